"""The PZQ store's on-disk format and the small types its modules share.

Files in the store folder::

    seg-<no:010d>.log   segments: records, written in order; the newest is the active one
    ids.snap            the duplicate window as of the last segment deletion
    QUEUE_ID            this queue's identity (random, made once), one line
    LOCK                flock: one open store per folder

Records. Every record is ``length u32, crc32 u32`` (little endian) then ``length`` bytes
of payload whose first byte is its type; the CRC covers the whole payload (the framing of
:mod:`zio_spark.storage.files`):

- ``HEADER`` (first in each segment): magic ``ZPQS``, format version u16, segment no u64.
- ``PUT``: accept sequence u64, id length u16, id, part count u32, part lengths u32 each,
  then the parts. The accept sequence numbers accepted messages 1, 2, 3, ... over the
  store's life; it orders the duplicate window.
- ``MOVE``: the original key u64, then a PUT's fields: a live message copied forward by
  compaction; replay marks the original slot dead.
- ``ACK``: count u32, keys u64 each: tombstones for acknowledged messages.

A segment is *preallocated* (``MessageStore(preallocate=True)``, the default): when it
starts, ``posix_fallocate`` gives the file ``segment_bytes`` of zeros, and records are
written with ``pwrite`` at the segment's end offset, so committing does not grow the
file. A commit that goes past ``segment_bytes`` grows it as before. When a segment is
closed (rollover, store close) it is truncated to its records, so a closed segment holds
records only; a crash leaves the active segment with a zero tail. A zero length field
where a record would start is the clean end of the written log (a payload is never
empty: it holds at least its type byte, and crc32 of nothing is 0, so a zero head would
pass the CRC). What it saves: an ``fdatasync`` that does not change the file's size
skips the journal commit for the inode's size (the reason PostgreSQL preallocates its
WAL segments). On this machine's ext4, 100 B appended + ``fdatasync`` took ~250-320 µs,
the same write into a preallocated region ~175-200 µs; one store put + commit of 100 B
went from ~330 µs to ~240 µs (median per commit, preallocate False vs True). A
filesystem without ``fallocate`` (``EOPNOTSUPP``/``EINVAL``) turns preallocation off for
the store, logged once at debug; a full disk (``ENOSPC``) leaves that one segment
growing as it is written.

Crash safety. A commit is one ``pwrite`` then one ``fdatasync``; only a commit that had
not finished can leave a torn record. Replay reads a segment record by record and stops
at the first one that is not whole and valid. If everything from there to the end of
the file is zero bytes, that is the clean end (a preallocated tail): nothing is counted.
Otherwise (a partial or CRC-failing record, or a zero head with non-zero bytes after it:
a commit whose later pages reached the disk before its first) the record is torn and
counted once (``StoreStats.torn_records``). Either way the file is truncated there.

``ids.snap``: magic ``ZPQI``, version u16, next segment no u64, last accept seq u64, seq
of the first id u64, id count u32, one length byte per id, the ids, then (version 2) a
16-byte body digest per id (all zero: unknown), crc32 of all before. Version 1 files (no
digests) are still read; their ids' bodies are unknown.

Body digests. The duplicate window keeps, per id, the BLAKE2b-128 digest of the newest
body stored under it (:func:`body_digest`: of the body as a record holds it, part count
and lengths then the parts), so a repeated id is a duplicate only with the same body. PUT
and MOVE records carry no digest: replay derives it from the record's bytes (the segment
format is unchanged, version 1); only ``ids.snap``, which outlives the segments, stores
digests.

Keys. A message's *store key* is ``segment no << 32 | slot``, the slot being its index
among the segment's PUT/MOVE records.

Also here: the store's errors and result types, :class:`LogFile` (one segment file:
creating and preallocating it, truncating it when closed, its in-memory index columns)
and :class:`CommitTicket` (one group commit). The record layouts (``*_STRUCT``, ``T_*``),
slot states (``STATE_*``) and record codecs (:func:`parse_head`, :func:`parse_message`,
:func:`message_payload`, :func:`ack_payload`, :func:`encode_snapshot`, ...) are public
names for the store's modules (:mod:`~zio_spark.storage.store`,
:mod:`~zio_spark.storage.store_index`, :mod:`~zio_spark.storage.store_recovery`); other
packages use :mod:`~zio_spark.storage.store`. Malformed bytes raise
:class:`~zio_spark.errors.CorruptRecordError`.
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import os
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from zio_spark.errors import (
    CorruptRecordError,
    FormatVersionError,
    StorageClosedError,
    StorageError,
    StorageInputError,
)
from zio_spark.storage.files import frame, fsync_dir, write_all

__all__ = [
    "ACK_STRUCT",
    "DEFAULT_DEDUP_WINDOW",
    "DEFAULT_SEGMENT_BYTES",
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "HEADER_STRUCT",
    "LIVE_STATES",
    "MAX_BODY_BYTES",
    "MAX_ID_BYTES",
    "MAX_SEGMENT_BYTES",
    "MAX_SLOTS",
    "MOVE_STRUCT",
    "PART1_STRUCT",
    "PENDING_BYTE",
    "PUT_STRUCT",
    "SEGMENT_MAGIC",
    "SEGMENT_NAME_RE",
    "SNAP_NAME",
    "SNAP_VERSION",
    "STATE_ACKED",
    "STATE_IN_FLIGHT",
    "STATE_MOVED",
    "STATE_PENDING",
    "STATE_QUEUED",
    "STATE_REQUEUED",
    "STATE_UNCOMMITTED",
    "T_ACK",
    "T_HEADER",
    "T_MOVE",
    "T_PUT",
    "CommitTicket",
    "LogFile",
    "MessageRejected",
    "StoreClosedError",
    "StoreError",
    "StoreLockedError",
    "StoreStats",
    "StoredMessage",
    "ack_payload",
    "body_digest",
    "decode_snapshot",
    "encode_snapshot",
    "framed_record",
    "header_payload",
    "message_payload",
    "parse_head",
    "parse_message",
    "record_digest",
]


DEFAULT_SEGMENT_BYTES: Final = 64 << 20
"""Soft size limit of a segment (a commit may overshoot it by its own size)."""

DEFAULT_DEDUP_WINDOW: Final = 100_000
"""How many of the most recently accepted message ids duplicate detection remembers."""

MAX_ID_BYTES: Final = 255
"""Longest accepted message id; bounds the duplicate window's memory."""

MAX_BODY_BYTES: Final = 1 << 30
"""Largest accepted message (id plus body parts); record offsets are 32-bit."""

FORMAT_VERSION: Final = 1
"""Segment format version (the HEADER record's)."""

SNAP_VERSION: Final = 2
"""``ids.snap`` format version written (2: with body digests; 1 is still read)."""

DIGEST_BYTES: Final = 16
"""Size of a body digest (BLAKE2b-128)."""

_NO_DIGEST: Final = bytes(DIGEST_BYTES)

SEGMENT_MAGIC: Final = b"ZPQS"
T_HEADER: Final = 0
T_PUT: Final = 1
T_MOVE: Final = 2
T_ACK: Final = 3

HEADER_STRUCT: Final = struct.Struct("<B4sHQ")  # type, magic, version, segment no
PUT_STRUCT: Final = struct.Struct("<BQH")  # type, accept seq, id length
MOVE_STRUCT: Final = struct.Struct("<BQQH")  # type, original key, accept seq, id length
ACK_STRUCT: Final = struct.Struct("<BI")  # type, count
_U32: Final = struct.Struct("<I")
PART1_STRUCT: Final = struct.Struct("<II")  # part count (1), its length
_SNAP: Final = struct.Struct("<4sHQQQI")  # magic, version, next segment, last seq, first, n

SEGMENT_NAME_RE: Final = re.compile(r"^seg-(\d{10})\.log$")
_SNAP_MAGIC: Final = b"ZPQI"
SNAP_NAME: Final = "ids.snap"
MAX_SLOTS: Final = 1 << 32
MAX_SEGMENT_BYTES: Final = 2 << 30  # record offsets are u32; leave room for one big commit

# Slot states (see "States" in :mod:`zio_spark.storage.store`).
STATE_UNCOMMITTED: Final = ord("U")
STATE_PENDING: Final = ord("P")
STATE_QUEUED: Final = ord("Q")
STATE_REQUEUED: Final = ord("R")
STATE_IN_FLIGHT: Final = ord("F")
STATE_ACKED: Final = ord("A")
STATE_MOVED: Final = ord("M")
LIVE_STATES: Final = frozenset(
    (STATE_UNCOMMITTED, STATE_PENDING, STATE_QUEUED, STATE_REQUEUED, STATE_IN_FLIGHT)
)
PENDING_BYTE: Final = b"P"
_NO_FALLOCATE: Final = frozenset((errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS))


class StoreError(StorageError):
    """The store cannot do what was asked: it failed, was closed, or misused.

    ``path`` is the store folder.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(f"{message} (store {path})" if path is not None else message)
        self.path = None if path is None else str(path)


class StoreClosedError(StoreError, StorageClosedError):
    """The store was used after :meth:`MessageStore.close`."""


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
        Bytes of records in the segment files (durable); the active segment's file is
        preallocated past them (``segment_bytes``).
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


class LogFile:
    """One segment file of the store (``seg-<no>.log``) and its in-memory index columns."""

    __slots__ = (
        "allocated",
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
        self.allocated = 0  # preallocated file size; truncated to the records when closed

    @classmethod
    def create(cls, no: int, path: Path, preallocate: int) -> tuple[LogFile, bool]:
        """Create segment file ``no`` at ``path``: its header written (not synced), the
        file preallocated to ``preallocate`` bytes when that is not 0. Returns the new
        segment and whether the filesystem can preallocate (False: the file just grows).

        Raises OSError (the file is then removed again).
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            header = b"".join(framed_record(header_payload(no)))
            write_all(fd, header, 0)
            allocated, supported = _preallocate(fd, preallocate) if preallocate else (0, True)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        seg = cls(no, path, fd, len(header))
        seg.allocated = allocated
        seg.needs_sync = True  # the first commit into it syncs header and directory
        return seg, supported

    def seal(self) -> None:
        """Truncate the preallocated tail of a closed segment: the file holds its records.

        Call only when nothing more is written to it (no outstanding commit, nothing
        buffered). Not synced: a crash leaves the zero tail, which replay ignores.
        """
        if self.allocated > self.end:
            os.ftruncate(self.fd, self.end)
        self.allocated = 0

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
        "_offset",
        "_seg",
        "_started",
        "_sync",
        "error",
        "puts",
    )

    def __init__(
        self,
        seg: LogFile,
        data: bytes,
        offset: int,
        first: int,
        puts: int,
        sync: bool,
        dir_path: Path | None,
    ) -> None:
        self._seg = seg
        self._fd = seg.fd
        self._data = data
        self._offset = offset
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
        """Bytes this commit writes (at the segment's end)."""
        return len(self._data)

    @property
    def segment(self) -> LogFile:
        """The segment this commit appends to."""
        return self._seg

    @property
    def first_slot(self) -> int:
        """The slot of this commit's first put in :attr:`segment`."""
        return self._first

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
            write_all(self._fd, self._data, self._offset)
            if self._sync:
                os.fdatasync(self._fd)
                if self._dir is not None:
                    fsync_dir(self._dir)
        except OSError as e:
            self.error = e
        finally:
            self._done.set()


def _preallocate(fd: int, nbytes: int) -> tuple[int, bool]:
    """Give file ``fd`` ``nbytes`` of zeros (``posix_fallocate``): (the size it has now,
    whether the filesystem can preallocate)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in _NO_FALLOCATE:
            return 0, False
        if e.errno != errno.ENOSPC:
            raise
        # A full disk: this segment grows as it is written, as without preallocation
        # (the space may have been given in part: the size says how much).
        return os.fstat(fd).st_size, True
    return nbytes, True


def framed_record(payload: bytes) -> tuple[bytes, bytes]:
    return frame(payload), payload


def parse_head(payload: bytes, kind: int) -> tuple[int, int, bytes]:
    """(original key or -1, accept seq, id) of a PUT/MOVE payload, checking its layout.

    Raises
    ------
    CorruptRecordError
        On a malformed payload.
    """
    try:
        return _parse_head(payload, kind)
    except struct.error as e:
        raise CorruptRecordError(f"malformed message record: {e}") from e


def _parse_head(payload: bytes, kind: int) -> tuple[int, int, bytes]:
    if kind == T_PUT:
        _, seq, id_len = PUT_STRUCT.unpack_from(payload, 0)
        pos = PUT_STRUCT.size
        original = -1
    else:
        _, original, seq, id_len = MOVE_STRUCT.unpack_from(payload, 0)
        pos = MOVE_STRUCT.size
    message_id = payload[pos : pos + id_len]
    if len(message_id) != id_len or not id_len:
        raise CorruptRecordError("message record with a short or empty id")
    pos += id_len
    (count,) = _U32.unpack_from(payload, pos)
    pos += 4
    lengths = struct.unpack_from(f"<{count}I", payload, pos)
    if not count or pos + 4 * count + sum(lengths) != len(payload):
        raise CorruptRecordError("message record whose part lengths do not add up")
    return original, seq, bytes(message_id)


def parse_message(payload: bytes, kind: int) -> tuple[int, int, bytes, tuple[bytes, ...]]:
    """(original key or -1, accept seq, id, body parts) of a PUT/MOVE payload.

    Raises
    ------
    CorruptRecordError
        On a malformed payload.
    """
    original, seq, message_id = parse_head(payload, kind)
    pos = (PUT_STRUCT.size if kind == T_PUT else MOVE_STRUCT.size) + len(message_id)
    (count,) = _U32.unpack_from(payload, pos)
    lengths = struct.unpack_from(f"<{count}I", payload, pos + 4)
    pos += 4 + 4 * count
    parts = []
    for n in lengths:
        parts.append(payload[pos : pos + n])
        pos += n
    return original, seq, message_id, tuple(parts)


def message_payload(
    seq: int, message_id: bytes, body: Sequence[bytes], original: int = -1
) -> bytes:
    if original < 0:
        head = PUT_STRUCT.pack(T_PUT, seq, len(message_id))
    else:
        head = MOVE_STRUCT.pack(T_MOVE, original, seq, len(message_id))
    lengths = struct.pack(f"<I{len(body)}I", len(body), *map(len, body))
    return b"".join((head, message_id, lengths, *body))


def body_digest(body: Sequence[bytes]) -> bytes:
    """BLAKE2b-128 of a message body as a PUT record holds it (part count, part lengths,
    parts): two bodies have one digest only if they have the same parts.

    The duplicate rule compares it, so a reused id with a new body is stored.
    """
    if len(body) == 1:
        part = body[0]
        h = hashlib.blake2b(PART1_STRUCT.pack(1, len(part)), digest_size=DIGEST_BYTES)
        h.update(part)
        return h.digest()
    h = hashlib.blake2b(
        struct.pack(f"<I{len(body)}I", len(body), *map(len, body)), digest_size=DIGEST_BYTES
    )
    for part in body:
        h.update(part)
    return h.digest()


def record_digest(payload: bytes, kind: int, id_len: int) -> bytes:
    """:func:`body_digest` of a PUT/MOVE payload's body, from the record's own bytes."""
    pos = (PUT_STRUCT.size if kind == T_PUT else MOVE_STRUCT.size) + id_len
    return hashlib.blake2b(memoryview(payload)[pos:], digest_size=DIGEST_BYTES).digest()


def header_payload(no: int) -> bytes:
    """The HEADER record's payload of segment ``no``."""
    return HEADER_STRUCT.pack(T_HEADER, SEGMENT_MAGIC, FORMAT_VERSION, no)


def ack_payload(keys: Sequence[int]) -> bytes:
    """An ACK record's payload: tombstones for ``keys``."""
    return ACK_STRUCT.pack(T_ACK, len(keys)) + struct.pack(f"<{len(keys)}Q", *keys)


def encode_snapshot(
    next_no: int,
    last_seq: int,
    first: int,
    ids: Sequence[bytes],
    digests: Sequence[bytes] | None = None,
    *,
    version: int = SNAP_VERSION,
) -> bytes:
    """The bytes of ``ids.snap`` (see the module docstring). ``digests``: one per id
    (``b""``: unknown); ``version`` 1 (no digests) is for tests of old stores."""
    head = _SNAP.pack(_SNAP_MAGIC, version, next_no, last_seq, first, len(ids))
    parts = [head, bytes(map(len, ids)), *ids]
    if version >= 2:
        given = digests if digests is not None else [b""] * len(ids)
        if len(given) != len(ids):
            raise StorageInputError("digests", len(given), f"one per id ({len(ids)})")
        parts += [d if len(d) == DIGEST_BYTES else _NO_DIGEST for d in given]
    data = b"".join(parts)
    return data + _U32.pack(zlib.crc32(data))


def decode_snapshot(data: bytes) -> tuple[int, int, int, list[bytes], list[bytes]]:
    """(next segment no, last seq, first seq, ids, digests) of ``ids.snap``'s bytes; a
    digest is ``b""`` where unknown (all of a version 1 file's).

    Raises
    ------
    CorruptRecordError
        For damaged bytes (too short, bad magic, CRC or length mismatch).
    FormatVersionError
        For a version this code does not read.
    """
    if len(data) < _SNAP.size + 4:
        raise CorruptRecordError(f"{SNAP_NAME} is {len(data)} bytes, too short")
    magic, version, next_no, last_seq, first, count = _SNAP.unpack_from(data, 0)
    if magic != _SNAP_MAGIC:
        raise CorruptRecordError(f"{SNAP_NAME} has magic {magic!r}, expected {_SNAP_MAGIC!r}")
    if version not in (1, SNAP_VERSION):
        raise FormatVersionError(version, (1, SNAP_VERSION))
    (crc,) = _U32.unpack_from(data, len(data) - 4)
    if zlib.crc32(data[:-4]) != crc:
        raise CorruptRecordError(f"{SNAP_NAME} CRC mismatch")
    body = data[_SNAP.size : -4]
    ids = []
    pos = count
    for n in body[:count]:
        ids.append(body[pos : pos + n])
        pos += n
    digests = [b""] * count
    if version >= 2:
        for i in range(count):
            d = body[pos : pos + DIGEST_BYTES]
            digests[i] = b"" if d == _NO_DIGEST else d
            pos += DIGEST_BYTES
    if pos != len(body):
        raise CorruptRecordError(f"{SNAP_NAME} length mismatch")
    return next_no, last_seq, first, ids, digests
