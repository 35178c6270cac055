"""The locked segment server (issue #15): CURVE only, this run's reader key only, and a
default address that is the driver's Spark host address, never every interface."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import zmq

from tests.loopback.conftest import RecordingProxy
from tests.support import wait_until
from zio_spark.errors import ConfigError, DataLossError, TransportError
from zio_spark.options import parse_source_options
from zio_spark.source.spool_server import (
    SegmentKeys,
    SegmentServer,
    _await,
    _ipc,
    _reader_socket,
    driver_host,
    fetch_range,
)
from zio_spark.storage.spool import Record, Spool, read_sealed

MARKER = b"PLAINTEXT-MARKER-7f3a9c"
N = 500
P = "producer-4e1d0b"  # also looked for on the wire


@pytest.fixture
def spool_path(tmp_path: Path) -> str:
    path = tmp_path / "spool"
    with Spool(path) as spool:
        spool.append(P, [Record(i, MARKER + b"-%d" % i) for i in range(1, N + 1)])
        spool.flush()
        assert spool.seal() == {P: N + 1}
    return str(path)


@pytest.fixture
def server(spool_path: str) -> Iterator[SegmentServer]:
    srv = SegmentServer(spool_path, "127.0.0.1")
    yield srv
    srv.stop()


def _values(batches: Iterator[pa.RecordBatch]) -> list[bytes]:
    return [v for b in batches for v in b.column("value").to_pylist()]


def _other_reader(keys: SegmentKeys) -> SegmentKeys:
    public, secret = zmq.curve_keypair()
    return SegmentKeys(keys.server_public, public.decode(), secret.decode())


def test_reader_with_the_keys_gets_the_range(server: SegmentServer, spool_path: str) -> None:
    got = _values(fetch_range(server.endpoint, server.keys, P, 10, 110, timeout=10))
    assert got == _values(read_sealed(spool_path, P, 10, 110))
    assert got[0] == MARKER + b"-10" and len(got) == 100
    assert server.requests == 1
    with pytest.raises(DataLossError):
        list(fetch_range(server.endpoint, server.keys, P, N + 5, N + 9, timeout=10))


def test_default_bind_is_loopback_and_advertised_as_bound(server: SegmentServer) -> None:
    assert server.bound.startswith("tcp://127.0.0.1:")
    assert server.endpoint == server.bound


def test_reader_without_curve_gets_nothing(server: SegmentServer, ctx: zmq.Context[Any]) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(server.endpoint)
        sock.send_multipart([b"READ", P.encode(), b"1", str(N + 1).encode()])
        assert sock.poll(1500) == 0, "a reader without CURVE got an answer"
    finally:
        sock.close(0)
    assert server.requests == 0


def test_reader_with_another_reader_key_is_refused(server: SegmentServer) -> None:
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="refused our CURVE handshake") as err:
        list(fetch_range(server.endpoint, _other_reader(server.keys), P, 1, 11, timeout=20))
    # Refused at the handshake (ZAP said no), not a timeout.
    assert time.monotonic() - t0 < 10
    assert err.value.endpoint == server.endpoint
    assert server.requests == 0


def test_a_request_sent_after_the_refusal_fails_instead_of_blocking(
    server: SegmentServer, ctx: zmq.Context[Any]
) -> None:
    """A reader thread descheduled between connect and send (a busy executor) sends after
    the refused handshake dropped the DEALER's only pipe: a blocking send would never
    return. The wait before the send names the refusal."""
    sock, monitor = _reader_socket(ctx, _other_reader(server.keys), server.endpoint)
    try:
        # the state the race leaves: no room to send (the refusal dropped the pipe)
        wait_until(lambda: not sock.poll(0, zmq.POLLOUT), what="the pipe dropped", timeout=20.0)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="refused our CURVE handshake"):
            _await(sock, monitor, zmq.POLLOUT, 20.0, server.endpoint, "could not send to")
        assert time.monotonic() - t0 < 10
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    assert server.requests == 0


def test_reader_expecting_another_server_key_gets_nothing(server: SegmentServer) -> None:
    impostor, _ = zmq.curve_keypair()
    keys = SegmentKeys(impostor.decode(), server.keys.reader_public, server.keys.reader_secret)
    with pytest.raises(TransportError, match="refused our CURVE handshake"):
        list(fetch_range(server.endpoint, keys, P, 1, 11, timeout=20))
    assert server.requests == 0


def test_keys_are_fresh_per_server_run(spool_path: str, server: SegmentServer) -> None:
    second = SegmentServer(spool_path, "127.0.0.1")
    try:
        assert second.keys.server_public != server.keys.server_public
        assert second.keys.reader_public != server.keys.reader_public
        # Keys of one run do not open another.
        with pytest.raises(TransportError, match="CURVE"):
            list(fetch_range(second.endpoint, server.keys, P, 1, 11, timeout=3))
        assert second.requests == 0
    finally:
        second.stop()
    assert "reader_secret" not in repr(server.keys)
    assert server.keys.reader_secret not in repr(server.keys)


def test_payload_never_crosses_in_clear(
    server: SegmentServer, recording_proxy: Callable[[int], RecordingProxy]
) -> None:
    proxy = recording_proxy(int(server.bound.rsplit(":", 1)[1]))
    got = _values(
        fetch_range(f"tcp://127.0.0.1:{proxy.port}", server.keys, P, 1, N + 1, timeout=10)
    )
    assert len(got) == N and got[-1] == MARKER + b"-%d" % N
    wire = proxy.recorded
    # Control: the payload as served (Arrow IPC) holds the values verbatim.
    assert MARKER in _ipc(next(read_sealed(server.path, P, 1, 2)))
    # Every record went through the proxy (N values of > 20 bytes each) ...
    assert proxy.connections == 1 and len(wire) > N * len(MARKER)
    # ... and not one is readable there, nor the producer id frame of the request.
    assert MARKER not in wire
    assert P.encode() not in wire
    assert b"CURVE" in wire[:64]  # the ZMTP greeting names the mechanism


def test_driver_host_follows_spark_order(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "# spark.driver.host 10.9.9.9\nspark.driver.host   10.1.2.3\nspark.master local\n"
    )
    env = {"SPARK_CONF_DIR": str(conf), "SPARK_LOCAL_IP": "10.0.0.7"}
    host, why = driver_host(env)
    assert host == "10.1.2.3" and "spark-defaults.conf" in why
    assert driver_host({"SPARK_LOCAL_IP": "10.0.0.7"}) == ("10.0.0.7", "SPARK_LOCAL_IP")
    assert driver_host({"SPARK_LOCAL_IP": "10.0.0.7", "SPARK_LOCAL_HOSTNAME": "drv"}) == (
        "drv",
        "SPARK_LOCAL_HOSTNAME",
    )
    # Nothing configured: the address Spark itself would pick, never every interface.
    host, why = driver_host({"SPARK_CONF_DIR": str(tmp_path / "none")})
    assert host not in ("0.0.0.0", "*", "::", "")
    assert "Spark detects" in why


def test_source_default_is_not_every_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZIO_SPOOL_SERVER_HOST", raising=False)
    opts = parse_source_options({"endpoints": "tcp://127.0.0.1:5555"})
    assert opts.spool_server_host is None  # the runner asks driver_host()
    monkeypatch.setenv("ZIO_SPOOL_SERVER_HOST", "10.0.0.8")
    assert parse_source_options({"endpoints": "tcp://127.0.0.1:5555"}).spool_server_host == (
        "10.0.0.8"
    )
    given = {"endpoints": "tcp://127.0.0.1:5555", "spoolServerHost": "0.0.0.0"}
    assert parse_source_options(given).spool_server_host == "0.0.0.0"  # explicit: allowed


@pytest.mark.parametrize("bad", ["tcp://10.0.0.1", "10.0.0.1:5000", "a host", "x/y"])
def test_bad_spool_server_host_names_the_option(bad: str) -> None:
    with pytest.raises(ConfigError, match="spoolServerHost") as err:
        parse_source_options({"endpoints": "tcp://127.0.0.1:5555", "spoolServerHost": bad})
    assert err.value.value == bad


def test_unusable_host_fails_naming_the_option(spool_path: str) -> None:
    with pytest.raises(TransportError, match="spoolServerHost"):
        SegmentServer(spool_path, "203.0.113.77")  # TEST-NET-3: not an address here
