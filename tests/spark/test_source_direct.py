"""``readMode=direct`` end to end on local Spark: tasks read ranges straight from bound
in-process producers on loopback, the driver acks commits on its control flows
(docs/direct-read.md)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.peers.zio_reference import ReferenceServer
from tests.support import committed_rows, free_endpoint, to_parquet, wait_until, zio_stream
from zio_spark.codec.schema import SPARK_SCHEMA
from zio_spark.errors import TransportError
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import ControlConnection, held_window

T = 120.0  # seconds: every wait of a test is bounded by this


def _values(n: int, first: int = 0) -> list[bytes]:
    return [f"rec-{i}".encode() for i in range(first, first + n)]


def _rebind(ctx: Any, producer_id: str, endpoint: str, made: list[Producer]) -> Producer:
    """A producer restarted without retention on the endpoint of one just closed
    (libzmq may still be tearing the old listener down: retried), added to ``made``."""

    def bind() -> bool:
        try:
            made.append(Producer(ctx=ctx, producer_id=producer_id, linger_ms=0, bind=endpoint))
        except TransportError:
            return False
        return True

    wait_until(bind, what="the producer back on its endpoint", timeout=30)
    return made[-1]


def _direct(spark: Any, endpoint: str, tmp_path: Any, **options: str) -> Any:
    return zio_stream(spark, endpoint, tmp_path, readMode="direct", **options)


def test_direct_reads_every_record_once_in_order_and_acks_commits(spark, ctx, producers, tmp_path):
    """Records come once each, in the producer's order, with the spool path's columns;
    a range larger than maxRecordsPerPartition is several partitions; after commits the
    producer's held window moves (the driver's acks arrived)."""
    p = producers("d1")
    n = 3000
    p.send_many(_values(n))
    got: list[tuple[int, list[Any]]] = []
    df = _direct(spark, p.endpoint, tmp_path, maxRecordsPerPartition="700")
    assert df.schema.simpleString() == (
        "struct<value:binary,key:binary,producer:string,seq:bigint,origin:bigint,"
        "granule:bigint,timestamp:timestamp,headers:map<string,string>>"
    )
    assert [f.name for f in df.schema.fields] == SPARK_SCHEMA.names

    def batch(b: Any, i: int) -> None:
        got.append((b.rdd.getNumPartitions(), b.collect()))

    q = (
        df.writeStream.foreachBatch(batch)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    rows = lambda: [r for _, rs in got for r in rs]  # noqa: E731
    try:
        wait_until(lambda: len(rows()) >= n, what="the first wave", timeout=T)
        p.send_many(_values(1000, first=n))
        wait_until(lambda: len(rows()) >= n + 1000, what="the second wave", timeout=T)
        # Commits lag a batch; the first wave's is acked at the latest at the next trigger.
        wait_until(
            lambda: held_window(p.endpoint, "d1", ctx=ctx, timeout=10).first > n,
            what="the producer's window moving past the first wave (acks)",
            timeout=T,
        )
        assert q.exception() is None
    finally:
        q.stop()
    # Spark ends the runner with SIGTERM: it unwinds to stop(), which ends the control
    # flow with EOT (the producer's side of it closes; tasks' range flows ended already).
    wait_until(lambda: not p._ranges.flows, what="the control flow ended at the stop", timeout=T)
    all_rows = rows()
    assert [r.seq for r in all_rows] == list(range(1, n + 1001))  # once each, in order
    assert [bytes(r.value) for r in all_rows] == _values(n + 1000)
    assert {r.producer for r in all_rows} == {"d1"}
    assert all(r.granule == 0 and r.timestamp is not None for r in all_rows)
    assert max(parts for parts, rs in got if rs) >= 3  # 3000 records, 700 a partition
    assert p.acked >= n
    inc, first, _, _ = held_window(p.endpoint, "d1", ctx=ctx, timeout=10)
    assert inc == p.incarnation and first == p.acked + 1


def test_available_now_then_restart_on_the_same_checkpoint(spark, ctx, producers, tmp_path):
    """availableNow reads what the producers held when the run started; a second run on
    the same checkpoint acks the first run's last batch (commit() never comes for it) and
    reads only the new records: no duplicates, none lost."""
    a, b = producers("da"), producers("db")
    a.send_many(_values(1500))
    b.send_many(_values(700))
    endpoints = f"{a.endpoint},{b.endpoint}"
    q = to_parquet(_direct(spark, endpoints, tmp_path), tmp_path, availableNow=True)
    assert q.awaitTermination(T)
    assert q.exception() is None
    assert committed_rows(q, tmp_path / "out")() == 2200
    a.send_many(_values(300, first=1500))
    q = to_parquet(_direct(spark, endpoints, tmp_path), tmp_path, availableNow=True)
    assert q.awaitTermination(T)
    assert q.exception() is None
    out = spark.read.parquet(str(tmp_path / "out")).select("producer", "seq", "value").collect()
    got = sorted((r.producer, r.seq, bytes(r.value)) for r in out)
    want = [("da", i + 1, v) for i, v in enumerate(_values(1800))]
    want += [("db", i + 1, v) for i, v in enumerate(_values(700))]
    assert got == sorted(want)
    # The second run acked the first run's end at its start.
    wait_until(lambda: a.acked >= 1500 and b.acked == 700, what="the first run's acks", timeout=T)


def test_a_giver_without_the_capability_is_read_through_the_spool_in_the_same_query(
    spark, ctx, producers, tmp_path
):
    """A plain (reference) giver next to a capable producer: it is sent nothing but its
    taker BOT's flow (no range or control request), read through the receiver and the
    spool, and the capable one directly, in the same availableNow run."""
    p = producers("dm")
    p.send_many(_values(800))
    plain = [b"plain-%d" % i for i in range(300)]
    with ReferenceServer(ctx, role="giver", flavor="cpp", values=plain, credit=10) as ref:
        df = _direct(spark, f"{p.endpoint},{ref.endpoint}", tmp_path, connectTimeout="20s")
        q = to_parquet(df, tmp_path, availableNow=True)
        assert q.awaitTermination(T)
        assert q.exception() is None
        out = spark.read.parquet(str(tmp_path / "out")).select("producer", "seq", "value")
        rows = out.collect()
    mine = sorted((r.seq, bytes(r.value)) for r in rows if r.producer == "dm")
    assert mine == [(i + 1, v) for i, v in enumerate(_values(800))]
    others = sorted((r.seq, bytes(r.value)) for r in rows if r.producer != "dm")
    assert [v for _, v in others] == plain
    assert len({r.producer for r in rows}) == 2
    assert p.stats["range_flows"] >= 1 and p.stats["control_flows"] >= 1
    assert p.stats.get("takers", 0) == 0  # the capable producer never had a taker
    assert (tmp_path / "spool").is_dir()  # the plain giver went through the spool


def test_records_freed_before_spark_read_them_are_data_loss(spark, ctx, producers, tmp_path):
    """Records another party acked before the query read them: a DataLossError naming
    them; with failOnDataLoss=false the run skips exactly them and reads the rest."""
    p = producers("dl")
    p.send_many(_values(1000))
    q = to_parquet(_direct(spark, p.endpoint, tmp_path), tmp_path, availableNow=True)
    assert q.awaitTermination(T)
    assert q.exception() is None
    p.send_many(_values(500, first=1000))
    with ControlConnection(p.endpoint, ctx=ctx, timeout=10) as control:
        control.ack(1200, p.incarnation)  # 1001..1200 freed, never read by the query
    q = to_parquet(_direct(spark, p.endpoint, tmp_path), tmp_path, availableNow=True)
    with pytest.raises(Exception) as info:
        q.awaitTermination(T)
    assert "[1001, 1201)" in str(info.value) and "'dl'" in str(info.value), str(info.value)
    q = to_parquet(
        _direct(spark, p.endpoint, tmp_path, failOnDataLoss="false"), tmp_path, availableNow=True
    )
    assert q.awaitTermination(T)
    assert q.exception() is None
    seqs = sorted(r.seq for r in spark.read.parquet(str(tmp_path / "out")).select("seq").collect())
    assert seqs == list(range(1, 1001)) + list(range(1201, 1501))


def test_available_now_never_ends_short_of_an_endpoint_that_does_not_answer(
    spark, ctx, producers, tmp_path
):
    """An availableNow run whose endpoint gives no held window when it starts would end
    without that producer's records: it fails naming the endpoint; with
    failOnDataLoss=false it reads the others and says so (no silent short run)."""
    p = producers("up")
    p.send_many(_values(400))
    down = free_endpoint()  # nobody listens there
    endpoints = f"{p.endpoint},{down}"
    q = to_parquet(
        _direct(spark, endpoints, tmp_path, connectTimeout="1s"), tmp_path, availableNow=True
    )
    with pytest.raises(Exception) as info:
        q.awaitTermination(T)
    text = str(info.value)
    assert down in text and "gave no held window" in text and "failOnDataLoss" in text, text
    q = to_parquet(
        _direct(spark, endpoints, tmp_path, connectTimeout="1s", failOnDataLoss="false"),
        tmp_path,
        availableNow=True,
    )
    assert q.awaitTermination(T)
    assert q.exception() is None
    seqs = sorted(r.seq for r in spark.read.parquet(str(tmp_path / "out")).select("seq").collect())
    assert seqs == list(range(1, 401))


def test_a_producer_restarted_without_its_records_is_read_in_its_new_numbering(
    spark, ctx, tmp_path
):
    """The producer restarts on the same endpoint without retention: a new incarnation,
    numbering from 1. The query goes on in the new numbering (a new control flow), reads
    the new records once each and never mixes the two numberings."""
    old = Producer(ctx=ctx, producer_id="dr", linger_ms=0, bind="tcp://127.0.0.1:*")
    made = [old]
    got: list[tuple[int, bytes]] = []
    try:
        old.send_many([b"old-%d" % i for i in range(500)])
        df = _direct(spark, old.endpoint, tmp_path, connectTimeout="3s")
        q = (
            df.writeStream.foreachBatch(
                lambda b, i: got.extend(
                    (r.seq, bytes(r.value)) for r in b.select("seq", "value").collect()
                )
            )
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            wait_until(lambda: len(got) >= 500, what="the old records", timeout=T)
            endpoint = old.endpoint
            old.close(flush=False, timeout=5)

            new = _rebind(ctx, "dr", endpoint, made)
            assert new.incarnation != old.incarnation
            new.send_many([b"new-%d" % i for i in range(300)])
            wait_until(lambda: len(got) >= 800, what="the new records", timeout=T)
            wait_until(lambda: new.acked >= 1, what="an ack in the new numbering", timeout=T)
            assert q.exception() is None
        finally:
            q.stop()
    finally:
        for p in made:
            p.close(flush=False, timeout=5)
    assert got == [(i + 1, b"old-%d" % i) for i in range(500)] + [
        (i + 1, b"new-%d" % i) for i in range(300)
    ]


def test_max_records_per_trigger_cuts_direct_batches(spark, ctx, producers, tmp_path):
    p = producers("dt")
    p.send_many(_values(2500))
    sizes: list[int] = []
    seqs: list[int] = []

    def batch(b: Any, i: int) -> None:
        got = [r.seq for r in b.select("seq").collect()]
        sizes.append(len(got))
        seqs.extend(got)

    q = (
        _direct(spark, p.endpoint, tmp_path, maxRecordsPerTrigger="1000")
        .writeStream.foreachBatch(batch)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(T)
    assert q.exception() is None
    assert sorted(seqs) == list(range(1, 2501))
    assert [s for s in sizes if s] == [1000, 1000, 500]


class _CurveKeys:
    """A producer's server key pair and the driver's (the source's curve* options)."""

    def __init__(self) -> None:
        import zmq

        self.server_public, self.server_secret = zmq.curve_keypair()
        self.driver_public, self.driver_secret = zmq.curve_keypair()

    def options(self) -> dict[str, str]:
        return {
            "curveServerKey": self.server_public.decode(),
            "curvePublicKey": self.driver_public.decode(),
            "curveSecretKey": self.driver_secret.decode(),
        }


def _curve_producer(ctx: Any, keys: _CurveKeys, producer_id: str) -> Producer:
    """A bound producer over CURVE that admits only the driver's key (and the run keys
    the driver's control flows register)."""
    return Producer(
        "tcp://127.0.0.1:*",
        ctx=ctx,
        producer_id=producer_id,
        linger_ms=0,
        curve_secret_key=keys.server_secret,
        curve_allowed_client_keys=[keys.driver_public],
    )


def test_the_partitions_carry_the_run_key_pair_never_the_sources_secret(ctx, tmp_path):
    """Planned on the driver side (no Spark job): each DirectPartition holds the run's
    key pair, registered on the control flow; neither the partitions nor the pickled
    reader hold the source's secret key; once the run stops (its control flow ends) a
    task of it is refused at once, naming the endpoint."""
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    from pyspark.sql.datasource import CaseInsensitiveDict
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from zio_spark.spark.datasource import ZioDataSource
    from zio_spark.spark.source import DirectPartition, _read_any

    keys = _CurveKeys()
    p = _curve_producer(ctx, keys, "dk")
    reader: Any = None
    try:
        p.send_many(_values(1500))
        source = ZioDataSource(  # options as Spark passes them: case-insensitive
            CaseInsensitiveDict(
                {"endpoints": p.endpoint, "readMode": "direct", "maxRecordsPerPartition": "600"}
                | keys.options()
            )
        )
        assert keys.driver_secret in pickle.dumps(source)  # as Spark hands it over
        reader = source.streamReader(None)
        # PySpark pickles the DataSource into the tasks' read function: no secret there.
        assert keys.driver_secret not in pickle.dumps(source)
        assert "curvePublicKey" in source.options
        # Off the main thread, as in Spark's runner thread: no SIGTERM handler here.
        with ThreadPoolExecutor(1) as pool:
            start = pool.submit(reader.initialOffset).result(T)
            end = pool.submit(reader.latestOffset, start, ReadAllAvailable()).result(T)
            parts = pool.submit(reader.partitions, start, end).result(T)
        # 1500 records, at most 600 a task, in waves of minPartitions (2 in direct mode).
        assert len(parts) == 4 and all(isinstance(x, DirectPartition) for x in parts)
        run = parts[0].curve
        assert run is not None and all(x.curve == run for x in parts)
        assert run.server_key == keys.server_public
        assert run.public_key != keys.driver_public and run.secret_key != keys.driver_secret
        assert p.run_keys == frozenset({run.public_key})  # registered on the control flow
        for blob in [pickle.dumps(x) for x in parts] + [pickle.dumps(reader)]:
            assert keys.driver_secret not in blob
        rows = [r for x in parts for b in _read_any(x) for r in b.to_pylist()]
        assert [r["seq"] for r in rows] == list(range(1, 1501))
        reader.stop()  # the run ends: its control flow ends, the key is revoked
        reader = None
        wait_until(lambda: not p.run_keys, what="the run key revoked", timeout=T)
        with pytest.raises(TransportError) as e:
            list(_read_any(parts[0]))
        assert e.value.endpoint == p.endpoint and "restart the query" in str(e.value)
    finally:
        if reader is not None:
            reader.stop()
        p.close(flush=False, timeout=5)


def test_direct_over_curve_reads_once_with_the_run_keys(spark, ctx, tmp_path):
    """A direct availableNow run over CURVE against a producer that admits only the
    driver's key: every record once; the driver's key made the control flows' handshakes
    and nothing else (the tasks' range flows came with the run key), and the run key is
    revoked once the query ended."""
    keys = _CurveKeys()
    p = _curve_producer(ctx, keys, "dc")
    try:
        p.send_many(_values(2000))
        df = _direct(spark, p.endpoint, tmp_path, maxRecordsPerPartition="700", **keys.options())
        q = to_parquet(df, tmp_path, availableNow=True)
        assert q.awaitTermination(T)
        assert q.exception() is None
        out = spark.read.parquet(str(tmp_path / "out")).select("seq", "value").collect()
        assert sorted((r.seq, bytes(r.value)) for r in out) == [
            (i + 1, v) for i, v in enumerate(_values(2000))
        ]
        assert len(out) == 2000  # once each
        gate = p._gate
        assert gate is not None
        wait_until(lambda: not p.run_keys, what="the run key revoked at the end", timeout=T)
        assert p.stats["run_keys_admitted"] >= 1 and p.stats["run_keys_revoked"] >= 1
        assert p.stats["range_flows"] >= 3  # 2000 records, 700 a partition
        assert gate.handshakes[keys.driver_public] == p.stats["control_flows"]
        run_handshakes = sum(n for k, n in gate.handshakes.items() if k != keys.driver_public)
        assert run_handshakes >= p.stats["range_flows"]
    finally:
        p.close(flush=False, timeout=5)


def test_the_spool_path_over_curve_reads_with_the_secret_dropped(spark, ctx, tmp_path):
    """readMode=spool over CURVE (the runner's receiver is the producer's taker with the
    source's keys): dropping curveSecretKey from the DataSource once the reader is made
    loses it nowhere it is needed; the producer's allow-list admits the driver's key."""
    keys = _CurveKeys()
    p = _curve_producer(ctx, keys, "sc")
    try:
        p.send_many(_values(500))
        df = zio_stream(spark, p.endpoint, tmp_path, **keys.options())
        q = to_parquet(df, tmp_path, availableNow=True)
        assert q.awaitTermination(T)
        assert q.exception() is None
        out = spark.read.parquet(str(tmp_path / "out")).select("seq", "value").collect()
        assert sorted((r.seq, bytes(r.value)) for r in out) == [
            (i + 1, v) for i, v in enumerate(_values(500))
        ]
        gate = p._gate
        assert gate is not None and gate.handshakes[keys.driver_public] >= 1
    finally:
        p.close(flush=False, timeout=5)


def test_a_first_batch_replanned_after_its_producer_restarted_without_records_is_loss(
    ctx, tmp_path
):
    """Spark re-plans an uncommitted first batch after a restart with ``initialOffset()``
    asked again. If the producer restarted without its records in between, that start
    is of its new incarnation while the batch's end is of the old one: the batch would
    read nothing of it. It is a DataLossError naming the producer and the planned end
    (hook by hook, no Spark session); with failOnDataLoss=false it reads on."""
    from zio_spark.errors import DataLossError
    from zio_spark.options import parse_source_options
    from zio_spark.spark.source import ZioStreamReader

    old = Producer(ctx=ctx, producer_id="b0", linger_ms=0, bind="tcp://127.0.0.1:*")
    made = [old]

    def reader(**extra: str) -> ZioStreamReader:
        raw = {"endpoints": endpoint, "readMode": "direct", "connectTimeout": "5s", **extra}
        return ZioStreamReader(parse_source_options(raw), ("seq", "value"))

    try:
        endpoint = old.endpoint
        old.send_many(_values(50))
        r = reader()
        try:
            start = r.initialOffset()
            end = r.latestOffset(start, None)
            assert end == {"b0": {"end": 51, "incarnation": old.incarnation}}
        finally:
            r.stop()  # the driver dies before batch 0 is committed
        old.close(flush=False, timeout=5)

        _rebind(ctx, "b0", endpoint, made).send_many(_values(5))
        r = reader()
        try:
            again = r.initialOffset()
            assert again == {"b0": {"end": 1, "incarnation": made[-1].incarnation}}
            with pytest.raises(DataLossError) as info:
                r.partitions(again, end)
            text = str(info.value)
            assert "'b0'" in text and "up to 50" in text and old.incarnation in text, text
        finally:
            r.stop()
        r = reader(failOnDataLoss="false")
        try:
            assert r.partitions(r.initialOffset(), end) == []  # nothing left to read of it
        finally:
            r.stop()
    finally:
        for p in made:
            p.close(flush=False, timeout=5)


def test_a_full_producers_batches_are_cut_to_half_its_window_from_the_second_plan(ctx):
    """A producer whose sends wait for room in its window says ``full`` in its held
    answer; the runner then plans at most half of what it holds (the batch before
    included), so a fast producer's batches settle at half its window instead of
    alternating. A runner's first plan is never cut: a run of one batch (Trigger.Once,
    availableNow before Spark 4.2) reads all that is held. Hook by hook, no Spark session;
    every wait is on the producer's state."""
    import contextlib
    import threading

    from zio_spark.options import parse_source_options
    from zio_spark.spark.source import ZioStreamReader

    p = Producer(ctx=ctx, producer_id="f0", linger_ms=0, bind="tcp://127.0.0.1:*", max_unacked=100)
    senders: list[threading.Thread] = []

    def send_blocked(n: int, first: int) -> None:
        # A send that must wait for room: on a thread, until the query's acks free it.
        def send() -> None:
            with contextlib.suppress(TransportError):  # the producer closed at the end
                p.send_many(_values(n, first), timeout=T)

        t = threading.Thread(target=send)
        t.start()
        senders.append(t)
        wait_until(lambda: p.window_full, what="the send waiting for room", timeout=T)

    raw = {"endpoints": p.endpoint, "readMode": "direct", "connectTimeout": "5s"}
    r = ZioStreamReader(parse_source_options(raw), ("seq", "value"))
    try:
        p.send_many(_values(100))
        send_blocked(100, 100)
        start = r.initialOffset()
        end1 = r.latestOffset(start, None)  # the runner's first plan: all that is held
        assert end1["f0"]["end"] == 101
        # The next plan: the first batch [1, 101) still held, nothing new: an empty
        # batch; its ack (start=end1) frees the window and the waiting send completes.
        assert r.latestOffset(end1, None)["f0"]["end"] == 101
        wait_until(lambda: p.acked == 100 and not p.window_full, what="the send done", timeout=T)
        senders.pop().join(T)
        send_blocked(100, 200)  # a fast producer: its window full again
        # Held [101, 201) and full: half of it, 50, where the whole would be 100.
        end3 = r.latestOffset(end1, None)
        assert end3["f0"]["end"] == 151
        parts = r.partitions(end1, end3)
        assert len(parts) == 2  # in waves of minPartitions (2 in direct mode)
    finally:
        r.stop()
        p.close(flush=False, timeout=5)
        for t in senders:
            t.join(T)
