"""The PZQ-style queue server: three sockets over a durable :class:`MessageStore`.

Theory of operation (spec: ``specs/pzq-sockets-and-formats.txt``; DESIGN.md "The
PZQ-style queue"; frames: :mod:`zio_spark.protocol.pzq`)
---------------------------------------------------------------------------------------
One thread owns the three sockets and the store; a second thread only runs the store's
``write`` + ``fdatasync`` (a :class:`~zio_spark.storage.store.CommitTicket`), so the first
keeps receiving, delivering and answering while the disk syncs.

*receive* (ROUTER, producers connect with DEALER): ``[id, *extra, "", *body]``. Each
message is put into the store's buffer; when no commit is outstanding, everything
buffered becomes one commit (group commit: one ``fdatasync`` for all producers' messages
since the last one). Only when that commit has ended does each producer get its ack
``[id, "1", "", ""]``. A duplicate id (one in the store's duplicate window) is not
stored again and is acked ``1`` once its original is durable. Failures get
``[id, "0", "", reason]``: bad frames whose id is readable, ids over
:data:`~zio_spark.storage.store.MAX_ID_BYTES`, oversized messages, a failed store. Frames
without a readable id are dropped and counted (``bad_frames``). Acks never get dropped
silently: a producer over its high-water mark gets them later (``ROUTER_MANDATORY``
turns the would-be drop into ``EAGAIN``, per peer), from a backlog of its own, so a
producer that reads no acks delays nobody else's. Each backlog is bounded
(``ack_backlog`` acks; all of them together by :data:`_MAX_BACKLOG_TOTAL` and
:data:`_MAX_BACKLOG_PRODUCERS`): beyond that the oldest acks of the producer stuck
longest are dropped, counted (``acks_dropped``) and logged once per producer. Acks for a
producer that has gone away are counted (``acks_undeliverable``). Either way the
producer resends what it saw no ack for, and the resend is acked as a duplicate.

*send* (consumers connect with ROUTER): deliveries ``[queue id, message id, sent µs, ack
timeout µs, "", *body]`` as the consumer sees them. The message id is the producer's id
(so every redelivery of a message carries the same id). The consumer answers ``[queue id,
message id, "1"]`` (delete it) or ``"0"`` (requeue now); no answer within the ack timeout
requeues it for redelivery (``expired_messages``). The socket's ``ZMQ_ROUTING_ID`` is
the queue id (stable, kept in the store): it is part 0 of what consumers receive.

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

Hot paths. The canonical frames (``[id, "", body]`` in, ``[id, "1", "", ""]`` and the
delivery out, ``[id, "1"|"0"]`` back) are built and parsed inline, and sent/received
through pyzmq's backend socket methods with int flags (pyzmq's ``send_multipart`` spent
most of its time on enum flag arithmetic); anything not canonical goes through the
:mod:`zio_spark.protocol.pzq` codecs, and a test checks that both agree.

Duplicates (``dedup``). ``"resend"`` (default): a repeated id is acked and not stored
only when it can be a resend of a message whose ack the producer missed: same producer
connection within the window, or the queue has not acked the first copy (commit running,
ack dropped or undeliverable), or the copy was found on disk less than ``dedup_grace``
after start. A new message reusing an id the queue acked to another connection is
stored. ``"global"``: ids are global over the store's window, across restarts. Should two
stored messages share an id, the second waits until the first is no longer in flight, so
acks stay unambiguous.

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
knows the key may connect (see :func:`zio_spark.transport.start_authenticator`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from zio_spark.errors import ConfigError, RemoteProtocolError, TransportError
from zio_spark.protocol.pzq import (
    ACK_FAILURE,
    ACK_SUCCESS,
    DELIMITER,
    MONITOR_KEYS,
    REFERENCE_MONITOR_KEYS,
    InFlight,
    ProducerAck,
    decode_consumer_ack,
    decode_monitor_request,
    decode_producer_message,
    encode_monitor_reply,
    encode_producer_ack,
)
from zio_spark.pzq.flow_ports import (
    DEFAULT_FLOW_WINDOW,
    FlowConsumerPort,
    FlowProducerPort,
    QueueFlows,
)
from zio_spark.storage.store import (
    DEFAULT_DEDUP_WINDOW,
    DEFAULT_SEGMENT_BYTES,
    CommitTicket,
    MessageRejected,
    MessageStore,
    StoreError,
)
from zio_spark.transport.curve import key_pair

__all__ = [
    "DEDUP_RULES",
    "DEFAULT_MONITOR",
    "DEFAULT_RECEIVE",
    "DEFAULT_SEND",
    "EXTRA_MONITOR_KEYS",
    "SEND_MODES",
    "QueueBroker",
]

log = logging.getLogger(__name__)

DEFAULT_RECEIVE: Final = "tcp://127.0.0.1:11131"
"""Default receive endpoint (PZQ's port; loopback only unless told otherwise)."""
DEFAULT_SEND: Final = "tcp://127.0.0.1:11132"
"""Default send endpoint."""
DEFAULT_MONITOR: Final = "tcp://127.0.0.1:11133"
"""Default monitor endpoint."""

SEND_MODES: Final = ("dealer", "router")
"""Kinds of send socket: ``dealer`` (default; serves any PZQ consumer) or ``router``."""
DEDUP_RULES: Final = ("resend", "global", "off")
"""Duplicate rules for producer ids: ``resend`` (default), ``global``, ``off``."""
DEFAULT_DEDUP_GRACE: Final = 60.0
"""Default ``dedup_grace``, seconds after start during which ids found on disk count as
possibly unacked (their producers may resend them)."""
MAX_ACK_TIMEOUT_S: Final = 86400.0
"""Longest ack timeout accepted (a day): anything longer is a unit mistake."""

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

_PRODUCER_WINDOW_S: Final = 60.0  # "producers" counts identities seen this recently
_TOMBSTONE_DELAY_S: Final = 0.05  # acks alone are committed after at most this long...
_TOMBSTONE_BATCH: Final = 4096  # ...or once this many are buffered
_BACKLOG_RETRY_S: Final = 0.01  # retry acks a producer's full pipe refused
DEFAULT_ACK_BACKLOG: Final = 10_000
"""Default ``ack_backlog``: most acks kept for one producer whose pipe is full."""
# Bounds over all producers' ack backlogs (memory, and the cost of one retry round):
# past either, the producer whose backlog is oldest loses its oldest ack.
_MAX_BACKLOG_TOTAL: Final = 1_000_000
_MAX_BACKLOG_PRODUCERS: Final = 1024
_MAX_WARNED: Final = 4096  # producers remembered as already logged for dropped acks
_SUCCESS_TAIL: Final = (ACK_SUCCESS, DELIMITER, b"")
_INLINE_COMMIT_PUTS: Final = 8  # commits this small sync in the broker thread
_TICK_S: Final = 0.1  # refresh stats() and retry consumers whose pipes were full
_IDLE_S: Final = 1.0  # no producer message for this long: tidy the store


# pyzmq's send_multipart/recv_multipart spend most of their time on enum flag arithmetic
# (measured 4x slower than the backend calls with int flags for a 5-part ack), so the hot
# paths call the backend socket methods directly. Semantics are the same: a ROUTER
# accepts or refuses (EAGAIN/EHOSTUNREACH) a message at its first part.
# (Reading RCVMORE through getsockopt builds an enum per part too, so receiving goes
# through Frame objects, whose ``more`` is read at receive time.)
_backend_send = zmq.backend.Socket.send
_backend_recv = zmq.backend.Socket.recv
_NOBLOCK: Final = int(zmq.NOBLOCK)
_MORE_NOBLOCK: Final = int(zmq.SNDMORE | zmq.NOBLOCK)


def _recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One whole multipart message, without blocking; raises ``zmq.Again`` if none."""
    frame = _backend_recv(sock, _NOBLOCK, False)
    parts = [frame.bytes]
    while frame.more:
        frame = _backend_recv(sock, _NOBLOCK, False)
        parts.append(frame.bytes)
    return parts


def _send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """Send a multipart message without blocking (``zmq.Again`` if refused)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _backend_send(sock, frame, _MORE_NOBLOCK if i < last else _NOBLOCK)


def _now_us() -> int:
    return time.time_ns() // 1000


def _check_count(option: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(option, value, f"an integer >= {minimum}")
    return value


def _curve_keys(secret: str | bytes) -> tuple[bytes, bytes]:
    """(secret, public) Z85 keys from a Z85 (40 chars) or raw (32 bytes) secret key."""
    return key_pair(secret)


class _AckBacklog:
    """Acks one producer's full pipe refused, oldest first: a message id (a success
    ack, the hot case, stored small) or the whole ack after the routing id."""

    __slots__ = ("acks",)

    def __init__(self) -> None:
        self.acks: deque[bytes | tuple[bytes, ...]] = deque()


class _Consumer:
    __slots__ = ("ident", "ready")

    def __init__(self, ident: bytes) -> None:
        self.ident = ident
        self.ready = False  # in the round-robin deque


class QueueBroker:
    """The PZQ-style queue server (see the module docstring). A context manager.

    Parameters
    ----------
    store_path
        Folder of the durable store (created if missing; one broker per folder).
    receive, send, monitor
        Endpoints to bind (``tcp://127.0.0.1:*`` picks a free port; ``monitor=None``
        disables the monitor socket).
    ack_timeout
        Seconds a consumer has to ack a delivery before it is requeued (> 0, at most
        :data:`MAX_ACK_TIMEOUT_S`). Deliveries carry it in microseconds.
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
        ``duplicates``). ``"resend"`` (default): only a message that can be a resend of
        one whose ack the producer may have missed: the first copy came on the same
        producer connection (among the last ``dedup_window`` messages), or the queue
        has not acked it (its commit is running, or its ack was dropped or could not be
        delivered), or it was found on disk at start less than ``dedup_grace`` ago. A
        new message reusing an id the queue did ack to another connection (the
        reference producer's second run) is stored. ``"global"``: any id among the last
        ``dedup_window`` messages, across restarts (for producers with globally unique
        ids). ``"off"``: every message is stored.
    dedup_grace
        Seconds after start during which, under ``"resend"``, ids found on disk are
        duplicates (a producer whose ack was lost in a crash resends them).
    curve_secret_key
        Make all sockets CURVE servers with this secret key (Z85 or 32 raw bytes).
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
    context
        A zmq context to use (default: a private one, terminated at stop).

    Raises
    ------
    ConfigError
        For a bad option value.
    TransportError
        If a CURVE key is given but libzmq has no CURVE support.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str],
        *,
        receive: str = "tcp://127.0.0.1:*",
        send: str = "tcp://127.0.0.1:*",
        monitor: str | None = "tcp://127.0.0.1:*",
        ack_timeout: float = 5.0,
        hwm: int = 10_000,
        ack_backlog: int = DEFAULT_ACK_BACKLOG,
        inflight: int = 1000,
        curve_secret_key: str | bytes | None = None,
        queue_id: bytes | None = None,
        max_batch: int = 4096,
        dedup_window: int = DEFAULT_DEDUP_WINDOW,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        sync: bool = True,
        linger_ms: int = 500,
        flow_producer: str | None = None,
        flow_consumer: str | None = None,
        flow_window: int = DEFAULT_FLOW_WINDOW,
        send_mode: str = "dealer",
        dedup: str = "resend",
        dedup_grace: float = DEFAULT_DEDUP_GRACE,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if (
            isinstance(ack_timeout, bool)
            or not isinstance(ack_timeout, (int, float))
            or not 0 < ack_timeout <= MAX_ACK_TIMEOUT_S
        ):
            raise ConfigError(
                "ack_timeout",
                ack_timeout,
                f"a number of seconds > 0, at most {MAX_ACK_TIMEOUT_S:g}",
            )
        if send_mode not in SEND_MODES:
            raise ConfigError("send_mode", send_mode, "one of " + ", ".join(SEND_MODES))
        if dedup not in DEDUP_RULES:
            raise ConfigError("dedup", dedup, "one of " + ", ".join(DEDUP_RULES))
        if (
            isinstance(dedup_grace, bool)
            or not isinstance(dedup_grace, (int, float))
            or not 0 <= dedup_grace <= 7 * 86400
        ):
            raise ConfigError("dedup_grace", dedup_grace, "seconds, 0 to 604800")
        self._send_mode = send_mode
        self._dedup = dedup
        self._dedup_grace = float(dedup_grace)
        for option, value in (("receive", receive), ("send", send)):
            if not isinstance(value, str) or not value:
                raise ConfigError(option, value, "an endpoint string")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigError("monitor", monitor, "an endpoint string or None")
        for option, flow_ep in (("flow_producer", flow_producer), ("flow_consumer", flow_consumer)):
            if flow_ep is not None and (not isinstance(flow_ep, str) or not flow_ep):
                raise ConfigError(option, flow_ep, "an endpoint string or None")
        self._flow_wanted = (flow_producer, flow_consumer)
        self._flow_window = _check_count("flow_window", flow_window, 1)
        self._flows: QueueFlows | None = None
        if queue_id is not None and (
            not isinstance(queue_id, bytes) or not 0 < len(queue_id) <= 255 or queue_id[0] == 0
        ):
            raise ConfigError("queue_id", queue_id, "1 to 255 bytes, not starting with a 0 byte")
        self._store_path = Path(store_path)
        self._endpoints_wanted = (receive, send, monitor)
        self._ack_timeout_us = max(1, round(ack_timeout * 1e6))
        self._hwm = _check_count("hwm", hwm, 0)
        self._ack_backlog = _check_count("ack_backlog", ack_backlog, 1)
        self._backlog_total = max(_MAX_BACKLOG_TOTAL, self._ack_backlog)
        self._inflight_limit = _check_count("inflight", inflight, 1)
        self._max_batch = _check_count("max_batch", max_batch, 1)
        self._linger = _check_count("linger_ms", linger_ms, 0)
        self._curve = _curve_keys(curve_secret_key) if curve_secret_key is not None else None
        self._queue_id_wanted = queue_id
        self._store_options = {
            "dedup_window": _check_count("dedup_window", dedup_window, 0),
            "segment_bytes": _check_count("segment_bytes", segment_bytes, 4096),
            "sync": bool(sync),
        }
        self._given_ctx = context
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._wake_r, self._wake_w = -1, -1
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

    # ------------------------------------------------------------------ public API

    @property
    def curve_public_key(self) -> bytes | None:
        """The servers' Z85 CURVE public key (clients need it), or None without CURVE."""
        return self._curve[1] if self._curve else None

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
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._thread = threading.Thread(target=self._main, name="zio-queue", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TransportError(f"the queue broker did not start within {timeout} s")
        if self._start_error is not None:
            self._thread.join()
            self._close_pipe()
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
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")
        thread.join(timeout)
        if thread.is_alive():
            raise TransportError(f"the queue broker did not stop within {timeout} s")
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

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
        self._done_r, self._done_w = os.pipe()
        os.set_blocking(self._done_r, False)
        try:
            try:
                store = MessageStore(self._store_path, **self._store_options)  # type: ignore[arg-type]
                self.queue_id = self._queue_id_wanted or store.queue_id
                self._open_sockets(ctx, sockets)
                self._open_flows(ctx, store)
            except BaseException as e:
                self._start_error = e
                return
            finally:
                self._ready.set()
            self._store = store
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
            if self._given_ctx is None:
                ctx.term()
            for fd in (self._done_r, self._done_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

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
            if self._curve is not None:
                s.setsockopt(zmq.CURVE_SERVER, 1)
                s.setsockopt(zmq.CURVE_SECRETKEY, self._curve[0])
                s.setsockopt(zmq.CURVE_PUBLICKEY, self._curve[1])
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
        curve = self._curve[0] if self._curve is not None else None
        sync = bool(self._store_options["sync"])
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
                    curve_secret_key=curve,
                    linger_ms=self._linger,
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
                    curve_secret_key=curve,
                    linger_ms=self._linger,
                )
        except BaseException:
            if producer is not None:
                producer.close()
            raise
        self._flows = QueueFlows(producer, consumer)
        self.endpoints.update(self._flows.endpoints())

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"w")

    def _sync_worker(self) -> None:
        while True:
            ticket = self._sync_q.get()
            if ticket is None:
                return
            ticket.run()
            with contextlib.suppress(OSError):
                os.write(self._done_w, b"d")

    # ------------------------------------------------------------------ serving

    def _serve(self, store: MessageStore) -> None:
        rx, tx, mon = self._rx, self._tx, self._mon
        # dealer mode: one pseudo-consumer b"" holds everything; the cap is global.
        inflight = InFlight(None if self._send_mode == "dealer" else self._inflight_limit)
        self._inflight = inflight
        self._keys: dict[bytes, int] = {}  # message id -> store key, while in flight
        self._deferred: dict[bytes, list[int]] = {}  # id in flight -> more keys, same id
        self._consumers: dict[bytes, _Consumer] = {}
        self._ready_q: deque[_Consumer] = deque()
        # dealer mode: the consumer connections (fds, from the socket monitor), and
        # whether the DEALER refused a send (all pipes full, or none attached yet).
        self._links: dict[int, int] = {}  # fd -> when we learnt of it (µs)
        self._tx_blocked = False
        # dedup "resend": (producer routing id, message id) of recent puts, oldest
        # first; ids whose success ack is not sent yet (count of copies); ids whose ack
        # was dropped or undeliverable, oldest first. Each bounded by dedup_window
        # (_unacked by the commit pipeline and the ack backlogs).
        self._recent: set[tuple[bytes, bytes]] = set()
        self._recent_order: deque[tuple[bytes, bytes]] = deque()
        self._recent_limit = int(self._store_options["dedup_window"])
        self._track_acks = self._dedup == "resend" and self._recent_limit > 0
        self._unacked: dict[bytes, int] = {}
        self._lost: set[bytes] = set()
        self._lost_order: deque[bytes] = deque()
        self._grace_until = time.monotonic() + self._dedup_grace
        self._producers: dict[bytes, float] = {}
        self._acks: list[tuple[bytes, bytes]] = []  # (producer, id) awaiting a commit
        self._ticket: CommitTicket | None = None
        self._ticket_acks: list[tuple[bytes, bytes]] = []
        # Callbacks run once everything put so far is durable (flows.py's bridge), with
        # True, or False if that commit failed; they travel with the acks.
        self._durable_cbs: list[Callable[[bool], None]] = []
        self._ticket_cbs: list[Callable[[bool], None]] = []
        # Acks refused with EAGAIN, per producer routing id; dict order = since when
        # each backlog is non-empty (oldest first). _backlogged counts all their acks.
        self._backlogs: dict[bytes, _AckBacklog] = {}
        self._backlogged = 0
        self._next_flush = 0.0
        self._warned: set[bytes] = set()  # producers logged for dropped acks
        self._tombstones_since = 0.0
        self._next_prune = time.monotonic() + _PRODUCER_WINDOW_S
        self._next_tick = 0.0
        self._last_put = 0.0
        self._timeout_bytes = str(self._ack_timeout_us).encode("ascii")
        poller = zmq.Poller()
        poller.register(rx, zmq.POLLIN)
        poller.register(tx, zmq.POLLIN)
        self._poller = poller
        tx_events = self._tx_events
        if tx_events is not None:
            poller.register(tx_events, zmq.POLLIN)
        dealer = self._send_mode == "dealer"
        if mon is not None:
            poller.register(mon, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._done_r, zmq.POLLIN)
        flows = self._flows
        flow_sockets = flows.sockets() if flows is not None else []
        for sock in flow_sockets:
            poller.register(sock, zmq.POLLIN)
        self._last_stats = self._collect_stats(store)
        while not self._stopping.is_set():
            events = dict(poller.poll(self._poll_timeout_ms(store)))
            if self._wake_r in events:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 64)
                if self._stopping.is_set():
                    break
            if self._done_r in events:
                with contextlib.suppress(OSError):
                    os.read(self._done_r, 64)
            self._guard(self._finish_commit, store)
            if rx in events:
                self._guard(self._receive_producers, store)
            if tx_events is not None and tx_events in events:
                self._guard(self._consumer_links, store)
            tx_ready = events.get(tx, 0)
            if tx_ready & zmq.POLLIN:
                self._guard(self._receive_dealer_acks if dealer else self._receive_consumers, store)
            if tx_ready & zmq.POLLOUT:
                self._tx_blocked = False
                poller.modify(tx, zmq.POLLIN)
            if mon is not None and mon in events:
                self._guard(self._answer_monitor, store)
            if flows is not None and any(sock in events for sock in flow_sockets):
                self._guard(flows.process, store)
            self._guard(self._housekeeping, store)
            self._guard(self._begin_commit, store)
            if flows is not None:  # after a commit (maybe inline), before PZQ consumers
                self._guard(flows.pump, store)
            self._guard(self._dispatch_dealer if dealer else self._dispatch, store)
            now = time.monotonic()
            if now >= self._next_tick:
                self._next_tick = now + _TICK_S
                self._guard(self._tick, store)
        self._shutdown(store)

    def _guard(self, step: Any, store: MessageStore) -> None:
        try:
            step(store)
        except Exception:  # a bug; the server keeps serving everybody else
            self.counters["errors"] += 1
            log.exception("queue broker: unexpected error in %s", step.__name__)

    def _poll_timeout_ms(self, store: MessageStore) -> int:
        if self._ticket is None and (self._acks or store.buffered_puts or self._durable_cbs):
            return 0
        if self._flows is not None and self._flows.busy():
            return 0
        now = time.monotonic()
        wait = max(0.0, self._next_tick - now)
        if self._backlogs:
            wait = min(wait, max(0.0, self._next_flush - now) + 0.001)
        if store.pending_tombstones and self._ticket is None:
            wait = min(wait, max(0.0, self._tombstones_since + _TOMBSTONE_DELAY_S - now))
        deadline = self._inflight.next_deadline()
        if deadline is not None:
            wait = min(wait, max(0.0, (deadline - _now_us()) / 1e6 + 0.001))
        return max(0, int(wait * 1000))

    def _shutdown(self, store: MessageStore) -> None:
        """Finish the outstanding commit and commit the buffer, then ack producers."""
        ticket = self._ticket
        if ticket is not None:
            ticket.wait()
            self._finish_commit(store)
        if not store.failed and (self._acks or store.dirty or self._durable_cbs):
            try:
                store.commit()
            except StoreError as e:
                self._fail_acks(self._acks, str(e))
                self._run_durable_cbs(self._take_durable_cbs(), False)
            else:
                self._send_acks(self._acks)
                self._run_durable_cbs(self._take_durable_cbs(), True)
            self._acks = []
        self._flush_backlogs()

    # ------------------------------------------------------------------ producers

    def _receive_producers(self, store: MessageStore) -> None:
        rx = self._rx
        now = time.monotonic()
        producers = self._producers
        acks = self._acks
        put = store.put
        counters = self.counters
        rule = self._dedup
        scoped = self._track_acks
        recent = self._recent
        unacked = self._unacked
        lost = self._lost
        in_grace = now < self._grace_until
        self._last_put = now
        for _ in range(self._max_batch):
            try:
                frames = _recv_frames(rx)
            except zmq.Again:
                break
            counters["received"] += 1
            ident = frames[0]
            producers[ident] = now
            # Fast path for the canonical [id, "", body] (what decode_producer_message
            # returns for it; tests check they agree); everything else goes to the codec.
            if len(frames) == 4 and frames[2] == DELIMITER and frames[1]:
                message_id = frames[1]
                body: Sequence[bytes] = frames[3:]
            else:
                try:
                    message = decode_producer_message(frames[1:])
                except RemoteProtocolError as e:
                    counters["bad_frames"] += 1
                    log.debug("queue: bad producer message from %r: %s", ident, e)
                    if len(frames) > 1 and frames[1]:
                        self._send_producer_ack(ident, frames[1], False, f"bad message: {e}")
                    continue
                message_id, body = message.message_id, message.body
            if store.failed:
                self._send_producer_ack(ident, message_id, False, f"store failed: {store.failed}")
                continue
            if scoped and (
                (ident, message_id) in recent
                or message_id in unacked
                or message_id in lost
                or (in_grace and store.accepted_before_open(message_id))
            ):
                # Can be a resend of a message whose ack the producer missed: acked, once
                # the original is durable (with the next commit's acks), not stored.
                counters["duplicates"] += 1
                unacked[message_id] = unacked.get(message_id, 0) + 1
                acks.append((ident, message_id))
                continue
            try:
                key = put(message_id, body, dedup=rule == "global")
            except MessageRejected as e:
                counters["rejected"] += 1
                self._send_producer_ack(ident, message_id, False, str(e))
                continue
            except StoreError as e:
                self._send_producer_ack(ident, message_id, False, str(e))
                continue
            if key is None:
                counters["duplicates"] += 1
            elif scoped:
                self._remember(ident, message_id)
                unacked[message_id] = unacked.get(message_id, 0) + 1
            acks.append((ident, message_id))

    def _remember(self, ident: bytes, message_id: bytes) -> None:
        """Enter a put in the ``resend`` rule's per-connection window (oldest out)."""
        limit = self._recent_limit
        entry = (ident, message_id)
        self._recent.add(entry)
        order = self._recent_order
        order.append(entry)
        if len(order) > limit:
            self._recent.discard(order.popleft())

    def _ack_sent(self, message_id: bytes) -> None:
        """``resend`` rule: the ack of one copy of ``message_id`` left (or it failed)."""
        unacked = self._unacked
        n = unacked.get(message_id)
        if n is not None:
            if n > 1:
                unacked[message_id] = n - 1
            else:
                del unacked[message_id]

    def _ack_lost(self, ack: bytes | tuple[bytes, ...]) -> None:
        """``resend`` rule: a success ack (a bare id) was dropped or undeliverable, so a
        resend of that id is a duplicate (within the window)."""
        if not self._track_acks or not isinstance(ack, bytes):
            return
        self._ack_sent(ack)
        if ack not in self._lost:
            self._lost.add(ack)
            self._lost_order.append(ack)
            if len(self._lost_order) > self._recent_limit:
                self._lost.discard(self._lost_order.popleft())

    def _begin_commit(self, store: MessageStore) -> None:
        if self._ticket is not None:
            return
        if store.failed:
            if self._acks:  # cannot happen today (puts are refused first); never spin
                self._fail_acks(self._acks, f"store failed: {store.failed}")
                self._acks = []
            self._run_durable_cbs(self._take_durable_cbs(), False)
            return
        if not store.dirty:
            if self._acks:  # only duplicates of durable messages: ack them now
                self._send_acks(self._acks)
                self._acks = []
            self._run_durable_cbs(self._take_durable_cbs(), True)
            return
        if not self._acks and not store.buffered_puts:
            # Only tombstones: batch them a little (a lost one only means a redelivery).
            now = time.monotonic()
            if not self._tombstones_since:
                self._tombstones_since = now
            if (
                store.pending_tombstones < _TOMBSTONE_BATCH
                and now < self._tombstones_since + _TOMBSTONE_DELAY_S
            ):
                return
        self._tombstones_since = 0.0
        acks, self._acks = self._acks, []
        cbs = self._take_durable_cbs()
        try:
            ticket = store.begin_commit()
        except StoreError as e:
            self._fail_acks(acks, str(e))
            self._run_durable_cbs(cbs, False)
            return
        if ticket is None:
            self._send_acks(acks)
            self._run_durable_cbs(cbs, True)
            return
        self._ticket = ticket
        self._ticket_acks = acks
        self._ticket_cbs = cbs
        if ticket.puts <= _INLINE_COMMIT_PUTS and not (self._flows and self._flows.busy()):
            # Light load (e.g. one synchronous producer): sync right here. Handing a
            # one-message commit to the sync thread and back cost ~130 µs per message
            # here (two thread wake-ups and the GIL), a fifth of an fdatasync; nothing
            # arrives meanwhile that a pipelined commit could have taken, and libzmq
            # keeps queueing whatever does for the next commit.
            ticket.run()
            self._finish_commit(store)
            return
        self._sync_q.put(ticket)

    def _take_durable_cbs(self) -> list[Callable[[bool], None]]:
        cbs, self._durable_cbs = self._durable_cbs, []
        return cbs

    def _run_durable_cbs(self, cbs: list[Callable[[bool], None]], ok: bool) -> None:
        for cb in cbs:
            try:
                cb(ok)
            except Exception:  # a bug in a flow port; the broker keeps serving
                self.counters["errors"] += 1
                log.exception("queue broker: a durability callback failed")

    def after_durable(self, callback: Callable[[bool], None]) -> None:
        """Run ``callback(ok)`` in the broker thread once every put made so far is
        durable (``ok`` True), or the commit covering them failed (False).

        Broker thread only (the flow ports use it).
        """
        self._durable_cbs.append(callback)

    def _finish_commit(self, store: MessageStore) -> None:
        ticket = self._ticket
        if ticket is None or not ticket.done:
            return
        self._ticket = None
        acks, self._ticket_acks = self._ticket_acks, []
        cbs, self._ticket_cbs = self._ticket_cbs, []
        try:
            store.end_commit(ticket)
        except StoreError as e:
            # Every put not yet durable is gone: this commit's and the buffered ones.
            self._fail_acks(acks, str(e))
            self._fail_acks(self._acks, str(e))
            self._acks = []
            self._run_durable_cbs(cbs, False)
            self._run_durable_cbs(self._take_durable_cbs(), False)
            return
        self._send_acks(acks)
        self._run_durable_cbs(cbs, True)

    def _send_acks(self, acks: list[tuple[bytes, bytes]]) -> None:
        backlogs = self._backlogs
        if backlogs:
            self._flush_backlogs()
        rx = self._rx
        track = self._track_acks
        for ident, message_id in acks:
            if backlogs and ident in backlogs:  # keep each producer's acks in order
                self._defer_ack(ident, message_id)
                continue
            try:
                # [id, "1", "", ""] is encode_producer_ack(ProducerAck(id, True, "")).
                _send_frames(rx, (ident, message_id, *_SUCCESS_TAIL))
            except zmq.Again:  # this producer's pipe is full (ROUTER_MANDATORY)
                self._defer_ack(ident, message_id)
            except zmq.ZMQError:  # EHOSTUNREACH: the producer went away
                self.counters["acks_undeliverable"] += 1
                self._ack_lost(message_id)
            else:
                if track:
                    self._ack_sent(message_id)

    def _fail_acks(self, acks: list[tuple[bytes, bytes]], reason: str) -> None:
        for ident, message_id in acks:
            if self._track_acks:
                self._ack_sent(message_id)  # not stored: a resend must be
            self._send_producer_ack(ident, message_id, False, reason)

    def _send_producer_ack(self, ident: bytes, message_id: bytes, ok: bool, reason: str) -> None:
        ack = tuple(encode_producer_ack(ProducerAck(message_id, ok, reason)))
        if ident in self._backlogs:
            self._defer_ack(ident, ack)
            return
        try:
            _send_frames(self._rx, (ident, *ack))
        except zmq.Again:
            self._defer_ack(ident, ack)
        except zmq.ZMQError:
            self.counters["acks_undeliverable"] += 1

    def _defer_ack(self, ident: bytes, ack: bytes | tuple[bytes, ...]) -> None:
        """Keep an ack that ``ident``'s full pipe refused, for :meth:`_flush_backlogs`.

        Bounded: one producer keeps at most ``ack_backlog`` acks, all together at most
        ``_MAX_BACKLOG_TOTAL`` acks of ``_MAX_BACKLOG_PRODUCERS`` producers. Past a bound
        an oldest ack is dropped. That is safe: an ack only tells the producer it may
        forget a message. A producer resends what it has no ack for (spec: it "should
        maintain a list of messages sent ... and mark off acknowledged IDs"), and the
        store's duplicate window (ids of the last ``dedup_window`` messages, see
        :meth:`MessageStore.put`) turns the resend into a duplicate that is acked and not
        stored again; a resend later than the window is stored twice (at least once, as
        for any lost ack). A producer this far behind reads no acks anyway.
        """
        backlogs = self._backlogs
        backlog = backlogs.get(ident)
        if backlog is None:
            if len(backlogs) >= _MAX_BACKLOG_PRODUCERS:  # the one stuck longest loses all
                self._drop_backlog(next(iter(backlogs)))
            backlog = backlogs[ident] = _AckBacklog()
        elif len(backlog.acks) >= self._ack_backlog:
            self._ack_lost(backlog.acks.popleft())  # its oldest, to make room
            self._backlogged -= 1
            self._count_dropped(ident, 1)
        backlog.acks.append(ack)
        self._backlogged += 1
        if self._backlogged > self._backlog_total:
            self._drop_oldest_ack()

    def _drop_oldest_ack(self) -> None:
        """Drop the oldest ack of the producer whose backlog is the oldest, counted and
        logged once per producer."""
        backlogs = self._backlogs
        ident = next(iter(backlogs))
        acks = backlogs[ident].acks
        self._ack_lost(acks.popleft())
        self._backlogged -= 1
        if not acks:
            del backlogs[ident]
        self._count_dropped(ident, 1)

    def _drop_backlog(self, ident: bytes) -> None:
        backlog = self._backlogs.pop(ident)
        for ack in backlog.acks:
            self._ack_lost(ack)
        self._backlogged -= len(backlog.acks)
        self._count_dropped(ident, len(backlog.acks))

    def _count_dropped(self, ident: bytes, n: int) -> None:
        self.counters["acks_dropped"] += n
        warned = self._warned
        if ident not in warned:
            if len(warned) >= _MAX_WARNED:
                warned.clear()
            warned.add(ident)
            log.warning(
                "queue: producer %r reads no acks (its pipe is full and its ack backlog "
                "too): dropping its oldest acks; it gets them by resending (acked as "
                "duplicates). Logged once per producer; see acks_dropped",
                ident,
            )

    def _flush_backlogs(self) -> None:
        """Send what each producer's backlog holds, oldest first, until its pipe is full
        again: a refusal for one producer does not stop the others (``ROUTER_MANDATORY``
        refuses per peer)."""
        self._next_flush = time.monotonic() + _BACKLOG_RETRY_S
        backlogs = self._backlogs
        rx = self._rx
        sent = 0
        for ident, backlog in list(backlogs.items()):
            acks = backlog.acks
            while acks:
                ack = acks[0]
                try:
                    if isinstance(ack, bytes):
                        _send_frames(rx, (ident, ack, *_SUCCESS_TAIL))
                    else:
                        _send_frames(rx, (ident, *ack))
                except zmq.Again:
                    break
                except zmq.ZMQError:  # EHOSTUNREACH: gone, so are the rest of its acks
                    self.counters["acks_undeliverable"] += len(acks)
                    sent += len(acks)
                    for lost in acks:
                        self._ack_lost(lost)
                    acks.clear()
                    break
                acks.popleft()
                if isinstance(ack, bytes) and self._track_acks:
                    self._ack_sent(ack)
                sent += 1
            if not acks:
                del backlogs[ident]
        self._backlogged -= sent

    # ------------------------------------------------------------------ consumers

    def _hello(self, ident: bytes) -> _Consumer:
        consumer = self._consumers.get(ident)
        if consumer is None:
            consumer = self._consumers[ident] = _Consumer(ident)
            log.info("queue: consumer %r connected", ident)
            self._make_ready(consumer)
        return consumer

    def _make_ready(self, consumer: _Consumer) -> None:
        if not consumer.ready and self._inflight.can_send(consumer.ident):
            consumer.ready = True
            self._ready_q.append(consumer)

    def _receive_consumers(self, store: MessageStore) -> None:
        tx = self._tx
        counters = self.counters
        consumers = self._consumers
        for _ in range(self._max_batch):
            try:
                frames = _recv_frames(tx)
            except zmq.Again:
                break
            ident = frames[0]
            if len(frames) == 1 or (len(frames) == 2 and not frames[1]):
                counters["hellos"] += 1
                self._hello(ident)  # PROBE_ROUTER / ROUTER_NOTIFY hello
                continue
            # Fast path for the canonical [id, "1"|"0"] (decode_consumer_ack agrees).
            if len(frames) == 3 and frames[1] and frames[2] in (ACK_SUCCESS, ACK_FAILURE):
                message_id, ok = frames[1], frames[2] == ACK_SUCCESS
            else:
                try:
                    ack = decode_consumer_ack(frames[1:])
                except RemoteProtocolError as e:
                    counters["bad_frames"] += 1
                    log.debug("queue: bad consumer message from %r: %s", ident, e)
                    continue
                message_id, ok = ack.message_id, ack.ok
            consumer = consumers.get(ident) or self._hello(ident)
            if not self._settle(store, message_id, ok):
                continue
            # The slot freed is usually the acker's; if another consumer held the message
            # (a late ack from an earlier holder), _tick makes that one ready again.
            if not consumer.ready:
                self._make_ready(consumer)
            if message_id in self._deferred:
                self._release_deferred(store, message_id)

    def _settle(self, store: MessageStore, message_id: bytes, ok: bool) -> bool:
        """Apply a consumer's ack (``ok``) or nack to the store and the in-flight table;
        False for an id not in flight (late, already requeued, repeated, unknown)."""
        key = self._keys.pop(message_id, None)
        if key is None:
            self.counters["unknown_acks"] += 1
            return False
        if ok:
            self._inflight.ack(message_id)
            store.ack(key)
            self.counters["acked"] += 1
        else:
            self._inflight.nack(message_id)
            store.release(key)
            self.counters["nacked"] += 1
        return True

    def _receive_dealer_acks(self, store: MessageStore) -> None:
        """dealer mode: acks arrive without the consumer's identity (none is needed:
        the in-flight table knows each id)."""
        tx = self._tx
        counters = self.counters
        deferred = self._deferred
        for _ in range(self._max_batch):
            try:
                frames = _recv_frames(tx)
            except zmq.Again:
                break
            # Fast path for the canonical [id, "1"|"0"] (decode_consumer_ack agrees).
            if len(frames) == 2 and frames[0] and frames[1] in (ACK_SUCCESS, ACK_FAILURE):
                message_id, ok = frames[0], frames[1] == ACK_SUCCESS
            elif len(frames) == 1 and not frames[0]:
                counters["hellos"] += 1  # a consumer's ZMQ_PROBE_ROUTER: nothing to do
                continue
            else:
                try:
                    ack = decode_consumer_ack(frames)
                except RemoteProtocolError as e:
                    counters["bad_frames"] += 1
                    log.debug("queue: bad consumer message: %s", e)
                    continue
                message_id, ok = ack.message_id, ack.ok
            if self._settle(store, message_id, ok) and message_id in deferred:
                self._release_deferred(store, message_id)

    def _consumer_links(self, store: MessageStore) -> None:
        """dealer mode: follow consumer connections with the send socket's monitor.

        A DEALER does not say which connection got a message, but time does: a message
        sent before every connection still open was accepted can only be held by one
        that has gone. So when a connection goes, those are requeued at once (all in
        flight, when it was the last). The rest wait for their ack timeout.
        """
        events = self._tx_events
        assert events is not None
        links = self._links
        gone = False
        for _ in range(1024):
            try:
                event = recv_monitor_message(events, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                links[fd] = _now_us()
                log.info("queue: a consumer connected (%d now)", len(links))
            elif links.pop(fd, None) is not None:
                log.info("queue: a consumer went away (%d left)", len(links))
                gone = True
        if gone:
            oldest = min(links.values(), default=2**63)
            self._requeue_sent_before(store, oldest)

    def _requeue_sent_before(self, store: MessageStore, before_us: int) -> None:
        inflight = self._inflight
        gone = inflight.drop_sent_before(b"", before_us)
        for message_id in gone:
            key = self._keys.pop(message_id, None)
            if key is not None:
                store.release(key)
            if message_id in self._deferred:
                self._release_deferred(store, message_id)
        self.counters["vanished_requeued"] += len(gone)

    def _dispatch_dealer(self, store: MessageStore) -> None:
        """dealer mode: the DEALER picks the consumer (round robin over the connections
        whose pipe has room); a refused send waits for POLLOUT."""
        events = self._tx_events
        if events is not None and int(events.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            # Learn of new connections before sending: one attached since is then
            # known to have been there (see _consumer_links).
            self._consumer_links(store)
        links = self._links
        if self._tx_blocked or not links:
            return
        inflight = self._inflight
        cap = self._inflight_limit * len(links)
        if len(inflight) >= cap:
            return
        tx = self._tx
        keys = self._keys
        counters = self.counters
        timeout = self._timeout_bytes
        timeout_us = self._ack_timeout_us
        now_us = _now_us()
        sent_bytes = str(now_us).encode("ascii")
        for _ in range(min(self._max_batch, cap - len(inflight))):
            try:
                message = store.take()
            except StoreError as e:  # an unreadable record; the store dropped it
                counters["errors"] += 1
                log.error("queue: %s", e)
                continue
            if message is None:
                break
            message_id = message.message_id
            if message_id in keys:  # another stored copy of this id is in flight: wait
                self._deferred.setdefault(message_id, []).append(message.key)
                continue
            try:
                # encode_delivery(Delivery(id, now, timeout, body)), built directly.
                _send_frames(tx, (message_id, sent_bytes, timeout, DELIMITER, *message.body))
            except zmq.Again:  # every pipe is full, or none is attached yet
                store.release(message.key, delivered=False)
                self._tx_blocked = True
                self._poller.modify(tx, zmq.POLLIN | zmq.POLLOUT)
                break
            inflight.add(message_id, b"", now_us, timeout_us)
            keys[message_id] = message.key
            counters["delivered"] += 1
            if message.redelivery:
                counters["redelivered"] += 1

    def _release_deferred(self, store: MessageStore, message_id: bytes) -> None:
        for key in self._deferred.pop(message_id, ()):
            store.release(key, delivered=False)

    def _drop_consumer(self, store: MessageStore, consumer: _Consumer) -> None:
        log.info("queue: consumer %r went away", consumer.ident)
        self._consumers.pop(consumer.ident, None)
        if consumer.ready:
            consumer.ready = False
            with contextlib.suppress(ValueError):
                self._ready_q.remove(consumer)
        for message_id in self._inflight.drop_consumer(consumer.ident):
            self.counters["vanished_requeued"] += 1
            key = self._keys.pop(message_id, None)
            if key is not None:
                store.release(key)
            if message_id in self._deferred:
                self._release_deferred(store, message_id)

    def _housekeeping(self, store: MessageStore) -> None:
        now_us = _now_us()
        inflight = self._inflight
        deadline = inflight.next_deadline()
        if deadline is not None and deadline < now_us:
            expired = inflight.expired(now_us)
            for message_id in expired:
                key = self._keys.pop(message_id, None)
                if key is not None:
                    store.release(key)
                if message_id in self._deferred:
                    self._release_deferred(store, message_id)
            self.counters["expired_messages"] += len(expired)
            for consumer in self._consumers.values():
                self._make_ready(consumer)
        now = time.monotonic()
        if self._backlogs and now >= self._next_flush:
            self._flush_backlogs()
        if now >= self._next_prune:
            self._next_prune = now + _PRODUCER_WINDOW_S
            floor = now - _PRODUCER_WINDOW_S
            self._producers = {k: t for k, t in self._producers.items() if t >= floor}

    def _tick(self, store: MessageStore) -> None:
        self._last_stats = self._collect_stats(store)
        # Retiring a fully acked active segment costs syncs and an ids snapshot: only
        # when producers have been quiet for a while, never between busy commits.
        if (
            self._ticket is None
            and not store.dirty
            and not store.failed
            and time.monotonic() - self._last_put > _IDLE_S
        ):
            store.maintain()
        for consumer in self._consumers.values():
            self._make_ready(consumer)  # also those skipped because their pipe was full

    def _dispatch(self, store: MessageStore) -> None:
        ready = self._ready_q
        if not ready:
            return
        tx = self._tx
        inflight = self._inflight
        keys = self._keys
        counters = self.counters
        timeout = self._timeout_bytes
        now_us = _now_us()
        sent_bytes = str(now_us).encode("ascii")
        for _ in range(self._max_batch):
            if not ready:
                break
            try:
                message = store.take()
            except StoreError as e:  # an unreadable record; the store dropped it
                counters["errors"] += 1
                log.error("queue: %s", e)
                continue
            if message is None:
                break
            consumer = ready.popleft()
            message_id = message.message_id
            if message_id in keys:  # another stored copy of this id is in flight: wait
                self._deferred.setdefault(message_id, []).append(message.key)
                ready.appendleft(consumer)
                continue
            # [consumer, *encode_delivery(Delivery(id, now, timeout, body))], built directly.
            frames = [consumer.ident, message_id, sent_bytes, timeout, DELIMITER, *message.body]
            try:
                _send_frames(tx, frames)
            except zmq.Again:  # its pipe is full: skip it until it acks something
                consumer.ready = False
                store.release(message.key, delivered=False)
                continue
            except zmq.ZMQError:  # EHOSTUNREACH: gone
                consumer.ready = False
                store.release(message.key, delivered=False)
                self._drop_consumer(store, consumer)
                continue
            inflight.add(message_id, consumer.ident, now_us, self._ack_timeout_us)
            keys[message_id] = message.key
            counters["delivered"] += 1
            if message.redelivery:
                counters["redelivered"] += 1
            if inflight.can_send(consumer.ident):
                ready.append(consumer)
            else:
                consumer.ready = False

    # ------------------------------------------------------------------ monitor

    def _answer_monitor(self, store: MessageStore) -> None:
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
                reply = encode_monitor_reply(self._collect_stats(store))
            mon.send_multipart(reply)  # REP: must answer before the next request

    def _collect_stats(self, store: MessageStore) -> dict[str, int | str]:
        c = self.counters
        s = store.stats()
        in_flight = len(self._inflight) if hasattr(self, "_inflight") else 0
        dealer = self._send_mode == "dealer"
        consumers = getattr(self, "_links" if dealer else "_consumers", ())
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
            "producers": len(getattr(self, "_producers", ())),
            "consumers": len(consumers),
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
