"""What the running Spark offers, probed class by class, never read from a version number.

zio-spark runs on every Spark whose pyspark has the Python data source API (4.0 on; the
Databricks runtimes that backport it onto 3.5). Where an older API lacks a hook, the
source degrades as the "Spark versions" table of docs/running.md says:

============================== ============ ========= ===============================
probe                          4.0          4.1       4.2 / 4.3
============================== ============ ========= ===============================
``HAS_DATASOURCE_API``         yes          yes       yes
``HAS_ADMISSION_CONTROL``      no           no        yes
``HAS_TRIGGER_AVAILABLE_NOW``  no           no        yes
``HAS_REPORT_LATEST_OFFSET``   no           no        yes
``HAS_STREAM_ARROW_WRITER``    no           yes       yes
============================== ============ ========= ===============================

- ``HAS_ADMISSION_CONTROL``: module ``pyspark.sql.streaming.datasource`` (``ReadLimit``,
  ``ReadMaxRows``, ``ReadAllAvailable``) and ``DataSourceStreamReader.getDefaultReadLimit``
  (SPARK-55304, ``versionadded:: 4.2.0``). Without it Spark calls ``latestOffset()`` with
  no arguments (our signature makes them optional: 4.2+ inspects it), and the option
  ``maxRecordsPerTrigger`` is refused at ``load()``.
- ``HAS_TRIGGER_AVAILABLE_NOW``: ``SupportsTriggerAvailableNow``. Without it Spark runs an
  ``availableNow`` query as one batch (``Falling back to single batch execution``).
- ``HAS_REPORT_LATEST_OFFSET``: ``DataSourceStreamReader.reportLatestOffset``. Without it
  the source logs its backlog metrics instead (they never reach ``lastProgress``).
- ``HAS_STREAM_ARROW_WRITER``: ``DataSourceStreamArrowWriter``. Without it the stream
  writer also derives from ``DataSourceArrowWriter``, which Spark's write path checks
  first, so it still gets Arrow batches.

Nothing here imports pyspark at import time: each ``HAS_*`` name is probed on first use
and cached (PEP 562), so ``import pyspark_zio`` stays light and never raises, with any
pyspark or none. The stand-ins (:class:`ReadLimit` and friends) let the source's code be
one code path on every version.

An unusable Spark fails with :class:`SparkCapabilityError` at ``load()``/``start()``
(:func:`require`), naming the class that is missing and the Spark (and Databricks
runtime) that has it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

# Also, resolved on first access (module __getattr__): the HAS_* probes and
# ReadLimit, ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow.
__all__ = [
    "DEGRADED",
    "SparkCapabilityError",
    "capabilities",
    "check_session",
    "find",
    "require",
    "spark_version",
]

_DS = "pyspark.sql.datasource"
_SDS = "pyspark.sql.streaming.datasource"
_S40 = "Spark 4.0 (Databricks Runtime 17.3 LTS; 15.4 LTS and 16.4 LTS backport it)"
_S41 = "Spark 4.1 (Databricks Runtime 18 LTS)"
_S42 = "Spark 4.2 (Databricks Runtime 19)"

# class name -> (its module, the first Spark that has it)
_CLASSES: dict[str, tuple[str, str]] = {
    "DataSource": (_DS, _S40),
    "DataSourceReader": (_DS, _S40),
    "DataSourceWriter": (_DS, _S40),
    "DataSourceStreamReader": (_DS, _S40),
    "DataSourceStreamWriter": (_DS, _S40),
    "DataSourceArrowWriter": (_DS, _S40),
    "DataSourceStreamArrowWriter": (_DS, _S41),
    "InputPartition": (_DS, _S40),
    "WriterCommitMessage": (_DS, _S40),
    "ReadLimit": (_SDS, _S42),
    "ReadAllAvailable": (_SDS, _S42),
    "ReadMaxRows": (_SDS, _S42),
    "SupportsTriggerAvailableNow": (_SDS, _S42),
}


class SparkCapabilityError(RuntimeError):
    """The running Spark lacks a class or hook zio-spark needs for what was asked."""

    def __init__(self, missing: str, needed_for: str, has_it: str) -> None:
        self.missing = missing
        self.needed_for = needed_for
        self.has_it = has_it
        found = spark_version() or "no pyspark"
        super().__init__(
            f"zio-spark: {needed_for} needs {missing}, which this Spark ({found}) does not "
            f"have; {has_it} and later have it. Run the query on such a Spark (open-source "
            "pyspark >= 4.0, or that Databricks runtime)"
        )


@functools.cache
def spark_version() -> str | None:
    """The installed pyspark's version, for messages only (None without pyspark)."""
    try:
        from pyspark.version import __version__
    except ImportError:
        return None
    return str(__version__)


@functools.cache
def find(name: str) -> Any:
    """The pyspark class ``name`` (a key of the table above), or None if this Spark lacks it."""
    module, _ = _CLASSES[name]
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(mod, name, None)


def require(name: str, needed_for: str) -> Any:
    """The pyspark class ``name``; raise :class:`SparkCapabilityError` if it is missing."""
    cls = find(name)
    if cls is None:
        module, has_it = _CLASSES[name]
        raise SparkCapabilityError(f"{module}.{name}", needed_for, has_it)
    return cls


def _has_admission_control() -> bool:
    reader = find("DataSourceStreamReader")
    if reader is None or find("ReadLimit") is None or find("ReadMaxRows") is None:
        return False
    if not hasattr(reader, "getDefaultReadLimit"):
        return False
    # Spark 4.2+ calls latestOffset(start, limit) when the reader's signature takes them.
    params = inspect.signature(reader.latestOffset).parameters
    return len(params) >= 3  # self, start, limit


def _has_report_latest_offset() -> bool:
    reader = find("DataSourceStreamReader")
    return reader is not None and hasattr(reader, "reportLatestOffset")


_PROBES = {
    "HAS_DATASOURCE_API": lambda: (
        find("DataSource") is not None and find("DataSourceStreamReader") is not None
    ),
    "HAS_ADMISSION_CONTROL": _has_admission_control,
    "HAS_TRIGGER_AVAILABLE_NOW": lambda: find("SupportsTriggerAvailableNow") is not None,
    "HAS_REPORT_LATEST_OFFSET": _has_report_latest_offset,
    "HAS_STREAM_ARROW_WRITER": lambda: find("DataSourceStreamArrowWriter") is not None,
}

# What each missing capability costs (docs/running.md's "Spark versions" table, in words).
DEGRADED = {
    "HAS_DATASOURCE_API": "no Python data source API: format('zio') is unknown to this Spark",
    "HAS_ADMISSION_CONTROL": "latestOffset() without arguments; option maxRecordsPerTrigger "
    "is refused at load() (bound memory with maxBacklog)",
    "HAS_TRIGGER_AVAILABLE_NOW": "availableNow runs as one batch holding what the producers "
    "held when the run started",
    "HAS_REPORT_LATEST_OFFSET": "source metrics (backlog, heldBackMs) are logged, not in "
    "the query's progress",
    "HAS_STREAM_ARROW_WRITER": "the stream writer gets Arrow batches through "
    "DataSourceArrowWriter (exactly once as on 4.1+)",
}


def capabilities() -> dict[str, bool]:
    """Every ``HAS_*`` probe of this Spark (for ``zio-spark doctor`` and messages)."""
    return {name: bool(_probe(name)) for name in _PROBES}


@functools.cache
def _probe(name: str) -> bool:
    return bool(_PROBES[name]())


def __getattr__(name: str) -> Any:
    """``HAS_*`` probes and the admission-control classes (Spark's, else a stand-in),
    resolved (and cached) on first access."""
    if name in _PROBES:
        return _probe(name)
    if name in _STAND_INS:
        return _stand_in(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- stand-ins for Spark < 4.2 (no pyspark.sql.streaming.datasource) ----------------------


class _ReadLimit:
    """Stand-in for ``pyspark.sql.streaming.datasource.ReadLimit`` (Spark < 4.2)."""


class _ReadAllAvailable(_ReadLimit):
    """Stand-in for ``ReadAllAvailable`` (Spark < 4.2)."""


class _ReadMaxRows(_ReadLimit):
    """Stand-in for ``ReadMaxRows`` (Spark < 4.2)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows


class _SupportsTriggerAvailableNow:
    """Stand-in mixin for ``SupportsTriggerAvailableNow`` (Spark < 4.2 never calls it)."""

    def prepareForTriggerAvailableNow(self) -> None:
        raise NotImplementedError


_STAND_INS: dict[str, type] = {
    "ReadLimit": _ReadLimit,
    "ReadAllAvailable": _ReadAllAvailable,
    "ReadMaxRows": _ReadMaxRows,
    "SupportsTriggerAvailableNow": _SupportsTriggerAvailableNow,
}


@functools.cache
def _stand_in(name: str) -> Any:
    found = find(name)
    return _STAND_INS[name] if found is None else found


def check_session(spark: Any) -> str:
    """The version of the Spark a session runs on (for a Spark Connect session: the
    server's). A Connect client cannot probe the server's classes; the server's own
    lookup does, and ``load()`` fails there, clearly, if a hook is missing."""
    return str(spark.version)
