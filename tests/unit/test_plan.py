"""Offset and partition planning (:mod:`zio_spark.source.plan`), with no spool, socket
or Spark: explicit cases, then properties (ranges cover exactly ``[start, end)`` once,
no empty partition, the step and the row limits honoured, ends never go back)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

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


def test_pack_in_waves_cuts_a_multiple_of_the_waves_into_near_equal_partitions():
    """minPartitions (``waves_of``): 1.18M records of one producer with a step of 500k
    were 3 tasks (a second wave of one on two cores); in waves of 2 they are 4."""
    got = plan.pack({"p": (1, 1_180_001)}, 500_000, 2)
    assert [b - a for g in got for _, a, b in g] == [295_000] * 4
    assert plan.pack({"p": (1, 1_180_001)}, 1_000_000, 2) == [
        (("p", 1, 590_001),),
        (("p", 590_001, 1_180_001),),
    ]
    # Small producers are laid end to end and cut: a producer may span two partitions.
    assert plan.pack({"a": (1, 301), "b": (1, 101)}, 1000, 2) == [
        (("a", 1, 201),),
        (("a", 201, 301), ("b", 1, 101)),
    ]
    # Never an empty partition: fewer records than the waves ask for.
    assert plan.pack({"a": (1, 4)}, 10, 8) == [(("a", 1, 2),), (("a", 2, 3),), (("a", 3, 4),)]
    assert plan.pack({"a": (5, 5)}, 10, 2) == [] and plan.pack({}, 10, 2) == []
    with pytest.raises(ValueError, match="empty"):
        plan.cut({"a": (1, 3)}, 3)


_WAVE_RANGES = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3),
    st.tuples(st.integers(1, 500), st.integers(0, 400)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=8,
)


@given(_WAVE_RANGES, st.integers(1, 300), st.integers(2, 5))
def test_pack_in_waves_properties(ranges, step, waves):
    parts = plan.pack(ranges, step, waves)
    total = sum(e - s for s, e in ranges.values())
    # Every record once, each producer's pieces in order and contiguous.
    for p, (start, end) in ranges.items():
        mine = [(a, b) for g in parts for q, a, b in g if q == p]
        assert [s for a, b in mine for s in range(a, b)] == list(range(start, end))
    assert all(g for g in parts) and all(b > a for g in parts for _, a, b in g)
    sizes = [sum(b - a for _, a, b in g) for g in parts]
    if total:
        # Near-equal, within the step, whole waves unless there are too few records.
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= step
        assert len(parts) % waves == 0 or len(parts) == total
        assert len(parts) >= min(waves, total)
        # No more waves than the step needs.
        assert len(parts) <= max(waves, -(-len(plan.pack(ranges, step)) // waves) * waves)
    else:
        assert parts == []
    assert plan.pack(dict(reversed(list(ranges.items()))), step, waves) == parts


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


def test_max_records_per_trigger_is_shared_fairly_from_each_base():
    start = {"a": 11}
    ends = {"a": 41, "b": 21, "c": 5}  # waiting: a 30 (from 11), b 20 (from 1), c none
    committed = {"b": 1, "c": 5}
    assert plan.latest_end(start, ends, committed, 50) == {"a": 41, "b": 21, "c": 5}
    # 35 over a and b: 17 each, the odd record to the first in id order.
    assert plan.latest_end(start, ends, committed, 35) == {"a": 29, "b": 18, "c": 5}
    assert plan.latest_end(start, ends, committed, 30) == {"a": 26, "b": 16, "c": 5}
    assert plan.latest_end(start, ends, committed, 10) == {"a": 16, "b": 6, "c": 5}
    assert plan.latest_end(start, ends, committed, 1) == {"a": 12, "b": 1, "c": 5}
    assert plan.latest_end(start, ends, committed, 0) == {"a": 11, "b": 1, "c": 5}


def test_a_busy_first_producer_does_not_fill_every_trigger():
    """The spool mode's budget in producer id order gave "a" (a backlog of 10,000) every
    batch of 100 until it was drained; shared, "b" is read from the first batch on."""
    ends, committed = {"a": 10_001, "b": 151}, {"a": 1, "b": 1}
    start: dict[str, int] = {}
    sizes = []
    while start != ends:
        end = plan.latest_end(start, ends, committed, 100)
        sizes.append((end["a"] - start.get("a", 1), end["b"] - start.get("b", 1)))
        start = end
    assert sizes[:4] == [(50, 50), (50, 50), (50, 50), (100, 0)]
    assert sum(a for a, _ in sizes) == 10_000 and sum(b for _, b in sizes) == 150
    assert len(sizes) == 102  # the budget used in full: 10,150 records in batches of 100


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
        # Shared fairly: a producer cut short got at least as much as any other (but
        # for one odd record), so none is starved while it has records waiting and the
        # budget reaches it: with as many records as producers waiting, each gets one.
        got = {p: out[p] - bases[p] for p in out}
        want = {p: max(0, unlimited[p] - bases[p]) for p in out}
        for p in out:
            if got[p] < want[p]:
                assert all(got[q] <= got[p] + 1 for q in out), (got, want)
        hungry = [p for p in out if want[p] > 0]
        if max_rows >= len(hungry):
            assert all(got[p] >= 1 for p in hungry), (got, want)
    # Deterministic: the same inputs in another mapping order give the same ends.
    again = plan.latest_end(
        dict(reversed(start.items())),
        dict(reversed(ends.items())),
        dict(reversed(committed.items())),
        max_rows,
    )
    assert again == out


# -- fair_rows ---------------------------------------------------------------------------


def test_fair_rows_gives_each_producer_an_equal_share_and_passes_on_what_one_leaves():
    # 2 waiting at "a": less than its share (10 over 3); "b" and "c" split the other 8.
    assert plan.fair_rows({"a": 1, "b": 1, "c": 1}, {"a": 3, "b": 101, "c": 101}, 10) == {
        "a": 3,
        "b": 5,
        "c": 5,
    }
    # 7 left over 2 after "a" took its 3: the odd record goes to the first in id order.
    assert plan.fair_rows({"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 101, "c": 101}, 10) == {
        "a": 4,
        "b": 5,
        "c": 4,
    }
    # A busy first producer does not fill the batch (id order would give "a" all 6).
    assert plan.fair_rows({"a": 1, "b": 1}, {"a": 1001, "b": 1001}, 6) == {"a": 4, "b": 4}
    assert plan.fair_rows({"a": 1, "b": 1}, {"a": 1001, "b": 1001}, 5) == {"a": 4, "b": 3}
    assert plan.fair_rows({"a": 6, "b": 1}, {"a": 4, "b": 3}, 5) == {"a": 6, "b": 3}  # empty
    assert plan.fair_rows({"a": 1}, {"a": 9}, 0) == {"a": 1}


@given(_OFFSETS, st.integers(0, 3000))
def test_fair_rows_properties(ends, budget):
    starts = {p: e // 2 for p, e in ends.items()}
    out = plan.fair_rows(starts, ends, budget)
    want = {p: max(0, ends[p] - starts[p]) for p in ends}
    got = {p: out[p] - starts[p] for p in out}
    assert set(out) == set(ends)
    assert all(0 <= got[p] <= want[p] for p in ends)
    assert sum(got.values()) == min(budget, sum(want.values()))  # the budget, all of it
    # Max-min fair: a producer given less than it wanted got at least as much as any
    # other, but for one odd record.
    for p in ends:
        if got[p] < want[p]:
            assert all(got[q] <= got[p] + 1 for q in ends), (got, want)


# -- is_step -----------------------------------------------------------------------------


def test_a_step_batch_is_a_million_waiting_or_anything_waiting_while_held_back():
    assert not plan.is_step(0, False)
    assert not plan.is_step(0, True)  # held back with nothing waiting: nothing to run
    assert plan.is_step(1, True)
    assert not plan.is_step(plan.STEP - 1, False)
    assert plan.is_step(plan.STEP, False)


# -- a batch read's maxRecords: take_acked, extend_plain -----------------------------------


def test_take_acked_leaves_the_plain_givers_their_records_first():
    starts = {"a": 1, "b": 1, "tcp://p": 1}
    ends = {"a": 2501, "b": 101, "tcp://p": 301}
    # The plain giver gave 300 and may still send 10: 310 of 1000 are its; "a" and "b"
    # (ack-capable) share the 690 left fairly, "b" needing only 100.
    assert plan.take_acked(starts, ends, {"tcp://p": 310}, 1000) == {"a": 591, "b": 101}
    # Id order would give "a", first, the whole budget: the plain giver's 300 lost.
    # Plain givers that alone reach the budget leave nothing to the ack-capable ones.
    assert plan.take_acked(starts, ends, {"tcp://p": 1200}, 1000) == {"a": 1, "b": 1}
    # No plain giver: all three are ack-capable, 10 shared fairly (4 + 3 + 3).
    assert plan.take_acked(starts, ends, {}, 10) == {"a": 5, "b": 4, "tcp://p": 4}
    assert plan.take_acked({"a": 1}, {"a": 9}, {"gone": 0}, 3) == {"a": 4}


@given(_OFFSETS, st.sets(st.sampled_from("abcde")), st.integers(0, 3000), st.integers(0, 50))
def test_take_acked_properties(ends, plain_ids, budget, in_flight):
    starts = {p: e // 2 for p, e in ends.items()}
    plain = {p: max(0, ends[p] - starts[p]) + in_flight for p in plain_ids if p in ends}
    out = plan.take_acked(starts, ends, plain, budget)
    assert set(out) == set(ends) - set(plain)  # only the ack-capable producers
    taken = sum(out[p] - starts[p] for p in out)
    want = sum(max(0, ends[p] - starts[p]) for p in out)
    # The plain givers' reach comes first; the ack-capable ones get all that is left.
    assert taken == min(want, max(0, budget - sum(plain.values())))
    assert all(starts[p] <= out[p] <= max(starts[p], ends[p]) for p in out)


def test_extend_plain_takes_what_plain_givers_gave_within_the_budget():
    got = plan.extend_plain(
        {"p", "q"},
        sealed={"p": 21, "q": 31, "z": 99},
        committed={"q": 11},
        starts={"p": 1, "z": 1},
        ends={"p": 11, "z": 50},
        budget=15,
    )
    # p: 10 more, q: new, from its committed 11, 20 stored; 15 shared fairly: 8 and 7
    # (the odd record to the first in id order), each loses only its last records.
    assert got.ends == {"p": 19, "q": 18, "z": 50}  # z is not plain: unchanged
    assert got.starts == {"p": 1, "q": 11, "z": 1}
    assert got.budget == 0
    assert got.left == {"p": (19, 21), "q": (18, 31)}
    # Within the budget: all they gave.
    got = plan.extend_plain({"p", "q"}, {"p": 21, "q": 31}, {"q": 11}, {"p": 1}, {"p": 11}, 40)
    assert (got.ends, got.left, got.budget) == ({"p": 21, "q": 31}, {}, 10)


def test_extend_plain_without_a_budget_takes_all():
    got = plan.extend_plain({"p"}, {"p": 21}, {}, {}, {}, None)
    assert (got.starts, got.ends, got.budget, got.left) == ({"p": 1}, {"p": 21}, None, {})


@given(_OFFSETS, _OFFSETS, st.none() | st.integers(0, 2000), st.sets(st.sampled_from("abcde")))
def test_extend_plain_properties(sealed, committed, budget, plain):
    got = plan.extend_plain(plain, sealed, committed, {}, {}, budget)
    gave_all = 0
    for p in sealed:
        if p not in plain:
            assert p not in got.ends
            continue
        start = got.starts[p]
        assert start == max(committed.get(p, 1), 1)
        gave = max(0, sealed[p] - start)
        gave_all += gave
        # Each record a plain giver gave is taken or counted as left, never both: what
        # is left is the range right after what is taken, to what it gave.
        lost_from, lost_to = got.left.get(p, (got.ends[p], got.ends[p]))
        assert lost_from == got.ends[p] and got.ends[p] - start + lost_to - lost_from == gave
    taken = sum(got.ends[p] - got.starts[p] for p in got.ends)
    if budget is None:
        assert got.left == {} and taken == gave_all
    else:
        assert got.budget == budget - taken >= 0
        # A record is left out only when the plain givers alone gave more than the budget.
        assert taken == min(budget, gave_all)


# -- completeness (availableNow) ----------------------------------------------------------


@dataclass(frozen=True)
class Flow:
    endpoint: str
    producer: str | None = None
    state: str = "receiving"
    ack_capable: bool = False
    encoding: str = "plain"
    records: int = 0
    last_error: str | None = None
    idle: bool = False
    position: int | None = None
    flows: int = 1
    last_data: float = 0.0


def _view(now: float, *status: Flow, **kw: Any) -> plan.RunView:
    kw.setdefault("positions", {})
    kw.setdefault("stored", {})
    kw.setdefault("looked_at", now)
    return plan.RunView(now=now, started_at=0.0, status=status, **kw)


def _check(c: plan.Completeness, view: plan.RunView, **kw: Any) -> plan.Verdict:
    kw.setdefault("plain", True)
    kw.setdefault("strict", True)
    return c.check(view, **kw)


def test_no_producer_is_awaited_for_reach_then_a_problem():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    assert _check(c, _view(4.0)).awaited == ["no producer yet"]
    late = _check(c, _view(6.0, bound=("tcp://*:5555",)))
    assert late.awaited == []
    assert late.problems[0][0] == "(none)" and "tcp://*:5555" in late.problems[0][1]
    # With a shorter reach (a stream's first batch), and not strict: nothing reported.
    quiet = _check(c, _view(2.0), strict=False, reach=1.0)
    assert quiet == plan.Verdict()


def test_an_endpoint_without_a_flow_is_awaited_then_named_with_what_the_socket_saw():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    ep = Flow("tcp://h:1", state="connecting", flows=0)
    assert _check(c, _view(1.0, ep)).awaited == ["tcp://h:1: no flow yet"]
    v = _check(c, _view(9.0, ep, why_no_flow=lambda e: f"{e} refused"))
    assert v.awaited == [] and v.problems[0][0] == "tcp://h:1"
    assert "(tcp://h:1 refused)" in v.problems[0][1]
    # A failed connection is reported at once; warned, not raised, on a first batch.
    failed = Flow("tcp://h:1", state="failed", flows=0, last_error="boom")
    w = _check(c, _view(1.0, failed), strict=False, warn=True)
    assert w.problems == [] and "(boom)" in w.warnings[0][1]


def test_a_stating_producer_is_done_by_its_position_or_more_false():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    p = Flow("tcp://h:1", "p", position=10, ack_capable=True)
    assert _check(c, _view(1.0, p, positions={"p": 10}, stored={"p": 7})).awaited == [
        "p: 7 of its 10 stored"
    ]
    assert _check(c, _view(1.0, p, positions={"p": 10}, stored={"p": 10})).awaited == []
    idle = replace(p, idle=True)  # more: false with all it sent stored
    assert _check(c, _view(1.0, idle, positions={"p": 10}, stored={"p": 7})).awaited == []


def test_a_stating_producer_whose_flow_is_down_is_awaited_connect_timeout_then_reported():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    down = Flow("tcp://h:1", "p", state="failed", position=10, last_error="gone")
    view = {"positions": {"p": 10}, "stored": {"p": 7}}
    assert _check(c, _view(10.0, down, **view)).awaited == ["p: 7 of its 10 stored, flow down"]
    assert _check(c, _view(15.0, down, **view)).awaited  # 5 s: not more than the timeout
    v = _check(c, _view(15.5, down, **view))
    assert v.awaited == [] and v.problems[0][0] == "p" and "(gone)" in v.problems[0][1]
    # Not strict (a first batch): a warning, whatever ``warn`` says.
    c2 = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    _check(c2, _view(10.0, down, **view), strict=False)
    assert _check(c2, _view(16.0, down, **view), strict=False).warnings[0][0] == "p"
    # Back to receiving: the down clock starts again.
    _check(c2, _view(17.0, replace(down, state="receiving"), **view), strict=False)
    assert _check(c2, _view(18.0, down, **view), strict=False).warnings == []


def test_a_plain_giver_is_done_after_plain_giver_quiet_while_holding_credit():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    g = Flow("tcp://h:1", "g", records=50, last_data=10.0)
    assert _check(c, _view(11.0, g)).awaited == ["tcp://h:1: plain giver, quiet 1.0 s"]
    v = _check(c, _view(12.5, g))
    assert v.awaited == [] and v.done_quiet == [("tcp://h:1", 2.5, 50)]
    # Not asked about plain givers (a 4.2+ first batch): not awaited at all.
    assert _check(c, _view(11.0, g), plain=False).awaited == []


def test_quiet_counts_only_from_when_max_backlog_stopped_withholding_credit():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    g = Flow("tcp://h:1", "g", records=50, last_data=10.0)
    # Held back at 20 (withheld time moved): quiet starts again from 20.
    held = _view(20.0, g, held_back=frozenset({"g"}), withheld_ms={"g": 300})
    assert _check(c, held).awaited == ["tcp://h:1: plain giver, quiet 0.0 s"]
    assert _check(c, _view(21.0, g, withheld_ms={"g": 300})).awaited
    assert _check(c, _view(22.5, g, withheld_ms={"g": 300})).awaited == []


def test_a_plain_giver_that_gave_nothing_is_a_problem():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    v = _check(c, _view(3.0, Flow("tcp://h:1", "g", records=0)))
    assert v.awaited == [] and "gave nothing" in v.problems[0][1]


def test_a_zio_spark_giver_stating_no_position_ends_by_more_false_or_eot_never_by_quiet():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    g = Flow("tcp://h:1", "z", ack_capable=True, records=9)
    assert _check(c, _view(4.0, g)).awaited == [
        "tcp://h:1: zio-spark giver, until more:false or EOT"
    ]
    v = _check(c, _view(5.0, g))
    assert v.awaited == [] and "neither said it had no more" in v.problems[0][1]
    assert _check(c, _view(9.0, replace(g, idle=True))) == plan.Verdict()


def test_cap_stops_awaiting_a_flow_still_giving_and_warns():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    g = Flow("tcp://h:1", "g", records=5, last_data=0.0)
    assert _check(c, _view(1.0, g, looked_at=0.5), strict=False, cap=5).awaited
    v = _check(c, _view(6.5, replace(g, last_data=6.4), looked_at=6.4), strict=False, cap=5)
    assert v.awaited == [] and "was still giving 5 s" in v.warnings[0][1]


def test_a_named_giver_client_whose_flow_failed_is_awaited_connect_timeout():
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    gone = Flow("tcp://peer:9", "cli", state="failed", last_error="reset")
    assert _check(c, _view(1.0, gone)).awaited == ["cli: giver client's flow dropped, awaiting it"]
    v = _check(c, _view(6.5, gone))
    assert v.problems == [("client:cli", v.problems[0][1])] and "(reset)" in v.problems[0][1]
    # Back with a live flow: not awaited; a plain client (origin:<n>) never is.
    back = Flow("tcp://peer:10", "cli", records=3, last_data=6.5)
    assert "cli: giver client" not in " ".join(_check(c, _view(7.0, gone, back)).awaited)
    anon = Flow("tcp://peer:11", "origin:3", state="failed")
    assert _check(c, _view(1.0, anon)).awaited == []
    # An endpoint we connect to is not a giver client (its own rules apply).
    mine = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    assert _check(mine, _view(1.0, gone, named=frozenset({"tcp://peer:9"}))).awaited == []


_FLOWS = st.builds(
    Flow,
    endpoint=st.sampled_from(["tcp://a:1", "tcp://b:2", "tcp://c:3"]),
    producer=st.sampled_from([None, "p", "q", "origin:1"]),
    state=st.sampled_from(["connecting", "receiving", "ended", "failed", "waiting"]),
    ack_capable=st.booleans(),
    records=st.integers(0, 5),
    idle=st.booleans(),
    position=st.none() | st.integers(0, 20),
    flows=st.integers(0, 2),
    last_data=st.floats(0, 30),
)


@given(
    st.lists(_FLOWS, max_size=4),
    st.dictionaries(st.sampled_from("pq"), st.integers(0, 20)),
    st.dictionaries(st.sampled_from("pq"), st.integers(0, 20)),
    st.floats(0, 30),
    st.booleans(),
    st.booleans(),
)
def test_completeness_properties(flows, positions, stored, now, plain, strict):
    c = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    v = c.check(_view(now, *flows, positions=positions, stored=stored), plain=plain, strict=strict)
    # A producer that stated a position and has it all stored is never awaited.
    for p, pos in positions.items():
        if stored.get(p, 0) >= pos:
            assert not any(a.startswith(f"{p}: {stored.get(p, 0)} of its") for a in v.awaited)
    # Not strict: no problems (a first batch only warns).
    if not strict:
        assert v.problems == []
    # The same look gives the same answer to a new run (decided by state, not by luck).
    again = plan.Completeness(connect_timeout=5, plain_giver_quiet=2)
    view = _view(now, *flows, positions=positions, stored=stored)
    assert again.check(view, plain=plain, strict=strict) == v
    # Every flow ended and nothing stated: nothing left to wait for.
    if flows and all(f.state == "ended" for f in flows) and not positions:
        assert v.awaited == []


def test_planning_is_pure():
    """plan.py imports no I/O, thread or clock (the runner passes the clock's reading in
    a RunView), and nothing of zio_spark but itself."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(plan.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    allowed = {"__future__", "itertools", "collections.abc", "dataclasses", "typing"}
    assert names <= allowed, names - allowed
