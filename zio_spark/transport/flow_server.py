"""A multi-client flow server: one flow state machine and one handler per client.

Like ZIO's flow broker, one :class:`~zio_spark.transport.port.ServerPort` accepts many
clients; each client's first message must be its BOT, and a handler made by the
factory serves that client's flow. Unlike the reference, a client is *removed*: when its
EOT exchange completes, when it breaks the protocol (the violation is logged with the
peer, counted in ``stats["dropped"]``, and no other flow notices), when it has been
silent for ``idle_timeout`` seconds, or, for a flow whose handler watches it
(:meth:`FlowHandler.watches_connection`) on a port that knows connections
(``ServerPort(conn_ids=True)``), when the connection its BOT came on has closed without
an EOT (``conn_check``; ``stats["gone"]``): a reader process killed, its host lost (with
ZMTP heartbeats on the port). That is transport state, not a guess from quiet time.

Everything runs in one thread that owns the socket, so handlers never need locks for
flow state. Two ways to run it:

- **Own thread**: :meth:`FlowServer.start` runs it on a :class:`~.loop.Loop` in a thread of
  its own; :meth:`FlowServer.stop` ends it and closes the port. Other threads reach it
  with :meth:`FlowServer.call_soon` (the loop's waker interrupts the poll).
- **Inline**, from another loop's thread (the queue broker, the receiver): the server is
  a :class:`~.loop.LoopPart`. Either ``loop.add(server)`` on a shared
  :class:`~.loop.Loop` (then :meth:`~FlowServer.call_soon` goes through that loop: pass
  ``loop=`` or call :meth:`FlowServer.attach`), or drive it by hand: poll
  :meth:`~FlowServer.sockets`, then call :meth:`~FlowServer.process` (dispatch what
  arrived, never blocks) and :meth:`~FlowServer.tick` (idle removal, handlers'
  ``on_tick``, queued calls) every turn, at least every ``tick`` seconds; end with
  :meth:`~FlowServer.close`.

In either mode :meth:`FlowServer.poke` runs one flow's ``on_tick`` at once (a giver with
new records to send) and :meth:`FlowServer.remove` ends one flow; a handler error, a
protocol violation or a failed send ends that flow only.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import zmq

from zio_spark.errors import ConfigError, ProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Data,
    EotReceived,
    Flow,
    FlowState,
    Role,
)
from zio_spark.protocol.message import DatCodec, Message
from zio_spark.transport.loop import Loop, LoopThread
from zio_spark.transport.port import (
    BadMessage,
    Connection,
    PeerId,
    ServerPort,
    connection_open,
    format_peer,
)

__all__ = ["FlowHandler", "FlowServer", "ServerFlow"]

log = logging.getLogger("zio_spark.transport")
# process() calls (1000 messages each) that serve what a closed connection's client had
# sent before its flow is removed.
_DRAIN_CALLS = 10


class ServerFlow:
    """The server's side of one client's flow; handed to every handler callback."""

    def __init__(self, server: FlowServer, peer: PeerId, origin: int) -> None:
        self.server = server
        self.peer = peer
        self.flow = Flow(Role.SERVER, origin=origin)
        self._dat_codec = DatCodec(origin)
        self.last_seen = time.monotonic()
        self.bot: BotReceived | None = None
        self.bot_origin = 0
        """The coord ``origin`` of the client's BOT message (the node that sent it)."""
        self.connection: Connection | None = None
        """The connection the client's BOT came on, if the port knows it (``conn_ids``)."""
        self.gone = False
        """True once the server removed the flow because that connection closed."""

    @property
    def name(self) -> str:
        return format_peer(self.peer)

    def _send(self, msg: Message) -> None:
        self.server.port.send(msg, self.peer, timeout_ms=self.server.send_timeout_ms)

    def accept(self, credit: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        """Accept the client's BOT; the credit is lowered to what our queue to it holds.

        With more credit than the send queue (``sndhwm``) takes, a client that is slow
        for a moment would look like one that stopped reading (see ``send_timeout``).
        """
        cap = self.server.max_credit
        if cap is not None and self.bot is not None:
            credit = min(self.bot.credit if credit is None else credit, cap)
        self._send(self.flow.accept(credit, attrs))

    def reject(self, attrs: Mapping[str, Any] | None = None) -> None:
        self._send(self.flow.reject(attrs))

    def send_dat(
        self, payload: tuple[bytes, ...] = (), attrs: Mapping[str, Any] | None = None
    ) -> None:
        if attrs:
            self._send(self.flow.send_dat(payload, attrs))
        else:  # the fast lane: no Message for a plain DAT
            self.server.port.send_dat(
                self._dat_codec,
                self.flow.send_dats(1),
                payload,
                self.peer,
                timeout_ms=self.server.send_timeout_ms,
            )

    def pay(self, amount: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        self._send(self.flow.pay(amount, attrs))

    def send_eot(self, attrs: Mapping[str, Any] | None = None) -> None:
        self._send(self.flow.send_eot(attrs))


class FlowHandler:
    """Serves one client flow. Override what you need; all run in the server thread.

    The default :meth:`on_bot` accepts the client's offer; the default :meth:`on_eot`
    does nothing, and the server echoes the EOT after it returns.
    """

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        conn.accept()

    def on_message(self, conn: ServerFlow, msg: Message) -> bool:
        """Every message of the open flow before the flow machine sees it; True if taken
        here (a fast lane calling ``conn.flow.take_dat()`` itself). Default: False."""
        return False

    def on_drained(self, conn: ServerFlow, now: float) -> None:
        """Once per :meth:`FlowServer.process` call that brought this flow input, after
        all of it was dispatched (batch work: storing what arrived)."""

    def on_data(self, conn: ServerFlow, data: Data) -> None:
        pass

    def on_credit(self, conn: ServerFlow, credit: Credit) -> None:
        pass

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        pass

    def on_tick(self, conn: ServerFlow, now: float) -> None:
        """Called on every loop turn while the flow is in transfer (givers push here)."""

    def watches_connection(self, conn: ServerFlow) -> bool:
        """True if the flow ends when its connection closes without EOT (``conn_check``).
        Default False: a flow lives until its EOT, a violation or ``idle_timeout``."""
        return False

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        pass


class FlowServer:
    """Serve flows on ``port`` with a handler per client, in a background thread.

    Parameters
    ----------
    port
        A bound :class:`ServerPort` (in "return" bad-message mode); the server owns it
        from :meth:`start` on and closes it on :meth:`stop`.
    handler_factory
        Called with no arguments for each new client's BOT.
    idle_timeout
        Remove a client silent for this many seconds (None: never).
    tick
        Longest poll wait in seconds; handlers' :meth:`~FlowHandler.on_tick` run at
        least this often.
    send_timeout
        Longest wait, in seconds, for room to queue one message to a client. Every flow
        shares the loop thread, so a client that stops reading must not hold it: a
        well-behaved peer's queue never fills (DATs and PAYs are bounded by the credit),
        and one that stays full this long is removed (``stats["send_failures"]``).
    on_stray
        Called with ``(peer, msg, why)`` for input of a client without an open flow that
        is not a BOT (``msg`` None: a message that did not parse). None: such input is
        dropped (``stats["dropped"]``, logged).
    conn_check
        Seconds between two looks at the connections of the flows whose handlers watch
        them (:meth:`FlowHandler.watches_connection`; one ``fstat`` each, nothing sent):
        a flow whose connection closed without EOT is removed (``stats["gone"]``). It
        bounds how late a closed connection is noticed, it decides nothing by itself.
        None (the default): never. Needs a port made with ``conn_ids=True``.
    """

    def __init__(
        self,
        port: ServerPort,
        handler_factory: Callable[[], FlowHandler],
        *,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        idle_timeout: float | None = None,
        tick: float = 0.05,
        origin: int = 0,
        name: str = "flow-server",
        send_timeout: float = 0.2,
        loop: Loop | None = None,
        on_stray: Callable[[PeerId, Message | None, str], None] | None = None,
        conn_check: float | None = None,
    ) -> None:
        if conn_check is not None and (
            isinstance(conn_check, bool)
            or not isinstance(conn_check, (int, float))
            or not 0 < conn_check <= 3600
        ):
            raise ConfigError("conn_check", conn_check, "seconds, > 0 and <= 3600, or None")
        if isinstance(send_timeout, bool) or not (
            isinstance(send_timeout, (int, float)) and 0 <= send_timeout <= 3600
        ):
            raise ConfigError("send_timeout", send_timeout, "seconds, 0..3600")
        self.send_timeout_ms = send_timeout * 1000.0
        self.max_credit = port.sndhwm or None  # 0: no limit
        self.port = port
        self.handler_factory = handler_factory
        self.idle_timeout = idle_timeout
        self.tick_s = tick
        self.origin = origin
        self.on_stray = on_stray
        self.conn_check = conn_check
        self._next_check = 0.0  # monotonic time of the next look at connections
        self.name = name
        self.ctx = ctx or zmq.Context.instance()
        self.flows: dict[PeerId, tuple[ServerFlow, FlowHandler]] = {}
        self.stats: collections.Counter[str] = collections.Counter()
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._own: LoopThread | None = None  # start(): a loop and thread of its own
        self._loop: Loop | None = None  # the loop driving it (own or shared), if any
        self._closed = False
        self.error: BaseException | None = None
        if loop is not None:
            self.attach(loop)

    @property
    def endpoint(self) -> str:
        ep = self.port.endpoint
        if ep is None:
            raise TransportError("flow server port is not bound")
        return ep

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> FlowServer:
        """Run the server in a thread of its own (see the module docstring)."""
        if self._loop is not None:
            raise TransportError(f"{self.name} is already driven by a loop")
        loop = Loop(tick=self.tick_s, name=self.name, stats=self.stats)
        self.attach(loop)
        self._own = LoopThread(loop, self._run)
        return self

    @property
    def running(self) -> bool:
        """True while the server's own thread runs (:meth:`start`)."""
        return self._own is not None and self._own.alive

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the own thread (if any), end every flow and close the port (idempotent)."""
        if self._own is not None:
            if not self._own.stop(timeout):
                raise TransportError(f"{self.name} did not stop within {timeout} s")
            self._own = None
        self.close()

    def __enter__(self) -> FlowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def attach(self, loop: Loop) -> None:
        """Be driven by ``loop`` (a part of it); :meth:`call_soon` then goes through it."""
        self._loop = loop
        loop.add(self)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the server's thread at the next turn (thread-safe).

        Driven by hand (no loop), the call runs at the next :meth:`tick`.
        """
        if self._loop is not None:
            self._loop.call_soon(fn)
        else:
            self._calls.append(fn)

    # -- driving it inline -----------------------------------------------------------

    def sockets(self) -> list[zmq.Socket[bytes]]:
        """The socket to poll for input (empty once closed)."""
        return [] if self._closed else [self.port.socket]

    def process(self, ready: Collection[object] | None = None, now: float | None = None) -> None:
        """Dispatch what arrived, without blocking (server thread).

        ``ready``: the poll's events; the socket is read only if it is among them (None:
        read it regardless). At most ``1000`` messages a call, so ticks still run.
        """
        if self._closed or (ready is not None and self.port.socket not in ready):
            return
        touched: dict[PeerId, ServerFlow] = {}
        for got in self.port.recv_many(1000, 0):
            conn = self._dispatch(got)
            if conn is not None:
                touched.setdefault(conn.peer, conn)
        if not touched:
            return
        at = time.monotonic() if now is None else now
        for conn in touched.values():
            entry = self.flows.get(conn.peer)
            if entry is not None and entry[0] is conn:
                self._guarded(conn, entry[1], "on_drained", entry[1].on_drained, conn, at)

    def tick(self, now: float | None = None) -> float:
        """Run queued calls, remove idle clients and run every open flow's ``on_tick``
        (server thread). Returns the most seconds until the next tick is due."""
        while self._calls:
            self._run_call(self._calls.popleft())
        self._tick(time.monotonic() if now is None else now)
        return self.tick_s

    def poke(self, conn: ServerFlow) -> None:
        """Run ``conn``'s handler ``on_tick`` now, if its flow is still served (server
        thread); its errors end that flow only."""
        entry = self.flows.get(conn.peer)
        if entry is not None and entry[0] is conn:
            self.tick_flow(conn, entry[1], time.monotonic())

    def remove(self, conn: ServerFlow, reason: str) -> None:
        """End ``conn``'s flow here (no EOT is sent): its handler's ``on_close`` runs."""
        entry = self.flows.get(conn.peer)
        if entry is not None and entry[0] is conn:
            self._remove(conn, entry[1], reason)

    def close(self, reason: str = "server stopped", linger_ms: int | None = None) -> None:
        """End every flow (``on_close`` with ``reason``) and close the port, lingering
        ``linger_ms`` (None: the port's own; idempotent; server thread, or any thread
        once the loop has ended)."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.remove(self)
        for conn, handler in list(self.flows.values()):
            self._remove(conn, handler, reason)
        self.port.close(linger_ms)

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.run()
        except BaseException as e:  # pragma: no cover - reported, never silent
            self.error = e
            log.exception("%s: loop failed", self.name)
        finally:
            for conn, handler in list(self.flows.values()):
                self._remove(conn, handler, "server stopped")

    def _run_call(self, fn: Callable[[], None]) -> None:
        # A failing call must not end the loop, and with it every client's flow.
        try:
            fn()
        except Exception:
            self.stats["call_errors"] += 1
            log.exception("%s: call_soon function %r failed", self.name, fn)

    def _dispatch(self, got: tuple[PeerId, Message] | BadMessage) -> ServerFlow | None:
        """Handle one input; returns the open flow it went to, if any."""
        if isinstance(got, BadMessage):
            self.stats["bad_messages"] += 1
            if got.peer is not None and not isinstance(got.peer, str):
                entry = self.flows.get(got.peer)
                if entry is not None:
                    self._drop(entry[0], entry[1], got.error)
                elif self.on_stray is not None:
                    self._stray(got.peer, None, str(got.error))
            return None
        peer, msg = got
        entry = self.flows.get(peer)
        if entry is None:
            conn = ServerFlow(self, peer, self.origin)
            handler: FlowHandler | None = None
        else:
            conn, handler = entry
        conn.last_seen = time.monotonic()
        try:
            if handler is not None and handler.on_message(conn, msg):
                return conn
            event = conn.flow.receive(msg)
        except ProtocolError as e:
            if handler is None and self.on_stray is not None:
                self._stray(peer, msg, str(e))
            else:
                self._drop(conn, handler, e)
            return None
        except TransportError as e:
            self._send_failed(conn, handler, e)
            return None
        except Exception as e:  # a handler bug ends its flow, not the server
            self._handler_failed(conn, handler, "on_message", e)
            return None
        if handler is None and not isinstance(event, BotReceived):
            why = f"{type(event).__name__} before any BOT"
            if self.on_stray is not None:
                self._stray(peer, msg, why)
            else:
                self._drop(conn, None, RemoteProtocolError(why, field="flow"))
            return None
        try:
            if isinstance(event, BotReceived):
                handler = self.handler_factory()
                conn.bot = event
                conn.bot_origin = msg.origin
                conn.connection = self.port.connection(peer)
                self.flows[peer] = (conn, handler)
                self.stats["flows"] += 1
                handler.on_bot(conn, event)
                if conn.flow.state is FlowState.CLOSED:  # rejected
                    self._remove(conn, handler, "rejected")
            elif handler is None:  # pragma: no cover - handled above
                raise AssertionError("event before BOT")
            elif isinstance(event, Data):
                handler.on_data(conn, event)
            elif isinstance(event, Credit):
                handler.on_credit(conn, event)
            elif isinstance(event, EotReceived):
                handler.on_eot(conn, event)
                if conn.flow.state is FlowState.EOT_RECEIVED:
                    conn.send_eot()
                if conn.flow.state is FlowState.CLOSED:
                    self._remove(conn, handler, "end of transmission")
        except ProtocolError as e:
            self._drop(conn, handler, e)
        except TransportError as e:
            self._send_failed(conn, handler, e)
        except Exception as e:  # a handler bug ends its flow, not the server
            self._handler_failed(conn, handler, "handler", e)
        return conn

    def _stray(self, peer: PeerId, msg: Message | None, why: str) -> None:
        assert self.on_stray is not None
        try:
            self.on_stray(peer, msg, why)
        except Exception:  # a hook bug must not take the server down
            self.stats["handler_errors"] += 1
            log.exception("%s: on_stray for %s failed", self.name, format_peer(peer))

    def _handler_failed(
        self, conn: ServerFlow, handler: FlowHandler | None, what: str, error: Exception
    ) -> None:
        self.stats["handler_errors"] += 1
        log.exception("%s: %s of %s failed", self.name, what, conn.name)
        if handler is not None:
            self._remove(conn, handler, f"handler error: {error!r}")

    def _check_connections(self) -> None:
        """Remove the watched flows whose connection closed without EOT (module doc)."""
        self.stats["conn_checks"] += 1
        gone: list[tuple[ServerFlow, FlowHandler]] = []
        for conn, handler in list(self.flows.values()):
            c = conn.connection
            if c is None or connection_open(c):
                continue
            try:
                if handler.watches_connection(conn):
                    gone.append((conn, handler))
            except Exception as e:
                self._handler_failed(conn, handler, "watches_connection", e)
        if not gone:
            return
        # libzmq closes the descriptor at once, but what the client sent before (its EOT,
        # a last commit) may still wait in the socket: it is served first.
        for _ in range(_DRAIN_CALLS):
            if self._closed or not self.port.socket.poll(0, zmq.POLLIN):
                break
            self.process()
        for conn, handler in gone:
            entry = self.flows.get(conn.peer)
            if entry is None or entry[0] is not conn:
                continue  # ended by what was still queued (its EOT)
            conn.gone = True
            self.stats["gone"] += 1
            log.info("%s: %s closed its connection without EOT", self.name, conn.name)
            self._remove(conn, handler, "the client's connection closed without EOT")

    def _tick(self, now: float) -> None:
        if self.conn_check is not None and now >= self._next_check:
            self._next_check = now + self.conn_check
            self._check_connections()
        for conn, handler in list(self.flows.values()):
            if self.idle_timeout is not None and now - conn.last_seen > self.idle_timeout:
                self.stats["idle_removed"] += 1
                self._remove(conn, handler, f"idle for more than {self.idle_timeout} s")
                continue
            if conn.flow.state in (FlowState.READY, FlowState.EOT_SENT):
                self.tick_flow(conn, handler, now)

    def tick_flow(self, conn: ServerFlow, handler: FlowHandler, now: float) -> None:
        """Run ``handler.on_tick`` now; its errors end that flow only (server thread only)."""
        self._guarded(conn, handler, "on_tick", handler.on_tick, conn, now)

    def _guarded(
        self,
        conn: ServerFlow,
        handler: FlowHandler,
        what: str,
        fn: Callable[[ServerFlow, float], None],
        *args: Any,
    ) -> None:
        try:
            fn(*args)
        except ProtocolError as e:
            self._drop(conn, handler, e)
        except TransportError as e:
            self._send_failed(conn, handler, e)
        except Exception as e:
            self._handler_failed(conn, handler, what, e)

    def _send_failed(
        self, conn: ServerFlow, handler: FlowHandler | None, error: TransportError
    ) -> None:
        # The client is gone, or its queue stayed full for send_timeout: it is not
        # reading, and it must not hold up every other flow on this loop.
        self.stats["send_failures"] += 1
        log.warning("%s: removing %s, cannot send to it: %s", self.name, conn.name, error)
        if handler is not None:
            self._remove(conn, handler, f"transport error: {error}")

    def _drop(self, conn: ServerFlow, handler: FlowHandler | None, error: ProtocolError) -> None:
        self.stats["dropped"] += 1
        log.warning(
            "%s: dropping peer %s: %s: %s",
            self.name,
            conn.name,
            type(error).__name__,
            error,
        )
        if handler is not None:
            self._remove(conn, handler, f"protocol error: {error}")

    def _remove(self, conn: ServerFlow, handler: FlowHandler, reason: str) -> None:
        if self.flows.get(conn.peer, (None,))[0] is conn:
            del self.flows[conn.peer]
        try:
            handler.on_close(conn, reason)
        except Exception:  # a handler bug must not take the server down
            self.stats["handler_errors"] += 1
            log.exception("%s: on_close of %s failed", self.name, conn.name)
