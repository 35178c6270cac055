"""The option parsers, without Spark: defaults come from the dataclasses, errors name the
option, the value and what is expected."""

from __future__ import annotations

import dataclasses

import pytest

from zio_spark.errors import ConfigError
from zio_spark.options import (
    SinkOptions,
    SourceOptions,
    ZreOptions,
    default_spool_path,
    parse_sink_options,
    parse_source_options,
)


def _defaults(cls: type) -> dict[str, object]:
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def test_source_defaults_are_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZIO_SPOOL_SERVER_HOST", raising=False)
    opts = parse_source_options({"endpoints": "tcp://h:1"})
    expected = {**_defaults(SourceOptions), "endpoints": ("tcp://h:1",)}
    expected["spool_path"] = default_spool_path("zio", ("tcp://h:1",), None)
    assert dataclasses.asdict(opts) == expected


def test_sink_defaults_are_the_dataclass_defaults() -> None:
    opts = parse_sink_options({"endpoint": "tcp://h:1"})
    assert dataclasses.asdict(opts) == {**_defaults(SinkOptions), "endpoint": "tcp://h:1"}


def test_given_options_reach_their_fields() -> None:
    opts = parse_source_options(
        {
            "endpoints": "tcp://h:1,tcp://h:2",
            "stream": "s",
            "credit": "7",
            "maxBacklog": "9",
            "maxRecordsPerTrigger": "3",
            "spoolPath": "/tmp/x",
            "spoolAccess": "remote",
            "failOnDataLoss": "false",
            "connectTimeout": "2s",
            "socket": "routerdealer",
            "maxRecords": "5",
            "timeout": "500ms",
        }
    )
    assert (opts.endpoints, opts.stream, opts.credit, opts.max_backlog) == (
        ("tcp://h:1", "tcp://h:2"),
        "s",
        7,
        9,
    )
    assert (opts.max_records_per_trigger, opts.spool_path, opts.spool_path_given) == (
        3,
        "/tmp/x",
        True,
    )
    assert (opts.spool_access, opts.fail_on_data_loss, opts.connect_timeout) == (
        "remote",
        False,
        2.0,
    )
    assert (opts.socket, opts.max_records, opts.timeout) == ("routerdealer", 5, 0.5)
    sink = parse_sink_options({"endpoint": "tcp://h:1", "format": "arrow", "credit": "4"})
    assert (sink.format, sink.credit) == ("arrow", 4)


def test_zre_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZIO_ZRE_BROADCAST", raising=False)
    assert parse_sink_options({"group": "g"}).zre == ZreOptions("g")
    monkeypatch.setenv("ZIO_ZRE_BROADCAST", "10.0.0.255")
    assert parse_sink_options({"group": "g"}).zre == ZreOptions("g", broadcast="10.0.0.255")
    given = parse_sink_options({"group": "g", "zreBroadcast": "127.255.255.255"}).zre
    assert given is not None and given.broadcast == "127.255.255.255"
    with pytest.raises(ConfigError, match=r"zreInterval.*together with the 'group'"):
        parse_sink_options({"endpoint": "tcp://h:1", "zreInterval": "2s"})


@pytest.mark.parametrize(
    ("raw", "parts"),
    [
        ({}, ["option 'endpoints'", "exactly one of 'endpoints'", "'bind'"]),
        (
            {"endpoints": "tcp://h:1", "group": "g"},
            ["option 'endpoints'", "not both 'endpoints' and 'group'"],
        ),
    ],
)
def test_source_needs_exactly_one_place(raw: dict[str, str], parts: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse_source_options(raw)
    for part in parts:
        assert part in str(e.value)


@pytest.mark.parametrize(
    ("raw", "part"),
    [
        ({}, "exactly one of 'endpoint' (a consumer endpoint) or 'group' (a ZRE group)"),
        ({"endpoint": "tcp://h:1", "group": "g"}, "not both 'endpoint' and 'group'"),
    ],
)
def test_sink_needs_exactly_one_place(raw: dict[str, str], part: str) -> None:
    with pytest.raises(ConfigError, match="option 'endpoint'") as e:
        parse_sink_options(raw)
    assert part in str(e.value)


def test_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"a known sink option: .*endpoint"):
        parse_sink_options({"endpoint": "tcp://h:1", "endpiont": "x"})
