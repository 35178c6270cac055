"""Source throughput against anchors measured in the same run (local[2], noop sink).

Cases, run back to back in every round (so a ratio compares neighbours in time):

- ``rate`` (anchor): Spark's built-in ``rate-micro-batch`` source, one batch of N rows.
- ``synthetic Arrow`` (anchor): a Python ``DataSourceStreamReader`` yielding Arrow batches
  of 100 B values, 10k rows each: the ceiling of any Python source (target >= 0.9x).
- ``zio, Arrow DATs``: an in-process Producer pre-loaded with N records of 100 B (Arrow,
  4096 records per DAT: the producer's default), read with ``readStream.format("zio")``.
- ``zio, 1 record/DAT (plain)``: a plain ZIO giver with the reference implementation's
  wire shape (``common.PlainGiver``: one record per DAT, label ``{"flow": "DAT"}``, no
  acknowledgements), P records (target >= 250k records/s).
- ``zio, 1 record/DAT (Arrow)``: ``Producer(batch=1)``: one Arrow-encoded record per DAT.
- ``zio bind, plain clients``: the reference's own topology: the source binds
  (``option("bind", ...)``) and two plain giver *clients* (:class:`PlainClientGiver`: BOT
  without attributes, one record per DAT, bare label) give P/2 records each.
- ``zio bind, Producer(connect)``: our producer as a flow client into ``bind`` (Arrow,
  acknowledged), N records.

Every query runs under ``Trigger.AvailableNow`` into the ``noop`` sink. Figures: rows/s
over the whole query (wall clock, start-up included; for zio this includes receiving
everything into the spool, i.e. the source's real work) and over the batches' own
``triggerExecution`` time. Ratios are taken run by run on wall time against the anchors
of the same round. Rows are counted from the query's progress, not assumed.

Run: ``.venv/bin/python bench/bench_source.py [--quick] [--out DIR]``; writes
``DIR/source.json`` and prints a Markdown table.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from common import (
    PlainGiver,
    fmt_spread,
    machine,
    md_table,
    quick_args,
    ratio_spread,
    spark_run,
    spread,
    write_json,
    zio_stream,
)
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

ROWS_PER_BATCH = 10_000
VALUE = b"x" * 100


class _Synthetic(DataSource):  # type: ignore[misc]
    @classmethod
    def name(cls) -> str:
        return "zio_bench_synthetic"

    def schema(self) -> str:
        return "value binary, seq bigint"

    def streamReader(self, schema):  # type: ignore[no-untyped-def]
        return _SyntheticReader(int(self.options.get("rows", "1000000")))


class _SyntheticReader(DataSourceStreamReader):  # type: ignore[misc]
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def initialOffset(self) -> dict:
        return {"n": 0}

    def latestOffset(self) -> dict:
        return {"n": self.rows}

    def partitions(self, start: dict, end: dict):  # type: ignore[no-untyped-def]
        s, e = start["n"], end["n"]
        step = max(1, (e - s) // 2)
        return [InputPartition((a, min(e, a + step))) for a in range(s, e, step)]

    def read(self, partition):  # type: ignore[no-untyped-def]
        a, b = partition.value
        for lo in range(a, b, ROWS_PER_BATCH):
            hi = min(b, lo + ROWS_PER_BATCH)
            yield pa.RecordBatch.from_arrays(
                [pa.array([VALUE] * (hi - lo), pa.binary()), pa.array(range(lo, hi), pa.int64())],
                names=["value", "seq"],
            )


def _run(df: Any, work: Path, expect: int) -> dict[str, float]:
    t0 = time.perf_counter()
    q = (
        df.writeStream.format("noop")
        .option("checkpointLocation", os.path.join(work, f"ckpt-{time.time_ns()}"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(q.exception())
    wall = time.perf_counter() - t0
    progress = q.recentProgress
    rows = sum(p["numInputRows"] for p in progress)
    if rows != expect:
        raise RuntimeError(f"query read {rows} rows, expected {expect}")
    busy = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    return {"wall": rows / wall, "batches": rows / (busy or wall), "seconds": wall}


class PlainClientGiver:
    """A reference-shaped plain giver *client*: connects to ``endpoint``, opens the flow
    with ``BOT{direction: extract, credit}`` and nothing else, sends ``n`` copies of
    ``value`` one per DAT labelled ``{"flow": "DAT"}`` within the credit paid, then EOT
    and waits for the echo. One thread; :meth:`close` stops it."""

    def __init__(
        self, endpoint: str, n: int, value: bytes, origin: int, credit: int = 1000
    ) -> None:
        import threading

        import zmq

        from zio_spark.transport.port import ClientPort

        self.n, self.value, self.origin, self.credit, self.sent = n, value, origin, credit, 0
        self.done = False
        self._ctx = zmq.Context()
        self._port = ClientPort(self._ctx, linger_ms=0, sndhwm=100_000)
        self._port.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._give, name="plain-client", daemon=True)
        self._thread.start()

    def _give(self) -> None:
        from zio_spark.protocol.flow import Direction, EotReceived, Flow, FlowState, Role
        from zio_spark.protocol.message import DatCodec

        port, payload = self._port, (self.value,)
        flow = Flow(Role.CLIENT, origin=self.origin)
        codec = DatCodec(self.origin)
        port.send(flow.send_bot(Direction.EXTRACT, self.credit))
        eot_sent = False
        while not self._stop.is_set():
            for msg in port.recv_many(1000, 20):
                if not hasattr(msg, "label"):
                    raise RuntimeError(f"bad message from the source: {msg}")
                event = flow.receive(msg)
                if isinstance(event, EotReceived):
                    self.done = event.echo
                    return
            k = min(flow.credit, self.n - self.sent)
            if k > 0 and flow.state is FlowState.READY:
                first = flow.send_dats(k)
                for i in range(k):
                    port.send_dat(codec, first + i, payload)
                self.sent += k
            if self.sent == self.n and not eot_sent and flow.state is FlowState.READY:
                port.send(flow.send_eot())
                eot_sent = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._port.close()
        self._ctx.term()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bound_stream(spark: Any, work: Path, endpoint: str, **options: str) -> Any:
    reader = (
        spark.readStream.format("zio")
        .option("bind", endpoint)
        .option("spoolPath", str(work / f"spool-{time.time_ns()}"))
        .option("spoolAccess", "local")
        .option("connectTimeout", "60s")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _zio_bound(spark: Any, work: Path, n: int, kind: str) -> dict[str, float]:
    """The source binds; the clients are started first and connect as soon as it does
    (the availableNow run takes what they give until its flows go quiet)."""
    from zio_spark.source.producer import Producer

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    backlog = str(max(n, 1_000_000))
    if kind == "bind-plain":
        half = n // 2
        clients = [PlainClientGiver(endpoint, half, VALUE, origin=o) for o in (1, 2)]
        try:
            return _run(_bound_stream(spark, work, endpoint, maxBacklog=backlog), work, 2 * half)
        finally:
            for c in clients:
                c.close()
    prod = Producer(
        connect=endpoint,
        producer_id="bench-client",
        linger_ms=0,
        max_unacked=n + 1,
        max_unacked_bytes=(n + 1) * len(VALUE),  # the whole preload is held until acked
    )
    try:
        for lo in range(0, n, 100_000):
            prod.send_many([VALUE] * min(100_000, n - lo))
        return _run(_bound_stream(spark, work, endpoint, maxBacklog=backlog), work, n)
    finally:
        prod.close(flush=False, timeout=0.2)


def _zio(spark: Any, work: Path, n: int, kind: str) -> dict[str, float]:
    from zio_spark.source.producer import Producer

    if kind == "plain":
        giver = PlainGiver(n, VALUE)
        try:
            return _run(zio_stream(spark, giver, work, maxBacklog=str(max(n, 1_000_000))), work, n)
        finally:
            giver.close()
    common = {
        "producer_id": f"bench-{kind}",
        "linger_ms": 0,
        "max_unacked": n + 1,
        "max_unacked_bytes": (n + 1) * len(VALUE),  # the whole preload is held until acked
    }
    # "arrow": the default DAT size (4096 records); "arrow1": one record per DAT.
    prod = Producer(**common) if kind == "arrow" else Producer(batch=1, **common)
    try:
        for lo in range(0, n, 100_000):
            prod.send_many([VALUE] * min(100_000, n - lo))
        df = zio_stream(spark, prod, work, maxBacklog=str(max(n, 1_000_000)))
        return _run(df, work, n)
    finally:
        # The availableNow query has ended: no taker is left to echo our EOT.
        prod.close(flush=False, timeout=0.2)


CASES = {
    "rate": "rate (built-in, anchor)",
    "synthetic": "synthetic Python Arrow source (anchor)",
    "arrow": "zio, Arrow DATs (4096 records/DAT, the default)",
    "plain": "zio, 1 record/DAT (plain)",
    "arrow1": "zio, 1 record/DAT (Arrow, batch=1)",
    "bind-plain": "zio bind, 2 plain giver clients (1 record/DAT)",
    "bind-producer": "zio bind, Producer(connect) (Arrow DATs)",
}


def main() -> None:
    a = quick_args(
        __doc__,
        {
            "rows": (3_000_000, 200_000, "N"),
            "single": (60_000, 10_000, "M"),
            "plain": (600_000, 60_000, "P"),
            "runs": (3, 1, "rounds"),
        },
    )
    n, m, plain, runs = a.rows, a.single, a.plain, a.runs

    res: dict[str, dict[str, list[float]]] = {k: {"wall": [], "batches": []} for k in CASES}

    def record(case: str, r: dict[str, float]) -> None:
        res[case]["wall"].append(r["wall"])
        res[case]["batches"].append(r["batches"])

    with spark_run("bench-source") as (spark, work):
        spark.dataSource.register(_Synthetic)
        # Warm-up (not counted): first use of the Python data source machinery.
        _run(
            spark.readStream.format("zio_bench_synthetic").option("rows", "1000").load(), work, 1000
        )
        for i in range(runs):
            rate = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", str(n)).load()
            record("rate", _run(rate, work, n))
            syn = spark.readStream.format("zio_bench_synthetic").option("rows", str(n)).load()
            record("synthetic", _run(syn, work, n))
            record("arrow", _zio(spark, work, n, "arrow"))
            record("plain", _zio(spark, work, plain, "plain"))
            record("arrow1", _zio(spark, work, m, "arrow1"))
            record("bind-plain", _zio_bound(spark, work, plain, "bind-plain"))
            record("bind-producer", _zio_bound(spark, work, n, "bind-producer"))
            print(
                f"round {i}: " + ", ".join(f"{k} {v['wall'][-1]:,.0f}/s" for k, v in res.items()),
                flush=True,
            )

    figures = {
        k: {
            "label": CASES[k],
            "rows": {"plain": plain, "arrow1": m, "bind-plain": plain // 2 * 2}.get(k, n),
            "rows_per_s_wall": spread(v["wall"]),
            "rows_per_s_batches": spread(v["batches"]),
        }
        for k, v in res.items()
    }
    ratios = {
        f"{k}_vs_{anchor}": ratio_spread(res[k]["wall"], res[anchor]["wall"])
        for k in ("arrow", "plain", "arrow1", "bind-plain", "bind-producer")
        for anchor in ("synthetic", "rate")
    }
    targets = {
        "arrow_vs_synthetic >= 0.9": ratios["arrow_vs_synthetic"]["median"] >= 0.9,
        "plain >= 250k records/s": figures["plain"]["rows_per_s_wall"]["median"] >= 250_000,
    }
    write_json(
        a.out,
        "source.json",
        {
            "bench": "source",
            "machine": machine(),
            "rows": n,
            "single_rows": m,
            "runs": runs,
            "unit": "rows/s",
            "figures": figures,
            "ratios": ratios,
            "targets_met": targets,
        },
    )
    print()
    print(
        md_table(
            [
                "path",
                "rows",
                "rows/s, wall (median, min-max)",
                "rows/s, batches only",
                "vs synthetic",
                "vs rate",
            ],
            [
                [
                    f["label"],
                    f"{f['rows']:,}",
                    fmt_spread(f["rows_per_s_wall"]),
                    fmt_spread(f["rows_per_s_batches"]),
                    "anchor"
                    if k in ("rate", "synthetic")
                    else fmt_spread(ratios[f"{k}_vs_synthetic"], "x", digits=3),
                    "anchor"
                    if k in ("rate", "synthetic")
                    else fmt_spread(ratios[f"{k}_vs_rate"], "x", digits=3),
                ]
                for k, f in figures.items()
            ],
        )
    )
    print()
    print(
        f"{runs} round(s), {os.cpu_count()} CPUs. Targets: zio Arrow >= 0.9x synthetic "
        f"({'met' if targets['arrow_vs_synthetic >= 0.9'] else 'NOT met'}); 1 record/DAT "
        f">= 250k/s ({'met' if targets['plain >= 250k records/s'] else 'NOT met'}). "
        "ROUTER/DEALER fallback (no draft libzmq) unless the build has drafts."
    )


if __name__ == "__main__":
    main()
