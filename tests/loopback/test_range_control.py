"""The driver's control flow on loopback: held queries and commit acks in direct mode.

A bound :class:`Producer` serves ``read: "control"`` flows
(:mod:`zio_spark.source.range_serving`); :class:`ControlConnection`
(:mod:`zio_spark.source.range_client`) is the driver's side. Tasks read ranges and never
ack; the control flow's ``ack`` (with the incarnation it was committed in) frees records
through the backlog's own release path, on disk too with ``retention_dir``. Covered: the
window after an ack, data loss below it, monotonic re-acks, an ack beyond the end (the
flow ends with the reason), an ack of another incarnation (nothing freed), the folder
after an ack and a restart on it, a spool-mode taker next to a control flow, its
renumbering ending the control flow, and a peer without the capability. Every socket is
on 127.0.0.1 with a random port, the ``ctx`` fixture fails on a leaked socket, and every
wait polls a condition with a deadline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zio_spark.source.backlog as backlog_module
from tests.peers.zio_reference import ReferenceServer
from tests.support import wait_until
from zio_spark.errors import DataLossError, LocalProtocolError, TransportError
from zio_spark.protocol.flow import Direction, Role
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import (
    AckRefused,
    ControlConnection,
    HeldWindow,
    RangesNotServed,
    held_window,
    read_range,
)
from zio_spark.source.receiver import Receiver
from zio_spark.storage.retention import RetentionLog
from zio_spark.storage.spool import Spool
from zio_spark.transport.flow_endpoint import FlowEndpoint

T = 10.0  # seconds any one wait may last (returns as soon as it can)
P = "p1"


def _producer(ctx: Any, closing: list[Any], **kw: Any) -> Producer:
    kw.setdefault("producer_id", P)
    p = Producer("tcp://127.0.0.1:*", ctx=ctx, linger_ms=0, **kw)
    closing.append(p)
    return p


def _control(p: Producer, ctx: Any, closing: list[Any]) -> ControlConnection:
    c = ControlConnection(p.endpoint, ctx=ctx, timeout=T)
    closing.append(c)
    return c


def _send(p: Producer, n: int, first: int = 0, batches: int = 1) -> list[tuple[int, bytes]]:
    """Queue ``n`` records in ``batches`` sends; returns ``(seq, value)`` of each."""
    out: list[tuple[int, bytes]] = []
    per = n // batches
    for b in range(batches):
        values = [b"v%d" % i for i in range(first + b * per, first + (b + 1) * per)]
        last = p.send_many(values)
        out += [(last - len(values) + 1 + j, v) for j, v in enumerate(values)]
    return out


def _read(p: Producer, start: int, end: int, ctx: Any, inc: str | None = None) -> list:
    batches = read_range(p.endpoint, P, inc or p.incarnation, start, end, ctx=ctx, timeout=T)
    return [(r["seq"], r["value"]) for b in batches for r in b.to_pylist()]


def _segments(folder: Path) -> list[str]:
    return sorted(x.name for x in folder.glob("*.seg"))


def test_a_commit_ack_frees_what_tasks_read_and_nothing_else(ctx, closing):
    p = _producer(ctx, closing, batch=50)
    rows = _send(p, 300)
    c = _control(p, ctx, closing)
    inc = p.incarnation
    assert (c.incarnation, c.producer) == (inc, P)
    assert c.held() == HeldWindow(inc, 1, 301)
    # Two tasks read their ranges; reads free nothing.
    assert _read(p, 1, 151, ctx) + _read(p, 151, 301, ctx) == rows
    assert p.acked == 0 and p.pending == 300
    # The commit of the batch that read up to K = 150.
    k = 150
    assert c.ack(k, inc) == HeldWindow(inc, k + 1, 301)
    assert p.acked == k and p.pending == 300 - k
    assert p.delivery().acked == k  # what the wire acknowledged, as a taker's acks
    assert held_window(p.endpoint, P, ctx=ctx, timeout=T) == HeldWindow(inc, k + 1, 301)
    with pytest.raises(DataLossError, match=r"\[100, 200\)"):
        _read(p, 100, 200, ctx)
    assert _read(p, k + 1, 301, ctx) == rows[k:]
    # Re-acks (a restarted driver re-acks its last commit, a late older one): no-ops.
    assert c.ack(k, inc) == HeldWindow(inc, k + 1, 301)
    assert c.ack(3, inc) == HeldWindow(inc, k + 1, 301)
    assert c.ack(0, inc) == HeldWindow(inc, k + 1, 301)
    assert p.acked == k and p.delivery().acked == k
    # The control flow is no taker: no taker came or was replaced, nothing renumbered.
    assert p.stats["takers"] == 0 and p.stats["control_flows"] == 1
    assert p.stats["control_acks"] == 4 and p.stats.get("incarnations", 0) == 0
    # A control flow reads no range (refused locally, nothing sent).
    with pytest.raises(LocalProtocolError):
        c.read(P, inc, k + 1, 301)
    # The last record can be acked; one beyond it ends the flow with a reason naming both.
    assert c.ack(300, inc) == HeldWindow(inc, 301, 301)
    with pytest.raises(TransportError) as e:
        c.ack(301, inc)
    text = str(e.value)
    assert "ack 301" in text and "last record is 300" in text and p.endpoint in text
    assert p.acked == 300 and p.pending == 0


def test_an_ack_beyond_the_end_frees_nothing(ctx, closing):
    p = _producer(ctx, closing)
    _send(p, 20)
    c = _control(p, ctx, closing)
    with pytest.raises(TransportError, match="beyond the producer's end"):
        c.ack(25, p.incarnation)
    assert p.acked == 0 and p.pending == 20
    wait_until(lambda: not p._ranges.flows, what="the control flow dropped", timeout=T)
    assert held_window(p.endpoint, P, ctx=ctx, timeout=T) == HeldWindow(p.incarnation, 1, 21)


def test_an_ack_of_another_incarnation_frees_nothing(ctx, closing):
    """A producer restarted without retention numbers from 1 again: the old commit's
    numbers name its new records, so the ack is refused and frees nothing."""
    old = _producer(ctx, closing)
    _send(old, 100)
    planned = held_window(old.endpoint, P, ctx=ctx, timeout=T)
    old.close(flush=False, timeout=5)
    new = _producer(ctx, closing)
    rows = _send(new, 200, first=1000)
    assert new.incarnation != planned.incarnation
    c = _control(new, ctx, closing)
    with pytest.raises(AckRefused) as e:
        c.ack(80, planned.incarnation)
    assert e.value.window == HeldWindow(new.incarnation, 1, 201)
    text = str(e.value)
    assert repr(planned.incarnation) in text and repr(new.incarnation) in text
    assert new.acked == 0 and new.pending == 200
    assert new.stats["control_acks_refused"] == 1
    assert _read(new, 1, 201, ctx) == rows
    # The flow stays open: a commit of its own incarnation is applied.
    assert c.ack(10, new.incarnation) == HeldWindow(new.incarnation, 11, 201)


def test_with_retention_an_ack_releases_the_folder_and_a_restart_starts_after_it(
    ctx, closing, tmp_path, monkeypatch
):
    class SmallSegments(RetentionLog):
        def __init__(self, *a: Any, **kw: Any) -> None:
            kw.setdefault("segment_bytes", 1024)
            super().__init__(*a, **kw)

    monkeypatch.setattr(backlog_module, "RetentionLog", SmallSegments)
    folder = tmp_path / "retention"
    first = _producer(ctx, closing, batch=50, retention_dir=folder)
    rows = _send(first, 1000, batches=20)
    before = _segments(folder)
    assert len(before) >= 5
    inc = first.incarnation
    c = _control(first, ctx, closing)
    k = 520
    assert c.ack(k, inc) == HeldWindow(inc, k + 1, 1001)
    wait_until(lambda: len(_segments(folder)) < len(before), what="segments released", timeout=T)
    assert first.acked == k and first.delivery().acked == k
    released = set(before) - set(_segments(folder))
    assert released and _segments(folder)  # the front went, the rest is kept
    c.close()
    first.close(flush=False, timeout=5)

    again = _producer(ctx, closing, batch=50, retention_dir=folder)
    assert again.incarnation == inc
    assert held_window(again.endpoint, P, ctx=ctx, timeout=T) == HeldWindow(inc, k + 1, 1001)
    assert _read(again, k + 1, 1001, ctx) == rows[k:]
    # The driver, restarted too, re-acks its last commit on the new process: a no-op.
    c2 = _control(again, ctx, closing)
    assert c2.ack(k, inc) == HeldWindow(inc, k + 1, 1001)
    assert c2.ack(1000, inc) == HeldWindow(inc, 1001, 1001)
    wait_until(lambda: not _segments(folder), what="every segment released", timeout=T)


def test_a_spool_taker_next_to_a_control_flow_keeps_working(ctx, closing, tmp_path):
    """A mixed deployment: a spool-mode receiver is the taker of the producer, a control
    flow acks too. Freeing is monotonic, so acks from both free up to the larger."""
    spool = Spool(tmp_path / "spool", sync=False)
    closing.append(spool)
    p = _producer(ctx, closing, batch=50)
    _send(p, 500)
    r = Receiver(spool, [p.endpoint], ctx=ctx, credit=4).start()
    closing.append(r)
    c = _control(p, ctx, closing)
    inc = p.incarnation
    wait_until(lambda: spool.next_seq(P) == 501, what="all records in the spool", timeout=30)
    assert c.ack(100, inc) == HeldWindow(inc, 101, 501)
    r.commit({P: 301})  # the receiver's commit acks up to 300 on its taker flow
    wait_until(lambda: p.acked == 300, what="the taker's ack", timeout=T)
    assert c.ack(200, inc) == HeldWindow(inc, 301, 501)  # below: a no-op
    assert p.acked == 300
    _send(p, 100, first=500)
    wait_until(lambda: spool.next_seq(P) == 601, what="more records in the spool", timeout=30)
    assert c.ack(550, inc) == HeldWindow(inc, 551, 601)
    (st,) = r.status()
    assert st.state == "receiving" and (st.records, st.duplicates, st.failures) == (600, 0, 0)
    assert p.stats["takers"] == 1 and p.stats.get("takers_replaced", 0) == 0
    assert c.held() == HeldWindow(inc, 551, 601)


def test_a_plain_giver_is_not_sent_a_commit(ctx):
    with ReferenceServer(ctx, role="giver", flavor="cpp", values=[b"a"]) as ref:
        with pytest.raises(RangesNotServed) as e:
            ControlConnection(ref.endpoint, ctx=ctx, timeout=T)
        assert ref.endpoint in str(e.value)
        wait_until(lambda: len(ref.bots) == 1, what="the BOT", timeout=T)
        assert ref.pays_received == [] and ref.sent == []


def test_renumbering_ends_the_control_flow_and_old_commits_are_refused(ctx, closing, make_client):
    """A spool taker resuming beyond what this process sent renumbers the held records:
    the control flow of the old incarnation ends, and a commit of the old numbers on a
    new control flow frees nothing."""
    p = _producer(ctx, closing)
    _send(p, 10)
    old = p.incarnation
    c = _control(p, ctx, closing)
    assert c.held() == HeldWindow(old, 1, 11)
    taker = FlowEndpoint(make_client(), Role.CLIENT)
    taker.channel.connect(p.endpoint)
    attrs = {"stream": "zio", "ack": True, "resume": 100, "encoding": ["arrow"]}
    taker.connect(Direction.INJECT, 4, attrs, T)
    assert p.incarnation != old
    with pytest.raises(TransportError, match="ended the flow"):
        c.ack(5, old)
    c2 = _control(p, ctx, closing)
    with pytest.raises(AckRefused):
        c2.ack(105, old)
    assert p.acked == 100 and p.pending == 10
    assert c2.ack(105, p.incarnation) == HeldWindow(p.incarnation, 106, 111)
    taker.send_eot(timeout=T)  # ended as a taker does (else closing waits out its echo)


def test_a_held_answer_says_whether_the_window_held_sends_back(ctx, closing):
    """``full`` in a held answer: a send waited for room in the window since this control
    flow's previous held answer, or waits now (the planner then settles batch sizes at
    half the window, ``direct.settled_end``)."""
    import threading

    p = _producer(ctx, closing, max_unacked=100)
    _send(p, 100)  # exactly the window: nothing waited
    c = _control(p, ctx, closing)
    inc = p.incarnation
    assert c.held() == HeldWindow(inc, 1, 101, False)
    sent: list[int] = []
    sender = threading.Thread(target=lambda: sent.append(p.send_many([b"w"] * 10, timeout=T)))
    sender.start()
    try:
        wait_until(lambda: p.window_full, what="the send waiting for room", timeout=T)
        assert c.held() == HeldWindow(inc, 1, 101, True)
        assert c.held().full  # still waiting: still full
        c.ack(50, inc)  # room for the 10: the send completes
        wait_until(lambda: sent, what="the waiting send done", timeout=T)
    finally:
        sender.join(T)
    # That wait was told while it went on; no send waited since: not full.
    assert c.held() == HeldWindow(inc, 51, 111, False)
    # A wait that began and ended between two answers is told once.
    sent.clear()
    sender = threading.Thread(target=lambda: sent.append(p.send_many([b"x"] * 50, timeout=T)))
    sender.start()
    try:
        wait_until(lambda: p.window_full, what="a second wait", timeout=T)
        c.ack(110, inc)
        wait_until(lambda: sent, what="the second send done", timeout=T)
    finally:
        sender.join(T)
    assert c.held() == HeldWindow(inc, 111, 161, True)
    assert c.held() == HeldWindow(inc, 111, 161, False)
    # Another control flow learns of the waits it did not see once, then not again.
    other = _control(p, ctx, closing)
    assert other.held().full and not other.held().full
