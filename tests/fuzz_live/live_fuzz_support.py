"""Shared by the live fuzz tests: durations, the case-count report, frame mutations.

Durations: ``ZIO_LIVE_FUZZ_SHORT_S`` (default 3 s, the default run) and
``ZIO_LIVE_FUZZ_LONG_S`` (default 60 s, the ``fuzz``-marked runs).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest

SHORT_S = float(os.environ.get("ZIO_LIVE_FUZZ_SHORT_S", "3"))
LONG_S = float(os.environ.get("ZIO_LIVE_FUZZ_LONG_S", "60"))

REPORT: list[str] = []
"""One line per live-fuzz or decoder-fuzz run, printed in the terminal summary."""


def durations() -> list[object]:
    """``duration`` parameters: short in the default run, long under ``-m fuzz``."""
    return [
        pytest.param(SHORT_S, id="short", marks=pytest.mark.timeout(SHORT_S * 4 + 90)),
        pytest.param(
            LONG_S,
            id="long",
            marks=[pytest.mark.fuzz, pytest.mark.timeout(LONG_S * 3 + 120)],
        ),
    ]


SPECIAL_BYTES = (0x00, 0x01, 0x22, 0x7B, 0x7F, 0x80, 0xC3, 0xFF)
"""What :func:`mutate` writes over a byte: boundaries, ``"`` and ``{`` (JSON), UTF-8 lead."""


def mutate(data: bytes, rng: random.Random, special: Sequence[int] = SPECIAL_BYTES) -> bytes:
    """A few random edits: bit flips, special bytes, insertions, deletions, truncation.

    Also the mutator of ``tests/unit/test_zre_fuzz.py`` (with its own ``special``).
    """
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(5)
        pos = rng.randint(0, len(out))
        if op == 0 and pos < len(out):
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and pos < len(out):
            out[pos] = rng.choice(special)
        elif op == 2:
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del out[pos : pos + rng.randint(1, 8)]
        else:
            del out[pos:]
    return bytes(out)


def report(line: str) -> None:
    REPORT.append(line)
    print(line)
