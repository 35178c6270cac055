"""The zio source and sink through a Spark Connect session, as on Databricks serverless
and shared clusters.

One Spark Connect server (pyspark's own ``sbin/start-connect-server.sh``, 127.0.0.1, a
free port: the run's ``connect_server``, tests/conftest.py); the tests talk to it through
one ``SparkSession.builder.remote`` session for the module, so every call crosses
gRPC: the client builds plans, the server plans and runs
them, and the data source runs in the server's Python workers. Producers and consumers
live in this process, on loopback.

Each operation runs twice: as ``format("zio")`` found by the server's ``pyspark_*``
lookup (auto-registration), and as ``format("zio_explicit")``, a subclass the client
registers with ``spark.dataSource.register`` (pickled by value, so the server can only
know it through that call).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    check_batch_read,
    check_published,
    committed_rows,
    rate_values,
    wait_published,
    wait_until,
)
from zio_spark.sink.consumer import Consumer
from zio_spark.source.producer import Producer
from zio_spark.spark.compat import check_session

FORMATS = ["zio", "zio_explicit"]

# Each poll asks the Connect server: not too often.
_wait = functools.partial(wait_until, interval=0.3)


@pytest.fixture(scope="module")
def remote(connect_server: str) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    from zio_spark.spark.source import ZioDataSource

    url = connect_server
    had_mode = "SPARK_CONNECT_MODE_ENABLED" in os.environ
    session = None
    try:
        # create(), not getOrCreate(): another test module may hold a classic session.
        session = SparkSession.builder.remote(url).create()
        explicit = type(
            "ZioExplicit",
            (ZioDataSource,),
            {"name": classmethod(lambda cls: "zio_explicit"), "__module__": __name__},
        )
        session.dataSource.register(explicit)
        yield session
    finally:
        if session is not None:
            with contextlib.suppress(Exception):
                session.stop()
        if not had_mode:  # the builder marks the process as a Connect client
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


def test_session_is_spark_connect_and_new_enough(remote: Any) -> None:
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    assert isinstance(remote, ConnectSession)
    assert check_session(remote) == remote.version


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_read_into_parquet_exactly_once(remote: Any, fmt: str, tmp_path: Path) -> None:
    n1, n2 = 3000, 2000
    prod = Producer(producer_id=f"connect-{fmt}", linger_ms=0)
    q = None
    try:
        prod.send_many([f"rec-{i}".encode() for i in range(n1)])
        df = (
            remote.readStream.format(fmt)
            .option("endpoints", prod.endpoint)
            .option("spoolPath", str(tmp_path / "spool"))
            .load()
        )
        out = str(tmp_path / "out")
        q = (
            df.writeStream.format("parquet")
            .option("path", out)
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="500 milliseconds")
            .start()
        )

        rows = committed_rows(q, tmp_path / "out")  # the sink's log, read here: no job
        _wait(lambda: rows() >= n1, what=f"{n1} rows of the first wave", timeout=90.0)
        prod.send_many([f"rec-{i}".encode() for i in range(n1, n1 + n2)])
        _wait(lambda: rows() >= n1 + n2, what=f"{n1 + n2} rows", timeout=90.0)
        # The source acknowledges a batch once the next one is planned: all of them soon.
        _wait(
            lambda: prod.acked == n1 + n2,
            what="the producer to hear every record acked",
            timeout=90.0,
        )
        assert q.exception() is None
        got = remote.read.parquet(out).select("seq", "value", "producer").collect()
        assert sorted(r.seq for r in got) == list(range(1, n1 + n2 + 1))
        assert {bytes(r.value) for r in got} == {f"rec-{i}".encode() for i in range(n1 + n2)}
        assert {r.producer for r in got} == {f"connect-{fmt}"}
        progress = q.lastProgress
        assert progress is not None and progress["sources"][0]["description"].startswith(
            "org.apache.spark.sql.execution.datasources.v2.python"
        )
    finally:
        if q is not None:
            q.stop()
        prod.close(flush=False, timeout=5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stream_write_to_consumer_exactly_once(remote: Any, fmt: str, tmp_path: Path) -> None:
    rows_per_batch = 300
    consumer = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)
    q = None
    try:
        q = (
            rate_values(remote, rows_per_batch)
            .writeStream.format(fmt)
            .option("endpoint", consumer.endpoint)
            .option("stream", "rate")
            .option("connectTimeout", "30s")
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="300 milliseconds")
            .start()
        )
        wait_published(q, consumer, "rate", 3, 90.0, interval=0.3)
        q.stop()
        check_published(consumer, "rate", rows_per_batch)
        assert consumer.stats["commit_errors"] == 0
    finally:
        if q is not None:
            q.stop()
        consumer.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_read_exactly_once(remote: Any, fmt: str, tmp_path: Path) -> None:
    n = 2500
    prod = Producer(producer_id=f"batch-{fmt}", linger_ms=0)
    try:
        prod.send_many([f"b-{i}".encode() for i in range(n)])
        check_batch_read(remote, fmt, prod.endpoint, tmp_path, n)
        _wait(lambda: prod.acked == n, 30, "the batch read's acknowledgement")
    finally:
        prod.close(flush=False, timeout=5)
