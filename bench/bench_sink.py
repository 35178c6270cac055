"""Throughput of the zio sink against Spark's Arrow writer floor (not a test).

rate-micro-batch -> ``df.writeStream.format("zio")`` -> :class:`~zio_spark.sink.consumer.Consumer`
(in this process, fsync on), next to rate-micro-batch -> a ``DataSourceStreamArrowWriter``
that discards its input, in the same run and Spark session. The two alternate
(noop, zio, noop, zio, ...) so both see the same machine (these VMs drift by 10-25 %).

Each run takes ``--batches`` micro-batches of ``--rows`` rows (values ``--size`` bytes)
after ``--warmup`` batches; rows/s is rows over the summed ``triggerExecution`` time of
the measured batches (so query start-up is not counted, the ~0.3 s per-batch fixed cost
is). Reported: median rows/s of each, and the ratio zio / noop (goal >= 0.9, issue #16);
CPU seconds per million rows by role over the measured batches; and the CPU this host
takes just to write the bytes the consumer staged per million rows into a new file
(fsync as the consumer). The machine's busy CPU per million rows of each path is
reported too: on a CPU-bound machine their ratio predicts the rows/s ratio, which tells
a CPU gap from waiting.

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
    driver and, for zio, the consumer's threads), with this process's kernel part."""
    t = os.times()
    return {
        **cpu_by_role(jvm_pid(None)),
        "driver + consumer": t.user + t.system,
        "driver + consumer, kernel": t.system,
    }


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (``/proc/stat``, idle and
    iowait excluded)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def run(
    spark, fmt: str, opts: dict[str, str], args: argparse.Namespace, ckpt: Path
) -> tuple[float, dict[str, float]]:
    """Rows/s over the measured batches, and CPU seconds per million rows by role over
    the same batches (from the end of the warm-up to the end of the last measured batch,
    seen by a 50 ms poll; ``machine`` is the whole machine's busy time)."""
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
    q = w.start()
    need = args.warmup + args.batches
    deadline = time.monotonic() + 600
    cpu0: dict[str, float] | None = None
    try:
        while time.monotonic() < deadline:
            if q.exception() is not None:
                raise RuntimeError(f"{fmt} query failed: {q.exception()}")
            done = [p for p in q.recentProgress if p["numInputRows"] > 0]
            if cpu0 is None and len(done) >= args.warmup:
                cpu0 = {**_cpu_seconds(), "machine": _busy_seconds()}
                seen0 = len(done)
            if len(done) >= need:
                cpu1 = {**_cpu_seconds(), "machine": _busy_seconds()}
                break
            time.sleep(0.05)  # a benchmark's poll interval, not a test wait
        else:
            raise RuntimeError(f"{fmt}: {need} batches did not finish in time")
    finally:
        q.stop()
    assert cpu0 is not None
    between = sum(p["numInputRows"] for p in done[seen0:]) or 1
    cpu = {
        role: (cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / (between / 1e6)
        for role in sorted(set(cpu0) | set(cpu1))
        if role not in ("python driver", "other")
    }
    measured = done[args.warmup : need]
    rows = sum(p["numInputRows"] for p in measured)
    seconds = sum(p["durationMs"]["triggerExecution"] for p in measured) / 1000
    return rows / seconds, cpu


def staged_bytes(root: Path) -> int:
    """Bytes of the published partition files under a consumer's folder."""
    return sum(f.stat().st_size for f in (root / "published").rglob("*.arrow"))


def write_cost(folder: Path, nbytes: int, fsync: bool) -> float:
    """CPU seconds this process spends writing ``nbytes`` into a new file (1 MiB
    writes, then fsync if ``fsync``): the least a consumer pays to stage those bytes on
    this host. The file is deleted after."""
    chunk = os.urandom(1 << 20)
    path = folder / "write-cost.bin"
    t0 = os.times()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    t1 = os.times()
    path.unlink()
    return (t1.user - t0.user) + (t1.system - t0.system)


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
    write_s: list[float] = []
    bytes_per_million: list[float] = []
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
                pubs = consumer.published("bench")
                published = len(pubs)
                rows_out = sum(consumer.rows("bench", b) for _, b in pubs)
                per_million = staged_bytes(consumer.root) / (rows_out / 1e6)
                write_s.append(write_cost(work, int(per_million), not args.no_fsync))
                bytes_per_million.append(per_million)
                for _, b in pubs:
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
    # On a CPU-bound machine the ratio follows the CPU each path needs per row: if
    # C_noop / C_zio matches the measured ratio, the gap is CPU, not waiting.
    noop_cpu = statistics.median(r["machine"] for r in cpu["noop"])
    zio_cpu = statistics.median(r["machine"] for r in cpu["zio"])
    write_m = statistics.median(write_s)
    extra = {
        role: statistics.median(r.get(role, 0.0) for r in cpu["zio"])
        - statistics.median(r.get(role, 0.0) for r in cpu["noop"])
        for role in ("driver + consumer", "python workers", "driver JVM")
    }
    breakdown = {
        "staged_bytes_per_million_rows": statistics.median(bytes_per_million),
        "write_cpu_s_per_million_rows": spread(write_s),
        "noop_machine_cpu_s_per_million_rows": noop_cpu,
        "zio_machine_cpu_s_per_million_rows": zio_cpu,
        "cpu_ratio_noop_over_zio": noop_cpu / zio_cpu,
        "extra_cpu_s_per_million_rows_by_role": extra,
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
            "cpu": breakdown,
            "ratios": {"zio_vs_noop": ratio},
            "targets_met": {"zio_vs_noop >= 0.9": ratio["median"] >= 0.9},
        },
    )
    print()
    print(
        md_table(
            [
                "path",
                "rows/s (median, min-max)",
                "vs anchor",
                "CPU s per 1M rows (measured batches)",
            ],
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
    print(
        f"machine CPU per 1M rows: noop {noop_cpu:.2f} s, zio {zio_cpu:.2f} s "
        f"(noop/zio {noop_cpu / zio_cpu:.2f}, against the measured {ratio['median']:.2f}x); "
        "zio's extra by role: "
        + ", ".join(f"{role} {v:+.2f}" for role, v in extra.items())
        + f"; writing the {breakdown['staged_bytes_per_million_rows'] / 1e6:.0f} MB staged per 1M "
        f"rows into a new file (fsync {not args.no_fsync}) alone: {write_m:.2f} CPU-s"
    )


if __name__ == "__main__":
    main()
