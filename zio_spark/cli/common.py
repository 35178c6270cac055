"""What the ``zio-spark`` subcommands share: exit codes, argparse types, the socket
option, the JSON summary and :class:`Stop` (SIGINT/SIGTERM end a command cleanly).

Every command module imports from here, and :mod:`zio_spark.cli.main` imports the
command modules: no command imports ``main``, so there is no cycle.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from zio_spark.errors import ConfigError, TransportError

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_TRANSPORT",
    "EXIT_USAGE",
    "HelpFormatter",
    "Stop",
    "add_socket_option",
    "duration",
    "emit",
    "heartbeats",
    "non_negative_float",
    "positive_int",
    "socket_mode",
    "unknown_arguments",
]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_TRANSPORT = 0, 1, 2, 3


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def duration(
    option: str,
    *,
    bare: str = "s",
    minimum: float = 0.0,
    maximum: float = 7 * 86400.0,
    zero: bool = False,
) -> Callable[[str], float]:
    """An argparse type: a duration with a unit (``500ms``, ``5s``, ``5000000us``) or a
    bare number (seconds unless ``bare`` says otherwise), read by
    :func:`zio_spark.options.parse_duration`: the one duration syntax of every command's
    time options. ``zero`` also accepts ``0`` (and ``0s``, ``0ms``...) as "off"."""
    from zio_spark.options import parse_duration

    def parse(text: str) -> float:
        if zero and text.strip().rstrip("smuµ") in ("0", "0.0"):
            return 0.0
        try:
            return parse_duration(option, text, bare=bare, minimum=minimum, maximum=maximum)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "duration"
    return parse


def heartbeats(
    interval: float | None, timeout: float | None, flags: tuple[str, str]
) -> tuple[float, float] | None:
    """A command's ZMTP heartbeat flags (``flags``: interval's, timeout's; each parsed by
    :func:`duration`, the interval with ``zero``) as ``(interval, timeout)`` seconds, or
    None for off (interval 0). An interval not given (None) is the default
    (:data:`~zio_spark.options.DEFAULT_HEARTBEAT_INTERVAL`), so is a timeout not given
    while heartbeats are on (:data:`~zio_spark.options.DEFAULT_HEARTBEAT_TIMEOUT`).

    Raises
    ------
    ConfigError
        Naming the flag: a timeout with heartbeats off, a timeout (given or the default)
        below the interval, a value out of :func:`~zio_spark.options.heartbeat_seconds`'
        ranges.
    """
    from zio_spark.options import (
        DEFAULT_HEARTBEAT_INTERVAL,
        DEFAULT_HEARTBEAT_TIMEOUT,
        heartbeat_seconds,
    )

    iflag, tflag = flags
    if interval == 0:
        if timeout is not None:
            raise ConfigError(tflag, timeout, f"no timeout: {iflag} 0 turns heartbeats off")
        return None
    interval = DEFAULT_HEARTBEAT_INTERVAL if interval is None else interval
    if timeout is None and interval > DEFAULT_HEARTBEAT_TIMEOUT:
        raise ConfigError(
            tflag,
            f"{DEFAULT_HEARTBEAT_TIMEOUT:g}s (the default)",
            f"a duration >= {iflag} ({interval:g}s): give it with that interval",
        )
    timeout = DEFAULT_HEARTBEAT_TIMEOUT if timeout is None else timeout
    return heartbeat_seconds(interval, timeout, names=flags)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already gives it (or
    there is none: no default, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """Refuse ``extras`` with ``parser``'s own usage (exit 2), suggesting the option a
    typo was probably meant to be (``--cout`` -> ``--count``)."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extras:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
            if close:
                hints.append(f"{word.split('=', 1)[0]} -> {close[0]}?")
    hint = f" (did you mean: {', '.join(hints)})" if hints else ""
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def socket_mode(value: str) -> str:
    """The socket kind for ``--socket``, checked against this pyzmq before any socket is
    made: ``clientserver`` on a pyzmq without the draft API is refused here (a
    CLIENT/SERVER handshake with it would abort the process)."""
    from zio_spark.transport.port import choose_mode

    try:
        return choose_mode(value, None, option="--socket").value
    except TransportError:
        raise ConfigError(
            "--socket",
            value,
            "a socket kind this pyzmq can open: clientserver needs a draft-enabled pyzmq "
            f"(this one, {sys.executable}, has none; build one with "
            "scripts/build-draft-pyzmq.sh and run zio-spark from that venv), or use "
            "--socket routerdealer if the peer has ROUTER/DEALER sockets",
        ) from None


def add_socket_option(sp: argparse.ArgumentParser) -> None:
    """Add ``--socket`` (read it with :func:`socket_mode`)."""
    sp.add_argument(
        "--socket",
        default="auto",
        choices=("auto", "clientserver", "routerdealer"),
        help="socket kind, as the Spark `socket` option: clientserver (CLIENT/SERVER, "
        "needs a draft pyzmq) or routerdealer (ROUTER/DEALER); auto = routerdealer here. "
        "Both ends must use the same kind",
    )


def emit(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """Print ``summary`` as one JSON line on stdout if the command got ``--json``."""
    if getattr(args, "json", False):
        print(json.dumps(summary, sort_keys=True))


class Stop:
    """SIGINT/SIGTERM set a flag so long-running commands end cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self.event.set())
