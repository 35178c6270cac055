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

from zio_spark.bench import BENCHES
from zio_spark.errors import ConfigError, TransportError, ZioSparkError

__all__ = ["main"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_TRANSPORT = 0, 1, 2, 3


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

    from zio_spark.transport.producer import Producer

    if args.connect:
        raise ConfigError(
            "--connect",
            args.connect,
            "--bind: a producer serves its flow (takers connect to it); use --bind ENDPOINT",
        )
    stop = _Stop()
    payload = os.urandom(args.size) if args.random else b"x" * args.size
    prod = Producer(
        args.bind,
        producer_id=args.producer_id,
        stream=args.stream,
        batch=args.batch,
        max_unacked=max(args.batch * 10, 100_000),
    )
    if args.group:
        prod.advertise(
            args.group,
            beacon_port=args.beacon_port,
            broadcast=args.broadcast,
            interface_addr=args.interface_addr,
        )
    print(f"producing on {prod.endpoint} as {prod.producer_id!r}", file=sys.stderr, flush=True)
    started = time.monotonic()
    sent = 0
    quiet = args.json or not sys.stderr.isatty()
    with Progress(
        TextColumn("[bold]produce"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} sent, {task.fields[acked]} acked"),
        TimeRemainingColumn(),
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("produce", total=args.count, acked=0)
        try:
            chunk = min(args.batch, 1000)
            while sent < args.count and not stop.event.is_set():
                n = min(chunk, args.count - sent)
                if args.rate:
                    due = started + (sent + n) / args.rate
                    delay = due - time.monotonic()
                    if delay > 0 and stop.event.wait(delay):
                        break
                prod.send_many([payload] * n, timeout=args.timeout)
                sent += n
                progress.update(task, completed=sent, acked=prod.acked)
            if args.wait_ack and not stop.event.is_set():
                deadline = time.monotonic() + args.timeout
                while prod.pending and time.monotonic() < deadline and not stop.event.is_set():
                    progress.update(task, acked=prod.acked)
                    stop.event.wait(0.1)
        finally:
            prod.close(timeout=5, flush=False)
    elapsed = time.monotonic() - started
    summary = {
        "command": "produce",
        "endpoint": prod.endpoint,
        "producer": prod.producer_id,
        "sent": sent,
        "acked": prod.acked,
        "seconds": round(elapsed, 3),
        "rate": round(sent / elapsed, 1) if elapsed > 0 else None,
    }
    _emit(args, summary)
    if args.wait_ack and prod.acked < sent:
        print(f"only {prod.acked} of {sent} records acknowledged", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


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
    from zio_spark.queue.consume_cli import run_consume

    return int(run_consume(args) or 0)


def cmd_peers(args: argparse.Namespace) -> int:
    from zio_spark.transport.peers_cli import run_peers

    return int(run_peers(args) or 0)


def cmd_demo(args: argparse.Namespace) -> int:
    from zio_spark.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from zio_spark.bench import run_bench

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

    sp = add("produce", cmd_produce, "Run an ack-capable ZIO producer that serves records.")
    sp.add_argument("--bind", default="tcp://127.0.0.1:5555", help="endpoint to bind")
    sp.add_argument("--connect", help="not supported: producers bind (takers connect)")
    sp.add_argument("--count", type=_positive_int, default=100_000, help="records to send")
    sp.add_argument("--size", type=_positive_int, default=100, help="bytes per record")
    sp.add_argument("--random", action="store_true", help="random payload bytes")
    sp.add_argument("--rate", type=_non_negative_float, default=0, help="records/s (0: max)")
    sp.add_argument("--batch", type=_positive_int, default=1000, help="most records per DAT")
    sp.add_argument("--stream", default="zio", help="stream name")
    sp.add_argument("--producer-id", help="stable producer id (default: host|endpoint)")
    sp.add_argument("--group", help="ZRE group to advertise in (see `peers`)")
    sp.add_argument("--beacon-port", type=_positive_int, default=5670, help="ZRE UDP port")
    sp.add_argument("--broadcast", help="ZRE beacon address (default: $ZIO_ZRE_BROADCAST)")
    sp.add_argument("--interface-addr", help="ZRE interface address")
    sp.add_argument(
        "--wait-ack", action="store_true", help="wait until every record is acknowledged"
    )
    sp.add_argument("--timeout", type=_non_negative_float, default=60.0, help="seconds")

    sp = add("consume", cmd_consume, "Run a sink consumer; publish committed batches as JSONL.")
    sp.add_argument("--bind", required=True, help="endpoint to bind")
    sp.add_argument("--out", required=True, help="JSON lines file to append published records to")
    sp.add_argument("--store", help="staging/publish folder (default: next to --out)")
    sp.add_argument("--count", type=_positive_int, help="exit after this many records")
    sp.add_argument("--timeout", type=_non_negative_float, help="exit after this many seconds")

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
        from zio_spark.queue.broker import run_queue

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
