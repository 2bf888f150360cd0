"""The system view: one eventId (or key: articleId, orderId, ...) across the producer and every
consumer, and the health of the whole deployment.

Everything here reads: producer databases through :mod:`outbox`'s queries,
consumer databases read-only through :func:`trace.trace` and short
statements, dead queues through :func:`deadletters.list_dead` (every message
is given back in place), queue depths through a passive declare. The
functions return plain dicts for ``--json``, the text commands and the
console alike. Rationale in docs/system-view.md.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from .. import consumers as registry
from ..amqp.partitions import Identity, partition_of, partition_topology, unrouted_name
from ..amqp.topology import Topology, topic_matches
from ..inbox import reports
from ..inbox.history import trace as trace_one
from ..model.contract import dialect
from ..model.durations import age as age_text
from ..model.durations import format as format_duration
from ..model.errors import DeliveryError, NotFound
from ..model.plural import count as _count
from ..store.sqlite import now_iso
from .deployment import ConsumerEntry, Deployment

Row = dict[str, Any]

#: At most this many dead letters are read from one dead queue per look.
DEAD_SCAN_LIMIT = 10_000
#: Receipt windows of ``status``, in seconds.
MINUTE_S, HOUR_S = 60, 3600




@dataclass(frozen=True)
class PgInbox:
    """A consumer's inbox (or one partition's) in PostgreSQL, where the deployment file's ``db``
    is a ``postgresql://`` URL: the schema of the consumer (of the partition) there. Shown
    without the URL's password."""

    url: str
    consumer: str
    partition: Identity | None = None

    def exists(self) -> bool:
        """Whether the schema holds an inbox yet (True when the server cannot be asked: opening
        the inbox then says why)."""
        from ..inbox.pg import psycopg_module, schema_for, split_url

        psycopg = psycopg_module()
        base, named = split_url(self.url)
        schema = named or schema_for(self.consumer, self.partition)
        try:
            with psycopg.connect(base, connect_timeout=5) as conn:
                row = conn.execute("SELECT to_regclass(%s)", (f'"{schema}".meta',)).fetchone()
        except psycopg.Error:
            return True
        return row is not None and row[0] is not None

    def open(self, *, readonly: bool = True) -> Any:
        from ..inbox.pg import PgInboxDB

        return PgInboxDB.open(self.url, registry.get(self.consumer), readonly=readonly, partition=self.partition)

    def __str__(self) -> str:
        from ..inbox.pg import redact, schema_for, split_url

        base, named = split_url(self.url)
        return f"{redact(base)} (schema {named or schema_for(self.consumer, self.partition)})"


#: Where one database of a consumer is: a file, or a schema of a PostgreSQL database.
Location = Path | PgInbox


def locations(dep: Deployment, name: str) -> list[tuple[str | None, Location, Topology]]:
    """``(partition, database, queues)`` of each database of consumer *name*: its files, or when the
    deployment file's ``db`` is a PostgreSQL URL, the schema of each (``dc_<name>_p<K>of<N>``)."""
    placement = dep.placement(name)
    found = placement.topologies()
    url = dep.consumers[name].db
    if isinstance(url, Path):
        return list(found)
    count = placement.count()
    return [(partition, PgInbox(url, name, None if partition is None or count is None
                                else Identity(int(partition[1:]), count)), topo)
            for partition, _path, topo in found]


def _files(found: Sequence[tuple[str | None, Location, Topology]]) -> list[Path]:
    return [where for _partition, where, _topo in found if isinstance(where, Path)]


@contextmanager
def open_inbox(where: Location, consumer: str, *, readonly: bool = True) -> Iterator[Any]:
    """The inbox at *where* (a file, or a schema in PostgreSQL) open for the block."""
    if isinstance(where, PgInbox):
        db = where.open(readonly=readonly)
        try:
            yield db
        finally:
            db.close()
        return
    with registry.open_db(where, consumer, readonly=readonly) as db:
        yield db



def _label(entry: ConsumerEntry, partition: str | None) -> str:
    return f"{entry.name}/{partition}" if partition else entry.name


# -- dead letters ------------------------------------------------------------------------


def dead_letters(dep: Deployment, consumer: str, topo: Topology | None = None, *, shared: Any = None) -> Row:
    """The dead queue of *consumer* (of the partition *topo* names) as read now (or as
    *shared*, a :class:`deadletters.SharedReads`, read it lately):
    ``{"queue", "letters", "complete"}`` or ``{"error"}``."""
    from ..model.errors import BrokerError
    from .deadletters import list_dead

    topo = topo or registry.topology(consumer, dep.exchange, dep.queue_prefix)
    try:
        snapshot = (shared.list if shared is not None else list_dead)(dep.amqp_url, topo,
                                                                       max_messages=DEAD_SCAN_LIMIT)
    except BrokerError as exc:
        return {"queue": topo.dead_queue, "error": str(exc)}
    return {"queue": snapshot.queue, "letters": snapshot.letters,
            "complete": snapshot.complete and len(snapshot.letters) >= snapshot.count_at_open}


#: Reasons and eventIds shown per group of dead letters.
GROUP_SAMPLES = 5


def group_dead_letters(letters: list[Any]) -> list[Row]:
    """Dead letters grouped by code, largest group first: count, distinct reasons, some eventIds."""
    groups: dict[str, Row] = {}
    for letter in letters:
        group = groups.setdefault(letter.code, {"code": letter.code, "count": 0, "reasons": [], "eventIds": []})
        group["count"] += 1
        if letter.reason not in group["reasons"] and len(group["reasons"]) < GROUP_SAMPLES:
            group["reasons"].append(letter.reason)
        if letter.event_id and len(group["eventIds"]) < GROUP_SAMPLES:
            group["eventIds"].append(letter.event_id)
    return sorted(groups.values(), key=lambda g: (-g["count"], g["code"]))


# -- trace -------------------------------------------------------------------------------


def key_field(dep: Deployment, event_type: str | None) -> str | None:
    """The key field (``articleId``, ``orderId``, ...) of *event_type* as the
    deployment's consumers, else the producers' declared types, declare it."""
    from ..model.event_types import default_types

    if event_type is None:
        return None
    for name in dep.consumers:
        declared = registry.get(name).event_types.get(event_type)
        if declared is not None:
            return declared.key
    declared = default_types().get(event_type)
    return None if declared is None else declared.key


def _key_fields(dep: Deployment) -> set[str]:
    """Every key field the deployment's consumers declare."""
    return {t.key for name in dep.consumers for t in registry.get(name).event_types}


def _producer_exists(db: Path | str) -> bool:
    from .. import outbox

    return outbox.exists(db)


def _outbox_rows(dep: Deployment, event_id: str) -> list[Row]:
    from .. import outbox

    rows = []
    for name, producer in dep.producers.items():
        try:
            with closing(outbox.open_db(producer.db, readonly=True)) as conn:
                row = outbox.show(conn, event_id)
        except NotFound:
            continue
        except (DeliveryError, sqlite3.Error) as exc:
            rows.append({"producer": name, "database": outbox.display(producer.db), "error": str(exc)})
            continue
        body = row.pop("body", None)
        if isinstance(body, dict):
            field = key_field(dep, body.get("type")) or "articleId"
            row.update({k: body.get(k) for k in ("type", field, "revision")})
            row["keyField"] = field
        rows.append({"producer": name, "database": outbox.display(producer.db), **row})
    return rows


def outbox_history(row: Row) -> list[str]:
    """What happened to an outbox row besides publication, oldest first: quarantine,
    requeue, drop (only what did happen), and an error that publication later overcame."""
    events = []
    if row.get("quarantinedAt"):
        events.append((row["quarantinedAt"], f"quarantined at {row['quarantinedAt']}: {row.get('quarantineReason')}"))
    if row.get("requeuedAt"):
        events.append((row["requeuedAt"], f"requeued at {row['requeuedAt']} by {row.get('requeuedBy')}"))
    if row.get("droppedAt"):
        events.append((row["droppedAt"], f"dropped at {row['droppedAt']} by {row.get('droppedBy')}: "
                                         f"{row.get('dropReason')}"))
    lines = [text for _, text in sorted(events)]
    if row.get("publishedAt") and row.get("lastError") and row["lastError"] != row.get("quarantineReason"):
        lines.append(f"published after an error: {row['lastError']}")
    return lines


def _verdict(shown: Row | None, letters: list[Row], routed: bool, published: list[Row],
             unpublished: list[Row]) -> str:
    receipt = shown["receipt"] if shown is not None else None
    if receipt is not None:  # applied, whatever became of another copy
        verdict = f"applied {receipt['result']}"
        if letters:
            return f"{verdict}; another copy dead-lettered {letters[0]['code']} (still in the dead queue)"
        others = sorted({r["code"] for r in shown["rejections"] if r["resolvedAt"] is None}) if shown else []
        return f"{verdict}; another copy was rejected ({', '.join(others)})" if others else verdict
    if letters:
        return f"dead-lettered {letters[0]['code']}"
    if shown is not None:
        unresolved = [r for r in shown["rejections"] if r["resolvedAt"] is None]
        if unresolved:
            last = unresolved[-1]
            return f"rejected {last['code']}" + ("" if last["deadLetter"] else " (no dead-letter copy)")
        return f"{shown['status']}: {shown['summary']}"
    if not routed:
        return "not routed to this consumer"
    if published:
        return "published, not yet received"
    if unpublished:
        row = unpublished[0]
        if row.get("state") in ("quarantined", "dropped"):  # an outbox that has these states
            why = row.get("quarantineReason") or row.get("dropReason") or row.get("lastError")
            return f"not published: {row['state']}" + (f" ({why})" if why else "")
        error = row.get("lastError")
        return f"not published: {error}" if error else "not published yet"
    return "unknown here"


def trace_event(dep: Deployment, event_id: str, *, key: str | None = None,
                broker: bool = True, shared: Any = None) -> Row:
    """The whole story of *event_id*; :class:`NotFound` when nobody knows it."""
    outbox_rows = _outbox_rows(dep, event_id)
    known = [r for r in outbox_rows if "error" not in r]
    published = [r for r in known if r.get("publishedAt")]
    unpublished = [r for r in known if not r.get("publishedAt")]
    routing_key = next((r.get("routingKey") for r in known), None)
    result: Row = {"eventId": event_id, "deployment": str(dep.path), "outbox": outbox_rows, "consumers": []}
    found = bool(known)
    keyed = next((r for r in known if r.get(r.get("keyField") or "articleId")), None)
    field = (keyed or {}).get("keyField") or "articleId"
    article = None if keyed is None else str(keyed[field])
    for name in dep.consumers:
        spec = registry.get(name)
        routed = routing_key is None or any(topic_matches(k, routing_key) for k in spec.binding_keys)
        count = dep.placement(name).count()
        home = f"p{partition_of(article, count)}" if article is not None and count else None
        items: list[Row] = []
        for partition, path, topo in locations(dep, name):
            item: Row = {"consumer": name, "partition": partition, "database": str(path), "trace": None}
            letters: list[Row] = []
            if broker:
                dead = dead_letters(dep, name, topo, shared=shared)
                letters = [letter.to_json() for letter in dead.get("letters", [])
                           if event_id in (letter.event_id, letter.message_id)]
                found = found or bool(letters)
                item["deadQueue"] = {"queue": dead["queue"], "error": dead.get("error"),
                                     "complete": dead.get("complete"), "letters": letters}
            if not path.exists():
                item["note"] = "no database yet"
            else:
                try:
                    with open_inbox(path, name) as db:
                        item["trace"] = trace_one(db, event_id, key=key)
                except NotFound:
                    pass
                except DeliveryError as exc:
                    item["error"] = str(exc)
            found = found or item["trace"] is not None
            item["letters"] = letters
            items.append(item)
        if home is None and count:  # no outbox row told the key: the partition that knows the event
            home = next((i["partition"] for i in items if i["trace"] is not None or i["letters"]), None)
        for item in items:
            letters = item.pop("letters")
            if home is not None:
                item["home"] = item["partition"] == home
            if "error" in item:
                item["verdict"] = f"error: {item['error']}"
            elif item.get("home") is False and item["trace"] is None and not letters:
                item["verdict"] = (f"not this partition's key ({field} {article} lives in {home})" if article
                                   else f"not this partition's event (it is in {home})")
            elif "note" in item and not letters:  # no database yet: what the outbox row says, if any
                verdict = _verdict(None, [], routed, published, unpublished) if known else item["note"]
                item["verdict"] = f"{verdict} ({item['note']})" if verdict.startswith("published") else verdict
            else:
                item["verdict"] = _verdict(item["trace"], letters, routed, published, unpublished)
            result["consumers"].append(item)
    if not found:
        unread = [f"{i['consumer']}: {i['error']}" for i in result["consumers"] if "error" in i]
        unread += [f"producer {r['producer']}: {r['error']}" for r in outbox_rows
                   if "error" in r and _producer_exists(dep.producers[r["producer"]].db)]  # not created yet: no news
        raise NotFound(f"eventId {event_id} is known to no producer and no consumer of {dep.path}"
                       + (f"; not read: {'; '.join(unread)}" if unread else ""))
    return result


def cloudevent_matches(dep: Deployment, ce_id: str) -> list[Row]:
    """Every event a consumer of *dep* knows that came as a CloudEvent with the id *ce_id*:
    ``{"source", "eventId", "consumers"}``, one per source (the eventId is derived from both)."""
    from ..inbox.history import cloudevent_matches as matches_in

    found: dict[tuple[str, str], Row] = {}
    for name in dep.consumers:
        for partition, path, _topo in locations(dep, name):
            if not path.exists():
                continue
            try:
                with open_inbox(path, name) as db:
                    pairs = matches_in(db, ce_id)
            except DeliveryError:
                continue
            for source, event_id in pairs:
                row = found.setdefault((source, event_id), {"source": source, "eventId": event_id, "consumers": []})
                row["consumers"].append(f"{name}/{partition}" if partition else name)
    return list(found.values())


def trace_key(dep: Deployment, key: str) -> Row:
    """A key's events (an article's, an order's ...) across the producers and every consumer, by revision.
    ``keyField`` names the key's field as the events' types declare it."""
    from .. import outbox

    events: dict[str, Row] = {}
    for name, producer in dep.producers.items():
        try:
            with closing(outbox.open_db(producer.db, readonly=True)) as conn:
                rows = conn.execute(
                    "SELECT event_id, routing_key, body, created_at, published_at, attempts, last_error"
                    " FROM outbox WHERE ordering_key = ?", (key,)).fetchall()
        except (DeliveryError, sqlite3.Error):
            continue
        for event_id, routing_key, body, created, published, attempts, error in rows:
            parsed = orjson.loads(body)
            events.setdefault(event_id, {"revision": parsed.get("revision"),
                                         "type": parsed.get("type") or routing_key})["outbox"] = {
                "producer": name, "createdAt": created, "publishedAt": published, "attempts": attempts,
                "lastError": error}
    dbs = [(_label(entry, partition), name, path) for name, entry in dep.consumers.items()
           for partition, path, _topo in locations(dep, name) if path.exists()]
    for _, name, path in dbs:  # first every eventId of the key, from every database
        try:
            with open_inbox(path, name) as db:
                for event_id, seen in reports.key_rows(db, key).items():
                    known = events.setdefault(event_id, {"revision": seen.get("revision")})
                    known.setdefault("type", seen.get("type"))
                    if known.get("revision") is None:
                        known["revision"] = seen.get("revision")
        except DeliveryError:
            continue
    per_consumer: dict[str, dict[str, Row]] = {}
    for label, name, path in dbs:  # then each database's receipts of them
        try:
            with open_inbox(path, name) as db:
                per_consumer.setdefault(label, {}).update(reports.receipts_by_id(db, list(events)))
        except DeliveryError:
            continue
    if not events:
        raise NotFound(f"key {key} is known to no producer and no consumer of {dep.path}")
    out = []
    for event_id, known in events.items():
        out.append({"eventId": event_id, "revision": known.get("revision"), "type": known.get("type"),
                    "outbox": known.get("outbox"),
                    "consumers": {label: receipts.get(event_id) for label, receipts in per_consumer.items()}})
    out.sort(key=lambda e: (e["revision"] is None, e["revision"] or 0, e["eventId"]))
    found = {key_field(dep, known.get("type")) for known in events.values()} - {None}
    declared = _key_fields(dep)
    field = found.pop() if len(found) == 1 else declared.pop() if not found and len(declared) == 1 else "key"
    return {"key": key, "keyField": field, "deployment": str(dep.path), "events": out}


# -- status ------------------------------------------------------------------------------


def _consumer_db_status(db: Any, now: float) -> Row:
    return {**reports.status_figures(db, now), **_writer(db)}


#: A writer whose note was not touched for this long is named in status (it beats every second).
WRITER_SILENT_S = 10.0


def _writer(db: Any) -> Row:
    """Who holds the database as its note says (dbfile.WriterLock), and a note when that
    process is stopped or has not heartbeated for WRITER_SILENT_S: a frozen active."""
    from ..store import liveness
    from ..store.dbfile import read_note

    if dialect(db.conn) == "postgres":  # no writer lock there: several runs may share the inbox
        return {}
    pid, what, silent = read_note(db.path)
    if pid is None or silent is None:
        return {}
    state = liveness.process_state(pid, None)[0]
    row: Row = {"writer": {"pid": pid, "what": what, "heartbeatAgeSeconds": round(silent, 1), "state": state}}
    if state == liveness.STOPPED or (state != liveness.GONE and silent >= WRITER_SILENT_S):
        row["writerNote"] = (f"writer pid {pid}{f' ({what})' if what else ''} "
                             + ("is stopped (SIGSTOP?), " if state == liveness.STOPPED else "")
                             + f"no heartbeat for {silent:.0f}s: frozen? (docs/failures.md, \"A frozen active\")")
    return row


def unacknowledged(dep: Deployment, queue: str) -> int | None:
    """Unacknowledged messages of one queue from the management API, when the file names it
    (``status`` asks for every queue at once: :func:`management.queue_infos`)."""
    if not dep.management_url:
        return None
    import httpx

    from ..amqp.management import credentials, vhost_of

    base, auth = credentials(dep.management_url, dep.amqp_url)
    url = f"{base}/api/queues/{vhost_of(dep.amqp_url)}/{quote(queue, safe='')}"
    try:
        answer = httpx.get(url, auth=auth, timeout=5)
        answer.raise_for_status()
        value = answer.json().get("messages_unacknowledged")
    except (httpx.HTTPError, ValueError):
        return None
    return value if isinstance(value, int) else None


def _state(counts: dict[str, Any], queue: str) -> Any:
    """The queue's counts (a QueueCount), or None when it is missing or cannot be read."""
    from ..amqp.admin import QueueCount

    found = counts.get(queue)
    return found if isinstance(found, QueueCount) else None


def queue_rows(topo: Topology, counts: dict[str, Any], infos: dict[str, Any] | None) -> list[Row]:
    """Each queue of *topo* as asked: readable (True, False, or None when not asked or missing),
    why not, and what the management API tells (leader, members online, quorum lost) when asked."""
    from ..amqp.admin import Unreadable

    kinds = [(topo.queue, "main"), (topo.dead_queue, "dead"), (topo.handover_queue, "handover"),
             *((topo.retry_queue(i), "retry") for i in range(len(topo.retry_delays_ms)))]
    rows = []
    for queue, kind in kinds:
        found = counts.get(queue, "not asked")
        if kind == "handover" and found is None:
            continue  # made by a repartition only
        row: Row = {"queue": queue, "kind": kind,
                    "readable": None if found in (None, "not asked") else not isinstance(found, Unreadable),
                    "error": found.reason if isinstance(found, Unreadable) else None}
        if found is None:
            row["note"] = "no queue yet"
        info = None if infos is None else infos.get(queue)
        if info is not None:
            row.update(info.to_json())
            if info.down and row["readable"] is not True:
                row["readable"] = False
        rows.append(row)
    return rows


def _queue_figures(dep: Deployment, label: str, topo: Topology, counts: dict[str, Any], asked: bool,
                   problems: list[str], shared: Any = None, infos: dict[str, Any] | None = None) -> Row:
    """The figures of one consumer's (or partition's) queues, and the problems they show."""
    main, dead, handover = (_state(counts, q) for q in (topo.queue, topo.dead_queue, topo.handover_queue))
    waiting = handover.ready if handover else 0
    queues = queue_rows(topo, counts, infos) if asked else []
    first = queues[0] if queues else {}
    unacked = first.get("unacked") if main else None
    item: Row = {"queue": topo.queue, "deadQueue": topo.dead_queue,
                 "ready": main.ready + waiting if main else None,
                 "unacked": unacked if isinstance(unacked, int) else None,
                 "consumersConnected": main.consumers + (handover.consumers if handover else 0) if main else None,
                 "deadLetters": dead.ready if dead else None, "deadByCode": {}, "deadGroups": [],
                 "handover": {"queue": topo.handover_queue, "ready": waiting} if handover else None,
                 "queues": queues, "readable": first.get("readable") if asked else None,
                 "leader": first.get("leader"), "online": first.get("online"), "members": first.get("members"),
                 "quorumLost": first.get("quorumLost")}
    if asked and counts.get(topo.queue, "not asked") is None:
        item["queueNote"] = "no queue yet (topology declare)"
    unreadable = [q for q in queues if q["readable"] is False]
    lost = [q for q in queues if q.get("quorumLost")]
    if unreadable or lost:
        item["brokerNote"] = "; ".join(
            [f"{q['queue']} unreadable: {q['error'] or 'its node is ' + str(q.get('state'))}" for q in unreadable]
            + [f"{q['queue']}: quorum lost ({len(q['online'])}/{len(q['members'])} members online)" for q in lost
               if q not in unreadable])
    for q in unreadable:
        why = q["error"] or f"the management API says its state is {q.get('state')}"
        problems.append(f"{label}: queue {q['queue']} cannot be read: {why}")
    for q in lost:
        online = ", ".join(q["online"]) or "none"
        problems.append(f"{label}: queue {q['queue']} has lost its quorum: {len(q['online'])} of "
                        f"{len(q['members'])} members online ({online}); publishes to it are refused")
    if dead is not None and dead.ready:
        letters = dead_letters(dep, topo.consumer, topo, shared=shared)
        if "error" in letters:
            item["deadByCode"] = None
            item["deadNote"] = letters["error"]
        else:
            groups = group_dead_letters(letters["letters"])
            item["deadByCode"] = {g["code"]: g["count"] for g in groups}
            item["deadGroups"] = groups
        codes = ", ".join(f"{n} {c}" for c, n in (item["deadByCode"] or {}).items()) or "codes not read"
        problems.append(f"{label}: {_count(dead.ready, 'dead letter')} in {topo.dead_queue} ({codes})")
    if main is not None and item["ready"] > dep.backlog_max and item["consumersConnected"] == 0:
        where = [f"{topo.queue}"] if main.ready else []
        where += [f"{topo.handover_queue} (moved there by repartition, applied first)"] if waiting else []
        problems.append(f"{label}: {_count(item['ready'], 'message')} {'waits' if item['ready'] == 1 else 'wait'} "
                        f"in {' and '.join(where)} and no consumer is connected")
    return item


def _ghosts(dep: Deployment, label: str, item: Row, path: Location, problems: list[str]) -> None:
    """A backlog with consumers listed but no receipt for longer than ``receipt_max_age``:
    consumers the broker still lists (a channel on a lost node, a stuck run) that do not
    consume. With no receipt yet, the database's last write stands for the newest receipt;
    with no database, no run of ours ever started on it."""
    ready, consumers = item.get("ready"), item.get("consumersConnected")
    if ready is None or consumers is None or ready <= dep.backlog_max or consumers == 0:
        return
    newest = item.get("lastProgressAgeSeconds")
    since = "receipt"
    if newest is None:
        newest = _last_write_age(path)
        since = "receipt (none yet; the database was last written)"
    if newest is not None and newest <= dep.receipt_max_age_s:
        return
    item["stalledSeconds"] = None if newest is None else round(newest, 1)
    ago = "never" if newest is None else f"{age_text(newest)} ago"
    problems.append(f"{label}: {_count(ready, 'message')} ready in {item['queue']} with "
                    f"{_count(consumers, 'consumer')} listed, but the newest {since} {ago} (more than "
                    f"{format_duration(dep.receipt_max_age_s)}): ghost consumers (a channel on a lost broker node) "
                    "or a stuck run")


def _last_write_age(path: Location) -> float | None:
    """Seconds since the database (or its write-ahead log) was last written; None without one
    (or in PostgreSQL, which tells no file's time). An empty log is a reader's (opening a
    database creates it), not a write."""
    if not isinstance(path, Path):
        return None
    wal = Path(f"{path}-wal")
    times = [p.stat().st_mtime for p in (path, wal) if p.exists() and (p != wal or p.stat().st_size)]
    return max(0.0, time.time() - max(times)) if times else None


def _former_queues(dep: Deployment, name: str, found: list[tuple[str | None, Location, Topology]]) -> dict[str, str]:
    """Queue -> what it served, of the layout a consumer had before its last repartition (stranded
    there: nothing consumes them): the unpartitioned queues of a partitioned consumer, those of the
    partitions its databases' former count had beyond the current one (every partition's, and the
    unrouted queue, for a consumer merged back into one), each with its handover queue."""
    from .partition_databases import repartitioned_from

    base = dep.placement(name).topology()
    partitioned = any(partition for partition, _, _ in found)
    out: dict[str, str] = {}
    if partitioned:
        out.update({q: "the unpartitioned consumer" for q in _queues_of(base)})
    try:
        former = next((repartitioned_from(path) for path in _files(found) if path.exists()), None)
    except DeliveryError:
        former = None
    if former is not None and former.isdigit():
        for k in range(len(found) if partitioned else 0, int(former)):
            out.update({q: f"its former {former} partitions" for q in _queues_of(partition_topology(base, k))})
        if not partitioned:
            out[unrouted_name(base)] = f"its former {former} partitions"
    return out


def _queues_of(topo: Topology) -> list[str]:
    return [*(q for q, _ in topo.queues()), topo.handover_queue]


def _layout_problems(dep: Deployment, name: str, found: list[tuple[str | None, Location, Topology]],
                     former: dict[str, str], counts: dict[str, Any], problems: list[str]) -> None:
    """Messages a repartition strands or misplaces: in a queue of the former layout, nothing consumes
    them; while one has not finished, the queues it shares with the former layout hold messages routed
    by the former count (the runs refuse to start until it has moved them)."""
    from .partition_databases import pending_layout, pending_words

    partitioned = any(partition for partition, _, _ in found)
    now, option = pending_words(str(len(found)) if partitioned else "unpartitioned")
    now = f"its {now}" if partitioned else "the unpartitioned consumer"
    again = f"delivery-consumer repartition --consumer {name} {option}"
    try:
        pending = next((p for path in _files(found) if path.exists() and (p := pending_layout(path))), None)
    except DeliveryError:
        pending = None
    if pending is not None:
        queues = [*former, *(q for _, _, topo in found for q in (topo.queue, *(
            topo.retry_queue(i) for i in range(len(topo.retry_delays_ms)))))]
        held = sum(state.ready for q in dict.fromkeys(queues) if (state := _state(counts, q)) is not None)
        problems.append(f"{name}: its repartition to {pending_words(pending)[0]} has not finished: its runs refuse to "
                        f"start, and what its queues hold ({_count(held, 'message')}) was routed by the former "
                        f"layout and is not in its partitions' handover queues yet; {again}")
        return
    for queue, what in former.items():
        left = _state(counts, queue)
        if left is not None and left.ready:
            problems.append(
                f"{name}: {_count(left.ready, 'message')} in {queue}, a queue of {what}, not of {now}: nothing "
                f"consumes it; {again} moves them to their partitions")


def notes(row: Row) -> str | None:
    """What a status row has to say besides its figures, in a few words."""
    if row.get("error"):
        return str(row["error"])
    found = [row[key] for key in ("note", "queueNote", "brokerNote", "deadNote", "writerNote") if row.get(key)]
    return "; ".join(found) or None


def queue_word(row: Row) -> str | None:
    """A status row's queue state in a word: ``ok``, ``UNREADABLE``, ``NO QUORUM``, ``GHOSTS``;
    None when the broker was not asked or the queue does not exist yet."""
    queues = row.get("queues") or []
    if any(q["readable"] is False for q in queues):
        return "UNREADABLE"
    if any(q.get("quorumLost") for q in queues):
        return "NO QUORUM"
    if "stalledSeconds" in row:
        return "GHOSTS"
    return "ok" if row.get("readable") else None


def online_text(row: Row) -> str | None:
    """``online/members`` of a status row's main queue (a quorum queue, management API asked)."""
    members = row.get("members")
    return f"{len(row.get('online') or [])}/{len(members)}" if members else None


def _total(values: list[Any]) -> int | None:
    """The sum, or None (unknown) when any part is unknown."""
    return None if not values or any(v is None for v in values) else sum(values)


#: Each broker call of ``status`` (the connection, each passive declare, the management API) must answer within this.
BROKER_TIMEOUT_S = 5.0


def status(dep: Deployment, *, now: float | None = None, broker: bool = True, shared: Any = None,
           timeout_s: float = BROKER_TIMEOUT_S) -> Row:
    """Every consumer (every partition) and producer of *dep*, and the problems that need a person
    (dead queues read through *shared*, a :class:`deadletters.SharedReads`, when given). Each
    broker call answers within *timeout_s* or its queue is shown unreadable."""
    from .. import outbox
    from ..amqp.admin import Unreadable, queue_states
    from ..amqp.management import ManagementError, credentials, queue_infos

    now = time.time() if now is None else now
    problems: list[str] = []
    counts: dict[str, Any] = {}
    broker_error = None
    infos: dict[str, Any] | None = None
    management: Row | None = None
    layout = {name: locations(dep, name) for name in dep.consumers}
    partitioned = {name for name, found in layout.items() if any(partition for partition, _, _ in found)}
    former = {name: _former_queues(dep, name, layout[name]) for name in dep.consumers}
    if broker and dep.consumers:
        queues = [q for found in layout.values() for _, _, topo in found
                  for q in (topo.queue, topo.dead_queue, topo.handover_queue, *(
                      topo.retry_queue(i) for i in range(len(topo.retry_delays_ms))))]
        queues += [unrouted_name(dep.placement(name).topology()) for name in partitioned]
        queues += [q for found in former.values() for q in found]
        counts = queue_states(dep.amqp_url, queues, timeout_s=timeout_s)
        reasons = {state.reason for state in counts.values() if isinstance(state, Unreadable)}
        if len(reasons) == 1 and all(isinstance(state, Unreadable) for state in counts.values()):
            broker_error = reasons.pop()  # not one queue answered: the broker itself
            problems.append(f"broker: {broker_error}")
            counts = {}
        if dep.management_url:
            management = {"url": credentials(dep.management_url, dep.amqp_url)[0], "error": None}
            try:
                infos = queue_infos(dep.management_url, dep.amqp_url, timeout_s=timeout_s)
            except ManagementError as exc:
                management["error"] = str(exc)
                problems.append(f"management API: {exc}")
    asked = broker and broker_error is None
    out_consumers = []
    for name, entry in dep.consumers.items():
        item: Row = {"consumer": name, "partitions": len(layout[name]) if name in partitioned else None}
        item["databases"] = []
        for partition, path, topo in layout[name]:
            label = _label(entry, partition)
            db_item: Row = {"partition": partition, "database": str(path)}
            db_item.update(_queue_figures(dep, label, topo, counts, asked, problems, shared, infos))
            if not path.exists():
                db_item["note"] = "no database yet"
            else:
                try:
                    with open_inbox(path, name) as db:
                        db_item.update(_consumer_db_status(db, now))
                except DeliveryError as exc:
                    db_item["error"] = str(exc)
                    problems.append(f"{label}: {db_item['error']}")
                unresolved = db_item.get("unresolvedRejections") or {}
                if unresolved and not asked:
                    # The dead queue was not read: the database's unresolved rejections are what is known.
                    codes = ", ".join(f"{n} {code}" for code, n in unresolved.items())
                    problems.append(f"{label}: {_count(sum(unresolved.values()), 'unresolved rejection')} ({codes}); "
                                    "the broker was not asked for its dead letters")
            if asked:
                _ghosts(dep, label, db_item, path, problems)
            item["databases"].append(db_item)
        rows = item["databases"]
        # the consumer as a whole: its own queues, or the sums over its partitions
        item["queue"] = rows[0]["queue"] if name not in partitioned else None
        item["deadQueue"] = rows[0]["deadQueue"] if name not in partitioned else None
        for key in ("ready", "unacked", "consumersConnected", "deadLetters"):
            item[key] = _total([row[key] for row in rows])
        by_code: dict[str, int] = {}
        for row in rows:
            for code, n in (row["deadByCode"] or {}).items():
                by_code[code] = by_code.get(code, 0) + n
        item["deadByCode"] = None if any(row["deadByCode"] is None for row in rows) else by_code
        item["unrouted"] = None
        if name in partitioned:
            queue = unrouted_name(dep.placement(name).topology())
            waiting = _state(counts, queue)
            item["unrouted"] = {"queue": queue, "ready": waiting.ready if waiting else None}
            if waiting is not None and waiting.ready:
                problems.append(f"{name}: {_count(waiting.ready, 'message')} in {queue} reached no partition "
                                f"(no slot header?); after the fix: delivery-consumer reroute --consumer {name}")
        for row in rows:
            if row.get("forwardedLastHour"):
                problems.append(
                    f"{_label(entry, row['partition'])}: {_count(row['forwardedLastHour'], 'event')} of other "
                    f"partitions reached {row['queue']} in the last hour (the last at {row['lastForwardedAt']}) and "
                    "went on to their own: a producer computing another slot, or bindings that disagree with the "
                    "partition count")
        if asked:
            _layout_problems(dep, name, layout[name], former[name], counts, problems)
        out_consumers.append(item)
    out_producers = []
    for name, producer in dep.producers.items():
        p_item: Row = {"producer": name, "database": outbox.display(producer.db)}
        if not outbox.exists(producer.db):
            p_item["note"] = "no database yet"
            out_producers.append(p_item)
            continue
        try:
            with closing(outbox.open_db(producer.db, readonly=True)) as conn:
                stats = outbox.stats(conn, now=now)
        except (DeliveryError, sqlite3.Error) as exc:
            p_item["error"] = str(exc)
            problems.append(f"producer {name}: {exc}")
            out_producers.append(p_item)
            continue
        p_item.update({k: v for k, v in stats.items() if k != "database"})
        age = stats.get("oldestPendingAgeSeconds")
        if age is not None and age > dep.outbox_max_age_s:
            problems.append(f"producer {name}: {_count(stats['pending'], 'pending row')}, the oldest "
                            f"{age_text(age)} old (more than {format_duration(dep.outbox_max_age_s)}): "
                            "is dispatch running?")
        quarantined = stats.get("quarantined")
        if isinstance(quarantined, int) and quarantined:
            problems.append(f"producer {name}: {_count(quarantined, 'quarantined outbox row')}")
        out_producers.append(p_item)
    return {"deployment": str(dep.path), "now": now_iso(now), "healthy": not problems, "problems": problems,
            "broker": {"url": _redacted(dep.amqp_url), "error": broker_error, "timeoutSeconds": timeout_s,
                       "management": management} if broker else None,
            "consumers": out_consumers, "producers": out_producers}


def _redacted(url: str) -> str:
    from ..amqp.connection import redact

    return redact(url)


__all__ = [
    "Location",
    "PgInbox",
    "cloudevent_matches",
    "dead_letters",
    "group_dead_letters",
    "locations",
    "notes",
    "online_text",
    "open_inbox",
    "outbox_history",
    "queue_rows",
    "queue_word",
    "status",
    "topic_matches",
    "trace_event",
    "trace_key",
    "unacknowledged",
]
