"""The zio source on local Spark against the stand-in for the unmodified ZIO reference.

A reference server giver echoes our BOT back: the source must read it as a plain giver
and return every record it gives -- streaming, availableNow and batch -- never "0 rows,
success". A batch read whose producer cannot be read raises that producer's error.
"""

from __future__ import annotations

import time

import pytest
import zmq

from tests.peers.zio_reference import ReferenceServer


@pytest.fixture
def reference(ctx):
    """``make(flavor, values)``: a reference server giver, closed at teardown."""
    made: list[ReferenceServer] = []

    def make(flavor: str, values: list[bytes]) -> ReferenceServer:
        s = ReferenceServer(ctx, role="giver", flavor=flavor, values=values, credit=10)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _values(rows) -> list[bytes]:
    return [bytes(r.value) for r in sorted(rows, key=lambda r: r.seq)]


def test_available_now_reads_every_record_of_a_reference_giver(spark, reference, tmp_path):
    values = [b"an-%d" % i for i in range(500)]
    server = reference("cpp", values)
    got: list = []
    q = (
        spark.readStream.format("zio")
        .option("endpoints", server.endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("connectTimeout", "20s")
        .load()
        .writeStream.foreachBatch(lambda df, _: got.extend(df.select("seq", "value").collect()))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(120), "availableNow did not finish"
    assert q.exception() is None
    assert _values(got) == values
    assert sorted(r.seq for r in got) == list(range(1, len(values) + 1))
    assert server.errors == [] and server.zero_credit_pays == 0


def test_streaming_reads_every_record_of_a_reference_giver_once(spark, reference, tmp_path):
    """Python flavor; the query keeps running after the giver's EOT and takes nothing
    twice (the giver would give everything again on a new flow)."""
    values = [b"st-%d" % i for i in range(400)]
    server = reference("python", values)
    q = (
        spark.readStream.format("zio")
        .option("endpoints", server.endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .load()
        .writeStream.format("memory")
        .queryName("zio_reference_stream")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 90
        while spark.sql("select count(*) from zio_reference_stream").first()[0] < len(values):
            assert q.exception() is None, q.exception()
            assert time.monotonic() < deadline, "not every record arrived"
            time.sleep(0.2)
        assert server.wait_until(lambda: server.flows_completed == 1, 20)
        q.processAllAvailable()
        rows = spark.sql("select seq, value from zio_reference_stream").collect()
    finally:
        q.stop()
    assert q.exception() is None
    assert _values(rows) == values
    assert server.flows_started == 1 and server.errors == []


def test_batch_read_of_a_reference_giver_returns_every_record(spark, reference, tmp_path):
    values = [b"ba-%d" % i for i in range(300)]
    server = reference("python", values)
    t = time.monotonic()
    rows = (
        spark.read.format("zio")
        .option("endpoints", server.endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("timeout", "60s")
        .load()
        .collect()
    )
    assert _values(rows) == values
    assert time.monotonic() - t < 30, "the read did not end at the giver's EOT"
    assert {r.producer for r in rows} == {server.endpoint}


def test_batch_read_of_a_silent_endpoint_raises_its_error(spark, ctx, tmp_path):
    """Nothing listens: the read fails naming the endpoint and why, not an assertion."""
    with ctx.socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"  # closed again: nothing listens there now
    df = (
        spark.read.format("zio")
        .option("endpoints", endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("connectTimeout", "2s")
        .load()
    )
    t = time.monotonic()
    with pytest.raises(Exception) as info:
        df.collect()
    text = str(info.value)
    assert "AssertionError" not in text
    assert endpoint in text and "nothing accepted a connection" in text, text
    assert time.monotonic() - t < 30


def _free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bind_takes_reference_clients_that_come_and_go(spark, ctx, tmp_path):
    """``bind``: the source is the flow server; plain reference giver clients connect
    while the query runs, one after the other and two at once; every record arrives,
    one partition per client origin."""
    from tests.peers.zio_reference import ReferenceClientGiver

    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    q = (
        spark.readStream.format("zio")
        .option("bind", endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .load()
        .writeStream.format("memory")
        .queryName("zio_bound_stream")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    clients = []

    def count() -> int:
        return spark.sql("select count(*) from zio_bound_stream").first()[0]

    def wait_rows(n: int) -> None:
        deadline = time.monotonic() + 90
        while count() < n:
            assert q.exception() is None, q.exception()
            assert time.monotonic() < deadline, f"{count()} rows of {n}"
            time.sleep(0.2)

    try:
        first = [b"one-%d" % i for i in range(200)]
        clients.append(ReferenceClientGiver(ctx, endpoint, first, flavor="cpp", origin=1))
        wait_rows(200)
        second = [b"two-%d" % i for i in range(150)]
        third = [b"three-%d" % i for i in range(100)]
        clients.append(ReferenceClientGiver(ctx, endpoint, second, flavor="python", origin=2))
        clients.append(ReferenceClientGiver(ctx, endpoint, third, flavor="cpp", origin=3))
        wait_rows(450)
        assert all(c.wait(30) for c in clients), [c.errors for c in clients]
        q.processAllAvailable()
        rows = spark.sql("select producer, seq, value from zio_bound_stream").collect()
    finally:
        q.stop()
        for c in clients:
            c.close()
    assert q.exception() is None
    by = {}
    for r in sorted(rows, key=lambda r: (r.producer, r.seq)):
        by.setdefault(r.producer, []).append(bytes(r.value))
    assert by == {"origin:1": first, "origin:2": second, "origin:3": third}


def test_streaming_query_fails_on_a_socket_kind_mismatch(spark, ctx, tmp_path):
    """A peer whose socket libzmq refuses at the handshake (a PULL here, a SERVER in real
    life): the query fails after connectTimeout naming the endpoint, both socket kinds
    and the fix -- not silent reconnects and 0 rows."""
    with ctx.socket(zmq.PULL) as wrong:
        wrong.linger = 0
        endpoint = f"tcp://127.0.0.1:{wrong.bind_to_random_port('tcp://127.0.0.1')}"
        q = (
            spark.readStream.format("zio")
            .option("endpoints", endpoint)
            .option("spoolPath", str(tmp_path / "spool"))
            .option("connectTimeout", "2s")
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            deadline = time.monotonic() + 60
            while q.isActive and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not q.isActive, "the query kept running"
        finally:
            q.stop()
    text = str(q.exception())
    assert endpoint in text and "DEALER" in text and "socket=clientserver" in text, text
