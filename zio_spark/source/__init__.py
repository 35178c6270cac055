"""The streaming source's moving parts below Spark: the producer (an ack-capable ZIO
giver), the receiver that fills the spool, and the spool server executors read from."""
