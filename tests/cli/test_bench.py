"""The benchmark harness keeps working (these check the harness, never a target).

Default run (fast, fine on a busy machine): every bench script starts and lists its
options; the benches without Spark (spool, queue, flow, and flow over CLIENT/SERVER on the
draft build) run at a small size and write JSON, a Markdown table with its anchor and,
through ``bench/plots.py``, their PNGs.

``-m bench`` (by hand; not in the default run or scripts/test.sh): one run of every
benchmark through ``zio-spark bench --quick`` (about two minutes on the project's quiet
2-core machine, 15 and more under load): each exits 0, writes JSON that parses, prints a
Markdown table that lands in summary.md, and the plots come out as valid PNGs.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from zio_spark.cli.bench import BENCHES

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
DRAFT_PYTHON = ROOT / ".venv-draft" / "bin" / "python"

# bench -> the JSON files it writes (flow: one per socket mode; CLIENT/SERVER runs on the
# draft build, which the test command makes before the suite)
JSON_FILES = {
    "flow": "flow-routerdealer.json",
    "flow-clientserver": "flow-clientserver.json",
    "spool": "spool.json",
    "queue": "queue.json",
    "source": "source.json",
    "steady": "steady.json",
    "sink": "sink.json",
    "latency": "latency.json",
    "rss": "rss.json",
}
PLOTS = (
    "throughput_vs_window.png",
    "latency_cdf.png",
    "rss_over_time.png",
    "source.png",
    "sink.png",
    "queue.png",
    "spool.png",
)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR", "PNG without IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND", "PNG truncated"
    return width, height


SCRIPTS = sorted({script for script, _quick, _full in BENCHES.values()} | {"plots.py", "soak.py"})


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_starts_and_lists_its_options(script):
    r = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True,
        text=True,
        timeout=240,  # hang guard
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--out" in r.stdout, r.stdout


def test_the_commit_ack_bench_runs_small(tmp_path):
    """bench/bench_commit_ack.py (run by hand, not by `zio-spark bench`) still runs and
    writes the figures its README line quotes."""
    out = tmp_path / "commit_ack.json"
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_commit_ack.py"), "-n", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,  # hang guard
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text(encoding="utf-8"))
    assert got["n"] == 20, got
    assert 0 < got["median_ms"] <= got["p95_ms"] <= got["max_ms"], got
    assert "commit->ack over 20 rounds" in r.stdout, r.stdout


def _run_small(python: Path | str, args: list[str], out: Path) -> str:
    r = subprocess.run(
        [str(python), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,  # hang guard; each bench has its own no-progress limits (30 s)
        cwd=ROOT,
    )
    assert r.returncode == 0, (args, r.stderr[-3000:])
    assert "|---" in r.stdout and "anchor" in r.stdout, (args, r.stdout[-3000:])
    return r.stdout


@pytest.mark.timeout(1200)
def test_the_benches_without_spark_run_small_and_plot(tmp_path):
    out = tmp_path / "results"
    _run_small(
        sys.executable, [str(BENCH / "bench_spool.py"), "--records", "5000", "--repeat", "1"], out
    )
    _run_small(
        sys.executable,
        [
            str(BENCH / "bench_queue.py"),
            "--messages",
            "500",
            "--repeat",
            "1",
            "--window1-messages",
            "100",
        ],
        out,
    )
    _run_small(sys.executable, [str(BENCH / "bench_flow.py"), "--quick"], out)
    for name in ("spool.json", "queue.json", "flow-routerdealer.json"):
        json.loads((out / name).read_text())  # parses
    r = subprocess.run(
        [sys.executable, str(BENCH / "plots.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    made = {line.strip() for line in r.stdout.splitlines() if line.strip().endswith(".png")}
    assert {"throughput_vs_window.png", "queue.png", "spool.png"} <= made, r.stdout
    for name in made:
        w, h = _png_size((out / name).read_bytes())
        assert w > 100 and h > 100, (name, w, h)


@pytest.mark.timeout(900)
def test_the_clientserver_flow_bench_runs_on_the_draft_build(tmp_path):
    if not DRAFT_PYTHON.exists():
        pytest.skip(f"needs {DRAFT_PYTHON}: run scripts/build-draft-pyzmq.sh (test.sh does)")
    out = tmp_path / "results"
    _run_small(
        DRAFT_PYTHON, [str(BENCH / "bench_flow.py"), "--quick", "--mode", "clientserver"], out
    )
    json.loads((out / "flow-clientserver.json").read_text())


@pytest.mark.bench
@pytest.mark.timeout(3600)
def test_bench_quick_runs_every_bench_and_reports(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "zio_spark.cli.main",
            "bench",
            "--quick",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=3500,  # hang guard: under load the quick run takes 15 min and more
    )
    summary_path = out / "summary.json"
    assert summary_path.exists(), r.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    statuses = {k: v["status"] for k, v in summary.items()}
    assert statuses == dict.fromkeys([*BENCHES, "plots"], 0), (statuses, r.stderr[-3000:])
    assert r.returncode == 0
    assert json.loads(r.stdout.splitlines()[-1])["failed"] == 0

    assert set(JSON_FILES) == set(BENCHES)
    md = (out / "summary.md").read_text()
    for name, pattern in JSON_FILES.items():
        files = sorted(out.glob(pattern))
        assert files, f"{name} wrote no {pattern}"
        for f in files:
            json.loads(f.read_text())  # parses
        assert summary[name]["json"], f"{name}: its JSON is not in summary.json"
        section = md.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "|---" in section, f"{name}: no Markdown table in summary.md"
        assert "anchor" in section, f"{name}: no anchor beside the figures"
    assert (out / "latency-samples.npz").stat().st_size > 0

    assert summary["plots"]["files"] == list(PLOTS)
    for name in PLOTS:
        w, h = _png_size((out / name).read_bytes())
        assert w > 100 and h > 100, (name, w, h)
        assert f"![{name}]({name})" in md
