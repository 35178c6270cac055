"""The Spark source and sink over real CLIENT/SERVER sockets (draft libzmq).

Run by the test command's second pass on ``.venv-draft`` (a pyzmq built with the draft
API, pyspark installed beside it: scripts/build-draft-pyzmq.sh) with
``ZIO_REQUIRE_DRAFT=1``, so these fail instead of skipping there. On a stock pyzmq they
skip: CLIENT/SERVER sockets cannot be used without the draft API (FACTS.md).
"""

from __future__ import annotations

import pytest

from tests.support import check_published, rate_values, wait_published

pytestmark = pytest.mark.requires_draft


def test_source_reads_every_record_once_over_clientserver(spark, ctx, tmp_path):
    from zio_spark.source.producer import Producer

    n = 3000
    prod = Producer(ctx=ctx, producer_id="cs-1", linger_ms=0, mode="clientserver")
    try:
        prod.send_many([f"cs-{i}".encode() for i in range(n)])
        df = (
            spark.readStream.format("zio")
            .option("endpoints", prod.endpoint)
            .option("socket", "clientserver")
            .option("spoolPath", str(tmp_path / "spool"))
            .load()
        )
        q = (
            df.writeStream.format("parquet")
            .option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination(120)
        assert q.exception() is None, q.exception()
        rows = spark.read.parquet(str(tmp_path / "out")).select("value", "seq").collect()
        assert sorted(r.seq for r in rows) == list(range(1, n + 1))
        assert {bytes(r.value) for r in rows} == {f"cs-{i}".encode() for i in range(n)}
    finally:
        prod.close(flush=False, timeout=5)


def test_sink_publishes_every_row_once_over_clientserver(spark, tmp_path):
    from zio_spark.sink.consumer import Consumer

    rows = 300
    consumer = Consumer(
        "tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0, mode="clientserver"
    )
    try:
        q = (
            rate_values(spark, rows)
            .writeStream.format("zio")
            .option("endpoint", consumer.endpoint)
            .option("socket", "clientserver")
            .option("stream", "cs")
            .option("connectTimeout", "20s")
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="100 milliseconds")
            .start()
        )
        try:
            wait_published(q, consumer, "cs", 2, 90)
        finally:
            q.stop()
        check_published(consumer, "cs", rows)
    finally:
        consumer.close()
