"""FlowClient against real peers: a flow opens, gives within credit, ends by EOT; a
server's EOT makes it reopen; a silent peer times the BOT out; one Loop thread drives a
server and two clients inline."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tests.support import wait_until
from zio_spark.protocol.flow import BotReceived, Credit, Data, Direction, EotReceived
from zio_spark.transport.curve import client_curve, server_curve
from zio_spark.transport.flow_client import ClientFlow, ClientHandler, FlowClient, Offer
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.loop import Loop
from zio_spark.transport.port import ServerPort


class Taker(FlowHandler):
    """Server side: accepts, pays 10, collects payloads."""

    def __init__(self, got: list[bytes], conns: list[ServerFlow]) -> None:
        self.got, self.conns = got, conns

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        conn.accept()
        conn.pay(10)
        self.conns.append(conn)

    def on_data(self, conn: ServerFlow, data: Data) -> None:
        self.got.append(data.message.payload[0])


class Giver(ClientHandler):
    """Client side: offers to give; sends ``todo`` while it has credit."""

    def __init__(self, todo: list[bytes]) -> None:
        self.todo = todo
        self.bots: list[BotReceived] = []
        self.closed: list[str] = []
        self.eots: list[EotReceived] = []

    def offer(self, conn: ClientFlow) -> Offer:
        return Offer(Direction.EXTRACT, 10, {"stream": "s"})

    def on_bot(self, conn: ClientFlow, bot: BotReceived) -> None:
        self.bots.append(bot)

    def on_credit(self, conn: ClientFlow, credit: Credit) -> None:
        self.on_tick(conn, 0.0)

    def on_tick(self, conn: ClientFlow, now: float) -> None:
        while self.todo and conn.flow.credit > 0 and conn.flow.state.name == "READY":
            conn.send_dat((self.todo.pop(0),))

    def on_eot(self, conn: ClientFlow, eot: EotReceived) -> None:
        self.eots.append(eot)

    def on_close(self, conn: ClientFlow, reason: str) -> None:
        self.closed.append(reason)


@pytest.fixture
def server(ctx: zmq.Context[Any]) -> Iterator[tuple[FlowServer, list[bytes], list[ServerFlow]]]:
    got: list[bytes] = []
    conns: list[ServerFlow] = []
    port = ServerPort(ctx, linger_ms=0)
    port.bind("tcp://127.0.0.1:*")
    srv = FlowServer(port, lambda: Taker(got, conns), ctx=ctx).start()
    yield srv, got, conns
    srv.stop()


def test_a_flow_gives_within_credit_and_ends_at_the_echo_of_its_eot(ctx, server):
    srv, got, _ = server
    handler = Giver([b"a", b"b", b"c"])
    client = FlowClient(srv.endpoint, handler, ctx=ctx, name="t").start()
    try:
        wait_until(lambda: got == [b"a", b"b", b"c"], what="three DATs")
        assert client.stats["connects"] == 1 and client.stats["flows"] == 1
        sent = threading.Event()
        client.call_soon(lambda: sent.set() if client.send_eot() else None)
        wait_until(sent.is_set, what="EOT sent")
        wait_until(lambda: handler.closed == ["end of transmission"], what="the echo")
        assert handler.eots[0].echo
        assert client.conn is None and client.ending
    finally:
        client.stop()
    assert client.stats["connects"] == 1  # nothing reopened after our EOT


def test_a_servers_eot_is_echoed_and_a_new_flow_opens(ctx, server):
    srv, _, conns = server
    handler = Giver([])
    client = FlowClient(srv.endpoint, handler, ctx=ctx, name="t").start()
    try:
        wait_until(lambda: len(conns) == 1, what="first flow")
        srv.call_soon(lambda: conns[0].send_eot())
        wait_until(lambda: len(handler.bots) == 2, what="a second flow")
        assert handler.closed[0] == "the server ended the flow"
        assert not handler.eots[0].echo
        assert client.stats["flow_failures"] == 0
    finally:
        client.stop()


def test_a_silent_peer_times_the_bot_out_and_a_hopeless_one_is_given_up(ctx):
    silent = ctx.socket(zmq.ROUTER)
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        handler = Giver([])
        client = FlowClient(endpoint, handler, ctx=ctx, connect_timeout=0.2, name="t").start()
        try:
            wait_until(lambda: client.stats["bot_timeouts"] >= 2, what="two BOT timeouts")
            assert client.last_error is not None
            assert client.last_error.startswith("no BOT reply within 0.2 s; nothing answered at")
            assert client.gave_up is None
        finally:
            client.stop()

        class Hopeless(Giver):
            def no_reply(self, conn: ClientFlow, timeout: float) -> tuple[str, bool]:
                return "never", True

        hopeless = Hopeless([])
        client = FlowClient(endpoint, hopeless, ctx=ctx, connect_timeout=0.2, name="t").start()
        try:
            wait_until(lambda: client.gave_up == "never", what="giving up")
            assert hopeless.closed == ["never"]
            assert client.stats["connects"] == 1
            assert client.diagnosis() == "never"
        finally:
            client.stop()
    finally:
        silent.close(0)


def test_one_loop_drives_a_server_and_two_clients_inline(ctx):
    got: list[bytes] = []
    conns: list[ServerFlow] = []
    port = ServerPort(ctx, linger_ms=0)
    endpoint = port.bind("tcp://127.0.0.1:*")
    loop = Loop(tick=0.01)
    srv = FlowServer(port, lambda: Taker(got, conns), ctx=ctx, loop=loop)
    givers = [Giver([b"x1", b"x2"]), Giver([b"y1"])]
    clients = [FlowClient(endpoint, g, ctx=ctx) for g in givers]
    for c in clients:
        loop.add(c)
    try:
        wait_until(
            lambda: loop.turn(0.01) is not None and sorted(got) == [b"x1", b"x2", b"y1"],
            what="both clients' DATs",
            interval=0,
        )
        assert [c.stats["flows"] for c in clients] == [1, 1]
        assert len(srv.flows) == 2
    finally:
        for c in clients:
            c.close()
        srv.close()
        loop.close()
    assert srv.sockets() == [] and all(c.sockets() == [] for c in clients)


class Diagnosed(Giver):
    """Records what the monitor had seen when the BOT timed out."""

    def __init__(self) -> None:
        super().__init__([])
        self.seen: list[Any] = []

    def no_reply(self, conn: ClientFlow, timeout: float) -> tuple[str, bool]:
        self.seen.append(conn.seen)
        return f"silent ({conn.seen.handshake_error})", False


@pytest.mark.parametrize("patient", [False, True])
def test_a_refused_curve_handshake_fails_at_once_or_waits_to_be_diagnosed(ctx, patient):
    _, server_secret = zmq.curve_keypair()
    wrong_public, _ = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    port = ServerPort(ctx, linger_ms=0, curve=server_curve(server_secret))
    endpoint = port.bind("tcp://127.0.0.1:*")
    srv = FlowServer(port, lambda: Taker([], []), ctx=ctx).start()
    handler = Diagnosed()
    client = FlowClient(
        endpoint,
        handler,
        ctx=ctx,
        connect_timeout=0.5,
        patient=patient,
        # Not the server's public key: the handshake fails.
        port_options={"curve": client_curve(wrong_public, client_secret, client_public)},
        name="t",
    ).start()
    try:
        if patient:
            wait_until(lambda: client.stats["bot_timeouts"] >= 1, what="a BOT timeout")
            seen = handler.seen[0]
            assert not seen.handshaked and (seen.refused or seen.handshake_error)
            assert client.stats["disconnects"] == 0
        else:
            wait_until(lambda: client.stats["disconnects"] >= 1, what="a disconnect")
            assert client.last_error is not None
            assert client.last_error.startswith("the connection closed before a BOT reply")
            assert client.stats["unanswered"] >= 1
        assert client.stats["flows"] == 0 and len(srv.flows) == 0
    finally:
        client.stop()
        srv.stop()
