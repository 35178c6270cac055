"""A producer's retention on local disk: numbered records kept until acknowledged.

:class:`RetentionLog` is what lets a :class:`~zio_spark.source.producer.Producer` (with
``retention_dir``) restart without losing a record it accepted: records are appended
with their sequence numbers, read back from any held seq (the same bytes every time),
released from the front once a taker acknowledges them, and found again after a crash.

Layout of the folder (one process at a time: an ``flock`` on ``LOCK``)::

    LOCK                            flock: one process per folder
    HEAD                            first held seq, generation, incarnation, owner
    <gen:08d>-<first:020d>.seg      segments of the current generation, by first seq

``HEAD`` is :data:`HEAD_MAGIC` then one CRC-framed record (:func:`~.files.frame`):
``b"H"``, 3 zero bytes, generation u32, first held seq u64, incarnation length u8, the
incarnation (ASCII), then the owner (the producer id, UTF-8). The *incarnation* names
this folder's numbering (the direct read mode's rule in docs/direct-read.md: under one
incarnation a seq names one record, forever): made when the folder is made, kept by every
reopen and release, replaced by a renumbering of held records. ``HEAD`` is replaced whole
(:func:`~.files.atomic_write`), so it reads as the old or the new one.

A segment is :data:`SEGMENT_MAGIC` then CRC-framed records, one per append batch:
``b"B"``, 3 zero bytes, record count u32, first seq u64 (16 bytes, so what follows is
8-aligned), then one Arrow IPC record-batch message of
:data:`~zio_spark.codec.schema.WIRE_SCHEMA` (``seq``, ``value``, ``key``, ``granule``,
``headers``: the columns the producer holds and sends). Seqs run contiguously from a
segment's first record to the last segment's last; a new segment starts once the
current one passed ``segment_bytes``.

Releasing up to ``S`` rewrites ``HEAD`` (first held = ``S + 1``) and then deletes the
segments holding only released records; reopening deletes any such segment a crash left
behind. A renumbering (:meth:`RetentionLog.renumber`, for a taker that holds more than
this log ever numbered) writes the held records at their new seqs into a segment of the
next generation, then ``HEAD`` naming that generation; segments of another generation
than ``HEAD``'s are the leftovers of an interrupted renumbering (or of a finished one)
and are deleted on open.

**Sync policy and what a crash loses.** With ``sync=True`` (the default) every append
batch is written with one ``write`` and made durable with one ``fdatasync`` before
:meth:`RetentionLog.append` returns; a new segment and its folder entry are synced
before its first record is written, and ``HEAD`` is replaced with a synced rename. So:

- a *process kill* (SIGKILL, a crash) loses nothing an append returned for, with or
  without ``sync`` (written bytes are in the kernel's page cache); an append the kill
  cut short leaves a torn record at the end of the last segment;
- a *power loss or kernel crash* loses nothing an append returned for with ``sync=True``
  (on a disk that honours flushes); with ``sync=False`` it may lose any suffix of what
  was appended since the kernel last wrote it back, and a release may come back undone
  (records resent: the taker drops them by seq).

On open, a torn tail (a header cut short, a length running past the end, a CRC failing
on the very last record, or only zeroes left) is cut off, counted in
:attr:`RetentionLog.torn` and logged: nothing in it was ever acknowledged to the caller.
Anything else that fails its checks (a bad record before the end, a missing or damaged
``HEAD``, a gap in the seqs) is a :class:`~zio_spark.errors.CorruptRecordError` naming
the file, the byte offset and what was expected; nothing is silently skipped.

Not thread-safe beyond one lock per call: the producer calls it under its own lock.
No zmq.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

from zio_spark.codec.records import seq_array
from zio_spark.codec.schema import WIRE_SCHEMA
from zio_spark.errors import (
    CorruptRecordError,
    FormatVersionError,
    StorageClosedError,
    StorageError,
    StorageInputError,
)
from zio_spark.storage.files import (
    RECORD_HEAD,
    atomic_write,
    frame,
    fsync_dir,
    is_torn_tail,
    lock_folder,
    read_record,
    write_all,
)

__all__ = [
    "HEAD_MAGIC",
    "SEGMENT_BYTES",
    "SEGMENT_MAGIC",
    "Held",
    "RetentionLockedError",
    "RetentionLog",
]

log = logging.getLogger("zio_spark.storage.retention")

HEAD_MAGIC: Final = b"ZSRETH1\x00"
"""The first bytes of a retention folder's ``HEAD`` (format version 1)."""
SEGMENT_MAGIC: Final = b"ZSRETS1\x00"
"""The first bytes of a retention segment (format version 1)."""
SEGMENT_BYTES: Final = 64 << 20
"""Default size past which appends go to a new segment."""

# b"H", generation, first held seq, incarnation length; then the incarnation, the owner
_HEAD: Final = struct.Struct("<c3xIQB")
_INCARNATION_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_BATCH: Final = struct.Struct("<c3xIQ")  # b"B", record count, first seq; then Arrow
_SEG_RE: Final = re.compile(r"^(\d{8})-(\d{20})\.seg$")
_MAX_PAYLOAD: Final = 0xFFFF_FFFF
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_HEADERS_TYPE: Final = WIRE_SCHEMA.field("headers").type


@dataclass(frozen=True, slots=True)
class Held:
    """Records ``first .. first + len(values) - 1`` as columns of Python values, as the
    producer holds them (a column that is all None is None)."""

    first: int
    values: list[bytes]
    keys: list[bytes | None] | None
    granules: list[int | None] | None
    headers: list[Mapping[str, str] | None] | None


class RetentionLockedError(StorageError):
    """Another process (or another open log in this one) holds the folder's lock."""


@dataclass(slots=True)
class _Segment:
    path: Path
    gen: int
    first: int  # seq of its first record (from its name)
    fd: int = -1
    size: int = 0  # bytes written (magic included)
    next: int = 0  # seq after its last record

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


@dataclass(slots=True)
class _Index:
    """Where each append batch is: parallel lists, bisected by first seq."""

    firsts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    segs: list[_Segment] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # of the record's header
    ends: list[int] = field(default_factory=list)  # offsets after the records
    head: int = 0  # entries before this are released

    def add(self, first: int, count: int, seg: _Segment, offset: int, end: int) -> None:
        self.firsts.append(first)
        self.counts.append(count)
        self.segs.append(seg)
        self.offsets.append(offset)
        self.ends.append(end)

    def _columns(self) -> tuple[list[Any], ...]:
        return (self.firsts, self.counts, self.segs, self.offsets, self.ends)

    def drop_below(self, first: int) -> None:
        """Forget the entries whose records all lie before seq ``first``."""
        while self.head < len(self.firsts) and (
            self.firsts[self.head] + self.counts[self.head] <= first
        ):
            self.head += 1
        if self.head > 256 and self.head * 2 > len(self.firsts):
            for col in self._columns():
                del col[: self.head]
            self.head = 0

    def clear(self) -> None:
        for col in self._columns():
            col.clear()
        self.head = 0


def _new_incarnation() -> str:
    return os.urandom(16).hex()


def _segment_name(gen: int, first: int) -> str:
    return f"{gen:08d}-{first:020d}.seg"


def _check_column(name: str, col: object, n: int) -> None:
    if col is not None and (not isinstance(col, Sequence) or isinstance(col, (bytes, str))):
        raise StorageInputError(name, col, f"a sequence of {n} entries, or None")
    if col is not None and len(col) != n:
        raise StorageInputError(name, f"{len(col)} entries", f"{n} entries, one per value")


def _bad_bytes(name: str, col: Sequence[object]) -> StorageInputError | None:
    for i, v in enumerate(col):
        if v is not None and not isinstance(v, (bytes, bytearray, memoryview)):
            return StorageInputError(f"{name}[{i}]", v, "bytes or None")
    return None


def _bad_granule(col: Sequence[object]) -> StorageInputError | None:
    for i, g in enumerate(col):
        if g is None:
            continue
        if isinstance(g, bool) or not isinstance(g, int):
            return StorageInputError(f"granules[{i}]", g, "an int or None")
        if not _I64_MIN <= g <= _I64_MAX:
            return StorageInputError(f"granules[{i}]", g, "within [-2**63, 2**63) (int64)")
    return None


def _bad_header(col: Sequence[object]) -> StorageInputError | None:
    for i, h in enumerate(col):
        if h is None:
            continue
        if not isinstance(h, Mapping):
            return StorageInputError(f"headers[{i}]", h, "a str -> str mapping or None")
        for k, v in h.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, str)):
                return StorageInputError(f"headers[{i}]", h, "a str -> str mapping or None")
    return None


def encode_batch(
    first: int,
    values: Sequence[bytes],
    keys: Sequence[bytes | None] | None,
    granules: Sequence[int | None] | None,
    headers: Sequence[Mapping[str, str] | None] | None,
) -> pa.RecordBatch:
    """The records as a batch of :data:`WIRE_SCHEMA` numbered from ``first``.

    Raises
    ------
    StorageInputError
        Naming the first bad column entry (``values[3]``, ``granules[0]`` ...).
    """
    n = len(values)
    if granules is not None:  # pyarrow would truncate a float quietly
        bad = _bad_granule(granules)
        if bad:
            raise bad
    try:
        value_array = pa.array(values, pa.binary())
        key_array = pa.nulls(n, pa.binary()) if keys is None else pa.array(keys, pa.binary())
        granule_array = (
            pa.nulls(n, pa.int64()) if granules is None else pa.array(granules, pa.int64())
        )
        header_array = (
            pa.nulls(n, _HEADERS_TYPE)
            if headers is None
            else pa.array([None if h is None else list(h.items()) for h in headers], _HEADERS_TYPE)
        )
    except (pa.ArrowException, TypeError, ValueError, AttributeError, OverflowError) as e:
        bad = (
            _bad_bytes("values", values)
            or (None if keys is None else _bad_bytes("keys", keys))
            or (None if headers is None else _bad_header(headers))
        )
        if bad is not None:
            raise bad from None
        raise StorageInputError(
            "records", str(e), "value and key bytes, int64 granules, str -> str headers"
        ) from e
    return pa.RecordBatch.from_arrays(
        [
            seq_array(first, n),
            value_array,
            key_array,
            granule_array,
            header_array,
        ],
        schema=WIRE_SCHEMA,
    )


def _held(batch: pa.RecordBatch) -> Held:
    """A batch's records as :class:`Held` columns (a column of nulls as None)."""
    n = batch.num_rows
    keys = batch.column(2)
    granules = batch.column(3)
    headers = batch.column(4)
    return Held(
        batch.column(0)[0].as_py(),
        batch.column(1).to_pylist(),
        None if keys.null_count == n else keys.to_pylist(),
        None if granules.null_count == n else granules.to_pylist(),
        None
        if headers.null_count == n
        else [None if h is None else dict(h) for h in headers.to_pylist()],
    )


class RetentionLog:
    """Numbered records on disk, appended at the end, released from the front.

    Parameters
    ----------
    folder
        The retention folder (created if missing, with its parents).
    owner
        Who numbers the records (the producer id): stored in ``HEAD`` on creation, and a
        folder of another owner is refused (its seqs mean nothing to this one's takers).
    sync
        ``fdatasync`` every append batch, new segment and ``HEAD`` (see the module
        docstring for what ``False`` gives up).
    segment_bytes
        Appends go to a new segment once the current one is at least this big.

    Attributes
    ----------
    torn
        Torn tail records cut off when the folder was opened (0 or 1).
    reopened
        Records held when the folder was opened.

    Raises
    ------
    RetentionLockedError
        If another process (or another open log) holds the folder.
    StorageInputError
        If the folder belongs to another owner, or for a bad argument.
    CorruptRecordError, FormatVersionError
        If the folder fails its checks (see the module docstring).
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        owner: str,
        sync: bool = True,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        if not isinstance(owner, str) or not owner:
            raise StorageInputError("owner", owner, "a non-empty str (the producer id)")
        if (
            isinstance(segment_bytes, bool)
            or not isinstance(segment_bytes, int)
            or (segment_bytes < 1)
        ):
            raise StorageInputError("segment_bytes", segment_bytes, "an integer >= 1")
        self.folder = Path(folder)
        self.owner = owner
        self.sync = bool(sync)
        self.segment_bytes = segment_bytes
        self.torn = 0
        self.reopened = 0
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._index = _Index()
        self._gen = 0
        self._incarnation = _new_incarnation()
        self._first = 1
        self._next = 1
        self._closed = False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot make the retention folder: {e}", path=folder) from e
        self._lock_fd = lock_folder(
            self.folder,
            lambda: RetentionLockedError(
                "retention folder is in use by another producer process (its LOCK is held)",
                path=self.folder,
            ),
        )
        try:
            self._open()
        except BaseException:
            self._close_fds()
            raise

    # -- open -------------------------------------------------------------------------

    def _open(self) -> None:
        head = self.folder / "HEAD"
        with contextlib.suppress(FileNotFoundError):
            (self.folder / ".HEAD.tmp").unlink()  # an interrupted HEAD replacement
        names = sorted(p.name for p in self.folder.iterdir() if _SEG_RE.match(p.name))
        if not head.exists():
            if names:
                raise CorruptRecordError(
                    f"HEAD is missing beside {len(names)} segment(s) ({names[0]} ...); "
                    "expected HEAD, written when the folder was made",
                    path=head,
                )
            self._write_head(0, 1)
            return
        gen, first, incarnation, owner = self._read_head(head)
        if owner != self.owner:
            raise StorageInputError(
                "producer_id",
                self.owner,
                f"{owner!r}, the producer whose records {self.folder} holds",
            )
        self._gen, self._first, self._next = gen, first, first
        self._incarnation = incarnation
        mine: list[_Segment] = []
        for name in names:
            m = _SEG_RE.match(name)
            assert m is not None
            seg = _Segment(self.folder / name, int(m.group(1)), int(m.group(2)))
            if seg.gen != gen:  # an interrupted or finished renumbering's leftover
                log.info(
                    "retention %s: removing %s (generation %d; HEAD names %d)",
                    self.folder,
                    name,
                    seg.gen,
                    gen,
                )
                seg.path.unlink()
                continue
            mine.append(seg)
        mine.sort(key=lambda s: s.first)
        expected: int | None = None
        for i, seg in enumerate(mine):
            last_segment = i == len(mine) - 1
            if expected is not None and seg.first != expected:
                raise CorruptRecordError(
                    f"segment starts at seq {seg.first}, expected {expected} (seqs "
                    f"{min(expected, seg.first)}..{max(expected, seg.first) - 1} are "
                    "missing or doubled)",
                    path=seg.path,
                    offset=0,
                )
            self._scan(seg, last_segment)
            expected = seg.next
        for seg in mine:
            if seg.size < 0:  # a torn, empty last segment was removed
                continue
            if seg.next <= first or seg.next == seg.first:
                # All released (HEAD moved past it, its deletion did not happen), or
                # made and never written to (a crash right after): not needed.
                seg.path.unlink()
                continue
            seg.fd = os.open(seg.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            self._segments.append(seg)
        self._index.drop_below(first)
        if not self._segments:
            self._index.clear()
        else:
            s0 = self._segments[0]
            if s0.first > first:
                raise CorruptRecordError(
                    f"the first segment starts at seq {s0.first} but HEAD says seq {first} "
                    f"is held: seqs {first}..{s0.first - 1} are missing",
                    path=s0.path,
                    offset=0,
                )
            self._next = max(first, self._segments[-1].next)
        self.reopened = self._next - self._first

    def _read_head(self, path: Path) -> tuple[int, int, str, str]:
        data = path.read_bytes()
        if not data.startswith(HEAD_MAGIC):
            if data[:6] == HEAD_MAGIC[:6]:
                raise FormatVersionError(data[:8], HEAD_MAGIC, path=path)
            raise CorruptRecordError(
                f"HEAD starts with {data[:8]!r}, expected {HEAD_MAGIC!r}", path=path, offset=0
            )
        got = read_record(data, len(HEAD_MAGIC), len(data))
        if isinstance(got, str):
            raise CorruptRecordError(
                f"HEAD record: {got}; expected one whole CRC-framed record",
                path=path,
                offset=len(HEAD_MAGIC),
            )
        payload, end = got
        if end != len(data) or len(payload) < _HEAD.size or payload[:1] != b"H":
            raise CorruptRecordError(
                f"HEAD record of {len(payload)} bytes (type {payload[:1]!r}, file {len(data)} "
                f"bytes); expected type b'H', at least {_HEAD.size} bytes, nothing after",
                path=path,
                offset=len(HEAD_MAGIC),
            )
        _, gen, first, inc_len = _HEAD.unpack_from(payload)
        at = _HEAD.size + inc_len
        incarnation = payload[_HEAD.size : at].decode("ascii", "replace")
        if not _INCARNATION_RE.fullmatch(incarnation) or at > len(payload):
            raise CorruptRecordError(
                f"HEAD incarnation {incarnation!r}; expected 1..64 of A-Z a-z 0-9 . _ -",
                path=path,
                offset=len(HEAD_MAGIC),
            )
        try:
            owner = payload[at:].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptRecordError(
                f"HEAD owner is not UTF-8 ({e})", path=path, offset=len(HEAD_MAGIC)
            ) from None
        if first < 1:
            raise CorruptRecordError(
                f"HEAD first seq {first}, expected >= 1", path=path, offset=len(HEAD_MAGIC)
            )
        return gen, first, incarnation, owner

    def _scan(self, seg: _Segment, last_segment: bool) -> None:
        """Index ``seg``'s records; cut a torn tail off the last segment."""
        data = seg.path.read_bytes()
        size = len(data)
        if not data.startswith(SEGMENT_MAGIC):
            if (
                last_segment
                and SEGMENT_MAGIC.startswith(data.rstrip(b"\0"))
                and (size <= len(SEGMENT_MAGIC))
            ):
                # Made, never written to: a crash right after creating it.
                self._torn(seg.path, 0, size)
                seg.path.unlink()
                seg.next = seg.first
                seg.size = -1  # removed
                return
            raise CorruptRecordError(
                f"segment starts with {data[:8]!r}, expected {SEGMENT_MAGIC!r}",
                path=seg.path,
                offset=0,
            )
        pos = len(SEGMENT_MAGIC)
        expected = seg.first
        while pos < size:
            got = read_record(data, pos, size)
            problem = got if isinstance(got, str) else None
            if problem is None:
                assert not isinstance(got, str)
                payload, end = got
                if len(payload) < _BATCH.size or payload[:1] != b"B":
                    problem = f"record type {payload[:1]!r} of {len(payload)} bytes"
                else:
                    _, count, first = _BATCH.unpack_from(payload)
                    if first != expected or count < 1:
                        raise CorruptRecordError(
                            f"batch of {count} records from seq {first}; expected one or "
                            f"more from seq {expected}",
                            path=seg.path,
                            offset=pos,
                        )
                    self._index.add(first, count, seg, pos, end)
                    expected += count
                    pos = end
                    continue
            if last_segment and is_torn_tail(data, pos):
                self._torn(seg.path, pos, size)
                with open(seg.path, "r+b") as f:
                    f.truncate(pos)
                    if self.sync:
                        os.fsync(f.fileno())
                size = pos
                break
            raise CorruptRecordError(
                f"{problem}; expected a whole CRC-framed batch record (only the end of "
                "the last segment may be torn)",
                path=seg.path,
                offset=pos,
            )
        seg.size = size
        seg.next = expected

    def _torn(self, path: Path, pos: int, size: int) -> None:
        self.torn += 1
        log.warning(
            "retention %s: torn record at byte %d of %d (a write cut short); cutting it off",
            path,
            pos,
            size,
        )

    # -- state --------------------------------------------------------------------------

    @property
    def first(self) -> int:
        """Seq of the first held record (:attr:`next_seq` when none is held)."""
        return self._first

    @property
    def next_seq(self) -> int:
        """Seq the next appended record must have."""
        return self._next

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def incarnation(self) -> str:
        """The name of this folder's numbering: the same across reopens and releases, a
        new one after a renumbering of held records (32 hex characters)."""
        return self._incarnation

    def __len__(self) -> int:
        return self._next - self._first

    def segment_paths(self) -> list[Path]:
        """The segment files now in use, in seq order."""
        with self._lock:
            return [s.path for s in self._segments]

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError("retention log is closed", path=self.folder)

    # -- append -------------------------------------------------------------------------

    def append(
        self,
        first: int,
        values: Sequence[bytes],
        keys: Sequence[bytes | None] | None = None,
        granules: Sequence[int | None] | None = None,
        headers: Sequence[Mapping[str, str] | None] | None = None,
    ) -> int:
        """Append records ``first, first + 1, ...``; durable (with ``sync``) on return.

        ``first`` must be :attr:`next_seq`. Returns the seq of the last record.

        Raises
        ------
        StorageInputError
            For a ``first`` other than :attr:`next_seq` or a bad column (named, with the
            entry's index); nothing is written.
        StorageError
            If writing or syncing fails (the partial record is cut off again).
        StorageClosedError
            After :meth:`close`.
        """
        if isinstance(values, (bytes, str)) or not isinstance(values, Sequence):
            raise StorageInputError("values", values, "a sequence of bytes")
        n = len(values)
        _check_column("keys", keys, n)
        _check_column("granules", granules, n)
        _check_column("headers", headers, n)
        with self._lock:
            self._check_open()
            if isinstance(first, bool) or not isinstance(first, int) or first != self._next:
                raise StorageInputError(
                    "first", first, f"{self._next}, the next seq of this retention log"
                )
            if n == 0:
                return self._next - 1
            batch = encode_batch(first, values, keys, granules, headers)
            self._write_batch(batch, first, n)
            return self._next - 1

    def _write_batch(self, batch: pa.RecordBatch, first: int, n: int) -> None:
        body = batch.serialize()
        prefix = _BATCH.pack(b"B", n, first)
        length = len(prefix) + body.size
        if length > _MAX_PAYLOAD:
            raise StorageInputError(
                "values", f"{length} bytes in one append", "at most 4 GiB - 1 per append"
            )
        seg = self._segments[-1] if self._segments else None
        if seg is None or seg.size >= self.segment_bytes or seg.next != first:
            seg = self._new_segment(self._gen, first)
        crc = zlib.crc32(body, zlib.crc32(prefix))
        head = RECORD_HEAD.pack(length, crc)
        offset = seg.size
        try:
            done = os.writev(seg.fd, [head, prefix, body])
            total = len(head) + length
            if done < total:  # short write: the rest
                write_all(seg.fd, (head + prefix + body.to_pybytes())[done:])
            if self.sync:
                os.fdatasync(seg.fd)
        except OSError as e:
            # A partial record would read as corruption once more follows: cut it off.
            with contextlib.suppress(OSError):
                os.ftruncate(seg.fd, offset)
            raise StorageError(f"cannot append to the retention log: {e}", path=seg.path) from e
        seg.size = offset + len(head) + length
        seg.next = first + n
        self._index.add(first, n, seg, offset, seg.size)
        self._next = first + n

    def _new_segment(self, gen: int, first: int) -> _Segment:
        seg = _Segment(self.folder / _segment_name(gen, first), gen, first, next=first)
        try:
            seg.fd = os.open(
                seg.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644
            )
            write_all(seg.fd, SEGMENT_MAGIC)
            if self.sync:
                os.fdatasync(seg.fd)
                fsync_dir(self.folder)
        except OSError as e:
            seg.close()
            raise StorageError(f"cannot make a retention segment: {e}", path=seg.path) from e
        seg.size = len(SEGMENT_MAGIC)
        if gen == self._gen:
            self._segments.append(seg)
        return seg

    # -- read ---------------------------------------------------------------------------

    def read(self, start: int, end: int) -> pa.RecordBatch:
        """Records ``[start, end)`` as one batch of :data:`WIRE_SCHEMA`: the same rows,
        from the same bytes, on every read while they are held (each record's CRC is
        checked on the way).

        Raises
        ------
        StorageInputError
            ``start``/``end`` outside ``first <= start <= end <= next_seq`` (a released
            range is no longer held: the caller's data loss to report).
        CorruptRecordError
            If a held record no longer reads back as written.
        """
        with self._lock:
            self._check_open()
            for name, v in (("start", start), ("end", end)):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise StorageInputError(name, v, "an int seq")
            if not self._first <= start <= self._next:
                raise StorageInputError(
                    "start", start, f"a held seq: {self._first} <= start <= {self._next}"
                )
            if not start <= end <= self._next:
                raise StorageInputError("end", end, f"{start} <= end <= {self._next}")
            if start == end:
                return pa.RecordBatch.from_pylist([], schema=WIRE_SCHEMA)
            idx = self._index
            i = bisect.bisect_right(idx.firsts, start, lo=idx.head) - 1
            parts: list[pa.RecordBatch] = []
            seq = start
            while seq < end:
                batch = self._read_entry(i)
                a = seq - idx.firsts[i]
                b = min(idx.counts[i], end - idx.firsts[i])
                parts.append(batch.slice(a, b - a))
                seq = idx.firsts[i] + b
                i += 1
        if len(parts) == 1:
            return parts[0]
        return pa.Table.from_batches(parts, WIRE_SCHEMA).combine_chunks().to_batches()[0]

    def records(self, start: int, end: int) -> Held | None:
        """Records ``[start, end)`` as columns of Python values (None if none)."""
        batch = self.read(start, end)
        return None if batch.num_rows == 0 else _held(batch)

    def _read_entry(self, i: int) -> pa.RecordBatch:
        idx = self._index
        seg, offset, end = idx.segs[i], idx.offsets[i], idx.ends[i]
        first, count = idx.firsts[i], idx.counts[i]
        data = os.pread(seg.fd, end - offset, offset)
        got = read_record(data, 0, len(data))
        if isinstance(got, str) or got[1] != len(data):
            raise CorruptRecordError(
                f"held batch of seqs {first}..{first + count - 1} no longer reads back "
                f"({got if isinstance(got, str) else 'length changed'}); expected the "
                "record as written",
                path=seg.path,
                offset=offset,
            )
        payload = got[0]
        try:
            kind, n, seq = _BATCH.unpack_from(payload)
            body = pa.py_buffer(payload).slice(_BATCH.size)
            batch = pa.ipc.read_record_batch(body, WIRE_SCHEMA)
            ok = kind == b"B" and n == count == batch.num_rows and seq == first
            if ok:
                column = batch.column(0)
                ok = column[0].as_py() == first and column[n - 1].as_py() == first + n - 1
        except (pa.ArrowException, OSError, EOFError, ValueError, struct.error) as e:
            raise CorruptRecordError(
                f"held batch of seqs {first}..{first + count - 1} does not decode ({e}); "
                f"expected an Arrow record batch of {count} records",
                path=seg.path,
                offset=offset,
            ) from None
        if not ok:
            raise CorruptRecordError(
                f"held batch at seqs {first}..{first + count - 1} holds other records; "
                f"expected {count} records from seq {first}",
                path=seg.path,
                offset=offset,
            )
        return batch

    # -- release ------------------------------------------------------------------------

    def release(self, upto: int) -> int:
        """Forget every record with seq <= ``upto``; returns how many were held.

        Durable on return (``HEAD`` replaced and synced), then the segments holding only
        released records are deleted. An ``upto`` at or past :attr:`next_seq` empties the
        log and moves :attr:`next_seq` to ``upto + 1`` (the taker holds more than this
        log numbered: numbering continues after it).

        Raises
        ------
        StorageInputError
            If ``upto`` is not an int.
        StorageError
            If ``HEAD`` cannot be replaced (nothing is released).
        """
        if isinstance(upto, bool) or not isinstance(upto, int):
            raise StorageInputError("upto", upto, "an int seq")
        with self._lock:
            self._check_open()
            if upto < self._first:
                return 0
            released = min(upto + 1, self._next) - self._first
            new_first = upto + 1
            self._write_head(self._gen, new_first)
            self._first = new_first
            self._next = max(self._next, new_first)
            self._index.drop_below(new_first)
            self._drop_segments(new_first)
            return released

    def _drop_segments(self, first: int) -> None:
        keep: list[_Segment] = []
        for seg in self._segments:
            if seg.next <= first:
                seg.close()
                with contextlib.suppress(FileNotFoundError):
                    seg.path.unlink()
            else:
                keep.append(seg)
        self._segments = keep
        if not keep:
            self._index.clear()

    def _write_head(self, gen: int, first: int, incarnation: str | None = None) -> None:
        inc = (self._incarnation if incarnation is None else incarnation).encode("ascii")
        payload = _HEAD.pack(b"H", gen, first, len(inc)) + inc + self.owner.encode("utf-8")
        try:
            atomic_write(
                self.folder / "HEAD", HEAD_MAGIC + frame(payload) + payload, sync=self.sync
            )
        except OSError as e:
            raise StorageError(f"cannot write HEAD: {e}", path=self.folder / "HEAD") from e

    # -- renumber -----------------------------------------------------------------------

    def renumber(self, shift: int) -> None:
        """Add ``shift`` (> 0) to every held record's seq and to :attr:`next_seq`.

        For a taker that holds more than this log ever numbered (a producer id reused
        with a fresh folder): the held records are written at their new seqs into a
        segment of the next generation, then ``HEAD`` names it (and a new
        :attr:`incarnation`), then the old segments are deleted; a crash part way leaves
        the old numbering or the new, whole. A log holding nothing only moves
        :attr:`next_seq` on (no record changes its number: the incarnation stays).

        Raises
        ------
        StorageInputError
            If ``shift`` is not an int > 0.
        """
        if isinstance(shift, bool) or not isinstance(shift, int) or shift < 1:
            raise StorageInputError("shift", shift, "an int >= 1")
        with self._lock:
            self._check_open()
            new_first = self._first + shift
            if self._first == self._next:
                self._write_head(self._gen, new_first)
                self._first = self._next = new_first
                self._drop_segments(new_first)
                return
            held: list[pa.RecordBatch] = []
            i = self._index.head
            while i < len(self._index.firsts):
                batch = self._read_entry(i)
                skip = max(0, self._first - self._index.firsts[i])
                held.append(batch.slice(skip))
                i += 1
            gen = self._gen + 1
            incarnation = _new_incarnation()
            seg = self._new_segment(gen, new_first)
            old = self._segments
            self._segments = [seg]
            self._index.clear()
            self._gen, self._first, self._next = gen, new_first, new_first
            try:
                for b in held:
                    seq = seq_array(self._next, b.num_rows)
                    moved = pa.RecordBatch.from_arrays([seq, *b.columns[1:]], schema=WIRE_SCHEMA)
                    self._write_batch(moved, self._next, b.num_rows)
                self._write_head(gen, new_first, incarnation)
            except BaseException:
                # The old generation is still what HEAD names: the folder is unchanged.
                for s in self._segments:
                    s.close()
                self._segments = old
                self._closed = True  # memory no longer matches; reopen to go on
                raise
            self._incarnation = incarnation
            for s in old:
                s.close()
                with contextlib.suppress(FileNotFoundError):
                    s.path.unlink()

    # -- close --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the files and drop the lock; idempotent. Appends were already durable."""
        with self._lock:
            self._closed = True
            self._close_fds()

    def _close_fds(self) -> None:
        for seg in self._segments:
            seg.close()
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> RetentionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """The log's state, for stats and messages."""
        with self._lock:
            return {
                "folder": str(self.folder),
                "first": self._first,
                "next_seq": self._next,
                "segments": len(self._segments),
                "generation": self._gen,
                "incarnation": self._incarnation,
                "torn": self.torn,
            }
