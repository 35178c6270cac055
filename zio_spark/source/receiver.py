"""The source's receiver: takes records from ZIO producers into the spool, with credit.

(The loop, the client flows, the spool writing and the public API; the bind mode's
handler is in ``bound_takers``, the per-flow state in ``receiver_peers``.)

Runs in Spark's long-lived streaming runner process (never in a reader's ``__init__``:
sockets do not pickle). One thread owns every socket and drives them all through one
:class:`~zio_spark.transport.loop.Loop`. It takes records in two topologies,
both at once if asked:

- **connect** (``endpoints``/``group``): for each producer endpoint it runs a ZIO flow as
  the *client taker*;
- **bind** (``bind``): it is a flow server like the reference's flow broker; every giver
  client that connects with ``BOT{direction: extract}`` is a producer partition.

As the client taker:

1. connect a client port and send ``BOT{direction: inject, credit: C, stream, ack: true,
   resume: R, encoding: ["arrow"], batch: K}`` -- an *offer*. ``R`` is the last sequence
   number the spool holds for that producer (durably): an ack-capable producer resends
   from ``R+1``. ``K`` caps records per DAT so the backlog bound below is exact. The
   reply counts only for what the giver states as its own
   (:func:`~zio_spark.protocol.negotiate.client_terms`): a reference server echoes our
   BOT back, which must read as a plain giver (no acks, plain DATs), never as ours.
2. every DAT goes into the spool: Arrow batches from our own producers, or one record per
   DAT from a plain ZIO giver (numbered here, ``seq = held + 1``). Records at or below what
   the spool holds are dropped (resends).
3. after each burst of input the spool is flushed (one fsync for all producers) and only
   then is credit handed back, so every record covered by a PAY is durable. Credit is
   handed back only while ``backlog + (outstanding + n) * K <= maxBacklog``: a slow query
   stops the producers and memory stays bounded.
4. ``commit(end)`` (after Spark's commit of a micro-batch) acknowledges ``end - 1`` to the
   producer on the next PAY, or on an ack-only PAY when no credit is held -- only to a
   giver whose terms have acks (:func:`~zio_spark.protocol.negotiate.pay_attrs`): a plain
   giver never sees ``ack`` nor a PAY of 0. A plain giver that announces our whole offer
   may be echoing it (a C++ reference server does, whatever its own window): its credit
   goes as PAYs of 1, which a reference giver (one message taken per DAT sent) always
   accepts. (A giver that writes its own BOT states its own credit: paid as usual.)

A flow that fails (the peer disconnects, times out on BOT, or breaks the protocol) is
closed, counted, and reopened after a back-off with a fresh BOT, so a restarted producer
is picked up without restarting the query (with ``reconnect=False``, batch reads, it stays
failed). A flow that brings no BOT within ``connectTimeout`` is reported with what the
socket monitor saw: nothing listening, no BOT, or a failed ZMTP handshake -- socket kinds
that cannot talk, which fails the receiver (``error``) naming both kinds and the fix,
instead of reconnecting in silence. A plain giver's EOT is final: reopening would make a
reference server give its whole stream again. Producer ids learned from BOTs are
kept by the spool (``peers.json``, :class:`~zio_spark.storage.spool_peers.SpoolPeers`)
so ``resume`` is right after a runner restart too; what may be acked is the spool's too
(:meth:`~zio_spark.storage.spool.Spool.ack_end`).

A zio-spark producer states its position in its BOT reply (``last``, see
:mod:`~zio_spark.protocol.negotiate`); the first one per producer is kept in
:attr:`Receiver.positions`: the reader ends an availableNow run on it, not on a clock.
:meth:`Receiver.stop` sends an EOT on every open flow and takes what arrives until each
echo (bounded), so a giver's flow is over on both sides. A plain giver's open flow is
recorded in ``plain_flows.json`` until it ends (EOT either way) or its connection drops:
a runner that was killed leaves the entry, and the next receiver on that spool refuses
to send a BOT into that flow (a reference giver dies on one), naming the endpoint and
the fix.

As the server taker (``bind``), one flow per client routing id: the client's BOT is its
own statement (:func:`~zio_spark.protocol.negotiate.server_terms`); the reply states
``resume``/``ack``/``encoding``/``batch`` to a zio-spark producer, and only the reversed
direction and a credit no larger than the offer to a plain client. The partition id is
the client's ``producer``, or ``origin:<n>`` from the BOT's coord for a plain client (see
:class:`~zio_spark.source.bound_takers.BoundTaker`). Each bound port is an inline
:class:`~zio_spark.transport.flow_server.FlowServer` on the receiver's loop. A client
flow that ends or fails is dropped (the client opens a new one); a plain client that
vanishes without EOT keeps its entry until the receiver stops (stock libzmq does not say
which ROUTER peer left).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import pyarrow as pa
import zmq

from zio_spark.codec.records import (
    DAT_RECORDS,
    ENCODING,
    decode_batch,
    decode_plain,
    wire_to_wal,
)
from zio_spark.errors import (
    DataLossError,
    ProtocolError,
    RemoteProtocolError,
    StorageError,
    TransportError,
)
from zio_spark.options import Curve
from zio_spark.protocol.credit import BacklogCredit, dat_records_for, echoes_offer, pays
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    FlowState,
    Rejected,
    dat_profile,
)
from zio_spark.protocol.message import (
    DAT_LABEL,
    FLOW_FORM,
    Message,
)
from zio_spark.protocol.negotiate import Terms, client_terms, pay_attrs
from zio_spark.source.bound_takers import BoundTaker, answer_stray, bind_port, read_bound_monitor
from zio_spark.source.receiver_peers import DONE_KEPT, Bound, Peer, PeerStatus, Pending
from zio_spark.storage.spool import Record, Spool
from zio_spark.transport.flow_client import ClientFlow, ClientHandler, FlowClient, Offer
from zio_spark.transport.flow_server import FlowServer
from zio_spark.transport.loop import Loop
from zio_spark.transport.port import (
    socket_type_name,
)

__all__ = ["PeerStatus", "Receiver"]

log = logging.getLogger("zio_spark.source")


class Receiver:
    """Receive from ``endpoints`` into ``spool`` in a background thread.

    Parameters
    ----------
    spool
        The open spool; the receiver appends and flushes, the caller seals and reads.
    endpoints
        Producer endpoints to connect to (more can be added with :meth:`add_endpoint`).
    credit
        Credit window offered in each BOT.
    max_backlog
        Most records held above the committed offset, per producer.
    stream
        Stream name sent in BOT.
    connect_timeout
        How long to wait for a producer's BOT before retrying (and, when no BOT ever came
        back, before reporting that the socket kinds may not match).
    bind
        Endpoints to bind a flow server on (``tcp://*:5555``): giver clients connect
        there, each client flow a producer partition (see :meth:`_bound_producer`).
    reconnect
        Reopen a flow that ended or failed (streaming). False: a failed flow stays
        ``failed`` and an ended one ``ended`` (batch reads).
    plain_budget
        A batch read's ``maxRecords``: the plain givers (no acks) are given credit for
        at most that many records in all, so they never give more than the read takes
        (a plain giver does not keep a record the read drops). None: no such bound.

    Raises
    ------
    TransportError
        If a ``bind`` endpoint cannot be bound (in use, malformed), naming it.
    """

    def __init__(
        self,
        spool: Spool,
        endpoints: Iterable[str] = (),
        *,
        credit: int = 1000,
        max_backlog: int = 1_000_000,
        stream: str = "zio",
        connect_timeout: float = 30.0,
        mode: str | None = None,
        curve: Curve | None = None,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        reconnect: bool = True,
        bind: Iterable[str] = (),
        plain_budget: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self.spool = spool
        self.credit = credit
        self.max_backlog = max_backlog
        # Records per DAT we accept: maxBacklog's second mechanism (dat_records_for).
        # Credit is paid only while backlog + DATs in flight x per-DAT records <=
        # max_backlog (BacklogCredit), so that bound holds exactly whatever the size.
        # Large DATs cost far less per record (4096 against 1000: the runner's CPU per
        # record halved, 574k -> 783k rows/s steady, bench_steady).
        self.batch = dat_records_for(max_backlog, DAT_RECORDS)
        self._credit_rule = BacklogCredit(max_backlog, self.batch)
        self.stream = stream
        self.connect_timeout = connect_timeout
        self.mode = mode
        self.curve = curve
        self.ctx = ctx or zmq.Context.instance()
        self.clock = clock
        self.reconnect = reconnect
        self.wall_clock_us = wall_clock_us
        self.stats: collections.Counter[str] = collections.Counter()
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ending = False  # stop: only the echoes of our EOTs are awaited
        self._credit_held = False  # hold_credit: no more credit is paid (acks still go)
        self.plain_budget = plain_budget
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.fatal: DataLossError | None = None
        self._pending: dict[str, Pending] = {}
        self._quiet_since: float | None = None
        # Per producer: time credit was withheld because of maxBacklog (finished spells,
        # and since when for one going on), and the blocked time it stated (blocked_ms).
        self._withheld_s: dict[str, float] = {}
        self._withheld_since: dict[str, float] = {}
        self._held_now: set[str] = set()
        self._blocked_ms: dict[str, int] = {}
        self._bound: list[Bound] = []
        self._done: collections.deque[PeerStatus] = collections.deque(maxlen=DONE_KEPT)
        # A flow the receiver could never start (no BOT within connectTimeout on a fresh
        # connection): what the query reports, naming the endpoint and the fix.
        self.unreachable: dict[str, str] = {}
        # Per producer: the position its first flow's BOT stated (``last``), lowered only
        # by a later statement below it (a restarted producer that lost records). What
        # "all it held when we started" means, by the protocol (see source/plan.py Completeness).
        self.positions: dict[str, int] = {}
        self.started_at = clock()
        # When the loop last looked at its sockets (after a poll): a flow whose
        # ``last_data`` is older had nothing waiting since then.
        self.looked_at = self.started_at
        # Plain givers whose flow is open (BOT exchanged, no EOT either way) are recorded
        # by the spool (spool.peers): a restart must not send a new BOT into a flow left
        # open by a killed runner. Producer ids per endpoint are kept there too.

        # One poll loop for every socket: its waker wakes the poll at once for a queued
        # call, a commit's ack or a stop; closed by the thread when it ends (or by stop()
        # if it never started).
        self._loop = Loop(tick=_TURN_S, name="zio-receiver", clock=clock)
        self._appended = False  # a drain appended records: flush this turn
        self._busy = False  # the turn's poll found input waiting
        self._looked = self.started_at
        self._ran = False
        for ep in endpoints:
            self._add(ep)
        try:
            for ep in bind:
                self._bind(ep)
        except BaseException:
            for b in self._bound:
                b.server.close(linger_ms=0)
            self._loop.close()
            raise
        # After the bound ports' servers: a turn stores and pays for what they took.
        self._loop.add(_Turns(self))

    # -- public (any thread) -----------------------------------------------------------

    def start(self) -> Receiver:
        self._ran = True
        self._thread = threading.Thread(target=self._run, name="zio-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """End every flow with EOT (best effort, bounded) and stop the thread; True once
        the thread has ended, so the spool can be closed.

        The thread's ending is bounded: an EOT send of at most :data:`_EOT_SEND_MS` per
        flow, one after another, then the echoes awaited at most
        ``min(_EOT_WAIT, connectTimeout)``, then the sockets closed. The default wait is
        that bound for the flows open now plus :data:`_STOP_MARGIN` (a fixed 10 s ran out
        with many flows, and the spool was closed under a thread still appending the
        records that came before the echoes). False (logged) means the thread outlived
        even that: leave the spool open (its lock goes with the process).
        """
        self._stop.set()
        self._loop.stop()
        thread = self._thread
        if thread is None:
            if not self._ran:
                self._loop.close()  # never started: nothing else closes it
            return True
        bound = self.stop_bound() if timeout is None else timeout
        thread.join(bound)
        if thread.is_alive():
            log.error(
                "zio source: the receiver thread is still ending its flows after %.1f s; "
                "leaving it (the spool stays open)",
                bound,
            )
            return False
        self._thread = None
        return True

    def stop_bound(self) -> float:
        """Seconds :meth:`stop` waits by default (see there)."""
        with self._lock:
            flows = len(self._flows())
        per_flow = _EOT_SEND_MS / 1000 + _END_FLOW_S
        return flows * per_flow + min(_EOT_WAIT, self.connect_timeout) + _STOP_MARGIN

    def add_endpoint(self, endpoint: str, mode: str | None = None) -> None:
        """Start receiving from ``endpoint`` (``mode``: the socket pair, None = default)."""
        self._call(lambda: self._add(endpoint, mode))

    def endpoints(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def remove_endpoint(self, endpoint: str) -> None:
        self._call(lambda: self._remove(endpoint))

    def commit(self, offsets: dict[str, int]) -> None:
        """Spark committed ``offsets``: let the spool drop them and ack the producers."""
        self.spool.commit(offsets)
        self.acknowledge(offsets)

    def acknowledge(self, offsets: dict[str, int]) -> None:
        """Ack ``offsets`` to the producers without dropping anything from the spool."""
        self.spool.acknowledge(offsets)
        self._loop.waker.wake()  # the ack goes on the loop's next turn, now

    def flush_acks(self, timeout: float = 5.0) -> bool:
        """Wait until every connected producer that takes acks was sent the latest
        committed ack (a plain giver takes none: it was waited for in vain, the whole
        ``timeout``, in every batch read)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                pending = [
                    p
                    for p in self._flows()
                    if p.producer is not None
                    and p.terms.ack
                    and p.flow is not None
                    and p.flow.state is FlowState.READY
                    and p.acked < self.spool.ack_end(p.producer) - 1
                ]
            if not pending:
                return True
            self._stop.wait(0.01)
        return False

    def hold_credit(self, timeout: float = 5.0) -> dict[str, int] | None:
        """Pay no more credit from now on (acks still go): a batch read whose
        ``maxRecords`` is reached bounds what its givers may still send.

        Returns, per producer, the most records its givers may still send: the credit
        they hold times the records one of their DATs may carry, taken on the receiver's
        thread after its last payment. None if that thread did not answer within
        ``timeout`` s (it is stuck or ended): the caller cannot bound the rest.
        """
        done = threading.Event()
        out: dict[str, int] = {}

        def hold() -> None:
            self._credit_held = True
            for peer in self._flows():
                if peer.flow is None or peer.producer is None:
                    continue
                out[peer.producer] = out.get(peer.producer, 0) + self._in_credit(peer)
            done.set()

        self._call(hold)
        return dict(out) if done.wait(timeout) else None

    def status(self) -> list[PeerStatus]:
        """One entry per producer endpoint we connect to, per live client flow of a bound
        endpoint, and per client flow that ended or failed there (the latest
        ``DONE_KEPT``)."""
        with self._lock:
            out = [PeerStatus(**vars(p.status)) for p in self._flows()]
            out.extend(PeerStatus(**vars(st)) for st in self._done)
            return out

    def quiet_for(self) -> float:
        """Seconds since the receiver last had anything to read (0 while it is busy:
        an append that takes long is not a quiet flow)."""
        since = self._quiet_since
        return 0.0 if since is None else max(0.0, self.clock() - since)

    def holdups(self) -> dict[str, dict[str, int]]:
        """Per producer: ``withheldMs``, how long the source withheld credit because of
        ``maxBacklog`` (it held the producer back), and ``blockedMs``, the time the
        producer itself stated it was blocked waiting for acks (only producers that
        state it: zio-spark producers, in ``blocked_ms`` DAT attributes)."""
        now = self.clock()
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for p in self._withheld_s.keys() | self._withheld_since.keys():
                total = self._withheld_s.get(p, 0.0)
                since = self._withheld_since.get(p)
                if since is not None:
                    total += max(0.0, now - since)
                out.setdefault(p, {})["withheldMs"] = int(total * 1000)
            for p, ms in self._blocked_ms.items():
                out.setdefault(p, {})["blockedMs"] = ms
            return out

    def stated_positions(self) -> dict[str, int]:
        """Per producer that states it (zio-spark producers, in their BOT): the position
        its first flow stated, the last seq it had assigned then (see ``positions``)."""
        with self._lock:
            return dict(self.positions)

    def held_back(self) -> list[str]:
        """Producers the source holds back right now: maxBacklog reached, and they hold
        no credit."""
        with self._lock:
            return sorted(self._withheld_since)

    def bound_endpoints(self) -> list[str]:
        """The endpoints bound for giver clients, as bound (``tcp://0.0.0.0:5555``)."""
        return [b.actual for b in self._bound]

    def _flows(self) -> list[Peer]:
        """Every flow: one per endpoint we connect to, one per client of a bound port."""
        out = list(self._peers.values())
        for b in self._bound:
            out.extend(b.flows.values())
        return out

    def _call(self, fn: Callable[[], None]) -> None:
        self._loop.call_soon(fn)

    def _bind(self, endpoint: str) -> None:
        port, actual, monitor = bind_port(endpoint, self.ctx, self.mode, self.curve)
        b = Bound(endpoint, port, actual, monitor=monitor)
        b.server = FlowServer(
            port,
            lambda: BoundTaker(self, b),
            ctx=self.ctx,
            origin=b.origin,
            name=f"zio source {actual}",
            send_timeout=1.0,
            loop=self._loop,
            on_stray=lambda rid, msg, why: answer_stray(b, self.stats, rid, msg, why),
        )
        self._bound.append(b)
        log.info("zio source: bound %s (%s) for giver clients", actual, port.socket_type)

    # -- into the spool --------------------------------------------------------------------

    def _take_plain(self, peer: Peer, msg: Message) -> None:
        """A plain DAT without attributes: its one payload frame is the record's value;
        what :meth:`_on_data` makes of it, without looking for attributes."""
        producer = peer.producer
        assert producer is not None  # a flow takes DATs only after the BOT named it
        pend = peer.pending
        seq = (pend.last or self.spool.next_seq(producer) - 1) + 1
        value = msg.payload[0]
        pend.records.append(
            Record(seq, value, None, msg.origin, msg.granule, self.wall_clock_us(), None)
        )
        pend.bytes += len(value)
        pend.dats += 1
        pend.last = seq

    def _append_pending(self, peer: Peer, now: float) -> bool:
        """Append what the drain took in; True if anything new reached the spool."""
        pend = peer.pending
        batches, records = pend.batches, pend.records
        if not batches and not records:
            return False
        pend.batches, pend.records, pend.last = [], [], 0
        pend.bytes = pend.dats = 0
        producer = peer.producer
        assert producer is not None
        total = sum(b.num_rows for b in batches) + len(records)
        try:
            if batches:
                # One WAL record each: concatenating first costs a copy, and sealing
                # regroups rows into large segment batches anyway.
                new = sum(self.spool.append_batch(producer, b) for b in batches)
            else:
                new = self.spool.append(producer, records)
        except DataLossError as e:
            # A gap: the producer no longer has records the spool never got. Fatal
            # for the query when failOnDataLoss (the spool then raises); reported.
            self.stats["data_loss"] += 1
            self.fatal = e
            peer.status.state = "failed"
            peer.status.last_error = str(e)
            if peer.flow is not None or peer.client is not None:
                self._end_flow(peer, eot=True)
            if peer.bound is not None:
                peer.status.state = "failed"  # _end_flow filed it as done
            return False
        except (StorageError, ValueError, pa.ArrowException) as e:
            # Records the spool cannot take (e.g. too large for one WAL record): this
            # peer's flow fails, as it would have on the DAT; the others go on.
            self.stats["dropped"] += 1
            self._fail(peer, f"cannot store records: {type(e).__name__}: {e}", now)
            return False
        peer.status.records += new
        peer.status.duplicates += total - new
        peer.status.last_data = now
        self.stats["records"] += new
        if new > 0:
            self._appended = True  # flushed this turn, before any credit is paid
        return new > 0

    def _on_data(self, peer: Peer, data: Data) -> None:
        """Take one DAT's records into the drain's pending append."""
        producer = peer.producer
        assert producer is not None
        pend = peer.pending
        held = pend.last or self.spool.next_seq(producer) - 1
        ts = self.wall_clock_us()
        origin = data.message.origin
        if peer.arrow:
            if data.attrs:  # now and then: the producer states its state
                self._on_state(peer, data.attrs)
            elif peer.said_idle:
                peer.said_idle = peer.status.idle = False
            if len(data.message.payload) != 1:
                raise RemoteProtocolError(
                    f"Arrow DAT must have 1 payload frame, got {len(data.message.payload)}",
                    field="payload",
                )
            batch = decode_batch(data.message.payload[0])
            if batch.num_rows > peer.dat_rows:
                if batch.num_rows > max(self.batch, peer.dat_rows):
                    # Valid records: failing the flow would refetch the same DAT forever.
                    log.warning(
                        "producer %s sends %d records per DAT, above the %d asked for in "
                        "BOT; credit is sized for %d",
                        peer.endpoint,
                        batch.num_rows,
                        self.batch,
                        batch.num_rows,
                    )
                peer.dat_rows = batch.num_rows
            first = int(batch.column(0)[0].as_py())
            if held == 0 and first > 1 and producer not in self.spool.producers():
                held = self._start_at(producer, first)
            # Records the spool holds already (a resend) are dropped there, counted by
            # _append_pending as duplicates.
            wal = wire_to_wal(batch, origin=origin, timestamp_us=ts)
            pend.batches.append(wal)
            pend.bytes += wal.nbytes
            pend.dats += 1
            pend.last = max(held, first + batch.num_rows - 1)
            return
        else:
            value, key, headers = decode_plain(data.message.payload, data.attrs)
            records = [Record(held + 1, value, key, origin, data.message.granule, ts, headers)]
        pend.records.extend(records)
        pend.bytes += len(value)
        pend.dats += 1
        pend.last = held + 1

    def _start_at(self, producer: str, first: int) -> int:
        """First contact with a producer whose records start at ``first > 1``.

        An ack-capable producer forgets a record only once a taker acknowledged it, so
        records below ``first`` were delivered elsewhere (an earlier batch read, another
        spool): the stream starts at ``first``, recorded as a commit, instead of a
        sequence gap that would fail the query as data loss.
        """
        log.info("producer %r: first records start at seq %d; starting there", producer, first)
        self.spool.commit({producer: first})
        return self.spool.next_seq(producer) - 1

    # -- peers ---------------------------------------------------------------------------

    def _mark_open(self, peer: Peer, is_open: bool) -> None:
        """Persist whether a plain giver's flow is open (client flows of a streaming
        receiver: a batch read's spool is its own)."""
        if peer.bound is not None or not self.reconnect:
            return
        if is_open:
            self.spool.peers.mark_open(peer.endpoint, peer.producer or peer.endpoint)
        else:
            self.spool.peers.mark_closed(peer.endpoint)

    def _add(self, endpoint: str, mode: str | None = None) -> None:
        with self._lock:
            if endpoint in self._peers:
                return
            peer = Peer(endpoint, PeerStatus(endpoint), mode or self.mode)
            self._peers[endpoint] = peer
        # The flow's engine: connects, sends our offer, watches the socket, times out a
        # silent giver and reconnects with back-off; the receiver takes every message.
        peer.client = FlowClient(
            endpoint,
            _EndpointTaker(self, peer),
            ctx=self.ctx,
            mode=peer.mode,
            port_options={} if self.curve is None else {"curve": self.curve},
            connect_timeout=self.connect_timeout,
            reconnect=self.reconnect,
            patient=True,
            connect_now=False,
            # The engine logs each failure of this flow (once, with the cause and the
            # reconnect delay) under this name; _failed only counts it.
            name=f"zio source: producer {endpoint}",
        )
        peer.client.attach(self._loop)
        if self.reconnect and endpoint in self.spool.peers.left_open:
            # The previous runner's flow to this plain giver ended without an EOT (it was
            # killed): the giver may still hold that flow open, and a reference giver
            # dies on a new BOT mid-flow (or gives its stream again from the start).
            why = (
                f"plain giver {endpoint}: the previous query on this spool left its flow "
                "open (no EOT was sent or echoed: the runner was killed?); a plain ZIO giver "
                "has no resume, and a new BOT would kill its open flow or make it give its "
                "stream again from the start. Restart the giver, then delete "
                f"{self.spool.peers.plain_flows_path} (or start over with a new spoolPath "
                "and checkpoint)"
            )
            self.spool.peers.keep_open(endpoint)  # still open: keep it
            self._unreachable(peer, why)
            peer.client.give_up(why)

    def _remove(self, endpoint: str) -> None:
        with self._lock:
            peer = self._peers.pop(endpoint, None)
        if peer is not None and peer.client is not None:
            peer.client.send_eot(timeout_ms=100)
            peer.client.close("endpoint removed", linger_ms=100)
            # The giver left (its group peer is gone; the echo is not awaited): no flow of
            # it is left open to stumble into, as when its socket disconnects. A stale
            # plain_flows.json entry would make the next runner refuse it once it is back.
            self._mark_open(peer, False)

    def _offer(self, peer: Peer, conn: ClientFlow) -> Offer:
        """The BOT of a new flow to ``peer``: our offer (the reply states what the giver
        does, see :func:`~zio_spark.protocol.negotiate.client_terms`)."""
        producer = peer.producer or self.spool.peers.producer_of(peer.endpoint)
        resume = self.spool.next_seq(producer) - 1 if producer else 0
        attrs: dict[str, Any] = {
            "stream": self.stream,
            "ack": True,
            "resume": resume,
            "encoding": [ENCODING],
            "batch": self.batch,
        }
        peer.port, peer.flow, peer.link, peer.sent = conn.port, conn.flow, conn, attrs
        peer.status.state = "connecting"
        return Offer(Direction.INJECT, self.credit, attrs)

    def _send(self, peer: Peer, msg: Message, timeout_ms: float = 1000) -> None:
        if peer.bound is not None:
            peer.bound.port.send(msg, peer.rid, timeout_ms=timeout_ms)
        else:
            assert peer.port is not None
            peer.port.send(msg, timeout_ms=timeout_ms)

    def _end_flow(self, peer: Peer, *, eot: bool) -> None:
        """End ``peer``'s flow here (with an EOT first if ``eot``); no new flow opens for
        an endpoint we connect to."""
        b = peer.bound
        if b is not None:
            if eot and peer.flow is not None and peer.flow.state is FlowState.READY:
                with contextlib.suppress(ProtocolError, TransportError):
                    self._send(peer, peer.flow.send_eot(), timeout_ms=100)
            with self._lock:
                if peer.rid is not None and b.flows.get(peer.rid) is peer:
                    del b.flows[peer.rid]
                    self._done.append(peer.status)
            peer.flow = None  # before the server's on_close, which then has nothing to do
            if peer.conn is not None:
                b.server.remove(peer.conn, "ended by the receiver")
            return
        if peer.client is not None:
            if eot:
                peer.client.send_eot(timeout_ms=100)
            peer.client.give_up(peer.status.last_error or "ended", linger_ms=100 if eot else 0)

    def _fail(self, peer: Peer, why: str, now: float) -> None:
        if peer.bound is not None:
            self.stats["flow_failures"] += 1
            peer.status.failures += 1
            peer.status.last_error = why
            # A client flow: the client opens a new one (a new BOT) if it wants to.
            peer.status.state = "failed"
            log.warning("zio source: giver client %s: %s; flow dropped", peer.endpoint, why)
            self._end_flow(peer, eot=False)
            return
        assert peer.client is not None
        peer.client.fail(why, "taker_errors", now)  # counted in _failed, via on_failure

    def _failed(self, peer: Peer, why: str, counter: str, final: bool) -> None:
        """A flow to ``peer`` failed (its engine's :meth:`ClientHandler.on_failure`).

        Counted and noted in ``peer.status`` here; not logged: the engine has logged it
        (one line naming the producer's endpoint, the cause and the reconnect delay)."""
        if counter == "protocol_errors":  # a message that did not parse
            self.stats["dropped"] += 1
        if counter == "disconnects":
            # The giver's socket is gone (its process ended or it closed the port): no
            # flow of it is left open to stumble into.
            self._mark_open(peer, False)
        if counter == "bot_timeouts" and final:
            self._unreachable(peer, why, logged=True)  # the engine gives up
            return
        self.stats["flow_failures"] += 1
        peer.status.failures += 1
        peer.status.last_error = why
        peer.status.state = "failed" if final else "waiting"

    def _closed(self, peer: Peer, now: float) -> None:
        """A flow to ``peer`` ended (its engine's :meth:`ClientHandler.on_close`): what it
        took before is kept."""
        flow_was = peer.flow
        peer.port = peer.flow = peer.link = None
        if flow_was is not None and peer.producer is not None:
            self._append_pending(peer, now)

    def _unreachable(self, peer: Peer, why: str, *, logged: bool = False) -> None:
        """A producer we can never talk to as configured: the query fails, saying why
        (the caller, or the flow's engine, gives up on it; ``logged``: the engine has
        already logged ``why``)."""
        self.stats["flow_failures"] += 1
        peer.status.failures += 1
        peer.status.state = "failed"
        peer.status.last_error = why
        self.unreachable[peer.endpoint] = why
        if not logged:
            log.error("zio source: %s", why)
        if self.error is None:
            self.error = TransportError(why, endpoint=peer.endpoint)

    def why_no_flow(self, endpoint: str) -> str | None:
        """Why ``endpoint`` has no flow yet (as the socket monitor saw it), or None."""
        peer = self._peers.get(endpoint)
        if peer is None or peer.status.state not in ("connecting", "waiting"):
            return None
        conn = peer.link
        if conn is None:
            return peer.status.last_error
        return self._diagnosis(conn)[0]

    def _diagnosis(self, conn: ClientFlow) -> tuple[str, bool]:
        """What we know of a connection that brought no BOT; True if the socket kinds
        cannot match (no use retrying)."""
        ours = socket_type_name("client", conn.mode)
        theirs = "SERVER" if ours == "DEALER" else "ROUTER"
        fix = (
            "set option socket=clientserver (it needs a draft-enabled pyzmq; see docs/flows.md "
            'section "Sockets: CLIENT/SERVER or ROUTER/DEALER")'
            if ours == "DEALER"
            else "set option socket=routerdealer"
        )
        t = self.connect_timeout
        seen, endpoint = conn.seen, conn.endpoint
        if seen.handshake_error is not None:
            return (
                f"{endpoint}: the security handshake failed ({seen.handshake_error}); "
                "check the CURVE keys (curveServerKey is the producer's public key)",
                False,
            )
        if seen.refused:
            return (
                f"{endpoint} did not answer our BOT within {t:g} s and every ZMTP "
                f"handshake with it failed: our socket is a {ours}, so the producer's is "
                f"probably a {theirs}, and the two never exchange a message; {fix}",
                True,
            )
        if not seen.connected:
            return f"nothing accepted a connection at {endpoint} within {t:g} s", False
        return (
            f"{endpoint} accepted our {ours} but sent no BOT within {t:g} s "
            f"(is it a ZIO flow server giving stream {self.stream!r}?)",
            False,
        )

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._loop.turn()
        except BaseException as e:  # reported through .error and the status, never silent
            self.error = e
            log.exception("receiver failed")
        finally:
            try:
                self._end_with_eot()
            except BaseException as e:  # pragma: no cover - reported, then sockets close
                log.exception("zio source: ending the flows failed")
                if self.error is None:
                    self.error = e
            for peer in self._flows():
                if peer.client is not None:
                    peer.client.close("the receiver stopped", linger_ms=0)
                else:
                    self._end_flow(peer, eot=False)
            for b in self._bound:
                with contextlib.suppress(zmq.ZMQError):
                    b.port.socket.disable_monitor()
                if b.monitor is not None:
                    b.monitor.close(0)
                b.server.close("the receiver stopped", linger_ms=100)
            self._loop.close()

    def _end_with_eot(self) -> None:
        """Stop: send an EOT on every open flow and take what arrives until each echo
        (the giver got our EOT: a plain giver's flow is over on both sides), bounded by
        ``min(5 s, connectTimeout)``. Records that arrive meanwhile are stored."""
        self._ending = True  # the turns below only take input, up to each echo
        ending = []
        for peer in self._flows():
            flow = peer.flow
            if peer.client is not None:
                # No new flow from here on; one still waiting for its BOT reply closes
                # (it never started: nothing to end with an EOT).
                if peer.client.send_eot(timeout_ms=_EOT_SEND_MS):
                    ending.append(peer)
                else:
                    peer.client.close("the receiver stopped", linger_ms=0)
                continue
            if flow is None or flow.state is not FlowState.READY:
                continue
            try:
                self._send(peer, flow.send_eot(), timeout_ms=_EOT_SEND_MS)
            except (ProtocolError, TransportError) as e:
                log.warning("zio source: cannot send EOT to %s: %s", peer.endpoint, e)
                continue
            ending.append(peer)
        deadline = self.clock() + min(_EOT_WAIT, self.connect_timeout)

        def waiting() -> list[Peer]:
            return [p for p in ending if p.flow is not None and p.flow.state is FlowState.EOT_SENT]

        while waiting() and self.clock() < deadline:
            self._loop.turn(0.02)
        for p in waiting():
            log.warning(
                "zio source: %s did not echo our EOT within %g s; its flow may still be open",
                p.endpoint,
                min(_EOT_WAIT, self.connect_timeout),
            )
        for p in ending:
            if p.flow is None and p.status.state == "ended":
                self.stats["eot_echoed"] += 1

    def _sockets(self) -> list[Any]:
        """What the receiver polls itself: the bound ports' monitors (the flows' sockets
        are their engines')."""
        return [b.monitor for b in self._bound if b.monitor is not None]

    def _look(self, ready: Collection[object]) -> None:
        """A turn's poll came back: note whether anything was waiting, read the bound
        ports' monitors."""
        self._looked = self.clock()
        self._busy = any(key != self._loop.waker.fd for key in ready)
        if self._busy:
            self._quiet_since = None
        for b in self._bound:
            if b.monitor is not None and b.monitor in ready:
                read_bound_monitor(b, self.stats)

    def _settle(self, now: float) -> None:
        """After every flow's input of a turn: store it (one flush for all producers),
        then pay credit. While stopping (:meth:`_end_with_eot`) only store."""
        if self._appended:
            self._appended = False
            self.spool.flush()
        if self._ending:
            return
        flows = [
            p
            for p in self._flows()
            if p.flow is not None and (p.port is not None or p.bound is not None)
        ]
        # Credit out per producer: plain clients of a bound port may share one, and
        # maxBacklog bounds the partition, whichever flows feed it.
        out: dict[str | None, int] = collections.Counter()
        for peer in flows:
            assert peer.flow is not None
            out[peer.producer] += peer.flow.outstanding
        room = self._plain_room()
        for peer in flows:
            self._pay(peer, now, out, room)
        if self._held_now or self._withheld_since:
            self._count_withheld()
        if not self._busy and self._quiet_since is None:
            self._quiet_since = self.clock()
        self.looked_at = self._looked

    def _plain_room(self) -> list[int] | None:
        """``plain_budget``: the records the plain givers may still be given credit for
        (what they gave and the credit they hold count), as a one-item list the turn's
        payments draw on; None without a budget."""
        if self.plain_budget is None:
            return None
        used = sum(st.records for st in self._done if not st.ack_capable)
        for peer in self._flows():
            if peer.producer is None or peer.terms.ack:
                continue
            used += peer.status.records
            if peer.flow is not None:
                used += self._in_credit(peer)
        return [self.plain_budget - used]

    def _per_dat(self, peer: Peer) -> int:
        """The most records one of ``peer``'s DATs may carry (the credit rule's count)."""
        return self._credit_rule.per_dat(arrow=peer.arrow, seen=peer.dat_rows)

    def _in_credit(self, peer: Peer) -> int:
        """The most records ``peer`` may still send on the credit it holds."""
        assert peer.flow is not None
        return peer.flow.outstanding * self._per_dat(peer)

    def _count_withheld(self) -> None:
        """Start or end each producer's spell of credit withheld for ``maxBacklog``."""
        held, now = self._held_now, self.clock()
        with self._lock:
            for p in [p for p in self._withheld_since if p not in held]:
                since = self._withheld_since.pop(p)
                self._withheld_s[p] = self._withheld_s.get(p, 0.0) + max(0.0, now - since)
            for p in held:
                self._withheld_since.setdefault(p, now)
        held.clear()

    def _take(self, peer: Peer, msg: Message, now: float) -> bool:
        """Take one message of ``peer``'s flow; False once that flow ended or failed."""
        flow = peer.flow
        assert flow is not None
        # Fast lane: a plain DAT without attributes, the reference giver's kind.
        if (
            msg.label == DAT_LABEL
            and not peer.arrow
            and len(msg.payload) == 1
            and msg.form == FLOW_FORM
            and flow.take_dat()
        ):
            self._take_plain(peer, msg)
        else:
            try:
                self._on_message(peer, msg, now)
            except (ProtocolError, ValueError) as e:
                self.stats["dropped"] += 1
                self._fail(peer, f"{type(e).__name__}: {e}", now)
                return False
            if peer.flow is not flow:  # the flow ended (EOT) or failed
                return False
        pend = peer.pending
        if pend.bytes >= _PENDING_BYTES_MAX or pend.dats >= _PENDING_DATS_MAX:
            self._append_pending(peer, now)
            if peer.flow is not flow:  # the append failed this flow
                return False
        return True

    def _drained(self, peer: Peer, now: float) -> None:
        """One read of ``peer``'s socket is over: store what it brought."""
        if peer.flow is None or peer.producer is None:
            return
        self._append_pending(peer, now)
        if peer.said_idle and peer.flow is not None:
            peer.status.idle = True

    def _on_message(self, peer: Peer, msg: Message, now: float) -> None:
        assert peer.flow is not None
        event = peer.flow.receive(msg)
        if isinstance(event, Data):
            self._on_data(peer, event)
            return
        if isinstance(event, BotReceived):
            if peer.bound is not None:  # pragma: no cover - a client's BOT opens its flow
                raise RemoteProtocolError("a second BOT on one flow", field="flow", value="BOT")
            self._on_bot(peer, event)
        elif isinstance(event, Rejected):
            self._fail(peer, f"producer rejected the flow: {dict(event.attrs)}", now)
        elif isinstance(event, EotReceived):
            # Everything before the EOT is in the spool before the flow reads as ended.
            flow = peer.flow
            self._append_pending(peer, now)
            if peer.flow is not flow:  # the append failed this flow
                return
            if peer.flow.state is FlowState.EOT_RECEIVED:
                self._send(peer, peer.flow.send_eot())
            peer.status.state = "ended"
            # An acknowledging producer resumes after what we hold on a new flow; a plain
            # giver starts over (a reference server gives its whole stream to each new
            # flow): reopening would take the same records again, endlessly.
            again = self.reconnect and peer.terms.ack and peer.bound is None
            if peer.client is not None:
                # The echo just queued must reach the giver (a reference giver waits
                # for it in eot()): closed with linger 0, it was lost under load.
                peer.client.end(
                    "end of transmission", reopen=again, now=now, linger_ms=_ECHO_LINGER_MS
                )
            else:
                self._end_flow(peer, eot=False)
            self._mark_open(peer, False)
            if self.reconnect and not again and peer.bound is None:
                log.info(
                    "zio source: plain giver %s ended its flow (EOT); not reopening it, "
                    "as a plain giver would start over",
                    peer.endpoint,
                )
        elif isinstance(event, Credit):  # pragma: no cover - a taker gets no PAY
            raise RemoteProtocolError("PAY sent to a taker")

    def _on_bot(self, peer: Peer, bot: BotReceived) -> None:
        """The server's reply to our BOT: only what it states as its own counts."""
        terms = client_terms("taker", peer.sent, bot.attrs)
        self._start_flow(peer, terms.producer or peer.endpoint, terms)
        # A plain giver that sent our BOT back (a reference server: every attribute of
        # our offer returns) and announces our whole credit may be echoing that too, its
        # real window unknown and possibly smaller: credit goes to it as PAYs of 1. A
        # giver that wrote its own BOT states its own credit.
        peer.pay_one = echoes_offer(
            peer.sent, bot.attrs, announced=bot.credit, offered=self.credit, profile=terms.profile
        )
        if terms.profile:
            self._on_state(peer, bot.attrs)
        assert peer.producer is not None  # _start_flow named it
        self.spool.peers.remember(peer.endpoint, peer.producer)

    def _start_flow(self, peer: Peer, producer: str, terms: Terms) -> None:
        peer.producer = producer
        peer.terms = terms
        peer.arrow = terms.encoding == ENCODING
        if peer.client is not None:
            peer.client.backoff.reset()
        peer.pending = self._pending.setdefault(producer, Pending())
        st = peer.status
        st.producer, st.state = producer, "receiving"
        st.ack_capable, st.at_most_once = terms.ack, not terms.ack
        st.encoding = "arrow" if peer.arrow else "plain"
        peer.acked = self.spool.ack_end(producer) - 1
        peer.said_idle = st.idle = False
        st.flows += 1
        st.last_data = self.clock()
        st.position = terms.last
        if terms.last is not None:
            with self._lock:
                known = self.positions.get(producer)
                if known is None or terms.last < known:
                    if known is not None:
                        log.warning(
                            "zio source: producer %s now states position %d, below the %d "
                            "it stated before (a restarted producer without those records)",
                            producer,
                            terms.last,
                            known,
                        )
                    self.positions[producer] = terms.last
        if not terms.ack:
            self._mark_open(peer, True)

    def _on_state(self, peer: Peer, attrs: Any) -> None:
        """A zio-spark producer's stated state, in a DAT or its BOT (:func:`dat_profile`).

        A bad value fails the flow like any other bad attribute (``RemoteProtocolError``
        naming it): only producers that negotiated the profile send these, so a wrong
        type is a broken producer, not a plain peer's own attribute (plain DATs'
        attributes are headers and are never read here).
        """
        state = dat_profile(attrs)
        peer.said_idle = state.more is False
        if not peer.said_idle:
            peer.status.idle = False
        if state.blocked_ms is not None and peer.producer is not None:
            with self._lock:
                self._blocked_ms[peer.producer] = state.blocked_ms

    def _pay(
        self, peer: Peer, now: float, out: dict[str | None, int], room: list[int] | None = None
    ) -> None:
        """Pay ``peer``'s flow what the maxBacklog rule allows, with the latest ack
        (:mod:`~zio_spark.protocol.credit`); ``out``: credit out per producer; ``room``:
        what ``plain_budget`` leaves the plain givers (:meth:`_plain_room`)."""
        flow = peer.flow
        assert flow is not None
        if flow.state is not FlowState.READY or peer.producer is None:
            return
        ack = self.spool.ack_end(peer.producer) - 1
        n = 0
        if flow.credit > 0 and not self._credit_held:
            decided = self._credit_rule.pay(
                held=flow.credit,
                backlog=self.spool.backlog().get(peer.producer, 0),
                outstanding=out[peer.producer],
                flow_outstanding=flow.outstanding,
                arrow=peer.arrow,
                seen=peer.dat_rows,
            )
            n = decided.amount
            if decided.held_back:
                self._held_now.add(peer.producer)
            if room is not None and not peer.terms.ack:
                per_dat = self._per_dat(peer)
                n = min(n, max(0, room[0] // per_dat))
                room[0] -= n * per_dat
        # ``ack`` only to a giver that stated it keeps records for acks (pay_attrs).
        attrs = pay_attrs(peer.terms, ack, peer.acked)
        if attrs is not None:
            # Counted before the send: the giver may act on the ack (and a caller see
            # it) before this thread goes on. A failed send fails the flow.
            peer.acked = ack
            self.stats["acks_sent"] += 1
        try:
            for credit, with_ack in pays(n, attrs, in_ones=peer.pay_one):
                self._send(peer, flow.pay(credit, with_ack))
        except TransportError as e:
            self._fail(peer, f"cannot send PAY: {e}", now)
            return
        out[peer.producer] += n


# A drain appends every so many DATs or bytes: enough to spread an append's fixed cost
# over many one-record DATs, small enough that records reach the spool (and the status
# the availableNow trigger watches) steadily.
_PENDING_BYTES_MAX = 8 << 20
# Stop: the most we wait for the echoes of our EOTs (bounded by connectTimeout too).
_EOT_WAIT = 5.0
# Stop: the most one EOT send blocks (ms), what closing one flow costs at most (s), and
# the margin for the turn in progress when stop() is called (s): Receiver.stop_bound.
_EOT_SEND_MS = 500
_END_FLOW_S = 0.2
_STOP_MARGIN = 10.0
_PENDING_DATS_MAX = 256
# A flow the giver ended (EOT): how long its port may still send our echo when it closes.
_ECHO_LINGER_MS = 200
# The longest poll wait of the receiver's loop (s).
_TURN_S = 0.05


class _Turns:
    """The receiver's own share of each loop turn (a
    :class:`~zio_spark.transport.loop.LoopPart`): after the flows' engines took their
    input, store it and pay credit."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def sockets(self) -> list[Any]:
        return self.receiver._sockets()

    def process(self, ready: Collection[object], now: float) -> None:
        self.receiver._look(ready)

    def tick(self, now: float) -> float | None:
        self.receiver._settle(now)
        return None


class _EndpointTaker(ClientHandler):
    """The taker of the flows to one endpoint we connect to (its
    :class:`~zio_spark.transport.flow_client.FlowClient`'s handler): every message goes
    the receiver's way (:meth:`Receiver._take`, the same for both topologies)."""

    disconnected_text = "disconnected"

    def __init__(self, receiver: Receiver, peer: Peer) -> None:
        self.receiver = receiver
        self.peer = peer

    def offer(self, conn: ClientFlow) -> Offer:
        return self.receiver._offer(self.peer, conn)

    def on_message(self, conn: ClientFlow, msg: Message) -> bool:
        if self.peer.flow is conn.flow:
            self.receiver._take(self.peer, msg, self.receiver.clock())
        return True

    def on_drained(self, conn: ClientFlow, now: float) -> None:
        if self.peer.flow is conn.flow:
            self.receiver._drained(self.peer, now)

    def on_failure(self, conn: ClientFlow | None, why: str, counter: str, final: bool) -> None:
        self.receiver._failed(self.peer, why, counter, final)

    def on_close(self, conn: ClientFlow, reason: str) -> None:
        if self.peer.flow is conn.flow:
            self.receiver._closed(self.peer, self.receiver.clock())

    def closed_unanswered(self, conn: ClientFlow) -> str:
        # Patient: only a connection that had completed its handshake fails at once.
        return self.disconnected_text

    def no_reply(self, conn: ClientFlow, timeout: float) -> tuple[str, bool]:
        return self.receiver._diagnosis(conn)
