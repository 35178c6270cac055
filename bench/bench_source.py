"""Source throughput against anchors measured in the same run (local[2], noop sink).

- ``rate``: Spark's built-in ``rate-micro-batch`` source, one batch of N rows (anchor).
- ``synthetic``: a Python ``DataSourceStreamReader`` yielding Arrow batches of 100 B values,
  10k rows each: the ceiling of any Python source (anchor for the target >= 0.9x).
- ``zio``: an in-process Producer pre-loaded with N records of 100 B, read with
  ``readStream.format("zio")`` under ``Trigger.AvailableNow`` (includes receiving, spooling
  and reading; the producer side encodes Arrow batches of 1000 records per DAT).

Each path gets two figures, median of runs: rows/s over the whole query (wall, start-up
included; for zio this includes receiving everything) and over the batches' execution
time only. The target ratio (>= 0.9x of synthetic) is taken on wall time.
Run: ``.venv/bin/python bench/bench_source.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

ROWS_PER_BATCH = 10_000
VALUE = b"x" * 100


class _Synthetic(DataSource):
    @classmethod
    def name(cls) -> str:
        return "zio_bench_synthetic"

    def schema(self) -> str:
        return "value binary, seq bigint"

    def streamReader(self, schema):  # type: ignore[no-untyped-def]
        return _SyntheticReader(int(self.options.get("rows", "1000000")))


class _SyntheticReader(DataSourceStreamReader):
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def initialOffset(self) -> dict:
        return {"n": 0}

    def latestOffset(self) -> dict:
        return {"n": self.rows}

    def partitions(self, start: dict, end: dict):  # type: ignore[no-untyped-def]
        s, e = start["n"], end["n"]
        step = max(1, (e - s) // 2)
        return [InputPartition((a, min(e, a + step))) for a in range(s, e, step)]

    def read(self, partition):  # type: ignore[no-untyped-def]
        a, b = partition.value
        for lo in range(a, b, ROWS_PER_BATCH):
            hi = min(b, lo + ROWS_PER_BATCH)
            yield pa.RecordBatch.from_arrays(
                [pa.array([VALUE] * (hi - lo), pa.binary()), pa.array(range(lo, hi), pa.int64())],
                names=["value", "seq"],
            )


def _run(spark, df, work: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    q = (
        df.writeStream.format("noop")
        .option("checkpointLocation", os.path.join(work, f"ckpt-{time.time_ns()}"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(q.exception())
    wall = time.perf_counter() - t0
    # Steady state: the batches' own execution time, without query start-up (the zio
    # source's wait for its producers to go quiet is part of its first batch).
    busy = sum(p.durationMs.get("triggerExecution", 0) for p in q.recentProgress) / 1000
    return wall, busy or wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    n = 500_000 if a.quick else 3_000_000
    runs = 1 if a.quick else 3
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from zio_spark.transport.producer import Producer

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(_Synthetic)
    work = tempfile.mkdtemp(prefix="zio-bench-source-")
    res: dict[str, list[float]] = {}

    def record(name: str, times: tuple[float, float]) -> None:
        res.setdefault(f"{name} (wall)", []).append(n / times[0])
        res.setdefault(f"{name} (batches)", []).append(n / times[1])

    try:
        for _ in range(runs):
            rate = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", str(n)).load()
            record("rate", _run(spark, rate, work))
            syn = spark.readStream.format("zio_bench_synthetic").option("rows", str(n)).load()
            record("synthetic", _run(spark, syn, work))
            prod = Producer(producer_id="bench", linger_ms=0, max_unacked=n + 1)
            try:
                for lo in range(0, n, 100_000):
                    prod.send_many([VALUE] * min(100_000, n - lo))
                spool = os.path.join(work, f"spool-{time.time_ns()}")
                zio = (
                    spark.readStream.format("zio")
                    .option("endpoints", prod.endpoint)
                    .option("spoolPath", spool)
                    .option("connectTimeout", "30s")
                    .load()
                )
                record("zio", _run(spark, zio, work))
            finally:
                prod.close(flush=False, timeout=5)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in res.items()
    }
    ratio = summary["zio (wall)"]["median"] / summary["synthetic (wall)"]["median"]
    summary["zio_vs_synthetic_wall"] = ratio
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "source.json"), "w") as f:
        json.dump({"rows": n, "runs": runs, **summary}, f, indent=2)
    print("| path | rows/s (median, min-max) |")
    print("|---|---|")
    for k, v in summary.items():
        if isinstance(v, dict):
            print(f"| {k} | {v['median']:,.0f} ({v['min']:,.0f}-{v['max']:,.0f}) |")
    print(f"zio / synthetic Arrow source (wall, start-up included): {ratio:.2f}x")


if __name__ == "__main__":
    main()
