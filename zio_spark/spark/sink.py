"""``df.writeStream.format("zio")`` and ``df.write.format("zio")``: the sink's writers.

Protocol (the consumer's side, with the on-disk layout and crash repair, is in
:mod:`zio_spark.sink.consumer`):

1. **Task** (executor, :meth:`write`): one ZIO flow per task, the task being the
   *client giver*: ``BOT{direction:"extract", credit, stream, spark_batch, partition,
   attempt, encoding: [...]}`` (:mod:`zio_spark.protocol.sink`), then DATs within the
   credit actually paid, then EOT (see "Message shapes" for the negotiated format).
   The consumer echoes the EOT only once the partition is durably staged (fsync'd),
   with ``{"rows": n}``; the task checks ``n`` and returns a :class:`ZioCommitMessage`.
   A task whose input fails midway sends ``EOT{error}`` (the consumer discards the
   partial file) and re-raises.
   An empty partition opens no flow (its message says 0 rows). No credit or no answer
   within ``connectTimeout`` fails the task with a
   :class:`~zio_spark.errors.TransportError` naming the endpoint.
2. **Driver** (:meth:`commit`/:meth:`abort`, run by
   :class:`~zio_spark.sink.driver.SinkDriver`): one control flow per consumer, its BOT
   carrying ``command``, ``partitions: [[partition, attempt, rows], ...]`` and the
   query id; the consumer replies with an EOT (a rejection, used as the reply) carrying
   ``result``. ``commit`` raises on ``error`` or no reply, so Spark fails the query
   before it records the batch as done; on restart it re-runs the batch and the
   consumer, which remembers committed ids, answers ``ok`` without publishing twice.
   ``abort`` is best effort (logged, never raised): it may overlap running tasks and
   its messages may be None, so it goes to the configured endpoint too (with a
   ``group``: to every consumer the aborting writer knows of).

   A command BOT goes only to an endpoint known to be a zio-spark consumer: a plain ZIO
   taker would take it for a new flow (and a reference server would end the flow in
   progress for it). What an endpoint is, the tasks' messages tell (a flow's EOT echo
   carries ``rows`` from a consumer only); this driver process remembers it across
   batches (:func:`driver`). An endpoint that no flow of this process has reached yet
   (every partition towards it was empty) gets no command: an all-empty batch is then
   not recorded there, which loses nothing (it published nothing).

Group targets (option ``group`` instead of ``endpoint``): the writer object, made on the
driver, resolves the consumers advertised in the ZRE group (port ``flow``, see
:meth:`Consumer.advertise <zio_spark.sink.consumer.Consumer.advertise>`) through one
:class:`~zio_spark.transport.zre_node.ZreNode` per (group, beacon port, broadcast,
interface), cached in the driver's Python worker and reused across micro-batches
(:func:`~zio_spark.transport.discovery.resolve_targets`). It
waits up to ``connectTimeout`` for at least one (a fresh node first listens for about
two beacon intervals, so it does not settle for the first consumer it hears), sorts the
endpoints and keeps that list: partition ``p`` goes to ``endpoints[p % n]``. The list
is pickled to the tasks with the writer, so tasks do no discovery and a retried task
goes to the same consumer as its first attempt. Each commit message names its endpoint
and socket mode, and commit goes to exactly the consumers the messages name (empty
partitions included, so each records the batch id), each committing atomically on its
own: a batch spread over consumers is published per consumer, not across them.

Batch ids: a streaming write uses Spark's micro-batch id, read on executors from the
local property ``streaming.sql.batchId`` (``write()`` is not given it). A batch write
(``df.write``) has none: the writer object made on the driver by ``writer()`` draws
``write-<uuid4 hex>`` once; Spark pickles that object to the tasks and hands it back
for ``commit``, so all of them agree. The Spark query id (local property
``sql.streaming.queryId``, stable across restarts from one checkpoint) rides along so
the consumer can refuse a *new* query reusing a stream whose batch ids are taken.

Message shapes (option ``format``), negotiated as in
:mod:`zio_spark.protocol.negotiate` (the client offers, the server states): the task's
BOT offers ``encoding: ["arrow", "record"]`` (``auto``, the default), ``["arrow"]`` or
``["record"]``; a zio-spark consumer names its pick as a scalar ``encoding`` in its BOT
reply. A reply that names none is a plain ZIO taker (the reference's servers echo the
client's BOT, offered list included): ``auto`` and ``record`` then send records, an
explicit ``arrow`` fails the task before any data is sent, naming the endpoint and the
option.

- ``arrow``: each DAT payload is one Arrow IPC stream holding one record batch (at most
  :data:`MAX_ROWS_PER_DAT` rows, about :data:`MAX_BYTES_PER_DAT` bytes) with columns
  ``value`` binary, ``key`` binary, ``headers`` map<string,string>.
- ``record``: one record per DAT, payload = the value bytes, flow-object attributes
  ``key`` (base64 text) and ``headers`` (an object) when present; a record with neither
  has the bare ``{"flow": "DAT"}`` label of the reference. Nothing is staged at a plain
  taker and commit/abort skip it: at-least-once.

A plain ZIO taker (the reference's server) serves **one flow at a time**: a second
flow's BOT ends the one in progress, telling its giver nothing. Tasks run on separate
executors, so the sink cannot serialise them; a flow towards a plain taker that stops
getting credit or its EOT echo within ``connectTimeout`` fails the task with an error
saying the taker serves one flow at a time (fix: ``df.coalesce(1)``, or a flow broker
such as ``zio-spark consume``). The query never reports success with rows missing, but
the rows the killed flow did deliver are there, and a retried task sends them again.

Input columns are normalised: ``value`` (required) binary or string (UTF-8), ``key``
binary or string, ``headers`` map<string,string>; anything else is an
:class:`~zio_spark.errors.InputColumnsError` raised on the driver when the writer is
created, listing the DataFrame's columns, what is wrong and what is accepted.

A new writer object is created for every micro-batch and another runs commit/abort
(FACTS.md): the writers hold only the parsed options, the column layout and (with a
group) the resolved consumers; commit/abort take endpoints and modes from the messages.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from zio_spark import heap
from zio_spark.codec.records import encode_payload
from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.errors import InputColumnsError, ZioSparkError
from zio_spark.options import SinkOptions, parse_sink_options
from zio_spark.protocol.sink import BatchId
from zio_spark.sink.client import StagingWriter
from zio_spark.sink.driver import SinkDriver, configured_mode
from zio_spark.spark import compat
from zio_spark.transport.discovery import Target

__all__ = [
    "MAX_BYTES_PER_DAT",
    "MAX_ROWS_PER_DAT",
    "SinkColumns",
    "ZioBatchWriter",
    "ZioCommitMessage",
    "ZioStreamWriter",
    "driver",
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
_HEADERS_TYPE = SINK_SCHEMA.field("headers").type


@dataclass(frozen=True)
class SinkColumns:
    """Which input columns feed ``value``, ``key`` and ``headers`` (by name)."""

    value: str
    key: str | None = None
    headers: str | None = None


def sink_columns(schema: StructType) -> SinkColumns:
    """Check the input columns of the sink (the DataFrame's schema) and map them.

    Raises
    ------
    InputColumnsError
        Listing the DataFrame's columns as found: a column other than value/key/headers,
        a column of a wrong type, one of them given twice (names are case-insensitive),
        or no ``value`` column; with what is accepted and how to get there.
    """
    columns = [f"{f.name} {f.dataType.simpleString()}" for f in schema.fields]
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
            raise InputColumnsError(
                columns,
                f"column {f.name!r} ({got}) is not one the sink writes",
                f"only {_ACCEPTED}: drop column {f.name!r}, or rename it to value, key or "
                f"headers (e.g. df.withColumnRenamed({f.name!r}, 'value'))",
            )
        if not ok:
            how = (
                f"cast it, e.g. df.withColumn({f.name!r}, df[{f.name!r}].cast('string'))"
                if name != "headers"
                else "build it as a map of strings, e.g. with pyspark.sql.functions.create_map"
            )
            raise InputColumnsError(
                columns, f"column {f.name!r} is {got}", f"{name} of type {want}: {how}"
            )
        if name in found:
            raise InputColumnsError(
                columns,
                f"columns {found[name]!r} and {f.name!r} both name {name} "
                "(column names are case-insensitive here)",
                "each of value, key, headers at most once: drop or rename one of them",
            )
        found[name] = f.name
    if "value" not in found:
        raise InputColumnsError(
            columns,
            "there is no 'value' column",
            f"{_ACCEPTED}: name the column that holds each record's payload value "
            "(e.g. df.withColumnRenamed('payload', 'value'))",
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
        As :func:`~zio_spark.options.parse_sink_options`.
    """
    return parse_sink_options({k: v for k, v in raw.items() if k.lower() not in _SPARK_OWNED})


# ----------------------------------------------------------------------------- driver

_DRIVER: SinkDriver | None = None
_DRIVER_LOCK = threading.Lock()


def driver() -> SinkDriver:
    """This process's :class:`~zio_spark.sink.driver.SinkDriver`, made on first use.

    Spark makes a new writer for every micro-batch and runs commit/abort on another, in
    a reused Python worker: what must outlive a batch (which endpoints are consumers,
    the ZRE nodes of group targets) lives in this one object, whose nodes stop at exit.
    """
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            _DRIVER = SinkDriver()
            atexit.register(_DRIVER.stop)
        return _DRIVER


def _target_of(targets: Sequence[Target], partition: int) -> Target:
    return targets[partition % len(targets)]


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class ZioCommitMessage(WriterCommitMessage):  # type: ignore[misc]
    """What one task reports: where its partition is staged and how many rows.

    ``plain`` is true when the endpoint turned out to be a plain ZIO taker (its EOT
    echo had no ``rows``): there is nothing staged to commit there; with ``rows`` 0 (no
    flow was opened) it says nothing of the endpoint. ``mode`` is the
    socket mode the task used (None: the ``socket`` option), for commit/abort.
    """

    endpoint: str
    stream: str
    batch: BatchId
    partition: int
    attempt: int
    rows: int
    plain: bool = False
    query: str | None = None
    mode: str | None = None


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
        raise InputColumnsError(
            [f"{name} {t}"], f"column {name!r} is {t}", "binary or string"
        ) from e


def _normalise(batch: pa.RecordBatch, cols: SinkColumns) -> pa.RecordBatch:
    """Spark's Arrow batch -> a batch of :data:`SINK_SCHEMA`."""
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
    return pa.RecordBatch.from_arrays([value, key, headers], schema=SINK_SCHEMA)


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
    target: Target | None = None,
) -> ZioCommitMessage:
    """Stream one partition to the consumer ``target`` (default: the ``endpoint``
    option); returns its commit message.

    Raises
    ------
    TransportError
        The consumer is unreachable, gives no credit or does not confirm staging within
        ``connectTimeout``, or confirms a different row count.
    """
    if target is None:
        if opts.endpoint is None:
            raise ZioSparkError("write_partition needs a target with a 'group' sink")
        target = (opts.endpoint, configured_mode(opts))
    endpoint, mode = target
    it = iter(batches)
    first: pa.RecordBatch | None = None
    for b in it:  # an empty partition opens no flow
        if b.num_rows:
            first = b
            break
    if first is None:
        return ZioCommitMessage(
            endpoint, opts.stream, batch, partition, attempt, 0, query=query, mode=mode
        )
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
        mode=mode,
        curve=opts.curve,
        extra=extra,
    )
    try:
        current: pa.RecordBatch | None = first
        while current is not None:
            if current.num_rows:
                norm = _normalise(current, cols)
                if w.format == "arrow":  # agreed with the consumer
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
        endpoint,
        opts.stream,
        batch,
        partition,
        attempt,
        rows,
        plain=w.plain_peer,
        query=query,
        mode=mode,
    )


def _send_records(w: StagingWriter, batch: pa.RecordBatch) -> None:
    """One DAT per record; runs of records without key and headers go out as bare DATs
    (the reference's ``{"flow": "DAT"}`` label), a credit run at a time."""
    values = [b"" if v is None else v for v in batch.column(0).to_pylist()]
    if batch.column(1).null_count == len(values) and batch.column(2).null_count == len(values):
        w.write_values(values)
        return
    keys = batch.column(1).to_pylist()
    headers = batch.column(2).to_pylist()
    run: list[bytes] = []
    for v, k, h in zip(values, keys, headers, strict=True):
        if k is None and not h:
            run.append(v)
            continue
        if run:
            w.write_values(run)
            run = []
        w.write_record(v, k, None if h is None else dict(h))
    if run:
        w.write_values(run)


# --------------------------------------------------------------------------- writers


def _reports(messages: Sequence[WriterCommitMessage | None]) -> list[ZioCommitMessage]:
    """The tasks' reports among Spark's commit messages (a failed task's is None)."""
    return [m for m in messages if isinstance(m, ZioCommitMessage)]


# Spark 4.1+ has DataSourceStreamArrowWriter. Spark 4.0 has not, but its write path checks
# isinstance(writer, DataSourceArrowWriter) first for streams too: deriving from both
# stream writer and Arrow writer gets Arrow batches there, and the same commit/abort.
_STREAM_WRITER_BASES: tuple[type, ...] = (
    (compat.find("DataSourceStreamArrowWriter"),)
    if compat.HAS_STREAM_ARROW_WRITER
    else (DataSourceStreamWriter, DataSourceArrowWriter)
)


class ZioStreamWriter(*_STREAM_WRITER_BASES):  # type: ignore[misc]
    """Micro-batch writer: one flow per task, commit/abort per batch id.

    ``targets`` (resolved here, on the driver) travels pickled to the tasks: partition
    ``p`` writes to ``targets[p % len(targets)]``.
    """

    def __init__(self, opts: SinkOptions, cols: SinkColumns) -> None:
        self.opts = opts
        self.cols = cols
        self.targets = driver().targets(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZioCommitMessage:
        heap.freeze_gc()  # the worker's gc.collect() after each task skips the modules
        partition, attempt, batch_text, query = _task_ids()
        if batch_text is None:  # pragma: no cover - Spark always sets it for streams
            raise ZioSparkError("no streaming.sql.batchId in this task's local properties")
        return write_partition(
            self.opts,
            self.cols,
            int(batch_text),
            partition,
            attempt,
            query,
            iterator,
            _target_of(self.targets, partition),
        )

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        driver().commit(self.opts, _reports(messages), batchId)

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        driver().abort(self.opts, _reports(messages), batchId, self.targets)


class ZioBatchWriter(DataSourceArrowWriter):  # type: ignore[misc]
    """``df.write.format("zio")``: one batch with id ``write-<uuid>`` drawn on the driver."""

    def __init__(self, opts: SinkOptions, cols: SinkColumns, batch_id: str) -> None:
        self.opts = opts
        self.cols = cols
        self.batch_id = batch_id
        self.targets = driver().targets(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZioCommitMessage:
        heap.freeze_gc()  # the worker's gc.collect() after each task skips the modules
        partition, attempt, _, _ = _task_ids()
        return write_partition(
            self.opts,
            self.cols,
            self.batch_id,
            partition,
            attempt,
            None,
            iterator,
            _target_of(self.targets, partition),
        )

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        driver().commit(self.opts, _reports(messages), self.batch_id)

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        driver().abort(self.opts, _reports(messages), self.batch_id, self.targets)
