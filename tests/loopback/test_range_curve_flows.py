"""Flows bound to CURVE keys, on loopback (docs/direct-read.md, Security).

A giver with an allow-list decides at each BOT which flows the connection's key may
open, from the ZAP ``User-Id`` its port keeps (``ServerPort(user_ids=True)``): a key on
the list (the driver's) opens control flows, range reads and takers' flows; a run key
leased by a control flow opens range reads only; a connection whose key is neither (a
run key whose lease ended after its handshake) opens none. Covered for a bound
``Producer`` here and for the queue's flow producer port in
``test_queue_ranges_curve.py``. Every socket is on 127.0.0.1 with a random port, the
``ctx`` fixture fails on a leaked socket, and every wait polls a condition with a
deadline.
"""

from __future__ import annotations

from typing import Any

import pytest
import zmq

from tests.loopback.test_range_curve import Keys
from tests.support import wait_until
from zio_spark.errors import TransportError
from zio_spark.options import Curve
from zio_spark.protocol.flow import Direction, Role
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import ControlConnection, RangeConnection, read_range
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import ClientPort

T = 30.0  # seconds any one wait may last
P = "p1"


@pytest.fixture
def keys() -> Keys:
    return Keys()


def _producer(ctx: Any, closing: list[Any], keys: Keys) -> Producer:
    p = Producer(
        "tcp://127.0.0.1:*",
        ctx=ctx,
        linger_ms=0,
        producer_id=P,
        curve_secret_key=keys.server_secret,
        curve_allowed_client_keys=[keys.driver[0]],
    )
    closing.append(p)
    return p


def _admitted(p: Producer, ctx: Any, closing: list[Any], keys: Keys) -> ControlConnection:
    """The driver's control flow, with the run key leased on it."""
    control = ControlConnection(p.endpoint, ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(control)
    assert control.admit(keys.run[0]) is True
    return control


def _read(p: Producer, ctx: Any, curve: Curve, start: int, end: int) -> list[bytes]:
    got = read_range(p.endpoint, P, p.incarnation, start, end, ctx=ctx, curve=curve, timeout=T)
    return [r["value"] for b in got for r in b.to_pylist()]


def _reason(err: FlowRejected) -> str:
    return str(err.attrs.get("reason", ""))


def test_a_run_key_reads_ranges_but_is_refused_a_control_flow(ctx, closing, keys):
    p = _producer(ctx, closing, keys)
    p.send_many([b"v%d" % i for i in range(10)])
    _admitted(p, ctx, closing, keys)
    assert _read(p, ctx, keys.curve(keys.run), 1, 11) == [b"v%d" % i for i in range(10)]
    # The same key on a control flow: admitted by ZAP (the lease), refused at the BOT.
    with pytest.raises(FlowRejected) as e:
        ControlConnection(p.endpoint, ctx=ctx, curve=keys.curve(keys.run), timeout=T)
    assert e.value.endpoint == p.endpoint
    reason = _reason(e.value)
    assert "a control flow refused" in reason, reason
    assert keys.run[0].decode() in reason and "query run's key" in reason
    assert "range reads only" in reason and "curvePublicKey" in reason  # the fix
    assert p.stats["flows_refused_key"] == 1
    assert p.stats["control_flows"] == 1  # the driver's only
    # The driver's own key opens both kinds.
    assert _read(p, ctx, keys.curve(keys.driver), 3, 5) == [b"v2", b"v3"]
    again = ControlConnection(p.endpoint, ctx=ctx, curve=keys.curve(keys.driver), timeout=T)
    closing.append(again)
    assert again.held().end == 11
    assert p.stats["flows_refused_key"] == 1


def test_a_run_key_is_refused_a_takers_flow(ctx, closing, keys):
    p = _producer(ctx, closing, keys)
    p.send_many([b"a", b"b"])
    _admitted(p, ctx, closing, keys)
    port = ClientPort(ctx, curve=keys.curve(keys.run), linger_ms=0)
    closing.append(port)
    port.connect(p.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    # A taker's BOT (no read mode): it would drain the records and ack them.
    ep.send_bot(Direction.INJECT, 4, {"ack": True})
    with pytest.raises(FlowRejected) as e:
        ep.recv_bot(T)
    reason = _reason(e.value)
    assert "a taker's flow refused" in reason and "range reads only" in reason, reason
    assert p.delivery().sent == 0  # nothing given to it
    assert p.stats["flows_refused_key"] == 1


def test_an_admit_on_a_range_flow_is_refused_and_leases_nothing(ctx, closing, keys):
    p = _producer(ctx, closing, keys)
    p.send_many([b"a", b"b"])
    _admitted(p, ctx, closing, keys)
    other = zmq.curve_keypair()
    conn = RangeConnection(p.endpoint, ctx=ctx, curve=keys.curve(keys.run), timeout=T)
    closing.append(conn)
    # What a task holding the run key could try: admit a key of its own on its flow.
    conn.ep.pay(0, {"admit": {"id": 0, "key": other[0].decode()}})
    assert conn.ep.get(T, auto_pay=False) is None  # no DAT: the refusal's EOT
    eot = conn.ep.peer_eot
    assert eot is not None
    reason = str(eot.attrs.get("reason"))
    assert "admit" in reason and "range flow" in reason, reason
    assert p.run_keys == frozenset({keys.run[0]})  # the other key is not leased
    assert p.stats["run_keys_admitted"] == 1
    with pytest.raises(TransportError) as refused:
        _read(p, ctx, keys.curve(other), 1, 3)
    assert "refused our CURVE key" in str(refused.value)


def test_a_connection_whose_lease_ended_opens_no_new_flow(ctx, closing, keys):
    p = _producer(ctx, closing, keys)
    p.send_many([b"a", b"b", b"c"])
    control = _admitted(p, ctx, closing, keys)
    port = ClientPort(ctx, curve=keys.curve(keys.run), linger_ms=0)
    closing.append(port)
    port.connect(p.endpoint)
    first = FlowEndpoint(port, Role.CLIENT)
    first.send_bot(Direction.INJECT, 4, {"read": "range"})
    assert first.recv_bot(T).attrs["ranges"] == 1  # admitted while the lease lives
    first.send_eot(timeout=T)
    control.close()  # the run ends: the lease with it
    wait_until(lambda: not p.run_keys, T, "the run key revoked", detail=lambda: p.stats)
    # The connection is still up (ZAP judged it once), but its key is no longer leased.
    second = FlowEndpoint(port, Role.CLIENT)
    second.send_bot(Direction.INJECT, 4, {"read": "range"})
    with pytest.raises(FlowRejected) as e:
        second.recv_bot(T)
    reason = _reason(e.value)
    assert "a range read refused" in reason and "neither on this giver's allow-list" in reason
    assert "restart the query" in reason, reason


class _Frame:
    """A received frame as pyzmq gives it with ``copy=False``: bytes, more, properties."""

    def __init__(self, data: bytes, more: bool, user_id: str | None) -> None:
        self.bytes = data
        self.more = more
        self._user_id = user_id

    def get(self, name: str) -> str:
        if name != "User-Id" or self._user_id is None:
            raise zmq.ZMQError(22)  # EINVAL, as libzmq for an absent property
        return self._user_id


class _Sock:
    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = frames

    def recv(self, flags: int, copy: bool) -> _Frame:
        assert copy is False  # the property is only readable on a frame object
        return self.frames.pop(0)


def test_both_wires_read_the_user_id_of_what_they_take():
    """The SERVER wire (one frame; no draft pyzmq here to run it on a socket) and the
    ROUTER wire (a multipart message) read the same property, None when absent."""
    from zio_spark.transport.wire import RouterWire, ServerWire

    key = "k" * 40
    for cls, frames, raw in (
        (ServerWire, [_Frame(b"m", False, key)], None),
        (RouterWire, [_Frame(b"id", True, key), _Frame(b"", True, key), _Frame(b"m", False, key)],
         [b"id", b"", b"m"]),
    ):  # fmt: skip
        wire = cls.__new__(cls)  # no socket: the getters take it as an argument
        wire.sock = _Sock(frames)  # type: ignore[assignment]
        wire.user_id = None
        wire.keep_user_ids()
        got = wire.get(0)
        assert wire.user_id == key
        if raw is not None:
            assert got == raw
        wire.sock.frames.append(_Frame(b"n", False, None))  # no ZAP handler judged it
        wire.get(0)
        assert wire.user_id is None
