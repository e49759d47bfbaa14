"""Fault points: named places in the checkpoint and journal code where a crash test makes the process stop dead.

The library never reads the environment for them: a test installs a hook in the process it means to crash, and the
code calls `reached(name)` at each point (a no-op without a hook). Points: "after_chunk", "before_manifest",
"before_commit", "manifest_tmp", "after_commit" (`arrowbuf.persist.checkpoint`), "before_batch_record" (a durable
store's writer, after it reserved a batch's seqs and before the batch's journal record).

Usage (in the child process of a crash test)::

    from arrowbuf.persist import faults
    faults.install(faults.kill_at("before_commit"))   # SIGKILL this process when the point is reached
    store.checkpoint(path)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

_hook: Callable[[str], None] | None = None


def install(hook: Callable[[str], None] | None) -> None:
    """Call `hook(point)` at every fault point from now on (None: none)."""
    global _hook
    _hook = hook


def reached(point: str) -> None:
    """The code is at fault point `point`."""
    hook = _hook
    if hook is not None:
        hook(point)


def kill_at(point: str) -> Callable[[str], None]:
    """A hook that SIGKILLs this process at fault point `point`."""

    def hook(name: str) -> None:
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
