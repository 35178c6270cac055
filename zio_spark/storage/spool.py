"""The spool: the source's durable, replayable log of pushed records.

Theory of operation (DESIGN.md, "The source", points 2-6):

ZIO producers push records; Spark wants offsets that point only at durable data and
ranges it can re-read identically. The spool sits between the two. Per producer (an
arbitrary string id) it keeps:

- **sealed segments**: immutable Arrow IPC *files* ``<first:020d>-<last:020d>.arrow`` in
  ``producers/<dirname>/``, written to a temporary name, fsync'd, renamed, and the folder
  fsync'd. Only sealed data is ever covered by an offset;
- an **open tail**: the records appended since the last :meth:`Spool.seal`. They live in
  the write-ahead log only; in memory the tail is an index, one entry (WAL file, offset,
  row count) per append. Seal reads them back through a memory map of the page-cached
  WAL, so memory holds no second copy of the backlog and the append path allocates only
  short-lived buffers (measured: keeping tail batches alive cost ~100 us per 1000-record
  append in fresh-page faults on this VM).

One **write-ahead log** (WAL) is shared by all producers (``wal/<generation:020d>.wal``):
a flush is then one ``fdatasync`` however many producers were appended to (measured: one
file syncs ~2.4k times/s, four files together ~0.6k times/s). A WAL record holds a whole
:meth:`Spool.append` batch::

    header  16 B  magic "ZSW1", payload length u32, CRC-32 of the payload u32, 0 u32
    payload       covers_from i64, producer id length u32, 0 u32,
                  producer id (UTF-8, zero-padded to 8 bytes),
                  one Arrow IPC record-batch message (WAL schema: SPARK_SCHEMA minus
                  ``producer``), zero-padded to 8 bytes

``covers_from`` is the producer's next expected sequence number before the append. On
open, the WAL files left by the previous run are scanned in generation order to rebuild
the tail index. A record whose ``covers_from`` is above what has been rebuilt so far means
earlier records are missing (a torn record before it): such a record is skipped (counted
in :attr:`SpoolStats.wal_records_skipped`), never accepted with a hole. The scan of a file
stops at the first record that is short, has a bad magic or a bad CRC, or does not decode
(a *torn* record, counted in :attr:`SpoolStats.torn_wal_records`), unless a valid record
follows it in the file: that is damage inside the file, not a write cut short by a crash,
so it is logged as an error and the scan resumes there (the ``covers_from`` check above
skips what follows for the producers that lost records in the damage). Records at or
below what segments already hold are dropped, so scanning a WAL whose records were
already sealed (crash between a segment's rename and the WAL's deletion) is harmless.

:meth:`Spool.seal` swaps in a fresh WAL generation, writes every non-empty tail as a
segment, and only when all are durable deletes the retired WAL files. Opening a spool
always starts a new WAL generation: appending after a torn record would make the new
records unreachable on the next scan.

Offsets are exclusive ends: ``{producer: next_seq}`` where ``next_seq`` is the last sealed
sequence number + 1 (records are numbered from 1, so a producer with nothing sealed has
end 1, or its committed offset). A committed offset ``c`` means every record with
``seq < c`` is consumed: segments whose last sequence number is below ``c`` are deleted.

Sequence numbers per producer must be ``next, next + 1, ...``. A record below ``next`` is
a duplicate (a resend): dropped and counted. A record above ``next`` is a gap: with
``on_gap="raise"`` the whole append is rejected with :class:`SequenceGapError` and nothing
is stored; with ``on_gap="accept"`` it is stored, the gap counted, and the missing numbers
are treated as a known hole (the segment that follows *covers* them, so reading across the
hole is not data loss).

Origins and granules are uint64 on the wire but ``long`` (int64) in Spark: a value
``>= 2**63`` is stored as its two's-complement int64 (``v - 2**64``); read it back as
unsigned with ``v & 0xFFFF_FFFF_FFFF_FFFF``. Negative values in ``[-2**63, 0)`` are stored
as they are; anything outside ``[-2**63, 2**64)`` is a :class:`ValueError`.

Threads: :meth:`Spool.append`/:meth:`Spool.flush` run on the receiver thread,
:meth:`Spool.seal`/:meth:`Spool.commit`/:meth:`Spool.read` on the Spark runner thread.
A state lock guards the in-memory state and the WAL writes (short: a ``write`` into the
page cache); no ``fsync`` ever runs under it. ``seal`` and ``commit`` are serialized by a
second, maintenance lock, which the receiver never takes. Each WAL file has its own sync
lock so that a flush cannot ``fdatasync`` a descriptor that ``seal`` is closing.

Executors in other processes read sealed segments with :func:`read_sealed`, which needs
only the folder (no lock, no WAL). Only one process may open a :class:`Spool` on a folder
(an ``flock`` on ``LOCK``; the kernel drops it when the process dies).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from zio_spark.errors import ConfigError, DataLossError, ZioSparkError

__all__ = [
    "DEFAULT_MAX_ROWS_PER_BATCH",
    "HEADERS_TYPE",
    "SPARK_SCHEMA",
    "WAL_SCHEMA",
    "CorruptSegmentError",
    "MissingRangeError",
    "Record",
    "SequenceGapError",
    "Spool",
    "SpoolLockedError",
    "SpoolStats",
    "project",
    "read_sealed",
]

log = logging.getLogger(__name__)

HEADERS_TYPE: Final = pa.map_(
    pa.field("key", pa.string(), nullable=False), pa.field("value", pa.string(), nullable=True)
)
"""``map<string,string>`` exactly as PySpark's ``to_arrow_type(MapType(StringType(),
StringType()))`` builds it (non-null keys, nullable values)."""

SPARK_SCHEMA: Final = pa.schema(
    [
        pa.field("value", pa.binary()),
        pa.field("key", pa.binary()),
        pa.field("producer", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("origin", pa.int64()),
        pa.field("granule", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("headers", HEADERS_TYPE),
    ]
)
"""The Arrow schema of every batch :meth:`Spool.read` yields: Spark's Arrow form of
``value binary, key binary, producer string, seq long, origin long, granule long,
timestamp timestamp, headers map<string,string>`` (all nullable, session time zone UTC)."""

_WAL_SCHEMA: Final = SPARK_SCHEMA.remove(SPARK_SCHEMA.get_field_index("producer"))
WAL_SCHEMA: Final = _WAL_SCHEMA
"""The columns of :meth:`Spool.append_batch`: :data:`SPARK_SCHEMA` without ``producer``."""
_SEQ_WAL: Final = _WAL_SCHEMA.get_field_index("seq")
_SEQ_SPARK: Final = SPARK_SCHEMA.get_field_index("seq")
_PRODUCER_SPARK: Final = SPARK_SCHEMA.get_field_index("producer")

DEFAULT_MAX_ROWS_PER_BATCH: Final = 10_000
"""Rows per yielded batch (FACTS.md measured 10k-row Arrow batches at 1.35-1.73M rows/s)."""

FORMAT_VERSION: Final = 1
_WAL_MAGIC: Final = b"ZSW1"
_WAL_HEADER: Final = struct.Struct("<4sIII")  # magic, payload length, crc32, reserved
_WAL_PREFIX: Final = struct.Struct("<qII")  # covers_from, producer id length, reserved
_SEGMENT_RE: Final = re.compile(r"^(\d{20})-(\d{20})\.arrow$")
_WAL_RE: Final = re.compile(r"^(\d{20})\.wal$")
_MAX_DIRECT_ID_BYTES: Final = 100  # longer ids get a hashed folder name (NAME_MAX is 255)
_SEGMENT_MAX_BYTES: Final = 64 << 20  # keep binary offsets far from the int32 limit
_U64: Final = 1 << 64
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_PAD: Final = bytes(8)


class Record(NamedTuple):
    """One received record. A plain tuple, so ``zip(*records)`` transposes a batch in C.

    Attributes
    ----------
    seq
        Producer sequence number: 1, 2, 3, ... per producer.
    value
        The payload (``None`` is stored as null).
    key
        Optional key.
    origin, granule
        ZIO flow-object fields, uint64 on the wire (see the module note on int64).
    timestamp_us
        Arrival time, microseconds since the Unix epoch (UTC), stamped by the receiver.
    headers
        Extra flow-object attributes, or ``None`` (stored as a null map).
    """

    seq: int
    value: bytes | None
    key: bytes | None = None
    origin: int = 0
    granule: int = 0
    timestamp_us: int = 0
    headers: Mapping[str, str] | None = None


class SequenceGapError(DataLossError, ValueError):
    """An append skipped sequence numbers while ``on_gap="raise"``; nothing was stored.

    ``producer``, ``expected`` (the next sequence number the spool wanted) and ``got``.
    """

    def __init__(self, producer: str, expected: int, got: int) -> None:
        self.expected = expected
        self.got = got
        super().__init__(
            f"producer {producer!r}: sequence gap, expected seq {expected}, got {got} "
            f"(records [{expected}, {got}) never arrived)",
            producer=producer,
        )


class MissingRangeError(DataLossError):
    """A requested range is not fully in sealed segments.

    ``producer``; ``start``/``end``, the first missing sub-range ``[start, end)``; and
    ``reason``: ``"deleted"`` (below what is retained: committed and removed, or never
    stored), ``"missing"`` (a hole between segments) or ``"unsealed"`` (not sealed yet).
    """

    def __init__(self, producer: str, start: int, end: int, reason: str) -> None:
        self.start = start
        self.end = end
        self.reason = reason
        super().__init__(
            f"producer {producer!r}: records [{start}, {end}) are not available ({reason})",
            producer=producer,
        )


class CorruptSegmentError(DataLossError):
    """A sealed segment file does not read back as the spool wrote it.

    ``path`` (the file), ``field`` (what is wrong: ``"file"``, ``"schema"``, a metadata
    key such as ``"zio.covers_from"``, ``"batch 3"``, ``"seq"``) and ``problem``. A
    :class:`DataLossError`, so a source with ``failOnDataLoss=false`` skips the range.
    """

    def __init__(self, path: Path, field: str, problem: str, producer: str | None) -> None:
        self.path = path
        self.field = field
        self.problem = problem
        super().__init__(f"corrupt spool segment {path}: {field}: {problem}", producer=producer)


class SpoolLockedError(ZioSparkError):
    """Another :class:`Spool` (in this or another process) has the folder open."""


@dataclass(frozen=True, slots=True)
class SpoolStats:
    """Counters since this :class:`Spool` was opened (``bytes_on_disk`` is current).

    ``appended``: new records stored; ``duplicates``: records dropped as already held;
    ``gaps``: accepted gaps (``on_gap="accept"``); ``segments_written``/``_deleted``;
    ``bytes_on_disk``: segments + WAL files; ``torn_wal_records``: torn or corrupt WAL
    records met on open (replay of that file stopped there, or resumed at the next valid
    record if one follows); ``wal_records_replayed``:
    WAL records indexed into tails on open; ``wal_records_skipped``: WAL records dropped on
    open because earlier records of their producer were lost.
    """

    appended: int = 0
    duplicates: int = 0
    gaps: int = 0
    segments_written: int = 0
    segments_deleted: int = 0
    bytes_on_disk: int = 0
    torn_wal_records: int = 0
    wal_records_replayed: int = 0
    wal_records_skipped: int = 0


def project(batch: pa.RecordBatch, columns: Sequence[str]) -> pa.RecordBatch:
    """Select ``columns`` (a user schema listing a subset of :data:`SPARK_SCHEMA`), in order.

    Zero-copy: the columns of ``batch`` are shared, not copied.

    Raises
    ------
    ConfigError
        A name that is not a spool column, or a name listed twice (option ``schema``).
    """
    names = list(columns)
    for name in names:
        if name not in SPARK_SCHEMA.names:
            raise ConfigError("schema", name, f"one of the columns {SPARK_SCHEMA.names}")
    if len(set(names)) != len(names):
        raise ConfigError("schema", names, "each column at most once")
    return batch.select(names)


def read_sealed(
    path: str | os.PathLike[str],
    producer: str,
    start_seq: int,
    end_seq: int,
    *,
    max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
) -> Iterator[pa.RecordBatch]:
    """Read ``[start_seq, end_seq)`` of ``producer`` straight from a spool folder.

    For executors in another process (local mode): no lock, no WAL, no recovery, only the
    immutable segment files. Same output as :meth:`Spool.read`.

    Every segment is checked as it is read (schema, metadata, ``seq`` invariants, and
    a full structural validation of the rows yielded): a damaged file never yields a
    batch that could crash whoever reads its values.

    Raises
    ------
    MissingRangeError
        At call time (before any batch), if the range is not fully in sealed segments.
    CorruptSegmentError
        A segment file is unreadable or does not hold what the spool wrote: at call time
        (schema, metadata) or while iterating (a batch). A :class:`DataLossError`.
    """
    _check_range(start_seq, end_seq, max_rows_per_batch)
    if start_seq == end_seq:
        return iter(())
    folder = Path(path) / "producers" / _dirname(_encode_id(producer))
    segments: list[_Segment] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            m = _SEGMENT_RE.match(entry.name)
            if m:
                first, last = int(m[1]), int(m[2])
                segments.append(_Segment(first, last, None, 0, Path(entry.path), 0))
    segments.sort(key=lambda s: s.first)
    plan = _plan(producer, segments, start_seq, end_seq)
    return _generate(producer, plan, start_seq, end_seq, max_rows_per_batch)


class Spool:
    """The source's durable log: append, flush, seal, read, commit (see the module note).

    Parameters
    ----------
    path
        The spool folder; created if missing, recovered if present.
    sync
        ``False`` skips every ``fsync`` (tests, benchmarks): nothing survives a machine
        crash, though a killed process still loses nothing the OS already has.
    on_gap
        ``"raise"`` (default): an append that skips sequence numbers raises
        :class:`SequenceGapError`; ``"accept"``: stores it and counts the gap.
    segment_batch_rows
        Rows per record batch inside a segment file (also capped at 64 MiB).

    Raises
    ------
    ConfigError
        A bad ``on_gap`` or ``segment_batch_rows``.
    SpoolLockedError
        The folder is open in another :class:`Spool`.
    DataLossError
        A sealed segment is unreadable or inconsistent (the disk lost fsync'd data).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync: bool = True,
        on_gap: Literal["raise", "accept"] = "raise",
        segment_batch_rows: int = 65_536,
    ) -> None:
        if on_gap not in ("raise", "accept"):
            raise ConfigError("on_gap", on_gap, '"raise" or "accept"')
        if isinstance(segment_batch_rows, bool) or not isinstance(segment_batch_rows, int):
            raise ConfigError("segment_batch_rows", segment_batch_rows, "an int >= 1")
        if segment_batch_rows < 1:
            raise ConfigError("segment_batch_rows", segment_batch_rows, "an int >= 1")
        self._root = Path(path)
        self._sync = sync
        self._on_gap = on_gap
        self._segment_batch_rows = segment_batch_rows
        self._lock = threading.Lock()
        self._maint_lock = threading.Lock()
        self._closed = False
        self._producers: dict[str, _Producer] = {}
        self._committed: dict[str, int] = {}
        self._retired: list[_Wal] = []  # swapped out (or left by an earlier run), not sealed
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "appended",
                "duplicates",
                "gaps",
                "segments_written",
                "segments_deleted",
                "torn_wal_records",
                "wal_records_replayed",
                "wal_records_skipped",
            ),
            0,
        )
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_folder_lock()
        try:
            self._prepare_layout()
            self._recover()
            self._wal = self._new_wal()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- receiver side -------------------------------------------------------------------

    def append(self, producer: str, records: Sequence[Record]) -> int:
        """Store ``records`` of ``producer`` in its open tail and in the WAL.

        Not durable until :meth:`flush` returns. Records below the producer's next
        expected sequence number are dropped as duplicates.

        Returns
        -------
        int
            How many records were new (stored).

        Raises
        ------
        SequenceGapError
            A record skips sequence numbers and ``on_gap="raise"``; nothing was stored.
        TypeError, ValueError
            Malformed records (wrong arity, a field of the wrong type, an origin or
            granule outside ``[-2**63, 2**64)``) or a producer id that is not a string
            encodable as UTF-8; nothing was stored.
        """
        n = len(records)
        if n == 0:
            return 0
        try:
            cols = tuple(zip(*records, strict=True))
        except ValueError as e:
            raise ValueError("records must all be Record tuples of 7 fields") from e
        if len(cols) != 7:
            raise ValueError(f"records must be Record tuples of 7 fields, got {len(cols)}")
        return self._append(producer, _build_wal_batch(cols, n), cols[0])

    def append_batch(self, producer: str, batch: pa.RecordBatch) -> int:
        """Like :meth:`append`, for records already in Arrow form (the receive hot path).

        ``batch`` has the columns of :data:`WAL_SCHEMA` (:data:`SPARK_SCHEMA` without
        ``producer``), exactly.

        Raises
        ------
        SequenceGapError
            As :meth:`append`.
        ValueError
            A batch of another schema, or with null sequence numbers; nothing was stored.
        """
        if not batch.schema.equals(_WAL_SCHEMA):
            raise ValueError(f"append_batch needs schema {_WAL_SCHEMA}, got {batch.schema}")
        if batch.num_rows == 0:
            return 0
        seq = batch.column(_SEQ_WAL)
        if seq.null_count:
            raise ValueError("append_batch: seq has nulls")
        _encode_id(producer)
        return self._append(producer, batch, tuple(seq.to_pylist()))

    def _append(self, producer: str, batch: pa.RecordBatch, seqs: Sequence[int]) -> int:
        n = batch.num_rows
        with self._lock:
            self._check_open()
            st = self._producer(producer)
            expect = st.next
            duplicates = gaps = 0
            if (
                seqs[0] == expect
                and seqs[-1] == expect + n - 1
                and seqs == tuple(range(expect, expect + n))
            ):
                keep = batch
            else:
                keep, duplicates, gaps = self._select(producer, batch, seqs, expect)
            self._counts["duplicates"] += duplicates
            if keep is None:
                return 0
            rows: int = keep.num_rows
            offset = self._wal.written
            self._wal.write(_encode_wal_record(st, expect, keep))
            st.tail.append(_Entry(self._wal, offset, rows))
            st.tail_rows += rows
            st.next = keep.column(_SEQ_WAL)[-1].as_py() + 1
            self._counts["appended"] += rows
            self._counts["gaps"] += gaps
            return rows

    def flush(self) -> None:
        """Make everything appended so far durable (one ``fdatasync`` per dirty WAL file).

        After it returns, a crash (even SIGKILL or power loss, with ``sync=True``) loses
        none of it: hand credit back to producers only after this.
        """
        with self._lock:
            self._check_open()
            if not self._sync:
                return
            todo = [(w, w.written) for w in (*self._retired, self._wal) if w.written > w.synced]
        for wal, target in todo:
            wal.sync_to(target)

    # -- runner side ---------------------------------------------------------------------

    def seal(self) -> dict[str, int]:
        """Turn every non-empty open tail into a durable segment; return the end offsets.

        Returns
        -------
        dict[str, int]
            :meth:`end_offsets` after sealing.
        """
        with self._maint_lock:
            with self._lock:
                self._check_open()
                needed = bool(self._retired or self._wal.written) or any(
                    st.tail for st in self._producers.values()
                )
            if needed:
                self._seal_locked()
            return self.end_offsets()

    def end_offsets(self) -> dict[str, int]:
        """Exclusive sealed end per producer, sorted by producer id.

        A producer is listed once it has had a sealed segment or a commit, and stays
        listed (so offset keys never disappear); a producer that has only unsealed
        records is absent. Its end is ``last sealed seq + 1``, never below its committed
        offset, and 1 if nothing was ever sealed.
        """
        with self._lock:
            return {p: st.end for p, st in sorted(self._producers.items()) if st.listed}

    def start_offsets(self) -> dict[str, int]:
        """Lowest retained sequence number per listed producer (its end if none retained).

        A retained segment that begins after an accepted gap covers the gap, so its
        start is where the gap began.
        """
        with self._lock:
            return {p: st.start for p, st in sorted(self._producers.items()) if st.listed}

    def committed(self) -> dict[str, int]:
        """The committed offsets, persisted across restarts, sorted by producer id."""
        with self._lock:
            return dict(sorted(self._committed.items()))

    def backlog(self) -> dict[str, int]:
        """Records stored above the committed offset (sealed + open tail), per producer.

        Every producer the spool knows is listed. After a commit beyond a producer's
        sealed end, its open-tail records below that commit still count until the next
        seal drops them.
        """
        with self._lock:
            return {p: st.sealed_above + st.tail_rows for p, st in sorted(self._producers.items())}

    def next_seq(self, producer: str) -> int:
        """The next sequence number ``producer`` should send (1 if unknown).

        ``next_seq - 1`` is the ``resume`` value for a BOT once :meth:`flush` returned.
        """
        with self._lock:
            st = self._producers.get(producer)
            if st is not None:
                return st.next
            return max(1, self._committed.get(producer, 1))

    def producers(self) -> list[str]:
        """Every producer the spool knows (sealed, unsealed or committed), sorted."""
        with self._lock:
            return sorted(self._producers)

    @property
    def path(self) -> Path:
        """The spool folder (give it to :func:`read_sealed` on executors)."""
        return self._root

    @property
    def stats(self) -> SpoolStats:
        """A snapshot of the counters."""
        with self._lock:
            size = sum(s.size for st in self._producers.values() for s in st.segments)
            size += sum(w.written for w in (*self._retired, self._wal))
            return SpoolStats(bytes_on_disk=size, **self._counts)

    def read(
        self,
        producer: str,
        start_seq: int,
        end_seq: int,
        *,
        max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
    ) -> Iterator[pa.RecordBatch]:
        """Yield the records with ``start_seq <= seq < end_seq`` from sealed segments.

        Batches have exactly :data:`SPARK_SCHEMA` (no metadata), at most
        ``max_rows_per_batch`` rows, are zero-copy slices of memory-mapped segments and
        are identical on every re-read. The range is checked when this is called, before
        any batch is produced.

        Raises
        ------
        MissingRangeError
            Part of the range is deleted (committed), missing or not sealed yet.
        CorruptSegmentError
            A segment file no longer reads back as written (see :func:`read_sealed`).
        ValueError
            ``start_seq > end_seq`` or ``max_rows_per_batch < 1``.
        """
        _check_range(start_seq, end_seq, max_rows_per_batch)
        if start_seq == end_seq:
            return iter(())
        with self._lock:
            self._check_open()
            st = self._producers.get(producer)
            if st is None:
                raise MissingRangeError(producer, start_seq, end_seq, "unsealed")
            segments, start, end = list(st.segments), st.start, st.end
        if end_seq > end:
            raise MissingRangeError(producer, max(start_seq, end), end_seq, "unsealed")
        if start_seq < start:
            raise MissingRangeError(producer, start_seq, min(end_seq, start), "deleted")
        plan = _plan(producer, segments, start_seq, end_seq)
        return _generate(producer, plan, start_seq, end_seq, max_rows_per_batch)

    def commit(self, offsets: Mapping[str, int]) -> None:
        """Records below ``offsets[producer]`` are consumed: persist, then delete segments.

        A segment is deleted when its last seq is below the committed end. Late, repeated,
        skipped and out-of-order commits are fine: an offset at or below the one already
        committed is a no-op; an unknown producer is recorded (its later records below the
        offset are dropped as duplicates). An offset above the sealed end raises the end
        to it: records below it that are still in the open tail are dropped at the next
        seal (a checkpoint from another spool incarnation; not a normal Spark flow).

        Raises
        ------
        TypeError, ValueError
            A key that is not a string or an offset that is not an int >= 0.
        """
        with self._maint_lock:
            with self._lock:
                self._check_open()
                changed: dict[str, int] = {}
                for producer, offset in offsets.items():
                    _encode_id(producer)
                    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                        raise ValueError(f"commit offset for {producer!r}: {offset!r} is not >= 0")
                    if offset > self._committed.get(producer, 1):
                        changed[producer] = offset
                if not changed:
                    return
                committed = {**self._committed, **changed}
                snapshot = {p: list(self._producer(p).segments) for p in changed}
            _atomic_write_json(
                self._root / "committed.json",
                {"format": FORMAT_VERSION, "committed": dict(sorted(committed.items()))},
                self._sync,
            )
            # Segments cannot change while we hold the maintenance lock: count outside.
            kept = {p: [s for s in segs if s.last >= changed[p]] for p, segs in snapshot.items()}
            above = {p: _rows_at_or_above(segs, changed[p]) for p, segs in kept.items()}
            doomed: list[_Segment] = []
            with self._lock:
                self._committed = committed
                for p, offset in changed.items():
                    st = self._producers[p]
                    st.listed = True
                    doomed.extend(s for s in st.segments if s.last < offset)
                    st.segments = kept[p]
                    st.sealed_above = above[p]
                    if offset > st.end:
                        st.end = offset
                        st.next = max(st.next, offset)
            self._delete_segments(doomed)

    def close(self) -> None:
        """Flush, close the WAL and release the folder. Idempotent."""
        with self._maint_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                wals = [*self._retired, self._wal]
            for wal in wals:
                if self._sync:
                    wal.sync_to(wal.written)
                wal.close()
            os.close(self._lock_fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"spool {self._root} is closed")

    def _producer(self, producer: str) -> _Producer:
        st = self._producers.get(producer)
        if st is None:
            st = _Producer(producer, _encode_id(producer))
            floor = self._committed.get(producer, 1)
            st.end = st.next = max(1, floor)
            self._producers[producer] = st
        return st

    def _select(
        self, producer: str, batch: pa.RecordBatch, seqs: tuple[int, ...], expect: int
    ) -> tuple[pa.RecordBatch | None, int, int]:
        keep: list[int] = []
        duplicates = gaps = 0
        for i, seq in enumerate(seqs):
            if seq < expect:
                duplicates += 1
                continue
            if seq > expect:
                if self._on_gap == "raise":
                    raise SequenceGapError(producer, expect, seq)
                gaps += 1
            keep.append(i)
            expect = seq + 1
        if not keep:
            return None, duplicates, gaps
        if keep[-1] - keep[0] == len(keep) - 1:
            return batch.slice(keep[0], len(keep)), duplicates, gaps
        return batch.take(pa.array(keep, pa.int64())), duplicates, gaps

    def _seal_locked(self) -> None:
        new_wal = self._new_wal()  # file created and its folder fsync'd before the swap
        with self._lock:
            tails = {
                p: (list(st.tail), st.end) for p, st in sorted(self._producers.items()) if st.tail
            }
            self._retired.append(self._wal)
            self._wal = new_wal
        maps: dict[Path, pa.Buffer] = {}
        for producer, (entries, covers_from) in tails.items():
            st = self._producers[producer]
            batches: list[pa.RecordBatch] = []
            cursor = covers_from  # drops records below a commit that raised the end
            for entry in entries:
                batch = _read_entry(producer, entry, maps)
                seq = batch.column(_SEQ_WAL)
                skip = _lower_bound(seq, cursor)
                if skip < batch.num_rows:
                    batches.append(batch.slice(skip) if skip else batch)
                    cursor = seq[-1].as_py() + 1
            segment = self._write_segment(st, batches, covers_from) if batches else None
            with self._lock:
                del st.tail[: len(entries)]
                st.tail_rows -= sum(e.rows for e in entries)
                if segment is not None:
                    st.segments.append(segment)
                    st.end = max(st.end, segment.last + 1)
                    st.sealed_above += segment.rows
                    st.listed = True
                    self._counts["segments_written"] += 1
        maps.clear()
        # Every record of the retired WAL files is now in a durable segment.
        with self._lock:
            retired, self._retired = self._retired, []
        for wal in retired:
            wal.close()
            _unlink(wal.path)

    def _write_segment(
        self, st: _Producer, batches: list[pa.RecordBatch], covers_from: int
    ) -> _Segment:
        rows = sum(b.num_rows for b in batches)
        first = batches[0].column(_SEQ_WAL)[0].as_py()
        last = batches[-1].column(_SEQ_WAL)[-1].as_py()
        folder = self._root / "producers" / st.dirname
        if not folder.is_dir():
            folder.mkdir()
            self._fsync_dir(folder.parent)
        final = folder / f"{first:020d}-{last:020d}.arrow"
        tmp = folder / f".{final.name}.tmp"
        schema = SPARK_SCHEMA.with_metadata(
            {
                "zio.format": str(FORMAT_VERSION),
                "zio.producer": st.id,
                "zio.covers_from": str(covers_from),
                "zio.rows": str(rows),
            }
        )
        try:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for group in _regroup(batches, self._segment_batch_rows, _SEGMENT_MAX_BYTES):
                    columns = group.columns
                    columns.insert(_PRODUCER_SPARK, pa.repeat(st.id_scalar, group.num_rows))
                    writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
            if self._sync:
                fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)  # the records stay in the tail and the WAL; the next seal retries
            raise
        self._fsync_dir(folder)
        return _Segment(first, last, covers_from, rows, final, final.stat().st_size)

    def _delete_segments(self, doomed: list[_Segment]) -> None:
        for segment in doomed:
            _unlink(segment.path)
        if doomed:
            with self._lock:
                self._counts["segments_deleted"] += len(doomed)

    def _fsync_dir(self, path: Path) -> None:
        if self._sync:
            _fsync_dir(path)

    def _take_folder_lock(self) -> int:
        fd = os.open(self._root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLockedError(f"spool {self._root} is open in another Spool") from None
        return fd

    def _prepare_layout(self) -> None:
        meta = self._root / "spool.json"
        if meta.exists():
            fmt = json.loads(meta.read_text()).get("format")
            if fmt != FORMAT_VERSION:
                raise ConfigError("path", str(self._root), f"a spool of format {FORMAT_VERSION}")
        else:
            _atomic_write_json(meta, {"format": FORMAT_VERSION}, self._sync)
        for sub in ("producers", "wal"):
            (self._root / sub).mkdir(exist_ok=True)
        self._fsync_dir(self._root)

    def _recover(self) -> None:
        committed_path = self._root / "committed.json"
        if committed_path.exists():
            raw = json.loads(committed_path.read_text())["committed"]
            self._committed = {str(p): int(c) for p, c in raw.items()}
        for entry in sorted(os.scandir(self._root / "producers"), key=lambda e: e.name):
            if entry.is_dir():
                self._recover_segments(Path(entry.path))
        for producer, offset in self._committed.items():
            st = self._producer(producer)
            st.listed = True
            st.end = max(st.end, offset)
            doomed = [s for s in st.segments if s.last < offset]  # a commit cut short
            st.segments = [s for s in st.segments if s.last >= offset]
            self._delete_segments(doomed)
        for st in self._producers.values():
            st.next = st.end
            st.sealed_above = _rows_at_or_above(st.segments, self._committed.get(st.id, 1))
        gens = []
        for entry in os.scandir(self._root / "wal"):
            m = _WAL_RE.match(entry.name)
            if m:
                gens.append((int(m[1]), Path(entry.path)))
            elif entry.name.endswith(".tmp"):
                _unlink(Path(entry.path))
        for _, path in sorted(gens):
            self._retired.append(self._scan_wal(path))
        self._next_gen = max((g for g, _ in gens), default=0) + 1

    def _recover_segments(self, folder: Path) -> None:
        segments: list[_Segment] = []
        owner: str | None = None
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name.endswith(".tmp"):  # a seal cut short; its records are in the WAL
                _unlink(Path(entry.path))
                continue
            m = _SEGMENT_RE.match(entry.name)
            if not m:
                continue
            path = Path(entry.path)
            first, last = int(m[1]), int(m[2])
            _, producer, covers_from, rows = _open_segment(path, first, last, None)
            if owner is None:
                owner = producer
            if producer != owner or _dirname(_encode_id(producer)) != folder.name:
                raise DataLossError(
                    f"spool segment {path} belongs to producer {producer!r}, "
                    f"not to folder {folder.name}",
                    producer=producer,
                )
            if segments and first <= segments[-1].last:
                raise DataLossError(
                    f"spool segment {path} overlaps its neighbours or covers {covers_from}",
                    producer=producer,
                )
            segments.append(_Segment(first, last, covers_from, rows, path, entry.stat().st_size))
        if owner is not None:
            st = self._producer(owner)
            st.segments = segments
            st.end = max(st.end, segments[-1].last + 1)
            st.listed = True

    def _scan_wal(self, path: Path) -> _Wal:
        """Index the records of a WAL file left by an earlier run into the tails."""
        size = path.stat().st_size
        wal = _Wal(path, -1)
        wal.written = wal.synced = size
        wal.closed = True
        if size == 0:
            return wal
        if self._sync:  # what we index must be on disk before producers are told so
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        data = pa.memory_map(str(path)).read_buffer()
        off = 0
        while off < size:
            record = _decode_wal_record(data, off)
            if record is None:
                self._counts["torn_wal_records"] += 1
                resume = _next_wal_record(path, data, off)
                if resume is None:  # a torn tail: the write that a crash cut short
                    log.warning(
                        "spool WAL %s: torn or corrupt record at byte %d; ignored %d bytes",
                        path,
                        off,
                        size - off,
                    )
                    break
                # Valid records follow: not a torn tail but damage inside the file. Keep
                # what follows; a producer whose records were lost in the damage gets its
                # later records skipped (covers_from above its next seq), never a hole.
                log.error(
                    "spool WAL %s: corrupt record at byte %d; %d bytes lost up to the next "
                    "valid record at byte %d (records of producers that lost data in them "
                    "are skipped and counted in wal_records_skipped)",
                    path,
                    off,
                    resume - off,
                    resume,
                )
                off = resume
                continue
            length, producer, covers_from, batch = record
            offset, off = off, off + length
            st = self._producer(producer)
            if covers_from > st.next:
                self._counts["wal_records_skipped"] += 1
                continue
            seq = batch.column(_SEQ_WAL)
            rows = batch.num_rows - _lower_bound(seq, st.next)
            if rows == 0:
                continue
            st.tail.append(_Entry(wal, offset, rows))
            st.tail_rows += rows
            st.next = seq[-1].as_py() + 1
            self._counts["wal_records_replayed"] += 1
        return wal

    def _new_wal(self) -> _Wal:
        gen = self._next_gen
        self._next_gen += 1
        path = self._root / "wal" / f"{gen:020d}.wal"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._fsync_dir(path.parent)
        return _Wal(path, fd)


# -- helpers ---------------------------------------------------------------------------


class _Segment:
    __slots__ = ("covers_from", "first", "last", "path", "rows", "size")

    def __init__(
        self, first: int, last: int, covers_from: int | None, rows: int, path: Path, size: int
    ) -> None:
        self.first = first
        self.last = last
        self.covers_from = covers_from  # None: read it from the file (read_sealed)
        self.rows = rows
        self.path = path
        self.size = size


class _Producer:
    __slots__ = (
        "dirname",
        "end",
        "id",
        "id_scalar",
        "listed",
        "next",
        "sealed_above",
        "segments",
        "tail",
        "tail_rows",
        "wal_prefix",
    )

    def __init__(self, producer: str, encoded: bytes) -> None:
        self.id = producer
        self.id_scalar = pa.scalar(producer, pa.string())
        self.dirname = _dirname(encoded)
        self.wal_prefix = (len(encoded), encoded + _PAD[: -len(encoded) % 8])
        self.segments: list[_Segment] = []
        self.end = 1  # exclusive end of sealed data (never below the committed offset)
        self.next = 1  # next expected seq: end, or the open tail's last seq + 1
        self.tail: list[_Entry] = []  # open-tail records, in the WAL
        self.tail_rows = 0
        self.sealed_above = 0  # sealed rows with seq >= committed
        self.listed = False  # in end_offsets(): has had a segment or a commit

    @property
    def start(self) -> int:
        if self.segments:
            covers_from = self.segments[0].covers_from
            assert covers_from is not None
            return covers_from
        return self.end


class _Entry(NamedTuple):
    """One append in the open tail: its WAL record, and how many of its rows are new."""

    wal: _Wal
    offset: int
    rows: int


class _Wal:
    """One WAL file. ``written`` changes under the spool's state lock; syncing and closing
    take ``sync_lock`` so a flush never syncs a descriptor that is being closed."""

    __slots__ = ("closed", "fd", "path", "sync_lock", "synced", "written")

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.written = 0
        self.synced = 0
        self.closed = False
        self.sync_lock = threading.Lock()

    def write(self, parts: list[Any]) -> None:
        total = sum(memoryview(p).nbytes for p in parts)
        try:
            done = os.writev(self.fd, parts)
            if done < total:  # short write: finish with the bytes left
                rest = b"".join(bytes(p) for p in parts)[done:]
                while rest:
                    rest = rest[os.write(self.fd, rest) :]
        except BaseException:
            # A partial record would hide every later one from replay: cut it off.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.written)
                os.lseek(self.fd, self.written, os.SEEK_SET)
            raise
        self.written += total

    def sync_to(self, target: int) -> None:
        with self.sync_lock:
            if self.closed or self.synced >= target:
                return
            os.fdatasync(self.fd)
            self.synced = target

    def close(self) -> None:
        with self.sync_lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


def _encode_id(producer: str) -> bytes:
    if not isinstance(producer, str):
        raise TypeError(f"producer id must be a str, got {type(producer).__name__}")
    try:
        return producer.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"producer id {producer!r} is not encodable as UTF-8") from e


def _dirname(encoded: bytes) -> str:
    # Hex: safe on every file system (no case folding, no separators); long ids hashed.
    # The real id is in each segment's metadata, which is what recovery trusts.
    if len(encoded) <= _MAX_DIRECT_ID_BYTES:
        return "p" + encoded.hex()
    return "h" + hashlib.sha256(encoded).hexdigest()


def _int64_column(values: tuple[Any, ...], name: str, type_: pa.DataType) -> pa.Array:
    try:
        data = array.array("q", values)  # the common case, in C
    except (OverflowError, TypeError):
        return _int64_column_slow(values, name, type_)
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(data)])


def _int64_column_slow(values: tuple[Any, ...], name: str, type_: pa.DataType) -> pa.Array:
    out: list[int | None] = []
    for v in values:
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"records: {name} must be an int or None, got {v!r}")
            if not _I64_MIN <= v < _U64:
                raise ValueError(f"records: {name} {v} is outside [-2**63, 2**64)")
            if v > _I64_MAX:
                v -= _U64  # uint64 on the wire: keep the bits, as two's complement
        out.append(v)
    return pa.array(out, type_)


def _build_wal_batch(cols: tuple[tuple[Any, ...], ...], n: int) -> pa.RecordBatch:
    seqs, values, keys, origins, granules, stamps, headers = cols
    seq_array = _int64_column(seqs, "seq", pa.int64())
    if seq_array.null_count:
        raise TypeError("records: seq must be int, got None")
    try:
        value_array = pa.array(values, pa.binary())
        key_array = (
            pa.nulls(n, pa.binary()) if keys.count(None) == n else pa.array(keys, pa.binary())
        )
        header_array = (
            pa.nulls(n, HEADERS_TYPE)
            if headers.count(None) == n
            else pa.array([None if h is None else dict(h) for h in headers], HEADERS_TYPE)
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        raise TypeError(f"records: value/key must be bytes, headers a str->str map: {e}") from e
    return pa.RecordBatch.from_arrays(
        [
            value_array,
            key_array,
            seq_array,
            _int64_column(origins, "origin", pa.int64()),
            _int64_column(granules, "granule", pa.int64()),
            _int64_column(stamps, "timestamp_us", pa.timestamp("us", tz="UTC")),
            header_array,
        ],
        schema=_WAL_SCHEMA,
    )


def _encode_wal_record(st: _Producer, covers_from: int, batch: pa.RecordBatch) -> list[Any]:
    id_len, id_padded = st.wal_prefix
    body = batch.serialize()
    pad = _PAD[: -body.size % 8]
    prefix = _WAL_PREFIX.pack(covers_from, id_len, 0) + id_padded
    length = len(prefix) + body.size + len(pad)
    if length > 0xFFFF_FFFF:
        raise ValueError(f"append batch too large for one WAL record: {length} bytes")
    crc = zlib.crc32(pad, zlib.crc32(body, zlib.crc32(prefix)))
    return [_WAL_HEADER.pack(_WAL_MAGIC, length, crc, 0), prefix, body, pad]


def _read_entry(producer: str, entry: _Entry, maps: dict[Path, pa.Buffer]) -> pa.RecordBatch:
    data = maps.get(entry.wal.path)
    if data is None:
        data = maps[entry.wal.path] = pa.memory_map(str(entry.wal.path)).read_buffer()
    record = _decode_wal_record(data, entry.offset)
    if record is None or record[1] != producer:
        # Bytes this process wrote (or indexed on open) no longer read back: the disk or
        # the page cache lost them. Keep every WAL file; nothing is sealed past this.
        raise DataLossError(
            f"spool WAL {entry.wal.path}: record at byte {entry.offset} of producer "
            f"{producer!r} no longer reads back",
            producer=producer,
        )
    return record[3]


def _decode_wal_record(data: pa.Buffer, off: int) -> tuple[int, str, int, pa.RecordBatch] | None:
    """The record at ``off``: ``(length, producer, covers_from, batch)``, or ``None``.

    ``None`` for anything short, with a bad magic or CRC (torn), and for a CRC-valid
    payload that does not decode into what :meth:`Spool.append` writes (a valid Arrow
    batch of :data:`WAL_SCHEMA`, non-empty, ``seq`` non-null, strictly increasing and
    ``>= covers_from >= 1``): never an exception, never a batch that could crash a reader.
    """
    size = data.size
    if off < 0 or size - off < _WAL_HEADER.size:
        return None
    magic, length, crc, _ = _WAL_HEADER.unpack_from(data, off)
    start = off + _WAL_HEADER.size
    if magic != _WAL_MAGIC or start + length > size or length < _WAL_PREFIX.size:
        return None
    payload = data.slice(start, length)
    if zlib.crc32(payload) != crc:
        return None
    try:
        covers_from, id_len, _ = _WAL_PREFIX.unpack_from(payload, 0)
        id_end = _WAL_PREFIX.size + id_len
        if id_end + (-id_len % 8) > length or covers_from < 1:
            return None
        producer = payload.slice(_WAL_PREFIX.size, id_len).to_pybytes().decode("utf-8")
        body = payload.slice(id_end + (-id_len % 8))
        batch = pa.ipc.read_record_batch(body, _WAL_SCHEMA)
        batch.validate(full=True)
    except (OSError, EOFError, ValueError, IndexError, struct.error, pa.ArrowException):
        # CRC-valid yet undecodable (pyarrow raises OSError/EOFError for a short message
        # body, ArrowInvalid for a malformed one): corrupt, handled like a torn record.
        return None
    n = batch.num_rows
    seq = batch.column(_SEQ_WAL)
    if n == 0 or seq.null_count or seq[0].as_py() < covers_from:
        return None
    if not _increasing(seq):
        return None
    return _WAL_HEADER.size + length, producer, covers_from, batch


def _next_wal_record(path: Path, data: pa.Buffer, off: int) -> int | None:
    """The offset of the first decodable record after ``off`` (records are 8-aligned)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = off + 8 - off % 8
        while True:
            pos = mm.find(_WAL_MAGIC, pos)
            if pos < 0:
                return None
            if pos % 8 == 0 and _decode_wal_record(data, pos) is not None:
                return pos
            pos += 1


def _regroup(
    batches: list[pa.RecordBatch], max_rows: int, max_bytes: int
) -> Iterator[pa.RecordBatch]:
    """Re-chunk the tail into batches of ``max_rows`` rows (fewer past ``max_bytes``)."""
    pending: list[pa.RecordBatch] = []
    rows = nbytes = 0
    for batch in batches:
        while batch.num_rows:
            take = min(batch.num_rows, max_rows - rows)
            part, batch = batch.slice(0, take), batch.slice(take)
            pending.append(part)
            rows += take
            nbytes += part.nbytes
            if rows >= max_rows or nbytes >= max_bytes:
                yield _combine(pending)
                pending, rows, nbytes = [], 0, 0
    if pending:
        yield _combine(pending)


def _combine(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    combined: pa.RecordBatch = (
        pa.Table.from_batches(batches).combine_chunks().to_batches(max_chunksize=None)[0]
    )
    return combined


def _lower_bound(seq: pa.Array, value: int) -> int:
    """Index of the first element ``>= value`` in a sorted, null-free int64 array."""
    n = len(seq)
    if n == 0:
        return 0
    first = seq[0].as_py()
    if value <= first:
        return 0
    last = seq[n - 1].as_py()
    if value > last:
        return n
    if last - first == n - 1:  # no gap inside: plain arithmetic
        return int(value - first)
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if seq[mid].as_py() < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _rows_at_or_above(segments: list[_Segment], offset: int) -> int:
    total = 0
    for seg in segments:
        if seg.first >= offset:
            total += seg.rows
        elif seg.last >= offset:
            if seg.rows == seg.last - seg.first + 1:
                total += seg.last - offset + 1
            else:  # an accepted gap inside: count from the file
                reader, _, _, rows = _open_segment(seg.path, seg.first, seg.last, None)
                check = _SegmentCheck(seg, rows, None)
                for k in range(reader.num_record_batches):
                    seq = check.batch(reader, k).column(_SEQ_SPARK)
                    total += len(seq) - _lower_bound(seq, offset)
    return total


def _increasing(seq: pa.Array) -> bool:
    n = len(seq)
    return n < 2 or bool(pc.all(pc.greater(seq.slice(1), seq.slice(0, n - 1))).as_py())


def _open_reader(path: Path) -> pa.ipc.RecordBatchFileReader:
    # The mapping stays alive as long as any batch sliced from it does, even after the
    # file is unlinked by a commit.
    return pa.ipc.open_file(pa.memory_map(str(path)))


_DECIMAL: Final = re.compile(rb"0|[1-9][0-9]{0,18}")
_FORMAT_BYTES: Final = str(FORMAT_VERSION).encode()


def _meta_int(path: Path, meta: Mapping[bytes, bytes], key: bytes, producer: str | None) -> int:
    raw = meta.get(key)
    if raw is None:
        raise CorruptSegmentError(path, key.decode(), "missing from the metadata", producer)
    if not _DECIMAL.fullmatch(raw) or int(raw) > _I64_MAX:
        raise CorruptSegmentError(path, key.decode(), f"{raw!r} is not an int64 >= 0", producer)
    return int(raw)


def _open_segment(
    path: Path, first: int, last: int, producer: str | None
) -> tuple[pa.ipc.RecordBatchFileReader, str, int, int]:
    """Open a segment and check its schema and metadata (cheap: the footer only).

    Returns the reader, the producer, ``zio.covers_from`` and ``zio.rows``. ``first`` and
    ``last`` come from the file name; ``producer``, if given, must be the file's.

    Raises
    ------
    FileNotFoundError
        The file is gone (a commit deleted it).
    CorruptSegmentError
        Anything else.
    """
    try:
        reader = _open_reader(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, IndexError, pa.ArrowException) as e:
        problem = f"not a readable Arrow IPC file ({e})"
        raise CorruptSegmentError(path, "file", problem, producer) from e
    schema = reader.schema
    if not schema.equals(SPARK_SCHEMA):  # metadata aside
        raise CorruptSegmentError(path, "schema", f"not the spool schema: {schema}", producer)
    meta = schema.metadata or {}
    if meta.get(b"zio.format") != _FORMAT_BYTES:
        problem = f"{meta.get(b'zio.format')!r}, not {_FORMAT_BYTES!r}"
        raise CorruptSegmentError(path, "zio.format", problem, producer)
    try:
        owner = meta[b"zio.producer"].decode("utf-8")
    except (KeyError, UnicodeDecodeError) as e:
        problem = f"missing or not UTF-8 ({e!r})"
        raise CorruptSegmentError(path, "zio.producer", problem, producer) from e
    if producer is not None and owner != producer:
        raise CorruptSegmentError(path, "zio.producer", f"{owner!r}, not {producer!r}", producer)
    covers_from = _meta_int(path, meta, b"zio.covers_from", producer)
    rows = _meta_int(path, meta, b"zio.rows", producer)
    if not 1 <= covers_from <= first <= last:
        problem = f"{covers_from} with seqs [{first}, {last}] in the file name"
        raise CorruptSegmentError(path, "zio.covers_from", problem, producer)
    if not 1 <= rows <= last - first + 1:
        problem = f"{rows} rows for seqs [{first}, {last}] in the file name"
        raise CorruptSegmentError(path, "zio.rows", problem, producer)
    return reader, owner, covers_from, rows


class _SegmentCheck:
    """Checks the batches of one segment, read in order, against the spool's invariants.

    Per batch (cheap, no pass over the values): the buffers are large enough for the
    lengths (``validate()``), ``seq`` is non-null, continues the previous batch and stays
    within the file name's range; when the segment has no accepted gap (``zio.rows`` =
    ``last - first + 1``) its endpoints are exactly ``n - 1`` apart, else every seq is
    checked strictly increasing (what finding a seq relies on). The rows handed out are
    then fully validated (:meth:`rows_out`): offsets, UTF-8, map keys, the producer id,
    and without a gap their seqs increasing by one. The per-row cost is paid only for the
    rows handed out (measured ~3.5 ns per row for 100-byte values; a CRC-32 of the file
    would cost ~30).
    """

    __slots__ = ("contiguous", "next", "producer", "rows", "seen", "seg")

    def __init__(self, seg: _Segment, rows: int, producer: str | None) -> None:
        self.seg = seg
        self.producer = producer
        self.rows = rows
        self.contiguous = rows == seg.last - seg.first + 1
        self.next = seg.first  # the lowest seq the next batch may start with
        self.seen = 0

    def _fail(self, field: str, problem: str) -> CorruptSegmentError:
        return CorruptSegmentError(self.seg.path, field, problem, self.producer)

    def batch(self, reader: pa.ipc.RecordBatchFileReader, k: int) -> pa.RecordBatch:
        try:
            batch = reader.get_batch(k)
            batch.validate()
        except (OSError, ValueError, IndexError, pa.ArrowException) as e:
            raise self._fail(f"batch {k}", f"unreadable ({e})") from e
        n = batch.num_rows
        if n == 0 or not batch.schema.equals(SPARK_SCHEMA):
            raise self._fail(f"batch {k}", f"{n} rows of schema {batch.schema}")
        seq = batch.column(_SEQ_SPARK)
        if seq.null_count:
            raise self._fail("seq", f"batch {k} has {seq.null_count} null seqs")
        lo, hi = seq[0].as_py(), seq[n - 1].as_py()
        start_ok = lo == self.next if self.contiguous or k == 0 else lo >= self.next
        if not start_ok or hi > self.seg.last or (self.contiguous and hi - lo != n - 1):
            problem = f"batch {k} holds seqs {lo}..{hi} ({n} rows) after seq {self.next - 1}"
            raise self._fail("seq", problem)
        # Without a gap, the endpoints place every row: the seqs of the rows handed out
        # are checked in rows_out. With one, finding a seq needs them all sorted.
        if not self.contiguous and not _increasing(seq):
            raise self._fail("seq", f"batch {k}: seqs not strictly increasing")
        self.next = hi + 1
        self.seen += n
        return batch

    def rows_out(self, part: pa.RecordBatch, k: int, ids: pa.Array, first: int) -> pa.RecordBatch:
        """``part``, fully validated. ``ids``: the producer id (binary), at least as many
        rows; ``first``: the seq its first row must have if the segment has no gap."""
        # validate(full=True) of the whole batch would spend 70 % of its time checking
        # the UTF-8 of the producer column: comparing it as bytes to the one id it must
        # hold is cheaper and checks more (measured 3.5 against 5 ns per row).
        column = part.column(_PRODUCER_SPARK).view(pa.binary())
        try:
            part.drop_columns("producer").validate(full=True)
            column.validate(full=True)
        except (ValueError, pa.ArrowException) as e:
            raise self._fail(f"batch {k}", f"invalid values ({e})") from e
        if not column.equals(ids.slice(0, part.num_rows)):
            problem = f"batch {k} holds rows of another producer than {self.producer!r}"
            raise self._fail("producer", problem)
        if self.contiguous:
            seq, m = part.column(_SEQ_SPARK), part.num_rows
            ends = (seq[0].as_py(), seq[m - 1].as_py())
            if ends != (first, first + m - 1) or not _increasing(seq):
                raise self._fail("seq", f"batch {k}: seqs from {first} not increasing by one")
        return part

    def end(self, batches: int) -> None:
        if self.next != self.seg.last + 1 or self.seen != self.rows:
            problem = (
                f"{batches} batches hold {self.seen} rows up to seq {self.next - 1}; "
                f"zio.rows {self.rows} and the file name say up to {self.seg.last}"
            )
            raise self._fail("seq", problem)


def _check_range(start_seq: int, end_seq: int, max_rows_per_batch: int) -> None:
    for name, v in (("start_seq", start_seq), ("end_seq", end_seq)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be int, got {v!r}")
    if start_seq > end_seq:
        raise ValueError(f"start_seq {start_seq} > end_seq {end_seq}")
    if isinstance(max_rows_per_batch, bool) or not isinstance(max_rows_per_batch, int):
        raise TypeError(f"max_rows_per_batch must be int, got {max_rows_per_batch!r}")
    if max_rows_per_batch < 1:
        raise ValueError(f"max_rows_per_batch must be >= 1, got {max_rows_per_batch}")


_Plan = list[tuple[_Segment, pa.ipc.RecordBatchFileReader, int]]


def _plan(producer: str, segments: list[_Segment], start: int, end: int) -> _Plan:
    """Open the segments covering ``[start, end)``; raise if coverage has a hole."""
    plan: _Plan = []
    pos = start
    i = bisect.bisect_left([s.last for s in segments], start)
    for seg in segments[i:]:
        if pos >= end:
            break
        try:
            reader, _, covers_from, rows = _open_segment(seg.path, seg.first, seg.last, producer)
        except FileNotFoundError:
            raise MissingRangeError(producer, pos, min(end, seg.last + 1), "deleted") from None
        if seg.covers_from is not None and covers_from != seg.covers_from:
            problem = f"{covers_from}, was {seg.covers_from} when the spool opened it"
            raise CorruptSegmentError(seg.path, "zio.covers_from", problem, producer)
        if covers_from > pos:
            reason = "missing" if plan else "deleted"
            raise MissingRangeError(producer, pos, min(end, covers_from), reason)
        plan.append((seg, reader, rows))
        pos = seg.last + 1
    if pos < end:
        raise MissingRangeError(producer, pos, end, "unsealed")
    return plan


def _generate(
    producer: str, plan: _Plan, start: int, end: int, max_rows: int
) -> Iterator[pa.RecordBatch]:
    ids = pa.repeat(pa.scalar(producer.encode("utf-8"), pa.binary()), min(max_rows, end - start))
    for seg, reader, rows in plan:
        if seg.first >= end:
            return
        check = _SegmentCheck(seg, rows, producer)
        batches = reader.num_record_batches
        for k in range(batches):
            batch = check.batch(reader, k)
            seq = batch.column(_SEQ_SPARK)
            if check.next <= start:  # its last seq is below start
                continue
            if seq[0].as_py() >= end:
                return
            lo, hi = _lower_bound(seq, start), _lower_bound(seq, end)
            base = seq[0].as_py()
            batch = batch.replace_schema_metadata(None)
            for off in range(lo, hi, max_rows):
                yield check.rows_out(batch.slice(off, min(max_rows, hi - off)), k, ids, base + off)
        check.end(batches)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_json(path: Path, obj: object, sync: bool) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    data = json.dumps(obj, sort_keys=True).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync:
        _fsync_dir(path.parent)
