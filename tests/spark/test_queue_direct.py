"""PZQ producers -> the queue -> ``readMode=direct`` on local Spark: every message once.

The Kafka-like deployment of issue #26 (requirement 4): a PZQ producer (the stand-in of
the reference's client library, ``tests/loopback/pzq_clients.py``) puts messages into an
in-process queue; a direct query asks the queue's flow producer port for its held window
on a control flow, its tasks read their ranges from the queue's store on range flows,
and the driver's commit acks delete the messages (zio_spark/pzq/flow_ports.py,
docs/direct-read.md "The queue's flow producer").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.loopback.pzq_clients import PzqProducer
from tests.support import wait_until, zio_stream
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
