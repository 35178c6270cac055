"""The queue as a drop-in for the reference PZQ daemon, seen by PZQ's own clients.

The clients are the stand-ins of :mod:`pzq_clients` (the reference's PHP client library
and examples, in Python, quirks included): a consumer that connects a ROUTER and never
speaks first, a synchronous producer, the monitor. The queue runs as a process
(``python -m zio_spark.cli.queue``, stock pyzmq) and is SIGKILLed by pid where a test
says so. Every wait polls with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from pzq_clients import (
    PzqClientError,
    PzqConsumer,
    PzqMonitor,
    PzqProducer,
    producer_example,
)
from test_broker import (  # the queue_process fixture is shared by importing it
    ROOT,
    queue_process,  # noqa: F401
)

from tests.support import wait_until
from zio_spark.protocol import pzq
from zio_spark.pzq.broker import QueueBroker
from zio_spark.storage import store as store_mod

WAIT_S = 10.0
Start = Callable[..., tuple[subprocess.Popen[bytes], dict[str, str]]]


@pytest.fixture
def clients(ctx: zmq.Context[Any]) -> Iterator[Callable[..., Any]]:
    """A factory of PZQ stand-in clients (PzqConsumer, PzqProducer, PzqMonitor), all
    closed at teardown."""
    made: list[Any] = []

    def make(cls: type, endpoint: str, **kw: Any) -> Any:
        client = cls(ctx, endpoint, **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def _port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _consume(consumer: PzqConsumer, n: int, timeout: float = WAIT_S) -> list[bytes]:
    """Consume and ack ``n`` messages (ids); fail if the next one takes ``timeout`` s."""
    got: list[bytes] = []
    while len(got) < n:
        message = consumer.consume(timeout)
        if message is None:
            pytest.fail(f"{len(got)} of {n} messages consumed, then nothing for {timeout} s")
        assert message.message == [message.id], "the example's body is its id"
        consumer.ack(message)
        got.append(message.id)
    return got


def _wait_stats(mon: PzqMonitor, key: str, value: int) -> dict[str, str]:
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = mon.get_stats()
        if int(stats[key]) == value:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"monitor {key} = {stats[key]}, waited for {value}")
        time.sleep(0.02)


def _settle(b: QueueBroker, **want: int) -> None:
    """Wait until the broker's stats (a snapshot refreshed every 0.1 s) show ``want``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = b.stats()
        if all(stats.get(k) == v for k, v in want.items()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"stats { ({k: stats.get(k) for k in want}) }, waited for {want}")
        time.sleep(0.02)


# ---------------------------------------------------------------------- silent consumers


def test_silent_consumer_is_served(
    queue_process: Start,  # noqa: F811
    clients: Callable[..., Any],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    n = 2000
    # PZQ's own unit (µs); 120 s so that no delivery expires while a loaded machine
    # drains 2,000 messages (5 s did: skipped_expired > 0 at load 12).
    _, info = queue_process(tmp_path / "q", "--ack-timeout", "120000000")
    consumer = clients(PzqConsumer, info["send"])  # connected first, silent throughout
    assert producer_example(ctx, info["receive"], n) == n
    got = _consume(consumer, n)
    assert sorted(got) == sorted(b"id-%d" % i for i in range(n))
    assert consumer.skipped_expired == 0
    mon = clients(PzqMonitor, info["monitor"])
    stats = _wait_stats(mon, "acked", n)
    assert stats["messages"] == "0" and stats["messages_inflight"] == "0"
    assert stats["hellos"] == "0", "it never spoke first"


def test_silent_consumer_connected_throughout_a_sigkill_and_restart(
    queue_process: Start,  # noqa: F811
    clients: Callable[..., Any],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    n = 1000
    store = tmp_path / "q"
    proc, info = queue_process(store, "--ack-timeout", "5s")
    consumer = clients(PzqConsumer, info["send"])
    assert producer_example(ctx, info["receive"], n) == n
    before = set(_consume(consumer, n // 2))
    _kill(proc)
    # Same endpoints: the consumer's ROUTER reconnects by itself, and does nothing else.
    _, info2 = queue_process(
        store,
        "--ack-timeout", "5s",
        "--receive", info["receive"], "--send", info["send"], "--monitor", info["monitor"],
    )  # fmt: skip
    after: set[bytes] = set()
    everything = {b"id-%d" % i for i in range(n)}
    deadline = time.monotonic() + WAIT_S
    while not everything <= before | after:
        # Unacked ones come back; acked ones may too, if their tombstone was not yet
        # committed (at least once).
        message = consumer.consume(max(0.1, deadline - time.monotonic()))
        if message is None:
            pytest.fail(f"after the restart: {len(after)} consumed, then nothing")
        consumer.ack(message)
        after.add(message.id)
    # And new messages after the restart reach it as well.
    producer = clients(PzqProducer, info2["receive"])
    for i in range(100):
        producer.produce(b"new-%d" % i, b"new-%d" % i)
    fresh = set()
    while len(fresh) < 100:
        message = consumer.consume(WAIT_S)
        assert message is not None, f"{len(fresh)} of 100 new messages after the restart"
        consumer.ack(message)
        if message.id.startswith(b"new-"):
            fresh.add(message.id)
    print(f"before the kill: {len(before)} consumed; after the restart: {len(after)} + 100")


def test_a_consumer_that_reconnects_is_served_and_a_vanished_ones_messages_come_back_at_once(
    queue_process: Start,  # noqa: F811
    clients: Callable[..., Any],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    n = 300
    # An ack timeout far beyond every wait below: a message that came back only by its
    # timeout would leave _consume with nothing for a whole minute.
    _, info = queue_process(tmp_path / "q", "--ack-timeout", "600s")
    first = clients(PzqConsumer, info["send"])
    assert producer_example(ctx, info["receive"], n) == n
    held = first.consume(WAIT_S)  # taken, never acked
    assert held is not None
    first.close()  # it vanishes with its in-flight messages
    # Decided by the queue's own state, not by the clock: once it has seen the connection
    # go (its socket monitor), what was in flight to it is back in the queue. (A consumer
    # that connects before that moment shares the dealer's round robin with the dead pipe,
    # and what goes there waits for the ack timeout: see pzq/send.py.)
    mon = clients(PzqMonitor, info["monitor"])
    wait_until(
        lambda: int(mon.get_stats()["vanished_requeued"]) >= 1,
        60,
        "the queue requeueing the vanished consumer's messages",
    )
    second = clients(PzqConsumer, info["send"])
    got = set(_consume(second, n, timeout=60))
    assert got == {b"id-%d" % i for i in range(n)} and held.id in got


def test_probing_consumers_keep_working_across_a_restart(
    queue_process: Start,  # noqa: F811
    raw_socket: Callable[[int], zmq.Socket[bytes]],
    tmp_path: Path,
) -> None:
    store = tmp_path / "q"
    proc, info = queue_process(store, "--ack-timeout", "5s")
    consumer = raw_socket(zmq.ROUTER)
    consumer.setsockopt(zmq.PROBE_ROUTER, 1)  # announces itself (a hello) on connect
    consumer.connect(info["send"])
    producer = raw_socket(zmq.DEALER)
    producer.connect(info["receive"])
    for life, endpoints in enumerate((None, info)):
        if endpoints is not None:
            _kill(proc)
            proc, _ = queue_process(
                store, "--ack-timeout", "5s",
                "--receive", info["receive"], "--send", info["send"],
                "--monitor", info["monitor"],
            )  # fmt: skip
        producer.send_multipart([b"p-%d" % life, b"", b"x"])
        assert producer.poll(int(WAIT_S * 1000)) and producer.recv_multipart()[1] == b"1"
        assert consumer.poll(int(WAIT_S * 1000)), f"nothing delivered in life {life}"
        queue_id, delivery = pzq.split_identity(consumer.recv_multipart())
        consumer.send_multipart([queue_id, pzq.decode_delivery(delivery).message_id, b"1"])


def test_router_mode_serves_only_consumers_that_announce_themselves(
    make_broker: Callable[..., QueueBroker], clients: Callable[..., Any], ctx: zmq.Context[Any]
) -> None:
    """The cost of ``send_mode="router"`` with stock libzmq, pinned down."""
    if zmq.DRAFT_API:
        pytest.skip("with ZMQ_ROUTER_NOTIFY a router queue serves silent consumers too")
    b = make_broker(send_mode="router")
    silent = clients(PzqConsumer, b.endpoints["send"])
    producer = clients(PzqProducer, b.endpoints["receive"])
    producer.produce(b"r-1", b"x")
    assert silent.consume(0.5) is None


# ---------------------------------------------------------------------- duplicates


def test_the_reference_producers_second_run_is_stored(
    queue_process: Start,  # noqa: F811
    clients: Callable[..., Any],
    ctx: zmq.Context[Any],
    tmp_path: Path,
) -> None:
    n = 1000
    _, info = queue_process(tmp_path / "q")
    assert producer_example(ctx, info["receive"], n) == n
    assert producer_example(ctx, info["receive"], n) == n  # ids id-0.. again
    mon = clients(PzqMonitor, info["monitor"])
    stats = mon.get_stats()
    assert (stats["stored"], stats["duplicates"]) == (str(2 * n), "0")
    consumer = clients(PzqConsumer, info["send"])
    got = _consume(consumer, 2 * n)
    assert sorted(got) == sorted(b"id-%d" % i for i in range(n) for _ in range(2))


def test_a_resend_after_a_missed_ack_is_stored_once(
    make_broker: Callable[..., QueueBroker],
    clients: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    real_run = store_mod.CommitTicket.run

    def slow_run(self: store_mod.CommitTicket) -> None:
        gate.wait(WAIT_S)
        real_run(self)

    b = make_broker()
    producer = clients(PzqProducer, b.endpoints["receive"])
    monkeypatch.setattr(store_mod.CommitTicket, "run", slow_run)
    with pytest.raises(PzqClientError, match="ACK timeout"):
        producer.produce(b"m-1", b"body", timeout=200)  # the disk is slow: no ack yet
    gate.set()
    monkeypatch.undo()
    # The application retries: the late ack of the first copy is read first (the PHP
    # client's quirk), then the resend's.
    producer.socket.send_multipart([b"m-1", b"", b"body"])
    acks = [producer.socket.recv_multipart()[:2] for _ in range(2)]
    assert acks == [[b"m-1", b"1"]] * 2
    # After the ack was sent, on the same connection: still a resend.
    assert producer.produce(b"m-1", b"body")
    _settle(b, stored=1, duplicates=2)


def test_a_resend_of_a_message_whose_ack_was_lost_in_a_crash_is_stored_once(
    make_broker: Callable[..., QueueBroker],
    clients: Callable[..., Any],
    tmp_path: Path,
) -> None:
    b = make_broker(tmp_path / "q")
    producer = clients(PzqProducer, b.endpoints["receive"])
    producer.produce(b"c-1", b"body")
    b.stop()  # as if the ack had died with the queue: the store has c-1
    b2 = make_broker(tmp_path / "q")
    resender = clients(PzqProducer, b2.endpoints["receive"])  # a new connection
    assert resender.produce(b"c-1", b"body")
    _settle(b2, stored=0, duplicates=1)
    b2.stop()
    b3 = make_broker(tmp_path / "q", dedup_grace=0)  # no grace: stored again
    again = clients(PzqProducer, b3.endpoints["receive"])
    assert again.produce(b"c-1", b"body")
    _settle(b3, stored=1, duplicates=0)


@pytest.mark.parametrize(("rule", "stored"), [("global", 1), ("off", 2)])
def test_the_other_dedup_rules(
    make_broker: Callable[..., QueueBroker], clients: Callable[..., Any], rule: str, stored: int
) -> None:
    b = make_broker(dedup=rule)
    for _ in range(2):
        producer = clients(PzqProducer, b.endpoints["receive"])
        producer.produce(b"same", b"body")
        producer.close()
    _settle(b, stored=stored, duplicates=2 - stored)


# ---------------------------------------------------------------------- options, monitor


def test_pzq_option_names_and_microsecond_ack_timeout(
    queue_process: Start,  # noqa: F811
    clients: Callable[..., Any],
    tmp_path: Path,
) -> None:
    _, info = queue_process(
        tmp_path / "q",
        "--database", str(tmp_path / "db"),
        "--receive-dsn", "tcp://127.0.0.1:*",
        "--send-dsn", "tcp://127.0.0.1:*",
        "--monitor-dsn", f"ipc://{tmp_path}/pzq-monitor",
        "--ack-timeout", "5000000",
    )  # fmt: skip
    assert info["monitor"] == f"ipc://{tmp_path}/pzq-monitor"
    assert (tmp_path / "db" / "QUEUE_ID").exists(), "--database is the store"
    producer = clients(PzqProducer, info["receive"])
    consumer = clients(PzqConsumer, info["send"])
    producer.produce(b"t-1", b"t-1")
    message = consumer.consume(WAIT_S)
    assert message is not None and message.ack_timeout == b"5000000"
    consumer.ack(message)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("5", ["'--ack-timeout'", "'5'", "5 µs", "read as seconds it would be 5 s"]),
        ("5000000s", ["'--ack-timeout'", "'5000000s'", "57.9 d"]),
        ("5 parsecs", ["'--ack-timeout'", "5000000us, 500ms"]),
    ],
)
def test_an_implausible_ack_timeout_is_refused_naming_both_readings(
    tmp_path: Path, value: str, words: list[str]
) -> None:
    cmd = [sys.executable, "-m", "zio_spark.cli.queue", "--store", str(tmp_path / "q")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*cmd, "--ack-timeout", value], capture_output=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 2
    err = done.stderr.decode()
    for word in words:
        assert word in err
    assert not (tmp_path / "q").exists(), "refused before opening anything"


def test_the_monitor_answers_with_the_spec_and_the_reference_keys(
    make_broker: Callable[..., QueueBroker], clients: Callable[..., Any]
) -> None:
    b = make_broker()
    producer = clients(PzqProducer, b.endpoints["receive"])
    consumer = clients(PzqConsumer, b.endpoints["send"])
    producer.produce(b"k-1", b"0123456789")
    assert consumer.consume(WAIT_S) is not None  # held, unacked
    mon = clients(PzqMonitor, b.endpoints["monitor"])
    deadline = time.monotonic() + WAIT_S
    while (stats := mon.get_stats())["messages_in_flight"] != "1":
        assert time.monotonic() < deadline
    for spec, reference in (
        ("messages_in_flight", "messages_inflight"),
        ("in_flightdb_size", "inflight_db_size"),
    ):
        assert stats[spec] == stats[reference] and int(stats[reference]) > 0
    for key in (*pzq.MONITOR_KEYS, *pzq.REFERENCE_MONITOR_KEYS):
        assert stats[key].isdigit()
