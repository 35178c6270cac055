"""The sink consumer's durable state, no sockets: staged partitions, published batches,
and the committed batch ids with their log.

Layout (the full story, with crash repair, is in :mod:`zio_spark.sink.consumer`)::

    <path>/LOCK                                   flock: one process per folder
    <path>/staging/<stream>/<batch>/<p>-<a>.part  being written (a :class:`Stage`)
    <path>/staging/<stream>/<batch>/<p>-<a>.arrow complete-staged partition
    <path>/published/<stream>/<seq>-<batch>/      a committed batch: part-<p>.arrow, _MANIFEST.json
    <path>/committed.log, committed.json          committed ids: log records, snapshot
    <path>/trash/                                 acked batches being deleted

:class:`SinkFolder` owns all of it; the consumer's flow handlers write :class:`Stage`
files, its command handler calls :meth:`SinkFolder.commit` and :meth:`SinkFolder.abort`,
the application the read/ack methods. Files are Arrow IPC files of
:data:`~zio_spark.codec.schema.SINK_SCHEMA`.

Commands return typed outcomes (:class:`Committed`, :class:`AlreadyCommitted`,
:class:`Aborted`) or raise :class:`CommitRefused`; the consumer
(:mod:`zio_spark.sink.consumer`) turns them into its wire replies.

``committed.log`` (:class:`CommittedLog`) starts with :data:`LOG_MAGIC`, then one
CRC-framed record per commit (:func:`~zio_spark.storage.files.frame`): a type byte
(:data:`_T_ENTRY`) and the entry as JSON (``seq``, ``stream``, ``batch``, ``rows``,
``query``). A log of an earlier version (JSON lines, no magic) is read and rewritten in
this format when the folder is opened.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import pyarrow as pa

from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.errors import LocalProtocolError, StorageError, ZioSparkError
from zio_spark.protocol.sink import BatchId
from zio_spark.storage.files import (
    atomic_write,
    frame,
    fsync_dir,
    fsync_file,
    is_torn_tail,
    lock_folder,
    read_record,
    write_all,
)

__all__ = [
    "COMPACT_EVERY",
    "LOG_MAGIC",
    "STRING_IDS_KEPT",
    "Aborted",
    "AlreadyCommitted",
    "CommitOutcome",
    "CommitRefused",
    "Committed",
    "CommittedIds",
    "CommittedLog",
    "ConsumerRecord",
    "ConsumerStateError",
    "Published",
    "SinkFolder",
    "Stage",
]

log = logging.getLogger("zio_spark.consumer")

COMPACT_EVERY = 10_000
STRING_IDS_KEPT = 10_000

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_RECORD_FLUSH_ROWS = 4096
_RECORD_FLUSH_BYTES = 4 << 20
_MANIFEST = "_MANIFEST.json"


LOG_MAGIC: Final = b"ZIOSINK\x01"
"""The first bytes of a ``committed.log`` in the framed format (version 1)."""
_T_ENTRY: Final = b"J"  # a framed record's type byte: the entry as JSON follows


class ConsumerStateError(StorageError):
    """The consumer's folder is inconsistent in a way that cannot be repaired safely."""


class CommitRefused(ZioSparkError):
    """A commit that cannot be done: a partition is not staged as the commit says, or
    the batch id was committed by another query. Nothing changed on disk.

    ``reason`` is the whole message (the consumer sends it as its error reply).
    """

    def __init__(self, stream: str, batch: BatchId, reason: str) -> None:
        self.stream = stream
        self.batch = batch
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class Committed:
    """A commit that recorded its batch id now. ``seq`` is the published folder's commit
    number, None when the batch had no rows (the id is recorded, nothing published)."""

    stream: str
    batch: BatchId
    rows: int
    seq: int | None

    @property
    def published(self) -> bool:
        return self.seq is not None


@dataclass(frozen=True, slots=True)
class AlreadyCommitted:
    """A commit of a batch id that was committed before: nothing published again."""

    stream: str
    batch: BatchId


CommitOutcome = Committed | AlreadyCommitted
"""What :meth:`SinkFolder.commit` returns."""


@dataclass(frozen=True, slots=True)
class Aborted:
    """An abort: ``discarded`` False when the batch was already committed (nothing to
    discard), True when its staging (if any) was deleted."""

    stream: str
    batch: BatchId
    discarded: bool


class ConsumerRecord(NamedTuple):
    value: bytes | None
    key: bytes | None
    headers: dict[str, str] | None


# ------------------------------------------------------------------------------ names


def _stream_dir(stream: str) -> str:
    """A file name for a stream name, reversible (see :func:`_stream_from_dir`)."""
    if _SAFE_NAME.fullmatch(stream):
        return stream
    return "~" + stream.encode("utf-8").hex()


def _stream_from_dir(name: str) -> str:
    if name.startswith("~"):
        return bytes.fromhex(name[1:]).decode("utf-8")
    return name


def _batch_key(batch: BatchId) -> str:
    return f"{batch:020d}" if isinstance(batch, int) else f"s-{batch}"


def _batch_from_key(key: str) -> BatchId:
    return key[2:] if key.startswith("s-") else int(key)


# ------------------------------------------------------------------------------ disk


def _count_rows(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


class Stage:
    """One staging file being written: an Arrow IPC file of :data:`SINK_SCHEMA`."""

    def __init__(self, part: Path, final: Path, sync: bool) -> None:
        self.part = part
        self.final = final
        self.sync = sync
        self.rows = 0
        self.started = time.monotonic()
        part.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            final.unlink()
        self._file: pa.NativeFile | None = pa.OSFile(str(part), "wb")
        self._writer: pa.ipc.RecordBatchFileWriter | None = pa.ipc.new_file(self._file, SINK_SCHEMA)
        self._values: list[bytes] = []
        self._keys: list[bytes | None] = []
        self._headers: list[list[tuple[str, str]] | None] = []
        self._buffered_bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        assert self._writer is not None
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def add_record(
        self, value: bytes, key: bytes | None, headers: Mapping[str, str] | None
    ) -> None:
        self._values.append(value)
        self._keys.append(key)
        self._headers.append(None if headers is None else list(headers.items()))
        self._buffered_bytes += len(value)
        if len(self._values) >= _RECORD_FLUSH_ROWS or self._buffered_bytes >= _RECORD_FLUSH_BYTES:
            self._flush_records()

    def _flush_records(self) -> None:
        if not self._values:
            return
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(self._values, pa.binary()),
                pa.array(self._keys, pa.binary()),
                pa.array(self._headers, SINK_SCHEMA.field("headers").type),
            ],
            schema=SINK_SCHEMA,
        )
        self._values, self._keys, self._headers = [], [], []
        self._buffered_bytes = 0
        self.write(batch)

    @property
    def pending(self) -> int:
        return self.rows + len(self._values)

    def finish(self) -> int:
        """Close, fsync, rename to the final name; returns the row count.

        Raises
        ------
        FileNotFoundError
            If the staging folder was deleted meanwhile (the batch was aborted).
        """
        self._flush_records()
        assert self._writer is not None and self._file is not None
        self._writer.close()
        self._file.close()
        self._writer = self._file = None
        if self.sync:
            fsync_file(self.part)
        os.rename(self.part, self.final)
        if self.sync:
            fsync_dir(self.final.parent)
        return self.rows

    def discard(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
        self._writer = self._file = None
        with contextlib.suppress(FileNotFoundError):
            self.part.unlink()


# ---------------------------------------------------------------------- committed ids


class CommittedIds:
    """The committed batch ids of one stream (see the module docstring, retention)."""

    def __init__(self) -> None:
        self.los: list[int] = []
        self.his: list[int] = []
        self.strings: dict[str, None] = {}
        self.query: str | None = None

    def __contains__(self, batch: BatchId) -> bool:
        if isinstance(batch, str):
            return batch in self.strings
        i = bisect.bisect_right(self.los, batch) - 1
        return i >= 0 and batch <= self.his[i]

    def add(self, batch: BatchId) -> None:
        if isinstance(batch, str):
            self.strings[batch] = None
            while len(self.strings) > STRING_IDS_KEPT:
                del self.strings[next(iter(self.strings))]
            return
        if batch in self:
            return
        i = bisect.bisect_right(self.los, batch)  # ranges [0, i) start at or below batch
        joins_left = i > 0 and self.his[i - 1] == batch - 1
        joins_right = i < len(self.los) and self.los[i] == batch + 1
        if joins_left and joins_right:
            self.his[i - 1] = self.his[i]
            del self.los[i], self.his[i]
        elif joins_left:
            self.his[i - 1] = batch
        elif joins_right:
            self.los[i] = batch
        else:
            self.los.insert(i, batch)
            self.his.insert(i, batch)

    def snapshot(self) -> dict[str, Any]:
        return {
            "ranges": [[lo, hi] for lo, hi in zip(self.los, self.his, strict=True)],
            "strings": list(self.strings),
            "query": self.query,
        }

    @classmethod
    def restore(cls, obj: Mapping[str, Any]) -> CommittedIds:
        c = cls()
        for lo, hi in obj.get("ranges", []):
            c.los.append(int(lo))
            c.his.append(int(hi))
        for s in obj.get("strings", []):
            c.strings[str(s)] = None
        c.query = obj.get("query")
        return c


@dataclass(frozen=True, slots=True)
class Published:
    stream: str
    batch: BatchId
    seq: int
    rows: int
    path: Path


# ------------------------------------------------------------------------ committed log


def _entry(obj: object) -> dict[str, Any] | str:
    """A committed-log entry checked (``stream`` str, ``batch`` an id, ``seq`` int or
    None), or what is wrong with it."""
    if not isinstance(obj, dict):
        return f"an entry is a JSON object, got {obj!r}"
    stream, batch, seq = obj.get("stream"), obj.get("batch"), obj.get("seq")
    if not isinstance(stream, str):
        return f"stream must be a string, got {stream!r}"
    if isinstance(batch, bool) or not isinstance(batch, int | str):
        return f"batch must be an int or a string, got {batch!r}"
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int)):
        return f"seq must be an int or null, got {seq!r}"
    return obj


def _decode(text: bytes) -> dict[str, Any] | str:
    try:
        obj = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"not JSON ({e})"
    return _entry(obj)


def _record(entry: Mapping[str, Any]) -> bytes:
    payload = _T_ENTRY + json.dumps(dict(entry)).encode("utf-8")
    return frame(payload) + payload


class CommittedLog:
    """``committed.log``: one record per commit, appended and (with ``fsync``) synced
    before the commit is answered. See the module docstring for the format.

    Open it with :meth:`open`, which replays it. The tail rule: the last append, torn by
    a crash (never synced, so never acknowledged), is cut off; corruption anywhere else
    raises :class:`ConsumerStateError`, since forgetting committed ids would publish
    duplicates. A log in the earlier JSON-lines format is read by the same rule (a torn
    last line) and rewritten framed.
    """

    def __init__(self, path: Path, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync
        self.count = 0
        """Records in the file (compaction resets it)."""
        self._fd = -1

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, fsync: bool
    ) -> tuple[CommittedLog, list[dict[str, Any]]]:
        """The log at ``path`` (created if missing) and its entries, in order.

        Raises
        ------
        ConsumerStateError
            If a record other than the last append is corrupt.
        """
        log_ = cls(Path(path), fsync)
        entries = log_._replay()
        log_._fd = os.open(log_.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return log_, entries

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The entries of the log at ``path``, either format, changing nothing (a torn
        last append is left out).

        Raises
        ------
        ConsumerStateError
            If a record other than the last append is corrupt.
        """
        log_ = cls(Path(path), False)
        data = log_.path.read_bytes()
        if LOG_MAGIC.startswith(data):
            return []
        if data.startswith(LOG_MAGIC):
            return log_._read_framed(data)[0]
        return log_._read_lines(data)

    def _replay(self) -> list[dict[str, Any]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        if LOG_MAGIC.startswith(data):  # new, or its creation never finished
            atomic_write(self.path, LOG_MAGIC, sync=self.fsync)
            return []
        if data.startswith(LOG_MAGIC):
            entries, good = self._read_framed(data)
            if good != len(data):
                log.warning("consumer: cutting a torn last record off %s", self.path)
                with open(self.path, "r+b") as f:
                    f.truncate(good)
                    if self.fsync:
                        os.fsync(f.fileno())
            self.count = len(entries)
            return entries
        entries = self._read_lines(data)
        log.info("consumer: %s is JSON lines (an earlier version); rewriting it framed", self.path)
        self.rewrite(entries)
        return entries

    def _read_framed(self, data: bytes) -> tuple[list[dict[str, Any]], int]:
        entries: list[dict[str, Any]] = []
        pos, size = len(LOG_MAGIC), len(data)
        while pos < size:
            got = read_record(data, pos, size)
            if isinstance(got, str):
                if self._torn(data, pos):
                    break
                raise ConsumerStateError(
                    f"{self.path} record {len(entries) + 1} at byte {pos} is corrupt: {got}"
                )
            payload, end = got
            entry = _decode(payload[1:]) if payload[:1] == _T_ENTRY else "unknown record type"
            if isinstance(entry, str):
                raise ConsumerStateError(
                    f"{self.path} record {len(entries) + 1} at byte {pos} is corrupt: {entry}"
                )
            entries.append(entry)
            pos = end
        return entries, pos

    @staticmethod
    def _torn(data: bytes, pos: int) -> bool:
        """Whether the bad record at ``pos`` is a torn last append
        (:func:`~zio_spark.storage.files.is_torn_tail`)."""
        return is_torn_tail(data, pos)

    def _read_lines(self, data: bytes) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if last and not line:
                break
            final = last or (i == len(lines) - 2 and not lines[-1])
            entry = "no newline" if last else _decode(line)  # no newline: a torn append
            if isinstance(entry, str):
                if final:  # the last append, never acknowledged: cut it off
                    log.warning("consumer: cutting a torn last line off %s (%s)", self.path, entry)
                    break
                raise ConsumerStateError(f"{self.path} line {i + 1} is corrupt: {entry}")
            entries.append(entry)
        return entries

    def append(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Append ``entries`` in one write, synced (with ``fsync``)."""
        write_all(self._fd, b"".join(_record(e) for e in entries))
        if self.fsync:
            os.fsync(self._fd)
        self.count += len(entries)

    def rewrite(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Replace the log by one holding ``entries`` (``[]``: after a compaction)."""
        atomic_write(self.path, LOG_MAGIC + b"".join(_record(e) for e in entries), sync=self.fsync)
        self.count = len(entries)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


# ---------------------------------------------------------------------------- folder


class SinkFolder:
    """The consumer's folder (see the module docstring): takes its lock, repairs it
    (:meth:`_recover`), and keeps the committed ids and published batches in memory.

    ``fault_hook`` is the consumer's test hook (see :meth:`commit`).

    Raises
    ------
    ConsumerStateError
        If the committed log is corrupt, or another process holds the folder.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool,
        fault_hook: Callable[[str, str, BatchId], None] | None = None,
    ) -> None:
        self.root = Path(path)
        self.fsync = fsync
        self.fault_hook = fault_hook
        self._lock = threading.RLock()
        self._ids: dict[str, CommittedIds] = {}
        self._published: dict[tuple[str, BatchId], Published] = {}
        self._next_seq = 1
        self._log: CommittedLog | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._recover()
        except BaseException:
            if self._log is not None:
                self._log.close()
            os.close(self._lock_fd)
            raise

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def new_stage(self, stream: str, batch: BatchId, partition: int, attempt: int) -> Stage:
        """A fresh staging file for one partition attempt (truncating an earlier one)."""
        folder = self.staging_dir(stream, batch)
        name = f"{partition}-{attempt}"
        return Stage(folder / f"{name}.part", folder / f"{name}.arrow", self.fsync)

    # -- application API -------------------------------------------------------------

    def published(self, stream: str | None = None) -> list[tuple[str, BatchId]]:
        """Published, not yet acked batches as ``(stream, batch)``, in commit order."""
        with self._lock:
            pubs = sorted(self._published.values(), key=lambda p: p.seq)
        return [(p.stream, p.batch) for p in pubs if stream is None or p.stream == stream]

    def is_committed(self, stream: str, batch: BatchId) -> bool:
        """True if ``batch`` of ``stream`` was committed (published, acked or empty)."""
        with self._lock:
            ids = self._ids.get(stream)
            return ids is not None and batch in ids

    def rows(self, stream: str, batch: BatchId) -> int:
        """Number of rows of a published batch.

        Raises
        ------
        LocalProtocolError
            If the batch is not published (never committed, or acked).
        """
        return self._lookup(stream, batch).rows

    def read(self, stream: str, batch: BatchId) -> Iterator[pa.RecordBatch]:
        """The published batch's records as Arrow batches of :data:`SINK_SCHEMA`,
        partition by partition.

        Raises
        ------
        LocalProtocolError
            If the batch is not published (never committed, or acked).
        """
        pub = self._lookup(stream, batch)
        files = sorted(pub.path.glob("part-*.arrow"))
        return self._read_files(files)

    @staticmethod
    def _read_files(files: list[Path]) -> Iterator[pa.RecordBatch]:
        for f in files:
            with pa.memory_map(str(f)) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)

    def records(self, stream: str, batch: BatchId) -> Iterator[ConsumerRecord]:
        """The published batch's records one by one (value, key, headers).

        Raises
        ------
        LocalProtocolError
            If the batch is not published.
        """
        for b in self.read(stream, batch):
            cols = [b.column(i).to_pylist() for i in range(3)]
            for v, k, h in zip(*cols, strict=True):
                yield ConsumerRecord(v, k, None if h is None else dict(h))

    def ack(self, stream: str, batch: BatchId) -> None:
        """Delete a published batch's data; its id stays committed. Idempotent.

        Raises
        ------
        LocalProtocolError
            If the batch was never committed.
        """
        with self._lock:
            pub = self._published.pop((stream, batch), None)
            if pub is None:
                if stream in self._ids and batch in self._ids[stream]:
                    return
                raise LocalProtocolError(
                    f"batch {batch!r} of stream {stream!r} was never committed", field="batch"
                )
            trash = self.root / "trash" / uuid.uuid4().hex
            os.rename(pub.path, trash)
            if self.fsync:
                fsync_dir(pub.path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def _lookup(self, stream: str, batch: BatchId) -> Published:
        with self._lock:
            pub = self._published.get((stream, batch))
        if pub is None:
            raise LocalProtocolError(
                f"batch {batch!r} of stream {stream!r} is not published (never committed, "
                "or acked)",
                field="batch",
            )
        return pub

    # -- commands (server thread) ----------------------------------------------------

    def commit(
        self,
        stream: str,
        batch: BatchId,
        parts: Sequence[tuple[int, int, int]],
        query: str | None,
    ) -> CommitOutcome:
        """Publish the staged ``(partition, attempt, rows)`` of a batch once and record
        its id (see :mod:`zio_spark.sink.consumer`, "Commands").

        The fault hook is called at ``"before_publish"`` (nothing changed yet; the
        consumer calls it at ``"after_publish"``); its exceptions propagate, as does
        disk trouble (``OSError``).

        Raises
        ------
        CommitRefused
            A listed partition with rows is not complete-staged, or has another row
            count; or the batch id was committed by another query.
        """
        with self._lock:
            ids = self._ids.setdefault(stream, CommittedIds())
            staging = self.staging_dir(stream, batch)
            if batch in ids:
                if (
                    isinstance(batch, int)
                    and query is not None
                    and ids.query is not None
                    and query != ids.query
                ):
                    raise CommitRefused(
                        stream,
                        batch,
                        f"batch {batch} of stream {stream!r} was already committed "
                        f"by another query ({ids.query}; this is {query}): a new checkpoint "
                        "must write to a new stream name, or its batches would be dropped "
                        "as duplicates",
                    )
                self._drop_staging(staging)
                return AlreadyCommitted(stream, batch)
            files: list[tuple[int, Path]] = []
            total = 0
            for p, a, rows in parts:
                if rows == 0:
                    continue
                f = staging / f"{p}-{a}.arrow"
                if not f.exists():
                    raise CommitRefused(
                        stream,
                        batch,
                        f"partition {p} attempt {a} of batch {batch!r} (stream "
                        f"{stream!r}) is not staged: no complete staging file",
                    )
                n = _count_rows(f)
                if n != rows:
                    raise CommitRefused(
                        stream,
                        batch,
                        f"partition {p} attempt {a} of batch {batch!r} has {n} "
                        f"staged rows, the commit says {rows}",
                    )
                files.append((p, f))
                total += rows
            self.fault("before_publish", stream, batch)
            seq: int | None = None
            if files:
                seq = self._next_seq
                self._publish(stream, batch, seq, files, total, query)
                self._next_seq += 1
            assert self._log is not None
            self._log.append(
                [{"seq": seq, "stream": stream, "batch": batch, "rows": total, "query": query}]
            )
            ids.add(batch)
            if query is not None and isinstance(batch, int):
                ids.query = query
            if seq is not None:
                path = self.published_dir(stream) / f"{seq:020d}-{_batch_key(batch)}"
                self._published[stream, batch] = Published(stream, batch, seq, total, path)
            self._drop_staging(staging)
            if isinstance(batch, int):
                self._drop_older_staging(stream, batch)
            if self._log.count >= COMPACT_EVERY:
                self._compact()
        return Committed(stream, batch, total, seq)

    def _publish(
        self,
        stream: str,
        batch: BatchId,
        seq: int,
        files: list[tuple[int, Path]],
        rows: int,
        query: str | None,
    ) -> None:
        parent = self.published_dir(stream)
        parent.mkdir(parents=True, exist_ok=True)
        name = f"{seq:020d}-{_batch_key(batch)}"
        tmp = parent / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for p, f in files:
            target = tmp / f"part-{p:05d}.arrow"
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
                if self.fsync:
                    fsync_file(target)
        manifest = {
            "stream": stream,
            "batch": batch,
            "seq": seq,
            "rows": rows,
            "partitions": [p for p, _ in files],
            "query": query,
        }
        mpath = tmp / _MANIFEST
        mpath.write_text(json.dumps(manifest))
        if self.fsync:
            fsync_file(mpath)
            fsync_dir(tmp)
        os.rename(tmp, parent / name)  # the commit point
        if self.fsync:
            fsync_dir(parent)

    def abort(self, stream: str, batch: BatchId) -> Aborted:
        """Discard a batch's staging (nothing once it is committed). Idempotent."""
        with self._lock:
            ids = self._ids.get(stream)
            if ids is not None and batch in ids:
                return Aborted(stream, batch, discarded=False)
            self._drop_staging(self.staging_dir(stream, batch))
        return Aborted(stream, batch, discarded=True)

    def fault(self, point: str, stream: str, batch: BatchId) -> None:
        """Call the fault hook (a test hook) at ``point``, if there is one."""
        if self.fault_hook is not None:
            self.fault_hook(point, stream, batch)

    def staging_dir(self, stream: str, batch: BatchId) -> Path:
        return self.root / "staging" / _stream_dir(stream) / _batch_key(batch)

    def published_dir(self, stream: str) -> Path:
        return self.root / "published" / _stream_dir(stream)

    def _drop_staging(self, folder: Path) -> None:
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)

    def _drop_older_staging(self, stream: str, batch: int) -> None:
        parent = self.root / "staging" / _stream_dir(stream)
        if not parent.is_dir():
            return
        for entry in parent.iterdir():
            if not entry.name.startswith("s-"):
                with contextlib.suppress(ValueError):
                    if int(entry.name) < batch:
                        shutil.rmtree(entry, ignore_errors=True)

    def _take_lock(self) -> int:
        return lock_folder(
            self.root,
            lambda: ConsumerStateError(
                f"consumer folder {self.root} is in use by another process (its LOCK is held)"
            ),
        )

    # -- committed log ---------------------------------------------------------------

    def _apply(self, entry: Mapping[str, Any]) -> None:
        stream = entry["stream"]
        batch = entry["batch"]
        ids = self._ids.setdefault(stream, CommittedIds())
        ids.add(batch)
        if entry.get("query") is not None and isinstance(batch, int):
            ids.query = entry["query"]
        if entry.get("seq") is not None:
            self._next_seq = max(self._next_seq, int(entry["seq"]) + 1)

    def _compact(self) -> None:
        snap = {
            "version": 1,
            "next_seq": self._next_seq,
            "streams": {s: ids.snapshot() for s, ids in self._ids.items()},
        }
        atomic_write(
            self.root / "committed.json",
            json.dumps(snap).encode("utf-8"),
            sync=self.fsync,
            tmp=self.root / "committed.json.tmp",
        )
        assert self._log is not None
        self._log.rewrite([])

    # -- recovery --------------------------------------------------------------------

    def _recover(self) -> None:
        root = self.root
        for sub in ("staging", "published", "trash"):
            (root / sub).mkdir(exist_ok=True)
        for entry in (root / "trash").iterdir():
            shutil.rmtree(entry, ignore_errors=True)
        snap_path = root / "committed.json"
        if snap_path.exists():
            try:
                snap = json.loads(snap_path.read_text())
                self._next_seq = int(snap.get("next_seq", 1))
                for s, obj in snap.get("streams", {}).items():
                    self._ids[s] = CommittedIds.restore(obj)
            except (ValueError, TypeError, AttributeError) as e:
                raise ConsumerStateError(f"{snap_path} is corrupt: {e}") from e
        self._log, entries = CommittedLog.open(root / "committed.log", fsync=self.fsync)
        for item in entries:
            self._apply(item)
        roll_forward: list[dict[str, Any]] = []
        for sdir in sorted((root / "published").iterdir()):
            stream = _stream_from_dir(sdir.name)
            for entry in sorted(sdir.iterdir()):
                if entry.name.endswith(".tmp"):
                    log.info("consumer: removing unfinished publish %s", entry)
                    shutil.rmtree(entry, ignore_errors=True)
                    continue
                seq_text, _, key = entry.name.partition("-")
                try:
                    seq = int(seq_text)
                    batch = _batch_from_key(key)
                    manifest = json.loads((entry / _MANIFEST).read_text())
                    rows = manifest["rows"]
                    query = manifest.get("query")
                except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
                    raise ConsumerStateError(
                        f"published folder {entry} is not a consumer batch: {e!r}"
                    ) from e
                if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
                    raise ConsumerStateError(
                        f"published folder {entry} is not a consumer batch: its "
                        f"{_MANIFEST} has rows {rows!r}, expected an int >= 0"
                    )
                self._next_seq = max(self._next_seq, seq + 1)
                ids = self._ids.get(stream)
                if (stream, batch) in self._published:
                    log.warning("consumer: %s duplicates a published batch; removed", entry)
                    shutil.rmtree(entry, ignore_errors=True)
                    continue
                if ids is None or batch not in ids:
                    roll_forward.append(
                        {
                            "seq": seq,
                            "stream": stream,
                            "batch": batch,
                            "rows": rows,
                            "query": query,
                        }
                    )
                self._published[stream, batch] = Published(stream, batch, seq, rows, entry)
        if roll_forward:
            roll_forward.sort(key=lambda x: int(x["seq"]))
            for line in roll_forward:
                log.warning(
                    "consumer: batch %r of stream %r was published but not logged; rolled forward",
                    line["batch"],
                    line["stream"],
                )
                self._apply(line)
            self._log.append(roll_forward)
        for sdir in sorted((root / "staging").iterdir()):
            stream = _stream_from_dir(sdir.name)
            ids = self._ids.get(stream)
            for bdir in sdir.iterdir():
                try:
                    batch = _batch_from_key(bdir.name)
                except ValueError:
                    shutil.rmtree(bdir, ignore_errors=True)
                    continue
                if ids is not None and batch in ids:
                    shutil.rmtree(bdir, ignore_errors=True)
                    continue
                for part in bdir.glob("*.part"):
                    part.unlink()
