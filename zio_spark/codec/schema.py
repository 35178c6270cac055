"""The record schemas, each written once: what Spark sees, what the spool logs, what
travels in Arrow DATs from a producer and from a sink.

- :data:`SPARK_SCHEMA`: the source's user-facing columns, in Spark's Arrow form;
  :data:`DEFAULT_SCHEMA` (its DDL string) and :data:`SPARK_TYPES` (column name to Spark
  type) are derived from the one list :data:`SPARK_COLUMNS`.
- :data:`WAL_SCHEMA`: what the spool's write-ahead log holds (no ``producer`` column: the
  file names it).
- :data:`WIRE_SCHEMA`: the records of an Arrow DAT from a zio-spark producer.
- :data:`SINK_SCHEMA`: the records of an Arrow DAT from the sink, and of the consumer's
  staged and published files.

The map types differ on purpose and are part of the formats: Spark's ``headers`` map has
non-null keys (as PySpark's ``to_arrow_type`` builds it), the wire's and the sink's have
pyarrow's default map, and an Arrow DAT's schema must match exactly.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

__all__ = [
    "DEFAULT_SCHEMA",
    "HEADERS_TYPE",
    "SINK_SCHEMA",
    "SPARK_COLUMNS",
    "SPARK_SCHEMA",
    "SPARK_TYPES",
    "WAL_SCHEMA",
    "WIRE_SCHEMA",
]

HEADERS_TYPE: Final = pa.map_(
    pa.field("key", pa.string(), nullable=False), pa.field("value", pa.string(), nullable=True)
)
"""``map<string,string>`` exactly as PySpark's ``to_arrow_type(MapType(StringType(),
StringType()))`` builds it (non-null keys, nullable values)."""

SPARK_COLUMNS: Final[tuple[tuple[str, str, pa.DataType], ...]] = (
    ("value", "binary", pa.binary()),
    ("key", "binary", pa.binary()),
    ("producer", "string", pa.string()),
    ("seq", "bigint", pa.int64()),
    ("origin", "bigint", pa.int64()),
    ("granule", "bigint", pa.int64()),
    ("timestamp", "timestamp", pa.timestamp("us", tz="UTC")),
    ("headers", "map<string,string>", HEADERS_TYPE),
)
"""The source's columns: name, Spark type (``simpleString``), Arrow type."""

SPARK_SCHEMA: Final = pa.schema([pa.field(name, arrow) for name, _, arrow in SPARK_COLUMNS])
"""The Arrow schema of every batch the source yields: Spark's Arrow form of
:data:`DEFAULT_SCHEMA` (all nullable, session time zone UTC)."""

SPARK_TYPES: Final = {name: spark for name, spark, _ in SPARK_COLUMNS}
"""Column name to Spark type: what a user schema may list (a subset, these types)."""

DEFAULT_SCHEMA: Final = ", ".join(f"{name} {spark}" for name, spark, _ in SPARK_COLUMNS)
"""The source's schema as Spark DDL."""

WAL_SCHEMA: Final = SPARK_SCHEMA.remove(SPARK_SCHEMA.get_field_index("producer"))
"""The columns the spool logs and appends: :data:`SPARK_SCHEMA` without ``producer``."""

WIRE_SCHEMA: Final = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("value", pa.binary()),
        pa.field("key", pa.binary()),
        pa.field("granule", pa.int64()),
        pa.field("headers", pa.map_(pa.string(), pa.string())),
    ]
)
"""The records of one Arrow DAT from a zio-spark producer (``encoding: "arrow"``)."""

SINK_SCHEMA: Final = pa.schema(
    [
        pa.field("value", pa.binary()),
        pa.field("key", pa.binary()),
        pa.field("headers", pa.map_(pa.string(), pa.string())),
    ]
)
"""The records of one Arrow DAT from the sink (``format=arrow``), and of the consumer's
staged and published files."""
