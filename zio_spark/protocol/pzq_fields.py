"""Field checks shared by the PZQ codecs (:mod:`zio_spark.protocol.pzq`) and the in-flight
table (:mod:`zio_spark.protocol.pzq_inflight`): the errors they raise, the decoders for
ids, delimiters and timestamps, and the constructors' argument checks.

Internal to the PZQ protocol modules; users import the public names from
:mod:`zio_spark.protocol.pzq`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zio_spark.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DELIMITER",
    "MAX_TIMESTAMP_US",
    "as_parts",
    "check_bool",
    "check_instance",
    "check_message_id",
    "check_parts",
    "check_time",
    "decode_delimiter",
    "decode_extra_and_body",
    "decode_message_id",
    "decode_timestamp",
    "find_delimiter",
    "local_error",
    "remote_error",
    "show",
]

DELIMITER = b""
"""The empty part between protocol fields and user data."""

MAX_TIMESTAMP_US = 2**64 - 1
"""Largest ``sent``/``ack timeout`` value accepted: PZQ writes them as unsigned 64-bit."""

# 2**64 - 1 has 20 digits; bounding the length first keeps int() cheap on hostile input.
_MAX_DIGITS = 20
_SHOW_LIMIT = 48
_BYTES_LIKE = (bytes, bytearray, memoryview, str)


def show(value: bytes) -> str:
    if len(value) <= _SHOW_LIMIT:
        return repr(value)
    return f"{value[:_SHOW_LIMIT]!r}... ({len(value)} bytes)"


def remote_error(
    kind: str, field: str, got: str, expected: str, value: object
) -> RemoteProtocolError:
    return RemoteProtocolError(
        f"PZQ {kind}: {field} {got}; expected {expected}", field=field, value=value
    )


def local_error(
    kind: str, field: str, got: str, expected: str, value: object
) -> LocalProtocolError:
    return LocalProtocolError(
        f"{kind}: {field} {got}; expected {expected}", field=field, value=value
    )


def as_parts(frames: Sequence[bytes], kind: str) -> list[bytes]:
    """Copy ``frames`` to a list of ``bytes`` (zmq ``Frame``/``bytearray`` are accepted)."""
    if isinstance(frames, _BYTES_LIKE) or not isinstance(frames, Sequence):
        raise local_error(
            f"decoding a PZQ {kind}",
            "frames",
            f"is a {type(frames).__name__}",
            "a sequence of parts (list of bytes)",
            frames,
        )
    parts: list[bytes] = []
    for index, part in enumerate(frames):
        if type(part) is bytes:
            parts.append(part)
            continue
        try:
            parts.append(bytes(memoryview(part)))
        except TypeError:
            raise local_error(
                f"decoding a PZQ {kind}",
                "frames",
                f"has a {type(part).__name__} at index {index}",
                "bytes or a buffer",
                part,
            ) from None
    return parts


def find_delimiter(parts: list[bytes], start: int) -> int:
    """Index of the first empty part at or after ``start``, or -1."""
    try:
        return parts.index(DELIMITER, start)
    except ValueError:
        return -1


def decode_message_id(parts: list[bytes], kind: str) -> bytes:
    if not parts:
        raise remote_error(kind, "message_id", "is missing (no parts)", "a non-empty id part", None)
    message_id = parts[0]
    if not message_id:
        raise remote_error(kind, "message_id", "is empty", "a non-empty id part", message_id)
    return message_id


def decode_delimiter(parts: list[bytes], start: int, kind: str) -> int:
    delimiter = find_delimiter(parts, start)
    if delimiter < 0:
        raise remote_error(
            kind,
            "delimiter",
            f"is missing (no empty part after part {start - 1} in {len(parts)} parts)",
            "an empty part between the protocol fields and the data",
            len(parts),
        )
    return delimiter


def decode_extra_and_body(
    parts: list[bytes], start: int, kind: str
) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """Split ``parts[start:]`` at the delimiter into ``(extra, body)``; the body must
    have at least one part."""
    delimiter = decode_delimiter(parts, start, kind)
    if delimiter == len(parts) - 1:
        raise remote_error(
            kind, "body", "is missing (delimiter is the last part)", "at least one part", None
        )
    return tuple(parts[start:delimiter]), tuple(parts[delimiter + 1 :])


def decode_timestamp(parts: list[bytes], index: int, field: str, kind: str) -> int:
    if len(parts) <= index:
        raise remote_error(
            kind,
            field,
            f"is missing (only {len(parts)} parts)",
            f"an ASCII decimal at part {index}",
            None,
        )
    raw = parts[index]
    # bytes.isdigit() is ASCII-only, so signs, spaces, "_" and non-ASCII digits all fail,
    # where int() alone would accept " +1_0 ".
    if not (0 < len(raw) <= _MAX_DIGITS and raw.isdigit()):
        raise remote_error(
            kind,
            field,
            f"is {show(raw)}",
            f"a non-negative ASCII decimal integer of 1 to {_MAX_DIGITS} digits (microseconds)",
            raw,
        )
    value = int(raw)
    if value > MAX_TIMESTAMP_US:
        raise remote_error(
            kind, field, f"is {value}", f"at most {MAX_TIMESTAMP_US} (2**64 - 1)", raw
        )
    return value


def check_message_id(kind: str, message_id: object) -> None:
    if not isinstance(message_id, bytes):
        raise local_error(
            kind, "message_id", f"is a {type(message_id).__name__}", "bytes", message_id
        )
    if not message_id:
        raise local_error(kind, "message_id", "is empty", "a non-empty id", message_id)


def check_parts(kind: str, field: str, value: object, *, data: bool) -> tuple[bytes, ...]:
    """Validate a body (``data=True``: >= 1 part, empty parts fine) or extra parts.

    Extra parts must be non-empty: an empty one would be read back as the delimiter.
    """
    if isinstance(value, _BYTES_LIKE) or not isinstance(value, Iterable):
        raise local_error(
            kind, field, f"is a {type(value).__name__}", "a tuple of bytes parts", value
        )
    parts = tuple(value)
    for index, part in enumerate(parts):
        if not isinstance(part, bytes):
            raise local_error(
                kind, field, f"has a {type(part).__name__} at index {index}", "bytes parts", value
            )
        if not data and not part:
            raise local_error(
                kind,
                field,
                f"has an empty part at index {index}",
                "non-empty parts (an empty part is the delimiter)",
                value,
            )
    if data and not parts:
        raise local_error(kind, field, "has no parts", "at least one body part", value)
    return parts


def check_bool(kind: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise local_error(kind, field, f"is a {type(value).__name__}", "a bool", value)


def check_time(kind: str, field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise local_error(
            kind, field, f"is a {type(value).__name__}", "an int (microseconds)", value
        )
    if not 0 <= value <= MAX_TIMESTAMP_US:
        raise local_error(kind, field, f"is {value}", f"0 <= value <= {MAX_TIMESTAMP_US}", value)


def check_instance(kind: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise local_error(kind, "message", f"is a {type(value).__name__}", cls.__name__, value)
