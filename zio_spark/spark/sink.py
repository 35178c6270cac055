"""``df.writeStream.format("zio")`` and ``df.write.format("zio")``: the sink's writers.

Protocol (the consumer's side, with the on-disk layout and crash repair, is in
:mod:`zio_spark.queue.consumer`):

1. **Task** (executor, :meth:`write`): one ZIO flow per task, the task being the
   *client giver*: ``BOT{direction:"extract", credit, stream, batch, partition,
   attempt, format}``, then DATs within credit, then EOT. The consumer echoes the EOT
   only once the partition is durably staged (fsync'd), with ``{"rows": n}``; the task
   checks ``n`` and returns a :class:`ZioCommitMessage`. A task whose input fails
   midway sends ``EOT{error}`` (the consumer discards the partial file) and re-raises.
   An empty partition opens no flow (its message says 0 rows). No credit or no answer
   within ``connectTimeout`` fails the task with a
   :class:`~zio_spark.errors.TransportError` naming the endpoint.
2. **Driver** (:meth:`commit`/:meth:`abort`): one control flow per consumer, its BOT
   carrying ``command``, ``partitions: [[partition, attempt, rows], ...]`` and the
   query id; the consumer replies with an EOT (a rejection, used as the reply) carrying
   ``result``. ``commit`` raises on ``error`` or no reply, so Spark fails the query
   before it records the batch as done; on restart it re-runs the batch and the
   consumer, which remembers committed ids, answers ``ok`` without publishing twice.
   ``abort`` is best effort (logged, never raised): it may overlap running tasks and
   its messages may be None, so it always goes to the configured endpoint.

Batch ids: a streaming write uses Spark's micro-batch id, read on executors from the
local property ``streaming.sql.batchId`` (``write()`` is not given it). A batch write
(``df.write``) has none: the writer object made on the driver by ``writer()`` draws
``write-<uuid4 hex>`` once; Spark pickles that object to the tasks and hands it back
for ``commit``, so all of them agree. The Spark query id (local property
``sql.streaming.queryId``, stable across restarts from one checkpoint) rides along so
the consumer can refuse a *new* query reusing a stream whose batch ids are taken.

Message shapes (option ``format``):

- ``arrow`` (default): each DAT payload is one Arrow IPC stream holding one record
  batch (at most :data:`MAX_ROWS_PER_DAT` rows, about :data:`MAX_BYTES_PER_DAT` bytes)
  with columns ``value`` binary, ``key`` binary, ``headers`` map<string,string>.
- ``record``: one record per DAT, payload = the value bytes, flow-object attributes
  ``key`` (base64 text) and ``headers`` (an object) when present, so a plain ZIO taker
  can read it. A taker whose EOT echo has no ``rows`` is taken for a plain ZIO peer:
  nothing is staged there, and commit/abort skip it (at-least-once).

Input columns are normalised: ``value`` (required) binary or string (UTF-8), ``key``
binary or string, ``headers`` map<string,string>; anything else is a
:class:`~zio_spark.errors.ConfigError` raised on the driver when the writer is created,
naming the column, its type and what is accepted.

A new writer object is created for every micro-batch and another runs commit/abort
(FACTS.md): the writers hold only the parsed options and column layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from zio_spark.errors import ConfigError, ZioSparkError
from zio_spark.options import SinkOptions, parse_sink_options
from zio_spark.queue.consumer import (
    CONSUMER_SCHEMA,
    BatchId,
    StagingWriter,
    encode_payload,
    send_command,
)

__all__ = [
    "MAX_BYTES_PER_DAT",
    "MAX_ROWS_PER_DAT",
    "SinkColumns",
    "ZioBatchWriter",
    "ZioCommitMessage",
    "ZioStreamWriter",
    "sink_columns",
    "sink_options",
]

log = logging.getLogger("zio_spark.sink")

MAX_ROWS_PER_DAT = 10_000
MAX_BYTES_PER_DAT = 8 << 20
_ACCEPTED = (
    "value (binary or string, required), key (binary or string, optional), "
    "headers (map<string,string>, optional)"
)
_HEADERS_TYPE = CONSUMER_SCHEMA.field("headers").type


@dataclass(frozen=True)
class SinkColumns:
    """Which input columns feed ``value``, ``key`` and ``headers`` (by name)."""

    value: str
    key: str | None = None
    headers: str | None = None


def sink_columns(schema: StructType) -> SinkColumns:
    """Check the input schema of the sink and map its columns.

    Raises
    ------
    ConfigError
        ``option="schema"``: a column other than value/key/headers, a column of a
        wrong type, a column given twice, or no ``value`` column.
    """
    found: dict[str, str] = {}
    for f in schema.fields:
        name = f.name.lower()
        got = f.dataType.simpleString()
        if name in ("value", "key"):
            ok = got in ("binary", "string")
            want = "binary or string"
        elif name == "headers":
            ok = got == "map<string,string>"
            want = "map<string,string>"
        else:
            raise ConfigError(
                "schema",
                f"{f.name} {got}",
                f"only the columns {_ACCEPTED}; drop or rename column {f.name!r}",
            )
        if not ok:
            raise ConfigError(
                "schema",
                f"{f.name} {got}",
                f"column {f.name!r} of type {want} (accepted columns: {_ACCEPTED})",
            )
        if name in found:
            raise ConfigError("schema", f.name, "each of value, key, headers at most once")
        found[name] = f.name
    if "value" not in found:
        raise ConfigError(
            "schema", schema.simpleString(), f"a 'value' column (accepted columns: {_ACCEPTED})"
        )
    return SinkColumns(found["value"], found.get("key"), found.get("headers"))


# Options Spark itself puts into a writer's options (``.option("checkpointLocation")``,
# ``.start(path)``, ``.queryName``): not ours to validate.
_SPARK_OWNED = frozenset({"checkpointlocation", "path", "queryname"})


def sink_options(raw: Mapping[str, str]) -> SinkOptions:
    """Parse the sink's options, leaving out the ones Spark owns.

    Raises
    ------
    ConfigError
        As :func:`~zio_spark.options.parse_sink_options`, and for a ZRE ``group``
        (not supported by the sink yet).
    """
    opts = parse_sink_options({k: v for k, v in raw.items() if k.lower() not in _SPARK_OWNED})
    _check_target(opts)
    return opts


def _check_target(opts: SinkOptions) -> str:
    if opts.zre is not None or opts.endpoint is None:
        raise ConfigError(
            "group",
            opts.zre.group if opts.zre else None,
            "an explicit 'endpoint': group targets are not supported yet",
        )
    return opts.endpoint


def _curve(opts: SinkOptions) -> tuple[bytes, bytes, bytes] | None:
    c = opts.curve
    return None if c is None else (c.server_key, c.public_key, c.secret_key)


def _mode(opts: SinkOptions) -> str | None:
    return None if opts.socket == "auto" else opts.socket


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class ZioCommitMessage(WriterCommitMessage):  # type: ignore[misc]
    """What one task reports: where its partition is staged and how many rows.

    ``plain`` is true when the endpoint turned out to be a plain ZIO taker (its EOT
    echo had no ``rows``): there is nothing staged to commit there.
    """

    endpoint: str
    stream: str
    batch: BatchId
    partition: int
    attempt: int
    rows: int
    plain: bool = False
    query: str | None = None


# ------------------------------------------------------------------------- task side


def _as_binary(col: pa.Array | pa.ChunkedArray, name: str) -> pa.Array:
    t = col.type
    if t == pa.binary():
        return col
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pc.cast(col, pa.string()).view(pa.binary())
    try:
        return pc.cast(col, pa.binary())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:  # pragma: no cover
        raise ConfigError("schema", f"{name} {t}", "binary or string") from e


def _normalise(batch: pa.RecordBatch, cols: SinkColumns) -> pa.RecordBatch:
    """Spark's Arrow batch -> a batch of :data:`CONSUMER_SCHEMA`."""
    n = batch.num_rows
    value = _as_binary(batch.column(cols.value), cols.value)
    key = (
        pa.nulls(n, pa.binary())
        if cols.key is None
        else _as_binary(batch.column(cols.key), cols.key)
    )
    if cols.headers is None:
        headers = pa.nulls(n, _HEADERS_TYPE)
    else:
        headers = batch.column(cols.headers)
        if headers.type != _HEADERS_TYPE:
            headers = pc.cast(headers, _HEADERS_TYPE)
    return pa.RecordBatch.from_arrays([value, key, headers], schema=CONSUMER_SCHEMA)


def _chunks(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    n = batch.num_rows
    if n == 0:
        return
    per = MAX_ROWS_PER_DAT
    size = batch.nbytes
    if size > MAX_BYTES_PER_DAT:
        per = max(1, min(per, n * MAX_BYTES_PER_DAT // size))
    if n <= per:
        yield batch
        return
    for start in range(0, n, per):
        yield batch.slice(start, per)


def _task_ids() -> tuple[int, int, str | None, str | None]:
    """(partition, attempt, streaming batch id or None, query id or None) of this task."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:  # pragma: no cover - write() always runs in a task
        raise ZioSparkError("the zio sink's write() must run in a Spark task")
    return (
        tc.partitionId(),
        tc.attemptNumber(),
        tc.getLocalProperty("streaming.sql.batchId"),
        tc.getLocalProperty("sql.streaming.queryId"),
    )


def write_partition(
    opts: SinkOptions,
    cols: SinkColumns,
    batch: BatchId,
    partition: int,
    attempt: int,
    query: str | None,
    batches: Iterator[pa.RecordBatch],
) -> ZioCommitMessage:
    """Stream one partition to the consumer; returns its commit message.

    Raises
    ------
    TransportError
        The consumer is unreachable, gives no credit or does not confirm staging within
        ``connectTimeout``, or confirms a different row count.
    """
    endpoint = _check_target(opts)
    it = iter(batches)
    first: pa.RecordBatch | None = None
    for b in it:  # an empty partition opens no flow
        if b.num_rows:
            first = b
            break
    if first is None:
        return ZioCommitMessage(endpoint, opts.stream, batch, partition, attempt, 0, query=query)
    extra = {"query": query} if query is not None else None
    w = StagingWriter(
        endpoint,
        opts.stream,
        batch,
        partition,
        attempt,
        format=opts.format,
        credit=opts.credit,
        timeout=opts.connect_timeout,
        mode=_mode(opts),
        curve=_curve(opts),
        extra=extra,
    )
    try:
        current: pa.RecordBatch | None = first
        while current is not None:
            if current.num_rows:
                norm = _normalise(current, cols)
                if opts.format == "arrow":
                    for chunk in _chunks(norm):
                        w.write_payload(encode_payload(chunk), chunk.num_rows)
                else:
                    _send_records(w, norm)
            current = next(it, None)
    except BaseException as e:
        w.fail(f"task failed: {type(e).__name__}: {e}")
        raise
    rows = w.close()
    return ZioCommitMessage(
        endpoint, opts.stream, batch, partition, attempt, rows, plain=w.plain_peer, query=query
    )


def _send_records(w: StagingWriter, batch: pa.RecordBatch) -> None:
    values = batch.column(0).to_pylist()
    keys = batch.column(1).to_pylist()
    headers = batch.column(2).to_pylist()
    for v, k, h in zip(values, keys, headers, strict=True):
        w.write_record(b"" if v is None else v, k, None if h is None else dict(h))


# ----------------------------------------------------------------------- driver side


def _endpoints(messages: Sequence[Any]) -> dict[str, tuple[bool, str | None]]:
    """endpoint -> (it is a plain ZIO taker, the query id)."""
    seen: dict[str, list[ZioCommitMessage]] = {}
    for m in messages:
        if isinstance(m, ZioCommitMessage):
            seen.setdefault(m.endpoint, []).append(m)
    out: dict[str, tuple[bool, str | None]] = {}
    for ep, ms in seen.items():
        # Empty partitions opened no flow, so only a message with rows can tell.
        plain = any(m.plain for m in ms) and not any(m.rows and not m.plain for m in ms)
        query = next((m.query for m in ms if m.query is not None), None)
        out[ep] = (plain, query)
    return out


def commit_batch(opts: SinkOptions, messages: Sequence[Any], batch: BatchId) -> None:
    """Tell each consumer to publish the staged partitions of ``batch``.

    Raises
    ------
    CommandError
        A consumer answered ``error`` (e.g. a partition is not staged).
    TransportError
        A consumer did not answer within ``connectTimeout``.
    """
    endpoint = _check_target(opts)
    targets = _endpoints(messages)
    targets.setdefault(endpoint, (False, None))  # record the id even with no messages
    for ep, (plain, query) in targets.items():
        if plain:
            log.info("zio sink: %s is a plain ZIO taker; batch %r not committed there", ep, batch)
            continue
        parts = sorted(
            (m.partition, m.attempt, m.rows)
            for m in messages
            if isinstance(m, ZioCommitMessage) and m.endpoint == ep
        )
        send_command(
            ep,
            "commit",
            opts.stream,
            batch,
            parts,
            query=query,
            mode=_mode(opts),
            curve=_curve(opts),
            timeout=opts.connect_timeout,
        )


def abort_batch(opts: SinkOptions, messages: Sequence[Any], batch: BatchId) -> None:
    """Tell each consumer to discard the staging of ``batch``; best effort, never raises."""
    endpoint = _check_target(opts)
    targets = set(_endpoints(messages)) | {endpoint}
    for ep in sorted(targets):
        try:
            send_command(
                ep,
                "abort",
                opts.stream,
                batch,
                mode=_mode(opts),
                curve=_curve(opts),
                timeout=min(opts.connect_timeout, 10.0),
            )
        except ZioSparkError as e:
            log.warning("zio sink: abort of batch %r at %s failed: %s", batch, ep, e)


# --------------------------------------------------------------------------- writers


class ZioStreamWriter(DataSourceStreamArrowWriter):  # type: ignore[misc]
    """Micro-batch writer: one flow per task, commit/abort per batch id."""

    def __init__(self, opts: SinkOptions, cols: SinkColumns) -> None:
        _check_target(opts)
        self.opts = opts
        self.cols = cols

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZioCommitMessage:
        partition, attempt, batch_text, query = _task_ids()
        if batch_text is None:  # pragma: no cover - Spark always sets it for streams
            raise ZioSparkError("no streaming.sql.batchId in this task's local properties")
        return write_partition(
            self.opts, self.cols, int(batch_text), partition, attempt, query, iterator
        )

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        commit_batch(self.opts, messages, batchId)

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        abort_batch(self.opts, messages, batchId)


class ZioBatchWriter(DataSourceArrowWriter):  # type: ignore[misc]
    """``df.write.format("zio")``: one batch with id ``write-<uuid>`` drawn on the driver."""

    def __init__(self, opts: SinkOptions, cols: SinkColumns, batch_id: str) -> None:
        _check_target(opts)
        self.opts = opts
        self.cols = cols
        self.batch_id = batch_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZioCommitMessage:
        partition, attempt, _, _ = _task_ids()
        return write_partition(
            self.opts, self.cols, self.batch_id, partition, attempt, None, iterator
        )

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        commit_batch(self.opts, messages, self.batch_id)

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        abort_batch(self.opts, messages, self.batch_id)
