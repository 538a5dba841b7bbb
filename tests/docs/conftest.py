"""The documentation tests' summary: the code blocks of the pages that were not run, and why."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    import sys

    pages = sys.modules.get("test_pages")
    skipped = getattr(pages, "SKIPPED", [])
    if skipped:
        terminalreporter.section("documentation blocks not run")
        for line in skipped:
            terminalreporter.write_line(line)
