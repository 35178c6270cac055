"""The queue's receive side: producers' messages into the store, group commits, acks.

*receive* (ROUTER, producers connect with DEALER): ``[id, *extra, "", *body]``. Each
message is put into the store's buffer; when no commit is outstanding, everything
buffered becomes one commit (group commit: one ``fdatasync`` for all producers' messages
since the last one). Only when that commit has ended does each producer get its ack
``[id, "1", "", ""]``. A duplicate (a repeated id that can be a resend, with the body
stored under that id: the store compares body digests) is not stored again and is acked
``1`` once its original is durable; a reused id with a new body is stored, so an ack
always means "this body is stored". Failures get ``[id, "0", "", reason]``: bad frames whose id is
readable, ids over :data:`~zio_spark.storage.store.MAX_ID_BYTES`, oversized messages, a
failed store. Frames without a readable id are dropped and counted (``bad_frames``).

Acks never get dropped silently: a producer over its high-water mark gets them later
(``ROUTER_MANDATORY`` turns the would-be drop into ``EAGAIN``, per peer), from a backlog
of its own, so a producer that reads no acks delays nobody else's. Each backlog is
bounded (``ack_backlog`` acks; all of them together by :data:`MAX_BACKLOG_TOTAL` and
:data:`MAX_BACKLOG_PRODUCERS`): beyond that the oldest acks of the producer stuck longest
are dropped, counted (``acks_dropped``) and logged once per producer. Acks for a producer
that has gone away are counted (``acks_undeliverable``). Either way the producer resends
what it saw no ack for, and the resend is acked as a duplicate.

The broker (:mod:`zio_spark.pzq.broker`) owns the sockets and the loop and calls
:class:`ReceiveSide` from its thread; the commit itself runs in the broker thread (small
commits) or on its sync thread (a :class:`~zio_spark.storage.store.CommitTicket`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

import zmq

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.pzq import (
    ACK_SUCCESS,
    DELIMITER,
    ProducerAck,
    decode_producer_message,
    encode_producer_ack,
)
from zio_spark.pzq.wire import readable, recv_frames, send_frames
from zio_spark.storage.store import (
    CommitTicket,
    MessageRejected,
    MessageStore,
    StoreError,
    body_digest,
)

__all__ = ["MAX_BACKLOG_PRODUCERS", "MAX_BACKLOG_TOTAL", "ReceiveSide"]

log = logging.getLogger("zio_spark.pzq.broker")

# Bounds over all producers' ack backlogs (memory, and the cost of one retry round):
# past either, the producer whose backlog is oldest loses its oldest ack.
MAX_BACKLOG_TOTAL: Final = 1_000_000
MAX_BACKLOG_PRODUCERS: Final = 1024
PRODUCER_WINDOW_S: Final = 60.0  # "producers" counts identities seen this recently
SUCCESS_TAIL: Final = (ACK_SUCCESS, DELIMITER, b"")
_MAX_WARNED: Final = 4096  # producers remembered as already logged for dropped acks
_TOMBSTONE_DELAY_S: Final = 0.05  # acks alone are committed after at most this long...
_TOMBSTONE_BATCH: Final = 4096  # ...or once this many are buffered
_BACKLOG_RETRY_S: Final = 0.01  # retry acks a producer's full pipe refused
_INLINE_COMMIT_PUTS: Final = 8  # commits this small sync in the broker thread

Ack = bytes | tuple[bytes, ...]
"""An ack kept for later: a message id (a success ack, the hot case, stored small) or
the whole ack after the routing id."""


class ReceiveSide:
    """Producers' messages, the duplicate rule, the commit pipeline and the acks.

    Broker thread only. ``counters`` is the broker's counter dict (shared, not copied).
    ``sync`` hands a commit to the sync thread; ``busy`` says whether the flow ports
    have work (then even a small commit goes to the sync thread).
    """

    def __init__(
        self,
        rx: zmq.Socket[bytes],
        store: MessageStore,
        counters: dict[str, int],
        *,
        dedup: str,
        dedup_window: int,
        dedup_grace: float,
        ack_backlog: int,
        max_batch: int,
        sync: Callable[[CommitTicket], None],
        busy: Callable[[], bool],
    ) -> None:
        self.rx = rx
        self.store = store
        self.counters = counters
        self._max_batch = max_batch
        self._dedup = dedup
        self._sync = sync
        self._busy = busy
        # dedup "resend": (producer routing id, message id) of recent puts, oldest
        # first; ids whose success ack is not sent yet (count of copies); ids whose ack
        # was dropped or undeliverable, oldest first. Each bounded by dedup_window
        # (unacked by the commit pipeline and the ack backlogs).
        self._recent: set[tuple[bytes, bytes]] = set()
        self._recent_order: deque[tuple[bytes, bytes]] = deque()
        self._recent_limit = dedup_window
        self._track_acks = dedup == "resend" and dedup_window > 0
        self._unacked: dict[bytes, int] = {}
        self._lost: set[bytes] = set()
        self._lost_order: deque[bytes] = deque()
        self._grace_until = time.monotonic() + dedup_grace
        self.producers: dict[bytes, float] = {}  # routing id -> last seen (monotonic)
        self.acks: list[tuple[bytes, bytes]] = []  # (producer, id) awaiting a commit
        self.ticket: CommitTicket | None = None
        self._ticket_acks: list[tuple[bytes, bytes]] = []
        # Callbacks run once everything put so far is durable (the flow ports), with
        # True, or False if that commit failed; they travel with the acks.
        self.durable_cbs: list[Callable[[bool], None]] = []
        self._ticket_cbs: list[Callable[[bool], None]] = []
        # Acks refused with EAGAIN, per producer routing id; dict order = since when
        # each backlog is non-empty (oldest first). backlogged counts all their acks.
        self.backlogs: dict[bytes, deque[Ack]] = {}
        self.backlogged = 0
        self._ack_backlog = ack_backlog
        self._backlog_total = max(MAX_BACKLOG_TOTAL, ack_backlog)
        self.next_flush = 0.0
        self._warned: set[bytes] = set()  # producers logged for dropped acks
        self.tombstones_since = 0.0
        self._next_prune = time.monotonic() + PRODUCER_WINDOW_S
        self.last_put = 0.0

    # ------------------------------------------------------------------ timing

    def wait(self, now: float) -> float | None:
        """Seconds until this side needs a turn of the loop (0: now; None: no limit)."""
        store = self.store
        if self.ticket is None and (self.acks or store.buffered_puts or self.durable_cbs):
            return 0.0
        wait: float | None = None
        if self.backlogs:
            wait = max(0.0, self.next_flush - now) + 0.001
        if store.pending_tombstones and self.ticket is None:
            due = max(0.0, self.tombstones_since + _TOMBSTONE_DELAY_S - now)
            wait = due if wait is None else min(wait, due)
        return wait

    def housekeeping(self, now: float) -> None:
        """Retry backlogged acks when due; forget producers not seen for a minute."""
        if self.backlogs and now >= self.next_flush:
            self.flush_backlogs()
        if now >= self._next_prune:
            self._next_prune = now + PRODUCER_WINDOW_S
            floor = now - PRODUCER_WINDOW_S
            self.producers = {k: t for k, t in self.producers.items() if t >= floor}

    # ------------------------------------------------------------------ producers

    def receive(self) -> None:
        """Take up to ``max_batch`` producer messages: put, or ack as duplicates."""
        rx = self.rx
        store = self.store
        now = time.monotonic()
        producers = self.producers
        acks = self.acks
        put = store.put
        counters = self.counters
        rule = self._dedup
        scoped = self._track_acks
        recent = self._recent
        unacked = self._unacked
        lost = self._lost
        in_grace = now < self._grace_until
        self.last_put = now
        for _ in range(self._max_batch):
            if not readable(rx):
                break
            try:
                frames = recv_frames(rx)
            except zmq.Again:
                break
            counters["received"] += 1
            ident = frames[0]
            producers[ident] = now
            # Fast path for the canonical [id, "", body] (what decode_producer_message
            # returns for it; tests check they agree); everything else goes to the codec.
            if len(frames) == 4 and frames[2] == DELIMITER and frames[1]:
                message_id = frames[1]
                body: Sequence[bytes] = frames[3:]
            else:
                try:
                    message = decode_producer_message(frames[1:])
                except RemoteProtocolError as e:
                    counters["bad_frames"] += 1
                    log.debug("queue: bad producer message from %r: %s", ident, e)
                    if len(frames) > 1 and frames[1]:
                        self.send_producer_ack(ident, frames[1], False, f"bad message: {e}")
                    continue
                message_id, body = message.message_id, message.body
            if store.failed:
                self.send_producer_ack(ident, message_id, False, f"store failed: {store.failed}")
                continue
            digest = None
            if scoped and (
                (ident, message_id) in recent
                or message_id in unacked
                or message_id in lost
                or (in_grace and store.accepted_before_open(message_id))
            ):
                # Can be a resend of a message whose ack the producer missed, if its body
                # is the one stored under that id: then acked, once the original is
                # durable (with the next commit's acks), not stored. A new body reusing
                # the id (PZQ's producer numbers id-0.. afresh every run) is stored.
                digest = body_digest(body)
                if store.same_body(message_id, digest):
                    counters["duplicates"] += 1
                    unacked[message_id] = unacked.get(message_id, 0) + 1
                    acks.append((ident, message_id))
                    continue
            try:
                key = put(message_id, body, dedup=rule == "global", digest=digest)
            except MessageRejected as e:
                counters["rejected"] += 1
                self.send_producer_ack(ident, message_id, False, str(e))
                continue
            except StoreError as e:
                self.send_producer_ack(ident, message_id, False, str(e))
                continue
            if key is None:
                counters["duplicates"] += 1
            elif scoped:
                self._remember(ident, message_id)
                unacked[message_id] = unacked.get(message_id, 0) + 1
            acks.append((ident, message_id))

    def _remember(self, ident: bytes, message_id: bytes) -> None:
        """Enter a put in the ``resend`` rule's per-connection window (oldest out)."""
        limit = self._recent_limit
        entry = (ident, message_id)
        self._recent.add(entry)
        order = self._recent_order
        order.append(entry)
        if len(order) > limit:
            self._recent.discard(order.popleft())

    def _ack_sent(self, message_id: bytes) -> None:
        """``resend`` rule: the ack of one copy of ``message_id`` left (or it failed)."""
        unacked = self._unacked
        n = unacked.get(message_id)
        if n is not None:
            if n > 1:
                unacked[message_id] = n - 1
            else:
                del unacked[message_id]

    def _ack_lost(self, ack: Ack) -> None:
        """``resend`` rule: a success ack (a bare id) was dropped or undeliverable, so a
        resend of that id is a duplicate (within the window)."""
        if not self._track_acks or not isinstance(ack, bytes):
            return
        self._ack_sent(ack)
        if ack not in self._lost:
            self._lost.add(ack)
            self._lost_order.append(ack)
            if len(self._lost_order) > self._recent_limit:
                self._lost.discard(self._lost_order.popleft())

    # ------------------------------------------------------------------ commits

    def begin_commit(self) -> None:
        """Make everything buffered one commit, unless one is running."""
        if self.ticket is not None:
            return
        store = self.store
        if store.failed:
            if self.acks:  # cannot happen today (puts are refused first); never spin
                self.fail_acks(self.acks, f"store failed: {store.failed}")
                self.acks = []
            self.run_durable_cbs(self.take_durable_cbs(), False)
            return
        if not store.dirty:
            if self.acks:  # only duplicates of durable messages: ack them now
                self.send_acks(self.acks)
                self.acks = []
            self.run_durable_cbs(self.take_durable_cbs(), True)
            return
        if not self.acks and not store.buffered_puts:
            # Only tombstones: batch them a little (a lost one only means a redelivery).
            now = time.monotonic()
            if not self.tombstones_since:
                self.tombstones_since = now
            if (
                store.pending_tombstones < _TOMBSTONE_BATCH
                and now < self.tombstones_since + _TOMBSTONE_DELAY_S
            ):
                return
        self.tombstones_since = 0.0
        acks, self.acks = self.acks, []
        cbs = self.take_durable_cbs()
        try:
            ticket = store.begin_commit()
        except StoreError as e:
            self.fail_acks(acks, str(e))
            self.run_durable_cbs(cbs, False)
            return
        if ticket is None:
            self.send_acks(acks)
            self.run_durable_cbs(cbs, True)
            return
        self.ticket = ticket
        self._ticket_acks = acks
        self._ticket_cbs = cbs
        if ticket.puts <= _INLINE_COMMIT_PUTS and not self._busy():
            # Light load (e.g. one synchronous producer): sync right here. Handing a
            # one-message commit to the sync thread and back cost ~130 µs per message
            # here (two thread wake-ups and the GIL), a fifth of an fdatasync; nothing
            # arrives meanwhile that a pipelined commit could have taken, and libzmq
            # keeps queueing whatever does for the next commit.
            ticket.run()
            self.finish_commit()
            return
        self._sync(ticket)

    def finish_commit(self) -> None:
        """If the running commit has ended: ack its producers (or fail them)."""
        ticket = self.ticket
        if ticket is None or not ticket.done:
            return
        self.ticket = None
        acks, self._ticket_acks = self._ticket_acks, []
        cbs, self._ticket_cbs = self._ticket_cbs, []
        try:
            self.store.end_commit(ticket)
        except StoreError as e:
            # Every put not yet durable is gone: this commit's and the buffered ones.
            self.fail_acks(acks, str(e))
            self.fail_acks(self.acks, str(e))
            self.acks = []
            self.run_durable_cbs(cbs, False)
            self.run_durable_cbs(self.take_durable_cbs(), False)
            return
        self.send_acks(acks)
        self.run_durable_cbs(cbs, True)

    def shutdown(self) -> None:
        """Finish the outstanding commit and commit the buffer, then ack producers."""
        ticket = self.ticket
        store = self.store
        if ticket is not None:
            ticket.wait()
            self.finish_commit()
        if not store.failed and (self.acks or store.dirty or self.durable_cbs):
            try:
                store.commit()
            except StoreError as e:
                self.fail_acks(self.acks, str(e))
                self.run_durable_cbs(self.take_durable_cbs(), False)
            else:
                self.send_acks(self.acks)
                self.run_durable_cbs(self.take_durable_cbs(), True)
            self.acks = []
        self.flush_backlogs()

    def take_durable_cbs(self) -> list[Callable[[bool], None]]:
        cbs, self.durable_cbs = self.durable_cbs, []
        return cbs

    def run_durable_cbs(self, cbs: list[Callable[[bool], None]], ok: bool) -> None:
        for cb in cbs:
            try:
                cb(ok)
            except Exception:  # a bug in a flow port; the broker keeps serving
                self.counters["errors"] += 1
                log.exception("queue broker: a durability callback failed")

    # ------------------------------------------------------------------ acks

    def send_acks(self, acks: list[tuple[bytes, bytes]]) -> None:
        backlogs = self.backlogs
        if backlogs:
            self.flush_backlogs()
        rx = self.rx
        track = self._track_acks
        for ident, message_id in acks:
            if backlogs and ident in backlogs:  # keep each producer's acks in order
                self._defer_ack(ident, message_id)
                continue
            try:
                # [id, "1", "", ""] is encode_producer_ack(ProducerAck(id, True, "")).
                send_frames(rx, (ident, message_id, *SUCCESS_TAIL))
            except zmq.Again:  # this producer's pipe is full (ROUTER_MANDATORY)
                self._defer_ack(ident, message_id)
            except zmq.ZMQError:  # EHOSTUNREACH: the producer went away
                self.counters["acks_undeliverable"] += 1
                self._ack_lost(message_id)
            else:
                if track:
                    self._ack_sent(message_id)

    def fail_acks(self, acks: list[tuple[bytes, bytes]], reason: str) -> None:
        for ident, message_id in acks:
            if self._track_acks:
                self._ack_sent(message_id)  # not stored: a resend must be
            self.send_producer_ack(ident, message_id, False, reason)

    def send_producer_ack(self, ident: bytes, message_id: bytes, ok: bool, reason: str) -> None:
        ack = tuple(encode_producer_ack(ProducerAck(message_id, ok, reason)))
        if ident in self.backlogs:
            self._defer_ack(ident, ack)
            return
        try:
            send_frames(self.rx, (ident, *ack))
        except zmq.Again:
            self._defer_ack(ident, ack)
        except zmq.ZMQError:
            self.counters["acks_undeliverable"] += 1

    def _defer_ack(self, ident: bytes, ack: Ack) -> None:
        """Keep an ack that ``ident``'s full pipe refused, for :meth:`flush_backlogs`.

        Bounded: one producer keeps at most ``ack_backlog`` acks, all together at most
        ``MAX_BACKLOG_TOTAL`` acks of ``MAX_BACKLOG_PRODUCERS`` producers. Past a bound
        an oldest ack is dropped. That is safe: an ack only tells the producer it may
        forget a message. A producer resends what it has no ack for (spec: it "should
        maintain a list of messages sent ... and mark off acknowledged IDs"), and the
        store's duplicate window (ids of the last ``dedup_window`` messages, see
        :meth:`MessageStore.put`) turns the resend into a duplicate that is acked and not
        stored again; a resend later than the window is stored twice (at least once, as
        for any lost ack). A producer this far behind reads no acks anyway.
        """
        backlogs = self.backlogs
        backlog = backlogs.get(ident)
        if backlog is None:
            if len(backlogs) >= MAX_BACKLOG_PRODUCERS:  # the one stuck longest loses all
                self._drop_backlog(next(iter(backlogs)))
            backlog = backlogs[ident] = deque()
        elif len(backlog) >= self._ack_backlog:
            self._ack_lost(backlog.popleft())  # its oldest, to make room
            self.backlogged -= 1
            self._count_dropped(ident, 1)
        backlog.append(ack)
        self.backlogged += 1
        if self.backlogged > self._backlog_total:
            self._drop_oldest_ack()

    def _drop_oldest_ack(self) -> None:
        """Drop the oldest ack of the producer whose backlog is the oldest, counted and
        logged once per producer."""
        backlogs = self.backlogs
        ident = next(iter(backlogs))
        acks = backlogs[ident]
        self._ack_lost(acks.popleft())
        self.backlogged -= 1
        if not acks:
            del backlogs[ident]
        self._count_dropped(ident, 1)

    def _drop_backlog(self, ident: bytes) -> None:
        acks = self.backlogs.pop(ident)
        for ack in acks:
            self._ack_lost(ack)
        self.backlogged -= len(acks)
        self._count_dropped(ident, len(acks))

    def _count_dropped(self, ident: bytes, n: int) -> None:
        self.counters["acks_dropped"] += n
        warned = self._warned
        if ident not in warned:
            if len(warned) >= _MAX_WARNED:
                warned.clear()
            warned.add(ident)
            log.warning(
                "queue: producer %r reads no acks (its pipe is full and its ack backlog "
                "too): dropping its oldest acks; it gets them by resending (acked as "
                "duplicates). Logged once per producer; see acks_dropped",
                ident,
            )

    def flush_backlogs(self) -> None:
        """Send what each producer's backlog holds, oldest first, until its pipe is full
        again: a refusal for one producer does not stop the others (``ROUTER_MANDATORY``
        refuses per peer)."""
        self.next_flush = time.monotonic() + _BACKLOG_RETRY_S
        backlogs = self.backlogs
        rx = self.rx
        sent = 0
        for ident, acks in list(backlogs.items()):
            while acks:
                ack = acks[0]
                try:
                    if isinstance(ack, bytes):
                        send_frames(rx, (ident, ack, *SUCCESS_TAIL))
                    else:
                        send_frames(rx, (ident, *ack))
                except zmq.Again:
                    break
                except zmq.ZMQError:  # EHOSTUNREACH: gone, so are the rest of its acks
                    self.counters["acks_undeliverable"] += len(acks)
                    sent += len(acks)
                    for lost in acks:
                        self._ack_lost(lost)
                    acks.clear()
                    break
                acks.popleft()
                if isinstance(ack, bytes) and self._track_acks:
                    self._ack_sent(ack)
                sent += 1
            if not acks:
                del backlogs[ident]
        self.backlogged -= sent
