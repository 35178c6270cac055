"""Flow throughput against raw pyzmq, measured in the same run (not a test).

Cases (each in two processes over loopback tcp, or ipc):

- ``raw``: the anchor. A DEALER sends the very frames a ZIO DAT has (empty delimiter,
  prefix, coord, payload), a ROUTER receives them with ``recv_multipart``; no flow control.
- ``flow1``: one record per DAT through our stack: a client giver (``FlowEndpoint.put``)
  and a server taker (``ServerPort.recv`` + ``Flow.receive`` + PAY), at credit window W.
- ``batched``: 1000 records per DAT packed as Arrow (``zio_spark.codec.records``), window W;
  compared in bytes/s with raw PUSH/PULL of the same payload bytes. The taker counts
  records (batch size x DATs, the first batch decoded as a check) rather than decoding
  every batch, as the anchor does not decode either: this measures the flow.

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
#
# Every case returns (records/s, sender CPU µs per message, receiver CPU µs per message).
# CPU is the sending or receiving Python thread's own time (time.thread_time; libzmq's I/O
# threads excluded): unlike wall-clock rates it barely moves when other work shares the
# machine, so it shows where the cost is even on a busy host.


def _report_cpu(cpu_q, t0: float, n: int) -> None:
    cpu_q.put((time.thread_time() - t0) / max(n, 1) * 1e6)


def _raw_sender(ep: str, n: int, frames: list[bytes], kind: int, cpu_q) -> None:
    ctx = zmq.Context()
    s = ctx.socket(kind)
    s.sndhwm = 100_000
    s.connect(ep)
    t0 = time.thread_time()
    for _ in range(n):
        s.send_multipart(frames, copy=True)
    _report_cpu(cpu_q, t0, n)
    s.send_multipart([b"END"])
    s.close(linger=5000)
    ctx.term()


def _run_receiver(
    sender, args: tuple, recv_one, is_end, batched: bool = False
) -> tuple[float, float, float]:
    """Start ``sender(*args, cpu_q)`` in a process; receive until ``is_end``.

    ``recv_one`` returns one item, or with ``batched`` a list of them (the end, if there,
    last).
    """
    spawn = mp.get_context("spawn")
    cpu_q = spawn.SimpleQueue()
    p = spawn.Process(target=sender, args=(*args, cpu_q))
    p.start()
    got = 0
    t0 = c0 = None
    try:
        while True:
            item = recv_one()
            if t0 is None:
                t0, c0 = time.perf_counter(), time.thread_time()
            if batched:
                got += len(item)
                if item and is_end(item[-1]):
                    got -= 1
                    break
                continue
            if is_end(item):
                break
            got += 1
        dt = time.perf_counter() - t0
        cpu_recv = (time.thread_time() - c0) / max(got, 1) * 1e6
        p.join(60)
        cpu_send = cpu_q.get() if not cpu_q.empty() else float("nan")
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
    return got / dt, cpu_send, cpu_recv


def raw(transport: str, n: int, frames: list[bytes], push: bool = False):
    ctx = zmq.Context()
    r = ctx.socket(zmq.PULL if push else zmq.ROUTER)
    r.rcvhwm = 100_000
    r.bind(_endpoint(transport))
    ep = r.getsockopt_string(zmq.LAST_ENDPOINT)
    kind = zmq.PUSH if push else zmq.DEALER
    try:
        return _run_receiver(
            _raw_sender, (ep, n, frames, kind), r.recv_multipart, lambda m: m[-1] == b"END"
        )
    finally:
        r.close(0)
        ctx.term()


def _cs_sender(ep: str, n: int, frame: bytes, cpu_q) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.CLIENT)
    s.sndhwm = 100_000
    s.connect(ep)
    t0 = time.thread_time()
    for _ in range(n):
        s.send(frame)
    _report_cpu(cpu_q, t0, n)
    s.send(b"END")
    s.close(linger=5000)
    ctx.term()


def raw_cs(transport: str, n: int, frame: bytes):
    """Anchor for the draft path: CLIENT -> SERVER, one single-frame DAT per message."""
    ctx = zmq.Context()
    r = ctx.socket(zmq.SERVER)
    r.rcvhwm = 100_000
    r.bind(_endpoint(transport))
    ep = r.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv_one() -> bytes:
        f = r.recv(copy=False)
        f.routing_id  # noqa: B018 - a server needs it to reply; part of the cost
        return f.bytes

    try:
        return _run_receiver(_cs_sender, (ep, n, frame), recv_one, lambda m: m == b"END")
    finally:
        r.close(0)
        ctx.term()


# -- our flows ------------------------------------------------------------------------------


def _flow_sender(ep: str, n: int, window: int, batch: int, mode: str, many: bool, cpu_q) -> None:
    from zio_spark.codec.records import encode_records
    from zio_spark.protocol.flow import Direction, Role
    from zio_spark.transport.flow_endpoint import FlowEndpoint
    from zio_spark.transport.port import ClientPort

    ctx = zmq.Context()
    port = ClientPort(ctx, mode=mode, linger_ms=5000, sndhwm=100_000)
    port.connect(ep)
    fe = FlowEndpoint(port, Role.CLIENT)
    fe.connect(Direction.EXTRACT, window, timeout=30)
    payload = (encode_records(1, [RECORD] * batch),) if batch > 1 else (RECORD,)
    dats = n // batch
    t0 = time.thread_time()
    if many:  # put_many: credit spent and DATs queued a run at a time
        run = [payload] * 1000
        for start in range(0, dats, len(run)):
            fe.put_many(run[: dats - start], timeout=30)
    else:
        for _ in range(dats):
            fe.put(payload, timeout=30)
    _report_cpu(cpu_q, t0, dats)
    fe.send_eot(timeout=30)
    port.close()
    ctx.term()


def flow(
    transport: str, n: int, window: int, batch: int, mode: str = "routerdealer", many: bool = True
):
    """Our giver (``FlowEndpoint.put_many``, or ``put`` per DAT) to a taker
    (``ServerPort.recv_many``, or ``recv`` per message, + ``Flow``)."""
    from zio_spark.codec.records import decode_batch
    from zio_spark.protocol.flow import BotReceived, Data, EotReceived, Flow, Role
    from zio_spark.transport.port import ServerPort

    ctx = zmq.Context()
    port = ServerPort(ctx, mode=mode, linger_ms=0, rcvhwm=100_000, sndhwm=100_000)
    ep = port.bind(_endpoint(transport))
    f = Flow(Role.SERVER)
    state = {"unpaid": 0, "checked": batch == 1}
    # Batches of a quarter window: PAYs go back while the giver still has credit.
    most = max(1, window // 4) if many else 1

    def recv_some() -> list:
        # The handshake happens before the first DAT, so it is not timed.
        while True:
            if many:
                got = port.recv_many(most, 30_000)
            else:
                one = port.recv(30_000)
                got = [] if one is None else [one]
            assert got, "nothing for 30 s"
            events = []
            for item in got:
                assert type(item) is tuple, item  # not a BadMessage
                peer, msg = item
                ev = f.receive(msg)
                if type(ev) is Data:
                    events.append(ev)
                elif isinstance(ev, BotReceived):
                    port.send(f.accept(), peer)
                    port.send(f.pay(), peer)
                else:
                    assert isinstance(ev, EotReceived), ev
                    port.send(f.send_eot(), peer)
                    events.append(ev)
                    return events
            if not events:
                continue
            if not state["checked"]:  # the payload is what was sent (checked once)
                assert decode_batch(events[0].message.payload[0]).num_rows == batch
                state["checked"] = True
            state["unpaid"] += len(events)
            if state["unpaid"] * 2 >= window:  # credit back in chunks, as the receiver
                port.send(f.pay(state["unpaid"]), peer)
                state["unpaid"] = 0
            return events

    try:
        rate, cpu_s, cpu_r = _run_receiver(
            _flow_sender,
            (ep, n, window, batch, mode, many),
            recv_some,
            lambda ev: isinstance(ev, EotReceived),
            batched=True,
        )
    finally:
        port.close()
        ctx.term()
    # The taker counts records (batch x DATs) instead of decoding every batch: the anchor
    # does not decode either, so this measures the flow.
    return rate * batch, cpu_s, cpu_r


def _summary(outs: list, scale: float = 1.0) -> dict:
    """Median, min and max of the rate, plus median CPU µs/message."""
    xs = [o[0] * scale for o in outs]
    return {
        "rate": (statistics.median(xs), min(xs), max(xs)),
        "cpu_send_us": statistics.median(o[1] for o in outs),
        "cpu_recv_us": statistics.median(o[2] for o in outs),
    }


class Paired:
    """An anchor run right before each run of a case, ``runs`` times; the ratio is the
    median of the pairs' ratios (this machine's rates drift by 2-3x between minutes, an
    anchor taken once would carry that drift into every ratio)."""

    def __init__(self, runs: int, anchor, scale: float = 1.0) -> None:
        self.runs, self.anchor, self.scale = runs, anchor, scale
        self.outs: list = []

    def case(self, fn) -> dict:
        ratios, outs = [], []
        for _ in range(self.runs):
            a = self.anchor()
            self.outs.append(a)
            out = fn()
            outs.append(out)
            ratios.append(out[0] / (a[0] * self.scale))
        r = _summary(outs)
        r["vs_anchor"] = statistics.median(ratios)
        r["vs_anchor_range"] = (min(ratios), max(ratios))
        return r

    def result(self) -> dict:
        """The anchor over every run it made."""
        return _summary(self.outs, self.scale)


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
    from zio_spark.codec.records import encode_records
    from zio_spark.protocol.message import Message, encode_frames, encode_single

    dat = [b"", *encode_frames(Message("FLOW", '{"flow": "DAT"}', payload=(RECORD,)))]
    block = encode_records(1, [RECORD] * 1000)
    results = []
    raw_name = "CLIENT->SERVER" if a.mode == "clientserver" else "DEALER->ROUTER"
    for transport in ("tcp", "ipc"):
        if a.mode == "clientserver":
            single = encode_single(Message("FLOW", '{"flow": "DAT"}', payload=(RECORD,)))
            anchor = Paired(runs, lambda t=transport, f=single: raw_cs(t, n1, f))
        else:
            anchor = Paired(runs, lambda t=transport: raw(t, n1, dat))
        cases = []
        for window in (1, 10, 100, 1000) if not a.quick else (10, 1000):
            nn = n1 if window >= 100 else n1 // 10
            cases.append(
                (
                    "flow, 1 record/DAT",
                    window,
                    lambda t=transport, w=window, k=nn: flow(t, k, w, 1, a.mode),
                )
            )
        # The same at window 1000 through the one-message calls (put, recv).
        cases.append(
            (
                "flow, 1 record/DAT, put/recv per DAT",
                1000,
                lambda t=transport: flow(t, n1, 1000, 1, a.mode, many=False),
            )
        )
        rows = [(case, window, anchor.case(fn)) for case, window, fn in cases]
        results.append(
            {
                "case": f"raw {raw_name} (DAT)",
                "transport": transport,
                "window": None,
                **anchor.result(),
            }
        )
        results += [{"case": c, "transport": transport, "window": w, **r} for c, w, r in rows]

        push = Paired(runs, lambda t=transport: raw(t, nb // 1000, [block], push=True), scale=1000)
        # One call per DAT: with 100 KB DATs the batch calls save nothing measurable
        # (their batches hold more memory than the caches do).
        rows = [
            (
                window,
                push.case(lambda t=transport, w=window: flow(t, nb, w, 1000, a.mode, many=False)),
            )
            for window in ((1, 10, 100) if not a.quick else (10, 100))
        ]
        results.append(
            {
                "case": "raw PUSH/PULL (same bytes)",
                "transport": transport,
                "window": None,
                **push.result(),
            }
        )
        results += [
            {
                "case": "flow, 1000 records/DAT (Arrow), put/recv per DAT",
                "transport": transport,
                "window": w,
                **r,
            }
            for w, r in rows
        ]
    for r in results:  # the figure other tools plot (median, min, max)
        r["records_per_s"] = r.pop("rate")
        r["mode"] = a.mode
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"flow-{a.mode}.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"flow benchmark, {a.mode}, {runs} run(s) each; CPU = Python thread µs per message")
    print()
    print(
        "| case | transport | window | records/s (median, min-max) | vs anchor (paired runs) "
        "| CPU send | CPU recv |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        med, lo, hi = r["records_per_s"]
        if "vs_anchor" in r:
            lo_r, hi_r = r["vs_anchor_range"]
            ratio = f"{r['vs_anchor']:.2f}x ({lo_r:.2f}-{hi_r:.2f})"
        else:
            ratio = "anchor"
        print(
            f"| {r['case']} | {r['transport']} | {r['window'] or ''} | "
            f"{med:,.0f} ({lo:,.0f}-{hi:,.0f}) | {ratio} | "
            f"{r['cpu_send_us']:.2f} | {r['cpu_recv_us']:.2f} |"
        )


if __name__ == "__main__":
    main()
