"""The contract every supported Spark line keeps (issue #24): a stream, availableNow with
the producer in another process, a batch read, the sink (stream and batch), one Spark
Connect round trip, and the documented degradations of the older API.

``scripts/matrix.sh`` runs this module on the newest 4.0.x, 4.1.x and 4.2.x (marker
``compat``; the 4.3 suite covers the same ground in tests/spark). What differs between
the lines is found by the source's own probes (:mod:`zio_spark.spark.compat`); the only
use of the version number here is to say which row of the verified table to expect.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyspark
import pytest

from tests.support import (
    check_batch_read,
    check_published,
    committed_rows,
    free_endpoint,
    rate_values,
    start_producer_child,
    stop_producer_child,
    to_parquet,
    wait_published,
    wait_until,
    zio_stream,
)
from zio_spark.sink.consumer import Consumer
from zio_spark.source.producer import Producer
from zio_spark.spark import compat

pytestmark = pytest.mark.compat

MINOR = tuple(int(x) for x in pyspark.__version__.split(".")[:2])


def test_the_probes_find_the_verified_table_row() -> None:
    """FACTS.md "Spark versions and platforms": what each line has, found by probing."""
    old = MINOR < (4, 2)
    assert compat.capabilities() == {
        "HAS_DATASOURCE_API": True,
        "HAS_ADMISSION_CONTROL": not old,
        "HAS_TRIGGER_AVAILABLE_NOW": not old,
        "HAS_REPORT_LATEST_OFFSET": not old,
        "HAS_STREAM_ARROW_WRITER": MINOR >= (4, 1),
    }
    from pyspark.sql.datasource import DataSourceArrowWriter

    from zio_spark.spark.sink import ZioStreamWriter

    # Spark's write path hands Arrow batches to a DataSourceArrowWriter (every line) or a
    # DataSourceStreamArrowWriter (4.1+): 4.0's stream writer is the former.
    arrow = compat.find("DataSourceStreamArrowWriter") or DataSourceArrowWriter
    assert issubclass(ZioStreamWriter, arrow)


def test_spark_workers_import_the_same_zio_spark(spark: Any) -> None:
    """scripts/matrix.sh runs this against the installed wheel: the workers too."""
    import zio_spark

    where = (
        spark.sparkContext.parallelize([0], 1)
        .map(lambda _: __import__("zio_spark").__file__)
        .collect()[0]
    )
    assert where == zio_spark.__file__


def _seqs(spark: Any, out: Path) -> list[int]:
    return sorted(r.seq for r in spark.read.parquet(str(out)).select("seq").collect())


@contextlib.contextmanager
def _into_parquet(
    session: Any, tmp_path: Path, producer_id: str, prefix: str, n: int, every: str
) -> Iterator[tuple[Producer, Any, Callable[[], int]]]:
    """A producer holding ``n`` records ``<prefix>-0`` ..., streamed by ``session`` into
    parquet in ``tmp_path / "out"`` every ``every``: ``(producer, query, committed rows)``;
    both stopped on leaving."""
    prod = Producer(producer_id=producer_id, linger_ms=0)
    q = None
    try:
        prod.send_many([f"{prefix}-{i}".encode() for i in range(n)])
        q = to_parquet(zio_stream(session, prod.endpoint, tmp_path), tmp_path, processingTime=every)
        yield prod, q, committed_rows(q, tmp_path / "out")
    finally:
        if q is not None:
            q.stop()
        prod.close(flush=False, timeout=5)


def test_stream_every_record_once(spark: Any, tmp_path: Path) -> None:
    n1, n2 = 3000, 2000
    stream = _into_parquet(spark, tmp_path, "contract-stream", "s", n1, "300 milliseconds")
    with stream as (prod, q, rows):
        wait_until(lambda: rows() >= n1, 120, f"{n1} rows")
        prod.send_many([f"s-{i}".encode() for i in range(n1, n1 + n2)])
        wait_until(lambda: rows() >= n1 + n2, 120, f"{n1 + n2} rows")
        wait_until(lambda: prod.acked == n1 + n2, 120, "every record acknowledged")
        q.stop()
        assert _seqs(spark, tmp_path / "out") == list(range(1, n1 + n2 + 1))


@pytest.fixture
def remote_producer() -> Iterator[Any]:
    """``start(endpoint, id, count)``: a producer in another process, holding ``count``
    records once it returns; stopped (stdin closed, then by pid) at teardown."""
    children: list[subprocess.Popen[str]] = []

    def start(endpoint: str, producer_id: str, count: int) -> subprocess.Popen[str]:
        child = start_producer_child(endpoint, producer_id, count)
        children.append(child)
        return child

    yield start
    for child in children:
        stop_producer_child(child)


def test_available_now_takes_what_a_remote_producer_held(
    spark: Any, tmp_path: Path, remote_producer: Any
) -> None:
    """On 4.0/4.1 Spark runs this as one batch; it must still hold every record the
    producer held when the run started (the same guarantee as 4.2+'s native run)."""
    count = 5000
    endpoint = free_endpoint()
    remote_producer(endpoint, "contract-an", count)
    out = tmp_path / "out"
    q = to_parquet(zio_stream(spark, endpoint, tmp_path), tmp_path, availableNow=True)
    assert q.awaitTermination(300), "the availableNow run did not end"  # hang guard only
    assert q.exception() is None, q.exception()
    assert _seqs(spark, out) == list(range(1, count + 1))


def test_batch_read_every_record_once(spark: Any, tmp_path: Path) -> None:
    n = 2500
    prod = Producer(producer_id="contract-batch", linger_ms=0)
    try:
        prod.send_many([f"b-{i}".encode() for i in range(n)])
        check_batch_read(spark, "zio", prod.endpoint, tmp_path, n)
        wait_until(lambda: prod.acked == n, 60, "the batch read's acknowledgement")
    finally:
        prod.close(flush=False, timeout=5)


@pytest.fixture
def consumer(tmp_path: Path) -> Iterator[Consumer]:
    c = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)
    yield c
    c.close()


def test_sink_stream_every_row_once_per_batch(
    spark: Any, consumer: Consumer, tmp_path: Path
) -> None:
    rows = 300
    q = (
        rate_values(spark, rows)
        .writeStream.format("zio")
        .option("endpoint", consumer.endpoint)
        .option("stream", "rate")
        .option("format", "arrow")  # the Arrow path, on 4.0 through DataSourceArrowWriter
        .option("connectTimeout", "30s")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        wait_published(q, consumer, "rate", 3, 120)
    finally:
        q.stop()
    check_published(consumer, "rate", rows)
    assert consumer.stats["commit_errors"] == 0


def test_sink_batch_write_publishes_one_batch(spark: Any, consumer: Consumer) -> None:
    n = 1000
    (
        spark.range(n)
        .selectExpr("cast(id as string) as value")
        .repartition(2)
        .write.format("zio")
        .option("endpoint", consumer.endpoint)
        .option("stream", "batch")
        .option("format", "arrow")
        .option("connectTimeout", "30s")
        .mode("append")
        .save()
    )
    pubs = consumer.published("batch")
    assert len(pubs) == 1, pubs
    values = sorted(int(r.value) for r in consumer.records("batch", pubs[0][1]))
    assert values == list(range(n))


def test_max_records_per_trigger_follows_admission_control(spark: Any, tmp_path: Path) -> None:
    """Spark < 4.2 never passes a read limit: the option is refused at load(), naming it
    and the Spark that has it; where Spark has admission control it bounds each batch."""
    prod = Producer(producer_id="contract-limit", linger_ms=0)
    q = None
    try:
        if not compat.HAS_ADMISSION_CONTROL:
            with pytest.raises(Exception, match="maxRecordsPerTrigger") as e:
                zio_stream(spark, prod.endpoint, tmp_path, maxRecordsPerTrigger="100")  # load()
            assert "Spark 4.2" in str(e.value) and "Drop the option" in str(e.value)
            return
        prod.send_many([f"l-{i}".encode() for i in range(500)])
        q = to_parquet(
            zio_stream(spark, prod.endpoint, tmp_path, maxRecordsPerTrigger="100"),
            tmp_path,
            processingTime="100 milliseconds",
        )

        def sizes() -> list[int]:
            return [p["numInputRows"] for p in q.recentProgress]

        # The progress of a batch comes after its commit: wait on progress, not output.
        wait_until(lambda: q.exception() is not None or sum(sizes()) >= 500, 120, "500 rows")
        assert q.exception() is None, q.exception()
        sizes = sizes()
        assert max(sizes) <= 100 and sum(sizes) >= 500, sizes
    finally:
        if q is not None:
            q.stop()
        prod.close(flush=False, timeout=5)


def _connect_server(work: Path) -> tuple[Any, str]:
    """This pyspark's Spark Connect server on 127.0.0.1, a free port, in the foreground.

    What ``sbin/start-connect-server.sh --wait`` runs; the pip package of 4.0 has the
    server's jar but not that script, so ``spark-submit`` is called as the script would.
    """
    from tests.cluster.spark_procs import SPARK_HOME, Proc, spark_env, wait_tcp
    from tests.support import free_port

    port = free_port()
    argv = ["bash", str(SPARK_HOME / "bin" / "spark-submit")]
    argv += ["--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    argv += ["--name", "Spark Connect server", "--master", "local[2]"]
    for conf in (
        "spark.connect.grpc.binding.address=127.0.0.1",
        f"spark.connect.grpc.binding.port={port}",
        "spark.ui.enabled=false",
        "spark.driver.host=127.0.0.1",
        "spark.driver.bindAddress=127.0.0.1",
        "spark.sql.shuffle.partitions=2",
        f"spark.local.dir={work / 'local'}",
    ):
        argv += ["--conf", conf]
    env = spark_env({"SPARK_CONNECT_MODE": "0", "SPARK_LOG_DIR": str(work / "logs")})
    proc = Proc(argv, work / "connect-server.log", env, cwd=work)
    try:
        wait_tcp(port, proc, 180.0, "the Spark Connect server")
    except BaseException:
        proc.stop()
        raise
    return proc, f"sc://127.0.0.1:{port}"


@pytest.fixture
def remote(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Iterator[Any]:
    """A Spark Connect session on a server of this pyspark (127.0.0.1, a free port)."""
    from pyspark.sql import SparkSession

    server, url = _connect_server(tmp_path_factory.mktemp("connect"))
    had_mode = "SPARK_CONNECT_MODE_ENABLED" in os.environ
    session = None
    try:
        session = SparkSession.builder.remote(url).create()
        yield session
    finally:
        if session is not None:
            with contextlib.suppress(Exception):
                session.stop()
        if not had_mode:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        server.stop()


def test_connect_stream_round_trip(remote: Any, tmp_path: Path) -> None:
    """A stream read through Spark Connect: the server's lookup finds format("zio")."""
    n = 2000
    stream = _into_parquet(remote, tmp_path, "contract-connect", "c", n, "500 milliseconds")
    with stream as (_, q, rows):
        wait_until(lambda: rows() >= n, 120, f"{n} rows", interval=0.3)
        q.stop()
        got = remote.read.parquet(str(tmp_path / "out")).select("seq").collect()
        assert sorted(r.seq for r in got) == list(range(1, n + 1))
