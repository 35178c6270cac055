"""A batch read's receive (``runtime.batch_receive``, what ``spark.read.format("zio")``
runs on the driver) with ``maxRecords``, over a zio-spark producer (ack-capable) and the
stand-in for a plain ZIO reference giver (``tests/peers/zio_reference.py``): the plain
giver cannot send a record again, so ``maxRecords`` goes to it first; the producer keeps
what is not acked for the next read. No Spark; loopback, random ports, polled waits.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from tests.peers.zio_reference import ReferenceServer
from tests.support import wait_until
from zio_spark.options import parse_source_options
from zio_spark.source.producer import Producer
from zio_spark.source.receiver import Receiver
from zio_spark.source.runtime import batch_receive
from zio_spark.storage.spool import Spool, read_sealed


def _values(path: str, producer: str, start: int, end: int) -> list[bytes]:
    out: list[bytes] = []
    for batch in read_sealed(path, producer, start, end):
        out.extend(batch.column("value").to_pylist())
    return out


def _read(ctx: Any, tmp_path: Path, endpoints: list[str], max_records: int) -> Any:
    opts = parse_source_options(
        {
            "endpoints": ",".join(endpoints),
            "spoolPath": str(tmp_path / "spool"),
            "maxRecords": str(max_records),
            "timeout": "30s",
        }
    )
    return batch_receive(opts, ctx=ctx)


def test_max_records_goes_to_the_plain_giver_first_and_the_producer_keeps_its_rest(
    ctx, closing, tmp_path, caplog
):
    """A producer first in id order with 2500 records and a plain giver with 300,
    ``maxRecords`` 1000: the plain giver's 300 are all in the read (they were dropped
    when the producer, first in id order, took the whole budget), the producer's first
    700 with them; the producer keeps its other 1800 and the next read gets them."""
    plain = [b"ref-%d" % i for i in range(300)]
    ref = ReferenceServer(ctx, role="giver", flavor="cpp", values=plain, credit=10)
    closing.append(ref)
    prod = Producer("tcp://127.0.0.1:*", producer_id="a-producer", ctx=ctx, linger_ms=0)
    closing.append(prod)
    assert ref.endpoint > "a-producer"  # the producer comes first in id order
    got: dict[str, Any] = {}

    def read() -> None:
        try:
            got["read"] = _read(ctx, tmp_path, [prod.endpoint, ref.endpoint], 1000)
        except BaseException as e:
            got["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    with caplog.at_level(logging.WARNING, logger="zio_spark.source"):
        reader.start()
        # The plain giver gives its 300 and ends its flow; then the producer gets its
        # records, so the read's budget is reached with the plain giver's all received.
        wait_until(
            lambda: ref.flows_completed == 1,
            what="the plain giver's flow to end",
            detail=lambda: (got, len(ref.sent), ref.errors),
        )
        prod.send_many([b"a-%d" % i for i in range(2500)])
        wait_until(lambda: not reader.is_alive(), what="the batch read", timeout=60.0)
    assert "error" not in got, got.get("error")
    path, ranges = got["read"]
    assert ranges == {ref.endpoint: (1, 301), "a-producer": (1, 701)}
    assert _values(path, ref.endpoint, 1, 301) == plain
    assert _values(path, "a-producer", 1, 701) == [b"a-%d" % i for i in range(700)]
    assert not [r for r in caplog.records if "beyond maxRecords" in r.getMessage()]
    assert ref.errors == [] and ref.flows_completed == 1  # its flow ended once, cleanly
    wait_until(lambda: prod.acked == 700, what="the first read acknowledged")
    # The producer kept what the read did not ack: the next read gets it, in order.
    path, ranges = _read(ctx, tmp_path, [prod.endpoint], 1800)
    assert ranges == {"a-producer": (701, 2501)}
    assert _values(path, "a-producer", 701, 2501) == [b"a-%d" % i for i in range(700, 2500)]
    wait_until(lambda: prod.acked == 2500, what="the second read acknowledged")


def test_a_plain_giver_is_given_credit_for_max_records_only(ctx, closing, tmp_path, caplog):
    """A plain giver holding more than ``maxRecords``: it gets credit for exactly that
    many records, so it gives no record the read would drop (before, the credit went on
    until the read noticed the budget and ended the flows: 1000-2000 records beyond
    ``maxRecords`` 100 given and lost here). It keeps the rest; the read ends at once."""
    plain = [b"ref-%d" % i for i in range(5000)]
    ref = ReferenceServer(ctx, role="giver", flavor="cpp", values=plain, credit=10)
    closing.append(ref)
    with caplog.at_level(logging.WARNING, logger="zio_spark.source"):
        path, ranges = _read(ctx, tmp_path, [ref.endpoint], 100)
    assert ranges == {ref.endpoint: (1, 101)}
    assert _values(path, ref.endpoint, 1, 101) == plain[:100]
    stored = Spool(path, sync=False)
    try:
        assert stored.seal()[ref.endpoint] == 101  # nothing stored beyond the read
    finally:
        stored.close()
    assert len(ref.sent) == 100  # and nothing given: nothing lost
    assert not [r for r in caplog.records if "beyond maxRecords" in r.getMessage()]
    # Our EOT reached it while it waited for credit: its flow ended cleanly.
    assert ref.wait_until(lambda: ref.flows_completed == 1) and ref.errors == []


def test_hold_credit_bounds_what_a_plain_giver_still_sends(ctx, closing, tmp_path):
    """After ``hold_credit`` no credit is paid: the reference giver sends at most what
    it held then (the count returned) and blocks for credit, with records left."""
    plain = [b"v%d" % i for i in range(5000)]
    ref = ReferenceServer(ctx, role="giver", flavor="cpp", values=plain, credit=10)
    closing.append(ref)
    spool = Spool(tmp_path / "spool", sync=False)
    closing.append(spool)
    r = Receiver(spool, [ref.endpoint], ctx=ctx, reconnect=False, credit=10)
    closing.append(r.start())
    wait_until(lambda: r.status()[0].records >= 50, what="records from the giver")
    held = r.hold_credit()
    assert held is not None
    at_hold = r.status()[0].records  # at least what was received when it held
    wait_until(lambda: ref.blocked_for_credit, what="the giver blocked for credit")
    wait_until(lambda: r.status()[0].records == len(ref.sent), what="what it sent to be received")
    assert at_hold <= len(ref.sent) <= at_hold + held[ref.endpoint] < len(plain)
    assert r.status()[0].state == "receiving"  # held, not ended
