"""The direct read mode's driver side (``readMode=direct``, docs/direct-read.md): offsets
from the producers' held windows, ranges to plan, commit acks. No pyspark here.

Offsets are ``{"<producer id>": {"end": e, "incarnation": i}}`` (keys sorted at both
levels: Spark compares offsets as JSON text): every record of that producer numbered
below ``e`` *in incarnation* ``i`` is covered. Sequence numbers are the spool path's
(from 1), but they name records only within one incarnation, so an end is always
stored with it.

Planning rules (pure, :func:`latest`, :func:`batch_ranges`):

- a producer seen for the first time (the first offsets, or a producer that joined):
  its offset is ``{first, incarnation}`` of its held window, so the batch reads nothing
  of it and the next one reads from its oldest held record;
- same incarnation as the batch start: the end is the held end (never below the start),
  cut to ``maxRecordsPerTrigger``; when the producer's window held its sends back
  (``full`` in its held answer), cut to half of what it holds (:func:`settled_end`);
  records below the held ``first`` that the batch
  start had not covered are lost (:class:`Loss`): that batch ends at ``first`` (its
  tasks are refused the range: a ``DataLossError``, or skipped with
  ``failOnDataLoss=false``) and the next one reads the held records;
- another incarnation (the producer restarted without its records): the offset jumps to
  the new incarnation's ``first`` (a batch reading nothing of it), and what the old one
  held beyond the start is lost (known if an earlier held answer showed more);
- a producer not answering this trigger keeps its start offset.

A batch reads ``[start.end, end.end)`` of every producer whose incarnation is the same in
both offsets; a producer whose incarnation changed reads nothing in that batch.

A Spark that calls ``latestOffset()`` without the batch start (before 4.2) gets the same
planning: the runner knows the start from Spark's other calls (:class:`ImpliedStart`).

:class:`Controls` keeps the control flows (one :class:`ControlConnection` per endpoint,
opened at the first need, reopened after a failure) for ``held`` queries and commit acks,
each on a thread of its own, so that an endpoint that is down never holds the others up.
Its endpoints are the ``endpoints`` option's, or what a ZRE ``group`` advertises.
With CURVE it also holds the run's key pair: drawn when the run's controls are made,
registered on every control flow it opens (``admit``: a producer with an allow-list
admits it while that flow lives) and handed to the tasks instead of the source's own
keys (:meth:`Controls.task_curve`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import Curve, ZreOptions
from zio_spark.source import plan
from zio_spark.source.range_client import (
    AckRefused,
    ControlConnection,
    HeldWindow,
    RangesNotServed,
)

if TYPE_CHECKING:  # imported where a group is used: ZRE costs ~0.1-0.3 s to import
    from zio_spark.transport.discovery import GroupWatcher

__all__ = [
    "Controls",
    "DirectRange",
    "ImpliedStart",
    "Loss",
    "Position",
    "batch_ranges",
    "check_disjoint",
    "initial",
    "latest",
    "latest_with_spool",
    "owed",
    "pack",
    "settled_end",
    "split_offsets",
    "stale_plan",
    "to_json",
]

log = logging.getLogger("zio_spark.source")


@dataclass(frozen=True)
class Position:
    """A producer's offset: records below ``end`` of ``incarnation`` are covered."""

    incarnation: str
    end: int


Offsets = dict[str, Position]

DirectRange = tuple[str, str, int, int]
"""``(producer, incarnation, start, end)``: records ``start <= seq < end`` of one
producer, numbered in that incarnation."""


@dataclass(frozen=True)
class Loss:
    """Records of ``producer`` known gone before a batch read them: ``[start, end)`` of
    ``incarnation`` (``end`` None: not known to be any: the producer restarted without
    its records and no held answer of this runner showed records beyond ``start``)."""

    producer: str
    incarnation: str
    start: int
    end: int | None
    why: str

    def text(self) -> str:
        span = f"[{self.start}, {self.end})" if self.end is not None else f"from {self.start} on"
        return (
            f"zio source (readMode=direct): records {span} of producer {self.producer!r} "
            f"(incarnation {self.incarnation!r}) are lost: {self.why}"
        )


def to_json(offsets: Mapping[str, Position]) -> dict[str, dict[str, Any]]:
    """Offsets as Spark stores them: sorted producer ids, ``end`` before
    ``incarnation``."""
    return {
        p: {"end": pos.end, "incarnation": pos.incarnation} for p, pos in sorted(offsets.items())
    }


def split_offsets(raw: Mapping[str, Any] | None) -> tuple[Offsets, dict[str, int]]:
    """Offsets from Spark (JSON decoded): the direct producers' positions, and the
    spool path's ``next_seq`` of the givers read through the spool (a bare number).

    Raises
    ------
    ConfigError
        If an offset is neither (a checkpoint of something else).
    """
    out: Offsets = {}
    spool: dict[str, int] = {}
    for p, v in dict(raw or {}).items():
        if isinstance(v, int) and not isinstance(v, bool):
            spool[str(p)] = v
            continue
        if (
            not isinstance(v, Mapping)
            or not isinstance(v.get("incarnation"), str)
            or isinstance(v.get("end"), bool)
            or not isinstance(v.get("end"), int)
        ):
            raise ConfigError(
                "readMode",
                "direct",
                f"a checkpoint of a zio query: its offset of producer {p!r} is {v!r}, "
                "neither {end, incarnation} (read directly) nor a number (read through "
                "the spool). Use a new checkpointLocation",
            )
        out[str(p)] = Position(v["incarnation"], int(v["end"]))
    return out, spool


def check_disjoint(held: Mapping[str, HeldWindow], spool: Mapping[str, int]) -> None:
    """A producer read through the spool so far (a spool-mode checkpoint, or a giver
    that stated no capability before) cannot go on directly: its spool numbers and its
    held window do not line up.

    Raises
    ------
    ConfigError
        Naming the producers.
    """
    both = sorted(set(held) & set(spool))
    if both:
        raise ConfigError(
            "readMode",
            "direct",
            f"a checkpoint whose producers {both} were read through the spool "
            "(readMode=spool, or before they stated the range capability); they serve "
            "range reads now. Go on with readMode=spool, or start from a new "
            "checkpointLocation",
        )


def initial(held: Mapping[str, HeldWindow]) -> Offsets:
    """The first offsets: each producer at its oldest held record."""
    return {p: Position(w.incarnation, w.first) for p, w in held.items()}


def latest(
    start: Mapping[str, Position],
    held: Mapping[str, HeldWindow],
    *,
    target: Mapping[str, Position] | None = None,
    max_rows: int | None = None,
    seen: Mapping[str, HeldWindow] | None = None,
    settle: bool = True,
) -> tuple[Offsets, list[Loss]]:
    """The end offsets of the next batch and the losses found (module docstring).

    ``target``: an availableNow run's ends (no further than them in their incarnation).
    ``seen``: the last held window each producer answered before (to tell what an
    incarnation that is gone held beyond ``start``). ``max_rows``
    (``maxRecordsPerTrigger``): shared fairly by the producers (:func:`plan.fair_rows`).
    ``settle``: cut a producer whose held answer says ``full`` (:func:`settled_end`);
    False for a runner's first plan (it may be a run's only batch).
    """
    end, _, losses = latest_with_spool(
        start, held, {}, {}, target=target, max_rows=max_rows, seen=seen, settle=settle
    )
    return end, losses


def latest_with_spool(
    start: Mapping[str, Position],
    held: Mapping[str, HeldWindow],
    spool_bases: Mapping[str, int],
    spool_ends: Mapping[str, int],
    *,
    target: Mapping[str, Position] | None = None,
    max_rows: int | None = None,
    seen: Mapping[str, HeldWindow] | None = None,
    settle: bool = True,
) -> tuple[Offsets, dict[str, int], list[Loss]]:
    """:func:`latest` for a batch that also reads givers through the spool:
    ``spool_bases``/``spool_ends`` are their ranges before the budget
    (:func:`plan.wanted_ends`). ``max_rows`` is then one budget for the whole batch,
    shared fairly by every producer whichever path reads it, so a batch holds at most
    ``max_rows`` records (not that many per path). Returns the direct offsets, the
    spool ends (cut) and the losses."""
    out: Offsets = dict(start)
    losses: list[Loss] = []
    ends: dict[str, int] = {}
    bases: dict[str, int] = {}
    for p, w in sorted(held.items()):
        was = start.get(p)
        if was is None:
            out[p] = Position(w.incarnation, w.first)
            continue
        if was.incarnation != w.incarnation:
            old = (seen or {}).get(p)
            lost_end = old.end if old is not None and old.incarnation == was.incarnation else None
            if lost_end is None or lost_end > was.end:
                losses.append(
                    Loss(
                        p,
                        was.incarnation,
                        was.end,
                        lost_end,
                        f"the producer now numbers its records as incarnation "
                        f"{w.incarnation!r} (holding [{w.first}, {w.end})): it restarted "
                        "without them"
                        + ("" if lost_end is not None else " (if it held any beyond that)"),
                    )
                )
            out[p] = Position(w.incarnation, w.first)
            continue
        if w.first > was.end:
            losses.append(
                Loss(
                    p,
                    was.incarnation,
                    was.end,
                    w.first,
                    f"the producer no longer holds them (its window is [{w.first}, {w.end}))",
                )
            )
            # This batch ends at the window: its tasks are refused the lost range
            # (skipped with failOnDataLoss=false), the next one reads what is held.
            bases[p] = was.end
            ends[p] = w.first
            continue
        goal = w.end
        if target is not None:
            t = target.get(p)
            goal = t.end if t is not None and t.incarnation == w.incarnation else was.end
        elif w.full and settle:
            goal = settled_end(was.end, w)
        bases[p] = was.end
        ends[p] = max(was.end, goal)
    spooled = dict(spool_ends)
    if max_rows is not None:
        # Producer ids are one namespace across both paths (check_disjoint).
        both = plan.fair_rows({**spool_bases, **bases}, {**spool_ends, **ends}, max_rows)
        ends = {p: both[p] for p in ends}
        spooled = {p: both[p] for p in spool_ends}
    for p, e in ends.items():
        out[p] = Position(start[p].incarnation, e)
    return dict(sorted(out.items())), plan.sorted_offsets(spooled), losses


def settled_end(start: int, w: HeldWindow) -> int:
    """The end of a batch from ``start`` of a producer whose window held its sends back
    (``w.full``): at most half of what it holds, ``[w.first, w.end)``.

    Such a producer is faster than the query, and its window sets the batch sizes: the
    previous batch (``[w.first, start)``, acked only once this one is planned) and the
    records made while it ran fill the window together, so a batch of ``a`` records is
    followed by one of ``window - a``. Unchecked, the sizes alternate for as long as the
    query runs, as far apart as the first batch set them (1.75M and 250k records with a
    2M window, measured), and the small batches pay a trigger's fixed cost for few
    records. Cut to half of what is held, the larger of the two is split and the rest
    waits one trigger: the sizes settle at half the window within two batches. A
    producer that never waits keeps the whole held end (no record waits a trigger
    longer than it must); an availableNow run reads to its target, never cut, and a
    runner's first plan is not cut either (``settle``: a run of one batch, as
    Trigger.Once or availableNow before Spark 4.2, reads all that is held)."""
    half = -(-(w.end - min(w.first, start)) // 2)
    return max(start, min(w.end, start + half))


def owed(
    start: Mapping[str, Position],
    target: Mapping[str, Position],
    held: Mapping[str, HeldWindow],
) -> list[str]:
    """An availableNow run: the producers that still owe it records (their offset is
    below the run's target in the same incarnation) but did not answer this trigger.
    Their offsets stay, so without this the run would end short of them, silently."""
    out = []
    for p, t in sorted(target.items()):
        s = start.get(p)
        if p in held or s is None or s.incarnation != t.incarnation or s.end >= t.end:
            continue
        out.append(p)
    return out


def stale_plan(
    start: Mapping[str, Position],
    end: Mapping[str, Position],
    seen: Mapping[str, HeldWindow],
) -> list[str]:
    """Producers whose part of a planned batch is gone: ``end`` is of an incarnation
    the producer no longer states while ``start`` is of the one it states now.

    :func:`latest` never plans that (an incarnation switch ends a batch *in* the new
    incarnation). It comes from Spark re-planning an uncommitted first batch after a
    restart: ``start`` is then ``initialOffset()`` asked again, answered from the window
    now, while ``end`` is the plan of the run before; if the producer restarted without
    its records in between, the batch would read nothing of it, silently.
    """
    out = []
    for p, e in sorted(end.items()):
        s, w = start.get(p), seen.get(p)
        if s is None or w is None or s.incarnation == e.incarnation:
            continue
        if s.incarnation == w.incarnation and e.incarnation != w.incarnation:
            out.append(p)
    return out


def batch_ranges(
    start: Mapping[str, Position], end: Mapping[str, Position]
) -> dict[str, tuple[str, int, int]]:
    """Per producer read in a batch: ``(incarnation, start, end)``, non-empty ranges of
    producers whose incarnation is the same at both ends only."""
    out: dict[str, tuple[str, int, int]] = {}
    for p, e in sorted(end.items()):
        s = start.get(p)
        if s is None or s.incarnation != e.incarnation or e.end <= s.end:
            continue
        out[p] = (e.incarnation, s.end, e.end)
    return out


def pack(
    ranges: Mapping[str, tuple[str, int, int]], step: int, waves_of: int = 1
) -> list[tuple[DirectRange, ...]]:
    """The ranges of one batch as the ranges of its Spark partitions, cut and grouped
    as the spool path's (:func:`~zio_spark.source.plan.pack`)."""
    groups = plan.pack({p: (s, e) for p, (_, s, e) in ranges.items()}, step, waves_of)
    return [tuple((p, ranges[p][0], s, e) for p, s, e in group) for group in groups]


@dataclass
class ImpliedStart:
    """The batch start of ``latestOffset`` on a Spark that does not pass it (before 4.2:
    ``latestOffset()`` with no arguments), known from Spark's other calls to the runner.

    Everything the direct mode does with ``start`` (ack what Spark committed, plan from
    it, tell records lost or of another incarnation from records not read yet) needs the
    exact start: a start too high skips records, one too low reads them twice. What such
    a Spark does (4.0.5 and 4.1.4, a probe source logging every call; the same on both):

    - it runs a batch to exactly the offsets ``latestOffset()`` answered, and asks again
      only once that batch is in its commit log (or when it ran none: the answer was its
      committed offsets);
    - it plans every batch with ``partitions(start, end)``, a batch it re-runs after a
      failure too (no ``latestOffset()`` before it);
    - a restarted query's first call is ``partitions(e, e)``, ``e`` the end of the last
      batch in its offset log, then ``partitions(s, e)`` if that batch is not in its
      commit log, and only then ``latestOffset()``;
    - a new checkpoint's first call is ``latestOffset()``, then ``initialOffset()``, then
      ``partitions(initial, end)``.

    So the last end Spark was answered or planned with is the next batch's start, and it
    is in Spark's commit log when ``latestOffset()`` is asked: :meth:`start` is what 4.2+
    would pass. None means this runner saw no such call: a new checkpoint (its first
    batch starts at the initial offsets, which the first ``latestOffset()`` then plans
    from, :attr:`initial`, and ``initialOffset()`` answers).

    Offsets are kept as Spark's JSON (plain dicts): the direct positions and the spool
    numbers of givers read through the spool alike.
    """

    last: dict[str, Any] | None = None
    # The initial offsets a start-less first latestOffset() planned from, for the
    # initialOffset() that follows it (until the first partitions()).
    initial: dict[str, Any] | None = None

    def start(self) -> dict[str, Any] | None:
        """The start of the batch ``latestOffset()`` is asked for (None: not known)."""
        return None if self.last is None else dict(self.last)

    def answered(self, end: Mapping[str, Any]) -> None:
        """``latestOffset()`` answered ``end``: the start of the next question."""
        self.last = dict(end)

    def planned(self, start: Mapping[str, Any], end: Mapping[str, Any]) -> None:
        """Spark called ``partitions(start, end)`` (``start == end``: a restarted query's
        look at its offset log, or a batch with no new records)."""
        self.last = dict(end)
        self.initial = None


T = TypeVar("T")

KEEP_INTERVAL = 1.0
"""Seconds between two looks of the keeper (:class:`Controls`, CURVE runs) at each idle
control flow."""


class _Lane:
    """One endpoint's control flow and the one thread that uses its socket (a zmq socket
    is used by one thread at a time): held queries, acks and the final EOT run there, in
    the order they were asked. A daemon thread (a lane is made at its endpoint's first
    job): one stuck on an endpoint that is down never keeps the runner from exiting."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((job, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            if not fut.set_running_or_notify_cancel():  # pragma: no cover - never cancelled
                continue
            try:
                fut.set_result(job())
            except BaseException as e:  # handed to whoever waits for the answer
                fut.set_exception(e)

    def stop(self) -> None:
        self._jobs.put(None)


@dataclass(frozen=True)
class _Answer:
    """What one endpoint's held query came to: a window (``producer``, ``window``), a
    plain giver (``plain``), or no answer (``error``)."""

    producer: str | None = None
    window: HeldWindow | None = None
    plain: bool = False
    error: str | None = None


class Controls:
    """The driver's control flows, one per endpoint: held queries and commit acks.

    Opened at the first :meth:`held` (never in a constructor Spark pickles), each
    reopened once after a failure. Every endpoint has its own thread (:class:`_Lane`),
    so a trigger waits for all endpoints at once, not one after the other. An endpoint
    that gave no answer (twice ``timeout``) is *down*: it is asked again in the
    background at each trigger and the triggers do not wait for it (its offset stays;
    its answer is used at the first trigger after it came), so a producer that is down
    costs the query one slow trigger, not every trigger. An endpoint whose giver does
    not state the range capability is put in :attr:`plain` (never asked again): the
    stream reader reads it through the spool. Acks are sent on the lanes without
    waiting (cumulative: only the latest position per producer is sent).

    With ``zre`` (the ``group`` option) the endpoints are those a ZRE group advertises
    (:meth:`_discover`): one that joins is asked from the next trigger, one that leaves
    is down (its offset stays; nothing waits for it), a plain one found there goes to
    :attr:`plain` as a listed one does.

    With ``curve`` (the source's CURVE client keys: the driver's, on the producers'
    allow-lists), a fresh key pair is drawn here, once per query run
    (:attr:`run_curve`); each control flow registers its public key as soon as it is
    open, and the tasks read with it (:meth:`task_curve`), so the source's secret key
    never leaves the driver, and a run's key stops working where its control flow ends.
    A producer with an allow-list that restarts in the middle of a batch has no lease
    for it any more, and that batch's tasks would be refused until the driver's next
    hook: so a keeper thread looks at each open control flow every
    :data:`KEEP_INTERVAL` seconds (a held query on its lane, when no other job waits
    there) and reopens one that ended, which registers the run key again. A restarted
    producer answers the look at once (an EOT: no such flow here).
    """

    def __init__(
        self,
        endpoints: tuple[str, ...],
        *,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve: Curve | None = None,
        timeout: float = 30.0,
        stream: str | None = None,
        zre: ZreOptions | None = None,
        group_port: str | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.ctx = ctx
        self.mode = mode
        self.curve = curve
        self.timeout = timeout
        self.stream = stream
        self._conns: dict[str, ControlConnection] = {}  # each used on its lane only
        self._lanes: dict[str, _Lane] = {}
        self._asking: dict[str, Future[_Answer]] = {}  # endpoint -> its held query
        self.where: dict[str, str] = {}  # producer id -> endpoint
        self.seen: dict[str, HeldWindow] = {}  # producer id -> its last held answer
        # Endpoints whose giver does not state the range capability: read through the
        # spool (never asked again).
        self.plain: set[str] = set()
        # Endpoints (not plain) whose last held query got no answer -> the error.
        self.down: dict[str, str] = {}
        self._lock = threading.Lock()  # the ack bookkeeping below, shared with the lanes
        self._acked: dict[str, Position] = {}  # producer id -> the last commit acked
        self._want: dict[str, tuple[str, Position]] = {}  # producer -> (endpoint, position)
        self._acking: set[str] = set()  # endpoints with an ack job queued or running
        self.terminating = False  # SIGTERM seen, or stop() begun (see the stream reader)
        self.run_curve: Curve | None = None
        if curve is not None:
            public, secret = zmq.curve_keypair()
            self.run_curve = Curve(curve.server_key, public, secret)
        # The keeper (CURVE runs): endpoints whose control flow it looks after (open once,
        # not given up on), those with a look queued, and its thread, started at the first
        # open control flow.
        self._kept: set[str] = set()
        self._keeping: set[str] = set()
        self._keeper: threading.Thread | None = None
        self._closed = threading.Event()
        # ZRE discovery (``group``): the watcher, started at the first held(); what it
        # saw join (endpoint -> socket mode) or leave, applied by held() on the caller's
        # thread; the socket mode of each endpoint it found (others: ``mode``).
        self.zre = zre
        self.group_port = group_port
        self._watcher: GroupWatcher | None = None
        self._found: list[tuple[str, str | None]] = []
        self._left: list[str] = []
        self._modes: dict[str, str | None] = {}

    def mode_of(self, endpoint: str) -> str | None:
        """The socket mode to reach ``endpoint`` (a discovered one: from the socket type
        it advertises; None: the default)."""
        return self._modes.get(endpoint, self.mode)

    # -- discovery (the watcher's thread, then the caller's) -----------------------------

    def _joined(self, endpoint: str, mode: str) -> None:
        with self._lock:
            self._found.append((endpoint, mode))

    def _gone(self, endpoint: str) -> None:
        with self._lock:
            self._left.append(endpoint)

    def _discover(self) -> None:
        """With a ``group``: start the watcher at the first call (then listen for two
        beacon intervals, so the first trigger sees the producers already there, not
        whichever beacon came first), and apply what it saw since the last call. A
        producer that joined is asked from this trigger on; one that left is *down*
        (its offset stays; an availableNow run it owes records fails naming it) and its
        control flow is closed; a plain giver that left is no longer read through the
        spool (:attr:`plain` forgets it)."""
        if self.zre is None:
            return
        if self._watcher is None:
            from zio_spark.transport.discovery import GroupWatcher

            self._watcher = GroupWatcher(
                self.zre,
                self._joined,
                self._gone,
                requested_mode=self.mode,
                port_name=self.group_port,
            ).start()
            self._closed.wait(2 * self.zre.interval + self._watcher.poll)
        self._apply_discovery()

    def _apply_discovery(self) -> None:
        """What the watcher saw since the last call (:meth:`_discover`)."""
        if self.zre is None:
            return
        with self._lock:
            found, self._found = self._found, []
            left, self._left = self._left, []
        for endpoint, mode in found:
            if endpoint not in self.endpoints:
                self.endpoints = (*self.endpoints, endpoint)
            self._modes[endpoint] = mode
            self.down.pop(endpoint, None)
            log.info(
                "zio source (readMode=direct): %s found in ZRE group %r; asked from this "
                "trigger on",
                endpoint,
                self.zre.group,
            )
        for endpoint in left:
            if any(e == endpoint for e, _ in found):
                continue  # left and came back between two triggers
            self.endpoints = tuple(e for e in self.endpoints if e != endpoint)
            if endpoint in self.plain:
                self.plain.discard(endpoint)
            else:
                self.down[endpoint] = f"it left ZRE group {self.zre.group!r}"
            with self._lock:
                self._kept.discard(endpoint)
            self._lane(endpoint).submit(partial(self._drop, endpoint))
            log.warning(
                "zio source (readMode=direct): %s left ZRE group %r; its offsets stay until "
                "it is found again",
                endpoint,
                self.zre.group,
            )

    def _lane(self, endpoint: str) -> _Lane:
        lane = self._lanes.get(endpoint)
        if lane is None:
            lane = self._lanes[endpoint] = _Lane(f"zio-control {endpoint}")
        return lane

    # -- on the lanes ------------------------------------------------------------------

    def _open(self, endpoint: str) -> ControlConnection:
        conn = self._conns.get(endpoint)
        if conn is not None:
            return conn
        conn = ControlConnection(
            endpoint,
            ctx=self.ctx,
            mode=self.mode_of(endpoint),
            curve=self.curve,
            timeout=self.timeout,
            stream=self.stream,
        )
        if self.run_curve is not None:
            # The run key first: the tasks of a batch planned once this flow is open
            # read with it (a producer with an allow-list leases it to this flow).
            try:
                gated = conn.admit(self.run_curve.public_key)
            except BaseException:
                conn.close()
                raise
            log.info(
                "zio source (readMode=direct): run key %s %s at %s",
                self.run_curve.public_key.decode("ascii"),
                "admitted while the control flow lives" if gated else "not needed (no allow-list)",
                endpoint,
            )
            with self._lock:
                self._kept.add(endpoint)
                if self._keeper is None and not self._closed.is_set():
                    self._keeper = threading.Thread(
                        target=self._keep_all, name="zio-control keeper", daemon=True
                    )
                    self._keeper.start()
        self._conns[endpoint] = conn
        return conn

    def _keep_all(self) -> None:
        """The keeper thread: every :data:`KEEP_INTERVAL` s, a look (:meth:`_keep`) at
        each kept control flow, queued on its lane unless one is queued already."""
        while not self._closed.wait(KEEP_INTERVAL):
            with self._lock:
                due = sorted(self._kept - self._keeping)
                self._keeping.update(due)
            for endpoint in due:
                self._lane(endpoint).submit(partial(self._keep, endpoint))

    def _keep(self, endpoint: str) -> None:
        """On the lane: a held query on the control flow; one that ended (a producer's
        restart answers with an EOT) is reopened at once, which registers the run key
        again. If it cannot be reopened now the keeper gives up on it until a hook opens
        it again (an endpoint that is down costs the lane one attempt, not one per look).
        """
        try:
            conn = self._conns.get(endpoint)
            if conn is not None:
                try:
                    conn.held()
                    return
                except TransportError as e:
                    log.info(
                        "zio source (readMode=direct): the control flow to %s ended (%s); "
                        "reopening it for the run key",
                        endpoint,
                        e,
                    )
                    self._drop(endpoint)
            try:
                self._open(endpoint)
            except (TransportError, RangesNotServed) as e:
                with self._lock:
                    self._kept.discard(endpoint)
                log.warning(
                    "zio source (readMode=direct): cannot reopen the control flow to %s "
                    "(%s): the run key is not registered there until the next trigger "
                    "reaches it",
                    endpoint,
                    e,
                )
        finally:
            with self._lock:
                self._keeping.discard(endpoint)

    def _drop(self, endpoint: str) -> None:
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            try:
                conn.close()
            except (TransportError, OSError) as e:  # pragma: no cover - best effort
                log.info("zio source: closing the control flow to %s: %s", endpoint, e)

    def _ask(self, endpoint: str) -> _Answer:
        error = ""
        for _ in (1, 2):
            try:
                conn = self._open(endpoint)
                w = conn.held()
            except RangesNotServed:
                return _Answer(plain=True)
            except TransportError as e:
                self._drop(endpoint)
                error = str(e)
                continue
            return _Answer(producer=conn.producer, window=w)
        return _Answer(error=error)

    def _ack_loop(self, endpoint: str) -> None:
        """Send the latest wanted ack of each producer at ``endpoint`` until none is left
        (a position wanted while this runs is sent too)."""
        while True:
            with self._lock:
                todo = [
                    (p, pos)
                    for p, (where, pos) in sorted(self._want.items())
                    if where == endpoint and self._acked.get(p) != pos
                ]
                if not todo:
                    self._acking.discard(endpoint)
                    return
            for p, pos in todo:
                if not self._ack_one(endpoint, p, pos):
                    with self._lock:
                        self._acking.discard(endpoint)
                    return  # not reachable now: the next commit acks it (cumulative)

    def _ack_one(self, endpoint: str, p: str, pos: Position) -> bool:
        for attempt in (1, 2):
            try:
                self._open(endpoint).ack(pos.end - 1, pos.incarnation, p)
            except AckRefused as e:
                log.error(
                    "zio source (readMode=direct): COMMIT ACK REFUSED by producer %r at %s: %s",
                    p,
                    endpoint,
                    e,
                )
                break  # never retried: it can never be applied
            except TransportError as e:
                self._drop(endpoint)
                if attempt == 2:
                    log.warning(
                        "zio source (readMode=direct): the ack of %d of producer %r at %s "
                        "did not go through (%s); the next commit acks it",
                        pos.end - 1,
                        p,
                        endpoint,
                        e,
                    )
                    return False
                continue
            break
        with self._lock:
            self._acked[p] = pos
        return True

    # -- on the caller's thread ---------------------------------------------------------

    def held(self) -> dict[str, HeldWindow]:
        """Each producer's held window now (one round trip per endpoint, all at once);
        endpoints that do not answer are left out (and logged). Endpoints that were down
        are asked in the background: their answer counts once it came. With a
        ``group``, the endpoints are the ones discovery found (:meth:`_discover`)."""
        self._discover()
        waited: dict[str, Future[_Answer]] = {}
        for endpoint in self.endpoints:
            if endpoint in self.plain:
                continue
            fut = self._asking.get(endpoint)
            if fut is None:
                fut = self._asking[endpoint] = self._lane(endpoint).submit(
                    partial(self._ask, endpoint)
                )
            if endpoint not in self.down:
                waited[endpoint] = fut
        # Each bounded by its connection's timeouts (two attempts). With a group, an
        # endpoint that leaves meanwhile is not waited for (it is down, as it left).
        while waited:
            _, busy = wait_all(waited.values(), timeout=None if self.zre is None else 0.2)
            if not busy:
                break
            self._apply_discovery()
            waited = {e: f for e, f in waited.items() if e in self.endpoints and f in busy}
        out: dict[str, HeldWindow] = {}
        for endpoint, fut in list(self._asking.items()):
            if not fut.done():
                continue
            del self._asking[endpoint]
            answer = fut.result()  # a protocol error of the peer is raised here
            if endpoint not in self.endpoints:
                # It left the group meanwhile: down for that reason, whatever it said
                # before it went (tasks planned on it now would find nobody there).
                continue
            if answer.plain:
                log.info(
                    "zio source (readMode=direct): %s does not serve range reads; it is "
                    "read through the spool",
                    endpoint,
                )
                self.plain.add(endpoint)
                self.down.pop(endpoint, None)
                continue
            if answer.error is not None:
                if endpoint not in self.down:
                    log.warning(
                        "zio source (readMode=direct): no held window from %s (%s); its "
                        "offset stays, and it is asked again in the background at each "
                        "trigger",
                        endpoint,
                        answer.error,
                    )
                self.down[endpoint] = answer.error
                continue
            if self.down.pop(endpoint, None) is not None:
                log.warning("zio source (readMode=direct): %s answers again", endpoint)
            producer, w = answer.producer, answer.window
            assert producer is not None and w is not None  # a capable giver states it
            other = self.where.get(producer)
            moved = other not in self.endpoints or (self.zre is not None and other in self.down)
            if other is not None and other != endpoint and not moved:
                raise ConfigError(
                    "endpoints",
                    ",".join(self.endpoints),
                    f"each producer at one endpoint; producer {producer!r} answers at "
                    f"{other} and {endpoint}",
                )
            self.where[producer] = endpoint
            self.seen[producer] = w
            out[producer] = w
        return out

    def ack(self, end: Mapping[str, Position]) -> None:
        """Spark committed ``end``: ack ``end - 1`` of each producer, in the incarnation
        of that end, on its control flow (once per position), without waiting for the
        answer. A refusal (another incarnation: the producer restarted without those
        records) frees nothing and is logged as an error; a producer not reachable now
        is acked at the next commit (acks are cumulative)."""
        start: list[str] = []
        with self._lock:
            for p, pos in sorted(end.items()):
                endpoint = self.where.get(p)
                if pos.end <= 1 or self._acked.get(p) == pos:
                    continue
                if endpoint is None or endpoint not in self.endpoints:
                    continue  # not seen by this runner yet, or it left the group: a later
                    # commit acks it (acks are cumulative)
                self._want[p] = (endpoint, pos)
                if endpoint not in self._acking:
                    self._acking.add(endpoint)
                    start.append(endpoint)
        for endpoint in start:
            self._lane(endpoint).submit(partial(self._ack_loop, endpoint))

    def task_curve(self, endpoints: Iterable[str]) -> Curve | None:
        """The CURVE keys of the tasks that read from ``endpoints``: the run's key pair
        (never the source's own secret key), None without CURVE. Each endpoint's lane
        first makes sure its control flow is open (one that ended since the last
        trigger is reopened, which registers the run key there); an endpoint that is
        down, or cannot be reached now, is logged: its tasks are refused, naming it.
        """
        if self.run_curve is None:
            return None
        opening = {
            endpoint: self._lane(endpoint).submit(partial(self._open, endpoint))
            for endpoint in sorted(set(endpoints))
            if endpoint not in self.plain and endpoint not in self.down
        }
        _, busy = wait_all(opening.values(), timeout=2 * self.timeout)
        for endpoint, fut in opening.items():
            error = "no answer in time" if fut in busy else fut.exception()
            if error is not None:
                log.warning(
                    "zio source (readMode=direct): the run key is not registered at %s "
                    "(%s): its tasks will be refused until a control flow to it is open "
                    "again",
                    endpoint,
                    error,
                )
        return self.run_curve

    def acked(self) -> dict[str, Position]:
        """The last position acked per producer (answered by the producer)."""
        with self._lock:
            return dict(self._acked)

    def close(self, timeout: float | None = None) -> None:
        """Send the acks still queued, end every control flow (EOT) and close its socket,
        each on its lane; waits at most ``timeout`` (default: the connection timeout)
        for all of them, then says which lane is still busy (an endpoint that is down)."""
        self._closed.set()
        if self._watcher is not None:
            self._watcher.stop()
        keeper = self._keeper
        if keeper is not None:
            keeper.join(KEEP_INTERVAL + 1.0)
        closing = {
            endpoint: lane.submit(partial(self._drop, endpoint))
            for endpoint, lane in self._lanes.items()
        }
        limit = self.timeout if timeout is None else timeout
        # Endpoints that left the group are not waited for (their lane may still be
        # asking one that is gone).
        _, busy = wait_all(
            [f for e, f in closing.items() if e in self.endpoints or self.zre is None],
            timeout=limit,
        )
        for endpoint, fut in closing.items():
            if fut in busy:
                log.warning(
                    "zio source (readMode=direct): the control flow to %s did not end in "
                    "time (the endpoint is down?); left to its thread",
                    endpoint,
                )
        for lane in self._lanes.values():
            lane.stop()
