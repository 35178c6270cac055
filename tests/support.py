"""Helpers every test folder shares (one copy each; tests import them from here).

- :func:`wait_until`: poll a condition with a deadline (tests never sleep to wait).
- :class:`TrackingContext`, :func:`terminate`, :func:`tracked_context`: a zmq context that
  keeps every socket it made, so a leaked socket fails the test instead of being
  garbage-collected quietly.
- :func:`free_port`, :func:`free_endpoint`: a loopback TCP port nobody listens on (yet).
- :func:`spark_session`: the local, loopback-only SparkSession the Spark tests share, with
  the workers on this interpreter (``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import os
import socket
import sys
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


def tracked_context() -> Iterator[TrackingContext]:
    """Body of a ``ctx`` fixture: yields a :class:`TrackingContext`, then fails the test
    if it leaked a socket or the context would not terminate."""
    import pytest

    context = TrackingContext()
    yield context
    leaked = terminate(context)
    if leaked:
        pytest.fail(f"test leaked {len(leaked)} zmq socket(s): {leaked}", pytrace=False)


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
