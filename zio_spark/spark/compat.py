"""Which Spark the connector needs, checked when ``zio_spark.spark`` is imported.

The source implements hooks of the Python data source API that older Sparks never call,
so on an older Spark the query would not fail: it would run without them (no read limit,
no ``Trigger.AvailableNow`` target), which is worse. The oldest Spark with every hook we
use is **4.2.0**:

- ``latestOffset(start, limit)``, ``getDefaultReadLimit()``, ``reportLatestOffset()``
  and ``pyspark.sql.streaming.datasource`` (``ReadLimit``, ``ReadAllAvailable``,
  ``ReadMaxRows``, ``SupportsTriggerAvailableNow``): SPARK-55304 (apache/spark#54085),
  marked ``versionadded:: 4.2.0`` in pyspark's ``python/pyspark/sql/datasource.py``;
- ``DataSourceStreamArrowWriter`` (the sink): 4.1.0; ``DataSourceArrowWriter``,
  ``DataSourceStreamReader``, ``DataSourceStreamWriter`` and the ``pyspark_*`` module
  lookup: 4.0.0.

Spark 3.5 (Databricks Runtime 14.3/15.4 LTS) has no Python streaming data source API
at all. The check reads the version of the pyspark that imports this package: on a
driver, a Spark Connect server and an executor that is the Spark running the query. A
Spark Connect *client* may be older or newer than its server: :func:`check_session`
checks the server's version through the session.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["MIN_SPARK", "SparkVersionError", "check_session", "require_spark", "spark_version"]

MIN_SPARK = (4, 2, 0)
_NEEDED = ".".join(map(str, MIN_SPARK))
_SKIP = "ZIO_SPARK_SKIP_VERSION_CHECK"
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


class SparkVersionError(ImportError):
    """The Spark found is older than the one zio-spark needs (or none was found)."""

    def __init__(self, found: str | None, where: str) -> None:
        self.found = found
        self.needed = _NEEDED
        if found is None:
            msg = (
                f"zio-spark's Spark data source needs pyspark >= {_NEEDED}, and {where} has "
                "no pyspark: pip install 'zio-spark[spark]' (or run it where Spark is)"
            )
        else:
            msg = (
                f"zio-spark needs Spark >= {_NEEDED} (Python data source hooks "
                "latestOffset(start, limit), getDefaultReadLimit, reportLatestOffset, "
                f"SupportsTriggerAvailableNow), but {where} is Spark {found}. On Databricks "
                f"that means Databricks Runtime 19 or later. Set {_SKIP}=1 to import anyway "
                "(only for a runtime known to carry these hooks under an older version number)"
            )
        super().__init__(msg)


def spark_version(text: str) -> tuple[int, int, int] | None:
    """``"4.3.0"``, ``"4.2.0.dev1"``, ``"4.2"`` -> a tuple; None if not a version."""
    m = _VERSION.match(text.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _installed() -> str | None:
    try:
        from pyspark.version import __version__
    except ImportError:
        return None
    return str(__version__)


def require_spark(found: str | None = None, where: str = "this Python's pyspark") -> str:
    """Raise :class:`SparkVersionError` unless ``found`` (default: the installed pyspark's
    version) is at least :data:`MIN_SPARK`; return the version checked."""
    version = _installed() if found is None else found
    if os.environ.get(_SKIP) == "1" and version is not None:
        return version
    parsed = None if version is None else spark_version(version)
    if parsed is None or parsed < MIN_SPARK:
        raise SparkVersionError(version, where)
    return str(version)


def check_session(spark: Any) -> str:
    """Check the Spark a session runs on (for a Spark Connect session: the server's)."""
    return require_spark(str(spark.version), "the session's Spark")
