"""Large fuzz runs for zio_spark.protocol.zre (marked ``fuzz``; not in the default run).

A seeded random loop, not hypothesis, for speed: >= 100k inputs per decoder, half pure
garbage and half mutations of valid encodings. Garbage must raise RemoteProtocolError and
nothing else; anything that decodes must re-encode to the same bytes and be accepted by a
PeerTable without error. Run with ``pytest -m fuzz tests/unit/test_zre_fuzz.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from uuid import UUID

import pytest

from tests.fuzz_live.live_fuzz_support import mutate
from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.zio_ports import advertised_ports
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
    decode_beacon,
    decode_command,
    decode_identity,
    encode_beacon,
    encode_command,
    encode_identity,
)
from zio_spark.protocol.zre_peers import PeerTable

pytestmark = pytest.mark.fuzz

EXAMPLES = 100_000
# What a mutation writes over a byte (the shared mutator's default adds JSON's '"' and '{').
ZRE_SPECIAL_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xC3, 0xFF)
ME = UUID(int=0)
PEER = UUID(int=1)


def _text(rng: random.Random, max_len: int) -> str:
    alphabet = "abcXYZ019 ._:/-é€\U0001f600zio.port.address.socket"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def _command(rng: random.Random) -> Command:
    seq = rng.choice([0, 1, 2, 255, 256, 65535, rng.randrange(65536)])
    kind = rng.randrange(7)
    if kind == 0:
        headers = {_text(rng, 20): _text(rng, 30) for _ in range(rng.randint(0, 4))}
        groups = tuple(_text(rng, 10) for _ in range(rng.randint(0, 4)))
        return Hello(seq, _text(rng, 40), groups, rng.randrange(256), _text(rng, 20), headers)
    if kind == 1:
        return Whisper(
            seq, tuple(rng.randbytes(rng.randint(0, 8)) for _ in range(rng.randint(0, 3)))
        )
    if kind == 2:
        return Shout(seq, _text(rng, 20), (rng.randbytes(rng.randint(0, 8)),))
    if kind == 3:
        return Join(seq, _text(rng, 20), rng.randrange(256))
    if kind == 4:
        return Leave(seq, _text(rng, 20), rng.randrange(256))
    return Ping(seq) if kind == 5 else PingOk(seq)


def _garbage_or_mutant(rng: random.Random, valid: Callable[[], bytes], prefix: bytes) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randint(0, 64))
    if choice == 1:
        return prefix + rng.randbytes(rng.randint(0, 64))
    return mutate(valid(), rng, ZRE_SPECIAL_BYTES)


def test_fuzz_decode_command() -> None:
    rng = random.Random(36)
    table = PeerTable(ME, evasive_after=1.0, expired_after=2.0)
    decoded = 0
    for i in range(EXAMPLES):
        header = b"\xaa\xa1" + bytes([rng.randint(0, 8), rng.choice([2, 2, 2, 1, 3])])
        frames = [_garbage_or_mutant(rng, lambda: encode_command(_command(rng))[0], header)]
        frames += [rng.randbytes(rng.randint(0, 4)) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
        try:
            cmd = decode_command(frames)
        except RemoteProtocolError as e:
            assert e.field is not None
            continue
        decoded += 1
        assert encode_command(cmd) == frames
        table.on_message(PEER, cmd, float(i))
        table.tick(float(i))
        if isinstance(cmd, Hello):
            try:
                advertised_ports(cmd.headers)
            except RemoteProtocolError as e:
                assert e.field is not None and e.field.startswith("zio.port.")
    assert decoded > EXAMPLES // 100  # the mutants must reach past the header checks


def test_fuzz_decode_beacon() -> None:
    rng = random.Random(5670)
    table = PeerTable(ME)
    decoded = 0
    for i in range(EXAMPLES):
        data = _garbage_or_mutant(
            rng,
            lambda: encode_beacon(Beacon(UUID(int=rng.getrandbits(128)), rng.randrange(65536))),
            b"ZRE\x01" + rng.randbytes(rng.choice([16, 18, 18, 19])),
        )
        try:
            beacon = decode_beacon(data)
        except RemoteProtocolError as e:
            assert e.field in {"length", "header", "version"}
            continue
        decoded += 1
        assert encode_beacon(beacon) == data
        table.on_beacon(beacon, "127.0.0.1", float(i))
    assert decoded > EXAMPLES // 100


def test_fuzz_decode_identity() -> None:
    rng = random.Random(17)
    decoded = 0
    for _ in range(EXAMPLES):
        frame = _garbage_or_mutant(
            rng,
            lambda: encode_identity(UUID(int=rng.getrandbits(128))),
            b"\x01" + rng.randbytes(rng.choice([15, 16, 16, 17])),
        )
        try:
            uuid = decode_identity(frame)
        except RemoteProtocolError as e:
            assert e.field == "identity"
            continue
        decoded += 1
        assert encode_identity(uuid) == frame
    assert decoded > EXAMPLES // 100
