"""Codecs: how records travel inside ZIO DAT payloads (Arrow IPC batches, plain records)
and the Spark-facing schema. No sockets, no Spark: bytes in, values out."""
