"""The ``zio-spark`` command: one entry point, subcommands, ``--help`` everywhere.

Exit codes a script can rely on:

- 0: success;
- 1: the work ran but failed its check (e.g. the demo found missing or duplicate records);
- 2: bad usage or a bad option (argparse, :class:`~zio_spark.errors.ConfigError`);
- 3: a transport failure (unreachable peer, timeout).

``--json`` (every command) makes it print JSON on stdout, one object per line: the
command's summary as its last line. For the long-running ones that is the line printed
when they end (``produce``: what was queued, sent, acknowledged, delivered; ``consume``:
records published; ``peers``: the peers seen; ``queue``: a ``ready`` line with its
endpoints once serving, then a ``stopped`` line with its counters). ``doctor --json`` is one
document with every check.

``--help`` shows every option's default; an unknown option is answered with the usage of
the command it was given to.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from zio_spark.cli.bench import BENCHES
from zio_spark.cli.common import (
    EXIT_CHECK_FAILED,
    EXIT_TRANSPORT,
    EXIT_USAGE,
    HelpFormatter,
    add_socket_option,
    duration,
    non_negative_float,
    positive_int,
    unknown_arguments,
)
from zio_spark.cli.produce import DEFAULT_BIND
from zio_spark.codec.records import DAT_RECORDS
from zio_spark.errors import ConfigError, TransportError, ZioSparkError

__all__ = ["build_parser", "main"]


# -- commands: each lives in its own module, imported when it runs --------------------------


def cmd_produce(args: argparse.Namespace) -> int:
    from zio_spark.cli.produce import run_produce

    return run_produce(args)


def cmd_keys(args: argparse.Namespace) -> int:
    from zio_spark.cli.keys import run_keys

    return run_keys(args)


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


def cmd_doctor(args: argparse.Namespace) -> int:
    from zio_spark.cli.doctor import run_doctor

    return run_doctor(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from zio_spark.cli.bench import run_bench

    return run_bench(args)


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zio-spark",
        description="ZeroMQ ZIO flows for Spark: producer, consumer, queue, discovery, demo, "
        "checks of the Spark setup (doctor).",
        formatter_class=HelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        sp.set_defaults(fn=fn, parser=sp)
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
        help=f"serve the flow on this endpoint; takers connect (default {DEFAULT_BIND})",
    )
    where.add_argument(
        "--connect",
        help="open the flow as a client of a server that takes at this endpoint "
        "(a flow broker, the Spark source in bind mode); reconnects after failures",
    )
    add_socket_option(sp)
    sp.add_argument("--count", type=positive_int, default=100_000, help="records to send")
    sp.add_argument("--size", type=positive_int, default=100, help="bytes per record")
    sp.add_argument("--random", action="store_true", help="random payload bytes")
    sp.add_argument("--rate", type=non_negative_float, default=0, help="records/s (0: max)")
    sp.add_argument("--batch", type=positive_int, default=DAT_RECORDS, help="most records per DAT")
    sp.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="most records held unacknowledged (default 2,000,000; see the README's "
        "'Producer window' for the arithmetic)",
    )
    sp.add_argument(
        "--window-mib",
        type=positive_int,
        default=None,
        help="most MiB of record values held unacknowledged (default 256)",
    )
    sp.add_argument("--stream", default="zio", help="stream name")
    sp.add_argument("--producer-id", help="stable producer id (default: host|endpoint)")
    sp.add_argument(
        "--curve-secret",
        metavar="KEY",
        help="--bind: serve over CURVE with this secret key (Z85; `zio-spark keys` makes "
        "one), or @FILE to read it from a file (keeps it out of ps); its public key is "
        "printed: the readers' curveServerKey",
    )
    sp.add_argument(
        "--curve-allow",
        metavar="KEY",
        action="append",
        help="with --curve-secret: admit only CURVE clients with this public key (Z85), "
        "through a ZAP handler; repeat it, @FILE with one key a line, or a folder of "
        "public certificates (zauth's CURVE location: *.key files). List the takers' "
        "and the Spark drivers' curvePublicKey: a driver in readMode=direct registers a "
        "fresh key for its query's tasks, admitted while its control flow lives, for "
        "range reads only. "
        "Default: any client that knows the server key",
    )
    sp.add_argument(
        "--heartbeat-interval",
        type=duration("--heartbeat-interval", maximum=3600, zero=True),
        metavar="DURATION",
        help="--bind: ZMTP PINGs on the port's connections this often, so a reader whose "
        "host vanished is noticed (500ms, 5s, 1m; a bare number is seconds); 0 turns "
        "them off (default 5s)",
    )
    sp.add_argument(
        "--heartbeat-timeout",
        type=duration("--heartbeat-timeout", minimum=1e-3, maximum=86400),
        metavar="DURATION",
        help="--bind: libzmq closes a connection silent this long (not even a PONG); at "
        "least --heartbeat-interval (default 30s with heartbeats on)",
    )
    sp.add_argument(
        "--conn-check",
        type=duration("--conn-check", minimum=1e-3, maximum=3600),
        metavar="DURATION",
        help="--bind: look this often at the range and control readers' connections: a "
        "flow whose reader vanished without EOT (a Spark task killed) ends, nothing "
        "acked (default 500ms)",
    )
    sp.add_argument("--group", help="ZRE group to advertise in (see `peers`; --bind only)")
    sp.add_argument("--beacon-port", type=positive_int, default=5670, help="ZRE UDP port")
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
        type=duration("--timeout"),
        metavar="DURATION",
        default="60s",
        help="longest wait for delivery once every record is queued (and for buffer room "
        "while queueing), e.g. 500ms, 30s, 5000000us; a bare number is seconds. A shortfall "
        "exits 1 with the numbers",
    )

    sp = add("consume", cmd_consume, "Run a sink consumer; publish committed batches as JSONL.")
    sp.add_argument("--bind", required=True, help="endpoint to bind")
    sp.add_argument("--out", required=True, help="JSON lines file to append published records to")
    sp.add_argument("--store", help="staging/publish folder (default: next to --out)")
    add_socket_option(sp)
    sp.add_argument("--count", type=positive_int, help="exit after this many records")
    sp.add_argument(
        "--timeout",
        type=duration("--timeout"),
        metavar="DURATION",
        help="exit after this long (500ms, 30s, 2m; a bare number is seconds); if no giver "
        "opened a flow by then, or nothing was published, it exits 1 naming the endpoint "
        "(default: run until SIGINT/SIGTERM)",
    )

    # Listed for `zio-spark --help` only: main() hands `queue ...` to the queue's own parser.
    sub.add_parser("queue", help="Run the PZQ-style durable queue server.")

    sp = add("peers", cmd_peers, "Show ZRE peers of a group and their ZIO ports, live.")
    sp.add_argument("--group", required=True, help="ZRE group")
    sp.add_argument("--beacon-port", type=positive_int, default=5670, help="ZRE UDP port")
    sp.add_argument("--broadcast", help="beacon address (default: $ZIO_ZRE_BROADCAST or all)")
    sp.add_argument("--interface-addr", help="address to bind the mailbox on")
    sp.add_argument(
        "--timeout",
        type=duration("--timeout"),
        metavar="DURATION",
        default="5s",
        help="how long to watch (500ms, 5s, 2m; a bare number is seconds)",
    )

    add("keys", cmd_keys, "Print a new CURVE key pair (Z85).")

    sp = add("demo", cmd_demo, "End-to-end demo on local Spark with an embedded producer.")
    sp.add_argument("--records", type=positive_int, default=200_000, help="frames to stream")
    sp.add_argument("--rate", type=non_negative_float, default=50_000, help="frames/s (0: max)")
    sp.add_argument("--out", default="demo-output", help="folder for the plot and summary")
    sp.add_argument("--no-progress", action="store_true", help="no live view")

    sp = add(
        "doctor",
        cmd_doctor,
        "Check the Python Spark's workers run (zio-spark, the same pyspark, Spark's data "
        "source hooks, draft pyzmq, start-up time), Java and ZRE broadcast; each finding "
        "with its fix. Exits 1 if a check fails.",
    )
    sp.add_argument(
        "--python",
        metavar="PATH",
        help="check this Python instead of the ones Spark would pick "
        "($PYSPARK_DRIVER_PYTHON, $PYSPARK_PYTHON, python3)",
    )
    sp.add_argument(
        "--fix",
        action="store_true",
        help="precompile the pyspark.zip (and py4j zip) Spark puts on that Python's "
        "workers' path, if they hold no bytecode for it (runs <python> -m "
        "zio_spark.cli.precompile, which rewrites them)",
    )

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
        from zio_spark.cli.queue import run_queue

        return int(run_queue(args_list[1:]) or 0)
    parser = build_parser()
    args, extras = parser.parse_known_args(args_list)
    if extras:  # answered with the subcommand's own usage, not the top-level one
        unknown_arguments(args.parser, extras)
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
