"""`zio-spark bench --quick` keeps the harness working (it checks the harness, not targets).

One run of every benchmark at its quick size (about two minutes on the project's 2-core
machine): each exits 0, writes JSON that parses, prints a Markdown table that lands in
summary.md, and the plots come out as valid PNGs. No figure is compared with a target.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from zio_spark.cli.bench import BENCHES

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


@pytest.mark.timeout(900)
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
        timeout=880,
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
