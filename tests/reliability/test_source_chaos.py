"""Source under chaos: ``readStream.format("zio")`` -> parquet, while the Spark driver and
the producer are SIGKILLed at random (seeded) moments and restarted; the committed parquet
output holds every record exactly once.

The driver (``driver_child.py source``) restarts from its checkpoint and spool; the
producer (``producer_child.py``) restarts with the same id on the same endpoint and
resumes where the source's ``resume`` says. Two topologies: the producer serves and the
source connects (``serve``), or the source binds and the producer is a flow client
(``bind``, the reference's own topology: a restarted driver binds the same endpoint and
the producer reconnects to it). Kill moments: each kill waits until the
committed output reaches a random fraction of the records, then a random delay (so it may
land mid-batch, mid-commit or during the previous restart); the seed is printed.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.helpers import (
    Child,
    KillPlan,
    ParquetProgress,
    chaos_rng,
    check_exactly_once,
    committed_parquet,
    run_with_kills,
    seq_report,
    wait_until,
)

PRODUCER_ID = "chaos-p"

SIZES = {
    # records, driver kills, producer kills, producer rate (records/s), maxBacklog in
    # micro-batches (maxRecordsPerTrigger = one second of production), test timeout (s)
    "ci": (24_000, 1, 1, 2_500, 3, 240),
    # maxBacklog = 2 batches: a driver killed after writing batch N's offsets but before
    # the runner persisted commit(N-1) leaves the spool's backlog full after the restart,
    # and the source stalls for good (no credit -> no new data -> no new batch -> no
    # commit); see the reliability note. With 3, two batches never fill the backlog.
    "full": (1_000_000, 5, 3, 15_000, 2, 1200),
}


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("topology", ["serve", "bind"])
@pytest.mark.parametrize(
    "size",
    [
        pytest.param("ci", marks=pytest.mark.timeout(SIZES["ci"][5])),
        pytest.param("full", marks=[pytest.mark.chaos, pytest.mark.timeout(SIZES["full"][5])]),
    ],
)
def test_source_driver_and_producer_kills_exactly_once(
    tmp_path: Path, size: str, topology: str
) -> None:
    n, driver_kills, producer_kills, rate, backlog_batches, timeout = SIZES[size]
    per_trigger = rate  # about one second of production per micro-batch at most
    _, rng = chaos_rng(f"source/{size}/{topology}")
    delay = 3.0 if size == "full" else 1.0  # at most ~1/8 of the records' production time
    driver_plan = KillPlan.draw(rng, "driver", driver_kills, n, max_delay=delay)
    # Up to 40 % of the output: the producer runs ahead by up to the backlog, and its
    # kills should come while it still has records to send.
    producer_plan = KillPlan.draw(rng, "producer", producer_kills, n, max_delay=delay, upto=0.4)
    out, ckpt, spool = tmp_path / "out", tmp_path / "ckpt", tmp_path / "spool"
    logs = tmp_path / "logs"
    logs.mkdir()
    children: list[Child] = []

    def start_producer(where: str) -> Child:
        args = [where, PRODUCER_ID, n, rate, "connect" if topology == "bind" else "bind"]
        p = Child("producer_child.py", args, logs / f"producer-{len(children)}")
        children.append(p)
        return p

    def start_driver() -> Child:
        backlog = backlog_batches * per_trigger
        args = ["source", endpoint, ckpt, out, spool, per_trigger, backlog, backlog // 600]
        args.append("bind" if topology == "bind" else "connect")
        d = Child("driver_child.py", args, logs / f"driver-{len(children)}")
        children.append(d)
        return d

    t0 = time.monotonic()
    try:
        if topology == "bind":  # the source binds a fixed endpoint, across its restarts
            endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
            driver = start_driver()
            wait_until(driver.started, 120, "the first driver's query to start")
            producer = start_producer(endpoint)
        else:
            producer = start_producer("tcp://127.0.0.1:*")
            endpoint = wait_until(lambda: producer.line("ENDPOINT"), 30, "the producer's endpoint")
            driver = start_driver()
            wait_until(driver.started, 120, "the first driver's query to start")
        current = {"driver": driver, "producer": producer}

        def kill_driver() -> None:
            current["driver"].kill()
            current["driver"] = start_driver()

        def kill_producer() -> None:
            current["producer"].kill()
            current["producer"] = start_producer(endpoint)

        committed = ParquetProgress(out)

        def progress() -> int:
            for c in current.values():  # neither the query nor the producer failed
                assert c.proc.poll() is None, c.output()
            return committed()

        try:
            took = run_with_kills(
                progress,
                n,
                {"driver": (driver_plan, kill_driver), "producer": (producer_plan, kill_producer)},
                timeout - 60,
                f"{n} committed rows",
            )
        except AssertionError as e:
            got = _read(out).column("seq").to_pylist()
            raise AssertionError(f"{e}\n{seq_report(got, n)}") from e
        producers = [c for c in children if c.log.name.startswith("producer")]
        resumes = [int(r) for c in producers for r in c.lines("RESUME")]
        for c in current.values():
            assert c.proc.poll() is None, c.output()
        current["driver"].stop()
        orphans = committed.orphans()
        table = _read(out)
    finally:
        for c in children:
            c.stop(grace=5.0)

    print(
        f"source/{size}/{topology}: {n} records, driver kills {driver_plan.done}, producer kills "
        f"{producer_plan.done}, producer resumes {resumes}, {orphans} uncommitted parquet "
        f"files ignored, {took:.1f} s to all committed, {time.monotonic() - t0:.1f} s total"
    )
    check_exactly_once(table, n, PRODUCER_ID)
    for plan in (driver_plan, producer_plan):
        # Each kill hit a running stream (else the restart had nothing left to prove).
        assert [p < n for _, p in plan.done] == [True] * len(plan.targets), plan


def _read(out: Path) -> pa.Table:
    """Every committed row of the parquet sink (files of uncommitted batches left out)."""
    parts = [pq.read_table(f, columns=["producer", "seq", "value"]) for f in committed_parquet(out)]
    return pa.concat_tables(parts) if parts else pa.table({"producer": [], "seq": [], "value": []})
