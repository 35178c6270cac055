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
import pytest

from tests.support import free_endpoint, wait_until
from zio_spark.errors import TransportError
from zio_spark.options import parse_source_options
from zio_spark.source.producer import Producer
from zio_spark.spark.compat import ReadMaxRows
from zio_spark.spark.source import ZioStreamReader
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


def test_one_max_records_per_trigger_budget_over_both_paths(ctx, tmp_path):
    """maxRecordsPerTrigger is one budget per batch, shared fairly by a producer read
    directly and an older one read through the spool (not that many per path)."""
    cap = Producer(ctx=ctx, producer_id="cap", linger_ms=0, bind="tcp://127.0.0.1:*")
    old = _older_producer(ctx, "old")
    try:
        cap.send_many(_values("cap", 0, 1000))
        old.send_many(_values("old", 0, 300))
        got: list[Row] = []
        r = _reader(tmp_path, endpoints=f"{cap.endpoint},{old.endpoint}")
        try:
            start = r.initialOffset()
            rt = r._rt
            assert rt is not None
            wait_until(lambda: rt.spool.backlog().get("old", 0) == 300, T, "old in the spool")
            sizes = []
            while len(got) < 1300:
                assert len(sizes) < 10, sizes
                end = r.latestOffset(start, ReadMaxRows(500))
                batch = _read(r, start, end)
                sizes.append((len(_of(batch, "cap")), len(_of(batch, "old"))))
                got += batch
                r.commit(end)
                start = end
        finally:
            r.stop()
        # 250 each while both have records waiting; then the direct producer takes
        # what the older one leaves (50 left of its 300).
        assert sizes == [(250, 250), (450, 50), (300, 0)], sizes
        assert _of(got, "cap") == _want("cap", 1000) and _of(got, "old") == _want("old", 300)
    finally:
        cap.close(flush=False, timeout=5)
        old.close(flush=False, timeout=5)


def test_a_plain_giver_found_after_the_spool_runtime_was_made_joins_the_query(ctx, tmp_path):
    """An endpoint down when the query started answers later as a plain giver, after
    the spool runtime was made for another one: its receiver takes it too (before, the
    query failed), and every record of the three givers is read once."""
    cap = Producer(ctx=ctx, producer_id="cap", linger_ms=0, bind="tcp://127.0.0.1:*")
    old = _older_producer(ctx, "old")
    late_endpoint = free_endpoint()
    late: Producer | None = None
    try:
        cap.send_many(_values("cap", 0, 100))
        old.send_many(_values("old", 0, 100))
        got: list[Row] = []
        r = _reader(
            tmp_path,
            endpoints=f"{cap.endpoint},{old.endpoint},{late_endpoint}",
            connectTimeout="1s",
        )
        try:
            start = r.initialOffset()
            assert r._rt is not None and r._controls is not None
            assert late_endpoint in r._controls.down  # nobody there yet
            start = _run(
                r,
                start,
                got,
                lambda: len(got) == 200,
                "the givers up at the start",
            )
            late = _older_producer(ctx, "late", bind=late_endpoint)
            late.send_many(_values("late", 0, 100))
            cap.send_many(_values("cap", 100, 10))
            _run(r, start, got, lambda: len(got) == 310, "the late plain giver")
            assert late_endpoint in r._controls.plain
        finally:
            r.stop()
        assert _of(got, "cap") == _want("cap", 110)
        assert _of(got, "old") == _want("old", 100)
        assert _of(got, "late") == _want("late", 100)
    finally:
        for p in (cap, old, late):
            if p is not None:
                p.close(flush=False, timeout=5)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_group_discovery_feeds_the_direct_query(ctx, tmp_path):
    """``group`` with readMode=direct, over real ZRE on loopback: a capable producer
    there at the start and one that joins later are read directly (range and control
    flows only), an older producer found in the group through the spool, every record
    once; a producer that leaves the group is down (its offset stays), the others read
    on."""
    group = f"dg-{uuid.uuid4().hex[:8]}"
    port = _free_udp_port()
    made: list[Producer] = []

    def producer(pid: str, older: bool = False) -> Producer:
        p = (
            _older_producer(ctx, pid)
            if older
            else Producer(ctx=ctx, producer_id=pid, linger_ms=0, bind="tcp://127.0.0.1:*")
        )
        made.append(p)
        p.advertise(group, beacon_port=port, interval=0.1)
        return p

    try:
        first = producer("g1")
        first.send_many(_values("g1", 0, 100))
        got: list[Row] = []
        r = _reader(tmp_path, group=group, zreBeaconPort=str(port), zreInterval="100ms")
        try:
            start = _run(r, r.initialOffset(), got, lambda: len(got) == 100, "the first")
            second = producer("g2")  # joins after the query started
            second.send_many(_values("g2", 0, 70))
            older = producer("g3", older=True)
            older.send_many(_values("g3", 0, 30))
            start = _run(r, start, got, lambda: len(got) == 200, "the ones that joined")
            controls = r._controls
            assert controls is not None
            assert controls.plain == {older.endpoint}
            assert controls.where == {"g1": first.endpoint, "g2": second.endpoint}

            first.close(flush=False, timeout=5)  # leaves the group (a leaving beacon)
            second.send_many(_values("g2", 70, 30))
            deadline = time.monotonic() + T
            while "left ZRE group" not in controls.down.get(first.endpoint, ""):
                assert time.monotonic() < deadline, "the leaving producer never seen gone"
                end = r.latestOffset(start, None)
                got += _read(r, start, end)
                r.commit(end)
                start = end
            assert first.endpoint not in controls.endpoints
            start = _run(r, start, got, lambda: len(got) == 230, "after one left")
            assert start["g1"]["end"] == 101  # its offset stays
            # It comes back (restarted without its records, on another port): found
            # again, and read on in its new numbering.
            again = producer("g1")
            again.send_many(_values("g1", 100, 20))
            _run(r, start, got, lambda: len(got) == 250, "the producer back in the group")
            assert controls.where["g1"] == again.endpoint
        finally:
            r.stop()
        assert _of(got, "g1") == sorted(
            _want("g1", 100) + [("g1", i + 1, v) for i, v in enumerate(_values("g1", 100, 20))]
        )
        assert _of(got, "g2") == _want("g2", 100)
        assert _of(got, "g3") == _want("g3", 30)
        assert second.stats.get("takers", 0) == 0 and second.stats["range_flows"] >= 1
    finally:
        for p in made:
            p.close(flush=False, timeout=5)


def test_a_direct_query_with_group_reads_a_producer_that_joins_later(spark, ctx, tmp_path):
    """The same in a Spark query (the runner process runs the discovery): two capable
    producers of a ZRE group, the second started after the query, each read once,
    directly (no taker)."""
    group = f"dq-{uuid.uuid4().hex[:8]}"
    port = _free_udp_port()
    made: list[Producer] = []
    got: list[Row] = []
    df = (
        spark.readStream.format("zio")
        .option("group", group)
        .option("readMode", "direct")
        .option("zreBeaconPort", str(port))
        .option("zreInterval", "100ms")
        .option("spoolPath", str(tmp_path / "spool"))
        .load()
    )
    q = (
        df.writeStream.foreachBatch(
            lambda b, i: got.extend(
                (r.producer, r.seq, bytes(r.value))
                for r in b.select("producer", "seq", "value").collect()
            )
        )
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        for k in range(2):  # the second producer joins after the query started
            p = Producer(ctx=ctx, producer_id=f"q{k}", linger_ms=0, bind="tcp://127.0.0.1:*")
            made.append(p)
            p.advertise(group, beacon_port=port, interval=0.1)
            p.send_many(_values(f"q{k}", 0, 300))

            def read(k: int = k) -> bool:
                assert q.exception() is None, q.exception()
                return len(got) >= 300 * (k + 1)

            wait_until(read, T, f"the records of producer {k}")
        assert q.exception() is None
    finally:
        q.stop()
        for p in made:
            p.close(flush=False, timeout=5)
    assert sorted(got) == sorted(_want("q0", 300) + _want("q1", 300))
    assert all(p.stats.get("takers", 0) == 0 and p.stats["range_flows"] >= 1 for p in made)


def test_an_available_now_run_that_finds_no_producer_in_its_group_fails_naming_it(tmp_path):
    """Never "0 rows, success": an availableNow run whose group has no producer fails
    naming the group and the beacon port; with failOnDataLoss=false it ends empty."""
    group = f"de-{uuid.uuid4().hex[:8]}"
    port = _free_udp_port()
    opts = {"group": group, "zreBeaconPort": str(port), "zreInterval": "100ms"}
    r = _reader(tmp_path, **opts)
    try:
        r.prepareForTriggerAvailableNow()
        with pytest.raises(TransportError) as info:
            r.latestOffset(r.initialOffset(), None)
        assert repr(group) in str(info.value) and f"beacon port {port}" in str(info.value)
    finally:
        r.stop()
    r = _reader(tmp_path, failOnDataLoss="false", **opts)
    try:
        r.prepareForTriggerAvailableNow()
        start = r.initialOffset()
        assert start == {} and r.latestOffset(start, None) == {}
    finally:
        r.stop()


def test_two_producers_of_one_id_in_a_group_fail_the_query_naming_both(ctx, tmp_path):
    """A producer id moves to a new endpoint only when its old one left (or is down):
    two live endpoints of a group stating one id fail the query, naming both."""
    from zio_spark.errors import ConfigError

    group = f"dd-{uuid.uuid4().hex[:8]}"
    port = _free_udp_port()
    made = [
        Producer(ctx=ctx, producer_id="dup", linger_ms=0, bind="tcp://127.0.0.1:*")
        for _ in range(2)
    ]
    try:
        for p in made:
            p.advertise(group, beacon_port=port, interval=0.1)
        r = _reader(tmp_path, group=group, zreBeaconPort=str(port), zreInterval="100ms")
        try:
            deadline = time.monotonic() + T
            with pytest.raises(ConfigError) as info:  # at the first trigger that sees both
                start = r.initialOffset()
                while time.monotonic() < deadline:
                    start = r.latestOffset(start, None)
            assert all(p.endpoint in str(info.value) for p in made), str(info.value)
        finally:
            r.stop()
    finally:
        for p in made:
            p.close(flush=False, timeout=5)
