"""A ``group`` source follows every flow port its members advertise
(``zio.port.<name>.address`` / ``.socket``), not only ports named ``flow``; ``groupPort``
narrows it to one name; a port that is a flow client (CLIENT/DEALER) is not followed,
and the log says why. ZRE on loopback (127.255.255.255, random beacon port)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.support import wait_until
from zio_spark.errors import ConfigError, LocalProtocolError, TransportError
from zio_spark.options import ZreOptions
from zio_spark.transport.discovery import (
    GroupWatcher,
    NodeCache,
    advertise,
    resolve_targets,
    zre_options,
)
from zio_spark.transport.zre_node import ZreNode

BROADCAST = "127.255.255.255"


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def group() -> Iterator[tuple[str, int, list[ZreNode]]]:
    """Two members: a giver server on port ``out`` (ROUTER), a giver client on port
    ``flow`` (DEALER, nothing to connect to)."""
    beacon = _free_udp_port()
    zre = ZreOptions(
        "daq", beacon_port=beacon, broadcast=BROADCAST, interface="127.0.0.1", interval=0.1
    )
    nodes = [
        advertise(zre, "tcp://127.0.0.1:41111", "ROUTER", port_name="out"),
        advertise(zre, "tcp://127.0.0.1:42222", "DEALER"),
    ]
    yield "daq", beacon, nodes
    for n in nodes:
        n.stop()


def _watch(beacon: int, port_name: str | None, added: list, removed: list) -> GroupWatcher:
    return GroupWatcher(
        ZreOptions("daq", beacon_port=beacon, broadcast=BROADCAST, interface="127.0.0.1"),
        lambda ep, mode: added.append((ep, mode)),
        removed.append,
        port_name=port_name,
        poll=0.05,
    ).start()


def test_every_advertised_server_port_is_followed(group, caplog):
    _, beacon, _ = group
    added: list = []
    with caplog.at_level(logging.WARNING, logger="zio_spark.transport"):
        w = _watch(beacon, None, added, [])
        try:
            wait_until(
                lambda: added and "tcp://127.0.0.1:42222" in w.refused,
                what="both ports seen",
                timeout=15.0,
            )
        finally:
            w.stop()
    assert added == [("tcp://127.0.0.1:41111", "routerdealer")]  # port "out", not "flow"
    assert "flow client" in w.refused["tcp://127.0.0.1:42222"]
    assert "not following tcp://127.0.0.1:42222" in caplog.text and "bind" in caplog.text


def test_group_port_narrows_to_one_name(group):
    _, beacon, _ = group
    added: list = []
    w = _watch(beacon, "flow", added, [])
    try:
        wait_until(
            lambda: "tcp://127.0.0.1:42222" in w.refused, what="the 'flow' port seen", timeout=15.0
        )
        # The "out" port of the other member is there too, and stays unfollowed.
        wait_until(
            lambda: len(w.node.zio_endpoints("daq")) == 2, what="both members' ports", timeout=15.0
        )
        w.sync()
    finally:
        w.stop()
    assert added == []


def test_zre_options_of_a_user_facing_advertise():
    """A group name with settings keywords (the others: ZreOptions' defaults), or one
    ZreOptions and no keyword, the keyword named as the caller spells it."""
    assert zre_options("daq") == ZreOptions("daq")
    assert zre_options("daq", interface="127.0.0.1", interval=0.5) == ZreOptions(
        "daq", interface="127.0.0.1", interval=0.5
    )
    zre = ZreOptions("daq", beacon_port=5999)
    assert zre_options(zre) is zre
    with pytest.raises(ConfigError, match="interval"):
        zre_options(zre, interval=0.5)
    with pytest.raises(ConfigError) as e:
        zre_options(zre, interface="127.0.0.1", interface_option="interface_addr")
    assert e.value.option == "interface_addr"


def test_an_empty_group_is_refused_as_a_name():
    with pytest.raises(LocalProtocolError):
        advertise(ZreOptions(""), "tcp://127.0.0.1:41111", "ROUTER")


def test_resolve_targets_lists_the_flow_ports_sorted_through_one_cached_node(group):
    """The ``flow`` ports of the group (not ``out``), sorted, each with its mode; the
    cache keeps one running node per group and settings; a group with none fails naming
    the group."""
    _, beacon, _ = group
    nodes = NodeCache()
    zre = ZreOptions(
        "daq", beacon_port=beacon, broadcast=BROADCAST, interface="127.0.0.1", interval=0.1
    )
    server = advertise(zre, "tcp://127.0.0.1:43333", "ROUTER")
    want = (("tcp://127.0.0.1:42222", "routerdealer"), ("tcp://127.0.0.1:43333", "routerdealer"))
    try:
        wait_until(
            lambda: resolve_targets(nodes, zre, requested_mode=None, timeout=15.0) == want,
            what="both flow ports",
            timeout=15.0,
        )
        # Another interval is the same node (the first caller's interval wins).
        again = resolve_targets(nodes, replace(zre, interval=0.5), requested_mode=None, timeout=5)
        assert again == want and len(nodes) == 1
        other = replace(zre, group="nobody-home")
        with pytest.raises(TransportError, match=r"group 'nobody-home'.*within 0.3 s"):
            resolve_targets(nodes, other, requested_mode=None, timeout=0.3)
        assert len(nodes) == 2
    finally:
        server.stop()
        nodes.stop()
    assert len(nodes) == 0
