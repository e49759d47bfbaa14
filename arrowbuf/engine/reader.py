"""StoreReader: the read path of a store: sampling, priority updates and consistent snapshots of the rows.

Sampling selects under the state lock and gathers outside it; a seqlock-style check of each row's seq after the
gather detects a row recycled meanwhile (a writer sets a position's seq to -1 before it overwrites it, and a seq never
comes back), and such items are drawn again, so no batch holds a torn row. On a tiered store a second seqlock over the
slot table re-gathers rows whose chunk moved during the gather.

Snapshots (`to_table`, and through it `sql`, `episodes` and the Flight server's `table`/`sql`) use the same seqlock,
per chunk and without holding any lock while copying: under the state lock the reader notes the live range `[lo, hi)`
(the snapshot point; a batch is committed all at once, so this never splits one), then copies each chunk of it, oldest
first, and right after each copy checks the rows' seqs. A row whose seq changed was evicted and overwritten while it
was copied; since the ring evicts in seq order, every older row was evicted too, so the snapshot drops that row and
everything before it. The result is the rows `[first, hi)` as committed: each row exactly as its writer committed it,
no gap, no half-replaced row, and nothing newer than the snapshot point. `first > lo` only when writers replaced rows
faster than they were copied.

`snapshot(columns)` is the one mechanism: it returns a `RowSnapshot` (the seq range and a `pa.Table`), which
`to_table` unwraps; a checkpoint that wants the same rows as a table can call it too (`ExperienceStore.snapshot`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ..delivery.batch import SampleBatch
from ..errors import ArrowbufError, InvalidArgument, SampleTimeout, SchemaError
from ..ring.columns import ColumnArenas
from ..ring.index import PENDING
from ..ring.outpool import OutputPool, take_into
from ..ring.ragged_gather import own_as
from ..ring.reservations import HOLE
from ..ring.tiered import TieredColumnArenas
from ..samplers import Sampler, validate_priorities
from ..samplers.device import device_kind
from ..schema import FieldSpec
from ..schema import logical as _logical
from ..schema.convert import numpy_to_arrow
from ..schema.inputs import Gathered, IdsLike, ValuesLike
from .core import StoreCore
from .nstep import n_step_returns

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs

    from .device_sample import DeviceSampling

_OPTIMISTIC_ROUNDS = 4  # seqlock rounds a tiered gather tries before it holds migrations off


@dataclass
class RowSnapshot:
    """A consistent copy of a store's rows (see the module docstring).

    Attributes:
        lo: the first seq copied; hi: one past the last (the live range's end at the snapshot point).
        live_lo: the live range's start at the snapshot point (`lo > live_lo` when rows went while copied).
        table: the rows [lo, hi) in seq order, copied (no view into the store's memory).
    """

    lo: int
    hi: int
    live_lo: int
    table: pa.Table


class StoreReader:
    """sample, update_priorities and snapshots over a store's `StoreCore` (see the module docstring).

    Attributes:
        count_access: record column accesses for a placement policy (a tiered store with one).
        outputs: the pool of output arrays that gathers on a one-tier store write into (`arrowbuf.ring.outpool`: an
            array is reused only once nothing outside the pool references it, so a kept batch is never overwritten).
    """

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self.count_access = False
        self.outputs = OutputPool()
        core.cols.use_outputs(self.outputs)  # large ragged gathers too
        self._logical = _logical.needs_delivery(core.schema)
        #: the device sample path (`arrowbuf.engine.device_sample`) when the store mirrors its ring on a device
        self.device: DeviceSampling | None = None
        if core.cols.tiered:
            cols = cast(TieredColumnArenas, core.cols)
            if cols.device_ring is not None:
                if device_kind(core.sampler) is None or core.max_times_sampled:  # draws on the host: no mirror
                    cols.drop_device_ring()
                else:
                    from .device_sample import DeviceSampling

                    self.device = DeviceSampling(core, cols.device_ring, self._timeout_error)

    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               n_step: int | None = None, gamma: float = 0.99) -> SampleBatch:
        """Sample `n` items.

        Args:
            n: batch size; uniform sampling is with replacement, so any n works once a row is sampleable (with
                `max_times_sampled`, a batch holds n distinct items: see the constructor).
            columns: columns to gather (default: every field and derived field).
            timeout: seconds to wait for the rate limiter or an empty store; None does not wait.
            n_step: add `n_step_return`, `n_step_discount` and, per derived field, `n_step_<name>` (the bootstrap
                observation) over `n_step` steps of the episode (see `arrowbuf.engine.nstep`).
            gamma: the discount for `n_step`.

        Returns:
            A `SampleBatch`. Its arrays are the caller's for as long as the caller holds them, or any view, tensor or
            Arrow array made from them; once every such reference is dropped, a later sample may reuse their memory
            (`arrowbuf.ring.outpool`). Keep the arrays themselves, not a raw pointer or a weak reference.

        Raises:
            SampleTimeout: nothing could be served within `timeout`.
        """
        if self.device is not None:
            batch = self._sample_device(n, columns, timeout, n_step, gamma)
            if batch is not None:
                return batch
        names, seqs, weights = self._selection(n, columns, timeout, n_step, gamma)
        arrays = self._gather_consistent(seqs, weights, names, n_step, gamma, timeout)
        self._sampled(seqs)
        indices = seqs[:, 0].copy() if seqs.ndim == 2 else seqs
        return SampleBatch(self._deliver(arrays), indices, weights)

    def _sample_device(self, n: int, columns: Iterable[str] | None, timeout: float | None, n_step: int | None,
                       gamma: float) -> SampleBatch | None:
        """`sample` on the device ring (`arrowbuf.engine.device_sample`), or None when a column asked for is not
        mirrored there (the host path serves it)."""
        assert self.device is not None
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive number of items, got {n!r}")
        self.core.check_open()
        names = self.core.schema.resolve_columns(list(columns) if columns is not None else None)
        if n_step is not None:
            self._check_n_step(n_step, gamma)
        if not self.device.serves(names, n_step):
            return None
        batch = self.device.sample(int(n), names, timeout, n_step, gamma)
        if self.count_access:
            self.core.cols.count_access((tuple(names), n_step is not None), int(n), self._columns_read, names,
                                        n_step)
        return batch

    def sample_pieces(self, n: int, rows: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
                      piece_bytes: int | None = None, n_step: int | None = None,
                      gamma: float = 0.99) -> Iterator[SampleBatch]:
        """`sample(n)` delivered as consecutive batches of at most `rows` items, each gathered only when the
        iterator is asked for it: a sender of a large sample (the Flight server's DoGet in parts) holds one piece's
        output at a time instead of the whole batch. With `piece_bytes`, the first piece has `rows` items and the
        others as many as make about `piece_bytes` at the first piece's bytes per item (at least one).

        The items are selected at once, here, as `sample` selects them (waiting on the rate limiter and for rows,
        counting deliveries; `SampleTimeout` and argument errors are raised by this call, before any piece). Each
        piece is then gathered with `sample`'s torn-row check: an item whose row a writer recycled before its piece
        was gathered is drawn again, as `sample` draws it again, so every piece holds whole rows and names its items
        in `indices` (which may differ from the first selection in such items). The sampler's `on_sampled` sees
        every item once the last piece is gathered (not if the caller stops early). A store whose items are
        distinct per batch (`max_times_sampled`, not a queue) gathers the batch as one piece: a torn row redraws
        every item, which only the whole batch can do without repeating one.
        """
        if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 1:
            raise InvalidArgument(f"rows must be a positive number of items per piece, got {rows!r}")
        if piece_bytes is not None and (not isinstance(piece_bytes, (int, np.integer)) or piece_bytes < 1):
            raise InvalidArgument(f"piece_bytes must be a positive number of bytes, got {piece_bytes!r}")
        names, seqs, weights = self._selection(n, columns, timeout, n_step, gamma)
        if self.core.max_times_sampled and not self.core.sampler.queue:
            rows = len(seqs)  # distinct items: a torn row redraws the whole batch (see sample), so one piece
        return self._pieces(seqs, weights, int(rows), piece_bytes, names, n_step, gamma, timeout)

    def _selection(self, n: int, columns: Iterable[str] | None, timeout: float | None, n_step: int | None,
                   gamma: float) -> tuple[list[str], np.ndarray, np.ndarray | None]:
        """What `sample` and `sample_pieces` share before gathering: the arguments checked, the items selected (as
        the sampler selects them: waiting on the rate limiter and for rows, counting deliveries) and the column
        access counted. Returns the columns, the items' seqs and their weights."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive number of items, got {n!r}")
        self.core.check_open()
        names = self.core.schema.resolve_columns(list(columns) if columns is not None else None)
        if n_step is not None:
            self._check_n_step(n_step, gamma)
        with self.core.cond:
            seqs, weights = self._select(int(n), timeout)
        if seqs.ndim == 2 and n_step is not None:
            raise InvalidArgument("n_step returns are for transitions; a Sequence sampler returns whole windows")
        if self.count_access:
            self.core.cols.count_access((tuple(names), n_step is not None), seqs.size, self._columns_read, names,
                                        n_step)
        return names, seqs, weights

    def _pieces(self, seqs: np.ndarray, weights: np.ndarray | None, rows: int, piece_bytes: int | None,
                names: list[str], n_step: int | None, gamma: float, timeout: float | None) -> Iterator[SampleBatch]:
        start = 0
        while start < len(seqs):
            part = seqs[start:start + rows]  # a view: redraws land in `seqs` for on_sampled
            w = None if weights is None else weights[start:start + rows]
            arrays = self._gather_consistent(part, w, names, n_step, gamma, timeout)
            if start == 0 and piece_bytes is not None:  # the rest sized from this piece's bytes per item
                nbytes = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
                rows = max(1, int(piece_bytes * len(part) // max(1, nbytes)))
            start += len(part)
            yield SampleBatch(self._deliver(arrays), part[:, 0].copy() if part.ndim == 2 else part.copy(),
                              None if w is None else w.copy())
            del arrays
        self._sampled(seqs)

    def _gather_consistent(self, seqs: np.ndarray, weights: np.ndarray | None, names: list[str],
                           n_step: int | None, gamma: float, timeout: float | None) -> dict[str, Any]:
        """Gather the items `seqs`; items whose rows were recycled meanwhile are drawn again, in place in `seqs`
        (and `weights`), until every row is whole."""
        arrays = self._gather_stable(seqs, names, n_step, gamma)
        bad = self._torn(seqs, arrays)
        retries = 0
        while bad.any():  # a writer recycled some rows while they were gathered: draw those again
            retries += 1
            if retries > 100:
                raise ArrowbufError("sample could not read a consistent batch after 100 retries")
            # distinct items (max_times_sampled): draw the whole batch again, so no redraw repeats a kept item (the
            # discarded draw stays counted: an item may get fewer deliveries than the limit, never more). A queue
            # (FIFO) never repeats an item: redraw only the torn ones.
            whole = self.core.max_times_sampled and not self.core.sampler.queue
            fix = np.arange(len(seqs)) if whole else np.flatnonzero(bad)
            self.core.index.count("torn_retries", len(fix))
            with self.core.cond:
                again, again_w = self._select(len(fix), timeout)
            seqs[fix] = again
            if weights is not None and again_w is not None:
                weights[fix] = again_w
            sub = self._gather_stable(again, names, n_step, gamma)
            for k in arrays:
                arrays[k] = _assign_rows(arrays[k], fix, sub[k])
            bad[:] = False
            bad[fix] = self._torn(again, sub)
        arrays.pop("_n_step_last", None)
        return arrays

    def _sampled(self, seqs: np.ndarray) -> None:
        if type(self.core.sampler).on_sampled is not Sampler.on_sampled:
            with self.core.cond:
                self.core.sampler.on_sampled(seqs)

    def gather(self, seqs: np.ndarray, columns: Iterable[str] | None = None) -> dict[str, Any]:
        """The columns (default: every field and derived field, ragged included) of rows `seqs`, gathered as
        `sample` gathers. For callers that keep the rows in place meanwhile (`arrowbuf.engine.consume` pins them while
        it gathers): no torn-row check."""
        names = self.core.schema.resolve_columns(list(columns) if columns is not None else None)
        return self._deliver(self._gather_stable(np.asarray(seqs, dtype=np.int64), names, None, 0.99))

    def _deliver(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Gathered columns as a batch holds them: fields of a dtype numpy lacks (bfloat16, float8, complex, json)
        as the Arrow columns of their dtype over the gathered memory (`arrowbuf.schema.logical`)."""
        if not self._logical:
            return arrays
        lists = {k: v for k, v in arrays.items() if isinstance(v, pa.ListArray)}
        out = _logical.deliver(self.core.schema, arrays)
        for k, v in lists.items():  # a ragged bfloat16 gather's own memory stays the batch's: packed without a copy
            if out[k] is not v:
                own_as(v, out[k])
        return out

    def _check_n_step(self, n_step: int, gamma: float) -> None:
        if not isinstance(n_step, (int, np.integer)) or n_step < 1:
            raise InvalidArgument(f"n_step must be a positive integer, got {n_step!r}")
        if "reward" not in self.core.cols or self.core.schema.fields["reward"].shape:
            raise SchemaError("n_step returns need a scalar 'reward' field in the schema")
        if not 0.0 <= gamma <= 1.0:
            raise InvalidArgument(f"gamma must be in [0, 1], got {gamma}")

    def _count_samples(self, seqs: np.ndarray) -> None:
        """Under the lock, as items are selected (so concurrent samples never exceed the limit): count deliveries;
        items sampled `max_times_sampled` times stop being sampleable. A window counts once, at its start row."""
        idx = self.core.index
        seqs = seqs[:, 0] if seqs.ndim == 2 else seqs
        live = seqs[idx.live(seqs)]
        pos = live % self.core.arena_rows
        np.add.at(self.core.times_sampled, pos, 1)
        done = np.unique(pos[self.core.times_sampled[pos] >= self.core.max_times_sampled])
        done = done[idx.valid[done]]
        if len(done):
            idx.valid[done] = False
            self.core.sampler.on_invalid(done)
            idx.count("removed", len(done))

    def has_next(self, pos: np.ndarray) -> np.ndarray:
        """Mask of positions whose row is stored with its next observation known, sampleable or not: a row that
        `max_times_sampled` removed still serves as a successor and inside windows while it is stored."""
        idx = self.core.index
        ok = idx.valid[pos]
        used = ~ok & (self.core.times_sampled[pos] >= self.core.max_times_sampled)
        if used.any():
            p = pos[used]
            seq = idx.seq[p]
            good = (seq >= idx.lo) & (seq < idx.hi)
            if self.core.final_sources:  # the next observation is known: a successor, or a final slot still its own
                nxt = idx.next_pos[p]
                good &= nxt != PENDING
                fin = good & (nxt >= self.core.arena_rows)
                good[fin] = self.core.final_owner[nxt[fin] - self.core.arena_rows] == seq[fin]
            ok[used] = good
        return ok

    def _select(self, n: int, timeout: float | None) -> tuple[np.ndarray, np.ndarray | None]:
        """Choose items under the lock, waiting on the rate limiter and for rows."""
        chosen: list[Any] = [None]
        held = [False]  # the rate limiter said no at least once (counted once per call: StoreCore.limiter_waits)

        def ready() -> bool:
            self.core.check_open()
            if self.core.rate_limiter is not None and not self.core.rate_limiter.can_sample(n, self.core.counters()):
                held[0] = True
                return False
            chosen[0] = self.core.sampler.select(n, distinct=bool(self.core.max_times_sampled))
            return chosen[0] is not None

        ok = self.core.wait_for(ready, timeout)
        if held[0]:
            self.core.limiter_waits["sample"] += 1
        if not ok:
            raise self._timeout_error(n, timeout)
        self.core.index.count("samples", n)
        if self.core.max_times_sampled:
            self._count_samples(chosen[0][0])
        self.core.cond.notify_all()
        return chosen[0]

    def _timeout_error(self, n: int, timeout: float | None) -> SampleTimeout:
        """Under the state lock: the error of a sample of `n` items that could not be served within `timeout`."""
        if self.core.rate_limiter is not None and not self.core.rate_limiter.can_sample(n, self.core.counters()):
            why = self.core.rate_limiter.blocked_reason(self.core.counters())
        elif len(self.core.index) == 0:
            why = "the store is empty"
        else:
            why = (f"{type(self.core.sampler).__name__} cannot serve {n} items from {len(self.core.index)} "
                   "stored rows")
            if self.core.max_times_sampled:
                why += (f" (max_times_sampled={self.core.max_times_sampled}: a batch needs {n} distinct eligible "
                        f"items; {self.core.index.counter('removed')} were used up)")
        wait = "did not wait (timeout=None)" if timeout is None else f"waited {timeout}s"
        return SampleTimeout(f"sample({n}) from {self.core.name!r}: {why}; {wait}. Add data or pass timeout= to "
                             "wait")

    def _columns_read(self, names: list[str], n_step: int | None) -> list[str]:
        """The stored columns a sample of `names` reads (what placement counts as accesses)."""
        out = []
        for n in names:
            d = self.core.schema.derived.get(n)
            out.append(d.next_of if d is not None else n)
        if n_step is not None:
            out += ["reward", *self.core.end_fields, *(d.next_of for d in self.core.derived)]
        return list(dict.fromkeys(out))

    def _gather_stable(self, seqs: np.ndarray, names: list[str], n_step: int | None, gamma: float) -> dict[str, Any]:
        """`_gather`, safe against chunks moving meanwhile on a tiered store (their old copy may be released or
        reused while it is read). First optimistically, a seqlock over the slot table: gather, then re-read the items
        whose chunks moved. A reader that keeps losing that race to a busy placement then holds migrations off for
        one gather (`moves_held`): bounded, never an error however often chunks move."""
        cols = self.core.cols
        if cols.direct:
            return self._gather(seqs, names, n_step, gamma)
        cols = cast(TieredColumnArenas, cols)  # not direct: several tiers
        for _ in range(_OPTIMISTIC_ROUNDS):
            arrays, moved = self._gather_checked(cols, seqs, names, n_step, gamma)
            if moved is None:
                return arrays
            if moved.all():
                continue
            fix = np.flatnonzero(moved)
            sub, again = self._gather_checked(cols, seqs[fix], names, n_step, gamma)
            if again is None:
                for k in arrays:
                    arrays[k] = _assign_rows(arrays[k], fix, sub[k])
                return arrays
        cols.counters["held_gathers"] += 1
        with cols.moves_held():
            return self._gather(seqs, names, n_step, gamma)

    def _gather_checked(self, cols: TieredColumnArenas, seqs: np.ndarray, names: list[str], n_step: int | None,
                        gamma: float) -> tuple[dict[str, Any], np.ndarray | None]:
        """One tracked `_gather` and, per item, whether a chunk it read moved meanwhile (None: none did)."""
        flips, e0 = cols.flips, cols.epoch.copy()
        reads: list = []
        arrays = self._gather(seqs, names, n_step, gamma, reads)
        if cols.flips == flips:  # nothing moved at all (the common case)
            return arrays, None
        moved = cols.moved(e0, reads, len(seqs))
        if moved is None or not moved.any():
            return arrays, None
        cols.counters["regathers"] += int(moved.sum())
        return arrays, moved

    def _gather(self, seqs: np.ndarray, names: list[str], n_step: int | None = None,
                gamma: float = 0.99, reads: list | None = None) -> dict[str, Any]:
        """One `take` per column per tier (the sample path: vectorised, no per-row Python).

        `seqs` is [B] for transitions or [B, T] for sequence windows; arrays come back [B, ...] or [B, T, ...].
        On a tiered store, `reads` collects (column, positions) of what was read, for the moved-chunk check.
        """
        idx = self.core.index
        cols = self.core.cols
        tracked = reads is not None
        shape = seqs.shape
        pos = (seqs % self.core.arena_rows).reshape(-1)
        out: dict[str, Any] = {}
        later = [name for name in names if name in cols.later]
        filled: dict[str, Any] = {}
        if later:  # fields filled later: null where a row has no value yet; all of an update or none, across fields
            extra = (reads,) if tracked else ()
            filled = cols.presence.consistent(
                lambda: {name: cols.take_later(name, pos, shape, *extra) for name in later})
        nxt = None
        for name in names:
            if name in filled:
                out[name] = filled[name]
                continue
            if name in cols.arrays:
                col = self._rows(cols, name, pos, reads)
            elif name in self.core.schema.derived:
                if nxt is None:
                    nxt = idx.next_pos[pos]
                src = self.core.schema.derived[name].next_of
                col = self._rows(cols, src, nxt, reads, final=True)
            elif name in cols.ragged:
                if len(shape) > 1:
                    raise SchemaError(f"ragged field {name!r} cannot be sampled as sequences")
                out[name] = cols.take_ragged(name, pos)
                continue
            elif name == "episode_id":
                col = idx.episode_id[pos]
            elif name == "step":
                col = idx.step[pos]
            else:  # seq
                col = seqs.reshape(-1).copy()
            out[name] = col.reshape(shape + tuple(col.shape[1:])) if len(shape) > 1 else col
        if n_step is not None:
            column = (lambda f: cols.column(f, reads)) if tracked else cols.column  # type: ignore[call-arg]
            trunc = self.core.schema.truncation  # end fields that bootstrap; the others terminate
            terminal = [column(f) for f in self.core.end_fields if f not in trunc]
            truncation = [column(f) for f in self.core.end_fields if f in trunc]
            has_reward = ((lambda p: cols.present(["reward"], p)) if "reward" in cols.later else None)
            ret, disc, last = n_step_returns(idx, column("reward"), terminal, truncation, pos, n_step, gamma,
                                             self.has_next if self.core.max_times_sampled else None, has_reward)
            out["n_step_return"], out["n_step_discount"] = ret, disc
            last_next = idx.next_pos[last]
            for d in self.core.derived:
                out[f"n_step_{d.name}"] = self._rows(cols, d.next_of, last_next, reads, final=True)
            out["_n_step_last"] = last
        return out

    def _rows(self, cols: ColumnArenas, name: str, positions: np.ndarray, reads: list | None,
              final: bool = False) -> Gathered:
        """Rows of column `name` at `positions` (`final`: ring positions or final-observation slots, a derived
        column's source). A one-tier column (`ColumnArenas.direct`: ring rows, then final rows) is gathered into a
        pooled output array when the output is big enough to be pooled, else by a plain `np.take` (small blocks cost
        malloc nothing); a tiered store's gathers from each tier a row lives in (`reads`: a tracked gather's log)."""
        if isinstance(cols, TieredColumnArenas):  # not `direct`
            take = cols.take_next if final else cols.take
            return take(name, positions) if reads is None else take(name, positions, reads)
        arena = cols.arrays[name]
        if len(positions) * (arena.nbytes // arena.shape[0]) < self.outputs.min_bytes:
            return np.take(arena, positions, axis=0)
        return take_into(arena, positions,
                         self.outputs.empty((len(positions), *arena.shape[1:]), arena.dtype, tag=name))

    def _torn(self, seqs: np.ndarray, arrays: dict[str, Any]) -> np.ndarray:
        """After a gather: per item, whether a writer recycled any row (or final-observation slot) it read."""
        idx = self.core.index
        pos = seqs % self.core.arena_rows
        ok = idx.seq[pos] == seqs
        if self.core.final_sources:
            nxt = idx.next_pos[pos]
            fin = nxt >= self.core.arena_rows
            if fin.any():
                ok[fin] &= self.core.final_owner[nxt[fin] - self.core.arena_rows] == seqs[fin]
            last = arrays.get("_n_step_last")
            if last is not None:
                lnext = idx.next_pos[last]
                fin = lnext >= self.core.arena_rows
                if fin.any():
                    ok[fin] &= self.core.final_owner[lnext[fin] - self.core.arena_rows] == idx.seq[last[fin]]
        return ~ok.reshape(len(seqs), -1).all(axis=1)

    def settle(self) -> None:
        """Apply the priority updates the device path still holds queued to the host sampler (the host's state is
        then complete: what a checkpoint copies); nothing to do without a device ring."""
        if self.device is not None:
            self.device.flush()

    def update_priorities(self, indices: IdsLike, priorities: ValuesLike) -> int:
        """Set the priorities of sampled items; ids whose row was evicted or recycled are ignored (and counted).

        Returns the number of ids applied.

        Raises:
            InvalidArgument: counts differ, or a priority is NaN, infinite, negative or too large
                (`samplers.validate_priorities`); nothing is applied.
        """
        dev = self.device
        if dev is not None and _on_device(indices, priorities, dev.ring.device):
            return dev.update_priorities(indices, priorities)  # a 0-d device tensor: reading it waits for the device
        seqs, pri = validate_priorities(_host(indices), _host(priorities))
        c = self.core
        if dev is not None:  # queued device updates first; the next sync copies the new leaves
            applied = [0]

            def apply() -> np.ndarray:
                live = c.index.live(seqs)
                pos = seqs[live] % c.arena_rows
                if live.any():
                    c.sampler.update_priorities(pos, pri[live])
                c.index.count("priority_updates_ignored", int((~live).sum()))
                applied[0] = int(live.sum())
                return pos

            dev.host_update(apply)
            return applied[0]
        with c.lock:
            live = c.index.live(seqs)
            if live.any():
                c.sampler.update_priorities(seqs[live] % c.arena_rows, pri[live])
            c.index.count("priority_updates_ignored", int((~live).sum()))
        return int(live.sum())

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, columns: Iterable[str] | None = None) -> RowSnapshot:
        """A consistent copy of the live rows' stored columns (see the module docstring); holds no lock while it
        copies.

        Built on `iter_snapshot`: when rows went while they were copied (a gap between two pieces), the pieces
        before the gap are dropped, so the table is one contiguous seq range ending at the snapshot point.

        Raises:
            SchemaError: an unknown column name.
        """
        it = _SnapshotIter(self.core, columns, None)
        parts: list[pa.RecordBatch] = []
        first = expect = it.lo
        for batch, s0, stop in it.pieces():
            if s0 != expect:  # rows went before they were copied: keep only what follows the gap
                parts.clear()
                first = s0
            parts.append(batch)
            expect = stop
        if expect != it.hi:  # the newest rows went before they were copied: nothing intact ends at `hi`
            parts.clear()
        if not parts:
            first = it.hi
        table = pa.Table.from_batches(parts, schema=it.schema) if parts else it.schema.empty_table()
        return RowSnapshot(lo=first, hi=it.hi, live_lo=it.lo, table=table)

    def iter_snapshot(self, columns: Iterable[str] | None = None,
                      max_rows: int | None = None) -> Iterator[pa.RecordBatch]:
        """The live rows' stored columns as a stream of copied record batches, holding about one chunk at a time.

        The snapshot point is the call: the stream covers seqs up to (not including) the live range's end then,
        oldest first, and nothing newer. Each batch is a copy (writers go on without changing it) and each of its
        rows is exactly as committed: the same seqlock as `snapshot`, per piece, with no lock held while copying.

        Rows evicted before the stream reached them are skipped, never yielded torn: a batch starts at the oldest
        row still intact when it is copied, so the stream's seqs are strictly increasing and each batch is one
        contiguous range, but there is a gap (visible in the `seq` column, when asked for) where the ring
        overwrote rows faster than they were read. A stream that must be one contiguous range can compare each
        batch's first seq with the previous batch's last (as `snapshot` does). Memory: one batch of at most
        `max_rows` rows (default: one chunk's).

        Args:
            columns: stored columns to copy (default: every stored column).
            max_rows: at most this many rows per batch (default and upper bound: the store's chunk rows).

        Raises:
            SchemaError: an unknown column name (raised at the call, before any row is read).
            InvalidArgument: `max_rows` is not a positive integer.
        """
        if max_rows is not None and (not isinstance(max_rows, (int, np.integer)) or isinstance(max_rows, bool)
                                     or max_rows < 1):
            raise InvalidArgument(f"max_rows must be a positive number of rows, got {max_rows!r}")
        it = _SnapshotIter(self.core, columns, None if max_rows is None else int(max_rows))
        return (batch for batch, _, _ in it.pieces() if batch.num_rows)


class _SnapshotIter:
    """The snapshot point (taken at construction, under the state lock) and the pieces after it: one mechanism for
    `snapshot` and `iter_snapshot`."""

    def __init__(self, core: StoreCore, columns: Iterable[str] | None, max_rows: int | None) -> None:
        core.check_open()
        full = core.schema.to_arrow()
        names = list(columns) if columns is not None else full.names
        for n in names:
            if n not in full.names:
                raise SchemaError(f"unknown stored column {n!r}; expected one of {full.names}")
        self.core = core
        self.names = names
        self.schema = pa.schema([full.field(n) for n in names], metadata=full.metadata)
        self.step = core.directory.chunk_rows if max_rows is None else min(max_rows, core.directory.chunk_rows)
        self.ragged_names = [n for n in names if n in core.cols.ragged]
        with core.lock:  # the snapshot point
            self.lo, self.hi = core.index.lo, core.index.hi
            # ragged slot arrays are immutable and replaced by writers: taken at the snapshot point, they hold the
            # rows of [lo, hi) as committed (the seqlock below still drops any that went meanwhile)
            self.ragged = core.cols.ragged_snapshot() if self.ragged_names else {}

    def pieces(self) -> Iterator[tuple[pa.RecordBatch, int, int]]:
        """(batch, its first seq, one past the last seq it covers) for each intact piece of [lo, hi), oldest first
        (holes, the seqs of a dead writer's skipped reservation, are left out of a batch without ending it)."""
        c = self.core
        idx = c.index
        cols = c.cols
        chunk_rows = c.directory.chunk_rows
        seq = self.lo
        while seq < self.hi:
            c.check_open()
            live_lo = idx.lo
            if live_lo > seq:  # evicted before reached: skip to the oldest live row
                seq = min(live_lo, self.hi)
                continue
            for slot, p0, p1, s0 in c.directory.live_chunks(seq, min(self.hi, seq + self.step)):
                arrays = []
                later = cols.presence.consistent(functools.partial(self._later, slot, p0, p1))  # all or none
                for n in self.names:
                    if n in later:
                        arrays.append(later[n])
                    elif n in cols:
                        arrays.append(_column_copy(cols.view(n, p0, p1), c.schema.fields[n]))
                    elif n in self.ragged:
                        arrays.append(_logical.to_arrow(c.schema.fields[n],
                                                        self.ragged[n][slot].slice(p0 - slot * chunk_rows, p1 - p0)))
                    elif n == "seq":
                        arrays.append(numpy_to_arrow(np.arange(s0, s0 + p1 - p0, dtype=np.int64)))
                    else:
                        arrays.append(numpy_to_arrow(np.array(getattr(idx, n)[p0:p1])))
                now = idx.seq[p0:p1]
                intact = now == np.arange(s0, s0 + p1 - p0, dtype=np.int64)  # after the copy: seqlock
                batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
                start = s0
                if not intact.all():
                    gone = ~intact & (now != HOLE)  # a hole (a dead writer's skipped seqs) is no row: left out
                    if gone.any():  # overwritten meanwhile: this row and every older one are gone
                        cut = int(np.flatnonzero(gone)[-1]) + 1
                        intact[:cut] = False
                        start = s0 + cut
                    batch = batch.filter(numpy_to_arrow(intact))
                seq = s0 + (p1 - p0)
                if batch.num_rows or start < seq:  # a piece of holes only still continues the range
                    yield batch, start, seq


    def _later(self, slot: int, p0: int, p1: int) -> dict[str, pa.Array]:
        """Rows [p0, p1) of chunk slot `slot` of the fields filled later (null where absent), read now rather than at
        the snapshot point, so that one seqlock read covers all of them (the row check after the copy still drops
        rows recycled meanwhile)."""
        cols = self.core.cols
        out: dict[str, pa.Array] = {}
        for n in self.names:
            if n not in cols.later:
                continue
            if n in cols:
                out[n] = cols.snapshot_later(n, p0, p1)
            else:  # ragged: the slot's current array (an update replaces it inside its bracket)
                off = p0 - slot * self.core.directory.chunk_rows
                out[n] = _logical.to_arrow(self.core.schema.fields[n], cols.ragged[n][slot].slice(off, p1 - p0))
        return out


def _column_copy(values: np.ndarray, spec: FieldSpec) -> pa.Array:
    """An Arrow array of a copy of `values` (arena rows): the arena may be overwritten after the snapshot."""
    values = np.array(values, copy=True)
    if not spec.plain:
        return _logical.to_arrow(spec, values)
    if spec.shape:
        return pa.FixedShapeTensorArray.from_numpy_ndarray(values)
    return numpy_to_arrow(values)


def _is_tensor(values: object) -> TypeIs[torch.Tensor]:
    return type(values).__module__.startswith("torch")


def _on_device(indices: IdsLike, priorities: ValuesLike, device: torch.device) -> bool:
    """Whether a priority update comes as tensors on the device ring's device (both; or ids there and priorities a
    tensor on the same device)."""
    return (_is_tensor(indices) and _is_tensor(priorities) and indices.device == device
            and priorities.device == device)


def _host(values: IdsLike) -> npt.ArrayLike:
    """A tensor's values as numpy (a device tensor is copied back: the host path waits for it)."""
    return values.detach().cpu().numpy() if _is_tensor(values) else values


def _assign_rows(arr: Gathered, rows: np.ndarray, values: Gathered) -> Gathered:
    """`arr` with `arr[rows] = values` (items read again after a chunk moved or a row was recycled).

    The two reads may come back as different kinds: a later field is an Arrow array where some row is null and numpy
    (or a device tensor) where none is, and rows read on a device tier come back as a tensor. The merge takes the
    wider kind: Arrow (nulls) over a tensor over numpy. In place for numpy arrays and tensors."""
    if isinstance(arr, (pa.Array, pa.ChunkedArray)) or isinstance(values, (pa.Array, pa.ChunkedArray)):
        return _replace_rows(arr, rows, values)
    if _is_tensor(arr) or _is_tensor(values):
        import torch

        device = arr.device if _is_tensor(arr) else values.device
        out = arr if _is_tensor(arr) else torch.from_numpy(np.ascontiguousarray(arr)).to(device)
        out[torch.from_numpy(np.asarray(rows)).to(device)] = (
            values.to(device) if _is_tensor(values) else torch.from_numpy(np.asarray(values)).to(device))
        return out
    arr[rows] = values
    return arr


def _replace_rows(arr: Gathered, rows: np.ndarray, values: Gathered) -> pa.Array:
    """A new Arrow array: `arr` with `values` at `rows`, of the Arrow type of whichever of the two is Arrow."""
    typ = arr.type if isinstance(arr, (pa.Array, pa.ChunkedArray)) else cast(pa.Array, values).type
    pylist = _pylist(arr, typ)
    for i, v in zip(rows.tolist(), _pylist(values, typ)):
        pylist[i] = v
    if isinstance(typ, pa.ExtensionType):  # e.g. fixed_shape_tensor: pyarrow builds these from their storage only
        return pa.ExtensionArray.from_storage(typ, numpy_to_arrow(pylist, typ.storage_type))
    return numpy_to_arrow(pylist, typ)


def _pylist(values: Gathered, typ: pa.DataType) -> list:
    """Rows of `values` (Arrow, numpy or a tensor) as Python values in the layout of Arrow type `typ`."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values.to_pylist()
    host = np.asarray(_host(values))
    if isinstance(typ, pa.ExtensionType) or pa.types.is_fixed_size_list(typ):  # a tensor row is one flat list
        host = host.reshape(len(host), -1)
    return host.tolist()
