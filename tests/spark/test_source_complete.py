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
from pathlib import Path

import pytest
import zmq
from pyspark.sql.streaming.datasource import ReadAllAvailable

from tests.peers.zio_reference import ReferenceServer
from tests.support import free_endpoint, runner_reader, to_parquet, wait_until, zio_stream
from zio_spark.errors import TransportError
from zio_spark.protocol.flow import BotReceived, Flow, Role
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
def silent_giver():
    ctx = zmq.Context()
    g = _SilentGiver(ctx)
    yield g
    g.close()
    ctx.term()


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
def ref_giver():
    """A reference-style plain giver (C++ flavour): one flow at a time, no resume, dies on
    a BOT mid-flow; 200k values, so a flow is still going when the reader stops."""
    ctx = zmq.Context()
    ref = ReferenceServer(
        ctx, role="giver", flavor="cpp", values=[b"x%d" % i for i in range(200_000)]
    )
    yield ref
    ref.close()
    ctx.term()


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
        wait_until(lambda: _open_flows(tmp_path) == {}, what="the flow marked gone")
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
