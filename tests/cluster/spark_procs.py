"""Spark processes for tests: a Spark Connect server and a standalone cluster, from
pyspark's own distribution (``sbin/start-connect-server.sh``, ``bin/spark-class``).

Loopback only: every process gets ``SPARK_LOCAL_IP=127.0.0.1`` and binds 127.0.0.1 on a
free port; web UIs are off. Each process runs in its own session (process group), so
:meth:`Proc.stop` ends the JVM and every Python worker it forked, bounded in time.
``PYSPARK_PYTHON`` is this interpreter, so Python workers import this checkout's
zio_spark.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyspark

from tests.support import free_port

SPARK_HOME = Path(pyspark.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]


def spark_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, pinned to loopback and this interpreter."""
    env = dict(os.environ)
    for var in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "MASTER"):
        env.pop(var, None)
    env.update(
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_HOME=str(SPARK_HOME),
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        # The source's segment server: loopback in tests (tests/conftest.py sets it too).
        ZIO_SPOOL_SERVER_HOST="127.0.0.1",
    )
    env.update(extra or {})
    return env


class Proc:
    """A child in its own process group, output to ``log``."""

    def __init__(
        self, argv: Sequence[str], log: Path, env: Mapping[str, str], cwd: Path | None = None
    ) -> None:
        self.argv = list(argv)
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                cwd=str(cwd) if cwd else None,
                start_new_session=True,
            )
        self.pid = self.popen.pid  # also the process group id

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL whatever is left after ``timeout``, then any
        descendant in a group of its own (PySpark's worker daemons) still alive."""
        below = [(pid, _start_time(pid)) for pid in descendants(self.pid)]
        self.signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        deadline = time.monotonic() + 10  # forked children of the group
        while time.monotonic() < deadline and _group_alive(self.pid):
            self.signal_group(signal.SIGKILL)
            time.sleep(0.1)
        for pid, started in below:
            if started is not None and _start_time(pid) == started:  # not a reused pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still "exists": look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid``, its process group and every descendant (some, like PySpark's
    worker daemon, live in process groups of their own); return the pids signalled."""
    tree = [pid, *descendants(pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    return tree


def wait_tcp(port: int, proc: Proc, timeout: float, what: str) -> None:
    """Poll until 127.0.0.1:``port`` accepts; fail with the log if ``proc`` dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise AssertionError(
                f"{what} exited with {proc.popen.returncode} before listening on {port}:\n"
                f"{proc.tail()}"
            )
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"{what} not listening on {port} after {timeout} s:\n{proc.tail()}")


def wait_log(proc: Proc, text: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.log.read_text(errors="replace"):
            return
        if not proc.alive():
            raise AssertionError(f"{what} exited with {proc.popen.returncode}:\n{proc.tail()}")
        time.sleep(0.2)
    raise AssertionError(f"{what}: no {text!r} in its log after {timeout} s:\n{proc.tail()}")


def start_connect_server(
    work: Path, master: str = "local[2]", timeout: float = 180.0
) -> tuple[Proc, str]:
    """pyspark's ``sbin/start-connect-server.sh --wait`` on 127.0.0.1, a free port.

    The pip packages of pyspark 4.0 and 4.1 have the server's jar but not that script:
    there, ``bin/spark-submit`` of the server's class, as the script would run it.
    Returns the process and the ``sc://`` URL for ``SparkSession.builder.remote``.
    """
    work.mkdir(parents=True, exist_ok=True)
    script = SPARK_HOME / "sbin" / "start-connect-server.sh"
    launch = (
        [str(script), "--wait"]
        if script.is_file()
        else [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer",
        ]
    )
    last = ""
    for attempt in range(3):  # the free port may be taken before the server binds it
        port = free_port()
        env = spark_env({"SPARK_LOG_DIR": str(work / "logs"), "SPARK_PID_DIR": str(work)})
        argv = [
            "bash",
            *launch,
            "--master",
            master,
            "--conf",
            "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf",
            f"spark.connect.grpc.binding.port={port}",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            "spark.driver.bindAddress=127.0.0.1",
            "--conf",
            "spark.sql.shuffle.partitions=2",
            "--conf",
            "spark.sql.session.timeZone=UTC",
            "--conf",
            f"spark.local.dir={work / 'local'}",
        ]
        proc = Proc(argv, work / f"connect-server-{attempt}.log", env, cwd=work)
        try:
            wait_tcp(port, proc, timeout, "the Spark Connect server")
            return proc, f"sc://127.0.0.1:{port}"
        except AssertionError as e:
            proc.stop()
            last = str(e)
            if "BindException" not in last and "Address already in use" not in last:
                raise
    raise AssertionError(f"the Spark Connect server did not start in 3 attempts: {last}")
