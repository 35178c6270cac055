"""``spark.readStream.format("zio")`` and ``spark.read.format("zio")``.

Two reader instances exist (FACTS.md): the long-lived *runner* on the driver calls
``initialOffset``/``latestOffset``/``partitions``/``commit``; executors get a pickled
copy and call ``read``. So the reader keeps only its parsed options until a runner-only
method first needs the receiver: the spool, the receiver thread and its sockets (and the
segment server for remote executors) are created then, never in ``__init__``, and are
left out of pickles.

Offsets are ``{"<producer id>": next_seq}`` with sorted keys (Spark compares them as
JSON strings): every record of that producer with ``seq < next_seq`` is covered.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from zio_spark.codec.schema import DEFAULT_SCHEMA, SPARK_SCHEMA, SPARK_TYPES
from zio_spark.errors import ConfigError, DataLossError, TransportError
from zio_spark.options import SourceOptions
from zio_spark.source import plan
from zio_spark.source.receiver import Receiver
from zio_spark.source.sealer import Sealer
from zio_spark.source.spool_server import SegmentKeys, SegmentServer, driver_host, fetch_range
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
from zio_spark.storage.spool import Spool, project, read_sealed

if TYPE_CHECKING:  # imported where a group is used: ZRE costs ~0.1-0.3 s to import
    from zio_spark.transport.discovery import GroupWatcher

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


class _Inlet:
    """The receiver of one reader and the group watcher that feeds it endpoints.

    Built in one place (:func:`_inlet`) for the stream and the batch reader, so every
    documented option means the same in both.
    """

    def __init__(self, receiver: Receiver, watcher: GroupWatcher | None) -> None:
        self.receiver = receiver
        self.watcher = watcher

    def stop(self) -> bool:
        """Stop the watcher, then the receiver: True once the receiver thread ended
        (:meth:`Receiver.stop`); only then may the spool be closed."""
        if self.watcher is not None:
            self.watcher.stop()
        return self.receiver.stop()


def _inlet(opts: SourceOptions, spool: Spool, *, reconnect: bool) -> _Inlet:
    """Start a receiver for ``opts`` (endpoints, group or bind; CURVE; socket kind).

    Raises
    ------
    TransportError
        If a ``bind`` endpoint cannot be bound, naming it.
    """
    curve = None
    if opts.curve is not None:
        curve = (opts.curve.server_key, opts.curve.public_key, opts.curve.secret_key)
    mode = None if opts.socket == "auto" else opts.socket
    receiver = Receiver(
        spool,
        opts.endpoints,
        credit=opts.credit,
        max_backlog=opts.max_backlog,
        stream=opts.stream,
        connect_timeout=opts.connect_timeout,
        mode=mode,
        curve=curve,
        reconnect=reconnect,
        bind=opts.bind,
    ).start()
    watcher: GroupWatcher | None = None
    if opts.zre is not None:
        from zio_spark.transport.discovery import GroupWatcher

        try:
            watcher = GroupWatcher(
                opts.zre,
                receiver.add_endpoint,
                receiver.remove_endpoint,
                requested_mode=mode,
                port_name=opts.group_port,
            ).start()
        except BaseException:
            receiver.stop()
            raise
    return _Inlet(receiver, watcher)


class _Runtime:
    """The runner-side state of a stream reader (never pickled)."""

    def __init__(self, opts: SourceOptions) -> None:
        if not opts.spool_path_given:
            log.warning(
                "zio source: spool at %s (no spoolPath given); on a cluster set spoolPath to "
                "a shared folder or let executors fetch through spoolAccess=remote",
                opts.spool_path,
            )
        self.spool = Spool(opts.spool_path, on_gap="raise" if opts.fail_on_data_loss else "accept")
        try:
            self.inlet = _inlet(opts, self.spool, reconnect=True)
        except BaseException:
            self.spool.close()
            raise
        self.receiver = self.inlet.receiver
        self.server: SegmentServer | None = None
        if opts.spool_access != "local":
            # Executors on other hosts must reach it, and no one else: it listens on the
            # driver's Spark host address unless spoolServerHost says otherwise, and
            # admits only this run's reader key (carried in the partitions).
            if opts.spool_server_host:
                host, why = opts.spool_server_host, "spoolServerHost"
            else:
                host, why = driver_host()
            try:
                self.server = SegmentServer(opts.spool_path, host)
            except BaseException:
                self.inlet.stop()
                self.spool.close()
                raise
            log.info(
                "zio source: segment server on %s (host from %s), CURVE on",
                self.server.endpoint,
                why,
            )
        # Seals while Spark runs a batch, so latestOffset seals only the latest records.
        self.sealer = Sealer(self.spool).start()
        self.stopped = False
        self.terminating = False  # SIGTERM seen, or stop() begun (see _runtime)

    def server_endpoint(self) -> str | None:
        return None if self.server is None else self.server.endpoint

    def server_keys(self) -> SegmentKeys | None:
        return None if self.server is None else self.server.keys

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        ended = self.inlet.stop()
        self.sealer.stop()
        if self.server is not None:
            self.server.stop()
        if ended:  # never under a receiver thread still appending (it logged why)
            self.spool.close()


# The most a query's first latestOffset waits for the first records (_wait_first).
_FIRST_WAIT = 1.0


class _RunState:
    """One run's completeness rules (:class:`~zio_spark.source.plan.Completeness`, made
    on first use) and what its checks said already (each problem and note once)."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._progress_at = 0.0
        self._rules: plan.Completeness | None = None

    def completeness(self, opts: SourceOptions) -> plan.Completeness:
        if self._rules is None:
            self._rules = plan.Completeness(opts.connect_timeout, opts.plain_giver_quiet)
        return self._rules

    def problem(self, key: str, text: str, fail: bool) -> None:
        """An incomplete run: raise (``failOnDataLoss``), else log it once."""
        if fail:
            raise TransportError(text)
        if f"problem:{key}" not in self._said:
            self._said.add(f"problem:{key}")
            log.warning("%s (failOnDataLoss=false: the run goes on without it)", text)

    def warn(self, key: str, text: str) -> None:
        """A first batch that goes on without some records: a WARN, once (on Spark
        4.0/4.1 an availableNow run is this one batch: never a silent short run)."""
        if f"problem:{key}" not in self._said:
            self._said.add(f"problem:{key}")
            log.warning("%s (the first batch goes on without them)", text)

    def once(self, key: str, fmt: str, *args: object) -> None:
        if f"note:{key}" not in self._said:
            self._said.add(f"note:{key}")
            log.info(fmt, *args)

    def say(self, awaited: list[str]) -> None:
        """What the run waits for, logged every 10 s while it waits (progress only)."""
        now = time.monotonic()
        if now - self._progress_at >= 10.0:
            if self._progress_at:
                log.info("zio source: waiting for %s", "; ".join(awaited))
            self._progress_at = now


class ZioStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    """Micro-batch reader; see the module docstring for which process calls what."""

    def __init__(self, opts: SourceOptions, columns: tuple[str, ...]) -> None:
        self.opts = opts
        self.columns = columns
        self._rt: _Runtime | None = None
        self._target: dict[str, int] | None = None
        self._available_now = False
        self._first_waited = False
        self._run_state = _RunState()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "opts": self.opts,
            "columns": self.columns,
            "_rt": None,
            "_target": None,
            "_available_now": False,
            "_first_waited": False,
            "_run_state": _RunState(),
        }

    def _runtime(self) -> _Runtime:
        if self._rt is None:
            self._rt = _Runtime(self.opts)
            if threading.current_thread() is threading.main_thread():
                previous = signal.getsignal(signal.SIGTERM)

                # SIGTERM (Spark ending the runner) unwinds the main thread, so the
                # runner's own ``finally: reader.stop()`` closes the receiver and the
                # spool. The handler itself must not stop anything: it runs between any
                # two bytecodes of the main thread, which may hold a spool lock (a
                # commit in progress); stopping from there deadlocked, and the runner
                # outlived its JVM. It unwinds once: Spark may signal again while that
                # ``finally`` runs, and a second SystemExit there cut the stop short
                # before the EOTs' echoes came (the giver's flow left open).
                rt = self._rt

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
        return self._rt

    def _check(self, rt: _Runtime) -> None:
        if rt.sealer.error is not None:
            raise rt.sealer.error
        if rt.receiver.fatal is not None and self.opts.fail_on_data_loss:
            raise rt.receiver.fatal
        if rt.receiver.error is not None:
            raise rt.receiver.error

    # -- Spark hooks -----------------------------------------------------------------

    def initialOffset(self) -> dict[str, int]:
        rt = self._runtime()
        return plan.sorted_offsets(rt.spool.committed())

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records_per_trigger is not None:
            return ReadMaxRows(self.opts.max_records_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """An availableNow run: each ``latestOffset`` waits for the producers
        (:meth:`_available`) instead of returning what is there."""
        self._runtime()
        self._available_now = True
        self._target = None
        self._run_state = _RunState()

    def _available(self, rt: _Runtime) -> dict[str, int]:
        """availableNow: the end of the next batch, once the producers' state says it.

        The run's end is what is stored once every producer has given what it held when
        the run started (:meth:`_awaited`): a zio-spark producer states its position in
        its BOT reply, a plain giver cannot and is taken as done after
        ``plainGiverQuiet`` without records. Until then, once ``plan.STEP`` records wait
        beyond the last batch, or maxBacklog holds a producer back, what is stored is a
        batch of its own: Spark processes it while the rest arrives, and its commit
        frees the backlog.
        """
        while True:
            self._check(rt)
            awaited = self._awaited(rt, plain=True, strict=True)
            if not awaited:
                break
            waiting = sum(rt.spool.backlog().values())
            if plan.is_step(waiting, waiting > 0 and bool(rt.receiver.held_back())):
                return rt.spool.seal()  # a step on the way, not the end
            self._run_state.say(awaited)
            time.sleep(0.02)  # the runner waits for producers; not a test wait
        self._target = rt.spool.seal()
        done = plan.sorted_offsets(self._target)
        log.info("zio source: availableNow run complete at %s", done)
        return dict(self._target)

    def _awaited(
        self,
        rt: _Runtime,
        *,
        plain: bool,
        strict: bool,
        reach: float | None = None,
        warn: bool = False,
        cap: float | None = None,
    ) -> list[str]:
        """What the producers still owe the run (empty: every one gave what it held when
        the run started), decided by protocol state: see
        :meth:`Completeness.check <zio_spark.source.plan.Completeness.check>`.

        Its problems are raised with ``failOnDataLoss`` (the default), else logged once;
        its warnings are logged once as a WARN.
        """
        recv, state = rt.receiver, self._run_state
        now = recv.clock()
        status = recv.status()
        positions = recv.stated_positions()
        stored = {p: rt.spool.next_seq(p) - 1 for p in positions}
        held_back = frozenset(recv.held_back())
        withheld = {p: h.get("withheldMs", 0) for p, h in recv.holdups().items()}
        view = plan.RunView(
            now=now,
            started_at=recv.started_at,
            looked_at=recv.looked_at,
            status=status,
            positions=positions,
            stored=stored,
            named=frozenset(recv.endpoints()),
            bound=tuple(recv.bound_endpoints()),
            held_back=held_back,
            withheld_ms=withheld,
            why_no_flow=recv.why_no_flow,
        )
        verdict = state.completeness(self.opts).check(
            view, plain=plain, strict=strict, reach=reach, warn=warn, cap=cap
        )
        for key, text in verdict.problems:
            state.problem(key, text, self.opts.fail_on_data_loss)
        for key, text in verdict.warnings:
            state.warn(key, text)
        for endpoint, quiet, records in verdict.done_quiet:
            state.once(
                endpoint,
                "zio source: plain giver %s brought nothing for %.1f s after %d records "
                "(plainGiverQuiet %g s): taken as having given all it held",
                endpoint,
                quiet,
                records,
                self.opts.plain_giver_quiet,
            )
        return verdict.awaited

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: ReadLimit | None = None
    ) -> dict[str, int]:
        # Spark < 4.2 calls latestOffset() with no arguments (compat.HAS_ADMISSION_CONTROL
        # false); 4.2+ passes both, as it sees from this signature.
        start = start or {}
        rt = self._runtime()
        self._check(rt)
        # Spark plans a batch only once the previous one is in its commit log, so
        # ``start`` is done with, whether or not commit() came for it (it lags, and
        # never comes for an availableNow run's last batch). Counted as backlog, records
        # below it could fill maxBacklog: no credit, no data, no batch, no commit().
        if start:
            rt.receiver.commit({p: int(v) for p, v in start.items()})
        if self._target is not None:
            ends = dict(self._target)
        elif self._available_now:
            ends = self._available(rt)
        else:
            if not self._first_waited:
                self._first_waited = True
                self._wait_first(rt)
            ends = rt.spool.seal()
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return plan.latest_end(start, ends, rt.spool.committed(), max_rows)

    def _wait_first(self, rt: _Runtime) -> None:
        """A run's first ``latestOffset`` (no availableNow preparation): wait until each
        producer that states its position has given what it held at connect
        (:meth:`_awaited`), or maxBacklog holds it back, or ``plan.STEP`` records wait.

        Spark 4.0/4.1 run an availableNow query as this one batch (no
        ``prepareForTriggerAvailableNow``): there the wait covers plain givers too
        (``plainGiverQuiet``), so the batch holds everything the producers held when the
        run started, up to ``maxBacklog`` records per producer. There every query has
        this wait (a processingTime stream too), so a giver stating no position that
        keeps giving is awaited at most ``connectTimeout`` from its flow's start (then a
        WARN), and whatever the batch goes on without is a WARN too. A stating producer
        whose flow is down is awaited ``connectTimeout`` (then a WARN) on any Spark. On
        4.2+ a plain giver's first records are awaited at most :data:`_FIRST_WAIT` s: a
        latency choice for the first batch (Spark runs it whatever offsets it gets,
        paying ~2 s of worker start-up), never a completeness decision; later batches
        take the rest.
        """
        one_batch = not compat.HAS_TRIGGER_AVAILABLE_NOW
        # A stream (4.2+) picks up a producer that is slow to connect in a later batch:
        # its first batch waits for connections only briefly (a latency choice).
        reach = None if one_batch else min(self.opts.connect_timeout, _FIRST_WAIT)
        cap = self.opts.connect_timeout if one_batch else None
        while True:
            self._check(rt)
            awaited = self._awaited(
                rt, plain=one_batch, strict=False, reach=reach, warn=one_batch, cap=cap
            )
            if not awaited:
                break
            waiting = sum(rt.spool.backlog().values())
            if plan.is_step(waiting, waiting > 0 and bool(rt.receiver.held_back())):
                return
            self._run_state.say(awaited)
            time.sleep(0.01)  # the runner waits for producers; not a test wait
        if one_batch:
            return
        deadline = time.monotonic() + min(_FIRST_WAIT, self.opts.connect_timeout)
        while time.monotonic() < deadline and not any(rt.spool.backlog().values()):
            self._check(rt)
            time.sleep(0.01)  # the runner waits for producers; not a test wait

    def reportLatestOffset(self) -> dict[str, Any]:
        if self._rt is None:
            return {}
        backlog = self._rt.spool.backlog()
        report: dict[str, Any] = {"backlog": backlog}
        # Who holds whom back, per producer (ms): the source withholding credit for
        # maxBacklog, and the producer's own wait for acks (as it states it).
        holdups = self._rt.receiver.holdups()
        report["heldBackMs"] = {
            p: holdups.get(p, {}).get("withheldMs", 0) for p in sorted(backlog.keys() | holdups)
        }
        blocked = {p: h["blockedMs"] for p, h in sorted(holdups.items()) if "blockedMs" in h}
        if blocked:
            report["producerBlockedMs"] = blocked
        if self._rt.server is not None:  # remote executors: reads served so far
            report["segmentRequests"] = self._rt.server.requests
        return report

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
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
            for group in plan.pack(ranges, self.opts.max_records_per_partition)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read_any(partition)

    def commit(self, end: dict[str, int]) -> None:
        rt = self._runtime()
        rt.receiver.commit({p: int(v) for p, v in end.items()})

    def stop(self) -> None:
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
        path = os.path.join(opts.spool_path, f"batch-{uuid.uuid4().hex}")
        spool = Spool(path, on_gap="raise" if opts.fail_on_data_loss else "accept")
        try:
            inlet = _inlet(opts, spool, reconnect=False)
        except BaseException:
            spool.close()
            raise
        recv = inlet.receiver
        ended: bool | None = None  # the receiver thread ended (then the spool may close)
        try:
            timeout = opts.timeout or opts.connect_timeout
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if recv.fatal is not None and opts.fail_on_data_loss:
                    raise recv.fatal
                if recv.error is not None:
                    raise recv.error
                status = recv.status()
                total = sum(s.records for s in status)
                if opts.max_records is not None and total >= opts.max_records:
                    break
                # With bind, giver clients may connect at any time: the read lasts
                # ``timeout`` (or ``maxRecords``), whoever ended before.
                if not opts.bind and status and all(s.state in ("ended", "failed") for s in status):
                    break
                time.sleep(0.02)  # waiting on producers, bounded by the deadline
            _raise_failed(recv, timeout)
            ends = spool.seal()
            budget = opts.max_records
            committed = spool.committed()
            starts = {p: plan.base(p, {}, committed) for p in ends}
            if budget is not None:
                ends, budget = plan.take_rows(starts, ends, budget)
            # The records stay in this private spool for read(); only the producers hear
            # that they are safe (an ack), so ack-capable ones can forget them. Acks go
            # on open flows: before the EOTs.
            recv.acknowledge(ends)
            recv.flush_acks(timeout=min(5.0, opts.connect_timeout))
            # End the flows. A plain giver sends what it had credit for until our EOT
            # reaches it, and its echo tells it all arrived: those records are in the
            # result (sealed after the receiver ended), never dropped with this spool.
            # An ack-capable producer's late records were not acked: it keeps them.
            ended = inlet.stop()
            if not ended:
                raise TransportError(
                    "zio batch read failed: the receiver did not end the flows within "
                    f"{recv.stop_bound():.0f} s, so what arrived meanwhile cannot be sealed"
                )
            starts, ends = _take_plain(recv, spool, starts, ends, budget, opts.max_records)
        finally:
            if ended is None:
                ended = inlet.stop()
            if ended:  # never under a receiver thread still appending (it logged why)
                spool.close()
        ranges = {p: (starts[p], e) for p, e in ends.items()}
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
            for group in plan.pack(ranges, opts.max_records_per_partition)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read_any(partition)


def _read_any(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    # No partitions planned (nothing arrived): PySpark still runs one task, with a bare
    # InputPartition(None). It reads nothing.
    if not isinstance(partition, ZioPartition):
        return iter(())
    return _read_partition(partition)


def _take_plain(
    recv: Receiver,
    spool: Spool,
    starts: dict[str, int],
    ends: dict[str, int],
    budget: int | None,
    max_records: int | None,
) -> tuple[dict[str, int], dict[str, int]]:
    """A batch read's flows have ended: ``(starts, ends)`` with the ends of plain givers
    (no acks) extended to all they gave, within ``budget`` (what ``maxRecords`` leaves;
    :func:`~zio_spark.source.plan.extend_plain`).

    A plain giver has no acks: what reached the spool is confirmed to it (by our credit,
    then the echo of our EOT), so it is in the result or (beyond ``maxRecords``) logged
    as not taken: the giver does not keep it."""
    plain = {st.producer for st in recv.status() if st.producer and not st.ack_capable}
    taken = plan.extend_plain(plain, spool.seal(), spool.committed(), starts, ends, budget)
    for p, left in sorted(taken.left.items()):
        log.warning(
            "zio batch read: %d records of plain giver %s are beyond maxRecords %s: "
            "not in the result, and a plain giver does not keep them",
            left,
            p,
            max_records,
        )
    return taken.starts, taken.ends


def _raise_failed(recv: Receiver, timeout: float) -> None:
    """A batch read must not return a silent partial result: raise for every producer
    endpoint that was never read or whose flow failed."""
    if recv.error is not None:
        raise recv.error
    problems = []
    named = set(recv.endpoints())  # a bound port's client flows come and go: logged only
    for st in recv.status():
        if st.endpoint not in named:
            continue
        if st.state == "failed":
            problems.append(f"{st.endpoint}: {st.last_error}")
        elif st.state in ("connecting", "waiting"):
            why = recv.why_no_flow(st.endpoint) or st.last_error or "no BOT answered ours"
            problems.append(f"no flow within {timeout:g} s: {why}")
    if problems:
        raise TransportError("zio batch read failed: " + "; ".join(problems))
