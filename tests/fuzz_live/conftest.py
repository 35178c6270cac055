"""Prints the case counts of the live and decoder fuzz runs in the terminal summary."""

from __future__ import annotations

import pytest

from tests.fuzz_live.live_fuzz_support import REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section("live fuzz / decoder fuzz case counts")
        for line in REPORT:
            terminalreporter.write_line(line)
