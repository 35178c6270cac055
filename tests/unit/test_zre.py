"""Tests for protocol.zre, zre_peers and zio_ports: beacons, commands, peers, ZIO port ads.

Golden vectors are written by hand from specs/36-zre.txt (ABNF field order, big-endian
numbers, 1-byte ``string`` and 4-byte ``longstr`` lengths). Hypothesis checks round
trips, that garbage and mutated frames only ever raise RemoteProtocolError, and that any
sequence of inputs keeps the peer table's CONNECT/DROP and ENTER/EXIT pairing. Timing is
driven by explicit ``now`` values; nothing sleeps. The >= 100k-example fuzz runs are in
test_zre_fuzz.py (marked ``fuzz``).
"""

from __future__ import annotations

import ast
import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from uuid import UUID

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_live.live_fuzz_support import mutate
from zio_spark.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from zio_spark.protocol import zio_ports, zre, zre_peers
from zio_spark.protocol.zio_ports import (
    ZioEndpoint,
    ZioPort,
    advertised_ports,
    group_zio_endpoints,
    zio_port_headers,
)
from zio_spark.protocol.zre import (
    Beacon,
    Command,
    Hello,
    Join,
    Leave,
    Ping,
    PingOk,
    Shout,
    Whisper,
    ZreCommand,
    decode_beacon,
    decode_command,
    decode_identity,
    encode_beacon,
    encode_command,
    encode_identity,
    tcp_endpoint,
)
from zio_spark.protocol.zre_peers import (
    ConnectAction,
    DropAction,
    DropReason,
    EnterEvent,
    EvasiveEvent,
    Event,
    ExitEvent,
    JoinEvent,
    LeaveEvent,
    PeerTable,
    SendPingAction,
    SendPingOkAction,
    ShoutEvent,
    WhisperEvent,
    ZreEventType,
)

ME = UUID("00000000-0000-4000-8000-000000000000")
A = UUID("0123456789abcdef0123456789abcdef")
B = UUID("11111111-2222-4333-8444-555555555555")
C = UUID("fedcba98-7654-4321-8fed-cba987654321")

# ---------------------------------------------------------------------------------------
# Golden vectors, by hand from the spec

BEACON_A_C000 = b"ZRE\x01" + bytes.fromhex("0123456789abcdef0123456789abcdef") + b"\xc0\x00"

HELLO_FRAME = (
    b"\xaa\xa1"  # signature
    b"\x01"  # HELLO
    b"\x02"  # version
    b"\x00\x01"  # sequence 1
    b"\x14tcp://10.0.0.1:49152"  # endpoint: string, 20 bytes
    b"\x00\x00\x00\x02"  # groups: 2 longstrs
    b"\x00\x00\x00\x02g1"
    b"\x00\x00\x00\x05group"
    b"\x03"  # status
    b"\x05n\xc5\x93ud"  # name "nœud": 5 UTF-8 bytes
    b"\x00\x00\x00\x02"  # headers: 2 pairs of (string, longstr)
    b"\x01k\x00\x00\x00\x01v"
    b"\x03key\x00\x00\x00\x05value"
)
HELLO = Hello(
    sequence=1,
    endpoint="tcp://10.0.0.1:49152",
    groups=("g1", "group"),
    status=3,
    name="nœud",
    headers={"k": "v", "key": "value"},
)

GOLDEN: list[tuple[Command, list[bytes]]] = [
    (HELLO, [HELLO_FRAME]),
    (
        Hello(1, "tcp://h:1"),
        [b"\xaa\xa1\x01\x02\x00\x01\x09tcp://h:1\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"],
    ),
    (Whisper(0x1234, (b"hi", b"")), [b"\xaa\xa1\x02\x02\x12\x34", b"hi", b""]),
    (Whisper(2), [b"\xaa\xa1\x02\x02\x00\x02"]),
    (Shout(7, "g1", (b"x",)), [b"\xaa\xa1\x03\x02\x00\x07\x02g1", b"x"]),
    (Join(65535, "grp", 255), [b"\xaa\xa1\x04\x02\xff\xff\x03grp\xff"]),
    (Leave(256, "", 0), [b"\xaa\xa1\x05\x02\x01\x00\x00\x00"]),
    (Ping(9), [b"\xaa\xa1\x06\x02\x00\x09"]),
    (PingOk(0), [b"\xaa\xa1\x07\x02\x00\x00"]),
]


def test_command_ids_follow_the_abnf() -> None:
    assert [(c.name, c.value) for c in ZreCommand] == [
        ("HELLO", 1),
        ("WHISPER", 2),
        ("SHOUT", 3),
        ("JOIN", 4),
        ("LEAVE", 5),
        ("PING", 6),
        ("PING_OK", 7),
    ]


def test_beacon_golden() -> None:
    beacon = Beacon(A, 0xC000)
    assert encode_beacon(beacon) == BEACON_A_C000
    assert len(BEACON_A_C000) == 22
    assert decode_beacon(BEACON_A_C000) == beacon
    assert not beacon.leaving


def test_beacon_port_zero_decodes_as_leaving() -> None:
    data = BEACON_A_C000[:20] + b"\x00\x00"
    beacon = decode_beacon(data)
    assert beacon == Beacon(A, 0)
    assert beacon.leaving
    assert encode_beacon(beacon) == data


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"", "length"),
        (BEACON_A_C000[:21], "length"),
        (BEACON_A_C000 + b"\x00", "length"),
        (b"ZRF\x01" + BEACON_A_C000[4:], "header"),
        (b"zre\x01" + BEACON_A_C000[4:], "header"),
        (b"ZRE\x02" + BEACON_A_C000[4:], "version"),
        (b"ZRE\x00" + BEACON_A_C000[4:], "version"),
    ],
)
def test_beacon_rejects(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_beacon(data)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("port", [-1, 65536, 1.5, "80", True])
def test_encode_beacon_rejects_bad_port(port: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_beacon(Beacon(A, port))  # type: ignore[arg-type]
    assert info.value.field == "port"


def test_encode_beacon_rejects_non_uuid() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_beacon(Beacon(A.bytes, 1))  # type: ignore[arg-type]
    assert info.value.field == "uuid"


def test_identity_round_trip_and_rejects() -> None:
    frame = encode_identity(A)
    assert frame == b"\x01" + bytes.fromhex("0123456789abcdef0123456789abcdef")
    assert decode_identity(frame) == A
    for bad in (b"", A.bytes, b"\x00" + A.bytes, frame + b"\x00"):
        with pytest.raises(RemoteProtocolError) as info:
            decode_identity(bad)
        assert info.value.field == "identity"
    with pytest.raises(LocalProtocolError):
        encode_identity("not a uuid")  # type: ignore[arg-type]


def test_tcp_endpoint() -> None:
    assert tcp_endpoint("10.0.0.1", 49152) == "tcp://10.0.0.1:49152"
    assert tcp_endpoint("fe80::1", 5) == "tcp://[fe80::1]:5"
    assert tcp_endpoint("[::1]", 5) == "tcp://[::1]:5"
    with pytest.raises(LocalProtocolError):
        tcp_endpoint("", 5)
    for port in (0, 65536, "5"):
        with pytest.raises(LocalProtocolError):
            tcp_endpoint("h", port)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cmd", "frames"), GOLDEN)
def test_command_golden(cmd: Command, frames: list[bytes]) -> None:
    assert encode_command(cmd) == frames
    assert decode_command(frames) == cmd


def test_hello_golden_fields() -> None:
    hello = decode_command([HELLO_FRAME])
    assert isinstance(hello, Hello)
    assert hello.command is ZreCommand.HELLO
    assert hello.groups == ("g1", "group")
    assert dict(hello.headers) == {"k": "v", "key": "value"}
    assert list(hello.headers) == ["k", "key"]
    assert hello.name == "nœud"


def test_commands_are_frozen_hashable_and_read_only() -> None:
    hello = Hello(1, "tcp://h:1", ["a"], 0, "n", {"x": "y"})  # type: ignore[arg-type]
    assert hello.groups == ("a",)
    assert hash(hello) == hash(Hello(1, "tcp://h:1", ("a",), 0, "n", {"x": "z"}))
    with pytest.raises(TypeError):
        hello.headers["x"] = "z"  # type: ignore[index]
    with pytest.raises(AttributeError):
        hello.sequence = 2  # type: ignore[misc]
    assert Whisper(1, [b"a"]).content == (b"a",)  # type: ignore[arg-type]
    assert Shout(1, "g", [b"a"]).content == (b"a",)  # type: ignore[arg-type]


def test_whisper_content_may_be_many_or_no_frames() -> None:
    # ABNF: content = msg, msg = *frame (zero or more); see the module docstring.
    assert decode_command([b"\xaa\xa1\x02\x02\x00\x05"]) == Whisper(5, ())
    assert decode_command([b"\xaa\xa1\x03\x02\x00\x05\x01g", b"a", b"b", b"c"]) == Shout(
        5, "g", (b"a", b"b", b"c")
    )
    frames = [bytearray(b"\xaa\xa1\x02\x02\x00\x05"), memoryview(b"m")]
    assert decode_command(frames) == Whisper(5, (b"m",))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Decoder rejections


def _reject(frames: list[bytes], field: str) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        decode_command(frames)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    return info.value


def test_rejects_no_frames() -> None:
    _reject([], "frames")


@pytest.mark.parametrize(
    "frame", [b"", b"\xaa", b"\xaa\xa0\x06\x02\x00\x01", b"\xa1\xaa\x06\x02\x00\x01", b"ZRE"]
)
def test_rejects_bad_signature(frame: bytes) -> None:
    _reject([frame], "signature")


@pytest.mark.parametrize("command_id", [0, 8, 9, 0x7F, 0xFF])
def test_rejects_unknown_command(command_id: int) -> None:
    error = _reject([b"\xaa\xa1" + bytes([command_id]) + b"\x02\x00\x01"], "command")
    assert error.value == command_id


def test_rejects_missing_command_id() -> None:
    _reject([b"\xaa\xa1"], "command")


@pytest.mark.parametrize("version", [0, 1, 3, 0xFF])
def test_rejects_wrong_version(version: int) -> None:
    error = _reject([b"\xaa\xa1\x06" + bytes([version]) + b"\x00\x01"], "version")
    assert error.value == version
    assert "expected 2" in str(error)


def test_rejects_every_truncation_of_hello() -> None:
    for end in range(len(HELLO_FRAME)):
        with pytest.raises(RemoteProtocolError) as info:
            decode_command([HELLO_FRAME[:end]])
        assert info.value.field in {
            "signature",
            "command",
            "version",
            "sequence",
            "endpoint",
            "groups",
            "status",
            "name",
            "headers",
        }


@pytest.mark.parametrize(("cmd", "frames"), GOLDEN)
def test_rejects_trailing_garbage(cmd: Command, frames: list[bytes]) -> None:
    _reject([frames[0] + b"\x00", *frames[1:]], "frame")


@pytest.mark.parametrize("cmd", [c for c, _ in GOLDEN if not isinstance(c, (Whisper, Shout))])
def test_rejects_extra_frames_on_single_frame_commands(cmd: Command) -> None:
    _reject([*encode_command(cmd), b"extra"], "frames")


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (b"\xaa\xa1\x01\x02\x00\x01\x01\xff", "endpoint"),
        (b"\xaa\xa1\x01\x02\x00\x01\x00\x00\x00\x00\x01\x00\x00\x00\x01\xc3", "groups"),
        (b"\xaa\xa1\x01\x02\x00\x01\x00\x00\x00\x00\x00\x00\x02\xed\xa0", "name"),
        (
            b"\xaa\xa1\x01\x02\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x01\x80\x00\x00\x00\x00",
            "headers",
        ),
        (b"\xaa\xa1\x03\x02\x00\x01\x01\xfe", "group"),
        (b"\xaa\xa1\x04\x02\x00\x01\x01\xc0\x00", "group"),
        (b"\xaa\xa1\x05\x02\x00\x01\x01\xc0\x00", "group"),
    ],
)
def test_rejects_non_utf8(frame: bytes, field: str) -> None:
    error = _reject([frame], field)
    assert "UTF-8" in str(error)


def test_rejects_duplicate_header_name() -> None:
    frame = (
        b"\xaa\xa1\x01\x02\x00\x01\x00\x00\x00\x00\x00\x00\x00"
        b"\x00\x00\x00\x02\x01k\x00\x00\x00\x01v\x01k\x00\x00\x00\x01w"
    )
    error = _reject([frame], "headers")
    assert error.value == "k"


def test_rejects_absurd_counts_without_looping() -> None:
    groups = b"\xaa\xa1\x01\x02\x00\x01\x00\xff\xff\xff\xff"
    assert "count 4294967295" in str(_reject([groups], "groups"))
    headers = b"\xaa\xa1\x01\x02\x00\x01\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\xff"
    _reject([headers], "headers")


# ---------------------------------------------------------------------------------------
# Encoder misuse


@pytest.mark.parametrize(
    ("cmd", "field"),
    [
        (Ping(65536), "sequence"),
        (Ping(-1), "sequence"),
        (Ping("1"), "sequence"),  # type: ignore[arg-type]
        (Join(1, "g", 256), "status"),
        (Hello(1, "tcp://h:1", status=-1), "status"),
        (Hello(1, "x" * 256), "endpoint"),
        (Hello(1, "tcp://h:1", name="é" * 128), "name"),
        (Hello(1, "tcp://h:1", name="\ud800"), "name"),
        (Hello(1, "tcp://h:1", name=b"n"), "name"),  # type: ignore[arg-type]
        (Hello(1, "tcp://h:1", groups=(3,)), "groups"),  # type: ignore[arg-type]
        (Hello(1, "tcp://h:1", headers={"k" * 256: "v"}), "headers"),
        (Hello(1, "tcp://h:1", headers={"k": "\udfff"}), "headers"),
        (Shout(1, "g" * 256), "group"),
        (Leave(1, "g" * 300, 0), "group"),
        (Whisper(1, ("text",)), "content"),  # type: ignore[arg-type]
    ],
)
def test_encode_rejects_misuse(cmd: Command, field: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_command(cmd)
    assert info.value.field == field
    assert field in str(info.value)


def test_encode_accepts_longest_string_and_long_longstr() -> None:
    hello = Hello(1, "e" * 255, groups=("g" * 1000,), headers={"k" * 255: "v" * 70000})
    assert decode_command(encode_command(hello)) == hello


def test_encode_rejects_non_command() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_command(Beacon(A, 1))  # type: ignore[arg-type]
    assert info.value.field == "command"


# ---------------------------------------------------------------------------------------
# Hypothesis: round trips and garbage

texts = st.text(max_size=60)  # <= 240 UTF-8 bytes: always fits a `string`
sequences = st.integers(0, 0xFFFF)
statuses = st.integers(0, 0xFF)
contents = st.lists(st.binary(max_size=64), max_size=4).map(tuple)
commands: st.SearchStrategy[Command] = st.one_of(
    st.builds(
        Hello,
        sequences,
        texts,
        st.lists(st.text(max_size=100), max_size=5).map(tuple),
        statuses,
        texts,
        st.dictionaries(texts, st.text(max_size=100), max_size=5),
    ),
    st.builds(Whisper, sequences, contents),
    st.builds(Shout, sequences, texts, contents),
    st.builds(Join, sequences, texts, statuses),
    st.builds(Leave, sequences, texts, statuses),
    st.builds(Ping, sequences),
    st.builds(PingOk, sequences),
)


@given(commands)
@settings(max_examples=1000)
def test_round_trip(cmd: Command) -> None:
    frames = encode_command(cmd)
    assert all(type(f) is bytes for f in frames)
    assert decode_command(frames) == cmd


@given(st.builds(Beacon, st.uuids(), st.integers(0, 0xFFFF)))
def test_beacon_round_trip(beacon: Beacon) -> None:
    assert decode_beacon(encode_beacon(beacon)) == beacon


def _decode_or_remote_error(frames: list[bytes]) -> None:
    try:
        cmd = decode_command(frames)
    except RemoteProtocolError as e:
        assert e.field is not None
    else:
        assert encode_command(cmd) == frames  # what decodes is in canonical form


@given(st.lists(st.binary(max_size=80), max_size=4))
@settings(max_examples=2000)
def test_random_frames_raise_only_remote_errors(frames: list[bytes]) -> None:
    _decode_or_remote_error(frames)


@given(
    st.integers(1, 7),
    st.integers(0, 3),
    st.binary(max_size=80),
    st.lists(st.binary(max_size=8), max_size=2),
)
@settings(max_examples=2000)
def test_random_bodies_after_a_valid_header_raise_only_remote_errors(
    command_id: int, version: int, body: bytes, extra: list[bytes]
) -> None:
    _decode_or_remote_error([b"\xaa\xa1" + bytes([command_id, version]) + body, *extra])


@given(commands, st.randoms(use_true_random=False))
@settings(max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_frames_raise_only_remote_errors(cmd: Command, rng: random.Random) -> None:
    frames = encode_command(cmd)
    _decode_or_remote_error([mutate(frames[0], rng), *frames[1:]])


@given(st.binary(max_size=40))
@settings(max_examples=1000)
def test_random_beacons_raise_only_remote_errors(data: bytes) -> None:
    for candidate in (data, b"ZRE\x01" + data):
        try:
            beacon = decode_beacon(candidate)
        except RemoteProtocolError:
            continue
        assert encode_beacon(beacon) == candidate


@given(st.binary(max_size=20))
def test_random_identities_raise_only_remote_errors(data: bytes) -> None:
    for candidate in (data, b"\x01" + data):
        with contextlib.suppress(RemoteProtocolError):
            assert encode_identity(decode_identity(candidate)) == candidate


# ---------------------------------------------------------------------------------------
# Peer table


def hello(seq: int = 1, *, name: str = "a", groups: tuple[str, ...] = (), **kw: object) -> Hello:
    return Hello(seq, kw.pop("endpoint", "tcp://10.0.0.2:50000"), groups, 0, name, **kw)  # type: ignore[arg-type]


def entered(peer: UUID = A, *, now: float = 0.0, **kw: object) -> PeerTable:
    """A table where ``peer`` was discovered by beacon and has said HELLO."""
    table = PeerTable(ME)
    assert table.on_beacon(Beacon(peer, 50000), "10.0.0.2", now) == [
        ConnectAction(peer, "tcp://10.0.0.2:50000")
    ]
    events = table.on_message(peer, hello(**kw), now)  # type: ignore[arg-type]
    assert isinstance(events[0], EnterEvent)
    return table


def test_table_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        PeerTable(ME, evasive_after=0)
    with pytest.raises(ConfigError):
        PeerTable(ME, evasive_after=5, expired_after=5)
    table = PeerTable(ME, evasive_after=1, expired_after=2)
    assert (table.evasive_after, table.expired_after) == (1.0, 2.0)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_peers": 0}, "max_peers"),
        ({"max_unconfirmed": 0}, "max_unconfirmed"),
        ({"max_peers": True}, "max_peers"),
        ({"max_peers": 4, "max_unconfirmed": 5}, "max_unconfirmed"),
    ],
)
def test_table_bounds_are_validated(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        PeerTable(ME, **kw)  # type: ignore[arg-type]
    assert field in str(e.value)


def _uuids(n: int, base: int = 1) -> list[UUID]:
    return [UUID(int=(base << 64) + i) for i in range(n)]


def test_forged_beacons_evict_the_oldest_unconfirmed_peer() -> None:
    table = PeerTable(ME, max_peers=10, max_unconfirmed=3)
    fakes = _uuids(5)
    events: list[Event] = []
    for i, u in enumerate(fakes):
        events += table.on_beacon(Beacon(u, 9), "127.0.0.1", float(i))
    # Each fake got a CONNECT; the 4th and 5th evicted the two oldest, in order.
    assert [e for e in events if isinstance(e, DropAction)] == [
        DropAction(fakes[0], DropReason.CROWDED, "newer unconfirmed peers"),
        DropAction(fakes[1], DropReason.CROWDED, "newer unconfirmed peers"),
    ]
    assert sum(isinstance(e, ConnectAction) for e in events) == 5
    assert len(table) == 3
    # A real peer arriving after the flood still gets in and, once it says HELLO, is
    # confirmed: later fakes evict other fakes, never it.
    table.on_beacon(Beacon(A, 50000), "10.0.0.2", 10.0)
    assert isinstance(table.on_message(A, hello(), 10.0)[0], EnterEvent)
    for i, u in enumerate(_uuids(10, base=2)):
        table.on_beacon(Beacon(u, 9), "127.0.0.1", 11.0 + i)
    peer = table.get(A)
    assert peer is not None and peer.ready
    assert len(table) == 4 and table.refused == 0


def test_a_full_table_refuses_new_nodes_until_a_place_frees_up() -> None:
    table = PeerTable(ME, max_peers=2, max_unconfirmed=2)
    for u in (A, B):
        table.on_beacon(Beacon(u, 50000), "10.0.0.2", 0.0)
        table.on_message(u, hello(), 0.0)
    c = UUID(int=99)
    assert table.on_beacon(Beacon(c, 50000), "10.0.0.3", 1.0) == []
    assert table.on_message(c, hello(endpoint="tcp://10.0.0.3:1"), 1.0) == []
    assert c not in table and table.refused == 2
    table.on_beacon(Beacon(A, 0), "10.0.0.2", 2.0)  # A leaves
    assert table.on_beacon(Beacon(c, 50000), "10.0.0.3", 3.0) == [
        ConnectAction(c, "tcp://10.0.0.3:50000")
    ]


def test_forged_beacons_repeated_cannot_hold_the_last_places() -> None:
    # Three greeted peers and one forged UUID re-sent forever fill a table of 4: a real
    # newcomer still gets in, by its beacon or its HELLO, evicting the forged entry.
    table = PeerTable(ME, max_peers=4, max_unconfirmed=2)
    greeted = _uuids(3, base=5)
    for u in greeted:
        table.on_beacon(Beacon(u, 50000), "10.0.0.2", 0.0)
        table.on_message(u, hello(), 0.0)
    forged = UUID(int=77)
    for t in range(5):
        table.on_beacon(Beacon(forged, 9), "127.0.0.1", float(t))
    real = UUID(int=88)
    events = table.on_message(real, hello(endpoint="tcp://10.0.0.9:1"), 6.0)
    assert DropAction(forged, DropReason.CROWDED, "newer unconfirmed peers") in events
    assert any(isinstance(e, EnterEvent) for e in events)
    assert real in table and table.refused == 0
    # Now every place holds a greeted peer: the forged node is refused, not let in.
    assert table.on_beacon(Beacon(forged, 9), "127.0.0.1", 7.0) == []
    assert forged not in table and table.refused == 1


def test_beacon_new_peer_connects_once() -> None:
    table = PeerTable(ME)
    assert table.on_beacon(Beacon(A, 49152), "192.168.1.7", 0.0) == [
        ConnectAction(A, "tcp://192.168.1.7:49152")
    ]
    assert table.on_beacon(Beacon(A, 49152), "192.168.1.7", 1.0) == []
    assert A in table and len(table) == 1
    peer = table.get(A)
    assert peer is not None
    assert not peer.ready and peer.last_seen == 1.0 and peer.endpoint == "tcp://192.168.1.7:49152"
    assert table.get(B) is None


def test_beacon_ipv6_sender() -> None:
    table = PeerTable(ME)
    assert table.on_beacon(Beacon(A, 5), "fe80::1", 0.0) == [ConnectAction(A, "tcp://[fe80::1]:5")]


def test_own_beacons_and_messages_are_ignored() -> None:
    table = PeerTable(ME)
    assert table.on_beacon(Beacon(ME, 1), "h", 0.0) == []
    assert table.on_message(ME, hello(), 0.0) == []
    assert len(table) == 0


def test_port_zero_beacon() -> None:
    table = entered(A, name="alice")
    assert table.on_beacon(Beacon(A, 0), "10.0.0.2", 1.0) == [
        ExitEvent(A, "alice"),
        DropAction(A, DropReason.LEAVING, "port-0 beacon"),
    ]
    assert A not in table
    assert table.on_beacon(Beacon(B, 0), "h", 1.0) == []  # unknown: nothing to do
    table.on_beacon(Beacon(B, 1), "h", 1.0)
    assert table.on_beacon(Beacon(B, 0), "h", 2.0) == [  # known but never entered: no EXIT
        DropAction(B, DropReason.LEAVING, "port-0 beacon")
    ]


def test_hello_enters_and_joins_groups() -> None:
    table = PeerTable(ME)
    table.on_beacon(Beacon(A, 50000), "10.0.0.2", 0.0)
    events = table.on_message(
        A,
        Hello(1, "tcp://10.0.0.2:50000", ("g1", "g2", "g1"), 7, "alice", {"k": "v"}),
        1.0,
    )
    assert events == [
        EnterEvent(A, "alice", {"k": "v"}, "tcp://10.0.0.2:50000"),
        JoinEvent(A, "alice", "g1"),
        JoinEvent(A, "alice", "g2"),
    ]
    assert [e.kind for e in events] == [ZreEventType.ENTER, ZreEventType.JOIN, ZreEventType.JOIN]
    peer = table.get(A)
    assert peer is not None
    assert peer.ready and peer.name == "alice" and peer.status == 7
    assert peer.groups == {"g1", "g2"} and dict(peer.headers) == {"k": "v"}
    assert peer.expected_sequence == 2 and peer.last_seen == 1.0
    assert table.groups() == {"g1", "g2"}


def test_hello_from_unknown_peer_connects_back() -> None:
    table = PeerTable(ME)
    events = table.on_message(B, hello(endpoint="tcp://10.0.0.9:6000", name="bob"), 0.0)
    assert events == [
        ConnectAction(B, "tcp://10.0.0.9:6000"),
        EnterEvent(B, "bob", {}, "tcp://10.0.0.9:6000"),
    ]


def test_hello_without_endpoint_from_unknown_peer_is_discarded() -> None:
    table = PeerTable(ME)
    assert table.on_message(B, hello(endpoint=""), 0.0) == []
    assert B not in table


def test_commands_before_hello_are_ignored() -> None:
    table = PeerTable(ME)
    for cmd in (Whisper(1, (b"x",)), Join(1, "g", 1), Ping(1), PingOk(2)):
        assert table.on_message(A, cmd, 0.0) == []  # unknown peer
    assert len(table) == 0
    table.on_beacon(Beacon(A, 1), "h", 0.0)
    later: list[Command] = [Whisper(5, (b"x",)), Shout(1, "g", ()), Leave(2, "g", 0), Ping(9)]
    for later_cmd in later:
        assert table.on_message(A, later_cmd, 3.0) == []  # known by beacon, no HELLO yet
    peer = table.get(A)
    assert peer is not None and peer.last_seen == 0.0  # ignored traffic is not activity
    assert table.on_message(A, hello(name="late"), 4.0)[0] == EnterEvent(
        A, "late", {}, "tcp://10.0.0.2:50000"
    )


def test_hello_must_be_sequence_one() -> None:
    table = PeerTable(ME)
    assert table.on_message(A, hello(2), 0.0) == []  # unknown: nothing to drop
    table.on_beacon(Beacon(A, 1), "h", 0.0)
    assert table.on_message(A, hello(0), 0.0) == [
        DropAction(A, DropReason.SEQUENCE, "HELLO sequence 0, expected 1")
    ]
    assert A not in table


def test_second_hello_means_restart() -> None:
    table = entered(A, name="old", groups=("g",))
    events = table.on_message(A, hello(name="new", endpoint="tcp://10.0.0.3:1"), 5.0)
    assert events == [
        ExitEvent(A, "old"),
        DropAction(A, DropReason.RESTARTED, "second HELLO"),
        ConnectAction(A, "tcp://10.0.0.3:1"),
        EnterEvent(A, "new", {}, "tcp://10.0.0.3:1"),
    ]
    peer = table.get(A)
    assert peer is not None and peer.groups == frozenset() and peer.sent_sequence == 0


def test_second_hello_with_bad_sequence_drops() -> None:
    table = entered(A, name="a")
    assert table.on_message(A, hello(3), 1.0) == [
        ExitEvent(A, "a"),
        DropAction(A, DropReason.SEQUENCE, "HELLO sequence 3, expected 1"),
    ]


@pytest.mark.parametrize("bad", [4, 2, 0, 65535])
def test_sequence_gap_or_repeat_drops_peer(bad: int) -> None:
    table = entered(A, name="a")
    assert table.on_message(A, Ping(2), 1.0) == [SendPingOkAction(A)]
    events = table.on_message(A, Whisper(bad, (b"x",)), 2.0)
    assert events == [
        ExitEvent(A, "a"),
        DropAction(A, DropReason.SEQUENCE, f"WHISPER sequence {bad}, expected 3"),
    ]
    assert A not in table
    assert table.on_message(A, Whisper(4, (b"x",)), 3.0) == []  # in flight: ignored now


def test_incoming_sequence_wraps_at_uint16() -> None:
    table = entered(A)
    for seq in range(2, 0x10000):
        assert table.on_message(A, PingOk(seq), 1.0) == []
    peer = table.get(A)
    assert peer is not None and peer.expected_sequence == 0
    assert table.on_message(A, PingOk(0), 1.0) == []
    assert table.on_message(A, PingOk(1), 1.0) == []
    assert table.on_message(A, PingOk(2), 1.0) == []


def test_whisper_and_shout_events() -> None:
    table = entered(A, name="alice")
    assert table.on_message(A, Whisper(2, (b"a", b"b")), 1.0) == [
        WhisperEvent(A, "alice", (b"a", b"b"))
    ]
    assert table.on_message(A, Shout(3, "g", (b"c",)), 1.0) == [
        ShoutEvent(A, "alice", "g", (b"c",))
    ]


def test_join_and_leave_track_groups_and_status() -> None:
    table = entered(A, name="a", groups=("g1",))
    assert table.on_message(A, Join(2, "g2", 1), 1.0) == [JoinEvent(A, "a", "g2")]
    assert table.on_message(A, Join(3, "g2", 2), 1.0) == []  # already in: no event
    assert [p.uuid for p in table.peers_in_group("g2")] == [A]
    assert table.on_message(A, Leave(4, "g1", 3), 1.0) == [LeaveEvent(A, "a", "g1")]
    assert table.on_message(A, Leave(5, "zz", 4), 1.0) == []  # never in: no event
    peer = table.get(A)
    assert peer is not None and peer.groups == {"g2"} and peer.status == 4
    assert table.peers_in_group("g1") == []
    assert table.groups() == {"g2"}


def test_groups_are_case_sensitive() -> None:
    table = entered(A, groups=("G",))
    assert table.peers_in_group("g") == []
    assert len(table.peers_in_group("G")) == 1


def test_peers_in_group_only_entered_and_sorted() -> None:
    table = PeerTable(ME)
    for peer in (C, A, B):
        table.on_message(peer, hello(groups=("g",), endpoint=f"tcp://h:{peer.int % 1000 + 1}"), 0)
    table.on_beacon(Beacon(UUID(int=5), 9), "h", 0.0)  # known, not entered
    assert [p.uuid for p in table.peers_in_group("g")] == sorted([A, B, C])
    assert [p.uuid for p in table.peers()] == sorted([A, B, C, UUID(int=5)])


def test_ping_gets_ping_ok_and_ping_ok_refreshes() -> None:
    table = entered(A)
    assert table.on_message(A, Ping(2), 3.0) == [SendPingOkAction(A)]
    assert table.on_message(A, PingOk(3), 4.0) == []
    peer = table.get(A)
    assert peer is not None and peer.last_seen == 4.0


def test_evasive_then_expired() -> None:
    table = entered(A, name="a", now=100.0)
    assert table.next_deadline() == 105.0
    assert table.tick(104.999) == []
    assert table.tick(105.0) == [EvasiveEvent(A, "a"), SendPingAction(A)]
    assert table.tick(106.0) == []  # PING once per silence
    peer = table.get(A)
    assert peer is not None and peer.evasive
    assert table.next_deadline() == 130.0
    assert table.tick(129.9) == []
    assert table.tick(130.0) == [
        ExitEvent(A, "a"),
        DropAction(A, DropReason.EXPIRED, "silent 30.000 s"),
    ]
    assert A not in table
    assert table.next_deadline() is None


def test_activity_resets_evasive() -> None:
    table = entered(A, name="a")
    assert table.tick(6.0) == [EvasiveEvent(A, "a"), SendPingAction(A)]
    assert table.on_message(A, PingOk(2), 7.0) == []
    peer = table.get(A)
    assert peer is not None and not peer.evasive
    assert table.tick(11.0) == []
    assert table.tick(12.0) == [EvasiveEvent(A, "a"), SendPingAction(A)]
    assert table.on_beacon(Beacon(A, 50000), "10.0.0.2", 13.0) == []  # beacons refresh too
    assert table.tick(17.5) == []
    assert table.tick(42.9) == [EvasiveEvent(A, "a"), SendPingAction(A)]
    assert table.tick(43.0)[-1] == DropAction(A, DropReason.EXPIRED, "silent 30.000 s")


def test_unentered_peer_is_never_pinged_but_expires() -> None:
    table = PeerTable(ME, evasive_after=1.0, expired_after=2.0)
    table.on_beacon(Beacon(A, 1), "h", 0.0)
    assert table.next_deadline() == 2.0
    assert table.tick(1.5) == []
    assert table.tick(2.0) == [DropAction(A, DropReason.EXPIRED, "silent 2.000 s")]


def test_time_going_backwards_does_not_unrefresh() -> None:
    table = entered(A, now=10.0)
    table.on_beacon(Beacon(A, 50000), "10.0.0.2", 5.0)
    peer = table.get(A)
    assert peer is not None and peer.last_seen == 10.0


def test_tick_orders_events_by_uuid() -> None:
    table = PeerTable(ME)
    for peer in (C, A, B):
        table.on_beacon(Beacon(peer, 1), "h", 0.0)
    assert [e.peer for e in table.tick(30.0)] == [A, B, C]


def test_local_remove() -> None:
    table = entered(A, name="a")
    assert table.remove(A, "send buffer full") == [
        ExitEvent(A, "a"),
        DropAction(A, DropReason.LOCAL, "send buffer full"),
    ]
    assert table.remove(A) == []


def test_on_message_rejects_non_command() -> None:
    with pytest.raises(LocalProtocolError):
        PeerTable(ME).on_message(A, b"\xaa\xa1", 0.0)  # type: ignore[arg-type]


def test_on_beacon_rejects_empty_host() -> None:
    with pytest.raises(LocalProtocolError):
        PeerTable(ME).on_beacon(Beacon(A, 1), "", 0.0)


# ---------------------------------------------------------------------------------------
# Outgoing sequence numbers


def test_stamp_starts_with_hello_and_counts_up() -> None:
    table = PeerTable(ME)
    table.on_beacon(Beacon(A, 1), "h", 0.0)
    with pytest.raises(LocalProtocolError) as info:
        table.stamp(A, Ping(0))
    assert info.value.field == "command" and info.value.value is ZreCommand.PING
    assert table.stamp(A, hello(99)) == hello(1)
    assert table.stamp(A, Whisper(0, (b"x",))) == Whisper(2, (b"x",))
    assert table.stamp(A, Ping(0)) == Ping(3)
    assert table.stamp(A, hello(50)).sequence == 1  # a new HELLO restarts the count
    assert table.stamp(A, Join(0, "g", 1)) == Join(2, "g", 1)
    peer = table.get(A)
    assert peer is not None and peer.sent_sequence == 2


def test_stamp_wraps_at_uint16() -> None:
    table = PeerTable(ME)
    table.on_beacon(Beacon(A, 1), "h", 0.0)
    table.stamp(A, hello())
    for expected in range(2, 0x10000):
        assert table.stamp(A, Ping(0)).sequence == expected
    assert table.stamp(A, Ping(0)).sequence == 0
    assert table.stamp(A, PingOk(0)).sequence == 1


def test_stamp_misuse() -> None:
    table = PeerTable(ME)
    with pytest.raises(LocalProtocolError) as info:
        table.stamp(A, hello())
    assert info.value.field == "peer"
    table.on_beacon(Beacon(A, 1), "h", 0.0)
    with pytest.raises(LocalProtocolError):
        table.stamp(A, "PING")  # type: ignore[type-var]


def test_stamped_sequences_are_accepted_by_a_peer_table() -> None:
    # Two tables talking: what one stamps, the other must accept in order.
    sender, receiver = PeerTable(A), PeerTable(B)
    sender.on_beacon(Beacon(B, 1), "h", 0.0)
    receiver.on_beacon(Beacon(A, 1), "h", 0.0)
    outgoing: list[Command] = [
        hello(),
        Join(0, "g", 1),
        Whisper(0, (b"w",)),
        Ping(0),
        Leave(0, "g", 2),
    ]
    events: list[Event] = []
    for cmd in outgoing:
        frames = encode_command(sender.stamp(B, cmd))
        events += receiver.on_message(A, decode_command(frames), 1.0)
    assert [e.kind for e in events] == [
        ZreEventType.ENTER,
        ZreEventType.JOIN,
        ZreEventType.WHISPER,
        ZreEventType.SEND_PING_OK,
        ZreEventType.LEAVE,
    ]


# ---------------------------------------------------------------------------------------
# Hypothesis: the table's contract with the transport and the application

peer_ids = st.sampled_from([A, B, C, ME])
table_inputs = st.one_of(
    st.tuples(st.just("beacon"), peer_ids, st.sampled_from([0, 1, 2])),
    st.tuples(st.just("message"), peer_ids, commands),
    st.tuples(st.just("hello"), peer_ids, st.sampled_from(["", "tcp://h:1"])),
    st.tuples(st.just("next"), peer_ids, st.sampled_from(["ping", "join", "leave", "whisper"])),
    st.tuples(st.just("tick"), peer_ids, st.floats(0, 40)),
    st.tuples(st.just("remove"), peer_ids, st.none()),
)


@given(st.lists(table_inputs, max_size=40))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_table_keeps_connect_drop_and_enter_exit_paired(
    inputs: list[tuple[str, UUID, Any]],
) -> None:
    table = PeerTable(ME)
    now = 0.0
    connected: set[UUID] = set()
    present: set[UUID] = set()
    groups: dict[UUID, set[str]] = {}
    for kind, peer, arg in inputs:
        if kind == "beacon":
            events = table.on_beacon(Beacon(peer, arg), "10.0.0.1", now)
        elif kind == "message":
            events = table.on_message(peer, arg, now)
        elif kind == "hello":
            events = table.on_message(peer, Hello(1, arg, ("g",)), now)
        elif kind == "next":
            record = table.get(peer)
            seq = record.expected_sequence if record else 2
            choices: dict[str, Command] = {
                "ping": Ping(seq),
                "join": Join(seq, "h", 1),
                "leave": Leave(seq, "g", 1),
                "whisper": Whisper(seq, (b"x",)),
            }
            cmd = choices[arg]
            events = table.on_message(peer, cmd, now)
        elif kind == "tick":
            now += arg
            events = table.tick(now)
        else:
            events = table.remove(peer)
        for event in events:
            assert event.peer != ME
            if isinstance(event, ConnectAction):
                assert event.peer not in connected
                connected.add(event.peer)
            elif isinstance(event, DropAction):
                assert event.peer in connected
                connected.discard(event.peer)
                assert event.peer not in present  # EXIT comes before DROP
            elif isinstance(event, EnterEvent):
                assert event.peer in connected and event.peer not in present
                present.add(event.peer)
                groups[event.peer] = set()
            elif isinstance(event, ExitEvent):
                assert event.peer in present
                present.discard(event.peer)
            else:
                assert event.peer in present
                if isinstance(event, JoinEvent):
                    assert event.group not in groups[event.peer]
                    groups[event.peer].add(event.group)
                elif isinstance(event, LeaveEvent):
                    groups[event.peer].remove(event.group)
        assert {p.uuid for p in table.peers()} == connected
        assert {p.uuid for p in table.peers() if p.ready} == present
        for p in table.peers():
            assert p.ready or not p.groups
            if p.ready:
                assert p.groups == groups[p.uuid]
        deadline = table.next_deadline()
        assert (deadline is None) == (len(table) == 0)


# ---------------------------------------------------------------------------------------
# ZIO ports in HELLO headers


def test_zio_port_headers() -> None:
    assert zio_port_headers("out", "tcp://10.0.0.5:41000", "SERVER") == {
        "zio.port.out.address": "tcp://10.0.0.5:41000",
        "zio.port.out.socket": "SERVER",
    }
    for name in ("", "a.b", "x" * 239, 3):
        with pytest.raises(LocalProtocolError) as info:
            zio_port_headers(name, "tcp://h:1", "SERVER")  # type: ignore[arg-type]
        assert info.value.field in {"name", "headers"}
    assert len(zio_port_headers("x" * 238, "a", "b")) == 2  # key of exactly 255 bytes
    for address, socket_type in (("", "SERVER"), ("tcp://h:1", "")):
        with pytest.raises(LocalProtocolError):
            zio_port_headers("out", address, socket_type)


def test_advertised_ports() -> None:
    headers = {
        **zio_port_headers("out", "tcp://h:1", "SERVER"),
        **zio_port_headers("in", "tcp://h:2", "ROUTER"),
        "zio.port.out.credit": "10",  # unknown attribute: ignored
        "zio.port..address": "x",  # no name: ignored
        "zio.port.a.b.address": "x",  # dotted name: ignored
        "zio.port.address": "x",  # no attribute: ignored
        "X-Other": "y",
    }
    ports = advertised_ports(headers)
    assert ports == {"in": ZioPort("tcp://h:2", "ROUTER"), "out": ZioPort("tcp://h:1", "SERVER")}
    assert list(ports) == ["in", "out"]
    address, socket_type = ports["out"]
    assert (address, socket_type) == ("tcp://h:1", "SERVER")
    assert advertised_ports({}) == {}


@pytest.mark.parametrize(
    ("headers", "field"),
    [
        ({"zio.port.out.address": "tcp://h:1"}, "zio.port.out.socket"),
        ({"zio.port.out.socket": "SERVER"}, "zio.port.out.address"),
        ({"zio.port.out.address": "", "zio.port.out.socket": "SERVER"}, "zio.port.out.address"),
    ],
)
def test_advertised_ports_rejects_half_ads(headers: dict[str, str], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        advertised_ports(headers)
    assert info.value.field == field
    assert field in str(info.value)


def test_group_zio_endpoints() -> None:
    table = PeerTable(ME)
    table.on_message(
        B,
        Hello(1, "tcp://b:1", ("zio",), 0, "bob", zio_port_headers("out", "tcp://b:9", "SERVER")),
        0.0,
    )
    table.on_message(
        A,
        Hello(
            1,
            "tcp://a:1",
            ("zio",),
            0,
            "alice",
            {
                **zio_port_headers("out", "tcp://a:9", "SERVER"),
                **zio_port_headers("mon", "tcp://a:8", "ROUTER"),
            },
        ),
        0.0,
    )
    broken = {"zio.port.out.address": "tcp://c:9"}
    table.on_message(C, Hello(1, "tcp://c:1", ("zio",), 0, "carol", broken), 0.0)
    table.on_message(UUID(int=1), Hello(1, "tcp://d:1", ("other",), 0, "dave", {}), 0.0)
    assert group_zio_endpoints(table, "zio") == [
        ZioEndpoint(A, "alice", "mon", "tcp://a:8", "ROUTER"),
        ZioEndpoint(A, "alice", "out", "tcp://a:9", "SERVER"),
        ZioEndpoint(B, "bob", "out", "tcp://b:9", "SERVER"),
    ]
    assert group_zio_endpoints(table, "zio", port="out") == [
        ZioEndpoint(A, "alice", "out", "tcp://a:9", "SERVER"),
        ZioEndpoint(B, "bob", "out", "tcp://b:9", "SERVER"),
    ]
    assert group_zio_endpoints(table, "other") == []
    assert group_zio_endpoints(table, "nobody") == []


# ---------------------------------------------------------------------------------------
# Purity


@pytest.mark.parametrize("module", [zre, zre_peers, zio_ports])
def test_module_imports_no_io(module: ModuleType) -> None:
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    forbidden = {"zmq", "pyspark", "threading", "socket", "time", "asyncio", "select", "os"}
    assert not imported & forbidden


def test_import_in_fresh_interpreter_pulls_no_zmq_or_pyspark() -> None:
    code = (
        "import sys, zio_spark.protocol.zre, zio_spark.protocol.zre_peers, "
        "zio_spark.protocol.zio_ports; "
        "bad = {'zmq', 'pyspark', 'asyncio'} & set(sys.modules); "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
