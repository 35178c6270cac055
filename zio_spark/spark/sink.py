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
2. **Driver** (:meth:`commit`/:meth:`abort`): one control flow per consumer, its BOT
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
   batches. An endpoint that no flow of this process has reached yet (every partition
   towards it was empty) gets no command: an all-empty batch is then not recorded
   there, which loses nothing (it published nothing).

Group targets (option ``group`` instead of ``endpoint``): the writer object, made on the
driver, resolves the consumers advertised in the ZRE group (port ``flow``, see
:meth:`Consumer.advertise <zio_spark.sink.consumer.Consumer.advertise>`) through one
:class:`~zio_spark.transport.zre_node.ZreNode` per (group, beacon port, broadcast,
interface), cached in the driver's Python worker and reused across micro-batches. It
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
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from zio_spark.codec.records import encode_payload
from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.errors import ConfigError, InputColumnsError, TransportError, ZioSparkError
from zio_spark.options import SinkOptions, ZreOptions, parse_sink_options
from zio_spark.protocol.sink import BatchId
from zio_spark.sink.client import StagingWriter, send_command
from zio_spark.spark import compat
from zio_spark.transport.discovery import FLOW_PORT
from zio_spark.transport.port import choose_mode
from zio_spark.transport.zre_node import ZreNode

__all__ = [
    "MAX_BYTES_PER_DAT",
    "MAX_ROWS_PER_DAT",
    "SinkColumns",
    "ZioBatchWriter",
    "ZioCommitMessage",
    "ZioStreamWriter",
    "resolve_targets",
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


def _curve(opts: SinkOptions) -> tuple[bytes, bytes, bytes] | None:
    c = opts.curve
    return None if c is None else (c.server_key, c.public_key, c.secret_key)


def _mode(opts: SinkOptions) -> str | None:
    return None if opts.socket == "auto" else opts.socket


# ---------------------------------------------------------------------------- targets

Target = tuple[str, str | None]
"""(consumer endpoint, socket mode or None for the configured ``socket`` option)."""

_NodeKey = tuple[str, int, str, str | None]
_NODES: dict[_NodeKey, ZreNode] = {}
_NODES_LOCK = threading.Lock()
_POLL = 0.05


def _stop_nodes() -> None:
    with _NODES_LOCK:
        nodes = list(_NODES.values())
        _NODES.clear()
    for node in nodes:
        try:
            node.stop(timeout=1.0)
        except Exception:  # pragma: no cover - best effort at interpreter exit
            log.debug("zio sink: stopping a ZRE node failed", exc_info=True)


def _group_node(z: ZreOptions) -> tuple[ZreNode, bool]:
    """The cached ZRE node of this group (started on first use); (node, freshly made).

    One node per (group, beacon port, broadcast, interface) in this process; the beacon
    interval of the first writer to ask wins.
    """
    key = (z.group, z.beacon_port, z.broadcast, z.interface)
    with _NODES_LOCK:
        node = _NODES.get(key)
        if node is not None and node.running:
            return node, False
        if not _NODES:
            atexit.register(_stop_nodes)
        node = ZreNode(
            beacon_port=z.beacon_port,
            broadcast=z.broadcast,
            interface_addr=z.interface,
            interval=z.interval,
        )
        node.join(z.group)
        node.start()
        _NODES[key] = node
        return node, True


def resolve_targets(opts: SinkOptions) -> tuple[Target, ...]:
    """The consumers this writer sends to, sorted by endpoint (driver side).

    With ``endpoint``: that one. With ``group``: the flow ports advertised in the ZRE
    group, each with the socket mode its advertised socket type needs; waits up to
    ``connectTimeout`` for at least one.

    Raises
    ------
    TransportError
        No usable consumer is advertised in the group within ``connectTimeout`` (the
        message names the group, and any consumer refused for its socket type).
    """
    z = opts.zre
    if z is None:
        if opts.endpoint is None:  # pragma: no cover - parse_sink_options ensures one
            raise ConfigError("endpoint", None, "an 'endpoint' or a 'group'")
        return ((opts.endpoint, _mode(opts)),)
    node, fresh = _group_node(z)
    start = time.monotonic()
    deadline = start + opts.connect_timeout
    # A fresh node has heard nobody yet: listen a little, so that the first batch
    # does not go all to whichever consumer answered first.
    settle = start + 2 * z.interval if fresh else start
    refused: dict[str, str] = {}
    while True:
        found: dict[str, str | None] = {}
        for ep in node.zio_endpoints(z.group, port=FLOW_PORT):
            try:
                found[ep.address] = choose_mode(_mode(opts), ep.socket, option="socket").value
            except ZioSparkError as e:
                if ep.address not in refused:
                    log.warning("zio sink: not writing to %s (%s): %s", ep.address, ep.socket, e)
                refused[ep.address] = str(e)
        now = time.monotonic()
        if (found and now >= settle) or now >= deadline:
            break
        time.sleep(min(_POLL, max(0.0, deadline - now)))
    if not found:
        why = "".join(f"; refused {a}: {r}" for a, r in sorted(refused.items()))
        raise TransportError(
            f"no consumer advertised a {FLOW_PORT!r} port in ZRE group {z.group!r} "
            f"(beacon port {z.beacon_port}) within {opts.connect_timeout:g} s{why}"
        )
    return tuple(sorted(found.items()))


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
        target = (opts.endpoint, _mode(opts))
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
        curve=_curve(opts),
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


# ----------------------------------------------------------------------- driver side


# What this (driver) process has learned of each endpoint from task messages: True for
# a plain ZIO taker, False for a zio-spark consumer. Only a partition with rows opens a
# flow, so a batch whose partitions towards an endpoint are all empty says nothing.
_KNOWN: dict[str, bool] = {}
_KNOWN_LOCK = threading.Lock()


@dataclass
class _Endpoint:
    plain: bool | None  # a plain ZIO taker; None: not known (no flow told yet)
    query: str | None
    mode: str | None
    parts: list[tuple[int, int, int]]


def _endpoints(messages: Sequence[Any], opts: SinkOptions) -> dict[str, _Endpoint]:
    """What the messages (and earlier batches' messages) say about each endpoint they
    name."""
    seen: dict[str, list[ZioCommitMessage]] = {}
    for m in messages:
        if isinstance(m, ZioCommitMessage):
            seen.setdefault(m.endpoint, []).append(m)
    out: dict[str, _Endpoint] = {}
    for ep, ms in seen.items():
        # Empty partitions opened no flow, so only a message with rows can tell.
        plain: bool | None = None
        if any(m.rows and not m.plain for m in ms):
            plain = False
        elif any(m.plain for m in ms):
            plain = True
        query = next((m.query for m in ms if m.query is not None), None)
        mode = next((m.mode for m in ms if m.mode is not None), _mode(opts))
        parts = sorted((m.partition, m.attempt, m.rows) for m in ms)
        out[ep] = _Endpoint(_learn(ep, plain), query, mode, parts)
    return out


def _learn(endpoint: str, plain: bool | None) -> bool | None:
    """Record what a batch told of ``endpoint``; returns what is known of it."""
    with _KNOWN_LOCK:
        if plain is None:
            return _KNOWN.get(endpoint)
        _KNOWN[endpoint] = plain
        return plain


def _why_not(endpoint: str, plain: bool | None) -> str:
    if plain:
        return f"{endpoint} is a plain ZIO taker (nothing staged there)"
    return (
        f"no flow of this batch reached {endpoint} (its partitions were empty) and it is "
        "not known to be a zio-spark consumer (a plain ZIO taker would take the "
        "command's BOT for a new flow)"
    )


def commit_batch(opts: SinkOptions, messages: Sequence[Any], batch: BatchId) -> None:
    """Tell each consumer to publish the staged partitions of ``batch``.

    The consumers are the ones the messages name (each partition's, empty ones
    included) and, with an explicit ``endpoint``, that one even with no messages (it
    records the batch id); each with the socket mode its messages name.

    Raises
    ------
    CommandError
        A consumer answered ``error`` (e.g. a partition is not staged).
    TransportError
        A consumer did not answer within ``connectTimeout``.
    """
    found = _endpoints(messages, opts)
    if opts.endpoint is not None and opts.endpoint not in found:
        found[opts.endpoint] = _Endpoint(_learn(opts.endpoint, None), None, _mode(opts), [])
    if not found:
        log.info("zio sink: batch %r has no partitions; nothing to commit", batch)
    for ep, t in sorted(found.items()):
        if t.plain is not False:
            log.info("zio sink: batch %r not committed: %s", batch, _why_not(ep, t.plain))
            continue
        send_command(
            ep,
            "commit",
            opts.stream,
            batch,
            t.parts,
            query=t.query,
            mode=t.mode,
            curve=_curve(opts),
            timeout=opts.connect_timeout,
        )


def abort_batch(
    opts: SinkOptions,
    messages: Sequence[Any],
    batch: BatchId,
    targets: Sequence[Target] = (),
) -> None:
    """Tell each consumer to discard the staging of ``batch``; best effort, never raises.

    Goes to the endpoints the messages name, the ``endpoint`` option and ``targets``
    (messages of failed tasks are None, so they cannot be relied on), each only if it is
    known to be a zio-spark consumer (from this batch's messages or an earlier batch's):
    a plain ZIO taker would take the command's BOT for a new flow, and a reference
    server would end the flow in progress for it.
    """
    found = _endpoints(messages, opts)
    modes: dict[str, str | None] = {ep: t.mode for ep, t in found.items()}
    for ep, mode in targets:
        modes.setdefault(ep, mode)
    if opts.endpoint is not None:
        modes.setdefault(opts.endpoint, _mode(opts))
    for ep, mode in sorted(modes.items()):
        plain = found[ep].plain if ep in found else _learn(ep, None)
        if plain is not False:
            log.info("zio sink: no abort of batch %r sent: %s", batch, _why_not(ep, plain))
            continue
        try:
            send_command(
                ep,
                "abort",
                opts.stream,
                batch,
                mode=mode,
                curve=_curve(opts),
                timeout=min(opts.connect_timeout, 10.0),
            )
        except ZioSparkError as e:
            log.warning("zio sink: abort of batch %r at %s failed: %s", batch, ep, e)


# --------------------------------------------------------------------------- writers


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
        self.targets = resolve_targets(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZioCommitMessage:
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
        commit_batch(self.opts, messages, batchId)

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        abort_batch(self.opts, messages, batchId, self.targets)


class ZioBatchWriter(DataSourceArrowWriter):  # type: ignore[misc]
    """``df.write.format("zio")``: one batch with id ``write-<uuid>`` drawn on the driver."""

    def __init__(self, opts: SinkOptions, cols: SinkColumns, batch_id: str) -> None:
        self.opts = opts
        self.cols = cols
        self.batch_id = batch_id
        self.targets = resolve_targets(opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZioCommitMessage:
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
        commit_batch(self.opts, messages, self.batch_id)

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        abort_batch(self.opts, messages, self.batch_id, self.targets)
