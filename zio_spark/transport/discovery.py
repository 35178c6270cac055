"""ZRE discovery for ZIO flows: advertise a port, or follow the ports of a group.

A producer (or consumer) joins a ZRE group and advertises its flow port in the headers
``zio.port.<name>.address`` / ``.socket`` (specs/zio-wire.md, "Discovery convention").
A :class:`GroupWatcher` follows a group and tells a callback which flow endpoints appeared
and which left, with the socket mode each needs (from the advertised socket type, never
a guess: see :func:`~zio_spark.transport.port.choose_mode`).

Cloud networks usually block UDP broadcast: there, use explicit endpoints instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from zio_spark.transport.port import choose_mode
from zio_spark.transport.zre_node import ZreNode

__all__ = ["FLOW_PORT", "GroupWatcher", "advertise"]

log = logging.getLogger("zio_spark.transport")

FLOW_PORT = "flow"
_CLIENT_SOCKETS = frozenset({"CLIENT", "DEALER"})


def _connectable(endpoint: str, host: str) -> str:
    """``tcp://0.0.0.0:5555`` or ``tcp://*:5555`` is not an address peers can use."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint


def advertise(
    group: str,
    endpoint: str,
    socket_type: str,
    *,
    name: str | None = None,
    port_name: str = FLOW_PORT,
    beacon_port: int = 5670,
    broadcast: str | None = None,
    interface_addr: str | None = None,
    interval: float = 1.0,
) -> ZreNode:
    """Start a ZRE node in ``group`` advertising ``endpoint``; the caller stops it.

    Raises
    ------
    ConfigError, TransportError
        As :class:`~zio_spark.transport.zre_node.ZreNode`.
    """
    node = ZreNode(
        name,
        beacon_port=beacon_port,
        broadcast=broadcast,
        interface_addr=interface_addr,
        interval=interval,
    )
    node.advertise_port(port_name, _connectable(endpoint, node.interface_addr), socket_type)
    node.join(group)
    node.start()
    return node


class GroupWatcher:
    """Follow the flow ports advertised in ``group``.

    ``on_add(endpoint, mode)`` and ``on_remove(endpoint)`` run in the watcher's thread.
    ``port_name`` narrows it to ports of that name (``zio.port.<name>.*``); None follows
    every port a member advertises. Ports that are flow *clients* (a ``CLIENT`` or
    ``DEALER`` socket: nothing to connect to) are not followed, and the log says so once.
    """

    def __init__(
        self,
        group: str,
        on_add: Callable[[str, str], None],
        on_remove: Callable[[str], None],
        *,
        requested_mode: str | None = None,
        port_name: str | None = FLOW_PORT,
        beacon_port: int = 5670,
        broadcast: str | None = None,
        interface_addr: str | None = None,
        interval: float = 1.0,
        poll: float = 0.2,
    ) -> None:
        self.group = group
        self.on_add = on_add
        self.on_remove = on_remove
        self.requested_mode = requested_mode
        self.port_name = port_name
        self.poll = poll
        self.node = ZreNode(
            beacon_port=beacon_port,
            broadcast=broadcast,
            interface_addr=interface_addr,
            interval=interval,
        )
        self.node.join(group)
        self.known: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zio-discovery", daemon=True)

    def start(self) -> GroupWatcher:
        self.node.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.node.stop()

    def sync(self) -> None:
        """Compare the group's advertised ports with what we follow; report changes."""
        seen: dict[str, str] = {}
        for ep in self.node.zio_endpoints(self.group, port=self.port_name):
            seen[ep.address] = ep.socket
        for address, socket_type in seen.items():
            if address in self.known or address in self.refused:
                continue
            if str(socket_type).strip().upper() in _CLIENT_SOCKETS:
                why = (
                    f"a {socket_type} port is a flow client: nothing listens there to connect "
                    "to (a giver client connects to a source that binds: option 'bind')"
                )
                self.refused[address] = why
                log.warning("discovery: not following %s: %s", address, why)
                continue
            try:
                mode = choose_mode(self.requested_mode, socket_type, option="socket").value
            except Exception as e:  # a peer we can never talk to: say why, once
                self.refused[address] = str(e)
                log.warning("discovery: not following %s (%s): %s", address, socket_type, e)
                continue
            self.known[address] = mode
            self.on_add(address, mode)
        for address in list(self.known):
            if address not in seen:
                del self.known[address]
                self.on_remove(address)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.sync()
            except Exception:
                log.exception("discovery: sync failed")
