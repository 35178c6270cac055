"""Auto-registration: Spark imports every top-level ``pyspark_*`` module on first data
source use and registers its ``DefaultSource`` under ``DefaultSource.name()``, so
``spark.readStream.format("zio")`` works with no ``spark.dataSource.register`` call.

This import must stay light and must never raise: a module that raises there makes
Spark skip the lookup of *every* Python data source (``Skipping the lookup of Python
Data Sources due to the failure``). So it imports only the small data source class
(:mod:`zio_spark.spark.datasource`); the readers and writers load when a query needs
them, and a Spark without a class they need fails then, at ``load()``/``start()``,
naming it (:mod:`zio_spark.spark.compat`).

- No pyspark, or a pyspark without the Python data source API (open-source 3.5): no
  ``DefaultSource`` here (such a Spark has no lookup either).
- zio-spark itself cannot be imported in this Python (a missing dependency in the
  workers' Python): ``DefaultSource`` is a stand-in named ``zio`` whose every method
  raises that import error, so ``load()`` says what is wrong instead of
  ``DATA_SOURCE_NOT_FOUND``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["DefaultSource"]

_failure: str | None = None
try:
    from pyspark.sql.datasource import DataSource as _DataSource
except Exception:  # no pyspark, or one without the Python data source API
    _DataSource = None

if _DataSource is not None:
    try:
        from zio_spark.spark.datasource import ZioDataSource as DefaultSource
    except Exception as e:  # never raise into Spark's lookup (see above)
        _failure = f"{type(e).__name__}: {e}"

        class DefaultSource(_DataSource):  # type: ignore[no-redef]
            """Stands in for the zio data source when it cannot be imported here."""

            @classmethod
            def name(cls) -> str:
                return "zio"

            def _fail(self, *args: Any, **kwargs: Any) -> Any:
                raise ImportError(
                    f"zio-spark cannot be imported by this Python ({sys.executable}): "
                    f"{_failure}. Install zio-spark where Spark's Python workers run "
                    "(PYSPARK_PYTHON, else python3): pip install its wheel there"
                )

            schema = reader = writer = streamReader = streamWriter = _fail
