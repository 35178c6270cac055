"""`zio-spark doctor`: what it finds in a good Python and a bare one, its JSON, its --fix,
and that it sends nothing to a non-loopback address.

Doctor runs in-process (``main``); the Pythons it checks run as its subprocesses. A bare
venv (``python -m venv --without-pip``: no zio-spark, no pyspark) stands in for the
``PYSPARK_PYTHON`` users forget to set. ``--fix`` is tested on a copy of pyspark.zip under
a temporary ``SPARK_HOME``, so the project's own venv is never rewritten.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from zio_spark.cli.doctor import START_LIMIT_S, START_WARN_S, worker_pythons
from zio_spark.cli.main import main

STATUSES = {"ok", "warn", "fail", "not checked", "fixed"}


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python with nothing installed: no zio-spark, no pyspark, no pyzmq."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    assert python.exists()
    return str(python)


def doctor_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc = main(["doctor", *argv, "--json"])
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1, out  # one JSON document, nothing else
    return rc, json.loads(out)


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    checks = {c["name"]: c for c in doc["checks"]}
    assert len(checks) == len(doc["checks"]), "check names are unique"
    return checks


def test_worker_pythons_follow_spark_s_lookup(bare_python):
    """Driver side: PYSPARK_DRIVER_PYTHON, PYSPARK_PYTHON, python3; executors:
    PYSPARK_PYTHON, python3. One target per distinct interpreter."""
    (only,) = worker_pythons({})
    assert only.path == os.path.abspath(shutil.which("python3") or "python3")
    assert len(only.roles) == 2 and "python3 on PATH" in only.source

    (only,) = worker_pythons({"PYSPARK_PYTHON": bare_python})
    assert only.path == bare_python and len(only.roles) == 2
    assert only.source == f"$PYSPARK_PYTHON = {bare_python}"

    driver, executors = worker_pythons(
        {"PYSPARK_DRIVER_PYTHON": sys.executable, "PYSPARK_PYTHON": bare_python}
    )
    assert driver.path == sys.executable and driver.roles[0].startswith("driver-side")
    assert driver.source.startswith("$PYSPARK_DRIVER_PYTHON")
    assert executors.path == bare_python and executors.roles == ["executors"]


def test_the_project_venv_passes_every_check(capsys):
    """``--python`` this venv: zio-spark, the same pyspark, every Spark hook, pyspark_zio,
    a timed worker start from pyspark.zip, Java, the loopback ZRE round trip."""
    rc, doc = doctor_json(capsys, "--python", sys.executable)
    assert doc["command"] == "doctor"
    assert doc["pythons"] == [
        {"path": sys.executable, "roles": ["what --python names"], "source": "--python"}
    ]
    for c in doc["checks"]:
        assert set(c) <= {"name", "status", "detail", "fix", "data"}, c
        assert c["status"] in STATUSES and c["detail"], c
        assert (c["fix"] is None) or c["status"] != "ok", c  # a fix only where one is due
    counts = {s: sum(c["status"] == s for c in doc["checks"]) for s in STATUSES}
    assert doc["counts"] == counts

    checks = by_name(doc)
    for name in (
        "python",
        "zio-spark",
        "pyspark",
        "spark: stream API",
        "spark: latestOffset(start, limit)",
        "spark: admission control",
        "spark: SupportsTriggerAvailableNow",
        "spark: reportLatestOffset",
        "spark: DataSourceStreamArrowWriter",
        "spark: DataSourceArrowWriter",
        "data source module",
        "java",
        "ZRE broadcast",  # conftest pins the beacons to 127.255.255.255
    ):
        assert checks[name]["status"] == "ok", checks[name]
    import pyspark

    assert checks["pyspark"]["detail"].startswith(f"{pyspark.__version__} (the same")
    assert checks["python"]["data"]["executable"] == sys.executable
    # Bytecode and draft pyzmq depend on how this venv was set up: either is a finding.
    assert checks["pyspark.zip bytecode"]["status"] in ("ok", "warn")
    assert checks["draft pyzmq"]["status"] in ("ok", "warn")

    # The start is measured, from pyspark.zip as Spark's workers import it; its status is
    # what the measurement says (a busy machine may be slow: that is the finding).
    start = checks["worker start"]
    seconds = start["data"]["seconds"]
    assert start["data"]["cpu_seconds"] > 0 and seconds > 0
    assert "pyspark.zip/pyspark/__init__.py" in start["data"]["pyspark"]
    expected = "ok" if seconds < START_WARN_S else "warn" if seconds < START_LIMIT_S else "fail"
    assert start["status"] == expected
    assert rc == (1 if expected == "fail" else 0) and doc["ok"] is (expected != "fail")


def test_a_python_without_zio_spark_fails_and_names_the_fix(capsys, bare_python):
    rc = main(["doctor", "--python", bare_python])
    out = capsys.readouterr().out
    assert rc == 1
    line = next(x for x in out.splitlines() if "zio-spark:" in x)
    assert line.lstrip().startswith("FAIL") and "cannot import zio_spark" in line
    assert f"{bare_python} -m pip install <zio-spark wheel or source folder>" in out
    assert f"export PYSPARK_PYTHON={sys.executable}" in out
    import pyspark

    assert f"{bare_python} -m pip install 'pyspark=={pyspark.__version__}'" in out
    assert re.search(r"\d+ ok, 0 fixed, \d+ warnings, [1-9]\d* failed", out), out


def test_the_environment_s_pythons_are_checked_each(capsys, monkeypatch, bare_python):
    """No --python: the driver side runs this venv, the executors a bare Python; the
    failure is the executors', tagged so."""
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    monkeypatch.setenv("PYSPARK_PYTHON", bare_python)
    rc, doc = doctor_json(capsys)
    assert rc == 1 and doc["ok"] is False
    assert [p["path"] for p in doc["pythons"]] == [sys.executable, bare_python]
    checks = by_name(doc)
    assert checks["zio-spark [driver-side]"]["status"] == "ok"
    bad = checks["zio-spark [executors]"]
    assert bad["status"] == "fail" and "PYSPARK_PYTHON" in bad["fix"]
    assert checks["pyspark [executors]"]["status"] == "fail"


def test_what_each_missing_spark_hook_degrades():
    """The capability table as doctor reports it, for the hooks Spark 4.0's pyspark has
    (what the probe found in pyspark 4.0.5) and for a pyspark without the API (3.5)."""
    from zio_spark.cli.doctor import _capability_checks

    spark40 = {"stream_api": True, "arrow_writer": True}
    checks = {c.name: c for c in _capability_checks(spark40, "4.0.5", "")}
    assert checks["spark: stream API"].status == "ok"
    assert checks["spark: DataSourceArrowWriter"].status == "ok"
    assert checks["spark: DataSourceStreamArrowWriter"].status == "ok"  # Arrow either way
    assert "through DataSourceArrowWriter" in checks["spark: DataSourceStreamArrowWriter"].detail
    warned = {n: c.detail for n, c in checks.items() if c.status == "warn"}
    assert set(warned) == {
        "spark: latestOffset(start, limit)",
        "spark: admission control",
        "spark: SupportsTriggerAvailableNow",
        "spark: reportLatestOffset",
    }
    assert "maxRecordsPerTrigger is refused at load()" in warned["spark: admission control"]
    assert "runs as one batch" in warned["spark: SupportsTriggerAvailableNow"]
    assert "never to lastProgress" in warned["spark: reportLatestOffset"]

    (unusable,) = _capability_checks({"stream_api": False}, "3.5.1", "")
    assert unusable.status == "fail" and "cannot run at all" in unusable.detail
    assert "Databricks Runtime 15.4 LTS" in unusable.fix


def _stripped_spark_home(root: Path) -> Path:
    """A SPARK_HOME whose python/lib holds copies of this pyspark's zips, without bytecode."""
    import pyspark

    src = Path(pyspark.__file__).parent / "python" / "lib"
    lib = root / "spark" / "python" / "lib"
    lib.mkdir(parents=True)
    for z in src.glob("*.zip"):
        with zipfile.ZipFile(z) as zin, zipfile.ZipFile(lib / z.name, "w") as zout:
            for info in zin.infolist():
                if not info.filename.endswith(".pyc"):
                    zout.writestr(info, zin.read(info))
    return root / "spark"


def test_fix_precompiles_the_zip_spark_s_workers_import(capsys, monkeypatch, tmp_path):
    import pyspark

    home = _stripped_spark_home(tmp_path)
    monkeypatch.setenv("SPARK_HOME", str(home))
    own = Path(pyspark.__file__).parent / "python" / "lib" / "pyspark.zip"
    own_before = own.stat().st_mtime_ns

    _, doc = doctor_json(capsys, "--python", sys.executable)
    before = by_name(doc)["pyspark.zip bytecode"]
    assert before["status"] == "warn" and "--fix" in before["fix"]
    assert f"{home}/python/lib/pyspark.zip" in by_name(doc)["worker start"]["data"]["pyspark"]

    _, doc = doctor_json(capsys, "--python", sys.executable, "--fix")
    fixed = by_name(doc)["pyspark.zip bytecode"]
    assert fixed["status"] == "fixed", fixed
    with zipfile.ZipFile(home / "python" / "lib" / "pyspark.zip") as z:
        assert "pyspark/__init__.pyc" in z.namelist()

    _, doc = doctor_json(capsys, "--python", sys.executable)
    assert by_name(doc)["pyspark.zip bytecode"]["status"] == "ok"
    assert own.stat().st_mtime_ns == own_before  # only the zips of SPARK_HOME were touched


def _loopback(host: str) -> bool:
    return ipaddress.ip_address(host.split("%")[0]).is_loopback


def test_doctor_sends_nothing_to_a_non_loopback_address(capsys, monkeypatch, bare_python):
    """Every datagram doctor's process sends is recorded: with the default broadcast
    address nothing is sent and ZRE is 'not checked'; with a loopback one, exactly one
    datagram goes there (the round trip)."""
    sent: list[tuple[str, int]] = []
    real_sendto = socket.socket.sendto

    def sendto(self: socket.socket, data: bytes, *args: Any) -> int:
        sent.append(args[-1])
        return real_sendto(self, data, *args)

    def refuse(self: socket.socket, *args: Any) -> Any:
        raise AssertionError(f"doctor used {args!r} on a socket: only sendto is expected")

    monkeypatch.setattr(socket.socket, "sendto", sendto)
    for name in ("send", "sendall", "sendmsg"):
        monkeypatch.setattr(socket.socket, name, refuse)

    monkeypatch.setenv("ZIO_ZRE_BROADCAST", "255.255.255.255")
    _, doc = doctor_json(capsys, "--python", bare_python)
    zre = by_name(doc)["ZRE broadcast"]
    assert zre["status"] == "not checked" and "zio-spark peers" in zre["fix"]
    assert sent == []

    monkeypatch.setenv("ZIO_ZRE_BROADCAST", "127.255.255.255")
    _, doc = doctor_json(capsys, "--python", bare_python)
    assert by_name(doc)["ZRE broadcast"]["status"] == "ok"
    assert [host for host, _ in sent] == ["127.255.255.255"]
    assert all(_loopback(host) for host, _ in sent)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_no_process_of_doctor_sends_off_host(tmp_path, bare_python):
    """The same, for doctor and every process it starts (the probes, java), seen by
    strace: no sendto/sendmsg to a non-loopback address, and no connect to one except on
    a UDP socket (a route lookup: a UDP connect sends nothing)."""
    trace = tmp_path / "trace"
    env = dict(os.environ, ZIO_ZRE_BROADCAST="255.255.255.255")
    cmd = ["strace", "-f", "-qq", "-o", str(trace)]
    cmd += ["-e", "trace=socket,connect,sendto,sendmsg,sendmmsg"]
    cmd += [sys.executable, "-m", "zio_spark.cli.main", "doctor", "--python", bare_python]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert r.returncode == 1, r.stderr  # the bare Python fails its checks
    assert "ZRE broadcast: beacons go to 255.255.255.255" in r.stdout
    udp: set[tuple[str, str]] = set()
    addresses = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')
    checked = 0
    for line in trace.read_text().splitlines():
        pid, call = line.split(maxsplit=1)  # strace pads the pid column
        m = re.match(r"socket\(AF_INET6?, SOCK_DGRAM\b.*\) = (\d+)", call)
        if m:
            udp.add((pid, m.group(1)))
            continue
        hosts = [a or b for a, b in addresses.findall(call)]
        if not hosts or all(_loopback(h) for h in hosts):
            continue
        checked += 1
        m = re.match(r"connect\((\d+),", call)
        assert m and (pid, m.group(1)) in udp, f"sent off-host: {line}"
    assert checked >= 1  # the route lookup toward 255.255.255.255 was seen and judged
