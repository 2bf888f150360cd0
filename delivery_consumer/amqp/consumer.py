"""The connection side of ``run``: consume, ack, publish copies, reconnect.

:class:`ConsumerIO` owns pika's ``SelectConnection`` loop in the calling
thread: it declares the consumer's topology, hands each :class:`Delivery` to
a callback, reconnects with backoff and jitter, and acks and publishes the
retry and dead-letter copies (on a confirm channel) when asked from the loop
thread. Delivery tags belong to one channel: each channel gets a
*generation* and an ack for an older one is dropped, never sent (see
docs/amqp.md).

After a ``repartition`` the queue may have a *handover queue* beside it
(``<queue>.handover``): the messages of this queue's keys that waited in the
former layout's queues, older than anything in the queue itself. Each channel
first asks for it; when it is there, its messages are consumed first, all of
them (their count is known: nothing publishes to it any more), and only then
the queue; once every one of them is acked it is deleted
(docs/partitions.md, "Changing the count").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions as pex
from pika.adapters.select_connection import IOLoop, PollEvents

from ..model.deliveries import Delivery, OutMessage
from ..model.errors import BrokerError, BrokerFatal, BrokerUnavailable
from .backoff import Backoff
from .connection import Addresses, classify, open_select, unreachable_queue
from .declare import Missing, Steps, declare_steps
from .publisher import confirm_mode, properties, take_confirmed
from .retry import RECONNECT_CAP_S
from .topology import Topology, upgrade_hint
from .wakeup import Wakeup

log = logging.getLogger("delivery_consumer.broker")
#: How often a run waits to look again at a handover queue another consumer is applying.
HANDOVER_RECHECK_S = 2.0


@dataclass
class _PendingCopies:
    future: Future[None]
    remaining: set[int] = field(default_factory=set)
    failure: str | None = None


class ConsumerIO:
    """The connection side of ``run``; :meth:`run` owns the calling thread.

    *on_delivery* is called in the loop thread for each message and must not
    block (it hands the delivery to the worker). *on_channel* is told the new
    generation after every (re)connect, *on_lost* the generation that died.
    """

    def __init__(
        self,
        url: str,
        topology: Topology,
        *,
        prefetch: int,
        on_delivery: Callable[[Delivery], None],
        on_channel: Callable[[int], None] = lambda gen: None,
        on_lost: Callable[[int, str], None] = lambda gen, why: None,
        name: str = "delivery-consumer run",
        first_connect_s: float | None = None,
    ) -> None:
        self.url = url
        self.topology = topology
        self.prefetch = prefetch
        self._addrs = Addresses(url, name=name)
        self._on_delivery = on_delivery
        self._on_channel_cb = on_channel
        self._on_lost = on_lost
        self.ioloop = IOLoop()
        self._wakeup = Wakeup(self.ioloop)
        self._conn: pika.SelectConnection | None = None
        self._channel: Any = None  # consuming channel (acks go here)
        self._pub: Any = None  # confirm-mode channel for retry / dead copies
        self._pub_seq = 0
        self._pub_pending: dict[int, _PendingCopies] = {}
        #: The copy channel met a nack: once nothing awaits a confirm on it, copies go on a new one (a
        #: channel can stay refused by a queue after a failover while a new one is confirmed: docs/cluster.md).
        self._pub_stale = False
        self._consumer_tag: str | None = None
        #: False once told to stop receiving: later deliveries stay unacked and return
        #: to the head of their queue, in order, when the connection closes.
        self._receiving = True
        self._probe: Any = None  # a channel for the handover queue (a refused passive declare closes it)
        self._phase = "main"  # "probe" -> ("handover" ->) "main", per channel
        self._handover_tag: str | None = None
        self._handover_total = 0
        self._handover_received = 0
        self._handover_last = 0  # delivery tag of the last handover message received
        self._handover_done = False  # every handover message received: delete it once all are acked
        self._acked = 0  # the highest delivery tag acked on the live channel
        self.generation = 0
        self._live_generation = 0  # 0 while no channel is consuming
        self._stopping = False
        #: Seconds to keep trying when no connection ever consumed (None:
        #: forever): a one-shot run with a wrong address must say so in time.
        self._first_connect_s = first_connect_s
        self._started = self._attempt_started = time.monotonic()
        self._ever_consumed = False
        #: The whole topology was declared once by this process: a reconnect declares only what is missing.
        self._declared = False
        self._outage = Backoff()  # the broker being waited out, logged once
        self.fatal: BrokerError | None = None

    # -- lifecycle (loop thread) --
    def run(self) -> None:
        """Connect and consume until :meth:`shutdown_now`; raises BrokerFatal."""
        self._connect()
        self.ioloop.start()
        self._wakeup.close()
        self.ioloop.close()
        if self.fatal is not None:
            raise self.fatal

    def _connect(self) -> None:
        if self._stopping:
            self.ioloop.stop()
            return
        self._attempt_started = time.monotonic()
        self._conn = None  # set once open: each address in turn, failing over at once
        open_select(self._addrs, ioloop=self.ioloop, on_open=self._on_open, on_open_error=self._on_open_error,
                    on_close=self._on_closed)

    def _retry_later(self, why: BrokerError) -> None:
        if self._stopping:
            self.ioloop.stop()
            return
        waited = time.monotonic() - self._started
        if isinstance(why, BrokerFatal) or (
                not self._ever_consumed and self._first_connect_s is not None and waited >= self._first_connect_s):
            if not isinstance(why, BrokerFatal):
                why = BrokerUnavailable(f"the broker could not be reached in {self._first_connect_s:g}s: {why}")
            self.fatal = why
            self._stopping = True
            self.ioloop.stop()
            return
        said = self._outage.fail(str(why))
        # Attempts start at most every backoff: the time a failed attempt took
        # (a handshake that timed out) counts towards the wait.
        delay = self._outage.delay(spent=time.monotonic() - self._attempt_started)
        if self._first_connect_s is not None and not self._ever_consumed:
            delay = max(0.01, min(delay, self._first_connect_s - waited))
        # Logged once per change of state, not once per attempt.
        if said != "same":
            log.warning("%s; reconnecting in %.1fs, then every %.0fs at most until it answers",
                        why, delay, RECONNECT_CAP_S)
        else:
            log.debug("%s; reconnecting in %.1fs (attempt %d)", why, delay, self._outage.tries)
        self.ioloop.call_later(delay, self._connect)

    def _on_open_error(self, _conn: Any, exc: BaseException) -> None:
        self._conn = None
        self._retry_later(classify(exc, url=self.url))

    @property
    def node(self) -> str | None:
        """``host:port`` of the broker node of the current (or last) connection."""
        return self._addrs.node

    def _on_open(self, conn: pika.SelectConnection) -> None:
        self._conn = conn
        conn.channel(on_open_callback=self._on_consume_channel)

    def _on_consume_channel(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_cancel_callback(self._on_cancelled)
        if self._declared:
            conn = self._conn
            if conn is None:
                return
            missing = Missing(lambda then: conn.channel(on_open_callback=then), [self.topology],
                              lambda: self._declared_missing(missing.declared), self._missing_failed)
            missing.start()
            return
        Steps(declare_steps(channel, [self.topology]), self._on_declared).start()

    def _on_declared(self) -> None:
        self._declared = True
        if self._conn is not None:
            self._conn.channel(on_open_callback=self._on_pub_channel)

    def _declared_missing(self, declared: list[str]) -> None:
        if declared:
            log.warning("declared again what was missing on the broker: %s", ", ".join(declared))
        if self._conn is not None:
            self._conn.channel(on_open_callback=self._on_pub_channel)

    def _missing_failed(self, reason: BaseException) -> None:
        """A reconnect's look at the topology got another answer than "exists" or "no such queue": a
        queue whose home node is down, no quorum, a lost connection. Waited out like any outage."""
        error = classify(reason, url=self.url)
        if isinstance(reason, pex.ChannelClosedByBroker) and reason.reply_code == 404:
            error = BrokerUnavailable(f"a queue of {self.topology.queue} is not available: {reason.reply_text}")
        if isinstance(error, BrokerFatal):
            self.fatal, self._stopping = error, True
        else:
            log.error("topology not available: %s", error)
        self._close()

    def _on_pub_channel(self, channel: Any) -> None:
        self._pub = channel
        confirm_mode(channel, on_close=self._on_channel_closed, on_return=self._on_return,
                     on_confirm=self._on_confirm, then=self._on_confirming)

    def _on_confirming(self) -> None:
        self._pub_seq, self._pub_stale = 0, False
        self._channel.basic_qos(prefetch_count=self.prefetch, callback=self._on_qos)

    def _on_qos(self, _frame: Any) -> None:
        if self._stopping:
            self._close()
            return
        self.generation += 1
        gen = self.generation
        self._on_channel_cb(gen)
        self._live_generation = gen
        self._phase, self._acked = "probe", 0
        self._handover_tag, self._handover_done = None, False
        self._handover_total = self._handover_received = self._handover_last = 0
        tries = self._outage.tries
        lasted = self._outage.end()
        if lasted is not None:
            log.warning("broker reachable again after %.0fs (%d attempts)", lasted, tries)
        self._ever_consumed = True
        if self._conn is not None:
            self._conn.channel(on_open_callback=lambda channel: self._on_probe_channel(gen, channel))

    # -- the handover queue a repartition left, before the queue --
    def _on_probe_channel(self, gen: int, channel: Any) -> None:
        if gen != self._live_generation:
            channel.close()
            return
        self._probe = channel
        channel.add_on_close_callback(lambda _ch, reason: self._on_probe_closed(gen, reason))
        self._ask_handover(gen)

    def _ask_handover(self, gen: int) -> None:
        probe = self._probe
        if gen != self._live_generation or self._phase != "probe" or probe is None or not probe.is_open:
            return
        probe.queue_declare(self.topology.handover_queue, passive=True, callback=lambda f: self._on_handover(gen, f))

    def _on_probe_closed(self, gen: int, reason: BaseException) -> None:
        self._probe = None
        if gen != self._live_generation or self._stopping or isinstance(reason, pex.ChannelClosedByClient):
            return
        if isinstance(reason, pex.ChannelClosedByBroker) and reason.reply_code == 404 \
                and not unreachable_queue(reason):
            self._consume_main(gen)  # no handover queue (the usual case), or it is gone
            return
        log.error("channel closed: %s", classify(reason, url=self.url))
        self._close()

    def _on_handover(self, gen: int, frame: Any) -> None:
        if gen != self._live_generation or self._phase != "probe":
            return
        queue, ready, consumers = self.topology.handover_queue, frame.method.message_count, frame.method.consumer_count
        if consumers:  # another run applies it: a standby of this partition elsewhere waits for it to finish
            log.info("%s is being applied by another consumer; waiting for it before consuming %s", queue,
                     self.topology.queue)
            self.ioloop.call_later(HANDOVER_RECHECK_S, lambda: self._ask_handover(gen))
            return
        if not ready:
            self._probe.queue_delete(queue, callback=lambda _f: self._consume_main(gen))
            return
        if not self._receiving:
            return
        self._phase, self._handover_total = "handover", ready
        self._handover_tag = self._channel.basic_consume(
            queue, lambda _ch, method, props, body: self._deliver_handover(gen, method, props, body), auto_ack=False)
        log.info("consuming %s first: %d messages repartition moved here, older than those in %s (prefetch %d, "
                 "channel generation %d)", queue, ready, self.topology.queue, self.prefetch, gen)

    def _deliver_handover(self, gen: int, method: Any, props: Any, body: bytes) -> None:
        if not self._receiving:
            return
        self._handover_received += 1
        self._handover_last = method.delivery_tag
        self._deliver(gen, method, props, body)
        if self._handover_received >= self._handover_total and not self._handover_done:
            # Every one of them is here (nothing publishes to it): the queue's messages come after them.
            self._handover_done = True
            self._consume_main(gen)
            self._drop_handover(gen)

    def _drop_handover(self, gen: int) -> None:
        """Delete the handover queue once every message taken from it is acked (it is empty then)."""
        channel, tag = self._channel, self._handover_tag
        if (gen != self._live_generation or not self._handover_done or tag is None or self._acked < self._handover_last
                or channel is None or not channel.is_open):
            return
        self._handover_tag = None
        queue = self.topology.handover_queue

        def delete(_frame: Any) -> None:
            probe = self._probe
            if probe is not None and probe.is_open:
                probe.queue_delete(queue, callback=lambda _f: log.info("%s applied and deleted", queue))

        channel.basic_cancel(tag, callback=delete)

    def _consume_main(self, gen: int) -> None:
        if gen != self._live_generation or self._phase == "main" or not self._receiving:
            return
        self._phase = "main"
        self._consumer_tag = self._channel.basic_consume(
            self.topology.queue,
            lambda _ch, method, props, body: self._deliver(gen, method, props, body),
            auto_ack=False,
        )
        log.info("consuming %s (prefetch %d, channel generation %d)", self.topology.queue, self.prefetch, gen)

    def _on_cancelled(self, frame: Any) -> None:
        if self._handover_tag is not None and frame.method.consumer_tag == self._handover_tag:
            # Its handover queue was deleted under it (another run applied it): ask again.
            self._handover_tag = None
            if self._phase == "handover":
                self._phase = "probe"
                self._ask_handover(self._live_generation)
            return
        self._reconnect("the broker cancelled the consumer")

    def _deliver(self, gen: int, method: Any, props: Any, body: bytes) -> None:
        if not self._receiving:
            return  # unacked: back to the head of its queue, in order, when the connection closes
        self._on_delivery(
            Delivery(
                generation=gen,
                tag=method.delivery_tag,
                body=body,
                routing_key=method.routing_key,
                redelivered=method.redelivered,
                message_id=props.message_id,
                headers=props.headers or {},
                content_type=props.content_type,
                exchange=method.exchange,
                content_encoding=props.content_encoding,
            )
        )

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if self._stopping and isinstance(reason, pex.ChannelClosedByClient):
            return
        if isinstance(reason, pex.ChannelClosedByClient) and channel is not self._channel \
                and channel is not self._pub:
            return  # a copy channel given up by _renew_pub (or one opened for a generation gone)
        error = classify(reason, url=self.url)
        if self._live_generation == 0 and isinstance(error, BrokerFatal):
            # Failed while declaring: the topology is incompatible; retrying cannot help.
            self.fatal = BrokerFatal(upgrade_hint(str(error), self.topology))
            self._stopping = True
        else:
            log.error("channel closed: %s", error)
        self._close()

    def _on_closed(self, _conn: Any, reason: BaseException) -> None:
        gen, self._live_generation = self._live_generation, 0
        self._conn = self._channel = self._pub = self._probe = None
        self._consumer_tag = self._handover_tag = None
        why = str(classify(reason, url=self.url))
        for pending in list(self._pub_pending.values()):
            self._settle(pending, f"connection lost before the confirm: {why}")
        self._pub_pending.clear()
        if gen:
            self._on_lost(gen, why)
        if self._stopping:
            self.ioloop.stop()
        elif isinstance(reason, pex.ConnectionClosedByClient):
            self._retry_later(BrokerUnavailable("reconnecting after a channel error"))
        else:
            self._retry_later(classify(reason, url=self.url))

    def _close(self) -> None:
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()
        elif conn is not None and not (conn.is_closing or conn.is_closed) and self._stopping:
            # Still connecting (a broker slow to answer): pika cannot close a
            # connection whose set-up is pending (its workflow asserts), so it
            # is left behind; nothing was received on it, the process leaves.
            self._conn = None
            self.ioloop.stop()
        elif conn is None and self._stopping:
            self.ioloop.stop()

    def _reconnect(self, why: str) -> None:
        log.warning("%s; reconnecting", why)
        self._close()

    # -- from another thread or a signal handler --
    def cancel(self) -> None:
        """Stop receiving new deliveries (the connection stays for acks)."""
        self._wakeup.request(self._cancel)

    # -- loop-thread API (for code already running in the loop, e.g. a watched pipe) --
    def soon(self, callback: Callable[[], None]) -> None:
        """Call *callback* on the next turn of the loop (after the current events)."""
        self.ioloop.call_later(0, callback)

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call *on_readable* in the loop whenever *fd* has data."""
        self.ioloop.add_handler(fd, lambda _fd, _events: on_readable(), PollEvents.READ)

    def unwatch(self, fd: int) -> None:
        self.ioloop.remove_handler(fd)

    def ack_now(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        """Acknowledge up to *tag* on channel *generation*, if it still lives."""
        channel = self._channel
        if generation != self._live_generation or channel is None or not channel.is_open:
            log.info("dropping ack of tag %d from channel generation %d (channel gone)", tag, generation)
            return
        channel.basic_ack(tag, multiple=multiple)
        if multiple:  # a single ack says nothing of the tags below it (one may be held unacked)
            self._acked = max(self._acked, tag)
        if self._handover_done:
            self._drop_handover(generation)

    def publish_now(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        """Publish *messages* on the confirm channel; the future resolves when
        every one is confirmed, or fails (BrokerUnavailable) if any was
        returned, nacked or lost -- or if *generation* is no longer live."""
        future: Future[None] = Future()
        pub = self._pub
        if generation == self._live_generation and pub is None and self._conn is not None:
            future.set_exception(BrokerUnavailable("a new channel for the copies is being opened"))
            return future
        if generation != self._live_generation or pub is None or not pub.is_open:
            future.set_exception(BrokerUnavailable("the channel of these deliveries is gone"))
            return future
        pending = _PendingCopies(future)
        for msg in messages:
            pub.basic_publish(msg.exchange, msg.routing_key, msg.body, properties(msg), mandatory=True)
            self._pub_seq += 1
            pending.remaining.add(self._pub_seq)
            self._pub_pending[self._pub_seq] = pending
        return future

    def reconnect_now(self, why: str) -> None:
        """Drop the connection (unacked deliveries return to the queue)."""
        self._reconnect(why)

    def shutdown_now(self) -> None:
        """Stop consuming, close the connection and end :meth:`run`."""
        self._stopping = True
        self._cancel()
        if self._conn is None:
            self.ioloop.stop()
        else:
            self._close()

    # -- confirms and returns of the copies --
    def _on_return(self, _channel: Any, method: Any, _props: Any, _body: bytes) -> None:
        # The return precedes the ack of the same message; the oldest pending
        # group is the one it belongs to (copies are confirmed in order).
        if self._pub_pending:
            first = self._pub_pending[min(self._pub_pending)]
            first.failure = f"copy to {method.routing_key} unroutable: {method.reply_code} {method.reply_text}"

    def _on_confirm(self, frame: Any) -> None:
        ack, settled = take_confirmed(frame, self._pub_pending)
        for tag, pending in settled:
            pending.remaining.discard(tag)
            if not ack:
                pending.failure = pending.failure or "the broker nacked a copy"
            if not pending.remaining:
                self._settle(pending, pending.failure)
        self._pub_stale = self._pub_stale or not ack
        if self._pub_stale and not self._pub_pending:
            self._renew_pub()

    def _renew_pub(self) -> None:
        """Close the copy channel that met a nack and open another: copies sent again go on it."""
        old, conn, gen = self._pub, self._conn, self._live_generation
        self._pub, self._pub_stale = None, False
        if old is not None and old.is_open:
            old.close()
        if conn is None or not conn.is_open or not gen:
            return
        log.info("a copy was nacked: the copies go on a new channel from now on")

        def opened(channel: Any) -> None:
            if gen != self._live_generation or self._stopping:
                channel.close()
                return

            def confirming() -> None:
                if gen != self._live_generation:
                    channel.close()
                    return
                self._pub, self._pub_seq = channel, 0

            confirm_mode(channel, on_close=self._on_channel_closed, on_return=self._on_return,
                         on_confirm=self._on_confirm, then=confirming)

        conn.channel(on_open_callback=opened)

    @staticmethod
    def _settle(pending: _PendingCopies, failure: str | None) -> None:
        if pending.future.done():
            return
        if failure:
            pending.future.set_exception(BrokerUnavailable(failure))
        else:
            pending.future.set_result(None)

    def _cancel(self) -> None:
        # Not basic.cancel: pika rejects (requeue) what arrives between a cancel and its cancel-ok, and
        # a quorum queue puts a rejected message at its tail, behind newer events of its key. What
        # arrives now stays unacked and returns to the head of the queue, in order, with the connection.
        self._receiving = False
