"""Benchmark of the PZQ-style queue (not a test).

Durable, acknowledged throughput of 1 KiB messages through a queue broker running in its
own process (``python -m zio_spark.cli.queue``), with raw pyzmq clients written from
the spec in other processes:

- ``produce``: producers (DEALER, a window of unacked messages each) into an empty queue
  with no consumer; a message counts once the queue has acked it (after its fsync).
- ``consume``: one consumer (ROUTER, acking every delivery) drains what ``produce`` left.
- ``e2e``: producers and the consumer at once; the clock stops when the consumer has
  received every message.
- ``window1``: one producer with a window of 1, so every message is its own commit: the
  group-commit effect is ``produce`` / ``window1``.

``--sync-producer``: only the case of one synchronous producer (send one message, wait
for its ack; 100 B by default), against a bare ``os.write`` + ``os.fdatasync`` loop of the
same size, one record per sync, and against a *minimal queue* (a Python ROUTER in its own
process that appends each message, ``fdatasync``s and acks: the two ZeroMQ hops and the
sync, nothing else), each run right before each queue run (paired: this machine's disk
rates drift between minutes): ratios = queue / anchor, the median of the pairs.

Anchors measured in the same run, on the same disk: raw ``os.write`` + ``os.fdatasync``
of the same bytes, 1 record per sync and ``--window`` records per sync. With
``--store-only``, also the store alone in-process against sqlite3 (WAL,
synchronous=FULL), same batches: the measurement behind the store's design.

    .venv/bin/python bench/bench_queue.py [--messages 200000] [--producers 2]
        [--window 1000] [--size 1024] [--repeat 3] [--store-only] [--out DIR]

Writes ``DIR/queue.json`` (every run) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from common import fmt_spread, machine, md_table, ratio_spread, spread, write_json  # noqa: E402

from zio_spark.storage.store import MessageStore  # noqa: E402

# ---------------------------------------------------------------------- broker process


def start_broker(store: Path, inflight: int, hwm: int) -> tuple[subprocess.Popen[str], dict]:
    cmd = [
        sys.executable,
        "-m",
        "zio_spark.cli.queue",
        "--store",
        str(store),
        "--receive",
        "tcp://127.0.0.1:*",
        "--send",
        "tcp://127.0.0.1:*",
        "--monitor",
        "tcp://127.0.0.1:*",
        "--inflight",
        str(inflight),
        "--hwm",
        str(hwm),
        "--ack-timeout",
        "60s",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    info: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line == "ready":
            return proc, info
        key, _, value = line.partition(": ")
        info[key] = value
    raise RuntimeError(f"broker exited with {proc.wait()}")


def stop_broker(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def monitor(endpoint: str) -> dict[str, str]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.linger = 0
    s.connect(endpoint)
    s.send(b"MONITOR")
    if not s.poll(10_000):
        raise RuntimeError("monitor did not answer")
    text = s.recv().decode()
    s.close()
    return dict(line.split(": ", 1) for line in text.splitlines() if line)


# ---------------------------------------------------------------------- clients

# Lean client I/O, as a performance-minded client would write it: pyzmq's
# send_multipart/recv_multipart spend most of their time on enum flag arithmetic.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    for frame in frames[:-1]:
        _send(sock, frame, 2)  # SNDMORE
    _send(sock, frames[-1], 0)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    frame = _recv(sock, 1, False)  # NOBLOCK, as a Frame (to read ``more``)
    parts = [frame.bytes]
    while frame.more:
        frame = _recv(sock, 1, False)
        parts.append(frame.bytes)
    return parts


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def producer(endpoint: str, prefix: str, n: int, size: int, window: int, out: mp.Queue) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndhwm = s.rcvhwm = 0
    s.connect(endpoint)
    body = os.urandom(size)
    ids = [f"{prefix}-{i}".encode() for i in range(n)]
    sent = acked = failed = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while acked < n:
        while sent < n and sent - acked < window:
            send_frames(s, [ids[sent], b"", body])
            sent += 1
        if not s.poll(30_000):
            raise RuntimeError(f"producer {prefix}: no ack for 30 s ({acked}/{n})")
        while True:
            try:
                frames = recv_frames(s)
            except zmq.Again:
                break
            acked += 1
            if frames[1] != b"1":
                failed += 1
    out.put((prefix, n, time.perf_counter() - t0, failed, time.process_time() - c0))
    s.close()
    ctx.term()


def consumer(endpoint: str, n: int, out: mp.Queue, ready: mp.Event) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.probe_router = 1
    s.sndhwm = s.rcvhwm = 0
    s.connect(endpoint)
    ready.set()
    seen: set[bytes] = set()
    got = 0
    t0 = None
    c0 = time.process_time()
    while len(seen) < n:
        if not s.poll(30_000):
            raise RuntimeError(f"consumer: nothing for 30 s ({len(seen)}/{n})")
        if t0 is None:
            t0 = time.perf_counter()
        while True:
            try:
                frames = recv_frames(s)
            except zmq.Again:
                break
            if len(frames) < 6:
                continue
            send_frames(s, [frames[0], frames[1], b"1"])
            seen.add(frames[1])
            got += 1
    out.put(("consumer", got, time.perf_counter() - (t0 or 0), 0, time.process_time() - c0))
    s.close()
    ctx.term()


def run_clients(
    info: dict,
    producers: int,
    n: int,
    size: int,
    window: int,
    consume: bool,
    produce: bool,
    broker_pid: int,
) -> dict[str, float]:
    mpctx = mp.get_context("spawn")
    out: mp.Queue = mpctx.Queue()
    ready = mpctx.Event()
    procs = []
    if consume:
        procs.append(mpctx.Process(target=consumer, args=(info["send"], n, out, ready)))
        procs[-1].start()
        ready.wait(30)
    t0 = time.perf_counter()
    b0 = cpu_seconds(broker_pid)
    if produce:
        per = n // producers
        for i in range(producers):
            procs.append(
                mpctx.Process(
                    target=producer,
                    args=(info["receive"], f"p{i}-{time.time_ns()}", per, size, window, out),
                )
            )
            procs[-1].start()
    results = [out.get(timeout=600) for _ in procs]
    elapsed = time.perf_counter() - t0
    broker_cpu = cpu_seconds(broker_pid) - b0
    for p in procs:
        p.join(60)
    if sum(r[3] for r in results):
        raise RuntimeError(f"{sum(r[3] for r in results)} messages were refused")
    return {
        "rate": n / elapsed,
        "broker_us": broker_cpu / n * 1e6,
        "clients_us": sum(r[4] for r in results) / n * 1e6,
    }


# ---------------------------------------------------------------------- anchors


def anchor(
    folder: Path, size: int, per_sync: int, records: int, preallocated: bool = False
) -> float:
    """Raw append + fdatasync, records/s; with ``preallocated``, the same writes into a
    file ``posix_fallocate``d beforehand (what the store does with its segments), so the
    sync does not change the file's size."""
    path = folder / f"anchor-{per_sync}.bin"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (0 if preallocated else os.O_APPEND)
    fd = os.open(path, flags, 0o644)
    chunk = os.urandom(size * per_sync)
    if preallocated:
        os.posix_fallocate(fd, 0, len(chunk) * (records // per_sync + 1))
        os.fsync(fd)
    t0 = time.perf_counter()
    done = 0
    while done < records:
        os.write(fd, chunk)
        os.fdatasync(fd)
        done += per_sync
    rate = done / (time.perf_counter() - t0)
    os.close(fd)
    path.unlink()
    return rate


def _minimal_queue(folder: str, ready: Any, stop_after: int) -> None:
    """The least a queue over ZeroMQ with one fsync per message can do, in Python: a ROUTER
    that appends each message (id + body) to a file, ``fdatasync``s it and acks ``1``.
    No index, no dedup, no delivery: only the two ZeroMQ hops and the sync. Serves
    ``stop_after`` messages, then exits (bounded by itself)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    port = s.bind_to_random_port("tcp://127.0.0.1")
    fd = os.open(Path(folder) / "minimal.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ready.put(port)
    for _ in range(stop_after):
        if not s.poll(60_000):
            break
        ident, message_id, _, body = recv_frames(s)
        os.write(fd, b"".join((len(message_id).to_bytes(2, "little"), message_id, body)))
        os.fdatasync(fd)
        send_frames(s, [ident, message_id, b"1"])
    os.close(fd)
    s.close()
    ctx.term()


def minimal_queue(folder: Path, size: int, n: int) -> float:
    """One synchronous producer against :func:`_minimal_queue` in its own process, msgs/s."""
    mpctx = mp.get_context("spawn")
    ready = mpctx.Queue()
    out = mpctx.Queue()
    server = mpctx.Process(target=_minimal_queue, args=(str(folder), ready, n))
    server.start()
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None:
            try:
                port = ready.get(timeout=1)
            except Exception:  # queue.Empty
                if not server.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the minimal queue did not start (exit code {server.exitcode})"
                    ) from None
        client = mpctx.Process(
            target=producer, args=(f"tcp://127.0.0.1:{port}", "min", n, size, 1, out)
        )
        client.start()
        _, count, seconds, failed, _ = out.get(timeout=600)
        client.join(60)
    finally:
        server.join(60)
        if server.is_alive():
            server.kill()
            server.join()
    (folder / "minimal.log").unlink(missing_ok=True)
    if failed:
        raise RuntimeError(f"minimal queue refused {failed} messages")
    return count / seconds


def store_only(folder: Path, n: int, size: int, batch: int) -> dict[str, float]:
    body = os.urandom(size)
    out: dict[str, float] = {}
    with MessageStore(folder / "store") as st:
        t0 = time.perf_counter()
        for i in range(n):
            st.put(b"m%d" % i, [body])
            if i % batch == batch - 1:
                st.commit()
        st.commit()
        out["log put+commit"] = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        k = 0
        while (m := st.take()) is not None:
            st.ack(m.key)
            k += 1
            if k % batch == 0:
                st.commit()
        st.commit()
        out["log take+ack"] = k / (time.perf_counter() - t0)
    db = sqlite3.connect(folder / "q.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE q (k INTEGER PRIMARY KEY, id BLOB UNIQUE, body BLOB)")
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO q (id, body) VALUES (?, ?)",
            ((b"m%d" % i, body) for i in range(start, min(n, start + batch))),
        )
        db.execute("COMMIT")
    out["sqlite insert"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    k = 0
    while True:
        rows = db.execute("SELECT k, id, body FROM q ORDER BY k LIMIT ?", (batch,)).fetchall()
        if not rows:
            break
        db.execute("BEGIN")
        db.executemany("DELETE FROM q WHERE k = ?", ((r[0],) for r in rows))
        db.execute("COMMIT")
        k += len(rows)
    out["sqlite select+delete"] = k / (time.perf_counter() - t0)
    db.close()
    return out


# ---------------------------------------------------------------------- main


def sync_producer(args: argparse.Namespace) -> None:
    """One synchronous producer vs the bare append+fdatasync loop, paired runs."""
    size = args.size if args.size != 1024 else 100
    n = args.window1_messages
    base = Path(tempfile.mkdtemp(prefix="bench-queue-sync-", dir=args.dir))
    print(
        f"# one synchronous producer, {n} messages of {size} B, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, {args.repeat} paired runs"
    )
    bare: list[float] = []
    bare_pre: list[float] = []
    minimal: list[float] = []
    queue: list[float] = []
    try:
        for r in range(args.repeat):
            bare.append(anchor(base, size, 1, n))
            bare_pre.append(anchor(base, size, 1, n, preallocated=True))
            minimal.append(minimal_queue(base, size, n))
            store = base / f"store-{r}"
            proc, info = start_broker(store, args.inflight, 100_000)
            try:
                res = run_clients(info, 1, n, size, 1, False, True, proc.pid)
            finally:
                stop_broker(proc)
            queue.append(res["rate"])
            shutil.rmtree(store, ignore_errors=True)
            print(
                f"run {r}: bare {bare[-1]:,.0f}/s, preallocated {bare_pre[-1]:,.0f}/s, "
                f"minimal queue {minimal[-1]:,.0f}/s, "
                f"queue {queue[-1]:,.0f}/s"
            )
        ratios = [q / b for q, b in zip(queue, bare, strict=True)]
        floor = [m / b for m, b in zip(minimal, bare, strict=True)]
        vs_min = [q / m for q, m in zip(queue, minimal, strict=True)]
        vs_pre = [q / b for q, b in zip(queue, bare_pre, strict=True)]
        pre_gain = [p / b for p, b in zip(bare_pre, bare, strict=True)]
        figures = {
            "bare append+fdatasync, 1 record/sync": {"msgs_per_s": spread(bare)},
            "bare write+fdatasync into a preallocated file, 1 record/sync": {
                "msgs_per_s": spread(bare_pre),
                "vs_bare": spread(pre_gain),
            },
            "minimal queue (ZeroMQ round trip + append+fdatasync), 1 sync producer": {
                "msgs_per_s": spread(minimal),
                "vs_bare": spread(floor),
            },
            "queue, one synchronous producer": {
                "msgs_per_s": spread(queue),
                "vs_bare": spread(ratios),
                "vs_bare_preallocated": spread(vs_pre),
                "vs_minimal_queue": spread(vs_min),
            },
        }
        write_json(
            args.out,
            "queue_sync.json",
            {
                "bench": "queue-sync-producer",
                "machine": machine(),
                "messages": n,
                "size": size,
                "runs": args.repeat,
                "unit": "msgs/s",
                "figures": figures,
                "targets_met": {
                    "sync producer >= 0.8x bare": statistics.median(ratios) >= 0.8,
                    "sync producer >= 0.8x minimal queue": statistics.median(vs_min) >= 0.8,
                },
            },
        )
        print()
        print(
            md_table(
                ["path", "msgs/s (median, min-max)", "vs bare loop", "vs minimal queue"],
                [
                    ["bare append+fdatasync, 1/sync", fmt_spread(spread(bare)), "anchor", ""],
                    [
                        "bare write+fdatasync, preallocated file",
                        fmt_spread(spread(bare_pre)),
                        fmt_spread(
                            spread([p / b for p, b in zip(bare_pre, bare, strict=True)]),
                            "x",
                            digits=2,
                        ),
                        "",
                    ],
                    [
                        "minimal queue: ZeroMQ round trip + append+fdatasync",
                        fmt_spread(spread(minimal)),
                        fmt_spread(spread(floor), "x", digits=2),
                        "anchor",
                    ],
                    [
                        "queue, 1 sync producer",
                        fmt_spread(spread(queue)),
                        fmt_spread(spread(ratios), "x", digits=2),
                        fmt_spread(spread(vs_min), "x", digits=2),
                    ],
                ],
            )
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--inflight", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--window1-messages", type=int, default=2000)
    ap.add_argument("--store-only", action="store_true")
    ap.add_argument(
        "--sync-producer",
        action="store_true",
        help="only one synchronous producer (window 1) vs a bare fdatasync loop, paired",
    )
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: tmp)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.sync_producer:
        sync_producer(args)
        return
    base = Path(tempfile.mkdtemp(prefix="bench-queue-", dir=args.dir))
    n, size, p, w = args.messages, args.size, args.producers, args.window
    print(
        f"# {n} messages of {size} B, {p} producers, window {w}, inflight {args.inflight}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, median of {args.repeat}"
    )
    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}
    extra: dict[str, list[float]] = {}
    try:
        for r in range(args.repeat):
            rates.setdefault("anchor: append+fdatasync, 1 record/sync", []).append(
                anchor(base, size, 1, 2000)
            )
            rates.setdefault(f"anchor: append+fdatasync, {w} records/sync", []).append(
                anchor(base, size, w, 50 * w)
            )
            store = base / f"store-{r}"
            proc, info = start_broker(store, args.inflight, 100_000)

            def phase(name: str, *a: object, info: dict = info, pid: int = proc.pid) -> None:
                res = run_clients(info, *a, broker_pid=pid)  # type: ignore[arg-type]
                rates.setdefault(name, []).append(res["rate"])
                cpu.setdefault(name, []).append((res["broker_us"], res["clients_us"]))

            try:
                phase("produce (durable, acked)", p, n, size, w, False, True)
                syncs = int(monitor(info["monitor"])["syncs"])
                extra.setdefault("messages per fdatasync in produce", []).append(n / syncs)
                phase("consume (acked)", p, n, size, w, True, False)
                phase("e2e produce->consume (durable, acked)", p, n, size, w, True, True)
                w1 = args.window1_messages
                phase("produce, window 1 (1 message per commit)", 1, w1, size, 1, False, True)
            finally:
                stop_broker(proc)
            shutil.rmtree(store, ignore_errors=True)
            if args.store_only:
                so = store_only(base / f"so-{r}", min(n, 100_000), size, 1000)
                for key, value in so.items():
                    rates.setdefault(f"store only: {key} (1000/commit)", []).append(value)
                shutil.rmtree(base / f"so-{r}", ignore_errors=True)
        anchor_w = f"anchor: append+fdatasync, {w} records/sync"
        anchor_1 = "anchor: append+fdatasync, 1 record/sync"
        vs: dict[str, tuple[str, dict]] = {}
        for name, values in rates.items():
            if name.startswith("anchor"):
                continue
            ref = anchor_1 if "window 1" in name else anchor_w
            vs[name] = (ref, ratio_spread(values, rates[ref]))
        figures = {
            name: {
                "msgs_per_s": spread(values),
                **(
                    {
                        "broker_cpu_us_per_msg": spread([c[0] for c in cpu[name]]),
                        "clients_cpu_us_per_msg": spread([c[1] for c in cpu[name]]),
                    }
                    if name in cpu
                    else {}
                ),
                **({"anchor": vs[name][0], "vs_anchor": vs[name][1]} if name in vs else {}),
            }
            for name, values in rates.items()
        }
        produce = figures["produce (durable, acked)"]["msgs_per_s"]["median"]
        write_json(
            args.out,
            "queue.json",
            {
                "bench": "queue",
                "machine": machine(),
                "messages": n,
                "size": size,
                "producers": p,
                "window": w,
                "inflight": args.inflight,
                "runs": args.repeat,
                "unit": "msgs/s",
                "figures": figures,
                "extra": {k: spread(v) for k, v in extra.items()},
                "targets_met": {"produce >= 50k durable acked msgs/s": produce >= 50_000},
            },
        )
        print()
        rows = []
        for name, f in figures.items():
            rows.append(
                [
                    name,
                    fmt_spread(f["msgs_per_s"]),
                    fmt_spread(f["broker_cpu_us_per_msg"], digits=1) if name in cpu else "",
                    fmt_spread(f["clients_cpu_us_per_msg"], digits=1) if name in cpu else "",
                    "anchor"
                    if name.startswith("anchor")
                    else (
                        f"{fmt_spread(vs[name][1], 'x', digits=2)} of {vs[name][0][8:]}"
                        if name in vs
                        else ""
                    ),
                ]
            )
        print(
            md_table(
                [
                    "path",
                    "msgs/s (median, min-max)",
                    "broker CPU µs/msg",
                    "clients CPU µs/msg",
                    "vs anchor",
                ],
                rows,
            )
        )
        print()
        for name, values in extra.items():
            print(f"{name}: {statistics.median(values):,.0f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
