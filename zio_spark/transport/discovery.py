"""ZRE discovery for ZIO flows: advertise a port, or follow the ports of a group.

A producer (or consumer) joins a ZRE group and advertises its flow port in the headers
``zio.port.<name>.address`` / ``.socket`` (specs/zio-wire.md, "Discovery convention").
A :class:`GroupWatcher` follows a group and tells a callback which flow endpoints appeared
and which left, with the socket mode each needs (from the advertised socket type, never
a guess: see :func:`~zio_spark.transport.port.choose_mode`). :func:`resolve_targets`
lists a group's flow ports once (the sink's driver, which spreads a batch over them),
through a :class:`NodeCache` that keeps one running node per group and ZRE settings.
All of them take the group and its settings as one :class:`~zio_spark.options.ZreOptions`;
:func:`zre_options` makes one from what a user-facing ``advertise`` takes.

Cloud networks usually block UDP broadcast: there, use explicit endpoints instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from zio_spark.errors import ConfigError, TransportError, ZioSparkError
from zio_spark.options import ZreOptions
from zio_spark.transport.port import choose_mode
from zio_spark.transport.zre_node import ZreNode

__all__ = [
    "FLOW_PORT",
    "GroupWatcher",
    "NodeCache",
    "Target",
    "advertise",
    "resolve_targets",
    "zre_options",
]

log = logging.getLogger("zio_spark.transport")

FLOW_PORT = "flow"
_CLIENT_SOCKETS = frozenset({"CLIENT", "DEALER"})


def _connectable(endpoint: str, host: str) -> str:
    """``tcp://0.0.0.0:5555`` or ``tcp://*:5555`` is not an address peers can use."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint


def zre_options(
    group: str | ZreOptions,
    *,
    beacon_port: int | None = None,
    broadcast: str | None = None,
    interface: str | None = None,
    interval: float | None = None,
    interface_option: str = "interface",
) -> ZreOptions:
    """The :class:`~zio_spark.options.ZreOptions` of a user-facing ``advertise(group,
    ...)`` (``Producer``'s, ``Consumer``'s): ``group`` itself, or a group name with the
    settings given as keywords (those not given: ``ZreOptions``' defaults).

    Raises
    ------
    ConfigError
        A settings keyword beside a ``ZreOptions``, named as the caller's keyword
        (``interface_option`` for ``interface``).
    """
    given = {
        k: v
        for k, v in (
            ("beacon_port", beacon_port),
            ("broadcast", broadcast),
            (interface_option, interface),
            ("interval", interval),
        )
        if v is not None
    }
    if isinstance(group, ZreOptions):
        if given:
            key = next(iter(given))
            raise ConfigError(key, given[key], "no ZRE keyword beside a ZreOptions")
        return group
    base = ZreOptions(group)  # its defaults, written once there
    return ZreOptions(
        group,
        beacon_port=base.beacon_port if beacon_port is None else beacon_port,
        broadcast=broadcast,
        interface=interface,
        interval=base.interval if interval is None else interval,
    )


def _node(zre: ZreOptions, name: str | None) -> ZreNode:
    """A (not started) node in ``zre.group``, with ``zre``'s settings."""
    node = ZreNode(name, zre=zre)
    node.join(zre.group)  # a no-op once joined; refuses an empty group (LocalProtocolError)
    return node


def advertise(
    zre: ZreOptions,
    endpoint: str,
    socket_type: str,
    *,
    name: str | None = None,
    port_name: str = FLOW_PORT,
) -> ZreNode:
    """Start a ZRE node in ``zre.group`` (with ``zre``'s settings) advertising
    ``endpoint``; the caller stops it.

    Raises
    ------
    ConfigError, TransportError
        As :class:`~zio_spark.transport.zre_node.ZreNode`.
    LocalProtocolError
        If the group or a name is not a valid ZRE name.
    """
    node = _node(zre, name)
    node.advertise_port(port_name, _connectable(endpoint, node.interface_addr), socket_type)
    node.start()
    return node


class GroupWatcher:
    """Follow the flow ports advertised in ``zre.group`` (with ``zre``'s settings).

    ``on_add(endpoint, mode)`` and ``on_remove(endpoint)`` run in the watcher's thread.
    ``port_name`` narrows it to ports of that name (``zio.port.<name>.*``); None follows
    every port a member advertises. Ports that are flow *clients* (a ``CLIENT`` or
    ``DEALER`` socket: nothing to connect to) are not followed, and the log says so once.
    """

    def __init__(
        self,
        zre: ZreOptions,
        on_add: Callable[[str, str], None],
        on_remove: Callable[[str], None],
        *,
        requested_mode: str | None = None,
        port_name: str | None = FLOW_PORT,
        poll: float = 0.2,
    ) -> None:
        self.on_add = on_add
        self.on_remove = on_remove
        self.requested_mode = requested_mode
        self.port_name = port_name
        self.poll = poll
        self.node, self.group = _node(zre, None), zre.group
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


Target = tuple[str, str | None]
"""(consumer endpoint, socket mode; None: the configured ``socket`` option)."""


class NodeCache:
    """Running ZRE nodes shared by one process's callers of :func:`resolve_targets`: one
    per (group, beacon port, broadcast, interface), started on first use; the beacon
    interval of the first caller wins. A node that stopped is replaced."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[str, int, str | None, str | None], ZreNode] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)

    def node(self, zre: ZreOptions) -> tuple[ZreNode, bool]:
        """The running node of ``zre``'s group and settings: (node, freshly started)."""
        key = (zre.group, zre.beacon_port, zre.broadcast, zre.interface)
        with self._lock:
            node = self._nodes.get(key)
            if node is not None and node.running:
                return node, False
            node = ZreNode(zre=zre)
            node.start()
            self._nodes[key] = node
            return node, True

    def stop(self) -> None:
        """Stop every node (best effort: a node that does not stop is logged)."""
        with self._lock:
            nodes = list(self._nodes.values())
            self._nodes.clear()
        for node in nodes:
            try:
                node.stop(timeout=1.0)
            except Exception:  # pragma: no cover - best effort at interpreter exit
                log.debug("discovery: stopping a ZRE node failed", exc_info=True)


def resolve_targets(
    nodes: NodeCache,
    zre: ZreOptions,
    *,
    requested_mode: str | None,
    timeout: float,
    port_name: str = FLOW_PORT,
    poll: float = 0.05,
) -> tuple[Target, ...]:
    """The ``port_name`` ports advertised in ``zre.group``, sorted by endpoint, each with
    the socket mode its advertised socket type needs (with ``requested_mode``).

    Waits up to ``timeout`` s for at least one. A freshly started node first listens for
    two beacon intervals, so the list is not just whichever member answered first.

    Raises
    ------
    TransportError
        No usable port is advertised within ``timeout`` (the message names the group,
        the beacon port, and each port refused for its socket type).
    """
    node, fresh = nodes.node(zre)
    start = time.monotonic()
    deadline = start + timeout
    settle = start + 2 * zre.interval if fresh else start
    refused: dict[str, str] = {}
    while True:
        found: dict[str, str | None] = {}
        for ep in node.zio_endpoints(zre.group, port=port_name):
            try:
                found[ep.address] = choose_mode(requested_mode, ep.socket, option="socket").value
            except ZioSparkError as e:
                if ep.address not in refused:
                    log.warning("discovery: not sending to %s (%s): %s", ep.address, ep.socket, e)
                refused[ep.address] = str(e)
        now = time.monotonic()
        if (found and now >= settle) or now >= deadline:
            break
        time.sleep(min(poll, max(0.0, deadline - now)))  # polls the node's peer table
    if not found:
        why = "".join(f"; refused {a}: {r}" for a, r in sorted(refused.items()))
        raise TransportError(
            f"no consumer advertised a {port_name!r} port in ZRE group {zre.group!r} "
            f"(beacon port {zre.beacon_port}) within {timeout:g} s{why}"
        )
    return tuple(sorted(found.items()))
