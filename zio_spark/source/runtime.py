"""The runner side of ``spark.readStream.format("zio")`` and ``spark.read.format("zio")``.

The Spark hooks (:mod:`zio_spark.spark.source`) call down here for everything that is not
Spark's: the receiver and the group watcher that feeds it endpoints (:class:`Inlet`), a
stream reader's runner state (:class:`Runtime`: spool, receiver, segment server, sealer),
the waits of a run's first batch and of an availableNow run (:func:`wait_first`,
:func:`available`), and a batch read's receive loop (:func:`batch_receive`).

No pyspark here: the streaming runner imports little at start, and what depends on the
Spark version (availableNow support) is passed in by the caller.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from zio_spark import heap
from zio_spark.errors import TransportError
from zio_spark.options import SourceOptions
from zio_spark.source import plan
from zio_spark.source.receiver import Receiver
from zio_spark.source.sealer import Sealer
from zio_spark.source.spool_server import SegmentKeys, SegmentServer, driver_host
from zio_spark.storage.spool import Spool

if TYPE_CHECKING:  # imported where a group is used: ZRE costs ~0.1-0.3 s to import
    import zmq

    from zio_spark.transport.discovery import GroupWatcher

__all__ = [
    "FIRST_WAIT",
    "Inlet",
    "RunState",
    "Runtime",
    "available",
    "awaited",
    "batch_receive",
    "check",
    "start_inlet",
    "wait_first",
]

log = logging.getLogger("zio_spark.source")


class Inlet:
    """The receiver of one reader and the group watcher that feeds it endpoints.

    Built in one place (:func:`start_inlet`) for the stream and the batch reader, so every
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


def start_inlet(
    opts: SourceOptions,
    spool: Spool,
    *,
    reconnect: bool,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    plain_budget: int | None = None,
) -> Inlet:
    """Start a receiver for ``opts`` (endpoints, group or bind; CURVE; socket kind), on
    ``ctx`` (default: the process's shared context; tests pass a tracked one);
    ``plain_budget``: a batch read's ``maxRecords`` (the receiver's ``plain_budget``).

    Raises
    ------
    TransportError
        If a ``bind`` endpoint cannot be bound, naming it.
    """
    mode = None if opts.socket == "auto" else opts.socket
    receiver = Receiver(
        spool,
        opts.endpoints,
        credit=opts.credit,
        max_backlog=opts.max_backlog,
        stream=opts.stream,
        connect_timeout=opts.connect_timeout,
        mode=mode,
        curve=opts.curve,
        reconnect=reconnect,
        bind=opts.bind,
        ctx=ctx,
        plain_budget=plain_budget,
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
    return Inlet(receiver, watcher)


class Runtime:
    """The runner-side state of a stream reader (never pickled)."""

    def __init__(self, opts: SourceOptions) -> None:
        heap.tune()  # the receiver's DATs and the spool's segments (zio_spark.heap)
        if not opts.spool_path_given:
            log.warning(
                "zio source: spool at %s (no spoolPath given); on a cluster set spoolPath to "
                "a shared folder or let executors fetch through spoolAccess=remote",
                opts.spool_path,
            )
        self.spool = Spool(opts.spool_path, on_gap="raise" if opts.fail_on_data_loss else "accept")
        try:
            self.inlet = start_inlet(opts, self.spool, reconnect=True)
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
        self.terminating = False  # SIGTERM seen, or stop() begun (see the stream reader)

    def server_endpoint(self) -> str | None:
        return None if self.server is None else self.server.endpoint

    def server_keys(self) -> SegmentKeys | None:
        return None if self.server is None else self.server.keys

    def report(self) -> dict[str, Any]:
        """What the stream reader reports with its latest offset: the backlog, who holds
        whom back, and the segment server's reads."""
        backlog = self.spool.backlog()
        report: dict[str, Any] = {"backlog": backlog}
        # Who holds whom back, per producer (ms): the source withholding credit for
        # maxBacklog, and the producer's own wait for acks (as it states it).
        holdups = self.receiver.holdups()
        report["heldBackMs"] = {
            p: holdups.get(p, {}).get("withheldMs", 0) for p in sorted(backlog.keys() | holdups)
        }
        blocked = {p: h["blockedMs"] for p, h in sorted(holdups.items()) if "blockedMs" in h}
        if blocked:
            report["producerBlockedMs"] = blocked
        if self.server is not None:  # remote executors: reads served so far
            report["segmentRequests"] = self.server.requests
        return report

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


# The most a query's first latestOffset waits for the first records (wait_first).
FIRST_WAIT = 1.0


class RunState:
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


def check(rt: Runtime, opts: SourceOptions) -> None:
    """Raise what the sealer or the receiver failed with (a receiver's fatal error only
    with ``failOnDataLoss``)."""
    if rt.sealer.error is not None:
        raise rt.sealer.error
    if rt.receiver.fatal is not None and opts.fail_on_data_loss:
        raise rt.receiver.fatal
    if rt.receiver.error is not None:
        raise rt.receiver.error


def available(rt: Runtime, opts: SourceOptions, state: RunState) -> tuple[dict[str, int], bool]:
    """availableNow: the end of the next batch, once the producers' state says it, and
    whether it is the run's end.

    The run's end is what is stored once every producer has given what it held when
    the run started (:func:`awaited`): a zio-spark producer states its position in
    its BOT reply, a plain giver cannot and is taken as done after
    ``plainGiverQuiet`` without records. Until then, once ``plan.STEP`` records wait
    beyond the last batch, or maxBacklog holds a producer back, what is stored is a
    batch of its own: Spark processes it while the rest arrives, and its commit
    frees the backlog.
    """
    while True:
        check(rt, opts)
        left = awaited(rt, opts, state, plain=True, strict=True)
        if not left:
            break
        waiting = sum(rt.spool.backlog().values())
        if plan.is_step(waiting, waiting > 0 and bool(rt.receiver.held_back())):
            return rt.spool.seal(), False  # a step on the way, not the end
        state.say(left)
        time.sleep(0.02)  # the runner waits for producers; not a test wait
    target = rt.spool.seal()
    log.info("zio source: availableNow run complete at %s", plan.sorted_offsets(target))
    return target, True


def awaited(
    rt: Runtime,
    opts: SourceOptions,
    state: RunState,
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
    recv = rt.receiver
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
    verdict = state.completeness(opts).check(
        view, plain=plain, strict=strict, reach=reach, warn=warn, cap=cap
    )
    for key, text in verdict.problems:
        state.problem(key, text, opts.fail_on_data_loss)
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
            opts.plain_giver_quiet,
        )
    return verdict.awaited


def wait_first(rt: Runtime, opts: SourceOptions, state: RunState, *, one_batch: bool) -> None:
    """A run's first ``latestOffset`` (no availableNow preparation): wait until each
    producer that states its position has given what it held at connect
    (:func:`awaited`), or maxBacklog holds it back, or ``plan.STEP`` records wait.

    ``one_batch``: this Spark (4.0/4.1) runs an availableNow query as this one batch (no
    ``prepareForTriggerAvailableNow``): there the wait covers plain givers too
    (``plainGiverQuiet``), so the batch holds everything the producers held when the
    run started, up to ``maxBacklog`` records per producer. There every query has
    this wait (a processingTime stream too), so a giver stating no position that
    keeps giving is awaited at most ``connectTimeout`` from its flow's start (then a
    WARN), and whatever the batch goes on without is a WARN too. A stating producer
    whose flow is down is awaited ``connectTimeout`` (then a WARN) on any Spark. On
    4.2+ a plain giver's first records are awaited at most :data:`FIRST_WAIT` s: a
    latency choice for the first batch (Spark runs it whatever offsets it gets,
    paying ~2 s of worker start-up), never a completeness decision; later batches
    take the rest.
    """
    # A stream (4.2+) picks up a producer that is slow to connect in a later batch:
    # its first batch waits for connections only briefly (a latency choice).
    reach = None if one_batch else min(opts.connect_timeout, FIRST_WAIT)
    cap = opts.connect_timeout if one_batch else None
    while True:
        check(rt, opts)
        left = awaited(
            rt, opts, state, plain=one_batch, strict=False, reach=reach, warn=one_batch, cap=cap
        )
        if not left:
            break
        waiting = sum(rt.spool.backlog().values())
        if plan.is_step(waiting, waiting > 0 and bool(rt.receiver.held_back())):
            return
        state.say(left)
        time.sleep(0.01)  # the runner waits for producers; not a test wait
    if one_batch:
        return
    deadline = time.monotonic() + min(FIRST_WAIT, opts.connect_timeout)
    while time.monotonic() < deadline and not any(rt.spool.backlog().values()):
        check(rt, opts)
        time.sleep(0.01)  # the runner waits for producers; not a test wait


def batch_receive(
    opts: SourceOptions, *, ctx: zmq.Context[zmq.Socket[bytes]] | None = None
) -> tuple[str, dict[str, tuple[int, int]]]:
    """A batch read: receive into a private spool until the flows end (``maxRecords``,
    ``timeout``); the spool's path and the ranges ``{producer: (start, end)}`` to read.

    ``maxRecords`` goes to the plain givers first (:func:`_take_plain`), the
    ack-capable producers share what they leave (``plan.take_acked``).

    Raises
    ------
    TransportError
        If a producer could not be read (naming its endpoint and the cause): it
        refused or broke the flow, never answered, or cannot talk to our socket kind.
    DataLossError
        If records are known lost and ``failOnDataLoss`` is true.
    """
    path = os.path.join(opts.spool_path, f"batch-{uuid.uuid4().hex}")
    spool = Spool(path, on_gap="raise" if opts.fail_on_data_loss else "accept")
    try:
        # The plain givers get credit for at most maxRecords records in all: they
        # never give more than the read can take (a record it drops is lost to them).
        inlet = start_inlet(opts, spool, reconnect=False, ctx=ctx, plain_budget=opts.max_records)
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
        budget = opts.max_records
        in_flight: dict[str, int] = {}
        if budget is not None:
            # From here the givers may send only the credit they hold, so what the
            # plain givers may still bring is known before the ack-capable producers'
            # share is decided (credit paid during the acks and the EOTs below would
            # bring plain records that share did not leave room for).
            held = recv.hold_credit(timeout=min(5.0, opts.connect_timeout))
            if held is None:
                raise TransportError(
                    "zio batch read failed: the receiver did not stop its credit within "
                    f"{min(5.0, opts.connect_timeout):g} s, so what its plain givers may "
                    "still send is unknown"
                )
            in_flight = held
        ends = spool.seal()
        committed = spool.committed()
        starts = {p: plan.base(p, {}, committed) for p in ends}
        plain = _plain(recv)
        if budget is not None:
            # maxRecords goes to the plain givers first, to all they gave and may still
            # give (they cannot send again what a read drops); the ack-capable
            # producers share the rest fairly and keep what is not acked for the next
            # read (plan.take_acked).
            reach = {
                p: max(0, ends.get(p, 0) - starts.get(p, 1)) + in_flight.get(p, 0) for p in plain
            }
            ends = plan.take_acked(starts, ends, reach, budget)
            budget -= sum(ends[p] - starts[p] for p in ends)
        else:
            ends = {p: e for p, e in ends.items() if p not in plain}
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
    return path, {p: (starts[p], e) for p, e in ends.items()}


def _plain(recv: Receiver) -> set[str]:
    """The producers of a batch read that are plain givers (no acks)."""
    return {st.producer for st in recv.status() if st.producer and not st.ack_capable}


def _take_plain(
    recv: Receiver,
    spool: Spool,
    starts: dict[str, int],
    ends: dict[str, int],
    budget: int | None,
    max_records: int | None,
) -> tuple[dict[str, int], dict[str, int]]:
    """A batch read's flows have ended: ``(starts, ends)`` with the plain givers (no
    acks) taken to all they gave, within ``budget`` (what the ack-capable producers
    left of ``maxRecords``; :func:`~zio_spark.source.plan.extend_plain`).

    A plain giver has no acks: what reached the spool is confirmed to it (by our credit,
    then the echo of our EOT), so it is in the result or, only when the plain givers
    alone gave more than ``maxRecords``, logged as lost: the giver does not keep it."""
    plain = _plain(recv)
    taken = plan.extend_plain(plain, spool.seal(), spool.committed(), starts, ends, budget)
    # What the plain givers gave in all in this read: taken, and lost beyond the budget.
    gave = sum(
        taken.left.get(p, (0, taken.ends[p]))[1] - taken.starts[p]
        for p in plain & taken.ends.keys()
    )
    for p, (lost_from, lost_to) in sorted(taken.left.items()):
        log.warning(
            "zio batch read: plain giver %s gave %d records beyond maxRecords %s (seq %d "
            "to %d): not in the result, and lost (a plain giver has no acks and cannot "
            "send them again). The plain givers alone gave %d records in this read: set "
            "a larger maxRecords (or none) to keep them all",
            p,
            lost_to - lost_from,
            max_records,
            lost_from,
            lost_to - 1,
            gave,
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
