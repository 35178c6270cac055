"""The driver of tests/cluster/test_standalone_cluster.py, run as its own process.

Connects to a standalone master, waits for two executors, probes what the executors
see (``PROBE`` lines), then runs ``readStream.format("zio")`` (spool under a folder the
workers cannot see, ``spoolAccess=auto``) into ``writeStream.format("zio")`` (a consumer)
and prints one ``PROGRESS`` JSON line per micro-batch. It stops once ``--records`` rows
went through and no batch has come for a while, and prints ``DONE``.

Argv: master producer_endpoint consumer_endpoint spool checkpoint records [read_mode]

``read_mode`` ``direct`` (default ``spool``): ``readMode=direct``, no spool: each task
reads its range straight from the producer, the driver acks commits on its control
flow; ``PROGRESS`` lines then carry the producer's held window as the driver last saw it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def probe(spool: str) -> dict[str, object]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    ancestors, pid = [], os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        ancestors.append(pid)
    return {
        "ancestors": ancestors,
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "mnt": os.readlink("/proc/self/ns/mnt"),
        "spool_exists": os.path.exists(spool),
        "partition": ctx.partitionId() if ctx else -1,
        "tmp": os.environ.get("TMPDIR", ""),
    }


def main() -> int:
    master, producer, consumer, spool, ckpt, records = sys.argv[1:7]
    read_mode = sys.argv[7] if len(sys.argv) > 7 else "spool"
    total = int(records)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName("zio-cluster-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.executor.cores", "1")
        .config("spark.cores.max", "2")
        .config("spark.executor.memory", "512m")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.task.maxFailures", "8")
        .getOrCreate()
    )
    sc = spark.sparkContext
    deadline = time.monotonic() + 180
    while sc._jsc.sc().getExecutorMemoryStatus().size() < 3:  # driver + 2 executors
        if time.monotonic() > deadline:
            print("FAIL two executors did not register in 180 s", flush=True)
            return 1
        time.sleep(0.2)
    driver = {"pid": os.getpid(), "mnt": os.readlink("/proc/self/ns/mnt")}
    driver["spool_exists"] = os.path.exists(spool)
    print("DRIVER " + json.dumps(driver), flush=True)
    for p in sc.parallelize(range(8), 8).map(lambda _: probe(spool)).collect():
        print("PROBE " + json.dumps(p), flush=True)

    reader = (
        spark.readStream.format("zio")
        .option("endpoints", producer)
        .option("maxRecordsPerTrigger", "3000")
    )
    if read_mode == "direct":
        reader = reader.option("readMode", "direct")
    else:
        reader = reader.option("spoolPath", spool).option("spoolAccess", "auto")
    df = reader.load().selectExpr("value", "cast(cast(seq as string) as binary) as key")
    q = (
        df.writeStream.format("zio")
        .option("endpoint", consumer)
        .option("stream", "cluster")
        .option("connectTimeout", "60s")
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    seen, rows, last_rows_at = -1, 0, time.monotonic()
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if q.exception() is not None:
                print(f"FAIL query failed: {q.exception()}", flush=True)
                return 1
            for p in q.recentProgress:
                if p["batchId"] <= seen:
                    continue
                seen = p["batchId"]
                src = p["sources"][0]
                report = src.get("latestOffset") or {}
                if isinstance(report, str):
                    report = json.loads(report)
                n = int(p["numInputRows"] or 0)
                rows += n
                if n:
                    last_rows_at = time.monotonic()
                line = {
                    "batch": seen,
                    "rows": n,
                    "total": rows,
                    "segmentRequests": report.get("segmentRequests"),
                    "heldWindows": report.get("heldWindows"),
                }
                print("PROGRESS " + json.dumps(line), flush=True)
            # Every record read and committed, and two more batches' worth of quiet (so
            # the last data batch's commit went through and latestOffset reported again).
            if rows >= total and time.monotonic() - last_rows_at > 5:
                break
            time.sleep(0.2)
        else:
            print(f"FAIL only {rows} of {total} rows in 600 s", flush=True)
            return 1
    finally:
        q.stop()
    print(f"DONE {rows}", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
