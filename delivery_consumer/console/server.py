"""The console's HTTP server: the standard library's HTTP server on a fixed
pool of worker threads, pages rendered on the server (HTML with inline SVG
and CSS, no script).

Routes: ``GET /`` status, chart and dead letters; ``GET /trace?q=ID`` an
eventId or articleId; ``GET /dead/confirm`` the confirmation step of an
action; ``POST /dead/requeue`` and ``POST /dead/purge``; ``GET /healthz``.
Actions need ``--allow-actions``, the form's CSRF token and a ``Host``
header naming this server; otherwise every POST is refused (403).

Under load (docs/console.md): a listen backlog, a bounded pool of workers, a
deadline for each request's head and body, the status page and dead-queue
reads shared between concurrent requests for a few seconds.
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from html import escape
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from ..amqp.topology import Topology
from ..model import durations
from ..model.envelope import is_event_id
from ..model.errors import DeliveryError, NotFound
from ..model.plural import count
from ..ops import system_view
from ..ops.deadletters import SharedReads
from ..ops.deployment import Deployment
from . import chart

log = logging.getLogger("delivery_consumer.console")

#: Largest POST body read (a form with a few fields).
MAX_FORM_BYTES = 16 * 1024
#: Worker threads that answer requests (at most this many at once), and
#: accepted connections waiting for one; more wait in the listen backlog.
WORKERS, PENDING, BACKLOG = 8, 64, 512
#: A request's line, headers and body must arrive within this many seconds
#: of its connection's acceptance; one that had begun to arrive when it got
#: a worker after that gets LATE_READ_S more.
REQUEST_DEADLINE_S, LATE_READ_S = 10.0, 0.5
#: How long the status page and a dead queue's read are shared, in seconds.
STATUS_TTL_S, DEAD_TTL_S = 2.0, 5.0

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}
header{background:#263238;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#fff;text-decoration:none;font-weight:600}
header form{margin-left:auto}
header input[type=search]{width:22em}
main{padding:8px 16px}
table{border-collapse:collapse;margin:4px 0 12px}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.bad{color:#b71c1c;font-weight:600}.ok{color:#1b5e20;font-weight:600}
.key{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}
.mode{font-size:12px;padding:2px 6px;border-radius:3px;background:#455a64}
.mode.on{background:#b71c1c}
code{font-size:12px}
section{margin-bottom:18px}
button{cursor:pointer}
"""


def _e(value: Any) -> str:
    return "-" if value is None else escape(str(value))


def _table(columns: list[str], rows: list[list[Any]], *, numeric: set[int] | None = None,
           raw: set[int] | None = None) -> str:
    numeric, raw = numeric or set(), raw or set()
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(
        f'<td{" class=n" if i in numeric else ""}>{v if i in raw else _e(v)}</td>' for i, v in enumerate(row))
        + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _ago(age: float | None, at: str | None) -> str:
    """An age (what an operator compares with the clock), the time itself on hover."""
    if age is None:
        return "-"
    return f'<span title="{_e(at)}">{escape(durations.age(age))} ago</span>'


def _queue_state(row: dict[str, Any]) -> str:
    """The row's queue state in a word (system_view.queue_word), marked bad unless ``ok``."""
    word = system_view.queue_word(row)
    if word is None:
        return "-"
    return f'<span class="{"ok" if word == "ok" else "bad"} queue-state">{escape(word)}</span>'


class Recent:
    """The last value of *build*, shared by every thread for *ttl_s* seconds.

    One thread builds at a time; those that ask meanwhile wait for its value.
    A failure is not kept: the next thread to ask builds again.
    """

    def __init__(self, build: Callable[[], str], ttl_s: float) -> None:
        self._build = build
        self.ttl_s = ttl_s
        self._cond = threading.Condition()
        self._value: str | None = None
        self._at = 0.0
        self._building = False
        #: Values built (for tests and benchmarks).
        self.builds = 0

    def get(self) -> str:
        with self._cond:
            while True:
                if self._value is not None and time.monotonic() - self._at <= self.ttl_s:
                    return self._value
                if not self._building:
                    self._building = True
                    break
                self._cond.wait()
        value = None
        try:
            value = self._build()
            self.builds += 1
            return value
        finally:
            with self._cond:
                self._building = False
                if value is not None:
                    self._value, self._at = value, time.monotonic()
                self._cond.notify_all()

    def forget(self) -> None:
        with self._cond:
            self._value = None


class Console:
    """What the pages need: the deployment, the mode, the CSRF token, the minute cache."""

    def __init__(self, dep: Deployment, *, allow_actions: bool = False, window_s: float = 3 * 3600,
                 broker_timeout_s: float = system_view.BROKER_TIMEOUT_S) -> None:
        self.dep = dep
        self.broker_timeout_s = broker_timeout_s
        self.allow_actions = allow_actions
        self.window_s = window_s
        self.token = secrets.token_urlsafe(32)
        self.minutes = chart.MinuteCache()
        #: Dead-queue reads shared by concurrent pages; never waiting for a dead command's hold.
        self.dead = SharedReads(DEAD_TTL_S)
        self.status = Recent(self.build_status_page, STATUS_TTL_S)
        self.address = ""
        #: Host headers that name this console (a defence against DNS rebinding).
        self.hosts: set[str] = set()

    def warm(self) -> None:
        """Read the settled minutes of every database once (a background thread at start-up),
        so that the first page is as fast as the next ones."""
        for name in self.dep.consumers:
            for _partition, path, _topo in system_view.locations(self.dep, name):
                try:
                    with system_view.open_inbox(path, name) as db:
                        self.minutes.minutes(db, self.window_s)
                except DeliveryError:
                    continue  # the page says what is wrong with it

    # -- layout ------------------------------------------------------------------------

    def page(self, title: str, body: str, query: str = "") -> str:
        mode = ('<span class="mode on">actions allowed</span>' if self.allow_actions
                else '<span class="mode">read-only</span>')
        return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · '
                f'delivery-consumer</title><style>{CSS}</style></head><body><header>'
                f'<a href="/">delivery-consumer</a>{mode}<span>{escape(str(self.dep.path))}</span>'
                f'<form action="/trace" method="get"><input type="search" name="q" id="q" value="{escape(query)}" '
                f'placeholder="eventId or key"> <button id="search">Trace</button></form></header>'
                f"<main><h1>{escape(title)}</h1>{body}</main></body></html>")

    # -- the status page ------------------------------------------------------------------

    def status_page(self) -> str:
        """The status page, built at most every STATUS_TTL_S seconds whatever the number of readers."""
        return self.status.get()

    def build_status_page(self) -> str:
        started = time.perf_counter()
        shown = system_view.status(self.dep, shared=self.dead, timeout_s=self.broker_timeout_s)
        parts = []
        if shown["healthy"]:
            parts.append('<p class="ok" id="verdict">healthy</p>')
        else:
            items = "".join(f"<li>{_e(p)}</li>" for p in shown["problems"])
            below = ('<p><a href="#dead">the dead letters, by code, are below</a></p>'
                     if any(item.get("deadGroups") for item in shown["consumers"]) else "")
            parts.append(f'<div id="verdict"><p class="bad">needs a person</p><ul>{items}</ul>{below}</div>')
        rows = []
        for item in shown["consumers"]:
            for db in item["databases"]:
                label = item["consumer"] + (f"/{db['partition']}" if db["partition"] else "")
                rows.append([label, db["ready"], db["unacked"], db["consumersConnected"], db["deadLetters"],
                             db.get("receiptsLastMinute"), db.get("receiptsLastHour"),
                             _ago(db.get("newestAgeSeconds"), db.get("newestReceivedAt")),
                             None if db.get("unresolvedRejections") is None
                             else sum(db["unresolvedRejections"].values()),
                             _queue_state(db), db.get("leader"), system_view.online_text(db),
                             _e(system_view.notes(db))])
            unrouted = item.get("unrouted")
            if unrouted and unrouted["ready"]:
                rows.append([f"{item['consumer']}/unrouted", unrouted["ready"], None, None, None, None, None, "-",
                             None, "-", None, None,
                             f'<span class="bad">{_e(unrouted["queue"])}: reached no partition</span>'])
        broker = shown["broker"]
        unknown = ('<p id="management"><small>leaders and members online unknown: no management API given '
                   "(--management-url, $DELIVERY_MANAGEMENT_URL or the file's management_url); each queue's "
                   "readability is shown</small></p>"
                   if broker is not None and broker.get("management") is None else "")
        parts.append('<section id="consumers"><h2>Consumers</h2>' + _table(
            ["consumer", "ready", "unacked", "consumers", "dead letters", "last minute", "last hour", "newest receipt",
             "unresolved", "queue", "leader", "online", "note"], rows, numeric={1, 2, 3, 4, 5, 6, 8},
            raw={7, 9, 12}) + unknown + "</section>")
        prows = [[p["producer"], p.get("unpublished"),
                  _ago(p.get("oldestPendingAgeSeconds"), p.get("oldestPendingAt")), p.get("failed"),
                  p.get("quarantined"), p.get("lastPublishedAt"), system_view.notes(p)] for p in shown["producers"]]
        if prows:
            parts.append("<section><h2>Producers</h2>" + _table(
                ["producer", "unpublished", "oldest pending", "with errors", "quarantined", "last published",
                 "note"], prows, numeric={1, 3, 4}, raw={2}) + "</section>")
        parts.append(self._charts())
        parts.append(self._dead_letters(shown))
        elapsed = (time.perf_counter() - started) * 1000
        parts.append(f'<p><small>at {_e(shown["now"])}, built in <span id="built-ms">{elapsed:.0f}</span> ms'
                     "</small></p>")
        return self.page("Status", "".join(parts))

    def _charts(self) -> str:
        window = durations.format(self.window_s)
        parts = [f"<section><h2>Outcomes per minute, last {window}</h2><p>{chart.legend()}</p>"]
        now = time.time()
        for name in self.dep.consumers:
            for partition, path, _topo in system_view.locations(self.dep, name):
                label = name + (f"/{partition}" if partition else "")
                if not path.exists():
                    parts.append(f"<h3>{_e(label)}</h3><p>no database yet</p>")
                    continue
                try:
                    with system_view.open_inbox(path, name) as db:
                        minutes = self.minutes.minutes(db, self.window_s, now)
                except DeliveryError as exc:
                    parts.append(f"<h3>{_e(label)}</h3><p class=bad>{_e(exc)}</p>")
                    continue
                total = ", ".join(f"{n} {c}" for c, n in chart.totals(minutes).items()) or "nothing"
                parts.append(f"<h3>{_e(label)} <small>({_e(total)})</small></h3>"
                             + chart.svg(minutes, self.window_s, now))
        return "".join(parts) + "</section>"

    def _dead_letters(self, shown: dict[str, Any]) -> str:
        parts = ['<section id="dead"><h2>Dead letters</h2>']
        any_letters = False
        for item in shown["consumers"]:
            for db in item["databases"]:
                groups = db.get("deadGroups") or []
                if not groups:
                    continue
                any_letters = True
                label = item["consumer"] + (f"/{db['partition']}" if db["partition"] else "")
                parts.append(f"<h3>{_e(label)} <small>{_e(db['deadQueue'])}</small></h3>")
                rows = []
                for group in groups:
                    reasons = "<br>".join(_e(r) for r in group["reasons"])
                    ids = " ".join(f'<a href="/trace?{urlencode({"q": i})}"><code>{_e(i)}</code></a>'
                                   for i in group["eventIds"])
                    rows.append([group["code"], group["count"], reasons, ids,
                                 self._action_links(item["consumer"], db["partition"], code=group["code"])])
                parts.append(_table(["code", "count", "reasons", "eventIds", ""], rows, numeric={1},
                                    raw={2, 3, 4}))
        if not any_letters:
            parts.append("<p>none</p>")
        return "".join(parts) + "</section>"

    def _action_links(self, consumer: str, partition: str | None, *, code: str | None = None,
                      event_id: str | None = None) -> str:
        if not self.allow_actions:
            return ""
        out = []
        for action in ("requeue", "purge"):
            query = {"consumer": consumer, "action": action, **({"partition": partition} if partition else {}),
                     **({"code": code} if code else {}),
                     **({"event": event_id} if event_id else {})}
            out.append(f'<a class="action" href="/dead/confirm?{escape(urlencode(query))}">{action}…</a>')
        return " ".join(out)

    # -- trace ------------------------------------------------------------------------------

    def trace_page(self, query: str) -> tuple[HTTPStatus, str]:
        query = query.strip()
        if not query:
            return HTTPStatus.OK, self.page("Trace", "<p>give an eventId or a key (articleId, orderId ...)</p>")
        if is_event_id(query.lower()):  # a UUID, in any case: stored in lower case, as trace reads it
            query = query.lower()
        try:
            shown = system_view.trace_event(self.dep, query, shared=self.dead)
        except NotFound:
            try:
                keyed = system_view.trace_key(self.dep, query)
                return HTTPStatus.OK, self.page(f"{keyed['keyField']} {query}", self._article(keyed), query)
            except NotFound:
                return HTTPStatus.NOT_FOUND, self.page(
                    "Not found", f'<p class="bad" id="not-found">{_e(query)}: no producer and no consumer of this '
                                 "deployment knows this eventId or key</p>", query)
        return HTTPStatus.OK, self.page(f"Event {query}", self._event(shown), query)

    def _event(self, shown: dict[str, Any]) -> str:
        verdicts = [[i["consumer"] + (f"/{i['partition']}" if i["partition"] else ""), i["verdict"]]
                    for i in shown["consumers"]]
        parts = ['<section id="verdicts"><h2>Verdict</h2>' + _table(["consumer", "verdict"], verdicts) + "</section>"]
        rows = [[r["producer"], r.get("state"), r.get("createdAt"), r.get("publishedAt"), r.get("attempts"),
                 _e(r.get("error") or (None if r.get("publishedAt") else r.get("lastError"))),
                 "<br>".join(_e(line) for line in system_view.outbox_history(r)) or "-"] for r in shown["outbox"]]
        parts.append("<section><h2>Outbox</h2>" + (_table(
            ["producer", "state", "enqueued", "published at", "attempts", "last error", "history"], rows,
            numeric={4}, raw={5, 6}) if rows else "<p>no producer of the deployment has this eventId</p>")
            + "</section>")
        for item in shown["consumers"]:
            label = item["consumer"] + (f"/{item['partition']}" if item["partition"] else "")
            if item.get("home") is False and item["trace"] is None and "error" not in item \
                    and not (item.get("deadQueue") or {}).get("letters"):
                continue  # a partition that is not the article's: its verdict says so
            parts.append(f"<section><h2>{_e(label)}</h2>")
            trace = item["trace"]
            if trace is not None:
                receipt = trace["receipt"]
                d = trace["deliveries"]
                parts.append(_table(["receipt", "at", "deliveries", "redeliveries", "attempts", "crashes"], [[
                    receipt and receipt["result"], receipt and receipt["receivedAt"], d["deliveries"],
                    d["redeliveries"], d["attempts"], d["crashes"]]], numeric={2, 3, 4, 5}))
                if trace["rejections"]:
                    parts.append(_table(["rejection", "at", "reason", "copy", "resolved"], [
                        [r["code"], r["rejectedAt"], r["reason"], r["deadLetter"], r["resolvedAt"] or "no"]
                        for r in trace["rejections"]]))
            else:
                parts.append(f"<p>{_e(item.get('error') or item.get('note') or 'no receipt, delivery or rejection')}"
                             "</p>")
            dead = item.get("deadQueue") or {}
            for letter in dead.get("letters", []):
                parts.append(f'<p class="bad dead-letter">dead letter now in {_e(dead["queue"])}: '
                             f"{_e(letter['code'])}: {_e(letter['reason'])} "
                             f"{self._action_links(item['consumer'], item['partition'], event_id=shown['eventId'])}"
                             "</p>")
            if dead.get("error"):
                parts.append(f"<p>dead queue not read: {_e(dead['error'])}</p>")
            parts.append("</section>")
        return "".join(parts)

    def _article(self, shown: dict[str, Any]) -> str:
        labels = sorted({label for event in shown["events"] for label in event["consumers"]})
        rows = []
        for event in shown["events"]:
            box = event["outbox"]
            state = None if box is None else ("published " + box["publishedAt"] if box["publishedAt"]
                                              else f"unpublished {box['lastError'] or ''}")
            link = f'<a href="/trace?{urlencode({"q": event["eventId"]})}"><code>{_e(event["eventId"])}</code></a>'
            rows.append([event["revision"], link, _e(event["type"]), _e(state),
                         *(_e((event["consumers"].get(label) or {}).get("result")) for label in labels)])
        return _table(["revision", "eventId", "type", "outbox", *labels], rows, numeric={0},
                      raw=set(range(1, 4 + len(labels))))

    # -- actions ------------------------------------------------------------------------------

    def _place(self, form: dict[str, str]) -> tuple[str, system_view.Location, Topology]:
        """The consumer's database and queues the form names (a partition's, with ``partition``)."""
        consumer = form.get("consumer", "")
        if consumer not in self.dep.consumers:
            raise ValueError(f"unknown consumer {consumer!r}")
        partition = form.get("partition") or None
        for found, path, topo in system_view.locations(self.dep, consumer):
            if found == partition:
                return consumer, path, topo
        if partition is None:
            raise ValueError(f"{consumer} is partitioned: choose the dead letters of one partition")
        raise ValueError(f"{consumer} has no partition {partition!r}")

    def _selection(self, form: dict[str, str]) -> tuple[str, Any]:
        from ..ops.deadletters import Selection

        consumer = form.get("consumer", "")
        if consumer not in self.dep.consumers:
            raise ValueError(f"unknown consumer {consumer!r}")
        if form.get("event"):
            return consumer, Selection(event_ids=frozenset([form["event"]]))
        if form.get("code"):
            return consumer, Selection(code=form["code"])
        raise ValueError("choose the dead letters by code or eventId")

    def confirm_page(self, form: dict[str, str]) -> tuple[HTTPStatus, str]:
        action = form.get("action", "")
        if action not in ("requeue", "purge"):
            return HTTPStatus.BAD_REQUEST, self.page("Bad request", "<p>unknown action</p>")
        try:
            consumer, selection = self._selection(form)
            _, _, topo = self._place(form)
            snapshot = self.dead.list(self.dep.amqp_url, topo)
        except (ValueError, DeliveryError) as exc:
            return HTTPStatus.BAD_REQUEST, self.page("Cannot do that", f'<p class="bad">{_e(exc)}</p>')
        chosen = [letter for letter, _ in snapshot.select(selection)]
        rows = [[c.position, c.code, c.event_id, c.reason] for c in chosen]
        hidden = "".join(f'<input type="hidden" name="{k}" value="{escape(v)}">' for k, v in form.items()
                         if k in ("consumer", "partition", "code", "event"))
        verb = "Requeue" if action == "requeue" else "Purge for good"
        where = consumer + (f"/{form['partition']}" if form.get("partition") else "")
        letters = count(len(chosen), "dead letter")
        body = (f"<p>{letters} of <b>{_e(where)}</b> selected ({_e(selection.describe())}) in "
                f"{_e(snapshot.queue)}:</p>" + _table(["#", "code", "eventId", "reason"], rows, numeric={0})
                + f'<form method="post" action="/dead/{action}">{hidden}'
                f'<input type="hidden" name="csrf" value="{escape(self.token)}">'
                f'<button id="confirm" {"disabled" if not chosen else ""}>{verb} {letters}</button>'
                ' <a href="/">cancel</a></form>')
        return HTTPStatus.OK, self.page(f"Confirm: {action}", body)

    def act(self, action: str, form: dict[str, str]) -> tuple[HTTPStatus, str]:
        from ..ops import deadletters

        try:
            consumer, selection = self._selection(form)
            _, path, topo = self._place(form)
            with ExitStack() as stack:
                db = (stack.enter_context(system_view.open_inbox(path, consumer, readonly=False))
                      if path.exists() else None)
                dq, snapshot = stack.enter_context(deadletters.reading(self.dep.amqp_url, topo))
                if action == "requeue":
                    if db is None:
                        raise ValueError(f"{path}: no such database; requeue needs it")
                    report = deadletters.requeue(db, dq, snapshot, topo, selection)
                else:
                    report = deadletters.purge(db, dq, snapshot, selection)
        except (ValueError, DeliveryError) as exc:
            return HTTPStatus.CONFLICT, self.page("Not done", f'<p class="bad">{_e(exc)}</p>')
        finally:  # the queue (and maybe the status) changed: the next page reads it again
            self.dead.forget()
            self.status.forget()
        log.info("console %s %s (%s): %s", action, topo.queue, selection.describe(), report.counts())
        rows = [[i.outcome, i.letter.event_id, i.letter.code, i.detail] for i in report.items]
        rows += [["not-found", e, None, None] for e in report.missing]
        counts = ", ".join(f"{n} {k}" for k, n in sorted(report.counts().items())) or "nothing selected"
        return HTTPStatus.OK, self.page(f"Done: {action}", f'<p id="result">{_e(counts)}</p>'
                                        + _table(["outcome", "eventId", "code", "detail"], rows)
                                        + '<p><a href="/">back to the status</a></p>')

    def check_host(self, host: str | None) -> str | None:
        """Why a request is refused for its Host header (a page of another site, rebound by DNS to
        this address, must not read the pages either), or None."""
        if host not in self.hosts:
            return (f"the Host header {host!r} does not name this console (it answers to "
                    f"{', '.join(sorted(self.hosts))}; through ssh -L, keep the same port on both ends)")
        return None

    def check_post(self, host: str | None, form: dict[str, str]) -> str | None:
        """Why a POST is refused, or None."""
        if not self.allow_actions:
            return "read-only console: started without --allow-actions"
        wrong_host = self.check_host(host)
        if wrong_host:
            return wrong_host
        if not hmac.compare_digest(form.get("csrf", ""), self.token):
            return "missing or wrong CSRF token: start again from the confirmation page"
        return None


class _Deadline:
    """The request's stream, read against one deadline for the whole request: a
    client that sends its head a byte at a time cannot keep a worker longer."""

    def __init__(self, stream: Any, sock: socket.socket, deadline: float) -> None:
        self._stream = stream
        self._sock = sock
        self._deadline = deadline
        self._late = False

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            if self._late or not select.select([self._sock], [], [], 0)[0]:
                raise TimeoutError("the request did not arrive in time")
            # It arrived while waiting for a worker: read what is there, a little longer.
            self._late, left = True, LATE_READ_S
            self._deadline = time.monotonic() + left
        self._sock.settimeout(left)

    def readline(self, size: int = -1) -> bytes:
        self._arm()
        return bytes(self._stream.readline(size))

    def read(self, size: int = -1) -> bytes:
        self._arm()
        return bytes(self._stream.read(size))

    def close(self) -> None:
        self._stream.close()


def client_gone(sock: socket.socket) -> bool:
    """True when the client has closed its end (its request was read, nothing more is expected)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:  # reset by the client, or closed
        return True


def handler(console: Console) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "delivery-consumer-console"

        def setup(self) -> None:
            super().setup()
            deadline = getattr(getattr(self.server, "current", None), "deadline", None)
            self.rfile = _Deadline(self.rfile, self.connection,  # type: ignore[assignment]
                                   deadline or time.monotonic() + REQUEST_DEADLINE_S)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: HTTPStatus, html: str, content_type: str = "text/html; charset=utf-8") -> None:
            data = html.encode("utf-8")
            self.connection.settimeout(REQUEST_DEADLINE_S)  # for the answer: the request's deadline is past use
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; "
                             "img-src data:; form-action 'self'; frame-ancestors 'none'")
            self.end_headers()
            self.wfile.write(data)

        def _guard(self, work: Callable[[], tuple[HTTPStatus, str]]) -> None:
            if client_gone(self.connection):  # nobody would read the page
                log.debug("%s left before its page was built", self.address_string())
                self.close_connection = True
                return
            try:
                status, html = work()
            except Exception as exc:  # one page with one line, never a traceback to the browser
                log.exception("console page failed")
                status, html = HTTPStatus.INTERNAL_SERVER_ERROR, console.page("Error", f"<p>{_e(exc)}</p>")
            self._send(status, html)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            wrong_host = None if url.path == "/healthz" else console.check_host(self.headers.get("Host"))
            if wrong_host:
                self._send(HTTPStatus.FORBIDDEN, console.page("Refused", f'<p class="bad" id="refused">'
                                                                         f"{_e(wrong_host)}</p>"))
            elif url.path == "/":
                self._guard(lambda: (HTTPStatus.OK, console.status_page()))
            elif url.path == "/trace":
                self._guard(lambda: console.trace_page(query.get("q", "")))
            elif url.path == "/dead/confirm":
                if not console.allow_actions:
                    self._send(HTTPStatus.FORBIDDEN, console.page(
                        "Refused", '<p class="bad" id="refused">read-only console: started without '
                                   "--allow-actions</p>"))
                else:
                    self._guard(lambda: console.confirm_page(query))
            elif url.path == "/healthz":
                self._send(HTTPStatus.OK, "ok\n", "text/plain; charset=utf-8")
            else:
                self._send(HTTPStatus.NOT_FOUND, console.page("Not found", "<p>no such page</p>"))

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_FORM_BYTES:
                status = HTTPStatus.BAD_REQUEST if length < 0 else HTTPStatus.REQUEST_ENTITY_TOO_LARGE
                self._send(status, console.page("Refused", "<p>no form, or one too large</p>"))
                return
            raw = self.rfile.read(length).decode("utf-8", "replace")
            form = {k: v[-1] for k, v in parse_qs(raw).items()}
            why = console.check_post(self.headers.get("Host"), form)
            if why is not None:
                self._send(HTTPStatus.FORBIDDEN, console.page("Refused", f'<p class="bad" id="refused">{_e(why)}</p>'))
                return
            action = urlsplit(self.path).path.removeprefix("/dead/")
            if action not in ("requeue", "purge"):
                self._send(HTTPStatus.NOT_FOUND, console.page("Not found", "<p>no such action</p>"))
                return
            self._guard(lambda: console.act(action, form))

    return Handler


class PooledHTTPServer(HTTPServer):
    """An HTTP server answering on *workers* threads, never more.

    The accepting thread hands each connection to the pool through a queue of
    *pending* places; when it is full the accepting thread waits, and new
    connections wait in the kernel's listen backlog (``request_queue_size``).
    A request's deadline runs from its acceptance (``current.deadline`` in the
    worker that answers it), so slow clients queued behind slow clients are
    dropped at once instead of each holding a worker in turn.
    """

    request_queue_size = BACKLOG
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler_class: type[BaseHTTPRequestHandler], *,
                 workers: int = WORKERS, pending: int = PENDING) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler_class)
        self._jobs: queue.Queue[tuple[Any, Any, float] | None] = queue.Queue(maxsize=pending)
        self.current = threading.local()
        self._workers = [threading.Thread(target=self._work, name=f"console-worker-{i}", daemon=True)
                         for i in range(workers)]
        for worker in self._workers:
            worker.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._jobs.put((request, client_address, time.monotonic() + REQUEST_DEADLINE_S))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            request, client_address, self.current.deadline = job
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("request from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        while True:  # connections not yet answered: closed
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.shutdown_request(job[0])
        for _ in self._workers:
            with suppress(queue.Full):
                self._jobs.put_nowait(None)


def make_server(console: Console, host: str, port: int, *, workers: int = WORKERS) -> PooledHTTPServer:
    """Bind (port 0: any free port); ``console.address`` becomes ``host:port``."""
    server = PooledHTTPServer((host, port), handler(console), workers=workers)
    bound_port = server.server_address[1]
    console.address = f"{host}:{bound_port}" if ":" not in host else f"[{host}]:{bound_port}"
    console.hosts = {console.address}
    names = set()
    if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""):
        names |= {"127.0.0.1", "localhost", "[::1]"}
    if host in ("0.0.0.0", "::", ""):  # every address: the names this machine answers to
        names |= {socket.gethostname(), socket.getfqdn()}
        with suppress(OSError):
            names |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    console.hosts |= {f"{name}:{bound_port}" for name in names if name}
    return server


__all__ = ["Console", "PooledHTTPServer", "Recent", "client_gone", "make_server"]
