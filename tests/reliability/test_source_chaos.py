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

from pathlib import Path

import pytest

from tests.reliability.chaos_harness import SourceChaos, check_kills_hit
from tests.reliability.helpers import KillPlan, chaos_rng, check_exactly_once, size_params
from tests.support import free_endpoint

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


@pytest.mark.parametrize("topology", ["serve", "bind"])
@pytest.mark.parametrize("size", size_params(SIZES))
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
    spool = tmp_path / "spool"
    with SourceChaos(tmp_path, f"source/{size}/{topology}") as run:

        def start_producer() -> None:
            mode = "connect" if topology == "bind" else "bind"
            run.spawn("producer", "producer_child.py", [endpoint, PRODUCER_ID, n, rate, mode])

        def start_driver() -> None:
            backlog = backlog_batches * per_trigger
            args = ["source", endpoint, run.ckpt, run.out, spool, per_trigger, backlog]
            args += [backlog // 600, "bind" if topology == "bind" else "connect"]
            run.spawn("driver", "driver_child.py", args)

        if topology == "bind":  # the source binds a fixed endpoint, across its restarts
            endpoint = free_endpoint()
            start_driver()
            run.started(run.current["driver"])
            start_producer()
        else:  # the producer binds a port of its own, kept across its restarts
            endpoint = "tcp://127.0.0.1:*"
            start_producer()
            endpoint = run.endpoint(run.current["producer"])
            start_driver()
            run.started(run.current["driver"])
        plans = {
            "driver": (driver_plan, run.restarter("driver", start_driver)),
            "producer": (producer_plan, run.restarter("producer", start_producer)),
        }
        run.run(n, plans, timeout, counts={PRODUCER_ID: n})
        resumes = [int(r) for r in run.lines("producer", "RESUME")]
        table = run.finish()

    run.say(
        f"{n} records, driver kills {driver_plan.done}, producer kills {producer_plan.done}, "
        f"producer resumes {resumes}"
    )
    check_exactly_once(table, {PRODUCER_ID: n})
    check_kills_hit((driver_plan, producer_plan), n)
