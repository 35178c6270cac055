"""PZQ producer, consumer and monitor frames (the wire codecs).

Theory of operation (spec: ``specs/pzq-sockets-and-formats.txt``)
-----------------------------------------------------------------
A PZQ queue has three sockets. Producers (DEALER) push messages into the *receive*
socket and get one ack per message; consumers (ROUTER) receive deliveries from the *send*
socket and answer each with an ack or nack; a monitor (REQ) asks the *monitor* socket for
``MONITOR`` and gets ``key: value`` lines back. Every PZQ frame puts protocol fields first,
then an empty *delimiter* part, then user data, so headers may be added without breaking
readers: parts between the fixed fields and the delimiter are kept as ``extra`` and
otherwise ignored.

This module is pure: frames in, dataclasses out, and back. It never touches a socket or a
clock; time is passed in as ``now_us`` (integer microseconds). The queue's table of
deliveries awaiting an ack is beside it, in :mod:`zio_spark.protocol.pzq_inflight`.

Routing envelopes are *not* part of the frames handled here. Each ROUTER socket prepends
the sender's identity on receive and consumes a destination identity on send; the
transport strips or adds that part (:func:`split_identity` helps). The queue's *send*
socket is a DEALER with a fixed routing identity, as in the reference daemon (a ROUTER
in the queue's optional ``router`` mode, which then adds the consumer identity first).
Concretely:

===================  ============================================  ===========================
frame                what the sender writes                        what the receiver reads
===================  ============================================  ===========================
producer message     DEALER: ``[id, *extra, b"", *body]``          queue ROUTER: ``[producer
                                                                   identity] + those``
producer ack         queue ROUTER: ``[producer identity, id,``     DEALER: ``[id, b"1"|b"0",
                     ``b"1"|b"0", *extra, b"", reason]``           *extra, b"", reason]``
delivery             queue DEALER: ``[id, sent, timeout,``         consumer ROUTER: ``[queue
                     ``*extra, b"", *body]``                       identity, id, sent,
                                                                   timeout, *extra, b"",
                                                                   *body]``
consumer ack         consumer ROUTER: ``[queue identity, id,``     queue DEALER: ``[id,
                     ``b"1"|b"0"]``                                b"1"|b"0"]``
monitor request      REQ: ``[b"MONITOR"]``                         REP: ``[b"MONITOR"]``
monitor reply        REP: ``[b"key: value\\n..."]``                REQ: the same one part
===================  ============================================  ===========================

Decoders take the right-hand column with any leading ROUTER identity removed (a DEALER
or REP receives no identity; a ROUTER serving REQ monitors must also drop the REQ's empty
envelope part). The "queue identity" a consumer sees (spec part 0) is what it must put
first when it acks, and lets one consumer read from several queues.

Decoders raise only :class:`~zio_spark.errors.RemoteProtocolError` on bad input, whatever
the bytes; constructing a message with bad fields or passing a non-sequence raises
:class:`~zio_spark.errors.LocalProtocolError`.

The spec text is the contract, and the reference daemon (mkoppanen/pzq, as run: FACTS in
``specs/pzq-sockets-and-formats.txt``) follows it on every frame above: producer acks
``[id, b"1"|b"0", b"", reason]``, consumer acks ``[queue identity, id, b"1"|b"0"]``.
Where they part: the daemon's monitor writes ``messages_inflight`` and
``inflight_db_size`` where the spec's example writes ``messages_in_flight`` and
``in_flightdb_size`` (a queue answers with both spellings:
:data:`REFERENCE_MONITOR_KEYS`), and the id a consumer sees is the daemon's own store key
(``<µs>|<uuid>``), where this queue passes the producer's id on. (Early versions of its
PHP client library, still in its repository's history, spoke an older dialect: producer
acks ``[b"", id, b"OK"]``, consumer acks ``[queue identity, b"", id]``. Neither the
daemon as run nor this module reads those.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zio_spark.protocol.pzq_fields import (
    DELIMITER,
    MAX_TIMESTAMP_US,
    as_parts,
    check_bool,
    check_instance,
    check_message_id,
    check_parts,
    check_time,
    decode_delimiter,
    decode_extra_and_body,
    decode_message_id,
    decode_timestamp,
    local_error,
    remote_error,
    show,
)

__all__ = [
    "ACK_FAILURE",
    "ACK_SUCCESS",
    "DELIMITER",
    "MAX_TIMESTAMP_US",
    "MONITOR_KEYS",
    "MONITOR_REQUEST",
    "REFERENCE_MONITOR_KEYS",
    "ConsumerAck",
    "Delivery",
    "ProducerAck",
    "ProducerMessage",
    "decode_consumer_ack",
    "decode_delivery",
    "decode_monitor_reply",
    "decode_monitor_request",
    "decode_producer_ack",
    "decode_producer_message",
    "encode_consumer_ack",
    "encode_delivery",
    "encode_monitor_reply",
    "encode_monitor_request",
    "encode_producer_ack",
    "encode_producer_message",
    "is_expired",
    "split_identity",
]

ACK_SUCCESS = b"1"
"""Status / ACK value meaning success (producer ack) or "done, delete it" (consumer ack)."""

ACK_FAILURE = b"0"
"""Status / ACK value meaning failure (producer ack) or "requeue now" (consumer ack)."""

MONITOR_REQUEST = b"MONITOR"
"""The one part a monitor sends to ask for statistics."""

MONITOR_KEYS: tuple[str, ...] = (
    "messages",
    "messages_in_flight",
    "db_size",
    "in_flightdb_size",
    "syncs",
    "expired_messages",
)
"""The statistics a PZQ monitor reply carries, in the spec's order and spelling."""

REFERENCE_MONITOR_KEYS: tuple[str, ...] = ("messages_inflight", "inflight_db_size")
"""The reference daemon's spelling of the spec's ``messages_in_flight`` and
``in_flightdb_size`` (same values; a queue writes both so either reader finds its keys)."""

# --------------------------------------------------------------------------- producer


@dataclass(frozen=True, slots=True)
class ProducerMessage:
    """A message a producer adds to the queue (producer DEALER -> queue *receive* socket).

    Wire form: ``[message_id, *extra, b"", *body]``.

    Parameters
    ----------
    message_id
        The producer's id for the message; the queue's ack carries it back. Non-empty.
    body
        The user data, at least one part; parts may be empty and pass through unmodified.
    extra
        Protocol parts between the id and the delimiter. Readers ignore them; they are kept
        so a decode/encode round trip is exact. Each must be non-empty.

    Raises
    ------
    LocalProtocolError
        If a field has the wrong type, the id is empty, the body has no parts, or an extra
        part is empty.
    """

    message_id: bytes
    body: tuple[bytes, ...]
    extra: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        kind = "ProducerMessage"
        check_message_id(kind, self.message_id)
        object.__setattr__(self, "body", check_parts(kind, "body", self.body, data=True))
        object.__setattr__(self, "extra", check_parts(kind, "extra", self.extra, data=False))


def encode_producer_message(message: ProducerMessage) -> list[bytes]:
    """Frames for a producer to send: ``[message_id, *extra, b"", *body]``.

    Parameters
    ----------
    message
        The message to send.

    Returns
    -------
    list[bytes]
        The multipart message for a DEALER socket (no identity part).

    Raises
    ------
    LocalProtocolError
        If ``message`` is not a :class:`ProducerMessage`.
    """
    check_instance("encode_producer_message", message, ProducerMessage)
    return [message.message_id, *message.extra, DELIMITER, *message.body]


def decode_producer_message(frames: Sequence[bytes]) -> ProducerMessage:
    """Parse a producer's message, as the queue reads it after the producer's identity.

    The first empty part after the id is the delimiter; any parts between the id and it
    are kept in ``extra`` and otherwise ignored; everything after it is the body.

    Parameters
    ----------
    frames
        The parts after the ROUTER identity: ``[message_id, *extra, b"", *body]``.

    Returns
    -------
    ProducerMessage

    Raises
    ------
    RemoteProtocolError
        If the id is missing or empty (field ``message_id``), there is no empty part after
        it (``delimiter``), or nothing follows the delimiter (``body``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    kind = "producer message"
    parts = as_parts(frames, kind)
    message_id = decode_message_id(parts, kind)
    extra, body = decode_extra_and_body(parts, 1, kind)
    return ProducerMessage(message_id, body, extra)


@dataclass(frozen=True, slots=True)
class ProducerAck:
    """The queue's answer to one producer message (queue *receive* socket -> producer).

    Wire form: ``[message_id, b"1" | b"0", *extra, b"", reason]``.

    Parameters
    ----------
    message_id
        The id of the acknowledged :class:`ProducerMessage`.
    ok
        True when the queue has stored the message durably.
    reason
        Human-readable detail, typically why ``ok`` is False; may be empty. Sent as one
        UTF-8 part.
    extra
        Protocol parts between the status and the delimiter (ignored by readers).

    Raises
    ------
    LocalProtocolError
        If a field has the wrong type, the id is empty, an extra part is empty, or
        ``reason`` cannot be encoded as UTF-8.
    """

    message_id: bytes
    ok: bool
    reason: str = ""
    extra: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        kind = "ProducerAck"
        check_message_id(kind, self.message_id)
        check_bool(kind, "ok", self.ok)
        if not isinstance(self.reason, str):
            raise local_error(
                kind, "reason", f"is a {type(self.reason).__name__}", "a str", self.reason
            )
        try:
            self.reason.encode("utf-8")
        except UnicodeEncodeError:
            raise local_error(
                kind, "reason", f"is {self.reason!r}", "text encodable as UTF-8", self.reason
            ) from None
        object.__setattr__(self, "extra", check_parts(kind, "extra", self.extra, data=False))


def encode_producer_ack(ack: ProducerAck) -> list[bytes]:
    """Frames for the queue to send back: ``[message_id, b"1"|b"0", *extra, b"", reason]``.

    Parameters
    ----------
    ack
        The acknowledgement.

    Returns
    -------
    list[bytes]
        The multipart message, without the producer identity the ROUTER needs first.

    Raises
    ------
    LocalProtocolError
        If ``ack`` is not a :class:`ProducerAck`.
    """
    check_instance("encode_producer_ack", ack, ProducerAck)
    status = ACK_SUCCESS if ack.ok else ACK_FAILURE
    return [ack.message_id, status, *ack.extra, DELIMITER, ack.reason.encode("utf-8")]


def decode_producer_ack(frames: Sequence[bytes]) -> ProducerAck:
    """Parse the queue's ack, as a producer's DEALER receives it.

    Only a status of exactly ``b"1"`` is success. The spec's prose also mentions ``OK`` /
    ``NO``; following its rule that anything but the success value is a failure, every
    other non-empty status (``b"0"``, ``b"OK"``, ``b"NO"``, ...) decodes as ``ok=False``,
    so a producer never mistakes an unknown status for a stored message. The parts after
    the delimiter are the reason: decoded as UTF-8 (bad bytes replaced, since it is only
    for humans) and joined with ``"\\n"``; there may be none.

    Parameters
    ----------
    frames
        ``[message_id, status, *extra, b"", *reason]``.

    Returns
    -------
    ProducerAck

    Raises
    ------
    RemoteProtocolError
        If the id is missing or empty (``message_id``), the status is missing or empty
        (``status``), or there is no empty part after the status (``delimiter``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    kind = "producer ack"
    parts = as_parts(frames, kind)
    message_id = decode_message_id(parts, kind)
    if len(parts) < 2 or not parts[1]:
        got = "is missing (only 1 part)" if len(parts) < 2 else "is empty"
        raise remote_error(kind, "status", got, 'b"1" (success) or b"0" (failure) at part 1', None)
    delimiter = decode_delimiter(parts, 2, kind)
    reason = b"\n".join(parts[delimiter + 1 :]).decode("utf-8", "replace")
    return ProducerAck(message_id, parts[1] == ACK_SUCCESS, reason, tuple(parts[2:delimiter]))


# --------------------------------------------------------------------------- consumer


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message the queue hands to a consumer (queue *send* socket -> consumer ROUTER).

    Wire form after the routing identity:
    ``[message_id, sent_us, ack_timeout_us, *extra, b"", *body]``, the two times as ASCII
    decimal microseconds. The consumer's ROUTER receives ``[queue identity] + those``.

    Parameters
    ----------
    message_id
        The queue's id for the message (not necessarily the producer's); ack with it.
    sent_us
        When the queue sent it, in microseconds since the epoch.
    ack_timeout_us
        How long the queue waits for an ack before it resends, in microseconds.
    body
        The user data, at least one part.
    extra
        Header parts between the times and the delimiter (ignored by readers).

    Raises
    ------
    LocalProtocolError
        If a field has the wrong type, the id is empty, a time is outside
        ``0..MAX_TIMESTAMP_US``, the body has no parts, or an extra part is empty.
    """

    message_id: bytes
    sent_us: int
    ack_timeout_us: int
    body: tuple[bytes, ...]
    extra: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        kind = "Delivery"
        check_message_id(kind, self.message_id)
        check_time(kind, "sent_us", self.sent_us)
        check_time(kind, "ack_timeout_us", self.ack_timeout_us)
        object.__setattr__(self, "body", check_parts(kind, "body", self.body, data=True))
        object.__setattr__(self, "extra", check_parts(kind, "extra", self.extra, data=False))

    @property
    def deadline_us(self) -> int:
        """``sent_us + ack_timeout_us``: after this the queue will resend the message."""
        return self.sent_us + self.ack_timeout_us


def encode_delivery(delivery: Delivery) -> list[bytes]:
    """Frames for the queue to send: ``[message_id, sent, timeout, *extra, b"", *body]``.

    Parameters
    ----------
    delivery
        The delivery.

    Returns
    -------
    list[bytes]
        The multipart message, without the consumer identity the ROUTER needs first.

    Raises
    ------
    LocalProtocolError
        If ``delivery`` is not a :class:`Delivery`.
    """
    check_instance("encode_delivery", delivery, Delivery)
    return [
        delivery.message_id,
        str(delivery.sent_us).encode("ascii"),
        str(delivery.ack_timeout_us).encode("ascii"),
        *delivery.extra,
        DELIMITER,
        *delivery.body,
    ]


def decode_delivery(frames: Sequence[bytes]) -> Delivery:
    """Parse a delivery, given the parts *after* the queue identity a consumer ROUTER adds.

    A consumer's ROUTER receives ``[queue identity, message_id, sent, timeout, *extra,
    b"", *body]``; strip part 0 first (see :func:`split_identity`) and keep it to address
    the ack.

    Parameters
    ----------
    frames
        ``[message_id, sent_us, ack_timeout_us, *extra, b"", *body]``.

    Returns
    -------
    Delivery

    Raises
    ------
    RemoteProtocolError
        If the id is missing or empty (``message_id``); a time is missing, not plain ASCII
        digits (so also if negative) or above ``MAX_TIMESTAMP_US`` (``sent_us``,
        ``ack_timeout_us``); there is no empty part after the times (``delimiter``); or
        nothing follows it (``body``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    kind = "delivery"
    parts = as_parts(frames, kind)
    message_id = decode_message_id(parts, kind)
    sent_us = decode_timestamp(parts, 1, "sent_us", kind)
    ack_timeout_us = decode_timestamp(parts, 2, "ack_timeout_us", kind)
    extra, body = decode_extra_and_body(parts, 3, kind)
    return Delivery(message_id, sent_us, ack_timeout_us, body, extra)


def is_expired(delivery: Delivery, now_us: int) -> bool:
    """Whether the queue will already have resent ``delivery`` at ``now_us``.

    True when ``sent_us + ack_timeout_us < now_us`` (the spec's "greater than"); a
    consumer may then discard the message to avoid a duplicate.

    Parameters
    ----------
    delivery
        The delivery.
    now_us
        The current time in microseconds since the epoch.

    Returns
    -------
    bool

    Raises
    ------
    LocalProtocolError
        If ``delivery`` is not a :class:`Delivery` or ``now_us`` is not an int.
    """
    check_instance("is_expired", delivery, Delivery)
    if not isinstance(now_us, int) or isinstance(now_us, bool):
        raise local_error("is_expired", "now_us", f"is a {type(now_us).__name__}", "an int", now_us)
    return delivery.deadline_us < now_us


@dataclass(frozen=True, slots=True)
class ConsumerAck:
    """A consumer's answer to a delivery (consumer ROUTER -> queue *send* socket).

    Wire form after the routing identity: ``[message_id, b"1" | b"0"]``.

    Parameters
    ----------
    message_id
        The :attr:`Delivery.message_id` being answered.
    ok
        True (``1``): processed, the queue deletes it. False (``0``): requeue it now.

    Raises
    ------
    LocalProtocolError
        If a field has the wrong type or the id is empty.
    """

    message_id: bytes
    ok: bool

    def __post_init__(self) -> None:
        check_message_id("ConsumerAck", self.message_id)
        check_bool("ConsumerAck", "ok", self.ok)


def encode_consumer_ack(ack: ConsumerAck) -> list[bytes]:
    """Frames for a consumer to send: ``[message_id, b"1"|b"0"]``.

    Prepend the queue identity received with the delivery before sending on the ROUTER.

    Parameters
    ----------
    ack
        The acknowledgement.

    Returns
    -------
    list[bytes]

    Raises
    ------
    LocalProtocolError
        If ``ack`` is not a :class:`ConsumerAck`.
    """
    check_instance("encode_consumer_ack", ack, ConsumerAck)
    return [ack.message_id, ACK_SUCCESS if ack.ok else ACK_FAILURE]


def decode_consumer_ack(frames: Sequence[bytes]) -> ConsumerAck:
    """Parse a consumer's ack, as the queue reads it after the consumer's identity.

    Parts after the ACK value are ignored: the spec defines none, and its general rule is
    that added headers must not break readers.

    Parameters
    ----------
    frames
        ``[message_id, ack_value, *ignored]``.

    Returns
    -------
    ConsumerAck

    Raises
    ------
    RemoteProtocolError
        If the id is missing or empty (``message_id``), or the ACK value is missing or
        anything but exactly ``b"0"`` or ``b"1"`` (``ack``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    kind = "consumer ack"
    parts = as_parts(frames, kind)
    message_id = decode_message_id(parts, kind)
    if len(parts) < 2:
        raise remote_error(kind, "ack", "is missing (only 1 part)", 'b"0" or b"1" at part 1', None)
    value = parts[1]
    if value == ACK_SUCCESS:
        return ConsumerAck(message_id, True)
    if value == ACK_FAILURE:
        return ConsumerAck(message_id, False)
    raise remote_error(kind, "ack", f"is {show(value)}", 'b"0" (nack) or b"1" (ack)', value)


def split_identity(frames: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
    """Split what a ROUTER socket received into the sender's identity and the frames.

    Parameters
    ----------
    frames
        ``[identity, *rest]`` as received on a ROUTER socket.

    Returns
    -------
    tuple[bytes, list[bytes]]
        The identity (use it to reply) and the remaining parts, ready for a decoder.

    Raises
    ------
    RemoteProtocolError
        If there are no parts or the identity is empty (``identity``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    parts = as_parts(frames, "routed message")
    if not parts or not parts[0]:
        got = "is missing (no parts)" if not parts else "is empty"
        raise remote_error("routed message", "identity", got, "a non-empty routing identity", None)
    return parts[0], parts[1:]


# --------------------------------------------------------------------------- monitor


def encode_monitor_request() -> list[bytes]:
    """The monitor request, ``[b"MONITOR"]`` (a REQ socket adds its own envelope).

    Returns
    -------
    list[bytes]
    """
    return [MONITOR_REQUEST]


def decode_monitor_request(frames: Sequence[bytes]) -> None:
    """Check a monitor request, as a REP socket delivers it (REQ envelope removed).

    Parameters
    ----------
    frames
        Must be exactly ``[b"MONITOR"]`` (case-sensitive, no padding).

    Raises
    ------
    RemoteProtocolError
        If it is anything else (field ``request``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    parts = as_parts(frames, "monitor request")
    if len(parts) != 1:
        raise remote_error(
            "monitor request", "request", f"has {len(parts)} parts", 'one part, b"MONITOR"', None
        )
    if parts[0] != MONITOR_REQUEST:
        raise remote_error(
            "monitor request", "request", f"is {show(parts[0])}", 'b"MONITOR"', parts[0]
        )


def encode_monitor_reply(stats: Mapping[str, int | str]) -> list[bytes]:
    """The monitor reply: one UTF-8 part of ``key: value`` lines, each ending in ``\\n``.

    Keys are written in the mapping's order; :data:`MONITOR_KEYS` are the ones the spec
    shows. Lines end with a newline, as the reference queue writes them.

    Parameters
    ----------
    stats
        Statistic name -> value. Keys must be non-empty, without ``:`` or newlines and
        without surrounding whitespace; str values without newlines or surrounding
        whitespace (readers strip it); ints are written in decimal.

    Returns
    -------
    list[bytes]
        A one-part message.

    Raises
    ------
    LocalProtocolError
        If a key or value would not survive being written and read back.
    """
    kind = "encode_monitor_reply"
    if not isinstance(stats, Mapping):
        raise local_error(kind, "stats", f"is a {type(stats).__name__}", "a mapping", stats)
    lines: list[str] = []
    for key, value in stats.items():
        if not isinstance(key, str):
            raise local_error(kind, "key", f"is a {type(key).__name__}", "a str", key)
        if not key or ":" in key or "\n" in key or key != key.strip():
            raise local_error(
                kind,
                "key",
                f"is {key!r}",
                "non-empty text without ':', newlines or surrounding whitespace",
                key,
            )
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise local_error(
                kind, "value", f"of {key!r} is a {type(value).__name__}", "int or str", value
            )
        try:
            text = str(value)
        except ValueError:  # an int beyond sys.get_int_max_str_digits()
            raise local_error(
                kind, "value", f"of {key!r} is too large", "a printable int", key
            ) from None
        if "\n" in text or text != text.strip():
            raise local_error(
                kind,
                "value",
                f"of {key!r} is {text!r}",
                "text without newlines or surrounding whitespace",
                value,
            )
        lines.append(f"{key}: {text}\n")
    blob = "".join(lines)
    try:
        return [blob.encode("utf-8")]
    except UnicodeEncodeError:
        raise local_error(kind, "stats", f"is {blob!r}", "text encodable as UTF-8", stats) from None


def decode_monitor_reply(frames: Sequence[bytes]) -> dict[str, str]:
    """Parse a monitor reply into ``{key: value}``.

    The single part is split on ``\\n``; blank lines are skipped; each other line is split
    at its first ``:`` and both sides are stripped (so ``\\r\\n`` endings are fine).

    Parameters
    ----------
    frames
        One part of UTF-8 ``key: value`` lines.

    Returns
    -------
    dict[str, str]
        Values stay text; the standard ones (:data:`MONITOR_KEYS`) are decimal integers.

    Raises
    ------
    RemoteProtocolError
        If there is not exactly one part or it is not UTF-8 (``reply``), a line has no
        ``:`` (``line``), or a key is empty or repeated (``key``).
    LocalProtocolError
        If ``frames`` is not a sequence of bytes-like parts.
    """
    kind = "monitor reply"
    parts = as_parts(frames, kind)
    if len(parts) != 1:
        raise remote_error(kind, "reply", f"has {len(parts)} parts", "exactly one part", None)
    try:
        text = parts[0].decode("utf-8")
    except UnicodeDecodeError as e:
        raise remote_error(
            kind, "reply", f"is not UTF-8 ({e.reason} at byte {e.start})", "UTF-8 text", parts[0]
        ) from None
    stats: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        key, colon, value = line.partition(":")
        if not colon:
            raise remote_error(kind, "line", f"{number} is {line!r}", "'key: value'", line)
        key = key.strip()
        if not key:
            raise remote_error(kind, "key", f"on line {number} is empty", "a non-empty key", line)
        if key in stats:
            raise remote_error(
                kind, "key", f"{key!r} repeats on line {number}", "each key at most once", key
            )
        stats[key] = value.strip()
    return stats
