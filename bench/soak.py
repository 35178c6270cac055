"""Soak: a producer feeding a slow streaming query for ``--minutes``; RSS sampled; growth.

Processes (all on this host, loopback only):

- **producer**: a child process (this script with ``--role producer``) running a
  :class:`~zio_spark.source.producer.Producer`. It offers records of ``--value-bytes``
  as fast as the flow lets it (its buffer holds at most ``--max-unacked`` records), so the
  query's pace, not the producer's, sets the rate: backpressure is exercised end to end
  (slow foreachBatch -> receiver backlog at ``maxBacklog`` -> no PAY -> producer blocks).
- **driver**: this process; a local[2] SparkSession reading ``format("zio")`` with
  ``maxRecordsPerTrigger``, written with a slow ``foreachBatch`` (a count, then a sleep of
  ``--batch-sleep`` seconds).
- **jvm**: the Spark JVM (pid asked from the JVM itself), with ``spark.driver.memory``
  ``--driver-memory`` (default 1g: with the default heap bound, a quarter of RAM, the heap
  just grows lazily between collections and RSS says nothing about leaks).
- **workers**: every Python process descending from the JVM (the daemon, its forked
  workers, the streaming source runner, planners): their RSS summed (``workers``), and
  the largest one (``worker_max``).

Every ``--interval`` seconds the RSS (``VmRSS`` from ``/proc/<pid>/status``) of each is
sampled. The first ``--warmup`` fraction of the run is discarded; growth is
``(median of the last 10 % of samples - median of the first 10 % after warm-up) /
the latter``, per process. Outputs in ``--out``: ``soak.json`` (parameters, per-process
start/end/growth, throughput, every sample) and ``soak.csv`` (samples); a Markdown table
is printed. Exit code: 0 when every growth is within ``--max-growth`` (default 10 %),
1 when one is over, 2 on an error (the query failed, the producer died, ...).

Run: ``.venv/bin/python bench/soak.py --minutes 10`` (``--minutes 0.5`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PROCESSES = ("driver", "jvm", "workers", "worker_max", "producer")


# ------------------------------------------------------------------ /proc helpers


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None
    return 0  # a zombie has no VmRSS line


def _ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: split after the last ")".
        rest = stat[stat.rfind(")") + 2 :].split()
        with contextlib.suppress(IndexError, ValueError):
            out[int(name)] = int(rest[1])
    return out


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppid_map().items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _is_python(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
    except OSError:
        return False
    return b"python" in os.path.basename(argv0)


def sample(driver: int, jvm: int | None, producer: int) -> dict[str, int | None]:
    """One RSS sample (KiB) of every tracked process."""
    workers: list[int] = []
    if jvm is not None:
        for pid in descendants(jvm):
            if _is_python(pid):
                r = rss_kib(pid)
                if r:
                    workers.append(r)
    return {
        "driver": rss_kib(driver),
        "jvm": None if jvm is None else rss_kib(jvm),
        "workers": sum(workers) if workers else None,
        "worker_max": max(workers) if workers else None,
        "worker_count": len(workers),
        "producer": rss_kib(producer),
    }


def growth(values: list[float], warmup: float) -> dict[str, Any]:
    """Growth of a series after discarding the first ``warmup`` fraction of samples.

    ``(median(last 10 %) - median(first 10 % after warm-up)) / median(first ...)``; each
    window holds at least one sample.
    """
    n = len(values)
    if n == 0:
        return {"samples": 0}
    skip = int(n * warmup)
    kept = values[skip:] or values[-1:]
    w = max(1, round(n * 0.10))
    first = statistics.median(kept[:w])
    last = statistics.median(kept[-w:])
    return {
        "samples": n,
        "used": len(kept),
        "window": w,
        "start_kib": first,
        "end_kib": last,
        "min_kib": min(kept),
        "max_kib": max(kept),
        "growth_pct": (last - first) / first * 100 if first else None,
    }


# ------------------------------------------------------------------ producer child


def run_producer(args: argparse.Namespace) -> int:
    from zio_spark.source.producer import Producer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    prod = Producer(
        "tcp://127.0.0.1:*",
        producer_id="soak",
        linger_ms=0,
        max_unacked=args.max_unacked,
        batch=1000,
    )
    print(prod.endpoint, flush=True)
    value = b"v" * args.value_bytes
    chunk = [value] * 1000
    sent = 0
    blocked = 0
    try:
        while not stop.is_set():
            try:
                prod.send_many(chunk, timeout=0.5)
                sent += len(chunk)
            except Exception as e:  # window full for 0.5 s: the query is behind
                if "window full" not in str(e):
                    raise
                blocked += 1
    finally:
        stats = {
            "last_seq": prod.last_seq,
            "acked": prod.acked,
            "pending": prod.pending,
            "blocked_waits": blocked,
            **{k: int(v) for k, v in prod.stats.items()},
        }
        prod.close(flush=False, timeout=5)
        Path(args.producer_stats).write_text(json.dumps(stats))
    return 0


# ------------------------------------------------------------------ driver


def _start_producer(
    args: argparse.Namespace, stats_path: Path
) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        "producer",
        "--value-bytes",
        str(args.value_bytes),
        "--max-unacked",
        str(args.max_unacked),
        "--producer-stats",
        str(stats_path),
    ]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    # Bounded wait for the endpoint line (the child prints it once bound).
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(60)
    if not box or not box[0].startswith("tcp://"):
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"producer child did not report its endpoint: {box!r}")
    return proc, box[0].strip()


def _stop_producer(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_driver(args: argparse.Namespace) -> int:
    from common import spark_session

    os.environ.setdefault("ZIO_SPOOL_SERVER_HOST", "127.0.0.1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zio-soak-"))
    duration = args.minutes * 60.0
    samples: list[dict[str, Any]] = []
    batches: list[tuple[int, int]] = []
    error: str | None = None
    startup_s: float | None = None
    prod_stats: dict[str, Any] = {}
    t_start = time.monotonic()
    producer, endpoint = _start_producer(args, work / "producer-stats.json")
    spark = None
    query = None
    try:
        spark = spark_session(
            "zio-soak",
            {
                "spark.driver.memory": args.driver_memory,
                # The heap committed and touched up front: RSS growth is then what is
                # allocated beyond it (a leak), not the JVM sizing its heap up lazily.
                "spark.driver.extraJavaOptions": (
                    f"-Xms{args.driver_memory} -XX:+AlwaysPreTouch" if args.fixed_heap else ""
                ),
            },
        )
        jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        driver_pid = os.getpid()

        def slow(batch_df: Any, batch_id: int) -> None:
            n = batch_df.count()
            batches.append((batch_id, n))
            time.sleep(args.batch_sleep)

        df = (
            spark.readStream.format("zio")
            .option("endpoints", endpoint)
            .option("spoolPath", str(work / "spool"))
            .option("spoolServerHost", "127.0.0.1")
            .option("maxRecordsPerTrigger", str(args.max_records_per_trigger))
            .option("maxBacklog", str(args.max_backlog))
            .option("connectTimeout", "60s")
            .load()
        )
        query = (
            df.writeStream.foreachBatch(slow)
            .option("checkpointLocation", str(work / "checkpoint"))
            .start()
        )
        # The measured window starts with the first rows, not with start(): on a busy
        # machine the query's start-up alone can outlast a short run.
        started = time.monotonic()
        while not any(n for _, n in batches):
            if query.exception() is not None:
                raise RuntimeError(f"query failed before its first rows: {query.exception()}")
            if producer.poll() is not None:
                raise RuntimeError(f"producer exited with {producer.returncode}")
            if time.monotonic() - started > args.startup_timeout:
                raise RuntimeError(f"no rows {args.startup_timeout:g} s after the query started")
            time.sleep(0.2)
        startup_s = round(time.monotonic() - started, 1)
        t0 = time.monotonic()
        deadline = t0 + duration
        next_sample = t0
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            if query.exception() is not None:
                raise RuntimeError(f"query failed: {query.exception()}")
            if not query.isActive:
                raise RuntimeError("query stopped on its own")
            if producer.poll() is not None:
                raise RuntimeError(f"producer exited with {producer.returncode}")
            if now >= next_sample:
                s: dict[str, Any] = {"t": round(now - t0, 3)}
                s.update(sample(driver_pid, jvm_pid, producer.pid))
                s["rows"] = sum(n for _, n in batches)
                s["batches"] = len(batches)
                samples.append(s)
                if args.verbose:
                    print(json.dumps(s), flush=True)
                next_sample += args.interval
            time.sleep(min(0.2, max(0.0, next_sample - time.monotonic())))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        if query is not None:
            with contextlib.suppress(Exception):
                query.stop()
        _stop_producer(producer)
        with contextlib.suppress(FileNotFoundError, ValueError):
            prod_stats = json.loads((work / "producer-stats.json").read_text())
        if spark is not None:
            with contextlib.suppress(Exception):
                spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    rows = sum(n for _, n in batches)
    elapsed = samples[-1]["t"] if samples else 0.0
    result: dict[str, Any] = {
        "parameters": {
            k: v for k, v in vars(args).items() if k not in ("role", "producer_stats", "out")
        },
        "elapsed_s": elapsed,
        "wall_s": round(time.monotonic() - t_start, 1),
        "startup_s": startup_s,
        "batches": len(batches),
        "rows": rows,
        "rows_per_s": rows / elapsed if elapsed else 0.0,
        "producer": prod_stats,
        "error": error,
        "growth": {},
        "samples": samples,
    }
    over: list[str] = []
    for name in PROCESSES:
        series = [float(s[name]) for s in samples if s.get(name)]
        g = growth(series, args.warmup)
        result["growth"][name] = g
        pct = g.get("growth_pct")
        # worker_max is a diagnostic (workers are forked and recycled), not a target.
        if name != "worker_max" and pct is not None and pct > args.max_growth:
            over.append(name)
    result["over_limit"] = over
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    fields = ["t", "driver", "jvm", "workers", "worker_max", "worker_count", "producer"]
    fields += ["rows", "batches"]
    with open(out / "soak.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(samples)

    print(
        f"soak: {elapsed:.0f} s sampled every {args.interval:g} s ({len(samples)} samples), "
        f"warm-up {args.warmup:.0%} discarded; {len(batches)} batches, {rows:,} rows "
        f"({result['rows_per_s']:,.0f} rows/s); producer blocked "
        f"{prod_stats.get('blocked_waits', '?')} x 0.5 s on a full buffer"
    )
    print()
    print("| process | RSS start (MiB) | RSS end (MiB) | min-max (MiB) | growth |")
    print("|---|---|---|---|---|")
    for name in PROCESSES:
        g = result["growth"][name]
        if not g.get("samples"):
            print(f"| {name} | - | - | - | no samples |")
            continue
        pct = g["growth_pct"]
        print(
            f"| {name} | {g['start_kib'] / 1024:.1f} | {g['end_kib'] / 1024:.1f} | "
            f"{g['min_kib'] / 1024:.1f}-{g['max_kib'] / 1024:.1f} | "
            f"{'-' if pct is None else f'{pct:+.1f} %'} |"
        )
    print()
    if error is not None:
        print(f"soak: ERROR {error}", file=sys.stderr)
        return 2
    if over:
        print(f"soak: growth over {args.max_growth:g} % for {', '.join(over)}", file=sys.stderr)
        return 1
    print(f"soak: every growth within {args.max_growth:g} %")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="sampled run time (default 10)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of samples discarded")
    p.add_argument("--max-growth", type=float, default=10.0, help="limit in percent")
    p.add_argument("--batch-sleep", type=float, default=1.0, help="foreachBatch sleep, s")
    p.add_argument("--max-records-per-trigger", type=int, default=20_000)
    p.add_argument("--max-backlog", type=int, default=100_000)
    p.add_argument("--max-unacked", type=int, default=50_000)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument(
        "--driver-memory",
        default="1g",
        help="spark.driver.memory (the JVM heap bound; unbounded default heaps grow lazily)",
    )
    p.add_argument(
        "--fixed-heap",
        action="store_true",
        help="start the JVM with its whole heap committed and touched (-Xms = driver "
        "memory, AlwaysPreTouch), so heap sizing does not show as RSS growth",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds from the query's start to its first rows before it is an error",
    )
    p.add_argument("--out", default="bench/results/soak")
    p.add_argument("--verbose", action="store_true", help="print every sample")
    p.add_argument(
        "--role", choices=("driver", "producer"), default="driver", help=argparse.SUPPRESS
    )
    p.add_argument("--producer-stats", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "producer":
        return run_producer(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
