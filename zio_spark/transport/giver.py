"""The ack-capable ZIO giver, written once: a flow's sending side over a :class:`Backlog`.

Two givers serve zio-spark takers: the :class:`~zio_spark.source.producer.Producer`
(records held in memory) and the PZQ queue's flow producer port
(:mod:`zio_spark.pzq.flow_ports`, messages assigned from the store). What they share is
here; what differs is their backlog:

- :class:`Backlog` is what a giver sends from: numbered records, kept until a taker
  acknowledges them. :meth:`Backlog.attach` says where a new taker's flow starts (after
  its ``resume``: a resend of what it lacks), :meth:`Backlog.take` what to send next,
  :meth:`Backlog.sent` marks it sent, :meth:`Backlog.ack` forgets what a PAY's ``ack``
  covers.
- :class:`Giving` is one flow's state (the agreed terms, records per DAT, the next seq
  to send) and :meth:`Giving.pump`, which sends while the taker's paid credit lasts: one
  Arrow IPC frame per DAT when ``arrow`` is agreed, else one record per DAT with ``seq``,
  ``key``, ``headers`` and ``granule`` in the label (or the reference's bare label).
- :class:`GiverHandler` serves a taker in either topology, applying its acks and pumping.
  On a server port (a :class:`~.flow_server.FlowServer` handler) it reads the client's
  BOT (:func:`~zio_spark.protocol.negotiate.server_terms`), refuses a wrong direction,
  stream or a plain taker where acks are required (:class:`GiverPolicy`), and keeps one
  taker at a time (a new BOT ends the other flows: a restarted taker). As a client (a
  :class:`~.flow_client.FlowClient` handler, made with ``credit``) it offers
  ``BOT{direction: extract, producer, stream, ack: true, encoding: ["arrow"]}`` and reads
  the server's terms (:func:`~zio_spark.protocol.negotiate.client_terms`): a plain taker
  (a reference server echoing the BOT) gets bare DATs, one record each.
- :meth:`Giving.wake` pumps that flow now through its engine (a backlog with new
  records), its failures ending that flow only.

Credit: a giver spends only what PAYs paid; nothing is sized from a BOT's credit.
Everything here runs in the thread that owns the port.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zio_spark.codec.records import ENCODING, encode_records
from zio_spark.codec.records import plain_attrs as record_attrs
from zio_spark.errors import RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    Flow,
    FlowState,
    pay_ack,
)
from zio_spark.protocol.message import Message
from zio_spark.protocol.negotiate import Terms, client_terms, server_terms
from zio_spark.transport.flow_client import ClientFlow, ClientHandler, Offer
from zio_spark.transport.flow_server import FlowHandler, ServerFlow

__all__ = [
    "PLAIN_RUN",
    "Backlog",
    "GiverConn",
    "GiverHandler",
    "GiverPolicy",
    "Giving",
    "Taken",
    "plain_attrs",
    "taker_terms",
]

log = logging.getLogger("zio_spark.transport")

PLAIN_RUN = 1000
"""Most bare DATs queued in one call (client mode, plain taker)."""


@dataclass(frozen=True, slots=True)
class Taken:
    """Records ``first .. first + len(values) - 1``; a None column means all None."""

    first: int
    values: list[bytes]
    keys: list[bytes | None] | None
    granules: list[int | None] | None
    headers: list[Mapping[str, str] | None] | None

    @property
    def last(self) -> int:
        return self.first + len(self.values) - 1


class Backlog(Protocol):
    """What a giver sends from: numbered records kept until a taker acknowledges them."""

    def attach(self, giving: Giving, resume: int | None) -> int:
        """A taker's flow opened (``resume``: what it holds, None for a plain taker);
        returns the seq to send from (resend from)."""
        ...

    def detach(self, giving: Giving, reason: str) -> None:
        """That flow ended."""
        ...

    def take(self, first: int, n: int, room: int) -> Taken | None:
        """Next to send: up to ``n`` contiguous records from seq ``first`` or the first
        one held after it; None if none. ``room``: records the paid credit allows now (a
        backlog filled lazily, from a store, fetches that many at once)."""
        ...

    def sent(self, first: int, last: int, records: int, dats: int, release: bool) -> None:
        """Mark sent: ``first..last`` went out in ``dats`` DATs; ``release``: a plain
        taker's, to forget now (no ack will come)."""
        ...

    def ack(self, upto: int) -> None:
        """Ack up to: a PAY acknowledged every seq <= ``upto``."""
        ...

    def stated(self, giving: Giving, last: int | None) -> dict[str, Any] | None:
        """The giver's profile state to add to an Arrow DAT ending at ``last``, or to
        the BOT reply (``last`` None): ``more``, ``blocked_ms``; None for none."""
        ...

    def ended(self, giving: Giving, echo: bool) -> None:
        """The taker sent an EOT (``echo``: the answer to ours)."""
        ...


class GiverConn(Protocol):
    """One flow as a giver sends on it (a :class:`ServerFlow` or a :class:`ClientFlow`)."""

    @property
    def flow(self) -> Flow: ...

    @property
    def name(self) -> str: ...

    def send_eot(self, attrs: Mapping[str, Any] | None = None) -> None: ...

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> None: ...


class _BareConn(GiverConn, Protocol):
    def send_dats(self, payloads: Sequence[tuple[bytes, ...]]) -> None: ...


def plain_attrs(
    seq: int, key: bytes | None, headers: Mapping[str, str] | None, granule: int | None
) -> dict[str, Any]:
    """The label of a plain (one record) DAT in the zio-spark profile."""
    attrs = record_attrs(key, headers, {"seq": seq})
    if granule is not None:
        attrs["granule"] = granule
    return attrs


class Giving:
    """How records go to the taker of one flow, in either topology (loop thread).

    ``batch``: the giver's most records per DAT (lowered to the taker's stated limit;
    1 unless Arrow is agreed). ``bare``: plain DATs carry the reference's bare label
    (client mode); else a plain taker's DATs carry the profile attributes. ``conn``: the
    flow; ``wake``: pumps it now through its engine, guarded (see :meth:`wake`).
    """

    def __init__(
        self,
        backlog: Backlog,
        terms: Terms,
        *,
        batch: int,
        bare: bool,
        conn: GiverConn | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.backlog = backlog
        self.terms = terms
        self.arrow = terms.encoding == ENCODING
        limit = terms.batch  # the taker's cap on records per DAT (the receiver refuses more)
        self.batch = (batch if limit is None else min(batch, limit)) if self.arrow else 1
        self.bare = bare and not self.arrow
        self.next_seq = 1  # next record to send to this taker
        self.records = 0  # records put on the wire on this flow
        self.closed = False
        self.conn = conn
        self._wake = wake

    def wake(self) -> None:
        """Pump this flow now (loop thread): records arrived for it. A failure ends the
        flow, not the loop (the engine's guard)."""
        if self._wake is not None and not self.closed:
            self._wake()

    @property
    def acks(self) -> bool:
        return self.terms.ack

    def pump(self, conn: GiverConn) -> None:
        """Send what the backlog holds while the flow has paid credit (loop thread).

        Raises
        ------
        TransportError
            If a send fails (what went out before is marked sent).
        """
        backlog = self.backlog
        flow = conn.flow
        release = not self.terms.ack
        while flow.credit > 0:
            if self.bare:
                run = min(flow.credit, PLAIN_RUN)
                got = backlog.take(self.next_seq, run, run)
                if got is None:
                    return
                bare: _BareConn = conn  # type: ignore[assignment]
                try:
                    bare.send_dats([(v,) for v in got.values])
                except TransportError as e:
                    if e.sent:  # those left; the others stay held for the next flow
                        self._sent(got.first, got.first + e.sent - 1, e.sent, e.sent, release)
                    raise
                n = len(got.values)
                self._sent(got.first, got.last, n, n, release)
                continue
            got = backlog.take(self.next_seq, self.batch, flow.credit * self.batch)
            if got is None:
                return
            if self.arrow:
                payload = encode_records(got.first, got.values, got.keys, got.granules, got.headers)
                conn.send_dat((payload,), backlog.stated(self, got.last))
            else:
                conn.send_dat(
                    (got.values[0],),
                    plain_attrs(
                        got.first,
                        None if got.keys is None else got.keys[0],
                        None if got.headers is None else got.headers[0],
                        None if got.granules is None else got.granules[0],
                    ),
                )
            self._sent(got.first, got.last, len(got.values), 1, release)

    def _sent(self, first: int, last: int, n: int, dats: int, release: bool) -> None:
        self.next_seq = last + 1
        self.records += n
        self.backlog.sent(first, last, n, dats, release)


@dataclass(frozen=True, slots=True)
class GiverPolicy:
    """Who a server port gives to.

    Attributes
    ----------
    producer_id
        Stated in the BOT reply (stable across restarts, for exactly-once).
    stream
        The stream given; a taker asking for another is refused. None: any, the reply
        names the taker's (``"zio"`` if it named none).
    batch
        Most records per DAT (Arrow flows).
    require_ack
        Refuse takers without ``ack: true`` (the reason is ``plain_refusal``).
    plain_refusal
        Why a plain taker is refused, when ``require_ack``.
    """

    producer_id: str
    stream: str | None
    batch: int
    require_ack: bool = False
    plain_refusal: str = "this port gives only to ack-capable takers (BOT ack: true)"


def taker_terms(
    conn: ServerFlow, bot: BotReceived, policy: GiverPolicy, wrong_direction: str
) -> tuple[Terms, str] | None:
    """The terms and stream of a taker's BOT on a giver's server port, or None after
    rejecting it (``wrong_direction``: the reason when it does not take). A BOT that does
    not parse is rejected and its RemoteProtocolError raised (the peer is dropped)."""
    if bot.direction is not Direction.INJECT:
        conn.reject({"reason": wrong_direction})
        return None
    try:
        terms = server_terms("giver", bot.attrs, (ENCODING,))
    except RemoteProtocolError as e:
        conn.reject({"reason": str(e)})
        raise
    stream = policy.stream
    if stream is None:
        stream = terms.stream or "zio"
    elif terms.stream is not None and terms.stream != stream:
        conn.reject({"reason": f"no stream {terms.stream!r} here (this is {stream!r})"})
        return None
    return terms, stream


class GiverHandler(FlowHandler, ClientHandler):
    """One taker's flow over ``backlog``, on a server port or as a client (module doc).

    Server: one taker at a time; an accepted BOT ends every other taker's flow on the
    server (the old client is dead or about to be; what it did not acknowledge is resent
    to the new one from its ``resume``). Client: ``credit`` is what the BOT offers, and
    a server stating another stream than ``policy.stream`` fails the flow.
    """

    def __init__(self, backlog: Backlog, policy: GiverPolicy, *, credit: int = 0) -> None:
        self.backlog = backlog
        self.policy = policy
        self.credit = credit
        self.giving: Giving | None = None

    # -- client mode ---------------------------------------------------------------------

    def offer(self, conn: ClientFlow) -> Offer:
        attrs: dict[str, Any] = {
            "producer": self.policy.producer_id,
            "stream": self.policy.stream,
            "ack": True,
            "encoding": [ENCODING],
        }
        return Offer(Direction.EXTRACT, self.credit, attrs)

    def _on_reply(self, conn: ClientFlow, bot: BotReceived) -> None:
        policy = self.policy
        assert conn.offer is not None
        terms = client_terms("giver", conn.offer.attrs, bot.attrs)
        if terms.stream is not None and terms.stream != policy.stream:
            raise RemoteProtocolError(
                f"the server takes stream {terms.stream!r}; this producer gives {policy.stream!r}",
                field="stream",
                value=terms.stream,
            )
        giving = Giving(
            self.backlog,
            terms,
            batch=policy.batch,
            bare=not terms.profile,
            conn=conn,
            wake=conn.client.poke,
        )
        self.giving = giving
        giving.next_seq = self.backlog.attach(giving, terms.resume if terms.ack else None)
        log.info(
            "producer %s: flow to %s open (%s, encoding %s, credit announced %d)",
            policy.producer_id,
            conn.endpoint,
            f"acks, resume {terms.resume}" if terms.ack else "plain taker, at most once",
            terms.encoding or "plain",
            bot.credit,
        )

    # -- both ----------------------------------------------------------------------------

    def on_bot(self, conn: ServerFlow | ClientFlow, bot: BotReceived) -> None:
        if isinstance(conn, ClientFlow):
            self._on_reply(conn, bot)
            return
        policy = self.policy
        accepted = taker_terms(
            conn, bot, policy, "this port is a producer: connect with direction inject"
        )
        if accepted is None:
            return
        terms, stream = accepted
        if policy.require_ack and not terms.ack:
            conn.reject({"reason": policy.plain_refusal})
            return
        server = conn.server
        giving = Giving(
            self.backlog,
            terms,
            batch=policy.batch,
            bare=False,
            conn=conn,
            wake=lambda: server.poke(conn),
        )
        self.giving = giving
        giving.next_seq = self.backlog.attach(giving, terms.resume if terms.ack else None)
        for other, handler in list(server.flows.values()):
            if other is not conn and isinstance(handler, GiverHandler) and handler.giving:
                # The old flow ends now instead of lingering in the server (forever
                # without an idle timeout) for a client that is gone.
                server.remove(other, "replaced by a new taker")
        attrs: dict[str, Any] = {"producer": policy.producer_id, "stream": stream, "ack": True}
        if giving.arrow:
            attrs["encoding"] = ENCODING
            attrs.update(self.backlog.stated(giving, None) or {})
        conn.accept(None, self.reply_attrs(attrs))

    def reply_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Server: the attributes of the BOT reply to an accepted taker (made after its
        ``resume`` was applied). A subclass adds its own statements here (the
        producer's range capability); default: ``attrs`` as they are."""
        return attrs

    def on_message(self, conn: ServerFlow | ClientFlow, msg: Message) -> bool:
        """No fast lane: a giver's input (PAY, EOT) goes to the flow machine."""
        return False

    def on_drained(self, conn: ServerFlow | ClientFlow, now: float) -> None:
        """Nothing batched per read: credit is acted on as it arrives."""

    def on_data(self, conn: ServerFlow | ClientFlow, data: Data) -> None:
        """Never called: the flow machine refuses DATs sent to a giver."""

    def on_credit(self, conn: ServerFlow | ClientFlow, credit: Credit) -> None:
        ack = pay_ack(credit.attrs)
        if ack is not None and self.giving is not None and self.giving.acks:
            self.backlog.ack(ack)
        self.on_tick(conn, 0.0)

    def on_tick(self, conn: ServerFlow | ClientFlow, now: float) -> None:
        g = self.giving
        if g is None or g.closed or conn.flow.state is not FlowState.READY:
            return
        g.pump(conn)

    def on_eot(self, conn: ServerFlow | ClientFlow, eot: EotReceived) -> None:
        if self.giving is not None:
            self.backlog.ended(self.giving, eot.echo)

    def on_close(self, conn: ServerFlow | ClientFlow, reason: str) -> None:
        g, self.giving = self.giving, None
        if g is not None and not g.closed:
            g.closed = True
            self.backlog.detach(g, reason)
