"""The JVM shim: ``format("zio")`` from a Java program and from spark-sql.

Builds ``jvm-shim/build/zio-spark-example.jar`` with ``jvm-shim/build.sh`` (javac + jar
against the jars inside pyspark), then runs it with ``jvm-shim/bin/zio-spark-submit``
against an in-process producer. Spark JVMs run as child processes, loopback only, from a
temporary working directory so that the repository is never found through the cwd: the
launcher alone must make ``pyspark_zio`` visible to Spark's data source lookup. One test
runs the documented fallback instead (plain spark-submit, explicit registration through
internal Spark APIs).

Needs a JDK (javac, jar, java). Without one the tests fail when ``CI=true`` and are
skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow.parquet as pq
import pyspark
import pytest

from zio_spark.source.producer import Producer

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "jvm-shim"
SUBMIT = SHIM / "bin" / "zio-spark-submit"
SPARK_SQL = SHIM / "bin" / "zio-spark-sql"
MAIN_CLASS = "zio.spark.example.ZioJavaExample"
SPARK_TIMEOUT = 180.0
LOOPBACK_CONF = [
    "--master",
    "local[2]",
    "--conf",
    "spark.driver.host=127.0.0.1",
    "--conf",
    "spark.driver.bindAddress=127.0.0.1",
    "--conf",
    "spark.ui.enabled=false",
    "--conf",
    "spark.log.level=WARN",
]


def _need_jdk() -> None:
    missing = [t for t in ("java", "javac", "jar") if shutil.which(t) is None]
    if missing:
        reason = f"JDK tools not found: {', '.join(missing)} (install a JDK 17+)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Whatever an earlier test (tests/spark sets PYSPARK_*) or the caller set: the launcher
    # decides these. PYTHONPATH stays: a checkout used without installing needs it.
    for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME", "ZIO_SPARK_HOME"):
        env.pop(k, None)
    env.update({"SPARK_LOCAL_IP": "127.0.0.1", "ZIO_PYTHON": sys.executable, **extra})
    return env


def _run(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; on timeout kill that group (the JVM and its
    Python workers) by the child's pid, then fail."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[0]} timed out after {timeout:.0f} s\n{_tail(err)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def _committed_parquet_files(out: Path) -> list[Path]:
    """The files the parquet sink committed, from its ``_spark_metadata`` log."""
    files: list[Path] = []
    for log in sorted((out / "_spark_metadata").iterdir(), key=lambda p: p.name):
        if log.name.startswith(".") or not log.name.split(".")[0].isdigit():
            continue
        lines = log.read_text().splitlines()
        assert lines and lines[0] == "v1", f"unexpected sink log format in {log}"
        for line in lines[1:]:
            entry = json.loads(line)
            if entry.get("action", "add") == "add":
                files.append(Path(unquote(urlparse(entry["path"]).path)))
    return files


def _bare_python(folder: Path) -> Path:
    """This interpreter without site-packages and PYTHON* variables: no pyarrow, no pyspark."""
    bare = folder / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(bare.stat().st_mode | stat.S_IXUSR)
    return bare


@pytest.fixture(scope="module")
def example_jar() -> Path:
    _need_jdk()
    result = subprocess.run(
        [str(SHIM / "build.sh")], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"build.sh failed:\n{result.stdout}\n{result.stderr}"
    jar = SHIM / "build" / "zio-spark-example.jar"
    assert jar.is_file()
    # Idempotent: a second run does not rebuild.
    again = subprocess.run(
        [str(SHIM / "build.sh")], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr
    return jar


def _stream_with_java_example(
    launcher: list[str], jar: Path, tmp_path: Path, env: dict[str, str], n: int = 1000
) -> None:
    """Run ZioJavaExample against a producer holding ``n`` records; check every record
    arrived exactly once, by the example's JSON line and by the committed parquet files."""
    prod = Producer(producer_id="jvm", linger_ms=0)
    try:
        prod.send_many([f"rec-{i}".encode() for i in range(n)])
        out, ckpt, spool = tmp_path / "out", tmp_path / "ckpt", tmp_path / "spool"
        cmd = [
            *launcher, "--class", MAIN_CLASS, str(jar),
            prod.endpoint, str(out), str(ckpt), str(spool),
        ]  # fmt: skip
        result = _run(cmd, cwd=tmp_path, env=env, timeout=SPARK_TIMEOUT)
        assert result.returncode == 0, f"spark-submit failed:\n{_tail(result.stderr)}"
        json_lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
        assert json_lines, f"no JSON line on stdout:\n{result.stdout}\n{_tail(result.stderr)}"
        assert json.loads(json_lines[-1]) == {"rows": n}

        files = _committed_parquet_files(out)
        assert files, "the parquet sink committed no file"
        tables = [pq.read_table(f, columns=["seq", "producer"]) for f in files]
        seqs = [s for t in tables for s in t.column("seq").to_pylist()]
        assert sorted(seqs) == list(range(1, n + 1))  # n rows, each seq exactly once
        assert {p for t in tables for p in t.column("producer").to_pylist()} == {"jvm"}
    finally:
        prod.close(flush=False, timeout=5)


def test_java_app_streams_from_zio(example_jar: Path, tmp_path: Path) -> None:
    """The supported route: the launcher's environment, no JVM code of ours involved in
    resolving format("zio")."""
    _stream_with_java_example([str(SUBMIT), *LOOPBACK_CONF], example_jar, tmp_path, _env())


def test_fallback_registration_without_environment(example_jar: Path, tmp_path: Path) -> None:
    """The fallback: plain spark-submit, an environment interpreter that cannot even import
    pyspark, no PYTHONPATH; ZioPythonRegistration registers the source explicitly (the
    example calls it when spark.zio.python is set)."""
    bare = _bare_python(tmp_path)
    spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = _env(PYSPARK_PYTHON=str(bare), PYSPARK_DRIVER_PYTHON=str(bare))
    env.pop("ZIO_PYTHON")
    env.pop("PYTHONPATH", None)
    env["SPARK_HOME"] = str(spark_submit.parent.parent)
    launcher = [str(spark_submit), *LOOPBACK_CONF, "--conf", f"spark.zio.python={sys.executable}"]
    _stream_with_java_example(launcher, example_jar, tmp_path, env)


def test_spark_sql_resolves_using_zio(tmp_path: Path) -> None:
    """``CREATE TEMPORARY VIEW ... USING zio`` from the spark-sql CLI: DESCRIBE needs only
    the data source's schema, so no producer is involved."""
    _need_jdk()
    query = (
        "CREATE TEMPORARY VIEW v USING zio OPTIONS "
        f"(endpoints 'tcp://127.0.0.1:9', spoolPath '{tmp_path / 'spool'}'); DESCRIBE v;"
    )
    cmd = [str(SPARK_SQL), *LOOPBACK_CONF, "-e", query]
    result = _run(cmd, cwd=tmp_path, env=_env(), timeout=SPARK_TIMEOUT)
    assert result.returncode == 0, f"spark-sql failed:\n{_tail(result.stderr)}"
    described = {
        line.split()[0]: line.split()[1] for line in result.stdout.splitlines() if line.strip()
    }
    assert described == {
        "value": "binary",
        "key": "binary",
        "producer": "string",
        "seq": "bigint",
        "origin": "bigint",
        "granule": "bigint",
        "timestamp": "timestamp",
        "headers": "map<string,string>",
    }


def test_launcher_names_what_is_missing(tmp_path: Path) -> None:
    """An interpreter without the packages: the launcher says which, and starts no JVM."""
    bare = tmp_path / "bare-python"
    bare.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n'
    )  # no site-packages, no PYTHON*
    bare.chmod(bare.stat().st_mode | stat.S_IXUSR)
    result = subprocess.run(
        [str(SUBMIT), "--version"], cwd=tmp_path, env=_env(ZIO_PYTHON=str(bare)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    for module in ("pyarrow", "zmq", "pyspark", "pyspark_zio"):
        assert f"  {module}: ModuleNotFoundError" in result.stderr, result.stderr
    assert "ZIO_PYTHON" in result.stderr
    assert "version" not in result.stdout.lower()  # spark-submit never ran

    nowhere = subprocess.run(
        [str(SUBMIT), "--version"], cwd=tmp_path,
        env=_env(ZIO_PYTHON=str(tmp_path / "no-such-python")),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert nowhere.returncode == 2
    assert "no Python interpreter" in nowhere.stderr
