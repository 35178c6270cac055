"""Suite-wide safety settings and the private network namespace fixture.

ZRE nodes broadcast UDP beacons. So that no test can ever broadcast on a real interface,
the defaults a :class:`~zio_spark.transport.zre_node.ZreNode` takes from the environment
are pinned to loopback here, at import time, before any test module is imported:
``127.255.255.255`` reaches every socket bound to ``0.0.0.0`` on this host and nothing
else. Child processes inherit these values.

Draft sockets: a test marked ``@pytest.mark.requires_draft`` needs a pyzmq built with the
draft API (CLIENT/SERVER). It is skipped without one, unless ``ZIO_REQUIRE_DRAFT=1``:
then it fails, so the CI pass meant to cover CLIENT/SERVER (on ``.venv-draft``) cannot
pass by silently skipping.

``ctx``: a zmq context per test, suite-wide (:func:`tests.support.tracked_context`): it
keeps every socket it made, and a socket left open or a context that will not terminate
fails the test. A folder or file needs no ``ctx`` fixture of its own.

``netns``: a factory of private network namespaces (``ip netns``), deleted at teardown.
Only ``lo`` is up inside, plus, on request, a veth pair whose *both* ends stay in the
namespace (for peers that insist on a non-loopback interface with a broadcast address,
like pyre). Needs root and iproute2; without them the test fails when ``CI=true`` and is
skipped otherwise. Nothing is installed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ["ZIO_ZRE_BROADCAST"] = "127.255.255.255"
os.environ["ZIO_ZRE_INTERFACE_ADDR"] = "127.0.0.1"
# The source's segment server listens on loopback only in tests (default: all interfaces).
os.environ["ZIO_SPOOL_SERVER_HOST"] = "127.0.0.1"


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    """With ``ZIO_TEST_CURRENT_FILE`` set (scripts/test.sh sets it), keep the id of the
    test now running in that file: if the process dies (a native crash dumps only thread
    stacks), the summary can name the test it died in."""
    path = os.environ.get("ZIO_TEST_CURRENT_FILE")
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(nodeid + "\n")
        except OSError:  # a diagnostic aid: never the reason a run fails
            pass


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("requires_draft") is None:
        return
    import zmq

    if zmq.has("draft") and zmq.DRAFT_API:
        return
    reason = (
        f"needs a draft-enabled pyzmq (zmq.has('draft')={zmq.has('draft')}, "
        f"zmq.DRAFT_API={zmq.DRAFT_API}); see scripts/build-draft-pyzmq.sh"
    )
    if os.environ.get("ZIO_REQUIRE_DRAFT") == "1":
        pytest.fail(f"ZIO_REQUIRE_DRAFT=1 but this test {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def ctx() -> Iterator[Any]:
    """A zmq context that must terminate at teardown; a socket left open fails the test.
    (Imported here, not above: the environment above is set before anything imports zmq.)"""
    from tests.support import tracked_context

    yield from tracked_context()


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``sc://`` URL of one Spark Connect server (pyspark's own, 127.0.0.1, a free
    port) for the whole run, stopped at its end: the Connect tests
    (tests/spark/test_connect.py) and the notebook's given session (tests/notebooks)
    share it, as clients of one server do; each starts its own session on it. A server
    start is a JVM start-up: ~10 s, far more on a busy machine."""
    from tests.cluster.spark_procs import start_connect_server

    server, url = start_connect_server(tmp_path_factory.mktemp("connect"))
    try:
        yield url
    finally:
        server.stop()


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but private network namespaces are unavailable: {reason}")
    pytest.skip(reason)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def netns() -> Iterator[Callable[..., str]]:
    """``make(veth_cidr=None) -> name``: a fresh namespace with ``lo`` up.

    With ``veth_cidr`` (e.g. ``"10.99.0.1/24"``) a veth pair ``v0``/``v1`` is created
    inside the namespace and ``v0`` gets that address; ``v1`` stays down and unnumbered.
    """
    if shutil.which("ip") is None:
        _unavailable("iproute2's `ip` is not installed (apt-get install iproute2)")
    if os.geteuid() != 0:
        _unavailable(f"`ip netns` needs root; running as uid {os.geteuid()}")
    made: list[str] = []

    def make(veth_cidr: str | None = None) -> str:
        name = f"zio-test-{secrets.token_hex(4)}"
        steps = [["netns", "add", name], ["-n", name, "link", "set", "lo", "up"]]
        if veth_cidr is not None:
            steps += [
                ["-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                ["-n", name, "addr", "add", veth_cidr, "dev", "v0"],
                ["-n", name, "link", "set", "v0", "up"],
            ]
        for i, step in enumerate(steps):
            result = _ip(*step)
            if i == 0 and result.returncode == 0:
                made.append(name)
            if result.returncode != 0:
                _unavailable(f"`ip {' '.join(step)}` failed: {result.stderr.strip()}")
        return name

    yield make
    for name in made:
        _ip("netns", "del", name)
