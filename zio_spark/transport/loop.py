"""The one wake-up mechanism of the poll loops: a :class:`Waker`.

A loop thread polls its sockets with a ``zmq.Poller``; other threads hand it work (a
queued call, a stop request) and then :meth:`Waker.wake` it, so the poll returns at once
instead of at its next timeout. Use::

    waker = Waker()
    poller.register(waker, zmq.POLLIN)        # the waker has a fileno()
    ...
    events = dict(poller.poll(timeout_ms))
    if waker.fd in events:                     # the poller reports it by descriptor
        waker.drain()                          # then run what was queued
    ...
    waker.close()                              # once the loop has ended

A socket pair, not a zmq socket: it needs no context, and ``wake`` is safe from any
thread. Wake-ups coalesce: while one is pending, ``wake`` costs no system call.

:class:`Loop` is the small shared loop built on it: a poller, the waker, queued calls
(:meth:`Loop.call_soon`, thread-safe) and any number of *parts* (:class:`LoopPart`: a flow
server, flow clients). Each turn the loop polls the sockets the parts name, runs the
queued calls, then calls every part's ``process`` and ``tick``. The poll waits at most the
shortest delay a part's last ``tick`` asked for (``tick`` at most). The loop owns no
thread: call :meth:`Loop.turn` (or :meth:`Loop.run`) from the thread that owns the parts'
sockets.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

import zmq

__all__ = ["Loop", "LoopPart", "LoopThread", "Waker"]

log = logging.getLogger("zio_spark.transport")


class Waker:
    """Interrupts a ``zmq.Poller`` wait from any thread (see the module docstring)."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self.fd = self._r.fileno()
        """The read end's descriptor: the key ``zmq.Poller.poll`` reports it under."""
        self._pending = False
        self._lock = threading.Lock()  # close() against a wake() in another thread
        self._closed = False

    def fileno(self) -> int:
        """The read end's descriptor (what the poller watches)."""
        return self.fd

    def wake(self) -> None:
        """Make the loop's poll return; thread-safe, a no-op once closed."""
        if self._pending:
            return  # the loop has not drained the last one yet: it will wake anyway
        with self._lock:
            if self._closed:
                return
            self._pending = True
            # A full buffer means a wake-up is already pending.
            with contextlib.suppress(BlockingIOError, InterruptedError):
                self._w.send(b"\0")

    def drain(self) -> None:
        """Consume pending wake-ups (loop thread); run the queued work after this."""
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            while self._r.recv(4096):
                pass
        # Cleared after reading: a wake() between the two found _pending set and wrote
        # nothing, and its work was queued before, so the caller runs it next.
        self._pending = False

    def close(self) -> None:
        """Close both ends; idempotent. Later ``wake`` calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._r.close()
            self._w.close()

    @property
    def closed(self) -> bool:
        return self._closed


class LoopPart(Protocol):
    """What a :class:`Loop` drives (a :class:`~.flow_server.FlowServer`, a
    :class:`~.flow_client.FlowClient`); all three run in the loop thread."""

    def sockets(self) -> Iterable[zmq.Socket[bytes]]:
        """The sockets to poll for input this turn (asked every turn: they may change)."""
        ...

    def process(self, ready: Collection[object], now: float) -> None:
        """Handle input; ``ready`` holds the sockets (and descriptors) the poll reported."""
        ...

    def tick(self, now: float) -> float | None:
        """Timers and periodic work; returns the most seconds until the next turn it
        needs (None: no timer of its own)."""
        ...


class Loop:
    """One poll loop for many parts, woken by one :class:`Waker` (see the module doc).

    ``tick``: the longest poll wait, seconds. ``stats``: where ``call_errors`` is counted.
    """

    def __init__(
        self,
        *,
        tick: float = 0.05,
        name: str = "loop",
        stats: collections.Counter[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tick_s = tick
        self.name = name
        self.stats: collections.Counter[str] = collections.Counter() if stats is None else stats
        self.clock = clock
        self.waker = Waker()
        self.parts: list[LoopPart] = []
        self._poller = zmq.Poller()
        self._poller.register(self.waker, zmq.POLLIN)
        self._polled: set[zmq.Socket[bytes]] = set()
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._wait = 0.0  # the first turn does not wait: new parts tick at once
        self._stopping = False

    def add(self, part: LoopPart) -> None:
        """Drive ``part`` from the next turn on (loop thread, or before the loop runs);
        that turn polls without waiting, so the part's first tick comes at once."""
        self.parts.append(part)
        self._wait = 0.0

    def remove(self, part: LoopPart) -> None:
        """Stop driving ``part`` (its sockets leave the poller at the next turn)."""
        if part in self.parts:
            self.parts.remove(part)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the loop thread at the next turn (thread-safe)."""
        self._calls.append(fn)
        self.waker.wake()

    def stop(self) -> None:
        """Make :meth:`run` return after the current turn (thread-safe)."""
        self._stopping = True
        self.waker.wake()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def run_calls(self) -> None:
        """Run the queued calls; one that fails is logged and counted, not raised."""
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:
                self.stats["call_errors"] += 1
                log.exception("%s: call_soon function %r failed", self.name, fn)

    def turn(self, timeout: float | None = None) -> dict[object, int]:
        """One turn: poll (at most ``timeout`` s, else what the parts asked for), run the
        queued calls, then every part's ``process`` and ``tick``. Returns the poll's events."""
        wanted: set[zmq.Socket[bytes]] = set()
        for part in self.parts:
            wanted.update(part.sockets())
        for gone in self._polled - wanted:
            self._poller.unregister(gone)
        for new in wanted - self._polled:
            self._poller.register(new, zmq.POLLIN)
        self._polled = wanted
        wait = self._wait if timeout is None else timeout
        events: dict[object, int] = dict(self._poller.poll(int(max(0.0, wait) * 1000)))
        if self.waker.fd in events:
            self.waker.drain()
        self.run_calls()
        now = self.clock()
        for part in list(self.parts):
            part.process(events, now)
        wait = self.tick_s
        for part in list(self.parts):
            due = part.tick(now)
            if due is not None:
                wait = min(wait, due)
        self._wait = wait
        return events

    def run(self) -> None:
        """Turn until :meth:`stop` is called."""
        while not self._stopping:
            self.turn()

    def close(self) -> None:
        """Close the waker (once the loop has ended); the parts are their owners'."""
        self.waker.close()


class LoopThread:
    """A part's own thread (the engines' standalone :meth:`start`): runs ``run``, the
    part's loop body around ``loop.run()``, until :meth:`stop`."""

    def __init__(self, loop: Loop, run: Callable[[], None]) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=run, name=loop.name, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float) -> bool:
        """Stop the loop, join the thread and close the loop; False (loop left open) if
        the thread did not end within ``timeout`` s."""
        self.loop.stop()
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        self.loop.close()
        return True
