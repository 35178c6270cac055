"""The record codecs (zio_spark.codec.records): the one Arrow DAT codec for both schemas,
and the one plain-record reading the source and the sink share. No sockets."""

from __future__ import annotations

import contextlib
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.codec.records import (
    PlainRecord,
    decode_batch,
    decode_payload,
    decode_plain,
    decode_stream,
    encode_payload,
    encode_records,
    encode_stream,
    plain_attrs,
)
from zio_spark.codec.schema import (
    DEFAULT_SCHEMA,
    SINK_SCHEMA,
    SPARK_SCHEMA,
    SPARK_TYPES,
    WAL_SCHEMA,
    WIRE_SCHEMA,
)
from zio_spark.errors import LocalProtocolError, RemoteProtocolError
from zio_spark.protocol.message import join_single


def _sink_batch(values: list[bytes]) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(values, pa.binary()),
            pa.array([b"k"] * n, pa.binary()),
            pa.array([[("h", "v")]] * n, SINK_SCHEMA.field("headers").type),
        ],
        schema=SINK_SCHEMA,
    )


# ---------------------------------------------------------------------------- schemas


def test_the_spark_columns_are_written_once() -> None:
    assert DEFAULT_SCHEMA == (
        "value binary, key binary, producer string, seq bigint, origin bigint, granule bigint, "
        "timestamp timestamp, headers map<string,string>"
    )
    assert list(SPARK_TYPES) == SPARK_SCHEMA.names
    assert WAL_SCHEMA.names == [n for n in SPARK_SCHEMA.names if n != "producer"]


# ------------------------------------------------------------------------- Arrow DATs


def test_one_arrow_codec_for_both_schemas() -> None:
    wire = encode_records(5, [b"a", b"b"], keys=[b"k", None], headers=[{"h": "1"}, None])
    batch = decode_batch(wire, expected_first=5)
    assert batch.schema.equals(WIRE_SCHEMA)
    assert batch.column("seq").to_pylist() == [5, 6]
    assert batch.column("key").to_pylist() == [b"k", None]
    sink = _sink_batch([b"x", b"y"])
    (back,) = decode_payload(encode_payload(sink))
    assert back.equals(sink)
    # The same bytes an Arrow stream writer makes, read by any Arrow reader.
    out = pa.BufferOutputStream()
    with pa.ipc.new_stream(out, SINK_SCHEMA) as w:
        w.write_batch(sink)
    assert encode_payload(sink) == out.getvalue().to_pybytes()


def test_a_batch_of_another_schema_is_refused_locally() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_payload(decode_batch(encode_records(1, [b"a"])))
    assert info.value.field == "schema"
    with pytest.raises(LocalProtocolError):
        encode_stream(_sink_batch([b"a"]), WIRE_SCHEMA)


def test_remote_arrow_garbage_names_the_field() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_payload(b"not arrow")
    assert info.value.field == "payload"
    with pytest.raises(RemoteProtocolError) as info:
        decode_payload(encode_records(1, [b"a"]))
    assert info.value.field == "schema"
    # The wire wants exactly one batch, checked before the schema.
    empty = pa.BufferOutputStream()
    with pa.ipc.new_stream(empty, SINK_SCHEMA):
        pass
    with pytest.raises(RemoteProtocolError, match="exactly one record batch") as info:
        decode_batch(empty.getvalue().to_pybytes())
    assert info.value.field == "payload"
    assert decode_stream(empty.getvalue().to_pybytes(), SINK_SCHEMA) == []


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arrow_garbage_raises_only_remote_protocol_error(data: bytes) -> None:
    for decode in (decode_payload, decode_batch):
        with contextlib.suppress(RemoteProtocolError):
            decode(data)


# ---------------------------------------------------------------------- plain records


def test_plain_record_rules() -> None:
    assert decode_plain((b"v",), {}) == PlainRecord(b"v", None, None)
    assert decode_plain((), {}) == PlainRecord(b"", None, None)
    # key: base64 text; headers: an object, flattened; foreign attributes: headers.
    got = decode_plain((b"v",), {"key": "a2V5", "headers": {"h": "1", "n": 2}, "unit": "mV"})
    assert got == PlainRecord(b"v", b"key", {"h": "1", "n": "2", "unit": "mV"})
    # What does not fit is kept, as text, under its own name.
    odd = decode_plain((b"v",), {"key": "not base64!", "headers": [1], "x": None})
    assert odd == PlainRecord(b"v", None, {"key": "not base64!", "headers": "[1]", "x": "null"})
    assert decode_plain((b"v",), {"key": 5}).headers == {"key": "5"}
    # Several frames stay whole, in czmq's framing, counted in zio.frames.
    multi = decode_plain((b"a", b"bc"), {})
    assert multi == PlainRecord(join_single((b"a", b"bc")), None, {"zio.frames": "2"})


def test_plain_attrs_round_trip() -> None:
    assert plain_attrs(None, None) == {}
    assert plain_attrs(None, {}) == {}
    attrs = plain_attrs(b"\x00\xff", {"h": "v"}, {"seq": 3})
    assert attrs == {"seq": 3, "key": "AP8=", "headers": {"h": "v"}}
    assert decode_plain((b"v",), plain_attrs(b"\x00\xff", {"h": "v"})) == PlainRecord(
        b"v", b"\x00\xff", {"h": "v"}
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(max_size=20), max_size=4),
    st.dictionaries(st.sampled_from(["key", "headers", "x"]) | st.text(max_size=5), json_values),
)
def test_any_plain_dat_becomes_a_record(payload: list[bytes], attrs: dict[str, Any]) -> None:
    rec = decode_plain(tuple(payload), attrs)
    assert isinstance(rec.value, bytes)
    assert rec.headers is None or all(
        isinstance(k, str) and isinstance(v, str) for k, v in rec.headers.items()
    )
