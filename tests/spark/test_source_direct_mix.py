"""``readMode=direct`` with givers of both kinds in one query, and with ``group``
discovery: driven hook by hook as Spark 4.2+ calls the runner (``latestOffset(start,
limit)``, ``partitions``, ``read``, ``commit``), against producers on loopback, with no
Spark session (docs/direct-read.md, "The Spark side").

The plain giver here is an *older zio-spark producer*: a bound giver with acks whose BOTs
state no range capability (its port serves the taker's flow only), so the query reads it
through the receiver and the spool, with the exactly-once guarantee of that path.
"""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any

import pyarrow as pa

from tests.support import free_endpoint, wait_until
from zio_spark.options import parse_source_options
from zio_spark.source.producer import Producer
from zio_spark.spark.compat import ReadMaxRows
from zio_spark.spark.source import DirectPartition, ZioPartition, ZioStreamReader
from zio_spark.transport.giver import GiverHandler

T = 60.0  # seconds: every wait of a test is bounded by this

Row = tuple[str, int, bytes]


def _older_producer(ctx: Any, producer_id: str, bind: str = "tcp://127.0.0.1:*") -> Producer:
    """A zio-spark producer from before the range protocol: its port's flows are the
    plain giver's (``GiverHandler``: acks, ``resume``, no ``ranges`` in its BOTs)."""
    p = Producer(ctx=ctx, producer_id=producer_id, linger_ms=0, bind=bind)
    server = p._server
    assert server is not None
    server.handler_factory = lambda: GiverHandler(p._backlog, p._ranges.policy)
    return p


def _reader(tmp_path: Any, **options: str) -> ZioStreamReader:
    raw = {
        "readMode": "direct",
        "spoolPath": str(tmp_path / "spool"),
        "connectTimeout": "5s",
        **options,
    }
    return ZioStreamReader(parse_source_options(raw), ("producer", "seq", "value"))


def _read(r: ZioStreamReader, start: dict[str, Any], end: dict[str, Any]) -> list[Row]:
    """A batch as a task would read it: every partition ``partitions`` planned."""
    out: list[Row] = []
    for part in r.partitions(start, end):
        for batch in r.read(part):
            assert isinstance(batch, pa.RecordBatch)
            out += zip(
                batch.column("producer").to_pylist(),
                batch.column("seq").to_pylist(),
                batch.column("value").to_pylist(),
                strict=True,
            )
    return out


def _values(tag: str, first: int, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(first, first + n)]


def _want(tag: str, n: int) -> list[Row]:
    return [(tag, i + 1, v) for i, v in enumerate(_values(tag, 0, n))]


def _run(
    r: ZioStreamReader,
    start: dict[str, Any],
    got: list[Row],
    done: Any,
    what: str,
    limit: Any = None,
) -> dict[str, Any]:
    """Micro-batches as Spark runs them (latestOffset, read, commit) until ``done()``;
    returns the last end."""
    deadline = time.monotonic() + T
    while not done():
        assert time.monotonic() < deadline, f"{what}: read {len(got)} rows by the deadline"
        end = r.latestOffset(start, limit)
        got += _read(r, start, end)
        r.commit(end)
        start = end
    return start


def _of(rows: list[Row], producer: str) -> list[Row]:
    return sorted(row for row in rows if row[0] == producer)


def test_a_plain_giver_and_a_capable_producer_across_a_restart_read_once(ctx, tmp_path):
    """A continuous query reading a capable producer directly and an older producer
    through the spool; its runner stops with a batch planned and not committed, both
    keep producing, a new runner on the same spool re-runs that batch and goes on:
    every record of both once, in order, and both acked up to what was committed."""
    cap = Producer(ctx=ctx, producer_id="cap", linger_ms=0, bind="tcp://127.0.0.1:*")
    old = _older_producer(ctx, "old")
    try:
        endpoints = f"{cap.endpoint},{old.endpoint}"
        cap.send_many(_values("cap", 0, 300))
        old.send_many(_values("old", 0, 200))
        got: list[Row] = []
        r = _reader(tmp_path, endpoints=endpoints)
        try:
            start = r.initialOffset()
            end = _run(
                r,
                start,
                got,
                lambda: len(_of(got, "cap")) == 300 and len(_of(got, "old")) == 200,
                "the first wave",
            )
            cap.send_many(_values("cap", 300, 100))
            old.send_many(_values("old", 200, 100))
            rt = r._rt
            assert rt is not None  # the spool runtime, for the older producer
            wait_until(
                lambda: rt.spool.backlog().get("old", 0) == 100,
                T,
                "the older producer's second wave in the spool",
            )
            planned = r.latestOffset(end, None)  # planned (in the offset log), never run
        finally:
            r.stop()
        assert planned["old"] == 301 and planned["cap"]["end"] == 401
        cap.send_many(_values("cap", 400, 50))
        old.send_many(_values("old", 300, 50))

        r = _reader(tmp_path, endpoints=endpoints)
        try:
            got += _read(r, end, planned)  # the uncommitted batch, re-run
            r.commit(planned)
            _run(
                r,
                planned,
                got,
                lambda: len(_of(got, "cap")) >= 450 and len(_of(got, "old")) >= 350,
                "the rest after the restart",
            )
        finally:
            r.stop()
        assert _of(got, "cap") == _want("cap", 450)
        assert _of(got, "old") == _want("old", 350)
        assert len(got) == 800  # no row twice
        # Both acked exactly what was committed: the last commit's end - 1.
        wait_until(lambda: (cap.acked, old.acked) == (450, 350), T, "the last commit's acks")
        assert cap.stats.get("takers", 0) == 0  # read directly only
        assert old.stats.get("range_flows", 0) == 0 and old.stats.get("control_flows", 0) == 0
    finally:
        cap.close(flush=False, timeout=5)
        old.close(flush=False, timeout=5)
