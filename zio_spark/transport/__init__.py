"""Transport: pyzmq sockets (and later UDP) under ZIO flows, PZQ and ZRE.

Depends on :mod:`zio_spark.protocol` for the codecs; nothing here is imported by it.
Importing this package opens no socket: sockets exist only inside port objects.

- :mod:`.wire` -- the framing of each socket type (SERVER, CLIENT, ROUTER, DEALER) and
  the choice of wire mode;
- :mod:`.port` -- server and client ports (a role holding a wire), with timeouts,
  bad-message accounting and optional CURVE security;
- :mod:`.curve` -- CURVE keys, socket setup and the ZAP authenticator;
- :mod:`.loop` -- the :class:`~.loop.Waker` every poll loop wakes up with, and
  :class:`~.loop.Loop`, one poll loop driving many parts (flow servers and clients);
- :mod:`.flow_server` -- many flows as a server, one handler each (own thread or inline);
- :mod:`.flow_client` -- one reconnecting flow as a client, served by a handler (own
  thread or inline);
- :mod:`.flow_endpoint` -- one flow as a blocking endpoint (a Spark task's);
- :mod:`.giver` -- the ack-capable giver, a handler for either engine;
- :mod:`.zre_node` (with :mod:`.zre_io`), :mod:`.discovery` -- ZRE discovery.

The names below are the port API, re-exported (``X as X``) so they are listed once.
"""

from __future__ import annotations

from zio_spark.transport.curve import CurveAuthenticator as CurveAuthenticator
from zio_spark.transport.curve import start_authenticator as start_authenticator
from zio_spark.transport.port import BadMessage as BadMessage
from zio_spark.transport.port import ClientPort as ClientPort
from zio_spark.transport.port import ServerPort as ServerPort
from zio_spark.transport.port import UnknownPeerError as UnknownPeerError
from zio_spark.transport.wire import PeerId as PeerId
from zio_spark.transport.wire import PortKind as PortKind
from zio_spark.transport.wire import SocketMode as SocketMode
from zio_spark.transport.wire import choose_mode as choose_mode
from zio_spark.transport.wire import drafts_available as drafts_available
from zio_spark.transport.wire import socket_type_name as socket_type_name
