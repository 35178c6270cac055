"""Throughput of the zio sink against Spark's Arrow writer floor (not a test).

rate-micro-batch -> ``df.writeStream.format("zio")`` -> :class:`~zio_spark.sink.consumer.Consumer`
(in this process, fsync on), next to rate-micro-batch -> a ``DataSourceStreamArrowWriter``
that discards its input, in the same run and Spark session. The two alternate
(noop, zio, noop, zio, ...) so both see the same machine (these VMs drift by 10-25 %).

Each run takes ``--batches`` micro-batches of ``--rows`` rows (values ``--size`` bytes)
after ``--warmup`` batches; rows/s is rows over the summed ``triggerExecution`` time of
the measured batches (so query start-up is not counted, the ~0.3 s per-batch fixed cost
is). Reported: median rows/s of each, and the ratio zio / noop (goal >= 0.9, issue #16).

    .venv/bin/python bench/bench_sink.py [--rows 1000000] [--batches 4] [--rounds 2] [--out DIR]

Writes ``DIR/sink.json`` (every round, medians, the ratio round by round) and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    cpu_by_role,
    fmt_spread,
    jvm_pid,
    machine,
    md_table,
    ratio_spread,
    spark_run,
    spread,
    write_json,
)

from zio_spark.sink.consumer import Consumer


@dataclass
class _Count(WriterCommitMessage):  # type: ignore[misc]
    rows: int


class _NoopWriter(DataSourceStreamArrowWriter):  # type: ignore[misc]
    def write(self, iterator: Iterator[pa.RecordBatch]) -> _Count:
        return _Count(sum(b.num_rows for b in iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass


class NoopArrowSink(DataSource):  # type: ignore[misc]
    @classmethod
    def name(cls) -> str:
        return "noop_arrow"

    def streamWriter(self, schema: object, overwrite: bool) -> _NoopWriter:
        return _NoopWriter()


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds so far per role: the JVM, the Python workers, and this process (the
    driver and, for zio, the consumer's threads)."""
    t = os.times()
    return {**cpu_by_role(jvm_pid(None)), "driver + consumer": t.user + t.system}


def run(
    spark, fmt: str, opts: dict[str, str], args: argparse.Namespace, ckpt: Path
) -> tuple[float, dict[str, float]]:
    """Rows/s over the measured batches, and CPU seconds per million rows by role over
    the whole query (start and warm-up included, for both paths alike)."""
    df = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", args.rows)
        .option("numPartitions", args.partitions)
        .load()
        .selectExpr(f"lpad(cast(value as string), {args.size}, 'x') as value")
    )
    w = (
        df.writeStream.format(fmt)
        .option("checkpointLocation", str(ckpt))
        .trigger(processingTime="0 seconds")
    )
    for k, v in opts.items():
        w = w.option(k, v)
    cpu0 = _cpu_seconds()
    q = w.start()
    need = args.warmup + args.batches
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if q.exception() is not None:
                raise RuntimeError(f"{fmt} query failed: {q.exception()}")
            done = [p for p in q.recentProgress if p["numInputRows"] > 0]
            if len(done) >= need:
                break
            time.sleep(0.2)  # a benchmark's poll interval, not a test wait
        else:
            raise RuntimeError(f"{fmt}: {need} batches did not finish in time")
    finally:
        q.stop()
    cpu1 = _cpu_seconds()
    every = sum(p["numInputRows"] for p in q.recentProgress) or 1
    cpu = {
        role: (cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / (every / 1e6)
        for role in sorted(set(cpu0) | set(cpu1))
        if role not in ("python driver", "other")
    }
    measured = done[args.warmup : need]
    rows = sum(p["numInputRows"] for p in measured)
    seconds = sum(p["durationMs"]["triggerExecution"] for p in measured) / 1000
    return rows / seconds, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per micro-batch")
    ap.add_argument("--size", type=int, default=100, help="value size in bytes")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--batches", type=int, default=4, help="measured batches per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="noop/zio pairs")
    ap.add_argument("--no-fsync", action="store_true", help="consumer skips fsync")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    results: dict[str, list[float]] = {"noop": [], "zio": []}
    cpu: dict[str, list[dict[str, float]]] = {"noop": [], "zio": []}
    with spark_run("bench-sink") as (spark, work):
        spark.dataSource.register(NoopArrowSink)
        for r in range(args.rounds):
            noop, cpu_noop = run(spark, "noop_arrow", {}, args, work / f"ckpt-noop-{r}")
            results["noop"].append(noop)
            cpu["noop"].append(cpu_noop)
            consumer = Consumer(
                "tcp://127.0.0.1:*", work / f"consumer-{r}", fsync=not args.no_fsync
            )
            try:
                zio, cpu_zio = run(
                    spark,
                    "zio",
                    {"endpoint": consumer.endpoint, "stream": "bench"},
                    args,
                    work / f"ckpt-zio-{r}",
                )
                published = len(consumer.published("bench"))
                for _, b in consumer.published("bench"):
                    consumer.ack("bench", b)
            finally:
                consumer.close()
            results["zio"].append(zio)
            cpu["zio"].append(cpu_zio)
            print(
                f"round {r}: noop {noop / 1e6:.2f}M rows/s, zio {zio / 1e6:.2f}M rows/s "
                f"({zio / noop:.2f}x), {published} batches published",
                flush=True,
            )
    noop_m = statistics.median(results["noop"])
    zio_m = statistics.median(results["zio"])
    ratio = ratio_spread(results["zio"], results["noop"])
    figures = {
        "noop": {"label": "Arrow noop writer (anchor)", "rows_per_s": spread(results["noop"])},
        "zio": {
            "label": f"zio sink -> Consumer (fsync {not args.no_fsync})",
            "rows_per_s": spread(results["zio"]),
        },
    }
    for case, runs in cpu.items():
        roles = sorted({role for r in runs for role in r})
        figures[case]["cpu_s_per_million"] = {
            role: spread([r.get(role, 0.0) for r in runs]) for role in roles
        }
    write_json(
        args.out,
        "sink.json",
        {
            "bench": "sink",
            "machine": machine(),
            "rows_per_batch": args.rows,
            "value_bytes": args.size,
            "batches": args.batches,
            "rounds": args.rounds,
            "fsync": not args.no_fsync,
            "unit": "rows/s",
            "figures": figures,
            "ratios": {"zio_vs_noop": ratio},
            "targets_met": {"zio_vs_noop >= 0.9": ratio["median"] >= 0.9},
        },
    )
    print()
    print(
        md_table(
            ["path", "rows/s (median, min-max)", "vs anchor", "CPU s per 1M rows (whole query)"],
            [
                [
                    figures[case]["label"],
                    fmt_spread(figures[case]["rows_per_s"]),
                    "anchor" if case == "noop" else fmt_spread(ratio, "x", digits=2),
                    ", ".join(
                        f"{role} {s['median']:.2f}"
                        for role, s in figures[case]["cpu_s_per_million"].items()
                    ),
                ]
                for case in ("noop", "zio")
            ],
        )
    )
    print()
    print(
        f"rows/batch {args.rows}, value {args.size} B, fsync {not args.no_fsync}, "
        f"{args.rounds} round(s) of {args.batches} measured batches: noop Arrow writer "
        f"{noop_m / 1e6:.2f}M rows/s, zio sink {zio_m / 1e6:.2f}M rows/s, "
        f"ratio {ratio['median']:.2f}x (goal >= 0.9x)"
    )


if __name__ == "__main__":
    main()
