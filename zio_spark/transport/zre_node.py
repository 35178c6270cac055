"""A ZRE node: UDP beacons, a ROUTER mailbox and one DEALER per peer (specs/36-zre.txt).

This module holds the node's configuration, public API and the command plumbing between
threads; the node thread's socket I/O is one part the node owns, a
:class:`~zio_spark.transport.zre_io.ZreIo` (:mod:`.zre_io`). It is about 900 lines,
over the usual 800, because the public API is documented method by method.

Theory of operation:

All protocol decisions live in the pure :class:`~zio_spark.protocol.zre_peers.PeerTable`; this
module only moves bytes and time. One background thread owns every socket (zmq sockets
are not thread-safe): the UDP beacon socket, the mailbox ROUTER and the per-peer DEALERs.
It loops on a single poll whose timeout is the earliest of "next beacon due" and
:meth:`PeerTable.next_deadline`, feeds beacons, mailbox messages and ``time.monotonic()``
into the table, and carries out what comes back:

- actions (CONNECT, DROP, SEND_PING, SEND_PING_OK) are done in the node thread: a CONNECT
  opens a DEALER with identity ``0x01 + our UUID`` to the peer's mailbox and sends our
  HELLO (endpoint, groups, status, name, headers) before anything else; DROP closes it;
- application events (ENTER, EXIT, JOIN, LEAVE, WHISPER, SHOUT, EVASIVE) are handed to the
  application: queued for :meth:`ZreNode.next_event`, or given to the ``on_event``
  callback (called in the node thread; it must not block, and may call the node's API).

Other threads talk to the node thread through a command queue and a
:class:`~zio_spark.transport.loop.Waker` (in the poll): each API call is a closure run in
the node thread, with a :class:`concurrent.futures.Future` for the result. Called from
the node thread itself (an ``on_event`` callback), the closure runs inline, so there is
no deadlock.

Where the node talks. The beacon socket binds ``0.0.0.0:<beacon_port>`` with SO_REUSEADDR,
SO_REUSEPORT and SO_BROADCAST, so that several nodes on one host share the port, and sends
its 22-byte beacon to ``<broadcast>:<beacon_port>`` every ``interval`` seconds. The
mailbox ROUTER binds ``tcp://<interface_addr>:<port>`` on an ephemeral port in
0xC000..0xFFFF, and the HELLO advertises that endpoint. Peers that discover us by beacon
connect to *the beacon's source address*, so ``interface_addr`` must be the address the
kernel uses as source when it sends to ``broadcast``; by default it is derived exactly
so (a UDP ``connect`` to the broadcast address, which sends nothing), and a mismatch is
logged as a warning. Defaults come from the environment when set:

- ``ZIO_ZRE_BROADCAST`` (else ``255.255.255.255``): tests set ``127.255.255.255``,
  which reaches every socket bound to ``0.0.0.0`` on loopback and nothing else;
- ``ZIO_ZRE_INTERFACE_ADDR`` (else derived from the broadcast address as above).

Bad input. A datagram that is not a ZRE beacon, or a mailbox message that does not
decode (bad identity, signature, version, truncation, a HELLO whose endpoint is not
``tcp://``), is dropped, counted in :attr:`ZreNode.stats` and logged on the
``zio_spark.transport`` logger with its sender; log lines are throttled. The node never
stops because of what a peer sends; a peer that breaks sequence numbering is dropped
(EXIT) by the table. A send that would block (the peer's queue is at its high-water mark
of ``expired_after * 100`` messages) is treated as "peer not responding": the peer is
removed (EXIT).

Leaving. :meth:`ZreNode.stop` sends a port-0 beacon, so peers drop us at once instead of
after their expiry timeout, then closes every socket (DEALERs with ``linger_ms``).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import queue
import threading
import uuid as uuid_mod
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from enum import Enum
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar
from uuid import UUID

import zmq

from zio_spark.errors import (
    ConfigError,
    LocalProtocolError,
    TransportError,
)
from zio_spark.options import ZreOptions
from zio_spark.protocol.zio_ports import (
    ZioEndpoint,
    group_zio_endpoints,
    zio_port_headers,
)
from zio_spark.protocol.zre import (
    Command,
    Hello,
    Join,
    Leave,
    Shout,
    Whisper,
    encode_identity,
)
from zio_spark.protocol.zre_peers import (
    EVASIVE_AFTER,
    EXPIRED_AFTER,
    MAX_PEERS,
    MAX_UNCONFIRMED,
    Peer,
    PeerTable,
)
from zio_spark.transport.loop import Waker
from zio_spark.transport.port import UnknownPeerError
from zio_spark.transport.zre_io import AppEvent, ZreIo, ZreIoConfig, _route_source, _Throttle

__all__ = [
    "BROADCAST_ENV",
    "DEFAULT_BROADCAST",
    "INTERFACE_ENV",
    "AppEvent",
    "ZreNode",
]

log = logging.getLogger("zio_spark.transport")

BROADCAST_ENV = "ZIO_ZRE_BROADCAST"
"""Environment variable naming the default beacon broadcast address."""
INTERFACE_ENV = "ZIO_ZRE_INTERFACE_ADDR"
"""Environment variable naming the default mailbox interface address."""
DEFAULT_BROADCAST = "255.255.255.255"


_T = TypeVar("_T")
_UINT8_MAX = 0xFF

_STAT_KEYS = (
    "beacons_sent",
    "beacon_send_errors",
    "beacons_received",
    "own_beacons",
    "bad_beacons",
    "messages_received",
    "bad_messages",
    "messages_sent",
    "pings_sent",
    "ping_oks_received",
    "send_failures",
    "peers_connected",
    "peers_dropped",
    "events_dropped",
    "callback_errors",
    "internal_errors",
)


class _State(Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


def _env_or(name: str, default: str | None) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or default


def _ipv4(option: str, value: object) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(str(value))
    except ValueError:
        raise ConfigError(option, value, "an IPv4 address (ZRE beacons are IPv4)") from None


def _check_text(value: object, field: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise LocalProtocolError(
            f"ZRE {field}: got {value!r}, expected a {'' if allow_empty else 'non-empty '}str",
            field=field,
            value=value,
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise LocalProtocolError(
            f"ZRE {field}: got {value!r}, expected text encodable as UTF-8",
            field=field,
            value=value,
        ) from e
    if size > _UINT8_MAX:
        raise LocalProtocolError(
            f"ZRE {field}: got {size} UTF-8 bytes ({value[:40]!r}...), expected at most 255",
            field=field,
            value=value,
        )
    return value


def _check_frames(frames: Iterable[object]) -> tuple[bytes, ...]:
    out: list[bytes] = []
    for i, frame in enumerate(frames):
        if isinstance(frame, bytes | bytearray | memoryview):
            out.append(bytes(frame))
        else:
            raise LocalProtocolError(
                f"ZRE content frame {i}: got {type(frame).__name__}, expected bytes",
                field="content",
                value=frame,
            )
    return tuple(out)


class ZreNode:
    """A ZRE node on the local network: discovery, groups, WHISPER and SHOUT.

    Parameters
    ----------
    name
        Public name sent in HELLO (default: the first 6 hex digits of the UUID).
    zre
        Where the node talks and the group it is in (:class:`~zio_spark.options.ZreOptions`;
        None: ``ZreOptions("")``, every default):

        - ``group``: joined before :meth:`start`, so it goes out in the HELLO; empty: no
          group (join some with :meth:`join`);
        - ``beacon_port``: the UDP discovery port (default 5670, the ZRE-DISC port).
          Every node of a cluster must use the same one;
        - ``broadcast``: the IPv4 address beacons are sent to (None:
          ``$ZIO_ZRE_BROADCAST``, else ``255.255.255.255``);
        - ``interface``: the IPv4 address the mailbox binds to and advertises (None:
          ``$ZIO_ZRE_INTERFACE_ADDR``, else the source address the kernel picks for
          ``broadcast``). It must be the address our beacons are sent from;
        - ``interval``: seconds between beacons (default 1.0).
    headers
        HELLO headers (name -> value); see also :meth:`set_header`, :meth:`advertise_port`.
    evasive_after, expired_after
        Seconds of silence before a peer gets a PING (EVASIVE) and before it is dropped
        (EXIT); defaults 5 and 30.
    max_peers, max_unconfirmed
        Most peers known, and most known only from a beacon (still waiting for their
        HELLO); defaults 512 and 64. Each peer costs a socket, and a context has about
        1000: see :class:`~zio_spark.protocol.zre_peers.PeerTable` for how the bounds keep a
        flood of forged beacons from locking real peers out (``stats["peers_refused"]``).
    ctx
        The zmq context for the mailbox and DEALERs; by default the node makes its own
        and terminates it in :meth:`stop`.
    on_event
        If given, called in the node thread with every application event instead of
        queueing it for :meth:`next_event`. Must not block; may call this node's API.
    linger_ms
        Linger of the peers' DEALERs when the node stops (default 100).
    max_queued_events
        Bound of the event queue; events beyond it are dropped and counted in
        ``stats["events_dropped"]`` (default 100000).
    call_timeout
        Seconds an API call waits for the node thread (default 5.0).

    Raises
    ------
    ConfigError
        If an address is not IPv4, a port, interval or timeout is out of range, or no
        interface address can be derived (naming ``beacon_port``, ``broadcast``,
        ``interface_addr`` or ``interval`` for the ``zre`` settings).
    LocalProtocolError
        If ``name`` or a header is not a str of at most 255 UTF-8 bytes.

    Notes
    -----
    The node is one-shot: :meth:`start` once, :meth:`stop` once (idempotent); it is a
    context manager. All methods are thread-safe. Groups may be joined before
    :meth:`start` (they go out in the HELLO); headers are fixed once started.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        zre: ZreOptions | None = None,
        headers: Mapping[str, str] | None = None,
        evasive_after: float = EVASIVE_AFTER,
        expired_after: float = EXPIRED_AFTER,
        max_peers: int = MAX_PEERS,
        max_unconfirmed: int = MAX_UNCONFIRMED,
        ctx: zmq.Context[Any] | None = None,
        on_event: Callable[[AppEvent], object] | None = None,
        linger_ms: int = 100,
        max_queued_events: int = 100_000,
        call_timeout: float = 5.0,
    ) -> None:
        self._uuid = uuid_mod.uuid4()
        self._name = _check_text(
            self._uuid.hex[:6] if name is None else name, "name", allow_empty=True
        )
        zre = ZreOptions("") if zre is None else zre
        beacon_port, broadcast, interval = zre.beacon_port, zre.broadcast, zre.interval
        if isinstance(beacon_port, bool) or not isinstance(beacon_port, int):
            raise ConfigError("beacon_port", beacon_port, "a UDP port number in 1..65535")
        if not 0 < beacon_port <= 0xFFFF:
            raise ConfigError("beacon_port", beacon_port, "a UDP port number in 1..65535")
        self._beacon_port = beacon_port
        bcast = broadcast if broadcast is not None else _env_or(BROADCAST_ENV, DEFAULT_BROADCAST)
        self._broadcast = str(_ipv4("broadcast", bcast))
        iface = zre.interface if zre.interface is not None else _env_or(INTERFACE_ENV, None)
        if iface is None:
            iface = _route_source(self._broadcast, beacon_port)
            if iface is None:
                raise ConfigError(
                    "interface_addr",
                    None,
                    f"an IPv4 address of this host (none routes to broadcast "
                    f"{self._broadcast}; set the ZRE interface or ${INTERFACE_ENV})",
                )
        iface_ip = _ipv4("interface_addr", iface)
        if iface_ip.is_unspecified or iface_ip.is_multicast:
            raise ConfigError(
                "interface_addr", iface, "a unicast IPv4 address peers can connect to"
            )
        self._interface_addr = str(iface_ip)
        if not isinstance(interval, int | float) or not math.isfinite(interval) or interval <= 0:
            raise ConfigError("interval", interval, "a positive number of seconds")
        self._interval = float(interval)
        self._table_bounds = {"max_peers": max_peers, "max_unconfirmed": max_unconfirmed}
        self._table = PeerTable(
            self._uuid,
            evasive_after=evasive_after,
            expired_after=expired_after,
            **self._table_bounds,
        )
        self._evasive_after = float(evasive_after)
        self._expired_after = float(expired_after)
        if isinstance(linger_ms, bool) or not isinstance(linger_ms, int) or linger_ms < 0:
            # Not -1 (forever): a dead peer must not be able to hang stop().
            raise ConfigError("linger_ms", linger_ms, "an integer >= 0 (milliseconds)")
        self._linger_ms = linger_ms
        if not isinstance(max_queued_events, int) or max_queued_events < 1:
            raise ConfigError("max_queued_events", max_queued_events, "a positive integer")
        if not call_timeout > 0:
            raise ConfigError("call_timeout", call_timeout, "a positive number of seconds")
        self._call_timeout = float(call_timeout)
        self._headers: dict[str, str] = {}
        for key, value in (headers or {}).items():
            self._put_header(key, value)

        self._ctx = ctx
        self._own_ctx = ctx is None
        self._on_event = on_event
        self._events: queue.Queue[AppEvent] = queue.Queue(maxsize=max_queued_events)
        self._stats = dict.fromkeys(_STAT_KEYS, 0)
        self._groups: set[str] = set()
        self._status = 0

        self._lock = threading.Lock()
        self._state = _State.NEW
        self._commands: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._waker: Waker | None = None

        self._event_drop_log = _Throttle()
        # The node thread's sockets, one part of this node (used in the node thread).
        self._io = ZreIo(
            ZreIoConfig(
                uuid=self._uuid,
                name=self._name,
                beacon_port=self._beacon_port,
                broadcast=self._broadcast,
                interface_addr=self._interface_addr,
                interval=self._interval,
                expired_after=self._expired_after,
                linger_ms=self._linger_ms,
            ),
            self._table,
            self._stats,
            deliver=self._deliver,
            hello=self._hello,
        )
        if zre.group:
            self.join(zre.group)

    # -- properties --------------------------------------------------------------------

    @property
    def uuid(self) -> UUID:
        """This node's UUID."""
        return self._uuid

    @property
    def name(self) -> str:
        """This node's public name."""
        return self._name

    @property
    def endpoint(self) -> str | None:
        """The mailbox endpoint advertised in HELLO (``tcp://addr:port``); None before start."""
        return self._io.endpoint

    @property
    def beacon_port(self) -> int:
        """The UDP discovery port."""
        return self._beacon_port

    @property
    def broadcast(self) -> str:
        """The address beacons are sent to."""
        return self._broadcast

    @property
    def interface_addr(self) -> str:
        """The address the mailbox binds to and advertises."""
        return self._interface_addr

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        return self._state is _State.RUNNING

    @property
    def headers(self) -> Mapping[str, str]:
        """Our HELLO headers (read-only view)."""
        return MappingProxyType(self._headers)

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the node's counters.

        ``beacons_sent``, ``beacon_send_errors``, ``beacons_received`` (valid, from
        others), ``own_beacons``, ``bad_beacons``, ``messages_received`` (decoded mailbox
        messages), ``bad_messages``, ``messages_sent``, ``pings_sent``,
        ``ping_oks_received``, ``send_failures`` (peer's queue full), ``peers_connected``
        (DEALERs opened), ``peers_dropped``, ``events_dropped`` (event queue full),
        ``callback_errors``, ``internal_errors``, ``peers_refused`` (new nodes ignored
        while ``max_peers`` were known).
        """
        return {**self._stats, "peers_refused": self._table.refused}

    # -- configuration (before start) --------------------------------------------------

    def _put_header(self, key: object, value: object) -> None:
        _check_text(key, "header name")
        if not isinstance(value, str):
            raise LocalProtocolError(
                f"ZRE header {key!r}: got {value!r}, expected a str value",
                field="headers",
                value=value,
            )
        self._headers[str(key)] = value

    def _check_configurable(self, what: str) -> None:
        if self._state is not _State.NEW:
            raise LocalProtocolError(
                f"ZRE {what}: node is {self._state.value}, expected a node not yet started "
                f"(headers go out in HELLO)",
                field="state",
                value=self._state.value,
            )

    def set_header(self, key: str, value: str) -> None:
        """Set a HELLO header. Only before :meth:`start`.

        Raises
        ------
        LocalProtocolError
            If the node was started, ``key`` is not a non-empty str of at most 255 UTF-8
            bytes, or ``value`` is not a str.
        """
        with self._lock:
            self._check_configurable("set_header")
            self._put_header(key, value)

    def advertise_port(self, name: str, address: str, socket_type: str) -> None:
        """Advertise a ZIO flow port in our HELLO headers. Only before :meth:`start`.

        Sets ``zio.port.<name>.address`` and ``zio.port.<name>.socket``
        (see :func:`~zio_spark.protocol.zio_ports.zio_port_headers`).

        Parameters
        ----------
        name
            The port's name, e.g. ``"out"`` (non-empty, no ``.``).
        address
            The endpoint peers connect to, e.g. ``"tcp://10.0.0.5:41000"``.
        socket_type
            The socket type bound there: ``"SERVER"``, ``"ROUTER"``, ...

        Raises
        ------
        LocalProtocolError
            If the node was started, or the name, address or socket type is invalid.
        """
        with self._lock:
            self._check_configurable("advertise_port")
            for key, value in zio_port_headers(name, address, socket_type).items():
                self._put_header(key, value)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 5.0) -> ZreNode:
        """Bind the sockets, start the node thread and the beacon. Returns ``self``.

        Raises
        ------
        LocalProtocolError
            If the node was already started (nodes are one-shot).
        TransportError
            If a socket cannot be bound (``endpoint`` names it), or the thread does not
            come up within ``timeout`` seconds.
        """
        ready: Future[None] = Future()
        with self._lock:
            if self._state is not _State.NEW:
                raise LocalProtocolError(
                    f"ZRE node start: node is {self._state.value}, expected new "
                    f"(a node starts once)",
                    field="state",
                    value=self._state.value,
                )
            self._waker = Waker()
            if self._ctx is None:
                self._ctx = zmq.Context()
            self._state = _State.RUNNING
            self._thread = threading.Thread(
                target=self._run, args=(ready,), name=f"zre-node-{self._name}", daemon=True
            )
            self._thread.start()
        try:
            ready.result(timeout)
        except FutureTimeout:
            self.stop(timeout)
            raise TransportError(
                f"ZRE node {self._name}: thread did not start within {timeout} s",
                endpoint=self._io.endpoint,
            ) from None
        except TransportError:
            self._join_thread(timeout)
            self._term_own_ctx()
            raise
        log.info(
            "ZRE node %s (%s) started: mailbox %s, beacons to %s:%d every %.3g s",
            self._name,
            self._uuid,
            self._io.endpoint,
            self._broadcast,
            self._beacon_port,
            self._interval,
        )
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Send a port-0 (leaving) beacon, close every socket and end the node thread.

        Idempotent; a node never started just becomes stopped. Queued events stay
        readable with :meth:`next_event`. From an ``on_event`` callback, the stop is
        requested and happens when the callback returns.

        Raises
        ------
        TransportError
            If the node thread does not finish within ``timeout`` seconds.
        """
        with self._lock:
            if self._state is _State.NEW:
                self._state = _State.STOPPED
                return
            if self._state is _State.RUNNING:
                self._stop_requested = True
                self._wake()
        if threading.current_thread() is self._thread:
            return
        self._join_thread(timeout)
        self._term_own_ctx()

    def _join_thread(self, timeout: float) -> None:
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            raise TransportError(
                f"ZRE node {self._name}: thread did not stop within {timeout} s",
                endpoint=self._io.endpoint,
            )

    def _term_own_ctx(self) -> None:
        if self._own_ctx and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.term()

    def __enter__(self) -> ZreNode:
        if self._state is _State.NEW:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"<ZreNode {self._name!r} {self._uuid} {self._state.value} "
            f"endpoint={self._io.endpoint} beacons={self._broadcast}:{self._beacon_port}>"
        )

    # -- events ------------------------------------------------------------------------

    def next_event(self, timeout: float | None = 0.0) -> AppEvent | None:
        """Return the next application event, or None if none arrives within ``timeout``.

        ``timeout`` is in seconds; 0 returns only what is already queued, None waits
        forever. With an ``on_event`` callback nothing is ever queued.
        """
        try:
            if timeout is not None and timeout <= 0:
                return self._events.get_nowait()
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    # -- commands ----------------------------------------------------------------------

    def join(self, group: str) -> None:
        """Join ``group`` (no-op if already in it); peers get a JOIN.

        Raises
        ------
        LocalProtocolError
            If ``group`` is not a non-empty str of at most 255 UTF-8 bytes, or the node
            was stopped.
        """
        _check_text(group, "group")
        self._call(lambda: self._do_group(group, join=True), allow_new=True)

    def leave(self, group: str) -> None:
        """Leave ``group`` (no-op if not in it); peers get a LEAVE.

        Raises
        ------
        LocalProtocolError
            As for :meth:`join`.
        """
        _check_text(group, "group")
        self._call(lambda: self._do_group(group, join=False), allow_new=True)

    def whisper(self, peer: UUID, *frames: bytes) -> None:
        """Send ``frames`` (zero or more) to one entered peer.

        Raises
        ------
        LocalProtocolError
            If the node is not running or a frame is not bytes-like.
        UnknownPeerError
            If ``peer`` has not entered (or has left); ``peer`` on the error is its ZRE
            identity (``0x01`` + UUID bytes).
        TransportError
            If the peer's send queue is full: the peer is dropped (EXIT) as not
            responding.
        """
        if not isinstance(peer, UUID):
            raise LocalProtocolError(
                f"ZRE whisper peer: got {peer!r}, expected a uuid.UUID", field="peer", value=peer
            )
        content = _check_frames(frames)
        self._call(lambda: self._do_whisper(peer, content))

    def shout(self, group: str, *frames: bytes) -> int:
        """Send ``frames`` to every entered peer in ``group``; returns how many it reached.

        A peer whose send queue is full is dropped (EXIT) and not counted.

        Raises
        ------
        LocalProtocolError
            If the node is not running, ``group`` is invalid or a frame is not bytes-like.
        """
        _check_text(group, "group")
        content = _check_frames(frames)
        return self._call(lambda: self._do_shout(group, content))

    # -- queries -----------------------------------------------------------------------

    def peers(self) -> list[Peer]:
        """Snapshots of the peers that have entered (said HELLO), sorted by UUID."""
        return self._query(lambda: [p for p in self._table.peers() if p.ready])

    def peer(self, peer: UUID) -> Peer | None:
        """Snapshot of one entered peer, or None."""

        def get() -> Peer | None:
            snapshot = self._table.get(peer)
            return snapshot if snapshot is not None and snapshot.ready else None

        return self._query(get)

    def peers_in_group(self, group: str) -> list[Peer]:
        """Snapshots of the entered peers in ``group``, sorted by UUID."""
        return self._query(lambda: self._table.peers_in_group(group))

    def peer_headers(self, peer: UUID) -> Mapping[str, str] | None:
        """The HELLO headers of an entered peer, or None if it has not entered."""
        snapshot = self.peer(peer)
        return None if snapshot is None else snapshot.headers

    def own_groups(self) -> frozenset[str]:
        """The groups this node is in."""
        return self._query(lambda: frozenset(self._groups))

    def peer_groups(self) -> frozenset[str]:
        """Every group that at least one entered peer is in."""
        return self._query(self._table.groups)

    def zio_endpoints(self, group: str, port: str | None = None) -> list[ZioEndpoint]:
        """The ZIO flow ports advertised by the entered peers in ``group``.

        See :func:`~zio_spark.protocol.zio_ports.group_zio_endpoints`; ``port`` keeps only
        that port name.
        """
        return self._query(lambda: group_zio_endpoints(self._table, group, port=port))

    # -- calling into the node thread --------------------------------------------------

    def _wake(self) -> None:
        if self._waker is not None:
            self._waker.wake()

    def _query(self, fn: Callable[[], _T]) -> _T:
        return self._call(fn, allow_new=True, allow_stopped=True)

    def _call(
        self, fn: Callable[[], _T], *, allow_new: bool = False, allow_stopped: bool = False
    ) -> _T:
        if threading.current_thread() is self._thread:
            return fn()
        with self._lock:
            state = self._state
            if state is not _State.RUNNING:
                # No node thread touches the state now, and the lock keeps it so.
                if (state is _State.NEW and allow_new) or (
                    state is _State.STOPPED and allow_stopped
                ):
                    return fn()
                raise LocalProtocolError(
                    f"ZRE node {self._name}: node is {state.value}, expected running",
                    field="state",
                    value=state.value,
                )
            future: Future[_T] = Future()
            self._commands.append((fn, future))
            self._wake()
        try:
            return future.result(self._call_timeout)
        except FutureTimeout:
            raise TransportError(
                f"ZRE node {self._name}: no answer from the node thread within "
                f"{self._call_timeout} s",
                endpoint=self._io.endpoint,
            ) from None

    # -- node thread: commands (run in the node thread, or before start) ---------------

    def _do_group(self, group: str, *, join: bool) -> None:
        if join == (group in self._groups):
            return
        if join:
            self._groups.add(group)
        else:
            self._groups.discard(group)
        self._status = (self._status + 1) & _UINT8_MAX
        if self._state is not _State.RUNNING:
            return
        cmd: Command = Join(0, group, self._status) if join else Leave(0, group, self._status)
        for peer in self._io.peers():
            self._io.send(peer, cmd)
        self._io.pump()

    def _do_whisper(self, peer: UUID, content: tuple[bytes, ...]) -> None:
        snapshot = self._table.get(peer)
        if snapshot is None or not snapshot.ready or not self._io.connected(peer):
            raise UnknownPeerError(
                f"ZRE whisper: peer {peer} has not entered (or has left)",
                peer=encode_identity(peer),
                endpoint=self._io.endpoint,
            )
        sent = self._io.send(peer, Whisper(0, content))
        self._io.pump()
        if not sent:
            raise TransportError(
                f"ZRE whisper: peer {peer} is not responding (send queue full), dropped",
                endpoint=snapshot.endpoint,
            )

    def _do_shout(self, group: str, content: tuple[bytes, ...]) -> int:
        reached = 0
        for snapshot in self._table.peers_in_group(group):
            if self._io.connected(snapshot.uuid) and self._io.send(
                snapshot.uuid, Shout(0, group, content)
            ):
                reached += 1
        self._io.pump()
        return reached

    # -- node thread: what the I/O part asks of the node -------------------------------

    def _hello(self) -> Hello:
        """Our HELLO (its sequence number is stamped when sent)."""
        return Hello(
            0,
            self._io.endpoint or "",
            tuple(sorted(self._groups)),
            self._status,
            self._name,
            self._headers,
        )

    def _deliver(self, event: AppEvent) -> None:
        """Hand an application event to ``on_event``, or queue it for :meth:`next_event`."""
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                self._stats["callback_errors"] += 1
                log.exception("ZRE node %s: on_event callback failed on %r", self._name, event)
            return
        try:
            self._events.put_nowait(event)
        except queue.Full:
            self._stats["events_dropped"] += 1
            self._event_drop_log(
                "ZRE node %s: event queue full (%d), dropped %s",
                self._name,
                self._events.maxsize,
                event.kind.value,
            )

    # -- node thread: main loop --------------------------------------------------------

    def _run(self, ready: Future[None]) -> None:
        assert self._ctx is not None and self._waker is not None
        waker = self._waker
        try:
            self._io.open(self._ctx)
        except BaseException as e:  # report any setup failure to start(), then end
            self._io.close(send_leaving=False)
            self._finish()
            if isinstance(e, TransportError):
                ready.set_exception(e)
            else:
                ready.set_exception(
                    TransportError(
                        f"ZRE node {self._name}: setup failed: {e!r}", endpoint=self._io.endpoint
                    )
                )
            return
        ready.set_result(None)
        try:
            self._io.run(waker, self._between_turns)
        except Exception:
            self._stats["internal_errors"] += 1
            log.exception("ZRE node %s: node thread failed; stopping the node", self._name)
        finally:
            self._io.close(send_leaving=True)
            self._finish()

    def _between_turns(self) -> bool:
        """Run the queued calls; True once a stop was requested (ends the I/O loop)."""
        self._run_commands()
        return self._stop_requested

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the calling thread
                future.set_exception(e)

    def _finish(self) -> None:
        with self._lock:
            self._state = _State.STOPPED
            self._table = self._io.table = PeerTable(
                self._uuid,
                evasive_after=self._evasive_after,
                expired_after=self._expired_after,
                **self._table_bounds,
            )
            commands, self._commands = self._commands, deque()
            if self._waker is not None:
                self._waker.close()
            self._waker = None
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(
                    LocalProtocolError(
                        f"ZRE node {self._name}: node stopped before the call ran",
                        field="state",
                        value="stopped",
                    )
                )
