"""Offset and partition planning of the readers: pure functions, no I/O.

Offsets are ``{"<producer id>": next_seq}``: every record of that producer with
``seq < next_seq`` is covered. A producer's *base* is where its next batch starts: the
batch start Spark gave for it, else the spool's committed offset (sequence numbers
start at 1). The stream reader (:mod:`zio_spark.spark.source`) asks here:

- which end offsets to plan (:func:`latest_end`): never below the start Spark gave nor
  below the base, within a ``maxRecordsPerTrigger`` budget (:func:`take_rows`);
- whether records waiting make a batch of their own during an availableNow run before
  the producers are done (:func:`is_step`);
- how a batch's ranges are cut into Spark partitions (:func:`partition_ranges`,
  :func:`pieces`, :func:`pack`).

The batch reader uses :func:`take_rows` for ``maxRecords`` and :func:`extend_plain`
for the plain givers' records that arrived until their flows ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "STEP",
    "PlainTake",
    "Range",
    "base",
    "extend_plain",
    "is_step",
    "latest_end",
    "pack",
    "partition_ranges",
    "pieces",
    "sorted_offsets",
    "take_rows",
]

Range = tuple[str, int, int]
"""``(producer, start, end)``: the records ``start <= seq < end`` of one producer."""

# availableNow: records waiting beyond the last batch that make a batch of their own
# while the producers are still sending (:func:`is_step`).
STEP = 1_000_000


def sorted_offsets(offsets: Mapping[str, int]) -> dict[str, int]:
    """``offsets`` with sorted keys: Spark compares offsets as JSON text."""
    return dict(sorted(offsets.items()))


def base(producer: str, start: Mapping[str, int], committed: Mapping[str, int]) -> int:
    """Where ``producer``'s next batch starts: its offset in ``start`` (Spark's batch
    start), else its committed offset (at least 1, the first sequence number)."""
    if producer in start:
        return int(start[producer])
    return max(committed.get(producer, 1), 1)


def take_rows(
    starts: Mapping[str, int], ends: Mapping[str, int], budget: int
) -> tuple[dict[str, int], int]:
    """``ends`` cut to at most ``budget`` records in all, taken in producer id order from
    each producer's start; returns the new ends (same keys) and the budget left.

    ``starts`` must hold every producer of ``ends``. A range already empty (end at or
    below its start) takes nothing and its end is set to its start.
    """
    out: dict[str, int] = {}
    for p in sorted(ends):
        s = starts[p]
        take = max(0, min(ends[p] - s, budget))
        out[p] = s + take
        budget -= take
    return out, budget


def latest_end(
    start: Mapping[str, int],
    ends: Mapping[str, int],
    committed: Mapping[str, int],
    max_rows: int | None = None,
) -> dict[str, int]:
    """The end offsets of the next batch (``latestOffset``).

    ``start`` is Spark's batch start, ``ends`` what the spool holds (sealed) or the
    availableNow target, ``committed`` the spool's committed offsets. Every producer of
    ``start`` or ``ends`` gets an end no lower than its start offset, its base and what
    is stored; with ``max_rows`` (``maxRecordsPerTrigger``) the batch holds at most that
    many records, taken in producer id order from each base. Keys are sorted.
    """
    out = {p: max(int(v), ends.get(p, 0)) for p, v in start.items()}
    for p, e in ends.items():
        out[p] = max(out.get(p, 0), e, base(p, start, committed))
    if max_rows is not None:
        out, _ = take_rows({p: base(p, start, committed) for p in out}, out, max_rows)
    return sorted_offsets(out)


def is_step(waiting: int, held_back: bool) -> bool:
    """availableNow before every producer is done: do the ``waiting`` records (stored
    beyond the last batch) make a batch of their own? Yes once :data:`STEP` wait, or any
    wait while ``maxBacklog`` holds a producer back (only a batch's commit frees it)."""
    return waiting >= STEP or (waiting > 0 and held_back)


def partition_ranges(
    start: Mapping[str, int], end: Mapping[str, int], committed: Mapping[str, int]
) -> dict[str, tuple[int, int]]:
    """Per producer of ``end``: the ``[base, end)`` range a batch reads."""
    return {p: (base(p, start, committed), int(end[p])) for p in end}


def pieces(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ranges of at most ``step`` sequence numbers, of near
    equal size (a 260k range with step 250k is two of 130k, not 250k and 10k)."""
    if end <= start:
        return []
    n = -(-(end - start) // step)
    bounds = [start + (end - start) * i // n for i in range(n + 1)]
    return list(itertools.pairwise(bounds))


def pack(ranges: Mapping[str, tuple[int, int]], step: int) -> list[tuple[Range, ...]]:
    """The ranges of one batch as the ranges of its Spark partitions.

    A producer's range is cut into near-equal pieces of at most ``step`` records
    (:func:`pieces`), so one producer's batch uses several cores; pieces of several
    producers then share a partition up to ``step`` records, in producer id order, so
    many small producers do not cost a task each (8 plain clients: ~60 ms of worker CPU
    per task and batch, 18 us per record, was the largest cost of a bound source).
    """
    out: list[tuple[Range, ...]] = []
    group: list[Range] = []
    size = 0
    for producer in sorted(ranges):
        start, end = ranges[producer]
        for s, e in pieces(start, end, step):
            if group and size + (e - s) > step:
                out.append(tuple(group))
                group, size = [], 0
            group.append((producer, s, e))
            size += e - s
    if group:
        out.append(tuple(group))
    return out


@dataclass(frozen=True)
class PlainTake:
    """A batch read's plain givers after their flows ended (:func:`extend_plain`)."""

    starts: dict[str, int]
    ends: dict[str, int]
    budget: int | None
    # Per plain giver: records stored beyond what ``maxRecords`` let in (not taken).
    left: dict[str, int]


def extend_plain(
    plain: Iterable[str],
    sealed: Mapping[str, int],
    committed: Mapping[str, int],
    starts: Mapping[str, int],
    ends: Mapping[str, int],
    budget: int | None,
) -> PlainTake:
    """Extend a batch read's ``ends`` of the ``plain`` givers (no acks) to all they gave
    (``sealed``, the spool's ends after the flows ended), within ``budget`` (what
    ``maxRecords`` leaves; None: no limit), in producer id order.

    A producer new in ``sealed`` starts at its committed offset (at least 1). Producers
    not in ``plain`` keep their ends.
    """
    plain = set(plain)
    new_starts, new_ends = dict(starts), dict(ends)
    left: dict[str, int] = {}
    for p in sorted(sealed):
        if p not in plain:
            continue
        start = new_starts.setdefault(p, max(committed.get(p, 1), 1))
        end = new_ends.get(p, start)
        more = max(0, sealed[p] - end)
        take = more if budget is None else min(more, budget)
        if budget is not None:
            budget -= take
        new_ends[p] = end + take
        if more > take:
            left[p] = more - take
    return PlainTake(new_starts, new_ends, budget, left)
