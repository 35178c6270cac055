"""The PZQ-compatible durable queue: the broker and its ZIO flow ports."""
