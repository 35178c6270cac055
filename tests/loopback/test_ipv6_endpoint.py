"""An endpoint the option parser accepts must work: ``tcp://[::1]:PORT`` (IPv6 loopback).

libzmq resolves an IPv6 address only on a socket with ``ZMQ_IPV6``; without it a connect
is accepted and then never made (silently), and a bind fails with "No such device". The
ports turn it on for a bracketed address.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from tests.support import free_endpoint
from zio_spark.options import parse_sink_options, parse_source_options
from zio_spark.protocol.message import Message
from zio_spark.transport.port import BadMessage, ClientPort, ServerPort

WAIT_MS = 5000


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_an_ipv6_endpoint_from_the_options_binds_and_connects(
    make_server: Callable[..., ServerPort], make_client: Callable[..., ClientPort]
) -> None:
    where = free_endpoint("::1")
    assert where.startswith("tcp://[::1]:")
    bound = parse_source_options({"bind": where}).bind[0]
    target = parse_sink_options({"endpoint": where}).endpoint
    assert bound == target == where
    server, client = make_server(), make_client()
    assert server.bind(bound) == where
    client.connect(target)
    sent = Message("LOG", "over IPv6", seqno=1)
    client.send(sent)
    got = server.recv(WAIT_MS)
    assert got is not None, "nothing arrived over [::1]"
    assert not isinstance(got, BadMessage), got
    peer, message = got
    assert message == sent
    server.send(Message("LOG", "and back", seqno=2), peer)
    back = client.recv(WAIT_MS)
    assert isinstance(back, Message) and back.label == "and back"
