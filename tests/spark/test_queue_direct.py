"""PZQ producers -> the queue -> ``readMode=direct`` on local Spark: every message once.

The Kafka-like deployment of issue #26 (requirement 4): a PZQ producer (the stand-in of
the reference's client library, ``tests/loopback/pzq_clients.py``) puts messages into an
in-process queue; a direct query asks the queue's flow producer port for its held window
on a control flow, its tasks read their ranges from the queue's store on range flows,
and the driver's commit acks delete the messages (zio_spark/pzq/flow_ports.py,
docs/direct-read.md "The queue's flow producer").
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.loopback.pzq_clients import PzqProducer
from tests.support import free_endpoint, wait_until, zio_stream
from zio_spark.protocol.message import join_single
from zio_spark.pzq.broker import QueueBroker

T = 120.0  # seconds: every wait of a test is bounded by this


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[QueueBroker]:
    b = QueueBroker(tmp_path / "store", flow_producer="tcp://127.0.0.1:*", linger_ms=0).start()
    yield b
    b.stop()


def _produce(ctx: zmq.Context[Any], endpoint: str, first: int, n: int) -> None:
    """Messages ``first .. first + n - 1``, each acked (durable) by the queue."""
    producer = PzqProducer(ctx, endpoint)
    try:
        for i in range(first, first + n):
            producer.produce(b"m-%05d" % i, [b"body-%05d" % i, b"part-%05d" % i], 10_000)
    finally:
        producer.close()


def test_pzq_producer_to_queue_to_direct_query_every_message_once(
    spark: Any, ctx: zmq.Context[Any], queue: QueueBroker, tmp_path: Path
) -> None:
    port = queue._flows.producer if queue._flows is not None else None
    assert port is not None
    pid = f"queue:{queue.queue_id.decode()}"
    first_wave, second_wave = 1200, 400
    _produce(ctx, queue.endpoints["receive"], 0, first_wave)
    got: list[tuple[bytes, bytes, int, str, dict[str, str]]] = []
    df = zio_stream(
        spark,
        queue.endpoints["flow_producer"],
        tmp_path,
        readMode="direct",
        maxRecordsPerPartition="500",
    )
    q = (
        df.writeStream.foreachBatch(
            lambda b, _: got.extend(
                (bytes(r.key), bytes(r.value), r.seq, r.producer, dict(r.headers or {}))
                for r in b.select("key", "value", "seq", "producer", "headers").collect()
            )
        )
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    total = first_wave + second_wave
    try:
        wait_until(
            lambda: len(got) >= first_wave or q.exception() is not None,
            what="the first wave",
            timeout=T,
        )
        _produce(ctx, queue.endpoints["receive"], first_wave, second_wave)
        wait_until(
            lambda: len(got) >= total or q.exception() is not None,
            what="the second wave",
            timeout=T,
        )
        # Commits lag a batch: the acks delete the first wave at the latest after the
        # next trigger's latestOffset.
        wait_until(
            lambda: int(queue.stats()["flow_acked"]) >= first_wave or q.exception() is not None,
            what="the driver's commit acks deleting the first wave",
            timeout=T,
        )
        assert q.exception() is None, q.exception()
    finally:
        q.stop()
    assert sorted(seq for *_, seq, _, _ in got) == list(range(1, total + 1))  # once each
    keys = sorted(k for k, *_ in got)
    assert keys == [b"m-%05d" % i for i in range(total)]
    for key, value, _, producer, headers in got:
        i = int(key[2:])
        assert value == join_single([b"body-%05d" % i, b"part-%05d" % i])  # both parts
        assert headers == {"zio.frames": "2"} and producer == pid
    # Read directly: range and control flows only, no taker, no spool.
    assert port.counters["takers"] == 0
    assert port.range_stats["range_flows"] >= 2 and port.range_stats["control_flows"] >= 1
    assert not (tmp_path / "spool").exists()
    left = int(queue.stats()["messages"])
    assert left == total - int(queue.stats()["flow_acked"]) and left <= second_wave


CHAOS_SIZES = {
    # messages, queue kills, maxRecordsPerTrigger, test timeout (s)
    "ci": (6_000, 2, 400, 300),
    "full": (200_000, 5, 5_000, 1200),
}


@pytest.mark.parametrize(
    "size",
    [
        pytest.param("ci", marks=pytest.mark.timeout(CHAOS_SIZES["ci"][3])),
        pytest.param(
            "full", marks=[pytest.mark.chaos, pytest.mark.timeout(CHAOS_SIZES["full"][3])]
        ),
    ],
)
def test_queue_sigkilled_while_a_direct_query_reads_loses_and_duplicates_nothing(
    spark: Any, ctx: zmq.Context[Any], tmp_path: Path, size: str
) -> None:
    """The queue process is SIGKILLed at random (seeded) moments while a PZQ producer
    feeds it and a ``readMode=direct`` query reads it, and restarted on its store and
    endpoints. A task reading when the queue dies fails the query (local Spark does not
    retry tasks); it is restarted from its checkpoint, as an operator would, and re-plans
    the same ranges in the same incarnation. ``foreachBatch`` output is kept per batch id
    (a re-run batch replaces its first run), so the output is exactly once: every message
    once, none lost; at the end the commit acks have emptied the store."""
    from tests.loopback.test_broker import _start_queue, monitor
    from tests.reliability.helpers import KillPlan, chaos_rng, run_with_kills
    from tests.reliability.test_queue_chaos import Producer as ChaosProducer

    n, kills, per_trigger, timeout = CHAOS_SIZES[size]
    _, rng = chaos_rng(f"queue-direct/{size}")
    plan = KillPlan.draw(rng, "queue", kills, n, max_delay=0.5)
    store = tmp_path / "store"
    names = ("receive", "send", "monitor", "flow-producer")
    fixed = [a for name in names for a in (f"--{name}", free_endpoint())]
    flow_ep = fixed[fixed.index("--flow-producer") + 1]
    procs: list[subprocess.Popen[bytes]] = []

    def start_queue() -> dict[str, str]:
        proc, info = _start_queue(store, "--ack-timeout", "60s", *fixed)
        procs.append(proc)
        return info

    batches: dict[int, list[bytes]] = {}  # batch id -> message ids (a re-run replaces)
    queries: list[Any] = []
    failures: list[str] = []

    def start_query() -> None:
        df = zio_stream(
            spark,
            flow_ep,
            tmp_path,
            readMode="direct",
            connectTimeout="5s",
            maxRecordsPerTrigger=str(per_trigger),
        )
        queries.append(
            df.writeStream.foreachBatch(
                lambda b, i: batches.__setitem__(
                    i, [bytes(r.key) for r in b.select("key").collect()]
                )
            )
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )

    def read() -> set[bytes]:
        return {k for keys in list(batches.values()) for k in keys}

    stop = threading.Event()
    info = start_queue()
    producer = ChaosProducer(ctx, info["receive"], n, stop)
    try:
        producer.start()
        start_query()

        def kill_queue() -> None:
            os.kill(procs[-1].pid, signal.SIGKILL)
            procs[-1].wait(10)
            start_queue()  # same store, same endpoints

        def progress() -> int:
            assert producer.error is None, repr(producer.error)
            q = queries[-1]
            if not q.isActive:
                error = q.exception()
                failures.append(str(error)[:300])
                assert len(failures) <= 4 * kills, f"the query keeps failing: {failures}"
                start_query()  # a task read while the queue was down: restart it
            return len(read())

        took = run_with_kills(progress, n, {"queue": (plan, kill_queue)}, timeout - 60, "rows")
        mon = ctx.socket(zmq.REQ)
        mon.linger = 0
        try:
            mon.connect(fixed[fixed.index("--monitor") + 1])
            wait_until(
                lambda: monitor(mon)["messages"] == "0",
                what="the commit acks emptying the store",
                timeout=60,
            )
        finally:
            mon.close(linger=0)
    finally:
        stop.set()
        for q in queries:
            q.stop()
        producer.join(10)
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    print(
        f"queue-direct/{size}: {n} messages in {took:.1f} s, kills {plan.done}, "
        f"{len(queries)} query runs, {len(batches)} batches, failures {failures}",
        flush=True,
    )
    got = [k for _, keys in sorted(batches.items()) for k in keys]
    assert len(got) == len(set(got)), "a message read twice"
    assert set(got) == {b"m-%07d" % i for i in range(n)}, "a message lost"
    assert plan.finished
