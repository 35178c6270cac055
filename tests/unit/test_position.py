"""A giver's stated position (``last`` in its BOT): parsed, checked, never taken from an
echo (issue #23: availableNow ends on what the producers state, not on a clock)."""

from __future__ import annotations

import pytest

from zio_spark.errors import RemoteProtocolError
from zio_spark.protocol.flow import profile_bot
from zio_spark.protocol.negotiate import client_terms, server_terms

OFFER = {"stream": "zio", "ack": True, "resume": 0, "encoding": ["arrow"], "batch": 4096}


def test_profile_bot_reads_last():
    assert profile_bot({"last": 20000}).last == 20000
    assert profile_bot({"last": 0}).last == 0
    assert profile_bot({}).last is None


@pytest.mark.parametrize("bad", [-1, True, "5", 1.5, [1]])
def test_a_bad_last_is_a_remote_error_naming_it(bad):
    with pytest.raises(RemoteProtocolError, match="BOT last must be an integer >= 0") as e:
        profile_bot({"last": bad})
    assert e.value.field == "last"


def test_a_zio_spark_giver_reply_states_its_position():
    reply = {**OFFER, "producer": "p1", "encoding": "arrow", "last": 20000}
    terms = client_terms("taker", OFFER, reply)
    assert terms.profile and terms.ack and terms.last == 20000


def test_an_echoed_bot_states_no_position():
    # A reference server sends our own BOT back: no producer, and no ``last`` to take.
    assert client_terms("taker", OFFER, dict(OFFER)).last is None


def test_last_without_the_profile_is_not_a_statement():
    # A peer that states no producer id is a plain giver: its ``last`` means nothing to us.
    assert client_terms("taker", OFFER, {**OFFER, "last": 7}).last is None


def test_our_own_last_echoed_back_would_not_count():
    # Should a client ever send ``last`` (a giver client), an echo of it is not the
    # server's statement.
    sent = {**OFFER, "producer": "p1", "last": 5}
    assert client_terms("giver", sent, dict(sent)).last is None


def test_a_giver_client_states_its_position_to_us_as_server():
    bot = {"producer": "c1", "ack": True, "encoding": ["arrow"], "last": 42}
    assert server_terms("taker", bot, ("arrow",)).last == 42
    # A plain giver client (no producer id) states none.
    assert server_terms("taker", {"last": 42}, ("arrow",)).last is None
    # A taker client's ``last`` is not a giver's position.
    assert server_terms("giver", {"resume": 3, "ack": True, "last": 42}).last is None
