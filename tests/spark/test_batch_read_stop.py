"""A batch read ends the flows before it seals and returns: what a plain giver sends
until our EOT reaches it (and its echo confirms) is in the result, never dropped with the
private spool. No Spark session: the reader's own partitions() and read()."""

from __future__ import annotations

from pathlib import Path

import zmq

import tests.loopback.test_receiver as rt  # module import: its tests are not re-collected
from tests.support import wait_until
from zio_spark.options import parse_source_options
from zio_spark.spark.source import ZioBatchReader, _columns


class LateGiver(rt.PlainGiver):
    """A plain giver that keeps its flow open after its values; on our EOT it sends
    ``late`` records it had in flight, then echoes the EOT (confirming them all)."""

    echo_eot = False  # it echoes itself, after its late records

    def __init__(self, ctx: zmq.Context, values: list[bytes], late: list[bytes]) -> None:
        self.late = late
        super().__init__(ctx, values, credit=50)
        self.eot_sent = True  # no EOT of its own

    def on_eot(self, ident: bytes, label: dict) -> None:
        super().on_eot(ident, label)
        for v in self.late:
            self.send(ident, {"flow": "DAT"}, (v,))
        self.send(ident, {"flow": "EOT"})


def test_records_a_plain_giver_sends_until_our_eot_are_in_the_result(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    values = [b"v%d" % i for i in range(20)]
    late = [b"late%d" % i for i in range(5)]
    giver = LateGiver(ctx, values, late)
    try:
        opts = parse_source_options(
            {"endpoints": giver.endpoint, "spoolPath": str(tmp_path / "spool"), "timeout": "1s"}
        )
        reader = ZioBatchReader(opts, _columns(None))
        parts = reader.partitions()
        got: list[bytes] = []
        for part in parts:
            for batch in reader.read(part):
                got.extend(batch.column("value").to_pylist())
        wait_until(lambda: giver.eot_echoes == 1, 10, "our EOT at the giver")
        assert got == values + late, "what the giver was told arrived is in the result"
    finally:
        giver.close()
