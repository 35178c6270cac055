"""The producer as a flow *client* (``Producer(connect=EP)``): the reference's topology.

Servers that take are (1) a zio-spark server taker built here on our own
:class:`FlowServer`, stating ``resume``/``ack``/``encoding``/``batch`` as the Spark
source in ``bind`` mode does, and (2) the stand-in for the ZIO reference
(``tests/peers/zio_reference.py``): a plain C++ ``ReferenceServer(role="taker")`` that
echoes our BOT, announces our credit and pays its own, smaller one. Every wait has a
deadline; endpoints are 127.0.0.1 random ports; linger 0; the ``ctx`` fixture fails on
a leaked socket.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from tests.peers.zio_reference import ReferenceServer
from zio_spark.codec.records import decode_batch
from zio_spark.errors import ConfigError
from zio_spark.protocol.flow import BotReceived, Data
from zio_spark.protocol.negotiate import server_terms
from zio_spark.source.producer import Producer
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow
from zio_spark.transport.port import ServerPort
from zio_spark.transport.wire import silent_peer_hint

# Deadline for what must happen (every wait returns as soon as it does): generous, so a
# busy machine (a shared CI runner, load 10+) slows these tests down but never fails them.
WAIT = 60.0


def poll_until(cond: Callable[[], Any], timeout: float = WAIT, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or cond}")
        gate.wait(0.005)


def free_endpoint() -> str:
    """A 127.0.0.1 port nobody listens on (taken from the OS, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ----------------------------------------------------------- a zio-spark server taker


class Store:
    """What a durable taker holds for one producer: rows, and how far they are durable.

    ``durable_upto`` caps what is made durable (and acknowledged); a "crash" keeps only
    the durable rows.
    """

    def __init__(self, durable_upto: int | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.bots: list[dict[str, Any]] = []
        self.durable = 0
        self.durable_upto = durable_upto
        self.dat_sizes: list[int] = []
        self.lock = threading.Lock()

    @property
    def last(self) -> int:
        return self.rows[-1]["seq"] if self.rows else self.durable

    def crash(self) -> None:
        with self.lock:
            self.rows = [r for r in self.rows if r["seq"] <= self.durable]

    def seqs(self) -> list[int]:
        with self.lock:
            return [r["seq"] for r in self.rows]


class SparkLikeTaker(FlowHandler):
    """A server taker in the zio-spark profile: states resume/ack/encoding/batch, decodes
    Arrow DATs (checking there is no gap) and acknowledges in its PAYs."""

    def __init__(
        self,
        store: Store,
        credit: int,
        batch: int,
        reject_first: bool,
        hold_bot: threading.Event | None = None,
    ) -> None:
        self.store = store
        self.credit = credit
        self.batch = batch
        self.reject_first = reject_first
        self.hold_bot = hold_bot

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        s = self.store
        s.bots.append({"direction": bot.direction.value, "credit": bot.credit, **bot.attrs})
        # The test holds the reply until it has done what must happen before the flow.
        if self.hold_bot is not None and not self.hold_bot.wait(WAIT):
            return  # the test failed before releasing it; no reply, the flow never starts
        if self.reject_first and len(s.bots) == 1:
            conn.reject({"reason": "not yet"})
            return
        terms = server_terms("taker", bot.attrs, ("arrow",))
        assert terms.ack and terms.producer is not None
        attrs = {"resume": s.durable, "ack": True, "batch": self.batch, "stream": "zio"}
        if terms.encoding is not None:
            attrs["encoding"] = terms.encoding
        conn.accept(self.credit, attrs)
        conn.pay()

    def on_data(self, conn: ServerFlow, data: Data) -> None:
        s = self.store
        with s.lock:
            rows = decode_batch(data.message.payload[0], expected_first=s.last + 1).to_pylist()
            s.rows.extend(rows)
            s.dat_sizes.append(len(rows))
            upto = s.last if s.durable_upto is None else min(s.last, s.durable_upto)
            s.durable = max(s.durable, upto)
        conn.pay(None, {"ack": s.durable})


class TakerServer:
    def __init__(
        self,
        ctx: zmq.Context[Any],
        mode: str,
        store: Store,
        *,
        endpoint: str = "tcp://127.0.0.1:*",
        credit: int = 4,
        batch: int = 5,
        reject_first: bool = False,
        hold_bot: threading.Event | None = None,
    ) -> None:
        port = ServerPort(ctx, mode=mode, linger_ms=0)
        self.endpoint = port.bind(endpoint)
        self.server = FlowServer(
            port, lambda: SparkLikeTaker(store, credit, batch, reject_first, hold_bot), ctx=ctx
        ).start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def servers(ctx: zmq.Context[Any]) -> Iterator[Callable[..., TakerServer]]:
    made: list[TakerServer] = []

    def make(mode: str, store: Store, **kw: Any) -> TakerServer:
        s = TakerServer(ctx, mode, store, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def make_producer(ctx: zmq.Context[Any]) -> Iterator[Callable[..., Producer]]:
    made: list[Producer] = []

    def make(endpoint: str, mode: str = "routerdealer", **kw: Any) -> Producer:
        kw.setdefault("linger_ms", 0)
        producer = Producer(connect=endpoint, ctx=ctx, mode=mode, **kw)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close(timeout=0.2, flush=False)


def values(first: int, n: int) -> list[bytes]:
    return [b"r%d" % i for i in range(first, first + n)]


# ------------------------------------------------------------------------ the profile


def test_client_bot_offers_and_gives_arrow_to_an_acking_server(make_producer, servers, wire_mode):
    store = Store()
    srv = servers(wire_mode, store, credit=4, batch=5)
    producer = make_producer(srv.endpoint, wire_mode, producer_id="p-client", batch=10)
    assert producer.send_many(values(1, 23)) == 23
    poll_until(lambda: store.seqs() == list(range(1, 24)), what="23 records")
    bot = store.bots[0]
    assert bot == {
        "direction": "extract",
        "credit": 1000,
        "producer": "p-client",
        "stream": "zio",
        "ack": True,
        "encoding": ["arrow"],
    }
    assert [r["value"] for r in store.rows] == values(1, 23)
    assert max(store.dat_sizes) == 5  # min(producer batch 10, the server's batch 5)
    producer.flush(WAIT)  # every record acknowledged
    assert producer.acks is True
    d = producer.close(WAIT)
    assert (d.queued, d.sent, d.acked, d.confirmed, d.pending) == (23, 23, 23, 0, 0)
    assert producer.stats["eot_received"] == 1  # the server echoed our EOT
    assert producer.stats["flow_failures"] == 0


def test_resume_after_the_server_dies_nothing_lost_nothing_twice(
    ctx, make_producer, servers, wire_mode
):
    """The Spark driver killed mid-stream: the server vanishes with 15 records taken and
    7 durable; a new one on the same endpoint states resume 7; the producer reconnects
    and resends from 8."""
    store = Store(durable_upto=7)
    first = servers(wire_mode, store, credit=3, batch=5)
    producer = make_producer(first.endpoint, wire_mode, producer_id="p-kill", batch=5)
    producer.send_many(values(1, 15))
    poll_until(lambda: len(store.rows) == 15 and producer.acked == 7, what="15 taken, 7 acked")
    assert producer.pending == 8
    first.stop()
    store.crash()
    assert store.seqs() == list(range(1, 8))
    store.durable_upto = None
    poll_until(lambda: producer.stats["disconnects"] >= 1, what="the disconnect seen")
    producer.send_many(values(16, 5))  # queued while no server runs
    servers(wire_mode, store, endpoint=first.endpoint, credit=3, batch=5)
    poll_until(lambda: store.seqs() == list(range(1, 21)), what="records 1..20, once each")
    assert [r["value"] for r in store.rows] == values(1, 20)
    producer.flush(WAIT)
    d = producer.delivery()
    assert (d.queued, d.sent, d.acked, d.pending) == (20, 20, 20, 0)
    assert producer.stats["flows"] == 2 and producer.stats["records_sent"] == 15 + 13
    assert store.bots[1]["producer"] == "p-kill"


def test_a_restarted_producer_continues_after_the_servers_resume(make_producer, servers):
    store = Store()
    srv = servers("routerdealer", store)
    before = make_producer(srv.endpoint, producer_id="p-restart")
    before.send_many(values(1, 5))
    before.flush(WAIT)
    before.close(WAIT)
    assert store.durable == 5

    after = make_producer(srv.endpoint, producer_id="p-restart")  # numbers from 1 again
    poll_until(lambda: after.connected, what="the second flow")
    assert after.send_many(values(6, 3)) == 8  # renumbered after the server's resume
    poll_until(lambda: store.seqs() == list(range(1, 9)), what="records 1..8")
    assert [r["value"] for r in store.rows] == values(1, 8)
    after.flush(WAIT)
    d = after.delivery()
    assert (d.queued, d.sent, d.acked) == (3, 3, 3)


def test_queued_before_the_flow_then_renumbered_after_resume(make_producer, servers):
    store = Store()
    store.durable = 40  # the server already holds 1..40 of this producer
    # No flow until the records are queued: the server holds its BOT reply (with
    # resume=40) until then, whatever the machine's speed. A BOT retry would start a second
    # handshake, so the producer waits for the reply as long as the test may take.
    reply = threading.Event()
    srv = servers("routerdealer", store, hold_bot=reply)
    producer = make_producer(srv.endpoint, producer_id="p-ahead", connect_timeout=2 * WAIT)
    try:
        poll_until(lambda: len(store.bots) == 1, what="the producer's BOT at the server")
        assert producer.stats["flows"] == 0
        assert producer.send_many(values(1, 3)) == 3  # queued before any flow: 1..3
    finally:
        reply.set()
    poll_until(lambda: store.seqs() == [41, 42, 43], what="41..43")
    assert len(store.bots) == 1
    assert producer.stats["renumbered"] == 3
    assert producer.send(b"next") == 44


def test_a_rejected_flow_is_retried_with_backoff(make_producer, servers, caplog):
    caplog.set_level(logging.WARNING, logger="zio_spark.transport")
    store = Store()
    srv = servers("routerdealer", store, reject_first=True)
    producer = make_producer(srv.endpoint)
    producer.send_many(values(1, 4))
    poll_until(lambda: store.seqs() == [1, 2, 3, 4], what="4 records after the retry")
    assert producer.stats["rejected"] == 1 and producer.stats["flows"] == 1
    assert "{'reason': 'not yet'}" in (producer.last_error or "")
    assert any("rejected the flow" in r.getMessage() for r in caplog.records)


def test_a_server_that_never_answers_is_named_with_both_socket_kinds(make_producer, caplog):
    caplog.set_level(logging.WARNING, logger="zio_spark.transport")
    endpoint = free_endpoint()
    producer = make_producer(endpoint, connect_timeout=0.2)
    producer.send(b"x")
    poll_until(lambda: producer.stats["bot_timeouts"] >= 2, what="two BOT timeouts, retried")
    assert producer.stats["unanswered"] >= 2
    error = producer.last_error or ""
    assert error.startswith("no BOT reply within 0.2 s; nothing answered at " + endpoint)
    assert "DEALER" in error and "ROUTER" in error and "SERVER" in error
    assert "--socket clientserver" in error and "draft" in error
    assert producer.delivery().sent == 0 and producer.pending == 1
    with pytest.raises(Exception, match="1 records still unacknowledged"):
        producer.flush(0.1)


@pytest.mark.requires_draft
def test_a_dealer_towards_a_server_socket_times_out_with_the_fix(ctx, make_producer):
    """The real mismatch: libzmq connects DEALER to SERVER, then delivers nothing."""
    with ReferenceServer(ctx, role="taker", flavor="cpp", sockets="clientserver") as ref:
        producer = make_producer(ref.endpoint, "routerdealer", connect_timeout=0.3)
        # libzmq closes the mismatched connection at the handshake: no reply ever comes.
        poll_until(lambda: producer.stats["unanswered"] >= 2, what="two unanswered BOTs")
        error = producer.last_error or ""
        assert error.startswith("the connection closed before a BOT reply; nothing answered")
        assert "use clientserver on this side (--socket clientserver" in error
        assert ref.bots == [] and producer.stats["flows"] == 0


def test_options_are_checked(ctx):
    with pytest.raises(ConfigError, match="either bind or connect"):
        Producer("tcp://127.0.0.1:*", connect="tcp://127.0.0.1:1", ctx=ctx)
    with pytest.raises(ConfigError, match="'credit'"):
        Producer(connect="tcp://127.0.0.1:1", ctx=ctx, credit=0)
    with pytest.raises(ConfigError, match="'connect_timeout'"):
        Producer(connect="tcp://127.0.0.1:1", ctx=ctx, connect_timeout=0)


def test_silent_peer_hint_names_both_kinds():
    hint = silent_peer_hint("tcp://h:1", "server", "clientserver")
    assert "this side is a SERVER socket (clientserver)" in hint
    assert "only to a CLIENT peer; a DEALER peer (routerdealer)" in hint
    assert "use routerdealer on this side (--socket routerdealer" in hint
    assert "draft" not in hint


# -------------------------------------------------------------- the reference stand-in


def test_a_plain_reference_server_taker_gets_bare_dats_at_most_once(ctx, make_producer, wire_mode):
    """C++ reference server taker: it echoes our BOT (so: plain), announces our credit
    1000 but pays its own 3; records go one per bare DAT, are forgotten once sent, and
    are confirmed when it echoes our EOT."""
    with ReferenceServer(ctx, role="taker", flavor="cpp", sockets=wire_mode, credit=3) as ref:
        producer = make_producer(ref.endpoint, wire_mode, producer_id="p-plain")
        producer.send_many(values(1, 25))
        assert ref.wait_until(lambda: len(ref.received) == 25, WAIT), ref.errors
        assert ref.received == values(1, 25)
        assert all(label == {"flow": "DAT"} for label in ref.received_labels)
        assert ref.replies[0]["credit"] == 1000  # announced, never paid
        assert max(ref.pays_sent) <= 3
        assert producer.acks is False
        poll_until(lambda: producer.pending == 0, what="released once sent")
        before = producer.delivery()
        assert (before.sent, before.acked, before.confirmed) == (25, 0, 0)
        d = producer.close(WAIT)
        assert (d.queued, d.sent, d.acked, d.confirmed) == (25, 25, 0, 25)
        assert d.delivered == 25
        assert ref.wait_until(lambda: ref.flows_completed == 1, WAIT)
        assert ref.errors == [] and ref.eots_received == 1


def test_records_sent_on_a_plain_flow_that_died_are_not_confirmed(ctx, make_producer):
    """Plain: what went out on a flow that died is not confirmed (at most once)."""
    ref = ReferenceServer(ctx, role="taker", flavor="cpp", credit=5)
    try:
        producer = make_producer(ref.endpoint, producer_id="p-plain-restart")
        producer.send_many(values(1, 4))
        assert ref.wait_until(lambda: len(ref.received) == 4, WAIT), ref.errors
    finally:
        ref.close()
    poll_until(lambda: producer.stats["disconnects"] >= 1, what="the disconnect seen")
    d = producer.delivery()
    assert (d.sent, d.confirmed, d.pending) == (4, 0, 0)  # sent, never confirmed
