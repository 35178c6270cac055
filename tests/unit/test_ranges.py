"""Range reads (protocol/ranges.py): negotiation, the request and answer codecs, the
giver's serving rule and the reader's checks, alone and over a flow pair.

The echoes are built as in test_negotiate.py: a reference server answers a client's BOT
with the client's own attributes, ``direction`` flipped.
"""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zio_spark.errors import (
    DataLossError,
    FlowControlError,
    LocalProtocolError,
    RemoteProtocolError,
)
from zio_spark.protocol.flow import BotReceived, Credit, Data, Direction, FlowPair
from zio_spark.protocol.message import FLOW_FORM, Message
from zio_spark.protocol.ranges import (
    CAPABILITY,
    INCARNATION_MAX,
    READ_CONTROL,
    READ_RANGE,
    SEQ_MAX,
    VERSION,
    Acked,
    AdmitRequest,
    Admitted,
    CommitRefused,
    CommitRequest,
    Done,
    HeldQuery,
    HeldReport,
    NotHeld,
    OtherIncarnation,
    RangeGiver,
    RangeReader,
    RangeRequest,
    RangeTerms,
    ReaderState,
    Records,
    UnknownProducer,
    Window,
    check_curve_key,
    check_incarnation,
    client_range_terms,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    forbid_requests,
    new_incarnation,
    offer_attrs,
    server_asks_range,
    server_read_mode,
    state_capability,
)

INC = "a1b2c3d4e5f60718"
"""The giver's incarnation in most tests (another one is OTHER)."""
OTHER = "ffee0011ccdd2233"
CAPABLE = RangeTerms(VERSION, "p1", INC)
INCARNATION_CHARS = string.ascii_letters + string.digits + "._-"
READER_BOT = {"direction": "inject", "credit": 8, **offer_attrs({"stream": "s"})}
GIVER_EXTRAS = state_capability({"producer": "p1", "stream": "s", "ack": True, "last": 9}, INC)


def echo(bot: dict[str, Any]) -> dict[str, Any]:
    flipped = {"inject": "extract", "extract": "inject"}[bot["direction"]]
    return {**bot, "direction": flipped}


# ---------------------------------------------------------------------- negotiation


def test_a_capable_giver_states_the_version_with_its_producer() -> None:
    assert GIVER_EXTRAS[CAPABILITY] == VERSION == 1
    reply = {"direction": "extract", "credit": 8, **GIVER_EXTRAS}
    terms = client_range_terms(READER_BOT, reply)
    assert terms == RangeTerms(1, "p1", INC) and terms.capable


def test_stating_the_capability_needs_a_producer_id() -> None:
    with pytest.raises(LocalProtocolError) as e:
        state_capability({"stream": "s"}, INC)
    assert e.value.field == "producer"


def test_an_echo_of_the_readers_bot_is_not_capable() -> None:
    terms = client_range_terms(READER_BOT, echo(READER_BOT))
    assert terms == RangeTerms() and not terms.capable


def test_an_echo_cannot_carry_the_capability_because_the_reader_never_sends_it() -> None:
    with pytest.raises(LocalProtocolError) as e:
        offer_attrs({"ranges": 1})
    assert e.value.field == CAPABILITY
    with pytest.raises(LocalProtocolError) as e:
        offer_attrs({"read": "stream"})
    assert e.value.field == "read"
    assert offer_attrs() == {"read": "range"}


def test_the_capability_without_an_own_producer_does_not_count() -> None:
    # A plain server that happened to state "ranges" but no profile (no own producer).
    assert not client_range_terms(READER_BOT, {**echo(READER_BOT), "ranges": 1}).capable
    # Its producer echoed (we sent one) is not its own statement either.
    sent = {**READER_BOT, "producer": "p1"}
    assert not client_range_terms(sent, {**echo(sent), "ranges": 1}).capable


def test_a_newer_version_is_spoken_as_ours() -> None:
    reply = {**GIVER_EXTRAS, "ranges": 7}
    assert client_range_terms(READER_BOT, reply).version == VERSION


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, "1", [1], {}])
def test_a_malformed_capability_is_a_remote_error(bad: object) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        client_range_terms(READER_BOT, {**GIVER_EXTRAS, "ranges": bad})
    assert e.value.field == "ranges" and e.value.value == bad


def test_a_server_sees_whether_the_client_opens_a_range_flow() -> None:
    assert server_asks_range(READER_BOT)
    assert not server_asks_range({"direction": "inject", "credit": 8, "ack": True})
    for bad in ("stream", "", 1, True, ["range"]):
        with pytest.raises(RemoteProtocolError) as e:
            server_asks_range({"read": bad})
        assert e.value.field == "read"


# --------------------------------------------------------------------- request codec


def test_requests_round_trip() -> None:
    for req in (
        RangeRequest(0, "p1", INC, 1, 1),
        RangeRequest(5, "p", INC, 10, 20),
        RangeRequest(SEQ_MAX, "é", INC, 0, SEQ_MAX),
        HeldQuery(3, "p2"),
    ):
        attrs = encode_request(req)
        assert decode_request(attrs) == req
    assert encode_request(RangeRequest(1, "p", INC, 2, 3)) == {
        "range": {"id": 1, "producer": "p", "incarnation": INC, "start": 2, "end": 3}
    }
    assert encode_request(HeldQuery(4, "p")) == {"held": {"id": 4, "producer": "p"}}


def test_a_pay_without_a_request_is_credit_only() -> None:
    assert decode_request({}) is None
    assert decode_request({"ack": 4}) is None


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"range": 1}, "range"),
        ({"range": [1, 2]}, "range"),
        ({"held": "p"}, "held"),
        ({"range": {"producer": "p", "start": 1, "end": 2}}, "range.id"),
        (
            {"range": {"id": -1, "producer": "p", "incarnation": INC, "start": 1, "end": 2}},
            "range.id",
        ),
        (
            {"range": {"id": True, "producer": "p", "incarnation": INC, "start": 1, "end": 2}},
            "range.id",
        ),
        ({"range": {"id": 1, "start": 1, "end": 2}}, "range.producer"),
        ({"range": {"id": 1, "producer": "", "start": 1, "end": 2}}, "range.producer"),
        ({"range": {"id": 1, "producer": 7, "start": 1, "end": 2}}, "range.producer"),
        ({"range": {"id": 1, "producer": "p", "incarnation": INC, "end": 2}}, "range.start"),
        (
            {"range": {"id": 1, "producer": "p", "incarnation": INC, "start": 1.5, "end": 2}},
            "range.start",
        ),
        (
            {"range": {"id": 1, "producer": "p", "incarnation": INC, "start": 1, "end": 2**63}},
            "range.end",
        ),
        (
            {"range": {"id": 1, "producer": "p", "incarnation": INC, "start": 3, "end": 2}},
            "range.start",
        ),
        ({"held": {"id": "1", "producer": "p"}}, "held.id"),
        ({"held": {"id": 1, "producer": None}}, "held.producer"),
        ({"range": {}, "held": {}}, "range"),
    ],
)
def test_malformed_requests_name_the_field(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_request(attrs)
    assert e.value.field == field
    assert field.split(".")[-1] in str(e.value)


def test_encoding_a_bad_request_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError) as e:
        encode_request(RangeRequest(1, "p", INC, 5, 4))
    assert e.value.field == "range.start"
    with pytest.raises(LocalProtocolError) as e:
        encode_request(HeldQuery(-1, "p"))
    assert e.value.field == "held.id"


def test_requests_on_a_flow_without_range_reads_are_refused() -> None:
    forbid_requests({"ack": 3})
    for key in ("range", "held"):
        with pytest.raises(RemoteProtocolError) as e:
            forbid_requests({key: {}})
        assert e.value.field == key


# ----------------------------------------------------------------------- reply codec


def test_replies_round_trip() -> None:
    for reply in (
        Done(1, 4, 9),
        Done(2, 4, 4),
        NotHeld(3, 10, 12),
        NotHeld(3, 12, 12),
        UnknownProducer(4),
        UnknownProducer(5, query=True),
        HeldReport(6, "p", INC, 1, 1),
        HeldReport(7, "p", INC, 3, 900),
        HeldReport(8, "p", INC, 3, 900, full=True),
    ):
        assert decode_reply(encode_reply(reply)) == reply
    assert encode_reply(NotHeld(3, 10, 12)) == {
        "range": {"id": 3, "status": "not_held", "first": 10, "end": 12}
    }
    assert encode_reply(UnknownProducer(5, query=True)) == {
        "held": {"id": 5, "status": "unknown_producer"}
    }
    assert decode_reply({"seq": 4}) is None


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"range": {"id": 1}}, "range.status"),
        ({"range": {"id": 1, "status": "held", "first": 1, "end": 2}}, "range.status"),
        ({"held": {"id": 1, "status": "done", "start": 1, "end": 2}}, "held.status"),
        ({"range": {"id": 1, "status": "done", "start": 3, "end": 2}}, "range.start"),
        ({"range": {"id": 1, "status": "not_held", "first": 3, "end": 2}}, "range.first"),
        ({"range": {"id": 1, "status": "not_held", "end": 2}}, "range.first"),
        ({"held": {"id": 1, "status": "held", "first": 1, "end": 2}}, "held.producer"),
        ({"held": {"status": "held"}}, "held.id"),
        ({"held": None}, "held"),
        ({"range": {}, "held": {}}, "range"),
    ],
)
def test_malformed_replies_name_the_field(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_reply(attrs)
    assert e.value.field == field


# ------------------------------------------------------------------------ the giver


def giver_with(req: RangeRequest | HeldQuery) -> RangeGiver:
    giver = RangeGiver(INC)
    assert giver.on_pay(encode_request(req)) == req
    return giver


def test_the_giver_serves_a_held_range_in_batches_then_done() -> None:
    giver = giver_with(RangeRequest(0, "p", INC, 3, 10))
    window = Window(1, 20)
    spans = []
    while True:
        act = giver.next(window, 3)
        if not isinstance(act, Records):
            break
        spans.append((act.first, act.count))
        giver.sent(act)
    assert spans == [(3, 3), (6, 3), (9, 1)]
    assert act == Done(0, 3, 10)
    assert giver.request is None and giver.next(window, 3) is None


def test_the_giver_may_send_fewer_records_than_planned() -> None:
    giver = giver_with(RangeRequest(0, "p", INC, 1, 5))
    act = giver.next(Window(1, 5), 4)
    assert act == Records(1, 4)
    giver.sent(act, 1)  # a byte budget cut the DAT short
    assert giver.next(Window(1, 5), 4) == Records(2, 3)


def test_a_zero_length_range_in_the_window_is_done_at_once() -> None:
    for start in (1, 5, 9):
        giver = giver_with(RangeRequest(0, "p", INC, start, start))
        assert giver.next(Window(1, 9), 10) == Done(0, start, start)


def test_a_zero_length_range_outside_the_window_is_refused() -> None:
    assert giver_with(RangeRequest(0, "p", INC, 0, 0)).next(Window(1, 9), 1) == NotHeld(0, 1, 9)
    assert giver_with(RangeRequest(0, "p", INC, 10, 10)).next(Window(1, 9), 1) == NotHeld(0, 1, 9)


def test_a_range_already_freed_is_refused_with_the_held_window() -> None:
    giver = giver_with(RangeRequest(2, "p", INC, 10, 20))
    assert giver.next(Window(15, 30), 5) == NotHeld(2, 15, 30)
    assert giver.request is None


def test_a_range_beyond_the_end_is_refused_never_waited_for() -> None:
    giver = giver_with(RangeRequest(0, "p", INC, 10, 31))
    assert giver.next(Window(1, 30), 5) == NotHeld(0, 1, 30)


def test_records_freed_while_a_range_is_sent_end_it_refused() -> None:
    # A speculative copy reads while the commit of the first copy frees the records.
    giver = giver_with(RangeRequest(0, "p", INC, 10, 20))
    act = giver.next(Window(10, 20), 4)
    assert act == Records(10, 4)
    giver.sent(act)
    assert giver.next(Window(12, 20), 4) == Records(14, 4)  # freed behind us: fine
    assert giver.next(Window(15, 20), 4) == NotHeld(0, 15, 20)


def test_an_unknown_producer_is_refused() -> None:
    assert giver_with(RangeRequest(0, "px", INC, 1, 2)).next(None, 1) == UnknownProducer(0)
    assert giver_with(HeldQuery(0, "px")).next(None, 1) == UnknownProducer(0, query=True)


def test_a_held_query_reports_the_window() -> None:
    giver = giver_with(HeldQuery(4, "p"))
    assert giver.producer == "p"
    assert giver.next(Window(7, 7), 1) == HeldReport(4, "p", INC, 7, 7)
    assert giver.producer is None
    # A window that held its sends back says so.
    assert giver_with(HeldQuery(5, "p")).next(Window(7, 9, full=True), 1) == HeldReport(
        5, "p", INC, 7, 9, full=True
    )


def test_full_is_sent_only_when_true_and_must_be_a_bool() -> None:
    """``full`` is optional on the wire (absent: false), so a giver of before it and one
    that never holds senders back send the same bytes; a non-bool is a remote error
    naming the field."""
    held = encode_reply(HeldReport(2, "p", INC, 4, 9))["held"]
    assert "full" not in held
    assert encode_reply(HeldReport(2, "p", INC, 4, 9, full=True))["held"]["full"] is True
    for bad in (1, 0, "true", None, [True]):
        with pytest.raises(RemoteProtocolError) as e:
            decode_reply({"held": {**held, "full": bad}})
        assert e.value.field == "held.full" and "full must be true or false" in str(e.value)
    with pytest.raises(LocalProtocolError) as le:
        Window(1, 2, full=1)  # type: ignore[arg-type]
    assert le.value.field == "full"


def test_one_request_at_a_time_with_increasing_ids() -> None:
    giver = giver_with(RangeRequest(1, "p", INC, 1, 5))
    with pytest.raises(RemoteProtocolError) as e:
        giver.on_pay(encode_request(HeldQuery(2, "p")))
    assert e.value.field == "held.id" and "one at a time" in str(e.value)
    assert giver.next(Window(1, 1), 1) == NotHeld(1, 1, 1)
    for rid in (0, 1):
        with pytest.raises(RemoteProtocolError) as e:
            giver.on_pay(encode_request(RangeRequest(rid, "p", INC, 1, 2)))
        assert e.value.field == "range.id" and e.value.value == rid
    assert giver.on_pay({}) is None
    assert giver.on_pay(encode_request(RangeRequest(2, "p", INC, 1, 2))) is not None


def test_the_giver_refuses_misuse_locally() -> None:
    giver = RangeGiver(INC)
    assert giver.next(Window(1, 2), 1) is None
    with pytest.raises(LocalProtocolError):
        giver.next(Window(1, 2), 0)
    with pytest.raises(LocalProtocolError):
        giver.sent(Records(1, 1))
    giver = giver_with(RangeRequest(0, "p", INC, 1, 5))
    with pytest.raises(LocalProtocolError) as e:
        giver.sent(Records(2, 1))
    assert e.value.field == "first"
    with pytest.raises(LocalProtocolError) as e:
        giver.sent(Records(1, 2), 3)
    assert e.value.field == "count"
    with pytest.raises(LocalProtocolError) as e:
        giver.sent(Records(1, 9))
    assert e.value.field == "count"
    with pytest.raises(LocalProtocolError):
        Window(3, 2)
    with pytest.raises(LocalProtocolError):
        Window(-1, 2)


# ----------------------------------------------------------------------- the reader


def test_a_reader_without_the_capability_never_builds_a_request() -> None:
    pair = FlowPair()
    pair.handshake(Direction.INJECT, 8, client_attrs=offer_attrs(), server_attrs=None)
    reader = RangeReader(RangeTerms())
    sent_before = pair.client.sent
    for call in (
        lambda: reader.request("p", INC, 1, 2),
        lambda: reader.query("p"),
        lambda: reader.send_request(pair.client, "p", INC, 1, 2),
        lambda: reader.send_query(pair.client, "p"),
    ):
        with pytest.raises(LocalProtocolError) as e:
            call()
        assert e.value.field == CAPABILITY
    assert pair.client.sent == sent_before and reader.state is ReaderState.IDLE


def test_the_reader_checks_records_arrive_in_order_once_each() -> None:
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 5, 10)
    assert reader.on_dat({"seq": 5}) is None
    reader.records(5, 2)
    assert reader.state is ReaderState.RECEIVING and reader.received == 2
    for first, count, field in ((5, 1, "seq"), (6, 1, "seq"), (8, 1, "seq"), (7, 4, "count")):
        r = RangeReader(CAPABLE)
        r.request("p", INC, 5, 10)
        r.records(5, 2)
        with pytest.raises(RemoteProtocolError) as e:
            r.records(first, count)
        assert e.value.field == field and r.state is ReaderState.ERROR
        with pytest.raises(LocalProtocolError):
            r.on_dat({})
    with pytest.raises(RemoteProtocolError) as e:
        reader.records(7, 0)
    assert e.value.field == "count"


def test_done_must_match_what_arrived() -> None:
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 5, 10)
    reader.records(5, 4)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(Done(0, 5, 10)))  # record 9 never came
    assert e.value.field == "range.end"
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 5, 10)
    reader.records(5, 5)
    with pytest.raises(RemoteProtocolError):
        reader.on_dat(encode_reply(Done(0, 5, 11)))


def test_a_zero_length_range_is_done_with_no_records() -> None:
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 4, 4)
    assert reader.on_dat(encode_reply(Done(0, 4, 4))) == Done(0, 4, 4)
    assert reader.state is ReaderState.DONE


def test_answers_must_match_the_open_request() -> None:
    reader = RangeReader(CAPABLE)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(Done(0, 1, 1)))  # nothing asked
    assert e.value.field == "range.id"
    reader = RangeReader(CAPABLE)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat({"seq": 1})  # records, nothing asked
    assert e.value.field == "flow"
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 1, 2)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(NotHeld(7, 1, 1)))
    assert e.value.field == "range.id" and e.value.value == 7
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 1, 2)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(HeldReport(0, "p", INC, 1, 2)))
    assert e.value.field == "held"
    reader = RangeReader(CAPABLE)
    reader.query("p")
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(HeldReport(0, "q", INC, 1, 2)))
    assert e.value.field == "held.producer"


def test_a_refusal_must_be_true_to_its_window() -> None:
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 5, 10)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(NotHeld(0, 1, 20)))  # covers the range: a lie
    assert e.value.field == "range.first"


def test_after_a_refusal_or_done_the_reader_asks_again() -> None:
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 5, 10)
    reader.records(5, 2)
    refusal = reader.on_dat(encode_reply(NotHeld(0, 8, 30)))
    assert refusal == NotHeld(0, 8, 30) and reader.state is ReaderState.REFUSED
    assert reader.request("p", INC, 7, 8) == encode_request(RangeRequest(1, "p", INC, 7, 8))
    with pytest.raises(LocalProtocolError) as e:
        reader.query("p")  # one at a time
    assert e.value.field == "state"
    reader.records(7, 1)
    assert reader.on_dat(encode_reply(Done(1, 7, 8))) == Done(1, 7, 8)
    assert reader.query("p") == encode_request(HeldQuery(2, "p"))
    assert reader.on_dat(encode_reply(UnknownProducer(2, query=True))) == UnknownProducer(
        2, query=True
    )
    assert reader.state is ReaderState.REFUSED


def test_a_bad_request_changes_nothing() -> None:
    reader = RangeReader(CAPABLE)
    with pytest.raises(LocalProtocolError) as e:
        reader.request("p", INC, 3, 2)
    assert e.value.field == "range.start"
    assert reader.state is ReaderState.IDLE
    assert reader.request("p", INC, 2, 3) == encode_request(RangeRequest(0, "p", INC, 2, 3))


# ------------------------------------------------------------------ over a flow pair


class Harness:
    """A range reader (client taker) and a giver (server) joined by a FlowPair; the
    giver's DATs carry ``{"seq": first, "n": count}`` for their records (the real codec
    puts them in an Arrow ``seq`` column)."""

    def __init__(
        self,
        credit: int,
        window: Window | None,
        *,
        capable: bool = True,
        incarnation: str = INC,
        giver: RangeGiver | None = None,
    ) -> None:
        self.pair = FlowPair()
        offer = offer_attrs({"stream": "s"})
        bot = self.pair.to_server(self.pair.client.send_bot(Direction.INJECT, credit, offer))
        assert isinstance(bot, BotReceived) and server_asks_range(bot.attrs)
        sent = {"direction": "inject", "credit": credit, **offer}
        extras = (
            state_capability({"producer": "p", "stream": "s"}, incarnation)
            if capable
            else dict(offer)
        )
        reply = self.pair.to_client(self.pair.server.accept(None, extras))
        assert isinstance(reply, BotReceived)
        self.reader = RangeReader(client_range_terms(sent, dict(reply.attrs)))
        self.giver = RangeGiver(incarnation) if giver is None else giver
        self.window = window
        self.seqs: list[int] = []
        self.replies: list[Any] = []

    def deliver_pay(self, msg: Any) -> None:
        event = self.pair.to_server(msg)
        assert isinstance(event, Credit)
        self.giver.on_pay(event.attrs)

    def pump(self, batch: int, cut: int = 0) -> None:
        """The giver sends while it holds credit and has something to send; each DAT is
        delivered at once. ``cut`` > 0 sends that many fewer records than planned."""
        server = self.pair.server
        while server.credit > 0:
            window = self.window if self.giver.producer == "p" else None
            act = self.giver.next(window, batch)
            if act is None:
                return
            if isinstance(act, Records):
                n = max(1, act.count - cut)
                msg = server.send_dat((b"x" * n,), {"seq": act.first, "n": n})
                self.giver.sent(act, n)
            else:
                msg = server.send_dat((), encode_reply(act))
            event = self.pair.to_client(msg)
            assert isinstance(event, Data)
            reply = self.reader.on_dat(event.attrs)
            if reply is None:
                first, n = event.attrs["seq"], event.attrs["n"]
                self.reader.records(first, n)
                self.seqs.extend(range(first, first + n))
            else:
                self.replies.append(reply)


def test_a_range_over_a_flow_pair_with_credit_one() -> None:
    h = Harness(1, Window(1, 100))
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", INC, 10, 14))
    while h.reader.state is not ReaderState.DONE:
        h.pump(batch=2)
        if h.pair.client.credit:
            h.deliver_pay(h.pair.client.pay())
    assert h.seqs == [10, 11, 12, 13] and h.replies == [Done(0, 10, 14)]
    # The giver kept a credit: the next request goes out on a PAY of 0.
    assert h.pair.client.credit == 0 and h.pair.server.credit == 1
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", INC, 14, 15))
    h.pump(batch=2)
    assert h.seqs[-1] == 14 and h.pair.server.credit == 0
    h.deliver_pay(h.pair.client.pay())
    h.pump(batch=2)
    assert h.replies[-1] == Done(1, 14, 15) and h.reader.state is ReaderState.DONE


def test_a_held_query_is_one_round_trip() -> None:
    h = Harness(4, Window(3, 42))
    h.deliver_pay(h.reader.send_query(h.pair.client, "p", 1))
    h.pump(batch=1)
    assert h.replies == [HeldReport(0, "p", INC, 3, 42)] and h.reader.state is ReaderState.IDLE


def test_an_echoing_server_is_never_sent_a_request() -> None:
    h = Harness(4, Window(1, 9), capable=False)
    assert not h.reader.terms.capable
    with pytest.raises(LocalProtocolError):
        h.reader.send_request(h.pair.client, "p", INC, 1, 2)
    assert h.pair.client.sent == 1  # the BOT only


def test_a_pay_of_zero_needs_a_request_or_an_ack() -> None:
    h = Harness(2, Window(1, 9))
    with pytest.raises(LocalProtocolError):
        h.pair.client.pay(0, {"other": 1})
    h2 = Harness(2, Window(1, 9))
    h2.deliver_pay(h2.reader.send_request(h2.pair.client, "p", INC, 1, 1, credit=0))
    assert h2.giver.request == RangeRequest(0, "p", INC, 1, 1)
    h3 = Harness(2, Window(1, 9))
    with pytest.raises(FlowControlError):
        h3.pair.server.receive(Message(FLOW_FORM, '{"flow": "PAY", "credit": 0, "other": 1}'))


# ----------------------------------------------------------------------- incarnation


def test_a_capable_giver_states_its_incarnation_and_the_reader_learns_it() -> None:
    assert GIVER_EXTRAS["incarnation"] == INC
    terms = client_range_terms(READER_BOT, {"direction": "extract", **GIVER_EXTRAS})
    assert terms.incarnation == INC
    # A fresh process draws one: hex of its entropy.
    assert new_incarnation(bytes(range(16))) == bytes(range(16)).hex()
    for bad in (b"", b"1234567", bytes(33), "0123456789abcdef"):
        with pytest.raises(LocalProtocolError) as e:
            new_incarnation(bad)  # type: ignore[arg-type]
        assert e.value.field == "incarnation"


BAD_INCARNATIONS: list[Any] = [
    None,
    "",
    "a b",
    "é",
    "x" * (INCARNATION_MAX + 1),
    7,
    True,
    ["a"],
    {},
]


@pytest.mark.parametrize("bad", BAD_INCARNATIONS)
def test_a_capable_bot_without_a_good_incarnation_is_a_remote_error(bad: object) -> None:
    reply = {"direction": "extract", **GIVER_EXTRAS}
    if bad is None:
        del reply["incarnation"]
    else:
        reply["incarnation"] = bad
    with pytest.raises(RemoteProtocolError) as e:
        client_range_terms(READER_BOT, reply)
    assert e.value.field == "incarnation" and e.value.value == bad
    assert "incarnation" in str(e.value) and "1..64" in str(e.value)
    # Without the capability an incarnation means nothing and is not looked at.
    plain = {k: v for k, v in reply.items() if k != "ranges"}
    assert not client_range_terms(READER_BOT, plain).capable


@pytest.mark.parametrize("bad", BAD_INCARNATIONS)
def test_a_giver_cannot_state_or_serve_a_bad_incarnation(bad: object) -> None:
    with pytest.raises(LocalProtocolError) as e:
        state_capability({"producer": "p"}, bad)  # type: ignore[arg-type]
    assert e.value.field == "incarnation"
    with pytest.raises(LocalProtocolError) as e:
        RangeGiver(bad)  # type: ignore[arg-type]
    assert e.value.field == "incarnation"
    with pytest.raises(LocalProtocolError) as e:
        RangeTerms(VERSION, "p", bad)  # type: ignore[arg-type]
    assert e.value.field == "incarnation"
    with pytest.raises(LocalProtocolError) as e:
        check_incarnation(bad)
    assert e.value.field == "incarnation" and "1..64" in str(e.value)


def test_check_incarnation_passes_a_good_one_through() -> None:
    for good in (INC, "a", "A.b_c-9", "x" * INCARNATION_MAX, new_incarnation(bytes(16))):
        assert check_incarnation(good) == good


def test_the_reader_never_states_an_incarnation() -> None:
    with pytest.raises(LocalProtocolError) as e:
        offer_attrs({"incarnation": INC})
    assert e.value.field == "incarnation"


@pytest.mark.parametrize("bad", BAD_INCARNATIONS)
def test_a_range_request_without_a_good_incarnation_names_the_field(bad: object) -> None:
    obj: dict[str, Any] = {"id": 1, "producer": "p", "start": 1, "end": 2}
    if bad is not None:
        obj["incarnation"] = bad
    with pytest.raises(RemoteProtocolError) as e:
        decode_request({"range": obj})
    assert e.value.field == "range.incarnation" and e.value.value == bad
    with pytest.raises(LocalProtocolError) as le:
        encode_request(RangeRequest(1, "p", bad, 1, 2))  # type: ignore[arg-type]
    assert le.value.field == "range.incarnation"
    reader = RangeReader(CAPABLE)
    with pytest.raises(LocalProtocolError):
        reader.request("p", bad, 1, 2)  # type: ignore[arg-type]
    assert reader.state is ReaderState.IDLE


@pytest.mark.parametrize("bad", BAD_INCARNATIONS)
def test_answers_without_a_good_incarnation_name_the_field(bad: object) -> None:
    held: dict[str, Any] = {"id": 1, "producer": "p", "status": "held", "first": 1, "end": 2}
    other: dict[str, Any] = {"id": 1, "status": "other_incarnation", "first": 1, "end": 2}
    for key, obj in (("held", held), ("range", other)):
        if bad is not None:
            obj["incarnation"] = bad
        with pytest.raises(RemoteProtocolError) as e:
            decode_reply({key: obj})
        assert e.value.field == f"{key}.incarnation" and e.value.value == bad


def test_incarnation_answers_round_trip() -> None:
    for reply in (OtherIncarnation(3, OTHER, 1, 251), OtherIncarnation(0, "b", 5, 5)):
        assert decode_reply(encode_reply(reply)) == reply
    assert encode_reply(OtherIncarnation(3, OTHER, 1, 251)) == {
        "range": {
            "id": 3,
            "status": "other_incarnation",
            "incarnation": OTHER,
            "first": 1,
            "end": 251,
        }
    }
    assert encode_reply(HeldReport(2, "p", INC, 4, 9)) == {
        "held": {
            "id": 2,
            "producer": "p",
            "status": "held",
            "incarnation": INC,
            "first": 4,
            "end": 9,
        }
    }
    with pytest.raises(RemoteProtocolError) as e:
        decode_reply({"range": {"id": 1, "status": "other_incarnation", "first": 3, "end": 2}})
    assert e.value.field == "range.first"


def test_the_giver_refuses_a_range_of_another_incarnation_before_any_record() -> None:
    for start, end in ((100, 200), (5, 5), (1, 251), (300, 400)):
        giver = RangeGiver(OTHER)
        giver.on_pay(encode_request(RangeRequest(0, "p", INC, start, end)))
        # Whatever the window: the numbers name other records.
        assert giver.next(Window(1, 251), 10) == OtherIncarnation(0, OTHER, 1, 251)
        assert giver.request is None


def test_the_giver_serves_a_range_of_its_own_incarnation() -> None:
    giver = RangeGiver(OTHER)
    giver.on_pay(encode_request(RangeRequest(0, "p", OTHER, 100, 102)))
    act = giver.next(Window(1, 251), 10)
    assert act == Records(100, 2)
    giver.sent(act)
    assert giver.next(Window(1, 251), 10) == Done(0, 100, 102)
    giver.on_pay(encode_request(HeldQuery(1, "p")))
    assert giver.next(Window(1, 251), 1) == HeldReport(1, "p", OTHER, 1, 251)


def test_the_reader_takes_a_true_other_incarnation_refusal_as_data_loss() -> None:
    reader = RangeReader(RangeTerms(VERSION, "p", OTHER))
    reader.request("daq-1", INC, 100, 200)
    refusal = reader.on_dat(encode_reply(OtherIncarnation(0, OTHER, 1, 251)))
    assert refusal == OtherIncarnation(0, OTHER, 1, 251)
    assert reader.state is ReaderState.REFUSED and reader.received == 0
    err = reader.loss(refusal)
    assert isinstance(err, DataLossError) and err.producer == "daq-1"
    text = str(err)
    for part in ("[100, 200)", "'daq-1'", INC, OTHER, "[1, 251)", "restarted"):
        assert part in text, (part, text)


def test_the_reader_names_the_numbers_of_a_not_held_range() -> None:
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 5, 10)
    reader.records(5, 2)
    refusal = reader.on_dat(encode_reply(NotHeld(0, 8, 30)))
    assert refusal is not None
    text = str(reader.loss(refusal))
    for part in ("[5, 10)", "[8, 30)", INC, "2 discarded"):
        assert part in text, (part, text)
    with pytest.raises(LocalProtocolError):
        reader.loss(Done(0, 5, 10))
    reader.query("p")
    held = reader.on_dat(encode_reply(UnknownProducer(1, query=True)))
    assert held is not None
    with pytest.raises(LocalProtocolError):
        reader.loss(held)  # a held query's refusal loses nothing


def test_the_reader_rejects_a_lying_other_incarnation_refusal() -> None:
    # Naming the request's own incarnation: the giver would serve it.
    reader = RangeReader(CAPABLE)
    reader.request("p", INC, 1, 5)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(OtherIncarnation(0, INC, 1, 9)))
    assert e.value.field == "range.incarnation" and reader.state is ReaderState.ERROR
    # Naming another incarnation than the one its BOT stated (fixed for the flow).
    reader = RangeReader(CAPABLE)
    reader.request("p", OTHER, 1, 5)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(OtherIncarnation(0, "third", 1, 9)))
    assert e.value.field == "range.incarnation"


def test_the_reader_never_takes_records_of_a_range_planned_on_another_incarnation() -> None:
    # A giver that stated OTHER in its BOT but serves a range planned on INC anyway.
    reader = RangeReader(RangeTerms(VERSION, "p", OTHER))
    reader.request("p", INC, 100, 200)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat({"seq": 100})
    assert e.value.field == "range.incarnation" and e.value.value == OTHER
    assert INC in str(e.value) and OTHER in str(e.value)
    assert reader.state is ReaderState.ERROR and reader.received == 0
    reader = RangeReader(RangeTerms(VERSION, "p", OTHER))
    reader.request("p", INC, 100, 200)
    with pytest.raises(RemoteProtocolError) as e:
        reader.records(100, 1)  # without on_dat first: still checked
    assert e.value.field == "range.incarnation" and reader.received == 0


def test_a_held_answer_of_another_incarnation_than_the_bot_is_a_remote_error() -> None:
    reader = RangeReader(CAPABLE)
    reader.query("p")
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(HeldReport(0, "p", OTHER, 1, 9)))
    assert e.value.field == "held.incarnation" and e.value.value == OTHER


def test_the_held_answers_incarnation_flows_into_the_range_request() -> None:
    h = Harness(4, Window(1, 300), incarnation=OTHER)
    h.deliver_pay(h.reader.send_query(h.pair.client, "p", 1))
    h.pump(batch=8)
    (held,) = h.replies
    assert isinstance(held, HeldReport) and held.incarnation == OTHER
    offsets: dict[str, dict[str, Any]] = {
        held.producer: {"incarnation": held.incarnation, "end": held.end}
    }
    plan = offsets["p"]
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", plan["incarnation"], 100, 104))
    assert h.giver.request == RangeRequest(1, "p", OTHER, 100, 104)
    while h.reader.state is not ReaderState.DONE:
        h.pump(batch=8)
        if h.pair.client.credit:
            h.deliver_pay(h.pair.client.pay())
    assert h.seqs == [100, 101, 102, 103]


def test_a_retried_task_after_a_restart_without_retention_gets_data_loss_not_data() -> None:
    """The hole this closes: planned [100, 200) on process A; A dies; B (same id, same
    endpoint) numbers from 1 again and holds [1, 251) when the retried task asks."""
    a = Harness(4, Window(1, 300), incarnation=INC)
    a.deliver_pay(a.reader.send_query(a.pair.client, "p", 1))
    a.pump(batch=8)
    (held,) = a.replies
    assert isinstance(held, HeldReport)
    b = Harness(4, Window(1, 251), incarnation=new_incarnation(b"restarted-B-0001"))
    b.deliver_pay(b.reader.send_request(b.pair.client, "p", held.incarnation, 100, 200))
    b.pump(batch=8)
    assert b.seqs == []
    (refusal,) = b.replies
    assert isinstance(refusal, OtherIncarnation) and (refusal.first, refusal.end) == (1, 251)
    assert b.reader.state is ReaderState.REFUSED
    assert "[100, 200)" in str(b.reader.loss(refusal))


# ------------------------------------------------------------------------ properties

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def held_ranges(draw: st.DrawFn) -> tuple[Window, int, int]:
    first = draw(st.integers(0, 50))
    end = draw(st.integers(first, first + 60))
    start = draw(st.integers(first, end))
    stop = draw(st.integers(start, end))
    return Window(first, end), start, stop


@PROPS
@given(
    held_ranges(),
    st.integers(1, 8),
    st.integers(1, 7),
    st.lists(st.integers(0, 8), min_size=1, max_size=20),
    st.integers(0, 3),
)
def test_a_held_range_arrives_exactly_once_in_order_whatever_the_credit(
    case: tuple[Window, int, int], credit: int, batch: int, pays: list[int], cut: int
) -> None:
    window, start, end = case
    h = Harness(credit, window)
    first_pay = min(pays[0], credit)
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", INC, start, end, credit=first_pay))
    i = 1
    while h.reader.state is not ReaderState.DONE:
        h.pump(batch, cut)
        held = h.pair.client.credit
        if held:
            amount = max(1, min(pays[i % len(pays)], held))
            h.deliver_pay(h.pair.client.pay(amount))
        i += 1
        assert i < 10_000
    assert h.seqs == list(range(start, end))
    assert h.replies == [Done(0, start, end)]
    # Credit stayed the flow's: nothing in flight, both halves add up.
    assert h.pair.client.credit + h.pair.server.credit == credit


@st.composite
def unheld_ranges(draw: st.DrawFn) -> tuple[Window, int, int]:
    first = draw(st.integers(0, 50))
    end = draw(st.integers(first, first + 60))
    start = draw(st.integers(0, end + 20))
    stop = draw(st.integers(start, end + 30))
    if first <= start and stop <= end:  # held: move one bound out
        if draw(st.booleans()) and first > 0:
            start = draw(st.integers(0, first - 1))
        else:
            stop = draw(st.integers(end + 1, end + 30))
    return Window(first, end), start, stop


@PROPS
@given(unheld_ranges(), st.integers(1, 5), st.integers(1, 5))
def test_a_range_not_fully_held_is_refused_with_the_held_bounds(
    case: tuple[Window, int, int], credit: int, batch: int
) -> None:
    window, start, end = case
    h = Harness(credit, window)
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", INC, start, end))
    h.pump(batch)
    assert h.seqs == []
    assert h.replies == [NotHeld(0, window.first, window.end)]
    assert h.reader.state is ReaderState.REFUSED


incarnations = st.text(INCARNATION_CHARS, min_size=1, max_size=INCARNATION_MAX)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**64) | st.text(max_size=4) | incarnations,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)
bot_attrs = st.dictionaries(
    st.sampled_from(["producer", "ranges", "incarnation", "stream", "ack", "read", "resume", "x"]),
    json_values,
    max_size=5,
)


@PROPS
@given(bot_attrs, bot_attrs)
def test_the_capability_counts_only_as_the_servers_own_statement(
    ours: dict[str, Any], extra: dict[str, Any]
) -> None:
    ours.pop("ranges", None)
    ours.pop("incarnation", None)
    try:
        sent = {"direction": "inject", "credit": 4, **offer_attrs(ours)}
    except LocalProtocolError:
        return  # a "read" we would never send
    # An echo, whatever else the peer adds: capable only with its own ranges and producer.
    reply = {**echo(sent), **extra}
    try:
        terms = client_range_terms(sent, reply)
    except RemoteProtocolError:
        return
    own_producer = isinstance(extra.get("producer"), str) and extra["producer"] != sent.get(
        "producer"
    )
    # (null states nothing, as for the other profile attributes)
    assert terms.capable == (extra.get("ranges") is not None and own_producer)
    if terms.capable:  # never without the giver's own, well-formed incarnation
        assert terms.incarnation == extra["incarnation"]
    assert not client_range_terms(sent, echo(sent)).capable


@PROPS
@given(
    st.one_of(
        st.builds(
            RangeRequest,
            st.integers(0, SEQ_MAX),
            st.text(min_size=1, max_size=8),
            incarnations,
            st.integers(0, 100),
            st.integers(100, SEQ_MAX),
        ),
        st.builds(HeldQuery, st.integers(0, SEQ_MAX), st.text(min_size=1, max_size=8)),
    )
)
def test_requests_survive_the_wire(req: RangeRequest | HeldQuery) -> None:
    pair = FlowPair()
    pair.handshake(Direction.INJECT, 3)
    event = pair.to_server(pair.client.pay(1, encode_request(req)))
    assert isinstance(event, Credit)
    assert decode_request(event.attrs) == req


@PROPS
@given(held_ranges(), st.integers(1, 6), st.integers(1, 5), st.lists(st.integers(0, 6)))
def test_acks_during_a_range_give_a_prefix_then_a_refusal_never_other_records(
    case: tuple[Window, int, int], credit: int, batch: int, frees: list[int]
) -> None:
    """Acks free records from the front while a (speculative) copy reads: the reader gets
    the range whole, or a prefix of it in order and then not_held; nothing else."""
    window, start, end = case
    h = Harness(credit, window)
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", INC, start, end))
    i = 0
    while h.reader.state not in (ReaderState.DONE, ReaderState.REFUSED):
        h.pump(batch)
        free = frees[i] if i < len(frees) else 0
        held = h.window
        assert held is not None
        h.window = Window(min(held.first + free, held.end), held.end)
        if h.pair.client.credit:
            h.deliver_pay(h.pair.client.pay())
        i += 1
    assert h.seqs == list(range(start, start + len(h.seqs)))
    if h.reader.state is ReaderState.DONE:
        assert h.seqs == list(range(start, end)) and h.replies == [Done(0, start, end)]
    else:
        (refusal,) = h.replies
        # Refused only because acks freed the next record (the window's end stayed).
        assert isinstance(refusal, NotHeld) and refusal.first > start + len(h.seqs)


@PROPS
@given(
    st.one_of(held_ranges(), unheld_ranges()),
    incarnations,
    incarnations,
    st.integers(1, 6),
    st.integers(1, 5),
    st.booleans(),
)
def test_a_reader_planned_on_one_incarnation_never_gets_records_of_another(
    case: tuple[Window, int, int],
    planned: str,
    stated: str,
    credit: int,
    batch: int,
    rogue: bool,
) -> None:
    """Whatever the windows (a restarted giver's may cover the planned range), a range
    planned on incarnation X gets no record from a giver of incarnation Y != X: the giver
    refuses it, and a rogue giver that serves the numbers anyway is stopped by the
    reader at its first DAT of records."""
    assume(planned != stated)
    window, start, end = case
    giver = RangeGiver(planned) if rogue else None  # rogue: states Y, serves as X
    h = Harness(credit, window, incarnation=stated, giver=giver)
    h.deliver_pay(h.reader.send_request(h.pair.client, "p", planned, start, end))
    try:
        for _ in range(1000):
            h.pump(batch)
            if h.reader.state is not ReaderState.REQUESTED:
                break
            if h.pair.client.credit:
                h.deliver_pay(h.pair.client.pay())
    except RemoteProtocolError as e:
        assert rogue and e.field == "range.incarnation"
        assert h.reader.state is ReaderState.ERROR
    assert h.seqs == [] and h.reader.received == 0
    if not rogue:
        assert h.replies == [OtherIncarnation(0, stated, window.first, window.end)]
        assert h.reader.state is ReaderState.REFUSED
        (refusal,) = h.replies
        text = str(h.reader.loss(refusal))
        assert planned in text and stated in text and f"[{start}, {end})" in text


# ------------------------------------------------------------------ the control flow


class Control:
    """A driver's control flow (``read: "control"``) to a giver over a FlowPair; the
    giver's held window is the model of what it holds (commits move ``first``)."""

    def __init__(self, window: Window, *, incarnation: str = INC, credit: int = 4) -> None:
        self.pair = FlowPair()
        offer = offer_attrs({"stream": "s"}, read=READ_CONTROL)
        bot = self.pair.to_server(self.pair.client.send_bot(Direction.INJECT, credit, offer))
        assert isinstance(bot, BotReceived) and server_read_mode(bot.attrs) == READ_CONTROL
        sent = {"direction": "inject", "credit": credit, **offer}
        extras = state_capability({"producer": "p", "stream": "s"}, incarnation)
        reply = self.pair.to_client(self.pair.server.accept(None, extras))
        assert isinstance(reply, BotReceived)
        self.reader = RangeReader(client_range_terms(sent, dict(reply.attrs)))
        self.giver = RangeGiver(incarnation, control=True)
        self.window = window
        self.freed_by: list[str] = []  # the incarnation of each commit that freed records

    def commit(self, incarnation: str, upto: int) -> Any:
        """Send a commit (credit 0 when none is held), serve it, apply what the giver
        says to free, deliver the answer; returns it."""
        client = self.pair.client
        msg = self.reader.send_commit(client, "p", incarnation, upto, credit=client.credit)
        event = self.pair.to_server(msg)
        assert isinstance(event, Credit)
        self.giver.on_pay(event.attrs)
        got = self.giver.next(self.window, 1)
        if isinstance(got, Acked):
            if got.upto >= self.window.first:
                self.freed_by.append(incarnation)
            self.window = Window(got.first, self.window.end)
        assert got is not None and not isinstance(got, Records)
        dat = self.pair.to_client(self.pair.server.send_dat((), encode_reply(got)))
        assert isinstance(dat, Data)
        reply = self.reader.on_dat(dat.attrs)
        if self.pair.client.credit == 0:
            self.pair.to_server(self.pair.client.pay(1))
        return reply


def test_a_control_bot_says_read_control() -> None:
    assert offer_attrs(read=READ_CONTROL) == {"read": "control"}
    assert server_read_mode({"read": "control"}) == READ_CONTROL
    assert server_read_mode({"read": "range"}) == READ_RANGE
    assert server_read_mode({}) is None
    assert server_asks_range({"read": "control"})
    with pytest.raises(LocalProtocolError) as e:
        offer_attrs(read="stream")
    assert e.value.field == "read"
    with pytest.raises(LocalProtocolError):
        offer_attrs({"read": "range"}, read=READ_CONTROL)


def test_a_commit_is_an_ack_with_its_incarnation_on_the_wire() -> None:
    req = CommitRequest(3, "p1", INC, 41)
    attrs = encode_request(req)
    assert attrs == {"ack": 41, "commit": {"id": 3, "producer": "p1", "incarnation": INC}}
    assert decode_request(attrs) == req
    for bad in ({"commit": attrs["commit"]}, {**attrs, "ack": -1}, {**attrs, "ack": True}):
        with pytest.raises(RemoteProtocolError) as e:
            decode_request(bad)
        assert e.value.field == "PAY.ack"
    with pytest.raises(RemoteProtocolError) as e:
        decode_request({**attrs, "held": {"id": 1, "producer": "p1"}})
    with pytest.raises(RemoteProtocolError) as e:
        forbid_requests(attrs)
    assert e.value.field == "commit"


def test_commit_answers_round_trip() -> None:
    for reply in (
        Acked(1, INC, 4, 5, 9),
        Acked(1, INC, 0, 3, 3),
        CommitRefused(2, OTHER, 1, 7),
        UnknownProducer(3, commit=True),
    ):
        attrs = encode_reply(reply)
        assert set(attrs) == {"commit"}
        assert decode_reply(attrs) == reply
    bad = {"commit": {"id": 1, "status": "acked", "incarnation": INC, "upto": 5, "first": 5}}
    with pytest.raises(RemoteProtocolError) as e:
        decode_reply({"commit": {**bad["commit"], "end": 9}})
    assert e.value.field == "commit.upto"


def test_a_commit_frees_up_to_its_number_and_answers_the_window() -> None:
    c = Control(Window(1, 11))
    assert c.commit(INC, 4) == Acked(0, INC, 4, 5, 11)
    assert c.window == Window(5, 11) and c.reader.state is ReaderState.IDLE


def test_a_commit_at_or_below_the_window_is_a_no_op() -> None:
    c = Control(Window(1, 11))
    c.commit(INC, 6)
    assert c.commit(INC, 6) == Acked(1, INC, 6, 7, 11)
    assert c.commit(INC, 2) == Acked(2, INC, 2, 7, 11)
    assert c.commit(INC, 0) == Acked(3, INC, 0, 7, 11)
    assert c.window == Window(7, 11) and c.freed_by == [INC]


def test_a_commit_of_another_incarnation_frees_nothing() -> None:
    c = Control(Window(1, 11))
    reply = c.commit(OTHER, 4)
    assert reply == CommitRefused(0, INC, 1, 11)
    assert c.window == Window(1, 11) and c.freed_by == []
    assert c.reader.state is ReaderState.REFUSED
    assert c.commit(INC, 4) == Acked(1, INC, 4, 5, 11)  # the flow goes on


def test_a_commit_beyond_the_end_is_a_protocol_error_naming_both_numbers() -> None:
    giver = RangeGiver(INC, control=True)
    giver.on_pay(encode_request(CommitRequest(0, "p", INC, 11)))
    with pytest.raises(RemoteProtocolError) as e:
        giver.next(Window(1, 11), 1)
    assert e.value.field == "ack" and e.value.value == 11
    assert "11" in str(e.value) and "last record is 10" in str(e.value)
    assert giver.request is None
    # The last record itself is fine; an empty window's last record too.
    giver.on_pay(encode_request(CommitRequest(1, "p", INC, 10)))
    assert giver.next(Window(1, 11), 1) == Acked(1, INC, 10, 11, 11)


def test_a_commit_of_an_unknown_producer_frees_nothing() -> None:
    giver = RangeGiver(INC, control=True)
    giver.on_pay(encode_request(CommitRequest(0, "q", INC, 3)))
    assert giver.next(None, 1) == UnknownProducer(0, commit=True)


def test_a_control_flow_takes_no_range_and_no_bare_ack() -> None:
    giver = RangeGiver(INC, control=True)
    with pytest.raises(RemoteProtocolError) as e:
        giver.on_pay(encode_request(RangeRequest(0, "p", INC, 1, 2)))
    assert e.value.field == "range"
    for bare in ({"ack": 3}, {"ack": 3, "held": {"id": 1, "producer": "p"}}):
        with pytest.raises(RemoteProtocolError) as e:
            giver.on_pay(bare)
        assert e.value.field == "ack"
    assert giver.on_pay({}) is None
    assert isinstance(giver.on_pay({"held": {"id": 1, "producer": "p"}}), HeldQuery)


def test_a_range_flow_takes_no_commit() -> None:
    giver = RangeGiver(INC)
    with pytest.raises(RemoteProtocolError) as e:
        giver.on_pay(encode_request(CommitRequest(0, "p", INC, 3)))
    assert e.value.field == "commit"


def test_the_reader_rejects_a_commit_applied_in_another_incarnation() -> None:
    reader = RangeReader(CAPABLE)
    reader.commit("p1", OTHER, 4)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(Acked(0, OTHER, 4, 5, 9)))
    assert e.value.field == "commit.incarnation" and reader.state is ReaderState.ERROR
    reader = RangeReader(CAPABLE)
    reader.commit("p1", INC, 4)
    with pytest.raises(RemoteProtocolError) as e:
        reader.on_dat(encode_reply(Acked(0, INC, 3, 5, 9)))
    assert e.value.field == "commit.upto"
    reader = RangeReader(CAPABLE)
    reader.commit("p1", OTHER, 4)
    with pytest.raises(RemoteProtocolError):  # a refusal must name the BOT's incarnation
        reader.on_dat(encode_reply(CommitRefused(0, OTHER, 1, 9)))
    reader = RangeReader(CAPABLE)
    reader.commit("p1", INC, 4)
    with pytest.raises(RemoteProtocolError) as e:  # a held answer to a commit
        reader.on_dat(encode_reply(HeldReport(0, "p1", INC, 1, 9)))
    assert e.value.field == "held"


def test_a_held_query_on_a_control_flow() -> None:
    c = Control(Window(3, 9))
    msg = c.reader.send_query(c.pair.client, "p")
    event = c.pair.to_server(msg)
    assert isinstance(event, Credit)
    c.giver.on_pay(event.attrs)
    got = c.giver.next(c.window, 1)
    assert got == HeldReport(0, "p", INC, 3, 9)


@PROPS
@given(
    st.integers(0, 40),
    st.integers(0, 40),
    incarnations,
    incarnations,
    st.lists(st.tuples(st.booleans(), st.integers(0, 90)), max_size=12),
)
def test_no_commit_of_one_incarnation_frees_records_of_another(
    first: int, size: int, giver_inc: str, other: str, commits: list[tuple[bool, int]]
) -> None:
    """No ack of incarnation X ever frees a record of a giver in incarnation Y != X:
    whatever the numbers, those commits are refused and the window does not move."""
    assume(giver_inc != other)
    c = Control(Window(first, first + size), incarnation=giver_inc)
    for own, upto in commits:
        before = c.window
        inc = giver_inc if own else other
        if own and upto >= before.end:
            continue  # a protocol error, tested above
        reply = c.commit(inc, upto)
        if own:
            assert isinstance(reply, Acked)
        else:
            assert reply == CommitRefused(reply.id, giver_inc, before.first, before.end)
            assert c.window == before
    assert other not in c.freed_by


@PROPS
@given(st.integers(1, 30), st.integers(0, 60), st.lists(st.integers(0, 90), max_size=12))
def test_commits_in_any_order_free_exactly_up_to_the_max(
    first: int, size: int, uptos: list[int]
) -> None:
    """Acks applied in any order (a restarted driver re-acks its last commit, acks of an
    older commit arrive late) free exactly up to the largest: monotonic, never an error
    below the window."""
    end = first + size
    uptos = [u for u in uptos if u < end]
    c = Control(Window(first, end))
    for upto in uptos:
        assert isinstance(c.commit(INC, upto), Acked)
    top = max(uptos, default=-1)
    assert c.window == Window(max(first, top + 1), end)


# ------------------------------------------------------ admit: the run key (control flow)

KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
"""A CURVE public key in Z85 text (the ZMQ RFC 26 example client key)."""
KEY2 = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"


def test_an_admit_request_carries_the_run_key_on_the_wire() -> None:
    c = Control(Window(1, 9))
    msg = c.reader.send_admit(c.pair.client, KEY, credit=0)  # a PAY of 0 is legal for it
    event = c.pair.to_server(msg)
    assert isinstance(event, Credit) and event.amount == 0
    assert dict(event.attrs) == {"admit": {"id": 0, "key": KEY}}
    assert c.giver.on_pay(event.attrs) == AdmitRequest(0, KEY)
    assert decode_request(encode_request(AdmitRequest(SEQ_MAX, KEY2))) == AdmitRequest(
        SEQ_MAX, KEY2
    )


def test_admit_answers_round_trip() -> None:
    for reply in (Admitted(0, gated=True), Admitted(7, gated=False)):
        assert decode_reply(encode_reply(reply)) == reply
    assert encode_reply(Admitted(3, gated=True)) == {"admit": {"id": 3, "status": "admitted"}}
    assert encode_reply(Admitted(3, gated=False)) == {"admit": {"id": 3, "status": "open"}}


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"admit": KEY}, "admit"),
        ({"admit": {"key": KEY}}, "admit.id"),
        ({"admit": {"id": -1, "key": KEY}}, "admit.id"),
        ({"admit": {"id": 0}}, "admit.key"),
        ({"admit": {"id": 0, "key": KEY[:-1]}}, "admit.key"),  # 39 characters
        ({"admit": {"id": 0, "key": KEY + "0"}}, "admit.key"),
        ({"admit": {"id": 0, "key": "~" + KEY[1:]}}, "admit.key"),  # not Z85
        ({"admit": {"id": 0, "key": "%" * 40}}, "admit.key"),  # groups beyond 32 bits
        ({"admit": {"id": 0, "key": KEY.encode()}}, "admit.key"),
        ({"admit": {"id": 0, "key": KEY}, "held": {"id": 1, "producer": "p"}}, "held"),
    ],
)
def test_malformed_admit_requests_name_the_field(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_request(attrs)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("attrs", "field"),
    [
        ({"admit": {"id": 0, "status": "acked"}}, "admit.status"),
        ({"admit": {"id": 0}}, "admit.status"),
        ({"admit": {"status": "open"}}, "admit.id"),
        ({"admit": ["open"]}, "admit"),
    ],
)
def test_malformed_admit_answers_name_the_field(attrs: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_reply(attrs)
    assert e.value.field == field


def test_a_bad_run_key_is_a_local_error_and_nothing_is_sent() -> None:
    reader = RangeReader(CAPABLE)
    with pytest.raises(LocalProtocolError) as e:
        reader.admit("not a key")
    assert e.value.field == "admit.key"
    assert reader.state is ReaderState.IDLE
    assert check_curve_key(KEY) == KEY
    with pytest.raises(LocalProtocolError):
        check_curve_key(None)


def test_a_gated_giver_admits_and_an_open_one_says_so_whatever_the_window() -> None:
    for gated in (True, False):
        giver = RangeGiver(INC, control=True, gated=gated)
        giver.on_pay(encode_request(AdmitRequest(0, KEY)))
        assert giver.producer is None  # no window needed
        assert giver.next(None, 1) == Admitted(0, gated=gated)
        assert giver.request is None
        giver.on_pay(encode_request(AdmitRequest(1, KEY2)))
        assert giver.next(Window(1, 5), 1) == Admitted(1, gated=gated)


def test_a_range_flow_and_a_takers_flow_take_no_admit() -> None:
    giver = RangeGiver(INC, gated=True)
    with pytest.raises(RemoteProtocolError) as e:
        giver.on_pay(encode_request(AdmitRequest(0, KEY)))
    assert e.value.field == "admit"
    assert giver.request is None
    with pytest.raises(RemoteProtocolError) as e:
        forbid_requests(encode_request(AdmitRequest(0, KEY)))
    assert e.value.field == "admit"


def test_admit_keeps_the_one_request_at_a_time_and_increasing_id_rules() -> None:
    giver = RangeGiver(INC, control=True, gated=True)
    giver.on_pay(encode_request(AdmitRequest(4, KEY)))
    with pytest.raises(RemoteProtocolError) as e:
        giver.on_pay(encode_request(HeldQuery(5, "p")))
    assert e.value.field == "held.id"
    assert giver.next(None, 1) == Admitted(4, gated=True)
    with pytest.raises(RemoteProtocolError) as e:
        giver.on_pay(encode_request(AdmitRequest(4, KEY)))
    assert e.value.field == "admit.id"


def test_the_reader_takes_an_admit_answer_only_for_its_admit_request() -> None:
    c = Control(Window(1, 9))
    event = c.pair.to_server(c.reader.send_admit(c.pair.client, KEY))
    assert isinstance(event, Credit)
    c.giver.on_pay(event.attrs)
    got = c.giver.next(c.window, 1)
    assert got == Admitted(0, gated=False)
    dat = c.pair.to_client(c.pair.server.send_dat((), encode_reply(got)))
    assert isinstance(dat, Data)
    assert c.reader.on_dat(dat.attrs) == Admitted(0, gated=False)
    assert c.reader.state is ReaderState.IDLE
    # then a held query goes on the same flow
    c.pair.to_server(c.pair.client.pay(1))
    assert c.reader.send_query(c.pair.client, "p") is not None
    reader = RangeReader(CAPABLE)
    reader.query("p1")
    with pytest.raises(RemoteProtocolError) as e:  # an admit answer to a held query
        reader.on_dat(encode_reply(Admitted(0, gated=True)))
    assert e.value.field == "admit"
    reader = RangeReader(CAPABLE)
    reader.admit(KEY)
    with pytest.raises(RemoteProtocolError) as e:  # another request's answer
        reader.on_dat(encode_reply(Admitted(1, gated=True)))
    assert e.value.field == "admit.id"
    reader = RangeReader(CAPABLE)
    with pytest.raises(RemoteProtocolError) as e:  # none asked
        reader.on_dat(encode_reply(Admitted(0, gated=True)))
    assert e.value.field == "admit.id"
