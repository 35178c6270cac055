"""The storage error family in :mod:`zio_spark.errors`: attributes and messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from zio_spark.errors import (
    CorruptRecordError,
    FormatVersionError,
    StorageClosedError,
    StorageError,
    StorageInputError,
    ZioSparkError,
)


def test_storage_error_keeps_the_path_and_names_it() -> None:
    e = StorageError("cannot write", path=Path("/tmp/spool"))
    assert isinstance(e, ZioSparkError)
    assert e.path == "/tmp/spool"
    assert str(e) == "cannot write (/tmp/spool)"
    assert str(StorageError("cannot write")) == "cannot write"


def test_corrupt_record_names_offset_and_path() -> None:
    e = CorruptRecordError("CRC mismatch", path="/f", offset=12)
    assert isinstance(e, StorageError) and isinstance(e, ValueError)
    assert (e.path, e.offset) == ("/f", 12)
    assert str(e) == "CRC mismatch at byte 12 (/f)"


def test_format_version_names_found_and_expected() -> None:
    e = FormatVersionError(3, 1, path="/f")
    assert (e.found, e.expected) == (3, 1)
    assert str(e) == "format version 3, expected 1 (/f)"


def test_closed_is_a_storage_error() -> None:
    assert isinstance(StorageClosedError("closed"), StorageError)


def test_input_error_is_also_value_and_type_error() -> None:
    e = StorageInputError("records", 7, "a list of Record tuples")
    for cls in (StorageError, ValueError, TypeError):
        assert isinstance(e, cls)
    assert (e.field, e.value, e.expected) == ("records", 7, "a list of Record tuples")
    assert str(e) == "records: got 7, expected a list of Record tuples"
    with pytest.raises(ValueError, match="records: got"):
        raise e


def test_input_error_shortens_a_huge_value() -> None:
    e = StorageInputError("value", b"x" * 10_000, "bytes")
    assert len(str(e)) < 300
