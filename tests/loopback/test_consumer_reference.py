"""The sink's giver (:class:`StagingWriter`) against a plain ZIO taker that behaves like
the reference (tests/peers/zio_reference.py: echoing server, plain labels, one flow at a
time, C++-style credit announcement), in both socket kinds, and against our Consumer.

The format is negotiated (zio_spark/protocol/negotiate.py): the writer offers
``encoding`` as a list, a zio-spark Consumer names its pick; an echoed list (the
reference) means a plain taker, which gets one record per DAT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import zmq

from tests.peers.zio_reference import ReferenceServer
from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.errors import ConfigError, TransportError
from zio_spark.protocol.flow import Direction, Role
from zio_spark.sink.client import StagingWriter
from zio_spark.sink.consumer import Consumer
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import ClientPort

SOCKETS = [
    "routerdealer",
    pytest.param("clientserver", marks=pytest.mark.requires_draft),
]
HEADERS = SINK_SCHEMA.field("headers").type


@pytest.fixture
def taker(ctx: zmq.Context[Any], request: pytest.FixtureRequest) -> Iterator[ReferenceServer]:
    """A C++-flavoured reference server taker (credit 10) on the socket kind of the test."""
    server = ReferenceServer(ctx, role="taker", flavor="cpp", sockets=request.param)
    yield server
    server.close()


@pytest.fixture
def consumer(ctx: zmq.Context[Any], tmp_path: Path) -> Iterator[Consumer]:
    c = Consumer("tcp://127.0.0.1:*", tmp_path / "consumer", ctx=ctx, linger_ms=0, fsync=False)
    yield c
    c.close()


def _writer(ctx: zmq.Context[Any], endpoint: str, sockets: str, **kw: Any) -> StagingWriter:
    kw.setdefault("timeout", 5)
    return StagingWriter(endpoint, "s", 3, 0, 0, ctx=ctx, mode=sockets, **kw)


def _batch(values: list[bytes]) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_arrays(
        [pa.array(values, pa.binary()), pa.nulls(n, pa.binary()), pa.nulls(n, HEADERS)],
        schema=SINK_SCHEMA,
    )


def _wait(cond: Callable[[], Any], what: str, server: ReferenceServer) -> None:
    assert server.wait_until(lambda: bool(cond()), 10.0), f"{what}; errors {server.errors}"


# ------------------------------------------------------------ a plain (reference) taker


@pytest.mark.parametrize("taker", SOCKETS, indirect=True)
def test_auto_sends_a_reference_taker_one_bare_record_per_dat(ctx, taker):
    values = [b"v%d" % i for i in range(250)]
    w = _writer(ctx, taker.endpoint, taker.sockets)  # format auto, credit offered 1000
    assert (w.format, w.plain_peer) == ("record", True)
    w.write_values(values[:100])
    for v in values[100:150]:
        w.write_record(v)  # one at a time: the same bare DAT
    w.write_values(values[150:])
    assert w.close() == len(values)
    assert w.plain_peer
    _wait(lambda: taker.flows_completed == 1, "the flow ends", taker)
    assert taker.received == values  # every value once, in order
    assert taker.received_labels == [{"flow": "DAT"}] * len(values)
    # It echoed our offer (and our credit: C++ announces the client's) and paid its own
    # 10: the writer spent what was paid, so the taker never saw a DAT beyond its credit.
    reply = taker.replies[0]
    assert reply["encoding"] == ["arrow", "record"] and reply["credit"] == 1000
    assert max(taker.pays_sent) <= 10
    assert taker.errors == [] and taker.flows_died == 0
    assert taker.pays_received == []  # a giver never pays (no zero-credit PAY either)


@pytest.mark.parametrize("taker", SOCKETS, indirect=True)
def test_record_with_key_and_headers_keeps_them_as_label_attributes(ctx, taker):
    w = _writer(ctx, taker.endpoint, taker.sockets, format="record")
    assert w.format == "record" and w.plain_peer
    w.write_record(b"a", b"42", {"h": "x"})
    w.write_record(b"b")
    assert w.close() == 2
    _wait(lambda: taker.flows_completed == 1, "the flow ends", taker)
    assert taker.received == [b"a", b"b"]
    assert taker.received_labels == [
        {"flow": "DAT", "headers": {"h": "x"}, "key": "NDI="},
        {"flow": "DAT"},
    ]


@pytest.mark.parametrize("taker", SOCKETS, indirect=True)
def test_explicit_arrow_to_a_reference_taker_fails_naming_endpoint_and_option(ctx, taker):
    with pytest.raises(ConfigError) as info:
        _writer(ctx, taker.endpoint, taker.sockets, format="arrow")
    assert info.value.option == "format" and info.value.value == "arrow"
    assert taker.endpoint in str(info.value) and "nothing was sent" in str(info.value)
    # The flow was ended cleanly, with no DAT: the taker is free for the next flow.
    _wait(lambda: taker.flows_completed == 1, "the empty flow ends", taker)
    assert taker.received == [] and taker.errors == []
    w = _writer(ctx, taker.endpoint, taker.sockets)
    w.write_values([b"next"])
    assert w.close() == 1
    _wait(lambda: taker.received == [b"next"], "the next flow's record", taker)


@pytest.mark.parametrize("taker", SOCKETS, indirect=True)
def test_a_second_flow_to_a_single_flow_taker_fails_both_saying_one_flow_at_a_time(ctx, taker):
    first = _writer(ctx, taker.endpoint, taker.sockets, timeout=1.5)
    first.write_values([b"a", b"b", b"c"])
    _wait(lambda: len(taker.received) == 3, "the first flow's records", taker)
    # The second flow's BOT ends the first flow and goes unanswered (fact 16).
    with pytest.raises(TransportError, match="serves one flow at a time") as second:
        _writer(ctx, taker.endpoint, taker.sockets, timeout=1.5)
    assert taker.endpoint in str(second.value)
    assert taker.flows_killed == 1
    # The first flow hears nothing more: it fails once its credit is spent, never
    # reports success.
    with pytest.raises(TransportError, match="serves one flow at a time") as first_err:
        first.write_values([b"x%d" % i for i in range(50)])
        first.close()
    assert f"The taker at {taker.endpoint} is a plain ZIO taker" in str(first_err.value)
    first.fail("test over")


@pytest.mark.parametrize("taker", SOCKETS, indirect=True)
def test_a_killed_flow_that_had_sent_everything_gets_no_echo_and_fails(ctx, taker):
    first = _writer(ctx, taker.endpoint, taker.sockets, timeout=1.5)
    first.write_values([b"a"])
    _wait(lambda: taker.received == [b"a"], "the record", taker)
    with pytest.raises(TransportError):
        _writer(ctx, taker.endpoint, taker.sockets, timeout=1.5)
    with pytest.raises(TransportError, match=r"did not confirm staging.*one flow at a time"):
        first.close()


# ------------------------------------------------------------------- our own consumer


def test_auto_to_our_consumer_negotiates_arrow(ctx, consumer):
    w = StagingWriter(consumer.endpoint, "s", 0, 0, ctx=ctx, timeout=5)
    assert (w.format, w.plain_peer) == ("arrow", False)
    for i in range(0, 30, 10):
        w.write_batch(_batch([b"%d" % j for j in range(i, i + 10)]))
    assert w.close() == 30 and not w.plain_peer
    assert consumer.stats["dats"] == 3  # one DAT per Arrow batch, not one per record
    staged = consumer.root / "staging" / "s" / f"{0:020d}" / "0-0.arrow"
    with pa.memory_map(str(staged)) as f:
        table = pa.ipc.open_file(f).read_all()
    assert table.column("value").to_pylist() == [b"%d" % j for j in range(30)]


def test_explicit_record_to_our_consumer_is_staged_as_records(ctx, consumer):
    w = StagingWriter(consumer.endpoint, "s", 0, 0, ctx=ctx, timeout=5, format="record")
    assert (w.format, w.plain_peer) == ("record", False)
    w.write_values([b"a", b"b"])
    w.write_record(b"c", b"k", {"h": "v"})
    assert w.close() == 3 and not w.plain_peer
    assert consumer.stats["dats"] == 3


def _raw_bot(
    make_client: Callable[..., ClientPort], endpoint: str, attrs: dict[str, Any]
) -> dict[str, Any]:
    port = make_client()
    port.connect(endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    try:
        reply = ep.connect(Direction.EXTRACT, 10, attrs, timeout=5)
    except FlowRejected as e:
        return {"rejected": e.attrs}
    ep.send_eot({"error": "probe"}, timeout=5)
    return reply.attrs


def test_consumer_states_its_pick_and_keeps_reading_the_old_format_attribute(consumer, make_client):
    base = {"stream": "s", "batch": 1, "partition": 0}
    # The client offers, the server states: a scalar, the first offered that it takes.
    assert (
        _raw_bot(make_client, consumer.endpoint, {**base, "encoding": ["avro", "record"]})[
            "encoding"
        ]
        == "record"
    )
    assert (
        _raw_bot(make_client, consumer.endpoint, {**base, "encoding": "arrow"})["encoding"]
        == "arrow"
    )
    # A sink older than the negotiation names its format and gets no statement back.
    old = _raw_bot(make_client, consumer.endpoint, {**base, "format": "record"})
    assert "encoding" not in old and "rejected" not in old
    # An offer of nothing it takes is refused, naming the attribute.
    refused = _raw_bot(make_client, consumer.endpoint, {**base, "encoding": ["avro"]})
    assert "encoding" in refused["rejected"]["reason"]
    assert "avro" in refused["rejected"]["reason"]


@pytest.mark.parametrize("sockets", SOCKETS)
@pytest.mark.parametrize("flavor", ["cpp", "python"])
def test_a_reference_client_giver_to_our_consumer_is_published_with_no_zero_credit_pay(
    ctx, tmp_path, sockets, flavor
):
    from tests.peers.zio_reference import ReferenceClientGiver

    values = [b"r%d" % i for i in range(300)]
    c = Consumer(
        "tcp://127.0.0.1:*", tmp_path / "c", ctx=ctx, linger_ms=0, fsync=False, mode=sockets
    )
    try:
        giver = ReferenceClientGiver(ctx, c.endpoint, values, flavor=flavor, sockets=sockets)
        try:
            assert giver.wait(20), giver.errors
            assert giver.reply is not None and "encoding" not in giver.reply  # nothing offered
            assert giver.zero_credit_pays == 0 and min(giver.pays_received) > 0
        finally:
            giver.close()
        got = [r.value for s, b in c.published("zio") for r in c.records(s, b)]
        assert got == values
    finally:
        c.close()
