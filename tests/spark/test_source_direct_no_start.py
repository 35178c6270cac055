"""``readMode=direct`` through the reader Spark 4.0/4.1 get (``ZioStreamReaderOldApi``:
``latestOffset()`` without the batch start), driven hook by hook in the call orders seen
on 4.0.5 and 4.1.4, against bound producers on loopback, with no Spark session (the
4.3 suite covers this path's sockets; ``tests/compat/test_direct.py`` runs the real
thing on 4.0 and 4.1)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from tests.support import wait_until
from zio_spark.options import parse_source_options
from zio_spark.spark.legacy import ZioStreamReaderOldApi

T = 60.0  # seconds: every wait of a test is bounded by this


def _reader(endpoint: str, tmp_path: Any) -> ZioStreamReaderOldApi:
    opts = parse_source_options(
        {"endpoints": endpoint, "readMode": "direct", "spoolPath": str(tmp_path / "spool")}
    )
    return ZioStreamReaderOldApi(opts, ("seq", "value"))


def _seqs(r: ZioStreamReaderOldApi, start: dict[str, Any], end: dict[str, Any]) -> list[int]:
    out: list[int] = []
    for part in r.partitions(start, end):
        for batch in r.read(part):
            assert isinstance(batch, pa.RecordBatch)
            out += batch.column("seq").to_pylist()
    return out


def _at(p: Any, end: int) -> dict[str, Any]:
    return {p.producer_id: {"end": end, "incarnation": p.incarnation}}


def test_a_new_checkpoint_then_a_restart_in_old_sparks_call_order(producers, tmp_path):
    p = producers("ns")
    p.send_many([b"v%d" % i for i in range(100)])
    r = _reader(p.endpoint, tmp_path)
    try:
        # A new checkpoint: latestOffset() comes first, initialOffset() after it.
        end0 = r.latestOffset()
        start0 = r.initialOffset()
        assert (start0, end0) == (_at(p, 1), _at(p, 101))
        assert _seqs(r, start0, end0) == list(range(1, 101))
        assert p.acked == 0
        p.send_many([b"v%d" % i for i in range(100, 150)])
        end1 = r.latestOffset()  # batch 0 is committed: acked now (on the control lane)
        assert end1 == _at(p, 151)
        wait_until(lambda: p.acked == 100, T, "batch 0 acked")
        assert _seqs(r, end0, end1) == list(range(101, 151))
        r.commit(end0)  # commit() lags a batch: already acked, nothing more
        assert p.acked == 100
    finally:
        r.stop()
    # The query stopped with batch 1 planned and not committed; records keep coming.
    p.send_many([b"v%d" % i for i in range(150, 170)])
    r = _reader(p.endpoint, tmp_path)
    try:
        assert r.partitions(end1, end1) == []  # a restart's first call: not a batch
        assert _seqs(r, end0, end1) == list(range(101, 151))  # re-run: the same rows
        end2 = r.latestOffset()  # once it is committed: acked, and the rest planned
        assert end2 == _at(p, 171)
        wait_until(lambda: p.acked == 150, T, "the re-run batch acked")
        assert _seqs(r, end1, end2) == list(range(151, 171))
    finally:
        r.stop()
    # availableNow on these Sparks: one batch, whose commit never comes; the next run's
    # first call names its end, and the run acks it at once.
    r = _reader(p.endpoint, tmp_path)
    try:
        r.partitions(end2, end2)
        assert r.latestOffset() == end2
        wait_until(lambda: p.acked == 170, T, "the last run's batch acked")
    finally:
        r.stop()


def test_a_restarted_runner_names_records_freed_before_they_were_read(producers, ctx, tmp_path):
    from zio_spark.errors import DataLossError
    from zio_spark.source.range_client import ControlConnection

    p = producers("nl")
    p.send_many([b"v%d" % i for i in range(60)])
    with ControlConnection(p.endpoint, ctx=ctx, timeout=10) as control:
        control.ack(30, p.incarnation)  # freed by another party, never read by the query
    r = _reader(p.endpoint, tmp_path)
    try:
        r.partitions(_at(p, 11), _at(p, 11))  # the checkpoint's last batch ended at 11
        try:
            r.latestOffset()
        except DataLossError as e:
            assert "[11, 31)" in str(e) and "'nl'" in str(e), str(e)
        else:
            raise AssertionError("no DataLossError for records 11..30")
    finally:
        r.stop()
