"""Concurrency limits of the Flight server: how many calls of each kind may run at once.

gRPC gives every call its own thread and pyarrow exposes no cap on them, so the server counts the calls its
handlers are running and refuses one more past a limit at once, with `ResourceExhausted` (RESOURCE_EXHAUSTED on the
wire), instead of letting threads and their buffers pile up. Nothing is queued: a refused client retries later.

Usage loop (what a handler does)::

    gate = CallGate({"call": 64, "sql": 2})
    with gate.enter("call"), gate.enter("sql"):
        ...                                  # the work
    gate.wait_idle(timeout=5.0)              # True once no call runs (tests, shutdown)
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

from ..errors import InvalidArgument, ResourceExhausted

#: What each kind of call is, for error messages.
KINDS = {
    "call": "calls (all verbs; streams count until their handler returns)",
    "sql": "sql queries",
    "table": "table streams",
}


class CallGate:
    """Counts running calls per kind and refuses one past its limit (see the module docstring)."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        for kind, limit in limits.items():
            if kind not in KINDS:
                raise InvalidArgument(f"unknown call kind {kind!r}; expected one of {sorted(KINDS)}")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise InvalidArgument(f"the limit of {KINDS[kind]} must be a positive integer, got {limit!r}")
        self.limits = dict(limits)
        self._running = dict.fromkeys(self.limits, 0)
        self._cond = threading.Condition()

    @contextmanager
    def enter(self, kind: str) -> Iterator[None]:
        """Count one call of `kind` while the block runs; `ResourceExhausted` when the limit is reached."""
        self.acquire(kind)
        try:
            yield
        finally:
            self.release(kind)

    def acquire(self, kind: str) -> None:
        """Take a slot of `kind` (pair it with `release`); `ResourceExhausted` when none is free."""
        with self._cond:
            limit = self.limits[kind]
            if self._running[kind] >= limit:
                raise ResourceExhausted(f"this server runs {limit} {KINDS[kind]} at most and all are busy; "
                                        "retry later")
            self._running[kind] += 1
            self._cond.notify_all()

    def release(self, kind: str) -> None:
        with self._cond:
            self._running[kind] -= 1
            self._cond.notify_all()

    def running(self) -> dict[str, int]:
        """Calls running now, per kind."""
        with self._cond:
            return dict(self._running)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no call of any kind runs; False if `timeout` seconds passed first."""
        return self.wait_for(lambda running: not any(running.values()), timeout)

    def wait_for(self, predicate: Callable[[dict[str, int]], bool], timeout: float | None = None) -> bool:
        """Block until `predicate(running calls per kind)` holds; False if `timeout` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not predicate(self._running):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True


__all__ = ["CallGate", "KINDS"]
