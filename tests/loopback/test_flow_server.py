"""Loopback tests of zio_spark.transport.flow_server.FlowServer: one handler per client.

Clients are :class:`FlowEndpoint` s over :class:`ClientPort` s (several at once run in
threads), or raw pyzmq sockets for what a well-behaved endpoint cannot send. The handler
journals every callback with its thread, so tests wait on the journal with a deadline
instead of sleeping. Endpoints are 127.0.0.1 random ports; sockets use linger 0 and the
``ctx`` fixture fails a test that leaks one.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from tests.support import Background
from zio_spark.errors import TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    FlowState,
    Role,
)
from zio_spark.protocol.message import DAT_LABEL, Message, encode_frames
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.port import ClientPort, ServerPort, format_peer

WAIT = 5.0  # deadline for what must happen (returns as soon as it does)
SHORT = 0.2  # timeouts that are meant to run out

MakeServer = Callable[..., ServerPort]
MakeClient = Callable[..., ClientPort]


def poll_until(cond: Callable[[], Any], timeout: float = WAIT, what: str = "") -> None:
    """Re-check ``cond`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or cond}")
        gate.wait(0.005)


# ------------------------------------------------------------------------ the handler


@dataclass(frozen=True)
class Entry:
    handler: FlowHandler
    kind: str
    peer: Any
    name: str | None
    thread: threading.Thread
    info: dict[str, Any] = field(default_factory=dict)


class Journal:
    """Every handler callback, in order, with the thread it ran in."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.handlers: list[Service] = []
        self._cond = threading.Condition()

    def add(self, handler: Service, kind: str, conn: ServerFlow, **info: Any) -> None:
        entry = Entry(handler, kind, conn.peer, handler.name, threading.current_thread(), info)
        with self._cond:
            self.entries.append(entry)
            self._cond.notify_all()

    def of(self, kind: str, name: str | None = None) -> list[Entry]:
        with self._cond:
            return [e for e in self.entries if e.kind == kind and name in (None, e.name)]

    def wait(
        self, kind: str, name: str | None = None, n: int = 1, timeout: float = WAIT
    ) -> list[Entry]:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.of(kind, name)) >= n, timeout)
        if not ok:
            seen = "\n  ".join(f"{e.kind} {e.name} {e.info}" for e in self.entries)
            pytest.fail(f"no {n} x {kind!r} for {name!r} within {timeout} s; saw:\n  {seen}")
        return self.of(kind, name)


class Service(FlowHandler):
    """Takes from givers (pays one back per DAT) and gives ``count`` DATs to takers.

    The client's BOT attributes steer it: ``name``; ``count`` (DATs to give); ``accept``
    (credit to agree); ``repay`` (false: pay no credit back after a DAT); ``reject``
    (a reason); ``fail`` (the callback that raises).
    """

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        journal.handlers.append(self)
        self.name: str | None = None
        self.count = 0
        self.sent = 0
        self.repay = True
        self.fail: str | None = None

    def _note(self, kind: str, conn: ServerFlow, **info: Any) -> None:
        self.journal.add(self, kind, conn, **info)
        if self.fail == kind:
            raise RuntimeError(f"on_{kind} failed on purpose")

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        attrs = bot.attrs
        self.name = attrs.get("name")
        self.count = attrs.get("count", 0)
        self.repay = attrs.get("repay", True)
        self.fail = attrs.get("fail")
        self._note("bot", conn, direction=bot.direction, credit=bot.credit, conn_name=conn.name)
        if "reject" in attrs:
            conn.reject({"reason": attrs["reject"]})
            return
        conn.accept(attrs.get("accept"), {"served": self.name})
        if bot.direction is Direction.EXTRACT:
            conn.pay()

    def on_data(self, conn: ServerFlow, data: Data) -> None:
        self._note("data", conn, payload=data.message.payload)
        if self.repay:
            conn.pay(1)

    def on_credit(self, conn: ServerFlow, credit: Credit) -> None:
        self._note("credit", conn, amount=credit.amount)
        self._push(conn)

    def on_tick(self, conn: ServerFlow, now: float) -> None:
        self._push(conn)

    def _push(self, conn: ServerFlow) -> None:
        while (
            conn.flow.state is FlowState.READY and conn.flow.credit > 0 and self.sent < self.count
        ):
            conn.send_dat((f"{self.name}:{self.sent}".encode(),))
            self.sent += 1

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        self._note("eot", conn, echo=eot.echo)

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        self._note("close", conn, reason=reason)


# ----------------------------------------------------------------------------- fixtures


@dataclass
class Running:
    server: FlowServer
    journal: Journal
    mode: str

    @property
    def endpoint(self) -> str:
        return self.server.endpoint


@pytest.fixture
def serve(
    ctx: zmq.Context[Any], make_server: MakeServer, tcp_any: str
) -> Iterator[Callable[..., Running]]:
    made: list[FlowServer] = []

    def start(mode: str = "routerdealer", **kw: Any) -> Running:
        journal = Journal()
        port = make_server(mode=mode)
        port.bind(tcp_any)
        server = FlowServer(port, lambda: Service(journal), ctx=ctx, **kw)
        made.append(server)
        server.start()
        return Running(server, journal, mode)

    yield start
    for server in made:
        server.stop()


@pytest.fixture
def client(make_client: MakeClient) -> Callable[..., FlowEndpoint]:
    def make(running: Running, **kw: Any) -> FlowEndpoint:
        port = make_client(mode=running.mode, **kw)
        port.connect(running.endpoint)
        return FlowEndpoint(port, Role.CLIENT)

    return make


@pytest.fixture
def background() -> Iterator[Callable[..., Background]]:
    made: list[Background] = []

    def start(fn: Callable[..., Any], *args: Any, name: str = "client") -> Background:
        bg = Background(lambda: fn(*args), name)
        made.append(bg)
        return bg

    yield start
    for bg in made:  # let calls stuck on their own deadline end before sockets close
        bg.thread.join(WAIT + 1)


def give(ep: FlowEndpoint, name: str, n: int, credit: int = 3, **attrs: Any) -> list[bytes]:
    """A giver client: BOT, ``n`` DATs, EOT; returns what it sent."""
    ep.connect(Direction.EXTRACT, credit, {"name": name, **attrs}, WAIT)
    sent = [f"{name} says {i}".encode() for i in range(n)]
    for value in sent:
        assert ep.put((value,), timeout=WAIT)
    assert ep.send_eot(timeout=WAIT).echo
    return sent


def take(ep: FlowEndpoint, name: str, n: int, credit: int = 3) -> list[bytes]:
    """A taker client: BOT asking for ``n`` DATs, takes them, ends with EOT."""
    bot = ep.connect(Direction.INJECT, credit, {"name": name, "count": n}, WAIT)
    assert bot.attrs["served"] == name
    got = []
    for _ in range(n):
        data = ep.get(WAIT)
        assert data is not None, f"{name}: EOT instead of DAT"
        got.append(data.message.payload[0])
    assert ep.send_eot(timeout=WAIT).echo
    return got


# --------------------------------------------------------------------------------- tests


def test_several_clients_each_served_by_its_own_handler(serve, client, background, wire_mode):
    running = serve(wire_mode)
    jobs = {
        "taker-a": background(take, client(running), "taker-a", 12, name="taker-a"),
        "taker-b": background(take, client(running), "taker-b", 7, 2, name="taker-b"),
        "giver-c": background(give, client(running), "giver-c", 9, name="giver-c"),
        "giver-d": background(give, client(running), "giver-d", 5, 1, name="giver-d"),
    }
    results = {name: job.result() for name, job in jobs.items()}

    # Replies went to the right client: each taker got exactly its own DATs, in order.
    assert results["taker-a"] == [f"taker-a:{i}".encode() for i in range(12)]
    assert results["taker-b"] == [f"taker-b:{i}".encode() for i in range(7)]
    # Each giver's DATs reached its own handler, in order.
    journal = running.journal
    for name in ("giver-c", "giver-d"):
        assert [e.info["payload"] for e in journal.of("data", name)] == [
            (v,) for v in results[name]
        ]

    # One handler per client, each seeing one peer, all in the server's thread.
    closes = journal.wait("close", n=4)
    assert len(journal.handlers) == 4 == running.server.stats["flows"]
    by_handler: dict[int, set[Any]] = {}
    for e in journal.entries:
        by_handler.setdefault(id(e.handler), set()).add(e.peer)
    assert len(by_handler) == 4 and all(len(peers) == 1 for peers in by_handler.values())
    assert len({next(iter(p)) for p in by_handler.values()}) == 4
    assert {e.thread.name for e in journal.entries} == {running.server.name}

    # A client ending with EOT is removed: the handler hears why.
    assert {e.name: e.info["reason"] for e in closes} == dict.fromkeys(jobs, "end of transmission")
    assert [e.info["echo"] for e in journal.of("eot")] == [False] * 4
    poll_until(lambda: not running.server.flows, what="flows removed")
    assert running.server.stats["dropped"] == 0 and running.server.error is None


def test_lowered_credit_and_rejection(serve, client, wire_mode):
    running = serve(wire_mode)
    ep = client(running)
    bot = ep.connect(Direction.EXTRACT, 10, {"name": "low", "accept": 2}, WAIT)
    assert bot.credit == 2 and ep.flow.total_credit == 2

    refused = client(running)
    with pytest.raises(FlowRejected) as err:
        refused.connect(Direction.INJECT, 3, {"name": "no", "reject": "not today"}, WAIT)
    assert err.value.attrs == {"reason": "not today"}
    close = running.journal.wait("close", "no")[0]
    assert close.info["reason"] == "rejected"
    poll_until(lambda: len(running.server.flows) == 1, what="the rejected flow removed")


def _breaker_dat_before_bot(running: Running, make_client: MakeClient) -> tuple[ClientPort, str]:
    port = make_client(mode=running.mode)
    if running.mode == "routerdealer":
        port.socket.setsockopt(zmq.ROUTING_ID, b"breaker")
    port.connect(running.endpoint)
    port.send(Message("FLOW", json.dumps({"flow": "DAT"}), seqno=1, payload=(b"early",)))
    return port, "RemoteProtocolError"


def _breaker_dat_beyond_credit(running: Running, make_client: MakeClient) -> tuple[ClientPort, str]:
    port = make_client(mode=running.mode)
    if running.mode == "routerdealer":
        port.socket.setsockopt(zmq.ROUTING_ID, b"breaker")
    port.connect(running.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    # Agreed credit 1 and no PAY back after a DAT: the second DAT has no credit.
    ep.connect(Direction.EXTRACT, 5, {"name": "breaker", "accept": 1, "repay": False}, WAIT)
    for i in range(2):
        port.send(Message("FLOW", json.dumps({"flow": "DAT"}), seqno=1 + i, payload=(b"x",)))
    return port, "FlowControlError"


@pytest.mark.parametrize(
    "breaker",
    [_breaker_dat_before_bot, _breaker_dat_beyond_credit],
    ids=["dat-before-bot", "dat-beyond-credit"],
)
def test_a_client_breaking_the_protocol_is_dropped_and_others_go_on(
    serve, client, make_client, background, caplog, wire_mode, breaker
):
    caplog.set_level(logging.WARNING, logger="zio_spark.transport")
    running = serve(wire_mode)
    good = client(running)
    good.connect(Direction.EXTRACT, 2, {"name": "good"}, WAIT)
    assert good.put((b"before",), timeout=WAIT)
    running.journal.wait("data", "good")

    _, error_name = breaker(running, make_client)
    poll_until(lambda: running.server.stats["dropped"] == 1, what="the breaker dropped")

    dropped = [r for r in caplog.records if "dropping peer" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.WARNING
    text = dropped[0].getMessage()
    if running.mode == "routerdealer":
        assert format_peer(b"breaker") in text
    else:
        assert "routing id " in text
    bots = running.journal.of("bot", "breaker")
    if bots:  # the credit case had a handler: it is closed, and the log names its peer
        assert bots[0].info["conn_name"] in text
        close = running.journal.wait("close", "breaker")[0]
        assert close.info["reason"].startswith("protocol error")
    else:
        assert "DAT received in state IDLE" in text
    assert f": {error_name}: " in text

    # The good flow never noticed.
    for i in range(4):
        assert good.put((b"after %d" % i,), timeout=WAIT)
    assert good.send_eot(timeout=WAIT).echo
    payloads = [e.info["payload"][0] for e in running.journal.of("data", "good")]
    assert payloads == [b"before", b"after 0", b"after 1", b"after 2", b"after 3"]
    poll_until(lambda: not running.server.flows, what="all flows removed")
    assert running.server.stats["dropped"] == 1 and running.server.stats["handler_errors"] == 0


def test_idle_timeout_removes_a_silent_client(serve, client, wire_mode):
    running = serve(wire_mode, idle_timeout=0.3, tick=0.02)
    ep = client(running)
    t0 = time.monotonic()
    ep.connect(Direction.INJECT, 2, {"name": "sleepy"}, WAIT)
    bot = running.journal.wait("bot", "sleepy")[0]
    close = running.journal.wait("close", "sleepy")[0]
    assert time.monotonic() - t0 >= 0.3  # not before its time
    assert close.info["reason"] == "idle for more than 0.3 s"
    assert running.server.stats["idle_removed"] == 1
    assert not running.server.flows
    assert bot.thread is close.thread
    # Anything it says now is a new conversation without a BOT: dropped, not served.
    ep.channel.send(ep.flow.pay())
    poll_until(lambda: running.server.stats["dropped"] == 1, what="the stale PAY dropped")


def test_a_busy_client_is_not_idle(serve, client, wire_mode):
    running = serve(wire_mode, idle_timeout=0.25, tick=0.02)
    ep = client(running)
    ep.connect(Direction.EXTRACT, 1, {"name": "busy"}, WAIT)
    deadline = time.monotonic() + 0.6  # well beyond the idle timeout
    while time.monotonic() < deadline:
        assert ep.put((b"tick",), timeout=WAIT)  # paced by the server's PAYs
    assert running.journal.of("close", "busy") == []
    assert ep.send_eot(timeout=WAIT).echo


def test_garbage_from_raw_peers_is_counted(serve, raw_socket, wire_mode):
    running = serve(wire_mode)
    cs = wire_mode == "clientserver"
    raw = raw_socket(zmq.CLIENT if cs else zmq.DEALER)
    raw.connect(running.endpoint)

    def send(frames: list[bytes]) -> None:
        if cs:
            raw.send(b"".join(bytes([len(f)]) + f for f in frames))
        else:
            raw.send_multipart(frames)

    garbage = [
        [b"no delimiter"],
        [b"", b"not a ZIO prefix", b"\0" * 24],
        [b"", b"ZIO0FLOW{", b"\0"],
    ]
    if cs:
        garbage = [[b"\xff\x00"], [b"not a ZIO prefix", b"\0" * 24], [b"ZIO0FLOW{", b"\0"]]
    for frames in garbage:
        send(frames)
    poll_until(lambda: running.server.stats["bad_messages"] == 3, what="3 bad messages")
    assert running.server.port.stats["bad_messages"] == 3
    assert running.server.stats["dropped"] == 0 and not running.server.flows

    # A peer with a flow that sends garbage loses the flow.
    bot = Message(
        "FLOW", json.dumps({"flow": "BOT", "direction": "extract", "credit": 2, "name": "raw"})
    )
    send(([] if cs else [b""]) + encode_frames(bot))
    running.journal.wait("bot", "raw")
    send(([] if cs else [b""]) + [b"not a ZIO prefix", struct.pack("<QQQ", 0, 0, 1)])
    close = running.journal.wait("close", "raw")[0]
    assert close.info["reason"].startswith("protocol error")
    assert running.server.stats["dropped"] == 1 and running.server.stats["bad_messages"] == 4


def test_call_soon_runs_in_the_loop_thread_in_order(serve):
    running = serve()
    seen: list[tuple[int, threading.Thread]] = []
    done = threading.Event()
    for i in range(50):
        running.server.call_soon(lambda i=i: seen.append((i, threading.current_thread())))
    running.server.call_soon(done.set)
    others = [
        threading.Thread(
            target=running.server.call_soon,
            args=(lambda: seen.append((-1, threading.current_thread())),),
        )
        for _ in range(3)
    ]
    for t in others:
        t.start()
    for t in others:
        t.join(WAIT)
    assert done.wait(WAIT)
    poll_until(lambda: len(seen) == 53, what="all calls run")
    assert [i for i, _ in seen if i >= 0] == list(range(50))
    assert running.server._own is not None  # white box: the server's own thread
    assert {t for _, t in seen} == {running.server._own.thread}
    assert {t.name for _, t in seen} == {running.server.name}


def test_a_failing_call_does_not_stop_the_server(serve, client, caplog, wire_mode):
    running = serve(wire_mode)
    done = threading.Event()
    running.server.call_soon(lambda: 1 / 0)
    running.server.call_soon(done.set)
    assert done.wait(WAIT), "the loop died with the failing call"
    assert running.server.error is None
    assert running.server.stats["call_errors"] == 1
    poll_until(
        lambda: any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records),
        what="the failing call logged",
    )
    ep = client(running)
    assert ep.connect(Direction.INJECT, 1, {"name": "still", "count": 1}, WAIT).credit == 1
    assert ep.get(WAIT).message.payload == (b"still:0",)


@pytest.mark.parametrize("where", ["data", "bot", "close"])
def test_a_handler_exception_ends_only_its_flow(
    serve, client, background, caplog, wire_mode, where
):
    running = serve(wire_mode)
    good = background(give, client(running), "good", 6, name="good")
    bad = client(running)
    if where == "bot":
        with pytest.raises(TransportError, match="BOT"):
            bad.connect(Direction.EXTRACT, 2, {"name": "bad", "fail": "bot"}, SHORT)
    else:
        bad.connect(Direction.EXTRACT, 2, {"name": "bad", "fail": where}, WAIT)
        assert bad.put((b"boom",), timeout=WAIT)
        if where == "close":
            assert bad.send_eot(timeout=WAIT).echo  # the flow ends; on_close then fails

    poll_until(lambda: running.server.stats["handler_errors"] == 1, what="the handler error")
    closes = running.journal.wait("close", "bad")
    if where != "close":
        assert closes[0].info["reason"].startswith("handler error: RuntimeError")

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.exc_info and r.exc_info[0] is RuntimeError]

    poll_until(failed, what="the handler's traceback logged")  # counted just before
    assert len(failed()) == 1 and f"on_{where} failed on purpose" in str(failed()[0].exc_info[1])

    assert good.result() == [f"good says {i}".encode() for i in range(6)]
    assert running.journal.wait("close", "good")[0].info["reason"] == "end of transmission"
    poll_until(lambda: not running.server.flows, what="all flows removed")
    assert running.server.error is None and running.server.stats["dropped"] == 0


def test_stop_is_prompt_and_idempotent(serve, client, wire_mode):
    running = serve(wire_mode, tick=30.0)  # the loop would sleep 30 s without the waker
    ep = client(running)
    ep.connect(Direction.INJECT, 1, {"name": "open"}, WAIT)
    t0 = time.monotonic()
    running.server.stop()
    assert time.monotonic() - t0 < 1.0
    assert running.journal.wait("close", "open")[0].info["reason"] == "server stopped"
    assert running.server.port.closed and not running.server.flows
    running.server.stop()  # again: nothing happens
    running.server.call_soon(lambda: None)  # after stop: queued, never run, no error
    assert running.server.error is None


# ------------------------------------------------------------------ hooks for takers


class FastTaker(Service):
    """A taker that takes plain DATs in :meth:`on_message` (its own fast lane) and notes
    each :meth:`on_drained`."""

    def on_message(self, conn: ServerFlow, msg: Message) -> bool:
        if msg.label != DAT_LABEL or not conn.flow.take_dat():
            return False
        self._note("fast", conn, payload=msg.payload, origin=conn.bot_origin)
        conn.pay(1)
        return True

    def on_drained(self, conn: ServerFlow, now: float) -> None:
        self._note("drained", conn)


@pytest.fixture
def serve_fast(
    ctx: zmq.Context[Any], make_server: MakeServer, tcp_any: str
) -> Iterator[Callable[..., Running]]:
    made: list[FlowServer] = []

    def start(mode: str = "routerdealer", **kw: Any) -> Running:
        journal = Journal()
        port = make_server(mode=mode)
        port.bind(tcp_any)
        server = FlowServer(port, lambda: FastTaker(journal), ctx=ctx, **kw)
        made.append(server)
        server.start()
        return Running(server, journal, mode)

    yield start
    for server in made:
        server.stop()


def test_a_fast_lane_takes_dats_and_on_drained_follows_each_read(serve_fast, make_client):
    running = serve_fast()
    port = make_client(mode=running.mode)
    port.connect(running.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT, origin=42)
    sent = give(ep, "fast", 5)
    poll_until(lambda: any(e.kind == "close" for e in running.journal.entries), what="close")
    kinds = [e.kind for e in running.journal.entries]
    fast = [e for e in running.journal.entries if e.kind == "fast"]
    # Every DAT went by the fast lane (none reached on_data), BOT and EOT the usual way.
    assert [e.info["payload"][0] for e in fast] == sent
    assert "data" not in kinds and kinds.count("eot") == 1
    assert {e.info["origin"] for e in fast} == {42}  # the BOT message's coord origin
    # on_drained comes after the input of a read, never before the first input.
    assert kinds.index("bot") < kinds.index("drained")
    assert kinds[-1] == "close"
    assert running.server.stats["dropped"] == 0


def test_input_of_no_flow_goes_to_on_stray(serve, make_client, wire_mode):
    strays: list[tuple[Any, Message | None, str]] = []
    running = serve(wire_mode, on_stray=lambda peer, msg, why: strays.append((peer, msg, why)))
    port, _ = _breaker_dat_before_bot(running, make_client)
    try:
        poll_until(lambda: strays, what="the stray")
        _peer, msg, why = strays[0]
        assert msg is not None and msg.payload == (b"early",)
        assert "BOT" in why or "DAT" in why, why
        # Handed to the hook, not dropped as a protocol violation; no flow was made.
        assert running.server.stats["dropped"] == 0 and running.server.flows == {}
    finally:
        port.close(linger_ms=0)
