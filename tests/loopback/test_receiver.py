"""The source's receiver on loopback: Producer (or a raw pyzmq giver) -> Receiver -> Spool.

No Spark. Every socket is on 127.0.0.1 with a random port and linger 0, the zmq context
must terminate at the end (a leaked socket fails the test), and every wait polls a
condition with a deadline.
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from tests.support import spark_trigger, spool_rows, wait_until
from zio_spark.codec.records import encode_records
from zio_spark.errors import TransportError
from zio_spark.source.producer import Producer
from zio_spark.source.receiver import Receiver
from zio_spark.storage.spool import Spool

# -- helpers -------------------------------------------------------------------------------


def _wait_quiet(
    value: Callable[[], object],
    quiet: float = 0.5,
    timeout: float = 20.0,
    what: str = "value",
    moving: bool = True,
) -> object:
    """Poll ``value()`` until it has not changed for ``quiet`` seconds; return it. With
    ``moving`` (a value that is still to grow), the quiet clock starts only once it has
    moved from its first reading: on a loaded machine the first records can take longer
    than ``quiet`` to arrive."""
    if moving:
        first = value()
        wait_until(lambda: value() != first, what=f"{what}: any progress", timeout=timeout)
    deadline = time.monotonic() + timeout
    last, since = value(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now = value()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise AssertionError(f"{what} still changing after {timeout} s (last {last!r})")


def _held(spool: Spool, producer: str) -> int:
    """Highest sequence number of ``producer`` the spool holds (durable once flushed)."""
    return spool.next_seq(producer) - 1


class BacklogSampler:
    """Samples the spool's backlog in a thread and keeps the maximum per producer."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for p, n in self.spool.backlog().items():
                self.peak[p] = max(self.peak.get(p, 0), n)
            self.samples += 1
            self._stop.wait(0.001)  # sampling period, not a wait for a condition

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -- a ZIO giver written with raw pyzmq (specs/zio-wire.md, ROUTER/DEALER fallback) ---------


def _label(frames: list[bytes]) -> dict:
    prefix = frames[0]
    assert prefix[:3] == b"ZIO" and prefix[4:8] == b"FLOW", prefix[:8]
    return json.loads(prefix[8:].decode("utf-8"))


class RawGiver:
    """A ROUTER that serves ZIO flows by hand; subclasses decide what to send.

    A message arrives as ``[identity, b"", prefix, coord, *payload]``: prefix
    ``b"ZIO" + level + b"FLOW" + label``, coord ``<QQQ`` origin, granule, seqno.

    Our EOT (the receiver's, at its stop) is echoed, as a ZIO peer does, unless the giver
    ended that flow itself first or ``echo_eot`` is false: a giver that never echoes
    makes every stop wait out the receiver's whole EOT bound (5 s); the tests of that
    case say so with ``echo_eot = False``.
    """

    origin = 7
    echo_eot = True

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.bots: list[dict] = []
        self.eot_echoes = 0
        self.errors: list[BaseException] = []
        self._seqno: dict[bytes, int] = {}
        self._ended: set[bytes] = set()  # flows we sent an EOT on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(
        self, ident: bytes, label: dict, payload: tuple[bytes, ...] = (), granule: int = 0
    ) -> None:
        seqno = self._seqno.get(ident, 0)
        self._seqno[ident] = seqno + 1
        if label.get("flow") == "EOT":
            self._ended.add(ident)
        prefix = b"ZIO0FLOW" + json.dumps(label).encode()
        coord = struct.pack("<QQQ", self.origin, granule, seqno)
        self.sock.send_multipart([ident, b"", prefix, coord, *payload])

    def send_raw(self, ident: bytes, *frames: bytes) -> None:
        self.sock.send_multipart([ident, *frames])

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(20):
                    continue
                ident, empty, *frames = self.sock.recv_multipart()
                assert empty == b"", "the DEALER side puts an empty delimiter first"
                label = _label(frames)
                flow = label["flow"]
                if flow == "BOT":
                    self._seqno[ident] = 0
                    self._ended.discard(ident)
                    self.bots.append(label)
                    self.on_bot(ident, label)
                elif flow == "PAY":
                    self.on_pay(ident, label)
                elif flow == "EOT":
                    self.on_eot(ident, label)
        except BaseException as e:  # reported to the test through .errors
            self.errors.append(e)

    def on_bot(self, ident: bytes, label: dict) -> None:
        raise NotImplementedError

    def on_pay(self, ident: bytes, label: dict) -> None:
        pass

    def on_eot(self, ident: bytes, label: dict) -> None:
        self.eot_echoes += 1
        if self.echo_eot and ident not in self._ended:
            self.send(ident, {"flow": "EOT"})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        assert not self.errors, self.errors


class PlainGiver(RawGiver):
    """A plain ZIO giver: no ``ack``, no producer id, one record per DAT, then EOT."""

    def __init__(
        self, ctx: zmq.Context, values: list[bytes], credit: int = 5, unit: str | None = "mV"
    ) -> None:
        self.values = values
        self.unit = unit  # an attribute on every DAT, or none (the reference's exact label)
        self.max_credit = credit
        self.credit: dict[bytes, int] = {}
        self.next: dict[bytes, int] = {}
        self.eot_sent = False
        super().__init__(ctx)

    def on_bot(self, ident: bytes, label: dict) -> None:
        assert label["direction"] == "inject"
        self.credit[ident] = 0
        self.next.setdefault(ident, 0)
        # The server answers with the reversed direction and at most the offered credit.
        credit = min(self.max_credit, label["credit"])
        self.send(ident, {"flow": "BOT", "direction": "extract", "credit": credit})

    def on_pay(self, ident: bytes, label: dict) -> None:
        self.credit[ident] += label["credit"]
        i = self.next[ident]
        while self.credit[ident] > 0 and i < len(self.values):
            label = {"flow": "DAT"} if self.unit is None else {"flow": "DAT", "unit": self.unit}
            self.send(ident, label, (self.values[i],), granule=1000 + i)
            self.credit[ident] -= 1
            i += 1
        self.next[ident] = i
        if i == len(self.values) and not self.eot_sent:
            self.eot_sent = True
            self.send(ident, {"flow": "EOT"})


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def spool(tmp_path) -> Iterator[Spool]:
    s = Spool(tmp_path / "spool", sync=False)
    yield s
    s.close()


def _producer(ctx, closing, producer_id: str, bind: str = "tcp://127.0.0.1:*") -> Producer:
    p = Producer(ctx=ctx, producer_id=producer_id, linger_ms=0, bind=bind)
    closing.append(p)
    return p


def _receiver(closing, spool, endpoints, ctx, **kw) -> Receiver:
    r = Receiver(spool, endpoints, ctx=ctx, **kw).start()
    closing.append(r)
    return r


def _rebind(ctx, closing, producer_id: str, endpoint: str) -> Producer:
    """A new producer on the very endpoint of one that just went away."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _producer(ctx, closing, producer_id, bind=endpoint)
        except (TransportError, zmq.ZMQError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the old listener is being torn down by libzmq


# -- tests ---------------------------------------------------------------------------------


def test_records_reach_the_spool(ctx, spool, closing):
    prod = _producer(ctx, closing, "p1")
    n = 3000
    prod.send_many(
        [f"rec-{i}".encode() for i in range(n)],
        keys=[b"k%d" % (i % 3) for i in range(n)],
        headers=[{"i": str(i)} for i in range(n)],
        granules=list(range(n)),
    )
    r = _receiver(closing, spool, [prod.endpoint], ctx)
    wait_until(lambda: _held(spool, "p1") == n, what="all records in the spool", timeout=20.0)
    assert spool_rows(spool, "p1") == [(i + 1, f"rec-{i}".encode()) for i in range(n)]
    batch = next(iter(spool.read("p1", 1, 3)))
    assert batch.column("key").to_pylist() == [b"k0", b"k1"]
    assert batch.column("granule").to_pylist() == [0, 1]
    assert batch.column("producer").to_pylist() == ["p1", "p1"]
    assert [dict(h) for h in batch.column("headers").to_pylist()] == [{"i": "0"}, {"i": "1"}]
    (st,) = r.status()
    assert (st.producer, st.state, st.encoding) == ("p1", "receiving", "arrow")
    assert st.ack_capable and not st.at_most_once
    assert (st.records, st.duplicates, st.failures) == (n, 0, 0)
    # Nothing was committed, so nothing may be acknowledged.
    assert prod.acked == 0 and prod.pending == n


def test_backlog_bounded_until_commit_then_acks_flow(ctx, spool, closing):
    """credit 10, maxBacklog 2000: a producer with 50k records blocks at 2000 until commits."""
    n, max_backlog = 50_000, 2000
    prod = _producer(ctx, closing, "big")
    prod.send_many([b"v%d" % i for i in range(n)])
    sampler = BacklogSampler(spool)
    try:
        r = _receiver(closing, spool, [prod.endpoint], ctx, credit=10, max_backlog=max_backlog)
        held = _wait_quiet(lambda: _held(spool, "big"), what="records received")
        assert 0 < held <= max_backlog
        assert spool.backlog()["big"] <= max_backlog
        assert prod.pending == n  # blocked, everything still held by the producer
        assert prod.acked == 0

        # Commit what Spark would have read: more flows, and the ack reaches the producer.
        committed = 1
        while committed <= n:
            ends = spool.seal()
            committed = ends["big"]
            r.commit(ends)
            wait_until(
                lambda c=committed: prod.acked == c - 1, what=f"ack {committed - 1}", timeout=20.0
            )
            if committed <= n:
                wait_until(
                    lambda c=committed: _held(spool, "big") >= c, what="more records", timeout=20.0
                )
        assert prod.acked == n and prod.pending == 0
    finally:
        sampler.stop()
    assert sampler.samples > 100
    assert 0 < sampler.peak["big"] <= max_backlog, sampler.peak
    assert r.stats["acks_sent"] >= n // max_backlog
    assert spool.backlog()["big"] == 0


def test_ack_only_pay_when_all_credit_is_out(ctx, spool, closing):
    """The producer holds every credit and has nothing to send: an ack still gets through."""
    prod = _producer(ctx, closing, "quiet")
    prod.send_many([b"a", b"b", b"c"])
    r = _receiver(closing, spool, [prod.endpoint], ctx, credit=4)
    wait_until(lambda: _held(spool, "quiet") == 3, what="3 records", timeout=20.0)
    peer = r._peers[prod.endpoint]  # white box: prove the receiver holds no credit
    wait_until(
        lambda: peer.flow is not None and peer.flow.credit == 0,
        what="all credit paid out",
        timeout=20.0,
    )
    acks_before = r.stats["acks_sent"]
    r.commit(spool.seal())
    wait_until(lambda: prod.acked == 3, what="ack 3", timeout=20.0)
    assert prod.pending == 0
    assert r.stats["acks_sent"] == acks_before + 1
    assert peer.flow.credit == 0  # the PAY carried the ack and no credit
    # The flow still works after an ack-only PAY.
    prod.send_many([b"d"])
    wait_until(lambda: _held(spool, "quiet") == 4, what="record 4", timeout=20.0)
    assert [v for _, v in spool_rows(spool, "quiet")] == [b"d"]


def test_reconnect_and_receiver_restart_resume_without_duplicates(ctx, tmp_path, closing):
    """Kill the taker side twice mid-stream; the producer resends from resume + 1."""
    n = 10_000
    prod = _producer(ctx, closing, "rs")
    prod.send_many([b"r%d" % i for i in range(n)])
    path = tmp_path / "spool"
    spool = Spool(path, sync=False)
    closing.append(spool)
    r1 = _receiver(closing, spool, [prod.endpoint], ctx, credit=10, max_backlog=2000)
    first = _wait_quiet(lambda: _held(spool, "rs"), what="first receiver blocked")
    assert 0 < first < n
    r1.stop()
    spool.close()

    # A new receiver (a restarted runner) on the same spool resumes where it left off.
    spool = Spool(path, sync=False)
    closing.append(spool)
    r2 = _receiver(closing, spool, [prod.endpoint], ctx, credit=10, max_backlog=2000)
    got: list[tuple[int, bytes]] = []
    end = spark_trigger(spool, r2, "rs", got)
    assert end == first + 1  # everything the first receiver stored, nothing more
    wait_until(lambda: _held(spool, "rs") > first, what="records after the restart", timeout=20.0)
    assert r2.status()[0].duplicates == 0

    # Drop and re-add the endpoint while records flow: a fresh flow, a fresh BOT.
    r2.remove_endpoint(prod.endpoint)
    r2.add_endpoint(prod.endpoint)
    while end <= n:
        end = spark_trigger(spool, r2, "rs", got)
        wait_until(
            lambda e=end: _held(spool, "rs") >= min(e, n), what=f"records from {end}", timeout=20.0
        )
    assert got == [(i + 1, b"r%d" % i) for i in range(n)]
    (st,) = r2.status()
    assert st.duplicates == 0 and spool.stats.duplicates == 0
    assert prod.stats["takers"] >= 3
    wait_until(lambda: prod.acked == n, what="every record acknowledged", timeout=20.0)


def test_resent_records_are_dropped(ctx, spool, closing):
    """A giver that ignores ``resume`` and resends from 1: the spool keeps one copy."""

    class Resender(RawGiver):
        def __init__(self, ctx):
            self.credit = self.cursor = 0
            self.limit = 0
            super().__init__(ctx)

        def on_bot(self, ident, label):
            assert label["ack"] is True and label["encoding"] == ["arrow"]
            self.credit, self.cursor = 0, 1  # always from 1: resume is ignored
            self.limit = 100 if self.limit == 0 else 150
            attrs = {"producer": "again", "ack": True, "encoding": "arrow"}
            self.send(ident, {"flow": "BOT", "direction": "extract", "credit": 3, **attrs})

        def on_pay(self, ident, label):
            self.credit += label["credit"]
            while self.credit > 0 and self.cursor <= self.limit:
                vals = [b"x%d" % s for s in range(self.cursor, self.cursor + 50)]
                self.send(ident, {"flow": "DAT"}, (encode_records(self.cursor, vals),))
                self.credit -= 1
                self.cursor += 50

    giver = Resender(ctx)
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, credit=3)
    wait_until(lambda: _held(spool, "again") == 100, what="round 1", timeout=20.0)
    assert giver.bots[-1]["resume"] == 0
    r.remove_endpoint(giver.endpoint)
    r.add_endpoint(giver.endpoint)
    wait_until(lambda: _held(spool, "again") == 150, what="round 2", timeout=20.0)
    assert giver.bots[-1]["resume"] == 100
    assert spool_rows(spool, "again") == [(s, b"x%d" % s) for s in range(1, 151)]
    (st,) = r.status()
    assert st.duplicates == 100
    assert spool.stats.duplicates == 100  # dropped once, by the spool (issue #25)


def test_fresh_spool_starts_where_the_producer_is(ctx, tmp_path, closing):
    """Records 1..1000 acknowledged to a first taker (a batch read with its own spool):
    a second taker with a fresh spool starts at 1001, not with a sequence gap."""
    prod = _producer(ctx, closing, "shared")
    prod.send_many([b"s%d" % i for i in range(3000)])
    for k in range(2):
        spool = Spool(tmp_path / f"spool{k}", sync=False)
        closing.append(spool)
        r = _receiver(closing, spool, [prod.endpoint], ctx, reconnect=False)
        wait_until(
            lambda s=spool, k=k: _held(s, "shared") >= 1000 * (k + 1),
            what=f"taker {k}",
            timeout=20.0,
        )
        assert r.fatal is None, r.fatal
        rows = spool_rows(spool, "shared")
        assert rows[0] == (1000 * k + 1, b"s%d" % (1000 * k))
        assert rows == [(s, b"s%d" % (s - 1)) for s in range(1000 * k + 1, rows[-1][0] + 1)]
        r.commit({"shared": 1000 * (k + 1) + 1})  # this taker used 1000 records only
        assert r.flush_acks(5)
        r.stop()
    assert prod.acked == 2000


@pytest.mark.parametrize("how", ["close", "kill"])
def test_producer_restart_same_id_continues(ctx, spool, closing, how):
    """Producer replaced on the same endpoint: the receiver reconnects by itself and the
    new producer's records follow the old ones with no loss and no duplicate."""
    n = 1000
    if how == "close":  # graceful: EOT ends the flow
        old = _producer(ctx, closing, "same")
        old.send_many([b"old-%d" % i for i in range(n)])
        endpoint = old.endpoint
    else:  # crash: SIGKILL, the disconnect monitor notices
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_PRODUCER, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        closing.append(_Killer(child))
        endpoint = child.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    r = _receiver(closing, spool, [endpoint], ctx)
    wait_until(lambda: _held(spool, "same") == n, what="old producer's records", timeout=20.0)
    if how == "close":
        old.close(flush=False, timeout=5)
        wait_until(lambda: r.status()[0].state == "ended", what="EOT seen", timeout=20.0)
    else:
        child.kill()
        child.wait(10)
        wait_until(
            lambda: r.status()[0].last_error == "disconnected",
            what="disconnect noticed",
            timeout=20.0,
        )
    new = _rebind(ctx, closing, "same", endpoint)
    new.send_many([b"new-%d" % i for i in range(n)])
    wait_until(lambda: _held(spool, "same") == 2 * n, what="new producer's records", timeout=20.0)
    expected = [b"old-%d" % i for i in range(n)] + [b"new-%d" % i for i in range(n)]
    assert spool_rows(spool, "same") == list(zip(range(1, 2 * n + 1), expected, strict=True))
    assert new.last_seq == 2 * n  # it numbered its records after the old ones
    assert r.status()[0].duplicates == 0


_CHILD_PRODUCER = """
import sys
from zio_spark.source.producer import Producer
p = Producer(producer_id="same", linger_ms=0, bind="tcp://127.0.0.1:*")
p.send_many([b"old-%d" % i for i in range(int(sys.argv[1]))])
print(p.endpoint, flush=True)
sys.stdin.read()
"""


class _Killer:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.mark.parametrize("unit", ["mV", None], ids=["with-attrs", "bare-label"])
def test_plain_zio_giver(ctx, spool, closing, unit, monkeypatch):
    """A reference-style giver (raw pyzmq): receiver-assigned seqs, reported at most once.
    DATs labelled exactly ``{"flow": "DAT"}`` take the receiver's fast lane."""
    if unit is None:

        def slow_lane(*args: object) -> None:
            raise AssertionError("a bare plain DAT went through _on_data")

        monkeypatch.setattr(Receiver, "_on_data", slow_lane)
    values = [b"plain-%d" % i for i in range(40)]
    giver = PlainGiver(ctx, values, credit=5, unit=unit)
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, reconnect=False)
    wait_until(
        lambda: r.status()[0].state == "ended", what="EOT from the plain giver", timeout=20.0
    )
    (st,) = r.status()
    producer = giver.endpoint  # a plain giver names no producer: the endpoint is its id
    assert st.producer == producer
    assert not st.ack_capable and st.at_most_once and st.encoding == "plain"
    assert st.records == 40
    wait_until(lambda: giver.eot_echoes == 1, what="the receiver's EOT echo", timeout=20.0)
    bot = giver.bots[0]
    assert bot["direction"] == "inject" and bot["ack"] is True and bot["resume"] == 0
    ends = spool.seal()
    batch = next(iter(spool.read(producer, 1, ends[producer])))
    assert batch.column("seq").to_pylist() == list(range(1, 41))
    assert batch.column("value").to_pylist() == values
    assert batch.column("origin").to_pylist() == [7] * 40
    assert batch.column("granule").to_pylist() == list(range(1000, 1040))
    if unit is None:
        assert batch.column("headers").to_pylist() == [None] * 40
        assert batch.column("key").to_pylist() == [None] * 40
    else:
        assert dict(batch.column("headers")[0].as_py()) == {"unit": "mV"}
    stamps = batch.column("timestamp").to_pylist()
    assert None not in stamps and stamps == sorted(stamps)


def test_a_plain_giver_fills_the_backlog_exactly(ctx, spool, closing):
    """One record per plain DAT: credit is sized for 1 record a DAT, not ``batch``.

    (It was sized as if each plain DAT could hold ``maxBacklog // credit`` records, so
    a backlog of 50 with credit 10 stalled at 46 records, and a plain giver was throttled
    as its backlog filled: a bench run with maxBacklog of the record count stalled.)"""
    values = [b"p%d" % i for i in range(100)]
    giver = PlainGiver(ctx, values, credit=10)
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, reconnect=False, credit=10, max_backlog=50)
    producer = giver.endpoint
    # The full backlog is awaited by its count (a pause on a loaded machine must not pass
    # for a full backlog); then no record past it may arrive while the giver waits.
    wait_until(lambda: r.status()[0].records >= 50, what="the backlog filled", timeout=20.0)
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:
        assert r.status()[0].records == 50, "records past a full backlog"
        time.sleep(0.01)
    assert spool.backlog()[producer] == 50
    r.commit(spool.seal())
    wait_until(lambda: r.status()[0].state == "ended", what="the rest and the EOT", timeout=20.0)
    assert r.status()[0].records == 100
    assert [v for _, v in spool_rows(spool, producer)] == values[50:]


def test_a_plain_giver_that_leaves_is_not_left_open_for_the_next_runner(ctx, tmp_path, closing):
    """A plain giver's flow is in plain_flows.json while open; removing its endpoint (a
    ZRE peer leaving the group) ends it there too, so the next receiver on the spool
    sends it a BOT instead of refusing it as left open."""
    giver = PlainGiver(ctx, [b"g%d" % i for i in range(1000)], credit=5)
    closing.append(giver)
    path = tmp_path / "spool" / "plain_flows.json"
    spool = Spool(tmp_path / "spool", sync=False)
    r = Receiver(spool, [giver.endpoint], ctx=ctx, credit=5, max_backlog=20).start()
    try:
        wait_until(lambda: r.status()[0].records == 20, what="the backlog filled", timeout=20.0)
        assert giver.endpoint in json.loads(path.read_text())
        r.remove_endpoint(giver.endpoint)
        wait_until(lambda: not r.endpoints(), what="the endpoint removed", timeout=20.0)
        wait_until(
            lambda: giver.endpoint not in json.loads(path.read_text()),
            what="the flow marked ended",
            timeout=20.0,
        )
    finally:
        r.stop()
        spool.close()
    assert r.error is None, r.error
    again = Spool(tmp_path / "spool", sync=False)
    closing.append(again)
    r2 = _receiver(closing, again, [giver.endpoint], ctx, credit=5, max_backlog=20)
    wait_until(lambda: len(giver.bots) == 2, what="a BOT from the next receiver", timeout=20.0)
    assert r2.error is None and r2.status()[0].state != "failed"


class SilentEndGiver(PlainGiver):
    """A plain giver that never ends its flow nor echoes our EOT; ``late`` more records
    come after our EOT."""

    echo_eot = False

    def __init__(self, ctx: zmq.Context, values: list[bytes], late: list[bytes]) -> None:
        self.late = late
        super().__init__(ctx, values, credit=50)
        self.eot_sent = True  # its flow stays open once its values are given

    def on_eot(self, ident: bytes, label: dict) -> None:
        super().on_eot(ident, label)
        for v in self.late:  # in flight when our EOT crossed them
            self.send(ident, {"flow": "DAT"}, (v,))


def test_stop_outlasts_the_eot_phase_and_keeps_what_came_in_it(ctx, tmp_path, closing, monkeypatch):
    """stop() waits as long as ending the flows may take (derived from the EOT bounds,
    not a fixed 10 s), so the spool is closed after the last append: records that came
    after our EOT, while the echoes were awaited, are stored."""
    import zio_spark.source.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "_EOT_WAIT", 11.0)  # beyond the old fixed 10 s
    givers = [SilentEndGiver(ctx, [b"v%d" % i for i in range(10)], [b"late"]) for _ in range(4)]
    closing.extend(givers)
    spool = Spool(tmp_path / "spool", sync=False)
    r = Receiver(spool, [g.endpoint for g in givers], ctx=ctx, credit=50).start()
    try:
        wait_until(
            lambda: sum(st.records for st in r.status()) == 40, what="40 records", timeout=20.0
        )
        thread = r._thread
        assert thread is not None
        assert r.stop_bound() >= 4 * 0.5 + 11.0
        assert r.stop() is True
        assert not thread.is_alive()
        assert r.error is None, r.error
        ends = spool.seal()
    finally:
        r.stop()
        spool.close()
    assert [g.eot_echoes for g in givers] == [1, 1, 1, 1]  # our EOT reached each
    for g in givers:
        assert ends[g.endpoint] == 12, "the 10 records and the late one, all stored"


def test_stop_says_when_the_thread_outlives_its_bound(ctx, spool, closing, monkeypatch):
    release = threading.Event()

    def stuck_end(self: Receiver) -> None:
        release.wait(30)  # a thread that cannot end (the test releases it)

    monkeypatch.setattr(Receiver, "_end_with_eot", stuck_end)
    r = Receiver(spool, [], ctx=ctx).start()
    try:
        assert r.stop(timeout=0.2) is False
        assert r._thread is not None and r._thread.is_alive()
    finally:
        release.set()
    assert r.stop() is True and r._thread is None


def test_flush_acks_does_not_wait_for_a_plain_giver(ctx, spool, closing):
    """A plain giver takes no acks: flush_acks has nothing to send it (it waited its
    whole timeout for one, 5 s of every batch read from a plain giver)."""
    giver = PlainGiver(ctx, [b"f%d" % i for i in range(1000)], credit=5)
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, credit=5, max_backlog=20)
    wait_until(lambda: r.status()[0].records == 20, what="the backlog filled", timeout=20.0)
    assert r.status()[0].state == "receiving"
    r.acknowledge({giver.endpoint: 21})
    assert r.flush_acks(timeout=3.0) is True


def test_garbage_peer_is_dropped_and_others_keep_flowing(ctx, spool, closing):
    class Garbage(RawGiver):
        """Breaks the protocol differently on each BOT."""

        def on_bot(self, ident, label):
            if len(self.bots) == 1:  # not ZIO at all
                self.send_raw(ident, b"", b"\x00garbage", b"more")
                return
            ok = {"flow": "BOT", "direction": "extract", "credit": 2, "encoding": "arrow"}
            self.send(ident, ok)

        def on_pay(self, ident, label):
            if len(self.bots) == 2:  # says Arrow, sends something else
                self.send(ident, {"flow": "DAT"}, (b"not arrow",))
            else:  # more DATs than the credit paid (a flow control violation)
                for seq in range(1, 4):
                    self.send(ident, {"flow": "DAT"}, (encode_records(seq, [b"x"]),))

    bad = Garbage(ctx)
    closing.append(bad)
    prod = _producer(ctx, closing, "good")
    r = _receiver(closing, spool, [bad.endpoint, prod.endpoint], ctx, credit=20)
    for wave in range(3):
        prod.send_many([b"g%d" % i for i in range(wave * 2000, (wave + 1) * 2000)])
        wait_until(
            lambda w=wave: _held(spool, "good") == 2000 * (w + 1), what=f"wave {wave}", timeout=20.0
        )
    wait_until(lambda: len(bad.bots) >= 3 and r.stats["dropped"] >= 3, what="3 drops", timeout=20.0)
    bad_status = next(s for s in r.status() if s.endpoint == bad.endpoint)
    assert bad_status.failures >= 3
    assert bad_status.last_error
    assert r.error is None and r.fatal is None
    assert spool_rows(spool, "good") == [(i + 1, b"g%d" % i) for i in range(6000)]


def test_stop_is_prompt(ctx, spool, closing):
    """Stop returns fast with a flow mid-stream, a silent peer and nothing listening."""
    prod = _producer(ctx, closing, "busy")
    prod.send_many([b"z"] * 20_000)
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers a BOT
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        endpoints = [prod.endpoint, f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:1"]
        r = _receiver(closing, spool, endpoints, ctx, credit=10, max_backlog=5000)
        wait_until(lambda: _held(spool, "busy") > 0, what="records flowing", timeout=20.0)
        t = time.monotonic()
        r.stop()
        took = time.monotonic() - t
        assert r._thread is None
        assert r.error is None
        assert took < 1.0, f"stop took {took:.2f} s"
    finally:
        silent.close(0)


def test_a_spool_append_error_fails_that_flow_not_the_receiver(ctx, spool, closing, monkeypatch):
    """Records a spool refuses (e.g. a batch too big for one WAL record) end that
    producer's flow, which reconnects and resends; the receiver thread keeps going."""
    prod = _producer(ctx, closing, "p1")
    n = 5000
    prod.send_many([b"r%d" % i for i in range(n)])
    real = spool.append_batch
    refused = []

    def refuse_once(producer, batch):
        if not refused:
            refused.append(batch.num_rows)
            raise ValueError("append batch too large for one WAL record: (test)")
        return real(producer, batch)

    monkeypatch.setattr(spool, "append_batch", refuse_once)
    r = _receiver(closing, spool, [prod.endpoint], ctx)
    wait_until(
        lambda: _held(spool, "p1") == n, what="all records after the refused append", timeout=20.0
    )
    assert refused and r.error is None
    (st,) = r.status()
    assert st.failures >= 1 and "cannot store records" in (st.last_error or "")
    assert [s for s, _ in spool_rows(spool, "p1")] == list(range(1, n + 1))


# -- the producer's stated state (more: false, blocked_ms) and who holds whom back -------


class ProfileGiver(RawGiver):
    """A zio-spark producer written by hand: Arrow DATs whose labels carry the extra
    attributes each ``(extra, records)`` in ``dats`` says."""

    def __init__(self, ctx: zmq.Context, dats: list[tuple[dict, int]]) -> None:
        self.dats = dats
        self.sent = 0
        self.next_seq = 1
        self.credit: dict[bytes, int] = {}
        super().__init__(ctx)

    def on_bot(self, ident: bytes, label: dict) -> None:
        self.credit[ident] = 0
        attrs = {"producer": "raw", "stream": "zio", "ack": True, "encoding": "arrow"}
        self.send(ident, {"flow": "BOT", "direction": "extract", "credit": 5, **attrs})

    def on_pay(self, ident: bytes, label: dict) -> None:
        self.credit[ident] += label["credit"]
        while self.credit[ident] > 0 and self.sent < len(self.dats):
            extra, n = self.dats[self.sent]
            payload = encode_records(self.next_seq, [b"v"] * n)
            self.send(ident, {"flow": "DAT", **extra}, (payload,))
            self.credit[ident] -= 1
            self.sent += 1
            self.next_seq += n


def test_a_producer_is_idle_once_it_said_more_false_and_all_it_sent_is_stored(ctx, spool, closing):
    prod = _producer(ctx, closing, "p1")
    n = 20_000
    prod.send_many([b"r%d" % i for i in range(n)])
    r = _receiver(closing, spool, [prod.endpoint], ctx, credit=10)
    seen_busy = False
    deadline = time.monotonic() + 20
    while True:  # idle never shows before the last record is in the spool
        (st,) = r.status()
        if st.idle:
            assert _held(spool, "p1") == n
            break
        seen_busy |= st.state == "receiving"
        assert time.monotonic() < deadline, "never idle"
        time.sleep(0.001)  # sampling period, not a wait for a condition
    assert seen_busy
    prod.send_many([b"more"] * 1500)
    wait_until(
        lambda: _held(spool, "p1") == n + 1500 and r.status()[0].idle,
        what="idle again",
        timeout=20.0,
    )


def test_a_producer_with_nothing_to_send_is_idle_at_once(ctx, spool, closing):
    prod = _producer(ctx, closing, "empty")
    r = _receiver(closing, spool, [prod.endpoint], ctx)
    # Idle is set once the read that brought the BOT is stored (a status read in between
    # sees "receiving", not yet idle): wait for both. No DAT ever comes, so only the BOT's
    # "more": false can make it idle.
    wait_until(
        lambda: r.status()[0].state == "receiving" and r.status()[0].idle,
        what="the flow, idle",
        timeout=20.0,
    )
    (st,) = r.status()
    assert st.idle and st.records == 0 and st.last_error is None  # said in its BOT


def test_idle_follows_the_last_dat_of_a_hand_written_producer(ctx, spool, closing):
    giver = ProfileGiver(ctx, [({}, 3), ({"more": False}, 2), ({}, 4)])
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, reconnect=False)
    wait_until(lambda: _held(spool, "raw") == 9, what="9 records", timeout=20.0)
    assert not r.status()[0].idle  # its last DAT did not say more: false


def test_a_bad_state_attribute_fails_the_flow_naming_it(ctx, spool, closing):
    giver = ProfileGiver(ctx, [({"more": "no"}, 2)])
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, reconnect=False)
    wait_until(lambda: r.status()[0].state == "failed", what="the flow to fail", timeout=20.0)
    (st,) = r.status()
    assert "DAT more must be true or false, got 'no'" in (st.last_error or "")
    assert not st.idle and _held(spool, "raw") == 0


@pytest.mark.parametrize("reconnect", [False, True])
def test_each_failed_flow_is_logged_once_naming_the_producer_and_the_cause(
    ctx, spool, closing, caplog, reconnect
):
    """One log line per failure (the flow's engine's), not a second one from the
    receiver; the counters and the status count the same failures."""
    caplog.set_level(logging.INFO, logger="zio_spark")
    giver = ProfileGiver(ctx, [({"more": "no"}, 2)] * 3)
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, reconnect=reconnect)
    want = 2 if reconnect else 1
    wait_until(lambda: r.status()[0].failures >= want, what=f"{want} failures", timeout=20.0)
    r.stop()  # no more failures, and every line is written
    cause = "DAT more must be true or false, got 'no'"
    lines = [rec.getMessage() for rec in caplog.records if cause in rec.getMessage()]
    (st,) = r.status()
    assert len(lines) == st.failures == r.stats["flow_failures"] >= want, lines
    assert all(giver.endpoint in line for line in lines), lines


def test_the_producers_stated_blocked_time_is_reported(ctx, spool, closing):
    giver = ProfileGiver(ctx, [({"blocked_ms": 1234}, 2), ({}, 1)])
    closing.append(giver)
    r = _receiver(closing, spool, [giver.endpoint], ctx, reconnect=False)
    wait_until(lambda: _held(spool, "raw") == 3, what="3 records", timeout=20.0)
    assert r.holdups()["raw"]["blockedMs"] == 1234  # kept until it states another


def test_a_blocked_producer_and_the_withheld_credit_are_reported(ctx, spool, closing):
    """A producer whose window fills states its blocked time; a receiver whose backlog
    fills counts the time it withheld credit, and stops counting once commits free it."""
    prod = Producer(
        ctx=ctx, producer_id="w", linger_ms=0, bind="tcp://127.0.0.1:*", max_unacked=200
    )
    closing.append(prod)
    r = _receiver(closing, spool, [prod.endpoint], ctx, credit=10, max_backlog=100)
    sending = threading.Thread(target=prod.send_many, args=([b"x"] * 300,), daemon=True)
    sending.start()
    wait_until(
        lambda: prod.window_full and prod.blocked_seconds >= 0.3,
        what="a blocked producer",
        timeout=20.0,
    )
    wait_until(
        lambda: r.holdups().get("w", {}).get("withheldMs", 0) >= 300,
        what="credit withheld",
        timeout=20.0,
    )
    while _held(spool, "w") < 300:  # Spark's commits, as fast as the records come
        ends = spool.seal()
        r.commit(ends)
        wait_until(
            lambda e=ends["w"]: _held(spool, "w") >= min(e, 300), what="more records", timeout=20.0
        )
    sending.join(10)
    r.commit(spool.seal())
    wait_until(
        lambda: r.holdups()["w"].get("blockedMs", 0) >= 300,
        what="the stated blocked time",
        timeout=20.0,
    )
    assert r.holdups()["w"]["blockedMs"] <= prod.blocked_seconds * 1000 + 1
    done = _wait_quiet(
        lambda: r.holdups()["w"]["withheldMs"], quiet=0.3, what="withheld time", moving=False
    )
    assert done >= 300


def test_a_giver_client_of_a_bound_receiver_says_idle_too(ctx, spool, closing):
    r = _receiver(closing, spool, [], ctx, bind=["tcp://127.0.0.1:*"])
    (endpoint,) = r.bound_endpoints()
    prod = Producer(ctx=ctx, producer_id="c1", linger_ms=0, connect=endpoint)
    closing.append(prod)
    prod.send_many([b"c%d" % i for i in range(5000)])
    wait_until(lambda: any(s.idle for s in r.status()), what="the client flow idle", timeout=20.0)
    assert _held(spool, "c1") == 5000


def test_default_dats_carry_4096_records_and_large_records_fewer(ctx, spool, closing):
    """Our producer and the source's defaults: 4096 records per Arrow DAT (per-DAT costs
    dominate below that), and about 4 MiB at most, so 1 MiB records make small DATs."""
    prod = _producer(ctx, closing, "big-dats")
    prod.send_many([b"s"] * 10_000)
    _receiver(closing, spool, [prod.endpoint], ctx)
    wait_until(lambda: _held(spool, "big-dats") == 10_000, what="the records", timeout=20.0)
    assert prod.stats["dats_sent"] == 3  # 4096 + 4096 + 1808
    large = _producer(ctx, closing, "large")
    large.send_many([b"L" * (1 << 20)] * 12)
    _receiver(closing, spool, [large.endpoint], ctx)
    wait_until(lambda: _held(spool, "large") == 12, what="the large records", timeout=20.0)
    assert large.stats["dats_sent"] == 3  # 4 records of 1 MiB each
