"""zio-spark: Spark Structured Streaming source and sink for ZeroMQ ZIO data flows."""

from __future__ import annotations

__version__ = "0.1.0"
