"""``zio-spark consume --bind EP --out FILE``: run a sink consumer, publish as JSON lines.

``--socket clientserver`` serves CLIENT givers (the reference's, with a draft libzmq);
the default serves DEALER ones. ``--timeout`` never ends in a silent success: it exits 1
when no giver opened a flow by then (naming the endpoint, the timeout, both socket kinds
and the fix: a mismatched pair connects and delivers nothing), when flows came but nothing
was published, and, with ``--count``, on a shortfall (with the numbers). Ended by
SIGINT/SIGTERM it exits 0. The counts (stderr, ``--json``) are records published, written
to ``--out`` and acknowledged to the giver, not records merely staged.

Each published record becomes one line ``{"stream", "batch", "partition"?, "value",
"key"?, "headers"?}``: ``value``/``key`` as UTF-8 text when they decode, else base64 with
``"value_b64": true``. A batch is appended to the file (flushed and fsync'd) before it is
acknowledged to the consumer, so a crash repeats at most the last batch in the file, never
loses one.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from typing import Any

from zio_spark.cli.common import EXIT_CHECK_FAILED, EXIT_OK, Stop, socket_mode
from zio_spark.sink.consumer import Consumer

__all__ = ["run_consume"]


def _text(field: str, data: bytes | None, out: dict[str, Any]) -> None:
    if data is None:
        return
    try:
        out[field] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[field] = base64.b64encode(data).decode("ascii")
        out[f"{field}_b64"] = True


def run_consume(args: argparse.Namespace) -> int:
    from zio_spark.transport.port import PortKind
    from zio_spark.transport.wire import silent_peer_hint

    mode = socket_mode(getattr(args, "socket", "auto"))
    stop = Stop()
    store = args.store or os.path.abspath(args.out) + ".store"
    consumer = Consumer(args.bind, store, mode=mode)
    socket_type = consumer.server.port.socket_type
    print(f"consuming on {consumer.endpoint} ({socket_type})", file=sys.stderr, flush=True)
    written = batches = 0
    timed_out = False
    started = time.monotonic()
    try:
        with open(args.out, "a", encoding="utf-8") as out:
            while not stop.event.is_set():
                for stream, batch in consumer.published():
                    for rec in consumer.records(stream, batch):
                        line: dict[str, Any] = {"stream": stream, "batch": batch}
                        _text("value", rec.value, line)
                        _text("key", rec.key, line)
                        if rec.headers:
                            line["headers"] = rec.headers
                        out.write(json.dumps(line, sort_keys=True) + "\n")
                        written += 1
                    out.flush()
                    os.fsync(out.fileno())
                    consumer.ack(stream, batch)
                    batches += 1
                if args.count is not None and written >= args.count:
                    break
                if args.timeout is not None and time.monotonic() - started >= args.timeout:
                    timed_out = True
                    break
                stop.event.wait(0.1)
    finally:
        flows = consumer.server.stats["flows"]
        consumer.close()
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "command": "consume",
                    "records": written,
                    "batches": batches,
                    "out": args.out,
                    "endpoint": consumer.endpoint,
                    "socket": mode,
                    "flows": flows,
                },
                sort_keys=True,
            )
        )
    if timed_out and args.count is not None and written < args.count:
        print(
            f"published {written} of --count {args.count} records within --timeout "
            f"{args.timeout:g} s ({flows} flows opened)",
            file=sys.stderr,
        )
        if flows == 0:
            print(
                "no giver opened a flow; "
                + silent_peer_hint(consumer.endpoint, PortKind.SERVER, mode),
                file=sys.stderr,
            )
        return EXIT_CHECK_FAILED
    if timed_out and flows == 0:
        print(
            f"no giver opened a flow at {consumer.endpoint} within --timeout "
            f"{args.timeout:g} s; " + silent_peer_hint(consumer.endpoint, PortKind.SERVER, mode),
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    if timed_out and written == 0:
        print(
            f"{flows} flows opened at {consumer.endpoint} but nothing was published within "
            f"--timeout {args.timeout:g} s: no batch was committed (a writer that stages and "
            "never commits, or a query still starting); wait longer with a larger --timeout",
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    print(
        f"published {written} records in {batches} batches to {args.out} ({flows} flows)",
        file=sys.stderr,
    )
    return EXIT_OK
