"""The producer's client mode: connect to a server that takes, open the flow, give.

:class:`ClientGiver` runs the flow of a :class:`~zio_spark.source.producer.Producer`
made with ``connect=EP``: it connects a client port, sends ``BOT{direction: extract,
credit, producer, stream, ack: true, encoding: ["arrow"]}``, reads the server's terms
(:func:`~zio_spark.protocol.negotiate.client_terms`: the client offers, the server
states; an echoed BOT proves nothing), gives from the producer's backlog through a
:class:`~zio_spark.transport.giver.Giving`, and after a disconnect, a flow failure, a
rejection or a server's EOT reconnects with back-off and a fresh BOT, so a restarted
server is picked up. A plain taker (no acks: a reference server echoing our BOT) gets
bare DATs, one record each.

Everything runs in one thread that owns the port; other threads reach it with
:meth:`ClientGiver.call_soon`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from zio_spark.codec.records import ENCODING
from zio_spark.errors import ProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Direction,
    EotReceived,
    Event,
    Flow,
    FlowState,
    Rejected,
    Role,
    pay_ack,
)
from zio_spark.protocol.message import DatCodec
from zio_spark.protocol.negotiate import client_terms
from zio_spark.transport.giver import Giving
from zio_spark.transport.loop import Waker
from zio_spark.transport.port import (
    BadMessage,
    ClientPort,
    PortKind,
    SocketMode,
    socket_type_name,
)

if TYPE_CHECKING:
    from zio_spark.source.producer import Producer

__all__ = ["ClientGiver", "silent_peer_hint"]

log = logging.getLogger("zio_spark.transport")

_CLIENT_SEND_TIMEOUT_MS = 1000  # longest wait to queue one message
_TICK = 0.05  # longest poll wait, seconds
_BACKOFF_MIN, _BACKOFF_MAX = 0.2, 5.0  # seconds before reconnecting
_monitor_ids = itertools.count()


class ClientConn:
    """Client mode: the giver's side of one flow over a :class:`ClientPort`."""

    def __init__(self, port: ClientPort, monitor: zmq.Socket[bytes] | None) -> None:
        self.port = port
        self.monitor = monitor
        self.flow = Flow(Role.CLIENT)
        self._codec = DatCodec(0)

    def send(self, msg: Any) -> None:
        self.port.send(msg, timeout_ms=_CLIENT_SEND_TIMEOUT_MS)

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> None:
        if attrs:
            self.send(self.flow.send_dat(payload, attrs))
        else:
            first = self.flow.send_dats(1)
            self.port.send_dat(self._codec, first, payload, timeout_ms=_CLIENT_SEND_TIMEOUT_MS)

    def send_dats(self, payloads: Sequence[tuple[bytes, ...]]) -> None:
        first = self.flow.send_dats(len(payloads))
        self.port.send_dats(self._codec, first, payloads, timeout_ms=_CLIENT_SEND_TIMEOUT_MS)

    def close(self, linger_ms: int) -> None:
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.port.socket.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        self.port.close(linger_ms=linger_ms)


def silent_peer_hint(endpoint: str, kind: PortKind | str, mode: SocketMode | str) -> str:
    """What to say when a peer at ``endpoint`` never answers: name both socket kinds and
    the fix (libzmq connects a mismatched pair and then delivers nothing, silently).

    ``kind`` and ``mode`` are *our* port's; the hint names the socket the other side
    must have for this to work, and the one that would explain the silence.
    """
    ours = socket_type_name(kind, mode)
    other_kind = PortKind.CLIENT if PortKind(kind) is PortKind.SERVER else PortKind.SERVER
    mode = SocketMode(mode)
    other_mode = (
        SocketMode.ROUTERDEALER if mode is SocketMode.CLIENTSERVER else SocketMode.CLIENTSERVER
    )
    works = socket_type_name(other_kind, mode)
    silent = socket_type_name(other_kind, other_mode)
    fix = (
        f"if the peer has a {silent} socket, use {other_mode.value} on this side "
        f"(--socket {other_mode.value}, or mode={other_mode.value!r} in Python)"
    )
    if other_mode is SocketMode.CLIENTSERVER:
        fix += ", which needs a draft-enabled pyzmq (scripts/build-draft-pyzmq.sh)"
    return (
        f"nothing answered at {endpoint}: this side is a {ours} socket "
        f"({mode.value}), which talks only to a {works} peer; a {silent} peer "
        f"({other_mode.value}) connects and then delivers nothing, silently. Fix: {fix}; "
        "otherwise check that the peer runs at that endpoint"
    )


class ClientGiver:
    """Client mode: connect, open the flow with a BOT, give, and reconnect after failures.

    Everything runs in one thread that owns the port; other threads reach it with
    :meth:`call_soon` (a :class:`~zio_spark.transport.loop.Waker` interrupts the poll).
    """

    def __init__(
        self,
        producer: Producer,
        endpoint: str,
        *,
        ctx: zmq.Context[zmq.Socket[bytes]],
        mode: str | None,
        credit: int,
        connect_timeout: float,
        reconnect: bool,
        linger_ms: int,
        curve: dict[str, Any],
    ) -> None:
        self.producer = producer
        self.endpoint = endpoint
        self.ctx = ctx
        self.credit = credit
        self.connect_timeout = connect_timeout
        self.reconnect = reconnect
        self.linger_ms = linger_ms
        # DATs are sent only within paid credit, at most the credit offered: a bound.
        self._port_kw: dict[str, Any] = {
            "mode": mode,
            "linger_ms": 0,
            "sndhwm": credit + 16,
            "send_timeout_ms": _CLIENT_SEND_TIMEOUT_MS,
            **curve,
        }
        # The first port is made here, so a bad mode or endpoint fails the constructor.
        self.conn: ClientConn | None = self._new_conn()
        self.mode: SocketMode = self.conn.port.mode
        self.socket_type = self.conn.port.socket_type
        self.giving: Giving | None = None
        self.sent_attrs: dict[str, Any] = {}
        self.opened_at = 0.0
        self.bot_sent = False
        self.retry_at = 0.0
        self.backoff = _BACKOFF_MIN
        self.ending = False
        self.last_error: str | None = None
        self._calls: collections.deque[Any] = collections.deque()
        self._stop = threading.Event()
        self._waker = Waker()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name=f"producer {producer.producer_id} -> {endpoint}", daemon=True
        )

    def _new_conn(self) -> ClientConn:
        port = ClientPort(self.ctx, **self._port_kw)
        try:
            # A named address: the default one reads socket.FD, experimental on CLIENT.
            monitor = port.socket.get_monitor_socket(
                zmq.EVENT_DISCONNECTED, f"inproc://zio-producer-monitor-{next(_monitor_ids)}"
            )
        except BaseException:
            port.close(linger_ms=0)
            raise
        conn = ClientConn(port, monitor)
        try:
            port.connect(self.endpoint)
        except BaseException:
            conn.close(0)
            raise
        return conn

    # -- other threads -------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is not None
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call_soon(self, fn: Any) -> None:
        self._calls.append(fn)
        self._waker.wake()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.call_soon(lambda: None)
        if self._thread is not None:
            if self._thread.ident is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    raise TransportError(
                        f"producer loop did not stop within {timeout} s", endpoint=self.endpoint
                    )
            else:  # never started
                self._finish()
            self._thread = None
        self._waker.close()

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._turn()
        except BaseException as e:  # reported, never silent
            self.error = e
            log.exception("producer %s: client loop failed", self.producer.producer_id)
        finally:
            self._finish()

    def _finish(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close(self.linger_ms)
        if self.giving is not None:
            giving, self.giving = self.giving, None
            self.producer._backlog.detach(giving, "producer closed")

    def _turn(self) -> None:
        now = time.monotonic()
        if self.conn is None and not self.ending and now >= self.retry_at:
            try:
                self.conn = self._new_conn()
            except TransportError as e:
                self._fail(f"cannot connect: {e}", "connect_errors", now)
        conn = self.conn
        if conn is not None and not self.bot_sent and not self.ending:
            self._send_bot(conn, now)
            conn = self.conn
        poller = zmq.Poller()
        poller.register(self._waker, zmq.POLLIN)
        if conn is not None:
            poller.register(conn.port.socket, zmq.POLLIN)
            if conn.monitor is not None:
                poller.register(conn.monitor, zmq.POLLIN)
        wait = _TICK
        if conn is None and not self.ending:
            wait = min(wait, max(0.0, self.retry_at - now))
        ready = dict(poller.poll(int(wait * 1000)))
        if self._waker.fd in ready:
            self._waker.drain()
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:
                self.producer.stats["call_errors"] += 1
                log.exception("producer %s: call %r failed", self.producer.producer_id, fn)
        now = time.monotonic()
        conn = self.conn
        if conn is None:
            return
        if conn.port.socket in ready:
            self._drain(conn, now)
        unanswered = self.conn is conn and conn.flow.state is FlowState.BOT_SENT
        if self.conn is conn and conn.monitor is not None and conn.monitor in ready:
            if unanswered:  # also what a socket-kind mismatch looks like: ZMTP refuses it
                self.producer.stats["unanswered"] += 1
                self._fail(
                    "the connection closed before a BOT reply; "
                    + silent_peer_hint(self.endpoint, PortKind.CLIENT, self.mode),
                    "disconnects",
                    now,
                )
            else:
                self._fail("the server disconnected", "disconnects", now)
            return
        if unanswered and now - self.opened_at > self.connect_timeout:
            self.producer.stats["unanswered"] += 1
            self._fail(
                f"no BOT reply within {self.connect_timeout:g} s; "
                + silent_peer_hint(self.endpoint, PortKind.CLIENT, self.mode),
                "bot_timeouts",
                now,
            )
            return
        self.pump()

    def _send_bot(self, conn: ClientConn, now: float) -> None:
        p = self.producer
        attrs: dict[str, Any] = {
            "producer": p.producer_id,
            "stream": p.stream,
            "ack": True,
            "encoding": [ENCODING],
        }
        self.sent_attrs = attrs
        try:
            conn.send(conn.flow.send_bot(Direction.EXTRACT, self.credit, attrs))
        except TransportError as e:
            self._fail(f"cannot send BOT: {e}", "send_failures", now)
            return
        self.bot_sent = True
        self.opened_at = now
        p.stats["connects"] += 1

    def _drain(self, conn: ClientConn, now: float) -> None:
        for _ in range(64):  # bounded: sending gets its turn too
            try:
                msgs = conn.port.recv_many(256, 0)
            except TransportError as e:
                self._fail(str(e), "transport_errors", now)
                return
            if not msgs:
                return
            for msg in msgs:
                if isinstance(msg, BadMessage):
                    self._fail(f"bad message: {msg.error}", "protocol_errors", now)
                    return
                try:
                    event = conn.flow.receive(msg)
                    self._on_event(conn, event, now)
                except ProtocolError as e:
                    self._fail(f"{type(e).__name__}: {e}", "protocol_errors", now)
                    return
                except TransportError as e:
                    self._fail(f"cannot send: {e}", "send_failures", now)
                    return
                if self.conn is not conn:
                    return

    def _on_event(self, conn: ClientConn, event: Event, now: float) -> None:
        p = self.producer
        if isinstance(event, Credit):
            ack = pay_ack(event.attrs)
            g = self.giving
            if ack is not None and g is not None and g.acks:
                p._backlog.ack(ack)
        elif isinstance(event, BotReceived):
            terms = client_terms("giver", self.sent_attrs, event.attrs)
            if terms.stream is not None and terms.stream != p.stream:
                raise RemoteProtocolError(
                    f"the server takes stream {terms.stream!r}; this producer gives {p.stream!r}",
                    field="stream",
                    value=terms.stream,
                )
            giving = Giving(p._backlog, terms, batch=p.batch, bare=not terms.profile)
            self.giving = giving
            giving.next_seq = p._backlog.attach(giving, terms.resume if terms.ack else None)
            self.backoff = _BACKOFF_MIN
            p.stats["flows"] += 1
            log.info(
                "producer %s: flow to %s open (%s, encoding %s, credit announced %d)",
                p.producer_id,
                self.endpoint,
                f"acks, resume {terms.resume}" if terms.ack else "plain taker, at most once",
                terms.encoding or "plain",
                event.credit,
            )
        elif isinstance(event, Rejected):
            p.stats["rejected"] += 1
            self._fail(f"the server rejected the flow: {dict(event.attrs)}", "rejections", now)
        elif isinstance(event, EotReceived):
            g = self.giving
            if g is not None:  # counts it; a plain taker's echo confirms its records
                p._backlog.ended(g, event.echo)
            else:
                p.stats["eot_received"] += 1
            if event.echo:  # the answer to our EOT: the taker had everything before it
                self._end("end of transmission")
            else:  # the server ends the flow: echo, then open a new one later
                with contextlib.suppress(ProtocolError, TransportError):
                    conn.send(conn.flow.send_eot())
                self._end("the server ended the flow")
                self.retry_at = now + self.backoff
        # DATs: the flow machine refuses them for a giver (a ProtocolError above).

    def pump(self) -> None:
        """Send what the paid credit allows (loop thread)."""
        conn, g = self.conn, self.giving
        if conn is None or g is None or conn.flow.state is not FlowState.READY:
            return
        try:
            g.pump(conn)
        except TransportError as e:
            self._fail(f"cannot send: {e}", "send_failures", time.monotonic())
        except ProtocolError as e:
            self._fail(f"{type(e).__name__}: {e}", "protocol_errors", time.monotonic())

    def send_eot(self, done: threading.Event) -> None:
        """End the flow with EOT and set ``done`` at its echo, or at once if there is no
        flow to end (loop thread). No new flow is opened afterwards."""
        self.ending = True
        conn = self.conn
        if conn is None or conn.flow.state is not FlowState.READY or self.giving is None:
            done.set()
            return
        self.producer._backlog.eot_done = done
        try:
            conn.send(conn.flow.send_eot())
        except TransportError as e:
            log.warning("producer %s: cannot send EOT: %s", self.producer.producer_id, e)
            self._end(f"cannot send EOT: {e}")
            done.set()

    def _end(self, reason: str) -> None:
        conn, self.conn = self.conn, None
        self.bot_sent = False
        if conn is not None:
            conn.close(0)
        giving, self.giving = self.giving, None
        if giving is not None:
            self.producer._backlog.detach(giving, reason)
        if not self.reconnect:
            self.ending = True

    def _fail(self, why: str, counter: str, now: float) -> None:
        p = self.producer
        p.stats["flow_failures"] += 1
        p.stats[counter] += 1
        # The same failure again (a peer that stays away) is logged once as a warning.
        level = logging.INFO if why == self.last_error else logging.WARNING
        self.last_error = why
        if self.ending or not self.reconnect:
            log.log(level, "producer %s -> %s: %s", p.producer_id, self.endpoint, why)
        else:
            log.log(
                level,
                "producer %s -> %s: %s; reconnecting in %.1f s",
                p.producer_id,
                self.endpoint,
                why,
                self.backoff,
            )
        self._end(why)
        self.retry_at = now + self.backoff
        self.backoff = min(self.backoff * 2, _BACKOFF_MAX)
