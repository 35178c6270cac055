"""Where a direct read's CPU goes inside Spark's Python workers (not a test; issue #26,
docs/direct-read.md "Measured").

A producer process holds ``--records`` records of 100 B (a bound
:class:`~zio_spark.source.producer.Producer`, its window never acked, so the same range
is read again each round). One local[2] Spark session reads, as a *batch* query into
Spark's ``noop`` writer, each case in turn, ``--partitions`` tasks:

- ``synthetic`` (anchor): ``bench_steady``'s 8-column Python Arrow source, the same
  rows made in the worker (10k-row batches);
- ``direct``: the zio source's task read (:class:`~zio_spark.spark.source.DirectPartition`
  through ``_read_any``, as a ``readMode=direct`` stream's tasks run it) of the
  producer's range, over loopback TCP.

A batch query leaves out what a stream adds (the trigger loop, the runner, commits), so
the figures are the task's own: per million rows, the Python workers' user and kernel
CPU (``/proc``, every pyspark process under the JVM) and the JVM's CPU, medians over
``--rounds`` rounds after a warm-up round; ratios to the synthetic source's in the same
rounds. ``--heap-default`` runs the workers with ``ZIO_SPARK_HEAP=default`` (glibc's
allocator as it comes, see :mod:`zio_spark.heap`) to show what the tuning does.

    .venv/bin/python bench/bench_direct_worker.py [--records 2000000] [--rounds 3]
        [--partitions 2] [--heap-default] [--out DIR]

Writes ``DIR/direct_worker.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    cmdline,
    descendants,
    jvm_pid,
    ratio_spread,
    spark_session,
    spread,
    write_json,
)
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

VALUE = b"x" * 100
CASES = ("synthetic", "direct")


class _Source(DataSource):  # type: ignore[misc]
    @classmethod
    def name(cls) -> str:
        return "zio_bench_direct_worker"

    def schema(self) -> str:
        from zio_spark.spark.source import DEFAULT_SCHEMA

        return DEFAULT_SCHEMA

    def reader(self, schema: Any) -> _Reader:
        return _Reader(dict(self.options))


class _Reader(DataSourceReader):  # type: ignore[misc]
    def __init__(self, opts: dict[str, str]) -> None:
        self.opts = opts

    def partitions(self) -> list[InputPartition]:
        n, parts = int(self.opts["n"]), int(self.opts["parts"])
        step = n // parts
        if self.opts["case"] == "synthetic":
            return [InputPartition((i * step, (i + 1) * step)) for i in range(parts)]
        from zio_spark.codec.schema import SPARK_SCHEMA
        from zio_spark.spark.source import DirectPartition

        start = int(self.opts["end"]) - n
        return [
            DirectPartition(
                ranges=(
                    (
                        self.opts["endpoint"],
                        self.opts["producer"],
                        self.opts["incarnation"],
                        start + i * step,
                        start + (i + 1) * step,
                    ),
                ),
                fail_on_data_loss=True,
                columns=tuple(SPARK_SCHEMA.names),
                timestamp_us=time.time_ns() // 1000,
                timeout=60.0,
                mode=None,
                curve=None,
                stream="zio",
            )
            for i in range(parts)
        ]

    def read(self, partition: InputPartition) -> Any:
        from zio_spark import heap
        from zio_spark.spark.source import DirectPartition, _read_any

        if isinstance(partition, DirectPartition):
            heap.freeze_gc()  # as the source's read() does
            return _read_any(partition)
        import bench_steady

        return bench_steady._SteadyReader(0).read(partition)


def _producer_child(records: int) -> None:
    """Holds ``records`` records (nobody acks) and prints its endpoint; ends on stdin EOF."""
    from zio_spark.source.producer import Producer

    prod = Producer("tcp://127.0.0.1:*", producer_id="bench-worker", linger_ms=0)
    chunk = [VALUE] * 10_000
    for _ in range(records // len(chunk)):
        prod.send_many(chunk, timeout=60)
    print(prod.endpoint, flush=True)
    sys.stdin.read()
    prod.close(flush=False, timeout=0.5)


def _cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` and its reaped children, 0 once gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tck = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[13])) / tck, (int(f[12]) + int(f[14])) / tck


def _workers(jvm: int) -> tuple[float, float]:
    user = system = 0.0
    for pid in descendants(jvm):
        if "pyspark" in cmdline(pid):
            u, s = _cpu(pid)
            user, system = user + u, system + s
    return user, system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--heap-default", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--producer-child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.producer_child:
        _producer_child(a.producer_child)
        return
    if not 10_000 <= a.records <= 2_000_000 or not 1 <= a.rounds <= 10:
        ap.error("--records from 10,000 to 2,000,000 (the producer's window), --rounds 1-10")
    if a.heap_default:
        os.environ["ZIO_SPARK_HEAP"] = "default"  # the workers inherit it through the JVM
    n = a.records - a.records % a.partitions
    child = subprocess.Popen(
        [sys.executable, __file__, "--producer-child", str(a.records)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        if not endpoint:
            raise RuntimeError("the producer process did not start")
        from zio_spark.source.range_client import held_window

        window = held_window(endpoint, "bench-worker", timeout=30)
        # The workers import bench_steady (the synthetic rows) from this folder.
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [here, os.environ.get("PYTHONPATH", "")] if p
        )
        spark = spark_session("zio-bench-direct-worker")
        spark.dataSource.register(_Source)
        jvm = jvm_pid(spark)
        assert jvm is not None
        res: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
        try:
            for r in range(a.rounds + 1):
                for case in CASES:
                    df = (
                        spark.read.format("zio_bench_direct_worker")
                        .option("case", case)
                        .option("n", str(n))
                        .option("parts", str(a.partitions))
                        .option("endpoint", endpoint)
                        .option("producer", "bench-worker")
                        .option("incarnation", window.incarnation)
                        .option("end", str(window.end))
                        .load()
                    )
                    w0, j0, t0 = _workers(jvm), sum(_cpu(jvm)), time.perf_counter()
                    df.write.format("noop").mode("overwrite").save()
                    w1, j1, t1 = _workers(jvm), sum(_cpu(jvm)), time.perf_counter()
                    if r == 0:
                        continue  # warm-up: workers forked, modules imported, JIT
                    per_m = 1e6 / n
                    res[case].append(
                        {
                            "workers_user": (w1[0] - w0[0]) * per_m,
                            "workers_system": (w1[1] - w0[1]) * per_m,
                            "workers": (w1[0] + w1[1] - w0[0] - w0[1]) * per_m,
                            "jvm": (j1 - j0) * per_m,
                            "wall": (t1 - t0) * per_m,
                            "load_1m": os.getloadavg()[0],
                        }
                    )
                    print(
                        f"round {r} {case}: "
                        + ", ".join(f"{k} {v:.3f}" for k, v in res[case][-1].items()),
                        flush=True,
                    )
        finally:
            spark.stop()
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)
    keys = ("workers_user", "workers_system", "workers", "jvm", "wall")
    figures = {c: {k: spread([x[k] for x in res[c]]) for k in keys} for c in CASES}
    ratios = {
        k: ratio_spread([x[k] for x in res["direct"]], [x[k] for x in res["synthetic"]])
        for k in ("workers", "jvm", "wall")
    }
    ratios["spark_side"] = ratio_spread(
        [x["workers"] + x["jvm"] for x in res["direct"]],
        [x["workers"] + x["jvm"] for x in res["synthetic"]],
    )
    out = write_json(
        a.out,
        "direct_worker.json",
        {
            "records": n,
            "rounds": a.rounds,
            "partitions": a.partitions,
            "heap": "default" if a.heap_default else "tuned",
            "figures": figures,
            "ratios": ratios,
            "load_1m": [x["load_1m"] for c in CASES for x in res[c]],
        },
    )
    print(
        "\n| case | workers user | workers kernel | workers | JVM | wall (s per 1M rows) |\n"
        "|---|---|---|---|---|---|"
    )
    for c in CASES:
        f = figures[c]
        print(f"| {c} | " + " | ".join(f"{f[k]['median']:.3f}" for k in keys) + " |")
    print(
        "\ndirect / synthetic (medians of per-round ratios): "
        + ", ".join(f"{k} {v['median']:.2f}x" for k, v in ratios.items())
        + f"; heap {'default' if a.heap_default else 'tuned'}; wrote {out}"
    )


if __name__ == "__main__":
    main()
