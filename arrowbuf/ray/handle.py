"""The learner side: `ShardedStore`, a handle on shards spread over a Ray cluster (see the package docstring).

`ShardedStore` mirrors the whole store surface over shards; the id codec (ids.py), the shard side (shard.py), the
writer (writer.py), consume routing (consume.py) and the split of a batch over shards (allocate.py) are modules of
their own.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import secrets
import time
import weakref
from collections.abc import Hashable, Iterable, Iterator
from types import EllipsisType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa

from ..delivery.batch import SampleBatch
from ..errors import ArrowbufError, InvalidArgument, SampleTimeout, ShardsLost, StoreClosed
from ..options import StoreOptions
from ..rate_limiters import RateLimiter
from ..samplers import Sampler, make_sampler, validate_priorities
from ..schema import ExperienceSchema, SchemaLike, load_schema
from ..schema.inputs import BatchLike, IdsLike, ValuesLike
from ._common import _DaemonPool, _ray, step_batch
from .allocate import allocate, allocate_fanout
from .consume import ShardedConsumer
from .ids import MAX_SHARDS, shard_of
from .membership import ShardMembership, ShardState
from .shard import _INFO_COLUMNS, ShardActor, ShardDirectory, is_exponent
from .writer import ShardWriter

if TYPE_CHECKING:  # pragma: no cover
    from ..flight.client import RemoteStore

log = logging.getLogger("arrowbuf.ray")

#: How often a handle asks a shard it last saw empty whether it has data now (seconds).
_EMPTY_RECHECK_S = 0.1
#: Default writers a handle keeps, one per insert timeout asked for (the oldest is closed past this).
_DEFAULT_WRITERS = 4


class ShardedStore:
    """A handle on shards spread over a Ray cluster; see the module docstring. Create one with `create`.

    The handle pickles (actor handles, token, the shards' last known locations) and opens its own connections in
    each process. `close()` closes this process's connections; `shutdown()` ends the shards themselves.

    Attributes:
        schema: the `ExperienceSchema` of every shard.
        num_shards: shard count.
        actors: the shard actors (Ray actor handles), by shard.
        deadline: default straggler deadline of `sample` in seconds (None: wait for every live shard).
    """

    def __init__(self, state: dict[str, Any], owner: bool = False) -> None:
        self._state = state
        self._owner = owner
        self.schema: ExperienceSchema = load_schema(state["schema"])
        self.num_shards = len(state["actors"])
        self.actors = list(state["actors"])
        self.deadline: float | None = state["deadline"]
        self.fanout: int | None = state.get("fanout")
        self.failure_timeout = float(state["failure_timeout"])
        self.max_restarts = int(state["max_restarts"])
        self._token = state["token"]
        sampler = make_sampler(state["sampler"])
        self.sampler = sampler  # every shard's sampler (its spec: each shard has its own instance)
        self.tier: str = state["tier"]
        beta = is_exponent(sampler)
        self.prioritized = beta is not None  # batches carry IS weights, made global here
        self.beta = beta or 0.0
        self.members = ShardMembership(self.actors, state["infos"], self._token, self.failure_timeout)
        self._lock = self.members.lock
        self._pool: _DaemonPool | None = None
        self._rng = np.random.default_rng()
        self._closed = False
        self._default_writers: dict[float | None, ShardWriter] = {}  # by insert timeout, the newest few
        self._writers: weakref.WeakSet[ShardWriter] = weakref.WeakSet()
        self._consumer = ShardedConsumer(self.members, self.schema, self.sampler, state.get("token_field"))
        self.counters = self.members.counters  # failed, revived (membership) and the handle's own
        self.counters.update({"late": 0, "topups": 0, "updates_dropped": 0})

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, schema: SchemaLike, num_shards: int, capacity_per_shard: int,
               sampler: str | Sampler | type[Sampler] = "uniform", *, rate_limiter: RateLimiter | None = None,
               seed: int | None = None, tier: str = "auto", name: str | None = None,
               strategy: str = "SPREAD", shard_cpus: float = 0.25, max_restarts: int = -1,
               deadline: float | None = None, fanout: int | None = None, failure_timeout: float = 30.0,
               chunk_rows: int | None = None,
               max_batch_rows: int = 65_536, bind: str | None = None, timeout: float = 120.0,
               checkpoint_root: str | None = None, checkpoint_every: float | None = None,
               tasks: list[str] | None = None, max_staleness: int | None = None,
               token_field: str | None = None, durable: str | None = None,
               durability: str = "group", options: StoreOptions | None = None,
               _test_hooks: bool = False) -> ShardedStore:
        """Start `num_shards` shard actors in a placement group and return a handle on them.

        Args:
            schema: an `ExperienceSchema`, or anything `load_schema` takes.
            num_shards: how many shards (at most 1024).
            capacity_per_shard: rows each shard holds (a FIFO ring, as `ExperienceStore`).
            sampler: the sampler of every shard: a name or an `ab.samplers` instance.
            rate_limiter: each shard's rate limiter (applies per shard).
            seed: base seed; shard k of generation g uses `seed + 1000003 * k + g`.
            tier: "auto" (shared memory when this arrowbuf has it and the schema fits, else "host"), "shm", "host".
            name: the stores' base name (default: the schema's).
            strategy: placement group strategy: "SPREAD" (default: over nodes, best effort), "STRICT_SPREAD",
                "PACK"; None to schedule without a placement group.
            shard_cpus: CPUs each shard reserves (its bundle).
            max_restarts: how often Ray restarts a dead shard (-1: always). A restarted shard comes back empty, or
                from its last checkpoint with `checkpoint_root`.
            deadline: default straggler deadline of `sample`, seconds.
            fanout: default fan-out of `sample`: None asks every shard with data for every batch; k asks at most k
                shards per batch (see `sample`).
            failure_timeout: a shard unreachable for this long (restarts exhausted or not) no longer counts as
                coming back, so a handle with every shard down raises `ShardsLost`.
            chunk_rows: rows per chunk of each shard store.
            max_batch_rows: the largest batch a shard's Flight server accepts or serves.
            bind: host the Flight servers bind (default: the node's IP); they always require a random token.
            timeout: seconds to wait for the shards to start.
            checkpoint_root: a directory every shard's node can reach: shard k checkpoints into
                `checkpoint_root/shard-<k>` (`checkpoint()`, `checkpoint_every`), and a restarted shard comes back from
                its last checkpoint there (under a new generation) instead of empty.
            checkpoint_every: seconds between each shard's own checkpoints (keeps the last 2); None: only on request.
            durable: a directory every shard's node can reach: shard k is a durable store (`ExperienceStore(...,
                durable=)`: checkpoints and a journal) in `durable/shard-<k>`, acknowledging writes only once they
                are durable, and a killed shard comes back from its last checkpoint plus its journal with nothing
                acknowledged lost. It is also the checkpoint root. Shards then live in the host tier.
            durability: the journal's policy with `durable=`: "group", "batch" or "os" (docs/durability.md).
            tasks, max_staleness, token_field: consumption per task on every shard (`ExperienceStore`; `consume`).
                With tasks, tier "auto" means "host". With an `ab.samplers.Group` sampler, `extend` routes each row
                by a hash of its group key, so a group's rows live on one shard.
            options: every shard store's `ab.StoreOptions` (its capacity is `capacity_per_shard`); the keywords
                above build one when it is not given (`chunk_rows`, the final-observation slots, `max_times_sampled`,
                `observe` and the rest come only through it). Its name, seed, tier, durability and placement are
                set per shard.
            _test_hooks: shards accept test hooks (`ShardActor.set_delay`): tests and benchmarks.
        """
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        schema = load_schema(schema)
        if not 1 <= int(num_shards) <= MAX_SHARDS:
            raise InvalidArgument(f"num_shards must be in [1, {MAX_SHARDS}], got {num_shards}")
        if options is None:
            options = StoreOptions(capacity=int(capacity_per_shard), sampler=sampler, rate_limiter=rate_limiter,
                                   chunk_rows=chunk_rows, tasks=None if tasks is None else list(tasks),
                                   max_staleness=max_staleness, token_field=token_field)
        elif int(capacity_per_shard) != options.capacity:
            raise InvalidArgument(f"capacity_per_shard={capacity_per_shard} but options.capacity="
                                  f"{options.capacity}: pass the same, or only options")
        sampler = make_sampler(options.sampler)
        options = options.replace(sampler=sampler)
        tasks = options.tasks
        if durable is not None:
            if tier == "shm":
                raise InvalidArgument("durable shards live in the host tier (a shared-memory store is not journaled)")
            if checkpoint_root is not None and os.path.abspath(checkpoint_root) != os.path.abspath(durable):
                raise InvalidArgument("durable= is the shards' checkpoint root too: pass one of them, or the same")
            checkpoint_root, tier = durable, "host"
        if (tasks or sampler.process_local or sampler.whole_groups) and tier == "auto":  # as before shm could hold them
            tier = "host"
        tier = _resolve_tier(tier, schema)
        uid = f"ab{secrets.token_hex(4)}"
        token = secrets.token_urlsafe(24)
        # named, so that shards find it by name: an actor handle among a restartable actor's arguments would pin them
        directory = ray.remote(num_cpus=0, max_restarts=-1)(ShardDirectory).options(
            name=f"arrowbuf-{uid}-directory").remote(int(num_shards))
        pg = None
        if strategy is not None:
            from ray.util.placement_group import placement_group

            pg = placement_group([{"CPU": float(shard_cpus)}] * int(num_shards), strategy=strategy)
            ready, _ = ray.wait([pg.ready()], timeout=timeout)
            if not ready:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
                ray.kill(directory)
                raise ArrowbufError(f"the placement group of {num_shards} shards ({shard_cpus} CPU each, {strategy}) "
                                    f"could not be placed within {timeout}s: add nodes or lower shard_cpus")
        remote_cls = ray.remote(ShardActor)
        actors = []
        for k in range(int(num_shards)):
            opts: dict[str, Any] = {"num_cpus": float(shard_cpus), "max_restarts": int(max_restarts),
                                    "max_task_retries": 0, "max_concurrency": 4}
            if pg is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=k)
            spec = {"shard": k, "schema": schema.to_dict(), "options": options, "seed": seed,
                    "tier": tier, "uid": uid, "name": name or schema.name, "token": token, "bind": bind,
                    "directory": f"arrowbuf-{uid}-directory", "max_batch_rows": int(max_batch_rows),
                    "checkpoint_root": None if checkpoint_root is None else os.path.abspath(checkpoint_root),
                    "checkpoint_every": checkpoint_every, "durable": durable is not None, "durability": durability,
                    "test_hooks": bool(_test_hooks)}
            actors.append(remote_cls.options(**opts).remote(spec))
        try:
            infos = ray.get([a.get_info.remote() for a in actors], timeout=timeout)
        except BaseException:
            for a in actors:
                ray.kill(a, no_restart=True)
            ray.kill(directory)
            if pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            raise
        state = {"schema": schema.to_dict(), "actors": actors, "infos": infos, "directory": directory, "pg": pg,
                 "token": token, "sampler": sampler, "deadline": deadline, "fanout": fanout,
                 "failure_timeout": failure_timeout,
                 "max_restarts": max_restarts, "tier": tier, "uid": uid, "token_field": token_field}
        return cls(state, owner=True)

    def __reduce__(self) -> tuple[type[ShardedStore], tuple[dict[str, Any]]]:
        with self._lock:
            state = dict(self._state, infos=[s.info for s in self.members.shards])
        return (ShardedStore, (state,))

    def __repr__(self) -> str:
        up = sum(not s.down for s in self.members.shards)
        return f"ShardedStore({self.num_shards} shards, {up} up, schema={self.schema.name!r})"

    # ------------------------------------------------------------------ shards
    @property
    def infos(self) -> list[dict[str, Any] | None]:
        """Each shard's last known info: location, generation, node_id, pid, shm name, ..."""
        return self.members.infos

    def _executor(self) -> _DaemonPool:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = _DaemonPool(min(64, 2 * self.num_shards + 2), "arrowbuf-shards")
        return self._pool

    # ------------------------------------------------------------------ membership (`arrowbuf.ray.membership`)
    def shard_client(self, k: int) -> RemoteStore | None:
        """Shard `k`'s Flight client, or None while it is down (see `ShardMembership.shard_client`)."""
        return self.members.shard_client(k)

    def report_down(self, k: int, exc: BaseException | None = None) -> None:
        """Shard `k` failed a call: it gets no share of batches until it answers again."""
        self.members.report_down(k, exc)

    def wait_for_shards(self, timeout: float = 60.0) -> int:
        """Block until every shard is reachable (e.g. after a restart) or `timeout`; returns how many are up."""
        return self.members.wait_for_shards(timeout)

    def wait_for_revival(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until the actor of a down shard answers or fails (`ShardMembership`)."""
        return self.members.wait_for_revival(timeout)

    def refresh(self) -> None:
        """Ask every live shard for its mass and size now (sample does this by itself when it has no estimate)."""
        live = self.members.live()
        futs = {self._executor().submit(_stats_of, s.client): s for s in live}
        for fut, s in futs.items():
            try:
                st = fut.result(timeout=self.failure_timeout)
            except Exception as exc:  # noqa: BLE001 - a shard that fails here is down
                self.members.mark_down(s, exc)
                continue
            self._set_mass(s, st)

    def _set_mass(self, s: ShardState, st: dict[str, Any]) -> None:
        s.mass = float(st["mass"])
        s.min_mass = float(st["min_mass"]) if st.get("min_mass") is not None else float("inf")
        s.size = int(st["size"])
        s.mass_at = time.monotonic()

    def _refresh_empty(self) -> None:
        """Without blocking: ask shards last seen empty (new, restarted, drained) for their mass again, at most every
        `_EMPTY_RECHECK_S`; a shard gets no share of a batch while its known mass is 0, so this is how data written
        to it is found."""
        now = time.monotonic()
        for s in self.members.shards:
            if (s.client is not None and not s.down and s.mass <= 0 and s.refreshing is None
                    and now - s.mass_at > _EMPTY_RECHECK_S):
                s.mass_at = now
                s.refreshing = self._executor().submit(self._refresh_one, s)

    def _refresh_one(self, s: ShardState) -> None:
        client = s.client
        try:
            if client is not None:
                self._set_mass(s, client.stats())
        except Exception as exc:  # noqa: BLE001 - a shard that fails here is down
            self.members.mark_down(s, exc)
        finally:
            s.refreshing = None

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               deadline: float | None | EllipsisType = ..., fanout: int | None | EllipsisType = ...,
               **options: object) -> SampleBatch:
        """Sample `n` items over all shards: each shard in parallel, `n_k` of them in proportion to its mass.

        Args:
            n: batch size.
            columns: columns to gather (default: every field).
            timeout: seconds to wait for data when every shard is empty (None: do not wait).
            deadline: straggler deadline in seconds (default: the handle's `deadline`). Shards that have not
                answered by then are left out of this call and their share is drawn from the shards that did answer
                (one more round trip to them), so the batch always has `n` rows. Effect on the distribution: in that
                batch a late shard's rows have probability 0 and every other row's probability is scaled by
                `M / (M - M_late)`; across calls a shard that misses a fraction f of deadlines is under-sampled by
                (1 - f). IS weights stay those of the global distribution (they do not correct for this).
            fanout: ask at most this many shards for this batch (default: the handle's `fanout`; None: every shard
                with data). The shards are drawn with replacement in proportion to their mass and each draw brings
                `n / fanout` rows, so an item's expected count stays `n * P_i` (the same global distribution in
                expectation; a single batch is more clustered by shard). Each request costs a shard a fixed overhead,
                so with many learners a bounded fan-out is what lets more shards add sampling capacity
                (benchmarks/simulate_scale.py).
            **options: passed to each shard's `sample` (e.g. `n_step=3, gamma=0.99`).

        Raises:
            SampleTimeout: every live shard is empty (or every shard is down but may come back) past `timeout`.
            ShardsLost: no shard is left.
        """
        parts = list(self.stream(n, columns, timeout, deadline=deadline, fanout=fanout, **options))
        if len(parts) == 1:
            return parts[0]
        info = {"shards": [p.info.get("shard") for p in parts], "rows_per_part": [len(p) for p in parts]}
        return SampleBatch.concat(parts, info)

    def stream(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               deadline: float | None | EllipsisType = ..., fanout: int | None | EllipsisType = ...,
               **options: object) -> Iterator[SampleBatch]:
        """The parts of `sample(n, ...)` as each shard's arrives (see `sample`): `n` rows in all."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive number of items, got {n!r}")
        if deadline is ...:
            deadline = self.deadline
        if fanout is ...:
            fanout = self.fanout
        if fanout is not None and (not isinstance(fanout, (int, np.integer)) or fanout < 1):
            raise InvalidArgument(f"fanout must be a positive number of shards or None, got {fanout!r}")
        cols = [columns] if isinstance(columns, str) else (list(columns) if columns is not None else None)
        t0 = time.monotonic()
        self._refresh_empty()
        live = self._wait_for_data(t0, timeout, None)
        remaining = int(n)
        first = True
        late_since: float | None = None  # when this call first left every part it asked for late
        patience = None if not timeout else t0 + timeout  # how long a round waits for its first part
        while remaining > 0:
            masses = np.array([s.mass for s in live])
            if first and fanout is not None and fanout < len(live):
                counts = allocate_fanout(remaining, masses, int(fanout), self._rng)
            else:
                counts = allocate(remaining, masses, self._rng)
            futs = {self._executor().submit(self._sample_one, s, int(c), cols, timeout, options): s
                    for s, c in zip(live, counts) if c > 0}
            answered: list[ShardState] = []
            end = t0 + deadline if (first and deadline is not None) else None
            for s, part in self._collect(futs, end, patience):
                if part is None:
                    continue
                answered.append(s)
                remaining -= len(part)
                yield part
            first = False
            if remaining <= 0:
                break
            self.counters["topups"] += 1
            if answered:
                late_since = None  # progress: the bound on rounds of late calls starts again at the next such round
            elif late_since is None:
                late_since = time.monotonic()
            live = [s for s in answered if s.mass > 0] or self._wait_for_data(t0, timeout, late_since)

    def _wait_for_data(self, t0: float, timeout: float | None, late_since: float | None) -> list[ShardState]:
        """Live shards with data (refreshing their mass when none is known), waiting up to `timeout` from `t0`;
        shards whose previous call is late count once it ends. For that this waits up to the caller's `timeout`, or
        if longer `failure_timeout` from `late_since` (when this call's own parts all became late; else `t0`): a
        bound that does not restart with each round of late calls, so a call never loops on shards that are always
        slower than `failure_timeout`, also when they come back from their late calls in turn (then one has data
        whenever this looks, and past the bound this raises anyway)."""
        pause = 0.002
        while True:
            up = self.members.live()
            live = [s for s in up if s.late is None]
            if live and not any(s.mass > 0 for s in live):
                self.refresh()  # a shard whose stats call outlasts failure_timeout is down now
                up = [s for s in up if not s.down]
                live = [s for s in live if not s.down]
            with_data = [s for s in live if s.mass > 0]
            if with_data and late_since is not None and time.monotonic() >= max(
                    late_since + self.failure_timeout, t0 + (timeout or 0.0)):
                # every round since late_since went late: shards coming back in turn from their late calls would
                # otherwise be asked again in turn, each round late again, and the call would never end
                raise SampleTimeout(f"sharded sample: no shard answered within failure_timeout={self.failure_timeout}s "
                                    f"in any round since {time.monotonic() - late_since:.1f}s ago (every call late)"
                                    + ("; did not wait (timeout=None)" if not timeout else f"; waited {timeout}s"))
            if with_data:
                return with_data
            waited = time.monotonic() - t0
            if not up and self.members.all_lost():
                raise ShardsLost(f"no shard of {self!r} is left: every shard is dead or unreachable for more than "
                                 f"{self.failure_timeout}s")
            late_only = bool(up) and not live
            left = (timeout or 0.0) - waited
            if late_only:
                left = max(left, (late_since or t0) + self.failure_timeout - time.monotonic())
            if left <= 0:
                if late_only:
                    why = f"every live shard is still busy with a late call after {self.failure_timeout}s"
                else:
                    why = ("every live shard is empty" if up
                           else f"every shard is down (no answer within failure_timeout={self.failure_timeout}s, "
                                "or restarting: they come back empty)")
                wait = "did not wait (timeout=None)" if not timeout else f"waited {timeout}s"
                raise SampleTimeout(f"sharded sample: {why}; {wait}. Add data or pass timeout= to wait")
            late = [f for f in (s.late for s in up) if f is not None]
            if late_only and late:  # every live shard is busy with a late call: until one of those ends
                cf.wait(late, timeout=left, return_when=cf.FIRST_COMPLETED)
            else:  # shards report data (or a restart) only when asked: ask again, backing off
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.05)

    def _collect(self, futs: dict[cf.Future, ShardState], end: float | None,
                 patience: float | None) -> Iterator[tuple[ShardState, Any]]:
        """(shard, part or None) as each call finishes; calls still running at `end` become late. Until a first
        part arrives it waits `failure_timeout` past `end` (or past its start without a deadline) or, if later, until
        `patience` (the caller's timeout): a call slower than failure_timeout on every shard is late, not lost."""
        start = time.monotonic()
        pending = set(futs)
        got_any = False
        while pending:
            wait = None if end is None else max(0.0, end - time.monotonic())
            if got_any is False and wait is not None and wait <= 0:
                wait = None  # nothing arrived yet: a deadline cannot leave a batch empty, wait for the first
            if wait is None:
                wait = self.failure_timeout
            done, pending = cf.wait(pending, timeout=wait, return_when=cf.FIRST_COMPLETED)
            if not done:
                now = time.monotonic()
                if not got_any and (now < (start if end is None else end) + self.failure_timeout
                                    or (patience is not None and now < patience)):
                    continue  # nothing here yet: wait for the first part instead
                for fut in pending:
                    self._set_late(futs[fut], fut)
                return
            for fut in done:
                s = futs[fut]
                try:
                    part = fut.result()
                except SampleTimeout:
                    s.mass = 0.0  # emptied meanwhile (e.g. a restart): not a failure
                    yield s, None
                    continue
                except (StoreClosed, OSError, pa.ArrowException, ConnectionError) as exc:
                    self.members.mark_down(s, exc)
                    yield s, None
                    continue
                got_any = True
                yield s, self._finish_part(s, part)
            if end is not None and got_any and time.monotonic() >= end:
                for fut in pending:
                    self._set_late(futs[fut], fut)
                return

    def _set_late(self, s: ShardState, fut: cf.Future) -> None:
        self.counters["late"] += 1
        s.late = fut

        def done(f: cf.Future) -> None:
            s.late = None
            if not f.cancelled() and f.exception() is None:
                self._read_mass(s, f.result())  # the late part's data is dropped; its mass report is kept

        fut.add_done_callback(done)

    def _sample_one(self, s: ShardState, n: int, cols: list[str] | None, timeout: float | None,
                    options: dict[str, Any]) -> SampleBatch:
        client = s.client
        if client is None:
            raise StoreClosed(f"shard {s.k} is down")
        return client.sample(n, cols, timeout, shard_info=True, **options)

    def _read_mass(self, s: ShardState, part: SampleBatch) -> None:
        if len(part):
            s.mass = float(part["_shard_mass"][0])
            s.min_mass = float(part["_shard_min"][0])
            s.size = int(part["_shard_size"][0])
            s.mass_at = time.monotonic()

    def _finish_part(self, s: ShardState, part: SampleBatch) -> SampleBatch:
        """Strip the shard's info columns; global IS weights from the masses known now."""
        self._read_mass(s, part)
        weights = None
        if self.prioritized:
            masses = [x for x in self.members.shards if not x.down and x.mass > 0]
            total = sum(x.mass for x in masses) or s.mass
            vmin = min((x.min_mass for x in masses), default=s.min_mass)
            p = np.asarray(part["_mass"], dtype=np.float64) / total
            pmin = vmin / total
            weights = np.minimum((p / pmin) ** (-self.beta), 1.0).astype(np.float32) if pmin > 0 else None
        arrays = {c: part[c] for c in part.columns if c not in _INFO_COLUMNS}
        info = dict(part.info or {})
        info["shard"] = s.k
        return SampleBatch(arrays, part.indices, weights, info)

    def update_priorities(self, indices: IdsLike, priorities: ValuesLike) -> int:
        """Route priority updates to the shards that own the ids; ids of down shards or dead incarnations are
        dropped (counted in `counters["updates_dropped"]`). Returns how many were applied.

        Raises:
            InvalidArgument: the counts differ or a priority is not finite and >= 0 (`samplers.validate_priorities`);
                nothing is applied.
        """
        ids, pri = validate_priorities(indices, priorities)
        owner = shard_of(ids)
        futs = {}
        for k in np.unique(owner):
            mask = owner == k
            s = self.members.shards[int(k)] if 0 <= k < self.num_shards else None
            client = self.members.client(s) if s is not None else None
            if s is None or client is None:
                self.counters["updates_dropped"] += int(mask.sum())
                continue
            futs[self._executor().submit(client.update_priorities, ids[mask], pri[mask])] = (s, int(mask.sum()))
        applied = 0
        for fut, (s, m) in futs.items():
            try:
                applied += int(fut.result(timeout=self.failure_timeout))
            except (StoreClosed, OSError, pa.ArrowException, cf.TimeoutError) as exc:
                self.members.mark_down(s, exc)
                self.counters["updates_dropped"] += m
        return applied

    # ------------------------------------------------------------------ fields filled later
    def update(self, ids: IdsLike, values: dict[str, Any]) -> int:
        """Fill fields declared `later: true` of stored rows (see `ExperienceStore.update`), routed by the shard each
        global id encodes. Validated here before any shard is written; atomic per shard (not across shards). Ids
        on a down shard are dropped (counted in `counters["updates_dropped"]`); ids of evicted rows, or of a shard's
        earlier incarnation, are skipped by the shard (its `stats()["update_skipped"]`). Returns rows written.

        Raises:
            SchemaError: an unknown field, a field not filled later, a wrong dtype, shape or length.
            InvalidArgument: an id no shard of this store issued (a shard number beyond `num_shards`), or an id
                given twice; nothing written.
        """
        from ..schema.update import update_ids, validate_update

        gids = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.schema, gids, values, single)
        owner = shard_of(gids)
        bad = (gids < 0) | (owner >= self.num_shards)
        if bad.any():
            raise InvalidArgument(f"update: id {int(gids[np.flatnonzero(bad)[0]])} was not issued by this "
                                  f"ShardedStore ({self.num_shards} shards); pass ids its extend/append returned")
        futs = {}
        for k in np.unique(owner):
            idx = np.flatnonzero(owner == k)
            s = self.members.shards[int(k)]
            client = self.members.client(s)
            if client is None:
                self.counters["updates_dropped"] += len(idx)
                continue
            part = {n: v.take(pa.array(idx)) if isinstance(v, pa.Array) else v[idx] for n, v in cols.items()}
            futs[self._executor().submit(client.update, gids[idx], part)] = (s, len(idx))
        written = 0
        for fut, (s, m) in futs.items():
            try:
                written += int(fut.result(timeout=self.failure_timeout))
            except (StoreClosed, OSError, pa.ArrowException, cf.TimeoutError) as exc:
                self.members.mark_down(s, exc)
                self.counters["updates_dropped"] += m
        return written

    # ------------------------------------------------------------------ writing
    def writer(self, shard: int | None = None, *, transport: str = "auto", max_in_flight: int = 8,
               actor: Hashable = None, timeout: float | None = None) -> ShardWriter:
        """A writer to one shard: `shard`, else a shard on this process's node, else one picked by writer id.
        `timeout`: seconds a shard's rate limiter may hold each write back (`InsertTimeout` after; None: no wait)."""
        if self._closed:  # contracts: a closed handle stays closed (StoreSurface)
            raise StoreClosed("this ShardedStore handle is closed; unpickle or create another")
        w = ShardWriter(self.members, self.schema, self.sampler, shard, transport=transport,
                        max_in_flight=max_in_flight, actor=actor, timeout=timeout)
        self._writers.add(w)
        return w

    def _default_writer(self, timeout: float | None) -> ShardWriter:
        w = self._default_writers.get(timeout)
        if w is None:
            if len(self._default_writers) >= _DEFAULT_WRITERS:  # a few distinct timeouts; the oldest goes
                oldest = next(iter(self._default_writers))
                self._default_writers.pop(oldest).close()
            w = self._default_writers[timeout] = self.writer(timeout=timeout)
        return w

    def extend(self, batch: BatchLike, *, timeout: float | None = None) -> np.ndarray:
        """Write through this handle's default writer (see `writer`); returns the rows' global ids
        (`np.ndarray[int64]`, in row order) once the shard has committed them. With an `ab.samplers.Group` sampler
        each row goes to the shard its group key hashes to (a group stays on one shard).

        Args:
            batch: dict of arrays with a leading dim, `pa.RecordBatch` or `pa.Table`.
            timeout: seconds a shard's rate limiter may hold the write back (None: no wait).

        Raises:
            SchemaError: the batch does not match the schema; nothing is written.
            InsertTimeout: a shard's rate limiter held the write back past `timeout`.
        """
        if self.sampler.whole_groups and self.num_shards > 1:
            return self._consumer.extend_by_group(batch, timeout=timeout)
        return self._default_writer(timeout).extend(batch)

    def append(self, step: dict[str, Any], *, timeout: float | None = None) -> int:
        """Write one step through the default writer; returns its global id (`timeout` as `extend`)."""
        return int(self.extend(step_batch(step), timeout=timeout)[0])

    # ------------------------------------------------------------------ consumption per task
    # Thin delegation to `arrowbuf.ray.consume.ShardedConsumer`.
    def consume(self, task: str, n: int, *, require: Iterable[str] | None = None, timeout: float | None = 0.0,
                max_staleness: int | None = None, where: str | None = None,
                max_tokens: int | None = None, lease: float | None = None,
                admission: str | None = None) -> SampleBatch:
        """`ExperienceStore.consume` over the shards (see `arrowbuf.ray.consume.ShardedConsumer.consume`); with
        `lease=`, the batch's lease names each shard's part."""
        batch = self._consumer.consume(task, n, require=require, timeout=timeout, max_staleness=max_staleness,
                                       where=where, max_tokens=max_tokens, lease=lease, admission=admission)
        if batch.lease is not None:
            batch.owner = self
        return batch

    def ack(self, lease: str) -> int:
        """`ExperienceStore.ack` of a lease of this store: each shard's part on its shard; returns the rows.

        Raises:
            LeaseError: a part not open on its shard (acked, nacked, expired), or its shard is down.
        """
        return self._consumer.end_lease(lease, "ack")

    def nack(self, lease: str) -> int:
        """`ExperienceStore.nack` of a lease of this store, each part on its shard; returns the rows."""
        return self._consumer.end_lease(lease, "nack")

    def add_task(self, name: str) -> None:
        """Declare a consuming task on every live shard."""
        self._consumer.add_task(name)

    @property
    def tasks(self) -> list[str]:
        """The consuming tasks (as the first live shard has them)."""
        return self._consumer.tasks()

    @property
    def policy_version(self) -> int:
        """The policy version (as the first live shard has it); setting it sets every live shard's."""
        return self._consumer.policy_version()

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._consumer.set_policy_version(value)

    # ------------------------------------------------------------------ inspection
    def __len__(self) -> int:
        self.refresh()
        return int(sum(s.size for s in self.members.shards if not s.down))

    def stats(self) -> dict[str, Any]:
        """Per-shard stats (None for a down shard) and totals; with tasks, the per-task counters (`consumed`,
        `in_flight`, `redelivered`, `leases_expired`, `stale_dropped_by_task`, `admission`) summed over the live
        shards."""
        futs = {s.k: self._executor().submit(_stats_of, s.client) for s in self.members.live()}
        shards: list[dict[str, Any] | None] = [None] * self.num_shards
        for k, fut in futs.items():
            with contextlib.suppress(Exception):
                shards[k] = fut.result(timeout=self.failure_timeout)
        up = [st for st in shards if st is not None]
        per_task: dict[str, Any] = {}  # consumption per task, summed over the live shards
        for key in ("consumed", "in_flight", "redelivered", "leases_expired", "stale_dropped_by_task"):
            sums: dict[str, int] = {}
            for st in up:
                for task, v in (st.get(key) or {}).items():
                    sums[task] = sums.get(task, 0) + int(v)
            if any(key in st for st in up):
                per_task[key] = sums
        admission: dict[str, dict[str, int]] = {}  # oldest-first admission counts per task (store.admission)
        for st in up:
            for task, c in (st.get("admission") or {}).items():
                acc = admission.setdefault(task, {})
                for k, v in c.items():
                    acc[k] = acc.get(k, 0) + int(v)
        if admission:
            per_task["admission"] = admission
        return {"shards": shards, "up": len(up), "size": sum(st["size"] for st in up),
                "inserts": sum(st["inserts"] for st in up), "samples": sum(st["samples"] for st in up),
                **per_task, **{f"handle_{k}": v for k, v in self.counters.items()}}

    def to_table(self, columns: list[str] | None = None) -> pa.Table:
        """Every live shard's rows, with a `shard` column first."""
        tables = []
        for s in self.members.live():
            t = s.connected().to_table(columns)
            tables.append(t.add_column(0, "shard", pa.array(np.full(t.num_rows, s.k, np.int32))))
        return pa.concat_tables(tables) if tables else self.schema.to_arrow().empty_table()

    def lineage_table(self, timeout: float = 60.0) -> pa.Table:
        """Every live shard's lineage (`ExperienceStore.lineage_table`), with a `shard` column first: the SQL table
        `lineage` of `sql` (join it with `experience` on `(shard, seq)`: seqs are per shard). Fetched from each shard
        actor through Ray (not through the shard's Flight SQL limits: the handle is the cluster's own).

        Raises:
            InvalidArgument: the shards record no lineage (shared-memory shards: create with `tier="host"` or tasks).
        """
        from ..observe.lineage import SCHEMA

        ray = _ray()
        live = self.members.live()
        got = ray.get([self.actors[s.k].lineage_table.remote() for s in live], timeout=timeout)
        tables = [t.add_column(0, "shard", pa.array(np.full(t.num_rows, s.k, np.int32))) for s, t in zip(live, got)
                  if t is not None]
        if live and not tables:
            raise InvalidArgument("the shards record no lineage (shared-memory shards record none): create the "
                                  "sharded store with tier='host' (or with tasks)")
        return pa.concat_tables(tables) if tables else pa.schema([("shard", pa.int32()), *SCHEMA]).empty_table()

    # --- contracts: the rest of the StoreSurface (arrowbuf/surface.py)
    def sql(self, query: str) -> pa.Table:
        """DuckDB SQL, run here, over every live shard's rows (`to_table()`, with its `shard` column) as
        `experience`, and their lineage (`lineage_table()`, also with `shard`) as `lineage`. Needs
        `arrowbuf[query]`."""
        from ..query.frames import run_sql

        return run_sql(cast(Any, self), query)  # run_sql reads only to_table() and lineage_table()

    def episodes(self) -> pa.Table:
        """Every live shard's episode summary, with a `shard` column first (episode ids are per shard)."""
        tables = []
        for s in self.members.live():
            t = s.connected().episodes()
            tables.append(t.add_column(0, "shard", pa.array(np.full(t.num_rows, s.k, np.int32))))
        if tables:
            return pa.concat_tables(tables)
        return pa.schema([("shard", pa.int32()), ("episode_id", pa.int64()), ("length", pa.int64()),
                          ("return", pa.float64()), ("first_seq", pa.int64()), ("last_seq", pa.int64()),
                          ("complete", pa.bool_())]).empty_table()
    # --- end contracts

    # ------------------------------------------------------------------ lifetime
    def checkpoint(self, root: str | None = None, keep: int | None = None,
                   timeout: float = 600.0) -> list[dict[str, Any]]:
        """Checkpoint every live shard into `root/shard-<k>` (default: the `checkpoint_root` given to `create`);
        one summary per shard (see `ExperienceStore.checkpoint`). Each shard's checkpoint is consistent on its own;
        together they are not one instant (shards run independently)."""
        ray = _ray()
        root = None if root is None else os.path.abspath(root)
        return list(ray.get([a.checkpoint.remote(root, keep) for a in self.actors], timeout=timeout))

    def close(self) -> None:
        """Close this process's connections and writers; the shards keep running. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in list(self._writers):  # writers made by this handle (the default one among them)
            with contextlib.suppress(Exception):
                w.close()
        self._consumer.close()
        self.members.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def shutdown(self) -> None:
        """End the shards (their stores and shared memory), the directory and the placement group."""
        ray = _ray()
        self.close()
        closes = [a.close.remote() for a in self.actors]
        with contextlib.suppress(Exception):
            ray.wait(closes, num_returns=len(closes), timeout=10)
        for a in [*self.actors, self._state["directory"]]:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        if self._state.get("pg") is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._state["pg"])

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owner:
            self.shutdown()
        else:  # contracts: leaving the block closes the handle (StoreSurface)
            self.close()


def _resolve_tier(tier: str, schema: ExperienceSchema) -> str:
    if tier not in ("auto", "shm", "host"):
        raise InvalidArgument(f"tier must be 'auto', 'shm' or 'host', got {tier!r}")
    if tier == "host":
        return tier
    from ..tiers.shm import shm_root

    ok = not any(f.ragged for f in schema.fields.values()) and os.path.isdir(shm_root())
    if tier == "shm" and not ok:
        raise ArrowbufError("tier='shm' needs /dev/shm (or $ARROWBUF_SHM_DIR) and a schema without ragged fields")
    return "shm" if ok else "host"


def _stats_of(client: RemoteStore) -> dict[str, Any]:
    return client.stats()
