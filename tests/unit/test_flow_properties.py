"""Property tests for the ZIO flow state machine (h11/h2 style).

(a) Every reachable state x every input: the machine either returns an event/message
    and moves as the transition table below says, or raises a ProtocolError and is in
    ERROR. An ERROR flow answers every call with LocalProtocolError.
(b) Credit accounting over random schedules with a FIFO wire in each direction:
    ``giver credit + DATs in flight + taker credit + PAYs in flight == total`` at every
    step, the giver never sends more DATs than it was paid for, and local calls that
    would break the books raise LocalProtocolError instead of succeeding.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zio_spark.errors import (
    FlowControlError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    Event,
    Flow,
    FlowPair,
    FlowState,
    Rejected,
    Role,
)
from zio_spark.protocol.message import (
    FLOW_FORM,
    Message,
    decode_frames,
    encode_frames,
    parse_flow_label,
)

S = FlowState
EXTRACT = Direction.EXTRACT
INJECT = Direction.INJECT
MISSING = "<missing>"  # marks an attribute left out of a generated flow object

SETTINGS = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def is_credit(value: object) -> bool:
    """What the protocol accepts as a credit: a positive int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ----------------------------------------------------------------- transition table

# Incoming messages: (state, flow type) -> (next state, event type). A pair not in the
# table is a RemoteProtocolError; a guard below may still refuse a listed pair.
RECEIVE: dict[tuple[FlowState, str], tuple[FlowState, type[Any]]] = {
    (S.IDLE, "BOT"): (S.BOT_RECEIVED, BotReceived),  # server only
    (S.BOT_SENT, "BOT"): (S.READY, BotReceived),
    (S.BOT_SENT, "EOT"): (S.CLOSED, Rejected),
    (S.READY, "DAT"): (S.READY, Data),  # taker only
    (S.EOT_SENT, "DAT"): (S.EOT_SENT, Data),  # taker draining
    (S.READY, "PAY"): (S.READY, Credit),  # giver only
    (S.EOT_SENT, "PAY"): (S.EOT_SENT, Credit),  # giver draining
    (S.READY, "EOT"): (S.EOT_RECEIVED, EotReceived),
    (S.EOT_SENT, "EOT"): (S.CLOSED, EotReceived),  # the echo, or a simultaneous EOT
}

# Local calls: (call, state) -> next state. Anything else is a LocalProtocolError.
CALLS: dict[tuple[str, FlowState], FlowState] = {
    ("send_bot", S.IDLE): S.BOT_SENT,  # client only
    ("accept", S.BOT_RECEIVED): S.READY,
    ("reject", S.BOT_RECEIVED): S.CLOSED,
    ("send_dat", S.READY): S.READY,  # giver with credit
    ("pay", S.READY): S.READY,  # taker, 1..held
    ("send_eot", S.READY): S.EOT_SENT,
    ("send_eot", S.EOT_RECEIVED): S.CLOSED,
}


@dataclass
class Snapshot:
    """What the model needs to know about a flow before an input."""

    state: FlowState
    role: Role
    direction: Direction | None
    credit: int
    total: int
    offered: int  # the client's offer (BOT_SENT client, BOT_RECEIVED server)
    sent: int

    @property
    def giver(self) -> bool:
        return self.direction is EXTRACT


def snapshot(flow: Flow, offered: int) -> Snapshot:
    return Snapshot(
        flow.state, flow.role, flow.direction, flow.credit, flow.total_credit, offered, flow.sent
    )


def receive_guard(snap: Snapshot, kind: str, obj: dict[str, Any]) -> type[ProtocolError] | None:
    """None if the listed transition applies, else the error expected instead."""
    direction = obj.get("direction")
    credit = obj.get("credit")
    if kind == "BOT" and snap.state is S.IDLE:
        if snap.role is not Role.SERVER:
            return RemoteProtocolError
        if direction not in ("extract", "inject"):
            return RemoteProtocolError
        return None if is_credit(credit) else FlowControlError
    if kind == "BOT":  # BOT_SENT: the server's answer
        assert snap.direction is not None
        if direction not in ("extract", "inject"):
            return RemoteProtocolError
        if not is_credit(credit):
            return FlowControlError
        if direction != snap.direction.reverse.value:
            return RemoteProtocolError
        return None if credit <= snap.offered else FlowControlError
    if kind == "DAT":
        if snap.giver:
            return RemoteProtocolError
        return None if snap.credit < snap.total else FlowControlError
    if kind == "PAY":
        if not snap.giver:
            return RemoteProtocolError
        if not is_credit(credit):
            return FlowControlError
        return None if snap.credit + credit <= snap.total else FlowControlError
    return None  # EOT


def call_guard(snap: Snapshot, name: str, args: tuple[Any, ...]) -> bool:
    if name == "send_bot":
        direction, credit = args
        return snap.role is Role.CLIENT and direction in ("extract", "inject") and is_credit(credit)
    if name == "accept":
        (credit,) = args
        agreed = snap.offered if credit is None else credit
        return is_credit(agreed) and agreed <= snap.offered
    if name == "send_dat":
        return snap.giver and snap.credit > 0
    if name == "pay":
        (amount,) = args
        n = snap.credit if amount is None else amount
        return not snap.giver and is_credit(n) and n <= snap.credit
    return True  # reject, send_eot


# ---------------------------------------------------------------- building states


@dataclass
class Built:
    flow: Flow
    offered: int = 0


STATES = [
    "idle_client",
    "idle_server",
    "bot_sent",
    "bot_received",
    "ready_giver",
    "ready_taker",
    "eot_sent_giver",
    "eot_sent_taker",
    "eot_received_giver",
    "eot_received_taker",
    "closed",
    "error",
]


def _transfer(draw: st.DrawFn, want_giver: bool) -> tuple[FlowPair, Flow, Flow]:
    """A ready pair after some traffic; returns (pair, the wanted side, the other)."""
    want_client = draw(st.booleans())
    client_direction = EXTRACT if want_giver == want_client else INJECT
    offer = draw(st.integers(1, 5))
    agreed = draw(st.integers(1, offer))
    pair = FlowPair()
    pair.handshake(client_direction, offer, agreed)
    giver = pair.client if pair.client.is_giver else pair.server
    taker = pair.server if giver is pair.client else pair.client

    def deliver(sender: Flow, msg: Message) -> None:
        if sender is pair.client:
            pair.to_server(msg)
        else:
            pair.to_client(msg)

    paid = draw(st.integers(0, agreed))
    if paid:
        deliver(taker, taker.pay(paid))
    dats = [giver.send_dat() for _ in range(draw(st.integers(0, giver.credit)))]
    for msg in dats[: draw(st.integers(0, len(dats)))]:
        deliver(giver, msg)
    wanted = giver if want_giver else taker
    other = taker if want_giver else giver
    return pair, wanted, other


@st.composite
def built_flows(draw: st.DrawFn, name: str) -> Built:
    if name == "idle_client":
        return Built(Flow(Role.CLIENT))
    if name == "idle_server":
        return Built(Flow(Role.SERVER))
    offer = draw(st.integers(1, 5))
    direction = draw(st.sampled_from([EXTRACT, INJECT]))
    if name == "bot_sent":
        flow = Flow(Role.CLIENT)
        flow.send_bot(direction, offer)
        return Built(flow, offer)
    if name == "bot_received":
        flow = Flow(Role.SERVER)
        flow.receive(
            Message(
                FLOW_FORM,
                json.dumps({"flow": "BOT", "direction": direction.value, "credit": offer}),
            )
        )
        return Built(flow, offer)
    if name.startswith(("ready_", "eot_")):
        want_giver = name.endswith("giver")
        pair, flow, other = _transfer(draw, want_giver)
        if name.startswith("eot_sent"):
            flow.send_eot()
        elif name.startswith("eot_received"):
            flow.receive(decode_frames(encode_frames(other.send_eot())))
        return Built(flow)
    if name == "closed":
        how = draw(st.sampled_from(["initiator", "responder", "rejected", "rejecter"]))
        if how in ("initiator", "responder"):
            pair, flow, other = _transfer(draw, draw(st.booleans()))
            first, second = (flow, other) if how == "initiator" else (other, flow)
            eot = first.send_eot()
            second.receive(eot)
            first.receive(second.send_eot())
            return Built(flow)
        pair = FlowPair()
        pair.to_server(pair.client.send_bot(direction, offer))
        pair.to_client(pair.server.reject())
        return Built(pair.client if how == "rejected" else pair.server)
    assert name == "error"
    base = draw(st.sampled_from([n for n in STATES if n != "error"]))
    built = draw(built_flows(base))
    if draw(st.booleans()):
        with pytest.raises(RemoteProtocolError):
            built.flow.receive(Message("TEXT"))
    else:
        with pytest.raises(LocalProtocolError):
            built.flow.pay(0)  # wrong state, wrong side or bad amount: always refused
    assert built.flow.state is S.ERROR
    return built


# ----------------------------------------------------------------- inputs


def values() -> st.SearchStrategy[object]:
    """Credits and amounts: mostly in range, plus every kind of wrong value."""
    return st.one_of(
        st.integers(-2, 8),
        st.sampled_from([MISSING, "3", True, False, None, 1.5, [1]]),
    )


MESSAGE_KINDS = ["BOT", "PAY", "DAT", "EOT", "unknown", "form", "label"]
CALL_NAMES = ["send_bot", "accept", "reject", "send_dat", "pay", "send_eot"]


@st.composite
def messages(draw: st.DrawFn, shape: str) -> tuple[Message, dict[str, Any] | None]:
    """A message of ``shape`` and its flow object (None if it is no valid flow message)."""
    payload = tuple(draw(st.lists(st.binary(max_size=4), max_size=2)))
    if shape == "form":
        form = draw(st.sampled_from(["TEXT", "FLO", "flow", "ZRE"]))
        return Message(form, '{"flow": "DAT"}', payload=payload), None
    if shape == "label":
        label = draw(st.sampled_from(["", "not json", "[]", '{"flow": 1}', '{"x": "DAT"}']))
        return Message(FLOW_FORM, label, payload=payload), None
    kind = draw(st.sampled_from(["XYZ", "bot", "", "DATA"])) if shape == "unknown" else shape
    obj: dict[str, Any] = {"flow": kind}
    if kind in ("BOT", "bot"):
        direction = draw(st.sampled_from(["extract", "inject", "sideways", None, MISSING]))
        if direction != MISSING:
            obj["direction"] = direction
    if kind in ("BOT", "PAY", "bot"):
        credit = draw(values())
        if credit != MISSING:
            obj["credit"] = credit
    if draw(st.booleans()):
        obj["extra"] = draw(st.sampled_from([1, "x", [None], {"a": 1}]))
    msg = Message(FLOW_FORM, json.dumps(obj), seqno=draw(st.integers(0, 9)), payload=payload)
    return decode_frames(encode_frames(msg)), obj


@st.composite
def call_args(draw: st.DrawFn, name: str) -> tuple[Any, ...]:
    if name == "send_bot":
        direction = draw(st.sampled_from(["extract", "inject", "sideways"]))
        return (direction, draw(values()))
    if name in ("accept", "pay"):
        value = draw(st.one_of(st.none(), values()))
        return (None if value == MISSING else value,)
    return ()


# ----------------------------------------------------------------- (a) the walk


@pytest.mark.parametrize("shape", MESSAGE_KINDS)
@pytest.mark.parametrize("state", STATES)
@SETTINGS
@given(data=st.data())
def test_every_state_every_message(state: str, shape: str, data: st.DataObject) -> None:
    built = data.draw(built_flows(state), label="flow")
    flow = built.flow
    msg, obj = data.draw(messages(shape), label="message")
    before = snapshot(flow, built.offered)

    try:
        event: Event | None = flow.receive(msg)
    except ProtocolError as e:
        event = None
        error: ProtocolError | None = e
    else:
        error = None

    if before.state is S.ERROR:
        assert isinstance(error, LocalProtocolError)
        assert flow.state is S.ERROR
        return
    entry = None if obj is None else RECEIVE.get((before.state, obj["flow"]))
    failure = None
    if entry is not None and obj is not None:
        failure = receive_guard(before, obj["flow"], obj)
    if entry is None or failure is not None:
        expected_error = failure or RemoteProtocolError
        assert isinstance(error, expected_error), (before, obj, error)
        assert not isinstance(error, LocalProtocolError)
        assert flow.state is S.ERROR
        return

    assert error is None, (before, obj, error)
    assert obj is not None
    target, event_type = entry
    assert isinstance(event, event_type)
    assert flow.state is target
    assert flow.sent == before.sent  # receiving never takes a seqno
    extras = {k: v for k, v in obj.items() if k not in ("flow", "direction", "credit")}
    assert dict(event.attrs) == extras
    if isinstance(event, Data):
        assert flow.credit == before.credit + 1
        assert event.message.payload == msg.payload
    elif isinstance(event, Credit):
        assert event.amount == obj["credit"]
        assert flow.credit == before.credit + obj["credit"]
    elif isinstance(event, BotReceived):
        assert (event.direction.value, event.credit) == (obj["direction"], obj["credit"])
        assert dict(flow.peer_attrs) == extras
        if before.role is Role.CLIENT:
            assert flow.total_credit == obj["credit"]
            assert flow.credit == (0 if flow.is_giver else obj["credit"])
        else:
            assert flow.direction is event.direction.reverse
    elif isinstance(event, EotReceived):
        assert event.echo is (before.state is S.EOT_SENT)
        assert event.payload == msg.payload
    else:
        assert isinstance(event, Rejected)


@pytest.mark.parametrize("name", CALL_NAMES)
@pytest.mark.parametrize("state", STATES)
@SETTINGS
@given(data=st.data())
def test_every_state_every_call(state: str, name: str, data: st.DataObject) -> None:
    built = data.draw(built_flows(state), label="flow")
    flow = built.flow
    args = data.draw(call_args(name), label="args")
    before = snapshot(flow, built.offered)

    try:
        out: Message | None = getattr(flow, name)(*args)
    except ProtocolError as e:
        out = None
        error: ProtocolError | None = e
    else:
        error = None

    target = CALLS.get((name, before.state))
    if target is None or not call_guard(before, name, args):
        assert isinstance(error, LocalProtocolError), (before, name, args, out)
        assert flow.state is S.ERROR
        assert flow.sent == before.sent
        return

    assert error is None, (before, name, args, error)
    assert out is not None
    assert flow.state is target
    assert (out.form, out.origin, out.seqno) == (FLOW_FORM, flow.origin, before.sent)
    assert flow.sent == before.sent + 1
    obj = parse_flow_label(out.label)
    if name == "send_dat":
        assert obj["flow"] == "DAT"
        assert flow.credit == before.credit - 1
    elif name == "pay":
        paid = before.credit if args[0] is None else args[0]
        assert dict(obj) == {"flow": "PAY", "credit": paid}
        assert flow.credit == before.credit - paid
    elif name == "accept":
        agreed = before.offered if args[0] is None else args[0]
        assert obj["credit"] == agreed == flow.total_credit
        assert flow.credit == (0 if flow.is_giver else agreed)
    elif name == "send_bot":
        assert dict(obj) == {"flow": "BOT", "direction": args[0], "credit": args[1]}
    else:
        assert obj["flow"] == "EOT"


# ------------------------------------------------------------ (b) credit invariant

ACTIONS = ["pay"] * 6 + ["dat"] * 6 + ["to_giver"] * 5 + ["to_taker"] * 5
ACTIONS += ["eot_giver", "eot_taker"]


def _in_flight(queue: deque[list[bytes]], kind: str) -> int:
    total = 0
    for frames in queue:
        obj = decode_frames(frames).flow_object
        if obj["flow"] == kind:
            total += obj["credit"] if kind == "PAY" else 1
    return total


@settings(max_examples=300, deadline=None)
@given(
    client_direction=st.sampled_from([EXTRACT, INJECT]),
    offer=st.integers(1, 8),
    lower=st.integers(0, 7),
    schedule=st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.one_of(st.none(), st.integers(-1, 10))),
        max_size=80,
    ),
)
def test_credit_invariant(
    client_direction: Direction,
    offer: int,
    lower: int,
    schedule: list[tuple[str, int | None]],
) -> None:
    pair = FlowPair()
    total = max(1, offer - lower)
    pair.handshake(client_direction, offer, total)
    giver = pair.client if pair.client.is_giver else pair.server
    taker = pair.server if giver is pair.client else pair.client
    to_taker: deque[list[bytes]] = deque()  # DAT and EOT, FIFO like a ZeroMQ pipe
    to_giver: deque[list[bytes]] = deque()  # PAY and EOT
    paid_sent = paid_received = 0
    payloads_received: list[bytes] = []
    eot_sent: set[str] = set()

    def check() -> None:
        dats = _in_flight(to_taker, "DAT")
        pays = _in_flight(to_giver, "PAY")
        assert giver.credit + dats + taker.credit + pays == total
        assert giver.credit >= 0
        assert taker.credit >= 0
        assert giver.dats_sent <= paid_received <= paid_sent
        assert taker.dats_received + dats == giver.dats_sent
        assert giver.state is not S.ERROR
        assert taker.state is not S.ERROR

    def attempt(flow: Flow, call: Callable[[Flow], Message], valid: bool) -> Message | None:
        """Make the call if the model says it is legal; else prove it is refused."""
        if valid:
            return call(flow)
        trial = copy.copy(flow)
        before = (trial.credit, trial.sent, trial.dats_sent)
        with pytest.raises(LocalProtocolError):
            call(trial)
        assert trial.state is S.ERROR
        assert (trial.credit, trial.sent, trial.dats_sent) == before
        return None

    def deliver(queue: deque[list[bytes]], receiver: Flow) -> Event:
        nonlocal paid_received
        event = receiver.receive(decode_frames(queue.popleft()))
        if isinstance(event, Credit):
            paid_received += event.amount
        elif isinstance(event, Data):
            payloads_received.append(event.message.payload[0])
        return event

    check()
    for action, arg in schedule:
        if action == "pay":
            n = taker.credit if arg is None else arg
            ok = taker.state is S.READY and 1 <= n <= taker.credit
            msg = attempt(taker, lambda f, a=arg: f.pay(a), ok)
            if msg is not None:
                paid_sent += n
                to_giver.append(encode_frames(msg))
        elif action == "dat":
            ok = giver.state is S.READY and giver.credit > 0
            body = b"%d" % giver.dats_sent
            msg = attempt(giver, lambda f, b=body: f.send_dat((b,)), ok)
            if msg is not None:
                to_taker.append(encode_frames(msg))
        elif action in ("eot_giver", "eot_taker"):
            flow, queue = (giver, to_taker) if action == "eot_giver" else (taker, to_giver)
            ok = flow.state in (S.READY, S.EOT_RECEIVED)
            msg = attempt(flow, lambda f: f.send_eot(), ok)
            if msg is not None:
                eot_sent.add(action)
                queue.append(encode_frames(msg))
        elif action == "to_giver" and to_giver:
            deliver(to_giver, giver)
        elif action == "to_taker" and to_taker:
            deliver(to_taker, taker)
        check()

    # Drain the wire; whoever got an EOT echoes it, as an application must.
    while True:
        for flow, queue in ((giver, to_taker), (taker, to_giver)):
            if flow.state is S.EOT_RECEIVED:
                queue.append(encode_frames(flow.send_eot()))
        if not (to_giver or to_taker):
            break
        if to_giver:
            deliver(to_giver, giver)
        if to_taker:
            deliver(to_taker, taker)
        check()

    assert giver.credit + taker.credit == total
    assert payloads_received == [b"%d" % i for i in range(giver.dats_sent)]
    if eot_sent:
        assert giver.state is taker.state is S.CLOSED
    else:
        assert giver.state is taker.state is S.READY
