"""Latency histograms and outcome counts of store operations and Flight verbs, kept without any dependency.

A `Timings` holds, per operation name ("extend", "sample", "consume", "update", or a Flight verb such as "DoGet"),
cumulative histogram bucket counts over fixed bounds (`BOUNDS`, seconds), the sum and count of the latencies, and
per-outcome counts (errors by kind, e.g. "ServerBusy"). `arrowbuf.observe.metrics` turns a snapshot into Prometheus
histograms at scrape time: recording costs a list append (folded into buckets in bulk).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

#: Upper bounds of the latency buckets, in seconds (the last bucket, +Inf, is implied). TransferQueue's request
#: histogram uses 0.001 .. 5.0; these cover it and reach down to the microseconds a local sample takes.
BOUNDS: tuple[float, ...] = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                             0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

F = TypeVar("F", bound=Callable[..., Any])
_clock = time.perf_counter


class Timings:
    """Latency histograms per operation (thread-safe, exact). See the module docstring.

    `record` appends the latency to a per-operation list (an atomic append under the GIL, no lock); the lists are
    folded into the bucket counts when they reach `FOLD` entries and at every `snapshot`, under a lock, by slicing
    off the entries present then (`del lst[:n]` removes those only: appends meanwhile stay for the next fold).
    """

    FOLD = 4096

    def __init__(self, bounds: tuple[float, ...] = BOUNDS) -> None:
        self.bounds = tuple(bounds)
        self._edges = np.asarray(self.bounds, dtype=np.float64)
        self._lock = threading.Lock()
        self._pending: dict[str, list[float]] = {}
        self._buckets: dict[str, np.ndarray] = {}
        self._sums: dict[str, float] = {}
        self._outcomes: dict[str, dict[str, int]] = {}

    def record(self, op: str, seconds: float, outcome: str | None = None) -> None:
        """Count one `op` that took `seconds`; `outcome`: None for success, else an error kind."""
        lst = self._pending.get(op)
        if lst is None:
            lst = self._new(op)
        lst.append(seconds)
        if outcome is not None:
            self.count(op, outcome)
        if len(lst) >= self.FOLD:
            with self._lock:
                self._fold(op)

    def _new(self, op: str) -> list[float]:
        with self._lock:
            if op not in self._pending:
                self._buckets[op] = np.zeros(len(self.bounds) + 1, dtype=np.int64)
                self._sums[op] = 0.0
                self._outcomes.setdefault(op, {})
                self._pending[op] = []
            return self._pending[op]

    def _fold(self, op: str) -> None:
        """Under the lock: move the pending latencies of `op` into its buckets."""
        lst = self._pending[op]
        n = len(lst)
        if not n:
            return
        vals = np.asarray(lst[:n], dtype=np.float64)
        del lst[:n]
        self._buckets[op] += np.bincount(np.searchsorted(self._edges, vals, side="left"),
                                         minlength=len(self.bounds) + 1)
        self._sums[op] += float(vals.sum())

    def count(self, op: str, outcome: str) -> None:
        """Count an outcome of `op` (an error kind)."""
        with self._lock:
            o = self._outcomes.setdefault(op, {})
            o[outcome] = o.get(outcome, 0) + 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per operation: `buckets` (per-bucket counts, the last one +Inf), `sum` (seconds), `count`, `outcomes`."""
        with self._lock:
            for op in list(self._pending):
                self._fold(op)
            empty = np.zeros(len(self.bounds) + 1, dtype=np.int64)
            ops = set(self._buckets) | set(self._outcomes)
            return {op: {"buckets": self._buckets.get(op, empty).tolist(), "sum": self._sums.get(op, 0.0),
                         "count": int(self._buckets.get(op, empty).sum()),
                         "outcomes": dict(self._outcomes.get(op, {}))} for op in ops}


def timed(op: str) -> Callable[[F], F]:
    """Decorator of a method of an object with a `timings` attribute (a `Timings` or None): records the call's
    latency under `op`, and the exception's class name as its outcome when it raises.

    A successful call costs two clock reads and a list append (`Timings.record`, inlined: no method call); the
    first call of an operation, every `FOLD`-th and a failed one go through `record`."""
    fold = Timings.FOLD

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = self.timings
            if t is None:
                return fn(self, *args, **kwargs)
            t0 = _clock()
            try:
                out = fn(self, *args, **kwargs)
            except BaseException as exc:
                t.record(op, _clock() - t0, type(exc).__name__)
                raise
            dt = _clock() - t0
            lst = t._pending.get(op)  # (this module's own class)
            if lst is not None and len(lst) < fold - 1:
                lst.append(dt)
            else:
                t.record(op, dt)
            return out

        return inner  # type: ignore[return-value]

    return wrap
