"""The ``zio`` data source class, kept light: Spark's ``pyspark_*`` lookup imports it
(through ``pyspark_zio``) in a fresh Python worker, and so does every worker that unpickles
it (the streaming runner first of all). It imports only ``pyspark.sql.datasource`` (which
those workers already hold); the reader and writer modules, with pyarrow, zmq, the
receiver and the spool, are imported by the method that returns a reader or writer.

Each method checks first that this Spark has the classes it needs
(:func:`zio_spark.spark.compat.require`), so an unusable Spark fails at ``load()`` or
``start()`` naming what is missing and which Spark has it.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource

from zio_spark.spark import compat

if TYPE_CHECKING:
    from pyspark.sql.datasource import (
        DataSourceReader,
        DataSourceStreamReader,
        DataSourceStreamWriter,
        DataSourceWriter,
    )
    from pyspark.sql.types import StructType

    from zio_spark.options import SourceOptions

__all__ = ["ZioDataSource", "check_source_options"]


def check_source_options(opts: SourceOptions) -> None:
    """Refuse source options this Spark cannot honour.

    ``readMode=direct`` runs on every supported Spark: where ``latestOffset()`` comes
    without its batch start (before 4.2) the reader knows it from Spark's other calls
    (:class:`~zio_spark.source.direct.ImpliedStart`). Its own limits (``endpoints``
    only; streaming only) are refused where they are met (options, :meth:`reader`).

    Raises
    ------
    ConfigError
        ``maxRecordsPerTrigger`` on a Spark without admission control for Python sources
        (before 4.2): Spark would never pass the limit, so each micro-batch would take
        everything stored, not the rows asked for.
    """
    from zio_spark.errors import ConfigError

    if opts.max_records_per_trigger is not None and not compat.HAS_ADMISSION_CONTROL:
        raise ConfigError(
            "maxRecordsPerTrigger",
            opts.max_records_per_trigger,
            "no read limit on this Spark "
            f"({compat.spark_version()}): it has no admission control for Python sources "
            "(pyspark.sql.streaming.datasource, Spark 4.2 / Databricks Runtime 19 and "
            "later). Drop the option: each micro-batch then takes what is stored, and "
            "maxBacklog bounds what the source holds",
        )


class ZioDataSource(DataSource):  # type: ignore[misc]
    """The ``zio`` data source: a ZIO flow source and sink for Spark."""

    @classmethod
    def name(cls) -> str:
        return "zio"

    def _source_options(self) -> SourceOptions:
        from zio_spark.options import parse_source_options

        opts = parse_source_options(self.options)
        check_source_options(opts)
        return opts

    def schema(self) -> str:
        # Reads only: validate the source options now, so a typo fails at load().
        from zio_spark.codec.schema import DEFAULT_SCHEMA

        self._source_options()
        return DEFAULT_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        compat.require("DataSourceStreamReader", "spark.readStream.format('zio')")
        from zio_spark.spark.source import ZioStreamReader, _columns

        cls: Any = ZioStreamReader
        if not compat.HAS_ADMISSION_CONTROL:  # latestOffset() without arguments
            from zio_spark.spark.legacy import ZioStreamReaderOldApi

            cls = ZioStreamReaderOldApi
        reader = cls(self._source_options(), _columns(schema))
        self._drop_curve_secret()
        return reader

    def _drop_curve_secret(self) -> None:
        """Forget ``curveSecretKey`` once a stream reader holds the parsed options.

        PySpark's read function for a Python source captures this object and is pickled
        into every task; the tasks read with what their partitions carry (a key pair per
        query run in ``readMode=direct``), so the source's secret key must not ride
        along. Spark makes this object afresh from its own pickle for each runner or
        planning worker, so dropping the key here loses it nowhere it is needed.
        """
        options = self.options
        if any(str(k).lower() == "curvesecretkey" for k in options):
            self.options = type(options)(
                (k, v) for k, v in options.items() if str(k).lower() != "curvesecretkey"
            )

    def reader(self, schema: StructType) -> DataSourceReader:
        compat.require("DataSourceReader", "spark.read.format('zio')")
        from zio_spark.errors import ConfigError
        from zio_spark.spark.source import ZioBatchReader, _columns

        opts = self._source_options()
        if opts.read_mode == "direct":
            raise ConfigError(
                "readMode",
                "direct",
                "spool for a batch read (spark.read): the direct read mode is for "
                "streaming queries (spark.readStream) only",
            )
        return ZioBatchReader(opts, _columns(schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        # Runs on the driver: bad options or input columns fail before any task starts.
        compat.require("DataSourceStreamWriter", "df.writeStream.format('zio')")
        compat.require("DataSourceArrowWriter", "df.writeStream.format('zio')")
        from zio_spark.spark.sink import ZioStreamWriter, sink_columns, sink_options

        return ZioStreamWriter(sink_options(self.options), sink_columns(schema))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        # The batch id is drawn here, once, on the driver; the pickled writer carries it
        # to the tasks and back to commit().
        compat.require("DataSourceArrowWriter", "df.write.format('zio')")
        from zio_spark.spark.sink import ZioBatchWriter, sink_columns, sink_options

        return ZioBatchWriter(
            sink_options(self.options), sink_columns(schema), f"write-{uuid.uuid4().hex}"
        )
