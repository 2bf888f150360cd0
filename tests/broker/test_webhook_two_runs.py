"""The fence with two runs: two real ``run`` processes of the webhook consumer on one database,
the local endpoint of webhook_server.py counting the calls per key, and a kill -9 of one run's
main PID while its call is under way (the endpoint made the effect and holds the answer).

On PostgreSQL both runs consume one queue and share the inbox (the fence's advisory locks keep
them apart); on SQLite the second is the standby of a partition (one writer per file) and takes
over. Either way: each key's effect once, each key called once (an idempotent endpoint: the key
killed mid-call once more, with the same key), revisions notified in order, every event one
receipt, nothing left in the queues.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, RunProcess, kill, session_processes
from partitionkit import Cluster, make_events
from support import read_rows, wait_until
from webhook_server import WebhookServer

#: A first retry delay longer than the read timeout, which outlasts the killed run's grace (2 s).
SLOW = ("--retry-delays", "6s,10s", "--webhook-read-timeout", "5", "--batch", "5", "--prefetch", "5")
ARTICLES, REVISIONS = 10, 6
#: The request held while its run is killed: well into the stream.
HOLD_AT = 25


@dataclass
class Place:
    """Where the two runs keep the webhook's inbox, and how the test reads it."""

    start: Callable[..., RunProcess]
    rows: Callable[[str, str], list[tuple[Any, ...]]]
    db_args: list[str]
    queues: list[str]
    #: Both runs consuming (PostgreSQL) or the second standing by (SQLite).
    second_ready: Callable[[RunProcess], bool]
    #: Both runs take deliveries (PostgreSQL): they are started before the stream is published.
    shared: bool
    #: Send the dead letters back to the consumer's queue.
    requeue: Callable[[dict[str, str]], None]


def _pg_place(ns: Namespace, url: str, env: dict[str, str]) -> Place:
    import psycopg

    def rows(table: str, columns: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(url, autocommit=True) as conn:
            return [tuple(r) for r in conn.execute(f"SELECT {columns} FROM dc_webhook.{table}").fetchall()]

    def start(*args: str) -> RunProcess:
        return ns.start_run("webhook", "--db", url, *SLOW, *args, env=env)

    topo = ns.topology("webhook")

    def consumers() -> int:
        conn, ch = ns.channel()
        try:
            return int(ch.queue_declare(topo.queue, passive=True).method.consumer_count)
        except Exception:  # not declared yet (the channel is closed by the broker)
            return 0
        finally:
            if conn.is_open:
                conn.close()

    def requeue(_env: dict[str, str]) -> None:
        # dead requeue reads a SQLite inbox only (docs/postgres-inbox.md): the letters are moved by hand.
        ns.publish([body for _props, body in ns.drain(topo.dead_queue)])

    return Place(start, rows, ["--consumer", "webhook", "--db", url], [topo.queue, topo.dead_queue],
                 lambda _second: consumers() == 2, True, requeue)


def _sqlite_place(ns: Namespace, env: dict[str, str]) -> Place:
    cluster = Cluster(ns, "webhook", 1)
    cluster.declare()
    db: Path = cluster.db(0)
    part = ("--partition", "0", "--partitions", "1")

    def start(*args: str) -> RunProcess:
        return ns.start_run("webhook", *part, "--db", str(db), *SLOW, *args, env=env)

    def requeue(env: dict[str, str]) -> None:
        _cli(ns, env, "dead", "requeue", "--consumer", "webhook", "--partition", "0", "--all")

    topo = ns.topology("webhook", partition=0)
    return Place(start, lambda table, columns: read_rows(db, table, columns), ["--db", str(db)],
                 [topo.queue, topo.dead_queue], lambda second: "standby: waiting" in second.output()[1], False,
                 requeue)


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "not-idempotent"])
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_fence_with_two_runs_and_a_kill_9_mid_call(
    ns: Namespace, backend: str, idempotent: bool, request: pytest.FixtureRequest
) -> None:
    """Two runs of the webhook on one database and one queue (SQLite: the active and its standby);
    the active one's main PID is killed while the endpoint holds the answer of a call it made. The
    endpoint's ledger: one effect per key; the calls per key are the fence's count (an idempotent
    endpoint: only keys in doubt at the kill called twice, with their key; one that is not: every
    key once, the keys in doubt dead-lettered outcome-unknown, resolved by hand with the provider's
    id and requeued); every event one receipt; each article's revisions notified in order, its
    last one notified; the queues empty."""
    with WebhookServer(idempotent=idempotent, delay_s=0.005) as server:
        env = ns.env(DELIVERY_WEBHOOK_URL=server.url)
        flag = [] if idempotent else ["--no-endpoint-idempotent"]
        place = (_pg_place(ns, str(request.getfixturevalue("pg_url")), env) if backend == "postgres"
                 else _sqlite_place(ns, env))
        events = make_events(ARTICLES * REVISIONS, ARTICLES, seed=5)
        for e in events:
            e["type"] = "material.published"
        # Each event twice in a row: on one queue the copies go to either run, both at once.
        stream = _ndjson(ns.workdir, [e for e in events for _ in "ab"])
        server.hold_at = HOLD_AT
        if place.shared:
            ns.publish([], declare=["webhook"])
            runs = [place.start("--exit-when-idle", "3", *flag) for _ in "ab"]
            wait_until("both runs consuming", lambda: place.second_ready(runs[1]), 60, runs)
            _cli(ns, env, "publish", "--consumer", "webhook", str(stream))
            wait_until("a call held by the endpoint", server.holding.is_set, 120, runs)
            killed = _caller(runs, server.held_port)
            (survivor,) = [r for r in runs if r is not killed]
        else:
            _cli(ns, env, "publish", "--consumer", "webhook", str(stream))
            killed = place.start(*flag)
            wait_until("a call of the active run held by the endpoint", server.holding.is_set, 120, [killed])
            survivor = place.start("--exit-when-idle", "3", *flag)
            wait_until("the standby waiting", lambda: place.second_ready(survivor), 60, [survivor])
        kill(killed, main_only=True)  # between the call (its effect made) and the commit
        server.release.set()
        done = survivor.until_idle(180)
        assert 0 == done.returncode, done.stderr
        held = server.held
        assert held is not None

        in_doubt = orjson.loads(_cli(ns, env, "fence", "list", *place.db_args, "--in-doubt", "--json"))
        if not idempotent:  # a person asks the provider, then requeues
            assert held in {row["key"] for row in in_doubt}
            for row in in_doubt:
                provider = server.first_id(row["key"])
                assert provider is not None  # each was called: the endpoint has its effect
                _cli(ns, env, "fence", "resolve", row["key"], "--provider-id", provider, *place.db_args)
            place.requeue(env)
            again = place.start("--exit-when-idle", "3", *flag).until_idle(180)
            assert 0 == again.returncode, again.stderr
        else:
            assert [] == in_doubt

        fences = {str(r[0]): r for r in place.rows("fence", "key, state, calls, provider_id, event_id")}
        calls, effects = server.calls(), server.effects()
        assert set(effects.values()) == {1}, "a key's effect made twice"
        assert {k for k, r in fences.items() if r[1] == "done"} == set(effects)
        assert all(fences[k][3] == server.first_id(k) for k in effects)
        assert all(n <= fences[k][2] for k, n in calls.items()), "a call the fence did not count"
        if idempotent:  # called again: only keys of the killed run's last batch (5 deliveries)
            assert 2 == calls[held], "the key killed mid-call is called again with its key"
            assert sum(n - 1 for n in calls.values()) <= 5 and set(calls.values()) <= {1, 2}, calls
        else:
            assert {1} == set(calls.values()), "a key called twice"
        notified: dict[str, list[int]] = defaultdict(list)
        for req in server.requests:
            if req.effect:
                notified[str(req.body["articleId"])].append(int(req.body["revision"]))
        for article, revisions in notified.items():
            assert revisions == sorted(revisions) and revisions[-1] == REVISIONS, (article, revisions)
        assert len(notified) == ARTICLES
        receipts = dict(place.rows("inbox", "event_id, result"))
        assert {str(e["eventId"]) for e in events} == set(receipts)
        assert set(receipts.values()) <= {"notified", "stale", "already-notified"}
        assert [0, 0] == [ns.count(q) for q in place.queues]


def _caller(runs: list[RunProcess], port: int | None) -> RunProcess:
    """The run one of whose processes has the TCP connection from local *port* (the held call's)."""
    inode = next(line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[1] == f"0100007F:{port:04X}")
    for run in runs:
        for pid in session_processes(run.pid):
            fds = Path(f"/proc/{pid}/fd")
            if any(_link(fd) == f"socket:[{inode}]" for fd in fds.iterdir()):
                return run
    raise AssertionError(f"no run has the connection from port {port}")


def _link(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return ""


def _ndjson(workdir: Path, events: list[dict[str, Any]]) -> Path:
    path = workdir / "events.ndjson"
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    return path


def _cli(ns: Namespace, env: dict[str, str], *args: str) -> str:
    done = ns.cli(*args, env=env)
    assert 0 == done.returncode, done.stderr
    return done.stdout
