"""The queue's ZIO flow ports on loopback, no Spark (see zio_spark/pzq/flow_ports.py).

- PZQ producer -> queue -> zio-spark taker (the source's Receiver and a Spool): every
  message once, in store order, numbered 1, 2, 3, ...; messages leave the store only when
  the taker's PAY acks them; PZQ consumers never see them.
- The queue killed (SIGKILL) mid-flow and restarted: the taker resumes, nothing lost or
  duplicated.
- Sink side: StagingWriter + commit command -> queue -> PZQ consumer, each record once,
  repeated commits and a crash between moving a batch and acking it included.

Every wait polls with a deadline; sockets on 127.0.0.1 with random ports.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import zmq
from test_broker import (  # the queue_process fixture is shared by importing it
    monitor,
    nothing_within,
    queue_process,  # noqa: F401
    recv,
    recv_delivery,
    wait_for,
)

from tests.support import free_endpoint
from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.protocol import pzq
from zio_spark.protocol.message import join_single
from zio_spark.pzq.broker import QueueBroker
from zio_spark.pzq.flow_ports import bridge_message_id
from zio_spark.sink.client import StagingWriter, send_command
from zio_spark.sink.consumer import Consumer
from zio_spark.source.receiver import Receiver
from zio_spark.storage.flow_log import FlowLog
from zio_spark.storage.spool import Spool
from zio_spark.storage.store import MessageStore

Sock = zmq.Socket[bytes]
HEADERS = SINK_SCHEMA.field("headers").type


# ---------------------------------------------------------------------- helpers


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    s = Spool(tmp_path / "spool", sync=False)
    yield s
    s.close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.stop()
        assert r.error is None, r.error


def _receiver(
    made: list[Receiver], spool: Spool, endpoint: str, ctx: zmq.Context[Any], **kw: Any
) -> Receiver:
    r = Receiver(spool, [endpoint], ctx=ctx, **kw).start()
    made.append(r)
    return r


def _produce(producer: Sock, messages: list[tuple[bytes, list[bytes]]]) -> None:
    """Send PZQ messages and wait until the queue acked every one (durable)."""
    for mid, body in messages:
        producer.send_multipart([mid, b"", *body])
    acked = set()
    while len(acked) < len(messages):
        ack = pzq.decode_producer_ack(recv(producer))
        assert ack.ok, ack
        acked.add(ack.message_id)
    assert acked == {mid for mid, _ in messages}


class Collector:
    """Reads what the spool holds for one producer, then commits it (as Spark would)."""

    def __init__(self, spool: Spool, receiver: Receiver) -> None:
        self.spool = spool
        self.receiver = receiver
        self.rows: list[dict[str, Any]] = []
        self.next = 1

    def held(self, producer: str) -> int:
        return self.spool.next_seq(producer) - 1

    def collect(self, producer: str, commit: bool = True) -> int:
        ends = self.spool.seal()
        end = ends.get(producer, 1)
        if end > self.next:
            for b in self.spool.read(producer, self.next, end):
                self.rows.extend(b.select(["seq", "value", "key", "headers"]).to_pylist())
            self.next = end
        if commit:
            self.receiver.commit(ends)
        return len(self.rows)


def _stats(b: QueueBroker, key: str) -> int:
    return int(b.stats()[key])


# ---------------------------------------------------------------------- producer port


def test_pzq_to_zio_taker_exactly_once_with_acks(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    spool: Spool,
    receivers: list[Receiver],
) -> None:
    b = make_broker(flow_producer="tcp://127.0.0.1:*")
    assert "flow_producer" in b.endpoints and "flow_consumer" not in b.endpoints
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    n = 500
    messages = [(b"m-%04d" % i, [b"body-%04d" % i]) for i in range(n - 1)]
    messages.append((b"multi", [b"part0", b"", b"x" * 300]))  # a multi-part body
    _produce(producer, messages)

    r = _receiver(receivers, spool, b.endpoints["flow_producer"], ctx, credit=8)
    pid = f"queue:{b.queue_id.decode()}"
    col = Collector(spool, r)
    wait_for(lambda: col.held(pid) >= n, what="all messages in the spool")
    assert col.collect(pid, commit=False) == n
    assert [row["seq"] for row in col.rows] == list(range(1, n + 1))
    assert [(row["key"], row["value"]) for row in col.rows[:-1]] == [
        (mid, body[0]) for mid, body in messages[:-1]
    ]
    last = col.rows[-1]
    assert last["key"] == b"multi"
    assert last["value"] == join_single([b"part0", b"", b"x" * 300])
    assert dict(last["headers"]) == {"zio.frames": "3"}
    # Given to the flow but not acked: still in the store, and no PZQ consumer gets them.
    wait_for(lambda: _stats(b, "flow_given") == n, what="flow_given")
    assert _stats(b, "messages") == n and _stats(b, "flow_acked") == 0
    consumer = raw_socket(zmq.ROUTER)
    consumer.setsockopt(zmq.PROBE_ROUTER, 1)
    consumer.connect(b.endpoints["send"])
    assert nothing_within(consumer, 0.3)
    # Spark's commit acks them: now they leave the store.
    col.collect(pid, commit=True)
    wait_for(lambda: _stats(b, "flow_acked") == n, what="flow_acked")
    wait_for(lambda: _stats(b, "messages") == 0, what="store emptied")
    # New messages keep flowing, numbered on.
    _produce(producer, [(b"late", [b"late-body"])])
    wait_for(lambda: col.held(pid) == n + 1, what="the late message")
    col.collect(pid)
    assert (col.rows[-1]["seq"], col.rows[-1]["key"]) == (n + 1, b"late")
    mon = raw_socket(zmq.REQ)
    mon.connect(b.endpoints["monitor"])
    stats = monitor(mon)
    assert stats["flow_given"] == str(n + 1) and stats["flow_stored"] == "0"


def test_the_takers_flow_sends_a_budget_of_dats_per_loop_turn_while_the_queue_serves_producers(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    spool: Spool,
    receivers: list[Receiver],
) -> None:
    """The taker's flow (spool mode) sends at most ``taker_turn_dats`` DATs per broker
    loop turn (unbudgeted, a PAY's 64 credits went out in one turn), so a PZQ producer
    sending while a large backlog drains to the taker is acked within a few loop turns,
    and the taker still gets every message once, in order. Turns and the taker's DATs
    per turn are counted in the broker's thread, around the flow ports' ``pump`` (each
    loop turn ends with it)."""
    n, batch = 8000, 50  # 160 DATs; a PAY's credit pays for 64
    b = make_broker(flow_producer="tcp://127.0.0.1:*", sync=False)
    pid = f"queue:{b.queue_id.decode()}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, [(b"m-%05d" % i, [b"body-%05d" % i]) for i in range(n)])
    flows = b._flows
    assert flows is not None and flows.producer is not None
    port = flows.producer
    budget = port.taker_turn_dats
    assert budget * 4 <= n // batch
    per_turn: list[int] = []  # the taker's DATs per loop turn
    pump = flows.pump

    def counted(store: MessageStore) -> None:  # the broker's thread
        pump(store)
        per_turn.append(port.taker_turn_sent)

    flows.pump = counted  # type: ignore[method-assign]  # looked up every turn
    r = Receiver(spool, [b.endpoints["flow_producer"]], ctx=ctx, credit=64)
    r.batch = batch  # stated in its BOT: the port's DATs carry 50 records (many DATs)
    receivers.append(r.start())
    col = Collector(spool, r)
    # Loop turns from a PZQ send to its ack while the taker's backlog drains.
    latencies: list[tuple[int, int]] = []  # (loop turns, taker DATs) from send to ack
    deadline = time.monotonic() + 30
    i = 0
    while col.held(pid) < n:
        assert time.monotonic() < deadline, f"the taker got {col.held(pid)} of {n}"
        draining = col.held(pid) > 0
        sent_at, dats_at = len(per_turn), sum(per_turn)
        _produce(producer, [(b"p-%05d" % i, [b"late-%05d" % i])])
        if draining and col.held(pid) < n:  # draining from send to ack
            latencies.append((len(per_turn) - sent_at, sum(per_turn) - dats_at))
        i += 1
    wait_for(lambda: col.held(pid) == n + i, what="the producer's messages too")
    assert col.collect(pid) == n + i
    assert [row["seq"] for row in col.rows] == list(range(1, n + i + 1))
    assert [row["key"] for row in col.rows] == [b"m-%05d" % k for k in range(n)] + [
        b"p-%05d" % k for k in range(i)
    ]
    sending = [t for t in per_turn if t]
    # The budget held every turn, so the 160 DATs took at least 160 / budget turns,
    assert max(sending) <= budget and sum(sending) >= n // batch
    assert len(sending) >= n // batch // budget
    assert port.counters["taker_deferred"] > 0
    # and the producer's acks came within a few turns, not after the taker's credit
    # was spent: typically 2 turns and 8 taker DATs, while the drain took 40-60 turns.
    # (Its commit runs in the broker's sync thread, which the GIL shares with the
    # loop's quick turns: a few acks took 10-70 turns on the loaded 2 cores, so the
    # median is what is asserted.)
    turns, dats = [t for t, _ in latencies], [d for _, d in latencies]
    assert len(latencies) >= 3, (latencies, len(sending))
    assert statistics.median(turns) <= 3 and statistics.median(dats) <= 2 * budget, latencies
    # Spark's commit acks them all: they leave the store.
    assert r.flush_acks(10)
    wait_for(lambda: _stats(b, "flow_acked") == n + i, what="flow_acked")
    wait_for(lambda: _stats(b, "messages") == 0, what="store emptied")


def test_takers_without_ack_are_refused_and_pzq_consumers_keep_the_messages(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
) -> None:
    from zio_spark.protocol.flow import Direction, Role
    from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
    from zio_spark.transport.port import ClientPort

    b = make_broker(flow_producer="tcp://127.0.0.1:*")
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, [(b"a", [b"1"]), (b"b", [b"2"])])
    port = ClientPort(ctx, linger_ms=0)
    try:
        port.connect(b.endpoints["flow_producer"])
        with pytest.raises(FlowRejected) as e:
            FlowEndpoint(port, Role.CLIENT).connect(Direction.INJECT, 10, {}, timeout=10)
        assert "ack" in str(e.value.attrs.get("reason"))
    finally:
        port.close(linger_ms=0)
    consumer = raw_socket(zmq.ROUTER)
    consumer.setsockopt(zmq.PROBE_ROUTER, 1)
    consumer.connect(b.endpoints["send"])
    got = {recv_delivery(consumer)[1].message_id for _ in range(2)}
    assert got == {b"a", b"b"} and _stats(b, "flow_given") == 0


def test_queue_killed_mid_flow_resumes_without_loss_or_duplicate(
    queue_process: Callable[..., tuple[subprocess.Popen[bytes], dict[str, str]]],  # noqa: F811
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    spool: Spool,
    receivers: list[Receiver],
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    flow_ep = free_endpoint()
    proc, info = queue_process(store, "--flow-producer", flow_ep)
    assert info["flow_producer"] == flow_ep
    pid = f"queue:{info['queue_id']}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(info["receive"])
    first = [(b"a-%04d" % i, [b"A%04d" % i]) for i in range(400)]
    _produce(producer, first)
    # A small backlog bound keeps the flow mid-way: given, held, committed all differ.
    r = _receiver(receivers, spool, flow_ep, ctx, credit=4, max_backlog=80, connect_timeout=5)
    col = Collector(spool, r)
    wait_for(lambda: col.held(pid) >= 80, what="a first slice in the spool")
    col.collect(pid)  # Spark commits what it read: acks go out on the next PAY
    assert r.flush_acks(10)
    wait_for(lambda: col.held(pid) >= 160, what="a second slice")
    mon = raw_socket(zmq.REQ)
    mon.connect(info["monitor"])
    wait_for(lambda: monitor(mon)["flow_acked"] == "80", what="the first ack at the queue")
    stats = monitor(mon)
    assert int(stats["flow_given"]) >= 160 and int(stats["messages"]) == 400 - 80
    mon.close(linger=0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    producer.close(linger=0)

    proc, info = queue_process(store, "--flow-producer", flow_ep)
    assert f"queue:{info['queue_id']}" == pid
    producer = raw_socket(zmq.DEALER)
    producer.connect(info["receive"])
    second = [(b"b-%04d" % i, [b"B%04d" % i]) for i in range(200)]
    _produce(producer, second)
    total = len(first) + len(second)

    def progressed() -> bool:
        col.collect(pid)
        return len(col.rows) >= total

    wait_for(progressed, timeout=30, what="every message after the restart")
    assert r.stats["flow_failures"] >= 1  # it did lose the queue and come back
    assert [row["seq"] for row in col.rows] == list(range(1, total + 1))
    keys = [row["key"] for row in col.rows]
    assert sorted(keys) == sorted(mid for mid, _ in first + second)  # each exactly once
    for row in col.rows:
        assert row["value"] == row["key"][:1].upper() + row["key"][2:]
    assert r.flush_acks(10)
    mon = raw_socket(zmq.REQ)
    mon.connect(info["monitor"])
    wait_for(lambda: monitor(mon)["messages"] == "0", what="every message acked")


def test_flow_log_replay_torn_tail_and_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "flow.log"
    fl = FlowLog(path, sync=False)
    fl.assign(1, [11, 12, 13])
    fl.ack(1)
    fl.commit()
    fl.assign(4, [14])
    fl.commit()
    fl.close()
    with open(path, "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")  # a torn record
    fl = FlowLog(path, sync=False)
    assert (fl.next_seq, fl.acked, fl.assigned, fl.torn) == (5, 1, {1: 11, 2: 12, 3: 13, 4: 14}, 1)
    fl.rewrite(9, 3, [(4, 14), (7, 17), (8, 18)])
    fl.ack(4)
    fl.close()
    fl = FlowLog(path, sync=False)
    assert (fl.next_seq, fl.acked, fl.assigned, fl.torn) == (9, 4, {4: 14, 7: 17, 8: 18}, 0)
    fl.close()


# ---------------------------------------------------------------------- consumer port


def _batch(values: list[bytes], headers: list[Any] | None = None) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(values, pa.binary()),
            pa.array([b"k"] * n, pa.binary()),
            pa.array(headers, HEADERS) if headers is not None else pa.nulls(n, HEADERS),
        ],
        schema=SINK_SCHEMA,
    )


def _stage_and_commit(
    ep: str, ctx: zmq.Context[Any], stream: str, batch: int, values: list[bytes]
) -> None:
    headers: list[Any] = [None] * len(values)
    headers[-1] = [("zio.frames", "2")]
    values = [*values[:-1], join_single([b"left", b"right"])]
    rows = 0
    for part, chunk in enumerate((values[: len(values) // 2], values[len(values) // 2 :])):
        w = StagingWriter(ep, stream, batch, part, ctx=ctx, timeout=10)
        w.write_batch(_batch(chunk, headers[part * (len(values) // 2) :][: len(chunk)]))
        rows += w.close()
    assert rows == len(values)
    reply = send_command(
        ep,
        "commit",
        stream,
        batch,
        [(0, 0, len(values) // 2), (1, 0, len(values) - len(values) // 2)],
        ctx=ctx,
        timeout=10,
    )
    assert reply["result"] == "ok"


def _consume(consumer: Sock, expected: int) -> dict[bytes, tuple[bytes, ...]]:
    got: dict[bytes, tuple[bytes, ...]] = {}
    for _ in range(expected):
        queue_id, d = recv_delivery(consumer)
        assert d.message_id not in got, f"{d.message_id!r} delivered twice"
        got[d.message_id] = d.body
        consumer.send_multipart([queue_id, d.message_id, b"1"])
    return got


def _expected(stream: str, batch: int, values: list[bytes]) -> dict[bytes, tuple[bytes, ...]]:
    want = {bridge_message_id(stream, batch, i): (v,) for i, v in enumerate(values[:-1])}
    want[bridge_message_id(stream, batch, len(values) - 1)] = (b"left", b"right")
    return want


def test_sink_flow_to_pzq_consumer_once_including_repeated_commits(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    b = make_broker(flow_consumer="tcp://127.0.0.1:*")
    ep = b.endpoints["flow_consumer"]
    consumer = raw_socket(zmq.ROUTER)
    consumer.setsockopt(zmq.PROBE_ROUTER, 1)
    consumer.connect(b.endpoints["send"])
    values = [b"v-%03d" % i for i in range(100)]
    _stage_and_commit(ep, ctx, "s", 0, values)
    assert _consume(consumer, 100) == _expected("s", 0, values)
    wait_for(lambda: _stats(b, "flow_stored") == 100, what="flow_stored")
    # Spark re-delivers the batch (a retry after a failure): ok, and not stored again.
    reply = send_command(ep, "commit", "s", 0, [(0, 0, 50), (1, 0, 50)], ctx=ctx, timeout=10)
    assert reply["result"] == "ok" and reply["published"] is False
    _stage_and_commit(ep, ctx, "s", 0, values)
    # The next batch goes through; nothing of batch 0 comes again.
    _stage_and_commit(ep, ctx, "s", 1, values[:10])
    assert _consume(consumer, 10) == _expected("s", 1, values[:10])
    assert nothing_within(consumer, 0.3)
    assert _stats(b, "flow_stored") == 110
    wait_for(lambda: not list((tmp_path / "store" / "flow-consumer" / "published").glob("*/*")))


def test_a_crash_between_storing_and_acking_a_batch_stores_it_once(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    """The bridge put part of a batch into the store, the commit ended, and the queue
    died before the batch was acked in the consumer: after the restart the batch is
    moved again and the duplicate window drops what is already stored."""
    store_path = tmp_path / "store"
    values = [b"v-%03d" % i for i in range(60)]
    c = Consumer("tcp://127.0.0.1:*", store_path / "flow-consumer", ctx=ctx, linger_ms=0)
    try:
        _stage_and_commit(c.endpoint, ctx, "s", 7, values)
    finally:
        c.close()
    want = _expected("s", 7, values)
    with MessageStore(store_path, sync=False) as st:
        for mid in list(want)[:25]:
            assert st.put(mid, want[mid]) is not None
        st.commit()
    b = make_broker(store_path, flow_consumer="tcp://127.0.0.1:*")
    consumer = raw_socket(zmq.ROUTER)
    consumer.setsockopt(zmq.PROBE_ROUTER, 1)
    consumer.connect(b.endpoints["send"])
    assert _consume(consumer, 60) == want
    assert nothing_within(consumer, 0.3)
    wait_for(lambda: _stats(b, "flow_stored") == 35, what="flow_stored")
