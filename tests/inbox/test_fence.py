"""The fence protocol in-process, against the local endpoint of webhook_server.py:
claim, call, complete; every redelivery and failure path; the fence commands.
Each scenario of the protocol runs on both backends (the ``db`` fixture: a SQLite
file, and the webhook's schema in a PostgreSQL database of the test's own).

A SIGKILL between the call and the local commit is simulated by a crash
point that raises (the real SIGKILL is in test_webhook.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import OpenDB, cli, closed_at_exit, env, json_lines, read_rows
from webhook_server import WebhookServer, free_port

from delivery_consumer import consumers
from delivery_consumer.amqp.retry import Retry, retry_after_tier
from delivery_consumer.consumers.webhook import Notifier, WebhookConfig, idempotency_key_header, payload
from delivery_consumer.inbox import ConsumerDB, InFlight, fence, unsynced_transaction
from delivery_consumer.inbox.apply import Store
from delivery_consumer.inbox.pg import PgInboxDB
from delivery_consumer.model.contract import DeliveryMark, Outcome, WorkHooks
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import ConfigError, FenceError, TransientError

Step = Callable[..., Notifier]


class Killed(BaseException):
    """Stands for the SIGKILL of a crash point."""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request: pytest.FixtureRequest, open_db: OpenDB) -> Iterator[Store]:
    """A fresh webhook database: a SQLite file, or the webhook's schema in a PostgreSQL database."""
    if request.param == "sqlite":
        yield open_db("webhook")
        return
    url = request.getfixturevalue("pg_url")
    with closed_at_exit() as keep:
        yield keep(PgInboxDB.open(url, consumers.get("webhook"), create=True))


@pytest.fixture
def sqlite_db(open_db: OpenDB) -> ConsumerDB:
    """A fresh webhook database file (for what only SQLite has: PRAGMAs, trace across files)."""
    return open_db("webhook")


def read(db: Store, table: str, columns: str = "*", where: str = "") -> list[tuple[Any, ...]]:
    """Rows of *table*, sorted, through a connection of their own (what another process sees)."""
    if isinstance(db, ConsumerDB):
        return read_rows(db.path, table, columns, where)
    import psycopg

    assert isinstance(db, PgInboxDB)
    with psycopg.connect(db.url) as conn:
        conn.execute(f'SET search_path TO "{db.schema}"')
        sql = f"SELECT {columns} FROM {table}" + (f" WHERE {where}" if where else "")
        return sorted(tuple(r) for r in conn.execute(sql).fetchall())


def db_args(db: Store) -> list[str]:
    """The --db (and, for PostgreSQL, --consumer) options naming *db* on the command line."""
    if isinstance(db, PgInboxDB):
        return ["--consumer", "webhook", "--db", f"{db.url}?schema={db.schema}"]
    return ["--db", str(db.path)]


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    """The local endpoint, idempotent."""
    with WebhookServer() as endpoint:
        yield endpoint


@pytest.fixture
def step(server: WebhookServer) -> Iterator[Step]:
    """Notifiers for the endpoint (closed afterwards)."""
    made: list[Notifier] = []

    def _step(*, idempotent: bool = True, read_timeout_s: float = 0.5, url: str | None = None) -> Notifier:
        notifier = Notifier(WebhookConfig(url or server.url, idempotent, 0.5, read_timeout_s))
        made.append(notifier)
        return notifier

    yield _step
    for notifier in made:
        notifier.close()


def apply(db: Store, notifier: Notifier, *envs: Envelope) -> list[Outcome]:
    marks = [DeliveryMark(f"{e.event_id}:{i}", redelivered=False, attempt=1) for i, e in enumerate(envs)]
    return fence.apply_fenced(db, envs, marks, notifier)


def statuses(outcomes: Sequence[Outcome]) -> list[str]:
    return [o.status for o in outcomes]


def row(db: Store, key: str) -> dict[str, Any]:
    shown = fence.fence_show(db.conn, key)
    assert shown is not None
    return shown


def crash_after_call(monkeypatch: pytest.MonkeyPatch) -> None:
    def crashpoint(name: str) -> None:
        if name == "webhook-after-call":
            raise Killed(name)

    monkeypatch.setattr(fence, "crashpoint", crashpoint)


E1 = "11111111-1111-4111-8111-111111111111"
E2 = "22222222-2222-4222-8222-222222222222"
E3 = "33333333-3333-4333-8333-333333333333"


# -- the protocol ----------------------------------------------------------------


def test_a_notification_is_sent_once_with_its_key_and_the_provider_id_is_kept(
    db: Store, server: WebhookServer, step: Step
) -> None:
    """Claim, call, complete: receipt notified, fence done with the endpoint's id."""
    event = env(event_id=E1, article_id="a-1", revision=3)

    assert ["notified"] == statuses(apply(db, step(), event))

    assert {"a-1:3:notify": 1} == server.effects()
    assert {"articleId": "a-1", "revision": 3, "published": True, "title": event.data["title"],
            "url": event.data["url"]} == server.requests[0].body
    shown = row(db, "a-1:3:notify")
    assert ("done", server.first_id("a-1:3:notify"), 200, 1, False, E1) == (
        shown["state"], shown["providerId"], shown["httpStatus"], shown["calls"], shown["inDoubt"], shown["eventId"]
    )
    assert [(E1, "notified")] == read(db, "inbox", "event_id, result")


def test_a_redelivery_with_a_receipt_makes_no_call(db: Store, server: WebhookServer, step: Step) -> None:
    """The receipt answers a redelivery: duplicate:notified, no second request."""
    event = env(event_id=E1)
    apply(db, step(), event)

    assert ["duplicate:notified"] == statuses(apply(db, step(), event))
    assert 1 == len(server.requests)


def test_a_done_fence_without_receipt_completes_without_calling(
    db: Store, server: WebhookServer, step: Step
) -> None:
    """A fence already done (its receipt lost) writes the receipt and calls nobody."""
    event = env(event_id=E1)
    apply(db, step(), event)
    db.conn.execute("DELETE FROM inbox")

    assert ["notified"] == statuses(apply(db, step(), event))
    assert 1 == len(server.requests)


def test_another_event_of_a_notified_revision_is_not_sent(db: Store, server: WebhookServer, step: Step) -> None:
    """The key is the business step: a second eventId with the same revision and state is already-notified."""
    apply(db, step(), env(event_id=E1))

    assert ["already-notified"] == statuses(apply(db, step(), env(event_id=E2)))
    assert 1 == len(server.requests)


def test_crash_after_the_call_calls_again_with_the_same_key_and_one_effect(
    db: Store, server: WebhookServer, step: Step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the 200 and before the commit: the redelivery calls an idempotent
    endpoint with the same key, which answers the same id; one effect."""
    event = env(event_id=E1)
    with monkeypatch.context() as patch:
        crash_after_call(patch)
        with pytest.raises(Killed):
            apply(db, step(), event)
    claimed = row(db, "article-42:1:notify")
    assert ("claimed", True, 1) == (claimed["state"], claimed["inDoubt"], claimed["calls"])

    assert ["notified"] == statuses(apply(db, step(), event))

    assert {"article-42:1:notify": 2} == server.calls()
    assert {"article-42:1:notify": 1} == server.effects()
    assert server.first_id("article-42:1:notify") == row(db, "article-42:1:notify")["providerId"]


def test_crash_after_the_call_to_a_non_idempotent_endpoint_is_outcome_unknown(
    db: Store, step: Step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without idempotency the redelivery never calls again on a guess: outcome-unknown."""
    with WebhookServer(idempotent=False) as endpoint:
        notifier = step(idempotent=False, url=endpoint.url)
        event = env(event_id=E1)
        with monkeypatch.context() as patch:
            crash_after_call(patch)
            with pytest.raises(Killed):
                apply(db, notifier, event)

        outcomes = apply(db, notifier, event)

        assert ["outcome-unknown"] == statuses(outcomes)
        assert "fence resolve" in (outcomes[0].rejection.reason if outcomes[0].rejection else "")
        assert 1 == len(endpoint.requests)


def test_a_crash_mid_batch_leaves_only_the_called_key_in_doubt_without_idempotency(
    db: Store, step: Step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark before each call is its own commit for a non-idempotent endpoint, so
    the calls never made are made after the restart, and the one made is not repeated."""
    with WebhookServer(idempotent=False) as endpoint:
        notifier = step(idempotent=False, url=endpoint.url)
        batch = [env(event_id=e, article_id=f"a-{i}") for i, e in enumerate((E1, E2, E3))]
        with monkeypatch.context() as patch:
            crash_after_call(patch)
            with pytest.raises(Killed):
                apply(db, notifier, *batch)

        assert ["outcome-unknown", "notified", "notified"] == statuses(apply(db, notifier, *batch))
        assert {"a-0:1:notify": 1, "a-1:1:notify": 1, "a-2:1:notify": 1} == endpoint.calls()


def test_a_stale_revision_is_not_sent(db: Store, server: WebhookServer, step: Step) -> None:
    """After revision 2 was notified, revision 1 gets the receipt stale and no call."""
    apply(db, step(), env(event_id=E2, revision=2))

    assert ["stale"] == statuses(apply(db, step(), env(event_id=E1, revision=1)))
    assert ["article-42:2:notify"] == [r.key for r in server.requests]


def test_in_one_batch_the_older_revision_after_the_newer_is_stale(
    db: Store, server: WebhookServer, step: Step
) -> None:
    """Revision 2 then 1 in one batch: 1 is stale; 1 then 2: both are sent, in order."""
    newer_first = apply(db, step(), env(event_id=E2, revision=2), env(event_id=E1, revision=1))
    assert ["notified", "stale"] == statuses(newer_first)
    both = apply(db, step(), env(event_id=E3, article_id="b", revision=1),
                 env(event_id="44444444-4444-4444-8444-444444444444", article_id="b", revision=2))
    assert ["notified", "notified"] == statuses(both)
    assert ["article-42:2:notify", "b:1:notify", "b:2:notify"] == [r.key for r in server.requests]


def test_the_same_key_with_another_payload_is_a_revision_conflict(
    db: Store, server: WebhookServer, step: Step
) -> None:
    """Two facts claiming one revision: the second is rejected revision-conflict, not sent."""
    apply(db, step(), env(event_id=E1, title="first"))

    assert ["revision-conflict"] == statuses(apply(db, step(), env(event_id=E2, title="second")))
    assert 1 == len(server.requests)


def test_the_same_event_twice_in_a_batch_is_called_once(db: Store, server: WebhookServer, step: Step) -> None:
    """A key met twice in one batch is called once; the second delivery follows the first."""
    event = env(event_id=E1)

    assert ["notified", "duplicate:notified"] == statuses(apply(db, step(), event, event))
    assert 1 == len(server.requests)


def test_the_claim_is_not_synced_and_the_connection_goes_back_to_full(
    sqlite_db: ConsumerDB, server: WebhookServer, step: Step
) -> None:
    """The claim commits with synchronous=NORMAL, for that transaction only: FULL
    (2) is back after it, after a failing one, and after a whole batch."""
    db = sqlite_db
    with unsynced_transaction(db) as tx:
        assert 1 == tx.conn.execute("PRAGMA synchronous").fetchone()[0]
    assert 2 == db.conn.execute("PRAGMA synchronous").fetchone()[0]
    with pytest.raises(RuntimeError), unsynced_transaction(db):
        raise RuntimeError("effect failed")
    assert 2 == db.conn.execute("PRAGMA synchronous").fetchone()[0]

    apply(db, step(), env(event_id=E1))
    assert 2 == db.conn.execute("PRAGMA synchronous").fetchone()[0]


# -- failures ----------------------------------------------------------------------


def test_an_endpoint_rejection_keeps_the_fence_for_a_rerun(db: Store, server: WebhookServer, step: Step) -> None:
    """A 400 is endpoint-rejected after one call; after the fix the rerun uses the same key."""
    event = env(event_id=E1, title="reject")

    assert ["endpoint-rejected"] == statuses(apply(db, step(), event))
    shown = row(db, "article-42:1:notify")
    assert ("claimed", 400, False) == (shown["state"], shown["httpStatus"], shown["inDoubt"])
    assert [] == read(db, "inbox")

    server.healed = True
    assert ["notified"] == statuses(apply(db, step(), event))
    assert {"article-42:1:notify": 2} == server.calls()
    assert 2 == row(db, "article-42:1:notify")["calls"]


def test_a_timeout_is_transient_for_an_idempotent_endpoint(db: Store, server: WebhookServer, step: Step) -> None:
    """A read timeout goes to the retry tiers (same key next time); the fence is in doubt."""
    outcomes = apply(db, step(read_timeout_s=0.2), env(event_id=E1, title="slow:0.6"))

    assert ["transient:endpoint-timeout"] == statuses(outcomes)
    assert (True, 1) == (row(db, "article-42:1:notify")["inDoubt"], row(db, "article-42:1:notify")["calls"])


def test_a_timeout_of_a_non_idempotent_endpoint_is_outcome_unknown_at_once(db: Store, step: Step) -> None:
    """Without idempotency a timed-out call is never repeated: outcome-unknown, one call."""
    with WebhookServer(idempotent=False) as endpoint:
        notifier = step(idempotent=False, read_timeout_s=0.2, url=endpoint.url)
        event = env(event_id=E1, title="slow:0.6")

        assert ["outcome-unknown"] == statuses(apply(db, notifier, event))
        assert ["outcome-unknown"] == statuses(apply(db, notifier, event))
        assert 1 == len(endpoint.requests)


def test_an_unreachable_endpoint_stops_the_batch_and_undoes_the_marks(db: Store, step: Step) -> None:
    """Connection refused: every event is transient, only the first is tried
    (the others' marks are undone), and no fence is in doubt (nothing was sent)."""
    notifier = step(url=f"http://127.0.0.1:{free_port()}/notify")
    batch = [env(event_id=e, article_id=f"a-{i}") for i, e in enumerate((E1, E2, E3))]

    outcomes = apply(db, notifier, *batch)

    assert ["transient:endpoint-unreachable"] * 3 == statuses(outcomes)
    assert [False, True, True] == ["not called" in (o.transient.reason if o.transient else "") for o in outcomes]
    assert [("a-0:1:notify", 1, 0), ("a-1:1:notify", 0, 0), ("a-2:1:notify", 0, 0)] == read(
        db, "fence", "key, calls, in_doubt")


def test_a_throttled_answer_carries_retry_after_and_stops_the_batch(
    db: Store, server: WebhookServer, step: Step
) -> None:
    """A 429 is transient with the wait it asked for; the rest of the batch is not called."""
    outcomes = apply(db, step(), env(event_id=E1, title="throttle:1"), env(event_id=E2, article_id="other"))

    assert ["transient:endpoint-throttled"] * 2 == statuses(outcomes)
    assert [1.0, 1.0] == [o.transient.retry_after_s for o in outcomes if o.transient]
    assert 1 == len(server.requests)


def test_a_503_answer_is_retried_and_counted_as_no_effect(db: Store, server: WebhookServer, step: Step) -> None:
    """503 is transient and not in doubt; the next try with the same key succeeds."""
    event = env(event_id=E1, title="busy:1")

    assert ["transient:endpoint-unavailable"] == statuses(apply(db, step(), event))
    assert False is row(db, "article-42:1:notify")["inDoubt"]
    assert ["notified"] == statuses(apply(db, step(), event))
    assert {"article-42:1:notify": 1} == server.effects()


GONE = "gone:1:1"  # the owner name of a process that no longer runs (another boot)


def test_only_the_delivery_being_called_is_under_way_and_a_crash_there_is_its_own(
    db: Store, server: WebhookServer, step: Step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a call only its delivery is noted under way: killed there, that
    delivery alone gets a crash (not the batch); the next delivery notifies it."""
    first, second = env(event_id=E1, article_id="a"), env(event_id=E2, article_id="b")
    marks = [DeliveryMark("m-1", redelivered=False, attempt=1), DeliveryMark("m-2", redelivered=False, attempt=1)]
    with monkeypatch.context() as patch:
        crash_after_call(patch)
        with pytest.raises(Killed):
            fence.apply_fenced(db, [first, second], marks, step(), WorkHooks(InFlight(db, GONE)))
    assert [(GONE, '["m-1"]')] == read(db, "in_flight", "owner, keys")

    assert 1 == InFlight(db).reap()
    assert [("m-1", 1, 1, "crashed")] == read(db, "deliveries", "key, deliveries, crashes, last_outcome")
    assert {"m-1": 1} == InFlight(db).open_keys(["m-1", "m-2"])

    again = [DeliveryMark("m-1", redelivered=True, attempt=1), DeliveryMark("m-2", redelivered=True, attempt=1)]
    outcomes = fence.apply_fenced(db, [first, second], again, step(), WorkHooks(InFlight(db)))
    assert ["notified", "notified"] == statuses(outcomes)
    assert [("m-1", 2, 1, "notified"), ("m-2", 1, 0, "notified")] == read(
        db, "deliveries", "key, deliveries, crashes, last_outcome")
    assert [] == read(db, "in_flight")
    assert {} == InFlight(db).open_keys(["m-1", "m-2"])


def test_copies_of_one_event_in_a_batch_are_one_call_and_no_crash(
    db: Store, server: WebhookServer, step: Step
) -> None:
    """Five copies of one envelope in a batch: one call, one receipt, five
    deliveries counted, no crash, nothing left under way."""
    event = env(event_id=E1)
    marks = [DeliveryMark(E1, redelivered=False, attempt=1) for _ in range(5)]
    outcomes = fence.apply_fenced(db, [event] * 5, marks, step(), WorkHooks(InFlight(db)))

    assert ["notified"] + ["duplicate:notified"] * 4 == statuses(outcomes)
    assert 1 == len(server.requests)
    assert [(E1, 5, 0, "duplicate:notified")] == read(db, "deliveries",
                                                          "key, deliveries, crashes, last_outcome")
    assert [] == read(db, "in_flight")


@pytest.mark.parametrize("batch", [1, 2])
def test_an_event_id_reused_with_another_body_is_refused_so_whatever_the_batch(
    db: Store, server: WebhookServer, step: Step, batch: int
) -> None:
    """The same eventId with another body is event-id-reused, in one batch or in two."""
    first, reused = env(event_id=E1, title="first"), env(event_id=E1, title="other body")
    if batch == 2:
        outcomes = apply(db, step(), first, reused)
    else:
        outcomes = apply(db, step(), first) + apply(db, step(), reused)
    assert ["notified", "event-id-reused"] == statuses(outcomes)
    assert 1 == len(server.requests)


# -- resolving by hand, reading, trace ------------------------------------------------


def test_resolve_by_hand_after_outcome_unknown(db: Store, step: Step) -> None:
    """--provider-id completes the event without a call; --not-sent lets it call again."""
    with WebhookServer(idempotent=False) as endpoint:
        notifier = step(idempotent=False, read_timeout_s=0.2, url=endpoint.url)
        sent, lost = env(event_id=E1, title="slow:0.4"), env(event_id=E2, article_id="b", title="slow:0.4")
        assert ["outcome-unknown"] == statuses(apply(db, notifier, sent))
        assert ["outcome-unknown"] == statuses(apply(db, notifier, lost))
        endpoint.healed = True

        assert "done" == fence.resolve(db, "article-42:1:notify", provider_id="ntf-by-hand")["state"]
        assert False is fence.resolve(db, "b:1:notify", not_sent=True)["inDoubt"]

        assert ["notified", "notified"] == statuses(apply(db, notifier, sent, lost))
        assert {"article-42:1:notify": 1, "b:1:notify": 2} == endpoint.calls()
        assert "ntf-by-hand" == row(db, "article-42:1:notify")["providerId"]
        with pytest.raises(FenceError, match="is done"):
            fence.resolve(db, "b:1:notify", not_sent=True)


def test_fence_commands_list_show_and_json(db: Store, server: WebhookServer, step: Step) -> None:
    """fence list/show print the rows (text and --json); an unknown key exits 1."""
    apply(db, step(), env(event_id=E1), env(event_id=E2, article_id="b", title="reject"))
    path = db_args(db)

    listed = cli(["fence", "list", *path, "--json"])
    assert 0 == listed.exit_code, listed.output
    assert {("article-42:1:notify", "done"), ("b:1:notify", "claimed")} == {
        (r["key"], r["state"]) for r in orjson.loads(listed.output)
    }
    claimed = cli(["fence", "list", *path, "--state", "claimed"])
    assert "b:1:notify" in claimed.output and "article-42:1:notify" not in claimed.output
    in_doubt = cli(["fence", "list", *path, "--in-doubt", "--json"])
    assert [] == orjson.loads(in_doubt.output), in_doubt.output
    shown = cli(["fence", "show", "article-42:1:notify", *path, "--json"])
    assert server.first_id("article-42:1:notify") == json_lines(shown.output)[0]["providerId"]
    assert "providerId:" in cli(["fence", "show", "article-42:1:notify", *path]).output
    assert 1 == cli(["fence", "show", "nope:1:notify", *path]).exit_code


def test_fence_resolve_command(db: Store, step: Step) -> None:
    """fence resolve refuses an unknown key or a missing verdict with exit 2, and resolves a key
    left outcome-unknown (the row as it is now: done, with the provider's id)."""
    path = db_args(db)
    assert 2 == cli(["fence", "resolve", "nope:1:notify", *path, "--not-sent"]).exit_code
    assert 2 == cli(["fence", "resolve", "nope:1:notify", *path]).exit_code
    with WebhookServer(idempotent=False) as endpoint:
        notifier = step(idempotent=False, read_timeout_s=0.2, url=endpoint.url)
        assert ["outcome-unknown"] == statuses(apply(db, notifier, env(event_id=E1, title="slow:0.4")))
    resolved = cli(["fence", "resolve", "article-42:1:notify", *path, "--provider-id", "ntf-1", "--json"])
    assert 0 == resolved.exit_code, resolved.output
    assert ("done", "ntf-1", False) == tuple(orjson.loads(resolved.output)[k] for k in ("state", "providerId",
                                                                                       "inDoubt"))


def test_trace_shows_the_fence_an_event_claimed(sqlite_db: ConsumerDB, step: Step, tmp_path: Path) -> None:
    """trace lists the fence row an event claimed among its effect rows, and none for another event;
    a database without a fence table lists no fence."""
    from delivery_consumer.inbox.history import trace

    db = sqlite_db

    apply(db, step(), env(event_id=E1), env(event_id=E2, revision=2))

    assert ["article-42:1:notify"] == [r["key"] for r in trace(db, E1)["effects"]["fence"]]
    assert ["article-42:2:notify"] == [r["key"] for r in trace(db, E2)["effects"]["fence"]]
    catalog = consumers.open_db(tmp_path / "catalog.db", "catalog", create=True)
    try:
        assert [] == fence.fence_list(catalog.conn)
    finally:
        catalog.close()


# -- configuration and pure pieces ---------------------------------------------------


def test_the_webhook_options_are_checked() -> None:
    """No URL, a read timeout not shorter than the first retry delay: ConfigError; defaults fit."""
    external = consumers.get("webhook").external
    assert external is not None
    with pytest.raises(ConfigError, match="--webhook-url"):
        external({})
    with pytest.raises(ConfigError, match="shorter than the first retry delay"):
        WebhookConfig.from_options({"webhook_url": "http://x/", "read_timeout_s": 1.0, "first_retry_delay_ms": 1000})
    config = WebhookConfig.from_options({"webhook_url": "http://x/", "first_retry_delay_ms": 500})
    assert (0.4, 0.4, True) == (config.read_timeout_s, config.connect_timeout_s, config.idempotent)


def test_the_idempotency_key_header_is_ascii_and_one_to_one() -> None:
    """Any articleId gives an ASCII header; plain keys are unchanged."""
    assert "a-1:3:notify" == idempotency_key_header("a-1:3:notify")
    header = idempotency_key_header("статья 1:2:notify")
    assert header.isascii() and " " not in header
    assert header != idempotency_key_header("статья 2:2:notify")


def test_a_key_is_one_to_one_with_article_step_and_revision() -> None:
    """Keys parse from the right (an articleId may hold colons); malformed keys are None."""
    assert ("a:b", "notify", 12) == fence.key_parts(fence.fence_key("a:b", 12, "notify"))
    assert [None, None, None] == [fence.key_parts(k) for k in ("a:notify", "a:+1:notify", "a:01:notify")]


def test_the_payload_is_canonical() -> None:
    """One revision, one body: the fence compares its hash."""
    assert payload(env(title="t")) == payload(env(title="t", event_id=E2))
    assert b'"published":false' in payload(env(type="material.withdrawn"))


def test_retry_after_picks_the_first_tier_long_enough() -> None:
    """Retry-After moves the retry to the first tier at least that long, never shorter, else the longest."""
    delays = (100, 1000, 5000)
    first = Retry(tier=0, delay_ms=100, attempts=1)
    assert 1 == retry_after_tier(first, delays, 1.0).tier
    assert 2 == retry_after_tier(first, delays, 1.5).tier
    assert 2 == retry_after_tier(first, delays, 60).tier
    assert 0 == retry_after_tier(first, delays, 0.05).tier
    assert 2 == retry_after_tier(Retry(tier=2, delay_ms=5000, attempts=3), delays, 0.5).tier


def test_the_webhook_consumer_refuses_to_run_inside_a_transaction(db: Store) -> None:
    """replay cannot fence a call: the in-transaction apply is a transient refusal."""
    from delivery_consumer.inbox import apply_event

    with pytest.raises(TransientError, match="run only"):
        apply_event(db, env(event_id=E1))
    assert [] == read(db, "fence")


def test_a_fence_of_the_first_schema_is_renamed_in_place_and_its_rows_keep_fencing(
    tmp_path: Path, server: WebhookServer, step: Step
) -> None:
    """A webhook database whose fence keeps the entity's key in ``article_id`` (its first migration only)
    is migrated on open: the column is ``entity_key``, every row kept, shown by its key, and an older
    revision of that entity is still stale against it (not sent)."""
    import dataclasses

    from delivery_consumer.consumers.webhook import SPEC

    path = tmp_path / "webhook.db"
    old = ConsumerDB.open(path, dataclasses.replace(SPEC, migrations=(fence.MIGRATION,)), create=True)
    with old.conn:
        old.conn.execute(
            "INSERT INTO fence (article_id, step, revision, key, event_id, payload_sha256, state, calls,"
            " provider_id, http_status, claimed_at, called_at, done_at)"
            " VALUES ('a-1', 'notify', 3, 'a-1:3:notify', ?, 'sha', 'done', 1, 'p-1', 200, 't0', 't1', 't2')", (E1,))
    old.close()

    with consumers.open_db(path, "webhook") as db:
        columns = [r[1] for r in db.conn.execute("PRAGMA table_info(fence)")]
        assert "entity_key" in columns and "article_id" not in columns
        shown = row(db, "a-1:3:notify")
        assert ("a-1", 3, "done", "p-1", E1) == (
            shown["articleId"], shown["revision"], shown["state"], shown["providerId"], shown["eventId"])
        assert ["stale"] == statuses(apply(db, step(), env(event_id=E2, article_id="a-1", revision=2)))
        assert [] == server.requests
        assert [("a-1", 3)] == read_rows(path, "fence", "entity_key, revision")


def test_trace_by_key_finds_the_fence_row_under_its_generic_column(
    sqlite_db: ConsumerDB, server: WebhookServer, step: Step
) -> None:
    """The fence keeps an event's key in ``entity_key``: a trace by key still finds its row
    (the webhook has no view naming a key column)."""
    from delivery_consumer.inbox import reports

    db = sqlite_db

    event = env(event_id=E1, article_id="a-9", revision=2)
    assert ["notified"] == statuses(apply(db, step(), event))
    assert {E1: {"revision": 2}} == {k: {"revision": v.get("revision")} for k, v in reports.key_rows(db, "a-9").items()}
    assert {} == reports.key_rows(db, "a-8")


@pytest.mark.postgres
def test_a_connection_lost_mid_batch_on_postgresql_calls_no_more_keys(pg_url: str, step: Step) -> None:
    """The server ends the inbox's session after the batch's first call (its advisory lock with it):
    the keys not yet called are not called by this batch (transient database-unavailable, their
    marks undone, nothing in doubt); the first key completes; the next batch calls the others once."""
    import psycopg

    with closed_at_exit() as keep, WebhookServer(idempotent=False) as endpoint:
        db = keep(PgInboxDB.open(pg_url, consumers.get("webhook"), create=True))
        notifier = step(idempotent=False, url=endpoint.url)
        call = notifier.call

        def call_then_cut(made: Any) -> Any:
            result = call(made)
            if len(endpoint.requests) == 1:  # the server ends the session (as a restart would)
                with psycopg.connect(pg_url, autocommit=True) as admin:
                    admin.execute("SELECT pg_terminate_backend(%s)", (db.conn.raw.info.backend_pid,))
            return result

        notifier.call = call_then_cut  # type: ignore[method-assign]
        batch = [env(event_id=e, article_id=f"a-{i}") for i, e in enumerate((E1, E2, E3))]
        marks = [DeliveryMark(f"m-{i}", redelivered=False, attempt=1) for i in range(3)]
        again = WorkHooks(wait_for_store=lambda exc: None)

        outcomes = fence.apply_fenced(db, batch, marks, notifier, again)

        assert ["notified", "transient:database-unavailable", "transient:database-unavailable"] == statuses(outcomes)
        assert [("a-0:1:notify", 1, 0), ("a-1:1:notify", 0, 0), ("a-2:1:notify", 0, 0)] == read(
            db, "fence", "key, calls, in_doubt")
        notifier.call = call  # type: ignore[method-assign]
        assert ["duplicate:notified", "notified", "notified"] == statuses(
            fence.apply_fenced(db, batch, marks, notifier, again))
        assert {"a-0:1:notify": 1, "a-1:1:notify": 1, "a-2:1:notify": 1} == endpoint.calls()
