"""The queue read with ``readMode=direct`` under chaos: the PZQ queue process is SIGKILLed
at random (seeded) moments while a producer feeds it and a direct query reads its flow
producer port into parquet, and restarted on its store and endpoints.

The query runs in a driver child on ``local[2,8]`` (``driver_child.py direct``): a task
reading a range while the queue dies fails, is retried against the restarted queue and
reads the same range in the same incarnation (the queue's store keeps every message until
the driver's commit ack deletes it). So the query itself never fails: the driver child
must stay up through every kill (on ``local[2]``, which does not retry a task, such a
kill failed the query, and the test restarted it as an operator would). Each kill waits
up to :data:`~tests.reliability.chaos_harness.READ_WAIT_S` for a task to be reading
from the queue, so that kills cut reads. Verdict: every message committed exactly once
(by its id), and at the end the commit acks have emptied the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import zmq

from tests.loopback.test_broker import _start_queue, monitor
from tests.reliability.chaos_harness import DIRECT_TIMEOUT, SourceChaos, wait_for_a_read
from tests.reliability.helpers import KillPlan, chaos_rng, size_params, wait_until
from tests.reliability.test_queue_chaos import Producer, _reap
from tests.support import TrackingContext, free_endpoint

SIZES = {
    # messages, queue kills, maxRecordsPerTrigger, test timeout (s)
    "ci": (6_000, 2, 400, 240),
    "full": (200_000, 5, 5_000, 1200),
}


@pytest.mark.parametrize("size", size_params(SIZES))
def test_queue_sigkilled_while_a_direct_query_reads_loses_and_duplicates_nothing(
    ctx: TrackingContext, tmp_path: Path, size: str
) -> None:
    n, kills, per_trigger, timeout = SIZES[size]
    _, rng = chaos_rng(f"queue-direct/{size}")
    plan = KillPlan.draw(rng, "queue", kills, n, max_delay=0.5)
    names = ("receive", "send", "monitor", "flow-producer")
    fixed = {name: free_endpoint() for name in names}
    args = [a for name, ep in fixed.items() for a in (f"--{name}", ep)]
    procs: list[subprocess.Popen[bytes]] = []
    read_open: list[bool] = []  # per kill: a task's range flow was open

    def start_queue() -> dict[str, str]:
        proc, info = _start_queue(tmp_path / "store", "--ack-timeout", "60s", *args)
        procs.append(proc)
        return info

    def kill_queue() -> None:
        read_open.append(wait_for_a_read(fixed["flow-producer"]))
        os.kill(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait(10)
        start_queue()  # same store, same endpoints

    stop = threading.Event()
    producer = Producer(ctx, start_queue()["receive"], n, stop)
    try:
        with SourceChaos(tmp_path, f"queue-direct/{size}") as run:
            producer.start()
            driver_args = ["direct", fixed["flow-producer"], run.ckpt, run.out, per_trigger]
            run.spawn(
                "driver", "driver_child.py", [*driver_args, "local[2,8]", "true", DIRECT_TIMEOUT]
            )
            run.started(run.current["driver"])

            def progress() -> int:
                assert producer.error is None, repr(producer.error)
                return run.progress()  # the driver child is still up: the query never failed

            run.run(n, {"queue": (plan, kill_queue)}, timeout, progress=progress)
            mon = ctx.socket(zmq.REQ)
            mon.linger = 0
            try:
                mon.connect(fixed["monitor"])
                wait_until(
                    lambda: monitor(mon)["messages"] == "0",
                    60,
                    "the commit acks emptying the store",
                )
            finally:
                mon.close(linger=0)
            retries = run.retries()
            table = run.finish(columns=("key",))
    finally:
        stop.set()
        producer.join(10)
        _reap(procs)
    run.say(
        f"{n} messages, kills {plan.done} (a range flow open at the kill: {read_open}), "
        f"task retries {retries}, {len(run.of('driver'))} driver run(s)"
    )
    got = table.column("key").to_pylist()
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} messages read twice"
    assert set(got) == {b"m-%07d" % i for i in range(n)}, "a message lost"
    assert len(run.of("driver")) == 1 and plan.finished
