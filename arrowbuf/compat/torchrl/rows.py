"""How the storage reads rows of its store by id: `ExperienceStore.take` (random access, one gather per column), or,
for a store served over Flight (which has no random access by id yet), a snapshot of its rows (`to_table`) that
the ids are picked from.

    lo, hi = live_range(store)                     # the live ids [lo, hi)
    got = gather(store, ids, ["obs", "action"])    # {column: ndarray [n, ...] (ragged: a list of arrays)}
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import InvalidArgument
from ...store.facade import ExperienceStore
from ...surface import StoreSurface
from ..transfer_queue.columns import dense_numpy


def live_range(store: StoreSurface) -> tuple[int, int]:
    """The live seqs [lo, hi) of `store`."""
    if isinstance(store, ExperienceStore):
        return int(store.index.lo), int(store.index.hi)
    st = store.stats()
    return int(st["first_seq"]), int(st["next_seq"])


def gather(store: StoreSurface, ids: np.ndarray, columns: list[str]) -> dict[str, Any]:
    """The rows `ids`, in that order: {column: values} as `SampleBatch.to_numpy()` gives them.

    Raises:
        InvalidArgument: an id names no stored row (evicted meanwhile, or never written).
    """
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(store, ExperienceStore):
        return store.take(ids, columns=columns).to_numpy()
    table = store.to_table(columns=[*columns, "seq"])
    seqs = table.column("seq").to_numpy()
    first = int(seqs[0]) if len(seqs) else 0
    rel = ids - first
    if len(ids) and (rel.min() < 0 or rel.max() >= len(seqs) or not np.array_equal(seqs[rel], ids)):
        raise InvalidArgument("some rows were evicted from the served store while they were read")
    rows = table.take(pa.array(rel))
    out: dict[str, Any] = {}
    for name in columns:
        col = rows.column(name)
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            out[name] = [np.asarray(v, dtype=np.uint8) for v in col.to_pylist()]
        else:
            out[name] = np.array(dense_numpy(col), copy=True)
    return out
