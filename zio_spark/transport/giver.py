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
- :class:`GiverHandler` serves a taker on a server port (:class:`FlowServer`): it reads
  the client's BOT (:func:`~zio_spark.protocol.negotiate.server_terms`), refuses a wrong
  direction, stream or a plain taker where acks are required (:class:`GiverPolicy`),
  keeps one taker at a time (a new BOT ends the other flows: a restarted taker), applies
  acks and pumps.

Credit: a giver spends only what PAYs paid; nothing is sized from a BOT's credit.
Everything here runs in the thread that owns the port.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from zio_spark.codec.records import ENCODING, encode_records
from zio_spark.codec.records import plain_attrs as record_attrs
from zio_spark.errors import RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Direction,
    EotReceived,
    Flow,
    FlowState,
    pay_ack,
)
from zio_spark.protocol.negotiate import Terms, server_terms
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
]

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
    """One flow as a giver sends on it (a :class:`ServerFlow`, or a client connection)."""

    @property
    def flow(self) -> Flow: ...

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
    (client mode); else a plain taker's DATs carry the profile attributes.
    """

    def __init__(
        self,
        backlog: Backlog,
        terms: Terms,
        *,
        batch: int,
        bare: bool,
        conn: ServerFlow | None = None,
        handler: FlowHandler | None = None,
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
        self.conn = conn  # server mode: to end the flow when a new taker replaces it
        self.handler = handler

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


class GiverHandler(FlowHandler):
    """One taker's flow on a giver's server port, over ``backlog``.

    One taker at a time: an accepted BOT ends every other taker's flow on the server
    (the old client is dead or about to be; what it did not acknowledge is resent to the
    new one from its ``resume``).
    """

    def __init__(self, backlog: Backlog, policy: GiverPolicy) -> None:
        self.backlog = backlog
        self.policy = policy
        self.giving: Giving | None = None

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        policy = self.policy
        if bot.direction is not Direction.INJECT:
            conn.reject({"reason": "this port is a producer: connect with direction inject"})
            return
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
            return
        if policy.require_ack and not terms.ack:
            conn.reject({"reason": policy.plain_refusal})
            return
        giving = Giving(
            self.backlog, terms, batch=policy.batch, bare=False, conn=conn, handler=self
        )
        self.giving = giving
        giving.next_seq = self.backlog.attach(giving, terms.resume if terms.ack else None)
        server = conn.server
        for other, handler in list(server.flows.values()):
            if other is not conn and isinstance(handler, GiverHandler) and handler.giving:
                # The old flow ends now instead of lingering in the server (forever
                # without an idle timeout) for a client that is gone.
                server.remove(other, "replaced by a new taker")
        attrs: dict[str, Any] = {"producer": policy.producer_id, "stream": stream, "ack": True}
        if giving.arrow:
            attrs["encoding"] = ENCODING
            attrs.update(self.backlog.stated(giving, None) or {})
        conn.accept(None, attrs)

    def on_credit(self, conn: ServerFlow, credit: Credit) -> None:
        ack = pay_ack(credit.attrs)
        if ack is not None and self.giving is not None and self.giving.acks:
            self.backlog.ack(ack)
        self.on_tick(conn, 0.0)

    def on_tick(self, conn: ServerFlow, now: float) -> None:
        g = self.giving
        if g is None or g.closed or conn.flow.state is not FlowState.READY:
            return
        g.pump(conn)

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        if self.giving is not None:
            self.backlog.ended(self.giving, eot.echo)

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        if self.giving is not None and not self.giving.closed:
            self.giving.closed = True
            self.backlog.detach(self.giving, reason)
