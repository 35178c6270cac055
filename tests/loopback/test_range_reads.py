"""Range reads on loopback: a bound Producer serves them, the range client reads them.

The direct read mode's wiring (docs/direct-read.md): ``held_window`` and ``read_range``
(:mod:`zio_spark.source.range_client`) against a :class:`Producer` in server mode
(:mod:`zio_spark.source.range_serving`), alone and next to the source's normal taker (a
:class:`Receiver` into a :class:`Spool`), plus the refusals (data loss), a plain ZIO giver
without the capability, and a silent endpoint. Every socket is on 127.0.0.1 with a random
port, the ``ctx`` fixture fails on a leaked socket, and every wait polls a condition with
a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import zmq

from tests.peers.zio_reference import ReferenceServer
from tests.support import spool_rows, wait_until
from zio_spark.errors import ConfigError, DataLossError, TransportError
from zio_spark.protocol.flow import BotReceived, Direction, Role
from zio_spark.protocol.ranges import state_capability
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import (
    ControlConnection,
    HeldWindow,
    RangeConnection,
    RangesNotServed,
    held_window,
    read_range,
)
from zio_spark.source.receiver import Receiver
from zio_spark.storage.spool import Spool
from zio_spark.transport.curve import client_curve
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.flow_server import FlowHandler, FlowServer, ServerFlow

T = 10.0  # seconds any one wait of a range read may last (returns as soon as it can)
P = "p1"


def _producer(ctx: Any, closing: list[Any], bind: str = "tcp://127.0.0.1:*", **kw: Any) -> Producer:
    kw.setdefault("producer_id", P)
    p = Producer(bind, ctx=ctx, linger_ms=0, **kw)
    closing.append(p)
    return p


def _send(p: Producer, n: int, first: int = 0) -> list[dict[str, Any]]:
    """Queue ``n`` records (every optional column, with nulls); returns their rows."""
    idx = range(first, first + n)
    values = [b"v%d" % i for i in idx]
    keys = [None if i % 4 == 0 else b"k%d" % i for i in idx]
    headers = [None if i % 5 == 0 else {"h": str(i)} for i in idx]
    granules = [None if i % 7 == 0 else 1000 + i for i in idx]
    last = p.send_many(values, keys=keys, headers=headers, granules=granules)
    start = last - n + 1
    return [
        {
            "seq": start + j,
            "value": v,
            "key": k,
            "granule": g,
            "headers": None if h is None else list(h.items()),
        }
        for j, (v, k, h, g) in enumerate(zip(values, keys, headers, granules, strict=True))
    ]


def _rows(batches: list[pa.RecordBatch]) -> list[dict[str, Any]]:
    return [row for b in batches for row in b.to_pylist()]


def _read(p: Producer, start: int, end: int, ctx: Any, incarnation: str | None = None) -> list:
    inc = p.incarnation if incarnation is None else incarnation
    return list(read_range(p.endpoint, P, inc, start, end, ctx=ctx, timeout=T))


# ------------------------------------------------------------------------------ serving


def test_held_window_and_ranges_give_exactly_the_records_in_order(ctx, closing):
    p = _producer(ctx, closing, batch=100)
    n = 1000
    rows = _send(p, n)
    assert p.serves_ranges and len(p.incarnation) == 32
    assert held_window(p.endpoint, P, ctx=ctx, timeout=T) == HeldWindow(p.incarnation, 1, n + 1)
    for start, end in [(1, 2), (10, 501), (501, n + 1), (1, n + 1), (999, n + 1)]:
        batches = _read(p, start, end, ctx)
        assert _rows(batches) == rows[start - 1 : end - 1], (start, end)
        assert max(b.num_rows for b in batches) <= 100  # the producer's batch
    assert _read(p, 7, 7, ctx) == []  # an empty range inside the window: done, no records
    # Re-reads are deterministic: the same batches, byte for byte.
    again = [_read(p, 3, 777, ctx) for _ in range(2)]
    assert len(again[0]) == len(again[1]) and all(
        a.equals(b) for a, b in zip(again[0], again[1], strict=True)
    )
    # Read-only: nothing was sent to a taker, released or acknowledged.
    d = p.delivery()
    assert (d.queued, d.sent, d.acked, d.pending) == (n, 0, 0, n)
    assert p.stats["records_sent"] == 0 and p.stats["takers"] == 0
    assert p.stats["range_records"] > 0


def test_both_socket_pairs(ctx, closing, wire_mode):
    p = _producer(ctx, closing, mode=wire_mode)
    rows = _send(p, 100)
    w = held_window(p.endpoint, P, ctx=ctx, mode=wire_mode, timeout=T)
    assert w == HeldWindow(p.incarnation, 1, 101)
    got = read_range(p.endpoint, P, w.incarnation, 1, 101, ctx=ctx, mode=wire_mode, timeout=T)
    assert _rows(list(got)) == rows


def test_over_curve(ctx, closing):
    public, secret = zmq.curve_keypair()
    p = _producer(ctx, closing, curve_secret_key=secret)
    rows = _send(p, 20)
    reader_public, reader_secret = zmq.curve_keypair()
    curve = client_curve(public, reader_secret, reader_public)
    w = held_window(p.endpoint, P, ctx=ctx, curve=curve, timeout=T)
    assert w == HeldWindow(p.incarnation, 1, 21)
    got = read_range(p.endpoint, P, w.incarnation, 5, 21, ctx=ctx, curve=curve, timeout=T)
    assert _rows(list(got)) == rows[4:]
    with pytest.raises(TransportError, match="no BOT reply"):  # no CURVE: no handshake
        held_window(p.endpoint, P, ctx=ctx, timeout=0.5)


def test_a_reader_without_arrow_gets_plain_dats_with_seq(ctx, closing, make_client):
    """The protocol allows plain DATs (one record each, ``seq`` in the label) for a reader
    that did not offer Arrow; the producer serves them so."""
    p = _producer(ctx, closing)
    _send(p, 5)
    ep = FlowEndpoint(make_client(), Role.CLIENT)
    ep.channel.connect(p.endpoint)
    bot = ep.connect(Direction.INJECT, 8, {"read": "range"}, T)
    assert "encoding" not in bot.attrs and bot.attrs["incarnation"] == p.incarnation
    req = {"id": 0, "producer": P, "incarnation": p.incarnation, "start": 2, "end": 5}
    ep.pay(None, {"range": req})
    got = [ep.get(T, auto_pay=False) for _ in range(4)]
    assert all(d is not None for d in got)
    labels = [dict(d.attrs) for d in got if d is not None]
    assert [d.message.payload for d in got[:3] if d is not None] == [(b"v1",), (b"v2",), (b"v3",)]
    assert [a["seq"] for a in labels[:3]] == [2, 3, 4]
    assert labels[3] == {"range": {"id": 0, "status": "done", "start": 2, "end": 5}}
    ep.send_eot(timeout=T)


def test_an_abandoned_read_ends_its_flow(ctx, closing):
    p = _producer(ctx, closing, batch=10)
    rows = _send(p, 1000)
    reading = read_range(p.endpoint, P, p.incarnation, 1, 1001, ctx=ctx, timeout=T, credit=4)
    first = next(reading)
    assert first.to_pylist() == rows[:10]
    wait_until(lambda: len(p._ranges.flows) == 1, what="the range flow open", timeout=T)
    reading.close()  # EOT, the echo awaited, the socket closed
    wait_until(lambda: not p._ranges.flows, what="the range flow ended", timeout=T)


def test_one_flow_answers_many_requests_with_little_credit(ctx, closing):
    p = _producer(ctx, closing, batch=3)
    rows = _send(p, 50)
    with RangeConnection(p.endpoint, ctx=ctx, timeout=T, credit=2, batch=2) as conn:
        assert conn.incarnation == p.incarnation and conn.producer == P
        assert conn.held(P) == HeldWindow(p.incarnation, 1, 51)
        for start, end in [(1, 51), (20, 30), (50, 51)]:
            got = list(conn.read(P, p.incarnation, start, end))
            assert max(b.num_rows for b in got) <= 2  # the reader's batch
            assert _rows(got) == rows[start - 1 : end - 1]
        with pytest.raises(DataLossError):
            list(conn.read(P, p.incarnation, 40, 60))
        assert conn.held(P).end == 51  # the flow is still good after a refusal


def test_concurrent_reads_from_three_threads(ctx, closing):
    p = _producer(ctx, closing, batch=64)
    rows = _send(p, 3000)
    results: dict[int, list[dict[str, Any]]] = {}
    errors: list[BaseException] = []
    spans = {0: (1, 3001), 1: (500, 2500), 2: (1000, 1001)}

    def run(k: int) -> None:
        try:
            start, end = spans[k]
            for _ in range(3):
                results[k] = _rows(_read(p, start, end, ctx))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    for k, (start, end) in spans.items():
        assert results[k] == rows[start - 1 : end - 1]
    wait_until(lambda: not p._ranges.flows, what="every range flow ended", timeout=T)


# ------------------------------------------------------------------ next to the taker


def test_range_reads_do_not_disturb_the_taker_and_acks_free_ranges(ctx, tmp_path, closing):
    spool = Spool(tmp_path / "spool", sync=False)
    closing.append(spool)
    p = _producer(ctx, closing, batch=50)
    first = _send(p, 2000)
    r = Receiver(spool, [p.endpoint], ctx=ctx, credit=4).start()
    closing.append(r)
    # Range reads while the taker receives, in another thread.
    stop = threading.Event()
    reads: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                got = _rows(_read(p, 1, 2001, ctx))
                assert got == first
                reads.append(len(got))
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        more = _send(p, 1000, first=2000)
        wait_until(lambda: spool.next_seq(P) == 3001, what="all records in the spool", timeout=30)
        wait_until(lambda: len(reads) >= 3, what="range reads alongside", timeout=30)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert spool_rows(spool, P) == [(x["seq"], x["value"]) for x in first + more]
    (st,) = r.status()
    assert st.state == "receiving" and (st.records, st.duplicates, st.failures) == (3000, 0, 0)
    assert p.stats["takers"] == 1 and p.stats.get("takers_replaced", 0) == 0
    assert p.acked == 0 and p.pending == 3000  # range reads acknowledge nothing

    # The driver's commit acks up to K = 1200: the range below it is gone, the rest served.
    k = 1200
    r.commit({P: k + 1})
    wait_until(lambda: p.acked == k, what=f"ack {k}", timeout=T)
    assert held_window(p.endpoint, P, ctx=ctx, timeout=T) == HeldWindow(p.incarnation, k + 1, 3001)
    with pytest.raises(DataLossError) as e:
        _read(p, 1000, 1500, ctx)
    text = str(e.value)
    assert "[1000, 1500)" in text and f"[{k + 1}, 3001)" in text and "no longer held" in text
    assert e.value.producer == P
    assert _rows(_read(p, k + 1, 1500, ctx)) == (first + more)[k:1499]
    assert _rows(_read(p, 2500, 3001, ctx)) == (first + more)[2499:]
    (st,) = r.status()
    assert (st.records, st.duplicates, st.failures) == (3000, 0, 0)


def test_a_range_flow_is_not_a_restarted_taker(ctx, closing, make_client):
    """A taker's BOT does not end range flows, a range flow's BOT does not end the
    taker's flow, and a range flow never acknowledges."""
    p = _producer(ctx, closing)
    _send(p, 10)
    with RangeConnection(p.endpoint, ctx=ctx, timeout=T) as conn:
        taker = FlowEndpoint(make_client(), Role.CLIENT)
        taker.channel.connect(p.endpoint)
        attrs = {"stream": "zio", "ack": True, "resume": 0, "encoding": ["arrow"]}
        bot = taker.connect(Direction.INJECT, 4, attrs, T)
        assert bot.attrs["incarnation"] == p.incarnation and bot.attrs["ranges"] == 1
        assert conn.held(P) == HeldWindow(p.incarnation, 1, 11)  # the range flow is still there
        with RangeConnection(p.endpoint, ctx=ctx, timeout=T) as other:
            assert other.held(P).end == 11
        taker.pay(4)
        assert taker.get(T, auto_pay=False) is not None  # the taker's flow still gives
        assert p.stats["takers"] == 1 and p.stats.get("takers_replaced", 0) == 0

    # An ack on a range flow is refused with the reason, and frees nothing.
    raw = FlowEndpoint(make_client(), Role.CLIENT)
    raw.channel.connect(p.endpoint)
    raw.connect(Direction.INJECT, 4, {"read": "range", "encoding": ["arrow"]}, T)
    raw.pay(0, {"ack": 10})
    assert raw.get(T, auto_pay=False) is None  # EOT
    assert raw.peer_eot is not None and "never acknowledges" in raw.peer_eot.attrs["reason"]
    assert p.acked == 0 and p.pending == 10
    # Both flows ended as a peer does (else closing the producer waits out their echoes).
    raw.send_eot(timeout=T)  # the echo of the producer's EOT
    taker.send_eot(timeout=T)


# ------------------------------------------------------------------------ refusals


def test_beyond_end_and_other_incarnation_are_data_loss_not_a_hang(ctx, closing):
    p = _producer(ctx, closing)
    _send(p, 20)
    t0 = time.monotonic()
    with pytest.raises(DataLossError) as e:
        _read(p, 15, 25, ctx)  # the producer assigned only up to 20
    assert "[15, 25)" in str(e.value) and "[1, 21)" in str(e.value)
    assert _read(p, 21, 21, ctx) == []  # empty, at the window's end: in it, done
    with pytest.raises(DataLossError):
        _read(p, 22, 22, ctx)  # empty, past the end: a position the producer never had
    assert time.monotonic() - t0 < 3 * T  # refused at once, never waited for


def test_wrong_incarnation_is_data_loss_naming_both(ctx, closing):
    p = _producer(ctx, closing)
    _send(p, 20)
    with pytest.raises(DataLossError) as e:
        _read(p, 1, 5, ctx, incarnation="stale-one")
    text = str(e.value)
    assert "'stale-one'" in text and repr(p.incarnation) in text and "[1, 5)" in text
    # A producer id this producer does not serve: not a held window, and a lost range.
    with pytest.raises(TransportError, match="serves no producer 'other'"):
        held_window(p.endpoint, "other", ctx=ctx, timeout=T)
    with pytest.raises(DataLossError, match="serves no producer 'other'"):
        list(read_range(p.endpoint, "other", p.incarnation, 1, 5, ctx=ctx, timeout=T))


def test_a_new_producer_on_the_same_endpoint_refuses_the_old_incarnation(ctx, closing):
    p = _producer(ctx, closing)
    rows = _send(p, 30)
    old = held_window(p.endpoint, P, ctx=ctx, timeout=T)
    assert _rows(_read(p, 1, 31, ctx)) == rows
    endpoint = p.endpoint
    p.close(flush=False, timeout=5)
    deadline = time.monotonic() + 10
    while True:  # the old listener is being torn down by libzmq
        try:
            q = _producer(ctx, closing, bind=endpoint)
            break
        except (TransportError, zmq.ZMQError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    _send(q, 40, first=1000)  # fresh numbering: 1..40 name other records
    assert q.incarnation != old.incarnation
    assert held_window(endpoint, P, ctx=ctx, timeout=T) == HeldWindow(q.incarnation, 1, 41)
    with pytest.raises(DataLossError) as e:
        _read(q, 1, 31, ctx, incarnation=old.incarnation)
    text = str(e.value)
    assert repr(old.incarnation) in text and repr(q.incarnation) in text
    assert "restarted" in text


def test_renumbering_takes_a_new_incarnation_and_ends_range_flows(ctx, closing, make_client):
    """A taker resuming beyond what this process sent renumbers the held records: the
    producer takes a new incarnation, its range flows of the old one end (EOT), and a
    range planned on the old one is refused."""
    p = _producer(ctx, closing)
    _send(p, 10)
    old = p.incarnation
    conn = RangeConnection(p.endpoint, ctx=ctx, timeout=T)
    closing.append(conn)
    assert conn.held(P) == HeldWindow(old, 1, 11)
    taker = FlowEndpoint(make_client(), Role.CLIENT)
    taker.channel.connect(p.endpoint)
    attrs = {"stream": "zio", "ack": True, "resume": 100, "encoding": ["arrow"]}
    bot = taker.connect(Direction.INJECT, 4, attrs, T)
    assert p.incarnation != old and bot.attrs["incarnation"] == p.incarnation
    assert p.stats["renumbered"] == 10
    with pytest.raises(TransportError, match="ended the flow"):
        conn.held(P)
    assert held_window(p.endpoint, P, ctx=ctx, timeout=T) == HeldWindow(p.incarnation, 101, 111)
    with pytest.raises(DataLossError):
        _read(p, 1, 11, ctx, incarnation=old)
    assert [r["value"] for r in _rows(_read(p, 101, 111, ctx))] == [b"v%d" % i for i in range(10)]


# ----------------------------------------------------------------- peers that cannot


def test_a_plain_giver_is_told_apart_and_sent_nothing_but_the_bot(ctx):
    with ReferenceServer(ctx, role="giver", flavor="cpp", values=[b"a", b"b"]) as ref:
        with pytest.raises(RangesNotServed) as e:
            held_window(ref.endpoint, P, ctx=ctx, timeout=T)
        text = str(e.value)
        assert ref.endpoint in text and "spool path" in text
        with pytest.raises(RangesNotServed):
            list(read_range(ref.endpoint, P, "x", 1, 2, ctx=ctx, timeout=T))
        # Nothing but the BOT (and the EOT that ends the flow): no PAY, so no DAT.
        wait_until(lambda: len(ref.bots) == 2, what="both BOTs", timeout=T)
        assert ref.pays_received == [] and ref.sent == []
        kinds = {m.flow for how, m in ref.trace if how == "recv"}
        assert kinds <= {"BOT", "EOT"}, kinds


def test_a_producer_in_client_mode_serves_no_ranges(ctx, closing):
    p = Producer(connect="tcp://127.0.0.1:1", ctx=ctx, linger_ms=0, producer_id=P)
    closing.append(p)
    assert not p.serves_ranges and len(p.incarnation) == 32


def test_a_given_incarnation_is_stated_and_a_bad_one_refused(ctx, closing):
    p = _producer(ctx, closing, incarnation="kept.on-disk_1")
    _send(p, 3)
    assert held_window(p.endpoint, P, ctx=ctx, timeout=T) == HeldWindow("kept.on-disk_1", 1, 4)
    with pytest.raises(ConfigError, match="incarnation"):
        Producer("tcp://127.0.0.1:*", ctx=ctx, linger_ms=0, incarnation="not ok")


def test_a_silent_endpoint_is_a_bounded_transport_error(ctx):
    silent = ctx.socket(zmq.ROUTER)
    silent.linger = 0
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(TransportError) as e:
            held_window(endpoint, P, ctx=ctx, timeout=0.5)
        assert time.monotonic() - t0 < 5
        text = str(e.value)
        assert endpoint in text and "no BOT reply within 0.5 s" in text
        with pytest.raises(TransportError):
            list(read_range(endpoint, P, "x", 1, 2, ctx=ctx, timeout=0.3))
    finally:
        silent.close(0)


class _Mute(FlowHandler):
    """A giver that states the capability, then answers no request."""

    def on_bot(self, conn: ServerFlow, bot: BotReceived) -> None:
        conn.accept(None, state_capability({"producer": P, "encoding": "arrow"}, "inc-1"))


def test_a_giver_silent_after_its_bot_is_a_bounded_transport_error(ctx, make_server):
    port = make_server()
    port.bind("tcp://127.0.0.1:*")
    with FlowServer(port, _Mute, ctx=ctx) as server:
        endpoint = server.endpoint
        t0 = time.monotonic()
        with pytest.raises(TransportError) as e:
            held_window(endpoint, P, ctx=ctx, timeout=0.5)
        assert time.monotonic() - t0 < 5
        text = str(e.value)
        assert endpoint in text and "0.5 s" in text and "the held window" in text
        with pytest.raises(TransportError) as e:
            list(read_range(endpoint, P, "inc-1", 1, 3, ctx=ctx, timeout=0.3))
        assert "records [1, 3) of 'p1'" in str(e.value) and "0.3 s" in str(e.value)


def test_a_rejected_flow_says_so(ctx, closing):
    p = _producer(ctx, closing, stream="daq")
    with pytest.raises(FlowRejected, match="no stream 'other'"):
        RangeConnection(p.endpoint, ctx=ctx, timeout=T, stream="other")


# ------------------------------------------------------------------ retention on disk


def test_a_producer_on_its_retention_folder_keeps_its_incarnation_across_a_restart(
    ctx, closing, tmp_path
):
    """The folder keeps records *and* their numbers, so it names the numbering: a range
    planned on the first process (its held window) is served, byte for byte, by the
    process restarted on the same folder, on another port."""
    folder = tmp_path / "retention"
    first = _producer(ctx, closing, batch=50, retention_dir=folder)
    rows = _send(first, 300)
    window = held_window(first.endpoint, P, ctx=ctx, timeout=T)
    assert window == HeldWindow(first.incarnation, 1, 301)
    before = _rows(_read(first, 40, 260, ctx))
    first.close(flush=False, timeout=5)

    again = _producer(ctx, closing, batch=50, retention_dir=folder)
    assert again.incarnation == window.incarnation  # planned on it, still served
    after = list(read_range(again.endpoint, P, window.incarnation, 40, 260, ctx=ctx, timeout=T))
    assert _rows(after) == before == rows[39:259]
    assert held_window(again.endpoint, P, ctx=ctx, timeout=T) == window


def test_a_producer_without_retention_restarts_in_another_incarnation(ctx, closing):
    first = _producer(ctx, closing)
    _send(first, 100)
    planned = held_window(first.endpoint, P, ctx=ctx, timeout=T)
    first.close(flush=False, timeout=5)
    again = _producer(ctx, closing)
    _send(again, 200)  # numbers 1..200 again: other records under the planned numbers
    assert again.incarnation != planned.incarnation
    with pytest.raises(DataLossError, match=planned.incarnation):
        list(read_range(again.endpoint, P, planned.incarnation, 10, 60, ctx=ctx, timeout=T))


def test_an_incarnation_other_than_the_retention_folders_is_refused(ctx, closing, tmp_path):
    folder = tmp_path / "retention"
    first = _producer(ctx, closing, retention_dir=folder)
    kept = first.incarnation
    first.close(flush=False, timeout=5)
    with pytest.raises(ConfigError, match="incarnation"):
        _producer(ctx, closing, retention_dir=folder, incarnation="another-one")
    assert _producer(ctx, closing, retention_dir=folder, incarnation=kept).incarnation == kept


# A producer process on a retention folder, to be SIGKILLed (no EOT to its readers):
# argv endpoint folder; prints its endpoint once bound and its records are held.
_KILLABLE = r"""
import sys, time
from zio_spark.source.producer import Producer
deadline = time.monotonic() + 10
while True:  # the killed process's listener may still be going away
    try:
        p = Producer(sys.argv[1], producer_id="p1", linger_ms=0, retention_dir=sys.argv[2])
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
if p.last_seq == 0:
    p.send_many([b"v%d" % i for i in range(1, 101)])
print(p.endpoint, flush=True)
time.sleep(120)
"""


def _killable(endpoint: str, folder: Any) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE, endpoint, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()  # the child binds within its 10 s


def test_readers_whose_flows_outlived_a_killed_producer_are_told_at_once(ctx, tmp_path):
    """A producer SIGKILLed and restarted on its endpoint and folder (the direct read
    mode's chaos): the driver's control flow and a task's range flow, open on the killed
    process, reconnect by themselves at the socket level. The control flow saw its
    connection drop (it watches from its BOT on) and fails its next request at once; the
    range flow (it watches from its first read on) sends its request to a process where
    no flow knows it, which answers with an EOT saying so. Each fails at once (then opens
    a new flow) instead of after its whole timeout (60 s here: a driver's trigger, a
    task's read, stuck that long)."""
    folder = tmp_path / "retention"
    slow = 60.0
    first, endpoint = _killable("tcp://127.0.0.1:*", folder)
    procs = [first]
    try:
        control = ControlConnection(endpoint, ctx=ctx, timeout=slow)
        reader = RangeConnection(endpoint, ctx=ctx, timeout=slow)
        try:
            window = control.held()
            assert (window.first, window.end) == (1, 101)
            first.kill()
            first.wait(T)
            again, _ = _killable(endpoint, folder)
            procs.append(again)
            for what, call, told in (
                ("held", control.held, "connection to the producer dropped"),
                (
                    "read",
                    lambda: list(reader.read(P, window.incarnation, 1, 50)),
                    "producer restarted",
                ),
            ):
                t0 = time.monotonic()
                with pytest.raises(TransportError) as e:
                    call()
                took = time.monotonic() - t0
                assert took < T, f"{what}: told after {took:.1f} s"
                assert told in str(e.value), e.value
        finally:
            control.close()
            reader.close()
        # A new flow reads on in the same numbering (the folder's).
        with ControlConnection(endpoint, ctx=ctx, timeout=T) as fresh:
            assert fresh.held() == window
        rows = _rows(list(read_range(endpoint, P, window.incarnation, 1, 101, ctx=ctx, timeout=T)))
        assert [r["value"] for r in rows] == [b"v%d" % i for i in range(1, 101)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(T)


def test_a_reader_waiting_for_records_fails_at_once_when_its_producer_dies(ctx, tmp_path):
    """A task's range flow cut mid-read by the producer's death (SIGKILL, nothing
    restarted): the reader waits for DATs that cannot come. It watches its connection and
    fails as soon as it drops, naming what it was waiting for, instead of after its whole
    timeout (600 s here: the test's own time limit ends far sooner), so Spark retries the
    task at once."""
    proc, endpoint = _killable("tcp://127.0.0.1:*", tmp_path / "retention")
    try:
        # One record per DAT, one DAT of credit: the rest of the range stays unsent.
        reader = RangeConnection(endpoint, ctx=ctx, timeout=600.0, credit=1, batch=1)
        try:
            window = reader.held(P)
            batches = reader.read(P, window.incarnation, 1, 101)
            assert next(batches).column("seq").to_pylist() == [1]
            proc.kill()
            proc.wait(T)
            got = 1
            with pytest.raises(TransportError) as e:
                for batch in batches:  # at most what was in flight at the kill
                    got += batch.num_rows
            assert got < 100
            assert "connection to the producer dropped" in str(e.value), e.value
            assert "records [1, 101)" in str(e.value)
        finally:
            reader.close()
    finally:
        proc.kill()
        proc.wait(T)
