"""Transport: pyzmq sockets (and later UDP) under ZIO flows, PZQ and ZRE.

Depends on :mod:`zio_spark.protocol` for the codecs; nothing here is imported by it.
Importing this package opens no socket: sockets exist only inside port objects.

- :mod:`.port` -- server and client ports in the CLIENT/SERVER or ROUTER/DEALER wire
  mode, with timeouts, bad-message accounting and optional CURVE security.
"""

from __future__ import annotations

from zio_spark.transport.port import (
    BadMessage,
    ClientPort,
    CurveAuthenticator,
    PeerId,
    PortKind,
    ServerPort,
    SocketMode,
    UnknownPeerError,
    choose_mode,
    drafts_available,
    socket_type_name,
    start_authenticator,
)

__all__ = [
    "BadMessage",
    "ClientPort",
    "CurveAuthenticator",
    "PeerId",
    "PortKind",
    "ServerPort",
    "SocketMode",
    "UnknownPeerError",
    "choose_mode",
    "drafts_available",
    "socket_type_name",
    "start_authenticator",
]
