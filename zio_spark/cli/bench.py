"""``zio-spark bench``: run the benchmarks in ``bench/`` and collect their reports.

Each benchmark is a script that measures our path *and* its anchor in the same run and
prints a Markdown table; this command runs them one after another (never in parallel: they
would measure each other), each in its own process with a time limit, and writes
``<out>/summary.md`` (every table, with the command that made it) and
``<out>/summary.json`` (exit status, seconds, output and the JSON each benchmark wrote),
then draws the PNG plots (``bench/plots.py``: throughput vs credit window, latency CDF,
RSS over time, throughput bars; median with min-max everywhere) into ``<out>``.

``--quick`` picks small sizes so the whole run takes about two minutes; it checks that the
harness works, not the targets. ``python -m zio_spark.cli.bench`` takes the same arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["BENCHES", "run_bench"]

# name -> (script, quick arguments, full arguments). Every script takes ``--out DIR`` and
# writes its JSON there (``<name>.json``; flow: ``flow-<mode>.json``).
BENCHES: dict[str, tuple[str, list[str], list[str]]] = {
    "flow": ("bench_flow.py", ["--quick"], []),
    "flow-clientserver": (
        "bench_flow.py",
        ["--quick", "--mode", "clientserver"],
        ["--mode", "clientserver"],
    ),
    "spool": ("bench_spool.py", ["--records", "100000", "--repeat", "2"], []),
    "queue": ("bench_queue.py", ["--messages", "20000", "--repeat", "1"], []),
    "source": ("bench_source.py", ["--quick"], []),
    "steady": ("bench_steady.py", ["--quick", "--bind-clients", "2"], []),
    "sink": (
        "bench_sink.py",
        ["--rows", "200000", "--batches", "2", "--rounds", "1"],
        ["--rounds", "3"],
    ),
    "latency": ("bench_latency.py", ["--quick"], []),
    "rss": ("bench_rss.py", ["--quick"], []),
}


# Benches that need another interpreter: CLIENT/SERVER sockets need a draft pyzmq, which
# scripts/build-draft-pyzmq.sh builds into .venv-draft (the stock wheel has no drafts).
_DRAFT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-draft" / "bin" / "python"
_INTERPRETER: dict[str, Path] = {"flow-clientserver": _DRAFT_PYTHON}


def _bench_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "bench"
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
        python = _INTERPRETER.get(name, Path(sys.executable))
        if not python.exists():
            failed += 1
            why = f"needs {python}: run scripts/build-draft-pyzmq.sh"
            results[name] = {"status": "not run", "reason": why}
            md += [f"## {name}", "", f"**Not run**: {why}.", ""]
            print(f"== {name}: not run, {why}", file=sys.stderr, flush=True)
            continue
        cmd = [str(python), str(bench / script), *(quick if args.quick else full)]
        cmd += ["--out", str(out)]
        before = _outputs(out)
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        status, stdout, stderr = _run_script(cmd, 900 if args.quick else 3600)
        seconds = round(time.monotonic() - t0, 1)
        failed += status != 0
        written = {
            p.name: data
            for p in sorted(out.glob("*.json"))
            if p.name not in ("summary.json",)
            and before.get(p.name) != p.stat().st_mtime_ns
            and (data := _read_json(p)) is not None
        }
        results[name] = {
            "status": status,
            "seconds": seconds,
            "command": cmd[1:],
            "output": stdout,
            "json": written,
        }
        md += [f"## {name}", "", f"`{' '.join(cmd[1:])}` — {seconds} s, exit {status}", ""]
        md += _paragraphs(stdout)
        if status != 0:
            md += ["```", stderr[-2000:], "```", ""]
        print(stdout, flush=True)
    status, files, stderr = _plots(bench, out)
    failed += status != 0
    results["plots"] = {"status": status, "files": files}
    md += ["## plots", "", "Median with min-max in every figure; grey bars are anchors.", ""]
    md += [f"![{f}]({f})" for f in files] + [""]
    if status != 0:
        md += ["```", stderr[-2000:], "```", ""]
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


def _run_script(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    """Run one bench in its own session; on timeout end that session's processes too
    (the bench's Spark JVM and its Python workers would outlive a killed script)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call created, by its pid
        stdout, _ = proc.communicate()
        return -1, stdout or "", f"timed out after {timeout:g} s"


def _paragraphs(text: str) -> list[str]:
    """Lines of a bench's output, blank lines kept single (they end Markdown tables)."""
    lines: list[str] = []
    for line in text.splitlines():
        line = line.rstrip()
        if line or (lines and lines[-1]):
            lines.append(line)
    return [*lines, ""] if lines and lines[-1] else lines


def _outputs(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}


def _read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _plots(bench: Path, out: Path) -> tuple[int, list[str], str]:
    """Draw every plot the JSON in ``out`` allows (own process: matplotlib stays out)."""
    cmd = [sys.executable, str(bench / "plots.py"), "--out", str(out)]
    print(f"== plots: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return -1, [], "timed out"
    files = [line.strip() for line in r.stdout.splitlines() if line.strip().endswith(".png")]
    return r.returncode, files, r.stderr


def main(argv: list[str] | None = None) -> int:
    """``python -m zio_spark.cli.bench``: the ``zio-spark bench`` command, every bench name."""
    p = argparse.ArgumentParser(prog="python -m zio_spark.cli.bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="about two minutes; checks the harness")
    p.add_argument("--out", default="bench/results", help="folder for JSON, Markdown, PNG")
    p.add_argument("--only", nargs="+", choices=tuple(BENCHES), help="run only these")
    p.add_argument("--json", action="store_true", help="print a JSON status line")
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
