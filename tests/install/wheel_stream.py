"""A small stream with the installed wheel (run by wheel_check.sh inside its venv).

``format("zio")`` must be found by Spark's own lookup (the wheel's ``pyspark_zio``), and
zio_spark must come from the venv given as argv[1], in the driver and in the workers.
Prints one line: ``stream: N rows, every seq once``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pyspark.sql import SparkSession

import zio_spark
from zio_spark.source.producer import Producer

N = 3000
venv = Path(sys.argv[1]).resolve()
assert Path(zio_spark.__file__).resolve().is_relative_to(venv), zio_spark.__file__

spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.enabled", "false")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.sql.shuffle.partitions", "2")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("WARN")
prod = Producer(producer_id="wheel", linger_ms=0)
q = None
try:
    prod.send_many([b"w%d" % i for i in range(N)])
    q = (
        spark.readStream.format("zio")
        .option("endpoints", prod.endpoint)
        .load()
        .writeStream.format("memory")
        .queryName("wheel_rows")
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    # Bounded by progress: every poll either sees rows arrive or the query's own error.
    deadline = time.monotonic() + 300
    while True:
        if q.exception() is not None:
            raise SystemExit(f"query failed: {q.exception()}")
        got = spark.sql("select count(*) from wheel_rows").collect()[0][0]
        if got >= N or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    seqs = sorted(r[0] for r in spark.sql("select seq from wheel_rows").collect())
    assert seqs == list(range(1, N + 1)), f"{len(seqs)} rows, want seq 1..{N} once each"
    # Where the workers imported zio_spark from: the venv too.
    where = (
        spark.sparkContext.parallelize([0], 1)
        .map(lambda _: __import__("zio_spark").__file__)
        .collect()[0]
    )
    assert Path(where).resolve().is_relative_to(venv), where
    print(f"stream: {len(seqs)} rows, every seq once; workers' zio_spark from {where}")
finally:
    if q is not None:
        q.stop()
    prod.close(flush=False, timeout=5)
    spark.stop()
