"""Offset and partition planning (:mod:`zio_spark.source.plan`), with no spool, socket
or Spark: explicit cases, then properties (ranges cover exactly ``[start, end)`` once,
no empty partition, the step and the row limits honoured, ends never go back)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zio_spark.source import plan

# -- pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end", "step", "want"),
    [
        (1, 1, 10, []),
        (1, 11, 10, [(1, 11)]),
        (1, 12, 10, [(1, 6), (6, 12)]),  # near equal, not 10 + 1
        (5, 8, 1, [(5, 6), (6, 7), (7, 8)]),
        (1, 1001, 300, [(1, 251), (251, 501), (501, 751), (751, 1001)]),
        (9, 3, 10, []),  # an end below its start: nothing
    ],
)
def test_pieces_cover_the_range_once_in_near_equal_parts(start, end, step, want):
    got = plan.pieces(start, end, step)
    assert got == want
    assert all(e - s <= step for s, e in got)


@given(st.integers(0, 10**9), st.integers(0, 5000), st.integers(1, 2000))
def test_pieces_properties(start, length, step):
    end = start + length
    got = plan.pieces(start, end, step)
    # Contiguous from start to end, each non-empty and at most step long.
    assert [start, *(e for _, e in got)] == [*(s for s, _ in got), end]
    assert all(0 < e - s <= step for s, e in got)
    # As few pieces as the step allows, of near-equal size (sizes differ by at most 1).
    assert len(got) == -(-length // step)
    sizes = [e - s for s, e in got]
    assert not sizes or max(sizes) - min(sizes) <= 1


# -- pack --------------------------------------------------------------------------------


def test_small_ranges_of_several_producers_share_a_partition_up_to_the_step():
    ranges = {f"c{i}": (1, 1001) for i in range(8)}  # 8 clients, 1000 records each
    assert plan.pack(ranges, 250_000) == [tuple((f"c{i}", 1, 1001) for i in range(8))]
    # A big producer is cut; small ones fill partitions up to the step, in id order.
    packed = plan.pack({"big": (1, 501), "s1": (1, 101), "s2": (11, 111)}, 250)
    assert packed == [(("big", 1, 251),), (("big", 251, 501),), (("s1", 1, 101), ("s2", 11, 111))]
    assert plan.pack({"a": (5, 5)}, 10) == []  # nothing to read: no partition
    assert plan.pack({}, 10) == []
    # Every record of every producer, once.
    for step in (1, 7, 100, 10_000):
        got = sorted(
            (p, s) for group in plan.pack(ranges, step) for p, a, b in group for s in range(a, b)
        )
        assert got == sorted((p, s) for p, (a, b) in ranges.items() for s in range(a, b))
        assert all(sum(b - a for _, a, b in g) <= step for g in plan.pack(ranges, step))


def test_pack_orders_by_producer_id_whatever_the_mapping_order():
    assert plan.pack({"b": (1, 3), "a": (1, 3)}, 10) == [(("a", 1, 3), ("b", 1, 3))]


_RANGES = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3),
    st.tuples(st.integers(1, 500), st.integers(0, 400)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=8,
)


@given(_RANGES, st.integers(1, 300))
def test_pack_properties(ranges, step):
    parts = plan.pack(ranges, step)
    # Each producer's ranges, in order, are contiguous and cover exactly [start, end).
    for p, (start, end) in ranges.items():
        mine = [(a, b) for g in parts for q, a, b in g if q == p]
        assert [s for a, b in mine for s in range(a, b)] == list(range(start, end))
    assert {q for g in parts for q, _, _ in g} <= set(ranges)
    # No empty partition and no empty range; the step is honoured.
    assert all(g for g in parts)
    assert all(b > a for g in parts for _, a, b in g)
    assert all(sum(b - a for _, a, b in g) <= step for g in parts)
    # Deterministic (read() may run twice; planning must agree with itself).
    assert plan.pack(dict(reversed(list(ranges.items()))), step) == parts
    # No two neighbouring partitions could have been one (small ranges are packed).
    for g, h in itertools.pairwise(parts):
        assert sum(b - a for _, a, b in g) + (h[0][2] - h[0][1]) > step


# -- base and partition ranges ----------------------------------------------------------


def test_base_is_spark_start_else_the_committed_offset_else_1():
    assert plan.base("a", {"a": 7}, {"a": 3}) == 7
    assert plan.base("a", {}, {"a": 3}) == 3
    assert plan.base("a", {}, {}) == 1
    assert plan.base("a", {}, {"a": 0}) == 1  # sequence numbers start at 1


def test_partition_ranges_start_at_each_base():
    ranges = plan.partition_ranges({"a": 5}, {"a": 9, "b": 4}, {"b": 2})
    assert ranges == {"a": (5, 9), "b": (2, 4)}


# -- latest_end --------------------------------------------------------------------------


def test_latest_end_is_what_is_stored_with_sorted_keys():
    got = plan.latest_end({}, {"b": 10, "a": 4}, {})
    assert got == {"a": 4, "b": 10}
    assert list(got) == ["a", "b"]  # Spark compares offsets as JSON text


def test_latest_end_never_goes_below_the_start_or_the_base():
    # A producer Spark has in its start but the spool no longer reports keeps its start.
    assert plan.latest_end({"gone": 8}, {}, {}) == {"gone": 8}
    # Stored below Spark's start (a spool that lost its tail): the start stands.
    assert plan.latest_end({"a": 8}, {"a": 5}, {}) == {"a": 8}
    # A new producer's end is at least its committed offset.
    assert plan.latest_end({}, {"a": 1}, {"a": 6}) == {"a": 6}


def test_max_records_per_trigger_takes_in_producer_id_order_from_each_base():
    start = {"a": 11}
    ends = {"a": 41, "b": 21, "c": 5}
    committed = {"b": 1, "c": 5}
    assert plan.latest_end(start, ends, committed, 50) == {"a": 41, "b": 21, "c": 5}
    assert plan.latest_end(start, ends, committed, 35) == {"a": 41, "b": 6, "c": 5}
    assert plan.latest_end(start, ends, committed, 30) == {"a": 41, "b": 1, "c": 5}
    assert plan.latest_end(start, ends, committed, 10) == {"a": 21, "b": 1, "c": 5}
    assert plan.latest_end(start, ends, committed, 0) == {"a": 11, "b": 1, "c": 5}


_OFFSETS = st.dictionaries(st.sampled_from("abcde"), st.integers(0, 1000), max_size=5)


@given(_OFFSETS, _OFFSETS, _OFFSETS, st.none() | st.integers(0, 3000))
def test_latest_end_properties(start, ends, committed, max_rows):
    out = plan.latest_end(start, ends, committed, max_rows)
    assert list(out) == sorted(out)
    assert set(out) == set(start) | set(ends)
    bases = {p: plan.base(p, start, committed) for p in out}
    # Never below the batch start (Spark would plan a batch backwards).
    assert all(out[p] >= v for p, v in start.items())
    assert all(out[p] >= bases[p] for p in out)
    unlimited = plan.latest_end(start, ends, committed)
    if max_rows is None:
        # Everything stored is planned.
        assert all(out[p] >= e for p, e in ends.items())
    else:
        # The limit is honoured, and nothing is left out while budget remains.
        taken = sum(out[p] - bases[p] for p in out)
        assert taken <= max_rows
        assert taken == min(max_rows, sum(unlimited[p] - bases[p] for p in out))
        assert all(out[p] <= unlimited[p] for p in out)


# -- take_rows ---------------------------------------------------------------------------


def test_take_rows_returns_the_budget_left():
    assert plan.take_rows({"a": 1, "b": 1}, {"a": 4, "b": 11}, 5) == ({"a": 4, "b": 3}, 0)
    assert plan.take_rows({"a": 1}, {"a": 4}, 5) == ({"a": 4}, 2)
    assert plan.take_rows({"a": 6}, {"a": 4}, 5) == ({"a": 6}, 5)  # an empty range


@given(_OFFSETS, st.integers(0, 3000))
def test_take_rows_properties(ends, budget):
    starts = {p: e // 2 for p, e in ends.items()}
    out, left = plan.take_rows(starts, ends, budget)
    assert set(out) == set(ends)
    taken = sum(out[p] - starts[p] for p in out)
    assert taken + left == budget
    assert taken == min(budget, sum(max(0, ends[p] - starts[p]) for p in ends))
    assert all(starts[p] <= out[p] <= max(starts[p], ends[p]) for p in ends)


# -- is_step -----------------------------------------------------------------------------


def test_a_step_batch_is_a_million_waiting_or_anything_waiting_while_held_back():
    assert not plan.is_step(0, False)
    assert not plan.is_step(0, True)  # held back with nothing waiting: nothing to run
    assert plan.is_step(1, True)
    assert not plan.is_step(plan.STEP - 1, False)
    assert plan.is_step(plan.STEP, False)


# -- extend_plain ------------------------------------------------------------------------


def test_extend_plain_takes_what_plain_givers_gave_within_the_budget():
    got = plan.extend_plain(
        {"p", "q"},
        sealed={"p": 21, "q": 31, "z": 99},
        committed={"q": 11},
        starts={"p": 1, "z": 1},
        ends={"p": 11, "z": 50},
        budget=15,
    )
    # p: 10 more, all taken; q: new, from its committed 11, 20 stored, 5 taken.
    assert got.ends == {"p": 21, "q": 16, "z": 50}  # z is not plain: unchanged
    assert got.starts == {"p": 1, "q": 11, "z": 1}
    assert got.budget == 0
    assert got.left == {"q": 15}


def test_extend_plain_without_a_budget_takes_all():
    got = plan.extend_plain({"p"}, {"p": 21}, {}, {}, {}, None)
    assert (got.starts, got.ends, got.budget, got.left) == ({"p": 1}, {"p": 21}, None, {})


@given(_OFFSETS, _OFFSETS, st.none() | st.integers(0, 2000), st.sets(st.sampled_from("abcde")))
def test_extend_plain_properties(sealed, committed, budget, plain):
    got = plan.extend_plain(plain, sealed, committed, {}, {}, budget)
    for p in sealed:
        if p not in plain:
            assert p not in got.ends
            continue
        start = got.starts[p]
        assert start == max(committed.get(p, 1), 1)
        gave = max(0, sealed[p] - start)
        # Each record a plain giver gave is taken or counted as left, never both.
        assert got.ends[p] - start + got.left.get(p, 0) == gave
    if budget is not None:
        taken = sum(got.ends[p] - got.starts[p] for p in got.ends)
        assert got.budget == budget - taken >= 0
