"""The receiver's bind mode: a flow server that giver clients connect to.

With ``bind``, the :class:`~zio_spark.source.receiver.Receiver` binds a server port
like the reference's flow broker; every giver client that opens a flow with
``BOT{direction: extract}`` is a producer partition (its ``producer`` id, or its
endpoint for a plain giver). :class:`BoundFlows` holds the methods that bind the port,
drain it, make a :class:`~zio_spark.source.receiver_peers.Peer` for each new client,
answer strays (messages of no open flow) and read the port's monitor. A mixin of
:class:`Receiver`: it runs in the receiver's thread on the receiver's state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from zio_spark.codec.records import ENCODING
from zio_spark.errors import ProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Direction,
    Flow,
    Role,
)
from zio_spark.protocol.message import (
    FLOW_FORM,
    Message,
    encode_flow_label,
    parse_flow_label,
)
from zio_spark.protocol.negotiate import server_terms
from zio_spark.source.receiver_peers import (
    DONE_KEPT,
    DRAIN_BATCH,
    Bound,
    Peer,
    PeerStatus,
    ReceiverParts,
)
from zio_spark.transport.port import (
    BadMessage,
    PeerId,
    ServerPort,
    format_peer,
)

__all__ = ["BoundFlows"]

log = logging.getLogger("zio_spark.source")

_BOUND_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_REBIND_S = 5.0  # how long a bind waits for an address a closing socket still holds
_LOG_STRAY_FIRST = 20


class BoundFlows(ReceiverParts):
    """The receiver's bind mode (a mixin of :class:`~zio_spark.source.receiver.Receiver`)."""

    def _bind(self, endpoint: str) -> None:
        kwargs: dict[str, Any] = {}
        if self.curve is not None:  # as the server: our own key pair
            kwargs = {"curve_secret_key": self.curve[2], "curve_public_key": self.curve[1]}
        port = ServerPort(
            self.ctx, mode=self.mode, linger_ms=0, send_timeout_ms=1000, sndhwm=0, **kwargs
        )
        try:
            # A receiver of this process that just stopped may still hold the address
            # for a moment (libzmq closes sockets in its I/O thread): retry briefly.
            deadline = time.monotonic() + _REBIND_S
            while True:
                try:
                    actual = port.bind(endpoint)
                    break
                except TransportError as e:
                    if "in use" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            monitor = port.socket.get_monitor_socket(_BOUND_EVENTS)
        except BaseException:
            port.close(linger_ms=0)
            raise
        self._bound.append(Bound(endpoint, port, actual, monitor=monitor))
        log.info("zio source: bound %s (%s) for giver clients", actual, port.socket_type)

    def _drain_bound(self, b: Bound, now: float) -> bool:
        """Take what giver clients sent to a bound port; a client that breaks the protocol
        loses its flow, the others go on."""
        budget = 10_000
        touched: dict[str, Peer] = {}
        while budget > 0:
            got = b.port.recv_many(min(budget, DRAIN_BATCH), 0)
            if not got:
                break
            budget -= len(got)
            for item in got:
                if isinstance(item, BadMessage):
                    self.stats["dropped"] += 1
                    bad = b.flows.get(item.peer) if isinstance(item.peer, (bytes, int)) else None
                    if bad is not None:
                        self._fail(bad, f"bad message: {item.error}", now)
                    continue
                rid, msg = item
                peer = b.flows.get(rid)
                if peer is None:
                    peer = self._new_client(b, rid, msg, now)
                    if peer is None or peer.producer is None:
                        continue
                elif not self._take(peer, msg, now):
                    continue
                if peer.producer is not None and peer.flow is not None:
                    touched[peer.producer] = peer
        appended = False
        for peer in touched.values():
            appended |= self._append_pending(peer, now)
        for peer in touched.values():
            if peer.said_idle and peer.flow is not None:
                peer.status.idle = True  # what it sent before is stored (appended above)
        return appended

    def _new_client(self, b: Bound, rid: PeerId, msg: Message, now: float) -> Peer | None:
        """The first message of a client we have no flow with: it must be a BOT."""
        flow = Flow(Role.SERVER, origin=b.origin)
        name = f"{b.actual} <- {format_peer(rid)}"
        try:
            event = flow.receive(msg)
        except ProtocolError as e:
            self._stray(b, rid, name, msg, str(e))
            return None
        if not isinstance(event, BotReceived):
            self._stray(b, rid, name, msg, f"{type(event).__name__} before any BOT")
            return None
        peer = Peer(name, PeerStatus(name), bound=b, rid=rid, flow=flow)
        with self._lock:
            b.flows[rid] = peer
        try:
            self._on_client_bot(peer, event, msg, now)
        except (ProtocolError, TransportError, ValueError) as e:
            self.stats["dropped"] += 1
            self._fail(peer, f"{type(e).__name__}: {e}", now)
        return peer

    def _stray(self, b: Bound, rid: PeerId, name: str, msg: Message, why: str) -> None:
        """A client without a flow here: ours failed it, or this receiver restarted while
        the client's flow was open, or it never sent a BOT. Counted, logged while rare,
        and a DAT or PAY is answered once with an EOT that says so: the client ends that
        flow instead of waiting for credit that will never come."""
        self.stats["stray_messages"] += 1
        if self.stats["stray_messages"] <= _LOG_STRAY_FIRST:
            log.warning("zio source: %s sent a message outside any flow (%s); dropped", name, why)
        try:
            kind = parse_flow_label(msg.label).get("flow") if msg.form == FLOW_FORM else None
        except RemoteProtocolError:
            kind = None
        if kind not in ("DAT", "PAY") or rid in b.told:
            return
        b.told[rid] = None
        while len(b.told) > DONE_KEPT:
            del b.told[next(iter(b.told))]
        label = encode_flow_label(
            {
                "flow": "EOT",
                "reason": "no flow with you here (ended, or this source restarted): "
                "open a new one with a BOT",
            }
        )
        with contextlib.suppress(TransportError):
            b.port.send(Message(FLOW_FORM, label, 0, b.origin, 0, 0, ()), rid, timeout_ms=100)

    def _on_bound_monitor(self, b: Bound) -> None:
        assert b.monitor is not None
        while b.monitor.poll(0):
            event = parse_monitor_message(b.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_ACCEPTED:
                b.accepted += 1
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                b.accepted = max(0, b.accepted - 1)
            elif event == zmq.EVENT_DISCONNECTED and b.accepted > 0:
                # Accepted, never handshaken, gone: libzmq refused the peer's socket type.
                b.accepted -= 1
                self.stats["handshake_failures"] += 1
                ours = b.port.socket_type
                fix = (
                    "a CLIENT needs socket=clientserver here (a draft-enabled pyzmq)"
                    if ours == "ROUTER"
                    else "a DEALER needs socket=routerdealer here"
                )
                log.warning(
                    "zio source: a client of %s failed the ZMTP handshake: our socket is a "
                    '%s and it cannot talk to the client\'s (%s; README section "Sockets")',
                    b.actual,
                    ours,
                    fix,
                )

    def _on_client_bot(self, peer: Peer, bot: BotReceived, msg: Message, now: float) -> None:
        """A giver client opened a flow on a bound port: answer with our statements.

        The producer id is the client's ``producer`` attribute, or for a plain client
        ``origin:<n>`` from the BOT's coord ``origin`` (which names the sending node in
        the reference): stable across the client's restarts. Plain clients that share an
        origin feed one partition, their records numbered here in arrival order. A client
        stating a producer id that another live flow holds replaces that flow (the
        producer restarted; its old connection is gone or going).
        """
        assert peer.flow is not None and peer.bound is not None
        flow = peer.flow
        if bot.direction is not Direction.EXTRACT:
            self._send(peer, flow.reject({"reason": "this is a source: give (direction extract)"}))
            raise RemoteProtocolError(
                f"client BOT direction {bot.direction.value!r}: a source takes only from "
                "givers (direction 'extract')",
                field="direction",
                value=bot.direction.value,
            )
        terms = server_terms("taker", bot.attrs, (ENCODING,))
        if terms.stream is not None and terms.stream != self.stream:
            self._send(peer, flow.reject({"reason": f"no stream {terms.stream!r} here"}))
            raise RemoteProtocolError(
                f"client gives stream {terms.stream!r}; this source takes {self.stream!r}",
                field="stream",
                value=terms.stream,
            )
        producer = terms.producer or f"origin:{msg.origin}"
        if terms.producer is not None:
            for other in list(peer.bound.flows.values()):
                if other is not peer and other.producer == producer:
                    log.info(
                        "zio source: %s replaces the flow of producer %r from %s",
                        peer.endpoint,
                        producer,
                        other.endpoint,
                    )
                    other.status.state = "ended"
                    other.status.last_error = "replaced by a new flow of the same producer"
                    self._end_flow(other, eot=True)
        self._start_flow(peer, producer, terms)
        if terms.profile:
            self._on_state(peer, bot.attrs)
        attrs: dict[str, Any] = {}
        if terms.encoding is not None:
            attrs["encoding"] = terms.encoding
        if terms.profile:
            attrs["stream"] = self.stream
            attrs["resume"] = self.spool.next_seq(producer) - 1
            attrs["batch"] = self.batch
            if terms.ack:
                attrs["ack"] = True
        self._send(peer, flow.accept(min(self.credit, bot.credit), attrs))
        log.info(
            "zio source: giver client %s opened a flow as producer %r (%s, %s)",
            peer.endpoint,
            producer,
            peer.status.encoding,
            "acknowledged" if terms.ack else "at most once",
        )
