"""The chaos scenarios' ledger lines, printed again at the end of the run."""

from __future__ import annotations

import pytest

from tests.chaos.ledger import LEDGER_LINES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per scenario that got as far as counting its ledger."""
    if LEDGER_LINES:
        terminalreporter.section("chaos ledger")
        for line in LEDGER_LINES:
            terminalreporter.write_line(line)
