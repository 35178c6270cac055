"""The direct read mode's planning (zio_spark.source.direct, pure parts) and its option."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest

from zio_spark.codec.schema import SPARK_SCHEMA, WIRE_SCHEMA
from zio_spark.errors import ConfigError
from zio_spark.options import parse_source_options
from zio_spark.source.direct import (
    Position,
    batch_ranges,
    check_disjoint,
    initial,
    latest,
    latest_with_spool,
    owed,
    pack,
    split_offsets,
    stale_plan,
    to_json,
)
from zio_spark.source.range_client import HeldWindow

A, B = "inc-a", "inc-b"


def test_offsets_are_deterministic_json_and_parse_back() -> None:
    offs = {"z": Position(A, 5), "a": Position(B, 1)}
    out = to_json(offs)
    assert json.dumps(out) == (
        '{"a": {"end": 1, "incarnation": "inc-b"}, "z": {"end": 5, "incarnation": "inc-a"}}'
    )
    assert split_offsets(json.loads(json.dumps(out))) == (offs, {})
    assert split_offsets(None) == ({}, {})
    # Givers read through the spool keep the spool path's numbers, in the same offsets.
    assert split_offsets({"s": 7, **out}) == (offs, {"s": 7})


@pytest.mark.parametrize(
    "bad", [{"p": "5"}, {"p": {"end": 5}}, {"p": {"end": True, "incarnation": A}}, {"p": True}]
)
def test_other_offsets_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"readMode.*new checkpointLocation"):
        split_offsets(bad)


def test_a_producer_read_through_the_spool_does_not_go_on_directly() -> None:
    check_disjoint({"p": HeldWindow(A, 1, 2)}, {"q": 3})
    with pytest.raises(ConfigError, match=r"\['p'\] were read through the spool"):
        check_disjoint({"p": HeldWindow(A, 1, 2)}, {"p": 3})


def test_initial_offsets_start_at_the_oldest_held_record() -> None:
    assert initial({"p": HeldWindow(A, 7, 20)}) == {"p": Position(A, 7)}


def test_latest_reads_to_the_held_end_and_never_back() -> None:
    start = {"p": Position(A, 7), "q": Position(A, 3)}
    held = {"p": HeldWindow(A, 7, 20), "q": HeldWindow(A, 1, 2)}  # q's end behind: kept
    end, losses = latest(start, held)
    assert end == {"p": Position(A, 20), "q": Position(A, 3)} and losses == []


def test_latest_shares_max_rows_fairly() -> None:
    start = {"p": Position(A, 1), "q": Position(B, 1)}
    held = {"p": HeldWindow(A, 1, 11), "q": HeldWindow(B, 1, 11)}
    end, _ = latest(start, held, max_rows=15)
    assert end == {"p": Position(A, 9), "q": Position(B, 8)}
    end, _ = latest(start, {"p": HeldWindow(A, 1, 4), "q": HeldWindow(B, 1, 100)}, max_rows=15)
    assert end == {"p": Position(A, 4), "q": Position(B, 13)}  # what p leaves goes to q


def test_one_max_rows_budget_over_direct_producers_and_givers_through_the_spool() -> None:
    """A batch that reads some producers directly and some givers through the spool
    holds at most maxRecordsPerTrigger records in all (not that many per path), shared
    fairly by the producers whichever path reads them."""
    start = {"d": Position(A, 1)}
    held = {"d": HeldWindow(A, 1, 1001)}
    end, spool, losses = latest_with_spool(
        start, held, {"g": 1, "h": 5}, {"g": 1001, "h": 7}, max_rows=100
    )
    assert losses == []
    # h has 2 waiting; d and g split the other 98.
    assert end == {"d": Position(A, 50)} and spool == {"g": 50, "h": 7}
    # Without a budget, each path goes as far as it can.
    end, spool, _ = latest_with_spool(start, held, {"g": 1}, {"g": 1001})
    assert end == {"d": Position(A, 1001)} and spool == {"g": 1001}
    # A spool giver kept (its base is its end: nothing waiting) takes nothing.
    end, spool, _ = latest_with_spool(start, held, {"g": 40}, {"g": 40}, max_rows=10)
    assert end == {"d": Position(A, 11)} and spool == {"g": 40}


def test_a_new_producer_joins_at_its_first_record_without_records_in_that_batch() -> None:
    end, losses = latest({}, {"p": HeldWindow(A, 4, 9)})
    assert end == {"p": Position(A, 4)} and losses == []
    assert batch_ranges({}, end) == {}


def test_a_producer_not_answering_keeps_its_offset() -> None:
    end, _ = latest({"p": Position(A, 4)}, {})
    assert end == {"p": Position(A, 4)}


def test_freed_records_not_read_are_a_loss() -> None:
    end, losses = latest({"p": Position(A, 4)}, {"p": HeldWindow(A, 9, 12)})
    assert end == {"p": Position(A, 9)}  # the lost range alone; the next batch reads on
    (loss,) = losses
    assert (loss.start, loss.end) == (4, 9) and "[4, 9)" in loss.text()


def test_a_new_incarnation_jumps_to_its_first_record_and_names_the_loss() -> None:
    start = {"p": Position(A, 10)}
    held = {"p": HeldWindow(B, 1, 5)}
    end, losses = latest(start, held, seen={"p": HeldWindow(A, 1, 15)})
    assert end == {"p": Position(B, 1)}
    (loss,) = losses
    assert (loss.incarnation, loss.start, loss.end) == (A, 10, 15)
    assert batch_ranges(start, end) == {}  # nothing read across incarnations
    # Nothing known beyond the start: a possible loss only (end None).
    _, losses = latest(start, held)
    assert losses[0].end is None
    # Everything of the old one was read: no loss.
    _, losses = latest(start, held, seen={"p": HeldWindow(A, 1, 10)})
    assert losses == []


def test_available_now_stops_at_the_target() -> None:
    start = {"p": Position(A, 1), "q": Position(A, 1)}
    held = {"p": HeldWindow(A, 1, 50), "q": HeldWindow(B, 1, 50)}
    end, _ = latest(start, held, target={"p": Position(A, 30)})
    assert end["p"] == Position(A, 30)
    assert end["q"] == Position(B, 1)  # another incarnation: the switch, nothing read


def test_an_available_now_run_is_owed_by_silent_producers_short_of_the_target() -> None:
    target = {"p": Position(A, 30), "q": Position(A, 20), "r": Position(A, 9), "s": Position(B, 9)}
    start = {"p": Position(A, 10), "q": Position(A, 20), "r": Position(A, 5), "s": Position(A, 3)}
    # p answered: not owed here (its offset moves on); q reached its target; r is short
    # and silent: owed; s restarted as another incarnation since: nothing to read of B.
    assert owed(start, target, {"p": HeldWindow(A, 1, 30)}) == ["r"]
    assert owed(start, target, {"p": HeldWindow(A, 1, 30), "r": HeldWindow(A, 1, 9)}) == []


def test_a_plan_whose_end_is_of_an_incarnation_gone_is_stale() -> None:
    now = {"p": HeldWindow(B, 1, 5), "q": HeldWindow(B, 1, 5), "r": HeldWindow(A, 1, 5)}
    # p: batch 0 re-planned after a restart (start asked again: B; the old plan's end: A).
    # q: latest()'s own switch (the batch ends in the new incarnation): not stale.
    # r: same incarnation at both ends: not stale.
    start = {"p": Position(B, 1), "q": Position(A, 7), "r": Position(A, 1)}
    end = {"p": Position(A, 51), "q": Position(B, 1), "r": Position(A, 5)}
    assert stale_plan(start, end, now) == ["p"]
    assert stale_plan(start, end, {}) == []  # not seen: nothing claimed


def test_batch_ranges_and_pack_cut_like_the_spool_path() -> None:
    start = {"p": Position(A, 1), "q": Position(B, 5)}
    end = {"p": Position(A, 1001), "q": Position(B, 8)}
    ranges = batch_ranges(start, end)
    assert ranges == {"p": (A, 1, 1001), "q": (B, 5, 8)}
    assert pack(ranges, 400) == [
        (("p", A, 1, 334),),
        (("p", A, 334, 667),),
        (("p", A, 667, 1001), ("q", B, 5, 8)),  # small ranges share a partition
    ]


def test_read_mode_option() -> None:
    assert parse_source_options({"endpoints": "tcp://h:1"}).read_mode == "spool"
    opts = parse_source_options({"endpoints": "tcp://h:1", "readmode": "Direct"})
    assert opts.read_mode == "direct"
    with pytest.raises(ConfigError, match=r"'readMode'.*one of spool, direct"):
        parse_source_options({"endpoints": "tcp://h:1", "readMode": "fast"})
    with pytest.raises(ConfigError, match=r"'readMode'.*with 'bind'"):
        parse_source_options({"bind": "tcp://127.0.0.1:5555", "readMode": "direct"})
    grouped = parse_source_options({"group": "g", "readMode": "direct"})
    assert grouped.read_mode == "direct" and grouped.zre is not None
    assert grouped.zre.group == "g" and grouped.endpoints == ()


def test_a_range_batch_becomes_the_spool_paths_columns() -> None:
    from zio_spark.spark.source import _spark_batch

    wire = pa.RecordBatch.from_arrays(
        [
            pa.array([3, 4], pa.int64()),
            pa.array([b"v3", b"v4"]),
            pa.array([None, b"k"]),
            pa.array([None, 7], pa.int64()),
            pa.array([[("h", "x")], []], pa.map_(pa.string(), pa.string())),
        ],
        schema=WIRE_SCHEMA,
    )
    out = _spark_batch(wire, "p", 2, 1_000_000, tuple(SPARK_SCHEMA.names))
    assert out.schema.equals(SPARK_SCHEMA)
    assert out.column("producer").to_pylist() == ["p", "p"]
    assert out.column("granule").to_pylist() == [0, 7]
    assert out.column("origin").to_pylist() == [2, 2]
    part = _spark_batch(wire, "p", 2, 1_000_000, ("seq", "value"))
    assert part.schema.names == ["seq", "value"] and part.column("seq").to_pylist() == [3, 4]


def _wire(first: int, n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array(range(first, first + n), pa.int64()),
            pa.array([b"v%d" % i for i in range(first, first + n)]),
            pa.nulls(n, pa.binary()),
            pa.nulls(n, pa.int64()),
            pa.nulls(n, pa.map_(pa.string(), pa.string())),
        ],
        schema=WIRE_SCHEMA,
    )


class _FakeRangeConnection:
    """Stands in for RangeConnection: yields the given (origin, wire batch) DATs."""

    dats: list[tuple[int, pa.RecordBatch]] = []

    def __init__(self, endpoint: str, **_: object) -> None:
        self.origin = 0

    def __enter__(self) -> _FakeRangeConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def read(self, producer: str, incarnation: str, start: int, end: int) -> Any:
        for origin, wire in self.dats:
            self.origin = origin
            yield wire


def _direct_partition(start: int, end: int) -> Any:
    from zio_spark.spark.source import DirectPartition

    return DirectPartition(
        ranges=(("tcp://h:1", "p", "inc", start, end),),
        fail_on_data_loss=True,
        columns=tuple(SPARK_SCHEMA.names),
        timestamp_us=5,
        timeout=1.0,
        mode=None,
        curve=None,
        stream="zio",
    )


def test_a_ranges_dats_reach_spark_in_few_large_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark pays per batch handed over: DATs are gathered into batches of
    SPARK_BATCH_ROWS (the last smaller), in order, one origin per batch."""
    from zio_spark.spark import source

    monkeypatch.setattr(source, "SPARK_BATCH_ROWS", 10)
    dats = [(7, _wire(1 + 4 * i, 4)) for i in range(6)]  # 24 records
    dats += [(8, _wire(25, 4)), (8, _wire(29, 2))]  # the origin changes: a new batch
    monkeypatch.setattr(_FakeRangeConnection, "dats", dats)
    monkeypatch.setattr(source, "RangeConnection", _FakeRangeConnection)
    out = list(source._read_direct(_direct_partition(1, 31)))
    assert [b.num_rows for b in out] == [12, 12, 6]
    assert [b.column("origin").to_pylist()[0] for b in out] == [7, 7, 8]
    assert all(b.schema.equals(SPARK_SCHEMA) for b in out)
    seqs = [s for b in out for s in b.column("seq").to_pylist()]
    assert seqs == list(range(1, 31))
    assert out[0].column("value").to_pylist()[:2] == [b"v1", b"v2"]


def test_batches_are_joined_without_concat_batches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow < 19 has no concat_batches: the table path gives the same batch."""
    from zio_spark.spark import source

    parts = [_wire(1, 3), _wire(4, 2), _wire(6, 1)]
    joined = source._concat(parts)
    monkeypatch.setattr(source, "_CONCAT_BATCHES", None)
    assert source._concat(parts).equals(joined)
    assert joined.num_rows == 6 and joined.column("seq").to_pylist() == list(range(1, 7))
    assert source._concat(parts[:1]) is parts[0]


def test_direct_mode_cuts_larger_partitions_unless_told() -> None:
    """Each direct task costs a range flow and a worker task's setup: the direct mode's
    default maxRecordsPerPartition is larger, and its batches come in an even number of
    tasks (minPartitions 2); ones given are kept, the spool's are not moved."""
    from zio_spark.options import DIRECT_MIN_PARTITIONS, DIRECT_RECORDS_PER_PARTITION

    direct = parse_source_options({"endpoints": "tcp://h:1", "readMode": "direct"})
    assert direct.max_records_per_partition == DIRECT_RECORDS_PER_PARTITION == 1_000_000
    assert direct.min_partitions == DIRECT_MIN_PARTITIONS == 2
    given = parse_source_options(
        {
            "endpoints": "tcp://h:1",
            "readMode": "direct",
            "maxRecordsPerPartition": "1000",
            "minPartitions": "1",
        }
    )
    assert given.max_records_per_partition == 1000 and given.min_partitions == 1
    spool = parse_source_options({"endpoints": "tcp://h:1"})
    assert spool.max_records_per_partition == 250_000 and spool.min_partitions == 1
    assert (
        parse_source_options({"endpoints": "tcp://h:1", "minpartitions": "8"}).min_partitions == 8
    )
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ConfigError, match=r"minPartitions"):
            parse_source_options({"endpoints": "tcp://h:1", "minPartitions": bad})


def test_direct_pack_in_waves() -> None:
    """With minPartitions, a direct batch is an even number of near-equal partitions."""
    ranges = {"p": (A, 1, 1_180_001)}
    parts = pack(ranges, 1_000_000, 2)
    assert [(g[0][2], g[0][3]) for g in parts] == [(1, 590_001), (590_001, 1_180_001)]
    assert all(g[0][:2] == ("p", A) for g in parts)
    assert len(pack({"p": (A, 1, 2_500_001)}, 1_000_000, 2)) == 4


def test_settled_end_splits_the_larger_of_two_batches_of_a_full_window() -> None:
    """A producer whose window held its sends back: a batch reads at most half of what it
    holds (the previous batch, not yet acked, included), so the batch sizes settle at half
    the window instead of alternating (1.75M / 250k with a 2M window, measured)."""
    from zio_spark.source.direct import settled_end

    # The previous batch [1, 250001) is held until this plan acks it; 1.75M made since.
    assert settled_end(250_001, HeldWindow(A, 1, 2_000_001, True)) == 1_250_001
    # The previous batch was the larger one: this one is whole.
    assert settled_end(1_750_001, HeldWindow(A, 1, 2_000_001, True)) == 2_000_001
    # Nothing held beyond the start: an empty batch, never one ending below its start.
    assert settled_end(501, HeldWindow(A, 1, 501, True)) == 501
    # Nothing of the previous batch held (acked already): half of what is.
    assert settled_end(501, HeldWindow(A, 501, 901, True)) == 701

    # Simulated: a producer that fills its window (2M) while each batch runs; the plan
    # of a batch sees the previous one [start, end) still held, then acks it.
    window, start, end = 2_000_000, 1, 1_750_001  # a first batch as the startup made it
    sizes = []
    for _ in range(6):
        nxt = settled_end(end, HeldWindow(A, start, start + window, True))
        sizes.append(nxt - end)
        start, end = end, nxt
    assert sizes == [250_000, 1_000_000, 1_000_000, 1_000_000, 1_000_000, 1_000_000]
    # Without the cut the sizes would alternate: 250k, 1.75M, 250k, ...


def test_latest_cuts_a_full_producer_only() -> None:
    start = {"p": Position(A, 250_001), "q": Position(B, 250_001)}
    held = {
        "p": HeldWindow(A, 1, 2_000_001, True),  # its sends waited: cut to half
        "q": HeldWindow(B, 1, 2_000_001),  # not held back: all of it
    }
    end, losses = latest(start, held)
    assert losses == []
    assert end == {"p": Position(A, 1_250_001), "q": Position(B, 2_000_001)}
    # An availableNow run reads to its target, full or not.
    target = {"p": Position(A, 2_000_001), "q": Position(B, 2_000_001)}
    end, _ = latest(start, held, target=target)
    assert end["p"] == Position(A, 2_000_001)
    # A runner's first plan is not cut (it may be a run's only batch).
    end, _ = latest(start, held, settle=False)
    assert end["p"] == Position(A, 2_000_001)
    # maxRecordsPerTrigger still applies after the cut.
    end, _ = latest(start, held, max_rows=100)
    assert end == {"p": Position(A, 250_051), "q": Position(B, 250_051)}
