"""ExperienceStore: a ring of schema-validated experience in Arrow-compatible columnar arenas.

Usage::

    store = ExperienceStore(load_schema("schemas/atari.yaml"), capacity=100_000, seed=0)
    store.extend({"obs": obs, "action": a, "reward": r, "terminated": term, "truncated": trunc,
                  "next_obs": next_obs})          # next_obs is read only on the steps that end an episode
    batch = store.sample(256)                       # SampleBatch; batch.to_numpy()["next_obs"] is derived
    store.sql("SELECT episode_id, sum(reward) FROM experience GROUP BY 1")

Ingest is two-phase (`arrowbuf.ingest`): a writer fills free arena rows (the ring keeps one spare chunk, so no live row
is touched), then commits under the lock. Sampling selects under the lock and gathers outside it; a seqlock-style check
of each row's seq after the gather detects a row recycled meanwhile, and such rows are drawn again, so no batch holds
a torn row. Column bytes live in `arrowbuf.columns` (one arena per column, or per column and tier for a store with
`tiers=`, where a second seqlock over the slot table re-gathers rows whose chunk moved during the gather).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, cast

import numpy as np
import pyarrow as pa

from .batch import SampleBatch
from .chunks import ChunkDirectory, default_chunk_rows
from .columns import ColumnArenas, TieredColumnArenas
from .episodes import EpisodeTracker
from .errors import ArrowbufError, InvalidArgument, OutOfSpace, SampleTimeout, SchemaError, StoreClosed
from .index import HEADER, PENDING, RingIndex
from .ingest import IngestMixin
from .nstep import n_step_returns
from .placement import PlacementTarget, make_placement, placement_table
from .rate_limiters import Counters, RateLimiter
from .samplers import Sampler, make_sampler, validate_priorities
from .schema import SYSTEM_COLUMNS, ExperienceSchema, FieldSpec, load_schema
from .tiers.base import Tier, format_bytes
from .tiers.host import HostTier

_SMALL_FINAL_OBS_BYTES = 64 << 20


class ExperienceStore(IngestMixin):
    """An in-process experience store: a FIFO ring of `capacity` rows with pluggable sampling and rate limiting.

    Args:
        schema: an `ExperienceSchema`, or anything `load_schema` takes (path, dict, `pa.Schema`).
        capacity: rows (steps) held; the ring keeps the newest `capacity` committed rows.
        sampler: "uniform" (default), "fifo", or an `ab.samplers` instance.
        rate_limiter: an `ab.rate_limiters` instance, or None (sample whenever a row is sampleable).
        seed: seed for reproducible sampling.
        chunk_rows: rows per chunk (default: about 2 MiB of row data).
        final_obs_capacity: slots for episodes' final observations when the schema derives `next_obs`
            (default: enough for every row when small, else capacity // 16).
        max_times_sampled: an item (a row; a window for `samplers.Sequence`) stops being sampleable after this many
            deliveries; it keeps its ring slot until evicted and still serves as a successor (n-step returns,
            next observations, other windows). A batch then holds distinct items, so `sample(n)` needs n eligible
            items: with fewer it waits for more up to `timeout`, then raises `SampleTimeout` (it never returns a
            short batch). None: no limit.
        tier: where the arenas live: "host" (default), "shm" (shared memory: other processes open the same store
            with `ExperienceStore.attach(name)`; see `arrowbuf.tiers.shm`), or a `Tier` instance.
        name: the store's name (default: the schema's); a shared store's name in /dev/shm.
        tiers: byte budgets per memory tier for a store whose columns live in several tiers, e.g.
            `{"gpu": "8GiB", "host": "16GiB", "disk": "spill/"}` (disk: a spill directory, or `("spill/", "100GiB")`;
            any value may also be a `Tier`). Residency is decided per (column, chunk) by `placement`; budgets are
            never exceeded. The index lives on the host (within the host budget). See `arrowbuf.columns`.
        placement: an `ab.placement` policy (default: `ab.placement.BandwidthAware()` when several tiers are given).
    """

    def __init__(self, schema: Any, capacity: int, sampler: str | Sampler | None = "uniform",
                 rate_limiter: RateLimiter | None = None, seed: int | None = None, *,
                 chunk_rows: int | None = None, final_obs_capacity: int | None = None,
                 max_times_sampled: int | None = None, tier: str | Tier = "host", name: str | None = None,
                 tiers: dict[str, Any] | None = None, placement: Any = None) -> None:
        self.schema: ExperienceSchema = load_schema(schema)
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
            raise InvalidArgument(f"capacity must be a positive number of rows, got {capacity!r}")
        self.capacity = int(capacity)
        self.name = name or self.schema.name
        self.placement_policy: Any = None
        self._closed = False
        if tiers is None:
            self._tier = _make_tier(tier, self.name, self.schema)
            data_tiers = [self._tier]
        else:
            if tier != "host":
                raise InvalidArgument("pass either tier= (one tier) or tiers= (budgets per tier), not both")
            ragged = [f.name for f in self.schema.fields.values() if f.ragged]
            if ragged:
                raise SchemaError(f"ragged fields are not yet supported in a tiered store: {ragged}; "
                                  "drop tiers= for this schema, or make the fields fixed-shape")
            from .tiers import make_tiers

            self._tier, data_tiers = make_tiers(tiers)
        try:
            self._build(data_tiers, chunk_rows, final_obs_capacity, max_times_sampled, sampler, rate_limiter, seed,
                        placement)
        except BaseException:
            for t in {id(t): t for t in [*data_tiers, self._tier]}.values():
                if not t.shared:
                    t.close()
            raise

    def _build(self, data_tiers: list[Tier], chunk_rows: int | None, final_obs_capacity: int | None,
               max_times_sampled: int | None, sampler: Any, rate_limiter: Any, seed: int | None,
               placement: Any) -> None:
        self._data_tiers = data_tiers
        self._data_tier = data_tiers[0]
        self.chunk_rows = int(chunk_rows or default_chunk_rows(self.schema.row_bytes, self.capacity))
        stored = [*self.schema.fields, *SYSTEM_COLUMNS]
        self.directory = ChunkDirectory(self.capacity, self.chunk_rows, stored, [t.name for t in data_tiers],
                                        self._tier)
        self.arena_rows = self.directory.arena_rows
        self.index = RingIndex(self._tier, self.capacity, self.arena_rows)
        # final observations of ended episodes, appended after the ring rows of each next_of source arena
        self._final_sources = sorted({d.next_of for d in self.schema.derived.values()})
        self.final_capacity = self._final_obs_capacity(final_obs_capacity) if self._final_sources else 0
        self._tier.reserve(self._planned_bytes(max_times_sampled))  # a shared tier fails here if it cannot fit
        for t in data_tiers:
            if t is not self._tier and not t.slotted:  # a whole ring of every column (a disk checks its free space)
                t.reserve(self._planned_bytes(None) - 8 * max(1, self.final_capacity))
        if len(data_tiers) > 1:
            self._cols: ColumnArenas = TieredColumnArenas(self.schema, self.directory, self._tier, data_tiers,
                                                          self.final_capacity, self._final_sources, self.index)
        else:
            self._cols = ColumnArenas(self.schema, self.directory, self._data_tier, self.final_capacity,
                                      self._final_sources)
        self._final_owner = self._tier.allocate("index.final_owner", np.dtype(np.int64), max(1, self.final_capacity))
        if self._tier.fresh:  # never re-initialise memory another process already uses
            self._final_owner.fill(-1)
        self._end_fields = list(self.schema.episode_end)
        self._derived_list = list(self.schema.derived.values())
        self._fast = self._fast_plan()
        # episode ids come from the shared header, so writer processes of a shared store never hand out one twice
        self._episodes = EpisodeTracker(self.index.header[HEADER["next_episode_id"]:HEADER["next_episode_id"] + 1])
        self._lock = self._tier.lock("state")  # cross-process locks for a shared tier
        self._cond = threading.Condition(self._lock)
        self._write_lock = self._tier.lock("write")
        self._rng = np.random.default_rng(seed)
        if max_times_sampled is not None and max_times_sampled < 1:
            raise InvalidArgument(f"max_times_sampled must be >= 1, got {max_times_sampled}")
        self._max_times_sampled = int(max_times_sampled or 0)
        self.sampler = make_sampler(sampler)
        self.sampler.bind(self.index, self._rng, has_next=self._has_next if self._max_times_sampled else None)
        self._notify = type(self.sampler).on_valid is not Sampler.on_valid  # skip no-op calls on the append path
        self.rate_limiter = rate_limiter
        self._times_sampled = (self._tier.allocate("index.times_sampled", np.dtype(np.int32), self.arena_rows)
                               if self._max_times_sampled else np.zeros(0, np.int32))
        if self._tier.fresh:
            self._times_sampled.fill(0)
        if isinstance(self._cols, TieredColumnArenas):
            self._cols.initial_placement()
        for t in {id(t): t for t in [self._tier, *data_tiers]}.values():
            if t.budget is not None and t.nbytes() > t.budget:
                raise OutOfSpace(f"{t.name} tier: the store needs {format_bytes(t.nbytes())} there (index, samplers"
                                 f"{', the whole ring of every column' if t is data_tiers[-1] else ''}) but its "
                                 f"budget is {format_bytes(t.budget)}; raise the budget"
                                 + (" or add a disk tier: tiers={..., 'disk': 'spill/'}"
                                    if t is data_tiers[-1] and t.name != "disk" else ""))
        self._placement_target = PlacementTarget(self.schema, self._cols, self.directory, self.index, self.sampler,
                                                 self._lock, self._write_lock, self.capacity, self.name,
                                                 self._data_tier)  # what a placement policy sees of this store
        self.placement_policy = make_placement(placement, len(data_tiers))
        if self.placement_policy is not None:
            self.placement_policy.bind(self._placement_target)
        if self._tier.fresh and self._tier.shared:  # publish what `attach` needs to rebuild this store
            self._tier.seal({"schema": self.schema.to_dict(), "capacity": self.capacity, "chunk_rows": self.chunk_rows,
                             "final_obs_capacity": self.final_capacity or None, "sampler": self.sampler,
                             "rate_limiter": self.rate_limiter, "max_times_sampled": max_times_sampled})

    @classmethod
    def attach(cls, name: str, *, seed: int | None = None, timeout: float = 0.0,
               allow_other_owner: bool = False) -> "ExperienceStore":
        """Open the shared store `name` (made with `tier="shm"`) from any process on the node: the same store over the
        same memory, with the same surface (append, extend, sample, update_priorities, to_table, sql, ...).

        Args:
            name: the shared store's name.
            seed: seed of this process's sampling.
            timeout: seconds to wait for the store to be created and sealed.
            allow_other_owner: open a store that another local user created (refused by default: that user could
                feed this process rows; see docs/security.md).

        Raises:
            StoreNotFound: no live store of that name (its owner died: the janitor reclaimed it).
            StoreNotTrusted: the store belongs to another user (without `allow_other_owner`) or others can write it.
            StoreCorrupt: its manifest or files are malformed or were tampered with; the message names the file.
        """
        from .tiers.shm import SharedMemoryTier, from_spec

        tier = SharedMemoryTier.attach(name, timeout=timeout, allow_other_owner=allow_other_owner)
        try:
            m = tier.manifest
            return cls(m["schema"], m["capacity"], from_spec(m["sampler"]), from_spec(m["rate_limiter"]), seed,
                       chunk_rows=m["chunk_rows"], final_obs_capacity=m["final_obs_capacity"],
                       max_times_sampled=m["max_times_sampled"], tier=tier, name=m["name"])
        except BaseException:
            tier.close()
            raise

    def _planned_bytes(self, max_times_sampled: int | None) -> int:
        """Bytes the arenas will take (checked against a shared tier's free space before anything is written)."""
        rows = self.arena_rows
        data = sum(f.row_bytes * (rows + (self.final_capacity if f.name in self._final_sources else 0))
                   for f in self.schema.fields.values() if not f.ragged)
        return data + 8 * max(1, self.final_capacity) + (4 * rows if max_times_sampled else 0)

    # ------------------------------------------------------------------ construction helpers
    def _final_obs_capacity(self, requested: int | None) -> int:
        spare = self.directory.spare_rows
        if requested is not None:
            if requested < 1:
                raise InvalidArgument(f"final_obs_capacity must be >= 1, got {requested}")
            return max(int(requested), spare)
        row_bytes = sum(self.schema.fields[s].row_bytes for s in self._final_sources)
        if row_bytes * self.capacity <= _SMALL_FINAL_OBS_BYTES:
            return max(self.capacity, spare)
        return max(self.capacity // 16, spare)

    # ------------------------------------------------------------------ properties
    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return (f"ExperienceStore(name={self.name!r}, schema={self.schema.name!r}, size={len(self)}, "
                f"capacity={self.capacity}, sampler={type(self.sampler).__name__})")

    @property
    def _arenas(self) -> dict[str, np.ndarray]:
        """The column arrays (ring rows, then final-observation rows) of a single-tier store."""
        return self._cols.arrays

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.name!r} is closed")

    def _counters(self) -> Counters:
        """What the rate limiter decides on (read under the lock)."""
        idx = self.index
        size = self.sampler.available() if self.sampler.queue else len(idx)
        return Counters(inserts=idx.counter("inserts"), samples=idx.counter("samples"), size=size)

    def _wait_for(self, predicate: Any, timeout: float | None) -> bool:
        """Wait on the condition (lock held) until `predicate()`; False on timeout. None waits not at all."""
        if timeout is None or timeout <= 0:
            return bool(predicate())
        deadline = time.monotonic() + timeout
        pause = 0.0005  # shared tier: other processes' commits cannot notify this condition, so poll (bounded backoff)
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return False
            if self._tier.shared:
                self._cond.wait(min(left, pause))
                pause = min(2 * pause, 0.02)
            else:
                self._cond.wait(left)
        return True

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               n_step: int | None = None, gamma: float = 0.99) -> SampleBatch:
        """Sample `n` items.

        Args:
            n: batch size; uniform sampling is with replacement, so any n works once a row is sampleable (with
                `max_times_sampled`, a batch holds n distinct items: see the constructor).
            columns: columns to gather (default: every field and derived field).
            timeout: seconds to wait for the rate limiter or an empty store; None does not wait.
            n_step: add `n_step_return`, `n_step_discount` and, per derived field, `n_step_<name>` (the bootstrap
                observation) over `n_step` steps of the episode (see `arrowbuf.nstep`).
            gamma: the discount for `n_step`.

        Raises:
            SampleTimeout: nothing could be served within `timeout`.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive number of items, got {n!r}")
        self._check_open()
        names = self.schema.resolve_columns(list(columns) if columns is not None else None)
        if n_step is not None:
            self._check_n_step(n_step, gamma)
        with self._cond:
            seqs, weights = self._select(int(n), timeout)
        if seqs.ndim == 2 and n_step is not None:
            raise InvalidArgument("n_step returns are for transitions; a Sequence sampler returns whole windows")
        if self.placement_policy is not None:
            self._cols.count_access((tuple(names), n_step is not None), seqs.size, self._columns_read, names, n_step)
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
            whole = self._max_times_sampled and not self.sampler.queue
            fix = np.arange(len(seqs)) if whole else np.flatnonzero(bad)
            self.index.count("torn_retries", len(fix))
            with self._cond:
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
        if type(self.sampler).on_sampled is not Sampler.on_sampled:
            with self._cond:
                self.sampler.on_sampled(seqs)
        indices = seqs[:, 0].copy() if seqs.ndim == 2 else seqs
        return SampleBatch(arrays, indices, weights)

    def _check_n_step(self, n_step: int, gamma: float) -> None:
        if not isinstance(n_step, (int, np.integer)) or n_step < 1:
            raise InvalidArgument(f"n_step must be a positive integer, got {n_step!r}")
        if "reward" not in self._cols or self.schema.fields["reward"].shape:
            raise SchemaError("n_step returns need a scalar 'reward' field in the schema")
        if not 0.0 <= gamma <= 1.0:
            raise InvalidArgument(f"gamma must be in [0, 1], got {gamma}")

    def _count_samples(self, seqs: np.ndarray) -> None:
        """Under the lock, as items are selected (so concurrent samples never exceed the limit): count deliveries;
        items sampled `max_times_sampled` times stop being sampleable. A window counts once, at its start row."""
        idx = self.index
        seqs = seqs[:, 0] if seqs.ndim == 2 else seqs
        live = seqs[idx.live(seqs)]
        pos = live % self.arena_rows
        np.add.at(self._times_sampled, pos, 1)
        done = np.unique(pos[self._times_sampled[pos] >= self._max_times_sampled])
        done = done[idx.valid[done]]
        if len(done):
            idx.valid[done] = False
            self.sampler.on_invalid(done)
            idx.count("removed", len(done))

    def _has_next(self, pos: np.ndarray) -> np.ndarray:
        """Mask of positions whose row is stored with its next observation known, sampleable or not: a row that
        `max_times_sampled` removed still serves as a successor and inside windows while it is stored."""
        idx = self.index
        ok = idx.valid[pos]
        used = ~ok & (self._times_sampled[pos] >= self._max_times_sampled)
        if used.any():
            p = pos[used]
            seq = idx.seq[p]
            good = (seq >= idx.lo) & (seq < idx.hi)
            if self._final_sources:  # the next observation is known: a successor, or a final slot still its own
                nxt = idx.next_pos[p]
                good &= nxt != PENDING
                fin = good & (nxt >= self.arena_rows)
                good[fin] = self._final_owner[nxt[fin] - self.arena_rows] == seq[fin]
            ok[used] = good
        return ok

    def _select(self, n: int, timeout: float | None) -> tuple[np.ndarray, np.ndarray | None]:
        """Choose items under the lock, waiting on the rate limiter and for rows."""
        chosen: list[Any] = [None]

        def ready() -> bool:
            self._check_open()
            if self.rate_limiter is not None and not self.rate_limiter.can_sample(n, self._counters()):
                return False
            chosen[0] = self.sampler.select(n, distinct=bool(self._max_times_sampled))
            return chosen[0] is not None

        if not self._wait_for(ready, timeout):
            if self.rate_limiter is not None and not self.rate_limiter.can_sample(n, self._counters()):
                why = self.rate_limiter.blocked_reason(self._counters())
            elif len(self.index) == 0:
                why = "the store is empty"
            else:
                why = f"{type(self.sampler).__name__} cannot serve {n} items from {len(self.index)} stored rows"
                if self._max_times_sampled:
                    why += (f" (max_times_sampled={self._max_times_sampled}: a batch needs {n} distinct eligible "
                            f"items; {self.index.counter('removed')} were used up)")
            wait = "did not wait (timeout=None)" if timeout is None else f"waited {timeout}s"
            raise SampleTimeout(f"sample({n}) from {self.name!r}: {why}; {wait}. Add data or pass timeout= to wait")
        self.index.count("samples", n)
        if self._max_times_sampled:
            self._count_samples(chosen[0][0])
        self._cond.notify_all()
        return chosen[0]

    def _columns_read(self, names: list[str], n_step: int | None) -> list[str]:
        """The stored columns a sample of `names` reads (what placement counts as accesses)."""
        out = []
        for n in names:
            d = self.schema.derived.get(n)
            out.append(d.next_of if d is not None else n)
        if n_step is not None:
            out += ["reward", *self._end_fields, *(d.next_of for d in self._derived_list)]
        return list(dict.fromkeys(out))

    def _gather_stable(self, seqs: np.ndarray, names: list[str], n_step: int | None, gamma: float,
                       depth: int = 0) -> dict[str, Any]:
        """`_gather`, and on a tiered store again for the items whose chunks moved meanwhile (their old copy may
        have been released or reused while they were read): a seqlock over the slot table."""
        cols = self._cols
        if cols.direct:
            return self._gather(seqs, names, n_step, gamma)
        assert isinstance(cols, TieredColumnArenas)
        for _ in range(100):
            flips, e0 = cols.flips, cols.epoch.copy()
            reads: list = []
            arrays = self._gather(seqs, names, n_step, gamma, reads)
            if cols.flips == flips:  # nothing moved at all (the common case)
                return arrays
            moved = cols.moved(e0, reads, len(seqs))
            if moved is None or not moved.any():
                return arrays
            cols.counters["regathers"] += int(moved.sum())
            if moved.all() or depth > 8:
                continue
            fix = np.flatnonzero(moved)
            sub = self._gather_stable(seqs[fix], names, n_step, gamma, depth + 1)
            for k in arrays:
                arrays[k] = _assign_rows(arrays[k], fix, sub[k])
            return arrays
        raise ArrowbufError("sample could not read a stable batch: chunks kept moving for 100 attempts")

    def _gather(self, seqs: np.ndarray, names: list[str], n_step: int | None = None,
                gamma: float = 0.99, reads: list | None = None) -> dict[str, Any]:
        """One `take` per column per tier (the sample path: vectorised, no per-row Python).

        `seqs` is [B] for transitions or [B, T] for sequence windows; arrays come back [B, ...] or [B, T, ...].
        On a tiered store, `reads` collects (column, positions) of what was read, for the moved-chunk check.
        """
        idx = self.index
        cols = self._cols
        tracked = reads is not None
        shape = seqs.shape
        pos = (seqs % self.arena_rows).reshape(-1)
        out: dict[str, Any] = {}
        nxt = None
        for name in names:
            if name in cols.arrays:
                col = cols.take(name, pos, reads) if tracked else cols.take(name, pos)  # type: ignore[call-arg]
            elif name in self.schema.derived:
                if nxt is None:
                    nxt = idx.next_pos[pos]
                src = self.schema.derived[name].next_of
                col = cols.take_next(src, nxt, reads) if tracked else cols.take_next(src, nxt)  # type: ignore
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
            trunc = self.schema.truncation  # end fields that bootstrap; the others terminate
            terminal = [column(f) for f in self._end_fields if f not in trunc]
            truncation = [column(f) for f in self._end_fields if f in trunc]
            ret, disc, last = n_step_returns(idx, column("reward"), terminal, truncation, pos, n_step, gamma,
                                             self._has_next if self._max_times_sampled else None)
            out["n_step_return"], out["n_step_discount"] = ret, disc
            last_next = idx.next_pos[last]
            for d in self._derived_list:
                out[f"n_step_{d.name}"] = (cols.take_next(d.next_of, last_next, reads) if tracked  # type: ignore
                                           else cols.take_next(d.next_of, last_next))
            out["_n_step_last"] = last
        return out

    def _torn(self, seqs: np.ndarray, arrays: dict[str, Any]) -> np.ndarray:
        """After a gather: per item, whether a writer recycled any row (or final-observation slot) it read."""
        idx = self.index
        pos = seqs % self.arena_rows
        ok = idx.seq[pos] == seqs
        if self._final_sources:
            nxt = idx.next_pos[pos]
            fin = nxt >= self.arena_rows
            if fin.any():
                ok[fin] &= self._final_owner[nxt[fin] - self.arena_rows] == seqs[fin]
            last = arrays.get("_n_step_last")
            if last is not None:
                lnext = idx.next_pos[last]
                fin = lnext >= self.arena_rows
                if fin.any():
                    ok[fin] &= self._final_owner[lnext[fin] - self.arena_rows] == idx.seq[last[fin]]
        return ~ok.reshape(len(seqs), -1).all(axis=1)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set the priorities of sampled items; ids whose row was evicted or recycled are ignored (and counted).

        Returns the number of ids applied.

        Raises:
            InvalidArgument: counts differ, or a priority is NaN, infinite, negative or too large
                (`samplers.validate_priorities`); nothing is applied.
        """
        seqs, pri = validate_priorities(indices, priorities)
        with self._lock:
            live = self.index.live(seqs)
            if live.any():
                self.sampler.update_priorities(seqs[live] % self.arena_rows, pri[live])
            self.index.count("priority_updates_ignored", int((~live).sum()))
        return int(live.sum())

    # ------------------------------------------------------------------ inspection
    def to_table(self, columns: Iterable[str] | None = None) -> pa.Table:
        """The live rows, oldest first, as a `pa.Table` of the stored columns.

        Fixed-size columns are zero-copy views of the arenas (bool columns are bit-packed copies). The views stay
        valid until the ring overwrites those rows: keep a long-lived table with `.combine_chunks()` or pass it
        through `pa.concat_tables` with a copy.
        """
        self._check_open()
        schema = self.schema.to_arrow()
        names = list(columns) if columns is not None else schema.names
        for c in names:
            if c not in schema.names:
                raise SchemaError(f"unknown stored column {c!r}; expected one of {schema.names}")
        out_schema = pa.schema([schema.field(c) for c in names], metadata=schema.metadata)
        with self._lock:
            lo, hi = self.index.lo, self.index.hi
            ragged = self._cols.ragged_snapshot()
        idx = self.index
        batches = []
        for slot, p0, p1, first in self.directory.live_chunks(lo, hi):
            arrays = []
            for c in names:
                if c in self._cols:
                    arrays.append(_column_view(self._cols.view(c, p0, p1), self.schema.fields[c]))
                elif c in ragged:
                    off = p0 - slot * self.chunk_rows
                    arrays.append(ragged[c][slot].slice(off, p1 - p0))
                elif c == "seq":
                    arrays.append(pa.array(np.arange(first, first + p1 - p0, dtype=np.int64)))
                else:
                    arrays.append(pa.array(getattr(idx, c)[p0:p1]))
            batches.append(pa.RecordBatch.from_arrays(arrays, schema=out_schema))
        if not batches:
            return out_schema.empty_table()
        return pa.Table.from_batches(batches, schema=out_schema)

    def to_pandas(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows as a pandas DataFrame (tensor columns as arrays per row). Needs `arrowbuf[query]`."""
        from .frames import table_to_pandas

        return table_to_pandas(self.to_table(columns))

    def to_polars(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows as a Polars DataFrame (tensors as Array columns). Needs `arrowbuf[query]`."""
        from .frames import table_to_polars

        return table_to_polars(self.to_table(columns))

    def sql(self, query: str) -> pa.Table:
        """Run DuckDB SQL over the live rows; the store is the table `experience`. Needs `arrowbuf[query]`."""
        from .frames import run_sql

        return run_sql(self, query)

    def episodes(self) -> pa.Table:
        """One row per episode with live rows: episode_id, length, return, first_seq, last_seq, complete."""
        from .frames import episode_table

        return episode_table(self)

    def stats(self) -> dict[str, Any]:
        """Size, counters and memory of the store."""
        with self._lock:
            idx = self.index
            out = {
                "name": self.name,
                "schema": self.schema.name,
                "size": len(idx),
                "capacity": self.capacity,
                "first_seq": idx.lo,
                "next_seq": idx.hi,
                "inserts": idx.counter("inserts"),
                "samples": idx.counter("samples"),
                "chunk_rows": self.chunk_rows,
                "chunks": self.directory.num_slots,
                "sealed_chunks": self.directory.sealed_chunks(idx.lo, idx.hi),
                "open_episodes": self._episodes.open_episodes(),
                "final_obs_capacity": self.final_capacity,
                "bytes": {t.name: t.nbytes() for t in {id(t): t for t in [self._tier, *self._data_tiers]}.values()},
                "final_obs_dropped": idx.counter("final_obs_dropped"),
                "torn_retries": idx.counter("torn_retries"),
                "priority_updates_ignored": idx.counter("priority_updates_ignored"),
                "removed": idx.counter("removed"),
                **self.sampler.describe(),
            }
            if isinstance(self._cols, TieredColumnArenas):
                out["placement"] = dict(self._cols.counters)
        return out

    def placement(self, explain: bool = False) -> pa.Table:
        """Where the columns live: one row per (column, tier) with the chunk slots and bytes there.

        With `explain=True`, also why (from the placement policy's last step): the column's share of sampled rows
        (`access_share`, `rows_per_s`), the share of the sampling mass in those chunks (`mass`), their value per
        byte, the tier's read bandwidth (`read_gbps`) and a sentence (`why`). See `arrowbuf.placement`.
        """
        self._check_open()
        with self._lock:
            return placement_table(self._placement_target, self.placement_policy, explain)

    def to_cudf(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows' scalar and metadata columns as a cuDF DataFrame (on the GPU). cuDF has no fixed-shape
        tensor type: sample tensor columns with `sample(...).to_torch("cuda")` (or a GPU tier). Needs
        `pip install 'arrowbuf[gpu]'` and a GPU."""
        from .tiers.gpu import to_cudf

        scalar = [n for n, f in self.schema.fields.items() if not f.shape and not f.ragged]
        names = list(columns) if columns is not None else [*scalar, "episode_id", "step", "seq"]
        tensors = [n for n in names if n in self.schema.fields and (self.schema.fields[n].shape
                                                                     or self.schema.fields[n].ragged)]
        if tensors:
            raise SchemaError(f"to_cudf() takes scalar and metadata columns; {tensors} are tensor or list columns "
                              "(cuDF has no fixed-shape tensor type): read them with sample(...).to_torch('cuda')")
        return to_cudf(self.to_table(names))

    def chunks(self) -> pa.Table:
        """The chunk directory of the live rows: slot, first_seq, rows, sealed, tier per column."""
        with self._lock:
            return self.directory.table(self.index.lo, self.index.hi)

    # ------------------------------------------------------------------ persistence hooks (owner: persist, issue 15)
    # Thin entry points into `arrowbuf.persist`; `_persist_parts` is the one place persist gets the store's parts.
    def _persist_parts(self) -> Any:
        """The components `arrowbuf.persist` checkpoints and restores (see `arrowbuf.persist.parts`)."""
        from .persist.parts import StoreParts

        self._check_open()
        config = {"name": self.name, "capacity": self.capacity, "chunk_rows": self.chunk_rows,
                  "final_obs_capacity": self.final_capacity or None,
                  "max_times_sampled": self._max_times_sampled or None}
        tier = "tiered" if isinstance(self._cols, TieredColumnArenas) else self._tier.name
        return StoreParts(self.schema, self._cols, self.directory, self.index, self.sampler, self._episodes,
                          self._rng, self._final_owner, self._times_sampled, self._lock, self._write_lock, config,
                          self.rate_limiter, tier)

    def checkpoint(self, path: Any, keep: int | None = None, background: bool = False,
                   compression: str | None = None) -> Any:
        """Write a consistent, incremental, atomic checkpoint into directory `path`; writers and samplers go on.

        The snapshot point is the call: the checkpoint holds the rows committed then (one contiguous seq range
        ending there, each row exactly as committed) and the sampler, rate-limiter, episode and RNG state of that
        instant. Sealed chunks already in `path` are reused; only new chunks, the open tail and the state files are
        written; `_manifest.json` is replaced atomically, so a crash leaves the previous checkpoint restorable. If
        the ring overwrites rows faster than they are copied, the oldest chunks that were overwritten meanwhile
        (and everything older) are left out: the checkpoint then starts at the oldest chunk still intact
        (`dropped_rows` says how many went). Never a torn row. Layout: docs/format.md.

        Args:
            path: the checkpoint directory (an Arrow IPC dataset; made if missing).
            keep: keep the newest `keep` checkpoints (their files); None keeps all.
            background: return a `CheckpointHandle` (`.wait()`, `.progress`) at once and write in a thread.
            compression: None (uncompressed, memory-mappable: the default), or "zstd"/"lz4" for archives.

        Returns:
            A summary dict (generation, rows, files written and reused, bytes), or a handle with `background=True`.
        """
        from .persist import checkpoint

        return checkpoint(self, path, keep=keep, background=background, compression=compression)

    @classmethod
    def restore(cls, path: Any, *, tier: str | Tier = "host", tiers: dict[str, Any] | None = None,
                seed: int | None = None, name: str | None = None, schema: Any = None) -> "ExperienceStore":
        """The store checkpointed at `path`: same rows under the same ids, same sampler, limiter and episode state.

        Args:
            path: a checkpoint directory (`checkpoint`).
            tier: where the restored store lives ("host", "shm", ...); tiers: byte budgets, as the constructor.
            seed: None continues the checkpointed RNG (the same batches the original would have drawn next);
                an int reseeds sampling.
            name: the restored store's name (default: the checkpointed one's).
            schema: when given, the schema the caller expects: a checkpoint whose fields differ raises SchemaError.

        Raises:
            StoreCorrupt: a file is missing, truncated or corrupt (the message names it).
            SchemaError: `schema` differs from the checkpoint's (the message names the fields).
        """
        from .persist import restore

        return cast("ExperienceStore", restore(path, tier=tier, tiers=tiers, seed=seed, name=name, schema=schema,
                                               cls=cls))

    def export(self, path: Any, format: str = "parquet", partition_by: Any = None,
               compression: str | None = None) -> dict[str, Any]:
        """Write the live rows as an offline-RL dataset (Parquet or Arrow IPC files, derived columns such as
        `next_obs` materialised, optional hive partitioning by `partition_by` columns); `ab.open_dataset` and
        `ExperienceStore.from_dataset` read it back. Writers wait while rows are copied (sampling goes on).
        Returns rows and path. See `arrowbuf.persist.datasets`."""
        from .persist import export

        return export(self, path, format=format, partition_by=partition_by, compression=compression)

    @classmethod
    def from_dataset(cls, path: Any, capacity: int | None = None, *, schema: Any = None,
                     **kwargs: Any) -> "ExperienceStore":
        """A new store filled from a dataset directory: an arrowbuf export or checkpoint, Parquet with arrowbuf's
        schema, or a Minari dataset with the Arrow backend (the newest `capacity` rows when there are more; default:
        all). `schema=` checks the dataset against a schema (SchemaError naming the fields); other keyword
        arguments go to the constructor (sampler, seed, tier, ...)."""
        from .persist import from_dataset

        return cast("ExperienceStore", from_dataset(path, capacity, schema=schema, **kwargs))
    # ------------------------------------------------------------------ end of persistence hooks

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the store's memory; idempotent. Waiting samples and inserts raise `StoreClosed`.

        Shared store: releases this process's mappings and lease. The creator's close also removes the store's name
        (as `unlink`): processes still attached keep working on their mappings until they close; new attaches fail.
        """
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.placement_policy is not None:  # no move may run while the arenas go
            self.placement_policy.close()
        with self._write_lock:
            self._cols.close()
            for t in {id(t): t for t in [*self._data_tiers, self._tier]}.values():
                t.close()

    def unlink(self) -> None:
        """Shared store: remove its name now (from any process); users keep their mappings until they close."""
        self._tier.unlink()

    def __reduce__(self) -> Any:
        if self._tier.shared:  # a shared store pickles by name: the receiving process attaches to it
            return (ExperienceStore.attach, (self.name,))
        raise TypeError(f"store {self.name!r} lives in this process's heap and cannot be pickled; "
                        "create it with tier='shm' to share it with other processes")

    def __enter__(self) -> "ExperienceStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_tier(tier: str | Tier, name: str, schema: ExperienceSchema) -> Tier:
    if isinstance(tier, Tier):
        return tier
    if tier == "host":
        return HostTier()
    if tier == "shm":
        ragged = [f.name for f in schema.fields.values() if f.ragged]
        if ragged:
            raise SchemaError(f"ragged fields are not yet supported in shared memory: {ragged}; "
                              "use tier='host' for this schema, or make the fields fixed-shape")
        from .tiers.shm import SharedMemoryTier

        return SharedMemoryTier.create(name)
    raise InvalidArgument(f"unknown tier {tier!r}; expected 'host', 'shm' or a Tier instance")


def _column_view(values: np.ndarray, spec: FieldSpec) -> pa.Array:
    values = values.view()
    values.flags.writeable = False  # a zero-copy view of the arena (shared memory, maybe): nobody writes through it
    if spec.shape:
        return pa.FixedShapeTensorArray.from_numpy_ndarray(values)
    return pa.array(values)


def _assign_rows(arr: Any, rows: np.ndarray, values: Any) -> Any:
    """`arr` with `arr[rows] = values`: in place for numpy arrays and torch tensors, a new array for Arrow."""
    if isinstance(arr, np.ndarray):
        arr[rows] = values
        return arr
    if not isinstance(arr, (pa.Array, pa.ChunkedArray)):  # a torch tensor (GPU tier)
        import torch

        arr[torch.from_numpy(np.asarray(rows)).to(arr.device)] = values.to(arr.device) if hasattr(values, "to") \
            else torch.from_numpy(np.asarray(values)).to(arr.device)
        return arr
    return _replace_rows(arr, rows, values)


def _replace_rows(arr: pa.Array, rows: np.ndarray, values: pa.Array) -> pa.Array:
    pylist = arr.to_pylist()
    for i, v in zip(rows.tolist(), values.to_pylist()):
        pylist[i] = v
    return pa.array(pylist, type=arr.type)
