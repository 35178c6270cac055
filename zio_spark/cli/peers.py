"""``zio-spark peers --group G``: a live view of a ZRE group's peers and their ZIO ports."""

from __future__ import annotations

import argparse
import json
import sys
import time

from zio_spark.options import ZreOptions
from zio_spark.protocol.zio_ports import advertised_ports
from zio_spark.transport.zre_node import ZreNode

__all__ = ["run_peers"]


def snapshot(node: ZreNode, group: str) -> list[dict[str, object]]:
    """Peers of ``group`` with their advertised ZIO ports, sorted by name."""
    rows: list[dict[str, object]] = []
    for peer in node.peers_in_group(group):
        try:
            ports = {
                name: {"address": p.address, "socket": p.socket}
                for name, p in advertised_ports(peer.headers).items()
            }
        except Exception as e:  # a half-advertised port: show the error, not hide the peer
            ports = {"error": {"address": str(e), "socket": ""}}
        rows.append(
            {"uuid": str(peer.uuid), "name": peer.name, "endpoint": peer.endpoint, "ports": ports}
        )
    return sorted(rows, key=lambda r: (str(r["name"]), str(r["uuid"])))


def run_peers(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    zre = ZreOptions(
        group=args.group,
        beacon_port=args.beacon_port,
        broadcast=args.broadcast,
        interface=args.interface_addr,
    )
    node = ZreNode(zre=zre)  # joins the group
    node.join(zre.group)  # a no-op once joined; refuses an empty group (LocalProtocolError)
    node.start()
    console = Console(stderr=True)

    def table(rows: list[dict[str, object]]) -> Table:
        t = Table(title=f"ZRE group {args.group!r}")
        for col in ("name", "uuid", "mailbox", "ZIO ports"):
            t.add_column(col)
        for r in rows:
            ports = r["ports"]
            assert isinstance(ports, dict)
            text = "\n".join(f"{k}: {v['address']} ({v['socket']})" for k, v in ports.items())
            t.add_row(str(r["name"]), str(r["uuid"])[:8], str(r["endpoint"]), text or "-")
        return t

    rows: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + args.timeout
        with Live(
            table(rows),
            console=console,
            refresh_per_second=4,
            transient=args.json or not sys.stderr.isatty(),
        ) as live:
            while time.monotonic() < deadline:
                rows = snapshot(node, args.group)
                live.update(table(rows))
                time.sleep(0.25)
    finally:
        node.stop()
    if args.json:
        print(json.dumps({"command": "peers", "group": args.group, "peers": rows}, sort_keys=True))
    return 0
