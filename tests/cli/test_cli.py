"""The zio-spark command: exit codes, --json summaries, a real producer run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import zmq

from zio_spark.cli.main import main
from zio_spark.codec.records import decode_batch
from zio_spark.protocol.flow import Direction, Role
from zio_spark.transport.flow_endpoint import FlowEndpoint
from zio_spark.transport.port import ClientPort


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zio_spark.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_everywhere():
    for cmd in ([], ["produce"], ["consume"], ["queue"], ["peers"], ["keys"], ["demo"], ["bench"]):
        r = run_cli(*cmd, "--help")
        assert r.returncode == 0, r.stderr
        assert "usage: zio-spark" in r.stdout


def test_keys_json():
    r = run_cli("keys", "--json")
    assert r.returncode == 0
    keys = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(keys["public"]) == 40 and len(keys["secret"]) == 40


def test_bad_usage_exits_2():
    r = run_cli("produce", "--count", "zero")
    assert r.returncode == 2
    assert "expected an integer >= 1" in r.stderr
    r = run_cli("produce", "--bind", "tcp://127.0.0.1:1", "--connect", "tcp://127.0.0.1:1")
    assert r.returncode == 2
    assert "argument --connect: not allowed with argument --bind" in r.stderr
    r = run_cli("produce", "--timeout", "5 parsecs")
    assert r.returncode == 2
    assert "option '--timeout': got '5 parsecs', expected a duration such as" in r.stderr
    r = run_cli("consume", "--bind", "tcp://127.0.0.1:1", "--out", "x", "--timeout=0s")
    assert r.returncode == 2 and "option '--timeout'" in r.stderr
    assert main(["produce", "--connect", "tcp://127.0.0.1:1", "--group", "g"]) == 2


def test_produce_serves_a_taker_and_reports(capsys):
    """`produce` runs in a thread here; a zio-spark taker receives and acks everything."""
    with zmq.Context() as probe:
        s = probe.socket(zmq.ROUTER)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.close(0)
    endpoint = f"tcp://127.0.0.1:{port}"
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            rc=main(
                [
                    "produce",
                    "--bind",
                    endpoint,
                    "--count",
                    "3000",
                    "--size",
                    "10",
                    "--producer-id",
                    "cli",
                    "--wait-ack",
                    "--timeout",
                    "60",
                    "--json",
                ]
            )
        )
    )
    t.start()
    ctx = zmq.Context()
    port_ = ClientPort(ctx, linger_ms=0)
    port_.connect(endpoint)
    fe = FlowEndpoint(port_, Role.CLIENT)
    bot = fe.connect(Direction.INJECT, 8, {"ack": True, "resume": 0, "encoding": ["arrow"]})
    assert bot.attrs["producer"] == "cli"
    last = 0
    while last < 3000:
        if fe.flow.credit:
            fe.pay(None, {"ack": last})
        data = fe.get(timeout=30, auto_pay=False)
        assert data is not None
        last = decode_batch(data.message.payload[0]).column("seq")[-1].as_py()
    fe.pay(fe.flow.credit, {"ack": last})  # an ack-only PAY if no credit is held
    assert fe.get(timeout=30, auto_pay=False) is None  # everything acked: the EOT comes
    fe.send_eot(timeout=30)
    t.join(60)
    assert not t.is_alive()
    port_.close()
    ctx.term()
    assert result["rc"] == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["queued"] == summary["sent"] == summary["acked"] == 3000
    assert summary["delivered"] == 3000 and summary["confirmed"] == 0
    assert summary["acks"] is True and summary["topology"] == "bind"


def test_consume_writes_published_batches_as_json_lines(tmp_path, capsys):
    """`consume` publishes a committed batch to JSONL, text values as text, binary as b64."""
    import pyarrow as pa

    from zio_spark.sink.client import StagingWriter, send_command

    with zmq.Context() as probe:
        s = probe.socket(zmq.ROUTER)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.close(0)
    endpoint = f"tcp://127.0.0.1:{port}"
    out = tmp_path / "out.jsonl"
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            rc=main(
                [
                    "consume",
                    "--bind",
                    endpoint,
                    "--out",
                    str(out),
                    "--count",
                    "2",
                    "--timeout",
                    "60",
                    "--json",
                ]
            )
        )
    )
    t.start()
    ctx = zmq.Context()
    batch = pa.RecordBatch.from_pydict(
        {
            "value": pa.array([b"hello", b"\xff\x00"], pa.binary()),
            "key": pa.array([b"k", None], pa.binary()),
            "headers": pa.array([[("h", "v")], None], pa.map_(pa.string(), pa.string())),
        }
    )
    w = StagingWriter(endpoint, "s", 7, 0, 0, ctx=ctx, timeout=30)
    w.write_batch(batch)
    assert w.close() == 2
    send_command(endpoint, "commit", "s", 7, [(0, 0, 2)], ctx=ctx, timeout=30)
    t.join(60)
    ctx.term()
    assert result["rc"] == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [
        {"stream": "s", "batch": 7, "value": "hello", "key": "k", "headers": {"h": "v"}},
        {"stream": "s", "batch": 7, "value": "/wA=", "value_b64": True},
    ]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["records"] == 2
