"""A Spark driver for the reliability suite, run as a child so it can be SIGKILLed.

Usage::

    python driver_child.py source ENDPOINT CKPT OUT SPOOL PER_TRIGGER BACKLOG CREDIT [TOPOLOGY]
    python driver_child.py direct ENDPOINTS CKPT OUT PER_TRIGGER MASTER [FAIL_ON_LOSS [TIMEOUT]]
    python driver_child.py sink ENDPOINT CKPT ROWS_PER_BATCH SEED FAIL_PROB

``source``: ``readStream.format("zio")`` from one producer -> parquet files in ``OUT``;
``TOPOLOGY`` ``connect`` (default: the source connects to the producer at ENDPOINT) or
``bind`` (the source binds ENDPOINT and the producer connects as a flow client).
``direct``: the same query with ``readMode=direct`` (no spool: tasks read ranges straight
from the givers at ENDPOINTS, comma-separated, the driver acks commits on its control
flows), on Spark master ``MASTER`` (``local[2,8]``: a task whose range read a giver's kill
cut short is retried; or a standalone cluster's URL), ``failOnDataLoss`` as
``FAIL_ON_LOSS`` (default ``true``), ``connectTimeout`` as ``TIMEOUT`` (default
``60s``: a task whose giver was killed under its read fails only after it, as the
giver's restart never hears from a reader that waits for records); the parquet files hold
``key`` too (the queue's message ids).
With ``ZIO_CHAOS_SOURCE_SERVER_KEY``, ``ZIO_CHAOS_SOURCE_PUBLIC`` and
``ZIO_CHAOS_SOURCE_SECRET`` in the environment (Z85; never in the command line), the
``direct`` query reads over CURVE: ``curveServerKey`` (the givers'), ``curvePublicKey`` and
``curveSecretKey`` (the driver's, on the givers' allow-lists).
``sink``: ``rate-micro-batch`` -> a UDF that fails some tasks (seeded, first attempt only,
after part of the partition went out) -> ``writeStream.format("zio")``, on
``local[2,4]`` so failed tasks are retried.

Prints ``STARTED <query id>`` once the query runs, then runs until killed (SIGKILL) or
stopped (SIGTERM); prints ``QUERY_EXCEPTION`` and exits 1 if the query fails.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql.functions import udf

# As tests/spark/conftest.py: loopback only, no UI, few shuffle partitions.
CONF = {
    "spark.ui.enabled": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
}
FAIL_AT = 900  # a doomed task attempt fails at this row (earlier rows went out)
PAD = 200  # bytes per sink value
ARROW_CONF, ARROW_ROWS = "spark.sql.execution.arrow.maxRecordsPerBatch", 100


def session(master: str, name: str, extra: dict[str, str] | None = None) -> SparkSession:
    builder = SparkSession.builder.master(master).appName(name)
    for key, value in {**CONF, **(extra or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def source_query(argv: list[str]):
    endpoint, ckpt, out, spool, per_trigger, backlog, credit, *rest = argv
    topology = rest[0] if rest else "connect"
    spark = session("local[2]", "zio-chaos-source")
    df = (
        spark.readStream.format("zio")
        .option({"connect": "endpoints", "bind": "bind"}[topology], endpoint)
        .option("spoolPath", spool)
        .option("maxRecordsPerTrigger", per_trigger)
        .option("maxBacklog", backlog)
        .option("credit", credit)
        .option("connectTimeout", "60s")
        .load()
        .select("producer", "seq", "value")
    )
    return _to_parquet(df, out, ckpt)


def _to_parquet(df, out: str, ckpt: str):
    """The source queries' sink: parquet files, checkpointed, a trigger every 200 ms."""
    return (
        df.writeStream.format("parquet")
        .option("path", out)
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="200 milliseconds")
        .start()
    )


CURVE_ENV = {
    "curveServerKey": "ZIO_CHAOS_SOURCE_SERVER_KEY",
    "curvePublicKey": "ZIO_CHAOS_SOURCE_PUBLIC",
    "curveSecretKey": "ZIO_CHAOS_SOURCE_SECRET",
}


def direct_query(argv: list[str]):
    endpoint, ckpt, out, per_trigger, master, *rest = argv
    defaults = ["true", "60s"]  # failOnDataLoss, connectTimeout
    fail_on_data_loss, timeout = [*rest, *defaults[len(rest) :]]
    extra = {"spark.task.maxFailures": "8"} if not master.startswith("local") else {}
    spark = session(master, "zio-chaos-direct", extra)
    curve = {opt: os.environ[var] for opt, var in CURVE_ENV.items() if var in os.environ}
    df = (
        spark.readStream.format("zio")
        .option("endpoints", endpoint)
        .option("readMode", "direct")
        .option("maxRecordsPerTrigger", per_trigger)
        .option("connectTimeout", timeout)
        .option("failOnDataLoss", fail_on_data_loss)
        .options(**curve)
        .load()
        .select("producer", "seq", "value", "key")
    )
    return _to_parquet(df, out, ckpt)


def sink_query(argv: list[str]):
    endpoint, ckpt, rows, seed, prob = argv
    seed_i, prob_f = int(seed), float(prob)
    # Arrow batches of ARROW_ROWS rows towards the writer: a failing attempt has sent some.
    spark = session("local[2,4]", "zio-chaos-sink", {ARROW_CONF: str(ARROW_ROWS)})
    seen: dict[int, int] = {}  # rows per task attempt, in each Python worker

    @udf("string")
    def flaky(v: int) -> str:
        import random

        from pyspark import TaskContext

        tc = TaskContext.get()
        n = seen[tc.taskAttemptId()] = seen.get(tc.taskAttemptId(), 0) + 1
        if n == FAIL_AT and tc.attemptNumber() == 0:
            batch = tc.getLocalProperty("streaming.sql.batchId")
            part = tc.partitionId()
            # Batch 1's partition 0 always, so that every run injects one (at CI size a
            # run has ~12 tasks: with the draws alone, 0.75**12 = 3 % of seeds had none).
            always = batch == "1" and part == 0
            if always or random.Random(f"{seed_i}/{batch}/{part}").random() < prob_f:
                raise RuntimeError(f"injected task failure: batch {batch} partition {part}")
        # Padded (int() ignores the spaces) so that rows before a failure fill Spark's
        # 64 KiB buffer towards the writer and reach the consumer's staging.
        return str(v).rjust(PAD)

    df = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", int(rows))
        .option("numPartitions", 2)
        .load()
        .select(flaky("value").alias("value"))
    )
    return (
        df.writeStream.format("zio")
        .option("endpoint", endpoint)
        .option("stream", "chaos")
        .option("connectTimeout", "30s")
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="200 milliseconds")
        .start()
    )


def main() -> int:
    mode, *argv = sys.argv[1:]
    query = {"source": source_query, "direct": direct_query, "sink": sink_query}[mode](argv)
    print("STARTED", query.id, flush=True)
    try:
        query.awaitTermination()  # returns or raises only when the query ends by itself
    except Exception as e:
        print("QUERY_EXCEPTION", e, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
