"""``zio-spark bench``: run the benchmarks in ``bench/`` and collect their reports.

Each benchmark is a script that measures our path *and* its anchor in the same run and
prints a Markdown table; this command runs them one after another (never in parallel: they
would measure each other), each in its own process with a time limit, and writes
``<out>/summary.md`` (every table, with the command that made it) and
``<out>/summary.json`` (exit status, seconds and output per benchmark).

``--quick`` picks small sizes so the whole run takes a few minutes; it checks that the
harness works, not the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["BENCHES", "run_bench"]

# name -> (script, quick arguments, full arguments)
BENCHES: dict[str, tuple[str, list[str], list[str]]] = {
    "flow": ("bench_flow.py", ["--quick"], []),
    "spool": ("bench_spool.py", ["--records", "200000", "--repeat", "1"], []),
    "queue": ("bench_queue.py", ["--messages", "20000", "--repeat", "1"], []),
    "source": ("bench_source.py", ["--quick"], []),
    "sink": ("bench_sink.py", ["--rows", "200000", "--batches", "2", "--rounds", "1"], []),
}


def _bench_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "bench"
    if not here.is_dir():
        raise FileNotFoundError(
            f"benchmarks not found at {here}: run `zio-spark bench` from a source checkout"
        )
    return here


def run_bench(args: argparse.Namespace) -> int:
    bench = _bench_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = getattr(args, "only", None)
    names = [n for n in BENCHES if not only or n in only]
    results: dict[str, dict[str, object]] = {}
    md = ["# zio-spark benchmarks", ""]
    failed = 0
    for name in names:
        script, quick, full = BENCHES[name]
        cmd = [sys.executable, str(bench / script), *(quick if args.quick else full)]
        if "--out" in _help(cmd[:2]):
            cmd += ["--out", str(out)]
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=900 if args.quick else 3600,
                env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
            )
            status, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            status, stdout, stderr = -1, str(e.stdout or ""), "timed out"
        seconds = round(time.monotonic() - t0, 1)
        failed += status != 0
        results[name] = {"status": status, "seconds": seconds, "output": stdout}
        md += [f"## {name}", "", f"`{' '.join(cmd[1:])}` — {seconds} s, exit {status}", ""]
        md += [line for line in stdout.splitlines() if line.strip()] + [""]
        if status != 0:
            md += ["```", stderr[-2000:], "```", ""]
        print(stdout, flush=True)
    (out / "summary.md").write_text("\n".join(md), encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "command": "bench",
                    "failed": failed,
                    "benchmarks": {k: v["status"] for k, v in results.items()},
                }
            )
        )
    return 1 if failed else 0


def _help(cmd: list[str]) -> str:
    try:
        return subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return ""
