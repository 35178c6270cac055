"""Durability: the source's replayable spool and the PZQ-style store.

:mod:`zio_spark.queue.spool` is the append-only, per-producer log that turns pushed ZIO
records into offsets Spark can replay (DESIGN.md, "The source", points 2-6); it imports
neither ``zmq`` nor ``pyspark``, so executors can read segments with it alone.
:mod:`zio_spark.queue.store` is the PZQ-style durable message store (pure stdlib) and
:mod:`zio_spark.queue.broker` the queue server on top of it (pyzmq);
:mod:`zio_spark.queue.consumer` is the sink's consumer (staging, atomic publish).
"""
