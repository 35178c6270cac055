"""36/ZRE peer bookkeeping: the pure state machine a ZRE node runs over its peers.

:class:`PeerTable` is the node's state machine in the h11 style: the transport feeds it
beacons (:meth:`~PeerTable.on_beacon`), decoded commands (:meth:`~PeerTable.on_message`)
and the passage of time (:meth:`~PeerTable.tick`), each with an explicit ``now`` in
seconds, and gets back a list of events: things for the application (ENTER, EXIT, JOIN,
LEAVE, WHISPER, SHOUT, EVASIVE) and actions for the transport (CONNECT, DROP, SEND_PING,
SEND_PING_OK). Incoming sequences must run 1, 2, ... from HELLO, wrapping at 65535 to 0
as zyre's uint16 counters do; a gap or repeat makes the peer invalid, and the table
removes it and emits DROP. :meth:`PeerTable.stamp` numbers our own outgoing commands per
peer the same way. The wire codec it consumes is :mod:`zio_spark.protocol.zre`. No I/O,
no clock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, TypeAlias
from uuid import UUID

from zio_spark.errors import ConfigError, LocalProtocolError
from zio_spark.protocol.zre import (
    _COMMAND_TYPES,
    _UINT16_MAX,
    Beacon,
    Command,
    CommandT,
    Hello,
    Join,
    Leave,
    Ping,
    Shout,
    Whisper,
    tcp_endpoint,
)

__all__ = [
    "EVASIVE_AFTER",
    "EXPIRED_AFTER",
    "MAX_PEERS",
    "MAX_UNCONFIRMED",
    "ConnectAction",
    "DropAction",
    "DropReason",
    "EnterEvent",
    "EvasiveEvent",
    "Event",
    "ExitEvent",
    "JoinEvent",
    "LeaveEvent",
    "Peer",
    "PeerTable",
    "SendPingAction",
    "SendPingOkAction",
    "ShoutEvent",
    "WhisperEvent",
    "ZreEventType",
]

EVASIVE_AFTER = 5.0
"""Default seconds of silence after which a peer is EVASIVE and gets a PING."""
EXPIRED_AFTER = 30.0
"""Default seconds of silence after which a peer is dead (EXIT)."""
MAX_PEERS = 512
"""Default bound on known peers (each costs the transport a DEALER socket)."""
MAX_UNCONFIRMED = 64
"""Default bound on peers known from a beacon only, still waiting for their HELLO."""


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
    """Transport: send the peer a stamped :class:`~zio_spark.protocol.zre.Ping`."""

    kind: ClassVar[ZreEventType] = ZreEventType.SEND_PING

    peer: UUID


@dataclass(frozen=True, slots=True)
class SendPingOkAction:
    """Transport: answer the peer's PING with a stamped :class:`~zio_spark.protocol.zre.PingOk`."""

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
            The decoded beacon (see :func:`~zio_spark.protocol.zre.decode_beacon`).
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
            crowded = len(self._unconfirmed) >= self.max_unconfirmed
            events, record = self._admit(beacon.uuid, endpoint, now, crowded)
            if record is not None:
                self._unconfirmed[beacon.uuid] = None
            return events
        self._refresh(record, now)
        return []

    def on_message(self, peer: UUID, cmd: Command, now: float) -> list[Event]:
        """Account for a decoded command received from ``peer`` on our mailbox.

        Parameters
        ----------
        peer
            The sender, from its identity frame (see
            :func:`~zio_spark.protocol.zre.decode_identity`).
        cmd
            The decoded command (see :func:`~zio_spark.protocol.zre.decode_command`).
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
        _check_command("on_message", "cmd", cmd)
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
        _check_command("stamp", "command", cmd)
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
            admitted, record = self._admit(peer, cmd.endpoint, now, False)
            events += admitted
            if record is None:
                return events
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

    def _admit(
        self, peer: UUID, endpoint: str, now: float, crowded: bool
    ) -> tuple[list[Event], _PeerRecord | None]:
        """Make a place for a new ``peer`` (see :meth:`_make_room`) and add it with a
        CONNECT, or count it in :attr:`refused` (record None) when the table is full."""
        events = self._make_room(crowded)
        if len(self._peers) >= self.max_peers:
            self.refused += 1
            return events, None
        record = _PeerRecord(peer, endpoint, now)
        self._peers[peer] = record
        events.append(ConnectAction(peer, endpoint))
        return events, record

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


def _check_command(where: str, name: str, cmd: object) -> None:
    if not isinstance(cmd, _COMMAND_TYPES):
        raise LocalProtocolError(
            f"{where} {name}: got {type(cmd).__name__}, expected a ZRE command",
            field=name,
            value=cmd,
        )
