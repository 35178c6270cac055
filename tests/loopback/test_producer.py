"""Loopback tests of zio_spark.source.producer.Producer, the ack-capable ZIO giver.

Takers are what the Spark receiver is on the wire: a :class:`FlowEndpoint` client sending
``BOT{stream, ack: true, resume, encoding: ["arrow"], batch}``, decoding Arrow DATs with
:func:`zio_spark.codec.records.decode_batch` and acknowledging in its PAYs; or a plain ZIO
taker written with raw pyzmq frames per specs/zio-wire.md. Every wait has a deadline;
endpoints are 127.0.0.1 random ports; linger 0; the ``ctx`` fixture fails on a leak.
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from tests.peers.zio_reference import ReferenceClientTaker
from tests.support import Background
from zio_spark.codec.records import decode_batch
from zio_spark.errors import TransportError
from zio_spark.protocol.flow import BotReceived, Direction, FlowState, Role
from zio_spark.source.producer import Producer
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import ClientPort

WAIT = 5.0  # deadline for what must happen (returns as soon as it does)
SHORT = 0.2  # timeouts that are meant to run out

MakeClient = Callable[..., ClientPort]


def poll_until(cond: Callable[[], Any], timeout: float = WAIT, what: str = "") -> None:
    """Re-check ``cond`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or cond}")
        gate.wait(0.005)


@pytest.fixture
def make_producer(ctx: zmq.Context[Any]) -> Iterator[Callable[..., Producer]]:
    made: list[Producer] = []

    def make(mode: str = "routerdealer", **kw: Any) -> Producer:
        kw.setdefault("linger_ms", 0)
        producer = Producer("tcp://127.0.0.1:*", ctx=ctx, mode=mode, **kw)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close(timeout=SHORT, flush=False)


class Taker:
    """A zio-spark taker: Arrow DATs, acknowledgements in PAYs, seq checked for gaps."""

    def __init__(self, port: ClientPort) -> None:
        self.port = port
        self.ep = FlowEndpoint(port, Role.CLIENT)
        self.rows: list[dict[str, Any]] = []
        self.dat_sizes: list[int] = []
        self.dat_attrs: list[dict[str, Any]] = []  # each DAT's profile attributes
        self.last = 0  # highest seq held

    def open(
        self,
        *,
        credit: int = 4,
        resume: int = 0,
        batch: Any = None,
        stream: str = "zio",
        arrow: bool = True,
        direction: Direction = Direction.INJECT,
        **extra: Any,
    ) -> BotReceived:
        attrs: dict[str, Any] = {"stream": stream, "ack": True, "resume": resume, **extra}
        if arrow:
            attrs["encoding"] = ["arrow"]
        if batch is not None:
            attrs["batch"] = batch
        self.last = resume
        return self.ep.connect(direction, credit, attrs, WAIT)

    def take(self, n: int, *, ack: bool = True) -> list[dict[str, Any]]:
        """Receive at least ``n`` more records; each PAY acks what is held if ``ack``."""
        want = len(self.rows) + n
        deadline = time.monotonic() + WAIT
        while len(self.rows) < want:
            if self.ep.flow.credit > 0:
                self.ep.pay(None, {"ack": self.last} if ack else None)
            data = self.ep.get(max(0.0, deadline - time.monotonic()), auto_pay=False)
            assert data is not None, f"EOT after {len(self.rows)} of {want} records"
            batch = decode_batch(data.message.payload[0], expected_first=self.last + 1)
            rows = batch.to_pylist()
            self.dat_sizes.append(len(rows))
            self.dat_attrs.append(dict(data.attrs))
            self.rows.extend(rows)
            self.last = rows[-1]["seq"]
        return self.rows[want - n :]

    def ack(self, upto: int | None = None) -> None:
        """An ack-only PAY (credit 0)."""
        self.ep.pay(0, {"ack": self.last if upto is None else upto})


@pytest.fixture
def taker(make_client: MakeClient) -> Callable[..., Taker]:
    def make(producer: Producer, mode: str = "routerdealer") -> Taker:
        port = make_client(mode=mode)
        port.connect(producer.endpoint)
        return Taker(port)

    return make


def columns(n: int, first: int = 0) -> dict[str, list[Any]]:
    """Record columns with empty and binary values and some nulls in every optional one."""
    idx = range(first, first + n)
    return {
        "values": [b"" if i % 6 == 0 else bytes([i % 256]) * (i % 9) + b"v%d" % i for i in idx],
        "keys": [None if i % 4 == 0 else b"k\x00%d" % i for i in idx],
        "headers": [None if i % 5 == 0 else {"h": str(i), "x-é": "ü" * (i % 3)} for i in idx],
        "granules": [None if i % 7 == 0 else 10**12 + i for i in idx],
    }


def expected_rows(cols: dict[str, list[Any]], first_seq: int) -> list[dict[str, Any]]:
    return [
        {
            "seq": first_seq + j,
            "value": v,
            "key": k,
            "granule": g,
            "headers": None if h is None else list(h.items()),
        }
        for j, (v, k, h, g) in enumerate(
            zip(cols["values"], cols["keys"], cols["headers"], cols["granules"], strict=True)
        )
    ]


def send_columns(producer: Producer, cols: dict[str, list[Any]], **kw: Any) -> int:
    return producer.send_many(
        cols["values"], keys=cols["keys"], headers=cols["headers"], granules=cols["granules"], **kw
    )


@pytest.fixture
def background() -> Iterator[Callable[..., Background]]:
    made: list[Background] = []

    def start(fn: Callable[..., Any], *args: Any, **kw: Any) -> Background:
        bg = Background(lambda: fn(*args, **kw))
        made.append(bg)
        return bg

    yield start
    for bg in made:  # calls stuck on their own deadline end before the sockets close
        bg.thread.join(WAIT + 1)


def echo_eot(t: Taker) -> Any:
    """Taker side of the producer's close(): wait for its EOT and echo it."""
    assert t.ep.get(WAIT, auto_pay=False) is None, "a DAT instead of the EOT"
    return t.ep.send_eot(timeout=WAIT)


# ---------------------------------------------------------------------- zio-spark taker


def test_arrow_taker_gets_every_record_then_an_acknowledged_eot(
    make_producer, taker, background, wire_mode
):
    producer = make_producer(wire_mode, producer_id="p-arrow", batch=10)
    early = columns(30)
    assert send_columns(producer, early) == 30  # queued before any taker connects
    t = taker(producer, wire_mode)
    bot = t.open(credit=3, batch=7)
    assert bot.credit == 3 and bot.direction is Direction.EXTRACT
    assert dict(bot.attrs) == {
        "producer": "p-arrow",
        "stream": "zio",
        "ack": True,
        "encoding": "arrow",
        "last": 30,  # its position: the last seq assigned when it answered
        # A bound producer serves range reads (docs/direct-read.md): every BOT says so.
        "ranges": 1,
        "incarnation": producer.incarnation,
    }
    assert t.take(30) == expected_rows(early, 1)

    late = columns(5, first=30)  # sent while the taker waits: the loop is woken
    for v, k, h, g in zip(*late.values(), strict=True):
        producer.send(v, key=k, headers=h, granule=g)
    assert t.take(5) == expected_rows(late, 31)
    assert [r["seq"] for r in t.rows] == list(range(1, 36))
    assert max(t.dat_sizes) == 7  # min(producer batch 10, taker batch 7)
    # Counted just after each send: the taker may be first.
    poll_until(lambda: producer.stats["records_sent"] == 35, what="35 records counted")
    assert producer.stats["dats_sent"] == len(t.dat_sizes)

    t.ack()
    producer.flush(WAIT)
    assert producer.pending == 0 and producer.acked == 35 == producer.last_seq

    # close() ends with an EOT the taker echoes: the end of stream is confirmed.
    echoing = background(echo_eot, t)
    producer.close(WAIT)
    assert echoing.result().echo is False  # the taker answered the producer's EOT
    assert producer.stats["eot_received"] == 1  # ... and the producer saw that echo
    assert t.ep.state is FlowState.CLOSED and t.ep.peer_eot is not None


@pytest.mark.parametrize(
    ("producer_batch", "taker_batch", "sizes"),
    [(10, 3, [3, 3, 3, 2]), (3, 10, [3, 3, 3, 2]), (4, None, [4, 4, 3]), (5, 1, [1] * 11)],
)
def test_the_takers_batch_caps_records_per_dat(
    make_producer, taker, producer_batch, taker_batch, sizes
):
    producer = make_producer(batch=producer_batch)
    cols = columns(11)
    send_columns(producer, cols)
    t = taker(producer)
    t.open(credit=20, batch=taker_batch)
    assert t.take(11) == expected_rows(cols, 1)
    assert t.dat_sizes == sizes


def test_records_are_kept_until_acknowledged(make_producer, taker):
    producer = make_producer()
    t = taker(producer)
    t.open(credit=4)
    cols = columns(4)
    send_columns(producer, cols)
    assert t.take(4, ack=False) == expected_rows(cols, 1)
    assert producer.pending == 4 and producer.acked == 0

    t0 = time.monotonic()
    with pytest.raises(TransportError, match="4 records still unacknowledged") as err:
        producer.flush(SHORT)
    assert time.monotonic() - t0 >= SHORT
    assert err.value.endpoint == producer.endpoint

    # The taker hands every credit out (nothing left to send), so it can only
    # acknowledge with an ack-only PAY of credit 0.
    t.ep.pay()
    assert t.ep.flow.credit == 0
    t.ack(2)
    poll_until(lambda: producer.acked == 2, what="ack 2")
    assert producer.pending == 2
    t.ack(4)
    producer.flush(WAIT)
    assert producer.pending == 0 and producer.acked == 4
    assert producer.stats["acked"] == 4


@pytest.mark.parametrize("old_taker", ["closed", "alive"])
def test_a_new_taker_resumes_after_its_resume_and_replaces_the_old_flow(
    make_producer, taker, wire_mode, old_taker
):
    producer = make_producer(wire_mode, batch=5)
    cols = columns(20)
    send_columns(producer, cols)
    first = taker(producer, wire_mode)
    first.open(credit=2, batch=5)
    got = first.take(12, ack=False)  # three DATs of five: seq 1..15 in hand
    assert [r["seq"] for r in got] == list(range(1, 16))
    first.ack(6)
    poll_until(lambda: producer.acked == 6, what="ack 6")
    if old_taker == "closed":  # the Spark side died; a new port reconnects
        first.port.close(linger_ms=0)

    second = taker(producer, wire_mode)
    second.open(credit=3, resume=8, batch=5)  # it made 1..8 durable before dying
    assert producer.stats["takers_replaced"] == 1 and producer.stats["takers"] == 2
    rest = second.take(12)
    assert rest == expected_rows(cols, 1)[8:]  # 9..20 resent, nothing lost
    assert second.dat_sizes[0] == 5 and rest[0]["seq"] == 9
    second.ack()
    producer.flush(WAIT)
    assert producer.pending == 0 and producer.acked == 20

    # The old flow is gone from the server; an old taker still alive gets nothing new.
    poll_until(lambda: len(producer._server.flows) == 1, what="only the new flow")
    if old_taker == "alive":
        while True:  # DATs it was given credit for before the replacement may be queued
            try:
                data = first.ep.get(SHORT, auto_pay=False)
            except TransportError:
                break
            assert data is not None and decode_batch(data.message.payload[0])[0][-1].as_py() <= 20
        first.ep.pay(0, {"ack": 20})  # its flow no longer exists: a PAY before any BOT
        # Told once with an EOT (it ended here: open a new flow), never given a record.
        assert first.ep.get(WAIT, auto_pay=False) is None
        assert first.ep.peer_eot is not None
        assert "no flow with you here" in first.ep.peer_eot.attrs["reason"]
        assert producer.stats["stray_messages"] == 1
        assert producer.acked == 20  # the stale ack freed nothing new
        assert producer.send(b"new") == 21
        assert [r["seq"] for r in second.take(1)] == [21]


def test_a_restarted_producer_renumbers_unsent_records_after_resume(
    make_producer, taker, background
):
    before = make_producer(producer_id="p-restart")
    send_columns(before, columns(5))
    t = taker(before)
    t.open(credit=8)
    t.take(5)
    t.ack()
    before.flush(WAIT)
    assert t.ep.send_eot(timeout=WAIT).echo  # the taker ends this flow
    before.close(WAIT)

    after = make_producer(producer_id="p-restart")  # a new process: numbers from 1 again
    cols = columns(3, first=5)
    assert send_columns(after, cols) == 3
    t2 = taker(after)
    bot = t2.open(credit=8, resume=5)
    assert bot.attrs["producer"] == "p-restart"
    assert t2.take(3) == expected_rows(cols, 6)
    assert after.stats["renumbered"] == 3
    assert after.last_seq == 8
    assert after.send(b"next") == 9
    assert [r["seq"] for r in t2.take(1)] == [9]
    t2.ack()
    after.flush(WAIT)

    # With nothing queued, a taker ahead of this process moves the numbering on.
    empty = make_producer(producer_id="p-restart")
    t3 = taker(empty)
    t3.open(resume=40)
    assert empty.send(b"x") == 41 and empty.stats["renumbered"] == 0
    assert t3.take(1)[0]["seq"] == 41


def test_a_second_taker_with_the_same_resume_does_not_renumber_again(make_producer, taker):
    """A restarted producer moves its numbering on for a taker's ``resume``; when that
    taker is replaced (the Spark driver restarted, or a reconnecting port delivered a
    queued BOT) by one with the same ``resume`` before anything was sent, the numbering
    must not move on a second time. (It did: 14001.. became 28001.. and the source stopped
    on a sequence gap; found by the source chaos test, seed 582289361.)"""
    producer = make_producer(producer_id="p-twice")
    first = taker(producer)
    first.open(credit=8, resume=40)
    poll_until(lambda: producer.connected, what="the first taker attached")
    second = taker(producer)
    second.open(credit=8, resume=40)
    poll_until(lambda: producer.stats["takers"] == 2, what="the second taker attached")
    cols = columns(3)
    assert send_columns(producer, cols) == 43
    assert second.take(3) == expected_rows(cols, 41)
    assert producer.stats["renumbered"] == 0
    # Queued but unsent when a third taker (same resume) comes: same numbers again.
    assert producer.send(b"queued") == 44
    third = taker(producer)
    third.open(credit=8, resume=43)
    assert [r["seq"] for r in third.take(1)] == [44]
    assert producer.stats["renumbered"] == 0
    assert producer.send(b"next") == 45


# -------------------------------------------------------------------------- plain taker


def _prefix(obj: dict[str, Any]) -> bytes:
    return b"ZIO0FLOW" + json.dumps(obj).encode()


def _coord(seqno: int) -> bytes:
    return struct.pack("<QQQ", 0, 0, seqno)


def _recv(sock: zmq.Socket[bytes]) -> tuple[dict[str, Any], int, list[bytes]]:
    """One message from the producer, as a reference ZIO peer sees it."""
    assert sock.poll(int(WAIT * 1000)), "nothing from the producer"
    frames = sock.recv_multipart()
    assert frames[0] == b"" and frames[1][:8] == b"ZIO0FLOW" and len(frames[2]) == 24
    _origin, _granule, seqno = struct.unpack("<QQQ", frames[2])
    return json.loads(frames[1][8:]), seqno, frames[3:]


def test_a_plain_zio_taker_gets_one_record_per_dat(make_producer, raw_socket, background):
    producer = make_producer()
    cols = columns(5)
    send_columns(producer, cols)
    raw = raw_socket(zmq.DEALER)
    raw.connect(producer.endpoint)
    raw.send_multipart(
        [b"", _prefix({"flow": "BOT", "direction": "inject", "credit": 2}), _coord(0)]
    )
    bot, seqno, payload = _recv(raw)
    assert (bot["flow"], bot["direction"], bot["credit"], seqno, payload) == (
        "BOT",
        "extract",
        2,
        0,
        [],
    )

    dats = []
    seqno_out = 1
    while len(dats) < 5:
        raw.send_multipart([b"", _prefix({"flow": "PAY", "credit": 2}), _coord(seqno_out)])
        seqno_out += 1
        for _ in range(min(2, 5 - len(dats))):
            dats.append(_recv(raw))
    for i, (obj, seqno, payload) in enumerate(dats):
        assert obj["flow"] == "DAT" and obj["seq"] == i + 1 and seqno == i + 1
        assert payload == [cols["values"][i]]  # the value is the payload
        key = cols["keys"][i]
        assert obj.get("key") == (None if key is None else base64.b64encode(key).decode())
        assert obj.get("headers") == cols["headers"][i]
        assert obj.get("granule") == cols["granules"][i]
    # At most once, as plain ZIO promises: released once sent, no ack needed.
    poll_until(lambda: producer.pending == 0, what="records released")
    producer.flush(0.0)
    assert producer.acked == 0

    closing = background(producer.close, WAIT)
    eot, seqno, _ = _recv(raw)
    assert eot == {"flow": "EOT"} and seqno == 6
    raw.send_multipart([b"", _prefix({"flow": "EOT"}), _coord(seqno_out)])
    closing.result()
    assert producer.stats["eot_received"] == 1


# ------------------------------------------------------------------------- back-pressure


def test_send_many_blocks_at_max_unacked(make_producer, taker, background):
    producer = make_producer(max_unacked=4)
    assert producer.send_many([b"1", b"2", b"3"]) == 3

    t0 = time.monotonic()
    with pytest.raises(
        TransportError, match=r"window full \(4 records, 4 bytes unacknowledged"
    ) as err:
        producer.send_many([b"4", b"5"], timeout=SHORT)
    assert time.monotonic() - t0 >= SHORT
    assert err.value.endpoint == producer.endpoint
    # What fitted was queued before the wait: the caller can tell from last_seq.
    assert producer.last_seq == 4 and producer.pending == 4

    sending = background(producer.send_many, [b"5", b"6", b"7"], timeout=WAIT)
    assert sending.running_after(SHORT), "send_many did not wait for room"
    t = taker(producer)
    t.open(credit=2, batch=2)
    rows = t.take(7)  # acking as it goes makes room
    assert sending.result() == 7
    assert [r["value"] for r in rows] == [b"%d" % i for i in range(1, 8)]
    t.ack()
    producer.flush(WAIT)


# ---------------------------------------------------------------------------- rejection


@pytest.mark.parametrize(
    ("open_kw", "reason"),
    [
        ({"stream": "other"}, "no stream 'other' here (this is 'zio')"),
        ({"direction": Direction.EXTRACT}, "connect with direction inject"),
        ({"resume": "x"}, "BOT resume must be an integer >= 0, got 'x'"),
        ({"batch": 0}, "BOT batch must be an integer >= 1, got 0"),
        ({"batch": "5"}, "BOT batch must be an integer >= 1, got '5'"),
    ],
    ids=["other-stream", "extract", "bad-resume", "batch-0", "batch-str"],
)
def test_takers_that_cannot_be_served_are_rejected(
    make_producer, taker, wire_mode, open_kw, reason
):
    producer = make_producer(wire_mode)
    producer.send(b"kept")
    t = taker(producer, wire_mode)
    with pytest.raises(FlowRejected) as err:
        t.open(**open_kw)
    assert reason in err.value.attrs["reason"]
    assert err.value.endpoint == t.port.endpoint
    assert not producer.connected and producer.stats["takers"] == 0
    assert producer.pending == 1
    poll_until(lambda: not producer._server.flows, what="the rejected flow removed")


# -------------------------------------------------------------------------- robustness


def test_close_gives_up_on_a_silent_taker_after_its_timeout(make_producer, taker, caplog):
    caplog.set_level(logging.WARNING, logger="zio_spark.transport")
    producer = make_producer()
    t = taker(producer)
    t.open()
    t0 = time.monotonic()
    producer.close(SHORT, flush=False)  # the taker never echoes
    assert SHORT <= time.monotonic() - t0 < SHORT + 2.0
    assert any("no EOT echo" in r.getMessage() for r in caplog.records)
    with pytest.raises(TransportError, match="closed"):
        producer.send(b"too late")


def test_a_vanished_taker_ends_its_flow_not_the_producer(make_producer, taker, wire_mode, caplog):
    """Sending to a taker that disconnected fails in the loop: that flow ends, no more."""
    caplog.set_level(logging.INFO, logger="zio_spark.transport")
    producer = make_producer(wire_mode)
    gone = taker(producer, wire_mode)
    gone.open(credit=1000)
    gone.ep.pay()  # the producer may send 1000 DATs, and has nothing yet
    conn = producer._taker.conn
    poll_until(lambda: conn.flow.credit == 1000, what="the PAY taken in")
    gone.port.close(linger_ms=0)

    # Each send wakes the loop, which sends a DAT at once; once the server knows the
    # peer is gone, that send fails (UnknownPeerError) inside the loop.
    n = 0
    deadline = time.monotonic() + WAIT
    pace = threading.Event()
    while producer.connected:
        assert time.monotonic() < deadline, "the vanished taker was never noticed"
        n = producer.send(b"r%d" % n)
        pace.wait(0.01)  # the loop sends it; the condition is re-checked every turn
    assert producer._server.error is None, f"the producer loop died: {producer._server.error!r}"
    assert producer._server.stats["call_errors"] == 0  # handled as that flow's failure
    poll_until(  # logged just after the taker is detached
        lambda: any("taker left (transport error" in r.getMessage() for r in caplog.records),
        what="the flow's end logged",
    )

    # Still serving: a new taker gets everything, from 1.
    t = taker(producer, wire_mode)
    t.open(credit=50)
    assert [r["seq"] for r in t.take(n)] == list(range(1, n + 1))


# ------------------------------------------------------------- the reference stand-in


@pytest.mark.parametrize("flavor", ["cpp", "python"])
def test_a_reference_client_taker_is_plain_and_confirms_only_by_echoing_eot(
    ctx, make_producer, wire_mode, flavor
):
    """Server mode, the reference's inject client: its BOT states nothing, so it gets one
    record per DAT and no acks are expected. The C++ taker echoes our EOT (all confirmed);
    the Python one cannot (fact 20 of the stand-in): nothing is confirmed, as it should."""
    producer = make_producer(wire_mode, producer_id="p-ref")
    producer.send_many([b"a%d" % i for i in range(12)])
    ref = ReferenceClientTaker(ctx, producer.endpoint, flavor=flavor, sockets=wire_mode, credit=4)
    try:
        assert ref.wait_until(lambda: len(ref.received) == 12, WAIT), ref.errors
        assert ref.received == [b"a%d" % i for i in range(12)]
        assert [label["seq"] for label in ref.received_labels] == list(range(1, 13))
        assert producer.acks is False
        poll_until(lambda: producer.pending == 0, what="released once sent")
        d = producer.close(1.0 if flavor == "python" else WAIT)
    finally:
        ref.close()
    assert (d.queued, d.sent, d.acked) == (12, 12, 0)
    assert d.confirmed == (12 if flavor == "cpp" else 0)
    assert ref.eots_received == (1 if flavor == "cpp" else 0)


# ---------------------------------------------------------------------- retention window


def test_the_window_counts_value_bytes_and_the_time_send_is_blocked(
    make_producer, taker, background
):
    producer = make_producer(max_unacked=1000, max_unacked_bytes=1000)
    producer.send_many([b"x" * 100] * 10)  # 1000 bytes: the byte budget, not the count
    assert not producer.window_full and producer.stats["blocked"] == 0
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="window full") as err:
        producer.send(b"y", timeout=SHORT)
    assert time.monotonic() - t0 >= SHORT
    assert "1000 bytes unacknowledged" in str(err.value)
    assert producer.stats["blocked"] == 1
    assert producer.blocked_seconds >= SHORT and not producer.window_full

    # A send that waits is seen waiting, and an acknowledgement lets it through.
    t = taker(producer)
    t.open(credit=20)
    waiting = background(producer.send, b"z" * 100, timeout=WAIT)
    poll_until(lambda: producer.window_full, what="the send to wait for room")
    assert t.take(10, ack=False)
    t.ack(10)
    assert waiting.result() == 11
    assert not producer.window_full
    assert producer.stats["blocked"] == 2


def test_the_dat_that_empties_the_queue_says_more_false(make_producer, taker, wire_mode):
    """``more: false`` on the DAT after which nothing is left to send, and only there."""
    producer = make_producer(wire_mode, batch=10)
    send_columns(producer, columns(25))
    t = taker(producer, wire_mode)
    bot = t.open(credit=20)
    assert "more" not in bot.attrs  # it has records to send
    t.take(25, ack=False)
    assert t.dat_sizes == [10, 10, 5]
    assert t.dat_attrs == [{}, {}, {"more": False}]
    producer.send_many([b"a", b"b", b"c"])  # a new burst: its last DAT says so again
    t.take(3, ack=False)
    assert t.dat_attrs[3:] == [{"more": False}]
    assert producer.stats["blocked"] == 0  # and no blocked_ms: it never blocked


def test_a_producer_with_nothing_to_send_says_so_in_its_bot(make_producer, taker, wire_mode):
    producer = make_producer(wire_mode)
    t = taker(producer, wire_mode)
    assert t.open(credit=4).attrs["more"] is False
    producer.send(b"late")
    t.take(1, ack=False)
    assert t.dat_attrs == [{"more": False}]


def test_the_time_send_was_blocked_is_stated_to_the_taker(make_producer, taker, background):
    """After a block, the next DAT carries the producer's total blocked time (ms)."""
    producer = make_producer(max_unacked=4, batch=10)
    producer.send_many([b"1", b"2", b"3", b"4"])
    t = taker(producer)
    t.open(credit=20)
    t.take(4, ack=False)
    assert "blocked_ms" not in t.dat_attrs[0]
    waiting = background(producer.send_many, [b"5", b"6"], timeout=WAIT)
    poll_until(lambda: producer.blocked_seconds >= SHORT, what="send blocked for a while")
    t.ack(4)
    assert waiting.result() == 6
    t.take(2, ack=False)
    stated = [a["blocked_ms"] for a in t.dat_attrs if "blocked_ms" in a]
    assert stated, t.dat_attrs
    assert SHORT * 1000 <= stated[-1] <= producer.blocked_seconds * 1000 + 1
    assert t.dat_attrs[-1]["more"] is False


def test_the_default_window_holds_more_than_the_sources_default_backlog():
    """The source's default maxBacklog is 1M records: a default producer must not cap it."""
    from zio_spark.options import parse_source_options
    from zio_spark.source.producer import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES

    backlog = parse_source_options({"endpoints": "tcp://127.0.0.1:1"}).max_backlog
    assert 2 * backlog <= DEFAULT_WINDOW
    assert backlog * 100 * 2 <= DEFAULT_WINDOW_BYTES  # 100 B records, two batches


def test_advertise_takes_one_zre_options_or_a_group_with_keywords(
    make_producer: Callable[..., Producer], ctx: zmq.Context[Any]
) -> None:
    from tests.support import free_endpoint
    from zio_spark.errors import ConfigError
    from zio_spark.options import ZreOptions

    producer = make_producer()
    with pytest.raises(ConfigError, match=r"interval.*no ZRE keyword beside a ZreOptions"):
        producer.advertise(ZreOptions("daq"), interval=0.5)
    client = Producer(connect=free_endpoint(), ctx=ctx, linger_ms=0)
    try:
        with pytest.raises(ConfigError, match=r"group.*'daq'.*client mode has no port"):
            client.advertise(ZreOptions("daq"))
    finally:
        client.close(timeout=SHORT, flush=False)
