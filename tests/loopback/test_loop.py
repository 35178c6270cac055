"""The Waker: a poll wakes at once when another thread wakes it, wake-ups coalesce, and a
closed waker ignores wake-ups. Every wait is bounded."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from zio_spark.transport.loop import Loop, Waker


def test_wake_from_another_thread_ends_the_poll() -> None:
    waker = Waker()
    try:
        poller = zmq.Poller()
        poller.register(waker, zmq.POLLIN)
        assert dict(poller.poll(0)) == {}
        threading.Thread(target=waker.wake).start()
        t0 = time.monotonic()
        events = dict(poller.poll(5000))
        assert waker.fd in events
        assert time.monotonic() - t0 < 4.0
        waker.drain()
        assert dict(poller.poll(0)) == {}
    finally:
        waker.close()


def test_wake_ups_coalesce_until_drained() -> None:
    waker = Waker()
    try:
        poller = zmq.Poller()
        poller.register(waker, zmq.POLLIN)
        for _ in range(10_000):
            waker.wake()
        assert waker.fd in dict(poller.poll(1000))
        waker.drain()
        assert dict(poller.poll(0)) == {}
        waker.wake()  # after a drain, a wake-up is seen again
        assert waker.fd in dict(poller.poll(1000))
    finally:
        waker.close()


def test_closed_waker_ignores_wake() -> None:
    waker = Waker()
    waker.close()
    waker.close()
    waker.wake()
    assert waker.closed


class _Part:
    """A loop part over one PAIR socket: records what it read and its ticks."""

    def __init__(self, sock: zmq.Socket, due: float | None = None) -> None:  # type: ignore[type-arg]
        self.sock, self.due = sock, due
        self.got: list[bytes] = []
        self.ticks = 0
        self.polled = True

    def sockets(self) -> list[zmq.Socket]:  # type: ignore[type-arg]
        return [self.sock] if self.polled else []

    def process(self, ready, now):  # type: ignore[no-untyped-def]
        while self.sock in ready and self.sock.poll(0):
            self.got.append(self.sock.recv())

    def tick(self, now: float) -> float | None:
        self.ticks += 1
        return self.due


def test_loop_runs_calls_parts_and_stops_from_another_thread(ctx: zmq.Context[Any]) -> None:
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.linger = b.linger = 0
    a.bind("inproc://loop-test")
    b.connect("inproc://loop-test")
    loop = Loop(tick=10.0)
    part = _Part(a)
    loop.add(part)
    ran: list[str] = []
    try:
        loop.call_soon(lambda: ran.append("call"))
        loop.call_soon(lambda: 1 / 0)  # type: ignore[func-returns-value]
        loop.turn()
        assert ran == ["call"] and loop.stats["call_errors"] == 1 and part.ticks == 1
        b.send(b"x")
        loop.turn(5.0)  # returns at the message, not after 5 s
        assert part.got == [b"x"]
        part.polled = False  # a part's socket leaves the poller when it stops naming it
        b.send(b"y")
        assert loop.turn(0.05) == {}
        t = threading.Thread(target=loop.run)
        t0 = time.monotonic()
        t.start()
        loop.stop()  # the waker ends the 10 s wait
        t.join(5.0)
        assert not t.is_alive() and time.monotonic() - t0 < 4.0
        loop.remove(part)
        assert loop.parts == []
    finally:
        loop.close()
        a.close()
        b.close()


def test_loop_waits_at_most_what_a_part_asked_for() -> None:
    loop = Loop(tick=10.0)
    part = _Part(zmq.Context.instance().socket(zmq.PAIR), due=0.0)
    part.polled = False
    loop.add(part)
    try:
        t0 = time.monotonic()
        loop.turn()  # a part was just added: no wait
        loop.turn()
        loop.turn()  # the part asked for 0 s: no wait
        assert time.monotonic() - t0 < 4.0 and part.ticks == 3
    finally:
        loop.close()
        part.sock.close(0)
