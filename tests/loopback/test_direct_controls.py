"""The driver's control flows of ``readMode=direct`` (:class:`~zio_spark.source.direct.Controls`):
one thread per endpoint, so an endpoint that is down never holds the others up.

Covered: a down endpoint is asked again in the background while triggers go on without
waiting for it, and counts again once it answers (with gated held queries, no timing);
against a real bound producer next to an endpoint nobody listens on: held windows,
acks sent without waiting and answered, a wanted ack that comes while an ack is in
flight, and the close that ends the control flow. Loopback only; every wait polls a
condition with a deadline.
"""

from __future__ import annotations

import threading

from tests.support import free_endpoint, wait_until
from zio_spark.source.direct import Controls, Position, _Answer
from zio_spark.source.producer import Producer
from zio_spark.source.range_client import HeldWindow

T = 10.0  # seconds any one wait may last (returns as soon as it can)


class _Gated(Controls):
    """Held queries answered by the test: ``script[endpoint]`` is a list of answers, each
    given when ``gates[endpoint]`` is set (a set gate answers at once)."""

    def __init__(self, endpoints: tuple[str, ...], script: dict[str, list[_Answer]]) -> None:
        super().__init__(endpoints, timeout=T)
        self.script = script
        self.gates = {e: threading.Event() for e in endpoints}
        for gate in self.gates.values():
            gate.set()
        self.asked = dict.fromkeys(endpoints, 0)

    def _ask(self, endpoint: str) -> _Answer:
        self.asked[endpoint] += 1
        assert self.gates[endpoint].wait(T), "the test never opened the gate"
        return self.script[endpoint].pop(0)


def _window(producer: str, end: int) -> _Answer:
    return _Answer(producer=producer, window=HeldWindow("inc", 1, end))


def test_a_down_endpoint_is_asked_in_the_background_and_never_waited_for_again():
    down = _Answer(error="no BOT reply within 10 s")
    c = _Gated(
        ("tcp://a", "tcp://b"),
        {
            "tcp://a": [_window("pa", 5), _window("pa", 6), _window("pa", 7)],
            "tcp://b": [down, _window("pb", 9)],
        },
    )
    try:
        assert c.held() == {"pa": HeldWindow("inc", 1, 5)}
        assert c.down == {"tcp://b": "no BOT reply within 10 s"}
        # b is down: its next query waits on a gate the test holds shut. The trigger
        # returns with a's window while b's query is still open (it was not waited for).
        c.gates["tcp://b"].clear()
        assert c.held() == {"pa": HeldWindow("inc", 1, 6)}
        wait_until(lambda: c.asked["tcp://b"] == 2, what="b asked again", timeout=T)
        assert not c._asking["tcp://b"].done() and "tcp://b" in c.down
        # b answers; the next trigger counts it and asks no new question while one is open.
        c.gates["tcp://b"].set()
        wait_until(lambda: c._asking["tcp://b"].done(), what="b's answer", timeout=T)
        got = c.held()
        assert got == {"pa": HeldWindow("inc", 1, 7), "pb": HeldWindow("inc", 1, 9)}
        assert c.down == {} and c.where == {"pa": "tcp://a", "pb": "tcp://b"}
        assert c.asked == {"tcp://a": 3, "tcp://b": 2}
    finally:
        c.close()


def test_acks_go_out_without_waiting_and_a_down_endpoint_does_not_hold_them(ctx):
    p = Producer(ctx=ctx, producer_id="p1", linger_ms=0, bind="tcp://127.0.0.1:*")
    nobody = free_endpoint()
    c = Controls((nobody, p.endpoint), ctx=ctx, timeout=0.5)
    try:
        p.send_many([f"r{i}".encode() for i in range(100)])
        wait_until(lambda: "p1" in c.held(), what="p1's held window", timeout=T)
        assert nobody in c.down and "p1" in c.where
        c.ack({"p1": Position(p.incarnation, 41)})  # records 1..40 committed
        wait_until(lambda: p.acked == 40, what="the ack of 40", timeout=T)
        # Several wanted acks in a row: the last one wins, none is lost.
        for end in (51, 61, 71):
            c.ack({"p1": Position(p.incarnation, end)})
        wait_until(lambda: p.acked == 70, what="the ack of 70", timeout=T)
        assert c.acked() == {"p1": Position(p.incarnation, 71)}
        # The down endpoint is still asked at each trigger, never waited for.
        assert c.held()["p1"].first == 71
    finally:
        c.close(timeout=T)
        try:
            wait_until(lambda: not p._ranges.flows, what="the control flow ended", timeout=T)
        finally:
            p.close(flush=False, timeout=5)
