"""Wire strategies: how a ZIO message travels on one socket type, and which type to use.

A port (:mod:`zio_spark.transport.port`) is a role (server or client) holding one
:class:`Wire`. The wire knows the framing of its socket type and nothing else:

- :class:`ServerWire` / :class:`ClientWire` (draft CLIENT/SERVER, 41/CLIENTSERVER): one
  frame per message in czmq's single-frame encoding; the SERVER names a client by its
  uint32 routing id;
- :class:`RouterWire` / :class:`DealerWire` (the reference ROUTER/DEALER fallback):
  ``[identity][empty][prefix][coord][payload...]`` on the ROUTER,
  ``[empty][prefix][coord][payload...]`` on the DEALER.

Every wire has the same small interface: ``pack``/``pack_dat`` build what ``put`` sends
(NOBLOCK; ``zmq.Again`` when there is no room), ``get`` reads one raw message (a bound
C-level call, for the hot loops), ``split``/``decode`` turn it into ZIO parts or a
:class:`~zio_spark.protocol.message.Message`, raising :class:`Undecodable` for a broken
one. A server wire's ``split``/``decode`` give ``(peer, ...)``, a client wire's just the
parts or message. Counting, logging, timeouts and retries are the port's business.

The mode vocabulary lives here too: :class:`PortKind`, :class:`SocketMode`,
:func:`choose_mode` (which mode works with a peer) and :func:`socket_type_name`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, ClassVar

import zmq

from zio_spark.errors import ConfigError, LocalProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.message import (
    DatCodec,
    Message,
    decode_frames,
    decode_single,
    join_single,
    split_single,
)

__all__ = [
    "DRAFT_BUILD_HINT",
    "ClientWire",
    "DealerWire",
    "PeerId",
    "PortKind",
    "RouterWire",
    "ServerWire",
    "SocketMode",
    "Undecodable",
    "Wire",
    "choose_mode",
    "drafts_available",
    "frame_fd",
    "frame_user_id",
    "make_wire",
    "silent_peer_hint",
    "socket_type_name",
]


PeerId = bytes | int
"""How a :class:`ServerPort` names a client: the ROUTER identity (``bytes``) in
``routerdealer`` mode, the SERVER routing id (``int``, 1..2**32-1) in ``clientserver``
mode. Treat it as opaque; it is only good for replying on the port that produced it."""


DRAFT_BUILD_HINT = (
    "requires a draft-enabled pyzmq (zmq.has('draft') and zmq.DRAFT_API); "
    "build one with scripts/build-draft-pyzmq.sh"
)

_NB = zmq.NOBLOCK
# Single frames this long are decoded from a view of the frame, so their payload is
# copied once (as recv(copy=True) would); shorter ones are cheaper to take as bytes.
_VIEW_MIN = 4096
_NB_MORE = zmq.NOBLOCK | zmq.SNDMORE
# Frames this long are handed to libzmq without a copy (it holds a reference to the
# bytes until sent): pyzmq's default copies each frame into a freshly allocated message,
# which for a 1 MiB Arrow payload cost more than the send itself (page faults and the
# copy, measured in the sink's tasks). Shorter frames are cheaper copied.
_ZERO_COPY_MIN = 1 << 16


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
        p = parts[i]
        if len(p) < _ZERO_COPY_MIN:
            send(p, _NB_MORE)
        else:
            send(p, _NB_MORE, copy=False)
    p = parts[last]
    if len(p) < _ZERO_COPY_MIN:
        send(p, _NB)
    else:
        send(p, _NB, copy=False)


def frame_user_id(frame: zmq.Frame) -> str | None:
    """The ZAP ``User-Id`` of the connection ``frame`` came on (a frame received with
    ``copy=False``), None without one (no ZAP handler judged that connection).

    libzmq attaches the connection's metadata to every message it delivers; the ZAP
    handler's reply sets ``User-Id`` (pyzmq's authenticators, ours included: the Z85
    public key of a CURVE client)."""
    try:
        got = frame.get("User-Id")
    except zmq.ZMQError:  # EINVAL: no such property on this connection
        return None
    return got if isinstance(got, str) and got else None


def frame_fd(frame: zmq.Frame) -> int:
    """The file descriptor of the connection ``frame`` came on (``ZMQ_SRCFD``; a frame
    received with ``copy=False``), -1 without one (``inproc``, or a libzmq that does not
    tell). libzmq deprecates the property (a descriptor number is reused once its
    connection closes), so it is never used alone: :mod:`zio_spark.transport.port` pairs
    it with the socket's inode (:func:`~zio_spark.transport.port.connection_open`)."""
    try:
        got = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return -1
    return got if isinstance(got, int) else -1


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


def silent_peer_hint(endpoint: str, kind: PortKind | str, mode: SocketMode | str) -> str:
    """What to say when a peer at ``endpoint`` never answers: name both socket kinds and
    the fix (libzmq connects a mismatched pair and then delivers nothing, silently).

    ``kind`` and ``mode`` are *our* port's; the hint names the socket the other side
    must have for this to work, and the one that would explain the silence.
    """
    ours = socket_type_name(kind, mode)
    other_kind = PortKind.CLIENT if PortKind(kind) is PortKind.SERVER else PortKind.SERVER
    mode = SocketMode(mode)
    other_mode = (
        SocketMode.ROUTERDEALER if mode is SocketMode.CLIENTSERVER else SocketMode.CLIENTSERVER
    )
    works = socket_type_name(other_kind, mode)
    silent = socket_type_name(other_kind, other_mode)
    fix = (
        f"if the peer has a {silent} socket, use {other_mode.value} on this side "
        f"(--socket {other_mode.value}, or mode={other_mode.value!r} in Python)"
    )
    if other_mode is SocketMode.CLIENTSERVER:
        fix += ", which needs a draft-enabled pyzmq (scripts/build-draft-pyzmq.sh)"
    return (
        f"nothing answered at {endpoint}: this side is a {ours} socket "
        f"({mode.value}), which talks only to a {works} peer; a {silent} peer "
        f"({other_mode.value}) connects and then delivers nothing, silently. Fix: {fix}; "
        "otherwise check that the peer runs at that endpoint"
    )


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


class Undecodable(Exception):
    """A message that did not decode: who sent it (None: the client's own server), the
    violation, and the frames to report. Raised by :meth:`Wire.split`/:meth:`Wire.decode`;
    the port counts, logs and returns or raises it as a :class:`BadMessage`."""

    def __init__(
        self, peer: PeerId | None, error: RemoteProtocolError, frames: Sequence[bytes]
    ) -> None:
        super().__init__(error)
        self.peer = peer
        self.error = error
        self.frames = frames


class Wire:
    """The framing of one socket: see the module docstring for the interface.

    ``took`` is the wire size of the message :meth:`decode` saw last (``recv_many``
    bounds a batch's bytes with it).
    """

    socket_name: ClassVar[str]
    kind: ClassVar[PortKind]
    mode: ClassVar[SocketMode]

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.took = 0
        self.user_id: str | None = None
        """The ZAP ``User-Id`` of the message :attr:`get` read last, once
        :meth:`keep_user_ids` is on (else None)."""
        self.get: Callable[[int], Any] = self._getter(sock)
        """Read one raw message with these flags; ``zmq.Again`` if none is there."""

    @staticmethod
    def _getter(sock: zmq.Socket[bytes]) -> Callable[[int], Any]:
        raise NotImplementedError  # pragma: no cover - every wire defines it

    _user_ids = False  # keep_user_ids() turned on
    _fds = False  # keep_fds() turned on
    fd = -1
    """The file descriptor of the connection the message :attr:`get` read last came on,
    once :meth:`keep_fds` is on (-1: none known, e.g. ``inproc``)."""

    def keep_user_ids(self) -> None:
        """From now on :attr:`get` also reads each message's ZAP ``User-Id`` into
        :attr:`user_id` (:func:`frame_user_id`): a server that lets a flow's kind depend
        on the client's CURVE key needs it at BOT time. Off by default: it costs a
        property lookup per message, which the receiving hot loops do not pay."""
        self._user_ids = True
        self._read_meta()

    def keep_fds(self) -> None:
        """From now on :attr:`get` also reads the descriptor of each message's connection
        into :attr:`fd` (:func:`frame_fd`): a server that ends a flow when its client's
        connection closes without EOT needs to know which connection a flow came on.
        Off by default, as :meth:`keep_user_ids`."""
        self._fds = True
        self._read_meta()

    def _read_meta(self) -> None:
        get = self._getter_with_first(self.sock)
        ids, fds = self._user_ids, self._fds

        def got(flags: int) -> Any:
            raw, first = get(flags)
            if ids:
                self.user_id = frame_user_id(first)
            if fds:
                self.fd = frame_fd(first)
            return raw

        self.get = got

    @staticmethod
    def _getter_with_first(sock: zmq.Socket[bytes]) -> Callable[[int], tuple[Any, zmq.Frame]]:
        """A getter that also gives the message's first frame (its properties: the
        connection's metadata rides on every frame)."""
        raise NotImplementedError  # pragma: no cover - every wire defines it

    def check_peer(self, peer: object) -> PeerId:
        """``peer`` if it can name a client on this wire, else LocalProtocolError."""
        raise LocalProtocolError(f"a {self.socket_name} sends to its one peer", field="routing_id")

    def pack(self, frames: Sequence[bytes], peer: Any) -> Any:
        """What :meth:`put` sends for the ZIO parts ``frames`` (to ``peer`` on a server)."""
        raise NotImplementedError  # pragma: no cover

    def pack_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: Any) -> Any:
        """What :meth:`put` sends for a plain DAT."""
        raise NotImplementedError  # pragma: no cover

    def put(self, packed: Any, peer: Any) -> None:
        """Queue ``packed`` (NOBLOCK); ``zmq.Again`` if there is no room."""
        raise NotImplementedError  # pragma: no cover

    def send_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: Any) -> None:
        """``put(pack_dat(...))`` in one call (the fast lane)."""
        self.put(self.pack_dat(codec, seqno, payload, peer), peer)

    def split(self, raw: Any) -> Any:
        """The ZIO parts of a raw message (``(peer, parts)`` on a server), undecoded."""
        raise NotImplementedError  # pragma: no cover

    def decode(self, raw: Any) -> Any:
        """The message of a raw message (``(peer, message)`` on a server)."""
        raise NotImplementedError  # pragma: no cover


# -- CLIENT/SERVER: one frame per message ---------------------------------------------


class _SingleFrameWire(Wire):
    mode = SocketMode.CLIENTSERVER

    @staticmethod
    def _getter(sock: zmq.Socket[bytes]) -> Callable[[int], Any]:
        return functools.partial(sock.recv, copy=False)

    @staticmethod
    def _getter_with_first(sock: zmq.Socket[bytes]) -> Callable[[int], tuple[Any, zmq.Frame]]:
        def get(flags: int) -> tuple[zmq.Frame, zmq.Frame]:
            frame = sock.recv(flags, copy=False)
            return frame, frame

        return get

    def pack(self, frames: Sequence[bytes], peer: Any) -> bytes:
        return join_single(frames)

    def pack_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: Any) -> bytes:
        return codec.single(seqno, payload)


class ServerWire(_SingleFrameWire):
    """A draft SERVER socket: clients are named by their uint32 routing id."""

    socket_name = "SERVER"
    kind = PortKind.SERVER

    def check_peer(self, peer: object) -> PeerId:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 < peer < 2**32:
            raise LocalProtocolError(
                f"a SERVER routing_id is an int 1..2**32-1, got {peer!r}",
                field="routing_id",
                value=peer,
            )
        return peer

    def put(self, packed: bytes, peer: int) -> None:
        self.sock.send(packed, _NB, copy=len(packed) < _ZERO_COPY_MIN, routing_id=peer)

    def send_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: int) -> None:
        packed = codec.single(seqno, payload)
        self.sock.send(packed, _NB, copy=len(packed) < _ZERO_COPY_MIN, routing_id=peer)

    def split(self, frame: zmq.Frame) -> tuple[PeerId, list[bytes]]:
        peer: PeerId = frame.get("routing_id")  # not .routing_id: its draft check costs ~0.4 µs
        try:
            return peer, split_single(frame.buffer)
        except RemoteProtocolError as e:
            raise Undecodable(peer, e, [frame.bytes]) from None

    def decode(self, frame: zmq.Frame) -> tuple[PeerId, Message]:
        peer: PeerId = frame.get("routing_id")
        self.took = size = len(frame)
        try:
            return peer, decode_single(frame.bytes if size < _VIEW_MIN else frame.buffer)
        except RemoteProtocolError as e:
            raise Undecodable(peer, e, [frame.bytes]) from None


class ClientWire(_SingleFrameWire):
    """A draft CLIENT socket: one server, no routing id."""

    socket_name = "CLIENT"
    kind = PortKind.CLIENT

    def put(self, packed: bytes, peer: None) -> None:
        self.sock.send(packed, _NB, copy=len(packed) < _ZERO_COPY_MIN)

    def send_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: None) -> None:
        packed = codec.single(seqno, payload)
        self.sock.send(packed, _NB, copy=len(packed) < _ZERO_COPY_MIN)

    def split(self, frame: zmq.Frame) -> list[bytes]:
        try:
            return split_single(frame.buffer)
        except RemoteProtocolError as e:
            raise Undecodable(None, e, [frame.bytes]) from None

    def decode(self, frame: zmq.Frame) -> Message:
        self.took = size = len(frame)
        try:
            return decode_single(frame.bytes if size < _VIEW_MIN else frame.buffer)
        except RemoteProtocolError as e:
            raise Undecodable(None, e, [frame.bytes]) from None


# -- ROUTER/DEALER: the ZIO parts after an envelope -----------------------------------


class _EnvelopeWire(Wire):
    mode = SocketMode.ROUTERDEALER

    @staticmethod
    def _getter(sock: zmq.Socket[bytes]) -> Callable[[int], Any]:
        return functools.partial(_recv_parts, sock)

    @staticmethod
    def _getter_with_first(sock: zmq.Socket[bytes]) -> Callable[[int], tuple[Any, zmq.Frame]]:
        def get(flags: int) -> tuple[list[bytes], zmq.Frame]:
            # As _recv_parts; the metadata rides on every frame (the ROUTER's identity
            # frame too), so the first one tells.
            first = frame = sock.recv(flags, copy=False)
            parts = [frame.bytes]
            while frame.more:
                frame = sock.recv(_NB, copy=False)
                parts.append(frame.bytes)
            return parts, first

        return get

    def put(self, packed: list[bytes], peer: Any) -> None:
        _send_parts(self.sock, packed)


class RouterWire(_EnvelopeWire):
    """A ROUTER (``ROUTER_MANDATORY``): ``[identity][empty][ZIO parts...]``."""

    socket_name = "ROUTER"
    kind = PortKind.SERVER

    def check_peer(self, peer: object) -> PeerId:
        if not isinstance(peer, bytes) or not peer:
            raise LocalProtocolError(
                f"a ROUTER routing_id is non-empty bytes (the identity), got {peer!r}",
                field="routing_id",
                value=peer,
            )
        return peer

    def pack(self, frames: Sequence[bytes], peer: bytes) -> list[bytes]:
        return [peer, b"", *frames]

    def pack_dat(
        self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: bytes
    ) -> list[bytes]:
        return [peer, b"", codec.prefix, codec.coord(seqno), *payload]

    def split(self, wire: list[bytes]) -> tuple[PeerId, list[bytes]]:
        peer = wire[0]
        if len(wire) < 2 or wire[1]:
            raise Undecodable(peer, _envelope_error(wire[1:], peer), wire)
        return peer, wire[2:]

    def decode(self, wire: list[bytes]) -> tuple[PeerId, Message]:
        self.took = sum(map(len, wire))
        peer, parts = self.split(wire)
        try:
            return peer, decode_frames(parts)
        except RemoteProtocolError as e:
            raise Undecodable(peer, e, parts) from None


class DealerWire(_EnvelopeWire):
    """A DEALER: ``[empty][ZIO parts...]``."""

    socket_name = "DEALER"
    kind = PortKind.CLIENT

    def pack(self, frames: Sequence[bytes], peer: None) -> list[bytes]:
        return [b"", *frames]

    def pack_dat(
        self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...], peer: None
    ) -> list[bytes]:
        return [b"", codec.prefix, codec.coord(seqno), *payload]

    def split(self, wire: list[bytes]) -> list[bytes]:
        if wire[0]:
            raise Undecodable(None, _envelope_error(wire, None), wire)
        return wire[1:]

    def decode(self, wire: list[bytes]) -> Message:
        self.took = sum(map(len, wire))
        parts = self.split(wire)
        try:
            return decode_frames(parts)
        except RemoteProtocolError as e:
            raise Undecodable(None, e, parts) from None


_WIRES: dict[tuple[PortKind, SocketMode], type[Wire]] = {
    (w.kind, w.mode): w for w in (ServerWire, ClientWire, RouterWire, DealerWire)
}


def make_wire(ctx: zmq.Context[zmq.Socket[bytes]], kind: PortKind, mode: SocketMode) -> Wire:
    """A new socket of ``kind`` in ``mode``, in its wire.

    Raises
    ------
    TransportError
        If a CLIENT/SERVER socket is asked for without the draft API (its handshake would
        abort the process), or the socket cannot be created.
    """
    cls = _WIRES[kind, mode]
    if mode is SocketMode.CLIENTSERVER and not (zmq.has("draft") and zmq.DRAFT_API):
        raise TransportError(f"a {cls.socket_name} socket {DRAFT_BUILD_HINT}")
    try:
        sock = ctx.socket(getattr(zmq, cls.socket_name))
    except zmq.ZMQError as e:
        raise TransportError(f"cannot create a {cls.socket_name} socket: {e}") from e
    return cls(sock)
