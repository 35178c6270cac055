"""Loopback tests of zio_spark.transport.port: both wire modes, bad input, CURVE, ZMTP/2.0.

Every wait is a poll with a deadline: a lost message fails the test, nothing hangs, and
nothing sleeps. Endpoints are 127.0.0.1 random ports, unique inproc names or ipc under
tmp_path.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from zio_spark.errors import (
    ConfigError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
)
from zio_spark.options import Curve
from zio_spark.protocol.message import (
    DAT_LABEL,
    DatCodec,
    Message,
    decode_frames,
    encode_frames,
    encode_single,
)
from zio_spark.transport.curve import (
    client_curve,
    optional_client_curve,
    optional_server_curve,
    server_curve,
    start_authenticator,
)
from zio_spark.transport.port import (
    BadMessage,
    ClientPort,
    PortKind,
    ServerPort,
    SocketMode,
    UnknownPeerError,
    choose_mode,
    socket_type_name,
)

WAIT_MS = 5000  # for things that must happen: generous, returns as soon as they do
QUIET_MS = 200  # for things that must not happen

MakeServer = Callable[..., ServerPort]
MakeClient = Callable[..., ClientPort]
RawSocket = Callable[[int], zmq.Socket[bytes]]


def flow(obj: dict[str, Any], *, seqno: int = 0, origin: int = 0, payload=()) -> Message:
    return Message("FLOW", json.dumps(obj), origin=origin, seqno=seqno, payload=tuple(payload))


BOT = {"flow": "BOT", "direction": "inject", "credit": 3}


def recv_within(sock: zmq.Socket[bytes], timeout_ms: int = WAIT_MS) -> list[bytes] | None:
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return sock.recv_multipart()


def server_recv(server: ServerPort, timeout_ms: int = WAIT_MS) -> tuple[Any, Message]:
    got = server.recv(timeout_ms)
    assert got is not None, f"nothing received within {timeout_ms} ms"
    assert not isinstance(got, BadMessage), got
    return got


def client_recv(client: ClientPort, timeout_ms: int = WAIT_MS) -> Message:
    got = client.recv(timeout_ms)
    assert got is not None, f"nothing received within {timeout_ms} ms"
    assert not isinstance(got, BadMessage), got
    return got


def tcp_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# --------------------------------------------------------------------------- choose_mode


@pytest.fixture
def drafts(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Pretend libzmq has (or lacks) the draft API, for choose_mode only."""

    def set_drafts(available: bool) -> None:
        real = zmq.has

        def fake_has(capability: str) -> bool:
            return available if capability == "draft" else real(capability)

        monkeypatch.setattr(zmq, "has", fake_has)

    return set_drafts


@pytest.mark.parametrize("drafts_on", [False, True])
@pytest.mark.parametrize("requested", [None, "auto", "AUTO", " auto "])
def test_choose_mode_defaults_to_routerdealer_when_nothing_is_known(drafts, drafts_on, requested):
    drafts(drafts_on)
    assert choose_mode(requested, None) is SocketMode.ROUTERDEALER


def test_explicit_clientserver_without_drafts_is_a_transport_error(drafts):
    drafts(False)
    with pytest.raises(TransportError, match=r"draft-enabled pyzmq.*build-draft-pyzmq\.sh"):
        choose_mode("clientserver", None)
    with pytest.raises(TransportError, match="draft"):
        choose_mode(SocketMode.CLIENTSERVER, "SERVER")


def test_explicit_modes_with_drafts(drafts):
    drafts(True)
    assert choose_mode("clientserver", None) is SocketMode.CLIENTSERVER
    assert choose_mode("ClientServer", "server") is SocketMode.CLIENTSERVER
    assert choose_mode("routerdealer", None) is SocketMode.ROUTERDEALER
    assert choose_mode(SocketMode.ROUTERDEALER, "ROUTER") is SocketMode.ROUTERDEALER


@pytest.mark.parametrize("peer", ["SERVER", "CLIENT", "server", " Client "])
def test_auto_follows_a_clientserver_peer_when_drafts_exist(drafts, peer):
    drafts(True)
    assert choose_mode("auto", peer) is SocketMode.CLIENTSERVER
    assert choose_mode(None, peer) is SocketMode.CLIENTSERVER


@pytest.mark.parametrize("peer", ["SERVER", "CLIENT"])
def test_auto_with_a_clientserver_peer_and_no_drafts_is_a_transport_error(drafts, peer):
    drafts(False)
    with pytest.raises(TransportError, match=f"advertises a {peer} socket.*draft"):
        choose_mode("auto", peer)


@pytest.mark.parametrize("drafts_on", [False, True])
@pytest.mark.parametrize("peer", ["ROUTER", "DEALER", "router"])
def test_auto_follows_a_routerdealer_peer(drafts, drafts_on, peer):
    drafts(drafts_on)
    assert choose_mode("auto", peer) is SocketMode.ROUTERDEALER


def test_explicit_mode_contradicting_the_peer_is_a_transport_error(drafts):
    drafts(True)
    with pytest.raises(TransportError, match="deliver nothing"):
        choose_mode("routerdealer", "SERVER")
    with pytest.raises(TransportError, match="deliver nothing"):
        choose_mode("clientserver", "DEALER")


def test_choose_mode_rejects_unknown_values(drafts):
    drafts(True)
    with pytest.raises(ConfigError) as e:
        choose_mode("zmtp", None, option="socketMode")
    assert e.value.option == "socketMode" and e.value.value == "zmtp"
    assert isinstance(e.value, ValueError)
    with pytest.raises(RemoteProtocolError) as r:
        choose_mode("auto", "PUB")
    assert r.value.field == "socket" and r.value.value == "PUB"


def test_socket_type_names():
    assert socket_type_name("server", "clientserver") == "SERVER"
    assert socket_type_name(PortKind.CLIENT, SocketMode.CLIENTSERVER) == "CLIENT"
    assert socket_type_name("server", "routerdealer") == "ROUTER"
    assert socket_type_name("client", "routerdealer") == "DEALER"
    with pytest.raises(ConfigError):
        socket_type_name("broker", "routerdealer")


@pytest.mark.skipif(zmq.DRAFT_API, reason="checks the guard of a pyzmq without drafts")
def test_no_clientserver_socket_is_ever_created_without_drafts(ctx, drafts):
    # Even if zmq.has('draft') lies, the port checks zmq.DRAFT_API before any socket.
    drafts(True)
    for cls in (ServerPort, ClientPort):
        with pytest.raises(TransportError, match="draft"):
            cls(ctx, mode="clientserver", linger_ms=0)
    assert not ctx.open_sockets()


def test_importing_the_transport_opens_nothing():
    code = (
        "import threading, zmq, zio_spark.transport, zio_spark.transport.port\n"
        "assert zmq.Context._instance is None, 'a global context was created'\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_ports_default_to_routerdealer(make_server, make_client):
    server, client = make_server(), make_client()
    assert server.mode is SocketMode.ROUTERDEALER and server.socket_type == "ROUTER"
    assert client.mode is SocketMode.ROUTERDEALER and client.socket_type == "DEALER"
    assert server.socket.getsockopt(zmq.TYPE) == zmq.ROUTER
    assert client.socket.getsockopt(zmq.TYPE) == zmq.DEALER


# ------------------------------------------------------------------ routerdealer round trips


@pytest.mark.parametrize("transport", ["tcp", "ipc", "inproc"])
def test_round_trip_routerdealer(
    request, make_server, make_client, transport, tcp_any, inproc_endpoint
):
    where = {"tcp": tcp_any, "inproc": inproc_endpoint}.get(transport)
    if where is None:
        where = request.getfixturevalue("ipc_endpoint")
    server, client = make_server(), make_client()
    endpoint = server.bind(where)
    assert server.endpoint == endpoint and server.endpoints == (endpoint,)
    if transport == "tcp":
        assert endpoint.startswith("tcp://127.0.0.1:") and tcp_port(endpoint) > 0
    else:
        assert endpoint == where
    client.connect(endpoint)

    big_label = {"flow": "BOT", "direction": "inject", "credit": 7, "note": "é" * 100_000}
    payload = (b"", b"\x00\xff" * 10, bytes(range(256)) * 4096)  # empty, binary, 1 MiB
    sent = flow(big_label, origin=2**64 - 1, seqno=0, payload=payload)
    client.send(sent)
    peer, got = server_recv(server)
    assert got == sent
    assert isinstance(peer, bytes) and peer == server.last_peer

    reply = flow({"flow": "BOT", "direction": "extract", "credit": 3}, seqno=1, payload=[b"ok"])
    server.send(reply, peer)
    assert client_recv(client) == reply
    reply2 = Message("LOG", "plain text label", level=4, granule=12345, seqno=2)
    server.send(reply2)  # routing_id=None: reply to the last peer
    assert client_recv(client) == reply2
    assert server.stats == {"sent": 2, "received": 1, "bad_messages": 0}
    assert client.stats == {"sent": 1, "received": 2, "bad_messages": 0}


def test_fallback_envelope_from_client_port_byte_for_byte(make_client, raw_socket, tcp_any):
    router = raw_socket(zmq.ROUTER)
    router.bind(tcp_any)
    client = make_client()
    client.connect(router.last_endpoint.decode())

    msg = flow({"flow": "DAT"}, origin=1, seqno=5, payload=[b"p1", b"p2"])
    client.send(msg)
    wire = recv_within(router)
    assert wire is not None
    identity = wire[0]
    assert wire[1:] == [b"", b'ZIO0FLOW{"flow": "DAT"}', struct.pack("<QQQ", 1, 0, 5), b"p1", b"p2"]

    # and the way back: [identity][empty][prefix][coord][payload]
    coord = struct.pack("<QQQ", 9, 8, 7)
    router.send_multipart([identity, b"", b"ZIO4TEXTlabel \xc3\xa9", coord, b"body"])
    assert client_recv(client) == Message(
        "TEXT", "label é", level=4, origin=9, granule=8, seqno=7, payload=(b"body",)
    )


def test_fallback_envelope_to_server_port_byte_for_byte(make_server, raw_socket, tcp_any):
    server = make_server()
    endpoint = server.bind(tcp_any)
    dealer = raw_socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"dealer-1")
    dealer.connect(endpoint)

    prefix = b'ZIO0FLOW{"flow": "BOT", "direction": "inject", "credit": 3}'
    coord = struct.pack("<QQQ", 42, 0, 0)
    dealer.send_multipart([b"", prefix, coord, b"x"])
    peer, msg = server_recv(server)
    assert peer == b"dealer-1"
    assert msg == Message("FLOW", prefix[8:].decode(), origin=42, payload=(b"x",))

    server.send(flow({"flow": "PAY", "credit": 2}, origin=3, seqno=1), peer)
    assert recv_within(dealer) == [
        b"",
        b'ZIO0FLOW{"flow": "PAY", "credit": 2}',
        struct.pack("<QQQ", 3, 0, 1),
    ]


def test_two_clients_get_their_own_replies(make_server, make_client, tcp_any):
    server = make_server()
    endpoint = server.bind(tcp_any)
    clients = [make_client(), make_client()]
    for i, c in enumerate(clients):
        c.connect(endpoint)
        c.send(flow(BOT, origin=100 + i))
    peers = {}
    for _ in clients:
        peer, msg = server_recv(server)
        peers[msg.origin] = peer
    assert set(peers) == {100, 101} and peers[100] != peers[101]
    # reply in the opposite order to the arrival order
    for origin in (101, 100):
        server.send(flow({"flow": "PAY", "credit": 1}, origin=origin), peers[origin])
    for i, c in enumerate(clients):
        assert client_recv(c).origin == 100 + i
    for c in clients:
        assert c.recv(QUIET_MS) is None


def test_raw_frames_fast_path(make_server, make_client, inproc_endpoint):
    server, client = make_server(), make_client()
    client.connect(server.bind(inproc_endpoint))
    parts = encode_frames(flow({"flow": "DAT"}, seqno=3, payload=[b"a", b"b"]))
    client.send_frames(parts)
    got = server.recv_frames(WAIT_MS)
    assert not isinstance(got, BadMessage) and got is not None
    peer, frames = got
    assert frames == parts
    server.send_frames(parts, peer)
    assert client.recv_frames(WAIT_MS) == parts


# ------------------------------------------------------------------------ errors and limits


def test_send_to_unknown_peer_is_a_transport_error(make_server, make_client, tcp_any):
    server = make_server()
    endpoint = server.bind(tcp_any)
    with pytest.raises(UnknownPeerError) as e:
        server.send(flow(BOT), b"\x00nobody")
    assert isinstance(e.value, TransportError)
    assert e.value.peer == b"\x00nobody" and e.value.endpoint == endpoint
    assert "identity 0x006e6f626f6479" in str(e.value)

    # a peer that went away becomes unknown too (the disconnect is noticed asynchronously)
    client = make_client()
    client.connect(endpoint)
    client.send(flow(BOT))
    peer, _ = server_recv(server)
    client.close()
    deadline = time.monotonic() + WAIT_MS / 1000
    with pytest.raises(UnknownPeerError):
        while time.monotonic() < deadline:
            server.send(flow({"flow": "PAY", "credit": 1}), peer)
            server.recv(10)  # paces the loop on a poll, not a sleep
    assert server.stats["bad_messages"] == 0


def test_send_needs_a_peer_of_the_right_kind(make_server, tcp_any):
    server = make_server()
    server.bind(tcp_any)
    with pytest.raises(LocalProtocolError, match="no message has been received"):
        server.send(flow(BOT))
    with pytest.raises(LocalProtocolError, match="ROUTER routing_id"):
        server.send(flow(BOT), 5)


MODES = [
    "routerdealer",
    pytest.param("clientserver", marks=pytest.mark.requires_draft),
]


@pytest.mark.parametrize("mode", MODES)
def test_send_raises_when_nothing_can_be_queued(make_client, mode):
    client = make_client(mode=mode)  # never connected: no pipe to queue on
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="could not queue") as e:
        client.send(flow(BOT), timeout_ms=50)
    assert time.monotonic() - t0 >= 0.045
    assert not isinstance(e.value, UnknownPeerError)


@pytest.mark.parametrize("mode", MODES)
def test_send_raises_when_the_clients_queue_is_full(
    make_server, make_client, inproc_endpoint, mode
):
    # ROUTER (mandatory) and SERVER report POLLOUT although this peer's queue is full:
    # this exercises the back-off, and the deadline must still hold.
    server = make_server(sndhwm=1, mode=mode)
    client = make_client(rcvhwm=1, mode=mode)
    client.connect(server.bind(inproc_endpoint))
    client.send(flow(BOT))
    peer, _ = server_recv(server)
    with pytest.raises(TransportError, match="queue is full") as e:
        for seqno in range(1, 1000):  # the client never reads
            t0 = time.monotonic()
            server.send(flow({"flow": "DAT"}, seqno=seqno), peer, timeout_ms=20)
    assert 0.018 <= time.monotonic() - t0 < 2
    assert not isinstance(e.value, UnknownPeerError)
    assert 1 <= server.stats["sent"] < 1000


@pytest.mark.parametrize("mode", MODES)
def test_client_send_raises_when_the_server_does_not_read(
    make_server, make_client, inproc_endpoint, mode
):
    server = make_server(rcvhwm=1, mode=mode)
    client = make_client(sndhwm=1, send_timeout_ms=20, mode=mode)
    client.connect(server.bind(inproc_endpoint))
    with pytest.raises(TransportError, match="could not queue"):
        for seqno in range(1000):
            client.send(flow({"flow": "DAT"}, seqno=seqno))
    assert 1 <= client.stats["sent"] < 1000


@pytest.mark.parametrize("mode", MODES)
def test_recv_times_out_with_none(make_server, make_client, tcp_any, mode):
    server, client = make_server(mode=mode), make_client(mode=mode)
    client.connect(server.bind(tcp_any))
    t0 = time.monotonic()
    assert server.recv(60) is None
    assert client.recv(60) is None
    assert time.monotonic() - t0 >= 0.11
    assert server.recv(0) is None and client.recv_frames(0) is None


def test_bind_and_connect_errors_name_the_endpoint(make_server, make_client, tcp_any):
    server = make_server()
    endpoint = server.bind(tcp_any)
    other = make_server()
    with pytest.raises(TransportError) as e:
        other.bind(endpoint)
    assert e.value.endpoint == endpoint
    with pytest.raises(TransportError) as e:
        other.bind("nonsense://x")
    assert e.value.endpoint == "nonsense://x"
    with pytest.raises(TransportError):
        make_client().connect("tcp://no-port")


def test_close_is_idempotent_and_ports_are_context_managers(ctx, inproc_endpoint):
    with ServerPort(ctx, linger_ms=0) as server:
        server.bind(inproc_endpoint)
        with ClientPort(ctx, linger_ms=0) as client:
            client.connect(inproc_endpoint)
            client.send(flow(BOT))
            server_recv(server)
        assert client.closed
        client.close()
    assert server.closed and "closed" in repr(server)
    server.close()
    with pytest.raises(TransportError, match="closed"):
        server.recv(10)
    with pytest.raises(TransportError, match="closed"):
        client.send(flow(BOT))


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"linger_ms": -2}, "linger_ms"),
        ({"sndhwm": -1}, "sndhwm"),
        ({"rcvhwm": 1.5}, "rcvhwm"),
        ({"send_timeout_ms": -1}, "send_timeout_ms"),
        ({"on_bad_message": "ignore"}, "on_bad_message"),
        ({"mode": "pushpull"}, "mode"),
    ],
)
def test_bad_options_are_config_errors(ctx, kwargs, option):
    with pytest.raises(ConfigError) as e:
        ServerPort(ctx, **kwargs)
    assert e.value.option == option


def test_bad_timeout_is_a_config_error(make_client):
    client = make_client()
    with pytest.raises(ConfigError):
        client.recv(-5)
    # A good timeout, checked once and remembered, must not let a bad one through.
    assert client.recv(1) is None
    for bad in (True, float("nan"), "1", -1):
        with pytest.raises(ConfigError):
            client.recv(bad)  # type: ignore[arg-type]
    assert client.recv(1.0) is None


# ------------------------------------------------------------------------------- bad input


GARBAGE = [
    ([b"no delimiter", b"ZIO0FLOW{}"], "envelope"),
    ([b""], "frames"),
    ([b"", b"XYZ0FLOW", bytes(24)], "magic"),
    ([b"", b"ZIO9FLOW", bytes(24)], "level"),
    ([b"", b"ZIO0FLOW{not json", bytes(24)], "label"),
    ([b"", b'ZIO0FLOW{"credit": 1}', bytes(24)], "flow"),
    ([b"", b"ZIO0TEXT", bytes(23)], "coord"),
]


def test_garbage_is_counted_logged_and_the_port_keeps_serving(
    make_server, make_client, raw_socket, tcp_any, caplog
):
    caplog.set_level(logging.WARNING, logger="zio_spark.transport")
    server = make_server()
    endpoint = server.bind(tcp_any)
    bad = raw_socket(zmq.DEALER)
    bad.setsockopt(zmq.ROUTING_ID, b"evil")
    bad.connect(endpoint)
    good = make_client()
    good.connect(endpoint)

    for frames, _ in GARBAGE:
        bad.send_multipart(frames)
    good.send(flow(BOT, origin=7))

    fields = []
    good_peer = None
    deadline = time.monotonic() + WAIT_MS / 1000
    while (len(fields) < len(GARBAGE) or good_peer is None) and time.monotonic() < deadline:
        got = server.recv(100)
        if isinstance(got, BadMessage):
            assert got.peer == b"evil" and got.error.peer == b"evil"
            fields.append(got.error.field)
        elif got is not None:
            good_peer, msg = got
            assert msg.origin == 7
    assert sorted(fields) == sorted(f for _, f in GARBAGE)
    assert server.stats["bad_messages"] == len(GARBAGE)
    assert server.stats["received"] == 1

    server.send(flow({"flow": "BOT", "direction": "extract", "credit": 3}), good_peer)
    assert client_recv(good).label.startswith('{"flow": "BOT"')
    assert server.last_peer == good_peer  # garbage never becomes the reply target

    lines = [r.getMessage() for r in caplog.records if r.name == "zio_spark.transport"]
    assert len(lines) == len(GARBAGE)
    assert all("identity 0x" + b"evil".hex() in line for line in lines)
    assert any("field=magic" in line and "bad magic" in line for line in lines)


def test_garbage_raises_in_raise_mode_and_the_port_continues(
    make_server, make_client, raw_socket, inproc_endpoint
):
    server = make_server(on_bad_message="raise")
    server.bind(inproc_endpoint)
    bad = raw_socket(zmq.DEALER)
    bad.setsockopt(zmq.ROUTING_ID, b"evil")
    bad.connect(inproc_endpoint)
    bad.send_multipart([b"", b"garbage", b"x"])
    with pytest.raises(RemoteProtocolError) as e:
        server.recv(WAIT_MS)
    assert e.value.peer == b"evil" and e.value.field == "prefix"
    assert server.stats["bad_messages"] == 1

    good = make_client()
    good.connect(inproc_endpoint)
    good.send(flow(BOT))
    _, msg = server_recv(server)
    assert msg == flow(BOT)


def test_client_port_reports_a_broken_envelope(make_client, raw_socket, inproc_endpoint):
    router = raw_socket(zmq.ROUTER)
    router.bind(inproc_endpoint)
    client = make_client()
    client.connect(inproc_endpoint)
    client.send(flow(BOT))
    identity = recv_within(router)[0]
    router.send_multipart([identity, b"ZIO0FLOW{}", bytes(24)])  # no delimiter
    got = client.recv(WAIT_MS)
    assert isinstance(got, BadMessage)
    assert got.error.field == "envelope" and got.peer == inproc_endpoint
    router.send_multipart([identity, b"", *encode_frames(flow({"flow": "EOT"}))])
    assert client_recv(client) == flow({"flow": "EOT"})
    assert client.stats["bad_messages"] == 1


def test_fast_path_callers_report_their_own_decoding_errors(
    make_server, raw_socket, inproc_endpoint
):
    server = make_server()
    server.bind(inproc_endpoint)
    dealer = raw_socket(zmq.DEALER)
    dealer.connect(inproc_endpoint)
    dealer.send_multipart([b"", b"ZIO0FLOWnot json", bytes(24)])
    got = server.recv_frames(WAIT_MS)  # the envelope is fine: no judgement yet
    assert got is not None and not isinstance(got, BadMessage)
    peer, frames = got
    with pytest.raises(RemoteProtocolError) as e:
        decode_frames(frames)
    marker = server.report_bad_message(peer, e.value, frames)
    assert marker.peer == peer and marker.frames[0] == b"ZIO0FLOWnot json"
    assert server.stats["bad_messages"] == 1


# -------------------------------------------------------------------------------- recv_many


def _garbage(raw_socket: RawSocket, mode: str, endpoint: str) -> Callable[[], None]:
    """A raw peer of the right kind; the returned call sends it one broken message."""
    if mode == "clientserver":
        bad = raw_socket(zmq.CLIENT)
        bad.connect(endpoint)
        return lambda: bad.send(b"\x07garbage!")  # a prefix length past the frame's end
    bad = raw_socket(zmq.DEALER)
    bad.connect(endpoint)
    return lambda: bad.send_multipart([b"", b"garbage", b"x"])


def _connected(
    make_server: MakeServer, make_client: MakeClient, endpoint: str, mode: str, **server_kw: Any
) -> tuple[ServerPort, ClientPort]:
    server = make_server(mode=mode, **server_kw)
    server.bind(endpoint)
    client = make_client(mode=mode)
    client.connect(endpoint)
    return server, client


@pytest.mark.parametrize("mode", MODES)
def test_server_recv_many_takes_what_is_queued_in_order(
    make_server, make_client, inproc_endpoint, mode
):
    server, client = _connected(make_server, make_client, inproc_endpoint, mode)
    sent = [flow({"flow": "DAT"}, seqno=i, payload=(b"r%d" % i,)) for i in range(10)]
    for msg in sent:
        client.send(msg)  # inproc: queued at the server when send returns
    batches = [server.recv_many(4, WAIT_MS) for _ in range(3)]
    assert [len(b) for b in batches] == [4, 4, 2]
    got = [item for b in batches for item in b]
    assert [msg for _, msg in got] == sent
    assert len({peer for peer, _ in got}) == 1 and server.last_peer == got[0][0]
    assert server.stats["received"] == 10
    t0 = time.monotonic()
    assert server.recv_many(4, QUIET_MS) == []  # nothing more: waits, then empty
    assert time.monotonic() - t0 >= QUIET_MS / 1000 * 0.9
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ConfigError, match="max_n"):
            server.recv_many(bad, 0)
        with pytest.raises(ConfigError, match="max_bytes"):
            server.recv_many(10, 0, max_bytes=bad)


@pytest.mark.parametrize("mode", MODES)
def test_recv_many_ends_a_batch_at_max_bytes(make_server, make_client, inproc_endpoint, mode):
    server, client = _connected(make_server, make_client, inproc_endpoint, mode)
    sent = [flow({"flow": "DAT"}, seqno=i, payload=(bytes(1000),)) for i in range(10)]
    for msg in sent:
        client.send(msg)
    # ~1,050 bytes each on the wire: the third takes the batch past 2,500.
    got = server.recv_many(100, WAIT_MS, max_bytes=2500)
    assert [m for _, m in got] == sent[:3]
    assert [m for _, m in server.recv_many(100, WAIT_MS, max_bytes=1)] == sent[3:4]
    assert [m for _, m in server.recv_many(100, WAIT_MS)] == sent[4:]


@pytest.mark.parametrize("mode", MODES)
def test_client_recv_many_takes_what_is_queued_in_order(
    make_server, make_client, inproc_endpoint, mode
):
    server, client = _connected(make_server, make_client, inproc_endpoint, mode)
    client.send(flow(BOT))
    peer, _ = server_recv(server)
    sent = [flow({"flow": "DAT"}, seqno=i, payload=(b"r%d" % i,)) for i in range(5)]
    for msg in sent:
        server.send(msg, peer)
    assert client.recv_many(100, WAIT_MS) == sent
    assert client.stats["received"] == 5
    assert client.recv_many(100, 0) == []


@pytest.mark.parametrize("mode", MODES)
def test_recv_many_puts_a_bad_message_in_its_place_in_return_mode(
    make_server, make_client, raw_socket, inproc_endpoint, mode
):
    server = make_server(mode=mode)
    server.bind(inproc_endpoint)
    send_garbage = _garbage(raw_socket, mode, inproc_endpoint)
    good = make_client(mode=mode)
    good.connect(inproc_endpoint)
    good.send(flow(BOT, seqno=0))
    poll_server = server.recv_many(10, WAIT_MS)  # the good peer's first message
    assert [m for _, m in poll_server] == [flow(BOT, seqno=0)]
    send_garbage()
    good.send(flow(BOT, seqno=1))
    got = []
    deadline = time.monotonic() + WAIT_MS / 1000
    while len(got) < 2 and time.monotonic() < deadline:
        got.extend(server.recv_many(10, 100))
    assert isinstance(got[0], BadMessage) and got[0].error.field
    assert got[1] == (poll_server[0][0], flow(BOT, seqno=1))
    assert server.stats["bad_messages"] == 1 and server.stats["received"] == 2
    assert server.last_peer == poll_server[0][0]  # garbage never becomes the reply target


@pytest.mark.parametrize("mode", MODES)
def test_recv_many_in_raise_mode_returns_the_good_ones_then_raises(
    make_server, make_client, raw_socket, inproc_endpoint, mode
):
    server = make_server(mode=mode, on_bad_message="raise")
    server.bind(inproc_endpoint)
    good = make_client(mode=mode)
    good.connect(inproc_endpoint)
    good.send(flow(BOT, seqno=0))
    assert server_recv(server)[1] == flow(BOT, seqno=0)
    send_garbage = _garbage(raw_socket, mode, inproc_endpoint)
    good.send(flow(BOT, seqno=1))
    send_garbage()
    good.send(flow(BOT, seqno=2))
    # Messages from two peers interleave in an order libzmq picks; collect them all.
    got: list[Message] = []
    raised = []
    deadline = time.monotonic() + WAIT_MS / 1000
    while len(got) < 2 or not raised:
        assert time.monotonic() < deadline, (got, raised)
        try:
            got.extend(m for _, m in server.recv_many(10, 100))
        except RemoteProtocolError as e:
            raised.append(e)
    assert got == [flow(BOT, seqno=1), flow(BOT, seqno=2)]
    assert len(raised) == 1 and raised[0].peer is not None
    assert server.stats["bad_messages"] == 1 and server.stats["received"] == 3
    assert server.recv_many(10, 0) == []  # raised once, then the port goes on


def test_recv_many_holds_a_bad_message_behind_good_ones_for_the_next_call(
    make_server, make_client, inproc_endpoint
):
    """One peer, so the order is fixed: good, bad, good -> [good], raise, [good]."""
    server = make_server(on_bad_message="raise")
    server.bind(inproc_endpoint)
    client = make_client()
    client.connect(inproc_endpoint)
    client.send(flow(BOT, seqno=0))
    client.send_frames([b"garbage", bytes(24)])  # through the real envelope: a bad prefix
    client.send(flow(BOT, seqno=1))
    got = server.recv_many(10, WAIT_MS)
    assert [m for _, m in got] == [flow(BOT, seqno=0)]
    with pytest.raises(RemoteProtocolError) as e:
        server.recv(0)  # the held error comes out of any receive call, once
    assert e.value.field == "prefix"
    assert [m for _, m in server.recv_many(10, WAIT_MS)] == [flow(BOT, seqno=1)]


@pytest.mark.parametrize("mode", MODES)
def test_client_send_dats_queues_in_order_and_stops_when_the_queue_stays_full(
    make_server, make_client, inproc_endpoint, mode
):
    server = make_server(mode=mode, rcvhwm=2)
    server.bind(inproc_endpoint)
    client = make_client(mode=mode, sndhwm=2)
    client.connect(inproc_endpoint)
    codec = DatCodec(5)
    client.send_dats(codec, 1, [(b"a",), (b"b",)])
    assert [m for _, m in server.recv_many(10, WAIT_MS)] == [
        Message("FLOW", DAT_LABEL, 0, 5, 0, 1, (b"a",)),
        Message("FLOW", DAT_LABEL, 0, 5, 0, 2, (b"b",)),
    ]
    # Nobody reads now: a few fit in the queues, then the rest cannot be queued.
    with pytest.raises(TransportError, match="could not queue") as err:
        client.send_dats(codec, 3, [(b"%d" % i,) for i in range(3, 1003)], timeout_ms=50)
    queued = client.stats["sent"] - 2
    assert 0 < queued < 1000 and err.value.sent == queued
    got = []
    while len(got) < queued:
        batch = server.recv_many(1000, WAIT_MS)
        assert batch, f"{len(got)} of {queued} queued DATs arrived"
        got.extend(m for _, m in batch)
    assert [m.seqno for m in got] == list(range(3, 3 + queued))
    assert [m.payload for m in got] == [(b"%d" % i,) for i in range(3, 3 + queued)]
    assert server.recv_many(10, QUIET_MS) == []


@pytest.mark.parametrize("mode", MODES)
def test_frames_either_side_of_the_zero_copy_size_arrive_intact(
    make_server, make_client, tcp_any, mode
):
    # Frames of 64 KiB or more are handed to libzmq without a copy (wire._ZERO_COPY_MIN),
    # shorter ones are copied: both, in one message and through the DAT fast lane, arrive
    # byte for byte, and the zero-copy bytes are not reused or freed early.
    server = make_server(mode=mode)
    client = make_client(mode=mode)
    client.connect(server.bind(tcp_any))
    sizes = [0, 65535, 65536, 65537, 3 << 20]
    payload = tuple(bytes([i + 1]) * n for i, n in enumerate(sizes))
    sent = flow({"flow": "DAT"}, seqno=1, payload=list(payload))
    client.send(sent)
    peer, got = server_recv(server)
    assert got == sent
    codec = DatCodec(9)
    client.send_dats(codec, 2, [(p,) for p in payload])
    for i, p in enumerate(payload):
        _, m = server_recv(server)
        assert (m.seqno, m.payload) == (2 + i, (p,))
    big = bytes(range(256)) * 1024  # 256 KiB, from the server side too
    server.send(flow({"flow": "DAT"}, seqno=3, payload=[big, b"tail"]), peer)
    assert client_recv(client).payload == (big, b"tail")


# ------------------------------------------------------------------------------------ CURVE


@pytest.fixture
def server_keys() -> tuple[bytes, bytes]:
    return zmq.curve_keypair()


def test_curve_allowed_client_talks(make_server, make_client, authenticator, tcp_any, server_keys):
    server_public, server_secret = server_keys
    client_public, client_secret = zmq.curve_keypair()
    authenticator([client_public])
    server = make_server(curve=server_curve(server_secret))
    assert server.curve_public_key == server_public
    endpoint = server.bind(tcp_any)
    client = make_client(curve=client_curve(server_public, client_secret))
    assert client.curve_public_key == client_public
    client.connect(endpoint)
    client.send(flow(BOT, payload=[b"secret"]))
    peer, msg = server_recv(server)
    assert msg.payload == (b"secret",)
    server.send(flow({"flow": "PAY", "credit": 1}), peer)
    assert client_recv(client).label == '{"flow": "PAY", "credit": 1}'


def test_curve_client_not_in_the_allow_list_gets_nothing(
    make_server, make_client, authenticator, tcp_any, server_keys, caplog
):
    caplog.set_level(logging.WARNING, logger="zio_spark.transport")
    server_public, server_secret = server_keys
    allowed_public, allowed_secret = zmq.curve_keypair()
    stranger_public, stranger_secret = zmq.curve_keypair()
    authenticator([allowed_public])
    server = make_server(curve=server_curve(server_secret, server_public))
    endpoint = server.bind(tcp_any)

    stranger = make_client(curve=client_curve(server_public, stranger_secret))
    monitor = stranger.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        stranger.connect(endpoint)
        stranger.send(flow(BOT, origin=666), timeout_ms=WAIT_MS)
        # Positive evidence of the refusal, rather than a wait for silence.
        assert monitor.poll(WAIT_MS), "no HANDSHAKE_FAILED_AUTH event"
        event = recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        stranger.socket.disable_monitor()
        monitor.close(linger=0)

    allowed = make_client(curve=client_curve(server_public, allowed_secret))
    allowed.connect(endpoint)
    allowed.send(flow(BOT, origin=1))
    _, msg = server_recv(server)
    assert msg.origin == 1  # the stranger's BOT never arrived
    assert server.recv(QUIET_MS) is None
    assert stranger.recv(0) is None
    assert any(stranger_public.decode() in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "plaintext-control"])
def test_curve_payload_never_appears_on_the_wire(
    make_server, make_client, authenticator, recording_proxy, tcp_any, server_keys, curve
):
    marker = b"ZIO-SPARK-MARKER-7f3a9c"
    server_public, server_secret = server_keys
    client_public, client_secret = zmq.curve_keypair()
    server_kw: dict[str, Any] = {}
    client_kw: dict[str, Any] = {}
    if curve:
        authenticator([client_public])
        server_kw = {"curve": server_curve(server_secret)}
        client_kw = {"curve": client_curve(server_public, client_secret)}
    server = make_server(**server_kw)
    endpoint = server.bind(tcp_any)
    proxy = recording_proxy(tcp_port(endpoint))
    client = make_client(**client_kw)
    client.connect(f"tcp://127.0.0.1:{proxy.port}")

    client.send(flow({"flow": "DAT", "note": marker.decode()}, payload=[marker * 3]))
    peer, msg = server_recv(server)
    assert msg.payload == (marker * 3,)
    server.send(flow({"flow": "PAY", "credit": 1}, payload=[marker]), peer)
    assert client_recv(client).payload == (marker,)

    recorded = proxy.recorded
    assert proxy.connections >= 1 and len(recorded) > 100
    if curve:
        assert marker not in recorded
        assert b"CURVE" in recorded  # the mechanism name is in the clear greeting
    else:
        assert recorded.count(marker) >= 5  # label + payload both ways


def test_curve_without_authenticator_admits_any_client_with_the_server_key(
    make_server, make_client, tcp_any, server_keys
):
    server_public, server_secret = server_keys
    server = make_server(curve=server_curve(server_secret))
    client = make_client(curve=client_curve(server_public, zmq.curve_keypair()[1]))
    client.connect(server.bind(tcp_any))
    client.send(flow(BOT))
    server_recv(server)


def test_curve_as_one_options_object(make_server, make_client, authenticator, tcp_any, server_keys):
    server_public, server_secret = server_keys
    client_public, client_secret = zmq.curve_keypair()
    authenticator([client_public])
    server = make_server(curve=server_curve(server_secret))
    assert server.curve_public_key == server_public
    client = make_client(curve=Curve(server_public, client_public, client_secret))
    assert client.curve_public_key == client_public
    client.connect(server.bind(tcp_any))
    client.send(flow(BOT, payload=[b"secret"]))
    peer, msg = server_recv(server)
    assert msg.payload == (b"secret",)
    server.send(flow({"flow": "PAY", "credit": 1}), peer)
    assert client_recv(client).label == '{"flow": "PAY", "credit": 1}'


def test_curve_builders_derive_and_normalise_keys(server_keys):
    server_public, server_secret = server_keys
    client_public, client_secret = zmq.curve_keypair()
    assert server_curve(server_secret.decode()) == Curve(
        server_public, server_public, server_secret
    )
    raw_server = zmq.utils.z85.decode(server_public)
    assert client_curve(raw_server, client_secret, client_public) == Curve(
        server_public, client_public, client_secret
    )
    with pytest.raises(ConfigError) as e:
        server_curve(server_secret, client_public)
    assert e.value.option == "curve_public_key"


def test_optional_curve_builders_take_a_user_facing_constructor_s_key_keywords(server_keys):
    """What Producer and Consumer do with their curve_* keywords: none given, no CURVE;
    a key without the one it needs names the missing keyword."""
    server_public, server_secret = server_keys
    client_public, client_secret = zmq.curve_keypair()
    assert optional_server_curve(None) is None
    assert optional_server_curve(server_secret) == server_curve(server_secret)
    assert optional_client_curve(None, None) is None
    assert optional_client_curve(server_public, client_secret) == Curve(
        server_public, client_public, client_secret
    )
    for call, option in [
        (lambda: optional_server_curve("short"), "curve_secret_key"),
        (lambda: optional_server_curve(None, server_public), "curve_secret_key"),
        (lambda: optional_client_curve(None, client_secret), "curve_server_key"),
        (lambda: optional_client_curve(None, None, client_public), "curve_server_key"),
        (lambda: optional_client_curve(server_public, None, client_public), "curve_secret_key"),
    ]:
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.option == option


def test_server_curve_with_another_server_key_is_refused(ctx, server_keys):
    server_public, server_secret = server_keys
    other_public = zmq.curve_keypair()[0]
    with pytest.raises(ConfigError) as e:
        ServerPort(ctx, curve=Curve(other_public, server_public, server_secret))
    assert e.value.option == "curve.server_key" and e.value.value == other_public
    assert "own public key" in e.value.expected


def test_curve_object_errors_name_the_field_and_hide_the_secret(ctx, server_keys):
    server_public = server_keys[0]
    client_public, client_secret = zmq.curve_keypair()
    with pytest.raises(ConfigError) as e:
        ClientPort(ctx, curve=Curve(b"not a key", client_public, client_secret))
    assert (e.value.option, e.value.value) == ("curve.server_key", b"not a key")
    with pytest.raises(ConfigError) as e:
        ClientPort(ctx, curve=Curve(server_public, client_public, client_secret[:-1] + b"~"))
    assert (e.value.option, e.value.value) == ("curve.secret_key", "<redacted>")
    with pytest.raises(ConfigError) as e:
        ClientPort(ctx, curve=Curve(server_public, server_public, client_secret))
    assert e.value.option == "curve.public_key"


def test_one_authenticator_per_context(ctx, authenticator):
    auth = authenticator([zmq.curve_keypair()[0]])
    with pytest.raises(TransportError, match="only one per context"):
        start_authenticator(ctx, [])
    key = zmq.curve_keypair()[0]
    auth.allow(key)
    assert key in auth.allowed
    auth.revoke(key)
    assert key not in auth.allowed
    with pytest.raises(ConfigError):
        auth.allow("not a key")


# ------------------------------------------------------------------------------- ZMTP/2.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return out


def _zmtp2_frames(frames: list[bytes]) -> bytes:
    out = b""
    for i, body in enumerate(frames):
        more = 0x01 if i < len(frames) - 1 else 0x00
        if len(body) < 256:
            out += bytes([more, len(body)]) + body
        else:
            out += bytes([more | 0x02]) + struct.pack(">Q", len(body)) + body
    return out


def _zmtp2_read_message(sock: socket.socket) -> list[bytes]:
    frames = []
    while True:
        flags = _recv_exact(sock, 1)[0]
        assert flags & ~0x03 == 0, f"reserved flag bits set: {flags:#x}"
        if flags & 0x02:
            (n,) = struct.unpack(">Q", _recv_exact(sock, 8))
        else:
            n = _recv_exact(sock, 1)[0]
        frames.append(_recv_exact(sock, n))
        if not flags & 0x01:
            return frames


def test_raw_zmtp2_dealer_talks_to_a_routerdealer_server_port(make_server, tcp_any):
    server = make_server()
    endpoint = server.bind(tcp_any)
    with socket.create_connection(("127.0.0.1", tcp_port(endpoint)), timeout=5) as raw:
        # greeting = signature revision socket-type identity (15/ZMTP)
        raw.sendall(b"\xff" + b"\x00" * 7 + b"\x01" + b"\x7f")
        signature = _recv_exact(raw, 10)
        assert signature[0] == 0xFF and signature[9] == 0x7F
        raw.sendall(b"\x01\x05")  # revision 1 (ZMTP/2.0), DEALER
        revision, socket_type = _recv_exact(raw, 2)
        assert revision >= 1 and socket_type == 0x06  # libzmq offers 3, then says ROUTER
        assert _recv_exact(raw, 2) == b"\x00\x00"  # the ROUTER's empty identity frame
        raw.sendall(b"\x00\x00")  # our identity: final-short, length 0

        sent = flow(BOT, origin=5, payload=[b"from a v2 peer", b"y" * 300])
        raw.sendall(_zmtp2_frames([b"", *encode_frames(sent)]))
        peer, msg = server_recv(server)
        assert msg == sent

        reply = flow({"flow": "BOT", "direction": "extract", "credit": 2}, seqno=1)
        reply = Message(reply.form, reply.label, seqno=1, payload=(b"z" * 1000,))
        server.send(reply, peer)
        assert _zmtp2_read_message(raw) == [b"", *encode_frames(reply)]


# ---------------------------------------------------------------------- clientserver (draft)


@pytest.mark.requires_draft
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_round_trip_clientserver(request, make_server, make_client, transport, tcp_any):
    where = tcp_any if transport == "tcp" else request.getfixturevalue("ipc_endpoint")
    server = make_server(mode="clientserver")
    client = make_client(mode="clientserver")
    assert (server.socket_type, client.socket_type) == ("SERVER", "CLIENT")
    client.connect(server.bind(where))
    sent = flow(
        {"flow": "BOT", "direction": "inject", "credit": 2, "pad": "l" * 70_000},
        payload=[b"", b"\x00" * 300, bytes(range(256)) * 4096],
    )
    client.send(sent)
    peer, got = server_recv(server)
    assert got == sent
    assert isinstance(peer, int) and 0 < peer < 2**32
    reply = flow({"flow": "PAY", "credit": 2}, seqno=1, payload=[b"ok"])
    server.send(reply, peer)
    assert client_recv(client) == reply
    server.send(reply)  # to the last peer
    assert client_recv(client) == reply


@pytest.mark.requires_draft
def test_clientserver_single_frame_on_the_wire(make_server, make_client, raw_socket, tcp_any):
    raw_server = raw_socket(zmq.SERVER)
    raw_server.bind(tcp_any)
    client = make_client(mode="clientserver")
    client.connect(raw_server.last_endpoint.decode())
    msg = flow({"flow": "DAT"}, seqno=1, payload=[b"abc"])
    client.send(msg)
    assert raw_server.poll(WAIT_MS)
    frame = raw_server.recv(copy=False)
    assert frame.bytes == encode_single(msg)
    assert frame.bytes == (
        b'\x17ZIO0FLOW{"flow": "DAT"}\x18' + struct.pack("<QQQ", 0, 0, 1) + b"\x03abc"
    )
    raw_server.send(encode_single(flow({"flow": "EOT"})), routing_id=frame.routing_id)
    assert client_recv(client) == flow({"flow": "EOT"})

    server = make_server(mode="clientserver")
    raw_client = raw_socket(zmq.CLIENT)
    raw_client.connect(server.bind(tcp_any))
    raw_client.send(encode_single(msg))
    peer, got = server_recv(server)
    assert got == msg
    server.send(flow({"flow": "EOT"}), peer)
    assert raw_client.poll(WAIT_MS)
    assert raw_client.recv() == encode_single(flow({"flow": "EOT"}))


@pytest.mark.requires_draft
def test_clientserver_two_clients_and_unknown_peer(make_server, make_client, tcp_any):
    server = make_server(mode="clientserver")
    endpoint = server.bind(tcp_any)
    clients = [make_client(mode="clientserver") for _ in range(2)]
    for i, c in enumerate(clients):
        c.connect(endpoint)
        c.send(flow(BOT, origin=i))
    peers = {}
    for _ in clients:
        peer, msg = server_recv(server)
        peers[msg.origin] = peer
    for origin in (1, 0):
        server.send(flow({"flow": "PAY", "credit": 1}, origin=origin), peers[origin])
    for i, c in enumerate(clients):
        assert client_recv(c).origin == i
    unknown = max(peers.values()) + 1000
    with pytest.raises(UnknownPeerError) as e:
        server.send(flow(BOT), unknown)
    assert e.value.peer == unknown and f"routing id {unknown}" in str(e.value)
    with pytest.raises(LocalProtocolError):
        server.send(flow(BOT), b"identity")


@pytest.mark.requires_draft
def test_clientserver_garbage_is_counted(make_server, make_client, raw_socket, tcp_any):
    server = make_server(mode="clientserver")
    endpoint = server.bind(tcp_any)
    raw_client = raw_socket(zmq.CLIENT)
    raw_client.connect(endpoint)
    raw_client.send(b"\xffshort")  # truncated length prefix
    got = server.recv(WAIT_MS)
    assert isinstance(got, BadMessage) and got.error.field == "length"
    assert isinstance(got.peer, int)
    raw_client.send(b"\x03abc\x03def")  # frames fine, not ZIO
    got = server.recv(WAIT_MS)
    assert isinstance(got, BadMessage) and got.error.field == "prefix"
    good = make_client(mode="clientserver")
    good.connect(endpoint)
    good.send(flow(BOT))
    server_recv(server)
    assert server.stats["bad_messages"] == 2


@pytest.mark.requires_draft
def test_clientserver_with_curve(make_server, make_client, authenticator, tcp_any, server_keys):
    server_public, server_secret = server_keys
    client_public, client_secret = zmq.curve_keypair()
    authenticator([client_public])
    server = make_server(mode="clientserver", curve=server_curve(server_secret))
    client = make_client(mode="clientserver", curve=client_curve(server_public, client_secret))
    client.connect(server.bind(tcp_any))
    client.send(flow(BOT))
    peer, _ = server_recv(server)
    server.send(flow({"flow": "PAY", "credit": 1}), peer)
    client_recv(client)


@pytest.mark.requires_draft
def test_clientserver_refuses_a_routerdealer_peer_in_choose_mode():
    assert choose_mode("auto", "SERVER") is SocketMode.CLIENTSERVER
    with pytest.raises(TransportError):
        choose_mode("clientserver", "ROUTER")


# ------------------------------------------------------------------------- the DAT fast lane


@pytest.mark.parametrize("mode", MODES)
def test_send_dat_is_the_same_message_as_send_both_ways(make_server, make_client, tcp_any, mode):
    server, client = make_server(mode=mode), make_client(mode=mode)
    client.connect(server.bind(tcp_any))
    payloads = [(b"abc",), (b"",), (), (b"x" * 300, b"y"), (bytes(range(256)) * 64,)]
    for seq, payload in enumerate(payloads):
        client.send_dat(DatCodec(7), seq, payload)
        peer, got = server_recv(server)
        assert got == Message("FLOW", DAT_LABEL, 0, 7, 0, seq, payload)
        server.send_dat(DatCodec(9), seq, payload, peer)
        assert client_recv(client) == Message("FLOW", DAT_LABEL, 0, 9, 0, seq, payload)
    assert server.stats["received"] == client.stats["received"] == len(payloads)


@pytest.mark.parametrize("mode", MODES)
def test_recv_waits_follow_each_calls_timeout(make_server, make_client, tcp_any, mode):
    # The wait is the socket's RCVTIMEO, changed only when the timeout changes: a short
    # wait must not stay in force for the next, longer one (or the other way round).
    server, client = make_server(mode=mode), make_client(mode=mode)
    client.connect(server.bind(tcp_any))
    assert server.recv(20) is None
    client.send(flow({"flow": "PAY", "credit": 1}))
    assert server.recv(WAIT_MS) is not None  # a long wait after a short one
    t0 = time.monotonic()
    assert server.recv(30) is None  # and a short one after a long one
    assert time.monotonic() - t0 < WAIT_MS / 1000
    client.send(flow({"flow": "PAY", "credit": 1}))
    assert server.recv(1e12) is not None  # beyond RCVTIMEO's int range: clamped, no error


def test_multipart_messages_keep_their_frames(make_server, make_client, tcp_any):
    # Our send/receive loops replace send_multipart/recv_multipart: frame boundaries and
    # message boundaries must survive many messages of different lengths in a row.
    server, client = make_server(), make_client()
    client.connect(server.bind(tcp_any))
    sent = [
        flow({"flow": "DAT"}, seqno=i, payload=[b"p%d" % j for j in range(i % 5)])
        for i in range(200)
    ]
    for m in sent:
        client.send(m)
    got = [server_recv(server)[1] for _ in sent]
    assert got == sent


def test_a_bad_part_leaves_nothing_half_sent(make_server, make_client, tcp_any):
    server, client = make_server(), make_client()
    client.connect(server.bind(tcp_any))
    with pytest.raises(TypeError):
        client.send(flow({"flow": "DAT"}, seqno=1, payload=[b"ok", "not bytes"]))
    good = flow({"flow": "DAT"}, seqno=2, payload=[b"second"])
    client.send(good)
    assert server_recv(server)[1] == good  # whole, and alone
    assert server.recv(50) is None
