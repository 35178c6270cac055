"""The queue's ZIO flow ports: a durable hub between Spark and PZQ peers.

Theory of operation (DESIGN.md "The PZQ-style queue"; FACTS.md "PySpark" for when
Spark commits)
------------------------------------------------------------------------------------
Both ports run inside the broker (:class:`~zio_spark.pzq.broker.QueueBroker`, options
``flow_producer`` / ``flow_consumer``), and everything that touches the
:class:`~zio_spark.storage.store.MessageStore` runs in the broker's thread.

**Flow producer port** (:class:`FlowProducerPort`; Spark sources connect to it:
``readStream.format("zio").option("endpoints", <port>)``). An ack-capable ZIO giver in
the zio-spark profile, like :class:`~zio_spark.source.producer.Producer`, but backed by
the store instead of memory:

- Its producer id is ``queue:<queue id>`` (the id kept in the store folder), stable
  across restarts. Messages get a contiguous sequence number 1, 2, 3, ... in the order
  they are taken from the store (store order: requeued ones first, then oldest first).
- A message is *assigned* to the flow by taking it from the store (``take(pin=True)``:
  PZQ consumers no longer get it, and compaction will not move it, so its store key
  stays valid). The assignment ``seq -> store key`` is appended to a side log,
  ``flow-producer.log`` in the store folder, and the log is ``fdatasync``'d (one sync
  per batch of assignments, group commit) *before* any DAT carrying it is sent.
- DAT payload: one Arrow IPC frame (:func:`zio_spark.codec.records.encode_records`): value =
  the PZQ body, key = the PZQ message id. A multi-part body is joined with czmq's
  framing (:func:`~zio_spark.protocol.message.join_single`) and the record gets the
  header ``zio.frames: <parts>`` (what the source does for multi-frame plain DATs), so
  nothing is lost; a one-part body is the value as is.
- A PAY's ``ack: N`` (Spark committed everything up to N) acks the store messages of
  seqs <= N: only now do they leave the store. An ``ACK N`` record goes to the side log.
- BOT ``resume: R`` (what the taker's spool already holds): sending starts at
  ``max(R, acked) + 1``; assignments up to R stay until a PAY acks them.
- Restart: the side log is replayed; every assigned key is taken back with
  :meth:`~zio_spark.storage.store.MessageStore.claim` before the broker serves anybody.
  Seqs above the logged ack are given again to a resuming taker (which drops what it
  holds); seqs at or below it whose store tombstone was lost in the crash are acked
  again. The side log is rewritten (temporary file, synced, renamed) to hold only the
  unacked assignments once it passes :data:`LOG_REWRITE_BYTES` and every store
  tombstone is durable, so it stays bounded by the unacked window.
- At most ``window`` messages are assigned and unacked at a time, and nothing is
  assigned while no taker is attached or it has no credit: with no Spark source
  connected, PZQ consumers get everything. The port's table of them holds ints only
  (seq -> store key: a dict of ints the garbage collector never tracks, so a full
  collection does not visit the window); the bodies a taker's take read are held only
  until a DAT carries them, and a resend reads them back from the store by their pinned
  keys (:meth:`~zio_spark.storage.store.MessageStore.read_taken_run`), as a range does.
- One taker at a time: a new BOT replaces the previous flow (a restarted Spark runner).
  Takers without ``ack: true`` are rejected: this port is exactly-once only. The
  taker's flow sends at most :data:`TAKER_TURN_DATS` DATs per broker loop turn, the
  rest of what its credit paid for in the next turns (as a range flow does), so one
  PAY does not hold the queue's PZQ peers and other flows for the whole of it.
- **Direct reads** (``readMode=direct``, docs/direct-read.md "The queue's flow
  producer"): the port is a :class:`~zio_spark.source.range_serving.RangeSource`, so its
  handlers are :class:`~zio_spark.source.range_serving.ProducerFlowHandler`'s: every BOT
  it writes states ``ranges: 1`` and the side log's incarnation (drawn when the log is
  made, kept by every replay: it names exactly this seq -> store key numbering), a
  ``read: "range"`` flow is served ranges and a ``read: "control"`` flow held queries
  and commits. A held query first assigns what the store has ready (up to ``window``
  unacked, durable in the side log before the answer names it), since no taker pulls
  them, at most :data:`HELD_SLICE` messages per broker loop turn (the answer waits for
  the last slice; the broker serves its other sockets in between). The numbering reads
  no record (:meth:`MessageStore.take_keys`) and syncs the side log once, with its last
  slice: until then what it numbered is shown to nobody (the window ends before it; a
  taker's flow syncs first). The window is ``[lowest assigned unacked seq, next
  durable seq)``. A range's records are read back from the store by their pinned keys
  (:meth:`MessageStore.read_taken_run`: neighbouring records in one ``pread``, each
  checked, length and CRC, before it is used: where a record damaged on disk is
  caught), not from memory: assignments made for a held query keep no body. Each range
  flow sends at most :data:`RANGE_TURN_DATS` DATs per loop turn, the rest in the next
  turns. A seq whose message is gone from the store or fails its check (a
  hole) is never skipped in a range: the range is refused ``not_held``. A commit acks
  through :meth:`FlowProducerPort.ack`, exactly as a taker's PAY ``ack`` does. The port
  never renumbers, so its incarnation changes only with a new side log.
- **Run keys** (CURVE, docs/direct-read.md "Security"): with ``gate`` (the broker's ZAP
  handler: its own from ``curve_allowed_client_keys``, or the application's passed as
  ``QueueBroker(authenticator=...)``), the port does what a bound producer with an
  allow-list does: a driver's ``admit`` leases its run key on that handler while its
  control flow lives (answered ``admitted``), and each BOT is judged by the key of the
  connection it came on (a list key opens any flow, a run key range reads only, any
  other key none). Without a gate ``admit`` is answered ``open``: the port cannot tell
  the context's handler, if any, about the run key, so such a handler would refuse the
  tasks (a ZAP handler of pyzmq's own on the queue's context is such a case: pass a
  :class:`~zio_spark.transport.curve.CurveAuthenticator` instead). The port's socket
  then has the ZAP domain :data:`FLOW_ZAP_DOMAIN`, and the gate admits leased run keys
  in that domain only (``lease_only_in``): a run key cannot reach the queue's PZQ
  sockets, which the same handler judges by its allow-list alone.
- **Policy when the taker goes away**: its unacknowledged messages *stay assigned* (in
  the store and the side log) until a taker resumes and acks them, across queue
  restarts too. They are never released to PZQ consumers automatically: a resuming
  Spark query may hold them in its spool, and giving them out again would duplicate
  them. (Retiring a source for good is an operator action; see the module's gaps in
  the issue note.)

**Flow consumer port** (:class:`FlowConsumerPort`; Spark sinks write to it:
``writeStream.format("zio").option("endpoint", <port>)``). It runs a sink
:class:`~zio_spark.sink.consumer.Consumer` (staging, commit command, committed batch ids,
atomic publish) on its own folder ``<store>/flow-consumer``, and a *bridge* in the
broker thread that moves each published batch into the store, oldest first: record
``n`` (in the consumer's read order, which is deterministic) becomes the message
``<stream>/<batch>/<n>`` with the record's value as its body (a value with a
``zio.frames`` header is split back into its parts; the key and other headers are not
carried: PZQ messages have no place for them). Once the commit covering the batch's
last put has ended, the batch is acked in the consumer (its files are deleted; its id
stays committed, so a batch Spark re-delivers is ``ok``'d and not published again). A
crash between the store commit and that ack re-moves the batch after the restart; the
store's duplicate window drops the ids already stored, so the move is idempotent for
batches up to ``dedup_window`` records (ids longer than
:data:`~zio_spark.storage.store.MAX_ID_BYTES` are shortened to a hash of
``<stream>/<batch>`` plus ``/<n>``).

Monitor counters: ``flow_given`` (messages assigned to the flow), ``flow_acked``
(acknowledged by the taker, so deleted from the store), ``flow_stored`` (records moved
from the sink consumer into the store, duplicates excluded).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import zmq

from zio_spark.errors import ConfigError, RemoteProtocolError, TransportError
from zio_spark.options import (
    DEFAULT_CONN_CHECK,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    Curve,
    conn_check_seconds,
    heartbeat_millis,
)
from zio_spark.protocol.flow import FlowState
from zio_spark.protocol.message import join_single, split_single
from zio_spark.sink.consumer import BatchId, Consumer
from zio_spark.source.range_serving import HeldView, RangeService
from zio_spark.storage.flow_log import FlowLog
from zio_spark.storage.store import MAX_ID_BYTES, MessageRejected, MessageStore, StoreError
from zio_spark.transport.curve import CurveAuthenticator
from zio_spark.transport.flow_server import FlowServer
from zio_spark.transport.giver import GiverPolicy, Giving, Taken
from zio_spark.transport.port import ServerPort

__all__ = [
    "DEFAULT_FLOW_WINDOW",
    "FLOW_ZAP_DOMAIN",
    "HELD_SLICE",
    "LOG_REWRITE_BYTES",
    "RANGE_TURN_DATS",
    "TAKER_TURN_DATS",
    "FlowConsumerPort",
    "FlowProducerPort",
    "QueueFlows",
    "bridge_message_id",
    "record_from_body",
]

log = logging.getLogger("zio_spark.pzq")

DEFAULT_FLOW_WINDOW: Final = 100_000
"""Most messages assigned to the flow producer port and not yet acknowledged."""

HELD_SLICE: Final = 1024
"""Most messages a held query numbers per broker loop turn (keys only, nothing read; one
side-log sync after the last slice): the rest of the loop (PZQ peers, other flows) runs
between slices."""

RANGE_TURN_DATS: Final = 4
"""Most DATs a range flow sends per broker loop turn (~2.5 ms each at 1000 records of
100 bytes): a range paid for in one PAY is sent over several turns, so the rest of the
loop (PZQ peers, other flows) runs in between, and every range flow with credit sends
every turn."""

TAKER_TURN_DATS: Final = 4
"""Most DATs the taker's flow (spool mode) sends per broker loop turn, as a range flow
(:data:`RANGE_TURN_DATS`): what one PAY's credit pays for (64 DATs of up to 1000
records) goes out over several turns, the queue's other sockets served in between."""

LOG_REWRITE_BYTES: Final = 4 << 20
"""The side log is rewritten to its live assignments once it grows past this."""

FLOW_ZAP_DOMAIN: Final = "zio-spark-queue-flow"
"""The ZAP domain of a gated flow producer port (its run keys are leased in it only)."""

FRAMES_HEADER: Final = "zio.frames"
_MAX_DAT_RECORDS: Final = 1000
_CONSUMER_FOLDER: Final = "flow-consumer"
_LOG_NAME: Final = "flow-producer.log"
_GONE: Final = 0  # store keys are never 0 (segment numbers start at 1)

T = TypeVar("T")

# ------------------------------------------------------------------- body <-> record


def record_from_body(body: tuple[bytes, ...]) -> tuple[bytes, dict[str, str] | None]:
    """A PZQ body as a record value and headers (lossless; see the module docstring)."""
    if len(body) == 1:
        return body[0], None
    return join_single(body), {FRAMES_HEADER: str(len(body))}


def _body_from_record(value: bytes | None, headers: Any) -> tuple[bytes, ...]:
    value = value or b""
    if headers:
        frames = dict(headers).get(FRAMES_HEADER)
        if frames is not None and frames != "1":
            with contextlib.suppress(RemoteProtocolError):
                parts = split_single(value)
                if parts and str(len(parts)) == frames:
                    return tuple(parts)
    return (value,)


def bridge_message_id(stream: str, batch: BatchId, n: int) -> bytes:
    """The store message id of record ``n`` of a sink batch: ``<stream>/<batch>/<n>``."""
    mid = f"{stream}/{batch}/{n}".encode()
    if len(mid) <= MAX_ID_BYTES:
        return mid
    digest = hashlib.sha256(f"{stream}/{batch}".encode()).hexdigest()[:40]
    return f"{digest}/{n}".encode()


# ------------------------------------------------------------------ the flow server


def _check_endpoint(option: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(option, value, "an endpoint string")
    return value


# -------------------------------------------------------------- flow producer port


class _StoreView:
    """The port's held window and records as range flows read them (a
    :class:`~zio_spark.source.range_serving.HeldView`; bodies come from the store)."""

    __slots__ = ("_port",)

    def __init__(self, port: FlowProducerPort) -> None:
        self._port = port

    @property
    def first(self) -> int:
        return self._port.held_first

    @property
    def next_seq(self) -> int:
        return self._port.next_seq

    def take(self, first: int, n: int, max_bytes: int | None = None) -> Taken | None:
        seq, ids, bodies = self._port._records(first, n, max_bytes)
        return _taken(seq, ids, bodies) if bodies else None


def _taken(first: int, ids: list[bytes | None], bodies: list[tuple[bytes, ...]]) -> Taken:
    """Contiguous assigned messages from seq ``first`` (their PZQ ``ids`` and
    ``bodies``) as the records of one DAT."""
    headers: list[Mapping[str, str] | None] | None = None
    try:
        values = [value for (value,) in bodies]  # one-part bodies: the value as is
    except ValueError:  # a multi-part body: joined, with its zio.frames header
        values = []
        headers = []
        for body in bodies:
            value, hdrs = record_from_body(body)
            values.append(value)
            headers.append(hdrs)
    return Taken(first, values, ids, None, headers)


class FlowProducerPort:
    """The queue's giver port for Spark sources (see the module docstring).

    Broker thread only. Opening replays the side log and claims the assigned messages
    from ``store``, so make it before anything else takes from the store.

    Parameters
    ----------
    store
        The broker's open store.
    endpoint
        Endpoint to bind.
    ctx
        zmq context for the port.
    window
        Most messages assigned and not yet acknowledged (their store keys are in
        memory; their bodies only from a taker's take until a DAT carries them).
    max_take
        Most messages taken from the store per loop turn.
    held_slice
        Most messages numbered for held queries per loop turn (:meth:`prepare_held`).
    range_turn_dats
        Most DATs each range flow sends per loop turn (:data:`RANGE_TURN_DATS`).
    taker_turn_dats
        Most DATs the taker's flow sends per loop turn (:data:`TAKER_TURN_DATS`).
    sync
        ``fdatasync`` the side log (False: tests and benchmarks only).
    mode, curve, linger_ms
        For the :class:`~zio_spark.transport.port.ServerPort` (``curve``: the broker's,
        a bound port's :class:`~zio_spark.options.Curve`; None: no CURVE).
    gate
        The running ZAP handler of ``ctx`` that admits this port's CURVE clients (needs
        ``curve``): drivers lease their run keys on it and flows are bound to keys, as
        on a producer with an allow-list (module docstring, "Run keys"). None: ``admit``
        is answered ``open`` and any client that got in opens any flow.
    heartbeat_interval, heartbeat_timeout, conn_check
        The watch on range and control readers' connections, as the bound
        :class:`~zio_spark.source.producer.Producer`'s keywords of these names (same
        defaults; errors name the queue's options ``flow_heartbeat_interval``,
        ``flow_heartbeat_timeout``, ``flow_conn_check``): a flow whose reader vanished
        without EOT (a task SIGKILLed, a driver lost) ends, nothing acked
        (``range_stats["range_flows_gone"]``, ``["control_flows_gone"]``).

    Raises
    ------
    ConfigError
        For a bad option.
    TransportError
        If the endpoint cannot be bound.
    OSError
        If the side log cannot be read or written.
    """

    def __init__(
        self,
        store: MessageStore,
        endpoint: str,
        *,
        ctx: zmq.Context[Any],
        window: int = DEFAULT_FLOW_WINDOW,
        max_take: int = 4096,
        held_slice: int = HELD_SLICE,
        range_turn_dats: int = RANGE_TURN_DATS,
        taker_turn_dats: int = TAKER_TURN_DATS,
        sync: bool = True,
        mode: str | None = None,
        curve: Curve | None = None,
        linger_ms: int = 500,
        gate: CurveAuthenticator | None = None,
        heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT,
        conn_check: float = DEFAULT_CONN_CHECK,
    ) -> None:
        _check_endpoint("flow_producer", endpoint)
        heartbeat_ms = heartbeat_millis(
            heartbeat_interval,
            heartbeat_timeout,
            names=("flow_heartbeat_interval", "flow_heartbeat_timeout"),
        )
        conn_check = conn_check_seconds(conn_check, "flow_conn_check")
        if gate is not None and curve is None:
            raise ConfigError(
                "gate",
                "<CurveAuthenticator>",
                "None without CURVE (curve_secret_key): a ZAP handler judges CURVE clients only",
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError("flow_window", window, "an integer >= 1")
        if isinstance(held_slice, bool) or not isinstance(held_slice, int) or held_slice < 1:
            raise ConfigError("held_slice", held_slice, "an integer >= 1")
        if (
            isinstance(taker_turn_dats, bool)
            or not isinstance(taker_turn_dats, int)
            or taker_turn_dats < 1
        ):
            raise ConfigError("taker_turn_dats", taker_turn_dats, "an integer >= 1")
        self.store = store
        self.window = window
        self.max_take = max_take
        self.held_slice = held_slice
        self._slice_left = held_slice  # numbering left for held queries this loop turn
        self._numbering = False  # a held query waits for more numbering
        self._ranges_waiting = False  # a range flow has DATs left for the next turn
        self.taker_turn_dats = taker_turn_dats
        self._taker_left = taker_turn_dats  # DATs the taker's flow may take this turn
        self._taker_stopped = False  # this turn's budget stopped the taker's flow
        self._taker_waiting = False  # it has credit and DATs left for the next turn
        self.taker_turn_sent = 0  # DATs the taker's flow took in the turn just ended
        self.producer_id = f"queue:{store.queue_id.decode('utf-8', 'replace')}"
        self.counters: dict[str, int] = dict.fromkeys(
            ("given", "acked", "resent", "takers", "lost", "reclaimed", "taker_deferred"), 0
        )
        # seq -> store key of every assigned unacked message: ints only, so CPython never
        # tracks the dict and a full GC pass does not visit the window (up to 100k).
        self._table: dict[int, int] = {}
        # seq -> (message id, body) read by a taker's take (_assign keep_body), until a
        # DAT's records take it (_records): one take's worth at most (max_take), not the
        # window.
        self._held: dict[int, tuple[bytes, tuple[bytes, ...]]] = {}
        self._low = 1  # no assigned unacked seq below this (see first)
        self._taker: Giving | None = None
        self.on_renumber: Callable[[], None] | None = None  # never called: no renumbering
        self.range_stats: collections.Counter[str] = collections.Counter()
        self._view = _StoreView(self)
        self._log = FlowLog(store.path / _LOG_NAME, sync=sync)
        try:
            self._next_seq = self._log.next_seq
            self._durable_next = self._next_seq  # seqs from here on: not in the side log yet
            self._acked = self._log.acked
            self._sent_max = self._next_seq - 1  # seqs above were never sent to anybody
            self._reclaim(self._log.assigned)
            self._log.assigned = {}
            if gate is not None:
                # Run keys are leased for this port's handshakes only: the handler
                # judges the queue's PZQ sockets too, where a task has no business.
                gate.lease_only_in(FLOW_ZAP_DOMAIN)
            port = ServerPort(
                ctx,
                mode=mode,
                linger_ms=linger_ms,
                send_timeout_ms=200,
                curve=curve,
                zap_domain=None if gate is None else FLOW_ZAP_DOMAIN,
                # With a gate, the key a client came with decides its flows.
                user_ids=gate is not None,
                # Which connection each range/control flow came on, and heartbeats, so a
                # reader gone without EOT ends its flow (range_serving, "Readers that vanish").
                conn_ids=True,
                heartbeat_ms=heartbeat_ms,
            )
            try:
                self.endpoint = port.bind(endpoint)
            except BaseException:
                port.close(linger_ms=0)
                raise
        except BaseException:
            self._log.close()
            raise
        policy = GiverPolicy(
            self.producer_id,
            None,
            _MAX_DAT_RECORDS,
            require_ack=True,
            plain_refusal="the queue's flow port gives only to ack-capable takers "
            "(BOT ack: true): messages leave the queue when the taker acks them",
        )
        # Range and control flows (direct reads) next to the taker's; the incarnation
        # is the side log's (kept_incarnation).
        # Range DATs go out range_turn_dats per flow and loop turn (pump starts a turn).
        self.ranges = RangeService(
            self, policy, stats=self.range_stats, gate=gate, turn_dats=range_turn_dats
        )
        # Driven inline by the broker's loop: process() and tick(), no thread of its own.
        self._server = FlowServer(
            port,
            self.ranges.handler,
            ctx=ctx,
            name="queue flow producer",
            # A reader (driver's control flow, task, taker) whose flow outlived a previous
            # queue process on this endpoint is told with an EOT, not left to its timeout.
            on_stray=self.ranges.stray_answerer(port),
            # Looked at from tick(), so once per loop turn at most and only when due: the
            # broker's loop turns at least every _TICK_S; a check never makes it busy.
            conn_check=conn_check,
        )

    def _reclaim(self, assigned: dict[int, int]) -> None:
        store = self.store
        for seq in sorted(assigned):
            key = assigned[seq]
            message = None
            if key != _GONE:
                try:
                    message = store.claim(key)
                except StoreError as e:
                    log.error("queue flow: %s", e)
            if seq <= self._acked:
                if message is not None:  # acked by the taker, tombstone lost in a crash
                    store.ack(message.key)
                continue
            if message is None:
                # Cannot happen unless the disk lost data: a hole the taker reports as
                # a sequence gap (DataLossError) if it had not received it yet.
                self.counters["lost"] += 1
                log.error(
                    "queue flow: message %#x assigned to seq %d is no longer in the store",
                    key,
                    seq,
                )
                continue
            self._table[seq] = message.key  # the body is read back when sent
            self.counters["reclaimed"] += 1
        if assigned:
            log.info(
                "queue flow: %d messages still assigned after restart (seqs %d..%d, acked %d)",
                len(self._table),
                min(assigned),
                max(assigned),
                self._acked,
            )

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._server.port.socket

    @property
    def unacked(self) -> int:
        """Messages assigned to the flow and not yet acknowledged."""
        return len(self._table)

    @property
    def next_seq(self) -> int:
        """The held window's end: the first seq not durable in the side log (numbered
        ones beyond it are shown to nobody: :meth:`_sync_numbering`)."""
        return self._durable_next

    @property
    def numbered(self) -> int:
        """The last seq numbered, durable in the side log or not yet."""
        return self._next_seq - 1

    @property
    def acked(self) -> int:
        return self._acked

    @property
    def incarnation(self) -> str:
        """The name of the port's numbering (the side log's; docs/direct-read.md)."""
        return self._log.incarnation

    # -- direct reads: the RangeSource side (broker thread) ----------------------------

    @property
    def kept_incarnation(self) -> str:
        return self._log.incarnation

    @property
    def last_seq(self) -> int:
        return self._durable_next - 1

    @property
    def held_first(self) -> int:
        """The lowest assigned unacked seq still in the store (``next_seq`` if none):
        the held window's front."""
        low = max(self._low, self._acked + 1)
        table = self._table
        if low not in table:
            # Past acked, lost or jumped-over seqs; table keys only grow above _acked.
            low = min(table) if table else self._next_seq
        self._low = low
        return min(low, self._durable_next)

    def prepare_held(self) -> bool:
        """Assign what the store has ready (up to ``window`` unacked), so a held answer
        shows it: in direct mode no taker's credit pulls messages in. At most
        ``held_slice`` messages per broker loop turn (shared by every held query of the
        turn), so the other sockets are served between slices. The store's records are
        not read (:meth:`MessageStore.take_keys`: ranges read and check them), and the
        side log is synced once, when the last slice is numbered: what the slices
        numbered before is kept from takers and range flows until then (``next_seq``).

        Returns True once nothing more is ready (or the window is full), everything
        numbered durable: the answer may go. False: more may be ready; the flow asks
        again at its next tick, and :meth:`busy` keeps the loop turning meanwhile.

        Raises
        ------
        OSError
            If the side log cannot be synced (the numbering not yet durable is undone).
        """
        left = self._slice_left
        if left > 0:
            got = self._assign(left, keep_body=False)
            self._slice_left = left - got
            if got < min(left, self.max_take):
                # The store has nothing more ready, or the window is full.
                self._sync_numbering()
                return True
        self._numbering = True
        return False

    def read_held(self, read: Callable[[HeldView], T]) -> T:
        return read(self._view)  # one thread: the broker's (no lock to take)

    def commit_held(self, step: Callable[[HeldView], tuple[T, int | None]]) -> T:
        out, upto = step(self._view)
        if upto is not None:
            self.ack(upto)
        return out

    def window_full_since(self, mark: int) -> tuple[bool, int]:
        """Full now: the window (``window`` numbered and not acked) is taken up while the
        store holds messages nobody took yet, so the held end is the window's, not the
        store's: a planner then settles its batches at half the window. No sender waits
        on it (PZQ producers wait on the store's acks), so there is no wait to count
        between answers: the state now is the answer (``mark`` unused)."""
        store = self.store
        return len(self._table) >= self.window and store.messages > store.in_flight, mark

    def _lost(self, seq: int, key: int, error: StoreError) -> None:
        """The store cannot give seq ``seq``'s message (store ``key``) back: the seq
        becomes a hole, and its record (if still there: it failed its check) is dropped
        from the store, as :meth:`MessageStore.take` drops one it cannot read (else its
        pin would keep its segment forever)."""
        self._table.pop(seq, None)
        self._held.pop(seq, None)
        with contextlib.suppress(StoreError):
            self.store.ack(key)
        self.counters["lost"] += 1
        log.error("queue flow: seq %d (message %#x) is lost: %s", seq, key, error)

    def _records(
        self, seq: int, n: int, max_bytes: int | None
    ) -> tuple[int, list[bytes | None], list[tuple[bytes, ...]]]:
        """Up to ``n`` contiguous assigned messages from ``seq``: ``seq``, their PZQ ids
        and their bodies (two lists of one length), stopping at a hole or once
        ``max_bytes`` of values were taken (at least one).

        A body a taker's take read (held in memory) is used once and let go: this DAT
        carries it, and a resend reads it back from the store like any other. Messages
        not held in memory are read back from the store a run at a time
        (:meth:`MessageStore.read_taken_run`: one ``pread`` for records side by side,
        each checked, length and CRC, before anything of it is used: this is where a
        record damaged on disk is caught); a message the store cannot give back ends
        the lists there, and asked for first it becomes a hole (counted ``lost``),
        never skipped."""
        get = self._table.get
        keys: list[int] = []
        for s in range(seq, seq + n):
            key = get(s)
            if key is None:
                break
            keys.append(key)
        held = self._held
        ids: list[bytes | None] = []  # None never: Taken's keys may be None in general
        bodies: list[tuple[bytes, ...]] = []
        total = len(keys)
        size = 0
        i = 0
        while i < total and (max_bytes is None or size < max_bytes):
            got = held.pop(seq + i, None) if held else None
            if got is not None:  # read by a taker's take (its id with it): used once
                ids.append(got[0])
                bodies.append(got[1])
                size += sum(map(len, got[1]))
                i += 1
                continue
            j = i + 1
            while j < total and (not held or seq + j not in held):
                j += 1
            try:
                read = self.store.read_taken_run(
                    keys[i:j], None if max_bytes is None else max_bytes - size
                )
            except StoreError as e:
                self._lost(seq + i, keys[i], e)
                break
            ids.extend([m.message_id for m in read])
            bodies.extend([m.body for m in read])
            if len(read) < j - i:
                break  # a byte budget reached, or a message the next read will name
            if j < total and max_bytes is not None:
                size += sum(len(part) for m in read for part in m.body)
            i = j
        return seq, ids, bodies

    def process(self) -> None:
        """The port's socket is readable: dispatch what arrived (broker thread)."""
        self._server.process()

    def pump(self) -> None:
        """Send the taker's DATs of the turn, number a slice for pending held queries,
        send each range flow's DATs of the turn; keep the side log bounded (broker
        thread, once per loop turn: it ends the turn's budgets)."""
        self._numbering = False  # set again by a held query still waiting (prepare_held)
        self._server.tick()
        self._slice_left = self.held_slice  # the next turn's numbering budget
        self.taker_turn_sent = self.taker_turn_dats - self._taker_left
        self._taker_left = self.taker_turn_dats  # the next turn's taker DATs
        self._taker_waiting, self._taker_stopped = self._taker_stopped, False
        self._ranges_waiting = self.ranges.deferred
        self.ranges.new_turn()  # the next turn's range DATs
        store = self.store
        if (
            self._log.size > LOG_REWRITE_BYTES
            and not self._log.dirty
            and not store.dirty
            and not store.committing
        ):
            # Every store tombstone is durable: acknowledged assignments can go.
            live = sorted(self._table.items())
            self._log.rewrite(self._next_seq, self._acked, live)

    def busy(self) -> bool:
        """Whether the next loop turn has work without waiting for input."""
        taker = self._taker
        conn = None if taker is None else taker.conn
        if self._numbering or self._ranges_waiting or self._taker_waiting:
            return True
        return (
            taker is not None
            and conn is not None
            and conn.flow.state is FlowState.READY
            and conn.flow.credit > 0
            and taker.next_seq < self._next_seq
        )

    def close(self) -> None:
        try:
            self._server.close("queue stopped")
        finally:
            self._log.close()

    # -- the giver's backlog (broker thread) -----------------------------------------

    def attach(self, giving: Giving, resume: int | None) -> int:
        """A taker's flow opened (the giver ends the previous one: a restarted runner)."""
        self._sync_numbering()  # the taker may be given any seq numbered
        self._taker = giving
        self.counters["takers"] += 1
        start = self._acked + 1
        if resume is not None:
            if resume >= self._next_seq:
                # The taker holds seqs this queue never assigned (e.g. its spool outlived
                # a wiped side log): continue after them, or new messages would be
                # dropped as duplicates.
                log.warning(
                    "queue flow: taker resumes at %d, beyond the last assigned seq %d; "
                    "continuing from %d",
                    resume,
                    self._next_seq - 1,
                    resume + 1,
                )
                self._next_seq = resume + 1
                self._log.jump(self._next_seq)
                self._log.commit()
                self._durable_next = self._next_seq
            start = max(start, resume + 1)
        log.info(
            "queue flow: taker %s attached (resume %s, acked %d, sending from %d)",
            "" if giving.conn is None else giving.conn.name,
            resume,
            self._acked,
            start,
        )
        return start

    def detach(self, giving: Giving, reason: str) -> None:
        if self._taker is giving:
            self._taker = None
            self._held.clear()  # bodies are in the store: a resuming taker's reads them back
            log.info(
                "queue flow: taker left (%s); %d messages stay assigned", reason, len(self._table)
            )

    def ack(self, ack: int) -> None:
        upto = min(ack, self._durable_next - 1)
        if upto <= self._acked:
            return
        store = self.store
        table = self._table
        done = 0
        if upto - self._acked > len(table):
            seqs: Iterable[int] = sorted(s for s in table if s <= upto)
        else:
            seqs = range(self._acked + 1, upto + 1)
        held = self._held
        for seq in seqs:
            key = table.pop(seq, None)
            if key is not None:
                if held:
                    held.pop(seq, None)
                store.ack(key)
                done += 1
        self.counters["acked"] += done
        self._acked = upto
        self._log.ack(upto)
        self._sync_numbering()  # the ACKED record (and any numbering buffered)

    def _assign(self, wanted: int, *, keep_body: bool = True) -> int:
        """Take up to ``wanted`` messages from the store for the flow and number them.
        ``keep_body``: read them and hold the bodies in memory until a DAT takes them
        (a taker is about to be sent them), durable in the side log on return. Else
        only their keys, their records not read (range reads read and check them), in
        the side log's buffer: the caller makes them durable (:meth:`_sync_numbering`)
        before anybody is shown them."""
        room = self.window - len(self._table)
        n = min(wanted, room, self.max_take)
        if n <= 0 or self.store.failed:
            return 0
        first = self._next_seq
        table = self._table
        store = self.store
        keys: list[int]
        if keep_body:
            held = self._held
            keys = []
            while len(keys) < n:
                try:
                    message = store.take(pin=True)
                except StoreError as e:  # an unreadable record; the store dropped it
                    log.error("queue flow: %s", e)
                    continue
                if message is None:
                    break
                seq = first + len(keys)
                table[seq] = message.key
                held[seq] = (message.message_id, tuple(message.body))
                keys.append(message.key)
        else:
            keys = store.take_keys(n)
            table.update(zip(range(first, first + len(keys)), keys, strict=True))
        if not keys:
            return 0
        self._log.assign(first, keys)
        self._next_seq = first + len(keys)
        self.counters["given"] += len(keys)
        if keep_body:
            self._sync_numbering()
        return len(keys)

    def _sync_numbering(self) -> None:
        """Make every seq numbered durable in the side log (one sync for all the
        slices of a held query), so it may be shown: ``next_seq``, the held window's
        end, moves only here. A seq numbered and not yet durable is shown to nobody (a
        range flow's window ends before it, a taker syncs before it is sent one): a
        crash before the sync leaves its message pending in the store, numbered again
        after the restart, and no reader ever had its number.

        Raises
        ------
        OSError
            If the side log cannot be written or synced: the numbering not yet durable
            is undone (its messages go back to the store, not delivered).
        """
        try:
            self._log.commit()
        except OSError:
            undone = 0
            for seq in range(self._durable_next, self._next_seq):
                key = self._table.pop(seq, None)
                self._held.pop(seq, None)
                if key is not None:
                    self.store.release(key, delivered=False)
                    undone += 1
            self.counters["given"] -= undone
            self._next_seq = self._durable_next
            raise
        self._durable_next = self._next_seq

    def take(self, first: int, n: int, room: int) -> Taken | None:
        """Up to ``n`` assigned messages from seq ``first``, assigning up to ``room``
        more from the store when none is left (a seq acked meanwhile, or lost, is
        skipped; a run stops at such a hole). The taker's flow is the only caller (one
        DAT a call): once it took ``taker_turn_dats`` this loop turn, None (its credit
        waits for the next turn; :meth:`busy` says there is one)."""
        if self._taker_left <= 0:
            self._taker_stopped = True
            self.counters["taker_deferred"] += 1
            return None
        if self._durable_next != self._next_seq:
            self._sync_numbering()  # a held query's numbering, not yet durable
        table = self._table
        seq = first
        while True:
            if seq >= self._next_seq and not self._assign(room):
                return None
            while seq < self._next_seq and seq not in table:
                seq += 1
            if seq < self._next_seq:
                got, ids, bodies = self._records(seq, n, None)
                if bodies:
                    self._taker_left -= 1
                    return _taken(got, ids, bodies)
                # seq's message could not be read back (now a hole): skip it

    def sent(self, first: int, last: int, records: int, dats: int, release: bool) -> None:
        if first <= self._sent_max:
            self.counters["resent"] += min(last, self._sent_max) - first + 1
        self._sent_max = max(self._sent_max, last)

    def stated(self, giving: Giving, last: int | None) -> dict[str, Any] | None:
        return None

    def ended(self, giving: Giving, echo: bool) -> None:
        pass


# -------------------------------------------------------------- flow consumer port


class _BridgeConsumer(Consumer):
    """A sink consumer that says when a batch was published."""

    def __init__(self, *args: Any, on_publish: Callable[[], None], **kw: Any) -> None:
        self._on_publish = on_publish
        super().__init__(*args, **kw)

    def _commit(self, *args: Any, **kw: Any) -> dict[str, Any]:
        reply = super()._commit(*args, **kw)
        if reply.get("published"):
            self._on_publish()
        return reply


@dataclass(slots=True)
class _Move:
    stream: str
    batch: BatchId
    records: Iterator[tuple[bytes | None, Any]]
    n: int = 0
    done: bool = False


def _rows(consumer: Consumer, stream: str, batch: BatchId) -> Iterator[tuple[bytes | None, Any]]:
    for b in consumer.read(stream, batch):
        yield from zip(b.column(0).to_pylist(), b.column(2).to_pylist(), strict=True)


class FlowConsumerPort:
    """The queue's taker port for Spark sinks, and the bridge into the store.

    The :class:`~zio_spark.sink.consumer.Consumer` serves flows in its own thread;
    :meth:`pump` (the bridge) runs in the broker's thread.

    Parameters
    ----------
    store_path
        The store folder; the consumer's state goes in ``<store_path>/flow-consumer``.
    endpoint
        Endpoint to bind.
    after_durable
        The broker's :meth:`~zio_spark.pzq.broker.QueueBroker.after_durable`.
    wake
        Called (from the consumer's thread) when a batch was published.
    max_put
        Most records moved per loop turn.
    fsync, ctx, mode, linger_ms
        For the consumer.
    curve
        The broker's CURVE keys, a bound port's :class:`~zio_spark.options.Curve` (None:
        no CURVE); the consumer takes their secret key.

    Raises
    ------
    ConsumerStateError, TransportError
        As :class:`~zio_spark.sink.consumer.Consumer`.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str],
        endpoint: str,
        *,
        after_durable: Callable[[Callable[[bool], None]], None],
        wake: Callable[[], None],
        ctx: zmq.Context[Any],
        max_put: int = 4096,
        fsync: bool = True,
        mode: str | None = None,
        curve: Curve | None = None,
        linger_ms: int = 500,
    ) -> None:
        _check_endpoint("flow_consumer", endpoint)
        self._after_durable = after_durable
        self._wake = wake
        self._pending = threading.Event()
        self._pending.set()  # batches published before a restart
        self.max_put = max_put
        self.counters: dict[str, int] = dict.fromkeys(
            ("stored", "duplicates", "rejected", "batches"), 0
        )
        self._move: _Move | None = None
        self._waiting = False
        self.consumer = _BridgeConsumer(
            endpoint,
            Path(store_path) / _CONSUMER_FOLDER,
            ctx=ctx,
            mode=mode,
            curve_secret_key=None if curve is None else curve.secret_key,
            fsync=fsync,
            linger_ms=linger_ms,
            on_publish=self._published,
        )
        self.endpoint = self.consumer.endpoint

    def _published(self) -> None:  # the consumer's thread
        self._pending.set()
        self._wake()

    def busy(self) -> bool:
        return self._move is not None and not self._waiting

    def pump(self, store: MessageStore) -> None:
        """Move published batches into the store, a slice per call (broker thread)."""
        if self._waiting or store.failed:
            return
        move = self._move
        if move is None:
            if not self._pending.is_set():
                return
            self._pending.clear()
            published = self.consumer.published()
            if not published:
                return
            self._pending.set()  # more may follow this one
            stream, batch = published[0]
            move = self._move = _Move(stream, batch, _rows(self.consumer, stream, batch))
        counters = self.counters
        for _ in range(self.max_put):
            row = next(move.records, None)
            if row is None:
                move.done = True
                break
            value, headers = row
            mid = bridge_message_id(move.stream, move.batch, move.n)
            move.n += 1
            try:
                key = store.put(mid, _body_from_record(value, headers))
            except MessageRejected as e:
                counters["rejected"] += 1
                log.error("queue flow: record %r of the sink batch is refused: %s", mid, e)
                continue
            if key is None:
                counters["duplicates"] += 1
            else:
                counters["stored"] += 1
        if move.done:
            self._waiting = True
            self._after_durable(lambda ok: self._moved(move, ok))

    def _moved(self, move: _Move, ok: bool) -> None:
        self._waiting = False
        self._move = None
        if not ok:
            log.error(
                "queue flow: batch %r of stream %r not moved (the store commit failed)",
                move.batch,
                move.stream,
            )
            return
        self.consumer.ack(move.stream, move.batch)
        self.counters["batches"] += 1
        self._pending.set()

    def close(self) -> None:
        self.consumer.close()


# ----------------------------------------------------------------------- both ports


class QueueFlows:
    """The broker's flow ports (either may be absent). Broker thread only."""

    def __init__(
        self,
        producer: FlowProducerPort | None,
        consumer: FlowConsumerPort | None,
    ) -> None:
        self.producer = producer
        self.consumer = consumer

    def endpoints(self) -> dict[str, str]:
        eps = {}
        if self.producer is not None:
            eps["flow_producer"] = self.producer.endpoint
        if self.consumer is not None:
            eps["flow_consumer"] = self.consumer.endpoint
        return eps

    def sockets(self) -> list[zmq.Socket[bytes]]:
        return [self.producer.socket] if self.producer is not None else []

    def process(self, store: MessageStore) -> None:
        """A flow socket is readable: dispatch what arrived."""
        if self.producer is not None:
            self.producer.process()

    def pump(self, store: MessageStore) -> None:
        if self.consumer is not None:
            self.consumer.pump(store)
        if self.producer is not None:
            self.producer.pump()

    def busy(self) -> bool:
        return (self.consumer is not None and self.consumer.busy()) or (
            self.producer is not None and self.producer.busy()
        )

    def stats(self) -> dict[str, int]:
        p = self.producer.counters if self.producer is not None else {}
        c = self.consumer.counters if self.consumer is not None else {}
        return {
            "flow_given": p.get("given", 0),
            "flow_acked": p.get("acked", 0),
            "flow_stored": c.get("stored", 0),
        }

    def close(self) -> None:
        errors: list[BaseException] = []
        for part in (self.producer, self.consumer):
            if part is not None:
                try:
                    part.close()
                except (OSError, TransportError) as e:
                    errors.append(e)
        if errors:
            log.error("queue flow: closing: %s", "; ".join(map(str, errors)))
