"""Several broker addresses (amqp.connection): how an address string is read and shown, the order in which its
nodes are tried, and what a cluster's answers about an unavailable queue mean."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pika.exceptions as pex
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorSocketConnectError,
    AMQPConnectorStackTimeout,
)

from delivery_consumer.amqp import connection
from delivery_consumer.amqp.connection import (
    CONNECT_TIMEOUT_S,
    HANDSHAKE_TIMEOUT_S,
    Addresses,
    classify,
    redact,
    unreachable_queue,
)
from delivery_consumer.amqp.dead_queue import DeadQueue
from delivery_consumer.amqp.topology import addresses, join
from delivery_consumer.model.errors import BrokerFatal, BrokerUnavailable, ConfigError
from delivery_consumer.ops.asyncapi import document
from delivery_consumer.ops.deployment import parse_file

HOSTS = st.one_of(st.from_regex(r"[a-z][a-z0-9-]{0,12}(\.[a-z][a-z0-9-]{0,8}){0,2}", fullmatch=True),
                  st.from_regex(r"10\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}", fullmatch=True))
#: Passwords as an operator writes them: anything, percent-encoded (a comma included, as %2C).
PASSWORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)


@st.composite
def urls(draw: st.DrawFn, password: str | None = None) -> str:
    host = draw(HOSTS)
    port = draw(st.integers(1, 65535))
    vhost = draw(st.sampled_from(["%2F", "", "prod", "a%2Fb"]))
    secret = quote(password if password is not None else draw(PASSWORDS), safe="")
    query = draw(st.sampled_from(["", "?heartbeat=30", "?heartbeat=5&socket_timeout=2"]))
    return f"amqp{draw(st.sampled_from(['', 's']))}://guest:{secret}@{host}:{port}/{vhost}{query}"


def test_a_comma_list_a_whitespace_list_and_a_multi_host_url_name_every_node() -> None:
    """URLs separated by commas or whitespace are the nodes in order; a URL with several hosts gives
    each host its user, password, vhost and options."""
    a, b = "amqp://u:p@h1:5672/%2F", "amqp://u:p@h2:5673/%2F"
    assert [a, b] == addresses(f"{a},{b}") == addresses(f" {a} , {b} ") == addresses(f"{a}\n{b}")
    assert [a] == addresses(a)
    assert ["amqp://u:p@h1:5672/v?heartbeat=5", "amqp://u:p@h2:5673/v?heartbeat=5", "amqp://u:p@h3/v?heartbeat=5"] \
        == addresses("amqp://u:p@h1:5672,h2:5673,h3/v?heartbeat=5")
    assert ["amqp://h1:5672", "amqp://[::1]:5673", "amqps://u@h3:5671/x"] \
        == addresses("amqp://h1:5672,[::1]:5673,amqps://u@h3:5671/x")


@pytest.mark.parametrize("text", ["", " , ", "h1:5672", "h1:5672,amqp://h2", "amqp://u:p@h1/v,h2:5673/v",
                                  "http://h1"])
def test_an_address_string_naming_no_broker_url_is_fatal(text: str) -> None:
    """No URL, a host before any URL, a vhost on a host other than the last of a multi-host URL: fatal, with
    no password in the message."""
    with pytest.raises(BrokerFatal) as caught:
        Addresses(text, name="t")
    assert "p@" not in str(caught.value)


@given(st.lists(urls(), min_size=1, max_size=5))
def test_joining_and_reading_back_gives_the_same_urls(given_urls: list[str]) -> None:
    """addresses(join(urls)) == urls for URLs whose passwords are percent-encoded; reading is idempotent."""
    assert given_urls == addresses(join(given_urls))
    assert addresses(join(addresses(join(given_urls)))) == given_urls


@settings(deadline=None)  # pika builds an SSL context for every amqps URL
@given(st.lists(st.tuples(PASSWORDS.filter(lambda p: len(quote(p, safe="")) >= 4), st.data()), min_size=1,
                max_size=4))
def test_redact_shows_every_host_and_never_a_password(items: list[tuple[str, st.DataObject]]) -> None:
    """The redacted address names every node (host:port) and contains no password, encoded or not."""
    given_urls = [data.draw(urls(password=password)) for password, data in items]
    shown = redact(join(given_urls))
    for password, _ in items:
        assert quote(password, safe="") not in shown
        if len(password) >= 4:
            assert password not in shown
    for params in Addresses(join(given_urls), name="t").params:
        assert f"@{params.host}:{params.port}/" in shown


def test_redact_of_one_url_is_unchanged_and_a_bad_one_says_so() -> None:
    """One URL redacts as before (user, host, port, vhost); an unreadable address shows no part of itself."""
    assert "amqp://guest@127.0.0.1:5672//" == redact("amqp://guest:secret@127.0.0.1:5672/%2F")
    assert "<invalid url>" == redact("not-a-url:secret")


def test_every_address_gets_the_timeouts_and_keeps_its_own_options() -> None:
    """Each node's parameters have the connect and handshake timeouts (a dead node costs at most those) and no
    retries of its own (the next address is tried at once); options written in a URL stay its own."""
    addrs = Addresses("amqp://h1:5672,h2:5673/%2F?socket_timeout=1,amqp://h3", name="t")
    assert [1, 1, CONNECT_TIMEOUT_S] == [p.socket_timeout for p in addrs.params]
    assert all(p.stack_timeout == HANDSHAKE_TIMEOUT_S and p.connection_attempts == 1 for p in addrs.params)


def hosts(addrs: Addresses) -> list[str]:
    return [str(p.host) for p in addrs.sequence()]


@pytest.fixture(autouse=True)
def no_failures_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no address remembered as failed in this process."""
    monkeypatch.setattr(connection, "_failed_at", {})


def test_a_node_that_just_failed_is_tried_after_the_others_by_every_client() -> None:
    """An address that failed an attempt (a silent node that cost its handshake timeout) goes after the others
    in the next attempt of any client of the process, the order otherwise kept; once it answers, it is back."""
    first = Addresses("amqp://h1,amqp://h2,amqp://h3", name="t", order="in-order")
    connection.note_attempt(first.params[0], ok=False)
    assert ["h2", "h3", "h1"] == hosts(first) == hosts(Addresses("amqp://h1,amqp://h2,amqp://h3", name="other"))
    connection.note_attempt(first.params[0], ok=True)
    assert ["h1", "h2", "h3"] == hosts(first)


def test_in_order_the_nodes_are_tried_as_given_and_a_reconnect_starts_after_the_node_lost() -> None:
    """In order: h1, h2, h3; once connected to h2 (and lost it), the next attempt starts with h3, h2 last."""
    addrs = Addresses("amqp://h1,amqp://h2,amqp://h3", name="t", order="in-order")
    assert ["h1", "h2", "h3"] == hosts(addrs)
    assert "h2:5672" == addrs.connected(addrs.params[1]) == addrs.node
    assert ["h3", "h1", "h2"] == hosts(addrs)


def test_shuffled_every_node_is_tried_once_and_the_node_lost_last() -> None:
    """Shuffled: each attempt tries every node once, in varying orders, the node last connected to last."""
    addrs = Addresses("amqp://h1,amqp://h2,amqp://h3,amqp://h4", name="t", order="shuffle")
    seen = {tuple(hosts(addrs)) for _ in range(200)}
    assert len(seen) > 1 and all(sorted(order) == ["h1", "h2", "h3", "h4"] for order in seen)
    addrs.connected(addrs.params[0])
    assert all(hosts(addrs)[-1] == "h1" for _ in range(50))


def test_the_order_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """DELIVERY_AMQP_ORDER chooses the order (what --amqp-order sets); an unknown one is fatal."""
    monkeypatch.setenv("DELIVERY_AMQP_ORDER", "shuffle")
    assert "shuffle" == Addresses("amqp://h1", name="t").order
    monkeypatch.setenv("DELIVERY_AMQP_ORDER", "random")
    with pytest.raises(BrokerFatal, match="DELIVERY_AMQP_ORDER"):
        Addresses("amqp://h1", name="t")


HOME_NODE_DOWN = ("NOT_FOUND - home node 'rabbit@n1' of durable queue 'd.audit.dead' in vhost '/' "
                  "is down or inaccessible")


@pytest.mark.parametrize("exc", [
    pex.ChannelClosedByBroker(404, HOME_NODE_DOWN),
    pex.ChannelClosedByBroker(541, "INTERNAL_ERROR"),
    pex.ChannelClosedByBroker(541, "INTERNAL_ERROR - Cannot declare a queue 'q' on node 'rabbit@n1': "
                                   "{error,timeout}"),
    pex.ChannelClosedByBroker(404, "NOT_FOUND - failed to perform operation on queue 'q' in vhost '/' "
                                   "due to timeout"),
    pex.ChannelClosedByBroker(404, "NOT_FOUND - queue 'q' in vhost '/' process is stopped by supervisor"),
    pex.ConnectionClosedByBroker(541, "INTERNAL_ERROR"),
])
def test_a_queue_whose_node_or_quorum_is_down_is_unavailable(exc: BaseException) -> None:
    """404 "home node ... is down or inaccessible", 541 and quorum timeouts: the queue exists but cannot be
    reached now -- BrokerUnavailable (retried with backoff), never BrokerFatal (exit 2)."""
    assert unreachable_queue(exc)
    error = classify(exc, url="amqp://guest:secret@h1:5672/%2F,amqp://guest:secret@h2:5672/%2F")
    assert isinstance(error, BrokerUnavailable), error
    assert str(getattr(exc, "reply_code", "")) in str(error) and "secret" not in str(error)


@pytest.mark.parametrize("text", ["NOT_FOUND - no queue 'd.audit.dead' in vhost '/'",
                                  "NOT_FOUND - no queue 'd.timeout.quorum.down or inaccessible' in vhost '/'"])
def test_a_queue_that_does_not_exist_stays_a_plain_404(text: str) -> None:
    """A 404 of a queue that does not exist is what it was (fatal), even when its name reads like an outage."""
    exc = pex.ChannelClosedByBroker(404, text)
    assert not unreachable_queue(exc)
    assert isinstance(classify(exc), BrokerFatal)


REFUSED = AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "Connection refused"))


def test_every_address_failing_is_unavailable_naming_what_each_met() -> None:
    """All nodes down (one refusing, one silent): unavailable, the message naming every node and each failure."""
    error = classify(AMQPConnectionWorkflowFailed([REFUSED, AMQPConnectorStackTimeout("Timeout during handshake")]),
                     url="amqp://guest:secret@h1:5672/%2F,amqp://guest:secret@h2:5673/%2F")
    assert isinstance(error, BrokerUnavailable)
    for words in ("h1:5672", "h2:5673", "Connection refused", "no AMQP handshake"):
        assert words in str(error)
    assert "secret" not in str(error)


def test_credentials_refused_by_a_node_that_answered_are_fatal_though_another_is_down() -> None:
    """A node refusing the login is a person's business even while another node is down (the nodes of a
    cluster share their users)."""
    refused_login = pex.ProbableAuthenticationError(repr(pex.ConnectionClosedByBroker(403, "ACCESS_REFUSED")))
    error = classify(AMQPConnectionWorkflowFailed([REFUSED, refused_login]))
    assert isinstance(error, BrokerFatal) and "authentication failed" in str(error)


def test_the_deployment_file_takes_a_list_of_urls_and_an_order(tmp_path: Path) -> None:
    """``amqp_url = [..]`` is every node, in order; ``amqp_order`` is read; a list that is empty, holds a
    non-string or a malformed multi-host URL is refused naming the key."""
    path = tmp_path / "delivery.toml"
    path.write_text('amqp_url = ["amqp://u:p@h1/%2F", "amqp://u:p@h2:5673,h3/%2F"]\namqp_order = "shuffle"\n')
    dep = parse_file(path)
    assert ["amqp://u:p@h1/%2F", "amqp://u:p@h2:5673/%2F", "amqp://u:p@h3/%2F"] == addresses(dep.amqp_url)
    assert "shuffle" == dep.amqp_order
    for bad in ("[]", "[1]", '["h1:5672"]', '"amqp://u:p@h1/v,h2/v"'):
        path.write_text(f"amqp_url = {bad}\n")
        with pytest.raises(ConfigError, match="amqp_url"):
            parse_file(path)


def test_the_asyncapi_document_names_every_node() -> None:
    """Several addresses: one AsyncAPI server per node, the first still ``rabbitmq``, no credentials."""
    doc = document([], [], url="amqp://u:secret@h1:5672/%2F,amqp://u:secret@h2:5673/%2F")
    assert {"rabbitmq": "h1:5672", "rabbitmq-2": "h2:5673"} == {k: v["host"] for k, v in doc["servers"].items()}
    assert "secret" not in str(doc["servers"])


def test_the_dead_queue_reader_waits_for_a_dead_queue_whose_node_is_down() -> None:
    """dead list/requeue/purge: a dead queue whose home node is down is unavailable (try again), not "does not
    exist" (exit 2 with advice to declare it); a dead queue that does not exist still says so."""
    reader = DeadQueue("amqp://guest:secret@h1:5672/%2F,amqp://guest:secret@h2:5672/%2F", "d.audit.dead")
    assert isinstance(reader._error(pex.ChannelClosedByBroker(404, HOME_NODE_DOWN)), BrokerUnavailable)
    missing = reader._error(pex.ChannelClosedByBroker(404, "NOT_FOUND - no queue 'd.audit.dead' in vhost '/'"))
    assert isinstance(missing, BrokerFatal) and "does not exist" in str(missing) and "secret" not in str(missing)
