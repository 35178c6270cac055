"""The queue's flow producer port over CURVE with run keys (docs/direct-read.md, Security).

A queue with ``curve_allowed_client_keys`` runs a ZAP handler of its own on its context
(or uses the application's, ``authenticator=``), and that handler is its flow producer
port's gate, as on a bound producer with an allow-list: a driver's ``admit`` leases its
run key while its control flow lives, the run key reads ranges, is refused a control
flow, and cannot reach the queue's PZQ sockets (leases hold in the flow port's ZAP
domain only). Every socket is on 127.0.0.1 with a random port, the ``ctx`` fixture fails
on a leaked socket, and every wait polls a condition with a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_flow_ports import _produce
from zmq.utils.monitor import recv_monitor_message

from tests.support import wait_until
from zio_spark.cli.queue import run_queue
from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import Curve, QueueOptions
from zio_spark.pzq.broker import QueueBroker
from zio_spark.source.range_client import ControlConnection, read_range
from zio_spark.transport.curve import CurveAuthenticator, client_curve
from zio_spark.transport.flow_endpoint import FlowRejected

Sock = zmq.Socket[bytes]
T = 10.0  # seconds any one wait may last (returns as soon as it can)


class Keys:
    def __init__(self) -> None:
        self.server_public, self.server_secret = zmq.curve_keypair()
        self.driver = zmq.curve_keypair()  # on the list
        self.pzq = zmq.curve_keypair()  # a PZQ producer, on the list
        self.run = zmq.curve_keypair()  # a query run's: leased by admit

    def curve(self, pair: tuple[bytes, bytes]) -> Curve:
        return client_curve(self.server_public, pair[1], pair[0])

    def dealer(self, make: Callable[[int], Sock], pair: tuple[bytes, bytes]) -> Sock:
        s = make(zmq.DEALER)
        s.curve_serverkey = self.server_public
        s.curve_secretkey = pair[1]
        s.curve_publickey = pair[0]
        return s


@pytest.fixture
def keys() -> Keys:
    return Keys()


def _values(ep: str, pid: str, inc: str, n: int, ctx: Any, curve: Curve) -> list[bytes]:
    got = read_range(ep, pid, inc, 1, n + 1, ctx=ctx, curve=curve, timeout=T)
    return [r["value"] for b in got for r in b.to_pylist()]


def _handshake(sock: Sock, endpoint: str) -> int:
    """Connect ``sock`` and return the handshake's outcome event (monitor, deadline)."""
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + T
        while time.monotonic() < deadline:
            if monitor.poll(100):
                return int(recv_monitor_message(monitor)["event"])
        raise AssertionError(f"no handshake outcome within {T} s at {endpoint}")
    finally:
        sock.disable_monitor()
        monitor.close(0)


def test_a_queue_with_an_allow_list_leases_run_keys_for_range_reads_only(
    make_broker: Callable[..., QueueBroker],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    closing: list[Any],
    keys: Keys,
) -> None:
    b = make_broker(
        flow_producer="tcp://127.0.0.1:*",
        curve_secret_key=keys.server_secret,
        curve_allowed_client_keys=(keys.driver[0], keys.pzq[0]),
    )
    ep = b.endpoints["flow_producer"]
    pid = f"queue:{b.queue_id.decode()}"
    producer = keys.dealer(raw_socket, keys.pzq)
    producer.connect(b.endpoints["receive"])
    _produce(producer, [(b"m%02d" % i, [b"body%02d" % i]) for i in range(12)])
    control = ControlConnection(ep, ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(control)
    inc, first, end, _ = control.held()
    assert (first, end) == (1, 13)
    assert control.admit(keys.run[0]) is True  # a gate: leased, not "open"
    want = [b"body%02d" % i for i in range(12)]
    assert _values(ep, pid, inc, 12, ctx, keys.curve(keys.run)) == want
    # The run key on a control flow: refused at the BOT, with the fix.
    with pytest.raises(FlowRejected) as e:
        ControlConnection(ep, ctx=ctx, curve=keys.curve(keys.run), timeout=T)
    assert e.value.endpoint == ep
    reason = str(e.value.attrs["reason"])
    assert "a control flow refused" in reason and "range reads only" in reason, reason
    # Nor can it reach the queue's PZQ sockets: the lease holds on the flow port only.
    thief = keys.dealer(raw_socket, keys.run)
    assert _handshake(thief, b.endpoints["send"]) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert _handshake(keys.dealer(raw_socket, keys.pzq), b.endpoints["send"]) == (
        zmq.EVENT_HANDSHAKE_SUCCEEDED
    )
    # The run ends: its key is refused at the handshake.
    control.close()
    gate = b._gate
    assert gate is not None
    wait_until(lambda: not gate.leased, T, "the run key revoked")
    with pytest.raises(TransportError, match="refused our CURVE key"):
        _values(ep, pid, inc, 12, ctx, keys.curve(keys.run))


def test_a_queue_takes_the_applications_authenticator_as_its_gate(
    make_broker: Callable[..., QueueBroker],
    tmp_path: Path,
    authenticator: Callable[..., CurveAuthenticator],
    raw_socket: Callable[[int], Sock],
    ctx: zmq.Context[Any],
    closing: list[Any],
    keys: Keys,
) -> None:
    auth = authenticator([keys.driver[0], keys.pzq[0]])
    b = make_broker(
        flow_producer="tcp://127.0.0.1:*",
        curve_secret_key=keys.server_secret,
        authenticator=auth,
    )
    ep = b.endpoints["flow_producer"]
    producer = keys.dealer(raw_socket, keys.pzq)
    producer.connect(b.endpoints["receive"])
    _produce(producer, [(b"x", [b"only"])])
    control = ControlConnection(ep, ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(control)
    inc = control.held().incarnation
    assert control.admit(keys.run[0]) is True
    assert auth.leased == frozenset({keys.run[0]})
    pid = f"queue:{b.queue_id.decode()}"
    assert _values(ep, pid, inc, 1, ctx, keys.curve(keys.run)) == [b"only"]
    # A list of its own on a context that runs a handler already: fails naming the fix.
    with pytest.raises(TransportError, match=r"authenticator=") as e:
        make_broker(
            tmp_path / "other",
            curve_secret_key=keys.server_secret,
            curve_allowed_client_keys=(keys.driver[0],),
        )
    assert "only one per context" in str(e.value)


def test_queue_gate_options_are_checked(ctx: zmq.Context[Any], tmp_path: Path, keys: Keys) -> None:
    public = keys.driver[0]
    with pytest.raises(ConfigError) as e:
        QueueOptions(tmp_path, curve_allowed_client_keys=(public,))
    assert e.value.option == "curve_allowed_client_keys" and "curve_secret_key" in str(e.value)
    with pytest.raises(ConfigError) as e:
        QueueOptions(
            tmp_path, curve_secret_key=keys.server_secret, curve_allowed_client_keys=(public, b"x")
        )
    assert e.value.option == "curve_allowed_client_keys[1]"
    with pytest.raises(ConfigError) as e:
        QueueOptions(tmp_path, curve_secret_key=keys.server_secret, curve_allowed_client_keys=())
    assert e.value.option == "curve_allowed_client_keys"
    one = QueueOptions(
        tmp_path, curve_secret_key=keys.server_secret, curve_allowed_client_keys=public
    )
    assert one.curve_allowed_client_keys == (public,)
    auth = CurveAuthenticator(ctx, [public])  # never started: checked before use
    with pytest.raises(ConfigError, match="context"):
        QueueBroker(tmp_path, curve_secret_key=keys.server_secret, authenticator=auth)
    with pytest.raises(ConfigError, match="curve_secret_key"):
        QueueBroker(tmp_path, context=ctx, authenticator=auth)
    with pytest.raises(ConfigError) as e:
        QueueBroker(
            tmp_path,
            context=ctx,
            authenticator=auth,
            curve_secret_key=keys.server_secret,
            curve_allowed_client_keys=(public,),
        )
    assert e.value.option == "curve_allowed_client_keys"
    # The command: --curve-allow without --curve-secret is a usage error (exit 2).
    assert run_queue(["--store", str(tmp_path), "--curve-allow", public.decode()]) == 2
