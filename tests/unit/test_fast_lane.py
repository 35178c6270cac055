"""The DAT fast lane: same bytes and same events as the full codec and state machine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.errors import FlowControlError, LocalProtocolError, RemoteProtocolError
from zio_spark.protocol.flow import Data, Direction, Flow, FlowPair, FlowState, Role
from zio_spark.protocol.message import (
    DAT_LABEL,
    DatCodec,
    Message,
    decode_frames,
    decode_single,
    encode_frames,
    encode_single,
    join_single,
    split_single,
)

payloads = st.lists(
    st.one_of(st.binary(max_size=300), st.binary(min_size=250, max_size=70_000)), max_size=4
).map(tuple)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=300, deadline=None)
@given(origin=u64, seqno=u64, payload=payloads)
def test_codec_bytes_equal_the_full_encoders(origin: int, seqno: int, payload) -> None:
    codec = DatCodec(origin)
    msg = Message("FLOW", DAT_LABEL, 0, origin, 0, seqno, payload)
    assert codec.frames(seqno, payload) == encode_frames(msg)
    single = codec.single(seqno, payload)
    assert single == encode_single(msg)
    # and both decoders (fast lane or not, bytes or a view) give the message back
    assert decode_single(single) == msg
    assert decode_single(memoryview(single)) == msg
    assert decode_frames(codec.frames(seqno, payload)) == msg


def test_codec_refuses_a_bad_origin() -> None:
    with pytest.raises(LocalProtocolError) as e:
        DatCodec(2**64)
    assert e.value.field == "coord"


@pytest.mark.parametrize("size", [0, 1, 254, 255, 256, 70_000])
def test_join_single_lengths(size: int) -> None:
    frame = b"z" * size
    joined = join_single([frame, b"a"])
    head = bytes((size,)) if size < 255 else b"\xff" + size.to_bytes(4, "big")
    assert joined == head + frame + b"\x01a"
    assert split_single(joined) == [frame, b"a"]
    assert split_single(memoryview(joined)) == [frame, b"a"]


def _known_dat(payload: tuple[bytes, ...] = (b"abc",)) -> bytes:
    data = DatCodec(1).single(7, payload)
    decode_single(data)  # the prefix is now known: later decodes take the fast lane
    return data


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],  # payload shorter than its length byte says
        lambda d: d + b"x",  # a stray byte after the payload
        lambda d: d[: len(d) - 4] + b"\xff\x00\x00",  # truncated 4-byte length
        lambda d: d[:30],  # cut inside the coord
    ],
)
def test_fast_lane_never_accepts_broken_framing(mangle) -> None:
    data = mangle(_known_dat())
    with pytest.raises(RemoteProtocolError):
        decode_single(data)


def test_fast_lane_checks_the_coord_length_byte() -> None:
    data = bytearray(_known_dat())
    prefix_len = data[0]
    data[1 + prefix_len] = 23  # coord length byte
    with pytest.raises(RemoteProtocolError):
        decode_single(bytes(data))


def test_long_payload_frame_takes_the_fast_lane_with_one_copy() -> None:
    big = bytes(range(256)) * 400
    data = _known_dat((big,))
    msg = decode_single(memoryview(data))
    assert msg.payload == (big,) and type(msg.payload[0]) is bytes


def _full_decode(data: bytes) -> Message | type[RemoteProtocolError]:
    try:
        return decode_frames(split_single(data))
    except RemoteProtocolError:
        return RemoteProtocolError


def _decodes_as_the_full_decoder(data: bytes) -> Message | type[RemoteProtocolError]:
    """With a DAT head just cached, ``decode_single(data)`` agrees with the full decoder
    (same message, or both refuse); returns what they gave."""
    _known_dat()
    want = _full_decode(data)
    if want is RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            decode_single(data)
    else:
        assert decode_single(data) == want
    return want


@settings(max_examples=1000, deadline=None)
@given(
    payload=st.binary(max_size=300),
    seqno=u64,
    cut=st.integers(0, 400),
    extra=st.binary(max_size=6),
    flip=st.tuples(st.integers(0, 400), st.integers(0, 255)),
)
def test_the_last_head_lane_agrees_with_the_full_decoder(payload, seqno, cut, extra, flip):
    """With the head cached (a DAT decoded just before), any mangled DAT decodes to what
    the full decoder says, or fails as it does."""
    _known_dat()
    data = bytearray(DatCodec(1).single(seqno, (payload,)))
    if flip[0] < len(data):
        data[flip[0]] = flip[1]
    _decodes_as_the_full_decoder(bytes(data[:cut]) + extra)


@pytest.mark.parametrize(
    "payload_frame",
    [
        b"\xff" + b"B" * 255,  # 255 is the long-form marker, not a length: broken framing
        b"\xff\x00\x00\x00\xfb" + b"C" * 251,  # the long form of a 251-byte frame
    ],
)
def test_the_last_head_lane_reads_a_255_length_byte_as_the_long_form(payload_frame) -> None:
    """Found by review: the cached-head lane took a 255 length byte for a 1-byte length
    when exactly 255 bytes followed."""
    want = _decodes_as_the_full_decoder(DatCodec(1).single(7, ()) + payload_frame)
    if want is not RemoteProtocolError:
        assert want.payload == (b"C" * 251,)


# -- flow accounting -------------------------------------------------------------------


def _pair(credit: int = 3) -> FlowPair:
    pair = FlowPair()
    pair.handshake(Direction.EXTRACT, credit)
    return pair


def test_send_dats_matches_send_dat() -> None:
    fast, slow = _pair(), _pair()
    slow_pay = slow.to_client(slow.server.pay())
    fast_pay = fast.to_client(fast.server.pay())
    assert fast_pay == slow_pay
    first = fast.client.send_dats(2)
    m1 = slow.client.send_dat((b"a",))
    m2 = slow.client.send_dat((b"b",))
    assert (first, first + 1) == (m1.seqno, m2.seqno)
    codec = DatCodec(fast.client.origin)
    assert codec.frames(first, (b"a",)) == encode_frames(m1)
    for name in ("credit", "sent", "dats_sent", "state"):
        assert getattr(fast.client, name) == getattr(slow.client, name), name


@pytest.mark.parametrize("n", [0, -1, 4, True, 1.0])
def test_send_dats_refuses_more_than_the_credit(n) -> None:
    pair = _pair()
    pair.to_client(pair.server.pay())
    with pytest.raises(LocalProtocolError) as e:
        pair.client.send_dats(n)
    assert e.value.field == "credit"


def test_send_dats_refuses_a_taker_and_a_closed_flow() -> None:
    pair = _pair()
    with pytest.raises(LocalProtocolError) as e:
        pair.server.send_dats(1)
    assert e.value.field == "direction"
    idle = Flow(Role.CLIENT)
    with pytest.raises(LocalProtocolError) as e:
        idle.send_dats(1)
    assert e.value.field == "state"


def test_take_dat_and_receive_agree() -> None:
    pair = _pair(2)
    pair.to_client(pair.server.pay())
    msg = pair.client.send_dat((b"x",))
    event = pair.to_server(msg)  # through receive(): the fast lane inside it
    assert isinstance(event, Data) and event.attrs == {} and event.message == msg
    assert pair.server.take_dat() is True  # the second credit handed out
    assert pair.server.take_dat() is False  # nothing outstanding: not acceptable
    assert pair.server.credit == 2 and pair.server.dats_received == 2
    # receive() gives the precise error for what take_dat refused
    with pytest.raises(FlowControlError):
        pair.server.receive(msg)
    assert pair.server.state is FlowState.ERROR
    assert pair.server.take_dat() is False


def test_take_dat_refuses_a_giver() -> None:
    pair = _pair()
    assert pair.client.take_dat() is False
    assert pair.client.dats_received == 0
