"""The source decides completeness from protocol state, and stop means EOT (issue #23).

Runner-side (no Spark session): availableNow ends at the producers' stated positions; a
plain giver that never gives, or an endpoint never reached, is an error, never an empty
success; stopping the reader (``stop()``, SIGTERM) sends an EOT that a reference-style
giver sees; a restart after a runner that was killed mid-flow fails naming the endpoint
instead of sending a BOT that would kill the giver's open flow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import zmq
from pyspark.sql.streaming.datasource import ReadAllAvailable

from tests.peers.zio_reference import ReferenceServer
from tests.support import free_endpoint, runner_reader, to_parquet, wait_until, zio_stream
from zio_spark.errors import TransportError
from zio_spark.protocol.flow import BotReceived, Flow, FlowState, Role
from zio_spark.spark import compat
from zio_spark.transport.port import ServerPort


def test_available_now_ends_at_the_position_the_producer_stated(producers, tmp_path):
    prod = producers("stated")
    n = 5000
    prod.send_many([b"v%d" % i for i in range(n)])
    reader = runner_reader(prod.endpoint, tmp_path)
    try:
        reader.prepareForTriggerAvailableNow()
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end == {"stated": n + 1}
        assert reader._rt.receiver.stated_positions() == {"stated": n}
        assert reader.latestOffset(end, ReadAllAvailable()) == end  # the run is over
    finally:
        reader.stop()


@pytest.mark.parametrize("native", [True, False], ids=["spark4.2+", "spark4.0-4.1"])
def test_first_latest_offset_waits_for_what_the_producer_held_at_connect(
    producers, tmp_path, monkeypatch, native
):
    """No prepareForTriggerAvailableNow (Spark 4.0/4.1 run availableNow as this one
    batch): the first batch still holds every record the producer held."""
    monkeypatch.setattr(compat, "HAS_TRIGGER_AVAILABLE_NOW", native, raising=False)
    prod = producers(f"first-all-{native}")
    n = 20_000
    prod.send_many([b"v%d" % i for i in range(n)])
    reader = runner_reader(prod.endpoint, tmp_path)
    try:
        start = reader.initialOffset()
        if native:  # a stream waits for connections only briefly: let this one come
            wait_until(lambda: reader._rt.receiver.stated_positions(), what="its BOT")
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end == {f"first-all-{native}": n + 1}
    finally:
        reader.stop()


class _SilentGiver:
    """A plain giver that answers the BOT (an echo, as the reference does) and then
    never sends anything."""

    def __init__(self, ctx: zmq.Context) -> None:  # type: ignore[type-arg]
        self.port = ServerPort(ctx, linger_ms=0)
        self.endpoint = self.port.bind("tcp://127.0.0.1:*")
        self.bots = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        flows: dict[object, Flow] = {}
        while not self._stop.is_set():
            got = self.port.recv(50)
            if got is None or not isinstance(got, tuple):
                continue
            rid, msg = got
            flow = flows.setdefault(rid, Flow(Role.SERVER))
            event = flow.receive(msg)
            if isinstance(event, BotReceived):
                self.bots += 1
                self.port.send(flow.accept(None, dict(event.attrs)), rid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.port.close(0)


@pytest.fixture
def silent_giver(ctx):
    g = _SilentGiver(ctx)
    yield g
    g.close()


def test_a_plain_giver_that_gives_nothing_fails_the_run_not_an_empty_success(
    silent_giver, tmp_path
):
    reader = runner_reader(silent_giver.endpoint, tmp_path, plainGiverQuiet="300ms")
    try:
        reader.prepareForTriggerAvailableNow()
        with pytest.raises(TransportError, match="plainGiverQuiet") as info:
            reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
        assert silent_giver.endpoint in str(info.value)
        assert "failOnDataLoss=false" in str(info.value)  # the fix is named
    finally:
        reader.stop()


def test_with_fail_on_data_loss_false_the_empty_plain_run_is_logged(silent_giver, tmp_path, caplog):
    reader = runner_reader(
        silent_giver.endpoint, tmp_path, plainGiverQuiet="300ms", failOnDataLoss="false"
    )
    try:
        reader.prepareForTriggerAvailableNow()
        with caplog.at_level("WARNING", logger="zio_spark.source"):
            assert reader.latestOffset(reader.initialOffset(), ReadAllAvailable()) == {}
        assert any(silent_giver.endpoint in r.getMessage() for r in caplog.records)
    finally:
        reader.stop()


def test_an_endpoint_never_reached_fails_the_available_now_run(tmp_path):
    endpoint = free_endpoint()  # nothing listens there
    reader = runner_reader(endpoint, tmp_path, connectTimeout="1s")
    try:
        reader.prepareForTriggerAvailableNow()
        with pytest.raises(TransportError, match="not reachable") as info:
            reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
        assert endpoint in str(info.value)
    finally:
        reader.stop()


# -- stop means EOT ---------------------------------------------------------------------------


@pytest.fixture
def ref_giver(ctx):
    """A reference-style plain giver (C++ flavour): one flow at a time, no resume, dies on
    a BOT mid-flow; 200k values, so a flow is still going when the reader stops."""
    ref = ReferenceServer(
        ctx, role="giver", flavor="cpp", values=[b"x%d" % i for i in range(200_000)]
    )
    yield ref
    ref.close()


def _open_flows(tmp_path) -> dict[str, str]:
    path = tmp_path / "spool" / "plain_flows.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_stop_sends_an_eot_the_reference_giver_sees(ref_giver, tmp_path):
    reader = runner_reader(ref_giver.endpoint, tmp_path)
    reader.initialOffset()
    rt = reader._rt
    wait_until(lambda: sum(rt.spool.backlog().values()) >= 500, what="records flowing")
    assert ref_giver.endpoint in _open_flows(tmp_path)  # a plain flow is open
    reader.stop()
    wait_until(lambda: ref_giver.eots_received == 1, what="the giver got our EOT")
    assert ref_giver.flows_completed == 1 and ref_giver.flows_killed == 0
    assert ref_giver.values[-1] not in ref_giver.sent  # it was mid-flow
    assert _open_flows(tmp_path) == {}  # closed on both sides: a restart may reconnect
    again = runner_reader(ref_giver.endpoint, tmp_path)
    try:
        again.initialOffset()
        wait_until(lambda: ref_giver.flows_started == 2, what="a new flow after a clean stop")
        assert ref_giver.flows_killed == 0
    finally:
        again.stop()


def test_a_plain_giver_that_went_away_leaves_no_open_flow_behind(ref_giver, tmp_path):
    reader = runner_reader(ref_giver.endpoint, tmp_path)
    try:
        reader.initialOffset()
        rt = reader._rt
        wait_until(lambda: sum(rt.spool.backlog().values()) >= 500, what="records flowing")
        assert ref_giver.endpoint in _open_flows(tmp_path)
        ref_giver.close()  # its process ends: the connection drops, no flow is left open
        wait_until(
            lambda: _open_flows(tmp_path) == {},
            what="the flow marked gone",
            detail=lambda: (_open_flows(tmp_path), rt.receiver.status()),
        )
    finally:
        reader.stop()


# The child runs the reader as the runner does and blocks on stdin once records flow.
RUNNER_CHILD = str(Path(__file__).with_name("runner_child.py"))


def _child(ref, tmp_path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, RUNNER_CHILD, "receive", ref.endpoint, str(tmp_path / "spool")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "receiving":
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"reader child did not start receiving: {line!r} {err[-2000:]!r}")
    return proc


def test_sigterm_to_the_runner_sends_an_eot(ref_giver, tmp_path):
    proc = _child(ref_giver, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wait_until(lambda: ref_giver.eots_received == 1, what="the giver got our EOT")
    assert ref_giver.flows_killed == 0
    assert _open_flows(tmp_path) == {}


def test_restart_after_a_killed_runner_fails_naming_the_open_plain_flow(ref_giver, tmp_path):
    proc = _child(ref_giver, tmp_path)
    proc.kill()  # SIGKILL: no EOT
    proc.communicate(timeout=60)
    assert ref_giver.endpoint in _open_flows(tmp_path)
    reader = runner_reader(ref_giver.endpoint, tmp_path)
    try:
        with pytest.raises(TransportError, match="left its flow") as info:
            reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
        text = str(info.value)
        assert ref_giver.endpoint in text and "plain_flows.json" in text  # where, the fix
        assert ref_giver.flows_started == 1 and ref_giver.flows_killed == 0  # no BOT sent
    finally:
        reader.stop()


# -- stop means EOT, through Spark -------------------------------------------------------------


def test_query_stop_sends_an_eot_to_a_reference_giver(spark, ref_giver, tmp_path):
    q = (
        zio_stream(spark, ref_giver.endpoint, tmp_path)
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .start()
    )
    try:
        wait_until(
            lambda: len(ref_giver.sent) >= 1000 or not q.isActive,
            timeout=300,
            what="the giver giving",
        )
        assert q.isActive, q.exception()
    finally:
        q.stop()
    wait_until(lambda: ref_giver.eots_received == 1, timeout=60, what="the giver got our EOT")
    assert ref_giver.flows_killed == 0
    assert ref_giver.values[-1] not in ref_giver.sent  # it was mid-flow
    # q.stop() does not wait for the runner: it marks the flow closed at the echo.
    wait_until(lambda: _open_flows(tmp_path) == {}, timeout=60, what="the flow marked closed")


def test_the_end_of_an_available_now_run_sends_an_eot(spark, producers, tmp_path):
    prod = producers("an-end")
    prod.send_many([b"v%d" % i for i in range(1000)])
    q = to_parquet(zio_stream(spark, prod.endpoint, tmp_path), tmp_path, availableNow=True)
    assert q.awaitTermination(600)
    assert q.exception() is None
    assert spark.read.parquet(str(tmp_path / "out")).count() == 1000
    wait_until(lambda: prod.stats["eot_received"] >= 1, timeout=60, what="our EOT")


def test_available_now_in_bind_mode_takes_what_a_giver_client_held(tmp_path):
    from zio_spark.options import parse_source_options
    from zio_spark.source.producer import Producer
    from zio_spark.spark.source import ZioStreamReader

    endpoint = free_endpoint()
    # A giver client states no position yet: the run ends at its ``more: false`` (the
    # DAT that empties its queue); plainGiverQuiet only guards a client that never gives.
    opts = parse_source_options(
        {
            "bind": endpoint,
            "spoolPath": str(tmp_path / "spool"),
            "spoolAccess": "local",
            "plainGiverQuiet": "60s",
        }
    )
    reader = ZioStreamReader(opts, ("seq", "value"))
    reader.prepareForTriggerAvailableNow()
    n = 3000
    prod = Producer(connect=endpoint, producer_id="client-held", linger_ms=0)
    try:
        prod.send_many([b"v%d" % i for i in range(n)])
        assert reader.latestOffset(reader.initialOffset(), ReadAllAvailable()) == {
            "client-held": n + 1
        }
    finally:
        reader.stop()
        prod.close(timeout=5, flush=False)


_DRIVER = textwrap.dedent(
    """
    import sys, time
    from tests.support import spark_session

    spark = spark_session("zio-driver-term")
    q = (
        spark.readStream.format("zio")
        .option("endpoints", sys.argv[1])
        .option("spoolPath", sys.argv[2] + "/spool")
        .option("spoolAccess", "local")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", sys.argv[2] + "/ckpt")
        .start()
    )
    print("started", flush=True)
    q.awaitTermination()
    """
)


def test_sigterm_to_the_driver_sends_an_eot(ref_giver, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, ref_giver.endpoint, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        wait_until(
            lambda: len(ref_giver.sent) >= 1000 or proc.poll() is not None,
            timeout=300,
            what="the giver giving to the driver's query",
        )
        assert proc.poll() is None, "the driver ended before its query read"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    wait_until(lambda: ref_giver.eots_received == 1, timeout=60, what="the giver got our EOT")
    assert ref_giver.flows_killed == 0
    wait_until(lambda: _open_flows(tmp_path) == {}, timeout=60, what="the flow marked closed")


# -- completeness under maxBacklog, pauses and flows down (review of 0478ffa) ---------------------


def _withheld_ms(recv, producer: str) -> int:
    return recv.holdups().get(producer, {}).get("withheldMs", 0)


def test_a_plain_giver_held_back_by_max_backlog_is_not_taken_as_done(ctx, tmp_path):
    """Quiet counts only while the giver holds credit: step batches slower than
    plainGiverQuiet (the giver held back by maxBacklog meanwhile) lose nothing."""
    n = 2000
    ref = ReferenceServer(ctx, role="giver", flavor="cpp", values=[b"h%d" % i for i in range(n)])
    reader = runner_reader(ref.endpoint, tmp_path, maxBacklog="500", plainGiverQuiet="300ms")
    try:
        reader.prepareForTriggerAvailableNow()
        end = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
        recv = reader._rt.receiver
        steps = 0
        while reader._target is None:
            steps += 1
            # Spark runs this step batch for 3x plainGiverQuiet: the giver has no credit.
            before = _withheld_ms(recv, ref.endpoint)
            wait_until(
                lambda b=before: _withheld_ms(recv, ref.endpoint) - b > 900,
                what="the giver held back for 3x plainGiverQuiet",
            )
            end = reader.latestOffset(end, ReadAllAvailable())
        assert end == {ref.endpoint: n + 1}
        assert steps >= 3  # maxBacklog 500 of 2000: step batches happened
        assert reader.latestOffset(end, ReadAllAvailable()) == end
    finally:
        reader.stop()
        ref.close()


def _latest_in_thread(reader, start) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def run() -> None:
        try:
            got["end"] = reader.latestOffset(start, ReadAllAvailable())
        except BaseException as e:  # handed to the test thread
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_a_zio_spark_giver_client_that_pauses_is_not_ended_by_plain_giver_quiet(tmp_path):
    from zio_spark.options import parse_source_options
    from zio_spark.source.producer import Producer
    from zio_spark.spark.source import ZioStreamReader

    endpoint = free_endpoint()
    opts = {"bind": endpoint, "spoolPath": str(tmp_path / "spool"), "spoolAccess": "local"}
    reader = ZioStreamReader(
        parse_source_options({**opts, "plainGiverQuiet": "300ms"}), ("seq", "value")
    )
    reader.prepareForTriggerAvailableNow()
    start = reader.initialOffset()
    recv = reader._rt.receiver
    prod = Producer(connect=endpoint, producer_id="client-pause", linger_ms=0)
    try:

        def quiet() -> float:
            mine = [s for s in recv.status() if s.producer == "client-pause"]
            live = [s for s in mine if s.state == "receiving"]
            return recv.looked_at - live[0].last_data if live else 0.0

        t, got = _latest_in_thread(reader, start)
        wait_until(lambda: quiet() > 1.0 or not t.is_alive(), what="a pause of 3x the quiet")
        assert t.is_alive(), got  # neither ended nor failed by plainGiverQuiet
        n = 3000
        prod.send_many([b"v%d" % i for i in range(n)])
        wait_until(lambda: not t.is_alive(), what="the run's end at more:false")
        assert got == {"end": {"client-pause": n + 1}}
    finally:
        reader.stop()
        prod.close(timeout=5, flush=False)


def _held_then_closed(producers, tmp_path, name: str, **options: str):
    """A producer stating 5000 records, held back by maxBacklog 500, then closed without
    flushing: its EOT comes short of its stated position."""
    prod = producers(name)
    prod.send_many([b"v%d" % i for i in range(5000)])
    reader = runner_reader(prod.endpoint, tmp_path, maxBacklog="500", **options)
    return prod, reader


def test_an_eot_short_of_the_stated_position_is_not_the_end(producers, tmp_path):
    prod, reader = _held_then_closed(producers, tmp_path, "eot-short", connectTimeout="5s")
    try:
        reader.prepareForTriggerAvailableNow()
        end = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
        assert 1 < end["eot-short"] < 5001  # a step: maxBacklog held it back
        recv = reader._rt.receiver
        prod.close(timeout=5, flush=False)  # EOT with records still held
        wait_until(
            lambda: all(s.state != "receiving" for s in recv.status()), what="its flow ended"
        )
        with pytest.raises(TransportError, match="stated it held records up to 5000") as info:
            reader.latestOffset(end, ReadAllAvailable())
        assert prod.endpoint in str(info.value)
    finally:
        reader.stop()


@pytest.mark.parametrize("native", [True, False], ids=["spark4.2+", "spark4.0-4.1"])
def test_the_first_batch_stops_awaiting_a_stating_producer_down_for_connect_timeout(
    producers, tmp_path, monkeypatch, caplog, native
):
    monkeypatch.setattr(compat, "HAS_TRIGGER_AVAILABLE_NOW", native, raising=False)
    prod, reader = _held_then_closed(producers, tmp_path, f"down-{native}", connectTimeout="2s")
    try:
        start = reader.initialOffset()
        recv = reader._rt.receiver
        wait_until(lambda: recv.held_back(), what="maxBacklog holding it back")
        prod.close(timeout=5, flush=False)
        wait_until(
            lambda: all(s.state != "receiving" for s in recv.status()), what="its flow ended"
        )
        with caplog.at_level("WARNING", logger="zio_spark.source"):
            t, got = _latest_in_thread(reader, start)
            wait_until(lambda: not t.is_alive(), what="the first batch's end")
        assert 1 < got["end"][f"down-{native}"] < 5001, got
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(prod.endpoint in m and "first batch" in m for m in warned), warned
    finally:
        reader.stop()


_PRODUCER = textwrap.dedent(
    """
    import sys, time
    from zio_spark.source.producer import Producer

    endpoint, producer_id, count, topology = sys.argv[1:5]
    where = {"connect": endpoint} if topology == "connect" else {"bind": endpoint}
    prod = Producer(producer_id=producer_id, linger_ms=0, max_unacked=200_000, **where)
    prod.send_many([b"r%d" % s for s in range(1, int(count) + 1)])
    print("QUEUED", flush=True)
    while True:
        time.sleep(1.0)  # gives until it is killed
    """
)


@pytest.fixture
def child_producer():
    """``start(endpoint, producer_id, count, topology)``: a producer in a child process
    that queues ``count`` records and gives them, killed (SIGKILL, by pid) at will."""
    procs: list[subprocess.Popen[str]] = []

    def start(endpoint: str, producer_id: str, count: int, topology: str):
        proc = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER, endpoint, producer_id, str(count), topology],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "QUEUED":
            proc.kill()
            pytest.fail(f"producer child did not start: {line!r} {proc.communicate()[1][-2000:]!r}")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def test_the_first_batch_stops_awaiting_a_stating_producer_whose_flow_failed(
    child_producer, tmp_path, caplog
):
    """Killed (no EOT), the producer's flow keeps reconnecting: awaited connectTimeout,
    then a WARN naming it, never an endless wait."""
    endpoint = free_endpoint()
    proc = child_producer(endpoint, "killed", 5000, "bind")
    reader = runner_reader(endpoint, tmp_path, maxBacklog="500", connectTimeout="3s")
    try:
        start = reader.initialOffset()
        recv = reader._rt.receiver
        wait_until(lambda: recv.held_back(), what="maxBacklog holding it back")
        assert recv.stated_positions() == {"killed": 5000}
        proc.kill()
        proc.communicate(timeout=60)
        wait_until(lambda: all(s.state != "receiving" for s in recv.status()), what="its flow down")
        with caplog.at_level("WARNING", logger="zio_spark.source"):
            t, got = _latest_in_thread(reader, start)
            wait_until(lambda: not t.is_alive(), what="the first batch's end")
        assert 1 < got["end"]["killed"] < 5001, got
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(endpoint in m and "first batch" in m for m in warned), warned
    finally:
        reader.stop()


def test_bind_mode_awaits_a_named_giver_client_whose_flow_dropped(child_producer, tmp_path):
    """A client that stated its producer id and dropped is awaited connectTimeout (it
    reconnects when it can), then the run fails naming it: never a short success."""
    from zio_spark.options import parse_source_options
    from zio_spark.spark.source import ZioStreamReader

    endpoint = free_endpoint()
    # Started first (it connects once we bind): a slow child start is no "no producer".
    proc = child_producer(endpoint, "dropped", 5000, "connect")
    opts = {"bind": endpoint, "spoolPath": str(tmp_path / "spool"), "spoolAccess": "local"}
    reader = ZioStreamReader(
        parse_source_options({**opts, "maxBacklog": "500", "connectTimeout": "4s"}),
        ("seq", "value"),
    )
    try:
        reader.prepareForTriggerAvailableNow()
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        assert 1 < end.get("dropped", 0) < 5001, end  # a step: maxBacklog held it back
        proc.kill()  # the commit frees credit: our PAY to it fails, its flow drops
        proc.communicate(timeout=60)
        with pytest.raises(TransportError, match="did not come back") as info:
            reader.latestOffset(end, ReadAllAvailable())
        assert "dropped" in str(info.value)
    finally:
        reader.stop()


class _DrippingGiver(_SilentGiver):
    """A plain giver that gives one record every 20 ms, within the credit paid, for as
    long as it runs: never quiet (a steady stream)."""

    def _run(self) -> None:
        flow: Flow | None = None
        rid: object = None
        n, next_at = 0, 0.0
        while not self._stop.is_set():
            got = self.port.recv(10)
            if isinstance(got, tuple):
                rid, msg = got
                flow = flow or Flow(Role.SERVER)
                event = flow.receive(msg)
                if isinstance(event, BotReceived):
                    self.bots += 1
                    self.port.send(flow.accept(None, dict(event.attrs)), rid)
            ready = flow is not None and flow.state is FlowState.READY and flow.credit > 0
            if ready and time.monotonic() >= next_at:  # pacing the giver, not a test wait
                assert flow is not None
                self.port.send(flow.send_dat((b"d%d" % n,)), rid)
                n += 1
                next_at = time.monotonic() + 0.02


@pytest.fixture
def dripping_giver(ctx):
    g = _DrippingGiver(ctx)
    yield g
    g.close()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_on_spark_4_0_the_first_batch_waits_for_a_steady_plain_giver_at_most_connect_timeout(
    dripping_giver, tmp_path, monkeypatch, caplog
):
    """Spark 4.0/4.1 give every query this one-batch wait (processingTime too): a plain
    giver that never goes quiet is awaited connectTimeout, then a WARN."""
    monkeypatch.setattr(compat, "HAS_TRIGGER_AVAILABLE_NOW", False, raising=False)
    ep = dripping_giver.endpoint
    reader = runner_reader(ep, tmp_path, connectTimeout="4s", plainGiverQuiet="500ms")
    try:
        with caplog.at_level("WARNING", logger="zio_spark.source"):
            t, got = _latest_in_thread(reader, reader.initialOffset())
            wait_until(lambda: not t.is_alive(), timeout=60, what="the first batch's end")
        assert got["end"][ep] > 1, got  # what it gave so far
        assert any(ep in m and "connectTimeout" in m for m in _warnings(caplog)), caplog.text
    finally:
        reader.stop()


def test_on_spark_4_0_the_first_batch_warns_of_each_producer_it_goes_on_without(
    silent_giver, tmp_path, monkeypatch, caplog
):
    """An unreachable endpoint and a plain giver that gave nothing: a WARN for each,
    never a silent short run (4.0/4.1 run availableNow as this one batch)."""
    monkeypatch.setattr(compat, "HAS_TRIGGER_AVAILABLE_NOW", False, raising=False)
    nobody = free_endpoint()
    reader = runner_reader(
        f"{nobody},{silent_giver.endpoint}", tmp_path, connectTimeout="3s", plainGiverQuiet="300ms"
    )
    try:
        with caplog.at_level("WARNING", logger="zio_spark.source"):
            assert reader.latestOffset(reader.initialOffset(), ReadAllAvailable()) == {}
        warned = _warnings(caplog)
        assert any(nobody in m and "not reachable" in m for m in warned), warned
        assert any(silent_giver.endpoint in m and "gave nothing" in m for m in warned), warned
    finally:
        reader.stop()
