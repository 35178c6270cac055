"""Durable storage without networking: the source's spool (WAL and sealed Arrow files),
the PZQ queue's message store (segment log, group commit) and flow side log, and the sink
consumer's folder (staging, publishing, committed ids). Shared file helpers are
:mod:`~zio_spark.storage.files`; errors are :class:`~zio_spark.errors.StorageError` and its
subclasses."""
