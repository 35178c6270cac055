"""36/ZRE: beacons, commands and peer bookkeeping, with no I/O.

Theory of operation (specs/36-zre.txt):

Discovery. Every node broadcasts a 22-byte UDP *beacon*: ``b"ZRE\\x01"``, its 16-byte
UUID and its mailbox port (uint16, network order). A non-zero port says "connect to me on
tcp://<sender ip>:<port>"; port 0 says "I am leaving". :func:`decode_beacon` accepts port 0
(it is a well-formed beacon); what a port means is decided by :meth:`PeerTable.on_beacon`.

Traffic. Each node binds one ROUTER (its mailbox) and opens one DEALER per peer, whose
identity is ``b"\\x01" + uuid`` (:func:`encode_identity`). Every command frame starts with
the signature ``%xAA %xA1``, the command id, the version (2) and a uint16 sequence; the
fields follow in the spec's ABNF order. Numbers are big-endian; ``string`` has a 1-byte
length, ``longstr`` a 4-byte length, ``strings`` is a 4-byte count of longstrs and
``dictionary`` a 4-byte count of (string name, longstr value) pairs. WHISPER and SHOUT
carry their content as the frames that follow the command frame.

Content frames. The prose says content is "one 0MQ frame" but the ABNF says
``msg = *frame`` ("zero or more distinct frames") and both reference implementations
(zyre, pyre) take every remaining frame, however many, including none. We follow the
ABNF: content is a tuple of zero or more frames. The other commands carry exactly one
frame; anything after it is rejected as trailing garbage.

Strictness. The decoders reject anything the grammar does not produce (bad signature,
unknown command, wrong version, truncation, trailing bytes, a repeated dictionary name)
with :class:`~zio_spark.errors.RemoteProtocolError` and nothing else. Text is UTF-8 (the
ABNF says ``*VCHAR``, but zyre and pyre put UTF-8 names, with spaces, on the wire).

Bookkeeping. :class:`PeerTable` is the node's state machine in the h11 style: the
transport feeds it beacons (:meth:`~PeerTable.on_beacon`), decoded commands
(:meth:`~PeerTable.on_message`) and the passage of time (:meth:`~PeerTable.tick`), each
with an explicit ``now`` in seconds, and gets back a list of events: things for the
application (ENTER, EXIT, JOIN, LEAVE, WHISPER, SHOUT, EVASIVE) and actions for the
transport (CONNECT, DROP, SEND_PING, SEND_PING_OK). Incoming sequences must run 1, 2, ...
from HELLO, wrapping at 65535 to 0 as zyre's uint16 counters do; a gap or repeat makes the
peer invalid, and the table removes it and emits DROP. :meth:`PeerTable.stamp` numbers our
own outgoing commands per peer the same way.

ZIO on ZRE. A peer advertises its ZIO flow ports in its HELLO headers as
``zio.port.<name>.address`` and ``zio.port.<name>.socket``; :func:`advertised_ports` and
:func:`group_zio_endpoints` read them back.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, NamedTuple, TypeAlias, TypeVar
from uuid import UUID

from zio_spark.errors import ConfigError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "BEACON_HEADER",
    "BEACON_SIZE",
    "DISCOVERY_PORT",
    "EVASIVE_AFTER",
    "EXPIRED_AFTER",
    "IDENTITY_SIZE",
    "SIGNATURE",
    "VERSION",
    "ZIO_PORT_PREFIX",
    "Beacon",
    "Command",
    "ConnectAction",
    "DropAction",
    "DropReason",
    "EnterEvent",
    "EvasiveEvent",
    "Event",
    "ExitEvent",
    "Hello",
    "Join",
    "JoinEvent",
    "Leave",
    "LeaveEvent",
    "Peer",
    "PeerTable",
    "Ping",
    "PingOk",
    "SendPingAction",
    "SendPingOkAction",
    "Shout",
    "ShoutEvent",
    "Whisper",
    "WhisperEvent",
    "ZioEndpoint",
    "ZioPort",
    "ZreCommand",
    "ZreEventType",
    "advertised_ports",
    "decode_beacon",
    "decode_command",
    "decode_identity",
    "encode_beacon",
    "encode_command",
    "encode_identity",
    "group_zio_endpoints",
    "tcp_endpoint",
    "zio_port_headers",
]

DISCOVERY_PORT = 5670
"""UDP port of the ZRE discovery service (ZRE-DISC, assigned by IANA)."""
BEACON_HEADER = b"ZRE\x01"
BEACON_SIZE = 22
SIGNATURE = b"\xaa\xa1"
VERSION = 2
IDENTITY_SIZE = 17
EVASIVE_AFTER = 5.0
"""Default seconds of silence after which a peer is EVASIVE and gets a PING."""
EXPIRED_AFTER = 30.0
"""Default seconds of silence after which a peer is dead (EXIT)."""
MAX_PEERS = 512
"""Default bound on known peers (each costs the transport a DEALER socket)."""
MAX_UNCONFIRMED = 64
"""Default bound on peers known from a beacon only, still waiting for their HELLO."""
ZIO_PORT_PREFIX = "zio.port."

_UINT8_MAX = 0xFF
_UINT16_MAX = 0xFFFF
_UINT32_MAX = 0xFFFF_FFFF
_PORT_FIELDS = ("address", "socket")


# ---------------------------------------------------------------------------------------
# Beacons and identities


@dataclass(frozen=True, slots=True)
class Beacon:
    """A ZRE UDP beacon.

    Attributes
    ----------
    uuid
        The sender's node UUID.
    port
        The sender's mailbox (ROUTER) TCP port; 0 means the sender is leaving.
    """

    uuid: UUID
    port: int

    @property
    def leaving(self) -> bool:
        """True for a port-0 beacon: the sender is disconnecting from the network."""
        return self.port == 0


def encode_beacon(beacon: Beacon) -> bytes:
    """Encode a beacon into its 22-byte UDP payload.

    Parameters
    ----------
    beacon
        The beacon to send.

    Returns
    -------
    bytes
        ``b"ZRE\\x01"`` + 16-byte UUID + port as uint16 big-endian.

    Raises
    ------
    LocalProtocolError
        If ``uuid`` is not a :class:`uuid.UUID` or ``port`` is not in 0..65535.
    """
    if not isinstance(beacon.uuid, UUID):
        raise LocalProtocolError(
            f"beacon uuid: got {beacon.uuid!r}, expected a uuid.UUID",
            field="uuid",
            value=beacon.uuid,
        )
    _check_uint(beacon.port, _UINT16_MAX, "port")
    return BEACON_HEADER + beacon.uuid.bytes + beacon.port.to_bytes(2, "big")


def decode_beacon(data: bytes) -> Beacon:
    """Decode a UDP beacon payload.

    A port of 0 decodes fine (the sender is leaving); see :attr:`Beacon.leaving`.

    Parameters
    ----------
    data
        The UDP datagram's payload.

    Returns
    -------
    Beacon

    Raises
    ------
    RemoteProtocolError
        If the payload is not 22 bytes (``field="length"``), does not start with ``ZRE``
        (``field="header"``) or has a beacon version other than 1 (``field="version"``).
    """
    data = bytes(data)
    if len(data) != BEACON_SIZE:
        raise RemoteProtocolError(
            f"ZRE beacon length: got {len(data)} bytes, expected {BEACON_SIZE}",
            field="length",
            value=len(data),
        )
    if data[:3] != b"ZRE":
        raise RemoteProtocolError(
            f"ZRE beacon header: got {data[:3]!r}, expected b'ZRE'",
            field="header",
            value=data[:3],
        )
    if data[3] != BEACON_HEADER[3]:
        raise RemoteProtocolError(
            f"ZRE beacon version: got {data[3]}, expected {BEACON_HEADER[3]}",
            field="version",
            value=data[3],
        )
    return Beacon(uuid=UUID(bytes=data[4:20]), port=int.from_bytes(data[20:22], "big"))


def encode_identity(uuid: UUID) -> bytes:
    """Return the DEALER identity for a node: ``b"\\x01"`` followed by the 16-byte UUID.

    Raises
    ------
    LocalProtocolError
        If ``uuid`` is not a :class:`uuid.UUID`.
    """
    if not isinstance(uuid, UUID):
        raise LocalProtocolError(
            f"identity uuid: got {uuid!r}, expected a uuid.UUID", field="uuid", value=uuid
        )
    return b"\x01" + uuid.bytes


def decode_identity(frame: bytes) -> UUID:
    """Return the sender's UUID from the identity frame a ROUTER mailbox prepends.

    Raises
    ------
    RemoteProtocolError
        If the frame is not 17 bytes (``field="identity"``) or its first byte is not 1.
    """
    frame = bytes(frame)
    if len(frame) != IDENTITY_SIZE or frame[0] != 1:
        raise RemoteProtocolError(
            f"ZRE identity: got {frame[: IDENTITY_SIZE + 1]!r} ({len(frame)} bytes), "
            f"expected 17 bytes starting with 0x01",
            field="identity",
            value=frame,
        )
    return UUID(bytes=frame[1:])


def tcp_endpoint(host: str, port: int) -> str:
    """Return the ZeroMQ endpoint ``tcp://host:port``, bracketing IPv6 literals.

    Raises
    ------
    LocalProtocolError
        If ``host`` is empty or ``port`` is not in 1..65535.
    """
    if not host:
        raise LocalProtocolError("endpoint host: got '', expected an address", field="host")
    if not isinstance(port, int) or not 0 < port <= _UINT16_MAX:
        raise LocalProtocolError(
            f"endpoint port: got {port!r}, expected 1..65535", field="port", value=port
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


# ---------------------------------------------------------------------------------------
# Commands


class ZreCommand(enum.IntEnum):
    """Command ids, as numbered in the spec's ABNF."""

    HELLO = 1
    WHISPER = 2
    SHOUT = 3
    JOIN = 4
    LEAVE = 5
    PING = 6
    PING_OK = 7


@dataclass(frozen=True, slots=True)
class Hello:
    """HELLO: greet a peer so it can connect back to us (always sequence 1).

    Attributes
    ----------
    sequence
        Cyclic sequence number (uint16).
    endpoint
        ZeroMQ endpoint the sender accepts connections on (``string``).
    groups
        Groups the sender is in (``strings``), in wire order.
    status
        The sender's group status sequence (uint8).
    name
        The sender's public name (``string``).
    headers
        The sender's header properties (``dictionary``); stored read-only.
    """

    command: ClassVar[ZreCommand] = ZreCommand.HELLO

    sequence: int
    endpoint: str
    groups: tuple[str, ...] = ()
    status: int = 0
    name: str = ""
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))


@dataclass(frozen=True, slots=True)
class Whisper:
    """WHISPER: a message to one peer; ``content`` is the frames after the command."""

    command: ClassVar[ZreCommand] = ZreCommand.WHISPER

    sequence: int
    content: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "content", tuple(self.content))


@dataclass(frozen=True, slots=True)
class Shout:
    """SHOUT: a message to a group (unicast to each member); ``content`` as for WHISPER."""

    command: ClassVar[ZreCommand] = ZreCommand.SHOUT

    sequence: int
    group: str
    content: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "content", tuple(self.content))


@dataclass(frozen=True, slots=True)
class Join:
    """JOIN: the sender joined ``group``; ``status`` is its group status after joining."""

    command: ClassVar[ZreCommand] = ZreCommand.JOIN

    sequence: int
    group: str
    status: int


@dataclass(frozen=True, slots=True)
class Leave:
    """LEAVE: the sender left ``group``; ``status`` is its group status after leaving."""

    command: ClassVar[ZreCommand] = ZreCommand.LEAVE

    sequence: int
    group: str
    status: int


@dataclass(frozen=True, slots=True)
class Ping:
    """PING: sent to a peer that has gone silent."""

    command: ClassVar[ZreCommand] = ZreCommand.PING

    sequence: int


@dataclass(frozen=True, slots=True)
class PingOk:
    """PING-OK: the reply to a PING."""

    command: ClassVar[ZreCommand] = ZreCommand.PING_OK

    sequence: int


Command: TypeAlias = Hello | Whisper | Shout | Join | Leave | Ping | PingOk
CommandT = TypeVar("CommandT", bound=Command)
_COMMAND_TYPES = (Hello, Whisper, Shout, Join, Leave, Ping, PingOk)


def _check_uint(value: object, maximum: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise LocalProtocolError(
            f"ZRE {name}: got {value!r}, expected an integer in 0..{maximum}",
            field=name,
            value=value,
        )
    return value


def _text_bytes(value: object, maximum: int, name: str) -> bytes:
    if not isinstance(value, str):
        raise LocalProtocolError(
            f"ZRE {name}: got {value!r}, expected str", field=name, value=value
        )
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LocalProtocolError(
            f"ZRE {name}: got {value!r}, expected text encodable as UTF-8",
            field=name,
            value=value,
        ) from e
    if len(raw) > maximum:
        raise LocalProtocolError(
            f"ZRE {name}: got {len(raw)} UTF-8 bytes ({value[:40]!r}...), "
            f"expected at most {maximum}",
            field=name,
            value=value,
        )
    return raw


def _put_string(out: bytearray, value: object, name: str) -> None:
    raw = _text_bytes(value, _UINT8_MAX, name)
    out.append(len(raw))
    out += raw


def _put_longstr(out: bytearray, value: object, name: str) -> None:
    raw = _text_bytes(value, _UINT32_MAX, name)
    out += len(raw).to_bytes(4, "big")
    out += raw


def _put_count(out: bytearray, count: int, name: str) -> None:
    _check_uint(count, _UINT32_MAX, name)
    out += count.to_bytes(4, "big")


def _content_frames(content: Iterable[object]) -> list[bytes]:
    frames: list[bytes] = []
    for i, frame in enumerate(content):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise LocalProtocolError(
                f"ZRE content[{i}]: got {type(frame).__name__}, expected bytes",
                field="content",
                value=frame,
            )
        frames.append(bytes(frame))
    return frames


def encode_command(cmd: Command) -> list[bytes]:
    """Encode a command into the frames to send on a peer's DEALER socket.

    Parameters
    ----------
    cmd
        Any of :class:`Hello`, :class:`Whisper`, :class:`Shout`, :class:`Join`,
        :class:`Leave`, :class:`Ping`, :class:`PingOk`, with its ``sequence`` set (see
        :meth:`PeerTable.stamp`).

    Returns
    -------
    list of bytes
        The command frame, then for WHISPER and SHOUT one frame per content frame.

    Raises
    ------
    LocalProtocolError
        If ``cmd`` is not a command, a number is out of range (``sequence`` uint16,
        ``status`` uint8), a ``string`` field (endpoint, name, group, header name) is
        longer than 255 UTF-8 bytes, text is not encodable as UTF-8, or a content frame
        is not bytes. ``field`` names the offending field.
    """
    if not isinstance(cmd, _COMMAND_TYPES):
        raise LocalProtocolError(
            f"ZRE command: got {type(cmd).__name__}, expected one of "
            f"{', '.join(t.__name__ for t in _COMMAND_TYPES)}",
            field="command",
            value=cmd,
        )
    out = bytearray(SIGNATURE)
    out.append(cmd.command)
    out.append(VERSION)
    out += _check_uint(cmd.sequence, _UINT16_MAX, "sequence").to_bytes(2, "big")
    extra: list[bytes] = []
    if isinstance(cmd, Hello):
        _put_string(out, cmd.endpoint, "endpoint")
        _put_count(out, len(cmd.groups), "groups")
        for group in cmd.groups:
            _put_longstr(out, group, "groups")
        out.append(_check_uint(cmd.status, _UINT8_MAX, "status"))
        _put_string(out, cmd.name, "name")
        _put_count(out, len(cmd.headers), "headers")
        for key, value in cmd.headers.items():
            _put_string(out, key, "headers")
            _put_longstr(out, value, "headers")
    elif isinstance(cmd, Whisper):
        extra = _content_frames(cmd.content)
    elif isinstance(cmd, Shout):
        _put_string(out, cmd.group, "group")
        extra = _content_frames(cmd.content)
    elif isinstance(cmd, (Join, Leave)):
        _put_string(out, cmd.group, "group")
        out.append(_check_uint(cmd.status, _UINT8_MAX, "status"))
    # Ping and PingOk carry nothing beyond the sequence.
    return [bytes(out), *extra]


class _Reader:
    """Cursor over one command frame; every failure is a RemoteProtocolError."""

    __slots__ = ("_data", "_pos", "what")

    def __init__(self, data: bytes, what: str) -> None:
        self._data = data
        self._pos = 0
        self.what = what

    def error(self, field: str, problem: str, value: object) -> RemoteProtocolError:
        return RemoteProtocolError(f"{self.what} {field}: {problem}", field=field, value=value)

    def take(self, n: int, field: str) -> bytes:
        end = self._pos + n
        if end > len(self._data):
            raise self.error(
                field,
                f"truncated: needs {n} bytes at offset {self._pos}, frame has {len(self._data)}",
                self._data[self._pos :],
            )
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def number1(self, field: str) -> int:
        return self.take(1, field)[0]

    def number2(self, field: str) -> int:
        return int.from_bytes(self.take(2, field), "big")

    def number4(self, field: str) -> int:
        return int.from_bytes(self.take(4, field), "big")

    def _text(self, raw: bytes, field: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(field, f"got {raw[:40]!r}, expected UTF-8 text", raw) from e

    def string(self, field: str) -> str:
        return self._text(self.take(self.number1(field), field), field)

    def longstr(self, field: str) -> str:
        return self._text(self.take(self.number4(field), field), field)

    def count(self, field: str, min_item_size: int) -> int:
        # Refuse an absurd count up front rather than looping 4 billion times.
        count = self.number4(field)
        left = len(self._data) - self._pos
        if count * min_item_size > left:
            raise self.error(
                field,
                f"count {count} needs at least {count * min_item_size} more bytes, "
                f"frame has {left} left",
                count,
            )
        return count

    def strings(self, field: str) -> tuple[str, ...]:
        return tuple(self.longstr(field) for _ in range(self.count(field, 4)))

    def dictionary(self, field: str) -> dict[str, str]:
        result: dict[str, str] = {}
        for _ in range(self.count(field, 1 + 4)):
            key = self.string(field)
            value = self.longstr(field)
            if key in result:
                # zyre (zhash: first wins) and pyre (dict: last wins) would disagree.
                raise self.error(field, f"name {key!r} appears twice, expected unique", key)
            result[key] = value
        return result

    def finish(self) -> None:
        if self._pos != len(self._data):
            raise self.error(
                "frame",
                f"{len(self._data) - self._pos} trailing bytes after the last field, expected none",
                self._data[self._pos :],
            )


def decode_command(frames: Sequence[bytes]) -> Command:
    """Decode the frames of one ZRE message (after the ROUTER identity frame).

    Parameters
    ----------
    frames
        The command frame, then for WHISPER and SHOUT zero or more content frames.

    Returns
    -------
    Command
        The decoded :class:`Hello`, :class:`Whisper`, ... instance.

    Raises
    ------
    RemoteProtocolError
        If there is no frame, the signature is not ``%xAA %xA1``, the command id is
        unknown, the version is not 2, a field is truncated or not UTF-8, a dictionary
        repeats a name, bytes trail the last field, or a command other than WHISPER/SHOUT
        has extra frames. ``field`` names the offending field (``signature``,
        ``command``, ``version``, ``sequence``, ``endpoint``, ..., ``frame``, ``frames``).
        No other exception escapes for any input of bytes.
    """
    if len(frames) == 0:
        raise RemoteProtocolError(
            "ZRE message frames: got none, expected a command frame", field="frames", value=0
        )
    reader = _Reader(bytes(frames[0]), "ZRE message")
    signature = reader.take(2, "signature")
    if signature != SIGNATURE:
        raise reader.error("signature", f"got {signature!r}, expected {SIGNATURE!r}", signature)
    command_id = reader.number1("command")
    if not ZreCommand.HELLO <= command_id <= ZreCommand.PING_OK:
        raise reader.error("command", f"got {command_id}, expected 1..7", command_id)
    command = ZreCommand(command_id)
    reader.what = f"ZRE {command.name}"
    version = reader.number1("version")
    if version != VERSION:
        raise reader.error("version", f"got {version}, expected {VERSION}", version)
    sequence = reader.number2("sequence")

    content: tuple[bytes, ...] = ()
    if command in (ZreCommand.WHISPER, ZreCommand.SHOUT):
        content = tuple(bytes(frame) for frame in frames[1:])
    elif len(frames) > 1:
        raise reader.error(
            "frames",
            f"got {len(frames) - 1} frames after the command, expected none",
            len(frames),
        )

    result: Command
    if command is ZreCommand.HELLO:
        endpoint = reader.string("endpoint")
        groups = reader.strings("groups")
        status = reader.number1("status")
        name = reader.string("name")
        headers = reader.dictionary("headers")
        result = Hello(sequence, endpoint, groups, status, name, headers)
    elif command is ZreCommand.WHISPER:
        result = Whisper(sequence, content)
    elif command is ZreCommand.SHOUT:
        result = Shout(sequence, reader.string("group"), content)
    elif command is ZreCommand.JOIN:
        group = reader.string("group")
        result = Join(sequence, group, reader.number1("status"))
    elif command is ZreCommand.LEAVE:
        group = reader.string("group")
        result = Leave(sequence, group, reader.number1("status"))
    elif command is ZreCommand.PING:
        result = Ping(sequence)
    else:
        result = PingOk(sequence)
    reader.finish()
    return result


# ---------------------------------------------------------------------------------------
# Events and actions


class ZreEventType(enum.Enum):
    """What an event is, with zyre's event names verbatim, plus the transport's actions."""

    ENTER = "ENTER"
    EXIT = "EXIT"
    JOIN = "JOIN"
    LEAVE = "LEAVE"
    WHISPER = "WHISPER"
    SHOUT = "SHOUT"
    EVASIVE = "EVASIVE"
    CONNECT = "CONNECT"
    DROP = "DROP"
    SEND_PING = "SEND_PING"
    SEND_PING_OK = "SEND_PING_OK"


class DropReason(enum.Enum):
    """Why :class:`PeerTable` removed a peer."""

    LEAVING = "leaving"
    """The peer sent a port-0 beacon."""
    EXPIRED = "expired"
    """Nothing heard from the peer for ``expired_after`` seconds."""
    SEQUENCE = "sequence"
    """A gap or out-of-order sequence number, or a HELLO not numbered 1."""
    RESTARTED = "restarted"
    """A second HELLO from a greeted peer: the old incarnation is gone."""
    LOCAL = "local"
    """Removed by :meth:`PeerTable.remove` (e.g. its send buffer is full)."""
    CROWDED = "crowded"
    """Not yet greeted (no HELLO) and the oldest such peer when a newer one came and
    ``max_unconfirmed`` were waiting: forged beacons must not crowd out real peers."""


@dataclass(frozen=True, slots=True)
class EnterEvent:
    """A peer said HELLO. ``endpoint`` is the one in its HELLO."""

    kind: ClassVar[ZreEventType] = ZreEventType.ENTER

    peer: UUID
    name: str
    headers: Mapping[str, str] = field(hash=False)
    endpoint: str


@dataclass(frozen=True, slots=True)
class ExitEvent:
    """A peer that had entered is gone (left, expired, invalid, or removed)."""

    kind: ClassVar[ZreEventType] = ZreEventType.EXIT

    peer: UUID
    name: str


@dataclass(frozen=True, slots=True)
class JoinEvent:
    """A peer joined a group."""

    kind: ClassVar[ZreEventType] = ZreEventType.JOIN

    peer: UUID
    name: str
    group: str


@dataclass(frozen=True, slots=True)
class LeaveEvent:
    """A peer left a group."""

    kind: ClassVar[ZreEventType] = ZreEventType.LEAVE

    peer: UUID
    name: str
    group: str


@dataclass(frozen=True, slots=True)
class WhisperEvent:
    """A peer whispered ``content`` to us."""

    kind: ClassVar[ZreEventType] = ZreEventType.WHISPER

    peer: UUID
    name: str
    content: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ShoutEvent:
    """A peer shouted ``content`` to ``group``."""

    kind: ClassVar[ZreEventType] = ZreEventType.SHOUT

    peer: UUID
    name: str
    group: str
    content: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class EvasiveEvent:
    """A peer has been silent for ``evasive_after`` seconds (a PING goes with it)."""

    kind: ClassVar[ZreEventType] = ZreEventType.EVASIVE

    peer: UUID
    name: str


@dataclass(frozen=True, slots=True)
class ConnectAction:
    """Transport: open a DEALER to ``endpoint`` and send it our HELLO, stamped."""

    kind: ClassVar[ZreEventType] = ZreEventType.CONNECT

    peer: UUID
    endpoint: str


@dataclass(frozen=True, slots=True)
class DropAction:
    """Transport: close the peer's DEALER; the table has forgotten the peer."""

    kind: ClassVar[ZreEventType] = ZreEventType.DROP

    peer: UUID
    reason: DropReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SendPingAction:
    """Transport: send the peer a stamped :class:`Ping`."""

    kind: ClassVar[ZreEventType] = ZreEventType.SEND_PING

    peer: UUID


@dataclass(frozen=True, slots=True)
class SendPingOkAction:
    """Transport: answer the peer's PING with a stamped :class:`PingOk`."""

    kind: ClassVar[ZreEventType] = ZreEventType.SEND_PING_OK

    peer: UUID


Event: TypeAlias = (
    EnterEvent
    | ExitEvent
    | JoinEvent
    | LeaveEvent
    | WhisperEvent
    | ShoutEvent
    | EvasiveEvent
    | ConnectAction
    | DropAction
    | SendPingAction
    | SendPingOkAction
)


# ---------------------------------------------------------------------------------------
# Peer bookkeeping


@dataclass(frozen=True, slots=True)
class Peer:
    """A read-only snapshot of what the table knows about one peer.

    Attributes
    ----------
    uuid
        The peer's node UUID.
    endpoint
        The endpoint our DEALER is connected to.
    name, groups, status, headers
        From its HELLO, JOINs and LEAVEs (empty until it has said HELLO).
    last_seen
        ``now`` of the last beacon or valid command from it.
    ready
        True once it has said HELLO (only then is it ENTERed and its traffic accepted).
    expected_sequence
        The sequence number its next command must carry.
    sent_sequence
        The sequence number of the last command we stamped for it (0 before HELLO).
    evasive
        True while it is silent past ``evasive_after`` and has been pinged.
    """

    uuid: UUID
    endpoint: str
    name: str
    groups: frozenset[str]
    status: int
    headers: Mapping[str, str] = field(hash=False)
    last_seen: float
    ready: bool
    expected_sequence: int
    sent_sequence: int
    evasive: bool


@dataclass(slots=True)
class _PeerRecord:
    uuid: UUID
    endpoint: str
    last_seen: float
    name: str = ""
    groups: set[str] = field(default_factory=set)
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    expected_sequence: int = 1
    sent_sequence: int = 0
    hello_sent: bool = False
    evasive: bool = False

    def snapshot(self) -> Peer:
        return Peer(
            uuid=self.uuid,
            endpoint=self.endpoint,
            name=self.name,
            groups=frozenset(self.groups),
            status=self.status,
            headers=MappingProxyType(dict(self.headers)),
            last_seen=self.last_seen,
            ready=self.ready,
            expected_sequence=self.expected_sequence,
            sent_sequence=self.sent_sequence,
            evasive=self.evasive,
        )


class PeerTable:
    """The ZRE node's view of its peers: feed it input and ``now``, act on the events.

    No I/O and no clock: :meth:`on_beacon`, :meth:`on_message` and :meth:`tick` return
    lists of events (:data:`Event`), in the order they happened. Application events
    (ENTER, EXIT, JOIN, LEAVE, WHISPER, SHOUT, EVASIVE) go up to the user; actions
    (CONNECT, DROP, SEND_PING, SEND_PING_OK) are for the transport, which stamps each
    command it sends with :meth:`stamp`. Not thread-safe; the owner serialises calls.

    Rules (specs/36-zre.txt), and the choices where the spec is silent:

    - A beacon from an unknown node with a non-zero port makes a new peer: CONNECT to
      ``tcp://<sender host>:<port>``. A port-0 beacon from a known peer removes it
      (EXIT if it had entered, then DROP); from an unknown node it is ignored. Beacons
      from ourselves are ignored.
    - Commands before a peer's HELLO are ignored. A HELLO from an unknown node makes a
      new peer (CONNECT to its endpoint). HELLO must be numbered 1; then each command
      must carry the previous number + 1, wrapping 65535 -> 0. Anything else removes the
      peer (EXIT, DROP with :attr:`DropReason.SEQUENCE`).
    - HELLO gives ENTER, then JOIN for each of its groups. A second HELLO from a peer that
      already entered is a restart: EXIT and DROP the old one, then CONNECT and ENTER.
    - JOIN/LEAVE emit an event only when membership changes; ``status`` is taken from
      the peer's message as is (sequence numbers already catch lost commands).
    - PING gives SEND_PING_OK. Any beacon or valid command refreshes ``last_seen``.
    - :meth:`tick`: an entered peer silent for ``evasive_after`` seconds gives EVASIVE and
      SEND_PING, once per silence; any peer silent for ``expired_after`` seconds is
      removed (EXIT if it had entered, then DROP with :attr:`DropReason.EXPIRED`).
    - Bounds (the spec has none; each peer costs the transport a socket): at most
      ``max_unconfirmed`` peers known only from a beacon wait for their HELLO; a newer
      one evicts the oldest (DROP with :attr:`DropReason.CROWDED`), so a flood of forged
      beacons cannot lock real peers out. At most ``max_peers`` in all: a newcomer
      then evicts the oldest peer not yet greeted, and only when every place holds a
      greeted peer is it ignored (counted in :attr:`refused`) until a place frees up.

    Parameters
    ----------
    own_uuid
        This node's UUID (its own beacons and messages are ignored).
    evasive_after
        Seconds of silence before EVASIVE + PING (default 5.0, the spec's "typically").
    expired_after
        Seconds of silence before the peer is dead (default 30.0).
    max_peers, max_unconfirmed
        The bounds above (defaults 512 and 64).

    Raises
    ------
    ConfigError
        If ``evasive_after`` is not positive, ``expired_after`` is not greater, or a
        bound is not an integer with ``1 <= max_unconfirmed <= max_peers``.
    """

    def __init__(
        self,
        own_uuid: UUID,
        *,
        evasive_after: float = EVASIVE_AFTER,
        expired_after: float = EXPIRED_AFTER,
        max_peers: int = MAX_PEERS,
        max_unconfirmed: int = MAX_UNCONFIRMED,
    ) -> None:
        for name, value, low in (
            ("max_peers", max_peers, 1),
            ("max_unconfirmed", max_unconfirmed, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, value, f"an integer >= {low}")
        if max_unconfirmed > max_peers:
            raise ConfigError(
                "max_unconfirmed", max_unconfirmed, f"at most max_peers ({max_peers})"
            )
        if not evasive_after > 0:
            raise ConfigError("evasive_after", evasive_after, "a positive number of seconds")
        if not expired_after > evasive_after:
            raise ConfigError(
                "expired_after",
                expired_after,
                f"a number of seconds greater than evasive_after ({evasive_after})",
            )
        self.own_uuid = own_uuid
        self.evasive_after = float(evasive_after)
        self.expired_after = float(expired_after)
        self._peers: dict[UUID, _PeerRecord] = {}
        self.max_peers = max_peers
        self.max_unconfirmed = max_unconfirmed
        # Peers known from a beacon only, oldest first (dicts keep insertion order).
        self._unconfirmed: dict[UUID, None] = {}
        self.refused = 0  # new nodes ignored because the table was full

    # -- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers

    def get(self, peer: UUID) -> Peer | None:
        """Return a snapshot of ``peer``, or None if the table does not know it."""
        record = self._peers.get(peer)
        return None if record is None else record.snapshot()

    def peers(self) -> list[Peer]:
        """Return snapshots of every known peer (entered or not), sorted by UUID."""
        return [self._peers[key].snapshot() for key in sorted(self._peers)]

    def peers_in_group(self, group: str) -> list[Peer]:
        """Return snapshots of the entered peers in ``group``, sorted by UUID."""
        return [
            self._peers[key].snapshot()
            for key in sorted(self._peers)
            if self._peers[key].ready and group in self._peers[key].groups
        ]

    def groups(self) -> frozenset[str]:
        """Return every group that at least one entered peer is in."""
        return frozenset(g for r in self._peers.values() if r.ready for g in r.groups)

    def next_deadline(self) -> float | None:
        """Return the earliest ``now`` at which :meth:`tick` has something to do.

        None when the table is empty. A transport can use it as its poll timeout.
        """
        deadlines: list[float] = []
        for record in self._peers.values():
            deadlines.append(record.last_seen + self.expired_after)
            if record.ready and not record.evasive:
                deadlines.append(record.last_seen + self.evasive_after)
        return min(deadlines, default=None)

    # -- input -----------------------------------------------------------------------

    def on_beacon(self, beacon: Beacon, addr_host: str, now: float) -> list[Event]:
        """Account for a decoded beacon received from ``addr_host``.

        Parameters
        ----------
        beacon
            The decoded beacon (see :func:`decode_beacon`).
        addr_host
            The sender's IP address as reported by ``recvfrom``.
        now
            The current time in seconds (any monotonic clock).

        Returns
        -------
        list of Event
            ``[ConnectAction]`` for a new peer; ``[ExitEvent?, DropAction]`` for a port-0
            beacon from a known peer; otherwise ``[]``.

        Raises
        ------
        LocalProtocolError
            If a new peer's ``addr_host`` is empty.
        """
        if beacon.uuid == self.own_uuid:
            return []
        record = self._peers.get(beacon.uuid)
        if beacon.leaving:
            if record is None:
                return []
            return self._remove(record, DropReason.LEAVING, "port-0 beacon")
        if record is None:
            endpoint = tcp_endpoint(addr_host, beacon.port)
            events = self._make_room(len(self._unconfirmed) >= self.max_unconfirmed)
            if len(self._peers) >= self.max_peers:
                self.refused += 1
                return events
            self._peers[beacon.uuid] = _PeerRecord(beacon.uuid, endpoint, now)
            self._unconfirmed[beacon.uuid] = None
            events.append(ConnectAction(beacon.uuid, endpoint))
            return events
        self._refresh(record, now)
        return []

    def on_message(self, peer: UUID, cmd: Command, now: float) -> list[Event]:
        """Account for a decoded command received from ``peer`` on our mailbox.

        Parameters
        ----------
        peer
            The sender, from its identity frame (see :func:`decode_identity`).
        cmd
            The decoded command (see :func:`decode_command`).
        now
            The current time in seconds.

        Returns
        -------
        list of Event
            See the class docstring for the rules; ``[]`` for an ignored command.

        Raises
        ------
        LocalProtocolError
            If ``cmd`` is not a command.
        """
        if not isinstance(cmd, _COMMAND_TYPES):
            raise LocalProtocolError(
                f"on_message cmd: got {type(cmd).__name__}, expected a ZRE command",
                field="cmd",
                value=cmd,
            )
        if peer == self.own_uuid:
            return []
        record = self._peers.get(peer)
        if isinstance(cmd, Hello):
            return self._on_hello(peer, record, cmd, now)
        if record is None or not record.ready:
            return []  # the spec: silently ignore commands that precede HELLO
        if cmd.sequence != record.expected_sequence:
            return self._remove(
                record,
                DropReason.SEQUENCE,
                f"{cmd.command.name} sequence {cmd.sequence}, expected {record.expected_sequence}",
            )
        record.expected_sequence = (cmd.sequence + 1) & _UINT16_MAX
        self._refresh(record, now)
        if isinstance(cmd, Whisper):
            return [WhisperEvent(peer, record.name, cmd.content)]
        if isinstance(cmd, Shout):
            return [ShoutEvent(peer, record.name, cmd.group, cmd.content)]
        if isinstance(cmd, Join):
            record.status = cmd.status
            return self._join(record, cmd.group)
        if isinstance(cmd, Leave):
            record.status = cmd.status
            if cmd.group not in record.groups:
                return []
            record.groups.discard(cmd.group)
            return [LeaveEvent(peer, record.name, cmd.group)]
        if isinstance(cmd, Ping):
            return [SendPingOkAction(peer)]
        return []  # PING-OK: the refresh above is all it is for

    def tick(self, now: float) -> list[Event]:
        """Let time pass: ping evasive peers, remove expired ones.

        Parameters
        ----------
        now
            The current time in seconds.

        Returns
        -------
        list of Event
            Per peer, sorted by UUID: ``[EvasiveEvent, SendPingAction]`` when an entered
            peer first passes ``evasive_after`` of silence; ``[ExitEvent?, DropAction]``
            when any peer passes ``expired_after``.
        """
        events: list[Event] = []
        for key in sorted(self._peers):
            record = self._peers[key]
            silent = now - record.last_seen
            if silent >= self.expired_after:
                events += self._remove(record, DropReason.EXPIRED, f"silent {silent:.3f} s")
            elif record.ready and not record.evasive and silent >= self.evasive_after:
                record.evasive = True
                events.append(EvasiveEvent(key, record.name))
                events.append(SendPingAction(key))
        return events

    def remove(self, peer: UUID, detail: str = "") -> list[Event]:
        """Forget ``peer`` on our own initiative (e.g. its DEALER's send buffer is full).

        Returns
        -------
        list of Event
            ``[ExitEvent?, DropAction(reason=LOCAL)]``, or ``[]`` for an unknown peer.
        """
        record = self._peers.get(peer)
        return [] if record is None else self._remove(record, DropReason.LOCAL, detail)

    # -- output ----------------------------------------------------------------------

    def stamp(self, peer: UUID, cmd: CommandT) -> CommandT:
        """Return ``cmd`` numbered with the next outgoing sequence for ``peer``.

        HELLO is always numbered 1 (it starts, or restarts, the connection); every later
        command gets the previous number + 1, wrapping 65535 -> 0.

        Parameters
        ----------
        peer
            A peer in the table (announced by a :class:`ConnectAction`).
        cmd
            The command to send; its ``sequence`` is ignored.

        Raises
        ------
        LocalProtocolError
            If ``peer`` is not in the table (``field="peer"``), ``cmd`` is not a command,
            or it is not a HELLO and no HELLO was stamped for this peer yet
            (``field="command"``).
        """
        if not isinstance(cmd, _COMMAND_TYPES):
            raise LocalProtocolError(
                f"stamp cmd: got {type(cmd).__name__}, expected a ZRE command",
                field="command",
                value=cmd,
            )
        record = self._peers.get(peer)
        if record is None:
            raise LocalProtocolError(
                f"stamp peer: {peer} is not in the table, expected a connected peer",
                field="peer",
                value=peer,
            )
        if isinstance(cmd, Hello):
            record.sent_sequence = 1
            record.hello_sent = True
        elif not record.hello_sent:
            raise LocalProtocolError(
                f"stamp command: got {cmd.command.name} for {peer} before any HELLO, "
                f"expected HELLO first",
                field="command",
                value=cmd.command,
            )
        else:
            record.sent_sequence = (record.sent_sequence + 1) & _UINT16_MAX
        return dataclasses.replace(cmd, sequence=record.sent_sequence)

    # -- internals -------------------------------------------------------------------

    def _on_hello(
        self, peer: UUID, record: _PeerRecord | None, cmd: Hello, now: float
    ) -> list[Event]:
        events: list[Event] = []
        if cmd.sequence != 1:
            if record is None:
                return []
            return self._remove(
                record, DropReason.SEQUENCE, f"HELLO sequence {cmd.sequence}, expected 1"
            )
        if record is not None and record.ready:
            events += self._remove(record, DropReason.RESTARTED, "second HELLO")
            record = None
        if record is None:
            if not cmd.endpoint:
                return events  # nowhere to connect back to; the spec says discard
            events += self._make_room(False)
            if len(self._peers) >= self.max_peers:
                self.refused += 1
                return events
            record = _PeerRecord(peer, cmd.endpoint, now)
            self._peers[peer] = record
            events.append(ConnectAction(peer, cmd.endpoint))
        record.ready = True
        self._unconfirmed.pop(peer, None)
        record.name = cmd.name
        record.headers = dict(cmd.headers)
        record.expected_sequence = 2
        self._refresh(record, now)
        events.append(EnterEvent(peer, cmd.name, MappingProxyType(dict(cmd.headers)), cmd.endpoint))
        for group in cmd.groups:
            events += self._join(record, group)
        record.status = cmd.status
        return events

    def _join(self, record: _PeerRecord, group: str) -> list[Event]:
        if group in record.groups:
            return []
        record.groups.add(group)
        return [JoinEvent(record.uuid, record.name, group)]

    def _refresh(self, record: _PeerRecord, now: float) -> None:
        record.last_seen = max(record.last_seen, now)
        record.evasive = False

    def _make_room(self, crowded: bool) -> list[Event]:
        """Evict the oldest peer known only from a beacon if ``crowded`` or the table is
        full: a peer that said HELLO (or is saying it now) always wins over one that has
        not, so refusals only ever fall on newcomers when every place holds a greeted peer.
        """
        if self._unconfirmed and (crowded or len(self._peers) >= self.max_peers):
            oldest = self._peers[next(iter(self._unconfirmed))]
            return self._remove(oldest, DropReason.CROWDED, "newer unconfirmed peers")
        return []

    def _remove(self, record: _PeerRecord, reason: DropReason, detail: str) -> list[Event]:
        del self._peers[record.uuid]
        self._unconfirmed.pop(record.uuid, None)
        events: list[Event] = []
        if record.ready:
            events.append(ExitEvent(record.uuid, record.name))
        events.append(DropAction(record.uuid, reason, detail))
        return events


# ---------------------------------------------------------------------------------------
# ZIO ports advertised in HELLO headers


class ZioPort(NamedTuple):
    """One advertised ZIO flow port: where to connect and the socket type found there."""

    address: str
    socket: str


@dataclass(frozen=True, slots=True)
class ZioEndpoint:
    """A ZIO flow port advertised by a peer in a group."""

    peer: UUID
    peer_name: str
    port: str
    address: str
    socket: str


def _check_port_name(name: object) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise LocalProtocolError(
            f"ZIO port name: got {name!r}, expected a non-empty name without '.'",
            field="name",
            value=name,
        )
    return name


def zio_port_headers(name: str, address: str, socket: str) -> dict[str, str]:
    """Return the HELLO headers that advertise one ZIO flow port.

    Parameters
    ----------
    name
        The port's name (non-empty, no ``.``), e.g. ``"out"``.
    address
        The endpoint peers connect to, e.g. ``"tcp://10.0.0.5:41000"``.
    socket
        The socket type bound there, e.g. ``"SERVER"`` or ``"ROUTER"``.

    Returns
    -------
    dict
        ``{"zio.port.<name>.address": address, "zio.port.<name>.socket": socket}``.

    Raises
    ------
    LocalProtocolError
        If ``name`` is empty, contains ``.``, or makes a header name longer than 255
        UTF-8 bytes, or ``address`` or ``socket`` is empty.
    """
    _check_port_name(name)
    for label, value in (("address", address), ("socket", socket)):
        if not isinstance(value, str) or not value:
            raise LocalProtocolError(
                f"ZIO port {name!r} {label}: got {value!r}, expected a non-empty string",
                field=label,
                value=value,
            )
    headers = {
        f"{ZIO_PORT_PREFIX}{name}.address": address,
        f"{ZIO_PORT_PREFIX}{name}.socket": socket,
    }
    for key in headers:
        _text_bytes(key, _UINT8_MAX, "headers")
    return headers


def advertised_ports(headers: Mapping[str, str]) -> dict[str, ZioPort]:
    """Return the ZIO flow ports a peer advertises in its HELLO headers.

    Keys under ``zio.port.`` that are not ``zio.port.<name>.address`` or
    ``zio.port.<name>.socket`` (with a non-empty name without ``.``) are ignored, so
    later attributes can be added without breaking older readers.

    Parameters
    ----------
    headers
        A peer's headers (e.g. :attr:`Peer.headers`).

    Returns
    -------
    dict
        Port name -> :class:`ZioPort` ``(address, socket)``, sorted by name.

    Raises
    ------
    RemoteProtocolError
        If a port has an address but no socket or the reverse, or an empty value;
        ``field`` is the offending header name.
    """
    found: dict[str, dict[str, str]] = {}
    for key, value in headers.items():
        if not key.startswith(ZIO_PORT_PREFIX):
            continue
        name, _, attribute = key[len(ZIO_PORT_PREFIX) :].rpartition(".")
        if not name or "." in name or attribute not in _PORT_FIELDS:
            continue
        if not value:
            raise RemoteProtocolError(
                f"ZIO port header {key}: got '', expected a non-empty {attribute}",
                field=key,
                value=value,
            )
        found.setdefault(name, {})[attribute] = value
    ports: dict[str, ZioPort] = {}
    for name in sorted(found):
        attributes = found[name]
        for attribute in _PORT_FIELDS:
            if attribute not in attributes:
                key = f"{ZIO_PORT_PREFIX}{name}.{attribute}"
                raise RemoteProtocolError(
                    f"ZIO port header {key}: missing, expected it alongside "
                    f"{ZIO_PORT_PREFIX}{name}.{next(iter(attributes))}",
                    field=key,
                    value=None,
                )
        ports[name] = ZioPort(attributes["address"], attributes["socket"])
    return ports


def group_zio_endpoints(
    table: PeerTable, group: str, *, port: str | None = None
) -> list[ZioEndpoint]:
    """List the ZIO flow ports advertised by the entered peers in ``group``.

    A peer whose advertisement is malformed (see :func:`advertised_ports`) is left out
    rather than failing the whole listing; call :func:`advertised_ports` on its headers
    to see why.

    Parameters
    ----------
    table
        The node's peer table.
    group
        The ZRE group.
    port
        Only this port name, if given.

    Returns
    -------
    list of ZioEndpoint
        Sorted by peer UUID, then port name.
    """
    endpoints: list[ZioEndpoint] = []
    for peer in table.peers_in_group(group):
        try:
            ports = advertised_ports(peer.headers)
        except RemoteProtocolError:
            continue
        for name, (address, socket) in ports.items():
            if port is None or name == port:
                endpoints.append(ZioEndpoint(peer.uuid, peer.name, name, address, socket))
    return endpoints
