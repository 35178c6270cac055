"""Fixtures for loopback transport tests, in the manner of pyzmq's own test suite.

- ``ctx``: a fresh ``zmq.Context`` per test that must terminate at teardown; a socket left
  open fails the test (it is closed first so the run does not hang), and termination
  itself is bounded.
- ``make_server`` / ``make_client``: ports with linger 0, closed at teardown.
- ``raw_socket``: plain pyzmq sockets (linger 0) for looking at the wire, closed at
  teardown.
- Endpoints: ``tcp://127.0.0.1:*`` only (never a fixed port or another address), unique
  ``inproc://`` names, ``ipc://`` under ``tmp_path``.
- ``make_broker``: a PZQ queue broker on this test's context (linger 0), stopped at
  teardown; ``make(store=None, **options)``.
- ``recording_proxy``: a plain TCP relay on 127.0.0.1 that keeps every byte it forwards.

Draft sockets: tests marked ``@pytest.mark.requires_draft`` are handled suite-wide in
tests/conftest.py (skipped without the draft API, failed when ``ZIO_REQUIRE_DRAFT=1``).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq

from tests.support import TERM_TIMEOUT_S, TrackingContext, close_all, tracked_context
from zio_spark.pzq.broker import QueueBroker
from zio_spark.source.producer import Producer
from zio_spark.source.receiver import Receiver
from zio_spark.transport.curve import CurveAuthenticator
from zio_spark.transport.port import ClientPort, ServerPort


@pytest.fixture
def ctx() -> Iterator[TrackingContext]:
    yield from tracked_context()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Things to close at teardown, newest first (receivers before their producers): a
    :class:`Receiver` is stopped and must have no error, a :class:`Producer` closed
    without waiting for delivery, anything else ``close()``d; every one is tried."""
    things: list[Any] = []
    yield things

    def close(thing: Any) -> None:
        if isinstance(thing, Receiver):
            thing.stop()
            assert thing.error is None, thing.error
        elif isinstance(thing, Producer):
            thing.close(flush=False, timeout=5)
        else:
            thing.close()

    close_all(things, close)


@pytest.fixture
def make_broker(ctx: zmq.Context[Any], tmp_path: Path) -> Iterator[Callable[..., QueueBroker]]:
    """A PZQ queue broker on ``ctx`` (linger 0, store under ``tmp_path`` unless given),
    stopped at teardown."""
    made: list[QueueBroker] = []

    def make(store: Path | None = None, **kw: Any) -> QueueBroker:
        kw.setdefault("linger_ms", 0)
        kw.setdefault("context", ctx)
        b = QueueBroker(store or tmp_path / "store", **kw).start()
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


P = TypeVar("P", ServerPort, ClientPort)


def _ports(ctx: zmq.Context[Any], cls: Callable[..., P]) -> Iterator[Callable[..., P]]:
    """A factory of ports (linger 0 unless given) that closes them all at teardown."""
    made: list[P] = []

    def make(**kw: Any) -> P:
        kw.setdefault("linger_ms", 0)
        port = cls(ctx, **kw)
        made.append(port)
        return port

    yield make
    for port in made:
        port.close(linger_ms=0)


@pytest.fixture
def make_server(ctx: zmq.Context[Any]) -> Iterator[Callable[..., ServerPort]]:
    yield from _ports(ctx, ServerPort)


@pytest.fixture
def make_client(ctx: zmq.Context[Any]) -> Iterator[Callable[..., ClientPort]]:
    yield from _ports(ctx, ClientPort)


@pytest.fixture
def raw_socket(ctx: zmq.Context[Any]) -> Iterator[Callable[[int], zmq.Socket[bytes]]]:
    made: list[zmq.Socket[bytes]] = []

    def make(kind: int) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = ctx.socket(kind)
        s.linger = 0
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(linger=0)


@pytest.fixture
def authenticator(ctx: zmq.Context[Any]) -> Iterator[Callable[..., CurveAuthenticator]]:
    made: list[CurveAuthenticator] = []

    def make(keys: list[bytes], **kw: Any) -> CurveAuthenticator:
        auth = CurveAuthenticator(ctx, keys, **kw)
        made.append(auth)
        return auth.start()

    yield make
    for auth in made:
        auth.stop()


@pytest.fixture
def tcp_any() -> str:
    return "tcp://127.0.0.1:*"


@pytest.fixture
def inproc_endpoint() -> str:
    return f"inproc://zio-test-{uuid.uuid4().hex}"


@pytest.fixture
def ipc_endpoint(tmp_path: Path) -> str:
    path = tmp_path / "port.ipc"
    if len(str(path)) > 100:  # sun_path is 108 bytes
        pytest.skip(f"tmp_path too long for an ipc socket: {path}")
    return f"ipc://{path}"


class RecordingProxy:
    """A TCP relay on 127.0.0.1 that records every byte going either way.

    Clients connect to ``port``; each connection is relayed to ``target_port``. Used to
    check what an eavesdropper on the wire could read, without tcpdump.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._recorded = bytearray()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self.connections = 0
        self._thread = threading.Thread(target=self._run, name="recording-proxy", daemon=True)
        self._thread.start()

    @property
    def recorded(self) -> bytes:
        with self._lock:
            return bytes(self._recorded)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        other: dict[socket.socket, socket.socket] = {}
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "wake":
                        return
                    if key.data == "accept":
                        down, _ = self._listener.accept()
                        up = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                        up.settimeout(None)
                        other[down], other[up] = up, down
                        sel.register(down, selectors.EVENT_READ, "pipe")
                        sel.register(up, selectors.EVENT_READ, "pipe")
                        self.connections += 1
                        continue
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = src.recv(65536)
                    except OSError:
                        data = b""
                    dst = other.get(src)
                    if not data or dst is None:
                        for s in (src, dst):
                            if s is not None and s in other:
                                sel.unregister(s)
                                other.pop(s)
                                s.close()
                        continue
                    with self._lock:
                        self._recorded += data
                    with contextlib.suppress(OSError):
                        dst.sendall(data)
        finally:
            for s in other:
                s.close()
            sel.close()

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join(TERM_TIMEOUT_S)
        alive = self._thread.is_alive()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        assert not alive, "recording proxy thread did not stop"


@pytest.fixture
def recording_proxy() -> Iterator[Callable[[int], RecordingProxy]]:
    made: list[RecordingProxy] = []

    def make(target_port: int) -> RecordingProxy:
        proxy = RecordingProxy(target_port)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


@pytest.fixture(
    params=["routerdealer", pytest.param("clientserver", marks=pytest.mark.requires_draft)]
)
def wire_mode(request: pytest.FixtureRequest) -> str:
    """Run a test on both socket pairs (clientserver needs a draft pyzmq)."""
    return str(request.param)
