"""``zio-spark queue``: run the PZQ-style durable queue until SIGTERM/SIGINT
(:class:`~zio_spark.pzq.broker.QueueBroker`).

PZQ's own option names are accepted as aliases (``--receive-dsn``, ``--database``, ...),
and ``--ack-timeout`` reads a bare number as microseconds, as PZQ does. Also runnable as
``python -m zio_spark.cli.queue ...`` (the tests and the queue benchmark start it so).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from zio_spark.cli.common import HelpFormatter, duration, heartbeats, unknown_arguments
from zio_spark.errors import ConfigError, TransportError
from zio_spark.options import (
    DEDUP_RULES,
    DEFAULT_ACK_BACKLOG,
    DEFAULT_ACK_TIMEOUT,
    DEFAULT_CONN_CHECK,
    DEFAULT_DEDUP_GRACE,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_HWM,
    DEFAULT_INFLIGHT,
    DEFAULT_QUEUE_DEDUP_WINDOW,
    DEFAULT_QUEUE_FLOW_WINDOW,
    MAX_ACK_TIMEOUT_S,
    MAX_DEDUP_GRACE_S,
    QUEUE_MONITOR,
    QUEUE_RECEIVE,
    QUEUE_SEND,
    SEND_MODES,
    QueueOptions,
)
from zio_spark.pzq.broker import QueueBroker
from zio_spark.storage.store import StoreError

__all__ = ["main", "queue_options", "run_queue"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zio-spark queue",
        description="Run the PZQ-style durable queue (receive/send/monitor sockets).",
        formatter_class=HelpFormatter,
    )
    # PZQ's own option names are accepted as aliases (--receive-dsn, ...).
    p.add_argument(
        "--receive", "--receive-dsn", default=QUEUE_RECEIVE, metavar="EP",
        help="producers' endpoint",
    )  # fmt: skip
    p.add_argument(
        "--send", "--send-dsn", default=QUEUE_SEND, metavar="EP", help="consumers' endpoint"
    )
    p.add_argument(
        "--monitor", "--monitor-dsn", default=QUEUE_MONITOR, metavar="EP",
        help="monitor endpoint ('none': off)",
    )  # fmt: skip
    p.add_argument("--store", "--database", required=True, metavar="PATH", help="store folder")
    p.add_argument(
        "--ack-timeout", default=f"{DEFAULT_ACK_TIMEOUT:g}s", metavar="DURATION",
        type=duration("--ack-timeout", bare="us", minimum=1e-3, maximum=MAX_ACK_TIMEOUT_S),
        help="consumer ack timeout: 5s, 500ms, 5000000us; a bare number is microseconds, "
        f"as PZQ reads it (default {DEFAULT_ACK_TIMEOUT:g}s)",
    )  # fmt: skip
    p.add_argument(
        "--send-mode", choices=SEND_MODES, default=SEND_MODES[0],
        help="send socket: dealer (serves every PZQ consumer; default) or router "
        "(exact per-consumer limits; consumers must announce themselves)",
    )  # fmt: skip
    p.add_argument(
        "--dedup", choices=DEDUP_RULES, default=DEDUP_RULES[0],
        help="which repeated producer ids are acked and not stored again, always only "
        "with the body stored under that id: resend (only what can be a resend of a "
        "missed ack; default), global (any id in the window, across restarts), off",
    )  # fmt: skip
    p.add_argument(
        "--dedup-grace", default=f"{DEFAULT_DEDUP_GRACE:g}s", metavar="DURATION",
        type=duration("--dedup-grace", maximum=MAX_DEDUP_GRACE_S, zero=True),
        help="under --dedup resend: how long after start ids found on disk count as "
        f"resends (default {DEFAULT_DEDUP_GRACE:g}s; a bare number is seconds)",
    )  # fmt: skip
    p.add_argument(
        "--hwm", type=int, default=DEFAULT_HWM, metavar="N", help="socket high-water mark"
    )
    p.add_argument(
        "--inflight", type=int, default=DEFAULT_INFLIGHT, metavar="N", help="per-consumer limit"
    )
    p.add_argument(
        "--ack-backlog", type=int, default=DEFAULT_ACK_BACKLOG, metavar="N",
        help="most acks kept for a producer that reads none (older ones are dropped)",
    )  # fmt: skip
    p.add_argument(
        "--curve-secret",
        metavar="KEY",
        help="CURVE secret key (Z85), or @FILE to read it from a file (keeps it out of ps)",
    )
    p.add_argument(
        "--curve-allow", action="append", metavar="KEY|@FILE|DIR",
        help="with --curve-secret: admit only CURVE clients with this public key (Z85), "
        "the keys of @FILE (one a line) or the public certificates of DIR; repeatable. "
        "It holds every client of the queue (PZQ producers and consumers, Spark "
        "drivers' curvePublicKey); a direct-mode driver's run keys are then admitted "
        "on --flow-producer for range reads while its control flow lives",
    )  # fmt: skip
    p.add_argument(
        "--dedup-window", type=int, default=DEFAULT_QUEUE_DEDUP_WINDOW, metavar="N",
        help="message ids remembered to drop duplicates",
    )  # fmt: skip
    p.add_argument("--queue-id", metavar="ID", help="routing id consumers see (default: stored)")
    p.add_argument(
        "--flow-producer", metavar="EP",
        help="ZIO flow producer port for Spark sources (default: off)",
    )  # fmt: skip
    p.add_argument(
        "--flow-consumer", metavar="EP",
        help="ZIO flow consumer port for Spark sinks (default: off)",
    )  # fmt: skip
    p.add_argument(
        "--flow-window", type=int, default=DEFAULT_QUEUE_FLOW_WINDOW, metavar="N",
        help="most messages given to the flow producer port and not yet acked",
    )  # fmt: skip
    p.add_argument(
        "--flow-heartbeat-interval", default=f"{DEFAULT_HEARTBEAT_INTERVAL:g}s",
        metavar="DURATION", type=duration("--flow-heartbeat-interval", maximum=3600, zero=True),
        help="ZMTP PINGs on --flow-producer's connections this often, so a Spark reader "
        "whose host vanished is noticed; 0 turns them off (default "
        f"{DEFAULT_HEARTBEAT_INTERVAL:g}s; a bare number is seconds)",
    )  # fmt: skip
    p.add_argument(
        "--flow-heartbeat-timeout", default=None, metavar="DURATION",
        type=duration("--flow-heartbeat-timeout", minimum=1e-3, maximum=86400),
        help="libzmq closes a --flow-producer connection silent this long (not even a "
        "PONG): at least --flow-heartbeat-interval (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT:g}s with heartbeats on)",
    )  # fmt: skip
    p.add_argument(
        "--flow-conn-check", default=f"{DEFAULT_CONN_CHECK:g}s", metavar="DURATION",
        type=duration("--flow-conn-check", minimum=1e-3, maximum=3600),
        help="look this often at the connections of --flow-producer's range and control "
        "flows: a flow whose reader vanished without EOT (a task killed) ends, nothing "
        f"acked (default {DEFAULT_CONN_CHECK:g}s)",
    )  # fmt: skip
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON lines instead of 'name: value' lines: one with the endpoints once "
        'serving ("event": "ready"), one with the monitor counters after a clean stop '
        '("event": "stopped": received, stored, duplicates, delivered, acked, ...)',
    )
    return p


def _allowed(values: list[str] | None, secret: str | None) -> tuple[bytes, ...] | None:
    """``--curve-allow``'s keys (each KEY, @FILE or DIR, as ``zio-spark produce``
    reads them), Z85; None without the option.

    Raises
    ------
    ConfigError
        Naming ``--curve-allow``: without ``--curve-secret``, a malformed key, an
        unreadable file or folder.
    """
    if not values:
        return None
    from zio_spark.cli.produce import _key_text
    from zio_spark.transport.curve import curve_key

    if secret is None:
        raise ConfigError(
            "--curve-secret", None, "the queue's secret key with --curve-allow (CURVE)"
        )
    return tuple(
        curve_key(k, "--curve-allow")
        for v in values
        for k in _key_text(v, "--curve-allow", folder=True)
    )


def queue_options(args: argparse.Namespace) -> QueueOptions:
    """The checked :class:`~zio_spark.options.QueueOptions` of ``zio-spark queue``'s
    parsed flags (``--curve-secret @FILE`` read here).

    Raises
    ------
    ConfigError
        Naming the flag or the field: a bad key, heartbeats that do not fit together
        (``--flow-heartbeat-timeout`` with heartbeats off or below the interval), any
        value :class:`~zio_spark.options.QueueOptions` refuses.
    OSError
        If ``--curve-secret @FILE`` cannot be read.
    """
    secret: str | None = args.curve_secret
    if secret is not None and secret.startswith("@"):
        secret = Path(secret[1:]).read_text("ascii").strip()
    allowed = _allowed(args.curve_allow, secret)
    beats = heartbeats(
        args.flow_heartbeat_interval,
        args.flow_heartbeat_timeout,
        ("--flow-heartbeat-interval", "--flow-heartbeat-timeout"),
    )
    return QueueOptions(
        Path(args.store),
        receive=args.receive,
        send=args.send,
        monitor=None if args.monitor.lower() == "none" else args.monitor,
        ack_timeout=args.ack_timeout,
        send_mode=args.send_mode,
        dedup=args.dedup,
        dedup_grace=args.dedup_grace,
        hwm=args.hwm,
        ack_backlog=args.ack_backlog,
        inflight=args.inflight,
        curve_secret_key=secret,
        curve_allowed_client_keys=allowed,
        queue_id=args.queue_id.encode() if args.queue_id else None,
        dedup_window=args.dedup_window,
        flow_producer=args.flow_producer,
        flow_consumer=args.flow_consumer,
        flow_window=args.flow_window,
        flow_heartbeat_interval=None if beats is None else beats[0],
        flow_heartbeat_timeout=None if beats is None else beats[1],
        flow_conn_check=args.flow_conn_check,
    )


def run_queue(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run a queue until SIGTERM/SIGINT. Returns the exit status.

    Prints ``name: value`` lines (``receive``, ``send``, ``monitor``, ``queue_id``,
    ``curve_public_key`` with CURVE), then ``ready``, on stdout once serving.

    Parameters
    ----------
    argv
        Arguments without the program name (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 after a clean stop, 1 if the queue could not start, 2 for bad arguments.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `zio-spark queue -- --store ...` passes the separator on
        argv = argv[1:]
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        unknown_arguments(parser, extras)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        options = queue_options(args)
        broker = QueueBroker(options)
    except (ConfigError, OSError) as e:
        print(f"zio-spark queue: {e}", file=sys.stderr)
        return 2
    allowed = options.curve_allowed_client_keys
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            broker.start()
        except (StoreError, TransportError, OSError) as e:
            print(f"zio-spark queue: cannot start: {e}", file=sys.stderr)
            return 1
        queue_id = broker.queue_id.decode("utf-8", "replace")
        public = broker.curve_public_key
        if args.json:
            ready: dict[str, object] = {"command": "queue", "event": "ready", "queue_id": queue_id}
            ready.update(broker.endpoints)
            if public is not None:
                ready["curve_public_key"] = public.decode("ascii")
            if allowed is not None:
                ready["curve_allowed_client_keys"] = len(allowed)
            print(json.dumps(ready, sort_keys=True), flush=True)
        else:
            for name, endpoint in broker.endpoints.items():
                print(f"{name}: {endpoint}")
            print(f"queue_id: {queue_id}")
            if public is not None:
                print(f"curve_public_key: {public.decode('ascii')}")
            if allowed is not None:
                print(f"curve_allowed_client_keys: {len(allowed)}")
            print("ready", flush=True)
        while not stop.wait(0.5):
            if not broker.running:
                print("zio-spark queue: the broker thread died", file=sys.stderr)
                return 1
        broker.stop()
        if args.json:  # the counters as the monitor socket reports them (exact after stop)
            stopped = {"command": "queue", "event": "stopped", "queue_id": queue_id}
            print(json.dumps({**stopped, "stats": broker.stats()}, sort_keys=True), flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main() -> None:
    """``python -m zio_spark.cli.queue ...``."""
    sys.exit(run_queue(sys.argv[1:]))


if __name__ == "__main__":
    main()
