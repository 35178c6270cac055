"""Child process for the ZRE tests that run inside a private network namespace.

Run as ``ip netns exec NS python zre_netns_child.py MODE ...``; never run it outside a
namespace made for it. It prints one JSON object per line on stdout (``{"t": seconds
since start, "ev": what, ...}``), ends with ``{"ev": "done", ...}`` and is bounded in time
by ``--deadline`` seconds. Modes:

``pair BROADCAST IFACE PORT``
    Two ZreNodes of ours discover each other, JOIN, WHISPER, SHOUT, then one stops.
``zio BROADCAST IFACE PORT``
    Our node's half of the pyre interop scenario (peer named ``pyre-peer``).
``pyre PORT``
    The pyre half (PyPI ``zeromq-pyre``): pyre picks its own interface and broadcast
    address, which is why this only ever runs inside a namespace.

The interop scenario, driven by events so that neither side sleeps: each side, on seeing
the other JOIN ``G``, whispers (two frames) and shouts to ``G``; our node, once it has
the pyre node's whisper and shout, LEAVEs ``G``; pyre answers by leaving too. Our node
runs with ``evasive_after`` shorter than pyre's beacon interval, so it PINGs pyre while
pyre is quiet; after pyre's LEAVE and at least one PING-OK from it, our node whispers
``bye``; pyre then stops (port-0 beacon) and our node sees EXIT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

T0 = time.monotonic()


def emit(ev: str, **fields: Any) -> None:
    print(json.dumps({"t": round(time.monotonic() - T0, 3), "ev": ev, **fields}), flush=True)


def text(frames: Any) -> list[str]:
    return [bytes(f).decode("utf-8", "replace") for f in frames or ()]


def run_pair(args: argparse.Namespace) -> None:
    from zio_spark.options import ZreOptions
    from zio_spark.transport.zre_node import ZreNode

    zre = ZreOptions("G", args.port, args.broadcast, args.iface, interval=0.1)
    a = ZreNode("ns-a", zre=zre, headers={"role": "a"}, linger_ms=0)
    b = ZreNode("ns-b", zre=zre, headers={"role": "b"}, linger_ms=0)
    for node in (a, b):
        node.start()
    emit("started", a=str(a.uuid), b=str(b.uuid), a_endpoint=a.endpoint, b_endpoint=b.endpoint)
    deadline = T0 + args.deadline
    pending = {"a-join": True, "b-join": True}
    sent = False
    b_stopped = False
    try:
        while time.monotonic() < deadline:
            for label, node in (("a", a), ("b", b)):
                e = node.next_event(0.02)
                if e is None:
                    continue
                fields: dict[str, Any] = {"node": label, "peer": str(e.peer), "name": e.name}
                if hasattr(e, "group"):
                    fields["group"] = e.group
                if hasattr(e, "content"):
                    fields["content"] = text(e.content)
                if hasattr(e, "headers"):
                    fields["headers"] = dict(e.headers)
                emit(e.kind.value, **fields)
                if e.kind.value == "JOIN":
                    pending.pop(f"{label}-join", None)
                if e.kind.value == "SHOUT" and label == "a":
                    b.stop()
                    b_stopped = True
                    emit("b-stopped")
                if e.kind.value == "EXIT" and label == "a":
                    emit("done", a_stats=a.stats)
                    return
            if not pending and not sent:
                a.whisper(b.uuid, b"ns-whisper")
                b.shout("G", b"ns-shout")
                sent = True
        emit("done", timeout=True, a_stats=a.stats)
    finally:
        a.stop()
        if not b_stopped:
            b.stop()


def run_zio(args: argparse.Namespace) -> None:
    from zio_spark.options import ZreOptions
    from zio_spark.transport.zre_node import ZreNode

    node = ZreNode(
        "zio-node",
        zre=ZreOptions("G", args.port, args.broadcast, args.iface, interval=0.25),
        headers={"X-Zio": "yes"},
        # Shorter than pyre's 1 s beacon interval, so PING / PING-OK cross the wire.
        evasive_after=0.4,
        expired_after=3.0,
        linger_ms=200,
    )
    node.start()
    emit("started", uuid=str(node.uuid), endpoint=node.endpoint)
    deadline = T0 + args.deadline
    pyre = None
    got: set[str] = set()
    sent = left = pyre_left = bye = False
    try:
        while time.monotonic() < deadline:
            e = node.next_event(0.05)
            if pyre_left and not bye and node.stats["ping_oks_received"] > 0:
                # pyre has answered at least one of our PINGs: the last step can go.
                assert pyre is not None
                emit("pong-seen", stats=node.stats)
                node.whisper(pyre, b"bye")
                bye = True
            if e is None:
                continue
            fields: dict[str, Any] = {"peer": str(e.peer), "name": e.name}
            for attr in ("group", "endpoint"):
                if hasattr(e, attr):
                    fields[attr] = getattr(e, attr)
            if hasattr(e, "content"):
                fields["content"] = text(e.content)
            if hasattr(e, "headers"):
                fields["headers"] = dict(e.headers)
            emit(e.kind.value, **fields)
            kind = e.kind.value
            if kind == "ENTER" and e.name == "pyre-peer":
                pyre = e.peer
            if pyre is None or e.peer != pyre:
                continue
            if kind == "JOIN" and e.group == "G" and not sent:
                node.whisper(pyre, b"whisper-from-zio", b"part-2")
                emit("shout-sent", reached=node.shout("G", b"shout-from-zio"))
                emit("pyre-in-group", members=[str(p.uuid) for p in node.peers_in_group("G")])
                sent = True
            if kind in ("WHISPER", "SHOUT"):
                got.add(kind)
            if sent and got == {"WHISPER", "SHOUT"} and not left:
                node.leave("G")
                left = True
            if kind == "LEAVE" and e.group == "G":
                pyre_left = True
            if kind == "EXIT":
                break
        emit("done", stats=node.stats, timeout=time.monotonic() >= deadline)
    finally:
        node.stop()


def run_pyre(args: argparse.Namespace) -> None:
    import pyre as pyre_pkg
    import zmq
    from pyre import Pyre
    from pyre.pyre_event import PyreEvent

    n = Pyre("pyre-peer")
    n.set_header("X-Pyre", "yes")
    n.set_port(str(args.port).encode())
    n.join("G")
    n.start()
    emit("started", uuid=str(n.uuid()), endpoint=n.endpoint(), version=pyre_pkg.__version__)
    poller = zmq.Poller()
    poller.register(n.socket(), zmq.POLLIN)
    deadline = T0 + args.deadline
    zio = None
    sent = False
    timed_out = True
    while time.monotonic() < deadline:
        if not poller.poll(100):
            continue
        e = PyreEvent(n)
        emit(
            e.type,
            peer=str(e.peer_uuid),
            name=e.peer_name,
            group=e.group,
            headers=e.headers,
            endpoint=e.peer_addr,
            content=text(e.msg),
        )
        if e.type == "ENTER" and e.peer_name == "zio-node":
            zio = e.peer_uuid
        if zio is None or e.peer_uuid != zio:
            continue
        if e.type == "JOIN" and e.group == "G" and not sent:
            n.whisper(zio, [b"whisper-from-pyre", b"part-2"])
            n.shout("G", b"shout-from-pyre")
            sent = True
        if e.type == "LEAVE" and e.group == "G":
            n.leave("G")
        if e.type == "WHISPER" and text(e.msg) == ["bye"]:
            timed_out = False
            break
    n.stop()
    emit("done", timeout=timed_out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deadline", type=float, default=15.0)
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("pair", "zio"):
        p = sub.add_parser(mode)
        p.add_argument("broadcast")
        p.add_argument("iface")
        p.add_argument("port", type=int)
    sub.add_parser("pyre").add_argument("port", type=int)
    args = parser.parse_args()
    try:
        {"pair": run_pair, "zio": run_zio, "pyre": run_pyre}[args.mode](args)
    except Exception as e:  # report, don't hang: the parent asserts on the JSON lines
        emit("error", error=repr(e))
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    # pyre's actor threads and contexts can hold interpreter exit; we are done.
    os._exit(0)


if __name__ == "__main__":
    main()
