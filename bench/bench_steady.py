"""Steady-state source throughput: a producer at full speed, the default trigger, >= 60 s.

Where ``bench_source.py`` times ``availableNow`` runs (start-up and a pre-loaded backlog
included), this bench measures what a running query sustains, beside anchors measured in
the same session, round after round (a ratio compares neighbours in time):

- ``synthetic`` (anchor): a Python ``DataSourceStreamReader`` with the zio source's *eight
  columns* (value 100 B, key, producer, seq, origin, granule, timestamp, headers), Arrow
  batches of 10k rows; its offset grows with time (at most ``--synthetic-batch`` rows a
  micro-batch), so Spark reads as fast as it can plan batches;
- ``rate`` (anchor): Spark's built-in ``rate-micro-batch`` source, ``--rate-batch`` rows a
  batch;
- ``zio``: a ``Producer`` in its own process (``zio-spark produce`` semantics: Arrow DATs,
  100 B records, default window unless ``--window``) sending as fast as it may, read with
  ``readStream.format("zio")`` and the default trigger;
- ``bind8`` (with ``--bind-clients N``, default 8): N plain client givers in their own
  processes, the reference's shape (one record per DAT labelled ``{"flow": "DAT"}``,
  nothing else), connecting to ``readStream.format("zio").option("bind", ...)``.

Each case runs ``--seconds`` into the ``noop`` sink with the default trigger. Figures:
rows/s over the second half (rows of the batches completed in it / its length), time to
the first row after ``start()`` (the first completed batch with rows), and CPU seconds per
million rows over the second half for the driver JVM, the source runner (the JVM's
long-lived Python process that holds the receiver), the other Python workers (reading
partitions) and the producer processes, from ``/proc/<pid>/stat``.

Run: ``.venv/bin/python bench/bench_steady.py [--quick] [--out DIR]``; writes
``DIR/steady.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from common import (
    ROOT,
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
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

VALUE = b"x" * 100
ROWS_PER_ARROW_BATCH = 10_000


# ----------------------------------------------------------------------------- anchor


class _Steady(DataSource):  # type: ignore[misc]
    @classmethod
    def name(cls) -> str:
        return "zio_bench_steady"

    def schema(self) -> str:
        from zio_spark.spark.source import DEFAULT_SCHEMA

        return DEFAULT_SCHEMA

    def streamReader(self, schema):  # type: ignore[no-untyped-def]
        return _SteadyReader(int(self.options.get("maxbatch", "2000000")))


class _SteadyReader(DataSourceStreamReader):  # type: ignore[misc]
    """Offsets grow with time at an unbounded rate, capped per micro-batch."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch

    def initialOffset(self) -> dict:
        return {"n": 0}

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        if start is None:
            return {"n": self.max_batch}
        return {"n": start["n"] + self.max_batch}

    def partitions(self, start: dict, end: dict):  # type: ignore[no-untyped-def]
        s, e = start["n"], end["n"]
        step = max(1, (e - s + 1) // 2)
        return [InputPartition((a, min(e, a + step))) for a in range(s, e, step)]

    def read(self, partition):  # type: ignore[no-untyped-def]
        a, b = partition.value
        n = ROWS_PER_ARROW_BATCH
        from zio_spark.storage.spool import SPARK_SCHEMA  # the zio source's Arrow schema

        ts = pa.scalar(time.time_ns() // 1000, pa.timestamp("us", tz="UTC"))
        template = pa.RecordBatch.from_arrays(
            [
                pa.array([VALUE] * n, pa.binary()),
                pa.nulls(n, pa.binary()),
                pa.array(["steady"] * n, pa.string()),
                pa.array(range(n), pa.int64()),
                pa.array([0] * n, pa.int64()),
                pa.array([0] * n, pa.int64()),
                pa.repeat(ts, n),
                pa.nulls(n, SPARK_SCHEMA.field("headers").type),
            ],
            schema=SPARK_SCHEMA,
        )
        for lo in range(a, b, n):
            k = min(n, b - lo)
            t = template.slice(0, k)
            seq = pc.add(t.column(3), pa.scalar(lo + 1, pa.int64()))
            yield pa.RecordBatch.from_arrays(
                [*t.columns[:3], seq, *t.columns[4:]], schema=template.schema
            )


# ----------------------------------------------------------------------------- children


def _producer_child(endpoint_file: str, window: int) -> None:
    """Our Producer in its own process, sending 100 B records as fast as it may."""
    from zio_spark.source.producer import Producer

    kw: dict[str, Any] = {"producer_id": "steady", "linger_ms": 0}
    if window > 0:
        kw["max_unacked"] = window
    prod = Producer("tcp://127.0.0.1:*", **kw)
    Path(endpoint_file + ".tmp").write_text(prod.endpoint)
    os.replace(endpoint_file + ".tmp", endpoint_file)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    chunk = [VALUE] * 10_000
    from zio_spark.errors import TransportError

    while not stop:
        try:
            prod.send_many(chunk, timeout=1.0)
        except TransportError:  # the window is full: the query is behind; keep offering
            continue
    prod.close(flush=False, timeout=0.5)


def _plain_client_child(endpoint: str, origin: int) -> None:
    """A reference-shaped client giver: BOT extract, then bare one-record DATs as paid."""
    import zmq

    from zio_spark.protocol.flow import Direction, EotReceived, Flow, FlowState, Role
    from zio_spark.protocol.message import DatCodec
    from zio_spark.transport.port import BadMessage, ClientPort

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    ctx = zmq.Context()
    port = ClientPort(ctx, linger_ms=0)
    port.connect(endpoint)
    flow = Flow(Role.CLIENT, origin=origin)
    port.send(flow.send_bot(Direction.EXTRACT, 1000))
    codec, payload = DatCodec(origin), (VALUE,)
    while not stop:
        for msg in port.recv_many(1000, 50):
            if type(msg) is not BadMessage and isinstance(flow.receive(msg), EotReceived):
                stop.append(1)  # the source ended the flow
        k = flow.credit if flow.state is FlowState.READY else 0
        if k > 0:
            first = flow.send_dats(k)
            for i in range(k):
                port.send_dat(codec, first + i, payload)
    port.close(linger_ms=0)
    ctx.term()


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")])}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, start_new_session=True)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


# ----------------------------------------------------------------------------- measuring


def _rows(q: Any) -> int:
    return sum(p["numInputRows"] for p in q.recentProgress)


def _warm_up(df: Any, work: Path, timeout: float = 180.0) -> None:
    """Run ``df`` until its first rows are in (Python workers started and imports done)."""
    q = (
        df.writeStream.format("noop")
        .option("checkpointLocation", str(work / f"ckpt-{time.time_ns()}"))
        .start()
    )
    deadline = time.monotonic() + timeout
    try:
        while _rows(q) == 0:
            if q.exception() is not None:
                raise RuntimeError(q.exception())
            if time.monotonic() > deadline:
                raise RuntimeError(f"warm-up query read nothing in {timeout:g} s")
            time.sleep(0.05)
    finally:
        q.stop()


def _measure(
    spark: Any, df: Any, work: Path, seconds: float, children: list[int]
) -> dict[str, Any]:
    jvm = jvm_pid(spark)
    t0 = time.perf_counter()
    q = (
        df.writeStream.format("noop")
        .option("checkpointLocation", str(work / f"ckpt-{time.time_ns()}"))
        .start()
    )
    first: float | None = None
    half_at = t0 + seconds / 2
    end_at = t0 + seconds
    mid: tuple[float, int, dict[str, float]] | None = None
    try:
        while True:
            now = time.perf_counter()
            if q.exception() is not None:
                raise RuntimeError(q.exception())
            if first is None and _rows(q) > 0:
                first = now - t0
            if mid is None and now >= half_at:
                mid = (now, _rows(q), cpu_by_role(jvm, children))
            if now >= end_at:
                break
            time.sleep(0.02)
        t_end, rows_end, cpu_end = time.perf_counter(), _rows(q), cpu_by_role(jvm, children)
    finally:
        q.stop()
    assert mid is not None
    t_mid, rows_mid, cpu_mid = mid
    rows = rows_end - rows_mid
    if rows <= 0:
        raise RuntimeError(f"no rows in the second half ({rows_end} in all)")
    per_m = {
        role: (cpu_end.get(role, 0.0) - cpu_mid.get(role, 0.0)) / (rows / 1e6)
        for role in sorted(set(cpu_end) | set(cpu_mid))
        if role not in ("python driver", "other")
    }
    return {
        "rows_per_s": rows / (t_end - t_mid),
        "first_row_s": first if first is not None else float("nan"),
        "rows": rows_end,
        "cpu_s_per_million": per_m,
    }


def _zio(
    spark: Any,
    work: Path,
    seconds: float,
    window: int,
    max_backlog: int,
    options: dict[str, str],
) -> dict[str, Any]:
    ep_file = str(work / f"producer-{time.time_ns()}.ep")
    proc = _spawn("--producer-child", ep_file, "--window", str(window))
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(ep_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the producer process did not start")
            time.sleep(0.02)
        endpoint = Path(ep_file).read_text()
        df = (
            spark.readStream.format("zio")  # a reader: options are added below, then load()
            .option("endpoints", endpoint)
            .option("spoolPath", str(work / f"spool-{time.time_ns()}"))
            .option("spoolAccess", "local")
        )
        if max_backlog:
            df = df.option("maxBacklog", str(max_backlog))
        for k, v in options.items():
            df = df.option(k, v)
        return _measure(spark, df.load(), work, seconds, [proc.pid])
    finally:
        _stop([proc])


def _bind(spark: Any, work: Path, seconds: float, clients: int) -> dict[str, Any]:
    import socket

    with socket.socket() as s:  # a free loopback port for the source to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    df = (
        spark.readStream.format("zio")
        .option("bind", endpoint)
        .option("spoolPath", str(work / f"spool-{time.time_ns()}"))
        .option("spoolAccess", "local")
        .load()
    )
    procs = [_spawn("--plain-child", endpoint, "--origin", str(100 + i)) for i in range(clients)]
    try:
        return _measure(spark, df, work, seconds, [p.pid for p in procs])
    finally:
        _stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 s per case, 1 round")
    ap.add_argument("--seconds", type=float, default=None, help="per case (default 60)")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 3)")
    ap.add_argument("--window", type=int, default=0, help="producer max_unacked (0: default)")
    ap.add_argument("--bind-clients", type=int, default=8, help="plain clients (0: skip)")
    ap.add_argument("--synthetic-batch", type=int, default=2_000_000)
    ap.add_argument("--rate-batch", type=int, default=2_000_000)
    ap.add_argument("--max-backlog", type=int, default=0, help="zio maxBacklog (0: default)")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a zio source option for the zio case (repeatable), e.g. credit=250",
    )
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--producer-child", help=argparse.SUPPRESS)
    ap.add_argument("--plain-child", help=argparse.SUPPRESS)
    ap.add_argument("--origin", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.producer_child:
        _producer_child(a.producer_child, a.window)
        return
    if a.plain_child:
        _plain_client_child(a.plain_child, a.origin)
        return
    options = {}
    for kv in a.option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--option {kv!r}: expected KEY=VALUE")
        options[key] = value
    seconds = a.seconds or (30.0 if a.quick else 60.0)
    runs = a.runs or (1 if a.quick else 3)
    if a.quick:  # small batches: a loaded machine still completes several per case
        a.synthetic_batch = min(a.synthetic_batch, 200_000)
        a.rate_batch = min(a.rate_batch, 200_000)
        a.max_backlog = a.max_backlog or 200_000
    cases = ["synthetic", "rate", "zio"] + (["bind8"] if a.bind_clients else [])
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    conf = {"spark.sql.streaming.numRecentProgressUpdates": "100000"}
    with spark_run("bench-steady", conf) as (spark, work):
        spark.dataSource.register(_Steady)
        # Warm-up, not counted: the first use of the Python data source machinery (worker
        # start, imports) would land on whichever case runs first.
        warm = spark.readStream.format("zio_bench_steady").option("maxBatch", "10000").load()
        _warm_up(warm, work)
        for i in range(runs):
            syn = (
                spark.readStream.format("zio_bench_steady")
                .option("maxBatch", str(a.synthetic_batch))
                .load()
            )
            res["synthetic"].append(_measure(spark, syn, work, seconds, []))
            rate = (
                spark.readStream.format("rate-micro-batch")
                .option("rowsPerBatch", str(a.rate_batch))
                .load()
            )
            res["rate"].append(_measure(spark, rate, work, seconds, []))
            res["zio"].append(_zio(spark, work, seconds, a.window, a.max_backlog, options))
            if a.bind_clients:
                res["bind8"].append(_bind(spark, work, seconds, a.bind_clients))
            print(
                f"round {i}: "
                + ", ".join(f"{c} {r[-1]['rows_per_s']:,.0f}/s" for c, r in res.items()),
                flush=True,
            )

    def series(case: str, key: str) -> list[float]:
        return [r[key] for r in res[case]]

    figures = {
        c: {
            "rows_per_s": spread(series(c, "rows_per_s")),
            "first_row_s": spread(series(c, "first_row_s")),
            "cpu_s_per_million": {
                role: spread([r["cpu_s_per_million"].get(role, 0.0) for r in res[c]])
                for role in sorted({k for r in res[c] for k in r["cpu_s_per_million"]})
            },
        }
        for c in cases
    }
    ratios = {
        f"{c}_vs_{anchor}": ratio_spread(series(c, "rows_per_s"), series(anchor, "rows_per_s"))
        for c in cases
        if c not in ("synthetic", "rate")
        for anchor in ("synthetic", "rate")
    }
    first_gap = spread(
        [
            z - s
            for z, s in zip(
                series("zio", "first_row_s"), series("synthetic", "first_row_s"), strict=True
            )
        ]
    )
    targets = {
        "zio >= 0.8x synthetic": ratios["zio_vs_synthetic"]["median"] >= 0.8,
        "first row within 1 s of synthetic": first_gap["median"] <= 1.0,
    }
    if "bind8" in cases:
        targets["bind8 >= 250k rows/s"] = figures["bind8"]["rows_per_s"]["median"] >= 250_000
    write_json(
        a.out,
        "steady.json",
        {
            "bench": "steady",
            "machine": machine(),
            "seconds": seconds,
            "runs": runs,
            "window": a.window or "default",
            "zio_options": options,
            "figures": figures,
            "ratios": ratios,
            "first_row_gap_s": first_gap,
            "targets_met": targets,
        },
    )
    labels = {
        "synthetic": "synthetic Python Arrow source, 8 columns (anchor)",
        "rate": "rate-micro-batch (anchor)",
        "zio": "zio, producer process, Arrow DATs",
        "bind8": f"zio bind, {a.bind_clients} plain clients, 1 record/DAT",
    }
    print()
    print(
        md_table(
            ["source", "rows/s, 2nd half", "vs synthetic", "first row (s)", "CPU s per 1M rows"],
            [
                [
                    labels[c],
                    fmt_spread(f["rows_per_s"]),
                    "anchor"
                    if c in ("synthetic", "rate")
                    else fmt_spread(ratios[f"{c}_vs_synthetic"], "x", digits=3),
                    fmt_spread(f["first_row_s"], digits=2),
                    ", ".join(
                        f"{role} {s['median']:.2f}" for role, s in f["cpu_s_per_million"].items()
                    ),
                ]
                for c, f in figures.items()
            ],
        )
    )
    print()
    print(
        f"{runs} round(s) of {seconds:g} s, {os.cpu_count()} CPUs; "
        + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items())
    )


if __name__ == "__main__":
    main()
