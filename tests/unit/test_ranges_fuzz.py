"""Fuzzing the range-read decoders: garbage only ever raises RemoteProtocolError.

Inputs go the whole way a peer's bytes go: a single-frame ZIO message (czmq form) is
decoded, its flow object read, and the range decoders applied -- :func:`decode_request`
(a PAY at the giver, and :meth:`RangeGiver.on_pay` of a range flow and of a control
flow), :func:`decode_reply` and :meth:`RangeReader.on_dat` (a DAT at the reader),
:func:`client_range_terms` and :func:`server_read_mode` (a BOT). Commits (``ack`` with
``commit``) and their answers are among the seeds. Each input is
a mutation of a valid message, at the byte level (flips, truncation, insertion, deletion,
splicing) or at the JSON level (a field replaced by another JSON value, dropped, added,
or a request object swapped for another). A decoder may accept it -- then what it
returns must encode back to itself -- or reject it with RemoteProtocolError; any other
exception is a bug (h11's rule, as in test_message_fuzz.py).

The hypothesis tests run by default (a few thousand inputs in all). The seeded loops are
marked ``fuzz`` (``pytest -m fuzz``) and run 100_000 inputs per decoder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.message import FLOW_FORM, Message, decode_single, encode_single
from zio_spark.protocol.ranges import (
    READ_CONTROL,
    AdmitRequest,
    Admitted,
    CommitRefused,
    OtherIncarnation,
    RangeGiver,
    RangeReader,
    RangeTerms,
    client_range_terms,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    offer_attrs,
    server_read_mode,
    state_capability,
)

SENT_BOT = {"direction": "inject", "credit": 8, **offer_attrs({"stream": "s"})}
INC = "i1"  # the giver's incarnation in the seeds
RUN_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a CURVE public key, Z85

REQUEST_SEEDS: list[dict[str, Any]] = [
    {
        "flow": "PAY",
        "credit": 4,
        "range": {"id": 0, "producer": "p1", "incarnation": INC, "start": 1, "end": 9},
    },
    {
        "flow": "PAY",
        "credit": 0,
        "range": {"id": 7, "producer": "é", "incarnation": "A-9.z_", "start": 5, "end": 5},
    },
    {"flow": "PAY", "credit": 1, "held": {"id": 3, "producer": "p1"}},
    {"flow": "PAY", "credit": 2, "ack": 4},
    {
        "flow": "PAY",
        "credit": 0,
        "ack": 4,
        "commit": {"id": 2, "producer": "p1", "incarnation": INC},
    },
    {
        "flow": "PAY",
        "credit": 1,
        "ack": 0,
        "commit": {"id": 0, "producer": "p", "incarnation": "i2"},
    },
    {"flow": "PAY", "credit": 0, "admit": {"id": 1, "key": RUN_KEY}},
    {"flow": "PAY", "credit": 2, "admit": {"id": 0, "key": "0" * 40}},
]
_HELD = {"id": 0, "producer": "p1", "status": "held", "incarnation": INC, "first": 1, "end": 9}
REPLY_SEEDS: list[dict[str, Any]] = [
    {"flow": "DAT", "range": {"id": 0, "status": "done", "start": 1, "end": 9}},
    {"flow": "DAT", "range": {"id": 0, "status": "not_held", "first": 4, "end": 12}},
    {"flow": "DAT", "range": {"id": 0, "status": "unknown_producer"}},
    {
        "flow": "DAT",
        "range": {"id": 0, "status": "other_incarnation", "incarnation": INC, "first": 1, "end": 9},
    },
    {"flow": "DAT", "held": _HELD},
    {"flow": "DAT", "held": {**_HELD, "full": True}},
    {"flow": "DAT", "held": {"id": 0, "status": "unknown_producer"}},
    {"flow": "DAT", "seq": 1},
    {
        "flow": "DAT",
        "commit": {"id": 0, "status": "acked", "incarnation": INC, "upto": 4, "first": 5, "end": 9},
    },
    {
        "flow": "DAT",
        "commit": {
            "id": 0,
            "status": "other_incarnation",
            "incarnation": INC,
            "first": 1,
            "end": 9,
        },
    },
    {"flow": "DAT", "commit": {"id": 0, "status": "unknown_producer"}},
    {"flow": "DAT", "admit": {"id": 0, "status": "admitted"}},
    {"flow": "DAT", "admit": {"id": 0, "status": "open"}},
]
BOT_SEEDS: list[dict[str, Any]] = [
    {
        "flow": "BOT",
        "direction": "extract",
        "credit": 8,
        **state_capability({"producer": "p1"}, INC),
    },
    {"flow": "BOT", **{**SENT_BOT, "direction": "extract"}},  # an echo
    {"flow": "BOT", **SENT_BOT},  # what a capable giver's server side reads
    {"flow": "BOT", "direction": "inject", "credit": 1, **offer_attrs(read=READ_CONTROL)},
    {
        "flow": "BOT",
        "direction": "extract",
        "credit": 8,
        "producer": "p",
        "ranges": 3,
        "incarnation": "x" * 64,
    },
]


def _single(obj: Mapping[str, Any]) -> bytes:
    return encode_single(Message(FLOW_FORM, json.dumps(obj), 0, 1, 0, 2, (b"x",)))


ALL_SEEDS = [_single(o) for o in REQUEST_SEEDS + REPLY_SEEDS + BOT_SEEDS]

INTERESTING: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2**63 - 1,
    2**63,
    2**64,
    1.5,
    float("nan"),
    "",
    "p1",
    "done",
    "held",
    "not_held",
    "unknown_producer",
    "other_incarnation",
    "range",
    "control",
    "acked",
    "commit",
    "admit",
    "admitted",
    "open",
    RUN_KEY,
    RUN_KEY[:-1],
    "%" * 40,
    "i1",
    "i2",
    "x" * 64,
    "x" * 65,
    "a b",
    "é",
    [],
    [1, 2],
    {},
    {"id": 0},
]
KEYS = [
    "id",
    "producer",
    "incarnation",
    "start",
    "end",
    "first",
    "status",
    "range",
    "held",
    "commit",
    "admit",
    "key",
    "ack",
    "upto",
    "ranges",
    "read",
]

# ------------------------------------------------------------------------- mutations


def _mutate_json(rng: random.Random, obj: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(obj))
    for _ in range(rng.randint(1, 3)):
        # Pick the top level or one nested object to change.
        targets = [out] + [v for v in out.values() if isinstance(v, dict)]
        target = rng.choice(targets)
        op = rng.random()
        keys = [k for k in target if k != "flow" or rng.random() < 0.05]
        if op < 0.5 and keys:
            target[rng.choice(keys)] = copy.deepcopy(rng.choice(INTERESTING))
        elif op < 0.7 and keys:
            del target[rng.choice(keys)]
        elif op < 0.9:
            target[rng.choice(KEYS)] = copy.deepcopy(rng.choice(INTERESTING))
        else:  # another seed's request or answer object, or both kinds at once
            donor = rng.choice(REQUEST_SEEDS + REPLY_SEEDS)
            for key in ("range", "held", "commit", "ack"):
                if key in donor:
                    target[key] = json.loads(json.dumps(donor[key]))
    return out


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[i % len(buf)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del buf[i:]
        elif op == 2:
            buf[i:i] = rng.randbytes(rng.randint(1, 6))
        elif op == 3:
            del buf[i : i + rng.randint(1, 8)]
        elif op == 4 and buf:
            buf[i % len(buf)] = rng.choice(b'{}[]",:0159\\ -ea')
        else:
            other = rng.choice(ALL_SEEDS)
            buf[i:] = other[rng.randrange(len(other) + 1) :]
    return bytes(buf)


def _case(rng: random.Random, seeds: list[dict[str, Any]]) -> bytes:
    r = rng.random()
    if r < 0.6:
        return _single(_mutate_json(rng, rng.choice(seeds)))
    if r < 0.95:
        return _mutate_bytes(rng, _single(rng.choice(seeds)))
    return rng.randbytes(rng.choice((0, 1, 8, 40)))


# -------------------------------------------------------------------------- decoders


def _flow_object(data: bytes) -> Mapping[str, Any]:
    msg = decode_single(data)
    if msg.form != FLOW_FORM:
        raise RemoteProtocolError("not a flow message", field="form", value=msg.form)
    return msg.flow_object


def _try_request(data: bytes) -> str:
    try:
        obj = _flow_object(data)
        req = decode_request(obj)
    except RemoteProtocolError as e:
        return str(e.field)
    # A giver of either flow takes it or refuses it, typed (a range flow takes no
    # commit, a control flow no range and no bare ack).
    for control in (False, True):
        with contextlib.suppress(RemoteProtocolError):
            giver = RangeGiver(INC, control=control, gated=True)
            if isinstance(giver.on_pay(obj), AdmitRequest):
                assert control and giver.next(None, 1) == Admitted(req.id, gated=True)
    if req is None:
        return "none"
    assert decode_request(encode_request(req)) == req
    return "ok"


def _try_reply(data: bytes) -> str:
    try:
        obj = _flow_object(data)
        reply = decode_reply(obj)
    except RemoteProtocolError as e:
        return str(e.field)
    if reply is None:
        return "none"
    assert decode_reply(encode_reply(reply)) == reply
    # The reader, with a request open, either takes the answer or rejects it: typed. A
    # range is planned on the giver's incarnation (records may arrive), except for an
    # other_incarnation answer, which only a range planned on another one can take.
    reader = RangeReader(RangeTerms(1, "p1", INC))
    if "held" in obj:
        reader.query("p1")
    elif "commit" in obj:
        reader.commit("p1", "i0" if isinstance(reply, CommitRefused) else INC, 4)
    elif "admit" in obj:
        reader.admit(RUN_KEY)
    elif isinstance(reply, OtherIncarnation):
        reader.request("p1", "i0", 1, 9)
    else:
        reader.request("p1", INC, 1, 9)
        reader.records(1, 8)
    try:
        reader.on_dat(obj)
    except RemoteProtocolError as e:
        return f"reader {e.field}"
    return "ok"


def _try_bot(data: bytes) -> str:
    try:
        obj = _flow_object(data)
    except RemoteProtocolError as e:
        return str(e.field)
    outcome = "ok"
    try:
        terms = client_range_terms(SENT_BOT, obj)
        if terms.capable:
            assert obj.get("ranges") is not None and isinstance(obj.get("producer"), str)
            assert terms.incarnation == obj.get("incarnation")
    except RemoteProtocolError as e:
        outcome = str(e.field)
    try:
        server_read_mode(obj)
    except RemoteProtocolError as e:
        outcome += f" server {e.field}"
    return outcome


# ------------------------------------------------------------------------ hypothesis

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.randoms(use_true_random=False))
def test_request_decoder_mutations(rng: random.Random) -> None:
    _try_request(_case(rng, REQUEST_SEEDS))


@FUZZ
@given(st.randoms(use_true_random=False))
def test_reply_decoder_mutations(rng: random.Random) -> None:
    _try_reply(_case(rng, REPLY_SEEDS))


@FUZZ
@given(st.randoms(use_true_random=False))
def test_bot_terms_mutations(rng: random.Random) -> None:
    _try_bot(_case(rng, BOT_SEEDS))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=8,
)


@settings(FUZZ, max_examples=500)
@given(st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4))
def test_decoders_take_any_json_object(attrs: dict[str, Any]) -> None:
    for flow, decode in (("PAY", _try_request), ("DAT", _try_reply), ("BOT", _try_bot)):
        decode(_single({"flow": flow, **attrs}))


# ---------------------------------------------------------------------- seeded runs

CASES = 100_000


def _run(seed: int, seeds: list[dict[str, Any]], decode: Callable[[bytes], str]) -> Counter[str]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    for n in range(CASES):
        case = _case(rng, seeds)
        try:
            outcomes[decode(case)] += 1
        except AssertionError:
            raise
        except Exception as e:
            pytest.fail(f"case {n}: {type(e).__name__}: {e} on input {case!r}")
    return outcomes


@pytest.mark.fuzz
def test_fuzz_request_decoder_seeded() -> None:
    outcomes = _run(0x2A60, REQUEST_SEEDS, _try_request)
    assert sum(outcomes.values()) == CASES
    assert outcomes["ok"] > CASES // 20, outcomes
    want = {"none", "label", "range", "held", "range.id", "range.producer", "range.start"}
    want |= {"range.end", "held.id", "held.producer", "range.incarnation"}
    want |= {"commit", "commit.id", "commit.incarnation", "PAY.ack"}
    want |= {"admit", "admit.id", "admit.key"}
    print("request outcomes:", dict(outcomes.most_common()))
    assert set(outcomes) >= want, outcomes


@pytest.mark.fuzz
def test_fuzz_reply_decoder_seeded() -> None:
    outcomes = _run(0x2A61, REPLY_SEEDS, _try_reply)
    assert sum(outcomes.values()) == CASES
    assert outcomes["ok"] > CASES // 20, outcomes
    want = {"none", "label", "range", "held", "range.id", "range.status", "held.status"}
    want |= {"range.first", "held.producer", "reader range.id"}
    want |= {"range.incarnation", "held.incarnation", "reader range.incarnation"}
    want |= {"commit.status", "commit.upto", "commit.incarnation", "reader commit.incarnation"}
    want |= {"admit", "admit.status", "reader admit.id"}
    print("reply outcomes:", dict(outcomes.most_common()))
    assert set(outcomes) >= want, outcomes


@pytest.mark.fuzz
def test_fuzz_bot_terms_seeded() -> None:
    outcomes = _run(0x2A62, BOT_SEEDS, _try_bot)
    assert sum(outcomes.values()) == CASES
    assert outcomes["ok"] > CASES // 20, outcomes
    print("bot outcomes:", dict(outcomes.most_common()))
    assert {"ranges", "producer", "incarnation", "ok server read"} <= set(outcomes), outcomes
