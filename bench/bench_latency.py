"""Latency producer -> foreachBatch at trigger 0, against the built-in rate source.

- ``zio``: a Producer in this process is fed at a steady ``--rate`` records/s for
  ``--seconds``; each value carries its send time (``time.time()``). The query
  ``readStream.format("zio")`` -> ``foreachBatch`` runs with ``processingTime="0 seconds"``.
  In foreachBatch (driver side, this process, same clock) the batch is collected and each
  row's latency is ``arrival - send time``, arrival being when the rows are in the
  user's hands. Also split: producer -> receiver (the ``timestamp`` column, stamped when
  the receiver took the record) and receiver -> foreachBatch.
- ``rate`` (anchor): Spark's ``rate`` source at the same rate and trigger; its
  ``timestamp`` column is when the row became available, so the same arrival - stamp is
  Spark's own micro-batch floor for this trigger on this machine.

The measured window opens when the first rows have reached foreachBatch (query start-up
is not steady state) and the records sent in its first ``--warmup`` seconds are left out.
Per run: p50, p99, max; reported as median (min-max) over runs. Targets: p50 <= 0.5 s, p99 <= 1.5 s.

Writes ``DIR/latency.json`` (figures and, per case, the CDF as 1001 quantiles of all runs)
and ``DIR/latency-samples.npz`` (every sample, seconds, float32, one array per case and
run). Run: ``.venv/bin/python bench/bench_latency.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
from common import (
    SteadySender,
    fmt_spread,
    machine,
    md_table,
    quick_args,
    ratio_spread,
    spark_run,
    spread,
    write_json,
    zio_stream,
)

TARGETS = {"p50": 0.5, "p99": 1.5}


class _Collector:
    """foreachBatch target: per-row latencies, kept in arrays (driver side)."""

    def __init__(self, stamp: str) -> None:
        self.stamp = stamp  # "value" (send time in the value) or "timestamp" (rate)
        self.lock = threading.Lock()
        self.total: list[np.ndarray] = []
        self.to_receiver: list[np.ndarray] = []
        self.sent_at: list[np.ndarray] = []
        self.rows = 0
        self.batches = 0

    def __call__(self, df: Any, batch_id: int) -> None:
        table = df.select("value", "timestamp").toArrow()
        arrival = time.time()
        ts = pc.cast(table.column("timestamp"), "int64").to_numpy(zero_copy_only=False) / 1e6
        if self.stamp == "value":
            raw = b"".join(v[:8] for v in table.column("value").to_pylist())
            sent = np.frombuffer(raw, dtype="<f8")
            to_receiver = ts - sent
        else:
            sent = ts
            to_receiver = np.zeros(0)
        with self.lock:
            self.total.append(arrival - sent)
            self.to_receiver.append(to_receiver)
            self.sent_at.append(sent)
            self.rows += table.num_rows
            self.batches += 1


def _query(df: Any, sink: _Collector, work: Path) -> Any:
    return (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(work / f"ckpt-{time.time_ns()}"))
        .trigger(processingTime="0 seconds")
        .start()
    )


def _wait(q: Any, cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if q.exception() is not None:
            raise RuntimeError(f"query failed: {q.exception()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)  # a benchmark's poll interval, not a test wait


def _figures(sink: _Collector, t_from: float) -> dict[str, Any]:
    sent = np.concatenate(sink.sent_at) if sink.rows else np.zeros(0)
    keep = sent >= t_from
    total = np.concatenate(sink.total)[keep] if sink.rows else np.zeros(0)
    out: dict[str, Any] = {"rows": int(keep.sum()), "batches": sink.batches, "samples": total}
    if total.size == 0:
        raise RuntimeError("no rows after the warm-up: run longer")
    for name, q in (("p50", 50), ("p99", 99)):
        out[name] = float(np.percentile(total, q))
    out["max"] = float(total.max())
    to_r = np.concatenate(sink.to_receiver) if sink.to_receiver else np.zeros(0)
    if to_r.size == sent.size:
        to_r = to_r[keep]
        out["p50_to_receiver"] = float(np.percentile(to_r, 50))
        out["p99_to_receiver"] = float(np.percentile(to_r, 99))
    return out


def run_zio(spark: Any, work: Path, rate: float, seconds: float, warmup: float) -> dict[str, Any]:
    from zio_spark.source.producer import Producer

    prod = Producer(producer_id=f"latency-{time.time_ns()}", linger_ms=0, max_unacked=1_000_000)
    sink = _Collector("value")
    q = None
    try:
        q = _query(zio_stream(spark, prod, work), sink, work)
        _wait(q, lambda: prod.connected, 120, "the source to connect")
        sender = SteadySender(prod, rate).start()
        try:
            # Start-up (the first batches start the Python workers) is not steady state:
            # the measured window opens once the first rows reached foreachBatch.
            _wait(q, lambda: sink.rows > 0, 120, "the first rows in foreachBatch")
            t_start = time.time()
            time.sleep(seconds)  # the measured run: records flow at a steady rate meanwhile
        finally:
            sent = sender.stop()
        _wait(q, lambda: sink.rows >= sent, 60, f"{sent} rows to reach foreachBatch")
        if sink.rows != sent:
            raise RuntimeError(f"{sink.rows} rows reached foreachBatch, {sent} were sent")
    finally:
        if q is not None:
            q.stop()
        prod.close(flush=False, timeout=0.5)
    return _figures(sink, t_start + warmup)


def run_rate(spark: Any, work: Path, rate: float, seconds: float, warmup: float) -> dict[str, Any]:
    sink = _Collector("timestamp")
    df = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", str(int(rate)))
        .option("numPartitions", "2")
        .load()
        .selectExpr("cast(cast(value as string) as binary) as value", "timestamp")
    )
    q = _query(df, sink, work)
    try:
        _wait(q, lambda: sink.rows > 0, 120, "the first rate batch")
        t_start = time.time()
        time.sleep(seconds)  # the measured run
    finally:
        q.stop()
    return _figures(sink, t_start + warmup)


def main() -> None:
    a = quick_args(
        __doc__,
        {
            "seconds": (30.0, 5.0, "seconds per run"),
            "warmup": (5.0, 1.0, "seconds left out"),
            "runs": (3, 1, "runs"),
        },
        lambda ap: ap.add_argument("--rate", type=float, default=20_000, help="records/s"),
    )
    seconds, warmup, runs = a.seconds, a.warmup, a.runs

    per: dict[str, list[dict[str, Any]]] = {"rate": [], "zio": []}
    with spark_run("bench-latency") as (spark, work):
        for i in range(runs):
            per["rate"].append(run_rate(spark, work, a.rate, seconds, warmup))
            per["zio"].append(run_zio(spark, work, a.rate, seconds, warmup))
            print(
                f"run {i}: "
                + ", ".join(
                    f"{k} p50 {v[-1]['p50']:.3f} s p99 {v[-1]['p99']:.3f} s" for k, v in per.items()
                ),
                flush=True,
            )

    labels = {"rate": "rate source -> foreachBatch (anchor)", "zio": "zio producer -> foreachBatch"}
    figures: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for k, rs in per.items():
        allsamples = np.concatenate([r["samples"] for r in rs])
        for i, r in enumerate(rs):
            arrays[f"{k}_run{i}"] = r["samples"].astype(np.float32)
        figures[k] = {
            "label": labels[k],
            "rows": [r["rows"] for r in rs],
            "batches": [r["batches"] for r in rs],
            **{m: spread([r[m] for r in rs]) for m in ("p50", "p99", "max")},
            "cdf_quantiles_s": [float(x) for x in np.quantile(allsamples, np.linspace(0, 1, 1001))],
        }
        if "p50_to_receiver" in rs[0]:
            for m in ("p50_to_receiver", "p99_to_receiver"):
                figures[k][m] = spread([r[m] for r in rs])
    ratios = {
        m: ratio_spread([r[m] for r in per["zio"]], [r[m] for r in per["rate"]])
        for m in ("p50", "p99")
    }
    targets = {f"{m} <= {t} s": figures["zio"][m]["median"] <= t for m, t in TARGETS.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "latency-samples.npz", **arrays)
    write_json(
        out,
        "latency.json",
        {
            "bench": "latency",
            "machine": machine(),
            "rate": a.rate,
            "seconds": seconds,
            "warmup": warmup,
            "runs": runs,
            "trigger": "processingTime=0 seconds",
            "unit": "s",
            "figures": figures,
            "zio_vs_rate": ratios,
            "targets": TARGETS,
            "targets_met": targets,
            "samples_file": "latency-samples.npz",
        },
    )
    print()
    print(
        md_table(
            ["path", "p50 s (median, min-max)", "p99 s", "max s", "p50 vs anchor", "p99 vs anchor"],
            [
                [
                    f["label"],
                    fmt_spread(f["p50"], digits=3),
                    fmt_spread(f["p99"], digits=3),
                    fmt_spread(f["max"], digits=3),
                    "anchor" if k == "rate" else fmt_spread(ratios["p50"], "x", digits=2),
                    "anchor" if k == "rate" else fmt_spread(ratios["p99"], "x", digits=2),
                ]
                for k, f in figures.items()
            ],
        )
    )
    z = figures["zio"]
    print()
    print(
        f"{a.rate:,.0f} records/s for {seconds:g} s per run ({warmup:g} s warm-up left out), "
        f"{runs} run(s), trigger processingTime=0. zio producer -> receiver p50 "
        f"{fmt_spread(z['p50_to_receiver'], digits=4)} s, p99 "
        f"{fmt_spread(z['p99_to_receiver'], digits=4)} s. Targets p50 <= 0.5 s "
        f"({'met' if targets['p50 <= 0.5 s'] else 'NOT met'}), p99 <= 1.5 s "
        f"({'met' if targets['p99 <= 1.5 s'] else 'NOT met'})."
    )


if __name__ == "__main__":
    main()
