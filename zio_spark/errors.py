"""The zio-spark error tree.

Every error this package raises on purpose derives from :class:`ZioSparkError`; any
other exception escaping the package is a bug. The split follows h11/h2:

- :class:`LocalProtocolError`: *we* misused the API (sent DAT without credit, called
  ``put`` on a taker, ...). Fix the calling code.
- :class:`RemoteProtocolError`: the *peer* broke the spec (bad bytes, illegal message
  for the state). The peer is dropped and counted; other flows go on.
- :class:`FlowControlError`: a credit violation, local or remote (it is a
  :class:`RemoteProtocolError` because it is almost always raised on input).
- :class:`ConfigError`: a bad option value; also a :class:`ValueError`.
- :class:`InputColumnsError`: the DataFrame given to the sink has columns it cannot
  write; also a :class:`ValueError`.
- :class:`TransportError`: socket-level trouble; keeps the endpoint.
- :class:`DataLossError`: records are known to be missing; raised only when
  ``failOnDataLoss`` is true.
- :class:`StorageError`: trouble with durable state on disk (spool, WAL, queue store,
  sink folder); keeps the path. Its subclasses: :class:`CorruptRecordError` (bytes that
  fail their checks; also a :class:`ValueError`), :class:`FormatVersionError` (a file
  written by another format version), :class:`StorageClosedError` (used after
  ``close``) and :class:`StorageInputError` (a bad argument to a storage call; also a
  :class:`ValueError` and a :class:`TypeError`). The mixins are what storage raised
  before, so callers that catch those keep working.

Errors carry their facts as attributes (``field``, ``value``, ``peer``, ``credit``) so
callers and tests need not parse messages, and messages name the field, the value and
what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = [
    "ConfigError",
    "CorruptRecordError",
    "DataLossError",
    "FlowControlError",
    "FormatVersionError",
    "InputColumnsError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "StorageClosedError",
    "StorageError",
    "StorageInputError",
    "TransportError",
    "ZioSparkError",
    "check_count",
]


class ZioSparkError(Exception):
    """Base class of every error zio-spark raises on purpose."""


class ConfigError(ZioSparkError, ValueError):
    """A bad option or setting.

    Parameters
    ----------
    option
        The option's name, as the user wrote it (e.g. ``"maxBacklog"``).
    value
        The offending value (``None`` when the option is missing).
    expected
        What would have been accepted, in words.
    """

    def __init__(self, option: str, value: object, expected: str) -> None:
        self.option = option
        self.value = value
        self.expected = expected
        super().__init__(f"option {option!r}: got {value!r}, expected {expected}")


class InputColumnsError(ZioSparkError, ValueError):
    """The DataFrame given to the sink has input columns it cannot write.

    Not an option problem: the message lists the DataFrame's columns as found, what is
    wrong and what the sink takes.

    Parameters
    ----------
    columns
        The DataFrame's input columns, each as ``"name type"``.
    problem
        What is wrong, naming the column(s) at fault.
    expected
        What would be accepted, and how to get there.
    """

    def __init__(self, columns: Sequence[str], problem: str, expected: str) -> None:
        self.columns = tuple(columns)
        self.problem = problem
        self.expected = expected
        listed = ", ".join(self.columns) if self.columns else "none"
        super().__init__(
            f"the DataFrame written to the zio sink has the input columns [{listed}]: "
            f"{problem}; expected {expected}"
        )


def check_count(option: str, value: object, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum`` (not a bool), else a :class:`ConfigError`
    naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(option, value, f"an integer >= {minimum}")
    return value


class ProtocolError(ZioSparkError):
    """Base of protocol violations. ``field``/``value`` name what was wrong, if known."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        value: object = None,
        peer: object = None,
    ) -> None:
        self.field = field
        self.value = value
        self.peer = peer
        super().__init__(message)


class LocalProtocolError(ProtocolError):
    """This side misused the protocol API; the peer did nothing wrong."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the spec forbids, or bytes that do not decode."""


class FlowControlError(RemoteProtocolError):
    """A credit violation: DAT without credit, PAY beyond what is held, credit <= 0.

    ``credit`` is the credit the offending side held at the time, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        credit: int | None = None,
        field: str | None = None,
        value: object = None,
        peer: object = None,
    ) -> None:
        self.credit = credit
        super().__init__(message, field=field, value=value, peer=peer)


class TransportError(ZioSparkError):
    """Socket trouble: unreachable endpoint, timeout, refused handshake.

    ``endpoint`` names the address involved. Raise it ``from`` the underlying error.
    ``sent``: set by calls that send many messages (``send_dats``, ``put_many``) to how
    many of theirs went out before the failure; None elsewhere.
    """

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        self.sent: int | None = None
        super().__init__(f"{message} (endpoint {endpoint})" if endpoint else message)


class DataLossError(ZioSparkError):
    """Records are known to be missing (raised only when ``failOnDataLoss`` is true)."""

    def __init__(self, message: str, *, producer: str | None = None) -> None:
        self.producer = producer
        super().__init__(message)


class StorageError(ZioSparkError):
    """Durable state on disk cannot be read, written or used as asked.

    ``path`` is the file or folder involved, when known; the message ends with it.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        super().__init__(f"{message} ({self.path})" if self.path is not None else message)


class CorruptRecordError(StorageError, ValueError):
    """Bytes on disk fail their checks (CRC, length, magic, a field out of range).

    ``offset`` is the byte offset of the bad record in ``path``, when known. Also a
    :class:`ValueError`, which storage raised for these before (a caller that catches
    ``ValueError`` around a decoder keeps working).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        offset: int | None = None,
    ) -> None:
        self.offset = offset
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"{message}{where}", path=path)


class FormatVersionError(StorageError):
    """A file was written in a format version this code does not read.

    ``found`` is the version (or magic) read, ``expected`` what this code reads.
    """

    def __init__(
        self,
        found: object,
        expected: object,
        *,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.found = found
        self.expected = expected
        super().__init__(f"format version {found!r}, expected {expected!r}", path=path)


class StorageClosedError(StorageError):
    """A storage object was used after it was closed."""


class StorageInputError(StorageError, ValueError, TypeError):
    """A bad argument to a storage call; the stored state is untouched.

    ``field`` names the argument (or the field of a record), ``value`` is what was given
    and ``expected`` says what would have been accepted. Also a :class:`ValueError` and a
    :class:`TypeError`, which storage raised for these before.
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        shown = repr(value)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        super().__init__(f"{field}: got {shown}, expected {expected}")
