"""QueueOptions: the queue server's settings, checked once (zio_spark.options)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from zio_spark.errors import ConfigError
from zio_spark.options import (
    DEFAULT_QUEUE_DEDUP_WINDOW,
    DEFAULT_QUEUE_FLOW_WINDOW,
    DEFAULT_QUEUE_SEGMENT_BYTES,
    MAX_ACK_TIMEOUT_S,
    MAX_DEDUP_GRACE_S,
    QueueOptions,
)
from zio_spark.pzq.flow_ports import DEFAULT_FLOW_WINDOW
from zio_spark.source import producer
from zio_spark.storage.store import DEFAULT_DEDUP_WINDOW, DEFAULT_SEGMENT_BYTES


def test_defaults_and_normalisation() -> None:
    opts = QueueOptions("some/store")  # type: ignore[arg-type]
    assert opts.store_path == Path("some/store")
    assert (opts.receive, opts.send, opts.monitor) == ("tcp://127.0.0.1:*",) * 3
    assert (opts.ack_timeout, opts.dedup_grace) == (5.0, 60.0)
    assert isinstance(opts.ack_timeout, float) and isinstance(opts.dedup_grace, float)
    assert (opts.send_mode, opts.dedup) == ("dealer", "resend")
    assert (opts.hwm, opts.inflight, opts.ack_backlog, opts.max_batch) == (
        10_000,
        1000,
        10_000,
        4096,
    )
    assert opts.curve_secret_key is None and opts.queue_id is None and opts.sync is True
    assert QueueOptions(Path("s"), ack_timeout=2, dedup_grace=0).dedup_grace == 0.0


def test_defaults_agree_with_the_store_and_the_flow_ports() -> None:
    # options.py may not import them (layers), so the values are written there too.
    assert DEFAULT_QUEUE_DEDUP_WINDOW == DEFAULT_DEDUP_WINDOW
    assert DEFAULT_QUEUE_SEGMENT_BYTES == DEFAULT_SEGMENT_BYTES
    assert DEFAULT_QUEUE_FLOW_WINDOW == DEFAULT_FLOW_WINDOW
    # The flow producer port watches its readers as a bound Producer does, by default.
    opts = QueueOptions(Path("s"))
    assert (
        (opts.flow_heartbeat_interval, opts.flow_heartbeat_timeout, opts.flow_conn_check)
        == (
            producer.DEFAULT_HEARTBEAT_INTERVAL,
            producer.DEFAULT_HEARTBEAT_TIMEOUT,
            producer.DEFAULT_CONN_CHECK,
        )
        == (5.0, 30.0, 0.5)
    )


def test_the_flow_ports_heartbeats_are_off_only_together_and_normalised() -> None:
    off = QueueOptions(Path("s"), flow_heartbeat_interval=None, flow_heartbeat_timeout=None)
    assert (off.flow_heartbeat_interval, off.flow_heartbeat_timeout) == (None, None)
    with pytest.raises(ConfigError) as e:
        QueueOptions(Path("s"), flow_heartbeat_interval=None)  # the timeout left at 30
    assert (e.value.option, e.value.value) == ("flow_heartbeat_timeout", 30.0)
    assert "None when flow_heartbeat_interval is None" in e.value.expected
    on = QueueOptions(
        Path("s"), flow_heartbeat_interval=1, flow_heartbeat_timeout=1, flow_conn_check=2
    )
    assert (on.flow_heartbeat_interval, on.flow_heartbeat_timeout, on.flow_conn_check) == (
        1.0,
        1.0,
        2.0,
    )
    assert all(isinstance(x, float) for x in (on.flow_heartbeat_interval, on.flow_conn_check))


@pytest.mark.parametrize(
    ("kw", "option", "expected"),
    [
        ({"ack_timeout": 0}, "ack_timeout", "a number of seconds > 0, at most 86400"),
        ({"ack_timeout": MAX_ACK_TIMEOUT_S + 1}, "ack_timeout", "at most 86400"),
        ({"ack_timeout": math.nan}, "ack_timeout", "seconds"),
        ({"ack_timeout": True}, "ack_timeout", "seconds"),
        ({"ack_timeout": "5s"}, "ack_timeout", "seconds"),
        ({"dedup_grace": -1}, "dedup_grace", "seconds, 0 to 604800"),
        ({"dedup_grace": MAX_DEDUP_GRACE_S * 2}, "dedup_grace", "0 to 604800"),
        ({"send_mode": "pub"}, "send_mode", "one of dealer, router"),
        ({"dedup": "always"}, "dedup", "one of resend, global, off"),
        ({"receive": ""}, "receive", "an endpoint string"),
        ({"send": None}, "send", "an endpoint string"),
        ({"monitor": ""}, "monitor", "an endpoint string or None"),
        ({"flow_producer": 5}, "flow_producer", "an endpoint string or None"),
        ({"flow_consumer": ""}, "flow_consumer", "an endpoint string or None"),
        ({"queue_id": b""}, "queue_id", "1 to 255 bytes"),
        ({"queue_id": b"\x00q"}, "queue_id", "not starting with a 0 byte"),
        ({"queue_id": b"q" * 256}, "queue_id", "1 to 255 bytes"),
        ({"queue_id": "q"}, "queue_id", "bytes"),
        ({"hwm": -1}, "hwm", "an integer >= 0"),
        ({"ack_backlog": 0}, "ack_backlog", "an integer >= 1"),
        ({"inflight": 0}, "inflight", "an integer >= 1"),
        ({"inflight": 1.5}, "inflight", "an integer >= 1"),
        ({"max_batch": 0}, "max_batch", "an integer >= 1"),
        ({"linger_ms": -1}, "linger_ms", "an integer >= 0"),
        ({"dedup_window": -1}, "dedup_window", "an integer >= 0"),
        ({"segment_bytes": 4095}, "segment_bytes", "an integer >= 4096"),
        ({"flow_window": 0}, "flow_window", "an integer >= 1"),
        ({"flow_window": True}, "flow_window", "an integer >= 1"),
        ({"flow_heartbeat_interval": 0}, "flow_heartbeat_interval", "0.001..3600, or None"),
        ({"flow_heartbeat_interval": "5s"}, "flow_heartbeat_interval", "seconds"),
        (
            {"flow_heartbeat_timeout": 1.0},
            "flow_heartbeat_timeout",
            "seconds >= flow_heartbeat_interval (5.0) and <= 86400",
        ),
        ({"flow_heartbeat_timeout": True}, "flow_heartbeat_timeout", "<= 86400"),
        (
            {"flow_heartbeat_timeout": None},
            "flow_heartbeat_timeout",
            "flow_heartbeat_interval=None turns them off",
        ),
        ({"flow_conn_check": 0}, "flow_conn_check", "> 0 and <= 3600"),
        ({"flow_conn_check": math.nan}, "flow_conn_check", "> 0 and <= 3600"),
        ({"flow_conn_check": 3601}, "flow_conn_check", "> 0 and <= 3600"),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_what_is_expected(
    kw: dict[str, Any], option: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as e:
        QueueOptions(Path("store"), **kw)
    assert e.value.option == option
    value = next(iter(kw.values()))
    assert e.value.value is value or (isinstance(value, float) and math.isnan(value))
    assert expected in e.value.expected


@pytest.mark.parametrize("path", ["", None, 5])
def test_the_store_path_is_a_folder_path(path: object) -> None:
    with pytest.raises(ConfigError) as e:
        QueueOptions(path)  # type: ignore[arg-type]
    assert e.value.option == "store_path"


def test_a_curve_secret_key_is_z85_text_or_32_raw_bytes_and_never_echoed() -> None:
    _, secret = zmq.curve_keypair()
    assert QueueOptions(Path("s"), curve_secret_key=secret).curve_secret_key == secret
    text = secret.decode()
    assert QueueOptions(Path("s"), curve_secret_key=text).curve_secret_key == text
    raw = bytes(range(32))
    assert QueueOptions(Path("s"), curve_secret_key=raw).curve_secret_key == raw
    for bad in (secret[:-1], "~" * 40, b"\xff" * 40, 40):
        with pytest.raises(ConfigError) as e:
            QueueOptions(Path("s"), curve_secret_key=bad)  # type: ignore[arg-type]
        assert (e.value.option, e.value.value) == ("curve_secret_key", "<redacted>")
        assert "Z85" in e.value.expected


def test_checked_again_when_replaced() -> None:
    opts = QueueOptions(Path("s"))
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(opts, hwm=-5)
    assert e.value.option == "hwm"
    assert dataclasses.replace(opts, hwm=0).hwm == 0


@given(
    ack=st.floats(allow_nan=True, allow_infinity=True),
    grace=st.floats(allow_nan=True, allow_infinity=True),
)
def test_durations_are_accepted_exactly_in_range(ack: float, grace: float) -> None:
    ack_ok = 0 < ack <= MAX_ACK_TIMEOUT_S
    grace_ok = 0 <= grace <= MAX_DEDUP_GRACE_S
    try:
        opts = QueueOptions(Path("s"), ack_timeout=ack, dedup_grace=grace)
    except ConfigError as e:
        assert e.option == ("dedup_grace" if ack_ok else "ack_timeout")
        assert not (ack_ok and grace_ok)
    else:
        assert ack_ok and grace_ok
        assert (opts.ack_timeout, opts.dedup_grace) == (ack, grace)


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_counts_are_accepted_exactly_from_their_minimum(n: int) -> None:
    minimums = {"hwm": 0, "inflight": 1, "segment_bytes": 4096, "flow_window": 1}
    for field, minimum in minimums.items():
        try:
            kw: dict[str, Any] = {field: n}
            opts = QueueOptions(Path("s"), **kw)
        except ConfigError as e:
            assert e.option == field and n < minimum
        else:
            assert n >= minimum and getattr(opts, field) == n


def test_the_brokers_keywords_are_the_options_fields() -> None:
    from zio_spark.pzq.broker import QueueSettings

    fields = {f.name for f in dataclasses.fields(QueueOptions)} - {"store_path"}
    assert set(QueueSettings.__annotations__) == fields
