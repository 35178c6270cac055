"""The harness of the chaos tests of a source query read into parquet.

A :class:`SourceChaos` run owns what every such test spawns and checks, so that each test
states only its scenario (which producers and drivers, which kills, which verdict):

- the children (:class:`~tests.reliability.helpers.Child`: Spark drivers, producers),
  each logging to ``logs/<role>-<n>``; the one currently running per role
  (:attr:`SourceChaos.current`), and the kill-and-restart action of a role
  (:meth:`SourceChaos.restarter`);
- the committed parquet output (``out``, checkpoint ``ckpt``) and its progress, which also
  asserts that no current child has died on its own (a query failure shows there);
- :meth:`SourceChaos.run`: :func:`~tests.reliability.helpers.run_with_kills`, with the
  output's per-producer differences in the failure;
- :meth:`SourceChaos.finish`: the last checks of the children, the driver stopped, the
  committed rows read;
- every child stopped (by its own pid tree) when the run ends, passed or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tests.reliability.helpers import (
    Child,
    KillPlan,
    ParquetProgress,
    committed_parquet,
    run_with_kills,
    seq_report,
    wait_until,
)

__all__ = [
    "DIRECT_TIMEOUT",
    "READ_WAIT_S",
    "SourceChaos",
    "check_kills_hit",
    "read_committed",
    "readers",
    "wait_for_a_read",
]

COLUMNS = ("producer", "seq", "value")
READ_WAIT_S = 5.0  # a producer kill waits at most this long for a task's range read
# The direct queries' connectTimeout: a task reading a range when its giver is killed
# hears nothing more (the restarted giver never hears from a reader that waits for
# records) and fails only after it, to be retried; the driver's held query to a giver
# that is down costs a trigger this long too.
DIRECT_TIMEOUT = "10s"


def read_committed(out: Path, columns: Sequence[str] = COLUMNS) -> pa.Table:
    """Every committed row of the parquet sink (files of uncommitted batches left out)."""
    parts = [pq.read_table(f, columns=list(columns)) for f in committed_parquet(out)]
    if parts:
        return pa.concat_tables(parts)
    types = {"producer": pa.string(), "seq": pa.int64()}
    return pa.table({c: pa.array([], types.get(c, pa.binary())) for c in columns})


def readers(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` from this machine's clients: for
    a producer's port, the driver's control flow plus one per task reading a range."""
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        n += f[3] == "01" and f[2] == f"0100007F:{port:04X}"
    return n


def wait_for_a_read(endpoint: str) -> bool:
    """Wait up to :data:`READ_WAIT_S` for a task to be reading a range from the giver at
    ``endpoint`` (a second connection next to the driver's control flow), so that a kill
    cuts a read; True if one was."""
    port = int(endpoint.rsplit(":", 1)[1])
    deadline = time.monotonic() + READ_WAIT_S
    while readers(port) < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    return readers(port) >= 2


class SourceChaos:
    """One chaos run of a source query -> parquet (module docstring). A context manager:
    its children are stopped on exit."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.name = name
        self.out, self.ckpt = tmp_path / "out", tmp_path / "ckpt"
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.children: list[Child] = []
        self.current: dict[str, Child] = {}
        self.committed = ParquetProgress(self.out)
        self.t0 = time.monotonic()
        self.took = 0.0
        self.orphans = 0

    def __enter__(self) -> SourceChaos:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for c in self.children:
            c.stop(grace=5.0)

    def spawn(
        self,
        role: str,
        script: str,
        args: Iterable[object],
        env: Mapping[str, str] | None = None,
    ) -> Child:
        """``script args`` as the current ``role`` (logs ``<role>-<n>``), with ``env``
        added to its environment."""
        log = self.logs / f"{role}-{len(self.children)}"
        child = Child(script, [str(a) for a in args], log, env)
        self.children.append(child)
        self.current[role] = child
        return child

    def restarter(
        self, role: str, start: Callable[[], Child], before: Callable[[], Any] | None = None
    ) -> Callable[[], None]:
        """The kill action of ``role``: ``before()`` (e.g. wait for a read), SIGKILL the
        current one's whole tree, ``start()`` the next."""

        def action() -> None:
            if before is not None:
                before()
            self.current[role].kill()
            start()

        return action

    def endpoint(self, child: Child) -> str:
        """The endpoint a producer child printed."""
        found = wait_until(lambda: child.line("ENDPOINT"), 30, f"{child.log.name}'s endpoint")
        return str(found)

    def started(self, driver: Child) -> None:
        wait_until(driver.started, 120, f"{driver.log.name}'s query to start")

    def alive(self) -> None:
        """Neither the query nor a producer failed (a current child exited on its own)."""
        for c in self.current.values():
            assert c.proc.poll() is None, c.output()

    def progress(self) -> int:
        """Committed rows, once every current child is checked alive."""
        self.alive()
        return self.committed()

    def of(self, role: str) -> list[Child]:
        """Every child that ran as ``role`` (``producer`` also matches ``producer-1``), in
        the order they started."""
        return [c for c in self.children if c.log.name.startswith(f"{role}-")]

    def lines(self, role: str, prefix: str) -> list[str]:
        return [ln for c in self.of(role) for ln in c.lines(prefix)]

    def run(
        self,
        total: int,
        plans: Mapping[str, tuple[KillPlan, Callable[[], None]]],
        timeout: float,
        *,
        counts: Mapping[str, int] | None = None,
        progress: Callable[[], int] | None = None,
    ) -> float:
        """Run the kills until ``total`` is reached (``progress``: committed rows by
        default) within ``timeout`` less a minute (for starting and stopping); on failure,
        what the output misses per producer of ``counts``."""
        try:
            self.took = run_with_kills(
                progress or self.progress, total, dict(plans), timeout - 60, "progress"
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.report(counts or {})}") from e
        return self.took

    def report(self, counts: Mapping[str, int]) -> str:
        """Per producer of ``counts``: what its committed seqs miss or repeat."""
        table = read_committed(self.out)
        producers = table.column("producer").to_pylist()
        seqs = table.column("seq").to_pylist()
        return "\n".join(
            f"{p}: " + seq_report([s for q, s in zip(producers, seqs, strict=True) if q == p], n)
            for p, n in sorted(counts.items())
        )

    def finish(self, columns: Sequence[str] = COLUMNS) -> pa.Table:
        """After :meth:`run`: every current child still up, the driver stopped, the
        committed rows read (uncommitted files counted in :attr:`orphans`)."""
        self.alive()
        self.current["driver"].stop()
        self.orphans = self.committed.orphans()
        return read_committed(self.out, columns)

    def say(self, what: str) -> None:
        print(
            f"{self.name}: {what}, {self.orphans} uncommitted parquet files ignored, "
            f"{self.took:.1f} s to all committed, {time.monotonic() - self.t0:.1f} s total",
            flush=True,
        )

    def retries(self) -> int:
        """Task attempts Spark lost (and retried), over every driver's log."""
        return sum(c.log.read_text(errors="replace").count("Lost task") for c in self.of("driver"))


def check_kills_hit(plans: Iterable[KillPlan], total: int) -> None:
    """Each kill hit a running stream (else the restart had nothing left to prove)."""
    for plan in plans:
        assert [p < total for _, p in plan.done] == [True] * len(plan.targets), plan
