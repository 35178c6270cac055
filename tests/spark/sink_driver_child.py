"""A Spark driver for ``test_sink_driver_kill.py``: rate-micro-batch -> zio sink, forever.

Usage: ``python sink_driver_child.py ENDPOINT STREAM CHECKPOINT ROWS_PER_BATCH``.
Prints ``STARTED <query id>`` once the query runs, then waits to be killed (SIGKILL) or
stopped (SIGTERM). Exits 1 with ``QUERY_EXCEPTION`` if the query fails. No cleanup is
expected: the test kills this process and its Spark JVM as a process group.
"""

from __future__ import annotations

import sys
import time

from pyspark.sql import SparkSession


def main() -> int:
    endpoint, stream, ckpt, rows = sys.argv[1:5]
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("zio-sink-driver-kill")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    df = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", int(rows))
        .option("numPartitions", 2)
        .load()
        .selectExpr("cast(value as string) as value")
    )
    q = (
        df.writeStream.format("zio")
        .option("endpoint", endpoint)
        .option("stream", stream)
        .option("connectTimeout", "20s")
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    print("STARTED", q.id, flush=True)
    while q.exception() is None and q.isActive:
        time.sleep(0.2)
    print("QUERY_EXCEPTION", q.exception(), flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
