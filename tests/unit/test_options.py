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
    assert parse_sink_options({"group": "g"}).zre == ZreOptions("g", broadcast="255.255.255.255")
    assert ZreOptions("g").broadcast is None  # built directly: the node's default
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


# ---------------------------------------------------------------------- endpoints


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5555",
        "tcp://localhost:1",
        "tcp://daq1.example.org:65535",
        "tcp://[::1]:5555",
        "tcp://[fe80::1%eth0]:5555",
        "tcp://eth0;10.0.0.5:5555",  # libzmq's source address, for connecting
        "ipc:///tmp/zio.sock",
        "ipc://@zio-abstract",
        "ipc://relative.sock",
    ],
)
def test_endpoints_libzmq_connects_to_are_accepted(endpoint: str) -> None:
    assert parse_source_options({"endpoints": endpoint}).endpoints == (endpoint,)
    assert parse_sink_options({"endpoint": endpoint}).endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://*:5555", "tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://eth0:5555", "ipc:///x"],
)
def test_endpoints_to_bind_are_accepted(endpoint: str) -> None:
    assert parse_source_options({"bind": endpoint}).bind == (endpoint,)


_REJECTED = [
    ("tcp://127.0.0.1", "the port after the host is missing"),  # the case
    ("tcp://localhost", "the port after the host is missing"),
    ("tcp://[::1]", "the port after the host is missing"),
    ("tcp://127.0.0.1:", "the port after the host is missing"),
    ("tcp://127.0.0.1:0", "not a number 1-65535"),
    ("tcp://127.0.0.1:65536", "not a number 1-65535"),
    ("tcp://127.0.0.1:http", "not a number 1-65535"),
    ("tcp://127.0.0.1:*", "not a number 1-65535"),
    ("tcp://*:5555", "* (every interface) is for binding"),
    ("tcp://:5555", "the host before the port is missing"),
    ("tcp://::1:5555", "write an IPv6 address in brackets"),
    ("tcp://[::1:5555", "lacks its closing ]"),
    ("tcp://[nope]:5555", "'nope' is not an IPv6 address"),
    ("tcp://[::1]5555", "'5555' after the address"),
    ("tcp://300.0.0.1:5555", "'300.0.0.1' is not an IPv4 address"),
    ("tcp://daq_1!:5555", "'daq_1!' is not a host name"),
    ("tcp://daq 1:5555", "holds no blanks"),
    ("tcp://;10.0.0.5:5555", "the source address before ; is empty"),
    ("127.0.0.1:5555", "the scheme (tcp:// or ipc://) is missing"),
    ("udp://127.0.0.1:5555", "udp:// is not a transport of ZIO flows"),
    ("ipc://", "the ipc path is missing"),
    ("ipc:///" + "p" * 107, "more than the 107 a Unix socket address holds"),
    ("inproc://zio", "inproc:// reaches only sockets of the same process"),
]


@pytest.mark.parametrize(("endpoint", "problem"), _REJECTED)
@pytest.mark.parametrize("option", ["endpoints", "endpoint"])
def test_bad_connect_endpoints_fail_at_parse_naming_option_value_and_example(
    option: str, endpoint: str, problem: str
) -> None:
    parse = parse_source_options if option == "endpoints" else parse_sink_options
    with pytest.raises(ConfigError) as e:
        parse({option: endpoint})
    assert (e.value.option, e.value.value) == (option, endpoint)
    text = str(e.value)
    assert text.startswith(
        f"option {option!r}: got {endpoint!r}, expected a ZeroMQ endpoint, tcp://HOST:PORT"
    )
    assert "e.g. tcp://127.0.0.1:5555" in text and problem in text


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("tcp://*", "the port after the host is missing"),
        ("tcp://*:*", "a fixed port, not '*' (an ephemeral port): giver clients connect"),
        ("tcp://127.0.0.1:0", "a fixed port, not '0'"),
        ("tcp://127.0.0.1:!", "a fixed port, not '!'"),
        ("tcp://eth0;127.0.0.1:5555", "a source address (SOURCE;HOST:PORT) is for connecting"),
        ("inproc://zio", "inproc:// reaches only sockets of the same process"),
    ],
)
def test_bad_bind_endpoints_fail_at_parse(endpoint: str, problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_source_options({"bind": endpoint})
    assert (e.value.option, e.value.value) == ("bind", endpoint)
    assert "or * for every interface" in str(e.value) and "e.g. tcp://*:5555" in str(e.value)
    assert problem in str(e.value)


def test_every_endpoint_of_a_list_is_checked_and_the_bad_one_named() -> None:
    with pytest.raises(ConfigError) as e:
        parse_source_options({"endpoints": "tcp://127.0.0.1:5555, tcp://127.0.0.1"})
    assert e.value.value == "tcp://127.0.0.1"
    with pytest.raises(ConfigError, match="each endpoint listed once"):
        parse_source_options({"endpoints": "tcp://h:1,tcp://h:1"})
    with pytest.raises(ConfigError, match="comma-separated list of endpoints"):
        parse_source_options({"endpoints": "tcp://h:1,"})
