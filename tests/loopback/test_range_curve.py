"""Range reads over CURVE with per-run keys, on loopback (docs/direct-read.md, Security).

A bound :class:`Producer` with ``curve_allowed_client_keys`` admits only CURVE clients on
that allow-list (the driver's long-term key) and the run keys its control flows register
(``admit``), each while the control flow that registered it lives. Covered: a run key
reads a range; an unknown key is refused at the handshake, fast, with the endpoint and
the fix; a run key revoked when its control flow ends; a driver key off the list; a
producer without an allow-list (``open``); producers sharing a context, each with its own
list; bad keys; the driver's keeper registering the run key again at a restarted
producer, also when the restart cut a request of the control flow short (a producer in a
process of its own, stopped and killed by its pid). Every socket is on 127.0.0.1 with a
random port, the ``ctx`` fixture fails on a leaked socket, and every wait polls a
condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.support import wait_until
from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import Curve
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import ControlConnection, held_window, read_range
from zio_spark.transport.curve import client_curve

T = 30.0  # seconds any one wait may last; a refusal must come far sooner
FAST = 10.0  # a refused handshake fails within this (libzmq answers at once)
P = "p1"


class Keys:
    """A server key pair and client key pairs (Z85 bytes), drawn per test."""

    def __init__(self) -> None:
        self.server_public, self.server_secret = zmq.curve_keypair()
        self.driver = zmq.curve_keypair()  # (public, secret): on the allow-list
        self.run = zmq.curve_keypair()  # the query run's pair: registered by admit
        self.stranger = zmq.curve_keypair()  # on no list

    def curve(self, pair: tuple[bytes, bytes]) -> Curve:
        return client_curve(self.server_public, pair[1], pair[0])


@pytest.fixture
def keys() -> Keys:
    return Keys()


def _producer(ctx: Any, closing: list[Any], keys: Keys, **kw: Any) -> Producer:
    kw.setdefault("producer_id", P)
    kw.setdefault("curve_secret_key", keys.server_secret)
    p = Producer("tcp://127.0.0.1:*", ctx=ctx, linger_ms=0, **kw)
    closing.append(p)
    return p


def _control(p: Producer, ctx: Any, closing: list[Any], curve: Curve | None) -> ControlConnection:
    c = ControlConnection(p.endpoint, ctx=ctx, curve=curve, timeout=T)
    closing.append(c)
    return c


def _read(p: Producer, ctx: Any, curve: Curve, start: int, end: int) -> list[bytes]:
    got = read_range(p.endpoint, P, p.incarnation, start, end, ctx=ctx, curve=curve, timeout=T)
    return [r["value"] for b in got for r in b.to_pylist()]


def _refused(call: Any) -> tuple[TransportError, float]:
    """Run ``call``; it must raise a TransportError; returns it and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(TransportError) as e:
        call()
    return e.value, time.monotonic() - t0


def test_the_run_key_reads_and_an_unknown_key_is_refused_fast(ctx, closing, keys):
    p = _producer(ctx, closing, keys, curve_allowed_client_keys=[keys.driver[0]])
    assert p.curve_allowed_client_keys == frozenset({keys.driver[0]})
    p.send_many([b"v%d" % i for i in range(20)])
    control = _control(p, ctx, closing, keys.curve(keys.driver))
    assert control.held().end == 21
    assert control.admit(keys.run[0]) is True  # the producer keeps an allow-list
    assert p.run_keys == frozenset({keys.run[0]})
    assert p.stats["run_keys_admitted"] == 1
    assert _read(p, ctx, keys.curve(keys.run), 1, 21) == [b"v%d" % i for i in range(20)]
    # A key on no list: refused by the ZAP handler at the handshake, not a BOT timeout.
    err, took = _refused(lambda: _read(p, ctx, keys.curve(keys.stranger), 1, 21))
    assert took < FAST, took
    assert err.endpoint == p.endpoint
    text = str(err)
    assert "refused our CURVE key" in text and "restart the query" in text
    assert "--curve-allow" in text


def test_a_run_key_is_revoked_when_its_control_flow_ends(ctx, closing, keys):
    p = _producer(ctx, closing, keys, curve_allowed_client_keys=keys.driver[0])
    p.send_many([b"a", b"b", b"c"])
    control = _control(p, ctx, closing, keys.curve(keys.driver))
    control.admit(keys.run[0])
    assert _read(p, ctx, keys.curve(keys.run), 1, 4) == [b"a", b"b", b"c"]
    control.close()  # the query stopped: EOT on its control flow
    wait_until(lambda: not p.run_keys, T, "the run key revoked", detail=lambda: p.stats)
    assert p.stats["run_keys_revoked"] == 1
    err, took = _refused(lambda: _read(p, ctx, keys.curve(keys.run), 1, 4))
    assert took < FAST, took
    assert "refused our CURVE key" in str(err)
    # The driver's own key stays on the list: a new run registers a new key and reads.
    again = _control(p, ctx, closing, keys.curve(keys.driver))
    fresh = zmq.curve_keypair()
    assert again.admit(fresh[0]) is True
    assert _read(p, ctx, keys.curve(fresh), 1, 4) == [b"a", b"b", b"c"]
    # Two control flows (two runs) hold their keys apart: ending one keeps the other's.
    other = _control(p, ctx, closing, keys.curve(keys.driver))
    assert other.admit(keys.run[0]) is True
    assert p.run_keys == frozenset({fresh[0], keys.run[0]})
    again.close()
    wait_until(lambda: p.run_keys == frozenset({keys.run[0]}), T, "only the first revoked")
    assert _read(p, ctx, keys.curve(keys.run), 2, 4) == [b"b", b"c"]


def test_a_driver_key_off_the_list_is_refused_with_the_fix(ctx, closing, keys):
    p = _producer(ctx, closing, keys, curve_allowed_client_keys=[keys.driver[0]])
    err, took = _refused(
        lambda: ControlConnection(
            p.endpoint, ctx=ctx, curve=keys.curve(keys.stranger), timeout=T
        ).close()
    )
    assert took < FAST, took
    assert err.endpoint == p.endpoint
    assert "curvePublicKey" in str(err) and "allow-list" in str(err)
    # The reader that only knows the server key, without CURVE at all: refused too.
    err, took = _refused(lambda: held_window(p.endpoint, P, ctx=ctx, timeout=3.0))
    assert "no BOT reply" in str(err)


def test_without_an_allow_list_the_answer_is_open_and_any_key_reads(ctx, closing, keys):
    p = _producer(ctx, closing, keys)
    assert p.curve_allowed_client_keys is None
    p.send_many([b"x", b"y"])
    control = _control(p, ctx, closing, keys.curve(keys.driver))
    assert control.admit(keys.run[0]) is False  # nothing stored
    assert p.run_keys == frozenset()
    assert _read(p, ctx, keys.curve(keys.stranger), 1, 3) == [b"x", b"y"]
    # No CURVE at all: the same answer, nothing changes for the reader.
    plain = Producer("tcp://127.0.0.1:*", ctx=ctx, linger_ms=0, producer_id="p2")
    closing.append(plain)
    c = ControlConnection(plain.endpoint, ctx=ctx, timeout=T)
    closing.append(c)
    assert c.admit(keys.run[0]) is False


def test_producers_sharing_a_context_keep_their_own_lists(ctx, closing, keys):
    other = zmq.curve_keypair()
    a = _producer(ctx, closing, keys, curve_allowed_client_keys=[keys.driver[0]])
    b = _producer(ctx, closing, keys, producer_id="p2", curve_allowed_client_keys=[other[0]])
    c = _producer(ctx, closing, keys, producer_id="p3")  # CURVE, no list: as before
    for p in (a, b, c):
        p.send(b"r")
    assert held_window(a.endpoint, P, ctx=ctx, curve=keys.curve(keys.driver), timeout=T).end == 2
    _refused(lambda: held_window(b.endpoint, "p2", ctx=ctx, curve=keys.curve(keys.driver)))
    assert held_window(b.endpoint, "p2", ctx=ctx, curve=keys.curve(other), timeout=T).end == 2
    _refused(lambda: held_window(a.endpoint, P, ctx=ctx, curve=keys.curve(other)))
    for pair in (keys.driver, other, keys.stranger):
        assert held_window(c.endpoint, "p3", ctx=ctx, curve=keys.curve(pair), timeout=T).end == 2


@pytest.mark.parametrize(
    ("allowed", "with_secret", "option"),
    [
        (["not a key"], True, "curve_allowed_client_keys[0]"),
        ([], True, "curve_allowed_client_keys"),
        ([b"\x00" * 31], True, "curve_allowed_client_keys[0]"),
        ([b"k" * 40], False, "curve_allowed_client_keys"),  # a list needs CURVE
    ],
)
def test_bad_allow_lists_are_config_errors(ctx, keys, allowed, with_secret, option):
    secret = keys.server_secret if with_secret else None
    with pytest.raises(ConfigError) as e:
        Producer(
            "tcp://127.0.0.1:*",
            ctx=ctx,
            curve_secret_key=secret,
            curve_allowed_client_keys=allowed,
        )
    assert e.value.option == option


def test_an_allow_list_is_for_a_bound_producer(ctx, keys):
    with pytest.raises(ConfigError) as e:
        Producer(
            connect="tcp://127.0.0.1:9",
            ctx=ctx,
            curve_server_key=keys.server_public,
            curve_secret_key=keys.driver[1],
            curve_allowed_client_keys=[keys.run[0]],
        )
    assert e.value.option == "curve_allowed_client_keys" and "bind" in e.value.expected


def test_the_drivers_controls_register_the_run_key_and_reregister_after_a_drop(ctx, closing, keys):
    """``Controls`` (the driver's control flows) draw a run key pair, register it when a
    control flow opens, hand it to the tasks (``task_curve``: never the source's pair),
    and reopen a control flow that ended before handing it out again."""
    from functools import partial

    from zio_spark.source.direct import Controls

    p = _producer(ctx, closing, keys, curve_allowed_client_keys=[keys.driver[0]])
    p.send_many([b"a", b"b"])
    controls = Controls((p.endpoint,), ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(controls)
    run = controls.run_curve
    assert run is not None and run.server_key == keys.server_public
    assert run.public_key != keys.driver[0] and run.secret_key != keys.driver[1]
    assert controls.held()[P].end == 3
    assert p.run_keys == frozenset({run.public_key})
    assert controls.task_curve([p.endpoint]) == run
    assert _read(p, ctx, run, 1, 3) == [b"a", b"b"]
    # The control flow ends (a producer's restart would end it too): the key is revoked.
    lane = controls._lane(p.endpoint)
    lane.submit(partial(controls._drop, p.endpoint)).result(T)
    wait_until(lambda: not p.run_keys, T, "the run key revoked")
    _refused(lambda: _read(p, ctx, run, 1, 3))
    # Planning the next batch reopens it first: registered again, the tasks read.
    assert controls.task_curve([p.endpoint]) == run
    assert p.run_keys == frozenset({run.public_key})
    assert _read(p, ctx, run, 1, 3) == [b"a", b"b"]
    # Without CURVE there is no run key to hand out.
    assert Controls((p.endpoint,), ctx=ctx, timeout=T).task_curve([p.endpoint]) is None


def test_the_keeper_registers_the_run_key_again_at_a_restarted_producer(ctx, closing, keys):
    """A producer with an allow-list restarted in the middle of a batch holds no lease
    for the run key; without a driver hook in between (a batch runs) its tasks would be
    refused. The driver's keeper looks at the control flow, finds it ended (the new
    process answers with an EOT) and reopens it, which registers the key again."""
    from zio_spark.source.direct import Controls

    allowed = [keys.driver[0]]
    p = _producer(ctx, closing, keys, curve_allowed_client_keys=allowed)
    p.send_many([b"a", b"b"])
    controls = Controls((p.endpoint,), ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(controls)
    run = controls.run_curve
    assert run is not None
    assert controls.held()[P].end == 3
    assert p.run_keys == frozenset({run.public_key})
    endpoint = p.endpoint
    p.close(flush=False, timeout=5)
    made: list[Producer] = []

    def rebind_at() -> bool:  # libzmq may still be tearing the old listener down
        try:
            q = Producer(
                endpoint,
                ctx=ctx,
                linger_ms=0,
                producer_id=P,
                curve_secret_key=keys.server_secret,
                curve_allowed_client_keys=allowed,
            )
        except TransportError:
            return False
        closing.append(q)
        made.append(q)
        return True

    wait_until(rebind_at, T, "the producer back on its endpoint")
    q = made[-1]
    q.send_many([b"c"])
    # No hook of the driver runs: only the keeper can register the key there again.
    wait_until(lambda: q.run_keys == frozenset({run.public_key}), T, "the run key again")
    assert _read(q, ctx, run, 1, 2) == [b"c"]


# A producer with an allow-list (the driver's key) in a process of its own, so that it
# can be stopped and killed by its pid: binds ENDPOINT (again, while the killed one's
# listener may still be going away), prints it, then the first run key it leases. No
# heartbeats: nothing but the driver's own requests goes to it.
_PRODUCER = """
import os, sys, time
from zio_spark.errors import TransportError
from zio_spark.source.producer import Producer
endpoint, producer_id = sys.argv[1:3]
deadline = time.monotonic() + 15
while True:
    try:
        p = Producer(
            endpoint,
            producer_id=producer_id,
            linger_ms=0,
            heartbeat_interval=None,
            heartbeat_timeout=None,
            curve_secret_key=os.environ["ZIO_TEST_SERVER_SECRET"],
            curve_allowed_client_keys=[os.environ["ZIO_TEST_ALLOWED"]],
        )
        break
    except TransportError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("ENDPOINT", p.endpoint, flush=True)
while not p.run_keys:
    time.sleep(0.01)
print("LEASED", min(p.run_keys).decode(), flush=True)
sys.stdin.read()
"""


class _ProducerProcess:
    """:data:`_PRODUCER`, its output in ``log``; :meth:`said` polls it, :meth:`stop`
    kills it by its pid."""

    def __init__(self, endpoint: str, keys: Keys, log: Path) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=os.getcwd(),
            ZIO_TEST_SERVER_SECRET=keys.server_secret.decode(),
            ZIO_TEST_ALLOWED=keys.driver[0].decode(),
        )
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _PRODUCER, endpoint, P],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def said(self, prefix: str) -> str | None:
        """The rest of its first output line starting with ``prefix``, if any yet."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith(prefix + " "):
                return line[len(prefix) + 1 :]
        assert self.proc.poll() is None, self.log.read_text(errors="replace")
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(T)
        if self.proc.stdin is not None:
            self.proc.stdin.close()


@pytest.fixture
def producer_process(tmp_path: Path) -> Iterator[Callable[[str, Keys], _ProducerProcess]]:
    started: list[_ProducerProcess] = []

    def start(endpoint: str, keys: Keys) -> _ProducerProcess:
        p = _ProducerProcess(endpoint, keys, tmp_path / f"producer-{len(started)}.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def _unread(port: int) -> int:
    """Bytes received and not yet read on the established TCP connections of 127.0.0.1's
    ``port`` (the server's side): a request waiting in a stopped process's socket."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and f[1] == f"0100007F:{port:04X}":
            n += int(f[4].split(":")[1], 16)
    return n


def test_a_restart_that_cuts_a_control_request_short_does_not_hold_the_run_key_back(
    ctx, producer_process, closing, keys
):
    """The producer dies after a request of the control flow (here the keeper's look; an
    ack or a trigger's held query alike) reached it and before it answered. The request
    fails as soon as the flow's connection drops, so the keeper reopens the flow at the
    restarted producer and registers the run key again at once, not after the flow's
    whole timeout: the batch's tasks, refused at the handshake until then, fail fast and
    would use up Spark's task retries in far less time than that."""
    from zio_spark.source.direct import KEEP_INTERVAL, Controls

    first = producer_process("tcp://127.0.0.1:*", keys)
    endpoint = wait_until(lambda: first.said("ENDPOINT"), T, "the producer's endpoint")
    controls = Controls((endpoint,), ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(controls)
    run = controls.run_curve
    assert run is not None
    assert controls.held()[P].end == 1
    assert wait_until(lambda: first.said("LEASED"), T, "the run key") == run.public_key.decode()
    # Stopped: the keeper's next look reaches its socket, and nothing reads it there.
    port = int(endpoint.rsplit(":", 1)[1])
    os.kill(first.proc.pid, signal.SIGSTOP)
    wait_until(lambda: _unread(port) > 0, T, "the keeper's look waiting in the producer's socket")
    first.stop()
    t0 = time.monotonic()
    second = producer_process(endpoint, keys)
    leased = wait_until(
        lambda: second.said("LEASED"), FAST, "the run key leased at the restarted producer"
    )
    took = time.monotonic() - t0
    assert leased == run.public_key.decode()
    # The restarted process takes most of it (start-up, imports); then a look at most.
    assert took < FAST, took
    assert KEEP_INTERVAL < FAST
