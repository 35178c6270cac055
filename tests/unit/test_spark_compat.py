"""The Spark version check: at import, an older Spark fails naming both versions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zio_spark.spark.compat import (
    MIN_SPARK,
    SparkVersionError,
    check_session,
    require_spark,
    spark_version,
)

ROOT = str(Path(__file__).resolve().parents[2])


def test_minimum_is_4_2_and_the_installed_pyspark_passes() -> None:
    import pyspark

    assert MIN_SPARK == (4, 2, 0)
    assert require_spark() == pyspark.__version__


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("4.3.0", (4, 3, 0)), ("4.2", (4, 2, 0)), ("4.2.0.dev1", (4, 2, 0)), ("x4", None)],
)
def test_versions_parse(text: str, parsed: tuple[int, int, int] | None) -> None:
    assert spark_version(text) == parsed


@pytest.mark.parametrize("found", ["3.5.0", "4.0.1", "4.1.1", "not-a-version"])
def test_older_spark_is_refused_naming_found_and_needed(found: str) -> None:
    with pytest.raises(SparkVersionError) as e:
        require_spark(found)
    assert e.value.found == found and e.value.needed == "4.2.0"
    assert f"Spark {found}" in str(e.value) and ">= 4.2.0" in str(e.value)


@pytest.mark.parametrize("found", ["4.2.0", "4.3.0", "4.3.1", "5.0.0"])
def test_new_enough_spark_passes(found: str) -> None:
    assert require_spark(found) == found


def test_check_session_reads_the_sessions_version() -> None:
    class Session:
        version = "4.1.0"

    with pytest.raises(SparkVersionError, match=r"the session's Spark is Spark 4\.1\.0"):
        check_session(Session())
    Session.version = "4.3.0"
    assert check_session(Session()) == "4.3.0"


def _import_with_pyspark(version: str | None, *, skip: bool = False) -> subprocess.Popen[str]:
    """Import ``pyspark_zio`` in a child whose ``pyspark.version`` says ``version``
    (None: no pyspark at all)."""
    fake = (
        "import sys, types\n"
        + (
            "sys.modules['pyspark'] = None\n"
            if version is None
            else f"m = types.ModuleType('pyspark.version'); m.__version__ = {version!r}\n"
            "import pyspark; sys.modules['pyspark.version'] = m\n"
        )
        + "import pyspark_zio\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("ZIO_SPARK_SKIP_VERSION_CHECK", None)
    if skip:
        env["ZIO_SPARK_SKIP_VERSION_CHECK"] = "1"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(fake)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def test_import_on_spark_3_5_fails_with_the_versions() -> None:
    out = _import_with_pyspark("3.5.0")
    assert out.returncode != 0
    assert "SparkVersionError" in out.stderr
    assert "Spark 3.5.0" in out.stderr and ">= 4.2.0" in out.stderr
    assert "Databricks Runtime 19" in out.stderr


def test_import_without_pyspark_names_the_extra() -> None:
    out = _import_with_pyspark(None)
    assert out.returncode != 0
    assert "SparkVersionError" in out.stderr and "zio-spark[spark]" in out.stderr


def test_skip_variable_lets_a_vendor_runtime_import() -> None:
    out = _import_with_pyspark("4.1.0", skip=True)
    assert out.returncode == 0, out.stderr


def test_transport_imports_without_pyspark() -> None:
    """Only the Spark data source needs Spark: flows, producer and queue do not."""
    code = (
        "import sys; sys.modules['pyspark'] = None\n"
        "import zio_spark.source.producer, zio_spark.sink.consumer\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr
