"""The zio source and sink on a real Spark standalone cluster on this machine.

``scripts/local-cluster.sh`` starts a master and two workers, each a separate process
group with its own work, local and temp folders, running in a private mount namespace
where the folder holding the driver's spool is an empty tmpfs. The driver
(``cluster_driver.py``) is a third process: its executors live in the workers' process
groups and cannot see the spool, so every source read must go through the driver's
segment server (counted in the source's progress report, ``segmentRequests``).

The query reads a producer (this process) and writes to a consumer (this process):
``format("zio")`` to ``format("zio")``. Mid-stream one worker's whole process group
(worker JVM, its executor and Python workers) is SIGKILLed. The consumer must then hold
every record exactly once, in batches published once each, in order.

Needs root (mount namespaces); behind the ``cluster`` marker (about 2-4 minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.spark_procs import ROOT, Proc, descendants, kill_tree, spark_env
from zio_spark.sink.consumer import Consumer
from zio_spark.source.producer import Producer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

N = 60_000  # records; the source takes at most 3000 per micro-batch


def _needs_root() -> None:
    why = None
    if os.geteuid() != 0:
        why = f"mount namespaces need root; running as uid {os.geteuid()}"
    elif shutil.which("unshare") is None:
        why = "util-linux's unshare is not installed"
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the cluster test cannot run: {why}")
        pytest.skip(why)


def _wait(cond, timeout: float, what: str, *procs: Proc):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        for p in procs:
            if not p.alive():
                raise AssertionError(f"{what}: {p.argv[1]} exited:\n{p.tail(60)}")
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.log}\n{p.tail(30)}" for p in procs)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tails}")


def _lines(proc: Proc, prefix: str) -> list[str]:
    text = proc.log.read_text(errors="replace")
    return [ln[len(prefix) :] for ln in text.splitlines() if ln.startswith(prefix)]


def test_cluster_reads_through_segment_server_and_survives_a_worker_kill(tmp_path: Path):
    _needs_root()
    t0 = time.monotonic()
    hidden = tmp_path / "driver-only"  # an empty tmpfs in the workers' mount namespace
    spool = hidden / "spool"
    spool.mkdir(parents=True)
    cluster = Proc(
        [
            "bash",
            str(ROOT / "scripts" / "local-cluster.sh"),
            "--workers",
            "2",
            "--dir",
            str(tmp_path / "cluster"),
            "--hide",
            str(hidden),
        ],
        tmp_path / "local-cluster.log",
        spark_env({"PYTHON": sys.executable}),
    )
    pgids: list[int] = []
    driver: Proc | None = None
    prod = Producer(producer_id="daq-cluster", linger_ms=0)
    consumer = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)
    try:
        _wait(lambda: _lines(cluster, "READY"), 240, "the local cluster", cluster)
        info = dict(ln.split("=", 1) for ln in cluster.log.read_text().splitlines() if "=" in ln)
        pgids = [int(info["MASTER_PID"]), int(info["WORKER1_PID"]), int(info["WORKER2_PID"])]
        t_cluster = time.monotonic() - t0

        first = N // 3
        prod.send_many([b"r%d" % i for i in range(first)])
        driver = Proc(
            [
                sys.executable,
                str(Path(__file__).with_name("cluster_driver.py")),
                info["MASTER"],
                prod.endpoint,
                consumer.endpoint,
                str(spool),
                str(tmp_path / "ckpt"),
                str(N),
            ],
            tmp_path / "driver.log",
            spark_env({"PYTHONPATH": str(ROOT)}),
            cwd=tmp_path,
        )
        _wait(lambda: len(_lines(driver, "PROBE ")) == 8, 300, "the executor probe", driver)
        drv = json.loads(_lines(driver, "DRIVER ")[0])
        probes = [json.loads(x) for x in _lines(driver, "PROBE ")]
        # The driver sees its spool; no executor does (another mount namespace, where the
        # folder is an empty tmpfs), and executors run in the workers' process groups.
        assert drv["spool_exists"] is True
        assert all(p["spool_exists"] is False for p in probes), probes
        assert all(p["mnt"] != drv["mnt"] for p in probes), (drv, probes)
        workers = {pgids[1]: 0, pgids[2]: 0}  # executor Python workers below each worker
        for p in probes:
            below = [w for w in workers if w in p["ancestors"]]
            assert len(below) == 1, (pgids, p)
            workers[below[0]] += 1
        assert all(p["tmp"].startswith(str(tmp_path / "cluster" / "worker-")) for p in probes)

        # Mid-stream: a few batches published, then one worker's whole group dies.
        _wait(lambda: len(consumer.published("cluster")) >= 3, 300, "3 batches", driver)
        victim = max(workers, key=lambda w: workers[w])
        published_at_kill = len(consumer.published("cluster"))
        killed = kill_tree(victim)  # worker JVM, its executor JVM, their Python workers
        t_kill = time.monotonic()
        prod.send_many([b"r%d" % i for i in range(first, N)])

        _wait(lambda: _lines(driver, "DONE ") or _lines(driver, "FAIL "), 600, "DONE", driver)
        assert not _lines(driver, "FAIL "), driver.tail(60)
        assert driver.popen.wait(60) == 0, driver.tail(60)
        wall = time.monotonic() - t0

        progress = [json.loads(x) for x in _lines(driver, "PROGRESS ")]
        requests = max((p["segmentRequests"] or 0) for p in progress)
        pubs = consumer.published("cluster")
        batches = [b for _, b in pubs]
        values = [r.value for _, b in pubs for r in consumer.records("cluster", b)]
        keys = [int(r.key) for _, b in pubs for r in consumer.records("cluster", b)]
        figures = {
            "records": N,
            "rows_published": len(values),
            "batches_published": len(pubs),
            "batches_before_kill": published_at_kill,
            "segment_requests": requests,
            "kills": 1,
            "processes_killed": len(killed),
            "wall_s": round(wall, 1),
            "cluster_start_s": round(t_cluster, 1),
            "after_kill_s": round(time.monotonic() - t_kill, 1),
        }
        print("CLUSTER FIGURES " + json.dumps(figures))
        # Every record exactly once, from batches published once each, in order.
        # (An empty micro-batch publishes nothing: the first one can be empty.)
        assert batches == sorted(set(batches))
        assert set(batches) == {p["batch"] for p in progress if p["rows"]}
        assert len(values) == N and set(values) == {b"r%d" % i for i in range(N)}
        assert sorted(keys) == list(range(1, N + 1))
        assert len(pubs) > published_at_kill  # the query went on after the kill
        assert consumer.stats["commit_errors"] == 0
        # Reads went through the segment server: at least one request per data batch.
        data_batches = sum(1 for p in progress if p["rows"])
        assert requests >= data_batches - 1 > 0, (requests, progress)
        assert re.search(r"ExecutorLost|executor lost|Lost executor", driver.log.read_text())
    finally:
        leftovers = [d for pid in pgids for d in descendants(pid)]
        if driver is not None:
            driver.stop()
        cluster.stop(20)
        for pid in pgids + leftovers:  # whatever the script could not stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        prod.close(flush=False, timeout=5)
        consumer.close()
