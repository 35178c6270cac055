"""The PZQ-style queue's durable message store: segment log, small index, group commit.

Theory of operation (DESIGN.md "The PZQ-style queue"; FACTS.md "Storage")
----------------------------------------------------------------------------
Why a log. On this machine kind append + ``fdatasync`` runs ~800k 1 KiB records/s at
1000 records per commit, sqlite3 (WAL, synchronous=FULL) ~113k and lmdb ~380k; a queue
also deletes every message again, which a log does by appending a tombstone. So the store
is an append-only log of *segment* files with an in-memory index, pure stdlib
(``bench/bench_queue.py --store-only`` re-measures the log against sqlite3).

Files in the store folder::

    seg-<no:010d>.log   segments: records, appended; the newest is the active one
    ids.snap            the duplicate window as of the last segment deletion
    QUEUE_ID            this queue's identity (random, made once), one line
    LOCK                flock: one open store per folder

Records. Every record is ``length u32, crc32 u32`` (little endian) then ``length`` bytes
of payload whose first byte is its type; the CRC covers the whole payload:

- ``HEADER`` (first in each segment): magic ``ZPQS``, format version u16, segment no u64.
- ``PUT``: accept sequence u64, id length u16, id, part count u32, part lengths u32 each,
  then the parts. The accept sequence numbers accepted messages 1, 2, 3, ... over the
  store's life; it orders the duplicate window.
- ``MOVE``: the original key u64, then a PUT's fields: a live message copied forward by
  compaction (below); replay marks the original slot dead.
- ``ACK``: count u32, keys u64 each: tombstones for acknowledged messages.

Keys. A message's *store key* is ``segment no << 32 | slot``, the slot being its index
among the segment's PUT/MOVE records. Keys are opaque ints to callers; they name a record
on disk, so a tombstone needs no lookup table on replay.

Memory. Per message the index holds a record offset (4 B), a payload length (4 B) and a
state byte, in per-segment ``array``/``bytearray`` columns: ~9 B per stored message
however large the bodies, which stay on disk and are read back (``pread``) one at a time
when delivered. Add the duplicate window (``dedup_window`` ids, ~150 B each with their
dict entry) and the requeue/forwarding tables (bounded by what is in flight). Recovery
keeps at most ~2 windows of ids while it scans.

Group commit. :meth:`MessageStore.put` and :meth:`MessageStore.ack` only buffer. A
commit writes the buffer with one ``write`` and one ``fdatasync``, however many messages
it holds. It comes in two forms: :meth:`MessageStore.commit` (synchronous), or
:meth:`MessageStore.begin_commit` → :meth:`CommitTicket.run` (any thread; it only
touches the file) → :meth:`MessageStore.end_commit`, so a server can keep buffering the
next batch and delivering while the disk syncs. One ticket may be outstanding at a time;
tickets complete in order. A put is durable, and its producer may be acked, only after
the commit that covers it has ended; a message is not deliverable
(:meth:`MessageStore.take`) before then. Tombstones ride along with the next commit; one
lost in a crash only means a redelivery.

States (one byte per slot): ``U`` put, not yet durable; ``P`` pending, never handed out
since open; ``Q``/``R`` waiting in the requeue deque (``R``: it was delivered before);
``F`` in flight (taken, awaiting ack/release); ``A`` acknowledged (or dropped); ``M``
moved (a copy lives elsewhere). Delivery order: the requeue deque first, then a cursor
scanning segments oldest first for ``P`` slots: FIFO apart from requeued and compacted
messages.

Segments and reclaiming disk. A commit that takes the active segment past
``segment_bytes`` starts a new one. Segments are deleted oldest first, and only when no
live message is left in them: a tombstone in a later segment may point into any earlier
one, so deleting from the middle could resurrect acked messages on replay. When a new
segment starts and the oldest one is mostly dead (live fraction at most
``compact_ratio``) and the delivery cursor has passed it, its live messages are *moved*:
copied into the new segment as ``MOVE`` records (synced at once), and the old segment is
deleted. Moved keys that callers still hold (in flight, queued) are forwarded
transparently. :meth:`MessageStore.maintain` also retires a fully acked active segment
when the store is idle.

Crash safety. Only records of a commit that had not finished can be torn: replay stops a
segment at its first short or CRC-failing record, truncates the rest away and counts it
(:attr:`StoreStats.torn_records`). Every open starts a fresh segment, so nothing is
ever appended after a torn spot. Everything not acked by a replayed tombstone comes back
as pending: in-flight state is not persisted, so a restart redelivers it.

Duplicates. A producer id already in the window is not stored again
(:meth:`MessageStore.put` returns ``None``; the broker acks it once the original is
durable). The window is the ids of the last ``dedup_window`` accepted messages (default
100,000), whatever their state; ids older than that are forgotten, so a resend that late
is stored twice. Ids are global, not per producer. The window survives restarts: ids of
live segments are read back, and before segments are deleted the durable part of the
window is written to ``ids.snap``.

Failures. An ``OSError`` while committing leaves the on-disk state unknown (after a failed
``fsync`` Linux may drop the dirty pages), so the store turns *failed*: the puts not yet
durable are dropped and every later :meth:`MessageStore.put`/commit raises
:class:`StoreError`. Reads and acks go on in memory; restart (replay) to recover. Only
one process may open a folder (:class:`StoreLockedError`).

Pins. A caller that records store keys durably elsewhere (the queue's flow producer
port, :mod:`zio_spark.pzq.flow_ports`) takes with ``take(pin=True)``: compaction never
moves a pinned message, so its key stays valid across restarts (keys are
``segment << 32 | slot`` and replay rebuilds the same slots). After a restart such a
caller re-takes exactly those messages with :meth:`MessageStore.claim`. A pin ends with
the message's ack or release.

Threads: not thread-safe; one owner thread (the broker's). Only :meth:`CommitTicket.run`
may run elsewhere.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import re
import struct
import threading
import uuid
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from zio_spark.errors import ConfigError, ZioSparkError

__all__ = [
    "DEFAULT_DEDUP_WINDOW",
    "DEFAULT_SEGMENT_BYTES",
    "MAX_BODY_BYTES",
    "MAX_ID_BYTES",
    "CommitTicket",
    "MessageRejected",
    "MessageStore",
    "StoreError",
    "StoreLockedError",
    "StoreStats",
    "StoredMessage",
]

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES: Final = 64 << 20
"""Soft size limit of a segment (a commit may overshoot it by its own size)."""

DEFAULT_DEDUP_WINDOW: Final = 100_000
"""How many of the most recently accepted message ids duplicate detection remembers."""

MAX_ID_BYTES: Final = 255
"""Longest accepted message id; bounds the duplicate window's memory."""

MAX_BODY_BYTES: Final = 1 << 30
"""Largest accepted message (id plus body parts); record offsets are 32-bit."""

FORMAT_VERSION: Final = 1

_MAGIC: Final = b"ZPQS"
_T_HEADER: Final = 0
_T_PUT: Final = 1
_T_MOVE: Final = 2
_T_ACK: Final = 3

_REC: Final = struct.Struct("<II")  # payload length, crc32(payload)
_HEADER: Final = struct.Struct("<B4sHQ")  # type, magic, version, segment no
_PUT: Final = struct.Struct("<BQH")  # type, accept seq, id length
_MOVE: Final = struct.Struct("<BQQH")  # type, original key, accept seq, id length
_ACK: Final = struct.Struct("<BI")  # type, count
_U32: Final = struct.Struct("<I")
_PART1: Final = struct.Struct("<II")  # part count (1), its length
_SNAP: Final = struct.Struct("<4sHQQQI")  # magic, version, next segment, last seq, first, n

_SEG_RE: Final = re.compile(r"^seg-(\d{10})\.log$")
_SNAP_MAGIC: Final = b"ZPQI"
_SNAP_NAME: Final = "ids.snap"
_MAX_SLOTS: Final = 1 << 32
_MAX_SEGMENT_BYTES: Final = 2 << 30  # record offsets are u32; leave room for one big commit
_RECLAIM_BYTES: Final = 1 << 20  # maintain() retires a fully acked active segment this big

# Slot states (see the module docstring).
_U: Final = ord("U")
_P: Final = ord("P")
_Q: Final = ord("Q")
_R: Final = ord("R")
_F: Final = ord("F")
_A: Final = ord("A")
_M: Final = ord("M")
_LIVE: Final = frozenset((_U, _P, _Q, _R, _F))
_P_BYTE: Final = b"P"


class StoreError(ZioSparkError):
    """The store cannot do what was asked: it failed, was closed, or misused.

    ``path`` is the store folder.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else str(path)
        super().__init__(f"{message} (store {path})" if path is not None else message)


class StoreLockedError(StoreError):
    """Another :class:`MessageStore` (this or another process) has the folder open."""


class MessageRejected(StoreError, ValueError):
    """One message cannot be stored (empty or too long id, no body, too large).

    The store itself is fine; only this message is refused.
    """


class StoredMessage(NamedTuple):
    """A message handed out by :meth:`MessageStore.take`.

    Attributes
    ----------
    key
        The store key: give it back to :meth:`MessageStore.ack` or
        :meth:`MessageStore.release`.
    message_id
        The producer's id.
    body
        The body parts, as stored.
    redelivery
        Whether this message was handed out before (since the store was opened).
    """

    key: int
    message_id: bytes
    body: tuple[bytes, ...]
    redelivery: bool


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters and sizes of a :class:`MessageStore`.

    Attributes
    ----------
    messages
        Durable messages not yet acked (pending plus in flight).
    in_flight
        Messages taken and not yet acked or released.
    in_flight_bytes
        Stored payload bytes (id + body + record fields) of the in-flight messages.
    uncommitted
        Puts not yet durable (buffered or in the outstanding commit).
    db_size
        Bytes of segment files on disk (durable).
    segments
        Segment files.
    syncs
        ``fdatasync`` calls made for commits, segment starts and compaction.
    commits
        Commits that wrote something.
    stored
        Puts made durable since open.
    duplicates
        Puts refused as duplicates since open.
    torn_records
        Torn or corrupt records dropped by recovery.
    moved
        Messages copied forward by compaction since open.
    deleted_segments
        Segments deleted since open.
    dedup_ids
        Ids in the duplicate window.
    index_bytes
        Bytes of the per-message index columns.
    failed
        Why the store failed (empty when healthy).
    """

    messages: int
    in_flight: int
    in_flight_bytes: int
    uncommitted: int
    db_size: int
    segments: int
    syncs: int
    commits: int
    stored: int
    duplicates: int
    torn_records: int
    moved: int
    deleted_segments: int
    dedup_ids: int
    index_bytes: int
    failed: str


class _Segment:
    """One segment file and its index columns."""

    __slots__ = (
        "durable",
        "end",
        "fd",
        "lengths",
        "live",
        "needs_sync",
        "no",
        "offsets",
        "path",
        "size",
        "state",
    )

    def __init__(self, no: int, path: Path, fd: int, size: int) -> None:
        self.no = no
        self.path = path
        self.fd = fd
        self.size = size  # durable bytes in the file
        self.end = size  # where the next record goes (durable + being written + buffered)
        self.offsets = array.array("I")  # record offset per slot
        self.lengths = array.array("I")  # payload length per slot
        self.state = bytearray()
        self.live = 0  # slots in a live state
        self.durable = 0  # slots before this one are durable
        self.needs_sync = False  # header and directory entry not yet synced

    def index_bytes(self) -> int:
        return len(self.state) * (self.offsets.itemsize + self.lengths.itemsize + 1)


class CommitTicket:
    """One group commit in progress: bytes to append to one segment, then sync.

    Made by :meth:`MessageStore.begin_commit`; :meth:`run` it (in any thread), then hand
    it to :meth:`MessageStore.end_commit` in the store's thread.
    """

    __slots__ = (
        "_claim",
        "_data",
        "_dir",
        "_done",
        "_fd",
        "_first",
        "_seg",
        "_started",
        "_sync",
        "error",
        "puts",
    )

    def __init__(
        self, seg: _Segment, data: bytes, first: int, puts: int, sync: bool, dir_path: Path | None
    ) -> None:
        self._seg = seg
        self._fd = seg.fd
        self._data = data
        self._first = first
        self.puts = puts
        """How many puts this commit makes durable."""
        self._sync = sync
        self._dir = dir_path
        self._done = threading.Event()
        self._claim = threading.Lock()
        self._started = False
        self.error: OSError | None = None
        """The error writing or syncing raised, if any (set by :meth:`run`)."""

    @property
    def nbytes(self) -> int:
        """Bytes this commit appends."""
        return len(self._data)

    @property
    def done(self) -> bool:
        """Whether :meth:`run` has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`run` has finished; True if it has."""
        return self._done.wait(timeout)

    def run(self) -> None:
        """Write and sync; never raises (an ``OSError`` is kept in :attr:`error`).

        Runs once: a second call (from any thread) returns at once.
        """
        with self._claim:
            if self._started:
                return
            self._started = True
        try:
            _write_all(self._fd, self._data)
            if self._sync:
                os.fdatasync(self._fd)
                if self._dir is not None:
                    _fsync_dir(self._dir)
        except OSError as e:
            self.error = e
        finally:
            self._done.set()


def _check_int(option: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(option, value, f"an integer >= {minimum}")
    return value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)
    if n < len(data):  # rare: a signal or a full disk part way
        view = memoryview(data)[n:]
        while view:
            view = view[os.write(fd, view) :]


def _record(payload: bytes) -> tuple[bytes, bytes]:
    return _REC.pack(len(payload), zlib.crc32(payload)), payload


def _parse_head(payload: bytes, kind: int) -> tuple[int, int, bytes]:
    """(original key or -1, accept seq, id) of a PUT/MOVE payload, checking its layout.

    Raises ValueError (struct.error) on a malformed payload.
    """
    if kind == _T_PUT:
        _, seq, id_len = _PUT.unpack_from(payload, 0)
        pos = _PUT.size
        original = -1
    else:
        _, original, seq, id_len = _MOVE.unpack_from(payload, 0)
        pos = _MOVE.size
    message_id = payload[pos : pos + id_len]
    if len(message_id) != id_len or not id_len:
        raise ValueError("short or empty id")
    pos += id_len
    (count,) = _U32.unpack_from(payload, pos)
    pos += 4
    lengths = struct.unpack_from(f"<{count}I", payload, pos)
    if not count or pos + 4 * count + sum(lengths) != len(payload):
        raise ValueError("part lengths do not add up")
    return original, seq, bytes(message_id)


def _parse_message(payload: bytes, kind: int) -> tuple[int, int, bytes, tuple[bytes, ...]]:
    """(original key or -1, accept seq, id, body parts) of a PUT/MOVE payload."""
    original, seq, message_id = _parse_head(payload, kind)
    pos = (_PUT.size if kind == _T_PUT else _MOVE.size) + len(message_id)
    (count,) = _U32.unpack_from(payload, pos)
    lengths = struct.unpack_from(f"<{count}I", payload, pos + 4)
    pos += 4 + 4 * count
    parts = []
    for n in lengths:
        parts.append(payload[pos : pos + n])
        pos += n
    return original, seq, message_id, tuple(parts)


def _message_payload(
    seq: int, message_id: bytes, body: Sequence[bytes], original: int = -1
) -> bytes:
    if original < 0:
        head = _PUT.pack(_T_PUT, seq, len(message_id))
    else:
        head = _MOVE.pack(_T_MOVE, original, seq, len(message_id))
    lengths = struct.pack(f"<I{len(body)}I", len(body), *map(len, body))
    return b"".join((head, message_id, lengths, *body))


class MessageStore:
    """Durable message store of the PZQ-style queue (see the module docstring).

    Opening replays the folder (creating it if needed), then starts a new segment.

    Parameters
    ----------
    path
        The store folder.
    segment_bytes
        Soft size limit of a segment file, bytes.
    dedup_window
        How many of the most recently accepted message ids are remembered to refuse
        duplicates (0 turns duplicate detection off).
    compact_ratio
        Move the oldest segment's live messages forward once at most this fraction of its
        messages is live (0 turns compaction off: only fully acked segments are deleted).
    sync
        ``fdatasync`` on commit (default). False is for tests and benchmarks only: nothing
        is then durable.

    Raises
    ------
    ConfigError
        For a bad option value.
    StoreLockedError
        If the folder is open in another store.
    StoreError
        If a segment has an unknown format version.
    OSError
        If the folder cannot be read or written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        dedup_window: int = DEFAULT_DEDUP_WINDOW,
        compact_ratio: float = 0.25,
        sync: bool = True,
    ) -> None:
        self._segment_bytes = _check_int("segment_bytes", segment_bytes, 4096)
        if self._segment_bytes > _MAX_SEGMENT_BYTES:
            raise ConfigError("segment_bytes", segment_bytes, f"at most {_MAX_SEGMENT_BYTES}")
        self._window_size = _check_int("dedup_window", dedup_window, 0)
        if (
            isinstance(compact_ratio, bool)
            or not isinstance(compact_ratio, (int, float))
            or not 0 <= compact_ratio < 1
        ):
            raise ConfigError("compact_ratio", compact_ratio, "a number in [0, 1)")
        self._compact_ratio = float(compact_ratio)
        self._sync = bool(sync)
        self._root = Path(path)
        self._closed = False
        self._failed = ""
        self._segments: dict[int, _Segment] = {}  # by number, ascending
        self._active: _Segment | None = None
        self._next_no = 1
        # Write buffer for the active segment: record pieces, first slot, puts, tombstones.
        self._buf: list[bytes] = []
        self._buf_first = 0
        self._buf_puts = 0
        self._buf_seq = 0
        self._tombstones: list[int] = []
        self._ticket: CommitTicket | None = None
        self._ticket_seq = 0
        # Delivery: the requeue deque, the cursor (segment no, slot), forwarded keys.
        self._requeue: deque[int] = deque()
        self._cursor_no = 0
        self._cursor_slot = 0
        self._forward: dict[int, int] = {}
        # Pinned in-flight keys (never moved by compaction), and their count per segment.
        self._pinned: set[int] = set()
        self._pins: dict[int, int] = {}
        # Duplicate window: ids in accept order; _window_first is the seq of _window[0].
        self._last_seq = 0
        self._durable_seq = 0
        self._window: deque[bytes] = deque()
        self._window_first = 1
        self._window_ids: dict[bytes, int] = {}
        self._open_seq = 0  # the last accept seq found on disk when opened
        # Counters.
        self._messages = 0
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._syncs = 0
        self._commits = 0
        self._stored = 0
        self._duplicates = 0
        self._torn = 0
        self._moved = 0
        self._deleted = 0
        self._lock_fd = -1
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = self._take_lock()
            self.queue_id: bytes = self._load_queue_id()
            """This queue's identity: random, made when the folder was created."""
            self._recover()
            self._open_seq = self._last_seq
            self._open_segment()
            self._sync_new_segment()
            self._reclaim()
        except BaseException:
            self._close_files()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _take_lock(self) -> int:
        fd = os.open(self._root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError("the folder is open in another store", path=self._root) from None
        return fd

    def _load_queue_id(self) -> bytes:
        path = self._root / "QUEUE_ID"
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text("ascii").strip()
            if text:
                return text.encode("ascii")
        value = f"pzq-{uuid.uuid4().hex[:16]}"
        tmp = path.with_name(".QUEUE_ID.tmp")
        tmp.write_text(value + "\n", "ascii")
        if self._sync:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        tmp.replace(path)
        self._fsync_dir()
        return value.encode("ascii")

    def close(self) -> None:
        """Finish the outstanding commit, commit what is buffered, close; idempotent.

        Raises
        ------
        StoreError
            If that last commit fails (the files are closed anyway).
        """
        if self._closed:
            return
        try:
            ticket = self._ticket
            if ticket is not None:
                ticket.run()  # no-op if another thread runs or ran it
                ticket.wait()
                self.end_commit(ticket)
            if not self._failed and self.dirty:
                self.commit()
        finally:
            self._closed = True
            self._close_files()

    def _close_files(self) -> None:
        for seg in self._segments.values():
            with contextlib.suppress(OSError):
                os.close(seg.fd)
        self._segments.clear()
        self._active = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        """The store folder."""
        return self._root

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> str:
        """Why the store failed, or ``""`` while healthy."""
        return self._failed

    def _check_writable(self) -> None:
        if self._closed:
            raise StoreError("the store is closed", path=self._root)
        if self._failed:
            raise StoreError(f"the store failed: {self._failed}; restart it", path=self._root)

    def _fsync_dir(self) -> None:
        if self._sync:
            _fsync_dir(self._root)

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        names = sorted(
            (int(m.group(1)), name)
            for name in os.listdir(self._root)
            if (m := _SEG_RE.match(name)) is not None
        )
        snap = self._read_snapshot()
        seen: list[tuple[int, bytes]] = []  # (accept seq, id), pruned to ~2 windows
        max_seq = snap[1] if snap else 0
        for no, name in names:
            max_seq = max(max_seq, self._replay_segment(no, self._root / name, seen))
            if len(seen) > 2 * self._window_size + 1024:
                seen.sort()
                del seen[: len(seen) - self._window_size]
        if snap is not None:
            self._next_no = max(self._next_no, snap[0])
            seen.extend(zip(itertools.count(snap[2]), snap[3]))
        self._last_seq = self._durable_seq = max_seq
        self._rebuild_window(seen)
        if self._segments:
            self._cursor_no = next(iter(self._segments))
        log.info(
            "store %s: %d segments, %d messages, %d torn records dropped",
            self._root,
            len(self._segments),
            self._messages,
            self._torn,
        )

    def _replay_segment(self, no: int, path: Path, seen: list[tuple[int, bytes]]) -> int:
        """Index one segment file; returns the highest accept seq in it."""
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        seg = _Segment(no, path, fd, size)
        self._segments[no] = seg  # tombstones may name this segment's own slots
        max_seq = 0
        good = 0
        bad = ""
        windowed = self._window_size > 0
        # Slices of the map are copies (bytes), so no buffer export outlives the map.
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        try:
            pos = 0
            while pos < size:
                assert mm is not None
                if pos + _REC.size > size:
                    bad = "short record header"
                    break
                length, crc = _REC.unpack_from(mm, pos)
                start = pos + _REC.size
                end = start + length
                if length == 0 or end > size:
                    bad = f"record length {length} runs past the end"
                    break
                payload = mm[start:end]
                if zlib.crc32(payload) != crc:
                    bad = "CRC mismatch"
                    break
                kind = payload[0]
                try:
                    if pos == 0:
                        _, magic, version, header_no = _HEADER.unpack(payload)
                        if kind != _T_HEADER or magic != _MAGIC or header_no != no:
                            bad = "not a segment header"
                            break
                        if version != FORMAT_VERSION:
                            raise StoreError(
                                f"segment {path.name} has format version {version}, "
                                f"expected {FORMAT_VERSION}",
                                path=self._root,
                            )
                    elif kind in (_T_PUT, _T_MOVE):
                        original, seq, message_id = _parse_head(payload, kind)
                        if len(seg.state) >= _MAX_SLOTS - 1:
                            bad = "too many records"
                            break
                        if original >= 0:
                            self._kill(original, _M)
                        seg.offsets.append(pos)
                        seg.lengths.append(length)
                        seg.state.append(_P)
                        seg.live += 1
                        self._messages += 1
                        if seq > max_seq:
                            max_seq = seq
                        if windowed:
                            seen.append((seq, message_id))
                    elif kind == _T_ACK:
                        _, count = _ACK.unpack_from(payload, 0)
                        if _ACK.size + 8 * count != length:
                            bad = "bad tombstone record"
                            break
                        for key in struct.unpack_from(f"<{count}Q", payload, _ACK.size):
                            self._kill(key, _A)
                    else:
                        bad = f"unknown record type {kind}"
                        break
                except (struct.error, ValueError) as e:
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
            self._torn += 1
            log.warning(
                "store %s: torn or corrupt record in %s at byte %d of %d (%s); truncating",
                self._root,
                path.name,
                good,
                size,
                bad,
            )
            os.ftruncate(fd, good)
            if self._sync:
                os.fsync(fd)
            seg.size = seg.end = good
        if good == 0:  # not even a header: a segment created just before the crash
            os.close(fd)
            os.unlink(path)
            del self._segments[no]
            self._fsync_dir()
        seg.durable = len(seg.state)
        self._next_no = max(self._next_no, no + 1)
        return max_seq

    def _kill(self, key: int, state: int) -> None:
        """Mark slot ``key`` dead (``A`` or ``M``), if it is still there and live."""
        seg = self._segments.get(key >> 32)
        slot = key & 0xFFFFFFFF
        if seg is None or slot >= len(seg.state) or seg.state[slot] not in _LIVE:
            return
        seg.state[slot] = state
        seg.live -= 1
        self._messages -= 1

    def _read_snapshot(self) -> tuple[int, int, int, list[bytes]] | None:
        """(next segment no, last seq, first seq, ids) from ids.snap, or None."""
        path = self._root / _SNAP_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            magic, version, next_no, last_seq, first, count = _SNAP.unpack_from(data, 0)
            if magic != _SNAP_MAGIC or version != FORMAT_VERSION:
                raise ValueError("bad magic or version")
            (crc,) = _U32.unpack_from(data, len(data) - 4)
            if zlib.crc32(data[:-4]) != crc:
                raise ValueError("CRC mismatch")
            body = data[_SNAP.size : -4]
            ids = []
            pos = count
            for n in body[:count]:
                ids.append(body[pos : pos + n])
                pos += n
            if pos != len(body):
                raise ValueError("length mismatch")
        except (struct.error, ValueError) as e:
            # Written to a temporary name, synced, then renamed: this is damage, not a crash.
            log.error("store %s: ignoring damaged %s (%s)", self._root, _SNAP_NAME, e)
            return None
        return next_no, last_seq, first, ids

    def _rebuild_window(self, seen: list[tuple[int, bytes]]) -> None:
        self._window_first = self._last_seq + 1
        if not self._window_size or not seen:
            return
        seen.sort()
        floor = self._last_seq - self._window_size
        window: list[bytes] = []
        first = expected = 0
        for seq, mid in seen:
            if seq <= floor or seq < expected:
                continue  # out of the window, or a second copy (MOVE) of the same seq
            if not window:
                first = expected = seq
            while expected < seq:  # a hole (should not happen): keep positions right
                window.append(b"")
                expected += 1
            window.append(mid)
            expected += 1
        self._window = deque(window)
        self._window_first = first
        self._window_ids = {mid: seq for seq, mid in zip(itertools.count(first), window) if mid}

    # ------------------------------------------------------------------ segments

    def _open_segment(self) -> _Segment:
        """Start a new active segment (header written, not synced). Buffer must be empty."""
        no = self._next_no
        self._next_no += 1
        path = self._root / f"seg-{no:010d}.log"
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            header = b"".join(_record(_HEADER.pack(_T_HEADER, _MAGIC, FORMAT_VERSION, no)))
            _write_all(fd, header)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        seg = _Segment(no, path, fd, len(header))
        seg.needs_sync = True  # the first commit into it syncs header and directory
        self._segments[no] = seg
        self._active = seg
        self._buf_first = 0
        if not self._cursor_no:
            self._cursor_no = no
        return seg

    def _sync_new_segment(self) -> None:
        seg = self._active
        assert seg is not None
        if seg.needs_sync and self._sync:
            os.fdatasync(seg.fd)
            self._fsync_dir()
            self._syncs += 1
        seg.needs_sync = False

    def _delete_segment(self, seg: _Segment) -> None:
        os.close(seg.fd)
        os.unlink(seg.path)
        del self._segments[seg.no]
        self._deleted += 1

    def _write_snapshot(self) -> None:
        """Write the durable part of the duplicate window to ids.snap (atomically)."""
        durable = max(0, min(len(self._window), self._durable_seq - self._window_first + 1))
        ids = list(itertools.islice(self._window, durable))
        head = _SNAP.pack(
            _SNAP_MAGIC,
            FORMAT_VERSION,
            self._next_no,
            self._durable_seq,
            self._window_first,
            len(ids),
        )
        data = b"".join([head, bytes(map(len, ids)), *ids])
        data += _U32.pack(zlib.crc32(data))
        tmp = self._root / f".{_SNAP_NAME}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data)
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._root / _SNAP_NAME)
        # The caller syncs the directory after unlinking the segments.

    def _reclaim(self) -> None:
        """Delete dead segments, oldest first (never the active one or one being written)."""
        busy = self._ticket._seg if self._ticket is not None else None
        doomed = []
        for seg in self._segments.values():
            if seg is self._active or seg is busy or seg.live:
                break
            doomed.append(seg)
        if not doomed:
            return
        self._write_snapshot()
        for seg in doomed:
            self._delete_segment(seg)
        self._fsync_dir()
        first = next(iter(self._segments))
        if self._cursor_no < first:
            self._cursor_no, self._cursor_slot = first, 0

    def _compact(self) -> None:
        """Move live messages of mostly dead oldest segments into the new active segment.

        Runs right after a segment start, while the new segment holds nothing else; the
        moves are synced here, so the old segments can go at once.
        """
        active = self._active
        assert active is not None and not self._buf and not len(active.state)
        busy = self._ticket._seg if self._ticket is not None else None
        heads = []
        for seg in self._segments.values():
            if (
                seg is active
                or seg is busy
                or seg.no >= self._cursor_no
                or seg.live > self._compact_ratio * len(seg.state)
                or seg.no in self._pins
            ):
                break
            heads.append(seg)
        moves = []  # (head, slot, state)
        for head in heads:
            for slot, state in enumerate(head.state):
                if state in _LIVE:
                    _, seq, message_id, body = self._read(head, slot)
                    payload = _message_payload(seq, message_id, body, head.no << 32 | slot)
                    self._append_record(active, payload, state)
                    moves.append((head, slot, state))
        if moves:
            data = b"".join(self._buf)
            _write_all(active.fd, data)
            if self._sync:
                os.fdatasync(active.fd)
                self._fsync_dir()
                self._syncs += 1
            active.needs_sync = False
            active.size += len(data)
            active.durable = len(active.state)
            self._buf.clear()
            self._buf_first = len(active.state)
        for new_slot, (head, slot, state) in enumerate(moves):
            head.state[slot] = _M
            head.live -= 1
            if state != _P:  # held by a caller (in flight) or queued: forward the key
                self._forward[head.no << 32 | slot] = active.no << 32 | new_slot
            if state == _F:  # a MOVE record is longer than the PUT it copies
                self._in_flight_bytes += active.lengths[new_slot] - head.lengths[slot]
        self._moved += len(moves)
        for head in heads:
            log.info("store %s: compacted segment %d into %d", self._root, head.no, active.no)

    def maintain(self) -> None:
        """Retire a fully acked active segment and delete dead ones; call when idle.

        Does nothing while a commit is outstanding or anything is buffered.

        Raises
        ------
        StoreError
            If the store failed or is closed, or the file operations fail (the store
            then turns failed).
        """
        self._check_writable()
        active = self._active
        assert active is not None
        if self._ticket is not None or self.dirty:
            return
        try:
            if active.live == 0 and active.end >= _RECLAIM_BYTES:
                self._open_segment()
                self._sync_new_segment()
            self._reclaim()
        except OSError as e:
            self._fail(f"segment maintenance failed: {e}")
            raise StoreError(f"segment maintenance failed: {e}", path=self._root) from e

    # ------------------------------------------------------------------ writing

    def _append_record(self, seg: _Segment, payload: bytes, state: int) -> int:
        """Buffer a PUT/MOVE record for ``seg`` (the active one); returns its slot."""
        slot = len(seg.state)
        if slot >= _MAX_SLOTS - 1:
            raise StoreError("segment slot limit reached", path=self._root)
        length = len(payload)
        self._buf.append(_REC.pack(length, zlib.crc32(payload)))
        self._buf.append(payload)
        seg.offsets.append(seg.end)
        seg.lengths.append(length)
        seg.state.append(state)
        seg.live += 1
        seg.end += _REC.size + length
        return slot

    def put(self, message_id: bytes, body: Sequence[bytes], *, dedup: bool = True) -> int | None:
        """Buffer a message; it is durable once a commit that covers it has ended.

        Parameters
        ----------
        message_id
            The producer's id: 1 to :data:`MAX_ID_BYTES` bytes.
        body
            At least one part (parts may be empty).
        dedup
            Refuse an id in the duplicate window (default). False stores it whatever
            the window holds (the id still enters the window): for a caller with a
            duplicate rule of its own (the broker scopes PZQ ids by producer
            connection).

        Returns
        -------
        int or None
            The new store key, or None if ``dedup`` and ``message_id`` is in the
            duplicate window: nothing is stored, and the original is durable once the
            commits begun so far and the next one have ended.

        Raises
        ------
        MessageRejected
            If the id is empty or longer than :data:`MAX_ID_BYTES`, the body has no parts,
            or the message is larger than :data:`MAX_BODY_BYTES` (nothing is stored).
        StoreError
            If the store failed or is closed.
        """
        if self._closed or self._failed:
            self._check_writable()
        id_len = len(message_id)
        if not 0 < id_len <= MAX_ID_BYTES:
            raise MessageRejected(
                f"message id of {id_len} bytes; expected 1 to {MAX_ID_BYTES} bytes"
            )
        ids = self._window_ids
        if dedup and message_id in ids:
            self._duplicates += 1
            return None
        seq = self._last_seq + 1
        if len(body) == 1:  # the common case, inlined
            part = body[0]
            if len(part) > MAX_BODY_BYTES:
                raise MessageRejected(
                    f"message of {len(part)} bytes exceeds the limit of {MAX_BODY_BYTES}"
                )
            payload = b"".join(
                (_PUT.pack(_T_PUT, seq, id_len), message_id, _PART1.pack(1, len(part)), part)
            )
        else:
            if not body:
                raise MessageRejected("message has no body part; expected at least one")
            size = id_len + sum(map(len, body))
            if size > MAX_BODY_BYTES:
                raise MessageRejected(
                    f"message of {size} bytes exceeds the limit of {MAX_BODY_BYTES}"
                )
            payload = _message_payload(seq, message_id, body)
        active = self._active
        assert active is not None
        # _append_record, inlined (the hot path)
        slot = len(active.state)
        if slot >= _MAX_SLOTS - 1:
            raise StoreError("segment slot limit reached", path=self._root)
        length = len(payload)
        self._buf += (_REC.pack(length, zlib.crc32(payload)), payload)
        active.offsets.append(active.end)
        active.lengths.append(length)
        active.state.append(_U)
        active.live += 1
        active.end += _REC.size + length
        self._last_seq = seq
        self._buf_puts += 1
        self._buf_seq = seq
        if self._window_size:
            window = self._window
            window.append(message_id)
            ids[message_id] = seq
            if len(window) > self._window_size:
                old = window.popleft()
                if ids.get(old) == self._window_first:
                    del ids[old]
                self._window_first += 1
        else:
            self._window_first = seq + 1
        return active.no << 32 | slot

    def accepted_before_open(self, message_id: bytes) -> bool:
        """Whether the newest message with this id in the duplicate window was accepted
        before this store was opened (found on disk: whether its producer got its ack
        is unknown). False for ids not in the window (``dedup_window`` 0: always)."""
        seq = self._window_ids.get(message_id)
        return seq is not None and seq <= self._open_seq

    @property
    def uncommitted(self) -> int:
        """Puts not yet durable: buffered, or in the outstanding commit."""
        return self._buf_puts + (self._ticket.puts if self._ticket is not None else 0)

    @property
    def buffered_puts(self) -> int:
        """Puts buffered for the next commit."""
        return self._buf_puts

    @property
    def dirty(self) -> bool:
        """Whether anything (puts or tombstones) waits for the next commit."""
        return bool(self._buf or self._tombstones)

    @property
    def pending_tombstones(self) -> int:
        """Acks buffered for the next commit."""
        return len(self._tombstones)

    @property
    def committing(self) -> bool:
        """Whether a commit is outstanding (begun and not ended)."""
        return self._ticket is not None

    def begin_commit(self) -> CommitTicket | None:
        """Take everything buffered into a commit ticket; the buffer starts afresh.

        Run the ticket (:meth:`CommitTicket.run`, any thread), then pass it to
        :meth:`end_commit`. Starts a new segment afterwards when this commit takes the
        active one past ``segment_bytes`` (and then compacts, see the module docstring).

        Returns
        -------
        CommitTicket or None
            None when nothing is buffered.

        Raises
        ------
        StoreError
            If the store failed or is closed, a commit is already outstanding, or starting
            a segment fails (the store then turns failed).
        """
        self._check_writable()
        if self._ticket is not None:
            raise StoreError("a commit is already outstanding; end it first", path=self._root)
        if not self._buf and not self._tombstones:
            return None
        active = self._active
        assert active is not None
        if self._tombstones:
            keys = self._tombstones
            header, payload = _record(
                _ACK.pack(_T_ACK, len(keys)) + struct.pack(f"<{len(keys)}Q", *keys)
            )
            self._buf += (header, payload)
            active.end += len(header) + len(payload)
            self._tombstones = []
        ticket = CommitTicket(
            active,
            b"".join(self._buf),
            self._buf_first,
            self._buf_puts,
            self._sync,
            self._root if active.needs_sync else None,
        )
        active.needs_sync = False
        self._ticket = ticket
        self._ticket_seq = self._buf_seq
        self._buf.clear()
        self._buf_first = len(active.state)
        self._buf_puts = 0
        if active.end >= self._segment_bytes:
            try:
                self._open_segment()
                if self._compact_ratio > 0:
                    self._compact()
                self._reclaim()
            except OSError as e:
                self._fail(f"starting a segment failed: {e}")
                raise StoreError(f"starting a segment failed: {e}", path=self._root) from e
        return ticket

    def end_commit(self, ticket: CommitTicket) -> int:
        """Apply a finished commit: its puts become durable and deliverable.

        Parameters
        ----------
        ticket
            The outstanding ticket, after :meth:`CommitTicket.run` returned.

        Returns
        -------
        int
            How many puts became durable.

        Raises
        ------
        StoreError
            If ``ticket`` is not the outstanding one or has not run, or writing/syncing
            failed: the store then turns failed, every put not yet durable (this ticket's
            and any buffered since) is dropped, and their producers must be told so.
        """
        if ticket is not self._ticket:
            raise StoreError("end_commit: not the outstanding commit", path=self._root)
        if not ticket.done:
            raise StoreError("end_commit: the commit has not run yet", path=self._root)
        self._ticket = None
        seg = ticket._seg
        if ticket.error is not None:
            self._fail(f"commit failed: {ticket.error}", ticket)
            raise StoreError(f"commit failed: {ticket.error}", path=self._root) from ticket.error
        seg.size += len(ticket._data)
        end = ticket._first + ticket.puts
        if ticket.puts:
            state = seg.state
            state[ticket._first : end] = bytes([_P]) * ticket.puts
            self._messages += ticket.puts
            self._stored += ticket.puts
        seg.durable = max(seg.durable, end)
        if self._sync:
            self._syncs += 1
        self._commits += 1
        self._durable_seq = max(self._durable_seq, self._ticket_seq)
        try:
            self._reclaim()
        except OSError as e:
            self._fail(f"deleting a segment failed: {e}")
            raise StoreError(f"deleting a segment failed: {e}", path=self._root) from e
        return ticket.puts

    def commit(self) -> int:
        """Write and ``fdatasync`` everything buffered, now: one sync for all of it.

        Returns
        -------
        int
            How many puts became durable (and deliverable).

        Raises
        ------
        StoreError
            As :meth:`begin_commit` and :meth:`end_commit`.
        """
        ticket = self.begin_commit()
        if ticket is None:
            return 0
        ticket.run()
        return self.end_commit(ticket)

    def _fail(self, reason: str, ticket: CommitTicket | None = None) -> None:
        """Drop every put not yet durable and refuse further writes (see module doc)."""
        log.error("store %s failed: %s", self._root, reason)
        self._failed = reason
        for seg in self._segments.values():
            for slot in range(seg.durable, len(seg.state)):
                if seg.state[slot] == _U:
                    seg.state[slot] = _A
                    seg.live -= 1
        self._buf.clear()
        self._buf_puts = 0
        self._ticket = None

    # ------------------------------------------------------------------ reading

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

    def _read(self, seg: _Segment, slot: int) -> tuple[int, int, bytes, tuple[bytes, ...]]:
        """(original key or -1, accept seq, id, body) of a slot, read back and CRC-checked."""
        offset = seg.offsets[slot]
        length = seg.lengths[slot]
        data = os.pread(seg.fd, _REC.size + length, offset)
        if len(data) != _REC.size + length or _REC.unpack_from(data, 0)[0] != length:
            raise StoreError(
                f"short read of a record in {seg.path.name} at {offset}", path=self._root
            )
        payload = data[_REC.size :]
        if zlib.crc32(payload) != _REC.unpack_from(data, 0)[1]:
            raise StoreError(
                f"record in {seg.path.name} at {offset} fails its CRC", path=self._root
            )
        if payload[0] == _T_PUT:  # single-part fast path
            _, seq, id_len = _PUT.unpack_from(payload, 0)
            pos = _PUT.size + id_len
            count, part_len = _PART1.unpack_from(payload, pos)
            if count == 1 and pos + 8 + part_len == length:
                return -1, seq, payload[_PUT.size : pos], (payload[pos + 8 :],)
        return _parse_message(payload, payload[0])

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
            if state in (_Q, _R):
                return self._hand_out(seg, slot, key, state == _R)
        segments = self._segments
        while True:
            seg = segments.get(self._cursor_no)
            if seg is None:
                later = [no for no in segments if no > self._cursor_no]
                if not later:
                    return None
                self._cursor_no, self._cursor_slot = later[0], 0
                continue
            slot = seg.state.find(_P_BYTE, self._cursor_slot)
            if slot >= 0:
                self._cursor_slot = slot + 1
                return self._hand_out(seg, slot, seg.no << 32 | slot, False)
            if seg is self._active or seg.durable < len(seg.state):
                # Wait here: slots from ``durable`` on become P when their commit ends.
                self._cursor_slot = max(self._cursor_slot, seg.durable)
                return None
            later = [no for no in segments if no > seg.no]
            self._cursor_no, self._cursor_slot = later[0], 0

    def _hand_out(self, seg: _Segment, slot: int, key: int, redelivery: bool) -> StoredMessage:
        length = seg.lengths[slot]
        try:
            # _read's single-part case, inlined (the hot path); anything else goes there.
            data = os.pread(seg.fd, _REC.size + length, seg.offsets[slot])
            stored_length, crc = _REC.unpack_from(data, 0)
            payload = data[_REC.size :]
            if (
                stored_length == length
                and len(payload) == length
                and payload[0] == _T_PUT
                and zlib.crc32(payload) == crc
            ):
                id_end = _PUT.size + _PUT.unpack_from(payload, 0)[2]
                count, part_len = _PART1.unpack_from(payload, id_end)
                if count == 1 and id_end + 8 + part_len == length:
                    seg.state[slot] = _F
                    self._in_flight += 1
                    self._in_flight_bytes += length
                    return StoredMessage(
                        key, payload[_PUT.size : id_end], (payload[id_end + 8 :],), redelivery
                    )
            _, _, message_id, body = self._read(seg, slot)
        except (OSError, StoreError, struct.error, ValueError) as e:
            seg.state[slot] = _A
            seg.live -= 1
            self._messages -= 1
            raise StoreError(
                f"message {key:#x} is unreadable and was dropped: {e}", path=self._root
            ) from e
        seg.state[slot] = _F
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
        if seg is None or slot >= seg.durable or seg.state[slot] not in (_P, _Q, _R):
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

    def _taken(self, key: int) -> tuple[_Segment, int, int] | None:
        """(segment, slot, current key) of an in-flight ``key``, else None."""
        current = self._current(key) if self._forward else key
        seg = self._segments.get(current >> 32)
        slot = current & 0xFFFFFFFF
        if seg is None or slot >= len(seg.state) or seg.state[slot] != _F:
            return None
        if current != key:
            self._resolve(key)
        return seg, slot, current

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
        if self._closed:
            return False
        found = self._taken(key)
        if found is None:
            return False
        seg, slot, current = found
        if self._pinned:
            self._unpin(current)
        seg.state[slot] = _A
        seg.live -= 1
        self._messages -= 1
        self._in_flight -= 1
        self._in_flight_bytes -= seg.lengths[slot]
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
        if self._closed:
            return False
        found = self._taken(key)
        if found is None:
            return False
        seg, slot, current = found
        if self._pinned:
            self._unpin(current)
        seg.state[slot] = _R if delivered else _Q
        self._in_flight -= 1
        self._in_flight_bytes -= seg.lengths[slot]
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

    @property
    def syncs(self) -> int:
        """``fdatasync`` calls made for commits (and segment starts)."""
        return self._syncs

    def db_size(self) -> int:
        """Durable bytes in the segment files."""
        return sum(seg.size for seg in self._segments.values())

    def stats(self) -> StoreStats:
        """A snapshot of the counters (see :class:`StoreStats`)."""
        return StoreStats(
            messages=self._messages,
            in_flight=self._in_flight,
            in_flight_bytes=self._in_flight_bytes,
            uncommitted=self.uncommitted,
            db_size=self.db_size(),
            segments=len(self._segments),
            syncs=self._syncs,
            commits=self._commits,
            stored=self._stored,
            duplicates=self._duplicates,
            torn_records=self._torn,
            moved=self._moved,
            deleted_segments=self._deleted,
            dedup_ids=len(self._window_ids),
            index_bytes=sum(seg.index_bytes() for seg in self._segments.values()),
            failed=self._failed,
        )

    def iter_messages(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        """(id, body) of every durable, unacked message, oldest segment first.

        Reads the disk; for tests and tools, not the hot path.
        """
        for seg in list(self._segments.values()):
            for slot in range(seg.durable):
                if seg.state[slot] in _LIVE:
                    _, _, message_id, body = self._read(seg, slot)
                    yield message_id, body
