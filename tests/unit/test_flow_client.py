"""The flow client's decisions that need no socket: the back-off, what a monitor event
means for a connection, and when an unanswered BOT is overdue."""

from __future__ import annotations

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from zio_spark.protocol.flow import FlowState
from zio_spark.transport.flow_client import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    Backoff,
    Seen,
    bot_overdue,
    note_monitor_event,
)


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff()
    assert [b.failed() for _ in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert (BACKOFF_MIN, BACKOFF_MAX) == (0.2, 5.0)
    b.reset()
    assert b.delay == 0.2 and b.failed() == 0.2


@given(st.floats(0.001, 10), st.floats(0.001, 100), st.integers(0, 40))
def test_backoff_never_shrinks_before_a_reset_and_stays_within_bounds(
    first: float, most: float, failures: int
) -> None:
    b = Backoff(first, max(first, most))
    delays = [b.failed() for _ in range(failures)]
    assert delays == sorted(delays)
    assert all(first <= d <= max(first, most) for d in delays)


def test_a_disconnect_fails_the_flow_at_once_unless_patient_and_never_handshaked() -> None:
    impatient = Seen()
    assert note_monitor_event(impatient, zmq.EVENT_DISCONNECTED, patient=False)
    assert impatient.disconnected and not impatient.refused

    refused = Seen()
    assert not note_monitor_event(refused, zmq.EVENT_CONNECTED, patient=True)
    assert not note_monitor_event(refused, zmq.EVENT_DISCONNECTED, patient=True)
    assert refused == Seen(connected=True, refused=True)

    talked = Seen()
    assert not note_monitor_event(talked, zmq.EVENT_HANDSHAKE_SUCCEEDED, patient=True)
    assert note_monitor_event(talked, zmq.EVENT_DISCONNECTED, patient=True)
    assert talked.handshaked and talked.disconnected


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (zmq.EVENT_HANDSHAKE_FAILED_AUTH, "authentication refused"),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "protocol error"),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "no detail"),
    ],
)
def test_a_failed_handshake_is_remembered_not_fatal(event: int, error: str) -> None:
    seen = Seen()
    assert not note_monitor_event(seen, event, patient=False)
    assert seen.handshake_error == error


def test_only_an_unanswered_bot_is_ever_overdue() -> None:
    assert not bot_overdue(FlowState.BOT_SENT, 10.0, 12.0, 2.0)  # exactly at the limit
    assert bot_overdue(FlowState.BOT_SENT, 10.0, 12.01, 2.0)
    assert not bot_overdue(FlowState.READY, 10.0, 100.0, 2.0)
    assert not bot_overdue(FlowState.CLOSED, 10.0, 100.0, 2.0)
