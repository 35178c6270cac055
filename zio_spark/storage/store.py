"""The PZQ-style queue's durable message store: segment log, small index, group commit.

(About 800 lines: ``MessageStore``'s write path, segments and compaction, which share its
state; the format, the index and the replay are in ``store_format``, ``store_index`` and
``store_recovery``.)

Theory of operation (DESIGN.md "The PZQ-style queue"; FACTS.md "Storage")
----------------------------------------------------------------------------
Why a log. On this machine kind append + ``fdatasync`` runs ~800k 1 KiB records/s at
1000 records per commit, sqlite3 (WAL, synchronous=FULL) ~113k and lmdb ~380k; a queue
also deletes every message again, which a log does by appending a tombstone. So the store
is an append-only log of *segment* files with an in-memory index, pure stdlib
(``bench/bench_queue.py --store-only`` re-measures the log against sqlite3).

Files and records. The folder holds segment files ``seg-<no>.log`` of CRC-framed
records (HEADER, then PUT, MOVE and ACK records), ``ids.snap``, ``QUEUE_ID`` and ``LOCK``:
the byte layout is in :mod:`zio_spark.storage.store_format`. A message's *store key* is
``segment no << 32 | slot``, the slot being its index among the segment's PUT/MOVE
records. Keys are opaque ints to callers; they name a record on disk, so a tombstone
needs no lookup table on replay.

Modules. This one holds :class:`MessageStore`: lifecycle, writing and group commit,
segments and compaction. It owns one :class:`~zio_spark.storage.store_index.StoreIndex`,
the index and delivery (take, claim, ack, release), which the store's own methods pass
through to; :mod:`~zio_spark.storage.store_recovery` replays a folder on open.

Memory. Per message the index holds a record offset (4 B), a payload length (4 B) and a
state byte, in per-segment ``array``/``bytearray`` columns: ~9 B per stored message
however large the bodies, which stay on disk and are read back (``pread``) one at a time
when delivered (a run of neighbouring records at a time for the queue's range reads,
:meth:`MessageStore.read_taken_run`). Add the duplicate window (``dedup_window`` ids,
~250 B each with their dict entries and body digests) and the requeue/forwarding tables
(bounded by what is in flight). Recovery keeps at most ~2 windows of ids while it scans.

Group commit. :meth:`MessageStore.put` and :meth:`MessageStore.ack` only buffer. A
commit writes the buffer with one ``pwrite`` (at the segment's end; segments are
preallocated, see :mod:`~zio_spark.storage.store_format`) and one ``fdatasync``, however
many messages it holds. It comes in two forms: :meth:`MessageStore.commit`
(synchronous), or :meth:`MessageStore.begin_commit` → :meth:`CommitTicket.run` (any
thread; it only touches the file) → :meth:`MessageStore.end_commit`, so a server can
keep buffering the next batch and delivering while the disk syncs. One ticket may be
outstanding at a time; tickets complete in order. A put is durable, and its producer may
be acked, only after the commit that covers it has ended; a message is not deliverable
(:meth:`MessageStore.take`) before then. Tombstones ride along with the next commit; one
lost in a crash only means a redelivery.

States (one byte per slot): ``U`` put, not yet durable; ``P`` pending, never handed out
since open; ``Q``/``R`` waiting in the requeue deque (``R``: it was delivered before);
``F`` in flight (taken, awaiting ack/release); ``A`` acknowledged (or dropped); ``M``
moved (a copy lives elsewhere). Delivery order: the requeue deque first, then a cursor
scanning segments oldest first for ``P`` slots: FIFO apart from requeued and compacted
messages.

Segments and reclaiming disk. A commit that takes the active segment past
``segment_bytes`` starts a new one. Segments are deleted oldest first, and only when no
live message is left in them: a tombstone in a later segment may point into any earlier
one, so deleting from the middle could resurrect acked messages on replay. When a new
segment starts and the oldest one is mostly dead (live fraction at most
``compact_ratio``) and the delivery cursor has passed it, its live messages are *moved*:
copied into the new segment as ``MOVE`` records (synced at once), and the old segment is
deleted. Moved keys that callers still hold (in flight, queued) are forwarded
transparently. :meth:`MessageStore.maintain` also retires a fully acked active segment
when the store is idle.

Crash safety. Only records of a commit that had not finished can be torn: replay stops a
segment at its first short or CRC-failing record, truncates the rest away and counts it
(:attr:`StoreStats.torn_records`); a preallocated zero tail is the clean end, not
counted (details in :mod:`~zio_spark.storage.store_format`). Every open starts a fresh
segment, so nothing is ever written after a torn spot. Everything not acked by a
replayed tombstone comes back as pending: in-flight state is not persisted, so a restart
redelivers it.

Duplicates. A message whose id is in the window *with the same body* is not stored again
(:meth:`MessageStore.put` returns ``None``; the broker acks it once the original is
durable): the window keeps, per id, the digest of the newest body stored under it
(:func:`~zio_spark.storage.store_format.body_digest`), so a reused id with a new body is
stored, whatever the window or a restart, and a put refused as a duplicate is one whose
body is on disk. The window is the ids of the last ``dedup_window`` accepted messages
(default 100,000), whatever their state; ids older than that are forgotten, so a resend
that late is stored twice. Ids are global, not per producer. The window survives
restarts: ids of live segments are read back (their digests computed from the records),
and before segments are deleted the durable part of the window, digests included, is
written to ``ids.snap`` (format in :mod:`~zio_spark.storage.store_format`).

Failures. An ``OSError`` while committing leaves the on-disk state unknown (after a failed
``fsync`` Linux may drop the dirty pages), so the store turns *failed*: the puts not yet
durable are dropped and every later :meth:`MessageStore.put`/commit raises
:class:`StoreError`. Reads and acks go on in memory; restart (replay) to recover. Only
one process may open a folder (:class:`StoreLockedError`).

Pins. A caller that records store keys durably elsewhere (the queue's flow producer
port, :mod:`zio_spark.pzq.flow_ports`) takes with ``take(pin=True)``: compaction never
moves a pinned message, so its key stays valid across restarts (keys are
``segment << 32 | slot`` and replay rebuilds the same slots). After a restart such a
caller re-takes exactly those messages with :meth:`MessageStore.claim`. A pin ends with
the message's ack or release.

Threads: not thread-safe; one owner thread (the broker's). Only :meth:`CommitTicket.run`
may run elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from zio_spark.errors import ConfigError, check_count
from zio_spark.storage.files import (
    RECORD_HEAD,
    atomic_write,
    frame,
    fsync_dir,
    lock_folder,
    write_all,
)
from zio_spark.storage.store_format import (
    DEFAULT_DEDUP_WINDOW,
    DEFAULT_SEGMENT_BYTES,
    LIVE_STATES,
    MAX_BODY_BYTES,
    MAX_ID_BYTES,
    MAX_SEGMENT_BYTES,
    MAX_SLOTS,
    PART1_STRUCT,
    PUT_STRUCT,
    SNAP_NAME,
    STATE_ACKED,
    STATE_IN_FLIGHT,
    STATE_MOVED,
    STATE_PENDING,
    STATE_UNCOMMITTED,
    T_PUT,
    CommitTicket,
    LogFile,
    MessageRejected,
    StoreClosedError,
    StoredMessage,
    StoreError,
    StoreLockedError,
    StoreStats,
    ack_payload,
    body_digest,
    encode_snapshot,
    framed_record,
    message_payload,
)
from zio_spark.storage.store_index import StoreIndex
from zio_spark.storage.store_recovery import Replay

__all__ = [
    "DEFAULT_DEDUP_WINDOW",
    "DEFAULT_SEGMENT_BYTES",
    "MAX_BODY_BYTES",
    "MAX_ID_BYTES",
    "CommitTicket",
    "MessageRejected",
    "MessageStore",
    "StoreClosedError",
    "StoreError",
    "StoreLockedError",
    "StoreStats",
    "StoredMessage",
    "body_digest",
]

log = logging.getLogger(__name__)

_RECLAIM_BYTES = 1 << 20  # maintain() retires a fully acked active segment this big


class MessageStore:
    """Durable message store of the PZQ-style queue (see the module docstring).

    Opening replays the folder (creating it if needed), then starts a new segment.

    Parameters
    ----------
    path
        The store folder.
    segment_bytes
        Soft size limit of a segment file, bytes.
    dedup_window
        How many of the most recently accepted message ids are remembered to refuse
        duplicates (0 turns duplicate detection off).
    compact_ratio
        Move the oldest segment's live messages forward once at most this fraction of its
        messages is live (0 turns compaction off: only fully acked segments are deleted).
    sync
        ``fdatasync`` on commit (default). False is for tests and benchmarks only: nothing
        is then durable.
    preallocate
        Give each new segment ``segment_bytes`` up front (``posix_fallocate``), truncated
        to its records when closed (default): a commit then does not grow the file, so its
        ``fdatasync`` is cheaper (see :mod:`~zio_spark.storage.store_format`).

    Raises
    ------
    ConfigError
        For a bad option value.
    StoreLockedError
        If the folder is open in another store.
    StoreError
        If a segment has an unknown format version.
    OSError
        If the folder cannot be read or written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        dedup_window: int = DEFAULT_DEDUP_WINDOW,
        compact_ratio: float = 0.25,
        sync: bool = True,
        preallocate: bool = True,
    ) -> None:
        self._segment_bytes = check_count("segment_bytes", segment_bytes, 4096)
        if self._segment_bytes > MAX_SEGMENT_BYTES:
            raise ConfigError("segment_bytes", segment_bytes, f"at most {MAX_SEGMENT_BYTES}")
        self._window_size = check_count("dedup_window", dedup_window, 0)
        if (
            isinstance(compact_ratio, bool)
            or not isinstance(compact_ratio, (int, float))
            or not 0 <= compact_ratio < 1
        ):
            raise ConfigError("compact_ratio", compact_ratio, "a number in [0, 1)")
        self._compact_ratio = float(compact_ratio)
        self._sync = bool(sync)
        if not isinstance(preallocate, bool):
            raise ConfigError("preallocate", preallocate, "a bool (True or False)")
        self._preallocate = preallocate
        self._root = Path(path)
        self._index = StoreIndex(self._root)
        self._next_no = 1
        # Write buffer for the active segment: record pieces, first slot, puts, tombstones.
        self._buf: list[bytes] = []
        self._buf_first = 0
        self._buf_puts = 0
        self._buf_seq = 0
        self._ticket: CommitTicket | None = None
        self._ticket_seq = 0
        # Duplicate window: ids in accept order; _window_first is the seq of _window[0].
        self._last_seq = 0
        self._durable_seq = 0
        self._window: deque[bytes] = deque()
        self._window_first = 1
        self._window_ids: dict[bytes, int] = {}
        self._window_digests: dict[bytes, bytes] = {}  # id -> its newest body's digest
        self._open_seq = 0  # the last accept seq found on disk when opened
        # Counters (the index keeps messages and in-flight counts).
        self._syncs = 0
        self._commits = 0
        self._stored = 0
        self._duplicates = 0
        self._torn = 0
        self._moved = 0
        self._deleted = 0
        self._lock_fd = -1
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            self._lock_fd = lock_folder(
                self._root,
                lambda: StoreLockedError("the folder is open in another store", path=self._root),
            )
            self.queue_id: bytes = self._load_queue_id()
            """This queue's identity: random, made when the folder was created."""
            self._recover()
            self._open_seq = self._last_seq
            self._open_segment()
            self._sync_new_segment()
            self._reclaim()
        except BaseException:
            self._close_files()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _load_queue_id(self) -> bytes:
        path = self._root / "QUEUE_ID"
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text("ascii").strip()
            if text:
                return text.encode("ascii")
        value = f"pzq-{uuid.uuid4().hex[:16]}"
        atomic_write(path, (value + "\n").encode("ascii"), sync=self._sync)
        return value.encode("ascii")

    def close(self) -> None:
        """Finish the outstanding commit, commit what is buffered, close; idempotent.

        Raises
        ------
        StoreError
            If that last commit fails (the files are closed anyway).
        """
        if self._index.closed:
            return
        try:
            ticket = self._ticket
            if ticket is not None:
                ticket.run()  # no-op if another thread runs or ran it
                ticket.wait()
                self.end_commit(ticket)
            if not self._index.failed and self.dirty:
                self.commit()
            if not self._index.failed and self._index.active is not None:
                with contextlib.suppress(OSError):  # harmless: replay ends at a zero tail
                    self._index.active.seal()
        finally:
            self._index.closed = True
            self._close_files()

    def _close_files(self) -> None:
        for seg in self._index.segments.values():
            with contextlib.suppress(OSError):
                os.close(seg.fd)
        self._index.segments.clear()
        self._index.active = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        """The store folder."""
        return self._root

    @property
    def closed(self) -> bool:
        return self._index.closed

    @property
    def failed(self) -> str:
        """Why the store failed, or ``""`` while healthy."""
        return self._index.failed

    # ------------------------------------------------------------------ delivery

    def take(self, *, pin: bool = False) -> StoredMessage | None:
        """Hand out the next deliverable message and mark it in flight.

        Requeued messages come first, then never-delivered ones oldest first. Only
        durable messages are deliverable.

        Parameters
        ----------
        pin
            Keep its key valid until it is acked or released: compaction does not move
            it (see "Pins" in the module docstring).

        Returns
        -------
        StoredMessage or None
            None when nothing is deliverable.

        Raises
        ------
        StoreError
            If the store is closed, or a record cannot be read back (it is then dropped,
            and the error names it).
        """
        return self._index.take(pin=pin)

    def take_keys(self, n: int) -> list[int]:
        """Hand out up to ``n`` deliverable messages, pinned, without reading them:
        their keys, in :meth:`take`'s order (requeued first, then oldest first).

        For a caller that reads them back later with :meth:`read_taken_run`, which
        checks each record (length, CRC) before anything of it is used: the queue's
        flow producer port numbering messages for range reads. A record damaged on
        disk since the store was opened (recovery checks every record at open) is
        therefore handed out here and found by that read; :meth:`take` would have
        found and dropped it now.

        Raises
        ------
        StoreError
            If the store is closed.
        """
        return self._index.take_keys(n)

    def claim(self, key: int) -> StoredMessage | None:
        """Take one particular durable, unacked message (by key) and pin it.

        For a caller that recorded keys it had taken with ``take(pin=True)`` before a
        restart (replay brings them back as pending). It is then in flight, as if
        taken, and counts as a redelivery.

        Returns
        -------
        StoredMessage or None
            None if the key names no pending message (acked, never durable, unknown,
            or already in flight).

        Raises
        ------
        StoreError
            If the store is closed, or the record cannot be read back (it is then
            dropped).
        """
        return self._index.claim(key)

    def read_taken(self, key: int) -> StoredMessage:
        """Read an in-flight message back from disk, leaving its state alone.

        For a caller that took it with ``take(pin=True)`` (or :meth:`claim`) and keeps
        only its key, not its body: the queue's flow producer port serves range reads
        from here (the body on disk is the durable one; nothing is held in memory).

        Raises
        ------
        StoreError
            If the store is closed, ``key`` is not in flight, or its record cannot be
            read back (CRC, short read); the message itself stays as it was.
        """
        return self._index.read_taken(key)

    def read_taken_run(
        self, keys: Sequence[int], max_bytes: int | None = None
    ) -> list[StoredMessage]:
        """Read in-flight messages back from disk, in the order of ``keys``, leaving
        their state alone: :meth:`read_taken` for many at once. Records that lie close
        together in one segment (messages taken in store order) come with one ``pread``
        per run of up to :data:`~zio_spark.storage.store_index.RUN_BYTES`, and every
        record's length and CRC is checked from that buffer.

        Returns the messages of a prefix of ``keys``: all of them, or fewer when a later
        key cannot be read back (not in flight, a short read, a failing CRC: the caller
        reads on from that key and gets its error), or once the bodies read total
        ``max_bytes`` (at least one message). Nothing is ever skipped.

        Raises
        ------
        StoreError
            If the store is closed, or the *first* key cannot be read back (as
            :meth:`read_taken`); the messages stay as they were.
        """
        return self._index.read_taken_run(keys, max_bytes)

    def ack(self, key: int) -> bool:
        """Delete an in-flight message: a tombstone goes into the next commit.

        Parameters
        ----------
        key
            A key from :meth:`take`.

        Returns
        -------
        bool
            True if it was in flight; False if unknown or not in flight (nothing changes).
        """
        return self._index.ack(key)

    def release(self, key: int, *, delivered: bool = True) -> bool:
        """Put an in-flight message back at the front of the queue (nack, expiry).

        Parameters
        ----------
        key
            A key from :meth:`take`.
        delivered
            Whether the consumer really got it (False: the caller took it but never sent
            it, so its next delivery is not counted as a redelivery).

        Returns
        -------
        bool
            True if it was in flight.
        """
        return self._index.release(key, delivered=delivered)

    @property
    def messages(self) -> int:
        """Durable messages not yet acked."""
        return self._index.messages

    @property
    def in_flight(self) -> int:
        """Messages taken and not acked or released."""
        return self._index.in_flight

    @property
    def in_flight_bytes(self) -> int:
        """Stored payload bytes of the in-flight messages."""
        return self._index.in_flight_bytes

    def iter_messages(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        """(id, body) of every durable, unacked message, oldest segment first.

        Reads the disk; for tests and tools, not the hot path.
        """
        return self._index.iter_messages()

    def _check_writable(self) -> None:
        if self._index.closed:
            raise StoreClosedError("the store is closed", path=self._root)
        if self._index.failed:
            raise StoreError(f"the store failed: {self._index.failed}; restart it", path=self._root)

    def _fsync_dir(self) -> None:
        if self._sync:
            fsync_dir(self._root)

    def _recover(self) -> None:
        found = Replay(self._root, window_size=self._window_size, sync=self._sync)
        self._index.segments = found.segments
        self._index.messages = found.messages
        self._torn = found.torn
        self._next_no = found.next_no
        self._last_seq = self._durable_seq = found.last_seq
        self._window = found.window
        self._window_first = found.window_first
        self._window_ids = found.window_ids
        self._window_digests = found.window_digests
        if self._index.segments:
            self._index.cursor_no = next(iter(self._index.segments))

    # ------------------------------------------------------------------ segments

    def _open_segment(self) -> LogFile:
        """Start a new active segment (header written, not synced). Buffer must be empty."""
        old = self._index.active
        if old is not None and (self._ticket is None or self._ticket.segment is not old):
            old.seal()  # else end_commit seals it once its last commit has run
        no = self._next_no
        self._next_no += 1
        path = self._root / f"seg-{no:010d}.log"
        seg, supported = LogFile.create(no, path, self._segment_bytes if self._preallocate else 0)
        if not supported:  # the filesystem cannot: segments grow as written from now on
            log.debug("store %s: no preallocation on this filesystem", self._root)
            self._preallocate = False
        self._index.segments[no] = seg
        self._index.active = seg
        self._buf_first = 0
        if not self._index.cursor_no:
            self._index.cursor_no = no
        return seg

    def _sync_new_segment(self) -> None:
        seg = self._index.active
        assert seg is not None
        if seg.needs_sync and self._sync:
            os.fdatasync(seg.fd)
            self._fsync_dir()
            self._syncs += 1
        seg.needs_sync = False

    def _delete_segment(self, seg: LogFile) -> None:
        os.close(seg.fd)
        os.unlink(seg.path)
        del self._index.segments[seg.no]
        self._deleted += 1

    def _write_snapshot(self) -> None:
        """Write the durable part of the duplicate window to ids.snap (atomically)."""
        durable = max(0, min(len(self._window), self._durable_seq - self._window_first + 1))
        ids = list(itertools.islice(self._window, durable))
        # A digest is kept for each id's newest copy only; older copies' are unknown.
        seqs, digests = self._window_ids, self._window_digests
        known = [
            digests.get(mid, b"") if seqs.get(mid) == seq else b""
            for seq, mid in zip(itertools.count(self._window_first), ids)
        ]
        data = encode_snapshot(self._next_no, self._durable_seq, self._window_first, ids, known)
        # The caller syncs the directory after unlinking the segments.
        atomic_write(self._root / SNAP_NAME, data, sync=self._sync, sync_dir=False)

    def _reclaim(self) -> None:
        """Delete dead segments, oldest first (never the active one or one being written)."""
        busy = self._ticket.segment if self._ticket is not None else None
        doomed = []
        for seg in self._index.segments.values():
            if seg is self._index.active or seg is busy or seg.live:
                break
            doomed.append(seg)
        if not doomed:
            return
        self._write_snapshot()
        for seg in doomed:
            self._delete_segment(seg)
        self._fsync_dir()
        first = next(iter(self._index.segments))
        if self._index.cursor_no < first:
            self._index.cursor_no, self._index.cursor_slot = first, 0

    def _compact(self) -> None:
        """Move live messages of mostly dead oldest segments into the new active segment.

        Runs right after a segment start, while the new segment holds nothing else; the
        moves are synced here, so the old segments can go at once.
        """
        active = self._index.active
        assert active is not None and not self._buf and not len(active.state)
        busy = self._ticket.segment if self._ticket is not None else None
        heads = []
        for seg in self._index.segments.values():
            if (
                seg is active
                or seg is busy
                or seg.no >= self._index.cursor_no
                or seg.live > self._compact_ratio * len(seg.state)
                or seg.no in self._index.pins
            ):
                break
            heads.append(seg)
        moves = []  # (head, slot, state)
        for head in heads:
            for slot, state in enumerate(head.state):
                if state in LIVE_STATES:
                    _, seq, message_id, body = self._index.read(head, slot)
                    payload = message_payload(seq, message_id, body, head.no << 32 | slot)
                    self._append_record(active, payload, state)
                    moves.append((head, slot, state))
        if moves:
            data = b"".join(self._buf)
            write_all(active.fd, data, active.size)
            if self._sync:
                os.fdatasync(active.fd)
                self._fsync_dir()
                self._syncs += 1
            active.needs_sync = False
            active.size += len(data)
            active.durable = len(active.state)
            self._buf.clear()
            self._buf_first = len(active.state)
        for new_slot, (head, slot, state) in enumerate(moves):
            head.state[slot] = STATE_MOVED
            head.live -= 1
            if state != STATE_PENDING:  # held by a caller (in flight) or queued: forward the key
                self._index.forward[head.no << 32 | slot] = active.no << 32 | new_slot
            if state == STATE_IN_FLIGHT:  # a MOVE record is longer than the PUT it copies
                self._index.in_flight_bytes += active.lengths[new_slot] - head.lengths[slot]
        self._moved += len(moves)
        for head in heads:
            log.info("store %s: compacted segment %d into %d", self._root, head.no, active.no)

    def maintain(self) -> None:
        """Retire a fully acked active segment and delete dead ones; call when idle.

        Does nothing while a commit is outstanding or anything is buffered.

        Raises
        ------
        StoreError
            If the store failed or is closed, or the file operations fail (the store
            then turns failed).
        """
        self._check_writable()
        active = self._index.active
        assert active is not None
        if self._ticket is not None or self.dirty:
            return
        try:
            if active.live == 0 and active.end >= _RECLAIM_BYTES:
                self._open_segment()
                self._sync_new_segment()
            self._reclaim()
        except OSError as e:
            self._fail(f"segment maintenance failed: {e}")
            raise StoreError(f"segment maintenance failed: {e}", path=self._root) from e

    # ------------------------------------------------------------------ writing

    def _append_record(self, seg: LogFile, payload: bytes, state: int) -> int:
        """Buffer a PUT/MOVE record for ``seg`` (the active one); returns its slot."""
        slot = len(seg.state)
        if slot >= MAX_SLOTS - 1:
            raise StoreError("segment slot limit reached", path=self._root)
        length = len(payload)
        self._buf.append(frame(payload))
        self._buf.append(payload)
        seg.offsets.append(seg.end)
        seg.lengths.append(length)
        seg.state.append(state)
        seg.live += 1
        seg.end += RECORD_HEAD.size + length
        return slot

    def put(
        self,
        message_id: bytes,
        body: Sequence[bytes],
        *,
        dedup: bool = True,
        digest: bytes | None = None,
    ) -> int | None:
        """Buffer a message; it is durable once a commit that covers it has ended.

        Parameters
        ----------
        message_id
            The producer's id: 1 to :data:`MAX_ID_BYTES` bytes.
        body
            At least one part (parts may be empty).
        dedup
            Refuse an id in the duplicate window whose newest copy has this body
            (default); a new body under a known id is stored. False stores it whatever
            the window holds (the id still enters the window): for a caller with a
            duplicate rule of its own (the broker scopes PZQ ids by producer
            connection).
        digest
            ``body_digest(body)``, if the caller has it already (else computed here).

        Returns
        -------
        int or None
            The new store key, or None if ``dedup`` and ``message_id`` is in the
            duplicate window with the same body: nothing is stored, and the original
            is durable once the commits begun so far and the next one have ended.

        Raises
        ------
        MessageRejected
            If the id is empty or longer than :data:`MAX_ID_BYTES`, the body has no parts,
            or the message is larger than :data:`MAX_BODY_BYTES` (nothing is stored).
        StoreError
            If the store failed or is closed.
        """
        if self._index.closed or self._index.failed:
            self._check_writable()
        id_len = len(message_id)
        if not 0 < id_len <= MAX_ID_BYTES:
            raise MessageRejected(
                f"message id of {id_len} bytes; expected 1 to {MAX_ID_BYTES} bytes"
            )
        ids = self._window_ids
        windowed = self._window_size > 0
        if windowed and digest is None:
            digest = body_digest(body)
        if dedup and message_id in ids and self._window_digests.get(message_id) == digest:
            self._duplicates += 1
            return None
        seq = self._last_seq + 1
        if len(body) == 1:  # the common case, inlined
            part = body[0]
            if len(part) > MAX_BODY_BYTES:
                raise MessageRejected(
                    f"message of {len(part)} bytes exceeds the limit of {MAX_BODY_BYTES}"
                )
            payload = b"".join(
                (
                    PUT_STRUCT.pack(T_PUT, seq, id_len),
                    message_id,
                    PART1_STRUCT.pack(1, len(part)),
                    part,
                )
            )
        else:
            if not body:
                raise MessageRejected("message has no body part; expected at least one")
            size = id_len + sum(map(len, body))
            if size > MAX_BODY_BYTES:
                raise MessageRejected(
                    f"message of {size} bytes exceeds the limit of {MAX_BODY_BYTES}"
                )
            payload = message_payload(seq, message_id, body)
        active = self._index.active
        assert active is not None
        # _append_record, inlined (the hot path)
        slot = len(active.state)
        if slot >= MAX_SLOTS - 1:
            raise StoreError("segment slot limit reached", path=self._root)
        length = len(payload)
        self._buf += (frame(payload), payload)
        active.offsets.append(active.end)
        active.lengths.append(length)
        active.state.append(STATE_UNCOMMITTED)
        active.live += 1
        active.end += RECORD_HEAD.size + length
        self._last_seq = seq
        self._buf_puts += 1
        self._buf_seq = seq
        if windowed:
            assert digest is not None
            window = self._window
            window.append(message_id)
            ids[message_id] = seq
            self._window_digests[message_id] = digest
            if len(window) > self._window_size:
                old = window.popleft()
                if ids.get(old) == self._window_first:
                    del ids[old]
                    self._window_digests.pop(old, None)
                self._window_first += 1
        else:
            self._window_first = seq + 1
        return active.no << 32 | slot

    def same_body(self, message_id: bytes, digest: bytes) -> bool:
        """Whether the newest message with this id in the duplicate window has the body
        whose :func:`body_digest` is ``digest`` (False for ids not in the window or whose
        body is unknown: ids read from a version 1 ``ids.snap``)."""
        return self._window_digests.get(message_id) == digest

    def accepted_before_open(self, message_id: bytes) -> bool:
        """Whether the newest message with this id in the duplicate window was accepted
        before this store was opened (found on disk: whether its producer got its ack
        is unknown). False for ids not in the window (``dedup_window`` 0: always)."""
        seq = self._window_ids.get(message_id)
        return seq is not None and seq <= self._open_seq

    @property
    def uncommitted(self) -> int:
        """Puts not yet durable: buffered, or in the outstanding commit."""
        return self._buf_puts + (self._ticket.puts if self._ticket is not None else 0)

    @property
    def buffered_puts(self) -> int:
        """Puts buffered for the next commit."""
        return self._buf_puts

    @property
    def dirty(self) -> bool:
        """Whether anything (puts or tombstones) waits for the next commit."""
        return bool(self._buf or self._index.tombstones)

    @property
    def pending_tombstones(self) -> int:
        """Acks buffered for the next commit."""
        return len(self._index.tombstones)

    @property
    def committing(self) -> bool:
        """Whether a commit is outstanding (begun and not ended)."""
        return self._ticket is not None

    def begin_commit(self) -> CommitTicket | None:
        """Take everything buffered into a commit ticket; the buffer starts afresh.

        Run the ticket (:meth:`CommitTicket.run`, any thread), then pass it to
        :meth:`end_commit`. Starts a new segment afterwards when this commit takes the
        active one past ``segment_bytes`` (and then compacts, see the module docstring).

        Returns
        -------
        CommitTicket or None
            None when nothing is buffered.

        Raises
        ------
        StoreError
            If the store failed or is closed, a commit is already outstanding, or starting
            a segment fails (the store then turns failed).
        """
        self._check_writable()
        if self._ticket is not None:
            raise StoreError("a commit is already outstanding; end it first", path=self._root)
        if not self._buf and not self._index.tombstones:
            return None
        active = self._index.active
        assert active is not None
        if self._index.tombstones:
            keys = self._index.tombstones
            header, payload = framed_record(ack_payload(keys))
            self._buf += (header, payload)
            active.end += len(header) + len(payload)
            self._index.tombstones = []
        data = b"".join(self._buf)
        ticket = CommitTicket(
            active,
            data,
            active.end - len(data),
            self._buf_first,
            self._buf_puts,
            self._sync,
            self._root if active.needs_sync else None,
        )
        active.needs_sync = False
        self._ticket = ticket
        self._ticket_seq = self._buf_seq
        self._buf.clear()
        self._buf_first = len(active.state)
        self._buf_puts = 0
        if active.end >= self._segment_bytes:
            try:
                self._open_segment()
                if self._compact_ratio > 0:
                    self._compact()
                self._reclaim()
            except OSError as e:
                self._fail(f"starting a segment failed: {e}")
                raise StoreError(f"starting a segment failed: {e}", path=self._root) from e
        return ticket

    def end_commit(self, ticket: CommitTicket) -> int:
        """Apply a finished commit: its puts become durable and deliverable.

        Parameters
        ----------
        ticket
            The outstanding ticket, after :meth:`CommitTicket.run` returned.

        Returns
        -------
        int
            How many puts became durable.

        Raises
        ------
        StoreError
            If ``ticket`` is not the outstanding one or has not run, or writing/syncing
            failed: the store then turns failed, every put not yet durable (this ticket's
            and any buffered since) is dropped, and their producers must be told so.
        """
        if ticket is not self._ticket:
            raise StoreError("end_commit: not the outstanding commit", path=self._root)
        if not ticket.done:
            raise StoreError("end_commit: the commit has not run yet", path=self._root)
        self._ticket = None
        seg = ticket.segment
        if ticket.error is not None:
            self._fail(f"commit failed: {ticket.error}", ticket)
            raise StoreError(f"commit failed: {ticket.error}", path=self._root) from ticket.error
        seg.size += ticket.nbytes
        end = ticket.first_slot + ticket.puts
        if ticket.puts:
            state = seg.state
            state[ticket.first_slot : end] = bytes([STATE_PENDING]) * ticket.puts
            self._index.messages += ticket.puts
            self._stored += ticket.puts
        seg.durable = max(seg.durable, end)
        if self._sync:
            self._syncs += 1
        self._commits += 1
        self._durable_seq = max(self._durable_seq, self._ticket_seq)
        try:
            if seg is not self._index.active:  # the commit that ended it: it is closed now
                seg.seal()
            self._reclaim()
        except OSError as e:
            self._fail(f"closing or deleting a segment failed: {e}")
            raise StoreError(f"closing or deleting a segment failed: {e}", path=self._root) from e
        return ticket.puts

    def commit(self) -> int:
        """Write and ``fdatasync`` everything buffered, now: one sync for all of it.

        Returns
        -------
        int
            How many puts became durable (and deliverable).

        Raises
        ------
        StoreError
            As :meth:`begin_commit` and :meth:`end_commit`.
        """
        ticket = self.begin_commit()
        if ticket is None:
            return 0
        ticket.run()
        return self.end_commit(ticket)

    def _fail(self, reason: str, ticket: CommitTicket | None = None) -> None:
        """Drop every put not yet durable and refuse further writes (see module doc)."""
        log.error("store %s failed: %s", self._root, reason)
        self._index.failed = reason
        for seg in self._index.segments.values():
            for slot in range(seg.durable, len(seg.state)):
                if seg.state[slot] == STATE_UNCOMMITTED:
                    seg.state[slot] = STATE_ACKED
                    seg.live -= 1
        self._buf.clear()
        self._buf_puts = 0
        self._ticket = None

    # ------------------------------------------------------------------ stats

    def syncs(self) -> int:
        """``fdatasync`` calls made for commits (and segment starts)."""
        return self._syncs

    def db_size(self) -> int:
        """Durable bytes in the segment files."""
        return sum(seg.size for seg in self._index.segments.values())

    def stats(self) -> StoreStats:
        """A snapshot of the counters (see :class:`StoreStats`)."""
        return StoreStats(
            messages=self._index.messages,
            in_flight=self._index.in_flight,
            in_flight_bytes=self._index.in_flight_bytes,
            uncommitted=self.uncommitted,
            db_size=self.db_size(),
            segments=len(self._index.segments),
            syncs=self._syncs,
            commits=self._commits,
            stored=self._stored,
            duplicates=self._duplicates,
            torn_records=self._torn,
            moved=self._moved,
            deleted_segments=self._deleted,
            dedup_ids=len(self._window_ids),
            index_bytes=sum(seg.index_bytes() for seg in self._index.segments.values()),
            failed=self._index.failed,
        )
