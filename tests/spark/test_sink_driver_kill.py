"""The Spark driver is SIGKILLed mid-stream and restarted from its checkpoint: every row
reaches the consumer exactly once.

The consumer lives in this process; the driver is a child process
(``sink_driver_child.py``: its own local[2] session, ``rate-micro-batch`` -> zio sink),
started in a new session so that the Python driver and its JVM die together by
``os.killpg``. ``rate-micro-batch`` makes batch ``b`` hold exactly the values
``b*ROWS .. (b+1)*ROWS - 1``, the same when Spark re-runs it after the restart.

Kill points:

- ``after_publish``: from the consumer's fault hook, once batch ``KILL_BATCH`` is
  published but before the driver hears ``ok`` (so its commit log lacks the batch):
  the restarted driver re-runs the batch and the consumer must not publish it again.
- ``before_publish`` (``-m chaos`` only): every partition of ``KILL_BATCH`` is staged,
  the commit arrives, the driver dies and the commit fails before the publish: the
  restarted driver re-runs the batch over leftover staging and it is published once.
- ``anytime`` (``-m chaos`` only; the default run has its equal in
  ``tests/reliability/test_sink_chaos.py``, size ``ci``): from the test, at a random
  moment (seeded, printed) within 1 s after ``KILL_BATCH`` batches were published:
  wherever the driver happens to be.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_until
from zio_spark.sink.consumer import Consumer

ROWS = 400  # per micro-batch
STREAM = "kill"
KILL_BATCH = 2
MORE = 3  # batches the restarted driver must publish beyond the kill point
ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("sink_driver_child.py")


# ------------------------------------------------------------------- process tree


def _children() -> dict[int, list[int]]:
    """ppid -> [pid] for every live (non-zombie) process we can see."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        out.setdefault(int(fields[1]), []).append(int(d))
    return out


def _descendants(pid: int) -> list[int]:
    tree = _children()
    found: list[int] = []
    todo = [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Driver:
    """One child driver process; its output goes to a file (no pipe to fill up)."""

    def __init__(self, consumer: Consumer, ckpt: Path, log: Path) -> None:
        self.log = log
        env = {
            **os.environ,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), consumer.endpoint, STREAM, str(ckpt), str(ROWS)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(ROOT),
            )
        self.pid = self.proc.pid
        self.tree: set[int] = set()  # every descendant seen, for the final sweep

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def started(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"driver exited with {self.proc.returncode}:\n{self.output()}")
        return "STARTED" in self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the driver's process group and to every descendant (Spark's
        Python worker daemon puts itself in a group of its own) and their groups."""
        if self.proc.poll() is None:
            self.tree.update(_descendants(self.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        own = os.getpgrp()
        for pid in sorted(self.tree):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                pgid = os.getpgid(pid)
                if pgid not in (own, self.pid):
                    os.killpg(pgid, sig)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        wait_until(
            lambda: not any(_alive(p) for p in self.tree), 30, "the driver's children to die"
        )

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; always reaps everything."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        self.kill()


# ------------------------------------------------------------------------- the test


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "point",
    # before_publish adds little to test_sink's failed-commit test and ~30-50 s: chaos only.
    # anytime (two more driver starts, ~50 s): chaos only, because the default run has the
    # same scenario and more in tests/reliability/test_sink_chaos.py's "ci" size: one
    # driver SIGKILLed at a seeded random moment, restarted from its checkpoint, every
    # batch published once with its exact values, more published after the restart, no
    # commit error (plus injected task failures).
    [
        "after_publish",
        pytest.param("anytime", marks=pytest.mark.chaos),
        pytest.param("before_publish", marks=pytest.mark.chaos),
    ],
)
def test_driver_sigkill_then_restart_publishes_every_row_once(tmp_path: Path, point: str) -> None:
    t0 = time.monotonic()
    ckpt = tmp_path / "ckpt"
    killed = threading.Event()
    holder: dict[str, Driver] = {}
    consumer = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)

    def fault(where: str, stream: str, batch: Any) -> None:
        if where == point and stream == STREAM and batch == KILL_BATCH and not killed.is_set():
            holder["first"].signal(signal.SIGKILL)
            killed.set()
            if where == "before_publish":
                raise OSError("injected: the driver died before the publish")

    drivers: list[Driver] = []
    try:
        if point != "anytime":
            consumer.fault_hook = fault
        first = holder["first"] = Driver(consumer, ckpt, tmp_path / "driver-1.log")
        drivers.append(first)
        wait_until(first.started, 90, "the first driver's query to start")
        if point == "anytime":
            wait_until(
                lambda: len(consumer.published(STREAM)) >= KILL_BATCH, 60, "published batches"
            )
            seed = random.randrange(1 << 30)
            delay = random.Random(seed).uniform(0.0, 1.0)
            print(f"anytime: seed {seed}, kill {delay:.3f} s after batch {KILL_BATCH - 1}")
            time.sleep(delay)  # a random kill moment, not a wait for a condition
            first.signal(signal.SIGKILL)
            killed.set()
        else:
            wait_until(
                lambda: killed.is_set() or first.proc.poll() is not None,
                60,
                f"the kill at {point} of batch {KILL_BATCH}",
            )
            assert killed.is_set(), f"the driver exited by itself:\n{first.output()}"
        first.kill()
        assert first.proc.returncode == -signal.SIGKILL, first.output()
        at_kill = [b for _, b in consumer.published(STREAM)]
        t_kill = time.monotonic() - t0

        second = Driver(consumer, ckpt, tmp_path / "driver-2.log")
        drivers.append(second)
        wait_until(second.started, 90, "the second driver's query to start")
        target = max(at_kill, default=-1) + 1 + MORE
        wait_until(
            lambda: second.proc.poll() is not None or len(consumer.published(STREAM)) >= target,
            60,
            f"{target} published batches after the restart",
        )
        assert second.proc.poll() is None, second.output()
        second.stop()
        ids = [b for _, b in consumer.published(STREAM)]
        batches = {b: [int(r.value) for r in consumer.records(STREAM, b)] for b in ids}
        stats = dict(consumer.stats)
    finally:
        for d in drivers:
            d.stop(grace=5.0)
        consumer.close()
    print(f"{point}: killed at {t_kill:.1f} s, total {time.monotonic() - t0:.1f} s")

    assert len(ids) == len(set(ids)), f"a batch id was published twice: {ids}"
    assert ids == list(range(len(ids))), ids
    assert len(ids) >= max(at_kill, default=-1) + 1 + MORE
    seen: list[int] = []
    for b in ids:
        values = sorted(batches[b])
        assert values == list(range(b * ROWS, (b + 1) * ROWS)), f"batch {b}"
        seen.extend(values)
    assert sorted(seen) == list(range(len(seen))), "values are not 0..max exactly once"
    assert len(seen) == len(ids) * ROWS

    if point == "after_publish":
        assert KILL_BATCH in at_kill  # published, then the driver died before the ok
        assert stats["duplicate_commits"] >= 1  # re-run after the restart, not republished
        assert stats["commit_errors"] == 0
    elif point == "before_publish":
        assert at_kill == list(range(KILL_BATCH))
        assert stats["commit_errors"] == 1  # the injected one
    else:
        assert stats["commit_errors"] == 0
