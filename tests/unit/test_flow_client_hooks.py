"""The flow client's hooks for a taker that reads every message itself (the source's
receiver): ``on_failure`` for every failure, ``end`` of a flow that is not a failure
(final or reopened), ``send_eot``'s send timeout, ``give_up`` and ``close`` lingering.
Over the stand-in port of ``test_flow_client_decisions`` with explicit clocks."""

from __future__ import annotations

from tests.unit.test_flow_client_decisions import Recorder, Rig
from zio_spark.protocol.flow import FlowState
from zio_spark.transport.flow_client import ClientFlow


class Failures(Recorder):
    def __init__(self, hopeless: bool = False) -> None:
        super().__init__(hopeless)
        self.failures: list[tuple[bool, str, str, bool]] = []

    def on_failure(self, conn: ClientFlow | None, why: str, counter: str, final: bool) -> None:
        # Called before the flow closes: the connection is still the client's.
        self.failures.append((conn is not None and conn.current, why, counter, final))


def test_on_failure_sees_every_failure_before_the_close_with_its_kind() -> None:
    handler = Failures()
    rig = Rig(handler)
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    c.fail("bad records", "taker_errors", 0.2)
    assert handler.failures == [(True, "bad records", "taker_errors", False)]
    assert handler.closed == [("bad records", "bad records")]
    assert c.stats["flow_failures"] == 1 and c.stats["taker_errors"] == 1
    c.tick(0.5)  # reopened after 0.2 s; the BOT goes unanswered
    c.tick(11.0)
    assert handler.failures[-1] == (True, "silent for 10 s", "bot_timeouts", False)


def test_a_hopeless_silence_is_a_final_failure() -> None:
    handler = Failures(hopeless=True)
    rig = Rig(handler)
    c = rig.client
    c.tick(0.0)
    c.tick(10.5)
    assert handler.failures == [(True, "silent for 10 s", "bot_timeouts", True)]
    assert c.gave_up == "silent for 10 s" and c.conn is None


def test_without_reconnect_every_failure_is_final() -> None:
    handler = Failures()
    rig = Rig(handler, reconnect=False)
    c = rig.client
    c.tick(0.0)
    c.fail("broken", "taker_errors", 1.0)
    assert handler.failures == [(True, "broken", "taker_errors", True)]


def test_end_without_reopen_is_final_and_no_failure() -> None:
    handler = Failures()
    rig = Rig(handler)
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    c.end("end of transmission", reopen=False, now=1.0)
    assert c.conn is None and c.ending and handler.failures == []
    assert handler.closed == [("end of transmission", None)]
    c.tick(100.0)
    assert len(rig.ports) == 1  # no new flow, ever
    assert c.stats["flow_failures"] == 0


def test_end_with_reopen_opens_after_the_backoff_delay() -> None:
    rig = Rig(Failures())
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    c.end("end of transmission", reopen=True, now=1.0)
    c.tick(1.1)
    assert len(rig.ports) == 1
    c.tick(1.25)
    assert len(rig.ports) == 2 and not c.ending


def test_send_eot_passes_its_timeout_and_close_and_give_up_linger_as_asked() -> None:
    sent: list[float | None] = []
    lingers: list[int | None] = []
    rig = Rig(Failures())
    c = rig.client
    c.tick(0.0)
    rig.reply(rig.server().accept(), 0.1)
    port = rig.port
    port.send = lambda msg, timeout_ms=None: sent.append(timeout_ms)  # type: ignore[method-assign]
    port.close = lambda linger_ms=None: lingers.append(linger_ms)  # type: ignore[method-assign]
    assert c.conn is not None and c.conn.flow.state is FlowState.READY
    assert c.send_eot(timeout_ms=123)
    assert sent == [123] and c.ending
    c.close("removed", linger_ms=77)
    assert lingers == [77]

    rig2 = Rig(Failures())
    rig2.client.tick(0.0)
    lingers2: list[int | None] = []
    rig2.port.close = lambda linger_ms=None: lingers2.append(linger_ms)  # type: ignore[method-assign]
    rig2.client.give_up("data loss", linger_ms=100)
    assert lingers2 == [100] and rig2.client.gave_up == "data loss"
