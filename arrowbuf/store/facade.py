"""ExperienceStore: a ring of schema-validated experience in Arrow-compatible columnar arenas.

Usage::

    store = ExperienceStore(load_schema("schemas/atari.yaml"), capacity=100_000, seed=0)
    store.extend({"obs": obs, "action": a, "reward": r, "terminated": term, "truncated": trunc,
                  "next_obs": next_obs})          # next_obs is read only on the steps that end an episode
    batch = store.sample(256)                       # SampleBatch; batch.to_numpy()["next_obs"] is derived
    store.sql("SELECT episode_id, sum(reward) FROM experience GROUP BY 1")

The store is a facade: it builds the engine's parts (`arrowbuf.engine.core.StoreCore`: ring index, column arenas,
sampler, locks) and delegates writing to a `StoreWriter` (`arrowbuf.engine.writer`: append, extend, end_episode; a
batch commits once, atomically) and reading to a `StoreReader` (`arrowbuf.engine.reader`: sample, update_priorities,
consistent snapshots for to_table, sql and episodes). Every change goes through the store's write path
(`arrowbuf.store.writes`: direct, or journaled by `arrowbuf.store.durable`). Column bytes live in
`arrowbuf.ring.columns` (one arena per column, or per column and tier for a store with `tiers=`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Literal, cast, overload

import numpy as np
import pyarrow as pa

from ..delivery.batch import SampleBatch
from ..engine.consume import ConsumeTracker, check_store_options
from ..engine.core import StoreCore
from ..engine.episodes import EpisodeTracker
from ..engine.pieces import ExtendInPieces
from ..engine.pieces_writer import PiecesWriter
from ..engine.reader import RowSnapshot, StoreReader
from ..engine.update import StoreUpdater
from ..engine.writer import StoreWriter
from ..errors import InvalidArgument, OutOfSpace, SchemaError, StoreClosed, StoreCorrupt
from ..observe.meter import ProgressSink
from ..observe.timings import Timings, timed
from ..options import StoreOptions
from ..placement import PlacementTarget, make_placement
from ..rate_limiters import RateLimiter
from ..ring.chunks import ChunkDirectory, default_chunk_rows
from ..ring.columns import ColumnArenas
from ..ring.index import HEADER, RingIndex
from ..ring.reservations import Reservations
from ..ring.tiered import TieredColumnArenas
from ..samplers import Sampler, make_sampler
from ..schema import SYSTEM_COLUMNS, ExperienceSchema, load_schema
from ..tiers.base import Tier, format_bytes
from ..tiers.host import HostTier
from .pending import PendingWrite
from .views import StoreViews, ViewParts
from .writes import DirectWrites, StoreParts, Writes

_SMALL_FINAL_OBS_BYTES = 64 << 20


class ExperienceStore:
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
            never exceeded. The index lives on the host (within the host budget). See `arrowbuf.ring.columns`.
        placement: an `ab.placement` policy (default: `ab.placement.BandwidthAware()` when several tiers are given).
        tasks: names of the tasks that `consume` rows (each sees every row once; rows wait for them before
            eviction); more with `add_task` (not on a shared store: its tasks are fixed when it is created, and every
            process that attaches consumes from the same state). See `arrowbuf.engine.consume`.
        max_staleness: admission control by policy version: rows older than `policy_version - max_staleness`
            are refused, rows newer than `policy_version + max_staleness` wait (`InsertTimeout`); stale rows may be
            evicted unconsumed. Needs an integer `policy_version` field.
        token_field: the ragged field `consume(max_tokens=...)` counts (default: `response_tokens`, or the only
            ragged field).
        observe: record latency histograms of extend, sample, consume and update, and the lineage of every row
            (writer, time, policy version; per task consumer, time, staleness) for `/metrics`, `sql("... FROM
            lineage")` and the inspector; False turns both off. A shared-memory store records no lineage (its
            writers are other processes). See docs/observability.md.
        durable: a directory for checkpoints and a journal (write-ahead log): every acknowledged change (rows,
            updates, priorities, tasks, policy_version, consumption) survives a crash; `ExperienceStore.restore(DIR)`
            brings it back. See `arrowbuf.store.durable` and docs/durability.md. None: no journal, no cost.
        durability: with `durable=`: "group" (default: group commit, one fsync shared by the writers waiting at
            once, acks wait for it), "batch" (an fsync before each ack) or "os" (no fsync: survives a process kill,
            not a machine crash).
    """

    def __init__(self, schema: Any, capacity: int | None = None, sampler: str | Sampler | None = "uniform",
                 rate_limiter: RateLimiter | None = None, seed: int | None = None, *,
                 chunk_rows: int | None = None, final_obs_capacity: int | None = None,
                 max_times_sampled: int | None = None, tier: str | Tier = "host", name: str | None = None,
                 tiers: dict[str, Any] | None = None, placement: Any = None, tasks: Any = None,
                 max_staleness: int | None = None, token_field: str | None = None, observe: bool = True,
                 durable: Any = None, durability: str = "group", options: StoreOptions | None = None) -> None:
        self.schema: ExperienceSchema = load_schema(schema)
        if options is None:
            if capacity is None:
                raise InvalidArgument("ExperienceStore(schema, capacity): capacity (rows) is required, or pass "
                                      "options=ab.StoreOptions(capacity=...)")
            options = StoreOptions(
                capacity=capacity, sampler="uniform" if sampler is None else sampler, rate_limiter=rate_limiter,
                seed=seed, chunk_rows=chunk_rows, final_obs_capacity=final_obs_capacity,
                max_times_sampled=max_times_sampled, tier=tier, name=name, tiers=tiers, placement=placement,
                tasks=tasks, max_staleness=max_staleness, token_field=token_field,
                observe=observe, durable=durable, durability=durability)
        elif capacity is not None or any(v is not d for v, d in (
                (sampler, "uniform"), (rate_limiter, None), (seed, None), (chunk_rows, None),
                (final_obs_capacity, None), (max_times_sampled, None), (tier, "host"), (name, None), (tiers, None),
                (placement, None), (tasks, None), (max_staleness, None), (token_field, None), (observe, True),
                (durable, None), (durability, "group"))):
            raise InvalidArgument("pass the store's options either as keywords or as options=StoreOptions(...), "
                                  "not both (options.replace(...) changes some of them)")
        o = options
        #: latency histograms of extend, sample, consume, update (`arrowbuf.observe.timings`); None: not recorded
        self.timings: Timings | None = Timings() if o.observe else None
        self._writes: Writes | None = None
        self._views: StoreViews | None = None
        check_store_options(o.tier, o.sampler, o.tasks)  # before anything is allocated
        self.capacity = o.capacity
        self.name = o.name or self.schema.name
        self.placement_policy: Any = None
        self._core: StoreCore | None = None
        if o.tiers is None:
            self._tier = _make_tier(o.tier, self.name, self.schema)
            data_tiers = [self._tier]
        else:
            if o.tier != "host":
                raise InvalidArgument("pass either tier= (one tier) or tiers= (budgets per tier), not both")
            from ..tiers import make_tiers

            self._tier, data_tiers = make_tiers(o.tiers)
        try:
            self._build(data_tiers, o)
            assert self._core is not None  # per-task consumption, staleness, groups
            self._consume: ConsumeTracker = ConsumeTracker(self._core, self._reader, o.tasks, o.max_staleness,
                                                           o.token_field)
            self._core.consume = self._consume
            if self._consume.holds:
                self._writer.hold = self._consume
            if o.observe and not self._tier.shared:
                self._core.lineage = self._make_lineage()
            #: the options this store was built from, as built (chunk rows and final-observation slots resolved)
            self.options = o.replace(name=self.name, chunk_rows=self.chunk_rows,
                                     final_obs_capacity=self.final_capacity or None, sampler=self.sampler,
                                     tasks=self._consume.tasks or None,
                                     max_staleness=self._consume.max_staleness,
                                     token_field=self._consume.token_field)
            self._core.options = self.options
            if self._tier.fresh and self._tier.shared:  # publish what `attach` needs to rebuild this store
                self._tier.seal({"schema": self.schema.to_dict(), **self.options.to_dict()})
            if o.durable is not None:
                from .durable import DurableWrites

                self._writes = DurableWrites.create(os.fspath(o.durable), o.durability, self._parts(),
                                                    direct=o.journal_direct)
            else:
                self._writes = DirectWrites(self._parts())
            tiers = list({id(t): t for t in [self._tier, *self._data_tiers]}.values())
            self._views = StoreViews(
                ViewParts(self.name, self.schema, self._core, self._reader, self._writer, self._consume,
                          self._episodes, tiers, self.timings, self.placement_policy))
        except BaseException:
            for t in {id(t): t for t in [*data_tiers, self._tier]}.values():
                if not t.shared or (t.fresh and not getattr(t, "sealed", True)):  # a shared store nobody attached
                    t.close()
            raise

    def _build(self, data_tiers: list[Tier], o: StoreOptions) -> None:
        chunk_rows, max_times_sampled = o.chunk_rows, o.max_times_sampled
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
        self.final_capacity = self._final_obs_capacity(o.final_obs_capacity) if self._final_sources else 0
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
        # episode ids come from the shared header, so writer processes of a shared store never hand out one twice
        self._episodes = EpisodeTracker(self.index.header[HEADER["next_episode_id"]:HEADER["next_episode_id"] + 1])
        self._lock = self._tier.lock("state")  # cross-process locks for a shared tier
        self._write_lock = self._tier.lock("write")
        self._rng = np.random.default_rng(o.seed)
        if max_times_sampled is not None and max_times_sampled < 1:
            raise InvalidArgument(f"max_times_sampled must be >= 1, got {max_times_sampled}")
        self._max_times_sampled = int(max_times_sampled or 0)
        self.sampler = make_sampler(o.sampler)
        self.rate_limiter = o.rate_limiter
        self._times_sampled = (self._tier.allocate("index.times_sampled", np.dtype(np.int32), self.arena_rows)
                               if self._max_times_sampled else np.zeros(0, np.int32))
        if self._tier.fresh:
            self._times_sampled.fill(0)
        self._core = StoreCore(self.schema, self.name, self.capacity, self._tier, self._cols, self.directory,
                               self.index, self.sampler, o.rate_limiter, self._rng, self._episodes, self._final_owner,
                               self._times_sampled, self._max_times_sampled, self._lock, self._write_lock,
                               Reservations(self._tier, self.index.header, HEADER["hi"]))
        self._cond = self._core.cond
        self._writer = StoreWriter(self._core)
        self._pieces = PiecesWriter(self._writer)  # extends that arrive in pieces (`begin_extend`)
        self._reader = StoreReader(self._core)
        self._updater = StoreUpdater(self._core)  # store.update
        self.sampler.bind(self.index, self._rng,
                          has_next=self._reader.has_next if self._max_times_sampled else None)
        self._cols.initial_placement()
        for t in {id(t): t for t in [self._tier, *data_tiers]}.values():
            if t.budget is not None and t.nbytes() > t.budget:
                raise OutOfSpace(f"{t.name} tier: the store needs {format_bytes(t.nbytes())} there (index, samplers"
                                 f"{', the whole ring of every column' if t is data_tiers[-1] else ''}) but its "
                                 f"budget is {format_bytes(t.budget)}; raise the budget"
                                 + (" or add a disk tier: tiers={..., 'disk': 'spill/'}"
                                    if t is data_tiers[-1] and t.name != "disk" else ""))
        self.placement_policy = make_placement(o.placement, len(data_tiers))
        if self.placement_policy is not None:
            target: PlacementTarget = self._core  # a policy sees the internals only through this Protocol
            self.placement_policy.bind(target)
            self._reader.count_access = True

    def _parts(self) -> StoreParts:
        assert self._core is not None
        return StoreParts(self._core, self._writer, self._reader, self._updater, self._consume)

    @property
    def _v(self) -> StoreViews:
        """The store's read-only views (`arrowbuf.store.views`): set when the store is built."""
        if self._views is None:
            self._check_open()
            raise StoreClosed(f"store {self.name!r} is not built")
        return self._views

    @property
    def _w(self) -> Writes:
        """The store's write path (`arrowbuf.store.writes`): set when the store is built."""
        if self._writes is None:
            self._check_open()
            raise StoreClosed(f"store {self.name!r} is not built")
        return self._writes

    @property
    def _durable(self) -> Any:
        """The durable write path (`arrowbuf.store.durable.DurableWrites`: its `journal`, what its restore
        `replayed`), or None: for tests and crash tools that look at the journal."""
        return self._writes if self._writes is not None and self._writes.journal is not None else None

    def _make_lineage(self) -> Any:
        from ..observe.lineage import for_core

        return for_core(self._core, lambda: self._consume.policy_version, self._consume.tasks,
                        self._consume.version_view())

    @classmethod
    def attach(cls, name: str, *, seed: int | None = None, timeout: float = 0.0,
               allow_other_owner: bool = False) -> ExperienceStore:
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
        from ..tiers.shm import SharedMemoryTier

        tier = SharedMemoryTier.attach(name, timeout=timeout, allow_other_owner=allow_other_owner)
        try:
            m = tier.manifest
            where = f"shared store {name!r}: its manifest {tier.manifest_file}"
            try:
                schema = load_schema(m["schema"])
            except SchemaError as exc:
                raise StoreCorrupt(f"{where} has an invalid schema ({str(exc)[:300]}); the store cannot be attached. "
                                   "Recreate it (or remove it with `arrowbuf shm rm`)") from None
            options = StoreOptions.from_dict(m, where, seed=seed, tier=tier)
            try:
                return cls(schema, options=options)
            except (InvalidArgument, SchemaError) as exc:  # what the manifest records does not fit together
                raise StoreCorrupt(f"{where} records a store that cannot be rebuilt ({str(exc)[:300]}); the store "
                                   "cannot be attached. Recreate it (or remove it with `arrowbuf shm rm`)") from None
        except BaseException:
            tier.close()
            raise

    def _planned_bytes(self, max_times_sampled: int | None) -> int:
        """Bytes the arenas will take (checked against a shared tier's free space before anything is written)."""
        rows = self.arena_rows
        data = sum(f.row_bytes * (rows + (self.final_capacity if f.name in self._final_sources else 0))
                   for f in self.schema.fields.values() if not f.ragged)
        if self._tier.shared:  # ragged fields in tier memory (arrowbuf.ring.ragged_arena)
            from ..ring.ragged_arena import planned_bytes

            data += sum(planned_bytes(f, self.chunk_rows, self.directory.num_slots, rows)
                        for f in self.schema.fields.values() if f.ragged)
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
        return self._core is None or self._core.closed

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"store {self.name!r} is closed")

    # ------------------------------------------------------------------ writing (StoreWriter)
    @property
    def takes_pieces(self) -> bool:
        """Whether this store takes an extend in pieces at all (`begin_extend`; `ab.PieceSink`): not a durable store
        (a batch is journaled whole), nor one whose writes wait for tasks, a rate limiter or final observations, nor
        a tiered one."""
        return self._w.accepts_pieces and self._pieces.ok(1, set())

    def begin_extend(self, rows: int, names: Any) -> ExtendInPieces | None:
        """One extend of `rows` rows (columns `names`) that arrives in pieces, each copied straight into the ring
        (`arrowbuf.engine.pieces.ExtendInPieces`: write, commit, abort; the guarantees of one `extend`), or None
        when this store takes such a batch only whole (`PiecesWriter.ok`: durable, tiered, tasks, a rate
        limiter, derived fields, episode ends or ragged fields in a shared store): then assemble it and call
        `extend`. With ragged fields the sink holds the write lock until its commit or abort."""
        if not self._w.accepts_pieces or not self._pieces.ok(int(rows), set(names)):
            return None
        return ExtendInPieces(self.schema, self._pieces, int(rows))

    def append(self, step: dict[str, Any], *, timeout: float | None = None) -> int:
        """Add one step (a dict of scalars and arrays). Returns the new row's id (an int: its seq).

        Steps that already have the schema's dtypes and shapes take a scalar fast path; anything else goes through
        the full validation of `extend` (same errors, same result).

        Raises:
            SchemaError: the step does not match the schema; nothing is stored.
            InsertTimeout: the rate limiter held the insert back past `timeout` seconds.
        """
        return self._w.append(step, timeout)

    @overload
    def extend(self, batch: Any, *, timeout: float | None = None, wait: Literal[True] = True) -> np.ndarray: ...
    @overload
    def extend(self, batch: Any, *, timeout: float | None = None, wait: Literal[False]) -> PendingWrite: ...

    @timed("extend")
    def extend(self, batch: Any, *, timeout: float | None = None, wait: bool = True) -> Any:
        """Add many steps: a dict of arrays with a leading dim, a `pa.RecordBatch` or a `pa.Table`.

        The batch is atomic: its rows become visible to `sample`, `len` and `to_table` all at once, when this
        returns, and a writer that dies before that leaves none of them (`arrowbuf.engine.writer`). A batch longer than
        the capacity keeps its newest rows (the older ones are counted as inserted but never visible).

        Returns:
            The new rows' ids, a 1-D `np.ndarray[int64]` (their seqs; the ids `SampleBatch.indices` uses and
            `update_priorities` takes). With `wait=False`, a `PendingWrite` at once: the rows are stored and
            visible as above, `.ids` are their ids, `.wait()` / `.durable` say when they are durable under a
            durable store's policy (`arrowbuf.store.pending`; without `durable=` it is durable at once).

        Raises:
            SchemaError: the batch does not match the schema; nothing is stored.
            InsertTimeout: the rate limiter held the insert back past `timeout` seconds (a writer waits for the
                limiter without holding the store's write lock: other writers go on).
        """
        return self._w.extend(batch, timeout, wait)

    def end_episode(self, actor: Any = None, **final: Any) -> bool:
        """End `actor`'s open episode at its last stored step, so that step becomes sampleable now.

        With a derived field (`next_obs`), the last step of an open episode waits for the episode's next step to know
        its next observation; until then it is not sampleable, and a FIFO queue (`samplers.Fifo`) stops in front of it:
        an idle actor's open step holds back everything written after it. `end_episode` gives that step its next
        observation as a final one (pass each derived field, e.g. `end_episode(actor, next_obs=obs)`: the observation
        the actor sees now) and treats it as a truncation: n-step returns bootstrap from it. The actor's next step
        starts a new episode.

        Args:
            actor: the stream (the `actor` key its rows were written with; None: rows written without one).
            **final: the derived fields of the step's successor (needed when the step waits for them).

        Returns:
            True when a waiting step became sampleable; False when the stream had none (its episode just ends).

        Raises:
            SchemaError: a derived field is missing or has the wrong shape.
        """
        return self._w.end_episode(actor, final)

    def flush(self, actor: Any = None, **final: Any) -> bool:
        """Deprecated name of `end_episode` (writers' `flush` waits for acknowledgements; this one never did)."""
        warnings.warn("ExperienceStore.flush(actor, ...) is deprecated: it ends an episode stream; call "
                      "end_episode(actor, ...) instead", DeprecationWarning, stacklevel=2)
        return self.end_episode(actor, **final)

    # ------------------------------------------------------------------ fields filled later
    @timed("update")
    def update(self, ids: Any, values: dict[str, Any]) -> int:
        """Fill fields declared `later: true` of stored rows: `store.update(ids, {"reward": r})`.

        Atomic per call and validated like `extend`; ids of evicted or replaced rows are skipped and counted in
        `stats()["update_skipped"]`. See `arrowbuf.engine.update`.

        Args:
            ids: ids that `extend`/`append` returned (a 1-D array, or one int with one value per field).
            values: {field: one value per id}; ragged fields take one list (or a `pa.ListArray`) per id.

        Returns:
            The number of rows written.

        Raises:
            SchemaError: an unknown field, a field not filled later, a wrong dtype, shape or length; nothing written.
            InvalidArgument: an id this store never issued, or an id given twice; nothing written.
        """
        return self._w.update(ids, values)

    def present(self, fields: list[str], ids: Any) -> np.ndarray:
        """Per id, whether every one of `fields` has a value (False for ids whose row is no longer stored)."""
        seqs = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        with self._lock:
            live = self.index.live(seqs)
            return live & self._core.present(fields, seqs % self.arena_rows)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ reading (StoreReader)
    @timed("sample")
    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               n_step: int | None = None, gamma: float = 0.99) -> SampleBatch:
        """Sample a batch of `n` items (rows; windows of T rows with `samplers.Sequence`) with the store's sampler.

        Args:
            n: batch size. Uniform sampling is with replacement, so any `n` works once a row is sampleable (a row is
                sampleable once its next observation is known). With `max_times_sampled`, a batch holds `n` distinct
                items, or waits up to `timeout` for them; it is never short.
            columns: the columns to gather, e.g. `["obs", "action"]` (default: every field and derived field).
            timeout: seconds to wait on an empty store or a rate limiter that says no; None (default) does not wait.
            n_step: add `n_step_return`, `n_step_discount` and, per derived field, `n_step_<name>` (e.g.
                `n_step_next_obs`, the bootstrap observation) over `n_step` steps of the episode; a truncated episode
                bootstraps, a terminated one does not.
            gamma: the discount of `n_step` returns.

        Returns:
            An `ab.SampleBatch`: `data` (a `pa.RecordBatch`), `indices` (int64 ids for `update_priorities`),
            `weights` (importance-sampling weights of a prioritized sampler, at most 1, else None); `to_numpy()` and
            `to_torch(device)` give dicts of arrays shaped `[n, *shape]` (`[n, T, *shape]` for sequences). The arrays
            are yours for as long as you hold them (or any view of them); keep the arrays, not raw pointers.

        Raises:
            SampleTimeout: nothing could be served within `timeout` (also a `TimeoutError`).
            InvalidArgument: a bad `n`, an unknown column, or `n_step` with a Sequence sampler.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(ab.load_schema("cartpole"), capacity=1000, seed=0)
            >>> for t in range(10):
            ...     _ = store.append({"obs": np.full(4, t, np.float32), "action": t % 2, "reward": 1.0,
            ...                       "terminated": t == 9, "truncated": False, "policy_version": 0,
            ...                       "next_obs": np.full(4, t + 1, np.float32)})
            >>> batch = store.sample(32, columns=["obs", "action", "next_obs"])
            >>> batch.to_numpy()["obs"].shape
            (32, 4)
            >>> store.sample(4, n_step=3, gamma=0.9).to_numpy()["n_step_return"].shape
            (4,)
            >>> store.close()
        """
        return self._reader.sample(n, columns, timeout, n_step=n_step, gamma=gamma)

    @timed("sample")
    def sample_pieces(self, n: int, rows: int, columns: Iterable[str] | None = None, timeout: float | None = None,
                      *, piece_bytes: int | None = None, n_step: int | None = None,
                      gamma: float = 0.99) -> Iterator[SampleBatch]:
        """`sample(n)` as consecutive batches of at most `rows` items, each gathered only when the iterator asks
        for it, for a sender that streams a large sample (the Flight server's DoGet in parts) and so holds one
        piece's output at a time. Items are selected by this call (its errors are `sample`'s); an item whose row is
        recycled before its piece is gathered is drawn again, as in `sample`, and each piece's `indices` name its
        items; with `piece_bytes`, pieces after the first are sized to about that many bytes. Timed as a `sample`
        (the selection). See `arrowbuf.engine.reader.StoreReader.sample_pieces`."""
        return self._reader.sample_pieces(n, rows, columns, timeout, piece_bytes=piece_bytes, n_step=n_step,
                                          gamma=gamma)

    def take(self, ids: Any, columns: Iterable[str] | None = None) -> SampleBatch:
        """The rows `ids` (as `extend` returned them), in that order, gathered as `sample` gathers: random access
        by id, for callers that keep their own index of rows (`arrowbuf.compat`'s TorchRL storage and
        TransferQueue API). Counts as no sample (no sampler, limiter or `max_times_sampled` effect).

        Raises:
            InvalidArgument: an id that names no stored row (evicted, replaced or never issued), before or while
                the rows were read; nothing is returned. Also a bad `ids` or an unknown column.
        """
        seqs = np.asarray(ids, dtype=np.int64)
        if seqs.ndim != 1:
            raise InvalidArgument(f"take: expected a 1-D array of ids, got shape {seqs.shape}")
        with self._lock:
            self._core.check_open()  # type: ignore[union-attr]
            live = self.index.live(seqs)
        if not live.all():
            raise InvalidArgument(f"take: ids {seqs[~live][:8].tolist()} name no stored row (evicted or never "
                                  "written)")
        arrays = self._reader.gather(seqs, columns)
        with self._lock:  # a row still live after the gather was never overwritten while it was read
            again = self.index.live(seqs)
        if not again.all():
            raise InvalidArgument(f"take: rows {seqs[~again][:8].tolist()} were evicted while they were read")
        return SampleBatch(arrays, seqs.copy(), None)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set the priorities of sampled items; ids whose row was evicted or recycled are ignored (and counted).

        Returns the number of ids applied.

        Raises:
            InvalidArgument: counts differ, or a priority is NaN, infinite, negative or too large; nothing applied.
        """
        return self._w.update_priorities(indices, priorities)

    # ------------------------------------------------------------------ consumption per task
    # Thin delegation to `arrowbuf.engine.consume.ConsumeTracker`.
    @timed("consume")
    def consume(self, task: str, n: int, *, require: Iterable[str] | None = None, timeout: float | None = 0.0,
                max_staleness: int | None = None, where: str | None = None,
                max_tokens: int | None = None, lease: float | None = None,
                admission: str | None = None) -> SampleBatch:
        """Up to `n` rows (whole groups with `samplers.Group`) that `task` has not consumed yet, marked consumed.

        Args:
            task: a declared task (`tasks=` or `add_task`); each task sees every row once.
            n: most rows to deliver; with a Group sampler at most `n // size` whole groups.
            require: fields every delivered row must have written (fields filled later by `update`).
            timeout: seconds to wait for `n` ready rows (or the token budget); then what is ready, maybe nothing.
            max_staleness: rows with `policy_version < store.policy_version - max_staleness` are dropped (counted in
                `stats()["stale_dropped"]`), never delivered.
            where: a SQL predicate over the scalar columns, e.g. `"reward > 0 AND policy_version >= 3"`.
            max_tokens: token budget of the batch over the store's `token_field` (at least one row is delivered).
            lease: seconds the rows stay in flight for `task` (`arrowbuf.engine.leases`): `ack(batch.lease)` makes
                them final, `nack` or expiry puts them back in the task's queue (delivered again, in their order).
                None (default): final at once.
            admission: "oldest": the oldest rows inside the version window first, rows outside it held back, not
                dropped (`arrowbuf.samplers.admission`); None (default): id order.

        Returns:
            A `SampleBatch` of every column; `indices` are the rows' ids, oldest first; `lease` the lease id (None
            without `lease=` or for an empty batch); `batch.ack()` / `batch.nack()` end it.

        Raises:
            InvalidArgument: an unknown task, an unknown field, a bad option or predicate; nothing is consumed.
        """
        batch = self._consume.consume(task, n, require=require, timeout=timeout, max_staleness=max_staleness,
                                      where=where, max_tokens=max_tokens, lease=lease, admission=admission)
        if batch.lease is not None:
            batch.owner = self
        return batch

    def ack(self, lease: str) -> int:
        """Make the rows of a lease (`batch.lease` of `consume(..., lease=)`) consumed for good by its task; returns
        the rows. They are never delivered to that task again.

        Raises:
            LeaseError: the lease is not open: acked or nacked already, expired (its rows went back to the queue),
                or unknown to this store.
        """
        return self._consume.ack(lease)

    def nack(self, lease: str) -> int:
        """Give the rows of a lease back to its task's queue now: the next consume of the task gets them first, in
        their order. Returns the rows.

        Raises:
            LeaseError: the lease is not open (as `ack`).
        """
        return self._consume.nack(lease)

    def add_task(self, name: str) -> None:
        """Declare a consuming task: it sees every live row once, and rows wait for it before eviction.

        Raises:
            InvalidArgument: a bad or duplicate name.
        """
        self._w.add_task(name)
        self._writer.hold = self._consume
        if self._core is not None and self._core.lineage is not None:
            self._core.lineage.add_task(name)

    @property
    def tasks(self) -> list[str]:
        """The declared consuming tasks."""
        return self._consume.tasks

    @property
    def policy_version(self) -> int:
        """The current policy version (settable; default 0): the reference of `max_staleness`."""
        return self._consume.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._w.set_policy_version(value)


    # ------------------------------------------------------------------ views (`arrowbuf.store.views`)
    def to_table(self, columns: Iterable[str] | None = None) -> pa.Table:
        """The live rows, oldest first, as a `pa.Table` of the stored columns: a consistent snapshot.

        Each row is exactly as committed (no row half-replaced, no part of a batch), the rows are one contiguous
        seq range ending at the newest row committed at the call, and the table is a copy: writers go on without
        changing it. If writers replace rows faster than they are copied, the table starts at the oldest row still
        intact (see `arrowbuf.engine.reader`).
        """
        return self._v.to_table(columns)

    def iter_table(self, columns: Iterable[str] | None = None, *, max_rows: int | None = None
                   ) -> Iterator[pa.RecordBatch]:
        """The live rows as a stream of consistent, copied record batches, about one chunk in memory at a time.

        The rows are those committed at the call (nothing newer), oldest first, each exactly as committed (no torn
        or half-replaced row, even while writers run). Rows that writers evict before the stream reaches them are
        skipped (a gap in `seq`), never yielded torn. See `StoreReader.iter_snapshot`.

        Args:
            columns: stored columns (default: all of them).
            max_rows: at most this many rows per batch (default: one chunk's rows).

        Raises:
            SchemaError: an unknown column (at the call). InvalidArgument: a bad `max_rows`.
        """
        return self._v.iter_table(columns, max_rows)

    def snapshot(self, columns: Iterable[str] | None = None) -> RowSnapshot:
        """`to_table` with the seq range it covers: a `RowSnapshot` (lo, hi, live_lo, table). See
        `arrowbuf.engine.reader`."""
        return self._v.snapshot(columns)

    def to_pandas(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows as a pandas DataFrame (tensor columns as arrays per row). Needs `arrowbuf[query]`."""
        from ..query.frames import table_to_pandas

        return table_to_pandas(self.to_table(columns))

    def to_polars(self, columns: Iterable[str] | None = None) -> Any:
        """The live rows as a Polars DataFrame (tensors as Array columns). Needs `arrowbuf[query]`."""
        from ..query.frames import table_to_polars

        return table_to_polars(self.to_table(columns))

    def sql(self, query: str) -> pa.Table:
        """Run DuckDB SQL over the live rows; the store is the table `experience`, its lineage the table `lineage`
        (docs/observability.md). Needs `arrowbuf[query]`."""
        from ..query.frames import run_sql

        return run_sql(self, query)

    def lineage_table(self) -> pa.Table:
        """The lineage of the live rows (the SQL table `lineage`): seq, writer, written_at, policy_version, task,
        consumed_at, consumer, staleness, outcome; one row per (live row, declared task). See
        `arrowbuf.observe.lineage`.

        Raises:
            InvalidArgument: the store records no lineage (`observe=False`, or a shared-memory store).
        """
        return self._v.lineage_table()

    def observability(self) -> dict[str, Any]:
        """What `/metrics` and the inspector read besides `stats()`: `timings` (latency histograms per operation),
        `lineage` (per task: delivered, dropped as stale, staleness counts), `lineage_bytes`, `progress` (per task
        ready / waiting / consumed / in flight: `arrowbuf.observe.progress`) and `checkpoints`."""
        return self._v.observability()

    def serve_metrics(self, address: str = "127.0.0.1:0") -> Any:
        """Serve this store's Prometheus metrics at `http://address/metrics` (a thread; needs `arrowbuf[metrics]`).
        Returns a `MetricsEndpoint` (`.url`, `.close()`, a context manager). See docs/observability.md."""
        from ..observe.metrics import MetricsEndpoint

        return MetricsEndpoint.start(address, stores={self.name: self})

    def episodes(self) -> pa.Table:
        """One row per episode with live rows: episode_id, length, return, first_seq, last_seq, complete."""
        from ..query.frames import episode_table

        return episode_table(self)

    def stats(self) -> dict[str, Any]:
        """Size, counters and memory of the store.

        Memory in two labelled numbers (`arrowbuf.engine.sizes`, the one definition `arrowbuf inspect`, the inspector
        and `/metrics` show too): `rows_bytes`, what the live rows' values take, and `reserved_bytes`, what the
        store's tiers hold for it (the ring of `capacity` rows and the rest; `bytes` splits it per tier);
        `columns` gives both per column.
        """
        return self._v.stats(self.capacity, self._w.stats())

    def placement(self, explain: bool = False) -> pa.Table:
        """Where the columns live: one row per (column, tier) with the chunk slots and bytes there. A ragged
        column has one row: the tier of its arena, every chunk slot, the bytes the arena holds (placement does not
        move it).

        With `explain=True`, also why (from the placement policy's last step): the column's share of sampled rows
        (`access_share`, `rows_per_s`), the share of the sampling mass in those chunks (`mass`), their value per
        byte, the tier's read bandwidth (`read_gbps`) and a sentence (`why`). See `arrowbuf.placement`.
        """
        return self._v.placement(explain)

    def to_cudf(self, columns: Iterable[str] | None = None, *, device: bool = False) -> Any:
        """The live rows' scalar and metadata columns as a cuDF DataFrame (on the GPU). cuDF has no fixed-shape
        tensor type: sample tensor columns with `sample(...).to_torch("cuda")` (or a GPU tier). Needs
        `pip install 'arrowbuf[gpu]'` and a GPU.

        Args:
            columns: scalar fields and metadata columns (default: all of them).
            device: views of the device ring's columns instead of a copy of the rows (a store whose GPU tier mirrors
                its ring, `arrowbuf.ring.device_ring`): no copy at all, every ring position in position order, with
                `seq` and a `live` column (`df[df.live].sort_values("seq")` is the table's order); a live view, which
                the store's next sample updates in place.

        Raises:
            MissingDependency: cuDF is not installed or there is no GPU (the message says what was found).
            InvalidArgument: `device=True` on a store without a device ring, or with it on the CPU.
            SchemaError: a tensor or list column.
        """
        return self._v.to_cudf(columns, device)

    def chunks(self) -> pa.Table:
        """The chunk directory of the live rows: slot, first_seq, rows, sealed, tier per column."""
        return self._v.chunks()

    # ------------------------------------------------------------------ checkpoints and exports (`arrowbuf.persist`)
    def checkpoint(self, path: Any = None, keep: int | None = None, background: bool = False,
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
            path: the checkpoint directory (an Arrow IPC dataset; made if missing). A durable store's own
                directory (or None) also truncates the journal the checkpoint covers (default keep: 2).
            keep: keep the newest `keep` checkpoints (their files); None keeps all.
            background: return a `CheckpointHandle` (`.wait()`, `.progress`) at once and write in a thread,
                at a lower CPU priority than the process's other threads (`persist.checkpoint.BACKGROUND_NICE`).
            compression: None (uncompressed, memory-mappable: the default), or "zstd"/"lz4" for archives.

        Returns:
            A summary dict (generation, rows, files written and reused, bytes), or a handle with `background=True`.
        """
        self._check_open()
        out: Any = self._w.checkpoint(None if path is None else os.fspath(path), keep, background, compression)
        self._v.checkpoints.started(out)  # for /metrics and the inspector
        return out

    def export(self, path: Any, format: str = "parquet", partition_by: Any = None,
               compression: str | None = None, progress: ProgressSink | None = None) -> dict[str, Any]:
        """Write the live rows as an offline-RL dataset (Parquet or Arrow IPC files, derived columns such as
        `next_obs` materialised, optional hive partitioning by `partition_by` columns); `ab.open_dataset` and
        `ExperienceStore.from_dataset` read it back. Writers wait while rows are copied (sampling goes on).
        The schema and the lineage of the live rows (taken right after the rows) go into the metadata folder
        `_arrowbuf/` (`dataset.json`, `lineage.parquet` or `.arrow`), where a glob of the data files such as DuckDB's
        or Polars' `read_parquet("DIR/*.parquet")` does not reach. Returns rows and path (and `lineage`: its
        file). `progress` hears the rows written (as `ExperienceStore.restore`'s). See
        `arrowbuf.persist.datasets`."""
        return self._v.export(path, format, partition_by, compression, progress)

    # ------------------------------------------------------------------ restore (`arrowbuf.persist`)
    @classmethod
    def restore(cls, path: Any, *, tier: str | Tier = "host", tiers: dict[str, Any] | None = None,
                seed: int | None = None, name: str | None = None, schema: Any = None,
                generation: int | None = None, durability: str | None = None,
                progress: ProgressSink | None = None) -> ExperienceStore:
        """The store checkpointed at `path`: same rows under the same ids, same sampler, limiter and episode state.

        Args:
            path: a checkpoint directory (`checkpoint`).
            tier: where the restored store lives ("host", "shm", ...); tiers: byte budgets, as the constructor.
            seed: None continues the checkpointed RNG (the same batches the original would have drawn next);
                an int reseeds sampling.
            name: the restored store's name (default: the checkpointed one's).
            schema: when given, the schema the caller expects: a checkpoint whose fields differ raises SchemaError.
            generation: a kept checkpoint other than the latest (`arrowbuf checkpoint ls` lists them).
            durability: a durable directory (`durable=`) is restored as its last checkpoint plus the journal after
                it, and the store journals on under this policy (default: the recorded one).
            progress: told how the restore advances, `progress(phase, done, total, unit)` (phases "restore",
                "journal: read", "journal: replay"); `arrowbuf.observe.meter.PhasedProgress()` shows it as bars or
                lines (what `arrowbuf inspect ckpt/` does).

        Raises:
            StoreCorrupt: a file is missing, truncated or corrupt (the message names it).
            SchemaError: `schema` differs from the checkpoint's (the message names the fields).
        """
        from ..persist import plan_restore

        plan = plan_restore(path, tier=tier, tiers=tiers, seed=seed, name=name, schema=schema,
                            generation=generation)
        store = cls(plan.schema, options=plan.options)
        try:
            assert store._core is not None
            plan.load(store._core, progress)
            from .durable import read_policy, resume

            if generation is None and (durability is not None or read_policy(plan.root) is not None):
                store._writes = resume(plan.root, plan.manifest, durability, store._parts(), progress)
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def from_dataset(cls, path: Any, capacity: int | None = None, *, schema: Any = None,
                     progress: ProgressSink | None = None, **kwargs: Any) -> ExperienceStore:
        """A new store filled from a dataset directory: an arrowbuf export or checkpoint, Parquet with arrowbuf's
        schema, or a Minari dataset with the Arrow backend (the newest `capacity` rows when there are more; default:
        all). `schema=` checks the dataset against a schema (SchemaError naming the fields); `progress` hears the
        rows loaded (as `restore`'s); other keyword arguments go to the constructor (sampler, seed, tier, ...)."""
        from ..persist import from_dataset

        return cast("ExperienceStore", from_dataset(path, capacity, store_cls=cls, schema=schema, progress=progress,
                                                    **kwargs))

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the store's memory; idempotent. Waiting samples and inserts raise `StoreClosed`.

        Shared store: releases this process's mappings and lease. The creator's close also removes the store's name
        (as `unlink`): processes still attached keep working on their mappings until they close; new attaches fail.
        """
        if self.closed:
            return
        assert self._core is not None
        if self._writes is not None:
            self._writes.close()
        with self._cond:
            self._core.closed = True
            self._cond.notify_all()
        if self.placement_policy is not None:  # no move may run while the arenas go
            self.placement_policy.close()
        with self._write_lock:
            self._cols.close()
            for t in {id(t): t for t in [*self._data_tiers, self._tier]}.values():
                t.close()
        self._reader.outputs.clear()  # pooled gather outputs (batches callers still hold stay valid)

    def unlink(self) -> None:
        """Shared store: remove its name now (from any process); users keep their mappings until they close."""
        self._tier.unlink()

    def __reduce__(self) -> Any:
        if self._tier.shared:  # a shared store pickles by name: the receiving process attaches to it
            return (ExperienceStore.attach, (self.name,))
        raise TypeError(f"store {self.name!r} lives in this process's heap and cannot be pickled; "
                        "create it with tier='shm' to share it with other processes")

    def __enter__(self) -> ExperienceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_tier(tier: str | Tier, name: str, schema: ExperienceSchema) -> Tier:
    if isinstance(tier, Tier):
        return tier
    if tier == "host":
        return HostTier()
    if tier == "shm":
        from ..tiers.shm import SharedMemoryTier

        return SharedMemoryTier.create(name)
    raise InvalidArgument(f"unknown tier {tier!r}; expected 'host', 'shm' or a Tier instance")

