"""A range reader's blocking client: held windows and ranges straight from a producer.

The reader's side of the direct read mode (docs/direct-read.md, the pure protocol in
:mod:`zio_spark.protocol.ranges`), for the Spark planner and tasks to come; no pyspark
here. Two calls, each on a flow of its own:

- :func:`held_window` asks a producer for its held window: ``(incarnation, first, end)``;
- :func:`read_range` reads records ``[start, end)`` planned on ``incarnation`` and
  yields them as Arrow record batches of the wire schema (``seq``, ``value``, ``key``,
  ``granule``, ``headers``), in order, each record once.

:class:`RangeConnection` is the flow under both, for a caller that asks many things on
one flow. :class:`ControlConnection` is the driver's control flow to one producer
(``read: "control"``): :meth:`~ControlConnection.held` for ``latestOffset`` and
:meth:`~ControlConnection.ack` for Spark's commit (``ack`` with ``commit: {id, producer,
incarnation}``; the producer frees up to the number only if the incarnation is its own,
else :class:`AckRefused` and nothing is freed), and :meth:`~ControlConnection.admit` to
register a query run's CURVE key (admitted while the control flow lives, by a producer
with an allow-list). With CURVE, every connection first waits for the handshake's
outcome on a socket monitor: a key the producer's ZAP handler refuses fails at once with
the endpoint and the fix, not after a silent BOT wait.

Engine: a :class:`~zio_spark.transport.port.ClientPort` under a
:class:`~zio_spark.transport.flow_endpoint.FlowEndpoint`, the blocking flow endpoint the
rest of the transport already has: every wait takes a deadline and raises a
:class:`~zio_spark.errors.TransportError` naming the endpoint and what was awaited, and
nothing runs in another thread. The reconnecting
:class:`~zio_spark.transport.flow_client.FlowClient` is a loop engine for long-lived
flows; a request whose failure must reach the caller (a task, to retry or fail) wants no
reconnection and no thread.

Per flow: BOT ``{direction: inject, credit, stream, read: "range", encoding: ["arrow"]}``
(:func:`~zio_spark.protocol.ranges.offer_attrs`); the server's BOT must state the
capability as its own (:func:`~zio_spark.protocol.ranges.client_range_terms`), else
:class:`RangesNotServed` is raised after an EOT, with no request sent (such a producer
is read through the spool path). A request rides on a PAY of all the credit held; credit
is paid back as DATs are taken (half the flow's credit at a time). A refusal of a range
is raised as :meth:`RangeReader.loss <zio_spark.protocol.ranges.RangeReader.loss>`'s
:class:`~zio_spark.errors.DataLossError`: batches already yielded by that
:func:`read_range` are then to be discarded (a refusal follows records only when acks
freed the rest of the range: a speculative copy of a committed task). A range reader
never acknowledges: acks go on the driver's control flow (or a spool-mode taker's).

Thread-safety: each call makes its own socket; calls may run in many threads at once
with one context.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pyarrow as pa
import zmq
from zmq.utils.monitor import recv_monitor_message

from zio_spark.codec.records import ENCODING, decode_batch
from zio_spark.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, TransportError
from zio_spark.protocol.flow import Direction, FlowState, Role
from zio_spark.protocol.ranges import (
    READ_CONTROL,
    READ_RANGE,
    Acked,
    Admitted,
    CommitRefused,
    HeldReport,
    RangeReader,
    RangeTerms,
    ReaderState,
    UnknownProducer,
    client_range_terms,
    offer_attrs,
)
from zio_spark.transport.curve import Curve
from zio_spark.transport.flow_client import HANDSHAKE_FAILED
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import ClientPort

__all__ = [
    "DEFAULT_CREDIT",
    "AckRefused",
    "ControlConnection",
    "HeldWindow",
    "RangeConnection",
    "RangesNotServed",
    "held_window",
    "read_range",
]

log = logging.getLogger("zio_spark.transport")

DEFAULT_CREDIT = 64
"""DATs in flight per range flow (the giver may lower it)."""
_EOT_WAIT = 2.0  # seconds, at most, for the echo of our EOT when the flow ends
# A flow lives and dies with its connection: the giver keeps a flow by the connection it
# came on, so once that drops (the producer killed or restarted, a network cut) no DAT
# of it can come. A reader waiting for records watches for it, and so does the driver's
# control flow, whatever it waits for.
_DROP_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_MONITORS = itertools.count()  # unique inproc addresses of the drops monitors
_AFTER_WATCH = 1.0  # seconds to read a message the socket already holds
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
for _event in HANDSHAKE_FAILED:
    _HANDSHAKE_EVENTS |= _event


class HeldWindow(NamedTuple):
    """A producer's held window: records ``first .. end - 1``, numbered in
    ``incarnation`` (``first == end``: none held). ``full``: a send began to wait for room
    in the window since the previous held answer, or waits (protocol.ranges)."""

    incarnation: str
    first: int
    end: int
    full: bool = False


class RangesNotServed(TransportError):
    """The peer did not state the range capability as its own (a plain ZIO giver, an
    older zio-spark producer, a producer in client mode behind a broker): no request was
    sent; read this producer through the spool path."""


class AckRefused(TransportError):
    """The producer refused a commit: it numbers its records in another incarnation
    (``window``: its held window now, in that one) than the one the commit names (it
    restarted without its records), or serves no such producer (``window`` None). Nothing
    was freed; the flow stays open."""

    def __init__(self, message: str, *, endpoint: str, window: HeldWindow | None) -> None:
        super().__init__(message, endpoint=endpoint)
        self.window = window


class RangeConnection:
    """One range flow to the giver at ``endpoint``: requests one at a time.

    Opens the flow in the constructor (BOT and the server's reply, within ``timeout``)
    and checks the capability. Use as a context manager, or call :meth:`close`.

    Parameters
    ----------
    endpoint
        The producer's flow port (a bound :class:`~zio_spark.source.producer.Producer`).
    ctx, mode, curve
        The zmq context (default: the global one), the socket mode (as the producer's)
        and CURVE client options (:func:`~zio_spark.transport.curve.client_curve`).
    timeout
        Seconds any one wait may last (the BOT reply, the next DAT, room to send).
    credit
        DATs in flight (the giver may lower it; None: the connection kind's default).
    stream, batch
        The stream asked for (None: the giver's), the most records per DAT.

    Raises
    ------
    RangesNotServed
        If the giver did not state the capability (after an EOT; nothing asked).
    TransportError
        If no BOT reply comes within ``timeout`` (a silent or absent peer), or the socket
        cannot be made; :class:`~zio_spark.transport.flow_endpoint.FlowRejected` if the
        producer rejects the flow (e.g. another stream).
    RemoteProtocolError
        If the giver's BOT is malformed (a bad ``ranges``/``incarnation``).
    """

    _READ = READ_RANGE  # the BOT's read mode
    _CREDIT = DEFAULT_CREDIT  # credit when none is given
    _WATCH_FROM_BOT = False  # watch for drops once the flow is open (else from read())
    # What follows when the connection drops while an answer is awaited.
    _DROPPED = "the task fails now so that Spark retries it"
    # What to do when the producer's ZAP handler refuses our CURVE key.
    _REFUSED_FIX = (
        "a task reads with its query run's key, which the producer admits only while "
        "that run's control flow to it lives: the query stopped or restarted (a task of "
        "an earlier run), or its driver could not register the key; restart the query. "
        "A reader with a key of its own: put its public key on the producer's allow-list "
        "(Producer(curve_allowed_client_keys=...), zio-spark produce --curve-allow)"
    )

    def __init__(
        self,
        endpoint: str,
        *,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve: Curve | None = None,
        timeout: float = 30.0,
        credit: int | None = None,
        stream: str | None = None,
        batch: int | None = None,
    ) -> None:
        credit = self._CREDIT if credit is None else credit
        self.endpoint = endpoint
        self.timeout = timeout
        # The connection's monitor (drops only), made by read() once the flow is open
        # (the CURVE handshake's is gone by then): it waits on it beside the socket.
        self._drops: zmq.Socket[bytes] | None = None
        self._watch = zmq.Poller()  # the socket and, once made, its drops monitor
        self.port = ClientPort(
            ctx or zmq.Context.instance(),
            mode=mode,
            curve=curve,
            linger_ms=0,
            send_timeout_ms=timeout * 1000.0,
        )
        try:
            # With CURVE, the handshake's outcome first: a key the producer's ZAP handler
            # refuses fails here at once, naming the fix, instead of a silent BOT wait.
            monitor = (
                None if curve is None else self.port.socket.get_monitor_socket(_HANDSHAKE_EVENTS)
            )
            self.port.connect(endpoint)
            if monitor is not None:
                self._await_handshake(monitor, timeout)
            self.ep = FlowEndpoint(self.port, Role.CLIENT)
            sent: dict[str, Any] = {"encoding": [ENCODING]}
            if stream is not None:
                sent["stream"] = stream
            if batch is not None:
                sent["batch"] = batch
            sent = offer_attrs(sent, read=self._READ)
            self.ep.send_bot(Direction.INJECT, credit, sent)
            try:
                bot = self.ep.recv_bot(timeout)
            except FlowRejected:
                raise
            except TransportError as e:
                raise TransportError(
                    f"range reader: no BOT reply within {timeout:g} s (is a bound zio-spark "
                    "producer listening there, with the same socket mode?)",
                    endpoint=endpoint,
                ) from e
            sent_attrs = {"direction": Direction.INJECT.value, "credit": credit, **sent}
            self.terms: RangeTerms = client_range_terms(sent_attrs, bot.attrs)
            if not self.terms.capable:
                self._end()
                raise RangesNotServed(
                    "this peer does not serve range reads (its BOT states no 'ranges' "
                    "capability as its own): this producer can only be read through the "
                    "spool path (no request was sent)",
                    endpoint=endpoint,
                )
            own = bot.attrs.get("encoding")
            if own != ENCODING:
                self._end()
                raise RemoteProtocolError(
                    f"the giver at {endpoint} picked encoding {own!r}; this reader reads "
                    f"{ENCODING!r} record batches only",
                    field="encoding",
                    value=own,
                )
            self.credit = self.ep.flow.credit  # the flow's total, as the giver accepted it
            # The coord origin of the giver's last DAT (the spool path's ``origin``
            # column: the receiver stores its DATs' origin).
            self.origin = 0
            self.reader = RangeReader(self.terms)
            if self._WATCH_FROM_BOT:
                self._watch_drops()
        except BaseException:
            self._unwatch()
            self.port.close(0)
            raise

    def _await_handshake(self, monitor: zmq.Socket[bytes], timeout: float) -> None:
        """Wait for the CURVE handshake's outcome on ``monitor`` (closed on return).

        Raises
        ------
        TransportError
            If the producer refuses it (its ZAP handler: our key is not admitted; or no
            CURVE there), or none is over within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not monitor.poll(max(1, int(left * 1000))):
                    raise TransportError(
                        f"range reader: no CURVE handshake within {timeout:g} s (is a bound "
                        "zio-spark producer with CURVE listening there, with the same "
                        "socket mode?)",
                        endpoint=self.endpoint,
                    )
                got = recv_monitor_message(monitor)
                event = int(got["event"])
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
                what = HANDSHAKE_FAILED.get(event)
                if what is None:
                    continue
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    raise TransportError(
                        "range reader: the producer refused our CURVE key (ZAP status "
                        f"{got['value']}: not on its allow-list, nor a run key it admits "
                        f"now): {self._REFUSED_FIX}",
                        endpoint=self.endpoint,
                    )
                raise TransportError(
                    f"range reader: the CURVE handshake failed ({what}, errno "
                    f"{got['value']}): the producer there has no CURVE, or another server "
                    "key than this reader's curveServerKey, or it went away during the "
                    "handshake (killed or restarted: a task's retry reads once it is back)",
                    endpoint=self.endpoint,
                )
        finally:
            self.port.socket.disable_monitor()
            monitor.close(0)

    @property
    def incarnation(self) -> str:
        """The incarnation the giver stated in its BOT (fixed for the flow's life)."""
        assert self.terms.incarnation is not None
        return self.terms.incarnation

    @property
    def producer(self) -> str | None:
        """The producer id the giver stated."""
        return self.terms.producer

    def __enter__(self) -> RangeConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the flow (EOT, a short wait for the echo) and close the socket
        (idempotent)."""
        if self.port.closed:
            return
        try:
            self._end()
        finally:
            self._unwatch()
            self.port.close(0)

    def _unwatch(self) -> None:
        drops, self._drops = self._drops, None
        if drops is not None:
            self.port.socket.disable_monitor()
            drops.close(0)

    def _watch_drops(self) -> None:
        """From now on a drop of the connection is seen by the waits of
        :meth:`_next_dat` with ``watch`` (idempotent)."""
        if self._drops is not None:
            return
        # An address of its own: pyzmq's default one is named by the socket's fd, and
        # libzmq lets go of a stopped monitor's address only later (its reaper thread),
        # so a second monitor on this socket (after the CURVE handshake's) or on a
        # socket reusing the fd could find it still taken.
        self._drops = self.port.socket.get_monitor_socket(
            _DROP_EVENTS, addr=f"inproc://zio-range-drops-{os.getpid()}-{next(_MONITORS)}"
        )
        self._watch.register(self.port.socket, zmq.POLLIN)
        self._watch.register(self._drops, zmq.POLLIN)

    def _await_data(self, what: str) -> bool:
        """Wait until a message is there to read, within ``timeout``: whether one is
        (False: the time ran out).

        Raises
        ------
        TransportError
            If the connection to the giver drops first (a flow cannot outlive it: a task
            fails now, and Spark's retry reads the range from the producer once it is
            back; the driver opens a new control flow).
        """
        drops = self._drops
        assert drops is not None  # read() watches before it asks
        ready = dict(self._watch.poll(max(1, int(self.timeout * 1000))))
        if self.port.socket in ready:  # what came before a drop is read first
            return True
        if drops in ready:  # the monitor reports drops only (_DROP_EVENTS)
            recv_monitor_message(drops)
            raise TransportError(
                f"range reader: the connection to the producer dropped while {what} "
                "was awaited (it stopped or restarted, or the network cut it): the "
                f"flow is gone with it; {self._DROPPED}",
                endpoint=self.endpoint,
            )
        return False

    def _end(self) -> None:
        ep = self.ep
        if ep.flow.state not in (FlowState.READY, FlowState.EOT_RECEIVED):
            return
        try:
            ep.send_eot(timeout=min(self.timeout, _EOT_WAIT))
        except (TransportError, ProtocolError) as e:
            log.info("range reader %s: no clean end of the flow: %s", self.endpoint, e)

    def _next_dat(
        self, what: str, *, watch: bool = False
    ) -> tuple[dict[str, Any], tuple[bytes, ...]]:
        wait = self.timeout
        if watch:
            # The wait was _await_data's (one timeout, not two): a message is there, or
            # the time ran out and get() only confirms it.
            wait = min(self.timeout, _AFTER_WATCH) if self._await_data(what) else 0.001
        try:
            data = self.ep.get(wait, auto_pay=False)
        except TransportError as e:
            if self.port.closed:
                raise
            raise TransportError(
                f"range reader: no DAT within {self.timeout:g} s while {what} was awaited "
                "(the producer is silent: stopped, overloaded or gone)",
                endpoint=self.endpoint,
            ) from e
        if data is None:
            eot = self.ep.peer_eot
            reason = "" if eot is None else f" ({dict(eot.attrs)})"
            raise TransportError(
                f"range reader: the producer ended the flow while {what} was awaited{reason}",
                endpoint=self.endpoint,
            )
        self.origin = data.message.origin
        return dict(data.attrs), data.message.payload

    def _repay(self) -> None:
        flow = self.ep.flow
        if flow.credit * 2 >= self.credit and flow.credit > 0:
            self.ep.pay(flow.credit)

    def held(self, producer: str) -> HeldWindow:
        """The held window of ``producer`` now.

        Raises
        ------
        TransportError
            If the giver serves no such producer (``unknown_producer``), ends the flow,
            or does not answer within ``timeout``.
        RemoteProtocolError
            If the answer breaks the protocol (e.g. another incarnation than its BOT's).
        """
        self.ep.channel.send(self.reader.send_query(self.ep.flow, producer))
        attrs, _ = self._next_dat("the held window", watch=self._drops is not None)
        reply = self.reader.on_dat(attrs)
        if isinstance(reply, UnknownProducer):
            raise TransportError(
                f"range reader: the giver serves no producer {producer!r}",
                endpoint=self.endpoint,
            )
        if not isinstance(reply, HeldReport):  # pragma: no cover - on_dat checks it
            raise RemoteProtocolError(f"not a held answer: {reply!r}", field="held")
        self._repay()
        return HeldWindow(reply.incarnation, reply.first, reply.end, reply.full)

    def read(
        self, producer: str, incarnation: str, start: int, end: int
    ) -> Iterator[pa.RecordBatch]:
        """Records ``[start, end)`` of ``producer``, planned on ``incarnation``, as record
        batches in order (lazily: nothing is asked before the first ``next``).

        Raises
        ------
        DataLossError
            If the giver refuses the range (not held, another incarnation, unknown
            producer): batches yielded before are to be discarded.
        TransportError
            If the giver ends the flow or a wait runs out.
        RemoteProtocolError
            If the giver breaks the protocol (a gap, a duplicate, records of another
            incarnation...).
        """
        reader = self.reader
        self._watch_drops()  # before asking: a drop from now on is seen
        self.ep.channel.send(reader.send_request(self.ep.flow, producer, incarnation, start, end))
        while True:
            attrs, payload = self._next_dat(f"records [{start}, {end}) of {producer!r}", watch=True)
            reply = reader.on_dat(attrs)
            if reply is None:
                if len(payload) != 1:
                    raise RemoteProtocolError(
                        f"a DAT of records must carry one Arrow frame, got {len(payload)}",
                        field="payload",
                        value=len(payload),
                    )
                cursor = start + reader.received
                batch = decode_batch(payload[0], expected_first=cursor)
                first = batch.column(0)[0].as_py()
                reader.records(first, batch.num_rows)
                self._repay()
                yield batch
                continue
            self._repay()
            if reader.state is ReaderState.DONE:
                return
            raise reader.loss(reply)


def held_window(
    endpoint: str,
    producer_id: str,
    *,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    curve: Curve | None = None,
    mode: str | None = None,
    timeout: float = 30.0,
) -> HeldWindow:
    """``(incarnation, first, end)``: the held window of ``producer_id`` at the producer
    listening on ``endpoint``, on a flow of its own (see :class:`RangeConnection` for the
    options and errors)."""
    with RangeConnection(endpoint, ctx=ctx, curve=curve, mode=mode, timeout=timeout) as conn:
        return conn.held(producer_id)


def read_range(
    endpoint: str,
    producer_id: str,
    incarnation: str,
    start: int,
    end: int,
    *,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    curve: Curve | None = None,
    mode: str | None = None,
    timeout: float = 30.0,
    credit: int = DEFAULT_CREDIT,
    batch: int | None = None,
) -> Iterator[pa.RecordBatch]:
    """Records ``[start, end)`` of ``producer_id``, planned on ``incarnation``, read from
    the producer at ``endpoint`` on a flow of its own, as Arrow record batches of the
    wire schema in order. A generator: the flow opens at the first ``next`` and closes
    (EOT, socket closed) when it ends, fails or is closed.

    Raises
    ------
    DataLossError
        If the producer refuses the range (:meth:`RangeConnection.read`).
    RangesNotServed, TransportError, RemoteProtocolError
        As :class:`RangeConnection` and :meth:`RangeConnection.read`.
    """
    with RangeConnection(
        endpoint, ctx=ctx, curve=curve, mode=mode, timeout=timeout, credit=credit, batch=batch
    ) as conn:
        yield from conn.read(producer_id, incarnation, start, end)


class ControlConnection(RangeConnection):
    """The driver's control flow to the producer at ``endpoint`` (BOT ``read:
    "control"``): held queries and commits, one at a time, never a range or a record.
    Bound to the incarnation its BOT stated (:attr:`incarnation`): the producer ends it
    (EOT) when it renumbers. It watches its connection from the BOT on: once that
    dropped (the producer killed or restarted), every request fails at once with a
    :class:`~zio_spark.errors.TransportError`, also one whose answer the drop cut off.
    Opening, options and errors as :class:`RangeConnection`; a peer without the
    capability is :class:`RangesNotServed`."""

    _READ = READ_CONTROL
    _CREDIT = 4  # only answers flow back: one per request
    # A request whose answer a drop cut off fails at once, not after ``timeout``: a
    # producer killed or restarted before it answered a held query, an ack or the
    # keeper's look would otherwise hold the driver's lane to it (and the run key's
    # registration at the restarted process) for the whole timeout.
    _WATCH_FROM_BOT = True
    _DROPPED = "the driver opens a new control flow"
    _REFUSED_FIX = (
        "put the source's curvePublicKey (the driver's key) on the producer's allow-list "
        "(Producer(curve_allowed_client_keys=...), zio-spark produce --curve-allow)"
    )

    def admit(self, key: str | bytes) -> bool:
        """Register ``key`` (a CURVE public key, Z85) with the producer: it admits
        clients with it for as long as this control flow lives (the query run's key for
        its tasks). Returns True if the producer keeps an allow-list and put the key on
        it, False if it has none (``open``: any client that knows its server key gets
        in, nothing stored). Blocks for the answer, at most ``timeout`` seconds.

        Raises
        ------
        TransportError
            If the producer ends the flow or does not answer in time.
        LocalProtocolError
            If ``key`` is not a Z85 CURVE public key (nothing sent).
        RemoteProtocolError
            If the answer breaks the protocol.
        """
        text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
        self.ep.channel.send(self.reader.send_admit(self.ep.flow, text))
        attrs, _ = self._next_dat("the answer to the run key's admission", watch=True)
        reply = self.reader.on_dat(attrs)
        self._repay()
        if not isinstance(reply, Admitted):  # pragma: no cover - on_dat checks it
            raise RemoteProtocolError(f"not an admit answer: {reply!r}", field="admit")
        return reply.gated

    def held(self, producer: str | None = None) -> HeldWindow:
        """The held window of ``producer`` (default: the one the producer stated)."""
        return super().held(self._producer(producer))

    def read(
        self, producer: str, incarnation: str, start: int, end: int
    ) -> Iterator[pa.RecordBatch]:
        """Never: a control flow carries no range (open a :class:`RangeConnection`).

        Raises
        ------
        LocalProtocolError
            Always.
        """
        raise LocalProtocolError(
            "a control flow reads no range: open a RangeConnection (read_range) for it",
            field="read",
            value=READ_CONTROL,
        )

    def _producer(self, producer: str | None) -> str:
        got = producer if producer is not None else self.producer
        if got is None:  # pragma: no cover - a capable giver states its producer
            raise LocalProtocolError("no producer id to ask for", field="producer")
        return got

    def ack(self, upto: int, incarnation: str, producer: str | None = None) -> HeldWindow:
        """Spark committed every record of ``producer`` (default: the one the producer
        stated) up to ``upto``, planned on ``incarnation``: the producer frees them (with
        its retention folder's copy) and answers its held window after it. Acks are
        monotonic: an ``upto`` below what the producer still holds (a re-ack of an
        earlier commit, a restarted driver's) frees nothing and is no error. Blocks for
        the answer, at most ``timeout`` seconds.

        Raises
        ------
        AckRefused
            If the producer numbers its records in another incarnation than
            ``incarnation`` (it restarted without its records), or serves no such
            producer: nothing freed, the flow stays open.
        TransportError
            If the producer ends the flow (e.g. ``upto`` is beyond its last record: a
            protocol error, its EOT's reason names both numbers), or does not answer
            within ``timeout``.
        LocalProtocolError
            If ``upto`` or ``incarnation`` is malformed (nothing sent).
        RemoteProtocolError
            If the answer breaks the protocol.
        """
        producer = self._producer(producer)
        self.ep.channel.send(self.reader.send_commit(self.ep.flow, producer, incarnation, upto))
        attrs, _ = self._next_dat(f"the answer to the ack of {upto} of {producer!r}", watch=True)
        reply = self.reader.on_dat(attrs)
        self._repay()
        if isinstance(reply, Acked):
            return HeldWindow(reply.incarnation, reply.first, reply.end)
        if isinstance(reply, CommitRefused):
            raise AckRefused(
                f"control flow: the ack of {upto} of {producer!r} committed in incarnation "
                f"{incarnation!r} was refused: the producer numbers its records as "
                f"{reply.incarnation!r} (holding [{reply.first}, {reply.end})), so it "
                "restarted without them; nothing was freed",
                endpoint=self.endpoint,
                window=HeldWindow(reply.incarnation, reply.first, reply.end),
            )
        if isinstance(reply, UnknownProducer):
            raise AckRefused(
                f"control flow: the producer serves no producer {producer!r}; nothing freed",
                endpoint=self.endpoint,
                window=None,
            )
        raise RemoteProtocolError(  # pragma: no cover - on_dat checks it
            f"not a commit answer: {reply!r}", field="commit"
        )
