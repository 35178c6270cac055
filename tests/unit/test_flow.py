"""Unit tests for the ZIO flow state machine (zio_spark.protocol.flow).

Specs: /work/shared/specs/zio-flow.txt and zio-wire.md ("Flow behaviour of the
reference"). The in-memory :class:`FlowPair` stands in for the network; messages that
the peer sends by hand are built as :class:`Message` objects with a JSON label, the way
a foreign (C++ or Python reference) peer would put them on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

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
    Flow,
    FlowKind,
    FlowPair,
    FlowState,
    ProfileBot,
    ProfileDat,
    Rejected,
    Role,
    dat_profile,
    pay_ack,
    profile_bot,
)
from zio_spark.protocol.message import (
    FLOW_FORM,
    Message,
    decode_frames,
    encode_frames,
    parse_flow_label,
)

EXTRACT = Direction.EXTRACT
INJECT = Direction.INJECT
_MISSING = object()


# ---------------------------------------------------------------------------- helpers


def flow_msg(
    obj: Mapping[str, Any] | str, *, payload: tuple[bytes, ...] = (), form: str = FLOW_FORM
) -> Message:
    """A message as a peer would send it; ``obj`` is the flow object or a raw label."""
    label = obj if isinstance(obj, str) else json.dumps(dict(obj))
    return Message(form, label, payload=payload)


def bot(direction: object = _MISSING, credit: object = _MISSING, **extra: Any) -> Message:
    obj: dict[str, Any] = {"flow": "BOT"}
    if direction is not _MISSING:
        obj["direction"] = direction
    if credit is not _MISSING:
        obj["credit"] = credit
    obj.update(extra)
    return flow_msg(obj)


def pay_msg(credit: object = _MISSING, **extra: Any) -> Message:
    obj: dict[str, Any] = {"flow": "PAY"}
    if credit is not _MISSING:
        obj["credit"] = credit
    obj.update(extra)
    return flow_msg(obj)


DAT = flow_msg({"flow": "DAT"})
EOT = flow_msg({"flow": "EOT"})


def wire(msg: Message) -> Message:
    """Through the multipart codec and back, as the transport would."""
    return decode_frames(encode_frames(msg))


def obj_of(msg: Message) -> dict[str, Any]:
    return dict(parse_flow_label(msg.label))


def ready_pair(
    client_direction: Direction = EXTRACT, offer: int = 4, accept: int | None = None
) -> FlowPair:
    pair = FlowPair()
    pair.handshake(client_direction, offer, accept)
    return pair


def roles(pair: FlowPair) -> tuple[Flow, Flow]:
    """(giver, taker) of a ready pair."""
    if pair.client.is_giver:
        return pair.client, pair.server
    return pair.server, pair.client


def send(pair: FlowPair, sender: Flow, msg: Message) -> Any:
    """Deliver ``msg`` from ``sender`` to the other side of ``pair``."""
    return pair.to_server(msg) if sender is pair.client else pair.to_client(msg)


def server_with_bot(direction: str = "extract", offer: int = 4) -> Flow:
    server = Flow(Role.SERVER)
    server.receive(bot(direction, offer))
    return server


def client_bot_sent(direction: Direction = EXTRACT, offer: int = 4) -> Flow:
    client = Flow(Role.CLIENT)
    client.send_bot(direction, offer)
    return client


def assert_error(
    flow: Flow,
    call: Callable[[], object],
    exc: type[ProtocolError],
    field: str | None = None,
    *,
    exact: bool = False,
) -> ProtocolError:
    with pytest.raises(exc) as info:
        call()
    if exact:
        assert type(info.value) is exc
    if field is not None:
        assert info.value.field == field
    assert flow.state is FlowState.ERROR
    return info.value


# -------------------------------------------------------------------------- enums


def test_enums_keep_spec_names() -> None:
    assert [k.value for k in FlowKind] == ["BOT", "PAY", "DAT", "EOT"]
    assert EXTRACT.value == "extract"
    assert INJECT.value == "inject"
    assert EXTRACT.reverse is INJECT
    assert INJECT.reverse is EXTRACT


# ---------------------------------------------------------------------- handshake


@pytest.mark.parametrize("client_direction", [EXTRACT, INJECT])
@pytest.mark.parametrize("accept", [None, 4, 1])
def test_handshake(client_direction: Direction, accept: int | None) -> None:
    pair = FlowPair()
    client, server = pair.client, pair.server
    bot_msg = client.send_bot(client_direction, 4)
    assert client.state is FlowState.BOT_SENT
    assert obj_of(bot_msg) == {"flow": "BOT", "direction": client_direction.value, "credit": 4}

    offer = pair.to_server(bot_msg)
    assert offer == BotReceived(client_direction, 4, {})
    assert server.state is FlowState.BOT_RECEIVED
    assert server.direction is client_direction.reverse

    answer = server.accept(accept)
    agreed = 4 if accept is None else accept
    assert obj_of(answer) == {
        "flow": "BOT",
        "direction": client_direction.reverse.value,
        "credit": agreed,
    }
    agreement = pair.to_client(answer)
    assert agreement == BotReceived(client_direction.reverse, agreed, {})

    for flow in (client, server):
        assert flow.state is FlowState.READY
        assert flow.total_credit == agreed
    assert client.direction is client_direction
    assert client.is_giver is (client_direction is EXTRACT)
    assert server.is_giver is (client_direction is INJECT)
    giver, taker = roles(pair)
    assert giver.credit == 0
    assert taker.credit == agreed
    assert taker.outstanding == 0


def test_server_may_not_raise_the_credit() -> None:
    client = client_bot_sent(EXTRACT, 3)
    err = assert_error(client, lambda: client.receive(bot("inject", 5)), FlowControlError, "credit")
    assert isinstance(err, FlowControlError)
    assert err.credit == 5
    assert err.value == 5


@pytest.mark.parametrize("direction", ["extract", "sideways", None, _MISSING])
def test_server_bot_must_reverse_direction(direction: object) -> None:
    client = client_bot_sent(EXTRACT, 3)
    assert_error(
        client,
        lambda: client.receive(bot(direction, 2)),
        RemoteProtocolError,
        "direction",
        exact=True,
    )


@pytest.mark.parametrize("credit", [0, -1, "2", True, None, 1.5, _MISSING])
def test_server_bot_bad_credit(credit: object) -> None:
    client = client_bot_sent(INJECT, 3)
    assert_error(client, lambda: client.receive(bot("extract", credit)), FlowControlError, "credit")


def test_server_rejects_with_eot() -> None:
    pair = FlowPair()
    pair.to_server(pair.client.send_bot(INJECT, 3))
    eot = pair.server.reject({"reason": "busy"})
    assert pair.server.state is FlowState.CLOSED
    assert obj_of(eot) == {"flow": "EOT", "reason": "busy"}
    assert eot.seqno == 0
    event = pair.to_client(eot)
    assert event == Rejected({"reason": "busy"})
    assert pair.client.state is FlowState.CLOSED


def test_reject_without_attrs() -> None:
    pair = FlowPair()
    pair.to_server(pair.client.send_bot(EXTRACT, 3))
    event = pair.to_client(pair.server.reject())
    assert isinstance(event, Rejected)
    assert event.attrs == {}


@pytest.mark.parametrize("credit", [0, 5, -1, True, False, "2", 1.5])
def test_accept_bad_credit(credit: Any) -> None:
    server = server_with_bot("extract", 4)
    assert_error(server, lambda: server.accept(credit), LocalProtocolError, "credit")


@pytest.mark.parametrize(
    ("obj", "exc", "field"),
    [
        ({"flow": "BOT", "credit": 3}, RemoteProtocolError, "direction"),
        ({"flow": "BOT", "direction": "sideways", "credit": 3}, RemoteProtocolError, "direction"),
        ({"flow": "BOT", "direction": "EXTRACT", "credit": 3}, RemoteProtocolError, "direction"),
        ({"flow": "BOT", "direction": None, "credit": 3}, RemoteProtocolError, "direction"),
        ({"flow": "BOT", "direction": "inject", "credit": 0}, FlowControlError, "credit"),
        ({"flow": "BOT", "direction": "inject", "credit": -1}, FlowControlError, "credit"),
        ({"flow": "BOT", "direction": "inject", "credit": "5"}, FlowControlError, "credit"),
        ({"flow": "BOT", "direction": "inject", "credit": True}, FlowControlError, "credit"),
        ({"flow": "BOT", "direction": "inject", "credit": 2.0}, FlowControlError, "credit"),
        ({"flow": "BOT", "direction": "inject", "credit": None}, FlowControlError, "credit"),
        ({"flow": "BOT", "direction": "inject"}, FlowControlError, "credit"),
    ],
)
def test_bad_client_bot(obj: dict[str, Any], exc: type[ProtocolError], field: str) -> None:
    server = Flow(Role.SERVER)
    err = assert_error(server, lambda: server.receive(wire(flow_msg(obj))), exc, field)
    if exc is RemoteProtocolError:
        assert not isinstance(err, FlowControlError)


def test_foreign_compact_json_labels() -> None:
    # The C++ reference writes compact JSON with sorted keys: parse, never compare text.
    server = Flow(Role.SERVER)
    event = server.receive(wire(flow_msg('{"credit":3,"direction":"inject","flow":"BOT"}')))
    assert event == BotReceived(INJECT, 3, {})
    server.accept()
    assert server.is_giver
    assert server.receive(wire(flow_msg('{"credit":2,"flow":"PAY"}'))) == Credit(2, {})
    dat = server.send_dat((b"x",))
    assert dat.payload == (b"x",)
    assert server.receive(wire(flow_msg('{"flow":"EOT"}'))) == EotReceived({}, (), echo=False)

    client = client_bot_sent(INJECT, 3)
    event = client.receive(wire(flow_msg('{"credit":2,"direction":"extract","flow":"BOT"}')))
    assert event == BotReceived(EXTRACT, 2, {})
    client.pay(1)
    data = client.receive(wire(flow_msg('{"flow":"DAT"}', payload=(b"a", b"b"))))
    assert isinstance(data, Data)
    assert data.message.payload == (b"a", b"b")
    assert data.attrs == {}


def test_extra_attributes_pass_through() -> None:
    pair = FlowPair()
    client_attrs = {"stream": "s1", "resume": 7, "ack": True, "x": [1, {"y": None}]}
    server_attrs = {"producer": "p-1", "ack": True}
    msg = pair.client.send_bot(INJECT, 5, client_attrs)
    assert obj_of(msg) == {"flow": "BOT", "direction": "inject", "credit": 5, **client_attrs}
    offer = pair.to_server(msg)
    assert isinstance(offer, BotReceived)
    assert dict(offer.attrs) == client_attrs
    assert dict(pair.server.peer_attrs) == client_attrs
    agreement = pair.to_client(pair.server.accept(3, server_attrs))
    assert isinstance(agreement, BotReceived)
    assert dict(agreement.attrs) == server_attrs
    assert dict(pair.client.peer_attrs) == server_attrs
    # Read-only views: a handler cannot corrupt the flow's record of the peer.
    with pytest.raises(TypeError):
        pair.client.peer_attrs["ack"] = False  # type: ignore[index]


def test_flowpair_handshake_with_attrs() -> None:
    pair = FlowPair(client_origin=11, server_origin=12)
    pair.handshake(EXTRACT, 2, None, {"stream": "a"}, {"producer": "b"})
    assert pair.client.origin == 11
    assert pair.server.origin == 12
    assert dict(pair.server.peer_attrs) == {"stream": "a"}
    assert dict(pair.client.peer_attrs) == {"producer": "b"}


def test_peer_attrs_empty_without_extras() -> None:
    pair = ready_pair()
    assert pair.client.peer_attrs == {}
    assert pair.server.peer_attrs == {}


def _reserved_cases() -> list[tuple[str, Callable[[], tuple[Flow, Callable[[], object]]]]]:
    def send_bot() -> tuple[Flow, Callable[[], object]]:
        f = Flow(Role.CLIENT)
        return f, lambda: f.send_bot(EXTRACT, 2, {"credit": 9})

    def accept() -> tuple[Flow, Callable[[], object]]:
        f = server_with_bot()
        return f, lambda: f.accept(None, {"direction": "extract"})

    def reject() -> tuple[Flow, Callable[[], object]]:
        f = server_with_bot()
        return f, lambda: f.reject({"flow": "BOT"})

    def send_dat() -> tuple[Flow, Callable[[], object]]:
        pair = ready_pair(EXTRACT)
        pair.to_client(pair.server.pay())
        return pair.client, lambda: pair.client.send_dat((), {"flow": "PAY"})

    def pay() -> tuple[Flow, Callable[[], object]]:
        pair = ready_pair(EXTRACT)
        return pair.server, lambda: pair.server.pay(1, {"credit": 3})

    def send_eot() -> tuple[Flow, Callable[[], object]]:
        pair = ready_pair(EXTRACT)
        return pair.client, lambda: pair.client.send_eot({"direction": "inject"})

    return [
        ("credit", send_bot),
        ("direction", accept),
        ("flow", reject),
        ("flow", send_dat),
        ("credit", pay),
        ("direction", send_eot),
    ]


@pytest.mark.parametrize(("key", "make"), _reserved_cases())
def test_reserved_attribute_is_local_error(
    key: str, make: Callable[[], tuple[Flow, Callable[[], object]]]
) -> None:
    flow, call = make()
    sent_before = flow.sent
    assert_error(flow, call, LocalProtocolError, key)
    assert flow.sent == sent_before


def test_unserialisable_attrs_are_local_error() -> None:
    pair = ready_pair(EXTRACT)
    assert_error(pair.client, lambda: pair.client.send_eot({"when": object()}), LocalProtocolError)


def test_send_bot_misuse() -> None:
    server = Flow(Role.SERVER)
    assert_error(server, lambda: server.send_bot(EXTRACT, 2), LocalProtocolError)
    client = client_bot_sent()
    assert_error(client, lambda: client.send_bot(EXTRACT, 2), LocalProtocolError, "state")


@pytest.mark.parametrize("credit", [0, -1, True, "3", 2.0, None])
def test_send_bot_bad_credit(credit: Any) -> None:
    client = Flow(Role.CLIENT)
    assert_error(client, lambda: client.send_bot(EXTRACT, credit), LocalProtocolError, "credit")


@pytest.mark.parametrize("direction", ["sideways", "EXTRACT", None, 1])
def test_send_bot_bad_direction(direction: Any) -> None:
    client = Flow(Role.CLIENT)
    assert_error(client, lambda: client.send_bot(direction, 2), LocalProtocolError, "direction")


def test_send_bot_accepts_direction_text() -> None:
    client = Flow(Role.CLIENT)
    client.send_bot("inject", 2)  # type: ignore[arg-type]
    assert client.direction is INJECT


@pytest.mark.parametrize("method", ["accept", "reject"])
@pytest.mark.parametrize("make", [lambda: Flow(Role.SERVER), lambda: ready_pair().server])
def test_accept_reject_need_pending_bot(method: str, make: Callable[[], Flow]) -> None:
    flow = make()
    assert_error(flow, getattr(flow, method), LocalProtocolError, "state")


# ------------------------------------------------------------------------- credit


@pytest.mark.parametrize("client_direction", [EXTRACT, INJECT])
def test_pay_defaults_to_all_held(client_direction: Direction) -> None:
    pair = ready_pair(client_direction, 5, 3)
    giver, taker = roles(pair)
    assert (giver.credit, taker.credit) == (0, 3)
    msg = taker.pay()
    assert obj_of(msg) == {"flow": "PAY", "credit": 3}
    assert taker.credit == 0
    assert taker.outstanding == 3
    assert send(pair, taker, msg) == Credit(3, {})
    assert giver.credit == 3


def test_partial_pays_and_dats_keep_the_books() -> None:
    pair = ready_pair(EXTRACT, 4)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay(1))
    send(pair, taker, taker.pay(2))
    assert (giver.credit, taker.credit) == (3, 1)
    for i in range(3):
        event = send(pair, giver, giver.send_dat((b"%d" % i,)))
        assert isinstance(event, Data)
        assert event.message.payload == (b"%d" % i,)
    assert (giver.credit, taker.credit) == (0, 4)
    assert (giver.dats_sent, taker.dats_received) == (3, 3)


@pytest.mark.parametrize("amount", [5, 0, -1, True, "1", 1.0])
def test_pay_beyond_held_or_invalid(amount: Any) -> None:
    pair = ready_pair(EXTRACT, 4)
    taker = pair.server
    err = assert_error(taker, lambda: taker.pay(amount), LocalProtocolError, "credit")
    assert err.value == amount


def test_pay_with_nothing_held() -> None:
    pair = ready_pair(INJECT, 2)
    taker = pair.client
    taker.pay()
    assert_error(taker, taker.pay, LocalProtocolError, "credit")


def test_giver_without_credit_cannot_send_dat() -> None:
    pair = ready_pair(EXTRACT, 2)
    giver = pair.client
    err = assert_error(giver, giver.send_dat, LocalProtocolError, "credit")
    assert err.value == 0

    pair = ready_pair(EXTRACT, 2)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay(1))
    giver.send_dat()
    assert_error(giver, giver.send_dat, LocalProtocolError, "credit")


def test_dat_without_outstanding_credit() -> None:
    pair = ready_pair(INJECT, 2)
    taker = pair.client
    err = assert_error(taker, lambda: taker.receive(DAT), FlowControlError, "flow")
    assert isinstance(err, FlowControlError)
    assert err.credit == 0

    pair = ready_pair(INJECT, 2)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay(1))
    send(pair, giver, giver.send_dat())
    assert_error(taker, lambda: taker.receive(DAT), FlowControlError)


def test_pay_beyond_total() -> None:
    pair = ready_pair(EXTRACT, 3)
    giver = pair.client
    err = assert_error(giver, lambda: giver.receive(pay_msg(4)), FlowControlError, "credit")
    assert isinstance(err, FlowControlError)
    assert err.credit == 0
    assert err.value == 4

    pair = ready_pair(EXTRACT, 3)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay())
    err = assert_error(giver, lambda: giver.receive(pay_msg(1)), FlowControlError, "credit")
    assert isinstance(err, FlowControlError)
    assert err.credit == 3


@pytest.mark.parametrize("credit", [0, -2, "2", True, False, 1.5, None, _MISSING])
def test_pay_bad_credit(credit: object) -> None:
    pair = ready_pair(INJECT, 3)
    giver = pair.server
    err = assert_error(giver, lambda: giver.receive(pay_msg(credit)), FlowControlError, "credit")
    assert err.value == (None if credit is _MISSING else credit)


def test_wrong_direction_messages_are_remote_errors() -> None:
    pair = ready_pair(EXTRACT, 3)
    giver, taker = roles(pair)
    assert_error(giver, lambda: giver.receive(DAT), RemoteProtocolError, "flow", exact=True)
    assert_error(taker, lambda: taker.receive(pay_msg(1)), RemoteProtocolError, "flow", exact=True)


def test_wrong_role_calls_are_local_errors() -> None:
    pair = ready_pair(INJECT, 3)
    giver, taker = roles(pair)
    assert_error(taker, taker.send_dat, LocalProtocolError, "direction")
    assert_error(giver, lambda: giver.pay(1), LocalProtocolError, "direction")


@pytest.mark.parametrize("msg", [DAT, pay_msg(1), EOT], ids=["DAT", "PAY", "EOT"])
def test_idle_server_needs_bot_first(msg: Message) -> None:
    server = Flow(Role.SERVER)
    assert_error(server, lambda: server.receive(msg), RemoteProtocolError, "flow")


@pytest.mark.parametrize(
    "msg", [bot("inject", 2), DAT, pay_msg(1), EOT], ids=["BOT", "DAT", "PAY", "EOT"]
)
def test_idle_client_accepts_nothing(msg: Message) -> None:
    client = Flow(Role.CLIENT)
    assert_error(client, lambda: client.receive(msg), RemoteProtocolError, "flow")


@pytest.mark.parametrize(
    "msg", [bot("inject", 2), DAT, pay_msg(1), EOT], ids=["BOT", "DAT", "PAY", "EOT"]
)
def test_server_awaiting_accept_accepts_nothing(msg: Message) -> None:
    server = server_with_bot()
    assert_error(server, lambda: server.receive(msg), RemoteProtocolError, "flow")


@pytest.mark.parametrize("msg", [DAT, pay_msg(1)], ids=["DAT", "PAY"])
def test_client_awaiting_bot_accepts_no_transfer(msg: Message) -> None:
    client = client_bot_sent()
    assert_error(client, lambda: client.receive(msg), RemoteProtocolError, "flow")


@pytest.mark.parametrize("side", ["client", "server"])
def test_duplicate_bot_in_ready(side: str) -> None:
    pair = ready_pair(EXTRACT, 3)
    flow: Flow = getattr(pair, side)
    direction = "inject" if flow.is_giver else "extract"
    err = assert_error(flow, lambda: flow.receive(bot(direction, 3)), RemoteProtocolError, "flow")
    assert err.value == "BOT"


@pytest.mark.parametrize("form", ["TEXT", "FLO", "flow", ""])
def test_non_flow_form(form: str) -> None:
    pair = ready_pair()
    msg = Message(form, '{"flow": "DAT"}')
    err = assert_error(pair.server, lambda: pair.server.receive(msg), RemoteProtocolError, "form")
    assert err.value == form


def test_non_flow_form_through_codec() -> None:
    server = Flow(Role.SERVER)
    msg = wire(Message("TEXT", "hello", level=4))
    assert_error(server, lambda: server.receive(msg), RemoteProtocolError, "form")


def test_unknown_flow_type() -> None:
    pair = ready_pair()
    msg = wire(flow_msg({"flow": "XYZ"}))
    err = assert_error(pair.client, lambda: pair.client.receive(msg), RemoteProtocolError, "flow")
    assert err.value == "XYZ"


@pytest.mark.parametrize(
    ("label", "field"),
    [("not json", "label"), ("[1, 2]", "label"), ('{"flow": 3}', "flow"), ("{}", "flow")],
)
def test_bad_flow_label(label: str, field: str) -> None:
    server = Flow(Role.SERVER)
    assert_error(server, lambda: server.receive(flow_msg(label)), RemoteProtocolError, field)


# -------------------------------------------------------------------------- ERROR


def _error_makers() -> list[tuple[str, Callable[[], Flow]]]:
    def remote_form() -> Flow:
        f = Flow(Role.SERVER)
        with pytest.raises(RemoteProtocolError):
            f.receive(Message("TEXT"))
        return f

    def flow_control() -> Flow:
        pair = ready_pair(EXTRACT)
        with pytest.raises(FlowControlError):
            pair.server.receive(DAT)
        return pair.server

    def bad_server_bot() -> Flow:
        f = client_bot_sent(EXTRACT, 2)
        with pytest.raises(RemoteProtocolError):
            f.receive(bot("extract", 2))
        return f

    def local_pay() -> Flow:
        pair = ready_pair(EXTRACT)
        with pytest.raises(LocalProtocolError):
            pair.server.pay(99)
        return pair.server

    def local_dat() -> Flow:
        pair = ready_pair(EXTRACT)
        with pytest.raises(LocalProtocolError):
            pair.client.send_dat()
        return pair.client

    def bad_accept() -> Flow:
        f = server_with_bot()
        with pytest.raises(LocalProtocolError):
            f.accept(0)
        return f

    def after_close() -> Flow:
        pair = ready_pair()
        pair.to_server(pair.client.send_eot())
        pair.to_client(pair.server.send_eot())
        with pytest.raises(RemoteProtocolError):
            pair.client.receive(EOT)
        return pair.client

    return [
        ("remote_form", remote_form),
        ("flow_control", flow_control),
        ("bad_server_bot", bad_server_bot),
        ("local_pay", local_pay),
        ("local_dat", local_dat),
        ("bad_accept", bad_accept),
        ("after_close", after_close),
    ]


_CALLS: list[tuple[str, Callable[[Flow], object]]] = [
    ("receive_dat", lambda f: f.receive(DAT)),
    ("receive_pay", lambda f: f.receive(pay_msg(1))),
    ("receive_bot", lambda f: f.receive(bot("extract", 1))),
    ("receive_eot", lambda f: f.receive(EOT)),
    ("receive_garbage", lambda f: f.receive(Message("TEXT"))),
    ("send_bot", lambda f: f.send_bot(EXTRACT, 1)),
    ("accept", lambda f: f.accept()),
    ("reject", lambda f: f.reject()),
    ("send_dat", lambda f: f.send_dat()),
    ("pay", lambda f: f.pay()),
    ("send_eot", lambda f: f.send_eot()),
]


@pytest.mark.parametrize("make", [pytest.param(m, id=name) for name, m in _error_makers()])
def test_error_state_is_terminal(make: Callable[[], Flow]) -> None:
    flow = make()
    assert flow.state is FlowState.ERROR
    sent = flow.sent
    for name, call in _CALLS:
        with pytest.raises(LocalProtocolError):
            call(flow)
        assert flow.state is FlowState.ERROR, name
    assert flow.sent == sent


# ---------------------------------------------------------------------------- EOT


@pytest.mark.parametrize("client_direction", [EXTRACT, INJECT])
def test_taker_initiated_eot_drains_dats(client_direction: Direction) -> None:
    pair = ready_pair(client_direction, 3)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay())
    in_flight = [giver.send_dat((b"%d" % i,)) for i in range(3)]

    eot = taker.send_eot()
    assert taker.state is FlowState.EOT_SENT
    # Draining: the taker still takes the DATs already on the wire, but sends no PAY.
    for i, msg in enumerate(in_flight):
        event = send(pair, giver, msg)
        assert isinstance(event, Data)
        assert event.message.payload == (b"%d" % i,)
        assert taker.state is FlowState.EOT_SENT
    assert send(pair, taker, eot) == EotReceived({}, (), echo=False)
    assert giver.state is FlowState.EOT_RECEIVED
    echo = giver.send_eot()
    assert giver.state is FlowState.CLOSED
    assert send(pair, giver, echo) == EotReceived({}, (), echo=True)
    assert taker.state is FlowState.CLOSED
    assert taker.credit == taker.total_credit


@pytest.mark.parametrize("client_direction", [EXTRACT, INJECT])
def test_giver_initiated_eot_drains_pays(client_direction: Direction) -> None:
    pair = ready_pair(client_direction, 4)
    giver, taker = roles(pair)
    pays = [taker.pay(1), taker.pay(2)]
    eot = giver.send_eot()
    assert giver.state is FlowState.EOT_SENT
    for msg, amount in zip(pays, (1, 2), strict=True):
        assert send(pair, taker, msg) == Credit(amount, {})
        assert giver.state is FlowState.EOT_SENT
    assert giver.credit == 3
    assert send(pair, giver, eot) == EotReceived({}, (), echo=False)
    assert send(pair, taker, taker.send_eot()) == EotReceived({}, (), echo=True)
    assert giver.state is taker.state is FlowState.CLOSED


def test_no_dat_or_pay_after_own_eot() -> None:
    # The peer gets our EOT first and would have to reject anything after it.
    pair = ready_pair(EXTRACT, 4)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay(2))
    giver.send_eot()
    assert_error(giver, giver.send_dat, LocalProtocolError, "state")

    pair = ready_pair(EXTRACT, 4)
    giver, taker = roles(pair)
    taker.send_eot()
    assert_error(taker, lambda: taker.pay(1), LocalProtocolError, "state")


def test_no_dat_or_pay_after_peer_eot() -> None:
    pair = ready_pair(EXTRACT, 4)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay(2))
    send(pair, taker, taker.send_eot())
    assert giver.state is FlowState.EOT_RECEIVED
    assert_error(giver, giver.send_dat, LocalProtocolError, "state")

    pair = ready_pair(EXTRACT, 4)
    giver, taker = roles(pair)
    send(pair, giver, giver.send_eot())
    assert_error(taker, lambda: taker.pay(1), LocalProtocolError, "state")


@pytest.mark.parametrize("client_direction", [EXTRACT, INJECT])
def test_simultaneous_eots_both_close(client_direction: Direction) -> None:
    pair = ready_pair(client_direction, 2)
    from_client = pair.client.send_eot({"side": "c"})
    from_server = pair.server.send_eot({"side": "s"})
    assert pair.to_server(from_client) == EotReceived({"side": "c"}, (), echo=True)
    assert pair.to_client(from_server) == EotReceived({"side": "s"}, (), echo=True)
    assert pair.client.state is pair.server.state is FlowState.CLOSED


def test_dat_after_peer_eot() -> None:
    taker = ready_pair(EXTRACT, 3).server
    taker.pay()
    taker.receive(EOT)
    assert taker.state is FlowState.EOT_RECEIVED
    assert_error(taker, lambda: taker.receive(DAT), RemoteProtocolError, "flow")


def test_pay_after_peer_eot() -> None:
    pair = ready_pair(EXTRACT, 3)
    giver = pair.client
    giver.receive(EOT)
    assert_error(giver, lambda: giver.receive(pay_msg(1)), RemoteProtocolError, "flow")


def test_eot_payload_and_attrs_pass_through() -> None:
    pair = ready_pair(INJECT, 3)
    eot = pair.client.send_eot({"reason": "done", "n": 3}, (b"last", b"words"))
    assert eot.payload == (b"last", b"words")
    assert obj_of(eot) == {"flow": "EOT", "reason": "done", "n": 3}
    event = pair.to_server(eot)
    assert event == EotReceived({"reason": "done", "n": 3}, (b"last", b"words"), echo=False)
    echo = pair.server.send_eot({"ok": True}, (b"bye",))
    assert pair.to_client(echo) == EotReceived({"ok": True}, (b"bye",), echo=True)


def test_eot_state_misuse() -> None:
    pair = ready_pair()
    pair.client.send_eot()
    assert_error(pair.client, pair.client.send_eot, LocalProtocolError, "state")

    pair = ready_pair()
    pair.to_server(pair.client.send_eot())
    pair.to_client(pair.server.send_eot())
    assert_error(pair.client, pair.client.send_eot, LocalProtocolError, "state")

    pair = ready_pair()
    pair.client.receive(EOT)
    assert_error(pair.client, lambda: pair.client.receive(EOT), RemoteProtocolError, "flow")

    client = Flow(Role.CLIENT)
    assert_error(client, client.send_eot, LocalProtocolError, "state")


@pytest.mark.parametrize("msg", [DAT, pay_msg(1), EOT, bot("inject", 1)])
def test_closed_accepts_nothing(msg: Message) -> None:
    pair = FlowPair()
    pair.to_server(pair.client.send_bot(EXTRACT, 2))
    pair.to_client(pair.server.reject())
    assert pair.client.state is FlowState.CLOSED
    assert_error(pair.client, lambda: pair.client.receive(msg), RemoteProtocolError)


# -------------------------------------------------------------------------- seqno


def test_seqno_and_origin() -> None:
    pair = FlowPair(client_origin=7, server_origin=9)
    client, server = pair.client, pair.server
    sent: list[Message] = []

    def out(msg: Message) -> Message:
        sent.append(msg)
        return msg

    pair.to_server(out(client.send_bot(EXTRACT, 3)))
    pair.to_client(out(server.accept()))
    pair.to_client(out(server.pay(2)))
    data: list[Any] = [pair.to_server(out(client.send_dat((b"d",)))) for _ in range(2)]
    pair.to_client(out(server.pay(2)))
    pair.to_server(out(client.send_eot()))
    pair.to_client(out(server.send_eot()))

    client_msgs = [m for m in sent if m.origin == 7]
    server_msgs = [m for m in sent if m.origin == 9]
    assert [(obj_of(m)["flow"], m.seqno) for m in client_msgs] == [
        ("BOT", 0),
        ("DAT", 1),
        ("DAT", 2),
        ("EOT", 3),
    ]
    assert [(obj_of(m)["flow"], m.seqno) for m in server_msgs] == [
        ("BOT", 0),
        ("PAY", 1),
        ("PAY", 2),
        ("EOT", 3),
    ]
    assert len(client_msgs) + len(server_msgs) == len(sent)
    for m in sent:
        assert (m.form, m.level, m.granule) == (FLOW_FORM, 0, 0)
    # The coord survives the codec: the taker sees the giver's origin and seqno.
    assert all(isinstance(d, Data) for d in data)
    assert [(d.message.origin, d.message.seqno) for d in data] == [(7, 1), (7, 2)]
    assert (client.sent, server.sent) == (4, 4)


def test_incoming_seqnos_are_not_checked() -> None:
    pair = ready_pair(INJECT, 2)
    pair.client.pay()
    for seqno in (99, 3):
        event = pair.client.receive(Message(FLOW_FORM, '{"flow": "DAT"}', seqno=seqno))
        assert isinstance(event, Data)


def test_dat_labels() -> None:
    pair = ready_pair(EXTRACT, 2)
    giver, taker = roles(pair)
    send(pair, taker, taker.pay())
    plain = giver.send_dat((b"v",))
    assert plain.label == '{"flow": "DAT"}'  # the Python reference's json.dumps spacing
    tagged = giver.send_dat((b"v",), {"key": "k1"})
    assert obj_of(tagged) == {"flow": "DAT", "key": "k1"}
    assert send(pair, giver, plain) == Data(wire(plain), {})
    event = send(pair, giver, tagged)
    assert isinstance(event, Data)
    assert dict(event.attrs) == {"key": "k1"}


# ------------------------------------------------------------------------ profile


def test_profile_bot_defaults() -> None:
    assert profile_bot({}) == ProfileBot(None, None, None, False)


def test_profile_bot_valid() -> None:
    attrs = {"stream": "s", "producer": "p", "resume": 0, "ack": True, "other": 1}
    assert profile_bot(attrs) == ProfileBot("s", "p", 0, True)
    assert profile_bot({"resume": 2**63, "ack": False}).resume == 2**63


def test_profile_bot_from_the_wire() -> None:
    pair = FlowPair()
    event = pair.to_server(
        pair.client.send_bot(INJECT, 4, {"stream": "s", "resume": 41, "ack": True})
    )
    assert isinstance(event, BotReceived)
    assert profile_bot(event.attrs) == ProfileBot("s", None, 41, True)


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"stream": 1}, "stream"),
        ({"stream": ["a"]}, "stream"),
        ({"producer": 2}, "producer"),
        ({"producer": {"id": "p"}}, "producer"),
        ({"resume": -1}, "resume"),
        ({"resume": "3"}, "resume"),
        ({"resume": True}, "resume"),
        ({"resume": 1.5}, "resume"),
        ({"ack": "true"}, "ack"),
        ({"ack": 1}, "ack"),
    ],
)
def test_profile_bot_invalid(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        profile_bot(attrs)
    assert info.value.field == field
    assert info.value.value == attrs[field]


@pytest.mark.parametrize("ack", [0, 41, 2**64 - 1])
def test_pay_ack_valid(ack: int) -> None:
    assert pay_ack({"ack": ack, "credit": 2}) == ack


def test_pay_ack_absent() -> None:
    assert pay_ack({}) is None


@pytest.mark.parametrize("ack", [-1, "3", True, 1.5])
def test_pay_ack_invalid(ack: object) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        pay_ack({"ack": ack})
    assert info.value.field == "ack"
    assert info.value.value == ack


def test_dat_profile_absent() -> None:
    assert dat_profile({}) == ProfileDat(None, None)
    assert dat_profile({"seq": 3, "other": "x"}) == ProfileDat(None, None)


@pytest.mark.parametrize(
    ("attrs", "want"),
    [
        ({"more": False}, ProfileDat(False, None)),
        ({"more": True}, ProfileDat(True, None)),
        ({"blocked_ms": 0}, ProfileDat(None, 0)),
        ({"blocked_ms": 2**63, "more": False}, ProfileDat(False, 2**63)),
    ],
)
def test_dat_profile_valid(attrs: dict[str, Any], want: ProfileDat) -> None:
    assert dat_profile(attrs) == want


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"more": "false"}, "more"),
        ({"more": 0}, "more"),
        ({"blocked_ms": -1}, "blocked_ms"),
        ({"blocked_ms": "5"}, "blocked_ms"),
        ({"blocked_ms": True}, "blocked_ms"),
        ({"blocked_ms": 1.5}, "blocked_ms"),
    ],
)
def test_dat_profile_invalid(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        dat_profile(attrs)
    assert info.value.field == field
    assert info.value.value == attrs[field]


def test_dat_profile_from_the_wire() -> None:
    pair = ready_pair(EXTRACT, 4)  # the client gives
    pair.to_client(pair.server.pay(2))
    event = pair.to_server(pair.client.send_dat((b"x",), {"more": False, "blocked_ms": 7}))
    assert isinstance(event, Data)
    assert dat_profile(event.attrs) == ProfileDat(False, 7)
    bare = pair.to_server(pair.client.send_dat((b"y",)))
    assert isinstance(bare, Data)
    assert dat_profile(bare.attrs) == ProfileDat(None, None)


def test_pay_ack_from_the_wire() -> None:
    pair = ready_pair(INJECT, 4)
    event = pair.to_server(pair.client.pay(2, {"ack": 41}))
    assert event == Credit(2, {"ack": 41})
    assert isinstance(event, Credit)
    assert pay_ack(event.attrs) == 41


# -- profile: ack-only PAY (credit 0 with "ack") ------------------------------------------


def test_ack_only_pay_with_zero_credit():
    pair = FlowPair()
    pair.handshake(Direction.INJECT, 2)
    pair.to_server(pair.client.pay())  # all credit out
    assert pair.client.credit == 0
    event = pair.to_server(pair.client.pay(0, {"ack": 5}))
    assert isinstance(event, Credit)
    assert (event.amount, pay_ack(event.attrs)) == (0, 5)
    assert pair.server.credit == 2
    assert pair.server.state is FlowState.READY


def test_zero_pay_without_ack_is_local_error():
    pair = FlowPair()
    pair.handshake(Direction.INJECT, 2)
    with pytest.raises(LocalProtocolError):
        pair.client.pay(0)
    assert pair.client.state is FlowState.ERROR


def test_zero_pay_without_ack_from_peer_is_flow_control_error():
    pair = FlowPair()
    pair.handshake(Direction.INJECT, 2)
    bad = Message(FLOW_FORM, '{"flow": "PAY", "credit": 0}')
    with pytest.raises(FlowControlError):
        pair.server.receive(bad)
    assert pair.server.state is FlowState.ERROR


def test_profile_bot_batch_and_encodings():
    prof = profile_bot({"batch": 7, "encoding": ["arrow", 3, "x"]})
    assert (prof.batch, prof.encodings) == (7, ("arrow", "x"))
    assert profile_bot({"encoding": "arrow"}).encodings == ("arrow",)
    assert profile_bot({"encoding": {"arrow": 1}}).encodings == ()
    for bad in (0, -1, "3", True, 1.5):
        with pytest.raises(RemoteProtocolError) as info:
            profile_bot({"batch": bad})
        assert info.value.field == "batch"
