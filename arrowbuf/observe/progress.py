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
    `StoreCore` (takes its state lock; O(live rows) per task)."""
    tracker = core.consume
    later = [f.name for f in core.schema.fields.values() if f.later]
    with core.lock:
        idx = core.index
        seqs = np.arange(idx.lo, idx.hi, dtype=np.int64)
        pos = seqs % core.arena_rows
        live = idx.seq[pos] == seqs
        valid = live & idx.valid[pos]
        present = np.asarray(core.present(later, pos), dtype=bool) if later and len(pos) else np.ones(len(pos), bool)
        out: dict[str, Any] = {"live": int(live.sum()), "produced": int((live & present).sum()), "tasks": {}}
        if tracker is None or not tracker.tasks:
            return out
        meta, arrays = tracker.state(seqs)
        delivered_now = tracker.stats()["consumed"]
        leases = getattr(tracker, "leases", None)  # rows leased and not acked (consume(..., lease=s)), if any
        leased = {task: np.zeros(len(seqs), dtype=bool) for task in meta["tasks"]}
        if leases is not None:
            for task in meta["tasks"]:
                for held in leases.of_task(task):
                    leased[task] |= np.isin(seqs, held.seqs)
    for task in meta["tasks"]:
        done = np.asarray(arrays[task], dtype=bool) & live & ~leased[task]
        total = int(delivered_now.get(task, 0))
        gathering = max(0, total - int(meta["delivered"].get(task, 0)))  # taken, not handed out yet
        out["tasks"][task] = {
            "ready": int((valid & ~done & ~leased[task] & present).sum()),
            "waiting": int((live & ~done & ~leased[task] & ~present).sum()),
            "consumed": int(done.sum()),
            "in_flight": gathering + int(leased[task].sum()),
            "delivered": total,
        }
    return out


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
