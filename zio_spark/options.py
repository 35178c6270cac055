"""User-facing options of the source, the sink and the queue, parsed once.

Spark hands a data source its options as a case-insensitive mapping with lower-cased
keys and string values. They are parsed here, on the driver, into frozen dataclasses; only
those (and partitions) travel to executors. Every error is a
:class:`~zio_spark.errors.ConfigError` naming the option as documented (camelCase), the
value and what would be accepted, like Spark's Kafka connector. Unknown options are an
error that lists the known ones: a typo must fail before the query starts.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, TypeVar

from zio_spark.errors import ConfigError, check_count

__all__ = [
    "READ_MODES",
    "Curve",
    "QueueOptions",
    "SinkOptions",
    "SourceOptions",
    "ZreOptions",
    "check_endpoint",
    "conn_check_seconds",
    "heartbeat_millis",
    "heartbeat_seconds",
    "parse_bool",
    "parse_duration",
    "parse_endpoints",
    "parse_sink_options",
    "parse_source_options",
]

T = TypeVar("T")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def parse_bool(name: str, value: str) -> bool:
    """Parse ``true``/``false`` (any case)."""
    v = value.strip().lower()
    if v in ("true", "false"):
        return v == "true"
    raise ConfigError(name, value, "true or false")


def parse_int(name: str, value: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Parse a decimal integer within ``minimum..maximum``."""
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or n < minimum or (maximum is not None and n > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(name, value, f"an integer {bound}")
    return n


_DURATION_SYNTAX = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|µs|μs|ms|s|m|h)?\s*$")
_DURATION_SECONDS = {
    "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0
}  # fmt: skip
_DURATION_WORDS = {"us": "microseconds", "ms": "milliseconds", "s": "seconds"}


def _show_seconds(seconds: float) -> str:
    """A duration in words a person can check at a glance (``5 s``, ``57.9 d``)."""
    for size, unit in ((86400.0, "d"), (3600.0, "h"), (60.0, "min"), (1.0, "s")):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs" if seconds else "0 s"


def parse_duration(
    name: str,
    value: str,
    *,
    bare: str = "s",
    minimum: float = 0.0,
    maximum: float = 7 * 86400.0,
) -> float:
    """Parse a duration into seconds: a number with a unit (``5000000us``, ``500ms``,
    ``30s``, ``2m``, ``1h``; ``µs`` is ``us``) or a bare number in the ``bare`` unit.

    One syntax for every option that takes time; only the reading of a bare number is
    per option (seconds for Spark options; microseconds for PZQ's ``--ack-timeout``, as
    PZQ reads it). A value outside ``minimum < seconds <= maximum`` is refused; when it
    was a bare number, the error gives its reading in the other unit too, so a value
    meant in seconds where microseconds are read (or the reverse) is caught, not obeyed.

    Parameters
    ----------
    name
        The option's name as the user wrote it (for the error).
    value
        The text to parse.
    bare
        Unit of a number without one: ``"s"``, ``"ms"`` or ``"us"``.
    minimum, maximum
        Plausible range in seconds (exclusive, inclusive).

    Returns
    -------
    float
        Seconds.

    Raises
    ------
    ConfigError
        For text that is not a duration, or a duration out of range (naming the option,
        the value and the readings).
    """
    if bare not in _DURATION_WORDS:
        raise ConfigError("bare", bare, "one of " + ", ".join(_DURATION_WORDS))
    m = _DURATION_SYNTAX.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(
            name,
            value,
            f"a duration such as 5000000us, 500ms, 30s, 2m or 1h "
            f"(a bare number is read as {_DURATION_WORDS[bare]})",
        )
    number, unit = float(m.group(1)), m.group(2)
    seconds = number * _DURATION_SECONDS[unit or bare]
    if minimum < seconds <= maximum:
        return seconds
    span = f"more than {_show_seconds(minimum)}" if minimum > 0 else "more than zero"
    span += f" and at most {_show_seconds(maximum)}"
    if unit is not None or number == 0:
        raise ConfigError(name, value, f"a duration of {span}; this is {_show_seconds(seconds)}")
    other = "us" if bare != "us" else "s"
    other_seconds = number * _DURATION_SECONDS[other]
    raise ConfigError(
        name,
        value,
        f"a duration of {span}: a bare number is read as {_DURATION_WORDS[bare]}, "
        f"so {m.group(1)} is {_show_seconds(seconds)} (read as {_DURATION_WORDS[other]} it "
        f"would be {_show_seconds(other_seconds)}); "
        f"write the unit, e.g. {m.group(1)}{other} or {m.group(1)}{bare}",
    )


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_\-]*[A-Za-z0-9_])?$")
_IPC_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, the last one NUL
_CONNECT_EXAMPLE = "tcp://127.0.0.1:5555"
_BIND_EXAMPLE = "tcp://*:5555"


def _endpoint_error(name: str, value: str, problem: str, *, bind: bool) -> ConfigError:
    """A :class:`ConfigError` for one endpoint: what is wrong, the accepted forms and an
    example the user can copy."""
    host = "a name, an IPv4 or [IPv6] address" + (", or * for every interface" if bind else "")
    example = _BIND_EXAMPLE if bind else _CONNECT_EXAMPLE
    return ConfigError(
        name,
        value,
        f"a ZeroMQ endpoint, tcp://HOST:PORT (HOST {host}; PORT 1-65535) or ipc:///path, "
        f"e.g. {example} ({problem})",
    )


def _check_host(name: str, value: str, host: str, *, bind: bool) -> None:
    """A TCP host: ``*`` (bind only), ``[IPv6]``, an IPv4 address or a DNS name (for a
    bind also an interface name, which has the same shape)."""
    import ipaddress

    if not host:
        raise _endpoint_error(name, value, "the host before the port is missing", bind=bind)
    if host == "*":
        if bind:
            return
        raise _endpoint_error(
            name,
            value,
            "* (every interface) is for binding; name the host to connect to",
            bind=bind,
        )
    if host.startswith("["):
        if not host.endswith("]"):
            raise _endpoint_error(name, value, f"{host!r} lacks its closing ]", bind=bind)
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise _endpoint_error(
                name, value, f"{host[1:-1]!r} is not an IPv6 address", bind=bind
            ) from None
        return
    if ":" in host:
        raise _endpoint_error(
            name, value, f"write an IPv6 address in brackets: tcp://[{host}]:PORT", bind=bind
        )
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _endpoint_error(
                name, value, f"{host!r} is not an IPv4 address", bind=bind
            ) from None
        return
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise _endpoint_error(name, value, f"{host!r} is not a host name", bind=bind)


def _check_port(name: str, value: str, port: str, *, bind: bool) -> None:
    if port.isdigit() and 1 <= int(port) <= 65535:
        return
    if not port:
        problem = "the port after the host is missing"
    elif bind and port in ("*", "!", "0"):
        # libzmq would pick a port, but giver clients must know it, and a restarted query
        # must bind the one they keep reconnecting to.
        problem = (
            f"a fixed port, not {port!r} (an ephemeral port): giver clients connect to it, "
            "and a restarted query binds it again"
        )
    else:
        problem = f"the port {port!r} is not a number 1-65535"
    raise _endpoint_error(name, value, problem, bind=bind)


def check_endpoint(name: str, value: str, *, bind: bool = False) -> str:
    """Check one ZeroMQ endpoint as libzmq would read it, before any socket sees it.

    ``tcp://HOST:PORT`` (HOST a DNS name, an IPv4 address or ``[IPv6]``; for a bind also
    ``*``, every interface; a connect may name a source address first, libzmq's
    ``tcp://SOURCE;HOST:PORT``) or ``ipc:///path`` (at most 107 bytes; ``ipc://@name``:
    Linux's abstract namespace). ``inproc://`` is refused: Spark runs the source and the
    sink in Python worker processes of their own, which another process's ``inproc``
    socket never reaches.

    Parameters
    ----------
    name
        The option's name (for the error).
    value
        One endpoint, without surrounding blanks.
    bind
        Whether it is bound (``*`` host allowed) rather than connected to.

    Returns
    -------
    str
        ``value``.

    Raises
    ------
    ConfigError
        Naming the option, the value, what is wrong and an example.
    """
    m = _SCHEME.match(value)
    if m is None:
        raise _endpoint_error(name, value, "the scheme (tcp:// or ipc://) is missing", bind=bind)
    scheme, rest = m.group(1), m.group(2)
    if any(c.isspace() for c in value):
        raise _endpoint_error(name, value, "an endpoint holds no blanks", bind=bind)
    if scheme == "inproc":
        raise _endpoint_error(
            name,
            value,
            "inproc:// reaches only sockets of the same process, and Spark runs the source "
            "and the sink in Python worker processes of their own",
            bind=bind,
        )
    if scheme == "ipc":
        if not rest:
            raise _endpoint_error(name, value, "the ipc path is missing", bind=bind)
        if len(rest.encode()) > _IPC_PATH_MAX:
            raise _endpoint_error(
                name,
                value,
                f"the ipc path is {len(rest.encode())} bytes, more than the {_IPC_PATH_MAX} "
                "a Unix socket address holds",
                bind=bind,
            )
        return value
    if scheme != "tcp":
        raise _endpoint_error(
            name, value, f"{scheme}:// is not a transport of ZIO flows", bind=bind
        )
    if ";" in rest:
        if bind:
            raise _endpoint_error(
                name, value, "a source address (SOURCE;HOST:PORT) is for connecting", bind=bind
            )
        source, rest = rest.split(";", 1)
        if not source:
            raise _endpoint_error(name, value, "the source address before ; is empty", bind=bind)
    if rest.startswith("["):
        close = rest.find("]")
        host, after = (rest, "") if close < 0 else (rest[: close + 1], rest[close + 1 :])
        if after and not after.startswith(":"):
            raise _endpoint_error(name, value, f"{after!r} after the address", bind=bind)
        port = after[1:]
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            host, port = rest, ""
        elif ":" in host:
            raise _endpoint_error(
                name, value, "write an IPv6 address in brackets: tcp://[ADDRESS]:PORT", bind=bind
            )
    _check_host(name, value, host, bind=bind)
    _check_port(name, value, port, bind=bind)
    return value


def parse_endpoints(name: str, value: str, *, bind: bool = False) -> tuple[str, ...]:
    """Parse a comma-separated list of ZeroMQ endpoints, each checked by
    :func:`check_endpoint`.

    Raises
    ------
    ConfigError
        For an empty entry, a bad endpoint or one listed twice (naming the option).
    """
    parts = tuple(p.strip() for p in value.split(","))
    if not parts or any(not p for p in parts):
        example = _BIND_EXAMPLE if bind else _CONNECT_EXAMPLE
        raise ConfigError(
            name, value, f"a comma-separated list of endpoints, e.g. {example},{example[:-1]}6"
        )
    for p in parts:
        check_endpoint(name, p, bind=bind)
    if len(set(parts)) != len(parts):
        raise ConfigError(name, value, "each endpoint listed once")
    return parts


def parse_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    v = value.strip().lower()
    if v not in choices:
        raise ConfigError(name, value, "one of " + ", ".join(choices))
    return v


def parse_curve_key(name: str, value: str) -> bytes:
    """Parse a Z85-encoded CURVE key (40 characters)."""
    v = value.strip()
    if not _Z85_KEY.match(v):
        raise ConfigError(
            name,
            "<redacted>" if "secret" in name.lower() else value,
            "a 40-character Z85 CURVE key (see `zio-spark keys`)",
        )
    return v.encode("ascii")


ZRE_BROADCAST: Final = "255.255.255.255"
"""Where beacons go when neither ``zreBroadcast`` nor ``$ZIO_ZRE_BROADCAST`` says."""


@dataclass(frozen=True, slots=True)
class ZreOptions:
    """ZRE discovery settings, as a :class:`~zio_spark.transport.zre_node.ZreNode` takes
    them (``ZreNode(zre=...)``: the node joins ``group``; an empty ``group``, used only
    for a node's own settings, joins none).

    ``broadcast`` None and ``interface`` None are the node's defaults
    (``$ZIO_ZRE_BROADCAST``, else :data:`ZRE_BROADCAST`; the address the kernel sends
    from towards ``broadcast``). Parsed Spark options fill ``broadcast`` on the driver,
    so executors beacon where the driver was told to.
    """

    group: str
    beacon_port: int = 5670
    broadcast: str | None = None
    interface: str | None = None
    interval: float = 1.0


@dataclass(frozen=True, slots=True)
class Curve:
    """CURVE keys, Z85 text as bytes. ``server_key`` is the peer's public key."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes


READ_MODES: Final = ("spool", "direct")
"""The source's read paths (``readMode``): ``spool``, the default, first; ``direct``
(docs/direct-read.md)."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    endpoints: tuple[str, ...] = ()
    zre: ZreOptions | None = None
    bind: tuple[str, ...] = ()  # flow server endpoints for giver clients
    group_port: str | None = None  # follow only this advertised port name (None: all)
    stream: str = "zio"
    credit: int = 1000
    max_backlog: int = 1_000_000
    max_records_per_trigger: int | None = None
    # A producer's range in one micro-batch is read as pieces of at most this many
    # records, one Spark partition each, so one producer's batch uses several cores.
    max_records_per_partition: int = 250_000
    # A batch's partitions come in multiples of this many (whole waves of task slots);
    # 1: no minimum, a producer's pieces packed as they come (plan.pack).
    min_partitions: int = 1
    spool_path: str = ""
    spool_path_given: bool = False
    spool_access: str = "auto"
    spool_server_host: str | None = None  # None: the driver's Spark host address
    fail_on_data_loss: bool = True
    connect_timeout: float = 30.0
    # availableNow: how long a flow that cannot state its position (a plain giver) must
    # bring nothing before the run takes it as having given all it held.
    plain_giver_quiet: float = 2.0
    socket: str = "auto"
    curve: Curve | None = None
    max_records: int | None = None  # batch reads only
    timeout: float | None = None  # batch reads only
    # spool (every record through the driver's receiver and spool) or direct (executors
    # read ranges straight from the producers; docs/direct-read.md).
    read_mode: str = "spool"


@dataclass(frozen=True, slots=True)
class SinkOptions:
    endpoint: str | None = None
    zre: ZreOptions | None = None
    stream: str = "zio"
    credit: int = 1000
    format: str = "auto"
    connect_timeout: float = 30.0
    socket: str = "auto"
    curve: Curve | None = None


# Each option: documented name -> (parser or None for free text, description).
_Parser = Callable[[str, str], Any]

_COMMON: dict[str, tuple[_Parser | None, str]] = {
    "group": (None, "ZRE group to find peers in (instead of explicit endpoints)"),
    "stream": (None, "stream name sent in BOT"),
    "credit": (lambda n, v: parse_int(n, v, minimum=1, maximum=1_000_000), "flow credit window"),
    "connectTimeout": (parse_duration, "how long to wait for a peer"),
    "socket": (
        lambda n, v: parse_choice(n, v, ("auto", "clientserver", "routerdealer")),
        "socket pair: auto, clientserver (draft) or routerdealer",
    ),
    "zreBeaconPort": (
        lambda n, v: parse_int(n, v, minimum=1, maximum=65535),
        "UDP port of ZRE beacons",
    ),
    "zreBroadcast": (None, "address ZRE beacons are sent to"),
    "zreInterface": (None, "IPv4 address of the interface ZRE uses (mailbox, beacons)"),
    "zreInterval": (parse_duration, "interval between ZRE beacons"),
    "curveServerKey": (parse_curve_key, "the peer's CURVE public key (Z85)"),
    "curvePublicKey": (parse_curve_key, "our CURVE public key (Z85)"),
    "curveSecretKey": (parse_curve_key, "our CURVE secret key (Z85)"),
}

SOURCE_OPTIONS: dict[str, tuple[_Parser | None, str]] = {
    "endpoints": (parse_endpoints, "comma-separated producer endpoints"),
    "bind": (
        lambda n, v: _bind_endpoints(n, v),
        "endpoints to bind as a flow server that giver clients connect to",
    ),
    **_COMMON,
    "groupPort": (
        lambda n, v: _port_name(n, v),
        "with group: follow only this advertised port name (default: every zio.port.<name>)",
    ),
    "maxBacklog": (
        lambda n, v: parse_int(n, v, minimum=1),
        "most records received but not committed",
    ),
    "maxRecordsPerTrigger": (
        lambda n, v: parse_int(n, v, minimum=1),
        "most records per micro-batch",
    ),
    "maxRecordsPerPartition": (
        lambda n, v: parse_int(n, v, minimum=1),
        "most records of one producer in one Spark partition (larger ranges are split)",
    ),
    "minPartitions": (
        lambda n, v: parse_int(n, v, minimum=1),
        "fewest Spark partitions of a micro-batch with records; more come in multiples of it",
    ),
    "spoolPath": (None, "folder of the spool (shared path on clusters)"),
    "spoolAccess": (
        lambda n, v: parse_choice(n, v, ("auto", "local", "remote")),
        "how executors read the spool",
    ),
    "spoolServerHost": (
        lambda n, v: _server_host(n, v),
        "address the driver's segment server binds and advertises "
        "(default: the driver's Spark host address)",
    ),
    "failOnDataLoss": (parse_bool, "fail the query when records are known lost"),
    "readMode": (
        lambda n, v: parse_choice(n, v, READ_MODES),
        "spool (the driver receives and spools every record) or direct (tasks read "
        "ranges straight from range-capable producers; endpoints only)",
    ),
    "plainGiverQuiet": (
        parse_duration,
        "availableNow: how long a giver that cannot state its position (a plain ZIO "
        "giver) must bring nothing before the run takes it as done",
    ),
    "maxRecords": (lambda n, v: parse_int(n, v, minimum=1), "batch read: stop after this many"),
    "timeout": (parse_duration, "batch read: stop after this long"),
}

SINK_OPTIONS: dict[str, tuple[_Parser | None, str]] = {
    "endpoint": (lambda n, v: _one_endpoint(n, v), "consumer endpoint"),
    **_COMMON,
    "format": (
        lambda n, v: parse_choice(n, v, ("auto", "arrow", "record")),
        "auto (Arrow if the consumer states it takes Arrow, else one record per DAT), "
        "arrow (Arrow IPC per DAT; fails towards a taker that does not take Arrow) or "
        "record (one record per DAT)",
    ),
}


# Option -> dataclass field. Only options given are passed, so every default is written
# once, on the dataclass.
_ZRE_FIELDS: dict[str, str] = {
    "zreBeaconPort": "beacon_port",
    "zreBroadcast": "broadcast",
    "zreInterface": "interface",
    "zreInterval": "interval",
}
_COMMON_FIELDS: dict[str, str] = {
    "stream": "stream",
    "credit": "credit",
    "connectTimeout": "connect_timeout",
    "socket": "socket",
}
_SOURCE_FIELDS: dict[str, str] = {
    **_COMMON_FIELDS,
    "endpoints": "endpoints",
    "bind": "bind",
    "groupPort": "group_port",
    "maxBacklog": "max_backlog",
    "maxRecordsPerTrigger": "max_records_per_trigger",
    "maxRecordsPerPartition": "max_records_per_partition",
    "minPartitions": "min_partitions",
    "spoolAccess": "spool_access",
    "failOnDataLoss": "fail_on_data_loss",
    "plainGiverQuiet": "plain_giver_quiet",
    "readMode": "read_mode",
    "maxRecords": "max_records",
    "timeout": "timeout",
}
_SINK_FIELDS: dict[str, str] = {**_COMMON_FIELDS, "endpoint": "endpoint", "format": "format"}


def _fields(opts: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """The options given among ``fields``, keyed by their dataclass field."""
    return {field: opts[name] for name, field in fields.items() if name in opts}


def _exactly_one(opts: Mapping[str, Any], choices: Mapping[str, str]) -> None:
    """Refuse anything but exactly one of ``choices`` (option -> what it is)."""
    where = [k for k in choices if k in opts]
    if len(where) == 1:
        return
    names = [f"{k!r} ({what})" for k, what in choices.items()]
    wanted = "exactly one of " + ", ".join(names[:-1]) + " or " + names[-1]
    if where:
        wanted += ", not both " + " and ".join(repr(k) for k in where)
    first = where[0] if where else next(iter(choices))
    raise ConfigError(first, opts.get(first), wanted)


def _bind_endpoints(name: str, value: str) -> tuple[str, ...]:
    return parse_endpoints(name, value, bind=True)


_HOST_NAME = re.compile(r"^(\*|[A-Za-z0-9_\-.]+|\[?[0-9A-Fa-f:.]+\]?)$")


def _server_host(name: str, value: str | None) -> str | None:
    """A host to listen on: a name, an IPv4/IPv6 address, or 0.0.0.0 (every interface)."""
    if value is None or not value.strip():
        return None  # unset: the driver's Spark host address
    v = value.strip()
    if not _HOST_NAME.match(v) or v.count(":") == 1:
        raise ConfigError(
            name,
            value,
            "a host name or IP address of the driver, without scheme or port "
            "(e.g. 10.0.0.5; 0.0.0.0 for every interface)",
        )
    return v


_PORT_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


def _port_name(name: str, value: str) -> str:
    v = value.strip()
    if not _PORT_NAME.match(v):
        raise ConfigError(
            name, value, "a port name as in the ZRE header zio.port.<name>.address, e.g. flow"
        )
    return v


def _one_endpoint(name: str, value: str) -> str:
    if "," in value:
        raise ConfigError(
            name, value, "exactly one endpoint (use a ZRE group for several consumers)"
        )
    return parse_endpoints(name, value)[0]


def _parse(
    raw: Mapping[str, str], table: Mapping[str, tuple[_Parser | None, str]], what: str
) -> dict[str, Any]:
    by_lower = {k.lower(): k for k in table}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = by_lower.get(key.lower())
        if name is None:
            known = ", ".join(sorted(table))
            raise ConfigError(key, value, f"a known {what} option: {known}")
        if not isinstance(value, str):
            value = str(value)
        parser = table[name][0]
        if parser is None:
            if not value.strip():
                raise ConfigError(name, value, "a non-empty value")
            out[name] = value.strip()
        else:
            out[name] = parser(name, value)
    return out


def _zre(opts: dict[str, Any]) -> ZreOptions | None:
    if "group" not in opts:
        for k in _ZRE_FIELDS:
            if k in opts:
                raise ConfigError(k, opts[k], "to be used together with the 'group' option")
        return None
    given = _fields(opts, _ZRE_FIELDS)
    if "broadcast" not in given:
        given["broadcast"] = os.environ.get("ZIO_ZRE_BROADCAST", ZRE_BROADCAST)
    return ZreOptions(group=opts["group"], **given)


def _curve(opts: dict[str, Any]) -> Curve | None:
    names = ("curveServerKey", "curvePublicKey", "curveSecretKey")
    given = [n for n in names if n in opts]
    if not given:
        return None
    if len(given) != len(names):
        missing = [n for n in names if n not in opts]
        raise ConfigError(missing[0], None, "all three of " + ", ".join(names) + " together")
    return Curve(opts["curveServerKey"], opts["curvePublicKey"], opts["curveSecretKey"])


# readMode=direct's defaults of maxRecordsPerPartition and minPartitions: each task opens
# a range flow to a producer (~1 CPU-ms) and costs Spark a task; with 250,000 records a
# task, the workers spent 0.34 CPU-s per million rows, with 500,000 0.26 (bench/README.md;
# most of the difference was PySpark's gc.collect() after each task, 40-65 ms, which
# heap.freeze_gc has since cut to what the task made). And a batch's tasks should fill
# whole waves of task slots: 1.18M records in tasks of at most 500,000 were three tasks
# on two cores, the third alone in a second wave (plan.pack). So in direct mode a batch
# is cut into an even number of near-equal tasks of at most 1M records: a fast producer
# with the default window (2M records, batches settling at 1M) gives two of 500,000.
DIRECT_RECORDS_PER_PARTITION = 1_000_000
DIRECT_MIN_PARTITIONS = 2


def default_spool_path(stream: str, endpoints: tuple[str, ...], group: str | None) -> str:
    """A per-stream folder under the system temp directory (stable across restarts)."""
    import hashlib

    ident = "|".join([stream, group or "", *endpoints]).encode()
    digest = hashlib.sha256(ident).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "zio-spark-spool", f"{stream}-{digest}")


def parse_source_options(raw: Mapping[str, str]) -> SourceOptions:
    """Parse the options of ``spark.readStream.format("zio")``.

    Raises
    ------
    ConfigError
        For an unknown option, a bad value, or not exactly one of ``endpoints``,
        ``group`` and ``bind`` (the error names the ones given).
    """
    opts = _parse(raw, SOURCE_OPTIONS, "source")
    _exactly_one(
        opts,
        {
            "endpoints": "comma-separated producer endpoints",
            "group": "a ZRE group",
            "bind": "endpoints giver clients connect to",
        },
    )
    if "groupPort" in opts and "group" not in opts:
        raise ConfigError("groupPort", opts["groupPort"], "to be used together with 'group'")
    if opts.get("readMode") == "direct":
        _direct_topology(opts)
    zre = _zre(opts)
    parsed = SourceOptions(
        **_fields(opts, _SOURCE_FIELDS),
        zre=zre,
        spool_path=opts.get("spoolPath", ""),
        spool_path_given="spoolPath" in opts,
        spool_server_host=opts.get("spoolServerHost")
        or _server_host("ZIO_SPOOL_SERVER_HOST", os.environ.get("ZIO_SPOOL_SERVER_HOST")),
        curve=_bind_curve(opts) if "bind" in opts else _curve(opts),
    )
    if parsed.read_mode == "direct" and "maxRecordsPerPartition" not in opts:
        parsed = replace(parsed, max_records_per_partition=DIRECT_RECORDS_PER_PARTITION)
    if parsed.read_mode == "direct" and "minPartitions" not in opts:
        parsed = replace(parsed, min_partitions=DIRECT_MIN_PARTITIONS)
    if parsed.spool_path_given:
        return parsed
    where = parsed.endpoints + parsed.bind
    spool = default_spool_path(parsed.stream, where, zre.group if zre else None)
    return replace(parsed, spool_path=spool)


def _direct_topology(opts: Mapping[str, Any]) -> None:
    """``readMode=direct`` reads producers named in ``endpoints`` or found in a ZRE
    ``group``: the driver opens a control flow to each and tasks connect to them. Giver
    clients of ``bind`` have no port a task could reach."""
    if "bind" in opts:
        raise ConfigError(
            "readMode",
            "direct",
            "spool with 'bind': direct reads connect to bound zio-spark producers listed "
            "in 'endpoints' or found in a 'group'; with 'bind' use readMode=spool",
        )


def _bind_curve(opts: dict[str, Any]) -> Curve | None:
    """CURVE as the server (``bind``): our key pair; clients use our public key as their
    server key, so ``curveServerKey`` is not needed (if given, it must be that key)."""
    pub, sec = opts.get("curvePublicKey"), opts.get("curveSecretKey")
    if pub is None and sec is None:
        if "curveServerKey" in opts:
            raise ConfigError(
                "curveServerKey",
                opts["curveServerKey"],
                "with bind, curvePublicKey and curveSecretKey (our own key pair) instead",
            )
        return None
    if pub is None or sec is None:
        missing = "curvePublicKey" if pub is None else "curveSecretKey"
        raise ConfigError(missing, None, "curvePublicKey and curveSecretKey together")
    server = opts.get("curveServerKey", pub)
    if server != pub:
        raise ConfigError(
            "curveServerKey",
            opts["curveServerKey"],
            "with bind, nothing or our own public key (curvePublicKey)",
        )
    return Curve(pub, pub, sec)


def parse_sink_options(raw: Mapping[str, str]) -> SinkOptions:
    """Parse the options of ``df.writeStream.format("zio")``.

    Raises
    ------
    ConfigError
        For an unknown option, a bad value, or neither/both of ``endpoint`` and ``group``.
    """
    opts = _parse(raw, SINK_OPTIONS, "sink")
    _exactly_one(opts, {"endpoint": "a consumer endpoint", "group": "a ZRE group"})
    return SinkOptions(**_fields(opts, _SINK_FIELDS), zre=_zre(opts), curve=_curve(opts))


# -- the queue server (zio-spark queue, QueueBroker) ------------------------------------

QUEUE_RECEIVE: Final = "tcp://127.0.0.1:11131"
"""The command's receive endpoint (PZQ's port; loopback only unless told otherwise)."""
QUEUE_SEND: Final = "tcp://127.0.0.1:11132"
"""The command's send endpoint."""
QUEUE_MONITOR: Final = "tcp://127.0.0.1:11133"
"""The command's monitor endpoint."""
ANY_LOOPBACK_PORT: Final = "tcp://127.0.0.1:*"
"""A :class:`QueueOptions` endpoint's default: a free loopback port (tests, embedding)."""
SEND_MODES: Final = ("dealer", "router")
"""Kinds of send socket: ``dealer`` (the default, first; serves any PZQ consumer) or
``router``."""
DEDUP_RULES: Final = ("resend", "global", "off")
"""Duplicate rules for producer ids: ``resend`` (the default, first), ``global``, ``off``."""
DEFAULT_ACK_TIMEOUT: Final = 5.0
"""Default consumer ack timeout, seconds."""
MAX_ACK_TIMEOUT_S: Final = 86400.0
"""Longest ack timeout accepted (a day): anything longer is a unit mistake."""
DEFAULT_DEDUP_GRACE: Final = 60.0
"""Default ``dedup_grace``, seconds after start during which ids found on disk count as
possibly unacked (their producers may resend them)."""
MAX_DEDUP_GRACE_S: Final = 7 * 86400.0
"""Longest ``dedup_grace`` accepted (a week)."""
DEFAULT_HWM: Final = 10_000
"""Default high-water mark of the receive and send sockets, messages per peer."""
DEFAULT_INFLIGHT: Final = 1000
"""Default most unacked deliveries per consumer."""
DEFAULT_ACK_BACKLOG: Final = 10_000
"""Default most acks kept for one producer whose pipe is full."""
DEFAULT_QUEUE_DEDUP_WINDOW: Final = 100_000
"""Default message ids the queue's store remembers (the store's own default too; a unit
test keeps the two equal, as this module may not import the store)."""
DEFAULT_QUEUE_SEGMENT_BYTES: Final = 64 << 20
"""Default size of one store segment file (the store's own default too)."""
DEFAULT_QUEUE_FLOW_WINDOW: Final = 100_000
"""Default most messages given to the flow producer port and not yet acknowledged (the
flow producer port's own default too)."""

DEFAULT_HEARTBEAT_INTERVAL: Final = 5.0
"""Default seconds between ZMTP PINGs on a giver port's connections (the bound
:class:`~zio_spark.source.producer.Producer`'s and the queue's flow producer port's)."""
DEFAULT_HEARTBEAT_TIMEOUT: Final = 30.0
"""Default seconds without any traffic (not even a PONG) after which libzmq closes such a
connection."""
DEFAULT_CONN_CHECK: Final = 0.5
"""Default seconds between two looks at the range and control flows' connections."""


def heartbeat_seconds(
    interval: object,
    timeout: object,
    *,
    names: tuple[str, str] = ("heartbeat_interval", "heartbeat_timeout"),
) -> tuple[float, float] | None:
    """A giver port's ZMTP heartbeats checked: ``(interval, timeout)`` in seconds, or None
    (off: ``interval`` None, and then ``timeout`` must be None too). ``names`` are the
    option names the errors use (a keyword's, or a command's flags).

    Raises
    ------
    ConfigError
        Naming the option: an interval not in 0.001..3600 seconds, a timeout below the
        interval or above 86400 seconds, a timeout without an interval or none with one.
    """
    iname, tname = names
    if interval is None:
        if timeout is not None:
            raise ConfigError(
                tname, timeout, f"None when {iname} is None (no heartbeats, no timeout)"
            )
        return None
    if isinstance(interval, bool) or not (
        isinstance(interval, int | float) and 0.001 <= interval <= 3600
    ):
        raise ConfigError(iname, interval, "seconds in 0.001..3600, or None (off)")
    if timeout is None:
        raise ConfigError(
            tname,
            timeout,
            f"seconds >= {iname} ({interval!r}) and <= 86400 while heartbeats are on; "
            f"{iname}=None turns them off",
        )
    if isinstance(timeout, bool) or not (
        isinstance(timeout, int | float) and interval <= timeout <= 86400
    ):
        raise ConfigError(tname, timeout, f"seconds >= {iname} ({interval!r}) and <= 86400")
    return float(interval), float(timeout)


def heartbeat_millis(
    interval: object,
    timeout: object,
    *,
    names: tuple[str, str] = ("heartbeat_interval", "heartbeat_timeout"),
) -> tuple[int, int] | None:
    """:func:`heartbeat_seconds` in milliseconds, as libzmq's ``ZMQ_HEARTBEAT_IVL`` and
    ``ZMQ_HEARTBEAT_TIMEOUT`` take them (None: no heartbeats).

    Raises
    ------
    ConfigError
        As :func:`heartbeat_seconds`.
    """
    beats = heartbeat_seconds(interval, timeout, names=names)
    return None if beats is None else (round(beats[0] * 1000), round(beats[1] * 1000))


def conn_check_seconds(value: object, name: str = "conn_check") -> float:
    """Seconds between two looks at the range readers' connections, checked (> 0, at
    most 3600).

    Raises
    ------
    ConfigError
        Naming ``name``, for anything else.
    """
    if isinstance(value, bool) or not (
        isinstance(value, int | float) and math.isfinite(value) and 0 < value <= 3600
    ):
        raise ConfigError(
            name, value, "seconds between looks at the range readers' connections, > 0 and <= 3600"
        )
    return float(value)


def _endpoint_or_none(option: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(
            option, value, "an endpoint string or None" if optional else "an endpoint string"
        )


def _seconds(option: str, value: object, *, low: float, high: float, zero: bool) -> float:
    """``value`` as seconds in ``low < value <= high`` (``low <= value`` with ``zero``)."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (low <= value if zero else low < value)
        and value <= high
    )
    if not ok:
        if zero:
            raise ConfigError(option, value, f"seconds, {low:g} to {high:g}")
        raise ConfigError(option, value, f"a number of seconds > {low:g}, at most {high:g}")
    return float(value)  # type: ignore[arg-type]


def _curve_secret(value: object) -> str | bytes | None:
    """A CURVE secret key's form: Z85 text (40 characters) or 32 raw bytes. Whether it is
    a key libzmq accepts is checked when the sockets are made (that needs libzmq)."""
    if value is None:
        return None
    if isinstance(value, bytes) and len(value) == 32:
        return value
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if isinstance(text, str) and _Z85_KEY.match(text):
        return value  # type: ignore[return-value]
    raise ConfigError(
        "curve_secret_key", "<redacted>", "a Z85 CURVE key (40 characters) or 32 raw bytes"
    )


def _curve_allowed(value: object, secret: object) -> tuple[str | bytes, ...] | None:
    """The queue's allow-list of CURVE client public keys: one key or several, each Z85
    text (40 characters) or 32 raw bytes; None: no list. Needs ``curve_secret_key``."""
    name = "curve_allowed_client_keys"
    if value is None:
        return None
    if secret is None:
        raise ConfigError(name, "...", "curve_secret_key too: an allow-list admits CURVE clients")
    items = [value] if isinstance(value, str | bytes) else value
    if not isinstance(items, list | tuple | frozenset | set) or not items:
        raise ConfigError(
            name,
            value,
            "one client public key or a non-empty list of them (the queue's PZQ "
            "producers and consumers, Spark sources' and sinks' curvePublicKey)",
        )
    keys: list[str | bytes] = []
    for i, key in enumerate(items):
        text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
        raw = isinstance(key, bytes) and len(key) == 32
        if not raw and not (isinstance(text, str) and _Z85_KEY.match(text)):
            raise ConfigError(
                f"{name}[{i}]", key, "a Z85 CURVE public key (40 characters) or 32 raw bytes"
            )
        keys.append(key)
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class QueueOptions:
    """The queue server's settings, checked once, here: what ``zio-spark queue`` parses
    from its flags and :class:`~zio_spark.pzq.broker.QueueBroker` runs with.

    Each default is written once, on the field (the command's own endpoint defaults are
    :data:`QUEUE_RECEIVE`, :data:`QUEUE_SEND`, :data:`QUEUE_MONITOR`). Every bad value is
    a :class:`~zio_spark.errors.ConfigError` naming the field, the value and what would be
    accepted; :class:`~zio_spark.pzq.broker.QueueBroker` documents what each one does.

    Parameters
    ----------
    store_path
        Folder of the durable store (a :class:`~pathlib.Path` once checked).
    receive, send, monitor
        Endpoints to bind (``monitor=None``: no monitor socket).
    ack_timeout
        Seconds a consumer has to ack a delivery (> 0, at most :data:`MAX_ACK_TIMEOUT_S`).
    hwm, ack_backlog, inflight, max_batch, linger_ms
        Counts: >= 0, >= 1, >= 1, >= 1, >= 0.
    curve_secret_key
        Z85 text (40 characters) or 32 raw bytes; None: no CURVE.
    curve_allowed_client_keys
        CURVE client public keys the queue admits (one or a non-empty list, each Z85
        text or 32 raw bytes; needs ``curve_secret_key``); None: no list.
    queue_id
        The send socket's routing id: 1 to 255 bytes, not starting with a 0 byte (None:
        the id kept in the store).
    dedup_window, segment_bytes, sync
        The store's: >= 0 ids, >= 4096 bytes, fdatasync or not.
    flow_producer, flow_consumer, flow_window
        The ZIO flow ports' endpoints (None: off) and the producer port's window (>= 1).
    flow_heartbeat_interval, flow_heartbeat_timeout, flow_conn_check
        The flow producer port's watch on its range and control readers' connections,
        as the bound :class:`~zio_spark.source.producer.Producer`'s ``heartbeat_interval``,
        ``heartbeat_timeout`` and ``conn_check`` (:func:`heartbeat_seconds`,
        :func:`conn_check_seconds`): seconds; interval and timeout both None: no
        heartbeats.
    send_mode, dedup
        One of :data:`SEND_MODES`, one of :data:`DEDUP_RULES`.
    dedup_grace
        Seconds, 0 to :data:`MAX_DEDUP_GRACE_S`.
    """

    store_path: Path
    receive: str = ANY_LOOPBACK_PORT
    send: str = ANY_LOOPBACK_PORT
    monitor: str | None = ANY_LOOPBACK_PORT
    ack_timeout: float = DEFAULT_ACK_TIMEOUT
    hwm: int = DEFAULT_HWM
    ack_backlog: int = DEFAULT_ACK_BACKLOG
    inflight: int = DEFAULT_INFLIGHT
    curve_secret_key: str | bytes | None = None
    queue_id: bytes | None = None
    max_batch: int = 4096
    dedup_window: int = DEFAULT_QUEUE_DEDUP_WINDOW
    segment_bytes: int = DEFAULT_QUEUE_SEGMENT_BYTES
    sync: bool = True
    linger_ms: int = 500
    flow_producer: str | None = None
    flow_consumer: str | None = None
    flow_window: int = DEFAULT_QUEUE_FLOW_WINDOW
    flow_heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL
    flow_heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT
    flow_conn_check: float = DEFAULT_CONN_CHECK
    send_mode: str = SEND_MODES[0]
    dedup: str = DEDUP_RULES[0]
    dedup_grace: float = DEFAULT_DEDUP_GRACE
    curve_allowed_client_keys: tuple[str | bytes, ...] | None = None

    def __post_init__(self) -> None:
        def put(field: str, value: object) -> None:
            object.__setattr__(self, field, value)

        if not isinstance(self.store_path, str | os.PathLike) or not os.fspath(self.store_path):
            raise ConfigError("store_path", self.store_path, "a folder path")
        put("store_path", Path(self.store_path))
        put(
            "ack_timeout",
            _seconds("ack_timeout", self.ack_timeout, low=0.0, high=MAX_ACK_TIMEOUT_S, zero=False),
        )
        if self.send_mode not in SEND_MODES:
            raise ConfigError("send_mode", self.send_mode, "one of " + ", ".join(SEND_MODES))
        if self.dedup not in DEDUP_RULES:
            raise ConfigError("dedup", self.dedup, "one of " + ", ".join(DEDUP_RULES))
        put(
            "dedup_grace",
            _seconds("dedup_grace", self.dedup_grace, low=0.0, high=MAX_DEDUP_GRACE_S, zero=True),
        )
        _endpoint_or_none("receive", self.receive, optional=False)
        _endpoint_or_none("send", self.send, optional=False)
        for option in ("monitor", "flow_producer", "flow_consumer"):
            _endpoint_or_none(option, getattr(self, option), optional=True)
        beats = heartbeat_seconds(
            self.flow_heartbeat_interval,
            self.flow_heartbeat_timeout,
            names=("flow_heartbeat_interval", "flow_heartbeat_timeout"),
        )
        put("flow_heartbeat_interval", None if beats is None else beats[0])
        put("flow_heartbeat_timeout", None if beats is None else beats[1])
        put("flow_conn_check", conn_check_seconds(self.flow_conn_check, "flow_conn_check"))
        q = self.queue_id
        if q is not None and (not isinstance(q, bytes) or not 0 < len(q) <= 255 or q[0] == 0):
            raise ConfigError("queue_id", q, "1 to 255 bytes, not starting with a 0 byte")
        for option, minimum in (
            ("hwm", 0),
            ("ack_backlog", 1),
            ("inflight", 1),
            ("max_batch", 1),
            ("linger_ms", 0),
            ("dedup_window", 0),
            ("segment_bytes", 4096),
            ("flow_window", 1),
        ):
            check_count(option, getattr(self, option), minimum)
        put("sync", bool(self.sync))
        put("curve_secret_key", _curve_secret(self.curve_secret_key))
        put(
            "curve_allowed_client_keys",
            _curve_allowed(self.curve_allowed_client_keys, self.curve_secret_key),
        )
