"""Interop between our ZreNode and the real Python ZRE peer, PyPI ``zeromq-pyre``.

pyre (0.3.4) cannot be told where to beacon: ``Pyre.set_interface`` is a no-op. Its
beacon scans the host's interfaces (``getifaddrs``), skips loopback and link-local
addresses, takes the first IPv4 interface with a netmask, binds its UDP socket to that
network's broadcast address and sends there; with no such interface it falls back to
multicast 225.25.25.25. Run unmodified on a real host it would broadcast on the LAN, so
here it only ever runs inside a private network namespace made by the test, with ``lo``
and a veth pair whose two ends are both inside it: ``v0`` has 10.99.0.1/24, so pyre
picks ``v0`` and broadcasts to 10.99.0.255, which never leaves the namespace. Our node
runs in the same namespace with ``broadcast=10.99.0.255`` and ``interface=10.99.0.1``
(the source address of those broadcasts, where pyre connects back).

Both sides run as child processes (tests/loopback/zre_netns_child.py) that print JSON
lines; the scenario is event-driven and bounded in time (see the child's docstring).
Needs root and iproute2 (fails under CI=true without them, skips otherwise) and pyre
installed; without pyre the test is skipped, or fails when ZIO_REQUIRE_PYRE=1.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from zio_spark.protocol.zre import DISCOVERY_PORT

pytestmark = pytest.mark.netns

CHILD = Path(__file__).with_name("zre_netns_child.py")
ROOT = Path(__file__).resolve().parents[2]
VETH_ADDR = "10.99.0.1"
VETH_CIDR = f"{VETH_ADDR}/24"
VETH_BROADCAST = "10.99.0.255"
CHILD_DEADLINE_S = 15.0
WAIT_S = 30.0


def pyre_version() -> str:
    """The installed zeromq-pyre version; skip (or fail) if it is absent or the wrong pyre."""
    spec = importlib.util.find_spec("pyre")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not any((Path(p) / "zbeacon.py").exists() for p in locations):
        reason = (
            "zeromq-pyre is not installed (`pip install zeromq-pyre`; PyPI `pyre` is an "
            "unrelated project)"
        )
        if os.environ.get("ZIO_REQUIRE_PYRE") == "1":
            pytest.fail(f"ZIO_REQUIRE_PYRE=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return importlib.metadata.version("zeromq-pyre")


def ns_ip(ns: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "-n", ns, *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout


def run_children(ns: str, argvs: dict[str, list[str]]) -> dict[str, list[dict[str, Any]]]:
    """Run the children together inside ``ns``; return each one's JSON lines."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {}
    for name, argv in argvs.items():
        cmd = ["ip", "netns", "exec", ns, sys.executable, str(CHILD)]
        cmd += ["--deadline", str(CHILD_DEADLINE_S), *argv]
        procs[name] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
    deadline = time.monotonic() + WAIT_S
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} child still running after {WAIT_S} s")
            lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
            assert proc.returncode == 0, (
                f"{name} child exited {proc.returncode}:\n{stdout}\n{stderr}"
            )
            assert lines and lines[-1]["ev"] == "done", f"{name} child:\n{stdout}\n{stderr}"
            out[name] = lines
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return out


def only(lines: list[dict[str, Any]], ev: str, **match: Any) -> dict[str, Any]:
    found = [x for x in lines if x["ev"] == ev and all(x.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one {ev} {match}, got {found} in {lines}"
    return found[0]


def test_zio_node_and_pyre_discover_join_whisper_shout(netns: Callable[..., str]) -> None:
    version = pyre_version()
    ns = netns(veth_cidr=VETH_CIDR)
    # Isolation before pyre runs: lo and the veth pair only, no route out.
    names = sorted(x.split(":")[1].strip() for x in ns_ip(ns, "-o", "link").splitlines())
    assert names == ["lo", "v0@v1", "v1@v0"]
    assert "default" not in ns_ip(ns, "-4", "route")
    port = str(DISCOVERY_PORT)  # the real port is safe inside the namespace

    out = run_children(
        ns, {"pyre": ["pyre", port], "zio": ["zio", VETH_BROADCAST, VETH_ADDR, port]}
    )
    pyre, zio = out["pyre"], out["zio"]
    pyre_id, zio_id = pyre[0]["uuid"], zio[0]["uuid"]
    assert pyre[0]["version"] == version

    # Our node saw pyre: ENTER (headers, endpoint), JOIN, two-frame WHISPER, SHOUT, LEAVE.
    enter = only(zio, "ENTER", peer=pyre_id)
    assert enter["name"] == "pyre-peer" and enter["headers"] == {"X-Pyre": "yes"}
    assert enter["endpoint"] == pyre[0]["endpoint"]
    assert enter["endpoint"].startswith(f"tcp://{VETH_ADDR}:")
    only(zio, "JOIN", peer=pyre_id, group="G")
    assert only(zio, "WHISPER", peer=pyre_id)["content"] == ["whisper-from-pyre", "part-2"]
    assert only(zio, "SHOUT", peer=pyre_id, group="G")["content"] == ["shout-from-pyre"]
    only(zio, "LEAVE", peer=pyre_id, group="G")
    assert only(zio, "shout-sent")["reached"] == 1
    # PING from us, PING-OK from pyre (pyre was quiet longer than our evasive_after).
    assert [x["ev"] for x in zio if x.get("peer") == pyre_id].count("EVASIVE") >= 1
    assert only(zio, "pong-seen")["stats"]["ping_oks_received"] >= 1
    only(zio, "EXIT", peer=pyre_id)

    # pyre saw us the same way.
    enter = only(pyre, "ENTER", peer=zio_id)
    assert enter["name"] == "zio-node" and enter["headers"] == {"X-Zio": "yes"}
    assert enter["endpoint"] == zio[0]["endpoint"]
    assert enter["endpoint"].startswith(f"tcp://{VETH_ADDR}:")
    only(pyre, "JOIN", peer=zio_id, group="G")
    only(pyre, "WHISPER", peer=zio_id, content=["whisper-from-zio", "part-2"])
    assert only(pyre, "SHOUT", peer=zio_id, group="G")["content"] == ["shout-from-zio"]
    only(pyre, "LEAVE", peer=zio_id, group="G")
    only(pyre, "WHISPER", peer=zio_id, content=["bye"])
    # pyre never dropped us: no sequence error, no expiry, on anything we sent.
    assert not [x for x in pyre if x["ev"] == "EXIT"]

    for lines in (pyre, zio):
        assert lines[-1]["ev"] == "done" and not lines[-1]["timeout"]
    stats = zio[-1]["stats"]
    assert stats["bad_beacons"] == stats["bad_messages"] == stats["internal_errors"] == 0
    assert stats["send_failures"] == 0
