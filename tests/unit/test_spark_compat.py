"""Spark capabilities are probed, never read from a version number; ``import pyspark_zio``
never raises and stays light; an unusable Spark fails at load()/start() naming what is
missing. Older Sparks are simulated in child processes by hiding pyspark's classes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from zio_spark.spark import compat

ROOT = str(Path(__file__).resolve().parents[2])


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_the_installed_pyspark_has_every_hook() -> None:
    assert compat.capabilities() == dict.fromkeys(compat.capabilities(), True)
    from pyspark.sql.streaming.datasource import ReadMaxRows

    assert compat.ReadMaxRows is ReadMaxRows
    assert compat.check_session(type("S", (), {"version": "4.3.0"})()) == "4.3.0"


def test_import_without_pyspark_does_not_raise_and_registers_nothing() -> None:
    out = _child(
        """
        import sys
        sys.modules["pyspark"] = None
        import pyspark_zio
        print(hasattr(pyspark_zio, "DefaultSource"))
        from zio_spark.spark import compat
        print(compat.capabilities())
        """
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert "'HAS_DATASOURCE_API': False" in lines[1]


def test_import_on_a_pyspark_without_the_data_source_api_does_not_raise() -> None:
    """Open-source 3.5: no pyspark.sql.datasource. Nothing to register, no error."""
    out = _child(
        """
        import sys
        sys.modules["pyspark.sql.datasource"] = None
        import pyspark_zio
        print(hasattr(pyspark_zio, "DefaultSource"))
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


def test_a_broken_install_registers_a_stand_in_that_says_why_at_load() -> None:
    """zio-spark cannot be imported in the workers' Python: Spark's lookup still works
    (for every other data source too) and load() names the cause and the fix."""
    out = _child(
        """
        import sys
        sys.modules["zio_spark.spark.datasource"] = None
        import pyspark_zio
        src = pyspark_zio.DefaultSource
        print(src.name())
        try:
            src(options={}).schema()
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    assert out.returncode == 0, out.stderr
    name, error = out.stdout.splitlines()[:2]
    assert name == "zio"
    assert "zio-spark cannot be imported by this Python" in error
    assert sys.executable in error and "PYSPARK_PYTHON" in error


def test_pyspark_zio_imports_only_the_light_data_source_class() -> None:
    """Spark's lookup imports every pyspark_* module in a fresh worker: ours adds only
    the data source class and the probes (no zmq, pyarrow, receiver, storage)."""
    out = _child(
        """
        import sys
        import pyspark.sql.datasource
        before = set(sys.modules)
        import pyspark_zio
        print(sorted(set(sys.modules) - before))
        """
    )
    assert out.returncode == 0, out.stderr
    new = set(eval(out.stdout))
    assert new == {
        "pyspark_zio",
        "zio_spark",
        "zio_spark.spark",
        "zio_spark.spark.compat",
        "zio_spark.spark.datasource",
    }, new


# Spark 4.0/4.1 as far as zio-spark can tell: no pyspark.sql.streaming.datasource, no
# latestOffset(start, limit), no getDefaultReadLimit/reportLatestOffset; 4.0 also has no
# DataSourceStreamArrowWriter.
_OLD_SPARK = """
import sys
import pyspark.sql.datasource as ds
sys.modules["pyspark.sql.streaming.datasource"] = None
del ds.DataSourceStreamReader.getDefaultReadLimit
del ds.DataSourceStreamReader.reportLatestOffset
def latestOffset(self):
    raise NotImplementedError
ds.DataSourceStreamReader.latestOffset = latestOffset
del ds.DataSourceStreamArrowWriter
"""


def test_spark_4_0_probes_stand_ins_and_writer_bases() -> None:
    out = _child(
        _OLD_SPARK
        + """
from zio_spark.spark import compat
print(compat.capabilities())
from zio_spark.spark.source import ZioStreamReader
from zio_spark.spark.sink import ZioStreamWriter
print(compat.ReadMaxRows.__module__, compat.SupportsTriggerAvailableNow.__module__)
print([c.__name__ for c in ZioStreamWriter.__mro__])
"""
    )
    assert out.returncode == 0, out.stderr
    caps, modules, mro = out.stdout.splitlines()
    assert caps == str(
        {
            "HAS_DATASOURCE_API": True,
            "HAS_ADMISSION_CONTROL": False,
            "HAS_TRIGGER_AVAILABLE_NOW": False,
            "HAS_REPORT_LATEST_OFFSET": False,
            "HAS_STREAM_ARROW_WRITER": False,
        }
    )
    assert modules == "zio_spark.spark.compat zio_spark.spark.compat"
    # Spark's write path checks DataSourceArrowWriter first: Arrow batches on 4.0 too.
    assert "DataSourceStreamWriter" in mro and "DataSourceArrowWriter" in mro


def test_old_spark_refuses_max_records_per_trigger_and_gets_the_old_api_reader() -> None:
    out = _child(
        _OLD_SPARK
        + """
from pyspark.sql.types import StructType
from zio_spark.spark.datasource import ZioDataSource
opts = {"endpoints": "tcp://127.0.0.1:5555", "spoolPath": "/tmp/x"}
reader = ZioDataSource(options=opts).streamReader(StructType())
print(type(reader).__name__)
try:
    ZioDataSource(options={**opts, "maxRecordsPerTrigger": "100"}).schema()
except Exception as e:
    print(type(e).__name__, e)
"""
    )
    assert out.returncode == 0, out.stderr
    kind, error = out.stdout.splitlines()[:2]
    assert kind == "ZioStreamReaderOldApi"
    assert error.startswith("ConfigError option 'maxRecordsPerTrigger': got 100")
    assert "Spark 4.2" in error and "Drop the option" in error


def test_old_spark_reads_direct_with_the_old_api_reader_and_refuses_only_what_remains() -> None:
    """``readMode=direct`` is no longer refused before 4.2 (the start comes from Spark's
    other calls); a batch read in direct mode still is, naming why."""
    out = _child(
        _OLD_SPARK
        + """
from pyspark.sql.types import StructType
from zio_spark.spark.datasource import ZioDataSource
opts = {"endpoints": "tcp://127.0.0.1:5555", "spoolPath": "/tmp/x", "readMode": "direct"}
reader = ZioDataSource(options=opts).streamReader(StructType())
print(type(reader).__name__, reader.opts.read_mode)
try:
    ZioDataSource(options=opts).reader(StructType())
except Exception as e:
    print(type(e).__name__, e)
"""
    )
    assert out.returncode == 0, out.stderr
    kind, error = out.stdout.splitlines()[:2]
    assert kind == "ZioStreamReaderOldApi direct"
    assert error.startswith("ConfigError option 'readMode': got 'direct'")
    assert "streaming queries (spark.readStream) only" in error


def test_a_missing_class_fails_at_load_naming_it_and_the_spark_that_has_it() -> None:
    out = _child(
        """
        import pyspark.sql.datasource as ds
        del ds.DataSourceStreamReader
        from pyspark.sql.types import StructType
        from zio_spark.spark.datasource import ZioDataSource
        try:
            ZioDataSource(options={}).streamReader(StructType())
        except Exception as e:
            print(type(e).__name__, e)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SparkCapabilityError zio-spark: spark.readStream")
    assert "pyspark.sql.datasource.DataSourceStreamReader" in out.stdout
    assert "Spark 4.0" in out.stdout and "Databricks Runtime" in out.stdout


def test_the_old_api_reader_passes_its_previous_answer_as_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spark < 4.2 asks latestOffset() again only once the batch to its last answer is
    committed: that answer is the start the reader acknowledges."""
    from zio_spark.spark import legacy
    from zio_spark.spark.source import ZioStreamReader

    seen: list[Any] = []
    answers = iter([{"p": 10}, {"p": 25}, {"p": 25}])

    def fake(self: Any, start: Any = None, limit: Any = None) -> dict[str, int]:
        seen.append((start, limit))
        return next(answers)

    monkeypatch.setattr(ZioStreamReader, "latestOffset", fake)
    monkeypatch.setattr(ZioStreamReader, "reportLatestOffset", lambda self: {"backlog": {}})
    monkeypatch.setattr(legacy.ZioStreamReaderOldApi, "_planned_end", lambda self: None)
    r = legacy.ZioStreamReaderOldApi.__new__(legacy.ZioStreamReaderOldApi)
    r.opts = SimpleNamespace(read_mode="spool")
    assert [r.latestOffset() for _ in range(3)] == [{"p": 10}, {"p": 25}, {"p": 25}]
    assert seen == [({}, None), ({"p": 10}, None), ({"p": 25}, None)]


def test_transport_imports_without_pyspark() -> None:
    """Only the Spark data source needs Spark: flows, producer and queue do not."""
    out = _child(
        "import sys; sys.modules['pyspark'] = None\n"
        "import zio_spark.source.producer, zio_spark.sink.consumer\n"
    )
    assert out.returncode == 0, out.stderr
