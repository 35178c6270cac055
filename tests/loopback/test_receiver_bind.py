"""The source's receiver as a flow server (``bind``), the reference's own topology:
giver clients connect, each client flow a producer partition, clients come and go.

Also: socket kinds that cannot talk are said out loud, on both sides (a failed ZMTP
handshake is what libzmq's socket monitor shows: CONNECTED/ACCEPTED then DISCONNECTED,
never HANDSHAKE_SUCCEEDED). No Spark; loopback, random ports, polled waits.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tests.peers.zio_reference import ReferenceClientGiver
from tests.support import close_all, spool_rows, wait_until
from zio_spark.errors import TransportError
from zio_spark.options import Curve
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
    made: list[Any] = []
    yield made

    def close(thing: Any) -> None:
        if isinstance(thing, Receiver):
            thing.stop()
        elif hasattr(thing, "send_many"):  # a Producer: nothing left to wait for
            thing.close(flush=False, timeout=5)
        else:
            thing.close()

    close_all(made, close)


def _bound(things, spool, ctx, **kw) -> tuple[Receiver, str]:
    r = Receiver(spool, ctx=ctx, bind=["tcp://127.0.0.1:*"], **kw).start()
    things.append(r)
    (endpoint,) = r.bound_endpoints()
    return r, endpoint


def _values(spool: Spool, producer: str) -> list[bytes]:
    ends = spool.seal()
    start = spool.start_offsets()[producer]
    out: list[bytes] = []
    for batch in spool.read(producer, start, ends[producer]):
        out.extend(batch.column("value").to_pylist())
    return out


def _client(things, ctx, endpoint, values, **kw) -> ReferenceClientGiver:
    c = ReferenceClientGiver(ctx, endpoint, values, **kw)
    things.append(c)
    return c


@pytest.mark.parametrize("flavor", FLAVORS)
def test_reference_clients_come_and_go(ctx, spool, things, flavor, wire_mode):
    """Two plain clients at once, then a third later that shares the first's origin:
    every value arrives; partitions are ``origin:<n>``; the shared one holds both
    clients' records in arrival order; no acks, no zero-credit PAY."""
    r, endpoint = _bound(things, spool, ctx, mode=wire_mode, credit=50)
    a = [b"a%d" % i for i in range(200)]
    b = [b"b%d" % i for i in range(150)]
    c = [b"c%d" % i for i in range(100)]
    ca = _client(things, ctx, endpoint, a, flavor=flavor, sockets=wire_mode, origin=11)
    cb = _client(things, ctx, endpoint, b, flavor=flavor, sockets=wire_mode, origin=22)
    assert ca.wait(30) and cb.wait(30), (ca.errors, cb.errors)
    cc = _client(things, ctx, endpoint, c, flavor=flavor, sockets=wire_mode, origin=11)
    assert cc.wait(30), cc.errors
    wait_until(lambda: sum(s.records for s in r.status()) == len(a) + len(b) + len(c), timeout=20.0)
    assert _values(spool, "origin:11") == a + c
    assert _values(spool, "origin:22") == b
    states = sorted((s.producer, s.state, s.records) for s in r.status())
    assert states == [
        ("origin:11", "ended", 100),
        ("origin:11", "ended", 200),
        ("origin:22", "ended", 150),
    ]
    for client in (ca, cb, cc):
        assert client.errors == [] and client.eot_echoes == 1
        assert client.zero_credit_pays == 0
        # The reply: direction flipped, a credit no larger than the offer, and no
        # statements a plain client did not ask for.
        assert client.reply == {"flow": "BOT", "direction": "inject", "credit": 10}
        pays = [m.obj for kind, m in client.trace if kind == "recv" and m.flow == "PAY"]
        assert pays and all(p["credit"] > 0 and "ack" not in p for p in pays)
    assert all(not s.ack_capable and s.at_most_once for s in r.status())
    assert r.error is None


def test_backlog_is_bounded_per_client(ctx, spool, things):
    """maxBacklog holds per producer: each client stops at it until a commit."""
    r, endpoint = _bound(things, spool, ctx, credit=10, max_backlog=30)
    one = _client(things, ctx, endpoint, [b"x%d" % i for i in range(80)], flavor="cpp", origin=1)
    two = _client(things, ctx, endpoint, [b"y%d" % i for i in range(80)], flavor="cpp", origin=2)
    wait_until(
        lambda: spool.backlog() == {"origin:1": 30, "origin:2": 30},
        what="both backlogs full",
        timeout=20.0,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:  # and they stay there: no credit without commits
        assert max(spool.backlog().values()) <= 30
        time.sleep(0.02)
    deadline = time.monotonic() + 30
    while not (one.finished and two.finished):
        assert time.monotonic() < deadline, spool.backlog()
        r.commit(spool.seal())
        assert max(spool.backlog().values(), default=0) <= 30
        time.sleep(0.02)
    assert one.done and two.done, (one.errors, two.errors)
    assert sum(s.records for s in r.status()) == 160


def test_a_client_that_takes_is_refused_with_a_reason(ctx, spool, things):
    r, endpoint = _bound(things, spool, ctx)
    with ctx.socket(zmq.DEALER) as d:
        d.linger = 0
        d.connect(endpoint)
        label = b'{"flow":"BOT","direction":"inject","credit":5}'
        d.send_multipart([b"", b"ZIO0FLOW" + label, b"\0" * 24])
        assert d.poll(10_000), "no answer to a taker's BOT"
        _, prefix, _coord = d.recv_multipart()
    label = json.loads(prefix[len(b"ZIO0FLOW") :])
    assert label["flow"] == "EOT" and "give (direction extract)" in label["reason"]
    wait_until(lambda: any(s.state == "failed" for s in r.status()), timeout=20.0)
    assert "direction 'inject'" in str(r.status()[0].last_error)


def test_a_client_of_the_wrong_socket_kind_is_logged(ctx, spool, things, caplog):
    """A socket libzmq refuses at the handshake (here a PUSH: stock pyzmq has no CLIENT)
    is reported by the bound side, naming both kinds."""
    r, endpoint = _bound(things, spool, ctx)
    with caplog.at_level(logging.WARNING, logger="zio_spark.source"), ctx.socket(zmq.PUSH) as p:
        p.linger = 0
        p.connect(endpoint)
        wait_until(
            lambda: r.stats["handshake_failures"] >= 1, what="the handshake failure", timeout=20.0
        )
    text = caplog.text
    assert endpoint.rsplit(":", 1)[1] in text and "ROUTER" in text and "ZMTP handshake" in text


def test_wrong_socket_kind_at_an_endpoint_fails_loudly(ctx, spool, things):
    """Our DEALER against a peer whose socket libzmq refuses (a PULL here; a SERVER in
    real life): after connectTimeout the receiver fails naming the endpoint, both socket
    kinds and the fix -- no silent reconnects, streaming included."""
    with ctx.socket(zmq.PULL) as wrong:
        wrong.linger = 0
        port = wrong.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        r = Receiver(spool, [endpoint], ctx=ctx, connect_timeout=1.0, reconnect=True).start()
        things.append(r)
        wait_until(lambda: r.error is not None, what="the receiver's error", timeout=20.0)
    err = r.error
    assert isinstance(err, TransportError) and err.endpoint == endpoint
    text = str(err)
    assert "DEALER" in text and "SERVER" in text and "socket=clientserver" in text
    assert "Sockets" in text
    (st,) = r.status()
    assert st.state == "failed" and st.failures == 1  # said once, not retried in silence


@pytest.mark.requires_draft
@pytest.mark.parametrize(
    ("ours", "theirs", "fix"),
    [
        ("routerdealer", zmq.SERVER if hasattr(zmq, "SERVER") else 0, "socket=clientserver"),
        ("clientserver", zmq.ROUTER, "socket=routerdealer"),
    ],
    ids=["DEALER-to-SERVER", "CLIENT-to-ROUTER"],
)
def test_socket_kind_mismatch_with_real_peers(ctx, spool, things, ours, theirs, fix):
    with ctx.socket(theirs) as wrong:
        wrong.linger = 0
        port = wrong.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        r = Receiver(spool, [endpoint], ctx=ctx, connect_timeout=1.0, mode=ours).start()
        things.append(r)
        wait_until(lambda: r.error is not None, what="the receiver's error", timeout=20.0)
    text = str(r.error)
    assert endpoint in text and fix in text and "handshake" in text


# -- our own Producer as a flow client (Producer(connect=...)) -----------------------------


def test_producer_clients_resume_across_receiver_and_producer_restarts(ctx, tmp_path, things):
    """Producer(connect) into a bound receiver: acknowledged, Arrow DATs; the receiver
    restarts on the same endpoint and spool, the producer restarts with the same id;
    every record once, in order."""
    from zio_spark.source.producer import Producer

    spool = Spool(tmp_path / "spool", sync=False)
    things.append(spool)
    r1, endpoint = _bound(things, spool, ctx, credit=20, max_backlog=5000)
    prod = Producer(connect=endpoint, producer_id="pc", ctx=ctx, linger_ms=0)
    things.append(prod)
    prod.send_many([b"r%d" % s for s in range(1, 3001)])
    wait_until(lambda: spool.next_seq("pc") == 3001, what="the first 3000 records", timeout=20.0)
    (st,) = r1.status()
    assert (st.producer, st.encoding, st.ack_capable, st.at_most_once) == (
        "pc",
        "arrow",
        True,
        False,
    )
    r1.commit(spool.seal())
    wait_until(
        lambda: prod.acked == 3000, what="the commit acknowledged to the producer", timeout=20.0
    )
    # The receiver goes away (records 3001..5000 sent meanwhile) and comes back.
    r1.stop()
    prod.send_many([b"r%d" % s for s in range(3001, 5001)])
    r2 = Receiver(spool, ctx=ctx, bind=[endpoint], credit=20, max_backlog=5000).start()
    things.append(r2)
    wait_until(
        lambda: spool.next_seq("pc") == 5001,
        what="records 3001..5000 after the restart",
        timeout=20.0,
    )
    # The producer restarts (same id): it resumes after what the spool holds.
    prod.close(flush=False, timeout=5)
    prod2 = Producer(connect=endpoint, producer_id="pc", ctx=ctx, linger_ms=0)
    things.append(prod2)
    wait_until(lambda: prod2.connected, what="the new producer's flow", timeout=20.0)
    assert prod2.last_seq == 5000  # the bound receiver's resume
    prod2.send_many([b"r%d" % s for s in range(5001, 6001)])
    wait_until(
        lambda: spool.next_seq("pc") == 6001, what="the restarted producer's records", timeout=20.0
    )
    got = spool_rows(spool, "pc")
    assert got == [(s, b"r%d" % s) for s in range(3001, 6001)]  # 1..3000 were committed
    assert r2.error is None and sum(s.duplicates for s in r2.status()) >= 0
    # The first producer's flow (if r2 still had it) was replaced, not failed.
    assert all(s.state != "failed" for s in r2.status()), r2.status()


def test_bind_with_curve_takes_an_encrypted_producer_client(ctx, spool, things):
    """CURVE on the bound port: our key pair; the client uses our public key."""
    from zio_spark.source.producer import Producer

    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    _, endpoint = _bound(things, spool, ctx, curve=Curve(server_pub, server_pub, server_sec))
    prod = Producer(
        connect=endpoint,
        producer_id="sealed",
        ctx=ctx,
        linger_ms=0,
        curve_server_key=server_pub,
        curve_public_key=client_pub,
        curve_secret_key=client_sec,
    )
    things.append(prod)
    prod.send_many([b"s%d" % i for i in range(100)])
    wait_until(lambda: spool.next_seq("sealed") == 101, what="the records over CURVE", timeout=20.0)
    assert _values(spool, "sealed") == [b"s%d" % i for i in range(100)]
    # A client without the keys gets nothing through.
    plain = _client(things, ctx, endpoint, [b"nope"], flavor="cpp", origin=9, deadline_s=1.0)
    plain.wait(10)
    assert not plain.done and "origin:9" not in spool.producers()


def test_plain_clients_sharing_an_origin_share_one_backlog(ctx, spool, things):
    """Two plain clients with one origin feed one partition: maxBacklog bounds the
    partition, not each flow (their credit out counts together)."""
    r, endpoint = _bound(things, spool, ctx, credit=10, max_backlog=30)
    a = _client(things, ctx, endpoint, [b"a%d" % i for i in range(60)], flavor="cpp", origin=5)
    b = _client(things, ctx, endpoint, [b"b%d" % i for i in range(60)], flavor="cpp", origin=5)
    wait_until(
        lambda: len(r.status()) == 2 and spool.backlog().get("origin:5") == 30,
        what="full",
        timeout=20.0,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:  # it stays at the bound: no credit beyond it
        assert spool.backlog()["origin:5"] <= 30
        time.sleep(0.02)
    deadline = time.monotonic() + 30
    while not (a.finished and b.finished):
        assert time.monotonic() < deadline, spool.backlog()
        r.commit(spool.seal())
        assert spool.backlog().get("origin:5", 0) <= 30
        time.sleep(0.02)
    assert a.done and b.done, (a.errors, b.errors)
    assert sum(s.records for s in r.status()) == 120


def test_a_dat_outside_any_flow_is_answered_with_an_eot(ctx, spool, things):
    """A client whose flow this source does not know (it restarted, or dropped the flow)
    is told once with an EOT, instead of waiting for credit forever."""
    r, endpoint = _bound(things, spool, ctx)
    with ctx.socket(zmq.DEALER) as d:
        d.linger = 0
        d.connect(endpoint)
        for _ in range(3):
            d.send_multipart([b"", b'ZIO0FLOW{"flow":"DAT"}', b"\0" * 24, b"lost"])
        assert d.poll(10_000), "no answer to a DAT outside any flow"
        _, prefix, _coord = d.recv_multipart()
        assert not d.poll(300), "told more than once"
    label = json.loads(prefix[len(b"ZIO0FLOW") :])
    assert label["flow"] == "EOT" and "open a new one with a BOT" in label["reason"]
    assert r.stats["stray_messages"] == 3 and r.status() == []
