"""Connecting to RabbitMQ, and what a failure means.

A broker *address* is one AMQP URL or several, separated by commas (or
whitespace), or one URL naming several hosts (``amqp://u:p@h1:5672,h2:5673/v``):
``topology.addresses`` splits such a string into full URLs, ``topology.join`` is
its inverse. :class:`Addresses` holds their pika parameters -- the timeouts of
docs/amqp.md ("Timeouts") unless a URL sets its own -- and the order of the next
attempt (as given or shuffled, :data:`ORDER_ENV`; a reconnect starts after the
node it lost); :func:`open_select` and :func:`open_blocking` try them in turn,
failing over at once. :func:`redact` drops the passwords for messages, and
:func:`classify` maps any pika failure to :class:`BrokerFatal` (only what a
person must fix: credentials, vhost, permissions, the URL, queue arguments) or
:class:`BrokerUnavailable` (anything else, a cluster node or queue member down
included: try again later), with one clear line. :data:`FAILURES` is what a
pika call may raise. See docs/amqp.md ("Several addresses").
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, urlparse

import pika
import pika.exceptions as pex
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorException,
    AMQPConnectorStackTimeout,
)

from ..model.errors import BrokerError, BrokerFatal, BrokerUnavailable
from .topology import AMQP_ORDER_ENV, AMQP_ORDERS, AddressError, addresses

log = logging.getLogger("delivery_consumer.broker")

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

#: The environment variable of the order of several addresses, and the orders.
ORDER_ENV, ORDERS = AMQP_ORDER_ENV, AMQP_ORDERS
#: Seconds during which an address that could not be connected to is tried after
#: the others by every client of this process: a silent node costs its handshake
#: timeout once, not once per connection (run's layout check, then its consumer).
RECENT_FAILURE_S = 60.0
_failed_at: dict[tuple[str, int], float] = {}


def _key(params: Any) -> tuple[str, int]:
    return str(params.host), int(params.port)


def note_attempt(params: Any, ok: bool) -> None:
    """Remember whether connecting to *params* worked (see :data:`RECENT_FAILURE_S`)."""
    if ok:
        _failed_at.pop(_key(params), None)
    else:
        _failed_at[_key(params)] = time.monotonic()


def _recently_failed(params: Any) -> bool:
    at = _failed_at.get(_key(params))
    return at is not None and time.monotonic() - at < RECENT_FAILURE_S


def order_from_env() -> str:
    """The order of :data:`ORDER_ENV` (``in-order`` when unset; BrokerFatal when unknown)."""
    value = os.environ.get(ORDER_ENV, "").strip() or ORDERS[0]
    if value not in ORDERS:
        raise BrokerFatal(f"{ORDER_ENV}={value!r}: must be one of {', '.join(ORDERS)}")
    return value


def node_of(params: pika.connection.Parameters) -> str:
    """``host:port`` of one address (how logs and metrics name the node in use)."""
    host = str(params.host)
    return f"[{host}]:{params.port}" if ":" in host else f"{host}:{params.port}"


class Addresses:
    """The broker addresses of one client and the order of its next attempt.

    :meth:`sequence` gives the parameters to try, all of them: as given, or
    shuffled (*order*, default :func:`order_from_env`); the node last
    connected to (:meth:`connected`) goes last, so that a reconnect after
    losing it tries the others first; a node that failed an attempt of this
    process in the last :data:`RECENT_FAILURE_S` goes after the others.
    """

    def __init__(self, url: str, *, name: str, order: str | None = None) -> None:
        self.url = url
        try:
            urls = addresses(url)
        except AddressError as exc:
            raise BrokerFatal(f"invalid AMQP URL: {exc}") from None
        self.params = [parameters(one, name=name) for one in urls]
        self.order = order or order_from_env()
        self._last: int | None = None
        #: ``host:port`` of the node of the open connection (None before the first).
        self.node: str | None = None

    def sequence(self) -> list[pika.URLParameters]:
        """The parameters of the next attempt, in the order to try them."""
        count = len(self.params)
        order = list(range(count))
        if self.order == "shuffle":
            random.shuffle(order)
        if self._last is not None and count > 1:
            if self.order == "shuffle":
                order.remove(self._last)
                order.append(self._last)
            else:
                order = [(self._last + 1 + i) % count for i in range(count)]
        order.sort(key=lambda i: _recently_failed(self.params[i]))  # stable: the order otherwise kept
        return [self.params[i] for i in order]

    def connected(self, params: Any) -> str:
        """Note that the connection with *params* opened; its node, ``host:port``."""
        # pika's connection holds a copy of the parameters it was given: compare by value
        same = [i for i, mine in enumerate(self.params) if mine is params] or \
            [i for i, mine in enumerate(self.params) if mine == params] or \
            [i for i, mine in enumerate(self.params) if (mine.host, mine.port) == (params.host, params.port)]
        if same:
            self._last = same[0]
        self.node = node_of(params)
        return self.node


def describe(conn: Any, node: str) -> str:
    """``<host:port> (cluster <name>, RabbitMQ <version>)`` of an open connection, for the log."""
    props = getattr(conn, "server_properties", None) or {}

    def text(key: str) -> str:
        value = props.get(key)
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")

    about = ", ".join(part for part in (
        f"cluster {text('cluster_name')}" if text("cluster_name") else "",
        f"{text('product')} {text('version')}".strip()) if part)
    return f"{node} ({about})" if about else node


def open_select(
    addrs: Addresses,
    *,
    ioloop: Any,
    on_open: Callable[[Any], None],
    on_open_error: Callable[[Any, BaseException], None],
    on_close: Callable[[Any, BaseException], None],
) -> Opening:
    """Open a ``SelectConnection`` to the first of *addrs* that answers (pika's
    connection workflow: each address in turn, at once). *on_open* gets the open
    connection (with *on_close* added), *on_open_error* ``(None, error)`` when every
    address failed (the error lists each attempt). :meth:`Opening.abort` ends an
    attempt still under way: neither callback is called then."""
    opening = Opening()
    sequence = addrs.sequence()

    def done(result: Any) -> None:
        # the workflow tries the addresses in turn: those before the one that answered failed
        reached = next((i for i, params in enumerate(sequence)
                        if not isinstance(result, BaseException) and _key(params) == _key(result.params)),
                       len(sequence))
        for i, params in enumerate(sequence[:reached + 1]):
            note_attempt(params, ok=i == reached)
        if opening.aborted:
            if not isinstance(result, BaseException) and result.is_open:
                result.close()
            return
        opening.workflow = None
        if isinstance(result, BaseException):
            on_open_error(None, result)
            return
        node = addrs.connected(result.params)
        result.add_on_close_callback(on_close)
        log.info("connected to %s", describe(result, node))
        on_open(result)

    opening.workflow = pika.SelectConnection.create_connection(sequence, done, custom_ioloop=ioloop)
    return opening


class Opening:
    """A connection attempt under way (:func:`open_select`)."""

    def __init__(self) -> None:
        self.workflow: Any = None
        self.aborted = False

    @property
    def pending(self) -> bool:
        return self.workflow is not None and not self.aborted

    def abort(self) -> None:
        """Give the attempt up: its outcome is ignored (a connection it opens is closed). pika's
        own abort asserts while a handshake is pending, so the attempt ends by its timeouts."""
        self.aborted = True


def open_blocking(addrs: Addresses | Sequence[pika.connection.Parameters]) -> pika.BlockingConnection:
    """A ``BlockingConnection`` to the first address that answers; when none does,
    ``AMQPConnectionWorkflowFailed`` listing every attempt's error."""
    sequence = addrs.sequence() if isinstance(addrs, Addresses) else list(addrs)
    errors: list[BaseException] = []
    for params in sequence:
        try:
            conn = pika.BlockingConnection(params)
        except FAILURES as exc:
            errors.append(exc)
            note_attempt(params, ok=False)
            continue
        note_attempt(params, ok=True)
        if isinstance(addrs, Addresses):
            addrs.connected(params)
        log.debug("connected to %s", node_of(params))
        return conn
    raise AMQPConnectionWorkflowFailed(errors)


def parameters(url: str, *, name: str) -> pika.URLParameters:
    """Connection parameters from one AMQP URL, named for the management UI."""
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
    """The address (one URL or several) without its passwords, for messages: every host shown."""
    try:
        urls = addresses(url)
    except AddressError:
        return "<invalid url>"
    return ", ".join(_redact_one(one) for one in urls)


def _redact_one(url: str) -> str:
    try:
        params = pika.URLParameters(url)
    except Exception:
        return "<invalid url>"
    vhost = params.virtual_host
    user = getattr(params.credentials, "username", "?")
    scheme = "amqps" if url.lower().startswith("amqps:") else "amqp"
    return f"{scheme}://{user}@{params.host}:{params.port}/{vhost}"


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


#: A broker's answer about a queue that exists but cannot be reached now: its
#: home node down (a classic queue), no quorum or a timeout of its members (a
#: quorum queue), its process restarting.
_UNREACHABLE_QUEUE = re.compile(
    r"down or inaccessible|time ?out|timed out|stopped by supervisor|nodedown|noproc|quorum|no_?majority"
    r"|not enough members", re.IGNORECASE)


def unreachable_queue(exc: BaseException) -> bool:
    """Whether a broker's close means "the queue exists but is unavailable now" (retry it),
    not a mistake: 541 INTERNAL_ERROR, or a 404 naming its home node down or a timeout."""
    if not isinstance(exc, (pex.ConnectionClosedByBroker, pex.ChannelClosedByBroker)):
        return False
    # queue names are quoted in the text: a queue called "x.timeout" says nothing
    text = re.sub(r"'[^']*'", "''", str(exc.reply_text))
    return exc.reply_code == 541 or (exc.reply_code == 404 and bool(_UNREACHABLE_QUEUE.search(text)))


def classify(exc: BaseException | None, *, url: str = "") -> BrokerError:
    """Map a pika failure to BrokerFatal or BrokerUnavailable, with one clear line.

    A failed attempt at several addresses is fatal when a broker answered so
    (it refused the credentials or the vhost: the nodes of a cluster share
    them; nodes that do not answer do not make that right); else it is
    unavailable, naming what each attempt met.
    """
    where = f" ({redact(url)})" if url else ""
    if isinstance(exc, BrokerError):
        return exc
    attempts = getattr(exc, "exceptions", None)
    if isinstance(exc, AMQPConnectionWorkflowFailed) and attempts and len(attempts) > 1:
        each = [classify(one) for one in attempts]
        fatal = [one for one in each if isinstance(one, BrokerFatal)]
        if fatal:
            return BrokerFatal(f"{fatal[0]}{where}")
        said = list(dict.fromkeys(str(one) for one in each))
        return BrokerUnavailable(f"no broker address answered{where}: {'; '.join(said)}")
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
        if unreachable_queue(exc):
            return BrokerUnavailable(f"queue unavailable{where}: {code} {text} (a node or quorum of the "
                                     "cluster is down; retrying)")
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

