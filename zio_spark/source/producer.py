"""An ack-capable ZIO giver: keeps every record until the taker acknowledges it.

Two topologies, one record buffer:

- **server** (``Producer(bind=EP)``): the producer binds a server port; a taker (the
  Spark source, or any ZIO flow client with direction ``inject``) connects and sends its
  BOT. One taker at a time: a new taker's BOT replaces the previous flow (the old client
  is dead or about to be; its unacknowledged records are resent to the new one).
- **client** (``Producer(connect=EP)``): the producer connects to a server that takes (a
  flow broker, the Spark source in ``bind`` mode) and opens the flow itself, as ZIO
  applications' producers usually do: ``BOT{direction: extract, credit, producer,
  stream, ack: true, encoding: ["arrow"]}``. After a disconnect, a flow failure, a
  rejection or a server's EOT it reconnects with back-off and a fresh BOT, so a
  restarted server is picked up (``stats`` counts what happened).

Terms are read in one place for both (:mod:`zio_spark.protocol.negotiate`): the client
offers, the server states; an echoed BOT (both reference servers echo the client's BOT)
proves nothing. Records are numbered from 1 in the order :meth:`Producer.send` is called
and kept in memory until acknowledged:

- A zio-spark taker states ``ack: true`` and ``resume: R`` (the last sequence number it
  holds durably). The producer then resends from ``R + 1`` and forgets a record only when
  a PAY carries ``ack >= seq``. Records go many to a DAT, packed as one Arrow IPC frame
  (see :mod:`zio_spark.codec.records`) when the ``arrow`` encoding is agreed.
- A plain ZIO taker (no acknowledgements: a reference taker, or a reference server that
  echoes our BOT) gets one record per DAT, the payload being the value, and a record is
  forgotten once sent: at most once, as plain ZIO promises. As a server we add ``seq``
  (and ``key``, ``headers``, ``granule``) to the DAT label; as a client the label is the
  reference's bare ``{"flow": "DAT"}``. Such a taker confirms what it got only by
  echoing our EOT (:meth:`Producer.close`): :meth:`Producer.delivery` counts those
  records as ``confirmed`` then, never before.

Credit: a giver spends only what PAYs paid (the C++ reference server announces the
client's credit in its BOT but may pay less); nothing is sized from a BOT's credit.

Where the parts live: the flow's giving side (terms, DAT packing, acks, one taker at a
time) is :mod:`zio_spark.transport.giver`, shared with the PZQ queue's flow port; the
retention window and its accounting are :mod:`zio_spark.source.backlog`; the engines
are the transport's: a :class:`~zio_spark.transport.flow_server.FlowServer` (server mode)
or a reconnecting :class:`~zio_spark.transport.flow_client.FlowClient` (client mode),
each in a thread of its own, with a :class:`~zio_spark.transport.giver.GiverHandler`.
A bound producer also serves range reads (the direct read mode, docs/direct-read.md):
its port's handlers come from :mod:`zio_spark.source.range_serving`, which routes a
reader's flow (``read: "range"``) apart from the taker's and states ``ranges: 1`` and
the producer's :attr:`~Producer.incarnation` in every BOT. A producer in client mode
serves no range reads.

Producer ids must be stable across restarts for exactly-once. A restarted producer
numbers from 1 again; when a taker's ``resume`` shows it already holds more than this
process ever sent, records not yet sent are renumbered to continue after ``resume``
(counted in ``stats["renumbered"]``), so nothing new is mistaken for a duplicate.

**Retention on disk** (``retention_dir``): records held in memory die with the process,
so a producer killed before the taker's commit loses what it had not had acknowledged.
With ``retention_dir`` the held records are also kept in a
:class:`~zio_spark.storage.retention.RetentionLog` there: :meth:`Producer.send` returns
only once its records are written and ``fdatasync``-ed, a restarted producer with the
same ``producer_id`` and folder reopens the log, resends what was not acknowledged and
numbers on after the last seq it wrote, so its restart loses nothing (a power loss
neither, on a disk that honours flushes). Acknowledged records are released from the
log as from memory.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from zio_spark import heap
from zio_spark.codec.records import DAT_RECORDS
from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import (
    DEFAULT_CONN_CHECK,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    ZreOptions,
    conn_check_seconds,
    heartbeat_millis,
)
from zio_spark.protocol.flow import FlowState
from zio_spark.source.backlog import (
    Delivery,
    ProducerBacklog,
    closes_retention_on_failure,
    open_retention,
)
from zio_spark.source.range_serving import RangeService
from zio_spark.transport.curve import (
    CurveAuthenticator,
    curve_key,
    optional_client_curve,
    optional_server_curve,
    start_authenticator,
)
from zio_spark.transport.flow_client import FlowClient
from zio_spark.transport.flow_server import FlowServer
from zio_spark.transport.giver import GiverHandler, GiverPolicy, Giving
from zio_spark.transport.port import ServerPort
from zio_spark.transport.wire import silent_peer_hint

if TYPE_CHECKING:
    from zio_spark.transport.zre_node import ZreNode

__all__ = [
    "DEFAULT_CONN_CHECK",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_WINDOW",
    "DEFAULT_WINDOW_BYTES",
    "Delivery",
    "Producer",
    "silent_peer_hint",
]

log = logging.getLogger("zio_spark.transport")

_CLIENT_QUEUE_SLACK = 16  # client mode's send queue: the credit offered plus this
_SEND_QUEUE = 100_000  # messages queued to the taker at most: the most credit it is given
_ZAP_DOMAIN = "zio-producer"  # the port's ZAP domain when it has an allow-list
# The retention window's defaults (see Producer's docstring for the arithmetic).
DEFAULT_WINDOW = 2_000_000
DEFAULT_WINDOW_BYTES = 256 << 20


class Producer:
    """Give records to a ZIO taker, keeping each until it is acknowledged.

    Parameters
    ----------
    bind
        Server mode: endpoint to bind (``tcp://127.0.0.1:*`` picks a free port); the
        default when ``connect`` is not given.
    connect
        Client mode: the endpoint of a server that takes (a flow broker, the Spark
        source in ``bind`` mode); the producer opens the flow and reconnects after
        failures.
    producer_id
        Stable id of this producer (default: host name and endpoint).
    stream
        Stream name; a taker asking for another stream is rejected (server mode), a
        server stating another one is left (client mode).
    batch
        Most records per DAT (Arrow-encoded flows; default 4096, and about 4 MiB of
        values at most, so large records make smaller DATs). The taker's BOT may lower it.
    max_unacked, max_unacked_bytes
        The retention window: :meth:`send` blocks while this many records, or this many
        value bytes, are held unacknowledged (whichever comes first; one call may go past
        the byte budget by what it adds). A taker acknowledges only what it has made
        durable *and* its query has committed: for the Spark source that is a micro-batch
        after it was received, and ``commit`` lags one batch, so the window must hold
        about two micro-batches or it caps the query at ``window / commit latency``.
        The defaults (2,000,000 records, 256 MiB) sit above the source's default
        ``maxBacklog`` (1,000,000 records) plus what its credit keeps in flight, so the
        source's backlog bound, not this window, is what limits a default pair. Time
        spent blocked here is counted (:attr:`blocked_seconds`, ``stats["blocked"]``).
    mode
        Socket kind: ``"routerdealer"`` (default), ``"clientserver"`` (needs a draft
        pyzmq) or ``"auto"``; the peer must use the matching kind.
    curve_secret_key
        Server mode: turn on CURVE with this secret key.
    curve_server_key, curve_public_key
        Client mode: CURVE with the server's public key and this client's key pair
        (``curve_secret_key`` is then the client's secret key).
    curve_allowed_client_keys
        Server mode, with ``curve_secret_key``: admit only CURVE clients whose public key
        is in this list (Z85 text or 32 raw bytes; one key or several), through a ZAP
        handler on the port (as :func:`~zio_spark.transport.curve.start_authenticator`
        does). Give it the keys of the takers and of the Spark drivers that read this
        producer (their ``curvePublicKey``). A driver in ``readMode=direct`` registers a
        fresh key per query run on its control flow; that key is admitted for as long as
        the control flow lives, so the query's tasks read ranges with it and never hold
        the driver's secret key (docs/direct-read.md, "Security"). Flows are bound to
        keys: a key on this list opens any flow (a taker's, a control flow, a range
        read); a run key opens range reads only (a control flow or a taker's flow
        opened with it is rejected, so a task cannot free records or admit keys); a
        connection whose key is neither (a run key whose lease ended) opens none. The
        port then lives
        in a zmq context of its own (a ZAP handler is one per context and would judge
        every CURVE socket of a shared one), so ``ctx`` is not used for it. None (the
        default): any client that knows the server key gets in, as before.
    linger_ms
        ZMQ linger of the port at :meth:`close`.
    idle_timeout
        Server mode: remove a taker silent for this many seconds.
    heartbeat_interval, heartbeat_timeout
        Server mode: ZMTP heartbeats on the port's connections (libzmq >= 4.2 on both
        sides answers them by itself; nothing reaches a flow): a PING every
        ``heartbeat_interval`` seconds (default 5), and a connection from which nothing
        at all, not even a PONG, came for ``heartbeat_timeout`` seconds (default 30;
        at least the interval) is closed by libzmq. That is how a reader whose host
        vanished without closing its TCP connection (power, network) is noticed; a
        reader process that exits or is killed is noticed at once, its kernel closes
        the connection. ``heartbeat_interval=None`` turns heartbeats off (then
        ``heartbeat_timeout`` must be None too). A quiet reader is never dropped: its
        libzmq answers the PINGs.
    conn_check
        Server mode: seconds between two looks (one ``fstat`` per flow, nothing sent)
        at the connections of range and control flows (default 0.5). A flow whose
        connection libzmq has closed without an EOT from the reader (a Spark task
        SIGKILLed, an executor lost, a driver killed) is removed with its own state
        only: nothing is freed or acknowledged, a control flow's run key is released
        as on EOT (:attr:`range_flows_open`, ``stats["range_flows_gone"]``,
        ``stats["control_flows_gone"]``; docs/direct-read.md).
    credit
        Client mode: the credit offered in our BOT (the most DATs in flight); the taker
        may pay less, and only what it pays is spent.
    connect_timeout
        Client mode: seconds to wait for the server's BOT reply before the flow counts as
        failed (``stats["bot_timeouts"]``, with a hint about socket kinds) and is retried.
        A connection that closes before the reply (what libzmq does to a mismatched
        socket pair) counts the same way: ``stats["unanswered"]`` counts both.
    reconnect
        Client mode: open a new flow after a failure or a server's EOT (default True).
    retention_dir
        Keep the retention window on local disk in this folder too (default None: in
        memory only, as fast as ever). :meth:`send` then returns only once its records
        are durable there (one ``fdatasync`` per call), and a producer restarted with the
        same ``producer_id`` (required) and folder resends what was not acknowledged and
        numbers on after its last seq: its restart loses nothing. One process per folder
        (an ``flock``); a folder of another producer id is refused.
    incarnation
        The name of this producer's sequence-number space, stated to range readers
        (docs/direct-read.md; 1..64 ASCII letters, digits, ``.``, ``_``, ``-``). None (the
        default): a fresh random one, right for a producer that numbers from 1 at every
        start; with ``retention_dir``, the folder's own (kept across restarts with the
        records and their numbers; another one is a ConfigError). Server mode serves range reads
        (:mod:`zio_spark.source.range_serving`); client mode does not (it has no port a
        reader could reach), though :attr:`incarnation` is kept the same way.

    Raises
    ------
    ConfigError
        For a bad option (both ``bind`` and ``connect``, a bad ``batch``, a
        ``retention_dir`` without ``producer_id`` ...).
    TransportError
        If the port cannot be made, bound or connected (e.g. ``clientserver`` without a
        draft pyzmq).
    StorageError
        If ``retention_dir`` cannot be used:
        :class:`~zio_spark.storage.retention.RetentionLockedError` when another process
        holds it, :class:`~zio_spark.errors.StorageInputError` when it holds another
        producer id's records, :class:`~zio_spark.errors.CorruptRecordError` when it is
        damaged (a torn last write is cut off instead: ``stats["retention_torn"]``).
    """

    @closes_retention_on_failure
    def __init__(
        self,
        bind: str | None = None,
        *,
        connect: str | None = None,
        producer_id: str | None = None,
        stream: str = "zio",
        batch: int = DAT_RECORDS,
        max_unacked: int = DEFAULT_WINDOW,
        max_unacked_bytes: int = DEFAULT_WINDOW_BYTES,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve_secret_key: str | bytes | None = None,
        curve_server_key: str | bytes | None = None,
        curve_public_key: str | bytes | None = None,
        linger_ms: int = 1000,
        idle_timeout: float | None = None,
        credit: int = 1000,
        connect_timeout: float = 10.0,
        reconnect: bool = True,
        retention_dir: str | os.PathLike[str] | None = None,
        incarnation: str | None = None,
        curve_allowed_client_keys: Iterable[str | bytes] | str | bytes | None = None,
        heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT,
        conn_check: float = DEFAULT_CONN_CHECK,
    ) -> None:
        if bind is not None and connect is not None:
            raise ConfigError(
                "connect", connect, f"either bind or connect, not both (bind={bind!r})"
            )
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError("batch", batch, "an integer >= 1")
        if isinstance(max_unacked, bool) or not isinstance(max_unacked, int) or max_unacked < 1:
            raise ConfigError("max_unacked", max_unacked, "an integer >= 1")
        if (
            isinstance(max_unacked_bytes, bool)
            or not isinstance(max_unacked_bytes, int)
            or max_unacked_bytes < 1
        ):
            raise ConfigError("max_unacked_bytes", max_unacked_bytes, "an integer >= 1")
        if (
            isinstance(credit, bool)
            or not isinstance(credit, int)
            or not 1 <= credit <= _SEND_QUEUE
        ):
            raise ConfigError("credit", credit, f"an integer 1..{_SEND_QUEUE}")
        if isinstance(connect_timeout, bool) or not (
            isinstance(connect_timeout, (int, float)) and 0 < connect_timeout <= 86400
        ):
            raise ConfigError("connect_timeout", connect_timeout, "seconds, > 0")
        heartbeat_ms = heartbeat_millis(heartbeat_interval, heartbeat_timeout)
        conn_check = conn_check_seconds(conn_check)
        allowed = _allowed_keys(curve_allowed_client_keys, connect, curve_secret_key)
        self._gate: CurveAuthenticator | None = None
        self._own_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self.ctx = ctx or zmq.Context.instance()
        self.stream = stream
        self.batch = batch
        self.max_unacked = max_unacked
        self.max_unacked_bytes = max_unacked_bytes
        self.stats: collections.Counter[str] = collections.Counter()
        heap.tune()  # the DATs it encodes and sends (zio_spark.heap)
        self._backlog = ProducerBacklog(
            max_unacked=max_unacked,
            max_unacked_bytes=max_unacked_bytes,
            stats=self.stats,
            wake=lambda: self._call_soon(self._woken),
            retention=open_retention(retention_dir, producer_id),
        )
        self._ranges = RangeService(
            self._backlog,
            GiverPolicy(producer_id or "", stream, batch),
            incarnation=incarnation,
            stats=self.stats,
        )
        self._zre: ZreNode | None = None  # the discovery node, once advertise() ran
        self._server: FlowServer | None = None
        self._client: FlowClient | None = None
        if connect is not None:
            self.endpoint = connect
            self.producer_id = producer_id or f"{socket.gethostname()}|{connect}"
            self._backlog.producer_id, self._backlog.endpoint = self.producer_id, connect
            self._ranges.policy = GiverPolicy(self.producer_id, stream, batch)
            # DATs are sent only within paid credit, at most the credit offered: a bound.
            port_options: dict[str, Any] = {"sndhwm": credit + _CLIENT_QUEUE_SLACK}
            if curve_server_key is not None or curve_secret_key is not None:
                port_options["curve"] = optional_client_curve(
                    curve_server_key, curve_secret_key, curve_public_key
                )
            # The first port is made here, so a bad mode or endpoint fails the constructor.
            client = FlowClient(
                connect,
                GiverHandler(
                    self._backlog, GiverPolicy(self.producer_id, stream, batch), credit=credit
                ),
                ctx=self.ctx,
                mode=mode,
                port_options=port_options,
                connect_timeout=float(connect_timeout),
                reconnect=reconnect,
                linger_ms=linger_ms,
                name=f"producer {self.producer_id} -> {connect}",
                stats=self.stats,
            )
            self._client = client
            self.curve_public_key = client.curve_public_key
            assert client.mode is not None and client.socket_type is not None
            self.mode = client.mode
            self.socket_type = client.socket_type
            client.start()
            return
        if curve_server_key is not None:
            raise ConfigError(
                "curve_server_key", "...", "connect: a bound producer is the CURVE server"
            )
        server_curve = optional_server_curve(curve_secret_key, curve_public_key)
        port_ctx = self.ctx
        if allowed is not None:
            # A context of its own: a ZAP handler is one per context, and it would judge
            # (and refuse) the CURVE sockets of other domains in a shared one.
            port_ctx = self._own_ctx = zmq.Context()
            try:
                self._gate = start_authenticator(port_ctx, allowed, domain=_ZAP_DOMAIN)
            except BaseException:
                self._own_ctx.term()
                raise
        # The send queue bounds the credit a taker gets (FlowServer lowers larger offers
        # to it); DATs go out only within credit, so this is a bound, not a buffer.
        try:
            port = ServerPort(
                port_ctx,
                mode=mode,
                linger_ms=linger_ms,
                curve=server_curve,
                zap_domain=None if allowed is None else _ZAP_DOMAIN,
                # With a list, which key a client came with decides the flows it may
                # open (range_serving: a run key reads ranges only).
                user_ids=allowed is not None,
                # Which connection each range/control flow came on, and heartbeats, so a
                # reader gone without EOT ends its flow (range_serving, "Readers that vanish").
                conn_ids=True,
                heartbeat_ms=heartbeat_ms,
                sndhwm=_SEND_QUEUE,
            )
        except BaseException:
            self._stop_gate()
            raise
        try:
            self.endpoint = port.bind("tcp://127.0.0.1:*" if bind is None else bind)
        except BaseException:
            port.close(0)
            self._stop_gate()
            raise
        self._ranges.gate = self._gate
        self.curve_public_key = port.curve_public_key
        self.mode = port.mode
        self.socket_type = port.socket_type
        self.producer_id = producer_id or f"{socket.gethostname()}|{self.endpoint}"
        self._backlog.producer_id, self._backlog.endpoint = self.producer_id, self.endpoint
        self._ranges.policy = GiverPolicy(self.producer_id, stream, batch)
        self._server = FlowServer(
            port,
            self._ranges.handler,
            ctx=port_ctx,
            idle_timeout=idle_timeout,
            name=f"producer {self.producer_id}",
            # A reader whose flow outlived a previous process on this endpoint is told.
            on_stray=self._ranges.stray_answerer(port),
            conn_check=float(conn_check),
        ).start()

    def _stop_gate(self) -> None:
        """Stop the ZAP handler and end the port's own context (after the port closed)."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.stop()
        own, self._own_ctx = self._own_ctx, None
        if own is not None:
            own.term()

    @property
    def curve_allowed_client_keys(self) -> frozenset[bytes] | None:
        """The allow-list of the port (Z85 keys), None without one (any client that
        knows the server key gets in)."""
        return None if self._gate is None else self._gate.allowed

    @property
    def run_keys(self) -> frozenset[bytes]:
        """The run keys admitted now, each while the control flow that registered it
        lives (Z85; empty without an allow-list)."""
        return frozenset() if self._gate is None else self._gate.leased

    # -- application side (any thread) --------------------------------------------

    def send(
        self,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        granule: int | None = None,
        timeout: float | None = 30.0,
    ) -> int:
        """Queue one record; returns its sequence number.

        With ``retention_dir``, the record is durable on disk when this returns.

        Raises
        ------
        TransportError
            If the buffer stays full (``max_unacked``) for ``timeout`` seconds.
        StorageError
            With ``retention_dir``: the record cannot be written there.
        """
        return self.send_many(
            [value],
            keys=None if key is None else [key],
            headers=None if headers is None else [headers],
            granules=None if granule is None else [granule],
            timeout=timeout,
        )

    def send_many(
        self,
        values: Sequence[bytes],
        *,
        keys: Sequence[bytes | None] | None = None,
        headers: Sequence[Mapping[str, str] | None] | None = None,
        granules: Sequence[int | None] | None = None,
        timeout: float | None = 30.0,
    ) -> int:
        """Queue many records; returns the sequence number of the last one.

        With ``retention_dir``, the records are durable on disk when this returns (one
        ``fdatasync`` per call: batch records into few calls).

        Raises
        ------
        TransportError
            If the buffer has no room for them within ``timeout`` seconds.
        ValueError
            If the optional columns do not match ``values`` in length.
        StorageError
            With ``retention_dir``: a record the log refuses
            (:class:`~zio_spark.errors.StorageInputError`, naming it) or a failed write;
            the records of this call before it stay held.
        """
        n = len(values)
        for name, col in (("keys", keys), ("headers", headers), ("granules", granules)):
            if col is not None and len(col) != n:
                raise ValueError(f"{name} has {len(col)} entries for {n} values")
        return self._backlog.append(values, keys, headers, granules, timeout)

    @property
    def blocked_seconds(self) -> float:
        """Total time :meth:`send` has spent waiting for acknowledgements to free the
        window (a send waiting now included): a producer held back by its taker."""
        return self._backlog.blocked_seconds

    @property
    def window_full(self) -> bool:
        """True while a :meth:`send` is waiting for room in the window."""
        return self._backlog.window_full

    def _call_soon(self, fn: Any) -> None:
        if self._client is not None:
            self._client.call_soon(fn)
        else:
            assert self._server is not None
            self._server.call_soon(fn)

    def _woken(self) -> None:
        g = self._backlog.woken()
        if g is not None:
            # As on a tick: a failure (the taker vanished) ends that flow, not the loop.
            g.wake()

    @property
    def acked(self) -> int:
        """Highest sequence number acknowledged by a taker."""
        return self._backlog.acked

    @property
    def last_seq(self) -> int:
        return self._backlog.last_seq

    @property
    def pending(self) -> int:
        """Records held: not yet acknowledged (or, for plain takers, not yet sent)."""
        return self._backlog.pending

    @property
    def connected(self) -> bool:
        """True while a taker's flow is open (its BOT exchanged)."""
        return self._backlog.taker is not None

    @property
    def _taker(self) -> Giving | None:
        """The flow records go to (loop thread's view)."""
        return self._backlog.taker

    @property
    def acks(self) -> bool | None:
        """Whether the current taker (or, once it left, the last one) acknowledges
        records; None before any taker came. False means a plain ZIO taker: at most once,
        confirmed only by the echo of our EOT."""
        return self._backlog.last_acks

    @property
    def incarnation(self) -> str:
        """The name of this producer's sequence-number space, stated to range readers
        with ``ranges: 1`` in every BOT of a bound producer. A new one replaces it if a
        taker's ``resume`` makes the producer renumber held records."""
        return self._ranges.incarnation

    @property
    def range_flows_open(self) -> int:
        """Range and control flows open now (a bound producer's readers; 0 in client
        mode). A flow whose reader vanished without EOT leaves this count once its
        connection is found closed (``stats["range_flows_gone"]``,
        ``stats["control_flows_gone"]``)."""
        return len(self._ranges.flows)

    @property
    def serves_ranges(self) -> bool:
        """True for a bound producer: it answers range reads (docs/direct-read.md)."""
        return self._server is not None

    @property
    def last_error(self) -> str | None:
        """Client mode: why the last flow failed (None if none did)."""
        return None if self._client is None else self._client.last_error

    def delivery(self) -> Delivery:
        """What became of the records this process queued (see :class:`Delivery`)."""
        return self._backlog.delivery()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait until every record sent so far is acknowledged (or sent, to a plain taker).

        Raises
        ------
        TransportError
            On timeout.
        """
        self._backlog.flush(timeout)

    def advertise(
        self,
        group: str | ZreOptions,
        *,
        beacon_port: int | None = None,
        broadcast: str | None = None,
        interface: str | None = None,
        interval: float | None = None,
    ) -> None:
        """Join a ZRE group and advertise this producer's flow port in it.

        ``group`` is the group's name, with the ZRE settings as keywords (defaults as
        :class:`~zio_spark.options.ZreOptions`), or one :class:`ZreOptions` (then no
        keyword). The node stops with :meth:`close`.
        """
        from zio_spark.transport.discovery import advertise, zre_options

        name = group.group if isinstance(group, ZreOptions) else group
        if self._server is None:
            raise ConfigError(
                "group",
                name,
                "a bound producer: a producer in client mode has no port to advertise",
            )
        zre = zre_options(
            group,
            beacon_port=beacon_port,
            broadcast=broadcast,
            interface=interface,
            interval=interval,
        )
        self._zre = advertise(
            zre, self.endpoint, self._server.port.socket_type, name=self.producer_id
        )

    def close(self, timeout: float | None = 30.0, *, flush: bool = True) -> Delivery:
        """Flush (optionally), end the flow with an EOT, wait for its echo, stop.

        The echo is what confirms delivery to a plain taker (:attr:`Delivery.confirmed`).
        Returns :meth:`delivery` as it stands once the producer is stopped.

        Raises
        ------
        TransportError
            If ``flush`` is true and records are still held after ``timeout`` (the
            producer is closed all the same, without an EOT).
        """
        try:
            if flush and not self._backlog.closed:
                self.flush(timeout)
            done = threading.Event()

            def end() -> None:
                if self._server is not None:
                    self._ranges.end_flows("the producer is closing")
                g = self._taker
                conn = None if g is None else g.conn
                if self._client is not None:
                    # No new flow after this; the echo (or the flow's end) sets done.
                    if g is not None:
                        self._backlog.eot_done = done
                    if not self._client.send_eot() or g is None:
                        done.set()
                    return
                if conn is not None and conn.flow.state is FlowState.READY:
                    self._backlog.eot_done = done
                    try:
                        conn.send_eot()
                    except TransportError as e:  # the taker is gone: no echo will come
                        log.warning("producer %s: cannot send EOT: %s", self.producer_id, e)
                        done.set()
                else:
                    done.set()

            if self._loop_alive():
                self._call_soon(end)
                if not done.wait(timeout):
                    log.warning("producer %s: no EOT echo before close", self.producer_id)
        finally:
            self._backlog.close()
            if self._zre is not None:
                self._zre.stop()
            if self._client is not None:
                self._client.stop()
            if self._server is not None:
                self._server.stop()  # raises if its thread hangs: the context stays then
            self._stop_gate()
            self._backlog.close_retention()
        return self.delivery()

    def _loop_alive(self) -> bool:
        if self._client is not None:
            return self._client.alive
        return self._server is not None and self._server.running

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(flush=exc[0] is None)


def _allowed_keys(
    keys: Iterable[str | bytes] | str | bytes | None,
    connect: str | None,
    secret_key: str | bytes | None,
) -> list[bytes] | None:
    """The checked allow-list of ``Producer(curve_allowed_client_keys=...)`` (Z85), None
    without one.

    Raises
    ------
    ConfigError
        Naming ``curve_allowed_client_keys``: in client mode, without
        ``curve_secret_key``, empty, or with a malformed key (naming it).
    """
    name = "curve_allowed_client_keys"
    if keys is None:
        return None
    if connect is not None:
        raise ConfigError(
            name, "...", "bind: an allow-list is for the CURVE server (a bound producer)"
        )
    if secret_key is None:
        raise ConfigError(
            name, "...", "curve_secret_key too: an allow-list admits CURVE clients only"
        )
    items = [keys] if isinstance(keys, str | bytes) else list(keys)
    if not items:
        raise ConfigError(
            name,
            [],
            "at least one client public key (the takers' and the Spark drivers' "
            "curvePublicKey); no allow-list at all: None",
        )
    return [curve_key(k, f"{name}[{i}]") for i, k in enumerate(items)]
