"""The records a producer holds until they are acknowledged, kept as columns.

A producer may hold a million records between two Spark commits, and hands them out a
DAT (a thousand records) at a time. Keeping one Python object per record costs about a
microsecond each to make and again to turn into Arrow columns, and finding "the records
from seq S" in a deque is linear in how many are held. So records are kept in *chunks*:
column lists (value, key, granule, headers) with the seq of their first record. Small
appends are merged into the last chunk, so chunks stay large and few; a lookup is a
bisection over chunk starts; a release drops whole chunks and trims the first one by an
offset. Sequence numbers are contiguous from :attr:`HeldRecords.first`.

Not thread-safe: the producer calls it under its own lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zio_spark.transport.giver import Taken

__all__ = ["HeldRecords", "Taken"]

_MERGE_BELOW = 4096  # a chunk shorter than this takes in the next append


@dataclass(slots=True)
class _Chunk:
    first: int  # seq of values[start]
    start: int  # index of the first held record (earlier ones are released)
    values: list[bytes]
    keys: list[bytes | None] | None  # None: every key is None
    granules: list[int | None] | None
    headers: list[Mapping[str, str] | None] | None
    nbytes: int = 0  # value bytes of the held records

    def __len__(self) -> int:
        return len(self.values) - self.start


def _extend(
    dst: list[object] | None, src: Sequence[object] | None, have: int, add: int
) -> list[object] | None:
    """Append column ``src`` (``add`` entries, None = all None) to ``dst`` (``have``)."""
    if src is None:
        if dst is not None:
            dst.extend([None] * add)
        return dst
    if dst is None:
        dst = [None] * have
    dst.extend(src)
    return dst


class HeldRecords:
    """Contiguously numbered records, appended at the end, released from the front."""

    def __init__(self, first: int = 1) -> None:
        self._chunks: list[_Chunk] = []
        self._starts: list[int] = []  # chunk first seqs, for bisection
        self._head = 0  # chunks before this index are released
        self._len = 0
        self._next = first  # seq the next appended record gets
        self._nbytes = 0

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        """Bytes of the values held (what a byte budget counts; keys and headers aside)."""
        return self._nbytes

    @property
    def first(self) -> int:
        """Seq of the first held record (the next to be appended if none are held)."""
        if self._len == 0:
            return self._next
        return self._chunks[self._head].first

    @property
    def next_seq(self) -> int:
        """Seq the next appended record will get."""
        return self._next

    def append(
        self,
        values: Sequence[bytes],
        keys: Sequence[bytes | None] | None = None,
        granules: Sequence[int | None] | None = None,
        headers: Sequence[Mapping[str, str] | None] | None = None,
    ) -> int:
        """Append records (columns of equal length); returns the seq of the last one."""
        n = len(values)
        if n == 0:
            return self._next - 1
        size = sum(map(len, values))
        self._nbytes += size
        last = self._chunks[-1] if self._len and self._head < len(self._chunks) else None
        if last is not None and len(last.values) < _MERGE_BELOW:
            have = len(last.values)
            last.values.extend(values)
            last.nbytes += size
            last.keys = _extend(last.keys, keys, have, n)  # type: ignore[assignment,arg-type]
            last.granules = _extend(last.granules, granules, have, n)  # type: ignore[assignment,arg-type]
            last.headers = _extend(last.headers, headers, have, n)  # type: ignore[assignment,arg-type]
        else:
            self._chunks.append(
                _Chunk(
                    self._next,
                    0,
                    list(values),
                    None if keys is None else list(keys),
                    None if granules is None else list(granules),
                    None if headers is None else list(headers),
                    size,
                )
            )
            self._starts.append(self._next)
        self._next += n
        self._len += n
        return self._next - 1

    def take(self, first: int, n: int, max_bytes: int | None = None) -> Taken | None:
        """Up to ``n`` held records from seq ``max(first, self.first)``; None if none.

        ``max_bytes``: fewer records if the held records' average value size says ``n``
        of them would pass it (at least one).
        """
        if self._len == 0 or n <= 0:
            return None
        if max_bytes is not None and self._nbytes:
            n = max(1, min(n, max_bytes * self._len // self._nbytes))
        first = max(first, self.first)
        if first >= self._next:
            return None
        i = bisect.bisect_right(self._starts, first, lo=self._head) - 1
        end = min(first + n, self._next)
        values: list[bytes] = []
        keys: list[bytes | None] = []
        granules: list[int | None] = []
        headers: list[Mapping[str, str] | None] = []
        any_key = any_granule = any_header = False
        seq = first
        while seq < end:
            c = self._chunks[i]
            a = c.start + (seq - c.first)
            b = min(len(c.values), a + (end - seq))
            values.extend(c.values[a:b])
            cnt = b - a
            if c.keys is None:
                keys.extend([None] * cnt)
            else:
                keys.extend(c.keys[a:b])
                any_key = True
            if c.granules is None:
                granules.extend([None] * cnt)
            else:
                granules.extend(c.granules[a:b])
                any_granule = True
            if c.headers is None:
                headers.extend([None] * cnt)
            else:
                headers.extend(c.headers[a:b])
                any_header = True
            seq += cnt
            i += 1
        return Taken(
            first,
            values,
            keys if any_key else None,
            granules if any_granule else None,
            headers if any_header else None,
        )

    def release(self, upto: int) -> int:
        """Forget every record with seq <= ``upto``; returns how many were released."""
        released = 0
        chunks = self._chunks
        while self._head < len(chunks) and self._len:
            c = chunks[self._head]
            held_first = c.first
            c_last = c.first + len(c) - 1
            if c_last <= upto:
                released += len(c)
                self._len -= len(c)
                self._nbytes -= c.nbytes
                chunks[self._head] = _EMPTY_CHUNK
                self._head += 1
                continue
            if held_first <= upto:
                drop = upto - held_first + 1
                size = sum(map(len, c.values[c.start : c.start + drop]))
                c.nbytes -= size
                self._nbytes -= size
                c.start += drop
                c.first += drop
                self._starts[self._head] = c.first
                released += drop
                self._len -= drop
            break
        if self._head > 64 and self._head * 2 > len(chunks):
            del chunks[: self._head]
            del self._starts[: self._head]
            self._head = 0
        if self._len == 0:
            chunks.clear()
            self._starts.clear()
            self._head = 0
            self._nbytes = 0
        return released

    def renumber(self, shift: int) -> None:
        """Add ``shift`` to every held record's seq (and to the next one's)."""
        for i in range(self._head, len(self._chunks)):
            self._chunks[i].first += shift
            self._starts[i] += shift
        self._next += shift


_EMPTY_CHUNK = _Chunk(0, 0, [], None, None, None)
