"""The crash harness's session summary: one line (and, with ARROWBUF_TEST_CRASH_OUT, a JSON file) over every run
of the session (`crash.harness.summary`)."""

from __future__ import annotations

from crash import harness as h


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if h.RESULTS:
        terminalreporter.write_line(h.summary_line(h.summary()))
        h.write_summary()
