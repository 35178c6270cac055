"""A zio stream reader in a child process, run the way Spark's
``python_streaming_source_runner`` runs it: ``python runner_child.py MODE ENDPOINT SPOOL``
(a local spool in SPOOL; the caller puts the repository on ``PYTHONPATH``).

- ``receive`` (test_source_complete.py): once 500 records are spooled, print
  ``receiving`` and block on stdin, like the runner on its command socket.
- ``sigterm-in-lock`` (test_source_runner.py): raise SIGTERM while holding the spool's
  locks, as inside a commit or a seal; print ``handler returned`` if the main thread was not
  unwound, then ``stopped <spool closed>`` once the reader is stopped.
"""

from __future__ import annotations

import signal
import sys
import time

from zio_spark.options import parse_source_options
from zio_spark.spark.source import ZioStreamReader


def main(mode: str, endpoint: str, spool: str) -> None:
    if mode not in ("receive", "sigterm-in-lock"):
        raise SystemExit(f"runner_child: unknown mode {mode!r} (receive, sigterm-in-lock)")
    opts = parse_source_options({"endpoints": endpoint, "spoolPath": spool, "spoolAccess": "local"})
    reader = ZioStreamReader(opts, ("seq", "value"))
    try:  # what python_streaming_source_runner does around its command loop
        reader.initialOffset()
        rt = reader._rt
        if mode == "receive":
            while sum(rt.spool.backlog().values()) < 500:
                time.sleep(0.01)
            print("receiving", flush=True)
            sys.stdin.read()  # like the runner blocked on its command socket
        else:
            with rt.spool._lock, rt.spool._maint_lock:  # as inside a commit or a seal
                signal.raise_signal(signal.SIGTERM)
                print("handler returned", flush=True)
    finally:
        reader.stop()
        if mode == "sigterm-in-lock":
            print("stopped", rt.spool._closed, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
