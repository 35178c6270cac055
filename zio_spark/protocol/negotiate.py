"""Handshake negotiation of the zio-spark profile that an echoed BOT cannot fool.

Theory of operation (specs/zio-wire.md, "What the reference really does"):

Both reference servers (C++ always, Python by default) answer a client's BOT with *the
client's own BOT*, ``direction`` flipped and every other attribute untouched, credit
included. A client that reads capabilities from the reply therefore finds its own offer
there and mistakes a plain peer for a capable one. So the rule here is:

**The client offers, the server states; a reply attribute counts only where it is not an
echo of the offer.** :func:`own_statements` keeps the reply attributes the client did not
send (or sent with another value). From those:

- **encoding**: the client *lists* what it can read or write (``encoding: ["arrow"]``);
  the server *names* the one it picked, as a scalar (``encoding: "arrow"``). An echoed
  list, or no answer, means plain payloads (one record per DAT, the payload is the
  value). A picked encoding that was never offered is a protocol error.
- **acknowledgements** (``ack``) count only from a peer that stated something no echo
  could carry: a giver its ``producer`` id (a taker never sends one), a taker its
  ``resume`` point (a giver never sends one). An echoed ``ack: true`` means a plain peer:
  no acknowledgements, at most once, and never a PAY with credit 0 (a C++ reference giver
  blocked in ``put()`` throws on one).
- **position** (``last``): a zio-spark giver states the last sequence number it had
  assigned when it wrote its BOT; it counts only with the profile (a giver's own
  ``producer``), never from an echo (a client of ours never sends ``last``), and only
  from a giver.
- **credit** is not part of the terms: the C++ server announces the client's credit even
  when it will pay less. Givers count the credit actually paid (the flow machine does);
  nothing is sized from a BOT's credit.

When the client's BOT reaches us as the *server*, it cannot be an echo: its attributes
are the client's own statements (:func:`server_terms`).

Pure code: mappings in, :class:`Terms` out; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.flow import profile_bot

__all__ = [
    "PLAIN",
    "Terms",
    "client_terms",
    "own_statements",
    "pay_attrs",
    "server_terms",
]

Role = Literal["giver", "taker"]

# Attributes of the flow itself, never a statement about the peer's capabilities.
_FLOW_KEYS = frozenset({"flow", "direction", "credit"})


@dataclass(frozen=True, slots=True)
class Terms:
    """What was agreed with the peer of one flow.

    Attributes
    ----------
    profile
        True if the peer stated zio-spark profile attributes as its own (a giver its
        ``producer`` id, a taker its ``resume`` point).
    ack
        Acknowledgements are on: the giver keeps records until a PAY's ``ack`` covers
        them and resends after ``resume`` on a new flow; the taker sends ``ack``.
    encoding
        The payload encoding of DATs (e.g. ``"arrow"``), None for plain DATs (one record
        each, the payload frame is the value).
    producer
        The giver's stable producer id, if it stated one.
    resume
        The last sequence number the taker holds durably, if it stated one.
    batch
        Most records per DAT the taker accepts, if it stated a limit.
    stream
        The stream name the peer stated, if any.
    last
        A zio-spark giver's stated position when it wrote its BOT: the last sequence
        number it had assigned (None: it stated none, as a plain giver, or an older
        zio-spark producer; such a giver cannot say when a taker has all it held).
    """

    profile: bool = False
    ack: bool = False
    encoding: str | None = None
    producer: str | None = None
    resume: int | None = None
    batch: int | None = None
    stream: str | None = None
    last: int | None = None


PLAIN = Terms()


def own_statements(sent: Mapping[str, Any], reply: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes of ``reply`` that are not an echo of ``sent`` (our own BOT).

    Flow keys (``flow``, ``direction``, ``credit``) are never statements.
    """
    missing = object()
    return {
        k: v for k, v in reply.items() if k not in _FLOW_KEYS and not _same(sent.get(k, missing), v)
    }


def _same(a: object, b: object) -> bool:
    # JSON values: True == 1 in Python, but an echo keeps the type too.
    return type(a) is type(b) and a == b


def client_terms(role: Role, sent: Mapping[str, Any], reply: Mapping[str, Any]) -> Terms:
    """Terms of a flow we opened as the client, playing ``role``.

    ``sent`` is the attributes of the BOT we sent (its ``encoding`` a list of what we
    offer), ``reply`` those of the server's BOT.

    Raises
    ------
    RemoteProtocolError
        If a stated attribute has the wrong type (see
        :func:`~zio_spark.protocol.flow.profile_bot`) or the server picked an encoding
        we did not offer.
    """
    own = own_statements(sent, reply)
    prof = profile_bot(own)  # checks the types of what the server stated
    # The one attribute that role's peer states and a client of ours never sends.
    profile = prof.producer is not None if role == "taker" else prof.resume is not None
    encoding: str | None = None
    picked = own.get("encoding")
    if isinstance(picked, str):
        offered = _offered(sent.get("encoding"))
        if picked not in offered:
            raise RemoteProtocolError(
                f"BOT encoding {picked!r} was not offered (offered: {list(offered)})",
                field="encoding",
                value=picked,
            )
        encoding = picked
    return Terms(
        profile=profile,
        ack=profile and reply.get("ack") is True,
        encoding=encoding,
        producer=prof.producer,
        resume=prof.resume if profile else None,
        batch=prof.batch,
        stream=prof.stream,
        last=prof.last if profile and role == "taker" else None,
    )


def server_terms(role: Role, bot: Mapping[str, Any], encodings: Sequence[str] = ()) -> Terms:
    """Terms of a flow a client opened with us as the server, playing ``role``.

    ``bot`` is the client's BOT attributes (its own: a client speaks first). We pick the
    first encoding of the client's offer (a list, or one name) that we support among
    ``encodings``; the reply names it as a scalar.

    Raises
    ------
    RemoteProtocolError
        If a profile attribute has the wrong type.
    """
    prof = profile_bot(bot)
    if role == "giver":  # the client takes: ``resume`` and ``batch`` are its statements
        profile = prof.resume is not None or prof.ack
        resume = prof.resume if prof.ack else None
        ack = prof.ack
    else:  # the client gives: its ``producer`` id (acks need a stable id to resume by)
        profile = prof.producer is not None
        resume = None
    ack = prof.ack and profile
    encoding = next((e for e in _offered(bot.get("encoding")) if e in encodings), None)
    return Terms(
        profile=profile,
        ack=ack,
        encoding=encoding,
        producer=prof.producer,
        resume=resume,
        batch=prof.batch,
        stream=prof.stream,
        last=prof.last if profile and role == "taker" else None,
    )


def _offered(raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list):
        return tuple(e for e in raw if isinstance(e, str))
    return ()


def pay_attrs(terms: Terms, ack: int, acked: int) -> dict[str, Any] | None:
    """The extra attributes of the next PAY: ``ack`` when acknowledgements are on and
    ``ack`` moved past what was last sent (``acked``); else None.

    A PAY without attributes must carry credit > 0: a PAY of 0 goes only to a peer whose
    terms have ``ack`` (a C++ reference giver throws on one).
    """
    if terms.ack and ack > acked:
        return {"ack": ack}
    return None
