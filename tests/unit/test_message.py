"""Tests for the ZIO message codec (zio_spark.protocol.message).

Golden vectors are written out byte by byte from specs/zio-wire.md, never produced by the
codec under test. Property tests cover every message kind; the error tests pin the
``field`` each rejection names. Garbage-input fuzzing lives in test_message_fuzz.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.errors import LocalProtocolError, RemoteProtocolError
from zio_spark.protocol import message as message_module
from zio_spark.protocol.message import (
    FLOW_FORM,
    DatCodec,
    Level,
    Message,
    decode_frames,
    decode_single,
    encode_flow_label,
    encode_frames,
    encode_single,
    join_single,
    parse_flow_label,
    split_single,
)

U64_MAX = 2**64 - 1
ZERO_COORD = b"\x00" * 24
DAT_LABEL = '{"flow": "DAT"}'
DAT_PREFIX = b'ZIO0FLOW{"flow": "DAT"}'

# origin 0x0102030405060708, granule 0x1122334455667788, seqno 1, each '<Q'.
COORD_123 = bytes.fromhex("0807060504030201 8877665544332211 0100000000000000")


# --------------------------------------------------------------------------------------
# Golden vectors (zio-wire.md)
# --------------------------------------------------------------------------------------


def test_dat_abc_single_frame_golden_encode():
    msg = Message(form="FLOW", label=DAT_LABEL, payload=(b"abc",))
    # 17 'ZIO0FLOW{"flow": "DAT"}'  18 <24-byte coord>  03 'abc'
    expected = b"\x17" + DAT_PREFIX + b"\x18" + ZERO_COORD + b"\x03abc"
    assert len(DAT_PREFIX) == 0x17
    assert encode_single(msg) == expected


def test_dat_abc_single_frame_golden_decode():
    data = b"\x17" + DAT_PREFIX + b"\x18" + ZERO_COORD + b"\x03abc"
    msg = decode_single(data)
    assert msg == Message(form="FLOW", label=DAT_LABEL, payload=(b"abc",))
    assert msg.level == Level.UNDEFINED
    assert (msg.origin, msg.granule, msg.seqno) == (0, 0, 0)
    assert msg.flow_object == {"flow": "DAT"}


def test_dat_abc_golden_with_nonzero_coord():
    msg = Message(
        form="FLOW",
        label=DAT_LABEL,
        origin=0x0102030405060708,
        granule=0x1122334455667788,
        seqno=1,
        payload=(b"abc",),
    )
    expected = (
        b"\x17"
        + DAT_PREFIX
        + b"\x18"
        + bytes.fromhex(
            "0807060504030201"  # origin, little-endian
            "8877665544332211"  # granule
            "0100000000000000"  # seqno
        )
        + b"\x03abc"
    )
    assert encode_single(msg) == expected
    assert decode_single(expected) == msg
    assert encode_frames(msg) == [DAT_PREFIX, COORD_123, b"abc"]
    assert decode_frames([DAT_PREFIX, COORD_123, b"abc"]) == msg


def test_coord_extremes_golden():
    msg = Message(form="FLOW", label=DAT_LABEL, origin=U64_MAX, granule=0, seqno=U64_MAX)
    coord = b"\xff" * 8 + b"\x00" * 8 + b"\xff" * 8
    assert encode_frames(msg) == [DAT_PREFIX, coord]
    assert decode_frames([DAT_PREFIX, coord]) == msg


def test_python_reference_label_spacing():
    assert encode_flow_label({"flow": "DAT"}) == DAT_LABEL
    assert (
        encode_flow_label({"flow": "BOT", "direction": "extract", "credit": 10})
        == '{"flow": "BOT", "direction": "extract", "credit": 10}'
    )


def test_bot_multipart_frames_golden():
    label = encode_flow_label({"flow": "BOT", "direction": "inject", "credit": 5})
    msg = Message(form="FLOW", label=label, origin=0x2A, seqno=0)
    frames = [
        b'ZIO0FLOW{"flow": "BOT", "direction": "inject", "credit": 5}',
        b"\x2a" + b"\x00" * 23,
    ]
    assert encode_frames(msg) == frames
    decoded = decode_frames(frames)
    assert decoded == msg
    assert decoded.flow_object == {"flow": "BOT", "direction": "inject", "credit": 5}


def test_foreign_compact_sorted_label_decodes():
    # What the C++ reference sends: compact JSON, sorted keys, granule = time in µs.
    prefix = b'ZIO0FLOW{"credit":10,"direction":"extract","flow":"BOT"}'
    coord = bytes.fromhex("0700000000000000 00401e18240a0600 0000000000000000")
    msg = decode_frames([prefix, coord])
    assert msg.form == FLOW_FORM
    assert msg.label == '{"credit":10,"direction":"extract","flow":"BOT"}'  # kept verbatim
    assert (msg.origin, msg.granule, msg.seqno) == (7, 1_700_000_000_000_000, 0)
    assert msg.flow_object == {"credit": 10, "direction": "extract", "flow": "BOT"}
    # The same message in single-frame form: prefix is 8 + 48 = 56 = 0x38 bytes.
    assert decode_single(b"\x38" + prefix + b"\x18" + coord) == msg
    # Re-encoding a foreign flow object gives the Python spacing, same object.
    again = encode_flow_label(msg.flow_object)
    assert again == '{"credit": 10, "direction": "extract", "flow": "BOT"}'
    assert parse_flow_label(again) == msg.flow_object


def test_label_at_255_bytes_takes_long_length_prefix():
    # prefix = 8 + 247 = 255 bytes: the first length that needs 0xFF + 4-byte big-endian.
    prefix = b"ZIO4TEXT" + b"x" * 247
    assert len(prefix) == 255
    msg = Message(form="TEXT", label="x" * 247, level=Level.INFO, seqno=1)
    expected = (
        b"\xff\x00\x00\x00\xff" + prefix + b"\x18" + bytes.fromhex("00" * 16 + "01" + "00" * 7)
    )
    assert encode_single(msg) == expected
    assert decode_single(expected) == msg


def test_label_at_254_bytes_keeps_one_byte_length():
    prefix = b"ZIO4TEXT" + b"x" * 246
    msg = Message(form="TEXT", label="x" * 246, level=Level.INFO)
    assert encode_single(msg) == b"\xfe" + prefix + b"\x18" + ZERO_COORD
    assert decode_single(b"\xfe" + prefix + b"\x18" + ZERO_COORD) == msg


def test_long_flow_label_golden():
    # A DAT with an application attribute long enough to push the prefix to 300 bytes.
    pad = "p" * 266
    label = '{"flow": "DAT", "pad": "' + pad + '"}'
    prefix = b'ZIO0FLOW{"flow": "DAT", "pad": "' + b"p" * 266 + b'"}'
    assert len(prefix) == 300  # 0x0000012c
    msg = Message(form="FLOW", label=label, payload=(b"abc",))
    expected = b"\xff\x00\x00\x01\x2c" + prefix + b"\x18" + ZERO_COORD + b"\x03abc"
    assert encode_single(msg) == expected
    assert decode_single(expected) == msg
    assert msg.flow_object == {"flow": "DAT", "pad": pad}


def test_label_length_counts_utf8_bytes_not_characters():
    # 124 two-byte characters: 124 chars, but 8 + 248 = 256 bytes of prefix.
    msg = Message(form="TEXT", label="é" * 124)
    expected = b"\xff\x00\x00\x01\x00" + b"ZIO0TEXT" + b"\xc3\xa9" * 124 + b"\x18" + ZERO_COORD
    assert encode_single(msg) == expected
    assert decode_single(expected) == msg


@pytest.mark.parametrize(
    ("size", "length_prefix"),
    [
        (0, b"\x00"),
        (254, b"\xfe"),
        (255, b"\xff\x00\x00\x00\xff"),
        (256, b"\xff\x00\x00\x01\x00"),
        (65535, b"\xff\x00\x00\xff\xff"),
        (65536, b"\xff\x00\x01\x00\x00"),
        (70000, b"\xff\x00\x01\x11\x70"),
    ],
)
def test_payload_length_prefix_golden(size, length_prefix):
    frame = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert len(frame) == size
    msg = Message(form="FLOW", label=DAT_LABEL, payload=(frame,))
    expected = b"\x17" + DAT_PREFIX + b"\x18" + ZERO_COORD + length_prefix + frame
    assert encode_single(msg) == expected
    assert decode_single(expected) == msg


def test_several_payload_frames_golden():
    msg = Message(form="FLOW", label=DAT_LABEL, payload=(b"", b"a", b"bc"))
    expected = b"\x17" + DAT_PREFIX + b"\x18" + ZERO_COORD + b"\x00" + b"\x01a" + b"\x02bc"
    assert encode_single(msg) == expected
    assert decode_single(expected) == msg
    assert encode_frames(msg) == [DAT_PREFIX, ZERO_COORD, b"", b"a", b"bc"]


@pytest.mark.parametrize("level", list(Level))
def test_level_digit_golden(level):
    frames = [b"ZIO" + str(int(level)).encode() + b"LOG hi", ZERO_COORD]
    msg = Message(form="LOG", label="hi", level=level)
    assert encode_frames(msg) == frames
    decoded = decode_frames(frames)
    assert decoded == msg
    assert decoded.level == level
    assert Level(decoded.level) is level


def test_level_names_are_the_specs():
    assert [(lv.name, lv.value) for lv in Level] == [
        ("UNDEFINED", 0),
        ("TRACE", 1),
        ("VERBOSE", 2),
        ("DEBUG", 3),
        ("INFO", 4),
        ("SUMMARY", 5),
        ("WARNING", 6),
        ("ERROR", 7),
        ("FATAL", 8),
    ]


@pytest.mark.parametrize(
    ("form", "wire"),
    [("A", b"A   "), ("AB", b"AB  "), ("ABC", b"ABC "), ("ABCD", b"ABCD"), (" A", b" A  ")],
)
def test_form_is_space_padded_on_the_wire(form, wire):
    assert encode_frames(Message(form=form))[0] == b"ZIO0" + wire
    assert decode_frames([b"ZIO0" + wire, ZERO_COORD]).form == form


def test_form_trailing_spaces_are_stripped_on_decode():
    # On the wire "AB" and "AB  " are the same form; decode yields the short one.
    assert decode_frames([b"ZIO0AB  ", ZERO_COORD]).form == "AB"
    assert encode_frames(Message(form="AB  ")) == encode_frames(Message(form="AB"))


def test_blank_form_of_the_python_reference_decodes():
    # The Python reference's default form is four spaces; it must decode (to "").
    msg = decode_frames([b"ZIO4    hello", ZERO_COORD])
    assert (msg.form, msg.label, msg.level) == ("", "hello", 4)
    # ... and re-encode as four spaces, so a relay passes it on unchanged.
    assert encode_frames(msg)[0] == b"ZIO4    hello"


def test_non_flow_label_is_not_parsed():
    msg = decode_frames([b"ZIO4TEXT{not json", ZERO_COORD])
    assert (msg.form, msg.label) == ("TEXT", "{not json")
    # Only the exact form FLOW carries a flow object.
    assert decode_frames([b"ZIO0flow[1]", ZERO_COORD]).form == "flow"
    assert decode_frames([b"ZIO0FLO [1]", ZERO_COORD]).form == "FLO"


def test_empty_label_round_trips():
    msg = Message(form="TEXT")
    assert encode_frames(msg) == [b"ZIO0TEXT", ZERO_COORD]
    assert decode_frames([b"ZIO0TEXT", ZERO_COORD]) == msg


def test_decode_accepts_any_buffer_type():
    # zmq hands out bytes, Frames or memoryviews depending on copy=; all must work.
    frames = [bytearray(DAT_PREFIX), memoryview(COORD_123), memoryview(b"abc"), bytearray(b"d")]
    msg = decode_frames(frames)
    assert msg.payload == (b"abc", b"d")
    assert all(type(p) is bytes for p in msg.payload)
    data = b"\x17" + DAT_PREFIX + b"\x18" + COORD_123 + b"\x03abc"
    assert decode_single(bytearray(data)) == decode_single(memoryview(data)) == decode_single(data)


def test_split_single_basics():
    assert split_single(b"") == []
    assert split_single(b"\x00\x00") == [b"", b""]
    assert split_single(b"\x03abc\x00\x01z") == [b"abc", b"", b"z"]
    assert all(type(f) is bytes for f in split_single(memoryview(b"\x03abc")))


def test_split_single_accepts_non_canonical_long_length():
    # czmq's zmsg_decode reads 0xFF + 4 bytes whatever the length; so do we.
    assert split_single(b"\xff\x00\x00\x00\x03abc") == [b"abc"]
    assert split_single(b"\xff\x00\x00\x00\x00") == [b""]


def test_join_single_golden():
    assert join_single([]) == b""
    assert join_single([b"", b"abc"]) == b"\x00\x03abc"
    assert join_single([b"x" * 255]) == b"\xff\x00\x00\x00\xff" + b"x" * 255


# --------------------------------------------------------------------------------------
# Message, flow objects
# --------------------------------------------------------------------------------------


def test_message_is_frozen_and_slotted():
    msg = Message(form="FLOW", label=DAT_LABEL)
    with pytest.raises(AttributeError):
        msg.form = "TEXT"  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")
    assert msg == Message(form="FLOW", label=DAT_LABEL)
    assert hash(msg) == hash(Message(form="FLOW", label=DAT_LABEL))


def test_flow_object_is_read_only():
    obj = Message(form="FLOW", label='{"flow": "PAY", "credit": 3}').flow_object
    assert obj == {"flow": "PAY", "credit": 3}
    with pytest.raises(TypeError):
        obj["credit"] = 4  # type: ignore[index]
    assert Message(form="FLOW", label='{"flow": "PAY", "credit": 3}').flow_object["credit"] == 3


def test_flow_object_of_a_bad_label_raises_remote_error():
    with pytest.raises(RemoteProtocolError) as info:
        _ = Message(form="TEXT", label="hello").flow_object
    assert info.value.field == "label"


def test_label_cache_returns_the_same_view(monkeypatch):
    monkeypatch.setattr(message_module, "_LABEL_CACHE", {})
    first = parse_flow_label('{"flow": "DAT", "n": 1}')
    assert parse_flow_label('{"flow": "DAT", "n": 1}') is first


def test_label_cache_is_bounded(monkeypatch):
    cache: dict[str, object] = {}
    monkeypatch.setattr(message_module, "_LABEL_CACHE", cache)
    monkeypatch.setattr(message_module, "_LABEL_CACHE_MAX", 2)
    labels = [json.dumps({"flow": "DAT", "n": n}) for n in range(5)]
    for n, label in enumerate(labels):
        assert parse_flow_label(label) == {"flow": "DAT", "n": n}
    assert list(cache) == labels[:2]
    # Past the bound, labels are still parsed correctly every time.
    assert parse_flow_label(labels[4]) == {"flow": "DAT", "n": 4}


def test_label_cache_never_keeps_rejected_labels(monkeypatch):
    cache: dict[str, object] = {}
    monkeypatch.setattr(message_module, "_LABEL_CACHE", cache)
    for _ in range(2):
        with pytest.raises(RemoteProtocolError):
            parse_flow_label('{"credit": 1}')
    assert cache == {}


# --------------------------------------------------------------------------------------
# Property tests: round trips over every message kind
# --------------------------------------------------------------------------------------

ascii_chars = st.characters(min_codepoint=0, max_codepoint=127)
# The form is right-stripped of spaces on decode, so a generated form never ends in one.
plain_forms = st.text(ascii_chars, min_size=1, max_size=4).filter(
    lambda f: not f.endswith(" ") and f != FLOW_FORM
)
labels = st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=400))
levels = st.one_of(st.integers(0, 8), st.sampled_from(Level))
u64 = st.one_of(st.integers(0, U64_MAX), st.sampled_from([0, 1, 255, 256, 2**63, U64_MAX]))

small_frames = st.binary(max_size=64)
# Sizes around the one-byte / four-byte length boundary and past 64 KiB.
big_frames = st.builds(
    lambda head, size, fill: (head + bytes([fill]) * size)[:size],
    st.binary(max_size=16),
    st.sampled_from([254, 255, 256, 65535, 65536, 70_000]),
    st.integers(0, 255),
)
payloads = st.lists(st.one_of(small_frames, small_frames, small_frames, big_frames), max_size=5)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
RESERVED_KEYS = {"flow", "direction", "credit"}
extra_attributes = st.dictionaries(
    st.text(max_size=12).filter(lambda k: k not in RESERVED_KEYS), json_values, max_size=4
)
flow_bases = st.one_of(
    st.fixed_dictionaries(
        {
            "flow": st.just("BOT"),
            "direction": st.sampled_from(["extract", "inject"]),
            "credit": st.integers(0, 2**31),
        }
    ),
    st.fixed_dictionaries({"flow": st.just("PAY"), "credit": st.integers(1, 2**31)}),
    st.fixed_dictionaries({"flow": st.just("DAT")}),
    st.fixed_dictionaries({"flow": st.just("EOT")}),
)
flow_objects = st.builds(lambda base, extra: {**base, **extra}, flow_bases, extra_attributes)


@st.composite
def flow_messages(draw):
    obj = draw(flow_objects)
    msg = Message(
        form=FLOW_FORM,
        label=encode_flow_label(obj),
        level=draw(levels),
        origin=draw(u64),
        granule=draw(u64),
        seqno=draw(u64),
        payload=tuple(draw(payloads)),
    )
    return obj, msg


plain_messages = st.builds(
    Message,
    form=plain_forms,
    label=labels,
    level=levels,
    origin=u64,
    granule=u64,
    seqno=u64,
    payload=payloads.map(tuple),
)
messages = st.one_of(plain_messages, flow_messages().map(lambda pair: pair[1]))

ROUND_TRIP = settings(max_examples=300, deadline=None)


@ROUND_TRIP
@given(messages)
def test_frames_round_trip(msg):
    frames = encode_frames(msg)
    assert all(type(f) is bytes for f in frames)
    assert len(frames) == 2 + len(msg.payload)
    assert frames[0][:3] == b"ZIO"
    assert len(frames[1]) == 24
    assert decode_frames(frames) == msg


@ROUND_TRIP
@given(messages)
def test_single_round_trip(msg):
    data = encode_single(msg)
    assert split_single(data) == encode_frames(msg)
    assert decode_single(data) == msg


@ROUND_TRIP
@given(flow_messages())
def test_flow_object_round_trip(pair):
    obj, msg = pair
    decoded = decode_single(encode_single(msg))
    assert decoded == msg
    assert decoded.flow_object == obj
    assert decoded.flow_object["flow"] in {"BOT", "PAY", "DAT", "EOT"}


@ROUND_TRIP
@given(flow_objects)
def test_compact_sorted_json_parses_like_python_spacing(obj):
    compact = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    assert parse_flow_label(compact) == parse_flow_label(encode_flow_label(obj)) == obj


@ROUND_TRIP
@given(st.lists(st.one_of(small_frames, big_frames), max_size=6))
def test_join_split_round_trip(frames):
    assert split_single(join_single(frames)) == frames


# --------------------------------------------------------------------------------------
# Decoding rejects with RemoteProtocolError naming the field
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "field"),
    [
        pytest.param([], "frames", id="no-frames"),
        pytest.param([DAT_PREFIX], "frames", id="one-frame"),
        pytest.param([b"", ZERO_COORD], "prefix", id="prefix-empty"),
        pytest.param([b"ZIO", ZERO_COORD], "prefix", id="prefix-3"),
        pytest.param([b"ZIO0FLO", ZERO_COORD], "prefix", id="prefix-7"),
        pytest.param([b'ZIP0FLOW{"flow": "DAT"}', ZERO_COORD], "magic", id="magic-ZIP"),
        pytest.param([b"zio0TEXT", ZERO_COORD], "magic", id="magic-lowercase"),
        pytest.param([b"\x00" * 8, ZERO_COORD], "magic", id="magic-zeros"),
        pytest.param([b"ZIO9TEXT", ZERO_COORD], "level", id="level-9"),
        pytest.param([b"ZIOxTEXT", ZERO_COORD], "level", id="level-x"),
        pytest.param([b"ZIO/TEXT", ZERO_COORD], "level", id="level-below-0"),
        pytest.param([b"ZIO:TEXT", ZERO_COORD], "level", id="level-above-9"),
        pytest.param([b"ZIO\xb0TEXT", ZERO_COORD], "level", id="level-non-ascii"),
        pytest.param([b"ZIO0FL\xc3\x96Wlabel", ZERO_COORD], "form", id="form-utf8"),
        pytest.param([b"ZIO0\xffLOW", ZERO_COORD], "form", id="form-0xff"),
        pytest.param([b"ZIO0TEXT\xff", ZERO_COORD], "label", id="label-0xff"),
        pytest.param([b"ZIO0TEXT\xc3", ZERO_COORD], "label", id="label-truncated-utf8"),
        pytest.param([b"ZIO0TEXT\xed\xa0\x80", ZERO_COORD], "label", id="label-surrogate"),
        pytest.param([b"ZIO0FLOW\xff", ZERO_COORD], "label", id="flow-label-not-utf8"),
        pytest.param([DAT_PREFIX, b"\x00" * 23], "coord", id="coord-23"),
        pytest.param([DAT_PREFIX, b"\x00" * 25], "coord", id="coord-25"),
        pytest.param([DAT_PREFIX, b""], "coord", id="coord-empty"),
        pytest.param([b'ZIO0FLOW{"flow": DAT}', ZERO_COORD], "label", id="flow-not-json"),
        pytest.param([b"ZIO0FLOW", ZERO_COORD], "label", id="flow-empty-label"),
        pytest.param([b"ZIO0FLOW" + b"[" * 100_000, ZERO_COORD], "label", id="flow-deep"),
        pytest.param([b"ZIO0FLOW[1]", ZERO_COORD], "label", id="flow-array"),
        pytest.param([b'ZIO0FLOW"x"', ZERO_COORD], "label", id="flow-string"),
        pytest.param([b"ZIO0FLOW1", ZERO_COORD], "label", id="flow-number"),
        pytest.param([b"ZIO0FLOWnull", ZERO_COORD], "label", id="flow-null"),
        pytest.param([b"ZIO0FLOW{}", ZERO_COORD], "flow", id="flow-empty-object"),
        pytest.param([b'ZIO0FLOW{"credit":10}', ZERO_COORD], "flow", id="flow-missing"),
        pytest.param([b'ZIO0FLOW{"flow": 1}', ZERO_COORD], "flow", id="flow-int"),
        pytest.param([b'ZIO0FLOW{"flow": null}', ZERO_COORD], "flow", id="flow-null-attr"),
        pytest.param([b'ZIO0FLOW{"flow": ["DAT"]}', ZERO_COORD], "flow", id="flow-list"),
        pytest.param([b'ZIO0FLOW{"flow": {"a": 1}}', ZERO_COORD], "flow", id="flow-object"),
    ],
)
def test_decode_rejects_naming_the_field(frames, field):
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames(frames)
    assert info.value.field == field
    # The single-frame form of the same parts fails the same way.
    with pytest.raises(RemoteProtocolError) as info:
        decode_single(join_single(frames))
    assert info.value.field == field


def test_decode_errors_carry_the_offending_value():
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames([b"ZIO9TEXT", ZERO_COORD])
    assert info.value.value == b"9"
    assert "'9'" in str(info.value) and "level" in str(info.value)
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames([DAT_PREFIX, b"\x00" * 23])
    assert info.value.value == 23
    assert "24" in str(info.value) and "23" in str(info.value)
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames([b'ZIO0FLOW{"flow": 1}', ZERO_COORD])
    assert info.value.value == 1
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames([DAT_PREFIX])
    assert info.value.value == 1


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x05ab", id="short-frame"),
        pytest.param(b"\x01", id="length-only"),
        pytest.param(b"\xff", id="ff-alone"),
        pytest.param(b"\xff\x00", id="ff-1-of-4"),
        pytest.param(b"\xff\x00\x00\x00", id="ff-3-of-4"),
        pytest.param(b"\xff\x00\x00\x01\x00" + b"x" * 255, id="ff-one-byte-short"),
        pytest.param(b"\xff\xff\xff\xff\xff", id="ff-4GiB-claim"),
        pytest.param(b"\x03abc\x02a", id="second-frame-short"),
        pytest.param(b"\x03abc\xff\x00\x00", id="second-ff-truncated"),
        pytest.param(b"\x17" + DAT_PREFIX + b"\x18" + ZERO_COORD + b"\x04abc", id="dat-payload"),
        pytest.param(b"\x17" + DAT_PREFIX + b"\x18" + ZERO_COORD[:-1], id="dat-coord-cut"),
    ],
)
def test_truncated_length_prefixes_are_rejected(data):
    for decode in (split_single, decode_single):
        with pytest.raises(RemoteProtocolError) as info:
            decode(data)
        assert info.value.field == "length"


def test_truncated_long_length_names_its_offset():
    with pytest.raises(RemoteProtocolError) as info:
        split_single(b"\x03abc\xff\x00\x00")
    assert info.value.value == 4


@pytest.mark.parametrize(
    ("label", "field"),
    [
        ("", "label"),
        ("{", "label"),
        ("[1]", "label"),
        ('"x"', "label"),
        ("true", "label"),
        ("[" * 100_000, "label"),
        ("1" * 5000, "label"),  # beyond int's max_str_digits: a ValueError inside json
        ("{}", "flow"),
        ('{"direction": "inject"}', "flow"),
        ('{"flow": false}', "flow"),
        ('{"flow": 3.5}', "flow"),
    ],
)
def test_parse_flow_label_rejects(label, field):
    with pytest.raises(RemoteProtocolError) as info:
        parse_flow_label(label)
    assert info.value.field == field


# --------------------------------------------------------------------------------------
# Encoding misuse raises LocalProtocolError
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"level": 9}, "level"),
        ({"level": -1}, "level"),
        ({"level": 48}, "level"),
        ({"level": "4"}, "level"),
        ({"level": 4.0}, "level"),
        ({"level": None}, "level"),
        ({"form": "ABCDE"}, "form"),
        ({"form": "FLOWS"}, "form"),
        ({"level": True}, "level"),
        ({"form": "FLÖW"}, "form"),
        ({"form": "É"}, "form"),
        ({"form": None}, "form"),
        ({"form": b"FLOW"}, "form"),
        ({"label": None}, "label"),
        ({"label": b"text"}, "label"),
        ({"label": "\ud800"}, "label"),
        ({"origin": -1}, "coord"),
        ({"origin": 2**64}, "coord"),
        ({"granule": -1}, "coord"),
        ({"granule": 2**64}, "coord"),
        ({"seqno": -1}, "coord"),
        ({"seqno": 2**64}, "coord"),
        ({"seqno": 2**100}, "coord"),
        ({"origin": 1.5}, "coord"),
        ({"origin": None}, "coord"),
    ],
)
def test_encode_misuse_raises_local_error(fields, field):
    msg = Message(**{"form": "TEXT", **fields})
    for encode in (encode_frames, encode_single):
        with pytest.raises(LocalProtocolError) as info:
            encode(msg)
        assert info.value.field == field
        assert not isinstance(info.value, RemoteProtocolError)


def test_encode_coord_error_carries_the_values():
    with pytest.raises(LocalProtocolError) as info:
        encode_frames(Message(form="TEXT", origin=1, granule=2**64, seqno=3))
    assert info.value.value == (1, 2**64, 3)


@pytest.mark.parametrize(
    "obj",
    [{}, {"credit": 10}, {"flow": None}, {"flow": 1}, {"flow": b"DAT"}, {"flow": ["DAT"]}],
)
def test_encode_flow_label_without_string_flow(obj):
    with pytest.raises(LocalProtocolError) as info:
        encode_flow_label(obj)
    assert info.value.field == "flow"


def test_encode_flow_label_not_serialisable():
    with pytest.raises(LocalProtocolError):
        encode_flow_label({"flow": "DAT", "when": object()})  # TypeError inside json
    circular: dict[str, object] = {"flow": "DAT"}
    circular["self"] = circular
    with pytest.raises(LocalProtocolError):
        encode_flow_label(circular)  # ValueError inside json


# -- the prefix caches -------------------------------------------------------------------


def test_unhashable_label_is_a_local_error_not_a_crash():
    with pytest.raises(LocalProtocolError) as info:
        encode_frames(Message(form="TEXT", label=["not", "text"]))  # type: ignore[arg-type]
    assert info.value.field == "label"


def test_cached_prefix_still_checks_the_coord():
    frames = encode_frames(Message(form="TEXT", label="cached"))
    decode_frames(frames)  # now cached
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames([frames[0], b"\x00" * 23])
    assert info.value.field == "coord"


def test_caches_stay_bounded_and_correct_when_full(monkeypatch):
    import zio_spark.protocol.message as m

    monkeypatch.setattr(m, "_PREFIX_OUT", {})
    monkeypatch.setattr(m, "_PREFIX_IN", {})
    monkeypatch.setattr(m, "_PREFIX_CACHE_MAX", 2)
    msgs = [Message(form="TEXT", label=f"l{i}", seqno=i) for i in range(5)]
    for msg in msgs:
        assert decode_frames(encode_frames(msg)) == msg
    assert len(m._PREFIX_OUT) == 2
    assert len(m._PREFIX_IN) == 2


def test_bool_level_is_not_served_from_the_cache():
    encode_frames(Message(form="TEXT", label="b", level=1))
    with pytest.raises(LocalProtocolError) as info:
        encode_frames(Message(form="TEXT", label="b", level=True))
    assert info.value.field == "level"


def test_join_single_rejects_frames_of_4_gib():
    class Huge(bytes):
        def __len__(self) -> int:
            return 1 << 32

    with pytest.raises(LocalProtocolError) as info:
        join_single([Huge(b"x")])
    assert info.value.field == "length"


def test_dat_codec_coord_is_the_coord_part_of_the_full_encoding():
    # The ROUTER wire packs a DAT from codec.prefix and codec.coord (no Message).
    codec = DatCodec(0x0102030405060708)
    msg = Message(FLOW_FORM, DAT_LABEL, 0, 0x0102030405060708, 0, 1, (b"x",))
    assert [codec.prefix, codec.coord(1), b"x"] == encode_frames(msg)
