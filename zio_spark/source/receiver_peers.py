"""The receiver's per-flow state: what it knows of each producer and each port.

:class:`Peer` is one flow the :class:`~zio_spark.source.receiver.Receiver` takes from
(a producer endpoint it connects to, or a giver client of its bound port),
:class:`Bound` the server port of ``bind``, :class:`Pending` what one drain took in for
a producer before it goes to the spool in one append, :class:`PeerStatus` what
:meth:`Receiver.status` reports. Plain data; the receiver thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import zmq

from zio_spark.protocol.flow import Flow
from zio_spark.protocol.negotiate import PLAIN, Terms
from zio_spark.storage.spool import Record
from zio_spark.transport.port import ClientPort, PeerId, ServerPort

if TYPE_CHECKING:
    from zio_spark.transport.flow_client import ClientFlow, FlowClient
    from zio_spark.transport.flow_server import FlowServer, ServerFlow

__all__ = ["DONE_KEPT", "Bound", "Peer", "PeerStatus", "Pending"]

# Client flows of a bound port that ended or failed, kept for status().
DONE_KEPT = 1000


@dataclass
class PeerStatus:
    """What the receiver knows about one producer endpoint (for progress and tests)."""

    endpoint: str
    producer: str | None = None
    state: str = "connecting"  # connecting | receiving | ended | failed | waiting
    ack_capable: bool = False
    encoding: str = "plain"
    records: int = 0
    duplicates: int = 0
    failures: int = 0
    last_error: str | None = None
    at_most_once: bool = False  # plain peer: records in flight before the spool may be lost
    # The producer said it has nothing more to send (``more: false`` in a DAT or its
    # BOT), and all it sent before is in the spool: no need to wait for quiet.
    idle: bool = False
    # The position its current flow's BOT stated (``last``: the last seq it had
    # assigned); None for a giver that states none (a plain giver).
    position: int | None = None
    flows: int = 0  # flows started (BOT exchanged) since the receiver started
    # Receiver clock when records last reached the spool from this flow (or it started).
    last_data: float = 0.0


@dataclass
class Pending:
    """What one drain took in for one producer, appended to the spool in one go when it
    ends (a spool append per DAT costs more than the DAT itself when DATs are small): WAL
    batches (Arrow givers) or records (plain givers), and the last seq among them. Kept
    per producer, not per flow: plain clients of a bound source that share an id feed
    one partition, numbered here in arrival order."""

    batches: list[pa.RecordBatch] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    last: int = 0
    bytes: int = 0
    dats: int = 0


@dataclass
class Bound:
    """The server port of ``bind``: giver clients connect to it, one flow each."""

    endpoint: str  # as asked (``tcp://*:5555``)
    port: ServerPort
    actual: str  # as bound (``tcp://0.0.0.0:5555``)
    flows: dict[PeerId, Peer] = field(default_factory=dict)
    origin: int = 0
    monitor: zmq.Socket[bytes] | None = None
    accepted: int = 0  # connections accepted and not yet handshaken
    told: dict[PeerId, None] = field(default_factory=dict)  # strays sent an EOT (bounded)
    # What serves its flows on the receiver's loop (set right after the bind).
    server: FlowServer = field(init=False)


@dataclass
class Peer:
    endpoint: str
    status: PeerStatus
    mode: str | None = None
    # Endpoints we connect to: the flows' engine, and the open flow's connection and
    # port (None between flows).
    client: FlowClient | None = None
    link: ClientFlow | None = None
    port: ClientPort | None = None
    flow: Flow | None = None
    producer: str | None = None
    arrow: bool = False
    acked: int = 0  # last ack sent
    # The BOT we sent (client flows): the reply's attributes count only where they are
    # not an echo of it. ``terms``: what was agreed (acks, encoding, producer id).
    sent: dict[str, Any] = field(default_factory=dict)
    terms: Terms = PLAIN
    # Bound flows: the server port the client came in on, and its routing id.
    bound: Bound | None = None
    rid: PeerId | None = None
    conn: ServerFlow | None = None  # its flow in the bound port's server
    pay_one: bool = False  # credit as PAYs of 1 (see _pay)
    # Most records seen in one Arrow DAT (0: none yet). A giver that ignores the
    # ``batch`` we ask for in BOT sends bigger DATs: credit is then sized by what it
    # really sends, and one credit at a time until its first DAT shows the size.
    dat_rows: int = 0
    pending: Pending = field(default_factory=Pending)
    # The last DAT (or the BOT) said ``more: false``; ``status.idle`` once it is stored.
    said_idle: bool = False
