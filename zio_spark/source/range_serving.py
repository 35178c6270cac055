"""A bound producer serves range reads (the direct read mode, docs/direct-read.md).

The pure protocol is :mod:`zio_spark.protocol.ranges`; this module wires its giver side
into :class:`~zio_spark.source.producer.Producer`'s server port:

- **Routing.** The port's :class:`~zio_spark.transport.flow_server.FlowServer` makes one
  :class:`ProducerFlowHandler` per client. A client whose BOT says ``read: "range"``
  or ``read: "control"`` (:func:`~zio_spark.protocol.ranges.server_read_mode`) gets a
  :class:`RangeFlow` (a control flow for the latter); every other client is the normal
  taker, served exactly as
  :class:`~zio_spark.transport.giver.GiverHandler` serves it. A range flow never attaches
  to the backlog: it is not a taker, so it does not replace (end) the taker's flow, does
  not move its ``resume`` or the numbering, and the taker's BOT does not end range flows
  (the giver's "one taker at a time" rule looks only at flows that give).
- **Capability.** Every BOT reply of the port, the taker's included, states
  ``ranges: 1`` and the producer's current incarnation
  (:func:`~zio_spark.protocol.ranges.state_capability`).
- **Serving.** A range flow answers ``held`` queries with the backlog's window now
  (``first``: the oldest record not yet acknowledged, ``end``: the next seq to assign)
  and ``range`` requests by :class:`~zio_spark.protocol.ranges.RangeGiver`'s rule, one
  DAT per paid credit: Arrow DATs with a ``seq`` column (the normal giver's encoder), or
  plain DATs with ``seq`` in the label if the reader did not offer Arrow. Reads are
  read-only: nothing is marked sent, released or counted as delivered (delivery counts
  stay about the real takers; ``stats["range_records"]`` counts what range flows sent).
  With ``turn_dats`` (the queue's flow producer port: its broker's one thread serves
  every socket of the queue), each range flow sends at most that many DATs per turn of
  the owner's loop (:meth:`RangeService.new_turn`) and the rest, in order, in the next
  turns (``deferred`` tells the owner to turn again without waiting for input); per
  flow, so every flow with credit progresses every turn. Without it (a bound producer:
  a loop of its own) a flow sends all its credit pays for at once.
- **Thread-safety.** Everything here runs in the server's loop thread. The held records
  are shared with the application's :meth:`Producer.send` threads, so each step reads
  the incarnation, the window and the records it sends under the backlog's lock
  (:meth:`~zio_spark.source.backlog.ProducerBacklog.read_held`), in one go; the Arrow
  encoding is done after the lock is released (the columns taken are lists of immutable
  values).
- **Acks** come on the driver's control flow (direct mode) or the taker's flow (spool
  mode). A PAY carrying ``ack`` on a range flow is refused (EOT with the reason, then the
  flow is dropped as a protocol violation) and frees nothing. On a control flow an ack
  must ride with ``commit: {id, producer, incarnation}``: the giver checks it against the
  window and its incarnation and frees up to it in the same hold of the backlog's lock
  (:meth:`~zio_spark.source.backlog.ProducerBacklog.commit_held`, which releases through
  the taker's own path: memory, the retention folder, the ``acked`` count of
  :meth:`Producer.delivery`: what the wire acknowledged). Another incarnation: refused,
  nothing freed, the flow goes on; at or below what was freed: a no-op; beyond the last
  record: EOT with the reason naming both numbers, the flow dropped, nothing freed. A
  control flow is no taker either; next to a spool-mode taker of the same producer, acks
  from both free up to the larger (freeing is monotonic).
- **Strays.** A PAY or DAT from a client with no flow here (its flow was open on a
  process of this producer that was killed, and libzmq reconnected it to this one) is
  answered once with an EOT saying so (:meth:`RangeService.answer_stray`): a driver's
  control flow, a task's range flow or a taker then opens a new flow at once, instead
  of waiting out its timeout for an answer that never comes.
- **Run keys** (``admit`` on a control flow, docs/direct-read.md "Security"). A producer
  with an allow-list of CURVE client keys runs a ZAP handler
  (:class:`~zio_spark.transport.curve.CurveAuthenticator`, ``gate``): a driver whose key
  is on the list opens its control flow and registers its query run's public key; the
  key is leased to that control flow (admitted at the next handshakes) until the flow
  closes, when the lease ends and new connections with it are refused. The lease is
  taken before the answer goes out, so a driver that has the answer can hand the key
  to its tasks. Without an allow-list the answer is ``open`` and nothing is stored.
- **Flows bound to keys** (with a ``gate`` only). ZAP judges a connection once, at its
  handshake; which flows it may open is decided at its BOT from the key it came with
  (the ZAP ``User-Id`` of the connection, which the port keeps:
  ``ServerPort(user_ids=True)``): a key on the allow-list (a taker, a driver) opens any
  flow; a leased run key opens range reads only, so a task holding it cannot open a
  control flow (free records, admit more keys) or a taker's flow (drain the backlog);
  any other key (a run key whose lease ended since the handshake, or none) opens none.
  A refusal is the BOT's rejection (EOT) with a reason naming the flow kind, the key
  kind and the fix (:meth:`RangeService.key_refusal`; ``stats["flows_refused_key"]``).
- **Readers that vanish.** A range or control flow whose reader is gone without EOT (a
  Spark task SIGKILLed, an executor lost, a driver killed) would otherwise stay open
  until the producer closes. The port knows which connection each flow's BOT came on
  (``ServerPort(conn_ids=True)``) and runs ZMTP heartbeats (a silent peer host is
  disconnected by libzmq); the server looks at those connections every ``conn_check``
  seconds (:meth:`ProducerFlowHandler.watches_connection`) and removes a flow whose
  connection libzmq closed: ``stats["range_flows_gone"]`` /
  ``stats["control_flows_gone"]``. Only the flow's own state goes: nothing is sent
  (the reader is gone), nothing is freed or acknowledged (a held record stays held
  until a commit acks it), and a control flow's run key is released as on its EOT. A
  quiet reader whose connection is up is never removed, however long it is quiet. The
  taker's flow is not watched (a new taker's BOT replaces it, as before).
- **Incarnation.** One per producer: a random one at start (``new_incarnation`` over
  ``os.urandom(16)``) or the one given (a producer with durable retention passes the one
  it persisted). When a taker's ``resume`` makes the backlog renumber held records, a new
  one is drawn at once (under the lock, before anything is served with the new numbers),
  and every range flow opened on the old one ends with EOT without another DAT.
- **Record sources.** What a :class:`RangeService` serves from is a
  :class:`RangeSource`: a giver's backlog that can also show its held window and records
  (:class:`HeldView`) to a function run under its lock, and free up to a commit in the
  same hold. Two implement it: the bound producer's
  :class:`~zio_spark.source.backlog.ProducerBacklog` (records in memory, optionally
  retained on disk) and the queue's
  :class:`~zio_spark.pzq.flow_ports.FlowProducerPort` (records read back from the
  queue's message store; its numbering and incarnation kept in the store folder's side
  log). A view's ``take`` may come back short or empty at a seq it cannot produce (a
  store record lost or unreadable): the range is then refused ``not_held`` with a window
  that starts after that seq, never served with a hole in it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from zio_spark.codec.records import DAT_BYTES, ENCODING, encode_records
from zio_spark.errors import ConfigError, LocalProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    EotReceived,
    FlowState,
    pay_ack,
)
from zio_spark.protocol.message import FLOW_FORM, Message, encode_flow_label, parse_flow_label
from zio_spark.protocol.ranges import (
    READ_CONTROL,
    READ_RANGE,
    Acked,
    AdmitRequest,
    Admitted,
    CommitRefused,
    HeldQuery,
    RangeGiver,
    Records,
    Window,
    check_incarnation,
    encode_reply,
    forbid_requests,
    new_incarnation,
    server_read_mode,
    state_capability,
)
from zio_spark.transport.curve import CurveAuthenticator
from zio_spark.transport.flow_client import ClientFlow
from zio_spark.transport.flow_server import ServerFlow
from zio_spark.transport.giver import (
    Backlog,
    GiverHandler,
    GiverPolicy,
    Taken,
    plain_attrs,
    taker_terms,
)
from zio_spark.transport.port import PeerId, ServerPort, format_peer

__all__ = ["HeldView", "ProducerFlowHandler", "RangeFlow", "RangeService", "RangeSource"]

log = logging.getLogger("zio_spark.transport")

_STALE = object()  # a step's answer: the flow's incarnation is no longer the producer's
_STRAYS_TOLD = 1024  # clients told "no flow here" remembered (each is told once)
_LOG_STRAY_FIRST = 20  # strays logged (then only counted)
_STRAY_EOT = (
    "no flow with you here (it ended, or this producer restarted while it was open): "
    "open a new one with a BOT"
)

T = TypeVar("T")


class HeldView(Protocol):
    """A source's held records as a range flow reads them, under the source's lock."""

    @property
    def first(self) -> int:
        """The oldest held record (``next_seq`` if none is held)."""
        ...

    @property
    def next_seq(self) -> int:
        """The seq the next record will get: the window's end."""
        ...

    def take(self, first: int, n: int, max_bytes: int | None = None) -> Taken | None:
        """Up to ``n`` contiguous held records from seq ``first`` (``first`` lies in the
        window); fewer, or None, where a record cannot be produced (a hole)."""
        ...


class RangeSource(Backlog, Protocol):
    """What a :class:`RangeService` serves from: a giver's backlog (the taker's flow
    uses it as such) whose held records range flows can read (module docstring)."""

    on_renumber: Callable[[], None] | None
    """Set by the service: called under the source's lock when held records get other
    numbers (a source that never renumbers never calls it)."""

    @property
    def last_seq(self) -> int:
        """The last seq numbered (0: none yet)."""
        ...

    @property
    def kept_incarnation(self) -> str | None:
        """The incarnation the source's durable records are numbered in (None: it keeps
        no numbering across restarts; the service draws one)."""
        ...

    def prepare_held(self) -> bool:
        """Before a held answer: number what is available, so the window shows it.
        False: not done yet (a source that numbers a slice per loop turn); the answer
        waits, and the flow asks again at its next tick."""
        ...

    def read_held(self, read: Callable[[HeldView], T]) -> T:
        """``read(view)`` under the source's lock; ``read`` changes nothing."""
        ...

    def commit_held(self, step: Callable[[HeldView], tuple[T, int | None]]) -> T:
        """``step(view)`` under the lock, then free up to the number it returns (None:
        nothing), in the same hold, as a taker's ack frees (monotonic)."""
        ...

    def window_full_since(self, mark: int) -> tuple[bool, int]:
        """Whether a sender began to wait for room in the source's window since ``mark`` (what
        this returned before; 0 at first) or waits now, and the next mark. A source that
        never holds its senders back: ``(False, 0)``. Called under the source's lock (it
        must be reentrant)."""
        ...


class RangeService:
    """A producer's range serving: its incarnation, its range flows, the port's handlers.

    ``incarnation``: the one to state (checked by the protocol's rules; None: a fresh
    random one). ``gate``: the port's ZAP handler when the producer has an allow-list
    of CURVE client keys (control flows lease their run keys on it). Hooks itself into
    ``backlog`` (``on_renumber``).

    Raises
    ------
    ConfigError
        If ``incarnation`` is malformed.
    """

    def __init__(
        self,
        backlog: RangeSource,
        policy: GiverPolicy,
        *,
        incarnation: str | None = None,
        stats: collections.Counter[str] | None = None,
        gate: CurveAuthenticator | None = None,
        turn_dats: int | None = None,
    ) -> None:
        if turn_dats is not None and (
            isinstance(turn_dats, bool) or not isinstance(turn_dats, int) or turn_dats < 1
        ):
            raise ConfigError("range_turn_dats", turn_dats, "an integer >= 1, or None")
        kept = backlog.kept_incarnation
        if incarnation is None:
            # A retention folder (a queue's store) keeps its records *and* their numbers
            # across restarts: its incarnation is the source's. Else a fresh one:
            # numbering restarts.
            incarnation = kept if kept is not None else new_incarnation(os.urandom(16))
        elif kept is not None and incarnation != kept:
            raise ConfigError(
                "incarnation",
                incarnation,
                f"none, or the retention folder's own {kept!r} (the folder's records are "
                "numbered in that one)",
            )
        else:
            try:
                check_incarnation(incarnation)
            except LocalProtocolError as e:
                raise ConfigError(
                    "incarnation",
                    incarnation,
                    "1..64 ASCII letters, digits, '.', '_' or '-' (the name of the "
                    "producer's sequence-number space)",
                ) from e
        self.backlog = backlog
        self.policy = policy
        self.gate = gate
        self.stats = stats if stats is not None else collections.Counter()
        self._incarnation = incarnation
        self.flows: set[RangeFlow] = set()  # open range flows (loop thread)
        self.turn_dats = turn_dats
        self.turn = 0  # the owner's loop turn (new_turn)
        self.deferred = False  # a range flow has credit and DATs left for the next turn
        self._told: dict[PeerId, None] = {}  # strays told to open a new flow (in order)
        backlog.on_renumber = self._renumbered

    @property
    def incarnation(self) -> str:
        """The producer's sequence-number space now."""
        return self._incarnation

    def new_turn(self) -> None:
        """The owner's loop starts another turn: every range flow may send
        ``turn_dats`` DATs again (with ``turn_dats`` only; loop thread)."""
        self.turn += 1
        self.deferred = False

    def handler(self) -> ProducerFlowHandler:
        """The server port's handler factory: one per client."""
        return ProducerFlowHandler(self)

    def _renumbered(self) -> None:
        # Under the backlog's lock: the held records just got other numbers. A range
        # flow's next step sees the new incarnation and ends instead of serving.
        # With retention the folder drew the new name (its HEAD, written first): the
        # same one survives this producer's restart.
        kept = self.backlog.kept_incarnation
        fresh = kept if kept is not None else new_incarnation(os.urandom(16))
        old, self._incarnation = self._incarnation, fresh
        self.stats["incarnations"] += 1
        log.warning(
            "producer %s: records renumbered; incarnation %s replaces %s (range flows of "
            "the old one end)",
            self.policy.producer_id,
            self._incarnation,
            old,
        )

    def stray_answerer(self, port: ServerPort) -> Callable[[PeerId, Message | None, str], None]:
        """The ``on_stray`` of a :class:`FlowServer` on ``port`` (:meth:`answer_stray`,
        origin 0): the producer's and the queue's flow producer port alike."""
        return lambda peer, msg, why: self.answer_stray(port, 0, peer, msg, why)

    def answer_stray(
        self, port: ServerPort, origin: int, peer: PeerId, msg: Message | None, why: str
    ) -> None:
        """The server port's ``on_stray`` (loop thread): input of a client without a flow
        here. Counted (``stats["stray_messages"]``), logged while rare, and a PAY or DAT
        is answered once per client with an EOT: after a kill and restart of this
        producer on the same endpoint, the reader's socket reconnects by itself and its
        next request lands here, where no flow knows it; without an answer the reader
        would wait its whole timeout (the driver's trigger, a task's read) before it
        opens a new flow. A message that did not parse (``msg`` None) is only counted."""
        self.stats["stray_messages"] += 1
        if msg is None:
            return
        if self.stats["stray_messages"] <= _LOG_STRAY_FIRST:
            log.warning(
                "producer %s: %s sent a message outside any flow (%s)",
                self.policy.producer_id,
                format_peer(peer),
                why,
            )
        try:
            kind = parse_flow_label(msg.label).get("flow") if msg.form == FLOW_FORM else None
        except RemoteProtocolError:
            kind = None
        if kind not in ("DAT", "PAY") or peer in self._told:
            return
        self._told[peer] = None
        while len(self._told) > _STRAYS_TOLD:
            del self._told[next(iter(self._told))]
        label = encode_flow_label({"flow": "EOT", "reason": _STRAY_EOT})
        with contextlib.suppress(TransportError):
            port.send(Message(FLOW_FORM, label, 0, origin, 0, 0, ()), peer, timeout_ms=100)

    def end_flows(self, reason: str) -> None:
        """End every open range flow with EOT (loop thread; e.g. the producer closes)."""
        for flow in list(self.flows):
            try:
                flow.end(reason)
            except TransportError as e:  # that reader is gone: nothing to tell it
                log.info("producer %s: cannot end a range flow: %s", self.policy.producer_id, e)

    def window(self, records: HeldView) -> Window:
        return Window(records.first, records.next_seq)

    def key_refusal(self, user_id: str | None, mode: str | None) -> str | None:
        """Why a client whose connection came with the CURVE key ``user_id`` (its ZAP
        ``User-Id``, Z85; None: none known) may not open a flow of ``mode`` (``read``:
        ``"range"``, ``"control"``, None for a taker), or None if it may.

        Without a gate every flow is open to whoever got in. With one: a key on the
        allow-list opens any flow; a run key leased now opens range reads only; any
        other key opens none (module docstring, "Flows bound to keys")."""
        gate = self.gate
        if gate is None:
            return None
        key = None if user_id is None else user_id.encode("ascii", "replace")
        if key is not None and key in gate.allowed:
            return None
        leased = key is not None and key in gate.leased
        if leased and mode == READ_RANGE:
            return None
        kind = {READ_RANGE: "a range read", READ_CONTROL: "a control flow"}.get(
            mode or "", "a taker's flow"
        )
        if leased:
            return (
                f"{kind} refused to CURVE key {user_id}: it is a query run's key (leased "
                "by a driver's control flow), which opens range reads only. A control "
                "flow or a taker's flow needs a key on this giver's allow-list: the "
                "source's own curvePublicKey/curveSecretKey, or a key added with "
                "curve_allowed_client_keys / --curve-allow"
            )
        shown = "(none: no ZAP user id on this connection)" if user_id is None else user_id
        return (
            f"{kind} refused to CURVE key {shown}: it is neither on this giver's "
            "allow-list nor a run key admitted now (a run key is admitted only while "
            "its query run's control flow lives: the query stopped or restarted, a task "
            "of an earlier run); restart the query, or put the reader's public key on "
            "the allow-list (curve_allowed_client_keys / --curve-allow)"
        )


class RangeFlow:
    """One range reader's flow (server side, loop thread): requests in PAYs, answers in
    DATs within the paid credit. ``control``: the driver's control flow (``read:
    "control"``): held queries and commits, no range."""

    def __init__(
        self, service: RangeService, conn: ServerFlow, arrow: bool, batch: int, control: bool
    ) -> None:
        self.service = service
        self.conn = conn
        self.arrow = arrow
        self.batch = batch if arrow else 1
        self.control = control
        gated = service.gate is not None
        self.giver = RangeGiver(service.incarnation, control=control, gated=gated)
        self.ending = False
        self._turn = -1  # the service's turn of the DATs counted in _turn_sent
        # The source's window_full_since() mark when this flow's last held answer went.
        self._waits_told = 0
        self._turn_sent = 0

    def _refuse(self, e: RemoteProtocolError) -> RemoteProtocolError:
        """Tell the reader why its flow ends (EOT with the reason); the caller raises
        ``e`` and the server drops the flow as a protocol violation."""
        self.ending = True
        if self.conn.flow.state is FlowState.READY:
            self.conn.send_eot({"reason": str(e)})
        return e

    def on_credit(self, credit: Credit) -> None:
        attrs = credit.attrs
        if self.control:
            try:
                self.giver.on_pay(attrs)
            except RemoteProtocolError as e:
                raise self._refuse(e) from None
            self.pump()
            return
        if pay_ack(attrs) is not None:
            text = (
                f"a range flow never acknowledges (PAY ack {attrs.get('ack')!r}): acks "
                "belong to the taker's flow (the driver's commit), range reads free nothing"
            )
            if self.conn.flow.state is FlowState.READY:
                self.conn.send_eot({"reason": text})
            raise RemoteProtocolError(text, field="ack", value=attrs.get("ack"))
        try:
            self.giver.on_pay(attrs)
        except RemoteProtocolError as e:
            # The reader learns why (an admit or a commit on a range flow, a bad
            # request), not only that its flow is gone.
            raise self._refuse(e) from None
        self.pump()

    def end(self, reason: str) -> None:
        """Send EOT (once) and serve nothing more; the reader's echo closes the flow."""
        if self.ending:
            return
        self.ending = True
        if self.conn.flow.state is FlowState.READY:
            log.info(
                "producer %s: ending range flow of %s: %s",
                self.service.policy.producer_id,
                self.conn.name,
                reason,
            )
            self.conn.send_eot({"reason": reason})

    def _step(self, records: HeldView) -> object:
        """Under the backlog's lock: what to send next, and the records for it."""
        service = self.service
        if self.giver.incarnation != service.incarnation:
            return _STALE
        producer = self.giver.producer
        window = service.window(records) if producer == service.policy.producer_id else None
        if window is not None and isinstance(self.giver.request, HeldQuery):
            # Its answer (a HeldReport) says whether a send began to wait for room since
            # this flow's last one; range DATs never ask.
            full, self._waits_told = service.backlog.window_full_since(self._waits_told)
            window = Window(window.first, window.end, full=full)
        got = self.giver.next(window, self.batch)
        if isinstance(got, Records):
            taken = records.take(got.first, got.count, DAT_BYTES)
            if taken is None or taken.first != got.first or not taken.values:
                # The source cannot produce the record at got.first (a lost store
                # record): the range is refused, with the window past that record.
                assert window is not None
                return self.giver.next(Window(got.first + 1, window.end), self.batch)
            return got, taken
        return got

    def _commit_step(self, records: HeldView) -> tuple[object, int | None]:
        """A control flow's step, under the backlog's lock: the answer, and up to where
        to free (an :class:`Acked` commit's ``upto``; the giver checked it against this
        window and the incarnation, so the release happens under the same lock)."""
        got = self._step(records)
        return got, got.upto if isinstance(got, Acked) else None

    def pump(self) -> None:
        """Answer the open request while credit lasts (loop thread).

        Raises
        ------
        TransportError
            If a send fails (the server then ends this flow).
        """
        conn = self.conn
        flow = conn.flow
        backlog = self.service.backlog
        stats = self.service.stats
        while not self.ending and flow.state is FlowState.READY and flow.credit > 0:
            req = self.giver.request
            if req is None:
                return
            if not self.control and not self._may_send():
                return  # this turn's DATs are sent: the rest in the next turns
            if isinstance(req, HeldQuery) and not backlog.prepare_held():
                return  # numbering goes on at the next loop turn (on_tick asks again)
            if self.control:
                try:
                    step = backlog.commit_held(self._commit_step)
                except RemoteProtocolError as e:  # an ack beyond the end: nothing freed
                    raise self._refuse(e) from None
                if isinstance(step, Acked):
                    stats["control_acks"] += 1
                elif isinstance(step, CommitRefused):
                    stats["control_acks_refused"] += 1
                elif isinstance(step, Admitted) and step.gated:
                    # Leased before the answer goes out: a driver holding the answer may
                    # hand the key to its tasks at once.
                    assert isinstance(req, AdmitRequest) and self.service.gate is not None
                    self.service.gate.lease(self, req.key)
                    stats["run_keys_admitted"] += 1
                    log.info(
                        "producer %s: run key %s admitted while the control flow of %s lives",
                        self.service.policy.producer_id,
                        req.key,
                        conn.name,
                    )
            else:
                step = backlog.read_held(self._step)
            if step is _STALE:
                self.end("the producer renumbered its records (a new incarnation)")
                return
            if isinstance(step, tuple):
                records, taken = step
                assert isinstance(taken, Taken) and taken.first == records.first
                self._send(taken)
                n = len(taken.values)
                self.giver.sent(records, n)
                stats["range_records"] += n
                stats["range_dats"] += 1
                continue
            assert step is not None
            conn.send_dat((), encode_reply(step))  # type: ignore[arg-type]

    def _may_send(self) -> bool:
        """Whether this turn's DAT budget (the service's ``turn_dats``, per flow) has
        room for one more DAT; counts it if so (a range flow's DATs: records, or a
        held answer or a refusal). Per flow, so every range
        flow with credit sends every turn: none waits behind another's range."""
        service = self.service
        budget = service.turn_dats
        if budget is None:
            return True
        if self._turn != service.turn:
            self._turn, self._turn_sent = service.turn, 0
        if self._turn_sent >= budget:
            service.deferred = True
            service.stats["range_turns_deferred"] += 1
            return False
        self._turn_sent += 1
        return True

    def _send(self, got: Taken) -> None:
        if self.arrow:
            payload = encode_records(got.first, got.values, got.keys, got.granules, got.headers)
            self.conn.send_dat((payload,))
            return
        self.conn.send_dat(
            (got.values[0],),
            plain_attrs(
                got.first,
                None if got.keys is None else got.keys[0],
                None if got.headers is None else got.headers[0],
                None if got.granules is None else got.granules[0],
            ),
        )


class ProducerFlowHandler(GiverHandler):
    """The bound producer's handler for one client: a range flow for a reader that asks
    for one (``read: "range"``), else the normal giver's flow (module doc)."""

    def __init__(self, service: RangeService) -> None:
        super().__init__(service.backlog, service.policy)
        self.service = service
        self.range: RangeFlow | None = None

    def reply_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        return state_capability(attrs, self.service.incarnation)

    def on_bot(self, conn: ServerFlow | ClientFlow, bot: BotReceived) -> None:
        if isinstance(conn, ServerFlow):
            try:
                mode = server_read_mode(bot.attrs)
            except RemoteProtocolError as e:
                conn.reject({"reason": str(e)})
                raise
            service = self.service
            if service.gate is not None:
                user_id = conn.server.port.user_id(conn.peer)
                refused = service.key_refusal(user_id, mode)
                if refused is not None:
                    service.stats["flows_refused_key"] += 1
                    if service.stats["flows_refused_key"] <= _LOG_STRAY_FIRST:
                        log.warning(
                            "producer %s: %s: %s",
                            service.policy.producer_id,
                            conn.name,
                            refused,
                        )
                    conn.reject({"reason": refused})
                    return
            if mode is not None:
                self._open_range(conn, bot, control=mode == READ_CONTROL)
                return
        super().on_bot(conn, bot)

    def _open_range(self, conn: ServerFlow, bot: BotReceived, control: bool) -> None:
        service = self.service
        policy = service.policy
        accepted = taker_terms(
            conn, bot, policy, "a range reader takes: connect with direction inject"
        )
        if accepted is None:
            return
        terms, stream = accepted
        arrow = terms.encoding == ENCODING
        limit = terms.batch
        batch = policy.batch if limit is None else min(policy.batch, limit)
        flow = RangeFlow(service, conn, arrow, batch, control)
        attrs: dict[str, Any] = {
            "producer": policy.producer_id,
            "stream": stream,
            "last": service.backlog.last_seq,
        }
        if arrow:
            attrs["encoding"] = ENCODING
        conn.accept(None, state_capability(attrs, flow.giver.incarnation))
        self.range = flow
        service.flows.add(flow)
        service.stats["control_flows" if control else "range_flows"] += 1

    def on_credit(self, conn: ServerFlow | ClientFlow, credit: Credit) -> None:
        if self.range is not None:
            self.range.on_credit(credit)
            return
        if isinstance(conn, ServerFlow):
            forbid_requests(credit.attrs)  # a taker's flow carries no range request
        super().on_credit(conn, credit)

    def on_tick(self, conn: ServerFlow | ClientFlow, now: float) -> None:
        flow = self.range
        if flow is None:
            super().on_tick(conn, now)
            return
        if flow.giver.incarnation != self.service.incarnation:
            flow.end("the producer renumbered its records (a new incarnation)")
            return
        flow.pump()

    def watches_connection(self, conn: ServerFlow) -> bool:
        """A range or control flow ends when its reader's connection closes without EOT
        (module docstring, "Readers that vanish"); a taker's flow keeps the giver's own
        rules (a new taker replaces it)."""
        return self.range is not None

    def on_eot(self, conn: ServerFlow | ClientFlow, eot: EotReceived) -> None:
        if self.range is None:
            super().on_eot(conn, eot)

    def on_close(self, conn: ServerFlow | ClientFlow, reason: str) -> None:
        flow, self.range = self.range, None
        if flow is not None:
            flow.ending = True
            service = self.service
            service.flows.discard(flow)
            if isinstance(conn, ServerFlow) and conn.gone:
                # Only this flow's own state goes: a control flow frees and acks nothing
                # (acks come from commits only); its run key is released below, as on EOT.
                service.stats["control_flows_gone" if flow.control else "range_flows_gone"] += 1
            gate = service.gate
            if gate is not None and gate.release(flow) is not None:
                service.stats["run_keys_revoked"] += 1
                log.info(
                    "producer %s: the control flow of %s ended (%s): its run key is revoked",
                    service.policy.producer_id,
                    conn.name,
                    reason,
                )
            return
        super().on_close(conn, reason)
