"""The producer's retention log (zio_spark.storage.retention.RetentionLog), no sockets:
append/read/release/reopen, a torn tail cut at every byte, damage before the end refused
naming file and offset, the folder lock, bad input named, renumbering crash-safe, and a
hypothesis state machine (appends, releases, renumberings, clean reopens and crashes at
any byte of an append or around a release) against a list model; then the producer's
backlog (zio_spark.source.backlog) over a log: written before held, released on ack,
renumbered on disk first, reopened."""

from __future__ import annotations

import collections
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zio_spark.errors import (
    CorruptRecordError,
    FormatVersionError,
    StorageClosedError,
    StorageError,
    StorageInputError,
)
from zio_spark.protocol.negotiate import Terms
from zio_spark.source.backlog import ProducerBacklog
from zio_spark.storage.retention import (
    HEAD_MAGIC,
    SEGMENT_MAGIC,
    RetentionLockedError,
    RetentionLog,
)
from zio_spark.transport.giver import Giving

Row = tuple[int, bytes, bytes | None, int | None, dict[str, str] | None]


def _open(folder: Path, **kw: object) -> RetentionLog:
    kw.setdefault("owner", "p1")
    kw.setdefault("sync", False)
    return RetentionLog(folder, **kw)  # type: ignore[arg-type]


def _rows(log: RetentionLog, start: int | None = None, end: int | None = None) -> list[Row]:
    start = log.first if start is None else start
    end = log.next_seq if end is None else end
    held = log.records(start, end)
    if held is None:
        return []
    n = len(held.values)
    return [
        (
            held.first + i,
            held.values[i],
            None if held.keys is None else held.keys[i],
            None if held.granules is None else held.granules[i],
            None if held.headers is None else held.headers[i],  # type: ignore[misc]
        )
        for i in range(n)
    ]


def _crash(log: RetentionLog) -> None:
    """What a killed process leaves: the files as they are, the descriptors gone."""
    for seg in log._segments:
        seg.close()
    os.close(log._lock_fd)
    log._lock_fd = -1
    log._closed = True


def _segments(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.seg"))


# ------------------------------------------------------------------------------ basics


def test_append_read_release_reopen(tmp_path: Path) -> None:
    log = _open(tmp_path / "r")
    assert (log.first, log.next_seq, len(log)) == (1, 1, 0)
    assert log.append(1, [b"a", b"b"], [b"k", None], [7, None], [{"h": "1"}, None]) == 2
    assert log.append(3, [b"c"]) == 3
    assert log.append(4, []) == 3  # nothing to add
    expected: list[Row] = [
        (1, b"a", b"k", 7, {"h": "1"}),
        (2, b"b", None, None, None),
        (3, b"c", None, None, None),
    ]
    assert _rows(log) == expected
    assert _rows(log, 2, 3) == expected[1:2]
    assert log.release(1) == 1
    assert (log.first, log.next_seq) == (2, 4)
    log.close()
    with pytest.raises(StorageClosedError):
        log.append(4, [b"d"])

    log = _open(tmp_path / "r")
    assert (log.first, log.next_seq, log.reopened, log.torn) == (2, 4, 2, 0)
    assert _rows(log) == expected[1:]
    assert log.append(4, [b"d"]) == 4  # numbering goes on after the last seq written
    assert log.release(4) == 3
    assert _segments(tmp_path / "r") == []  # every record released: no segment left
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["HEAD", "LOCK"]
    log.close()
    log = _open(tmp_path / "r")
    assert (log.first, log.next_seq, len(log)) == (5, 5, 0)
    log.close()


def test_reads_are_deterministic_and_range_exact(tmp_path: Path) -> None:
    log = _open(tmp_path / "r", segment_bytes=300)
    for i in range(20):
        log.append(log.next_seq, [b"v%03d" % (5 * i + j) for j in range(5)])
    assert len(_segments(tmp_path / "r")) > 3
    one = log.read(7, 63)
    assert one.num_rows == 56
    assert one.column("seq").to_pylist() == list(range(7, 63))
    assert one.column("value").to_pylist() == [b"v%03d" % (s - 1) for s in range(7, 63)]
    again = log.read(7, 63)
    assert one.equals(again)
    assert one.serialize().to_pybytes() == again.serialize().to_pybytes()
    assert log.read(40, 40).num_rows == 0
    log.close()
    log = _open(tmp_path / "r", segment_bytes=300)
    assert log.read(7, 63).equals(one)  # and after a reopen
    log.close()


def test_release_deletes_whole_segments_only(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder, segment_bytes=1)  # a segment per append
    for i in range(5):
        log.append(log.next_seq, [b"x%d" % i, b"y%d" % i])  # seqs 2i+1, 2i+2
    assert len(_segments(folder)) == 5
    log.release(3)  # segment 1..2 gone, 3..4 half held
    assert len(_segments(folder)) == 4
    assert _rows(log)[0][:2] == (4, b"y1")
    log.release(100)  # past the end: empty, numbering moves on after it
    assert _segments(folder) == []
    assert (log.first, log.next_seq) == (101, 101)
    assert log.append(101, [b"z"]) == 101
    log.close()
    log = _open(folder)
    assert _rows(log) == [(101, b"z", None, None, None)]
    log.close()


def test_a_release_interrupted_before_its_deletions_is_finished_on_open(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder, segment_bytes=1)
    for i in range(3):
        log.append(log.next_seq, [b"v%d" % i])
    log._write_head(0, 3)  # HEAD moved, then the crash: no segment deleted yet
    _crash(log)
    assert len(_segments(folder)) == 3
    log = _open(folder)
    assert _rows(log) == [(3, b"v2", None, None, None)]
    assert len(_segments(folder)) == 1
    log.close()


# ---------------------------------------------------------------------- torn and corrupt


def _two_appends(folder: Path) -> tuple[int, int]:
    """Records 1..3 then 4..5; returns (size after the first append, size at the end)."""
    log = _open(folder)
    log.append(1, [b"a", b"b", b"c"])
    (seg,) = _segments(folder)
    first = seg.stat().st_size
    log.append(4, [b"d", b"e"], headers=[{"x": "y"}, None])
    end = seg.stat().st_size
    log.close()
    return first, end


def test_a_torn_last_append_is_cut_off_at_every_byte(tmp_path: Path, caplog) -> None:
    first, end = _two_appends(tmp_path / "ref")
    data = _segments(tmp_path / "ref")[0].read_bytes()
    for cut in range(first, end):
        folder = tmp_path / f"c{cut}"
        _two_appends(folder)
        (seg,) = _segments(folder)
        seg.write_bytes(data[:cut])
        log = _open(folder)
        assert (log.first, log.next_seq) == (1, 4), cut
        assert log.torn == (1 if cut > first else 0), cut
        assert seg.stat().st_size == first  # cut off on disk too
        assert log.append(4, [b"again"]) == 4  # and appends go on after it
        log.close()
    assert "torn record" in caplog.text


def test_zeroes_after_the_last_record_are_a_torn_tail(tmp_path: Path) -> None:
    _, end = _two_appends(tmp_path / "r")
    (seg,) = _segments(tmp_path / "r")
    with open(seg, "ab") as f:
        f.write(bytes(4096))  # space a file system allocated before a crash
    log = _open(tmp_path / "r")
    assert (log.next_seq, log.torn) == (6, 1)
    assert seg.stat().st_size == end
    log.close()


def test_damage_before_the_end_is_an_error_naming_file_and_offset(tmp_path: Path) -> None:
    first, _ = _two_appends(tmp_path / "r")
    (seg,) = _segments(tmp_path / "r")
    data = bytearray(seg.read_bytes())
    data[first - 3] ^= 0x40  # inside the first record's payload
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError) as err:
        _open(tmp_path / "r")
    e = err.value
    assert e.path == str(seg) and e.offset == len(SEGMENT_MAGIC)
    assert "CRC mismatch" in str(e) and "expected" in str(e)
    # Nothing was changed, and the folder is not left locked.
    assert seg.read_bytes() == bytes(data)
    with pytest.raises(CorruptRecordError):
        _open(tmp_path / "r")


def test_a_torn_record_in_a_segment_that_is_not_the_last_is_damage(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder, segment_bytes=1)
    log.append(1, [b"a"])
    log.append(2, [b"b"])
    log.close()
    older = _segments(folder)[0]
    older.write_bytes(older.read_bytes()[:-2])
    with pytest.raises(CorruptRecordError, match="only the end of the last segment") as err:
        _open(folder)
    assert err.value.path == str(older)


def test_a_missing_segment_is_a_gap(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder, segment_bytes=1)
    for i in range(3):
        log.append(log.next_seq, [b"v%d" % i])
    log.close()
    _segments(folder)[1].unlink()
    with pytest.raises(CorruptRecordError, match=r"starts at seq 3, expected 2"):
        _open(folder)
    _segments(folder)[0].unlink()  # now the first held one is missing
    with pytest.raises(CorruptRecordError, match=r"seqs 1\.\.2 are missing"):
        _open(folder)


def test_a_damaged_or_missing_head_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    _two_appends(folder)
    head = folder / "HEAD"
    good = head.read_bytes()
    head.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptRecordError, match="HEAD record: CRC mismatch") as err:
        _open(folder)
    assert err.value.offset == len(HEAD_MAGIC)
    head.write_bytes(b"ZSRETH2\x00" + good[8:])
    with pytest.raises(FormatVersionError):
        _open(folder)
    head.write_bytes(b"garbage!")
    with pytest.raises(CorruptRecordError, match="HEAD starts with"):
        _open(folder)
    head.unlink()
    with pytest.raises(CorruptRecordError, match="HEAD is missing beside 1 segment"):
        _open(folder)


def test_a_held_record_changed_on_disk_after_open_fails_the_read(tmp_path: Path) -> None:
    log = _open(tmp_path / "r")
    log.append(1, [b"abcdef" * 10])
    (seg,) = _segments(tmp_path / "r")
    data = bytearray(seg.read_bytes())
    data[-5] ^= 1
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="no longer reads back") as err:
        log.read(1, 2)
    assert err.value.path == str(seg) and err.value.offset == len(SEGMENT_MAGIC)
    log.close()


# ------------------------------------------------------------------------------ lock


def test_one_process_per_folder(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder)
    with pytest.raises(RetentionLockedError, match="in use by another producer process"):
        _open(folder)
    code = (
        "import sys\n"
        "from zio_spark.storage.retention import RetentionLog, RetentionLockedError\n"
        "try:\n"
        "    RetentionLog(sys.argv[1], owner='p1')\n"
        "except RetentionLockedError as e:\n"
        "    print('locked', e.path)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["locked", str(folder)]
    log.close()
    _open(folder).close()  # free again once closed


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "field", "expected"),
    [
        (lambda log: log.append(2, [b"a"]), "first", "1, the next seq"),
        (lambda log: log.append(True, [b"a"]), "first", "1, the next seq"),
        (lambda log: log.append(1, b"abc"), "values", "a sequence of bytes"),
        (lambda log: log.append(1, [b"a"], keys=[b"k", b"l"]), "keys", "1 entries, one per"),
        (lambda log: log.append(1, [b"a"], granules=5), "granules", "a sequence of 1"),
        (lambda log: log.append(1, [b"a", 3]), "values[1]", "bytes or None"),
        (lambda log: log.append(1, [b"a"], keys=[3]), "keys[0]", "bytes or None"),
        (lambda log: log.append(1, [b"a"], granules=[1.5]), "granules[0]", "an int or None"),
        (lambda log: log.append(1, [b"a"], granules=[1 << 63]), "granules[0]", "int64"),
        (lambda log: log.append(1, [b"a"], headers=[{"k": 1}]), "headers[0]", "str -> str"),
        (lambda log: log.append(1, [b"a"], headers=["x=y"]), "headers[0]", "str -> str"),
        (lambda log: log.read(0, 1), "start", "a held seq"),
        (lambda log: log.read(1, 2), "end", "1 <= end <= 1"),
        (lambda log: log.release("3"), "upto", "an int seq"),
        (lambda log: log.renumber(0), "shift", "an int >= 1"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(tmp_path: Path, call, field, expected) -> None:
    log = _open(tmp_path / "r")
    with pytest.raises(StorageInputError) as err:
        call(log)
    assert err.value.field == field
    assert expected in err.value.expected
    assert (log.first, log.next_seq) == (1, 1)
    assert log.append(1, [b"ok"]) == 1  # the log still works
    log.close()


def test_bad_constructor_arguments(tmp_path: Path) -> None:
    with pytest.raises(StorageInputError) as err:
        RetentionLog(tmp_path / "r", owner="")
    assert err.value.field == "owner"
    with pytest.raises(StorageInputError) as err:
        RetentionLog(tmp_path / "r", owner="p", segment_bytes=0)
    assert err.value.field == "segment_bytes"
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot make the retention folder"):
        RetentionLog(tmp_path / "file" / "r", owner="p")


def test_a_folder_of_another_producer_is_refused(tmp_path: Path) -> None:
    _open(tmp_path / "r", owner="alpha").close()
    with pytest.raises(StorageInputError) as err:
        _open(tmp_path / "r", owner="beta")
    assert err.value.field == "producer_id" and err.value.value == "beta"
    assert "'alpha'" in err.value.expected
    _open(tmp_path / "r", owner="alpha").close()  # the lock was let go


# ------------------------------------------------------------------------- renumber


def test_renumber_moves_held_records_and_survives_reopen(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder, segment_bytes=1)
    for i in range(3):
        log.append(log.next_seq, [b"v%d" % i], granules=[i])
    log.release(1)
    log.renumber(100)
    assert (log.first, log.next_seq, log.generation) == (102, 104, 1)
    assert _rows(log) == [(102, b"v1", None, 1, None), (103, b"v2", None, 2, None)]
    assert {p.name[:8] for p in _segments(folder)} == {"00000001"}
    log.append(104, [b"v3"])
    log.close()
    log = _open(folder)
    assert [r[0] for r in _rows(log)] == [102, 103, 104]
    log.renumber(6)  # an empty log just moves its numbering on, too
    log.release(110)
    log.renumber(5)
    assert (log.first, log.next_seq) == (116, 116)
    log.close()


def test_the_incarnation_is_kept_until_held_records_are_renumbered(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    log = _open(folder)
    made = log.incarnation
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    log.append(1, [b"a"])
    log.close()
    log = _open(folder)
    assert log.incarnation == made  # reopened: the same numbering
    log.release(1)
    log.renumber(5)  # nothing held: numbers only move on
    log.close()
    log = _open(folder)
    assert (log.incarnation, log.next_seq) == (made, 7)
    log.append(7, [b"b"])
    log.renumber(3)  # a held record gets another number: another numbering
    assert log.incarnation != made
    renumbered = log.incarnation
    log.close()
    log = _open(folder)
    assert (log.incarnation, log.first) == (renumbered, 10)
    log.close()
    assert _open(tmp_path / "other").incarnation not in (made, renumbered)


def test_a_head_with_a_bad_incarnation_is_corrupt(tmp_path: Path) -> None:
    from zio_spark.storage.files import frame

    folder = tmp_path / "r"
    _open(folder).close()
    payload = struct.pack("<c3xIQB", b"H", 0, 1, 3) + b"a b" + b"p1"
    (folder / "HEAD").write_bytes(HEAD_MAGIC + frame(payload) + payload)
    with pytest.raises(CorruptRecordError, match="HEAD incarnation 'a b'"):
        _open(folder)


def test_a_renumbering_cut_short_leaves_the_old_numbering(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "r"
    log = _open(folder)
    log.append(1, [b"a", b"b"])
    before = log.incarnation

    def fail(gen: int, first: int, incarnation: str | None = None) -> None:
        raise StorageError("disk gone")

    monkeypatch.setattr(log, "_write_head", fail)
    with pytest.raises(StorageError, match="disk gone"):
        log.renumber(10)
    assert log.closed  # memory may not match the folder: reopen to go on
    _crash(log)
    assert len(_segments(folder)) == 2  # the new generation's, never named by HEAD
    log = _open(folder)
    assert _rows(log) == [(1, b"a", None, None, None), (2, b"b", None, None, None)]
    assert [p.name[:8] for p in _segments(folder)] == ["00000000"]
    assert log.incarnation == before
    log.close()


# ------------------------------------------------------------------------ the model


class RetentionMachine(RuleBasedStateMachine):
    """The log against a list of held rows; crashes cut the last append at any byte."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.folder = Path(self.tmp.name) / "r"
        self.log = RetentionLog(self.folder, owner="m", sync=False, segment_bytes=200)
        self.model: list[Row] = []
        self.first = 1
        self.next = 1
        self.counter = 0

    def teardown(self) -> None:
        self.log.close()
        self.tmp.cleanup()

    def _reopen(self) -> None:
        self.log = RetentionLog(self.folder, owner="m", sync=False, segment_bytes=200)

    def _cols(self, n: int, keys: bool, granules: bool, headers: bool) -> tuple:
        c = self.counter
        self.counter += n
        return (
            [b"v%d" % (c + i) for i in range(n)],
            [b"k%d" % i if i % 2 else None for i in range(n)] if keys else None,
            [c + i if i % 3 else None for i in range(n)] if granules else None,
            [{"i": str(c + i)} if i % 2 == 0 else None for i in range(n)] if headers else None,
        )

    @rule(
        n=st.integers(0, 12),
        keys=st.booleans(),
        granules=st.booleans(),
        headers=st.booleans(),
    )
    def append(self, n: int, keys: bool, granules: bool, headers: bool) -> None:
        values, k, g, h = self._cols(n, keys, granules, headers)
        assert self.log.append(self.next, values, k, g, h) == self.next + n - 1
        for i in range(n):
            self.model.append(
                (
                    self.next + i,
                    values[i],
                    None if k is None else k[i],
                    None if g is None else g[i],
                    None if h is None else h[i],
                )
            )
        self.next += n

    @rule(k=st.integers(-2, 15))
    def release(self, k: int) -> None:
        upto = self.first - 1 + k
        self.log.release(upto)
        if upto >= self.first:
            self.model = [r for r in self.model if r[0] > upto]
            self.first = upto + 1
            self.next = max(self.next, self.first)

    @rule(shift=st.integers(1, 50))
    def renumber(self, shift: int) -> None:
        self.log.renumber(shift)
        self.model = [(r[0] + shift, *r[1:]) for r in self.model]  # type: ignore[misc]
        self.first += shift
        self.next += shift

    @rule()
    def reopen(self) -> None:
        self.log.close()
        self._reopen()

    @rule(n=st.integers(1, 6), at=st.floats(0, 1, exclude_max=True))
    def crash_in_an_append(self, n: int, at: float) -> None:
        """The process dies while writing an append: any prefix of it is on disk."""
        before = {p: p.stat().st_size for p in _segments(self.folder)}
        values, *_ = self._cols(n, False, False, False)
        self.log.append(self.next, values)
        tail = self.log._segments[-1]
        start = before.get(tail.path, 0)
        cut = start + int(at * (tail.size - start))
        _crash(self.log)
        with open(tail.path, "r+b") as f:
            f.truncate(cut)
        self._reopen()
        assert self.log.torn <= 1

    @rule(k=st.integers(1, 15), after_head=st.booleans())
    def crash_in_a_release(self, k: int, after_head: bool) -> None:
        """Dies replacing HEAD (a partial temp file) or just after (no deletions)."""
        upto = self.first - 1 + k
        if after_head:
            self.log._write_head(self.log.generation, upto + 1)
            self.model = [r for r in self.model if r[0] > upto]
            self.first = upto + 1
            self.next = max(self.next, self.first)
        else:
            (self.folder / ".HEAD.tmp").write_bytes(HEAD_MAGIC + b"\x10\x00")
        _crash(self.log)
        self._reopen()

    @precondition(lambda self: self.next > self.first)
    @rule(data=st.data())
    def read_a_range(self, data: st.DataObject) -> None:
        a = data.draw(st.integers(self.first, self.next))
        b = data.draw(st.integers(a, self.next))
        assert _rows(self.log, a, b) == [r for r in self.model if a <= r[0] < b]

    @invariant()
    def holds_the_model(self) -> None:
        assert (self.log.first, self.log.next_seq) == (self.first, self.next)
        assert _rows(self.log) == self.model


TestRetentionMachine = RetentionMachine.TestCase
TestRetentionMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ------------------------------------------------- the producer's backlog over the log


def _backlog(folder: Path, stats: collections.Counter[str] | None = None) -> ProducerBacklog:
    return ProducerBacklog(
        max_unacked=1000,
        max_unacked_bytes=1 << 20,
        stats=collections.Counter() if stats is None else stats,
        wake=lambda: None,
        retention=_open(folder, owner="bp"),
    )


def _taker(backlog: ProducerBacklog, resume: int | None) -> tuple[Giving, int]:
    giving = Giving(
        backlog,
        Terms(profile=True, ack=True, encoding="arrow", resume=resume),
        batch=100,
        bare=False,
    )
    return giving, backlog.attach(giving, resume)


def test_the_backlog_writes_before_holding_and_releases_on_ack(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    b = _backlog(folder)
    assert b.append([b"a", b"b", b"c"], None, None, None, 1) == 3
    assert (b.retention.first, b.retention.next_seq) == (1, 4)
    _, start = _taker(b, 0)
    assert start == 1
    got = b.take(1, 10, 10)
    assert got is not None and got.values == [b"a", b"b", b"c"]
    b.sent(1, 3, 3, 1, False)
    b.ack(2)
    assert (b.retention.first, b.pending) == (3, 1)
    b.ack(99)  # beyond what was numbered: the log's numbering stays memory's
    assert (b.retention.first, b.retention.next_seq, b.last_seq) == (4, 4, 3)
    assert b.append([b"d"], None, None, None, 1) == 4
    b.close_retention()

    again = _backlog(folder)  # a restart: holds 4, numbers on after it
    assert (again.pending, again.last_seq, again.acked) == (1, 4, 3)
    _, start = _taker(again, 3)
    assert start == 4
    again.close_retention()


def test_a_bad_record_fails_the_append_and_holds_nothing_of_it(tmp_path: Path) -> None:
    b = _backlog(tmp_path / "r")
    with pytest.raises(StorageInputError) as err:
        b.append([b"a", 5], None, None, None, 1)  # type: ignore[list-item]
    assert err.value.field == "values[1]"
    assert (b.pending, b.last_seq, b.retention.next_seq) == (0, 0, 1)
    b.close_retention()


def test_the_backlog_renumbers_the_log_first(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    stats: collections.Counter[str] = collections.Counter()
    b = _backlog(folder, stats)
    b.append([b"x", b"y"], None, None, None, 1)
    _, start = _taker(b, 40)  # the taker holds 1..40 from this id's earlier life
    assert start == 41 and stats["renumbered"] == 2
    assert (b.retention.first, b.retention.next_seq, b.last_seq) == (41, 43, 42)
    b.close_retention()
    again = _backlog(folder)
    assert (again.pending, again.last_seq) == (2, 42)
    got = again.take(41, 10, 10)
    assert got is not None and (got.first, got.values) == (41, [b"x", b"y"])
    # A second taker with the same resume does not move the numbering again.
    _, start = _taker(again, 40)
    assert start == 41 and again.last_seq == 42
    again.close_retention()
