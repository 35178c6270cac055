"""``spark.readStream.format("zio")`` and ``spark.read.format("zio")``.

Two reader instances exist (FACTS.md): the long-lived *runner* on the driver calls
``initialOffset``/``latestOffset``/``partitions``/``commit``; executors get a pickled
copy and call ``read``. So the reader keeps only its parsed options until a runner-only
method first needs the receiver: the spool, the receiver thread and its sockets (and the
segment server for remote executors, :class:`~zio_spark.source.runtime.Runtime`) are
created then, never in ``__init__``, and are left out of pickles. This module holds the
Spark hooks; what they call down to is in :mod:`zio_spark.source.runtime`.

Offsets are ``{"<producer id>": next_seq}`` with sorted keys (Spark compares them as
JSON strings): every record of that producer with ``seq < next_seq`` is covered.

With ``readMode=direct`` no receiver, spool or segment server is made: the runner keeps
one control flow per endpoint (:class:`~zio_spark.source.direct.Controls`, opened at the
first hook that needs it), offsets are ``{"<producer id>": {"end": e, "incarnation":
i}}`` (:mod:`zio_spark.source.direct`), each task reads its ranges straight from the
producers (:class:`DirectPartition`) and ``commit`` acks on the control flows.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from zio_spark import heap
from zio_spark.codec.records import wire_to_wal
from zio_spark.codec.schema import DEFAULT_SCHEMA, SPARK_SCHEMA, SPARK_TYPES
from zio_spark.errors import ConfigError, DataLossError, TransportError
from zio_spark.options import Curve, SourceOptions
from zio_spark.source import direct, plan
from zio_spark.source.range_client import HeldWindow, RangeConnection
from zio_spark.source.runtime import (
    RunState,
    Runtime,
    available,
    batch_receive,
    check,
    wait_first,
)
from zio_spark.source.spool_server import SegmentKeys, fetch_range
from zio_spark.spark import compat

# Spark's admission-control classes (4.2+), or stand-ins on older Sparks (compat.py).
from zio_spark.spark.compat import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

# The data source class lives in a light module (Spark's pyspark_* lookup imports it).
from zio_spark.spark.datasource import ZioDataSource
from zio_spark.storage.spool import project, read_sealed

__all__ = ["DEFAULT_SCHEMA", "ZioBatchReader", "ZioDataSource", "ZioStreamReader"]

log = logging.getLogger("zio_spark.source")


def _columns(schema: StructType | None) -> tuple[str, ...]:
    """Check a user schema lists a subset of the default columns, with their types."""
    if schema is None:
        return tuple(SPARK_TYPES)
    names = []
    for f in schema.fields:
        want = SPARK_TYPES.get(f.name)
        got = f.dataType.simpleString()
        if want is None:
            raise ConfigError("schema", f.name, f"columns among {', '.join(SPARK_TYPES)}")
        if got != want:
            raise ConfigError("schema", f"{f.name} {got}", f"column {f.name} of type {want}")
        names.append(f.name)
    return tuple(names)


class _Ending(Protocol):
    terminating: bool


def _unwind_on_sigterm(rt: _Ending) -> None:
    """From the runner's main thread: SIGTERM (Spark ending the runner) unwinds it, so
    the runner's own ``finally: reader.stop()`` ends the flows (``rt.terminating`` set).

    The handler itself must not stop anything: it runs between any two bytecodes of the
    main thread, which may hold a spool lock (a commit in progress); stopping from there
    deadlocked, and the runner outlived its JVM. It unwinds once: Spark may signal again
    while that ``finally`` runs, and a second SystemExit there cut the stop short before
    the EOTs' echoes came (the giver's flow left open).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        if rt.terminating:
            log.info("zio source: SIGTERM again; still ending the flows")
            return
        rt.terminating = True
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)


@dataclass(frozen=True)
class ZioPartition(InputPartition):  # type: ignore[misc]
    """Ranges ``(producer, start, end)`` to read in one task, and how executors reach
    the spool. Small ranges of several producers share a task
    (:func:`~zio_spark.source.plan.pack`)."""

    ranges: tuple[tuple[str, int, int], ...]
    spool_path: str
    host: str
    server: str | None
    access: str
    fail_on_data_loss: bool
    columns: tuple[str, ...]
    # The segment server's CURVE keys for this run (None with no server).
    keys: SegmentKeys | None = None


def _read_partition(p: ZioPartition) -> Iterator[pa.RecordBatch]:
    local = p.access == "local" or (
        p.access == "auto" and p.host == socket.gethostname() and os.path.isdir(p.spool_path)
    )
    for producer, start, end in p.ranges:
        try:
            if local or p.server is None or p.keys is None:
                batches = read_sealed(p.spool_path, producer, start, end)
            else:
                batches = fetch_range(p.server, p.keys, producer, start, end)
            for batch in batches:
                yield project(batch, p.columns) if len(p.columns) != len(SPARK_SCHEMA) else batch
        except DataLossError:
            if p.fail_on_data_loss:
                raise
            log.warning(
                "records [%d, %d) of producer %r are gone; skipped (failOnDataLoss=false)",
                start,
                end,
                producer,
            )


@dataclass(frozen=True)
class DirectPartition(InputPartition):  # type: ignore[misc]
    """``readMode=direct``: ranges ``(endpoint, producer, incarnation, start, end)`` a
    task reads straight from the producers, in order (pieces of one producer's range
    are several partitions, small ranges of several producers share one, as
    :func:`~zio_spark.source.plan.pack` cuts them)."""

    ranges: tuple[tuple[str, str, str, int, int], ...]
    fail_on_data_loss: bool
    columns: tuple[str, ...]
    # The ``timestamp`` column: when the driver planned the batch (the same in every
    # retry of the task; the spool path stores when its receiver took the DAT).
    timestamp_us: int
    timeout: float
    mode: str | None
    # The query run's CURVE key pair (Controls.run_curve), admitted by the producers
    # while the run's control flows live; never the source's own secret key.
    curve: Curve | None
    stream: str


def _spark_batch(
    wire: pa.RecordBatch, producer: str, origin: int, timestamp_us: int, columns: tuple[str, ...]
) -> pa.RecordBatch:
    """A range's wire batch as the source's columns (the spool path's values: ``origin``
    the DAT's, ``granule`` null read as 0)."""
    wal = wire_to_wal(wire, origin=origin, timestamp_us=timestamp_us, memory_pool=_POOL)
    n = wal.num_rows
    arrays = {name: wal.column(name) for name in wal.schema.names}
    arrays["producer"] = pa.repeat(pa.scalar(producer, pa.string()), n, memory_pool=_POOL)
    schema = pa.schema([SPARK_SCHEMA.field(c) for c in columns])
    return pa.RecordBatch.from_arrays([arrays[c] for c in columns], schema=schema)


# What one batch handed to Spark gathers of a range's DATs (4,096 records each by
# default): Spark's worker and JVM pay per batch (a struct wrap, an IPC message, a
# vector load) and the column conversion pays per call, so a range is converted and
# handed over in batches of about this size (the last one smaller), at the cost of
# one copy of the records (``concat_batches``). Measured per 65,536 rows of 100 B
# (min of 5 runs of 20 calls, a loaded machine): converting 16 DATs one by one 5.2 ms,
# joined then converted 3.2 ms; Spark's wrap-and-write of 16 batches 3.1 ms, of one
# 0.07 ms.
SPARK_BATCH_ROWS = 65_536
SPARK_BATCH_BYTES = 16 << 20


def _fetch_direct(
    p: DirectPartition, endpoint: str, producer: str, incarnation: str, start: int, end: int
) -> Iterator[pa.RecordBatch]:
    with RangeConnection(
        endpoint, mode=p.mode, curve=p.curve, timeout=p.timeout, stream=p.stream
    ) as conn:
        pending: list[pa.RecordBatch] = []
        rows = size = 0
        origin = None
        for wire in conn.read(producer, incarnation, start, end):
            if pending and conn.origin != origin:  # each batch has one origin
                yield _spark_batch(_concat(pending), producer, origin, p.timestamp_us, p.columns)
                pending, rows, size = [], 0, 0
            origin = conn.origin
            pending.append(wire)
            rows += wire.num_rows
            size += wire.nbytes
            if rows >= SPARK_BATCH_ROWS or size >= SPARK_BATCH_BYTES:
                yield _spark_batch(_concat(pending), producer, origin, p.timestamp_us, p.columns)
                pending, rows, size = [], 0, 0
        if pending:
            assert origin is not None
            yield _spark_batch(_concat(pending), producer, origin, p.timestamp_us, p.columns)


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    if _CONCAT_BATCHES is not None:
        return _CONCAT_BATCHES(batches, memory_pool=_POOL)
    # pyarrow < 19 has no concat_batches: the same through a table.
    (one,) = pa.Table.from_batches(batches).combine_chunks(memory_pool=_POOL).to_batches()
    return one


_CONCAT_BATCHES = getattr(pa, "concat_batches", None)
# The batches a task hands Spark come from glibc (tuned by zio_spark.heap), not Arrow's
# default pool (mimalloc in the wheels): mimalloc gives freed pages back to the kernel
# after 10 ms, and a batch Spark holds longer than that is faulted in afresh each time.
# Measured in a Spark worker reading 2M records (a batch read into Spark's noop writer,
# 2 rounds, load ~11): the workers' kernel CPU per million rows 0.17-0.19 s with the
# default pool, 0.075 s with the system pool.
_POOL = pa.system_memory_pool()


def _read_direct(p: DirectPartition) -> Iterator[pa.RecordBatch]:
    for endpoint, producer, incarnation, start, end in p.ranges:
        try:
            if p.fail_on_data_loss:
                yield from _fetch_direct(p, endpoint, producer, incarnation, start, end)
            else:
                # A refusal can follow records: keep the range whole or not at all.
                yield from list(_fetch_direct(p, endpoint, producer, incarnation, start, end))
        except DataLossError as e:
            if p.fail_on_data_loss:
                raise
            log.warning("zio source (readMode=direct): %s; skipped (failOnDataLoss=false)", e)


class ZioStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    """Micro-batch reader; see the module docstring for which process calls what."""

    def __init__(self, opts: SourceOptions, columns: tuple[str, ...]) -> None:
        self.opts = opts
        self.columns = columns
        self._rt: Runtime | None = None
        self._target: dict[str, int] | None = None
        self._available_now = False
        self._first_waited = False
        self._run_state = RunState()
        self._controls: direct.Controls | None = None
        self._direct_target: dict[str, direct.Position] | None = None
        self._rt_plain: frozenset[str] = frozenset()
        # Direct mode on a Spark that calls latestOffset() without start (< 4.2).
        self._implied = direct.ImpliedStart()
        # Direct mode: this runner planned a batch before (direct.settled_end applies).
        self._planned = False

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for the tasks only (the runner makes its reader afresh): they read
        # with what their partitions carry, so the source's CURVE keys (its secret key)
        # stay on the driver.
        return {
            "opts": replace(self.opts, curve=None),
            "columns": self.columns,
            "_rt": None,
            "_target": None,
            "_available_now": False,
            "_first_waited": False,
            "_run_state": RunState(),
            "_controls": None,
            "_direct_target": None,
            "_rt_plain": frozenset(),
            "_implied": direct.ImpliedStart(),
            "_planned": False,
        }

    @property
    def _direct(self) -> bool:
        return self.opts.read_mode == "direct"

    def _control(self) -> direct.Controls:
        """The direct mode's control flows (made here, never in ``__init__``)."""
        if self._controls is None:
            o = self.opts
            self._controls = direct.Controls(
                o.endpoints,
                mode=None if o.socket == "auto" else o.socket,
                curve=o.curve,
                timeout=o.connect_timeout,
                stream=o.stream,
                zre=o.zre,
                group_port=o.group_port,
            )
            _unwind_on_sigterm(self._controls)
        return self._controls

    def _losses(self, losses: list[direct.Loss]) -> None:
        for loss in losses:
            if loss.end is not None and self.opts.fail_on_data_loss:
                raise DataLossError(loss.text() + " (failOnDataLoss=false reads on without them)")
            log.warning("%s", loss.text())

    def _direct_latest(
        self, start: dict[str, Any] | None, limit: ReadLimit | None
    ) -> dict[str, Any]:
        """``start`` None: a Spark that does not pass it (before 4.2) and no call of
        this runner told it (:class:`~zio_spark.source.direct.ImpliedStart`): a new
        checkpoint, whose first batch starts at the initial offsets. This plans from
        them, and ``initialOffset()``, which such a Spark asks next, answers them."""
        controls = self._control()
        begin, spool_start = direct.split_offsets(start)
        seen = dict(controls.seen)
        held = controls.held()
        direct.check_disjoint(held, spool_start)
        if start is None:
            begin = direct.initial(held)
            self._implied.initial = direct.to_json(begin)  # nothing to ack yet
        else:
            # Spark plans a batch only once the previous one is in its commit log:
            # ``start`` is committed (commit() lags and never comes for availableNow's
            # last batch). After held(): a restarted runner knows each producer's
            # endpoint only then.
            controls.ack(begin)
        if self._available_now:
            self._direct_complete(controls, begin, held)
        if self._available_now and self._direct_target is None:
            # The run's target: what each producer held when it started.
            self._direct_target = {
                p: direct.Position(w.incarnation, w.end) for p, w in held.items()
            }
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        # Givers read through the spool before, not answering yet (a restarted
        # runner): their offsets are kept.
        spool_bases, spool_ends = dict(spool_start), dict(spool_start)
        if self._plain():
            # The givers read through the spool, in the same batch and within the same
            # maxRecordsPerTrigger budget (shared fairly with the direct producers).
            spool_bases, spool_ends = self._spool_wanted(spool_start)
        end, spool_end, losses = direct.latest_with_spool(
            begin,
            held,
            spool_bases,
            spool_ends,
            target=self._direct_target,
            max_rows=max_rows,
            seen=seen,
            # Not a runner's first plan: a run of one batch (Trigger.Once, availableNow
            # before Spark 4.2) reads all that is held, as before the cut existed.
            settle=self._planned,
        )
        self._planned = True
        self._losses(losses)
        out: dict[str, Any] = direct.to_json(end)
        out.update(spool_end)
        return dict(sorted(out.items()))

    def _direct_complete(
        self,
        controls: direct.Controls,
        begin: dict[str, direct.Position],
        held: dict[str, HeldWindow],
    ) -> None:
        """availableNow, direct mode: a run never ends short of a producer silently. An
        endpoint that gave no held window when the run started, or a producer that owes
        the run records and no longer answers (each asked twice, up to connectTimeout
        each), is a problem: the run fails (``failOnDataLoss``), else a WARN."""
        fail = self.opts.fail_on_data_loss
        if self._direct_target is None and controls.zre is not None and not controls.endpoints:
            zre = controls.zre
            self._run_state.problem(
                zre.group,
                f"zio source (readMode=direct): no producer advertised a flow port in ZRE "
                f"group {zre.group!r} (beacon port {zre.beacon_port}) when the "
                "availableNow run started; the run would end with nothing. Start the "
                "producers first (check zreBroadcast/zreInterface where UDP broadcast is "
                "blocked), or set failOnDataLoss=false to run without them",
                fail,
            )
        if self._direct_target is None:
            for endpoint, why in sorted(controls.down.items()):
                self._run_state.problem(
                    endpoint,
                    f"zio source (readMode=direct): {endpoint} gave no held window when "
                    f"the availableNow run started ({why}); the run would end without "
                    "its records. Start the producer first, or set failOnDataLoss=false "
                    "to run without it",
                    fail,
                )
            return
        for p in direct.owed(begin, self._direct_target, held):
            t = self._direct_target[p]
            self._run_state.problem(
                p,
                f"zio source (readMode=direct): producer {p!r} "
                f"({controls.where.get(p, 'no endpoint')}) held records up to "
                f"{t.end - 1} when the availableNow run started; the run has read up to "
                f"{begin[p].end - 1} and the producer no longer answers "
                f"({controls.down.get(controls.where.get(p, ''), 'no answer')}). "
                "Restart the producer, or set failOnDataLoss=false to end the run "
                "without them",
                fail,
            )

    def _runtime(self) -> Runtime:
        if self._rt is None:
            opts = self.opts
            if self._direct:
                # Direct mode: the receiver takes the givers without the range capability
                # only (no group watcher of its own: Controls' discovery hands them
                # over); those with another socket mode, and later ones, :meth:`_plain`
                # adds.
                controls = self._control()
                plain = tuple(
                    sorted(e for e in controls.plain if controls.mode_of(e) == controls.mode)
                )
                opts = replace(opts, endpoints=plain, zre=None, read_mode="spool")
                self._rt_plain = frozenset(plain)
            self._rt = Runtime(opts)
            _unwind_on_sigterm(self._rt)
            if self._direct:
                self._plain()
        return self._rt

    def _plain(self) -> bool:
        """Direct mode: whether some endpoints are read through the spool (their givers
        do not state the range capability); the spool runtime is made for them on the
        first need. A giver found plain later (its endpoint answered late, or discovery
        found it) joins the receiver at once, as a producer found by a spool-mode
        ``group`` does: its records are read from the next batch on; one that left the
        group is let go by the receiver (its offset stays)."""
        controls = self._control()
        plain = frozenset(controls.plain)
        if self._rt is not None and plain != self._rt_plain:
            receiver = self._rt.receiver
            joined = plain - self._rt_plain
            for endpoint in sorted(joined):
                log.info("zio source (readMode=direct): %s is read through the spool", endpoint)
                receiver.add_endpoint(endpoint, controls.mode_of(endpoint))
            for endpoint in sorted(self._rt_plain - plain):
                receiver.remove_endpoint(endpoint)
            self._rt_plain = plain
            # The receiver's loop adds them: once it did, the spool path's completeness
            # rules (availableNow) count them.
            deadline = time.monotonic() + self.opts.connect_timeout
            while not joined <= set(receiver.endpoints()):
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"zio source (readMode=direct): the receiver did not take "
                        f"{sorted(joined - set(receiver.endpoints()))} within "
                        f"connectTimeout ({self.opts.connect_timeout:g} s)"
                    )
                time.sleep(0.01)
        return bool(plain)

    # -- Spark hooks -----------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        if self._direct:
            out: dict[str, Any] = self._implied.initial or direct.to_json(
                direct.initial(self._control().held())
            )
            if self._plain():
                out.update(plan.sorted_offsets(self._runtime().spool.committed()))
            return dict(sorted(out.items()))
        rt = self._runtime()
        return plan.sorted_offsets(rt.spool.committed())

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records_per_trigger is not None:
            return ReadMaxRows(self.opts.max_records_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """An availableNow run: each ``latestOffset`` waits for the producers
        (:meth:`_available`) instead of returning what is there. Direct mode: the run
        reads up to what each producer held at its first ``latestOffset``."""
        if self._direct:
            self._available_now = True
            self._direct_target = None
            self._target = None
            self._run_state = RunState()
            return
        self._runtime()
        self._available_now = True
        self._target = None
        self._run_state = RunState()

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: ReadLimit | None = None
    ) -> dict[str, Any]:
        # Spark < 4.2 calls latestOffset() with no arguments (compat.HAS_ADMISSION_CONTROL
        # false); 4.2+ passes both, as it sees from this signature.
        if self._direct:
            return self._direct_latest(start, limit)
        return self._spool_latest(start or {}, limit)

    def _spool_latest(self, start: dict[str, Any], limit: ReadLimit | None) -> dict[str, int]:
        """The spool mode's next batch: :func:`~zio_spark.source.plan.latest_end` (the
        ``maxRecordsPerTrigger`` budget shared fairly), the function its tests exercise."""
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        ends, committed = self._spool_ends(start)
        return plan.latest_end(start, ends, committed, max_rows)

    def _spool_wanted(self, start: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """The spool path's next batch before ``maxRecordsPerTrigger``: each producer's
        base and the end it could reach (:func:`~zio_spark.source.plan.wanted_ends`)."""
        return plan.wanted_ends(start, *self._spool_ends(start))

    def _spool_ends(self, start: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """What the spool path's next batch could reach (the sealed ends, or the
        availableNow target) and the spool's committed offsets."""
        rt = self._runtime()
        check(rt, self.opts)
        # Spark plans a batch only once the previous one is in its commit log, so
        # ``start`` is done with, whether or not commit() came for it (it lags, and
        # never comes for an availableNow run's last batch). Counted as backlog, records
        # below it could fill maxBacklog: no credit, no data, no batch, no commit().
        if start:
            rt.receiver.commit({p: int(v) for p, v in start.items()})
        if self._target is not None:
            ends = dict(self._target)
        elif self._available_now:
            ends, final = available(rt, self.opts, self._run_state)
            if final:
                self._target = dict(ends)
        else:
            if not self._first_waited:
                self._first_waited = True
                one_batch = not compat.HAS_TRIGGER_AVAILABLE_NOW
                wait_first(rt, self.opts, self._run_state, one_batch=one_batch)
            ends = rt.spool.seal()
        return ends, rt.spool.committed()

    def reportLatestOffset(self) -> dict[str, Any]:
        if self._controls is not None:
            held = {
                "heldWindows": {
                    p: {"first": w.first, "end": w.end, "incarnation": w.incarnation}
                    for p, w in sorted(self._controls.seen.items())
                }
            }
            return {**(self._rt.report() if self._rt is not None else {}), **held}
        if self._rt is None:
            return {}
        return self._rt.report()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if self._direct:
            return self._direct_partitions(start, end)
        return self._spool_partitions(start, end)

    def _spool_partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[ZioPartition]:
        rt = self._runtime()
        ranges = plan.partition_ranges(start, end, rt.spool.committed())
        return [
            ZioPartition(
                group,
                self.opts.spool_path,
                socket.gethostname(),
                rt.server_endpoint(),
                self.opts.spool_access,
                self.opts.fail_on_data_loss,
                self.columns,
                rt.server_keys(),
            )
            for group in plan.pack(
                ranges, self.opts.max_records_per_partition, self.opts.min_partitions
            )
        ]

    def _direct_partitions(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> list[InputPartition]:
        controls = self._control()
        begin, spool_start = direct.split_offsets(start)
        finish, spool_end = direct.split_offsets(end)
        spooled: list[InputPartition] = []
        if any(spool_end[p] > max(spool_start.get(p, 1), 1) for p in spool_end):
            if not controls.plain:
                controls.held()  # a restarted runner: learn which givers are plain
            if not self._plain():
                raise TransportError(
                    "zio source (readMode=direct): this batch reads givers through the "
                    f"spool ({sorted(spool_end)}), but none of {list(self.opts.endpoints)} "
                    "answered as such a giver yet; restart the query once they are back"
                )
            spooled = list(self._spool_partitions(spool_start, spool_end))
        switched = [
            p for p, e in finish.items() if p in begin and begin[p].incarnation != e.incarnation
        ]
        if any(p not in controls.seen for p in switched):
            controls.held()  # a restarted runner: learn each producer's incarnation now
        for p in direct.stale_plan(begin, finish, controls.seen):
            text = (
                f"zio source (readMode=direct): this batch was planned to read producer "
                f"{p!r} up to {finish[p].end - 1} numbered as incarnation "
                f"{finish[p].incarnation!r}, but the producer now numbers its records as "
                f"{controls.seen[p].incarnation!r}: it restarted without them, so they are "
                "lost"
            )
            if self.opts.fail_on_data_loss:
                raise DataLossError(text + " (failOnDataLoss=false reads on without them)")
            log.warning("%s", text)
        ranges = direct.batch_ranges(begin, finish)
        if any(p not in controls.where for p in ranges):
            controls.held()  # a restarted runner: learn which endpoint serves which id
        missing = sorted(p for p in ranges if p not in controls.where)
        if missing:
            raise TransportError(
                f"zio source (readMode=direct): no endpoint of {list(self.opts.endpoints)} "
                f"answers for producer(s) {missing} of this batch; their ranges cannot be "
                "read now (the query can be restarted once they are back)"
            )
        o = self.opts
        planned = time.time_ns() // 1000
        # The run's key pair, never the source's secret (docs/direct-read.md, Security).
        curve = controls.task_curve(controls.where[p] for p in ranges)
        # A task reads with one socket mode: producers found by discovery may advertise
        # another socket type than the rest, so their ranges are packed apart.
        by_mode: dict[str | None, dict[str, tuple[str, int, int]]] = {}
        for p, r in ranges.items():
            by_mode.setdefault(controls.mode_of(controls.where[p]), {})[p] = r
        return spooled + [
            DirectPartition(
                tuple((controls.where[p], p, inc, s, e) for p, inc, s, e in group),
                o.fail_on_data_loss,
                self.columns,
                planned,
                o.connect_timeout,
                mode,
                curve,
                o.stream,
            )
            for mode, some in sorted(by_mode.items(), key=lambda kv: str(kv[0]))
            for group in direct.pack(some, o.max_records_per_partition, o.min_partitions)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        heap.freeze_gc()  # the worker's gc.collect() after each task skips the modules
        return _read_any(partition)

    def commit(self, end: dict[str, Any]) -> None:
        if self._direct:
            finish, spool_end = direct.split_offsets(end)
            self._control().ack(finish)
            if spool_end:
                self._runtime().receiver.commit(spool_end)
            return
        rt = self._runtime()
        rt.receiver.commit({p: int(v) for p, v in end.items()})

    def stop(self) -> None:
        if self._controls is not None:
            self._controls.terminating = True
            self._controls.close()
        if self._rt is not None:
            self._rt.terminating = True  # a SIGTERM now must not cut the stop short
            self._rt.stop()


class ZioBatchReader(DataSourceReader):  # type: ignore[misc]
    """``spark.read.format("zio")``: read a bounded flow into a private spool, then scan it.

    Ends when every producer has sent EOT, or ``maxRecords`` records arrived, or ``timeout``
    passed (default: ``connectTimeout``). Records read are acknowledged to the producers;
    records beyond ``maxRecords`` are not, so ack-capable producers keep them.
    """

    def __init__(self, opts: SourceOptions, columns: tuple[str, ...]) -> None:
        self.opts = opts
        self.columns = columns

    def partitions(self) -> Sequence[InputPartition]:
        """Receive into a private spool until the flows end (``maxRecords``, ``timeout``).

        Raises
        ------
        TransportError
            If a producer could not be read (naming its endpoint and the cause): it
            refused or broke the flow, never answered, or cannot talk to our socket kind.
        DataLossError
            If records are known lost and ``failOnDataLoss`` is true.
        """
        opts = self.opts
        path, ranges = batch_receive(opts)
        return [
            ZioPartition(
                group,
                path,
                socket.gethostname(),
                None,
                "local",
                opts.fail_on_data_loss,
                self.columns,
            )
            for group in plan.pack(ranges, opts.max_records_per_partition, opts.min_partitions)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        heap.freeze_gc()  # the worker's gc.collect() after each task skips the modules
        return _read_any(partition)


def _read_any(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    heap.tune()  # the worker's large buffers reused, not faulted in (zio_spark.heap)
    # No partitions planned (nothing arrived): PySpark still runs one task, with a bare
    # InputPartition(None). It reads nothing.
    if isinstance(partition, DirectPartition):
        return _read_direct(partition)
    if not isinstance(partition, ZioPartition):
        return iter(())
    return _read_partition(partition)
