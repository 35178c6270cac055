"""The sink's input-column check (``sink_columns``), without a Spark session: errors list
the DataFrame's columns as found, say what is wrong and what is accepted, and name no
option (the user gave none for columns)."""

from __future__ import annotations

import pytest
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from zio_spark.errors import ConfigError, InputColumnsError
from zio_spark.spark.sink import SinkColumns, sink_columns

ACCEPTED = (
    "value (binary or string, required), key (binary or string, optional), "
    "headers (map<string,string>, optional)"
)


def _schema(*fields: tuple[str, object]) -> StructType:
    return StructType([StructField(name, t) for name, t in fields])  # type: ignore[arg-type]


def test_accepted_columns_are_mapped_by_name_case_insensitively() -> None:
    headers = MapType(StringType(), StringType())
    got = sink_columns(
        _schema(("Value", BinaryType()), ("KEY", StringType()), ("headers", headers))
    )
    assert got == SinkColumns("Value", "KEY", "headers")
    assert sink_columns(_schema(("value", StringType()))) == SinkColumns("value")


@pytest.mark.parametrize(
    ("fields", "columns", "parts"),
    [
        (
            [("timestamp", TimestampType()), ("value", LongType())],
            "[timestamp timestamp, value bigint]",
            ["column 'timestamp' (timestamp) is not one the sink writes", ACCEPTED,
             "df.withColumnRenamed('timestamp', 'value')"],
        ),
        (
            [("value", LongType())],
            "[value bigint]",
            ["column 'value' is bigint", "expected value of type binary or string",
             "df['value'].cast('string')"],
        ),
        (
            [("value", StringType()), ("headers", StringType())],
            "[value string, headers string]",
            ["column 'headers' is string", "headers of type map<string,string>", "create_map"],
        ),
        (
            [("Value", StringType()), ("value", BinaryType())],
            "[Value string, value binary]",
            ["columns 'Value' and 'value' both name value", "at most once"],
        ),
        (
            [("key", StringType())],
            "[key string]",
            ["there is no 'value' column", ACCEPTED],
        ),
        ([], "[none]", ["there is no 'value' column"]),
    ],
)  # fmt: skip
def test_bad_columns_list_the_dataframes_columns_and_what_is_expected(
    fields: list[tuple[str, object]], columns: str, parts: list[str]
) -> None:
    with pytest.raises(InputColumnsError) as e:
        sink_columns(_schema(*fields))
    text = str(e.value)
    assert text.startswith(
        f"the DataFrame written to the zio sink has the input columns {columns}: "
    )
    for part in parts:
        assert part in text, f"{part!r} not in {text}"
    assert "option '" not in text and "'schema'" not in text, "columns are not an option"
    assert not isinstance(e.value, ConfigError)
    assert isinstance(e.value, ValueError)
    assert e.value.columns == tuple(f"{n} {t.simpleString()}" for n, t in fields)  # type: ignore[attr-defined]
