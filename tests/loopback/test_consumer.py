"""The sink's consumer on loopback: staging, EOT echo, commit/abort, restart, peers."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import zmq

from tests.support import wait_until
from zio_spark.codec.records import encode_payload
from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.errors import TransportError
from zio_spark.protocol.flow import Direction, Role
from zio_spark.protocol.message import Message, encode_frames
from zio_spark.sink.client import CommandError, StagingWriter, run_command, send_command
from zio_spark.sink.consumer import Consumer, ConsumerStateError
from zio_spark.storage import sink_folder as staging_mod
from zio_spark.storage.sink_folder import CommittedLog
from zio_spark.transport.flow_endpoint import FlowEndpoint, FlowRejected
from zio_spark.transport.port import ClientPort

HEADERS = SINK_SCHEMA.field("headers").type


def _batch(values: list[bytes], keys: list[bytes | None] | None = None) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(values, pa.binary()),
            pa.array(keys if keys is not None else [None] * n, pa.binary()),
            pa.nulls(n, HEADERS),
        ],
        schema=SINK_SCHEMA,
    )


@pytest.fixture
def make_consumer(ctx: zmq.Context[Any], tmp_path: Path) -> Iterator[Callable[..., Consumer]]:
    made: list[Consumer] = []

    def make(path: Path | None = None, **kw: Any) -> Consumer:
        kw.setdefault("linger_ms", 0)
        c = Consumer("tcp://127.0.0.1:*", path or tmp_path / "consumer", ctx=ctx, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def consumer(make_consumer: Callable[..., Consumer]) -> Consumer:
    return make_consumer()


def _stage(
    ctx: zmq.Context[Any],
    c: Consumer,
    batch: int | str,
    partition: int,
    values: list[bytes],
    *,
    stream: str = "s",
    attempt: int = 0,
    per_dat: int = 3,
) -> int:
    w = StagingWriter(c.endpoint, stream, batch, partition, attempt, ctx=ctx, timeout=5)
    for i in range(0, len(values), per_dat):
        w.write_batch(_batch(values[i : i + per_dat]))
    return w.close()


def _values(c: Consumer, stream: str, batch: int | str) -> list[bytes]:
    return [r.value for r in c.records(stream, batch)]


# ------------------------------------------------------------------------ data flows


def test_giver_stages_and_eot_echo_carries_rows(ctx, consumer, make_client):
    """The protocol by hand: BOT extract, DATs within credit, EOT echoed with rows."""
    port: ClientPort = make_client()
    port.connect(consumer.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    attrs = {"stream": "s", "batch": 7, "partition": 1, "attempt": 0, "format": "arrow"}
    bot = ep.connect(Direction.EXTRACT, 1000, attrs, timeout=5)
    assert bot.direction is Direction.INJECT
    assert bot.credit == consumer.credit  # the offer is lowered to the consumer's cap
    for i in range(100):  # more DATs than the window: credit must come back
        assert ep.put((encode_payload(_batch([b"v%d" % i, b"w%d" % i])),), timeout=5)
    echo = ep.send_eot(timeout=5)
    assert echo.echo and echo.attrs["rows"] == 200
    staged = consumer.root / "staging" / "s" / f"{7:020d}" / "1-0.arrow"
    assert staged.exists()
    assert not staged.with_suffix(".part").exists()
    assert consumer.stats["staged"] == 1


def test_commit_publishes_once_and_repeat_is_idempotent(ctx, consumer):
    assert _stage(ctx, consumer, 0, 0, [b"a", b"b"]) == 2
    assert _stage(ctx, consumer, 0, 1, [b"c"]) == 1
    assert consumer.published() == []
    reply = send_command(
        consumer.endpoint, "commit", "s", 0, [(0, 0, 2), (1, 0, 1)], ctx=ctx, timeout=5
    )
    assert reply["result"] == "ok" and reply["published"] is True
    assert consumer.published() == [("s", 0)]
    assert _values(consumer, "s", 0) == [b"a", b"b", b"c"]
    # Spark re-delivers the batch after a failure: staged again, committed again.
    _stage(ctx, consumer, 0, 0, [b"a", b"b"], attempt=1)
    again = send_command(consumer.endpoint, "commit", "s", 0, [(0, 1, 2)], ctx=ctx, timeout=5)
    assert again["result"] == "ok" and again["published"] is False
    assert consumer.published() == [("s", 0)]
    assert _values(consumer, "s", 0) == [b"a", b"b", b"c"]
    assert consumer.stats["duplicate_commits"] == 1
    assert not (consumer.root / "staging" / "s" / f"{0:020d}").exists()


def test_commit_publishes_listed_attempt_only_and_in_commit_order(ctx, consumer):
    _stage(ctx, consumer, 1, 0, [b"old"], attempt=0)  # a failed attempt's leftovers
    _stage(ctx, consumer, 1, 0, [b"new"], attempt=1)
    _stage(ctx, consumer, 0, 0, [b"zero"])
    send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 1)], ctx=ctx, timeout=5)
    send_command(consumer.endpoint, "commit", "s", 1, [(0, 1, 1)], ctx=ctx, timeout=5)
    _stage(ctx, consumer, "write-x", 0, [b"batchwrite"], stream="other")
    send_command(consumer.endpoint, "commit", "other", "write-x", [(0, 0, 1)], ctx=ctx, timeout=5)
    assert consumer.published() == [("s", 0), ("s", 1), ("other", "write-x")]
    assert consumer.published("s") == [("s", 0), ("s", 1)]
    assert _values(consumer, "s", 1) == [b"new"]
    assert consumer.rows("other", "write-x") == 1


def test_commit_of_unstaged_or_miscounted_partition_is_an_error(ctx, consumer):
    _stage(ctx, consumer, 3, 0, [b"a", b"b"])
    with pytest.raises(CommandError, match=r"partition 1 attempt 0 of batch 3.*not staged"):
        send_command(consumer.endpoint, "commit", "s", 3, [(0, 0, 2), (1, 0, 5)], ctx=ctx)
    with pytest.raises(CommandError, match="has 2 staged rows, the commit says 9"):
        send_command(consumer.endpoint, "commit", "s", 3, [(0, 0, 9)], ctx=ctx)
    assert consumer.published() == [] and not consumer.is_committed("s", 3)
    send_command(consumer.endpoint, "commit", "s", 3, [(0, 0, 2)], ctx=ctx)
    assert consumer.published() == [("s", 3)]


def test_run_command_answers_with_a_typed_reply_refusals_included(ctx, consumer):
    """The wire replies, exactly (the driver<->consumer protocol), as typed replies."""
    _stage(ctx, consumer, 0, 0, [b"a"])
    ep = consumer.endpoint
    refused = run_command(ep, "commit", "s", 0, [(0, 0, 5)], ctx=ctx, timeout=5)
    assert not refused.ok
    assert refused.reason == "partition 0 attempt 0 of batch 0 has 1 staged rows, the commit says 5"
    done = run_command(ep, "commit", "s", 0, [(0, 0, 1)], ctx=ctx, timeout=5)
    assert done.ok and done.reason is None
    assert dict(done.attrs) == {"result": "ok", "published": True, "rows": 1}
    again = run_command(ep, "commit", "s", 0, [(0, 0, 1)], ctx=ctx, timeout=5)
    assert dict(again.attrs) == {"result": "ok", "published": False, "reason": "already committed"}
    late = run_command(ep, "abort", "s", 0, ctx=ctx, timeout=5)
    assert dict(late.attrs) == {"result": "ok", "reason": "already committed; nothing to discard"}
    assert dict(run_command(ep, "abort", "s", 1, ctx=ctx, timeout=5).attrs) == {"result": "ok"}
    assert consumer.stats["commit_errors"] == 1 and consumer.stats["aborts"] == 2


def test_empty_batch_records_the_id_and_publishes_nothing(ctx, consumer):
    send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 0)], ctx=ctx, timeout=5)
    assert consumer.is_committed("s", 0)
    assert consumer.published() == []


def test_abort_discards_staging_and_is_idempotent(ctx, consumer):
    _stage(ctx, consumer, 5, 0, [b"a"])
    folder = consumer.root / "staging" / "s" / f"{5:020d}"
    assert folder.exists()
    for _ in range(2):
        assert send_command(consumer.endpoint, "abort", "s", 5, ctx=ctx)["result"] == "ok"
    assert not folder.exists()
    with pytest.raises(CommandError, match="not staged"):
        send_command(consumer.endpoint, "commit", "s", 5, [(0, 0, 1)], ctx=ctx)
    # Abort after commit changes nothing.
    _stage(ctx, consumer, 6, 0, [b"b"])
    send_command(consumer.endpoint, "commit", "s", 6, [(0, 0, 1)], ctx=ctx)
    send_command(consumer.endpoint, "abort", "s", 6, ctx=ctx)
    assert _values(consumer, "s", 6) == [b"b"]


def test_eot_with_error_discards_the_partial_partition(ctx, consumer):
    w = StagingWriter(consumer.endpoint, "s", 0, 0, ctx=ctx, timeout=5)
    w.write_batch(_batch([b"half"]))
    w.fail("task failed: boom")
    folder = consumer.root / "staging" / "s" / f"{0:020d}"
    wait_until(lambda: not any(folder.glob("0-0.*")), what="staging discarded", timeout=10.0)


def test_new_bot_for_the_same_partition_truncates(ctx, consumer):
    _stage(ctx, consumer, 0, 0, [b"first", b"run"])
    _stage(ctx, consumer, 0, 0, [b"second"])  # a restarted query re-runs attempt 0
    send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 1)], ctx=ctx)
    assert _values(consumer, "s", 0) == [b"second"]


def test_credit_bounds_what_is_in_flight(ctx, make_consumer, make_client):
    c = make_consumer(credit=2)
    port = make_client()
    port.connect(c.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    attrs = {"stream": "s", "batch": 0, "partition": 0, "format": "arrow"}
    bot = ep.connect(Direction.EXTRACT, 1000, attrs, timeout=5)
    assert bot.credit == 2
    wait_until(lambda: ep.poll() and ep.flow.credit == 2, what="initial PAY", timeout=10.0)
    ep.put((encode_payload(_batch([b"x"])),), timeout=5)
    ep.put((encode_payload(_batch([b"y"])),), timeout=5)
    assert ep.flow.credit == 0  # a third DAT has to wait for the consumer's PAY
    assert ep.put((encode_payload(_batch([b"z"])),), timeout=5)
    assert ep.send_eot(timeout=5).attrs["rows"] == 3


def test_query_id_mismatch_on_a_committed_batch_is_refused(ctx, consumer):
    _stage(ctx, consumer, 0, 0, [b"a"])
    send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 1)], query="q1", ctx=ctx)
    send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 1)], query="q1", ctx=ctx)
    with pytest.raises(CommandError, match="already committed by another query"):
        send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 1)], query="q2", ctx=ctx)


# -------------------------------------------------------------------- restart, state


def test_restart_keeps_committed_ids_and_published_data(ctx, make_consumer, tmp_path):
    path = tmp_path / "state"
    c = make_consumer(path)
    _stage(ctx, c, 0, 0, [b"a"])
    _stage(ctx, c, 1, 0, [b"b"])
    _stage(ctx, c, 2, 0, [b"staged, not committed"])
    send_command(c.endpoint, "commit", "s", 0, [(0, 0, 1)], ctx=ctx)
    send_command(c.endpoint, "commit", "s", 1, [(0, 0, 1)], ctx=ctx)
    c.ack("s", 0)
    c.close()
    c2 = make_consumer(path)
    assert c2.published() == [("s", 1)]
    assert _values(c2, "s", 1) == [b"b"]
    assert c2.is_committed("s", 0) and c2.is_committed("s", 1)
    # Batch 0 re-delivered after the restart: acked, but still not published again.
    _stage(ctx, c2, 0, 0, [b"a"])
    assert send_command(c2.endpoint, "commit", "s", 0, [(0, 0, 1)], ctx=ctx)["published"] is False
    assert c2.published() == [("s", 1)]
    # A partition staged before the restart can still be committed after it.
    send_command(c2.endpoint, "commit", "s", 2, [(0, 0, 1)], ctx=ctx)
    assert c2.published() == [("s", 1), ("s", 2)]


def test_one_process_per_folder(make_consumer, tmp_path):
    make_consumer(tmp_path / "x")
    # flock is per open file description: a second open in this process conflicts too.
    with pytest.raises(ConsumerStateError, match="in use"):
        make_consumer(tmp_path / "x")


def test_crash_repairs_are_deterministic(ctx, make_consumer, tmp_path):
    path = tmp_path / "state"
    c = make_consumer(path)
    _stage(ctx, c, 0, 0, [b"a"])
    _stage(ctx, c, 1, 0, [b"b"])
    _stage(ctx, c, 2, 0, [b"c"])
    send_command(c.endpoint, "commit", "s", 0, [(0, 0, 1)], ctx=ctx)
    send_command(c.endpoint, "commit", "s", 1, [(0, 0, 1)], ctx=ctx)
    c.close()
    log_path = path / "committed.log"
    assert [e["batch"] for e in CommittedLog.read(log_path)] == [0, 1]
    # Crash after batch 1's rename, before its log record: only a torn record is left.
    data = log_path.read_bytes()
    log_path.write_bytes(data[:-10])
    assert [e["batch"] for e in CommittedLog.read(log_path)] == [0]
    # Crash in the middle of publishing batch 2 (before the rename).
    tmp_dir = path / "published" / "s" / f"{3:020d}-{2:020d}.tmp"
    tmp_dir.mkdir()
    (tmp_dir / "part-00000.arrow").write_bytes(b"half")
    # A flow that was writing when the process died.
    part = path / "staging" / "s" / f"{2:020d}" / "1-0.part"
    part.write_bytes(b"partial")
    c2 = make_consumer(path)
    assert not tmp_dir.exists() and not part.exists()
    assert c2.published() == [("s", 0), ("s", 1)]  # batch 1 rolled forward
    assert c2.is_committed("s", 1) and not c2.is_committed("s", 2)
    assert [e["batch"] for e in CommittedLog.read(log_path)] == [0, 1]
    # Batch 2's staged partition survived; its commit now succeeds.
    send_command(c2.endpoint, "commit", "s", 2, [(0, 0, 1)], ctx=ctx)
    assert _values(c2, "s", 2) == [b"c"]


def test_corrupt_committed_log_is_refused(make_consumer, tmp_path):
    path = tmp_path / "state"
    path.mkdir()
    good = json.dumps({"seq": None, "stream": "s", "batch": 0, "rows": 0}).encode()
    (path / "committed.log").write_bytes(b"garbage\n" + good + b"\n")
    with pytest.raises(ConsumerStateError, match="line 1 is corrupt"):
        make_consumer(path)


def test_compaction_keeps_ids_as_ranges(ctx, make_consumer, tmp_path, monkeypatch):
    monkeypatch.setattr(staging_mod, "COMPACT_EVERY", 5)
    path = tmp_path / "state"
    c = make_consumer(path)
    for b in [*range(12), 20, 21]:
        send_command(c.endpoint, "commit", "s", b, [], ctx=ctx)
    c.close()
    snap = json.loads((path / "committed.json").read_text())
    assert snap["streams"]["s"]["ranges"] == [[0, 9]]
    c2 = make_consumer(path)
    assert all(c2.is_committed("s", b) for b in [*range(12), 20, 21])
    assert not c2.is_committed("s", 12) and not c2.is_committed("s", 19)
    assert c2.folder._ids["s"].los == [0, 20] and c2.folder._ids["s"].his == [11, 21]


# --------------------------------------------------------------------------- peers


def test_plain_zio_giver_one_record_per_dat(ctx, consumer, make_client):
    """A reference-style giver: BOT with only direction and credit, one record per DAT."""
    port = make_client()
    port.connect(consumer.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    bot = ep.connect(Direction.EXTRACT, 10, timeout=5)
    assert bot.credit == 10
    for i in range(50):
        assert ep.put((b"rec-%d" % i,), timeout=5)
    assert ep.put((b"with-attrs",), {"key": "a2V5", "headers": {"h": "1"}, "x": 5}, timeout=5)
    assert ep.send_eot(timeout=5).attrs["rows"] == 51
    pubs = wait_until(lambda: consumer.published("zio"), what="plain batch published", timeout=10.0)
    records = [r for p in pubs for r in consumer.records(*p)]
    assert [r.value for r in records] == [b"rec-%d" % i for i in range(50)] + [b"with-attrs"]
    assert records[-1].key == b"key" and records[-1].headers == {"h": "1", "x": "5"}
    assert all(isinstance(b, str) and b.startswith("flow-") for _, b in pubs)


# The plain DATs a sink (or any giver) may send a plain taker: (payload, label attributes).
PLAIN_DATS: list[tuple[tuple[bytes, ...], dict[str, Any] | None]] = [
    ((b"bare",), None),
    ((b"keyed",), {"key": "a2V5", "headers": {"h": "1", "n": 2}}),
    ((b"foreign",), {"unit": "mV", "x": 5, "nested": {"a": [1]}}),
    ((b"odd key",), {"key": "not base64!", "headers": "flat"}),
    ((b"a", b"bc"), {"key": ""}),
    ((), None),
]


def _give_plain(make_client: Callable[..., ClientPort], endpoint: str) -> None:
    port = make_client()
    port.connect(endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    ep.connect(Direction.EXTRACT, 10, timeout=5)
    for payload, attrs in PLAIN_DATS:
        assert ep.put(payload, attrs, timeout=5)
    ep.send_eot(timeout=5)


def test_the_source_and_the_sink_read_a_plain_dat_alike(ctx, consumer, make_client, tmp_path):
    """The same plain DATs to our consumer and to the source's receiver (bind mode) give
    the same value, key and headers: one decoder (codec.records.decode_plain) for both."""
    from zio_spark.source.receiver import Receiver
    from zio_spark.storage.spool import Spool

    _give_plain(make_client, consumer.endpoint)
    pubs = wait_until(lambda: consumer.published("zio"), what="plain batch published", timeout=10.0)
    sink = [tuple(r) for p in pubs for r in consumer.records(*p)]

    spool = Spool(tmp_path / "spool", sync=False)
    receiver = Receiver(spool, [], ctx=ctx, bind=["tcp://127.0.0.1:*"]).start()
    try:
        (endpoint,) = receiver.bound_endpoints()
        _give_plain(make_client, endpoint)
        wait_until(
            lambda: sum(st.records for st in receiver.status()) >= len(PLAIN_DATS),
            what="rows",
            timeout=10.0,
        )
        ends = spool.seal()
        (producer,) = ends
        batches = list(spool.read(producer, 1, ends[producer]))
    finally:
        receiver.stop()
        spool.close()
    source = [
        (v, k, None if h is None else dict(h))
        for b in batches
        for v, k, h in zip(
            *(b.column(c).to_pylist() for c in ("value", "key", "headers")), strict=True
        )
    ]
    assert source == sink
    assert sink[0] == (b"bare", None, None)
    assert sink[1] == (b"keyed", b"key", {"h": "1", "n": "2"})
    assert sink[2] == (b"foreign", None, {"unit": "mV", "x": "5", "nested": '{"a": [1]}'})
    assert sink[3] == (b"odd key", None, {"key": "not base64!", "headers": "flat"})
    assert sink[4][1] == b"" and sink[4][2] == {"zio.frames": "2"}
    assert sink[5] == (b"", None, None)


def test_garbage_from_a_raw_peer_is_dropped_and_others_still_work(
    ctx, consumer, raw_socket, make_client
):
    raw = raw_socket(zmq.DEALER)
    raw.connect(consumer.endpoint)
    raw.send_multipart([b"", b"not a ZIO prefix", b"x"])
    raw.send_multipart([b"no delimiter"])
    # A peer with a valid flow but a payload that is not Arrow: only its flow is dropped.
    bad = make_client()
    bad.connect(consumer.endpoint)
    bad_ep = FlowEndpoint(bad, Role.CLIENT)
    attrs = {"stream": "s", "batch": 0, "partition": 9, "format": "arrow"}
    bad_ep.connect(Direction.EXTRACT, 4, attrs, timeout=5)
    wait_until(lambda: bad_ep.poll() and bad_ep.flow.credit > 0, what="credit", timeout=10.0)
    bad_ep.put((b"definitely not arrow",), timeout=5)
    wait_until(lambda: consumer.server.stats["dropped"] >= 1, what="bad flow dropped", timeout=10.0)
    assert consumer.server.stats["bad_messages"] >= 2
    # Everybody else is unaffected.
    assert _stage(ctx, consumer, 0, 0, [b"fine"]) == 1
    send_command(consumer.endpoint, "commit", "s", 0, [(0, 0, 1)], ctx=ctx)
    assert _values(consumer, "s", 0) == [b"fine"]
    assert not (consumer.root / "staging" / "s" / f"{0:020d}" / "9-0.part").exists()


def test_raw_frames_with_a_bad_bot_are_rejected_with_a_reason(ctx, consumer, raw_socket):
    raw = raw_socket(zmq.DEALER)
    raw.connect(consumer.endpoint)
    label = json.dumps(
        {"flow": "BOT", "direction": "extract", "credit": 5, "stream": "s", "batch": "../x"}
    )
    raw.send_multipart([b"", *encode_frames(Message("FLOW", label))])
    assert raw.poll(5000)
    frames = raw.recv_multipart()
    reply = json.loads(frames[1][8:].decode())
    assert reply["flow"] == "EOT" and reply["result"] == "error"
    assert "batch must be" in reply["reason"]


def test_command_to_a_consumer_that_is_not_there_times_out_naming_it(ctx):
    dead = "tcp://127.0.0.1:1"  # nothing listens on port 1
    with pytest.raises(TransportError, match=r"127\.0\.0\.1:1"):
        send_command(dead, "commit", "s", 0, [], ctx=ctx, timeout=0.3)
    with pytest.raises(TransportError, match=r"did not answer within 0\.3 s") as e:
        StagingWriter(dead, "s", 0, 0, ctx=ctx, timeout=0.3)
    assert e.value.endpoint == dead


def test_flow_rejected_for_inject_direction(ctx, consumer, make_client):
    port = make_client()
    port.connect(consumer.endpoint)
    ep = FlowEndpoint(port, Role.CLIENT)
    with pytest.raises(FlowRejected, match="only takes data"):
        ep.connect(Direction.INJECT, 5, {"stream": "s"}, timeout=5)
