"""The zio sink writing to a ZRE group of consumers, on loopback.

Beacons go to 127.255.255.255 (tests/conftest.py) on a free UDP port per test, so no
test hears another's consumers.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_until
from zio_spark.errors import TransportError
from zio_spark.sink.consumer import Consumer
from zio_spark.spark import sink as sink_mod
from zio_spark.spark.sink import SinkColumns, ZioStreamWriter, sink_options

ROWS = 400  # per micro-batch


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return _free_udp_port()


@pytest.fixture
def consumers(tmp_path: Path, port: int) -> Iterator[list[Consumer]]:
    made: list[Consumer] = []
    try:
        for k in range(2):
            c = Consumer("tcp://127.0.0.1:*", tmp_path / f"consumer{k}", linger_ms=0)
            made.append(c)
            c.advertise("sinks", beacon_port=port, interval=0.1)
        yield made
    finally:
        for c in made:
            c.close()


@pytest.fixture
def driver_nodes() -> Iterator[None]:
    """Writers made in this process cache ZRE nodes: stop them after the test."""
    try:
        yield
    finally:
        sink_mod.driver().stop()


def _group_opts(port: int, group: str = "sinks", timeout: str = "10s") -> dict[str, str]:
    return {
        "group": group,
        "zreBeaconPort": str(port),
        "zreInterval": "100ms",
        "connectTimeout": timeout,
        "stream": "rate",
    }


def test_group_resolves_sorted_consumers_and_spreads_partitions(consumers, port, driver_nodes):
    opts = sink_options(_group_opts(port))
    want = sorted(c.endpoint for c in consumers)

    def both() -> Any:
        t = sink_mod.driver().targets(opts)
        return t if [e for e, _ in t] == want else None

    targets = wait_until(both, 20, "both consumers discovered")
    assert all(mode == "routerdealer" for _, mode in targets)
    w = ZioStreamWriter(opts, SinkColumns("value"))  # reuses the cached node
    assert len(sink_mod.driver().nodes) == 1
    assert w.targets == targets
    assert [sink_mod._target_of(w.targets, p)[0] for p in range(4)] == want * 2


def test_group_with_no_consumers_fails_naming_the_group(port, driver_nodes):
    opts = sink_options(_group_opts(port, group="nobody-home", timeout="500ms"))
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"ZRE group 'nobody-home'.*within 0.5 s"):
        ZioStreamWriter(opts, SinkColumns("value"))
    assert time.monotonic() - t0 < 5


def test_stream_to_group_publishes_every_row_once_across_consumers(
    spark, consumers, port, tmp_path
):
    df = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", ROWS)
        .option("numPartitions", 4)
        .load()
        .selectExpr("cast(value as string) as value")
    )
    w = (
        df.writeStream.format("zio")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="100 milliseconds")
    )
    for k, v in _group_opts(port, timeout="20s").items():
        w = w.option(k, v)
    q = w.start()
    try:
        wait_until(
            lambda: (
                q.exception() is not None or all(len(c.published("rate")) >= 3 for c in consumers)
            ),
            60,
            "3 published batches at each consumer",
        )
        assert q.exception() is None, q.exception()
    finally:
        q.stop()

    per_batch: dict[int, list[int]] = {}
    for c in consumers:
        assert c.stats["commit_errors"] == 0
        for _, b in c.published("rate"):
            assert isinstance(b, int)
            values = [int(r.value) for r in c.records("rate", b)]
            assert values, f"an empty batch {b} was published at {c.endpoint}"
            per_batch.setdefault(b, []).extend(values)
    every = [v for vs in per_batch.values() for v in vs]
    dups = [v for v, n in Counter(every).items() if n > 1]
    assert not dups, f"rows published twice: {dups[:10]}"
    # The last batch may have been committed at one consumer only when the query stopped.
    complete = sorted(per_batch)[:-1]
    assert complete == list(range(len(complete))) and len(complete) >= 2
    for b in complete:
        assert sorted(per_batch[b]) == list(range(b * ROWS, (b + 1) * ROWS)), f"batch {b}"


def test_batch_write_to_group_spreads_partitions(spark, consumers, port):
    want = sorted(c.endpoint for c in consumers)
    # Discovery in this process first, so the writer (in a Spark worker) has peers to hear.
    wait_until(
        lambda: [e for e, _ in sink_mod.driver().targets(sink_options(_group_opts(port)))] == want,
        20,
        "both consumers advertised",
    )
    sink_mod.driver().stop()
    df = spark.range(0, 1000, numPartitions=4).selectExpr("cast(id as string) as value")
    w = df.write.format("zio").mode("append")
    for k, v in {**_group_opts(port), "stream": "b"}.items():
        w = w.option(k, v)
    w.save()
    got: list[int] = []
    for c in consumers:
        pubs = c.published("b")
        assert len(pubs) == 1 and str(pubs[0][1]).startswith("write-")
        got.extend(int(r.value) for r in c.records(*pubs[0]))
    assert sorted(got) == list(range(1000))
