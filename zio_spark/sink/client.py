"""The sink's client side, what Spark executors and the driver run: :class:`StagingWriter`
(the giver of one task's data flow) and :func:`run_command` (the driver's commit/abort:
the consumer's answer, ``ok`` or a refusal, as a typed
:class:`~zio_spark.protocol.sink.CommandReply`); :func:`send_command` is the same with a
refusal raised as :class:`CommandError`.

On the wire a command's answer is the consumer's EOT, a flow rejection whatever the
outcome (:mod:`zio_spark.protocol.sink`); here that rejection is the normal path and
comes back as a value, not an exception.

The protocol is :mod:`zio_spark.protocol.sink`; the consumer's side is
:mod:`zio_spark.sink.consumer`. This module needs neither the consumer nor its folder,
so an executor imports only the transport it speaks over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import zmq

from zio_spark.codec.records import encode_payload, plain_attrs
from zio_spark.errors import (
    ConfigError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
    ZioSparkError,
)
from zio_spark.options import Curve
from zio_spark.protocol.flow import Direction, Role
from zio_spark.protocol.negotiate import client_terms
from zio_spark.protocol.sink import (
    WRITER_FORMATS,
    BatchId,
    CommandReply,
    command_bot,
    data_bot,
    parse_reply,
    parse_staged,
)
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import ClientPort

__all__ = ["CommandError", "CommandReply", "StagingWriter", "run_command", "send_command"]


class CommandError(ZioSparkError):
    """The consumer answered a command with ``result: error``; ``reason`` says why."""

    def __init__(self, endpoint: str, command: str, reason: str) -> None:
        self.endpoint = endpoint
        self.command = command
        self.reason = reason
        super().__init__(f"consumer {endpoint} refused {command}: {reason}")


def _client_port(
    ctx: zmq.Context[zmq.Socket[bytes]] | None,
    endpoint: str,
    mode: str | None,
    curve: Curve | None,
    timeout: float,
) -> ClientPort:
    port = ClientPort(
        ctx or zmq.Context.instance(),
        mode=mode,
        linger_ms=0,
        send_timeout_ms=timeout * 1000,
        on_bad_message="raise",
        curve=curve,
    )
    try:
        port.connect(endpoint)
    except BaseException:
        port.close(linger_ms=0)
        raise
    return port


def _answer(ep: FlowEndpoint, attrs: Mapping[str, Any], timeout: float) -> Mapping[str, Any] | None:
    """Send a command's BOT; the consumer's answer (its EOT's attributes), or None if
    the peer accepted the BOT (it is no zio-spark consumer)."""
    try:
        ep.connect(Direction.EXTRACT, 1, attrs, timeout=timeout)
    except FlowRejected as e:  # the consumer's answer, ok or not
        return e.attrs
    return None


def run_command(
    endpoint: str,
    command: str,
    stream: str,
    batch: BatchId,
    partitions: Iterable[tuple[int, int, int]] = (),
    *,
    query: str | None = None,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    mode: str | None = None,
    curve: Curve | None = None,
    timeout: float = 30.0,
) -> CommandReply:
    """Send ``commit`` or ``abort`` to a consumer and return its answer: ``ok`` True
    (``attrs`` has the rest: ``published``, ``rows``, ...) or ``ok`` False with the
    consumer's ``reason``.

    ``curve``: the consumer's public key and our key pair (a
    :class:`~zio_spark.options.Curve`; None: no CURVE).

    Raises
    ------
    CommandError
        If the peer is not a zio-spark consumer: it accepted the command's BOT, or its
        answer is not a consumer's reply.
    TransportError
        If no answer came within ``timeout`` (names the endpoint).
    """
    attrs = command_bot(command, stream, batch, partitions, query)
    port = _client_port(ctx, endpoint, mode, curve, timeout)
    try:
        ep = FlowEndpoint(port, Role.CLIENT)
        try:
            reply = _answer(ep, attrs, timeout)
        except TransportError as e:
            raise TransportError(
                f"consumer did not answer {command} of batch {batch!r} (stream {stream!r}) "
                f"within {timeout:g} s",
                endpoint=endpoint,
            ) from e
        if reply is None:
            with contextlib.suppress(ZioSparkError):
                ep.send_eot(timeout=min(timeout, 2.0))
            raise CommandError(
                endpoint,
                command,
                "the peer accepted a command BOT: it is a plain ZIO taker, not a zio-spark "
                "consumer",
            )
    finally:
        port.close(linger_ms=0)
    try:
        return parse_reply(reply)
    except RemoteProtocolError as e:
        raise CommandError(endpoint, command, f"not a consumer's reply ({e}): {reply}") from e


def send_command(
    endpoint: str,
    command: str,
    stream: str,
    batch: BatchId,
    partitions: Iterable[tuple[int, int, int]] = (),
    *,
    query: str | None = None,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    mode: str | None = None,
    curve: Curve | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """:func:`run_command`, with a refusal raised: returns the ``ok`` reply's attributes.

    Raises
    ------
    CommandError
        If the consumer answers ``result: error``, or is not a zio-spark consumer.
    TransportError
        If no reply came within ``timeout`` (names the endpoint).
    """
    got = run_command(
        endpoint,
        command,
        stream,
        batch,
        partitions,
        query=query,
        ctx=ctx,
        mode=mode,
        curve=curve,
        timeout=timeout,
    )
    if not got.ok:
        raise CommandError(endpoint, command, str(got.reason))
    return dict(got.attrs)


class StagingWriter:
    """The giver side of one data flow (what a Spark task runs); blocking.

    The payload format is negotiated (:mod:`zio_spark.protocol.negotiate`: the client
    offers, the server states). The BOT offers ``encoding`` as a list: ``["arrow",
    "record"]`` for ``format="auto"``, ``["arrow"]`` or ``["record"]`` when explicit. A
    zio-spark :class:`Consumer` names its pick as a scalar ``encoding`` in its reply.
    A reply that names none (a plain ZIO taker: the reference's servers echo the client's
    BOT, so the offered list comes back unchanged) means one record per DAT: ``auto`` and
    ``record`` then send records (:attr:`plain_peer` is set), an explicit ``arrow`` fails
    before any data is sent. The BOT also carries the legacy ``format`` attribute
    (``"arrow"`` for an explicit arrow, else ``"record"``) for consumers older than the
    negotiation: they stage what ``format`` says and state nothing, so they get records.

    Parameters
    ----------
    endpoint
        The consumer.
    stream, batch, partition, attempt
        Where the data goes (see the module docstring).
    format
        ``"auto"`` (Arrow if the consumer states it takes Arrow, else records),
        ``"arrow"`` (:meth:`write_batch`/:meth:`write_payload`) or ``"record"``
        (:meth:`write_record`/:meth:`write_values`). :attr:`format` is the agreed one.
    credit
        Credit offered. Only the credit the consumer actually pays is spent (a C++
        reference server announces the offer whatever it pays).
    timeout
        Longest wait for the consumer: the BOT answer, each credit, the EOT echo.

    Raises
    ------
    TransportError
        If the consumer does not answer the BOT within ``timeout``, or its reply is not
        usable (it picked an encoding that was not offered).
    ConfigError
        ``format="arrow"`` towards a taker that did not state it takes Arrow (names the
        endpoint and the option ``format``).
    CommandError
        If it rejects the flow.
    """

    def __init__(
        self,
        endpoint: str,
        stream: str,
        batch: BatchId,
        partition: int,
        attempt: int = 0,
        *,
        format: str = "auto",
        credit: int = 1000,
        timeout: float = 30.0,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve: Curve | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if format not in WRITER_FORMATS:
            raise ConfigError("format", format, "auto, arrow or record")
        self.endpoint = endpoint
        self.requested = format
        self.format = "arrow" if format == "auto" else format
        self.timeout = timeout
        self.rows = 0
        self.plain_peer = False
        self._port = _client_port(ctx, endpoint, mode, curve, timeout)
        attrs = data_bot(stream, batch, partition, attempt, format, extra)
        self._ep = FlowEndpoint(self._port, Role.CLIENT)
        try:
            reply = self._ep.connect(Direction.EXTRACT, credit, attrs, timeout=timeout)
        except FlowRejected as e:
            self._port.close(linger_ms=0)
            raise CommandError(endpoint, "data flow", str(e.attrs.get("reason", e.attrs))) from e
        except TransportError as e:
            self._port.close(linger_ms=0)
            raise TransportError(
                f"consumer did not answer within {timeout:g} s (stream {stream!r}, batch "
                f"{batch!r}, partition {partition}). A plain ZIO taker (such as the "
                "reference's server) serves one flow at a time: a BOT that comes during "
                "another flow ends that flow and goes unanswered. If that is the peer, write "
                "from one partition (df.coalesce(1)) or through a flow broker such as "
                "`zio-spark consume`",
                endpoint=endpoint,
            ) from e
        except BaseException:
            self._port.close(linger_ms=0)
            raise
        try:
            terms = client_terms("giver", attrs, reply.attrs)
        except RemoteProtocolError as e:
            self.fail(f"unusable BOT reply: {e}")
            raise TransportError(
                f"the consumer's BOT reply is not usable: {e}", endpoint=endpoint
            ) from e
        if terms.encoding is not None:
            self.format = terms.encoding
            return
        if format == "arrow":
            self.fail("format=arrow, and this taker did not state that it takes Arrow")
            raise ConfigError(
                "format",
                format,
                f"'auto' or 'record' towards {endpoint}: the taker there did not state "
                "that it takes Arrow (its BOT reply names no encoding: a plain ZIO taker, "
                "such as the reference's), so each Arrow payload would reach it as one "
                "opaque record; nothing was sent",
            )
        self.format = "record"
        self.plain_peer = True  # until its EOT echo says otherwise (see close)

    def _stalled(self, what: str) -> str:
        """``what`` went wrong; towards a plain taker, the likely cause and the fix."""
        if not self.plain_peer:
            return what
        return (
            f"{what}. The taker at {self.endpoint} is a plain ZIO taker (its BOT reply "
            "stated no encoding), and a plain ZIO taker serves one flow at a time: a second "
            "flow's BOT (e.g. another partition of this write) ends the flow in progress "
            "without a word to its giver. Write from one partition (df.coalesce(1)), or "
            "through a flow broker such as `zio-spark consume`"
        )

    def _put(self, payload: tuple[bytes, ...], attrs: Mapping[str, Any] | None = None) -> None:
        try:
            ok = self._ep.put(payload, attrs, timeout=self.timeout)
        except TransportError as e:
            raise TransportError(
                self._stalled(f"no credit from the consumer within {self.timeout:g} s"),
                endpoint=self.endpoint,
            ) from e
        if not ok:
            self._ended()

    def _ended(self) -> None:
        eot = self._ep.peer_eot
        reason = eot.attrs.get("error") if eot is not None else None
        raise TransportError(
            f"the consumer ended the flow: {reason or 'EOT'}", endpoint=self.endpoint
        )

    def _check_format(self, fmt: str) -> None:
        if self.format != fmt:
            raise LocalProtocolError(
                f"this flow sends {self.format!r} DATs (agreed with {self.endpoint}), not {fmt!r}",
                field="format",
                value=fmt,
            )

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Send one record batch of :data:`~zio_spark.codec.schema.SINK_SCHEMA` as one DAT
        (``format=arrow``)."""
        self._check_format("arrow")
        self._put((encode_payload(batch),))
        self.rows += batch.num_rows

    def write_payload(self, payload: bytes, rows: int) -> None:
        """Send an already encoded ``format=arrow`` payload holding ``rows`` rows."""
        self._check_format("arrow")
        self._put((payload,))
        self.rows += rows

    def write_record(
        self,
        value: bytes,
        key: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send one record as one DAT (``format=record``); without a key and headers its
        label is the bare ``{"flow": "DAT"}`` a reference taker expects."""
        self._check_format("record")
        self._put((value,), plain_attrs(key, headers) or None)
        self.rows += 1

    def write_values(self, values: Sequence[bytes]) -> None:
        """Send records without key or headers, one bare DAT each (``format=record``),
        a credit run at a time."""
        self._check_format("record")
        try:
            sent = self._ep.put_many([(v,) for v in values], timeout=self.timeout)
        except TransportError as e:
            self.rows += e.sent or 0
            raise TransportError(
                self._stalled(f"no credit from the consumer within {self.timeout:g} s"),
                endpoint=self.endpoint,
            ) from e
        self.rows += sent
        if sent < len(values):
            self._ended()

    def close(self) -> int:
        """Send EOT and wait for the echo (the partition is then durably staged).

        Returns the row count the consumer confirmed (what was sent, for a plain peer).

        Raises
        ------
        TransportError
            If the echo does not come within the timeout, reports an error, or counts
            a different number of rows than were sent.
        """
        try:
            eot = self._ep.send_eot(timeout=self.timeout)
        except TransportError as e:
            raise TransportError(
                self._stalled(f"the consumer did not confirm staging within {self.timeout:g} s"),
                endpoint=self.endpoint,
            ) from e
        finally:
            self._port.close(linger_ms=0)
        try:
            staged = parse_staged(eot.attrs)
        except RemoteProtocolError as e:
            raise TransportError(
                f"the consumer's EOT echo is not usable: {e}", endpoint=self.endpoint
            ) from e
        if staged.error is not None:
            raise TransportError(
                f"the consumer could not stage the partition: {staged.error}",
                endpoint=self.endpoint,
            )
        rows = staged.rows
        if rows is None:
            self.plain_peer = True  # a plain ZIO taker: no staging, no commit
            return self.rows
        self.plain_peer = False  # a consumer older than the encoding negotiation
        if rows != self.rows:
            raise TransportError(
                f"the consumer staged {rows} rows, {self.rows} were sent", endpoint=self.endpoint
            )
        return self.rows

    def fail(self, reason: str) -> None:
        """Give up: tell the consumer to discard what was sent (best effort), close."""
        try:
            with contextlib.suppress(ZioSparkError, zmq.ZMQError):
                self._ep.send_eot({"error": reason[:500]}, timeout=min(self.timeout, 2.0))
        finally:
            self._port.close(linger_ms=0)
