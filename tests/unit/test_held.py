"""HeldRecords against a plain list model (hypothesis state machine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from zio_spark.source.held import HeldRecords


class HeldMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.held = HeldRecords()
        self.model: list[tuple[int, bytes, bytes | None, int | None, dict | None]] = []
        self.next = 1
        self.counter = 0

    @rule(
        n=st.integers(0, 5000),
        with_keys=st.booleans(),
        with_granules=st.booleans(),
        with_headers=st.booleans(),
    )
    def append(self, n: int, with_keys: bool, with_granules: bool, with_headers: bool) -> None:
        values = [b"v%d" % (self.counter + i) for i in range(n)]
        keys = [b"k%d" % i if i % 3 else None for i in range(n)] if with_keys else None
        granules = list(range(n)) if with_granules else None
        headers = [{"i": str(i)} for i in range(n)] if with_headers else None
        self.counter += n
        last = self.held.append(values, keys, granules, headers)
        for i in range(n):
            self.model.append(
                (
                    self.next + i,
                    values[i],
                    keys[i] if keys else None,
                    granules[i] if granules else None,
                    headers[i] if headers else None,
                )
            )
        self.next += n
        assert last == self.next - 1

    @rule(offset=st.integers(-5, 9000), n=st.integers(0, 3000))
    def take(self, offset: int, n: int) -> None:
        first = (self.model[0][0] if self.model else self.next) + offset
        got = self.held.take(first, n)
        want = [r for r in self.model if r[0] >= first][:n]
        if not want:
            assert got is None
            return
        assert got is not None
        assert got.first == want[0][0] and got.last == want[-1][0]
        assert got.values == [r[1] for r in want]
        for col, idx in ((got.keys, 2), (got.granules, 3), (got.headers, 4)):
            expected = [r[idx] for r in want]
            assert (col if col is not None else [None] * len(want)) == expected

    @rule(back=st.integers(-10, 6000))
    def release(self, back: int) -> None:
        upto = (self.model[0][0] if self.model else self.next) + back
        before = len(self.model)
        self.model = [r for r in self.model if r[0] > upto]
        assert self.held.release(upto) == before - len(self.model)

    @rule(shift=st.integers(0, 100))
    def renumber(self, shift: int) -> None:
        self.held.renumber(shift)
        self.model = [(r[0] + shift, *r[1:]) for r in self.model]
        self.next += shift

    @invariant()
    def lengths_agree(self) -> None:
        assert len(self.held) == len(self.model)
        assert self.held.next_seq == self.next
        assert self.held.first == (self.model[0][0] if self.model else self.next)
        assert self.held.nbytes == sum(len(r[1]) for r in self.model)


TestHeld = HeldMachine.TestCase
TestHeld.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_many_small_appends_stay_few_chunks_and_cheap_to_take() -> None:
    held = HeldRecords()
    for i in range(20_000):
        held.append([b"%d" % i])
    assert len(held._chunks) <= 20_000 // 4096 + 1
    got = held.take(15_000, 1000)
    assert got is not None and got.values[0] == b"14999" and len(got.values) == 1000


def test_take_with_a_byte_cap_takes_fewer_large_records_and_at_least_one():
    held = HeldRecords()
    held.append([b"x" * 100] * 5000)
    assert len(held.take(1, 4096, 4 << 20).values) == 4096  # small records: the count rules
    big = HeldRecords()
    big.append([b"y" * (1 << 20)] * 10)
    got = big.take(1, 4096, 4 << 20)
    assert (got.first, len(got.values)) == (1, 4)  # ~4 MiB of 1 MiB values
    huge = HeldRecords()
    huge.append([b"z" * (8 << 20)])
    assert len(huge.take(1, 4096, 4 << 20).values) == 1  # never zero
