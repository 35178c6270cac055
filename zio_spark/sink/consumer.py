"""The sink's consumer: durable staging, atomic publish, committed batch ids.

Theory of operation (DESIGN.md, "The sink"; specs/zio-flow.txt):

**Data flows.** Every Spark task of ``df.writeStream.format("zio")`` opens a ZIO flow
towards the consumer as the *client giver*::

    BOT{direction:"extract", credit, stream, batch, partition, attempt, encoding:[...]}

``batch`` is Spark's micro-batch id (an int) or, for ``df.write``, a string chosen on the
driver; ``encoding`` lists the payload formats the sink offers, in its order of
preference: ``"arrow"`` (each DAT payload is one Arrow IPC stream holding one record
batch of :data:`CONSUMER_SCHEMA`) and/or ``"record"`` (one record per DAT: the payload
frame is the value, DAT attributes ``key`` (base64 text) and ``headers`` (an object of
strings)). The consumer answers ``BOT{direction:"inject", encoding:<its pick>}`` (the
client offers, the server states: :mod:`zio_spark.protocol.negotiate`; a reference
server would echo the list instead, which is how a sink tells a plain ZIO taker) with a
credit no larger than its own cap (``credit`` for arrow flows, ``record_credit`` for
record flows) and hands the credit out. A BOT without ``encoding`` (a sink older than
the negotiation) names its format in ``format``, and gets no ``encoding`` back.

Each DAT is written to the staging file
``staging/<stream>/<batch>/<partition>-<attempt>.part`` (an Arrow IPC file) *before* its
credit goes back (a PAY once a quarter of the window is back), so a slow disk slows the
writer down and nothing queues without bound. A new BOT for the same
(stream, batch, partition, attempt) truncates the file (a restarted query re-runs the
same attempt numbers) and ends the flow that was writing it.

On the giver's EOT the file is closed, fsync'd and renamed to ``<partition>-<attempt>.arrow``
(the folder fsync'd): the partition is now *complete-staged*, and only then is the EOT
echoed, carrying ``{"rows": n}``. An EOT carrying ``error`` (the task failed while
writing) discards the file instead. A flow that breaks, idles out or violates the
protocol leaves nothing behind but a deleted ``.part`` file.

**Commands.** The driver's ``commit``/``abort`` reach the consumer as a *control flow*:
a BOT with ``command``::

    BOT{direction:"extract", credit:1, stream, batch, command:"commit"|"abort",
        partitions:[[partition, attempt, rows], ...], query:<Spark query id, optional>}

The consumer never accepts it: it answers with EOT (a flow rejection, used as the reply)
carrying ``{"result":"ok"}`` or ``{"result":"error","reason":...}``.

- ``commit``: if the batch id is already in the committed set of that stream, ``ok``
  (idempotent: a re-delivered batch is published once). Otherwise every listed
  (partition, attempt) with ``rows > 0`` must be complete-staged with exactly ``rows``
  rows, else ``error``. Then the batch is *published*: the listed files are hard-linked
  (copied if the file system cannot link) into ``published/<stream>/<seq>-<batch>.tmp/``
  as ``part-<partition>.arrow`` with a ``_MANIFEST.json``, the folder is fsync'd and
  renamed to ``published/<stream>/<seq>-<batch>/`` (the parent fsync'd) -- **the rename is
  the commit point** -- then a line is appended to ``committed.log`` and fsync'd, and
  the batch's staging folder (other attempts included) is deleted. ``seq`` is the
  consumer's commit sequence number, so folder names sort in commit order. A batch with
  no rows records its id and publishes nothing. Staging of older int batches of the same
  stream is deleted too: Spark commits in order and never re-runs an older batch.
- ``abort``: deletes the batch's staging (nothing if the batch is already committed).
  Messages from failed tasks are ``None``, so the driver sends abort to the configured
  endpoint whatever the messages say. Idempotent.

A ``query`` attribute (Spark's query id, stable across restarts from one checkpoint)
guards the most likely misuse: a new query (fresh checkpoint) writing to a stream whose
batch ids an older query already used. Such a batch would be dropped as a duplicate; the
commit fails with a reason instead.

**Plain ZIO givers.** A data flow whose BOT has no ``batch`` (any ZIO peer that knows
nothing of Spark; ``stream`` defaults to ``"zio"``, the format to ``"record"``) is
published by the consumer itself, as batches with string ids ``flow-...``: whenever
``plain_batch_rows`` records or ``plain_batch_seconds`` have accumulated, and at EOT.
That is at-least-once (a plain giver has no batch ids to deduplicate).

**Crash safety** (all files under ``path``; one process per folder, ``flock`` on
``LOCK``). On open, deterministically:

1. ``published/<stream>/*.tmp`` folders are deleted (a publish that had not reached its
   commit point; the staged files are still in place, so a retried commit succeeds).
2. A published folder whose batch is missing from the committed log is *rolled
   forward*: its manifest's line is appended to the log. (The rename was the commit
   point; the writer's retry, or Spark re-running the batch, then gets ``ok``.)
3. A committed-log entry without a published folder means the application acked it
   (or it had no rows): nothing to do.
4. Staging of committed batches, and every ``.part`` file (their flows died with the
   previous process), are deleted; complete ``.arrow`` files stay for a later commit.
5. A torn last line of ``committed.log`` (crash during the append, never fsync'd, so
   never acknowledged) is cut off. Corruption anywhere else raises
   :class:`ConsumerStateError`: forgetting committed ids would publish duplicates.
6. ``trash/`` (acked folders being deleted) is emptied.

**Committed ids** are kept per stream: int ids as sorted disjoint ranges (Spark's ids
are consecutive, so this is one or a few ranges whatever the run length), string ids
(``df.write``, plain flows) the most recent :data:`STRING_IDS_KEPT` per stream. Every
:data:`COMPACT_EVERY` commits the log is folded into ``committed.json`` (written to a
temporary name, fsync'd, renamed) and truncated; opening replays the snapshot and then
the log, so a crash between the two steps is harmless.

**Application API**: :meth:`Consumer.published` (commit order), :meth:`Consumer.read`
(Arrow record batches), :meth:`Consumer.records`, :meth:`Consumer.ack` (deletes the
published data; the committed id stays remembered).

Threads: the flow server thread owns staging and runs commands; application calls take
the same lock as commands, briefly. A commit (links and fsyncs) and an EOT (one fsync)
run in the server thread, so they delay other flows for their duration.

Layering note: unlike the spool, this module runs a
:class:`~zio_spark.transport.flow_server.FlowServer`, so it imports the transport layer
(and ``zmq``) on top of durability.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa
import zmq

from zio_spark.codec.records import plain_value
from zio_spark.errors import (
    ConfigError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
    ZioSparkError,
)
from zio_spark.protocol.flow import BotReceived, Data, Direction, EotReceived, Role
from zio_spark.protocol.negotiate import client_terms, server_terms
from zio_spark.transport.curve import client_kwargs
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.port import ClientPort, ServerPort

if TYPE_CHECKING:
    from zio_spark.transport.zre_node import ZreNode

__all__ = [
    "COMPACT_EVERY",
    "CONSUMER_SCHEMA",
    "STRING_IDS_KEPT",
    "BatchId",
    "CommandError",
    "Consumer",
    "ConsumerRecord",
    "ConsumerStateError",
    "StagingWriter",
    "decode_payload",
    "encode_payload",
    "send_command",
]

log = logging.getLogger("zio_spark.consumer")

CONSUMER_SCHEMA = pa.schema(
    [
        pa.field("value", pa.binary()),
        pa.field("key", pa.binary()),
        pa.field("headers", pa.map_(pa.string(), pa.string())),
    ]
)
"""The columns of a staged/published record: what the sink sends in ``format=arrow``."""

_SCHEMA_MESSAGE: bytes = CONSUMER_SCHEMA.serialize().to_pybytes()
_IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation marker, length 0

BatchId = int | str
COMPACT_EVERY = 10_000
STRING_IDS_KEPT = 10_000
FORMATS = ("arrow", "record")
"""Payload formats a consumer takes, in the order it prefers them."""
WRITER_FORMATS = ("auto", *FORMATS)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_STRING_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_STREAM_BYTES = 200
_MAX_INT_ID = 10**19 - 1
_MAX_PART = 10**9
_RECORD_FLUSH_ROWS = 4096
_RECORD_FLUSH_BYTES = 4 << 20
_MANIFEST = "_MANIFEST.json"


class ConsumerStateError(ZioSparkError):
    """The consumer's folder is inconsistent in a way that cannot be repaired safely."""


class CommandError(ZioSparkError):
    """The consumer answered a command with ``result: error``; ``reason`` says why."""

    def __init__(self, endpoint: str, command: str, reason: str) -> None:
        self.endpoint = endpoint
        self.command = command
        self.reason = reason
        super().__init__(f"consumer {endpoint} refused {command}: {reason}")


class ConsumerRecord(NamedTuple):
    value: bytes | None
    key: bytes | None
    headers: dict[str, str] | None


# ----------------------------------------------------------------------------- names


def _check_stream(stream: object) -> str:
    if not isinstance(stream, str) or not stream:
        raise RemoteProtocolError(
            f"stream must be a non-empty string, got {stream!r}", field="stream", value=stream
        )
    if len(stream.encode("utf-8")) > _MAX_STREAM_BYTES:
        raise RemoteProtocolError(
            f"stream name is longer than {_MAX_STREAM_BYTES} bytes", field="stream", value=stream
        )
    return stream


def _check_batch(batch: object) -> BatchId:
    if isinstance(batch, bool):
        pass
    elif isinstance(batch, int):
        if 0 <= batch <= _MAX_INT_ID:
            return batch
    elif isinstance(batch, str) and _STRING_ID.match(batch):
        return batch
    raise RemoteProtocolError(
        f"batch must be an integer 0..{_MAX_INT_ID} or a string of letters, digits, "
        f"'.', '_', '-' (1..128, starting alphanumeric), got {batch!r}",
        field="batch",
        value=batch,
    )


def _check_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_PART:
        raise RemoteProtocolError(
            f"{name} must be an integer 0..{_MAX_PART - 1}, got {value!r}", field=name, value=value
        )
    return value


def _stream_dir(stream: str) -> str:
    """A file name for a stream name, reversible (see :func:`_stream_from_dir`)."""
    if _SAFE_NAME.match(stream):
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


# --------------------------------------------------------------------------- payloads


def encode_payload(batch: pa.RecordBatch) -> bytes:
    """One DAT payload of ``format=arrow``: an Arrow IPC stream with one batch.

    Raises
    ------
    LocalProtocolError
        If the batch is not of :data:`CONSUMER_SCHEMA`.
    """
    if not batch.schema.equals(CONSUMER_SCHEMA):
        raise LocalProtocolError(
            f"record batch schema must be {CONSUMER_SCHEMA}, got {batch.schema}", field="schema"
        )
    # schema message + record batch message + end-of-stream marker = an IPC stream; one
    # pre-sized copy instead of a growing output stream and a second copy out of it.
    return b"".join((_SCHEMA_MESSAGE, batch.serialize(), _IPC_EOS))


def decode_payload(data: bytes) -> list[pa.RecordBatch]:
    """Decode one ``format=arrow`` DAT payload.

    Raises
    ------
    RemoteProtocolError
        ``field="payload"`` if the bytes are not an Arrow IPC stream, ``field="schema"``
        if its schema is not :data:`CONSUMER_SCHEMA`.
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        schema = reader.schema
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise RemoteProtocolError(
            f"DAT payload is not an Arrow IPC stream: {e}", field="payload"
        ) from None
    if not schema.equals(CONSUMER_SCHEMA):
        raise RemoteProtocolError(
            f"DAT record schema must be {CONSUMER_SCHEMA}, got {schema}", field="schema"
        )
    return batches


def _record_from_dat(data: Data) -> tuple[bytes, bytes | None, list[tuple[str, str]] | None]:
    """A plain record: payload = value; attrs ``key`` (base64), ``headers``, others."""
    value, nframes = plain_value(data.message.payload)
    key: bytes | None = None
    headers: dict[str, str] = {}
    for name, v in data.attrs.items():
        if name == "key" and isinstance(v, str):
            try:
                key = base64.b64decode(v, validate=True)
                continue
            except ValueError:
                pass  # not base64: kept as a header, like any foreign attribute
        if name == "headers" and isinstance(v, Mapping):
            for hk, hv in v.items():
                headers[str(hk)] = hv if isinstance(hv, str) else json.dumps(hv)
            continue
        headers[name] = v if isinstance(v, str) else json.dumps(v)
    if nframes > 1:
        headers["zio.frames"] = str(nframes)
    return value, key, (list(headers.items()) if headers else None)


# ------------------------------------------------------------------------------ disk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _count_rows(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


class _Stage:
    """One staging file being written: an Arrow IPC file of :data:`CONSUMER_SCHEMA`."""

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
        self._writer: pa.ipc.RecordBatchFileWriter | None = pa.ipc.new_file(
            self._file, CONSUMER_SCHEMA
        )
        self._values: list[bytes] = []
        self._keys: list[bytes | None] = []
        self._headers: list[list[tuple[str, str]] | None] = []
        self._buffered_bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        assert self._writer is not None
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def add_record(
        self, value: bytes, key: bytes | None, headers: list[tuple[str, str]] | None
    ) -> None:
        self._values.append(value)
        self._keys.append(key)
        self._headers.append(headers)
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
                pa.array(self._headers, CONSUMER_SCHEMA.field("headers").type),
            ],
            schema=CONSUMER_SCHEMA,
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
            _fsync_file(self.part)
        os.rename(self.part, self.final)
        if self.sync:
            _fsync_dir(self.final.parent)
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


class _Committed:
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
    def restore(cls, obj: Mapping[str, Any]) -> _Committed:
        c = cls()
        for lo, hi in obj.get("ranges", []):
            c.los.append(int(lo))
            c.his.append(int(hi))
        for s in obj.get("strings", []):
            c.strings[str(s)] = None
        c.query = obj.get("query")
        return c


@dataclass(frozen=True, slots=True)
class _Published:
    stream: str
    batch: BatchId
    seq: int
    rows: int
    path: Path


# -------------------------------------------------------------------------- handlers


def _pick_format(attrs: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The payload format of a data flow from the client's BOT, and our reply's
    attributes (None: nothing to state).

    A client that offers ``encoding`` (a list, or one name) gets the first one it lists
    that we take, named as a scalar in our reply (:func:`server_terms`). A client that
    does not: the ``format`` attribute of sinks older than the negotiation, else
    ``record`` for a plain ZIO giver (no ``batch``) and ``arrow`` for a sink.

    Raises
    ------
    RemoteProtocolError
        If the offer names no encoding we take, or ``format`` is not one we know.
    """
    if "encoding" in attrs:
        # Only the offer: the sink's ``batch`` (a Spark batch id) is not the profile's.
        picked = server_terms("taker", {"encoding": attrs["encoding"]}, FORMATS).encoding
        if picked is None:
            raise RemoteProtocolError(
                f"BOT encoding {attrs['encoding']!r} offers nothing this consumer takes "
                f"(it takes {list(FORMATS)})",
                field="encoding",
                value=attrs["encoding"],
            )
        return picked, {"encoding": picked}
    fmt = attrs.get("format", "record" if "batch" not in attrs else "arrow")
    if fmt not in FORMATS:
        raise RemoteProtocolError(
            f"format must be 'arrow' or 'record', got {fmt!r}", field="format", value=fmt
        )
    return fmt, None


class _DataHandler(FlowHandler):
    """Serves one client flow: a data flow to stage, or a command to answer."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.stage: _Stage | None = None
        self.key: tuple[str, BatchId, int, int] | None = None
        self.format = "arrow"
        self.stream = ""
        self.plain = False
        self.plain_rows = 0
        self.dead: str | None = None

    # -- BOT -------------------------------------------------------------------------

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        c = self.consumer
        attrs = bot.attrs
        if bot.direction is not Direction.EXTRACT:
            c.stats["rejected"] += 1
            conn.reject(
                {"result": "error", "reason": "this consumer only takes data: send BOT extract"}
            )
            return
        if "command" in attrs:
            conn.reject(c._command(attrs))
            return
        try:
            reply = self._open(attrs)
        except RemoteProtocolError as e:
            c.stats["rejected"] += 1
            log.warning("consumer: rejecting flow from %s: %s", conn.name, e)
            conn.reject({"result": "error", "reason": str(e)})
            return
        cap = c.credit if self.format == "arrow" else c.record_credit
        conn.accept(min(bot.credit, cap), reply)
        conn.pay()

    def _open(self, attrs: Mapping[str, Any]) -> dict[str, Any] | None:
        """Set up staging for the flow; returns the attributes of our BOT reply."""
        c = self.consumer
        self.stream = _check_stream(attrs.get("stream", "zio"))
        fmt, reply = _pick_format(attrs)
        self.format = fmt
        if "batch" not in attrs:
            self.plain = True
            self._new_plain_stage()
            c.stats["plain_flows"] += 1
            return reply
        batch = _check_batch(attrs["batch"])
        partition = _check_index("partition", attrs.get("partition"))
        attempt = _check_index("attempt", attrs.get("attempt", 0))
        self.key = (self.stream, batch, partition, attempt)
        folder = c._staging_dir(self.stream, batch)
        previous = c._active.get(self.key)
        if previous is not None and previous is not self:
            previous._supersede()
        c._active[self.key] = self
        self.stage = _Stage(
            folder / f"{partition}-{attempt}.part", folder / f"{partition}-{attempt}.arrow", c.fsync
        )
        c.stats["data_flows"] += 1
        return reply

    def _new_plain_stage(self) -> None:
        c = self.consumer
        batch = f"flow-{uuid.uuid4().hex}"
        folder = c._staging_dir(self.stream, batch)
        self.key = (self.stream, batch, 0, 0)
        self.stage = _Stage(folder / "0-0.part", folder / "0-0.arrow", c.fsync)

    def _supersede(self) -> None:
        self.dead = "superseded by a newer flow for the same partition and attempt"
        if self.stage is not None:
            self.stage.discard()
            self.stage = None

    # -- data ------------------------------------------------------------------------

    def on_data(self, conn: ServerFlow, data: Data) -> None:
        if self.dead is not None:
            raise RemoteProtocolError(f"flow is {self.dead}", field="flow")
        stage = self.stage
        assert stage is not None
        payload = data.message.payload
        if self.format == "arrow":
            if len(payload) != 1:
                raise RemoteProtocolError(
                    f"an arrow DAT has exactly 1 payload frame, got {len(payload)}",
                    field="payload",
                    value=len(payload),
                )
            for batch in decode_payload(payload[0]):
                stage.write(batch)
        else:
            stage.add_record(*_record_from_dat(data))
        self.consumer.stats["dats"] += 1
        if self.plain and stage.pending >= self.consumer.plain_batch_rows:
            self._roll()
        # The DAT is in the page cache: its credit may go back (backpressure point).
        held = conn.flow.credit
        if held >= max(1, conn.flow.total_credit // 4):
            conn.pay(held)

    def on_tick(self, conn: ServerFlow, now: float) -> None:
        stage = self.stage
        if (
            self.plain
            and stage is not None
            and stage.pending
            and now - stage.started >= self.consumer.plain_batch_seconds
        ):
            self._roll()

    def _roll(self) -> None:
        """Plain flow: publish what is staged as one batch, start the next."""
        stage, key = self.stage, self.key
        assert stage is not None and key is not None
        rows = stage.finish()
        self.stage = None
        self.plain_rows += rows
        reply = self.consumer._commit(key[0], key[1], [(0, 0, rows)], None)
        if reply.get("result") != "ok":  # pragma: no cover - only disk trouble
            raise OSError(f"publishing plain batch {key[1]} failed: {reply.get('reason')}")
        self._new_plain_stage()

    # -- EOT -------------------------------------------------------------------------

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        if eot.echo:  # pragma: no cover - we never start an EOT on a data flow
            return
        stage = self.stage
        if stage is None or self.dead is not None:
            conn.send_eot({"error": f"flow is {self.dead or 'closed'}"})
            return
        if eot.attrs.get("error") is not None:
            log.info(
                "consumer: %s gave up on %s: %s; staging discarded",
                conn.name,
                self.key,
                eot.attrs.get("error"),
            )
            stage.discard()
            self.stage = None
            conn.send_eot({"rows": 0, "discarded": True})
            return
        try:
            if self.plain:
                total = self.plain_rows + stage.pending
                if stage.pending:
                    self._roll()
                else:
                    stage.discard()
                self.stage = None
                conn.send_eot({"rows": total})
                return
            rows = stage.finish()
        except FileNotFoundError:
            stage.discard()
            self.stage = None
            assert self.key is not None
            conn.send_eot(
                {"error": f"staging of batch {self.key[1]!r} was discarded (aborted) meanwhile"}
            )
            return
        self.stage = None
        self.consumer.stats["staged"] += 1
        conn.send_eot({"rows": rows})

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        if self.stage is not None:
            if reason != "end of transmission":
                log.info("consumer: flow %s of %s closed: %s", self.key, conn.name, reason)
            self.stage.discard()
            self.stage = None
        if self.key is not None and self.consumer._active.get(self.key) is self:
            del self.consumer._active[self.key]


# -------------------------------------------------------------------------- consumer


class Consumer:
    """The receiving end of the zio sink: stages flows, publishes committed batches.

    Parameters
    ----------
    bind
        Endpoint to bind, e.g. ``tcp://127.0.0.1:*`` (see :attr:`endpoint` for the port).
    path
        Folder of the durable state (created if missing). One process per folder.
    ctx
        zmq context (default: the global instance).
    mode
        Socket mode: ``"routerdealer"`` (default), ``"clientserver"`` or ``"auto"``.
    credit
        Most DATs in flight per ``format=arrow`` flow (the BOT offer is lowered to this).
    record_credit
        Most DATs in flight per ``format=record`` flow.
    curve_secret_key
        Turns on CURVE (clients need :attr:`public_key`).
    idle_timeout
        A data flow silent for this long is dropped and its staging discarded.
    fsync
        False skips every fsync (tests and benchmarks only: nothing survives a crash).
    plain_batch_rows, plain_batch_seconds
        How plain ZIO givers' records are cut into published batches.
    fault_hook
        Test hook: called as ``fault_hook(point, stream, batch)`` with ``point`` in
        ``"before_publish"``, ``"after_publish"``; an exception it raises becomes the
        command's error reply (after a publish, the batch stays published).

    Raises
    ------
    ConsumerStateError
        If the folder's committed log is corrupt, or another process holds the folder.
    TransportError
        If ``bind`` fails.
    """

    def __init__(
        self,
        bind: str,
        path: str | os.PathLike[str],
        *,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        credit: int = 32,
        record_credit: int = 256,
        curve_secret_key: str | bytes | None = None,
        idle_timeout: float | None = 600.0,
        fsync: bool = True,
        plain_batch_rows: int = 100_000,
        plain_batch_seconds: float = 1.0,
        linger_ms: int = 1000,
        fault_hook: Callable[[str, str, BatchId], None] | None = None,
    ) -> None:
        for name, value in (("credit", credit), ("record_credit", record_credit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        self.credit = credit
        self.record_credit = record_credit
        self.fsync = fsync
        self.plain_batch_rows = plain_batch_rows
        self.plain_batch_seconds = plain_batch_seconds
        self.fault_hook = fault_hook
        self.root = Path(path)
        self.stats: dict[str, int] = {
            k: 0
            for k in (
                "data_flows",
                "plain_flows",
                "dats",
                "staged",
                "rejected",
                "commits",
                "published",
                "duplicate_commits",
                "commit_errors",
                "aborts",
            )
        }
        self._lock = threading.RLock()
        self._ids: dict[str, _Committed] = {}
        self._published: dict[tuple[str, BatchId], _Published] = {}
        self._next_seq = 1
        self._log_lines = 0
        self._active: dict[tuple[str, BatchId, int, int], _DataHandler] = {}
        self._closed = False
        self._zre: ZreNode | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._recover()
            self._log = open(self.root / "committed.log", "ab")  # noqa: SIM115 - kept open
        except BaseException:
            os.close(self._lock_fd)
            raise
        try:
            port = ServerPort(
                ctx or zmq.Context.instance(),
                mode=mode,
                linger_ms=linger_ms,
                curve_secret_key=curve_secret_key,
            )
        except BaseException:
            self._release()
            raise
        try:
            port.bind(bind)
        except BaseException:
            port.close(linger_ms=0)
            self._release()
            raise
        self.public_key = port.curve_public_key
        self.server = FlowServer(
            port,
            lambda: _DataHandler(self),
            ctx=ctx,
            idle_timeout=idle_timeout,
            name="zio-consumer",
        ).start()

    # -- lifecycle -------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The bound endpoint (with the actual port for ``tcp://...:*``)."""
        return self.server.endpoint

    def close(self) -> None:
        """Stop serving (open flows are dropped, their staging discarded); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            zre, self._zre = self._zre, None
            if zre is not None:
                zre.stop()
        finally:
            try:
                self.server.stop()
            finally:
                self._release()

    def advertise(self, group: str, **zre: object) -> None:
        """Join ZRE ``group`` and advertise this consumer's flow port in it.

        A sink with ``option("group", group)`` then spreads its partitions over the
        consumers advertised there. ``zre`` goes to
        :func:`~zio_spark.transport.discovery.advertise` (``beacon_port``, ``broadcast``,
        ``interface_addr``, ``interval``); the node stops with :meth:`close`.
        """
        from zio_spark.transport.discovery import advertise

        if self._closed:
            raise ZioSparkError("the consumer is closed")
        if self._zre is not None:
            raise ZioSparkError("the consumer is already advertised")
        self._zre = advertise(
            group,
            self.endpoint,
            self.server.port.socket_type,
            **zre,  # type: ignore[arg-type]
        )

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self._log.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        """The published batch's records as Arrow batches of :data:`CONSUMER_SCHEMA`,
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
                _fsync_dir(pub.path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def _lookup(self, stream: str, batch: BatchId) -> _Published:
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

    def _command(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        command = attrs.get("command")
        try:
            stream = _check_stream(attrs.get("stream"))
            batch = _check_batch(attrs.get("batch"))
            query = attrs.get("query")
            if query is not None and not isinstance(query, str):
                raise RemoteProtocolError(f"query must be a string, got {query!r}", field="query")
            if command == "commit":
                parts = self._parts(attrs.get("partitions", []))
                return self._commit(stream, batch, parts, query)
            if command == "abort":
                return self._abort(stream, batch)
            raise RemoteProtocolError(
                f"command must be 'commit' or 'abort', got {command!r}", field="command"
            )
        except RemoteProtocolError as e:
            self.stats["commit_errors"] += 1
            return {"result": "error", "reason": str(e)}
        except Exception as e:  # disk trouble, hook failures: reported, never silent
            self.stats["commit_errors"] += 1
            log.warning("consumer: %s of %r failed: %r", command, attrs.get("batch"), e)
            return {"result": "error", "reason": f"{type(e).__name__}: {e}"}

    @staticmethod
    def _parts(raw: object) -> list[tuple[int, int, int]]:
        if not isinstance(raw, list):
            raise RemoteProtocolError(
                f"partitions must be a list of [partition, attempt, rows], got {raw!r}",
                field="partitions",
            )
        out: list[tuple[int, int, int]] = []
        seen: set[int] = set()
        for item in raw:
            if not isinstance(item, list) or len(item) != 3:
                raise RemoteProtocolError(
                    f"partitions entry must be [partition, attempt, rows], got {item!r}",
                    field="partitions",
                )
            p = _check_index("partition", item[0])
            a = _check_index("attempt", item[1])
            r = item[2]
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise RemoteProtocolError(f"rows must be an integer >= 0, got {r!r}", field="rows")
            if p in seen:
                raise RemoteProtocolError(f"partition {p} listed twice", field="partitions")
            seen.add(p)
            out.append((p, a, r))
        return out

    def _commit(
        self,
        stream: str,
        batch: BatchId,
        parts: Sequence[tuple[int, int, int]],
        query: str | None,
    ) -> dict[str, Any]:
        with self._lock:
            ids = self._ids.setdefault(stream, _Committed())
            staging = self._staging_dir(stream, batch)
            if batch in ids:
                if (
                    isinstance(batch, int)
                    and query is not None
                    and ids.query is not None
                    and query != ids.query
                ):
                    self.stats["commit_errors"] += 1
                    return {
                        "result": "error",
                        "reason": f"batch {batch} of stream {stream!r} was already committed "
                        f"by another query ({ids.query}; this is {query}): a new checkpoint "
                        "must write to a new stream name, or its batches would be dropped "
                        "as duplicates",
                    }
                self.stats["duplicate_commits"] += 1
                self._drop_staging(staging)
                return {"result": "ok", "published": False, "reason": "already committed"}
            files: list[tuple[int, Path]] = []
            total = 0
            for p, a, rows in parts:
                if rows == 0:
                    continue
                f = staging / f"{p}-{a}.arrow"
                if not f.exists():
                    self.stats["commit_errors"] += 1
                    return {
                        "result": "error",
                        "reason": f"partition {p} attempt {a} of batch {batch!r} (stream "
                        f"{stream!r}) is not staged: no complete staging file",
                    }
                n = _count_rows(f)
                if n != rows:
                    self.stats["commit_errors"] += 1
                    return {
                        "result": "error",
                        "reason": f"partition {p} attempt {a} of batch {batch!r} has {n} "
                        f"staged rows, the commit says {rows}",
                    }
                files.append((p, f))
                total += rows
            self._fault("before_publish", stream, batch)
            seq: int | None = None
            if files:
                seq = self._next_seq
                self._publish(stream, batch, seq, files, total, query)
                self._next_seq += 1
            self._append_log(
                {"seq": seq, "stream": stream, "batch": batch, "rows": total, "query": query}
            )
            ids.add(batch)
            if query is not None and isinstance(batch, int):
                ids.query = query
            if seq is not None:
                path = self._published_dir(stream) / f"{seq:020d}-{_batch_key(batch)}"
                self._published[stream, batch] = _Published(stream, batch, seq, total, path)
                self.stats["published"] += 1
            self.stats["commits"] += 1
            self._drop_staging(staging)
            if isinstance(batch, int):
                self._drop_older_staging(stream, batch)
            if self._log_lines >= COMPACT_EVERY:
                self._compact()
        self._fault("after_publish", stream, batch)
        return {"result": "ok", "published": seq is not None, "rows": total}

    def _publish(
        self,
        stream: str,
        batch: BatchId,
        seq: int,
        files: list[tuple[int, Path]],
        rows: int,
        query: str | None,
    ) -> None:
        parent = self._published_dir(stream)
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
                    _fsync_file(target)
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
            _fsync_file(mpath)
            _fsync_dir(tmp)
        os.rename(tmp, parent / name)  # the commit point
        if self.fsync:
            _fsync_dir(parent)

    def _abort(self, stream: str, batch: BatchId) -> dict[str, Any]:
        with self._lock:
            self.stats["aborts"] += 1
            ids = self._ids.get(stream)
            if ids is not None and batch in ids:
                return {"result": "ok", "reason": "already committed; nothing to discard"}
            self._drop_staging(self._staging_dir(stream, batch))
        return {"result": "ok"}

    def _fault(self, point: str, stream: str, batch: BatchId) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, stream, batch)

    # -- folders ---------------------------------------------------------------------

    def _staging_dir(self, stream: str, batch: BatchId) -> Path:
        return self.root / "staging" / _stream_dir(stream) / _batch_key(batch)

    def _published_dir(self, stream: str) -> Path:
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
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise ConsumerStateError(
                f"consumer folder {self.root} is in use by another process ({e})"
            ) from e
        return fd

    # -- committed log ---------------------------------------------------------------

    def _append_log(self, entry: Mapping[str, Any]) -> None:
        self._log.write(json.dumps(entry).encode("utf-8") + b"\n")
        self._log.flush()
        if self.fsync:
            os.fsync(self._log.fileno())
        self._log_lines += 1

    def _apply(self, entry: Mapping[str, Any]) -> None:
        stream = entry["stream"]
        batch = entry["batch"]
        ids = self._ids.setdefault(stream, _Committed())
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
        tmp = self.root / "committed.json.tmp"
        tmp.write_text(json.dumps(snap))
        if self.fsync:
            _fsync_file(tmp)
        os.rename(tmp, self.root / "committed.json")
        if self.fsync:
            _fsync_dir(self.root)
        self._log.truncate(0)
        self._log.seek(0)
        if self.fsync:
            os.fsync(self._log.fileno())
        self._log_lines = 0

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
                    self._ids[s] = _Committed.restore(obj)
            except (ValueError, TypeError, AttributeError) as e:
                raise ConsumerStateError(f"{snap_path} is corrupt: {e}") from e
        self._replay_log(root / "committed.log")
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
                except (ValueError, OSError) as e:
                    raise ConsumerStateError(
                        f"published folder {entry} is not a consumer batch: {e}"
                    ) from e
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
                            "rows": int(manifest["rows"]),
                            "query": manifest.get("query"),
                        }
                    )
                self._published[stream, batch] = _Published(
                    stream, batch, seq, int(manifest["rows"]), entry
                )
        if roll_forward:
            with open(root / "committed.log", "ab") as out:
                for line in sorted(roll_forward, key=lambda x: int(x["seq"])):
                    log.warning(
                        "consumer: batch %r of stream %r was published but not logged; "
                        "rolled forward",
                        line["batch"],
                        line["stream"],
                    )
                    out.write(json.dumps(line).encode("utf-8") + b"\n")
                    self._apply(line)
                    self._log_lines += 1
                out.flush()
                if self.fsync:
                    os.fsync(out.fileno())
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

    def _replay_log(self, path: Path) -> None:
        if not path.exists():
            return
        data = path.read_bytes()
        lines = data.split(b"\n")
        good_end = 0
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if last and not line:
                break
            final = last or (i == len(lines) - 2 and not lines[-1])
            try:
                if last:  # no newline: a torn append
                    raise ValueError("no newline")
                entry = json.loads(line)
                self._apply(entry)
            except (ValueError, KeyError, TypeError) as e:
                if final:  # the last append, never acknowledged: cut it off
                    log.warning("consumer: cutting a torn last line off %s (%s)", path, e)
                    break
                raise ConsumerStateError(f"{path} line {i + 1} is corrupt: {e}") from e
            good_end += len(line) + 1
            self._log_lines += 1
        if good_end != len(data):
            with open(path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())


# ---------------------------------------------------------------------------- clients


def _client_port(
    ctx: zmq.Context[zmq.Socket[bytes]] | None,
    endpoint: str,
    mode: str | None,
    curve: tuple[bytes, bytes, bytes] | None,
    timeout: float,
) -> ClientPort:
    kw = client_kwargs(curve)
    port = ClientPort(
        ctx or zmq.Context.instance(),
        mode=mode,
        linger_ms=0,
        send_timeout_ms=timeout * 1000,
        on_bad_message="raise",
        **kw,
    )
    try:
        port.connect(endpoint)
    except BaseException:
        port.close(linger_ms=0)
        raise
    return port


def send_command(
    endpoint: str,
    command: str,
    stream: str,
    batch: BatchId,
    partitions: Iterable[tuple[int, int, int]] = (),
    *,
    query: str | None = None,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    mode: str | None = None,
    curve: tuple[bytes, bytes, bytes] | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Send ``commit`` or ``abort`` to a consumer and return its ``ok`` reply.

    ``curve`` is ``(server public key, our public key, our secret key)``.

    Raises
    ------
    CommandError
        If the consumer answers ``result: error``, or is not a zio-spark consumer (it
        accepted the command's BOT).
    TransportError
        If no reply came within ``timeout`` (names the endpoint).
    """
    attrs: dict[str, Any] = {
        "stream": stream,
        "batch": batch,
        "command": command,
        "partitions": [list(p) for p in partitions],
    }
    if query is not None:
        attrs["query"] = query
    port = _client_port(ctx, endpoint, mode, curve, timeout)
    try:
        ep = FlowEndpoint(port, Role.CLIENT)
        try:
            ep.connect(Direction.EXTRACT, 1, attrs, timeout=timeout)
        except FlowRejected as e:
            reply = e.attrs
        except TransportError as e:
            raise TransportError(
                f"consumer did not answer {command} of batch {batch!r} (stream {stream!r}) "
                f"within {timeout:g} s",
                endpoint=endpoint,
            ) from e
        else:
            with contextlib.suppress(ZioSparkError):
                ep.send_eot(timeout=min(timeout, 2.0))
            raise CommandError(
                endpoint,
                command,
                "the peer accepted a command BOT: it is a plain ZIO taker, not a zio-spark "
                "consumer",
            )
    finally:
        port.close(linger_ms=0)
    if reply.get("result") != "ok":
        raise CommandError(endpoint, command, str(reply.get("reason", reply)))
    return reply


class StagingWriter:
    """The giver side of one data flow (what a Spark task runs); blocking.

    The payload format is negotiated (:mod:`zio_spark.protocol.negotiate`: the client
    offers, the server states). The BOT offers ``encoding`` as a list: ``["arrow",
    "record"]`` for ``format="auto"``, ``["arrow"]`` or ``["record"]`` when explicit. A
    zio-spark :class:`Consumer` names its pick as a scalar ``encoding`` in its reply.
    A reply that names none (a plain ZIO taker: the reference's servers echo the client's
    BOT, so the offered list comes back unchanged) means one record per DAT: ``auto`` and
    ``record`` then send records (:attr:`plain_peer` is set), an explicit ``arrow`` fails
    before any data is sent. The BOT also carries the legacy ``format`` attribute
    (``"arrow"`` for an explicit arrow, else ``"record"``) for consumers older than the
    negotiation: they stage what ``format`` says and state nothing, so they get records.

    Parameters
    ----------
    endpoint
        The consumer.
    stream, batch, partition, attempt
        Where the data goes (see the module docstring).
    format
        ``"auto"`` (Arrow if the consumer states it takes Arrow, else records),
        ``"arrow"`` (:meth:`write_batch`/:meth:`write_payload`) or ``"record"``
        (:meth:`write_record`/:meth:`write_values`). :attr:`format` is the agreed one.
    credit
        Credit offered. Only the credit the consumer actually pays is spent (a C++
        reference server announces the offer whatever it pays).
    timeout
        Longest wait for the consumer: the BOT answer, each credit, the EOT echo.

    Raises
    ------
    TransportError
        If the consumer does not answer the BOT within ``timeout``, or its reply is not
        usable (it picked an encoding that was not offered).
    ConfigError
        ``format="arrow"`` towards a taker that did not state it takes Arrow (names the
        endpoint and the option ``format``).
    CommandError
        If it rejects the flow.
    """

    def __init__(
        self,
        endpoint: str,
        stream: str,
        batch: BatchId,
        partition: int,
        attempt: int = 0,
        *,
        format: str = "auto",
        credit: int = 1000,
        timeout: float = 30.0,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve: tuple[bytes, bytes, bytes] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if format not in WRITER_FORMATS:
            raise ConfigError("format", format, "auto, arrow or record")
        self.endpoint = endpoint
        self.requested = format
        self.format = "arrow" if format == "auto" else format
        self.timeout = timeout
        self.rows = 0
        self.plain_peer = False
        self._port = _client_port(ctx, endpoint, mode, curve, timeout)
        attrs = {
            "stream": stream,
            "batch": batch,
            "partition": partition,
            "attempt": attempt,
            "encoding": list(FORMATS) if format == "auto" else [format],
            "format": "arrow" if format == "arrow" else "record",
            **(extra or {}),
        }
        self._ep = FlowEndpoint(self._port, Role.CLIENT)
        try:
            reply = self._ep.connect(Direction.EXTRACT, credit, attrs, timeout=timeout)
        except FlowRejected as e:
            self._port.close(linger_ms=0)
            raise CommandError(endpoint, "data flow", str(e.attrs.get("reason", e.attrs))) from e
        except TransportError as e:
            self._port.close(linger_ms=0)
            raise TransportError(
                f"consumer did not answer within {timeout:g} s (stream {stream!r}, batch "
                f"{batch!r}, partition {partition}). A plain ZIO taker (such as the "
                "reference's server) serves one flow at a time: a BOT that comes during "
                "another flow ends that flow and goes unanswered. If that is the peer, write "
                "from one partition (df.coalesce(1)) or through a flow broker such as "
                "`zio-spark consume`",
                endpoint=endpoint,
            ) from e
        except BaseException:
            self._port.close(linger_ms=0)
            raise
        try:
            terms = client_terms("giver", attrs, reply.attrs)
        except RemoteProtocolError as e:
            self.fail(f"unusable BOT reply: {e}")
            raise TransportError(
                f"the consumer's BOT reply is not usable: {e}", endpoint=endpoint
            ) from e
        if terms.encoding is not None:
            self.format = terms.encoding
            return
        if format == "arrow":
            self.fail("format=arrow, and this taker did not state that it takes Arrow")
            raise ConfigError(
                "format",
                format,
                f"'auto' or 'record' towards {endpoint}: the taker there did not state "
                "that it takes Arrow (its BOT reply names no encoding: a plain ZIO taker, "
                "such as the reference's), so each Arrow payload would reach it as one "
                "opaque record; nothing was sent",
            )
        self.format = "record"
        self.plain_peer = True  # until its EOT echo says otherwise (see close)

    def _stalled(self, what: str) -> str:
        """``what`` went wrong; towards a plain taker, the likely cause and the fix."""
        if not self.plain_peer:
            return what
        return (
            f"{what}. The taker at {self.endpoint} is a plain ZIO taker (its BOT reply "
            "stated no encoding), and a plain ZIO taker serves one flow at a time: a second "
            "flow's BOT (e.g. another partition of this write) ends the flow in progress "
            "without a word to its giver. Write from one partition (df.coalesce(1)), or "
            "through a flow broker such as `zio-spark consume`"
        )

    def _put(self, payload: tuple[bytes, ...], attrs: Mapping[str, Any] | None = None) -> None:
        try:
            ok = self._ep.put(payload, attrs, timeout=self.timeout)
        except TransportError as e:
            raise TransportError(
                self._stalled(f"no credit from the consumer within {self.timeout:g} s"),
                endpoint=self.endpoint,
            ) from e
        if not ok:
            self._ended()

    def _ended(self) -> None:
        eot = self._ep.peer_eot
        reason = eot.attrs.get("error") if eot is not None else None
        raise TransportError(
            f"the consumer ended the flow: {reason or 'EOT'}", endpoint=self.endpoint
        )

    def _check_format(self, fmt: str) -> None:
        if self.format != fmt:
            raise LocalProtocolError(
                f"this flow sends {self.format!r} DATs (agreed with {self.endpoint}), not {fmt!r}",
                field="format",
                value=fmt,
            )

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Send one record batch of :data:`CONSUMER_SCHEMA` as one DAT (``format=arrow``)."""
        self._check_format("arrow")
        self._put((encode_payload(batch),))
        self.rows += batch.num_rows

    def write_payload(self, payload: bytes, rows: int) -> None:
        """Send an already encoded ``format=arrow`` payload holding ``rows`` rows."""
        self._check_format("arrow")
        self._put((payload,))
        self.rows += rows

    def write_record(
        self,
        value: bytes,
        key: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send one record as one DAT (``format=record``); without a key and headers its
        label is the bare ``{"flow": "DAT"}`` a reference taker expects."""
        self._check_format("record")
        attrs: dict[str, Any] = {}
        if key is not None:
            attrs["key"] = base64.b64encode(key).decode("ascii")
        if headers:
            attrs["headers"] = dict(headers)
        self._put((value,), attrs or None)
        self.rows += 1

    def write_values(self, values: Sequence[bytes]) -> None:
        """Send records without key or headers, one bare DAT each (``format=record``),
        a credit run at a time."""
        self._check_format("record")
        try:
            sent = self._ep.put_many([(v,) for v in values], timeout=self.timeout)
        except TransportError as e:
            self.rows += e.sent or 0
            raise TransportError(
                self._stalled(f"no credit from the consumer within {self.timeout:g} s"),
                endpoint=self.endpoint,
            ) from e
        self.rows += sent
        if sent < len(values):
            self._ended()

    def close(self) -> int:
        """Send EOT and wait for the echo (the partition is then durably staged).

        Returns the row count the consumer confirmed (what was sent, for a plain peer).

        Raises
        ------
        TransportError
            If the echo does not come within the timeout, reports an error, or counts
            a different number of rows than were sent.
        """
        try:
            eot = self._ep.send_eot(timeout=self.timeout)
        except TransportError as e:
            raise TransportError(
                self._stalled(f"the consumer did not confirm staging within {self.timeout:g} s"),
                endpoint=self.endpoint,
            ) from e
        finally:
            self._port.close(linger_ms=0)
        if eot.attrs.get("error") is not None:
            raise TransportError(
                f"the consumer could not stage the partition: {eot.attrs['error']}",
                endpoint=self.endpoint,
            )
        rows = eot.attrs.get("rows")
        if rows is None:
            self.plain_peer = True  # a plain ZIO taker: no staging, no commit
            return self.rows
        self.plain_peer = False  # a consumer older than the encoding negotiation
        if rows != self.rows:
            raise TransportError(
                f"the consumer staged {rows} rows, {self.rows} were sent", endpoint=self.endpoint
            )
        return self.rows

    def fail(self, reason: str) -> None:
        """Give up: tell the consumer to discard what was sent (best effort), close."""
        try:
            with contextlib.suppress(ZioSparkError, zmq.ZMQError):
                self._ep.send_eot({"error": reason[:500]}, timeout=min(self.timeout, 2.0))
        finally:
            self._port.close(linger_ms=0)
