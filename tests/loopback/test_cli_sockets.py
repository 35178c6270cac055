"""`zio-spark produce` / `consume` with ``--socket``, against the reference stand-in.

They need a draft pyzmq for the CLIENT/SERVER peers (marked ``requires_draft``: they run
in the draft pass, ``.venv-draft/bin/python -m pytest tests/loopback``; the stock-pyzmq
side is in ``tests/cli/test_produce_delivery.py``). The commands run in a thread
(``main``); endpoints are 127.0.0.1 random ports; every wait has a deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.cli_support import Run, free_endpoint, last_json
from tests.peers.zio_reference import ReferenceClientGiver, ReferenceClientTaker, ReferenceServer

WAIT = 30.0


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.requires_draft
@pytest.mark.parametrize("flavor", ["cpp", "python"])
def test_consume_serves_a_reference_client_giver_over_clientserver(zctx, tmp_path, capsys, flavor):
    endpoint = free_endpoint()
    out = tmp_path / "out.jsonl"
    run = Run(
        [
            "consume",
            "--bind",
            endpoint,
            "--socket",
            "clientserver",
            "--out",
            str(out),
            "--count",
            "50",
            "--timeout",
            "20s",
            "--json",
        ]
    )
    values = [f"v{i}" for i in range(50)]
    with ReferenceClientGiver(
        zctx, endpoint, values, flavor=flavor, sockets="clientserver", credit=4
    ) as giver:
        assert giver.wait(WAIT), giver.errors
        assert giver.eot_echoes == 1
    rc, _ = run.result()
    assert rc == 0
    assert [line["value"] for line in lines(out)] == values
    s, err = last_json(capsys)
    assert s["records"] == 50 and s["socket"] == "clientserver" and s["flows"] == 1
    assert "(SERVER)" in err


@pytest.mark.requires_draft
def test_consume_on_the_wrong_socket_kind_says_so_after_the_timeout(zctx, tmp_path, capsys):
    """A CLIENT giver towards consume's default ROUTER: connected, never delivered."""
    endpoint = free_endpoint()
    out = tmp_path / "out.jsonl"
    run = Run(["consume", "--bind", endpoint, "--out", str(out), "--count", "5", "--timeout", "1s"])
    giver = ReferenceClientGiver(
        zctx, endpoint, ["a"] * 5, flavor="cpp", sockets="clientserver", deadline_s=2.0
    )
    try:
        rc, took = run.result()
    finally:
        giver.close()
    assert rc == 1 and took >= 1.0
    err = capsys.readouterr().err
    assert "published 0 of --count 5 records within --timeout 1 s (0 flows opened)" in err
    assert f"nothing answered at {endpoint}: this side is a ROUTER socket (routerdealer)" in err
    assert "if the peer has a CLIENT socket, use clientserver on this side" in err
    assert giver.reply is None  # the giver never got a BOT back either


@pytest.mark.requires_draft
def test_produce_connects_to_a_reference_server_over_clientserver(zctx, capsys):
    with ReferenceServer(zctx, role="taker", flavor="cpp", sockets="clientserver", credit=5) as ref:
        rc, _ = Run(
            [
                "produce",
                "--connect",
                ref.endpoint,
                "--socket",
                "clientserver",
                "--count",
                "200",
                "--size",
                "2",
                "--timeout",
                "20s",
                "--json",
            ]
        ).result()
        assert ref.received == [b"xx"] * 200 and ref.errors == []
    assert rc == 0
    s, _ = last_json(capsys)
    assert (s["delivered"], s["confirmed"], s["socket"]) == (200, 200, "clientserver")


@pytest.mark.requires_draft
def test_produce_binds_for_a_reference_client_taker_over_clientserver(zctx, capsys):
    endpoint = free_endpoint()
    run = Run(
        [
            "produce",
            "--bind",
            endpoint,
            "--socket",
            "clientserver",
            "--count",
            "120",
            "--timeout",
            "20s",
            "--json",
        ]
    )
    taker = ReferenceClientTaker(zctx, endpoint, flavor="cpp", sockets="clientserver", credit=3)
    try:
        rc, _ = run.result()
        assert taker.wait(WAIT), taker.errors
    finally:
        taker.close()
    assert rc == 0 and len(taker.received) == 120
    s, _ = last_json(capsys)
    assert (s["delivered"], s["confirmed"], s["acks"]) == (120, 120, False)


@pytest.mark.requires_draft
def test_produce_towards_a_server_socket_says_so_after_the_timeout(zctx, capsys):
    """Default routerdealer towards a reference SERVER: libzmq connects, then drops it."""
    with ReferenceServer(zctx, role="taker", flavor="cpp", sockets="clientserver") as ref:
        rc, took = Run(
            ["produce", "--connect", ref.endpoint, "--count", "3", "--timeout", "1s"]
        ).result()
        assert ref.bots == []
    assert rc == 1 and took >= 1.0
    err = capsys.readouterr().err
    assert "delivered 0 of 3 records within --timeout 1 s (queued 3, sent 0" in err
    assert "the server never answered our BOT; nothing answered at " + ref.endpoint in err
    assert "if the peer has a SERVER socket, use clientserver on this side" in err
