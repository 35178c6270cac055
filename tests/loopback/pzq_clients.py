"""Stand-ins for the reference PZQ's client library (mkoppanen/pzq, ``php-api/PZQClient.php``)
and its example programs, in Python, for tests.

They reproduce what the real clients do on the wire, quirks included, from two sources:
the client library's source (read in the reference repository) and the facts in
``specs/pzq-sockets-and-formats.txt`` (the daemon and its clients as run). Each class says
which facts it reproduces. What they add is only what a test needs: a receive timeout
(the PHP consumer blocks forever; a test must fail instead of hanging), and counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

Sock = zmq.Socket[bytes]


class PzqClientError(Exception):
    """What the PHP client throws (``PZQClientException``)."""


@dataclass
class PzqMessage:
    """``PZQMessage``: the fields the PHP consumer fills in from a delivery."""

    peer: bytes
    id: bytes
    sent: bytes
    ack_timeout: bytes
    message: list[bytes]


class PzqConsumer:
    """``PZQConsumer``, as the reference's clients behave.

    Reproduces:

    - A ROUTER socket (``ZMQ::SOCKET_XREP``) that only ``connect``\\ s to the send socket,
      with default options: no ``ZMQ_PROBE_ROUTER``, no routing id of its own, no
      ``ZMQ_ROUTER_HANDOVER``; libzmq's automatic reconnect is all it does after the
      queue goes away. It never sends anything before its first delivery (facts: "Real
      consumers ... never announce themselves and never set ZMQ_PROBE_ROUTER").
    - ``consume()`` reads one multipart message and takes ``parts[0]`` as the peer (the
      queue id), ``parts[1]`` the id, ``parts[2]`` the sent time, ``parts[3]`` the ack
      timeout and ``parts[5:]`` as the body: it assumes the delimiter is part 4, as the
      PHP code does (``array_slice($parts, 5)``).
    - ``filter_expired`` (on by default): a delivery whose age ``now - sent`` (float
      seconds, ``microtime(true)``) exceeds its ack timeout is skipped silently, neither
      acked nor nacked, and the next one is read.
    - ``ack()`` sends ``[peer, id, "1"]``; ``nack()`` ``[peer, id, "0"]`` (facts: consumer
      acks are ``[queue id, message id, "1"|"0"]``, as in the spec). Sends block, as
      ``sendMulti`` does; a ROUTER drops what it cannot route (the queue is gone).
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, *, filter_expired: bool = True):
        self.socket: Sock = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.filter_expired = filter_expired
        self.skipped_expired = 0

    def consume(self, timeout: float) -> PzqMessage | None:
        """The next unexpired delivery, or None if none comes within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                return None
            parts = self.socket.recv_multipart()
            message = PzqMessage(parts[0], parts[1], parts[2], parts[3], parts[5:])
            if self.filter_expired and self.is_expired(message):
                self.skipped_expired += 1
                continue
            return message

    @staticmethod
    def is_expired(message: PzqMessage) -> bool:
        sent = float(message.sent) / 1_000_000
        return time.time() - sent > float(message.ack_timeout) / 1_000_000

    def ack(self, message: PzqMessage) -> None:
        self.socket.send_multipart([message.peer, message.id, b"1"])

    def nack(self, message: PzqMessage) -> None:
        self.socket.send_multipart([message.peer, message.id, b"0"])

    def close(self) -> None:
        self.socket.close(linger=0)


class PzqProducer:
    """``PZQProducer``, as the reference's clients behave.

    Reproduces:

    - A DEALER socket (``ZMQ::SOCKET_XREQ``) that connects; its routing id is whatever
      the queue's ROUTER assigns (a new one on every connection).
    - ``produce()`` is synchronous: send ``[id, "", *body]``, poll for the ack up to
      ``timeout`` ms (default 5000), then read one reply. No ack in time raises
      ``ACK timeout``, and nothing is resent: retrying is the caller's business, and a
      late ack stays in the socket to be read by the next ``produce()`` (which then
      raises ``Got ACK for wrong message``), as in the PHP code.
    - The ack is read per the facts: ``[id, "1"|"0", "", reason]``; an id other than the
      one sent, or a status other than ``"1"``, raises.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.socket: Sock = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def produce(self, message_id: bytes, body: bytes | list[bytes], timeout: int = 5000) -> bool:
        out = [message_id, b""] + (list(body) if isinstance(body, list) else [body])
        self.socket.send_multipart(out)
        if not self.socket.poll(timeout):
            raise PzqClientError("ACK timeout")
        response = self.socket.recv_multipart()
        if response[0] != message_id:
            raise PzqClientError("Got ACK for wrong message")
        if response[1] != b"1":
            raise PzqClientError("Remote peer failed to handle message")
        return True

    def close(self) -> None:
        self.socket.close(linger=0)


def producer_example(ctx: zmq.Context[Any], endpoint: str, n: int = 10_000) -> int:
    """The reference's ``producer.php``: one run, a fresh producer, ids and bodies
    ``id-0``, ``id-1``, ... numbered afresh on every run. Returns the messages acked."""
    producer = PzqProducer(ctx, endpoint)
    try:
        for i in range(n):
            text = b"id-%d" % i
            producer.produce(text, text, 10_000)
        return n
    finally:
        producer.close()


class PzqMonitor:
    """``PZQMonitor``: a REQ socket sends ``MONITOR``; the one-part reply is exploded on
    newlines, empty lines dropped, each line split at ``": "`` (key, value)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.socket: Sock = ctx.socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def get_stats(self, timeout: float = 10.0) -> dict[str, str]:
        self.socket.send(b"MONITOR")
        if not self.socket.poll(int(timeout * 1000)):
            raise PzqClientError("no monitor reply")
        text = self.socket.recv().decode()
        data: dict[str, str] = {}
        for part in filter(None, text.split("\n")):
            key, _, value = part.partition(": ")
            data[key] = value
        return data

    def close(self) -> None:
        self.socket.close(linger=0)
