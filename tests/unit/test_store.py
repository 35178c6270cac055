"""Tests for zio_spark.storage.store: the PZQ-style queue's durable message store.

No sockets. "Crash" means the store's files are closed without a commit or a close (what
SIGKILL leaves behind); torn tails are made by truncating or overwriting segment bytes.
Segments are preallocated by default, so a crashed store's active segment ends in zeros.
"""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

import pytest

from tests.support import flip_byte
from zio_spark.errors import ConfigError, StorageClosedError
from zio_spark.storage import store as store_mod
from zio_spark.storage import store_format
from zio_spark.storage.files import RECORD_HEAD, read_record
from zio_spark.storage.store import (
    MAX_ID_BYTES,
    MessageRejected,
    MessageStore,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)

SMALL = 64 << 10  # small segments, so tests cross segment boundaries quickly


def crash(store: MessageStore) -> None:
    """Drop the store as SIGKILL would: no commit, no close (the lock goes with the fds)."""
    store._close_files()
    store._index.closed = True


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.log"))


def records_end(path: Path) -> int:
    """Where the last whole, valid record of a segment file ends (read independently)."""
    data = path.read_bytes()
    pos = 0
    while not isinstance(got := read_record(data, pos, len(data)), str):
        pos = got[1]
    return pos


def active_end(store: MessageStore) -> int:
    """The end of the records in the store's active segment (call before a crash)."""
    assert store._index.active is not None
    return store._index.active.end


def put_many(store: MessageStore, ids: list[bytes], body: bytes = b"x" * 100) -> list[int]:
    keys = []
    for mid in ids:
        key = store.put(mid, [body])
        assert key is not None
        keys.append(key)
    return keys


def drain(store: MessageStore, *, ack: bool = True) -> list[bytes]:
    out = []
    while (m := store.take()) is not None:
        out.append(m.message_id)
        if ack:
            assert store.ack(m.key)
    return out


def ids(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i:06d}".encode() for i in range(n)]


# ---------------------------------------------------------------------- basics


def test_put_commit_take_ack_roundtrip(tmp_path: Path) -> None:
    with MessageStore(tmp_path) as st:
        k1 = st.put(b"a", [b"one"])
        k2 = st.put(b"b", [b"", b"two", b"parts"])
        k3 = st.put(b"c", [b""])
        assert None not in (k1, k2, k3)
        assert st.take() is None, "nothing is deliverable before its commit"
        assert st.commit() == 3
        got = [st.take() for _ in range(3)]
        assert st.take() is None
        assert [(m.message_id, m.body, m.redelivery) for m in got if m] == [
            (b"a", (b"one",), False),
            (b"b", (b"", b"two", b"parts"), False),
            (b"c", (b"",), False),
        ]
        assert st.stats().in_flight == 3
        assert all(st.ack(m.key) for m in got if m)
        assert not st.ack(got[0].key), "a second ack changes nothing"  # type: ignore[union-attr]
        assert st.messages == 0 and st.in_flight == 0


def test_release_requeues_first_and_counts_redelivery(tmp_path: Path) -> None:
    with MessageStore(tmp_path) as st:
        put_many(st, ids(3))
        st.commit()
        first = st.take()
        assert first is not None and first.message_id == b"m000000"
        assert st.release(first.key)
        assert not st.release(first.key), "only in-flight messages can be released"
        again = st.take()
        assert again is not None and again.message_id == b"m000000" and again.redelivery
        assert st.release(again.key, delivered=False)
        third = st.take()
        assert third is not None and third.message_id == b"m000000" and third.redelivery is False
        assert [m for m in drain(st)] == [b"m000001", b"m000002"]


def test_async_commit_buffers_the_next_batch(tmp_path: Path) -> None:
    with MessageStore(tmp_path) as st:
        st.put(b"a", [b"1"])
        ticket = st.begin_commit()
        assert ticket is not None and ticket.puts == 1 and st.committing
        with pytest.raises(StoreError, match="already outstanding"):
            st.begin_commit()
        st.put(b"b", [b"2"])  # goes into the next commit
        assert st.uncommitted == 2
        assert st.take() is None
        ticket.run()
        assert st.end_commit(ticket) == 1
        m = st.take()
        assert m is not None and m.message_id == b"a"
        assert st.take() is None, "b is not durable yet"
        assert st.commit() == 1
        m2 = st.take()
        assert m2 is not None and m2.message_id == b"b"


def test_inputs_are_checked(tmp_path: Path) -> None:
    with MessageStore(tmp_path) as st:
        with pytest.raises(MessageRejected):
            st.put(b"", [b"x"])
        with pytest.raises(MessageRejected):
            st.put(b"i" * (MAX_ID_BYTES + 1), [b"x"])
        with pytest.raises(MessageRejected):
            st.put(b"a", [])
        assert st.put(b"i" * MAX_ID_BYTES, [b"x"]) is not None
    with pytest.raises(ConfigError):
        MessageStore(tmp_path / "x", segment_bytes=10)
    with pytest.raises(ConfigError):
        MessageStore(tmp_path / "y", compact_ratio=1.5)
    with pytest.raises(ConfigError):
        MessageStore(tmp_path / "z", dedup_window=-1)


def test_one_store_per_folder(tmp_path: Path) -> None:
    with MessageStore(tmp_path) as st:
        with pytest.raises(StoreLockedError):
            MessageStore(tmp_path)
        queue_id = st.queue_id
    with MessageStore(tmp_path) as again:
        assert again.queue_id == queue_id, "the queue id is kept in the folder"


# ---------------------------------------------------------------------- recovery


def test_restart_redelivers_everything_not_acked(tmp_path: Path) -> None:
    st = MessageStore(tmp_path, segment_bytes=SMALL)
    put_many(st, ids(1000))
    st.commit()
    taken = [st.take() for _ in range(600)]
    for m in taken[:300]:
        assert m is not None and st.ack(m.key)
    st.commit()  # tombstones for the first 300; 300 more stay in flight
    crash(st)
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.messages == 700
        left = drain(again)
        assert left == ids(1000)[300:], "in-flight and pending ones come back, in order"


def test_uncommitted_puts_are_lost_in_a_crash(tmp_path: Path) -> None:
    st = MessageStore(tmp_path)
    put_many(st, ids(10))
    st.commit()
    put_many(st, ids(5, "late"))  # never committed
    crash(st)
    with MessageStore(tmp_path) as again:
        assert drain(again) == ids(10)
        # Their ids never became durable, so a resend is stored, not refused.
        assert again.put(b"late000000", [b"x"]) is not None


@pytest.mark.parametrize("preallocate", [True, False])
def test_torn_tail_is_truncated_and_counted(tmp_path: Path, preallocate: bool) -> None:
    st = MessageStore(tmp_path, preallocate=preallocate)
    put_many(st, ids(50))
    st.commit()
    last = segments(tmp_path)[-1]
    end = active_end(st)
    crash(st)
    with last.open("r+b") as f:  # a commit that stopped half way through a record
        if preallocate:  # the rest of the region stays zero
            f.seek(end - 7)
            f.write(bytes(7))
        else:
            f.truncate(end - 7)
    with MessageStore(tmp_path, preallocate=preallocate) as again:
        assert again.stats().torn_records == 1
        assert drain(again) == ids(49)
        assert again.put(b"new", [b"n"]) is not None
        again.commit()
    with MessageStore(tmp_path) as third:
        assert third.stats().torn_records == 0, "the torn bytes are gone for good"
        assert drain(third) == [b"new"]


@pytest.mark.parametrize("preallocate", [True, False])
def test_garbage_after_the_tail_and_bad_crc(tmp_path: Path, preallocate: bool) -> None:
    st = MessageStore(tmp_path, preallocate=preallocate)
    put_many(st, ids(20))
    st.commit()
    last = segments(tmp_path)[-1]
    end = active_end(st)
    crash(st)
    data = bytearray(last.read_bytes())
    data[end - 3] ^= 0xFF  # the last record's payload no longer matches its CRC
    data[end : end + 100] = os.urandom(100)
    last.write_bytes(bytes(data))
    with MessageStore(tmp_path, preallocate=preallocate) as again:
        assert again.stats().torn_records == 1
        assert drain(again) == ids(19)


def test_empty_segment_left_by_a_crash_is_removed(tmp_path: Path) -> None:
    with MessageStore(tmp_path) as st:
        put_many(st, ids(3))
    (tmp_path / "seg-0000000099.log").write_bytes(b"")
    with MessageStore(tmp_path) as again:
        assert not (tmp_path / "seg-0000000099.log").exists()
        assert drain(again) == ids(3)


# ---------------------------------------------------------------------- preallocation


def test_crash_with_a_preallocated_tail_loses_nothing_and_counts_nothing(
    tmp_path: Path,
) -> None:
    st = MessageStore(tmp_path, segment_bytes=SMALL)
    put_many(st, ids(300))
    st.commit()
    put_many(st, ids(5, "late"))  # never committed
    last = segments(tmp_path)[-1]
    end = active_end(st)
    crash(st)
    assert last.stat().st_size == SMALL > end, "the crash leaves a zero tail"
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.stats().torn_records == 0
        assert last.stat().st_size == records_end(last) < end, "tail truncated on replay"
        assert drain(again) == ids(300)


@pytest.mark.parametrize("damage", ["half record", "zero head, data later"])
def test_torn_record_in_the_preallocated_area_is_counted_once(tmp_path: Path, damage: str) -> None:
    st = MessageStore(tmp_path)
    put_many(st, ids(30))
    st.commit()
    last = segments(tmp_path)[-1]
    end = active_end(st)
    crash(st)
    with last.open("r+b") as f:
        if damage == "half record":  # a head claiming 500 bytes, 40 written, then zeros
            f.seek(end)
            f.write(RECORD_HEAD.pack(500, 0x1234_5678) + os.urandom(40))
        else:  # a commit whose later page reached the disk, its first did not
            f.seek(end + 8192)
            f.write(os.urandom(100))
    size = last.stat().st_size
    with MessageStore(tmp_path) as again:
        assert again.stats().torn_records == 1
        assert drain(again) == ids(30)
        assert last.stat().st_size == records_end(last) == end < size
    with MessageStore(tmp_path) as third:
        assert third.stats().torn_records == 0


def test_rollover_and_close_truncate_segments_to_their_records(tmp_path: Path) -> None:
    st = MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0)
    for batch in range(12):
        put_many(st, ids(100, f"b{batch}-"), b"y" * 300)
        if batch % 2:  # the async form: the rollover happens with the ticket outstanding
            ticket = st.begin_commit()
            assert ticket is not None
            ticket.run()
            st.end_commit(ticket)
        else:
            st.commit()
    files = segments(tmp_path)
    assert len(files) > 3
    *closed, active = files
    for path in closed:
        assert path.stat().st_size == records_end(path), f"{path.name} not truncated"
    assert active.stat().st_size == SMALL, "the active segment is preallocated"
    assert st.db_size() == sum(map(records_end, files))
    st.close()
    for path in files:
        assert path.stat().st_size == records_end(path), f"{path.name} not truncated"
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.stats().torn_records == 0
        assert again.messages == 1200


def test_without_preallocation_files_hold_records_only(tmp_path: Path) -> None:
    with MessageStore(tmp_path, segment_bytes=SMALL, preallocate=False) as st:
        put_many(st, ids(20))
        st.commit()
        (only,) = segments(tmp_path)
        assert only.stat().st_size == records_end(only) == active_end(st)
        put_many(st, ids(400, "more"), b"z" * 300)  # past SMALL: a rollover
        st.commit()
        for path in segments(tmp_path):
            assert path.stat().st_size == records_end(path)


def test_a_filesystem_without_fallocate_falls_back_to_appending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def unsupported(*args: object) -> None:
        calls.append(args)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    caplog.set_level("DEBUG", logger=store_mod.log.name)
    with MessageStore(tmp_path, segment_bytes=SMALL) as st:
        put_many(st, ids(400), b"z" * 300)  # several segments
        st.commit()
        put_many(st, ids(400, "more"), b"z" * 300)
        st.commit()
        for path in segments(tmp_path):
            assert path.stat().st_size == records_end(path)
    assert len(calls) == 1, "tried once, then off for the store"
    assert [r.levelname for r in caplog.records if "preallocation" in r.message] == ["DEBUG"]
    with MessageStore(tmp_path, segment_bytes=SMALL, preallocate=False) as again:
        assert again.messages == 800


def test_a_full_disk_at_segment_start_leaves_that_segment_growing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def full(*args: object) -> None:
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with MessageStore(tmp_path, segment_bytes=SMALL) as st:
        put_many(st, ids(400), b"z" * 300)  # a rollover: a second segment starts
        st.commit()
        assert len(calls) == 2, "tried again for the next segment"
        for path in segments(tmp_path):
            assert path.stat().st_size == records_end(path)
    with MessageStore(tmp_path, segment_bytes=SMALL, preallocate=False) as again:
        assert again.messages == 400 and again.stats().torn_records == 0


@pytest.mark.parametrize("value", [1, "yes", None])
def test_preallocate_must_be_a_bool(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="preallocate") as info:
        MessageStore(tmp_path, preallocate=value)  # type: ignore[arg-type]
    assert info.value.option == "preallocate" and info.value.value == value


# ---------------------------------------------------------------------- reclaiming disk


def test_fully_acked_segments_are_deleted(tmp_path: Path) -> None:
    with MessageStore(tmp_path, segment_bytes=SMALL) as st:
        for batch in range(10):
            put_many(st, ids(200, f"b{batch}-"), b"y" * 200)
            st.commit()
        assert len(segments(tmp_path)) > 5
        big = st.db_size()
        drain(st)
        st.commit()
        st.maintain()
        assert st.db_size() < big // 10
        assert len(segments(tmp_path)) <= 2
        assert st.stats().deleted_segments >= 5


def test_compaction_moves_stragglers_and_forwards_their_keys(tmp_path: Path) -> None:
    st = MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0.25)
    old = ids(400)
    for i in range(0, 400, 100):  # several segments
        put_many(st, old[i : i + 100], b"z" * 500)
        st.commit()
    taken = []
    while (m := st.take()) is not None:
        taken.append(m)
    held = [m for m in taken if m.message_id.endswith(b"7")]  # in flight for long
    requeued = {m.message_id for m in taken if m.message_id.endswith(b"3")}
    for m in taken:
        if m.message_id.endswith(b"3"):
            assert st.release(m.key)
        elif not m.message_id.endswith(b"7"):
            assert st.ack(m.key)
    st.commit()
    # New traffic starts new segments; each start moves the live 20 % of the old ones.
    new = [mid for b in range(6) for mid in ids(150, f"n{b}-")]
    for i in range(0, len(new), 150):
        put_many(st, new[i : i + 150], b"w" * 500)
        st.commit()
    stats = st.stats()
    assert stats.moved >= 40 and stats.deleted_segments >= 2
    for m in held[::2]:  # keys handed out before the move still work
        assert st.ack(m.key), m.message_id
    st.commit()
    expected = requeued | {m.message_id for m in held[1::2]} | set(new)
    crash(st)
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        left = drain(again)
        assert len(left) == len(set(left)), "a moved message comes back once"
        assert set(left) == expected


def test_pinned_messages_keep_their_keys_and_can_be_claimed_after_a_crash(
    tmp_path: Path,
) -> None:
    """take(pin=True) is for a caller that logs keys elsewhere (the queue's flow port):
    compaction leaves pinned messages where they are, and after a restart claim(key)
    takes exactly those back."""
    st = MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0.5)
    for i in range(0, 300, 100):
        put_many(st, ids(300)[i : i + 100], b"p" * 500)
        st.commit()
    pinned = [st.take(pin=True) for _ in range(3)]
    assert all(m is not None for m in pinned)
    while (m := st.take()) is not None:
        st.ack(m.key)
    st.commit()
    for b in range(4):  # new segments: compaction would move the stragglers
        put_many(st, ids(150, f"y{b}-"), b"p" * 500)
        st.commit()
    assert st.stats().moved == 0, "the oldest segment holds pinned messages"
    keys = {m.key: m.message_id for m in pinned if m is not None}
    assert st.claim(next(iter(keys))) is None  # in flight already
    crash(st)
    with MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0.5) as again:
        claimed = [again.claim(key) for key in keys]
        assert [(m.key, m.message_id, m.redelivery) for m in claimed if m] == [
            (k, mid, True) for k, mid in keys.items()
        ]
        assert again.claim(1 << 32 | 10_000) is None  # no such message
        rest = drain(again)
        assert len(rest) == 600 and not set(rest) & set(keys.values())
        for key in keys:
            assert again.ack(key)
        again.commit()
        assert again.messages == 0


def test_requeued_messages_are_delivered_after_a_move(tmp_path: Path) -> None:
    with MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0.5) as st:
        for i in range(0, 300, 100):
            put_many(st, ids(300)[i : i + 100], b"r" * 500)
            st.commit()
        taken = []
        while (m := st.take()) is not None:
            taken.append(m)
        for m in taken:
            if m.message_id.endswith(b"5"):
                st.release(m.key)
            else:
                st.ack(m.key)
        for b in range(4):
            put_many(st, ids(150, f"x{b}-"), b"r" * 500)
            st.commit()
        assert st.stats().moved > 0
        got = drain(st)
        assert got[:30] == [mid for mid in ids(300) if mid.endswith(b"5")], "requeued first"
        assert len(got) == 30 + 600


# ---------------------------------------------------------------------- duplicates


X100 = b"x" * 100  # put_many's body


def test_duplicate_ids_are_refused_and_survive_restart(tmp_path: Path) -> None:
    st = MessageStore(tmp_path, segment_bytes=SMALL)
    put_many(st, ids(100))
    assert st.put(b"m000005", [X100]) is None, "refused even before its commit"
    st.commit()
    assert st.put(b"m000005", [X100]) is None
    drain(st)  # acked: still remembered
    st.commit()
    assert st.put(b"m000005", [X100]) is None
    assert st.stats().duplicates == 3
    crash(st)
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.put(b"m000005", [X100]) is None
        assert again.put(b"m000099", [X100]) is None
        assert again.put(b"fresh", [b"new"]) is not None


def test_a_reused_id_with_a_new_body_is_stored_whatever_the_window_or_a_restart(
    tmp_path: Path,
) -> None:
    st = MessageStore(tmp_path, segment_bytes=SMALL)
    put_many(st, ids(100))
    assert st.put(b"m000005", [b"a new body"]) is not None, "same id, new body: stored"
    assert st.put(b"m000005", [b"a new body"]) is None, "and that body is now the one"
    assert st.put(b"m000006", [b"x" * 50, b"x" * 50]) is not None, "other parts, other body"
    st.commit()
    crash(st)
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.put(b"m000005", [b"a new body"]) is None, "its digest was derived on replay"
        assert again.put(b"m000007", [X100]) is None
        assert again.put(b"m000007", [b"run 2"]) is not None
        assert again.put(b"m000006", [b"x" * 50, b"x" * 50]) is None
        again.commit()
        bodies = [m.body for m in iter(again.take, None)]
    assert bodies.count((b"a new body",)) == 1 and bodies.count((b"run 2",)) == 1
    assert len(bodies) == 103


def test_body_digests_tell_parts_apart() -> None:
    digest = store_mod.body_digest
    assert digest([b"ab"]) == digest([b"ab"]) and len(digest([b"ab"])) == 16
    assert len({digest([b"ab"]), digest([b"a", b"b"]), digest([b"ab", b""]), digest([b""])}) == 4


def _drained_and_deleted(tmp_path: Path) -> MessageStore:
    """A store that took 500 ids (400-byte bodies), delivered them all and deleted their
    segments (``maintain``): the ids live on only in ``ids.snap``."""
    st = MessageStore(tmp_path, segment_bytes=SMALL)
    put_many(st, ids(500), b"d" * 400)
    st.commit()
    drain(st)
    st.commit()
    st.maintain()
    return st


def test_duplicate_window_survives_segment_deletion(tmp_path: Path) -> None:
    st = _drained_and_deleted(tmp_path)
    assert st.stats().deleted_segments > 0 and (tmp_path / "ids.snap").exists()
    crash(st)
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.messages == 0
        assert all(again.put(mid, [b"d" * 400]) is None for mid in ids(500)), "from ids.snap"
        assert again.put(b"m000001", [b"new"]) is not None, "its digest is in ids.snap too"


def test_an_ids_snap_of_version_1_still_opens_and_its_ids_count_as_new_bodies(
    tmp_path: Path,
) -> None:
    """A store written before digests: its ``ids.snap`` (version 1) has none. It opens;
    ids known only from it have no known body, so a repeat is stored (at least once),
    while ids of live segments get their digests from the records."""
    st = _drained_and_deleted(tmp_path)
    put_many(st, [b"live"], b"kept")
    st.commit()
    crash(st)
    snap = tmp_path / "ids.snap"
    _, last_seq, first, old_ids, digests = store_format.decode_snapshot(snap.read_bytes())
    assert len(old_ids) == len(digests) and all(len(d) == 16 for d in digests)
    next_no = store_format.decode_snapshot(snap.read_bytes())[0]
    snap.write_bytes(store_format.encode_snapshot(next_no, last_seq, first, old_ids, version=1))
    assert snap.read_bytes()[4:6] == (1).to_bytes(2, "little"), "a version 1 file"
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.stats().dedup_ids >= 500
        assert again.put(b"m000001", [b"d" * 400]) is not None, "body unknown: stored"
        assert again.put(b"live", [b"kept"]) is None, "digest derived from its record"
        again.commit()
    _, _, _, _, after = store_format.decode_snapshot(snap.read_bytes())
    assert snap.read_bytes()[4:6] == (1).to_bytes(2, "little"), "not rewritten yet"
    assert after == [b""] * len(after)


def test_put_without_dedup_stores_a_repeated_id_and_knows_what_was_on_disk(
    tmp_path: Path,
) -> None:
    with MessageStore(tmp_path) as st:
        assert st.put(b"a", [b"1"]) is not None
        assert st.put(b"a", [b"2"], dedup=False) is not None, "stored again"
        assert st.put(b"a", [b"2"]) is None, "the window has it, with that body"
        st.commit()
        assert not st.accepted_before_open(b"a"), "accepted by this store"
        assert [m.body for m in iter(st.take, None)] == [(b"1",), (b"2",)]
        assert st.same_body(b"a", store_mod.body_digest([b"2"]))
        assert not st.same_body(b"a", store_mod.body_digest([b"1"])), "the newest copy's"
    with MessageStore(tmp_path) as again:
        assert again.accepted_before_open(b"a") and not again.accepted_before_open(b"b")
        assert again.put(b"a", [b"4"], dedup=False) is not None
        assert not again.accepted_before_open(b"a"), "its newest copy is this store's"
    with MessageStore(tmp_path / "off", dedup_window=0) as off:
        off.put(b"a", [b"1"])
        off.commit()
    with MessageStore(tmp_path / "off", dedup_window=0) as off:
        assert not off.accepted_before_open(b"a"), "no window, nothing remembered"


def test_duplicate_window_is_bounded(tmp_path: Path) -> None:
    with MessageStore(tmp_path, dedup_window=100) as st:
        put_many(st, ids(250))
        st.commit()
        assert st.stats().dedup_ids == 100
        assert st.put(b"m000249", [X100]) is None, "recent: refused"
        assert st.put(b"m000000", [b"x"]) is not None, "out of the window: stored again"
    with MessageStore(tmp_path, dedup_window=100) as again:
        assert again.stats().dedup_ids == 100
        assert again.put(b"m000249", [X100]) is None


def test_snapshot_never_holds_ids_that_are_not_durable(tmp_path: Path) -> None:
    # A segment start (with a segment deletion, hence a snapshot) happens inside
    # begin_commit, before that commit's puts are durable. A crash then must not leave
    # their ids in the window, or a resend would be acked without being stored.
    st = MessageStore(tmp_path, segment_bytes=SMALL)
    put_many(st, ids(70), b"s" * 1000)  # > SMALL: this commit starts segment 2
    st.commit()
    drain(st)  # segment 1 is dead; its deletion waits for the next segment start
    put_many(st, ids(100, "late"), b"s" * 1000)  # takes segment 2 past its limit
    ticket = st.begin_commit()
    assert ticket is not None
    assert st.stats().deleted_segments >= 1 and (tmp_path / "ids.snap").exists()
    crash(st)  # the ticket never ran
    with MessageStore(tmp_path, segment_bytes=SMALL) as again:
        assert again.put(b"late000042", [b"s" * 1000]) is not None
        assert again.put(b"m000042", [b"s" * 1000]) is None


# ---------------------------------------------------------------------- failures


@pytest.mark.parametrize("call", ["pwrite", "fdatasync"])
def test_commit_failure_fails_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    st = MessageStore(tmp_path)
    put_many(st, ids(5))
    st.commit()
    put_many(st, ids(3, "doomed"))

    def broken(*args: object) -> None:
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(store_mod.os, call, broken)
    with pytest.raises(StoreError, match="injected"):
        st.commit()
    assert st.failed
    with pytest.raises(StoreError, match="failed"):
        st.put(b"more", [b"x"])
    with pytest.raises(StoreError):
        st.commit()
    assert drain(st) == ids(5), "durable messages can still be delivered"
    monkeypatch.undo()
    crash(st)
    with MessageStore(tmp_path) as again:
        # The acks could not be made durable any more, so those five come back.
        if call == "pwrite":  # nothing reached the file: a resend is stored
            assert again.messages == 5
            assert again.put(b"doomed000000", [X100]) is not None
        else:  # written, sync failed: the data may well be there; a resend is a duplicate
            assert again.messages == 8
            assert again.put(b"doomed000000", [X100]) is None


# ---------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_memory_stays_bounded_with_a_deep_queue(tmp_path: Path) -> None:
    n = 200_000
    body = os.urandom(1024)
    before = _rss_bytes()
    with MessageStore(tmp_path, sync=False, dedup_window=10_000) as st:
        for i in range(n):
            st.put(b"deep-%07d" % i, [body])
            if i % 5000 == 4999:
                st.commit()
        st.commit()
        stats = st.stats()
        assert stats.messages == n
        assert stats.index_bytes <= 10 * n, "~9 bytes of index per stored message"
        grown = _rss_bytes() - before
    # 200 MB of bodies went to disk; the process keeps the index plus the id window.
    assert grown < 40 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
    before = _rss_bytes()
    with MessageStore(tmp_path, sync=False, dedup_window=10_000) as again:
        assert again.messages == n
        m = again.take()
        assert m is not None and m.body == (body,)
        grown = _rss_bytes() - before
    assert grown < 40 << 20, f"recovery: RSS grew by {grown / 2**20:.1f} MiB"


def test_a_closed_store_says_so(tmp_path: Path) -> None:
    st = MessageStore(tmp_path, sync=False)
    st.put(b"a", [b"x"])
    st.close()
    for call in (st.take, lambda: st.claim(1), lambda: st.put(b"b", [b"y"]), st.commit):
        with pytest.raises(StoreClosedError, match="the store is closed") as e:
            call()
        assert isinstance(e.value, StoreError) and isinstance(e.value, StorageClosedError)
        assert e.value.path == str(tmp_path)
    assert st.ack(1) is False and st.release(1) is False


def test_read_taken_run_reads_records_side_by_side_at_once_and_checks_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """read_taken_run (the queue's range reads): the same messages as read_taken one by
    one, with one pread per run of neighbouring records (acks and segment ends between
    them included); a prefix stops before a record that cannot be given back (damaged,
    not in flight), which asked for first raises; nothing changes state."""
    from zio_spark.storage import store_index

    st = MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0)
    with st:
        for b in range(6):  # ack records between the puts, and several segments
            put_many(st, ids(100, f"b{b}-"), b"q" * (150 + b))
            st.put(f"multi{b}".encode(), [b"", b"two", b"p" * 40])
            st.commit()
            if b % 2:
                m = st.take()
                assert m is not None and st.ack(m.key)
        taken = [m for m in iter(lambda: st.take(pin=True), None)]
        assert len(taken) == 603 and len({m.key >> 32 for m in taken}) >= 2
        keys = [m.key for m in taken]
        preads: list[int] = []
        real_pread = os.pread

        def counting(fd: int, n: int, offset: int) -> bytes:
            preads.append(n)
            return real_pread(fd, n, offset)

        monkeypatch.setattr(store_index.os, "pread", counting)
        got = st.read_taken_run(keys)
        assert [(g.key, g.message_id, g.body) for g in got] == [
            (m.key, m.message_id, m.body) for m in taken
        ]
        assert len(preads) < 20, preads  # runs, not one read per record
        # Out of order (a requeued message) still reads right, with more reads.
        shuffled = keys[300:310] + keys[:5] + keys[200:190:-1]
        assert [g.key for g in st.read_taken_run(shuffled)] == shuffled
        # A byte budget: the shortest prefix whose bodies reach it (at least one).
        some = st.read_taken_run(keys, max_bytes=1000)
        assert sum(len(p) for g in some for p in g.body) >= 1000
        assert sum(len(p) for g in some[:-1] for p in g.body) < 1000
        assert len(st.read_taken_run(keys, max_bytes=1)) == 1
        # A damaged record in the middle: the records before it, then its own error.
        seg = st._index.segments[keys[250] >> 32]
        offset = seg.offsets[keys[250] & 0xFFFFFFFF] + RECORD_HEAD.size + 12
        flip_byte(seg.path, offset)
        assert [g.key for g in st.read_taken_run(keys[240:260])] == keys[240:250]
        with pytest.raises(StoreError, match="fails its CRC"):
            st.read_taken_run(keys[250:260])
        assert [g.key for g in st.read_taken_run(keys[251:260])] == keys[251:260]
        # A key not in flight (acked): the same, and it is named.
        assert st.ack(keys[100])
        assert [g.key for g in st.read_taken_run(keys[95:105])] == keys[95:100]
        with pytest.raises(StoreError, match=f"{keys[100]:#x} is not in flight"):
            st.read_taken_run(keys[100:105])
        assert st.in_flight == 602 and st.messages == 602  # reads change nothing
    with pytest.raises(StoreClosedError):
        st.read_taken_run(keys[:3])


def test_take_keys_hands_out_in_takes_order_pinned_and_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """take_keys (the queue's held numbering): the keys take(pin=True) would hand out,
    in its order (requeued first, then oldest first, across segments, none past the
    durable end), pinned (as take(pin=True): compaction leaves them), in flight, without one
    pread: a record damaged on disk is handed out and caught by read_taken_run."""
    from zio_spark.storage import store_index

    st = MessageStore(tmp_path, segment_bytes=SMALL, compact_ratio=0.9)
    with st:
        for i in range(0, 900, 100):  # a new segment once a commit passes SMALL
            put_many(st, ids(900)[i : i + 100])
            st.commit()
        st.put(b"not-durable", [b"x"])  # buffered: never handed out
        first = st.take()
        assert first is not None and st.release(first.key)  # requeued: comes first
        reads: list[int] = []
        real_pread = os.pread

        def counting(fd: int, n: int, offset: int) -> bytes:
            reads.append(n)
            return real_pread(fd, n, offset)

        monkeypatch.setattr(store_index.os, "pread", counting)
        keys = st.take_keys(500) + st.take_keys(1000)
        assert not reads  # nothing read
        monkeypatch.undo()
        assert len(keys) == 900 and len({k >> 32 for k in keys}) >= 2
        assert keys[0] == first.key and keys[1:] == sorted(keys[1:])
        assert st.take_keys(10) == [] and st.take() is None
        assert st.in_flight == 900 and st.messages == 900
        got = st.read_taken_run(keys)
        assert [g.message_id for g in got] == [first.message_id] + [
            m for m in ids(900) if m != first.message_id
        ]
        # Pinned as take(pin=True) pins (compaction never moves them); acks unpin.
        assert st._index.pinned == set(keys)
        for k in keys[1:800]:
            assert st.ack(k)
        st.commit()
        assert st._index.pinned == {keys[0], *keys[800:]}
        assert [g.key for g in st.read_taken_run(keys[800:])] == keys[800:]
        # Damaged on disk after being handed out unread: the read names it.
        seg = st._index.segments[keys[850] >> 32]
        flip_byte(seg.path, seg.offsets[keys[850] & 0xFFFFFFFF] + RECORD_HEAD.size + 12)
        assert [g.key for g in st.read_taken_run(keys[840:860])] == keys[840:850]
        with pytest.raises(StoreError, match="fails its CRC"):
            st.read_taken_run(keys[850:860])
    with pytest.raises(StoreClosedError):
        st.take_keys(1)
