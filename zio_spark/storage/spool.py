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
:meth:`Spool.append` batch and the producer's ``covers_from``; its layout is in
:mod:`zio_spark.storage.wal`.

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

Executors in other processes read sealed segments with :func:`read_sealed`
(:mod:`zio_spark.storage.spool_sealed`), which needs only the folder (no lock, no WAL).
Only one process may open a :class:`Spool` on a folder (an ``flock`` on ``LOCK``; the
kernel drops it when the process dies).
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import numpy as np
import pyarrow as pa

from zio_spark.codec.schema import HEADERS_TYPE, SPARK_SCHEMA, WAL_SCHEMA
from zio_spark.errors import (
    ConfigError,
    DataLossError,
    StorageClosedError,
    StorageInputError,
)
from zio_spark.storage.files import atomic_write, fsync_dir, fsync_file, lock_folder
from zio_spark.storage.spool_peers import SpoolPeers
from zio_spark.storage.spool_sealed import (
    DEFAULT_MAX_ROWS_PER_BATCH,
    FORMAT_VERSION,
    SEGMENT_RE,
    SEQ_WAL,
    CorruptSegmentError,
    MissingRangeError,
    SealedFile,
    check_range,
    encode_id,
    generate_batches,
    lower_bound,
    open_segment,
    plan_read,
    producer_dirname,
    project,
    read_sealed,
    rows_at_or_above,
    unlink_quiet,
    write_sealed,
)
from zio_spark.storage.wal import (
    PAD,
    WAL_RE,
    Record,
    Wal,
    WalEntry,
    WalScan,
    build_wal_batch,
    encode_wal_record,
    read_entry,
)

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
    "SpoolClosedError",
    "SpoolLockedError",
    "SpoolPathError",
    "SpoolStats",
    "project",
    "read_sealed",
]

_WAL_SCHEMA: Final = WAL_SCHEMA


class SpoolClosedError(StorageClosedError, ValueError):
    """The spool was used after :meth:`Spool.close` (also a :class:`ValueError`, which
    it raised before)."""


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


SPOOL_OPTION: Final = "spoolPath"
"""The source option that names a spool folder (the errors below name it)."""


class SpoolLockedError(ConfigError):
    """Another :class:`Spool` (in this or another process) has the folder open: two
    queries, or a query and a batch read, were given one ``spoolPath``.

    ``option`` is ``"spoolPath"``, ``value`` the folder.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(
            SPOOL_OPTION,
            str(path),
            "a spool folder no other query or process has open, but another Spool (a "
            "running query, batch read or process) holds this one; give each query its "
            "own spoolPath, or stop the query that uses it first",
        )


class SpoolPathError(ConfigError):
    """The spool folder cannot be created, read or written (``OSError`` on open).

    ``option`` is ``"spoolPath"``, ``value`` the folder; the ``OSError`` is the cause.
    """

    def __init__(self, path: str | os.PathLike[str], error: OSError) -> None:
        self.errno = error.errno
        what = error.strerror or str(error)
        where = (
            f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
        )
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = (
                "set spoolPath to a folder this process may create and write (the Spark "
                "driver's user; on a cluster, a folder shared by the driver and the "
                "executors), or give that user write access to it"
            )
        elif error.errno in (errno.ENOTDIR, errno.EEXIST):
            fix = "set spoolPath to a folder: part of this path is a file"
        elif error.errno == errno.ENOSPC:
            fix = "free space on its filesystem, or set spoolPath to a folder on another"
        else:
            fix = "set spoolPath to a folder this process can create, read and write"
        super().__init__(
            SPOOL_OPTION,
            str(path),
            f"a spool folder this process can use, but opening it failed: {what}{where}; {fix}",
        )


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
        The folder is open in another :class:`Spool` (a :class:`ConfigError` naming
        ``spoolPath``).
    SpoolPathError
        The folder cannot be created, read or written (a :class:`ConfigError` naming
        ``spoolPath``, the folder, the ``OSError`` and what to do).
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
        self._acked: dict[str, int] = {}  # acknowledged, not committed (memory only)
        self._retired: list[Wal] = []  # swapped out (or left by an earlier run), not sealed
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
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = self._take_folder_lock()
        except OSError as e:  # read-only, a file in the way, ...: name the option
            raise SpoolPathError(self._root, e) from e
        try:
            self._prepare_layout()
            self._recover()
            self._wal = self._new_wal()
            self.peers = SpoolPeers(self._root)
            """Producer ids per endpoint and open plain flows (``peers.json``,
            ``plain_flows.json``): :class:`~zio_spark.storage.spool_peers.SpoolPeers`."""
        except OSError as e:
            os.close(self._lock_fd)
            raise SpoolPathError(self._root, e) from e
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
            raise StorageInputError(
                "records", f"tuples of unequal length ({e})", "Record tuples of 7 fields"
            ) from e
        if len(cols) != 7:
            raise StorageInputError("records", f"{len(cols)} fields", "Record tuples of 7 fields")
        return self._append(producer, build_wal_batch(cols, n), cols[0])

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
            raise StorageInputError("batch schema", batch.schema, f"WAL_SCHEMA {_WAL_SCHEMA}")
        if batch.num_rows == 0:
            return 0
        seq = batch.column(SEQ_WAL)
        if seq.null_count:
            raise StorageInputError("batch seq", f"{seq.null_count} nulls", "no nulls")
        encode_id(producer)
        return self._append(producer, batch, seq.to_numpy())

    def _append(
        self, producer: str, batch: pa.RecordBatch, seqs: Sequence[int] | np.ndarray
    ) -> int:
        n = batch.num_rows
        with self._lock:
            self._check_open()
            st = self._producer(producer)
            expect = st.next
            duplicates = gaps = 0
            if _runs_from(seqs, expect, n):
                keep = batch
            else:
                listed = seqs.tolist() if isinstance(seqs, np.ndarray) else seqs
                keep, duplicates, gaps = self._select(producer, batch, listed, expect)
            self._counts["duplicates"] += duplicates
            if keep is None:
                return 0
            rows: int = keep.num_rows
            offset = self._wal.written
            self._wal.write(encode_wal_record(st.wal_prefix, expect, keep))
            st.tail.append(WalEntry(self._wal, offset, rows))
            st.tail_rows += rows
            st.next = keep.column(SEQ_WAL)[-1].as_py() + 1
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

    def acknowledge(self, offsets: Mapping[str, int]) -> None:
        """Records below ``offsets[producer]`` may be acknowledged to their producer,
        though not committed (a batch read keeps them for its result): what
        :meth:`ack_end` says, in memory only. Lower offsets than known are no-ops.

        Raises
        ------
        StorageInputError
            A key that is not a string or an offset that is not an int >= 0.
        """
        for producer, offset in offsets.items():
            if not isinstance(producer, str):
                raise StorageInputError("producer", producer, "a string")
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise StorageInputError(f"offset of {producer!r}", offset, "an int >= 0")
        with self._lock:
            for producer, offset in offsets.items():
                if offset > self._acked.get(producer, 0):
                    self._acked[producer] = offset

    def ack_end(self, producer: str) -> int:
        """What ``producer`` may be told is safe: records below this end (committed or
        acknowledged, :meth:`acknowledge`); 1 if none. The receiver acks ``ack_end - 1``."""
        with self._lock:
            return max(1, self._committed.get(producer, 1), self._acked.get(producer, 0))

    def backlog(self) -> dict[str, int]:
        """Records stored above the committed offset (sealed + open tail), per producer.

        Every producer the spool knows is listed. After a commit beyond a producer's
        sealed end, its open-tail records below that commit still count until the next
        seal drops them.
        """
        with self._lock:
            return {p: st.sealed_above + st.tail_rows for p, st in sorted(self._producers.items())}

    def unsealed(self) -> tuple[int, int]:
        """Records and WAL bytes appended since the last :meth:`seal` started (what the
        next seal would write), all producers together."""
        with self._lock:
            rows = sum(st.tail_rows for st in self._producers.values())
            return rows, self._wal.written

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
        check_range(start_seq, end_seq, max_rows_per_batch)
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
        plan = plan_read(producer, segments, start_seq, end_seq)
        return generate_batches(producer, plan, start_seq, end_seq, max_rows_per_batch)

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
                    encode_id(producer)
                    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                        raise StorageInputError(
                            f"commit offset of {producer!r}", offset, "an int >= 0"
                        )
                    if offset > self._committed.get(producer, 1):
                        changed[producer] = offset
                if not changed:
                    return
                committed = {**self._committed, **changed}
                snapshot = {p: list(self._producer(p).segments) for p in changed}
            _write_json(
                self._root / "committed.json",
                {"format": FORMAT_VERSION, "committed": dict(sorted(committed.items()))},
                self._sync,
            )
            # Segments cannot change while we hold the maintenance lock: count outside.
            kept = {p: [s for s in segs if s.last >= changed[p]] for p, segs in snapshot.items()}
            above = {p: rows_at_or_above(segs, changed[p]) for p, segs in kept.items()}
            doomed: list[SealedFile] = []
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
            raise SpoolClosedError("the spool is closed", path=self._root)

    def _producer(self, producer: str) -> _Producer:
        st = self._producers.get(producer)
        if st is None:
            st = _Producer(producer, encode_id(producer))
            floor = self._committed.get(producer, 1)
            st.end = st.next = max(1, floor)
            self._producers[producer] = st
        return st

    def _select(
        self, producer: str, batch: pa.RecordBatch, seqs: Sequence[int], expect: int
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
                batch = read_entry(producer, entry, maps)
                seq = batch.column(SEQ_WAL)
                skip = lower_bound(seq, cursor)
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
            unlink_quiet(wal.path)

    def _write_segment(
        self, st: _Producer, batches: list[pa.RecordBatch], covers_from: int
    ) -> SealedFile:
        folder = self._root / "producers" / st.dirname
        if not folder.is_dir():
            folder.mkdir()
            self._fsync_dir(folder.parent)
        return write_sealed(
            folder, st.id, st.id_scalar, batches, covers_from, self._segment_batch_rows, self._sync
        )

    def _delete_segments(self, doomed: list[SealedFile]) -> None:
        for segment in doomed:
            unlink_quiet(segment.path)
        if doomed:
            with self._lock:
                self._counts["segments_deleted"] += len(doomed)

    def _fsync_dir(self, path: Path) -> None:
        if self._sync:
            fsync_dir(path)

    def _take_folder_lock(self) -> int:
        root = self._root
        return lock_folder(root, lambda: SpoolLockedError(root))

    def _prepare_layout(self) -> None:
        meta = self._root / "spool.json"
        if meta.exists():
            fmt = json.loads(meta.read_text()).get("format")
            if fmt != FORMAT_VERSION:
                raise ConfigError("path", str(self._root), f"a spool of format {FORMAT_VERSION}")
        else:
            _write_json(meta, {"format": FORMAT_VERSION}, self._sync)
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
            st.sealed_above = rows_at_or_above(st.segments, self._committed.get(st.id, 1))
        gens = []
        for entry in os.scandir(self._root / "wal"):
            m = WAL_RE.match(entry.name)
            if m:
                gens.append((int(m[1]), Path(entry.path)))
            elif entry.name.endswith(".tmp"):
                unlink_quiet(Path(entry.path))
        for _, path in sorted(gens):
            self._retired.append(self._scan_wal(path))
        self._next_gen = max((g for g, _ in gens), default=0) + 1

    def _recover_segments(self, folder: Path) -> None:
        segments: list[SealedFile] = []
        owner: str | None = None
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name.endswith(".tmp"):  # a seal cut short; its records are in the WAL
                unlink_quiet(Path(entry.path))
                continue
            m = SEGMENT_RE.match(entry.name)
            if not m:
                continue
            path = Path(entry.path)
            first, last = int(m[1]), int(m[2])
            _, producer, covers_from, rows = open_segment(path, first, last, None)
            if owner is None:
                owner = producer
            if producer != owner or producer_dirname(encode_id(producer)) != folder.name:
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
            segments.append(SealedFile(first, last, covers_from, rows, path, entry.stat().st_size))
        if owner is not None:
            st = self._producer(owner)
            st.segments = segments
            st.end = max(st.end, segments[-1].last + 1)
            st.listed = True

    def _scan_wal(self, path: Path) -> Wal:
        """Index the records of a WAL file left by an earlier run into the tails."""
        size = path.stat().st_size
        wal = Wal(path, -1)
        wal.written = wal.synced = size
        wal.closed = True
        if size == 0:
            return wal
        if self._sync:  # what we index must be on disk before producers are told so
            fsync_file(path)
        scan = WalScan(path, size)
        for offset, producer, covers_from, batch in scan:
            st = self._producer(producer)
            if covers_from > st.next:
                self._counts["wal_records_skipped"] += 1
                continue
            seq = batch.column(SEQ_WAL)
            rows = batch.num_rows - lower_bound(seq, st.next)
            if rows == 0:
                continue
            st.tail.append(WalEntry(wal, offset, rows))
            st.tail_rows += rows
            st.next = seq[-1].as_py() + 1
            self._counts["wal_records_replayed"] += 1
        self._counts["torn_wal_records"] += scan.torn
        return wal

    def _new_wal(self) -> Wal:
        gen = self._next_gen
        self._next_gen += 1
        path = self._root / "wal" / f"{gen:020d}.wal"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._fsync_dir(path.parent)
        return Wal(path, fd)


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
        self.dirname = producer_dirname(encoded)
        self.wal_prefix = (len(encoded), encoded + PAD[: -len(encoded) % 8])
        self.segments: list[SealedFile] = []
        self.end = 1  # exclusive end of sealed data (never below the committed offset)
        self.next = 1  # next expected seq: end, or the open tail's last seq + 1
        self.tail: list[WalEntry] = []  # open-tail records, in the WAL
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


def _runs_from(seqs: Sequence[int] | np.ndarray, expect: int, n: int) -> bool:
    """Are ``seqs`` exactly ``expect, expect + 1, ..., expect + n - 1``?"""
    if seqs[0] != expect or seqs[-1] != expect + n - 1:
        return False
    if isinstance(seqs, np.ndarray):  # the Arrow path: vectorized
        return n < 2 or bool((np.diff(seqs) == 1).all())
    return tuple(seqs) == tuple(range(expect, expect + n))


def _write_json(path: Path, obj: object, sync: bool) -> None:
    atomic_write(path, json.dumps(obj, sort_keys=True).encode(), sync=sync)
