"""The sink's consumer: durable staging, atomic publish, committed batch ids.

Theory of operation (DESIGN.md, "The sink"; specs/zio-flow.txt):

**Data flows.** Every Spark task of ``df.writeStream.format("zio")`` opens a ZIO flow
towards the consumer as the *client giver*::

    BOT{direction:"extract", credit, stream, spark_batch, partition, attempt, encoding:[...]}

``spark_batch`` is Spark's micro-batch id (an int) or, for ``df.write``, a string chosen
on the driver; ``encoding`` lists the payload formats the sink offers, in its order of
preference: ``"arrow"`` (each DAT payload is one Arrow IPC stream holding one record
batch of :data:`~zio_spark.codec.schema.SINK_SCHEMA`) and/or ``"record"`` (one record
per DAT, read by :func:`~zio_spark.codec.records.decode_plain`: the payload frame is the
value, DAT attributes ``key`` (base64 text) and ``headers`` (an object of strings)).
The consumer answers ``BOT{direction:"inject", encoding:<its pick>}`` (the client
offers, the server states: :mod:`zio_spark.protocol.negotiate`; a reference server would
echo the list instead, which is how a sink tells a plain ZIO taker) with a credit no
larger than its own cap (``credit`` for arrow flows, ``record_credit`` for record flows)
and hands the credit out. A BOT without ``encoding`` (a sink older than the negotiation)
names its format in ``format``, and gets no ``encoding`` back.

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

    BOT{direction:"extract", credit:1, stream, spark_batch, command:"commit"|"abort",
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
  the commit point** -- then a record is appended to ``committed.log`` and fsync'd, and
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

The vocabulary (attributes, checks, replies) is :mod:`zio_spark.protocol.sink`, which
also reads the ``batch`` that sinks before ``spark_batch`` sent.

**Plain ZIO givers.** A data flow whose BOT has no ``spark_batch`` (any ZIO peer that knows
nothing of Spark; ``stream`` defaults to ``"zio"``, the format to ``"record"``) is
published by the consumer itself, as batches with string ids ``flow-...``: whenever
``plain_batch_rows`` records or ``plain_batch_seconds`` have accumulated, and at EOT.
That is at-least-once (a plain giver has no batch ids to deduplicate).

**Crash safety** (all files under ``path``; one process per folder, ``flock`` on
``LOCK``). On open, deterministically:

1. ``published/<stream>/*.tmp`` folders are deleted (a publish that had not reached its
   commit point; the staged files are still in place, so a retried commit succeeds).
2. A published folder whose batch is missing from the committed log is *rolled
   forward*: its manifest's entry is appended to the log. (The rename was the commit
   point; the writer's retry, or Spark re-running the batch, then gets ``ok``.)
3. A committed-log entry without a published folder means the application acked it
   (or it had no rows): nothing to do.
4. Staging of committed batches, and every ``.part`` file (their flows died with the
   previous process), are deleted; complete ``.arrow`` files stay for a later commit.
5. A torn last record of ``committed.log`` (crash during the append, never fsync'd, so
   never acknowledged) is cut off. Corruption anywhere else raises
   :class:`ConsumerStateError`: forgetting committed ids would publish duplicates. The
   log is CRC-framed (:class:`~zio_spark.storage.sink_folder.CommittedLog`); a JSON-lines
   log of an earlier version is read by the same rule and rewritten framed.
6. ``trash/`` (acked folders being deleted) is emptied.

**Committed ids** are kept per stream: int ids as sorted disjoint ranges (Spark's ids
are consecutive, so this is one or a few ranges whatever the run length), string ids
(``df.write``, plain flows) the most recent
:data:`~zio_spark.storage.sink_folder.STRING_IDS_KEPT` per stream. Every
:data:`~zio_spark.storage.sink_folder.COMPACT_EVERY` commits the log is folded into
``committed.json`` (written to a temporary name, fsync'd, renamed) and emptied;
opening replays the snapshot and then the log, so a crash between the two steps is
harmless.

**Application API**: :meth:`Consumer.published` (commit order), :meth:`Consumer.read`
(Arrow record batches), :meth:`Consumer.records`, :meth:`Consumer.ack` (deletes the
published data; the committed id stays remembered).

Threads: the flow server thread owns staging and runs commands; application calls take
the same lock as commands, briefly. A commit (links and fsyncs) and an EOT (one fsync)
run in the server thread, so they delay other flows for their duration.

Modules: this one is the server (:class:`Consumer` and its flow handler), and maps the
folder's typed outcomes to the command replies (:func:`commit_reply`,
:func:`abort_reply`); the folder, staging files and committed ids are
:mod:`zio_spark.storage.sink_folder` (no sockets); the client that Spark's executors and
driver run is :mod:`zio_spark.sink.client`; the pay-back rule is
:class:`~zio_spark.protocol.credit.QuarterWindow`.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import zmq

from zio_spark.codec.records import decode_payload, decode_plain
from zio_spark.errors import ConfigError, RemoteProtocolError, ZioSparkError
from zio_spark.options import ZreOptions
from zio_spark.protocol.credit import QuarterWindow
from zio_spark.protocol.flow import BotReceived, Data, Direction, EotReceived
from zio_spark.protocol.sink import BatchId, error_reply, parse_command, parse_data_bot
from zio_spark.storage.sink_folder import (
    Aborted,
    AlreadyCommitted,
    CommitOutcome,
    CommitRefused,
    ConsumerRecord,
    ConsumerStateError,
    SinkFolder,
    Stage,
)
from zio_spark.transport.curve import optional_server_curve
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.port import ServerPort

if TYPE_CHECKING:
    from zio_spark.transport.zre_node import ZreNode

__all__ = ["BatchId", "Consumer", "ConsumerRecord", "ConsumerStateError"]

log = logging.getLogger("zio_spark.consumer")


# -------------------------------------------------------------------------- handlers


class _DataHandler(FlowHandler):
    """Serves one client flow: a data flow to stage, or a command to answer."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.stage: Stage | None = None
        self.key: tuple[str, BatchId, int, int] | None = None
        self.format = "arrow"
        self.stream = ""
        self.plain = False
        self.plain_rows = 0
        self.dead: str | None = None
        self.pay_rule: QuarterWindow | None = None

    # -- BOT -------------------------------------------------------------------------

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        c = self.consumer
        attrs = bot.attrs
        if bot.direction is not Direction.EXTRACT:
            c.stats["rejected"] += 1
            conn.reject(error_reply("this consumer only takes data: send BOT extract"))
            return
        if "command" in attrs:
            conn.reject(c._command(attrs))
            return
        try:
            reply = self._open(attrs)
        except RemoteProtocolError as e:
            c.stats["rejected"] += 1
            log.warning("consumer: rejecting flow from %s: %s", conn.name, e)
            conn.reject(error_reply(str(e)))
            return
        cap = c.credit if self.format == "arrow" else c.record_credit
        window = min(bot.credit, cap)
        self.pay_rule = QuarterWindow(window)
        conn.accept(window, reply)
        conn.pay()

    def _open(self, attrs: Mapping[str, Any]) -> dict[str, Any] | None:
        """Set up staging for the flow; returns the attributes of our BOT reply."""
        c = self.consumer
        flow = parse_data_bot(attrs)
        self.stream = flow.stream
        self.format = flow.format
        if flow.batch is None:
            self.plain = True
            self._new_plain_stage()
            c.stats["plain_flows"] += 1
            return flow.reply
        self.key = (flow.stream, flow.batch, flow.partition, flow.attempt)
        previous = c._active.get(self.key)
        if previous is not None and previous is not self:
            previous._supersede()
        c._active[self.key] = self
        self.stage = c.folder.new_stage(*self.key)
        c.stats["data_flows"] += 1
        return flow.reply

    def _new_plain_stage(self) -> None:
        c = self.consumer
        self.key = (self.stream, f"flow-{uuid.uuid4().hex}", 0, 0)
        self.stage = c.folder.new_stage(*self.key)

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
            stage.add_record(*decode_plain(data.message.payload, data.attrs))
        self.consumer.stats["dats"] += 1
        if self.plain and stage.pending >= self.consumer.plain_batch_rows:
            self._roll()
        # The DAT is in the page cache: its credit may go back (backpressure point).
        assert self.pay_rule is not None
        pay = self.pay_rule.to_pay(conn.flow.credit)
        if pay:
            conn.pay(pay)

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
        self.plain_batch_rows = plain_batch_rows
        self.plain_batch_seconds = plain_batch_seconds
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
        self._active: dict[tuple[str, BatchId, int, int], _DataHandler] = {}
        self._closed = False
        self._zre: ZreNode | None = None
        self.folder = SinkFolder(path, fsync=fsync, fault_hook=fault_hook)
        self.root = self.folder.root
        try:
            port = ServerPort(
                ctx or zmq.Context.instance(),
                mode=mode,
                linger_ms=linger_ms,
                curve=optional_server_curve(curve_secret_key),
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
    def fault_hook(self) -> Callable[[str, str, BatchId], None] | None:
        """The test hook (see the class docstring); settable while serving."""
        return self.folder.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, str, BatchId], None] | None) -> None:
        self.folder.fault_hook = hook

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

    def advertise(
        self,
        group: str | ZreOptions,
        *,
        beacon_port: int | None = None,
        broadcast: str | None = None,
        interface_addr: str | None = None,
        interval: float | None = None,
    ) -> None:
        """Join ZRE ``group`` and advertise this consumer's flow port in it.

        A sink with ``option("group", group)`` then spreads its partitions over the
        consumers advertised there. ``group`` is a group name with the ZRE settings
        beside it (those not given: :class:`~zio_spark.options.ZreOptions`' defaults), or
        one ``ZreOptions`` (then no keyword). The node stops with :meth:`close`.

        Raises
        ------
        ZioSparkError
            If the consumer is closed or already advertised.
        ConfigError, TransportError
            As :func:`~zio_spark.transport.discovery.advertise`; ConfigError also for a
            settings keyword beside a ``ZreOptions``.
        """
        from zio_spark.transport.discovery import advertise, zre_options

        if self._closed:
            raise ZioSparkError("the consumer is closed")
        if self._zre is not None:
            raise ZioSparkError("the consumer is already advertised")
        zre = zre_options(
            group,
            beacon_port=beacon_port,
            broadcast=broadcast,
            interface=interface_addr,
            interval=interval,
            interface_option="interface_addr",
        )
        self._zre = advertise(zre, self.endpoint, self.server.port.socket_type)

    def _release(self) -> None:
        self.folder.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- application API -------------------------------------------------------------

    def published(self, stream: str | None = None) -> list[tuple[str, BatchId]]:
        """Published, not yet acked batches as ``(stream, batch)``, in commit order."""
        return self.folder.published(stream)

    def is_committed(self, stream: str, batch: BatchId) -> bool:
        """True if ``batch`` of ``stream`` was committed (published, acked or empty)."""
        return self.folder.is_committed(stream, batch)

    def rows(self, stream: str, batch: BatchId) -> int:
        """Number of rows of a published batch.

        Raises
        ------
        LocalProtocolError
            If the batch is not published (never committed, or acked).
        """
        return self.folder.rows(stream, batch)

    def read(self, stream: str, batch: BatchId) -> Iterator[pa.RecordBatch]:
        """The published batch's records as Arrow batches of
        :data:`~zio_spark.codec.schema.SINK_SCHEMA`, partition by partition.

        Raises
        ------
        LocalProtocolError
            If the batch is not published (never committed, or acked).
        """
        return self.folder.read(stream, batch)

    def records(self, stream: str, batch: BatchId) -> Iterator[ConsumerRecord]:
        """The published batch's records one by one (value, key, headers).

        Raises
        ------
        LocalProtocolError
            If the batch is not published.
        """
        return self.folder.records(stream, batch)

    def ack(self, stream: str, batch: BatchId) -> None:
        """Delete a published batch's data; its id stays committed. Idempotent.

        Raises
        ------
        LocalProtocolError
            If the batch was never committed.
        """
        self.folder.ack(stream, batch)

    # -- commands (server thread) ----------------------------------------------------

    def _command(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            cmd = parse_command(attrs)
            if cmd.command == "commit":
                return self._commit(cmd.stream, cmd.batch, cmd.partitions, cmd.query)
            self.stats["aborts"] += 1
            return abort_reply(self.folder.abort(cmd.stream, cmd.batch))
        except RemoteProtocolError as e:
            self.stats["commit_errors"] += 1
            return error_reply(str(e))
        except Exception as e:  # disk trouble, hook failures: reported, never silent
            self.stats["commit_errors"] += 1
            log.warning(
                "consumer: %s of %r failed: %r", attrs.get("command"), attrs.get("spark_batch"), e
            )
            return error_reply(f"{type(e).__name__}: {e}")

    def _commit(
        self,
        stream: str,
        batch: BatchId,
        parts: Sequence[tuple[int, int, int]],
        query: str | None,
    ) -> dict[str, Any]:
        """Every commit, a command's or a plain flow's (a subclass may watch them): the
        folder's outcome as the command's reply; disk trouble and the fault hook's
        exceptions propagate."""
        try:
            outcome = self.folder.commit(stream, batch, parts, query)
        except CommitRefused as e:
            self.stats["commit_errors"] += 1
            return error_reply(e.reason)
        if isinstance(outcome, AlreadyCommitted):
            self.stats["duplicate_commits"] += 1
        else:
            self.stats["commits"] += 1
            if outcome.published:
                self.stats["published"] += 1
            self.folder.fault("after_publish", stream, batch)
        return commit_reply(outcome)


def commit_reply(outcome: CommitOutcome) -> dict[str, Any]:
    """The wire reply to a commit that succeeded (``result: ok``)."""
    if isinstance(outcome, AlreadyCommitted):
        return {"result": "ok", "published": False, "reason": "already committed"}
    return {"result": "ok", "published": outcome.published, "rows": outcome.rows}


def abort_reply(outcome: Aborted) -> dict[str, Any]:
    """The wire reply to an abort (always ``result: ok``)."""
    if not outcome.discarded:
        return {"result": "ok", "reason": "already committed; nothing to discard"}
    return {"result": "ok"}
