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
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["Waker"]


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
