"""The queue's flow producer port serves direct reads from its store (issue #26, req. 4).

PZQ producers put messages into the queue; the port numbers them into its side log
(``seq -> store key``, under the side log's incarnation) when the driver's control flow
asks for the held window, and range flows read them back from the store by key
(:mod:`zio_spark.pzq.flow_ports`, docs/direct-read.md "The queue's flow producer").
Covered: ranges and held answers from the store (no body kept in memory), commit acks
deleting exactly up to the ack (monotonic, another incarnation frees nothing, beyond the
end refused), a range planned before a queue SIGKILL served byte for byte after the
restart, a lost side log making a new incarnation (the old ranges refused, never other
data), a lost store record refused, and the side log's incarnation record. Every socket
is on 127.0.0.1 with a random port; every wait polls with a deadline.
"""

from __future__ import annotations

import gc
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_broker import (  # the queue_process fixture is shared by importing it
    monitor,
    nothing_within,
    queue_process,  # noqa: F401
    wait_for,
)
from test_flow_ports import _produce

from tests.support import flip_byte, free_endpoint
from zio_spark.errors import DataLossError, TransportError
from zio_spark.protocol.message import join_single
from zio_spark.pzq.broker import QueueBroker
from zio_spark.pzq.flow_ports import FlowProducerPort
from zio_spark.source.range_client import (
    AckRefused,
    ControlConnection,
    HeldWindow,
    held_window,
    read_range,
)
from zio_spark.storage import flow_log
from zio_spark.storage.files import frame
from zio_spark.storage.flow_log import FlowLog
from zio_spark.storage.store import MessageStore

Sock = zmq.Socket[bytes]
T = 10.0  # seconds any one wait may last (returns as soon as it can)


def _messages(prefix: bytes, n: int) -> list[tuple[bytes, list[bytes]]]:
    return [(b"%s-%04d" % (prefix, i), [b"%s-body-%04d" % (prefix, i) * 3]) for i in range(n)]


def _read(endpoint: str, producer: str, inc: str, start: int, end: int, ctx: Any) -> list:
    batches = read_range(endpoint, producer, inc, start, end, ctx=ctx, timeout=T)
    return [(r["seq"], r["key"], r["value"], r["headers"]) for b in batches for r in b.to_pylist()]


def _port(b: QueueBroker) -> FlowProducerPort:
    flows = b._flows
    assert flows is not None and flows.producer is not None
    return flows.producer


def _stat(b: QueueBroker, key: str) -> int:
    return int(b.stats()[key])


def test_the_queue_serves_held_windows_and_ranges_from_its_store(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    closing: list[Any],
) -> None:
    b = make_broker(flow_producer="tcp://127.0.0.1:*")
    ep = b.endpoints["flow_producer"]
    pid = f"queue:{b.queue_id.decode()}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    messages = _messages(b"a", 299)
    messages.append((b"multi", [b"part0", b"", b"x" * 300]))  # a multi-part body
    _produce(producer, messages)
    port = _port(b)

    control = ControlConnection(ep, ctx=ctx, timeout=T)
    closing.append(control)
    inc = control.incarnation
    assert control.producer == pid and inc == port.incarnation
    # Nothing was numbered before the held query: it numbers what the store has ready.
    assert control.held() == HeldWindow(inc, 1, 301)
    # Ranges in the port's numbering, read back from the store in store order.
    got = _read(ep, pid, inc, 1, 151, ctx) + _read(ep, pid, inc, 151, 301, ctx)
    assert [g[0] for g in got] == list(range(1, 301))
    assert [(k, v) for _, k, v, _ in got[:-1]] == [(mid, body[0]) for mid, body in messages[:-1]]
    assert got[-1][1:3] == (b"multi", join_single([b"part0", b"", b"x" * 300]))
    assert dict(got[-1][3]) == {"zio.frames": "3"}
    # A retried task gets the same bytes; a read frees nothing and keeps no body in memory.
    assert _read(ep, pid, inc, 40, 260, ctx) == got[39:259]
    assert not port._held
    wait_for(lambda: _stat(b, "flow_given") == 300, what="flow_given")
    assert _stat(b, "messages") == 300 and _stat(b, "flow_acked") == 0
    # Later messages: the next held query numbers them on.
    _produce(producer, _messages(b"b", 20))
    assert control.held() == HeldWindow(inc, 1, 321)
    late = _read(ep, pid, inc, 301, 321, ctx)
    assert [(s, k) for s, k, _, _ in late] == [(301 + i, b"b-%04d" % i) for i in range(20)]
    # Beyond the end and another incarnation: data loss, never a wait or other data.
    with pytest.raises(DataLossError, match="321"):
        _read(ep, pid, inc, 300, 322, ctx)
    with pytest.raises(DataLossError, match="incarnation"):
        _read(ep, pid, "another-one", 1, 10, ctx)
    assert port.range_stats["range_flows"] >= 6 and port.range_stats["control_flows"] == 1
    # Assigned to the flow: a PZQ consumer does not get them (it would get messages not
    # numbered yet: the flow takes from the store only when a held query asks).
    consumer = raw_socket(zmq.ROUTER)
    consumer.setsockopt(zmq.PROBE_ROUTER, 1)
    consumer.connect(b.endpoints["send"])
    assert nothing_within(consumer, 0.3)


def test_a_held_answer_is_full_while_the_window_leaves_messages_in_the_store(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    closing: list[Any],
) -> None:
    """The queue's held end is its window's when the store holds more than the window
    numbers: the answer says ``full`` then (the planner settles its batches at half the
    window), and not once the store's messages all fit."""
    b = make_broker(flow_producer="tcp://127.0.0.1:*", flow_window=100)
    ep = b.endpoints["flow_producer"]
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, _messages(b"a", 150))
    control = ControlConnection(ep, ctx=ctx, timeout=T)
    closing.append(control)
    inc = control.incarnation
    assert control.held() == HeldWindow(inc, 1, 101, True)  # 50 left in the store
    control.ack(40, inc)
    assert control.held() == HeldWindow(inc, 41, 141, True)  # 10 still left
    control.ack(100, inc)
    assert control.held() == HeldWindow(inc, 101, 151, False)  # all fit: not full


def test_commit_acks_delete_exactly_up_to_the_ack(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    closing: list[Any],
) -> None:
    b = make_broker(flow_producer="tcp://127.0.0.1:*")
    ep = b.endpoints["flow_producer"]
    pid = f"queue:{b.queue_id.decode()}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, _messages(b"a", 200))
    control = ControlConnection(ep, ctx=ctx, timeout=T)
    closing.append(control)
    inc = control.incarnation
    assert control.held() == HeldWindow(inc, 1, 201)
    rows = _read(ep, pid, inc, 1, 201, ctx)

    assert control.ack(120, inc) == HeldWindow(inc, 121, 201)
    wait_for(lambda: _stat(b, "messages") == 80, what="120 messages deleted")
    assert _stat(b, "flow_acked") == 120 and _port(b).acked == 120
    # The store holds exactly the unacked ones: 121..200.
    left = {mid for mid, _ in _port(b).store.iter_messages()}
    assert left == {r[1] for r in rows[120:]}
    with pytest.raises(DataLossError, match=r"\[100, 130\)"):
        _read(ep, pid, inc, 100, 130, ctx)
    assert _read(ep, pid, inc, 121, 201, ctx) == rows[120:]
    # Monotonic: older or repeated commits are no-ops.
    assert control.ack(120, inc) == HeldWindow(inc, 121, 201)
    assert control.ack(7, inc) == HeldWindow(inc, 121, 201)
    # Another incarnation frees nothing; the flow goes on.
    with pytest.raises(AckRefused):
        control.ack(150, "not-this-numbering")
    assert control.held() == HeldWindow(inc, 121, 201)
    assert _stat(b, "flow_acked") == 120
    # The last record can be acked; one beyond ends the flow, naming both numbers.
    assert control.ack(200, inc) == HeldWindow(inc, 201, 201)
    wait_for(lambda: _stat(b, "messages") == 0, what="every message deleted")
    with pytest.raises(TransportError) as e:
        control.ack(201, inc)
    assert "ack 201" in str(e.value) and "last record is 200" in str(e.value)
    assert _stat(b, "flow_acked") == 200


def test_a_range_planned_before_a_queue_sigkill_is_served_byte_for_byte_after_it(
    queue_process: Callable[..., tuple[subprocess.Popen[bytes], dict[str, str]]],  # noqa: F811
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    ep = free_endpoint()
    proc, info = queue_process(store, "--flow-producer", ep)
    pid = f"queue:{info['queue_id']}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(info["receive"])
    _produce(producer, _messages(b"a", 400))
    # The driver plans on the held window; one task reads, one commit is applied.
    planned = held_window(ep, pid, ctx=ctx, timeout=T)
    assert (planned.first, planned.end) == (1, 401)
    before = _read(ep, pid, planned.incarnation, 1, 401, ctx)
    with ControlConnection(ep, ctx=ctx, timeout=T) as control:
        assert control.ack(100, planned.incarnation).first == 101
    producer.close(linger=0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    proc, info = queue_process(store, "--flow-producer", ep)
    assert f"queue:{info['queue_id']}" == pid
    inc = planned.incarnation
    # Same numbering, same name: the ranges planned before are served byte for byte.
    assert held_window(ep, pid, ctx=ctx, timeout=T) == HeldWindow(inc, 101, 401)
    assert _read(ep, pid, inc, 101, 401, ctx) == before[100:]
    assert _read(ep, pid, inc, 250, 260, ctx) == before[249:259]
    with pytest.raises(DataLossError):  # acked before the kill: gone for good
        _read(ep, pid, inc, 50, 150, ctx)
    # New messages are numbered on; acks go on deleting exactly up to them.
    producer = raw_socket(zmq.DEALER)
    producer.connect(info["receive"])
    _produce(producer, _messages(b"b", 50))
    with ControlConnection(ep, ctx=ctx, timeout=T) as control:
        assert control.held() == HeldWindow(inc, 101, 451)
        after = _read(ep, pid, inc, 401, 451, ctx)
        assert [r[1] for r in after] == [b"b-%04d" % i for i in range(50)]
        assert control.ack(300, inc) == HeldWindow(inc, 301, 451)
        mon = raw_socket(zmq.REQ)
        mon.connect(info["monitor"])
        wait_for(lambda: monitor(mon)["messages"] == "150", what="acks up to 300 applied")


def test_a_control_flow_that_outlived_a_killed_queue_is_told_at_once(
    queue_process: Callable[..., tuple[subprocess.Popen[bytes], dict[str, str]]],  # noqa: F811
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    """After a queue SIGKILL and restart on its endpoint the driver's socket reconnects
    by itself. Its next request fails at once, instead of after its whole timeout (60 s
    here: the error would then say "no DAT within"), so the driver reopens: the control
    flow saw its connection drop (it watches from its BOT on). (Had it not, the request
    would reach a queue process that knows no flow of it, which answers with an EOT: a
    range flow's case, tests/loopback/test_range_reads.py.)"""
    store = tmp_path / "store"
    ep = free_endpoint()
    proc, info = queue_process(store, "--flow-producer", ep)
    pid = f"queue:{info['queue_id']}"
    with ControlConnection(ep, ctx=ctx, timeout=60) as control:
        inc = control.held(pid).incarnation
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        queue_process(store, "--flow-producer", ep)
        t0 = time.monotonic()
        with pytest.raises(TransportError) as info_:
            control.held(pid)
        assert time.monotonic() - t0 < T
        assert "connection to the producer dropped" in str(info_.value), str(info_.value)
    assert held_window(ep, pid, ctx=ctx, timeout=T).incarnation == inc


def test_a_read_cut_by_a_queue_sigkill_fails_bounded_and_its_retry_gets_the_same_bytes(
    queue_process: Callable[..., tuple[subprocess.Popen[bytes], dict[str, str]]],  # noqa: F811
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    """A task reading when the queue dies: a TransportError within its timeout naming the
    endpoint (never a hang, never a short range taken as whole); its retry on the
    restarted queue gets exactly the rows of a read before the kill."""
    store = tmp_path / "store"
    ep = free_endpoint()
    proc, info = queue_process(store, "--flow-producer", ep)
    pid = f"queue:{info['queue_id']}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(info["receive"])
    _produce(producer, _messages(b"a", 1000))
    producer.close(linger=0)
    planned = held_window(ep, pid, ctx=ctx, timeout=T)
    whole = _read(ep, pid, planned.incarnation, 1, 1001, ctx)
    # Little credit and small DATs: the giver is far from the end when the queue dies.
    batches = read_range(
        ep, pid, planned.incarnation, 1, 1001, ctx=ctx, timeout=3.0, credit=2, batch=50
    )
    try:
        first = next(batches)
        assert first.num_rows <= 50 and first.column("seq")[0].as_py() == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with pytest.raises(TransportError) as e:
            for _ in batches:
                pass
        assert ep in str(e.value)
    finally:
        batches.close()
    queue_process(store, "--flow-producer", ep)
    assert _read(ep, pid, planned.incarnation, 1, 1001, ctx) == whole


def test_a_lost_side_log_is_another_incarnation_and_old_ranges_are_refused(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    b = make_broker(store, flow_producer="tcp://127.0.0.1:*")
    ep = b.endpoints["flow_producer"]
    pid = f"queue:{b.queue_id.decode()}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, _messages(b"a", 30))
    planned = held_window(ep, pid, ctx=ctx, timeout=T)
    b.stop()
    (store / "flow-producer.log").unlink()  # the numbering is gone with it

    b = make_broker(store, flow_producer="tcp://127.0.0.1:*")
    ep = b.endpoints["flow_producer"]
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, _messages(b"b", 10))
    now = held_window(ep, pid, ctx=ctx, timeout=T)
    assert now.incarnation != planned.incarnation
    assert (now.first, now.end) == (1, 41)  # renumbered from 1: the same seqs, other data
    with pytest.raises(DataLossError) as e:
        _read(ep, pid, planned.incarnation, 1, 31, ctx)
    assert planned.incarnation in str(e.value) and now.incarnation in str(e.value)
    assert len(_read(ep, pid, now.incarnation, 1, 41, ctx)) == 40


def test_a_store_record_lost_under_a_range_refuses_the_range(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
) -> None:
    b = make_broker(flow_producer="tcp://127.0.0.1:*")
    ep = b.endpoints["flow_producer"]
    pid = f"queue:{b.queue_id.decode()}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    _produce(producer, _messages(b"a", 20))
    inc = held_window(ep, pid, ctx=ctx, timeout=T).incarnation
    good = _read(ep, pid, inc, 1, 21, ctx)
    # Damage seq 12's record on disk (its CRC fails): the store cannot give it back.
    port = _port(b)
    key = port._table[12]
    seg = port.store._index.segments[key >> 32]
    offset = seg.offsets[key & 0xFFFFFFFF] + 12
    flip_byte(seg.path, offset)
    with pytest.raises(DataLossError, match=r"\[1, 21\)"):
        _read(ep, pid, inc, 1, 21, ctx)
    # What lies on either side of the hole is still served as before.
    assert _read(ep, pid, inc, 1, 12, ctx) == good[:11]
    assert _read(ep, pid, inc, 13, 21, ctx) == good[12:]
    assert port.counters["lost"] == 1


def test_the_side_log_keeps_its_incarnation(tmp_path: Path) -> None:
    path = tmp_path / "flow.log"
    fl = FlowLog(path, sync=False)
    inc = fl.incarnation
    fl.assign(1, [11, 12, 13])
    fl.close()
    fl = FlowLog(path, sync=False)
    assert fl.incarnation == inc and fl.assigned == {1: 11, 2: 12, 3: 13}
    fl.rewrite(4, 1, [(2, 12), (3, 13)])
    fl.close()
    fl = FlowLog(path, sync=False)
    assert (fl.incarnation, fl.next_seq, fl.acked) == (inc, 4, 1)
    fl.close()
    # A log written before incarnations (BASE and ASSIGN only) keeps its numbering and
    # gets a name at its first open, the same at the next.
    old = [flow_log._BASE.pack(0, 3, 0), flow_log._ASSIGN.pack(1, 1, 2) + bytes(16)]
    legacy = tmp_path / "legacy.log"
    legacy.write_bytes(b"".join(frame(p) + p for p in old))
    fl = FlowLog(legacy, sync=False)
    named = fl.incarnation
    assert named and fl.assigned == {1: 0, 2: 0} and fl.next_seq == 3
    fl.close()
    fl = FlowLog(legacy, sync=False)
    assert fl.incarnation == named and fl.torn == 0
    fl.close()
    # An empty file starts a numbering from 1 again: another incarnation.
    path.write_bytes(b"")
    fl = FlowLog(path, sync=False)
    assert fl.incarnation != inc and fl.next_seq == 1
    fl.close()


def test_a_held_query_numbers_a_slice_per_loop_turn_and_other_flows_are_served_meanwhile(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """The held query numbers at most ``held_slice`` store messages per loop turn, so a
    large window does not stop the broker: a task's range read of messages numbered
    before is served in full while the numbering is still going on (from the port's
    state: a turn runs only when a client's message is in, and the task's read needs
    far fewer turns than the numbering). The test is the port's loop, turn by turn, as
    the broker's thread runs it (``process`` when the socket is readable, ``pump``)."""
    slice_, before, more = 50, 100, 2000
    with MessageStore(tmp_path / "store", sync=False) as store:
        for i in range(before + more):
            store.put(b"m-%05d" % i, (b"body-%05d" % i,))
            if i == before - 1:
                store.commit()
        port = FlowProducerPort(
            store, "tcp://127.0.0.1:*", ctx=ctx, sync=False, held_slice=slice_, linger_ms=0
        )
        try:
            ep, pid, inc = port.endpoint, port.producer_id, port.incarnation
            while not port.prepare_held():  # what a first held query numbered
                port.pump()
            assert port.last_seq == before
            store.commit()  # the rest becomes ready: the next held query numbers it
            log_path = store.path / "flow-producer.log"
            log_size = log_path.stat().st_size
            numbered = [port.last_seq]
            poller = zmq.Poller()
            poller.register(port.socket, zmq.POLLIN)

            def turn(wait_ms: int, *, on_input_only: bool = False) -> None:
                """One loop turn of the broker's thread (``on_input_only``: none
                unless a client's message came within ``wait_ms``)."""
                if poller.poll(wait_ms):
                    port.process()
                elif on_input_only:
                    return
                port.pump()
                numbered.append(port.numbered)

            results: dict[str, Any] = {}

            def client(name: str, fn: Callable[[], Any]) -> threading.Thread:
                def run() -> None:
                    try:
                        results[name] = fn()
                    except BaseException as e:  # the test reports it
                        results[name] = e

                t = threading.Thread(target=run, name=f"client-{name}", daemon=True)
                t.start()
                return t

            def held() -> HeldWindow:
                with ControlConnection(ep, ctx=ctx, timeout=T) as control:
                    return control.held()

            a = client("held", held)
            deadline = time.monotonic() + T
            while port.numbered == before:  # A's BOT, then its held query numbering
                assert time.monotonic() < deadline, "the held query never came"
                turn(100, on_input_only=True)
            assert before < port.numbered <= before + 2 * slice_
            b = client("range", lambda: _read(ep, pid, inc, 1, before + 1, ctx))
            while b.is_alive():  # a turn only when the task's (or A's) input is in
                assert time.monotonic() < deadline, "the range read was not served"
                turn(100, on_input_only=True)
                b.join(0.001)
            rows = results["range"]
            assert not isinstance(rows, BaseException), rows
            assert [r[1] for r in rows] == [b"m-%05d" % i for i in range(before)]
            # Served in full while the held query's numbering was still going on.
            assert port.numbered < before + more and a.is_alive() and "held" not in results
            # What the slices numbered so far is shown to nobody (the window still ends
            # at the last answer's) and not yet in the side log: one sync at the end.
            assert port.numbered > before and (port.last_seq, port.next_seq) == (
                before,
                before + 1,
            )
            assert log_path.stat().st_size == log_size
            while a.is_alive():
                assert time.monotonic() < deadline, "the held query was never answered"
                turn(1)
                a.join(0.001)
            assert results["held"] == HeldWindow(inc, 1, before + more + 1)
            assert FlowLog(log_path, sync=False).next_seq == before + more + 1
            steps = [y - x for x, y in itertools.pairwise(numbered)]
            assert max(steps) <= slice_ and len(steps) >= more // slice_, steps
        finally:
            port.close()


def test_records_mix_bodies_held_for_a_taker_and_read_back_from_the_store(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """The port's records for a DAT come from memory (assigned for a taker) and from the
    store a run at a time (assigned for a held query), in seq order; a byte budget
    stops them (at least one record), and a damaged record ends them before it."""
    with MessageStore(tmp_path / "store", sync=False) as store:
        for i in range(30):
            store.put(b"m-%02d" % i, (b"v-%02d" % i,) if i != 7 else (b"a", b"", b"bc"))
        store.commit()
        port = FlowProducerPort(store, "tcp://127.0.0.1:*", ctx=ctx, sync=False, linger_ms=0)
        try:
            assert port._assign(10, keep_body=False) == 10  # seqs 1..10: a held query's
            assert port._assign(10) == 10  # 11..20: a taker's, bodies in memory
            assert port._assign(10, keep_body=False) == 10  # 21..30
            taken = port._view.take(1, 30)
            assert taken is not None and taken.first == 1
            assert taken.keys == [b"m-%02d" % i for i in range(30)]
            assert taken.values[7] == join_single([b"a", b"", b"bc"])
            assert [v for i, v in enumerate(taken.values) if i != 7] == [
                b"v-%02d" % i for i in range(30) if i != 7
            ]
            assert taken.headers is not None and dict(taken.headers[7] or {}) == {"zio.frames": "3"}
            budget = port._view.take(1, 30, max_bytes=20)
            assert budget is not None and len(budget.values) == 5  # 4-byte values
            one = port._view.take(9, 30, max_bytes=1)
            assert one is not None and one.values == [b"v-08"]
            # Seq 25's record damaged on disk: a DAT stops before it; asked for, a hole.
            key = port._table[25]
            seg = store._index.segments[key >> 32]
            offset = seg.offsets[key & 0xFFFFFFFF] + 12
            fd = os.open(seg.path, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
            finally:
                os.close(fd)
            short = port._view.take(18, 30)
            assert short is not None and short.keys == [b"m-%02d" % i for i in range(17, 24)]
            assert port._view.take(25, 5) is None and port.counters["lost"] == 1
            assert 25 not in port._table and port._view.take(26, 5) is not None
        finally:
            port.close()


def test_a_full_window_adds_nothing_the_collector_visits_and_resends_read_the_store(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """The port's table of assigned unacked messages (up to the window: 100k) holds
    ints only, so a full GC pass does not visit it (it was an object per seq, the
    broker's longest loop turn during range reads). Half the window is numbered for a
    held query (keys only), half taken by a taker (bodies read, held until a DAT's
    records take them, then let go): the objects the collector tracks grow by less than
    1 per 100 seqs, and a resend of the taker's seqs reads the same bytes back from the
    store."""
    n = 20_000
    with MessageStore(tmp_path / "store", sync=False) as store:
        for i in range(n):
            store.put(b"m-%05d" % i, (b"v-%05d" % i,))
        store.commit()
        port = FlowProducerPort(
            store,
            "tcp://127.0.0.1:*",
            ctx=ctx,
            window=n,
            held_slice=n // 2,
            max_take=n // 2,
            taker_turn_dats=n,  # this test is no loop: no turn ends between takes
            sync=False,
        )
        try:
            gc.collect()
            before = len(gc.get_objects())
            assert not port.prepare_held()  # the slice spent: more is ready
            port.pump()  # the next loop turn
            assert port.numbered == n // 2 and port.next_seq == 1  # durable: not yet
            seq = n // 2 + 1  # a taker's seqs from here (take syncs the held numbering)
            firsts: list[tuple[int, bytes, bytes]] = []
            while (taken := port.take(seq, 1000, 1000)) is not None:
                firsts.append((taken.first, taken.keys[0] or b"", taken.values[-1]))
                seq = taken.first + len(taken.values)
            assert seq == n + 1 and port.unacked == n and port.next_seq == n + 1
            assert firsts[0] == (n // 2 + 1, b"m-%05d" % (n // 2), b"v-%05d" % (n // 2 + 999))
            gc.collect()
            grown = len(gc.get_objects()) - before
            assert grown < n // 100, f"{grown} more tracked objects for a window of {n}"
            assert not gc.is_tracked(port._table) and not port._held
            # A resend (a taker that resumed) gets the same bytes, read back by key.
            again = port.take(n // 2 + 1, 1000, 0)
            assert (
                again is not None and (again.first, again.keys[0], again.values[-1]) == (firsts[0])
            )
            port.ack(n)
            assert port.unacked == 0 and store.messages == 0
        finally:
            port.close()


def test_range_flows_send_a_budget_of_dats_per_loop_turn_while_the_queue_serves_producers(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
) -> None:
    """A range flow sends at most ``range_turn_dats`` DATs per broker loop turn, so two
    large range reads and a PZQ producer sending meanwhile all progress: each of the
    producer's messages is acked within a few loop turns (not after a whole range), both
    ranges send in the same turns (neither waits for the other to end), and both come
    back complete and in order. Turns and per-turn DATs are counted in the broker's
    thread, around the flow ports' ``pump`` (each loop turn ends with it)."""
    n, batch = 16_000, 50  # two ranges of 160 DATs each; a PAY's credit pays for 64
    b = make_broker(flow_producer="tcp://127.0.0.1:*", sync=False)
    ep, pid = b.endpoints["flow_producer"], f"queue:{b.queue_id.decode()}"
    producer = raw_socket(zmq.DEALER)
    producer.connect(b.endpoints["receive"])
    messages = [(b"m-%05d" % i, [b"body-%05d" % i]) for i in range(n)]
    _produce(producer, messages)
    port = _port(b)
    budget = port.ranges.turn_dats
    assert budget is not None and budget * 4 <= n // 2 // batch
    with ControlConnection(ep, ctx=ctx, timeout=T) as control:
        held = control.held()
    assert (held.first, held.end) == (1, n + 1)

    turns = [0]
    per_turn: list[dict[int, int]] = []  # {flow id: DATs sent} per loop turn
    flows = b._flows
    assert flows is not None
    pump = flows.pump

    def counted(store: MessageStore) -> None:  # the broker's thread
        pump(store)
        service = port.ranges  # new_turn() ran: the turn just ended is turn - 1
        per_turn.append({id(f): f._turn_sent for f in service.flows if f._turn == service.turn - 1})
        turns[0] += 1

    flows.pump = counted  # type: ignore[method-assign]  # looked up every turn

    ranges: dict[str, list[tuple[int, bytes]]] = {"a": [], "b": []}
    done: dict[str, BaseException | None] = {}

    def read(name: str, start: int, end: int) -> None:
        try:
            for got in read_range(ep, pid, held.incarnation, start, end, ctx=ctx, batch=batch):
                ranges[name] += [(r["seq"], r["key"]) for r in got.to_pylist()]
            done[name] = None
        except BaseException as e:  # the test reports it
            done[name] = e

    readers = [
        threading.Thread(target=read, args=("a", 1, n // 2 + 1), daemon=True),
        threading.Thread(target=read, args=("b", n // 2 + 1, n + 1), daemon=True),
    ]
    # Loop turns, and range DATs sent, from a PZQ send to its ack during both ranges.
    latencies: list[tuple[int, int]] = []
    for t in readers:
        t.start()
    deadline = time.monotonic() + T
    i = 0
    while len(done) < 2:
        assert time.monotonic() < deadline, f"the ranges were not served: {done}"
        reading = not done and bool(ranges["a"]) and bool(ranges["b"])
        sent_at, dats_at = turns[0], port.range_stats["range_dats"]
        _produce(producer, [(b"p-%05d" % i, [b"late-%05d" % i])])
        if reading and not done:  # both ranges still going on from send to ack
            latencies.append((turns[0] - sent_at, port.range_stats["range_dats"] - dats_at))
        i += 1
    for t in readers:
        t.join(T)
    assert done == {"a": None, "b": None}, done
    assert ranges["a"] == [(s, b"m-%05d" % (s - 1)) for s in range(1, n // 2 + 1)]
    assert ranges["b"] == [(s, b"m-%05d" % (s - 1)) for s in range(n // 2 + 1, n + 1)]
    sending = [t for t in per_turn if t]
    # The budget held every turn, so the 320 DATs took at least 160 / budget turns...
    assert max(max(t.values()) for t in sending) <= budget
    assert sum(sum(t.values()) for t in sending) >= n // batch
    assert len(sending) >= n // batch // (2 * budget)
    # ... in which both ranges went on together, not one after the other,
    assert sum(len(t) == 2 for t in sending) >= n // 2 // batch // budget // 2
    # and the producer's acks came within a few turns each (its commit runs in the
    # broker's sync thread: 2-6 turns seen on the loaded 2 cores), not after a range:
    # the broker sent far fewer DATs meanwhile than one range has (unbudgeted, a PAY's
    # credit had each range flow send 64 DATs in one turn).
    assert len(latencies) >= 3, (latencies, len(sending))
    assert max(t for t, _ in latencies) <= 12 < len(sending), (latencies, len(sending))
    # (one turn more: the count is read from this thread, between two of the loop's)
    assert max(d for _, d in latencies) <= 13 * 2 * budget < n // 2 // batch, latencies
    assert port.range_stats["range_turns_deferred"] > 0


def test_a_held_query_numbers_without_reading_and_a_damaged_record_is_caught_by_the_read(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """A held query numbers store messages without reading their records
    (``take_keys``): a record damaged on disk before it is numbered gets its seq, and
    the range read's check (length, CRC) catches it before anything of it is served:
    a DAT stops before it, asked for first it is a hole (``lost``, the range refused
    at the task: test_a_store_record_lost_under_a_range_refuses_the_range), and the
    store drops it as take() drops a record it cannot read. The records on either
    side are served unchanged."""
    with MessageStore(tmp_path / "store", sync=False) as store:
        keys = [store.put(b"m-%02d" % i, (b"v-%02d" % i,)) for i in range(20)]
        store.commit()
        key = keys[11]
        assert key is not None
        seg = store._index.segments[key >> 32]
        flip_byte(seg.path, seg.offsets[key & 0xFFFFFFFF] + 12)  # seq 12's record
        port = FlowProducerPort(store, "tcp://127.0.0.1:*", ctx=ctx, sync=False, linger_ms=0)
        try:
            assert port.prepare_held() and (port.held_first, port.next_seq) == (1, 21)
            assert port.counters["lost"] == 0 and port._table[12] == key
            taken = port._view.take(1, 20)
            assert taken is not None and taken.keys == [b"m-%02d" % i for i in range(11)]
            assert port._view.take(12, 5) is None and port.counters["lost"] == 1
            assert 12 not in port._table and store.messages == store.in_flight == 19
            after = port._view.take(13, 20)
            assert after is not None and after.first == 13
            assert after.values == [b"v-%02d" % i for i in range(12, 20)]
        finally:
            port.close()
