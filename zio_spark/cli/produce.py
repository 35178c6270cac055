"""``zio-spark produce``: an ack-capable ZIO producer that delivers ``--count`` records.

It serves the flow (``--bind``, optionally advertised in a ZRE ``--group``) or opens it as
a client of a taker's server (``--connect``), shows a live progress bar on a terminal, and
waits until every record is acknowledged (a plain ZIO taker confirms by echoing the
final EOT). A shortfall exits 1 with the numbers and, when no taker came, the likely fix.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from zio_spark.cli.common import EXIT_CHECK_FAILED, EXIT_OK, Stop, emit, socket_mode
from zio_spark.errors import ConfigError, TransportError

__all__ = ["DEFAULT_BIND", "run_produce"]

DEFAULT_BIND = "tcp://127.0.0.1:5555"
"""Where ``produce`` serves its flow without ``--bind`` or ``--connect``."""


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
