"""The source's receiver: takes records from ZIO producers into the spool, with credit.

Runs in Spark's long-lived streaming runner process (never in a reader's ``__init__``:
sockets do not pickle). One thread owns every socket. For each producer endpoint it runs
a ZIO flow as the *client taker*:

1. connect a client port and send ``BOT{direction: inject, credit: C, stream, ack: true,
   resume: R, encoding: ["arrow"], batch: K}``. ``R`` is the last sequence number the
   spool holds for that producer (durably): an ack-capable producer resends from ``R+1``.
   ``K`` caps records per DAT so the backlog bound below is exact.
2. every DAT goes into the spool: Arrow batches from our own producers, or one record per
   DAT from a plain ZIO giver (numbered here, ``seq = held + 1``). Records at or below what
   the spool holds are dropped (resends).
3. after each burst of input the spool is flushed (one fsync for all producers) and only
   then is credit handed back, so every record covered by a PAY is durable. Credit is
   handed back only while ``backlog + (outstanding + n) * K <= maxBacklog``: a slow query
   stops the producers and memory stays bounded.
4. ``commit(end)`` (after Spark's commit of a micro-batch) acknowledges ``end - 1`` to the
   producer on the next PAY, or on an ack-only PAY when no credit is held.

A flow that fails (the peer disconnects, times out on BOT, or breaks the protocol) is
closed, counted, and reopened after a back-off with a fresh BOT, so a restarted producer
is picked up without restarting the query. Producer ids learned from BOTs are persisted
in the spool folder (``peers.json``) so ``resume`` is right after a runner restart too.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import zmq

from zio_spark.errors import DataLossError, ProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    Flow,
    FlowState,
    Rejected,
    Role,
    profile_bot,
)
from zio_spark.protocol.message import DAT_LABEL, FLOW_FORM, Message
from zio_spark.queue.spool import WAL_SCHEMA, Record, Spool
from zio_spark.records import ENCODING, decode_batch, plain_value
from zio_spark.transport.port import BadMessage, ClientPort

__all__ = ["PeerStatus", "Receiver"]

log = logging.getLogger("zio_spark.source")


@dataclass
class PeerStatus:
    """What the receiver knows about one producer endpoint (for progress and tests)."""

    endpoint: str
    producer: str | None = None
    state: str = "connecting"  # connecting | receiving | ended | failed | waiting
    ack_capable: bool = False
    encoding: str = "plain"
    records: int = 0
    duplicates: int = 0
    failures: int = 0
    last_error: str | None = None
    at_most_once: bool = False  # plain peer: records in flight before the spool may be lost


@dataclass
class _Peer:
    endpoint: str
    status: PeerStatus
    mode: str | None = None
    port: ClientPort | None = None
    flow: Flow | None = None
    monitor: zmq.Socket[bytes] | None = None
    producer: str | None = None
    arrow: bool = False
    opened_at: float = 0.0
    retry_at: float = 0.0
    acked: int = 0  # last ack sent
    backoff: float = 0.2
    # Most records seen in one Arrow DAT (0: none yet). A giver that ignores the
    # ``batch`` we ask for in BOT sends bigger DATs: credit is then sized by what it
    # really sends, and one credit at a time until its first DAT shows the size.
    dat_rows: int = 0
    # What one drain took in, appended to the spool in one go when it ends (a spool
    # append per DAT costs more than the DAT itself when DATs are small): WAL batches
    # (Arrow givers) or records (plain givers), and the last seq among them.
    pending_batches: list[pa.RecordBatch] = field(default_factory=list)
    pending_records: list[Record] = field(default_factory=list)
    pending_last: int = 0
    pending_bytes: int = 0
    pending_dats: int = 0


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
        How long to wait for a producer's BOT before retrying.
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
        curve: tuple[bytes, bytes, bytes] | None = None,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        reconnect: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self.spool = spool
        self.credit = credit
        self.max_backlog = max_backlog
        # Records per DAT we accept: with it, backlog <= max_backlog holds exactly.
        self.batch = max(1, min(1000, max_backlog // credit))
        self.stream = stream
        self.connect_timeout = connect_timeout
        self.mode = mode
        self.curve = curve
        self.ctx = ctx or zmq.Context.instance()
        self.clock = clock
        self.reconnect = reconnect
        self.wall_clock_us = wall_clock_us
        self.stats: collections.Counter[str] = collections.Counter()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._committed: dict[str, int] = dict(spool.committed())
        self._ids_path = os.path.join(str(spool.path), "peers.json")
        self._known_ids: dict[str, str] = self._load_ids()
        self.error: BaseException | None = None
        self.fatal: DataLossError | None = None
        for ep in endpoints:
            self._add(ep)

    # -- public (any thread) -----------------------------------------------------------

    def start(self) -> Receiver:
        self._thread = threading.Thread(target=self._run, name="zio-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End every flow with EOT (best effort, bounded) and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

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
        with self._lock:
            for producer, end in offsets.items():
                if end > self._committed.get(producer, 0):
                    self._committed[producer] = end

    def flush_acks(self, timeout: float = 5.0) -> bool:
        """Wait until every connected producer was sent the latest committed ack."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                pending = [
                    p
                    for p in self._peers.values()
                    if p.producer is not None
                    and p.flow is not None
                    and p.flow.state is FlowState.READY
                    and p.acked < self._committed.get(p.producer, 1) - 1
                ]
            if not pending:
                return True
            self._stop.wait(0.01)
        return False

    def status(self) -> list[PeerStatus]:
        with self._lock:
            return [PeerStatus(**vars(p.status)) for p in self._peers.values()]

    def _call(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)

    # -- peers ---------------------------------------------------------------------------

    def _load_ids(self) -> dict[str, str]:
        try:
            with open(self._ids_path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable %s: %s", self._ids_path, e)
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _save_ids(self) -> None:
        tmp = self._ids_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._known_ids, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._ids_path)

    def _add(self, endpoint: str, mode: str | None = None) -> None:
        with self._lock:
            if endpoint not in self._peers:
                self._peers[endpoint] = _Peer(endpoint, PeerStatus(endpoint), mode or self.mode)

    def _remove(self, endpoint: str) -> None:
        with self._lock:
            peer = self._peers.pop(endpoint, None)
        if peer is not None:
            self._end_flow(peer, eot=True)

    def _open(self, peer: _Peer, now: float) -> None:
        port = ClientPort(
            self.ctx, mode=peer.mode, linger_ms=0, send_timeout_ms=1000, **self._curve_kwargs()
        )
        monitor = port.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        port.connect(peer.endpoint)
        flow = Flow(Role.CLIENT)
        producer = peer.producer or self._known_ids.get(peer.endpoint)
        resume = self.spool.next_seq(producer) - 1 if producer else 0
        attrs: dict[str, Any] = {
            "stream": self.stream,
            "ack": True,
            "resume": resume,
            "encoding": [ENCODING],
            "batch": self.batch,
        }
        port.send(flow.send_bot(Direction.INJECT, self.credit, attrs))
        peer.port, peer.flow, peer.monitor = port, flow, monitor
        peer.opened_at = now
        peer.status.state = "connecting"

    def _curve_kwargs(self) -> dict[str, Any]:
        if self.curve is None:
            return {}
        server_key, public_key, secret_key = self.curve
        return {
            "curve_server_key": server_key,
            "curve_public_key": public_key,
            "curve_secret_key": secret_key,
        }

    def _end_flow(self, peer: _Peer, *, eot: bool) -> None:
        if peer.port is not None:
            if eot and peer.flow is not None and peer.flow.state is FlowState.READY:
                with contextlib.suppress(ProtocolError, TransportError):
                    peer.port.send(peer.flow.send_eot(), timeout_ms=100)
            if peer.monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    peer.port.socket.disable_monitor()
                peer.monitor.close(0)
            peer.port.close(linger_ms=100 if eot else 0)
        peer.port = peer.flow = peer.monitor = None

    def _fail(self, peer: _Peer, why: str, now: float) -> None:
        self.stats["flow_failures"] += 1
        peer.status.failures += 1
        peer.status.last_error = why
        peer.status.state = "waiting"
        log.warning("producer %s: %s; reconnecting in %.1f s", peer.endpoint, why, peer.backoff)
        self._end_flow(peer, eot=False)
        peer.retry_at = now + peer.backoff
        peer.backoff = min(peer.backoff * 2, 5.0)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._turn()
        except BaseException as e:  # reported through .error and the status, never silent
            self.error = e
            log.exception("receiver failed")
        finally:
            for peer in list(self._peers.values()):
                self._end_flow(peer, eot=True)

    def _turn(self) -> None:
        while self._calls:
            self._calls.popleft()()
        now = self.clock()
        poller = zmq.Poller()
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            if peer.port is None and now >= peer.retry_at:
                try:
                    self._open(peer, now)
                except TransportError as e:
                    self._fail(peer, f"cannot connect: {e}", now)
            if peer.port is not None:
                poller.register(peer.port.socket, zmq.POLLIN)
                if peer.monitor is not None:
                    poller.register(peer.monitor, zmq.POLLIN)
        ready = dict(poller.poll(50)) if poller.sockets else {}
        if not poller.sockets:
            self._stop.wait(0.05)
        appended = False
        for peer in peers:
            if peer.port is None:
                continue
            if peer.monitor is not None and peer.monitor in ready:
                self._fail(peer, "disconnected", now)
                continue
            if peer.port.socket in ready:
                appended |= self._drain(peer, now)
            if (
                peer.port is not None
                and peer.flow is not None
                and peer.flow.state is FlowState.BOT_SENT
                and now - peer.opened_at > self.connect_timeout
            ):
                self._fail(peer, f"no BOT within {self.connect_timeout} s", now)
        if appended:
            self.spool.flush()
        for peer in peers:
            if peer.port is not None and peer.flow is not None:
                self._pay(peer, now)

    def _drain(self, peer: _Peer, now: float) -> bool:
        assert peer.port is not None
        appended = False
        budget = 10_000  # bounded, so one busy peer does not starve the others
        while budget > 0:
            port, flow = peer.port, peer.flow
            if port is None or flow is None:
                break
            try:
                got = port.recv_many(min(budget, _DRAIN_BATCH), 0)
            except TransportError as e:
                self._fail(peer, str(e), now)
                break
            if not got:
                break
            budget -= len(got)
            for msg in got:
                if type(msg) is BadMessage:
                    self.stats["dropped"] += 1
                    self._fail(peer, f"bad message: {msg.error}", now)
                    budget = 0
                    break
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
                        budget = 0
                        break
                    if peer.flow is not flow:  # the flow ended (EOT) or failed
                        budget = 0
                        break
                if (
                    peer.pending_bytes >= _PENDING_BYTES_MAX
                    or peer.pending_dats >= _PENDING_DATS_MAX
                ):
                    appended |= self._append_pending(peer, now)
                    if peer.flow is not flow:  # the append failed this flow
                        budget = 0
                        break
        # What arrived before a failure was valid and in order: it is kept.
        return self._append_pending(peer, now) or appended

    def _take_plain(self, peer: _Peer, msg: Message) -> None:
        """A plain DAT without attributes: its one payload frame is the record's value;
        what :meth:`_on_data` makes of it, without looking for attributes."""
        producer = peer.producer
        assert producer is not None  # a flow takes DATs only after the BOT named it
        seq = (peer.pending_last or self.spool.next_seq(producer) - 1) + 1
        value = msg.payload[0]
        peer.pending_records.append(
            Record(seq, value, None, msg.origin, msg.granule, self.wall_clock_us(), None)
        )
        peer.pending_bytes += len(value)
        peer.pending_dats += 1
        peer.pending_last = seq

    def _append_pending(self, peer: _Peer, now: float) -> bool:
        """Append what the drain took in; True if anything new reached the spool."""
        batches, records = peer.pending_batches, peer.pending_records
        if not batches and not records:
            return False
        peer.pending_batches, peer.pending_records, peer.pending_last = [], [], 0
        peer.pending_bytes = peer.pending_dats = 0
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
            if peer.flow is not None:
                self._end_flow(peer, eot=True)
            peer.retry_at = float("inf")
            return False
        except (ValueError, pa.ArrowException) as e:
            # Records the spool cannot take (e.g. too large for one WAL record): this
            # peer's flow fails, as it would have on the DAT; the others go on.
            self.stats["dropped"] += 1
            self._fail(peer, f"cannot store records: {type(e).__name__}: {e}", now)
            return False
        peer.status.records += new
        peer.status.duplicates += total - new
        self.stats["records"] += new
        return new > 0

    def _on_message(self, peer: _Peer, msg: Message, now: float) -> None:
        assert peer.flow is not None
        event = peer.flow.receive(msg)
        if isinstance(event, Data):
            self._on_data(peer, event)
            return
        if isinstance(event, BotReceived):
            self._on_bot(peer, event)
        elif isinstance(event, Rejected):
            self._fail(peer, f"producer rejected the flow: {dict(event.attrs)}", now)
        elif isinstance(event, EotReceived):
            # Everything before the EOT is in the spool before the flow reads as ended.
            self._append_pending(peer, now)
            if peer.port is None:  # the append failed this flow
                return
            if peer.flow.state is FlowState.EOT_RECEIVED:
                peer.port.send(peer.flow.send_eot())
            peer.status.state = "ended"
            self._end_flow(peer, eot=False)
            peer.retry_at = now + peer.backoff if self.reconnect else float("inf")
        elif isinstance(event, Credit):  # pragma: no cover - a taker gets no PAY
            raise RemoteProtocolError("PAY sent to a taker")

    def _on_bot(self, peer: _Peer, bot: BotReceived) -> None:
        prof = profile_bot(bot.attrs)
        producer = prof.producer or peer.endpoint
        peer.producer = producer
        peer.arrow = prof.encodings == (ENCODING,)
        peer.backoff = 0.2
        st = peer.status
        st.producer, st.state = producer, "receiving"
        st.ack_capable, st.at_most_once = prof.ack, not prof.ack
        st.encoding = "arrow" if peer.arrow else "plain"
        peer.acked = self._committed.get(producer, 1) - 1
        if self._known_ids.get(peer.endpoint) != producer:
            self._known_ids[peer.endpoint] = producer
            self._save_ids()

    def _on_data(self, peer: _Peer, data: Data) -> None:
        """Take one DAT's records into the drain's pending append."""
        producer = peer.producer
        assert producer is not None
        held = peer.pending_last or self.spool.next_seq(producer) - 1
        ts = self.wall_clock_us()
        origin = data.message.origin
        if peer.arrow:
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
            wal = _wal_batch(batch, held, origin, ts)
            if wal is None:
                peer.status.duplicates += batch.num_rows
                self.stats["duplicate_dats"] += 1
                return
            peer.pending_batches.append(wal)
            peer.pending_bytes += wal.nbytes
            peer.pending_dats += 1
            peer.pending_last = max(held, first + batch.num_rows - 1)
            return
        else:
            value, nframes = plain_value(data.message.payload)
            headers = {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.attrs.items()}
            if nframes > 1:
                headers["zio.frames"] = str(nframes)
            key = None
            if "key" in data.attrs and isinstance(data.attrs["key"], str):
                with contextlib.suppress(ValueError):
                    key = base64.b64decode(data.attrs["key"], validate=True)
            records = [
                Record(held + 1, value, key, origin, data.message.granule, ts, headers or None)
            ]
        peer.pending_records.extend(records)
        peer.pending_bytes += len(value)
        peer.pending_dats += 1
        peer.pending_last = held + 1

    def _start_at(self, producer: str, first: int) -> int:
        """First contact with a producer whose records start at ``first > 1``.

        An ack-capable producer forgets a record only once a taker acknowledged it, so
        records below ``first`` were delivered elsewhere (an earlier batch read, another
        spool): the stream starts at ``first``, recorded as a commit, instead of a
        sequence gap that would fail the query as data loss.
        """
        log.info("producer %r: first records start at seq %d; starting there", producer, first)
        self.spool.commit({producer: first})
        with self._lock:
            self._committed[producer] = max(self._committed.get(producer, 0), first)
        return self.spool.next_seq(producer) - 1

    def _pay(self, peer: _Peer, now: float) -> None:
        flow = peer.flow
        assert flow is not None and peer.port is not None
        if flow.state is not FlowState.READY or peer.producer is None:
            return
        committed = self._committed.get(peer.producer, 1)
        ack = committed - 1
        held = flow.credit
        n = 0
        if held > 0:
            backlog = self.spool.backlog().get(peer.producer, 0)
            # Records a DAT may carry: up to ``batch`` (or what the producer was seen to
            # send) in Arrow, exactly one in a plain DAT.
            per_dat = max(self.batch, peer.dat_rows) if peer.arrow else 1
            room = (self.max_backlog - backlog) // per_dat - flow.outstanding
            if peer.arrow and peer.dat_rows == 0:
                room = min(room, 1 - flow.outstanding)  # probe: how big are its DATs?
            n = max(0, min(held, room))
        attrs: dict[str, Any] | None = None
        if ack > peer.acked:
            attrs = {"ack": ack}
        if n == 0 and attrs is None:
            return
        try:
            peer.port.send(flow.pay(n, attrs), timeout_ms=1000)
        except TransportError as e:
            self._fail(peer, f"cannot send PAY: {e}", now)
            return
        if attrs is not None:
            peer.acked = ack
            self.stats["acks_sent"] += 1


_U64 = 1 << 64
# A drain appends every so many DATs or bytes: enough to spread an append's fixed cost
# over many one-record DATs, small enough that records reach the spool (and the status
# the availableNow trigger watches) steadily.
_PENDING_BYTES_MAX = 8 << 20
_PENDING_DATS_MAX = 256
# Messages taken from a port per recv_many call while draining.
_DRAIN_BATCH = 256


def _wal_batch(batch: pa.RecordBatch, held: int, origin: int, ts: int) -> pa.RecordBatch | None:
    """Turn a wire batch into the spool's columns, dropping records already held."""
    first = batch.column(0)[0].as_py()
    skip = max(0, held + 1 - first)
    if skip >= batch.num_rows:
        return None
    b = batch.slice(skip) if skip else batch
    n = b.num_rows
    signed_origin = origin - _U64 if origin >= 1 << 63 else origin
    granule = b.column(3)
    if granule.null_count:
        granule = pc.fill_null(granule, 0)
    return pa.RecordBatch.from_arrays(
        [
            b.column(1),
            b.column(2),
            b.column(0),
            pa.repeat(pa.scalar(signed_origin, pa.int64()), n),
            granule,
            pa.repeat(pa.scalar(ts, pa.timestamp("us", tz="UTC")), n),
            b.column(4),
        ],
        schema=WAL_SCHEMA,
    )
