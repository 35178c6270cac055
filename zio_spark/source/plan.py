"""Offset and partition planning of the readers: pure functions, no I/O.

Offsets are ``{"<producer id>": next_seq}``: every record of that producer with
``seq < next_seq`` is covered. A producer's *base* is where its next batch starts: the
batch start Spark gave for it, else the spool's committed offset (sequence numbers
start at 1). The stream reader (:mod:`zio_spark.spark.source`) asks here:

- which end offsets to plan (:func:`latest_end`): never below the start Spark gave nor
  below the base, within a ``maxRecordsPerTrigger`` budget shared fairly by the
  producers (:func:`fair_rows`, the same split in both read modes);
- whether records waiting make a batch of their own during an availableNow run before
  the producers are done (:func:`is_step`);
- how a batch's ranges are cut into Spark partitions (:func:`partition_ranges`,
  :func:`pieces`, :func:`pack`, :func:`cut`).

The batch reader's ``maxRecords`` goes to the plain givers first (they cannot send
again what a read drops): :func:`take_acked` gives the ack-capable producers what the
plain givers leave of it (they keep what is not acked), :func:`extend_plain` the plain
givers all they gave until their flows ended (see ``runtime.batch_receive``).

Whether an availableNow run has all the producers held when it started is decided by
:class:`Completeness` from a :class:`RunView` (one look at the receiver and the spool,
taken by the runner): a :class:`Verdict` of what is still awaited and what the run goes
on without; the reader raises or logs those.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "STEP",
    "Completeness",
    "FlowView",
    "PlainTake",
    "Range",
    "RunView",
    "Verdict",
    "base",
    "extend_plain",
    "fair_rows",
    "is_step",
    "latest_end",
    "pack",
    "partition_ranges",
    "pieces",
    "sorted_offsets",
    "take_acked",
    "wanted_ends",
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
    many records from the bases, shared fairly by the producers with records waiting
    (:func:`fair_rows`: a busy producer never fills the batch while another waits).
    A pure function of its arguments: the same start, ends and budget give the same
    split (a batch Spark replays after a restart comes from its offsets log, ends
    included, and is never planned again). Keys are sorted.
    """
    bases, out = wanted_ends(start, ends, committed)
    if max_rows is not None:
        out = fair_rows(bases, out, max_rows)
    return sorted_offsets(out)


def wanted_ends(
    start: Mapping[str, int], ends: Mapping[str, int], committed: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """:func:`latest_end` before ``maxRecordsPerTrigger``: each producer's base (where
    its next batch starts) and the end it could reach, for a caller that shares one
    budget with other ranges (the direct mode's givers read through the spool)."""
    out = {p: max(int(v), ends.get(p, 0)) for p, v in start.items()}
    for p, e in ends.items():
        out[p] = max(out.get(p, 0), e, base(p, start, committed))
    return {p: base(p, start, committed) for p in out}, out


def fair_rows(starts: Mapping[str, int], ends: Mapping[str, int], budget: int) -> dict[str, int]:
    """``ends`` cut to at most ``budget`` records in all, shared fairly: every producer
    with records waiting gets an equal share, and what one does not need (fewer
    records waiting than its share) goes to the others (max-min fairness). A share that
    does not divide evenly gives the odd records one each, in producer id order.

    Unlike producer id order (which a busy first producer can fill trigger after
    trigger) no producer waits behind another: the ``maxRecordsPerTrigger`` budget of
    both read modes (the spool mode's :func:`latest_end`, the direct mode's one budget
    over its direct producers and the givers it reads through the spool) and a batch
    read's ``maxRecords`` (:func:`take_acked`, :func:`extend_plain`).
    Deterministic: no clock, no mapping order (producers are taken sorted).
    ``starts`` must hold every producer of ``ends``; a range already empty keeps
    nothing and its end is set to its start.
    """
    want = {p: max(0, ends[p] - starts[p]) for p in ends}
    give = dict.fromkeys(ends, 0)
    left = max(0, budget)
    hungry = sorted(p for p, n in want.items() if n > 0)
    while hungry and left > 0:
        share = left // len(hungry)
        if share == 0:
            for p in hungry[:left]:
                give[p] += 1
            break
        still = []
        for p in hungry:
            take = min(share, want[p] - give[p])
            give[p] += take
            left -= take
            if give[p] < want[p]:
                still.append(p)
        hungry = still
    return {p: starts[p] + give[p] for p in ends}


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


def pack(
    ranges: Mapping[str, tuple[int, int]], step: int, waves_of: int = 1
) -> list[tuple[Range, ...]]:
    """The ranges of one batch as the ranges of its Spark partitions.

    A producer's range is cut into near-equal pieces of at most ``step`` records
    (:func:`pieces`), so one producer's batch uses several cores; pieces of several
    producers then share a partition up to ``step`` records, in producer id order, so
    many small producers do not cost a task each (8 plain clients: ~60 ms of worker CPU
    per task and batch, 18 us per record, was the largest cost of a bound source).

    ``waves_of`` > 1 (``minPartitions``): the batch is instead cut into a multiple of
    ``waves_of`` partitions of near-equal size (:func:`cut`), at least as many as the
    cut above makes, so the batch's tasks fill whole waves of that many task slots. A
    batch of 1.18M records with ``step`` 500k was three tasks on two cores: a second
    wave of one task with the other core idle (bench/README.md, "Batch sizes and waves").
    """
    if waves_of > 1:
        n = len(_greedy(ranges, step))
        n = min(
            -(-max(n, 1) // waves_of) * waves_of, sum(max(0, e - s) for s, e in ranges.values())
        )
        return cut(ranges, n)
    return _greedy(ranges, step)


def _greedy(ranges: Mapping[str, tuple[int, int]], step: int) -> list[tuple[Range, ...]]:
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


def cut(ranges: Mapping[str, tuple[int, int]], n: int) -> list[tuple[Range, ...]]:
    """The producers' ranges, laid end to end in producer id order, cut into ``n``
    partitions whose sizes differ by at most one record (``n`` at most the records).

    A producer's range may end one partition and start the next: it is then read as two
    ranges (two range flows in direct mode), each contiguous."""
    order = [(p, *ranges[p]) for p in sorted(ranges) if ranges[p][1] > ranges[p][0]]
    total = sum(e - s for _, s, e in order)
    if total == 0 or n <= 0:
        return []
    if n > total:
        raise ValueError(f"cut: {n} partitions of {total} records would leave some empty")
    bounds = [total * i // n for i in range(n + 1)]
    out: list[tuple[Range, ...]] = []
    k, before = 0, 0  # the producer in hand, and the records of the producers before it
    for lo, hi in itertools.pairwise(bounds):
        group: list[Range] = []
        while lo < hi:
            p, s, e = order[k]
            a, b = s + lo - before, min(e, s + hi - before)
            group.append((p, a, b))
            lo += b - a
            if b == e:
                k, before = k + 1, before + (e - s)
        out.append(tuple(group))
    return out


def take_acked(
    starts: Mapping[str, int],
    ends: Mapping[str, int],
    plain: Mapping[str, int],
    budget: int,
) -> dict[str, int]:
    """A batch read's ``maxRecords`` (``budget``) over its ack-capable producers: the
    ends of the producers of ``ends`` not in ``plain``, cut to what the plain givers
    leave of the budget and shared fairly (:func:`fair_rows`).

    ``plain``: per plain giver, the most records it may bring to this read (what it
    gave so far and the credit it still holds). The plain givers come first: a record
    a read drops is lost for a plain giver (it has no acks, it does not keep it), while
    an ack-capable producer keeps what is not acked and gives it to the next read. The
    rest is shared fairly, not in producer id order: batch reads are often repeated
    (``maxRecords`` then the rest), and in id order a busy first producer would fill
    every read while a later one's records wait, its window full.
    ``starts`` must hold every producer of ``ends``.
    """
    left = max(0, budget - sum(max(0, n) for n in plain.values()))
    acked = {p: e for p, e in ends.items() if p not in plain}
    return fair_rows(starts, acked, left)


@dataclass(frozen=True)
class PlainTake:
    """A batch read's plain givers after their flows ended (:func:`extend_plain`)."""

    starts: dict[str, int]
    ends: dict[str, int]
    budget: int | None
    # Per plain giver: the records stored beyond what ``maxRecords`` let in (not
    # taken), ``(start, end)``: seq ``start <= seq < end``.
    left: dict[str, tuple[int, int]]


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
    ``maxRecords`` leaves them; None: no limit), shared fairly (:func:`fair_rows`): when
    the plain givers alone gave more than the budget, each loses only its last records.

    A producer new in ``sealed`` starts at its committed offset (at least 1). Producers
    not in ``plain`` keep their ends.
    """
    plain = set(plain)
    new_starts, new_ends = dict(starts), dict(ends)
    have: dict[str, int] = {}
    gave: dict[str, int] = {}
    for p in sorted(sealed):
        if p not in plain:
            continue
        start = new_starts.setdefault(p, max(committed.get(p, 1), 1))
        have[p] = new_ends.get(p, start)
        gave[p] = max(have[p], sealed[p])
    took = gave if budget is None else fair_rows(have, gave, budget)
    left: dict[str, tuple[int, int]] = {}
    for p, end in took.items():
        new_ends[p] = end
        if gave[p] > end:
            left[p] = (end, gave[p])
    if budget is not None:
        budget -= sum(took[p] - have[p] for p in took)
    return PlainTake(new_starts, new_ends, budget, left)


# -- availableNow: which producers are done ----------------------------------------------


class FlowView(Protocol):
    """What completeness reads of one flow endpoint (the receiver's ``PeerStatus``)."""

    @property
    def endpoint(self) -> str: ...
    @property
    def producer(self) -> str | None: ...
    @property
    def state(self) -> str: ...  # connecting | receiving | ended | failed | waiting
    @property
    def ack_capable(self) -> bool: ...
    @property
    def encoding(self) -> str: ...
    @property
    def records(self) -> int: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def idle(self) -> bool: ...
    @property
    def position(self) -> int | None: ...
    @property
    def flows(self) -> int: ...
    @property
    def last_data(self) -> float: ...


@dataclass(frozen=True)
class RunView:
    """One look at the receiver and the spool, taken by the runner (the receiver's
    clock throughout)."""

    now: float
    started_at: float  # when the receiver started
    looked_at: float  # when its loop last looked at its sockets
    status: Sequence[FlowView]
    positions: Mapping[str, int]  # per producer: the position it stated
    stored: Mapping[str, int]  # per stating producer: the last seq in the spool
    named: frozenset[str] = frozenset()  # the endpoints we connect to (not bound ports')
    bound: tuple[str, ...] = ()  # our bound endpoints
    held_back: frozenset[str] = frozenset()  # producers maxBacklog holds back now
    withheld_ms: Mapping[str, int] = field(default_factory=dict)  # credit withheld so far
    # Why an endpoint has no flow (what its socket saw), asked only when it matters.
    why_no_flow: Callable[[str], str | None] = lambda endpoint: None


@dataclass
class Verdict:
    """What completeness found: what the run still waits for, and what it goes on
    without, as ``(key, text)`` (the caller raises or logs each key once)."""

    awaited: list[str] = field(default_factory=list)
    # Strict: the run is incomplete (an error with failOnDataLoss, else logged).
    problems: list[tuple[str, str]] = field(default_factory=list)
    # The first batch goes on without these (a WARN).
    warnings: list[tuple[str, str]] = field(default_factory=list)
    # Information: a plain giver taken as done (its endpoint, quiet s, records).
    done_quiet: list[tuple[str, float, int]] = field(default_factory=list)


class Completeness:
    """Whether the producers gave what they held when an availableNow run started,
    decided by protocol state (:meth:`check`); keeps since when each flow is down,
    quiet or first seen, across the checks of one run."""

    def __init__(self, connect_timeout: float, plain_giver_quiet: float) -> None:
        self.connect_timeout = connect_timeout
        self.plain_giver_quiet = plain_giver_quiet
        self.down: dict[str, float] = {}
        self.first_seen: dict[str, float] = {}
        self._held_at: dict[str, float] = {}
        self._withheld_ms: dict[str, int] = {}

    def _held(self, view: RunView) -> dict[str, float]:
        """Per producer: when it last held no credit from us (maxBacklog withheld it).
        A giver cannot give without credit: its quiet counts only from then on."""
        for p, ms in view.withheld_ms.items():
            if p in view.held_back or ms != self._withheld_ms.get(p, 0):
                self._withheld_ms[p] = ms
                self._held_at[p] = view.now
        return self._held_at

    def check(
        self,
        view: RunView,
        *,
        plain: bool,
        strict: bool,
        reach: float | None = None,
        warn: bool = False,
        cap: float | None = None,
    ) -> Verdict:
        """What the producers still owe the run (``awaited`` empty: every one gave what
        it held when the run started):

        - an endpoint with no flow yet is awaited for ``reach`` s (default
          ``connectTimeout``) from the start; then (``strict``) it is a problem naming it
          and what the socket saw;
        - a producer that stated its position is awaited until the spool holds every
          record up to it or it said ``more: false`` with all it sent stored; an EOT
          short of that or a flow down is awaited for ``connectTimeout``, then it is a
          problem (``strict``) or a warning;
        - (``plain``) a plain giver (it states nothing) is awaited until it ends (EOT),
          or brings nothing for ``plainGiverQuiet`` while it holds credit from us (the
          quiet clock starts again when maxBacklog stops withholding its credit); quiet
          with nothing received at all is a problem;
        - (``plain``) a zio-spark giver that states no position is awaited until
          ``more: false`` or EOT; quiet for ``connectTimeout`` is a problem. One whose
          flow failed, and that named itself (a producer id), is awaited for
          ``connectTimeout`` to come back, then it is a problem;
        - ``cap``: a flow stating no position that is still giving ``cap`` s after it
          was first seen is no longer awaited (a warning: Spark 4.0/4.1's one batch).

        Problems are reported with ``strict``; with ``warn`` (not ``strict``) they are
        warnings; otherwise they are not reported (the endpoint is just not awaited).
        """
        out = Verdict()
        now, status = view.now, view.status
        age = now - view.started_at
        reach = self.connect_timeout if reach is None else reach

        def short(key: str, text: str) -> None:
            if strict:
                out.problems.append((key, text))
            elif warn:
                out.warnings.append((key, text))

        for st in status:
            if st.flows or st.state in ("receiving", "ended"):
                continue
            if st.state == "failed" or age > reach:
                why = view.why_no_flow(st.endpoint) or st.last_error or "no BOT answered ours"
                short(
                    st.endpoint,
                    f"zio source: producer {st.endpoint} was not reachable during this "
                    f"availableNow run ({why}); its records are not in this run. Start "
                    "it (or fix the endpoint), or set failOnDataLoss=false to end the "
                    "run without it",
                )
                continue
            out.awaited.append(f"{st.endpoint}: no flow yet")
        if not status:
            if age <= reach:
                out.awaited.append("no producer yet")
            else:
                where = ", ".join(view.bound) or "the group"
                short(
                    "(none)",
                    f"zio source: no producer reached this availableNow run within "
                    f"connectTimeout {self.connect_timeout:g} s (listening on {where}); "
                    "start the producers first, or raise connectTimeout",
                )
        self._stated(view, strict, out)
        if not plain:
            return out
        self._unstated(view, cap, short, out)
        self._dropped_clients(view, short, out)
        return out

    def _stated(self, view: RunView, strict: bool, out: Verdict) -> None:
        """Producers that stated their position: done by their own statements only (an
        EOT short of the position, a closed or restarting producer, is a flow down)."""
        now = view.now
        for producer, pos in sorted(view.positions.items()):
            stored = view.stored.get(producer, 0)
            mine = [st for st in view.status if st.producer == producer]
            if stored >= pos or any(st.idle for st in mine):
                self.down.pop(producer, None)
                continue
            if any(st.state == "receiving" for st in mine):
                self.down.pop(producer, None)
                out.awaited.append(f"{producer}: {stored} of its {pos} stored")
                continue
            since = self.down.setdefault(producer, now)
            if now - since > self.connect_timeout:
                errors = "; ".join(st.last_error or st.state for st in mine) or "no flow"
                where = ", ".join(sorted({st.endpoint for st in mine})) or "no endpoint"
                text = (
                    f"zio source: producer {producer} ({where}) stated it held records up "
                    f"to {pos} when the run started; the spool holds up to {stored}, and "
                    f"its flow has been down (or ended short) for {now - since:.0f} s "
                    f"({errors}). Restart the producer, or set failOnDataLoss=false to "
                    "end the run without them"
                )
                # The first batch: not awaited any longer, never silently.
                (out.problems if strict else out.warnings).append((producer, text))
                continue
            out.awaited.append(f"{producer}: {stored} of its {pos} stored, flow down")

    def _unstated(
        self,
        view: RunView,
        cap: float | None,
        short: Callable[[str, str], None],
        out: Verdict,
    ) -> None:
        """Flows that state no position: plain givers and zio-spark giver clients."""
        now = view.now
        held_at = self._held(view)
        for st in view.status:
            if st.state != "receiving" or st.position is not None or st.idle:
                continue
            # Quiet counts only while it holds credit from us: a giver held back by
            # maxBacklog (while Spark runs a step batch) cannot give.
            since = max(st.last_data, held_at.get(st.producer or st.endpoint, st.last_data))
            quiet = max(view.looked_at - since, 0.0)
            ours = st.ack_capable or st.encoding == "arrow"
            kind = "zio-spark giver" if ours else "plain giver"
            if cap is not None:
                first = self.first_seen.setdefault(st.endpoint, now)
                if now - first > cap:
                    out.warnings.append(
                        (
                            st.endpoint,
                            f"zio source: {kind} {st.endpoint} was still giving {cap:g} s "
                            f"(connectTimeout) after its flow started, {st.records} records "
                            "so far; the first batch takes what is stored. On Spark 4.0/4.1 "
                            "an availableNow run is this one batch: its later records are "
                            "not in it",
                        )
                    )
                    continue
            if ours:
                # It ends by its own statement (more: false) or EOT, never by quiet.
                if quiet < self.connect_timeout:
                    out.awaited.append(f"{st.endpoint}: {kind}, until more:false or EOT")
                    continue
                short(
                    st.endpoint,
                    f"zio source: {kind} {st.endpoint} (producer {st.producer}) brought "
                    f"nothing for {quiet:.0f} s (connectTimeout {self.connect_timeout:g} "
                    f"s) after {st.records} records while holding credit, and neither "
                    "said it had no more (more: false) nor ended its flow (EOT). Check "
                    "the producer, or set failOnDataLoss=false to end the run without it",
                )
                continue
            if quiet < self.plain_giver_quiet:
                out.awaited.append(f"{st.endpoint}: plain giver, quiet {quiet:.1f} s")
                continue
            if st.records == 0:
                short(
                    st.endpoint,
                    f"zio source: plain giver {st.endpoint} answered our BOT but gave "
                    f"nothing within plainGiverQuiet {self.plain_giver_quiet:g} s; a "
                    "plain giver cannot state what it holds, so this run would end "
                    "with none of its records. Raise plainGiverQuiet if it is slow to "
                    "start, or set failOnDataLoss=false to accept an empty run",
                )
                continue
            out.done_quiet.append((st.endpoint, quiet, st.records))

    def _dropped_clients(
        self, view: RunView, short: Callable[[str, str], None], out: Verdict
    ) -> None:
        """Bind mode: a giver client that named itself (a producer id) and whose latest
        flow failed is awaited for ``connectTimeout`` to come back (it reconnects), then
        ``short`` says so. A plain client (``origin:<n>``) cannot resume: not awaited."""
        now = view.now
        live = {st.producer for st in view.status if st.state == "receiving"}
        latest: dict[str, FlowView] = {}
        for st in view.status:  # live flows first, then the ended ones in the order they ended
            p = st.producer
            if st.endpoint in view.named or p is None or p.startswith("origin:"):
                continue
            if p in view.positions:
                continue
            if st.state != "receiving":
                latest[p] = st
        for producer, st in sorted(latest.items()):
            key = f"client:{producer}"
            if producer in live or st.state != "failed" or st.idle:
                self.down.pop(key, None)
                continue
            since = self.down.setdefault(key, now)
            if now - since > self.connect_timeout:
                short(
                    key,
                    f"zio source: giver client {st.endpoint} (producer {producer}) "
                    f"dropped its flow ({st.last_error}) and did not come back within "
                    f"connectTimeout {self.connect_timeout:g} s; records it still "
                    "held are not in this run. Restart it, or set failOnDataLoss=false "
                    "to end the run without it",
                )
                continue
            out.awaited.append(f"{producer}: giver client's flow dropped, awaiting it")
