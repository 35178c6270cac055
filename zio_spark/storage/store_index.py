"""The PZQ store's in-memory index and delivery: which messages exist, in which state,
who holds them.

A :class:`~zio_spark.storage.store.MessageStore` has one :class:`StoreIndex` (its
``_index``), which hands messages out and takes them back (take, claim, ack, release;
the requeue deque, the delivery cursor, compaction's forwarded keys, pins) and reads
records back from the segment files. Writing, group commit, recovery and compaction are
the store's, in :mod:`zio_spark.storage.store`, whose docstring describes states and
delivery order.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

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
    StoreClosedError,
    StoredMessage,
    StoreError,
    parse_message,
)

__all__ = ["RUN_BYTES", "StoreIndex"]

RUN_BYTES: Final = 256 << 10
"""Most bytes :meth:`StoreIndex.read_taken_run` reads in one ``pread`` (one record
larger than this is read whole)."""


class StoreIndex:
    """The index of a store's segment files and the delivery over it (see the module).

    Owned by one :class:`~zio_spark.storage.store.MessageStore`, which reads and sets its
    attributes: the segments and the active one, the tombstones for the next commit,
    the counts, and the ``closed``/``failed`` state. Not thread-safe; one owner thread.

    Attributes
    ----------
    segments
        ``{no: LogFile}`` ascending; ``active`` is the one being written.
    messages, in_flight, in_flight_bytes
        Durable unacked messages; those taken and not settled, and their stored bytes.
    tombstones
        Acked keys for the next commit (the store takes them).
    requeue, cursor_no, cursor_slot, forward, pinned, pins
        Delivery: released keys first, then the scan cursor; compaction's forwarding
        entries; pinned in-flight keys and their count per segment (never moved).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.closed = False
        self.failed = ""  # why the store failed; "" while healthy
        self.segments: dict[int, LogFile] = {}  # by number, ascending
        self.active: LogFile | None = None
        self.tombstones: list[int] = []  # acked keys for the next commit
        # Delivery: the requeue deque, the cursor (segment no, slot), forwarded keys.
        self.requeue: deque[int] = deque()
        self.cursor_no = 0
        self.cursor_slot = 0
        self.forward: dict[int, int] = {}
        # Pinned in-flight keys (never moved by compaction), and their count per segment.
        self.pinned: set[int] = set()
        self.pins: dict[int, int] = {}
        self.messages = 0
        self.in_flight = 0
        self.in_flight_bytes = 0

    def _current(self, key: int) -> int:
        """``key`` after following compaction's forwarding entries (which stay)."""
        forward = self.forward
        while key in forward:
            key = forward[key]
        return key

    def _resolve(self, key: int) -> int:
        """Follow and drop the forwarding entries of ``key``; the current key."""
        while key in self.forward:
            key = self.forward.pop(key)
        return key

    def read(self, seg: LogFile, slot: int) -> tuple[int, int, bytes, tuple[bytes, ...]]:
        """(original key or -1, accept seq, id, body) of a slot, read back and CRC-checked."""
        offset = seg.offsets[slot]
        length = seg.lengths[slot]
        data = os.pread(seg.fd, RECORD_HEAD.size + length, offset)
        return self._parse(data, 0, length, seg, offset)

    def _parse(
        self, data: bytes, pos: int, length: int, seg: LogFile, offset: int
    ) -> tuple[int, int, bytes, tuple[bytes, ...]]:
        """(original key or -1, accept seq, id, body) of the record of payload ``length``
        at ``data[pos:]``, read from ``offset`` in ``seg``: its head and CRC checked."""
        start = pos + RECORD_HEAD.size
        end = start + length
        if len(data) < end or RECORD_HEAD.unpack_from(data, pos)[0] != length:
            raise StoreError(
                f"short read of a record in {seg.path.name} at {offset}", path=self.root
            )
        view = memoryview(data)[start:end]
        if zlib.crc32(view) != RECORD_HEAD.unpack_from(data, pos)[1]:
            raise StoreError(f"record in {seg.path.name} at {offset} fails its CRC", path=self.root)
        if data[start] == T_PUT:  # single-part fast path: one copy of the id and the body
            _, seq, id_len = PUT_STRUCT.unpack_from(data, start)
            at = start + PUT_STRUCT.size + id_len
            count, part_len = PART1_STRUCT.unpack_from(data, at)
            if count == 1 and at + 8 + part_len == end:
                return -1, seq, data[start + PUT_STRUCT.size : at], (data[at + 8 : end],)
        return parse_message(bytes(view), data[start])

    def read_taken_run(
        self, keys: Sequence[int], max_bytes: int | None = None
    ) -> list[StoredMessage]:
        """As :meth:`~zio_spark.storage.store.MessageStore.read_taken_run`: records that
        lie close together in one segment come with one ``pread`` (up to
        :data:`RUN_BYTES` at a time), each record's head and CRC checked from that
        buffer as :meth:`read` checks them (the single-part case inlined: this is the
        hot path of the queue's range reads)."""
        if self.closed:
            raise StoreClosedError("the store is closed", path=self.root)
        out: list[StoredMessage] = []
        size = 0
        i = 0
        n = len(keys)
        head = RECORD_HEAD.size
        unpack_head = RECORD_HEAD.unpack_from
        unpack_put = PUT_STRUCT.unpack_from
        unpack_part1 = PART1_STRUCT.unpack_from
        id_at = PUT_STRUCT.size
        crc32 = zlib.crc32
        while i < n:
            found = self._flying(keys[i])
            if found is None:
                if out:
                    return out
                raise StoreError(
                    f"message {keys[i]:#x} is not in flight: it cannot be read back",
                    path=self.root,
                )
            seg, slot = found
            offsets, lengths = seg.offsets, seg.lengths
            start = offsets[slot]
            end = start + head + lengths[slot]
            slots = [slot]
            wanted = lengths[slot]  # payload bytes in the run: at least its bodies' bytes
            j = i + 1
            while j < n and (max_bytes is None or size + wanted < max_bytes):
                found = self._flying(keys[j])
                if found is None or found[0] is not seg:
                    break
                s = found[1]
                at = offsets[s]
                stop = at + head + lengths[s]
                if at < end or stop - start > RUN_BYTES:
                    break  # out of order (a requeued message), or the run is full
                slots.append(s)
                wanted += lengths[s]
                end = stop
                j += 1
            try:
                data = os.pread(seg.fd, end - start, start)
            except OSError as e:
                if out:
                    return out
                raise StoreError(
                    f"message {keys[i]:#x} cannot be read back: {e}", path=self.root
                ) from e
            view = memoryview(data)
            got = len(data)
            for key, s in zip(keys[i:j], slots, strict=True):
                pos = offsets[s] - start
                length = lengths[s]
                first = pos + head
                last = first + length
                try:
                    checked = last <= got and unpack_head(data, pos) == (
                        length,
                        crc32(view[first:last]),
                    )
                    if checked and data[first] == T_PUT:
                        id_end = first + id_at + unpack_put(data, first)[2]
                        count, part_len = unpack_part1(data, id_end)
                        if count == 1 and id_end + 8 + part_len == last:
                            message_id = data[first + id_at : id_end]
                            body: tuple[bytes, ...] = (data[id_end + 8 : last],)
                            out.append(StoredMessage(key, message_id, body, True))
                            size += part_len
                            if max_bytes is not None and size >= max_bytes:
                                return out
                            continue
                    # Anything else (a failing check: its precise error) the long way.
                    _, _, message_id, body = self._parse(data, pos, length, seg, offsets[s])
                except (StorageError, struct.error) as e:
                    if out:
                        return out  # the caller's next read starts at this one: its error
                    raise StoreError(
                        f"message {key:#x} cannot be read back: {e}", path=self.root
                    ) from e
                out.append(StoredMessage(key, message_id, body, True))
                size += sum(map(len, body))
                if max_bytes is not None and size >= max_bytes:
                    return out
            i = j
        return out

    def _flying(self, key: int) -> tuple[LogFile, int] | None:
        """(segment, slot) of an in-flight ``key`` (forwarding followed), else None."""
        current = self._current(key) if self.forward else key
        seg = self.segments.get(current >> 32)
        slot = current & 0xFFFFFFFF
        if seg is None or slot >= len(seg.state) or seg.state[slot] != STATE_IN_FLIGHT:
            return None
        return seg, slot

    def take(self, *, pin: bool = False) -> StoredMessage | None:
        """As :meth:`~zio_spark.storage.store.MessageStore.take`."""
        if self.closed:
            raise StoreClosedError("the store is closed", path=self.root)
        if pin:
            message = self.take()
            if message is not None:
                self._pin(message.key)
            return message
        while self.requeue:
            key = self._resolve(self.requeue.popleft())
            seg = self.segments.get(key >> 32)
            slot = key & 0xFFFFFFFF
            if seg is None or slot >= len(seg.state):
                continue
            state = seg.state[slot]
            if state in (STATE_QUEUED, STATE_REQUEUED):
                return self._hand_out(seg, slot, key, state == STATE_REQUEUED)
        segments = self.segments
        while True:
            seg = segments.get(self.cursor_no)
            if seg is None:
                later = [no for no in segments if no > self.cursor_no]
                if not later:
                    return None
                self.cursor_no, self.cursor_slot = later[0], 0
                continue
            slot = seg.state.find(PENDING_BYTE, self.cursor_slot)
            if slot >= 0:
                self.cursor_slot = slot + 1
                return self._hand_out(seg, slot, seg.no << 32 | slot, False)
            if seg is self.active or seg.durable < len(seg.state):
                # Wait here: slots from ``durable`` on become P when their commit ends.
                self.cursor_slot = max(self.cursor_slot, seg.durable)
                return None
            later = [no for no in segments if no > seg.no]
            self.cursor_no, self.cursor_slot = later[0], 0

    def take_keys(self, n: int) -> list[int]:
        """As :meth:`~zio_spark.storage.store.MessageStore.take_keys`: up to ``n`` keys
        in :meth:`take`'s order, handed out pinned, their records not read."""
        if self.closed:
            raise StoreClosedError("the store is closed", path=self.root)
        keys: list[int] = []
        requeue = self.requeue
        while requeue and len(keys) < n:
            key = self._resolve(requeue.popleft())
            seg = self.segments.get(key >> 32)
            slot = key & 0xFFFFFFFF
            if seg is None or slot >= len(seg.state):
                continue
            if seg.state[slot] in (STATE_QUEUED, STATE_REQUEUED):
                self._fly(seg, slot)
                keys.append(key)
        segments = self.segments
        while len(keys) < n:
            seg = segments.get(self.cursor_no)
            if seg is None:
                later = [no for no in segments if no > self.cursor_no]
                if not later:
                    break
                self.cursor_no, self.cursor_slot = later[0], 0
                continue
            state = seg.state
            slot = state.find(PENDING_BYTE, self.cursor_slot)
            while slot >= 0 and len(keys) < n:
                self._fly(seg, slot)
                keys.append(seg.no << 32 | slot)
                self.cursor_slot = slot + 1
                slot = state.find(PENDING_BYTE, slot + 1)
            if len(keys) >= n:
                break
            if seg is self.active or seg.durable < len(state):
                # Wait here: slots from ``durable`` on become P when their commit ends.
                self.cursor_slot = max(self.cursor_slot, seg.durable)
                break
            later = [no for no in segments if no > seg.no]
            self.cursor_no, self.cursor_slot = later[0], 0
        for key in keys:
            self._pin(key)
        return keys

    def _fly(self, seg: LogFile, slot: int) -> None:
        """Mark a slot handed out (in flight), as :meth:`_hand_out` does once read."""
        seg.state[slot] = STATE_IN_FLIGHT
        self.in_flight += 1
        self.in_flight_bytes += seg.lengths[slot]

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
                    self.in_flight += 1
                    self.in_flight_bytes += length
                    return StoredMessage(
                        key, payload[PUT_STRUCT.size : id_end], (payload[id_end + 8 :],), redelivery
                    )
            _, _, message_id, body = self.read(seg, slot)
        except (OSError, StorageError, struct.error) as e:
            seg.state[slot] = STATE_ACKED
            seg.live -= 1
            self.messages -= 1
            raise StoreError(
                f"message {key:#x} is unreadable and was dropped: {e}", path=self.root
            ) from e
        seg.state[slot] = STATE_IN_FLIGHT
        self.in_flight += 1
        self.in_flight_bytes += seg.lengths[slot]
        return StoredMessage(key, message_id, body, redelivery)

    def claim(self, key: int) -> StoredMessage | None:
        """As :meth:`~zio_spark.storage.store.MessageStore.claim`."""
        if self.closed:
            raise StoreClosedError("the store is closed", path=self.root)
        seg = self.segments.get(key >> 32)
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

    def read_taken(self, key: int) -> StoredMessage:
        """As :meth:`~zio_spark.storage.store.MessageStore.read_taken`."""
        if self.closed:
            raise StoreClosedError("the store is closed", path=self.root)
        found = self._flying(key)
        if found is None:
            raise StoreError(
                f"message {key:#x} is not in flight: it cannot be read back", path=self.root
            )
        seg, slot = found
        try:
            _, _, message_id, body = self.read(seg, slot)
        except (OSError, StorageError, struct.error) as e:
            raise StoreError(f"message {key:#x} cannot be read back: {e}", path=self.root) from e
        return StoredMessage(key, message_id, body, True)

    def _pin(self, key: int) -> None:
        self.pinned.add(key)
        no = key >> 32
        self.pins[no] = self.pins.get(no, 0) + 1

    def _unpin(self, key: int) -> None:
        if key in self.pinned:
            self.pinned.remove(key)
            no = key >> 32
            left = self.pins[no] - 1
            if left:
                self.pins[no] = left
            else:
                del self.pins[no]

    def _taken(self, key: int) -> tuple[LogFile, int, int] | None:
        """(segment, slot, current key) of an in-flight ``key``, else None."""
        current = self._current(key) if self.forward else key
        seg = self.segments.get(current >> 32)
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
        if self.closed:
            return None
        found = self._taken(key)
        if found is not None:
            seg, slot, current = found
            if self.pinned:
                self._unpin(current)
            self.in_flight -= 1
            self.in_flight_bytes -= seg.lengths[slot]
        return found

    def ack(self, key: int) -> bool:
        """As :meth:`~zio_spark.storage.store.MessageStore.ack`."""
        found = self._settle(key)
        if found is None:
            return False
        seg, slot, current = found
        seg.state[slot] = STATE_ACKED
        seg.live -= 1
        self.messages -= 1
        if not self.failed:
            self.tombstones.append(current)
        return True

    def release(self, key: int, *, delivered: bool = True) -> bool:
        """As :meth:`~zio_spark.storage.store.MessageStore.release`."""
        found = self._settle(key)
        if found is None:
            return False
        seg, slot, current = found
        seg.state[slot] = STATE_REQUEUED if delivered else STATE_QUEUED
        self.requeue.append(current)
        return True

    def iter_messages(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        """As :meth:`~zio_spark.storage.store.MessageStore.iter_messages`."""
        for seg in list(self.segments.values()):
            for slot in range(seg.durable):
                if seg.state[slot] in LIVE_STATES:
                    _, _, message_id, body = self.read(seg, slot)
                    yield message_id, body
