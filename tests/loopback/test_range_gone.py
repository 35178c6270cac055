"""Range and control flows of readers that vanish without EOT, on loopback.

A bound :class:`Producer` knows which connection each range or control flow came on and
runs ZMTP heartbeats on its port (:mod:`zio_spark.source.range_serving`, "Readers that
vanish"). Covered: a reader process SIGKILLed (its kernel closes the connection), one
SIGSTOPped (its connection stays up but nothing answers the PINGs: the heartbeat timeout
closes it), a socket dropped in this process without EOT, a control flow with a leased
run key (released as on EOT), a quiet reader that is never dropped, a descriptor reused by
a later connection, and the keywords' checks. Held records stay held throughout: a
vanished flow frees and acknowledges nothing. The queue's flow producer port
(:class:`~zio_spark.pzq.flow_ports.FlowProducerPort`, driven inline by the broker's
loop) does the same with the queue's ``flow_heartbeat_*``/``flow_conn_check`` settings:
a killed reader's flows end, its messages stay in the store, assigned. Processes
started here are stopped by their pid; every wait polls a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest
import zmq
from test_flow_ports import _produce

from tests.support import wait_until
from zio_spark.errors import ConfigError
from zio_spark.protocol.flow import Direction, EotReceived, Role
from zio_spark.pzq.broker import QueueBroker
from zio_spark.pzq.flow_ports import FlowProducerPort
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import ControlConnection, HeldWindow, RangeConnection
from zio_spark.transport.curve import client_curve
from zio_spark.transport.flow_endpoint import FlowEndpoint
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.port import ServerPort, connection_open

T = 10.0  # seconds any one wait may last (returns as soon as it can)
P = "p1"
# Short in tests: PING every 50 ms, a silent connection closed after 300 ms, a look at
# the flows' connections every 20 ms.
FAST: dict[str, Any] = {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.3, "conn_check": 0.02}

# A reader in a process of its own: opens a control flow and a range flow, asks once on
# each (so both are served), says so, then waits on stdin until it is killed.
_READER = """
import sys
from zio_spark.source.range_client import ControlConnection, RangeConnection
ep, producer = sys.argv[1], sys.argv[2]
control = ControlConnection(ep, timeout=10)
control.held()
ranges = RangeConnection(ep, timeout=10)
ranges.held(producer)
print("ready", flush=True)
sys.stdin.read()
"""


def _producer(ctx: Any, closing: list[Any], **kw: Any) -> Producer:
    kw.setdefault("producer_id", P)
    for k, v in FAST.items():
        kw.setdefault(k, v)
    p = Producer("tcp://127.0.0.1:*", ctx=ctx, linger_ms=0, **kw)
    closing.append(p)
    return p


class _Reader:
    """The reader process; :meth:`kill` signals it by pid, :meth:`stop` ends it."""

    def __init__(self, endpoint: str, producer: str = P) -> None:
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _READER, endpoint, producer],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # ends at its "ready", or at its exit
        assert line == b"ready\n", (line, self.proc.poll())

    def kill(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(T)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def reader():
    started: list[_Reader] = []

    def start(endpoint: str, producer: str = P) -> _Reader:
        r = _Reader(endpoint, producer)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def _gone(p: Producer) -> tuple[int, int]:
    return p.stats["range_flows_gone"], p.stats["control_flows_gone"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_vanished_readers_flows_end_and_free_nothing(ctx, closing, reader, sig):
    """SIGKILL: the reader's kernel closes the connection, libzmq closes ours. SIGSTOP:
    the connection stays up, nothing answers the PINGs, the heartbeat timeout closes it
    (a host gone without FIN). Either way both flows go, with nothing freed or acked."""
    p = _producer(ctx, closing)
    p.send_many([b"v%d" % i for i in range(100)])
    r = reader(p.endpoint)
    assert p.range_flows_open == 2 and p.stats["control_flows"] == 1
    r.kill(sig)
    wait_until(
        lambda: p.range_flows_open == 0,
        T,
        "the vanished reader's flows to end",
        detail=lambda: (p.range_flows_open, p.stats),
    )
    assert _gone(p) == (1, 1)
    # A held record keeps its meaning: nothing freed, nothing acknowledged.
    assert p.acked == 0 and p.pending == 100 and p.delivery().acked == 0
    # Other readers go on: a new control flow sees the same window.
    with ControlConnection(p.endpoint, ctx=ctx, timeout=T) as c:
        assert c.held() == HeldWindow(p.incarnation, 1, 101)


def test_a_socket_dropped_without_eot_ends_its_flow(ctx, closing, make_client):
    p = _producer(ctx, closing)
    port = make_client(linger_ms=0)
    port.connect(p.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    ep.send_bot(Direction.INJECT, 4, {"read": "range"})
    assert ep.recv_bot(T).attrs["ranges"] == 1
    wait_until(lambda: p.range_flows_open == 1, T, "the range flow open")
    port.close(0)  # no EOT
    wait_until(
        lambda: p.range_flows_open == 0, T, "the dropped flow to end", detail=lambda: p.stats
    )
    assert _gone(p) == (1, 0)


def test_a_vanished_control_flow_releases_its_run_key(ctx, closing):
    """The run key a control flow leased is released when the flow is found gone, as on
    its EOT: a task of that run can no longer open a range flow."""
    server_pub, server_sec = zmq.curve_keypair()
    driver_pub, driver_sec = zmq.curve_keypair()
    run_pub, _ = zmq.curve_keypair()
    p = _producer(ctx, closing, curve_secret_key=server_sec, curve_allowed_client_keys=[driver_pub])
    curve = client_curve(server_pub, driver_sec, driver_pub)
    c = ControlConnection(p.endpoint, ctx=ctx, curve=curve, timeout=T)
    try:
        assert c.admit(run_pub) is True
        assert p.run_keys == {run_pub}
    finally:
        c._unwatch()  # its drops monitor (a control flow watches from its BOT on)
        c.port.close(0)  # the driver's socket dropped: no EOT
    wait_until(lambda: not p.run_keys, T, "the run key released", detail=lambda: p.stats)
    assert _gone(p) == (0, 1) and p.stats["run_keys_revoked"] == 1


def test_a_commit_sent_just_before_the_socket_drops_is_applied(ctx, closing):
    """What the driver sent before its connection closed (a last commit) is served
    before its flow is removed: the ack frees up to it, and only that. (Which of the
    two removals comes first is a race; the hand-driven test below fixes the order.)"""
    p = _producer(ctx, closing)
    p.send_many([b"v%d" % i for i in range(10)])
    c = ControlConnection(p.endpoint, ctx=ctx, timeout=T)
    try:
        inc = c.held().incarnation
        c.ep.channel.send(c.reader.send_commit(c.ep.flow, P, inc, 4))
    finally:
        c._unwatch()  # its drops monitor (a control flow watches from its BOT on)
        c.port.close(1000)  # the commit leaves, then the socket goes: no EOT
    wait_until(lambda: p.range_flows_open == 0, T, "the control flow to end")
    assert p.acked == 4 and p.pending == 6 and p.stats["control_acks"] == 1
    # Its flow ended as gone, or, when the answer to the commit found the peer gone
    # first, as a failed send: either way once, and nothing else was freed.
    server = p._server
    assert server is not None
    assert _gone(p)[0] == 0
    assert _gone(p)[1] + server.stats["send_failures"] == 1, (p.stats, server.stats)


class _Watched(FlowHandler):
    """A flow server's handler that watches its connection and notes EOTs."""

    def __init__(self, eots: list[str]) -> None:
        self.eots = eots

    def watches_connection(self, conn: ServerFlow) -> bool:
        return True

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        self.eots.append(conn.name)


def test_what_a_closed_connection_sent_is_served_before_its_flow_goes(ctx, make_client):
    """Driven by hand, so the order is ours: the client's EOT waits in the server's
    socket when its connection is found closed; the look serves it first, and the flow
    ends by its EOT, not as gone."""
    eots: list[str] = []
    port = ServerPort(ctx, linger_ms=0, conn_ids=True)
    server = FlowServer(port, lambda: _Watched(eots), ctx=ctx, conn_check=0.001)
    try:
        endpoint = port.bind("tcp://127.0.0.1:*")
        client = make_client(linger_ms=1000)
        client.connect(endpoint)
        ep = FlowEndpoint(client, Role.CLIENT)
        ep.send_bot(Direction.INJECT, 4, {})
        wait_until(lambda: server.process() or server.flows, T, "the BOT served")
        assert ep.recv_bot(T) is not None
        ((conn, _),) = server.flows.values()
        assert conn.connection is not None and connection_open(conn.connection)
        ep.channel.send(ep.flow.send_eot())  # no wait for the echo: the client goes
        client.close(1000)  # the EOT leaves, then the connection closes
        wait_until(lambda: not connection_open(conn.connection), T, "the connection closed")
        server.tick()
        assert eots == [conn.name] and not server.flows
        assert server.stats["gone"] == 0 and server.stats["conn_checks"] == 1
    finally:
        server.close()


def test_a_quiet_reader_is_not_dropped(ctx, closing, reader):
    """Readers silent for many heartbeat timeouts keep their flows: their libzmq answers
    the PINGs, and their connections stay open. Meanwhile a killed reader's flows end,
    so the looks at connections do run."""
    p = _producer(ctx, closing)
    p.send_many([b"a", b"b"])
    server = p._server
    assert server is not None
    assert server.port.socket.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 300
    control = ControlConnection(p.endpoint, ctx=ctx, timeout=T)
    ranges = RangeConnection(p.endpoint, ctx=ctx, timeout=T)
    closing += [control, ranges]
    assert control.held() == ranges.held(P) == HeldWindow(p.incarnation, 1, 3)
    quiet = server.stats["conn_checks"]
    r = reader(p.endpoint)
    r.kill(signal.SIGKILL)
    wait_until(lambda: _gone(p) == (1, 1), T, "the killed reader's flows to end")
    # 40 looks, one a loop turn at most (50 ms): 2 s, over six heartbeat timeouts of quiet.
    wait_until(lambda: server.stats["conn_checks"] >= quiet + 40, T, "40 looks at the connections")
    assert p.range_flows_open == 2 and _gone(p) == (1, 1)
    assert control.held() == ranges.held(P) == HeldWindow(p.incarnation, 1, 3)
    assert control.ack(1, p.incarnation) == HeldWindow(p.incarnation, 2, 3)


def test_a_reused_descriptor_is_another_connection():
    a, b = socket.socketpair()
    fd = a.fileno()
    conn = (fd, os.fstat(fd).st_ino)
    assert connection_open(conn)
    a.close()
    assert not connection_open(conn)
    c, d = socket.socketpair()
    try:
        assert fd in (c.fileno(), d.fileno())  # the lowest free number: the same one
        assert not connection_open(conn)
    finally:
        for s in (b, c, d):
            s.close()


@pytest.mark.parametrize(
    ("kw", "name", "expected"),
    [
        ({"heartbeat_interval": 0}, "heartbeat_interval", "0.001..3600"),
        ({"heartbeat_interval": "5"}, "heartbeat_interval", "0.001..3600"),
        ({"heartbeat_interval": True}, "heartbeat_interval", "0.001..3600"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": 1.0}, "heartbeat_timeout",
         ">= heartbeat_interval"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": None}, "heartbeat_timeout",
         "heartbeat_interval=None"),
        ({"heartbeat_interval": None}, "heartbeat_timeout", "None when heartbeat_interval is None"),
        ({"conn_check": 0}, "conn_check", "> 0 and <= 3600"),
        ({"conn_check": float("nan")}, "conn_check", "> 0 and <= 3600"),
    ],
)  # fmt: skip
def test_bad_keywords_are_config_errors(ctx, kw, name, expected):
    with pytest.raises(ConfigError) as e:
        Producer("tcp://127.0.0.1:*", ctx=ctx, producer_id=P, **kw)
    assert e.value.option == name and expected in str(e.value), str(e.value)


def test_heartbeats_off(ctx, closing):
    p = _producer(ctx, closing, heartbeat_interval=None, heartbeat_timeout=None)
    server = p._server
    assert server is not None
    assert server.port.socket.getsockopt(zmq.HEARTBEAT_IVL) == 0


class _Frame:
    """A received frame as pyzmq gives it with ``copy=False``: bytes, more, properties."""

    def __init__(self, data: bytes, more: bool, fd: int | None, user_id: str | None) -> None:
        self.bytes = data
        self.more = more
        self._props: dict[object, object] = {zmq.SRCFD: fd, "User-Id": user_id}

    def get(self, name: object) -> object:
        got = self._props.get(name)
        if got is None:
            raise zmq.ZMQError(22)  # EINVAL, as libzmq for an absent property
        return got


class _Sock:
    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = frames

    def recv(self, flags: int, copy: bool) -> _Frame:
        assert copy is False  # properties are only readable on a frame object
        return self.frames.pop(0)


def test_both_wires_read_the_descriptor_of_what_they_take():
    """The SERVER wire (one frame; no draft pyzmq here to run it on a socket) and the
    ROUTER wire (a multipart message) read the connection's descriptor, -1 when absent,
    next to the ZAP user id when both are kept."""
    from zio_spark.transport.wire import RouterWire, ServerWire

    key = "k" * 40

    def frames(n: int) -> list[_Frame]:
        return [_Frame(b"f%d" % i, i < n - 1, 7, key) for i in range(n)]

    for cls, n in ((ServerWire, 1), (RouterWire, 3)):
        wire = cls.__new__(cls)  # no socket: the getters take it as an argument
        wire.sock = _Sock(frames(n))  # type: ignore[assignment]
        wire.user_id = None
        wire.keep_fds()
        wire.keep_user_ids()
        wire.get(0)
        assert (wire.fd, wire.user_id) == (7, key)
        wire.sock.frames.append(_Frame(b"n", False, None, None))  # inproc, no ZAP
        wire.get(0)
        assert (wire.fd, wire.user_id) == (-1, None)


# -- the queue's flow producer port (inline in the broker's loop) -------------------------

QUEUE_FAST: dict[str, Any] = {f"flow_{k}": v for k, v in FAST.items()}


def _queue_port(b: QueueBroker) -> FlowProducerPort:
    flows = b._flows
    assert flows is not None and flows.producer is not None
    return flows.producer


def test_the_queue_port_ends_a_killed_readers_flows_and_keeps_its_messages(
    make_broker, raw_socket, ctx, closing, reader
):
    """A reader process holding a control flow and a range flow on the queue's flow
    producer port is SIGKILLed: both flows end (found from the broker's loop turns),
    nothing is acked, the store keeps the 100 messages (assigned to the flow, not given
    to PZQ consumers), and a new control flow sees the same window. A quiet control
    flow of this process stays through many looks, and the looks never make the loop
    busy (they run from its turns, when due)."""
    b = make_broker(flow_producer="tcp://127.0.0.1:*", **QUEUE_FAST)
    port = _queue_port(b)
    ep = b.endpoints["flow_producer"]
    assert port.socket.getsockopt(zmq.HEARTBEAT_IVL) == 50
    assert port.socket.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 300
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, [(b"m-%03d" % i, [b"body-%03d" % i]) for i in range(100)])
    r = reader(ep, port.producer_id)  # its control flow's held query numbered all 100
    quiet = ControlConnection(ep, ctx=ctx, timeout=T)
    closing.append(quiet)
    window = HeldWindow(port.incarnation, 1, 101)
    assert quiet.held() == window
    assert len(port.ranges.flows) == 3 and port.range_stats["control_flows"] == 2
    server = port._server
    r.kill(signal.SIGKILL)
    wait_until(
        lambda: len(port.ranges.flows) == 1,
        T,
        "the killed reader's flows on the queue's port to end",
        detail=lambda: (len(port.ranges.flows), port.range_stats),
    )
    gone = port.range_stats["range_flows_gone"], port.range_stats["control_flows_gone"]
    assert gone == (1, 1)
    # The monitor's snapshot is refreshed every 0.1 s: wait for the one after numbering.
    wait_until(lambda: b.stats()["flow_given"] == 100, T, "flow_given 100 in the snapshot")
    stats = b.stats()
    assert stats["flow_acked"] == 0 and stats["messages"] == 100
    assert port.acked == 0 and port.unacked == 100
    assert not b._flows.busy()
    looks = server.stats["conn_checks"]
    # 20 more looks (one per 20 ms at most): the quiet flow stays, heartbeats answered.
    wait_until(lambda: server.stats["conn_checks"] >= looks + 20, T, "20 more looks")
    assert len(port.ranges.flows) == 1 and quiet.held() == window
    with ControlConnection(ep, ctx=ctx, timeout=T) as c:
        assert c.held() == window


def test_the_queue_port_takes_the_producers_watch_defaults_and_can_turn_heartbeats_off(
    make_broker,
):
    b = make_broker(flow_producer="tcp://127.0.0.1:*")
    port = _queue_port(b)
    assert port.socket.getsockopt(zmq.HEARTBEAT_IVL) == 5000
    assert port.socket.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 30000
    assert port._server.conn_check == 0.5
    off = make_broker(
        store=b.options.store_path.parent / "off",
        flow_producer="tcp://127.0.0.1:*",
        flow_heartbeat_interval=None,
        flow_heartbeat_timeout=None,
        flow_conn_check=2,
    )
    port = _queue_port(off)
    assert port.socket.getsockopt(zmq.HEARTBEAT_IVL) == 0 and port._server.conn_check == 2.0
