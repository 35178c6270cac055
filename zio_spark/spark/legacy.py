"""The stream reader on a Spark without admission control for Python sources (before
4.2: :data:`zio_spark.spark.compat.HAS_ADMISSION_CONTROL` false).

Such a Spark calls ``latestOffset()`` with no arguments. The reader needs ``start`` (the
end of the batch Spark has in its commit log) to acknowledge records to the producers:
``commit(end)`` lags a batch and never comes for the last one. Spark < 4.2 runs a batch
to the exact offset ``latestOffset()`` returned, one batch at a time, and asks again only
once that batch is in its commit log (or when it ran none, the offsets being unchanged).
So the previous answer *is* the next ``start``: this subclass passes it on.

Without ``reportLatestOffset`` (same Spark versions) the metrics it would report in the
query's progress are logged instead (logger ``zio_spark.source``, INFO), at most every
:data:`METRICS_LOG_INTERVAL` seconds.

Imported only by :meth:`ZioDataSource.streamReader
<zio_spark.spark.datasource.ZioDataSource.streamReader>` on such a Spark.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from zio_spark.spark import compat
from zio_spark.spark.source import ZioStreamReader

__all__ = ["METRICS_LOG_INTERVAL", "ZioStreamReaderOldApi"]

log = logging.getLogger("zio_spark.source")

# Seconds between two metrics lines (every latestOffset would flood a fast trigger).
METRICS_LOG_INTERVAL = 10.0


class ZioStreamReaderOldApi(ZioStreamReader):
    """:class:`ZioStreamReader` for ``latestOffset()`` without arguments (see above)."""

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: Any = None
    ) -> dict[str, int]:
        if start is None:
            # Runner-side state, never pickled (ZioStreamReader.__getstate__).
            start = getattr(self, "_previous_end", None) or {}
        out = super().latestOffset(start, limit)
        self._previous_end = dict(out)
        if not compat.HAS_REPORT_LATEST_OFFSET:
            now = time.monotonic()
            if now >= getattr(self, "_metrics_due", 0.0):
                self._metrics_due = now + METRICS_LOG_INTERVAL
                log.info(
                    "zio source metrics (this Spark has no reportLatestOffset): %s",
                    json.dumps(self.reportLatestOffset(), sort_keys=True),
                )
        return out
