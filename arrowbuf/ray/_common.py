"""Generic helpers of the Ray layer: the lazy `ray` import and a daemon thread pool."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

from ..errors import require


def _ray() -> Any:
    return require("ray", "ray")


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
