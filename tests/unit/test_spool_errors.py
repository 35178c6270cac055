"""The spool's bad-input and closed errors are ZioSparkError subclasses naming the field,
the value and what was expected (and still the ValueError/TypeError they were). No
sockets."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from zio_spark.errors import StorageClosedError, StorageInputError, ZioSparkError
from zio_spark.storage.spool import Record, Spool, SpoolClosedError, read_sealed


def _spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "s", sync=False)


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (Record(1, b"v", None, 1 << 64, None, 0, None), "records: origin"),
        (Record(1, b"v", None, 0, "7", 0, None), "records: granule"),
        (Record(None, b"v", None, 0, None, 0, None), "records: seq"),  # type: ignore[arg-type]
        (Record(1, 5, None, 0, None, 0, None), "records"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_record_names_its_field(tmp_path: Path, record: Record, field: str) -> None:
    with _spool(tmp_path) as spool:
        with pytest.raises(StorageInputError) as e:
            spool.append("p", [record])
        assert e.value.field == field
        assert isinstance(e.value, ZioSparkError) and isinstance(e.value, ValueError)
        assert spool.next_seq("p") == 1  # nothing stored


def test_a_batch_of_another_schema_names_the_schema(tmp_path: Path) -> None:
    batch = pa.RecordBatch.from_pydict({"seq": [1]})
    with _spool(tmp_path) as spool, pytest.raises(StorageInputError) as e:
        spool.append_batch("p", batch)
    assert e.value.field == "batch schema" and "WAL_SCHEMA" in e.value.expected


@pytest.mark.parametrize("offset", [-1, True, 1.5])
def test_a_bad_commit_offset_names_producer_and_value(tmp_path: Path, offset: object) -> None:
    with _spool(tmp_path) as spool, pytest.raises(StorageInputError) as e:
        spool.commit({"p": offset})  # type: ignore[dict-item]
    assert "'p'" in e.value.field and e.value.value == offset


def test_a_bad_producer_id_is_named(tmp_path: Path) -> None:
    with _spool(tmp_path) as spool:
        with pytest.raises(StorageInputError) as e:
            spool.commit({"\ud800": 2})
        assert e.value.field == "producer id" and "UTF-8" in e.value.expected


def test_a_bad_read_range_is_named(tmp_path: Path) -> None:
    with pytest.raises(StorageInputError) as e:
        list(read_sealed(tmp_path, "p", 5, 2))
    assert (e.value.field, e.value.value) == ("start_seq", 5)


def test_a_closed_spool_says_so_and_where(tmp_path: Path) -> None:
    spool = _spool(tmp_path)
    spool.close()
    with pytest.raises(SpoolClosedError) as e:
        spool.append("p", [Record(1, b"v", None, 0, None, 0, None)])
    assert isinstance(e.value, StorageClosedError) and isinstance(e.value, ValueError)
    assert e.value.path == str(tmp_path / "s")
