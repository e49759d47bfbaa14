"""Server-side prefetch for learner sessions (DoExchange): batches drawn ahead by a background thread, so a session's
next request is answered from memory while the learner trains on the last one."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class Prefetcher:
    """Keeps up to `depth` sampled batches ready for a learner session, drawn by a background thread.

    Errors are never prefetched: a speculative draw that fails (an empty store, a rate limiter saying wait) is
    dropped and prefetching pauses; the next request then samples inline with its own timeout, so it waits or
    fails with an error about now, not about when the draw was made.

    Usage loop (what a session does)::

        pre = Prefetcher(draw, depth=2, stop=event)
        batch = pre.get(timeout)      # a ready batch, or one drawn now
        pre.close()
    """

    def __init__(self, draw: Callable[[float | None], Any], depth: int, stop: threading.Event) -> None:
        self._draw = draw
        self._depth = max(0, depth)
        self._stop = stop
        self._ready: deque[Any] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._paused = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if self._depth:
            self._thread = threading.Thread(target=self._run, name="arrowbuf-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._done() and (self._paused or len(self._ready) >= self._depth):
                    self._cond.wait()  # woken by get(), close() and wake() (the server closing)
                if self._done():
                    return
                self._busy = True
            try:
                batch = self._draw(None)
            except Exception:  # noqa: BLE001 - see the class docstring: errors are not prefetched
                batch = None
            with self._cond:
                self._busy = False
                if batch is None:
                    self._paused = True
                else:
                    self._ready.append(batch)
                self._cond.notify_all()

    def _done(self) -> bool:
        return self._closed or self._stop.is_set()

    def get(self, timeout: float | None) -> Any:
        with self._cond:
            while not self._ready and self._busy:
                self._cond.wait()
            if self._ready:
                batch = self._ready.popleft()
                self._cond.notify_all()
                return batch
            self._paused = False
            self._cond.notify_all()
        return self._draw(timeout)

    def wake(self) -> None:
        """Make the prefetch thread look at `stop` again (set it first)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)


__all__ = ["Prefetcher"]
