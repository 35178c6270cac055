"""Shared pieces of the reliability (chaos) suite.

- :func:`chaos_rng`: one seeded RNG per test, the seed printed (``ZIO_CHAOS_SEED`` replays
  a run: every kill moment is drawn from it).
- :class:`Child`: a child process in a session of its own, killed as a whole tree (the
  signal/kill/stop logic is :class:`test_sink_driver_kill.Driver`'s; only the command
  differs). Used for Spark drivers (whose JVM and Python workers must die with them) and
  for producers.
- :class:`KillPlan`: kill moments as (progress target, extra random delay) pairs, so the
  kills spread over a run whatever the machine's speed, each at a random moment.
- :func:`committed_parquet`: the files a Spark parquet sink has committed (its
  ``_spark_metadata`` log), the way ``spark.read.parquet`` sees them, without a session.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from tests.spark.test_sink_driver_kill import Driver
from tests.support import wait_until

__all__ = [
    "ROOT",
    "Child",
    "KillPlan",
    "ParquetProgress",
    "chaos_rng",
    "check_exactly_once",
    "child_env",
    "committed_parquet",
    "run_with_kills",
    "seq_report",
    "size_params",
    "wait_until",
]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def size_params(sizes: dict[str, tuple[Any, ...]], ci_by_default: bool = True) -> list[Any]:
    """The ``size`` parameters of a chaos test whose ``sizes`` rows end with the test's
    timeout (s): ``ci`` in the default run (else behind ``-m chaos`` too), ``full``
    behind ``-m chaos``."""
    ci = [pytest.mark.timeout(sizes["ci"][-1])] + ([] if ci_by_default else [pytest.mark.chaos])
    return [
        pytest.param("ci", marks=ci),
        pytest.param("full", marks=[pytest.mark.chaos, pytest.mark.timeout(sizes["full"][-1])]),
    ]


def chaos_rng(name: str) -> tuple[int, random.Random]:
    """A seeded RNG for one test; the seed is printed so a failure can be replayed with
    ``ZIO_CHAOS_SEED=<seed>``."""
    env = os.environ.get("ZIO_CHAOS_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(1 << 31)
    print(f"{name}: seed {seed} (replay with ZIO_CHAOS_SEED={seed})", flush=True)
    return seed, random.Random(seed)


def child_env() -> dict[str, str]:
    """Environment for children: loopback Spark, this interpreter, the repo importable."""
    env = dict(os.environ)
    path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    env.update(
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join(path),
        PYTHONUNBUFFERED="1",
    )
    return env


class Child(Driver):
    """``python tests/reliability/<script> args...`` in its own session, output to ``log``.

    Inherits ``signal``/``kill``/``stop`` (process group plus every descendant, reaped).
    ``env``: more variables for this child only (e.g. CURVE keys, which so never appear
    in its command line or a file)."""

    def __init__(
        self, script: str, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.log = log
        self.tree: set[int] = set()
        cmd = [sys.executable, str(HERE / script), *map(str, args)]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=str(ROOT),
                env={**child_env(), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def lines(self, prefix: str) -> list[str]:
        """Output lines starting with ``prefix``, without it."""
        text = self.log.read_text(errors="replace")
        return [ln[len(prefix) :].strip() for ln in text.splitlines() if ln.startswith(prefix)]

    def line(self, prefix: str) -> str | None:
        """The last output line starting with ``prefix``, if any; fails if the child has
        exited without printing one."""
        found = self.lines(prefix)
        if found:
            return found[-1]
        if self.proc.poll() is not None:
            code = self.proc.returncode
            raise AssertionError(f"{self.log.name}: exited {code}:\n{self.output()}")
        return None


@dataclass
class KillPlan:
    """Kills of one kind of process: kill ``i`` comes once progress reaches
    ``targets[i]`` and then ``delays[i]`` more seconds have passed."""

    what: str
    targets: list[int]
    delays: list[float]
    armed_at: float | None = None  # when the next kill's target was reached
    done: list[tuple[float, int]] = field(default_factory=list)  # (time, progress) of kills

    @classmethod
    def draw(
        cls,
        rng: random.Random,
        what: str,
        kills: int,
        total: int,
        max_delay: float,
        upto: float = 0.7,
    ) -> KillPlan:
        """``kills`` targets uniform in 5 %..``upto`` of ``total``, delays uniform in
        0..max_delay."""
        targets = sorted(int(total * rng.uniform(0.05, upto)) for _ in range(kills))
        delays = [round(rng.uniform(0.0, max_delay), 3) for _ in range(kills)]
        plan = cls(what, targets, delays)
        print(f"{what} kills at progress {targets}, then delays {delays} s", flush=True)
        return plan

    def due(self, progress: int, now: float) -> bool:
        """True when the next kill should happen now."""
        k = len(self.done)
        if k >= len(self.targets):
            return False
        if self.armed_at is None:
            if progress < self.targets[k]:
                return False
            self.armed_at = now
        return now - self.armed_at >= self.delays[k]

    def record(self, t: float, progress: int) -> None:
        self.done.append((round(t, 2), progress))
        self.armed_at = None

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.targets)


def run_with_kills(
    progress: Callable[[], int],
    total: int,
    plans: dict[str, tuple[KillPlan, Callable[[], None]]],
    timeout: float,
    what: str,
    more_after_kills: bool = False,
    stall: float = 150.0,
) -> float:
    """Poll ``progress()`` until it reaches ``total`` and every plan has run (and, with
    ``more_after_kills``, has grown since the last kill: the restarted process did work);
    perform each plan's kill-and-restart action when due. Fails after ``timeout`` seconds,
    or once progress has not moved for ``stall`` seconds (a restart takes well under a
    minute). Returns the elapsed seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    moved, seen = t0, -1
    while True:
        now = time.monotonic()
        done = progress()
        if done != seen:
            moved, seen = now, done
        elif now - moved > stall:
            kills = {k: p.done for k, (p, _) in plans.items()}
            raise AssertionError(
                f"stalled: {what} stuck at {done}/{total} for {stall:g} s, kills {kills}"
            )
        for plan, action in plans.values():
            if plan.due(done, now):
                action()
                plan.record(now - t0, done)
                print(f"{now - t0:7.2f} s: killed {plan.what} at progress {done}", flush=True)
        last = max((p for plan, _ in plans.values() for _, p in plan.done), default=-1)
        finished = all(p.finished for p, _ in plans.values())
        if done >= total and finished and (done > last or not more_after_kills):
            return now - t0
        if now > deadline:
            kills = {k: p.done for k, (p, _) in plans.items()}
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}: progress {done}/{total}, "
                f"kills {kills}"
            )
        time.sleep(0.1)


# ------------------------------------------------------------------ parquet sink output


def _log_entries(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    if not lines or lines[0] != "v1":
        raise AssertionError(f"{path}: not a v1 file sink log: {lines[:1]}")
    return [json.loads(ln) for ln in lines[1:] if ln.strip()]


def committed_parquet(out: Path) -> list[Path]:
    """Files of a parquet sink that its ``_spark_metadata`` log lists (the latest
    ``N.compact`` plus every later batch file): files of batches killed before their
    commit are on disk but not listed, and must not be counted."""
    meta = out / "_spark_metadata"
    if not meta.is_dir():
        return []
    batches: dict[int, Path] = {}
    compacts: dict[int, Path] = {}
    for p in meta.iterdir():
        stem, _, ext = p.name.partition(".")
        if not stem.isdigit() or ext not in ("", "compact"):
            continue  # temp and checksum files
        (compacts if ext else batches)[int(stem)] = p
    base = max(compacts, default=-1)
    logs = ([compacts[base]] if base >= 0 else []) + [
        batches[b] for b in sorted(batches) if b > base
    ]
    files: dict[str, Path] = {}
    for log in logs:
        for e in _log_entries(log):
            if e.get("action", "add") == "add":
                files[e["path"]] = Path(unquote(urlparse(e["path"]).path))
            else:
                files.pop(e["path"], None)
    return list(files.values())


class ParquetProgress:
    """Committed rows of a parquet sink, counted from file footers (cached per file)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._rows: dict[Path, int] = {}

    def __call__(self) -> int:
        import pyarrow.parquet as pq

        total = 0
        for f in committed_parquet(self.out):
            if f not in self._rows:
                self._rows[f] = pq.ParquetFile(f).metadata.num_rows
            total += self._rows[f]
        return total

    def orphans(self) -> int:
        """Parquet files on disk that no committed batch lists (from killed batches)."""
        listed = set(committed_parquet(self.out))
        return sum(1 for f in self.out.glob("*.parquet") if f not in listed)


def _ranges(xs: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1..3, 7"`` (first 10 ranges)."""
    out: list[list[int]] = []
    for x in sorted(xs):
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    text = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in out[:10])
    return text + (f", ... ({len(out)} ranges)" if len(out) > 10 else "")


def seq_report(seqs: list[int], n: int) -> str:
    """What differs between ``seqs`` and ``1..n`` exactly once: missing, duplicated, extra."""
    count = collections.Counter(seqs)
    missing = [s for s in range(1, n + 1) if s not in count]
    dups = [s for s, c in count.items() if c > 1]
    extra = [s for s in count if not 1 <= s <= n]
    return (
        f"{len(seqs)} rows for {n} records: {len(missing)} missing ({_ranges(missing)}), "
        f"{len(dups)} duplicated ({_ranges(dups)}), {len(extra)} out of range ({_ranges(extra)})"
    )


def check_exactly_once(table: Any, counts: Mapping[str, int]) -> None:
    """The source chaos tests' verdict on their output (a pyarrow table with ``seq``,
    ``value``, ``producer``): records ``1..n`` of each producer of ``counts`` exactly
    once, each with its own value (``b"r<seq>"``, as the producer children send them), and
    no row of another producer."""
    producers = table.column("producer").to_pylist()
    seqs = table.column("seq").to_pylist()
    values = table.column("value").to_pylist()
    assert set(producers) <= set(counts), sorted(set(producers) - set(counts))
    for p, n in sorted(counts.items()):
        mine = [(s, v) for q, s, v in zip(producers, seqs, values, strict=True) if q == p]
        assert sorted(s for s, _ in mine) == list(range(1, n + 1)), (
            f"{p}: {seq_report([s for s, _ in mine], n)}"
        )
        bad = [(s, v) for s, v in mine if v != b"r%d" % s]
        assert not bad, f"{p}: {len(bad)} records whose value is not their seq's, e.g. {bad[:3]}"
