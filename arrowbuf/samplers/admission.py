"""Oldest-first admission under a version window: stale rollouts wait in line instead of being thrown away.

`consume(task, n, admission="oldest")` (issue 28, the field's ask from tinker-cookbook PR #822): discarding rollouts
that went stale biases training toward the problems that finish fast, because the slow ones are the ones that go
stale. Under this admission mode a consume

- delivers the *oldest eligible* rows first: ordered by `policy_version`, then by id (seq); a group (a `Group`
  sampler) is ordered by its oldest row and delivered whole;
- takes only rows inside the version window `[policy_version - k, policy_version]`, where `k` is the call's
  `max_staleness` or else the store's (no lower bound when neither is set);
- holds back, never discards, the rows outside it: rows *ahead* of the store's `policy_version` (written under a
  newer policy than the consumer's) wait for the version to catch up; rows *behind* the window stay unconsumed for
  the task, so a later call with a wider window (or none) still gets them. They keep holding eviction like any
  unconsumed row, except that a store made with `max_staleness=` may evict them when its ring needs the space: only
  then are they counted as dropped (`stats()["stale_dropped_by_task"]`);
- counts, per task (`stats()["admission"][task]`): `admitted` (rows delivered by oldest-first consumes), `waiting`
  (= `waiting_ahead` + `waiting_stale`: live rows the task has not consumed that its window holds back now) and
  `dropped` (rows dropped as stale for the task). `waiting` is computed when `stats()` is called, against the
  current `policy_version` and the window of the task's last oldest-first consume.

The functions here are pure: the tracker (`arrowbuf.engine.consume.ConsumeTracker`) selects candidate rows and
groups as for any consume, then asks `admit` which of them may go, in which order; `waiting` counts what waits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgument

#: The admission modes `consume(admission=...)` takes: None (rows in arrival order, stale ones dropped with
#: `max_staleness`) or "oldest" (this module).
ADMISSIONS = ("oldest",)
#: How a task's window is kept in its per-task ints (`consume_state.TASK_INTS["window"]`): 0 = the task never
#: consumed oldest-first, 1 = no lower bound, k + 2 = `max_staleness` k.
_NEVER, _UNBOUNDED = 0, 1


def check_admission(value: Any) -> str | None:
    """The admission mode a consume asked for, checked.

    Raises:
        InvalidArgument: not None nor one of `ADMISSIONS`.
    """
    if value is None or (isinstance(value, str) and value in ADMISSIONS):
        return value
    raise InvalidArgument(f"consume: admission must be None (arrival order) or one of {list(ADMISSIONS)}, "
                          f"got {value!r:.80}")


def admit(units: np.ndarray, versions: np.ndarray, policy_version: int, k: int | None) -> np.ndarray:
    """The units (rows or whole groups) that may be delivered now, oldest first.

    Args:
        units: int64 [units, size] seqs, one unit per line (size 1 for rows), each line in seq order.
        versions: the `policy_version` of each seq in `units` (same shape).
        policy_version: the store's current policy version.
        k: the window's width (`max_staleness`), or None for no lower bound.

    Returns:
        The eligible units (every row inside `[policy_version - k, policy_version]`), sorted by their oldest
        row's version, then their first seq. A unit with any row outside the window waits whole.
    """
    if not len(units):
        return units
    versions = np.asarray(versions, dtype=np.int64).reshape(units.shape)
    ok = (versions <= policy_version).all(axis=1)
    if k is not None:
        ok &= (versions >= policy_version - k).all(axis=1)
    units, oldest = units[ok], versions[ok].min(axis=1)
    order = np.lexsort((units[:, 0], oldest))  # last key first: version, then seq
    return units[order]


def encode_window(k: int | None) -> int:
    """A window as kept in a task's ints (shared memory for a shared store)."""
    return _UNBOUNDED if k is None else int(k) + 2


def waiting(versions: np.ndarray, policy_version: int, window: int) -> dict[str, int]:
    """What a task's window holds back now, among the live rows it has not consumed (their `versions`).

    Args:
        versions: `policy_version` of each live row the task has not consumed (rows in flight excluded).
        policy_version: the store's current policy version.
        window: the task's window as `encode_window` kept it (0: the task never consumed oldest-first, so
            nothing waits on a window).

    Returns:
        {"waiting", "waiting_ahead", "waiting_stale"} row counts.
    """
    if window == _NEVER or not len(versions):
        return {"waiting": 0, "waiting_ahead": 0, "waiting_stale": 0}
    ahead = int(np.count_nonzero(versions > policy_version))
    stale = 0 if window == _UNBOUNDED else int(np.count_nonzero(versions < policy_version - (window - 2)))
    return {"waiting": ahead + stale, "waiting_ahead": ahead, "waiting_stale": stale}


__all__ = ["ADMISSIONS", "admit", "check_admission", "encode_window", "waiting"]
