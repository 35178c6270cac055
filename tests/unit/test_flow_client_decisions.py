"""The flow client without sockets: the back-off, what a monitor event means for a
connection, when an unanswered BOT is overdue, and the engine itself over a stand-in
port (``make_port``) with explicit clocks: reconnects, back-off, BOT timeouts,
rejections, a server's EOT, handler errors, patient and impatient disconnects."""

from __future__ import annotations

import collections
import struct
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from zio_spark.protocol.flow import BotReceived, Direction, Flow, FlowState, Role
from zio_spark.protocol.message import Message
from zio_spark.transport.flow_client import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    Backoff,
    ClientFlow,
    ClientHandler,
    FlowClient,
    Offer,
    Seen,
    bot_overdue,
    note_monitor_event,
)
from zio_spark.transport.wire import SocketMode


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff()
    assert [b.failed() for _ in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert (BACKOFF_MIN, BACKOFF_MAX) == (0.2, 5.0)
    b.reset()
    assert b.delay == 0.2 and b.failed() == 0.2


@given(st.floats(0.001, 10), st.floats(0.001, 100), st.integers(0, 40))
def test_backoff_never_shrinks_before_a_reset_and_stays_within_bounds(
    first: float, most: float, failures: int
) -> None:
    b = Backoff(first, max(first, most))
    delays = [b.failed() for _ in range(failures)]
    assert delays == sorted(delays)
    assert all(first <= d <= max(first, most) for d in delays)


def test_a_disconnect_fails_the_flow_at_once_unless_patient_and_never_handshaked() -> None:
    impatient = Seen()
    assert note_monitor_event(impatient, zmq.EVENT_DISCONNECTED, patient=False)
    assert impatient.disconnected and not impatient.refused

    refused = Seen()
    assert not note_monitor_event(refused, zmq.EVENT_CONNECTED, patient=True)
    assert not note_monitor_event(refused, zmq.EVENT_DISCONNECTED, patient=True)
    assert refused == Seen(connected=True, refused=True)

    talked = Seen()
    assert not note_monitor_event(talked, zmq.EVENT_HANDSHAKE_SUCCEEDED, patient=True)
    assert note_monitor_event(talked, zmq.EVENT_DISCONNECTED, patient=True)
    assert talked.handshaked and talked.disconnected


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (zmq.EVENT_HANDSHAKE_FAILED_AUTH, "authentication refused"),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "protocol error"),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "no detail"),
    ],
)
def test_a_failed_handshake_is_remembered_not_fatal(event: int, error: str) -> None:
    seen = Seen()
    assert not note_monitor_event(seen, event, patient=False)
    assert seen.handshake_error == error


def test_only_an_unanswered_bot_is_ever_overdue() -> None:
    assert not bot_overdue(FlowState.BOT_SENT, 10.0, 12.0, 2.0)  # exactly at the limit
    assert bot_overdue(FlowState.BOT_SENT, 10.0, 12.01, 2.0)
    assert not bot_overdue(FlowState.READY, 10.0, 100.0, 2.0)
    assert not bot_overdue(FlowState.CLOSED, 10.0, 100.0, 2.0)


# -- the engine without sockets: a stand-in port, a server flow machine, explicit clocks --


class FakeMonitor:
    def __init__(self) -> None:
        self.events: collections.deque[int] = collections.deque()

    def poll(self, timeout: int = 0) -> int:
        return len(self.events)

    def recv_multipart(self) -> list[bytes]:
        return [struct.pack("=hi", self.events.popleft(), 0), b"tcp://h:1"]

    def close(self, linger: int = 0) -> None:
        pass


class FakeSocket:
    def __init__(self) -> None:
        self.monitor = FakeMonitor()

    def get_monitor_socket(self, events: int, addr: str) -> FakeMonitor:
        return self.monitor

    def disable_monitor(self) -> None:
        pass


class FakePort:
    """A ClientPort stand-in: what the engine sends goes to ``sent``; ``inbox`` is read."""

    def __init__(self, ctx: object, **kw: Any) -> None:
        self.socket = FakeSocket()
        self.mode = SocketMode.ROUTERDEALER
        self.socket_type = "DEALER"
        self.curve_public_key = None
        self.sent: list[Message] = []
        self.inbox: collections.deque[Message] = collections.deque()
        self.closed = False

    def connect(self, endpoint: str) -> str:
        return endpoint

    def send(self, msg: Message, timeout_ms: float | None = None) -> None:
        self.sent.append(msg)

    def recv_many(self, n: int, timeout_ms: int) -> list[Message]:
        return [self.inbox.popleft() for _ in range(min(n, len(self.inbox)))]

    def close(self, linger_ms: int | None = None) -> None:
        self.closed = True


class Recorder(ClientHandler):
    def __init__(self, hopeless: bool = False) -> None:
        self.hopeless = hopeless
        self.closed: list[tuple[str, str | None]] = []
        self.bots = 0

    def offer(self, conn: ClientFlow) -> Offer:
        return Offer(Direction.INJECT, 5, {"stream": "s"})

    def on_bot(self, conn: ClientFlow, bot: BotReceived) -> None:
        self.bots += 1

    def on_close(self, conn: ClientFlow, reason: str) -> None:
        self.closed.append((reason, conn.failure))

    def no_reply(self, conn: ClientFlow, timeout: float) -> tuple[str, bool]:
        return f"silent for {timeout:g} s", self.hopeless


class Rig:
    """A FlowClient over stand-in ports, one server flow machine per port."""

    def __init__(self, handler: ClientHandler | None = None, **kw: Any) -> None:
        self.ports: list[FakePort] = []
        self.handler = handler or Recorder()

        def make(ctx: object, **port_kw: Any) -> FakePort:
            port = FakePort(ctx, **port_kw)
            self.ports.append(port)
            return port

        self.client = FlowClient(
            "tcp://h:1", self.handler, connect_timeout=10.0, make_port=make, **kw
        )
        self.servers: list[Flow] = []

    @property
    def port(self) -> FakePort:
        return self.ports[-1]

    def server(self) -> Flow:
        """The server's machine for the latest port, fed what the client sent."""
        if len(self.servers) < len(self.ports):
            self.servers.append(Flow(Role.SERVER))
            for msg in self.port.sent:
                self.servers[-1].receive(msg)
        return self.servers[-1]

    def reply(self, msg: Message, now: float) -> None:
        self.port.inbox.append(msg)
        self.client.process(None, now)


def test_bot_timeouts_back_off_doubling_and_reconnect_on_a_new_port() -> None:
    rig = Rig()
    c = rig.client
    c.tick(0.0)  # the BOT goes out on the port the constructor made
    assert len(rig.ports) == 1 and c.stats["connects"] == 1
    assert c.tick(9.9) is None and c.conn is not None  # not overdue yet
    c.tick(10.1)
    assert c.conn is None and rig.ports[0].closed
    assert c.stats["bot_timeouts"] == 1 and c.last_error == "silent for 10 s"
    assert rig.handler.closed == [("silent for 10 s", "silent for 10 s")]  # type: ignore[attr-defined]
    assert c.tick(10.2) == pytest.approx(0.1)  # waiting out 0.2 s
    c.tick(10.3)
    assert len(rig.ports) == 2 and c.stats["connects"] == 2
    c.tick(20.4)  # the second timeout: 0.4 s next
    c.tick(20.7)
    assert len(rig.ports) == 2
    c.tick(20.81)
    assert len(rig.ports) == 3
    assert c.stats["flow_failures"] == 2


def test_an_accepted_flow_resets_the_backoff_and_a_servers_eot_reopens_it() -> None:
    rig = Rig()
    c = rig.client
    c.backoff.failed()
    c.backoff.failed()  # 0.8 s now, as after two failures
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    assert c.conn is not None and c.conn.flow.state is FlowState.READY
    assert c.stats["flows"] == 1 and c.backoff.delay == BACKOFF_MIN
    rig.reply(rig.server().send_eot(), 1.0)
    assert c.conn is None and rig.handler.closed == [("the server ended the flow", None)]  # type: ignore[attr-defined]
    assert rig.server().receive(rig.ports[0].sent[-1]).__class__.__name__ == "EotReceived"  # echoed
    c.tick(1.1)
    assert len(rig.ports) == 1  # not before the back-off delay
    c.tick(1.21)
    assert len(rig.ports) == 2 and c.stats["flow_failures"] == 0


def test_a_rejection_fails_the_flow_and_without_reconnect_nothing_reopens() -> None:
    rig = Rig(reconnect=False)
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().reject({"reason": "no"}), 0.1)
    assert c.stats["rejections"] == 1 and c.stats["rejected"] == 1
    assert c.last_error == "the server rejected the flow: {'reason': 'no'}"
    assert c.ending
    c.tick(100.0)
    assert len(rig.ports) == 1 and c.tick(200.0) is None


def test_a_handler_error_fails_that_flow_only() -> None:
    class Broken(Recorder):
        def on_bot(self, conn: ClientFlow, bot: BotReceived) -> None:
            raise KeyError("bug")

    rig = Rig(Broken())
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    assert c.stats["handler_errors"] == 1 and c.conn is None
    assert c.last_error is not None and c.last_error.startswith("handler error: KeyError")
    c.tick(0.31)
    assert len(rig.ports) == 2  # reconnected


@pytest.mark.parametrize("patient", [False, True])
def test_a_disconnect_before_the_reply_fails_at_once_unless_patient(patient: bool) -> None:
    rig = Rig(Recorder(hopeless=True), patient=patient)
    c = rig.client
    c.tick(0.0)
    rig.port.socket.monitor.events.append(zmq.EVENT_DISCONNECTED)
    c.process(None, 0.5)
    if not patient:
        assert c.stats["disconnects"] == 1 and c.stats["unanswered"] == 1
        assert c.last_error is not None
        assert c.last_error.startswith("the connection closed before a BOT reply; ")
        assert c.gave_up is None
        return
    assert c.conn is not None and c.conn.seen.refused and c.stats["disconnects"] == 0
    c.tick(10.1)  # then the timeout's diagnosis: hopeless, so given up
    assert c.gave_up == "silent for 10 s" and c.stats["bot_timeouts"] == 1
    c.tick(100.0)
    assert len(rig.ports) == 1


def test_an_overdue_bot_is_judged_on_what_the_monitor_already_saw() -> None:
    """The handshake failures a busy loop has not read yet when the BOT timer fires still
    decide the verdict: the handler's diagnosis sees them (here: the refusal), and the
    monitor is read before the timeout, not after it."""

    class Diagnosing(Recorder):
        def no_reply(self, conn: ClientFlow, timeout: float) -> tuple[str, bool]:
            return f"refused={conn.seen.refused}", conn.seen.refused

    rig = Rig(Diagnosing(), patient=True)
    c = rig.client
    c.tick(0.0)
    rig.port.socket.monitor.events.extend(
        [zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_DISCONNECTED]
    )
    c.tick(10.1)  # the timer, before any process() read the monitor
    assert c.gave_up == "refused=True" and c.stats["bot_timeouts"] == 1
    assert c.stats["flow_failures"] == 1 and not rig.port.socket.monitor.events


def test_our_eot_ends_the_flow_for_good_at_its_echo() -> None:
    rig = Rig()
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    assert c.send_eot()
    server = rig.server()
    server.receive(rig.port.sent[-1])
    rig.reply(server.send_eot(), 0.2)
    assert c.conn is None and rig.handler.closed == [("end of transmission", None)]  # type: ignore[attr-defined]
    c.tick(100.0)
    assert len(rig.ports) == 1 and not c.send_eot()


def test_a_handlers_failure_after_the_server_went_is_the_disconnect() -> None:
    """A PAY that could not be queued because the server's process ended: the monitor's
    disconnect, already there, decides (a handler counting on ``disconnects`` to forget
    an open flow sees it); with no such event the handler's own verdict stands."""

    class Failing(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.failures: list[tuple[str, str]] = []

        def on_failure(self, conn: ClientFlow | None, why: str, counter: str, final: bool) -> None:
            self.failures.append((why, counter))

    for server_gone in (True, False):
        handler = Failing()
        rig = Rig(handler)
        c = rig.client
        c.tick(0.0)
        rig.reply(rig.server().accept(), 0.1)
        if server_gone:
            rig.port.socket.monitor.events.append(zmq.EVENT_DISCONNECTED)
        c.fail("cannot send PAY: no peer is connected", "taker_errors", 0.2)
        assert c.conn is None
        expected = "disconnects" if server_gone else "taker_errors"
        assert [counter for _, counter in handler.failures] == [expected]
        assert c.stats["disconnects"] == (1 if server_gone else 0)
