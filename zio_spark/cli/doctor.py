"""``zio-spark doctor``: check what users get wrong before Spark says it obscurely.

Each check has a status (``ok``, ``warn``, ``fail``, ``not checked``; ``fixed`` after
``--fix``), what was found and, when it is not ok, the fix. Exit 1 when a check fails;
warnings exit 0.

Which Python: Spark starts its own Python processes and finds the interpreter in the
environment only. The driver-side ones (the ``pyspark_*`` data source lookup, the
streaming source runner) run ``$PYSPARK_DRIVER_PYTHON``, else ``$PYSPARK_PYTHON``, else
``python3``; executors run ``$PYSPARK_PYTHON``, else ``python3`` (FACTS: "JVM Spark
applications and Python data sources"). Each distinct one is asked, in a subprocess
(:mod:`zio_spark.cli.doctor_probe`), what it has: zio-spark, the *same* pyspark as this
process, the Python data source hooks (by ``hasattr``/``inspect.signature``, never by
version number), a draft pyzmq. ``--python PATH`` checks that Python instead.

Start-up: Spark gives a fresh Python worker a fixed 10 s to connect back. The check times
a fresh process that imports what the streaming runner imports, from where Spark makes it
import it (``pyspark.zip`` first on ``PYTHONPATH``), plus ``pyspark_zio``; above 5 s it
warns, at 10 s it fails (a query started now would die with "Python worker failed to
connect back"). ``pyspark.zip`` keeps no bytecode unless it was precompiled; ``--fix``
precompiles it (``<python> -m zio_spark.cli.precompile``), and only then.

Network: the ZRE check sends one datagram, and only to a loopback broadcast address
(``$ZIO_ZRE_BROADCAST`` in 127.0.0.0/8). For any other broadcast address it sends nothing
and says "not checked": whether beacons reach other hosts can only be seen on the real
network, with ``zio-spark peers`` on two hosts.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from zio_spark.cli.common import EXIT_CHECK_FAILED, EXIT_OK

__all__ = ["Check", "run_doctor", "worker_pythons"]

START_LIMIT_S = 10.0
"""Spark's fixed wait for a fresh Python worker to connect back (not a setting)."""
START_WARN_S = 5.0
PROBE_TIMEOUT_S = 120.0
"""Longest wait for one probe subprocess (a busy machine can be slow; a hung one is not)."""
ZRE_ECHO_TIMEOUT_S = 5.0

OK, WARN, FAIL, NOT_CHECKED, FIXED = "ok", "warn", "fail", "not checked", "fixed"


@dataclass
class Check:
    """One finding: ``name``, ``status``, what was found, and the fix when not ok."""

    name: str
    status: str
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Target:
    """A Python Spark will start: its path, who it serves and where the choice came from."""

    path: str
    roles: list[str]
    source: str


# -- which Python -------------------------------------------------------------------------


def _resolve(name: str) -> str | None:
    found = shutil.which(name) if os.sep not in name else name
    return os.path.abspath(found) if found else None


def worker_pythons(env: dict[str, str] | None = None) -> list[Target]:
    """The Pythons Spark will start, from the environment as Spark reads it, deduplicated
    (by path): driver-side first, then executors."""
    env = dict(os.environ if env is None else env)
    driver_src = next(
        (f"${v}" for v in ("PYSPARK_DRIVER_PYTHON", "PYSPARK_PYTHON") if env.get(v)), "python3"
    )
    driver = env[driver_src[1:]] if driver_src.startswith("$") else "python3"
    worker_src = "$PYSPARK_PYTHON" if env.get("PYSPARK_PYTHON") else "python3"
    worker = env.get("PYSPARK_PYTHON") or "python3"
    targets: list[Target] = []
    for name, src, role in (
        (driver, driver_src, "driver-side (data source lookup, streaming runner)"),
        (worker, worker_src, "executors"),
    ):
        path = _resolve(name) or name
        for t in targets:
            if t.path == path:  # not realpath: a venv's python is a symlink to its base
                t.roles.append(role)
                break
        else:
            how = (
                f"{src} = {name}" if src.startswith("$") else "python3 on PATH: no $PYSPARK_PYTHON"
            )
            targets.append(Target(path, [role], how))
    return targets


# -- running the probe -----------------------------------------------------------------


def _probe_source() -> str:
    return resources.files("zio_spark.cli").joinpath("doctor_probe.py").read_text("utf-8")


def _run_probe(
    python: str, job: str, env: dict[str, str] | None = None
) -> tuple[dict[str, Any] | None, str, float, float]:
    """Run the probe's ``job`` in ``python`` (a fresh process in an empty folder, so
    nothing in the current folder shadows a module). Returns (result or None, error text,
    wall seconds, CPU seconds of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="zio-doctor-") as cwd:
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                [python, "-c", _probe_source(), job],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                cwd=cwd,
                env=env,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{type(e).__name__}: {e}", time.monotonic() - t0, 0.0
        wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return None, tail, wall, cpu
    try:
        return json.loads(lines[-1]), "", wall, cpu
    except ValueError:
        return None, f"unreadable probe output: {lines[-1][:200]!r}", wall, cpu


# -- checks ----------------------------------------------------------------------------


def _this_pyspark() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pyspark")
        except PackageNotFoundError:
            pass
        from pyspark.version import __version__

        return str(__version__)
    except ImportError:
        return None


def _install_fix(python: str) -> str:
    return (
        f"install zio-spark into {python} ({python} -m pip install <zio-spark wheel or "
        "source folder>), or point PYSPARK_PYTHON (and PYSPARK_DRIVER_PYTHON, if set) at "
        f"a Python that has it, e.g. export PYSPARK_PYTHON={sys.executable}"
    )


def _python_checks(t: Target, tag: str, fix: bool) -> list[Check]:
    """Everything asked of one Python Spark will start."""
    py = t.path
    found = f"{py} ({t.source}; runs {' and '.join(t.roles)})"
    if not os.path.exists(py) and shutil.which(py) is None:
        return [
            Check(
                f"python{tag}",
                FAIL,
                f"{found}: not found",
                "set PYSPARK_PYTHON to the full path of a Python that has zio-spark, "
                f"e.g. export PYSPARK_PYTHON={sys.executable}",
            )
        ]
    info, err, _, _ = _run_probe(py, "probe")
    if info is None:
        return [
            Check(
                f"python{tag}",
                FAIL,
                f"{found}: cannot run the probe: {err}",
                f"set PYSPARK_PYTHON to a working Python 3.10+, e.g. {sys.executable}",
            )
        ]
    checks = [Check(f"python{tag}", OK, f"{py}: Python {info['python']}", data=info)]
    zs, pa, ps = info["zio_spark"], info["pyarrow"], info["pyspark"]
    if zs["ok"] and pa["ok"]:
        checks.append(Check(f"zio-spark{tag}", OK, f"{zs['version']} at {zs['path']}"))
    else:
        pairs = (("zio_spark", zs), ("pyarrow", pa))
        missing = [f"{n} ({m['error']})" for n, m in pairs if not m["ok"]]
        checks.append(
            Check(
                f"zio-spark{tag}",
                FAIL,
                f"{py} cannot import {', '.join(missing)}: Spark's Python workers would fail "
                "(DATA_SOURCE_NOT_FOUND at the lookup, No module named 'zio_spark' in tasks)",
                _install_fix(py),
            )
        )
    mine = _this_pyspark()
    if not ps["ok"]:
        checks.append(
            Check(
                f"pyspark{tag}",
                FAIL,
                f"{py} cannot import pyspark ({ps['error']})",
                f"{py} -m pip install 'pyspark=={mine}'"
                if mine
                else f"{py} -m pip install pyspark (the version your Spark runs)",
            )
        )
    elif mine is not None and ps["version"] != mine:
        checks.append(
            Check(
                f"pyspark{tag}",
                FAIL,
                f"{py} has pyspark {ps['version']}, this Python ({sys.executable}) has "
                f"{mine}: driver and workers must run the same Spark",
                f"{py} -m pip install 'pyspark=={mine}', or run both from one venv",
            )
        )
    else:
        same = "the same as this Python's" if mine else f"this Python ({sys.executable}) has none"
        checks.append(Check(f"pyspark{tag}", OK, f"{ps['version']} ({same})"))
    if ps["ok"]:
        checks += _capability_checks(ps["capabilities"], ps["version"], tag)
    if zs["ok"] and ps["ok"]:
        pz = info["pyspark_zio"]
        if pz["ok"]:
            checks.append(Check(f"data source module{tag}", OK, "pyspark_zio imports"))
        else:
            checks.append(
                Check(
                    f"data source module{tag}",
                    FAIL,
                    f"importing pyspark_zio in {py} raises {pz['error']}: Spark's lookup then "
                    "skips every Python data source (DATA_SOURCE_NOT_FOUND)",
                    "use a pyspark this zio-spark supports (see the capability checks), "
                    "or reinstall zio-spark",
                )
            )
    if zs["ok"]:
        checks.append(_draft_check(info["zmq"], py, tag))
    else:
        checks.append(
            Check(f"draft pyzmq{tag}", NOT_CHECKED, "pyzmq comes with zio-spark (see above)")
        )
    if zs["ok"] and ps["ok"] and info["pyspark_zio"]["ok"]:
        checks += _startup_checks(py, ps, tag, fix)
    return checks


# (key, name, what it gives, what degrades without it, status without it)
_CAPABILITIES = (
    (
        "stream_api",
        "stream API",
        "DataSourceStreamReader/DataSourceStreamWriter",
        "zio-spark cannot run at all: pyspark 3.5 (open source) has no Python streaming "
        "data source API; it needs Spark 4.0+ or Databricks Runtime 15.4 LTS+",
        FAIL,
    ),
    (
        "latest_offset_start_limit",
        "latestOffset(start, limit)",
        "Spark hands the read limit to the source",
        "Spark calls latestOffset() with no arguments, so no read limit reaches the source "
        "(zio-spark takes either form)",
        WARN,
    ),
    (
        "admission_control",
        "admission control",
        "pyspark.sql.streaming.datasource ReadMaxRows, getDefaultReadLimit",
        "maxRecordsPerTrigger is refused at load() (Spark 4.0/4.1, Databricks 17.3/18 LTS)",
        WARN,
    ),
    (
        "trigger_available_now",
        "SupportsTriggerAvailableNow",
        "Trigger.AvailableNow runs batch by batch up to the position taken at its start",
        "Trigger.AvailableNow runs as one batch (Spark logs 'Falling back to single batch "
        "execution'), holding what the producers had when it started",
        WARN,
    ),
    (
        "report_latest_offset",
        "reportLatestOffset",
        "the source's backlog shows in the query progress",
        "the source's backlog metrics go to its log, never to lastProgress",
        WARN,
    ),
    (
        "stream_arrow_writer",
        "DataSourceStreamArrowWriter",
        "the streaming sink receives Arrow batches",
        "the streaming sink takes Arrow through DataSourceArrowWriter instead "
        "(Spark 4.0); nothing is lost when that one is present",
        OK,
    ),
    (
        "arrow_writer",
        "DataSourceArrowWriter",
        "sinks receive Arrow batches",
        "sinks receive rows one by one, not Arrow batches (slower)",
        WARN,
    ),
)


def _capability_checks(caps: dict[str, Any], version: str, tag: str) -> list[Check]:
    if not caps["stream_api"]:
        key, name, _, degrades, status = _CAPABILITIES[0]
        why = f" ({caps['error']})" if "error" in caps else ""
        return [
            Check(
                f"spark{tag}: {name}",
                status,
                f"pyspark {version}: missing{why}; {degrades}",
                "install pyspark 4.x (pip install 'pyspark>=4.0,<5'), or use Databricks "
                "Runtime 15.4 LTS or later",
                data={"capability": key, "present": False},
            )
        ]
    out = []
    for key, name, gives, degrades, status in _CAPABILITIES:
        present = bool(caps.get(key))
        if present:
            out.append(
                Check(
                    f"spark{tag}: {name}",
                    OK,
                    f"present: {gives}",
                    data={"capability": key, "present": True},
                )
            )
        else:
            out.append(
                Check(
                    f"spark{tag}: {name}",
                    status,
                    f"missing in pyspark {version}: {degrades}",
                    None
                    if status == OK
                    else "Spark 4.2+ (Databricks Runtime 19+) has it; zio-spark works "
                    "without it as described",
                    data={"capability": key, "present": False},
                )
            )
    return out


def _draft_check(z: dict[str, Any], py: str, tag: str) -> Check:
    if not z["ok"]:
        return Check(
            f"draft pyzmq{tag}",
            FAIL,
            f"{py} cannot import zmq ({z['error']})",
            f"{py} -m pip install pyzmq (zio-spark's dependency; reinstalling zio-spark brings it)",
        )
    where = f"pyzmq {z['version']}, libzmq {z['libzmq']}"
    if z["draft"]:
        return Check(
            f"draft pyzmq{tag}", OK, f"{where} with the draft API: socket=clientserver works"
        )
    return Check(
        f"draft pyzmq{tag}",
        WARN,
        f"{where} without the draft API: only ROUTER/DEALER (socket=routerdealer); "
        "peers with CLIENT/SERVER sockets (the ZIO reference) cannot be reached",
        "only if you need CLIENT/SERVER: build a draft pyzmq (scripts/build-draft-pyzmq.sh) "
        "into the Python Spark runs",
    )


def _bytecode(py: str, zips: list[str], check_only: bool) -> tuple[dict[str, Any] | None, str]:
    """Run ``<py> -m zio_spark.cli.precompile [--check] --json ZIP...``: whether each zip
    Spark puts on the workers' path holds bytecode ``py`` would use (with ``check_only``
    False: add it). Returns (its JSON or None, the last line it printed otherwise)."""
    cmd = [py, "-m", "zio_spark.cli.precompile", "--json", *(["--check"] if check_only else [])]
    cmd += zips
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    lines = r.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "zips" not in doc:
        text = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}").splitlines()
        return None, text[-1]
    return doc, ""


def _bytecode_detail(doc: dict[str, Any]) -> str:
    parts = []
    for z in doc["zips"]:
        if z.get("error"):
            parts.append(f"{z['path']}: {z['error']}")
        else:
            parts.append(f"{os.path.basename(z['path'])}: {z['compiled']} of {z['sources']}")
    return "modules with bytecode for this Python: " + "; ".join(parts)


def _startup_checks(py: str, ps: dict[str, Any], tag: str, fix: bool) -> list[Check]:
    z = ps["zip"]
    name = f"pyspark.zip bytecode{tag}"
    if not z.get("exists"):
        return [
            Check(
                f"worker start{tag}",
                NOT_CHECKED,
                f"no {z['path']}: not a pip-installed pyspark or a Spark distribution, so "
                "how Spark's workers import pyspark here is unknown",
            )
        ]
    out: list[Check] = []
    zips = [z["path"], *ps.get("py4j_zips", [])]
    doc, err = _bytecode(py, zips, check_only=True)
    how = f"{py} -m zio_spark.cli.precompile"
    if doc is None:
        out.append(Check(name, NOT_CHECKED, f"{how} --check did not answer: {err}"))
    elif doc.get("precompiled"):
        out.append(Check(name, OK, f"precompiled; {_bytecode_detail(doc)}", data=doc))
    elif not fix:
        out.append(
            Check(
                name,
                WARN,
                f"not precompiled: every fresh worker compiles pyspark anew (~1 CPU-s); "
                f"{_bytecode_detail(doc)}",
                f"zio-spark doctor --python {py} --fix (runs {how} on those zips, which "
                "rewrites them in place; run it while no Spark job of that install runs)",
                data=doc,
            )
        )
    else:
        after, err = _bytecode(py, zips, check_only=False)
        if after is not None and after.get("precompiled"):
            out.append(Check(name, FIXED, f"precompiled by --fix; {_bytecode_detail(after)}"))
        else:
            why = _bytecode_detail(after) if after is not None else err
            out.append(Check(name, FAIL, f"--fix could not precompile: {why}", f"run {how}"))
    out.append(_time_start(py, ps, tag))
    return out


def _time_start(py: str, ps: dict[str, Any], tag: str) -> Check:
    z = ps["zip"]
    env = dict(os.environ)
    path = [z["path"], *ps.get("py4j_zips", [])]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    result, err, wall, cpu = _run_probe(py, "start", env)
    load = os.getloadavg()[0]
    data = {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "load": round(load, 2)}
    measured = f"{wall:.2f} s ({cpu:.2f} CPU-s, load {load:.1f})"
    name = f"worker start{tag}"
    if result is None:
        return Check(
            name,
            FAIL,
            f"a fresh worker could not import the streaming runner and pyspark_zio: {err}",
            _install_fix(py),
            data,
        )
    data["pyspark"] = result["pyspark"]
    if ".zip" not in result["pyspark"]:
        return Check(
            name,
            NOT_CHECKED,
            f"took {measured}, but pyspark came from {result['pyspark']}, not {z['path']}: "
            "not what Spark's workers import",
            data=data,
        )
    if wall >= START_LIMIT_S:
        return Check(
            name,
            FAIL,
            f"a fresh worker took {measured} to import the streaming runner and "
            f"pyspark_zio: over Spark's fixed {START_LIMIT_S:g} s, a query started now would "
            "fail with 'Python worker failed to connect back'",
            "precompile pyspark.zip (zio-spark doctor --fix) and start queries when the "
            "machine is less busy",
            data,
        )
    if wall >= START_WARN_S:
        return Check(
            name,
            WARN,
            f"a fresh worker took {measured}; Spark allows {START_LIMIT_S:g} s",
            "precompile pyspark.zip (zio-spark doctor --fix); a busier machine may cross the limit",
            data,
        )
    return Check(name, OK, f"{measured}; Spark allows {START_LIMIT_S:g} s", data=data)


_JAVA_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?[^"]*"')


def _java_check(pyspark_version: str | None) -> Check:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    needed = 17 if pyspark_version is None or not pyspark_version.startswith("3.") else 8
    connect = bool(os.environ.get("SPARK_REMOTE"))
    missing = WARN if connect else FAIL
    fix = (
        f"install a JDK {needed} or later (e.g. apt-get install openjdk-17-jre-headless) and "
        "set JAVA_HOME"
        + (" (a Spark Connect client, $SPARK_REMOTE, needs none)" if not connect else "")
    )
    if not java or not os.path.exists(java):
        where = f"$JAVA_HOME/bin/java ({java})" if home else "java on PATH"
        return Check("java", missing, f"no {where}", fix)
    try:
        r = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("java", missing, f"{java} -version failed: {e}", fix)
    m = _JAVA_VERSION.search(r.stderr + r.stdout)
    if m is None:
        return Check("java", missing, f"{java} -version printed no version", fix)
    major = int(m.group(1))
    if major == 1 and m.group(2):  # 1.8.0_392 is Java 8
        major = int(m.group(2))
    spark = f"Spark {pyspark_version}" if pyspark_version else "Spark 4"
    detail = f"{java}: Java {major} ({m.group(0)})"
    if major < needed:
        return Check("java", missing, f"{detail}; {spark} needs Java {needed}+", fix)
    return Check("java", OK, detail, data={"java": java, "major": major})


def _zre_check() -> Check:
    from zio_spark.transport.zre_node import BROADCAST_ENV, DEFAULT_BROADCAST, INTERFACE_ENV

    text = os.environ.get(BROADCAST_ENV) or DEFAULT_BROADCAST
    origin = f"${BROADCAST_ENV}" if os.environ.get(BROADCAST_ENV) else "the default"
    try:
        addr = ipaddress.IPv4Address(text)
    except ValueError:
        return Check(
            "ZRE broadcast",
            FAIL,
            f"{origin} broadcast address {text!r} is not an IPv4 address",
            f"set {BROADCAST_ENV} to an IPv4 broadcast address, e.g. 127.255.255.255 "
            "(this host only) or your subnet's",
        )
    if not addr.is_loopback:
        source = _route_source(str(addr))
        return Check(
            "ZRE broadcast",
            NOT_CHECKED,
            f"beacons go to {addr} ({origin}), leaving from {source}; doctor sends nothing "
            "to a non-loopback address, so whether other hosts hear them is not checked",
            f"check with `zio-spark peers --group G` on two hosts; on one host only, set "
            f"{BROADCAST_ENV}=127.255.255.255 and {INTERFACE_ENV}=127.0.0.1",
            data={"broadcast": str(addr), "source": source},
        )
    return _loopback_round_trip(addr, origin)


def _route_source(broadcast: str) -> str:
    """The source address the kernel picks for ``broadcast`` (a UDP connect: sends nothing)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        s.connect((broadcast, 9))
        return str(s.getsockname()[0])
    except OSError as e:
        return f"nowhere ({e})"
    finally:
        s.close()


def _loopback_round_trip(addr: ipaddress.IPv4Address, origin: str) -> Check:
    """A datagram to ``addr`` (loopback) on a port of our own, received on ``0.0.0.0``
    as a ZRE node's beacon socket receives: the path beacons take on this host."""
    assert addr.is_loopback  # the one place doctor sends: never anywhere else
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rx.bind(("0.0.0.0", 0))
        port = rx.getsockname()[1]
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        token = os.urandom(16)
        tx.sendto(b"ZIO-DOCTOR" + token, (str(addr), port))
        deadline = time.monotonic() + ZRE_ECHO_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            rx.settimeout(left)
            try:
                data, _ = rx.recvfrom(64)
            except TimeoutError:
                break
            if data.endswith(token):
                return Check(
                    "ZRE broadcast",
                    OK,
                    f"a beacon-sized datagram to {addr} ({origin}) came back on 0.0.0.0:{port}:"
                    " ZRE nodes on this host find each other",
                    data={"broadcast": str(addr), "port": port},
                )
    except OSError as e:
        return Check(
            "ZRE broadcast",
            FAIL,
            f"sending to {addr} ({origin}) failed: {e}",
            "check the loopback interface (ip addr show lo), or use explicit endpoints",
        )
    finally:
        rx.close()
        tx.close()
    return Check(
        "ZRE broadcast",
        FAIL,
        f"a datagram to {addr} ({origin}) did not come back within {ZRE_ECHO_TIMEOUT_S:g} s",
        "a firewall drops loopback broadcast: allow UDP on lo, or use explicit endpoints",
    )


# -- the command ---------------------------------------------------------------------------


def run_checks(python: str | None = None, fix: bool = False) -> tuple[list[Target], list[Check]]:
    """Every check, in order; ``python`` replaces the Pythons found in the environment."""
    if python is not None:
        targets = [Target(_resolve(python) or python, ["what --python names"], "--python")]
    else:
        targets = worker_pythons()
    checks: list[Check] = []
    for t in targets:
        tag = "" if len(targets) == 1 else f" [{t.roles[0].split(' ')[0]}]"
        checks += _python_checks(t, tag, fix)
    versions = [
        c.data["pyspark"]["version"]
        for c in checks
        if c.name.startswith("python") and c.data.get("pyspark", {}).get("ok")
    ]
    checks.append(_java_check(versions[0] if versions else _this_pyspark()))
    checks.append(_zre_check())
    return targets, checks


_MARK = {OK: "ok", WARN: "WARN", FAIL: "FAIL", NOT_CHECKED: "--", FIXED: "FIXED"}


def run_doctor(args: argparse.Namespace) -> int:
    targets, checks = run_checks(getattr(args, "python", None), bool(getattr(args, "fix", False)))
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, NOT_CHECKED, FIXED)}
    failed = counts[FAIL] > 0
    if getattr(args, "json", False):
        doc = {
            "command": "doctor",
            "ok": not failed,
            "pythons": [asdict(t) for t in targets],
            "checks": [{k: v for k, v in asdict(c).items() if k != "data" or v} for c in checks],
            "counts": counts,
        }
        print(json.dumps(doc, sort_keys=True))
    else:
        for t in targets:
            if t.source == "--python":
                print(f"Checking {t.path} (--python)")
            else:
                print(f"Spark starts {t.path} ({t.source}) for {' and '.join(t.roles)}")
        for c in checks:
            print(f"{_MARK[c.status]:>5}  {c.name}: {c.detail}")
            if c.fix:
                print(f"{'':>5}  fix: {c.fix}")
        print(
            f"{counts[OK]} ok, {counts[FIXED]} fixed, {counts[WARN]} warnings, "
            f"{counts[FAIL]} failed, {counts[NOT_CHECKED]} not checked"
        )
    return EXIT_CHECK_FAILED if failed else EXIT_OK
