"""``readMode=direct`` on every supported Spark line (``scripts/matrix.sh``, marker
``compat``; ``-m compat -k direct`` on the 4.3 venv).

Before 4.2 Spark calls ``latestOffset()`` without the batch start: the reader knows it
from Spark's other calls (:class:`zio_spark.source.direct.ImpliedStart`). These tests hold
it to what the 4.2+ path does with the start Spark passes: every record exactly once in
a stream and across restarts on one checkpoint, acks of what Spark committed (also the
last batch of an availableNow run, whose ``commit()`` never comes), records freed before
they were read named exactly. Where 4.0/4.1 run an availableNow query as one batch, the
tests expect that degradation (docs/running.md), found by probing, not by version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import committed_rows, to_parquet, wait_until, zio_stream
from zio_spark.errors import TransportError
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import ControlConnection, held_window
from zio_spark.spark import compat

pytestmark = pytest.mark.compat

T = 180.0  # seconds: every wait of a test is bounded by this


def _values(prefix: str, n: int, first: int = 0) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(first, first + n)]


@contextlib.contextmanager
def _producer(producer_id: str) -> Iterator[Producer]:
    prod = Producer(producer_id=producer_id, linger_ms=0)  # bound: it serves ranges
    try:
        yield prod
    finally:
        prod.close(flush=False, timeout=5)


def _direct(spark: Any, endpoints: str, tmp_path: Path, **options: str) -> Any:
    return zio_stream(spark, endpoints, tmp_path, readMode="direct", **options)


def _out(spark: Any, tmp_path: Path) -> list[tuple[str, int, bytes]]:
    rows = spark.read.parquet(str(tmp_path / "out")).select("producer", "seq", "value")
    return sorted((r.producer, r.seq, bytes(r.value)) for r in rows.collect())


def _want(producer_id: str, values: list[bytes]) -> list[tuple[str, int, bytes]]:
    return [(producer_id, i + 1, v) for i, v in enumerate(values)]


def _available_now(spark: Any, endpoints: str, tmp_path: Path, **options: str) -> int:
    """One availableNow run into ``tmp_path/out`` (checkpoint ``tmp_path/ckpt``); the
    rows it read."""
    q = to_parquet(_direct(spark, endpoints, tmp_path, **options), tmp_path, availableNow=True)
    assert q.awaitTermination(T), "the availableNow run did not end"  # hang guard only
    assert q.exception() is None, q.exception()
    return sum(p["numInputRows"] for p in q.recentProgress)


def _held_first(endpoint: str, producer_id: str) -> int:
    return held_window(endpoint, producer_id, timeout=10).first


def test_direct_stream_every_record_once_and_acks(spark: Any, tmp_path: Path) -> None:
    """A continuous query: two waves, every record once, in the producer's numbering,
    and the producer's window moves past what Spark committed (acks on the control
    flow; the reader never received a record: no taker flow)."""
    with _producer("cd-stream") as prod:
        n1, n2 = 3000, 1500
        prod.send_many(_values("s", n1))
        q = to_parquet(
            _direct(spark, prod.endpoint, tmp_path, maxRecordsPerPartition="1000"),
            tmp_path,
            processingTime="300 milliseconds",
        )
        try:
            rows = committed_rows(q, tmp_path / "out")
            wait_until(lambda: rows() >= n1, T, f"{n1} rows")
            prod.send_many(_values("s", n2, first=n1))
            wait_until(lambda: rows() >= n1 + n2, T, f"{n1 + n2} rows")
            # commit() lags a batch; the next latestOffset() acks what Spark committed.
            wait_until(lambda: prod.acked == n1 + n2, T, "every record acknowledged")
            assert q.exception() is None, q.exception()
        finally:
            q.stop()
        assert _out(spark, tmp_path) == _want("cd-stream", _values("s", n1 + n2))
        assert _held_first(prod.endpoint, "cd-stream") == n1 + n2 + 1
        assert prod.delivery().acked == n1 + n2


def test_direct_stream_restarted_on_its_checkpoint_loses_and_repeats_nothing(
    spark: Any, tmp_path: Path
) -> None:
    """Stopped mid-stream (the runner ends with a batch perhaps planned and not
    committed), records sent while it was down, restarted on the same checkpoint:
    every record exactly once, and the first run's last batch acked by the second."""
    with _producer("cd-restart") as prod:
        n1, n2, n3 = 2000, 1000, 700
        prod.send_many(_values("r", n1))

        def start() -> Any:
            return to_parquet(
                _direct(spark, prod.endpoint, tmp_path),
                tmp_path,
                processingTime="200 milliseconds",
            )

        q = start()
        try:
            wait_until(lambda: committed_rows(q, tmp_path / "out")() >= n1, T, f"{n1} rows")
            prod.send_many(_values("r", n2, first=n1))  # stop while these may be read
        finally:
            q.stop()
        prod.send_many(_values("r", n3, first=n1 + n2))
        q = start()
        try:
            rows = committed_rows(q, tmp_path / "out")
            wait_until(lambda: rows() >= n1 + n2 + n3, T, f"{n1 + n2 + n3} rows")
            wait_until(lambda: prod.acked == n1 + n2 + n3, T, "every record acknowledged")
            assert q.exception() is None, q.exception()
        finally:
            q.stop()
        assert _out(spark, tmp_path) == _want("cd-restart", _values("r", n1 + n2 + n3))


def test_direct_available_now_runs_on_one_checkpoint(spark: Any, tmp_path: Path) -> None:
    """Consecutive availableNow runs (the only trigger on serverless): each reads what
    the producers held when it started and was not read before; the last batch of a
    run is acked when the next starts (its commit() never comes)."""
    with _producer("cd-an-a") as a, _producer("cd-an-b") as b:
        endpoints = f"{a.endpoint},{b.endpoint}"
        a.send_many(_values("a", 1500))
        b.send_many(_values("b", 700))
        assert _available_now(spark, endpoints, tmp_path) == 2200
        a.send_many(_values("a", 300, first=1500))
        assert _available_now(spark, endpoints, tmp_path) == 300
        # The second run acked the first run's end at its start.
        wait_until(lambda: a.acked >= 1500 and b.acked == 700, T, "the first run's acks")
        assert _available_now(spark, endpoints, tmp_path) == 0
        wait_until(lambda: a.acked == 1800, T, "the second run's acks")
        want = _want("cd-an-a", _values("a", 1800)) + _want("cd-an-b", _values("b", 700))
        assert _out(spark, tmp_path) == sorted(want)


def test_direct_records_freed_before_they_were_read_are_named(spark: Any, tmp_path: Path) -> None:
    """Records another party acked before the query read them: a DataLossError naming
    exactly them; with failOnDataLoss=false the query skips exactly them."""
    with _producer("cd-loss") as prod:
        prod.send_many(_values("l", 1000))
        assert _available_now(spark, prod.endpoint, tmp_path) == 1000
        prod.send_many(_values("l", 500, first=1000))
        with ControlConnection(prod.endpoint, timeout=10) as control:
            control.ack(1200, prod.incarnation)  # 1001..1200 freed, never read
        q = to_parquet(_direct(spark, prod.endpoint, tmp_path), tmp_path, availableNow=True)
        with pytest.raises(Exception) as info:
            q.awaitTermination(T)
        assert "[1001, 1201)" in str(info.value) and "'cd-loss'" in str(info.value), str(info.value)
        read = _available_now(spark, prod.endpoint, tmp_path, failOnDataLoss="false")
        if not compat.HAS_TRIGGER_AVAILABLE_NOW:
            # One batch per availableNow run: it ends at the loss (its tasks skip
            # [1001, 1201)); the next run reads on.
            assert read == 0
            read = _available_now(spark, prod.endpoint, tmp_path, failOnDataLoss="false")
        assert read == 300
        seqs = [seq for _, seq, _ in _out(spark, tmp_path)]
        assert seqs == list(range(1, 1001)) + list(range(1201, 1501))


def test_direct_stream_follows_a_producer_restarted_without_its_records(
    spark: Any, tmp_path: Path
) -> None:
    """The producer restarts on its endpoint without retention: a new incarnation,
    numbering from 1. The query reads the new records once each in the new numbering,
    never mixes the two, and acks in the new one."""
    old = Producer(producer_id="cd-inc", linger_ms=0)
    made = [old]
    got: list[tuple[int, bytes]] = []
    try:
        old.send_many(_values("old", 500))
        q = (
            _direct(spark, old.endpoint, tmp_path, connectTimeout="3s")
            .writeStream.foreachBatch(
                lambda b, i: got.extend(
                    (r.seq, bytes(r.value)) for r in b.select("seq", "value").collect()
                )
            )
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            wait_until(lambda: len(got) >= 500, T, "the old records")
            endpoint = old.endpoint
            old.close(flush=False, timeout=5)

            def rebind() -> bool:  # libzmq may still be tearing the old listener down
                try:
                    made.append(Producer(producer_id="cd-inc", linger_ms=0, bind=endpoint))
                except TransportError:
                    return False
                return True

            wait_until(rebind, 30, "the producer back on its endpoint")
            new = made[-1]
            assert new.incarnation != old.incarnation
            new.send_many(_values("new", 300))
            wait_until(lambda: len(got) >= 800, T, "the new records")
            wait_until(lambda: new.acked == 300, T, "the new records acknowledged")
            assert q.exception() is None, q.exception()
        finally:
            q.stop()
    finally:
        for p in made:
            p.close(flush=False, timeout=5)
    assert got == [(i + 1, v) for i, v in enumerate(_values("old", 500))] + [
        (i + 1, v) for i, v in enumerate(_values("new", 300))
    ]


def test_direct_reads_a_plain_giver_through_the_spool_in_the_same_query(
    spark: Any, ctx: Any, tmp_path: Path
) -> None:
    """A plain (reference) giver next to a capable producer, one availableNow run on a
    new checkpoint: the giver through the receiver and the spool, the producer directly
    (range and control flows only, never a taker), every record once."""
    from tests.peers.zio_reference import ReferenceServer

    plain = [b"plain-%d" % i for i in range(300)]
    with (
        _producer("cd-mix") as prod,
        ReferenceServer(ctx, role="giver", flavor="cpp", values=plain, credit=10) as ref,
    ):
        prod.send_many(_values("m", 800))
        endpoints = f"{prod.endpoint},{ref.endpoint}"
        assert _available_now(spark, endpoints, tmp_path, connectTimeout="20s") == 1100
        rows = _out(spark, tmp_path)
        assert prod.stats["range_flows"] >= 1 and prod.stats["control_flows"] >= 1
        assert prod.stats.get("takers", 0) == 0
    assert [(s, v) for p, s, v in rows if p == "cd-mix"] == [
        (i + 1, v) for i, v in enumerate(_values("m", 800))
    ]
    assert sorted(v for p, _, v in rows if p != "cd-mix") == sorted(plain)
    assert len({p for p, _, _ in rows}) == 2
    assert (tmp_path / "spool").is_dir()  # the plain giver went through the spool
