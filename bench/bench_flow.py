"""Flow throughput against raw pyzmq, measured in the same run (not a test).

Cases (each in two processes over loopback tcp, or ipc):

- ``raw``: the anchor. A DEALER sends the very frames a ZIO DAT has (empty delimiter,
  prefix, coord, payload), a ROUTER receives them with ``recv_multipart``; no flow control.
- ``flow1``: one record per DAT through our stack: a client giver (``FlowEndpoint.put``)
  and a server taker (``ServerPort.recv`` + ``Flow.receive`` + PAY), at credit window W.
- ``batched``: 1000 records per DAT packed as Arrow (``zio_spark.records``), window W;
  compared in bytes/s with raw PUSH/PULL of the same payload bytes.

Run: ``.venv/bin/python bench/bench_flow.py [--quick]``; prints a table and writes JSON
next to it (``bench/results/flow.json``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import zmq

RECORD = b"x" * 100


def _endpoint(transport: str) -> str:
    if transport == "ipc":
        return f"ipc://{tempfile.mktemp(prefix='zio-bench-')}"
    return "tcp://127.0.0.1:*"


# -- raw anchors -------------------------------------------------------------------------


def _raw_sender(ep: str, n: int, frames: list[bytes], kind: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(kind)
    s.sndhwm = 100_000
    s.connect(ep)
    for _ in range(n):
        s.send_multipart(frames, copy=True)
    s.send_multipart([b"END"])
    s.close(linger=5000)
    ctx.term()


def raw(transport: str, n: int, frames: list[bytes], push: bool = False) -> float:
    ctx = zmq.Context()
    r = ctx.socket(zmq.PULL if push else zmq.ROUTER)
    r.rcvhwm = 100_000
    r.bind(_endpoint(transport))
    ep = r.getsockopt_string(zmq.LAST_ENDPOINT)
    p = mp.get_context("spawn").Process(
        target=_raw_sender, args=(ep, n, frames, zmq.PUSH if push else zmq.DEALER)
    )
    p.start()
    got = 0
    t0 = None
    while True:
        parts = r.recv_multipart()
        if t0 is None:
            t0 = time.perf_counter()
        if parts[-1] == b"END":
            break
        got += 1
    dt = time.perf_counter() - t0
    p.join(30)
    r.close(0)
    ctx.term()
    return got / dt


def _cs_sender(ep: str, n: int, frame: bytes) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.CLIENT)
    s.sndhwm = 100_000
    s.connect(ep)
    for _ in range(n):
        s.send(frame)
    s.send(b"END")
    s.close(linger=5000)
    ctx.term()


def raw_cs(transport: str, n: int, frame: bytes) -> float:
    """Anchor for the draft path: CLIENT -> SERVER, one single-frame DAT per message."""
    ctx = zmq.Context()
    r = ctx.socket(zmq.SERVER)
    r.rcvhwm = 100_000
    r.bind(_endpoint(transport))
    ep = r.getsockopt_string(zmq.LAST_ENDPOINT)
    p = mp.get_context("spawn").Process(target=_cs_sender, args=(ep, n, frame))
    p.start()
    got = 0
    t0 = None
    while True:
        data = r.recv()
        if t0 is None:
            t0 = time.perf_counter()
        if data == b"END":
            break
        got += 1
    dt = time.perf_counter() - t0
    p.join(30)
    r.close(0)
    ctx.term()
    return got / dt


# -- our flows ------------------------------------------------------------------------------


def _flow_sender(ep: str, n: int, window: int, batch: int, mode: str = "routerdealer") -> None:
    from zio_spark.protocol.flow import Direction, Role
    from zio_spark.records import encode_records
    from zio_spark.transport.flow import FlowEndpoint
    from zio_spark.transport.port import ClientPort

    ctx = zmq.Context()
    port = ClientPort(ctx, mode=mode, linger_ms=5000, sndhwm=100_000)
    port.connect(ep)
    fe = FlowEndpoint(port, Role.CLIENT)
    fe.connect(Direction.EXTRACT, window, timeout=30)
    payload = (encode_records(1, [RECORD] * batch),) if batch > 1 else (RECORD,)
    for _ in range(n // batch):
        fe.put(payload, timeout=30)
    fe.send_eot(timeout=30)
    port.close()
    ctx.term()


def flow(transport: str, n: int, window: int, batch: int, mode: str = "routerdealer") -> float:
    from zio_spark.protocol.flow import BotReceived, Data, EotReceived, Flow, Role
    from zio_spark.records import decode_batch
    from zio_spark.transport.port import ServerPort

    ctx = zmq.Context()
    port = ServerPort(ctx, mode=mode, linger_ms=0, rcvhwm=100_000, sndhwm=100_000)
    ep = port.bind(_endpoint(transport))
    p = mp.get_context("spawn").Process(target=_flow_sender, args=(ep, n, window, batch, mode))
    p.start()
    f = Flow(Role.SERVER)
    records = 0
    t0 = None
    unpaid = 0
    while True:
        got = port.recv(30_000)
        assert got is not None and not hasattr(got, "error"), got
        peer, msg = got
        ev = f.receive(msg)
        if isinstance(ev, BotReceived):
            port.send(f.accept(), peer)
            port.send(f.pay(), peer)
            t0 = time.perf_counter()
        elif isinstance(ev, Data):
            records += decode_batch(msg.payload[0]).num_rows if batch > 1 else 1
            unpaid += 1
            if unpaid * 2 >= window:  # return credit in chunks, as the receiver does
                port.send(f.pay(unpaid), peer)
                unpaid = 0
        elif isinstance(ev, EotReceived):
            port.send(f.send_eot(), peer)
            break
    dt = time.perf_counter() - t0
    p.join(30)
    port.close()
    ctx.term()
    return records / dt


def median_of(runs: int, fn, *args, scale: float = 1.0, **kw):
    xs = [fn(*args, **kw) * scale for _ in range(runs)]
    return statistics.median(xs), min(xs), max(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument(
        "--mode",
        choices=("routerdealer", "clientserver"),
        default="routerdealer",
        help="clientserver needs a draft pyzmq (.venv-draft)",
    )
    a = ap.parse_args()
    runs = 1 if a.quick else 3
    n1 = 50_000 if a.quick else 200_000
    nb = 200_000 if a.quick else 2_000_000
    from zio_spark.protocol.message import Message, encode_frames, encode_single
    from zio_spark.records import encode_records

    dat = [b"", *encode_frames(Message("FLOW", '{"flow": "DAT"}', payload=(RECORD,)))]
    block = encode_records(1, [RECORD] * 1000)
    results = []
    raw_name = "CLIENT->SERVER" if a.mode == "clientserver" else "DEALER->ROUTER"
    for transport in ("tcp", "ipc"):
        if a.mode == "clientserver":
            single = encode_single(Message("FLOW", '{"flow": "DAT"}', payload=(RECORD,)))
            anchor = median_of(runs, raw_cs, transport, n1, single)
        else:
            anchor = median_of(runs, raw, transport, n1, dat)
        results.append(
            {
                "case": f"raw {raw_name} (DAT)",
                "transport": transport,
                "window": None,
                "records_per_s": anchor,
            }
        )
        for window in (1, 10, 100, 1000) if not a.quick else (10, 1000):
            nn = n1 if window >= 100 else n1 // 10
            r = median_of(runs, flow, transport, nn, window, 1, a.mode)
            results.append(
                {
                    "case": "flow, 1 record/DAT",
                    "transport": transport,
                    "window": window,
                    "records_per_s": r,
                    "vs_anchor": r[0] / anchor[0],
                }
            )
        push = median_of(runs, raw, transport, nb // 1000, [block], push=True, scale=1000)
        results.append(
            {
                "case": "raw PUSH/PULL (same bytes)",
                "transport": transport,
                "window": None,
                "records_per_s": push,
            }
        )
        for window in (10, 100):
            r = median_of(runs, flow, transport, nb, window, 1000, a.mode)
            results.append(
                {
                    "case": "flow, 1000 records/DAT (Arrow)",
                    "transport": transport,
                    "window": window,
                    "records_per_s": r,
                    "vs_anchor": r[0] / push[0],
                }
            )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"flow-{a.mode}.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("| case | transport | window | records/s (median, min-max) | vs anchor |")
    print("|---|---|---|---|---|")
    for r in results:
        med, lo, hi = r["records_per_s"]
        ratio = f"{r['vs_anchor']:.2f}x" if "vs_anchor" in r else "anchor"
        print(
            f"| {r['case']} | {r['transport']} | {r['window'] or ''} | "
            f"{med:,.0f} ({lo:,.0f}-{hi:,.0f}) | {ratio} |"
        )


if __name__ == "__main__":
    main()
