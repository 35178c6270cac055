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
from typing import Any

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


def _start_cluster(tmp_path: Path, hide: Path | None) -> Proc:
    """``scripts/local-cluster.sh`` with two workers (``hide``: a folder the workers see
    as an empty tmpfs)."""
    argv = ["bash", str(ROOT / "scripts" / "local-cluster.sh"), "--workers", "2"]
    argv += ["--dir", str(tmp_path / "cluster")]
    if hide is not None:
        argv += ["--hide", str(hide)]
    return Proc(argv, tmp_path / "local-cluster.log", spark_env({"PYTHON": sys.executable}))


def _driver(tmp_path: Path, info: dict[str, str], prod: Producer, consumer: Consumer, *rest: str):
    """``cluster_driver.py`` on the cluster: ``rest`` is spool, records[, read mode]."""
    argv = [sys.executable, str(Path(__file__).with_name("cluster_driver.py")), info["MASTER"]]
    argv += [prod.endpoint, consumer.endpoint, rest[0], str(tmp_path / "ckpt"), *rest[1:]]
    env = spark_env({"PYTHONPATH": str(ROOT)})
    return Proc(argv, tmp_path / "driver.log", env, cwd=tmp_path)


def _executors_by_worker(driver: Proc, pgids: list[int]) -> dict[int, int]:
    """Executor Python workers (the probe's tasks) below each worker's process group."""
    _wait(lambda: len(_lines(driver, "PROBE ")) == 8, 300, "the executor probe", driver)
    probes = [json.loads(x) for x in _lines(driver, "PROBE ")]
    workers = {pgids[1]: 0, pgids[2]: 0}
    for p in probes:
        below = [w for w in workers if w in p["ancestors"]]
        assert len(below) == 1, (pgids, p)
        workers[below[0]] += 1
    return workers


def _stop_all(cluster: Proc, driver: Proc | None, pgids: list[int]) -> None:
    leftovers = [d for pid in pgids for d in descendants(pid)]
    if driver is not None:
        driver.stop()
    cluster.stop(20)
    for pid in pgids + leftovers:  # whatever the script could not stop
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _check_published(
    batches: list[int],
    progress: list[dict[str, Any]],
    values: list[bytes],
    keys: list[int],
    pubs: list[Any],
    published_at_kill: int,
    consumer: Consumer,
) -> None:
    """Every record exactly once at the consumer, from batches published once each, in
    order, and the query went on after the kill. (An empty micro-batch publishes
    nothing: the first one can be empty.)"""
    assert batches == sorted(set(batches))
    assert set(batches) == {p["batch"] for p in progress if p["rows"]}
    assert len(values) == N and set(values) == {b"r%d" % i for i in range(N)}
    assert sorted(keys) == list(range(1, N + 1))
    assert len(pubs) > published_at_kill  # the query went on after the kill
    assert consumer.stats["commit_errors"] == 0


def _cluster_ready(cluster: Proc) -> tuple[dict[str, str], list[int]]:
    """Wait for the cluster script's READY; its ``KEY=value`` lines, and the process
    groups of the master and the two workers."""
    _wait(lambda: _lines(cluster, "READY"), 240, "the local cluster", cluster)
    info = dict(ln.split("=", 1) for ln in cluster.log.read_text().splitlines() if "=" in ln)
    return info, [int(info["MASTER_PID"]), int(info["WORKER1_PID"]), int(info["WORKER2_PID"])]


def test_cluster_reads_through_segment_server_and_survives_a_worker_kill(tmp_path: Path):
    _needs_root()
    t0 = time.monotonic()
    hidden = tmp_path / "driver-only"  # an empty tmpfs in the workers' mount namespace
    spool = hidden / "spool"
    spool.mkdir(parents=True)
    cluster = _start_cluster(tmp_path, hidden)
    pgids: list[int] = []
    driver: Proc | None = None
    prod = Producer(producer_id="daq-cluster", linger_ms=0)
    consumer = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)
    try:
        info, pgids = _cluster_ready(cluster)
        t_cluster = time.monotonic() - t0

        first = N // 3
        prod.send_many([b"r%d" % i for i in range(first)])
        driver = _driver(tmp_path, info, prod, consumer, str(spool), str(N))
        workers = _executors_by_worker(driver, pgids)
        drv = json.loads(_lines(driver, "DRIVER ")[0])
        probes = [json.loads(x) for x in _lines(driver, "PROBE ")]
        # The driver sees its spool; no executor does (another mount namespace, where the
        # folder is an empty tmpfs), and executors run in the workers' process groups.
        assert drv["spool_exists"] is True
        assert all(p["spool_exists"] is False for p in probes), probes
        assert all(p["mnt"] != drv["mnt"] for p in probes), (drv, probes)
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
        _check_published(batches, progress, values, keys, pubs, published_at_kill, consumer)
        # Reads went through the segment server: at least one request per data batch.
        data_batches = sum(1 for p in progress if p["rows"])
        assert requests >= data_batches - 1 > 0, (requests, progress)
        assert re.search(r"ExecutorLost|executor lost|Lost executor", driver.log.read_text())
    finally:
        _stop_all(cluster, driver, pgids)
        prod.close(flush=False, timeout=5)
        consumer.close()


def _reading_worker(port: int, pgids: list[int]) -> int | None:
    """The worker (process group) one of whose processes holds an established TCP
    connection to 127.0.0.1:``port`` now (a task's range flow to the producer), if any."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and f[2] == f"0100007F:{port:04X}":  # ESTABLISHED to the port
            inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for worker in pgids:
        for pid in descendants(worker):
            with contextlib.suppress(OSError):
                fds = Path(f"/proc/{pid}/fd")
                if any(os.readlink(fd) in inodes for fd in fds.iterdir()):
                    return worker
    return None


def test_cluster_direct_reads_survive_a_worker_kill(tmp_path: Path):
    """``readMode=direct`` on the cluster: no spool, no receiver; the executors read their
    ranges straight from the producer (this process, a bound ``Producer``), the driver
    acks Spark's commits on its control flow. Mid-stream one worker's whole process group
    dies, its tasks (one may be cut mid-read) run again on the other executor, against the
    records the producer still holds (acks follow commits). The consumer must hold every
    record exactly once, in batches published once each, in order, and the producer must
    end with everything acknowledged and no taker ever attached."""
    t0 = time.monotonic()
    cluster = _start_cluster(tmp_path, None)
    pgids: list[int] = []
    driver: Proc | None = None
    prod = Producer(producer_id="daq-cluster-direct", linger_ms=0)
    consumer = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)
    try:
        info, pgids = _cluster_ready(cluster)
        t_cluster = time.monotonic() - t0

        first = N // 3
        prod.send_many([b"r%d" % i for i in range(first)])
        unused = str(tmp_path / "no-spool")  # readMode=direct makes none
        driver = _driver(tmp_path, info, prod, consumer, unused, str(N), "direct")
        workers = _executors_by_worker(driver, pgids)

        _wait(lambda: len(consumer.published("cluster")) >= 3, 300, "3 batches", driver)
        # The kill should cut a task's read: the worker of an executor that has a range
        # flow open to the producer, caught by polling for a while (bounded; else the
        # busier worker, between reads). The rest of the records come after it.
        port = int(prod.endpoint.rsplit(":", 1)[1])
        more = iter(range(first, N, 500))
        victim, deadline = None, time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            start = next(more, None)
            if start is not None:  # keep batches coming while we look
                prod.send_many([b"r%d" % i for i in range(start, min(start + 500, N))])
            for _ in range(50):
                victim = _reading_worker(port, pgids[1:])
                if victim is not None:
                    break
        mid_read = victim is not None
        if victim is None:
            victim = max(workers, key=lambda w: workers[w])
        published_at_kill = len(consumer.published("cluster"))
        killed = kill_tree(victim)  # worker JVM, its executor JVM, their Python workers
        t_kill = time.monotonic()
        for start in more:
            prod.send_many([b"r%d" % i for i in range(start, min(start + 500, N))])

        _wait(lambda: _lines(driver, "DONE ") or _lines(driver, "FAIL "), 600, "DONE", driver)
        assert not _lines(driver, "FAIL "), driver.tail(60)
        assert driver.popen.wait(60) == 0, driver.tail(60)
        wall = time.monotonic() - t0

        progress = [json.loads(x) for x in _lines(driver, "PROGRESS ")]
        pubs = consumer.published("cluster")
        batches = [b for _, b in pubs]
        values = [r.value for _, b in pubs for r in consumer.records("cluster", b)]
        keys = [int(r.key) for _, b in pubs for r in consumer.records("cluster", b)]
        figures = {
            "read_mode": "direct",
            "records": N,
            "rows_published": len(values),
            "batches_published": len(pubs),
            "batches_before_kill": published_at_kill,
            "range_flows": prod.stats["range_flows"],
            "range_records": prod.stats["range_records"],
            "control_flows": prod.stats["control_flows"],
            "kills": 1,
            "killed_mid_read": mid_read,
            "processes_killed": len(killed),
            "wall_s": round(wall, 1),
            "cluster_start_s": round(t_cluster, 1),
            "after_kill_s": round(time.monotonic() - t_kill, 1),
        }
        print("CLUSTER FIGURES " + json.dumps(figures))
        _check_published(batches, progress, values, keys, pubs, published_at_kill, consumer)
        # A range flow seen open at the kill does not mean records were still to come:
        # the task may have read its whole range while the kill was on its way (seen in
        # 2 of 4 runs: range_records == N). A re-read is reported, not required; every
        # record exactly once at the consumer is.
        print(
            f"CLUSTER RE-READ {prod.stats['range_records'] - N} records "
            f"(a range flow open at the kill: {mid_read})"
        )
        # Direct: ranges read from the producer (at least one flow per data batch), never
        # through a receiver (no taker), no segment server; every commit acked at the end.
        data_batches = sum(1 for p in progress if p["rows"])
        assert prod.stats["range_flows"] >= data_batches > 0, (prod.stats, progress)
        assert prod.stats["range_records"] >= N
        assert prod.stats["takers"] == 0 and prod.stats["control_flows"] >= 1, prod.stats
        assert all(p["segmentRequests"] is None for p in progress), progress
        assert prod.acked == N and prod.pending == 0, (prod.acked, prod.pending)
        assert re.search(r"ExecutorLost|executor lost|Lost executor", driver.log.read_text())
    finally:
        _stop_all(cluster, driver, pgids)
        prod.close(flush=False, timeout=5)
        consumer.close()
