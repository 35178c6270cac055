"""An ack-capable ZIO giver: keeps every record until the taker acknowledges it.

The producer binds a server port; a taker (the Spark source, or any ZIO flow client
with direction ``inject``) connects and sends its BOT. Records are numbered from 1 in
the order :meth:`Producer.send` is called and kept in memory until acknowledged:

- A zio-spark taker says ``ack: true`` and ``resume: R`` (the last sequence number it
  holds durably) in its BOT. The producer then resends from ``R + 1`` and forgets a
  record only when a PAY carries ``ack >= seq``. Records go many to a DAT, packed as
  one Arrow IPC frame (see :mod:`zio_spark.records`) when the taker lists ``arrow``
  among its ``encoding`` values.
- A plain ZIO taker (no ``ack``) gets one record per DAT, the payload being the value,
  and a record is forgotten once sent: at most once, as plain ZIO promises.

One taker at a time: a new taker's BOT replaces the previous flow (the old client is
dead or about to be; its unacknowledged records are resent to the new one).

Producer ids must be stable across restarts for exactly-once. A restarted producer
numbers from 1 again; when a taker's ``resume`` shows it already holds more than this
process ever sent, records not yet sent are renumbered to continue after ``resume``
(counted in ``stats["renumbered"]``), so nothing new is mistaken for a duplicate.
"""

from __future__ import annotations

import base64
import collections
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from zio_spark.errors import RemoteProtocolError, TransportError
from zio_spark.protocol.flow import (
    BotReceived,
    Credit,
    Direction,
    EotReceived,
    FlowState,
    pay_ack,
    profile_bot,
)
from zio_spark.records import ENCODING, encode_records
from zio_spark.transport.held import HeldRecords, Taken
from zio_spark.transport.port import ServerPort
from zio_spark.transport.server import FlowHandler, FlowServer, ServerFlow

if TYPE_CHECKING:
    from zio_spark.transport.zre_node import ZreNode

__all__ = ["Producer"]

log = logging.getLogger("zio_spark.transport")

_SEND_QUEUE = 100_000  # messages queued to the taker at most: the most credit it is given


class _Taker(FlowHandler):
    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.acks = False
        self.arrow = False
        self.batch = 1  # most records per DAT for this taker
        self.next_seq = 1  # next record to send to this taker

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        p = self.producer
        if bot.direction is not Direction.INJECT:
            conn.reject({"reason": "this port is a producer: connect with direction inject"})
            return
        try:
            prof = profile_bot(bot.attrs)
        except RemoteProtocolError as e:
            conn.reject({"reason": str(e)})
            raise
        if prof.stream is not None and prof.stream != p.stream:
            conn.reject({"reason": f"no stream {prof.stream!r} here (this is {p.stream!r})"})
            return
        # The taker's "batch" caps the records per DAT (the Spark receiver refuses more).
        limit = prof.batch
        self.acks = prof.ack
        self.arrow = ENCODING in prof.encodings
        self.batch = (p.batch if limit is None else min(p.batch, limit)) if self.arrow else 1
        self.next_seq = p._attach(self, conn, prof.resume if prof.ack else None)
        attrs: dict[str, Any] = {"producer": p.producer_id, "stream": p.stream, "ack": True}
        if self.arrow:
            attrs["encoding"] = ENCODING
        conn.accept(None, attrs)

    def on_credit(self, conn: ServerFlow, credit: Credit) -> None:
        ack = pay_ack(credit.attrs)
        if ack is not None and self.acks:
            self.producer._ack(ack)
        self.on_tick(conn, 0.0)

    def on_tick(self, conn: ServerFlow, now: float) -> None:
        p = self.producer
        if p._taker is not self or conn.flow.state is not FlowState.READY:
            return
        while conn.flow.credit > 0:
            got = p._take(self.next_seq, self.batch, release=not self.acks)
            if got is None:
                return
            if self.arrow:
                payload = encode_records(got.first, got.values, got.keys, got.granules, got.headers)
                conn.send_dat((payload,))
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
            self.next_seq = got.last + 1
            p._sent(got.last, len(got.values))

    def on_eot(self, conn: ServerFlow, eot: EotReceived) -> None:
        self.producer.stats["eot_received"] += 1

    def on_close(self, conn: ServerFlow, reason: str) -> None:
        self.producer._detach(self, reason)


class Producer:
    """Give records to a ZIO taker, keeping each until it is acknowledged.

    Parameters
    ----------
    bind
        Endpoint to bind (``tcp://127.0.0.1:*`` picks a free port).
    producer_id
        Stable id of this producer (default: host name and bound endpoint).
    stream
        Stream name; a taker asking for another stream is rejected.
    batch
        Most records per DAT (Arrow-encoded flows).
    max_unacked
        :meth:`send` blocks while this many records are held unacknowledged.
    mode, curve_secret_key, linger_ms
        Passed to the :class:`~zio_spark.transport.port.ServerPort`.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        producer_id: str | None = None,
        stream: str = "zio",
        batch: int = 1000,
        max_unacked: int = 100_000,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        mode: str | None = None,
        curve_secret_key: str | bytes | None = None,
        linger_ms: int = 1000,
        idle_timeout: float | None = None,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if max_unacked < 1:
            raise ValueError(f"max_unacked must be >= 1, got {max_unacked}")
        self.ctx = ctx or zmq.Context.instance()
        # The send queue bounds the credit a taker gets (FlowServer lowers larger offers
        # to it); DATs go out only within credit, so this is a bound, not a buffer.
        port = ServerPort(
            self.ctx,
            mode=mode,
            linger_ms=linger_ms,
            curve_secret_key=curve_secret_key,
            sndhwm=_SEND_QUEUE,
        )
        try:
            self.endpoint = port.bind(bind)
        except BaseException:
            port.close(0)
            raise
        self.curve_public_key = port.curve_public_key
        self.producer_id = producer_id or f"{socket.gethostname()}|{self.endpoint}"
        self.stream = stream
        self.batch = batch
        self.max_unacked = max_unacked
        self.stats: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._records = HeldRecords()
        self._ever_sent = 0  # highest seq sent to, or held by, a taker of this process
        self._acked = 0
        self._taker: _Taker | None = None
        self._taker_conn: ServerFlow | None = None
        self._wake_pending = False
        self._closed = False
        self._eot_done: threading.Event | None = None  # set while close() awaits the echo
        self._zre: ZreNode | None = None  # the discovery node, once advertise() ran
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
                if room <= 0:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TransportError(
                            f"producer buffer full ({self.max_unacked} unacknowledged records) "
                            f"for {timeout} s: is a taker connected and acknowledging?",
                            endpoint=self.endpoint,
                        )
                    self._cond.wait(left)
                    continue
                j = min(n, i + room)
                whole = i == 0 and j == n
                self._records.append(
                    values if whole else values[i:j],
                    keys if whole or keys is None else keys[i:j],
                    granules if whole or granules is None else granules[i:j],
                    headers if whole or headers is None else headers[i:j],
                )
                i = j
                self._wake_locked()
            return self._records.next_seq - 1

    def _wake_locked(self) -> None:
        if not self._wake_pending and self._taker is not None:
            self._wake_pending = True
            self._server.call_soon(self._woken)

    def _woken(self) -> None:
        with self._cond:
            self._wake_pending = False
        if self._taker is not None and self._taker_conn is not None:
            # As on a tick: a failure (the taker vanished) ends that flow, not the loop.
            self._server.tick_flow(self._taker_conn, self._taker, 0.0)

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
        return self._taker is not None

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

        self._zre = advertise(
            group,
            self.endpoint,
            self._server.port.socket_type,
            name=self.producer_id,
            **zre,  # type: ignore[arg-type]
        )

    def close(self, timeout: float | None = 30.0, *, flush: bool = True) -> None:
        """Flush (optionally), end the flow with an acknowledged EOT, stop the server."""
        try:
            if flush and not self._closed:
                self.flush(timeout)
            done = threading.Event()

            def end() -> None:
                conn = self._taker_conn
                if conn is not None and conn.flow.state is FlowState.READY:
                    self._eot_done = done
                    try:
                        conn.send_eot()
                    except TransportError as e:  # the taker is gone: no echo will come
                        log.warning("producer %s: cannot send EOT: %s", self.producer_id, e)
                        done.set()
                else:
                    done.set()

            if self._server._thread is not None:
                self._server.call_soon(end)
                if not done.wait(timeout if timeout is not None else None):
                    log.warning("producer %s: no EOT echo before close", self.producer_id)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._zre is not None:
                self._zre.stop()
            self._server.stop()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(flush=exc[0] is None)

    # -- loop side (server thread) ---------------------------------------------------

    def _attach(self, taker: _Taker, conn: ServerFlow, resume: int | None) -> int:
        replaced: tuple[_Taker, ServerFlow] | None = None
        with self._cond:
            if self._taker is not None and self._taker is not taker:
                self.stats["takers_replaced"] += 1
                assert self._taker_conn is not None
                replaced = (self._taker, self._taker_conn)
            self._taker = taker
            self._taker_conn = conn
            self.stats["takers"] += 1
            records = self._records
            start = records.first
            if resume is not None:
                never_sent = self._ever_sent + 1
                if resume >= never_sent and records.next_seq > never_sent:
                    shift = resume + 1 - never_sent
                    records.release(never_sent - 1)
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
                    records.release(resume)
                    records.renumber(max(0, resume + 1 - records.next_seq))
                self._release(resume)
                # Records up to ``resume`` are now accounted for: a later taker with the
                # same ``resume`` (a replaced driver, a reconnecting port's queued BOT)
                # must not move the numbering on a second time.
                self._ever_sent = max(self._ever_sent, resume)
                start = max(start, resume + 1)
            self._cond.notify_all()
        if replaced is not None:
            # One taker at a time: the old flow ends now instead of lingering in the
            # server (forever without an idle timeout) for a client that is gone.
            self._server._remove(replaced[1], replaced[0], "replaced by a new taker")
        return start

    def _detach(self, taker: _Taker, reason: str) -> None:
        with self._cond:
            if self._taker is taker:
                self._taker = None
                self._taker_conn = None
        if self._eot_done is not None:
            self._eot_done.set()
        log.info("producer %s: taker left (%s)", self.producer_id, reason)

    def _take(self, first: int, n: int, release: bool) -> Taken | None:
        with self._cond:
            got = self._records.take(first, n)
            if release and got is not None:
                self._records.release(got.last)
                self._cond.notify_all()
            return got

    def _sent(self, last: int, n: int) -> None:
        with self._cond:
            self._ever_sent = max(self._ever_sent, last)
        self.stats["records_sent"] += n
        self.stats["dats_sent"] += 1

    def _ack(self, ack: int) -> None:
        with self._cond:
            self._release(ack)
            self._cond.notify_all()

    def _release(self, upto: int) -> None:
        self._records.release(upto)
        if upto > self._acked:
            self.stats["acked"] += upto - self._acked
            self._acked = upto
