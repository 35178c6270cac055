"""Auto-registration: Spark imports every top-level ``pyspark_*`` module on first data
source use and registers its ``DefaultSource`` under ``DefaultSource.name()``, so
``spark.readStream.format("zio")`` works with no ``spark.dataSource.register`` call.
Keep this import light. Importing it checks the Spark version (zio_spark/spark/compat.py:
Spark >= 4.2.0), so an older runtime fails at the lookup naming both versions."""

from zio_spark.spark.source import ZioDataSource as DefaultSource

__all__ = ["DefaultSource"]
