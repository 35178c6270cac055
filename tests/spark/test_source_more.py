"""More of the zio source on local Spark: restarts, admission control, remote spool
access, batch reads, option errors, user schemas and the progress report."""

from __future__ import annotations

import json
import threading
import time

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from tests.support import runner_reader, wait_until


def _stream(spark, endpoint, tmp_path, **options):
    reader = spark.readStream.format("zio").option("endpoints", endpoint)
    reader = reader.option("spoolPath", str(tmp_path / "spool"))
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader


def _input_rows(q) -> int:
    return sum(p["numInputRows"] for p in q.recentProgress)


# -- streaming ---------------------------------------------------------------------------


def test_restart_exactly_once_into_parquet(spark, producers, tmp_path):
    """Stop a running query and start it again on the same checkpoint and spool while the
    producer keeps sending: every record lands in the parquet output exactly once."""
    prod = producers("restart")
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")

    def start():
        return (
            _stream(spark, prod.endpoint, tmp_path)
            .load()
            .writeStream.format("parquet")
            .option("path", out)
            .option("checkpointLocation", ckpt)
            .trigger(processingTime="200 milliseconds")
            .start()
        )

    values = [f"r{i}".encode() for i in range(9000)]
    prod.send_many(values[:3000])
    q1 = start()
    try:
        wait_until(lambda: _input_rows(q1) >= 3000, what="first query's records", timeout=60.0)
        prod.send_many(values[3000:4000])  # in flight while the query stops
        assert q1.exception() is None
    finally:
        q1.stop()
    prod.send_many(values[4000:6000])  # while no query runs
    q2 = start()
    try:
        prod.send_many(values[6000:])
        wait_until(
            lambda: spark.read.parquet(out).count() >= 9000,
            what="all records in the output",
            interval=0.5,
            timeout=60.0,
        )
        assert q2.exception() is None
    finally:
        q2.stop()
    rows = spark.read.parquet(out).select("seq", "value").collect()
    assert sorted((r.seq, bytes(r.value)) for r in rows) == [
        (i + 1, v) for i, v in enumerate(values)
    ]


def test_max_records_per_trigger_and_user_schema(spark, producers, tmp_path):
    """maxRecordsPerTrigger caps each micro-batch; a subset schema, in its own order."""
    prod = producers("limited")
    prod.send_many([f"m{i}".encode() for i in range(4500)])
    batches: dict[int, list] = {}
    q = (
        _stream(spark, prod.endpoint, tmp_path, maxRecordsPerTrigger=1000)
        .schema("seq bigint, value binary")
        .load()
        .writeStream.foreachBatch(lambda b, i: batches.__setitem__(i, b.collect()))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    sizes = [len(rows) for _, rows in sorted(batches.items())]
    assert sizes == [1000, 1000, 1000, 1000, 500]
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == sizes
    rows = [r for _, b in sorted(batches.items()) for r in b]
    assert rows[0].__fields__ == ["seq", "value"]
    assert [(r.seq, bytes(r.value)) for r in rows] == [
        (i + 1, f"m{i}".encode()) for i in range(4500)
    ]
    # reportLatestOffset() is in the progress as sources[0].latestOffset.
    reports = [json.loads(p["sources"][0]["latestOffset"]) for p in q.recentProgress]
    assert reports[0]["backlog"] == {"limited": 4500}
    # spoolAccess=auto on the runner's host: executors read the folder, never the server.
    assert [r.get("segmentRequests", 0) for r in reports] == [0] * len(reports)


def test_max_records_per_trigger_is_shared_fairly_by_the_producers(spark, producers, tmp_path):
    """readMode=spool: a busy producer first in id order does not fill every batch of
    maxRecordsPerTrigger while another waits (in id order "a-busy" took the first four
    batches and "b-small" waited for the last); shared, "b-small" is in the first."""
    busy, small = producers("a-busy"), producers("b-small")
    busy.send_many([f"a{i}".encode() for i in range(2000)])
    small.send_many([f"b{i}".encode() for i in range(200)])
    batches: dict[int, list] = {}
    q = (
        _stream(spark, f"{busy.endpoint},{small.endpoint}", tmp_path, maxRecordsPerTrigger=500)
        .load()
        .writeStream.foreachBatch(
            lambda b, i: batches.__setitem__(i, b.select("producer", "seq").collect())
        )
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    # The run's target is what both held when it started (they state their positions).
    sizes = [
        (sum(r.producer == "a-busy" for r in rows), sum(r.producer == "b-small" for r in rows))
        for _, rows in sorted(batches.items())
    ]
    assert sizes == [(300, 200), (500, 0), (500, 0), (500, 0), (200, 0)], sizes
    rows = [r for _, b in sorted(batches.items()) for r in b]
    for pid, n in (("a-busy", 2000), ("b-small", 200)):
        assert sorted(r.seq for r in rows if r.producer == pid) == list(range(1, n + 1))


def test_remote_spool_access_fetches_through_segment_server(spark, producers, tmp_path):
    prod = producers("far")
    got: list[int] = []
    q = (
        _stream(spark, prod.endpoint, tmp_path, spoolAccess="remote")
        .load()
        .writeStream.foreachBatch(lambda b, i: got.extend(r.seq for r in b.collect()))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )

    def served() -> int:
        reports = [p["sources"][0].get("latestOffset") for p in q.recentProgress]
        return max((json.loads(r).get("segmentRequests", 0) for r in reports if r), default=0)

    try:
        for wave in range(2):
            prod.send_many([b"f"] * 1500)
            wait_until(lambda w=wave: len(got) >= 1500 * (w + 1), what=f"wave {wave}", timeout=60.0)
        # Executors fetched their ranges from the runner's segment server, not the folder.
        wait_until(
            lambda: served() >= 2, what="segment requests in the progress report", timeout=60.0
        )
        assert q.exception() is None
    finally:
        q.stop()
    assert sorted(got) == list(range(1, 3001))


# -- batch reads -------------------------------------------------------------------------


def test_batch_read_max_records_then_the_rest(spark, producers, tmp_path):
    prod = producers("batchy")
    prod.send_many([f"b{i}".encode() for i in range(2500)])

    def read():
        df = (
            spark.read.format("zio")
            .option("endpoints", prod.endpoint)
            .option("spoolPath", str(tmp_path / "spool"))
            .option("maxRecords", "1000")
            .load()
        )
        return sorted((r.seq, bytes(r.value)) for r in df.select("seq", "value").collect())

    assert read() == [(i + 1, f"b{i}".encode()) for i in range(1000)]
    wait_until(lambda: prod.acked == 1000, what="the first read acknowledged", timeout=60.0)
    # The next read continues where the first stopped (records 1..1000 were acked).
    assert read() == [(i + 1, f"b{i}".encode()) for i in range(1000, 2000)]
    assert prod.pending == 500


def test_batch_read_until_eot(spark, producers, tmp_path):
    """A producer that ends its flow (EOT): the read returns everything it sent."""
    prod = producers("ending")
    prod.send_many([f"e{i}".encode() for i in range(700)])

    def close_when_sent() -> None:
        wait_until(lambda: prod.stats["records_sent"] >= 700, what="records sent", timeout=60.0)
        prod.close(flush=False, timeout=5)

    closer = threading.Thread(target=close_when_sent, daemon=True)
    closer.start()
    t = time.monotonic()
    rows = (
        spark.read.format("zio")
        .schema("value binary, seq bigint")
        .option("endpoints", prod.endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .option("timeout", "60s")
        .load()
        .collect()
    )
    took = time.monotonic() - t
    closer.join(10)
    assert sorted((r.seq, bytes(r.value)) for r in rows) == [
        (i + 1, f"e{i}".encode()) for i in range(700)
    ]
    assert took < 30, f"the read waited {took:.1f} s: EOT did not end it"


# -- options and schemas -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"endpoints": "tcp://127.0.0.1:5555", "maxBacklogg": "10"},
            ["option 'maxbacklogg'", "maxBacklog", "maxRecordsPerTrigger", "spoolPath"],
        ),
        (
            {"endpoints": "tcp://127.0.0.1:5555", "group": "daq"},
            ["option 'endpoints'", "exactly one of 'endpoints'", "not both"],
        ),
        ({"stream": "s"}, ["option 'endpoints'", "got None", "exactly one of 'endpoints'"]),
        (
            {"endpoints": "tcp://127.0.0.1:5555", "credit": "0"},
            ["option 'credit'", "got '0'", "an integer 1..1000000"],
        ),
        (
            {"endpoints": "tcp://127.0.0.1:5555", "connectTimeout": "soon"},
            ["option 'connectTimeout'", "got 'soon'", "a duration such as", "30s"],
        ),
        (
            {"endpoints": "localhost:5555"},
            ["option 'endpoints'", "got 'localhost:5555'", "a ZeroMQ endpoint"],
        ),
        (
            {"endpoints": "tcp://127.0.0.1:5555", "bind": "tcp://*:5556"},
            ["option 'endpoints'", "exactly one of", "'bind'", "not both 'endpoints' and 'bind'"],
        ),
        (
            {"bind": "tcp://*:5556", "groupPort": "out"},
            ["option 'groupPort'", "got 'out'", "together with 'group'"],
        ),
    ],
    ids=["unknown", "both", "neither", "credit", "duration", "endpoint", "bind-and", "groupPort"],
)
@pytest.mark.parametrize("kind", ["stream", "batch"])
def test_option_errors_at_dataframe_creation(spark, tmp_path, options, expected, kind):
    reader = spark.readStream if kind == "stream" else spark.read
    reader = reader.format("zio")
    for k, v in options.items():
        reader = reader.option(k, v)
    with pytest.raises(Exception) as info:
        reader.load()  # no query, no action: load() alone must fail
    text = str(info.value)
    assert "ConfigError" in text
    for part in expected:
        assert part in text, f"{part!r} not in {text}"


def test_user_schema_wrong_type_is_a_clear_error(spark, producers, tmp_path):
    prod = producers("typed")
    df = (
        spark.read.format("zio")
        .schema("value string, seq bigint")
        .option("endpoints", prod.endpoint)
        .option("spoolPath", str(tmp_path / "spool"))
        .load()
    )
    with pytest.raises(Exception) as info:
        df.collect()
    text = str(info.value)
    assert "option 'schema'" in text
    assert "column value of type binary" in text
    assert prod.stats["takers"] == 0  # failed before connecting to anything


def test_a_full_backlog_already_read_by_spark_does_not_stall_the_query(spark, producers, tmp_path):
    """Spark calls commit() for a batch only when it plans the next one, and never for the
    last batch of an availableNow run. A later run starts after that batch, so the
    records it covered are done: they must not count as backlog. (Found by the chaos
    suite: with the backlog at maxBacklog, no credit, no data, no batch, no commit().)

    The availableNow run reads the 3000 records in batches of a full backlog each (a
    batch as soon as maxBacklog holds the producer back), so its last batch leaves the
    backlog at maxBacklog, uncommitted: the next run must still get the next records."""
    prod = producers("stall")
    prod.send_many([b"r%d" % i for i in range(1, 3001)])
    seqs: list[int] = []
    sizes: list[int] = []
    ckpt = str(tmp_path / "ckpt")

    def batch(b, _i):
        got = [r.seq for r in b.select("seq").collect()]
        seqs.extend(got)
        sizes.append(len(got))

    def run(**trigger):
        df = _stream(spark, prod.endpoint, tmp_path, maxBacklog=1000, credit=10).load()
        w = df.writeStream.foreachBatch(batch)
        return w.option("checkpointLocation", ckpt).trigger(**trigger).start()

    first = run(availableNow=True)
    assert first.awaitTermination(120)
    assert first.exception() is None
    assert sorted(seqs) == list(range(1, 3001))
    assert sizes == [1000, 1000, 1000]
    prod.send_many([b"r%d" % i for i in range(3001, 5001)])
    second = run(processingTime="200 milliseconds")
    try:
        wait_until(lambda: len(seqs) >= 5000, 90, "the next records after a full backlog")
    finally:
        second.stop()
    assert sorted(seqs) == list(range(1, 5001))


# -- availableNow's end and the holdups report (runner methods, no Spark session) -----------


def test_available_now_ends_when_every_producer_said_it_has_nothing_more(producers, tmp_path):
    """No quiet wait for a zio-spark producer: it says ``more: false``; the quiet rule
    alone could not end before 0.5 s without a new record."""
    prod = producers("said")
    n = 2000
    prod.send_many([b"a%d" % i for i in range(n)])
    reader = runner_reader(prod.endpoint, tmp_path, connectTimeout="30s")
    try:
        start = reader.initialOffset()
        reader.prepareForTriggerAvailableNow()
        end = reader.latestOffset(start, ReadAllAvailable())
        # The quiet rule returns only after 0.5 s without input; this ended at once.
        quiet = reader._rt.receiver.quiet_for()
        assert quiet < 0.5, f"returned {quiet:.2f} s after the last input: waited for quiet"
        assert end == {"said": n + 1}
        report = reader.reportLatestOffset()
        assert report["backlog"] == {"said": n}
        assert report["heldBackMs"] == {"said": 0}
        assert "producerBlockedMs" not in report  # it never blocked, so never said so
        assert reader.latestOffset(end, ReadAllAvailable()) == end  # the run ends there
    finally:
        reader.stop()


def test_available_now_with_an_idle_producer_that_has_nothing_ends_at_once(producers, tmp_path):
    prod = producers("nothing")
    reader = runner_reader(prod.endpoint, tmp_path, connectTimeout="30s")
    try:
        t0 = time.monotonic()
        reader.prepareForTriggerAvailableNow()
        assert reader.latestOffset({}, ReadAllAvailable()) == {}
        assert time.monotonic() - t0 < 0.5  # idle from its BOT: no quiet wait
    finally:
        reader.stop()


def test_available_now_takes_more_than_max_backlog_in_steps(producers, tmp_path):
    """A producer holding more than maxBacklog: each batch is what the backlog holds, its
    commit lets more in, and the run ends with all of it (not at the first full backlog,
    which would look quiet)."""
    prod = producers("steps")
    n = 500
    prod.send_many([b"s%d" % i for i in range(n)])
    reader = runner_reader(prod.endpoint, tmp_path, maxBacklog=100, credit=10)
    try:
        start = reader.initialOffset()
        reader.prepareForTriggerAvailableNow()
        ends = []
        while True:  # what Spark does: the next batch starts at the last one's end
            end = reader.latestOffset(start, ReadAllAvailable())
            if end == start:
                break
            assert end["steps"] - start.get("steps", 1) <= 100
            ends.append(end["steps"])
            start = end
            assert len(ends) <= n // 10, ends
        assert ends[-1] == n + 1 and len(ends) >= 5, ends
    finally:
        reader.stop()


def test_the_report_shows_the_source_holding_a_producer_back(producers, tmp_path):
    prod = producers("held")
    prod.send_many([b"h"] * 500)
    reader = runner_reader(prod.endpoint, tmp_path, maxBacklog=100, credit=10)
    try:
        reader.initialOffset()
        wait_until(
            lambda: reader.reportLatestOffset()["heldBackMs"].get("held", 0) >= 200,
            timeout=20,
            what="credit withheld for maxBacklog",
        )
        report = reader.reportLatestOffset()
        # DATs of up to maxBacklog / 8 = 12 records: 8 of them fit in 100, a 9th would not.
        assert report["backlog"] == {"held": 96}
    finally:
        reader.stop()
