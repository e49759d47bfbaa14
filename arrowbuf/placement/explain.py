"""`store.placement()`: the table of bytes per column per tier, and why (`explain=True`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:  # pragma: no cover
    pass

from .base import Placement
from .target import PlacementTarget


def placement_table(target: PlacementTarget, policy: Placement | None, explain: bool = False) -> pa.Table:
    """`store.placement()`: one row per (column, tier): chunks and bytes there; with `explain`, why."""
    tiers = target.tiers
    rows: dict[str, list[Any]] = {"column": [], "tier": [], "chunks": [], "bytes": []}
    extra: dict[str, list[Any]] = {"access_share": [], "rows_per_s": [], "mass": [], "value_per_byte": [],
                                   "read_gbps": [], "why": []}
    info = policy.explain() if (explain and policy is not None) else {}
    bw = info.get("bandwidth")
    directory = target.directory
    for f in target.schema.fields.values():
        if f.ragged:
            continue
        cb = f.row_bytes * target.chunk_rows
        ci = directory.columns.index(f.name)
        res = directory.residency[ci] if target.tiered else np.zeros(directory.num_slots, int)
        for code, t in enumerate(tiers):
            here = res == code
            n = int(here.sum())
            rows["column"].append(f.name)
            rows["tier"].append(t.name)
            rows["chunks"].append(n)
            rows["bytes"].append(n * cb)
            if explain:
                share = info.get("share", {}).get(f.name)
                mass = info.get("mass")
                m = float(mass[here].sum()) if mass is not None else None
                extra["access_share"].append(share)
                extra["rows_per_s"].append(info.get("rows_per_s", {}).get(f.name))
                extra["mass"].append(m)
                extra["value_per_byte"].append(share * m / max(1, n * cb) if share is not None and m is not None
                                               and n else None)
                extra["read_gbps"].append(float(bw[code]) / 1e9 if bw is not None else None)
                extra["why"].append(_why(f.name, t.name, n, share, m, code, len(tiers), policy))
    cols_out = {**rows, **(extra if explain else {})}
    return pa.table(cols_out)


def _why(column: str, tier: str, chunks: int, share: float | None, mass: float | None, code: int, ntiers: int,
         policy: Placement | None) -> str:
    if policy is None:
        return "single tier" if ntiers == 1 else "no placement policy: where the store first put it"
    if share is None:
        return "no step yet"
    if not chunks:
        return ""
    reads = f"{100 * share:.0f}% of sampled rows read this column"
    if mass is not None:
        reads += f"; these chunks hold {100 * mass:.0f}% of the sampling mass"
    if code == ntiers - 1:
        return reads + ("; the rest, below the upper tiers' value cut" if share > 0 else
                        "; never sampled: lowest value")
    return reads + "; highest value per byte that fits the budget"
