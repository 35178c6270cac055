"""Blocking, thread-friendly flow endpoints in the spirit of ZIO's ``zio::flow::Flow``.

A :class:`FlowEndpoint` drives one :class:`~zio_spark.protocol.flow.Flow` state machine
over a *channel*: anything with ``send(msg)`` and ``recv(timeout_ms) -> Message | None``
(a :class:`~zio_spark.transport.port.ClientPort`, or one client's view of a server port).
Every call that waits takes a timeout; a wait that runs out raises
:class:`~zio_spark.errors.TransportError` naming the endpoint (or returns ``None`` where
documented), so a lost peer never hangs a Spark task.

An endpoint is used from one thread at a time (pyzmq sockets are not thread-safe).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from zio_spark.errors import LocalProtocolError, ProtocolError, TransportError
from zio_spark.protocol.credit import AutoPay
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
from zio_spark.transport.port import BadMessage

__all__ = ["Channel", "FlowEndpoint", "FlowRejected"]

_AUTO_PAY = AutoPay()  # a taker's default credit rule (get/get_many with auto_pay)


class Channel(Protocol):
    """What a flow endpoint needs from a port."""

    @property
    def endpoint(self) -> str | None: ...

    def send(self, msg: Message) -> None: ...

    def send_dat(self, codec: DatCodec, seqno: int, payload: tuple[bytes, ...]) -> None:
        """Send a plain DAT: what ``send`` does with the message ``codec`` describes."""

    def send_dats(self, codec: DatCodec, first: int, payloads: Sequence[tuple[bytes, ...]]) -> None:
        """Send plain DATs ``first``, ``first + 1``, ...: ``send_dat`` for each."""

    def recv(self, timeout_ms: int) -> Message | BadMessage | None: ...

    def recv_many(self, max_n: int, timeout_ms: int) -> list[Message | BadMessage]:
        """Up to ``max_n`` messages: the first within ``timeout_ms``, then those queued."""


class FlowRejected(TransportError):
    """The server answered our BOT with EOT; ``attrs`` holds its reasons."""

    def __init__(self, endpoint: str | None, attrs: Mapping[str, Any]) -> None:
        self.attrs = dict(attrs)
        super().__init__(f"flow rejected by the server: {self.attrs}", endpoint=endpoint)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining_ms(deadline: float | None) -> int:
    if deadline is None:
        return 1000  # wait in slices so a closed endpoint is noticed
    return max(0, int((deadline - time.monotonic()) * 1000))


class FlowEndpoint:
    """One end of a flow over ``channel``.

    Parameters
    ----------
    channel
        Where messages go and come from.
    role
        Client (speaks first) or server.
    origin
        The ``origin`` stamped on our messages.
    on_credit
        Called with every PAY the giver receives (the zio-spark ``ack`` rides on it).
    """

    def __init__(
        self,
        channel: Channel,
        role: Role,
        *,
        origin: int = 0,
        on_credit: Callable[[Credit], None] | None = None,
    ) -> None:
        self.channel = channel
        self.flow = Flow(role, origin=origin)
        self.on_credit = on_credit
        self.bot: BotReceived | None = None
        self._pending_eot: EotReceived | None = None
        # get_many: an error met behind good DATs (raised by the next call), and the
        # messages after it, taken off the channel but not yet through the flow.
        self._deferred: ProtocolError | None = None
        self._backlog: collections.deque[Message | BadMessage] = collections.deque()
        self._dat_codec = DatCodec(origin)

    # -- small helpers -------------------------------------------------------------

    @property
    def endpoint(self) -> str | None:
        return self.channel.endpoint

    @property
    def is_sender(self) -> bool:
        """True if this end gives (sends DATs)."""
        return self.flow.is_giver

    @property
    def state(self) -> FlowState:
        return self.flow.state

    def _timeout(self, what: str, timeout: float | None) -> TransportError:
        return TransportError(
            f"timed out after {timeout} s waiting for {what}", endpoint=self.endpoint
        )

    def _raise_deferred(self) -> None:
        """Raise the error ``get_many`` met behind good DATs, once."""
        if self._deferred is not None:
            error, self._deferred = self._deferred, None
            raise error

    def _recv(self, timeout_ms: int) -> Message | BadMessage | None:
        """The next message: one that ``get_many`` left over, else from the channel; an
        error ``get_many`` deferred is raised first."""
        self._raise_deferred()
        if self._backlog:
            return self._backlog.popleft()
        return self.channel.recv(timeout_ms)

    def _next(self, deadline: float | None, what: str, timeout: float | None) -> Event:
        while True:
            msg = self._recv(_remaining_ms(deadline))
            if isinstance(msg, BadMessage):
                raise msg.error
            if msg is not None:
                return self.flow.receive(msg)
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timeout(what, timeout)

    # -- handshake -----------------------------------------------------------------

    def send_bot(
        self, direction: Direction, credit: int, attrs: Mapping[str, Any] | None = None
    ) -> None:
        """Client: send our BOT (``direction`` is ours: extract = we give)."""
        self.channel.send(self.flow.send_bot(direction, credit, attrs))

    def recv_bot(self, timeout: float | None = 30.0) -> BotReceived:
        """Wait for the peer's BOT.

        Raises
        ------
        TransportError
            On timeout.
        FlowRejected
            If the server answered with EOT.
        RemoteProtocolError
            If the peer sent anything else.
        """
        deadline = _deadline(timeout)
        event = self._next(deadline, "the peer's BOT", timeout)
        if isinstance(event, Rejected):
            raise FlowRejected(self.endpoint, event.attrs)
        assert isinstance(event, BotReceived)  # the machine allows nothing else here
        self.bot = event
        return event

    def accept(self, credit: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        """Server: answer the client's BOT."""
        self.channel.send(self.flow.accept(credit, attrs))

    def connect(
        self,
        direction: Direction,
        credit: int,
        attrs: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
    ) -> BotReceived:
        """Client: :meth:`send_bot` then :meth:`recv_bot`."""
        self.send_bot(direction, credit, attrs)
        return self.recv_bot(timeout)

    # -- giver ---------------------------------------------------------------------

    def _handle_giver_event(self, event: Event) -> bool:
        if isinstance(event, Credit):
            if self.on_credit is not None:
                self.on_credit(event)
            return True
        assert isinstance(event, EotReceived)
        self._pending_eot = event
        return False

    def poll(self) -> bool:
        """Giver: take in every PAY already waiting, without blocking.

        Returns False if the peer sent EOT (answer with :meth:`send_eot`).
        """
        while True:
            msg = self._recv(0)
            if isinstance(msg, BadMessage):
                raise msg.error
            if msg is None:
                return True
            if not self._handle_giver_event(self.flow.receive(msg)):
                return False

    def put(
        self,
        payload: tuple[bytes, ...],
        attrs: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
    ) -> bool:
        """Giver: send one DAT, waiting for credit if needed.

        Returns False (nothing sent) if the peer sent EOT instead of credit.

        Raises
        ------
        TransportError
            If no credit came within ``timeout``.
        """
        if self._pending_eot is not None:
            return False
        if self.flow.credit <= 0:
            deadline = _deadline(timeout)
            while self.flow.credit <= 0:
                event = self._next(deadline, "credit (PAY)", timeout)
                if not self._handle_giver_event(event):
                    return False
        if attrs:
            self.channel.send(self.flow.send_dat(payload, attrs))
        else:  # the fast lane: no Message for a plain DAT
            self.channel.send_dat(self._dat_codec, self.flow.send_dats(1), payload)
        return True

    def put_many(self, payloads: Sequence[tuple[bytes, ...]], timeout: float | None = 30.0) -> int:
        """Giver: send one plain DAT per payload, in order, waiting for credit as needed
        (each wait up to ``timeout``). What :meth:`put` does for each, with the credit
        spent and the DATs queued a run at a time.

        Returns how many were sent: all of them, or fewer if the peer sent EOT.

        Raises
        ------
        TransportError
            If no credit came within ``timeout``, or a DAT could not be queued; its
            ``sent`` says how many of ``payloads`` went out (the first ``sent``). After a
            failure to queue, the flow is not usable: credit and sequence numbers were
            spent on DATs that never left, as with :meth:`put`.
        """
        n = len(payloads)
        sent = 0
        try:
            while sent < n:
                if self._pending_eot is not None:
                    return sent
                flow = self.flow
                if flow.credit <= 0:
                    deadline = _deadline(timeout)
                    while flow.credit <= 0:
                        event = self._next(deadline, "credit (PAY)", timeout)
                        if not self._handle_giver_event(event):
                            return sent
                k = min(flow.credit, n - sent)
                run = payloads[sent : sent + k]
                self.channel.send_dats(self._dat_codec, flow.send_dats(k), run)
                sent += k
        except TransportError as e:
            e.sent = sent + (e.sent or 0)  # a run that failed part-way counts its own
            raise
        return sent

    # -- taker ---------------------------------------------------------------------

    def pay(self, amount: int | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        """Taker: hand out ``amount`` credits (default all held), with extra attributes."""
        self.channel.send(self.flow.pay(amount, attrs))

    def _auto_pay(self) -> None:
        n = _AUTO_PAY.to_pay(self.flow.credit)  # the reference's rule: all held
        if n > 0:
            self.pay(n)

    def get(self, timeout: float | None = 30.0, *, auto_pay: bool = True) -> Data | None:
        """Taker: the next DAT, or None if the peer sent EOT (answer with :meth:`send_eot`).

        With ``auto_pay`` every credit held is handed back first (the reference's
        behaviour); without it, the caller decides when to :meth:`pay`.

        Raises
        ------
        TransportError
            If no DAT came within ``timeout``.
        """
        if self._pending_eot is not None:
            return None
        if self.flow.is_giver:
            raise LocalProtocolError("get() on a giver; use put()", field="direction")
        if auto_pay:
            self._auto_pay()
        event = self._next(_deadline(timeout), "a DAT", timeout)
        if isinstance(event, Data):
            return event
        assert isinstance(event, EotReceived)
        self._pending_eot = event
        return None

    def get_many(
        self, max_n: int = 1000, timeout: float | None = 30.0, *, auto_pay: bool = True
    ) -> list[Data]:
        """Taker: up to ``max_n`` DATs, the first within ``timeout``, then those already
        queued (no waiting for more); ``[]`` once the peer sent EOT (answer with
        :meth:`send_eot`). What :meth:`get` does, a batch at a time: for takers that
        drain a busy flow, one call per batch instead of per DAT.

        With ``auto_pay`` every credit held is handed back first, as in :meth:`get`.

        Raises
        ------
        TransportError
            If no DAT came within ``timeout``.
        RemoteProtocolError, FlowControlError
            If the peer broke the protocol. When that happens after good DATs of the
            same batch, those are returned first and the next call raises.
        """
        if self._pending_eot is not None:
            return []
        self._raise_deferred()
        if self.flow.is_giver:
            raise LocalProtocolError("get_many() on a giver; use put()", field="direction")
        if auto_pay:
            self._auto_pay()
        msgs: list[Message | BadMessage]
        if self._backlog:  # left over by the previous call
            msgs = [self._backlog.popleft() for _ in range(min(max_n, len(self._backlog)))]
        else:
            deadline = _deadline(timeout)
            while not (msgs := self.channel.recv_many(max_n, _remaining_ms(deadline))):
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._timeout("a DAT", timeout)
        out: list[Data] = []
        receive = self.flow.receive
        for i, msg in enumerate(msgs):
            if isinstance(msg, BadMessage):
                if not out:
                    self._backlog.extendleft(reversed(msgs[i + 1 :]))
                    raise msg.error
                # The good DATs first; this one raises at the next call, as with get().
                self._backlog.extendleft(reversed(msgs[i:]))
                break
            try:
                event = receive(msg)
            except ProtocolError as e:
                # What follows stays queued (a flow in ERROR will refuse it, precisely).
                self._backlog.extendleft(reversed(msgs[i + 1 :]))
                if not out:
                    raise
                self._deferred = e
                break
            if type(event) is Data:
                out.append(event)
                continue
            # A taker's flow lets nothing else through: PAY or BOT here raise above.
            assert isinstance(event, EotReceived)
            self._pending_eot = event
            self._backlog.extendleft(reversed(msgs[i + 1 :]))
            break
        return out

    # -- end of transmission ------------------------------------------------------

    @property
    def peer_eot(self) -> EotReceived | None:
        """The EOT the peer sent, once seen."""
        return self._pending_eot

    def send_eot(
        self,
        attrs: Mapping[str, Any] | None = None,
        timeout: float | None = 30.0,
        on_data: Callable[[Data], None] | None = None,
    ) -> EotReceived:
        """End the flow and wait until both sides agree.

        If the peer already sent EOT this only echoes it. Otherwise our EOT goes out and
        we drain DATs (passed to ``on_data``) and PAYs until the echo arrives: only then
        is every message the peer sent accounted for (FACTS.md: closing right after the
        last send can lose data over ipc).

        Raises
        ------
        TransportError
            If the echo does not come within ``timeout``.
        """
        if self._pending_eot is None and self.flow.state is FlowState.READY:
            # The peer's EOT may already be queued: take in what is waiting first.
            while (msg := self._recv(0)) is not None:
                if isinstance(msg, BadMessage):
                    raise msg.error
                event = self.flow.receive(msg)
                if isinstance(event, EotReceived):
                    self._pending_eot = event
                    break
                self._dispatch_drain(event, on_data)
        if self._pending_eot is not None:
            self.channel.send(self.flow.send_eot(attrs))
            return self._pending_eot
        self.channel.send(self.flow.send_eot(attrs))
        return self.recv_eot(timeout, on_data)

    def recv_eot(
        self, timeout: float | None = 30.0, on_data: Callable[[Data], None] | None = None
    ) -> EotReceived:
        """After our EOT: drain until the peer's echo."""
        deadline = _deadline(timeout)
        while True:
            event = self._next(deadline, "the EOT echo", timeout)
            if isinstance(event, EotReceived):
                self._pending_eot = event
                return event
            self._dispatch_drain(event, on_data)

    def _dispatch_drain(self, event: Event, on_data: Callable[[Data], None] | None) -> None:
        if isinstance(event, Data):
            if on_data is not None:
                on_data(event)
        elif isinstance(event, Credit) and self.on_credit is not None:
            self.on_credit(event)
