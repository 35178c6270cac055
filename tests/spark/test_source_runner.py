"""The stream reader's runner side without a Spark session: background sealing, the
first ``latestOffset``, and SIGTERM in the runner (the partition planning's own suite is
tests/unit/test_plan.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from tests.support import runner_reader, wait_until
from zio_spark.errors import ConfigError
from zio_spark.options import parse_source_options
from zio_spark.source import runtime as runtime_mod
from zio_spark.source.sealer import Sealer
from zio_spark.spark.compat import ReadMaxRows
from zio_spark.storage.spool import Record, Spool

# -- partitions ---------------------------------------------------------------------------


def test_max_records_per_partition_option_is_checked():
    with pytest.raises(ConfigError, match="maxRecordsPerPartition"):
        parse_source_options({"endpoints": "tcp://127.0.0.1:5555", "maxRecordsPerPartition": "0"})
    opts = parse_source_options({"endpoints": "tcp://127.0.0.1:5555"})
    assert opts.max_records_per_partition == 250_000


def test_a_producer_range_is_read_as_several_partitions_each_record_once(producers, tmp_path):
    prod = producers("split")
    n = 1000
    prod.send_many([b"v%d" % i for i in range(n)])
    reader = runner_reader(prod.endpoint, tmp_path, maxRecordsPerPartition=300)
    try:
        start = reader.initialOffset()
        wait_until(
            lambda: reader._rt.spool.backlog().get("split", 0) == n,
            what="all records in the spool",
        )
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end == {"split": n + 1}
        parts = reader.partitions(start, end)
        assert [p.ranges for p in parts] == [
            (("split", 1, 251),),
            (("split", 251, 501),),
            (("split", 501, 751),),
            (("split", 751, 1001),),
        ]
        seqs: list[int] = []
        values: list[bytes] = []
        for p in parts:  # as executors do: a pickled copy of the reader reads each
            for batch in reader.read(p):
                assert isinstance(batch, pa.RecordBatch)
                seqs += batch.column(0).to_pylist()
                values += batch.column(1).to_pylist()
        assert seqs == list(range(1, n + 1))
        assert values == [b"v%d" % i for i in range(n)]
    finally:
        reader.stop()


def test_a_batch_replayed_after_a_restart_reads_its_logged_ends_not_a_new_split(
    producers, tmp_path
):
    """maxRecordsPerTrigger's fair split is made once, by ``latestOffset``. A batch
    planned before the runner went is re-run by Spark from its offsets log (start and
    end), and ``partitions`` cuts it from those ends alone: the same ranges and records,
    though a split made now (more records wait) would give other ends."""
    busy, small = producers("a-busy"), producers("b-small")
    busy.send_many([b"a%d" % i for i in range(2000)])
    small.send_many([b"b%d" % i for i in range(200)])
    endpoints = f"{busy.endpoint},{small.endpoint}"
    first = runner_reader(endpoints, tmp_path)
    try:
        start = first.initialOffset()
        wait_until(
            lambda: first._rt.spool.backlog() == {"a-busy": 2000, "b-small": 200},
            what="both producers' records in the spool",
        )
        end = first.latestOffset(start, ReadMaxRows(500))
        assert end == {"a-busy": 301, "b-small": 201}  # 200 (all b has), 300 of a
        planned = [p.ranges for p in first.partitions(start, end)]
    finally:
        first.stop()  # the runner goes with the batch planned, not committed
    small.send_many([b"b%d" % i for i in range(200, 500)])
    second = runner_reader(endpoints, tmp_path)
    try:
        assert second.initialOffset() == start
        wait_until(
            lambda: second._rt.spool.backlog() == {"a-busy": 2000, "b-small": 500},
            what="the small producer's later records in the spool",
        )
        parts = second.partitions(start, end)  # Spark's replay: the logged offsets
        assert [p.ranges for p in parts] == planned
        values = [v for p in parts for b in second.read(p) for v in b.column(1).to_pylist()]
        assert sorted(values) == sorted(
            [b"a%d" % i for i in range(300)] + [b"b%d" % i for i in range(200)]
        )
        # A new split would differ (250 each now): only a new batch is split again.
        assert second.latestOffset(start, ReadMaxRows(500)) == {"a-busy": 251, "b-small": 251}
    finally:
        second.stop()


# -- background sealing -------------------------------------------------------------------


def _records(first: int, n: int) -> list[Record]:
    return [Record(first + i, b"x", None, 0, 0, 0, None) for i in range(n)]


def test_the_sealer_seals_a_large_tail_without_latest_offset(tmp_path):
    spool = Spool(tmp_path / "spool")
    sealer = Sealer(spool, rows=100, every=0.01).start()
    try:
        spool.append("p", _records(1, 150))
        spool.flush()
        wait_until(lambda: spool.end_offsets() == {"p": 151}, what="the tail sealed")
        assert sealer.seals >= 1 and sealer.error is None
        assert spool.unsealed() == (0, 0)
    finally:
        sealer.stop()
        spool.close()


def test_a_failed_background_seal_fails_the_next_spark_call(producers, tmp_path, monkeypatch):
    prod = producers("boom")
    reader = runner_reader(prod.endpoint, tmp_path)
    try:
        start = reader.initialOffset()
        rt = reader._rt

        def broken() -> dict[str, int]:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(rt.sealer, "rows", 1)
        monkeypatch.setattr(rt.spool, "seal", broken)
        prod.send_many([b"b"] * 10)
        wait_until(lambda: rt.sealer.error is not None, what="the seal failed")
        with pytest.raises(OSError, match="No space left"):
            reader.latestOffset(start, ReadAllAvailable())
    finally:
        monkeypatch.undo()
        reader.stop()


# -- the first latestOffset -----------------------------------------------------------------


def test_the_first_latest_offset_waits_for_the_first_records(producers, tmp_path, monkeypatch):
    """Spark runs a query's first batch whatever the offsets: it must not be empty when a
    producer has records (the bound is raised here so a slow machine cannot flake)."""
    monkeypatch.setattr(runtime_mod, "FIRST_WAIT", 30.0)
    prod = producers("first")
    prod.send_many([b"f"] * 100)
    reader = runner_reader(prod.endpoint, tmp_path)
    try:
        start = reader.initialOffset()
        assert start == {}
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end.get("first", 1) > 1, end
    finally:
        reader.stop()


def test_the_first_latest_offset_without_records_returns_within_its_bound(producers, tmp_path):
    prod = producers("empty")
    reader = runner_reader(prod.endpoint, tmp_path)
    try:
        assert reader.latestOffset(reader.initialOffset(), ReadAllAvailable()) == {}
        assert reader.latestOffset({}, ReadAllAvailable()) == {}  # no second wait
    finally:
        reader.stop()


# -- SIGTERM --------------------------------------------------------------------------------

# The child runs the reader as the runner does, raising SIGTERM inside the spool's locks.
RUNNER_CHILD = str(Path(__file__).with_name("runner_child.py"))


def test_sigterm_while_the_runner_holds_a_spool_lock_stops_cleanly(producers, tmp_path):
    """SIGTERM lands between any two bytecodes of the runner's main thread: the handler
    must not stop the reader itself (that deadlocked on the spool's lock, and the runner
    outlived its JVM); it unwinds, and the runner's ``finally`` stops the reader."""
    prod = producers("term")
    proc = subprocess.Popen(
        [sys.executable, RUNNER_CHILD, "sigterm-in-lock", prod.endpoint, str(tmp_path / "spool")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the reader hung after SIGTERM (deadlock): {out!r} {err[-2000:]!r}")
    assert proc.returncode == 0, err[-2000:]
    assert "handler returned" not in out  # it unwound the main thread
    assert "stopped True" in out  # and the reader was stopped: spool closed
