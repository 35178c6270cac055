"""The stream reader on a Spark without admission control for Python sources (before
4.2: :data:`zio_spark.spark.compat.HAS_ADMISSION_CONTROL` false).

Such a Spark calls ``latestOffset()`` with no arguments. The reader needs ``start`` (the
end of the batch Spark has in its commit log) to acknowledge records to the producers:
``commit(end)`` lags a batch and never comes for the last one. Spark < 4.2 runs a batch
to the exact offset ``latestOffset()`` returned, one batch at a time, and asks again only
once that batch is in its commit log (or when it ran none, the offsets being unchanged).
So the previous answer *is* the next ``start``: this subclass passes it on.

A runner's first ``latestOffset()`` has no previous answer. The end of every batch Spark
plans (``partitions(start, end)`` with a non-empty range) is therefore kept in the spool
folder (:data:`PLANNED_FILE`, written atomically). On a restart Spark (checked on 4.0.5)
first calls ``partitions(e, e)`` with the end ``e`` of its last offset-log entry (an
empty range: not a batch), then re-plans that batch through ``partitions(start, e)`` if it
is not in its commit log, and only then asks ``latestOffset()``. So a first
``latestOffset()`` that no planned batch of this runner preceded means the last batch
planned before is in Spark's commit log: its end is the ``start`` acknowledged. Without
this, an availableNow run (one batch on these Sparks) whose last batch filled
``maxBacklog`` left that batch counted as backlog for ever (its ``commit`` never comes):
no credit, no new records, no batch, and every later run ended with 0 rows.

``readMode=direct`` keeps no such file: its start is known from Spark's own calls
(:class:`zio_spark.source.direct.ImpliedStart`): the previous answer, the end of every
``partitions(start, end)``, and a restarted query's first call ``partitions(e, e)``
naming the end of its offset log's last batch (seen on 4.0.5 and 4.1.4). The spool
folder is not the checkpoint's (a new checkpoint on the same stream meets an old file),
and a start that is not Spark's would ack records to the producers that no batch read.
Without any (a new checkpoint: ``latestOffset()`` comes before ``initialOffset()``) the
first batch plans from the initial offsets, which ``initialOffset()`` then answers.

Without ``reportLatestOffset`` (same Spark versions) the metrics it would report in the
query's progress are logged instead (logger ``zio_spark.source``, INFO), at most every
:data:`METRICS_LOG_INTERVAL` seconds.

Imported only by :meth:`ZioDataSource.streamReader
<zio_spark.spark.datasource.ZioDataSource.streamReader>` on such a Spark.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from pyspark.sql.datasource import InputPartition

from zio_spark.spark import compat
from zio_spark.spark.source import ZioStreamReader
from zio_spark.storage.files import atomic_write

__all__ = ["METRICS_LOG_INTERVAL", "PLANNED_FILE", "ZioStreamReaderOldApi"]

log = logging.getLogger("zio_spark.source")

# Seconds between two metrics lines (every latestOffset would flood a fast trigger).
METRICS_LOG_INTERVAL = 10.0

# In the spool folder: {"end": <the end offsets of the last batch Spark planned>}.
PLANNED_FILE = "planned.json"


def _offsets(raw: Any) -> dict[str, int]:
    return {str(p): int(v) for p, v in dict(raw).items()}


class ZioStreamReaderOldApi(ZioStreamReader):
    """:class:`ZioStreamReader` for ``latestOffset()`` without arguments (see above)."""

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        if self._direct:
            # The start is known from Spark's calls (direct.ImpliedStart), never from a
            # file: the spool folder is not the checkpoint's, and a start that is not
            # Spark's would ack records no batch read, or read records twice.
            out = self._direct_latest(self._implied.start(), limit)
            self._implied.answered(out)
            self._log_metrics()
            return out
        if start is None:
            # Runner-side state, never pickled (ZioStreamReader.__getstate__).
            start = getattr(self, "_previous_end", None)
            if start is None:
                # This runner's first question, and no batch planned before it: the
                # last batch planned by an earlier runner is in Spark's commit log.
                start = self._planned_end() or {}
        out = super().latestOffset(start, limit)
        self._previous_end = dict(out)
        self._log_metrics()
        return out

    def _log_metrics(self) -> None:
        if not compat.HAS_REPORT_LATEST_OFFSET:
            now = time.monotonic()
            if now >= getattr(self, "_metrics_due", 0.0):
                self._metrics_due = now + METRICS_LOG_INTERVAL
                log.info(
                    "zio source metrics (this Spark has no reportLatestOffset): %s",
                    json.dumps(self.reportLatestOffset(), sort_keys=True),
                )

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        if self._direct:
            out = super().partitions(start, end)
            # Also partitions(e, e): a restarted query's first call names the end of
            # its last offset-log batch, the start of its next latestOffset().
            self._implied.planned(start, end)
            return out
        out = super().partitions(start, end)
        begin, stop = _offsets(start), _offsets(end)
        if begin != stop:  # a batch; partitions(e, e) is Spark's look at its offset log
            atomic_write(
                self._planned_path(),
                json.dumps({"end": dict(sorted(stop.items()))}).encode(),
                sync=True,
            )
            # The next latestOffset() comes once this batch is in the commit log (also
            # when Spark re-planned it after a failure, with no latestOffset before).
            self._previous_end = stop
        return out

    def _planned_path(self) -> str:
        return os.path.join(self.opts.spool_path, PLANNED_FILE)

    def _planned_end(self) -> dict[str, int] | None:
        """The end of the last batch planned on this spool (:data:`PLANNED_FILE`), or
        None if there is none. An unreadable file is logged and ignored: acknowledging
        nothing keeps every record."""
        path = self._planned_path()
        try:
            with open(path, "rb") as f:
                return _offsets(json.loads(f.read())["end"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning(
                "zio source: %s is unreadable (%s); the last batch of the previous run is "
                "acknowledged only once Spark commits a batch in this one",
                path,
                e,
            )
            return None
