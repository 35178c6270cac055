"""Remote spool access: executors that cannot see the spool fetch segment ranges over zmq.

The runner exposes a :class:`SegmentServer` (a ROUTER in a thread). A request is
``[b"READ", producer, start, end]`` (ASCII decimals); the answer is a stream of
``[b"BATCH", <Arrow IPC stream bytes>]`` messages closed by ``[b"END"]``, or a single
``[b"ERR", kind, text]`` where ``kind`` is ``missing`` (a :class:`DataLossError`) or
``bad`` (a malformed request). Reads are the same :func:`read_sealed` the local path
uses, so remote and local reads return identical batches.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import pyarrow as pa
import zmq

from zio_spark.errors import DataLossError, RemoteProtocolError, TransportError
from zio_spark.queue.spool import read_sealed

__all__ = ["SegmentServer", "fetch_range"]

log = logging.getLogger("zio_spark.source")


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


class SegmentServer:
    """Serve sealed ranges of the spool at ``path`` on ``bind`` (a thread owns the socket)."""

    def __init__(self, path: str, bind: str = "tcp://127.0.0.1:*") -> None:
        self.path = path
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = 0
        self.bad_requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zio-segments", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(100):
                    continue
                frames = self.sock.recv_multipart()
                self._serve(frames)
        finally:
            self.sock.close(0)

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


def fetch_range(
    endpoint: str, producer: str, start: int, end: int, timeout: float = 60.0
) -> Iterator[pa.RecordBatch]:
    """Fetch ``[start, end)`` of ``producer`` from a :class:`SegmentServer`.

    Raises
    ------
    DataLossError
        If the range is no longer (or not yet) in the spool.
    TransportError
        On timeout or a malformed answer.
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"READ", producer.encode(), str(start).encode(), str(end).encode()])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TransportError(
                    f"no answer from the segment server within {timeout} s", endpoint=endpoint
                )
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
            sock.close(0)
