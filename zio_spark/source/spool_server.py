"""Remote spool access: executors that cannot see the spool fetch segment ranges over zmq.

The runner exposes a :class:`SegmentServer` (a ROUTER in a thread running a
:class:`~zio_spark.transport.loop.Loop`, woken at once to stop). A request is
``[b"READ", producer, start, end]`` (ASCII decimals); the answer is a stream of
``[b"BATCH", <Arrow IPC stream bytes>]`` messages closed by ``[b"END"]``, or a single
``[b"ERR", kind, text]`` where ``kind`` is ``missing`` (a :class:`DataLossError`) or
``bad`` (a malformed request). Reads are the same :func:`read_sealed` the local path
uses, so remote and local reads return identical batches.

The server is locked (issue #15): it binds one address, by default the driver's Spark
host address (:func:`driver_host`), never every interface unless told so, and speaks
CURVE only. Each server draws a fresh key pair for itself and one for its readers
(:class:`SegmentKeys`); the partitions carry the server's public key and the reader key
pair to the executors, and a ZAP handler on the server's private context admits that
reader key alone. A reader without it gets no answer, and no record crosses the wire in
clear.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import zmq
import zmq.utils.monitor

from zio_spark.errors import DataLossError, RemoteProtocolError, TransportError
from zio_spark.storage.spool import read_sealed
from zio_spark.transport.curve import CurveAuthenticator, start_authenticator
from zio_spark.transport.loop import Loop

__all__ = ["SegmentKeys", "SegmentServer", "driver_host", "fetch_range"]

log = logging.getLogger("zio_spark.source")


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data


_LOOPBACK = "127.0.0.1"
_IDLE_WAIT = 1.0  # seconds: the longest poll (a request or stop() wakes it at once)
_REQUESTS_PER_TURN = 100


def _spark_conf_value(key: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    """``key`` from ``spark-defaults.conf`` ($SPARK_CONF_DIR, else $SPARK_HOME/conf)."""
    conf_dir = env.get("SPARK_CONF_DIR") or (
        os.path.join(env["SPARK_HOME"], "conf") if env.get("SPARK_HOME") else None
    )
    if not conf_dir:
        return None
    path = os.path.join(conf_dir, "spark-defaults.conf")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0] == key and not parts[0].startswith("#"):
            found = parts[1].strip()  # the last one wins, as in Spark
    return (found, f"{key} in {path}") if found else None


def _detected_address() -> str:
    """The address Spark's driver would pick with nothing configured.

    Spark (``Utils.findLocalInetAddress``) takes the address of this host's name, and if
    that is a loopback address, an address of a network interface. The interface here is
    the one of the default route (a UDP ``connect`` sends nothing); no route: loopback.
    """
    with contextlib.suppress(OSError):
        addr = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
        addr = str(s.getsockname()[0])
        if addr != "0.0.0.0":
            return addr
    return _LOOPBACK


def driver_host(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The driver's Spark host address as the source runner can know it, and whence.

    The runner is a Python process the driver's JVM starts: it does not see the session's
    SparkConf, only the environment and the Spark configuration files. In Spark's order
    for ``spark.driver.host``: the value in ``spark-defaults.conf``, then
    ``SPARK_LOCAL_HOSTNAME``, then ``SPARK_LOCAL_IP``, then the address Spark itself would
    detect (:func:`_detected_address`). Never every interface: a ``spark.driver.host`` set
    only in code is invisible here, so ``spoolServerHost`` names it then.
    """
    env = os.environ if env is None else env
    conf = _spark_conf_value("spark.driver.host", env)
    if conf is not None:
        return conf
    for var in ("SPARK_LOCAL_HOSTNAME", "SPARK_LOCAL_IP"):
        if env.get(var, "").strip():
            return env[var].strip(), var
    return _detected_address(), "this host's address (as Spark detects it)"


def _everywhere(host: str) -> bool:
    return host in ("*", "0.0.0.0", "::", "[::]")


def _tcp(host: str) -> str:
    """``host`` as the host part of a tcp endpoint (IPv6 literals in brackets)."""
    bare = host.strip("[]")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(bare).version == 6:
            return f"[{bare}]"
    return host


@dataclass(frozen=True, slots=True)
class SegmentKeys:
    """The CURVE keys of one segment server run (Z85 text; pickled into partitions).

    ``server_public``: the server's public key, which readers check. ``reader_public`` and
    ``reader_secret``: the one key pair the server admits. The server's secret key stays
    in the runner.
    """

    server_public: str
    reader_public: str
    reader_secret: str

    def __repr__(self) -> str:  # never print a secret in a log or a Spark plan
        return f"SegmentKeys(server_public={self.server_public!r}, reader_public=...)"


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise TransportError(
            "the segment server needs CURVE but this libzmq has none: install the pyzmq "
            "wheel from PyPI (or a libzmq built with libsodium), or set spoolAccess=local "
            "with a spoolPath every executor can read"
        )


class SegmentServer:
    """Serve sealed ranges of the spool at ``path`` on ``host`` (a thread owns the socket).

    ``host`` is an address of this machine (or a name resolving to one); ``"0.0.0.0"``
    (every interface) only when asked for. CURVE is always on: :attr:`keys` are this run's
    server public key and the only reader key pair admitted. :attr:`endpoint` is what
    readers connect to (the host as given; every interface: this host's name).
    """

    def __init__(self, path: str, host: str = _LOOPBACK) -> None:
        _require_curve()
        self.path = path
        server_public, server_secret = zmq.curve_keypair()
        reader_public, reader_secret = zmq.curve_keypair()
        self.keys = SegmentKeys(
            server_public.decode("ascii"),
            reader_public.decode("ascii"),
            reader_secret.decode("ascii"),
        )
        # A private context: ZAP handlers are one per context, and the runner's receiver
        # may run its own for a CURVE-protected bind.
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: CurveAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        try:
            self.sock.linger = 0
            self.sock.curve_server = True
            self.sock.curve_secretkey = server_secret
            self.sock.zap_domain = b"zio-segments"
            self._auth = start_authenticator(self.ctx, [reader_public], domain="zio-segments")
            where = _tcp(host)
            if ":" in where:
                self.sock.ipv6 = True
            try:
                self.sock.bind(f"tcp://{where}:*")
            except zmq.ZMQError as e:
                raise TransportError(
                    f"the segment server cannot listen on {host!r}: {e}; set the source "
                    "option spoolServerHost to an address of this machine that executors "
                    "can reach",
                    endpoint=f"tcp://{where}:*",
                ) from e
        except BaseException:
            self._close()
            raise
        self.bound: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        port = self.bound.rsplit(":", 1)[1]
        advertised = socket.gethostname() if _everywhere(host) else where
        self.endpoint: str = f"tcp://{advertised}:{port}"
        self.requests = 0
        self.bad_requests = 0
        # No timer: the poll waits for a request or for stop()'s wake-up.
        self._loop = Loop(tick=_IDLE_WAIT, name="zio-segments")
        self._loop.add(self)
        self._thread = threading.Thread(target=self._loop.run, name="zio-segments", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._loop.stop()
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
            self._close()

    def _close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()

    # -- the loop's part (server thread) --------------------------------------------------

    def sockets(self) -> list[zmq.Socket[bytes]]:
        return [self.sock]

    def process(self, ready: Collection[object], now: float) -> None:
        if self.sock not in ready:
            return
        for _ in range(_REQUESTS_PER_TURN):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._serve(frames)

    def tick(self, now: float) -> float | None:
        return None

    def _serve(self, frames: list[bytes]) -> None:
        ident, req = frames[0], frames[1:]
        self.requests += 1
        try:
            if len(req) != 4 or req[0] != b"READ":
                raise RemoteProtocolError(f"bad segment request {req[:1]!r} ({len(req)} parts)")
            producer = req[1].decode("utf-8")
            start, end = int(req[2]), int(req[3])
        except (UnicodeDecodeError, ValueError, RemoteProtocolError) as e:
            self.bad_requests += 1
            self.sock.send_multipart([ident, b"ERR", b"bad", str(e).encode()])
            return
        try:
            for batch in read_sealed(self.path, producer, start, end):
                self.sock.send_multipart([ident, b"BATCH", _ipc(batch)], copy=False)
        except DataLossError as e:
            self.sock.send_multipart([ident, b"ERR", b"missing", str(e).encode()])
            return
        except Exception as e:  # never kill the server on one bad read
            log.exception("segment read failed")
            self.sock.send_multipart([ident, b"ERR", b"bad", repr(e).encode()])
            return
        self.sock.send_multipart([ident, b"END"])


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def _await(
    sock: zmq.Socket[bytes],
    monitor: zmq.Socket[bytes],
    event: int,
    timeout: float,
    endpoint: str,
    what: str,
) -> None:
    """Wait until ``sock`` is ready for ``event`` (POLLIN/POLLOUT); a refused handshake on
    ``monitor`` or ``timeout`` s without it raise :class:`TransportError` (``what`` says
    what did not happen: "no answer from" the segment server)."""
    poller = zmq.Poller()
    poller.register(sock, event)
    poller.register(monitor, zmq.POLLIN)
    ready = dict(poller.poll(int(timeout * 1000)))
    if monitor in ready:
        got = zmq.utils.monitor.recv_monitor_message(monitor)
        raise TransportError(
            "the segment server refused our CURVE handshake (event "
            f"{got['event']!r}, errno {got['value']}): this partition's keys are "
            "not those of the server's run (a restarted query? a stale task?)",
            endpoint=endpoint,
        )
    if sock not in ready:
        raise TransportError(f"{what} the segment server within {timeout} s", endpoint=endpoint)


def _reader_socket(
    ctx: zmq.Context[Any], keys: SegmentKeys, endpoint: str
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A reader's DEALER with ``keys``, connected to ``endpoint``, and the monitor of its
    refused handshakes (the caller closes both)."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.linger = 0
    monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
    try:
        sock.curve_serverkey = keys.server_public.encode("ascii")
        sock.curve_publickey = keys.reader_public.encode("ascii")
        sock.curve_secretkey = keys.reader_secret.encode("ascii")
        if endpoint.startswith("tcp://["):
            sock.ipv6 = True
        sock.connect(endpoint)
    except BaseException:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        raise
    return sock, monitor


def fetch_range(
    endpoint: str,
    keys: SegmentKeys,
    producer: str,
    start: int,
    end: int,
    timeout: float = 60.0,
) -> Iterator[pa.RecordBatch]:
    """Fetch ``[start, end)`` of ``producer`` from a :class:`SegmentServer`, over CURVE.

    ``keys`` are the server's (carried in the partition): the reader authenticates with
    them and checks the server's public key.

    Raises
    ------
    DataLossError
        If the range is no longer (or not yet) in the spool.
    TransportError
        On timeout, a refused CURVE handshake (keys of another run) or a malformed answer.
    """
    _require_curve()
    sock, monitor = _reader_socket(zmq.Context.instance(), keys, endpoint)
    try:
        request = [b"READ", producer.encode(), str(start).encode(), str(end).encode()]
        # Not a plain blocking send: should the handshake fail before it (a thread
        # descheduled between connect and send, on a busy executor), the DEALER has no pipe
        # left and a blocking send would never return. Wait for room or the refusal.
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            _await(sock, monitor, zmq.POLLOUT, left, endpoint, "could not send our request to")
            try:
                sock.send_multipart(request, zmq.NOBLOCK)
                break
            except zmq.Again:  # the pipe went between poll and send (libzmq rolled back)
                continue
        while True:
            _await(sock, monitor, zmq.POLLIN, timeout, endpoint, "no answer from")
            parts = sock.recv_multipart()
            kind = parts[0] if parts else b""
            if kind == b"END":
                return
            if kind == b"BATCH" and len(parts) == 2:
                with pa.ipc.open_stream(pa.py_buffer(parts[1])) as reader:
                    yield from reader
                continue
            if kind == b"ERR" and len(parts) == 3:
                text = parts[2].decode("utf-8", "replace")
                if parts[1] == b"missing":
                    raise DataLossError(text, producer=producer)
                raise TransportError(f"segment server refused: {text}", endpoint=endpoint)
            raise TransportError(
                f"bad answer from the segment server: {parts[:1]!r}", endpoint=endpoint
            )
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        with contextlib.suppress(zmq.ZMQError):
            monitor.close(0)
        with contextlib.suppress(zmq.ZMQError):
            sock.close(0)
