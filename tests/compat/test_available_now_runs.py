"""Consecutive availableNow runs on one checkpoint (the only trigger on serverless).

On Spark 4.0/4.1 an availableNow run is one batch and ``commit(end)`` never comes for it:
the next run's first ``latestOffset()`` (no ``start`` on those Sparks) must still
acknowledge it, or a run that filled ``maxBacklog`` leaves that backlog full for ever:
no credit, no records, no batch, and every later run ends with 0 rows
(:mod:`zio_spark.spark.legacy`). ``scripts/matrix.sh`` runs this on 4.0, 4.1 and 4.2
(marker ``compat``); ``-m compat`` on the 4.3 venv runs it there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_until
from zio_spark.source.producer import Producer
from zio_spark.spark import compat

pytestmark = pytest.mark.compat


def _run(spark: Any, endpoint: str, tmp_path: Path) -> int:
    """One availableNow run into ``tmp_path/out``; the rows it wrote."""
    q = (
        spark.readStream.format("zio")
        .option("endpoints", endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("spoolAccess", "local")
        .option("maxBacklog", "200")
        .load()
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(300), "the availableNow run did not end"  # hang guard only
    assert q.exception() is None, q.exception()
    return sum(p["numInputRows"] for p in q.recentProgress)


def test_a_run_that_filled_max_backlog_does_not_stall_the_next(spark: Any, tmp_path: Path) -> None:
    n = 300
    prod = Producer(producer_id="contract-runs", linger_ms=0)
    try:
        prod.send_many([f"a-{i}".encode() for i in range(n)])
        first = _run(spark, prod.endpoint, tmp_path)
        assert first > 0
        if not compat.HAS_TRIGGER_AVAILABLE_NOW:
            # One batch, held to maxBacklog: the rest is the next run's.
            assert first < n, f"run 1 took {first} of {n}: maxBacklog 200 did not hold it"
        second = _run(spark, prod.endpoint, tmp_path)
        assert first + second == n, f"run 1 took {first}, run 2 {second}, of {n}"
        seqs = sorted(r.seq for r in spark.read.parquet(str(tmp_path / "out")).collect())
        assert seqs == list(range(1, n + 1))
        # The last batch of run 2 is acknowledged when run 3 starts (its commit never
        # comes); run 3 has nothing to read.
        assert _run(spark, prod.endpoint, tmp_path) == 0
        wait_until(lambda: prod.acked == n, 60, f"all {n} records acknowledged")
    finally:
        prod.close(flush=False, timeout=5)
