"""The ZRE node thread's I/O: the beacon socket, the mailbox and the peers' DEALERs.

:class:`ZreIo` is the part of a :class:`~zio_spark.transport.zre_node.ZreNode` that runs in
the node thread, one object the node makes and owns: it binds the sockets, runs the poll
loop, reads beacons and mailbox messages into the pure
:class:`~zio_spark.protocol.zre_peers.PeerTable`, and carries out what the table answers
(connect, drop, ping; events go back to the node through ``deliver``). The public API,
the configuration, our HELLO's contents and the command plumbing between threads are
the node's (:mod:`.zre_node`); read its docstring for the theory of operation.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias
from uuid import UUID

import zmq

from zio_spark.errors import (
    RemoteProtocolError,
    TransportError,
)
from zio_spark.protocol.zre import (
    Beacon,
    Command,
    Hello,
    Ping,
    PingOk,
    decode_beacon,
    decode_command,
    decode_identity,
    encode_beacon,
    encode_command,
    encode_identity,
    tcp_endpoint,
)
from zio_spark.protocol.zre_peers import (
    ConnectAction,
    DropAction,
    DropReason,
    EnterEvent,
    EvasiveEvent,
    Event,
    ExitEvent,
    JoinEvent,
    LeaveEvent,
    PeerTable,
    SendPingAction,
    SendPingOkAction,
    ShoutEvent,
    WhisperEvent,
)
from zio_spark.transport.loop import Waker

__all__ = ["AppEvent", "ZreIo", "ZreIoConfig"]

log = logging.getLogger("zio_spark.transport")

AppEvent: TypeAlias = (
    EnterEvent | ExitEvent | JoinEvent | LeaveEvent | WhisperEvent | ShoutEvent | EvasiveEvent
)
"""What the application receives from :meth:`ZreNode.next_event` or ``on_event``."""
_APP_EVENTS = (EnterEvent, ExitEvent, JoinEvent, LeaveEvent, WhisperEvent, ShoutEvent, EvasiveEvent)

_MAILBOX_PORTS = (0xC000, 0x10000)  # the spec's ephemeral range, upper bound exclusive
_DATAGRAM_MAX = 512  # larger than a beacon, so an oversized datagram is seen as such
_BIND_TRIES = 200
_BATCH = 256  # inputs handled per source per loop turn, so timers are never starved
_LOG_BAD_FIRST = 20
_LOG_BAD_EVERY = 1000


def _route_source(broadcast: str, port: int) -> str | None:
    """The source address the kernel would use to send to ``broadcast`` (sends nothing)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        s.connect((broadcast, port))
        return str(s.getsockname()[0])
    except OSError:
        return None
    finally:
        s.close()


class _Throttle:
    """Logs the first few occurrences, then one in every ``_LOG_BAD_EVERY``."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, msg: str, *args: object) -> None:
        self.count += 1
        if self.count <= _LOG_BAD_FIRST or self.count % _LOG_BAD_EVERY == 0:
            log.warning(msg + " [occurrence %d]", *args, self.count)


@dataclass(frozen=True, slots=True)
class ZreIoConfig:
    """Who the node is and where it talks: what :class:`ZreIo` needs from the node's
    configuration (checked by :class:`~zio_spark.transport.zre_node.ZreNode`)."""

    uuid: UUID
    name: str
    beacon_port: int
    broadcast: str
    interface_addr: str
    interval: float
    expired_after: float
    linger_ms: int


class ZreIo:
    """The node thread's sockets: a part of a :class:`~zio_spark.transport.zre_node.ZreNode`,
    made and owned by it; everything here runs in the node thread.

    The seam: the node hands over its configuration, its peer table, its counters, how
    an application event is delivered (``deliver``) and what our HELLO says (``hello``:
    groups, status, name and headers belong to the node); the node calls :meth:`open`,
    :meth:`run` (which runs the node's queued calls between turns), :meth:`close`, and,
    from those calls, :meth:`send`, :meth:`pump`, :meth:`connected` and :meth:`peers`.

    Parameters
    ----------
    config
        The node's identity and addresses.
    table
        The node's peer table (protocol decisions).
    stats
        The node's counters, incremented here.
    deliver
        Hands one application event to the application (called in the node thread).
    hello
        Our HELLO, sent first to each peer connected to (sequence number stamped here).
    """

    def __init__(
        self,
        config: ZreIoConfig,
        table: PeerTable,
        stats: dict[str, int],
        *,
        deliver: Callable[[AppEvent], None],
        hello: Callable[[], Hello],
    ) -> None:
        self.config = config
        self.table = table
        self.stats = stats
        self._deliver = deliver
        self._hello = hello
        self.endpoint: str | None = None
        """The mailbox endpoint advertised in HELLO, once :meth:`open` bound it."""
        self.mailbox_port = 0
        self._udp: socket.socket | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._dealers: dict[UUID, zmq.Socket[bytes]] = {}
        self._pending: deque[Event] = deque()
        self._next_beacon = 0.0
        self._bad_beacon_log = _Throttle()
        self._bad_message_log = _Throttle()
        self._send_error_log = _Throttle()

    # -- what the node calls -----------------------------------------------------------

    def connected(self, peer: UUID) -> bool:
        """Whether a DEALER to ``peer`` is open."""
        return peer in self._dealers

    def peers(self) -> list[UUID]:
        """The peers a DEALER is open to."""
        return list(self._dealers)

    def open(self, ctx: zmq.Context[Any]) -> None:
        """Bind the beacon socket and the mailbox (sets :attr:`endpoint`).

        Raises
        ------
        TransportError
            If a socket cannot be bound (``endpoint`` names it).
        """
        c = self.config
        self._ctx = ctx
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        self._udp = udp
        try:
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            udp.bind(("0.0.0.0", c.beacon_port))
            udp.setblocking(False)
        except OSError as e:
            raise TransportError(
                f"ZRE node {c.name}: cannot bind the beacon socket: {e}",
                endpoint=f"udp://0.0.0.0:{c.beacon_port}",
            ) from e

        router: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self._router = router
        router.linger = 0
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        bind_base = f"tcp://{c.interface_addr}"
        port = _bind_in_range(router, bind_base, c.name)
        self.mailbox_port = port
        self.endpoint = tcp_endpoint(c.interface_addr, port)

        source = _route_source(c.broadcast, c.beacon_port)
        if source is not None and source != c.interface_addr:
            log.warning(
                "ZRE node %s: beacons to %s leave from %s but the mailbox is on %s; peers "
                "that discover us by beacon will connect to %s:%d and fail",
                c.name,
                c.broadcast,
                source,
                c.interface_addr,
                source,
                port,
            )

    def run(self, waker: Waker, between: Callable[[], bool]) -> None:
        """Beacon, poll and serve until ``between`` (run at every turn: the node's
        queued calls) answers True (stop)."""
        assert self._udp is not None and self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._udp, zmq.POLLIN)
        poller.register(waker, zmq.POLLIN)
        udp_fd = self._udp.fileno()
        self._next_beacon = time.monotonic()
        while True:
            if between():
                return
            now = time.monotonic()
            if now >= self._next_beacon:
                self._send_beacon(self.mailbox_port)
                self._next_beacon = now + self.config.interval
            self._guarded(self.table.tick, now)
            self.pump()
            deadline = self._next_beacon
            table_deadline = self.table.next_deadline()
            if table_deadline is not None:
                deadline = min(deadline, table_deadline)
            timeout_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(timeout_ms))
            if waker.fd in ready:
                waker.drain()
            if self._router in ready:
                self._read_mailbox()
            if udp_fd in ready:
                self._read_beacons()

    def _guarded(self, fn: Callable[[float], list[Event]], now: float) -> None:
        try:
            self._pending.extend(fn(now))
        except Exception:
            self.stats["internal_errors"] += 1
            log.exception("ZRE node %s: internal error", self.config.name)

    def close(self, *, send_leaving: bool) -> None:
        """Close every socket (DEALERs with the node's linger), first sending a port-0
        (leaving) beacon if ``send_leaving``. Idempotent."""
        c = self.config
        if send_leaving and self._udp is not None:
            self._send_beacon(0)
        for dealer in self._dealers.values():
            dealer.close(linger=c.linger_ms)
        self._dealers.clear()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        log.info("ZRE node %s (%s) stopped", c.name, c.uuid)

    # -- node thread: beacons ----------------------------------------------------------

    def _send_beacon(self, port: int) -> None:
        assert self._udp is not None
        data = encode_beacon(Beacon(self.config.uuid, port))
        try:
            self._udp.sendto(data, (self.config.broadcast, self.config.beacon_port))
        except OSError as e:
            self.stats["beacon_send_errors"] += 1
            self._send_error_log(
                "ZRE node %s: beacon to %s:%d failed: %s",
                self.config.name,
                self.config.broadcast,
                self.config.beacon_port,
                e,
            )
        else:
            self.stats["beacons_sent"] += 1

    def _read_beacons(self) -> None:
        assert self._udp is not None
        for _ in range(_BATCH):
            try:
                data, addr = self._udp.recvfrom(_DATAGRAM_MAX)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. ICMP errors reported on the socket
                log.debug("ZRE node %s: beacon socket: %s", self.config.name, e)
                return
            now = time.monotonic()
            try:
                beacon = decode_beacon(data)
            except RemoteProtocolError as e:
                self.stats["bad_beacons"] += 1
                self._bad_beacon_log(
                    "ZRE node %s: dropped a bad beacon from %s:%s: %s",
                    self.config.name,
                    addr[0],
                    addr[1],
                    e,
                )
                continue
            if beacon.uuid == self.config.uuid:
                self.stats["own_beacons"] += 1
                continue
            self.stats["beacons_received"] += 1
            try:
                self._pending.extend(self.table.on_beacon(beacon, addr[0], now))
            except Exception:
                self.stats["internal_errors"] += 1
                log.exception(
                    "ZRE node %s: internal error on a beacon from %s", self.config.name, addr[0]
                )
            self.pump()

    # -- node thread: mailbox ----------------------------------------------------------

    def _read_mailbox(self) -> None:
        assert self._router is not None
        for _ in range(_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            now = time.monotonic()
            raw = [f.bytes for f in frames]
            try:
                sender = decode_identity(raw[0])
                cmd = decode_command(raw[1:])
                if isinstance(cmd, Hello) and not _is_tcp_endpoint(cmd.endpoint):
                    raise RemoteProtocolError(
                        f"ZRE HELLO endpoint: got {cmd.endpoint[:80]!r}, expected tcp://host:port",
                        field="endpoint",
                        value=cmd.endpoint,
                    )
            except RemoteProtocolError as e:
                self.stats["bad_messages"] += 1
                self._bad_message_log(
                    "ZRE node %s: dropped a bad mailbox message from %s (identity 0x%s): %s",
                    self.config.name,
                    _peer_address(frames[0]),
                    raw[0][:32].hex(),
                    e,
                )
                continue
            self.stats["messages_received"] += 1
            if isinstance(cmd, PingOk):
                self.stats["ping_oks_received"] += 1
            try:
                self._pending.extend(self.table.on_message(sender, cmd, now))
            except Exception:
                self.stats["internal_errors"] += 1
                log.exception(
                    "ZRE node %s: internal error on a message from %s", self.config.name, sender
                )
            self.pump()

    # -- node thread: carrying out the table's events ----------------------------------

    def pump(self) -> None:
        """Carry out the table's pending actions and deliver its events."""
        while self._pending:
            event = self._pending.popleft()
            try:
                self._dispatch(event)
            except Exception:
                self.stats["internal_errors"] += 1
                log.exception("ZRE node %s: internal error handling %r", self.config.name, event)

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, ConnectAction):
            self._connect(event.peer, event.endpoint)
        elif isinstance(event, DropAction):
            self._drop(event)
        elif isinstance(event, SendPingAction):
            if self.send(event.peer, Ping(0)):
                self.stats["pings_sent"] += 1
        elif isinstance(event, SendPingOkAction):
            self.send(event.peer, PingOk(0))
        elif isinstance(event, _APP_EVENTS):
            self._deliver(event)

    def _connect(self, peer: UUID, endpoint: str) -> None:
        assert self._ctx is not None
        old = self._dealers.pop(peer, None)
        if old is not None:  # a restarted peer: the table dropped it first, but be sure
            old.close(linger=0)
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.setsockopt(zmq.ROUTING_ID, encode_identity(self.config.uuid))
        dealer.sndhwm = max(1000, int(self.config.expired_after * 100))
        dealer.sndtimeo = 0
        try:
            dealer.connect(endpoint)
        except zmq.ZMQError as e:
            dealer.close(linger=0)
            self.stats["bad_messages"] += 1
            self._bad_message_log(
                "ZRE node %s: peer %s gave an endpoint we cannot connect to, %r: %s",
                self.config.name,
                peer,
                endpoint,
                e,
            )
            self._pending.extend(self.table.remove(peer, f"cannot connect to {endpoint}"))
            return
        self._dealers[peer] = dealer
        self.stats["peers_connected"] += 1
        log.debug("ZRE node %s: connected to peer %s at %s", self.config.name, peer, endpoint)
        self.send(peer, self._hello())

    def _drop(self, event: DropAction) -> None:
        dealer = self._dealers.pop(event.peer, None)
        if dealer is not None:
            dealer.close(linger=0)
        self.stats["peers_dropped"] += 1
        # Coming and going is normal; a broken sequence is the peer's bug.
        level = logging.WARNING if event.reason is DropReason.SEQUENCE else logging.INFO
        log.log(
            level,
            "ZRE node %s: dropped peer %s (%s%s)",
            self.config.name,
            event.peer,
            event.reason.value,
            f": {event.detail}" if event.detail else "",
        )

    def send(self, peer: UUID, cmd: Command) -> bool:
        """Stamp and send ``cmd``; False (and the peer removed) if its queue is full."""
        dealer = self._dealers.get(peer)
        if dealer is None or peer not in self.table:
            return False
        frames = encode_command(self.table.stamp(peer, cmd))
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.stats["send_failures"] += 1
            log.warning(
                "ZRE node %s: peer %s is not responding (send queue full); dropping it",
                self.config.name,
                peer,
            )
            self._pending.extend(self.table.remove(peer, "send queue full"))
            return False
        self.stats["messages_sent"] += 1
        return True


def _bind_in_range(router: zmq.Socket[bytes], base: str, name: str) -> int:
    # pyzmq's bind_to_random_port ignores a range equal to its defaults (it binds ":*",
    # the OS range), so the spec's 0xC000..0xFFFF is tried here.
    rng = random.Random()
    error: zmq.ZMQError | None = None
    for _ in range(_BIND_TRIES):
        port = rng.randrange(*_MAILBOX_PORTS)
        try:
            router.bind(f"{base}:{port}")
        except zmq.ZMQError as e:
            if e.errno == zmq.EADDRINUSE:
                error = e
                continue
            raise TransportError(
                f"ZRE node {name}: cannot bind the mailbox: {e}", endpoint=f"{base}:{port}"
            ) from e
        return port
    raise TransportError(
        f"ZRE node {name}: no free mailbox port in 0xC000..0xFFFF after {_BIND_TRIES} tries",
        endpoint=f"{base}:*",
    ) from error


def _is_tcp_endpoint(endpoint: str) -> bool:
    """``tcp://host:port`` with a non-empty host and a port in 1..65535."""
    if not endpoint.startswith("tcp://"):
        return False
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 0xFFFF)


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "unknown address"
