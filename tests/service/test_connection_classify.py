"""What a broker failure means (amqp.connection.classify), the default timeouts, and the reconnect cap:
only what a person must fix is fatal."""

from __future__ import annotations

import pika.exceptions as pex
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorAMQPHandshakeError,
    AMQPConnectorStackTimeout,
)

from delivery_consumer.amqp.connection import CONNECT_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, HEARTBEAT_S, classify, parameters
from delivery_consumer.amqp.retry import RECONNECT_CAP_S, reconnect_delay_s
from delivery_consumer.model.errors import BrokerFatal, BrokerUnavailable

REFUSED_LOGIN = pex.ConnectionClosedByBroker(403, "ACCESS_REFUSED - Login was refused")
NO_VHOST = pex.ConnectionClosedByBroker(530, "NOT_ALLOWED - vhost x not found")
LOST = pex.StreamLostError("Stream connection lost: ConnectionResetError(104, 'Connection reset by peer')")


@pytest.mark.parametrize(("exc", "words"), [
    (pex.ProbableAuthenticationError(repr(REFUSED_LOGIN)), "authentication failed"),
    (pex.ProbableAccessDeniedError(repr(NO_VHOST)), "access denied"),
    (REFUSED_LOGIN, "403"),
    (pex.ChannelClosedByBroker(406, "PRECONDITION_FAILED - inequivalent arg"), "406"),
])
def test_what_a_person_must_fix_is_fatal(exc: BaseException, words: str) -> None:
    """The broker's own refusal (credentials, vhost, permission, arguments) is BrokerFatal."""
    error = classify(exc)
    assert isinstance(error, BrokerFatal)
    assert words in str(error)


@pytest.mark.parametrize(("exc", "words"), [
    (pex.IncompatibleProtocolError(repr(LOST)), "closed before the AMQP handshake"),
    (AMQPConnectionWorkflowFailed([AMQPConnectorAMQPHandshakeError(pex.IncompatibleProtocolError("EOF"))]),
     "closed before the AMQP handshake"),
    (pex.ProbableAuthenticationError(repr(LOST)), "during the AMQP handshake"),
    (pex.ProbableAccessDeniedError(repr(LOST)), "during the AMQP handshake"),
    (AMQPConnectorStackTimeout("Timeout during AMQP handshake"), "no AMQP handshake"),
    (AMQPConnectionWorkflowFailed([AMQPConnectorStackTimeout("Timeout during AMQP handshake")]),
     "no AMQP handshake"),
    (pex.ConnectionOpenAborted("Connection.close() called before connection finished opening: "
                               "Timeout while setting up AMQP to '127.0.0.1'"), "no AMQP handshake"),
    (pex.AMQPHeartbeatTimeout("No activity or too many missed heartbeats in the last 10 seconds"),
     "heartbeat"),
    (pex.ConnectionClosedByBroker(320, "CONNECTION_FORCED - broker forced connection closure"), "320"),
    (ConnectionRefusedError(111, "Connection refused"), "Connection refused"),
    (LOST, "unreachable"),
    (None, "connection lost"),
])
def test_every_other_failure_is_waited_out(exc: BaseException | None, words: str) -> None:
    """A connection refused, closed before or during the handshake, silent, timed out or forced closed
    is BrokerUnavailable -- never "not an AMQP server"."""
    error = classify(exc, url="amqp://guest:secret@127.0.0.1:5672/%2F")
    assert isinstance(error, BrokerUnavailable)
    assert words in str(error)
    assert "not an AMQP" not in str(error)
    assert "secret" not in str(error)


def test_a_bad_url_is_fatal() -> None:
    """A URL that does not parse is a configuration error."""
    with pytest.raises(BrokerFatal):
        parameters("amqp://guest:guest@127.0.0.1:notaport/%2F", name="t")


def test_timeouts_default_unless_the_url_sets_them() -> None:
    """The documented timeouts apply by default; the URL's own query options win."""
    params = parameters("amqp://guest:guest@127.0.0.1:5672/%2F", name="t")
    assert (params.heartbeat, params.socket_timeout, params.stack_timeout) == (
        HEARTBEAT_S, CONNECT_TIMEOUT_S, HANDSHAKE_TIMEOUT_S)
    params = parameters("amqp://guest:guest@127.0.0.1:5672/%2F?heartbeat=30&socket_timeout=2&stack_timeout=7",
                        name="t")
    assert (params.heartbeat, params.socket_timeout, params.stack_timeout) == (30, 2, 7)


@given(st.integers(min_value=1, max_value=10_000))
def test_reconnect_waits_are_capped(failures: int) -> None:
    """However many attempts failed, the next one comes within the cap (and after half of the grown delay)."""
    delay = reconnect_delay_s(failures)
    assert 0 < delay <= RECONNECT_CAP_S
    assert delay >= min(RECONNECT_CAP_S, 0.5 * 2 ** min(failures - 1, 32)) / 2
