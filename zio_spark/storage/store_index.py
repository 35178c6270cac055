"""The PZQ store's in-memory index and delivery: which messages exist, in which state,
who holds them.

:class:`StoreIndex` is the half of :class:`~zio_spark.storage.store.MessageStore` that
hands messages out and takes them back (take, claim, ack, release; the requeue deque,
the delivery cursor, compaction's forwarded keys, pins) and reads records back from the
segment files. Writing, group commit, recovery and compaction are the other half, in
:mod:`zio_spark.storage.store`, whose docstring describes states and delivery order.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from zio_spark.errors import StorageError
from zio_spark.storage.files import RECORD_HEAD
from zio_spark.storage.store_format import (
    LIVE_STATES,
    PART1_STRUCT,
    PENDING_BYTE,
    PUT_STRUCT,
    STATE_ACKED,
    STATE_IN_FLIGHT,
    STATE_PENDING,
    STATE_QUEUED,
    STATE_REQUEUED,
    T_PUT,
    LogFile,
    StoredMessage,
    StoreError,
    parse_message,
)

__all__ = ["StoreIndex"]


class StoreIndex:
    """The index of a store's segment files and the delivery over it (see the module).

    Not thread-safe; one owner thread.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._closed = False
        self._failed = ""
        self._segments: dict[int, LogFile] = {}  # by number, ascending
        self._active: LogFile | None = None
        self._tombstones: list[int] = []  # acked keys for the next commit
        # Delivery: the requeue deque, the cursor (segment no, slot), forwarded keys.
        self._requeue: deque[int] = deque()
        self._cursor_no = 0
        self._cursor_slot = 0
        self._forward: dict[int, int] = {}
        # Pinned in-flight keys (never moved by compaction), and their count per segment.
        self._pinned: set[int] = set()
        self._pins: dict[int, int] = {}
        self._messages = 0
        self._in_flight = 0
        self._in_flight_bytes = 0

    def _current(self, key: int) -> int:
        """``key`` after following compaction's forwarding entries (which stay)."""
        forward = self._forward
        while key in forward:
            key = forward[key]
        return key

    def _resolve(self, key: int) -> int:
        """Follow and drop the forwarding entries of ``key``; the current key."""
        while key in self._forward:
            key = self._forward.pop(key)
        return key

    def _read(self, seg: LogFile, slot: int) -> tuple[int, int, bytes, tuple[bytes, ...]]:
        """(original key or -1, accept seq, id, body) of a slot, read back and CRC-checked."""
        offset = seg.offsets[slot]
        length = seg.lengths[slot]
        data = os.pread(seg.fd, RECORD_HEAD.size + length, offset)
        if len(data) != RECORD_HEAD.size + length or RECORD_HEAD.unpack_from(data, 0)[0] != length:
            raise StoreError(
                f"short read of a record in {seg.path.name} at {offset}", path=self._root
            )
        payload = data[RECORD_HEAD.size :]
        if zlib.crc32(payload) != RECORD_HEAD.unpack_from(data, 0)[1]:
            raise StoreError(
                f"record in {seg.path.name} at {offset} fails its CRC", path=self._root
            )
        if payload[0] == T_PUT:  # single-part fast path
            _, seq, id_len = PUT_STRUCT.unpack_from(payload, 0)
            pos = PUT_STRUCT.size + id_len
            count, part_len = PART1_STRUCT.unpack_from(payload, pos)
            if count == 1 and pos + 8 + part_len == length:
                return -1, seq, payload[PUT_STRUCT.size : pos], (payload[pos + 8 :],)
        return parse_message(payload, payload[0])

    def take(self, *, pin: bool = False) -> StoredMessage | None:
        """Hand out the next deliverable message and mark it in flight.

        Requeued messages come first, then never-delivered ones oldest first. Only
        durable messages are deliverable.

        Parameters
        ----------
        pin
            Keep its key valid until it is acked or released: compaction does not move
            it (see "Pins" in the module docstring).

        Returns
        -------
        StoredMessage or None
            None when nothing is deliverable.

        Raises
        ------
        StoreError
            If the store is closed, or a record cannot be read back (it is then dropped,
            and the error names it).
        """
        if self._closed:
            raise StoreError("the store is closed", path=self._root)
        if pin:
            message = self.take()
            if message is not None:
                self._pin(message.key)
            return message
        while self._requeue:
            key = self._resolve(self._requeue.popleft())
            seg = self._segments.get(key >> 32)
            slot = key & 0xFFFFFFFF
            if seg is None or slot >= len(seg.state):
                continue
            state = seg.state[slot]
            if state in (STATE_QUEUED, STATE_REQUEUED):
                return self._hand_out(seg, slot, key, state == STATE_REQUEUED)
        segments = self._segments
        while True:
            seg = segments.get(self._cursor_no)
            if seg is None:
                later = [no for no in segments if no > self._cursor_no]
                if not later:
                    return None
                self._cursor_no, self._cursor_slot = later[0], 0
                continue
            slot = seg.state.find(PENDING_BYTE, self._cursor_slot)
            if slot >= 0:
                self._cursor_slot = slot + 1
                return self._hand_out(seg, slot, seg.no << 32 | slot, False)
            if seg is self._active or seg.durable < len(seg.state):
                # Wait here: slots from ``durable`` on become P when their commit ends.
                self._cursor_slot = max(self._cursor_slot, seg.durable)
                return None
            later = [no for no in segments if no > seg.no]
            self._cursor_no, self._cursor_slot = later[0], 0

    def _hand_out(self, seg: LogFile, slot: int, key: int, redelivery: bool) -> StoredMessage:
        length = seg.lengths[slot]
        try:
            # _read's single-part case, inlined (the hot path); anything else goes there.
            data = os.pread(seg.fd, RECORD_HEAD.size + length, seg.offsets[slot])
            stored_length, crc = RECORD_HEAD.unpack_from(data, 0)
            payload = data[RECORD_HEAD.size :]
            if (
                stored_length == length
                and len(payload) == length
                and payload[0] == T_PUT
                and zlib.crc32(payload) == crc
            ):
                id_end = PUT_STRUCT.size + PUT_STRUCT.unpack_from(payload, 0)[2]
                count, part_len = PART1_STRUCT.unpack_from(payload, id_end)
                if count == 1 and id_end + 8 + part_len == length:
                    seg.state[slot] = STATE_IN_FLIGHT
                    self._in_flight += 1
                    self._in_flight_bytes += length
                    return StoredMessage(
                        key, payload[PUT_STRUCT.size : id_end], (payload[id_end + 8 :],), redelivery
                    )
            _, _, message_id, body = self._read(seg, slot)
        except (OSError, StorageError, struct.error) as e:
            seg.state[slot] = STATE_ACKED
            seg.live -= 1
            self._messages -= 1
            raise StoreError(
                f"message {key:#x} is unreadable and was dropped: {e}", path=self._root
            ) from e
        seg.state[slot] = STATE_IN_FLIGHT
        self._in_flight += 1
        self._in_flight_bytes += seg.lengths[slot]
        return StoredMessage(key, message_id, body, redelivery)

    def claim(self, key: int) -> StoredMessage | None:
        """Take one particular durable, unacked message (by key) and pin it.

        For a caller that recorded keys it had taken with ``take(pin=True)`` before a
        restart (replay brings them back as pending). It is then in flight, as if
        taken, and counts as a redelivery.

        Returns
        -------
        StoredMessage or None
            None if the key names no pending message (acked, never durable, unknown,
            or already in flight).

        Raises
        ------
        StoreError
            If the store is closed, or the record cannot be read back (it is then
            dropped).
        """
        if self._closed:
            raise StoreError("the store is closed", path=self._root)
        seg = self._segments.get(key >> 32)
        slot = key & 0xFFFFFFFF
        if (
            seg is None
            or slot >= seg.durable
            or seg.state[slot] not in (STATE_PENDING, STATE_QUEUED, STATE_REQUEUED)
        ):
            return None
        # A Q/R key stays in the requeue deque; take() skips it once it is no longer Q/R.
        message = self._hand_out(seg, slot, key, True)
        self._pin(key)
        return message

    def _pin(self, key: int) -> None:
        self._pinned.add(key)
        no = key >> 32
        self._pins[no] = self._pins.get(no, 0) + 1

    def _unpin(self, key: int) -> None:
        if key in self._pinned:
            self._pinned.remove(key)
            no = key >> 32
            left = self._pins[no] - 1
            if left:
                self._pins[no] = left
            else:
                del self._pins[no]

    def _taken(self, key: int) -> tuple[LogFile, int, int] | None:
        """(segment, slot, current key) of an in-flight ``key``, else None."""
        current = self._current(key) if self._forward else key
        seg = self._segments.get(current >> 32)
        slot = current & 0xFFFFFFFF
        if seg is None or slot >= len(seg.state) or seg.state[slot] != STATE_IN_FLIGHT:
            return None
        if current != key:
            self._resolve(key)
        return seg, slot, current

    def _settle(self, key: int) -> tuple[LogFile, int, int] | None:
        """End the flight of ``key`` (unpinned, not counted in flight); its (segment,
        slot, current key) for the caller to set the new state, or None if it was not in
        flight (or the store is closed)."""
        if self._closed:
            return None
        found = self._taken(key)
        if found is not None:
            seg, slot, current = found
            if self._pinned:
                self._unpin(current)
            self._in_flight -= 1
            self._in_flight_bytes -= seg.lengths[slot]
        return found

    def ack(self, key: int) -> bool:
        """Delete an in-flight message: a tombstone goes into the next commit.

        Parameters
        ----------
        key
            A key from :meth:`take`.

        Returns
        -------
        bool
            True if it was in flight; False if unknown or not in flight (nothing changes).
        """
        found = self._settle(key)
        if found is None:
            return False
        seg, slot, current = found
        seg.state[slot] = STATE_ACKED
        seg.live -= 1
        self._messages -= 1
        if not self._failed:
            self._tombstones.append(current)
        return True

    def release(self, key: int, *, delivered: bool = True) -> bool:
        """Put an in-flight message back at the front of the queue (nack, expiry).

        Parameters
        ----------
        key
            A key from :meth:`take`.
        delivered
            Whether the consumer really got it (False: the caller took it but never sent
            it, so its next delivery is not counted as a redelivery).

        Returns
        -------
        bool
            True if it was in flight.
        """
        found = self._settle(key)
        if found is None:
            return False
        seg, slot, current = found
        seg.state[slot] = STATE_REQUEUED if delivered else STATE_QUEUED
        self._requeue.append(current)
        return True

    # ------------------------------------------------------------------ stats

    @property
    def messages(self) -> int:
        """Durable messages not yet acked."""
        return self._messages

    @property
    def in_flight(self) -> int:
        """Messages taken and not acked or released."""
        return self._in_flight

    @property
    def in_flight_bytes(self) -> int:
        """Stored payload bytes of the in-flight messages."""
        return self._in_flight_bytes

    def iter_messages(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        """(id, body) of every durable, unacked message, oldest segment first.

        Reads the disk; for tests and tools, not the hot path.
        """
        for seg in list(self._segments.values()):
            for slot in range(seg.durable):
                if seg.state[slot] in LIVE_STATES:
                    _, _, message_id, body = self._read(seg, slot)
                    yield message_id, body
