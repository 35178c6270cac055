"""``zio-spark produce``: an ack-capable ZIO producer that delivers ``--count`` records.

It serves the flow (``--bind``, optionally advertised in a ZRE ``--group``) or opens it as
a client of a taker's server (``--connect``), shows a live progress bar on a terminal, and
waits until every record is acknowledged (a plain ZIO taker confirms by echoing the
final EOT). A shortfall exits 1 with the numbers and, when no taker came, the likely fix.

CURVE (``--bind`` only): ``--curve-secret`` makes the port a CURVE server (its public key
is printed: the readers' ``curveServerKey``); ``--curve-allow`` (repeatable) admits only
the listed client public keys, through a ZAP handler, plus the run keys that Spark
drivers on the list register for their queries' tasks, for range reads only: a run key
is refused a control flow or a taker's flow (docs/direct-read.md, Security).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from zio_spark.cli.common import EXIT_CHECK_FAILED, EXIT_OK, Stop, emit, heartbeats, socket_mode
from zio_spark.errors import ConfigError, TransportError

__all__ = ["DEFAULT_BIND", "run_produce"]

DEFAULT_BIND = "tcp://127.0.0.1:5555"
"""Where ``produce`` serves its flow without ``--bind`` or ``--connect``."""


def _key_text(value: str, option: str, folder: bool = False) -> list[str]:
    """``value`` of a key option: the key itself, or ``@FILE`` with one key a line
    (blank lines and ``#`` comments skipped), so secrets stay out of ``ps``; with
    ``folder``, an existing directory of public certificates too (zauth's CURVE
    "location": every ``*.key`` file in the ZPL format of czmq's zcert and pyzmq's
    ``zmq.auth.create_certificates``)."""
    if folder and not value.startswith("@") and Path(value).is_dir():
        import zmq.auth

        try:
            found = zmq.auth.load_certificates(value)
        except (OSError, ValueError) as e:
            raise ConfigError(option, value, f"a folder of readable certificates ({e})") from e
        if not found:
            raise ConfigError(option, value, "a folder holding public certificates (*.key)")
        return sorted(k.decode("ascii") for k in found)
    if not value.startswith("@"):
        return [value]
    path = Path(value[1:])
    try:
        text = path.read_text("ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(option, value, f"a key, or @FILE of a readable key file ({e})") from e
    keys = [ln.strip() for ln in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ConfigError(option, value, "a file holding at least one key (Z85, one a line)")
    return keys


def curve_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Producer's CURVE keywords from ``--curve-secret`` / ``--curve-allow``.

    Raises
    ------
    ConfigError
        Naming the option: with ``--connect``, ``--curve-allow`` without
        ``--curve-secret``, a malformed key or an unreadable ``@FILE``.
    """
    from zio_spark.transport.curve import curve_key

    secret: str | None = getattr(args, "curve_secret", None)
    allow: list[str] = list(getattr(args, "curve_allow", None) or [])
    if secret is None and not allow:
        return {}
    if args.connect:
        option = "--curve-secret" if secret is not None else "--curve-allow"
        raise ConfigError(option, "...", "--bind: the producer is the CURVE server there")
    if secret is None:
        raise ConfigError(
            "--curve-secret", None, "the producer's secret key with --curve-allow (CURVE)"
        )
    secrets = _key_text(secret, "--curve-secret")
    if len(secrets) != 1:
        raise ConfigError("--curve-secret", "<redacted>", "one secret key")
    out: dict[str, Any] = {"curve_secret_key": curve_key(secrets[0], "--curve-secret")}
    if allow:
        out["curve_allowed_client_keys"] = [
            curve_key(k, "--curve-allow")
            for v in allow
            for k in _key_text(v, "--curve-allow", folder=True)
        ]
    return out


def watch_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Producer's ``heartbeat_interval``, ``heartbeat_timeout`` and ``conn_check``
    from ``--heartbeat-interval``, ``--heartbeat-timeout``, ``--conn-check`` (none given:
    the Producer's defaults).

    Raises
    ------
    ConfigError
        Naming the flag: given with ``--connect`` (a client's connection is the
        server's to watch), a timeout with heartbeats off or below the interval.
    """
    given = {
        flag: value
        for flag, value in (
            ("--heartbeat-interval", getattr(args, "heartbeat_interval", None)),
            ("--heartbeat-timeout", getattr(args, "heartbeat_timeout", None)),
            ("--conn-check", getattr(args, "conn_check", None)),
        )
        if value is not None
    }
    if not given:
        return {}
    if args.connect:
        flag, value = next(iter(given.items()))
        raise ConfigError(flag, value, "--bind: it watches the readers of the port it serves")
    out: dict[str, Any] = {}
    if "--heartbeat-interval" in given or "--heartbeat-timeout" in given:
        beats = heartbeats(
            given.get("--heartbeat-interval"),
            given.get("--heartbeat-timeout"),
            ("--heartbeat-interval", "--heartbeat-timeout"),
        )
        out["heartbeat_interval"] = None if beats is None else beats[0]
        out["heartbeat_timeout"] = None if beats is None else beats[1]
    if "--conn-check" in given:
        out["conn_check"] = given["--conn-check"]
    return out


def run_produce(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from zio_spark.source.producer import DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES, Producer
    from zio_spark.transport.port import PortKind
    from zio_spark.transport.wire import silent_peer_hint

    if args.connect and args.bind:
        raise ConfigError(
            "--connect", args.connect, f"either --bind or --connect, not both (--bind {args.bind})"
        )
    if args.connect and args.group:
        raise ConfigError(
            "--group", args.group, "--bind: a producer in client mode has no port to advertise"
        )
    mode = socket_mode(args.socket)
    curve = curve_options(args)
    watch = watch_options(args)
    stop = Stop()
    payload = os.urandom(args.size) if args.random else b"x" * args.size
    prod = Producer(
        None if args.connect else args.bind or DEFAULT_BIND,
        connect=args.connect,
        mode=mode,
        producer_id=args.producer_id,
        stream=args.stream,
        batch=args.batch,
        max_unacked=DEFAULT_WINDOW if args.window is None else args.window,
        max_unacked_bytes=(
            DEFAULT_WINDOW_BYTES if args.window_mib is None else args.window_mib << 20
        ),
        # The command's own deadline reports a server that never answers.
        connect_timeout=args.timeout + 5.0,
        **curve,
        **watch,
    )
    topology = "connect" if args.connect else "bind"
    kind = PortKind.CLIENT if args.connect else PortKind.SERVER
    if args.group:
        prod.advertise(
            args.group,
            beacon_port=args.beacon_port,
            broadcast=args.broadcast,
            interface=args.interface_addr,
        )
    verb = "connecting to" if args.connect else "producing on"
    print(
        f"{verb} {prod.endpoint} ({prod.socket_type}) as {prod.producer_id!r}",
        file=sys.stderr,
        flush=True,
    )
    if prod.curve_public_key is not None and not args.connect:
        allowed = prod.curve_allowed_client_keys
        print(
            f"curve server key: {prod.curve_public_key.decode('ascii')} ("
            + ("any client with it" if allowed is None else f"{len(allowed)} allowed client keys")
            + ")",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    queued = 0
    shortfall: str | None = None
    quiet = args.json or not sys.stderr.isatty()
    with Progress(
        TextColumn("[bold]produce"),
        BarColumn(),
        # The bar fills with what reached the taker (acked, or confirmed by the EOT echo),
        # not with what was queued here: a bar at 100 % means delivered.
        TextColumn(
            "{task.completed}/{task.total} delivered, {task.fields[sent]} sent, "
            "{task.fields[queued]} queued{task.fields[blocked]}"
        ),
        TimeRemainingColumn(),
        console=Console(stderr=True),  # stdout is for --json; the live view is stderr's
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("produce", total=args.count, sent=0, queued=0, blocked="")

        def show() -> None:
            d = prod.delivery()
            waited = prod.blocked_seconds
            blocked = ""
            if waited >= 0.05:  # the taker's acknowledgements hold us back: say so
                now = " (window full now)" if prod.window_full else ""
                blocked = f", {waited:.1f} s waiting for acks{now}"
            progress.update(
                task, completed=d.delivered, sent=d.sent, queued=d.queued, blocked=blocked
            )

        deadline = time.monotonic() + args.timeout
        try:
            chunk = min(args.batch, 1000)
            while queued < args.count and not stop.event.is_set():
                n = min(chunk, args.count - queued)
                if args.rate:
                    due = started + (queued + n) / args.rate
                    delay = due - time.monotonic()
                    if delay > 0 and stop.event.wait(delay):
                        break
                try:
                    prod.send_many([payload] * n, timeout=args.timeout)
                except TransportError as e:  # no room for --timeout: nobody takes them
                    shortfall = str(e)
                    break
                queued += n
                show()
            # Delivered means acknowledged by an ack-capable taker, or sent to a plain one
            # (which confirms only by echoing the EOT that close() sends).
            deadline = time.monotonic() + args.timeout
            while (
                shortfall is None
                and prod.pending
                and time.monotonic() < deadline
                and not stop.event.is_set()
            ):
                show()
                stop.event.wait(0.05)
        finally:
            left = max(0.0, deadline - time.monotonic())
            plain = prod.acks is False
            # The EOT's echo confirms a plain taker's records: wait for it as long as the
            # deadline allows (an ack-capable taker's acks already say everything).
            delivery = prod.close(
                timeout=max(left, 1.0) if plain else min(left, 5.0) + 0.5, flush=False
            )
    elapsed = time.monotonic() - started
    summary: dict[str, Any] = {
        "command": "produce",
        "endpoint": prod.endpoint,
        "topology": topology,
        "socket": mode,
        "producer": prod.producer_id,
        "queued": delivery.queued,
        "sent": delivery.sent,
        "acked": delivery.acked,
        "confirmed": delivery.confirmed,
        "delivered": delivery.delivered,
        "acks": prod.acks,
        "flows": prod.stats["takers"],
        "flow_failures": prod.stats["flow_failures"],
        "window": {"records": prod.max_unacked, "bytes": prod.max_unacked_bytes},
        "blocked_seconds": round(prod.blocked_seconds, 3),
        "seconds": round(elapsed, 3),
        "rate": round(delivery.delivered / elapsed, 1) if elapsed > 0 else None,
    }
    emit(args, summary)
    if delivery.delivered == args.count and delivery.queued == args.count:
        if plain:
            print(
                f"{args.count} records delivered to a plain ZIO taker at {prod.endpoint} "
                "(confirmed by its EOT echo; it cannot acknowledge)",
                file=sys.stderr,
            )
        return EXIT_OK
    print(
        f"delivered {delivery.delivered} of {args.count} records within --timeout "
        f"{args.timeout:g} s (queued {delivery.queued}, sent {delivery.sent}, acked "
        f"{delivery.acked}, confirmed by EOT echo {delivery.confirmed}, still held "
        f"{delivery.pending})" + ("; interrupted" if stop.event.is_set() else ""),
        file=sys.stderr,
    )
    if shortfall:
        print(shortfall, file=sys.stderr)
    if prod.stats["takers"] == 0:
        what = "the server never answered our BOT" if args.connect else "no taker came"
        print(f"{what}; " + silent_peer_hint(prod.endpoint, kind, mode), file=sys.stderr)
    else:
        if delivery.sent < delivery.queued and not shortfall:
            print(
                f"the taker at {prod.endpoint} took only {delivery.sent} of "
                f"{delivery.queued} records: it paid no credit for more",
                file=sys.stderr,
            )
        if prod.last_error:
            print(f"last flow failure: {prod.last_error}", file=sys.stderr)
    return EXIT_CHECK_FAILED
