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
  cut to ``maxRecordsPerTrigger``; records below the held ``first`` that the batch
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
opened at the first need, reopened after a failure) for ``held`` queries and commit acks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import Curve
from zio_spark.source import plan
from zio_spark.source.range_client import (
    AckRefused,
    ControlConnection,
    HeldWindow,
    RangesNotServed,
)

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
    "pack",
    "split_offsets",
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
) -> tuple[Offsets, list[Loss]]:
    """The end offsets of the next batch and the losses found (module docstring).

    ``target``: an availableNow run's ends (no further than them in their incarnation).
    ``seen``: the last held window each producer answered before (to tell what an
    incarnation that is gone held beyond ``start``).
    """
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
        bases[p] = was.end
        ends[p] = max(was.end, goal)
    if max_rows is not None:
        ends, _ = plan.take_rows(bases, ends, max_rows)
    for p, e in ends.items():
        out[p] = Position(start[p].incarnation, e)
    return dict(sorted(out.items())), losses


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


def pack(ranges: Mapping[str, tuple[str, int, int]], step: int) -> list[tuple[DirectRange, ...]]:
    """The ranges of one batch as the ranges of its Spark partitions, cut and grouped
    as the spool path's (:func:`~zio_spark.source.plan.pack`)."""
    groups = plan.pack({p: (s, e) for p, (_, s, e) in ranges.items()}, step)
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


class Controls:
    """The driver's control flows, one per endpoint: held queries and commit acks.

    Opened at the first :meth:`held` (never in a constructor Spark pickles), each
    reopened once after a failure; an endpoint that does not answer is skipped for that
    trigger (logged). An endpoint whose giver does not state the range capability is
    put in :attr:`plain` (never asked again): the stream reader reads it through the
    spool.
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
    ) -> None:
        self.endpoints = endpoints
        self.ctx = ctx
        self.mode = mode
        self.curve = curve
        self.timeout = timeout
        self.stream = stream
        self._conns: dict[str, ControlConnection] = {}
        self.where: dict[str, str] = {}  # producer id -> endpoint
        self.seen: dict[str, HeldWindow] = {}  # producer id -> its last held answer
        # Endpoints whose giver does not state the range capability: read through the
        # spool (never asked again).
        self.plain: set[str] = set()
        self._acked: dict[str, Position] = {}  # producer id -> the last commit acked
        self.terminating = False  # SIGTERM seen, or stop() begun (see the stream reader)

    def _open(self, endpoint: str) -> ControlConnection:
        conn = self._conns.get(endpoint)
        if conn is not None:
            return conn
        try:
            conn = ControlConnection(
                endpoint,
                ctx=self.ctx,
                mode=self.mode,
                curve=self.curve,
                timeout=self.timeout,
                stream=self.stream,
            )
        except RangesNotServed:
            log.info(
                "zio source (readMode=direct): %s does not serve range reads; it is read "
                "through the spool",
                endpoint,
            )
            self.plain.add(endpoint)
            raise
        self._conns[endpoint] = conn
        return conn

    def _drop(self, endpoint: str) -> None:
        conn = self._conns.pop(endpoint, None)
        if conn is not None:
            try:
                conn.close()
            except (TransportError, OSError) as e:  # pragma: no cover - best effort
                log.info("zio source: closing the control flow to %s: %s", endpoint, e)

    def held(self) -> dict[str, HeldWindow]:
        """Each producer's held window now (one round trip per endpoint); endpoints that
        do not answer are left out (and logged)."""
        out: dict[str, HeldWindow] = {}
        for endpoint in self.endpoints:
            if endpoint in self.plain:
                continue
            for attempt in (1, 2):
                try:
                    conn = self._open(endpoint)
                    w = conn.held()
                except RangesNotServed:
                    break
                except TransportError as e:
                    self._drop(endpoint)
                    if attempt == 2:
                        log.warning(
                            "zio source (readMode=direct): no held window from %s this "
                            "trigger (%s); its offset stays",
                            endpoint,
                            e,
                        )
                    continue
                producer = conn.producer
                assert producer is not None  # a capable giver states it
                other = self.where.get(producer)
                if other is not None and other != endpoint:
                    raise ConfigError(
                        "endpoints",
                        ",".join(self.endpoints),
                        f"each producer at one endpoint; producer {producer!r} answers at "
                        f"{other} and {endpoint}",
                    )
                self.where[producer] = endpoint
                self.seen[producer] = w
                out[producer] = w
                break
        return out

    def ack(self, end: Mapping[str, Position]) -> None:
        """Spark committed ``end``: ack ``end - 1`` of each producer, in the incarnation
        of that end, on its control flow (once per position). A refusal (another
        incarnation: the producer restarted without those records) frees nothing and
        is logged as an error; a producer not reachable now is acked at the next
        commit (acks are cumulative)."""
        for p, pos in sorted(end.items()):
            if pos.end <= 1 or self._acked.get(p) == pos:
                continue
            endpoint = self.where.get(p)
            if endpoint is None:
                continue  # not seen yet by this runner: the next commit acks it
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
                    self._acked[p] = pos  # never retried: it can never be applied
                    break
                except TransportError as e:
                    self._drop(endpoint)
                    if attempt == 2:
                        log.warning(
                            "zio source (readMode=direct): the ack of %d of producer %r "
                            "at %s did not go through (%s); the next commit acks it",
                            pos.end - 1,
                            p,
                            endpoint,
                            e,
                        )
                    continue
                self._acked[p] = pos
                break

    def close(self) -> None:
        """End every control flow (EOT) and close its socket."""
        for endpoint in list(self._conns):
            self._drop(endpoint)
