"""The Spark data source (``format("zio")``): source, sink, receiver, segment server.

Importing it checks the Spark version first (:mod:`zio_spark.spark.compat`): an older
Spark fails here, naming the version found and the one needed, not later with an
obscure ImportError or, worse, a query that silently runs without our hooks.
"""

from zio_spark.spark.compat import require_spark

require_spark()
