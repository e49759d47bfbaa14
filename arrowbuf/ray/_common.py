"""Generic helpers of the Ray layer: the lazy `ray` import, a daemon thread pool and one step as a batch."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

import numpy as np

from ..errors import require


def _ray() -> Any:
    return require("ray", "ray")


def step_batch(step: dict[str, Any]) -> dict[str, Any]:
    """One step (`append`'s dict) as a batch of one row for `extend`: arrays and tensors get a leading dimension,
    any other value becomes a one-element list. (`np.asarray` of every value would turn a JSON list such as
    `[7, "x"]` into an array of strings, and refuses bfloat16 tensors.)"""
    out: dict[str, Any] = {}
    for k, v in step.items():
        if isinstance(v, np.ndarray) or type(v).__module__.startswith("torch"):
            out[k] = v[None]
        else:
            out[k] = [v]
    return out


class _DaemonPool:
    """A small thread pool of daemon threads returning `concurrent.futures.Future`s.

    Daemon threads: a call stuck on a hung shard must never keep a learner's process from exiting (the standard
    executor joins its threads at exit).
    """

    def __init__(self, workers: int, name: str) -> None:
        import queue

        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(exc)

    def submit(self, fn: Any, *args: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
