"""An ack from the queue means "stored", also when ids are reused across a crash.

PZQ's own producer (``producer.php``) numbers its ids ``id-0, id-1, ...`` afresh on every
run. The queue's ``resend`` rule takes a repeated id for a resend only when it can be one
(among them: found on disk less than ``--dedup-grace`` after a restart, the ack possibly
lost with the killed process) *and* its body is the one stored under that id (a digest in
the store's index). Here: three runs of 400 messages with the same ids around a SIGKILL
of the queue, a stock PZQ consumer (connects, never speaks first) connected throughout:
every body is delivered. And a true resend after the restart (same ids, same bodies) is
still stored once.

The queue runs as a process (``python -m zio_spark.cli.queue``), restarted on the same
store and endpoints; ``--dedup-grace 1h`` keeps every run after the restart inside the
grace window whatever the machine's load (the case the digest must decide).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.loopback.pzq_clients import PzqConsumer, PzqMonitor, PzqProducer
from tests.loopback.test_broker import queue_process  # noqa: F401  (the fixture)
from tests.support import wait_until

Start = Callable[..., tuple[subprocess.Popen[bytes], dict[str, str]]]

N = 400
WAIT_S = 10.0  # for the next delivery or ack: a bound on progress, not on the whole run
# The consumer reads only after a run is produced; a delivery older than the ack timeout
# would be skipped as expired (PzqConsumer, as PZQ's client), so the timeout is long.
QUEUE_ARGS = ("--ack-timeout", "10m", "--dedup-grace", "1h")


def _body(run: int, i: int) -> bytes:
    return b"run%d:id-%d" % (run, i)


def _produce_run(ctx: zmq.Context[Any], endpoint: str, run: int) -> None:
    """One run of the reference producer: a fresh connection, ids id-0.., every message
    acked "1" (PzqProducer raises otherwise)."""
    producer = PzqProducer(ctx, endpoint)
    try:
        for i in range(N):
            assert producer.produce(b"id-%d" % i, _body(run, i), int(WAIT_S * 1000))
    finally:
        producer.close()


def _consume_until(
    consumer: PzqConsumer, want: set[bytes], seen: collections.Counter[bytes]
) -> None:
    """Consume and ack deliveries until every body of ``want`` was seen; fail if the next
    delivery takes longer than ``WAIT_S``. Each delivery's id must be its body's."""
    while not want <= seen.keys():
        message = consumer.consume(WAIT_S)
        if message is None:
            missing = sorted(want - seen.keys())
            pytest.fail(f"{len(missing)} bodies never delivered, e.g. {missing[:5]}")
        assert len(message.message) == 1
        body = message.message[0]
        assert body.split(b":", 1)[1] == message.id, "delivered under its own id"
        seen[body] += 1
        consumer.ack(message)


class Queue:
    """The queue process on the store ``tmp_path / "q"`` (``QUEUE_ARGS``); ``info`` holds
    its endpoints."""

    def __init__(self, start: Start, store: Path) -> None:
        self.start, self.store = start, store
        self.proc, self.info = start(store, *QUEUE_ARGS)

    def kill_and_restart(self) -> dict[str, str]:
        """SIGKILL the queue, then start it again on the same store and endpoints; returns
        the new process's endpoints."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        info = self.info
        _, info2 = self.start(
            self.store, *QUEUE_ARGS,
            "--receive", info["receive"], "--send", info["send"], "--monitor", info["monitor"],
        )  # fmt: skip
        return info2


@pytest.fixture
def queue(queue_process: Start, tmp_path: Path) -> Queue:  # noqa: F811
    return Queue(queue_process, tmp_path / "q")


def _stats(ctx: zmq.Context[Any], endpoint: str) -> dict[str, int]:
    mon = PzqMonitor(ctx, endpoint)
    try:
        return {k: int(v) for k, v in mon.get_stats().items() if v.isdigit()}
    finally:
        mon.close()


def test_three_runs_with_the_same_ids_around_a_sigkill_deliver_every_body(
    queue: Queue, ctx: zmq.Context[Any]
) -> None:
    info = queue.info
    consumer = PzqConsumer(ctx, info["send"])  # connected throughout, never speaks first
    try:
        seen: collections.Counter[bytes] = collections.Counter()
        _produce_run(ctx, info["receive"], 1)
        _consume_until(consumer, {_body(1, i) for i in range(N)}, seen)
        run1_seen = sum(seen.values())
        # SIGKILL: acks of the last deliveries may die with it.
        info2 = queue.kill_and_restart()
        _produce_run(ctx, info2["receive"], 2)
        _produce_run(ctx, info2["receive"], 3)
        every = {_body(r, i) for r in (1, 2, 3) for i in range(N)}
        _consume_until(consumer, every, seen)

        assert set(seen) == every, "nothing but the bodies sent"
        assert len(every) == 3 * N
        # Only run 1 can come twice: deliveries whose ack had not reached the disk.
        assert all(seen[_body(r, i)] == 1 for r in (2, 3) for i in range(N))
        stats = _stats(ctx, info2["monitor"])
        assert (stats["received"], stats["stored"], stats["duplicates"]) == (2 * N, 2 * N, 0)
        after = sum(seen.values()) - run1_seen  # deliveries by the restarted queue
        redelivered_run1 = after - 2 * N
        assert 0 <= redelivered_run1 <= N
        # Its monitor agrees: everything it delivered was acked, nothing is left.
        wait_until(lambda: _stats(ctx, info2["monitor"])["messages"] == 0, WAIT_S, "the last acks")
        stats = _stats(ctx, info2["monitor"])
        assert (stats["delivered"], stats["acked"], stats["messages_in_flight"]) == (
            after,
            after,
            0,
        )
        print(
            f"run 1 bodies delivered again after the restart: {redelivered_run1}; "
            f"after the restart: received {stats['received']}, stored {stats['stored']}, "
            f"duplicates {stats['duplicates']}"
        )
    finally:
        consumer.close()


def test_a_true_resend_after_a_sigkill_is_stored_once(queue: Queue, ctx: zmq.Context[Any]) -> None:
    _produce_run(ctx, queue.info["receive"], 1)
    info2 = queue.kill_and_restart()  # as if every ack had died with it
    _produce_run(ctx, info2["receive"], 1)  # the same ids with the same bodies: resends
    stats = _stats(ctx, info2["monitor"])
    assert (stats["received"], stats["stored"], stats["duplicates"]) == (N, 0, N)
    assert stats["messages"] == N, "each stored once"
    consumer = PzqConsumer(ctx, info2["send"])
    try:
        seen: collections.Counter[bytes] = collections.Counter()
        _consume_until(consumer, {_body(1, i) for i in range(N)}, seen)
        assert set(seen.values()) == {1}
        assert consumer.consume(0.3) is None, "nothing delivered twice"
    finally:
        consumer.close()
