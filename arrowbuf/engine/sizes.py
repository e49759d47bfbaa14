"""A store's size: the one definition that `stats()`, `arrowbuf inspect`, the inspector page and `/metrics` show.

Two numbers, always labelled, because they answer different questions:

- **rows' bytes** (`rows_bytes`): what the live rows' values take, as the store keeps them. Per stored column: live
  rows x the field's bytes per row for a fixed-width field (`FieldSpec.row_bytes`: item size x shape; a bool is one
  byte), the live rows' elements x item size for a ragged field, and 8 bytes per row for each of the system columns
  `episode_id`, `step` and `seq`. Derived columns (`next_obs`) are not stored and not counted. It grows with the rows
  and is about what an uncompressed export of them takes.
- **reserved bytes** (`reserved_bytes`): what the store's memory tiers hold for it, rows or not: the ring of
  `capacity` rows plus one spare chunk for every column, final-observation slots, the index and the bookkeeping
  (`stats()["bytes"]` per tier sums to it). A store of 500 rows with room for 10,000 reserves the 10,000. Per column:
  the column's ring arenas (`store.placement()`, summed over tiers; the index's arrays for the system columns).

A 500-row Atari store of capacity 10,000 thus shows obs at 14.1 MB of rows' bytes and 285 MB reserved: both are
right, and every place says which one it shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..schema import SYSTEM_COLUMNS, FieldSpec  # SYSTEM_COLUMNS: int64 columns the store adds, kept in the index
from ..schema.convert import arrow_to_numpy
from .core import StoreCore


def ragged_placement(core: StoreCore) -> list[dict[str, Any]]:
    """Rows of `store.placement()` for the ragged columns (which live outside the chunk residency that placement
    moves): per ragged field, its tier, the ring's chunk slots and the bytes its arena holds."""
    cols = core.cols
    out: list[dict[str, Any]] = []
    if core.closed:  # its memory is gone (stats() of a closed store still answers)
        return out
    for f in core.schema.fields.values():
        if not f.ragged:
            continue
        arena = cols.tier_ragged.get(f.name)
        if arena is not None:
            nbytes = sum(int(a.nbytes) for a in (arena.values, arena.start, arena.length, arena.lstart, arena.origin,
                                                  arena.meta))
            tier = arena.tier.name
        else:  # per-slot Arrow arrays in the process heap
            nbytes = sum(int(a.get_total_buffer_size()) for a in cols.ragged_snapshot()[f.name])
            tier = cols.tiers[0].name
        out.append({"column": f.name, "tier": tier, "chunks": int(core.directory.num_slots), "bytes": nbytes})
    return out


def store_sizes(core: StoreCore, placement: pa.Table, tier_bytes: dict[str, int]) -> dict[str, Any]:
    """`{"rows_bytes", "reserved_bytes", "columns": {name: {"rows_bytes", "reserved_bytes"}}}` of a store's
    internals (`StoreCore`; call under its state lock), from its `placement()` table (ragged rows included) and the
    bytes its tiers hold (`stats()["bytes"]`). See the module docstring for what each number means."""
    idx = core.index
    live = len(idx)
    reserved_of: dict[str, int] = {}
    for name, nbytes in zip(placement.column("column").to_pylist(), placement.column("bytes").to_pylist()):
        reserved_of[name] = reserved_of.get(name, 0) + int(nbytes)
    live_rows: list[slice] | np.ndarray | None = None
    columns: dict[str, dict[str, int]] = {}
    for f in core.schema.fields.values():
        if f.ragged:
            if live_rows is None:
                live_rows = _live_rows(core)
            rows = _ragged_rows_bytes(core, f, live_rows)
        else:
            rows = live * int(f.row_bytes)
        columns[f.name] = {"rows_bytes": int(rows), "reserved_bytes": reserved_of.get(f.name, 0)}
    for name in SYSTEM_COLUMNS:
        columns[name] = {"rows_bytes": 8 * live, "reserved_bytes": 8 * int(core.arena_rows)}
    return {"rows_bytes": sum(c["rows_bytes"] for c in columns.values()),
            "reserved_bytes": int(sum(tier_bytes.values())), "columns": columns}


def _live_rows(core: StoreCore) -> list[slice] | np.ndarray:
    """The ring positions of the live rows: one or two slices when every seq of [lo, hi) is live (no holes: the
    usual case, summed without a gather), else the positions themselves."""
    idx = core.index
    lo, hi, arena = int(idx.lo), int(idx.hi), int(core.arena_rows)
    if len(idx) == hi - lo:
        p0, n = lo % arena, hi - lo
        return [slice(p0, p0 + n)] if p0 + n <= arena else [slice(p0, arena), slice(0, p0 + n - arena)]
    seqs = np.arange(lo, hi, dtype=np.int64)
    pos = seqs % arena
    return pos[idx.seq[pos] == seqs]


def _ragged_rows_bytes(core: StoreCore, spec: FieldSpec, live: list[slice] | np.ndarray) -> int:
    """Bytes of the elements of the live rows of ragged field `spec` (a row not written yet counts 0; a closed
    store's rows: 0, their memory is gone)."""
    if core.closed:
        return 0
    cols = core.cols
    arena = cols.tier_ragged.get(spec.name)
    if arena is not None:
        lengths = np.asarray(arena.length)
        parts = [lengths[s] for s in live] if isinstance(live, list) else [lengths[live]]
        elements = sum(int(p.sum()) + int((p < 0).sum()) for p in parts)  # -1: no value yet, counts 0
        return elements * int(arena.values.dtype.itemsize)
    positions = (np.concatenate([np.arange(s.start, s.stop) for s in live]) if isinstance(live, list)
                 else live)
    slots = cols.ragged_snapshot()[spec.name]
    chunk_rows = int(core.chunk_rows)
    total = 0
    for s in np.unique(positions // chunk_rows):
        arr = slots[int(s)]
        lengths = arrow_to_numpy(pc.list_value_length(arr).fill_null(0))
        rows = positions[positions // chunk_rows == s] % chunk_rows
        total += int(lengths[rows[rows < len(lengths)]].sum())
    return total * int(spec.dtype.itemsize)


__all__ = ["ragged_placement", "store_sizes"]
