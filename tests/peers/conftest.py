"""Fixtures for the tests of the ZIO reference stand-in (``tests/peers``).

Draft sockets: same rule as ``tests/transport/conftest.py``: tests marked
``@pytest.mark.requires_draft`` are skipped when pyzmq has no draft API, unless
``ZIO_REQUIRE_DRAFT=1`` is set: then they fail.

- ``ctx``: a fresh ``zmq.Context`` per test that must terminate at teardown (a socket left
  open fails the test; it is closed first so the run does not hang).
- ``wire_mode``: ``"routerdealer"`` and ``"clientserver"`` (the latter needs draft).
- ``peers``: registers stand-in peers so they are closed at teardown, before ``ctx``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

HAVE_DRAFT = bool(zmq.has("draft") and getattr(zmq, "DRAFT_API", False))
TERM_TIMEOUT_S = 5.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires_draft: needs pyzmq with the draft API (CLIENT/SERVER); skipped without "
        "it, failed instead when ZIO_REQUIRE_DRAFT=1",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("requires_draft") is None or HAVE_DRAFT:
        return
    reason = (
        f"needs a draft-enabled pyzmq (zmq.has('draft')={zmq.has('draft')}, "
        f"zmq.DRAFT_API={getattr(zmq, 'DRAFT_API', None)}); see scripts/build-draft-pyzmq.sh"
    )
    if os.environ.get("ZIO_REQUIRE_DRAFT") == "1":
        pytest.fail(f"ZIO_REQUIRE_DRAFT=1 but this test {reason}", pytrace=False)
    pytest.skip(reason)


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
