"""Sealing in the background, so a micro-batch does not wait for it.

A stream reader's ``latestOffset`` must return offsets of sealed (durable, immutable)
data, and sealing a large open tail takes time (reading the records back from the WAL,
writing a segment, two ``fsync``): measured ~0.8 us per 100-byte record, ~400 ms of each
~1 s micro-batch cycle when it all happened in ``latestOffset``. :class:`Sealer` seals
whenever the open tail holds ``rows`` records or ``nbytes`` WAL bytes, while Spark runs
the previous batch; ``latestOffset`` then seals only what arrived since.

Sealing earlier changes no offset's meaning (an offset still covers only sealed data)
and no commit (:meth:`~zio_spark.storage.spool.Spool.seal` and ``commit`` are serialized
by the spool). A seal that fails is kept in :attr:`Sealer.error` and ends the thread;
the reader raises it from its next Spark call.
"""

from __future__ import annotations

import logging
import threading

from zio_spark.storage.spool import Spool

__all__ = ["Sealer"]

log = logging.getLogger("zio_spark.source")


class Sealer:
    """Seal ``spool`` when its open tail reaches ``rows`` records or ``nbytes`` bytes."""

    def __init__(
        self, spool: Spool, *, rows: int = 65_536, nbytes: int = 16 << 20, every: float = 0.05
    ) -> None:
        self.spool = spool
        self.rows = rows
        self.nbytes = nbytes
        self.every = every
        self.seals = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zio-sealer", daemon=True)

    def start(self) -> Sealer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop and wait for a seal under way (the spool may be closed after this)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        # Polls two counters under the spool's lock every ``every`` seconds: cheap, and
        # the receiver thread needs no hook.
        while not self._stop.wait(self.every):
            rows, nbytes = self.spool.unsealed()
            if rows < self.rows and nbytes < self.nbytes:
                continue
            try:
                self.spool.seal()
                self.seals += 1
            except BaseException as e:  # handed to the Spark thread
                if self._stop.is_set():
                    return  # the spool closed under a last seal: stopping anyway
                log.error("zio source: background seal failed: %s", e)
                self.error = e
                return
