"""Source in ``readMode=direct`` under chaos: ``readStream.format("zio")`` reading ranges
straight from a bound producer -> parquet, while the Spark driver and the producer are
SIGKILLed at random (seeded) moments and restarted; the committed parquet output holds
every record exactly once (issue #26, requirement 6).

No spool and no taker here: the driver asks the producer's held window and acks Spark's
commits on its control flow, and each task reads its range from the producer. So the
records live only in the producer until a commit acks them, and what makes a producer
kill harmless is its on-disk retention (``Producer(retention_dir=...)``): the restarted
producer (``producer_child.py ... direct DIR``, same id, same endpoint, same folder)
finds its records, its numbering and its incarnation there, serves the ranges planned
before the kill (a task the kill cut short is retried: ``local[2,8]``) and numbers on
after the last record the folder holds. A restarted driver re-plans the batch its
offsets log holds without a commit from the same offsets, which the producer still holds
(acks follow commits only).

Kill moments are drawn as in test_source_chaos.py (progress target, then a random
delay; the seed printed, ``ZIO_CHAOS_SEED`` replays them); a producer kill then waits up
to :data:`READ_WAIT_S` for a task to be reading a range (a second connection to the
producer's port next to the driver's control flow), so that kills cut reads.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.reliability.helpers import (
    Child,
    KillPlan,
    ParquetProgress,
    chaos_rng,
    check_exactly_once,
    run_with_kills,
    seq_report,
    wait_until,
)
from tests.reliability.test_source_chaos import _read

PRODUCER_ID = "chaos-direct"

SIZES = {
    # records, driver kills, producer kills, producer rate (records/s),
    # maxRecordsPerTrigger, test timeout (s). CI: production spans ~24 s, so that the
    # producer's kill (drawn on the committed output) comes while it still sends.
    "ci": (24_000, 1, 1, 1_000, 2_500, 240),
    "full": (1_000_000, 5, 3, 15_000, 15_000, 1200),
}


READ_WAIT_S = 5.0  # a producer kill waits at most this long for a task's range read


def _readers(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` from this machine's clients:
    the driver's control flow, plus one per task reading a range."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        n += f[3] == "01" and f[2] == f"0100007F:{port:04X}"
    return n


@pytest.mark.parametrize(
    "size",
    [
        pytest.param("ci", marks=pytest.mark.timeout(SIZES["ci"][5])),
        pytest.param("full", marks=[pytest.mark.chaos, pytest.mark.timeout(SIZES["full"][5])]),
    ],
)
def test_direct_source_driver_and_producer_kills_exactly_once(tmp_path: Path, size: str) -> None:
    n, driver_kills, producer_kills, rate, per_trigger, timeout = SIZES[size]
    _, rng = chaos_rng(f"source-direct/{size}")
    delay = 3.0 if size == "full" else 1.0
    driver_plan = KillPlan.draw(rng, "driver", driver_kills, n, max_delay=delay)
    # Up to 40 % of the committed output: the producer runs a few batches ahead of the
    # commits, and its kills should come while it still has records to send.
    producer_plan = KillPlan.draw(rng, "producer", producer_kills, n, max_delay=delay, upto=0.4)
    out, ckpt, retention = tmp_path / "out", tmp_path / "ckpt", tmp_path / "retention"
    logs = tmp_path / "logs"
    logs.mkdir()
    children: list[Child] = []
    flow_open: list[bool] = []  # per producer kill: a task's range flow was open

    def start_producer(where: str) -> Child:
        args = [where, PRODUCER_ID, n, rate, "direct", retention]
        p = Child("producer_child.py", args, logs / f"producer-{len(children)}")
        children.append(p)
        return p

    def start_driver() -> Child:
        args = ["direct", endpoint, ckpt, out, per_trigger, "local[2,8]"]
        d = Child("driver_child.py", args, logs / f"driver-{len(children)}")
        children.append(d)
        return d

    t0 = time.monotonic()
    try:
        producer = start_producer("tcp://127.0.0.1:*")
        endpoint = wait_until(lambda: producer.line("ENDPOINT"), 30, "the producer's endpoint")
        driver = start_driver()
        wait_until(driver.started, 120, "the first driver's query to start")
        current = {"driver": driver, "producer": producer}

        def kill_driver() -> None:
            current["driver"].kill()
            current["driver"] = start_driver()

        port = int(endpoint.rsplit(":", 1)[1])

        def kill_producer() -> None:
            # Preferably while a task reads a range (it then fails and is retried against
            # the restarted producer): wait a little for one, bounded.
            deadline = time.monotonic() + READ_WAIT_S
            while _readers(port) < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            flow_open.append(_readers(port) >= 2)
            current["producer"].kill()
            current["producer"] = start_producer(endpoint)  # same endpoint, same folder

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
        incarnations = [i for c in producers for i in c.lines("INCARNATION")]
        last_incarnation = current["producer"].line("INCARNATION")
        drivers = [c for c in children if c.log.name.startswith("driver")]
        refused = [c.log.name for c in drivers if "COMMIT ACK REFUSED" in c.log.read_text()]
        retries = sum(c.log.read_text().count("Lost task") for c in drivers)
        for c in current.values():
            assert c.proc.poll() is None, c.output()
        current["driver"].stop()
        orphans = committed.orphans()
        table = _read(out)
    finally:
        for c in children:
            c.stop(grace=5.0)

    print(
        f"source-direct/{size}: {n} records, driver kills {driver_plan.done}, producer kills "
        f"{producer_plan.done} (a range flow open at the kill: {flow_open}, task retries "
        f"{retries}), producer resumes {resumes}, {orphans} uncommitted parquet files "
        f"ignored, {took:.1f} s to all committed, {time.monotonic() - t0:.1f} s total"
    )
    check_exactly_once(table, n, PRODUCER_ID)
    # Every restart of the producer reopened its folder: one numbering throughout (a new
    # incarnation would have made the query skip the old one's records as lost). A
    # producer killed while it was still starting printed none: the first and the last
    # one did.
    assert len(set(incarnations)) == 1 and incarnations[0] == last_incarnation, incarnations
    assert resumes[0] == 0 and all(r > 0 for r in resumes[1:]), resumes
    assert not refused, f"commit acks refused in {refused}"
    for plan in (driver_plan, producer_plan):
        # Each kill hit a running stream (else the restart had nothing left to prove).
        assert [p < n for _, p in plan.done] == [True] * len(plan.targets), plan
