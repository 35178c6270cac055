"""The suite's tracked context (tests/support.py) at teardown: a leaked socket fails the
test, and a socket still used by a thread the test left running is never closed under it
(libzmq aborts the whole process when a socket is closed while another thread polls it:
one such crash ended a CI run's main pytest pass with no test named)."""

from __future__ import annotations

import threading

import pytest
import zmq

from tests.support import tracked_context


def test_a_leaked_socket_fails_the_test_and_the_context_ends() -> None:
    gen = tracked_context()
    ctx = next(gen)
    ctx.socket(zmq.PAIR).bind("inproc://leak")
    with pytest.raises(pytest.fail.Exception, match=r"leaked 1 zmq socket"):
        next(gen)
    assert ctx.closed


def test_a_socket_in_use_by_a_running_thread_is_not_closed_under_it() -> None:
    gen = tracked_context()
    ctx = next(gen)
    release = threading.Event()
    polling = threading.Event()

    def owner() -> None:  # the only thread that touches its socket, closing it included
        sock = ctx.socket(zmq.PULL)
        sock.bind("inproc://in-use")
        polling.set()
        while not release.is_set():
            sock.poll(10)
        sock.close(linger=0)

    t = threading.Thread(target=owner, name="socket-owner", daemon=True)
    t.start()
    assert polling.wait(5)
    try:
        with pytest.raises(pytest.fail.Exception, match=r"socket-owner.*not closed under them"):
            next(gen)  # waits its bounded time for the thread, then fails naming it
        assert not ctx.closed and [s for s in ctx.open_sockets()]  # left alone
    finally:
        release.set()
        t.join(5)
    assert not t.is_alive() and not ctx.open_sockets()
    ctx.term()


def test_a_thread_that_ends_within_the_wait_closes_its_own_socket_first() -> None:
    gen = tracked_context()
    ctx = next(gen)
    polling = threading.Event()

    def owner() -> None:  # ends shortly after teardown began
        sock = ctx.socket(zmq.PULL)
        sock.bind("inproc://ends")
        polling.set()
        for _ in range(20):
            sock.poll(10)
        sock.close(linger=0)

    t = threading.Thread(target=owner, name="short-owner", daemon=True)
    t.start()
    assert polling.wait(5)
    with pytest.raises(StopIteration):
        next(gen)  # no failure: the thread closed its socket within the wait
    assert ctx.closed
