"""The ``zio-spark`` command: one entry point, subcommands, ``--help`` everywhere.

Exit codes a script can rely on:

- 0: success;
- 1: the work ran but failed its check (e.g. the demo found missing or duplicate records);
- 2: bad usage or a bad option (argparse, :class:`~zio_spark.errors.ConfigError`);
- 3: a transport failure (unreachable peer, timeout).

``--json`` makes a subcommand print one JSON summary object on stdout as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from zio_spark.cli.bench import BENCHES
from zio_spark.errors import ConfigError, TransportError, ZioSparkError

__all__ = ["main"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_TRANSPORT = 0, 1, 2, 3
_DEFAULT_PRODUCE_BIND = "tcp://127.0.0.1:5555"


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def _non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def _duration(option: str) -> Callable[[str], float]:
    """An argparse type: a duration with a unit (``500ms``, ``5s``, ``5000000us``) or a
    bare number of seconds, read by :func:`zio_spark.options.parse_duration`."""
    from zio_spark.options import parse_duration

    def parse(text: str) -> float:
        try:
            return parse_duration(option, text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "duration"
    return parse


def _socket_mode(value: str) -> str:
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


def _add_socket_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--socket",
        default="auto",
        choices=("auto", "clientserver", "routerdealer"),
        help="socket kind, as the Spark `socket` option: clientserver (CLIENT/SERVER, "
        "needs a draft pyzmq) or routerdealer (ROUTER/DEALER); auto = routerdealer here. "
        "Both ends must use the same kind",
    )


def _emit(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(summary, sort_keys=True))


class _Stop:
    """SIGINT/SIGTERM set a flag so long-running commands end cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self.event.set())


# -- produce ----------------------------------------------------------------------------


def cmd_produce(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from zio_spark.source.producer import Producer, silent_peer_hint
    from zio_spark.transport.port import PortKind

    if args.connect and args.bind:
        raise ConfigError(
            "--connect", args.connect, f"either --bind or --connect, not both (--bind {args.bind})"
        )
    if args.connect and args.group:
        raise ConfigError(
            "--group", args.group, "--bind: a producer in client mode has no port to advertise"
        )
    mode = _socket_mode(args.socket)
    stop = _Stop()
    payload = os.urandom(args.size) if args.random else b"x" * args.size
    window: dict[str, int] = {}
    if args.window is not None:
        window["max_unacked"] = args.window
    if args.window_mib is not None:
        window["max_unacked_bytes"] = args.window_mib << 20
    prod = Producer(
        None if args.connect else args.bind or _DEFAULT_PRODUCE_BIND,
        connect=args.connect,
        mode=mode,
        producer_id=args.producer_id,
        stream=args.stream,
        batch=args.batch,
        **window,
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
            interface_addr=args.interface_addr,
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
        TextColumn(
            "{task.completed}/{task.total} queued, {task.fields[sent]} sent, "
            "{task.fields[delivered]} delivered{task.fields[blocked]}"
        ),
        TimeRemainingColumn(),
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("produce", total=args.count, sent=0, delivered=0, blocked="")

        def show() -> None:
            d = prod.delivery()
            waited = prod.blocked_seconds
            blocked = ""
            if waited >= 0.05:  # the taker's acknowledgements hold us back: say so
                now = " (window full now)" if prod.window_full else ""
                blocked = f", {waited:.1f} s waiting for acks{now}"
            progress.update(
                task, completed=d.queued, sent=d.sent, delivered=d.delivered, blocked=blocked
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
    _emit(args, summary)
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


# -- keys -------------------------------------------------------------------------------


def cmd_keys(args: argparse.Namespace) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    summary = {"public": public.decode("ascii"), "secret": secret.decode("ascii")}
    if args.json:
        _emit(args, summary)
    else:
        print(f"public: {summary['public']}\nsecret: {summary['secret']}")
    return EXIT_OK


# -- delegating commands ------------------------------------------------------------------


def cmd_consume(args: argparse.Namespace) -> int:
    from zio_spark.cli.consume import run_consume

    return int(run_consume(args) or 0)


def cmd_peers(args: argparse.Namespace) -> int:
    from zio_spark.cli.peers import run_peers

    return int(run_peers(args) or 0)


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        import zio_spark.spark  # noqa: F401  (checks for a Spark, an optional extra)
    except ImportError as e:  # no pyspark, or one too old: the message says which and why
        print(f"zio-spark demo: {e}", file=sys.stderr)
        return EXIT_USAGE
    from zio_spark.cli.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from zio_spark.cli.bench import run_bench

    return run_bench(args)


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zio-spark",
        description="ZeroMQ ZIO flows for Spark: producer, consumer, queue, discovery, demo.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        sp.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
        return sp

    sp = add(
        "produce",
        cmd_produce,
        "Run an ack-capable ZIO producer and deliver --count records to a taker.",
    )
    where = sp.add_mutually_exclusive_group()
    where.add_argument(
        "--bind",
        help=f"serve the flow on this endpoint; takers connect (default {_DEFAULT_PRODUCE_BIND})",
    )
    where.add_argument(
        "--connect",
        help="open the flow as a client of a server that takes at this endpoint "
        "(a flow broker, the Spark source in bind mode); reconnects after failures",
    )
    _add_socket_option(sp)
    sp.add_argument("--count", type=_positive_int, default=100_000, help="records to send")
    sp.add_argument("--size", type=_positive_int, default=100, help="bytes per record")
    sp.add_argument("--random", action="store_true", help="random payload bytes")
    sp.add_argument("--rate", type=_non_negative_float, default=0, help="records/s (0: max)")
    sp.add_argument("--batch", type=_positive_int, default=1000, help="most records per DAT")
    sp.add_argument(
        "--window",
        type=_positive_int,
        default=None,
        help="most records held unacknowledged (default 2,000,000; see the README's "
        "'Producer window' for the arithmetic)",
    )
    sp.add_argument(
        "--window-mib",
        type=_positive_int,
        default=None,
        help="most MiB of record values held unacknowledged (default 256)",
    )
    sp.add_argument("--stream", default="zio", help="stream name")
    sp.add_argument("--producer-id", help="stable producer id (default: host|endpoint)")
    sp.add_argument("--group", help="ZRE group to advertise in (see `peers`; --bind only)")
    sp.add_argument("--beacon-port", type=_positive_int, default=5670, help="ZRE UDP port")
    sp.add_argument("--broadcast", help="ZRE beacon address (default: $ZIO_ZRE_BROADCAST)")
    sp.add_argument("--interface-addr", help="ZRE interface address")
    sp.add_argument(
        "--wait-ack",
        action="store_true",
        help="kept for scripts: produce always waits until every record is acknowledged "
        "(a plain ZIO taker, which cannot ack, confirms by echoing the final EOT)",
    )
    sp.add_argument(
        "--timeout",
        type=_duration("--timeout"),
        default=60.0,
        help="longest wait for delivery once every record is queued (and for buffer room "
        "while queueing), e.g. 500ms, 30s, 5000000us; a bare number is seconds. A shortfall "
        "exits 1 with the numbers",
    )

    sp = add("consume", cmd_consume, "Run a sink consumer; publish committed batches as JSONL.")
    sp.add_argument("--bind", required=True, help="endpoint to bind")
    sp.add_argument("--out", required=True, help="JSON lines file to append published records to")
    sp.add_argument("--store", help="staging/publish folder (default: next to --out)")
    _add_socket_option(sp)
    sp.add_argument("--count", type=_positive_int, help="exit after this many records")
    sp.add_argument(
        "--timeout",
        type=_duration("--timeout"),
        help="exit after this long (500ms, 30s, 2m; a bare number is seconds)",
    )

    # Listed for `zio-spark --help` only: main() hands `queue ...` to the queue's own parser.
    sub.add_parser("queue", help="Run the PZQ-style durable queue server.")

    sp = add("peers", cmd_peers, "Show ZRE peers of a group and their ZIO ports, live.")
    sp.add_argument("--group", required=True, help="ZRE group")
    sp.add_argument("--beacon-port", type=_positive_int, default=5670)
    sp.add_argument("--broadcast", help="beacon address (default: $ZIO_ZRE_BROADCAST or all)")
    sp.add_argument("--interface-addr", help="address to bind the mailbox on")
    sp.add_argument("--timeout", type=_non_negative_float, default=5.0, help="seconds to watch")

    add("keys", cmd_keys, "Print a new CURVE key pair (Z85).")

    sp = add("demo", cmd_demo, "End-to-end demo on local Spark with an embedded producer.")
    sp.add_argument("--records", type=_positive_int, default=200_000, help="frames to stream")
    sp.add_argument("--rate", type=_non_negative_float, default=50_000, help="frames/s (0: max)")
    sp.add_argument("--out", default="demo-output", help="folder for the plot and summary")
    sp.add_argument("--no-progress", action="store_true", help="no live view")

    sp = add("bench", cmd_bench, "Run the benchmarks (numbers as ratios against anchors).")
    sp.add_argument("--quick", action="store_true", help="about two minutes; checks the harness")
    sp.add_argument("--out", default="bench/results", help="folder for JSON and Markdown")
    sp.add_argument(
        "--only",
        nargs="+",
        choices=tuple(BENCHES),
        help="run only these benchmarks",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["queue"]:
        # The queue has its own option parser (run_queue); hand it everything after
        # `queue`, so `zio-spark queue --store X` works as written.
        from zio_spark.pzq.broker import run_queue

        return int(run_queue(args_list[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"zio-spark {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TransportError as e:
        print(f"zio-spark {args.command}: {e}", file=sys.stderr)
        return EXIT_TRANSPORT
    except ZioSparkError as e:
        print(f"zio-spark {args.command}: {e}", file=sys.stderr)
        return EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
