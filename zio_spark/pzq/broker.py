"""The PZQ-style queue server: three sockets over a durable :class:`MessageStore`.

(A little over 800 lines: the theory of operation below is the queue's user-facing
contract and stays beside the loop it describes; the work is in ``receive``/``send``.)

Theory of operation (spec: ``specs/pzq-sockets-and-formats.txt``; DESIGN.md "The
PZQ-style queue"; frames: :mod:`zio_spark.protocol.pzq`)
---------------------------------------------------------------------------------------
One thread owns the three sockets and the store; a second thread only runs the store's
``write`` + ``fdatasync`` (a :class:`~zio_spark.storage.store.CommitTicket`), so the first
keeps receiving, delivering and answering while the disk syncs.

*receive* (ROUTER, producers connect with DEALER): messages go into the store's buffer,
one commit (one ``fdatasync``) covers everything buffered, and each producer's ack
``[id, "1", "", ""]`` leaves once its message is durable; failures are acked ``"0"``
with a reason, and acks a full pipe refuses wait in bounded per-producer backlogs.
Details: :mod:`zio_spark.pzq.receive` (:class:`~zio_spark.pzq.receive.ReceiveSide`).

*send* (consumers connect with ROUTER): deliveries ``[queue id, message id, sent µs, ack
timeout µs, "", *body]``; the consumer answers ``[queue id, message id, "1"|"0"]``; no
answer within the ack timeout requeues the message (``expired_messages``). The socket's
``ZMQ_ROUTING_ID`` is the queue id (stable, kept in the store). Details:
:mod:`zio_spark.pzq.send` (:class:`~zio_spark.pzq.send.SendSide`).

``send_mode="dealer"`` (default): the send socket is a DEALER, as in the reference
daemon. A consumer that connects and never speaks first (PZQ's own clients) is served,
and again after a queue restart (its ROUTER reconnects by itself). The DEALER deals
round robin over the connections whose pipe has room; each pipe holds at most
``inflight`` deliveries (its high-water mark), and at most ``inflight`` x connected
consumers are unacked. A socket monitor follows the connections (``consumers``); a
message sent before every open connection was made can only be held by one that closed,
so those are requeued as soon as a connection closes (``vanished_requeued``).

``send_mode="router"``: a ROUTER that knows each consumer: exact per-consumer in-flight
limits, round robin by consumer, and a consumer's messages requeued at once when a send
to it fails (``EHOSTUNREACH``). ROUTER-to-ROUTER, the binding side learns of a peer only
when it speaks: a consumer announces itself with ``ZMQ_PROBE_ROUTER`` (libzmq sends it
on the first connect only) or any message; with a draft libzmq the queue sets
``ZMQ_ROUTER_NOTIFY`` and every consumer is announced on connect. ``ZMQ_ROUTER_HANDOVER``
lets a peer with a fixed routing id reconnect at once.

Hot paths. The canonical frames are built and parsed inline and go through pyzmq's
backend socket methods with int flags (:mod:`zio_spark.pzq.wire`); anything not
canonical goes through the :mod:`zio_spark.protocol.pzq` codecs, and a test checks that
both agree.

Duplicates (``dedup``). A repeated id is a duplicate (acked, not stored) only with the
body stored under that id: the store keeps a digest of the newest body per id in its
window, across restarts, so a reused id with a new body is always stored and an ack
always means "stored". ``"resend"`` (default) asks moreover that it can be a resend of a
message whose ack the producer missed: same producer connection within the window, or
the queue has not acked the first copy (commit running, ack dropped or undeliverable),
or the copy was found on disk less than ``dedup_grace`` after start. A new message
reusing an id the queue acked to another connection is stored. ``"global"``: any id (with
its body) in the store's window, across restarts. Should two stored messages share an id,
the second waits until the first is no longer in flight, so acks stay unambiguous.

*monitor* (REP): ``MONITOR`` → one part of ``key: value`` lines: the spec's
``messages`` (durable, unacked), ``messages_in_flight``, ``db_size`` (segment bytes on
disk), ``in_flightdb_size`` (stored bytes of in-flight messages), ``syncs``
(``fdatasync`` calls), ``expired_messages``, the reference daemon's spellings
``messages_inflight`` and ``inflight_db_size``, then ``delivered``, ``acked``, ``nacked``,
``redelivered``, ``producers`` (seen in the last minute), ``consumers`` (known now) and
more counters (:data:`EXTRA_MONITOR_KEYS`). Anything else gets ``error: ...`` and is
counted.

Bad input never stops the server: decode errors are counted and answered or dropped as
above, and an unexpected exception while handling one message is logged with its
traceback and counted (``errors``), and the loop goes on.

*flow ports* (optional, :mod:`zio_spark.pzq.flow_ports`): ``flow_producer`` is a ZIO giver
for Spark sources (messages leave the store when the source acks them after Spark's
commit), ``flow_consumer`` a sink consumer whose published batches are moved into the
store. Counted as ``flow_given``, ``flow_acked``, ``flow_stored``.

Security: with ``curve_secret_key`` all three sockets are CURVE servers; clients need
:attr:`QueueBroker.curve_public_key`. Without a ZAP handler on the context any client that
knows the key may connect (see :func:`zio_spark.transport.start_authenticator`). With
``curve_allowed_client_keys`` the broker runs a ZAP handler of its own on its context
that admits only those keys, on every socket (PZQ producers and consumers, Spark sources
and sinks alike); an application's own handler on a ``context`` it passes is given as
``authenticator``. Either is the flow producer port's gate: Spark drivers in
``readMode=direct`` lease their query runs' keys on it (range reads on that port only),
as with a bound producer's allow-list (:mod:`zio_spark.pzq.flow_ports`, "Run keys").
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypedDict

import zmq

from zio_spark import heap
from zio_spark.errors import ConfigError, RemoteProtocolError, TransportError
from zio_spark.options import QueueOptions
from zio_spark.protocol.pzq import (
    MONITOR_KEYS,
    REFERENCE_MONITOR_KEYS,
    decode_monitor_request,
    encode_monitor_reply,
)
from zio_spark.pzq.flow_ports import (
    FlowConsumerPort,
    FlowProducerPort,
    QueueFlows,
)
from zio_spark.pzq.receive import ReceiveSide
from zio_spark.pzq.send import SendSide
from zio_spark.pzq.wire import POLLIN, POLLOUT, now_us
from zio_spark.storage.store import (
    CommitTicket,
    MessageStore,
    StoreError,
)
from zio_spark.transport.curve import (
    CurveAuthenticator,
    apply_server,
    server_curve,
    server_keys,
    start_authenticator,
)
from zio_spark.transport.loop import Waker

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "EXTRA_MONITOR_KEYS",
    "QueueBroker",
    "QueueSettings",
]

log = logging.getLogger(__name__)

EXTRA_MONITOR_KEYS: Final = (
    "delivered",
    "acked",
    "nacked",
    "redelivered",
    "producers",
    "consumers",
    "received",
    "stored",
    "duplicates",
    "rejected",
    "bad_frames",
    "unknown_acks",
    "acks_undeliverable",
    "acks_dropped",
    "commits",
    "segments",
    "errors",
    "store_failed",
    "flow_given",
    "flow_acked",
    "flow_stored",
    "vanished_requeued",
    "hellos",
    "send_mode",
    "dedup",
)
"""Monitor keys after the spec's :data:`~zio_spark.protocol.pzq.MONITOR_KEYS` and the
reference daemon's :data:`~zio_spark.protocol.pzq.REFERENCE_MONITOR_KEYS`, in order."""

_TICK_S: Final = 0.1  # refresh stats() and retry consumers whose pipes were full
_IDLE_S: Final = 1.0  # no producer message for this long: tidy the store


class QueueSettings(TypedDict, total=False):
    """:class:`QueueBroker`'s keywords: the fields of
    :class:`~zio_spark.options.QueueOptions` after ``store_path`` (defaults there)."""

    receive: str
    send: str
    monitor: str | None
    ack_timeout: float
    hwm: int
    ack_backlog: int
    inflight: int
    curve_secret_key: str | bytes | None
    curve_allowed_client_keys: tuple[str | bytes, ...] | None
    queue_id: bytes | None
    max_batch: int
    dedup_window: int
    segment_bytes: int
    sync: bool
    linger_ms: int
    flow_producer: str | None
    flow_consumer: str | None
    flow_window: int
    flow_heartbeat_interval: float | None
    flow_heartbeat_timeout: float | None
    flow_conn_check: float
    send_mode: str
    dedup: str
    dedup_grace: float


class QueueBroker:
    """The PZQ-style queue server (see the module docstring). A context manager.

    The settings are one :class:`~zio_spark.options.QueueOptions`, checked there: pass
    it, or the store folder and any of its fields as keywords (:class:`QueueSettings`;
    the defaults are the dataclass's).

    Parameters
    ----------
    store_path
        Folder of the durable store (created if missing; one broker per folder), or the
        whole :class:`~zio_spark.options.QueueOptions` (then no keywords but ``context``).
    receive, send, monitor
        Endpoints to bind (``tcp://127.0.0.1:*`` picks a free port; ``monitor=None``
        disables the monitor socket).
    ack_timeout
        Seconds a consumer has to ack a delivery before it is requeued (> 0, at most
        :data:`~zio_spark.options.MAX_ACK_TIMEOUT_S`). Deliveries carry it in microseconds.
    hwm
        High-water mark, messages per peer, of the receive and send sockets (0: none).
    ack_backlog
        Most acks kept for one producer whose pipe is full (it reads no acks) beyond
        ``hwm``; past this its oldest are dropped (``acks_dropped``), and it gets them by
        resending (acked as duplicates).
    inflight
        Most unacked deliveries per consumer (>= 1). In ``dealer`` mode: the most
        queued per consumer connection (the send socket's per-pipe high-water mark),
        and ``inflight`` times the connected consumers unacked in all.
    send_mode
        ``"dealer"`` (default): the send socket is a DEALER with the queue id as its
        routing id, as the reference daemon's: every consumer that connects is served,
        silent ones and after restarts included. ``"router"``: a ROUTER that knows each
        consumer (exact per-consumer limits, prompt requeue of a vanished consumer's
        messages), but serves only consumers that announce themselves
        (``ZMQ_PROBE_ROUTER``, first connect only) or, with a draft libzmq, all
        (``ZMQ_ROUTER_NOTIFY``). See the module docstring.
    dedup
        Which repeated producer ids are duplicates (acked, not stored again; counted as
        ``duplicates``); under every rule only one whose body is the one stored under
        that id (the store compares digests). ``"resend"`` (default): only a message
        that can be a resend of one whose ack the producer may have missed: the first
        copy came on the same producer connection (among the last ``dedup_window``
        messages), or the queue has not acked it (its commit is running, or its ack was
        dropped or could not be delivered), or it was found on disk at start less than
        ``dedup_grace`` ago. A new message reusing an id the queue did ack to another
        connection (the reference producer's second run) is stored. ``"global"``: any
        id among the last ``dedup_window`` messages, across restarts (for producers with
        globally unique ids). ``"off"``: every message is stored.
    dedup_grace
        Seconds after start during which, under ``"resend"``, ids found on disk are
        duplicates when they come with the same body (a producer whose ack was lost in a
        crash resends them).
    curve_secret_key
        Make all sockets CURVE servers with this secret key (Z85 or 32 raw bytes).
    curve_allowed_client_keys
        With ``curve_secret_key``: admit only CURVE clients with these public keys
        (Z85 or 32 raw bytes), through a ZAP handler the broker runs on its context, on
        every socket: list the PZQ producers and consumers and the Spark drivers
        (sources' and sinks' ``curvePublicKey``). It is the flow producer port's gate:
        a driver's run keys are admitted there, for range reads, while its control flow
        lives. None: no list (any client that knows the server key gets in, unless the
        context runs a handler of its own). The context must run no other ZAP handler
        (one per context): with one of yours, pass it as ``authenticator``.
    queue_id
        The send socket's routing id, which consumers see as part 0 (default: the id kept
        in the store folder). Must not start with a zero byte.
    max_batch
        Most messages taken from one socket per loop turn.
    dedup_window, segment_bytes, sync
        Passed to :class:`~zio_spark.storage.store.MessageStore`.
    linger_ms
        ZMQ_LINGER of the sockets at stop (so the last acks can leave).
    flow_producer
        Bind a ZIO flow producer port here for Spark sources (None: off); see
        :mod:`zio_spark.pzq.flow_ports`.
    flow_consumer
        Bind a ZIO flow consumer port here for Spark sinks (None: off).
    flow_window
        Most messages given to the flow producer port and not yet acknowledged.
    flow_heartbeat_interval, flow_heartbeat_timeout, flow_conn_check
        How the flow producer port notices a range or control reader that vanished
        without EOT (a Spark task SIGKILLed, a driver or host lost), as the bound
        :class:`~zio_spark.source.producer.Producer`'s ``heartbeat_interval``,
        ``heartbeat_timeout`` and ``conn_check``: ZMTP PINGs every interval seconds
        (default 5; None: off, then the timeout None too), a connection silent for
        the timeout (default 30) closed by libzmq, and its connections looked at every
        ``flow_conn_check`` seconds (default 0.5) from the loop's turns. Such a flow
        ends, nothing is acknowledged: its messages stay in the store, assigned.
    context
        A zmq context to use (default: a private one, terminated at stop).
    authenticator
        The application's running :class:`~zio_spark.transport.curve.CurveAuthenticator`
        on ``context`` (needs ``context`` and ``curve_secret_key``; not with
        ``curve_allowed_client_keys``): the flow producer port's gate, on which drivers
        lease their run keys. The port calls its ``lease_only_in`` so that run keys are
        admitted on that port only.

    Raises
    ------
    ConfigError
        For a bad option value.
    TransportError
        If a CURVE key is given but libzmq has no CURVE support.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str] | QueueOptions,
        *,
        context: zmq.Context[Any] | None = None,
        authenticator: CurveAuthenticator | None = None,
        **settings: Unpack[QueueSettings],
    ) -> None:
        if isinstance(store_path, QueueOptions):
            if settings:
                first, value = next(iter(settings.items()))
                raise ConfigError(first, value, "in the QueueOptions given, not as a keyword too")
            options = store_path
        else:
            options = QueueOptions(Path(store_path), **settings)
        self.options: Final = options
        """The settings, checked (:class:`~zio_spark.options.QueueOptions`)."""
        heap.tune()  # range reads' runs of records and their DATs (zio_spark.heap)
        self._send_mode = options.send_mode
        self._dedup = options.dedup
        self._dedup_grace = options.dedup_grace
        self._flow_wanted = (options.flow_producer, options.flow_consumer)
        self._flow_window = options.flow_window
        self._flows: QueueFlows | None = None
        self._store_path = options.store_path
        self._endpoints_wanted = (options.receive, options.send, options.monitor)
        self._ack_timeout_us = max(1, round(options.ack_timeout * 1e6))
        self._hwm = options.hwm
        self._ack_backlog = options.ack_backlog
        self._inflight_limit = options.inflight
        self._max_batch = options.max_batch
        self._linger = options.linger_ms
        secret = options.curve_secret_key
        self._curve = None if secret is None else server_curve(secret)
        self._keys = server_keys(self._curve)  # (secret, public) for the three sockets
        self._queue_id_wanted = options.queue_id
        if authenticator is not None:
            if not isinstance(authenticator, CurveAuthenticator):
                raise ConfigError(
                    "authenticator",
                    type(authenticator).__name__,
                    "a running zio_spark.transport.curve.CurveAuthenticator (it leases "
                    "run keys); another handler cannot admit them",
                )
            if context is None:
                raise ConfigError(
                    "authenticator", "...", "context= too: the context the handler runs on"
                )
            if secret is None:
                raise ConfigError(
                    "authenticator", "...", "curve_secret_key too: it judges CURVE clients"
                )
            if options.curve_allowed_client_keys is not None:
                raise ConfigError(
                    "curve_allowed_client_keys",
                    "...",
                    "None with authenticator= (the list belongs to your handler then)",
                )
        self._authenticator = authenticator
        self._gate: CurveAuthenticator | None = None  # the flow port's, while running
        self._given_ctx = context
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._waker: Waker | None = None  # wakes the loop: stop, calls, commits done
        self.endpoints: dict[str, str] = {}
        """Bound endpoints by socket name (``receive``, ``send``, ``monitor``, and
        ``flow_producer``/``flow_consumer`` when enabled)."""
        self.queue_id: bytes = b""
        """The send socket's routing id (part 0 of every delivery), once started."""
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "expired_messages",
                "delivered",
                "acked",
                "nacked",
                "redelivered",
                "received",
                "duplicates",
                "rejected",
                "bad_frames",
                "unknown_acks",
                "acks_undeliverable",
                "acks_dropped",
                "bad_monitor_requests",
                "errors",
                "vanished_requeued",
                "hellos",
            ),
            0,
        )
        """Event counters, updated by the broker thread (read them via :meth:`stats`)."""
        self._last_stats: dict[str, int | str] = {}
        self._receiving: ReceiveSide | None = None
        self._sending: SendSide | None = None

    # ------------------------------------------------------------------ public API

    @property
    def curve_public_key(self) -> bytes | None:
        """The servers' Z85 CURVE public key (clients need it), or None without CURVE."""
        return None if self._curve is None else self._curve.public_key

    @property
    def running(self) -> bool:
        """Whether the broker thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 60.0) -> QueueBroker:
        """Open the store, bind the sockets and start serving (in a new thread).

        Returns once the endpoints are bound (see :attr:`endpoints`).

        Raises
        ------
        StoreError
            If the store cannot be opened (e.g. it is locked by another broker).
        ConfigError
            If a store option is out of range.
        TransportError
            If an endpoint cannot be bound, or startup takes longer than ``timeout``.
        OSError
            If the store folder cannot be read or written.
        """
        if self._thread is not None:
            raise TransportError("the queue broker was already started")
        self._waker = Waker()
        self._thread = threading.Thread(target=self._main, name="zio-queue", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TransportError(f"the queue broker did not start within {timeout} s")
        if self._start_error is not None:
            self._thread.join()
            self._close_waker()
            raise self._start_error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving: finish the commit in progress, ack what it covers, close.

        Messages in flight stay unacked in the store (a restart redelivers them).
        Idempotent.

        Raises
        ------
        TransportError
            If the broker thread does not finish within ``timeout``.
        """
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._wake()
        thread.join(timeout)
        if thread.is_alive():
            raise TransportError(f"the queue broker did not stop within {timeout} s")
        self._close_waker()

    def _close_waker(self) -> None:
        if self._waker is not None:
            self._waker.close()
            self._waker = None

    def __enter__(self) -> QueueBroker:
        return self.start() if self._thread is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stats(self) -> dict[str, int | str]:
        """The monitor statistics (as the monitor socket would answer), as a dict.

        Safe from any thread: a snapshot the broker thread refreshes every 0.1 s (exact
        after :meth:`stop`).
        """
        return dict(self._last_stats)

    # ------------------------------------------------------------------ thread

    def _main(self) -> None:
        ctx = self._given_ctx if self._given_ctx is not None else zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        store: MessageStore | None = None
        sync_thread: threading.Thread | None = None
        self._sync_q: queue.SimpleQueue[CommitTicket | None] = queue.SimpleQueue()
        own_gate: CurveAuthenticator | None = None
        try:
            try:
                opts = self.options
                self._gate = self._authenticator
                if opts.curve_allowed_client_keys is not None:
                    # Before any socket: every handshake is judged from the first on.
                    try:
                        own_gate = start_authenticator(ctx, opts.curve_allowed_client_keys)
                    except TransportError as e:
                        raise TransportError(
                            f"{e}: the context given to the queue runs a ZAP handler "
                            "already; pass it as QueueBroker(authenticator=...) (a "
                            "CurveAuthenticator) instead of curve_allowed_client_keys",
                            endpoint=e.endpoint,
                        ) from e
                    self._gate = own_gate
                store = MessageStore(
                    self._store_path,
                    segment_bytes=opts.segment_bytes,
                    dedup_window=opts.dedup_window,
                    sync=opts.sync,
                )
                self.queue_id = self._queue_id_wanted or store.queue_id
                self._store = store
                self._open_sockets(ctx, sockets)
                self._open_sides(store)
                self._open_flows(ctx, store)
            except BaseException as e:
                self._start_error = e
                return
            finally:
                self._ready.set()
            sync_thread = threading.Thread(target=self._sync_worker, name="zio-queue-sync")
            sync_thread.daemon = True
            sync_thread.start()
            self._serve(store)
        except BaseException:  # a bug: keep the traceback, shut down cleanly
            log.exception("queue broker thread failed")
            self.counters["errors"] += 1
        finally:
            if sync_thread is not None:
                self._sync_q.put(None)
                sync_thread.join()
            if self._flows is not None:
                self._flows.close()
            if store is not None:
                with contextlib.suppress(Exception):
                    self._last_stats = self._collect_stats(store)
                try:
                    store.close()
                except StoreError as e:
                    log.error("closing the store: %s", e)
            for s in sockets:
                s.close(linger=self._linger)
            if own_gate is not None:
                own_gate.stop()
            if self._given_ctx is None:
                ctx.term()

    def _open_sockets(self, ctx: zmq.Context[Any], sockets: list[zmq.Socket[bytes]]) -> None:
        receive_ep, send_ep, monitor_ep = self._endpoints_wanted

        def make(kind: int, name: str) -> zmq.Socket[bytes]:
            s: zmq.Socket[bytes] = ctx.socket(kind)
            sockets.append(s)
            s.setsockopt(zmq.LINGER, self._linger)
            if kind == zmq.ROUTER:
                s.setsockopt(zmq.SNDHWM, self._hwm)
                s.setsockopt(zmq.RCVHWM, self._hwm)
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # A peer with a fixed routing id that reconnects takes it over, instead
                # of being refused while its old connection lingers.
                s.setsockopt(zmq.ROUTER_HANDOVER, 1)
            apply_server(s, self._keys)
            return s

        self._rx = make(zmq.ROUTER, "receive")
        self._tx_events: zmq.Socket[bytes] | None = None
        if self._send_mode == "dealer":
            self._tx = make(zmq.DEALER, "send")
            # Per consumer connection: at most ``inflight`` deliveries queued unread.
            self._tx.setsockopt(zmq.SNDHWM, self._inflight_limit)
            self._tx.setsockopt(zmq.RCVHWM, self._hwm)
            self._tx.setsockopt(zmq.ROUTING_ID, self.queue_id)
            # Consumer connections come and go unseen by a DEALER: a socket monitor
            # counts them (the in-flight cap) and tells when the last one is gone.
            # (ACCEPTED, not HANDSHAKE_SUCCEEDED: only the former carries the fd.)
            events = self._tx.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            sockets.append(events)
            self._tx_events = events
        else:
            self._tx = make(zmq.ROUTER, "send")
            self._tx.setsockopt(zmq.ROUTING_ID, self.queue_id)
            notify = getattr(zmq, "ROUTER_NOTIFY", None)
            notified = False
            if notify is not None:
                # Draft libzmq only (EINVAL otherwise): announce consumers on connect.
                with contextlib.suppress(zmq.ZMQError):
                    self._tx.setsockopt(notify, getattr(zmq, "NOTIFY_CONNECT", 1))
                    notified = True
            if not notified:
                log.warning(
                    "queue: send_mode router without ZMQ_ROUTER_NOTIFY (a draft libzmq): "
                    "only consumers that announce themselves (ZMQ_PROBE_ROUTER) are "
                    "served, and after a queue restart only once they speak again"
                )
        self._mon = make(zmq.REP, "monitor") if monitor_ep is not None else None
        for name, s, ep in (
            ("receive", self._rx, receive_ep),
            ("send", self._tx, send_ep),
            ("monitor", self._mon, monitor_ep),
        ):
            if s is None or ep is None:
                continue
            try:
                s.bind(ep)
            except zmq.ZMQError as e:
                raise TransportError(f"cannot bind the {name} socket: {e}", endpoint=ep) from e
            actual = s.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoints[name] = actual.decode() if isinstance(actual, bytes) else str(actual)

    def _open_flows(self, ctx: zmq.Context[Any], store: MessageStore) -> None:
        producer_ep, consumer_ep = self._flow_wanted
        if producer_ep is None and consumer_ep is None:
            return
        sync = self.options.sync
        producer: FlowProducerPort | None = None
        consumer: FlowConsumerPort | None = None
        try:
            if producer_ep is not None:
                # Before anything else takes from the store: it reclaims its messages.
                producer = FlowProducerPort(
                    store,
                    producer_ep,
                    ctx=ctx,
                    window=self._flow_window,
                    max_take=self._max_batch,
                    sync=sync,
                    curve=self._curve,
                    linger_ms=self._linger,
                    gate=self._gate,
                    heartbeat_interval=self.options.flow_heartbeat_interval,
                    heartbeat_timeout=self.options.flow_heartbeat_timeout,
                    conn_check=self.options.flow_conn_check,
                )
            if consumer_ep is not None:
                consumer = FlowConsumerPort(
                    self._store_path,
                    consumer_ep,
                    after_durable=self.after_durable,
                    wake=self._wake,
                    ctx=ctx,
                    max_put=self._max_batch,
                    fsync=sync,
                    curve=self._curve,
                    linger_ms=self._linger,
                )
        except BaseException:
            if producer is not None:
                producer.close()
            raise
        self._flows = QueueFlows(producer, consumer)
        self.endpoints.update(self._flows.endpoints())

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None:
            waker.wake()

    def _sync_worker(self) -> None:
        while True:
            ticket = self._sync_q.get()
            if ticket is None:
                return
            ticket.run()
            self._wake()  # the loop ends the commit and sends its acks

    # ------------------------------------------------------------------ serving

    def _open_sides(self, store: MessageStore) -> None:
        """The receive and send sides over the bound sockets (before the flow ports,
        which register durability callbacks)."""
        self._receiving = ReceiveSide(
            self._rx,
            store,
            self.counters,
            dedup=self._dedup,
            dedup_window=self.options.dedup_window,
            dedup_grace=self._dedup_grace,
            ack_backlog=self._ack_backlog,
            max_batch=self._max_batch,
            sync=self._sync_q.put,
            busy=lambda: self._flows is not None and self._flows.busy(),
        )
        self._sending = SendSide(
            self._tx,
            self._tx_events,
            store,
            self.counters,
            dealer=self._send_mode == "dealer",
            inflight=self._inflight_limit,
            max_batch=self._max_batch,
            ack_timeout_us=self._ack_timeout_us,
            want_pollout=self._want_pollout,
        )

    def _want_pollout(self, on: bool) -> None:
        self._poller.modify(self._tx, POLLIN | POLLOUT if on else POLLIN)

    def after_durable(self, callback: Callable[[bool], None]) -> None:
        """Run ``callback(ok)`` in the broker thread once every put made so far is
        durable (``ok`` True), or the commit covering them failed (False).

        Broker thread only (the flow ports use it).
        """
        assert self._receiving is not None, "after_durable before the broker started"
        self._receiving.durable_cbs.append(callback)

    def _serve(self, store: MessageStore) -> None:
        rx, tx, mon = self._rx, self._tx, self._mon
        receiving, sending = self._receiving, self._sending
        assert receiving is not None and sending is not None
        self._next_tick = 0.0
        poller = zmq.Poller()
        poller.register(rx, zmq.POLLIN)
        poller.register(tx, zmq.POLLIN)
        self._poller = poller
        tx_events = self._tx_events
        if tx_events is not None:
            poller.register(tx_events, zmq.POLLIN)
        if mon is not None:
            poller.register(mon, zmq.POLLIN)
        waker = self._waker
        assert waker is not None  # set by start() before the thread runs
        poller.register(waker, zmq.POLLIN)
        flows = self._flows
        flow_sockets = flows.sockets() if flows is not None else []
        for sock in flow_sockets:
            poller.register(sock, zmq.POLLIN)
        guard = self._guard
        self._last_stats = self._collect_stats(store)
        while not self._stopping.is_set():
            events = dict(poller.poll(self._poll_timeout_ms(receiving, sending)))
            if waker.fd in events:
                waker.drain()
                if self._stopping.is_set():
                    break
            guard(receiving.finish_commit)
            if rx in events:
                guard(receiving.receive)
            if tx_events is not None and tx_events in events:
                guard(sending.consumer_links)
            tx_ready = events.get(tx, 0)
            if tx_ready & POLLIN:
                guard(sending.receive)
            if tx_ready & POLLOUT:
                sending.writable()
            if mon is not None and mon in events:
                guard(self._answer_monitor)
            if flows is not None and any(sock in events for sock in flow_sockets):
                guard(flows.process, store)
            guard(self._housekeeping, receiving, sending)
            guard(receiving.begin_commit)
            if flows is not None:  # after a commit (maybe inline), before PZQ consumers
                guard(flows.pump, store)
            guard(sending.dispatch)
            now = time.monotonic()
            if now >= self._next_tick:
                self._next_tick = now + _TICK_S
                guard(self._tick, receiving, sending)
        receiving.shutdown()

    def _guard(self, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except Exception:  # a bug; the server keeps serving everybody else
            self.counters["errors"] += 1
            log.exception("queue broker: unexpected error in %s", step.__name__)

    def _poll_timeout_ms(self, receiving: ReceiveSide, sending: SendSide) -> int:
        now = time.monotonic()
        wait = receiving.wait(now)
        if wait == 0.0:
            return 0
        if self._flows is not None and self._flows.busy():
            return 0
        tick = max(0.0, self._next_tick - now)
        wait = tick if wait is None else min(wait, tick)
        deadline = sending.inflight.next_deadline()
        if deadline is not None:
            wait = min(wait, max(0.0, (deadline - now_us()) / 1e6 + 0.001))
        return max(0, int(wait * 1000))

    def _housekeeping(self, receiving: ReceiveSide, sending: SendSide) -> None:
        sending.expire(now_us())
        receiving.housekeeping(time.monotonic())

    def _tick(self, receiving: ReceiveSide, sending: SendSide) -> None:
        store = self._store
        self._last_stats = self._collect_stats(store)
        # Retiring a fully acked active segment costs syncs and an ids snapshot: only
        # when producers have been quiet for a while, never between busy commits.
        if (
            receiving.ticket is None
            and not store.dirty
            and not store.failed
            and time.monotonic() - receiving.last_put > _IDLE_S
        ):
            store.maintain()
        sending.refresh()  # also consumers skipped because their pipe was full

    # ------------------------------------------------------------------ monitor

    def _answer_monitor(self) -> None:
        mon = self._mon
        assert mon is not None
        for _ in range(64):
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                decode_monitor_request(frames)
            except RemoteProtocolError as e:
                self.counters["bad_monitor_requests"] += 1
                reply = [f"error: {e}".replace("\n", " ").encode("utf-8", "replace")]
            else:
                reply = encode_monitor_reply(self._collect_stats(self._store))
            mon.send_multipart(reply)  # REP: must answer before the next request

    def _collect_stats(self, store: MessageStore) -> dict[str, int | str]:
        c = self.counters
        s = store.stats()
        sending, receiving = self._sending, self._receiving
        in_flight = len(sending.inflight) if sending is not None else 0
        stats: dict[str, int | str] = {
            "messages": s.messages,
            "messages_in_flight": in_flight,
            "db_size": s.db_size,
            "in_flightdb_size": s.in_flight_bytes,
            "syncs": s.syncs,
            "expired_messages": c["expired_messages"],
            "messages_inflight": in_flight,
            "inflight_db_size": s.in_flight_bytes,
            "delivered": c["delivered"],
            "acked": c["acked"],
            "nacked": c["nacked"],
            "redelivered": c["redelivered"],
            "producers": len(receiving.producers) if receiving is not None else 0,
            "consumers": sending.consumer_count if sending is not None else 0,
            "received": c["received"],
            "stored": s.stored,
            "duplicates": c["duplicates"],
            "rejected": c["rejected"],
            "bad_frames": c["bad_frames"],
            "unknown_acks": c["unknown_acks"],
            "acks_undeliverable": c["acks_undeliverable"],
            "acks_dropped": c["acks_dropped"],
            "commits": s.commits,
            "segments": s.segments,
            "errors": c["errors"],
            "store_failed": 1 if s.failed else 0,
            **(
                self._flows.stats()
                if self._flows is not None
                else {"flow_given": 0, "flow_acked": 0, "flow_stored": 0}
            ),
            "vanished_requeued": c["vanished_requeued"],
            "hellos": c["hellos"],
            "send_mode": self._send_mode,
            "dedup": self._dedup,
        }
        assert tuple(stats) == MONITOR_KEYS + REFERENCE_MONITOR_KEYS + EXTRA_MONITOR_KEYS
        return stats
