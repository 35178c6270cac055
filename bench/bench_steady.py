"""Steady-state source throughput: a producer at full speed, the default trigger, >= 60 s.

Where ``bench_source.py`` times ``availableNow`` runs (start-up and a pre-loaded backlog
included), this bench measures what a running query sustains, beside anchors measured in
the same session, round after round (a ratio compares neighbours in time):

- ``synthetic`` (anchor, always run): a Python ``DataSourceStreamReader`` with the zio
  source's *eight columns* (value 100 B, key, producer, seq, origin, granule, timestamp,
  headers), Arrow batches of 10k rows; its offset grows with time (at most
  ``--synthetic-batch`` rows a micro-batch), so Spark reads as fast as it can plan
  batches;
- ``rate`` (anchor): Spark's built-in ``rate-micro-batch`` source, ``--rate-batch`` rows a
  batch;
- ``zio``: a bound ``Producer`` in its own process (``zio-spark produce`` semantics: Arrow
  DATs, 100 B records, default window unless ``--window``) sending as fast as it may,
  read with ``readStream.format("zio")`` and the default trigger (the spool path);
- ``direct``: the same producer, read with ``readMode=direct`` (the driver asks the
  producer's held window on a control flow; each task fetches its range from the
  producer; docs/direct-read.md);
- ``bind8`` (with ``--bind-clients N``, default 8): N plain client givers in their own
  processes, the reference's shape (one record per DAT labelled ``{"flow": "DAT"}``,
  nothing else), connecting to ``readStream.format("zio").option("bind", ...)``.

``--cases`` picks among them. Each case runs ``--seconds`` into the ``noop`` sink with the
default trigger. Figures: rows/s over the second half (rows of the batches completed in
it / its length), time to the first row after ``start()`` (the first completed batch with
rows), and CPU seconds per million rows over the second half, from ``/proc``: the driver
JVM, the source runner (the JVM's long-lived Python process that plans the source), the
other Python workers (reading partitions) and the producer processes; derived: the
*Spark side* (JVM + workers + runner: what the query costs, producers excluded) and the
*driver* (the source runner, which is driver-only, plus the JVM's driver threads: the
micro-batch loop, the DAG scheduler, task results, the listener bus, the RPC
dispatcher; ``common.JVM_DRIVER_THREADS``). In local mode the executors live in the
driver JVM: its GC, JIT and task threads serve both and are left out of the driver
figure (task threads cannot be counted per thread: Spark replaces them every few
seconds). The Spark side's ratio to the synthetic source's and the driver's excess over
it are taken round by round. The load average (1 min) at each case's start and end is
kept: the machine is shared.

``--scale 1,4,16`` runs, instead of the cases, direct mode with that many producer
processes at ``--scale-rate`` records/s each (default 5000): rows grow with the
producers; the figures are the driver's CPU per second and per trigger (the source
runner, the JVM's micro-batch loop) against the rows per second; writes
``steady-scale.json``.

Run: ``.venv/bin/python bench/bench_steady.py [--quick] [--cases ...] [--out DIR]``;
writes ``DIR/steady.json`` and prints a Markdown table.
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
    CpuTracker,
    fmt_spread,
    jvm_pid,
    jvm_threads,
    jvm_threads_used,
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


def _producer_child(
    endpoint_file: str, window: int, producer_id: str, rate: float, batch: int, window_bytes: int
) -> None:
    """Our Producer in its own process (bound: it serves range reads too), sending 100 B
    records as fast as it may, or ``rate`` records a second (in chunks every 100 ms)."""
    from zio_spark.source.producer import Producer

    kw: dict[str, Any] = {"producer_id": producer_id, "linger_ms": 0}
    if batch > 0:
        kw["batch"] = batch
    if window > 0:
        kw["max_unacked"] = window
    if window_bytes > 0:
        kw["max_unacked_bytes"] = window_bytes
    prod = Producer("tcp://127.0.0.1:*", **kw)
    Path(endpoint_file + ".tmp").write_text(prod.endpoint)
    os.replace(endpoint_file + ".tmp", endpoint_file)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    chunk = [VALUE] * 10_000
    from zio_spark.errors import TransportError

    # Seconds spent in sends that found the window full (the query acked too late to
    # keep the producer going): written next to the endpoint file at the end.
    born, full = time.monotonic(), 0.0
    if rate > 0:
        t0, sent = time.monotonic(), 0
        while not stop:
            due = int((time.monotonic() - t0) * rate) - sent
            if due > 0:
                try:
                    prod.send_many([VALUE] * due, timeout=1.0)
                    sent += due
                except TransportError:  # the window is full: the query is behind
                    continue
            time.sleep(0.1)
    while not stop:
        t = time.monotonic()
        try:
            prod.send_many(chunk, timeout=1.0)
        except TransportError:  # the window is full: the query is behind; keep offering
            full += time.monotonic() - t
            continue
    Path(endpoint_file + ".full").write_text(f"{full / (time.monotonic() - born):.4f}")
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


def _sum_rows(progress: list[Any]) -> int:
    return sum(p["numInputRows"] for p in progress)


def _rows(q: Any) -> int:
    return _sum_rows(q.recentProgress)


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
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    q = (
        df.writeStream.format("noop")
        .option("checkpointLocation", str(work / f"ckpt-{time.time_ns()}"))
        .start()
    )
    first: float | None = None
    half_at = t0 + seconds / 2
    end_at = t0 + seconds
    tracker = CpuTracker(jvm, children)
    mid: tuple[float, int, dict[int, Any], int] | None = None
    try:
        # Progress is read over py4j (the whole list each time: it costs the JVM and
        # this process CPU): every 50 ms until the first row, then only at the half and
        # the end; in between, the query's health and the CPU samples, twice a second.
        while True:
            now = time.perf_counter()
            if q.exception() is not None:
                raise RuntimeError(q.exception())
            if first is None and _rows(q) > 0:
                first = now - t0
            if mid is None and now >= half_at:
                tracker.sample()
                progress = list(q.recentProgress)
                mid = (now, _sum_rows(progress), jvm_threads(jvm), len(progress))
            elif mid is not None:
                tracker.sample()
            if now >= end_at:
                break
            nxt = end_at if mid is not None else half_at
            time.sleep(0.05 if first is None else max(0.0, min(0.5, nxt - now)))
        t_end, threads_end = time.perf_counter(), jvm_threads(jvm)
        progress = list(q.recentProgress)
        rows_end = _sum_rows(progress)
    finally:
        q.stop()
    assert mid is not None
    t_mid, rows_mid, threads_mid, n_mid = mid
    rows = rows_end - rows_mid
    if rows <= 0:
        raise RuntimeError(f"no rows in the second half ({rows_end} in all)")
    used = {role: v for role, v in tracker.used.items() if role not in ("python driver", "other")}
    used.update(jvm_threads_used(threads_mid, threads_end))
    # Derived groups: the Spark side (what the query costs, producers excluded) and the
    # driver's own work: the source runner is driver-only; of the JVM, its driver
    # threads (common.JVM_DRIVER_THREADS: the micro-batch loop, scheduler, listeners,
    # RPC). The JVM's GC, JIT and the executors' task threads serve both and are not in
    # it (local mode: one JVM).
    used["spark side"] = sum(
        used.get(r, 0.0) for r in ("driver JVM", "python workers", "source runner")
    )
    used["driver"] = used.get("source runner", 0.0) + used.get("JVM driver threads", 0.0)
    per_m = {role: v / (rows / 1e6) for role, v in used.items()}
    span = t_end - t_mid
    triggers = progress[n_mid:]
    durations: dict[str, float] = {}
    for pr in triggers:
        for k, v in (pr.get("durationMs") or {}).items():
            durations[k] = durations.get(k, 0.0) + float(v)
    return {
        "rows_per_s": rows / span,
        "first_row_s": first if first is not None else float("nan"),
        "rows": rows_end,
        "cpu_s_per_million": per_m,
        "cpu_s_per_s": {role: v / span for role, v in used.items()},
        "triggers_per_s": len(triggers) / span,
        "ms_per_trigger": {k: v / max(1, len(triggers)) for k, v in sorted(durations.items())},
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def _producers(
    work: Path, n: int, window: int, rate: float, batch: int = 0, window_bytes: int = 0
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``n`` producer processes (ids ``steady``, or ``steady-<i>``) and their endpoints."""
    procs: list[subprocess.Popen[bytes]] = []
    files: list[str] = []
    try:
        for i in range(n):
            ep_file = str(work / f"producer-{time.time_ns()}-{i}.ep")
            pid = "steady" if n == 1 else f"steady-{i}"
            procs.append(
                _spawn(
                    "--producer-child",
                    ep_file,
                    "--window",
                    str(window),
                    "--window-bytes",
                    str(window_bytes),
                    "--producer-id",
                    pid,
                    "--rate",
                    str(rate),
                    "--producer-batch",
                    str(batch),
                )
            )
            files.append(ep_file)
        deadline = time.monotonic() + 60
        for proc, ep_file in zip(procs, files, strict=True):
            while not os.path.exists(ep_file):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("a producer process did not start")
                time.sleep(0.02)
        return procs, [Path(f).read_text() for f in files]
    except BaseException:
        _stop(procs)
        raise


def _zio(
    spark: Any,
    work: Path,
    seconds: float,
    window: int,
    max_backlog: int,
    options: dict[str, str],
    *,
    direct: bool = False,
    producers: int = 1,
    rate: float = 0.0,
    batch: int = 0,
    window_bytes: int = 0,
) -> dict[str, Any]:
    procs, endpoints = _producers(work, producers, window, rate, batch, window_bytes)
    res: dict[str, Any] = {}
    try:
        df = (
            spark.readStream.format("zio")  # a reader: options are added below, then load()
            .option("endpoints", ",".join(endpoints))
            .option("spoolPath", str(work / f"spool-{time.time_ns()}"))
            .option("spoolAccess", "local")
        )
        if direct:
            df = df.option("readMode", "direct")
        elif max_backlog:
            df = df.option("maxBacklog", str(max_backlog))
        for k, v in options.items():
            df = df.option(k, v)
        res = _measure(spark, df.load(), work, seconds, [p.pid for p in procs])
    finally:
        _stop(procs)
    # Each producer's share of its life spent on a full window (the query behind).
    shares = [float(p.read_text()) for p in work.glob("producer-*.ep.full")]
    for p in work.glob("producer-*.ep.full"):
        p.unlink()
    if shares:
        res["producer_window_full_share"] = max(shares)
    return res


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


def _scale(
    spark: Any, work: Path, a: argparse.Namespace, counts: list[int], runs: int, seconds: float
) -> None:
    """Direct mode with 1, 4, 16... rate-limited producer processes: the driver's CPU
    per second against the rows per second (they grow with the producers)."""
    res: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for i in range(runs):
        for n in counts:
            res[n].append(
                _zio(
                    spark,
                    work,
                    seconds,
                    a.window,
                    0,
                    {},
                    direct=True,
                    producers=n,
                    rate=a.scale_rate,
                    batch=a.producer_batch,
                    window_bytes=a.window_bytes,
                )
            )
            r = res[n][-1]
            print(
                f"round {i}, {n} producers: {r['rows_per_s']:,.0f} rows/s, "
                f"{r['triggers_per_s']:.2f} triggers/s, runner "
                f"{r['cpu_s_per_s'].get('source runner', 0.0):.3f} CPU-s/s, stream thread "
                f"{r['cpu_s_per_s'].get('JVM stream thread', 0.0):.3f} CPU-s/s, "
                f"load {r['load_1m']}",
                flush=True,
            )

    def per_trigger(r: dict[str, Any], role: str) -> float:
        return 1000 * r["cpu_s_per_s"].get(role, 0.0) / max(r["triggers_per_s"], 1e-9)

    figures = {
        str(n): {
            "rows_per_s": spread([r["rows_per_s"] for r in res[n]]),
            "triggers_per_s": spread([r["triggers_per_s"] for r in res[n]]),
            "cpu_s_per_s": {
                role: spread([r["cpu_s_per_s"].get(role, 0.0) for r in res[n]])
                for role in sorted({k for r in res[n] for k in r["cpu_s_per_s"]})
            },
            "runner_cpu_ms_per_trigger": spread([per_trigger(r, "source runner") for r in res[n]]),
            "stream_thread_cpu_ms_per_trigger": spread(
                [per_trigger(r, "JVM stream thread") for r in res[n]]
            ),
            "ms_per_trigger": {
                k: spread([r["ms_per_trigger"].get(k, 0.0) for r in res[n]])
                for k in sorted({k for r in res[n] for k in r["ms_per_trigger"]})
            },
            "load_1m": [r["load_1m"] for r in res[n]],
        }
        for n in counts
    }
    write_json(
        a.out,
        "steady-scale.json",
        {
            "bench": "steady-scale",
            "machine": machine(),
            "seconds": seconds,
            "runs": runs,
            "rate_per_producer": a.scale_rate,
            "figures": figures,
            "runs_raw": {str(n): res[n] for n in counts},
        },
    )
    print()
    print(
        md_table(
            [
                "producers",
                "rows/s, 2nd half",
                "triggers/s",
                "runner CPU-s/s",
                "JVM stream thread CPU-s/s",
                "runner CPU-ms/trigger",
                "stream thread CPU-ms/trigger",
                "JVM driver threads CPU-s/s",
                "driver JVM (all) CPU-s/s",
                "latestOffset ms/trigger",
                "load (1 min)",
            ],
            [
                [
                    n,
                    fmt_spread(f["rows_per_s"]),
                    fmt_spread(f["triggers_per_s"], digits=2),
                    fmt_spread(f["cpu_s_per_s"].get("source runner", spread([0])), digits=3),
                    fmt_spread(f["cpu_s_per_s"].get("JVM stream thread", spread([0])), digits=3),
                    fmt_spread(f["runner_cpu_ms_per_trigger"], digits=1),
                    fmt_spread(f["stream_thread_cpu_ms_per_trigger"], digits=1),
                    fmt_spread(f["cpu_s_per_s"].get("JVM driver threads", spread([0])), digits=3),
                    fmt_spread(f["cpu_s_per_s"].get("driver JVM", spread([0])), digits=3),
                    fmt_spread(f["ms_per_trigger"].get("latestOffset", spread([0])), digits=0),
                    " / ".join(f"{x[0]:.1f}-{x[1]:.1f}" for x in f["load_1m"]),
                ]
                for n, f in ((n, figures[str(n)]) for n in counts)
            ],
        )
    )
    print()
    print(
        f"{runs} round(s) of {seconds:g} s per count, {a.scale_rate:g} records/s per "
        f"producer, readMode=direct, {os.cpu_count()} CPUs"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="30 s per case, 1 round, batches of about 200k rows in every case (a harness "
        "check: the targets need the full run)",
    )
    ap.add_argument("--seconds", type=float, default=None, help="per case (default 60)")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 3)")
    ap.add_argument(
        "--cases",
        default="synthetic,rate,zio,direct,bind8",
        help="comma-separated, among synthetic, rate, zio, direct, bind8 (synthetic is "
        "always run: it is the anchor)",
    )
    ap.add_argument("--window", type=int, default=0, help="producer max_unacked (0: default)")
    ap.add_argument(
        "--window-bytes", type=int, default=0, help="producer max_unacked_bytes (0: default)"
    )
    ap.add_argument(
        "--producer-batch",
        type=int,
        default=0,
        help="producer records per DAT (Producer(batch=...); 0: its default, 4096)",
    )
    ap.add_argument("--bind-clients", type=int, default=8, help="plain clients (0: skip)")
    ap.add_argument("--synthetic-batch", type=int, default=2_000_000)
    ap.add_argument("--rate-batch", type=int, default=2_000_000)
    ap.add_argument("--max-backlog", type=int, default=0, help="zio maxBacklog (0: default)")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a zio source option for the zio and direct cases (repeatable), e.g. credit=250",
    )
    ap.add_argument(
        "--scale",
        default="",
        metavar="N,N,...",
        help="instead of the cases: direct mode with N rate-limited producer processes "
        "for each N (e.g. 1,4,16); writes steady-scale.json",
    )
    ap.add_argument(
        "--scale-rate", type=float, default=5000.0, help="records/s per producer (--scale)"
    )
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--producer-child", help=argparse.SUPPRESS)
    ap.add_argument("--producer-id", default="steady", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--plain-child", help=argparse.SUPPRESS)
    ap.add_argument("--origin", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.producer_child:
        _producer_child(
            a.producer_child, a.window, a.producer_id, a.rate, a.producer_batch, a.window_bytes
        )
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
    known = ("synthetic", "rate", "zio", "direct", "bind8")
    wanted = {c.strip() for c in a.cases.split(",") if c.strip()}
    if wanted - set(known):
        ap.error(f"--cases: unknown {sorted(wanted - set(known))}; expected among {known}")
    if not a.bind_clients:
        wanted.discard("bind8")
    cases = [c for c in known if c in wanted or c == "synthetic"]
    seconds = a.seconds or (30.0 if a.quick else 60.0)
    runs = a.runs or (1 if a.quick else 3)
    if a.quick:  # small batches: a loaded machine still completes several per case
        a.synthetic_batch = min(a.synthetic_batch, 200_000)
        a.rate_batch = min(a.rate_batch, 200_000)
        a.max_backlog = a.max_backlog or 200_000
    # Direct mode has no maxBacklog (the producer's window bounds it): in a quick run
    # its batches are cut as the others' are.
    direct_options = dict(options)
    if a.quick:
        direct_options.setdefault("maxRecordsPerTrigger", "200000")
    counts: list[int] = []
    if a.scale:
        try:
            counts = [int(n) for n in a.scale.split(",")]
        except ValueError:
            ap.error(f"--scale {a.scale!r}: expected a comma-separated list of integers")
        if not counts or min(counts) < 1 or max(counts) > 32:
            ap.error(f"--scale {a.scale!r}: expected counts from 1 to 32 (bounded load)")
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    conf = {"spark.sql.streaming.numRecentProgressUpdates": "100000"}
    with spark_run("bench-steady", conf) as (spark, work):
        spark.dataSource.register(_Steady)
        # Warm-up, not counted: the first use of the Python data source machinery (worker
        # start, imports) would land on whichever case runs first.
        warm = spark.readStream.format("zio_bench_steady").option("maxBatch", "10000").load()
        _warm_up(warm, work)
        if counts:
            _scale(spark, work, a, counts, runs, seconds)
            return
        pb = a.producer_batch
        for i in range(runs):
            syn = (
                spark.readStream.format("zio_bench_steady")
                .option("maxBatch", str(a.synthetic_batch))
                .load()
            )
            res["synthetic"].append(_measure(spark, syn, work, seconds, []))
            if "rate" in cases:
                rate = (
                    spark.readStream.format("rate-micro-batch")
                    .option("rowsPerBatch", str(a.rate_batch))
                    .load()
                )
                res["rate"].append(_measure(spark, rate, work, seconds, []))
            if "zio" in cases:
                res["zio"].append(
                    _zio(
                        spark,
                        work,
                        seconds,
                        a.window,
                        a.max_backlog,
                        options,
                        batch=pb,
                        window_bytes=a.window_bytes,
                    )
                )
            if "direct" in cases:
                res["direct"].append(
                    _zio(
                        spark,
                        work,
                        seconds,
                        a.window,
                        0,
                        direct_options,
                        direct=True,
                        batch=pb,
                        window_bytes=a.window_bytes,
                    )
                )
            if "bind8" in cases:
                res["bind8"].append(_bind(spark, work, seconds, a.bind_clients))
            print(
                f"round {i}: "
                + ", ".join(
                    f"{c} {r[-1]['rows_per_s']:,.0f}/s "
                    f"({r[-1]['rows_per_s'] / max(r[-1]['triggers_per_s'], 1e-9):,.0f}/trigger"
                    + (
                        f", producer on a full window {r[-1]['producer_window_full_share']:.0%}"
                        if "producer_window_full_share" in r[-1]
                        else ""
                    )
                    + ")"
                    for c, r in res.items()
                )
                + f"; load {[r[-1]['load_1m'] for r in res.values()]}",
                flush=True,
            )
    _report(a, res, cases, options, seconds, runs)


def _report(
    a: argparse.Namespace,
    res: dict[str, list[dict[str, Any]]],
    cases: list[str],
    options: dict[str, str],
    seconds: float,
    runs: int,
) -> None:
    def series(case: str, key: str) -> list[float]:
        return [r[key] for r in res[case]]

    def cpu(case: str, role: str) -> list[float]:
        return [r["cpu_s_per_million"].get(role, 0.0) for r in res[case]]

    anchors = [c for c in ("synthetic", "rate") if c in cases]
    figures = {
        c: {
            "rows_per_s": spread(series(c, "rows_per_s")),
            "first_row_s": spread(series(c, "first_row_s")),
            "triggers_per_s": spread(series(c, "triggers_per_s")),
            "cpu_s_per_million": {
                role: spread(cpu(c, role))
                for role in sorted({k for r in res[c] for k in r["cpu_s_per_million"]})
            },
            "ms_per_trigger": {
                k: spread([r["ms_per_trigger"].get(k, 0.0) for r in res[c]])
                for k in sorted({k for r in res[c] for k in r["ms_per_trigger"]})
            },
            "load_1m": series(c, "load_1m"),
        }
        for c in cases
    }
    ours = [c for c in cases if c not in anchors]
    ratios = {
        f"{c}_vs_{anchor}": ratio_spread(series(c, "rows_per_s"), series(anchor, "rows_per_s"))
        for c in ours
        for anchor in anchors
    }
    # CPU against the anchor of the same round: the Spark side's ratio, the driver's
    # excess (CPU-s per million rows beyond the synthetic source's own).
    for c in ours:
        ratios[f"{c}_spark_side_cpu_vs_synthetic"] = ratio_spread(
            cpu(c, "spark side"), cpu("synthetic", "spark side")
        )
        ratios[f"{c}_driver_cpu_minus_synthetic"] = spread(
            [
                x - y
                for x, y in zip(
                    cpu(c, "driver"),
                    cpu("synthetic", "driver"),
                    strict=True,
                )
            ]
        )
    targets: dict[str, bool] = {}
    first_gap = None
    if "zio" in cases:
        first_gap = spread(
            [
                z - s
                for z, s in zip(
                    series("zio", "first_row_s"), series("synthetic", "first_row_s"), strict=True
                )
            ]
        )
        targets["zio >= 0.8x synthetic"] = ratios["zio_vs_synthetic"]["median"] >= 0.8
        targets["first row within 1 s of synthetic"] = first_gap["median"] <= 1.0
    if "direct" in cases:
        targets["direct >= 0.6x synthetic"] = ratios["direct_vs_synthetic"]["median"] >= 0.6
        targets["direct Spark-side CPU <= 1.3x synthetic"] = (
            ratios["direct_spark_side_cpu_vs_synthetic"]["median"] <= 1.3
        )
        targets["direct driver CPU <= synthetic + 0.05 CPU-s per 1M rows"] = (
            ratios["direct_driver_cpu_minus_synthetic"]["median"] <= 0.05
        )
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
            "producer_batch": a.producer_batch or "default",
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
        "zio": "zio (spool), producer process, Arrow DATs",
        "direct": "zio readMode=direct, same producer",
        "bind8": f"zio bind, {a.bind_clients} plain clients, 1 record/DAT",
    }
    shown = (
        "driver JVM",
        "JVM driver threads",
        "JVM stream thread",
        "python workers",
        "source runner",
        "producers",
        "spark side",
        "driver",
    )
    print()
    print(
        md_table(
            [
                "source",
                "rows/s, 2nd half",
                "vs synthetic",
                "Spark-side CPU vs synthetic",
                "driver CPU-s/1M beyond synthetic",
                "first row (s)",
                "CPU s per 1M rows (median)",
            ],
            [
                [
                    labels[c],
                    fmt_spread(f["rows_per_s"]),
                    "anchor"
                    if c in anchors
                    else fmt_spread(ratios[f"{c}_vs_synthetic"], "x", digits=3),
                    ""
                    if c in anchors
                    else fmt_spread(ratios[f"{c}_spark_side_cpu_vs_synthetic"], "x", digits=2),
                    ""
                    if c in anchors
                    else fmt_spread(ratios[f"{c}_driver_cpu_minus_synthetic"], digits=3),
                    fmt_spread(f["first_row_s"], digits=2),
                    ", ".join(
                        f"{role} {f['cpu_s_per_million'][role]['median']:.3f}"
                        for role in shown
                        if role in f["cpu_s_per_million"]
                    ),
                ]
                for c, f in figures.items()
            ],
        )
    )
    print()
    loads = [x for c in cases for pair in figures[c]["load_1m"] for x in pair]
    print(
        f"{runs} round(s) of {seconds:g} s, {os.cpu_count()} CPUs, load (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f}; "
        + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items())
    )


if __name__ == "__main__":
    main()
