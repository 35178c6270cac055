"""Recovery of a PZQ store folder: replay the segment files into the in-memory index.

:class:`Replay` reads ``ids.snap`` and every ``seg-*.log`` oldest first, indexes each
PUT/MOVE record as a pending slot, applies MOVE originals and ACK tombstones, and
rebuilds the duplicate window, with each id's body digest derived from its record (or
read from ``ids.snap`` for ids whose segments are gone). Only the window's records are
hashed, read back once the window is known: recovery's extra cost is bounded by
``dedup_window``, not by the store's size. A segment stops at its first
short, CRC-failing or malformed record: the rest is truncated away and counted (only a
commit that never finished can leave one, unless the disk corrupted data), unless the
rest is all zero bytes: the preallocated tail of a segment that was not closed,
truncated and not counted (see "Crash safety" in :mod:`zio_spark.storage.store_format`).
A segment without even its header (created just before a crash) is deleted. See
:mod:`zio_spark.storage.store`.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import struct
from collections import deque
from pathlib import Path
from typing import Final

from zio_spark.errors import CorruptRecordError, FormatVersionError
from zio_spark.storage.files import RECORD_HEAD, fsync_dir, read_record
from zio_spark.storage.store_format import (
    ACK_STRUCT,
    FORMAT_VERSION,
    HEADER_STRUCT,
    LIVE_STATES,
    MAX_SLOTS,
    SEGMENT_MAGIC,
    SEGMENT_NAME_RE,
    SNAP_NAME,
    STATE_ACKED,
    STATE_MOVED,
    STATE_PENDING,
    T_ACK,
    T_HEADER,
    T_MOVE,
    T_PUT,
    LogFile,
    StoreError,
    decode_snapshot,
    parse_head,
    record_digest,
)

__all__ = ["Replay"]

_ZERO_CHUNK: Final = 1 << 20  # the zero-tail check compares this many bytes at a time

log = logging.getLogger("zio_spark.storage.store")


class Replay:
    """What replaying a store folder found (the store adopts it, then starts a segment).

    Opens every segment file (read and truncated here, never written again); on an error
    the files opened so far are closed again.

    Attributes
    ----------
    segments
        ``{no: LogFile}`` ascending, each with its index columns (slots pending or dead).
    messages
        Live messages found.
    torn
        Torn or corrupt records dropped (one per segment at most; a zero tail is not
        one).
    next_no
        The number for the next new segment.
    last_seq
        The highest accept sequence found (in segments or ``ids.snap``).
    window, window_first, window_ids, window_digests
        The duplicate window: ids in accept order, the seq of ``window[0]``,
        ``{id: seq}`` and ``{id: body digest}`` (of the newest copy; missing if unknown).

    Raises
    ------
    StoreError
        If a segment has an unknown format version.
    OSError
        If the folder cannot be read or a file written.
    """

    def __init__(self, root: Path, *, window_size: int, sync: bool) -> None:
        self.root = root
        self.window_size = window_size
        self.sync = sync
        self.segments: dict[int, LogFile] = {}
        self.messages = 0
        self.torn = 0
        self.next_no = 1
        self.last_seq = 0
        self.window: deque[bytes] = deque()
        self.window_first = 1
        self.window_ids: dict[bytes, int] = {}
        self.window_digests: dict[bytes, bytes] = {}
        try:
            self._run()
        except BaseException:
            for seg in self.segments.values():
                os.close(seg.fd)
            self.segments.clear()
            raise

    def _fsync_dir(self) -> None:
        if self.sync:
            fsync_dir(self.root)

    def _run(self) -> None:
        names = sorted(
            (int(m.group(1)), name)
            for name in os.listdir(self.root)
            if (m := SEGMENT_NAME_RE.match(name)) is not None
        )
        snap = self._read_snapshot()
        # (accept seq, id, digest or b"", key of its record or -1), pruned to ~2 windows
        seen: list[tuple[int, bytes, bytes, int]] = []
        max_seq = snap[1] if snap else 0
        for no, name in names:
            max_seq = max(max_seq, self._replay_segment(no, self.root / name, seen))
            if len(seen) > 2 * self.window_size + 1024:
                seen.sort()
                del seen[: len(seen) - self.window_size]
        if snap is not None:
            self.next_no = max(self.next_no, snap[0])
            seen.extend(
                (seq, mid, digest, -1)
                for seq, mid, digest in zip(itertools.count(snap[2]), snap[3], snap[4])
            )
        self.last_seq = max_seq
        self._rebuild_window(seen)
        log.info(
            "store %s: %d segments, %d messages, %d torn records dropped",
            self.root,
            len(self.segments),
            self.messages,
            self.torn,
        )

    def _replay_segment(
        self, no: int, path: Path, seen: list[tuple[int, bytes, bytes, int]]
    ) -> int:
        """Index one segment file; returns the highest accept seq in it."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        seg = LogFile(no, path, fd, size)
        self.segments[no] = seg  # tombstones may name this segment's own slots
        max_seq = 0
        good = 0
        bad = ""
        windowed = self.window_size > 0
        # Slices of the map are copies (bytes), so no buffer export outlives the map.
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        try:
            pos = 0
            while pos < size:
                assert mm is not None
                got = read_record(mm, pos, size)
                if isinstance(got, str):
                    if not _all_zero(mm, pos, size):
                        bad = got
                    break
                payload, end = got
                length = len(payload)
                kind = payload[0]
                try:
                    if pos == 0:
                        _, magic, version, header_no = HEADER_STRUCT.unpack(payload)
                        if kind != T_HEADER or magic != SEGMENT_MAGIC or header_no != no:
                            bad = "not a segment header"
                            break
                        if version != FORMAT_VERSION:
                            raise StoreError(
                                f"segment {path.name} has format version {version}, "
                                f"expected {FORMAT_VERSION}",
                                path=self.root,
                            )
                    elif kind in (T_PUT, T_MOVE):
                        original, seq, message_id = parse_head(payload, kind)
                        if len(seg.state) >= MAX_SLOTS - 1:
                            bad = "too many records"
                            break
                        if original >= 0:
                            self._kill(original, STATE_MOVED)
                        seg.offsets.append(pos)
                        seg.lengths.append(length)
                        seg.state.append(STATE_PENDING)
                        seg.live += 1
                        self.messages += 1
                        if seq > max_seq:
                            max_seq = seq
                        if windowed:  # its digest is computed if it ends up in the window
                            seen.append((seq, message_id, b"", no << 32 | len(seg.state) - 1))
                    elif kind == T_ACK:
                        _, count = ACK_STRUCT.unpack_from(payload, 0)
                        if ACK_STRUCT.size + 8 * count != length:
                            bad = "bad tombstone record"
                            break
                        for key in struct.unpack_from(f"<{count}Q", payload, ACK_STRUCT.size):
                            self._kill(key, STATE_ACKED)
                    else:
                        bad = f"unknown record type {kind}"
                        break
                except (struct.error, CorruptRecordError) as e:
                    bad = f"malformed record ({e})"
                    break
                pos = end
                good = end
        finally:
            if mm is not None:
                mm.close()
        if bad:
            # Only a commit that never finished can leave this (segments are synced before
            # the next one starts being used), unless the disk itself corrupted data.
            self.torn += 1
            log.warning(
                "store %s: torn or corrupt record in %s at byte %d of %d (%s); truncating",
                self.root,
                path.name,
                good,
                size,
                bad,
            )
        if good < size:  # torn, or the zero tail of a preallocated segment never closed
            os.ftruncate(fd, good)
            if self.sync:
                os.fsync(fd)
            seg.size = seg.end = good
        if good == 0:  # not even a header: a segment created just before the crash
            os.close(fd)
            os.unlink(path)
            del self.segments[no]
            self._fsync_dir()
        seg.durable = len(seg.state)
        self.next_no = max(self.next_no, no + 1)
        return max_seq

    def _kill(self, key: int, state: int) -> None:
        """Mark slot ``key`` dead (``A`` or ``M``), if it is still there and live."""
        seg = self.segments.get(key >> 32)
        slot = key & 0xFFFFFFFF
        if seg is None or slot >= len(seg.state) or seg.state[slot] not in LIVE_STATES:
            return
        seg.state[slot] = state
        seg.live -= 1
        self.messages -= 1

    def _read_snapshot(self) -> tuple[int, int, int, list[bytes], list[bytes]] | None:
        """(next segment no, last seq, first seq, ids, digests) from ids.snap, or None."""
        path = self.root / SNAP_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return decode_snapshot(data)
        except (struct.error, CorruptRecordError, FormatVersionError) as e:
            # Written to a temporary name, synced, then renamed: this is damage, not a crash.
            log.error("store %s: ignoring damaged %s (%s)", self.root, SNAP_NAME, e)
            return None

    def _rebuild_window(self, seen: list[tuple[int, bytes, bytes, int]]) -> None:
        self.window_first = self.last_seq + 1
        if not self.window_size or not seen:
            return
        seen.sort()
        floor = self.last_seq - self.window_size
        window: list[bytes] = []
        sources: list[tuple[bytes, int]] = []  # per position: (digest or b"", key or -1)
        first = expected = 0
        for seq, mid, digest, key in seen:
            if seq <= floor:
                continue  # out of the window
            if seq < expected:  # a second copy: a MOVE, or ids.snap beside a segment
                if seq == expected - 1:
                    known, where = sources[-1]
                    sources[-1] = (known or digest, where if where >= 0 else key)
                continue
            if not window:
                first = expected = seq
            while expected < seq:  # a hole (should not happen): keep positions right
                window.append(b"")
                sources.append((b"", -1))
                expected += 1
            window.append(mid)
            sources.append((digest, key))
            expected += 1
        self.window = deque(window)
        self.window_first = first
        self.window_ids = {mid: seq for seq, mid in zip(itertools.count(first), window) if mid}
        # The newest copy's digest per id: from ids.snap, else from its record. Unknown
        # (ids.snap version 1, segment gone) means the id is not in window_digests.
        newest = {mid: i for i, mid in enumerate(window) if mid}
        digests: dict[bytes, bytes] = {}
        for mid, i in newest.items():
            digest, key = sources[i]
            if not digest and key >= 0:
                digest = self._record_digest(key, len(mid))
            if digest:
                digests[mid] = digest
        self.window_digests = digests

    def _record_digest(self, key: int, id_len: int) -> bytes:
        """The body digest of the PUT/MOVE record ``key`` names, whose id is ``id_len``
        bytes (parsed and CRC-checked by the scan); b"" if it cannot be read back."""
        seg = self.segments.get(key >> 32)
        slot = key & 0xFFFFFFFF
        if seg is None or slot >= len(seg.state):
            return b""
        length = seg.lengths[slot]
        data = os.pread(seg.fd, RECORD_HEAD.size + length, seg.offsets[slot])
        payload = data[RECORD_HEAD.size :]
        if len(payload) != length:
            return b""
        return record_digest(payload, payload[0], id_len)


def _all_zero(mm: mmap.mmap, pos: int, size: int) -> bool:
    """Whether bytes ``pos`` to ``size`` of the map are all zero (a preallocated tail)."""
    while pos < size:
        n = min(_ZERO_CHUNK, size - pos)
        if mm[pos : pos + n] != bytes(n):
            return False
        pos += n
    return True
