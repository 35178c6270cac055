"""The queue's send side: deliveries to consumers, their acks, requeues.

*send* (consumers connect with ROUTER): deliveries ``[queue id, message id, sent µs, ack
timeout µs, "", *body]`` as the consumer sees them. The message id is the producer's id
(so every redelivery of a message carries the same id). The consumer answers ``[queue id,
message id, "1"]`` (delete it) or ``"0"`` (requeue now); no answer within the ack timeout
requeues it for redelivery (``expired_messages``). Should two stored messages share an
id, the second waits until the first is no longer in flight, so acks stay unambiguous.

``dealer`` mode: the DEALER deals round robin over the connections whose pipe has room;
each pipe holds at most ``inflight`` deliveries, and at most ``inflight`` x connected
consumers are unacked. A socket monitor follows the connections; a message sent before
every open connection was made can only be held by one that closed, so those are
requeued as soon as a connection closes (``vanished_requeued``).

``router`` mode: a ROUTER that knows each consumer: exact per-consumer in-flight limits,
round robin by consumer, and a consumer's messages requeued at once when a send to it
fails (``EHOSTUNREACH``).

The broker (:mod:`zio_spark.pzq.broker`) owns the sockets and the loop and calls
:class:`SendSide` from its thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.pzq import (
    ACK_FAILURE,
    ACK_SUCCESS,
    DELIMITER,
    decode_consumer_ack,
)
from zio_spark.protocol.pzq_inflight import InFlight
from zio_spark.pzq.wire import now_us, readable, recv_frames, send_frames
from zio_spark.storage.store import MessageStore, StoredMessage, StoreError

__all__ = ["SendSide"]

log = logging.getLogger("zio_spark.pzq.broker")


class _Consumer:
    __slots__ = ("ident", "ready")

    def __init__(self, ident: bytes) -> None:
        self.ident = ident
        self.ready = False  # in the round-robin deque


class SendSide:
    """Deliveries and consumer acks over the send socket (see the module docstring).

    Broker thread only. ``counters`` is the broker's counter dict (shared, not copied);
    ``want_pollout(on)`` asks the loop to watch the send socket for room (dealer mode,
    after the DEALER refused a send).
    """

    def __init__(
        self,
        tx: zmq.Socket[bytes],
        events: zmq.Socket[bytes] | None,
        store: MessageStore,
        counters: dict[str, int],
        *,
        dealer: bool,
        inflight: int,
        max_batch: int,
        ack_timeout_us: int,
        want_pollout: Callable[[bool], None],
    ) -> None:
        self.tx = tx
        self.events = events
        self.store = store
        self.counters = counters
        self.dealer = dealer
        self._limit = inflight
        self._max_batch = max_batch
        self._ack_timeout_us = ack_timeout_us
        self._timeout_bytes = str(ack_timeout_us).encode("ascii")
        self._want_pollout = want_pollout
        # dealer mode: one pseudo-consumer b"" holds everything; the cap is global.
        self.inflight = InFlight(None if dealer else inflight)
        self._keys: dict[bytes, int] = {}  # message id -> store key, while in flight
        self._deferred: dict[bytes, list[int]] = {}  # id in flight -> more keys, same id
        self.consumers: dict[bytes, _Consumer] = {}
        self._ready_q: deque[_Consumer] = deque()
        # dealer mode: the consumer connections (fds, from the socket monitor), and
        # whether the DEALER refused a send (all pipes full, or none attached yet).
        self.links: dict[int, int] = {}  # fd -> when we learnt of it (µs)
        self.blocked = False

    @property
    def consumer_count(self) -> int:
        """Consumers known now: connections (dealer mode) or announced peers (router)."""
        return len(self.links if self.dealer else self.consumers)

    def receive(self) -> None:
        """Read consumers' acks and hellos from the send socket."""
        if self.dealer:
            self._receive_dealer_acks()
        else:
            self._receive_consumers()

    def dispatch(self) -> None:
        """Deliver what the store holds, as far as the in-flight limits allow."""
        if self.dealer:
            self._dispatch_dealer()
        else:
            self._dispatch_router()

    def writable(self) -> None:
        """The send socket has room again (POLLOUT): sends may go on."""
        self.blocked = False
        self._want_pollout(False)

    def expire(self, now: int) -> None:
        """Requeue deliveries whose ack timeout passed (``now`` in µs)."""
        inflight = self.inflight
        deadline = inflight.next_deadline()
        if deadline is None or deadline >= now:
            return
        expired = inflight.expired(now)
        self._requeue(expired)
        self.counters["expired_messages"] += len(expired)
        self.refresh()

    def refresh(self) -> None:
        """Make ready again the consumers skipped because their pipe was full."""
        for consumer in self.consumers.values():
            self._make_ready(consumer)

    # ------------------------------------------------------------------ consumers

    def _hello(self, ident: bytes) -> _Consumer:
        consumer = self.consumers.get(ident)
        if consumer is None:
            consumer = self.consumers[ident] = _Consumer(ident)
            log.info("queue: consumer %r connected", ident)
            self._make_ready(consumer)
        return consumer

    def _make_ready(self, consumer: _Consumer) -> None:
        if not consumer.ready and self.inflight.can_send(consumer.ident):
            consumer.ready = True
            self._ready_q.append(consumer)

    def _receive_consumers(self) -> None:
        tx = self.tx
        counters = self.counters
        consumers = self.consumers
        for _ in range(self._max_batch):
            try:
                frames = recv_frames(tx)
            except zmq.Again:
                break
            ident = frames[0]
            if len(frames) == 1 or (len(frames) == 2 and not frames[1]):
                counters["hellos"] += 1
                self._hello(ident)  # PROBE_ROUTER / ROUTER_NOTIFY hello
                continue
            # Fast path for the canonical [id, "1"|"0"] (decode_consumer_ack agrees).
            if len(frames) == 3 and frames[1] and frames[2] in (ACK_SUCCESS, ACK_FAILURE):
                message_id, ok = frames[1], frames[2] == ACK_SUCCESS
            else:
                try:
                    ack = decode_consumer_ack(frames[1:])
                except RemoteProtocolError as e:
                    counters["bad_frames"] += 1
                    log.debug("queue: bad consumer message from %r: %s", ident, e)
                    continue
                message_id, ok = ack.message_id, ack.ok
            consumer = consumers.get(ident) or self._hello(ident)
            if not self._settle(message_id, ok):
                continue
            # The slot freed is usually the acker's; if another consumer held the message
            # (a late ack from an earlier holder), refresh() makes that one ready again.
            if not consumer.ready:
                self._make_ready(consumer)
            if message_id in self._deferred:
                self._release_deferred(message_id)

    def _settle(self, message_id: bytes, ok: bool) -> bool:
        """Apply a consumer's ack (``ok``) or nack to the store and the in-flight table;
        False for an id not in flight (late, already requeued, repeated, unknown)."""
        key = self._keys.pop(message_id, None)
        if key is None:
            self.counters["unknown_acks"] += 1
            return False
        if ok:
            self.inflight.ack(message_id)
            self.store.ack(key)
            self.counters["acked"] += 1
        else:
            self.inflight.nack(message_id)
            self.store.release(key)
            self.counters["nacked"] += 1
        return True

    def _receive_dealer_acks(self) -> None:
        """dealer mode: acks arrive without the consumer's identity (none is needed:
        the in-flight table knows each id)."""
        tx = self.tx
        counters = self.counters
        deferred = self._deferred
        for _ in range(self._max_batch):
            try:
                frames = recv_frames(tx)
            except zmq.Again:
                break
            # Fast path for the canonical [id, "1"|"0"] (decode_consumer_ack agrees).
            if len(frames) == 2 and frames[0] and frames[1] in (ACK_SUCCESS, ACK_FAILURE):
                message_id, ok = frames[0], frames[1] == ACK_SUCCESS
            elif len(frames) == 1 and not frames[0]:
                counters["hellos"] += 1  # a consumer's ZMQ_PROBE_ROUTER: nothing to do
                continue
            else:
                try:
                    ack = decode_consumer_ack(frames)
                except RemoteProtocolError as e:
                    counters["bad_frames"] += 1
                    log.debug("queue: bad consumer message: %s", e)
                    continue
                message_id, ok = ack.message_id, ack.ok
            if self._settle(message_id, ok) and message_id in deferred:
                self._release_deferred(message_id)

    def consumer_links(self) -> None:
        """dealer mode: follow consumer connections with the send socket's monitor.

        A DEALER does not say which connection got a message, but time does: a message
        sent before every connection still open was accepted can only be held by one
        that has gone. So when a connection goes, those are requeued at once (all in
        flight, when it was the last). The rest wait for their ack timeout.
        """
        events = self.events
        assert events is not None
        links = self.links
        gone = False
        for _ in range(1024):
            try:
                event = recv_monitor_message(events, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                links[fd] = now_us()
                log.info("queue: a consumer connected (%d now)", len(links))
            elif links.pop(fd, None) is not None:
                log.info("queue: a consumer went away (%d left)", len(links))
                gone = True
        if gone:
            oldest = min(links.values(), default=2**63)
            gone_ids = self.inflight.drop_sent_before(b"", oldest)
            self._requeue(gone_ids)
            self.counters["vanished_requeued"] += len(gone_ids)

    def _requeue(self, message_ids: list[bytes]) -> None:
        """Put these ids, no longer in flight, back in the store's queue."""
        keys, deferred, store = self._keys, self._deferred, self.store
        for message_id in message_ids:
            key = keys.pop(message_id, None)
            if key is not None:
                store.release(key)
            if message_id in deferred:
                self._release_deferred(message_id)

    def _release_deferred(self, message_id: bytes) -> None:
        for key in self._deferred.pop(message_id, ()):
            self.store.release(key, delivered=False)

    def _drop_consumer(self, consumer: _Consumer) -> None:
        log.info("queue: consumer %r went away", consumer.ident)
        self.consumers.pop(consumer.ident, None)
        if consumer.ready:
            consumer.ready = False
            with contextlib.suppress(ValueError):
                self._ready_q.remove(consumer)
        gone = self.inflight.drop_consumer(consumer.ident)
        self.counters["vanished_requeued"] += len(gone)
        self._requeue(gone)

    # ------------------------------------------------------------------ deliveries

    def _take(self) -> StoredMessage | None:
        """The next message to deliver, or None; an unreadable record is counted (the
        store dropped it) and skipped."""
        while True:
            try:
                return self.store.take()
            except StoreError as e:
                self.counters["errors"] += 1
                log.error("queue: %s", e)

    def _counted(self, message: StoredMessage) -> None:
        self._keys[message.message_id] = message.key
        self.counters["delivered"] += 1
        if message.redelivery:
            self.counters["redelivered"] += 1

    def _dispatch_dealer(self) -> None:
        """dealer mode: the DEALER picks the consumer (round robin over the connections
        whose pipe has room); a refused send waits for POLLOUT."""
        events = self.events
        if events is not None and readable(events):
            # Learn of new connections before sending: one attached since is then
            # known to have been there (see consumer_links).
            self.consumer_links()
        links = self.links
        if self.blocked or not links:
            return
        inflight = self.inflight
        cap = self._limit * len(links)
        if len(inflight) >= cap:
            return
        tx = self.tx
        keys = self._keys
        timeout = self._timeout_bytes
        timeout_us = self._ack_timeout_us
        now = now_us()
        sent_bytes = str(now).encode("ascii")
        for _ in range(min(self._max_batch, cap - len(inflight))):
            message = self._take()
            if message is None:
                break
            message_id = message.message_id
            if message_id in keys:  # another stored copy of this id is in flight: wait
                self._deferred.setdefault(message_id, []).append(message.key)
                continue
            try:
                # encode_delivery(Delivery(id, now, timeout, body)), built directly.
                send_frames(tx, (message_id, sent_bytes, timeout, DELIMITER, *message.body))
            except zmq.Again:  # every pipe is full, or none is attached yet
                self.store.release(message.key, delivered=False)
                self.blocked = True
                self._want_pollout(True)
                break
            inflight.add(message_id, b"", now, timeout_us)
            self._counted(message)

    def _dispatch_router(self) -> None:
        ready = self._ready_q
        if not ready:
            return
        tx = self.tx
        inflight = self.inflight
        keys = self._keys
        timeout = self._timeout_bytes
        now = now_us()
        sent_bytes = str(now).encode("ascii")
        for _ in range(self._max_batch):
            if not ready:
                break
            message = self._take()
            if message is None:
                break
            consumer = ready.popleft()
            message_id = message.message_id
            if message_id in keys:  # another stored copy of this id is in flight: wait
                self._deferred.setdefault(message_id, []).append(message.key)
                ready.appendleft(consumer)
                continue
            # [consumer, *encode_delivery(Delivery(id, now, timeout, body))], built directly.
            frames = [consumer.ident, message_id, sent_bytes, timeout, DELIMITER, *message.body]
            try:
                send_frames(tx, frames)
            except zmq.Again:  # its pipe is full: skip it until it acks something
                consumer.ready = False
                self.store.release(message.key, delivered=False)
                continue
            except zmq.ZMQError:  # EHOSTUNREACH: gone
                consumer.ready = False
                self.store.release(message.key, delivered=False)
                self._drop_consumer(consumer)
                continue
            inflight.add(message_id, consumer.ident, now, self._ack_timeout_us)
            self._counted(message)
            if inflight.can_send(consumer.ident):
                ready.append(consumer)
            else:
                consumer.ready = False
