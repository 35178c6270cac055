"""The PZQ queue's flow side log: which store message each flow seq was given as.

The queue's flow producer port (:mod:`zio_spark.pzq.flow_ports`) takes messages from
the store for a zio-spark taker and numbers them 1, 2, 3, ...; :class:`FlowLog` keeps
``seq -> store key`` durable (``flow-producer.log`` in the store folder) before any DAT
carrying them is sent, and the highest seq the taker acknowledged, so a restarted queue
gives a resuming taker exactly what it lacks. Records: ``BASE`` (next seq, acked; first
and only first), ``ASSIGN`` (first seq, count, the keys), ``ACKED``, ``NEXT`` (a jump:
the taker was ahead), ``INCARNATION``, each CRC-framed (:mod:`zio_spark.storage.files`).
No zmq.

The *incarnation* (docs/direct-read.md) names this log's numbering: under it, a seq
names one store message, forever. It is drawn when the log is made (a new or an empty
file: numbering starts at 1 again) and written right after ``BASE``, in the same commit;
every replay and :meth:`FlowLog.rewrite` keeps it, so it lives exactly as long as the
numbering does. A log from before incarnations were written (``BASE`` without one) gets
one at its first open: its numbering is kept from there on.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Final

from zio_spark.errors import CorruptRecordError, LocalProtocolError
from zio_spark.protocol.ranges import check_incarnation, new_incarnation
from zio_spark.storage.files import atomic_write, frame, read_record, write_all

__all__ = ["FlowLog"]

log = logging.getLogger("zio_spark.pzq")

# Side log records are CRC-framed (:func:`~zio_spark.storage.files.frame`); the
# payload's first byte is the type. A file starts with BASE.
_BASE: Final = struct.Struct("<BQQ")  # type 0, next seq, acked
_ASSIGN: Final = struct.Struct("<BQI")  # type 1, first seq, count; then count u64 keys
_ACKED: Final = struct.Struct("<BQ")  # type 2, acked
_NEXT: Final = struct.Struct("<BQ")  # type 3, next seq (a jump: the taker was ahead)
# type 4, then the incarnation (ASCII, 1..64 of A-Z a-z 0-9 . _ -)
_T_BASE, _T_ASSIGN, _T_ACKED, _T_NEXT, _T_INCARNATION = 0, 1, 2, 3, 4


def _incarnation_payload(name: str) -> bytes:
    return bytes((_T_INCARNATION,)) + name.encode("ascii")


class FlowLog:
    """The flow producer port's durable ``seq -> store key`` assignments.

    Append-only, group-committed (:meth:`commit`: one write and one ``fdatasync``),
    rewritten to its live part by :meth:`rewrite`. Replay stops at the first torn or
    corrupt record and cuts the file there (only a commit that never finished can leave
    one, and nothing of it was acted upon).

    Parameters
    ----------
    path
        The log file (created if missing).
    sync
        ``fdatasync`` on commit (False: tests and benchmarks only).

    Attributes
    ----------
    next_seq, acked
        From the replay: the next sequence number to assign, the highest acknowledged.
    assigned
        From the replay: ``{seq: store key}`` of every assignment still in the file
        (acknowledged ones included, until a rewrite drops them).
    incarnation
        The name of this log's numbering (module docstring): the replayed one, or a
        fresh one (durable on return) for a new, empty or pre-incarnation log.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True) -> None:
        self.path = Path(path)
        self._sync = sync
        self.next_seq = 1
        self.acked = 0
        self.assigned: dict[int, int] = {}
        self.incarnation = ""
        self.torn = 0
        self._buf: list[bytes] = []
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            self.size = self._replay()
            if self.size == 0:
                self._append(_BASE.pack(_T_BASE, 1, 0))
            if not self.incarnation:
                self.incarnation = new_incarnation(os.urandom(16))
                self._append(_incarnation_payload(self.incarnation))
            self.commit()
        except BaseException:
            os.close(self._fd)
            raise

    def _replay(self) -> int:
        data = b""
        size = os.fstat(self._fd).st_size
        if size:
            data = os.pread(self._fd, size, 0)
        pos = good = 0
        while pos < len(data):
            got = read_record(data, pos, len(data))
            if isinstance(got, str):
                break
            payload, end = got
            try:
                self._apply(payload, first=pos == 0)
            except (struct.error, CorruptRecordError):
                break
            pos = good = end
        if good != len(data):
            self.torn += 1
            log.warning(
                "flow log %s: torn or corrupt record at byte %d of %d; truncating",
                self.path,
                good,
                len(data),
            )
            os.ftruncate(self._fd, good)
            if self._sync:
                os.fsync(self._fd)
        return good

    def _apply(self, payload: bytes, *, first: bool) -> None:
        kind = payload[0]
        if first != (kind == _T_BASE):
            raise CorruptRecordError("BASE must come first, and only first", path=self.path)
        if kind == _T_BASE:
            _, self.next_seq, self.acked = _BASE.unpack(payload)
        elif kind == _T_ASSIGN:
            _, seq, count = _ASSIGN.unpack_from(payload, 0)
            if len(payload) != _ASSIGN.size + 8 * count:
                raise CorruptRecordError(
                    f"ASSIGN of {count} keys is {len(payload)} bytes", path=self.path
                )
            keys = struct.unpack_from(f"<{count}Q", payload, _ASSIGN.size)
            for i, key in enumerate(keys):
                self.assigned[seq + i] = key
            self.next_seq = max(self.next_seq, seq + count)
        elif kind == _T_ACKED:
            self.acked = max(self.acked, _ACKED.unpack(payload)[1])
        elif kind == _T_NEXT:
            self.next_seq = max(self.next_seq, _NEXT.unpack(payload)[1])
        elif kind == _T_INCARNATION:
            name = payload[1:].decode("ascii", "replace")
            try:
                self.incarnation = check_incarnation(name)
            except LocalProtocolError as e:
                raise CorruptRecordError(f"INCARNATION {name!r}: {e}", path=self.path) from e
        else:
            raise CorruptRecordError(f"unknown record type {kind}", path=self.path)

    def _append(self, payload: bytes) -> None:
        self._buf += (frame(payload), payload)

    def assign(self, first_seq: int, keys: list[int]) -> None:
        """Buffer the assignment of ``keys`` to ``first_seq, first_seq + 1, ...``."""
        self._append(
            _ASSIGN.pack(_T_ASSIGN, first_seq, len(keys)) + struct.pack(f"<{len(keys)}Q", *keys)
        )

    def ack(self, acked: int) -> None:
        """Buffer "everything up to ``acked`` is acknowledged"."""
        self._append(_ACKED.pack(_T_ACKED, acked))

    def jump(self, next_seq: int) -> None:
        """Buffer "the next sequence number is at least ``next_seq``"."""
        self._append(_NEXT.pack(_T_NEXT, next_seq))

    @property
    def dirty(self) -> bool:
        return bool(self._buf)

    def commit(self) -> None:
        """Write what is buffered with one ``write`` and one ``fdatasync``.

        Raises
        ------
        OSError
            If writing or syncing fails (the caller must not act on the records).
        """
        if not self._buf:
            return
        data = b"".join(self._buf)
        self._buf.clear()
        write_all(self._fd, data)
        if self._sync:
            os.fdatasync(self._fd)
        self.size += len(data)

    def rewrite(self, next_seq: int, acked: int, live: list[tuple[int, int]]) -> None:
        """Replace the file by BASE + the live assignments ``[(seq, key), ...]``.

        ``live`` must be sorted by seq; gaps are written as runs of their own. Written to
        a temporary name, synced and renamed, so a crash leaves the old or the new file.
        """
        parts = [_BASE.pack(_T_BASE, next_seq, acked), _incarnation_payload(self.incarnation)]
        run: list[int] = []
        run_first = 0
        for seq, key in live:
            if run and seq != run_first + len(run):
                parts.append(_ASSIGN.pack(_T_ASSIGN, run_first, len(run)))
                parts[-1] += struct.pack(f"<{len(run)}Q", *run)
                run = []
            if not run:
                run_first = seq
            run.append(key)
        if run:
            parts.append(
                _ASSIGN.pack(_T_ASSIGN, run_first, len(run)) + struct.pack(f"<{len(run)}Q", *run)
            )
        data = b"".join(frame(p) + p for p in parts)
        atomic_write(self.path, data, sync=self._sync)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        self._buf.clear()
        self.size = len(data)

    def close(self) -> None:
        """Commit what is buffered and close; idempotent."""
        if self._fd < 0:
            return
        try:
            self.commit()
        finally:
            os.close(self._fd)
            self._fd = -1
