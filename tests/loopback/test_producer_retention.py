"""A Producer with its retention on disk (``retention_dir``), on loopback: Producer ->
Receiver -> Spool, as the Spark source runs them, without Spark.

The main test SIGKILLs a producer process holding records the receiver took but never
acknowledged (acks come only with commits), starts a new one with the same id and
folder, and checks that the spool ends with every record exactly once and that the
folder holds no segment once all is acknowledged. Every socket is on 127.0.0.1, the zmq
context must terminate at the end, every wait polls with a deadline, and child
processes are stopped by their pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.support import spark_trigger, wait_until
from zio_spark.errors import ConfigError, StorageInputError, TransportError
from zio_spark.source.producer import Producer
from zio_spark.source.receiver import Receiver
from zio_spark.storage.retention import RetentionLockedError
from zio_spark.storage.spool import Spool

WAIT = 30.0

# A producer in a child process: bound to argv[1] (retried while the port is still being
# let go by a killed predecessor), retention in argv[3], then argv[4] records r<seq>
# numbered after what it reopened; prints what it reopened and then what it queued.
_CHILD = """
import sys, time
from zio_spark.source.producer import Producer
endpoint, pid, folder, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
deadline = time.monotonic() + 20
while True:
    try:
        p = Producer(endpoint, producer_id=pid, retention_dir=folder, linger_ms=0)
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("open", p.endpoint, p.last_seq, p.pending, p.stats["retention_reopened"], flush=True)
first = p.last_seq + 1
for a in range(first, first + count, 1000):
    p.send_many([b"r%d" % s for s in range(a, min(a + 1000, first + count))])
print("queued", p.last_seq, flush=True)
sys.stdin.read()
d = p.close(timeout=5, flush=False)
print("closed", d.acked, d.pending, flush=True)
"""


class _Child:
    """A producer process; :meth:`stop` ends it (closing its stdin, else killing it by
    pid), always within a bound."""

    def __init__(self, endpoint: str, producer_id: str, folder: Path, count: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, endpoint, producer_id, str(folder), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        opened = self.line().split()
        assert opened[0] == "open", opened
        self.endpoint = opened[1]
        self.last_seq, self.pending, self.reopened = map(int, opened[2:])
        queued = self.line().split()
        assert queued[0] == "queued", queued
        self.queued_to = int(queued[1])

    def line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(WAIT)
            raise AssertionError(f"producer child ended (exit {self.proc.returncode})")
        return line

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL, by pid
        self.proc.wait(WAIT)

    def stop(self) -> str:
        """Close its producer (stdin closed) and return its last line."""
        out = ""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.close()
            try:
                out = self.proc.stdout.read()
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                f.close()
        return out.strip()


@pytest.fixture
def children() -> Iterator[list[_Child]]:
    made: list[_Child] = []
    yield made
    for c in made:
        if c.proc.poll() is None:
            c.kill()
        c.stop()


@pytest.fixture
def closing() -> Iterator[list]:
    """Receivers, producers and spools to close at teardown, newest first."""
    things: list = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Receiver):
            thing.stop()
        elif isinstance(thing, Producer):
            thing.close(flush=False, timeout=5)
        else:
            thing.close()


def _held(spool: Spool, producer: str) -> int:
    return spool.next_seq(producer) - 1


def _bind(ctx, endpoint: str, **kw) -> Producer | None:
    """A producer bound to ``endpoint``; None while the port is still being let go."""
    try:
        return Producer(endpoint, ctx=ctx, linger_ms=0, **kw)
    except (TransportError, zmq.ZMQError):
        return None


def _segments(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.seg"))


def test_a_killed_producer_restarted_on_its_folder_loses_and_doubles_nothing(
    ctx, tmp_path, children, closing
):
    n, more = 6000, 500
    folder = tmp_path / "retention"
    first = _Child("tcp://127.0.0.1:*", "rt", folder, n)
    children.append(first)
    assert (first.reopened, first.queued_to) == (0, n)
    spool = Spool(tmp_path / "spool", sync=False)
    closing.append(spool)
    r = Receiver(spool, [first.endpoint], ctx=ctx, credit=10, max_backlog=1500).start()
    closing.append(r)
    # The receiver takes what its backlog allows; nothing is committed, so nothing acked.
    wait_until(lambda: _held(spool, "rt") >= 1000, what="records taken", timeout=WAIT)
    taken = _held(spool, "rt")
    assert taken < n
    first.kill()
    wait_until(
        lambda: r.status()[0].last_error == "disconnected",
        what="the disconnect noticed",
        timeout=WAIT,
    )
    assert _segments(folder)  # everything is still on disk

    second = _Child(first.endpoint, "rt", folder, more)
    children.append(second)
    # It reopened all n (none was acknowledged) and numbered its own after them. (How
    # many it still holds depends on whether the receiver's new flow, whose resume
    # releases what the spool holds, came before it printed.)
    assert (second.last_seq, second.reopened) == (n, n) and second.pending <= n
    assert second.queued_to == n + more
    got: list[tuple[int, bytes]] = []
    end = 1
    deadline = time.monotonic() + 4 * WAIT
    while end <= n + more:
        assert time.monotonic() < deadline, f"stuck at {end} of {n + more}"
        end = spark_trigger(spool, r, "rt", got)
        wait_until(
            lambda e=end: _held(spool, "rt") >= min(e, n + more),
            what=f"records from {end}",
            timeout=WAIT,
        )
    assert got == [(s, b"r%d" % s) for s in range(1, n + more + 1)]
    (st,) = r.status()
    assert st.duplicates == 0 and spool.stats.duplicates == 0
    # The last commit's ack releases everything: no segment is left in the folder.
    assert r.flush_acks(WAIT)
    wait_until(lambda: not _segments(folder), what="every segment released", timeout=WAIT)
    assert sorted(p.name for p in folder.iterdir()) == ["HEAD", "LOCK"]
    assert second.stop().split() == ["closed", str(n + more), "0"]


def test_an_in_process_restart_reopens_and_numbers_on(ctx, tmp_path, closing):
    folder = tmp_path / "r"
    p = Producer(ctx=ctx, producer_id="ip", linger_ms=0, retention_dir=folder)
    closing.append(p)
    keys = [b"k%d" % i for i in range(100)]
    heads = [{"i": str(i)} for i in range(100)]
    assert p.send_many([b"v%d" % i for i in range(100)], keys=keys, headers=heads) == 100
    p.send(b"one", granule=7)
    with pytest.raises(RetentionLockedError):  # one process (one producer) per folder
        Producer(ctx=ctx, producer_id="ip", linger_ms=0, retention_dir=folder)
    p.close(flush=False, timeout=5)

    q = Producer(ctx=ctx, producer_id="ip", linger_ms=0, retention_dir=folder)
    closing.append(q)
    assert (q.last_seq, q.pending, q.stats["retention_reopened"]) == (101, 101, 101)
    assert q.send(b"two") == 102
    held = q._backlog._records.take(1, 200)
    assert held is not None and held.first == 1
    assert held.values == [b"v%d" % i for i in range(100)] + [b"one", b"two"]
    assert held.keys == [*keys, None, None]
    assert held.headers == [*heads, None, None]
    assert held.granules == [None] * 100 + [7, None]


def test_retention_options_are_checked(ctx, tmp_path, closing):
    with pytest.raises(ConfigError) as err:
        Producer(ctx=ctx, linger_ms=0, retention_dir=tmp_path / "r")
    assert err.value.option == "producer_id"
    with pytest.raises(ConfigError) as err:
        Producer(ctx=ctx, producer_id="a", linger_ms=0, retention_dir=5)  # type: ignore[arg-type]
    assert err.value.option == "retention_dir"
    Producer(ctx=ctx, producer_id="a", linger_ms=0, retention_dir=tmp_path / "r").close(
        flush=False, timeout=5
    )
    with pytest.raises(StorageInputError) as err2:  # the folder holds a's records
        Producer(ctx=ctx, producer_id="b", linger_ms=0, retention_dir=tmp_path / "r")
    assert err2.value.field == "producer_id"
    # A constructor that fails after opening the folder lets its lock go.
    with pytest.raises(TransportError, match="cannot bind"):
        Producer("nonsense://x", ctx=ctx, producer_id="a", retention_dir=tmp_path / "r")
    p = Producer(ctx=ctx, producer_id="a", linger_ms=0, retention_dir=tmp_path / "r")
    closing.append(p)


def test_a_renumbering_is_kept_on_disk(ctx, tmp_path, closing):
    """The taker holds more than a fresh folder ever numbered (the id ran before
    without retention): unsent records are renumbered after its resume, in the log too."""
    spool = Spool(tmp_path / "spool", sync=False)
    closing.append(spool)
    old = Producer(ctx=ctx, producer_id="rn", linger_ms=0)
    closing.append(old)
    old.send_many([b"old%d" % i for i in range(50)])
    r1 = Receiver(spool, [old.endpoint], ctx=ctx).start()
    closing.append(r1)
    wait_until(lambda: _held(spool, "rn") == 50, what="the old records", timeout=WAIT)
    r1.stop()
    old.close(flush=False, timeout=5)

    folder = tmp_path / "r"
    # On the old one's endpoint: the receiver knows which producer it serves (a new
    # endpoint would be offered resume 0 and the records dropped as duplicates).
    new = wait_until(
        lambda: _bind(ctx, old.endpoint, producer_id="rn", retention_dir=folder),
        what="the old endpoint free again",
        timeout=WAIT,
    )
    closing.append(new)
    new.send_many([b"new%d" % i for i in range(10)])  # seqs 1..10, before any taker
    r2 = Receiver(spool, [new.endpoint], ctx=ctx).start()
    closing.append(r2)
    wait_until(
        lambda: _held(spool, "rn") == 60,
        what="the new records",
        timeout=WAIT,
        detail=lambda: (_held(spool, "rn"), new.stats, r2.status()),
    )
    assert new.stats["renumbered"] == 10 and new.last_seq == 60
    r2.stop()
    new.close(flush=False, timeout=5)  # nothing committed: all ten still held

    again = Producer(ctx=ctx, producer_id="rn", linger_ms=0, retention_dir=folder)
    closing.append(again)
    assert (again.last_seq, again.pending) == (60, 10)
    held = again._backlog._records.take(51, 20)
    assert held is not None and held.first == 51
    assert held.values == [b"new%d" % i for i in range(10)]


def test_a_client_mode_producer_restarted_on_its_folder(ctx, tmp_path, closing):
    """Producer(connect=...) into a bound receiver: the same folder, the same records."""
    spool = Spool(tmp_path / "spool", sync=False)
    closing.append(spool)
    r = Receiver(spool, ctx=ctx, bind=["tcp://127.0.0.1:*"]).start()
    closing.append(r)
    (endpoint,) = r.bound_endpoints()
    folder = tmp_path / "r"
    kw = {"connect": endpoint, "producer_id": "cm", "linger_ms": 0, "retention_dir": folder}
    p = Producer(ctx=ctx, **kw)
    closing.append(p)
    p.send_many([b"r%d" % s for s in range(1, 301)])
    wait_until(lambda: _held(spool, "cm") == 300, what="the first records", timeout=WAIT)
    p.close(flush=False, timeout=5)  # nothing committed, so nothing acknowledged

    q = Producer(ctx=ctx, **kw)
    closing.append(q)
    # Its flow may already be open: the receiver's resume (300) releases what it holds.
    assert (q.stats["retention_reopened"], q.last_seq) == (300, 300)
    q.send_many([b"r%d" % s for s in range(301, 401)])
    wait_until(lambda: _held(spool, "cm") == 400, what="the new records", timeout=WAIT)
    got: list[tuple[int, bytes]] = []
    assert spark_trigger(spool, r, "cm", got) == 401
    assert got == [(s, b"r%d" % s) for s in range(1, 401)]
    wait_until(lambda: q.acked == 400, what="the commit acknowledged", timeout=WAIT)
    wait_until(lambda: not _segments(folder), what="every segment released", timeout=WAIT)


def test_send_many_rate_with_and_without_retention(ctx, tmp_path, closing, record_property):
    """Not a timed assertion: records/s of send_many, 100 B records, with and without
    retention in the same run (printed, and kept as test properties)."""
    total, per_call = 200_000, 1000
    value = b"x" * 100
    rates: dict[str, float] = {}
    for name in ("memory", "retention"):
        for calls in (total // per_call, 1):
            kw = {"retention_dir": tmp_path / f"bench{calls}"} if name == "retention" else {}
            p = Producer(ctx=ctx, producer_id=f"bench-{name}-{calls}", linger_ms=0, **kw)
            closing.append(p)
            n = total // calls
            chunk = [value] * n
            t0 = time.perf_counter()
            for _ in range(calls):
                p.send_many(chunk)
            rates[f"{name}, {n} per call"] = total / (time.perf_counter() - t0)
            assert p.last_seq == total
            p.close(flush=False, timeout=5)
    for k, v in rates.items():
        record_property(k, round(v))
        print(f"send_many {k}: {v:,.0f} records/s")
