"""Queue under chaos: the PZQ queue process (``python -m zio_spark.cli.queue``) is
SIGKILLed under load at random (seeded) moments and restarted on the same store and
endpoints, while a producer (raw pyzmq, as ``tests/loopback/test_broker.py``) and a
consumer keep running: no message the queue acknowledged is lost, every message is delivered,
and a message is delivered again only across a restart (a consumer ack the dead queue had
not made durable), never twice by one queue process.

The producer keeps ``WINDOW`` messages unacknowledged and resends any left without an ack
for ``RESEND_S`` (acks die with the queue; the queue drops and re-acks duplicate ids).
The consumer acks every delivery at once and, when idle, says hello again (``[queue id,
""]``, what ``ZMQ_PROBE_ROUTER`` sends): libzmq sends the probe on the first connect only,
not on a reconnect, so without ROUTER_NOTIFY (draft) a restarted queue never learns of a
consumer that has nothing to ack (see the test at the end).

Each size runs with two kinds of consumer: ``probing`` (the above) and ``pzq``, the
stand-in for the reference PZQ's client library (``tests/loopback/pzq_clients.py``): a
ROUTER that connects and never speaks first, no ``ZMQ_PROBE_ROUTER``, no
``ROUTER_MANDATORY`` (an ack it cannot send is dropped silently), skipping expired
deliveries. Both are checked alike: deliveries are tallied by the queue's message id (as
the spec tells a consumer to spot duplicates), every acked message is among them, and a
message came again only from a later queue process. Kill moments: once the
acknowledged count reaches a random fraction of the messages, after a random delay; the
seed is printed. Which queue
process sent a delivery is told by its ``sent`` time against the moments the killed
processes were reaped (a new one starts only after that).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.loopback.pzq_clients import PzqConsumer
from tests.loopback.test_broker import _start_queue
from tests.reliability.helpers import KillPlan, chaos_rng, run_with_kills, wait_until
from tests.support import TrackingContext
from zio_spark.protocol import pzq

WINDOW = 500  # producer's unacknowledged messages
RESEND_S = 2.0
HELLO_S = 0.5
INFLIGHT = 1000  # the queue's per-consumer limit (its default)

SIZES = {
    # messages, queue kills, test timeout (s)
    "ci": (40_000, 2, 120),
    "full": (1_000_000, 5, 900),
}


def _body(i: int) -> bytes:
    return (b"body-%07d-" % i).ljust(100, b"x")


def _send(sock: zmq.Socket[bytes], i: int) -> None:
    """Send message ``i``; if the pipe is full (no queue), it is resent later like a lost
    one, so that the thread never blocks."""
    with contextlib.suppress(zmq.Again):
        sock.send_multipart([b"m-%07d" % i, b"", _body(i)], zmq.NOBLOCK)


def _drain(sock: zmq.Socket[bytes]) -> Iterator[list[bytes]]:
    """Every message ``sock`` has ready now."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


class Producer(threading.Thread):
    """Sends ``0..n-1`` with at most WINDOW unacked; resends what stays unacked."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, n: int, stop: threading.Event):
        super().__init__(daemon=True, name="chaos-producer")
        self.ctx, self.endpoint, self.n, self.stop = ctx, endpoint, n, stop
        self.acked: set[int] = set()
        self.resent = 0
        self.refused: list[bytes] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        try:
            self._loop(sock)
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            sock.close(linger=0)

    def _loop(self, sock: zmq.Socket[bytes]) -> None:
        outstanding: dict[int, float] = {}
        nxt = 0
        while len(self.acked) < self.n and not self.stop.is_set():
            now = time.monotonic()
            while nxt < self.n and len(outstanding) < WINDOW:
                _send(sock, nxt)
                outstanding[nxt] = now
                nxt += 1
            for i, sent in list(outstanding.items()):
                if now - sent > RESEND_S:
                    _send(sock, i)
                    outstanding[i] = now
                    self.resent += 1
            if not sock.poll(100):
                continue
            for frames in _drain(sock):
                i = int(frames[0][2:])
                if frames[1] == b"1":
                    self.acked.add(i)
                    outstanding.pop(i, None)
                else:  # refused: resent after RESEND_S like a lost one
                    self.refused.append(frames[-1])


class Consumer(threading.Thread):
    """Acks every delivery at once; keeps each delivery's ``sent`` time (µs); says hello
    to ``queue_id`` after HELLO_S without a delivery.

    ``ROUTER_MANDATORY``: a plain ROUTER silently drops what it cannot send at once (its
    pipe to the queue full), and a dropped ack comes back as a redelivery after the ack
    timeout. So acks that do not fit are kept and sent again (``ack_retries``); acks to
    a queue that is gone (``EHOSTUNREACH``) are dropped, its successor redelivers."""

    def __init__(self, ctx: zmq.Context[Any], info: dict[str, str], stop: threading.Event) -> None:
        super().__init__(daemon=True, name="chaos-consumer")
        self.ctx, self.stop = ctx, stop
        self.endpoint, self.queue_id = info["send"], info["queue_id"].encode()
        self.got: dict[int, list[int]] = collections.defaultdict(list)
        self.bad: list[tuple[bytes, tuple[bytes, ...]]] = []
        self.ack_retries = 0
        self.acks_unroutable = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.PROBE_ROUTER, 1)  # announces us on the first connect only
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.connect(self.endpoint)
        acks: collections.deque[list[bytes]] = collections.deque()
        try:
            while not self.stop.is_set():
                self._send(sock, acks)
                if not sock.poll(10 if acks else int(HELLO_S * 1000)):
                    if not acks:
                        with contextlib.suppress(zmq.ZMQError):  # not connected: next time
                            sock.send_multipart([self.queue_id, b""], zmq.NOBLOCK)
                    continue
                for frames in _drain(sock):
                    queue_id, rest = pzq.split_identity(frames)
                    d = pzq.decode_delivery(rest)
                    i = int(d.message_id[2:])
                    if d.body != (_body(i),):
                        self.bad.append((d.message_id, d.body))
                    self.got[i].append(d.sent_us)
                    acks.append([queue_id, d.message_id, b"1"])
                    self._send(sock, acks)
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket[bytes], todo: collections.deque[list[bytes]]) -> None:
        while todo:
            try:
                sock.send_multipart(todo[0], zmq.NOBLOCK)
            except zmq.Again:  # pipe full: later
                self.ack_retries += 1
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self.acks_unroutable += 1  # not connected (yet): dropped
            todo.popleft()


class SilentPzqConsumer(threading.Thread):
    """The reference PZQ client's consumer loop (:class:`PzqConsumer`): consume, ack,
    repeat; it never sends anything but acks. Keeps each delivery's ``sent`` time (µs)
    by message, as :class:`Consumer`."""

    def __init__(self, ctx: zmq.Context[Any], info: dict[str, str], stop: threading.Event) -> None:
        super().__init__(daemon=True, name="chaos-pzq-consumer")
        self.ctx, self.stop, self.endpoint = ctx, stop, info["send"]
        self.got: dict[int, list[int]] = collections.defaultdict(list)
        self.bad: list[tuple[bytes, tuple[bytes, ...]]] = []
        self.skipped_expired = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        client = PzqConsumer(self.ctx, self.endpoint)  # created here: sockets stay in a thread
        try:
            while not self.stop.is_set():
                message = client.consume(0.1)
                if message is None:
                    continue
                i = int(message.id[2:])
                if message.message != [_body(i)]:
                    self.bad.append((message.id, tuple(message.message)))
                self.got[i].append(int(message.sent))
                client.ack(message)
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.skipped_expired = client.skipped_expired
            client.close()


CONSUMERS: dict[str, type[Consumer] | type[SilentPzqConsumer]] = {
    "probing": Consumer,
    "pzq": SilentPzqConsumer,
}


def _monitor(ctx: zmq.Context[Any], endpoint: str) -> dict[str, str]:
    sock = ctx.socket(zmq.REQ)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send(b"MONITOR")
        assert sock.poll(10_000), "no MONITOR reply within 10 s"
        return pzq.decode_monitor_reply(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill (by pid) the queue processes still running, reap all, close their pipes."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("kind", list(CONSUMERS))
@pytest.mark.parametrize(
    "size",
    [
        pytest.param("ci", marks=pytest.mark.timeout(SIZES["ci"][2])),
        pytest.param("full", marks=[pytest.mark.chaos, pytest.mark.timeout(SIZES["full"][2])]),
    ],
)
def test_queue_sigkill_under_load_loses_no_acked_message(
    ctx: TrackingContext, tmp_path: Path, size: str, kind: str
) -> None:
    n, kills, timeout = SIZES[size]
    _, rng = chaos_rng(f"queue/{size}/{kind}")
    plan = KillPlan.draw(rng, "queue", kills, n, max_delay=0.5)
    store = tmp_path / "q"
    procs: list[subprocess.Popen[bytes]] = []
    reaped_us: list[int] = []  # when each killed queue process was gone
    stop = threading.Event()
    threads: list[Producer | Consumer | SilentPzqConsumer] = []

    def start(*endpoints: str) -> dict[str, str]:
        proc, info = _start_queue(store, "--ack-timeout", "60s", *endpoints)
        procs.append(proc)
        return info

    t0 = time.monotonic()
    try:
        info = start()
        fixed = [a for k in ("receive", "send", "monitor") for a in (f"--{k}", info[k])]
        producer = Producer(ctx, info["receive"], n, stop)
        consumer = CONSUMERS[kind](ctx, info, stop)
        threads += [producer, consumer]
        for t in threads:
            t.start()

        def kill_queue() -> None:
            os.kill(procs[-1].pid, signal.SIGKILL)
            procs[-1].wait(10)
            reaped_us.append(time.time_ns() // 1000)
            start(*fixed)  # same store, same endpoints: the clients reconnect by themselves

        def progress() -> int:
            for t in threads:
                assert t.error is None, f"{t.name}: {t.error!r}"
            return len(producer.acked)

        took = run_with_kills(progress, n, {"queue": (plan, kill_queue)}, timeout - 30, "acks")
        try:
            wait_until(lambda: len(consumer.got) >= n, 60, "every message delivered")
        except AssertionError as e:
            missing = sorted(set(range(n)) - set(consumer.got))
            raise AssertionError(
                f"{e}: {len(missing)} never delivered, e.g. {missing[:10]}; "
                f"monitor {_monitor(ctx, info['monitor'])}"
            ) from e
        # Drained: nothing stored or in flight, so no duplicate is waiting to come out.
        wait_until(
            lambda: (
                (m := _monitor(ctx, info["monitor"]))["messages"] == "0"
                and m["messages_in_flight"] == "0"
            ),
            30,
            "an empty queue",
        )
        stats = _monitor(ctx, info["monitor"])
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        _reap(procs)
    # A client thread still running holds its socket: the ``ctx`` fixture's teardown then
    # closes it (linger 0), terminates the context within its deadline and fails the test.
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"client threads still running 10 s after stop: {stuck}"

    again = {
        i: [bisect.bisect(reaped_us, t) for t in sent]  # the queue process of each delivery
        for i, sent in consumer.got.items()
        if len(sent) > 1
    }
    same_process = {i: tags for i, tags in again.items() if len(set(tags)) < len(tags)}
    if isinstance(consumer, Consumer):
        seen = f"ack retries {consumer.ack_retries} unroutable {consumer.acks_unroutable}"
    else:
        seen = f"skipped as expired {consumer.skipped_expired}"
    print(
        f"queue/{size}/{kind}: {n} messages, kills {plan.done}, {producer.resent} resends, "
        f"consumer {seen}, "
        f"{len(again)} redelivered across a restart, {took:.1f} s to all acked, "
        f"{time.monotonic() - t0:.1f} s total; last queue's monitor: {stats}"
    )
    assert producer.acked == set(range(n))
    assert not producer.refused, producer.refused[:5]
    assert not consumer.bad, consumer.bad[:5]
    assert set(consumer.got) == set(range(n)), "acked messages lost"
    if isinstance(consumer, SilentPzqConsumer):
        assert consumer.skipped_expired == 0, "a 60 s ack timeout expired in transit"
        assert stats["hellos"] == "0", "the PZQ consumer never speaks first"
    assert not same_process, f"delivered twice by one queue process: {list(same_process)[:10]}"
    # Across a restart only what the dead queue had in flight or not yet durably acked.
    assert len(again) <= kills * (INFLIGHT + WINDOW), f"{len(again)} redelivered"
    assert [p < n for _, p in plan.done] == [True] * kills, plan


@pytest.mark.timeout(60)
def test_idle_probe_router_consumer_is_served_after_a_queue_restart(
    ctx: TrackingContext, tmp_path: Path
) -> None:
    """Minimal repro: a consumer as the broker's docstring says (ROUTER, PROBE_ROUTER=1)
    stays connected across a queue SIGKILL + restart on the same endpoints; a message
    produced after the restart never reaches it (it takes milliseconds when it works)."""
    procs: list[subprocess.Popen[bytes]] = []
    socks: list[zmq.Socket[bytes]] = []
    try:
        proc, info = _start_queue(tmp_path / "q", "--ack-timeout", "60s")
        procs.append(proc)
        consumer = ctx.socket(zmq.ROUTER)
        socks.append(consumer)
        consumer.setsockopt(zmq.PROBE_ROUTER, 1)
        consumer.connect(info["send"])
        wait_until(lambda: _monitor(ctx, info["monitor"])["consumers"] == "1", 10, "hello")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        fixed = [a for k in ("receive", "send", "monitor") for a in (f"--{k}", info[k])]
        procs.append(_start_queue(tmp_path / "q", "--ack-timeout", "60s", *fixed)[0])
        producer = ctx.socket(zmq.DEALER)
        socks.append(producer)
        producer.connect(info["receive"])
        producer.send_multipart([b"after-restart", b"", b"body"])
        assert producer.poll(10_000) and producer.recv_multipart()[1] == b"1"
        assert consumer.poll(3_000), (
            f"no delivery within 3 s; monitor {_monitor(ctx, info['monitor'])}"
        )
    finally:
        for s in socks:
            s.close(linger=0)
        _reap(procs)
