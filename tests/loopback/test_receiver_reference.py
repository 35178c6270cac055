"""The source's receiver against the stand-in for the unmodified ZIO reference.

The reference server answers our BOT by echoing it (``direction`` flipped, every other
attribute ours), so our offer of ``ack``, ``resume`` and ``encoding: ["arrow"]`` comes
back verbatim: the receiver must still read the giver as plain (one record per DAT, no
acknowledgements), and never send it an ``ack`` attribute or a zero-credit PAY (a C++
giver blocked for credit throws on one). Both flavors, both socket kinds (CLIENT/SERVER
runs in the draft pass). No Spark; loopback, random ports, polled waits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.peers.zio_reference import ReferenceServer
from tests.support import wait_until
from zio_spark.source.receiver import Receiver
from zio_spark.storage.spool import Spool

FLAVORS = ["cpp", "python"]


@pytest.fixture
def spool(tmp_path) -> Iterator[Spool]:
    s = Spool(tmp_path / "spool", sync=False)
    yield s
    s.close()


@pytest.fixture
def things() -> Iterator[list[Any]]:
    """Receivers and peers to close at teardown, newest first (receivers first)."""
    made: list[Any] = []
    yield made
    for thing in reversed(made):
        if isinstance(thing, Receiver):
            thing.stop()
            assert thing.error is None, thing.error
        else:
            thing.close()


def _values(spool: Spool, producer: str) -> list[bytes]:
    ends = spool.seal()
    start = spool.start_offsets()[producer]
    out: list[bytes] = []
    for batch in spool.read(producer, start, ends[producer]):
        out.extend(batch.column("value").to_pylist())
    return out


def _pay_labels(server: ReferenceServer) -> list[dict[str, Any]]:
    return [m.obj for kind, m in list(server.trace) if kind == "recv" and m.flow == "PAY"]


@pytest.mark.parametrize("credit", [10, 1000], ids=["same-credit", "offer-above-its-own"])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_record_from_a_reference_server_giver(ctx, spool, things, flavor, wire_mode, credit):
    """Our BOT echoed back reads as a plain giver: every value once, in order, no acks.

    Offering more credit than the giver's own (10): the C++ server still announces our
    offer, and refuses a PAY beyond its real window; credit in PAYs of 1 always fits."""
    values = [b"ref-%d" % i for i in range(300)]
    server = ReferenceServer(
        ctx, role="giver", flavor=flavor, sockets=wire_mode, values=values, credit=10
    )
    things.append(server)
    r = Receiver(spool, [server.endpoint], ctx=ctx, mode=wire_mode, reconnect=False, credit=credit)
    things.append(r.start())
    wait_until(
        lambda: r.status()[0].state in ("ended", "failed"), what="the flow to end", timeout=20.0
    )
    (st,) = r.status()
    assert st.state == "ended", st.last_error
    assert (st.encoding, st.ack_capable, st.at_most_once) == ("plain", False, True)
    assert st.producer == server.endpoint  # a plain giver names no producer
    assert st.records == len(values) and st.failures == 0
    assert _values(spool, server.endpoint) == values
    # The echo: the reply carried our own offer back, and it did not fool us.
    reply = server.replies[0]
    assert reply["encoding"] == ["arrow"] and reply["ack"] is True
    assert server.wait_until(lambda: server.flows_completed == 1)
    assert server.eot_echoes == 1 and server.flows_killed == 0
    assert server.errors == []
    pays = _pay_labels(server)
    assert pays and all(p["credit"] > 0 and "ack" not in p for p in pays), pays
    assert server.zero_credit_pays == 0


@pytest.mark.parametrize("flavor", FLAVORS)
def test_commits_send_no_ack_to_a_reference_giver(ctx, spool, things, flavor, wire_mode):
    """A backlog smaller than the stream: the giver blocks for credit until commits free
    room. Commits of a plain giver's records are never acknowledged to it (no ``ack``,
    no ack-only PAY of 0 while all credit is out: that kills a blocked C++ giver)."""
    values = [b"v%d" % i for i in range(120)]
    server = ReferenceServer(
        ctx, role="giver", flavor=flavor, sockets=wire_mode, values=values, credit=10
    )
    things.append(server)
    r = Receiver(
        spool,
        [server.endpoint],
        ctx=ctx,
        mode=wire_mode,
        reconnect=False,
        credit=10,
        max_backlog=25,
    )
    things.append(r.start())
    producer = server.endpoint
    deadline = time.monotonic() + 30
    commits = 0
    while r.status()[0].state not in ("ended", "failed"):
        assert time.monotonic() < deadline, f"stalled at {r.status()[0]}"
        if spool.backlog().get(producer, 0) >= 25:
            assert server.blocked_for_credit or r.status()[0].records < len(values)
            r.commit(spool.seal())
            commits += 1
        time.sleep(0.01)
    (st,) = r.status()
    assert st.state == "ended", st.last_error
    assert commits >= 3 and st.records == len(values)
    assert server.errors == [] and server.flows_killed == 0
    assert server.zero_credit_pays == 0
    assert all("ack" not in p for p in _pay_labels(server))
    got = _values(spool, producer)
    assert got == values[-len(got) :]  # what is left after the commits, in order


def test_a_streaming_receiver_does_not_reopen_a_plain_giver_after_its_eot(ctx, spool, things):
    """A reference server gives its whole stream to every new flow: reopening after its
    EOT would take every record again. So a streaming receiver leaves it ended."""
    values = [b"once-%d" % i for i in range(50)]
    server = ReferenceServer(ctx, role="giver", flavor="cpp", values=values, credit=10)
    things.append(server)
    r = Receiver(spool, [server.endpoint], ctx=ctx, reconnect=True, credit=10)
    things.append(r.start())
    wait_until(lambda: r.status()[0].state == "ended", what="the flow to end", timeout=20.0)
    # Well past the first reconnect back-off (0.2 s): still one flow, every record once.
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        assert r.status()[0].state == "ended"
        time.sleep(0.05)
    assert server.flows_started == 1
    assert _values(spool, server.endpoint) == values
