"""36/ZRE: the wire codec for beacons, identities and commands, with no I/O.

Theory of operation (specs/36-zre.txt):

Discovery. Every node broadcasts a 22-byte UDP *beacon*: ``b"ZRE\\x01"``, its 16-byte
UUID and its mailbox port (uint16, network order). A non-zero port says "connect to me on
tcp://<sender ip>:<port>"; port 0 says "I am leaving". :func:`decode_beacon` accepts port 0
(it is a well-formed beacon); what a port means is decided by
:meth:`~zio_spark.protocol.zre_peers.PeerTable.on_beacon`.

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

The rest of ZRE lives beside this module: :mod:`zio_spark.protocol.zre_peers` holds the
peer state machine (:class:`~zio_spark.protocol.zre_peers.PeerTable` and its events), and
:mod:`zio_spark.protocol.zio_ports` the ``zio.port.*`` HELLO headers that advertise ZIO
flow ports.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, TypeAlias, TypeVar
from uuid import UUID

from zio_spark.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "BEACON_HEADER",
    "BEACON_SIZE",
    "DISCOVERY_PORT",
    "IDENTITY_SIZE",
    "SIGNATURE",
    "VERSION",
    "Beacon",
    "Command",
    "Hello",
    "Join",
    "Leave",
    "Ping",
    "PingOk",
    "Shout",
    "Whisper",
    "ZreCommand",
    "decode_beacon",
    "decode_command",
    "decode_identity",
    "encode_beacon",
    "encode_command",
    "encode_identity",
    "tcp_endpoint",
]

DISCOVERY_PORT = 5670
"""UDP port of the ZRE discovery service (ZRE-DISC, assigned by IANA)."""
BEACON_HEADER = b"ZRE\x01"
BEACON_SIZE = 22
SIGNATURE = b"\xaa\xa1"
VERSION = 2
IDENTITY_SIZE = 17

_UINT8_MAX = 0xFF
_UINT16_MAX = 0xFFFF
_UINT32_MAX = 0xFFFF_FFFF


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
        :meth:`~zio_spark.protocol.zre_peers.PeerTable.stamp`).

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
