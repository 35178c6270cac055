"""The sink profile: what a zio-spark sink task or driver and the consumer say to each
other in ZIO flow labels. Pure: attributes in, checked values or attributes out.

Theory of operation (the consumer's side, with staging and publishing, is in
:mod:`zio_spark.sink.consumer`; specs/zio-flow.txt for the flow itself):

**Data flows.** A Spark task is the client giver of one flow::

    BOT{direction:"extract", credit, stream, spark_batch, partition, attempt,
        encoding:[...], format}

``spark_batch`` is Spark's micro-batch id (an int ``0..10**19-1``) or, for
``df.write``, a string id drawn on the driver (letters, digits, ``.``, ``_``, ``-``;
1..128 characters, starting alphanumeric). It is not the source profile's ``batch``
(records per DAT, :mod:`zio_spark.protocol.flow`), hence the name; a sink older than the
name sent ``batch`` and the consumer still reads it (:func:`spark_batch_attr`).
``encoding`` offers payload formats (:data:`FORMATS`) in the sink's order of preference;
the consumer names its pick as a scalar in its reply (:func:`pick_format`; the client
offers, the server states: :mod:`zio_spark.protocol.negotiate`). ``format`` is for
consumers older than the negotiation. A data BOT without a Spark batch id comes from a
plain ZIO giver: ``stream`` defaults to ``"zio"``, the format to ``record``.

The consumer echoes the giver's EOT once the partition is durably staged, with
``{"rows": n}`` (:func:`parse_staged` reads it); ``{"error": ...}`` means it could not.

**Commands.** The driver's ``commit``/``abort`` are a BOT with ``command``::

    BOT{direction:"extract", credit:1, stream, spark_batch, command:"commit"|"abort",
        partitions:[[partition, attempt, rows], ...], query:<optional>}

which the consumer never accepts: its EOT (a rejection) is the reply,
``{"result":"ok", ...}`` or ``{"result":"error","reason":...}`` (:func:`parse_reply`).

Garbage from a peer only ever raises :class:`~zio_spark.errors.RemoteProtocolError`
naming the field (tests/unit/test_sink_protocol.py fuzzes every parser).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.negotiate import server_terms

__all__ = [
    "DEFAULT_STREAM",
    "FORMATS",
    "MAX_INT_ID",
    "MAX_PART",
    "MAX_STREAM_BYTES",
    "SPARK_BATCH",
    "WRITER_FORMATS",
    "BatchId",
    "Command",
    "CommandReply",
    "DataFlow",
    "Staged",
    "check_batch",
    "check_index",
    "check_stream",
    "command_bot",
    "data_bot",
    "error_reply",
    "parse_command",
    "parse_data_bot",
    "parse_partitions",
    "parse_reply",
    "parse_staged",
    "pick_format",
    "spark_batch_attr",
]

BatchId = int | str
"""A Spark batch id: the micro-batch number, or a ``df.write``'s string id."""

FORMATS: Final = ("arrow", "record")
"""Payload formats a consumer takes, in the order it prefers them."""
WRITER_FORMATS: Final = ("auto", *FORMATS)
"""The sink's option ``format``."""

SPARK_BATCH: Final = "spark_batch"
"""The BOT attribute naming the Spark batch a data flow or command belongs to."""
_LEGACY_BATCH: Final = "batch"  # what sinks before the rename sent
DEFAULT_STREAM: Final = "zio"

MAX_STREAM_BYTES: Final = 200
MAX_INT_ID: Final = 10**19 - 1
MAX_PART: Final = 10**9
_STRING_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_COMMANDS: Final = ("commit", "abort")


# ------------------------------------------------------------------------------ names


def check_stream(stream: object) -> str:
    """A stream name: a non-empty string of at most :data:`MAX_STREAM_BYTES` UTF-8 bytes.

    Raises
    ------
    RemoteProtocolError
        ``field="stream"`` otherwise.
    """
    if not isinstance(stream, str) or not stream:
        raise RemoteProtocolError(
            f"stream must be a non-empty string, got {stream!r}", field="stream", value=stream
        )
    try:
        size = len(stream.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: no file name can hold it
        raise RemoteProtocolError(
            f"stream name is not valid UTF-8 text: {stream!r}", field="stream", value=stream
        ) from None
    if size > MAX_STREAM_BYTES:
        raise RemoteProtocolError(
            f"stream name is longer than {MAX_STREAM_BYTES} bytes", field="stream", value=stream
        )
    return stream


def check_batch(batch: object, name: str = SPARK_BATCH) -> BatchId:
    """A Spark batch id (see the module docstring); ``name`` is the attribute it came in.

    Raises
    ------
    RemoteProtocolError
        ``field=name`` otherwise.
    """
    if isinstance(batch, bool):
        pass
    elif isinstance(batch, int):
        if 0 <= batch <= MAX_INT_ID:
            return batch
    elif isinstance(batch, str) and _STRING_ID.fullmatch(batch):
        return batch
    raise RemoteProtocolError(
        f"{name} must be an integer 0..{MAX_INT_ID} or a string of letters, digits, "
        f"'.', '_', '-' (1..128, starting alphanumeric), got {batch!r}",
        field=name,
        value=batch,
    )


def check_index(name: str, value: object) -> int:
    """A partition or attempt number, ``0..MAX_PART-1``.

    Raises
    ------
    RemoteProtocolError
        ``field=name`` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_PART:
        raise RemoteProtocolError(
            f"{name} must be an integer 0..{MAX_PART - 1}, got {value!r}", field=name, value=value
        )
    return value


def spark_batch_attr(attrs: Mapping[str, Any]) -> str | None:
    """The attribute of ``attrs`` that holds the Spark batch id: ``spark_batch``, else the
    legacy ``batch``; None when there is neither (a plain ZIO giver)."""
    if SPARK_BATCH in attrs:
        return SPARK_BATCH
    if _LEGACY_BATCH in attrs:
        return _LEGACY_BATCH
    return None


# ------------------------------------------------------------------------- data flows


def data_bot(
    stream: str,
    batch: BatchId,
    partition: int,
    attempt: int,
    format: str,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The extra attributes of a sink task's BOT. ``format`` is the option (one of
    :data:`WRITER_FORMATS`): ``auto`` offers every format, else just that one."""
    return {
        "stream": stream,
        SPARK_BATCH: batch,
        "partition": partition,
        "attempt": attempt,
        "encoding": list(FORMATS) if format == "auto" else [format],
        "format": "arrow" if format == "arrow" else "record",
        **(extra or {}),
    }


def pick_format(attrs: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The payload format of a data flow from the client's BOT, and our reply's
    attributes (None: nothing to state).

    A client that offers ``encoding`` (a list, or one name) gets the first one it lists
    that we take, named as a scalar in our reply (:func:`server_terms`). A client that
    does not: the ``format`` attribute of sinks older than the negotiation, else
    ``record`` for a plain ZIO giver (no Spark batch id) and ``arrow`` for a sink.

    Raises
    ------
    RemoteProtocolError
        If the offer names no encoding we take, or ``format`` is not one we know.
    """
    if "encoding" in attrs:
        # Only the offer: a legacy sink's ``batch`` (a Spark batch id) is not the profile's.
        picked = server_terms("taker", {"encoding": attrs["encoding"]}, FORMATS).encoding
        if picked is None:
            raise RemoteProtocolError(
                f"BOT encoding {attrs['encoding']!r} offers nothing this consumer takes "
                f"(it takes {list(FORMATS)})",
                field="encoding",
                value=attrs["encoding"],
            )
        return picked, {"encoding": picked}
    fmt = attrs.get("format", "record" if spark_batch_attr(attrs) is None else "arrow")
    if fmt not in FORMATS:
        raise RemoteProtocolError(
            f"format must be 'arrow' or 'record', got {fmt!r}", field="format", value=fmt
        )
    return fmt, None


@dataclass(frozen=True, slots=True)
class DataFlow:
    """A data flow's BOT as the consumer reads it.

    ``batch`` is None for a plain ZIO giver (its ``partition``/``attempt`` are then 0);
    ``reply`` the attributes of our BOT reply (None: nothing to state).
    """

    stream: str
    batch: BatchId | None
    partition: int
    attempt: int
    format: str
    reply: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def plain(self) -> bool:
        return self.batch is None


def parse_data_bot(attrs: Mapping[str, Any]) -> DataFlow:
    """Read a data flow's BOT (one without ``command``).

    Raises
    ------
    RemoteProtocolError
        Naming the attribute: ``stream``, ``encoding``/``format``, ``spark_batch`` (or
        ``batch``), ``partition``, ``attempt``.
    """
    stream = check_stream(attrs.get("stream", DEFAULT_STREAM))
    fmt, reply = pick_format(attrs)
    name = spark_batch_attr(attrs)
    if name is None:
        return DataFlow(stream, None, 0, 0, fmt, reply)
    batch = check_batch(attrs[name], name)
    partition = check_index("partition", attrs.get("partition"))
    attempt = check_index("attempt", attrs.get("attempt", 0))
    return DataFlow(stream, batch, partition, attempt, fmt, reply)


@dataclass(frozen=True, slots=True)
class Staged:
    """A consumer's EOT echo of a data flow: ``rows`` staged (None: the peer stated none,
    so it is a plain ZIO taker), or ``error`` (it could not stage)."""

    rows: int | None
    error: str | None


def parse_staged(attrs: Mapping[str, Any]) -> Staged:
    """Read the EOT echo of a data flow.

    Raises
    ------
    RemoteProtocolError
        ``field="rows"`` if ``rows`` is not an integer >= 0.
    """
    error = attrs.get("error")
    if error is not None:
        return Staged(None, error if isinstance(error, str) else repr(error))
    rows = attrs.get("rows")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise RemoteProtocolError(
            f"EOT rows must be an integer >= 0, got {rows!r}", field="rows", value=rows
        )
    return Staged(rows, None)


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class Command:
    """A driver's command: ``commit`` the listed ``(partition, attempt, rows)`` of a
    batch, or ``abort`` it. ``query`` is Spark's query id, when known."""

    command: str
    stream: str
    batch: BatchId
    partitions: tuple[tuple[int, int, int], ...] = ()
    query: str | None = None


def command_bot(
    command: str,
    stream: str,
    batch: BatchId,
    partitions: Iterable[tuple[int, int, int]] = (),
    query: str | None = None,
) -> dict[str, Any]:
    """The extra attributes of a command's BOT."""
    attrs: dict[str, Any] = {
        "stream": stream,
        SPARK_BATCH: batch,
        "command": command,
        "partitions": [list(p) for p in partitions],
    }
    if query is not None:
        attrs["query"] = query
    return attrs


def parse_command(attrs: Mapping[str, Any]) -> Command:
    """Read a command's BOT (one with ``command``).

    Raises
    ------
    RemoteProtocolError
        Naming the attribute: ``stream``, ``spark_batch`` (or ``batch``), ``query``,
        ``command``, ``partitions``, ``partition``, ``attempt``, ``rows``.
    """
    stream = check_stream(attrs.get("stream"))
    name = spark_batch_attr(attrs) or SPARK_BATCH
    batch = check_batch(attrs.get(name), name)
    query = attrs.get("query")
    if query is not None and not isinstance(query, str):
        raise RemoteProtocolError(
            f"query must be a string, got {query!r}", field="query", value=query
        )
    command = attrs.get("command")
    if command == "commit":
        parts = parse_partitions(attrs.get("partitions", []))
        return Command("commit", stream, batch, parts, query)
    if command == "abort":
        return Command("abort", stream, batch, (), query)
    raise RemoteProtocolError(
        f"command must be one of {list(_COMMANDS)}, got {command!r}",
        field="command",
        value=command,
    )


def parse_partitions(raw: object) -> tuple[tuple[int, int, int], ...]:
    """A commit's ``partitions``: ``[[partition, attempt, rows], ...]``, each partition
    once.

    Raises
    ------
    RemoteProtocolError
        ``field="partitions"`` (not a list of triples, a partition twice),
        ``"partition"``, ``"attempt"`` or ``"rows"`` (not an integer in range).
    """
    if not isinstance(raw, list):
        raise RemoteProtocolError(
            f"partitions must be a list of [partition, attempt, rows], got {raw!r}",
            field="partitions",
        )
    out: list[tuple[int, int, int]] = []
    seen: set[int] = set()
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise RemoteProtocolError(
                f"partitions entry must be [partition, attempt, rows], got {item!r}",
                field="partitions",
            )
        p = check_index("partition", item[0])
        a = check_index("attempt", item[1])
        r = item[2]
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise RemoteProtocolError(
                f"rows must be an integer >= 0, got {r!r}", field="rows", value=r
            )
        if p in seen:
            raise RemoteProtocolError(f"partition {p} listed twice", field="partitions", value=p)
        seen.add(p)
        out.append((p, a, r))
    return tuple(out)


# ---------------------------------------------------------------------------- replies


def error_reply(reason: str) -> dict[str, Any]:
    """A command's (or a refused flow's) error reply."""
    return {"result": "error", "reason": reason}


@dataclass(frozen=True, slots=True)
class CommandReply:
    """A consumer's reply to a command: ``ok``, or not with a ``reason``; ``attrs`` the
    whole reply (``published``, ``rows``, ...)."""

    ok: bool
    reason: str | None
    attrs: Mapping[str, Any]


def parse_reply(attrs: Mapping[str, Any]) -> CommandReply:
    """Read a consumer's EOT reply to a command.

    Raises
    ------
    RemoteProtocolError
        ``field="result"`` if it is neither ``"ok"`` nor ``"error"`` (not a consumer's
        reply), ``field="reason"`` if an error's reason is not a string.
    """
    result = attrs.get("result")
    if result == "ok":
        return CommandReply(True, None, attrs)
    if result == "error":
        reason = attrs.get("reason")
        if not isinstance(reason, str):
            raise RemoteProtocolError(
                f"an error reply's reason must be a string, got {reason!r}",
                field="reason",
                value=reason,
            )
        return CommandReply(False, reason, attrs)
    raise RemoteProtocolError(
        f"reply result must be 'ok' or 'error', got {result!r}", field="result", value=result
    )
