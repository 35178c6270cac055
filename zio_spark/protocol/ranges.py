"""Range reads: a taker asks a giver for records ``[start, end)`` of one producer.

Theory of operation (docs/direct-read.md has the sequences and the wiring):

In the direct read mode a Spark task fetches its offset range straight from the giver
that holds it, and the driver only learns each producer's held window. Both are requests
on an ordinary ZIO flow of the zio-spark profile: the client is the *range reader* (a
taker, direction ``inject``), the server the giver. Credit stays the flow's
(:mod:`.flow`): every message the giver sends in answer is a DAT and costs one credit.

**Capability, stated so that an echo cannot fool it** (as in :mod:`.negotiate`). A giver
that can serve ranges states ``"ranges": 1`` (the version it speaks) in every BOT it
writes; a client of ours never sends ``ranges``, so a reference server echoing our BOT
never carries it, and the statement counts only together with the giver's own
``producer`` (the profile). A range reader opens its flow with ``"read": "range"``; a
capable giver then sends nothing on credit alone, only what requests ask for. A reader
whose server did not state ``ranges`` sends no request at all (:class:`RangeReader`
raises :class:`~zio_spark.errors.LocalProtocolError` before anything is built) and ends
the flow: no data moved, the query keeps the spool path for that producer.

**Incarnation: which numbers.** Sequence numbers name records only within one numbering:
a producer restarted without durable retention numbers from 1 again, so after a restart
the range ``[100, 200)`` a plan named may exist again and hold *other* records. So a
capable giver states, together with ``ranges``, ``"incarnation": "<name>"`` (1..64 ASCII
letters, digits, ``.``, ``_``, ``-``; opaque, compared for equality only): the name of
its sequence-number space. Under one incarnation a number names one record, forever. A
new one is taken whenever the numbering may have restarted: a fresh process without
durable retention makes a random one (:func:`new_incarnation` over ``os.urandom``), a
producer with durable retention persists its incarnation with its records and keeps it
(and its numbers) across its own restarts, and a giver that renumbers while it lives
takes a new one and ends its range flows first, so that a flow's incarnation is the one
its BOT stated. The reader never sends ``incarnation`` either (echo-proof as ``ranges``).

**Requests** ride on a PAY (the taker's only message in transfer), together with any
credit, which may be 0 for them (:mod:`.flow` allows it):

- ``"range": {"id": k, "producer": p, "incarnation": i, "start": s, "end": e}``: the
  records with sequence numbers ``s <= seq < e`` (the per-producer numbers of the spool
  path, from 1) of incarnation ``i``, the one the range was planned on.
- ``"held": {"id": k, "producer": p}``: the producer's held window.

``id`` is the reader's number for the request, unique within the flow and increasing;
every answer repeats it. One request at a time: a new one only after the answer ended.

**Answers** are DATs. The records of a range come in DATs of the flow's encoding (Arrow
with a ``seq`` column, or plain DATs with ``seq``), in order, each record once. Then one
DAT without payload ends it:

- ``"range": {"id": k, "status": "done", "start": s, "end": e}`` -- all of ``[s, e)`` was
  sent (none for ``s == e``);
- ``"range": {"id": k, "status": "not_held", "first": a, "end": b}`` -- the giver holds
  ``[a, b)`` for that producer, which does not cover the rest of the range. May follow
  some records (acks freed them while a speculative copy read): the reader discards the
  range, a data loss with these numbers;
- ``"range": {"id": k, "status": "other_incarnation", "incarnation": j, "first": a,
  "end": b}`` -- the giver's incarnation is ``j``, not the request's: never after a
  record; a data loss naming both incarnations;
- ``"range": {"id": k, "status": "unknown_producer"}`` -- the giver serves no such id (a
  data loss too).

For each refusal of a range, :meth:`RangeReader.loss` builds the
:class:`~zio_spark.errors.DataLossError` (the caller raises it when ``failOnDataLoss``
holds), naming the range, the producer and the incarnations.

A held query is answered by one DAT
``"held": {"id": k, "producer": p, "status": "held", "incarnation": i, "first": a,
"end": b}`` (or ``"status": "unknown_producer"``). A planner keeps, per producer id,
``{incarnation: i, end: b}`` in its offsets and puts ``i`` in every range it plans up to
``b``; a later held answer of another incarnation means the numbering restarted: the
ranges planned but not read are lost.

A held answer may also carry ``"full": true``: a send of the producer began to wait for
room in its window (unacknowledged records at the producer's limit) since the giver's
previous held answer on this flow, or waits now (the queue's flow producer: its window is
taken up and its store holds more). Absent means false (a giver of before this field
never sends it). It tells a planner that the producer is faster than the reads and its
window sets the batch sizes: the planner then reads at most half of what the producer
holds per batch (``direct.settled_end``), so that its batches, each held until the next
one's plan acks it, settle at half the window instead of alternating between a large
one and a small one.

**The rule for serving** is made before every DAT of the range: the request's
incarnation must be the giver's (else ``other_incarnation``, before any record), and with
``[first, end)`` the producer's held window now (``first``: the oldest record not yet
acknowledged, ``end``: the next sequence number to assign), the rest ``[next, e)`` of the
request is served only if ``first <= next`` and ``e <= end``. So a zero-length range is
answered ``done`` where its position lies in the window, and ``not_held`` elsewhere (a
giver whose window moved back restarted and lost records). A range that reaches beyond
``end`` is refused, never waited for: the planner asks only up to an end the giver
reported, and a giver's end never moves back while it lives, so such a request means the
giver restarted without its records; waiting would block the task, and after a restart
the numbers may name other records -- different data, where a re-read must give the same
rows or fail.

The reader checks the incarnation too: records for a range planned on another
incarnation than the one the giver stated in its BOT, a held answer of another
incarnation, or an ``other_incarnation`` refusal naming the request's own, are a
:class:`~zio_spark.errors.RemoteProtocolError`.

The giver frees records only on acks, so a retried or speculative task re-reads exactly
what the first attempt read, or is refused. A range flow never carries one; in the
direct mode they come on the driver's **control flow**: BOT ``"read": "control"`` (part
of version 1: a giver stating ``ranges: 1`` accepts it), on which the driver sends
``held`` queries and commits, never a range (no record ever flows on it). A commit is a
PAY ``"ack": n`` with ``"commit": {"id": k, "producer": p, "incarnation": i}`` (``i``:
the incarnation the committed offsets were planned on; an ``ack`` without it on a
control flow is a :class:`RemoteProtocolError`, a bare number could free another
numbering's records), answered by one DAT
``"commit": {"id": k, "status": "acked", "incarnation": i, "upto": n, "first": a,
"end": b}`` (every record ``<= n`` freed, or freed already: acks are monotonic, a
re-ack is a no-op; ``[a, b)`` the window after it), ``"status": "other_incarnation"``
with the giver's incarnation and window (nothing freed), or ``"unknown_producer"``. An
``ack`` of the giver's incarnation at or beyond ``end`` names no record of it: a
:class:`RemoteProtocolError` naming both numbers. A control flow is bound to its BOT's
incarnation as range flows are (a renumbering giver ends it).

**Run keys** (CURVE per query run, docs/direct-read.md "Security"): on a control flow
only, a PAY ``"admit": {"id": k, "key": K}`` (``K`` a CURVE public key in Z85 text)
asks the giver to admit clients with ``K`` for as long as this control flow lives (the
key the query's tasks read with). The answer is one DAT ``"admit": {"id": k, "status":
"admitted"}`` (the giver keeps an allow-list and put ``K`` on it, before answering) or
``"status": "open"`` (no allow-list: nothing stored). ``admit`` on a range flow is a
:class:`RemoteProtocolError`.

Everything here is pure: attribute mappings in, attribute dicts and events out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from zio_spark.errors import (
    DataLossError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from zio_spark.protocol.flow import Flow, pay_ack, profile_bot
from zio_spark.protocol.message import Message
from zio_spark.protocol.negotiate import own_statements

__all__ = [
    "CAPABILITY",
    "INCARNATION",
    "INCARNATION_MAX",
    "READ",
    "READ_CONTROL",
    "READ_RANGE",
    "SEQ_MAX",
    "VERSION",
    "Acked",
    "AdmitRequest",
    "Admitted",
    "CommitRefused",
    "CommitRequest",
    "Done",
    "HeldQuery",
    "HeldReport",
    "NotHeld",
    "OtherIncarnation",
    "RangeGiver",
    "RangeReader",
    "RangeRequest",
    "RangeTerms",
    "ReaderState",
    "Records",
    "Reply",
    "Request",
    "UnknownProducer",
    "Window",
    "check_curve_key",
    "check_incarnation",
    "client_range_terms",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "forbid_requests",
    "new_incarnation",
    "offer_attrs",
    "server_asks_range",
    "server_read_mode",
    "state_capability",
]

VERSION = 1
"""The version of the range protocol this module speaks."""

CAPABILITY = "ranges"
"""Giver BOT attribute: the range protocol version it serves (an integer >= 1)."""

READ = "read"
READ_RANGE = "range"
"""Taker BOT attribute ``read: "range"``: this flow carries range requests, no stream."""

READ_CONTROL = "control"
"""Taker BOT attribute ``read: "control"``: the driver's control flow to a producer:
``held`` queries and ``commit`` acks, never a range, never a record (part of version 1)."""

_READ_MODES = (READ_RANGE, READ_CONTROL)

SEQ_MAX = 2**63 - 1
"""Largest sequence number or request id (the Arrow ``seq`` column is an int64)."""

INCARNATION = "incarnation"
"""Giver BOT attribute, and a field of ``range`` requests, ``held`` answers and
``other_incarnation`` refusals: the name of the giver's sequence-number space."""

INCARNATION_MAX = 64
"""Longest incarnation, in characters (ASCII letters, digits, ``.``, ``_``, ``-``)."""

_INCARNATION_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{INCARNATION_MAX}}}")

_REQUEST_KEYS = ("range", "held", "commit", "admit")

CURVE_KEY_CHARS = 40
"""A CURVE public key's length in Z85 text (32 bytes)."""
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {c: i for i, c in enumerate(_Z85)}


# ------------------------------------------------------------------------- incarnation


def _incarnation(value: object, field: str, local: bool) -> str:
    if not isinstance(value, str) or _INCARNATION_RE.fullmatch(value) is None:
        raise _fail(
            local,
            f"{field} must be a string of 1..{INCARNATION_MAX} ASCII letters, digits, '.', "
            f"'_' or '-' (the giver's sequence-number space), got {value!r:.80}",
            field,
            value,
        )
    return value


def check_incarnation(value: object) -> str:
    """``value`` if it is a well-formed incarnation (1..64 ASCII letters, digits, ``.``,
    ``_``, ``-``): what a giver given one from outside (e.g. persisted with its records)
    checks before stating it.

    Raises
    ------
    LocalProtocolError
        ``field="incarnation"`` if it is not.
    """
    return _incarnation(value, INCARNATION, local=True)


def new_incarnation(entropy: bytes) -> str:
    """A fresh incarnation made of ``entropy`` (pass ``os.urandom(16)``): hex, so 16 random
    bytes give 32 characters.

    Raises
    ------
    LocalProtocolError
        If ``entropy`` is not 8..32 bytes (too few would let two restarts collide).
    """
    if not isinstance(entropy, bytes | bytearray) or not 8 <= len(entropy) <= 32:
        raise LocalProtocolError(
            f"incarnation entropy must be 8..32 bytes, got {entropy!r:.80}",
            field=INCARNATION,
            value=entropy,
        )
    return bytes(entropy).hex()


def _curve_key(value: object, field: str, local: bool) -> str:
    """``value`` if it is a CURVE public key in Z85 text: 40 characters of the Z85
    alphabet, each group of 5 a 32-bit number (so it decodes to 32 bytes)."""
    ok = isinstance(value, str) and len(value) == CURVE_KEY_CHARS
    if ok:
        assert isinstance(value, str)
        for i in range(0, CURVE_KEY_CHARS, 5):
            n = 0
            for c in value[i : i + 5]:
                digit = _Z85_VALUE.get(c)
                if digit is None:
                    ok = False
                    break
                n = n * 85 + digit
            if not ok or n >= 1 << 32:
                ok = False
                break
    if not ok:
        raise _fail(
            local,
            f"{field} must be a CURVE public key in Z85 text ({CURVE_KEY_CHARS} characters "
            f"of the Z85 alphabet), got {value!r:.80}",
            field,
            value,
        )
    assert isinstance(value, str)
    return value


def check_curve_key(value: object) -> str:
    """``value`` if it is a CURVE public key in Z85 text (what an ``admit`` request
    carries).

    Raises
    ------
    LocalProtocolError
        ``field="admit.key"`` if it is not.
    """
    return _curve_key(value, "admit.key", local=True)


# ------------------------------------------------------------------------- negotiation


@dataclass(frozen=True, slots=True)
class RangeTerms:
    """What a range reader learned from the giver's BOT.

    ``version`` is the range protocol version both speak (None: the giver did not state
    the capability as its own; send it no request). ``producer`` is the giver's own
    ``producer`` statement, ``incarnation`` its sequence-number space (stated with the
    capability, fixed for the flow's life).
    """

    version: int | None = None
    producer: str | None = None
    incarnation: str | None = None

    def __post_init__(self) -> None:
        if self.version is not None:
            _incarnation(self.incarnation, INCARNATION, local=True)

    @property
    def capable(self) -> bool:
        return self.version is not None


NOT_CAPABLE = RangeTerms()


def offer_attrs(attrs: Mapping[str, Any] | None = None, read: str = READ_RANGE) -> dict[str, Any]:
    """The extras of a range reader's BOT: ``attrs`` plus ``read: "range"`` (or
    ``read: "control"`` for the driver's control flow: ``read=READ_CONTROL``).

    Raises
    ------
    LocalProtocolError
        If ``attrs`` holds ``ranges`` or ``incarnation`` (a reader never states them: an
        echo would then pass for the giver's statement) or another ``read``.
    """
    out = dict(attrs or {})
    for key in (CAPABILITY, INCARNATION):
        if key in out:
            raise LocalProtocolError(
                f"a range reader's BOT must not carry {key!r} (got {out[key]!r}): "
                "an echo of it would pass for the giver's statement",
                field=key,
                value=out[key],
            )
    if read not in _READ_MODES:
        raise LocalProtocolError(
            f"read must be one of {', '.join(map(repr, _READ_MODES))}, got {read!r}",
            field=READ,
            value=read,
        )
    if out.get(READ, read) != read:
        raise LocalProtocolError(
            f"BOT {READ} must be {read!r} on this flow, got {out[READ]!r}",
            field=READ,
            value=out[READ],
        )
    out[READ] = read
    return out


def state_capability(attrs: Mapping[str, Any] | None, incarnation: str) -> dict[str, Any]:
    """A capable giver's BOT extras: ``attrs`` plus ``ranges: VERSION`` and
    ``incarnation`` (its current sequence-number space).

    Raises
    ------
    LocalProtocolError
        If ``attrs`` has no string ``producer`` (the statement counts only with the
        profile, so without it the reader would never use it), or ``incarnation`` is
        malformed.
    """
    _incarnation(incarnation, INCARNATION, local=True)
    out = dict(attrs or {})
    if not isinstance(out.get("producer"), str):
        raise LocalProtocolError(
            f"a giver stating {CAPABILITY!r} must state its producer id too, got "
            f"{out.get('producer')!r}",
            field="producer",
            value=out.get("producer"),
        )
    out[CAPABILITY] = VERSION
    out[INCARNATION] = incarnation
    return out


def client_range_terms(sent: Mapping[str, Any], reply: Mapping[str, Any]) -> RangeTerms:
    """The range terms of a flow we opened as the reader: ``sent`` our BOT's attributes,
    ``reply`` the server's. Only the server's own statements count (not echoes), and
    ``ranges`` only together with its own ``producer``; a capable server must state its
    ``incarnation`` too.

    Raises
    ------
    RemoteProtocolError
        If the server stated ``ranges`` that is not an integer >= 1, a profile attribute
        of the wrong type, or ``ranges`` and ``producer`` without a well-formed
        ``incarnation`` (``field="incarnation"``).
    """
    own = own_statements(sent, reply)
    prof = profile_bot(own)
    raw = own.get(CAPABILITY)
    if raw is None:
        return RangeTerms(None, prof.producer)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise RemoteProtocolError(
            f"BOT {CAPABILITY} must be an integer >= 1 (a range protocol version), got {raw!r}",
            field=CAPABILITY,
            value=raw,
        )
    if prof.producer is None:  # no profile: not a statement we trust
        return NOT_CAPABLE
    incarnation = _incarnation(own.get(INCARNATION), INCARNATION, local=False)
    return RangeTerms(min(raw, VERSION), prof.producer, incarnation)


def server_read_mode(bot: Mapping[str, Any]) -> str | None:
    """The flow the client's BOT (our server side's view) opens: :data:`READ_RANGE` (a
    range reader), :data:`READ_CONTROL` (the driver's control flow) or None (a taker of
    the stream).

    Raises
    ------
    RemoteProtocolError
        If ``read`` is present but neither (a mode we do not know: serving it as a
        stream would send data the client did not ask for).
    """
    raw = bot.get(READ)
    if raw is None:
        return None
    if not isinstance(raw, str) or raw not in _READ_MODES:
        raise RemoteProtocolError(
            f"BOT {READ} must be {READ_RANGE!r} or {READ_CONTROL!r}, got {raw!r}",
            field=READ,
            value=raw,
        )
    return raw


def server_asks_range(bot: Mapping[str, Any]) -> bool:
    """True if the client's BOT opens a flow of the range protocol (a range reader's or
    a control flow: :func:`server_read_mode` says which), False for a stream's taker.

    Raises
    ------
    RemoteProtocolError
        As :func:`server_read_mode`.
    """
    return server_read_mode(bot) is not None


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class RangeRequest:
    """Records ``start <= seq < end`` of ``producer`` (request number ``id``), numbered
    in ``incarnation`` (the one the range was planned on)."""

    id: int
    producer: str
    incarnation: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class HeldQuery:
    """The held window of ``producer`` (request number ``id``)."""

    id: int
    producer: str


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """The driver's commit on a control flow (request number ``id``): free every record
    of ``producer`` up to ``upto`` (inclusive), numbered in ``incarnation`` (the one the
    committed offsets were planned on). On the wire: PAY ``ack: upto`` with
    ``commit: {id, producer, incarnation}``."""

    id: int
    producer: str
    incarnation: str
    upto: int


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """The driver's run key on a control flow (request number ``id``): admit CURVE
    clients with the public key ``key`` (Z85 text) to this giver's port for as long as
    this control flow lives. On the wire: PAY ``admit: {id, key}``."""

    id: int
    key: str


Request = RangeRequest | HeldQuery | CommitRequest | AdmitRequest


@dataclass(frozen=True, slots=True)
class Done:
    """Every record of ``[start, end)`` was sent."""

    id: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class NotHeld:
    """The giver holds ``[first, end)``, which does not cover the request (or its rest)."""

    id: int
    first: int
    end: int


@dataclass(frozen=True, slots=True)
class OtherIncarnation:
    """The giver numbers its records as ``incarnation``, not the request's: the numbers
    asked for may name other records. ``[first, end)``: its held window (of its own
    incarnation)."""

    id: int
    incarnation: str
    first: int
    end: int


@dataclass(frozen=True, slots=True)
class UnknownProducer:
    """The giver serves no such producer id. ``query``: the answer to a held query,
    ``commit``: to a commit (neither: to a range)."""

    id: int
    query: bool = False
    commit: bool = False


@dataclass(frozen=True, slots=True)
class Acked:
    """A commit applied: every record up to ``upto`` of ``incarnation`` is freed (or was
    already: acks are monotonic), the held window now being ``[first, end)``."""

    id: int
    incarnation: str
    upto: int
    first: int
    end: int


@dataclass(frozen=True, slots=True)
class CommitRefused:
    """A commit of another incarnation than the giver's ``incarnation``: nothing freed
    (its numbers may name records no batch read). ``[first, end)``: the giver's window."""

    id: int
    incarnation: str
    first: int
    end: int


@dataclass(frozen=True, slots=True)
class HeldReport:
    """The producer's held window ``[first, end)``: records ``first .. end - 1``, numbered
    in ``incarnation``. A planner stores ``incarnation`` with the ``end`` it plans to and
    puts it in every range request it plans from this report. ``full``: a send of the
    producer began to wait for room in its window since the previous held answer, or
    waits now (module docstring)."""

    id: int
    producer: str
    incarnation: str
    first: int
    end: int
    full: bool = False


@dataclass(frozen=True, slots=True)
class Admitted:
    """The answer to an :class:`AdmitRequest`. ``gated`` True (``status: "admitted"``):
    the giver admits CURVE clients from an allow-list, and the key is on it until this
    control flow ends. False (``status: "open"``): the giver has no allow-list (any
    client that knows its server key, or any client at all without CURVE, gets in), so
    nothing was stored."""

    id: int
    gated: bool


Reply = (
    Done
    | NotHeld
    | OtherIncarnation
    | UnknownProducer
    | HeldReport
    | Acked
    | CommitRefused
    | Admitted
)


def _fail(local: bool, text: str, field: str, value: object) -> ProtocolError:
    if local:
        return LocalProtocolError(text, field=field, value=value)
    return RemoteProtocolError(text, field=field, value=value)


def _int(obj: Mapping[str, Any], where: str, key: str, local: bool, low: int = 0) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= SEQ_MAX:
        raise _fail(
            local,
            f"{where}.{key} must be an integer {low}..2**63-1, got {value!r}",
            f"{where}.{key}",
            value,
        )
    return value


def _producer(obj: Mapping[str, Any], where: str, local: bool) -> str:
    value = obj.get("producer")
    if not isinstance(value, str) or not value:
        raise _fail(
            local,
            f"{where}.producer must be a non-empty string, got {value!r}",
            f"{where}.producer",
            value,
        )
    return value


def _object(attrs: Mapping[str, Any], key: str, local: bool) -> Mapping[str, Any]:
    obj = attrs[key]
    if not isinstance(obj, Mapping):
        raise _fail(
            local,
            f"{key} must be a JSON object, got {type(obj).__name__}: {obj!r:.80}",
            key,
            obj,
        )
    return obj


def _window(obj: Mapping[str, Any], where: str, local: bool) -> tuple[int, int]:
    first = _int(obj, where, "first", local)
    end = _int(obj, where, "end", local)
    if first > end:
        raise _fail(
            local,
            f"{where}: first {first} must be <= end {end} (a window [first, end))",
            f"{where}.first",
            first,
        )
    return first, end


def _check_request(req: Mapping[str, Any], key: str, local: bool, ack: object = None) -> Request:
    rid = _int(req, key, "id", local)
    if key == "admit":
        return AdmitRequest(rid, _curve_key(req.get("key"), "admit.key", local))
    producer = _producer(req, key, local)
    if key == "held":
        return HeldQuery(rid, producer)
    incarnation = _incarnation(req.get(INCARNATION), f"{key}.{INCARNATION}", local)
    if key == "commit":
        upto = _int({"ack": ack}, "PAY", "ack", local)
        return CommitRequest(rid, producer, incarnation, upto)
    start = _int(req, key, "start", local)
    end = _int(req, key, "end", local)
    if start > end:
        raise _fail(
            local,
            f"range: start {start} must be <= end {end} (a range [start, end))",
            "range.start",
            start,
        )
    return RangeRequest(rid, producer, incarnation, start, end)


def encode_request(req: Request) -> dict[str, Any]:
    """The PAY extras of a request (pass them to :meth:`Flow.pay`).

    Raises
    ------
    LocalProtocolError
        If a field is out of range (as :func:`decode_request` would refuse it).
    """
    if isinstance(req, RangeRequest):
        key = "range"
        obj: dict[str, Any] = {
            "id": req.id,
            "producer": req.producer,
            "incarnation": req.incarnation,
            "start": req.start,
            "end": req.end,
        }
    elif isinstance(req, CommitRequest):
        obj = {"id": req.id, "producer": req.producer, "incarnation": req.incarnation}
        _check_request(obj, "commit", local=True, ack=req.upto)
        return {"ack": req.upto, "commit": obj}
    elif isinstance(req, AdmitRequest):
        key = "admit"
        obj = {"id": req.id, "key": req.key}
    else:
        key = "held"
        obj = {"id": req.id, "producer": req.producer}
    _check_request(obj, key, local=True)
    return {key: obj}


def decode_request(attrs: Mapping[str, Any]) -> Request | None:
    """The request a PAY's extras carry, None if it carries none (credit only).

    Raises
    ------
    RemoteProtocolError
        If both ``range`` and ``held`` are present, or a field is missing, of the wrong
        type or out of range (``field`` names it, e.g. ``range.start``).
    """
    key = _which(attrs, "a PAY carries one request")
    if key is None:
        return None
    return _check_request(_object(attrs, key, local=False), key, local=False, ack=attrs.get("ack"))


def _which(attrs: Mapping[str, Any], one: str) -> str | None:
    """Which of ``range``/``held`` ``attrs`` carry (None: neither); both are an error
    (``one`` says what may be carried: "a PAY carries one request")."""
    present = [k for k in _REQUEST_KEYS if k in attrs]
    if len(present) > 1:
        raise RemoteProtocolError(
            f"{one}, got {' and '.join(map(repr, present))}", field=present[0], value=present
        )
    return present[0] if present else None


def forbid_requests(attrs: Mapping[str, Any]) -> None:
    """Check a PAY on a flow that did not agree range reads carries no request.

    Raises
    ------
    RemoteProtocolError
        If it does (the peer sends what was not agreed).
    """
    for key in _REQUEST_KEYS:
        if key in attrs:
            raise RemoteProtocolError(
                f"PAY carries a {key!r} request on a flow that did not open with "
                f"{READ}: {READ_RANGE!r}",
                field=key,
                value=attrs[key],
            )


def encode_reply(reply: Reply) -> dict[str, Any]:
    """The extras of the DAT (without payload) that carries ``reply``.

    Raises
    ------
    LocalProtocolError
        If a field is out of range.
    """
    obj: dict[str, Any]
    if isinstance(reply, Done):
        key, obj = "range", {"id": reply.id, "status": "done", "start": reply.start}
        obj["end"] = reply.end
    elif isinstance(reply, NotHeld):
        key, obj = "range", {"id": reply.id, "status": "not_held", "first": reply.first}
        obj["end"] = reply.end
    elif isinstance(reply, OtherIncarnation):
        key, obj = "range", {"id": reply.id, "status": "other_incarnation"}
        obj[INCARNATION] = reply.incarnation
        obj["first"], obj["end"] = reply.first, reply.end
    elif isinstance(reply, UnknownProducer):
        key = _reply_key(reply)
        obj = {"id": reply.id, "status": "unknown_producer"}
    elif isinstance(reply, Acked):
        key, obj = "commit", {"id": reply.id, "status": "acked"}
        obj[INCARNATION], obj["upto"] = reply.incarnation, reply.upto
        obj["first"], obj["end"] = reply.first, reply.end
    elif isinstance(reply, CommitRefused):
        key, obj = "commit", {"id": reply.id, "status": "other_incarnation"}
        obj[INCARNATION] = reply.incarnation
        obj["first"], obj["end"] = reply.first, reply.end
    elif isinstance(reply, Admitted):
        key, obj = "admit", {"id": reply.id, "status": "admitted" if reply.gated else "open"}
    else:
        key = "held"
        obj = {"id": reply.id, "producer": reply.producer, "status": "held"}
        obj[INCARNATION] = reply.incarnation
        obj["first"], obj["end"] = reply.first, reply.end
        if reply.full:
            obj["full"] = True
    _check_reply(obj, key, local=True)
    return {key: obj}


_RANGE_STATUSES = ("done", "not_held", "other_incarnation", "unknown_producer")
_HELD_STATUSES = ("held", "unknown_producer")
_COMMIT_STATUSES = ("acked", "other_incarnation", "unknown_producer")
_ADMIT_STATUSES = ("admitted", "open")
_STATUSES = {
    "range": _RANGE_STATUSES,
    "held": _HELD_STATUSES,
    "commit": _COMMIT_STATUSES,
    "admit": _ADMIT_STATUSES,
}


def _reply_key(reply: Reply) -> str:
    """The DAT key an answer rides under: ``range``, ``held``, ``commit`` or ``admit``."""
    if isinstance(reply, Admitted):
        return "admit"
    if isinstance(reply, Acked | CommitRefused):
        return "commit"
    if isinstance(reply, HeldReport):
        return "held"
    if isinstance(reply, UnknownProducer):
        return "commit" if reply.commit else "held" if reply.query else "range"
    return "range"


def _check_reply(obj: Mapping[str, Any], key: str, local: bool) -> Reply:
    rid = _int(obj, key, "id", local)
    status = obj.get("status")
    allowed = _STATUSES[key]
    if not isinstance(status, str) or status not in allowed:
        raise _fail(
            local,
            f"{key}.status must be one of {', '.join(allowed)}, got {status!r}",
            f"{key}.status",
            status,
        )
    if status == "unknown_producer":
        return UnknownProducer(rid, query=key == "held", commit=key == "commit")
    if key == "admit":
        return Admitted(rid, gated=status == "admitted")
    if status == "done":
        start = _int(obj, key, "start", local)
        end = _int(obj, key, "end", local)
        if start > end:
            raise _fail(local, f"range: start {start} must be <= end {end}", "range.start", start)
        return Done(rid, start, end)
    first, end = _window(obj, key, local)
    if key == "commit":
        incarnation = _incarnation(obj.get(INCARNATION), f"{key}.{INCARNATION}", local)
        if status == "other_incarnation":
            return CommitRefused(rid, incarnation, first, end)
        upto = _int(obj, key, "upto", local)
        if not upto < first:
            raise _fail(
                local,
                f"commit: acked up to {upto}, but the window after it starts at {first} "
                "(it must start after what was freed)",
                f"{key}.upto",
                upto,
            )
        return Acked(rid, incarnation, upto, first, end)
    if status == "not_held":
        return NotHeld(rid, first, end)
    if status == "other_incarnation":
        incarnation = _incarnation(obj.get(INCARNATION), f"{key}.{INCARNATION}", local)
        return OtherIncarnation(rid, incarnation, first, end)
    producer = _producer(obj, key, local)
    incarnation = _incarnation(obj.get(INCARNATION), f"{key}.{INCARNATION}", local)
    full = obj.get("full", False)
    if not isinstance(full, bool):
        raise _fail(
            local,
            f"{key}: full must be true or false, got {type(full).__name__}: {full!r:.40}",
            f"{key}.full",
            full,
        )
    return HeldReport(rid, producer, incarnation, first, end, full)


def decode_reply(attrs: Mapping[str, Any]) -> Reply | None:
    """The answer a DAT's extras carry, None for a DAT of records.

    Raises
    ------
    RemoteProtocolError
        If both ``range`` and ``held`` are present, or a field is missing, of the wrong
        type or out of range (``field`` names it, e.g. ``range.status``).
    """
    key = _which(attrs, "a DAT carries one answer")
    if key is None:
        return None
    return _check_reply(_object(attrs, key, local=False), key, local=False)


# ------------------------------------------------------------------------- the giver


@dataclass(frozen=True, slots=True)
class Window:
    """A producer's held window now: records ``first .. end - 1`` (``first``: the oldest
    not yet acknowledged, ``end``: the next sequence number to assign). ``full``: a send
    began to wait for room in the window since this flow's previous held answer, or
    waits now (stated in a held answer only)."""

    first: int
    end: int
    full: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.full, bool):
            raise LocalProtocolError(
                f"window full must be a bool, got {self.full!r}", field="full", value=self.full
            )
        for name in ("first", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= SEQ_MAX:
                raise LocalProtocolError(
                    f"window {name} must be an integer 0..2**63-1, got {v!r}",
                    field=name,
                    value=v,
                )
        if self.first > self.end:
            raise LocalProtocolError(
                f"window first {self.first} must be <= end {self.end}",
                field="first",
                value=self.first,
            )


@dataclass(frozen=True, slots=True)
class Records:
    """Send the records ``first .. first + count - 1`` in one DAT (or fewer, from
    ``first``: tell :meth:`RangeGiver.sent` how many)."""

    first: int
    count: int


class RangeGiver:
    """The giver's side of a range flow: which DAT to send next.

    Made with the ``incarnation`` the giver stated in this flow's BOT: its
    sequence-number space, fixed for the flow's life (a giver whose numbering restarts
    while it lives takes a new incarnation and ends its range flows first). A range
    request planned on another incarnation is refused (:class:`OtherIncarnation`) before
    any record; held answers carry it.

    Feed each PAY's extras to :meth:`on_pay` (after :meth:`Flow.receive` accounted for
    its credit). While the flow holds credit, call :meth:`next` with the current held
    window of :attr:`producer` (None: this giver serves no such producer) and the most
    records per DAT; it returns :class:`Records` (encode them in one DAT in the flow's
    encoding, then call :meth:`sent`), a :class:`Reply` (send
    ``flow.send_dat((), encode_reply(reply))``: the request is then over), or None
    (nothing asked). Credit is the flow's: call :meth:`next` only when it holds some.

    ``control``: the flow opened with ``read: "control"`` (the driver's): it takes held
    queries and commits, never a range; a range flow takes ranges and held queries, never
    a commit. A commit is answered by :meth:`next` too: :class:`Acked` means *free every
    record up to* ``upto`` now (the caller does it, with the same window, under the same
    lock; freeing is monotonic, so an ``upto`` below the window frees nothing),
    :class:`CommitRefused` (another incarnation) or :class:`UnknownProducer` free nothing.
    An :class:`AdmitRequest` (control flows only) is answered :class:`Admitted` whatever
    the window: ``gated`` (the giver admits CURVE clients from an allow-list) means the
    caller puts the request's key on it, for as long as this flow lives, *before* it
    sends the answer; not gated, nothing is stored.
    """

    __slots__ = ("_cursor", "_request", "_served", "control", "gated", "incarnation")

    def __init__(self, incarnation: str, *, control: bool = False, gated: bool = False) -> None:
        self.incarnation = _incarnation(incarnation, INCARNATION, local=True)
        self.control = control
        self.gated = gated
        self._request: Request | None = None
        self._cursor = 0  # next seq of the current range request
        self._served = -1  # id of the last request taken, for the increasing-id rule

    @property
    def request(self) -> Request | None:
        """The request being answered, if any."""
        return self._request

    @property
    def producer(self) -> str | None:
        """The producer id whose window :meth:`next` needs, if a request is open."""
        req = self._request
        return None if req is None or isinstance(req, AdmitRequest) else req.producer

    def on_pay(self, attrs: Mapping[str, Any]) -> Request | None:
        """Take the request a PAY carries, if any.

        Raises
        ------
        RemoteProtocolError
            If the request does not decode, arrives while another is open, or its id
            does not increase; on a control flow, if it is a range (``field="range"``) or
            an ``ack`` comes without ``commit`` (``field="ack"``: a bare number could free
            records of another numbering); on a range flow, if it is a commit.
        """
        req = decode_request(attrs)
        if self.control:
            if isinstance(req, RangeRequest):
                raise RemoteProtocolError(
                    f"a control flow ({READ}: {READ_CONTROL!r}) carries no range request "
                    f"(range {req.id} of {req.producer!r}): open a range flow to read",
                    field="range",
                    value=req.id,
                )
            if not isinstance(req, CommitRequest) and pay_ack(attrs) is not None:
                raise RemoteProtocolError(
                    f"PAY ack {attrs.get('ack')!r} without 'commit' on a control flow: an "
                    "ack must name the producer and the incarnation it was committed in",
                    field="ack",
                    value=attrs.get("ack"),
                )
        elif isinstance(req, CommitRequest):
            raise RemoteProtocolError(
                f"a commit (ack {req.upto}) on a range flow: acks belong to the driver's "
                f"control flow ({READ}: {READ_CONTROL!r}), range reads free nothing",
                field="commit",
                value=req.id,
            )
        elif isinstance(req, AdmitRequest):
            raise RemoteProtocolError(
                f"an admit request (key {req.key!r}) on a range flow: run keys are "
                f"registered on the driver's control flow ({READ}: {READ_CONTROL!r}) only",
                field="admit",
                value=req.id,
            )
        if req is None:
            return None
        if self._request is not None:
            raise RemoteProtocolError(
                f"request {req.id} arrived while request {self._request.id} is still "
                "being answered (one at a time)",
                field=f"{_key(req)}.id",
                value=req.id,
            )
        if req.id <= self._served:
            raise RemoteProtocolError(
                f"request id {req.id} must be greater than the last one, {self._served}",
                field=f"{_key(req)}.id",
                value=req.id,
            )
        self._served = req.id
        self._request = req
        if isinstance(req, RangeRequest):
            self._cursor = req.start
        return req

    def next(self, window: Window | None, batch: int) -> Records | Reply | None:
        """What to send next for the open request (see the class docstring).

        Raises
        ------
        LocalProtocolError
            If ``batch`` is not an integer >= 1.
        RemoteProtocolError
            ``field="ack"`` for a commit of the giver's incarnation beyond the window's
            end (a record never numbered: the request is dropped, nothing freed).
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise LocalProtocolError(
                f"batch must be an integer >= 1, got {batch!r}", field="batch", value=batch
            )
        req = self._request
        if req is None:
            return None
        if isinstance(req, AdmitRequest):
            # The caller stores the key (gated) before it sends this answer.
            self._request = None
            return Admitted(req.id, gated=self.gated)
        if window is None:
            self._request = None
            return UnknownProducer(
                req.id, query=isinstance(req, HeldQuery), commit=isinstance(req, CommitRequest)
            )
        if isinstance(req, HeldQuery):
            self._request = None
            return HeldReport(
                req.id, req.producer, self.incarnation, window.first, window.end, window.full
            )
        if isinstance(req, CommitRequest):
            self._request = None
            if req.incarnation != self.incarnation:
                return CommitRefused(req.id, self.incarnation, window.first, window.end)
            if req.upto >= window.end:
                raise RemoteProtocolError(
                    f"commit {req.id}: ack {req.upto} of {req.producer!r} is beyond the "
                    f"producer's end: its last record is {window.end - 1} (incarnation "
                    f"{self.incarnation!r})",
                    field="ack",
                    value=req.upto,
                )
            first = max(window.first, req.upto + 1)
            return Acked(req.id, self.incarnation, req.upto, first, window.end)
        # The rule: the numbers are the ones planned on, and the rest [cursor, end) lies
        # in the window, now.
        if req.incarnation != self.incarnation:
            self._request = None
            return OtherIncarnation(req.id, self.incarnation, window.first, window.end)
        if window.first > self._cursor or req.end > window.end:
            self._request = None
            return NotHeld(req.id, window.first, window.end)
        if self._cursor == req.end:
            self._request = None
            return Done(req.id, req.start, req.end)
        return Records(self._cursor, min(batch, req.end - self._cursor))

    def sent(self, records: Records, count: int | None = None) -> None:
        """The DAT for ``records`` went out with ``count`` of them (default: all).

        Raises
        ------
        LocalProtocolError
            If ``records`` is not what :meth:`next` asked for now, or ``count`` is not
            1..``records.count``.
        """
        req = self._request
        n = records.count if count is None else count
        if not isinstance(req, RangeRequest) or records.first != self._cursor:
            raise LocalProtocolError(
                f"sent records from {records.first}, but the range reads from "
                f"{self._cursor if isinstance(req, RangeRequest) else 'nothing (no range open)'}",
                field="first",
                value=records.first,
            )
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= records.count:
            raise LocalProtocolError(
                f"sent count must be 1..{records.count}, got {n!r}", field="count", value=n
            )
        if records.first + records.count > req.end:
            raise LocalProtocolError(
                f"records {records.first}..{records.first + records.count - 1} pass the "
                f"range end {req.end}",
                field="count",
                value=records.count,
            )
        self._cursor += n


def _key(req: Request) -> str:
    if isinstance(req, AdmitRequest):
        return "admit"
    if isinstance(req, CommitRequest):
        return "commit"
    return "range" if isinstance(req, RangeRequest) else "held"


# ------------------------------------------------------------------------ the reader


class ReaderState(str, Enum):
    IDLE = "IDLE"  # nothing asked, or the last answer is in
    REQUESTED = "REQUESTED"  # a request is out, nothing back yet
    RECEIVING = "RECEIVING"  # records of the range are arriving
    DONE = "DONE"  # the range arrived whole
    REFUSED = "REFUSED"  # the giver refused (not held, unknown producer)
    ERROR = "ERROR"  # the giver broke the protocol; terminal


class RangeReader:
    """The taker's side of a range flow.

    Made with the :class:`RangeTerms` of the flow (:func:`client_range_terms`): without
    the capability, every request is a :class:`LocalProtocolError` and nothing is built.
    :meth:`request` / :meth:`query` give the PAY extras (or :meth:`send_request` /
    :meth:`send_query` the PAY itself). For each DAT, pass its extras to :meth:`on_dat`:
    an answer comes back as a :class:`Reply`; for a DAT of records (None) decode its
    payload and pass the span to :meth:`records`, which checks that the records arrive
    in order, each once, inside the range.

    A range is requested with the incarnation it was planned on (the one of the
    :class:`HeldReport` the planner read). The giver refuses it with
    :class:`OtherIncarnation` if that is not its own; the reader checks it too, against
    the incarnation the giver stated in its BOT: records of a range planned on another
    one are a :class:`RemoteProtocolError`, never taken. A refusal of a range
    (not held, other incarnation, unknown producer) is the caller's data loss:
    :meth:`loss` builds the :class:`~zio_spark.errors.DataLossError` to raise when
    ``failOnDataLoss`` holds.
    """

    __slots__ = ("_cursor", "_next_id", "_request", "state", "terms")

    def __init__(self, terms: RangeTerms) -> None:
        self.terms = terms
        self.state = ReaderState.IDLE
        self._request: Request | None = None
        self._next_id = 0
        self._cursor = 0

    @property
    def current(self) -> Request | None:
        """The request out now (or last answered)."""
        return self._request

    @property
    def received(self) -> int:
        """Records of the current range received so far."""
        req = self._request
        return self._cursor - req.start if isinstance(req, RangeRequest) else 0

    def _ready(self) -> None:
        if not self.terms.capable:
            raise LocalProtocolError(
                f"the giver did not state {CAPABILITY!r} as its own: a range request is "
                "never sent to it (read this producer through the spool path)",
                field=CAPABILITY,
                value=None,
            )
        if self.state not in (ReaderState.IDLE, ReaderState.DONE, ReaderState.REFUSED):
            raise LocalProtocolError(
                f"cannot send a request in state {self.state.value} (one at a time: "
                "needs IDLE, DONE or REFUSED)",
                field="state",
                value=self.state.value,
            )

    def _out(self, req: Request) -> dict[str, Any]:
        attrs = encode_request(req)  # checks the fields before any state changes
        self._request = req
        self._next_id += 1
        self.state = ReaderState.REQUESTED
        if isinstance(req, RangeRequest):
            self._cursor = req.start
        return attrs

    def request(self, producer: str, incarnation: str, start: int, end: int) -> dict[str, Any]:
        """The PAY extras asking for records ``[start, end)`` of ``producer``, numbered in
        ``incarnation`` (the one the range was planned on).

        Raises
        ------
        LocalProtocolError
            Without the capability, with a request still open, or with a bad field.
        """
        self._ready()
        return self._out(RangeRequest(self._next_id, producer, incarnation, start, end))

    def query(self, producer: str) -> dict[str, Any]:
        """The PAY extras asking for the held window of ``producer``.

        Raises
        ------
        LocalProtocolError
            As :meth:`request`.
        """
        self._ready()
        return self._out(HeldQuery(self._next_id, producer))

    def commit(self, producer: str, incarnation: str, upto: int) -> dict[str, Any]:
        """The PAY extras of a commit on a control flow: free the records of ``producer``
        up to ``upto``, committed in ``incarnation`` (``ack`` and ``commit``).

        Raises
        ------
        LocalProtocolError
            As :meth:`request`.
        """
        self._ready()
        return self._out(CommitRequest(self._next_id, producer, incarnation, upto))

    def send_commit(
        self, flow: Flow, producer: str, incarnation: str, upto: int, credit: int | None = None
    ) -> Message:
        """:meth:`commit` on a PAY of ``flow`` (see :meth:`send_request`)."""
        self._ready()
        req = CommitRequest(self._next_id, producer, incarnation, upto)
        attrs = encode_request(req)
        msg = flow.pay(flow.credit if credit is None else credit, attrs)
        self._out(req)
        return msg

    def admit(self, key: str) -> dict[str, Any]:
        """The PAY extras of an admit request on a control flow: let CURVE clients with
        the public key ``key`` (Z85 text) in while this flow lives.

        Raises
        ------
        LocalProtocolError
            As :meth:`request` (``field="admit.key"`` for a malformed key).
        """
        self._ready()
        return self._out(AdmitRequest(self._next_id, key))

    def send_admit(self, flow: Flow, key: str, credit: int | None = None) -> Message:
        """:meth:`admit` on a PAY of ``flow`` (see :meth:`send_request`)."""
        self._ready()
        req = AdmitRequest(self._next_id, key)
        attrs = encode_request(req)
        msg = flow.pay(flow.credit if credit is None else credit, attrs)
        self._out(req)
        return msg

    def send_request(
        self,
        flow: Flow,
        producer: str,
        incarnation: str,
        start: int,
        end: int,
        credit: int | None = None,
    ) -> Message:
        """:meth:`request` on a PAY of ``flow`` with ``credit`` (default: all it holds,
        possibly 0).

        Raises
        ------
        LocalProtocolError
            As :meth:`request`, or from :meth:`Flow.pay` (then nothing is out).
        """
        self._ready()
        req = RangeRequest(self._next_id, producer, incarnation, start, end)
        attrs = encode_request(req)
        msg = flow.pay(flow.credit if credit is None else credit, attrs)
        self._out(req)
        return msg

    def send_query(self, flow: Flow, producer: str, credit: int | None = None) -> Message:
        """:meth:`query` on a PAY of ``flow`` (see :meth:`send_request`)."""
        self._ready()
        attrs = encode_request(HeldQuery(self._next_id, producer))
        msg = flow.pay(flow.credit if credit is None else credit, attrs)
        self._out(HeldQuery(self._next_id, producer))
        return msg

    def _remote(self, text: str, field: str, value: object) -> RemoteProtocolError:
        self.state = ReaderState.ERROR
        return RemoteProtocolError(text, field=field, value=value)

    def _check_live(self) -> None:
        if self.state is ReaderState.ERROR:
            raise LocalProtocolError("range reader is in ERROR state", field="state")

    def _check_records_incarnation(self, req: RangeRequest) -> None:
        if req.incarnation != self.terms.incarnation:
            raise self._remote(
                f"range {req.id}: the giver of incarnation {self.terms.incarnation!r} sent "
                f"records of [{req.start}, {req.end}) of {req.producer!r}, planned on "
                f"incarnation {req.incarnation!r} (it must refuse with other_incarnation: "
                "its numbers may name other records)",
                f"range.{INCARNATION}",
                self.terms.incarnation,
            )

    def loss(self, reply: Reply) -> DataLossError:
        """The :class:`~zio_spark.errors.DataLossError` for a refusal of the current
        range (:class:`NotHeld`, :class:`OtherIncarnation`, :class:`UnknownProducer`),
        naming the range, the producer and both incarnations; the caller raises it when
        ``failOnDataLoss`` holds (else the range reads as empty, with a warning).

        Raises
        ------
        LocalProtocolError
            If no range is open or was last answered, or ``reply`` is not a refusal of it.
        """
        req = self._request
        refusal = (NotHeld, OtherIncarnation, UnknownProducer)
        if (
            not isinstance(req, RangeRequest)
            or not isinstance(reply, refusal)
            or reply.id != req.id
            or (isinstance(reply, UnknownProducer) and reply.query)
        ):
            raise LocalProtocolError(
                f"no data loss in {reply!r} for the request {req!r}", field="reply", value=reply
            )
        what = (
            f"records [{req.start}, {req.end}) of producer {req.producer!r} "
            f"(incarnation {req.incarnation!r})"
        )
        got = "" if self._cursor == req.start else f" ({self._cursor - req.start} discarded)"
        if isinstance(reply, OtherIncarnation):
            text = (
                f"{what} are lost: the producer now numbers its records as incarnation "
                f"{reply.incarnation!r} (holding [{reply.first}, {reply.end})), so it "
                "restarted without them and the same numbers name other records"
            )
        elif isinstance(reply, NotHeld):
            text = (
                f"{what} are no longer held: the producer holds [{reply.first}, "
                f"{reply.end}) of incarnation {self.terms.incarnation!r}"
            )
        else:
            text = f"{what} are lost: the giver serves no producer {req.producer!r}"
        return DataLossError(text + got, producer=req.producer)

    def on_dat(self, attrs: Mapping[str, Any]) -> Reply | None:
        """The answer a DAT carries (the request is then over), or None for records.

        Raises
        ------
        RemoteProtocolError
            If the extras do not decode, answer another request or nothing asked, or
            a ``done`` does not match the records received (the reader is then in ERROR).
        """
        self._check_live()
        try:
            reply = decode_reply(attrs)
        except RemoteProtocolError:
            self.state = ReaderState.ERROR
            raise
        req = self._request
        waiting = self.state in (ReaderState.REQUESTED, ReaderState.RECEIVING)
        if reply is None:
            if not waiting or not isinstance(req, RangeRequest):
                raise self._remote(
                    f"a DAT of records arrived in state {self.state.value}, with no range "
                    "request open",
                    "flow",
                    "DAT",
                )
            self._check_records_incarnation(req)
            return None
        key = _reply_key(reply)
        if not waiting or req is None:
            raise self._remote(
                f"an answer to request {reply.id} arrived with none open "
                f"(state {self.state.value})",
                f"{key}.id",
                reply.id,
            )
        if reply.id != req.id:
            raise self._remote(
                f"an answer to request {reply.id} arrived while request {req.id} is open",
                f"{key}.id",
                reply.id,
            )
        if key != _key(req):
            raise self._remote(
                f"a {key!r} answer arrived for a {_key(req)!r} request {req.id}",
                key,
                reply.id,
            )
        if isinstance(reply, Done):
            assert isinstance(req, RangeRequest)
            if (reply.start, reply.end) != (req.start, req.end) or self._cursor != req.end:
                raise self._remote(
                    f"range {req.id} done as [{reply.start}, {reply.end}) but "
                    f"[{req.start}, {req.end}) was asked and records up to "
                    f"{self._cursor - 1} arrived",
                    "range.end",
                    reply.end,
                )
            self.state = ReaderState.DONE
        elif isinstance(reply, HeldReport):
            assert isinstance(req, HeldQuery)
            if reply.producer != req.producer:
                raise self._remote(
                    f"held window of {reply.producer!r} arrived for a query of {req.producer!r}",
                    "held.producer",
                    reply.producer,
                )
            if reply.incarnation != self.terms.incarnation:
                raise self._remote(
                    f"held window of incarnation {reply.incarnation!r} arrived on a flow "
                    f"whose giver stated incarnation {self.terms.incarnation!r} (fixed for "
                    "the flow's life)",
                    f"held.{INCARNATION}",
                    reply.incarnation,
                )
            self.state = ReaderState.IDLE
        elif isinstance(reply, Acked):
            assert isinstance(req, CommitRequest)
            if (
                reply.upto != req.upto
                or reply.incarnation != req.incarnation
                or reply.incarnation != self.terms.incarnation
            ):
                raise self._remote(
                    f"commit {req.id} acked as {reply.upto} of incarnation "
                    f"{reply.incarnation!r}, but {req.upto} of {req.incarnation!r} was sent "
                    f"and the giver stated {self.terms.incarnation!r} in its BOT (a commit "
                    "of another incarnation must be refused, never applied)",
                    "commit.upto" if reply.upto != req.upto else f"commit.{INCARNATION}",
                    reply.upto if reply.upto != req.upto else reply.incarnation,
                )
            self.state = ReaderState.IDLE
        elif isinstance(reply, CommitRefused):
            assert isinstance(req, CommitRequest)
            if reply.incarnation == req.incarnation or reply.incarnation != self.terms.incarnation:
                raise self._remote(
                    f"commit {req.id} refused as other_incarnation {reply.incarnation!r}, but "
                    f"it was sent in {req.incarnation!r} and the giver stated "
                    f"{self.terms.incarnation!r} in its BOT",
                    f"commit.{INCARNATION}",
                    reply.incarnation,
                )
            self.state = ReaderState.REFUSED
        elif isinstance(reply, Admitted):
            self.state = ReaderState.IDLE
        elif isinstance(reply, OtherIncarnation) and isinstance(req, RangeRequest):
            if reply.incarnation == req.incarnation or reply.incarnation != self.terms.incarnation:
                raise self._remote(
                    f"range {req.id} refused as other_incarnation {reply.incarnation!r}, but "
                    f"it was asked on {req.incarnation!r} and the giver stated "
                    f"{self.terms.incarnation!r} in its BOT (the refusal must name the "
                    "giver's own incarnation, different from the request's)",
                    f"range.{INCARNATION}",
                    reply.incarnation,
                )
            self.state = ReaderState.REFUSED
        elif isinstance(reply, NotHeld) and isinstance(req, RangeRequest):
            if reply.first <= self._cursor and req.end <= reply.end:
                raise self._remote(
                    f"range {req.id} refused as not held, but the stated window "
                    f"[{reply.first}, {reply.end}) covers the rest [{self._cursor}, {req.end})",
                    "range.first",
                    reply.first,
                )
            self.state = ReaderState.REFUSED
        else:
            self.state = ReaderState.REFUSED
        return reply

    def records(self, first: int, count: int) -> None:
        """A DAT of the range brought records ``first .. first + count - 1``.

        Raises
        ------
        RemoteProtocolError
            ``field="seq"`` if they are not the next ones of the range (a duplicate, a
            gap or out of order), ``field="count"`` if there are none or they pass its
            end (the reader is then in ERROR).
        LocalProtocolError
            If no range is open (call :meth:`on_dat` first), or ``first``/``count`` are
            not integers.
        """
        self._check_live()
        req = self._request
        if not isinstance(req, RangeRequest) or self.state not in (
            ReaderState.REQUESTED,
            ReaderState.RECEIVING,
        ):
            raise LocalProtocolError(
                f"records given in state {self.state.value} with no range open",
                field="state",
                value=self.state.value,
            )
        for name, v in (("first", first), ("count", count)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise LocalProtocolError(
                    f"records {name} must be an integer, got {v!r}", field=name, value=v
                )
        self._check_records_incarnation(req)
        if count < 1:
            raise self._remote(
                f"a DAT of range {req.id} holds {count} records, expected >= 1", "count", count
            )
        if first != self._cursor:
            what = "a duplicate" if first < self._cursor else "a gap or out of order"
            raise self._remote(
                f"range {req.id}: records from {first} arrived, expected {self._cursor} ({what})",
                "seq",
                first,
            )
        if first + count > req.end:
            raise self._remote(
                f"range {req.id}: records {first}..{first + count - 1} pass its end "
                f"{req.end} (asked [{req.start}, {req.end}))",
                "count",
                count,
            )
        self._cursor = first + count
        self.state = ReaderState.RECEIVING
