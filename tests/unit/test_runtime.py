"""The runner-side pieces of the zio source (:mod:`zio_spark.source.runtime`) that need
no Spark and no socket: a run's problems and notes, the failure check, the report."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from zio_spark.errors import DataLossError, StorageError, TransportError
from zio_spark.options import SourceOptions
from zio_spark.source.runtime import RunState, Runtime, _take_plain, check


def test_a_problem_raises_with_fail_on_data_loss() -> None:
    with pytest.raises(TransportError, match="giver x owes records"):
        RunState().problem("x", "giver x owes records", fail=True)


def test_a_problem_without_fail_on_data_loss_is_logged_once_per_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = RunState()
    with caplog.at_level(logging.INFO, "zio_spark.source"):
        for _ in range(3):
            state.problem("x", "giver x owes records", fail=False)
            state.problem("y", "giver y owes records", fail=False)
            state.warn("x", "giver x again")  # a problem of key x was said already
            state.once("x", "note %s", "x")
    texts = [r.getMessage() for r in caplog.records]
    assert texts == [
        "giver x owes records (failOnDataLoss=false: the run goes on without it)",
        "giver y owes records (failOnDataLoss=false: the run goes on without it)",
        "note x",
    ]


def test_a_warning_is_logged_once() -> None:
    state = RunState()
    got: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: got.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("zio_spark.source")
    log.addHandler(handler)
    try:
        state.warn("k", "no BOT from e")
        state.warn("k", "no BOT from e")
    finally:
        log.removeHandler(handler)
    assert got == ["no BOT from e (the first batch goes on without them)"]


def _rt(sealer: Any = None, fatal: Any = None, error: Any = None) -> Any:
    return SimpleNamespace(
        sealer=SimpleNamespace(error=sealer),
        receiver=SimpleNamespace(fatal=fatal, error=error),
    )


def test_check_raises_the_sealer_error_first_and_fatal_only_with_fail_on_data_loss() -> None:
    strict, lenient = SourceOptions(), SourceOptions(fail_on_data_loss=False)
    check(_rt(), strict)  # nothing failed
    seal, lost, broke = StorageError("seal"), DataLossError("lost"), TransportError("broke")
    with pytest.raises(StorageError):
        check(_rt(sealer=seal, fatal=lost, error=broke), strict)
    with pytest.raises(DataLossError):
        check(_rt(fatal=lost, error=broke), strict)
    with pytest.raises(TransportError):
        check(_rt(fatal=lost, error=broke), lenient)
    check(_rt(fatal=lost), lenient)


def test_the_report_names_backlog_holdups_and_segment_reads() -> None:
    rt = SimpleNamespace(
        spool=SimpleNamespace(backlog=lambda: {"a": 3, "b": 0}),
        receiver=SimpleNamespace(
            holdups=lambda: {"b": {"withheldMs": 40}, "c": {"withheldMs": 5, "blockedMs": 7}}
        ),
        server=SimpleNamespace(requests=2),
    )
    assert Runtime.report(rt) == {  # type: ignore[arg-type]
        "backlog": {"a": 3, "b": 0},
        "heldBackMs": {"a": 0, "b": 40, "c": 5},
        "producerBlockedMs": {"c": 7},
        "segmentRequests": 2,
    }
    rt.server = None
    rt.receiver.holdups = dict
    assert Runtime.report(rt) == {"backlog": {"a": 3, "b": 0}, "heldBackMs": {"a": 0, "b": 0}}  # type: ignore[arg-type]


def test_the_runtime_imports_without_pyspark() -> None:
    """The runner's side of the source needs no Spark: the hooks pass in what does."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['pyspark'] = None\nimport zio_spark.source.runtime\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_plain_records_beyond_max_records_are_named_with_their_range_and_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Should plain givers alone give more than ``maxRecords`` (the receiver credits
    them for at most that many, so only a giver sending more per DAT than asked can),
    the read keeps ``maxRecords`` of theirs, shared fairly, and a WARNING names each
    giver, the seq range it loses, what the plain givers gave and the fix."""
    status = [
        SimpleNamespace(producer="tcp://p", ack_capable=False),
        SimpleNamespace(producer="tcp://q", ack_capable=False),
        SimpleNamespace(producer="a", ack_capable=True),
    ]
    recv: Any = SimpleNamespace(status=lambda: status)
    spool: Any = SimpleNamespace(
        seal=lambda: {"a": 11, "tcp://p": 31, "tcp://q": 5}, committed=lambda: {}
    )
    with caplog.at_level(logging.WARNING, "zio_spark.source"):
        starts, ends = _take_plain(recv, spool, {"a": 1}, {"a": 1}, 20, 20)
    # "a" (ack-capable) took nothing; q gave 4 (all kept), p 30 of which 16 kept.
    assert ends == {"a": 1, "tcp://p": 17, "tcp://q": 5}
    assert starts == {"a": 1, "tcp://p": 1, "tcp://q": 1}
    (text,) = [r.getMessage() for r in caplog.records]
    assert "plain giver tcp://p gave 14 records beyond maxRecords 20 (seq 17 to 30)" in text
    assert "The plain givers alone gave 34 records" in text and "larger maxRecords" in text
