"""The Spark data source (``format("zio")``): source, sink, and the Spark probes.

Importing this package imports nothing from pyspark: :mod:`zio_spark.spark.datasource`
is the light data source class Spark's lookup registers, :mod:`~zio_spark.spark.source`
and :mod:`~zio_spark.spark.sink` the readers and writers it loads when a query needs
them, and :mod:`~zio_spark.spark.compat` what the running Spark offers (probed by class
and signature, never by version number).
"""
