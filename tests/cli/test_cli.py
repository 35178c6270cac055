"""The zio-spark command: exit codes, --json summaries, a real producer run."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading

import pytest
import zmq

from tests.cli_support import free_endpoint
from tests.support import wait_until
from zio_spark.cli.main import build_parser, main
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


COMMANDS = ("produce", "consume", "queue", "peers", "keys", "doctor", "demo", "bench")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's own parser (the queue has its own; the others are subparsers)."""
    from zio_spark.cli.queue import _parser as queue_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    found = {name: p for name, p in sub.choices.items() if name != "queue"}
    found["queue"] = queue_parser()
    assert set(found) == set(COMMANDS)
    return found


def test_help_everywhere():
    for cmd in ([], *([c] for c in COMMANDS)):
        r = run_cli(*cmd, "--help")
        assert r.returncode == 0, r.stderr
        assert "usage: zio-spark" in r.stdout
        if cmd:
            assert f"usage: zio-spark {cmd[0]}" in r.stdout


def test_every_help_shows_the_defaults():
    """Each option that has a default says it in its --help line (as the text it takes:
    durations as `60s`)."""
    for name, parser in parsers().items():
        text = parser.format_help()
        # argparse wraps help text: compare on whitespace-collapsed blocks per option
        blocks = re.split(r"\n  (?=-)", text)
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            block = next(b for b in blocks if b.startswith(action.option_strings[0]))
            assert "default" in " ".join(block.split()), (name, action.option_strings, block)
    produce = " ".join(parsers()["produce"].format_help().split())
    for shown in ("(default: 100000)", "(default: 60s)", "(default: auto)", "(default: zio)"):
        assert shown in produce
    assert "(default: 10000)" in " ".join(parsers()["queue"].format_help().split())  # --hwm
    assert "(default: 5s)" in " ".join(parsers()["peers"].format_help().split())


def test_every_command_takes_json_and_every_time_option_units():
    for name, parser in parsers().items():
        options = {o: a for a in parser._actions for o in a.option_strings}
        assert "--json" in options, name
        for option, action in options.items():
            if "timeout" in option or "grace" in option:
                assert getattr(action.type, "__name__", "") == "duration", (name, option)


def test_peers_timeout_takes_units(capsys):
    """`peers --timeout 1s` was refused; the ZRE beacons stay on loopback (conftest)."""
    assert main(["peers", "--group", "doctor-test", "--timeout", "300ms", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["command"] == "peers" and summary["group"] == "doctor-test"
    r = run_cli("peers", "--group", "g", "--timeout", "soon")
    assert r.returncode == 2 and "option '--timeout': got 'soon'" in r.stderr
    assert r.stderr.startswith("usage: zio-spark peers")


def test_an_unknown_option_gets_the_command_s_own_usage(tmp_path):
    r = run_cli("produce", "--cout", "5")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: zio-spark produce"), r.stderr
    assert "unrecognized arguments: --cout 5 (did you mean: --cout -> --count?)" in r.stderr
    r = run_cli("consume", "--bind", "tcp://127.0.0.1:1", "--out", "x", "--jsn")
    assert r.returncode == 2 and r.stderr.startswith("usage: zio-spark consume")
    assert "--jsn -> --json?" in r.stderr
    r = run_cli("queue", "--store", str(tmp_path / "q"), "--hwn", "5")
    assert r.returncode == 2 and r.stderr.startswith("usage: zio-spark queue")
    assert "unrecognized arguments: --hwn 5 (did you mean: --hwn -> --hwm?)" in r.stderr
    assert not (tmp_path / "q").exists()


def test_queue_json_prints_ready_then_stopped_with_its_counters(tmp_path):
    receive, send, monitor = free_endpoint(), free_endpoint(), free_endpoint()
    cmd = [sys.executable, "-m", "zio_spark.cli.main", "queue", "--store", str(tmp_path / "q")]
    cmd += ["--receive", receive, "--send", send, "--monitor", monitor, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())  # blocks until ready (or EOF on a failure)
        assert ready["command"] == "queue" and ready["event"] == "ready"
        assert (ready["receive"], ready["send"], ready["monitor"]) == (receive, send, monitor)
        assert ready["queue_id"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, err
    stopped = json.loads(out.strip().splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["queue_id"] == ready["queue_id"]
    assert stopped["stats"]["received"] == 0 and stopped["stats"]["stored"] == 0


def test_consume_with_no_flow_before_the_timeout_exits_1_naming_endpoint_and_timeout(
    tmp_path, capsys
):
    endpoint = free_endpoint()
    out = tmp_path / "out.jsonl"
    rc = main(["consume", "--bind", endpoint, "--out", str(out), "--timeout", "300ms", "--json"])
    assert rc == 1
    stdout, err = capsys.readouterr()
    assert f"no giver opened a flow at {endpoint} within --timeout 0.3 s" in err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert (summary["records"], summary["flows"]) == (0, 0)


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


def test_produce_serves_a_taker_and_reports(ctx, capsys):
    """`produce` runs in a thread here; a zio-spark taker receives and acks everything."""
    endpoint = free_endpoint()
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
    assert result["rc"] == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["queued"] == summary["sent"] == summary["acked"] == 3000
    assert summary["delivered"] == 3000 and summary["confirmed"] == 0
    assert summary["acks"] is True and summary["topology"] == "bind"


def test_consume_writes_published_batches_as_json_lines(ctx, tmp_path, capsys):
    """`consume` publishes a committed batch to JSONL, text values as text, binary as b64."""
    import pyarrow as pa

    from zio_spark.sink.client import StagingWriter, send_command

    endpoint = free_endpoint()
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
    assert not t.is_alive()
    assert result["rc"] == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [
        {"stream": "s", "batch": 7, "value": "hello", "key": "k", "headers": {"h": "v"}},
        {"stream": "s", "batch": 7, "value": "/wA=", "value_b64": True},
    ]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["records"] == 2


def test_consume_with_flows_but_nothing_published_exits_1(ctx, tmp_path, capsys):
    """A writer stages a batch and never commits: a flow came, nothing was published."""
    import pyarrow as pa

    from tests.cli_support import Run
    from zio_spark.sink.client import StagingWriter

    endpoint = free_endpoint()
    out = tmp_path / "out.jsonl"
    run = Run(["consume", "--bind", endpoint, "--out", str(out), "--timeout", "4s", "--json"])
    w = StagingWriter(endpoint, "s", 1, 0, 0, ctx=ctx, timeout=30)
    w.write_batch(
        pa.RecordBatch.from_pydict(
            {
                "value": pa.array([b"x"], pa.binary()),
                "key": pa.array([None], pa.binary()),
                "headers": pa.array([None], pa.map_(pa.string(), pa.string())),
            }
        )
    )
    assert w.close() == 1  # staged, never committed
    rc, _ = run.result()
    assert rc == 1
    stdout, err = capsys.readouterr()
    assert f"flows opened at {endpoint} but nothing was published within --timeout 4 s" in err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["records"] == 0 and summary["flows"] >= 1
    assert out.read_text() == ""


def test_produce_over_curve_admits_only_the_allowed_driver_and_its_run_key(ctx, tmp_path, capsys):
    """`produce --curve-secret @FILE --curve-allow @FILE`: the listed driver registers a
    run key on its control flow, reads a range with it and acks everything there."""
    import zmq

    from zio_spark.errors import TransportError
    from zio_spark.source.range_client import ControlConnection, read_range
    from zio_spark.transport.curve import client_curve

    server_public, server_secret = zmq.curve_keypair()
    driver_public, driver_secret = zmq.curve_keypair()
    run_public, run_secret = zmq.curve_keypair()
    (tmp_path / "secret").write_bytes(server_secret + b"\n")
    (tmp_path / "allowed").write_bytes(b"# the drivers\n" + driver_public + b"\n")
    endpoint = free_endpoint()
    result = {}
    argv = ["produce", "--bind", endpoint, "--count", "10", "--size", "4", "--producer-id"]
    argv += ["cli", "--curve-secret", f"@{tmp_path / 'secret'}"]
    argv += ["--curve-allow", f"@{tmp_path / 'allowed'}", "--timeout", "60", "--json"]
    t = threading.Thread(target=lambda: result.update(rc=main(argv)))
    t.start()
    try:
        stranger = zmq.curve_keypair()
        with pytest.raises(TransportError) as e:
            ControlConnection(
                endpoint,
                ctx=ctx,
                curve=client_curve(server_public, stranger[1], stranger[0]),
                timeout=30,
            )
        assert "allow-list" in str(e.value)
        control = ControlConnection(
            endpoint,
            ctx=ctx,
            curve=client_curve(server_public, driver_secret, driver_public),
            timeout=30,
        )
        try:
            w = wait_until(lambda: (lambda h: h if h.end == 11 else None)(control.held()), 30)
            assert control.admit(run_public) is True
            run = client_curve(server_public, run_secret, run_public)
            got = read_range(endpoint, "cli", w.incarnation, 1, 11, ctx=ctx, curve=run, timeout=30)
            assert sum(b.num_rows for b in got) == 10
            control.ack(10, w.incarnation)
            t.join(60)
        finally:
            control.close()
    finally:
        t.join(60)
    assert not t.is_alive()
    assert result["rc"] == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["acked"] == 10
    assert f"curve server key: {server_public.decode()} (1 allowed client keys)" in captured.err


def test_produce_curve_options_are_checked():
    assert main(["produce", "--curve-allow", "k" * 40]) == 2  # no --curve-secret
    r = run_cli("produce", "--curve-secret", "short", "--count", "1")
    assert r.returncode == 2 and "option '--curve-secret'" in r.stderr
    assert "short" not in r.stderr.replace("'--curve-secret'", "")  # a secret is not echoed
    good = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    r = run_cli("produce", "--curve-secret", good, "--curve-allow", "nope", "--count", "1")
    assert r.returncode == 2 and "option '--curve-allow': got 'nope'" in r.stderr
    r = run_cli("produce", "--connect", "tcp://127.0.0.1:1", "--curve-secret", good)
    assert r.returncode == 2 and "--bind" in r.stderr


def test_curve_allow_takes_keys_files_and_zauth_certificate_folders(tmp_path):
    """--curve-allow KEY, @FILE (one a line) and a folder of public certificates (zauth's
    CURVE location, as zmq.auth.create_certificates / czmq's zcert write them)."""
    import zmq
    import zmq.auth

    from zio_spark.cli.produce import curve_options
    from zio_spark.errors import ConfigError

    certs = tmp_path / "certs"
    certs.mkdir()
    cert_public, _ = zmq.auth.load_certificate(zmq.auth.create_certificates(certs, "driver")[0])
    listed, _ = zmq.curve_keypair()
    (tmp_path / "keys").write_bytes(b"# takers\n\n" + listed + b"\n")
    bare, _ = zmq.curve_keypair()
    _, secret = zmq.curve_keypair()

    def options(*allow: str) -> dict:
        args = argparse.Namespace(connect=None, curve_secret=secret.decode(), curve_allow=allow)
        return curve_options(args)

    got = options(bare.decode(), f"@{tmp_path / 'keys'}", str(certs))
    assert got["curve_secret_key"] == secret
    assert got["curve_allowed_client_keys"] == [bare, listed, cert_public]
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, why in ((str(empty), "public certificates"), ("@/nonexistent/keys", "readable")):
        with pytest.raises(ConfigError) as e:
            options(bad)
        assert e.value.option == "--curve-allow" and why in e.value.expected
    assert options() == {"curve_secret_key": secret}


# -- watching range readers' connections: produce's and the queue's flags ------------------


def _produce_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["produce", *flags])


def test_produce_watch_flags_reach_the_producer_in_seconds(ctx):
    from zio_spark.cli.produce import watch_options
    from zio_spark.source.producer import Producer

    assert watch_options(_produce_args()) == {}  # the Producer's own defaults
    got = watch_options(
        _produce_args(
            "--heartbeat-interval", "500ms", "--heartbeat-timeout", "3s", "--conn-check", "100ms"
        )
    )
    assert got == {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0, "conn_check": 0.1}
    # A timeout alone keeps the default interval (5s); 0 turns heartbeats off.
    assert watch_options(_produce_args("--heartbeat-timeout", "1m")) == {
        "heartbeat_interval": 5.0,
        "heartbeat_timeout": 60.0,
    }
    off = watch_options(_produce_args("--heartbeat-interval", "0"))
    assert off == {"heartbeat_interval": None, "heartbeat_timeout": None}
    p = Producer("tcp://127.0.0.1:*", ctx=ctx, linger_ms=0, **got)
    try:
        socket = p._server.port.socket
        assert (socket.getsockopt(zmq.HEARTBEAT_IVL), socket.getsockopt(zmq.HEARTBEAT_TIMEOUT)) == (
            500,
            3000,
        )
        assert p._server.conn_check == 0.1
    finally:
        p.close(flush=False, timeout=5)


@pytest.mark.parametrize(
    ("flags", "option", "expected"),
    [
        (("--heartbeat-interval", "10s", "--heartbeat-timeout", "5s"), "--heartbeat-timeout",
         ">= --heartbeat-interval (10.0) and <= 86400"),
        (("--heartbeat-interval", "1m"), "--heartbeat-timeout", ">= --heartbeat-interval (60s)"),
        (("--heartbeat-interval", "0", "--heartbeat-timeout", "5s"), "--heartbeat-timeout",
         "--heartbeat-interval 0 turns heartbeats off"),
        (("--connect", "tcp://127.0.0.1:1", "--conn-check", "1s"), "--conn-check", "--bind"),
        (("--connect", "tcp://127.0.0.1:1", "--heartbeat-interval", "1s"), "--heartbeat-interval",
         "--bind"),
    ],
)  # fmt: skip
def test_produce_watch_flags_that_do_not_fit_are_refused_naming_the_flag(
    flags, option, expected, capsys
):
    from zio_spark.cli.produce import watch_options
    from zio_spark.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        watch_options(_produce_args(*flags))
    assert e.value.option == option and expected in str(e.value), str(e.value)
    assert main(["produce", *flags]) == 2  # before any port is bound
    assert f"option '{option}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ("--conn-check", "0"),
        ("--conn-check", "2h"),
        ("--heartbeat-interval", "soon"),
        ("--heartbeat-interval", "2h"),
        ("--heartbeat-timeout", "0"),
    ],
)
def test_produce_watch_durations_out_of_range_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        _produce_args(*flags)
    assert e.value.code == 2
    assert f"option '{flags[0]}': got '{flags[1]}'" in capsys.readouterr().err


def test_queue_flow_watch_flags_reach_the_options(tmp_path, capsys):
    from zio_spark.cli.queue import _parser, queue_options, run_queue

    def options(*flags: str):
        return queue_options(_parser().parse_args(["--store", str(tmp_path / "q"), *flags]))

    o = options()
    assert (o.flow_heartbeat_interval, o.flow_heartbeat_timeout, o.flow_conn_check) == (
        5.0,
        30.0,
        0.5,
    )
    o = options(
        "--flow-heartbeat-interval", "200ms", "--flow-heartbeat-timeout", "2s",
        "--flow-conn-check", "50ms",
    )  # fmt: skip
    assert (o.flow_heartbeat_interval, o.flow_heartbeat_timeout, o.flow_conn_check) == (
        0.2,
        2.0,
        0.05,
    )
    o = options("--flow-heartbeat-interval", "0")
    assert (o.flow_heartbeat_interval, o.flow_heartbeat_timeout) == (None, None)
    for flags, option in (
        (("--flow-heartbeat-interval", "1m"), "--flow-heartbeat-timeout"),
        (("--flow-heartbeat-interval", "0", "--flow-heartbeat-timeout", "1s"),
         "--flow-heartbeat-timeout"),
        (("--flow-heartbeat-interval", "3s", "--flow-heartbeat-timeout", "1s"),
         "--flow-heartbeat-timeout"),
    ):  # fmt: skip
        argv = ["--store", str(tmp_path / "q"), *flags]
        assert run_queue(argv) == 2, flags
        assert f"option '{option}'" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()  # refused before the store was made
    with pytest.raises(SystemExit):
        _parser().parse_args(["--store", "q", "--flow-conn-check", "0"])
    assert "option '--flow-conn-check': got '0'" in capsys.readouterr().err
