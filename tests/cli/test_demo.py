"""The main job: `zio-spark demo` end to end (local Spark, embedded producer/consumer)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import zio_spark.cli.demo as demo
import zio_spark.cli.precompile as pc


@pytest.mark.timeout(1260)  # hang guard: a busy machine slows Spark's start-up a lot
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
        timeout=1200,  # hang guard only: the demo itself fails after 300 s without progress
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["exactly_once"] is True
    assert summary["published_frames"] == 20000
    assert summary["duplicate_windows"] == 0
    png = out / "demo-throughput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "demo-summary.json").read_text()) == summary


# -- when Spark's fixed worker start-up limit is hit anyway (issue #23) ----------------------

JAVA_TRACE = (
    "An error occurred while calling o42.start.\n"
    ": org.apache.spark.SparkException: Python worker failed to connect back.\n"
    "\tat org.apache.spark.api.python.PythonWorkerFactory.createSimpleWorker(...)\n"
    "Caused by: java.net.SocketTimeoutException: Accept timed out\n"
)


def _args(tmp_path):
    return argparse.Namespace(
        records=10, rate=0.0, out=str(tmp_path / "out"), no_progress=True, json=False
    )


def test_worker_connect_back_is_recognised_anywhere_in_the_chain():
    try:
        try:
            raise Exception(JAVA_TRACE)  # as a Py4JJavaError renders itself
        except Exception as inner:
            raise RuntimeError("query failed: the query stopped") from inner
    except RuntimeError as e:
        assert demo.worker_start_timed_out(e)
    timed_out = "Timed out while waiting for the Python worker to connect back after 10000 ms"
    assert demo.worker_start_timed_out(RuntimeError(timed_out))
    assert not demo.worker_start_timed_out(RuntimeError("query failed: disk full"))
    assert not demo.worker_start_timed_out(
        ValueError("Python worker exited unexpectedly (crashed)")
    )


def test_a_worker_timeout_ends_in_one_paragraph_and_removes_the_work_folder(
    tmp_path, monkeypatch, capsys
):
    seen = {}

    def fail(args, work):
        seen["work"] = work
        (Path(work) / "spool").mkdir()
        (Path(work) / "spool" / "segment").write_bytes(b"x" * 100)
        raise RuntimeError(f"query failed: {JAVA_TRACE}")

    monkeypatch.setattr(demo, "_demo", fail)
    assert demo.run_demo(_args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert not Path(seen["work"]).exists()
    paragraph = err.strip()
    assert "\n" not in paragraph, paragraph  # one paragraph, nothing after it
    assert "Traceback" not in err and "org.apache.spark" not in err
    assert "within Spark's fixed 10 s start-up limit" in paragraph
    assert "Python worker failed to connect back" in paragraph
    assert "run the demo again" in paragraph
    assert f"The work folder {seen['work']} has been removed." in paragraph
    assert "precompile" in paragraph  # either "run ... precompile" or "already precompiled"


def test_the_paragraph_says_whether_pyspark_zip_is_precompiled(tmp_path, monkeypatch):
    z = tmp_path / "pyspark.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("pyspark/__init__.py", "X = 1\n")
    monkeypatch.setattr(pc, "find_zips", lambda: [z])
    text = demo.explain_worker_timeout("/tmp/w")
    assert f"run `{sys.executable} -m zio_spark.cli.precompile`" in text
    pc.precompile_zip(z)
    text = demo.explain_worker_timeout("/tmp/w")
    assert "already precompiled for this Python" in text and "-m zio_spark" not in text


def test_other_failures_still_raise_and_remove_the_work_folder(tmp_path, monkeypatch):
    seen = {}

    def fail(args, work):
        seen["work"] = work
        raise ValueError("something else")

    monkeypatch.setattr(demo, "_demo", fail)
    with pytest.raises(ValueError, match="something else"):
        demo.run_demo(_args(tmp_path))
    assert not Path(seen["work"]).exists()


def test_a_stalled_demo_says_what_stopped_and_removes_the_work_folder(
    tmp_path, monkeypatch, capsys
):
    seen = {}

    def stall(args, work):
        seen["work"] = work
        raise demo.DemoStalled("no progress for 300 s: produced 10, ingested 0")

    monkeypatch.setattr(demo, "_demo", stall)
    assert demo.run_demo(_args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "no progress for 300 s: produced 10, ingested 0" in err
    assert not Path(seen["work"]).exists()
