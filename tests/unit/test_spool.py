"""The spool (zio_spark.storage.spool): durable, replayable per-producer log.

Everything runs under ``tmp_path``; nothing sleeps. The crash test kills a real child
process with SIGKILL right after its flush returned. The property test drives random
append/flush/seal/commit/read/reopen sequences against a list-per-producer model.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zio_spark.errors import ConfigError, DataLossError
from zio_spark.storage.spool import (
    SPARK_SCHEMA,
    CorruptSegmentError,
    MissingRangeError,
    Record,
    SequenceGapError,
    Spool,
    SpoolLockedError,
    SpoolPathError,
    project,
    read_sealed,
)

REPO = Path(__file__).resolve().parents[2]


def recs(start: int, stop: int, tag: str = "v") -> list[Record]:
    """Records start..stop-1 with values that name their seq (and a tag)."""
    return [Record(i, f"{tag}{i}".encode(), None, i, i, i, None) for i in range(start, stop)]


def seqs(batches: Any) -> list[int]:
    return [s for b in batches for s in b.column("seq").to_pylist()]


def values(batches: Any) -> list[bytes]:
    return [v for b in batches for v in b.column("value").to_pylist()]


def wal_files(path: Path) -> list[Path]:
    return sorted((path / "wal").glob("*.wal"))


def segment_files(path: Path) -> list[Path]:
    return sorted((path / "producers").glob("*/*.arrow"))


@contextlib.contextmanager
def spool_of_p(path: Path, stop: int, *, seal: bool = False) -> Iterator[tuple[Spool, Path]]:
    """A Spool at ``path`` with producer p's records 1..stop-1 flushed to its WAL (sealed,
    with ``seal``), and the one WAL file (segment) that holds them; closed on exit."""
    with Spool(path) as sp:
        sp.append("p", recs(1, stop))
        if seal:
            sp.seal()
            (held,) = segment_files(path)
        else:
            sp.flush()
            (held,) = wal_files(path)
        yield sp, held


@pytest.fixture
def spool(tmp_path: Path) -> Any:
    sp = Spool(tmp_path / "spool")
    yield sp
    sp.close()


# -- round trip, schema ------------------------------------------------------------------


def test_round_trip_exact_values(tmp_path: Path) -> None:
    path = tmp_path / "s"
    rows = [
        Record(1, b"one", b"k1", 7, 8, 1_700_000_000_000_001, {"a": "1", "b": "2"}),
        Record(2, b"", None, 0, 0, 0, None),
        Record(3, b"\x00\xff" * 50, b"", 2**64 - 1, 2**63, 1_700_000_000_000_003, {}),
    ]
    with Spool(path) as sp:
        assert sp.append("prod", rows) == 3
        sp.flush()
        assert sp.end_offsets() == {}  # nothing sealed yet: offsets cover no unsealed data
        assert sp.seal() == {"prod": 4}
        got = list(sp.read("prod", 1, 4))
    table = pa.Table.from_batches(got)
    assert table.to_pylist() == [
        {
            "value": b"one",
            "key": b"k1",
            "producer": "prod",
            "seq": 1,
            "origin": 7,
            "granule": 8,
            "timestamp": datetime(2023, 11, 14, 22, 13, 20, 1, tzinfo=timezone.utc),
            "headers": [("a", "1"), ("b", "2")],
        },
        {
            "value": b"",
            "key": None,
            "producer": "prod",
            "seq": 2,
            "origin": 0,
            "granule": 0,
            "timestamp": datetime(1970, 1, 1, tzinfo=timezone.utc),
            "headers": None,
        },
        {
            "value": b"\x00\xff" * 50,
            "key": b"",
            "producer": "prod",
            "seq": 3,
            "origin": -1,  # uint64 2**64-1 as two's complement
            "granule": -(2**63),
            "timestamp": datetime(2023, 11, 14, 22, 13, 20, 3, tzinfo=timezone.utc),
            "headers": [],
        },
    ]


def test_schema_is_exactly_sparks(spool: Spool) -> None:
    types = pytest.importorskip("pyspark.sql.types")
    pandas_types = pytest.importorskip("pyspark.sql.pandas.types")
    spark = types.StructType(
        [
            types.StructField("value", types.BinaryType()),
            types.StructField("key", types.BinaryType()),
            types.StructField("producer", types.StringType()),
            types.StructField("seq", types.LongType()),
            types.StructField("origin", types.LongType()),
            types.StructField("granule", types.LongType()),
            types.StructField("timestamp", types.TimestampType()),
            types.StructField("headers", types.MapType(types.StringType(), types.StringType())),
        ]
    )
    expected = pandas_types.to_arrow_schema(spark, timezone="UTC")
    assert expected.equals(SPARK_SCHEMA, check_metadata=True)
    spool.append("p", [*recs(1, 5), Record(5, b"h", headers={"x": "y"})])
    spool.seal()
    batches = list(spool.read("p", 1, 6, max_rows_per_batch=2))
    assert len(batches) == 3
    for b in batches:
        assert b.schema.equals(expected, check_metadata=True)
        assert b.schema.metadata is None


def test_uint64_origin_and_granule_never_crash(spool: Spool) -> None:
    rows = [
        Record(1, b"a", origin=2**63, granule=2**64 - 1),
        Record(2, b"b", origin=2**63 - 1, granule=-5),
        Record(3, b"c", origin=None, granule=2**63 + 7),  # type: ignore[arg-type]
    ]
    assert spool.append("p", rows) == 3
    spool.seal()
    t = pa.Table.from_batches(spool.read("p", 1, 4))
    assert t.column("origin").to_pylist() == [-(2**63), 2**63 - 1, None]
    assert t.column("granule").to_pylist() == [-1, -5, 2**63 + 7 - 2**64]
    assert [v & (2**64 - 1) for v in t.column("granule").to_pylist()] == [
        2**64 - 1,
        2**64 - 5,
        2**63 + 7,
    ]
    with pytest.raises(ValueError, match="origin"):
        spool.append("p", [Record(4, b"d", origin=2**64)])
    with pytest.raises(ValueError, match="granule"):
        spool.append("p", [Record(4, b"d", granule=-(2**63) - 1)])
    assert spool.next_seq("p") == 4  # the rejected appends stored nothing


def test_malformed_records_store_nothing(spool: Spool) -> None:
    with pytest.raises(ValueError, match="7 fields"):
        spool.append("p", [Record(1, b"a"), (2, b"b")])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        spool.append("p", [Record(1, 123)])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        spool.append("p", [Record("1", b"a")])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        spool.append("p", [Record(1, b"a", headers={"k": 1})])  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        spool.append(b"p", recs(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="UTF-8"):
        spool.append("bad\udc80", recs(1, 2))
    assert spool.append("p", []) == 0
    assert spool.next_seq("p") == 1
    assert spool.stats.appended == 0


def test_project_selects_a_subset(spool: Spool) -> None:
    spool.append("p", recs(1, 4))
    spool.seal()
    (batch,) = spool.read("p", 1, 4)
    sub = project(batch, ["seq", "value"])
    assert sub.schema.names == ["seq", "value"]
    assert sub.schema.field("seq").type == pa.int64()
    assert sub.column("seq").to_pylist() == [1, 2, 3]
    with pytest.raises(ConfigError, match="nope"):
        project(batch, ["value", "nope"])
    with pytest.raises(ConfigError):
        project(batch, ["value", "value"])


# -- sequence numbers --------------------------------------------------------------------


def test_duplicates_are_dropped_and_counted(spool: Spool) -> None:
    assert spool.append("p", recs(1, 4)) == 3
    assert spool.append("p", recs(2, 6, tag="again")) == 2  # 2, 3 are resends
    assert spool.append("p", recs(1, 6, tag="again")) == 0
    assert spool.append("p", [*recs(6, 7), *recs(6, 8, tag="x")]) == 2  # dup inside a batch
    assert spool.stats.duplicates == 2 + 5 + 1
    assert spool.stats.appended == 7
    spool.seal()
    assert values(spool.read("p", 1, 8)) == [
        b"v1",
        b"v2",
        b"v3",
        b"again4",
        b"again5",
        b"v6",
        b"x7",
    ]


def test_gap_raises_and_stores_nothing(spool: Spool) -> None:
    spool.append("p", recs(1, 3))
    with pytest.raises(SequenceGapError) as info:
        spool.append("p", [*recs(3, 4), *recs(5, 6)])
    err = info.value
    assert isinstance(err, DataLossError)
    assert isinstance(err, ValueError)
    assert (err.producer, err.expected, err.got) == ("p", 4, 5)
    assert spool.next_seq("p") == 3  # seq 3, before the gap, was not stored either
    assert spool.append("p", recs(3, 5)) == 2
    assert spool.stats.gaps == 0


def test_gap_accepted_is_a_known_hole(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Spool(path, on_gap="accept") as sp:
        assert sp.append("p", recs(1, 3)) == 2
        assert sp.seal() == {"p": 3}
        assert sp.append("p", [*recs(5, 7), *recs(9, 10)]) == 3
        assert sp.stats.gaps == 2
        assert sp.seal() == {"p": 10}
        assert seqs(sp.read("p", 1, 10)) == [1, 2, 5, 6, 9]
        assert seqs(sp.read("p", 3, 5)) == []  # the hole itself: covered, empty, no loss
        assert sp.backlog() == {"p": 5}
        sp.commit({"p": 4})  # inside the hole: the first segment goes
        assert sp.start_offsets() == {"p": 3}  # the second segment covers from 3
        assert sp.backlog() == {"p": 3}
        assert seqs(sp.read("p", 3, 10)) == [5, 6, 9]
        sp.commit({"p": 6})
        assert sp.backlog() == {"p": 2}  # counted from the file: 6 and 9
    with Spool(path, on_gap="accept") as sp:
        assert sp.start_offsets() == {"p": 3}
        assert sp.backlog() == {"p": 2}
        assert seqs(sp.read("p", 3, 10)) == [5, 6, 9]
    assert seqs(read_sealed(path, "p", 3, 10)) == [5, 6, 9]


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="on_gap"):
        Spool("/nonexistent", on_gap="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="segment_batch_rows"):
        Spool("/nonexistent", segment_batch_rows=0)


# -- reads -------------------------------------------------------------------------------


def test_read_spans_segments_and_partial_segments(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Spool(path, segment_batch_rows=4) as sp:
        for start in range(1, 31, 10):  # segments 1-10, 11-20, 21-30
            sp.append("p", recs(start, start + 5))
            sp.append("p", recs(start + 5, start + 10))
            sp.seal()
        assert len(segment_files(path)) == 3
        for lo, hi in [(1, 31), (7, 26), (10, 12), (11, 21), (20, 21), (1, 2), (30, 31), (5, 5)]:
            got = list(sp.read("p", lo, hi, max_rows_per_batch=3))
            assert seqs(got) == list(range(lo, hi)), (lo, hi)
            assert values(got) == [f"v{i}".encode() for i in range(lo, hi)]
            assert all(0 < b.num_rows <= 3 for b in got)
            assert seqs(read_sealed(path, "p", lo, hi, max_rows_per_batch=3)) == seqs(got)
    with pytest.raises(ValueError):
        next(iter(read_sealed(path, "p", 5, 4)))
    with pytest.raises(ValueError):
        read_sealed(path, "p", 1, 4, max_rows_per_batch=0)


def test_reread_is_bytes_identical(tmp_path: Path) -> None:
    path = tmp_path / "s"

    def snapshot(batches: Any) -> list[bytes]:
        return [b.serialize().to_pybytes() for b in batches]

    with Spool(path, segment_batch_rows=7) as sp:
        sp.append(
            "p",
            [Record(i, os.urandom(i % 13), None, i, -i, i, {"i": str(i)}) for i in range(1, 40)],
        )
        sp.seal()
        sp.append("p", recs(40, 50))
        sp.seal()
        first = snapshot(sp.read("p", 3, 47, max_rows_per_batch=5))
        assert first == snapshot(sp.read("p", 3, 47, max_rows_per_batch=5))
    with Spool(path) as sp:
        assert first == snapshot(sp.read("p", 3, 47, max_rows_per_batch=5))
    assert first == snapshot(read_sealed(path, "p", 3, 47, max_rows_per_batch=5))


def test_unsealed_and_unknown_ranges_are_data_loss(spool: Spool) -> None:
    spool.append("p", recs(1, 6))
    with pytest.raises(MissingRangeError) as info:
        spool.read("p", 1, 3)  # appended and flushed is not enough: not sealed
    assert (info.value.producer, info.value.start, info.value.end) == ("p", 1, 3)
    assert info.value.reason == "unsealed"
    spool.seal()
    spool.append("p", recs(6, 9))
    with pytest.raises(MissingRangeError) as info:
        spool.read("p", 4, 8)
    assert (info.value.start, info.value.end, info.value.reason) == (6, 8, "unsealed")
    assert "'p'" in str(info.value) and "[6, 8)" in str(info.value)
    with pytest.raises(MissingRangeError) as info:
        spool.read("ghost", 1, 2)
    assert info.value.producer == "ghost"
    assert list(spool.read("ghost", 1, 1)) == []
    with pytest.raises(MissingRangeError):
        read_sealed(spool.path, "ghost", 1, 2)
    with pytest.raises(MissingRangeError) as info:
        read_sealed(spool.path, "p", 3, 8)
    assert (info.value.start, info.value.end) == (6, 8)


# -- commit ------------------------------------------------------------------------------


def test_commit_deletes_only_fully_committed_segments(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Spool(path) as sp:
        for start in (1, 11, 21):
            sp.append("p", recs(start, start + 10))
            sp.seal()
        sp.append("q", recs(1, 4))
        sp.seal()
        names = [f.name for f in segment_files(path)]
        assert len(names) == 4
        sp.commit({"p": 15})
        assert not any(n.startswith(f"{1:020d}-") for n in _segment_names(path, "p"))
        assert len(_segment_names(path, "p")) == 2
        assert sp.start_offsets() == {"p": 11, "q": 1}
        assert sp.backlog() == {"p": 16, "q": 3}
        assert seqs(sp.read("p", 11, 31)) == list(range(11, 31))  # 11..14 still readable
        with pytest.raises(MissingRangeError) as info:
            sp.read("p", 5, 31)
        assert (info.value.start, info.value.end, info.value.reason) == (5, 11, "deleted")
        with pytest.raises(MissingRangeError):
            read_sealed(path, "p", 5, 12)
        # Late, repeated, lower, out-of-order, unknown and empty commits.
        sp.commit({"p": 15})
        sp.commit({"p": 3, "q": 1})
        sp.commit({})
        sp.commit({"ghost": 7, "p": 12})
        assert sp.committed() == {"ghost": 7, "p": 15}
        assert len(_segment_names(path, "p")) == 2
        assert sp.stats.segments_deleted == 1
        sp.commit({"p": 21})  # 11-20 goes: its last seq 20 < 21
        assert len(_segment_names(path, "p")) == 1
        sp.commit({"p": 31, "q": 4})
        assert _segment_names(path, "p") == [] and _segment_names(path, "q") == []
        assert sp.end_offsets() == {"ghost": 7, "p": 31, "q": 4}
        assert sp.start_offsets() == {"ghost": 7, "p": 31, "q": 4}
        assert sp.backlog() == {"ghost": 0, "p": 0, "q": 0}
        assert list(sp.read("p", 31, 31)) == []
        assert sp.next_seq("ghost") == 7
    with Spool(path) as sp:  # committed offsets survive; so do the ends and the floor
        assert sp.committed() == {"ghost": 7, "p": 31, "q": 4}
        assert sp.end_offsets() == {"ghost": 7, "p": 31, "q": 4}
        assert sp.next_seq("p") == 31
        assert sp.append("p", recs(25, 33)) == 2  # below 31: already consumed
        assert sp.append("ghost", recs(1, 9)) == 2
        assert sp.seal() == {"ghost": 9, "p": 33, "q": 4}
        assert seqs(sp.read("ghost", 7, 9)) == [7, 8]


def _segment_names(path: Path, producer: str) -> list[str]:
    folder = path / "producers" / ("p" + producer.encode().hex())
    return sorted(f.name for f in folder.glob("*.arrow"))


def test_commit_rejects_bad_offsets(spool: Spool) -> None:
    with pytest.raises(ValueError):
        spool.commit({"p": -1})
    with pytest.raises(ValueError):
        spool.commit({"p": "3"})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        spool.commit({3: 3})  # type: ignore[dict-item]
    assert spool.committed() == {}


def test_commit_beyond_sealed_end(spool: Spool) -> None:
    spool.append("p", recs(1, 4))
    spool.seal()
    spool.append("p", recs(4, 10))
    spool.commit({"p": 7})  # from a checkpoint newer than this spool's seals
    assert spool.end_offsets() == {"p": 7}
    assert spool.next_seq("p") == 10
    assert spool.seal() == {"p": 10}
    assert seqs(spool.read("p", 7, 10)) == [7, 8, 9]  # 4..6 were dropped at seal
    assert spool.backlog() == {"p": 3}


def test_backlog_counts_sealed_and_open_tail(spool: Spool) -> None:
    assert spool.backlog() == {}
    spool.append("p", recs(1, 11))
    spool.seal()
    spool.append("p", recs(11, 16))
    spool.append("q", recs(1, 3))
    assert spool.backlog() == {"p": 15, "q": 2}
    spool.commit({"p": 8})
    assert spool.backlog() == {"p": 8, "q": 2}
    spool.seal()
    assert spool.backlog() == {"p": 8, "q": 2}


# -- recovery ----------------------------------------------------------------------------


def test_reopen_recovers_segments_and_wal_tail(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Spool(path) as sp:
        sp.append("p", recs(1, 11))
        sp.append("q", recs(1, 3))
        sp.seal()
        sp.append("p", recs(11, 16))
        sp.append("r", recs(1, 4))
        sp.flush()
    with Spool(path) as sp:
        assert sp.end_offsets() == {"p": 11, "q": 3}  # r has unsealed records only
        assert sp.backlog() == {"p": 15, "q": 2, "r": 3}
        assert sp.next_seq("p") == 16
        assert sp.stats.wal_records_replayed == 2
        assert sp.append("p", recs(14, 18)) == 2
        assert sp.seal() == {"p": 18, "q": 3, "r": 4}
        assert values(sp.read("p", 1, 18)) == [f"v{i}".encode() for i in range(1, 18)]
        assert len(wal_files(path)) == 1  # the old generations are gone after the seal
    with Spool(path) as sp:
        assert sp.backlog() == {"p": 17, "q": 2, "r": 3}
        assert sp.stats.wal_records_replayed == 0


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_torn_wal_tail_is_ignored_and_counted(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "s"
    with spool_of_p(path, 6) as (sp, wal):
        good = wal.stat().st_size
        sp.append("p", recs(6, 11))
        sp.flush()
    full = wal.stat().st_size
    if damage == "truncate":
        os.truncate(wal, good + (full - good) // 2)
    else:
        with open(wal, "r+b") as f:
            f.seek(full - 20)
            byte = f.read(1)
            f.seek(full - 20)
            f.write(bytes([byte[0] ^ 0x40]))
    with Spool(path) as sp:
        assert sp.stats.torn_wal_records == 1
        assert sp.next_seq("p") == 6  # the earlier record is kept
        assert sp.seal() == {"p": 6}
        assert values(sp.read("p", 1, 6)) == [f"v{i}".encode() for i in range(1, 6)]
        assert sp.append("p", recs(6, 8, tag="resent")) == 2  # the producer resends
        sp.seal()
        assert values(sp.read("p", 5, 8)) == [b"v5", b"resent6", b"resent7"]


def test_wal_record_after_a_lost_one_is_skipped(tmp_path: Path) -> None:
    """A record whose predecessor is lost must not be accepted with a hole."""
    path = tmp_path / "s"
    with Spool(path) as sp:
        sp.append("p", recs(1, 3))
        sp.append("q", recs(1, 3))
        sp.flush()
        (old,) = wal_files(path)
    saved = old.read_bytes()
    with Spool(path) as sp:  # a new generation; p's records 1-2 live in the old one
        sp.append("p", recs(3, 5))
        sp.flush()
    old.write_bytes(saved[: len(saved) // 4])  # p's first record torn in the old file
    with Spool(path) as sp:
        assert sp.stats.torn_wal_records == 1
        assert sp.stats.wal_records_skipped == 1  # p 3-4: covers_from 3 > next 1
        assert sp.next_seq("p") == 1
        assert sp.next_seq("q") == 1


def test_damage_inside_a_wal_file_resumes_at_the_next_valid_record(tmp_path: Path) -> None:
    """Valid records after a damaged one: not a torn tail. Those of producers that lost
    nothing are kept; the damaged producer's later records are skipped (no hole)."""
    path = tmp_path / "s"
    with Spool(path) as sp:
        sp.append("p", recs(1, 3))
        (wal,) = wal_files(path)
        p_end = wal.stat().st_size
        sp.append("q", recs(1, 3))
        sp.append("p", recs(3, 5))
        sp.flush()
    data = bytearray(wal.read_bytes())
    data[p_end - 30] ^= 0x10  # inside p's first record: its CRC no longer matches
    wal.write_bytes(bytes(data))
    with Spool(path) as sp:
        assert sp.stats.torn_wal_records == 1
        assert sp.stats.wal_records_skipped == 1  # p 3-4: covers_from 3 > next 1
        assert sp.next_seq("p") == 1
        assert sp.next_seq("q") == 3  # kept, where a plain truncation would drop it
        assert sp.seal() == {"q": 3}
        assert values(sp.read("q", 1, 3)) == [b"v1", b"v2"]


def test_crc_valid_undecodable_wal_tail_is_torn(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with spool_of_p(path, 3) as (_, wal):
        good = wal.read_bytes()
    payload = bytes(40)  # covers_from 0, an empty id, then no Arrow message at all
    header = struct.pack("<4sIII", b"ZSW1", len(payload), zlib.crc32(payload), 0)
    wal.write_bytes(good + header + payload)
    with Spool(path) as sp:
        assert sp.stats.torn_wal_records == 1
        assert sp.next_seq("p") == 3


def test_corrupt_segment_is_reported_by_read_and_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with spool_of_p(path, 11, seal=True) as (sp, segment):
        original = segment.read_bytes()
        segment.write_bytes(original[: len(original) // 2])  # the disk lost the rest
        with pytest.raises(CorruptSegmentError) as err:
            list(sp.read("p", 1, 11))
        assert (err.value.path, err.value.field, err.value.producer) == (segment, "file", "p")
        with pytest.raises(DataLossError):
            list(read_sealed(path, "p", 5, 6))
    with pytest.raises(CorruptSegmentError, match="not a readable Arrow IPC file"):
        Spool(path)
    segment.write_bytes(original)
    with Spool(path) as sp:
        assert seqs(sp.read("p", 1, 11)) == list(range(1, 11))


def test_wal_left_over_by_a_crash_during_seal_is_harmless(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with spool_of_p(path, 6) as (sp, wal):
        saved = wal.read_bytes()
        sp.seal()
        assert not wal.exists()
    wal.write_bytes(saved)  # as if the process died between the segment's rename and unlink
    leftover = path / "producers" / ("p" + b"p".hex()) / ".00000000000000000006-x.arrow.tmp"
    leftover.write_bytes(b"half a segment")
    with Spool(path) as sp:
        assert not leftover.exists()
        assert sp.backlog() == {"p": 5}
        assert sp.next_seq("p") == 6
        assert sp.seal() == {"p": 6}
        assert len(segment_files(path)) == 1
        assert seqs(sp.read("p", 1, 6)) == [1, 2, 3, 4, 5]


def test_commit_cut_short_is_finished_on_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Spool(path) as sp:
        for start in (1, 11):
            sp.append("p", recs(start, start + 10))
            sp.seal()
        first = segment_files(path)[0]
        saved = first.read_bytes()
        sp.commit({"p": 11})
        assert not first.exists()
    first.write_bytes(saved)  # as if the process died after committed.json, before unlink
    with Spool(path) as sp:
        assert not first.exists()
        assert sp.start_offsets() == {"p": 11}
        assert sp.backlog() == {"p": 10}
        assert sp.stats.segments_deleted == 1


CHILD = r"""
import sys
from zio_spark.storage.spool import Record, Spool

path, n = sys.argv[1], int(sys.argv[2])
sp = Spool(path)
for start in range(1, n + 1, 250):
    stop = min(start + 250, n + 1)
    sp.append("crash/ü", [Record(i, b"v%d" % i, None, i, i, i, None) for i in range(start, stop)])
    if start == 501:
        sp.seal()  # some records sealed, the rest only in the WAL
sp.flush()
sp.append("crash/ü", [Record(n + 1, b"not flushed")])  # may or may not survive
print("flushed", flush=True)
sys.stdin.read()  # block until killed
"""


def test_flushed_records_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "s"
    n = 2000
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "child did not report"
        line = proc.stdout.readline()
        assert line == b"flushed\n", proc.stderr.read() if proc.stderr else line
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    with Spool(path) as sp:
        end = sp.seal()["crash/ü"]
        assert end in (n + 1, n + 2)
        got = list(sp.read("crash/ü", 1, n + 1))
        assert seqs(got) == list(range(1, n + 1))
        assert values(got) == [b"v%d" % i for i in range(1, n + 1)]
        assert pa.Table.from_batches(got).column("origin").to_pylist() == list(range(1, n + 1))


# -- producers, locking, threads ---------------------------------------------------------


@pytest.mark.parametrize(
    "producer",
    ["a/b", "../../etc", "ünï/çødé 🚀", "", "nul\x00byte", "C:\\x", "x" * 300, "ab", "AB"],
)
def test_odd_producer_ids(tmp_path: Path, producer: str) -> None:
    path = tmp_path / "s"
    with Spool(path) as sp:
        sp.append(producer, recs(1, 4))
        sp.append("ab", recs(1, 2, tag="other"))  # a neighbour that must not collide
        sp.seal()
    for entry in (path / "producers").iterdir():
        assert entry.parent == path / "producers"
        assert len(entry.name) <= 65
    with Spool(path) as sp:
        ends = sp.end_offsets()
        assert ends[producer] == 4  # for "ab" itself the neighbour's append was resends
        got = list(sp.read(producer, 1, ends[producer]))
        assert pa.Table.from_batches(got).column("producer").to_pylist() == [producer] * len(
            seqs(got)
        )
    assert seqs(read_sealed(path, producer, 1, ends[producer])) == seqs(got)


def test_second_open_of_a_folder_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    sp = Spool(path)
    with pytest.raises(SpoolLockedError) as e:
        Spool(path)  # two queries given one spoolPath
    assert isinstance(e.value, ConfigError)
    assert (e.value.option, e.value.value) == ("spoolPath", str(path))
    text = str(e.value)
    assert text.startswith(f"option 'spoolPath': got {str(path)!r}, expected ")
    assert "give each query its own spoolPath, or stop the query that uses it" in text
    sp.close()
    sp.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        sp.append("p", recs(1, 2))
    Spool(path).close()


def _deny_writes_under(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make ``folder`` read-only for this process. Root ignores permission bits, so for
    root the kernel's answer is given instead: EACCES for creating anything under it."""
    folder.chmod(0o555)
    if os.geteuid() != 0:
        return
    real_open, real_mkdir = os.open, os.mkdir

    def denied(path: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def fake_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if str(path).startswith(str(folder)) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            denied(path)
        return real_open(path, flags, *args, **kw)

    def fake_mkdir(path: Any, *args: Any, **kw: Any) -> None:
        if str(path).startswith(str(folder)):
            denied(path)
        real_mkdir(path, *args, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


@pytest.mark.parametrize("where", ["the folder", "its parent"])
def test_a_read_only_spool_path_names_spoolpath_the_path_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder if where == "the folder" else folder / "spool"
    _deny_writes_under(monkeypatch, folder)
    try:
        with pytest.raises(SpoolPathError) as e:
            Spool(path)
    finally:
        monkeypatch.undo()
        folder.chmod(0o755)
    assert isinstance(e.value, ConfigError) and isinstance(e.value.__cause__, PermissionError)
    assert (e.value.option, e.value.value) == ("spoolPath", str(path))
    text = str(e.value)
    assert text.startswith(f"option 'spoolPath': got {str(path)!r}, expected ")
    assert "Permission denied" in text
    assert "set spoolPath to a folder this process may create and write" in text


def test_a_spool_path_through_a_file_names_spoolpath_and_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SpoolPathError) as e:
        Spool(blocker / "spool")
    assert (e.value.option, e.value.value) == ("spoolPath", str(blocker / "spool"))
    assert "Not a directory" in str(e.value) and "part of this path is a file" in str(e.value)
    with pytest.raises(SpoolPathError, match="part of this path is a file"):
        Spool(blocker)  # the path itself is a file


def test_receiver_and_runner_threads(tmp_path: Path) -> None:
    path = tmp_path / "s"
    total = 3000
    with Spool(path, sync=False) as sp:
        errors: list[BaseException] = []

        def receiver() -> None:
            try:
                for start in range(1, total + 1, 50):
                    sp.append("p", recs(start, start + 50))
                    sp.append("q", recs(start, start + 50))
                    sp.flush()
            except BaseException as e:  # surfaced by the assertion below
                errors.append(e)

        thread = threading.Thread(target=receiver)
        thread.start()
        start = {"p": 1, "q": 1}
        seen: dict[str, list[int]] = {"p": [], "q": []}
        while thread.is_alive() or any(sp.backlog().values()):
            ends = sp.seal()
            for producer, end in ends.items():
                seen[producer] += seqs(sp.read(producer, start[producer], end))
                start[producer] = end
            sp.commit(ends)
        thread.join()
        assert not errors
        for producer in ("p", "q"):
            assert seen[producer] == list(range(1, total + 1))
        assert segment_files(path) == []


# -- property test against a model -------------------------------------------------------

PRODUCERS = ["p", "a/ü"]
_examples = itertools.count()

# One flat tuple per step, (kind, producer, a, b, c); the kind list weights the steps
# (one_of would favour the simplest branch and starve appends).
OPS = st.tuples(
    st.sampled_from(["append"] * 4 + ["read"] * 3 + ["seal"] * 3 + ["flush", "commit", "reopen"]),
    st.sampled_from(PRODUCERS),
    st.integers(-3, 8),
    st.integers(0, 8),
    st.integers(1, 4),
)


class _Model:
    """A list per producer: what the spool must hold and return."""

    def __init__(self) -> None:
        self.p: dict[str, dict[str, Any]] = {}

    def get(self, name: str) -> dict[str, Any]:
        if name not in self.p:
            self.p[name] = {
                "next": 1,
                "end": 1,
                "committed": 1,
                "tail": [],
                "segs": [],
                "listed": False,
            }
        return self.p[name]

    def start(self, m: dict[str, Any]) -> int:
        return m["segs"][0][0] if m["segs"] else m["end"]

    def seal(self) -> dict[str, int]:
        for m in self.p.values():
            rows = [(s, v) for s, v in m["tail"] if s >= m["end"]]  # drops below a commit
            m["tail"] = []
            if rows:
                m["segs"].append((m["end"], rows))
                m["end"] = rows[-1][0] + 1
                m["listed"] = True
        return {n: m["end"] for n, m in sorted(self.p.items()) if m["listed"]}

    def backlog(self) -> dict[str, int]:
        out = {}
        for name, m in self.p.items():
            sealed = sum(1 for _, rs in m["segs"] for s, _ in rs if s >= m["committed"])
            if sealed + len(m["tail"]):
                out[name] = sealed + len(m["tail"])
        return out


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, min_size=5, max_size=50), on_gap=st.sampled_from(["raise", "accept"]))
def test_random_operations_match_the_model(
    tmp_path: Path, ops: list[tuple[Any, ...]], on_gap: str
) -> None:
    path = tmp_path / f"ex{next(_examples)}"
    model = _Model()
    sp = Spool(path, sync=False, on_gap=on_gap, segment_batch_rows=3)  # type: ignore[arg-type]
    try:
        for i, op in enumerate(ops):
            kind, name, a, b, c = op
            if kind == "append":
                m = model.get(name)
                first = m["next"] + (a if a <= 2 else 0)  # mostly in order; resends; gaps
                batch = [Record(s, f"{name}|{s}|{i}".encode()) for s in range(first, first + b + 1)]
                expect, keep, gap = m["next"], [], False
                for r in batch:
                    if r.seq < expect:
                        continue
                    gap = gap or r.seq > expect
                    keep.append((r.seq, r.value))
                    expect = r.seq + 1
                if gap:
                    event(f"append with a gap ({on_gap})")
                if gap and on_gap == "raise":
                    with pytest.raises(SequenceGapError):
                        sp.append(name, batch)
                else:
                    assert sp.append(name, batch) == len(keep)
                    m["tail"] += keep
                    m["next"] = expect
            elif kind == "flush":
                sp.flush()
            elif kind == "seal":
                assert sp.seal() == model.seal()
            elif kind == "commit":
                name = "ghost" if c == 4 else name
                m = model.get(name)
                offset = max(0, m["end"] + a - 6)
                sp.commit({name: offset})
                if offset > m["committed"]:
                    m["committed"] = offset
                    m["listed"] = True
                    if offset > m["end"]:
                        m["end"] = offset
                        m["next"] = max(m["next"], offset)
                    kept = [(c, rs) for c, rs in m["segs"] if rs[-1][0] >= offset]
                    if len(kept) < len(m["segs"]):
                        event("commit deletes segments")
                    m["segs"] = kept
            elif kind == "read":
                m = model.p.get(name)
                start, end = (model.start(m), m["end"]) if m else (1, 1)
                # Mostly inside [start, end], sometimes one past either side.
                lo = max(0, start - 1 + (a + 3) % (end - start + 3))
                hi = lo + b % (end - start + 3)
                max_rows = c
                segs = m["segs"] if m else []
                ok = lo == hi or (bool(segs) and segs[0][0] <= lo and hi <= segs[-1][1][-1][0] + 1)
                if ok:
                    want = [(s, v) for _, rs in segs for s, v in rs if lo <= s < hi]
                    event("read: records" if want else "read: empty")
                    got = list(sp.read(name, lo, hi, max_rows_per_batch=max_rows))
                    assert list(zip(seqs(got), values(got), strict=True)) == want
                    assert all(b.num_rows <= max_rows for b in got)
                    assert all(b.schema.equals(SPARK_SCHEMA, check_metadata=True) for b in got)
                    assert seqs(read_sealed(path, name, lo, hi)) == [s for s, _ in want]
                else:
                    event("read: data loss")
                    with pytest.raises(MissingRangeError):
                        sp.read(name, lo, hi)
            elif kind == "reopen":
                sp.close()
                sp = Spool(path, sync=False, on_gap=on_gap, segment_batch_rows=3)  # type: ignore[arg-type]
                for m in model.p.values():
                    m["tail"] = [(s, v) for s, v in m["tail"] if s >= m["end"]]
            # Invariants after every step.
            assert {k: v for k, v in sp.backlog().items() if v} == model.backlog()
            assert sp.end_offsets() == {
                n: m["end"] for n, m in sorted(model.p.items()) if m["listed"]
            }
            assert sp.start_offsets() == {
                n: model.start(m) for n, m in sorted(model.p.items()) if m["listed"]
            }
            for name, m in model.p.items():
                assert sp.next_seq(name) == m["next"]
        # Finally: seal, and everything retained reads back exactly, in memory and on disk.
        assert sp.seal() == model.seal()
        for name, m in model.p.items():
            if m["segs"]:
                want = [(s, v) for _, rs in m["segs"] for s, v in rs]
                event("final read: records" if want else "final read: empty")
                got = list(sp.read(name, model.start(m), m["end"]))
                assert list(zip(seqs(got), values(got), strict=True)) == want
                assert seqs(read_sealed(path, name, model.start(m), m["end"])) == seqs(got)
    finally:
        sp.close()
        shutil.rmtree(path, ignore_errors=True)


# -- append_batch: the Arrow receive path ---------------------------------------------------


def _wal_batch(start: int, stop: int, tag: str = "v") -> pa.RecordBatch:
    from zio_spark.storage.spool import WAL_SCHEMA

    n = stop - start
    return pa.RecordBatch.from_arrays(
        [
            pa.array([f"{tag}{i}".encode() for i in range(start, stop)], pa.binary()),
            pa.nulls(n, pa.binary()),
            pa.array(range(start, stop), pa.int64()),
            pa.array(range(start, stop), pa.int64()),
            pa.array(range(start, stop), pa.int64()),
            pa.array(range(start, stop), pa.timestamp("us", tz="UTC")),
            pa.nulls(n, WAL_SCHEMA.field("headers").type),
        ],
        schema=WAL_SCHEMA,
    )


def test_append_batch_matches_append(tmp_path):
    with Spool(tmp_path / "a", sync=False) as a, Spool(tmp_path / "b", sync=False) as b:
        assert a.append("p", recs(1, 101)) == 100
        assert b.append_batch("p", _wal_batch(1, 101)) == 100
        # Resends are dropped the same way.
        assert b.append_batch("p", _wal_batch(50, 151)) == 50
        assert a.append("p", recs(50, 151)) == 50
        assert a.seal() == b.seal() == {"p": 151}
        ra = pa.Table.from_batches(list(a.read("p", 1, 151)))
        rb = pa.Table.from_batches(list(b.read("p", 1, 151)))
        assert ra.equals(rb)


def test_append_batch_rejects_other_schemas_and_gaps(tmp_path):
    with Spool(tmp_path / "s", sync=False) as sp:
        wrong = pa.RecordBatch.from_pydict({"value": [b"x"], "seq": [1]})
        with pytest.raises(ValueError, match="schema"):
            sp.append_batch("p", wrong)
        with pytest.raises(SequenceGapError):
            sp.append_batch("p", _wal_batch(5, 10))
        assert sp.append_batch("p", _wal_batch(1, 1)) == 0
        assert sp.backlog().get("p", 0) == 0
