"""`store.update`: fill fields of rows already stored (the LLM post-training path: rewards, reference log-probs).

A schema marks the fields a later stage produces with `later: true` (`arrowbuf.schema.FieldSpec.later`); a row may be
written without them (they read as null) and a reward worker or a reference-model worker fills them afterwards::

    ids = store.extend(rollouts)                                   # reward, ref_logprobs left out
    store.update(ids, {"reward": rewards})                         # one value per id
    store.update(ids[:2], {"ref_logprobs": [lp0, lp1]})            # ragged: one list per id (or a pa.ListArray)
    store.stats()["update_skipped"]                                # ids whose row was evicted meanwhile

Semantics:
- Only fields declared `later: true` can be updated. The others are written with their row and never change: the
  store's episode links, samplers and snapshots rely on that (a row's data is immutable until eviction, which is
  what lets a checkpoint copy sealed chunks without a lock). Declare a field `later` to fill or correct it.
- Updating a row whose field already has a value overwrites it (last write wins; a reward worker may retry).
- Validation is `extend`'s: the field exists, the dtype converts without loss, the shape (or a ragged field's
  element dtype) matches, `allow_nan`, and one value per id. Everything is checked before anything is written, under
  the store's write lock, so a call is atomic: readers see all of its rows or none of a row (see
  `arrowbuf.ring.presence`).
- Ids are what `extend`/`append` returned. An id whose row was evicted or replaced (the ring's seq check, as for
  `update_priorities`) is skipped and counted in `stats()["update_skipped"]`; the call returns the rows written. An
  id this store never issued (negative, at or past the next id, another store's encoding such as a ShardedStore's
  global id) raises `InvalidArgument`, and nothing is written. So does an id given twice.
- After writing, consumers waiting for fields (`store.consume(require=...)`) are woken: the store's condition is
  notified, then `StoreCore.on_update(positions, fields)` is called when set (under the write lock only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument
from ..schema.convert import numpy_to_arrow
from ..schema.inputs import IdsLike
from ..schema.update import update_ids, validate_update
from .core import StoreCore


class StoreUpdater:
    """`update` over a store's `StoreCore` (see the module docstring)."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core

    def update(self, ids: IdsLike, values: Mapping[str, object]) -> int:
        """Fill later fields of stored rows; returns the number of rows written (see the module docstring).

        Raises:
            SchemaError, InvalidArgument: bad input; nothing written.
            StoreClosed: the store is closed.
        """
        seqs = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.core.schema, seqs, values, single)
        return self.apply(seqs, cols)

    def check_issued(self, seqs: np.ndarray) -> None:
        """Refuse ids this store never issued (negative, or at or past its next id).

        Raises:
            InvalidArgument: naming the id.
            StoreClosed: the store is closed.
        """
        c = self.core
        c.check_open()
        if len(seqs) and seqs.min() < 0:
            raise InvalidArgument(f"update: id {int(seqs.min())} is negative; ids are what extend/append returned")
        hi = c.index.hi
        if len(seqs) and seqs.max() >= hi:
            raise InvalidArgument(f"update: id {int(seqs.max())} was never issued by store {c.name!r} (its next "
                                  f"id is {hi}); pass ids this store's extend/append returned (a ShardedStore's "
                                  "ids go to the ShardedStore)")

    def apply(self, seqs: np.ndarray, cols: dict[str, Any]) -> int:
        """`update` of ids and columns already checked (`update_ids`, `validate_update`); returns the rows written.

        Raises:
            InvalidArgument: an id never issued (`check_issued`); nothing written.
            StoreClosed: the store is closed.
        """
        c = self.core
        self.check_issued(seqs)
        with c.write_lock:  # rows are evicted only by writers: holding it, a live row stays live until we finish
            c.check_open()
            idx = c.index
            live = idx.live(seqs)
            keep = np.flatnonzero(live)
            pos = seqs[keep] % c.arena_rows
            if len(keep):
                parts = {name: col if len(keep) == len(seqs) else (
                    col.take(numpy_to_arrow(keep)) if isinstance(col, pa.Array) else col[keep])
                    for name, col in cols.items()}
                c.cols.update_fields(pos, parts)  # one bracket: readers see all of a row's update or none
            with c.cond:
                skipped = len(seqs) - len(keep)
                if skipped:
                    idx.count("update_skipped", skipped)
                if len(keep):
                    c.cond.notify_all()  # consumers waiting for fields (consume require=) check again
            if len(keep) and c.on_update is not None:
                c.on_update(pos, list(cols))
        return len(keep)
