"""The zio source end to end on local Spark, with in-process producers."""

from __future__ import annotations

from tests.support import wait_until
from zio_spark.source.producer import Producer


def test_stream_all_records_once(spark, ctx, tmp_path):
    n = 5000
    prod = Producer(ctx=ctx, producer_id="p1", linger_ms=0)
    try:
        prod.send_many([f"rec-{i}".encode() for i in range(n)])
        df = (
            spark.readStream.format("zio")
            .option("endpoints", prod.endpoint)
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
        assert q.exception() is None
        rows = (
            spark.read.parquet(str(tmp_path / "out")).select("value", "seq", "producer").collect()
        )
        assert sorted(r.seq for r in rows) == list(range(1, n + 1))
        assert {bytes(r.value) for r in rows} == {f"rec-{i}".encode() for i in range(n)}
        assert {r.producer for r in rows} == {"p1"}
        # Spark never calls commit() for the last batch of an availableNow run (FACTS.md),
        # but it asks latestOffset(start=its end) once that batch is in the commit log, and
        # the source acknowledges ``start`` then; the query may stop before that PAY leaves.
        # Either way nothing is acknowledged in part, and only after the commit log has it.
        assert (tmp_path / "ckpt" / "commits" / "0").exists()
        assert prod.acked in (0, n)
        assert prod.pending == n - prod.acked
    finally:
        prod.close(flush=False, timeout=5)


def test_commit_acknowledges_producer(spark, ctx, tmp_path):
    """A continuous query commits batch N after batch N+1 starts; acks reach the producer."""
    prod = Producer(ctx=ctx, producer_id="p2", linger_ms=0)
    got = []
    try:
        df = (
            spark.readStream.format("zio")
            .option("endpoints", prod.endpoint)
            .option("spoolPath", str(tmp_path / "spool"))
            .load()
        )
        q = (
            df.writeStream.foreachBatch(lambda b, i: got.extend(r.seq for r in b.collect()))
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            for wave in range(3):
                prod.send_many([b"x"] * 1000)
                wait_until(
                    lambda w=wave: len(got) >= 1000 * (w + 1), what=f"wave {wave}", timeout=60.0
                )
            # Commits lag one batch: the first two waves must be acknowledged.
            wait_until(lambda: prod.acked >= 2000, what="acks for committed batches", timeout=60.0)
            assert q.exception() is None
        finally:
            q.stop()
        assert sorted(got) == list(range(1, 3001))
    finally:
        prod.close(flush=False, timeout=5)


def _free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_group_discovers_producers_that_join_later(spark, ctx, tmp_path):
    """A ZRE group instead of endpoints: producers found (and added) while the query runs."""
    port = _free_udp_port()
    got = []
    prods = []
    df = (
        spark.readStream.format("zio")
        .option("group", "daq")
        .option("zreBeaconPort", str(port))
        .option("zreInterval", "100ms")
        .option("spoolPath", str(tmp_path / "spool"))
        .load()
    )
    q = (
        df.writeStream.foreachBatch(
            lambda b, i: got.extend(
                (r.producer, r.seq) for r in b.select("producer", "seq").collect()
            )
        )
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        for k in range(2):  # the second producer joins after the query started
            prod = Producer(ctx=ctx, producer_id=f"daq{k}", linger_ms=0)
            prods.append(prod)
            prod.advertise("daq", beacon_port=port, interval=0.1)
            prod.send_many([b"frame"] * 500)
            wait_until(
                lambda k=k: len(got) >= 500 * (k + 1), what=f"records of producer {k}", timeout=60.0
            )
        assert q.exception() is None
    finally:
        q.stop()
        for prod in prods:
            prod.close(flush=False, timeout=5)
    assert sorted(got) == [(f"daq{k}", s) for k in range(2) for s in range(1, 501)]
