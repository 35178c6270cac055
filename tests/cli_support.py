"""Helpers shared by the tests that run `zio-spark` commands in-process (``main(argv)``).

- :func:`free_endpoint` (from ``tests/support.py``): a ``tcp://127.0.0.1:<port>`` nobody
  listens on (yet).
- :class:`Run`: ``main(argv)`` in a thread; ``result()`` joins it with a deadline.
- :func:`last_json`: the command's JSON summary (its last stdout line) and its stderr.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.support import free_endpoint
from zio_spark.cli.main import main

__all__ = ["Run", "free_endpoint", "last_json"]

WAIT = 30.0


class Run:
    """``main(argv)`` in a thread; ``result()`` joins it with a deadline."""

    def __init__(self, argv: list[str]) -> None:
        self.rc: int | None = None
        self.thread = threading.Thread(target=self._run, args=(argv,), daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def _run(self, argv: list[str]) -> None:
        self.rc = main(argv)

    def result(self, timeout: float = WAIT) -> tuple[int, float]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"command still running after {timeout} s"
        assert self.rc is not None
        return self.rc, time.monotonic() - self.started


def last_json(capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    out, err = capsys.readouterr()
    return json.loads(out.strip().splitlines()[-1]), err
