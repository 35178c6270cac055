"""Commit-to-ack latency of the source's receiver, on loopback (no Spark).

A :class:`~zio_spark.source.producer.Producer` binds on 127.0.0.1 and a
:class:`~zio_spark.source.receiver.Receiver` connects to it. Per round: the producer
sends one record, the receiver stores it, the spool is sealed, then the clock starts,
``receiver.commit(ends)`` is called, and the clock stops when the producer sees the ack
(``Producer.acked``). The wait is a spin with 50 us naps: its resolution is well below
the effect measured (a receiver loop polling every 50 ms).

Prints median, p95 and max in milliseconds; ``--json FILE`` also writes them.
Run: ``.venv/bin/python bench/bench_commit_ack.py [-n 200]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from zio_spark.source.producer import Producer
from zio_spark.source.receiver import Receiver
from zio_spark.storage.spool import Spool


def _spin(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.00005)


def run(n: int) -> list[float]:
    """``n`` commit-to-ack latencies in seconds."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    out: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(Path(tmp) / "spool", sync=False)
        prod = Producer(bind="tcp://127.0.0.1:*", producer_id="p", ctx=ctx, linger_ms=0)
        recv = Receiver(spool, [prod.endpoint], ctx=ctx).start()
        try:
            for seq in range(1, n + 11):
                prod.send(b"v%d" % seq)
                _spin(lambda s=seq: spool.next_seq("p") > s, "record stored")
                ends = spool.seal()
                t0 = time.perf_counter()
                recv.commit(ends)
                _spin(lambda s=seq: prod.acked >= s, "ack")
                if seq > 10:  # the first rounds warm up the flow
                    out.append(time.perf_counter() - t0)
        finally:
            recv.stop()
            prod.close(flush=False, timeout=5)
            spool.close()
            ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    lat = sorted(run(args.n))
    ms = {
        "n": len(lat),
        "median_ms": statistics.median(lat) * 1000,
        "p95_ms": lat[int(0.95 * (len(lat) - 1))] * 1000,
        "max_ms": lat[-1] * 1000,
    }
    print(
        f"commit->ack over {ms['n']} rounds: median {ms['median_ms']:.2f} ms, "
        f"p95 {ms['p95_ms']:.2f} ms, max {ms['max_ms']:.2f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(ms, indent=2) + "\n")


if __name__ == "__main__":
    main()
