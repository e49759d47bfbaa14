"""The placement policy interface (`Placement`: bind, step, a background thread), `Static`, and `make_placement`."""

from __future__ import annotations

import abc
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from .target import PlacementTarget


class Placement(abc.ABC):
    """Decides residency per (column, chunk) of one tiered store. Usage loop (what the store does)::

        policy.bind(target)     # once, at the end of the store's construction; starts the thread
        policy.step()           # one round: observe, plan, move (the thread calls it every `interval` seconds)
        policy.close()          # stop and join the thread (store.close() calls it)
    """

    interval: float | None = None

    def bind(self, target: PlacementTarget) -> None:
        """Serve the store whose internals `target` is (its `StoreCore`: a `PlacementTarget`).

        Raises:
            InvalidArgument: the policy already serves a store.
        """
        if getattr(self, "_target", None) is not None:
            raise InvalidArgument("a placement policy serves one store; make a new one for each store")
        self._target: PlacementTarget | None = target
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.interval is not None and target.tiered and len(target.tiers) > 1:
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop, self.interval),
                                            name=f"arrowbuf-placement-{target.name}", daemon=True)
            self._thread.start()

    def _live_target(self) -> PlacementTarget | None:
        target = getattr(self, "_target", None)
        return None if target is None or target.closed or getattr(self, "_closed", False) else target

    @abc.abstractmethod
    def step(self) -> int:
        """One round of placement; returns the number of chunks moved."""

    def explain(self) -> dict[str, Any]:
        """Per-column inputs of the last decision (for `store.placement(explain=True)`)."""
        return {}

    def close(self) -> None:
        """Stop the background thread and wait for it (a move in progress finishes first); idempotent. The store
        calls it when it closes. The policy serves no store afterwards; the store itself stays open."""
        self._closed = True
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None

    @property
    def running(self) -> bool:
        """Whether the background thread is stepping now."""
        return self._thread is not None and self._thread.is_alive()


def _run(ref: weakref.ref[Placement], stop: threading.Event, interval: float) -> None:
    """The background loop; holds the policy only weakly between rounds, so a forgotten store is collected. A round
    that took a while waits longer before the next (a quarter of one core at most, on a big store)."""
    delay = interval
    while not stop.wait(delay):
        policy = ref()
        if policy is None:
            return
        target = policy._live_target()
        if target is None:
            return
        try:
            t0 = time.perf_counter()
            policy.step()
            delay = max(interval, 3 * (time.perf_counter() - t0))
        except Exception as exc:  # keep serving from where the data is; the error is visible in explain()
            policy.last_error = repr(exc)  # type: ignore[attr-defined]
            if policy._live_target() is None:
                return
        del policy, target


class Static(Placement):
    """Never moves anything: chunks stay where the store first put them (upper tiers filled in ring order)."""

    def step(self) -> int:
        return 0
