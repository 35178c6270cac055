"""Fixtures for the tests of the ZIO reference stand-in (``tests/peers``).

Draft sockets: tests marked ``@pytest.mark.requires_draft`` follow the suite-wide rule in
``tests/conftest.py`` (skipped without the draft API, failed when ``ZIO_REQUIRE_DRAFT=1``).

- ``ctx``: a fresh ``zmq.Context`` per test that must terminate at teardown (a socket left
  open fails the test; it is closed first so the run does not hang).
- ``wire_mode``: ``"routerdealer"`` and ``"clientserver"`` (the latter needs draft).
- ``peers``: registers stand-in peers so they are closed at teardown, before ``ctx``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

TERM_TIMEOUT_S = 5.0


class _TrackingContext(zmq.Context):  # type: ignore[type-arg]
    """Holds every socket it made so a leak is seen, not garbage-collected."""

    _made: list[zmq.Socket[Any]]

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        s = super().socket(*args, **kwargs)
        if not hasattr(self, "_made"):
            self._made = []
        self._made.append(s)
        return s

    def open_sockets(self) -> list[zmq.Socket[Any]]:
        return [s for s in getattr(self, "_made", []) if not s.closed]


@pytest.fixture
def ctx() -> Iterator[_TrackingContext]:
    context = _TrackingContext()
    yield context
    leaked = context.open_sockets()
    names = [repr(s) for s in leaked]
    for s in leaked:
        s.close(linger=0)
    done = threading.Event()

    def term() -> None:
        context.term()
        done.set()

    threading.Thread(target=term, name="zmq-ctx-term", daemon=True).start()
    if not done.wait(TERM_TIMEOUT_S):
        pytest.fail(f"zmq context did not terminate within {TERM_TIMEOUT_S} s", pytrace=False)
    if names:
        pytest.fail(f"test leaked {len(names)} zmq socket(s): {names}", pytrace=False)


@pytest.fixture(
    params=["routerdealer", pytest.param("clientserver", marks=pytest.mark.requires_draft)]
)
def wire_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class _Registry:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def __call__(self, obj: Any) -> Any:
        self.items.append(obj)
        return obj


@pytest.fixture
def peers(ctx: zmq.Context[Any]) -> Iterator[_Registry]:
    """``peers(obj)`` registers something with ``close()``; closed in reverse at teardown."""
    reg = _Registry()
    yield reg
    for obj in reversed(reg.items):
        obj.close()
