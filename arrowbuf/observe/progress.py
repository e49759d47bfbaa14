"""Per-task progress of a store, computed from its internals when asked (a scrape, the inspector), never on the
data path.

For each declared task, over the live rows: `ready` (sampleable, not consumed by the task, every field filled later
written), `waiting` (not consumed, some field filled later missing), `consumed` (taken by the task, handed out),
`in_flight` (taken, still being gathered for delivery, or leased and not acked), and the store-level `produced`
(live rows with every later field written). TransferQueue's production and consumption progress ratios are
`produced / live` and `consumed / live`.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def task_progress(core: Any) -> dict[str, Any]:
    """`{"live": n, "produced": n, "tasks": {task: {ready, waiting, consumed, in_flight, delivered}}}` of a
    `StoreCore`.

    Under the store's state lock it only copies what it counts (the ring's seqs and validity at the live positions,
    the presence of fields filled later, each task's consumed marks and in-flight counts: vectorised copies, no work
    per lease or per gather); the counting runs after the lock is released, so a scrape holds writers back for the
    time of a few array copies, however many leases are open.
    """
    tracker = core.consume
    later = [f.name for f in core.schema.fields.values() if f.later]
    with core.lock:
        idx = core.index
        lo, hi = int(idx.lo), int(idx.hi)
        segments = ring_segments(lo, hi, core.arena_rows)
        seq_at = _joined([idx.seq[a:b] for a, b in segments], np.int64)
        valid_at = _joined([idx.valid[a:b] for a, b in segments], bool)
        present = None
        if later and hi > lo:
            pos = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in segments])
            present = np.array(core.present(later, pos), dtype=bool)
        tasks = tracker.progress_state(segments) if tracker is not None and tracker.tasks else {}
    seqs = np.arange(lo, hi, dtype=np.int64)
    live = seq_at == seqs
    valid = live & valid_at
    if present is None:
        present = np.ones(len(seqs), dtype=bool)
    out: dict[str, Any] = {"live": int(live.sum()), "produced": int((live & present).sum()), "tasks": {}}
    for task, t in tasks.items():
        # leased and still-gathered rows are marked consumed until they are final (or come back): in flight
        marked = (t["consumed_at"] == seqs) & live
        in_flight = t["leased"] + t["gathering"]
        out["tasks"][task] = {
            "ready": int((valid & ~marked & present).sum()),
            "waiting": int((live & ~marked & ~present).sum()),
            "consumed": max(0, int(marked.sum()) - in_flight),
            "in_flight": in_flight,
            "delivered": t["delivered"],
        }
    return out


def ring_segments(lo: int, hi: int, rows: int) -> list[tuple[int, int]]:
    """The ring positions of seqs [lo, hi) as at most two [start, stop) slices (the ring wraps once at most)."""
    if hi <= lo:
        return []
    a, n = lo % rows, hi - lo
    if a + n <= rows:
        return [(a, a + n)]
    return [(a, rows), (0, a + n - rows)]


def _joined(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def observed(core: Any, timings: Any, checkpoints: dict[str, Any]) -> dict[str, Any]:
    """`ExperienceStore.observability()`: timings, lineage counters and bytes, rate-limiter waits, per-task progress
    and checkpoints (`checkpoints`: the facade's record: count, last summary, the latest background handle)."""
    with core.lock:
        lineage = None if core.lineage is None else core.lineage.counters()
    ck = dict(checkpoints)
    handle = ck.pop("handle", None)
    ck["running"] = handle is not None and not getattr(handle, "done", True)
    if handle is not None:
        ck["progress"] = getattr(handle, "progress", None)
    return {"timings": None if timings is None else timings.snapshot(), "lineage": lineage,
            "limiter_waits": dict(core.limiter_waits),
            "lineage_bytes": 0 if core.lineage is None else core.lineage.nbytes,
            "progress": task_progress(core), "checkpoints": ck}
