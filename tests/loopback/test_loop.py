"""The Waker: a poll wakes at once when another thread wakes it, wake-ups coalesce, and a
closed waker ignores wake-ups. Every wait is bounded."""

from __future__ import annotations

import threading
import time

import zmq

from zio_spark.transport.loop import Waker


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
