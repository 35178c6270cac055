"""The receiver's bind mode: a flow server that giver clients connect to.

With ``bind``, the :class:`~zio_spark.source.receiver.Receiver` binds a server port
like the reference's flow broker and serves it with an inline
:class:`~zio_spark.transport.flow_server.FlowServer` on the receiver's loop; every giver
client that opens a flow with ``BOT{direction: extract}`` is a producer partition (its
``producer`` id, or ``origin:<n>`` for a plain giver). Here: :func:`bind_port` (the port,
with a retry for an address a closing socket still holds), :class:`BoundTaker` (the
taker handler of one client flow), :func:`answer_stray` (input of no open flow) and
:func:`read_bound_monitor` (clients that never complete the ZMTP handshake). All run in
the receiver's thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from zio_spark.codec.records import ENCODING
from zio_spark.errors import ProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import BotReceived, Direction
from zio_spark.protocol.message import (
    FLOW_FORM,
    Message,
    encode_flow_label,
    parse_flow_label,
)
from zio_spark.protocol.negotiate import server_terms
from zio_spark.source.receiver_peers import DONE_KEPT, Bound, Peer, PeerStatus
from zio_spark.transport.curve import server_curve
from zio_spark.transport.flow_server import FlowHandler, ServerFlow
from zio_spark.transport.port import PeerId, ServerPort, format_peer

if TYPE_CHECKING:
    from zio_spark.options import Curve
    from zio_spark.source.receiver import Receiver

__all__ = ["BoundTaker", "answer_stray", "bind_port", "read_bound_monitor"]

log = logging.getLogger("zio_spark.source")

_BOUND_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_REBIND_S = 5.0  # how long a bind waits for an address a closing socket still holds
_LOG_STRAY_FIRST = 20


def bind_port(
    endpoint: str,
    ctx: zmq.Context[zmq.Socket[bytes]],
    mode: str | None,
    curve: Curve | None,
) -> tuple[ServerPort, str, zmq.Socket[bytes]]:
    """Bind a server port on ``endpoint``: the port, the address as bound and a monitor.

    Raises
    ------
    TransportError
        If ``endpoint`` cannot be bound (in use for more than 5 s, malformed).
    """
    # As the server: our own key pair, our public key is what our clients use.
    server = None if curve is None else server_curve(curve.secret_key, curve.public_key)
    port = ServerPort(ctx, curve=server, mode=mode, linger_ms=0, send_timeout_ms=1000, sndhwm=0)
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
    return port, actual, monitor


class BoundTaker(FlowHandler):
    """The taker of one giver client's flow on a bound port (made per client BOT).

    Every message after the BOT goes the receiver's way (:meth:`Receiver._take`, the
    same for both topologies); what one read of the port brought is stored once
    (:meth:`on_drained`).
    """

    def __init__(self, receiver: Receiver, bound: Bound) -> None:
        self.receiver = receiver
        self.bound = bound
        self.peer: Peer | None = None

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        r, b = self.receiver, self.bound
        name = f"{b.actual} <- {format_peer(conn.peer)}"
        peer = Peer(name, PeerStatus(name), bound=b, rid=conn.peer, flow=conn.flow, conn=conn)
        self.peer = peer
        with r._lock:
            b.flows[conn.peer] = peer
        now = r.clock()
        try:
            self._answer(peer, bot, conn.bot_origin)
        except (ProtocolError, TransportError, ValueError) as e:
            r.stats["dropped"] += 1
            r._fail(peer, f"{type(e).__name__}: {e}", now)

    def on_message(self, conn: ServerFlow, msg: Message) -> bool:
        peer = self.peer
        if peer is not None and peer.flow is not None:
            self.receiver._take(peer, msg, self.receiver.clock())
        return True

    def on_drained(self, conn: ServerFlow, now: float) -> None:
        peer, r = self.peer, self.receiver
        if peer is None or peer.flow is None or peer.producer is None:
            return
        r._append_pending(peer, now)
        if peer.said_idle and peer.flow is not None:
            peer.status.idle = True  # what it sent before is stored (appended above)

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        """The server ended the flow (a bad message, a failed send, the port closing):
        the receiver files it like a failure of its own; one it ended itself is done."""
        peer = self.peer
        if peer is None or peer.flow is None:
            return
        if reason.startswith("protocol error"):
            self.receiver.stats["dropped"] += 1
        self.receiver._fail(peer, reason, self.receiver.clock())

    def _answer(self, peer: Peer, bot: BotReceived, origin: int) -> None:
        """A giver client opened a flow on a bound port: answer with our statements.

        The producer id is the client's ``producer`` attribute, or for a plain client
        ``origin:<n>`` from the BOT's coord ``origin`` (which names the sending node in
        the reference): stable across the client's restarts. Plain clients that share an
        origin feed one partition, their records numbered here in arrival order. A client
        stating a producer id that another live flow holds replaces that flow (the
        producer restarted; its old connection is gone or going).
        """
        r, b = self.receiver, self.bound
        assert peer.flow is not None
        flow = peer.flow
        if bot.direction is not Direction.EXTRACT:
            r._send(peer, flow.reject({"reason": "this is a source: give (direction extract)"}))
            raise RemoteProtocolError(
                f"client BOT direction {bot.direction.value!r}: a source takes only from "
                "givers (direction 'extract')",
                field="direction",
                value=bot.direction.value,
            )
        terms = server_terms("taker", bot.attrs, (ENCODING,))
        if terms.stream is not None and terms.stream != r.stream:
            r._send(peer, flow.reject({"reason": f"no stream {terms.stream!r} here"}))
            raise RemoteProtocolError(
                f"client gives stream {terms.stream!r}; this source takes {r.stream!r}",
                field="stream",
                value=terms.stream,
            )
        producer = terms.producer or f"origin:{origin}"
        if terms.producer is not None:
            for other in list(b.flows.values()):
                if other is not peer and other.producer == producer:
                    log.info(
                        "zio source: %s replaces the flow of producer %r from %s",
                        peer.endpoint,
                        producer,
                        other.endpoint,
                    )
                    other.status.state = "ended"
                    other.status.last_error = "replaced by a new flow of the same producer"
                    r._end_flow(other, eot=True)
        r._start_flow(peer, producer, terms)
        if terms.profile:
            r._on_state(peer, bot.attrs)
        attrs: dict[str, Any] = {}
        if terms.encoding is not None:
            attrs["encoding"] = terms.encoding
        if terms.profile:
            attrs["stream"] = r.stream
            attrs["resume"] = r.spool.next_seq(producer) - 1
            attrs["batch"] = r.batch
            if terms.ack:
                attrs["ack"] = True
        r._send(peer, flow.accept(min(r.credit, bot.credit), attrs))
        log.info(
            "zio source: giver client %s opened a flow as producer %r (%s, %s)",
            peer.endpoint,
            producer,
            peer.status.encoding,
            "acknowledged" if terms.ack else "at most once",
        )


def answer_stray(b: Bound, stats: Counter[str], rid: PeerId, msg: Message | None, why: str) -> None:
    """Input of a client without a flow here: ours failed it, or this receiver restarted
    while the client's flow was open, or it never sent a BOT. Counted, logged while rare,
    and a DAT or PAY is answered once with an EOT that says so: the client ends that flow
    instead of waiting for credit that will never come. (``msg`` None: it did not parse,
    counted as dropped.)"""
    if msg is None:
        stats["dropped"] += 1
        return
    name = f"{b.actual} <- {format_peer(rid)}"
    stats["stray_messages"] += 1
    if stats["stray_messages"] <= _LOG_STRAY_FIRST:
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


def read_bound_monitor(b: Bound, stats: Counter[str]) -> None:
    """Count the clients of ``b`` that were accepted and left without a ZMTP handshake
    (``stats["handshake_failures"]``), logging the socket kinds' fix."""
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
            stats["handshake_failures"] += 1
            ours = b.port.socket_type
            fix = (
                "a CLIENT needs socket=clientserver here (a draft-enabled pyzmq)"
                if ours == "ROUTER"
                else "a DEALER needs socket=routerdealer here"
            )
            log.warning(
                "zio source: a client of %s failed the ZMTP handshake: our socket is a "
                "%s and it cannot talk to the client's (%s; docs/flows.md section "
                '"Sockets: CLIENT/SERVER or ROUTER/DEALER")',
                b.actual,
                ours,
                fix,
            )
