"""The ZIO flow state machine (BOT/PAY/DAT/EOT) and the zio-spark profile.

Theory of operation (specs/zio-flow.txt, specs/zio-wire.md "Flow behaviour"):

A flow joins a *client* (which speaks first) and a *server*. Each side is either the
*giver* (direction ``extract``: it sends DATs) or the *taker* (``inject``: it receives
DATs). The client sends ``BOT{direction, credit}``; the server answers with a BOT of the
reversed direction and a credit no larger than the offer, or with EOT to reject. The
agreed credit ``C`` is the number of DATs that may be in flight.

Credit accounting: the taker starts holding all ``C`` credits and hands them out with
PAY; the giver starts at 0, spends one per DAT and gains what each PAY says. The taker
regains one per DAT received. So ``giver credit + DATs in flight + taker held == C``
at all times, and the machine checks both halves: a DAT that arrives while the taker has
nothing outstanding, or a PAY that would give the giver more than ``C``, is a
:class:`~zio_spark.errors.FlowControlError`.

EOT: either side may send it at any time after the handshake; the other side echoes it.
The initiator keeps accepting DAT (taker) or PAY (giver) until the echo arrives. When
both sides send EOT at once, each treats the other's as the echo.

Every message a side sends takes the next ``seqno``, starting with BOT = 0 (like the
reference). The reference never checks incoming seqnos, and neither do we.

The zio-spark profile adds attributes that plain ZIO peers ignore (unknown attributes
pass through untouched): in BOT, ``stream`` (name), ``producer`` (a stable producer id),
``resume`` (the last sequence number the taker holds durably), ``ack`` (true if the
giver keeps records until acknowledged) and ``last`` (a giver's position: the last
sequence number it had assigned when it wrote its BOT, so a taker knows what "everything
it holds now" means without waiting on a clock); in PAY, ``ack`` (the highest record sequence
number whose delivery is final). A PAY with ``credit`` 0 is legal only when it carries
``ack``: the taker must be able to acknowledge while it holds no credit (all of it out
with a giver that has nothing to send), and a reference giver just adds 0 to its credit.
The range requests of :mod:`.ranges` (``range``, ``held``) make a PAY of 0 legal too: a
range reader may have paid all its credit for an earlier range, and they go only to a
giver that stated the capability. A PAY of 0 with none of these stays a violation.
In an Arrow DAT (and the giver's BOT),
``more`` (false: the giver holds nothing more to send right now) and ``blocked_ms`` (the
giver's total time blocked waiting for acks, in ms) state the giver's own state, now and
then, never on every DAT. :func:`profile_bot`, :func:`pay_ack` and :func:`dat_profile`
read and check them.

The machine does no I/O: :meth:`Flow.receive` takes a decoded
:class:`~zio_spark.protocol.message.Message` and returns the event it means; the ``send_*``/``pay``
methods return the :class:`Message` to put on the wire. Any protocol error, local or
remote, moves the machine to :attr:`FlowState.ERROR`, where every call raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, NamedTuple

from zio_spark.errors import (
    FlowControlError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from zio_spark.protocol.message import (
    DAT_LABEL,
    FLOW_FORM,
    Message,
    decode_frames,
    encode_flow_label,
    encode_frames,
    parse_flow_label,
)

__all__ = [
    "BotReceived",
    "Credit",
    "Data",
    "Direction",
    "EotReceived",
    "Event",
    "Flow",
    "FlowKind",
    "FlowPair",
    "FlowState",
    "ProfileBot",
    "ProfileDat",
    "Rejected",
    "Role",
    "dat_profile",
    "pay_ack",
    "profile_bot",
]

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_RESERVED = frozenset({"flow", "direction", "credit"})
# PAY attributes that make a PAY of 0 legal: an ack, a request of ranges.py (range, held, admit).
_ZERO_PAY_KEYS = frozenset({"ack", "range", "held", "admit"})


class FlowKind(str, Enum):
    """The flow sub-message types, spec names verbatim."""

    BOT = "BOT"
    PAY = "PAY"
    DAT = "DAT"
    EOT = "EOT"


class Direction(str, Enum):
    """Direction of a BOT, from the point of view of its sender."""

    EXTRACT = "extract"  # the sender of this BOT gives (sends DATs)
    INJECT = "inject"  # the sender of this BOT takes (receives DATs)

    @property
    def reverse(self) -> Direction:
        return Direction.INJECT if self is Direction.EXTRACT else Direction.EXTRACT


class Role(str, Enum):
    CLIENT = "client"
    SERVER = "server"


class FlowState(str, Enum):
    IDLE = "IDLE"  # nothing exchanged yet
    BOT_SENT = "BOT_SENT"  # client: BOT sent, awaiting the server's
    BOT_RECEIVED = "BOT_RECEIVED"  # server: client BOT in, awaiting accept()/reject()
    READY = "READY"  # transfer phase
    EOT_SENT = "EOT_SENT"  # we sent EOT, draining until the echo
    EOT_RECEIVED = "EOT_RECEIVED"  # peer sent EOT, we owe the echo
    CLOSED = "CLOSED"  # EOT exchange complete (or BOT rejected)
    ERROR = "ERROR"  # a protocol error happened; terminal


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class BotReceived:
    """The peer's BOT. On a server: the client's offer. On a client: the agreement."""

    direction: Direction
    credit: int
    attrs: Mapping[str, Any]


class Data(NamedTuple):
    """A DAT received by the taker.

    A named tuple, not a frozen dataclass like the other events: one is made per DAT,
    and building it with ``tuple.__new__`` costs a third as much (~0.1 µs).
    """

    message: Message
    attrs: Mapping[str, Any]


_new_data = tuple.__new__


@dataclass(frozen=True, slots=True)
class Credit:
    """A PAY received by the giver: ``amount`` more DATs may be sent."""

    amount: int
    attrs: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EotReceived:
    """An EOT. ``echo`` is true when it answers ours (the flow is then CLOSED)."""

    attrs: Mapping[str, Any]
    payload: tuple[bytes, ...]
    echo: bool


@dataclass(frozen=True, slots=True)
class Rejected:
    """The server answered our BOT with EOT."""

    attrs: Mapping[str, Any]


Event = BotReceived | Data | Credit | EotReceived | Rejected


def _extras(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    if len(obj) == 1:
        return _EMPTY
    return MappingProxyType({k: v for k, v in obj.items() if k not in _RESERVED})


def _check_credit_value(value: object, what: str, local: bool) -> int:
    # bool is an int in Python; a credit of True is not what any peer means.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        msg = f"{what} credit must be a positive integer, got {value!r}"
        if local:
            raise LocalProtocolError(msg, field="credit", value=value)
        raise FlowControlError(msg, field="credit", value=value)
    return value


# ------------------------------------------------------------------------------ flow


@dataclass(slots=True)
class Flow:
    """One end of a ZIO flow. No I/O: feed :meth:`receive`, send what methods return.

    Parameters
    ----------
    role
        :attr:`Role.CLIENT` (speaks first) or :attr:`Role.SERVER`.
    origin
        The ``origin`` coord value stamped on every message we send.
    """

    role: Role
    origin: int = 0
    state: FlowState = FlowState.IDLE
    direction: Direction | None = None  # ours, once known
    total_credit: int = 0
    credit: int = 0  # giver: DATs it may send now; taker: credits it holds
    peer_attrs: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    sent: int = 0  # messages sent (next seqno)
    dats_sent: int = 0
    dats_received: int = 0
    _offered: int = 0
    _dat_label: str = ""

    # -- properties ------------------------------------------------------------

    @property
    def is_giver(self) -> bool:
        """True if this end sends DATs (direction ``extract``)."""
        return self.direction is Direction.EXTRACT

    @property
    def outstanding(self) -> int:
        """Taker: credits handed out and not yet returned by a DAT."""
        return self.total_credit - self.credit

    # -- helpers ---------------------------------------------------------------

    def _fail(self, error: ProtocolError) -> ProtocolError:
        self.state = FlowState.ERROR
        return error

    def _local(self, text: str, **kw: Any) -> ProtocolError:
        return self._fail(LocalProtocolError(text, **kw))

    def _remote(self, text: str, **kw: Any) -> ProtocolError:
        return self._fail(RemoteProtocolError(text, **kw))

    def _flow_control(self, text: str, **kw: Any) -> ProtocolError:
        return self._fail(FlowControlError(text, **kw))

    def _make(self, label: str, payload: tuple[bytes, ...] = ()) -> Message:
        msg = Message(FLOW_FORM, label, 0, self.origin, 0, self.sent, payload)
        self.sent += 1
        return msg

    def _label(self, kind: FlowKind, attrs: Mapping[str, Any] | None, **fixed: Any) -> str:
        obj: dict[str, Any] = {"flow": kind.value, **fixed}
        if attrs:
            for key, value in attrs.items():
                if key in _RESERVED:
                    raise self._local(
                        f"attribute {key!r} is reserved by the flow protocol",
                        field=key,
                        value=value,
                    )
                obj[key] = value
        try:
            return encode_flow_label(obj)
        except LocalProtocolError as e:
            raise self._fail(e) from None

    def _require(self, *states: FlowState, action: str) -> None:
        if self.state not in states:
            names = ", ".join(s.value for s in states)
            raise self._local(
                f"cannot {action} in state {self.state.value} (needs {names})",
                field="state",
                value=self.state.value,
            )

    def _enter_transfer(self, direction: Direction, credit: int) -> None:
        self.direction = direction
        self.total_credit = credit
        # The taker starts holding every credit, the giver none.
        self.credit = 0 if direction is Direction.EXTRACT else credit
        self.state = FlowState.READY
        self._dat_label = encode_flow_label({"flow": "DAT"})

    # -- handshake -------------------------------------------------------------

    def send_bot(
        self, direction: Direction, credit: int, attrs: Mapping[str, Any] | None = None
    ) -> Message:
        """Client: open the flow offering ``credit``.

        Raises
        ------
        LocalProtocolError
            If this is not an idle client, the direction is not ``extract``/``inject``
            or the credit is not a positive integer.
        """
        if self.role is not Role.CLIENT:
            raise self._local("only a client sends the first BOT; a server calls accept()")
        self._require(FlowState.IDLE, action="send BOT")
        try:
            _check_credit_value(credit, "offered", local=True)
        except LocalProtocolError as e:
            raise self._fail(e) from None
        try:
            direction = Direction(direction)
        except ValueError:
            raise self._local(
                f"direction must be 'extract' or 'inject', got {direction!r}",
                field="direction",
                value=direction,
            ) from None
        label = self._label(FlowKind.BOT, attrs, direction=direction.value, credit=credit)
        self.direction = direction
        self._offered = credit
        self.state = FlowState.BOT_SENT
        return self._make(label)

    def accept(self, credit: int | None = None, attrs: Mapping[str, Any] | None = None) -> Message:
        """Server: answer the client's BOT, optionally lowering the credit.

        Raises
        ------
        LocalProtocolError
            If no BOT is pending, or ``credit`` is not within 1..offered.
        """
        self._require(FlowState.BOT_RECEIVED, action="accept a BOT")
        agreed = self._offered if credit is None else credit
        if (
            isinstance(agreed, bool)
            or not isinstance(agreed, int)
            or not (1 <= agreed <= self._offered)
        ):
            raise self._local(
                f"accepted credit must be 1..{self._offered} (the client's offer), got {credit!r}",
                field="credit",
                value=credit,
            )
        assert self.direction is not None
        label = self._label(FlowKind.BOT, attrs, direction=self.direction.value, credit=agreed)
        self._enter_transfer(self.direction, agreed)
        return self._make(label)

    def reject(self, attrs: Mapping[str, Any] | None = None) -> Message:
        """Server: refuse the client's BOT with EOT; the flow is then CLOSED.

        Raises
        ------
        LocalProtocolError
            If no BOT is pending.
        """
        self._require(FlowState.BOT_RECEIVED, action="reject a BOT")
        label = self._label(FlowKind.EOT, attrs)
        self.state = FlowState.CLOSED
        return self._make(label)

    # -- transfer ----------------------------------------------------------------

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> Message:
        """Giver: a DAT carrying ``payload`` frames; spends one credit.

        Raises
        ------
        LocalProtocolError
            If this end is not a giver in READY, or holds no credit.
        """
        # Not in EOT_SENT: the peer has our EOT first and would reject a DAT after it.
        self._require(FlowState.READY, action="send DAT")
        if not self.is_giver:
            raise self._local("a taker (inject) cannot send DAT", field="direction")
        if self.credit <= 0:
            raise self._local(
                f"no credit to send DAT (credit {self.credit} of {self.total_credit})",
                field="credit",
                value=self.credit,
            )
        label = self._label(FlowKind.DAT, attrs) if attrs else self._dat_label
        self.credit -= 1
        self.dats_sent += 1
        return self._make(label, payload)

    def send_dats(self, n: int = 1) -> int:
        """Giver, the fast lane: spend ``n`` credits on plain DATs; returns the first seqno.

        The caller encodes DAT ``i`` (0-based) with
        ``DatCodec(self.origin).frames(first + i, payload)`` (or ``single``): the same
        bytes :meth:`send_dat` without attributes would give, without a Message each.

        Raises
        ------
        LocalProtocolError
            If this end is not a giver in READY, or ``n`` is not 1..credit held.
        """
        if (
            self.state is FlowState.READY
            and self.direction is Direction.EXTRACT
            and type(n) is int
            and 0 < n <= self.credit
        ):
            first = self.sent
            self.sent += n
            self.credit -= n
            self.dats_sent += n
            return first
        self._require(FlowState.READY, action="send DAT")
        if not self.is_giver:
            raise self._local("a taker (inject) cannot send DAT", field="direction")
        raise self._local(
            f"DAT count must be 1..{self.credit} (credit held of {self.total_credit}), got {n!r}",
            field="credit",
            value=n,
        )

    def take_dat(self) -> bool:
        """Taker, the fast lane: account for one plain DAT; True if it was acceptable.

        False changes nothing: the DAT is not acceptable here (wrong state, direction or
        no credit outstanding), and passing the decoded message to :meth:`receive` raises
        the precise error. True is exactly what :meth:`receive` would have done for a DAT
        without attributes.
        """
        state = self.state
        if (
            (state is FlowState.READY or state is FlowState.EOT_SENT)
            and self.direction is Direction.INJECT
            and self.credit < self.total_credit
        ):
            self.credit += 1
            self.dats_received += 1
            return True
        return False

    def pay(self, amount: int | None = None, attrs: Mapping[str, Any] | None = None) -> Message:
        """Taker: hand ``amount`` credits (default: all held) to the giver.

        ``attrs`` carries profile attributes such as ``{"ack": 41}``.

        Raises
        ------
        LocalProtocolError
            If this end is not a taker in READY, or ``amount`` is not 1..held.
        """
        # Not in EOT_SENT: the peer has our EOT first and would reject a PAY after it.
        self._require(FlowState.READY, action="send PAY")
        if self.is_giver:
            raise self._local("a giver (extract) cannot send PAY", field="direction")
        n = self.credit if amount is None else amount
        # Profile: a PAY of 0 is legal only when it carries "ack" or a range request.
        lowest = 0 if attrs and not _ZERO_PAY_KEYS.isdisjoint(attrs) else 1
        if isinstance(n, bool) or not isinstance(n, int) or not (lowest <= n <= self.credit):
            raise self._local(
                f"PAY amount must be {lowest}..{self.credit} (credit held), got {n!r}",
                field="credit",
                value=n,
            )
        label = self._label(FlowKind.PAY, attrs, credit=n)
        self.credit -= n
        return self._make(label)

    def send_eot(
        self, attrs: Mapping[str, Any] | None = None, payload: tuple[bytes, ...] = ()
    ) -> Message:
        """Begin end of transmission, or echo the peer's EOT.

        Raises
        ------
        LocalProtocolError
            If the flow is not in transfer (READY or EOT_RECEIVED).
        """
        self._require(FlowState.READY, FlowState.EOT_RECEIVED, action="send EOT")
        label = self._label(FlowKind.EOT, attrs)
        self.state = FlowState.EOT_SENT if self.state is FlowState.READY else FlowState.CLOSED
        return self._make(label, payload)

    # -- input -------------------------------------------------------------------

    def receive(self, msg: Message) -> Event:
        """Process one message from the peer and return what it means.

        Raises
        ------
        RemoteProtocolError
            The peer broke the protocol (the flow is then in ERROR).
        FlowControlError
            The peer broke credit accounting (the flow is then in ERROR).
        LocalProtocolError
            If the flow is already in ERROR.
        """
        # Fast lane: a DAT without attributes that the taker can take (most messages).
        if msg.label == DAT_LABEL and msg.form == FLOW_FORM and self.take_dat():
            return _new_data(Data, (msg, _EMPTY))
        state = self.state
        if state is FlowState.ERROR:
            raise LocalProtocolError("flow is in ERROR state", field="state", value="ERROR")
        if msg.form != FLOW_FORM:
            raise self._remote(
                f"expected a FLOW message, got form {msg.form!r}", field="form", value=msg.form
            )
        try:
            obj = parse_flow_label(msg.label)
        except RemoteProtocolError as e:
            raise self._fail(e) from None
        kind = obj["flow"]
        if kind == "DAT":
            return self._on_dat(msg, obj)
        if kind == "PAY":
            return self._on_pay(obj)
        if kind == "BOT":
            return self._on_bot(obj)
        if kind == "EOT":
            return self._on_eot(msg, obj)
        raise self._remote(
            f"unknown flow type {kind!r} (expected BOT, PAY, DAT or EOT)",
            field="flow",
            value=kind,
        )

    def _in_transfer(self, kind: str) -> None:
        if self.state not in (FlowState.READY, FlowState.EOT_SENT):
            raise self._remote(
                f"{kind} received in state {self.state.value}",
                field="flow",
                value=kind,
            )

    def _on_dat(self, msg: Message, obj: Mapping[str, Any]) -> Event:
        self._in_transfer("DAT")
        if self.is_giver:
            raise self._remote("DAT received by the giver (wrong direction)", field="flow")
        if self.credit >= self.total_credit:
            raise self._flow_control(
                f"DAT received with no credit outstanding (taker holds {self.credit} of "
                f"{self.total_credit})",
                credit=0,
                field="flow",
                value="DAT",
            )
        self.credit += 1
        self.dats_received += 1
        return Data(msg, _extras(obj))

    def _on_pay(self, obj: Mapping[str, Any]) -> Event:
        self._in_transfer("PAY")
        if not self.is_giver:
            raise self._remote("PAY received by the taker (wrong direction)", field="flow")
        if (
            obj.get("credit") == 0
            and type(obj["credit"]) is int
            and not _ZERO_PAY_KEYS.isdisjoint(obj)
        ):
            amount = 0  # profile: an ack-only PAY, or a range request (ranges.py)
        else:
            try:
                amount = _check_credit_value(obj.get("credit"), "PAY", local=False)
            except FlowControlError as e:
                raise self._fail(e) from None
        if self.credit + amount > self.total_credit:
            raise self._flow_control(
                f"PAY of {amount} beyond what the taker holds: giver already has "
                f"{self.credit} of {self.total_credit}",
                credit=self.credit,
                field="credit",
                value=amount,
            )
        self.credit += amount
        return Credit(amount, _extras(obj))

    def _on_bot(self, obj: Mapping[str, Any]) -> Event:
        if self.state is FlowState.IDLE and self.role is Role.SERVER:
            direction = self._bot_direction(obj)
            credit = self._bot_credit(obj)
            self.direction = direction.reverse
            self._offered = credit
            self.peer_attrs = _extras(obj)
            self.state = FlowState.BOT_RECEIVED
            return BotReceived(direction, credit, self.peer_attrs)
        if self.state is FlowState.BOT_SENT:
            direction = self._bot_direction(obj)
            credit = self._bot_credit(obj)
            assert self.direction is not None
            if direction is not self.direction.reverse:
                raise self._remote(
                    f"server BOT direction {direction.value!r} does not reverse ours "
                    f"({self.direction.value!r})",
                    field="direction",
                    value=direction.value,
                )
            if credit > self._offered:
                raise self._flow_control(
                    f"server raised the credit to {credit} above our offer of {self._offered}",
                    credit=credit,
                    field="credit",
                    value=credit,
                )
            self.peer_attrs = _extras(obj)
            self._enter_transfer(self.direction, credit)
            return BotReceived(direction, credit, self.peer_attrs)
        raise self._remote(
            f"BOT received in state {self.state.value} as {self.role.value}",
            field="flow",
            value="BOT",
        )

    def _bot_direction(self, obj: Mapping[str, Any]) -> Direction:
        value = obj.get("direction")
        if value == "extract":
            return Direction.EXTRACT
        if value == "inject":
            return Direction.INJECT
        raise self._remote(
            f"BOT direction must be 'extract' or 'inject', got {value!r}",
            field="direction",
            value=value,
        )

    def _bot_credit(self, obj: Mapping[str, Any]) -> int:
        try:
            return _check_credit_value(obj.get("credit"), "BOT", local=False)
        except FlowControlError as e:
            raise self._fail(e) from None

    def _on_eot(self, msg: Message, obj: Mapping[str, Any]) -> Event:
        state = self.state
        attrs = _extras(obj)
        if state is FlowState.BOT_SENT:
            self.state = FlowState.CLOSED
            return Rejected(attrs)
        if state is FlowState.READY:
            self.state = FlowState.EOT_RECEIVED
            return EotReceived(attrs, msg.payload, echo=False)
        if state is FlowState.EOT_SENT:
            self.state = FlowState.CLOSED
            return EotReceived(attrs, msg.payload, echo=True)
        raise self._remote(f"EOT received in state {state.value}", field="flow", value="EOT")


# --------------------------------------------------------------------------- profile


@dataclass(frozen=True, slots=True)
class ProfileBot:
    """The zio-spark profile attributes of a BOT (absent ones are ``None``/False)."""

    stream: str | None = None
    producer: str | None = None
    resume: int | None = None
    ack: bool = False
    batch: int | None = None  # taker: most records it accepts per DAT
    encodings: tuple[str, ...] = ()  # payload encodings offered (taker) or used (giver)
    # Giver: its position when it wrote this BOT, the last sequence number it had
    # assigned (every record up to it is held for the taker or was acknowledged; 0: none).
    last: int | None = None


def profile_bot(attrs: Mapping[str, Any]) -> ProfileBot:
    """Read and check the profile attributes of a BOT's extras.

    Raises
    ------
    RemoteProtocolError
        If ``stream``/``producer`` are not strings, ``resume`` or ``last`` not an integer
        >= 0, ``batch`` not an integer >= 1 or ``ack`` not a boolean.
    """
    stream = attrs.get("stream")
    producer = attrs.get("producer")
    resume = attrs.get("resume")
    ack = attrs.get("ack", False)
    for name, value in (("stream", stream), ("producer", producer)):
        if value is not None and not isinstance(value, str):
            raise RemoteProtocolError(
                f"BOT {name} must be a string, got {value!r}", field=name, value=value
            )
    last = attrs.get("last")
    for name, value in (("resume", resume), ("last", last)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise RemoteProtocolError(
                f"BOT {name} must be an integer >= 0, got {value!r}", field=name, value=value
            )
    if not isinstance(ack, bool):
        raise RemoteProtocolError(
            f"BOT ack must be true or false, got {ack!r}", field="ack", value=ack
        )
    batch = attrs.get("batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise RemoteProtocolError(
            f"BOT batch must be an integer >= 1, got {batch!r}", field="batch", value=batch
        )
    # A taker lists the encodings it reads, a giver names the one it uses; anything else
    # means none (plain payloads), as for a peer that does not know the attribute.
    raw = attrs.get("encoding")
    if isinstance(raw, str):
        encodings: tuple[str, ...] = (raw,)
    elif isinstance(raw, list):
        encodings = tuple(e for e in raw if isinstance(e, str))
    else:
        encodings = ()
    return ProfileBot(stream, producer, resume, ack, batch, encodings, last)


def pay_ack(attrs: Mapping[str, Any]) -> int | None:
    """The cumulative ``ack`` of a PAY, or None if it carries none.

    Raises
    ------
    RemoteProtocolError
        If ``ack`` is present but not an integer >= 0.
    """
    ack = attrs.get("ack")
    if ack is None:
        return None
    if isinstance(ack, bool) or not isinstance(ack, int) or ack < 0:
        raise RemoteProtocolError(
            f"PAY ack must be an integer >= 0, got {ack!r}", field="ack", value=ack
        )
    return ack


@dataclass(frozen=True, slots=True)
class ProfileDat:
    """The zio-spark profile state a giver states in a DAT or its BOT (absent: None)."""

    more: bool | None = None  # False: nothing more to send right now (all sent)
    blocked_ms: int | None = None  # total time the giver was blocked waiting for acks


_NO_STATE = ProfileDat()


def dat_profile(attrs: Mapping[str, Any]) -> ProfileDat:
    """Read and check the giver's stated state (``more``, ``blocked_ms``) in DAT or BOT
    extras; other attributes are ignored.

    Raises
    ------
    RemoteProtocolError
        If ``more`` is not a boolean or ``blocked_ms`` not an integer >= 0.
    """
    if not attrs:
        return _NO_STATE
    more = attrs.get("more")
    if more is not None and not isinstance(more, bool):
        raise RemoteProtocolError(
            f"DAT more must be true or false, got {more!r}", field="more", value=more
        )
    blocked = attrs.get("blocked_ms")
    if blocked is not None and (
        isinstance(blocked, bool) or not isinstance(blocked, int) or blocked < 0
    ):
        raise RemoteProtocolError(
            f"DAT blocked_ms must be an integer >= 0, got {blocked!r}",
            field="blocked_ms",
            value=blocked,
        )
    if more is None and blocked is None:
        return _NO_STATE
    return ProfileDat(more, blocked)


# ------------------------------------------------------------------------ test pair


class FlowPair:
    """A client and a server flow joined in memory (h11's ConnectionPair idea).

    :meth:`to_server` and :meth:`to_client` push a message through the multipart codec
    and into the other side, so tests exercise the wire format too.
    """

    def __init__(self, client_origin: int = 1, server_origin: int = 2) -> None:
        self.client = Flow(Role.CLIENT, origin=client_origin)
        self.server = Flow(Role.SERVER, origin=server_origin)

    def to_server(self, msg: Message) -> Event:
        return self.server.receive(decode_frames(encode_frames(msg)))

    def to_client(self, msg: Message) -> Event:
        return self.client.receive(decode_frames(encode_frames(msg)))

    def handshake(
        self,
        client_direction: Direction,
        offer: int,
        accept: int | None = None,
        client_attrs: Mapping[str, Any] | None = None,
        server_attrs: Mapping[str, Any] | None = None,
    ) -> None:
        """Run the BOT exchange; both flows end in READY."""
        self.to_server(self.client.send_bot(client_direction, offer, client_attrs))
        self.to_client(self.server.accept(accept, server_attrs))
