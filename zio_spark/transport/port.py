"""Ports: the sockets under ZIO flows, in CLIENT/SERVER or the ROUTER/DEALER fallback.

Theory of operation (specs/zio-wire.md, specs/41-clientserver.txt, DESIGN.md "Sockets"):

A *port* is one ZeroMQ socket with a role (:class:`PortKind`): a :class:`ServerPort`
binds and talks to many clients, each addressed by an opaque :data:`PeerId`; a
:class:`ClientPort` connects and talks to its server. A port speaks exactly one wire mode
(:class:`SocketMode`; the framing of each is in :mod:`zio_spark.transport.wire`):

``clientserver``
    Real draft CLIENT/SERVER sockets (41/CLIENTSERVER), one frame per message in czmq's
    single-frame encoding; the SERVER names each client by a non-zero uint32 *routing
    id* (an ``int``). Needs a pyzmq built against a draft-enabled libzmq: stock PyPI
    pyzmq has no draft API, and a CLIENT/SERVER handshake with it aborts the whole
    process, so these sockets are only ever created when ``zmq.DRAFT_API`` is true (see
    ``scripts/build-draft-pyzmq.sh``).
``routerdealer``
    The reference ZIO fallback: a ROUTER serves, DEALERs connect, and the ZIO parts
    follow an empty delimiter frame. The peer id is the ROUTER identity (``bytes``).

The two modes never interoperate: libzmq checks socket types during the ZMTP 3
handshake, and a DEALER talking to a SERVER connects and then silently delivers
nothing. So the mode is never guessed; :func:`choose_mode` takes it from an explicit
option or from the socket type a peer advertises (ZRE header
``zio.port.<name>.socket``), and refuses combinations that could not work.

Timeouts. Every call that waits takes a timeout in milliseconds and polls with a
deadline:

- ``recv``/``recv_frames`` return ``None`` when nothing arrived in time (0 means "only
  what is already queued");
- ``send``/``send_frames`` raise :class:`~zio_spark.errors.TransportError` when the
  message cannot be *queued* within the timeout (the peer's queue is at its high-water
  mark, or no peer is connected). Nothing is ever dropped silently: ROUTER sockets run
  with ``ROUTER_MANDATORY``, and sending to an unknown or departed peer raises
  :class:`UnknownPeerError` (a ``TransportError`` with ``.peer``), as 41/CLIENTSERVER
  requires of a SERVER.

Bad input from a peer. A message that does not decode (broken envelope, bad ZIO parts)
is counted in ``port.stats["bad_messages"]`` and logged on the ``zio_spark.transport``
logger with the peer and the violation. Then, by the port's ``on_bad_message``:

- ``"return"`` (default): ``recv`` returns a :class:`BadMessage` naming the peer and the
  :class:`~zio_spark.errors.RemoteProtocolError`. A multi-client loop handles it as one
  more case (drop that peer's flow) and keeps serving everybody else; typed callers
  cannot forget it because it is part of ``recv``'s return type;
- ``"raise"``: ``recv`` raises that ``RemoteProtocolError`` with ``.peer`` set. Handy for a
  single-flow client, where a bad message ends the flow anyway.

Either way the bad message has been consumed, so the next ``recv`` carries on.

Closing and linger. ``close()`` is idempotent; ports are context managers. The default
linger is 1000 ms: long enough for the last queued messages (an EOT echo, a final PAY) to
leave in normal conditions, bounded so that a dead peer cannot hang ``close()`` or
``Context.term()``. Linger is *not* a delivery guarantee: FACTS.md measured losses when a
sender closes right after its last send over ``ipc://``. End of stream must be confirmed
at the application level (the flow's EOT echo, acknowledgements) before closing. Tests
use linger 0.

Threads. Like the zmq sockets under them, ports are not thread-safe: use each port from
one thread at a time. Sockets are created only by the port constructors, never at import.

Security. ``ServerPort(curve=...)`` turns on CURVE (``ClientPort`` then needs a
``curve`` naming the server's public key and its own key pair): one
:class:`~zio_spark.options.Curve` each, built from keys in any accepted form by
:func:`~zio_spark.transport.curve.server_curve` /
:func:`~zio_spark.transport.curve.client_curve`. Which clients may connect is decided by
a ZAP handler: :func:`~zio_spark.transport.curve.start_authenticator` runs pyzmq's
``ThreadAuthenticator`` with an allow-list of client public keys. Without an
authenticator any client that knows the server's public key is accepted. Keys and the
authenticator live in :mod:`zio_spark.transport.curve`.

Structure. A port is a role (:class:`ServerPort`, :class:`ClientPort`) holding one wire
strategy (:mod:`zio_spark.transport.wire`: the framing of SERVER, CLIENT, ROUTER or
DEALER). The roles never look at the mode; the wires never count, log or wait. What the
roles share (options, receiving, sending with deadlines, bad input, closing) is written
once in their base; a role adds only its CURVE keys, how it attaches (``bind`` or
``connect``) and whom it sends to (a server names the peer, a client has one). This
module is about 950 lines, over the usual 800, because most of it is the ports'
documented public API (timeouts, bad input, errors): splitting the base from the roles
would scatter what a user of one port reads.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypedDict, TypeVar

import zmq

from zio_spark.errors import (
    ConfigError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
    check_count,
)
from zio_spark.options import Curve
from zio_spark.protocol.message import DatCodec, Message, encode_frames
from zio_spark.transport.curve import apply_client, apply_server, client_keys, server_keys
from zio_spark.transport.wire import (
    PeerId,
    PortKind,
    SocketMode,
    Undecodable,
    Wire,
    choose_mode,
    drafts_available,
    make_wire,
    socket_type_name,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BadMessage",
    "ClientPort",
    "PeerId",  # this and the mode vocabulary below: from .wire
    "PortKind",
    "PortOptions",
    "ServerPort",
    "SocketMode",
    "UnknownPeerError",
    "choose_mode",
    "connection_open",
    "drafts_available",
    "format_peer",
    "socket_type_name",
]

log = logging.getLogger("zio_spark.transport")

OnBadMessage = Literal["return", "raise"]
_P = TypeVar("_P", bound="_Port[Any, Any]")
# Clients whose User-Id a ServerPort(user_ids=True) remembers: far more than one
# recv_many batch can name, so the BOT being dispatched always finds its own.
_USER_IDS_KEPT = 4096
_R = TypeVar("_R")
_Got = TypeVar("_Got")  # what recv gives: (peer, message) on a server, a message on a client
_Parts = TypeVar("_Parts")  # what recv_frames gives: (peer, parts) or the parts
# Bad-message log lines are throttled so that a peer spraying garbage cannot flood the
# log: the first few are logged, then one in every _LOG_BAD_EVERY with the running total.
_LOG_BAD_FIRST = 20
_LOG_BAD_EVERY = 1000

_NB = zmq.NOBLOCK
# recv_many: a batch ends once it holds this many bytes (large DATs stay cache-sized).
_MANY_BYTES = 1 << 18
_MAX_TIMEOUT_MS = 2**31 - 1  # RCVTIMEO is an int: ~24.8 days, longer waits are cut there


def format_peer(peer: PeerId | str | None) -> str:
    """Human-readable peer name for logs and errors."""
    if isinstance(peer, bytes):
        return f"identity 0x{peer.hex()}" if peer else "identity <empty>"
    if isinstance(peer, int):
        return f"routing id {peer}"
    if peer is None:
        return "unknown peer"
    return str(peer)


Connection = tuple[int, int]
"""One client connection of a :class:`ServerPort`: its file descriptor and that socket's
inode (:meth:`ServerPort.connection`)."""


def connection_open(conn: Connection) -> bool:
    """Whether the connection ``conn`` is still open in libzmq: its descriptor still names
    the same socket. libzmq closes a connection's descriptor when the peer closes it
    (a process that exits or is killed: its kernel closes the TCP connection) or when
    ZMTP heartbeats time out (a peer host gone silent); a descriptor number reused by a
    later connection names another socket (another inode), so it does not pass for the
    old one. A read-only ``fstat``: nothing is sent."""
    fd, inode = conn
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:  # EBADF: closed
        return False


class UnknownPeerError(TransportError):
    """Sending to a peer id that the port does not know (never connected, or gone).

    ``peer`` is the :data:`PeerId`; ``endpoint`` the port's endpoint(s).
    """

    def __init__(self, message: str, *, peer: PeerId, endpoint: str | None = None) -> None:
        self.peer = peer
        super().__init__(message, endpoint=endpoint)


@dataclass(frozen=True, slots=True)
class BadMessage:
    """A message from a peer that did not decode (returned by ``recv`` in "return" mode).

    Attributes
    ----------
    peer
        Who sent it: the :data:`PeerId` on a :class:`ServerPort`, the connected
        endpoint(s) on a :class:`ClientPort`.
    error
        The violation; ``error.peer`` is set too.
    frames
        The frames as received (envelope included), for diagnostics.
    """

    peer: PeerId | str | None
    error: RemoteProtocolError
    frames: tuple[bytes, ...] = ()


def _check_timeout(timeout_ms: float, option: str = "timeout_ms") -> float:
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)):
        raise ConfigError(option, timeout_ms, "a number of milliseconds >= 0")
    if not timeout_ms >= 0:  # also rejects NaN
        raise ConfigError(option, timeout_ms, "a number of milliseconds >= 0")
    return float(timeout_ms)


class PortOptions(TypedDict, total=False):
    """The options both port kinds take, as keywords (see :class:`ServerPort`)."""

    mode: SocketMode | str | None
    linger_ms: int
    sndhwm: int
    rcvhwm: int
    send_timeout_ms: float
    on_bad_message: OnBadMessage


class _Port(Generic[_Got, _Parts]):
    """What both port kinds share: the socket, options, polling, stats, bad input, close,
    and receiving (what a message comes as is the role's ``_Got``/``_Parts``)."""

    kind: ClassVar[PortKind]
    _peered: ClassVar[bool]  # a server: messages come from named peers, replies go to one
    curve_public_key: bytes | None
    """This port's Z85 public key when CURVE is on: a server's for its clients, a
    client's for the server's allow-list."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        secure: Callable[[zmq.Socket[bytes]], None] | None,
        *,
        mode: SocketMode | str | None = None,
        linger_ms: int = 1000,
        sndhwm: int = 1000,
        rcvhwm: int = 1000,
        send_timeout_ms: float = 5000,
        on_bad_message: OnBadMessage = "return",
    ) -> None:
        self.mode: SocketMode = choose_mode(mode, None)
        self._linger = check_count("linger_ms", linger_ms, -1)
        self._sndhwm = check_count("sndhwm", sndhwm, 0)
        self._rcvhwm = check_count("rcvhwm", rcvhwm, 0)
        self._send_timeout = _check_timeout(send_timeout_ms, "send_timeout_ms")
        if on_bad_message not in ("return", "raise"):
            raise ConfigError("on_bad_message", on_bad_message, "'return' or 'raise'")
        self._raise_bad = on_bad_message == "raise"
        self._held_error: RemoteProtocolError | None = None  # see _recv_many
        self._last_peer: PeerId | None = None  # a server's; see ServerPort.last_peer
        self.stats: dict[str, int] = {"sent": 0, "received": 0, "bad_messages": 0}
        self._endpoints: list[str] = []
        self._closed = False
        self._wire: Wire = make_wire(ctx, self.kind, self.mode)
        self._socket_name = self._wire.socket_name
        sock = self._sock = self._wire.sock
        try:
            sock.setsockopt(zmq.LINGER, self._linger)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            if self._socket_name == "ROUTER":
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if secure is not None:
                secure(sock)  # the role's CURVE options
        except BaseException:
            self._closed = True
            sock.close(linger=0)
            raise
        self._rcvtimeo = -1  # libzmq's default; _recv_with sets it per call
        self._timeout_arg: object = None  # the last timeout_ms checked (and its type)
        self._timeout_type: type = type(None)
        # The wire's operations, bound once (not looked up per message).
        self._get = self._wire.get
        self._put = self._wire.put
        self._decode = self._wire.decode
        self._split = self._wire.split
        self._wire_send_dat = self._wire.send_dat
        self._pollout = zmq.Poller()
        self._pollout.register(sock, zmq.POLLOUT)

    # -- introspection ---------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The underlying zmq socket, e.g. to register in a shared ``zmq.Poller``.

        Receive and send through the port, not the socket, or the envelope and the
        accounting go wrong.
        """
        return self._sock

    @property
    def socket_type(self) -> str:
        """``"SERVER"``, ``"CLIENT"``, ``"ROUTER"`` or ``"DEALER"`` (for ZRE headers)."""
        return self._socket_name

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Endpoints bound (server) or connected (client), in order."""
        return tuple(self._endpoints)

    @property
    def sndhwm(self) -> int:
        """Most messages queued to one peer (0: no limit)."""
        return self._sndhwm

    @property
    def endpoint(self) -> str | None:
        """The first endpoint, or ``None`` before ``bind``/``connect``."""
        return self._endpoints[0] if self._endpoints else None

    @property
    def closed(self) -> bool:
        return self._closed

    def _where(self) -> str | None:
        return ", ".join(self._endpoints) or None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self._socket_name} {self._where()} {state}>"

    # -- lifecycle -------------------------------------------------------------------

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket; idempotent.

        ``linger_ms`` overrides the port's linger for this close (0 discards anything
        still queued). See the module docstring on why linger is no delivery guarantee.
        """
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=linger_ms)

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- raw I/O with deadlines ----------------------------------------------------------

    def _transport_error(self, what: str, e: zmq.ZMQError) -> TransportError:
        if self._closed or e.errno == zmq.ENOTSOCK:
            return TransportError(f"{what}: port is closed", endpoint=self._where())
        if e.errno == zmq.ETERM:
            return TransportError(f"{what}: context terminated", endpoint=self._where())
        return TransportError(f"{what}: {e}", endpoint=self._where())

    def _wait(self, poller: zmq.Poller, deadline: float) -> bool:
        """Poll until ready or the deadline; False on timeout."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            return bool(poller.poll(max(1, math.ceil(remaining * 1000))))
        except zmq.ZMQError as e:
            raise self._transport_error("poll failed", e) from e

    def _recv_with(self, op: Callable[[int], _R], timeout_ms: float) -> _R | None:
        """Receive with ``op(flags)``, blocking in libzmq for up to ``timeout_ms``.

        The wait is the socket's RCVTIMEO (set only when the timeout changes), not a
        NOBLOCK attempt and a poll: when the peer is slower than us, that costs a raised
        ``zmq.Again`` and a poll call per message, which is most of a hot loop's time.
        """
        if self._held_error is not None:
            self._raise_held()
        try:
            if timeout_ms != self._timeout_arg or type(timeout_ms) is not self._timeout_type:
                ms = min(math.ceil(_check_timeout(timeout_ms)), _MAX_TIMEOUT_MS)
                if ms != self._rcvtimeo:
                    self._sock.setsockopt(zmq.RCVTIMEO, ms)
                    self._rcvtimeo = ms
                self._timeout_arg, self._timeout_type = timeout_ms, type(timeout_ms)
            return op(0)
        except zmq.Again:
            return None
        except zmq.ZMQError as e:
            raise self._transport_error("recv failed", e) from e

    def _recv_one(self, convert: Callable[[Any], Any], timeout_ms: float) -> Any:
        """One message within ``timeout_ms`` through ``convert`` (the wire's ``split`` or
        ``decode``), counted; a :class:`BadMessage` (or raised) if it is broken; None."""
        raw = self._recv_with(self._get, timeout_ms)
        if raw is None:
            return None
        try:
            item = convert(raw)
        except Undecodable as bad:
            return self.report_bad_message(self._from(bad), bad.error, bad.frames)
        self.stats["received"] += 1
        if self._peered:
            self._last_peer = item[0]
        return item

    def _from(self, bad: Undecodable) -> PeerId | str | None:
        """Who sent a bad message: the peer id, or (on a client) the endpoints."""
        return self._where() if bad.peer is None else bad.peer

    def _send(self, packed: Any, timeout_ms: float | None, peer: PeerId | None) -> None:
        """Queue what the wire packed, retrying until a deadline (see :meth:`_retry`)."""
        try:
            self._put(packed, peer)
        except zmq.Again:
            self._retry(packed, timeout_ms, peer)
        except zmq.ZMQError as e:
            raise self._send_error(e, peer) from e
        else:
            self.stats["sent"] += 1

    def _send_dat(
        self,
        codec: DatCodec,
        seqno: int,
        payload: tuple[bytes, ...],
        peer: PeerId | None,
        timeout_ms: float | None,
    ) -> None:
        """A plain DAT: packed and queued in one wire call, packed once more on a retry."""
        try:
            self._wire_send_dat(codec, seqno, payload, peer)
        except zmq.Again:
            self._retry(self._wire.pack_dat(codec, seqno, payload, peer), timeout_ms, peer)
        except zmq.ZMQError as e:
            raise self._send_error(e, peer) from e
        else:
            self.stats["sent"] += 1

    def _retry(self, packed: Any, timeout_ms: float | None, peer: PeerId | None) -> None:
        """Queue ``packed`` once there is room, or raise TransportError at the deadline.

        POLLOUT is exact for DEALER and CLIENT. A ROUTER_MANDATORY ROUTER reports POLLOUT
        when *any* peer has room and a SERVER always does, so a retry can fail again;
        then a short, growing back-off keeps the loop from spinning.
        """
        timeout = self._send_timeout if timeout_ms is None else _check_timeout(timeout_ms)
        deadline = time.monotonic() + timeout / 1000.0
        backoff = 0.0002
        while True:
            if self._wait(self._pollout, deadline):
                try:
                    self._put(packed, peer)
                except zmq.Again:
                    pause = min(backoff, deadline - time.monotonic())
                    if pause > 0:
                        time.sleep(pause)
                    backoff = min(backoff * 2, 0.01)
                    continue
                except zmq.ZMQError as e:
                    raise self._send_error(e, peer) from e
                self.stats["sent"] += 1
                return
            target = f" to {format_peer(peer)}" if peer is not None else ""
            raise TransportError(
                f"could not queue a message{target} within {timeout:g} ms on "
                f"{self._socket_name}: the peer's queue is full (sndhwm {self._sndhwm}) "
                "or no peer is connected",
                endpoint=self._where(),
            )

    def _send_error(self, e: zmq.ZMQError, peer: PeerId | None) -> TransportError:
        if e.errno == zmq.EHOSTUNREACH and peer is not None:
            return UnknownPeerError(
                f"cannot send to {format_peer(peer)} on {self._socket_name}: no such peer "
                "(never connected, or disconnected)",
                peer=peer,
                endpoint=self._where(),
            )
        return self._transport_error("send failed", e)

    # -- bad input -------------------------------------------------------------------

    def report_bad_message(
        self,
        peer: PeerId | str | None,
        error: RemoteProtocolError,
        frames: Sequence[bytes] = (),
    ) -> BadMessage:
        """Count and log a bad message; returns the marker, or raises in "raise" mode.

        Ports call this themselves; a hot loop that decodes ``recv_frames`` output on its
        own calls it too when its decoding fails, so counting and logging stay in one
        place.

        Raises
        ------
        RemoteProtocolError
            ``error`` itself, with ``.peer`` set, when the port's ``on_bad_message`` is
            ``"raise"``.
        """
        bad = self._report(peer, error, frames)
        if self._raise_bad:
            raise error
        return bad

    def _report(
        self, peer: PeerId | str | None, error: RemoteProtocolError, frames: Sequence[bytes]
    ) -> BadMessage:
        """Count and log a bad message and return its marker (never raises)."""
        if error.peer is None:
            error.peer = peer
        n = self.stats["bad_messages"] = self.stats["bad_messages"] + 1
        if n <= _LOG_BAD_FIRST or n % _LOG_BAD_EVERY == 0:
            log.warning(
                "bad message from %s on %s %s: %s (field=%s)%s",
                format_peer(peer),
                self._socket_name,
                self._where(),
                error,
                error.field,
                f" [{n} bad messages so far, logging 1 in {_LOG_BAD_EVERY}]"
                if n >= _LOG_BAD_FIRST
                else "",
            )
        return BadMessage(peer, error, tuple(bytes(f) for f in frames))

    # -- receiving many ---------------------------------------------------------------

    def _take(self, flags: int) -> Any:
        """Receive one message with ``flags`` and decode it (bad ones reported, not raised).

        Raises ``zmq.Again`` if none is there; each kind of port gets what its ``recv``
        returns.
        """
        raw = self._get(flags)
        try:
            return self._decode(raw)
        except Undecodable as bad:
            return self._report(self._from(bad), bad.error, bad.frames)

    def _raise_held(self) -> None:
        """Raise the bad message a batch stopped at (in "raise" mode), once."""
        error, self._held_error = self._held_error, None
        assert error is not None
        raise error

    def _recv_many(self, max_n: int, timeout_ms: float, max_bytes: int) -> list[Any]:
        if type(max_n) is not int or max_n < 1:
            raise ConfigError("max_n", max_n, "a positive integer (messages per call)")
        if type(max_bytes) is not int or max_bytes < 1:
            raise ConfigError("max_bytes", max_bytes, "a positive integer (bytes per call)")
        first = self._recv_with(self._take, timeout_ms)
        if first is None:
            return []
        if type(first) is BadMessage and self._raise_bad:
            raise first.error
        out = [first]
        bad = int(type(first) is BadMessage)
        wire = self._wire
        took = wire.took
        take, append = self._take, out.append
        try:
            for _ in range(max_n - 1):
                if took >= max_bytes:
                    break
                item = take(_NB)
                took += wire.took
                if type(item) is BadMessage:
                    if self._raise_bad:
                        # Raised by the next call, after the caller has the good ones.
                        self._held_error = item.error
                        break
                    bad += 1
                append(item)
        except zmq.Again:
            pass
        except zmq.ZMQError:
            pass  # closed or terminated: the next call says so; what came is kept
        self.stats["received"] += len(out) - bad
        if self._peered:
            for item in reversed(out):
                if type(item) is not BadMessage:
                    self._last_peer = item[0]
                    break
        return out

    # -- receiving (public) ------------------------------------------------------------

    def recv(self, timeout_ms: float) -> _Got | BadMessage | None:
        """Receive and decode one ZIO message: ``(peer, message)`` on a
        :class:`ServerPort` (the peer becomes :attr:`~ServerPort.last_peer`), the
        message on a :class:`ClientPort`.

        Returns
        -------
        The message; a :class:`BadMessage` if the envelope or the message is broken (in
        "return" mode); ``None`` if nothing arrived within ``timeout_ms``.

        Raises
        ------
        RemoteProtocolError
            For a bad message, in "raise" mode (``.peer`` set: the peer id on a server,
            the endpoint on a client).
        TransportError
            If the port is closed or the context terminated.
        """
        return self._recv_one(self._decode, timeout_ms)  # type: ignore[no-any-return]

    def recv_frames(self, timeout_ms: float) -> _Parts | BadMessage | None:
        """Receive one message as ZIO parts ``[prefix, coord, *payload]``, undecoded:
        ``(peer, parts)`` on a :class:`ServerPort`, the parts on a :class:`ClientPort`.

        The envelope is checked and removed, so what comes back is the same in both
        modes; the ZIO parts themselves are not validated (the fast path for loops that
        decode on their own; call :meth:`report_bad_message` if that fails).

        Returns
        -------
        The parts; a :class:`BadMessage` for a broken envelope (in "return" mode);
        ``None`` if nothing arrived within ``timeout_ms``.

        Raises
        ------
        RemoteProtocolError, TransportError
            As :meth:`recv`, for a broken envelope.
        """
        return self._recv_one(self._split, timeout_ms)  # type: ignore[no-any-return]

    def recv_many(
        self, max_n: int, timeout_ms: float, max_bytes: int = _MANY_BYTES
    ) -> list[_Got | BadMessage]:
        """Receive up to ``max_n`` messages: the first within ``timeout_ms``, then those
        already queued, without waiting. What :meth:`recv` gives, many at a time, for loops
        that drain a busy port (one call per batch instead of per message).

        A batch also ends once its messages reach ``max_bytes`` on the wire: a batch of
        large DATs that outgrows the CPU caches costs more per byte than it saves. On a
        server, :attr:`~ServerPort.last_peer` becomes the peer of the batch's last good
        message: reply with an explicit routing id when a batch may mix peers. A loop
        that waits with ``poll`` before receiving would see a held error (below) only
        once another message arrives: give such loops a "return" mode port.

        Returns
        -------
        What :meth:`recv` gives, in arrival order; in "return" mode a :class:`BadMessage`
        takes a bad one's place. ``[]`` if nothing arrived in time.

        Raises
        ------
        RemoteProtocolError
            In "raise" mode, for a bad message: at once if it came first, else the batch
            ends before it and the next ``recv``/``recv_many`` call raises it.
        ConfigError
            If ``max_n`` or ``max_bytes`` is not a positive integer.
        TransportError
            If the port is closed or the context terminated (messages already taken by
            this call are returned first).
        """
        return self._recv_many(max_n, timeout_ms, max_bytes)

    def _attach(self, verb: str, op: Callable[[str], _R], endpoint: str) -> _R:
        """``op(endpoint)`` (the socket's bind or connect), its errors named."""
        if isinstance(endpoint, str) and "://[" in endpoint:
            # An IPv6 address: without ZMQ_IPV6 libzmq never connects to it, silently.
            self._sock.ipv6 = True
        try:
            return op(endpoint)
        except zmq.ZMQError as e:
            raise TransportError(
                f"cannot {verb} {self._socket_name}: {e}", endpoint=endpoint
            ) from e
        except TypeError as e:
            raise ConfigError("endpoint", endpoint, "an endpoint string") from e


class ServerPort(_Port[tuple[PeerId, Message], tuple[PeerId, list[bytes]]]):
    """The binding side of ZIO flows: a SERVER, or a ROUTER in the fallback mode.

    Parameters
    ----------
    ctx
        The zmq context (a plain, non-asyncio ``zmq.Context``).
    mode
        ``"routerdealer"`` (default when ``None``), ``"clientserver"``, or ``"auto"``;
        resolved by :func:`choose_mode` with no peer information.
    linger_ms
        ZMQ_LINGER for close (default 1000; -1 waits forever; see the module docstring).
    sndhwm, rcvhwm
        High-water marks, in messages, per connected client (0 = unlimited).
    send_timeout_ms
        Default time ``send`` may wait to queue a message.
    on_bad_message
        ``"return"`` a :class:`BadMessage` from ``recv`` (default) or ``"raise"``
        :class:`~zio_spark.errors.RemoteProtocolError`.
    curve
        Turns on CURVE as server: our key pair, and our public key as ``server_key`` (build
        one from keys with :func:`~zio_spark.transport.curve.server_curve`).
    zap_domain
        ZAP domain of the socket (see :func:`~zio_spark.transport.curve.start_authenticator`).
    user_ids
        Keep the ZAP ``User-Id`` of each client's connection (:meth:`user_id`): what a
        server whose flows depend on the client's CURVE key reads at BOT time. Off by
        default (a property lookup per message).
    conn_ids
        Keep which connection each client's latest message came on (:meth:`connection`):
        what a server that ends flows whose client's connection closed without EOT reads
        at BOT time. Off by default: a property lookup and an ``fstat`` per message
        (about 5 us a message on a ROUTER, measured on a busy 2-core machine; a
        producer's port takes PAYs, one per DAT at most).
    heartbeat_ms
        ``(interval, timeout)``: ZMTP heartbeats on every connection (``ZMQ_HEARTBEAT_IVL``
        and ``ZMQ_HEARTBEAT_TIMEOUT``, libzmq >= 4.2): libzmq PINGs a client every
        ``interval`` ms and closes its connection when nothing at all (data or PONG) came
        for ``timeout`` ms: a peer host that went silent (no FIN: power, network) is
        disconnected as one that closed. PING/PONG are ZMTP commands, answered by the
        peer's libzmq itself; the application of either side never sees them. None (the
        default): libzmq's default, no heartbeats.

    Raises
    ------
    ConfigError
        For a bad option value.
    TransportError
        If the mode is unavailable or the socket cannot be created.
    """

    kind = PortKind.SERVER
    _peered = True

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        curve: Curve | None = None,
        zap_domain: str | None = None,
        user_ids: bool = False,
        conn_ids: bool = False,
        heartbeat_ms: tuple[int, int] | None = None,
        **options: Unpack[PortOptions],
    ) -> None:
        if heartbeat_ms is not None:
            ivl, tmo = heartbeat_ms
            check_count("heartbeat interval (ms)", ivl, 1)
            check_count("heartbeat timeout (ms)", tmo, 1)
        keys = server_keys(curve)
        self.curve_public_key = keys[1] if keys else None
        super().__init__(
            ctx, functools.partial(apply_server, keys=keys, zap_domain=zap_domain), **options
        )
        if heartbeat_ms is not None:
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
        self.heartbeat_ms = heartbeat_ms
        # peer -> the User-Id of its connection (user_ids only; bounded, oldest out).
        self._user_ids: dict[PeerId, str | None] | None = None
        # peer -> its connection (conn_ids only; bounded the same way).
        self._conns: dict[PeerId, Connection] | None = None
        if user_ids or conn_ids:
            self._keep_meta(user_ids, conn_ids)

    def _keep_meta(self, user_ids: bool, conn_ids: bool) -> None:
        wire = self._wire
        ids: dict[PeerId, str | None] | None = None
        conns: dict[PeerId, Connection] | None = None
        if user_ids:
            wire.keep_user_ids()
            ids = self._user_ids = {}
        if conn_ids:
            wire.keep_fds()
            conns = self._conns = {}
        decode, split = self._decode, self._split

        def note(peer: PeerId) -> None:
            # Every message of a peer (one connection) has the same User-Id; the latest
            # goes last, so the oldest peers are the ones forgotten.
            if ids is not None:
                _remember(ids, peer, wire.user_id)
            if conns is not None and wire.fd >= 0:
                _remember(conns, peer, _connection(wire.fd))

        def decode_noting(raw: Any) -> Any:
            got = decode(raw)
            note(got[0])
            return got

        def split_noting(raw: Any) -> Any:
            got = split(raw)
            note(got[0])
            return got

        self._get = wire.get
        self._decode = decode_noting
        self._split = split_noting

    def user_id(self, peer: PeerId) -> str | None:
        """The ZAP ``User-Id`` of the connection ``peer``'s latest message came on: a
        CURVE client's Z85 public key under a ZAP handler of ours or pyzmq's. None if
        the port keeps none (``user_ids`` off), no ZAP handler judged the connection,
        or nothing came from ``peer`` lately."""
        kept = self._user_ids
        return None if kept is None else kept.get(peer)

    def connection(self, peer: PeerId) -> Connection | None:
        """The connection ``peer``'s latest message came on (see :func:`connection_open`),
        None if the port keeps none (``conn_ids`` off), the transport has no descriptor
        (``inproc``) or nothing came from ``peer`` lately. A connection already closed
        when its message was read is kept as one that :func:`connection_open` calls
        closed."""
        kept = self._conns
        return None if kept is None else kept.get(peer)

    @property
    def last_peer(self) -> PeerId | None:
        """The peer of the most recent good message, the default target of ``send``."""
        return self._last_peer

    def bind(self, endpoint: str) -> str:
        """Bind and return the actual endpoint (``tcp://127.0.0.1:*`` gets its port).

        Raises
        ------
        TransportError
            If the endpoint is malformed or in use.
        """
        self._attach("bind", self._sock.bind, endpoint)
        actual = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        result = actual.decode() if isinstance(actual, bytes) else str(actual)
        self._endpoints.append(result)
        return result

    def _target(self, routing_id: PeerId | None) -> PeerId:
        peer = self._last_peer if routing_id is None else routing_id
        if peer is None:
            raise LocalProtocolError(
                "send needs a routing_id: no message has been received yet to reply to",
                field="routing_id",
            )
        return self._wire.check_peer(peer)

    def send_frames(
        self,
        frames: Sequence[bytes],
        routing_id: PeerId | None = None,
        *,
        timeout_ms: float | None = None,
    ) -> None:
        """Send already-encoded ZIO parts ``[prefix, coord, *payload]`` to one client.

        The port adds the envelope (identity and delimiter, or the single-frame
        encoding). ``routing_id=None`` replies to :attr:`last_peer`.

        Raises
        ------
        UnknownPeerError
            If no such client is connected.
        TransportError
            If the message cannot be queued within ``timeout_ms`` (default: the port's
            ``send_timeout_ms``), or the port is closed.
        LocalProtocolError
            If there is no peer to reply to, or the id does not fit the mode.
        """
        peer = self._target(routing_id)
        self._send(self._wire.pack(frames, peer), timeout_ms, peer)

    def send_dat(
        self,
        codec: DatCodec,
        seqno: int,
        payload: tuple[bytes, ...],
        routing_id: PeerId | None = None,
        *,
        timeout_ms: float | None = None,
    ) -> None:
        """Send a plain DAT encoded by ``codec`` (the fast lane of
        :meth:`~zio_spark.protocol.flow.Flow.send_dats`); otherwise as :meth:`send_frames`.
        """
        self._send_dat(codec, seqno, payload, self._target(routing_id), timeout_ms)

    def send(
        self,
        msg: Message,
        routing_id: PeerId | None = None,
        *,
        timeout_ms: float | None = None,
    ) -> None:
        """Encode and send a ZIO message to one client; see :meth:`send_frames`.

        Raises
        ------
        LocalProtocolError
            If the message does not encode, or as in :meth:`send_frames`.
        UnknownPeerError, TransportError
            As in :meth:`send_frames`.
        """
        self.send_frames(encode_frames(msg), routing_id, timeout_ms=timeout_ms)


def _remember(kept: dict[PeerId, Any], peer: PeerId, value: Any) -> None:
    """Keep ``value`` for ``peer`` as its latest (the dict's order: the oldest peers go
    first once more than ``_USER_IDS_KEPT`` are kept)."""
    kept.pop(peer, None)
    kept[peer] = value
    if len(kept) > _USER_IDS_KEPT:
        del kept[next(iter(kept))]


def _connection(fd: int) -> Connection:
    """The connection on descriptor ``fd``: the descriptor and that socket's inode read
    now (an ``fstat`` per message, under a microsecond: a peer that reconnects with the
    same routing id is then known on its new connection at once)."""
    try:
        inode = os.fstat(fd).st_ino
    except OSError:  # closed since the message was read: that connection is gone
        inode = -1  # no socket has it: connection_open says closed
    return fd, inode


class ClientPort(_Port[Message, list[bytes]]):
    """The connecting side of ZIO flows: a CLIENT, or a DEALER in the fallback mode.

    Parameters
    ----------
    ctx, mode, linger_ms, sndhwm, rcvhwm, send_timeout_ms, on_bad_message
        As for :class:`ServerPort`.
    curve
        Turns on CURVE as client: the server's public key (``server_key``) and this
        client's key pair, which the server's authenticator checks (build one from keys
        with :func:`~zio_spark.transport.curve.client_curve`).

    Raises
    ------
    ConfigError, TransportError
        As for :class:`ServerPort`.
    """

    kind = PortKind.CLIENT
    _peered = False

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        curve: Curve | None = None,
        **options: Unpack[PortOptions],
    ) -> None:
        secure: Callable[[zmq.Socket[bytes]], None] | None = None
        self.curve_public_key = None
        keys = client_keys(curve)
        if keys is not None:
            server_key, pair = keys
            secure = functools.partial(apply_client, server_key=server_key, keys=pair)
            self.curve_public_key = pair[1]
        super().__init__(ctx, secure, **options)

    def connect(self, endpoint: str) -> str:
        """Connect to a server endpoint; returns it. Connection happens in the background.

        Messages sent before the connection is up are queued (up to ``sndhwm``).

        Raises
        ------
        TransportError
            If the endpoint is malformed or its transport unsupported.
        """
        self._attach("connect", self._sock.connect, endpoint)
        self._endpoints.append(endpoint)
        return endpoint

    def disconnect(self, endpoint: str) -> None:
        """Disconnect from one endpoint given to :meth:`connect`.

        Raises
        ------
        TransportError
            If the port is not connected to it.
        """
        try:
            self._sock.disconnect(endpoint)
        except zmq.ZMQError as e:
            raise TransportError(
                f"cannot disconnect {self._socket_name}: {e}", endpoint=endpoint
            ) from e
        self._endpoints.remove(endpoint)

    def send_frames(self, frames: Sequence[bytes], *, timeout_ms: float | None = None) -> None:
        """Send already-encoded ZIO parts ``[prefix, coord, *payload]`` to the server.

        Raises
        ------
        TransportError
            As :meth:`ServerPort.send_frames` (e.g. nothing connected and the queue full).
        """
        self._send(self._wire.pack(frames, None), timeout_ms, None)

    def send_dat(
        self,
        codec: DatCodec,
        seqno: int,
        payload: tuple[bytes, ...],
        *,
        timeout_ms: float | None = None,
    ) -> None:
        """Send a plain DAT encoded by ``codec``; see :meth:`ServerPort.send_dat`."""
        self._send_dat(codec, seqno, payload, None, timeout_ms)

    def send_dats(
        self,
        codec: DatCodec,
        first: int,
        payloads: Sequence[tuple[bytes, ...]],
        *,
        timeout_ms: float | None = None,
    ) -> None:
        """Send plain DATs numbered ``first``, ``first + 1``, ... (one per payload): what
        :meth:`send_dat` does for each, in one call.

        Raises
        ------
        LocalProtocolError, TransportError
            As :meth:`send_dat`; the DATs before the failing one were queued, and a
            TransportError's ``sent`` says how many.
        """
        n = len(payloads)
        done = 0
        send = self._wire_send_dat
        try:  # what fits now, without a retry loop each
            for payload in payloads:
                send(codec, first + done, payload, None)
                done += 1
        except zmq.Again:
            pass  # the queue is full: the rest wait for room, one by one
        except zmq.ZMQError as e:
            self.stats["sent"] += done
            error = self._send_error(e, None)
            error.sent = done
            raise error from e
        self.stats["sent"] += done
        try:
            for i in range(done, n):
                self._send_dat(codec, first + i, payloads[i], None, timeout_ms)
                done += 1
        except TransportError as e:
            e.sent = done
            raise

    def send(self, msg: Message, *, timeout_ms: float | None = None) -> None:
        """Encode and send a ZIO message; see :meth:`send_frames` (LocalProtocolError if
        the message does not encode)."""
        self.send_frames(encode_frames(msg), timeout_ms=timeout_ms)
