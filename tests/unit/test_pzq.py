"""Tests for zio_spark.protocol.pzq, pzq_fields and pzq_inflight: frames, in-flight table.

Golden vectors are written by hand from specs/pzq-sockets-and-formats.txt; hypothesis
checks round trips, tolerance of extra header parts, and that garbage only ever raises
RemoteProtocolError. The `fuzz`-marked test pushes >= 100k deterministic random inputs
through every decoder.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zio_spark.errors import LocalProtocolError, RemoteProtocolError
from zio_spark.protocol import pzq, pzq_fields, pzq_inflight
from zio_spark.protocol.pzq import (
    MAX_TIMESTAMP_US,
    MONITOR_KEYS,
    ConsumerAck,
    Delivery,
    ProducerAck,
    ProducerMessage,
    decode_consumer_ack,
    decode_delivery,
    decode_monitor_reply,
    decode_monitor_request,
    decode_producer_ack,
    decode_producer_message,
    encode_consumer_ack,
    encode_delivery,
    encode_monitor_reply,
    encode_monitor_request,
    encode_producer_ack,
    encode_producer_message,
    is_expired,
    split_identity,
)
from zio_spark.protocol.pzq_inflight import InFlight

DECODERS: dict[str, Callable[[Sequence[bytes]], object]] = {
    "producer_message": decode_producer_message,
    "producer_ack": decode_producer_ack,
    "delivery": decode_delivery,
    "consumer_ack": decode_consumer_ack,
    "monitor_request": decode_monitor_request,
    "monitor_reply": decode_monitor_reply,
    "split_identity": split_identity,
}

SPEC_MONITOR_EXAMPLE = (
    b"messages: 0\n"
    b"messages_in_flight: 0\n"
    b"db_size: 1438720\n"
    b"in_flightdb_size: 0\n"
    b"syncs: 16694\n"
    b"expired_messages: 6"
)


# --------------------------------------------------------------------------- purity


@pytest.mark.parametrize("module", [pzq, pzq_fields, pzq_inflight])
def test_module_imports_no_io_modules(module: ModuleType) -> None:
    assert module.__file__ is not None
    source = Path(module.__file__).read_text(encoding="utf-8")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"zmq", "pyspark", "threading", "socket", "time", "asyncio"})


def test_fresh_import_loads_no_zmq_or_spark() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import zio_spark.protocol.pzq, zio_spark.protocol.pzq_inflight\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.split('.')[0] in "
        "{'zmq', 'pyspark', 'threading', 'socket', 'time'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(pzq.__file__).resolve().parents[2],  # the directory holding zio_spark/
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("module", [pzq, pzq_fields, pzq_inflight])
def test_all_is_accurate(module: ModuleType) -> None:
    for name in module.__all__:
        assert hasattr(module, name), name


# --------------------------------------------------------------------------- golden vectors


def test_golden_producer_message_single_part() -> None:
    frames = [b"msg-1", b"", b"hello"]
    message = ProducerMessage(b"msg-1", (b"hello",))
    assert encode_producer_message(message) == frames
    assert decode_producer_message(frames) == message


def test_golden_producer_message_headers_and_multipart_body() -> None:
    # Header parts before the delimiter are ignored (kept as extra); body parts after the
    # delimiter pass through unmodified, empty ones included.
    frames = [b"42", b"x-trace: abc", b"v2", b"", b"part one", b"", b"part three"]
    message = decode_producer_message(frames)
    assert message.message_id == b"42"
    assert message.extra == (b"x-trace: abc", b"v2")
    assert message.body == (b"part one", b"", b"part three")
    assert encode_producer_message(message) == frames


def test_golden_producer_message_empty_body_part() -> None:
    assert decode_producer_message([b"i", b"", b""]).body == (b"",)


def test_golden_producer_ack_success() -> None:
    frames = [b"msg-1", b"1", b"", b""]
    assert encode_producer_ack(ProducerAck(b"msg-1", True)) == frames
    assert decode_producer_ack(frames) == ProducerAck(b"msg-1", True, "")


def test_golden_producer_ack_failure_with_reason() -> None:
    frames = [b"msg-2", b"0", b"", b"store: disk full"]
    ack = ProducerAck(b"msg-2", False, "store: disk full")
    assert encode_producer_ack(ack) == frames
    assert decode_producer_ack(frames) == ack


@pytest.mark.parametrize("status", [b"0", b"OK", b"NO", b"NOT OK", b"11", b"true", b"1 "])
def test_producer_ack_only_exact_1_is_success(status: bytes) -> None:
    assert decode_producer_ack([b"m", status, b"", b"why"]).ok is False


def test_producer_ack_reason_parts() -> None:
    assert decode_producer_ack([b"m", b"1", b""]).reason == ""
    assert decode_producer_ack([b"m", b"0", b"", b"a", b"b"]).reason == "a\nb"
    assert decode_producer_ack([b"m", b"0", b"", b"caf\xc3\xa9"]).reason == "café"
    assert decode_producer_ack([b"m", b"0", b"", b"\xff"]).reason == "\ufffd"


def test_producer_ack_extra_parts_ignored() -> None:
    ack = decode_producer_ack([b"m", b"1", b"hdr", b"", b"fine"])
    assert (ack.ok, ack.reason, ack.extra) == (True, "fine", (b"hdr",))
    assert encode_producer_ack(ack) == [b"m", b"1", b"hdr", b"", b"fine"]


def test_golden_delivery_queue_and_consumer_views() -> None:
    # What the queue's ROUTER is given to send, after the consumer identity it consumes:
    frames = [b"1700000000000000|6f1c", b"1700000000000000", b"5000000", b"", b"payload"]
    delivery = Delivery(b"1700000000000000|6f1c", 1_700_000_000_000_000, 5_000_000, (b"payload",))
    assert encode_delivery(delivery) == frames
    # What the consumer's ROUTER receives: the queue's identity first (spec part 0).
    identity, rest = split_identity([b"pzq-A", *frames])
    assert identity == b"pzq-A"
    assert decode_delivery(rest) == delivery
    assert delivery.deadline_us == 1_700_000_005_000_000


def test_golden_delivery_headers_and_body_parts() -> None:
    frames = [b"id", b"10", b"20", b"h1", b"h2", b"", b"b1", b"", b"b3"]
    delivery = decode_delivery(frames)
    assert (delivery.sent_us, delivery.ack_timeout_us) == (10, 20)
    assert delivery.extra == (b"h1", b"h2")
    assert delivery.body == (b"b1", b"", b"b3")
    assert encode_delivery(delivery) == frames


def test_delivery_timestamps_edge_values() -> None:
    top = str(MAX_TIMESTAMP_US).encode()
    assert decode_delivery([b"i", b"0", top, b"", b"x"]).ack_timeout_us == MAX_TIMESTAMP_US
    assert decode_delivery([b"i", b"007", b"0", b"", b"x"]).sent_us == 7


def test_golden_consumer_ack() -> None:
    assert encode_consumer_ack(ConsumerAck(b"k1", True)) == [b"k1", b"1"]
    assert encode_consumer_ack(ConsumerAck(b"k1", False)) == [b"k1", b"0"]
    assert decode_consumer_ack([b"k1", b"1"]) == ConsumerAck(b"k1", True)
    assert decode_consumer_ack([b"k1", b"0"]) == ConsumerAck(b"k1", False)
    # The queue's ROUTER view: the consumer identity first.
    identity, rest = split_identity([b"consumer-7", b"k1", b"1"])
    assert identity == b"consumer-7"
    assert decode_consumer_ack(rest) == ConsumerAck(b"k1", True)


def test_consumer_ack_trailing_parts_ignored() -> None:
    assert decode_consumer_ack([b"k", b"0", b"", b"later header"]) == ConsumerAck(b"k", False)


def test_golden_monitor_request() -> None:
    assert encode_monitor_request() == [b"MONITOR"]
    decode_monitor_request([b"MONITOR"])  # returns None; raises on anything else


def test_golden_monitor_reply_spec_example() -> None:
    stats = decode_monitor_reply([SPEC_MONITOR_EXAMPLE])
    assert stats == {
        "messages": "0",
        "messages_in_flight": "0",
        "db_size": "1438720",
        "in_flightdb_size": "0",
        "syncs": "16694",
        "expired_messages": "6",
    }
    assert tuple(stats) == MONITOR_KEYS


def test_golden_monitor_reply_encoding() -> None:
    values = [0, 0, 1438720, 0, 16694, 6]
    frames = encode_monitor_reply(dict(zip(MONITOR_KEYS, values, strict=True)))
    assert frames == [SPEC_MONITOR_EXAMPLE + b"\n"]


def test_monitor_reply_tolerances() -> None:
    text = b"\n  a :1\r\n\nb: x: y\n   \nc:\n"
    assert decode_monitor_reply([text]) == {"a": "1", "b": "x: y", "c": ""}
    assert decode_monitor_reply([b""]) == {}


def test_buffer_frames_are_accepted() -> None:
    frames: list[bytes] = [bytearray(b"k"), memoryview(b"1")]  # type: ignore[list-item]
    assert decode_consumer_ack(frames) == ConsumerAck(b"k", True)
    assert decode_consumer_ack((b"k", b"1")) == ConsumerAck(b"k", True)


# --------------------------------------------------------------------------- decode errors


BAD_FRAMES: list[tuple[str, list[bytes], str]] = [
    ("producer_message", [], "message_id"),
    ("producer_message", [b"", b"", b"body"], "message_id"),
    ("producer_message", [b"id"], "delimiter"),
    ("producer_message", [b"id", b"body-without-delimiter"], "delimiter"),
    ("producer_message", [b"id", b""], "body"),
    ("producer_message", [b"id", b"hdr", b""], "body"),
    ("producer_ack", [], "message_id"),
    ("producer_ack", [b"", b"1", b"", b""], "message_id"),
    ("producer_ack", [b"id"], "status"),
    ("producer_ack", [b"id", b"", b"reason"], "status"),
    ("producer_ack", [b"id", b"1"], "delimiter"),
    ("producer_ack", [b"id", b"1", b"reason"], "delimiter"),
    ("delivery", [], "message_id"),
    ("delivery", [b""], "message_id"),
    ("delivery", [b"id"], "sent_us"),
    ("delivery", [b"id", b"", b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b"-5", b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b"+5", b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b" 5", b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b"1_0", b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b"1.5", b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", "\u0665".encode(), b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b"1" * 21, b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", str(2**64).encode(), b"5", b"", b"x"], "sent_us"),
    ("delivery", [b"id", b"5"], "ack_timeout_us"),
    ("delivery", [b"id", b"5", b"abc", b"", b"x"], "ack_timeout_us"),
    ("delivery", [b"id", b"5", b"-1", b"", b"x"], "ack_timeout_us"),
    ("delivery", [b"id", b"5", b"5"], "delimiter"),
    ("delivery", [b"id", b"5", b"5", b"x"], "delimiter"),
    ("delivery", [b"id", b"5", b"5", b""], "body"),
    ("consumer_ack", [], "message_id"),
    ("consumer_ack", [b"", b"1"], "message_id"),
    ("consumer_ack", [b"id"], "ack"),
    ("consumer_ack", [b"id", b""], "ack"),
    ("consumer_ack", [b"id", b"2"], "ack"),
    ("consumer_ack", [b"id", b"OK"], "ack"),
    ("consumer_ack", [b"id", b"1\x00"], "ack"),
    ("monitor_request", [], "request"),
    ("monitor_request", [b"MONITOR", b""], "request"),
    ("monitor_request", [b"monitor"], "request"),
    ("monitor_request", [b"MONITOR\x00"], "request"),
    ("monitor_request", [b""], "request"),
    ("monitor_reply", [], "reply"),
    ("monitor_reply", [b"a: 1", b"b: 2"], "reply"),
    ("monitor_reply", [b"a: \xff"], "reply"),
    ("monitor_reply", [b"a: 1\nno colon here\n"], "line"),
    ("monitor_reply", [b": 1"], "key"),
    ("monitor_reply", [b"a: 1\na: 2"], "key"),
    ("split_identity", [], "identity"),
    ("split_identity", [b"", b"x"], "identity"),
]


@pytest.mark.parametrize(("decoder", "frames", "field"), BAD_FRAMES)
def test_malformed_frames_name_the_field(decoder: str, frames: list[bytes], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        DECODERS[decoder](frames)
    assert info.value.field == field
    assert field in str(info.value)
    assert "expected" in str(info.value)


def test_error_message_names_value_and_expectation() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_delivery([b"id", b"-5", b"5", b"", b"x"])
    err = info.value
    assert (err.field, err.value) == ("sent_us", b"-5")
    assert "b'-5'" in str(err)
    assert "non-negative ASCII decimal" in str(err)


def test_error_message_truncates_huge_values() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_consumer_ack([b"id", b"x" * 100_000])
    assert len(str(info.value)) < 300
    assert "100000 bytes" in str(info.value)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
@pytest.mark.parametrize("frames", [b"MONITOR", "MONITOR", bytearray(b"x"), None, 5])
def test_decoders_reject_non_sequences_as_local_error(decoder: str, frames: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        DECODERS[decoder](frames)  # type: ignore[arg-type]
    assert info.value.field == "frames"


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_decoders_reject_non_buffer_parts_as_local_error(decoder: str) -> None:
    with pytest.raises(LocalProtocolError, match="index 1"):
        DECODERS[decoder]([b"MONITOR", "text"])  # type: ignore[list-item]


# --------------------------------------------------------------------------- construction


LOCAL_ERRORS: list[tuple[Callable[[], object], str]] = [
    (lambda: ProducerMessage(b"", (b"x",)), "message_id"),
    (lambda: ProducerMessage("id", (b"x",)), "message_id"),  # type: ignore[arg-type]
    (lambda: ProducerMessage(b"id", ()), "body"),
    (lambda: ProducerMessage(b"id", b"body"), "body"),  # type: ignore[arg-type]
    (lambda: ProducerMessage(b"id", 5), "body"),  # type: ignore[arg-type]
    (lambda: ProducerMessage(b"id", ("x",)), "body"),  # type: ignore[arg-type]
    (lambda: ProducerMessage(b"id", (b"x",), (b"",)), "extra"),
    (lambda: ProducerAck(b"id", 1), "ok"),  # type: ignore[arg-type]
    (lambda: ProducerAck(b"id", True, b"r"), "reason"),  # type: ignore[arg-type]
    (lambda: ProducerAck(b"id", True, "\ud800"), "reason"),
    (lambda: ProducerAck(b"id", True, "", (b"",)), "extra"),
    (lambda: Delivery(b"id", -1, 0, (b"x",)), "sent_us"),
    (lambda: Delivery(b"id", 0, MAX_TIMESTAMP_US + 1, (b"x",)), "ack_timeout_us"),
    (lambda: Delivery(b"id", 1.5, 0, (b"x",)), "sent_us"),  # type: ignore[arg-type]
    (lambda: Delivery(b"id", True, 0, (b"x",)), "sent_us"),
    (lambda: Delivery(b"id", 0, 0, ()), "body"),
    (lambda: ConsumerAck(b"", True), "message_id"),
    (lambda: ConsumerAck(b"id", None), "ok"),  # type: ignore[arg-type]
    (lambda: encode_producer_message(ProducerAck(b"i", True)), "message"),  # type: ignore[arg-type]
    (lambda: encode_producer_ack(ConsumerAck(b"i", True)), "message"),  # type: ignore[arg-type]
    (lambda: encode_delivery(None), "message"),  # type: ignore[arg-type]
    (lambda: encode_consumer_ack(None), "message"),  # type: ignore[arg-type]
    (lambda: is_expired(None, 0), "message"),  # type: ignore[arg-type]
    (lambda: is_expired(Delivery(b"i", 0, 0, (b"x",)), 1.0), "now_us"),  # type: ignore[arg-type]
    (lambda: encode_monitor_reply([("a", 1)]), "stats"),  # type: ignore[arg-type]
    (lambda: encode_monitor_reply({1: 1}), "key"),  # type: ignore[dict-item]
    (lambda: encode_monitor_reply({"": 1}), "key"),
    (lambda: encode_monitor_reply({"a:b": 1}), "key"),
    (lambda: encode_monitor_reply({"a\nb": 1}), "key"),
    (lambda: encode_monitor_reply({" a": 1}), "key"),
    (lambda: encode_monitor_reply({"a": True}), "value"),
    (lambda: encode_monitor_reply({"a": 1.5}), "value"),  # type: ignore[dict-item]
    (lambda: encode_monitor_reply({"a": "x\ny"}), "value"),
    (lambda: encode_monitor_reply({"a": "x "}), "value"),
    (lambda: encode_monitor_reply({"a": "\udcff"}), "stats"),
    (lambda: encode_monitor_reply({"a": 10**5000}), "value"),
]


@pytest.mark.parametrize(("make", "field"), LOCAL_ERRORS)
def test_api_misuse_raises_local_error(make: Callable[[], object], field: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        make()
    assert info.value.field == field
    assert not isinstance(info.value, RemoteProtocolError)


def test_lists_are_frozen_into_tuples() -> None:
    message = ProducerMessage(b"id", [b"a", b"b"], [b"h"])  # type: ignore[arg-type]
    assert message.body == (b"a", b"b")
    assert message.extra == (b"h",)
    hash(message)


def test_is_expired_boundary() -> None:
    delivery = Delivery(b"i", 1_000, 500, (b"x",))
    assert not is_expired(delivery, 1_499)
    assert not is_expired(delivery, 1_500)  # spec: expired only when now > sent + timeout
    assert is_expired(delivery, 1_501)


def test_monitor_reply_int_and_str_values() -> None:
    frames = encode_monitor_reply({"messages": 3, "note": "a: b", "neg": -1})
    assert decode_monitor_reply(frames) == {"messages": "3", "note": "a: b", "neg": "-1"}
    assert encode_monitor_reply({}) == [b""]


# --------------------------------------------------------------------------- round trips

ids = st.binary(min_size=1, max_size=24)
bodies = st.lists(st.binary(max_size=24), min_size=1, max_size=6).map(tuple)
extras = st.lists(st.binary(min_size=1, max_size=12), max_size=3).map(tuple)
times = st.integers(0, MAX_TIMESTAMP_US)

producer_messages = st.builds(ProducerMessage, ids, bodies, extras)
producer_acks = st.builds(ProducerAck, ids, st.booleans(), st.text(max_size=40), extras)
deliveries = st.builds(Delivery, ids, times, times, bodies, extras)
consumer_acks = st.builds(ConsumerAck, ids, st.booleans())

monitor_keys = (
    st.text(min_size=1, max_size=16)
    .map(str.strip)
    .filter(lambda k: k != "" and ":" not in k and "\n" not in k)
)
monitor_values = st.one_of(
    st.integers(),
    st.text(max_size=16).map(str.strip).filter(lambda v: "\n" not in v),
)


@given(producer_messages)
def test_round_trip_producer_message(message: ProducerMessage) -> None:
    assert decode_producer_message(encode_producer_message(message)) == message


@given(producer_acks)
def test_round_trip_producer_ack(ack: ProducerAck) -> None:
    assert decode_producer_ack(encode_producer_ack(ack)) == ack


@given(deliveries)
def test_round_trip_delivery(delivery: Delivery) -> None:
    assert decode_delivery(encode_delivery(delivery)) == delivery


@given(consumer_acks)
def test_round_trip_consumer_ack(ack: ConsumerAck) -> None:
    assert decode_consumer_ack(encode_consumer_ack(ack)) == ack


@given(st.dictionaries(monitor_keys, monitor_values, max_size=8))
def test_round_trip_monitor_reply(stats: dict[str, int | str]) -> None:
    decoded = decode_monitor_reply(encode_monitor_reply(stats))
    assert decoded == {key: str(value) for key, value in stats.items()}


@given(producer_messages, extras)
def test_extra_header_parts_are_ignored_producer(
    message: ProducerMessage, more: tuple[bytes, ...]
) -> None:
    frames = encode_producer_message(message)
    frames[1:1] = more
    decoded = decode_producer_message(frames)
    assert (decoded.message_id, decoded.body) == (message.message_id, message.body)


@given(deliveries, extras)
def test_extra_header_parts_are_ignored_delivery(
    delivery: Delivery, more: tuple[bytes, ...]
) -> None:
    frames = encode_delivery(delivery)
    frames[3:3] = more
    decoded = decode_delivery(frames)
    assert (decoded.message_id, decoded.sent_us, decoded.ack_timeout_us, decoded.body) == (
        delivery.message_id,
        delivery.sent_us,
        delivery.ack_timeout_us,
        delivery.body,
    )


@given(producer_acks, extras)
def test_extra_header_parts_are_ignored_producer_ack(
    ack: ProducerAck, more: tuple[bytes, ...]
) -> None:
    frames = encode_producer_ack(ack)
    frames[2:2] = more
    decoded = decode_producer_ack(frames)
    assert (decoded.message_id, decoded.ok, decoded.reason) == (ack.message_id, ack.ok, ack.reason)


@given(consumer_acks, st.lists(st.binary(max_size=8), max_size=3))
def test_trailing_parts_are_ignored_consumer_ack(ack: ConsumerAck, more: list[bytes]) -> None:
    assert decode_consumer_ack(encode_consumer_ack(ack) + more) == ack


# --------------------------------------------------------------------------- fuzz

# Parts that steer random frames into the decoders' deeper branches.
INTERESTING = [
    b"",
    b"1",
    b"0",
    b"2",
    b"-1",
    b"OK",
    b"MONITOR",
    b"1700000000000000",
    str(MAX_TIMESTAMP_US).encode(),
    str(MAX_TIMESTAMP_US + 1).encode(),
    b"9" * 21,
    b"a: 1\nb: 2\n",
    b"no colon",
    b": v",
    b"\xff\xfe",
    b"\x00",
]

parts_strategy = st.one_of(st.sampled_from(INTERESTING), st.binary(max_size=24))
frames_strategy = st.lists(parts_strategy, max_size=8)


def _check_only_remote_errors(frames: list[bytes]) -> None:
    """Every decoder either succeeds or raises RemoteProtocolError; successes re-encode."""
    for name, decoder in DECODERS.items():
        try:
            result = decoder(frames)
        except RemoteProtocolError:
            continue
        # Anything that decoded must re-encode to something that decodes the same.
        if name == "producer_message":
            assert isinstance(result, ProducerMessage)
            assert decode_producer_message(encode_producer_message(result)) == result
        elif name == "producer_ack":
            assert isinstance(result, ProducerAck)
            assert decode_producer_ack(encode_producer_ack(result)) == result
        elif name == "delivery":
            assert isinstance(result, Delivery)
            assert decode_delivery(encode_delivery(result)) == result
        elif name == "consumer_ack":
            assert isinstance(result, ConsumerAck)
            assert decode_consumer_ack(encode_consumer_ack(result)) == result


@settings(max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
@given(frames_strategy)
def test_random_frames_raise_only_remote_errors(frames: list[bytes]) -> None:
    _check_only_remote_errors(frames)


def _mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = list(frames)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        index = rng.randrange(len(frames) + 1)
        if op == 0 and frames:
            del frames[index % len(frames)]
        elif op == 1:
            frames.insert(index, rng.choice(INTERESTING))
        elif op == 2 and frames:
            frames[index % len(frames)] = rng.choice(INTERESTING)
        elif op == 3 and frames:
            part = frames[index % len(frames)]
            frames[index % len(frames)] = part[: rng.randrange(len(part) + 1)]
        elif op == 4 and frames:
            flipped = bytearray(frames[index % len(frames)] or b"\x00")
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            frames[index % len(frames)] = bytes(flipped)
        else:
            frames = frames[:index]
    return frames


valid_frames = st.one_of(
    producer_messages.map(encode_producer_message),
    producer_acks.map(encode_producer_ack),
    deliveries.map(encode_delivery),
    consumer_acks.map(encode_consumer_ack),
    st.dictionaries(monitor_keys, monitor_values, max_size=4).map(encode_monitor_reply),
    st.just(encode_monitor_request()),
)


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(valid_frames, st.randoms(use_true_random=False))
def test_mutated_frames_raise_only_remote_errors(frames: list[bytes], rng: random.Random) -> None:
    _check_only_remote_errors(_mutate(frames, rng))


def _random_frames(rng: random.Random) -> list[bytes]:
    frames: list[bytes] = []
    for _ in range(rng.randrange(9)):
        if rng.random() < 0.5:
            frames.append(rng.choice(INTERESTING))
        else:
            frames.append(rng.randbytes(rng.randrange(16)))
    return frames


VALID_SEEDS = [
    encode_producer_message(ProducerMessage(b"id", (b"a", b"", b"c"), (b"h",))),
    encode_producer_ack(ProducerAck(b"id", False, "nope", (b"h",))),
    encode_delivery(Delivery(b"id", 1_700_000_000_000_000, 5_000_000, (b"x", b""), (b"h",))),
    encode_consumer_ack(ConsumerAck(b"id", True)),
    encode_monitor_request(),
    [SPEC_MONITOR_EXAMPLE],
]


@pytest.mark.fuzz
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_fuzz_100k_per_decoder(decoder: str) -> None:
    decode = DECODERS[decoder]
    rng = random.Random(f"pzq-fuzz-{decoder}")
    ok = 0
    for i in range(100_000):
        frames = _mutate(rng.choice(VALID_SEEDS), rng) if i % 2 else _random_frames(rng)
        try:
            decode(frames)
            ok += 1
        except RemoteProtocolError:
            pass
    assert ok > 0  # the mix reaches success paths, not only early rejections


# --------------------------------------------------------------------------- InFlight


def test_inflight_add_ack_and_counts() -> None:
    table = InFlight()
    entry = table.add(b"m1", b"c1", 1_000, 500)
    table.add(b"m2", b"c1", 1_000, 500)
    table.add(b"m3", b"c2", 1_000, 500)
    assert entry.deadline_us == 1_500
    assert len(table) == 3
    assert b"m1" in table
    assert table.get(b"m1") == entry
    assert table.get(b"nope") is None
    assert (table.count(b"c1"), table.count(b"c2"), table.count(b"c3")) == (2, 1, 0)
    assert table.ack(b"m1") is True
    assert table.ack(b"m1") is False  # repeated ack
    assert table.nack(b"m3") is True
    assert table.nack(b"m3") is False
    assert (table.count(b"c1"), table.count(b"c2")) == (1, 0)
    assert len(table) == 1
    assert b"m1" not in table


def test_inflight_drop_sent_before_takes_only_earlier_sends_of_that_consumer() -> None:
    table = InFlight()
    table.add(b"old-2", b"", 100, 10_000)
    table.add(b"old-1", b"", 50, 500)
    table.add(b"new", b"", 300, 10)
    table.add(b"other", b"c", 0, 10)
    assert table.drop_sent_before(b"", 300) == [b"old-1", b"old-2"]  # earliest deadline first
    assert b"new" in table and b"other" in table and b"old-1" not in table
    assert table.count(b"") == 1 and table.drop_sent_before(b"", 300) == []
    assert table.expired(10**6) == [b"other", b"new"], "no stale heap entry expires"


def test_monitor_keys_in_both_spellings() -> None:
    assert pzq.REFERENCE_MONITOR_KEYS == ("messages_inflight", "inflight_db_size")
    assert not set(pzq.REFERENCE_MONITOR_KEYS) & set(pzq.MONITOR_KEYS)


def test_inflight_expired_orders_by_deadline_not_insertion() -> None:
    table = InFlight()
    table.add(b"late", b"c", 0, 900)
    table.add(b"early", b"c", 100, 100)
    table.add(b"tie-1", b"c", 0, 500)
    table.add(b"tie-2", b"c", 200, 300)
    assert table.next_deadline() == 200
    assert table.expired(200) == []  # deadline == now is not yet expired
    assert table.expired(501) == [b"early", b"tie-1", b"tie-2"]
    assert table.next_deadline() == 900
    assert len(table) == 1
    assert table.count(b"c") == 1
    assert table.expired(10_000) == [b"late"]
    assert table.next_deadline() is None
    assert table.expired(10_000) == []


def test_inflight_acked_messages_never_expire() -> None:
    table = InFlight()
    table.add(b"a", b"c", 0, 10)
    table.add(b"b", b"c", 0, 20)
    table.ack(b"a")
    assert table.next_deadline() == 20
    assert table.expired(1_000) == [b"b"]


def test_inflight_readd_after_ack_uses_new_deadline() -> None:
    # The first send's heap item is stale; it must not expire the second send early.
    table = InFlight()
    table.add(b"m", b"c1", 0, 10)
    table.nack(b"m")
    table.add(b"m", b"c2", 100, 10)
    assert table.expired(50) == []
    assert table.get(b"m") is not None
    assert table.next_deadline() == 110
    assert table.expired(111) == [b"m"]


def test_inflight_expired_after_expiry_then_readd() -> None:
    table = InFlight()
    table.add(b"m", b"c", 0, 10)
    assert table.expired(11) == [b"m"]
    table.add(b"m", b"c", 20, 10)
    assert table.expired(31) == [b"m"]


def test_inflight_per_consumer_limit() -> None:
    table = InFlight(per_consumer_limit=2)
    assert table.per_consumer_limit == 2
    table.add(b"m1", b"c", 0, 10)
    table.add(b"m2", b"c", 0, 10)
    assert not table.can_send(b"c")
    assert table.can_send(b"other")
    with pytest.raises(LocalProtocolError) as info:
        table.add(b"m3", b"c", 0, 10)
    assert info.value.field == "consumer"
    table.ack(b"m1")
    assert table.can_send(b"c")
    table.add(b"m3", b"c", 0, 10)
    assert InFlight().can_send(b"c")


def test_inflight_duplicate_add_is_local_error() -> None:
    table = InFlight()
    table.add(b"m", b"c", 0, 10)
    with pytest.raises(LocalProtocolError) as info:
        table.add(b"m", b"d", 0, 10)
    assert info.value.field == "message_id"
    assert table.count(b"d") == 0


def test_inflight_drop_consumer() -> None:
    table = InFlight()
    table.add(b"x2", b"gone", 0, 30)
    table.add(b"y", b"stays", 0, 5)
    table.add(b"x1", b"gone", 0, 10)
    assert table.drop_consumer(b"gone") == [b"x1", b"x2"]
    assert table.drop_consumer(b"gone") == []
    assert table.count(b"gone") == 0
    assert len(table) == 1
    assert table.expired(100) == [b"y"]


def test_inflight_heap_is_compacted_after_many_acks() -> None:
    table = InFlight()
    for i in range(1_000):
        table.add(str(i).encode(), b"c", i, 1_000_000)
    for i in range(990):
        table.ack(str(i).encode())
    assert len(table) == 10
    assert len(table._heap) < 200  # lazy deletion does not let the heap grow unbounded
    assert table.next_deadline() == 990 + 1_000_000
    assert table.expired(MAX_TIMESTAMP_US) == [str(i).encode() for i in range(990, 1_000)]
    assert table._heap == []


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2"])
def test_inflight_bad_limit(limit: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        InFlight(per_consumer_limit=limit)  # type: ignore[arg-type]
    assert info.value.field == "per_consumer_limit"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((b"", b"c", 0, 1), "message_id"),
        (("m", b"c", 0, 1), "message_id"),
        ((b"m", "c", 0, 1), "consumer"),
        ((b"m", b"c", -1, 1), "sent_us"),
        ((b"m", b"c", 0, -1), "timeout_us"),
        ((b"m", b"c", 0, 1.0), "timeout_us"),
    ],
)
def test_inflight_add_validates(args: tuple[object, ...], field: str) -> None:
    with pytest.raises(LocalProtocolError) as info:
        InFlight().add(*args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_inflight_expired_rejects_non_int_now() -> None:
    with pytest.raises(LocalProtocolError):
        InFlight().expired(1.5)  # type: ignore[arg-type]


# Each op is (kind, a, b, c, d): add -> message a, consumer b, sent c, timeout d;
# ack/nack -> message a; expire -> now a; drop -> consumer a.
ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "ack", "nack", "expire", "drop"]),
        st.integers(0, 200),
        st.integers(0, 2),
        st.integers(0, 100),
        st.integers(0, 50),
    ),
    max_size=60,
)


@given(ops)
def test_inflight_matches_a_naive_model(operations: list[tuple[str, int, int, int, int]]) -> None:
    limit = 3
    table = InFlight(per_consumer_limit=limit)
    # message id -> (deadline, insertion order, consumer): the obvious, slow version.
    model: dict[bytes, tuple[int, int, bytes]] = {}
    order = 0

    def held_by(consumer: bytes) -> list[bytes]:
        mine = sorted((v[0], v[1], k) for k, v in model.items() if v[2] == consumer)
        return [k for _, _, k in mine]

    for kind, a, b, c, d in operations:
        mid = b"m%d" % (a % 8)
        if kind == "add":
            consumer = b"c%d" % b
            if mid in model or len(held_by(consumer)) >= limit:
                with pytest.raises(LocalProtocolError):
                    table.add(mid, consumer, c, d)
            else:
                table.add(mid, consumer, c, d)
                order += 1
                model[mid] = (c + d, order, consumer)
        elif kind in ("ack", "nack"):
            method = table.ack if kind == "ack" else table.nack
            assert method(mid) == (mid in model)
            model.pop(mid, None)
        elif kind == "expire":
            due = sorted((v[0], v[1], k) for k, v in model.items() if v[0] < a)
            assert table.expired(a) == [k for _, _, k in due]
            for _, _, k in due:
                del model[k]
        else:
            consumer = b"c%d" % (a % 3)
            held = held_by(consumer)
            assert table.drop_consumer(consumer) == held
            for k in held:
                del model[k]
        assert len(table) == len(model)
        for n in range(3):
            consumer = b"c%d" % n
            assert table.count(consumer) == len(held_by(consumer))
        assert table.next_deadline() == min((v[0] for v in model.values()), default=None)
