"""Durations: one syntax for every option that takes time (zio_spark.options.parse_duration).

A bare number is read per option (seconds for Spark options, microseconds for PZQ's
``--ack-timeout``); an implausible value is refused with both readings.
"""

from __future__ import annotations

import pytest

from zio_spark.errors import ConfigError
from zio_spark.options import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5s", 5.0),
        ("500ms", 0.5),
        ("5000000us", 5.0),
        ("5000000µs", 5.0),
        ("5000000μs", 5.0),  # Greek mu, as some keyboards type it
        ("2m", 120.0),
        ("1h", 3600.0),
        (" 1.5 s ", 1.5),
        ("30", 30.0),  # bare: seconds by default, as before
    ],
)
def test_units(text: str, seconds: float) -> None:
    assert parse_duration("timeout", text) == pytest.approx(seconds)


def test_a_bare_number_in_microseconds_as_pzq_reads_it() -> None:
    assert parse_duration("--ack-timeout", "5000000", bare="us", minimum=1e-3) == 5.0
    assert parse_duration("--ack-timeout", "5s", bare="us", minimum=1e-3) == 5.0


def test_a_bare_number_too_small_as_microseconds_names_both_readings() -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration("--ack-timeout", "5", bare="us", minimum=1e-3)
    e = info.value
    assert (e.option, e.value) == ("--ack-timeout", "5")
    text = str(e)
    assert "read as microseconds, so 5 is 5 µs" in text
    assert "read as seconds it would be 5 s" in text
    assert "5s or 5us" in text


def test_a_bare_number_too_large_as_seconds_names_both_readings() -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration("connectTimeout", "5000000")
    text = str(info.value)
    assert "'connectTimeout'" in text and "'5000000'" in text
    assert "57.9 d" in text and "read as microseconds it would be 5 s" in text


@pytest.mark.parametrize("text", ["5000000s", "0", "0ms", "8d", "5 parsecs", "", "-1s", "1e3"])
def test_refused(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration("timeout", text)
    assert info.value.option == "timeout" and info.value.value == text


def test_range_is_per_option() -> None:
    assert parse_duration("x", "200h", maximum=30 * 86400) == 720000.0
    with pytest.raises(ConfigError, match="more than 1 ms"):
        parse_duration("x", "500us", minimum=1e-3)
    with pytest.raises(ConfigError, match="bare"):
        parse_duration("x", "1", bare="fortnights")
