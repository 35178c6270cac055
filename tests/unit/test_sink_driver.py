"""The sink's driver side (:class:`zio_spark.sink.driver.SinkDriver`) with a stand-in for
the command sender: which endpoints get a commit or an abort, with what partitions and
socket mode, and what the driver remembers of each endpoint across batches. No socket,
no Spark session (the hooks' filter of Spark's messages is checked at the end)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from zio_spark.errors import TransportError
from zio_spark.options import parse_sink_options
from zio_spark.sink.client import CommandError
from zio_spark.sink.driver import SinkDriver

A = "tcp://127.0.0.1:5001"
B = "tcp://127.0.0.1:5002"


@dataclass(frozen=True)
class Report:
    endpoint: str
    partition: int
    attempt: int = 0
    rows: int = 0
    plain: bool = False
    query: str | None = None
    mode: str | None = None


class Sender:
    """Records each command; raises ``fail[endpoint]`` if set."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any, dict[str, Any]]] = []
        self.fail: dict[str, Exception] = {}

    def __call__(self, endpoint: str, command: str, stream: str, batch: Any, *args, **kw):
        if args:
            kw["partitions"] = args[0]
        self.sent.append((endpoint, command, batch, kw))
        if endpoint in self.fail:
            raise self.fail[endpoint]
        return {"result": "ok"}

    def to(self) -> list[tuple[str, str, Any]]:
        return [(e, c, b) for e, c, b, _ in self.sent]


def _driver() -> tuple[SinkDriver, Sender]:
    send = Sender()
    return SinkDriver(send=send), send


def _group_opts(**more: str):
    return parse_sink_options({"group": "sinks", "stream": "s", **more})


def test_commit_goes_to_each_consumer_named_with_its_partitions_sorted():
    d, send = _driver()
    reports = [
        Report(B, 1, rows=5, query="q1", mode="routerdealer"),
        Report(A, 2, rows=3),
        Report(A, 0, attempt=1, rows=0),  # empty: still listed, so A records the batch
    ]
    d.commit(_group_opts(), reports, 7)
    assert send.to() == [(A, "commit", 7), (B, "commit", 7)]
    assert send.sent[0][3]["partitions"] == [(0, 1, 0), (2, 0, 3)]
    assert send.sent[0][3]["query"] is None and send.sent[0][3]["mode"] is None
    assert send.sent[1][3]["query"] == "q1" and send.sent[1][3]["mode"] == "routerdealer"
    assert d.known(A) is False and d.known(B) is False


def test_the_socket_option_is_the_mode_when_no_report_names_one():
    d, send = _driver()
    d.commit(_group_opts(socket="clientserver"), [Report(A, 0, rows=1)], 1)
    assert send.sent[0][3]["mode"] == "clientserver"


def test_no_command_to_an_unknown_endpoint_or_a_plain_taker():
    d, send = _driver()
    opts = parse_sink_options({"endpoint": A, "stream": "s"})
    # Nothing known yet and every partition empty: no command (a plain taker would take
    # the command's BOT for a new flow), not even for the configured endpoint.
    d.commit(opts, [Report(A, 0), Report(A, 1)], 4)
    d.abort(opts, [], 4)
    assert send.sent == [] and d.known(A) is None
    # A flow said it is a plain taker: no command then, nor later with empty partitions.
    d.commit(opts, [Report(A, 0, rows=10, plain=True), Report(A, 1)], 5)
    d.abort(opts, [Report(A, 0, rows=10, plain=True)], 5)
    d.commit(opts, [Report(A, 0)], 6)
    d.abort(opts, [], 6)
    assert send.sent == [] and d.known(A) is True


def test_a_consumer_known_from_an_earlier_batch_records_an_all_empty_batch():
    d, send = _driver()
    opts = parse_sink_options({"endpoint": A, "stream": "s"})
    d.commit(opts, [Report(A, 0, rows=2)], 2)
    d.commit(opts, [Report(A, 0)], 3)  # all empty, but A is known to be a consumer
    d.commit(opts, [], 4)  # no reports at all: the configured endpoint still records it
    assert send.to() == [(A, "commit", 2), (A, "commit", 3), (A, "commit", 4)]
    assert send.sent[2][3]["partitions"] == []


def test_what_one_driver_learns_is_its_own():
    d, _ = _driver()
    d.commit(_group_opts(), [Report(A, 0, rows=1)], 1)
    other, other_send = _driver()
    other.commit(_group_opts(), [Report(A, 0)], 1)
    assert d.known(A) is False and other.known(A) is None and other_send.sent == []


def test_commit_errors_reach_spark():
    d, send = _driver()
    send.fail[A] = CommandError(A, "commit", "partition 0 is not staged")
    with pytest.raises(CommandError, match="not staged"):
        d.commit(_group_opts(), [Report(A, 0, rows=1)], 1)


def test_abort_reaches_known_consumers_among_reports_targets_and_endpoint_best_effort(caplog):
    d, send = _driver()
    d.commit(_group_opts(), [Report(A, 0, rows=1), Report(B, 1, rows=1)], 1)
    send.sent.clear()
    send.fail[A] = TransportError("no reply")
    # Failed tasks report nothing: the targets the writer resolved stand in for them.
    d.abort(_group_opts(), [], 2, targets=[(B, "routerdealer"), (A, None)])
    assert send.to() == [(A, "abort", 2), (B, "abort", 2)]
    assert send.sent[1][3]["mode"] == "routerdealer"
    assert "abort of batch 2 at " + A + " failed" in caplog.text  # logged, not raised
    # A plain taker among the targets gets no abort.
    send.sent.clear()
    d.commit(_group_opts(), [Report(B, 0, rows=1, plain=True)], 3)
    d.abort(_group_opts(), [], 3, targets=[(B, None)])
    assert send.sent == []


def test_abort_timeout_is_at_most_ten_seconds():
    d, send = _driver()
    opts = parse_sink_options({"endpoint": A, "stream": "s", "connectTimeout": "60s"})
    d.commit(opts, [Report(A, 0, rows=1)], 1)
    d.abort(opts, [], 2)
    assert send.sent[0][3]["timeout"] == 60.0
    assert send.sent[1][3]["timeout"] == 10.0


def test_targets_of_an_endpoint_sink_are_that_endpoint_with_the_socket_option():
    d, _ = _driver()
    opts = parse_sink_options({"endpoint": A, "socket": "routerdealer"})
    assert d.targets(opts) == ((A, "routerdealer"),)
    assert len(d.nodes) == 0  # no ZRE node for an endpoint sink


def test_the_hooks_pass_only_task_reports_to_the_driver():
    from zio_spark.spark.sink import ZioCommitMessage, _reports

    m = ZioCommitMessage(A, "s", 1, 0, 0, 3)
    assert _reports([None, m, None]) == [m]
