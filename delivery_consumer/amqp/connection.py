"""Connecting to RabbitMQ, and what a failure means.

:func:`parameters` turns an AMQP URL into pika's connection parameters,
:func:`redact` drops its password for messages, and :func:`classify` maps
any pika failure to :class:`BrokerFatal` (retrying cannot help) or
:class:`BrokerUnavailable` (try again later), with one clear line.
"""

from __future__ import annotations

import pika
import pika.exceptions as pex

from ..errors import DeliveryError

# AMQP reply codes (https://www.rabbitmq.com/amqp-0-9-1-reference#constants).
_FATAL_REPLY_CODES = {
    403: "access refused",
    404: "not found",
    406: "precondition failed",
    530: "not allowed (missing vhost or no permission)",
}


class BrokerError(DeliveryError):
    """Something went wrong talking to RabbitMQ."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached or dropped us; retrying later may work."""


class BrokerFatal(BrokerError):
    """Retrying cannot help: credentials, vhost, permissions, queue arguments."""


def parameters(url: str, *, name: str) -> pika.URLParameters:
    """Connection parameters from an AMQP URL, named for the management UI."""
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises assorted errors for a bad URL
        raise BrokerFatal(f"invalid AMQP URL: {exc}") from None
    params.client_properties = {"connection_name": name, "product": "delivery-consumer"}
    if params.blocked_connection_timeout is None:
        # A broker under a resource alarm blocks publishers; do not hang forever.
        params.blocked_connection_timeout = 60
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
    if isinstance(exc, (pex.ProbableAuthenticationError, pex.AuthenticationError)):
        return BrokerFatal(f"authentication failed{where}: check the user and password")
    if isinstance(exc, pex.ProbableAccessDeniedError):
        return BrokerFatal(f"access denied{where}: the vhost does not exist or the user may not use it")
    if isinstance(exc, pex.IncompatibleProtocolError):
        return BrokerFatal(f"not an AMQP 0-9-1 server{where}")
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

