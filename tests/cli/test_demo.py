"""The main job: `zio-spark demo` end to end (local Spark, embedded producer/consumer)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_delivers_every_frame_exactly_once(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "zio_spark.cli.main",
            "demo",
            "--records",
            "20000",
            "--rate",
            "0",
            "--out",
            str(out),
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["exactly_once"] is True
    assert summary["published_frames"] == 20000
    assert summary["duplicate_windows"] == 0
    png = out / "demo-throughput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "demo-summary.json").read_text()) == summary
