"""Connecting to RabbitMQ, and what a failure means.

:func:`parameters` turns an AMQP URL into pika's connection parameters, with
the timeouts of docs/amqp.md ("Timeouts") unless the URL sets its own;
:func:`redact` drops its password for messages, and :func:`classify` maps
any pika failure to :class:`BrokerFatal` (only what a person must fix:
credentials, vhost, permissions, the URL, queue arguments) or
:class:`BrokerUnavailable` (anything else: try again later), with one clear
line. :data:`FAILURES` is what a pika call may raise.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pika
import pika.exceptions as pex
from pika.adapters.utils.connection_workflow import AMQPConnectorException, AMQPConnectorStackTimeout

from ..errors import BrokerError, BrokerFatal, BrokerUnavailable

# AMQP reply codes (https://www.rabbitmq.com/amqp-0-9-1-reference#constants).
_FATAL_REPLY_CODES = {
    403: "access refused",
    404: "not found",
    406: "precondition failed",
    530: "not allowed (missing vhost or no permission)",
}


#: Heartbeat timeout proposed to the broker (seconds): pika closes a connection
#: on which nothing arrived for one check interval (heartbeat + 5 s), so a
#: silent or half-open broker is detected within 2 * (HEARTBEAT_S + 5) s.
HEARTBEAT_S = 10
#: TCP connect timeout (seconds).
CONNECT_TIMEOUT_S = 5.0
#: The whole connection set-up -- TCP, then the AMQP handshake -- must be done
#: within this (seconds): a broker that accepts TCP and stays silent.
HANDSHAKE_TIMEOUT_S = 10.0
#: A broker under a resource alarm blocks publishers; do not hang forever.
BLOCKED_TIMEOUT_S = 60.0

#: What pika raises: its own errors, socket errors, and the connection
#: workflow's errors (a stack timeout is not an ``AMQPError``).
FAILURES: tuple[type[BaseException], ...] = (pex.AMQPError, OSError, AMQPConnectorException)


def parameters(url: str, *, name: str) -> pika.URLParameters:
    """Connection parameters from an AMQP URL, named for the management UI."""
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises assorted errors for a bad URL
        raise BrokerFatal(f"invalid AMQP URL: {exc}") from None
    params.client_properties = {"connection_name": name, "product": "delivery-consumer"}
    given = parse_qs(urlparse(url).query)
    if "heartbeat" not in given:
        params.heartbeat = HEARTBEAT_S
    if "socket_timeout" not in given:
        params.socket_timeout = CONNECT_TIMEOUT_S
    if "stack_timeout" not in given:
        params.stack_timeout = HANDSHAKE_TIMEOUT_S
    if params.blocked_connection_timeout is None:
        params.blocked_connection_timeout = BLOCKED_TIMEOUT_S
    return params


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        params = pika.URLParameters(url)
    except Exception:
        return "<invalid url>"
    vhost = params.virtual_host
    user = getattr(params.credentials, "username", "?")
    return f"amqp://{user}@{params.host}:{params.port}/{vhost}"


def _innermost(exc: BaseException) -> BaseException:
    """pika wraps a refused socket in two or three layers; find the cause."""
    for _ in range(5):
        inner: BaseException | None = None
        failures = getattr(exc, "exceptions", None)
        wrapped = getattr(exc, "exception", None)  # a connector phase error
        if failures:
            inner = failures[-1]
        elif isinstance(wrapped, BaseException):
            inner = wrapped
        elif exc.args and isinstance(exc.args[0], BaseException):
            inner = exc.args[0]
        if inner is None or isinstance(exc, (pex.ProbableAuthenticationError, pex.AuthenticationError,
                                              pex.ProbableAccessDeniedError)):
            return exc
        exc = inner
    return exc


def classify(exc: BaseException | None, *, url: str = "") -> BrokerError:
    """Map a pika failure to BrokerFatal or BrokerUnavailable, with one clear line."""
    where = f" ({redact(url)})" if url else ""
    if isinstance(exc, BrokerError):
        return exc
    if exc is not None:
        exc = _innermost(exc)
    # pika guesses these from the stage at which the connection closed; only a
    # close sent by the broker (403, 530) is its answer, a lost stream is not.
    refused = "ConnectionClosedByBroker" in str(getattr(exc, "args", ""))
    if isinstance(exc, pex.AuthenticationError) or (isinstance(exc, pex.ProbableAuthenticationError) and refused):
        return BrokerFatal(f"authentication failed{where}: check the user and password")
    if isinstance(exc, pex.ProbableAccessDeniedError) and refused:
        return BrokerFatal(f"access denied{where}: the vhost does not exist or the user may not use it")
    if isinstance(exc, (pex.ProbableAuthenticationError, pex.ProbableAccessDeniedError)):
        return BrokerUnavailable(f"the broker closed the connection during the AMQP handshake{where}")
    if isinstance(exc, pex.IncompatibleProtocolError):
        # Accepted, then closed before the broker said a word: a broker
        # starting or stopping, a proxy or load balancer with no broker behind it.
        return BrokerUnavailable(f"the connection was closed before the AMQP handshake{where} "
                                 "(broker starting or stopping, or a proxy with no broker behind it)")
    if isinstance(exc, AMQPConnectorStackTimeout) or (
            isinstance(exc, pex.ConnectionOpenAborted) and "Timeout while setting up" in str(exc)):
        return BrokerUnavailable(f"no AMQP handshake within the connection timeout{where}: "
                                 "the broker accepted the connection but did not answer")
    if isinstance(exc, pex.AMQPHeartbeatTimeout):
        return BrokerUnavailable(f"nothing heard from the broker within the heartbeat timeout{where}: "
                                 "connection silent or half-open")
    if isinstance(exc, (pex.ConnectionClosedByBroker, pex.ChannelClosedByBroker)):
        code, text = exc.reply_code, exc.reply_text
        if code in _FATAL_REPLY_CODES:
            return BrokerFatal(f"broker refused{where}: {code} {_FATAL_REPLY_CODES[code]}: {text}")
        return BrokerUnavailable(f"broker closed the connection{where}: {code} {text}")
    if exc is None:
        return BrokerUnavailable(f"connection lost{where}")
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return BrokerUnavailable(f"broker unreachable{where}: {text}")

