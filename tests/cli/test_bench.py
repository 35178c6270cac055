"""`zio-spark bench --quick` keeps the harness working (it checks the harness, not targets)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_harness_runs_and_reports(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "zio_spark.cli",
            "bench",
            "--quick",
            "--only",
            "spool",
            "queue",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["status"] for k, v in summary.items()} == {"spool": 0, "queue": 0}
    md = (out / "summary.md").read_text()
    assert "anchor" in md and "## spool" in md and "## queue" in md
