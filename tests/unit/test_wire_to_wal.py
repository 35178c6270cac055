"""wire_to_wal (zio_spark.codec.records): an Arrow DAT's records as the spool's WAL
columns, taken by name. No sockets."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zio_spark.codec.records import decode_batch, encode_records, wire_to_wal
from zio_spark.codec.schema import WAL_SCHEMA, WIRE_SCHEMA
from zio_spark.errors import LocalProtocolError
from zio_spark.storage.spool import Spool

TS = 1_700_000_000_000_000


def _wire(first: int, values: list[bytes], **kw: object) -> pa.RecordBatch:
    return decode_batch(encode_records(first, values, **kw))  # type: ignore[arg-type]


def test_each_wal_column_comes_from_the_wire_column_of_its_name() -> None:
    wire = _wire(5, [b"a", b"b"], keys=[b"k", None], granules=[7, None], headers=[{"h": "1"}, None])
    wal = wire_to_wal(wire, origin=42, timestamp_us=TS)
    assert wal.schema.equals(WAL_SCHEMA)
    assert wal.column("seq").to_pylist() == [5, 6]
    assert wal.column("value").to_pylist() == [b"a", b"b"]
    assert wal.column("key").to_pylist() == [b"k", None]
    assert wal.column("granule").to_pylist() == [7, 0]  # a null granule reads as 0
    assert wal.column("origin").to_pylist() == [42, 42]
    assert [t.value for t in wal.column("timestamp")] == [TS, TS]
    assert wal.column("headers").to_pylist() == [[("h", "1")], None]


def test_a_uint64_origin_is_stored_as_its_int64_twos_complement() -> None:
    wal = wire_to_wal(_wire(1, [b"x"]), origin=(1 << 64) - 1, timestamp_us=TS)
    assert wal.column("origin").to_pylist() == [-1]
    wal = wire_to_wal(_wire(1, [b"x"]), origin=1 << 63, timestamp_us=TS)
    assert wal.column("origin").to_pylist() == [-(1 << 63)]


def test_a_batch_of_another_schema_is_refused_naming_it() -> None:
    wire = _wire(1, [b"x"])
    reordered = wire.select(["value", "seq", "key", "granule", "headers"])
    with pytest.raises(LocalProtocolError) as e:
        wire_to_wal(reordered, origin=0, timestamp_us=TS)
    assert e.value.field == "schema"


@pytest.mark.parametrize("origin", [1 << 64, -(1 << 63) - 1])
def test_an_origin_outside_uint64_and_int64_is_refused(origin: int) -> None:
    with pytest.raises(LocalProtocolError) as e:
        wire_to_wal(_wire(1, [b"x"]), origin=origin, timestamp_us=TS)
    assert (e.value.field, e.value.value) == ("origin", origin)


def test_the_spool_takes_it_and_drops_what_it_holds(tmp_path: Path) -> None:
    with Spool(tmp_path / "s", sync=False) as spool:
        assert (
            spool.append_batch("p", wire_to_wal(_wire(1, [b"a", b"b"]), origin=1, timestamp_us=TS))
            == 2
        )
        # A resend overlapping what is held: the spool drops the duplicates, once.
        again = wire_to_wal(_wire(2, [b"b", b"c"]), origin=1, timestamp_us=TS)
        assert spool.append_batch("p", again) == 1
        assert spool.stats.duplicates == 1
        ends = spool.seal()
        rows = [
            b for batch in spool.read("p", 1, ends["p"]) for b in batch.column("value").to_pylist()
        ]
    assert rows == [b"a", b"b", b"c"]


_record = st.tuples(
    st.binary(max_size=20),
    st.none() | st.binary(max_size=8),
    st.none() | st.integers(-(1 << 63), (1 << 63) - 1),
    st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(
    first=st.integers(1, 1 << 40),
    records=st.lists(_record, min_size=1, max_size=30),
    origin=st.integers(0, (1 << 64) - 1),
    ts=st.integers(0, 1 << 52),
)
def test_every_record_keeps_its_fields(
    first: int,
    records: list[tuple[bytes, bytes | None, int | None, dict[str, str] | None]],
    origin: int,
    ts: int,
) -> None:
    values, keys, granules, headers = (list(c) for c in zip(*records, strict=True))
    wire = _wire(first, values, keys=keys, granules=granules, headers=headers)
    assert wire.schema.equals(WIRE_SCHEMA)
    wal = wire_to_wal(wire, origin=origin, timestamp_us=ts)
    n = len(records)
    assert wal.num_rows == n
    assert wal.column("seq").to_pylist() == list(range(first, first + n))
    assert wal.column("value").to_pylist() == values
    assert wal.column("key").to_pylist() == keys
    assert wal.column("granule").to_pylist() == [0 if g is None else g for g in granules]
    assert [o & ((1 << 64) - 1) for o in wal.column("origin").to_pylist()] == [origin] * n
    assert [t.value for t in wal.column("timestamp")] == [ts] * n
    got = [None if h is None else dict(h) for h in wal.column("headers").to_pylist()]
    assert got == headers
