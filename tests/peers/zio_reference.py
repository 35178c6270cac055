"""A stand-in for the ZIO reference implementation's flow peers, for tests.

The team's connector once passed its tests and then failed against the real ZIO reference
(brettviren/zio, C++ ``zio::Flow`` and Python ``zio.flow``), because the test peers behaved
the way we read the spec. The peers here behave the way the reference *code* behaves,
quirks included. They are written from the facts below, not copied from the reference, and
they deliberately do not import ``zio_spark``: every byte is encoded and decoded here by
hand (``struct`` / ``json``) so the stand-in cannot inherit our own reading of the wire.

Peers (each runs in its own thread; ``close()`` or use as a context manager):

- :class:`ReferenceServer` - a plain reference ``Flow`` on a bound server port
  (``role="giver"|"taker"``), serving one flow at a time, forever, like a reference server
  application that makes a new ``Flow`` after each one ends or dies.
- :class:`ReferenceClientGiver` - a reference ``extract`` client (the reference's common
  topology: producers are flow clients that connect to a server/broker that binds).
- :class:`ReferenceClientTaker` - a reference ``inject`` client.

``flavor="cpp"`` follows ``src/flow.cpp`` + ``src/port.cpp`` + ``src/util.cpp`` +
``src/message.cpp``; ``flavor="python"`` follows ``python/zio/flow/proto.py`` +
``python/zio/flow/sm.py`` + ``python/zio/port.py`` + ``python/zio/util.py`` +
``python/zio/message.py`` (latest stored versions: ``proto.py`` with ``TransmissionEnd``,
``sm.py`` with the ``serverish`` argument). ``sockets="routerdealer"`` is the reference's
no-draft fallback, ``"clientserver"`` needs a draft pyzmq (checked; never attempted on a
stock pyzmq, where creating such a socket aborts the process).

Facts reproduced (ZW = ``/work/shared/specs/zio-wire.md``, section "What the reference
really does" unless another section is named):

Wire (ZW "Message = parts", "Single-frame encoding", "When draft sockets are missing")

1. prefix ``b"ZIO0FLOW" + label``, coord ``struct "<QQQ"`` origin, granule, seqno
   (``message.cpp`` ``PrefixHeader::dumps``; ``message.py`` ``PrefixHeader.__bytes__``,
   ``encode_header_coord``: native ``'LLL'`` = little-endian 8 bytes on x86-64 Linux).
2. ROUTER/DEALER: the DEALER puts an empty delimiter first, the ROUTER sees
   ``[identity, b"", prefix, coord, *payload]`` and replies ``[identity, b"", ...]``
   (``util.cpp`` ``send_dealer``/``recv_router``/``send_router``; ``util.py``
   ``clientish_send``/``serverish_recv``: the Python ROUTER raises on a missing delimiter,
   the stand-in records an error and drops the message).
3. CLIENT/SERVER: one frame, czmq ``zmsg_encode`` form, length byte or ``0xFF`` + 4-byte
   big-endian (``util.py`` ``encode_message``/``decode_message``).
4. Granule: C++ stamps every message it sends with the current time in us
   (``port.cpp`` ``Port::send`` -> ``Message::set_coord(m_origin)`` with granule 0 ->
   ``system_clock`` us); Python leaves what the message had (0 for a new message).
   Origin: C++ sets the port's origin only when non-zero; Python when the port has one
   (``port.py`` ``Port.send``). So an echoed BOT keeps the *client's* origin when the
   server has none, and (Python) the client's granule.
5. Seqno: each side counts its own sends from 0 (BOT = 0, first DAT = 1, PAY and EOT take
   numbers); a message sent in FINACK/ACKFIN other than EOT gets no number (it keeps 0)
   (``flow.cpp`` ``send_msg``/``flush_pay``; ``sm.py`` ``send_msg``/``flush_pay``).
   Nobody checks received seqnos.
6. JSON: C++ writes nlohmann ``dump()``: compact, keys sorted; Python ``json.dumps``:
   ``", "``/``": "`` spacing, insertion order (ZW "Flow object").
   Labels written: C++ client BOT ``{"credit":N,"direction":"extract","flow":"BOT"}``,
   DAT ``{"flow":"DAT"}``, PAY ``{"credit":n,"flow":"PAY"}``, EOT ``{"flow":"EOT"}``;
   Python client BOT ``{"flow": "BOT", "credit": N, "direction": "extract"}``,
   DAT ``{"flow": "DAT"}``, PAY ``{"flow": "PAY", "credit": n}``, EOT ``{"flow": "EOT"}``.
   DAT payload = one frame, the value.

Handshake

7. The server's BOT reply is the client's BOT message echoed: same label object with
   ``direction`` flipped, same payload frames; every other attribute untouched (ZW first
   bullet; ``flow.cpp`` ``FlowImpServer::bot_handshake``; ``proto.py`` ``Flow.bot`` with
   ``msg=None`` -> ``msg = obot``).
8. C++: the reply's ``credit`` is the client's, untouched, even when the server lowers
   its own total (``accept_credit``: ``0 < offer < total`` -> ``total = offer``, never
   raised) - so a C++ server taker pays ``min(own, offer)`` while announcing ``offer``
   (ZW second bullet). Python: ``send_bot`` overwrites ``credit`` with the lowered total
   and ``direction`` with its own, appending keys the client's label lacked
   (``proto.py`` ``send_bot``; ``sm.py`` ``recv_bot``).
9. A client accepts the reply's credit as its total, whatever it is (``accept_credit`` /
   ``recv_bot`` client branch). A reference client (giver or taker) offers its own
   constructor credit in its BOT; the reference's own tests use the same value on both
   sides (``test/test_flow.cpp``: 10, 5, 2, 1).
10. A BOT must carry the direction opposite to the receiver's own (``check_recv_bot``);
    anything else in IDLE is a protocol error (C++ ``remote_error``, Python
    ``ValueError``): recorded in ``errors``, the message is consumed, no reply.

Credit (ZW "Flow behaviour of the reference")

11. Taker starts with all the credit; the C++ taker's ``get()`` flushes everything it holds
    as one PAY *before* each receive (so: one PAY of the total, then one PAY of 1 per DAT);
    Python ``get()`` the same (``send_pay``/``flush_pay``).
12. Giver starts at 0. Its ``put()`` first takes at most ONE waiting message without
    blocking (only if ``credit != total``), then, if still broke, blocks for ONE message,
    then sends the DAT (``flow.cpp`` ``put``/``recv_pay``; ``proto.py``
    ``put``/``recv_pay``). A PAY is valid when ``credit >= 0`` and
    ``credit + held <= total`` (``check_pay``).
13. **Zero-credit PAY** (ZW fourth bullet): valid, so it moves the giver to GENEROUS with
    0 credit; when it is the message the giver blocked for, the DAT send that follows is
    refused by the state machine and the giver throws (C++ ``local_error``
    "send invalid"). The flow dies: no EOT, silence. NOTE: the Python giver does the
    same (``sm.py``: GENEROUS + SendMsg needs credit >= 1 -> ``ValueError`` "bad send").
    A zero-credit PAY taken in the non-blocking step is harmless in both.
14. C++ giver: a message refused in the non-blocking step (too much PAY, a stray BOT,
    DAT...) is silently dropped (``process_event`` result ignored); refused in the
    blocking step, the DAT send throws (flow dies). Python giver: refused in either step
    -> ``RuntimeError`` (flow dies). Unknown attributes in PAY/DAT labels are ignored
    (only ``flow`` and ``credit`` are read) (ZW third bullet).
15. A PAY exceeding the giver's total is refused (``check_pay``): a C++ server giver that
    lowered its total below a client taker's offer drops that client's first PAY (the
    client believes the total it offered) and stalls or dies as in 14.

One flow at a time

16. A plain server ``Flow`` takes messages from any client (no routing-id check on
    receive, ``Port::recv``); the routing id of the BOT is kept for sends only. A second
    client's BOT during a flow (ZW sixth bullet): C++ taker ``get()`` -> ``remote_error``;
    C++ giver as in 14 (dies if it was blocked waiting for credit, dropped otherwise);
    Python giver dies. The killing BOT is consumed and never answered; the first client
    gets nothing more (no EOT, no PAY/DAT): silence. The server then waits for a new BOT
    (a reference server app would make a new ``Flow``), so the second client must send
    its BOT again. Counted in ``flows_killed``.
17. Python *server taker* cannot pay (ZW fifth bullet): ``flush_pay`` does not set the
    routing id, so ``Port.send`` on a serverish socket fails (ROUTER: ``TypeError`` on the
    int 0 identity; SERVER: ``ZMQError`` EINVAL setting routing id 0). Reproduced: the
    BOT reply goes out, then the flow dies before any PAY; ``errors`` says so.

EOT

18. Either side may send EOT; the receiver acknowledges with an EOT of its own
    (``eotack``/``eotsend``: a new message ``{"flow":"EOT"}``, numbered). The initiator
    keeps receiving, skipping PAY/DAT, until the EOT arrives (``eot``/``eotrecv``;
    ZW "Flow behaviour").
19. C++ giver/taker: an EOT received in ``put``/``get`` throws ``end_of_transmission``;
    the reference apps answer with ``eotack()`` (``test/test_flow.cpp``).
20. Python taker ``get()`` asserts ``credit > 0`` *before* looking for EOT, and it has just
    flushed all its credit, so an EOT from the giver raises ``AssertionError``: the Python
    taker never echoes (with ``python_asserts=False``, i.e. ``python -O``, it raises
    ``TransmissionEnd`` and the app echoes with ``eotsend``). The Python giver's ``put()``
    never checks for EOT: after one arrives it keeps sending DATs without credit
    accounting (FINACK accepts any non-EOT send), and its final ``eot()`` sends the EOT
    that completes the handshake, then waits in ``eotrecv`` for an echo that will not come.

Where the reference source says more than (or other than) zio-wire.md:

- zio-wire.md "Flow behaviour" says the server replies with a credit "no larger than the
  offer"; the C++ server echoes the offer whatever it pays (fact 8, already in "What the
  reference really does"); the Python server does lower it.
- A zero-credit PAY also kills the *Python* giver when it is blocked for credit, and it
  kills either giver only when it is the message the giver blocked for (fact 13).
- "A second client's BOT kills the flow": always for the C++ taker and the Python giver;
  a C++ giver that still has credit drops that BOT silently and carries on (fact 14, 16).
  The killing BOT is never answered; the first client just stops hearing anything.
- A C++ server giver that lowered its total drops a client's PAY above that total
  (fact 15); with a client that trusts the echoed credit nothing is ever given.
- The Python taker cannot echo the giver's EOT (AssertionError, fact 20); the Python
  giver never notices an EOT in ``put()``.
- The reference client offers its own constructor credit in its BOT (nothing special for
  a giver); C++ puts ``credit`` in a client BOT's label, the Python client the same.

Records every peer keeps (appended by its thread; poll them with ``wait_until``):
``bots`` (BOT labels received), ``sent`` / ``received`` (DAT payload values),
``received_labels``, ``pays_received`` / ``pays_sent`` (credits), ``zero_credit_pays``,
``eot_echoes`` (echoes to an EOT it initiated), ``eots_received`` (EOTs the other side
initiated), ``errors`` (texts: every way a flow died), ``ignored`` (messages dropped
without killing the flow), ``trace`` (``("recv"|"send"|"dropped", WireMessage)``).
Servers add ``replies``, ``flows_started``, ``flows_completed``, ``flows_died``,
``flows_killed``, ``blocked_for_credit``; clients add ``reply``, ``total_credit``,
``done``, ``finished``, ``wait()``.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq

__all__ = [
    "FLAVORS",
    "SOCKETS",
    "ReferenceClientGiver",
    "ReferenceClientTaker",
    "ReferenceServer",
    "WireMessage",
    "decode_parts",
    "dumps_label",
    "encode_parts",
    "have_draft",
    "pack_coord",
    "unpack_coord",
    "zmsg_decode",
    "zmsg_encode",
]

FLAVORS = ("cpp", "python")
SOCKETS = ("routerdealer", "clientserver")
PREFIX_HEAD = b"ZIO0FLOW"
_COORD = struct.Struct("<QQQ")
_SLICE_MS = 20  # poll slice so a blocked peer notices close()


# --------------------------------------------------------------------------- wire helpers


def have_draft() -> bool:
    """True when this pyzmq can make CLIENT/SERVER sockets (never try them otherwise)."""
    return bool(zmq.has("draft") and getattr(zmq, "DRAFT_API", False))


def dumps_label(obj: dict[str, Any], flavor: str) -> str:
    """The label JSON as each reference writes it (C++ compact sorted, Python spaced)."""
    if flavor == "cpp":
        return json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return json.dumps(obj)


def pack_coord(origin: int, granule: int, seqno: int) -> bytes:
    return _COORD.pack(origin, granule, seqno)


def unpack_coord(data: bytes) -> tuple[int, int, int]:
    origin, granule, seqno = _COORD.unpack(data)
    return origin, granule, seqno


def zmsg_encode(parts: Iterable[bytes]) -> bytes:
    """czmq ``zmsg_encode``: each part ``[len][bytes]``, len 1 byte or 0xFF + 4 bytes BE."""
    out = bytearray()
    for p in parts:
        n = len(p)
        if n < 255:
            out.append(n)
        else:
            out.append(0xFF)
            out += struct.pack(">I", n)
        out += p
    return bytes(out)


def zmsg_decode(data: bytes) -> list[bytes]:
    parts: list[bytes] = []
    i, n = 0, len(data)
    while i < n:
        size = data[i]
        i += 1
        if size == 0xFF:
            if i + 4 > n:
                raise ValueError("corrupt zmsg: truncated long length")
            (size,) = struct.unpack(">I", data[i : i + 4])
            i += 4
        if i + size > n:
            raise ValueError("corrupt zmsg: part runs past the end")
        parts.append(bytes(data[i : i + size]))
        i += size
    return parts


@dataclass
class WireMessage:
    """One ZIO FLOW message as it travels: label text, coord, payload frames, routing id."""

    label: str
    origin: int = 0
    granule: int = 0
    seqno: int = 0
    payload: list[bytes] = field(default_factory=list)
    rid: bytes | int | None = None
    level: int = 0
    form: str = "FLOW"

    @property
    def obj(self) -> dict[str, Any]:
        """The label parsed as JSON ({} for an empty label); raises ValueError if not JSON."""
        if not self.label:
            return {}
        val = json.loads(self.label)
        if not isinstance(val, dict):
            raise ValueError(f"label is not a JSON object: {self.label!r}")
        return val

    @property
    def flow(self) -> str | None:
        try:
            f = self.obj.get("flow")
        except ValueError:
            return None
        return f if isinstance(f, str) else None

    def copy(self) -> WireMessage:
        return WireMessage(
            self.label,
            self.origin,
            self.granule,
            self.seqno,
            list(self.payload),
            self.rid,
            self.level,
            self.form,
        )


def encode_parts(msg: WireMessage) -> list[bytes]:
    """``[prefix, coord, *payload]``."""
    form = msg.form.encode()[:4].ljust(4, b" ")
    prefix = b"ZIO" + str(msg.level).encode() + form + msg.label.encode("utf-8")
    return [prefix, pack_coord(msg.origin, msg.granule, msg.seqno), *msg.payload]


def decode_parts(parts: list[bytes], rid: bytes | int | None = None) -> WireMessage:
    if len(parts) < 2:
        raise ValueError(f"a ZIO message has at least 2 parts, got {len(parts)}")
    prefix, coord = parts[0], parts[1]
    if len(prefix) < 8 or prefix[:3] != b"ZIO":
        raise ValueError(f"bad ZIO prefix {prefix[:16]!r}")
    if len(coord) != 24:
        raise ValueError(f"coord must be 24 bytes, got {len(coord)}")
    origin, granule, seqno = unpack_coord(coord)
    return WireMessage(
        label=prefix[8:].decode("utf-8"),
        origin=origin,
        granule=granule,
        seqno=seqno,
        payload=[bytes(p) for p in parts[2:]],
        rid=rid,
        level=prefix[3] - ord("0"),
        form=prefix[4:8].decode("ascii", "replace"),
    )


def _now_us() -> int:
    return time.time_ns() // 1000


# --------------------------------------------------------------------------- exceptions


class _Stopped(Exception):
    """close() was called."""


class _EndOfTransmission(Exception):
    """C++ ``flow::end_of_transmission`` / Python ``TransmissionEnd``."""


class _FlowDied(Exception):
    """The reference would have thrown out of its flow here (protocol or send error)."""

    def __init__(self, text: str, cause: WireMessage | None = None) -> None:
        super().__init__(text)
        self.cause = cause


# --------------------------------------------------------------------------- sockets


class _Wire:
    """One reference port: serverish (ROUTER/SERVER, bind) or clientish (DEALER/CLIENT)."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        sockets: str,
        serverish: bool,
        stop: threading.Event | None = None,
    ) -> None:
        self._stop = stop
        if sockets not in SOCKETS:
            raise ValueError(f"sockets must be one of {SOCKETS}, got {sockets!r}")
        self.draft = sockets == "clientserver"
        if self.draft and not have_draft():
            raise RuntimeError(
                "sockets='clientserver' needs a draft-enabled pyzmq (zmq.has('draft') is "
                f"{zmq.has('draft')}); refusing to create CLIENT/SERVER sockets on a stock "
                "pyzmq (it aborts the process). See scripts/build-draft-pyzmq.sh."
            )
        self.serverish = serverish
        if self.draft:
            kind = zmq.SERVER if serverish else zmq.CLIENT
        else:
            kind = zmq.ROUTER if serverish else zmq.DEALER
        self.sock: zmq.Socket[Any] = ctx.socket(kind)
        self.sock.linger = 0
        self.endpoint = ""

    def bind_random(self) -> str:
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        return self.endpoint

    def connect(self, endpoint: str) -> None:
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self) -> WireMessage:
        """Receive one message (call after poll); raises ValueError for a malformed one."""
        if self.draft:
            frame = self.sock.recv(copy=False)
            rid: bytes | int | None = frame.routing_id if self.serverish else None
            return decode_parts(zmsg_decode(frame.bytes), rid)
        frames = self.sock.recv_multipart()
        if self.serverish:
            if len(frames) < 2 or frames[1] != b"":
                raise ValueError(f"ROUTER expected [identity, b'', ...], got {frames[:3]!r}")
            return decode_parts(frames[2:], frames[0])
        if not frames or frames[0] != b"":
            raise ValueError(f"DEALER expected a leading empty delimiter, got {frames[:2]!r}")
        return decode_parts(frames[1:])

    def send(self, msg: WireMessage, rid: bytes | int | None) -> None:
        """Send, waiting for room as the reference's blocking send does, but in slices
        that notice close(): a DEALER/CLIENT whose only pipe a refused handshake dropped
        has no room ever, and a plain blocking send would outlive the test. (A serverish
        port sends as before: a ROUTER never blocks, and POLLOUT is exact only on the
        DEALER/CLIENT.)"""
        stoppable = self._stop is not None and not self.serverish
        while True:
            try:
                self._send(msg, rid, zmq.NOBLOCK if stoppable else 0)
                return
            except zmq.Again:  # no room, or the pipe went mid-message (libzmq rolled back)
                pass
            while not self.sock.poll(_SLICE_MS, zmq.POLLOUT):
                if self._stop is not None and self._stop.is_set():
                    raise _Stopped

    def _send(self, msg: WireMessage, rid: bytes | int | None, flags: int) -> None:
        parts = encode_parts(msg)
        if self.draft:
            frame = zmq.Frame(zmsg_encode(parts))
            if self.serverish:
                frame.routing_id = rid  # type: ignore[assignment]  # 0/None -> ZMQError
            self.sock.send(frame, flags)
            return
        if self.serverish:
            # pyzmq raises TypeError for a non-bytes identity (the Python reference's 0)
            self.sock.send_multipart([rid, b"", *parts], flags)  # type: ignore[list-item]
            return
        self.sock.send_multipart([b"", *parts], flags)

    def close(self) -> None:
        self.sock.close(linger=0)


# --------------------------------------------------------------------------- state machine


class _FlowSM:
    """The reference flow state machine (``flow.cpp`` sml tables / ``sm.py``).

    States: IDLE BOTSEND BOTRECV READY BROKE GENEROUS (giving) RICH HANDSOUT (taking)
    FINACK ACKFIN FIN. Methods return False where the reference's ``process_event`` /
    trigger returns False (no transition).
    """

    GIVING = ("BROKE", "GENEROUS")
    TAKING = ("RICH", "HANDSOUT")

    def __init__(self, flavor: str, direction: str, credit: int, serverish: bool) -> None:
        self.flavor = flavor
        self.direction = direction
        self.total = credit
        self.credit = 0
        self.serverish = serverish
        self.state = "IDLE"
        self.send_seqno = -1
        self.recv_seqno = -1
        self.remid: bytes | int | None = None

    # guards
    def _check_bot(self, msg: WireMessage, sending: bool) -> bool:
        if (self.send_seqno if sending else self.recv_seqno) != -1:
            return False
        obj = msg.obj
        if obj.get("flow") != "BOT":
            return False
        odir = obj.get("direction")
        if odir not in ("extract", "inject"):
            return False
        return odir == self.direction if sending else odir != self.direction

    def _pay_amount(self, obj: dict[str, Any]) -> int:
        c = obj.get("credit", -1)
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            return -1
        return int(c)

    def _check_pay(self, msg: WireMessage) -> bool:
        obj = msg.obj
        if obj.get("flow") != "PAY":
            return False
        got = self._pay_amount(obj)
        return not (got < 0 or got + self.credit > self.total)

    # events
    def recv(self, msg: WireMessage) -> bool:
        flow = msg.obj.get("flow")
        s = self.state
        if s in ("IDLE", "BOTSEND"):
            if not self._check_bot(msg, sending=False):
                return False
            self._recv_bot(msg)
            self.state = "BOTRECV" if s == "IDLE" else "READY"
            return True
        if s in self.GIVING:
            if self._check_pay(msg):
                self.recv_seqno += 1
                self.credit += self._pay_amount(msg.obj)
                self.state = "GENEROUS"
                return True
            if flow == "EOT":
                self.recv_seqno += 1
                self.state = "FINACK"
                return True
            return False
        if s in self.TAKING:
            if s == "HANDSOUT" and flow == "DAT":
                held_out = self.total - self.credit
                if held_out == 1:
                    self.state = "RICH"
                elif self.flavor == "python" and held_out <= 1:
                    return False
                self.recv_seqno += 1
                self.credit += 1
                return True
            if flow == "EOT":
                self.recv_seqno += 1
                self.state = "FINACK"
                return True
            return False
        if s == "FINACK":
            return flow != "EOT"
        if s == "ACKFIN":
            if flow == "EOT":
                self.state = "FIN"
            return True
        return False  # BOTRECV READY FIN

    def send(self, msg: WireMessage) -> bool:
        """On success the message gets its seqno and routing id (when the SM numbers it)."""
        flow = msg.obj.get("flow")
        s = self.state
        if s in ("IDLE", "BOTRECV"):
            if not self._check_bot(msg, sending=True):
                return False
            self._number(msg)
            self.state = "BOTSEND" if s == "IDLE" else "READY"
            return True
        if s in self.GIVING or s in self.TAKING:
            if flow == "EOT":
                self._number(msg)
                self.state = "ACKFIN"
                return True
            if s == "GENEROUS" and flow == "DAT" and self.credit >= 1:
                self.credit -= 1
                if self.credit == 0:
                    self.state = "BROKE"
                self._number(msg)
                return True
            return False
        if s == "FINACK":
            if flow == "EOT":
                self._number(msg)
                self.state = "FIN"
            return True  # non-EOT: accepted, not numbered
        if s == "ACKFIN":
            return flow != "EOT"
        return False

    def flush_pay(self, msg: WireMessage, dumps: Callable[[dict[str, Any]], str]) -> bool:
        if self.state not in self.TAKING or self.credit <= 0:
            return False
        obj = msg.obj
        obj["flow"] = "PAY"
        obj["credit"] = self.credit
        msg.label = dumps(obj)
        self.send_seqno += 1
        msg.seqno = self.send_seqno
        self.credit = 0
        self.state = "HANDSOUT"
        if self.flavor == "cpp" and self.remid is not None:
            msg.rid = self.remid
        # python: flush_pay never sets the routing id (fact 17)
        return True

    def begin(self) -> bool:
        if self.state != "READY":
            return False
        self.state = "BROKE" if self.direction == "extract" else "RICH"
        return True

    def _recv_bot(self, msg: WireMessage) -> None:
        obj = msg.obj
        # python: KeyError in the reference when "credit" is missing
        offer = obj["credit"] if self.flavor == "python" else self._pay_amount(obj)
        if self.serverish:
            if 0 < offer < self.total:
                self.total = offer
        else:
            self.total = offer
        self.credit = self.total if self.direction == "inject" else 0
        self.recv_seqno += 1
        self.remid = msg.rid

    def _number(self, msg: WireMessage) -> None:
        self.send_seqno += 1
        msg.seqno = self.send_seqno
        msg.rid = self.remid


# --------------------------------------------------------------------------- peer base


class _Peer:
    """Thread, stop flag, change notification and the shared counters."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        flavor: str,
        sockets: str,
        serverish: bool,
        origin: int | None,
        timeout_ms: int | None,
        name: str,
    ) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
        self.flavor = flavor
        self.sockets = sockets
        self.origin = origin
        self.timeout_ms = timeout_ms
        self._stop = threading.Event()
        self._wire = _Wire(ctx, sockets, serverish, self._stop)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._closed = False
        # counters / records (appended by the peer thread, read by tests)
        self.bots: list[dict[str, Any]] = []  # BOT labels received (parsed)
        self.sent: list[bytes] = []  # DAT payload values sent
        self.received: list[bytes] = []  # DAT payload values received
        self.received_labels: list[dict[str, Any]] = []  # DAT labels received
        self.pays_received: list[int] = []  # credit of every PAY received
        self.pays_sent: list[int] = []  # credit of every PAY sent
        self.zero_credit_pays = 0
        self.eot_echoes = 0  # echoes received for an EOT we initiated
        self.eots_received = 0  # EOTs the peer initiated (we acknowledged or not)
        self.errors: list[str] = []
        self.ignored: list[str] = []  # messages dropped without killing the flow
        self.trace: list[tuple[str, WireMessage]] = []  # ("recv"|"send", message)

    # -- public
    def wait_until(self, pred: Callable[[], bool], timeout: float = 60.0) -> bool:
        """Wait (with a deadline) until ``pred()`` is true; returns its final value. The
        deadline only guards against a hang (a loaded machine took over 10 s for a flow's
        last EOT round trip); it returns as soon as ``pred()`` holds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bool(pred())
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self._wire.close()
            self._closed = True
        if alive:
            raise RuntimeError(f"{self._thread.name} did not stop within {timeout} s")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing
    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _main(self) -> None:
        try:
            self._run()
        except _Stopped:
            pass
        except Exception as e:  # a bug in the stand-in itself: make it visible
            self.errors.append(f"stand-in crashed: {type(e).__name__}: {e}")
        finally:
            self._finish()
            self._changed()

    def _finish(self) -> None:
        pass

    def _run(self) -> None:
        raise NotImplementedError

    def _dumps(self, obj: dict[str, Any]) -> str:
        return dumps_label(obj, self.flavor)

    def _error(self, text: str) -> None:
        self.errors.append(text)
        self._changed()

    def _port_recv(self, timeout_ms: int | None) -> WireMessage | None:
        """Port-level receive: None on timeout (``timeout_ms`` None = forever)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if self._stop.is_set():
                raise _Stopped
            if deadline is None:
                wait = _SLICE_MS
            else:
                wait = max(0, min(_SLICE_MS, int((deadline - time.monotonic()) * 1000)))
            if self._wire.poll(wait):
                try:
                    msg = self._wire.recv()
                except ValueError as e:
                    self._error(f"malformed message dropped: {e}")
                    continue
                self._note_recv(msg)
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _note_recv(self, msg: WireMessage) -> None:
        self.trace.append(("recv", msg))
        try:
            obj = msg.obj
        except ValueError:
            self._changed()
            return
        flow = obj.get("flow")
        if flow == "BOT":
            self.bots.append(obj)
        elif flow == "PAY":
            c = obj.get("credit")
            if isinstance(c, (int, float)) and not isinstance(c, bool):
                self.pays_received.append(int(c))
                if c == 0:
                    self.zero_credit_pays += 1
        self._changed()

    def _port_send(self, msg: WireMessage) -> None:
        """Port-level send with each reference's coord rules (fact 4)."""
        if self.flavor == "cpp":
            msg.granule = _now_us()
            if self.origin:
                msg.origin = self.origin
        elif self.origin is not None:
            msg.origin = self.origin
        rid = msg.rid if self._wire.serverish else None
        if self._wire.serverish:
            if self.flavor == "python" and not rid:
                # Message.routing_id defaults to 0: ROUTER -> TypeError, SERVER -> ZMQError
                raise _FlowDied(
                    "python serverish send without a routing id (Message.routing_id = 0): "
                    + ("TypeError from send_multipart" if not self._wire.draft else "ZMQError")
                )
            if self.flavor == "cpp" and (rid is None or rid == b""):
                if self._wire.draft:  # util.cpp send_server throws
                    raise _FlowDied("send server requires a remote identity")
                # send_router pushes an empty identity: the ROUTER drops it silently
                self.trace.append(("dropped", msg))
                self._changed()
                return
        self._wire.send(msg, rid)
        self.trace.append(("send", msg))
        obj = msg.obj
        if obj.get("flow") == "PAY":
            self.pays_sent.append(int(obj.get("credit", 0)))
        self._changed()


# --------------------------------------------------------------------------- flow API


class _Flow:
    """One reference ``Flow`` object (C++ ``FlowImp`` / Python ``proto.Flow``) on a peer."""

    def __init__(self, peer: _Peer, direction: str, credit: int) -> None:
        self.peer = peer
        self.flavor = peer.flavor
        self.serverish = peer._wire.serverish
        self.sm = _FlowSM(peer.flavor, direction, credit, self.serverish)
        self.timeout_ms = peer.timeout_ms
        self.last_refused: WireMessage | None = None
        self.last_received: WireMessage | None = None
        self.reply_sent: WireMessage | None = None
        self.obot: WireMessage | None = None  # the BOT that opened this flow
        self.blocked_for_credit = threading.Event()

    # -- low level, per flavor
    def _refuse(self, msg: WireMessage, text: str) -> _FlowDied:
        self.last_refused = msg
        return _FlowDied(text, msg)

    def _process(self, msg: WireMessage) -> bool:
        self.last_received = msg
        try:
            ok = self.sm.recv(msg)
        except (ValueError, KeyError, TypeError) as e:  # json parse / python KeyError
            raise self._refuse(msg, f"label not understood ({e}): {msg.label!r}") from None
        if not ok:
            self.last_refused = msg
        return ok

    def recv(self) -> WireMessage | None:
        """``Flow::recv`` / ``Flow.recv``: None on timeout; refused message -> dies."""
        msg = self.peer._port_recv(self.timeout_ms)
        if msg is None:
            if self.flavor == "python":
                # proto.py logs msg.routing_id of None -> AttributeError
                raise _FlowDied("python flow recv timed out (AttributeError on None)")
            return None
        if not self._process(msg):
            raise self._refuse(msg, f"recv flow bad message {msg.label!r} in {self.sm.state}")
        return msg

    def send(self, msg: WireMessage) -> None:
        msg.form = "FLOW"
        if not self.sm.send(msg):
            raise _FlowDied(f"send invalid: {msg.label!r} in {self.sm.state}", self.last_refused)
        self.peer._port_send(msg)

    # -- handshake
    def bot_server(self) -> WireMessage | None:
        obot = self.recv()
        if obot is None:
            return None
        reply = obot.copy()
        obj = obot.obj
        if self.flavor == "cpp":
            obj["direction"] = "extract" if obj.get("direction") == "inject" else "inject"
        else:  # Flow.send_bot: label_object.update(flow, credit, direction)
            obj.update(flow="BOT", credit=self.sm.total, direction=self.sm.direction)
        reply.label = self.peer._dumps(obj)
        self.obot = obot
        self.send(reply)
        self.reply_sent = reply
        return obot

    def bot_client(self, deadline: float) -> WireMessage:
        if self.flavor == "cpp":
            obj: dict[str, Any] = {"flow": "BOT", "direction": self.sm.direction}
            obj["credit"] = self.sm.total
        else:
            obj = {"flow": "BOT", "credit": self.sm.total, "direction": self.sm.direction}
        self.send(WireMessage(self.peer._dumps(obj)))
        while True:
            reply = self.recv()
            if reply is not None:
                return reply
            if time.monotonic() >= deadline:
                raise _FlowDied("no BOT reply from the server before the deadline")

    def begin(self) -> None:
        if not self.sm.begin():
            raise _FlowDied(f"flow failed to begin in {self.sm.state}")
        if self.flavor == "python":  # proto.Flow.begin -> pay()
            if self.sm.direction == "extract":
                self._py_recv_pay()
            else:
                self._send_pay()

    # -- giver
    def put(self, value: bytes) -> bool:
        """Send one DAT; False on a (C++) timeout waiting for credit."""
        if self.flavor == "cpp":
            return self._cpp_put(value)
        self._py_recv_pay()
        self.send(WireMessage(self.peer._dumps({"flow": "DAT"}), payload=[value]))
        self.peer.sent.append(value)
        return True

    def _cpp_put(self, value: bytes) -> bool:
        sm = self.sm
        if sm.credit != sm.total:  # recv_pay(): one non-blocking look
            msg = self.peer._port_recv(0)
            if msg is not None:
                if not self._process(msg):
                    self.peer.ignored.append(f"dropped in recv_pay: {msg.label!r}")
                    self.last_refused = None
                if sm.state == "FINACK":
                    raise _EndOfTransmission
        if sm.credit == 0:  # "try harder"
            self.blocked_for_credit.set()
            self.peer._changed()
            try:
                msg = self.peer._port_recv(self.timeout_ms)
            finally:
                self.blocked_for_credit.clear()
            if msg is None:
                return False
            self._process(msg)  # result ignored, as in the reference
            if sm.state == "FINACK":
                raise _EndOfTransmission
        self.send(WireMessage(self.peer._dumps({"flow": "DAT"}), payload=[value]))
        self.peer.sent.append(value)
        return True

    def _py_recv_pay(self) -> None:
        sm = self.sm
        if sm.credit < sm.total:
            msg = self.peer._port_recv(0)
            if msg is not None and not self._process(msg):
                raise self._refuse(msg, f"flow recv bad PAY: {msg.label!r} in {sm.state}")
        if not sm.credit:
            self.blocked_for_credit.set()
            self.peer._changed()
            try:
                msg = self.peer._port_recv(self.timeout_ms)
            finally:
                self.blocked_for_credit.clear()
            if msg is None:
                raise _FlowDied("flow timeout waiting for needed credit")
            if not self._process(msg):
                raise self._refuse(msg, f"flow recv bad PAY: {msg.label!r} in {sm.state}")

    # -- taker
    def _send_pay(self) -> None:
        if not self.sm.credit:
            return
        pay = WireMessage(self.peer._dumps({"flow": "PAY"}))
        if self.sm.flush_pay(pay, self.peer._dumps):
            self.peer._port_send(pay)

    def get(self, python_asserts: bool = True) -> WireMessage | None:
        """Receive one DAT (None on a C++ timeout); EOT raises _EndOfTransmission."""
        self._send_pay()
        msg = self.recv()
        if msg is None:
            return None
        if self.flavor == "python":
            if python_asserts and not self.sm.credit > 0:
                raise _FlowDied(
                    f"python taker get(): AssertionError (credit {self.sm.credit}) on "
                    f"{msg.label!r}; TransmissionEnd is never raised, no EOT echo",
                    msg,
                )
            if msg.obj.get("flow") == "EOT":
                raise _EndOfTransmission
            return msg
        if self.sm.state == "FINACK":
            raise _EndOfTransmission
        return msg

    # -- EOT
    def eotack(self) -> None:
        self.send(WireMessage(self.peer._dumps({"flow": "EOT"})))

    def eot(self, deadline: float) -> bool:
        """Initiate EOT and wait (until ``deadline``) for the other end's EOT."""
        self.eotack()
        if self.flavor == "cpp" and self.sm.state != "ACKFIN":
            raise _FlowDied(f"eot handshake failed to reach ACKFIN state ({self.sm.state})")
        while True:
            msg = self.peer._port_recv(_SLICE_MS * 5)
            if msg is None:
                if time.monotonic() >= deadline:
                    return False
                continue
            if not self._process(msg):
                raise self._refuse(msg, f"bad recv {msg.label!r} in {self.sm.state}")
            if self.sm.state == "ACKFIN":
                continue
            if self.sm.state != "FIN":
                raise _FlowDied(f"eot handshake failed to reach FIN state ({self.sm.state})")
            return True


# --------------------------------------------------------------------------- server


def _as_bytes(v: bytes | str) -> bytes:
    return v.encode("utf-8") if isinstance(v, str) else bytes(v)


class ReferenceServer(_Peer):
    """A plain reference ``Flow`` on a bound server port, one flow at a time, forever.

    ``role="giver"``: each accepted flow gives every value of ``values`` as plain DATs
    (within the credit actually paid), then initiates EOT and waits for the echo.
    ``role="taker"``: pays credit and collects DAT payloads in ``received`` until the
    client's EOT, which it echoes (``flavor="python"`` reproduces the reference's broken
    server PAY: the flow dies after the BOT reply, see fact 17).

    ``credit`` is the server's own total (``Flow(port, direction, credit)``); it is
    lowered to a smaller positive client offer. ``timeout_ms`` is the ``Flow`` timeout
    (C++ default 1000 as in ``test/test_flow.cpp``: put/get then return false and the app
    tries again; Python default None = forever). ``eot_timeout_s`` bounds the wait for
    an EOT echo. After a flow ends or dies the server waits for the next BOT.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        role: str,
        flavor: str,
        sockets: str = "routerdealer",
        values: Iterable[bytes | str] = (),
        credit: int = 10,
        origin: int | None = None,
        timeout_ms: int | None = -1,
        eot_timeout_s: float = 30.0,
        python_asserts: bool = True,
    ) -> None:
        if role not in ("giver", "taker"):
            raise ValueError(f"role must be 'giver' or 'taker', got {role!r}")
        if timeout_ms == -1:
            timeout_ms = 1000 if flavor == "cpp" else None
        super().__init__(
            ctx,
            flavor=flavor,
            sockets=sockets,
            serverish=True,
            origin=origin,
            timeout_ms=timeout_ms,
            name=f"zio-ref-server-{flavor}-{role}",
        )
        self.role = role
        self.direction = "extract" if role == "giver" else "inject"
        self.values = [_as_bytes(v) for v in values]
        self.credit = credit
        self.eot_timeout_s = eot_timeout_s
        self.python_asserts = python_asserts
        try:
            self.endpoint = self._wire.bind_random()
        except Exception:
            self._wire.close()
            raise
        self.replies: list[dict[str, Any]] = []  # BOT replies sent (parsed)
        self.flows_started = 0
        self.flows_completed = 0
        self.flows_killed = 0
        self.flows_died = 0  # every flow that ended by an error (killed ones included)
        self.flow: _Flow | None = None
        self._thread.start()

    @property
    def blocked_for_credit(self) -> bool:
        """True while the giver is blocked in put() waiting for a PAY with 0 credit."""
        f = self.flow
        return f is not None and f.blocked_for_credit.is_set()

    def _run(self) -> None:
        while not self._stop.is_set():
            flow = _Flow(self, self.direction, self.credit)
            self.flow = flow
            try:
                self._serve(flow)
            except _FlowDied as e:
                if flow.reply_sent is None:  # the new Flow's bot() failed
                    self._error(f"refused while waiting for a BOT: {e}")
                    continue
                self.flows_died += 1
                cause = e.cause or flow.last_refused or flow.last_received
                if cause is not None and cause is not flow.obot and cause.flow == "BOT":
                    self.flows_killed += 1
                    self._error(f"flow killed by a BOT during the flow: {e}")
                elif cause is not None and cause.flow == "PAY" and _credit_of(cause) == 0:
                    self._error(f"flow died on a zero-credit PAY: {e}")
                else:
                    self._error(f"flow died: {e}")

    def _serve(self, flow: _Flow) -> None:
        while flow.bot_server() is None:  # C++ bot() times out: the app tries again
            pass
        assert flow.reply_sent is not None
        self.replies.append(flow.reply_sent.obj)
        self.flows_started += 1
        self._changed()
        flow.begin()
        if self.role == "giver":
            self._give(flow)
        else:
            self._take(flow)
        self.flows_completed += 1
        self._changed()

    def _give(self, flow: _Flow) -> None:
        try:
            for value in self.values:
                while not flow.put(value):
                    pass
        except _EndOfTransmission:
            self.eots_received += 1
            flow.eotack()
            return
        self._initiate_eot(flow)

    def _take(self, flow: _Flow) -> None:
        try:
            while True:
                msg = flow.get(self.python_asserts)
                if msg is None:
                    continue
                self.received.append(msg.payload[0] if msg.payload else b"")
                self.received_labels.append(msg.obj)
                self._changed()
        except _EndOfTransmission:
            self.eots_received += 1
            flow.eotack()

    def _initiate_eot(self, flow: _Flow) -> None:
        if flow.eot(time.monotonic() + self.eot_timeout_s):
            self.eot_echoes += 1
        else:
            self._error("no EOT echo before eot_timeout_s")


def _credit_of(msg: WireMessage) -> int | None:
    try:
        c = msg.obj.get("credit")
    except ValueError:
        return None
    return c if isinstance(c, int) else None


# --------------------------------------------------------------------------- clients


class _Client(_Peer):
    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        *,
        direction: str,
        flavor: str,
        sockets: str,
        credit: int,
        origin: int | None,
        timeout_ms: int | None,
        deadline_s: float,
        python_asserts: bool,
        name: str,
    ) -> None:
        if timeout_ms == -1:
            timeout_ms = 1000 if flavor == "cpp" else None
        super().__init__(
            ctx,
            flavor=flavor,
            sockets=sockets,
            serverish=False,
            origin=origin,
            timeout_ms=timeout_ms,
            name=name,
        )
        self.direction = direction
        self.credit = credit
        self.deadline_s = deadline_s
        self.python_asserts = python_asserts
        self.endpoint = endpoint
        self.reply: dict[str, Any] | None = None  # the server's BOT (parsed)
        self.total_credit: int | None = None  # what the client accepted from the reply
        self.done = False  # the flow finished as the reference would (no error)
        self.finished = False  # the thread is over, for any reason
        self.flow: _Flow | None = None
        try:
            self._wire.connect(endpoint)
        except Exception:
            self._wire.close()
            raise

    def wait(self, timeout: float = 10.0) -> bool:
        """Wait (with a deadline) until the client finished; returns ``done``."""
        self.wait_until(lambda: self.finished, timeout)
        return self.done

    def _finish(self) -> None:
        self.finished = True

    def _run(self) -> None:
        deadline = time.monotonic() + self.deadline_s
        flow = _Flow(self, self.direction, self.credit)
        self.flow = flow
        try:
            reply = flow.bot_client(deadline)
            self.reply = reply.obj
            self.total_credit = flow.sm.total
            self._changed()
            flow.begin()
            self._transfer(flow, deadline)
            self.done = True
        except _FlowDied as e:
            self._error(f"flow died: {e}")

    def _transfer(self, flow: _Flow, deadline: float) -> None:
        raise NotImplementedError


class ReferenceClientGiver(_Client):
    """A reference ``extract`` client: BOT, DATs as credit is paid, EOT, wait for the echo.

    Offers ``credit`` in its BOT and accepts the reply's credit as its total (fact 9).
    ``deadline_s`` bounds the whole run (the wait for the BOT reply, for credit, for the
    echo). ``wait()`` polls until finished; ``done`` is True only for a clean finish.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        values: Iterable[bytes | str],
        *,
        flavor: str,
        sockets: str = "routerdealer",
        credit: int = 10,
        origin: int | None = None,
        timeout_ms: int | None = -1,
        deadline_s: float = 30.0,
    ) -> None:
        super().__init__(
            ctx,
            endpoint,
            direction="extract",
            flavor=flavor,
            sockets=sockets,
            credit=credit,
            origin=origin,
            timeout_ms=timeout_ms,
            deadline_s=deadline_s,
            python_asserts=True,
            name=f"zio-ref-client-giver-{flavor}",
        )
        self.values = [_as_bytes(v) for v in values]
        self._thread.start()

    def _transfer(self, flow: _Flow, deadline: float) -> None:
        try:
            for value in self.values:
                while not flow.put(value):
                    if time.monotonic() >= deadline:
                        raise _FlowDied("no credit before the deadline")
        except _EndOfTransmission:
            self.eots_received += 1
            flow.eotack()
            return
        if flow.eot(deadline):
            self.eot_echoes += 1
        else:
            raise _FlowDied("no EOT echo before the deadline")


class ReferenceClientTaker(_Client):
    """A reference ``inject`` client: BOT, PAYs as it takes DATs, echoes the giver's EOT.

    ``received`` holds DAT payloads, ``received_labels`` their labels. With ``eot_after=N``
    it initiates EOT itself after N DATs and waits for the echo. ``python_asserts=False``
    models ``python -O`` (the Python taker then echoes EOT; by default it cannot, fact 20).
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        *,
        flavor: str,
        sockets: str = "routerdealer",
        credit: int = 10,
        origin: int | None = None,
        timeout_ms: int | None = -1,
        deadline_s: float = 30.0,
        eot_after: int | None = None,
        python_asserts: bool = True,
    ) -> None:
        super().__init__(
            ctx,
            endpoint,
            direction="inject",
            flavor=flavor,
            sockets=sockets,
            credit=credit,
            origin=origin,
            timeout_ms=timeout_ms,
            deadline_s=deadline_s,
            python_asserts=python_asserts,
            name=f"zio-ref-client-taker-{flavor}",
        )
        self.eot_after = eot_after
        self._thread.start()

    def _transfer(self, flow: _Flow, deadline: float) -> None:
        try:
            while True:
                if self.eot_after is not None and len(self.received) >= self.eot_after:
                    if flow.eot(deadline):
                        self.eot_echoes += 1
                        return
                    raise _FlowDied("no EOT echo before the deadline")
                msg = flow.get(self.python_asserts)
                if msg is None:
                    if time.monotonic() >= deadline:
                        raise _FlowDied("no DAT before the deadline")
                    continue
                self.received.append(msg.payload[0] if msg.payload else b"")
                self.received_labels.append(msg.obj)
                self._changed()
        except _EndOfTransmission:
            self.eots_received += 1
            flow.eotack()
