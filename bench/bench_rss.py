"""Resident memory over a streaming run: zio source against the rate source (anchor).

- ``zio``: a Producer in this process fed at a steady ``--rate`` records/s (100 B values)
  for ``--seconds``; ``readStream.format("zio")`` -> ``foreachBatch`` (counts rows) at
  ``processingTime="0 seconds"``.
- ``rate`` (anchor): the built-in ``rate`` source at the same rate into the same sink:
  what the JVM and Spark's Python side do on their own over the same time.

RSS (``/proc/<pid>/status`` VmRSS, found by pid) is sampled every ``--interval`` s for:
the Python driver (this process: the producer lives here in the zio run), the driver JVM,
the source runner (the JVM's long-lived Python process that holds the zio receiver) and
the Python workers (the JVM's other Python processes: the executors' Python side in
local mode). Per group: start (median of the samples in the first 10 % after
``--warmup``), end (median of the last 10 %), max, and growth % = end / start - 1.
Target: flat RSS (the soak's bar is growth <= 10 %).

Writes ``DIR/rss.json`` (figures and every sample, for the RSS-over-time plot).
Run: ``.venv/bin/python bench/bench_rss.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from common import (
    RssSampler,
    SteadySender,
    fmt_spread,
    jvm_pid,
    machine,
    md_table,
    quick_args,
    spark_run,
    spread,
    write_json,
    zio_stream,
)

GROUPS = ("python driver", "driver JVM", "source runner", "python workers")


class _Count:
    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, df: Any, batch_id: int) -> None:
        self.rows += df.count()


def _run(
    spark: Any, work: Path, case: str, rate: float, seconds: float, interval: float
) -> dict[str, Any]:
    from zio_spark.source.producer import Producer

    sink = _Count()
    prod = sender = None
    if case == "zio":
        prod = Producer(producer_id=f"rss-{time.time_ns()}", linger_ms=0, max_unacked=1_000_000)
        df = zio_stream(spark, prod, work)
    else:
        df = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", str(int(rate)))
            .option("numPartitions", "2")
            .load()
        )
    q = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(work / f"ckpt-{case}-{time.time_ns()}"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    sampler = RssSampler(jvm_pid(spark), interval)
    try:

        def wait(cond: Any, what: str) -> None:
            deadline = time.monotonic() + 120
            while not cond():
                if q.exception() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{case}: no {what}: {q.exception()}")
                time.sleep(0.05)  # a benchmark's poll interval, not a test wait

        if prod is not None:
            wait(lambda: prod.connected, "connection to the producer")
            sender = SteadySender(prod, rate).start()
        # Sampling starts once rows flow (the workers exist), so start-up is not growth.
        wait(lambda: sink.rows > 0, "rows in foreachBatch")
        sampler.start()
        time.sleep(seconds)  # the measured run: RSS is sampled meanwhile
        samples = sampler.stop()
        if q.exception() is not None:
            raise RuntimeError(f"{case}: query failed: {q.exception()}")
    finally:
        sampler.stop()
        if sender is not None:
            sender.stop()
        q.stop()
        if prod is not None:
            prod.close(flush=False, timeout=0.5)
    return {"samples": samples, "rows": sink.rows}


def _growth(samples: list[dict[str, float]], warmup: float) -> dict[str, dict[str, float]]:
    body = [s for s in samples if s["t"] >= warmup] or samples
    k = max(1, len(body) // 10)
    out = {}
    for g in GROUPS:
        start = statistics.median(s[g] for s in body[:k])
        end = statistics.median(s[g] for s in body[-k:])
        if not start and not end:
            continue
        out[g] = {
            "start_mb": start / 1e6,
            "end_mb": end / 1e6,
            "max_mb": max(s[g] for s in body) / 1e6,
            "growth_pct": (end / start - 1) * 100 if start else 0.0,
        }
    return out


def main() -> None:
    a = quick_args(
        __doc__,
        {
            "seconds": (120.0, 6.0, "seconds per run"),
            "warmup": (20.0, 1.0, "seconds left out"),
            "interval": (1.0, 0.5, "seconds between samples"),
            "runs": (2, 1, "runs per case"),
        },
        lambda ap: ap.add_argument("--rate", type=float, default=50_000, help="records/s"),
    )
    seconds, warmup, interval, runs = a.seconds, a.warmup, a.interval, a.runs

    per: dict[str, list[dict[str, Any]]] = {"rate": [], "zio": []}
    with spark_run("bench-rss") as (spark, work):
        for i in range(runs):
            for case in per:
                r = _run(spark, work, case, a.rate, seconds, interval)
                r["growth"] = _growth(r["samples"], warmup)
                per[case].append(r)
                print(
                    f"run {i} {case}: {r['rows']:,} rows; "
                    + ", ".join(
                        f"{g} {v['start_mb']:.0f}->{v['end_mb']:.0f} MB ({v['growth_pct']:+.1f} %)"
                        for g, v in r["growth"].items()
                    ),
                    flush=True,
                )

    labels = {"rate": "rate source (anchor)", "zio": "zio source"}
    figures: dict[str, Any] = {}
    for case, rs in per.items():
        groups: dict[str, Any] = {}
        for g in GROUPS:
            vals = [r["growth"][g] for r in rs if g in r["growth"]]
            if vals:
                groups[g] = {m: spread([v[m] for v in vals]) for m in vals[0]}
        figures[case] = {
            "label": labels[case],
            "python_workers_n": [
                [int(s["workers_n"]) for s in r["samples"][:: max(1, len(r["samples"]) // 10)]]
                for r in rs
            ],
            "rows": [r["rows"] for r in rs],
            "groups": groups,
            "samples": [r["samples"] for r in rs],
        }
    zg = figures["zio"]["groups"]
    flat = {g: v["growth_pct"]["median"] <= 10 for g, v in zg.items()}
    write_json(
        a.out,
        "rss.json",
        {
            "bench": "rss",
            "machine": machine(),
            "rate": a.rate,
            "seconds": seconds,
            "warmup": warmup,
            "interval": interval,
            "runs": runs,
            "unit": "MB (10^6 bytes)",
            "figures": figures,
            "targets_met": {f"{g} growth <= 10 %": ok for g, ok in flat.items()},
        },
    )
    print()
    rows = []
    for f in figures.values():
        for g, v in f["groups"].items():
            rows.append(
                [
                    f["label"],
                    g,
                    fmt_spread(v["start_mb"], " MB"),
                    fmt_spread(v["end_mb"], " MB"),
                    fmt_spread(v["max_mb"], " MB"),
                    fmt_spread(v["growth_pct"], " %", digits=1),
                ]
            )
    print(md_table(["run", "process", "start", "end", "max", "growth"], rows))
    print()
    print(
        f"{a.rate:,.0f} records/s for {seconds:g} s per run, {runs} run(s) per case, RSS every "
        f"{interval:g} s, first {warmup:g} s left out. zio vs anchor: compare the growth "
        "column process by process. Target: flat (growth <= 10 %)."
    )


if __name__ == "__main__":
    main()
