"""Source in ``readMode=direct`` under chaos: ``readStream.format("zio")`` reading ranges
straight from several bound producers -> parquet, while the Spark driver and the producers
are SIGKILLed at random (seeded) moments and restarted (issue #26, requirement 6).

No spool and no taker here: the driver asks each producer's held window and acks Spark's
commits on its control flows, and each task reads its ranges from the producers. So the
records live only in the producers until a commit acks them. Three scenarios:

- **with retention** (``Producer(retention_dir=...)``): what makes a producer kill
  harmless. The restarted producer (``producer_child.py ... direct DIR``, same id, same
  endpoint, same folder) finds its records, its numbering and its incarnation there,
  serves the ranges planned before the kill (a task the kill cut short is retried:
  ``local[2,8]``) and numbers on after the last record the folder holds. A restarted
  driver re-plans the batch its offsets log holds without a commit from the same
  offsets, which the producers still hold (acks follow commits only). Verdict: every
  record of every producer exactly once.
- **without retention** (``producer_child.py ... volatile``), ``failOnDataLoss=false``: a
  restarted producer is a new incarnation numbering from 1 and sends its records again
  from the first (each value tagged with its incarnation); what the killed one held
  beyond the last commit is lost by design and the query goes on. Verdict: the last
  incarnation of each producer exactly once; in a killed one, the committed records and
  the ranges the source reported lost (the WARNs of the tasks and of the planner) are
  disjoint and leave no gap below the highest of them: exactly the reported ranges are
  lost, nothing else, nothing read twice.
- **over CURVE, producers with allow-lists** (the with-retention scenario; docs/
  direct-read.md, "Security and networks"): every producer admits only the driver's
  public key and the run key that the driver's control flow leases to it; the tasks hold
  the run key pair only. A restarted producer (same server key and list) holds no lease,
  so the tasks of the batch it was in are refused at the handshake until the driver's
  keeper has reopened its control flow, which registers the run key again; Spark's task
  retries carry them over that. The keys are drawn by the test and given to the children
  in their environment only. Verdict: every record exactly once, the query never failed,
  every producer serving at the end leased a run key, and no file of the run holds a
  secret key.

Kill moments are drawn as in test_source_chaos.py (progress target, then a random
delay; the seed printed, ``ZIO_CHAOS_SEED`` replays them), each producer kill on a producer
drawn from the same seed; a producer kill then waits up to
:data:`~tests.reliability.chaos_harness.READ_WAIT_S` for a task to be reading a range from
it, so that kills cut reads.
"""

from __future__ import annotations

import collections
import random
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.chaos_harness import (
    DIRECT_TIMEOUT,
    SourceChaos,
    check_kills_hit,
    wait_for_a_read,
)
from tests.reliability.helpers import (
    KillPlan,
    chaos_rng,
    check_exactly_once,
    committed_parquet,
    size_params,
)

PRODUCERS = 3  # per query

SIZES = {
    # records per producer, driver kills, producer kills (spread over the producers),
    # producer rate (records/s each), maxRecordsPerTrigger, test timeout (s). CI:
    # production spans ~24 s, so that the producer kill (drawn on the committed output)
    # comes while they still send; one producer kill only (a second one cost the default
    # run ~40 s more on the loaded 2 cores).
    "ci": (8_000, 1, 1, 333, 2_500, 300),
    "full": (350_000, 5, 4, 5_000, 15_000, 1200),
}

VOLATILE_SIZES = {
    # as SIZES; each kill makes its producer send all of its records again. CI: no driver
    # kill (its restart costs more than the rest of the test), and behind -m chaos too:
    # 67-124 s on the 2 shared cores (load 5-15), over the default run's budget.
    "ci": (4_000, 0, 2, 400, 1_500, 180),
    "full": (200_000, 2, 4, 4_000, 15_000, 1200),
}


class DirectChaos:
    """``PRODUCERS`` bound producers (roles ``producer-<i>``, ids ``<prefix>-<i>``, each
    on a port of its own kept across its restarts) and a direct query reading them all
    (role ``driver``, ``local[2,8]``), on a :class:`SourceChaos` run."""

    def __init__(
        self,
        run: SourceChaos,
        prefix: str,
        mode: Callable[[int], list[object]],
        size: tuple[int, ...],
    ) -> None:
        self.run = run
        self.ids = [f"{prefix}-{i}" for i in range(PRODUCERS)]
        self.n, _, _, self.rate, self.per_trigger, _ = size
        self.mode = mode  # producer i's last arguments
        self.endpoints = ["tcp://127.0.0.1:*"] * PRODUCERS
        self.fail_on_data_loss = "true"
        self.read_open: list[bool] = []  # per producer kill: a task's range flow was open
        # More environment of the producers and of the driver (CURVE keys).
        self.producer_env: dict[str, str] = {}
        self.driver_env: dict[str, str] = {}

    def start_producer(self, i: int) -> None:
        args = [self.endpoints[i], self.ids[i], self.n, self.rate, *self.mode(i)]
        self.run.spawn(f"producer-{i}", "producer_child.py", args, self.producer_env)

    def start_driver(self) -> None:
        args = ["direct", ",".join(self.endpoints), self.run.ckpt, self.run.out]
        args += [self.per_trigger, "local[2,8]", self.fail_on_data_loss, DIRECT_TIMEOUT]
        self.run.spawn("driver", "driver_child.py", args, self.driver_env)

    def start(self) -> None:
        for i in range(PRODUCERS):
            self.start_producer(i)
        for i in range(PRODUCERS):
            self.endpoints[i] = self.run.endpoint(self.run.current[f"producer-{i}"])
        self.start_driver()
        self.run.started(self.run.current["driver"])

    def plans(
        self, rng: random.Random, size: tuple[int, ...], max_delay: float
    ) -> dict[str, tuple[KillPlan, Callable[[], None]]]:
        """The driver's kills and the producers' (each on a producer drawn from ``rng``)."""
        _, driver_kills, producer_kills, *_ = size
        total = self.n * PRODUCERS
        driver_plan = KillPlan.draw(rng, "driver", driver_kills, total, max_delay=max_delay)
        # Up to 40 % of the committed output: the producers run a few batches ahead of the
        # commits, and their kills should come while they still have records to send.
        producer_plan = KillPlan.draw(
            rng, "producer", producer_kills, total, max_delay=max_delay, upto=0.4
        )
        victims = [rng.randrange(PRODUCERS) for _ in range(producer_kills)]
        print(f"producer kills on producers {victims}", flush=True)

        def kill_producer() -> None:
            i = victims[len(producer_plan.done)]
            self.read_open.append(wait_for_a_read(self.endpoints[i]))
            self.run.current[f"producer-{i}"].kill()
            self.start_producer(i)  # same endpoint (and folder, with retention)

        return {
            "driver": (driver_plan, self.run.restarter("driver", self.start_driver)),
            "producer": (producer_plan, kill_producer),
        }

    def incarnations(self, i: int) -> list[str]:
        """Producer ``i``'s incarnations, in order (one per child that printed one)."""
        return self.run.lines(f"producer-{i}", "INCARNATION")

    def driver_logs(self) -> str:
        return "\n".join(c.log.read_text(errors="replace") for c in self.run.of("driver"))


class OneNumbering:
    """What the producers with retention of a run printed, read before the run ends:
    their resumes and incarnations, and whether a driver logged a refused commit ack."""

    def __init__(self, run: SourceChaos, chaos: DirectChaos) -> None:
        self.resumes = [
            [int(r) for r in run.lines(f"producer-{i}", "RESUME")] for i in range(PRODUCERS)
        ]
        self.incarnations = [chaos.incarnations(i) for i in range(PRODUCERS)]
        self.last = [run.current[f"producer-{i}"].line("INCARNATION") for i in range(PRODUCERS)]
        self.refused = [
            c.log.name for c in run.of("driver") if "COMMIT ACK REFUSED" in c.log.read_text()
        ]

    def check(self) -> None:
        for incs, now, res in zip(self.incarnations, self.last, self.resumes, strict=True):
            # Every restart of a producer reopened its folder: one numbering throughout (a
            # new incarnation would have made the query skip the old one's records as
            # lost). A producer killed while it was still starting printed none: the first
            # and the last one did.
            assert len(set(incs)) == 1 and incs[0] == now, self.incarnations
            assert res[0] == 0 and all(r > 0 for r in res[1:]), self.resumes
        assert not self.refused, f"commit acks refused in {self.refused}"


@pytest.mark.parametrize("size", size_params(SIZES))
def test_direct_source_driver_and_producer_kills_exactly_once(tmp_path: Path, size: str) -> None:
    _, rng = chaos_rng(f"source-direct/{size}")
    retention = tmp_path / "retention"
    with SourceChaos(tmp_path, f"source-direct/{size}") as run:
        chaos = DirectChaos(
            run, "chaos-direct", lambda i: ["direct", retention / str(i)], SIZES[size]
        )
        chaos.start()
        plans = chaos.plans(rng, SIZES[size], 3.0 if size == "full" else 1.0)
        counts = dict.fromkeys(chaos.ids, chaos.n)
        run.run(chaos.n * PRODUCERS, plans, SIZES[size][5], counts=counts)
        numbering = OneNumbering(run, chaos)
        retries = run.retries()
        table = run.finish()

    run.say(
        f"{len(table)} rows of {PRODUCERS} producers, kills {[p.done for p, _ in plans.values()]} "
        f"(a range flow open at the producer kills: {chaos.read_open}, task retries {retries}), "
        f"producer resumes {numbering.resumes}"
    )
    check_exactly_once(table, counts)
    numbering.check()
    check_kills_hit([p for p, _ in plans.values()], chaos.n * PRODUCERS)


CURVE_SIZES = {
    # As SIZES. CI: two producer kills, no driver kill (a driver's restart costs ~20 s on
    # the loaded 2 cores); production spans ~15 s, so that the producer kills (up to 40 %
    # of the committed output) come while the producers still send. Full: six producer
    # kills and two driver kills (each restarted runner draws a new run key).
    "ci": (5_000, 0, 2, 333, 1_500, 240),
    "full": (200_000, 2, 6, 4_000, 15_000, 1200),
}


_LOG_LINE = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d ", re.M)


def lost_tasks(text: str) -> list[str]:
    """Each task attempt Spark lost, as its driver's log tells it (the "Lost task" line
    and the traceback under it, up to the next log line)."""
    out = []
    for m in re.finditer(r"^.*Lost task", text, re.M):
        end = _LOG_LINE.search(text, m.start() + 1)
        out.append(text[m.start() : end.start() if end else len(text)])
    return out


def holding(root: Path, secrets: list[bytes]) -> list[str]:
    """Files under ``root`` that hold one of ``secrets`` (the tests' logs, the query's
    checkpoint and output, the producers' folders)."""
    return [
        str(f.relative_to(root))
        for f in sorted(root.rglob("*"))
        if f.is_file() and any(k in f.read_bytes() for k in secrets)
    ]


@pytest.mark.parametrize("size", size_params(CURVE_SIZES))
def test_direct_source_over_curve_producers_with_allow_lists_killed_exactly_once(
    tmp_path: Path, size: str
) -> None:
    """The with-retention scenario over CURVE, per query run keys: every producer admits
    only the driver's public key (its allow-list) and the run key the driver's control
    flow leases to it; the tasks hold the run key pair only. A killed producer comes back
    (same endpoint, id, folder, server key and list) with no lease: the tasks of the batch
    it was in are refused at the handshake until the driver's keeper has reopened its
    control flow, which registers the run key again. Spark's task retries (``local[2,8]``)
    must carry them over that, and the query must never fail. Verdict: every record of
    every producer exactly once; the current producers hold a run key; no secret key
    in any file of the run."""
    import zmq

    _, rng = chaos_rng(f"source-direct-curve/{size}")
    server_public, server_secret = zmq.curve_keypair()
    driver_public, driver_secret = zmq.curve_keypair()
    retention = tmp_path / "retention"
    with SourceChaos(tmp_path, f"source-direct-curve/{size}") as run:
        chaos = DirectChaos(
            run, "chaos-curve", lambda i: ["direct", retention / str(i)], CURVE_SIZES[size]
        )
        chaos.producer_env = {
            "ZIO_CHAOS_PRODUCER_SECRET": server_secret.decode(),
            "ZIO_CHAOS_PRODUCER_ALLOW": driver_public.decode(),
        }
        chaos.driver_env = {
            "ZIO_CHAOS_SOURCE_SERVER_KEY": server_public.decode(),
            "ZIO_CHAOS_SOURCE_PUBLIC": driver_public.decode(),
            "ZIO_CHAOS_SOURCE_SECRET": driver_secret.decode(),
        }
        chaos.start()
        plans = chaos.plans(rng, CURVE_SIZES[size], 3.0 if size == "full" else 1.0)
        counts = dict.fromkeys(chaos.ids, chaos.n)
        run.run(chaos.n * PRODUCERS, plans, CURVE_SIZES[size][5], counts=counts)
        numbering = OneNumbering(run, chaos)
        run_keys = [run.lines(f"producer-{i}", "RUN_KEY") for i in range(PRODUCERS)]
        now = [run.current[f"producer-{i}"].line("RUN_KEY") for i in range(PRODUCERS)]
        retries = run.retries()
        table = run.finish()
    lost = lost_tasks(chaos.driver_logs())
    refused = sum("refused our CURVE key" in t for t in lost)

    run.say(
        f"{len(table)} rows of {PRODUCERS} producers, kills {[p.done for p, _ in plans.values()]} "
        f"(a range flow open at the producer kills: {chaos.read_open}, task retries {retries}, "
        f"{refused} of them refused the run key at the handshake), producer resumes "
        f"{numbering.resumes}, run keys leased per producer "
        f"{[len(k) for k in run_keys]} ({len(set().union(*run_keys))} distinct)"
    )
    check_exactly_once(table, counts)
    numbering.check()
    # Every producer that serves now leased a run key (the last driver's: the tasks read
    # with nothing else), and no key is the driver's own.
    assert all(now), run_keys
    assert driver_public.decode() not in set().union(*run_keys), run_keys
    assert not holding(tmp_path, [server_secret, driver_secret])
    check_kills_hit([p for p, _ in plans.values()], chaos.n * PRODUCERS)


# The source's reports of lost records, as its WARN lines say them: a task refused a
# range (zio_spark/protocol/ranges.py RangeReader.loss), the planner's Loss
# (zio_spark/source/direct.py), a first batch re-planned after the producer restarted
# (direct.stale_plan in zio_spark/spark/source.py: it covers the old numbering from 1,
# nothing of it having been committed yet).
_RANGE = re.compile(
    r"records \[(\d+), (\d+)\) of producer '([^']+)' \(incarnation '([^']+)'\) are "
    r"(?:lost|no longer held)"
)
_FROM = re.compile(
    r"records from (\d+) on of producer '([^']+)' \(incarnation '([^']+)'\) are lost"
)
_STALE = re.compile(
    r"planned to read producer '([^']+)' up to (\d+) numbered as incarnation '([^']+)'"
)


def reported_losses(
    text: str,
) -> tuple[dict[tuple[str, str], set[int]], dict[tuple[str, str], int]]:
    """Per ``(producer, incarnation)``: the seqs reported lost, and where a report of
    "from ``s`` on" starts (the lowest)."""
    spans: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    open_from: dict[tuple[str, str], int] = {}
    for m in _RANGE.finditer(text):
        spans[(m[3], m[4])].update(range(int(m[1]), int(m[2])))
    for m in _STALE.finditer(text):
        spans[(m[1], m[3])].update(range(1, int(m[2]) + 1))
    for m in _FROM.finditer(text):
        key = (m[2], m[3])
        open_from[key] = min(int(m[1]), open_from.get(key, int(m[1])))
    return dict(spans), open_from


class CurrentRows:
    """Committed rows of each producer's current incarnation (the tag of their values),
    read once per committed file: the progress of a run whose restarted producers send
    their records again under a new numbering."""

    def __init__(self, chaos: DirectChaos) -> None:
        self.chaos = chaos
        self.files: dict[Path, collections.Counter[bytes]] = {}

    def __call__(self) -> int:
        run = self.chaos.run
        run.alive()
        for f in committed_parquet(run.out):
            if f not in self.files:
                values = pq.read_table(f, columns=["value"]).column("value").to_pylist()
                self.files[f] = collections.Counter(v.partition(b"@")[2] for v in values)
        tags = [run.current[f"producer-{i}"].line("INCARNATION") for i in range(PRODUCERS)]
        return sum(c[t.encode()] for t in tags if t is not None for c in self.files.values())


def check_lost_as_reported(table: pa.Table, chaos: DirectChaos, reports: str) -> tuple[int, int]:
    """The verdict of the run without retention (module docstring); returns (records
    reported lost, killed incarnations)."""
    spans, open_from = reported_losses(reports)
    rows: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for p, s, v in zip(
        *(table.column(c).to_pylist() for c in ("producer", "seq", "value")), strict=True
    ):
        head, _, inc = v.partition(b"@")
        assert head == b"r%d" % s, f"{p}: seq {s} holds {v!r}"
        rows[(p, inc.decode())].append(s)
    known = {(p, inc) for i, p in enumerate(chaos.ids) for inc in chaos.incarnations(i)}
    assert set(rows) <= known, f"rows of unknown numberings: {sorted(set(rows) - known)}"
    assert set(spans) | set(open_from) <= known, (spans.keys(), open_from.keys())
    lost = killed = 0
    for i, p in enumerate(chaos.ids):
        *old, last = chaos.incarnations(i)
        got = rows.get((p, last), [])
        assert sorted(got) == list(range(1, chaos.n + 1)), f"{p} ({last}): {len(got)} rows"
        assert (p, last) not in spans and (p, last) not in open_from, f"{p}: {last} reported lost"
        for inc in old:
            killed += 1
            seqs = rows.get((p, inc), [])
            dup = sorted(s for s, k in collections.Counter(seqs).items() if k > 1)
            assert not dup, f"{p} ({inc}): read twice: {dup[:10]}"
            gone, read = spans.get((p, inc), set()), set(seqs)
            both = sorted(gone & read)
            assert not both, f"{p} ({inc}): reported lost yet committed: {both[:10]}"
            top = max(gone | read, default=0)
            gap = [s for s in range(1, top + 1) if s not in gone and s not in read]
            assert not gap, f"{p} ({inc}): lost without a report: {gap[:10]} ({len(gap)})"
            tail = open_from.get((p, inc))
            assert tail is None or top < tail, f"{p} ({inc}): rows from {tail} on: {top}"
            lost += len(gone)
    return lost, killed


@pytest.mark.parametrize("size", size_params(VOLATILE_SIZES, ci_by_default=False))
def test_direct_source_producers_without_retention_lose_exactly_what_is_reported(
    tmp_path: Path, size: str
) -> None:
    _, rng = chaos_rng(f"source-direct-volatile/{size}")
    with SourceChaos(tmp_path, f"source-direct-volatile/{size}") as run:
        chaos = DirectChaos(run, "chaos-volatile", lambda i: ["volatile"], VOLATILE_SIZES[size])
        chaos.fail_on_data_loss = "false"
        chaos.start()
        plans = chaos.plans(rng, VOLATILE_SIZES[size], 3.0 if size == "full" else 1.0)
        total = chaos.n * PRODUCERS
        run.run(total, plans, VOLATILE_SIZES[size][5], progress=CurrentRows(chaos))
        table = run.finish()
        reports = chaos.driver_logs()  # the driver stopped: its whole log
        retries = run.retries()

    lost, killed = check_lost_as_reported(table, chaos, reports)
    run.say(
        f"{len(table)} rows of {PRODUCERS} producers ({total} in their last numberings), "
        f"kills {[p.done for p, _ in plans.values()]} (a range flow open at the producer "
        f"kills: {chaos.read_open}, task retries {retries}), {killed} numberings killed, "
        f"{lost} records reported lost, none read twice"
    )
    check_kills_hit([p for p, _ in plans.values()], total)
