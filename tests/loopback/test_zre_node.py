"""Tests for zio_spark.transport.zre_node: real ZRE nodes on loopback.

Network rules: beacons go to 127.255.255.255 (reaches every socket bound to 0.0.0.0 on
this host, nothing else; tests/conftest.py also pins the environment defaults to it),
mailboxes bind 127.0.0.1, every test takes a random free UDP beacon port so tests never
hear each other, and the namespace test runs in a private ``ip netns`` with only ``lo``.
Nothing sleeps to wait for a condition: events are awaited with a deadline, counters
are polled with one. Sockets use linger 0 and the ``ctx`` fixture fails a test that
leaks one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from zio_spark.errors import ConfigError, LocalProtocolError, TransportError
from zio_spark.options import ZreOptions
from zio_spark.protocol.zio_ports import ZioEndpoint
from zio_spark.protocol.zre import (
    DISCOVERY_PORT,
    Beacon,
    Hello,
    Ping,
    PingOk,
    Whisper,
    decode_beacon,
    decode_command,
    encode_beacon,
    encode_command,
    encode_identity,
)
from zio_spark.transport.port import UnknownPeerError
from zio_spark.transport.zre_node import AppEvent, ZreNode

LOOPBACK_BROADCAST = "127.255.255.255"
WAIT = 5.0  # deadline for anything that normally takes milliseconds
CHILD = Path(__file__).with_name("zre_netns_child.py")
ROOT = Path(__file__).resolve().parents[2]


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def poll_until(cond: Callable[[], bool], timeout: float = WAIT, what: str = "") -> None:
    """Re-check ``cond`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    gate = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or cond}")
        gate.wait(0.01)


class Events:
    """The events one node delivered, awaited with deadlines.

    ``wait`` returns the first not yet claimed event that matches, pulling more from the
    node as needed; claimed events are never matched twice.
    """

    def __init__(self, node: ZreNode) -> None:
        self.node = node
        self.seen: list[AppEvent] = []
        self._unclaimed: list[AppEvent] = []

    def _pull(self, timeout: float) -> bool:
        event = self.node.next_event(timeout)
        if event is None:
            return False
        self.seen.append(event)
        self._unclaimed.append(event)
        return True

    def wait(self, kind: str, timeout: float = WAIT, **attrs: Any) -> AppEvent:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self._unclaimed):
                if event.kind.value == kind and all(
                    getattr(event, k, object()) == v for k, v in attrs.items()
                ):
                    return self._unclaimed.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                seen = "\n  ".join(repr(e) for e in self.seen)
                pytest.fail(
                    f"{self.node.name}: no {kind} {attrs} within {timeout} s; saw:\n  {seen}"
                )
            self._pull(min(left, 0.1))

    def kinds(self) -> list[str]:
        return [e.kind.value for e in self.seen]


@pytest.fixture
def beacon_port() -> int:
    return free_udp_port()


@pytest.fixture
def make_node(ctx: zmq.Context[Any], beacon_port: int) -> Iterator[Callable[..., ZreNode]]:
    made: list[ZreNode] = []

    def make(name: str, **kw: Any) -> ZreNode:
        """A node in no group unless ``zre`` is given; ZreOptions' fields as keywords
        change one of the loopback settings."""
        zre = ZreOptions("", beacon_port, LOOPBACK_BROADCAST, "127.0.0.1", 0.05)
        settings = {k: kw.pop(k) for k in ("beacon_port", "interface") if k in kw}
        kw.setdefault("zre", dataclasses.replace(zre, **settings))
        kw.setdefault("linger_ms", 0)
        kw.setdefault("ctx", ctx)
        node = ZreNode(name, **kw)
        made.append(node)
        return node

    yield make
    for node in made:
        node.stop()


Trio = tuple[dict[str, ZreNode], dict[str, Events]]


@pytest.fixture
def trio(make_node: Callable[..., ZreNode]) -> Trio:
    """Nodes a, b, c in group G, each having seen the others ENTER and JOIN."""
    nodes = {
        "a": make_node("a", headers={"role": "alpha"}),
        "b": make_node("b", headers={"role": "beta"}),
        "c": make_node("c"),
    }
    nodes["a"].advertise_port("out", "tcp://127.0.0.1:41000", "ROUTER")
    for node in nodes.values():
        node.join("G")
        node.start()
    logs = {name: Events(node) for name, node in nodes.items()}
    for name, log in logs.items():
        for other, node in nodes.items():
            if other != name:
                log.wait("ENTER", peer=node.uuid)
                log.wait("JOIN", peer=node.uuid, group="G")
    return nodes, logs


# ---------------------------------------------------------------------------------------
# Configuration


def test_defaults_come_from_the_environment_pinned_to_loopback() -> None:
    node = ZreNode("env")
    assert node.broadcast == LOOPBACK_BROADCAST
    assert node.interface_addr == "127.0.0.1"
    assert node.beacon_port == DISCOVERY_PORT == 5670
    assert node.endpoint is None and not node.running


def test_environment_and_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZIO_ZRE_BROADCAST", "127.1.2.255")
    monkeypatch.setenv("ZIO_ZRE_INTERFACE_ADDR", "127.0.0.9")
    node = ZreNode("env")
    assert (node.broadcast, node.interface_addr) == ("127.1.2.255", "127.0.0.9")
    node = ZreNode("arg", zre=ZreOptions("", broadcast=LOOPBACK_BROADCAST, interface="127.0.0.1"))
    assert (node.broadcast, node.interface_addr) == (LOOPBACK_BROADCAST, "127.0.0.1")
    assert node.own_groups() == set()  # an empty group: settings only, no group joined


def test_without_environment_broadcast_defaults_to_limited_broadcast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Constructed only, never started: the interface is derived with a UDP connect(),
    # which sends nothing.
    monkeypatch.delenv("ZIO_ZRE_BROADCAST")
    monkeypatch.delenv("ZIO_ZRE_INTERFACE_ADDR")
    try:
        node = ZreNode("default")
    except ConfigError as e:  # a host with no route at all
        assert e.option == "interface_addr"
        return
    assert node.broadcast == "255.255.255.255"
    assert node.interface_addr.count(".") == 3
    assert not node.running


@pytest.mark.parametrize(
    ("kw", "option"),
    [
        ({"zre": ZreOptions("", broadcast="not-an-address")}, "broadcast"),
        ({"zre": ZreOptions("", broadcast="::1")}, "broadcast"),
        ({"zre": ZreOptions("", interface="0.0.0.0")}, "interface_addr"),
        ({"zre": ZreOptions("", interface="224.0.0.1")}, "interface_addr"),
        ({"zre": ZreOptions("", interface="localhost")}, "interface_addr"),
        ({"zre": ZreOptions("", interval=0)}, "interval"),
        ({"zre": ZreOptions("", interval=math.nan)}, "interval"),
        ({"zre": ZreOptions("", beacon_port=0)}, "beacon_port"),
        ({"zre": ZreOptions("", beacon_port=65536)}, "beacon_port"),
        ({"zre": ZreOptions("", beacon_port=True)}, "beacon_port"),
        ({"evasive_after": 2.0, "expired_after": 1.0}, "expired_after"),
        ({"max_queued_events": 0}, "max_queued_events"),
        ({"linger_ms": -1}, "linger_ms"),
    ],
)
def test_bad_configuration_raises_config_error(kw: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError) as info:
        ZreNode("bad", **kw)
    assert info.value.option == option


def test_settings_as_one_zre_options_object(beacon_port: int) -> None:
    zre = ZreOptions("G", beacon_port, "127.1.2.255", "127.0.0.9", 0.25)
    node = ZreNode("opts", zre=zre)
    assert (node.beacon_port, node.broadcast, node.interface_addr) == (
        beacon_port,
        "127.1.2.255",
        "127.0.0.9",
    )
    assert node.own_groups() == {"G"}  # joined before start: it goes out in the HELLO
    bad = dataclasses.replace(zre, interval=0.0)
    with pytest.raises(ConfigError) as info:
        ZreNode("bad", zre=bad)
    assert (info.value.option, info.value.value) == ("interval", 0.0)


def test_two_nodes_made_from_zre_options_meet_in_its_group(
    make_node: Callable[..., ZreNode], beacon_port: int
) -> None:
    zre = ZreOptions("Z", beacon_port, LOOPBACK_BROADCAST, "127.0.0.1", 0.05)
    a = make_node("za", zre=zre)
    b = make_node("zb", zre=zre)
    events = Events(b)
    a.start()
    b.start()
    events.wait("JOIN", peer=a.uuid, group="Z")
    assert [p.uuid for p in b.peers_in_group("Z")] == [a.uuid]


def test_bad_name_and_headers_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError):
        ZreNode("n" * 256)
    with pytest.raises(LocalProtocolError):
        ZreNode("x", headers={"k": 1})  # type: ignore[dict-item]
    node = ZreNode("x")
    with pytest.raises(LocalProtocolError):
        node.set_header("", "v")
    with pytest.raises(LocalProtocolError):
        node.advertise_port("a.b", "tcp://127.0.0.1:1", "ROUTER")


# ---------------------------------------------------------------------------------------
# Three nodes on loopback


def test_discovery_enter_carries_headers_and_endpoint(trio: Trio) -> None:
    nodes, _ = trio
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    for node in (a, b, c):
        assert node.endpoint is not None and node.endpoint.startswith("tcp://127.0.0.1:")
        assert 0xC000 <= int(node.endpoint.rsplit(":", 1)[1]) <= 0xFFFF
        others = {p.uuid for p in node.peers()}
        assert others == {n.uuid for n in (a, b, c) if n is not node}
    peer_a = b.peer(a.uuid)
    assert peer_a is not None
    assert (peer_a.name, peer_a.endpoint) == ("a", a.endpoint)
    assert peer_a.headers["role"] == "alpha"
    assert c.peer_headers(b.uuid) == {"role": "beta"}
    assert c.peer_headers(uuid.uuid4()) is None
    assert a.peer_groups() == {"G"} and a.own_groups() == {"G"}
    for node in (a, b, c):
        # A peer may enter by its HELLO before its first beacon arrives; beacons follow.
        poll_until(
            lambda node=node: node.stats["beacons_received"] >= 2,  # type: ignore[misc]
            what=f"{node.name} hearing the others' beacons",
        )
        stats = node.stats
        assert stats["beacons_sent"] > 0 and stats["own_beacons"] > 0
        assert stats["bad_beacons"] == stats["bad_messages"] == stats["internal_errors"] == 0


def test_enter_event_details(trio: Trio) -> None:
    nodes, logs = trio
    enter = next(e for e in logs["c"].seen if e.kind.value == "ENTER" and e.peer == nodes["a"].uuid)
    assert enter.name == "a"
    assert enter.endpoint == nodes["a"].endpoint  # type: ignore[union-attr]
    assert enter.headers["zio.port.out.socket"] == "ROUTER"  # type: ignore[union-attr]


def test_join_and_leave_after_start(trio: Trio) -> None:
    nodes, logs = trio
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    b.join("H")
    b.join("H")  # already in: no second JOIN
    for name in ("a", "c"):
        logs[name].wait("JOIN", peer=b.uuid, group="H")
    assert [p.uuid for p in a.peers_in_group("H")] == [b.uuid]
    assert b.own_groups() == {"G", "H"}
    b.leave("H")
    b.leave("never-joined")  # not in it: nothing sent
    for name in ("a", "c"):
        logs[name].wait("LEAVE", peer=b.uuid, group="H")
    assert a.peers_in_group("H") == []
    assert {p.uuid for p in c.peers_in_group("G")} == {a.uuid, b.uuid}
    assert [k for k in logs["a"].kinds() if k in ("JOIN", "LEAVE")].count("JOIN") == 3


def test_whisper_in_both_directions(trio: Trio) -> None:
    nodes, logs = trio
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    a.whisper(b.uuid, b"to-b", b"second frame")
    b.whisper(a.uuid, bytearray(b"to-a"))
    c.whisper(a.uuid)  # zero content frames are allowed (ABNF: msg = *frame)
    got = logs["b"].wait("WHISPER", peer=a.uuid)
    assert got.content == (b"to-b", b"second frame")  # type: ignore[union-attr]
    assert got.name == "a"
    assert logs["a"].wait("WHISPER", peer=b.uuid).content == (b"to-a",)  # type: ignore[union-attr]
    assert logs["a"].wait("WHISPER", peer=c.uuid).content == ()  # type: ignore[union-attr]


def test_shout_reaches_group_members_only(trio: Trio) -> None:
    nodes, logs = trio
    a, c = nodes["a"], nodes["c"]
    assert a.shout("G", b"one") == 2
    for name in ("b", "c"):
        shout = logs[name].wait("SHOUT", peer=a.uuid, group="G")
        assert shout.content == (b"one",)  # type: ignore[union-attr]
    assert c.shout("G", b"from-c") == 2
    logs["a"].wait("SHOUT", peer=c.uuid, content=(b"from-c",))
    logs["b"].wait("SHOUT", peer=c.uuid, content=(b"from-c",))

    c.leave("G")
    logs["a"].wait("LEAVE", peer=c.uuid, group="G")
    assert a.shout("G", b"two") == 1
    assert a.shout("nobody-here", b"x") == 0
    # One DEALER per peer keeps order: had c got "two", it would precede the marker.
    a.whisper(c.uuid, b"marker")
    logs["c"].wait("WHISPER", peer=a.uuid, content=(b"marker",))
    assert not [e for e in logs["c"].seen if e.kind.value == "SHOUT" and e.content == (b"two",)]  # type: ignore[union-attr]
    logs["b"].wait("SHOUT", peer=a.uuid, content=(b"two",))


def test_zio_port_advertisement_found_in_group(trio: Trio) -> None:
    nodes, _ = trio
    a, b = nodes["a"], nodes["b"]
    expected = [ZioEndpoint(a.uuid, "a", "out", "tcp://127.0.0.1:41000", "ROUTER")]
    assert b.zio_endpoints("G") == expected
    assert b.zio_endpoints("G", port="out") == expected
    assert b.zio_endpoints("G", port="in") == []
    assert b.zio_endpoints("other") == []
    assert a.zio_endpoints("G") == []  # b and c advertise nothing; a never lists itself


def test_stopping_node_is_seen_leaving_promptly(trio: Trio) -> None:
    nodes, logs = trio
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    started = time.monotonic()
    c.stop()
    for name in ("a", "b"):
        logs[name].wait("EXIT", peer=c.uuid)
    # Far below expired_after (30 s): the port-0 beacon did it, not the expiry timer.
    assert time.monotonic() - started < 2.0
    assert {p.uuid for p in a.peers()} == {b.uuid}
    with pytest.raises(UnknownPeerError) as info:
        a.whisper(c.uuid, b"gone")
    assert info.value.peer == encode_identity(c.uuid)
    assert not c.running and c.peers() == []
    c.stop()  # idempotent


# ---------------------------------------------------------------------------------------
# A hand-made peer on raw sockets, to control exactly what the node hears


class RawPeer:
    """A ZRE peer written with raw sockets: a ROUTER mailbox and a DEALER to the node."""

    def __init__(self, raw_socket: Callable[[int], zmq.Socket[bytes]], node: ZreNode) -> None:
        self.uuid = uuid.uuid4()
        self.mailbox = raw_socket(zmq.ROUTER)
        port = self.mailbox.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.out = raw_socket(zmq.DEALER)
        self.out.setsockopt(zmq.ROUTING_ID, encode_identity(self.uuid))
        assert node.endpoint is not None
        self.out.connect(node.endpoint)
        self.sequence = 0

    def send(self, cmd: Any, *, sequence: int | None = None) -> None:
        self.sequence = self.sequence + 1 if sequence is None else sequence
        self.out.send_multipart(encode_command(dataclasses.replace(cmd, sequence=self.sequence)))

    def hello(self, **kw: Any) -> None:
        self.send(Hello(0, self.endpoint, **kw), sequence=1)

    def recv(self, timeout: float = WAIT) -> Any:
        if not self.mailbox.poll(int(timeout * 1000)):
            pytest.fail(f"raw peer: nothing from the node within {timeout} s")
        frames = self.mailbox.recv_multipart()
        return decode_command(frames[1:])


def test_silent_peer_goes_evasive_then_expires(
    make_node: Callable[..., ZreNode], raw_socket: Callable[[int], zmq.Socket[bytes]]
) -> None:
    evasive_after, expired_after = 0.2, 0.8
    node = make_node("watcher", evasive_after=evasive_after, expired_after=expired_after)
    node.start()
    log = Events(node)
    peer = RawPeer(raw_socket, node)
    peer.hello(name="quiet")
    log.wait("ENTER", peer=peer.uuid)
    assert isinstance(peer.recv(), Hello)  # the node connected back and greeted first

    # While the peer answers each PING, it is evasive now and then but never expires.
    answered_until = time.monotonic() + expired_after + evasive_after
    pings = 0
    while time.monotonic() < answered_until:
        log.wait("EVASIVE", peer=peer.uuid)
        assert isinstance(peer.recv(), Ping)
        pings += 1
        peer.send(PingOk(0))
    assert pings >= 2
    assert "EXIT" not in log.kinds()

    # Now it goes silent: EVASIVE (+ PING) and then EXIT, on the table's timers.
    silent_since = time.monotonic()
    log.wait("EVASIVE", peer=peer.uuid)
    assert isinstance(peer.recv(), Ping)
    log.wait("EXIT", peer=peer.uuid)
    elapsed = time.monotonic() - silent_since
    assert expired_after * 0.9 <= elapsed < expired_after + 2.0
    assert node.peers() == []
    stats = node.stats
    assert stats["pings_sent"] >= pings + 1 and stats["ping_oks_received"] == pings
    assert stats["bad_messages"] == stats["internal_errors"] == 0


def test_sequence_gap_drops_the_peer(
    make_node: Callable[..., ZreNode], raw_socket: Callable[[int], zmq.Socket[bytes]]
) -> None:
    node = make_node("strict")
    node.start()
    log = Events(node)
    peer = RawPeer(raw_socket, node)
    peer.hello(name="sloppy")
    log.wait("ENTER", peer=peer.uuid)
    peer.send(Whisper(0, (b"ok",)))
    log.wait("WHISPER", peer=peer.uuid, content=(b"ok",))
    peer.send(Whisper(0, (b"skipped ahead",)), sequence=7)
    log.wait("EXIT", peer=peer.uuid)
    assert node.peers() == [] and node.stats["peers_dropped"] == 1


# ---------------------------------------------------------------------------------------
# Robustness: garbage in, counted and dropped, node unharmed


def test_garbage_beacons_are_counted_and_discovery_still_works(
    make_node: Callable[..., ZreNode], beacon_port: int
) -> None:
    a, b = make_node("a"), make_node("b")
    a.start()
    b.start()
    garbage = [
        b"",
        b"Z",
        b"ZRE",
        b"ZRE\x01" + bytes(17),  # 21 bytes
        b"ZRE\x01" + bytes(19),  # 23 bytes
        b"ZRX\x01" + bytes(18),
        b"ZRE\x02" + bytes(18),
        b"\xff" * 22,
        b"ZRE\x01" + bytes(600),  # larger than the receive buffer
    ]
    leaving_stranger = encode_beacon(Beacon(uuid.uuid4(), 0))  # valid, unknown: ignored
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        for datagram in [*garbage, leaving_stranger]:
            s.sendto(datagram, (LOOPBACK_BROADCAST, beacon_port))
    for node in (a, b):
        poll_until(
            lambda node=node: node.stats["bad_beacons"] == len(garbage),  # type: ignore[misc]
            what=f"{node.name} counting {len(garbage)} bad beacons",
        )
    c = make_node("c")
    c.start()
    logs = {n.name: Events(n) for n in (a, b, c)}
    for x in (a, b, c):
        for y in (a, b, c):
            if x is not y:
                logs[x.name].wait("ENTER", peer=y.uuid)
    for node in (a, b):
        assert node.stats["bad_beacons"] == len(garbage)
        assert node.stats["internal_errors"] == 0
        assert node.running


def test_garbage_on_the_mailbox_is_counted_and_dropped(
    make_node: Callable[..., ZreNode], raw_socket: Callable[[int], zmq.Socket[bytes]]
) -> None:
    node = make_node("target")
    node.start()
    log = Events(node)
    assert node.endpoint is not None

    anonymous = raw_socket(zmq.DEALER)  # the ROUTER gives it a 5-byte 0x00... identity
    anonymous.connect(node.endpoint)
    for frames in ([b"hello?"], [b"\xaa\xa1\x01\x02"], [b"", b""]):
        anonymous.send_multipart(frames)

    peer = RawPeer(raw_socket, node)
    hello = encode_command(Hello(1, peer.endpoint, name="fake"))[0]
    ping = encode_command(Ping(2))[0]
    bad = [
        [b"\x00\x00\x01\x02\x00\x01"],  # signature
        [b"\xaa\xa1\x09\x02\x00\x01"],  # command 9
        [b"\xaa\xa1\x06\x03\x00\x01"],  # version 3
        [hello[:-3]],  # truncated
        [hello + b"xx"],  # trailing bytes
        [ping, b"extra"],  # PING takes no content frames
        [b""],  # empty command frame
        encode_command(Hello(1, "ipc:///tmp/zio-not-tcp", name="fake")),  # not tcp://
        encode_command(Hello(1, "tcp://127.0.0.1:http", name="fake")),  # no port number
        encode_command(Hello(1, "tcp://127.0.0.1", name="fake")),
    ]
    expected_bad = 3 + len(bad)
    peer.out.send_multipart(encode_command(Whisper(5, (b"before hello",))))  # ignored
    for frames in bad:
        peer.out.send_multipart(frames)
    poll_until(
        lambda: node.stats["bad_messages"] == expected_bad,
        what=f"{expected_bad} bad mailbox messages counted",
    )
    assert node.peers() == [] and node.next_event(0) is None

    # The same connection then speaks properly, and is heard.
    peer.hello(name="fake")
    log.wait("ENTER", peer=peer.uuid, name="fake")
    peer.send(Whisper(0, (b"after hello",)))
    log.wait("WHISPER", peer=peer.uuid, content=(b"after hello",))
    assert not [e for e in log.seen if getattr(e, "content", None) == (b"before hello",)]

    # And ordinary discovery still works.
    other = make_node("other")
    other.start()
    log.wait("ENTER", peer=other.uuid)
    Events(other).wait("ENTER", peer=node.uuid)
    other.whisper(node.uuid, b"hi")
    log.wait("WHISPER", peer=other.uuid, content=(b"hi",))
    stats = node.stats
    assert stats["bad_messages"] == expected_bad
    assert stats["internal_errors"] == 0 and node.running


# ---------------------------------------------------------------------------------------
# API behaviour


def test_api_errors_and_lifecycle(make_node: Callable[..., ZreNode]) -> None:
    node = make_node("api")
    with pytest.raises(LocalProtocolError):
        node.whisper(uuid.uuid4(), b"x")  # not running
    with pytest.raises(LocalProtocolError):
        node.shout("G", b"x")
    node.join("G")  # fine before start: it goes out in HELLO
    assert node.own_groups() == {"G"} and node.peers() == []
    node.set_header("k", "v")
    with node:
        assert node.running
        with pytest.raises(LocalProtocolError):
            node.start()
        with pytest.raises(LocalProtocolError):
            node.set_header("late", "v")
        with pytest.raises(LocalProtocolError):
            node.advertise_port("out", "tcp://127.0.0.1:1", "ROUTER")
        stranger = uuid.uuid4()
        with pytest.raises(UnknownPeerError) as info:
            node.whisper(stranger, b"x")
        assert info.value.peer == b"\x01" + stranger.bytes
        with pytest.raises(LocalProtocolError):
            node.whisper(stranger, "text is not bytes")  # type: ignore[arg-type]
        with pytest.raises(LocalProtocolError):
            node.whisper(str(stranger), b"x")  # type: ignore[arg-type]
        for group in ("", "g" * 256, 7):
            with pytest.raises(LocalProtocolError):
                node.join(group)  # type: ignore[arg-type]
        assert node.shout("G", b"nobody") == 0
        assert node.headers == {"k": "v"}
    assert not node.running
    with pytest.raises(LocalProtocolError):
        node.join("H")
    with pytest.raises(LocalProtocolError):
        node.start()
    node.stop()


def test_start_failures_raise_transport_error(make_node: Callable[..., ZreNode]) -> None:
    # An address that is not on this host: bind fails, nothing is sent anywhere.
    node = make_node("nowhere", interface="203.0.113.7")
    with pytest.raises(TransportError) as info:
        node.start()
    assert "203.0.113.7" in str(info.value.endpoint)
    assert not node.running

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("0.0.0.0", 0))  # no SO_REUSEADDR/SO_REUSEPORT: the port is exclusive
        port = taken.getsockname()[1]
        node = make_node("busy", beacon_port=port)
        with pytest.raises(TransportError) as info:
            node.start()
        assert info.value.endpoint == f"udp://0.0.0.0:{port}"


def test_on_event_callback_runs_in_node_thread_and_may_call_the_api(
    make_node: Callable[..., ZreNode],
) -> None:
    threads: list[str] = []

    def greet(event: AppEvent) -> None:
        threads.append(threading.current_thread().name)
        if event.kind.value == "ENTER":
            host.whisper(event.peer, b"welcome")  # inline in the node thread: no deadlock
        if event.kind.value == "JOIN":
            raise RuntimeError("a buggy callback")

    host = make_node("host", on_event=greet)
    guest = make_node("guest")
    guest.join("G")
    host.start()
    guest.start()
    Events(guest).wait("WHISPER", peer=host.uuid, content=(b"welcome",))
    poll_until(lambda: host.stats["callback_errors"] == 1, what="the callback error counted")
    assert host.next_event(0) is None  # with a callback nothing is queued
    assert set(threads) == {"zre-node-host"}
    assert host.running


def test_api_calls_from_many_threads(make_node: Callable[..., ZreNode]) -> None:
    sender, receiver = make_node("sender"), make_node("receiver")
    sender.start()
    receiver.start()
    Events(sender).wait("ENTER", peer=receiver.uuid)
    log = Events(receiver)
    log.wait("ENTER", peer=sender.uuid)
    errors: list[BaseException] = []

    def blast(t: int) -> None:
        try:
            for i in range(100):
                sender.whisper(receiver.uuid, b"%d" % t, b"%d" % i)
                sender.peers()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=blast, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors
    got: dict[bytes, list[int]] = {}
    for _ in range(400):
        content = log.wait("WHISPER", peer=sender.uuid).content  # type: ignore[union-attr]
        got.setdefault(content[0], []).append(int(content[1]))
    assert got == {b"%d" % t: list(range(100)) for t in range(4)}  # per-thread order kept


def test_full_event_queue_drops_and_counts(make_node: Callable[..., ZreNode]) -> None:
    small = make_node("small", max_queued_events=3)
    chatty = make_node("chatty")
    small.start()
    chatty.start()
    Events(chatty).wait("ENTER", peer=small.uuid)
    for i in range(5):
        chatty.whisper(small.uuid, b"%d" % i)
    poll_until(lambda: small.stats["events_dropped"] == 3, what="3 events dropped")
    kinds = [small.next_event(0) for _ in range(4)]
    assert [getattr(e, "content", e.kind.value) for e in kinds[:3]] == [  # type: ignore[union-attr]
        "ENTER",
        (b"0",),
        (b"1",),
    ]
    assert kinds[3] is None


def test_node_with_its_own_context_sends_a_leaving_beacon(beacon_port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("0.0.0.0", beacon_port))
        listener.settimeout(WAIT)
        node = ZreNode(
            "solo",
            zre=ZreOptions("", beacon_port, LOOPBACK_BROADCAST, "127.0.0.1"),
            linger_ms=0,
        )
        with node:
            assert node.running and node.endpoint is not None
            mailbox_port = int(node.endpoint.rsplit(":", 1)[1])
        assert not node.running
        beacons = []
        while not beacons or beacons[-1].port != 0:
            data, (host, _) = listener.recvfrom(512)  # socket.timeout fails the test
            beacons.append(decode_beacon(data))
            assert host == "127.0.0.1"
    assert {b.uuid for b in beacons} == {node.uuid}
    assert all(b.port == mailbox_port for b in beacons[:-1])


# ---------------------------------------------------------------------------------------
# A private network namespace with only lo


@pytest.mark.netns
def test_two_nodes_discover_each_other_in_a_private_namespace(
    netns: Callable[..., str],
) -> None:
    ns = netns()
    links = subprocess.run(
        ["ip", "-n", ns, "-o", "link"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    # The real discovery port is fine here: nothing outside the namespace can hear it.
    cmd = [
        "ip", "netns", "exec", ns, sys.executable, str(CHILD), "--deadline", "10",
        "pair", LOOPBACK_BROADCAST, "127.0.0.1", str(DISCOVERY_PORT),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"child failed: {proc.stdout}\n{proc.stderr}"
    by = {(line["ev"], line.get("node")): line for line in lines}
    started = by["started", None]
    assert by["ENTER", "a"]["peer"] == started["b"]
    assert by["ENTER", "a"]["headers"] == {"role": "b"}
    assert by["ENTER", "b"]["peer"] == started["a"]
    assert by["JOIN", "a"]["group"] == by["JOIN", "b"]["group"] == "G"
    assert by["WHISPER", "b"]["content"] == ["ns-whisper"]
    assert by["SHOUT", "a"]["content"] == ["ns-shout"]
    assert by["EXIT", "a"]["peer"] == started["b"]
    done = by["done", None]
    assert "timeout" not in done
    assert done["a_stats"]["bad_beacons"] == done["a_stats"]["internal_errors"] == 0
