"""The shard side: a shard's store as its Flight server sees it, the shard directory and the shard actor."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from ..delivery.batch import SampleBatch
from ..errors import InvalidArgument
from ..samplers import Sampler, make_sampler, validate_priorities
from ..schema import load_schema
from ._common import _ray
from .ids import _GEN_MASK, GEN_BITS, decode_ids, encode_ids

#: Internal columns a shard adds to a batch for the learner's global weights (never reach the user).
_INFO_COLUMNS = ("_mass", "_shard_mass", "_shard_min", "_shard_size")

#: The environment variable that lets a shard accept test hooks (`ShardActor.set_delay`).


def is_exponent(sampler: Sampler) -> float | None:
    """The importance-sampling exponent of a sampler whose batches carry IS weights: its `beta` (prioritized
    sampling), or that of the sampler it draws start rows with (`priority` of a sequence sampler); None for samplers
    without weights. The learner's handle needs it to make weights global over every shard."""
    for s in (sampler, getattr(sampler, "priority", None)):
        beta = getattr(s, "beta", None)
        if isinstance(beta, (int, float)) and not isinstance(beta, bool):
            return float(beta)
    return None


def shm_safe(sampler: Sampler) -> bool:
    """Whether writers in other processes may append through shared memory: the sampler keeps its state of which
    rows are sampleable in the store's tier (arrowbuf's own samplers do: cursors, sum and min trees live in shared
    memory), or keeps none. A custom sampler says so with a class attribute `shm_safe`; without one, it is safe only
    if it does not track rows (`on_valid`/`on_invalid` not overridden), else its rows go through the shard's process,
    over Flight."""
    cls = type(make_sampler(sampler))
    declared = getattr(cls, "shm_safe", None)
    if declared is not None:
        return bool(declared)
    if cls.process_local or cls.whole_groups:  # groups: a shard's rows of one group are routed through it
        return False
    if cls.spec_name:  # arrowbuf's own samplers keep their state in the store's tier
        return True
    return cls.on_valid is Sampler.on_valid and cls.on_invalid is Sampler.on_invalid


class ShardBackend:
    """A shard's store as its Flight server sees it: the local store with global ids and sampling-mass reports.

    `sample(..., shard_info=True)` adds the columns `_mass` (each item's sampling mass, `Sampler.mass`: `p^alpha`
    for prioritized sampling, 1 for uniform), `_shard_mass`, `_shard_min` and `_shard_size` (this shard's total and
    smallest positive mass and its size, repeated per row) that the learner's `ShardedStore` turns into global
    weights and strips. Everything else is the store's surface.
    """

    def __init__(self, store: Any, shard: int, generation: int) -> None:
        self.store = store
        self.shard = int(shard)
        self.generation = int(generation) & _GEN_MASK
        self.name = store.name
        self.schema = store.schema
        self.capacity = store.capacity
        self.delay_s = 0.0  # artificial slowness (benchmarks, tests): added to every sample
        self.update_skipped = 0  # update ids of this shard's earlier incarnations

    def mass(self) -> tuple[float, float, int]:
        """(sampling mass, smallest positive item mass, size) now, from the store's sampler."""
        sampler = self.store.sampler
        return float(sampler.total_mass()), float(sampler.min_mass()), len(self.store)

    # --- contracts: the StoreSurface (arrowbuf/surface.py), explicitly rather than through __getattr__
    def extend(self, batch: Any, **kwargs: Any) -> np.ndarray:
        """The store's `extend`; returns the rows' global ids."""
        return encode_ids(self.shard, self.generation, np.asarray(self.store.extend(batch, **kwargs)))

    def append(self, step: Any, **kwargs: Any) -> int:
        """The store's `append`; returns the row's global id."""
        return int(encode_ids(self.shard, self.generation, np.array([self.store.append(step, **kwargs)]))[0])

    def sample(self, n: int, columns: Iterable[str] | None = None, timeout: float | None = None, *,
               shard_info: bool = False, **options: Any) -> SampleBatch:
        """The store's `sample` under global ids.

        Args:
            shard_info: add the columns the handle weighs shards by (`_mass`, `_shard_mass`, `_shard_min`,
                `_shard_size`).
        """
        if self.delay_s:
            time.sleep(self.delay_s)
        b = self.store.sample(n, columns, timeout, **options)
        ids = encode_ids(self.shard, self.generation, b.indices)
        if not shard_info:
            return SampleBatch({c: b[c] for c in b.columns}, ids, b.weights, b.info)
        arrays = {c: b[c] for c in b.columns}
        total, vmin, size = self.mass()
        k = len(ids)
        pos = np.asarray(b.indices, dtype=np.int64) % self.store.arena_rows  # an id's ring position
        arrays["_mass"] = np.asarray(self.store.sampler.mass(pos), dtype=np.float64)
        arrays["_shard_mass"] = np.full(k, total)
        arrays["_shard_min"] = np.full(k, vmin)
        arrays["_shard_size"] = np.full(k, size, dtype=np.int64)
        return SampleBatch(arrays, ids, b.weights, b.info)

    # --- consume: consumption per task, under global ids
    def consume(self, task: str, n: int, **kwargs: Any) -> SampleBatch:
        """The store's `consume`; the batch's indices are global ids (its lease, if any, is the store's)."""
        b = self.store.consume(task, n, **kwargs)
        out = SampleBatch({c: b[c] for c in b.columns}, encode_ids(self.shard, self.generation, b.indices), None,
                          b.info)
        if b.lease is not None:
            out.lease, out.owner = b.lease, self
        return out

    def ack(self, lease: str) -> int:
        """The store's `ack`."""
        return int(self.store.ack(lease))

    def nack(self, lease: str) -> int:
        """The store's `nack`."""
        return int(self.store.nack(lease))

    def add_task(self, name: str) -> None:
        """The store's `add_task`."""
        self.store.add_task(name)

    @property
    def tasks(self) -> list[str]:
        """The store's consuming tasks."""
        return list(self.store.tasks)

    @property
    def policy_version(self) -> int:
        """The store's policy version (settable)."""
        return int(self.store.policy_version)

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.store.policy_version = value
    # --- end consume

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """The store's `update_priorities` by global ids; ids of other shards or earlier incarnations are
        ignored. Returns how many were applied."""
        ids, pri = validate_priorities(indices, priorities)
        shard, gen, seq = decode_ids(ids)
        mine = (shard == self.shard) & (gen == self.generation)  # ids of a dead incarnation are not ours
        return int(self.store.update_priorities(seq[mine], pri[mine])) if mine.any() else 0

    def update(self, ids: Any, values: Any) -> int:
        """The store's `update` by global ids: ids of this shard's earlier incarnations name rows that are
        gone (skipped and counted in `stats()["update_skipped"]`); ids of another shard are `InvalidArgument`."""
        from ..schema.update import update_ids, validate_update

        gids = update_ids(ids)
        single = isinstance(ids, (int, np.integer)) and not isinstance(ids, bool)
        cols = validate_update(self.schema, gids, values, single)
        shard, gen, seq = decode_ids(gids)
        bad = (gids < 0) | (shard != self.shard)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(f"update: id {int(gids[i])} is not an id of shard {self.shard} (it names shard "
                                  f"{int(shard[i])}); send ids to the ShardedStore that issued them")
        mine = gen == self.generation
        self.update_skipped += int((~mine).sum())
        if not mine.any():
            return 0
        keep = np.flatnonzero(mine)
        part = cols if mine.all() else {k: v.take(pa.array(keep)) if isinstance(v, pa.Array) else v[keep]
                                        for k, v in cols.items()}
        return int(self.store.update(seq[keep], part))

    def __len__(self) -> int:
        return len(self.store)

    def stats(self) -> dict[str, Any]:
        """The store's stats plus this shard's number, generation and sampling mass."""
        total, vmin, size = self.mass()
        out = {**self.store.stats(), "shard": self.shard, "generation": self.generation, "mass": total,
               "min_mass": vmin if np.isfinite(vmin) else None}
        out["update_skipped"] = out.get("update_skipped", 0) + self.update_skipped  # ids of earlier incarnations
        return out

    def to_table(self, columns: list[str] | None = None) -> Any:
        """The store's `to_table`."""
        return self.store.to_table(columns)

    def iter_table(self, columns: list[str] | None = None) -> Any:
        """The store's `iter_table` (the Flight server's `table` stream: one chunk copied at a time)."""
        return self.store.iter_table(columns)

    def sql(self, query: str) -> Any:
        """The store's `sql`."""
        return self.store.sql(query)

    def episodes(self) -> Any:
        """The store's `episodes`."""
        return self.store.episodes()

    def close(self) -> None:
        """Close the store; idempotent."""
        self.store.close()

    def __enter__(self) -> ShardBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
    # --- end contracts

    def __getattr__(self, name: str) -> Any:  # chunks, placement, ...: the store's own
        if name == "store":
            raise AttributeError(name)
        return getattr(self.store, name)


class ShardDirectory:
    """Per sharded store: hands each shard incarnation its generation and records where the shards are.

    A Ray actor (no CPU). Generations count up per shard; a directory that was itself restarted starts them at a
    random point so an incarnation after that rarely repeats a recent generation.
    """

    def __init__(self, num_shards: int) -> None:
        ray = _ray()
        start = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = ray.get_runtime_context().was_current_actor_reconstructed
        if again:
            start = secrets.randbelow(1 << GEN_BITS)
        self.generations = [start - 1] * num_shards
        self.starts = [0] * num_shards
        self.infos: list[dict[str, Any] | None] = [None] * num_shards

    def next_generation(self, shard: int) -> tuple[int, int]:
        """Start shard `shard`'s next incarnation: its new generation and how many times it has started."""
        self.generations[shard] = (self.generations[shard] + 1) & _GEN_MASK
        self.starts[shard] += 1
        return self.generations[shard], self.starts[shard]

    def publish(self, shard: int, info: dict[str, Any]) -> None:
        """Record shard `shard`'s current info (endpoint, generation, pid, ...)."""
        self.infos[shard] = info

    def get(self) -> list[dict[str, Any] | None]:
        """Every shard's last published info (None: not published yet)."""
        return self.infos


class ShardActor:
    """One shard: a store (shared memory on its node when it can, else the heap) and a Flight server for it.

    Made a Ray actor by `ShardedStore.create`; a restarted incarnation (Ray's `max_restarts`) starts empty under a
    new generation, with a new Flight port, and publishes itself in the directory.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        from ..flight import serve
        from ..store.facade import ExperienceStore

        ray = _ray()
        ctx = ray.get_runtime_context()
        shard = int(spec["shard"])
        self.shard = shard
        self.test_hooks = bool(spec.get("test_hooks"))
        directory = None
        try:
            directory = ray.get_actor(spec["directory"])
            gen, starts = ray.get(directory.next_generation.remote(shard), timeout=30)
        except Exception:  # noqa: BLE001 - without the directory an incarnation still needs a generation
            gen, starts = secrets.randbelow(1 << GEN_BITS), -1
        tier = spec["tier"]
        shm_name = None
        if tier == "shm":
            shm_name = f"{spec['uid']}-s{shard}-g{gen}-{secrets.token_hex(3)}"
        seed = None if spec["seed"] is None else int(spec["seed"]) + 1000003 * shard + gen
        # a shard with a checkpoint directory comes back from its last checkpoint
        root = spec.get("checkpoint_root")
        self.checkpoint_dir = None if root is None else os.path.join(root, f"shard-{shard}")
        self.restored_from: dict[str, Any] | None = None
        if self.checkpoint_dir is not None and os.path.exists(os.path.join(self.checkpoint_dir, "_manifest.json")):
            self.store = ExperienceStore.restore(self.checkpoint_dir, tier=tier, seed=seed,
                                                 name=shm_name or f"{spec['name']}-{shard}")
            self.restored_from = {"path": self.checkpoint_dir, "rows": len(self.store)}
            if spec.get("durable"):  # the journal after the checkpoint was replayed (arrowbuf.store.durable)
                self.restored_from["replayed"] = self.store.stats()["journal"]["replayed"]
            for task in spec["options"].tasks or []:  # a restored shard's tasks come back declared
                if task not in self.store.tasks:
                    self.store.add_task(task)
        else:
            options = spec["options"].replace(
                seed=seed, tier=tier, name=shm_name or f"{spec['name']}-{shard}",
                durable=self.checkpoint_dir if spec.get("durable") else None,
                durability=spec.get("durability") or "group")
            self.store = ExperienceStore(load_schema(spec["schema"]), options=options)
        self._stop_checkpoints = threading.Event()
        self._periodic = threading.Condition()
        self._periodic_last: dict[str, Any] | None = None  # the latest periodic checkpoint's summary (or error)
        self._periodic_thread: threading.Thread | None = None
        self.shard_store = ShardBackend(self.store, shard, gen)
        host = ray.util.get_node_ip_address() if spec["bind"] is None else spec["bind"]
        self.server = serve(self.shard_store, f"grpc://{host}:0", token=spec["token"],
                            max_batch_rows=spec["max_batch_rows"])
        self.info = {"shard": shard, "generation": gen, "incarnation": starts, "location": self.server.location,
                     "store": self.store.name, "shm": shm_name, "node_id": ctx.get_node_id(), "node_ip": host,
                     "pid": os.getpid(), "started": time.time(), "restored_from": self.restored_from}
        if directory is not None:
            with contextlib.suppress(Exception):
                directory.publish.remote(shard, self.info)
        if spec.get("checkpoint_every") and self.checkpoint_dir is not None:  # persist: periodic checkpoints
            self._periodic_thread = threading.Thread(
                target=self._checkpoint_every, args=(float(spec["checkpoint_every"]),), daemon=True,
                name="arrowbuf-shard-checkpoint")
            self._periodic_thread.start()

    def get_info(self) -> dict[str, Any]:
        """This incarnation's info: shard, generation, incarnation, Flight location, store and shm names, node, pid."""
        return self.info

    def stats(self) -> dict[str, Any]:
        """The shard's `ShardBackend.stats`."""
        return self.shard_store.stats()

    def lineage_table(self) -> Any:
        """The store's `lineage_table()`, or None when it records no lineage (a shared-memory shard)."""
        from ..errors import InvalidArgument

        try:
            return self.store.lineage_table()
        except InvalidArgument:  # this store records no lineage
            return None

    def set_delay(self, seconds: float) -> None:
        """Slow every sample of this shard by `seconds`: a test hook (the straggler deadline's tests and benchmarks),
        refused unless the sharded store was created with `_test_hooks=True` (`ShardedStore.create`)."""
        from ..errors import InvalidArgument

        if not getattr(self, "test_hooks", False):
            raise InvalidArgument("set_delay is a test hook; a shard accepts it only when its sharded store was "
                                  "created with _test_hooks=True (tests and benchmarks do)")
        self.shard_store.delay_s = float(seconds)

    # --- checkpoints of this shard
    def checkpoint(self, root: str | None = None, keep: int | None = None) -> dict[str, Any]:
        """Checkpoint this shard's store into `root/shard-<k>` (default: the checkpoint root it was made with)."""
        from ..errors import InvalidArgument

        path = self.checkpoint_dir if root is None else os.path.join(root, f"shard-{self.shard}")
        if path is None:
            raise InvalidArgument("this sharded store has no checkpoint_root: pass root= to checkpoint()")
        info = dict(self.store.checkpoint(path, keep=keep))
        info.update(shard=self.shard, shard_generation=self.info["generation"])
        return info

    def periodic_checkpoint(self, newer_than: int = -1, timeout: float = 0.0) -> dict[str, Any] | None:
        """The summary of this incarnation's latest periodic checkpoint (`checkpoint_every`), or None before the
        first; `count` numbers them (1, 2, ...), and a failed one carries `error` instead of rows.

        Waits (on a condition the checkpoint thread signals, at most `timeout` seconds) until one with
        `count > newer_than` has finished; returns the latest one then (or the latest one so far at the deadline).
        """
        deadline = time.monotonic() + max(0.0, float(timeout))
        with self._periodic:
            while (self._periodic_last is None or self._periodic_last["count"] <= newer_than) and \
                    not self._stop_checkpoints.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not self._periodic.wait(left):
                    break
            return None if self._periodic_last is None else dict(self._periodic_last)

    def _checkpoint_every(self, seconds: float) -> None:
        count = 0
        while not self._stop_checkpoints.wait(seconds):
            count += 1
            try:
                info: dict[str, Any] = dict(self.store.checkpoint(self.checkpoint_dir, keep=2))
            except Exception as exc:  # noqa: BLE001 - a failed periodic checkpoint leaves the previous one; try again
                info = {"error": f"{type(exc).__name__}: {exc}"}
            info.update(count=count, shard=self.shard, shard_generation=self.info["generation"])
            with self._periodic:
                self._periodic_last = info
                self._periodic.notify_all()
    # --- end persist

    def close(self) -> None:
        """Stop periodic checkpoints (waiting for one in progress), then close the Flight server and the store."""
        self._stop_checkpoints.set()
        with self._periodic:
            self._periodic.notify_all()
        if self._periodic_thread is not None:  # a checkpoint in progress finishes (the manifest commit is atomic)
            self._periodic_thread.join(60)
        self.server.close()
        self.store.close()  # the creator's close removes the shared-memory name


def __getattr__(name: str) -> Any:
    if name == "ShardStore":  # the adapter's old name, two letters from ShardedStore (the learner's handle)
        warnings.warn("arrowbuf.ray.ShardStore was renamed ShardBackend (ShardedStore is the learner's handle)",
                      DeprecationWarning, stacklevel=2)
        return ShardBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
