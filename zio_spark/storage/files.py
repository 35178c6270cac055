"""File helpers every durable folder of zio-spark shares, written once.

- :func:`fsync_dir`, :func:`fsync_file`: make a directory entry or a file's data durable;
- :func:`write_all`: ``os.write`` until every byte is written (a short write is rare: a
  signal or a full disk part way);
- :func:`lock_folder`: one process per folder, an ``flock`` on ``<folder>/LOCK`` (the
  kernel drops it when the process dies), with the caller's error when it is taken;
- :func:`atomic_write`: a whole file replaced at once: written to a temporary name,
  synced, renamed over the target, and the folder synced, so a crash leaves the old or
  the new content, never a mix;
- CRC-framed log records (:data:`RECORD_HEAD`, :func:`frame`, :func:`read_record`): each
  record is ``length u32, crc32 u32`` (little endian) then ``length`` bytes of payload,
  the CRC covering the payload. A log is read record by record up to the first short or
  CRC-failing one, which only a write cut short (or damaged) can leave. A zero length is
  never a record (crc32 of nothing is 0, so zeroes would pass the CRC): callers' payloads
  hold at least a type byte. :func:`is_torn_tail` tells a write cut short at a log's
  end (cut off on open) from damage before it (an error).

Users: the spool (:mod:`zio_spark.storage.spool`), the PZQ store
(:mod:`zio_spark.storage.store`), and above this layer the sink's consumer and the
source's receiver. No zmq, no pyspark.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = [
    "RECORD_HEAD",
    "atomic_write",
    "frame",
    "fsync_dir",
    "fsync_file",
    "is_torn_tail",
    "lock_folder",
    "read_record",
    "write_all",
]

RECORD_HEAD: Final = struct.Struct("<II")
"""A log record's header: payload length u32, crc32 of the payload u32 (little endian)."""


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` the directory ``path``: entries created, renamed or removed are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file ``path`` (its data and metadata)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    """Write every byte of ``data`` to ``fd``: at its position (or its end with
    O_APPEND), or with ``pwrite`` at ``offset`` when given."""
    n = os.write(fd, data) if offset is None else os.pwrite(fd, data, offset)
    if n < len(data):  # rare: a signal or a full disk part way
        view = memoryview(data)[n:]
        while view:
            if offset is None:
                n = os.write(fd, view)
            else:
                n = os.pwrite(fd, view, offset + len(data) - len(view))
            view = view[n:]


def lock_folder(folder: str | os.PathLike[str], taken: Callable[[], Exception]) -> int:
    """Take the folder's lock (``flock`` on ``<folder>/LOCK``, created if missing).

    Returns the lock file's descriptor: the lock lasts until it is closed (or the process
    ends). ``taken()`` makes the error raised when another descriptor holds it.

    Raises
    ------
    Exception
        ``taken()``, when the lock is held elsewhere (this or another process).
    OSError
        If the lock file cannot be opened or locked for another reason.
    """
    fd = os.open(Path(folder) / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise taken() from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    sync: bool,
    sync_dir: bool = True,
    tmp: str | os.PathLike[str] | None = None,
) -> None:
    """Replace ``path`` by a file holding ``data``, atomically.

    Written to ``tmp`` (default ``.<name>.tmp`` beside ``path``), synced (``fdatasync``)
    when ``sync``, renamed over ``path``, then the folder synced when ``sync`` and
    ``sync_dir`` (False: the caller syncs the folder itself, after more changes).
    """
    target = Path(path)
    temp = target.with_name(f".{target.name}.tmp") if tmp is None else Path(tmp)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    os.replace(temp, target)
    if sync and sync_dir:
        fsync_dir(target.parent)


def frame(payload: bytes) -> bytes:
    """The header of a log record holding ``payload`` (write it, then the payload)."""
    return RECORD_HEAD.pack(len(payload), zlib.crc32(payload))


def read_record(data: bytes | mmap.mmap, pos: int, size: int) -> tuple[bytes, int] | str:
    """The log record at ``pos`` of ``data`` (``size`` bytes readable): its payload and
    the offset after it; or, when there is no whole valid record there, why not.

    The problem names what is wrong (short header, a length running past the end or
    zero, a CRC mismatch); a caller stops its log there. Slices of an ``mmap`` are
    copies, so no buffer export outlives the map.
    """
    if pos + RECORD_HEAD.size > size:
        return "short record header"
    length, crc = RECORD_HEAD.unpack_from(data, pos)
    start = pos + RECORD_HEAD.size
    end = start + length
    if length == 0 or end > size:
        return f"record length {length} runs past the end"
    payload: bytes = data[start:end]
    if zlib.crc32(payload) != crc:
        return "CRC mismatch"
    return payload, end


def is_torn_tail(data: bytes, pos: int) -> bool:
    """Whether the bad log record at ``pos`` of ``data`` (the whole file) is a torn last
    append: a header cut short, a length running past the end, a CRC failing on the very
    last record, or only zeroes left (space a file system allocated before a crash). Any
    other bad record is damage, not a write cut short."""
    size = len(data)
    if pos + RECORD_HEAD.size > size or not data[pos:].strip(b"\0"):
        return True
    length: int = RECORD_HEAD.unpack_from(data, pos)[0]
    return length > 0 and pos + RECORD_HEAD.size + length >= size
