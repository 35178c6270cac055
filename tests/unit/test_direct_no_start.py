"""``readMode=direct`` on a Spark that calls ``latestOffset()`` without the batch start
(before 4.2): :class:`~zio_spark.source.direct.ImpliedStart` knows it from Spark's other
calls, in the call orders seen on 4.0.5 and 4.1.4 (a probe source logging every call).

The last test drives the pure planner (``latest``, ``batch_ranges``, the acks) the way
such a Spark does, through restarts at every point of a batch, against a model producer
that frees what is acked: every record is read exactly once and none is acked unread.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from zio_spark.source.direct import (
    ImpliedStart,
    Position,
    batch_ranges,
    initial,
    latest,
    split_offsets,
    to_json,
)
from zio_spark.source.range_client import HeldWindow

A, B = "inc-a", "inc-b"


def _j(**ends: int) -> dict[str, Any]:
    """Offsets as Spark hands them over (JSON decoded), all of incarnation A."""
    return json.loads(json.dumps(to_json({p: Position(A, e) for p, e in ends.items()})))


def test_a_new_checkpoint_has_no_start_until_spark_says_it() -> None:
    # New checkpoint: latestOffset(), initialOffset(), partitions(initial, end).
    s = ImpliedStart()
    assert s.start() is None
    s.initial = _j(p=1)  # what the start-less first latestOffset() planned from
    s.answered(_j(p=40))
    assert s.start() == _j(p=40)
    s.planned(_j(p=1), _j(p=40))
    assert s.initial is None  # initialOffset() after a batch is a fresh question
    # The next latestOffset() comes once batch 0 is committed: it starts at its end.
    assert s.start() == _j(p=40)


def test_a_restart_starts_at_the_end_of_the_offset_logs_last_batch() -> None:
    # Restart, last batch committed: partitions(e, e), then latestOffset().
    s = ImpliedStart()
    s.planned(_j(p=40, q=3), _j(p=40, q=3))
    assert s.start() == _j(p=40, q=3)
    # Restart, last batch not committed: partitions(e, e), partitions(s, e) (re-run),
    # then latestOffset() once it is committed.
    s = ImpliedStart()
    s.planned(_j(p=40), _j(p=40))
    s.planned(_j(p=20), _j(p=40))
    assert s.start() == _j(p=40)


def test_an_unchanged_answer_is_still_the_start() -> None:
    """No new records: Spark runs no batch and asks again from the same offsets."""
    s = ImpliedStart()
    s.planned(_j(p=5), _j(p=5))
    s.answered(_j(p=5))
    assert s.start() == _j(p=5)
    returned = s.start()
    assert returned is not None
    returned["p"] = "changed"  # a copy: the caller cannot move the start
    assert s.start() == _j(p=5)


def test_a_restart_meets_the_producers_new_incarnation() -> None:
    """The start a restarted runner learns from ``partitions(e, e)`` is in the old
    incarnation: the producer restarted without its records numbers anew. The planning
    is then 4.2's: the offset jumps to the new ``first``, nothing of either is read in
    that batch, and what the old one held beyond ``e`` is named (not known: the runner
    never saw it)."""
    s = ImpliedStart()
    s.planned(_j(p=40), _j(p=40))
    begin, spool = split_offsets(s.start())
    assert spool == {}
    end, losses = latest(begin, {"p": HeldWindow(B, 1, 7)})
    assert end == {"p": Position(B, 1)}
    assert batch_ranges(begin, end) == {}
    (loss,) = losses
    assert (loss.incarnation, loss.start, loss.end) == (A, 40, None)


def test_records_freed_before_a_restarted_runner_read_them_are_named_exactly() -> None:
    s = ImpliedStart()
    s.planned(_j(p=40), _j(p=40))
    begin, _ = split_offsets(s.start())
    end, losses = latest(begin, {"p": HeldWindow(A, 55, 90)})
    assert end == {"p": Position(A, 55)}
    assert batch_ranges(begin, end) == {"p": (A, 40, 55)}  # its tasks are refused these
    (loss,) = losses
    assert (loss.start, loss.end) == (40, 55)


# -- the whole protocol, with restarts ------------------------------------------------


@dataclass
class _Producer:
    """A model producer: one incarnation, records 1.., frees what an ack covers."""

    first: int = 1
    end: int = 1
    acked: list[int] = field(default_factory=list)

    def held(self) -> dict[str, HeldWindow]:
        return {"p": HeldWindow(A, self.first, self.end)}

    def ack(self, upto: int) -> None:
        self.acked.append(upto)
        self.first = max(self.first, upto + 1)

    def read(self, start: int, end: int) -> list[int]:
        assert self.first <= start and end <= self.end, (start, end, self.first, self.end)
        return list(range(start, end))


class _Runner:
    """The direct mode's runner logic of ``ZioStreamReaderOldApi`` over the model
    producer (no sockets): what the stream reader does in each hook."""

    def __init__(self, prod: _Producer) -> None:
        self.prod = prod
        self.implied = ImpliedStart()
        self.acked: Position | None = None

    def _ack(self, offsets: dict[str, Position]) -> None:
        pos = offsets.get("p")
        if pos is not None and pos.end > 1 and pos != self.acked:
            self.prod.ack(pos.end - 1)
            self.acked = pos

    def initial_offset(self) -> dict[str, Any]:
        return self.implied.initial or to_json(initial(self.prod.held()))

    def latest_offset(self) -> dict[str, Any]:
        start = self.implied.start()
        begin, _ = split_offsets(start)
        held = self.prod.held()
        if start is None:
            begin = initial(held)
            self.implied.initial = to_json(begin)
        else:
            self._ack(begin)
        end, losses = latest(begin, held)
        assert losses == []
        out = json.loads(json.dumps(to_json(end)))
        self.implied.answered(out)
        return out

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[int]:
        self.implied.planned(start, end)
        ranges = batch_ranges(split_offsets(start)[0], split_offsets(end)[0])
        return [seq for _, s, e in ranges.values() for seq in self.prod.read(s, e)]

    def commit(self, end: dict[str, Any]) -> None:
        self._ack(split_offsets(end)[0])


class _Crash(Exception):
    pass


def _spark_old(seed: int) -> None:
    """Spark 4.0/4.1's micro-batch loop as probed (offset log, commit log, a sink that
    keeps only committed batches), crashing the query at random points and restarting
    it with a new runner on the same checkpoint."""
    rnd = random.Random(seed)
    prod = _Producer()
    offset_log: list[dict[str, Any]] = []
    committed = 0  # batches in the commit log
    out: list[int] = []
    initial_of_batch0: dict[str, Any] | None = None

    def maybe_crash() -> None:
        if rnd.random() < 0.15:
            raise _Crash

    def run_batch(r: _Runner, i: int) -> None:
        nonlocal committed
        start = offset_log[i - 1] if i > 0 else r.initial_offset()
        rows = r.partitions(start, offset_log[i])
        maybe_crash()  # the batch ran; not in the commit log
        committed = i + 1
        out.extend(rows)

    for _ in range(40):  # runs of the query
        r = _Runner(prod)
        try:
            if offset_log:
                r.partitions(offset_log[-1], offset_log[-1])  # the restart's first call
                if committed < len(offset_log):
                    run_batch(r, len(offset_log) - 1)
            for _ in range(rnd.randint(1, 6)):  # triggers of this run
                prod.end += rnd.choice([0, 0, 1, 7, 30])  # records arrive
                maybe_crash()
                end = r.latest_offset()
                if committed:
                    # Acked at once: what Spark committed, before commit() (which lags
                    # and never comes for a run's last batch), across restarts too.
                    done = split_offsets(offset_log[committed - 1])[0]["p"].end
                    assert prod.first == max(done, 1), (prod.first, done)
                if committed and end == offset_log[committed - 1]:
                    continue  # no new data: no batch
                if not offset_log and end == r.initial_offset():
                    continue
                maybe_crash()  # before the offset log entry
                offset_log.append(end)
                if len(offset_log) == 1:
                    initial_of_batch0 = r.initial_offset()
                if committed:
                    r.commit(offset_log[committed - 1])  # commit() lags a batch
                maybe_crash()  # in the offset log, not planned
                run_batch(r, len(offset_log) - 1)
        except _Crash:
            continue
    assert initial_of_batch0 is None or initial_of_batch0 == _j(p=1)
    assert committed > 3, committed  # the run got somewhere
    # Every record of the committed batches exactly once, in order; acks only below
    # what was read (never a record no batch read).
    assert out == list(range(1, len(out) + 1))
    assert all(upto <= len(out) for upto in prod.acked), (prod.acked, len(out))
    assert prod.acked == sorted(prod.acked)


@pytest.mark.parametrize("seed", range(40))
def test_old_sparks_protocol_with_restarts_reads_once_and_acks_only_what_was_read(
    seed: int,
) -> None:
    _spark_old(seed)
