"""Shared helpers of the benchmark scripts (not a test, not part of the library).

- :func:`spark_session`: the local[2] session every Spark benchmark uses, loopback only;
  :func:`spark_run`: that session and a scratch folder, both gone afterwards;
  :func:`zio_stream`: the zio source reading a Producer of the run.
- :func:`quick_args`: the command line of a benchmark with ``--quick`` (a short run: the
  defaults of some options change) and ``--out``.
- :func:`spread` / :func:`write_json` / :func:`md_table`: every figure is kept as its
  runs, reported as median with min-max, written as JSON for machines and printed as a
  Markdown table for the README.
- :class:`PlainGiver`: a plain ZIO giver with the reference implementation's wire shape
  (one record per DAT, label ``{"flow": "DAT"}``), for the one-record-per-DAT figure
  of the source.
- :class:`RssSampler`: resident memory of the Python driver, the driver JVM and the JVM's
  Python children (source runner, workers), read from ``/proc`` by pid.

Scripts import it as ``common`` (they run as ``python bench/<name>.py``, so ``bench/`` is
first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------- Spark


def spark_session(app: str, conf: Mapping[str, str] | None = None) -> Any:
    """local[2], bound to 127.0.0.1, no UI, errors only in the log; ``conf`` on top."""
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # The JVM's Python workers and the source runner import zio_spark / pyspark_zio.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p
    )
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextlib.contextmanager
def spark_run(app: str, conf: Mapping[str, str] | None = None) -> Iterator[tuple[Any, Path]]:
    """:func:`spark_session` and a scratch folder (``zio-<app>-*``); both gone afterwards."""
    spark = spark_session(app, conf)
    work = Path(tempfile.mkdtemp(prefix=f"zio-{app}-"))
    try:
        yield spark, work
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


def zio_stream(spark: Any, producer: Any, work: Path, **options: str) -> Any:
    """``readStream.format("zio")`` from ``producer``, spooled in a new folder under
    ``work`` (local access, 60 s to connect), with ``options`` on top."""
    reader = (
        spark.readStream.format("zio")
        .option("endpoints", producer.endpoint)
        .option("spoolPath", str(work / f"spool-{time.time_ns()}"))
        .option("spoolAccess", "local")
        .option("connectTimeout", "60s")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def jvm_pid(spark: Any) -> int | None:
    """Pid of the driver JVM: the java process among this process's descendants."""
    for pid in descendants(os.getpid()):
        if _comm(pid) == "java":
            return pid
    return None


# ----------------------------------------------------------------------------- command line


def _num(v: float) -> str:
    return f"{int(v):,}" if v == int(v) else f"{v:g}"


def quick_args(
    doc: str,
    scaled: Mapping[str, tuple[float, float, str]],
    add: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """Parse ``--quick``, the options ``add`` adds, ``scaled`` and ``--out``.

    ``scaled`` maps an option's name (``"seconds"`` for ``--seconds``) to its default in a
    full run, its default with ``--quick`` and what it is; its type is the defaults' (int
    or float). Once parsed, an option that was not given holds the default that applies.
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run (smaller defaults)")
    if add is not None:
        add(ap)
    for name, (full, quick, what) in scaled.items():
        ap.add_argument(
            f"--{name}",
            type=type(full),
            default=None,
            help=f"{what} (default {_num(full)}, quick {_num(quick)})",
        )
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    for name, (full, quick, _) in scaled.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    return a


# ----------------------------------------------------------------------------- figures


def spread(values: Sequence[float]) -> dict[str, Any]:
    """A figure over its runs: median, min, max and every run."""
    vals = [float(v) for v in values]
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "runs": vals,
    }


def fmt_spread(s: dict[str, Any], unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    def f(v: float) -> str:
        return f"{v * scale:,.{digits}f}"

    if len(s["runs"]) == 1:
        return f"{f(s['median'])}{unit}"
    return f"{f(s['median'])}{unit} ({f(s['min'])}-{f(s['max'])})"


def ratio_spread(ours: Sequence[float], anchor: Sequence[float]) -> dict[str, Any]:
    """Ratios run by run (each pair measured back to back), as a spread."""
    return spread([a / b for a, b in zip(ours, anchor, strict=True) if b])


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(out: str | Path, name: str, obj: object) -> Path:
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2), encoding="utf-8")
    tmp.replace(path)
    return path


def machine() -> dict[str, Any]:
    """What the numbers were measured on (they are noisy: say how loaded the box was)."""
    return {
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ----------------------------------------------------------------------------- producers


class PlainGiver:
    """The reference ZIO giver's wire shape, for the one-record-per-DAT figure of the
    source: a server port that answers a taker's BOT and sends ``n`` copies of
    ``value``, one per DAT labelled exactly ``{"flow": "DAT"}`` (no attributes, no
    acknowledgements: at most once, as plain ZIO is), as the taker's credit allows.

    One serving thread; :meth:`close` stops it. ``sent`` counts the DATs sent.
    """

    def __init__(self, n: int, value: bytes, mode: str = "routerdealer") -> None:
        import zmq

        from zio_spark.transport.port import ServerPort

        self.n, self.value, self.sent = n, value, 0
        self._ctx = zmq.Context()
        self._port = ServerPort(self._ctx, mode=mode, linger_ms=0, sndhwm=100_000)
        self.endpoint = self._port.bind("tcp://127.0.0.1:*")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="plain-giver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from zio_spark.errors import ProtocolError
        from zio_spark.protocol.flow import BotReceived, EotReceived, Flow, FlowState, Role
        from zio_spark.protocol.message import DatCodec
        from zio_spark.transport.port import UnknownPeerError

        port, codec, payload = self._port, DatCodec(0), (self.value,)
        flows: dict[Any, Flow] = {}
        while not self._stop.is_set():
            for item in port.recv_many(1000, 50):
                if not isinstance(item, tuple):
                    continue  # a bad message: nothing to answer
                peer, msg = item
                flow = flows.setdefault(peer, Flow(Role.SERVER))
                try:
                    event = flow.receive(msg)
                except ProtocolError:
                    del flows[peer]
                    continue
                if isinstance(event, BotReceived):
                    port.send(flow.accept(), peer)
                elif isinstance(event, EotReceived):
                    port.send(flow.send_eot(), peer)
                    del flows[peer]
            for peer, flow in list(flows.items()):
                k = min(flow.credit, self.n - self.sent)
                if k > 0 and flow.state is FlowState.READY:
                    first = flow.send_dats(k)
                    try:
                        for i in range(k):
                            port.send_dat(codec, first + i, payload, peer)
                            self.sent += 1
                    except UnknownPeerError:  # the taker went away (its query ended)
                        del flows[peer]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._port.close()
        self._ctx.term()


# ----------------------------------------------------------------------------- memory


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        out += [int(c) for c in text.split()]
    return out


def descendants(pid: int) -> list[int]:
    seen: list[int] = []
    todo = children(pid)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += children(p)
    return seen


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def classify(pid: int, jvm: int | None) -> str:
    """Role of a process of the run, from its command line."""
    if pid == os.getpid():
        return "python driver"
    if pid == jvm:
        return "driver JVM"
    cmd = cmdline(pid)
    if "python_streaming_source_runner" in cmd or "streaming_source_runner" in cmd:
        return "source runner"
    if "python" in cmd or "pyspark" in cmd:
        return "python workers"
    return "other"


def cpu_with_reaped(pid: int) -> float:
    """CPU seconds of ``pid`` (0 once it has gone): utime + stime, plus cutime + cstime,
    the time of its children already reaped (Python workers that ended between two
    samples), so each is counted once, in its parent's row."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


# Driver-side JVM threads, by the first 15 characters of their name
# (``/proc/<pid>/task/<tid>/comm``). In local mode the executors live in the driver JVM,
# so the JVM's total mixes both; these long-lived threads are the driver's own: the
# micro-batch loop (planning, offset and commit logs, the calls into the source runner),
# the DAG scheduler, task results, the listener bus (query progress) and the RPC
# dispatcher (driver and executor endpoints share it in local mode). Executor task
# threads cannot be counted this way: Spark replaces them every few seconds, and a
# thread that ended takes its counter with it.
JVM_DRIVER_THREADS = (
    "stream executio",
    "dag-scheduler-e",
    "task-result-get",
    "spark-listener-",
    "dispatcher-even",
)


def jvm_threads(jvm: int | None) -> dict[int, tuple[str, float]]:
    """``{tid: (name, CPU seconds so far)}`` of the driver JVM's live threads."""
    out: dict[int, tuple[str, float]] = {}
    if jvm is None:
        return out
    try:
        tids = os.listdir(f"/proc/{jvm}/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        base = f"/proc/{jvm}/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            fields = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def jvm_threads_used(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds between two :func:`jvm_threads` samples: ``JVM stream thread`` (the
    micro-batch loop) and ``JVM driver threads`` (all of :data:`JVM_DRIVER_THREADS`,
    the stream thread included). A thread alive at both counts its difference, one born
    between them all of its time; one that ended in between is lost (a lower bound)."""
    out = {"JVM stream thread": 0.0, "JVM driver threads": 0.0}
    for tid, (name, cpu) in after.items():
        used = cpu - before[tid][1] if tid in before else cpu
        if name.startswith(JVM_DRIVER_THREADS):
            out["JVM driver threads"] += used
            if name.startswith("stream executio"):
                out["JVM stream thread"] += used
    return out


def cpu_by_role(jvm: int | None, extra: Sequence[int] = ()) -> dict[str, float]:
    """CPU seconds so far of this process's descendants, summed per :func:`classify`
    role (``extra`` pids: ``"producers"``)."""
    groups: dict[str, float] = {}
    for pid in descendants(os.getpid()):
        role = "producers" if pid in extra else classify(pid, jvm)
        groups[role] = groups.get(role, 0.0) + cpu_with_reaped(pid)
    return groups


def _own_cpu(pid: int) -> float | None:
    """utime + stime of ``pid`` alone (None once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuTracker:
    """CPU seconds per :func:`classify` role over a window, from the processes' *own*
    time (utime + stime, without reaped children), sampled by :meth:`sample`.

    :func:`cpu_by_role` at two instants counts a child reaped in between in its
    parent's row with *all* of its time: a source runner or Python worker of the
    previous query, still ending when the window opens, then lands its whole life in
    the JVM's row (and leaves its own row negative). Here each process counts what it
    used between two samples it was seen in; one born after the first sample counts
    all of its time at the first sample it is seen in; one that ends loses what it used
    since its last sample (sample often: every 0.5 s). ``extra`` pids: ``"producers"``.
    """

    def __init__(self, jvm: int | None, extra: Sequence[int] = ()) -> None:
        self.jvm = jvm
        self.extra = set(extra)
        self.last: dict[int, float] = {}
        self.role: dict[int, str] = {}
        self.used: dict[str, float] = {}
        self.started = False

    def sample(self) -> None:
        for pid in descendants(os.getpid()):
            cpu = _own_cpu(pid)
            if cpu is None:
                continue
            role = self.role.get(pid)
            if role is None:
                role = "producers" if pid in self.extra else classify(pid, self.jvm)
                self.role[pid] = role
            if pid in self.last:
                self.used[role] = self.used.get(role, 0.0) + cpu - self.last[pid]
            elif self.started:
                self.used[role] = self.used.get(role, 0.0) + cpu  # born in the window
            else:
                self.used.setdefault(role, 0.0)
            self.last[pid] = cpu
        self.started = True


class RssSampler:
    """Samples RSS of the run's processes every ``interval`` s in a background thread.

    Groups: ``python driver`` (this process), ``driver JVM``, ``source runner`` (the
    JVM's long-lived Python process that holds the zio receiver), ``python workers``
    (the JVM's other Python processes: the daemon and its forked workers, i.e. the
    executors' Python side in local mode). Each sample is ``{"t": s, group: bytes}``.
    """

    def __init__(self, jvm: int | None, interval: float = 1.0) -> None:
        self.jvm = jvm
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        groups: dict[str, float] = {
            "python driver": 0,
            "driver JVM": 0,
            "source runner": 0,
            "python workers": 0,
        }
        groups["python driver"] = rss_bytes(os.getpid())
        workers = 0
        if self.jvm is not None:
            groups["driver JVM"] = rss_bytes(self.jvm)
            for pid in descendants(self.jvm):
                role = classify(pid, self.jvm)
                if role in groups:
                    groups[role] += rss_bytes(pid)
                    workers += role == "python workers"
        # workers_n: how many worker processes the "python workers" figure sums.
        return {"t": round(time.monotonic() - self._t0, 2), **groups, "workers_n": workers}

    def _run(self) -> None:
        while not self._stop.wait(0 if not self.samples else self.interval):
            self.samples.append(self.sample())

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)
        return self.samples


class SteadySender:
    """Feeds a Producer at ``rate`` records/s from a thread, each value stamped.

    A value is the send time (``time.time()``, little-endian double) padded to ``size``
    bytes; records go in small chunks every ``tick`` seconds so the rate is steady.
    """

    def __init__(self, producer: Any, rate: float, size: int = 100, tick: float = 0.005) -> None:
        self.producer = producer
        self.rate = rate
        self.pad = b"x" * max(0, size - 8)
        self.tick = tick
        self.sent = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-sender", daemon=True)

    def start(self) -> SteadySender:
        self._thread.start()
        return self

    def _run(self) -> None:
        import struct

        pack = struct.Struct("<d").pack
        t0 = time.monotonic()
        try:
            while not self._stop.wait(self.tick):
                due = int(self.rate * (time.monotonic() - t0)) - self.sent
                if due > 0:
                    v = pack(time.time()) + self.pad
                    self.producer.send_many([v] * due, timeout=60)
                    self.sent += due
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        if self.error is not None:
            raise RuntimeError(f"sender failed: {self.error}") from self.error
        return self.sent
