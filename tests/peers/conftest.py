"""Fixtures for the tests of the ZIO reference stand-in (``tests/peers``).

Draft sockets: tests marked ``@pytest.mark.requires_draft`` follow the suite-wide rule in
``tests/conftest.py`` (skipped without the draft API, failed when ``ZIO_REQUIRE_DRAFT=1``).

- ``ctx``: a fresh ``zmq.Context`` per test that must terminate at teardown (a socket left
  open fails the test; it is closed first so the run does not hang).
- ``wire_mode``: ``"routerdealer"`` and ``"clientserver"`` (the latter needs draft).
- ``peers``: registers stand-in peers so they are closed at teardown, before ``ctx``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq


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
