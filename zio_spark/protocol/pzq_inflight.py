"""The PZQ queue's in-flight table: deliveries awaiting their consumer's ack.

A queue records each delivery here (:meth:`InFlight.add`), forgets it on an ack or nack,
and asks :meth:`InFlight.expired` which ones passed their ack deadline and must be sent
again, with the same expiry rule as :func:`~zio_spark.protocol.pzq.is_expired` on the
consumer side. It also enforces a per-consumer limit on unacked messages. Pure
bookkeeping: no I/O and no clock (callers pass ``now_us``, integer microseconds). The
frames themselves are :mod:`zio_spark.protocol.pzq`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from zio_spark.protocol.pzq_fields import check_message_id, check_time, local_error, show

__all__ = ["InFlight", "InFlightEntry"]

# Rebuild the deadline heap once this many stale entries outnumber the live ones.
_COMPACT_MIN_STALE = 64


@dataclass(frozen=True, slots=True)
class InFlightEntry:
    """One delivery awaiting its consumer's ack.

    Parameters
    ----------
    message_id
        The delivered message's id.
    consumer
        The consumer's routing identity.
    sent_us
        When it was sent, in microseconds.
    timeout_us
        The ack timeout it was sent with, in microseconds.
    """

    message_id: bytes
    consumer: bytes
    sent_us: int
    timeout_us: int

    @property
    def deadline_us(self) -> int:
        """``sent_us + timeout_us``; the entry expires once ``now_us`` passes it."""
        return self.sent_us + self.timeout_us


class InFlight:
    """The queue's table of deliveries awaiting an ack, for redelivery and in-flight limits.

    No clock: callers pass ``now_us``. A message expires when
    ``sent_us + timeout_us < now_us``, the same rule as
    :func:`~zio_spark.protocol.pzq.is_expired`, so the queue resends exactly when a
    consumer would discard. Deadlines sit in a heap; acks delete
    from the table only and leave their heap entry to be skipped later (lazy deletion),
    with a rebuild once stale entries outnumber live ones, so every operation is
    O(log n) amortised.

    Parameters
    ----------
    per_consumer_limit
        Most messages one consumer may hold unacked (``None``: no limit).

    Raises
    ------
    LocalProtocolError
        If ``per_consumer_limit`` is not None or a positive int.
    """

    __slots__ = ("_by_consumer", "_entries", "_heap", "_limit", "_seq", "_stale")

    def __init__(self, per_consumer_limit: int | None = None) -> None:
        if per_consumer_limit is not None and (
            not isinstance(per_consumer_limit, int)
            or isinstance(per_consumer_limit, bool)
            or per_consumer_limit < 1
        ):
            raise local_error(
                "InFlight",
                "per_consumer_limit",
                f"is {per_consumer_limit!r}",
                "None or an int >= 1",
                per_consumer_limit,
            )
        self._limit = per_consumer_limit
        # message id -> (entry, heap sequence number of its live heap item)
        self._entries: dict[bytes, tuple[InFlightEntry, int]] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        self._by_consumer: dict[bytes, int] = {}
        self._seq = 0
        self._stale = 0

    @property
    def per_consumer_limit(self) -> int | None:
        """The limit given at construction."""
        return self._limit

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._entries

    def get(self, message_id: bytes) -> InFlightEntry | None:
        """The entry for ``message_id``, or None if it is not in flight."""
        slot = self._entries.get(message_id)
        return None if slot is None else slot[0]

    def count(self, consumer: bytes) -> int:
        """How many messages ``consumer`` holds unacked."""
        return self._by_consumer.get(consumer, 0)

    def can_send(self, consumer: bytes) -> bool:
        """Whether ``consumer`` is below the per-consumer limit."""
        return self._limit is None or self.count(consumer) < self._limit

    def add(
        self, message_id: bytes, consumer: bytes, sent_us: int, timeout_us: int
    ) -> InFlightEntry:
        """Record that ``message_id`` was sent to ``consumer`` at ``sent_us``.

        Parameters
        ----------
        message_id
            The delivered message's id; must not already be in flight.
        consumer
            The consumer's routing identity.
        sent_us, timeout_us
            Send time and ack timeout, microseconds, each in ``0..MAX_TIMESTAMP_US``.

        Returns
        -------
        InFlightEntry

        Raises
        ------
        LocalProtocolError
            If an argument has the wrong type or range, the id is already in flight, or
            ``consumer`` is at its limit (check :meth:`can_send` first).
        """
        kind = "InFlight.add"
        check_message_id(kind, message_id)
        if not isinstance(consumer, bytes):
            raise local_error(
                kind, "consumer", f"is a {type(consumer).__name__}", "bytes", consumer
            )
        check_time(kind, "sent_us", sent_us)
        check_time(kind, "timeout_us", timeout_us)
        if message_id in self._entries:
            raise local_error(
                kind,
                "message_id",
                f"{show(message_id)} is already in flight",
                "ack, nack or expire it before sending it again",
                message_id,
            )
        if not self.can_send(consumer):
            raise local_error(
                kind,
                "consumer",
                f"{show(consumer)} holds {self.count(consumer)} unacked messages",
                f"fewer than the limit of {self._limit}",
                consumer,
            )
        entry = InFlightEntry(message_id, consumer, sent_us, timeout_us)
        self._seq += 1
        self._entries[message_id] = (entry, self._seq)
        heapq.heappush(self._heap, (entry.deadline_us, self._seq, message_id))
        self._by_consumer[consumer] = self._by_consumer.get(consumer, 0) + 1
        return entry

    def ack(self, message_id: bytes) -> bool:
        """Forget ``message_id`` after a positive ack.

        Returns
        -------
        bool
            True if it was in flight; False for an unknown, late or repeated ack.
        """
        return self._discard(message_id) is not None

    def nack(self, message_id: bytes) -> bool:
        """Forget ``message_id`` after a negative ack; the caller requeues it now.

        Returns
        -------
        bool
            True if it was in flight.
        """
        return self._discard(message_id) is not None

    def drop_consumer(self, consumer: bytes) -> list[bytes]:
        """Forget everything ``consumer`` holds (it went away); the caller requeues them.

        Returns
        -------
        list[bytes]
            The message ids, earliest deadline first.
        """
        return self._drop(consumer, None)

    def drop_sent_before(self, consumer: bytes, before_us: int) -> list[bytes]:
        """Forget what ``consumer`` was sent before ``before_us`` (the caller requeues
        it): for a queue that cannot tell its consumers apart but knows that nobody
        still connected was there to receive those.

        Returns
        -------
        list[bytes]
            The message ids, earliest deadline first.
        """
        return self._drop(consumer, before_us)

    def expired(self, now_us: int) -> list[bytes]:
        """Remove and return the messages whose deadline is before ``now_us``.

        They are no longer in flight: the caller requeues them for redelivery.

        Parameters
        ----------
        now_us
            The current time in microseconds.

        Returns
        -------
        list[bytes]
            Message ids, earliest deadline first (ties in the order they were added).

        Raises
        ------
        LocalProtocolError
            If ``now_us`` is not an int.
        """
        if not isinstance(now_us, int) or isinstance(now_us, bool):
            raise local_error(
                "InFlight.expired", "now_us", f"is a {type(now_us).__name__}", "an int", now_us
            )
        heap = self._heap
        out: list[bytes] = []
        while heap and heap[0][0] < now_us:
            _, seq, message_id = heapq.heappop(heap)
            slot = self._entries.get(message_id)
            if slot is None or slot[1] != seq:
                self._stale -= 1
                continue
            self._forget(slot[0])
            out.append(message_id)
        return out

    def next_deadline(self) -> int | None:
        """The earliest deadline in flight (microseconds), or None when empty.

        :meth:`expired` returns it once ``now_us`` exceeds this value, so a poll loop can
        sleep until then.
        """
        heap = self._heap
        while heap:
            _, seq, message_id = heap[0]
            slot = self._entries.get(message_id)
            if slot is not None and slot[1] == seq:
                return heap[0][0]
            heapq.heappop(heap)
            self._stale -= 1
        return None

    def _drop(self, consumer: bytes, before_us: int | None) -> list[bytes]:
        """Forget what ``consumer`` holds (sent before ``before_us`` if given), earliest
        deadline first, and return those ids."""
        if consumer not in self._by_consumer:
            return []
        held = sorted(
            (
                slot
                for slot in self._entries.values()
                if slot[0].consumer == consumer
                and (before_us is None or slot[0].sent_us < before_us)
            ),
            key=lambda slot: (slot[0].deadline_us, slot[1]),
        )
        for entry, _ in held:
            self._discard(entry.message_id)
        return [entry.message_id for entry, _ in held]

    def _discard(self, message_id: bytes) -> InFlightEntry | None:
        slot = self._entries.get(message_id)
        if slot is None:
            return None
        self._forget(slot[0])
        self._stale += 1
        if self._stale > _COMPACT_MIN_STALE and self._stale > len(self._entries):
            self._heap = [
                (entry.deadline_us, seq, mid) for mid, (entry, seq) in self._entries.items()
            ]
            heapq.heapify(self._heap)
            self._stale = 0
        return slot[0]

    def _forget(self, entry: InFlightEntry) -> None:
        del self._entries[entry.message_id]
        remaining = self._by_consumer[entry.consumer] - 1
        if remaining:
            self._by_consumer[entry.consumer] = remaining
        else:
            del self._by_consumer[entry.consumer]
