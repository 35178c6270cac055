"""Spark < 4.2 (latestOffset() with no arguments): a runner's first latestOffset
acknowledges the last batch an earlier runner planned, unless this runner planned one
first (Spark re-plans an uncommitted batch before asking). Call orders as seen on 4.0.5."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from zio_spark.spark import legacy
from zio_spark.spark.source import ZioStreamReader


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``runner()``: a new old-API reader on one spool folder (a new runner process);
    every start the base latestOffset got is in ``runner.starts``."""
    starts: list[dict[str, int]] = []

    def latest(self: Any, start: Any = None, limit: Any = None) -> dict[str, int]:
        starts.append(dict(start))
        return {"p": 99}

    monkeypatch.setattr(ZioStreamReader, "latestOffset", latest)
    monkeypatch.setattr(ZioStreamReader, "partitions", lambda self, s, e: [])
    monkeypatch.setattr(ZioStreamReader, "reportLatestOffset", lambda self: {})

    def make() -> Any:
        r = legacy.ZioStreamReaderOldApi.__new__(legacy.ZioStreamReaderOldApi)
        r.opts = SimpleNamespace(spool_path=str(tmp_path), read_mode="spool")
        return r

    make.starts = starts  # type: ignore[attr-defined]
    return make


def test_a_fresh_spool_acknowledges_nothing_first(runner: Any) -> None:
    runner().latestOffset()
    assert runner.starts == [{}]


def test_a_restart_acknowledges_the_last_planned_batch(runner: Any) -> None:
    first = runner()
    first.latestOffset()
    first.partitions({}, {"p": 10, "q": 3})
    # availableNow on 4.0/4.1: one batch, then the runner ends; commit({"p": 10}) never came.
    second = runner()
    second.partitions({"p": 10, "q": 3}, {"p": 10, "q": 3})  # Spark's look: not a batch
    second.latestOffset()
    assert runner.starts == [{}, {"p": 10, "q": 3}]


def test_a_batch_replanned_after_a_failure_is_acknowledged_once_asked_again(
    runner: Any,
) -> None:
    first = runner()
    first.latestOffset()
    first.partitions({"p": 10}, {"p": 20})  # planned; the query failed before its commit
    second = runner()
    second.partitions({"p": 20}, {"p": 20})
    second.partitions({"p": 10}, {"p": 20})  # re-planned: runs before any latestOffset
    second.latestOffset()
    assert runner.starts == [{}, {"p": 20}]


def test_an_unreadable_record_acknowledges_nothing_and_says_so(
    runner: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / legacy.PLANNED_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, "zio_spark.source"):
        runner().latestOffset()
    assert runner.starts == [{}]
    assert legacy.PLANNED_FILE in caplog.text and "unreadable" in caplog.text
