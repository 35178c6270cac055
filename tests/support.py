"""Helpers every test folder shares (one copy each; tests import them from here).

- :func:`wait_until`: poll a condition with a deadline (tests never sleep to wait).
- :class:`TrackingContext`, :func:`terminate`, :func:`tracked_context`: a zmq context that
  keeps every socket it made, so a leaked socket fails the test instead of being
  garbage-collected quietly.
- :func:`spool_rows`: what a spool holds of a producer, as ``(seq, value)``.
- :func:`spark_trigger`: a Spark trigger done by hand on a spool and its receiver.
- :func:`close_all`: a fixture's teardown of several things, each tried even when one fails.
- :func:`free_port`, :func:`free_endpoint`: a loopback TCP port nobody listens on (yet).
- :func:`spark_session`: the local, loopback-only SparkSession the Spark tests share, with
  the workers on this interpreter (``PYSPARK_PYTHON``).
- :func:`runner_reader`, :func:`zio_stream`, :func:`to_parquet`, :func:`committed_rows`,
  :func:`rate_values`, :func:`wait_published`, :func:`check_published`,
  :func:`check_batch_read`: the source and sink driven the same way by several Spark test
  folders (tests/compat runs them on pyspark 4.0-4.2: nothing here imports pyspark at
  module level).
- :func:`start_producer_child`, :func:`stop_producer_child`: a producer in another
  process, holding its records until stopped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import zmq

T = TypeVar("T")

TERM_TIMEOUT_S = 5.0


def wait_until(
    cond: Callable[[], T],
    timeout: float = 20.0,
    what: str = "condition",
    interval: float = 0.05,
    detail: Callable[[], object] | None = None,
) -> T:
    """Return ``cond()``'s first truthy value; AssertionError naming ``what`` after
    ``timeout`` seconds (with ``detail()`` appended, for the state worth seeing)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            extra = f": {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{extra}")
        time.sleep(interval)


class TrackingContext(zmq.Context):  # type: ignore[type-arg]
    """A context that holds every socket it made, so a leak is seen, not garbage-collected.

    pyzmq closes an unreferenced socket when it is collected (with only a ResourceWarning),
    which would hide a port that a test or the code under test forgot to close.
    """

    _made: list[zmq.Socket[Any]]

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        s = super().socket(*args, **kwargs)
        if not hasattr(self, "_made"):
            self._made = []
        self._made.append(s)
        return s

    def open_sockets(self) -> list[zmq.Socket[Any]]:
        return [s for s in getattr(self, "_made", []) if not s.closed]


def terminate(ctx: TrackingContext, timeout_s: float = TERM_TIMEOUT_S) -> list[str]:
    """Terminate ``ctx`` within ``timeout_s``; returns descriptions of leaked sockets.

    Leaked sockets are closed with linger 0 first so termination cannot hang on them.
    Raises AssertionError if termination still does not finish in time.
    """
    leaked = ctx.open_sockets()
    names = [repr(s) for s in leaked]
    for s in leaked:
        s.close(linger=0)
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, name="zmq-ctx-term", daemon=True).start()
    if not done.wait(timeout_s):
        raise AssertionError(f"zmq context did not terminate within {timeout_s} s")
    return names


def _threads_left(before: set[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Threads not in ``before`` still running after waiting up to ``timeout_s`` for them."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not left or time.monotonic() >= deadline:
            return left
        left[0].join(max(0.0, min(0.05, deadline - time.monotonic())))


def _stacks(threads: list[threading.Thread], depth: int = 8) -> str:
    """Where each of ``threads`` is now (its innermost ``depth`` frames)."""
    import sys
    import traceback

    frames = sys._current_frames()
    out = []
    for t in threads:
        frame = frames.get(t.ident) if t.ident is not None else None
        where = "".join(traceback.format_stack(frame)[-depth:]) if frame else "  (no frame)\n"
        out.append(f"thread {t.name}:\n{where}")
    return "".join(out)


def tracked_context() -> Iterator[TrackingContext]:
    """Body of a ``ctx`` fixture: yields a :class:`TrackingContext`, then fails the test
    if it leaked a socket or the context would not terminate.

    A socket may only be closed by the thread that uses it (libzmq aborts the whole
    process otherwise). So when a thread the test started still runs at teardown (after a
    bounded wait for it to end) and sockets are still open, the test fails naming both and
    the context is left alone, instead of closing sockets under that thread.
    """
    import pytest

    before = set(threading.enumerate())
    context = TrackingContext()
    yield context
    if context.open_sockets():
        left = _threads_left(before, TERM_TIMEOUT_S)
        still_open = [repr(s) for s in context.open_sockets()]
        if left and still_open:
            pytest.fail(
                f"test left {len(left)} thread(s) running "
                f"({', '.join(t.name for t in left)}) with {len(still_open)} zmq socket(s) "
                f"open: {still_open}; the sockets were not closed under them\n" + _stacks(left),
                pytrace=False,
            )
    leaked = terminate(context)
    if leaked:
        pytest.fail(f"test leaked {len(leaked)} zmq socket(s): {leaked}", pytrace=False)


def close_all(things: list[Any], close: Callable[[Any], None]) -> None:
    """Close ``things`` newest first with ``close``; every one is tried even when one
    fails (a thing left running would keep its sockets past the test), then the first
    failure is raised, naming how many others failed too."""
    errors: list[BaseException] = []
    for thing in reversed(things):
        try:
            close(thing)
        except Exception as e:
            errors.append(e)
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"{len(errors) - 1} more thing(s) failed to close: {errors[1:]!r}")
        raise errors[0]


def spool_rows(spool: Any, producer: str) -> list[tuple[int, bytes]]:
    """Seal ``spool``, then every retained record of ``producer`` as ``(seq, value)``."""
    ends = spool.seal()
    start = spool.start_offsets()[producer]
    out: list[tuple[int, bytes]] = []
    for batch in spool.read(producer, start, ends[producer]):
        out.extend(
            zip(batch.column("seq").to_pylist(), batch.column("value").to_pylist(), strict=True)
        )
    return out


def spark_trigger(spool: Any, receiver: Any, producer: str, got: list[tuple[int, bytes]]) -> int:
    """What Spark does each trigger, by hand: seal ``spool``, read ``producer``'s new
    range into ``got`` as ``(seq, value)``, commit it through ``receiver``. The new end."""
    ends = spool.seal()
    start = spool.committed().get(producer, 1)
    for batch in spool.read(producer, start, ends[producer]):
        got.extend(
            zip(batch.column("seq").to_pylist(), batch.column("value").to_pylist(), strict=True)
        )
    receiver.commit(ends)
    return int(ends[producer])


class Background:
    """A blocking call run in a thread of its own; :meth:`result` joins it with a
    deadline and returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], Any], name: str = "background") -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:
            self._error = e

    def running_after(self, seconds: float) -> bool:
        """True if still running after ``seconds`` (a bounded wait for a non-event)."""
        self.thread.join(seconds)
        return self.thread.is_alive()

    def result(self, timeout: float = 5.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.thread.name} still running after {timeout} s"
        if self._error is not None:
            raise self._error
        return self._value


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to 0, read, release)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_endpoint(host: str = "127.0.0.1") -> str:
    """``tcp://<host>:<port>`` with a port from :func:`free_port`."""
    return (
        f"tcp://{host}:{free_port(host)}"
        if ":" not in host
        else f"tcp://[{host}]:{free_port(host)}"
    )


def spark_session(app: str = "zio-spark-tests", **conf: str) -> Any:
    """A ``local[2]`` SparkSession bound to loopback, its Python workers on this
    interpreter (else ``format("zio")`` is not found), UTC, 2 shuffle partitions;
    ``conf`` adds or overrides settings."""
    from pyspark.sql import SparkSession

    # Loopback only: Spark must not pick a real interface for its own sockets.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    settings = {
        "spark.ui.enabled": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.session.timeZone": "UTC",
        **conf,
    }
    builder = SparkSession.builder.master("local[2]").appName(app)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session


def runner_reader(endpoint: str, tmp_path: Any, **options: object) -> Any:
    """A zio stream reader used the way Spark's runner uses it, without a session:
    ``endpoints``, a local spool in ``tmp_path / "spool"``, columns ``seq`` and ``value``;
    ``options`` are further source options (their values as strings)."""
    from zio_spark.options import parse_source_options
    from zio_spark.spark.source import ZioStreamReader

    opts = {"endpoints": endpoint, "spoolPath": str(tmp_path / "spool"), "spoolAccess": "local"}
    opts.update({k: str(v) for k, v in options.items()})
    return ZioStreamReader(parse_source_options(opts), ("seq", "value"))


def zio_stream(spark: Any, endpoint: str, tmp_path: Any, **options: str) -> Any:
    """``spark.readStream.format("zio")`` on ``endpoint``, a local spool in
    ``tmp_path / "spool"``; ``options`` are further source options; loaded."""
    r = (
        spark.readStream.format("zio")
        .option("endpoints", endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("spoolAccess", "local")
    )
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def to_parquet(df: Any, base: Any, **trigger: Any) -> Any:
    """Start streaming ``df`` into parquet in ``base / "out"``, checkpoint ``base / "ckpt"``,
    with ``trigger(**trigger)``; returns the query."""
    return (
        df.writeStream.format("parquet")
        .option("path", str(base / "out"))
        .option("checkpointLocation", str(base / "ckpt"))
        .trigger(**trigger)
        .start()
    )


def committed_rows(q: Any, out: Any) -> Callable[[], int]:
    """Rows the parquet sink of query ``q`` has committed in ``out`` (read from its log, no
    Spark job); the call raises AssertionError once the query has failed."""
    from tests.reliability.helpers import ParquetProgress

    committed = ParquetProgress(out)

    def rows() -> int:
        if q.exception() is not None:
            raise AssertionError(f"query failed: {q.exception()}")
        return committed()

    return rows


def rate_values(spark: Any, rows: int) -> Any:
    """A ``rate-micro-batch`` stream of ``rows`` rows a batch on 2 partitions, its
    ``value`` as a string (batch b holds ``b * rows`` to ``(b + 1) * rows - 1``)."""
    return (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", rows)
        .option("numPartitions", 2)
        .load()
        .selectExpr("cast(value as string) as value")
    )


def wait_published(
    q: Any, consumer: Any, stream: str, batches: int, timeout: float, interval: float = 0.05
) -> None:
    """Wait until ``consumer`` has published ``batches`` batches of ``stream``; the query
    ``q`` must not have failed (it is left running)."""
    wait_until(
        lambda: q.exception() is not None or len(consumer.published(stream)) >= batches,
        timeout,
        f"{batches} published batches",
        interval=interval,
    )
    assert q.exception() is None, q.exception()


def check_published(consumer: Any, stream: str, rows: int) -> None:
    """Each batch of a :func:`rate_values` stream that ``consumer`` published for
    ``stream``: numbered from 0 without a gap, holding its own ``rows`` values once."""
    pubs = consumer.published(stream)
    assert [b for _, b in pubs] == list(range(len(pubs)))
    for _, b in pubs:
        values = sorted(int(r.value) for r in consumer.records(stream, b))
        assert values == list(range(b * rows, (b + 1) * rows)), f"batch {b}"


def check_batch_read(session: Any, fmt: str, endpoint: str, tmp_path: Any, n: int) -> None:
    """A batch read (``maxRecords`` n, ``timeout`` 60s) of a producer that holds the ``n``
    records ``b-0`` ... ``b-<n-1>`` returns each once, ``seq`` 1 to n."""
    got = (
        session.read.format(fmt)
        .option("endpoints", endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("maxRecords", str(n))
        .option("timeout", "60s")
        .load()
        .select("seq", "value")
        .collect()
    )
    assert sorted(r.seq for r in got) == list(range(1, n + 1))
    assert {bytes(r.value) for r in got} == {f"b-{i}".encode() for i in range(n)}


# The producer child: queue COUNT records, say so, keep them until stdin closes.
PRODUCER_CHILD = textwrap.dedent(
    """
    import sys
    from zio_spark.source.producer import Producer

    prod = Producer(bind=sys.argv[1], producer_id=sys.argv[2], linger_ms=0)
    prod.send_many([b"r%d" % i for i in range(int(sys.argv[3]))], timeout=None)
    print("queued", prod.last_seq, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    d = prod.close(timeout=5, flush=False)
    print("acked", d.acked, "sent", d.sent, flush=True)
    """
)


def start_producer_child(endpoint: str, producer_id: str, count: int) -> subprocess.Popen[str]:
    """A producer in another process bound to ``endpoint``, holding ``count`` records
    (``r0`` ...) once this returns; stop it with :func:`stop_producer_child`."""
    child = subprocess.Popen(
        [sys.executable, "-c", PRODUCER_CHILD, endpoint, producer_id, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # the producer holds every record now
        assert line.split() == ["queued", str(count)], line
    except BaseException:
        stop_producer_child(child)
        raise
    return child


def stop_producer_child(child: subprocess.Popen[str]) -> None:
    """Close the child's stdin (it closes its producer and exits), then kill it by pid if
    it has not ended within 30 s."""
    if child.poll() is None:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)


def flip_byte(path: str | os.PathLike[str], offset: int) -> None:
    """Invert one byte of a file in place (a damaged record for integrity checks)."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)
