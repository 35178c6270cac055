"""The ZIO reference stand-in, pinned against raw pyzmq sockets (never our connector).

Each test pins one behaviour of the reference (brettviren/zio) that the stand-in
reproduces; the numbers refer to the facts in ``tests/peers/zio_reference.py``. The raw
side encodes and decodes by hand, independently of the stand-in's own helpers.
"""

from __future__ import annotations

import json
import struct
import time
from typing import Any

import pytest
import zmq

from tests.peers import zio_reference as zr
from tests.peers.zio_reference import (
    ReferenceClientGiver,
    ReferenceClientTaker,
    ReferenceServer,
)

WAIT_S = 10.0
QUIET_S = 0.4  # how long "nothing arrives" is watched


# --------------------------------------------------------------------------- raw side


def _zmsg(parts: list[bytes]) -> bytes:
    out = b""
    for p in parts:
        out += (bytes([len(p)]) if len(p) < 255 else b"\xff" + struct.pack(">I", len(p))) + p
    return out


def _unzmsg(data: bytes) -> list[bytes]:
    parts, i = [], 0
    while i < len(data):
        n = data[i]
        i += 1
        if n == 0xFF:
            (n,) = struct.unpack(">I", data[i : i + 4])
            i += 4
        parts.append(data[i : i + n])
        i += n
    return parts


def flow_parts(
    label: str, seqno: int = 0, origin: int = 0, granule: int = 0, payload: tuple = ()
) -> list[bytes]:
    return [b"ZIO0FLOW" + label.encode(), struct.pack("<QQQ", origin, granule, seqno), *payload]


class Got:
    """One received message, split by hand."""

    def __init__(self, parts: list[bytes], rid: Any = None, frames: Any = None) -> None:
        self.parts = parts
        self.rid = rid
        self.frames = frames  # the raw multipart (routerdealer) or the single frame bytes
        assert parts[0][:8] == b"ZIO0FLOW", parts[0][:16]
        self.label = parts[0][8:].decode()
        self.obj = json.loads(self.label) if self.label else {}
        assert len(parts[1]) == 24
        self.origin, self.granule, self.seqno = struct.unpack("<QQQ", parts[1])
        self.payload = parts[2:]


class Raw:
    """A raw pyzmq socket speaking the reference's envelope by hand."""

    def __init__(self, ctx: zmq.Context[Any], mode: str, serverish: bool) -> None:
        self.mode, self.serverish = mode, serverish
        if mode == "clientserver":
            kind = zmq.SERVER if serverish else zmq.CLIENT
        else:
            kind = zmq.ROUTER if serverish else zmq.DEALER
        self.sock = ctx.socket(kind)
        self.sock.linger = 0
        self.endpoint = ""
        self.last_rid: Any = None

    def bind(self) -> str:
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        return self.endpoint

    def connect(self, endpoint: str) -> Raw:
        self.sock.connect(endpoint)
        return self

    def send(self, parts: list[bytes], rid: Any = None) -> None:
        rid = self.last_rid if rid is None else rid
        if self.mode == "clientserver":
            frame = zmq.Frame(_zmsg(parts))
            if self.serverish:
                frame.routing_id = rid
            self.sock.send(frame)
        elif self.serverish:
            self.sock.send_multipart([rid, b"", *parts])
        else:
            self.sock.send_multipart([b"", *parts])

    def send_label(self, label: str, seqno: int = 0, **kw: Any) -> None:
        self.send(flow_parts(label, seqno, **kw))

    def recv(self, timeout: float = WAIT_S) -> Got:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"nothing received within {timeout} s")
        if self.mode == "clientserver":
            frame = self.sock.recv(copy=False)
            rid = frame.routing_id if self.serverish else None
            self.last_rid = rid if self.serverish else None
            return Got(_unzmsg(frame.bytes), rid, frame.bytes)
        frames = self.sock.recv_multipart()
        if self.serverish:
            assert frames[1] == b"", frames[:3]
            self.last_rid = frames[0]
            return Got(frames[2:], frames[0], frames)
        assert frames[0] == b"", frames[:2]
        return Got(frames[1:], None, frames)

    def quiet(self, window: float = QUIET_S) -> bool:
        """True if nothing arrives within ``window`` seconds."""
        return not self.sock.poll(int(window * 1000))

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def raw(ctx: zmq.Context[Any], peers: Any, wire_mode: str) -> Any:
    def make(serverish: bool = False, connect: str | None = None) -> Raw:
        r = peers(Raw(ctx, wire_mode, serverish))
        if connect:
            r.connect(connect)
        return r

    return make


def _server(ctx: Any, peers: Any, wire_mode: str, **kw: Any) -> ReferenceServer:
    return peers(ReferenceServer(ctx, sockets=wire_mode, **kw))


def _now_us() -> int:
    return time.time_ns() // 1000


# --------------------------------------------------------------------------- wire helpers


def test_zmsg_and_coord_helpers_match_the_spec_example() -> None:
    coord = zr.pack_coord(1, 2, 3)
    assert coord == struct.pack("<QQQ", 1, 2, 3) and zr.unpack_coord(coord) == (1, 2, 3)
    enc = zr.zmsg_encode([b'ZIO0FLOW{"flow": "DAT"}', coord, b"abc"])
    assert enc[:1] == b"\x17" and enc[24:25] == b"\x18" and enc[-4:] == b"\x03abc"
    long = zr.zmsg_encode([b"x" * 300])
    assert long[:5] == b"\xff\x00\x00\x01\x2c"
    assert zr.zmsg_decode(long) == [b"x" * 300]
    assert zr.dumps_label({"flow": "PAY", "credit": 3}, "cpp") == '{"credit":3,"flow":"PAY"}'
    assert zr.dumps_label({"flow": "PAY", "credit": 3}, "python") == (
        '{"flow": "PAY", "credit": 3}'
    )


def test_clientserver_refused_without_draft(ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never create CLIENT/SERVER sockets on a stock pyzmq: a clear error instead."""
    monkeypatch.setattr(zr, "have_draft", lambda: False)
    with pytest.raises(RuntimeError, match="draft"):
        ReferenceServer(ctx, role="giver", flavor="cpp", sockets="clientserver")
    with pytest.raises(RuntimeError, match="draft"):
        ReferenceClientGiver(ctx, "tcp://127.0.0.1:1", [b"x"], flavor="cpp", sockets="clientserver")
    assert ctx.open_sockets() == []


# --------------------------------------------------------------------------- server BOT


def test_cpp_server_bot_reply_is_the_client_bot_echoed(
    ctx: Any, peers: Any, wire_mode: str, raw: Any
) -> None:
    """Facts 7, 8, 4, 5, 6: echo with direction flipped, credit untouched, compact sorted."""
    srv = _server(ctx, peers, wire_mode, role="giver", flavor="cpp", values=[b"v1"], credit=3)
    cl = raw(connect=srv.endpoint)
    bot = '{"flow": "BOT", "direction": "inject", "credit": 7, "encoding": "x", "ack": true}'
    before = _now_us()
    cl.send(flow_parts(bot, origin=77, granule=5, payload=(b"bot-payload",)))
    got = cl.recv()
    assert got.parts[0] == (
        b'ZIO0FLOW{"ack":true,"credit":7,"direction":"extract","encoding":"x","flow":"BOT"}'
    )
    assert got.payload == [b"bot-payload"]
    assert got.seqno == 0
    assert got.origin == 77  # no server origin: the client's stays
    assert before <= got.granule <= _now_us()  # C++ stamps now, in us
    if wire_mode == "routerdealer":
        assert got.frames[0] == b"" and len(got.frames) == 4  # DEALER side: [b"", ...]
    assert srv.bots[0]["encoding"] == "x"
    # The stand-in records its reply after sending it: the client may read it first.
    assert srv.wait_until(lambda: len(srv.replies) == 1)
    assert srv.replies[0]["credit"] == 7


def test_python_server_bot_reply_lowers_credit_and_keeps_order(
    ctx: Any, peers: Any, wire_mode: str, raw: Any
) -> None:
    """Facts 7, 8, 4: Python echoes the client's label in its key order, credit lowered."""
    srv = _server(ctx, peers, wire_mode, role="giver", flavor="python", values=[b"v"], credit=3)
    cl = raw(connect=srv.endpoint)
    cl.send(flow_parts('{"credit":7,"direction":"inject","flow":"BOT","x":1}', granule=5))
    got = cl.recv()
    assert got.label == '{"credit": 3, "direction": "extract", "flow": "BOT", "x": 1}'
    assert (got.seqno, got.granule, got.origin) == (0, 5, 0)


@pytest.mark.parametrize("flavor", zr.FLAVORS)
def test_server_giver_gives_within_paid_credit_then_eot(
    ctx: Any, peers: Any, wire_mode: str, raw: Any, flavor: str
) -> None:
    """Facts 11, 12, 5, 6, 18: DATs only as paid, seqno 1.., EOT, waits for the echo."""
    vals = [b"a", b"b", b"c"]
    srv = _server(ctx, peers, wire_mode, role="giver", flavor=flavor, values=vals, credit=2)
    cl = raw(connect=srv.endpoint)
    cl.send_label('{"credit":2,"direction":"inject","flow":"BOT"}')
    assert cl.recv().obj["direction"] == "extract"
    cl.send_label('{"credit":2,"flow":"PAY","ack":1}', seqno=1)  # unknown attr ignored
    dats = [cl.recv(), cl.recv()]
    assert cl.quiet()  # no more than paid
    dat = '{"flow":"DAT"}' if flavor == "cpp" else '{"flow": "DAT"}'
    assert [d.label for d in dats] == [dat, dat]
    assert [d.payload for d in dats] == [[b"a"], [b"b"]]
    assert [d.seqno for d in dats] == [1, 2]
    cl.send_label('{"credit":1,"flow":"PAY"}', seqno=2)
    last = cl.recv()
    assert (last.payload, last.seqno) == ([b"c"], 3)
    eot = cl.recv()
    assert eot.obj == {"flow": "EOT"} and eot.seqno == 4
    assert eot.label == ('{"flow":"EOT"}' if flavor == "cpp" else '{"flow": "EOT"}')
    assert srv.eot_echoes == 0
    cl.send_label('{"flow":"EOT"}', seqno=3)
    assert srv.wait_until(lambda: srv.eot_echoes == 1 and srv.flows_completed == 1)
    assert srv.sent == vals and srv.errors == []


def test_cpp_server_taker_announces_the_offer_and_pays_less(
    ctx: Any, peers: Any, wire_mode: str, raw: Any
) -> None:
    """Facts 8, 11, 14, 19: reply says 5, PAY says 2; one PAY per DAT; EOT echoed."""
    srv = _server(ctx, peers, wire_mode, role="taker", flavor="cpp", credit=2)
    cl = raw(connect=srv.endpoint)
    cl.send_label('{"credit":5,"direction":"extract","flow":"BOT"}')
    reply = cl.recv()
    assert reply.obj == {"credit": 5, "direction": "inject", "flow": "BOT"}
    pay = cl.recv()
    assert pay.label == '{"credit":2,"flow":"PAY"}' and pay.seqno == 1
    assert cl.quiet()  # 2 is all that is paid
    cl.send(flow_parts('{"flow":"DAT","seq":1,"ack":true}', 1, payload=(b"x",)))
    cl.send(flow_parts('{"flow":"DAT"}', 2, payload=(b"y",)))
    pays = [cl.recv(), cl.recv()]
    assert [p.obj["credit"] for p in pays] == [1, 1] and [p.seqno for p in pays] == [2, 3]
    cl.send_label('{"flow":"EOT"}', seqno=3)
    echo = cl.recv()
    assert echo.label == '{"flow":"EOT"}' and echo.seqno == 4
    assert srv.wait_until(lambda: srv.flows_completed == 1)
    assert srv.received == [b"x", b"y"] and srv.eots_received == 1
    assert srv.received_labels[0]["seq"] == 1


def test_python_server_taker_cannot_pay(ctx: Any, peers: Any, wire_mode: str, raw: Any) -> None:
    """Fact 17: the BOT reply goes out, the PAY never does (no routing id)."""
    srv = _server(ctx, peers, wire_mode, role="taker", flavor="python", credit=4)
    cl = raw(connect=srv.endpoint)
    cl.send_label('{"credit":4,"direction":"extract","flow":"BOT"}')
    assert cl.recv().obj["direction"] == "inject"
    assert cl.quiet()
    assert srv.wait_until(lambda: srv.flows_died == 1)
    assert "routing id" in srv.errors[0] and srv.pays_sent == []


# --------------------------------------------------------------------------- quirks


@pytest.mark.parametrize("flavor", zr.FLAVORS)
def test_zero_credit_pay_kills_a_blocked_giver(
    ctx: Any, peers: Any, wire_mode: str, raw: Any, flavor: str
) -> None:
    """Fact 13: PAY 0 to a giver blocked for credit: the flow dies, silence follows."""
    vals = [b"1", b"2", b"3", b"4"]
    srv = _server(ctx, peers, wire_mode, role="giver", flavor=flavor, values=vals, credit=2)
    cl = raw(connect=srv.endpoint)
    cl.send_label('{"credit":2,"direction":"inject","flow":"BOT"}')
    cl.recv()
    cl.send_label('{"credit":2,"flow":"PAY"}', seqno=1)
    cl.recv()
    cl.recv()
    assert srv.wait_until(lambda: srv.blocked_for_credit)
    cl.send_label('{"credit":0,"flow":"PAY"}', seqno=2)
    assert srv.wait_until(lambda: srv.flows_died == 1)
    assert srv.zero_credit_pays == 1 and "zero-credit" in srv.errors[0]
    cl.send_label('{"credit":2,"flow":"PAY"}', seqno=3)  # too late: nobody is listening
    assert cl.quiet()  # no DAT, no EOT
    assert srv.sent == vals[:2] and srv.eot_echoes == 0


def test_cpp_giver_drops_a_pay_beyond_its_lowered_total(
    ctx: Any, peers: Any, wire_mode: str, raw: Any
) -> None:
    """Facts 8, 15: a client that trusts the echoed credit overpays; nothing is given."""
    srv = _server(ctx, peers, wire_mode, role="giver", flavor="cpp", values=[b"a"], credit=2)
    cl = raw(connect=srv.endpoint)
    cl.send_label('{"credit":5,"direction":"inject","flow":"BOT"}')
    assert cl.recv().obj["credit"] == 5  # announced: the client's own offer
    cl.send_label('{"credit":5,"flow":"PAY"}', seqno=1)
    assert cl.quiet()
    assert srv.sent == [] and srv.pays_received == [5]


@pytest.mark.parametrize(
    ("flavor", "role"), [("cpp", "taker"), ("cpp", "giver"), ("python", "giver")]
)
def test_second_bot_kills_the_flow_in_progress(
    ctx: Any, peers: Any, wire_mode: str, raw: Any, flavor: str, role: str
) -> None:
    """Fact 16: a second client's BOT kills the flow; nobody is answered; BOT again works."""
    vals = [b"a", b"b", b"c"]
    srv = _server(ctx, peers, wire_mode, role=role, flavor=flavor, values=vals, credit=2)
    first = raw(connect=srv.endpoint)
    second = raw(connect=srv.endpoint)
    their = "extract" if role == "taker" else "inject"
    first.send_label(f'{{"credit":2,"direction":"{their}","flow":"BOT"}}')
    first.recv()
    if role == "taker":
        first.recv()  # the PAY; the server now waits in get()
    else:
        first.send_label('{"credit":2,"flow":"PAY"}', seqno=1)
        first.recv()
        first.recv()
        assert srv.wait_until(lambda: srv.blocked_for_credit)
    second.send_label(f'{{"credit":2,"direction":"{their}","flow":"BOT"}}')
    assert srv.wait_until(lambda: srv.flows_killed == 1)
    assert first.quiet() and second.quiet()
    assert len(srv.bots) == 2 and len(srv.replies) == 1
    second.send_label(f'{{"credit":2,"direction":"{their}","flow":"BOT"}}')
    assert second.recv().obj["flow"] == "BOT"
    assert srv.wait_until(lambda: srv.flows_started == 2)


def test_client_eot_to_cpp_giver_is_echoed(ctx: Any, peers: Any, wire_mode: str, raw: Any) -> None:
    """Facts 18, 19: the taker ends the flow; the C++ giver acknowledges with EOT."""
    vals = [b"a", b"b", b"c"]
    srv = _server(ctx, peers, wire_mode, role="giver", flavor="cpp", values=vals, credit=1)
    cl = raw(connect=srv.endpoint)
    cl.send_label('{"credit":1,"direction":"inject","flow":"BOT"}')
    cl.recv()
    cl.send_label('{"credit":1,"flow":"PAY"}', seqno=1)
    assert cl.recv().payload == [b"a"]
    assert srv.wait_until(lambda: srv.blocked_for_credit)
    cl.send_label('{"flow":"EOT"}', seqno=2)
    echo = cl.recv()
    assert echo.label == '{"flow":"EOT"}' and echo.seqno == 2
    assert srv.wait_until(lambda: srv.flows_completed == 1)
    assert srv.eots_received == 1 and srv.sent == [b"a"]


@pytest.mark.requires_draft
def test_clientserver_long_part_uses_the_long_length(ctx: Any, peers: Any) -> None:
    """Fact 3: a part of 255+ bytes is 0xFF + 4-byte big-endian length."""
    value = bytes(range(256)) * 2
    srv = peers(
        ReferenceServer(ctx, role="giver", flavor="cpp", sockets="clientserver", values=[value])
    )
    cl = peers(Raw(ctx, "clientserver", serverish=False)).connect(srv.endpoint)
    cl.send_label('{"credit":1,"direction":"inject","flow":"BOT"}')
    cl.recv()
    cl.send_label('{"credit":1,"flow":"PAY"}', seqno=1)
    dat = cl.recv()
    assert dat.payload == [value]
    prefix = b'ZIO0FLOW{"flow":"DAT"}'
    assert dat.frames[: 1 + len(prefix)] == bytes([len(prefix)]) + prefix  # short length
    tail = dat.frames[-(len(value) + 5) :]
    assert tail[:5] == b"\xff" + struct.pack(">I", len(value))


# --------------------------------------------------------------------------- clients


@pytest.mark.parametrize("flavor", zr.FLAVORS)
def test_client_giver_against_a_raw_server(
    ctx: Any, peers: Any, wire_mode: str, raw: Any, flavor: str
) -> None:
    """Facts 2, 4, 5, 6, 9, 12, 18: BOT with its own credit, DATs as paid, EOT, echo."""
    srv = raw(serverish=True)
    endpoint = srv.bind()
    vals = [b"p", b"q", b"r"]
    before = _now_us()
    giver = peers(
        ReferenceClientGiver(ctx, endpoint, vals, flavor=flavor, sockets=wire_mode, credit=4)
    )
    bot = srv.recv()
    if flavor == "cpp":
        assert bot.label == '{"credit":4,"direction":"extract","flow":"BOT"}'
        assert before <= bot.granule <= _now_us()
    else:
        assert bot.label == '{"flow": "BOT", "credit": 4, "direction": "extract"}'
        assert bot.granule == 0
    assert bot.seqno == 0 and bot.payload == []
    if wire_mode == "routerdealer":
        assert bot.frames[1] == b"" and len(bot.frames) == 4  # [identity, b"", prefix, coord]
    srv.send_label('{"credit":2,"direction":"inject","flow":"BOT"}')
    assert giver.wait_until(lambda: giver.total_credit == 2)
    srv.send_label('{"credit":2,"flow":"PAY"}', seqno=1)
    dats = [srv.recv(), srv.recv()]
    assert srv.quiet()
    assert [d.payload for d in dats] == [[b"p"], [b"q"]] and [d.seqno for d in dats] == [1, 2]
    assert dats[0].obj == {"flow": "DAT"}
    srv.send_label('{"credit":2,"flow":"PAY"}', seqno=2)
    assert srv.recv().payload == [b"r"]
    eot = srv.recv()
    assert eot.obj == {"flow": "EOT"} and eot.seqno == 4
    assert not giver.finished
    srv.send_label('{"flow":"EOT"}', seqno=3)
    assert giver.wait(WAIT_S)
    assert giver.eot_echoes == 1 and giver.sent == vals and giver.errors == []


@pytest.mark.parametrize("flavor", zr.FLAVORS)
def test_client_taker_pays_and_echoes(
    ctx: Any, peers: Any, wire_mode: str, raw: Any, flavor: str
) -> None:
    """Facts 11, 6, 18, 20: PAY total then 1 per DAT; EOT echoed (Python only under -O)."""
    srv = raw(serverish=True)
    endpoint = srv.bind()
    taker = peers(
        ReferenceClientTaker(
            ctx, endpoint, flavor=flavor, sockets=wire_mode, credit=3, python_asserts=False
        )
    )
    bot = srv.recv()
    assert bot.obj == {"flow": "BOT", "credit": 3, "direction": "inject"}
    srv.send_label('{"credit":2,"direction":"extract","flow":"BOT","x":"y"}')
    pay = srv.recv()
    want = '{"credit":2,"flow":"PAY"}' if flavor == "cpp" else '{"flow": "PAY", "credit": 2}'
    assert pay.label == want and pay.seqno == 1
    srv.send(flow_parts('{"flow":"DAT","seq":9}', 1, payload=(b"d1",)))
    assert srv.recv().obj["credit"] == 1
    srv.send(flow_parts('{"flow":"DAT"}', 2, payload=(b"d2",)))
    srv.send_label('{"flow":"EOT"}', seqno=3)
    msgs = [srv.recv(), srv.recv()]
    assert [m.obj["flow"] for m in msgs] == ["PAY", "EOT"]
    assert taker.wait(WAIT_S)
    assert taker.received == [b"d1", b"d2"] and taker.received_labels[0]["seq"] == 9
    assert taker.reply == {"credit": 2, "direction": "extract", "flow": "BOT", "x": "y"}
    assert taker.eots_received == 1


def test_python_client_taker_never_echoes_eot(
    ctx: Any, peers: Any, wire_mode: str, raw: Any
) -> None:
    """Fact 20: the Python taker's get() asserts on the giver's EOT: no echo."""
    srv = raw(serverish=True)
    endpoint = srv.bind()
    taker = peers(ReferenceClientTaker(ctx, endpoint, flavor="python", sockets=wire_mode))
    srv.recv()
    srv.send_label('{"flow": "BOT", "credit": 1, "direction": "extract"}')
    srv.recv()  # PAY 1
    srv.send(flow_parts('{"flow":"DAT"}', 1, payload=(b"only",)))
    assert srv.recv().obj == {"flow": "PAY", "credit": 1}
    srv.send_label('{"flow":"EOT"}', seqno=2)
    assert srv.quiet()
    assert taker.wait_until(lambda: taker.finished)
    assert not taker.done and "AssertionError" in taker.errors[0]
    assert taker.received == [b"only"]


@pytest.mark.parametrize("flavor", zr.FLAVORS)
def test_reference_peers_talk_to_each_other(
    ctx: Any, peers: Any, wire_mode: str, flavor: str
) -> None:
    """The stand-in's own pairs complete a flow (client giver -> C++ server taker, and a
    server giver -> client taker), the reference's usual topologies."""
    taker_srv = peers(ReferenceServer(ctx, role="taker", flavor="cpp", sockets=wire_mode))
    vals = [str(i).encode() for i in range(25)]
    giver = peers(
        ReferenceClientGiver(
            ctx, taker_srv.endpoint, vals, flavor=flavor, sockets=wire_mode, credit=3
        )
    )
    assert giver.wait(WAIT_S), giver.errors
    assert taker_srv.wait_until(lambda: taker_srv.flows_completed == 1)
    assert taker_srv.received == vals

    giver_srv = peers(
        ReferenceServer(ctx, role="giver", flavor=flavor, sockets=wire_mode, values=vals)
    )
    taker = peers(
        ReferenceClientTaker(ctx, giver_srv.endpoint, flavor="cpp", sockets=wire_mode, credit=4)
    )
    assert taker.wait(WAIT_S), taker.errors
    assert taker.received == vals
    assert giver_srv.wait_until(lambda: giver_srv.eot_echoes == 1)
