"""Loopback tests of FlowEndpoint (zio_spark.transport.flow_endpoint) over real ports, both modes.

The client end runs over a :class:`ClientPort`; the server end over a :class:`ServerPort`
seen through :class:`OneClient` (one client's view of the port, the ``Channel`` a
single-flow server needs). Blocking calls of the two ends run in two threads when they
must overlap; every wait has a deadline, so a lost message fails instead of hanging.
Endpoints are 127.0.0.1 random ports, unique inproc names or ipc under tmp_path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from tests.support import Background
from zio_spark.errors import LocalProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import Credit, Data, Direction, Flow, FlowState, Role
from zio_spark.protocol.message import DatCodec, Message, encode_frames, encode_single
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import BadMessage, ClientPort, PeerId, ServerPort

WAIT = 5.0  # deadline for what must happen (returns as soon as it does)
SHORT = 0.2  # timeouts that are meant to run out

MakeServer = Callable[..., ServerPort]
MakeClient = Callable[..., ClientPort]


class OneClient:
    """A :class:`ServerPort` as the channel of one client's flow (the first to speak)."""

    def __init__(self, port: ServerPort) -> None:
        self.port = port
        self.peer: PeerId | None = None

    @property
    def endpoint(self) -> str:
        assert self.port.endpoint is not None
        return self.port.endpoint

    def send(self, msg: Message) -> None:
        self.port.send(msg, self.peer)

    def send_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...]) -> None:
        self.port.send_dat(codec, seqno, payload, self.peer)

    def send_dats(self, codec: DatCodec, first: int, payloads: Any) -> None:
        for i, payload in enumerate(payloads):
            self.port.send_dat(codec, first + i, payload, self.peer)

    def recv(self, timeout_ms: int) -> Message | BadMessage | None:
        got = self.port.recv(timeout_ms)
        if got is None or isinstance(got, BadMessage):
            return got
        peer, msg = got
        if self.peer is None:
            self.peer = peer
        assert peer == self.peer, f"a second client {peer!r} on a one-client channel"
        return msg

    def recv_many(self, max_n: int, timeout_ms: int) -> list[Message | BadMessage]:
        out: list[Message | BadMessage] = []
        for got in self.port.recv_many(max_n, timeout_ms):
            if isinstance(got, BadMessage):
                out.append(got)
                continue
            peer, msg = got
            if self.peer is None:
                self.peer = peer
            assert peer == self.peer, f"a second client {peer!r} on a one-client channel"
            out.append(msg)
        return out


class Ends:
    """A connected (not yet handshaken) client endpoint and server endpoint."""

    def __init__(self, client_port: ClientPort, server_port: ServerPort) -> None:
        self.client_port = client_port
        self.server_port = server_port
        self.credits: list[Credit] = []  # PAYs seen by whichever end gives
        self.client = FlowEndpoint(client_port, Role.CLIENT, origin=1, on_credit=self._credit)
        self.server = FlowEndpoint(
            OneClient(server_port), Role.SERVER, origin=2, on_credit=self._credit
        )

    def _credit(self, credit: Credit) -> None:
        self.credits.append(credit)

    def handshake(
        self,
        client_direction: Direction,
        offer: int,
        accept: int | None = None,
        client_attrs: dict[str, Any] | None = None,
        server_attrs: dict[str, Any] | None = None,
    ) -> None:
        """The BOT exchange, step by step in this thread."""
        self.client.send_bot(client_direction, offer, client_attrs)
        self.server.recv_bot(WAIT)
        self.server.accept(accept, server_attrs)
        self.client.recv_bot(WAIT)

    @property
    def giver(self) -> FlowEndpoint:
        return self.client if self.client.is_sender else self.server

    @property
    def taker(self) -> FlowEndpoint:
        return self.server if self.client.is_sender else self.client


@pytest.fixture
def make_ends(
    make_server: MakeServer, make_client: MakeClient, tcp_any: str
) -> Callable[..., Ends]:
    def make(mode: str = "routerdealer", where: str | None = None) -> Ends:
        server = make_server(mode=mode)
        client = make_client(mode=mode)
        client.connect(server.bind(where or tcp_any))
        return Ends(client, server)

    return make


@pytest.fixture
def background() -> Iterator[Callable[..., Background]]:
    made: list[Background] = []

    def start(fn: Callable[[], Any], name: str = "flow-end") -> Background:
        bg = Background(fn, name)
        made.append(bg)
        return bg

    yield start
    # A test that failed half-way may leave a call blocked on its own deadline: let it
    # finish before the port fixtures close the sockets under it.
    for bg in made:
        bg.thread.join(WAIT + 1)


def payloads(n: int) -> list[tuple[bytes, ...]]:
    return [(f"record {i}".encode(), bytes([i % 256]) * i) for i in range(n)]


def take_all(taker: FlowEndpoint, *, auto_pay: bool = True) -> list[Data]:
    """Get DATs until the peer's EOT, then echo it."""
    got: list[Data] = []
    while (data := taker.get(WAIT, auto_pay=auto_pay)) is not None:
        got.append(data)
    taker.send_eot(timeout=WAIT)
    return got


# ------------------------------------------------------------------------------ handshake


def test_bot_handshake_with_lowered_credit(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.client.send_bot(Direction.EXTRACT, 10, {"stream": "s", "resume": 4})
    offer = ends.server.recv_bot(WAIT)
    assert offer.direction is Direction.EXTRACT and offer.credit == 10
    assert dict(offer.attrs) == {"stream": "s", "resume": 4}
    assert ends.server.state is FlowState.BOT_RECEIVED

    ends.server.accept(3, {"producer": "p-1"})
    agreed = ends.client.recv_bot(WAIT)
    assert agreed.direction is Direction.INJECT and agreed.credit == 3
    assert dict(agreed.attrs) == {"producer": "p-1"}
    assert ends.client.bot is agreed and ends.server.bot is offer
    assert ends.client.state is ends.server.state is FlowState.READY
    assert ends.client.is_sender and not ends.server.is_sender
    # The giver starts with nothing, the taker holds every agreed credit.
    assert (ends.client.flow.credit, ends.server.flow.credit) == (0, 3)
    assert ends.client.flow.total_credit == ends.server.flow.total_credit == 3


def test_connect_is_send_bot_then_recv_bot(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    connecting = background(lambda: ends.client.connect(Direction.INJECT, 8, {"a": 1}, WAIT))
    offer = ends.server.recv_bot(WAIT)
    assert offer.direction is Direction.INJECT and dict(offer.attrs) == {"a": 1}
    ends.server.accept(5)
    agreed = connecting.result()
    assert agreed.direction is Direction.EXTRACT and agreed.credit == 5
    assert not ends.client.is_sender and ends.server.is_sender


# ------------------------------------------------------------------------------- transfer


@pytest.mark.parametrize("transport", ["tcp", "ipc", "inproc"])
def test_client_giver_to_server_taker(request, make_ends, background, transport, inproc_endpoint):
    where = {"tcp": None, "inproc": inproc_endpoint}.get(transport)
    if transport == "ipc":
        where = request.getfixturevalue("ipc_endpoint")
    ends = make_ends("routerdealer", where)
    ends.handshake(Direction.EXTRACT, 16, accept=4)
    sent = payloads(25)

    def give() -> Any:
        for p in sent:
            assert ends.client.put(p, {"n": len(p[1])}, timeout=WAIT)
        return ends.client.send_eot(timeout=WAIT)

    giving = background(give, "giver")
    got = take_all(ends.server)
    echo = giving.result()
    assert echo.echo
    assert [d.message.payload for d in got] == sent
    assert [d.attrs["n"] for d in got] == [len(p[1]) for p in sent]
    # seqno counts every message the giver sent: BOT = 0, then the DATs 1..25.
    assert [d.message.seqno for d in got] == list(range(1, 26))
    assert {d.message.origin for d in got} == {1}
    assert ends.client.state is ends.server.state is FlowState.CLOSED
    assert sum(c.amount for c in ends.credits) >= 25
    assert ends.client.flow.dats_sent == ends.server.flow.dats_received == 25


def test_server_giver_to_client_taker(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.INJECT, 5)
    sent = payloads(17)

    def give() -> Any:
        for p in sent:
            assert ends.server.put(p, timeout=WAIT)
        return ends.server.send_eot(timeout=WAIT)

    giving = background(give, "giver")
    got = take_all(ends.client)
    assert giving.result().echo
    assert [d.message.payload for d in got] == sent
    assert {d.message.origin for d in got} == {2}
    assert ends.client.state is ends.server.state is FlowState.CLOSED


# ------------------------------------------------------------------------------- credit


def test_put_waits_for_credit(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 2)
    putting = background(lambda: ends.client.put((b"first",), timeout=WAIT))
    assert putting.running_after(SHORT), "put() sent a DAT without credit"
    ends.server.pay(1)
    assert putting.result() is True
    data = ends.server.get(WAIT, auto_pay=False)
    assert data is not None and data.message.payload == (b"first",)
    assert ends.client.flow.credit == 0 and ends.server.flow.credit == 2
    assert [c.amount for c in ends.credits] == [1]


def test_put_times_out_with_a_transport_error_naming_the_endpoint(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 2)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="credit") as err:
        ends.client.put((b"x",), timeout=SHORT)
    assert SHORT <= time.monotonic() - t0 < SHORT + 1.0
    assert err.value.endpoint == ends.client_port.endpoint
    assert ends.client_port.endpoint in str(err.value)
    assert ends.client.flow.dats_sent == 0 and ends.client.state is FlowState.READY


def test_get_with_auto_pay_hands_back_every_credit(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.INJECT, 3)
    with pytest.raises(TransportError, match="a DAT"):
        ends.client.get(SHORT)  # pays all 3 first, then waits in vain
    assert ends.client.flow.credit == 0
    for i in range(3):  # the first put takes in the PAY
        assert ends.server.put((bytes([i]),), timeout=WAIT)
    assert [c.amount for c in ends.credits] == [3] and ends.server.flow.credit == 0
    got = [ends.client.get(WAIT, auto_pay=False) for _ in range(3)]
    assert [d.message.payload for d in got] == [(b"\0",), (b"\1",), (b"\2",)]
    assert ends.client.flow.credit == 3  # one regained per DAT


def test_get_without_auto_pay_leaves_credit_to_the_caller(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 4)
    with pytest.raises(TransportError, match="a DAT") as err:
        ends.server.get(SHORT, auto_pay=False)
    assert err.value.endpoint == ends.server_port.endpoint
    assert ends.server.flow.credit == 4  # nothing handed out
    assert ends.client.poll() is True and ends.credits == []

    ends.server.pay(2, {"ack": 7})
    assert ends.client.put((b"a",), timeout=WAIT) and ends.client.put((b"b",), timeout=WAIT)
    assert [(c.amount, dict(c.attrs)) for c in ends.credits] == [(2, {"ack": 7})]
    assert ends.server.get(WAIT, auto_pay=False).message.payload == (b"a",)
    assert ends.server.get(WAIT, auto_pay=False).message.payload == (b"b",)
    assert ends.server.flow.credit == 4 and ends.client.flow.credit == 0

    # Profile: an ack-only PAY (credit 0) acknowledges without handing out credit.
    ends.server.pay(0, {"ack": 9})
    deadline = time.monotonic() + WAIT
    while len(ends.credits) < 2:
        assert time.monotonic() < deadline, "the ack-only PAY never arrived"
        ends.client_port.socket.poll(10)
        assert ends.client.poll() is True
    assert [(c.amount, dict(c.attrs)) for c in ends.credits][1] == (0, {"ack": 9})
    assert ends.client.flow.credit == 0
    with pytest.raises(TransportError):
        ends.client.put((b"c",), timeout=SHORT)


def test_wrong_direction_calls_are_local_errors(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 2)
    with pytest.raises(LocalProtocolError, match="giver"):
        ends.client.get(SHORT)
    with pytest.raises(LocalProtocolError):
        ends.server.put((b"x",), timeout=SHORT)


# -------------------------------------------------------------------- end of transmission


def test_taker_initiated_eot_drains_dats_through_on_data(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 5)
    ends.server.pay()  # all 5 out: the giver may send before it sees our EOT

    def give() -> Any:
        for i in range(3):
            assert ends.client.put((b"late %d" % i,), timeout=WAIT)
        deadline = time.monotonic() + WAIT
        while ends.client.poll():  # until the taker's EOT arrives
            assert time.monotonic() < deadline, "no EOT from the taker"
            ends.client_port.socket.poll(10)  # wait for input without consuming it
        assert not ends.client.put((b"refused",), timeout=WAIT)  # EOT pending: nothing sent
        return ends.client.send_eot(timeout=WAIT)  # only echoes

    giving = background(give, "giver")
    # Let the first DAT arrive (the giver has seen the PAY), so all three are on their way.
    assert ends.server_port.socket.poll(int(WAIT * 1000)), "no DAT from the giver"
    drained: list[Data] = []
    echo = ends.server.send_eot({"why": "enough"}, timeout=WAIT, on_data=drained.append)
    peer_view = giving.result()
    assert echo.echo and not peer_view.echo
    assert dict(peer_view.attrs) == {"why": "enough"}
    assert [d.message.payload for d in drained] == [(b"late %d" % i,) for i in range(3)]
    assert ends.client.state is ends.server.state is FlowState.CLOSED


def test_giver_initiated_eot_drains_pays(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 2)
    taking = background(lambda: take_all(ends.server), "taker")
    for i in range(6):
        assert ends.client.put((bytes([i]),), timeout=WAIT)
    echo = ends.client.send_eot(timeout=WAIT)
    got = taking.result()
    assert echo.echo and ends.server.peer_eot is not None and not ends.server.peer_eot.echo
    assert [d.message.payload for d in got] == [(bytes([i]),) for i in range(6)]
    # Every PAY, including those drained while waiting for the echo, reached on_credit.
    assert sum(c.amount for c in ends.credits) >= 6
    assert ends.client.state is ends.server.state is FlowState.CLOSED


def test_eot_from_both_sides_at_once(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.INJECT, 2)
    server_end = background(lambda: ends.server.send_eot(timeout=WAIT), "server-eot")
    client_eot = ends.client.send_eot(timeout=WAIT)
    server_eot = server_end.result()
    assert client_eot.attrs == {} and server_eot.attrs == {}
    assert ends.client.state is ends.server.state is FlowState.CLOSED


def test_eot_carries_payload_and_attrs_to_the_echo(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.INJECT, 1)

    def answer() -> Any:
        assert ends.server.put((b"only",), timeout=WAIT)
        assert not ends.server.put((b"no",), timeout=WAIT)  # EOT instead of credit
        eot = ends.server.peer_eot
        ends.server.send_eot({"seen": eot.payload[0].decode()}, timeout=WAIT)
        return eot

    answering = background(answer, "server")
    assert ends.client.get(WAIT).message.payload == (b"only",)
    ends.client.channel.send(ends.client.flow.send_eot({"bye": True}, payload=(b"p",)))
    echo = ends.client.recv_eot(WAIT)
    eot = answering.result()
    assert dict(eot.attrs) == {"bye": True} and eot.payload == (b"p",)
    assert echo.echo and dict(echo.attrs) == {"seen": "p"}


# ---------------------------------------------------------------------------- rejection


def test_flow_rejected_when_the_server_answers_eot(make_server, make_client, tcp_any, wire_mode):
    server = make_server(mode=wire_mode)
    client_port = make_client(mode=wire_mode)
    client_port.connect(server.bind(tcp_any))
    client = FlowEndpoint(client_port, Role.CLIENT)
    client.send_bot(Direction.INJECT, 4, {"stream": "nope"})

    got = server.recv(int(WAIT * 1000))
    assert got is not None and not isinstance(got, BadMessage)
    peer, bot = got
    machine = Flow(Role.SERVER)
    machine.receive(bot)
    server.send(machine.reject({"reason": "no stream 'nope' here"}), peer)

    with pytest.raises(FlowRejected) as err:
        client.recv_bot(WAIT)
    assert isinstance(err.value, TransportError)
    assert err.value.attrs == {"reason": "no stream 'nope' here"}
    assert err.value.endpoint == client_port.endpoint
    assert "no stream 'nope' here" in str(err.value)
    assert client.state is FlowState.CLOSED


# ----------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("step", ["client recv_bot", "server recv_bot", "get", "recv_eot"])
def test_every_wait_times_out_with_the_endpoint(make_ends, wire_mode, step):
    ends = make_ends(wire_mode)
    if step == "server recv_bot":
        end, call = ends.server, lambda: ends.server.recv_bot(SHORT)
        expected = ends.server_port.endpoint
    elif step == "client recv_bot":
        ends.client.send_bot(Direction.INJECT, 1)  # nobody answers
        end, call = ends.client, lambda: ends.client.recv_bot(SHORT)
        expected = ends.client_port.endpoint
    elif step == "get":
        ends.handshake(Direction.INJECT, 1)
        end, call = ends.client, lambda: ends.client.get(SHORT)
        expected = ends.client_port.endpoint
    else:
        ends.handshake(Direction.INJECT, 1)
        ends.client.channel.send(ends.client.flow.send_eot())  # the server never echoes
        end, call = ends.client, lambda: ends.client.recv_eot(SHORT)
        expected = ends.client_port.endpoint
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"timed out after 0\.2 s") as err:
        call()
    assert SHORT <= time.monotonic() - t0 < SHORT + 1.0
    assert err.value.endpoint == expected == end.endpoint
    assert f"(endpoint {expected})" in str(err.value)


def test_send_eot_times_out_when_no_echo_comes(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 1)
    with pytest.raises(TransportError, match="EOT echo"):
        ends.client.send_eot(timeout=SHORT)
    assert ends.client.state is FlowState.EOT_SENT


# ------------------------------------------------------------------------- bad messages


def test_a_bad_message_from_the_port_raises(make_client, raw_socket, tcp_any, wire_mode):
    """The client port reports garbage as a BadMessage; the endpoint raises its error."""
    raw = raw_socket(zmq.SERVER if wire_mode == "clientserver" else zmq.ROUTER)
    raw.bind(tcp_any)
    client_port = make_client(mode=wire_mode)
    client_port.connect(raw.last_endpoint.decode())
    client = FlowEndpoint(client_port, Role.CLIENT)
    client.send_bot(Direction.INJECT, 2)
    assert raw.poll(int(WAIT * 1000)), "the BOT never arrived"
    if wire_mode == "clientserver":
        frame = raw.recv(copy=False)
        raw.send(b"\x05ZIO0F", routing_id=frame.routing_id)  # a part cut short
    else:
        identity = raw.recv_multipart()[0]
        raw.send_multipart([identity, b"", b"not a ZIO prefix", b"\0" * 24])

    with pytest.raises(RemoteProtocolError) as err:
        client.recv_bot(WAIT)
    assert err.value.peer == client_port.endpoint
    assert client_port.stats["bad_messages"] == 1

    # The bad message was consumed: a good BOT afterwards completes the handshake.
    reply = Flow(Role.SERVER)
    reply.receive(Flow(Role.CLIENT).send_bot(Direction.INJECT, 2))
    good = reply.accept()
    if wire_mode == "clientserver":
        raw.send(encode_single(good), routing_id=frame.routing_id)
    else:
        raw.send_multipart([identity, b"", *encode_frames(good)])
    assert client.recv_bot(WAIT).credit == 2


# ----------------------------------------------------------------------------- get_many


@pytest.mark.parametrize("taker_side", ["client", "server"])
def test_get_many_takes_queued_dats_a_batch_at_a_time(
    make_ends, wire_mode, inproc_endpoint, background, taker_side
):
    # inproc: a sent message is in the receiver's queue when send returns, so what
    # "already queued" means is exact here.
    ends = make_ends(wire_mode, inproc_endpoint)
    ends.handshake(Direction.INJECT if taker_side == "client" else Direction.EXTRACT, 16)
    taker, giver = ends.taker, ends.giver
    assert taker is (ends.client if taker_side == "client" else ends.server)
    sent = payloads(10)
    with pytest.raises(TransportError, match="a DAT"):
        taker.get_many(4, SHORT)  # hands the 16 credits over, then times out
    for p in sent:
        assert giver.put(p, timeout=WAIT)
    sizes = []
    got: list[Data] = []
    while len(got) < len(sent):
        batch = taker.get_many(4, WAIT, auto_pay=False)
        sizes.append(len(batch))
        got.extend(batch)
    assert sizes == [4, 4, 2]
    assert [d.message.payload for d in got] == sent
    assert [d.message.seqno for d in got] == list(range(1, 11))  # the BOT was 0
    assert taker.flow.credit == 10 and taker.flow.dats_received == 10
    ending = background(lambda: giver.send_eot(timeout=WAIT), "giver")
    assert taker.get_many(4, WAIT) == []  # the peer's EOT
    assert taker.peer_eot is not None
    assert taker.get_many(4, WAIT) == []  # and stays ended
    taker.send_eot(timeout=WAIT)
    assert ending.result().echo
    assert taker.state is giver.state is FlowState.CLOSED


def test_get_many_times_out_and_checks_its_caller(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.INJECT, 3)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="a DAT") as err:
        ends.client.get_many(10, SHORT)
    assert SHORT <= time.monotonic() - t0 < SHORT + 1.0
    assert err.value.endpoint == ends.client_port.endpoint
    assert ends.client.flow.credit == 0  # auto_pay handed the 3 over first
    with pytest.raises(LocalProtocolError, match="giver"):
        ends.server.get_many(10, SHORT)
    with pytest.raises(ValueError, match="max_n"):
        ends.client.get_many(0, SHORT)


def test_get_many_returns_the_good_dats_before_a_violation_then_raises(
    make_ends, wire_mode, inproc_endpoint
):
    ends = make_ends(wire_mode, inproc_endpoint)
    ends.handshake(Direction.INJECT, 8)
    with pytest.raises(TransportError):
        ends.client.get_many(8, 0.05)  # hands the 8 credits over
    for i in range(3):
        assert ends.server.put((bytes([i]),), timeout=WAIT)
    # Then a PAY: a giver must never send one (and two more DATs behind it).
    peer = ends.server.channel.peer
    ends.server_port.send(Message("FLOW", '{"flow": "PAY", "credit": 1}'), peer)
    for i in range(2):
        ends.server_port.send(Message("FLOW", '{"flow": "DAT"}', seqno=3 + i), peer)
    got = ends.client.get_many(100, WAIT, auto_pay=False)
    assert [d.message.payload for d in got] == [(b"\0",), (b"\1",), (b"\2",)]
    with pytest.raises(RemoteProtocolError, match="PAY"):
        ends.client.get_many(100, WAIT, auto_pay=False)
    assert ends.client.state is FlowState.ERROR


def test_get_many_keeps_the_dats_behind_a_bad_message(make_ends, wire_mode, inproc_endpoint):
    """As get() does: the DATs before it, then the error, then the DATs after it (found by
    review: those were taken off the port and dropped, their credit never regained)."""
    ends = make_ends(wire_mode, inproc_endpoint)
    ends.handshake(Direction.INJECT, 10)
    with pytest.raises(TransportError):
        ends.client.get_many(10, 0.05)  # hands the 10 credits over
    assert ends.server.put((b"r0",), timeout=WAIT)
    ends.server_port.send_frames([b"garbage", b"x"], ends.server.channel.peer)
    for i in (1, 2):
        assert ends.server.put((b"r%d" % i,), timeout=WAIT)
    first = ends.client.get_many(100, WAIT, auto_pay=False)
    assert [d.message.payload for d in first] == [(b"r0",)]
    with pytest.raises(RemoteProtocolError) as e:
        ends.client.get_many(100, WAIT, auto_pay=False)
    assert e.value.field == "prefix"
    rest = ends.client.get_many(100, WAIT, auto_pay=False)
    assert [d.message.payload for d in rest] == [(b"r1",), (b"r2",)]
    assert ends.client.flow.credit == 3 and ends.client.state is FlowState.READY


def test_an_error_get_many_deferred_is_raised_by_get_too(make_ends, wire_mode, inproc_endpoint):
    ends = make_ends(wire_mode, inproc_endpoint)
    ends.handshake(Direction.INJECT, 4)
    with pytest.raises(TransportError):
        ends.client.get_many(4, 0.05)
    assert ends.server.put((b"ok",), timeout=WAIT)
    ends.server_port.send(Message("FLOW", '{"flow": "PAY", "credit": 1}'), ends.server.channel.peer)
    assert [d.message.payload for d in ends.client.get_many(10, WAIT)] == [(b"ok",)]
    with pytest.raises(RemoteProtocolError, match="PAY"):
        ends.client.get(WAIT, auto_pay=False)


# ----------------------------------------------------------------------------- put_many


@pytest.mark.parametrize("giver_side", ["client", "server"])
def test_put_many_sends_every_payload_in_order_within_the_credit(
    make_ends, wire_mode, background, giver_side
):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT if giver_side == "client" else Direction.INJECT, 4)
    giver, taker = ends.giver, ends.taker
    sent = payloads(23)
    giving = background(lambda: giver.put_many(sent, timeout=WAIT), "giver")
    got: list[Data] = []
    while len(got) < len(sent):
        got.extend(taker.get_many(4, WAIT))  # pays back what it took, 4 credits at most
    assert giving.result() == len(sent)
    assert [d.message.payload for d in got] == sent
    assert [d.message.seqno for d in got] == list(range(1, 24))
    assert giver.flow.dats_sent == 23
    assert giver.put_many([], timeout=SHORT) == 0


def test_put_many_stops_at_the_peers_eot(make_ends, wire_mode, background):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 3)
    ends.server.pay(3)
    ending = background(lambda: ends.server.send_eot(timeout=WAIT, on_data=lambda d: None))
    assert ends.client.put_many(payloads(10), timeout=WAIT) == 3  # then the EOT came
    assert ends.client.peer_eot is not None
    ends.client.send_eot(timeout=WAIT)
    assert ending.result().echo


def test_put_many_times_out_without_credit(make_ends, wire_mode):
    ends = make_ends(wire_mode)
    ends.handshake(Direction.EXTRACT, 2)
    ends.server.pay(2)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="credit") as err:
        ends.client.put_many(payloads(5), timeout=SHORT)
    assert SHORT <= time.monotonic() - t0 < SHORT + 1.0
    assert err.value.endpoint == ends.client_port.endpoint
    assert ends.client.flow.dats_sent == 2  # the two it had credit for went out
    got = ends.server.get_many(10, WAIT, auto_pay=False)
    assert [d.message.payload for d in got] == payloads(2)


def test_put_many_says_how_many_went_out_when_the_queue_stays_full(
    make_server, make_client, inproc_endpoint, wire_mode
):
    server_port = make_server(mode=wire_mode, rcvhwm=5)
    client_port = make_client(mode=wire_mode, sndhwm=5, send_timeout_ms=100)
    client_port.connect(server_port.bind(inproc_endpoint))
    ends = Ends(client_port, server_port)
    ends.handshake(Direction.EXTRACT, 50)
    ends.server.pay(50)
    with pytest.raises(TransportError, match="could not queue") as err:
        ends.client.put_many(payloads(50), timeout=WAIT)  # nobody reads: the queues fill
    sent = err.value.sent
    assert sent is not None and 0 < sent < 50
    got: list[Data] = []
    while len(got) < sent:
        got.extend(ends.server.get_many(100, WAIT, auto_pay=False))
    assert [d.message.payload for d in got] == payloads(sent)
    with pytest.raises(TransportError):
        ends.server.get_many(100, SHORT, auto_pay=False)  # and nothing more
