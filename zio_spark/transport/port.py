"""Ports: the sockets under ZIO flows, in CLIENT/SERVER or the ROUTER/DEALER fallback.

Theory of operation (specs/zio-wire.md, specs/41-clientserver.txt, DESIGN.md "Sockets"):

A *port* is one ZeroMQ socket with a role (:class:`PortKind`): a :class:`ServerPort`
binds and talks to many clients, each addressed by an opaque :data:`PeerId`; a
:class:`ClientPort` connects and talks to its server. Two wire modes (:class:`SocketMode`)
exist and a port speaks exactly one of them:

``clientserver``
    Real draft CLIENT/SERVER sockets (41/CLIENTSERVER). They carry one frame per
    message, so a ZIO message travels in czmq's single-frame encoding
    (:func:`~zio_spark.protocol.message.encode_single`). The SERVER names each client
    by a non-zero uint32 *routing id* (an ``int`` here). Needs a pyzmq built against a
    draft-enabled libzmq: stock PyPI pyzmq has no draft API, and a CLIENT/SERVER
    handshake with it aborts the whole process, so these sockets are only ever created
    when ``zmq.DRAFT_API`` is true (see ``scripts/build-draft-pyzmq.sh``).
``routerdealer``
    The reference ZIO fallback: the server side is a ROUTER, which receives
    ``[identity][empty][prefix][coord][payload...]`` and replies
    ``[identity][empty][prefix][coord][payload...]``; the client side is a DEALER,
    which sends ``[empty][prefix][coord][payload...]`` and receives
    ``[empty][prefix][coord][payload...]``. The peer id is the ROUTER identity
    (``bytes``).

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

Security. ``ServerPort(curve_secret_key=...)`` turns on CURVE (``ClientPort`` then needs
``curve_server_key`` and its own key pair). Which clients may connect is decided by a ZAP
handler: :func:`start_authenticator` runs pyzmq's ``ThreadAuthenticator`` with an
allow-list of client public keys. Without an authenticator any client that knows the
server's public key is accepted.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any, Literal, TypeVar

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from zio_spark.errors import ConfigError, LocalProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.message import (
    DatCodec,
    Message,
    decode_frames,
    decode_single,
    encode_frames,
    join_single,
    split_single,
)

__all__ = [
    "BadMessage",
    "ClientPort",
    "CurveAuthenticator",
    "PeerId",
    "PortKind",
    "ServerPort",
    "SocketMode",
    "UnknownPeerError",
    "choose_mode",
    "drafts_available",
    "format_peer",
    "socket_type_name",
    "start_authenticator",
]

log = logging.getLogger("zio_spark.transport")

PeerId = bytes | int
"""How a :class:`ServerPort` names a client: the ROUTER identity (``bytes``) in
``routerdealer`` mode, the SERVER routing id (``int``, 1..2**32-1) in ``clientserver``
mode. Treat it as opaque; it is only good for replying on the port that produced it."""

OnBadMessage = Literal["return", "raise"]
_P = TypeVar("_P", bound="_Port")
_R = TypeVar("_R")

DRAFT_BUILD_HINT = (
    "requires a draft-enabled pyzmq (zmq.has('draft') and zmq.DRAFT_API); "
    "build one with scripts/build-draft-pyzmq.sh"
)

# Bad-message log lines are throttled so that a peer spraying garbage cannot flood the
# log: the first few are logged, then one in every _LOG_BAD_EVERY with the running total.
_LOG_BAD_FIRST = 20
_LOG_BAD_EVERY = 1000

_NB = zmq.NOBLOCK
# Single frames this long are decoded from a view of the frame, so their payload is
# copied once (as recv(copy=True) would); shorter ones are cheaper to take as bytes.
_VIEW_MIN = 4096
# recv_many: a batch ends once it holds this many bytes (large DATs stay cache-sized).
_MANY_BYTES = 1 << 18
_MAX_TIMEOUT_MS = 2**31 - 1  # RCVTIMEO is an int: ~24.8 days, longer waits are cut there
_NB_MORE = zmq.NOBLOCK | zmq.SNDMORE


def _send_parts(sock: zmq.Socket[bytes], parts: Sequence[bytes]) -> None:
    """``send_multipart(parts, NOBLOCK)`` without its per-frame checks (~3x faster here).

    ``zmq.Again`` can only come from the first frame (nothing queued then): libzmq takes
    a message's further frames once it has taken the first.
    """
    for p in parts:
        if type(p) is not bytes:
            # pyzmq checks every part before sending any: a part of the wrong type must
            # not leave half a message queued, to be glued onto the next one.
            sock.send_multipart(parts, _NB)
            return
    send = sock.send
    last = len(parts) - 1
    for i in range(last):
        send(parts[i], _NB_MORE)
    send(parts[last], _NB)


def _recv_parts(sock: zmq.Socket[bytes], flags: int) -> list[bytes]:
    """``recv_multipart(flags)`` reading "more" from each frame, not a getsockopt each.

    Raises ``zmq.Again`` if no message came (NOBLOCK, or RCVTIMEO ran out); the rest of
    a message is always there once its first frame is.
    """
    frame = sock.recv(flags, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = sock.recv(_NB, copy=False)
        parts.append(frame.bytes)
    return parts


class PortKind(str, Enum):
    """A port's role: the server binds and serves many clients; a client connects."""

    SERVER = "server"
    CLIENT = "client"


class SocketMode(str, Enum):
    """The wire mode of a port; both ends of a connection must use the same one."""

    CLIENTSERVER = "clientserver"
    ROUTERDEALER = "routerdealer"


_SOCKET_NAMES: dict[tuple[PortKind, SocketMode], str] = {
    (PortKind.SERVER, SocketMode.CLIENTSERVER): "SERVER",
    (PortKind.CLIENT, SocketMode.CLIENTSERVER): "CLIENT",
    (PortKind.SERVER, SocketMode.ROUTERDEALER): "ROUTER",
    (PortKind.CLIENT, SocketMode.ROUTERDEALER): "DEALER",
}
_PEER_SOCKET_MODES = {
    "SERVER": SocketMode.CLIENTSERVER,
    "CLIENT": SocketMode.CLIENTSERVER,
    "ROUTER": SocketMode.ROUTERDEALER,
    "DEALER": SocketMode.ROUTERDEALER,
}
_MODE_CHOICES = "'auto', 'clientserver' or 'routerdealer'"


def socket_type_name(kind: PortKind | str, mode: SocketMode | str) -> str:
    """The socket type name a port of this kind and mode advertises.

    This is the value for the ZRE header ``zio.port.<name>.socket``: ``"SERVER"``,
    ``"CLIENT"``, ``"ROUTER"`` or ``"DEALER"``.

    Raises
    ------
    ConfigError
        If ``kind`` or ``mode`` is not one of the known values.
    """
    try:
        k = PortKind(kind)
    except ValueError:
        raise ConfigError("kind", kind, "'server' or 'client'") from None
    try:
        m = SocketMode(mode)
    except ValueError:
        raise ConfigError("mode", mode, "'clientserver' or 'routerdealer'") from None
    return _SOCKET_NAMES[k, m]


def drafts_available() -> bool:
    """True when libzmq has the draft API (``zmq.has('draft')``), checked at call time."""
    return bool(zmq.has("draft"))


def choose_mode(
    requested: SocketMode | str | None,
    peer_socket: str | None,
    *,
    option: str = "mode",
) -> SocketMode:
    """Choose the wire mode from an explicit request and/or a peer's advertised socket.

    Parameters
    ----------
    requested
        ``"clientserver"``, ``"routerdealer"``, ``"auto"`` or ``None`` (same as auto);
        case-insensitive.
    peer_socket
        The socket type the peer advertises (ZRE header ``zio.port.<name>.socket``):
        ``"SERVER"``, ``"CLIENT"``, ``"ROUTER"`` or ``"DEALER"`` (case-insensitive), or
        ``None`` when unknown.
    option
        The option name to quote in a :class:`ConfigError` (e.g. the user-facing key).

    Returns
    -------
    SocketMode
        The rules, in order:

        1. explicit ``clientserver`` without drafts (``zmq.has('draft')`` false):
           TransportError;
        2. an explicit mode contradicting the peer's advertised socket (clientserver
           against ROUTER/DEALER, routerdealer against SERVER/CLIENT): TransportError, as
           the two would connect and then never deliver a message;
        3. explicit mode: that mode;
        4. auto, peer advertises SERVER/CLIENT: ``clientserver`` if drafts are available,
           else TransportError (a ROUTER/DEALER port would never interoperate with it);
        5. auto, peer advertises ROUTER/DEALER: ``routerdealer``;
        6. auto, nothing known about the peer: ``routerdealer``, the reference default
           that every ZIO peer without drafts speaks.

    Raises
    ------
    ConfigError
        If ``requested`` is not one of the accepted values.
    RemoteProtocolError
        ``field="socket"``, if the peer advertises a socket type a ZIO port cannot be.
    TransportError
        If the request cannot work on this machine or with this peer (rules 1, 2, 4).
    """
    if requested is None:
        req = "auto"
    elif isinstance(requested, SocketMode):
        req = requested.value
    elif isinstance(requested, str):
        req = requested.strip().lower()
    else:
        raise ConfigError(option, requested, _MODE_CHOICES)
    if req not in ("auto", SocketMode.CLIENTSERVER.value, SocketMode.ROUTERDEALER.value):
        raise ConfigError(option, requested, _MODE_CHOICES)

    peer_mode: SocketMode | None = None
    peer_name: str | None = None
    if peer_socket is not None:
        peer_name = str(peer_socket).strip().upper()
        if peer_name not in _PEER_SOCKET_MODES:
            raise RemoteProtocolError(
                f"peer advertises socket type {peer_socket!r}; a ZIO port is one of "
                "SERVER, CLIENT, ROUTER or DEALER",
                field="socket",
                value=peer_socket,
            )
        peer_mode = _PEER_SOCKET_MODES[peer_name]

    drafts = drafts_available()
    if req == SocketMode.CLIENTSERVER.value and not drafts:
        raise TransportError(f"{option}='clientserver' {DRAFT_BUILD_HINT}")
    if req != "auto":
        mode = SocketMode(req)
        if peer_mode is not None and peer_mode is not mode:
            raise TransportError(
                f"{option}={req!r} cannot talk to a peer advertising a {peer_name} socket: "
                f"it needs {peer_mode.value!r} (libzmq would connect and deliver nothing)"
            )
        return mode
    if peer_mode is SocketMode.CLIENTSERVER:
        if not drafts:
            raise TransportError(
                f"peer advertises a {peer_name} socket, which only a CLIENT/SERVER port "
                f"can talk to; that {DRAFT_BUILD_HINT}"
            )
        return SocketMode.CLIENTSERVER
    return SocketMode.ROUTERDEALER


def format_peer(peer: PeerId | str | None) -> str:
    """Human-readable peer name for logs and errors."""
    if isinstance(peer, bytes):
        return f"identity 0x{peer.hex()}" if peer else "identity <empty>"
    if isinstance(peer, int):
        return f"routing id {peer}"
    if peer is None:
        return "unknown peer"
    return str(peer)


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


def _normalise_key(key: str | bytes, option: str) -> bytes:
    """A CURVE key as Z85 bytes (40 characters), from Z85 text or 32 raw bytes."""
    if isinstance(key, str):
        try:
            key = key.encode("ascii")
        except UnicodeEncodeError:
            raise ConfigError(option, key, "a Z85 CURVE key (40 characters)") from None
    if isinstance(key, bytes):
        if len(key) == 40:
            try:
                raw = z85.decode(key)
            except (ValueError, KeyError, TypeError):
                raw = b""
            if len(raw) == 32:
                return key
        elif len(key) == 32:
            return z85.encode(key)
    raise ConfigError(option, key, "a Z85 CURVE key (40 characters) or 32 raw bytes")


def _key_pair(secret_key: str | bytes, public_key: str | bytes | None) -> tuple[bytes, bytes]:
    """(secret, public) Z85 keys; the public key is derived, and checked if given."""
    if not zmq.has("curve"):
        raise TransportError("CURVE requested but this libzmq has no CURVE support")
    secret = _normalise_key(secret_key, "curve_secret_key")
    public = zmq.curve_public(secret)
    if public_key is not None and _normalise_key(public_key, "curve_public_key") != public:
        raise ConfigError("curve_public_key", public_key, "the public key of curve_secret_key")
    return secret, public


def _check_timeout(timeout_ms: float, option: str = "timeout_ms") -> float:
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)):
        raise ConfigError(option, timeout_ms, "a number of milliseconds >= 0")
    if not timeout_ms >= 0:  # also rejects NaN
        raise ConfigError(option, timeout_ms, "a number of milliseconds >= 0")
    return float(timeout_ms)


def _check_count(value: int, option: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(option, value, f"an integer >= {minimum}")
    return value


class _Port:
    """What both port kinds share: the socket, options, polling, stats, bad input, close."""

    kind: PortKind

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        mode: SocketMode | str | None,
        linger_ms: int,
        sndhwm: int,
        rcvhwm: int,
        send_timeout_ms: float,
        on_bad_message: OnBadMessage,
    ) -> None:
        self.mode: SocketMode = choose_mode(mode, None)
        self._linger = _check_count(linger_ms, "linger_ms", -1)
        self._sndhwm = _check_count(sndhwm, "sndhwm", 0)
        self._rcvhwm = _check_count(rcvhwm, "rcvhwm", 0)
        self._send_timeout = _check_timeout(send_timeout_ms, "send_timeout_ms")
        if on_bad_message not in ("return", "raise"):
            raise ConfigError("on_bad_message", on_bad_message, "'return' or 'raise'")
        self._raise_bad = on_bad_message == "raise"
        self._held_error: RemoteProtocolError | None = None  # see _recv_many
        self._took = 0  # bytes of the message _take received last
        self.stats: dict[str, int] = {"sent": 0, "received": 0, "bad_messages": 0}
        self._endpoints: list[str] = []
        self._closed = False
        self._socket_name = _SOCKET_NAMES[self.kind, self.mode]
        if self.mode is SocketMode.CLIENTSERVER and not (zmq.has("draft") and zmq.DRAFT_API):
            # Never open CLIENT/SERVER without drafts: the handshake aborts the process.
            raise TransportError(f"a {self._socket_name} socket {DRAFT_BUILD_HINT}")
        try:
            sock = ctx.socket(getattr(zmq, self._socket_name))
        except zmq.ZMQError as e:
            raise TransportError(f"cannot create a {self._socket_name} socket: {e}") from e
        self._sock: zmq.Socket[bytes] = sock
        try:
            sock.setsockopt(zmq.LINGER, self._linger)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            if self._socket_name == "ROUTER":
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        except BaseException:
            sock.close(linger=0)
            raise
        self._rcvtimeo = -1  # libzmq's default; _recv_with sets it per call
        self._timeout_arg: object = None  # the last timeout_ms checked (and its type)
        self._timeout_type: type = type(None)
        # The receive operations, bound once (not a closure made per message).
        self._op_parts: Callable[[int], list[bytes]] = functools.partial(_recv_parts, sock)
        self._op_frame: Callable[[int], zmq.Frame] = functools.partial(sock.recv, copy=False)
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

    def _recv_multipart(self, timeout_ms: float) -> list[bytes] | None:
        return self._recv_with(self._op_parts, timeout_ms)

    def _recv_frame(self, timeout_ms: float) -> zmq.Frame | None:
        return self._recv_with(self._op_frame, timeout_ms)

    def _send(
        self, attempt: Callable[[], object], timeout_ms: float | None, peer: PeerId | None
    ) -> None:
        """Queue a message with ``attempt()`` (a NOBLOCK send), retrying until a deadline.

        POLLOUT is exact for DEALER and CLIENT. A ROUTER_MANDATORY ROUTER reports POLLOUT
        when *any* peer has room and a SERVER always does, so a retry can fail again;
        then a short, growing back-off keeps the loop from spinning.
        """
        try:
            attempt()
        except zmq.Again:
            pass
        except zmq.ZMQError as e:
            raise self._send_error(e, peer) from e
        else:
            self.stats["sent"] += 1
            return
        timeout = self._send_timeout if timeout_ms is None else _check_timeout(timeout_ms)
        deadline = time.monotonic() + timeout / 1000.0
        backoff = 0.0002
        while True:
            if self._wait(self._pollout, deadline):
                try:
                    attempt()
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

        Raises ``zmq.Again`` if none is there; each kind of port returns what its
        ``recv`` does.
        """
        raise NotImplementedError  # pragma: no cover - every port defines it

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
        bad = type(first) is BadMessage
        took = self._took
        take, append = self._take, out.append
        try:
            for _ in range(max_n - 1):
                if took >= max_bytes:
                    break
                item = take(_NB)
                took += self._took
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
        return out


class ServerPort(_Port):
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
    curve_secret_key, curve_public_key
        Turn on CURVE as server. Z85 text or 32 raw bytes; the public key is derived from
        the secret key when omitted.
    zap_domain
        ZAP domain of the socket (see :func:`start_authenticator`).

    Raises
    ------
    ConfigError
        For a bad option value.
    TransportError
        If the mode is unavailable or the socket cannot be created.
    """

    kind = PortKind.SERVER

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        mode: SocketMode | str | None = None,
        linger_ms: int = 1000,
        sndhwm: int = 1000,
        rcvhwm: int = 1000,
        send_timeout_ms: float = 5000,
        on_bad_message: OnBadMessage = "return",
        curve_secret_key: str | bytes | None = None,
        curve_public_key: str | bytes | None = None,
        zap_domain: str | None = None,
    ) -> None:
        keys: tuple[bytes, bytes] | None = None
        if curve_secret_key is not None:
            keys = _key_pair(curve_secret_key, curve_public_key)
        elif curve_public_key is not None:
            raise ConfigError("curve_secret_key", None, "a key whenever curve_public_key is set")
        super().__init__(
            ctx,
            mode=mode,
            linger_ms=linger_ms,
            sndhwm=sndhwm,
            rcvhwm=rcvhwm,
            send_timeout_ms=send_timeout_ms,
            on_bad_message=on_bad_message,
        )
        self.curve_public_key: bytes | None = keys[1] if keys else None
        """This server's Z85 public key when CURVE is on (clients need it)."""
        try:
            if keys is not None:
                self._sock.setsockopt(zmq.CURVE_SERVER, 1)
                self._sock.setsockopt(zmq.CURVE_SECRETKEY, keys[0])
                self._sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[1])
            if zap_domain is not None:
                self._sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode("utf-8"))
        except BaseException:
            self.close(linger_ms=0)
            raise
        self._last_peer: PeerId | None = None
        self._cs = self.mode is SocketMode.CLIENTSERVER

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
        try:
            self._sock.bind(endpoint)
            actual = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            raise TransportError(f"cannot bind {self._socket_name}: {e}", endpoint=endpoint) from e
        except TypeError as e:
            raise ConfigError("endpoint", endpoint, "an endpoint string") from e
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
        if self._cs:
            if isinstance(peer, bool) or not isinstance(peer, int) or not 0 < peer < 2**32:
                raise LocalProtocolError(
                    f"a SERVER routing_id is an int 1..2**32-1, got {peer!r}",
                    field="routing_id",
                    value=peer,
                )
        elif not isinstance(peer, bytes) or not peer:
            raise LocalProtocolError(
                f"a ROUTER routing_id is non-empty bytes (the identity), got {peer!r}",
                field="routing_id",
                value=peer,
            )
        return peer

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
        sock = self._sock
        if isinstance(peer, int):  # _target made sure the id's type matches the mode
            data = join_single(frames)
            rid = peer

            def attempt() -> object:
                return sock.send(data, zmq.NOBLOCK, routing_id=rid)
        else:
            wire = [peer, b"", *frames]

            def attempt() -> object:
                return _send_parts(sock, wire)

        self._send(attempt, timeout_ms, peer)

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
        peer = self._target(routing_id)
        sock = self._sock
        if isinstance(peer, int):
            data = codec.single(seqno, payload)
            rid = peer

            def attempt() -> object:
                return sock.send(data, _NB, routing_id=rid)
        else:
            wire = [peer, b"", codec.prefix, codec.coord(seqno), *payload]

            def attempt() -> object:
                return _send_parts(sock, wire)

        self._send(attempt, timeout_ms, peer)

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

    def _recv_parts(self, timeout_ms: float) -> tuple[PeerId, list[bytes]] | BadMessage | None:
        if self._cs:
            frame = self._recv_frame(timeout_ms)
            if frame is None:
                return None
            peer: PeerId = frame.get("routing_id")  # not .routing_id: its draft check costs ~0.4 µs
            try:
                return peer, split_single(frame.buffer)
            except RemoteProtocolError as e:
                return self.report_bad_message(peer, e, [frame.bytes])
        wire = self._recv_multipart(timeout_ms)
        if wire is None:
            return None
        peer = wire[0]
        if len(wire) < 2 or wire[1]:
            return self.report_bad_message(peer, _envelope_error(wire[1:], peer), wire)
        return peer, wire[2:]

    def recv_frames(self, timeout_ms: float) -> tuple[PeerId, list[bytes]] | BadMessage | None:
        """Receive one message as ``(peer, [prefix, coord, *payload])``, undecoded.

        The envelope is checked and removed, so what comes back is the same in both
        modes; the ZIO parts themselves are not validated (the fast path for loops that
        decode on their own; call :meth:`report_bad_message` if that fails).

        Returns
        -------
        ``(peer, parts)``; a :class:`BadMessage` for a broken envelope (in "return" mode);
        ``None`` if nothing arrived within ``timeout_ms``.

        Raises
        ------
        RemoteProtocolError
            For a broken envelope, in "raise" mode (``.peer`` set).
        TransportError
            If the port is closed or the context terminated.
        """
        got = self._recv_parts(timeout_ms)
        if got is None or isinstance(got, BadMessage):
            return got
        self.stats["received"] += 1
        self._last_peer = got[0]
        return got

    def _take(self, flags: int) -> tuple[PeerId, Message] | BadMessage:
        if self._cs:
            frame = self._sock.recv(flags, copy=False)
            peer: PeerId = frame.get("routing_id")  # not .routing_id: its draft check costs ~0.4 µs
            self._took = size = len(frame)
            try:
                return peer, decode_single(frame.bytes if size < _VIEW_MIN else frame.buffer)
            except RemoteProtocolError as e:
                return self._report(peer, e, [frame.bytes])
        wire = _recv_parts(self._sock, flags)
        self._took = sum(map(len, wire))
        peer = wire[0]
        if len(wire) < 2 or wire[1]:
            return self._report(peer, _envelope_error(wire[1:], peer), wire)
        try:
            return peer, decode_frames(wire[2:])
        except RemoteProtocolError as e:
            return self._report(peer, e, wire[2:])

    def recv_many(
        self, max_n: int, timeout_ms: float, max_bytes: int = _MANY_BYTES
    ) -> list[tuple[PeerId, Message] | BadMessage]:
        """Receive up to ``max_n`` messages: the first within ``timeout_ms``, then those
        already queued, without waiting. What :meth:`recv` gives, many at a time, for loops
        that drain a busy port (one call per batch instead of per message).

        A batch also ends once its messages reach ``max_bytes`` on the wire: a batch of
        large DATs that outgrows the CPU caches costs more per byte than it saves.
        :attr:`last_peer` becomes the peer of the batch's last good message: reply with
        an explicit routing id when a batch may mix peers. A loop that waits with
        ``poll`` before receiving would see a held error (below) only once another
        message arrives: give such loops a "return" mode port.

        Returns
        -------
        ``(peer, message)`` items in arrival order; in "return" mode a
        :class:`BadMessage` takes a bad one's place. ``[]`` if nothing arrived in time.

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
        out = self._recv_many(max_n, timeout_ms, max_bytes)
        for item in reversed(out):
            if type(item) is not BadMessage:
                self._last_peer = item[0]
                break
        return out

    def recv(self, timeout_ms: float) -> tuple[PeerId, Message] | BadMessage | None:
        """Receive and decode one ZIO message as ``(peer, message)``.

        Returns
        -------
        ``(peer, message)``; a :class:`BadMessage` if the envelope or the message is
        broken (in "return" mode); ``None`` if nothing arrived within ``timeout_ms``.

        Raises
        ------
        RemoteProtocolError
            For a bad message, in "raise" mode (``.peer`` set).
        TransportError
            If the port is closed or the context terminated.
        """
        peer: PeerId
        if self._cs:
            frame = self._recv_frame(timeout_ms)
            if frame is None:
                return None
            peer = frame.get("routing_id")  # not .routing_id: its draft check costs ~0.4 µs
            try:
                msg = decode_single(frame.bytes if len(frame) < _VIEW_MIN else frame.buffer)
            except RemoteProtocolError as e:
                return self.report_bad_message(peer, e, [frame.bytes])
        else:
            got = self._recv_parts(timeout_ms)
            if got is None or isinstance(got, BadMessage):
                return got
            peer, parts = got
            try:
                msg = decode_frames(parts)
            except RemoteProtocolError as e:
                return self.report_bad_message(peer, e, parts)
        self.stats["received"] += 1
        self._last_peer = peer
        return peer, msg


class ClientPort(_Port):
    """The connecting side of ZIO flows: a CLIENT, or a DEALER in the fallback mode.

    Parameters
    ----------
    ctx, mode, linger_ms, sndhwm, rcvhwm, send_timeout_ms, on_bad_message
        As for :class:`ServerPort`.
    curve_server_key
        The server's public key: turns on CURVE as client. Z85 text or 32 raw bytes.
    curve_secret_key, curve_public_key
        This client's key pair (required with ``curve_server_key``; the public key is
        derived when omitted). The server's authenticator checks the public key.

    Raises
    ------
    ConfigError
        For a bad option value.
    TransportError
        If the mode is unavailable or the socket cannot be created.
    """

    kind = PortKind.CLIENT

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        mode: SocketMode | str | None = None,
        linger_ms: int = 1000,
        sndhwm: int = 1000,
        rcvhwm: int = 1000,
        send_timeout_ms: float = 5000,
        on_bad_message: OnBadMessage = "return",
        curve_server_key: str | bytes | None = None,
        curve_secret_key: str | bytes | None = None,
        curve_public_key: str | bytes | None = None,
    ) -> None:
        curve: tuple[bytes, bytes, bytes] | None = None
        if curve_server_key is not None:
            if curve_secret_key is None:
                raise ConfigError(
                    "curve_secret_key", None, "the client's secret key with curve_server_key"
                )
            secret, public = _key_pair(curve_secret_key, curve_public_key)
            curve = (_normalise_key(curve_server_key, "curve_server_key"), secret, public)
        elif curve_secret_key is not None or curve_public_key is not None:
            raise ConfigError(
                "curve_server_key", None, "the server's public key whenever a client key is set"
            )
        super().__init__(
            ctx,
            mode=mode,
            linger_ms=linger_ms,
            sndhwm=sndhwm,
            rcvhwm=rcvhwm,
            send_timeout_ms=send_timeout_ms,
            on_bad_message=on_bad_message,
        )
        self.curve_public_key: bytes | None = curve[2] if curve else None
        """This client's Z85 public key when CURVE is on (for the server's allow-list)."""
        try:
            if curve is not None:
                self._sock.setsockopt(zmq.CURVE_SERVERKEY, curve[0])
                self._sock.setsockopt(zmq.CURVE_SECRETKEY, curve[1])
                self._sock.setsockopt(zmq.CURVE_PUBLICKEY, curve[2])
        except BaseException:
            self.close(linger_ms=0)
            raise
        self._cs = self.mode is SocketMode.CLIENTSERVER

    def connect(self, endpoint: str) -> str:
        """Connect to a server endpoint; returns it. Connection happens in the background.

        Messages sent before the connection is up are queued (up to ``sndhwm``).

        Raises
        ------
        TransportError
            If the endpoint is malformed or its transport unsupported.
        """
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise TransportError(
                f"cannot connect {self._socket_name}: {e}", endpoint=endpoint
            ) from e
        except TypeError as e:
            raise ConfigError("endpoint", endpoint, "an endpoint string") from e
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
        """Send already-encoded ZIO parts ``[prefix, coord, *payload]``.

        Raises
        ------
        TransportError
            If the message cannot be queued within ``timeout_ms`` (default: the port's
            ``send_timeout_ms``), e.g. nothing connected and the queue full; or the port
            is closed.
        """
        sock = self._sock
        if self._cs:
            data = join_single(frames)

            def attempt() -> object:
                return sock.send(data, zmq.NOBLOCK)
        else:
            wire = [b"", *frames]

            def attempt() -> object:
                return _send_parts(sock, wire)

        self._send(attempt, timeout_ms, None)

    def send_dat(
        self,
        codec: DatCodec,
        seqno: int,
        payload: tuple[bytes, ...],
        *,
        timeout_ms: float | None = None,
    ) -> None:
        """Send a plain DAT encoded by ``codec`` (the fast lane of
        :meth:`~zio_spark.protocol.flow.Flow.send_dats`); otherwise as :meth:`send_frames`.
        """
        sock = self._sock
        if self._cs:
            data = codec.single(seqno, payload)
            try:  # the common case, without a closure
                sock.send(data, _NB)
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                raise self._send_error(e, None) from e
            else:
                self.stats["sent"] += 1
                return

            def attempt() -> object:
                return sock.send(data, _NB)
        else:
            wire = [b"", codec.prefix, codec.coord(seqno), *payload]

            def attempt() -> object:
                return _send_parts(sock, wire)

        self._send(attempt, timeout_ms, None)

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
        if self._cs:
            sock, single = self._sock, codec.single
            try:
                for payload in payloads:
                    sock.send(single(first + done, payload), _NB)
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
                self.send_dat(codec, first + i, payloads[i], timeout_ms=timeout_ms)
                done += 1
        except TransportError as e:
            e.sent = done
            raise

    def send(self, msg: Message, *, timeout_ms: float | None = None) -> None:
        """Encode and send a ZIO message; see :meth:`send_frames`.

        Raises
        ------
        LocalProtocolError
            If the message does not encode.
        TransportError
            As in :meth:`send_frames`.
        """
        self.send_frames(encode_frames(msg), timeout_ms=timeout_ms)

    def _recv_parts(self, timeout_ms: float) -> list[bytes] | BadMessage | None:
        if self._cs:
            frame = self._recv_frame(timeout_ms)
            if frame is None:
                return None
            try:
                return split_single(frame.buffer)
            except RemoteProtocolError as e:
                return self.report_bad_message(self._where(), e, [frame.bytes])
        wire = self._recv_multipart(timeout_ms)
        if wire is None:
            return None
        if wire[0]:
            return self.report_bad_message(self._where(), _envelope_error(wire, None), wire)
        return wire[1:]

    def recv_frames(self, timeout_ms: float) -> list[bytes] | BadMessage | None:
        """Receive one message as ZIO parts ``[prefix, coord, *payload]``, undecoded.

        Returns
        -------
        The parts; a :class:`BadMessage` for a broken envelope (in "return" mode);
        ``None`` if nothing arrived within ``timeout_ms``.

        Raises
        ------
        RemoteProtocolError
            For a broken envelope, in "raise" mode (``.peer`` set).
        TransportError
            If the port is closed or the context terminated.
        """
        got = self._recv_parts(timeout_ms)
        if got is not None and not isinstance(got, BadMessage):
            self.stats["received"] += 1
        return got

    def _take(self, flags: int) -> Message | BadMessage:
        if self._cs:
            frame = self._sock.recv(flags, copy=False)
            self._took = size = len(frame)
            try:
                return decode_single(frame.bytes if size < _VIEW_MIN else frame.buffer)
            except RemoteProtocolError as e:
                return self._report(self._where(), e, [frame.bytes])
        wire = _recv_parts(self._sock, flags)
        self._took = sum(map(len, wire))
        if wire[0]:
            return self._report(self._where(), _envelope_error(wire, None), wire)
        try:
            return decode_frames(wire[1:])
        except RemoteProtocolError as e:
            return self._report(self._where(), e, wire[1:])

    def recv_many(
        self, max_n: int, timeout_ms: float, max_bytes: int = _MANY_BYTES
    ) -> list[Message | BadMessage]:
        """Receive up to ``max_n`` messages (and about ``max_bytes``): the first within
        ``timeout_ms``, then those already queued, without waiting (see
        :meth:`ServerPort.recv_many`).

        Returns
        -------
        The messages in arrival order (in "return" mode a :class:`BadMessage` takes a
        bad one's place); ``[]`` if nothing arrived in time.

        Raises
        ------
        RemoteProtocolError, ConfigError, TransportError
            As for :meth:`ServerPort.recv_many`.
        """
        return self._recv_many(max_n, timeout_ms, max_bytes)

    def recv(self, timeout_ms: float) -> Message | BadMessage | None:
        """Receive and decode one ZIO message.

        Returns
        -------
        The message; a :class:`BadMessage` if it is broken (in "return" mode); ``None`` if
        nothing arrived within ``timeout_ms``.

        Raises
        ------
        RemoteProtocolError
            For a bad message, in "raise" mode (``.peer`` is the endpoint).
        TransportError
            If the port is closed or the context terminated.
        """
        if self._cs:
            frame = self._recv_frame(timeout_ms)
            if frame is None:
                return None
            try:
                msg = decode_single(frame.bytes if len(frame) < _VIEW_MIN else frame.buffer)
            except RemoteProtocolError as e:
                return self.report_bad_message(self._where(), e, [frame.bytes])
        else:
            got = self._recv_parts(timeout_ms)
            if got is None or isinstance(got, BadMessage):
                return got
            try:
                msg = decode_frames(got)
            except RemoteProtocolError as e:
                return self.report_bad_message(self._where(), e, got)
        self.stats["received"] += 1
        return msg


def _envelope_error(rest: Sequence[bytes], peer: PeerId | None) -> RemoteProtocolError:
    """The violation for a fallback envelope whose delimiter frame is missing."""
    if not rest:
        detail = "the message has no frames after the identity"
    else:
        detail = f"first frame is {len(rest[0])} bytes: {bytes(rest[0][:16])!r}"
    return RemoteProtocolError(
        f"routerdealer envelope needs an empty delimiter frame before the ZIO parts; {detail}",
        field="envelope",
        value=bytes(rest[0][:64]) if rest else None,
        peer=peer,
    )


class CurveAuthenticator:
    """A running ZAP handler that admits CURVE clients from an allow-list of public keys.

    Built on pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`. One per context (ZAP
    handlers bind ``inproc://zeromq.zap.01``). It applies to every CURVE socket of the
    context whose ZAP domain matches ``domain`` (``"*"``: all). Use :func:`start_authenticator`.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        allowed_client_public_keys: Iterable[str | bytes],
        *,
        domain: str = "*",
    ) -> None:
        self._allowed: frozenset[bytes] = frozenset(
            _normalise_key(k, "allowed_client_public_keys") for k in allowed_client_public_keys
        )
        self.domain = domain
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("zio_spark.transport.zap"))
        self._started = False

    @property
    def allowed(self) -> frozenset[bytes]:
        """The allowed client public keys, Z85."""
        return self._allowed

    def allow(self, *keys: str | bytes) -> None:
        """Add client public keys (takes effect for the next handshake)."""
        new = {_normalise_key(k, "allowed_client_public_keys") for k in keys}
        self._allowed = self._allowed | new

    def revoke(self, *keys: str | bytes) -> None:
        """Remove client public keys (established connections stay up)."""
        gone = {_normalise_key(k, "allowed_client_public_keys") for k in keys}
        self._allowed = self._allowed - gone

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: ``key`` is the client's Z85 public key."""
        ok = key in self._allowed
        if not ok:
            log.warning(
                "CURVE client key %s refused (ZAP domain %r): not in the allow-list",
                key.decode("ascii", "replace"),
                domain,
            )
        return ok

    def start(self) -> CurveAuthenticator:
        """Start the ZAP thread.

        Raises
        ------
        TransportError
            If another ZAP handler already runs on this context.
        """
        if self._started:
            return self
        try:
            self._auth.start()
        except zmq.ZMQError as e:
            self._auth.stop()
            raise TransportError(
                f"cannot start the ZAP authenticator: {e} (only one per context)",
                endpoint="inproc://zeromq.zap.01",
            ) from e
        self._auth.configure_curve_callback(self.domain, credentials_provider=self)
        self._started = True
        return self

    def stop(self) -> None:
        """Stop the ZAP thread; idempotent. Do this before terminating the context."""
        if self._started:
            self._started = False
            self._auth.stop()

    def __enter__(self) -> CurveAuthenticator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_authenticator(
    ctx: zmq.Context[zmq.Socket[bytes]],
    allowed_client_public_keys: Iterable[str | bytes],
    *,
    domain: str = "*",
) -> CurveAuthenticator:
    """Start a ZAP handler on ``ctx`` admitting only the given CURVE client keys.

    Parameters
    ----------
    ctx
        The context of the CURVE server ports to protect.
    allowed_client_public_keys
        Client public keys, Z85 text or 32 raw bytes.
    domain
        ZAP domain to answer for (``"*"``: any; else match ``ServerPort(zap_domain=...)``).

    Returns
    -------
    CurveAuthenticator
        Running; call ``stop()`` (or use it as a context manager) before ``ctx.term()``.

    Raises
    ------
    ConfigError
        If a key is malformed.
    TransportError
        If a ZAP handler already runs on this context.
    """
    return CurveAuthenticator(ctx, allowed_client_public_keys, domain=domain).start()
