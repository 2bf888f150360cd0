"""The webhook consumer under ``run``: real broker, real processes, real SIGKILL,
and the local endpoint of webhook_server.py keeping a ledger of effects per key.

Retry tiers are 500 ms and 1 s here, so the read timeout (default: 80 % of
the first delay) is 0.4 s.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import orjson
from brokerkit import Namespace, kill
from support import SAMPLES, new_event, read_rows
from webhook_server import WebhookServer, free_port

TIERS = ("--retry-delays", "500ms,1s")


def hook_env(ns: Namespace, server: WebhookServer, **extra: str) -> dict[str, str]:
    return ns.env(DELIVERY_WEBHOOK_URL=server.url, **extra)


def publish(ns: Namespace, *events: dict[str, Any]) -> list[str]:
    """Publish *events*; their fence keys."""
    ns.publish([orjson.dumps(e) for e in events], declare=["webhook"])
    return [f"{e['articleId']}:{e['revision']}:notify" for e in events]


def fence_of(ns: Namespace, key: str) -> dict[str, Any]:
    shown = ns.cli("fence", "show", key, "--db", str(ns.db("webhook")), "--json")
    assert 0 == shown.returncode, shown.stderr
    row: dict[str, Any] = orjson.loads(shown.stdout)
    return row


def dead_codes(ns: Namespace) -> list[str]:
    return sorted(props.headers["x-error-code"] for props, _ in ns.drain(ns.topology("webhook").dead_queue))


def test_sigkill_after_the_answer_before_the_commit_notifies_once(ns: Namespace) -> None:
    """SIGKILL after a 200 and before the local commit, then restart: one effect per
    key in the endpoint's ledger, and the fence holds the id of that first answer."""
    with WebhookServer() as server:
        keys = publish(ns, *(new_event(article_id=f"a-{i}") for i in range(5)))
        env = hook_env(ns, server, DELIVERY_CRASH_AT="webhook-after-call")
        crashed = ns.run_until_idle("webhook", *TIERS, env=env, idle=5)
        assert -signal.SIGKILL == crashed.returncode, crashed.stderr
        first = server.requests[0]
        assert 1 == len(server.requests)

        env.pop("DELIVERY_CRASH_AT")
        recovered = ns.run_until_idle("webhook", *TIERS, env=env)

        assert 0 == recovered.returncode, recovered.stderr
        assert dict.fromkeys(keys, 1) == server.effects()
        assert 2 == server.calls()[first.key or ""]  # called again with the same key, same answer
        assert (first.response_id, "done") == (fence_of(ns, first.key or "")["providerId"],
                                               fence_of(ns, first.key or "")["state"])
        assert [(5,)] == read_rows(ns.db("webhook"), "inbox", "count(*)", where="result = 'notified'")
        assert 0 == ns.count(ns.topology("webhook").queue) + ns.count(ns.topology("webhook").dead_queue)


def test_sigkill_after_a_call_to_a_non_idempotent_endpoint_is_never_repeated(ns: Namespace) -> None:
    """Without idempotency, the key called before the SIGKILL is dead-lettered
    outcome-unknown after the restart; the keys not yet called are called once."""
    with WebhookServer(idempotent=False) as server:
        keys = publish(ns, *(new_event(article_id=f"a-{i}") for i in range(3)))
        env = hook_env(ns, server, DELIVERY_CRASH_AT="webhook-after-call")
        crashed = ns.run_until_idle("webhook", *TIERS, "--no-endpoint-idempotent", env=env, idle=5)
        assert -signal.SIGKILL == crashed.returncode, crashed.stderr

        env.pop("DELIVERY_CRASH_AT")
        recovered = ns.run_until_idle("webhook", *TIERS, "--no-endpoint-idempotent", env=env)

        assert 0 == recovered.returncode, recovered.stderr
        assert dict.fromkeys(keys, 1) == server.calls()
        assert ["outcome-unknown"] == dead_codes(ns)
        assert (True, None) == (fence_of(ns, keys[0])["inDoubt"], fence_of(ns, keys[0])["providerId"])


def test_an_endpoint_down_for_a_while_is_retried_through_the_tiers(ns: Namespace) -> None:
    """Connection refused until the run has sent a retry copy: the events go through the
    retry tiers and are notified once each when the endpoint comes up."""
    server = WebhookServer(free_port())
    keys = publish(ns, *(new_event(article_id=f"a-{i}") for i in range(3)))
    proc = ns.start_run("webhook", "--exit-when-idle", "3", *TIERS, "--max-attempts", "8",
                        env=hook_env(ns, server))
    try:
        proc.wait_for_log("retry copy sent")  # the endpoint stays down until an event is in a retry tier
        server.start()
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise
    finally:
        server.stop()

    assert 0 == proc.returncode, err
    assert "retry copy sent" in err
    assert dict.fromkeys(keys, 1) == server.effects()
    assert [(3,)] == read_rows(ns.db("webhook"), "inbox", "count(*)", where="result = 'notified'")
    assert read_rows(ns.db("webhook"), "deliveries", "min(attempts) > 1", where="last_outcome = 'notified'") == [
        (1,)
    ]


def test_an_endpoint_rejection_is_dead_lettered_after_one_call(ns: Namespace) -> None:
    """A 400 is dead-lettered endpoint-rejected after exactly one call (no retry
    storm); the fence stays claimed for a rerun with the same key."""
    with WebhookServer() as server:
        bad, *good = publish(ns, new_event(article_id="bad", title="reject"),
                             *(new_event(article_id=f"a-{i}") for i in range(2)))
        done = ns.run_until_idle("webhook", *TIERS, env=hook_env(ns, server))

        assert 0 == done.returncode, done.stderr
        assert {bad: 1, **dict.fromkeys(good, 1)} == server.calls()
        assert ["endpoint-rejected"] == dead_codes(ns)
        assert [("endpoint-rejected",)] == read_rows(ns.db("webhook"), "rejected", "code")
        assert ("claimed", 400) == (fence_of(ns, bad)["state"], fence_of(ns, bad)["httpStatus"])


def test_an_unknown_outcome_at_a_non_idempotent_endpoint_is_dead_lettered_after_one_call(ns: Namespace) -> None:
    """A call that times out at an endpoint that is not idempotent is dead-lettered
    outcome-unknown with exactly one call; the neighbour is notified."""
    with WebhookServer(idempotent=False) as server:
        slow, fine = publish(ns, new_event(article_id="slow", title="slow:1.2"), new_event(article_id="fine"))
        done = ns.run_until_idle("webhook", *TIERS, "--no-endpoint-idempotent", env=hook_env(ns, server))

        assert 0 == done.returncode, done.stderr
        assert {slow: 1, fine: 1} == server.calls()
        assert ["outcome-unknown"] == dead_codes(ns)
        receipts = "inbox i JOIN fence f USING (event_id)"
        assert [("fine", "notified")] == read_rows(ns.db("webhook"), receipts, "f.entity_key, i.result")


def test_a_stale_revision_is_not_sent(ns: Namespace) -> None:
    """Revision 2 then revision 1 of one article: only revision 2 is sent; 1 gets the receipt stale."""
    newer, older = new_event(article_id="x", revision=2), new_event(article_id="x", revision=1)
    with WebhookServer() as server:
        newer_key, _ = publish(ns, newer, older)
        done = ns.run_until_idle("webhook", *TIERS, env=hook_env(ns, server))

        assert 0 == done.returncode, done.stderr
        assert {newer_key: 1} == server.calls()
        assert {(newer["eventId"], "notified"), (older["eventId"], "stale")} == set(
            read_rows(ns.db("webhook"), "inbox", "event_id, result")
        )


def test_retry_after_picks_a_retry_tier_long_enough(ns: Namespace) -> None:
    """A 429 with Retry-After: 1 sends the retry copy to the 1 s tier, not the 500 ms one."""
    with WebhookServer() as server:
        (key,) = publish(ns, new_event(article_id="t", title="throttle:1"))
        done = ns.run_until_idle("webhook", *TIERS, env=hook_env(ns, server), idle=3)

        assert 0 == done.returncode, done.stderr
        assert f"retry copy sent to {ns.topology('webhook').queue}.retry.1000ms" in done.stderr
        assert {key: 2} == server.calls()
        assert {key: 1} == server.effects()


def test_run_refuses_a_webhook_without_url_or_with_a_long_read_timeout(ns: Namespace) -> None:
    """No --webhook-url, or a read timeout not shorter than the first retry delay: one line, exit 2."""
    missing = ns.cli("run", "--consumer", "webhook", "--db", str(ns.db("webhook")))
    assert (2, 1) == (missing.returncode, len(missing.stderr.strip().splitlines()))
    assert "--webhook-url" in missing.stderr
    long = ns.cli("run", "--consumer", "webhook", "--webhook-url", "http://127.0.0.1:9/", *TIERS,
                  "--webhook-read-timeout", "0.5")
    assert 2 == long.returncode and "shorter than the first retry delay" in long.stderr


def requeue_dead(ns: Namespace, env: dict[str, str]) -> None:
    done = ns.cli("dead", "requeue", "--consumer", "webhook", "--db", str(ns.db("webhook")), "--all", env=env)
    assert 0 == done.returncode, done.stderr


def test_retries_exhausted_keep_the_fence_and_a_requeue_continues_with_the_same_key(ns: Namespace) -> None:
    """After --max-attempts 503s the event is dead-lettered retries-exhausted; after the
    fix, dead requeue calls again with the same key and the endpoint counts one effect."""
    with WebhookServer() as server:
        (key,) = publish(ns, new_event(article_id="down", title="busy:99"))
        env = hook_env(ns, server)
        failed = ns.run_until_idle("webhook", *TIERS, "--max-attempts", "2", env=env, idle=2)
        assert 0 == failed.returncode, failed.stderr
        assert ("claimed", 2) == (fence_of(ns, key)["state"], fence_of(ns, key)["calls"])
        server.healed = True

        requeue_dead(ns, env)
        done = ns.run_until_idle("webhook", *TIERS, env=env)

        assert 0 == done.returncode, done.stderr
        assert ({key: 3}, {key: 1}) == (server.calls(), server.effects())
        assert ("done", server.first_id(key)) == (fence_of(ns, key)["state"], fence_of(ns, key)["providerId"])
        assert 0 == ns.count(ns.topology("webhook").dead_queue)


def test_an_outcome_unknown_resolved_by_hand_completes_without_a_call(ns: Namespace) -> None:
    """outcome-unknown, then fence resolve --provider-id and dead requeue: the receipt
    is written and the endpoint is not called again."""
    with WebhookServer(idempotent=False) as server:
        (key,) = publish(ns, new_event(article_id="slow", title="slow:1.2"))
        env = hook_env(ns, server)
        ns.run_until_idle("webhook", *TIERS, "--no-endpoint-idempotent", env=env)
        resolved = ns.cli("fence", "resolve", key, "--provider-id", "ntf-by-hand", "--db", str(ns.db("webhook")),
                          env=env)
        assert 0 == resolved.returncode, resolved.stderr

        requeue_dead(ns, env)
        done = ns.run_until_idle("webhook", *TIERS, "--no-endpoint-idempotent", env=env)

        assert 0 == done.returncode, done.stderr
        assert {key: 1} == server.calls()
        assert [("notified",)] == read_rows(ns.db("webhook"), "inbox", "result")
        assert "ntf-by-hand" == fence_of(ns, key)["providerId"]


def test_copies_of_one_envelope_in_a_batch_are_no_crash(ns: Namespace) -> None:
    """One envelope published 5 times, then once more: one call, the receipt answers
    every copy, no crash is counted and nothing is dead-lettered."""
    event = new_event(article_id="dup")
    with WebhookServer() as server:
        key = publish(ns, *([event] * 5))[0]
        env = hook_env(ns, server)
        done = ns.run_until_idle("webhook", *TIERS, env=env)
        assert 0 == done.returncode, done.stderr
        publish(ns, event)
        again = ns.run_until_idle("webhook", *TIERS, env=env)
        assert 0 == again.returncode, again.stderr

        assert {key: 1} == server.calls()
        traced = ns.cli("trace", event["eventId"], "--db", str(ns.db("webhook")), "--json", env=env)
        deliveries = orjson.loads(traced.stdout)["deliveries"]
        assert (6, 0, "duplicate:notified") == (deliveries["deliveries"], deliveries["crashes"],
                                                deliveries["lastOutcome"])
        assert [] == dead_codes(ns)


def test_samples_are_refused_with_the_same_codes_whatever_the_batch(ns: Namespace) -> None:
    """The lesson's samples through the webhook consumer: the reused eventId (05) is
    event-id-reused at the default batch as at --batch 1."""
    with WebhookServer() as server:
        for batch in ("250", "1"):
            published = ns.cli("publish", "--consumer", "webhook", str(SAMPLES))
            assert 0 == published.returncode, published.stderr
            done = ns.run_until_idle("webhook", *TIERS, "--batch", batch, env=hook_env(ns, server))
            assert 0 == done.returncode, done.stderr
            assert "event-id-reused" in dead_codes(ns), batch
            for file in ns.db("webhook").parent.glob("inbox.db*"):  # the next batch size starts afresh
                file.unlink()
