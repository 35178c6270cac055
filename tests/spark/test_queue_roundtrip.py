"""Spark sink -> the queue -> Spark source, on local Spark: every row exactly once.

The queue runs in-process with both flow ports (zio_spark/pzq/flow_ports.py). A file
stream (three files, one per micro-batch) is written with ``format("zio")`` into the
queue's flow consumer port; a second query reads the queue's flow producer port with
``readStream.format("zio")``. A message from a plain PZQ producer then makes the source
run one more batch, which commits (and so acknowledges) the earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.support import wait_until
from zio_spark.protocol import pzq
from zio_spark.pzq.broker import QueueBroker

FILES, LINES = 3, 300


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[QueueBroker]:
    b = QueueBroker(
        tmp_path / "store",
        flow_producer="tcp://127.0.0.1:*",
        flow_consumer="tcp://127.0.0.1:*",
        linger_ms=0,
    ).start()
    yield b
    b.stop()


def test_sink_to_queue_to_source_every_row_once(
    spark, ctx: zmq.Context, queue: QueueBroker, tmp_path: Path
):
    src = tmp_path / "in"
    src.mkdir()
    expected = []
    for f in range(FILES):
        lines = [f"row-{f}-{i:04d}" for i in range(LINES)]
        expected += lines
        (src / f"part-{f}.txt").write_text("\n".join(lines) + "\n")

    got: list[tuple[bytes, bytes, int]] = []
    reader = (
        spark.readStream.format("zio")
        .option("endpoints", queue.endpoints["flow_producer"])
        .option("spoolPath", str(tmp_path / "spool"))
        .load()
    )
    source_q = (
        reader.writeStream.foreachBatch(
            lambda b, _: got.extend(
                (bytes(r.key), bytes(r.value), r.seq)
                for r in b.select("key", "value", "seq").collect()
            )
        )
        .option("checkpointLocation", str(tmp_path / "ckpt-source"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    sink_q = None
    producer = ctx.socket(zmq.DEALER)
    producer.linger = 0
    try:
        sink_q = (
            spark.readStream.option("maxFilesPerTrigger", 1)
            .text(str(src))
            .writeStream.format("zio")
            .option("endpoint", queue.endpoints["flow_consumer"])
            .option("stream", "rt")
            .option("connectTimeout", "20s")
            .option("checkpointLocation", str(tmp_path / "ckpt-sink"))
            .trigger(processingTime="100 milliseconds")
            .start()
        )
        total = FILES * LINES
        wait_until(
            lambda: len(got) >= total or source_q.exception() or sink_q.exception(),
            what=f"{total} rows through the queue",
            timeout=60.0,
        )
        assert sink_q.exception() is None, sink_q.exception()
        assert source_q.exception() is None, source_q.exception()
        assert queue.stats()["flow_stored"] == total
        # One more message (a plain PZQ producer) makes the source commit what it read.
        producer.connect(queue.endpoints["receive"])
        producer.send_multipart([b"pzq-1", b"", b"from a PZQ producer"])
        assert producer.poll(10_000), "no ack from the queue"
        assert pzq.decode_producer_ack(producer.recv_multipart()).ok
        wait_until(lambda: len(got) > total, what="the PZQ message", timeout=60.0)
        wait_until(
            lambda: int(queue.stats()["flow_acked"]) >= total,
            what="acks for committed rows",
            timeout=60.0,
        )
        assert source_q.exception() is None, source_q.exception()
    finally:
        for q in (sink_q, source_q):
            if q is not None:
                q.stop()
        producer.close()
    assert sorted(seq for _, _, seq in got) == list(range(1, len(got) + 1))
    assert len(got) == FILES * LINES + 1
    values = sorted(v for k, v, _ in got if k != b"pzq-1")
    assert values == sorted(v.encode() for v in expected)  # every row exactly once
    keys = [k for k, _, _ in got]
    assert len(set(keys)) == len(keys) and all(k.startswith(b"rt/") for k in keys if k != b"pzq-1")
    assert int(queue.stats()["messages"]) <= 1  # only the last batch awaits its commit
