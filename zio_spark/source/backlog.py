"""The producer's retention window: its held records as a giver's backlog.

:class:`ProducerBacklog` is what :class:`~zio_spark.source.producer.Producer` sends
from (the :class:`~zio_spark.transport.giver.Backlog` of its flows, server or client
mode) and what :meth:`Producer.send` fills: the :class:`~zio_spark.source.held.HeldRecords`
behind one lock, the send side's blocking on a full window (and the time spent blocked,
stated to the taker as ``blocked_ms``), the taker's acks and ``resume``, and the
delivery counts. Records are numbered from 1 in the order they are appended.

A restarted producer numbers from 1 again; when a taker's ``resume`` shows it already
holds more than this process ever sent, records not yet sent are renumbered to continue
after ``resume`` (``stats["renumbered"]``), so nothing new is mistaken for a duplicate.

With a :class:`~zio_spark.storage.retention.RetentionLog` (``Producer(retention_dir=)``)
the held records are also on disk: :meth:`ProducerBacklog.append` writes them to the log
(durable on return) before they can be sent, every release (an ack, a ``resume``, a
plain taker's send) is applied to the log after memory, a renumbering to the log before
memory, and a backlog made over a reopened log holds what it held and numbers on after
its last seq. Seqs a log numbered count as possibly sent (a restarted process cannot
know), so only records appended since are ever renumbered.

The application's threads call :meth:`append`, :meth:`flush` and the read-only views;
the port's loop thread calls the :class:`~zio_spark.transport.giver.Backlog` methods.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from zio_spark.codec.records import DAT_BYTES
from zio_spark.errors import ConfigError, StorageError, TransportError
from zio_spark.source.held import HeldRecords
from zio_spark.storage.retention import RetentionLog
from zio_spark.transport.giver import Giving, Taken

__all__ = ["Delivery", "ProducerBacklog", "closes_retention_on_failure", "open_retention"]

log = logging.getLogger("zio_spark.transport")

_BLOCKED_EVERY = 0.5  # while append() is blocked: most often its blocked time is stated

_P = ParamSpec("_P")


def open_retention(
    retention_dir: str | os.PathLike[str] | None, producer_id: str | None
) -> RetentionLog | None:
    """The producer's retention log in ``retention_dir`` (None: in memory only).

    Raises
    ------
    ConfigError
        ``retention_dir`` not a path, or no explicit ``producer_id`` (a default id names
        the endpoint, which a restart may change: the folder's records would be orphans).
    RetentionLockedError
        If another process holds the folder.
    StorageError
        If the folder belongs to another producer id, or is damaged.
    """
    if retention_dir is None:
        return None
    if not isinstance(retention_dir, (str, os.PathLike)) or not os.fspath(retention_dir):
        raise ConfigError("retention_dir", retention_dir, "a folder path (str or PathLike)")
    if not producer_id:
        raise ConfigError(
            "producer_id",
            producer_id,
            "an explicit, stable producer id with retention_dir (a restart must find its "
            "records under the same id)",
        )
    return RetentionLog(retention_dir, owner=producer_id)


def closes_retention_on_failure(
    init: Callable[Concatenate[Any, _P], None],
) -> Callable[Concatenate[Any, _P], None]:
    """Wrap a producer's ``__init__``: if it fails after its backlog opened a retention
    log, close the log (its folder lock would otherwise outlive the failed object)."""

    @functools.wraps(init)
    def wrapper(self: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            backlog = getattr(self, "_backlog", None)
            if isinstance(backlog, ProducerBacklog):
                backlog.close_retention()
            raise

    return wrapper


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Delivery:
    """What became of the records this process queued (:meth:`Producer.delivery`).

    Attributes
    ----------
    queued
        Records given to :meth:`Producer.send` / :meth:`Producer.send_many`.
    sent
        Of those, records put on the wire at least once (resends not counted again).
    acked
        Of those, records an ack-capable taker acknowledged (or covered by the ``resume``
        it stated): it holds them durably.
    confirmed
        Of those, records sent to a plain taker on a flow whose EOT it echoed: it had
        them all before the echo (a plain taker gives no other confirmation).
    pending
        Records still held: not yet acknowledged, or not yet sent to a plain taker.

    With ``retention_dir``, records an earlier process left in the folder count in
    ``pending`` (and in ``acked`` once acknowledged) but not in ``queued`` or ``sent``
    (``stats["retention_reopened"]`` says how many there were).
    """

    queued: int
    sent: int
    acked: int
    confirmed: int
    pending: int

    @property
    def delivered(self) -> int:
        """Records known to have reached a taker: ``acked + confirmed``."""
        return self.acked + self.confirmed


class ProducerBacklog:
    """Records held until acknowledged, bounded by ``max_unacked`` / ``max_unacked_bytes``.

    ``wake`` is called (under the lock) when records arrive for a taker that has none
    waiting; the loop then calls :meth:`woken` and pumps the flow. ``retention``: keep
    the held records on disk too (see the module docstring); the backlog owns it from
    here and closes it in :meth:`close_retention`.
    """

    def __init__(
        self,
        *,
        max_unacked: int,
        max_unacked_bytes: int,
        stats: collections.Counter[str],
        wake: Callable[[], None],
        retention: RetentionLog | None = None,
    ) -> None:
        self.max_unacked = max_unacked
        self.max_unacked_bytes = max_unacked_bytes
        self.stats = stats
        self.producer_id = ""
        self.endpoint = ""
        self._wake = wake
        self._cond = threading.Condition()
        self._records = HeldRecords()
        self._blocked_s = 0.0  # time append() spent waiting for room in the window
        self._blocked_since: float | None = None  # set while an append() waits
        self._ever_sent = 0  # highest seq sent to, or held by, a taker of this process
        self._acked = 0
        self._queued = 0  # records queued by this process
        self._sent_count = 0  # of those, put on the wire at least once
        self._acked_count = 0  # of those, acknowledged (or covered by a taker's resume)
        self._confirmed = 0  # of those, sent to a plain taker that echoed our EOT
        self.taker: Giving | None = None  # the flow records go to
        self.last_acks: bool | None = None  # whether the latest taker acknowledges
        self._wake_pending = False
        self.closed = False
        self.eot_done: threading.Event | None = None  # set while close() awaits the echo
        # Per flow: the blocked time last stated to its taker (see :meth:`stated`), the
        # window's finished total then, and when.
        self._told: dict[int, tuple[float, float]] = {}
        self.retention = retention
        if retention is not None:
            self._reopen(retention)

    def _reopen(self, retention: RetentionLog) -> None:
        """Hold what ``retention`` holds; number on after the last seq it wrote."""
        self._records = HeldRecords(retention.first)
        held = retention.records(retention.first, retention.next_seq)
        if held is not None:
            self._records.append(held.values, held.keys, held.granules, held.headers)
        # Whatever an earlier process numbered may have reached a taker.
        self._ever_sent = retention.next_seq - 1
        self._acked = retention.first - 1
        self.stats["retention_reopened"] += len(retention)
        self.stats["retention_torn"] += retention.torn
        if held is not None:
            log.info(
                "producer: retention %s holds %d unacknowledged records (seqs %d..%d); "
                "numbering on from %d",
                retention.folder,
                len(retention),
                retention.first,
                retention.next_seq - 1,
                retention.next_seq,
            )
        # Called under the lock when held records get other numbers (a taker's resume
        # renumbered them): the range service takes a new incarnation then.
        self.on_renumber: Callable[[], None] | None = None

    # -- application side (any thread) --------------------------------------------

    def append(
        self,
        values: Sequence[bytes],
        keys: Sequence[bytes | None] | None,
        headers: Sequence[Mapping[str, str] | None] | None,
        granules: Sequence[int | None] | None,
        timeout: float | None,
    ) -> int:
        """Hold records, waiting for room; returns the seq of the last one.

        Raises
        ------
        TransportError
            If the window has no room for them within ``timeout`` seconds, or the
            producer is closed.
        StorageError
            With retention: if the log refuses a record
            (:class:`~zio_spark.errors.StorageInputError`, naming it) or cannot write;
            records of this call appended before it stay held.
        """
        n = len(values)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            i = 0
            while i < n:
                if self.closed:
                    raise TransportError("producer is closed", endpoint=self.endpoint)
                room = self.max_unacked - len(self._records)
                if self._records.nbytes >= self.max_unacked_bytes:
                    room = 0
                if room <= 0:
                    now = time.monotonic()
                    if self._blocked_since is None:
                        self._blocked_since = now
                        self.stats["blocked"] += 1
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        self._end_blocked(now)
                        raise TransportError(
                            f"producer window full ({len(self._records)} records, "
                            f"{self._records.nbytes} bytes unacknowledged; window "
                            f"{self.max_unacked} records / {self.max_unacked_bytes} bytes) "
                            f"for {timeout} s: is a taker connected and acknowledging?",
                            endpoint=self.endpoint,
                        )
                    self._cond.wait(left)
                    continue
                if self._blocked_since is not None:
                    self._end_blocked(time.monotonic())
                j = min(n, i + room)
                whole = i == 0 and j == n
                cols = (
                    values if whole else values[i:j],
                    keys if whole or keys is None else keys[i:j],
                    granules if whole or granules is None else granules[i:j],
                    headers if whole or headers is None else headers[i:j],
                )
                if self.retention is not None:  # durable before it can be sent
                    self.retention.append(self._records.next_seq, *cols)
                self._records.append(*cols)
                self._queued += j - i
                i = j
                if not self._wake_pending and self.taker is not None:
                    self._wake_pending = True
                    self._wake()
            return self._records.next_seq - 1

    def _end_blocked(self, now: float) -> None:
        assert self._blocked_since is not None
        self._blocked_s += now - self._blocked_since
        self._blocked_since = None

    def flush(self, timeout: float | None) -> None:
        """Wait until nothing is held.

        Raises
        ------
        TransportError
            On timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._records:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportError(
                        f"{len(self._records)} records still unacknowledged after {timeout} s",
                        endpoint=self.endpoint,
                    )
                self._cond.wait(left if left is None else min(left, 0.5))

    def close(self) -> None:
        """No more appends; a waiting one fails."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def close_retention(self) -> None:
        """Close the retention log, if any (once the loop no longer calls in)."""
        with self._cond:
            if self.retention is not None:
                self.retention.close()

    def _forget(self, upto: int) -> None:
        """Release up to ``upto`` in the retention log (after memory). A failure is
        logged and counted: those records are resent after a restart, never lost."""
        retention = self.retention
        if retention is None:
            return
        # Never past what memory numbered: a taker acking beyond it must not move the
        # log's numbering away from memory's (a jump is memory's renumber, done first).
        upto = min(upto, self._records.next_seq - 1)
        if upto < retention.first or retention.closed:
            return
        try:
            retention.release(upto)
        except (StorageError, OSError) as e:
            self.stats["retention_errors"] += 1
            log.error("producer %s: cannot release up to %d: %s", self.producer_id, upto, e)

    @property
    def blocked_seconds(self) -> float:
        with self._cond:
            now = time.monotonic()
            ongoing = 0.0 if self._blocked_since is None else now - self._blocked_since
            return self._blocked_s + ongoing

    @property
    def window_full(self) -> bool:
        with self._cond:
            return self._blocked_since is not None

    def window_full_since(self, mark: int) -> tuple[bool, int]:
        """Whether a send began to wait for room in the window since ``mark`` (a number this
        returned before; 0 at first) or waits now, and the mark to pass next time
        (:class:`~zio_spark.source.range_serving.RangeSource`)."""
        with self._cond:
            waits = self.stats["blocked"]  # waits begun (one going on counted)
            return waits > mark or self._blocked_since is not None, waits

    @property
    def acked(self) -> int:
        with self._cond:
            return self._acked

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._records.next_seq - 1

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._records)

    @property
    def kept_incarnation(self) -> str | None:
        """The retention folder's incarnation (its records keep their numbers across a
        restart), or None without a folder."""
        return None if self.retention is None else self.retention.incarnation

    def prepare_held(self) -> bool:
        """Nothing to do: :meth:`append` numbers records as they come, so the window is
        always current (the queue's port numbers store messages lazily instead)."""
        return True

    def read_held(self, read: Callable[[HeldRecords], T]) -> T:
        """``read(records)`` under the lock, for readers that never change them (range
        reads: nothing is sent, released or counted; keep ``read`` short)."""
        with self._cond:
            return read(self._records)

    def commit_held(self, step: Callable[[HeldRecords], tuple[T, int | None]]) -> T:
        """``step(records)`` under the lock, then free every record up to the number it
        returns (None: nothing), as a taker's ack does (:meth:`ack`: memory, the
        retention log, the ``acked`` count), in the same hold of the lock: the driver's
        commit on its control flow, checked against the window it frees from. Freeing is
        monotonic: a number below what is held frees nothing."""
        with self._cond:
            out, upto = step(self._records)
            if upto is not None:
                self._release(upto)
                self._cond.notify_all()
            return out

    def delivery(self) -> Delivery:
        with self._cond:
            return Delivery(
                queued=self._queued,
                sent=self._sent_count,
                acked=self._acked_count,
                confirmed=self._confirmed,
                pending=len(self._records),
            )

    # -- loop side: the giver's Backlog ----------------------------------------------

    def woken(self) -> Giving | None:
        """The loop answers a :meth:`append`'s wake: the flow to pump, if any."""
        with self._cond:
            self._wake_pending = False
        return self.taker

    def attach(self, giving: Giving, resume: int | None) -> int:
        with self._cond:
            if self.taker is not None and self.taker is not giving:
                self.stats["takers_replaced"] += 1
            self.taker = giving
            self.last_acks = giving.acks
            self.stats["takers"] += 1
            records = self._records
            start = records.first
            if resume is not None:
                never_sent = self._ever_sent + 1
                if resume >= never_sent and records.next_seq > never_sent:
                    shift = resume + 1 - never_sent
                    if self.retention is not None:  # disk first: a failure changes nothing
                        self.retention.release(never_sent - 1)
                        self.retention.renumber(shift)
                    self._acked_count += records.release(never_sent - 1)
                    records.renumber(shift)
                    if self.on_renumber is not None:
                        self.on_renumber()
                    kept = len(records)
                    self.stats["renumbered"] += kept
                    log.warning(
                        "producer %s: taker resumes at %d beyond what this process sent; "
                        "%d unsent records renumbered from %d",
                        self.producer_id,
                        resume,
                        kept,
                        resume + 1,
                    )
                elif resume >= never_sent:  # the taker has all we sent; nothing unsent
                    self._acked_count += records.release(resume)
                    records.renumber(max(0, resume + 1 - records.next_seq))
                    self._forget(resume)  # the log numbers on after resume too
                self._release(resume)
                # Records up to ``resume`` are now accounted for: a later taker with the
                # same ``resume`` (a replaced driver, a reconnecting port's queued BOT)
                # must not move the numbering on a second time.
                self._ever_sent = max(self._ever_sent, resume)
                start = max(start, resume + 1)
            self._cond.notify_all()
        return start

    def detach(self, giving: Giving, reason: str) -> None:
        with self._cond:
            if self.taker is giving:
                self.taker = None
        self._told.pop(id(giving), None)
        if self.eot_done is not None:
            self.eot_done.set()
        log.info("producer %s: taker left (%s)", self.producer_id, reason)

    def take(self, first: int, n: int, room: int) -> Taken | None:
        with self._cond:
            return self._records.take(first, n, DAT_BYTES)

    def sent(self, first: int, last: int, records: int, dats: int, release: bool) -> None:
        with self._cond:
            self._sent_count += max(0, last - max(self._ever_sent, first - 1))
            self._ever_sent = max(self._ever_sent, last)
            if release:
                self._records.release(last)
                self._forget(last)
                self._cond.notify_all()
        self.stats["records_sent"] += records
        self.stats["dats_sent"] += dats

    def ack(self, upto: int) -> None:
        with self._cond:
            self._release(upto)
            self._cond.notify_all()

    def _release(self, upto: int) -> None:
        self._acked_count += self._records.release(upto)
        self._forget(upto)
        if upto > self._acked:
            self.stats["acked"] += upto - self._acked
            self._acked = upto

    def ended(self, giving: Giving, echo: bool) -> None:
        self.stats["eot_received"] += 1
        if echo and not giving.acks:  # the plain taker had them all before its echo
            with self._cond:
                self._confirmed += giving.records
                self._cond.notify_all()
            self.stats["confirmed"] += giving.records

    def stated(self, giving: Giving, last: int | None) -> dict[str, Any] | None:
        """``more: false`` when the DAT ending at ``last`` empties the queue (in the BOT
        reply: when nothing is held for this taker), so the taker need not wait for
        more; in the BOT reply always ``last``, the position (the last seq assigned);
        ``blocked_ms`` (DATs only) when the time :meth:`append` spent blocked on a
        full window changed since last stated (at most every ``_BLOCKED_EVERY`` s while
        a block lasts). Unlocked reads first: the common case costs a few attribute
        reads and returns None (a bare label)."""
        if last is None:
            # The BOT reply: our position (``last``, the last seq assigned so far), so the
            # taker knows what "all we hold now" is by the protocol, not by a clock.
            with self._cond:
                position = self._records.next_seq - 1
            state: dict[str, Any] = {"last": position}
            if position < giving.next_seq:
                state["more"] = False
            return state
        attrs: dict[str, Any] | None = None
        if last >= self._records.next_seq - 1:
            attrs = {"more": False}
        told_base, told_at = self._told.get(id(giving), (0.0, 0.0))
        if self._blocked_since is None and self._blocked_s == told_base:
            return attrs
        now = time.monotonic()
        with self._cond:
            base, since = self._blocked_s, self._blocked_since
        if since is not None and now - told_at < _BLOCKED_EVERY:
            return attrs
        if since is None and base == told_base:
            return attrs
        self._told[id(giving)] = (base, now)
        ms = int((base + (0.0 if since is None else max(0.0, now - since))) * 1000)
        if attrs is None:
            attrs = {}
        attrs["blocked_ms"] = ms
        return attrs
