"""The zio sink on local Spark towards a plain ZIO taker that behaves like the reference
(tests/peers/zio_reference.py: a C++ server taker, echoing BOT replies, one flow at a
time). The socket pair here is ROUTER/DEALER; CLIENT/SERVER is covered at the transport
level (tests/loopback/test_consumer_reference.py, draft pass).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tests.peers.zio_reference import ReferenceServer
from tests.support import rate_values


@pytest.fixture
def taker(ctx: zmq.Context[Any]) -> Iterator[ReferenceServer]:
    server = ReferenceServer(ctx, role="taker", flavor="cpp", sockets="routerdealer")
    yield server
    server.close()


def _values(spark, n: int, partitions: int):
    return spark.range(0, n, numPartitions=partitions).selectExpr("cast(id as string) as value")


def _no_command_bot(taker: ReferenceServer) -> None:
    # commit/abort never open a control flow towards a plain taker: it would take the
    # command's BOT for a new flow (and end the one in progress).
    assert [b for b in taker.bots if "command" in b] == []


def test_default_format_sends_a_reference_taker_one_bare_record_per_dat(spark, taker):
    n = 3000
    (
        _values(spark, n, 1)
        .write.format("zio")
        .mode("append")
        .option("endpoint", taker.endpoint)
        .option("connectTimeout", "20s")
        .save()
    )
    assert taker.received == [str(i).encode() for i in range(n)]  # each once, in order
    assert taker.received_labels == [{"flow": "DAT"}] * n
    assert taker.flows_completed == 1 and taker.errors == []
    assert taker.bots[0]["encoding"] == ["arrow", "record"]  # offered; echoed back
    _no_command_bot(taker)


def test_stream_to_a_reference_taker_from_one_partition(spark, taker, tmp_path):
    """Micro-batches one after another (one flow each), commits skip the plain taker."""
    rows = 200
    q = (
        rate_values(spark, rows)
        .coalesce(1)
        .writeStream.format("zio")
        .option("endpoint", taker.endpoint)
        .option("connectTimeout", "20s")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and q.exception() is None:
            if taker.flows_completed >= 3:
                break
            time.sleep(0.05)
        assert q.exception() is None, q.exception()
    finally:
        q.stop()
    assert taker.flows_completed >= 3 and taker.errors == []
    got = [int(v) for v in taker.received]
    assert len(got) >= 3 * rows
    full = len(got) // rows
    for b in range(full):  # each value once, batch after batch
        assert sorted(got[b * rows : (b + 1) * rows]) == list(range(b * rows, (b + 1) * rows))
    # A flow that q.stop() cut short: part of the next batch, nothing twice.
    tail = got[full * rows :]
    assert len(set(tail)) == len(tail) and set(tail) <= set(range(full * rows, (full + 1) * rows))
    _no_command_bot(taker)


def test_explicit_arrow_to_a_reference_taker_fails_naming_endpoint_and_option(spark, taker):
    with pytest.raises(Exception) as info:
        (
            _values(spark, 100, 1)
            .write.format("zio")
            .mode("append")
            .option("endpoint", taker.endpoint)
            .option("format", "arrow")
            .option("connectTimeout", "20s")
            .save()
        )
    text = str(info.value)
    assert "option 'format': got 'arrow'" in text and taker.endpoint in text
    assert taker.received == []  # nothing was sent
    _no_command_bot(taker)


def test_two_partitions_to_a_single_flow_taker_fail_saying_one_flow_at_a_time(spark, taker):
    n = 200_000  # two flows of 100k records: they overlap
    t0 = time.monotonic()
    with pytest.raises(Exception, match="serves one flow at a time") as info:
        (
            _values(spark, n, 2)
            .write.format("zio")
            .mode("append")
            .option("endpoint", taker.endpoint)
            .option("format", "record")
            .option("connectTimeout", "3s")
            .save()
        )
    assert taker.endpoint in str(info.value)
    assert time.monotonic() - t0 < 60
    assert taker.flows_killed >= 1  # what happened: the second BOT ended the first flow
    assert len(taker.received) < n  # and the write did fail with rows missing
    _no_command_bot(taker)


# ------------------------------------------- the driver's commit/abort (no Spark needed)


def test_commit_and_abort_send_no_command_bot_to_a_plain_or_unknown_taker(taker):
    from zio_spark.sink.driver import SinkDriver
    from zio_spark.spark.sink import ZioCommitMessage, sink_options

    driver = SinkDriver()
    commit_batch, abort_batch = driver.commit, driver.abort
    opts = sink_options({"endpoint": taker.endpoint, "connectTimeout": "2s"})
    # Nothing known yet, every partition empty: not known to be a consumer, so no BOT
    # (a command BOT would reach the taker before send_command returns).
    empty = [ZioCommitMessage(taker.endpoint, "zio", 4, p, 0, 0) for p in range(2)]
    commit_batch(opts, empty, 4)
    abort_batch(opts, [], 4)  # failed tasks report nothing (the hook drops None)
    assert taker.bots == []
    # A flow told the driver it is a plain taker: still no command, then or later.
    plain = [ZioCommitMessage(taker.endpoint, "zio", 5, 0, 0, 10, plain=True), empty[1]]
    commit_batch(opts, plain, 5)
    abort_batch(opts, plain, 5)
    commit_batch(opts, empty, 6)
    abort_batch(opts, [], 6)
    assert taker.bots == [] and taker.errors == []


def test_commit_reaches_a_consumer_known_from_an_earlier_batch(ctx: zmq.Context[Any], tmp_path):
    from zio_spark.sink.client import StagingWriter
    from zio_spark.sink.consumer import Consumer
    from zio_spark.sink.driver import SinkDriver
    from zio_spark.spark.sink import ZioCommitMessage, sink_options

    commit_batch = SinkDriver().commit
    c = Consumer("tcp://127.0.0.1:*", tmp_path / "c", ctx=ctx, linger_ms=0, fsync=False)
    try:
        opts = sink_options({"endpoint": c.endpoint, "stream": "s", "connectTimeout": "5s"})
        commit_batch(opts, [ZioCommitMessage(c.endpoint, "s", 0, 0, 0, 0)], 0)
        assert not c.is_committed("s", 0)  # unknown: no command sent
        w = StagingWriter(c.endpoint, "s", 2, 0, format="record", ctx=ctx, timeout=5)
        w.write_values([b"a", b"b"])
        assert w.close() == 2 and not w.plain_peer
        commit_batch(opts, [ZioCommitMessage(c.endpoint, "s", 2, 0, 0, 2)], 2)
        assert [r.value for r in c.records("s", 2)] == [b"a", b"b"]
        # Now known as a consumer: an all-empty batch is recorded there again.
        commit_batch(opts, [ZioCommitMessage(c.endpoint, "s", 3, 0, 0, 0)], 3)
        assert c.is_committed("s", 3)
    finally:
        c.close()
