"""Micro benchmark of the spool's hot path (not a test).

Appends N records of S bytes in batches of B with a flush (fdatasync) per batch, seals
every K records, then reads everything back. Next to it, in the same run and on the same
disk, the anchor: raw ``os.write`` + ``os.fdatasync`` of the same payload bytes per batch
(FACTS.md "Storage": ~800k rec/s for 1 KiB records with 1000 per commit), alternating with
the spool every seal interval. Each batch's records are built just before its timed
append: building them is the receiver's cost, not the spool's.

    .venv/bin/python bench/bench_spool.py [--records 1000000] [--producers 1] [--out DIR]

Writes ``DIR/spool.json`` (every run) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import fmt_spread, machine, md_table, ratio_spread, spread, write_json

from zio_spark.storage.spool import Record, Spool


def run(
    folder: Path, records: int, batch: int, size: int, seal_every: int, producers: int
) -> dict[str, float]:
    """One run. Anchor and spool alternate every seal interval, so both see the same disk
    (fdatasync latency on these VMs drifts by 10x within minutes)."""
    pool = [os.urandom(size) for _ in range(1024)]
    chunk = os.urandom(size * batch * producers)  # anchor: the same bytes per sync
    names = [f"producer-{i}" for i in range(producers)]
    seq = dict.fromkeys(names, 1)
    anchor_time = append_time = flush_time = seal_time = 0.0
    anchor_fd = os.open(folder / "anchor.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    per_round = batch * producers
    rounds_per_seal = max(1, seal_every // per_round)
    with Spool(folder / "spool") as spool:
        done = 0
        while done + per_round <= records:
            n_rounds = min(rounds_per_seal, (records - done) // per_round)
            t0 = time.perf_counter()
            for _ in range(n_rounds):
                os.write(anchor_fd, chunk)
                os.fdatasync(anchor_fd)
            anchor_time += time.perf_counter() - t0
            for _ in range(n_rounds):
                # Build the records (untimed, the receiver's cost), then append + flush.
                ts = time.time_ns() // 1000
                rnd = []
                for name in names:
                    s = seq[name]
                    rnd.append(
                        (
                            name,
                            [
                                Record(i, pool[i & 1023], None, 0, 0, ts, None)
                                for i in range(s, s + batch)
                            ],
                        )
                    )
                    seq[name] = s + batch
                t0 = time.perf_counter()
                for name, recs in rnd:
                    spool.append(name, recs)
                t1 = time.perf_counter()
                spool.flush()
                t2 = time.perf_counter()
                append_time += t1 - t0
                flush_time += t2 - t1
            done += n_rounds * per_round
            t0 = time.perf_counter()
            spool.seal()
            seal_time += time.perf_counter() - t0
        stats = spool.stats
        t0 = time.perf_counter()
        rows = 0
        for name in names:
            for b in spool.read(name, 1, seq[name]):
                rows += b.num_rows
        read_time = time.perf_counter() - t0
        assert rows == done, (rows, done)
    os.close(anchor_fd)
    os.unlink(folder / "anchor.bin")
    return {
        "records": done,
        "anchor_rps": done / anchor_time,
        "append_flush_rps": done / (append_time + flush_time),
        "append_only_rps": done / append_time,
        "flush_ms": flush_time / (done / per_round) * 1e3,
        "anchor_ms": anchor_time / (done / per_round) * 1e3,
        "with_seal_rps": done / (append_time + flush_time + seal_time),
        "seal_s": seal_time,
        "read_rps": rows / read_time,
        "segments": stats.segments_written,
        "bytes_on_disk": stats.bytes_on_disk,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--seal-every", type=int, default=100_000)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="runs; the median is reported")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: tmp)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-spool-", dir=args.dir))
    try:
        runs = []
        for i in range(args.repeat):
            run_dir = base / f"run{i}"
            run_dir.mkdir()
            runs.append(
                run(run_dir, args.records, args.batch, args.size, args.seal_every, args.producers)
            )
            shutil.rmtree(run_dir)
        med = statistics.median
        col = {k: [r[k] for r in runs] for k in runs[0]}
        ratio = ratio_spread(col["append_flush_rps"], col["anchor_rps"])
        figures = {
            "anchor_rps": ("anchor: write + fdatasync, same bytes per sync", "rec/s"),
            "append_flush_rps": ("spool append + flush (fdatasync)", "rec/s"),
            "append_only_rps": ("spool append alone (CPU, no sync)", "rec/s"),
            "with_seal_rps": ("spool append + flush + seal", "rec/s"),
            "read_rps": ("spool read back (zero-copy)", "rec/s"),
            "flush_ms": ("per sync: spool flush", "ms"),
            "anchor_ms": ("per sync: anchor write + fdatasync", "ms"),
        }
        write_json(
            args.out,
            "spool.json",
            {
                "bench": "spool",
                "machine": machine(),
                "records": args.records,
                "size": args.size,
                "batch": args.batch,
                "seal_every": args.seal_every,
                "producers": args.producers,
                "runs": args.repeat,
                "figures": {
                    k: {"label": label, "unit": unit, "value": spread(col[k])}
                    for k, (label, unit) in figures.items()
                },
                "ratios": {"append_flush_vs_anchor": ratio},
                "segments": runs[-1]["segments"],
                "bytes_on_disk": runs[-1]["bytes_on_disk"],
            },
        )
        print(
            f"spool bench: {args.records} records x {args.size} B, {args.batch}/flush, "
            f"seal every {args.seal_every}, {args.producers} producer(s), "
            f"median of {args.repeat} (min-max)"
        )
        print()
        rows = []
        for k, (label, unit) in figures.items():
            vs = ""
            if k == "anchor_rps":
                vs = "anchor"
            elif k == "append_flush_rps":
                vs = fmt_spread(ratio, "x", digits=2)
            digits = 2 if unit == "ms" else 0
            rows.append([label, fmt_spread(spread(col[k]), f" {unit}", digits=digits), vs])
        print(md_table(["path", "median (min-max)", "vs anchor"], rows))
        print()
        print(
            f"seal total {med(col['seal_s']):.3f} s; segments {runs[-1]['segments']:.0f}, "
            f"on disk {runs[-1]['bytes_on_disk'] / 1e6:.1f} MB"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
