"""Giving and GiverHandler without sockets: real flow machines on both sides, a
list-backed backlog, and connections that hand each message to the peer's machine.

What is pinned: a giver sends only within paid credit, resends from the taker's
``resume``, packs Arrow DATs up to the taker's ``batch``, gives a plain taker one record
per DAT (profile label as a server, bare label as a client), applies acks, refuses wrong
directions, streams and plain takers where acks are required, keeps one taker at a time,
and ends a client flow whose server states another stream."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zio_spark.codec.records import ENCODING, decode_batch
from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    Flow,
    FlowState,
    Rejected,
    Role,
)
from zio_spark.protocol.message import Message, decode_frames
from zio_spark.protocol.negotiate import server_terms
from zio_spark.transport.flow_client import ClientFlow
from zio_spark.transport.giver import GiverHandler, GiverPolicy, Giving, Taken


class ListBacklog:
    """Records 1..n held in a list; forgets on ack (or at once for a plain taker)."""

    def __init__(self, n: int) -> None:
        self.values = {seq: b"v%d" % seq for seq in range(1, n + 1)}
        self.acked = 0
        self.log: list[tuple[str, Any]] = []
        self.taker: Giving | None = None

    def attach(self, giving: Giving, resume: int | None) -> int:
        self.taker = giving
        self.log.append(("attach", resume))
        return (resume if resume is not None else self.acked) + 1

    def detach(self, giving: Giving, reason: str) -> None:
        self.log.append(("detach", reason))

    def take(self, first: int, n: int, room: int) -> Taken | None:
        seqs = [s for s in sorted(self.values) if s >= first][:n]
        seqs = [s for i, s in enumerate(seqs) if s == seqs[0] + i]  # contiguous
        if not seqs:
            return None
        return Taken(seqs[0], [self.values[s] for s in seqs], None, None, None)

    def sent(self, first: int, last: int, records: int, dats: int, release: bool) -> None:
        self.log.append(("sent", (first, last, records, dats)))
        if release:
            for s in range(first, last + 1):
                self.values.pop(s, None)

    def ack(self, upto: int) -> None:
        self.acked = max(self.acked, upto)
        for s in [s for s in self.values if s <= upto]:
            del self.values[s]

    def stated(self, giving: Giving, last: int | None) -> dict[str, Any] | None:
        return None

    def ended(self, giving: Giving, echo: bool) -> None:
        self.log.append(("ended", echo))


class Peer:
    """The taker's flow machine at the other end: every message goes through it."""

    def __init__(self, role: Role) -> None:
        self.flow = Flow(role)
        self.events: list[Any] = []

    def take(self, msg: Message) -> Any:
        event = self.flow.receive(msg)
        self.events.append(event)
        return event

    @property
    def dats(self) -> list[Data]:
        return [e for e in self.events if isinstance(e, Data)]


class FakeServer:
    def __init__(self) -> None:
        self.flows: dict[int, tuple[Any, GiverHandler]] = {}
        self.removed: list[tuple[Any, str]] = []
        self.poked: list[Any] = []

    def remove(self, conn: Any, reason: str) -> None:
        entry = self.flows.pop(conn.peer)
        self.removed.append((conn, reason))
        entry[1].on_close(conn, reason)

    def poke(self, conn: Any) -> None:
        self.poked.append(conn)


class ServerConn:
    """A ServerFlow stand-in: the giver's server-side machine wired to a taker."""

    def __init__(self, server: FakeServer, peer: int, taker: Peer) -> None:
        self.server, self.peer, self.taker = server, peer, taker
        self.flow = Flow(Role.SERVER)
        self.name = f"peer {peer}"

    def accept(self, credit: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        self.taker.take(self.flow.accept(credit, attrs))

    def reject(self, attrs: Mapping[str, Any] | None = None) -> None:
        self.taker.take(self.flow.reject(attrs))

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> None:
        self.taker.take(self.flow.send_dat(payload, attrs))

    def send_eot(self, attrs: Mapping[str, Any] | None = None) -> None:
        self.taker.take(self.flow.send_eot(attrs))


def open_server_flow(
    handler: GiverHandler, attrs: Mapping[str, Any], *, direction: Direction = Direction.INJECT
) -> tuple[ServerConn, Peer, FakeServer]:
    server = FakeServer()
    taker = Peer(Role.CLIENT)
    conn = ServerConn(server, 1, taker)
    bot = conn.flow.receive(taker.flow.send_bot(direction, 10, attrs))
    assert isinstance(bot, BotReceived)
    server.flows[1] = (conn, handler)
    handler.on_bot(conn, bot)
    return conn, taker, server


def pay(conn: Any, taker: Peer, n: int, ack: int | None = None) -> Credit:
    credit = conn.flow.receive(taker.flow.pay(n, None if ack is None else {"ack": ack}))
    assert isinstance(credit, Credit)
    return credit


ACKING = {"ack": True, "resume": 0, "encoding": [ENCODING], "stream": "s"}
POLICY = GiverPolicy("p1", "s", 100)


def test_server_sends_only_within_paid_credit_and_resends_after_resume() -> None:
    backlog = ListBacklog(10)
    handler = GiverHandler(backlog, GiverPolicy("p1", "s", 3))
    conn, taker, _ = open_server_flow(handler, {**ACKING, "resume": 4})
    reply = taker.events[0]
    assert isinstance(reply, BotReceived)
    assert reply.attrs["producer"] == "p1" and reply.attrs["encoding"] == ENCODING
    assert backlog.log[0] == ("attach", 4)
    handler.on_credit(conn, pay(conn, taker, 1))
    assert len(taker.dats) == 1  # one DAT per credit, three records in it
    batch = decode_batch(taker.dats[0].message.payload[0])
    assert batch.column("seq").to_pylist() == [5, 6, 7]
    handler.on_credit(conn, pay(conn, taker, 5, ack=7))
    assert len(taker.dats) == 2  # 8..10: then nothing left, credit unspent
    assert conn.flow.credit == 4
    assert sorted(backlog.values) == [8, 9, 10]  # the ack forgot 1..7


def test_the_takers_batch_limit_lowers_records_per_dat() -> None:
    backlog = ListBacklog(5)
    handler = GiverHandler(backlog, GiverPolicy("p1", "s", 100))
    conn, taker, _ = open_server_flow(handler, {**ACKING, "batch": 2})
    handler.on_credit(conn, pay(conn, taker, 10))
    assert [len(decode_batch(d.message.payload[0])) for d in taker.dats] == [2, 2, 1]


def test_a_plain_taker_gets_one_record_per_dat_with_the_profile_label_and_forgets() -> None:
    backlog = ListBacklog(3)
    handler = GiverHandler(backlog, POLICY)
    conn, taker, _ = open_server_flow(handler, {"stream": "s"})
    assert backlog.log[0] == ("attach", None)
    handler.on_credit(conn, pay(conn, taker, 2))
    assert [(d.message.payload[0], d.attrs["seq"]) for d in taker.dats] == [
        (b"v1", 1),
        (b"v2", 2),
    ]
    assert sorted(backlog.values) == [3]  # released once sent: no ack will come


@pytest.mark.parametrize(
    ("attrs", "direction", "policy", "reason"),
    [
        ({}, Direction.EXTRACT, POLICY, "connect with direction inject"),
        ({"stream": "t"}, Direction.INJECT, POLICY, "no stream 't' here"),
        (
            {"stream": "s"},
            Direction.INJECT,
            GiverPolicy("p1", "s", 1, require_ack=True, plain_refusal="acks only"),
            "acks only",
        ),
    ],
)
def test_server_refusals(
    attrs: dict[str, Any], direction: Direction, policy: GiverPolicy, reason: str
) -> None:
    backlog = ListBacklog(1)
    conn, taker, _ = open_server_flow(GiverHandler(backlog, policy), attrs, direction=direction)
    (event,) = taker.events
    assert isinstance(event, Rejected) and reason in event.attrs["reason"]
    assert conn.flow.state is FlowState.CLOSED
    assert backlog.log == []  # nothing attached


def test_a_new_taker_replaces_the_old_flow_and_wake_pokes_its_engine() -> None:
    backlog = ListBacklog(2)
    first = GiverHandler(backlog, POLICY)
    conn1, _, server = open_server_flow(first, ACKING)
    second = GiverHandler(backlog, POLICY)
    taker2 = Peer(Role.CLIENT)
    conn2 = ServerConn(server, 2, taker2)
    bot = conn2.flow.receive(taker2.flow.send_bot(Direction.INJECT, 10, ACKING))
    assert isinstance(bot, BotReceived)
    server.flows[2] = (conn2, second)
    second.on_bot(conn2, bot)
    assert server.removed == [(conn1, "replaced by a new taker")]
    assert ("detach", "replaced by a new taker") in backlog.log
    assert first.giving is None and second.giving is not None
    second.giving.wake()
    assert server.poked == [conn2]


def test_eot_reaches_the_backlog_and_close_detaches_once() -> None:
    backlog = ListBacklog(1)
    handler = GiverHandler(backlog, POLICY)
    conn, taker, _ = open_server_flow(handler, ACKING)
    eot = conn.flow.receive(taker.flow.send_eot())
    assert isinstance(eot, EotReceived)
    handler.on_eot(conn, eot)
    handler.on_close(conn, "end of transmission")
    handler.on_close(conn, "again")
    assert backlog.log[1:] == [("ended", False), ("detach", "end of transmission")]


# -- client mode ---------------------------------------------------------------------


class FakePort:
    """What ClientFlow sends through, handing every message to the server's machine."""

    def __init__(self, server: Peer) -> None:
        self.server = server
        self.mode = "routerdealer"

    def send(self, msg: Message, timeout_ms: float | None = None) -> None:
        self.server.take(msg)

    def send_dat(self, codec: Any, first: int, payload: tuple[bytes, ...], **kw: Any) -> None:
        self.server.take(decode_frames(codec.frames(first, payload)))

    def send_dats(
        self, codec: Any, first: int, payloads: Sequence[tuple[bytes, ...]], **kw: Any
    ) -> None:
        for i, payload in enumerate(payloads):
            self.server.take(decode_frames(codec.frames(first + i, payload)))


class FakeClient:
    def __init__(self) -> None:
        self.endpoint = "tcp://h:1"
        self.pokes = 0
        self.conn: Any = None

    def poke(self) -> None:
        self.pokes += 1


def open_client_flow(
    handler: GiverHandler, reply: Mapping[str, Any]
) -> tuple[ClientFlow, Peer, FakeClient]:
    server = Peer(Role.SERVER)
    client = FakeClient()
    conn = ClientFlow(client, FakePort(server), None)  # type: ignore[arg-type]
    client.conn = conn
    offer = handler.offer(conn)
    conn.send(conn.flow.send_bot(offer.direction, offer.credit, offer.attrs))
    conn.offer = offer
    bot = conn.flow.receive(server.flow.accept(None, reply))
    assert isinstance(bot, BotReceived)
    handler.on_bot(conn, bot)
    return conn, server, client


def test_client_offers_to_give_and_gives_a_plain_server_bare_dats() -> None:
    backlog = ListBacklog(3)
    handler = GiverHandler(backlog, POLICY, credit=7)
    offer = handler.offer(None)  # type: ignore[arg-type]
    assert offer.direction is Direction.EXTRACT and offer.credit == 7
    assert dict(offer.attrs) == {
        "producer": "p1",
        "stream": "s",
        "ack": True,
        "encoding": [ENCODING],
    }
    conn, server, client = open_client_flow(handler, {})  # an echo-less plain server
    assert backlog.log[0] == ("attach", None)
    handler.on_credit(conn, conn.flow.receive(server.flow.pay(5)))  # type: ignore[arg-type]
    assert [d.message.payload[0] for d in server.dats] == [b"v1", b"v2", b"v3"]
    assert all(dict(d.attrs) == {} for d in server.dats)  # the reference's bare label
    assert handler.giving is not None
    handler.giving.wake()
    assert client.pokes == 1


def test_client_with_an_acking_server_resumes_and_refuses_another_stream() -> None:
    backlog = ListBacklog(4)
    handler = GiverHandler(backlog, POLICY, credit=7)
    reply = {"ack": True, "resume": 2, "encoding": ENCODING}
    conn, server, _ = open_client_flow(handler, reply)
    handler.on_credit(conn, conn.flow.receive(server.flow.pay(5)))  # type: ignore[arg-type]
    assert decode_batch(server.dats[0].message.payload[0]).column("seq").to_pylist() == [3, 4]
    with pytest.raises(RemoteProtocolError, match="takes stream 'other'"):
        open_client_flow(
            GiverHandler(ListBacklog(1), POLICY, credit=7), {**reply, "stream": "other"}
        )


@given(
    n=st.integers(0, 60),
    pays=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    batch=st.integers(1, 7),
    arrow=st.booleans(),
)
def test_pump_never_overspends_and_sends_each_record_once_in_order(
    n: int, pays: list[int], batch: int, arrow: bool
) -> None:
    backlog = ListBacklog(n)
    attrs = ACKING if arrow else {"stream": "s", "ack": True, "resume": 0}
    handler = GiverHandler(backlog, GiverPolicy("p", "s", batch))
    conn, taker, _ = open_server_flow(handler, attrs)
    terms = server_terms("giver", attrs, (ENCODING,))
    assert handler.giving is not None and handler.giving.arrow == (terms.encoding == ENCODING)
    paid = 0
    for want in pays:
        p = min(want, taker.flow.credit)  # a taker pays at most what it holds
        if p == 0:
            continue
        paid += p
        handler.on_credit(conn, pay(conn, taker, p))
        assert len(taker.dats) <= paid  # never beyond the credit paid
    seqs: list[int] = []
    for d in taker.dats:
        if arrow:
            got = decode_batch(d.message.payload[0]).column("seq").to_pylist()
            assert len(got) <= batch
            seqs += got
        else:
            seqs.append(d.attrs["seq"])
    per_dat = batch if arrow else 1
    assert seqs == list(range(1, min(n, paid * per_dat) + 1))
