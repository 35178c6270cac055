"""The PZQ store's record and snapshot codecs (zio_spark.storage.store_format) and the
queue's flow side log (zio_spark.storage.flow_log): damaged bytes raise the storage
errors of :mod:`zio_spark.errors`, never a bare ValueError or struct.error."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.errors import CorruptRecordError, FormatVersionError, StorageInputError
from zio_spark.storage import store_format as sf
from zio_spark.storage.files import frame
from zio_spark.storage.flow_log import FlowLog


def test_a_message_record_round_trips() -> None:
    payload = sf.message_payload(7, b"id-1", [b"a", b"bc"])
    assert sf.parse_head(payload, sf.T_PUT) == (-1, 7, b"id-1")
    assert sf.parse_message(payload, sf.T_PUT) == (-1, 7, b"id-1", (b"a", b"bc"))
    moved = sf.message_payload(8, b"id-1", [b"a"], original=5)
    assert sf.parse_message(moved, sf.T_MOVE) == (5, 8, b"id-1", (b"a",))


def test_malformed_message_records_are_corrupt_records() -> None:
    payload = sf.message_payload(7, b"id-1", [b"a", b"bc"])
    with pytest.raises(CorruptRecordError, match="part lengths do not add up"):
        sf.parse_head(payload + b"x", sf.T_PUT)
    with pytest.raises(CorruptRecordError, match="short or empty id"):
        sf.parse_head(sf.PUT_STRUCT.pack(sf.T_PUT, 1, 40) + b"abc", sf.T_PUT)
    with pytest.raises(CorruptRecordError, match="malformed message record"):
        sf.parse_message(payload[:5], sf.T_PUT)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda i, b: sf.message_payload(1, i, b),
            st.binary(min_size=1, max_size=8),
            st.lists(st.binary(max_size=8), min_size=1, max_size=3),
        ).map(lambda p: p[:-1] if len(p) % 3 == 0 else p),
    ),
    st.sampled_from([sf.T_PUT, sf.T_MOVE]),
)
def test_any_bytes_parse_or_raise_a_corrupt_record(data: bytes, kind: int) -> None:
    """Bytes that parse are exactly the record of what they parse as (the type byte
    aside: the caller dispatched on it)."""
    try:
        original, seq, message_id, body = sf.parse_message(data, kind)
    except CorruptRecordError:
        return
    assert sf.message_payload(seq, message_id, body, original)[1:] == data[1:]


def test_snapshot_errors_name_what_is_wrong() -> None:
    good = sf.encode_snapshot(3, 9, 8, [b"a", b"b"], [sf.body_digest([b"x"]), b""])
    assert sf.decode_snapshot(good) == (3, 9, 8, [b"a", b"b"], [sf.body_digest([b"x"]), b""])
    with pytest.raises(CorruptRecordError, match="CRC mismatch"):
        sf.decode_snapshot(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptRecordError, match="too short"):
        sf.decode_snapshot(good[:10])
    with pytest.raises(CorruptRecordError, match="magic"):
        sf.decode_snapshot(b"XXXX" + good[4:])
    future = bytearray(good)
    struct.pack_into("<H", future, 4, 99)
    with pytest.raises(FormatVersionError) as e:
        sf.decode_snapshot(bytes(future))
    assert e.value.found == 99 and e.value.expected == (1, sf.SNAP_VERSION)
    with pytest.raises(StorageInputError, match=r"digests: got 1, expected one per id \(2\)"):
        sf.encode_snapshot(3, 9, 8, [b"a", b"b"], [b""])


def test_flow_log_stops_at_a_record_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "flow-producer.log"
    log = FlowLog(path, sync=False)
    log.assign(1, [10, 11])
    log.commit()
    log.close()
    good = path.read_bytes()
    bad = b"\x09junk"  # an unknown record type, CRC-valid
    path.write_bytes(good + frame(bad) + bad)
    again = FlowLog(path, sync=False)
    try:
        assert again.assigned == {1: 10, 2: 11} and again.next_seq == 3
        assert again.torn == 1 and path.read_bytes() == good
    finally:
        again.close()
