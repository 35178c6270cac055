"""An ack-capable ZIO giver: keeps every record until the taker acknowledges it.

Two topologies, one record buffer:

- **server** (``Producer(bind=EP)``): the producer binds a server port; a taker (the
  Spark source, or any ZIO flow client with direction ``inject``) connects and sends its
  BOT. One taker at a time: a new taker's BOT replaces the previous flow (the old client
  is dead or about to be; its unacknowledged records are resent to the new one).
- **client** (``Producer(connect=EP)``): the producer connects to a server that takes (a
  flow broker, the Spark source in ``bind`` mode) and opens the flow itself, as ZIO
  applications' producers usually do: ``BOT{direction: extract, credit, producer,
  stream, ack: true, encoding: ["arrow"]}``. After a disconnect, a flow failure, a
  rejection or a server's EOT it reconnects with back-off and a fresh BOT, so a
  restarted server is picked up (``stats`` counts what happened).

Terms are read in one place for both (:mod:`zio_spark.protocol.negotiate`): the client
offers, the server states; an echoed BOT (both reference servers echo the client's BOT)
proves nothing. Records are numbered from 1 in the order :meth:`Producer.send` is called
and kept in memory until acknowledged:

- A zio-spark taker states ``ack: true`` and ``resume: R`` (the last sequence number it
  holds durably). The producer then resends from ``R + 1`` and forgets a record only when
  a PAY carries ``ack >= seq``. Records go many to a DAT, packed as one Arrow IPC frame
  (see :mod:`zio_spark.codec.records`) when the ``arrow`` encoding is agreed.
- A plain ZIO taker (no acknowledgements: a reference taker, or a reference server that
  echoes our BOT) gets one record per DAT, the payload being the value, and a record is
  forgotten once sent: at most once, as plain ZIO promises. As a server we add ``seq``
  (and ``key``, ``headers``, ``granule``) to the DAT label; as a client the label is the
  reference's bare ``{"flow": "DAT"}``. Such a taker confirms what it got only by
  echoing our EOT (:meth:`Producer.close`): :meth:`Producer.delivery` counts those
  records as ``confirmed`` then, never before.

Credit: a giver spends only what PAYs paid (the C++ reference server announces the
client's credit in its BOT but may pay less); nothing is sized from a BOT's credit.

Producer ids must be stable across restarts for exactly-once. A restarted producer
numbers from 1 again; when a taker's ``resume`` shows it already holds more than this
process ever sent, records not yet sent are renumbered to continue after ``resume``
(counted in ``stats["renumbered"]``), so nothing new is mistaken for a duplicate.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from zio_spark.codec.records import ENCODING, encode_records
from zio_spark.errors import ConfigError, ProtocolError, RemoteProtocolError, TransportError
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
from zio_spark.protocol.negotiate import Terms, client_terms, server_terms
from zio_spark.source.held import HeldRecords, Taken
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.port import (
    BadMessage,
    ClientPort,
    PortKind,
    ServerPort,
    SocketMode,
    socket_type_name,
)

if TYPE_CHECKING:
    from zio_spark.transport.zre_node import ZreNode

__all__ = ["DEFAULT_WINDOW", "DEFAULT_WINDOW_BYTES", "Delivery", "Producer", "silent_peer_hint"]

log = logging.getLogger("zio_spark.transport")

_SEND_QUEUE = 100_000  # messages queued to the taker at most: the most credit it is given
# The retention window's defaults (see Producer's docstring for the arithmetic).
DEFAULT_WINDOW = 2_000_000
DEFAULT_WINDOW_BYTES = 256 << 20
_PLAIN_RUN = 1000  # client mode, plain taker: most bare DATs queued in one call
_CLIENT_SEND_TIMEOUT_MS = 1000  # client mode: longest wait to queue one message
_TICK = 0.05  # client mode: longest poll wait, seconds
_BLOCKED_EVERY = 0.5  # while send() is blocked: most often its blocked time is stated
_BACKOFF_MIN, _BACKOFF_MAX = 0.2, 5.0  # client mode: seconds before reconnecting
_monitor_ids = itertools.count()


class _Conn(Protocol):
    """One flow as a giver sends on it (a :class:`ServerFlow`, or :class:`_ClientConn`)."""

    @property
    def flow(self) -> Flow: ...

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> None: ...


class _Giving:
    """How the records go to the taker of one flow, in either topology (loop thread).

    ``bare``: plain DATs carry the reference's bare label (client mode); else a plain
    taker's DATs carry ``seq``/``key``/``headers``/``granule`` attributes (server mode).
    """

    def __init__(
        self,
        producer: Producer,
        terms: Terms,
        *,
        bare: bool,
        conn: ServerFlow | None = None,
        handler: FlowHandler | None = None,
    ) -> None:
        self.producer = producer
        self.terms = terms
        self.arrow = terms.encoding == ENCODING
        limit = terms.batch  # the taker's cap on records per DAT (the receiver refuses more)
        self.batch = (
            (producer.batch if limit is None else min(producer.batch, limit)) if (self.arrow) else 1
        )
        self.bare = bare and not self.arrow
        self.next_seq = 1  # next record to send to this taker
        self.records = 0  # records put on the wire on this flow
        self.conn = conn  # server mode: to remove the flow when a new taker replaces it
        self.handler = handler
        # The blocked time last stated to this taker (see :meth:`_state`): the window's
        # finished total then, and when.
        self.told_base = 0.0
        self.told_at = 0.0

    @property
    def acks(self) -> bool:
        return self.terms.ack

    def pump(self, conn: _Conn) -> None:
        """Send held records while the flow has paid credit (loop thread)."""
        p = self.producer
        flow = conn.flow
        release = not self.terms.ack
        while flow.credit > 0:
            if self.bare:
                assert isinstance(conn, _ClientConn)
                got = p._take(self.next_seq, min(flow.credit, _PLAIN_RUN))
                if got is None:
                    return
                try:
                    conn.send_dats([(v,) for v in got.values])
                except TransportError as e:
                    if e.sent:  # those left; the others stay held for the next flow
                        self._sent(got.first, got.first + e.sent - 1, e.sent, e.sent, release)
                    raise
                n = len(got.values)
                self._sent(got.first, got.last, n, n, release)
                continue
            got = p._take(self.next_seq, self.batch)
            if got is None:
                return
            if self.arrow:
                payload = encode_records(got.first, got.values, got.keys, got.granules, got.headers)
                conn.send_dat((payload,), self._state(got.last))
            else:
                attrs: dict[str, Any] = {"seq": got.first}
                key = None if got.keys is None else got.keys[0]
                if key is not None:
                    attrs["key"] = base64.b64encode(key).decode("ascii")
                headers = None if got.headers is None else got.headers[0]
                if headers:
                    attrs["headers"] = dict(headers)
                granule = None if got.granules is None else got.granules[0]
                if granule is not None:
                    attrs["granule"] = granule
                conn.send_dat((got.values[0],), attrs)
            self._sent(got.first, got.last, len(got.values), 1, release)

    def _state(self, last: int) -> dict[str, Any] | None:
        """The profile state for an Arrow DAT ending at ``last`` (None, the common case:
        a bare label). ``more: false`` when it empties the queue (the taker need not wait
        for more); ``blocked_ms`` when the time :meth:`Producer.send` spent blocked on a
        full window changed since last stated (at most every ``_BLOCKED_EVERY`` s while a
        block lasts). Unlocked reads first: the common case costs two attribute reads."""
        p = self.producer
        attrs: dict[str, Any] | None = None
        if last >= p._records.next_seq - 1:
            attrs = {"more": False}
        if p._blocked_since is None and p._blocked_s == self.told_base:
            return attrs
        now = time.monotonic()
        with p._cond:
            base, since = p._blocked_s, p._blocked_since
        if since is not None and now - self.told_at < _BLOCKED_EVERY:
            return attrs
        if since is None and base == self.told_base:
            return attrs
        self.told_base, self.told_at = base, now
        ms = int((base + (0.0 if since is None else max(0.0, now - since))) * 1000)
        if attrs is None:
            attrs = {}
        attrs["blocked_ms"] = ms
        return attrs

    def _sent(self, first: int, last: int, n: int, dats: int, release: bool) -> None:
        self.next_seq = last + 1
        self.records += n
        self.producer._sent(first, last, n, dats, release)


class _Taker(FlowHandler):
    """Server mode: one taker's flow on the producer's server port."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.giving: _Giving | None = None

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        p = self.producer
        if bot.direction is not Direction.INJECT:
            conn.reject({"reason": "this port is a producer: connect with direction inject"})
            return
        try:
            terms = server_terms("giver", bot.attrs, (ENCODING,))
        except RemoteProtocolError as e:
            conn.reject({"reason": str(e)})
            raise
        if terms.stream is not None and terms.stream != p.stream:
            conn.reject({"reason": f"no stream {terms.stream!r} here (this is {p.stream!r})"})
            return
        giving = _Giving(p, terms, bare=False, conn=conn, handler=self)
        self.giving = giving
        giving.next_seq = p._attach(giving, terms.resume if terms.ack else None)
        attrs: dict[str, Any] = {"producer": p.producer_id, "stream": p.stream, "ack": True}
        if giving.arrow:
            attrs["encoding"] = ENCODING
            if p._records.next_seq <= giving.next_seq:
                attrs["more"] = False  # nothing to send: no DAT will say so
        conn.accept(None, attrs)

    def on_credit(self, conn: ServerFlow, credit: Credit) -> None:
        ack = pay_ack(credit.attrs)
        if ack is not None and self.giving is not None and self.giving.acks:
            self.producer._ack(ack)
        self.on_tick(conn, 0.0)

    def on_tick(self, conn: ServerFlow, now: float) -> None:
        g = self.giving
        if g is None or self.producer._taker is not g or conn.flow.state is not FlowState.READY:
            return
        g.pump(conn)

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        p = self.producer
        p.stats["eot_received"] += 1
        if eot.echo and self.giving is not None and not self.giving.acks:
            p._confirm(self.giving.records)  # the plain taker had them all before its echo

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        if self.giving is not None:
            self.producer._detach(self.giving, reason)


class _ClientConn:
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


class _ClientGiver:
    """Client mode: connect, open the flow with a BOT, give, and reconnect after failures.

    Everything runs in one thread that owns the port; other threads reach it with
    :meth:`call_soon` (an inproc waker interrupts the poll).
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
        self.conn: _ClientConn | None = self._new_conn()
        self.mode: SocketMode = self.conn.port.mode
        self.socket_type = self.conn.port.socket_type
        self.giving: _Giving | None = None
        self.sent_attrs: dict[str, Any] = {}
        self.opened_at = 0.0
        self.bot_sent = False
        self.retry_at = 0.0
        self.backoff = _BACKOFF_MIN
        self.ending = False
        self.last_error: str | None = None
        self._calls: collections.deque[Any] = collections.deque()
        self._stop = threading.Event()
        self._waker_addr = f"inproc://zio-producer-waker-{id(self)}"
        self._wake_lock = threading.Lock()
        self._wake_in = ctx.socket(zmq.PULL)
        self._wake_in.linger = 0
        self._wake_in.bind(self._waker_addr)
        self._wake_out: zmq.Socket[bytes] | None = ctx.socket(zmq.PUSH)
        self._wake_out.linger = 0
        self._wake_out.connect(self._waker_addr)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name=f"producer {producer.producer_id} -> {endpoint}", daemon=True
        )

    def _new_conn(self) -> _ClientConn:
        port = ClientPort(self.ctx, **self._port_kw)
        try:
            # A named address: the default one reads socket.FD, experimental on CLIENT.
            monitor = port.socket.get_monitor_socket(
                zmq.EVENT_DISCONNECTED, f"inproc://zio-producer-monitor-{next(_monitor_ids)}"
            )
        except BaseException:
            port.close(linger_ms=0)
            raise
        conn = _ClientConn(port, monitor)
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
        with self._wake_lock:
            if self._wake_out is not None:
                with contextlib.suppress(zmq.Again):
                    self._wake_out.send(b"", zmq.NOBLOCK)

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
        with self._wake_lock:
            for s in (self._wake_out, self._wake_in):
                if s is not None:
                    s.close(0)
            self._wake_out = None

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
            self.producer._detach(giving, "producer closed")

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
        poller.register(self._wake_in, zmq.POLLIN)
        if conn is not None:
            poller.register(conn.port.socket, zmq.POLLIN)
            if conn.monitor is not None:
                poller.register(conn.monitor, zmq.POLLIN)
        wait = _TICK
        if conn is None and not self.ending:
            wait = min(wait, max(0.0, self.retry_at - now))
        ready = dict(poller.poll(int(wait * 1000)))
        if self._wake_in in ready:
            while True:
                try:
                    self._wake_in.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
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

    def _send_bot(self, conn: _ClientConn, now: float) -> None:
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

    def _drain(self, conn: _ClientConn, now: float) -> None:
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

    def _on_event(self, conn: _ClientConn, event: Event, now: float) -> None:
        p = self.producer
        if isinstance(event, Credit):
            ack = pay_ack(event.attrs)
            g = self.giving
            if ack is not None and g is not None and g.acks:
                p._ack(ack)
        elif isinstance(event, BotReceived):
            terms = client_terms("giver", self.sent_attrs, event.attrs)
            if terms.stream is not None and terms.stream != p.stream:
                raise RemoteProtocolError(
                    f"the server takes stream {terms.stream!r}; this producer gives {p.stream!r}",
                    field="stream",
                    value=terms.stream,
                )
            giving = _Giving(p, terms, bare=not terms.profile)
            self.giving = giving
            giving.next_seq = p._attach(giving, terms.resume if terms.ack else None)
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
            p.stats["eot_received"] += 1
            g = self.giving
            if event.echo:  # the answer to our EOT: the taker had everything before it
                if g is not None and not g.acks:
                    p._confirm(g.records)
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
        self.producer._eot_done = done
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
            self.producer._detach(giving, reason)
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


@dataclass(frozen=True, slots=True)
class Delivery:
    """What became of the records this process queued (:meth:`Producer.delivery`).

    Attributes
    ----------
    queued
        Records given to :meth:`Producer.send` / :meth:`Producer.send_many`.
    sent
        Of those, records put on the wire at least once (resends not counted again).
    acked
        Of those, records an ack-capable taker acknowledged (or covered by the ``resume``
        it stated): it holds them durably.
    confirmed
        Of those, records sent to a plain taker on a flow whose EOT it echoed: it had
        them all before the echo (a plain taker gives no other confirmation).
    pending
        Records still held: not yet acknowledged, or not yet sent to a plain taker.
    """

    queued: int
    sent: int
    acked: int
    confirmed: int
    pending: int

    @property
    def delivered(self) -> int:
        """Records known to have reached a taker: ``acked + confirmed``."""
        return self.acked + self.confirmed


class Producer:
    """Give records to a ZIO taker, keeping each until it is acknowledged.

    Parameters
    ----------
    bind
        Server mode: endpoint to bind (``tcp://127.0.0.1:*`` picks a free port); the
        default when ``connect`` is not given.
    connect
        Client mode: the endpoint of a server that takes (a flow broker, the Spark
        source in ``bind`` mode); the producer opens the flow and reconnects after
        failures.
    producer_id
        Stable id of this producer (default: host name and endpoint).
    stream
        Stream name; a taker asking for another stream is rejected (server mode), a
        server stating another one is left (client mode).
    batch
        Most records per DAT (Arrow-encoded flows).
    max_unacked, max_unacked_bytes
        The retention window: :meth:`send` blocks while this many records, or this many
        value bytes, are held unacknowledged (whichever comes first; one call may go past
        the byte budget by what it adds). A taker acknowledges only what it has made
        durable *and* its query has committed: for the Spark source that is a micro-batch
        after it was received, and ``commit`` lags one batch, so the window must hold
        about two micro-batches or it caps the query at ``window / commit latency``.
        The defaults (2,000,000 records, 256 MiB) sit above the source's default
        ``maxBacklog`` (1,000,000 records) plus what its credit keeps in flight, so the
        source's backlog bound, not this window, is what limits a default pair. Time
        spent blocked here is counted (:attr:`blocked_seconds`, ``stats["blocked"]``).
    mode
        Socket kind: ``"routerdealer"`` (default), ``"clientserver"`` (needs a draft
        pyzmq) or ``"auto"``; the peer must use the matching kind.
    curve_secret_key
        Server mode: turn on CURVE with this secret key.
    curve_server_key, curve_public_key
        Client mode: CURVE with the server's public key and this client's key pair
        (``curve_secret_key`` is then the client's secret key).
    linger_ms
        ZMQ linger of the port at :meth:`close`.
    idle_timeout
        Server mode: remove a taker silent for this many seconds.
    credit
        Client mode: the credit offered in our BOT (the most DATs in flight); the taker
        may pay less, and only what it pays is spent.
    connect_timeout
        Client mode: seconds to wait for the server's BOT reply before the flow counts as
        failed (``stats["bot_timeouts"]``, with a hint about socket kinds) and is retried.
        A connection that closes before the reply (what libzmq does to a mismatched
        socket pair) counts the same way: ``stats["unanswered"]`` counts both.
    reconnect
        Client mode: open a new flow after a failure or a server's EOT (default True).

    Raises
    ------
    ConfigError
        For a bad option (both ``bind`` and ``connect``, a bad ``batch`` ...).
    TransportError
        If the port cannot be made, bound or connected (e.g. ``clientserver`` without a
        draft pyzmq).
    """

    def __init__(
        self,
        bind: str | None = None,
        *,
        connect: str | None = None,
        producer_id: str | None = None,
        stream: str = "zio",
        batch: int = 1000,
        max_unacked: int = DEFAULT_WINDOW,
        max_unacked_bytes: int = DEFAULT_WINDOW_BYTES,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve_secret_key: str | bytes | None = None,
        curve_server_key: str | bytes | None = None,
        curve_public_key: str | bytes | None = None,
        linger_ms: int = 1000,
        idle_timeout: float | None = None,
        credit: int = 1000,
        connect_timeout: float = 10.0,
        reconnect: bool = True,
    ) -> None:
        if bind is not None and connect is not None:
            raise ConfigError(
                "connect", connect, f"either bind or connect, not both (bind={bind!r})"
            )
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError("batch", batch, "an integer >= 1")
        if isinstance(max_unacked, bool) or not isinstance(max_unacked, int) or max_unacked < 1:
            raise ConfigError("max_unacked", max_unacked, "an integer >= 1")
        if (
            isinstance(max_unacked_bytes, bool)
            or not isinstance(max_unacked_bytes, int)
            or max_unacked_bytes < 1
        ):
            raise ConfigError("max_unacked_bytes", max_unacked_bytes, "an integer >= 1")
        if (
            isinstance(credit, bool)
            or not isinstance(credit, int)
            or not 1 <= credit <= _SEND_QUEUE
        ):
            raise ConfigError("credit", credit, f"an integer 1..{_SEND_QUEUE}")
        if isinstance(connect_timeout, bool) or not (
            isinstance(connect_timeout, (int, float)) and 0 < connect_timeout <= 86400
        ):
            raise ConfigError("connect_timeout", connect_timeout, "seconds, > 0")
        self.ctx = ctx or zmq.Context.instance()
        self.stream = stream
        self.batch = batch
        self.max_unacked = max_unacked
        self.max_unacked_bytes = max_unacked_bytes
        self._blocked_s = 0.0  # time send() spent waiting for room in the window
        self._blocked_since: float | None = None  # set while a send() waits
        self.stats: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._records = HeldRecords()
        self._ever_sent = 0  # highest seq sent to, or held by, a taker of this process
        self._acked = 0
        self._queued = 0  # records queued by this process
        self._sent_count = 0  # of those, put on the wire at least once
        self._acked_count = 0  # of those, acknowledged (or covered by a taker's resume)
        self._confirmed = 0  # of those, sent to a plain taker that echoed our EOT
        self._taker: _Giving | None = None  # the flow records go to
        self._last_acks: bool | None = None  # whether the latest taker acknowledges
        self._wake_pending = False
        self._closed = False
        self._eot_done: threading.Event | None = None  # set while close() awaits the echo
        self._zre: ZreNode | None = None  # the discovery node, once advertise() ran
        self._server: FlowServer | None = None
        self._client: _ClientGiver | None = None
        if connect is not None:
            self.endpoint = connect
            self.producer_id = producer_id or f"{socket.gethostname()}|{connect}"
            curve: dict[str, Any] = {}
            if curve_server_key is not None or curve_secret_key is not None:
                curve = {
                    "curve_server_key": curve_server_key,
                    "curve_secret_key": curve_secret_key,
                    "curve_public_key": curve_public_key,
                }
            self._client = _ClientGiver(
                self,
                connect,
                ctx=self.ctx,
                mode=mode,
                credit=credit,
                connect_timeout=float(connect_timeout),
                reconnect=reconnect,
                linger_ms=linger_ms,
                curve=curve,
            )
            self.curve_public_key = (
                self._client.conn.port.curve_public_key if (self._client.conn is not None) else None
            )
            self.mode = self._client.mode
            self.socket_type = self._client.socket_type
            self._client.start()
            return
        if curve_server_key is not None:
            raise ConfigError(
                "curve_server_key", "...", "connect: a bound producer is the CURVE server"
            )
        # The send queue bounds the credit a taker gets (FlowServer lowers larger offers
        # to it); DATs go out only within credit, so this is a bound, not a buffer.
        port = ServerPort(
            self.ctx,
            mode=mode,
            linger_ms=linger_ms,
            curve_secret_key=curve_secret_key,
            curve_public_key=curve_public_key,
            sndhwm=_SEND_QUEUE,
        )
        try:
            self.endpoint = port.bind("tcp://127.0.0.1:*" if bind is None else bind)
        except BaseException:
            port.close(0)
            raise
        self.curve_public_key = port.curve_public_key
        self.mode = port.mode
        self.socket_type = port.socket_type
        self.producer_id = producer_id or f"{socket.gethostname()}|{self.endpoint}"
        self._server = FlowServer(
            port,
            lambda: _Taker(self),
            ctx=self.ctx,
            idle_timeout=idle_timeout,
            name=f"producer {self.producer_id}",
        ).start()

    # -- application side (any thread) --------------------------------------------

    def send(
        self,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        granule: int | None = None,
        timeout: float | None = 30.0,
    ) -> int:
        """Queue one record; returns its sequence number.

        Raises
        ------
        TransportError
            If the buffer stays full (``max_unacked``) for ``timeout`` seconds.
        """
        return self.send_many(
            [value],
            keys=None if key is None else [key],
            headers=None if headers is None else [headers],
            granules=None if granule is None else [granule],
            timeout=timeout,
        )

    def send_many(
        self,
        values: Sequence[bytes],
        *,
        keys: Sequence[bytes | None] | None = None,
        headers: Sequence[Mapping[str, str] | None] | None = None,
        granules: Sequence[int | None] | None = None,
        timeout: float | None = 30.0,
    ) -> int:
        """Queue many records; returns the sequence number of the last one.

        Raises
        ------
        TransportError
            If the buffer has no room for them within ``timeout`` seconds.
        ValueError
            If the optional columns do not match ``values`` in length.
        """
        n = len(values)
        for name, col in (("keys", keys), ("headers", headers), ("granules", granules)):
            if col is not None and len(col) != n:
                raise ValueError(f"{name} has {len(col)} entries for {n} values")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            i = 0
            while i < n:
                if self._closed:
                    raise TransportError("producer is closed", endpoint=self.endpoint)
                room = self.max_unacked - len(self._records)
                if self._records.nbytes >= self.max_unacked_bytes:
                    room = 0
                if room <= 0:
                    now = time.monotonic()
                    if self._blocked_since is None:
                        self._blocked_since = now
                        self.stats["blocked"] += 1
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        self._end_blocked(now)
                        raise TransportError(
                            f"producer window full ({len(self._records)} records, "
                            f"{self._records.nbytes} bytes unacknowledged; window "
                            f"{self.max_unacked} records / {self.max_unacked_bytes} bytes) "
                            f"for {timeout} s: is a taker connected and acknowledging?",
                            endpoint=self.endpoint,
                        )
                    self._cond.wait(left)
                    continue
                if self._blocked_since is not None:
                    self._end_blocked(time.monotonic())
                j = min(n, i + room)
                whole = i == 0 and j == n
                self._records.append(
                    values if whole else values[i:j],
                    keys if whole or keys is None else keys[i:j],
                    granules if whole or granules is None else granules[i:j],
                    headers if whole or headers is None else headers[i:j],
                )
                self._queued += j - i
                i = j
                self._wake_locked()
            return self._records.next_seq - 1

    def _end_blocked(self, now: float) -> None:
        assert self._blocked_since is not None
        self._blocked_s += now - self._blocked_since
        self._blocked_since = None

    @property
    def blocked_seconds(self) -> float:
        """Total time :meth:`send` has spent waiting for acknowledgements to free the
        window (a send waiting now included): a producer held back by its taker."""
        with self._cond:
            now = time.monotonic()
            ongoing = 0.0 if self._blocked_since is None else now - self._blocked_since
            return self._blocked_s + ongoing

    @property
    def window_full(self) -> bool:
        """True while a :meth:`send` is waiting for room in the window."""
        with self._cond:
            return self._blocked_since is not None

    def _wake_locked(self) -> None:
        if not self._wake_pending and self._taker is not None:
            self._wake_pending = True
            self._call_soon(self._woken)

    def _call_soon(self, fn: Any) -> None:
        if self._client is not None:
            self._client.call_soon(fn)
        else:
            assert self._server is not None
            self._server.call_soon(fn)

    def _woken(self) -> None:
        with self._cond:
            self._wake_pending = False
        g = self._taker
        if g is None:
            return
        if self._client is not None:
            self._client.pump()
        elif self._server is not None and g.conn is not None and g.handler is not None:
            # As on a tick: a failure (the taker vanished) ends that flow, not the loop.
            self._server.tick_flow(g.conn, g.handler, 0.0)

    @property
    def acked(self) -> int:
        """Highest sequence number acknowledged by a taker."""
        with self._cond:
            return self._acked

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._records.next_seq - 1

    @property
    def pending(self) -> int:
        """Records held: not yet acknowledged (or, for plain takers, not yet sent)."""
        with self._cond:
            return len(self._records)

    @property
    def connected(self) -> bool:
        """True while a taker's flow is open (its BOT exchanged)."""
        return self._taker is not None

    @property
    def acks(self) -> bool | None:
        """Whether the current taker (or, once it left, the last one) acknowledges
        records; None before any taker came. False means a plain ZIO taker: at most once,
        confirmed only by the echo of our EOT."""
        return self._last_acks

    @property
    def last_error(self) -> str | None:
        """Client mode: why the last flow failed (None if none did)."""
        return None if self._client is None else self._client.last_error

    def delivery(self) -> Delivery:
        """What became of the records this process queued (see :class:`Delivery`)."""
        with self._cond:
            return Delivery(
                queued=self._queued,
                sent=self._sent_count,
                acked=self._acked_count,
                confirmed=self._confirmed,
                pending=len(self._records),
            )

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait until every record sent so far is acknowledged (or sent, to a plain taker).

        Raises
        ------
        TransportError
            On timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._records:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportError(
                        f"{len(self._records)} records still unacknowledged after {timeout} s",
                        endpoint=self.endpoint,
                    )
                self._cond.wait(left if left is None else min(left, 0.5))

    def advertise(self, group: str, **zre: object) -> None:
        """Join ZRE ``group`` and advertise this producer's flow port in it.

        ``zre`` goes to :func:`~zio_spark.transport.discovery.advertise` (``beacon_port``,
        ``broadcast``, ``interface_addr``, ``interval``); the node stops with :meth:`close`.
        """
        from zio_spark.transport.discovery import advertise

        if self._server is None:
            raise ConfigError(
                "group",
                group,
                "a bound producer: a producer in client mode has no port to advertise",
            )
        self._zre = advertise(
            group,
            self.endpoint,
            self._server.port.socket_type,
            name=self.producer_id,
            **zre,  # type: ignore[arg-type]
        )

    def close(self, timeout: float | None = 30.0, *, flush: bool = True) -> Delivery:
        """Flush (optionally), end the flow with an EOT, wait for its echo, stop.

        The echo is what confirms delivery to a plain taker (:attr:`Delivery.confirmed`).
        Returns :meth:`delivery` as it stands once the producer is stopped.

        Raises
        ------
        TransportError
            If ``flush`` is true and records are still held after ``timeout`` (the
            producer is closed all the same, without an EOT).
        """
        try:
            if flush and not self._closed:
                self.flush(timeout)
            done = threading.Event()

            def end() -> None:
                if self._client is not None:
                    self._client.send_eot(done)
                    return
                g = self._taker
                conn = None if g is None else g.conn
                if conn is not None and conn.flow.state is FlowState.READY:
                    self._eot_done = done
                    try:
                        conn.send_eot()
                    except TransportError as e:  # the taker is gone: no echo will come
                        log.warning("producer %s: cannot send EOT: %s", self.producer_id, e)
                        done.set()
                else:
                    done.set()

            if self._loop_alive():
                self._call_soon(end)
                if not done.wait(timeout):
                    log.warning("producer %s: no EOT echo before close", self.producer_id)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._zre is not None:
                self._zre.stop()
            if self._client is not None:
                self._client.stop()
            if self._server is not None:
                self._server.stop()
        return self.delivery()

    def _loop_alive(self) -> bool:
        if self._client is not None:
            return self._client.alive
        return self._server is not None and self._server._thread is not None

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(flush=exc[0] is None)

    # -- loop side (server thread) ---------------------------------------------------

    def _attach(self, giving: _Giving, resume: int | None) -> int:
        replaced: _Giving | None = None
        with self._cond:
            if self._taker is not None and self._taker is not giving:
                self.stats["takers_replaced"] += 1
                replaced = self._taker
            self._taker = giving
            self._last_acks = giving.acks
            self.stats["takers"] += 1
            records = self._records
            start = records.first
            if resume is not None:
                never_sent = self._ever_sent + 1
                if resume >= never_sent and records.next_seq > never_sent:
                    shift = resume + 1 - never_sent
                    self._acked_count += records.release(never_sent - 1)
                    records.renumber(shift)
                    kept = len(records)
                    self.stats["renumbered"] += kept
                    log.warning(
                        "producer %s: taker resumes at %d beyond what this process sent; "
                        "%d unsent records renumbered from %d",
                        self.producer_id,
                        resume,
                        kept,
                        resume + 1,
                    )
                elif resume >= never_sent:  # the taker has all we sent; nothing unsent
                    self._acked_count += records.release(resume)
                    records.renumber(max(0, resume + 1 - records.next_seq))
                self._release(resume)
                # Records up to ``resume`` are now accounted for: a later taker with the
                # same ``resume`` (a replaced driver, a reconnecting port's queued BOT)
                # must not move the numbering on a second time.
                self._ever_sent = max(self._ever_sent, resume)
                start = max(start, resume + 1)
            self._cond.notify_all()
        if (
            replaced is not None
            and self._server is not None
            and replaced.conn is not None
            and replaced.handler is not None
        ):
            # One taker at a time: the old flow ends now instead of lingering in the
            # server (forever without an idle timeout) for a client that is gone.
            self._server._remove(replaced.conn, replaced.handler, "replaced by a new taker")
        return start

    def _detach(self, giving: _Giving, reason: str) -> None:
        with self._cond:
            if self._taker is giving:
                self._taker = None
        if self._eot_done is not None:
            self._eot_done.set()
        log.info("producer %s: taker left (%s)", self.producer_id, reason)

    def _take(self, first: int, n: int) -> Taken | None:
        with self._cond:
            return self._records.take(first, n)

    def _sent(self, first: int, last: int, n: int, dats: int, release: bool) -> None:
        """Records ``first..last`` went out in ``dats`` DATs; a plain taker's are released."""
        with self._cond:
            self._sent_count += max(0, last - max(self._ever_sent, first - 1))
            self._ever_sent = max(self._ever_sent, last)
            if release:
                self._records.release(last)
                self._cond.notify_all()
        self.stats["records_sent"] += n
        self.stats["dats_sent"] += dats

    def _confirm(self, n: int) -> None:
        """A plain taker echoed our EOT after ``n`` records of its flow."""
        with self._cond:
            self._confirmed += n
            self._cond.notify_all()
        self.stats["confirmed"] += n

    def _ack(self, ack: int) -> None:
        with self._cond:
            self._release(ack)
            self._cond.notify_all()

    def _release(self, upto: int) -> None:
        self._acked_count += self._records.release(upto)
        if upto > self._acked:
            self.stats["acked"] += upto - self._acked
            self._acked = upto
