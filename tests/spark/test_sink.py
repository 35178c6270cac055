"""The zio sink end to end on local Spark, into an in-process Consumer.

``rate-micro-batch`` makes deterministic micro-batches: batch ``b`` holds the values
``b*N .. (b+1)*N - 1``, identical when Spark re-runs it after a restart. So "every row
published exactly once, per batch in order" is checked value by value.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.support import wait_until
from zio_spark.sink.consumer import Consumer

ROWS = 400  # per micro-batch
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def consumer(tmp_path: Path) -> Iterator[Consumer]:
    c = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)
    yield c
    c.close()


def _rate(spark, rows: int = ROWS):
    return (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", rows)
        .option("numPartitions", 2)
        .load()
    )


def _start(df, consumer: Consumer, ckpt: Path, **options: str):
    w = (
        df.writeStream.format("zio")
        .option("endpoint", consumer.endpoint)
        .option("stream", "rate")
        .option("connectTimeout", "20s")
        .option("checkpointLocation", str(ckpt))
        .trigger(processingTime="100 milliseconds")
    )
    for k, v in options.items():
        w = w.option(k, v)
    return w.start()


def _run_until(q, consumer: Consumer, batches: int, timeout: float = 60.0) -> None:
    try:
        wait_until(
            lambda: q.exception() is not None or len(consumer.published("rate")) >= batches,
            timeout,
            f"{batches} published batches",
        )
        assert q.exception() is None, q.exception()
    finally:
        q.stop()


def _check_exactly_once_in_order(consumer: Consumer, rows: int = ROWS) -> int:
    """Published batches are 0, 1, 2, ... in commit order, each exactly its rows."""
    pubs = consumer.published("rate")
    assert [b for _, b in pubs] == list(range(len(pubs)))
    for _, b in pubs:
        values = sorted(int(r.value) for r in consumer.records("rate", b))
        assert values == list(range(b * rows, (b + 1) * rows)), f"batch {b}"
    return len(pubs)


def test_stream_every_row_published_once_per_batch_in_order(spark, consumer, tmp_path):
    df = _rate(spark).selectExpr(
        "cast(value as string) as value",
        "cast(cast(value % 7 as string) as binary) as key",
        "map('n', cast(value as string)) as headers",
    )
    q = _start(df, consumer, tmp_path / "ckpt")
    _run_until(q, consumer, 3)
    assert _check_exactly_once_in_order(consumer) >= 3
    rec = next(r for r in consumer.records("rate", 1) if r.value == b"405")
    assert rec.key == b"6" and rec.headers == {"n": "405"}
    assert consumer.stats["commit_errors"] == 0


def test_failed_commit_fails_query_and_restart_publishes_once(spark, consumer, tmp_path):
    """The consumer publishes batch 1 and then answers error: Spark fails the query
    without recording the batch; after a restart it re-runs batch 1, which the consumer
    recognises as committed."""
    failed: list[int] = []

    def fault(point: str, stream: str, batch: Any) -> None:
        if point == "after_publish" and batch == 1 and not failed:
            failed.append(batch)
            raise OSError("injected: disk went away after the publish")

    consumer.fault_hook = fault
    df = _rate(spark).selectExpr("cast(value as string) as value")
    ckpt = tmp_path / "ckpt"
    q = _start(df, consumer, ckpt)
    try:
        wait_until(lambda: q.exception() is not None, 60, "the query to fail")
        assert "injected: disk went away" in str(q.exception())
    finally:
        q.stop()
    assert failed == [1]
    assert [b for _, b in consumer.published("rate")] == [0, 1]
    q = _start(df, consumer, ckpt)
    _run_until(q, consumer, 4)
    assert _check_exactly_once_in_order(consumer) >= 4
    assert consumer.stats["duplicate_commits"] >= 1  # batch 1 came again, was not republished


def test_batch_write_publishes_one_batch(spark, consumer):
    df = spark.range(0, 1000, numPartitions=3).selectExpr(
        "cast(cast(id as string) as binary) as value"
    )
    w = df.write.format("zio").mode("append")
    w.option("endpoint", consumer.endpoint).option("stream", "b").save()
    pubs = consumer.published("b")
    assert len(pubs) == 1 and str(pubs[0][1]).startswith("write-")
    assert consumer.rows(*pubs[0]) == 1000


def test_bad_columns_fail_on_the_driver_naming_the_column(spark, consumer, tmp_path):
    df = _rate(spark)  # timestamp, value bigint
    q = _start(df, consumer, tmp_path / "ckpt")
    try:
        wait_until(lambda: q.exception() is not None, 60, "the query to fail")
    finally:
        q.stop()
    msg = str(q.exception())
    assert "timestamp timestamp" in msg and "value (binary or string, required)" in msg
    assert consumer.stats["data_flows"] == 0


def test_unreachable_consumer_fails_the_task_naming_the_endpoint(spark):
    df = spark.range(10, numPartitions=1).selectExpr("cast(id as string) as value")
    dead = "tcp://127.0.0.1:1"
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"did not answer within 1 s.*endpoint tcp://127.0.0.1:1"):
        w = df.write.format("zio").mode("append")
        w.option("endpoint", dead).option("connectTimeout", "1s").save()
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------ a plain ZIO taker


class RawTaker:
    """A ZIO taker written from specs/zio-wire.md with a bare ROUTER: no zio_spark code.

    Answers each client's BOT with ``BOT{inject}``, hands out credit, PAYs one credit
    back per DAT, echoes EOT. Keeps (value, flow object) per DAT.
    """

    def __init__(self, ctx: zmq.Context[Any], credit: int = 8) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.credit = credit
        self.records: list[tuple[bytes, dict[str, Any]]] = []
        self.ended = 0
        self._seq: dict[bytes, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, ident: bytes, obj: dict[str, Any]) -> None:
        seq = self._seq.get(ident, 0)
        self._seq[ident] = seq + 1
        prefix = b"ZIO0FLOW" + json.dumps(obj).encode()
        self.sock.send_multipart([ident, b"", prefix, struct.pack("<QQQ", 0, 0, seq)])

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, delim, prefix, _coord, *payload = self.sock.recv_multipart()
            assert delim == b"" and prefix[:3] == b"ZIO"
            obj = json.loads(prefix[8:])
            kind = obj["flow"]
            if kind == "BOT":
                credit = min(obj["credit"], self.credit)
                self._send(ident, {"flow": "BOT", "direction": "inject", "credit": credit})
                self._send(ident, {"flow": "PAY", "credit": credit})
            elif kind == "DAT":
                self.records.append((payload[0], obj))
                self._send(ident, {"flow": "PAY", "credit": 1})
            elif kind == "EOT":
                self._send(ident, {"flow": "EOT"})
                self.ended += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def test_plain_zio_taker_receives_record_format(spark, ctx):
    taker = RawTaker(ctx)
    try:
        df = spark.range(0, 300, numPartitions=2).selectExpr(
            "cast(id as string) as value",
            "cast(cast(id as string) as binary) as key",
            "map('h', 'x') as headers",
        )
        (
            df.write.format("zio")
            .mode("append")
            .option("endpoint", taker.endpoint)
            .option("format", "record")
            .option("connectTimeout", "20s")
            .save()
        )
        assert taker.ended == 2
        assert sorted(int(v) for v, _ in taker.records) == list(range(300))
        _, obj = next(r for r in taker.records if r[0] == b"42")
        assert obj["key"] == "NDI=" and obj["headers"] == {"h": "x"}  # base64("42")
    finally:
        taker.close()


# ----------------------------------------------------------------- task retries

_RETRY_SCRIPT = textwrap.dedent(
    """
    import glob, os, sys, time
    from pyspark import TaskContext
    from pyspark.sql import SparkSession
    from pyspark.sql.functions import udf

    endpoint, marker, ckpt, staging = sys.argv[1:5]
    spark = (
        SparkSession.builder.master("local[2,3]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "20")
        .config("spark.sql.execution.python.udf.maxRecordsPerBatch", "10")
        .getOrCreate()
    )
    seen = {}

    @udf("string")
    def flaky(v):
        # Partition 0 of batch 1 fails once, near its end: earlier rows went out already.
        tc = TaskContext.get()
        if tc.getLocalProperty("streaming.sql.batchId") == "1" and tc.partitionId() == 0:
            n = seen[tc.taskAttemptId()] = seen.get(tc.taskAttemptId(), 0) + 1
            if n == 190 and not os.path.exists(marker):
                # Fail only once this attempt's flow is staging data at the consumer.
                deadline = time.monotonic() + 30
                while not glob.glob(staging) and time.monotonic() < deadline:
                    time.sleep(0.02)
                open(marker, "w").close()
                raise RuntimeError("injected task failure")
        # Padded (int() ignores the spaces) so that rows before the failure fill Spark's
        # 64 KiB buffer towards the writer and reach the consumer.
        return str(v).rjust(2000)

    df = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 400)
        .option("numPartitions", 2).load().select(flaky("value").alias("value"))
    )
    q = (
        df.writeStream.format("zio").option("endpoint", endpoint).option("stream", "rate")
        .option("checkpointLocation", ckpt).trigger(processingTime="100 milliseconds").start()
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and q.exception() is None:
        p = q.lastProgress
        if p is not None and p["batchId"] >= 3:
            break
        time.sleep(0.1)
    exc = q.exception()
    q.stop()
    spark.stop()
    print("QUERY_EXCEPTION", exc)
    sys.exit(1 if exc is not None else 0)
    """
)


def test_task_retry_publishes_the_successful_attempt_only(consumer, tmp_path):
    """Needs spark.task.maxFailures > 1, which only a new session (local[2,3]) can set:
    Spark allows one session per JVM, so this runs in a child process."""
    script = tmp_path / "retry.py"
    script.write_text(_RETRY_SCRIPT)
    marker = tmp_path / "failed-once"
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            consumer.endpoint,
            str(marker),
            str(tmp_path / "ckpt"),
            str(consumer.root / "staging" / "rate" / f"{1:020d}" / "0-0.part"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert marker.exists()  # the failure did happen
    assert _check_exactly_once_in_order(consumer) >= 3
    # Batch 1 had a third flow: the failed attempt, discarded.
    assert consumer.stats["data_flows"] >= 2 * len(consumer.published("rate")) + 1
