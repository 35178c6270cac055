"""The sink consumer's folder (zio_spark.storage.sink_folder), without sockets.

Commits and aborts return typed outcomes or raise CommitRefused; the crash repairs run
on folders left as a crash would leave them; committed.log is CRC-framed, and a JSON
lines log of an earlier version is still read. Property tests: the committed ids
against a set, and the log's tail rule against every cut of a written log.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zio_spark.codec.schema import SINK_SCHEMA
from zio_spark.errors import LocalProtocolError, StorageError, ZioSparkError
from zio_spark.protocol.sink import BatchId
from zio_spark.storage import sink_folder as sink_folder_mod
from zio_spark.storage.files import frame
from zio_spark.storage.sink_folder import (
    LOG_MAGIC,
    Aborted,
    AlreadyCommitted,
    CommitRefused,
    Committed,
    CommittedIds,
    CommittedLog,
    ConsumerStateError,
    SinkFolder,
)

HEADERS = SINK_SCHEMA.field("headers").type


def _batch(values: list[bytes]) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_arrays(
        [pa.array(values, pa.binary()), pa.nulls(n, pa.binary()), pa.nulls(n, HEADERS)],
        schema=SINK_SCHEMA,
    )


@pytest.fixture
def open_folder(tmp_path: Path) -> Iterator[Any]:
    opened: list[SinkFolder] = []

    def make(path: Path | None = None, **kw: Any) -> SinkFolder:
        kw.setdefault("fsync", False)
        f = SinkFolder(path or tmp_path / "sink", **kw)
        opened.append(f)
        return f

    yield make
    for f in opened:
        f.close()


def _stage(folder: SinkFolder, batch: BatchId, partition: int, values: list[bytes]) -> None:
    stage = folder.new_stage("s", batch, partition, 0)
    stage.write(_batch(values))
    assert stage.finish() == len(values)


def _values(folder: SinkFolder, batch: BatchId) -> list[bytes | None]:
    return [r.value for r in folder.records("s", batch)]


def _reopen(folder: SinkFolder, open_folder: Any) -> SinkFolder:
    folder.close()
    return open_folder(folder.root)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- outcomes


def test_commit_publishes_once_and_says_so(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 0, 0, [b"a", b"b"])
    _stage(f, 0, 1, [b"c"])
    got = f.commit("s", 0, [(0, 0, 2), (1, 0, 1)], None)
    assert got == Committed("s", 0, rows=3, seq=1) and got.published
    assert f.published() == [("s", 0)] and f.rows("s", 0) == 3
    assert _values(f, 0) == [b"a", b"b", b"c"]
    assert not f.staging_dir("s", 0).exists()
    # Again (a re-delivered batch): nothing published a second time.
    _stage(f, 0, 0, [b"a", b"b"])
    assert f.commit("s", 0, [(0, 0, 2)], None) == AlreadyCommitted("s", 0)
    assert f.published() == [("s", 0)] and not f.staging_dir("s", 0).exists()


def test_an_empty_batch_records_its_id_and_publishes_nothing(open_folder: Any) -> None:
    f = open_folder()
    got = f.commit("s", 4, [(0, 0, 0)], None)
    assert got == Committed("s", 4, rows=0, seq=None) and not got.published
    assert f.is_committed("s", 4) and f.published() == []


def test_commit_refusals_name_the_partition_and_change_nothing(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 3, 0, [b"x", b"y"])
    with pytest.raises(CommitRefused, match=r"partition 1 attempt 0 of batch 3.*not staged") as e:
        f.commit("s", 3, [(0, 0, 2), (1, 0, 5)], None)
    assert isinstance(e.value, ZioSparkError)
    assert (e.value.stream, e.value.batch) == ("s", 3)
    assert str(e.value) == e.value.reason
    with pytest.raises(CommitRefused, match="has 2 staged rows, the commit says 9"):
        f.commit("s", 3, [(0, 0, 9)], None)
    assert not f.is_committed("s", 3)
    assert f.commit("s", 3, [(0, 0, 2)], None).published  # the staging was left alone


def test_a_batch_id_of_another_query_is_refused(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 0, 0, [b"a"])
    assert f.commit("s", 0, [(0, 0, 1)], "q1").published
    assert f.commit("s", 0, [(0, 0, 1)], "q1") == AlreadyCommitted("s", 0)
    with pytest.raises(
        CommitRefused, match=r"already committed by another query \(q1; this is q2\)"
    ):
        f.commit("s", 0, [(0, 0, 1)], "q2")
    assert f.commit("s", "write-1", [], "q2") == Committed("s", "write-1", 0, None)


def test_abort_discards_staging_unless_committed(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 5, 0, [b"a"])
    assert f.abort("s", 5) == Aborted("s", 5, discarded=True)
    assert not f.staging_dir("s", 5).exists()
    assert f.abort("s", 5) == Aborted("s", 5, discarded=True)  # idempotent
    with pytest.raises(CommitRefused, match="not staged"):
        f.commit("s", 5, [(0, 0, 1)], None)
    _stage(f, 6, 0, [b"b"])
    f.commit("s", 6, [(0, 0, 1)], None)
    assert f.abort("s", 6) == Aborted("s", 6, discarded=False)
    assert _values(f, 6) == [b"b"]


def test_ack_deletes_the_data_and_keeps_the_id(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 0, 0, [b"a"])
    f.commit("s", 0, [(0, 0, 1)], None)
    f.ack("s", 0)
    f.ack("s", 0)  # idempotent
    assert f.published() == [] and f.is_committed("s", 0)
    with pytest.raises(LocalProtocolError, match="not published"):
        f.rows("s", 0)
    with pytest.raises(LocalProtocolError, match="never committed"):
        f.ack("s", 1)


def test_commit_of_int_batch_drops_older_staging(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 1, 0, [b"old"])
    _stage(f, 3, 0, [b"newer"])
    f.commit("s", 2, [], None)
    assert not f.staging_dir("s", 1).exists() and f.staging_dir("s", 3).exists()


def test_a_failing_fault_hook_before_publish_leaves_nothing_committed(open_folder: Any) -> None:
    def hook(point: str, stream: str, batch: BatchId) -> None:
        raise OSError(f"injected at {point}")

    f = open_folder(fault_hook=hook)
    _stage(f, 0, 0, [b"a"])
    with pytest.raises(OSError, match="before_publish"):
        f.commit("s", 0, [(0, 0, 1)], None)
    assert not f.is_committed("s", 0)
    f.fault_hook = None
    assert f.commit("s", 0, [(0, 0, 1)], None).published


def test_one_process_per_folder(open_folder: Any) -> None:
    f = open_folder()
    with pytest.raises(ConsumerStateError, match="in use") as e:
        open_folder(f.root)
    assert isinstance(e.value, StorageError)


# ------------------------------------------------------------------ crash repairs


def test_restart_keeps_ids_published_data_and_staged_partitions(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, 0, 0, [b"a"])
    _stage(f, 1, 0, [b"b"])
    _stage(f, 2, 0, [b"staged, not committed"])
    f.commit("s", 0, [(0, 0, 1)], None)
    f.commit("s", 1, [(0, 0, 1)], None)
    f.ack("s", 0)
    f2 = _reopen(f, open_folder)
    assert f2.published() == [("s", 1)] and _values(f2, 1) == [b"b"]
    assert f2.is_committed("s", 0) and f2.is_committed("s", 1)
    assert f2.commit("s", 2, [(0, 0, 1)], None) == Committed("s", 2, 1, 3)


def test_crash_repairs_are_deterministic(open_folder: Any) -> None:
    f = open_folder()
    for b, v in ((0, b"a"), (1, b"b"), (2, b"c")):
        _stage(f, b, 0, [v])
    f.commit("s", 0, [(0, 0, 1)], None)
    f.commit("s", 1, [(0, 0, 1)], None)
    f.close()
    root = f.root
    log_path = root / "committed.log"
    # Crash after batch 1's rename, before its log record was whole.
    log_path.write_bytes(log_path.read_bytes()[:-10])
    # Crash in the middle of publishing batch 2 (before the rename).
    tmp_dir = root / "published" / "s" / f"{3:020d}-{2:020d}.tmp"
    tmp_dir.mkdir()
    (tmp_dir / "part-00000.arrow").write_bytes(b"half")
    # A flow that was writing when the process died; an acked batch being deleted.
    part = root / "staging" / "s" / f"{2:020d}" / "1-0.part"
    part.write_bytes(b"partial")
    (root / "trash" / "x").mkdir()
    f2 = open_folder(root)
    assert not tmp_dir.exists() and not part.exists() and not any((root / "trash").iterdir())
    assert f2.published() == [("s", 0), ("s", 1)]  # batch 1 rolled forward
    assert f2.is_committed("s", 1) and not f2.is_committed("s", 2)
    assert [e["batch"] for e in CommittedLog.read(log_path)] == [0, 1]
    # Batch 2's staged partition survived; its commit now succeeds, after batch 1's seq.
    assert f2.commit("s", 2, [(0, 0, 1)], None) == Committed("s", 2, 1, 3)
    assert _values(f2, 2) == [b"c"]


def test_staging_of_committed_batches_goes_on_open(open_folder: Any) -> None:
    f = open_folder()
    _stage(f, "w-1", 0, [b"a"])
    f.commit("s", "w-1", [(0, 0, 1)], None)
    f.close()
    left = f.staging_dir("s", "w-1")  # as if the process died before dropping it
    left.mkdir(parents=True)
    (left / "0-1.arrow").write_bytes(b"stale")
    open_folder(f.root)
    assert not left.exists()


def test_a_published_folder_that_is_no_batch_is_refused(open_folder: Any) -> None:
    f = open_folder()
    f.close()
    (f.root / "published" / "s").mkdir(parents=True)
    (f.root / "published" / "s" / "junk").mkdir()
    with pytest.raises(ConsumerStateError, match="is not a consumer batch"):
        open_folder(f.root)


@pytest.mark.parametrize("manifest", ["{}", "[1]", '{"rows": "3"}', '{"rows": -1}', "{bad"])
def test_a_published_batch_with_a_bad_manifest_is_refused(open_folder: Any, manifest: str) -> None:
    f = open_folder()
    _stage(f, 0, 0, [b"a"])
    f.commit("s", 0, [(0, 0, 1)], None)
    f.close()
    (f.root / "published" / "s" / f"{1:020d}-{0:020d}" / "_MANIFEST.json").write_text(manifest)
    with pytest.raises(ConsumerStateError, match="is not a consumer batch"):
        open_folder(f.root)


def test_compaction_folds_the_log_into_a_snapshot(
    open_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sink_folder_mod, "COMPACT_EVERY", 5)
    f = open_folder()
    for b in [*range(12), 20, 21]:
        f.commit("s", b, [], None)
    snap = json.loads((f.root / "committed.json").read_text())
    assert snap["streams"]["s"]["ranges"] == [[0, 9]]
    assert [e["batch"] for e in CommittedLog.read(f.root / "committed.log")] == [10, 11, 20, 21]
    f2 = _reopen(f, open_folder)
    assert all(f2.is_committed("s", b) for b in [*range(12), 20, 21])
    assert not f2.is_committed("s", 12) and not f2.is_committed("s", 19)


def test_a_corrupt_snapshot_is_refused(open_folder: Any) -> None:
    f = open_folder()
    f.close()
    (f.root / "committed.json").write_text("{not json")
    with pytest.raises(ConsumerStateError, match=r"committed\.json is corrupt"):
        open_folder(f.root)


# --------------------------------------------------------------------- the log


def _entry(batch: BatchId, seq: int | None = None) -> dict[str, Any]:
    return {"seq": seq, "stream": "s", "batch": batch, "rows": 0, "query": None}


def _framed(entries: list[dict[str, Any]]) -> bytes:
    out = [LOG_MAGIC]
    for e in entries:
        payload = b"J" + json.dumps(e).encode()
        out += [frame(payload), payload]
    return b"".join(out)


def test_a_new_log_starts_with_the_magic(tmp_path: Path) -> None:
    log, entries = CommittedLog.open(tmp_path / "committed.log", fsync=False)
    log.append([_entry(0), _entry("w")])
    log.close()
    assert entries == []
    assert (tmp_path / "committed.log").read_bytes() == _framed([_entry(0), _entry("w")])


def test_a_json_lines_log_of_an_earlier_version_is_read_and_rewritten(
    open_folder: Any, tmp_path: Path
) -> None:
    root = tmp_path / "old"
    root.mkdir()
    lines = [_entry(0), _entry(1, seq=7), {**_entry(3), "stream": "t"}]
    (root / "committed.log").write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in lines))
    f = open_folder(root)
    assert f.is_committed("s", 0) and f.is_committed("s", 1) and f.is_committed("t", 3)
    assert (root / "committed.log").read_bytes().startswith(LOG_MAGIC)
    assert CommittedLog.read(root / "committed.log") == lines
    assert f.commit("s", 2, [], None) == Committed("s", 2, 0, None)
    _stage(f, 4, 0, [b"z"])
    assert f.commit("s", 4, [(0, 0, 1)], None).seq == 8  # after the old log's seq 7
    f2 = _reopen(f, open_folder)
    assert all(f2.is_committed("s", b) for b in (0, 1, 2, 4))


def test_a_json_lines_log_with_a_torn_last_line_loses_only_that_line(
    open_folder: Any, tmp_path: Path
) -> None:
    root = tmp_path / "old"
    root.mkdir()
    good = json.dumps(_entry(0)).encode() + b"\n"
    (root / "committed.log").write_bytes(good + json.dumps(_entry(1)).encode()[:12])
    f = open_folder(root)
    assert f.is_committed("s", 0) and not f.is_committed("s", 1)
    assert CommittedLog.read(root / "committed.log") == [_entry(0)]


def test_a_json_lines_log_corrupt_before_its_end_is_refused(
    open_folder: Any, tmp_path: Path
) -> None:
    root = tmp_path / "old"
    root.mkdir()
    good = json.dumps(_entry(0)).encode()
    (root / "committed.log").write_bytes(b"garbage\n" + good + b"\n")
    with pytest.raises(ConsumerStateError, match="line 1 is corrupt"):
        open_folder(root)
    (root / "committed.log").write_bytes(b'{"stream": 3, "batch": 0}\n' + good + b"\n")
    with pytest.raises(ConsumerStateError, match="line 1 is corrupt: stream must be a string"):
        open_folder(root)


def test_a_corrupt_record_before_the_end_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "committed.log"
    data = bytearray(_framed([_entry(0), _entry(1), _entry(2)]))
    data[len(LOG_MAGIC) + 12] ^= 0xFF  # a payload byte of the first record
    path.write_bytes(bytes(data))
    with pytest.raises(ConsumerStateError, match=r"record 1 at byte 8 is corrupt: CRC mismatch"):
        CommittedLog.open(path, fsync=False)
    path.write_bytes(_framed([]) + frame(b"X{}") + b"X{}")
    with pytest.raises(ConsumerStateError, match="unknown record type"):
        CommittedLog.read(path)


def test_zeroes_after_the_last_record_are_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "committed.log"
    path.write_bytes(_framed([_entry(0)]) + b"\0" * 64)
    log, entries = CommittedLog.open(path, fsync=False)
    log.close()
    assert entries == [_entry(0)]
    assert path.read_bytes() == _framed([_entry(0)])


_ids = st.one_of(
    st.integers(0, 10**6), st.text("abc-", min_size=1, max_size=5).map(lambda s: "w" + s)
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_ids, max_size=12), st.data())
def test_every_cut_of_the_log_reads_as_a_prefix(batches: list[BatchId], data: Any) -> None:
    """A log cut anywhere (a crash part way through an append) opens as the entries
    wholly before the cut, and is truncated to them."""
    entries = [_entry(b, seq=i) for i, b in enumerate(batches)]
    full = _framed(entries)
    cut = data.draw(st.integers(0, len(full)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "committed.log"
        path.write_bytes(full[:cut])
        log, got = CommittedLog.open(path, fsync=False)
        log.append([_entry("after")])
        log.close()
        assert got == entries[: len(got)]
        assert len(_framed(got)) <= max(cut, len(LOG_MAGIC))
        assert CommittedLog.read(path) == [*got, _entry("after")]


@settings(max_examples=200, deadline=None)
@given(st.lists(_ids, max_size=60))
def test_committed_ids_hold_what_was_added(batches: list[BatchId]) -> None:
    ids = CommittedIds()
    for b in batches:
        ids.add(b)
    ints = {b for b in batches if isinstance(b, int)}
    assert all(b in ids for b in batches)
    assert not any(b + 1 in ids for b in ints if b + 1 not in ints)
    assert len(ids.los) == len(ids.his)
    # Ranges are sorted, disjoint and not adjacent (adjacent ones are merged).
    for i, (lo, hi) in enumerate(zip(ids.los, ids.his, strict=True)):
        assert lo <= hi and (i == 0 or lo > ids.his[i - 1] + 1)
    assert sum(hi - lo + 1 for lo, hi in zip(ids.los, ids.his, strict=True)) == len(ints)
    restored = CommittedIds.restore(json.loads(json.dumps(ids.snapshot())))
    assert all(b in restored for b in batches)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("stage"), st.integers(0, 3), st.integers(1, 2)),
        st.tuples(st.just("commit"), st.integers(0, 3), st.integers(0, 2)),
        st.tuples(st.just("abort"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("ack"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("reopen"), st.just(0), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(_ops)
@example([("stage", 0, 1), ("commit", 1, 0), ("commit", 0, 1)])  # older staging goes
@example([("stage", 2, 2), ("commit", 2, 2), ("reopen", 0, 0), ("ack", 2, 0), ("reopen", 0, 0)])
def test_the_folder_follows_a_model_across_reopens(ops: list[tuple[str, int, int]]) -> None:
    """Random stage/commit/abort/ack/reopen runs against a model: a batch id is
    committed once, published iff it had rows, and an acked batch stays committed."""
    with tempfile.TemporaryDirectory() as d:
        f = SinkFolder(Path(d) / "sink", fsync=False)
        staged: dict[int, int] = {}  # batch -> rows staged (partition 0, attempt 0)
        committed: set[int] = set()
        published: dict[int, int] = {}  # batch -> rows, in commit order
        try:
            for op, batch, n in ops:
                if op == "stage":
                    _stage(f, batch, 0, [b"v"] * n)
                    staged[batch] = n
                elif op == "commit":
                    if batch in committed:
                        assert f.commit("s", batch, [(0, 0, n)], None) == AlreadyCommitted(
                            "s", batch
                        )
                        staged.pop(batch, None)  # its staging goes, older batches' stay
                        continue
                    if n and staged.get(batch) != n:
                        with pytest.raises(CommitRefused):
                            f.commit("s", batch, [(0, 0, n)], None)
                        continue
                    else:
                        got = f.commit("s", batch, [(0, 0, n)], None)
                        assert isinstance(got, Committed) and got.rows == n
                        assert got.published == (n > 0)
                        committed.add(batch)
                        if n:
                            published[batch] = n
                    # Spark commits in order: older staging goes with a new commit.
                    staged = {b: r for b, r in staged.items() if b > batch}
                elif op == "abort":
                    assert f.abort("s", batch).discarded == (batch not in committed)
                    staged.pop(batch, None)
                elif op == "ack":
                    if batch in committed:
                        f.ack("s", batch)
                        published.pop(batch, None)
                    else:
                        with pytest.raises(LocalProtocolError):
                            f.ack("s", batch)
                else:
                    f.close()
                    f = SinkFolder(Path(d) / "sink", fsync=False)
                assert {b for _, b in f.published()} == set(published)
                assert all(f.rows("s", b) == r for b, r in published.items())
                assert all(f.is_committed("s", b) == (b in committed) for b in range(4))
        finally:
            f.close()
