"""Taking RLlib's `add` off the critical path: a background committer with a bounded queue, and the Loader source.

`BackgroundCommitter` runs each queued write on one thread, in order; `put` returns once the write is queued and
blocks (back-pressure) while `max_pending` writes wait, so a slow store slows the caller down instead of growing a
queue without bound. `flush` waits until every queued write is committed; an error in a write is raised by the next
`put`/`flush` in the caller's thread, with its original type. Writes already queued behind a failed one are dropped
(not committed) until that error has been raised; later writes are committed again.

`QueuedSource` is what the RLlib buffers hand to `ab.Loader`: samples and priority updates go to the store, `extend`
goes to the committer, so `Loader.extend` times exactly the blocking part of an add (its `insert_s`).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, StoreClosed

if TYPE_CHECKING:  # pragma: no cover
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from ..delivery.batch import SampleBatch
    from ..schema import ExperienceSchema
    from ..schema.inputs import IdsLike, ValuesLike
    from ..surface import StoreSurface


class _State:
    """Shared by the caller and the committer thread (no reference to the committer, so it can be collected)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self.busy = False
        self.stop = False
        self.error: BaseException | None = None
        self.commit_s = 0.0  # background time spent in writes since the last `take_commit_s`


def _run(st: _State) -> None:
    while True:
        with st.cond:
            while not st.queue and not st.stop:
                st.cond.wait()
            if not st.queue:  # stopped and drained
                return
            fn, args = st.queue.popleft()
            st.busy = True
            st.cond.notify_all()  # a slot is free: wake a caller blocked on back-pressure
        t0 = time.perf_counter()
        try:
            if st.error is None:  # after a failure, later writes are dropped: the caller sees the first error
                fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            exc.add_note("(raised in arrowbuf.rllib's background add)")
            with st.cond:
                st.error = exc
        finally:
            fn = args = None  # type: ignore[assignment]  # drop references to the queued data at once
            with st.cond:
                st.busy = False
                st.commit_s += time.perf_counter() - t0
                st.cond.notify_all()


class BackgroundCommitter:
    """Runs writes on a background thread, in call order, with at most `max_pending` waiting.

    Usage::

        committer = BackgroundCommitter(max_pending=2)
        blocked_s = committer.put(store.extend, batch)   # returns when queued; blocks while 2 writes wait
        committer.flush()                                # every write so far is committed (or its error raised)
        committer.close()

    Args:
        max_pending: writes that may wait in the queue (the one being committed not counted); >= 1.
    """

    def __init__(self, max_pending: int = 2) -> None:
        if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending < 1:
            raise InvalidArgument(f"max_pending must be >= 1 queued adds, got {max_pending!r}")
        self.max_pending = max_pending
        self._st = _State()
        self._thread = threading.Thread(target=_run, args=(self._st,), name="arrowbuf-rllib-add", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._st)

    def _raise_error(self) -> None:
        st = self._st
        if st.error is not None:
            err, st.error = st.error, None
            raise err

    def put(self, fn: Callable[..., object], *args: object) -> float:
        """Queue `fn(*args)`; returns the seconds spent blocked by back-pressure.

        Raises:
            StoreClosed: after `close()`.
            Exception: the error of an earlier queued write, with its original type.
        """
        st = self._st
        t0 = time.perf_counter()
        with st.cond:
            while len(st.queue) >= self.max_pending and st.error is None and not st.stop:
                st.cond.wait()
            if st.stop:
                raise StoreClosed("the RLlib buffer's background add is closed")
            self._raise_error()
            st.queue.append((fn, args))
            st.cond.notify_all()
        return time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued write is committed; raise the first error of one."""
        st = self._st
        with st.cond:
            while (st.queue or st.busy) and st.error is None:
                st.cond.wait()
            self._raise_error()

    @property
    def pending(self) -> int:
        """Writes queued or being committed now."""
        with self._st.cond:
            return len(self._st.queue) + int(self._st.busy)

    def take_commit_s(self) -> float:
        """Background seconds spent committing since the previous call."""
        with self._st.cond:
            out, self._st.commit_s = self._st.commit_s, 0.0
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop the thread; idempotent. Errors of queued writes are dropped."""
        _stop(self._st)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._finalizer.detach()


def _stop(st: _State) -> None:
    with st.cond:
        st.stop = True
        st.cond.notify_all()


class QueuedSource:
    """The source an RLlib buffer's `ab.Loader` draws from: sampling from the store, adds through the committer.

    Args:
        store: any store-like object (`sample`, `update_priorities`).
        committer: where `extend` queues its write.
        write: the function that commits one add (`write(episodes)`), called on the committer's thread.
    """

    def __init__(self, store: StoreSurface, committer: BackgroundCommitter,
                 write: Callable[[list[SingleAgentEpisode]], None]) -> None:
        self.store = store
        self.committer = committer
        self._write = write

    @property
    def schema(self) -> ExperienceSchema:
        return self.store.schema

    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None,
               **options: object) -> SampleBatch:
        return self.store.sample(n, columns, timeout=timeout, **options)

    def update_priorities(self, ids: IdsLike, priorities: ValuesLike) -> int:
        return self.store.update_priorities(ids, priorities)

    def extend(self, episodes: list[SingleAgentEpisode]) -> float:
        """Queue the add; returns the seconds blocked by back-pressure."""
        return self.committer.put(self._write, episodes)


__all__ = ["BackgroundCommitter", "QueuedSource"]
