"""Benchmark of the queue's direct range serving (not a test; docs/direct-read.md
"The queue's flow producer").

A store of ``--messages`` PZQ messages of ``--size`` bytes is written, then read the
ways the queue's flow producer port reads it, each against an anchor measured in the
same run on the same bytes:

- ``anchor``: a raw ``pread`` of the store's segment files, 1 MiB at a time (the bytes a
  range read must touch, with nothing done to them), as records/s.
- ``anchor per record``: a ``pread`` and a ``crc32`` of each record on its own (the
  floor of a read costing one syscall and one CRC per record; ACK and HEADER records
  included, ~1 % more records).
- ``number``: the port numbering every message for a held query (``prepare_held``
  until it says done: the slices a broker spreads over its loop turns), in-process.
- ``serve``: the port's records for DATs of 1000 (``HeldView.take``, what a range flow
  encodes and sends), over the whole range, in-process: the store-reading part of a
  range read, without ZeroMQ or Arrow.
- ``e2e held`` / ``e2e range``: the same folder served by a :class:`QueueBroker` in this
  process (its side log removed first, so it numbers afresh): the driver's held query,
  then ``read_range`` of every message over loopback (a task's read: the broker's
  thread, ZeroMQ and the reader's Arrow decoding, on the same cores), read twice.
  ``longest turn``: the broker's longest loop turn of its flow ports (``process`` and
  ``pump`` of one turn: where range DATs are sent) while those two reads run, in ms of
  the broker thread's CPU (and wall): how long the queue's other sockets can wait
  (after a warm-up DAT encoding: the first one imports pandas, once per process, and a
  full collection of what the in-process cases left), and the median turn's.

Each case in records/s (wall) and records per CPU-second of this process (every
thread: the broker's too; the steadier figure on a shared box); ratios are ours / the
anchor's records per CPU-second of the same run (the mean of its reads before and after
the cases); medians over ``--repeat`` runs (the store is written once per run).

    .venv/bin/python bench/bench_queue_ranges.py [--messages 100000] [--size 100]
        [--repeat 3] [--no-sync] [--out DIR]

Writes ``DIR/queue_ranges.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import fmt_spread, machine, md_table, ratio_spread, spread, write_json  # noqa: E402

from zio_spark.codec.records import DAT_BYTES, encode_records  # noqa: E402
from zio_spark.pzq.broker import QueueBroker  # noqa: E402
from zio_spark.pzq.flow_ports import FlowProducerPort  # noqa: E402
from zio_spark.source.range_client import held_window, read_range  # noqa: E402
from zio_spark.storage.files import RECORD_HEAD  # noqa: E402
from zio_spark.storage.store import MessageStore  # noqa: E402

_CHUNK = 1 << 20
_DAT = 1000


class Clock:
    """Wall and CPU seconds (this process: every thread, the broker's included) of a
    step: the box is shared, so CPU seconds are the steadier figure."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def took(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def fill(folder: Path, n: int, size: int, sync: bool) -> None:
    """``n`` durable messages of ``size`` bytes, committed 1000 at a time."""
    body = os.urandom(size)
    with MessageStore(folder, sync=sync) as store:
        for i in range(n):
            store.put(b"m-%08d" % i, (body,))
            if i % 1000 == 999:
                store.commit()
        store.commit()


def anchor(folder: Path) -> tuple[float, float]:
    """Seconds to pread every segment file of ``folder`` once, 1 MiB at a time."""
    t0 = Clock()
    total = 0
    for path in sorted(folder.glob("seg-*.log")):
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while True:
                got = os.pread(fd, _CHUNK, offset)
                if not got:
                    break
                offset += len(got)
                total += len(got)
        finally:
            os.close(fd)
    assert total > 0
    return t0.took()


def anchor_records(folder: Path) -> tuple[float, float]:
    """Seconds to pread every record of ``folder`` on its own and crc32 it: the floor of
    a read that costs one ``pread`` and one CRC per record (framing parsed in Python)."""
    heads: list[tuple[Path, list[tuple[int, int]]]] = []
    for path in sorted(folder.glob("seg-*.log")):
        data = path.read_bytes()
        spans = []
        pos = 0
        while pos + RECORD_HEAD.size <= len(data):
            length = RECORD_HEAD.unpack_from(data, pos)[0]
            if length == 0:
                break
            spans.append((pos, RECORD_HEAD.size + length))
            pos += RECORD_HEAD.size + length
        heads.append((path, spans))
    t0 = Clock()
    for path, spans in heads:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, size in spans:
                record = os.pread(fd, size, offset)
                zlib.crc32(memoryview(record)[RECORD_HEAD.size :])
        finally:
            os.close(fd)
    return t0.took()


def in_process(
    folder: Path, n: int, sync: bool, ctx: zmq.Context[Any]
) -> dict[str, tuple[float, float]]:
    """Seconds to number ``n`` messages, then to serve them twice (port only)."""
    out: dict[str, tuple[float, float]] = {}
    with MessageStore(folder, sync=sync) as store:
        port = FlowProducerPort(store, "tcp://127.0.0.1:*", ctx=ctx, sync=sync, linger_ms=0)
        try:
            t0 = Clock()
            while port.prepare_held() is False:
                port.pump()  # a loop turn: the next slice may number
            out["number"] = t0.took()
            if port.last_seq != n:
                raise SystemExit(f"numbered {port.last_seq} of {n} messages")
            view = port._view
            for name in ("serve", "serve again"):
                t0 = Clock()
                seq, got = 1, 0
                while seq <= n:
                    taken = view.take(seq, min(_DAT, n + 1 - seq), DAT_BYTES)
                    if taken is None or taken.first != seq:
                        raise SystemExit(f"the store did not give back seq {seq}")
                    seq += len(taken.values)
                    got += len(taken.values)
                out[name] = t0.took()
                assert got == n
        finally:
            port.close()
    return out


class TurnWatch:
    """The longest loop turn of a broker's flow ports: ``process`` (PAYs in: a range
    flow's credit) and ``pump`` (ticks) of one turn, timed in the broker's thread, in
    that thread's CPU seconds and in wall seconds. Wraps the two methods on the
    instance (the loop looks them up every turn)."""

    def __init__(self, flows: Any) -> None:
        self.cpu = self.wall = 0.0
        self.turns = 0
        self.cpus: list[float] = []  # every turn's CPU seconds
        self._cpu = self._wall = 0.0  # this turn's so far (process before pump)
        self.on = False
        process, pump = flows.process, flows.pump

        def timed_process(store: Any) -> None:
            c, w = time.thread_time(), time.perf_counter()
            process(store)
            self._cpu += time.thread_time() - c
            self._wall += time.perf_counter() - w

        def timed_pump(store: Any) -> None:
            c, w = time.thread_time(), time.perf_counter()
            pump(store)
            cpu = self._cpu + time.thread_time() - c
            wall = self._wall + time.perf_counter() - w
            self._cpu = self._wall = 0.0
            if self.on:
                self.turns += 1
                self.cpus.append(cpu)
                self.cpu = max(self.cpu, cpu)
                self.wall = max(self.wall, wall)

        flows.process, flows.pump = timed_process, timed_pump


def e2e(
    folder: Path, n: int, sync: bool, ctx: zmq.Context[Any]
) -> tuple[dict[str, tuple[float, float]], TurnWatch]:
    """Seconds for a held query and two range reads of every message, over loopback,
    and the longest loop turn of the flow ports during the reads."""
    (folder / "flow-producer.log").unlink()  # number afresh: nothing held in memory
    # The first DAT's encoding imports pandas (pyarrow, for numpy input): ~0.25 s once
    # per process, which would be the broker's longest turn; done here beforehand, so
    # the turns measured are the steady ones.
    encode_records(1, [b"warm"], None)
    # The in-process cases leave ~100k survivors counted towards the collector's next
    # full pass (the records they served): collected here, so a full pass landing in a
    # measured turn is one the broker's own work caused (the port's table: ints only).
    gc.collect()
    out: dict[str, tuple[float, float]] = {}
    broker = QueueBroker(
        folder, flow_producer="tcp://127.0.0.1:*", context=ctx, linger_ms=0, sync=sync
    ).start()
    watch = TurnWatch(broker._flows)
    try:
        ep = broker.endpoints["flow_producer"]
        pid = f"queue:{broker.queue_id.decode()}"
        t0 = Clock()
        held = held_window(ep, pid, ctx=ctx, timeout=120)
        out["e2e held"] = t0.took()
        if (held.first, held.end) != (1, n + 1):
            raise SystemExit(f"held window [{held.first}, {held.end}), wanted [1, {n + 1})")
        watch.on = True
        for name in ("e2e range", "e2e range again"):
            t0 = Clock()
            rows = sum(
                b.num_rows
                for b in read_range(ep, pid, held.incarnation, 1, n + 1, ctx=ctx, timeout=120)
            )
            out[name] = t0.took()
            if rows != n:
                raise SystemExit(f"read {rows} of {n} rows")
        watch.on = False
    finally:
        broker.stop()
    return out, watch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-sync", action="store_true", help="no fdatasync (store, side log)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    n, sync = args.messages, not args.no_sync
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    turns: dict[str, list[float]] = {"cpu_ms": [], "wall_ms": [], "median_cpu_ms": [], "turns": []}
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for _ in range(args.repeat):
            folder = Path(tempfile.mkdtemp(prefix="bench-qr-"))
            try:
                fill(folder, n, args.size, sync)
                times = {"anchor": anchor(folder), "anchor per record": anchor_records(folder)}
                times.update(in_process(folder, n, sync, ctx))
                got, watch = e2e(folder, n, sync, ctx)
                times.update(got)
                turns["cpu_ms"].append(watch.cpu * 1e3)
                turns["wall_ms"].append(watch.wall * 1e3)
                turns["turns"].append(watch.turns)
                turns["median_cpu_ms"].append(statistics.median(watch.cpus) * 1e3)
                times["anchor after"] = anchor(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            for name, (w, c) in times.items():
                wall.setdefault(name, []).append(n / w)
                cpu.setdefault(name, []).append(n / max(c, 1e-6))
    finally:
        ctx.term()

    def both(runs: dict[str, list[float]]) -> list[float]:
        """The anchor of each run: the mean of its reads before and after."""
        return [(a + b) / 2 for a, b in zip(runs["anchor"], runs["anchor after"], strict=True)]

    result: dict[str, Any] = {
        "machine": machine(),
        "messages": n,
        "size": args.size,
        "sync": sync,
        "records_per_s": {k: spread(v) for k, v in wall.items()},
        "records_per_cpu_s": {k: spread(v) for k, v in cpu.items()},
        "ratio_to_anchor": {k: ratio_spread(v, both(wall)) for k, v in wall.items()},
        "cpu_ratio_to_anchor": {k: ratio_spread(v, both(cpu)) for k, v in cpu.items()},
        "longest_turn_during_ranges": {k: spread(v) for k, v in turns.items()},
    }
    path = write_json(args.out, "queue_ranges.json", result)
    rows = [
        (
            k,
            fmt_spread(spread(v), "/s"),
            fmt_spread(spread(cpu[k]), "/CPU-s"),
            fmt_spread(ratio_spread(cpu[k], both(cpu)), "", digits=4),
        )
        for k, v in wall.items()
    ]
    print(md_table(("case", "records/s", "records per CPU-s", "CPU ratio to the raw pread"), rows))
    print(
        "longest flow-port loop turn during the range reads: "
        f"{fmt_spread(spread(turns['cpu_ms']), ' ms CPU')}, "
        f"{fmt_spread(spread(turns['wall_ms']), ' ms wall')} "
        f"(over {fmt_spread(spread(turns['turns']), ' turns')}; the median turn "
        f"{fmt_spread(spread(turns['median_cpu_ms']), ' ms CPU', digits=1)})"
    )
    print(f"({n} messages of {args.size} B, sync {sync}; load {os.getloadavg()[0]:.1f}; {path})")


if __name__ == "__main__":
    main()
