"""Handshake negotiation: an echoed BOT (the reference servers' reply) means a plain peer.

The echoes here are built the way specs/zio-wire.md ("What the reference really does")
says both reference servers build their reply: the client's BOT with ``direction``
flipped and every other attribute untouched, credit included (C++).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.negotiate import (
    PLAIN,
    Terms,
    client_terms,
    own_statements,
    pay_attrs,
    server_terms,
)

# What our source's receiver sends as a client taker, and what our producer sends as a
# client giver.
TAKER_BOT = {
    "direction": "inject",
    "credit": 1000,
    "stream": "zio",
    "ack": True,
    "resume": 41,
    "encoding": ["arrow"],
    "batch": 1000,
}
GIVER_BOT = {
    "direction": "extract",
    "credit": 1000,
    "stream": "zio",
    "producer": "daq-1",
    "ack": True,
    "encoding": ["arrow"],
}


def echo(bot: dict[str, Any]) -> dict[str, Any]:
    flipped = {"inject": "extract", "extract": "inject"}[bot["direction"]]
    return {**bot, "direction": flipped}


def test_an_echoed_taker_bot_is_a_plain_giver() -> None:
    terms = client_terms("taker", TAKER_BOT, echo(TAKER_BOT))
    assert terms == Terms(stream=None)
    assert not terms.ack and terms.encoding is None and terms.producer is None


def test_an_echoed_giver_bot_is_a_plain_taker() -> None:
    terms = client_terms("giver", GIVER_BOT, echo(GIVER_BOT))
    assert terms == PLAIN


def test_a_bare_reference_reply_is_plain() -> None:
    assert client_terms("taker", TAKER_BOT, {"direction": "extract", "credit": 3}) == PLAIN


def test_our_producer_reply_states_its_terms() -> None:
    reply = {
        "direction": "extract",
        "credit": 1000,
        "producer": "daq-1",
        "stream": "zio",
        "ack": True,
        "encoding": "arrow",
    }
    terms = client_terms("taker", TAKER_BOT, reply)
    assert terms.profile and terms.ack
    assert (terms.encoding, terms.producer) == ("arrow", "daq-1")


def test_a_producer_without_arrow_gives_plain_dats_with_acks() -> None:
    reply = {"direction": "extract", "credit": 10, "producer": "p", "ack": True}
    terms = client_terms("taker", TAKER_BOT, reply)
    assert terms.ack and terms.encoding is None


def test_a_producer_that_does_not_keep_records_has_no_acks() -> None:
    reply = {"direction": "extract", "credit": 10, "producer": "p"}
    assert not client_terms("taker", TAKER_BOT, reply).ack


def test_our_bound_source_reply_states_resume() -> None:
    reply = {
        "direction": "inject",
        "credit": 500,
        "stream": "zio",
        "ack": True,
        "resume": 7,
        "encoding": "arrow",
        "batch": 100,
    }
    terms = client_terms("giver", GIVER_BOT, reply)
    assert terms.profile and terms.ack
    assert (terms.resume, terms.batch, terms.encoding) == (7, 100, "arrow")


def test_an_echoed_resume_does_not_count() -> None:
    """A giver never sends resume, but if it did, the echo must not make it count."""
    sent = {**GIVER_BOT, "resume": 3}
    assert client_terms("giver", sent, echo(sent)) == PLAIN


def test_a_picked_encoding_that_was_not_offered_is_refused() -> None:
    reply = {"direction": "extract", "producer": "p", "encoding": "parquet"}
    with pytest.raises(RemoteProtocolError) as e:
        client_terms("taker", TAKER_BOT, reply)
    assert e.value.field == "encoding"
    assert "parquet" in str(e.value) and "arrow" in str(e.value)


def test_a_listed_encoding_in_a_reply_is_not_a_pick() -> None:
    reply = {"direction": "extract", "producer": "p", "encoding": ["arrow", "x"]}
    assert client_terms("taker", TAKER_BOT, reply).encoding is None


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        ({"producer": 5}, "producer"),
        ({"resume": -1}, "resume"),
        ({"resume": "3"}, "resume"),
        ({"batch": 0}, "batch"),
        ({"stream": ["a"]}, "stream"),
    ],
)
def test_stated_attributes_of_the_wrong_type_are_refused(reply: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        client_terms("giver", GIVER_BOT, {"direction": "inject", **reply})
    assert e.value.field == field


def test_an_echo_keeps_types_apart() -> None:
    # ``True == 1`` in Python; a reply of 1 where we sent true is not our echo.
    assert own_statements({"ack": True}, {"ack": 1}) == {"ack": 1}
    assert own_statements({"ack": True}, {"ack": True}) == {}
    assert own_statements({}, {"flow": "BOT", "direction": "x", "credit": 3}) == {}


def test_server_terms_as_giver_read_the_takers_own_bot() -> None:
    terms = server_terms("giver", TAKER_BOT, ("arrow",))
    assert terms.profile and terms.ack
    assert (terms.resume, terms.batch, terms.encoding) == (41, 1000, "arrow")


def test_server_terms_of_a_reference_taker_client_are_plain() -> None:
    assert server_terms("giver", {"credit": 3}, ("arrow",)) == PLAIN


def test_server_terms_as_taker_need_a_producer_id_for_acks() -> None:
    terms = server_terms("taker", GIVER_BOT, ("arrow",))
    assert terms.profile and terms.ack and terms.producer == "daq-1"
    anonymous = server_terms("taker", {"ack": True, "encoding": ["arrow"]}, ("arrow",))
    assert not anonymous.ack and anonymous.encoding == "arrow"


def test_server_picks_the_first_offered_encoding_it_supports() -> None:
    bot = {"encoding": ["zstd-arrow", "arrow", "record"]}
    assert server_terms("taker", bot, ("record", "arrow")).encoding == "arrow"
    assert server_terms("taker", bot, ("json",)).encoding is None
    assert server_terms("taker", {"encoding": "record"}, ("record",)).encoding == "record"


def test_pay_attrs_only_for_acking_peers() -> None:
    acking = Terms(profile=True, ack=True)
    assert pay_attrs(acking, 10, 9) == {"ack": 10}
    assert pay_attrs(acking, 10, 10) is None
    assert pay_attrs(PLAIN, 10, 0) is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@given(
    st.sampled_from(["giver", "taker"]),
    st.dictionaries(st.text(max_size=10), _json, max_size=8),
    st.integers(0, 10_000),
)
def test_any_echo_is_plain(role: str, extra: dict[str, Any], credit: int) -> None:
    """Whatever a client puts in its BOT, the reference's echo of it yields no terms."""
    direction = "extract" if role == "giver" else "inject"
    sent = {**extra, "direction": direction, "credit": credit}
    assert client_terms(role, sent, echo(sent)) == PLAIN  # type: ignore[arg-type]
