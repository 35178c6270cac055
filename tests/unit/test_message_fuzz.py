"""Fuzzing the ZIO message decoders: garbage only ever raises RemoteProtocolError.

Every input is either random bytes or a mutation (bit flips, truncation, insertion,
deletion, splicing) of a valid encoding. A decoder may accept it -- and then what it
returns must survive a re-encode -- or reject it with RemoteProtocolError; any other
exception is a bug (h11's rule).

The hypothesis tests run by default (a few thousand inputs, a few seconds). The seeded
``random.Random`` loops are marked ``fuzz`` (``pytest -m fuzz``) and run 100_000 inputs per
decoder.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.message import (
    FLOW_FORM,
    Message,
    decode_frames,
    decode_single,
    encode_flow_label,
    encode_frames,
    encode_single,
    join_single,
    split_single,
)

U64_MAX = 2**64 - 1
INTERESTING_BYTES = (0x00, 0x01, 0x17, 0x18, 0x20, 0x22, 0x30, 0x38, 0x39, 0x7F, 0x80, 0xC3, 0xFF)


def _check_message(msg: Message) -> None:
    """What a decoder accepted is a well-formed message that re-encodes to itself."""
    assert isinstance(msg, Message)
    assert 0 <= msg.level <= 8
    assert all(0 <= v <= U64_MAX for v in (msg.origin, msg.granule, msg.seqno))
    assert all(type(p) is bytes for p in msg.payload)
    if msg.form == FLOW_FORM:
        assert isinstance(msg.flow_object["flow"], str)
    # Every accepted message re-encodes to itself (a blank form, four spaces on the
    # wire, decodes to "" and encodes back to four spaces).
    assert decode_frames(encode_frames(msg)) == msg
    assert decode_single(encode_single(msg)) == msg


def _try_decode_single(data: bytes) -> str:
    """Return "ok" or the rejected field; anything but RemoteProtocolError propagates."""
    try:
        msg = decode_single(data)
    except RemoteProtocolError as e:
        return str(e.field)
    _check_message(msg)
    return "ok"


def _try_split_single(data: bytes) -> str:
    try:
        frames = split_single(data)
    except RemoteProtocolError as e:
        return str(e.field)
    assert all(type(f) is bytes for f in frames)
    # Canonical re-framing is never longer (a long length prefix may have been non-canonical).
    assert split_single(join_single(frames)) == frames
    assert len(join_single(frames)) <= len(data)
    return "ok"


def _try_decode_frames(frames: Sequence[bytes]) -> str:
    try:
        msg = decode_frames(frames)
    except RemoteProtocolError as e:
        return str(e.field)
    _check_message(msg)
    return "ok"


# --------------------------------------------------------------------------------------
# Valid seeds and mutations, shared by the hypothesis and the seeded runs
# --------------------------------------------------------------------------------------


def _seed_messages() -> list[Message]:
    flows = [
        {"flow": "BOT", "direction": "extract", "credit": 10},
        {"flow": "BOT", "direction": "inject", "credit": 1, "stream": "x" * 300},
        {"flow": "PAY", "credit": 3},
        {"flow": "DAT"},
        {"flow": "DAT", "nested": {"a": [1, 2.5, None, True, "é"]}},
        {"flow": "EOT"},
    ]
    msgs = [
        Message(form=FLOW_FORM, label=encode_flow_label(obj), seqno=n, payload=(b"abc",) * n)
        for n, obj in enumerate(flows)
    ]
    msgs += [
        # The C++ reference's compact, sorted label and a granule in µs.
        Message(
            form=FLOW_FORM,
            label=json.dumps(flows[0], sort_keys=True, separators=(",", ":")),
            origin=7,
            granule=1_700_000_000_000_000,
        ),
        Message(form="TEXT", label="hello", level=4, origin=U64_MAX, payload=(b"",)),
        Message(form="LOG", label="é" * 130, level=8, payload=(b"\xff" * 300, b"x")),
        Message(form="A", seqno=1),
    ]
    return msgs


SEEDS = _seed_messages()
SEED_SINGLES = [encode_single(m) for m in SEEDS]
SEED_FRAMES = [encode_frames(m) for m in SEEDS]

# One mutation step: (operation, position, amount, bytes). Positions and amounts are taken
# modulo the input's size, so every step applies to any input and shrinks well.
OPS = ("flip", "truncate", "insert", "delete", "set", "splice")
Mutation = tuple[str, int, int, bytes]


def _apply(data: bytes, steps: Sequence[Mutation]) -> bytes:
    buf = bytearray(data)
    for op, pos, amount, extra in steps:
        i = pos % (len(buf) + 1)
        if op == "flip" and buf:
            buf[i % len(buf)] ^= 1 << (amount % 8)
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = extra or b"\x00"
        elif op == "delete":
            del buf[i : i + 1 + amount % 8]
        elif op == "set" and buf:
            buf[i % len(buf)] = INTERESTING_BYTES[amount % len(INTERESTING_BYTES)]
        elif op == "splice":
            other = SEED_SINGLES[amount % len(SEED_SINGLES)]
            buf[i:] = other[pos % (len(other) + 1) :]
    return bytes(buf)


mutations = st.lists(
    st.tuples(
        st.sampled_from(OPS), st.integers(0, 2**16), st.integers(0, 255), st.binary(max_size=8)
    ),
    min_size=1,
    max_size=4,
)
seed_index = st.integers(0, len(SEEDS) - 1)

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=300))
def test_decode_single_random_bytes(data):
    _try_decode_single(data)
    _try_split_single(data)


@FUZZ
@given(seed_index, mutations)
def test_decode_single_mutations(index, steps):
    data = _apply(SEED_SINGLES[index], steps)
    _try_decode_single(data)
    _try_split_single(data)


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=6))
def test_decode_frames_random_frame_lists(frames):
    _try_decode_frames(frames)


prefix_like = st.builds(
    lambda magic, level, form, label: magic + level + form + label,
    st.sampled_from([b"ZIO", b"ZIP", b"zio", b""]),
    st.one_of(st.sampled_from([b"0", b"4", b"8", b"9", b"x"]), st.binary(max_size=1)),
    st.one_of(st.sampled_from([b"FLOW", b"TEXT", b"    ", b"FL"]), st.binary(max_size=4)),
    st.one_of(
        st.sampled_from([b'{"flow": "DAT"}', b'{"flow": 1}', b"{}", b"[1]", b"", b"\xff"]),
        st.binary(max_size=20),
    ),
)


@FUZZ
@given(prefix_like, st.binary(min_size=22, max_size=26), st.lists(st.binary(max_size=8)))
def test_decode_frames_prefix_like(prefix, coord, payload):
    _try_decode_frames([prefix, coord, *payload])
    _try_decode_single(join_single([prefix, coord, *payload]))


@FUZZ
@given(seed_index, st.integers(0, 8), mutations, st.lists(st.binary(max_size=8), max_size=2))
def test_decode_frames_mutations(index, which, steps, appended):
    frames = list(SEED_FRAMES[index])
    which %= len(frames)
    frames[which] = _apply(frames[which], steps)
    _try_decode_frames(frames + appended)
    _try_decode_frames(frames[:which])


# --------------------------------------------------------------------------------------
# Seeded large runs (pytest -m fuzz)
# --------------------------------------------------------------------------------------

CASES = 100_000


def _random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((0, 1, 2, 5, 8, 24, 40, 64, 300)))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    steps = [
        (rng.choice(OPS), rng.randrange(2**16), rng.randrange(256), _random_bytes(rng)[:8])
        for _ in range(rng.randint(1, 4))
    ]
    return _apply(data, steps)


def _random_single(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.15:
        return _random_bytes(rng)
    if r < 0.30:  # plausible framing around random parts
        return join_single([_random_bytes(rng) for _ in range(rng.randint(0, 4))])
    return _mutate(rng, rng.choice(SEED_SINGLES))


def _random_frames(rng: random.Random) -> list[bytes]:
    r = rng.random()
    if r < 0.15:
        return [_random_bytes(rng) for _ in range(rng.randint(0, 5))]
    frames = list(rng.choice(SEED_FRAMES))
    if r < 0.25:
        return frames[: rng.randrange(len(frames) + 1)]
    if r < 0.35:
        frames.insert(rng.randrange(len(frames) + 1), _random_bytes(rng))
        return frames
    if r < 0.45:
        frames[1] = rng.randbytes(rng.choice((0, 8, 23, 24, 25, 48)))
        return frames
    i = 0 if r < 0.85 else rng.randrange(len(frames))
    frames[i] = _mutate(rng, frames[i])
    return frames


def _run(rng: random.Random, make: Callable[[random.Random], object], decode) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    for n in range(CASES):
        case = make(rng)
        try:
            outcomes[decode(case)] += 1
        except AssertionError:
            raise
        except Exception as e:
            pytest.fail(f"case {n}: {type(e).__name__}: {e} on input {case!r}")
    return outcomes


# Each rejection a decoder can make, so the run proves it reached every check.
ALL_FIELDS = {"frames", "prefix", "magic", "level", "form", "label", "coord", "flow"}


@pytest.mark.fuzz
def test_fuzz_decode_single_seeded():
    outcomes = _run(random.Random(0x5A10), _random_single, _try_decode_single)
    assert sum(outcomes.values()) == CASES
    assert outcomes["ok"] > CASES // 100
    assert set(outcomes) >= ALL_FIELDS | {"length"}, outcomes


@pytest.mark.fuzz
def test_fuzz_split_single_seeded():
    outcomes = _run(random.Random(0x5A11), _random_single, _try_split_single)
    assert sum(outcomes.values()) == CASES
    assert set(outcomes) == {"ok", "length"}, outcomes
    assert outcomes["ok"] > CASES // 10


@pytest.mark.fuzz
def test_fuzz_decode_frames_seeded():
    outcomes = _run(random.Random(0x5A12), _random_frames, _try_decode_frames)
    assert sum(outcomes.values()) == CASES
    assert outcomes["ok"] > CASES // 100
    assert set(outcomes) >= ALL_FIELDS, outcomes
