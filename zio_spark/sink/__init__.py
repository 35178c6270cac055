"""The streaming sink's moving parts below Spark: the consumer (a ZIO taker that stages
and publishes each Spark batch once) and the executor-side client."""
