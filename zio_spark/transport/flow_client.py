"""One reconnecting client flow: connect, send a BOT, serve the flow, and after a failure
connect again with back-off. The client-side twin of :mod:`.flow_server`.

A :class:`FlowClient` owns one endpoint and one :class:`ClientHandler` (kept across
reconnections; every flow gets a fresh :class:`ClientFlow` connection object). Per flow:

1. open: a new :class:`~.port.ClientPort` with a socket monitor, connected to the
   endpoint; the handler's :meth:`ClientHandler.offer` says the BOT to send
   (``stats["connects"]`` once it is sent);
2. the server's reply: its BOT goes to :meth:`ClientHandler.on_bot` (raise a
   :class:`~zio_spark.errors.ProtocolError` there to refuse the terms), which resets the
   back-off (``stats["flows"]``); an EOT is a rejection (:meth:`ClientHandler.on_rejected`,
   then the flow fails with ``rejected_text``);
3. the flow: ``on_data``, ``on_credit``, ``on_tick`` (every turn while the flow is READY
   or EOT_SENT; givers send here), ``on_drained`` after each read of the socket;
4. the end: a server's EOT goes to ``on_eot``; the engine echoes it, ends the flow and
   opens a new one after the current back-off delay. The echo of *our* EOT
   (:meth:`FlowClient.send_eot`) ends it for good. A handler that takes every message
   itself (``on_message``) ends a flow with :meth:`FlowClient.end`, reopening it later
   or never. ``on_close(conn, reason)`` runs for every flow that was opened, whatever
   ended it (``conn.failure`` is set if it failed); ``on_failure`` for every failure,
   before the close, with its counter's name and whether no flow will open again.

Failures (each counted in ``stats["flow_failures"]`` and a named counter, logged with
the client's ``name``; the same failure again is logged at INFO): a connect error
(``connect_errors``), a failed send (``send_failures``), a bad message or protocol
violation (``protocol_errors``), a handler bug (``handler_errors``), a rejection
(``rejections``), a disconnect seen by the monitor (``disconnects``), no BOT reply within
``connect_timeout`` (``bot_timeouts``). After a failure the next flow opens after the
back-off delay, 0.2 s doubling to 5 s (:class:`Backoff`), unless ``reconnect`` is off,
the client is ending, or it gave up (:meth:`FlowClient.give_up`).

A disconnect before any BOT reply: with ``patient=False`` (the producer) the flow fails
at once with :meth:`ClientHandler.closed_unanswered`; with ``patient=True`` (the
receiver) a disconnect before any ZMTP handshake succeeded is taken as a refused
handshake (socket kinds that cannot talk; :class:`Seen`) and the flow waits for the BOT
timeout. At the BOT timeout :meth:`ClientHandler.no_reply` names the cause from what the
monitor saw and says whether retrying can help; if not (or without ``reconnect``) the
client gives up (``gave_up`` holds why).

Running it, like the server: **standalone** with :meth:`FlowClient.start` /
:meth:`FlowClient.stop` (a :class:`~.loop.Loop` in a thread of its own;
:meth:`FlowClient.call_soon` reaches it), or **inline** as a :class:`~.loop.LoopPart` of
another loop (``loop.add(client)``, or by hand: poll :meth:`~FlowClient.sockets`, then
:meth:`~FlowClient.process` and :meth:`~FlowClient.tick` every turn; end with
:meth:`~FlowClient.close`). One thread may drive many clients and servers.

The decisions that need no socket are pure and tested alone: :class:`Backoff`,
:func:`note_monitor_event`, :func:`bot_overdue`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from zio_spark.errors import ProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    Direction,
    EotReceived,
    Event,
    Flow,
    FlowState,
    Rejected,
    Role,
)
from zio_spark.protocol.message import DatCodec, Message
from zio_spark.transport.loop import Loop, LoopThread
from zio_spark.transport.port import BadMessage, ClientPort
from zio_spark.transport.wire import PortKind, SocketMode, silent_peer_hint

__all__ = [
    "BACKOFF_MAX",
    "BACKOFF_MIN",
    "HANDSHAKE_FAILED",
    "MONITOR_EVENTS",
    "Backoff",
    "ClientFlow",
    "ClientHandler",
    "FlowClient",
    "Offer",
    "Seen",
    "bot_overdue",
    "note_monitor_event",
]

log = logging.getLogger("zio_spark.transport")

BACKOFF_MIN, BACKOFF_MAX = 0.2, 5.0
"""Seconds before reconnecting: the first delay, and the most it doubles to."""
SEND_TIMEOUT_MS = 1000
"""Longest wait to queue one message to the server."""
HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused",
}
MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_DRAIN_READS, _DRAIN_BATCH = 64, 256  # bounded, so sending and other flows get a turn
_monitor_ids = itertools.count()


# -- pure decisions ------------------------------------------------------------------


@dataclass(slots=True)
class Backoff:
    """The reconnect delay: ``first`` seconds, doubled after each failure up to ``most``,
    back to ``first`` once a flow opens."""

    first: float = BACKOFF_MIN
    most: float = BACKOFF_MAX
    delay: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay = self.first

    def failed(self) -> float:
        """A flow failed: the delay before the next one (and double it for later)."""
        delay = self.delay
        self.delay = min(self.delay * 2, self.most)
        return delay

    def reset(self) -> None:
        self.delay = self.first


@dataclass(slots=True)
class Seen:
    """What the socket monitor saw of one connection (for the diagnosis of a silence)."""

    connected: bool = False
    handshaked: bool = False
    refused: bool = False
    """Disconnected before any ZMTP handshake succeeded: libzmq checks the socket kinds
    there, so a pair that cannot talk looks like this."""
    handshake_error: str | None = None
    disconnected: bool = False


def note_monitor_event(seen: Seen, event: int, *, patient: bool) -> bool:
    """Record monitor ``event`` in ``seen``; True if the connection is gone and its flow
    fails now. ``patient``: a disconnect before any handshake succeeded is a refusal to
    diagnose at the BOT timeout, not a failure now."""
    if event == zmq.EVENT_CONNECTED:
        seen.connected = True
    elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        seen.handshaked = True
    elif event in HANDSHAKE_FAILED:
        seen.handshake_error = HANDSHAKE_FAILED[event]
    elif event == zmq.EVENT_DISCONNECTED:
        if patient and not seen.handshaked:
            seen.refused = True
            return False
        seen.disconnected = True
        return True
    return False


def bot_overdue(state: FlowState, opened_at: float, now: float, timeout: float) -> bool:
    """Whether a flow still waiting for the server's BOT has waited too long."""
    return state is FlowState.BOT_SENT and now - opened_at > timeout


# -- the handler and its connection ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Offer:
    """The BOT a client flow opens with."""

    direction: Direction
    credit: int
    attrs: Mapping[str, Any]


class ClientFlow:
    """The client's side of one flow; handed to every :class:`ClientHandler` callback."""

    def __init__(self, client: FlowClient, port: ClientPort, monitor: zmq.Socket[bytes]) -> None:
        self.client = client
        self.port = port
        self.monitor: zmq.Socket[bytes] | None = monitor
        self.flow = Flow(Role.CLIENT)
        self.seen = Seen()
        self.offer: Offer | None = None  # the BOT sent, once sent
        self.opened_at = 0.0  # when the BOT was sent
        self.bot: BotReceived | None = None  # the server's reply
        self.failure: str | None = None  # why the flow failed, if it did
        self._codec = DatCodec(0)

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    @property
    def name(self) -> str:
        return self.client.endpoint

    @property
    def mode(self) -> SocketMode:
        return self.port.mode

    @property
    def current(self) -> bool:
        """True while this is the client's open flow."""
        return self.client.conn is self

    def send(self, msg: Message, timeout_ms: float = SEND_TIMEOUT_MS) -> None:
        self.port.send(msg, timeout_ms=timeout_ms)

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> None:
        if attrs:
            self.send(self.flow.send_dat(payload, attrs))
        else:  # the fast lane: no Message for a plain DAT
            first = self.flow.send_dats(1)
            self.port.send_dat(self._codec, first, payload, timeout_ms=SEND_TIMEOUT_MS)

    def send_dats(self, payloads: Sequence[tuple[bytes, ...]]) -> None:
        """Plain DATs with the bare label (the reference's), in one call."""
        first = self.flow.send_dats(len(payloads))
        self.port.send_dats(self._codec, first, payloads, timeout_ms=SEND_TIMEOUT_MS)

    def pay(self, amount: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        self.send(self.flow.pay(amount, attrs))

    def send_eot(
        self, attrs: Mapping[str, Any] | None = None, timeout_ms: float = SEND_TIMEOUT_MS
    ) -> None:
        self.send(self.flow.send_eot(attrs), timeout_ms)

    def close(self, linger_ms: int = 0) -> None:
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.port.socket.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        self.port.close(linger_ms=linger_ms)


class ClientHandler:
    """Serves the flows of one :class:`FlowClient`; all run in the client's thread.

    Override :meth:`offer` (required) and what you need. The texts below name the peer
    in failure reasons; override them to suit the role.
    """

    rejected_text = "the server rejected the flow"
    disconnected_text = "the server disconnected"

    def offer(self, conn: ClientFlow) -> Offer:
        """The BOT to open ``conn``'s flow with (called for every new flow)."""
        raise NotImplementedError

    def on_message(self, conn: ClientFlow, msg: Message) -> bool:
        """Every message before the flow machine sees it; True if taken here (a fast
        lane calling ``conn.flow.take_dat()`` itself). Default: False."""
        return False

    def on_bot(self, conn: ClientFlow, bot: BotReceived) -> None:
        """The server accepted: its BOT states the terms."""

    def on_rejected(self, conn: ClientFlow, rejected: Rejected) -> None:
        """The server answered the BOT with EOT; the flow then fails."""

    def on_data(self, conn: ClientFlow, data: Data) -> None:
        pass

    def on_credit(self, conn: ClientFlow, credit: Credit) -> None:
        pass

    def on_eot(self, conn: ClientFlow, eot: EotReceived) -> None:
        """The server's EOT (``eot.echo``: the answer to ours); the engine echoes it."""

    def on_drained(self, conn: ClientFlow, now: float) -> None:
        """After each read of the socket (batch work: appending what arrived)."""

    def on_tick(self, conn: ClientFlow, now: float) -> None:
        """Every turn while the flow is READY or EOT_SENT (givers send here)."""

    def on_close(self, conn: ClientFlow, reason: str) -> None:
        """The flow ended (``conn.failure`` is set if it failed)."""

    def on_failure(self, conn: ClientFlow | None, why: str, counter: str, final: bool) -> None:
        """A flow failed (``conn`` None: no connection was made), before it is closed;
        ``counter`` names the failure's kind (see the module docstring), ``final`` says
        that no new flow will open (else one opens after ``client.backoff.delay``)."""

    def closed_unanswered(self, conn: ClientFlow) -> str:
        """Why a flow failed whose connection closed before the server's BOT."""
        return "the connection closed before a BOT reply; " + silent_peer_hint(
            conn.endpoint, PortKind.CLIENT, conn.mode
        )

    def no_reply(self, conn: ClientFlow, timeout: float) -> tuple[str, bool]:
        """Why no BOT came within ``timeout`` s (``conn.seen``: what the monitor saw), and
        whether no retry can help (True: give up)."""
        hint = silent_peer_hint(conn.endpoint, PortKind.CLIENT, conn.mode)
        return f"no BOT reply within {timeout:g} s; {hint}", False


# -- the engine --------------------------------------------------------------------------


class FlowClient:
    """A reconnecting client flow to ``endpoint`` served by ``handler`` (module doc).

    Parameters
    ----------
    endpoint, handler
        Where to connect, and what serves every flow.
    ctx, mode, port_options
        The context, the socket mode and more :class:`ClientPort` keywords (``sndhwm``,
        ``curve``...); ``linger_ms`` 0 and ``send_timeout_ms`` 1000 unless given.
    connect_timeout
        Seconds to wait for the server's BOT.
    reconnect
        Open a new flow after a failure or a server's EOT (else the first end is final).
    patient
        See the module docstring (a refused handshake waits for the BOT timeout).
    connect_now
        Make the first port in the constructor, so a bad mode or endpoint raises here.
    linger_ms
        Linger of the port closed by :meth:`close` (a flow ended otherwise lingers 0).
    name, stats
        The name in log lines and thread names; the counters (shared if given).
    make_port
        What makes each flow's port: ``make_port(ctx, **port keywords)`` (a
        :class:`ClientPort`; tests pass a stand-in to drive the engine without sockets).
    """

    def __init__(
        self,
        endpoint: str,
        handler: ClientHandler,
        *,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: SocketMode | str | None = None,
        port_options: Mapping[str, Any] | None = None,
        connect_timeout: float = 10.0,
        reconnect: bool = True,
        patient: bool = False,
        connect_now: bool = True,
        linger_ms: int = 0,
        name: str | None = None,
        stats: Counter[str] | None = None,
        backoff: Backoff | None = None,
        tick: float = 0.05,
        make_port: Callable[..., ClientPort] = ClientPort,
    ) -> None:
        self.endpoint = endpoint
        self.handler = handler
        self.ctx = ctx or zmq.Context.instance()
        self._port_kw: dict[str, Any] = {
            "mode": mode,
            "linger_ms": 0,
            "send_timeout_ms": SEND_TIMEOUT_MS,
            **(port_options or {}),
        }
        self.connect_timeout = connect_timeout
        self.reconnect = reconnect
        self.patient = patient
        self.linger_ms = linger_ms
        self.name = name or f"flow client -> {endpoint}"
        self.stats: Counter[str] = Counter() if stats is None else stats
        self.backoff = backoff or Backoff()
        self.tick_s = tick
        self._make_port = make_port
        self.conn: ClientFlow | None = None
        self.mode: SocketMode | None = None  # known once a port was made
        self.socket_type: str | None = None
        self.curve_public_key: bytes | None = None
        self.retry_at = 0.0
        self.ending = False  # no new flow: send_eot(), close() or end(reopen=False)
        self.gave_up: str | None = None  # why no new flow will open, if so
        self.last_error: str | None = None
        self.error: BaseException | None = None  # what ended the own thread, if anything
        self._closed = False
        self._loop: Loop | None = None
        self._own: LoopThread | None = None  # start(): a loop and thread of its own
        if connect_now:
            self.conn = self._connect()

    # -- standalone --------------------------------------------------------------------

    def start(self) -> FlowClient:
        """Run the client in a thread of its own."""
        if self._loop is not None:
            raise TransportError(f"{self.name} is already driven by a loop")
        loop = Loop(tick=self.tick_s, name=self.name, stats=self.stats)
        self.attach(loop)
        self._own = LoopThread(loop, self._run)
        return self

    @property
    def alive(self) -> bool:
        """True while the own thread runs."""
        return self._own is not None and self._own.alive

    def attach(self, loop: Loop) -> None:
        """Be driven by ``loop``; :meth:`call_soon` then goes through it."""
        self._loop = loop
        loop.add(self)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the client's thread at the next turn (thread-safe; needs a loop)."""
        if self._loop is None:
            raise TransportError(f"{self.name}: no loop drives this client", endpoint=self.endpoint)
        self._loop.call_soon(fn)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the own thread (if any) and :meth:`close` (idempotent)."""
        if self._own is not None:
            if not self._own.stop(timeout):
                raise TransportError(
                    f"{self.name}: loop did not stop within {timeout} s", endpoint=self.endpoint
                )
            self._own = None
        self.close()

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.run()
        except BaseException as e:  # reported, never silent
            self.error = e
            log.exception("%s: loop failed", self.name)
        finally:
            self.close()

    # -- inline --------------------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket[bytes]]:
        conn = self.conn
        if conn is None:
            return []
        if conn.monitor is None:
            return [conn.port.socket]
        return [conn.port.socket, conn.monitor]

    def process(self, ready: Collection[object] | None = None, now: float | None = None) -> None:
        """Take what arrived (``ready``: the poll's events; None: look regardless)."""
        conn = self.conn
        if conn is None:
            return
        now = time.monotonic() if now is None else now
        if ready is None or conn.port.socket in ready:
            self._drain(conn, now)
        # After the drain: what arrived before a disconnect is taken first.
        if (
            self.conn is conn
            and conn.monitor is not None
            and (ready is None or conn.monitor in ready)
        ):
            self._on_monitor(conn, now)

    def tick(self, now: float | None = None) -> float | None:
        """Open a flow when due, send its BOT, time out a silent server, run ``on_tick``.
        Returns the most seconds until the next tick is due (None: no timer)."""
        now = time.monotonic() if now is None else now
        if self._closed:
            return None
        if self.conn is None and self._may_open() and now >= self.retry_at:
            try:
                self.conn = self._connect()
            except TransportError as e:
                self._fail(f"cannot connect: {e}", "connect_errors", now)
        conn = self.conn
        if conn is not None and conn.offer is None and not self.ending:
            self._send_bot(conn, now)
        conn = self.conn
        if conn is None:
            return max(0.0, self.retry_at - now) if self._may_open() else None
        if bot_overdue(conn.flow.state, conn.opened_at, now, self.connect_timeout):
            # What the monitor already saw is read first: the verdict on a silence (a
            # refused handshake: hopeless) comes from what happened on the wire, not from
            # whether the loop got round to the monitor before the timer (a busy machine).
            if conn.monitor is not None:
                self._on_monitor(conn, now)
                if self.conn is not conn:
                    return max(0.0, self.retry_at - now) if self._may_open() else None
            self._no_reply(conn, now)
            return None
        if conn.flow.state in (FlowState.READY, FlowState.EOT_SENT):
            self._guarded(conn, now, self.handler.on_tick, conn, now)
        return None

    def close(self, reason: str = "client closed", linger_ms: int | None = None) -> None:
        """End the flow without an EOT (its port lingers ``linger_ms``, None: the client's
        own); no new flow opens (idempotent; client thread, or any thread once the loop
        has ended)."""
        if self._closed:
            return
        self._closed = True
        self.ending = True
        if self._loop is not None:
            self._loop.remove(self)
        self._end(reason, linger_ms=self.linger_ms if linger_ms is None else linger_ms)

    # -- control (client thread) ------------------------------------------------------

    def send_eot(
        self, attrs: Mapping[str, Any] | None = None, timeout_ms: float = SEND_TIMEOUT_MS
    ) -> bool:
        """End the flow with an EOT (waiting at most ``timeout_ms`` to queue it); no new
        flow opens afterwards. True if an echo can be awaited (the flow was READY and the
        EOT went out)."""
        self.ending = True
        conn = self.conn
        if conn is None or conn.flow.state is not FlowState.READY:
            return False
        try:
            conn.send_eot(attrs, timeout_ms)
        except TransportError as e:
            log.warning("%s: cannot send EOT: %s", self.name, e)
            self._end(f"cannot send EOT: {e}")
            return False
        return True

    def poke(self) -> None:
        """Run the handler's ``on_tick`` now if a flow is READY or EOT_SENT (a giver with
        new records); its failure fails that flow only."""
        conn = self.conn
        if conn is not None and conn.flow.state in (FlowState.READY, FlowState.EOT_SENT):
            now = time.monotonic()
            self._guarded(conn, now, self.handler.on_tick, conn, now)

    def give_up(self, why: str, linger_ms: int = 0) -> None:
        """End the flow (no EOT; its port lingers ``linger_ms``) and never open another;
        ``gave_up`` says why."""
        self.gave_up = why
        self._end(why, linger_ms)

    def end(
        self, reason: str, *, reopen: bool, now: float | None = None, linger_ms: int = 0
    ) -> None:
        """End the open flow here, not as a failure (a handler that took the server's EOT
        itself): a new flow opens after the current back-off delay if ``reopen`` (and
        ``reconnect``), else none (a giver whose EOT is final). ``linger_ms``: how long
        the port's last sends (the echo of the server's EOT) may still go out."""
        if not reopen:
            self.ending = True
        self._end(reason, linger_ms)
        self.retry_at = (time.monotonic() if now is None else now) + self.backoff.delay

    def fail(self, why: str, counter: str, now: float | None = None) -> None:
        """Fail the open flow (a handler's verdict): count, log, back off, reconnect.

        What the monitor already saw is read first: a send that failed because the server
        went away (no peer to queue to) is then the disconnect it is, not a handler error.
        """
        now = time.monotonic() if now is None else now
        conn = self.conn
        if conn is not None and conn.monitor is not None:
            self._on_monitor(conn, now)
            if self.conn is not conn:  # the monitor had seen the connection go
                return
        self._fail(why, counter, now)

    def diagnosis(self) -> str | None:
        """Why there is no flow yet, as far as is known: the last failure, or what the
        monitor saw of an unanswered BOT; None once a flow is open."""
        conn = self.conn
        if conn is None:
            return self.gave_up or self.last_error
        if conn.flow.state is FlowState.BOT_SENT:
            return self.handler.no_reply(conn, self.connect_timeout)[0]
        return None

    # -- internals ------------------------------------------------------------------------

    def _may_open(self) -> bool:
        return not self.ending and self.gave_up is None and not self._closed

    def _connect(self) -> ClientFlow:
        port = self._make_port(self.ctx, **self._port_kw)
        try:
            # A named address: the default one reads socket.FD, experimental on CLIENT.
            monitor = port.socket.get_monitor_socket(
                MONITOR_EVENTS, f"inproc://zio-flow-client-monitor-{next(_monitor_ids)}"
            )
        except BaseException:
            port.close(linger_ms=0)
            raise
        conn = ClientFlow(self, port, monitor)
        try:
            port.connect(self.endpoint)
        except BaseException:
            conn.close(0)
            raise
        self.mode = port.mode
        self.socket_type = port.socket_type
        self.curve_public_key = port.curve_public_key
        return conn

    def _send_bot(self, conn: ClientFlow, now: float) -> None:
        try:
            offer = self.handler.offer(conn)
            conn.send(conn.flow.send_bot(offer.direction, offer.credit, offer.attrs))
        except TransportError as e:
            self._fail(f"cannot send BOT: {e}", "send_failures", now)
            return
        conn.offer = offer
        conn.opened_at = now
        self.stats["connects"] += 1

    def _drain(self, conn: ClientFlow, now: float) -> None:
        for _ in range(_DRAIN_READS):
            try:
                msgs = conn.port.recv_many(_DRAIN_BATCH, 0)
            except TransportError as e:
                self._fail(str(e), "transport_errors", now)
                return
            if not msgs:
                break
            for msg in msgs:
                if isinstance(msg, BadMessage):
                    self._fail(f"bad message: {msg.error}", "protocol_errors", now)
                    return
                self._guarded(conn, now, self._take, conn, msg, now)
                if self.conn is not conn:
                    return
        self._guarded(conn, now, self.handler.on_drained, conn, now)

    def _take(self, conn: ClientFlow, msg: Message, now: float) -> None:
        if self.handler.on_message(conn, msg):
            return
        self._on_event(conn, conn.flow.receive(msg), now)

    def _guarded(self, conn: ClientFlow, now: float, fn: Callable[..., None], *args: Any) -> None:
        """Run a handler step; its failure fails this flow, not the loop."""
        try:
            fn(*args)
        except ProtocolError as e:
            self._fail(f"{type(e).__name__}: {e}", "protocol_errors", now)
        except TransportError as e:
            self._fail(f"cannot send: {e}", "send_failures", now)
        except Exception as e:
            log.exception("%s: handler failed", self.name)
            self._fail(f"handler error: {e!r}", "handler_errors", now)

    def _on_event(self, conn: ClientFlow, event: Event, now: float) -> None:
        handler = self.handler
        if isinstance(event, Data):
            handler.on_data(conn, event)
        elif isinstance(event, Credit):
            handler.on_credit(conn, event)
        elif isinstance(event, BotReceived):
            conn.bot = event
            handler.on_bot(conn, event)
            if self.conn is conn and conn.flow.state is FlowState.READY:
                self.backoff.reset()
                self.stats["flows"] += 1
        elif isinstance(event, Rejected):
            self.stats["rejected"] += 1
            handler.on_rejected(conn, event)
            if self.conn is conn:
                self._fail(f"{handler.rejected_text}: {dict(event.attrs)}", "rejections", now)
        elif isinstance(event, EotReceived):
            handler.on_eot(conn, event)
            if self.conn is not conn:
                return
            if conn.flow.state is FlowState.EOT_RECEIVED:  # the server ends it: echo
                with contextlib.suppress(ProtocolError, TransportError):
                    conn.send_eot()
            if event.echo:  # the answer to our EOT
                self._end("end of transmission")
            else:  # open a new flow later (unless ending, given up or no reconnect)
                self._end("the server ended the flow")
                self.retry_at = now + self.backoff.delay

    def _on_monitor(self, conn: ClientFlow, now: float) -> None:
        monitor = conn.monitor
        while monitor is not None and self.conn is conn and monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if note_monitor_event(conn.seen, int(event), patient=self.patient):
                if conn.bot is None:  # before the server's BOT (or before ours went out)
                    self.stats["unanswered"] += 1
                    why = self.handler.closed_unanswered(conn)
                else:
                    why = self.handler.disconnected_text
                self._fail(why, "disconnects", now)
                return

    def _no_reply(self, conn: ClientFlow, now: float) -> None:
        self.stats["unanswered"] += 1
        why, hopeless = self.handler.no_reply(conn, self.connect_timeout)
        if hopeless or not self.reconnect:
            self.stats["flow_failures"] += 1
            self.stats["bot_timeouts"] += 1
            self.last_error = why
            log.error("%s: %s", self.name, why)
            conn.failure = why
            self._on_failure(conn, why, "bot_timeouts", True)
            self.give_up(why)
        else:
            self._fail(why, "bot_timeouts", now)

    def _fail(self, why: str, counter: str, now: float) -> None:
        self.stats["flow_failures"] += 1
        self.stats[counter] += 1
        # The same failure again (a peer that stays away) is logged once as a warning.
        level = logging.INFO if why == self.last_error else logging.WARNING
        self.last_error = why
        if self.conn is not None:
            self.conn.failure = why
        final = not self._may_open() or not self.reconnect
        if final:
            log.log(level, "%s: %s", self.name, why)
        else:
            log.log(level, "%s: %s; reconnecting in %.1f s", self.name, why, self.backoff.delay)
        self._on_failure(self.conn, why, counter, final)
        self._end(why)
        self.retry_at = now + self.backoff.failed()

    def _on_failure(self, conn: ClientFlow | None, why: str, counter: str, final: bool) -> None:
        try:
            self.handler.on_failure(conn, why, counter, final)
        except Exception:  # a handler bug must not take the loop down
            self.stats["handler_errors"] += 1
            log.exception("%s: on_failure failed", self.name)

    def _end(self, reason: str, linger_ms: int = 0) -> None:
        conn, self.conn = self.conn, None
        if not self.reconnect:
            self.ending = True
        if conn is None:
            return
        conn.close(linger_ms)
        try:
            self.handler.on_close(conn, reason)
        except Exception:  # a handler bug must not take the loop down
            self.stats["handler_errors"] += 1
            log.exception("%s: on_close failed", self.name)
