"""``zio-spark demo``: the end-to-end main job on an embedded default.

Everything runs on this machine, on loopback: local Spark (``local[2]``), an in-process
ack-capable producer emitting detector-style readout frames, the ``zio`` source, a
windowed aggregation (frames and energy per detector per 100 ms of detector time, with a
watermark), the ``zio`` sink, and an in-process consumer that publishes committed
batches. A live view shows records in and out, backlog and rates; at the end a summary
checks exactly-once delivery (every frame counted once across the published windows, no
window published twice) and a PNG plot of throughput over time is written.

The stream ends with one *sentinel* frame stamped far after the data: it moves the
watermark past every real window, so append mode emits each of them exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

DETECTORS = 8
WINDOW_MS = 100
_HEAD = struct.Struct("<IQHH")  # frame id, t µs, detector, channel
_ADC = struct.Struct(">16H")  # 16 ADC samples, big-endian (sample 7 is the peak)
_PEAK_POS = _HEAD.size + 7 * 2 + 1  # 1-based position of sample 7 for Spark's substring


def make_frame(frame_id: int, t_us: int, rng: random.Random) -> tuple[bytes, bytes, int]:
    """One readout frame: (value, key = detector id, granule = detector time in µs)."""
    detector = frame_id % DETECTORS
    base = rng.randint(0, 200)
    peak = rng.randint(0, 4000)
    samples = [
        min(65535, base + (peak if 6 <= i <= 8 else peak // (1 + abs(i - 7)))) for i in range(16)
    ]
    value = _HEAD.pack(frame_id, t_us, detector, rng.randint(0, 63)) + _ADC.pack(*samples)
    return value, str(detector).encode(), t_us


@dataclass
class Samples:
    t: list[float] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    ingested: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)


def _check_java() -> str | None:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "java not found: Spark 4 needs Java 17 (apt-get install openjdk-17-jre-headless)"
    return None


# Spark's own words when a fresh Python worker did not connect back within its fixed limit
# (PythonWorkerFactory: 10 s in Spark 4.0-4.3, not configurable).
_WORKER_CONNECT_BACK = (
    "Python worker failed to connect back",
    "Timed out while waiting for the Python worker to connect back",
)
# No frame counter moved for this long: the demo is stuck, not slow (a busy machine slows
# every step; a stuck one stops them all).
STALL_S = 300.0


class DemoStalled(RuntimeError):
    """No frame was produced, ingested or published for ``STALL_S`` seconds."""


def _texts(exc: BaseException) -> list[str]:
    """The messages of ``exc`` and of every exception it was raised from or during."""
    out: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            out.append(str(e))
        except Exception:  # a Py4J error whose JVM is gone cannot always render itself
            out.append(repr(e))
        e = e.__cause__ or e.__context__
    return out


def worker_start_timed_out(exc: BaseException) -> bool:
    """Did Spark give up on a Python worker that did not connect back in time?"""
    return any(m in t for t in _texts(exc) for m in _WORKER_CONNECT_BACK)


def explain_worker_timeout(work: str) -> str:
    """One paragraph for the user: what happened, why, and what to do."""
    from zio_spark.cli.precompile import check_zip, find_zips

    zips = [z for z in find_zips() if z.name == "pyspark.zip"]
    states = [check_zip(z) for z in zips]
    if states and all(st.precompiled for st in states):
        zip_note = "pyspark.zip is already precompiled for this Python, so the machine is"
        zip_note += " simply too busy right now"
    else:
        zip_note = (
            f"pyspark.zip is not precompiled for this Python: run `{sys.executable} -m "
            f"zio_spark.cli.precompile` (scripts/setup.sh does it), which halves the "
            f"worker's start"
        )
    try:
        load = f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except OSError:
        load = f"{os.cpu_count()} cores"
    return (
        "zio-spark demo: Spark stopped the query before any zio-spark code ran: a Python "
        "worker it started did not connect back to the JVM within Spark's fixed 10 s "
        f"start-up limit (`Python worker failed to connect back`; {load}). The worker "
        "spends that time importing pyspark, and on a busy machine that can take longer "
        f"than 10 s. Nothing is wrong with your data or setup; {zip_note}. Then run the "
        f"demo again, when fewer processes compete for the CPU. The work folder {work} "
        "has been removed."
    )


def run_demo(args: argparse.Namespace) -> int:
    problem = _check_java()
    if problem:
        print(f"zio-spark demo: {problem}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="zio-spark-demo-")
    try:
        return _demo(args, work)
    except DemoStalled as e:
        print(f"zio-spark demo: {e}; the work folder {work} has been removed", file=sys.stderr)
        return 1
    except Exception as e:
        if not worker_start_timed_out(e):
            raise
        print(explain_worker_timeout(work), file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _demo(args: argparse.Namespace, work: str) -> int:
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

    import zmq
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from zio_spark.sink.consumer import Consumer
    from zio_spark.source.producer import Producer

    console = Console(stderr=True)
    # The runner goes away with the query, so the producer's closing EOT has nobody to
    # answer it; that is expected here and not worth a warning on the demo's screen.
    logging.getLogger("zio_spark").setLevel(logging.ERROR)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    n = args.records
    # Whatever fails on the way (a worker that never connects back fails load() or the
    # query), everything started so far is stopped: last started, first stopped.
    with contextlib.ExitStack() as cleanup:
        ctx = zmq.Context()
        cleanup.callback(ctx.term)
        console.print(f"[bold]zio-spark demo[/]: {n} frames, work folder {work}")

        spark = (
            SparkSession.builder.master("local[2]")
            .appName("zio-spark-demo")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        cleanup.callback(spark.stop)
        spark.sparkContext.setLogLevel("ERROR")
        producer = Producer(ctx=ctx, producer_id="demo-daq", stream="demo", max_unacked=n + 10)
        cleanup.callback(producer.close, timeout=1, flush=False)
        consumer = Consumer("tcp://127.0.0.1:*", os.path.join(work, "consumer"), ctx=ctx)
        cleanup.callback(consumer.close)
        samples = Samples()
        stop_feed = threading.Event()
        cleanup.callback(stop_feed.set)
        t0 = time.monotonic()
        start_us = 1_700_000_000_000_000

        def feed() -> None:
            rng = random.Random(42)
            begun = time.monotonic()
            sent = 0
            chunk = 1000
            while sent < n and not stop_feed.is_set():
                k = min(chunk, n - sent)
                if args.rate:
                    delay = begun + (sent + k) / args.rate - time.monotonic()
                    if delay > 0 and stop_feed.wait(delay):
                        return
                frames = [make_frame(i, start_us + i * 20, rng) for i in range(sent, sent + k)]
                producer.send_many(
                    [f[0] for f in frames],
                    keys=[f[1] for f in frames],
                    granules=[f[2] for f in frames],
                )
                sent += k
            # The sentinel: far after the data, so the watermark passes every real window.
            value, _key, _ = make_frame(n, start_us, random.Random(0))
            producer.send(value, key=b"sentinel", granule=start_us + n * 20 + 3_600_000_000)

        frames = (
            spark.readStream.format("zio")
            .option("endpoints", producer.endpoint)
            .option("stream", "demo")
            .option("spoolPath", os.path.join(work, "spool"))
            .option("maxRecordsPerTrigger", "50000")
            .option("spoolServerHost", "127.0.0.1")
            .load()
        )
        readings = frames.select(
            F.col("key").cast("string").alias("detector"),
            F.timestamp_micros("granule").alias("t"),
            F.conv(F.hex(F.substring("value", _PEAK_POS, 2)), 16, 10).cast("long").alias("adc7"),
        )
        windows = (
            readings.withWatermark("t", "1 second")
            .groupBy(F.window("t", f"{WINDOW_MS} milliseconds"), "detector")
            .agg(F.count("*").alias("frames"), F.sum("adc7").alias("energy"))
            .select(
                F.to_json(
                    F.struct(
                        F.unix_millis(F.col("window.start")).alias("start"),
                        "detector",
                        "frames",
                        "energy",
                    )
                ).alias("value")
            )
        )
        query = (
            windows.writeStream.format("zio")
            .outputMode("append")
            .option("endpoint", consumer.endpoint)
            .option("stream", "windows")
            .option("checkpointLocation", os.path.join(work, "checkpoint"))
            .trigger(processingTime="500 milliseconds")
            .start()
        )
        feeder = threading.Thread(target=feed, name="demo-feed", daemon=True)
        feeder.start()

        published: dict[tuple[int, str], tuple[int, int]] = {}
        rows_by_batch: dict[int, int] = {}
        duplicates = 0
        ingested = 0

        def collect() -> None:
            nonlocal duplicates
            for stream, batch in consumer.published("windows"):
                for rb in consumer.read(stream, batch):
                    for raw in rb.column("value").to_pylist():
                        w = json.loads(raw)
                        k = (int(w["start"]), str(w["detector"]))
                        if k in published:
                            duplicates += 1
                        published[k] = (int(w["frames"]), int(w["energy"] or 0))
                consumer.ack(stream, batch)

        def view() -> Table:
            table = Table(title="zio-spark demo (local Spark, loopback)")
            for col in (
                "elapsed s",
                "produced",
                "acked",
                "ingested",
                "published frames",
                "windows",
            ):
                table.add_column(col, justify="right")
            table.add_row(
                f"{time.monotonic() - t0:.1f}",
                str(producer.last_seq),
                str(producer.acked),
                str(ingested),
                str(sum(v[0] for v in published.values())),
                str(len(published)),
            )
            return table

        ok = False
        last_moved = time.monotonic()
        moved_at: tuple[int, ...] = ()
        try:
            with Live(
                view(),
                console=console,
                refresh_per_second=4,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            ) as live:
                while True:
                    if query.exception() is not None:
                        raise RuntimeError(f"query failed: {query.exception()}")
                    for p in query.recentProgress:
                        rows_by_batch[int(p.batchId)] = int(p.numInputRows)
                    ingested = sum(rows_by_batch.values())
                    collect()
                    samples.t.append(time.monotonic() - t0)
                    samples.produced.append(producer.last_seq)
                    samples.ingested.append(ingested)
                    samples.published.append(sum(v[0] for v in published.values()))
                    if not args.no_progress:
                        live.update(view())
                    if sum(v[0] for v in published.values()) >= n:
                        ok = True
                        break
                    # Decided by progress, not by the clock: any counter that moves (frames
                    # sent, acknowledged, ingested, published) shows the pipeline is alive.
                    counters = (producer.last_seq, producer.acked, ingested, len(published))
                    if counters != moved_at:
                        moved_at, last_moved = counters, time.monotonic()
                    elif time.monotonic() - last_moved > STALL_S:
                        raise DemoStalled(
                            f"no progress for {STALL_S:g} s: produced {producer.last_seq}, "
                            f"acknowledged {producer.acked}, ingested {ingested}, published "
                            f"{sum(v[0] for v in published.values())} of {n} frames; query "
                            f"status {query.status}"
                        )
                    time.sleep(0.25)
        finally:
            stop_feed.set()
            query.stop()
            collect()

    total = sum(v[0] for v in published.values())
    exact = ok and total == n and duplicates == 0
    elapsed = samples.t[-1] if samples.t else 0.0
    plot = os.path.join(out_dir, "demo-throughput.png")
    _plot(samples, plot)
    summary = {
        "command": "demo",
        "frames": n,
        "published_frames": total,
        "windows": len(published),
        "duplicate_windows": duplicates,
        "exactly_once": exact,
        "seconds": round(elapsed, 2),
        "plot": plot,
    }
    with open(os.path.join(out_dir, "demo-summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    verdict = (
        "[green]exactly once: every frame counted once[/]"
        if exact
        else (f"[red]NOT exactly once: {total} of {n} frames, {duplicates} duplicate windows[/]")
    )
    console.print(verdict)
    console.print(f"plot: {plot}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0 if exact else 1


def _plot(s: Samples, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(s.t, s.produced, label="produced (records)")
    ax.plot(s.t, s.ingested, label="ingested by Spark")
    ax.plot(s.t, s.published, label="published frames (in windows)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("cumulative records")
    ax.set_title("zio-spark demo: producer → Spark (zio source) → windows → zio sink")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
