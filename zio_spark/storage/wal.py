"""The spool's write-ahead log: one file per generation, shared by all producers.

``wal/<generation:020d>.wal`` in the spool folder. A record holds one
:meth:`~zio_spark.storage.spool.Spool.append` batch::

    header  16 B  magic "ZSW1", payload length u32, CRC-32 of the payload u32, 0 u32
    payload       covers_from i64, producer id length u32, 0 u32,
                  producer id (UTF-8, zero-padded to 8 bytes),
                  one Arrow IPC record-batch message (WAL schema: SPARK_SCHEMA minus
                  ``producer``), zero-padded to 8 bytes

``covers_from`` is the producer's next expected sequence number before the append. How
the spool scans these files on open, and what it does with a torn record, is in
:mod:`zio_spark.storage.spool`. Here: the :class:`Record` tuple appends take, building
the WAL batch from records, encoding and decoding a record, and :class:`Wal`, one open
file. The underscore names are the spool modules' own.
"""

from __future__ import annotations

import array
import contextlib
import logging
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

import pyarrow as pa

from zio_spark.codec.schema import HEADERS_TYPE, WAL_SCHEMA
from zio_spark.errors import DataLossError, StorageInputError
from zio_spark.storage.spool_sealed import SEQ_WAL, increasing

__all__ = [
    "PAD",
    "WAL_RE",
    "Record",
    "Wal",
    "WalEntry",
    "WalScan",
    "build_wal_batch",
    "encode_wal_record",
    "read_entry",
]

log = logging.getLogger("zio_spark.storage.spool")

_WAL_SCHEMA: Final = WAL_SCHEMA
_WAL_MAGIC: Final = b"ZSW1"
_WAL_HEADER: Final = struct.Struct("<4sIII")  # magic, payload length, crc32, reserved
_WAL_PREFIX: Final = struct.Struct("<qII")  # covers_from, producer id length, reserved
WAL_RE: Final = re.compile(r"^(\d{20})\.wal$")
_U64: Final = 1 << 64
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
PAD: Final = bytes(8)


class Record(NamedTuple):
    """One received record. A plain tuple, so ``zip(*records)`` transposes a batch in C.

    Attributes
    ----------
    seq
        Producer sequence number: 1, 2, 3, ... per producer.
    value
        The payload (``None`` is stored as null).
    key
        Optional key.
    origin, granule
        ZIO flow-object fields, uint64 on the wire (see the module note on int64).
    timestamp_us
        Arrival time, microseconds since the Unix epoch (UTC), stamped by the receiver.
    headers
        Extra flow-object attributes, or ``None`` (stored as a null map).
    """

    seq: int
    value: bytes | None
    key: bytes | None = None
    origin: int = 0
    granule: int = 0
    timestamp_us: int = 0
    headers: Mapping[str, str] | None = None


class WalEntry(NamedTuple):
    """One append in the open tail: its WAL record, and how many of its rows are new."""

    wal: Wal
    offset: int
    rows: int


class Wal:
    """One WAL file. ``written`` changes under the spool's state lock; syncing and closing
    take ``sync_lock`` so a flush never syncs a descriptor that is being closed."""

    __slots__ = ("closed", "fd", "path", "sync_lock", "synced", "written")

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.written = 0
        self.synced = 0
        self.closed = False
        self.sync_lock = threading.Lock()

    def write(self, parts: list[Any]) -> None:
        total = sum(memoryview(p).nbytes for p in parts)
        try:
            done = os.writev(self.fd, parts)
            if done < total:  # short write: finish with the bytes left
                rest = b"".join(bytes(p) for p in parts)[done:]
                while rest:
                    rest = rest[os.write(self.fd, rest) :]
        except BaseException:
            # A partial record would hide every later one from replay: cut it off.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.written)
                os.lseek(self.fd, self.written, os.SEEK_SET)
            raise
        self.written += total

    def sync_to(self, target: int) -> None:
        with self.sync_lock:
            if self.closed or self.synced >= target:
                return
            os.fdatasync(self.fd)
            self.synced = target

    def close(self) -> None:
        with self.sync_lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


def _int64_column(values: tuple[Any, ...], name: str, type_: pa.DataType) -> pa.Array:
    try:
        data = array.array("q", values)  # the common case, in C
    except (OverflowError, TypeError):
        return _int64_column_slow(values, name, type_)
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(data)])


def _int64_column_slow(values: tuple[Any, ...], name: str, type_: pa.DataType) -> pa.Array:
    out: list[int | None] = []
    for v in values:
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise StorageInputError(f"records: {name}", v, "an int or None")
            if not _I64_MIN <= v < _U64:
                raise StorageInputError(f"records: {name}", v, "within [-2**63, 2**64)")
            if v > _I64_MAX:
                v -= _U64  # uint64 on the wire: keep the bits, as two's complement
        out.append(v)
    return pa.array(out, type_)


def build_wal_batch(cols: tuple[tuple[Any, ...], ...], n: int) -> pa.RecordBatch:
    seqs, values, keys, origins, granules, stamps, headers = cols
    seq_array = _int64_column(seqs, "seq", pa.int64())
    if seq_array.null_count:
        raise StorageInputError("records: seq", None, "an int")
    try:
        value_array = pa.array(values, pa.binary())
        key_array = (
            pa.nulls(n, pa.binary()) if keys.count(None) == n else pa.array(keys, pa.binary())
        )
        header_array = (
            pa.nulls(n, HEADERS_TYPE)
            if headers.count(None) == n
            else pa.array([None if h is None else dict(h) for h in headers], HEADERS_TYPE)
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        raise StorageInputError(
            "records", str(e), "value and key bytes, headers a str->str map"
        ) from e
    return pa.RecordBatch.from_arrays(
        [
            value_array,
            key_array,
            seq_array,
            _int64_column(origins, "origin", pa.int64()),
            _int64_column(granules, "granule", pa.int64()),
            _int64_column(stamps, "timestamp_us", pa.timestamp("us", tz="UTC")),
            header_array,
        ],
        schema=_WAL_SCHEMA,
    )


def encode_wal_record(
    wal_prefix: tuple[int, bytes], covers_from: int, batch: pa.RecordBatch
) -> list[Any]:
    """The pieces of one WAL record (``wal_prefix``: the producer id's length and padded
    bytes), for ``os.writev``."""
    id_len, id_padded = wal_prefix
    body = batch.serialize()
    pad = PAD[: -body.size % 8]
    prefix = _WAL_PREFIX.pack(covers_from, id_len, 0) + id_padded
    length = len(prefix) + body.size + len(pad)
    if length > 0xFFFF_FFFF:
        raise StorageInputError(
            "append batch", f"{length} bytes", "at most 4 GiB - 1 (one WAL record)"
        )
    crc = zlib.crc32(pad, zlib.crc32(body, zlib.crc32(prefix)))
    return [_WAL_HEADER.pack(_WAL_MAGIC, length, crc, 0), prefix, body, pad]


def read_entry(producer: str, entry: WalEntry, maps: dict[Path, pa.Buffer]) -> pa.RecordBatch:
    data = maps.get(entry.wal.path)
    if data is None:
        data = maps[entry.wal.path] = pa.memory_map(str(entry.wal.path)).read_buffer()
    record = _decode_wal_record(data, entry.offset, verify=False)
    if record is None or record[1] != producer:
        # Bytes this process wrote (or indexed on open) no longer read back: the disk or
        # the page cache lost them. Keep every WAL file; nothing is sealed past this.
        raise DataLossError(
            f"spool WAL {entry.wal.path}: record at byte {entry.offset} of producer "
            f"{producer!r} no longer reads back",
            producer=producer,
        )
    return record[3]


def _decode_wal_record(
    data: pa.Buffer, off: int, *, verify: bool = True
) -> tuple[int, str, int, pa.RecordBatch] | None:
    """The record at ``off``: ``(length, producer, covers_from, batch)``, or ``None``.

    ``None`` for anything short, with a bad magic or CRC (torn), and for a CRC-valid
    payload that does not decode into what :meth:`Spool.append` writes (a valid Arrow
    batch of :data:`WAL_SCHEMA`, non-empty, ``seq`` non-null, strictly increasing and
    ``>= covers_from >= 1``): never an exception, never a batch that could crash a reader.

    ``verify=False`` is for a record already known good: one this process wrote, or one
    the open-time scan checked (every tail entry is one or the other). Sealing reads each
    record back once; there the CRC, the full validation and the ``seq`` checks (~0.4 us
    per 100-byte record, a third of a seal, profiled) would only re-check bytes already
    checked or written from checked data. The framing, the prefix, the producer id and
    the decoding are still checked, so a record not where the index says is caught.
    """
    size = data.size
    if off < 0 or size - off < _WAL_HEADER.size:
        return None
    magic, length, crc, _ = _WAL_HEADER.unpack_from(data, off)
    start = off + _WAL_HEADER.size
    if magic != _WAL_MAGIC or start + length > size or length < _WAL_PREFIX.size:
        return None
    payload = data.slice(start, length)
    if verify and zlib.crc32(payload) != crc:
        return None
    try:
        covers_from, id_len, _ = _WAL_PREFIX.unpack_from(payload, 0)
        id_end = _WAL_PREFIX.size + id_len
        if id_end + (-id_len % 8) > length or covers_from < 1:
            return None
        producer = payload.slice(_WAL_PREFIX.size, id_len).to_pybytes().decode("utf-8")
        body = payload.slice(id_end + (-id_len % 8))
        batch = pa.ipc.read_record_batch(body, _WAL_SCHEMA)
        if verify:
            batch.validate(full=True)
    except (OSError, EOFError, ValueError, IndexError, struct.error, pa.ArrowException):
        # CRC-valid yet undecodable (pyarrow raises OSError/EOFError for a short message
        # body, ArrowInvalid for a malformed one): corrupt, handled like a torn record.
        return None
    if batch.num_rows == 0:
        return None
    if verify:
        seq = batch.column(SEQ_WAL)
        if seq.null_count or seq[0].as_py() < covers_from or not increasing(seq):
            return None
    return _WAL_HEADER.size + length, producer, covers_from, batch


def _next_wal_record(path: Path, data: pa.Buffer, off: int) -> int | None:
    """The offset of the first decodable record after ``off`` (records are 8-aligned)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = off + 8 - off % 8
        while True:
            pos = mm.find(_WAL_MAGIC, pos)
            if pos < 0:
                return None
            if pos % 8 == 0 and _decode_wal_record(data, pos) is not None:
                return pos
            pos += 1


class WalScan:
    """The records of a WAL file left by an earlier run, in file order: iterate for
    ``(offset, producer, covers_from, batch)``.

    The scan stops at a torn record (short, bad magic or CRC, undecodable) unless a valid
    record follows it: that is damage inside the file, not a write cut short, so it is
    logged as an error and the scan resumes there. :attr:`torn` counts such records.
    """

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.torn = 0

    def __iter__(self) -> Iterator[tuple[int, str, int, pa.RecordBatch]]:
        path, size = self.path, self.size
        data = pa.memory_map(str(path)).read_buffer()
        off = 0
        while off < size:
            record = _decode_wal_record(data, off)
            if record is None:
                self.torn += 1
                resume = _next_wal_record(path, data, off)
                if resume is None:  # a torn tail: the write that a crash cut short
                    log.warning(
                        "spool WAL %s: torn or corrupt record at byte %d; ignored %d bytes",
                        path,
                        off,
                        size - off,
                    )
                    break
                # Valid records follow: not a torn tail but damage inside the file. Keep
                # what follows; a producer whose records were lost in the damage gets its
                # later records skipped (covers_from above its next seq), never a hole.
                log.error(
                    "spool WAL %s: corrupt record at byte %d; %d bytes lost up to the next "
                    "valid record at byte %d (records of producers that lost data in them "
                    "are skipped and counted in wal_records_skipped)",
                    path,
                    off,
                    resume - off,
                    resume,
                )
                off = resume
                continue
            length, producer, covers_from, batch = record
            yield off, producer, covers_from, batch
            off += length
