"""A pytest plugin for the generated TorchRL suite: a per-test time limit and a JSON-lines report that pairs each
`ArrowbufStorage` test with its `LazyTensorStorage` twin.

    pytest -p report_plugin --ab-report=out.jsonl --ab-timeout=60 rb/test_storages.py

Each line: {"nodeid", "twin" (the nodeid with ArrowbufStorage named LazyTensorStorage), "storage" ("ArrowbufStorage",
"LazyTensorStorage" or null), "outcome" ("passed", "failed", "skipped", "timeout"), "message"}. A line is written
and flushed when a test ends, so a run killed from outside still reports every test that ended.

With --ab-sum-trees, TorchRL's `PrioritizedSampler` runs on arrowbuf's sum trees (`use_arrowbuf_sum_trees`) for
every storage, so the prioritized tests that need TorchRL's C++ extension (which does not load against torch 2.13)
run too.

With --ab-only=FILE, only the tests whose node ids FILE lists (one per line) run.

With --ab-shard=I/N, only shard I of N runs: the tests whose twin id hashes to I (a test and its twin always share a
shard, so each shard's report compares them on its own); the project's suite runs the shards side by side.

A test that runs past --ab-timeout seconds (a phase: setup, call or teardown) is interrupted by SIGALRM and reported
as "timeout"; TorchRL's waits (queues, joins, locks) are interruptible, so a hang becomes a failure, not a stuck run.
"""

from __future__ import annotations

import functools
import json
import pathlib
import signal
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

OURS, PEER = "ArrowbufStorage", "LazyTensorStorage"


class PhaseTimeout(BaseException):
    """A test phase ran past --ab-timeout (a BaseException so that `except Exception` in a test cannot swallow it)."""


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--ab-report", default=None, help="write the JSON-lines report here")
    parser.addoption("--ab-timeout", type=float, default=60.0, help="seconds per test phase")
    parser.addoption("--ab-sum-trees", action="store_true",
                     help="give TorchRL's PrioritizedSampler arrowbuf's sum trees (its C++ ones do not load here)")
    parser.addoption("--ab-shard", default=None, help="I/N: run shard I (0-based) of N (by the twin id's hash)")
    parser.addoption("--ab-only", default=None, help="a file of node ids, one per line: run only these")


def pytest_make_parametrize_id(config: Any, val: Any, argname: str) -> str | None:
    # functools.partial(LazyTensorStorage, 1000) would get a positional id ("storage1"), which shifts when a value is
    # added before it; name it after what it calls instead so that twins get twin ids
    if isinstance(val, functools.partial) and isinstance(getattr(val.func, "__name__", None), str):
        return f"partial({val.func.__name__})"
    return None


def _storage(nodeid: str) -> str | None:
    if OURS in nodeid:
        return OURS
    if PEER in nodeid:
        return PEER
    return None


class _Report:
    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (closed at session end)
        self.outcome: dict[str, str] = {}
        self.message: dict[str, str] = {}

    def log(self, report: Any) -> None:
        nid = report.nodeid
        if report.failed:
            if self.outcome.get(nid) != "timeout":
                crash = getattr(report.longrepr, "reprcrash", None)
                msg = crash.message if crash is not None else str(report.longrepr)[-500:]
                timed_out = "PhaseTimeout" in msg or "PhaseTimeout" in str(report.longrepr)[-2000:]
                self.outcome[nid] = "timeout" if timed_out else "failed"
                self.message[nid] = msg.splitlines()[0][:300] if msg else ""
        elif report.skipped and nid not in self.outcome:
            self.outcome[nid] = "skipped"
            self.message[nid] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        elif report.when == "call" and nid not in self.outcome:
            self.outcome[nid] = "passed"

    def finish(self, nid: str) -> None:
        if self.file is None:
            return
        line = {"nodeid": nid, "twin": nid.replace(OURS, PEER), "storage": _storage(nid),
                "outcome": self.outcome.get(nid, "failed"), "message": self.message.get(nid, "")}
        self.file.write(json.dumps(line) + "\n")


_report: _Report | None = None


def shard_of(nodeid: str, shards: int) -> int:
    """The shard of a test: its twin id's hash (stable across processes and runs)."""
    return zlib.crc32(nodeid.replace(OURS, PEER).encode()) % shards


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    shard, only = config.getoption("--ab-shard"), config.getoption("--ab-only")
    if not shard and not only:
        return
    wanted = set(pathlib.Path(only).read_text().splitlines()) if only else None
    i, n = (int(x) for x in shard.split("/")) if shard else (0, 1)

    def kept(item: Any) -> bool:
        return shard_of(item.nodeid, n) == i and (wanted is None or item.nodeid in wanted)

    keep = [it for it in items if kept(it)]
    dropped = [it for it in items if not kept(it)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_configure(config: Any) -> None:
    global _report
    _report = _Report(config.getoption("--ab-report"))
    if config.getoption("--ab-sum-trees"):
        from arrowbuf.compat.torchrl import use_arrowbuf_sum_trees

        use_arrowbuf_sum_trees()


def pytest_unconfigure(config: Any) -> None:
    if _report is not None and _report.file is not None:
        _report.file.close()


def pytest_runtest_logreport(report: Any) -> None:
    if _report is not None:
        _report.log(report)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if _report is not None:
        _report.finish(nodeid)


def _on_alarm(signum: int, frame: Any) -> None:
    raise PhaseTimeout("the test phase ran past --ab-timeout")


def _limited(item: Any) -> Iterator[None]:
    seconds = float(item.config.getoption("--ab-timeout"))
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: Any) -> Iterator[None]:
    yield from _limited(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    yield from _limited(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: Any) -> Iterator[None]:
    yield from _limited(item)
