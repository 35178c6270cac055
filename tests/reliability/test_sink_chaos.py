"""Sink under chaos: ``rate-micro-batch`` -> ``writeStream.format("zio")`` -> a Consumer,
with injected task failures (retried by Spark) and the driver SIGKILLed at random (seeded)
moments and restarted from its checkpoint: every row is published exactly once.

``rate-micro-batch`` makes batch ``b`` hold exactly the values ``b*R .. (b+1)*R - 1``,
the same when Spark re-runs it, so exactly-once is checked value by value. The driver is
``driver_child.py sink`` (as ``tests/spark/sink_driver_child.py`` plus a UDF that fails
the first attempt of a seeded share of the tasks, and always of batch 1's partition 0,
after 900 of their rows); the
consumer lives in this process. Kill moments: once the published rows reach a random
fraction of the total, after a random delay; the seed is printed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.reliability.helpers import Child, KillPlan, chaos_rng, run_with_kills, wait_until
from zio_spark.sink.consumer import Consumer

STREAM = "chaos"  # as driver_child.py
FAIL_PROB = 0.25  # share of tasks whose first attempt fails

SIZES = {
    # rows at least, rows per micro-batch, driver kills, test timeout (s)
    "ci": (24_000, 4_000, 1, 240),
    "full": (1_000_000, 20_000, 5, 1200),
}


class Published:
    """Rows the consumer has published so far (the progress of the run)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self._rows: dict[object, int] = {}

    def __call__(self) -> int:
        for _, b in self.consumer.published(STREAM):
            if b not in self._rows:
                self._rows[b] = self.consumer.rows(STREAM, b)
        return sum(self._rows.values())


@pytest.mark.parametrize(
    "size",
    [
        pytest.param("ci", marks=pytest.mark.timeout(SIZES["ci"][3])),
        pytest.param("full", marks=[pytest.mark.chaos, pytest.mark.timeout(SIZES["full"][3])]),
    ],
)
def test_sink_task_failures_and_driver_kills_exactly_once(tmp_path: Path, size: str) -> None:
    n, rows, kills, timeout = SIZES[size]
    seed, rng = chaos_rng(f"sink/{size}")
    plan = KillPlan.draw(rng, "driver", kills, n, max_delay=1.5)
    logs = tmp_path / "logs"
    logs.mkdir()
    drivers: list[Child] = []
    consumer = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", linger_ms=0)

    def start_driver() -> Child:
        args = ["sink", consumer.endpoint, tmp_path / "ckpt", rows, seed, FAIL_PROB]
        d = Child("driver_child.py", args, logs / f"driver-{len(drivers)}")
        drivers.append(d)
        return d

    def kill_driver() -> None:
        drivers[-1].kill()
        start_driver()

    t0 = time.monotonic()
    try:
        wait_until(start_driver().started, 120, "the first driver's query to start")
        published = Published(consumer)

        def progress() -> int:
            assert drivers[-1].proc.poll() is None, drivers[-1].output()  # no query failure
            return published()

        kill_plans = {"driver": (plan, kill_driver)}
        took = run_with_kills(progress, n, kill_plans, timeout - 60, "rows", more_after_kills=True)
        assert drivers[-1].proc.poll() is None, drivers[-1].output()
        drivers[-1].stop()
        ids = [b for _, b in consumer.published(STREAM)]
        values = {
            b: [int(v) for part in consumer.read(STREAM, b) for v in part.column(0).to_pylist()]
            for b in ids
        }
        stats = dict(consumer.stats)
    finally:
        for d in drivers:
            d.stop(grace=5.0)
        consumer.close()
    failures = {
        hit
        for d in drivers
        for hit in re.findall(
            r"injected task failure: batch (\d+) partition (\d+)", d.log.read_text()
        )
    }
    total = sum(len(v) for v in values.values())
    print(
        f"sink/{size}: {total} rows in {len(ids)} batches, driver kills {plan.done}, "
        f"{len(failures)} task attempts failed on purpose, consumer {stats}, "
        f"{took:.1f} s to {n} rows, {time.monotonic() - t0:.1f} s total"
    )
    assert ids == list(range(len(ids))), f"batches published out of order or twice: {ids}"
    for b in ids:
        assert sorted(values[b]) == list(range(b * rows, (b + 1) * rows)), f"batch {b}"
    assert total == len(ids) * rows >= n
    assert total > max(p for _, p in plan.done)  # the last restarted driver published more
    assert stats["commit_errors"] == 0
    assert failures, "no task failure was injected"
