"""The state behind `arrowbuf.compat.transfer_queue`: partitions of samples, their keys, tags, production and
per-task consumption status (TransferQueue's controller), with the field values in arrowbuf stores (its storage).

Layout: a partition holds samples numbered by global index (0, 1, ...). Field values live in arrowbuf
`ExperienceStore`s, one per *field group*: the set of fields written together by one put. A group's schema is
inferred from its first put (`columns`); a put that brings new fields, or fills fields of existing samples,
writes a row into the group store of exactly those fields and records, per (field, sample), which group and row hold
the value. This is how a schema-free API sits on schema-first stores: schema evolution happens in this layer (a new
field group is a new store, whose columns `sql()` and checkpoints see by their names), not inside one store.

Guarantees:
- a put is validated whole (field kinds against the partition's, batch sizes, dtypes) before anything is written;
  a refused put changes nothing.
- each task sees each sample once through `get_meta` (until `reset_consumption`); partitions share nothing.
- a cleared sample is gone from every index at once; its bytes stay in the ring until the store evicts them.
- a group store is a ring of `capacity` rows: a value overwritten or cleared more than `capacity` rows ago is
  evicted, and reading a sample whose value was evicted raises `SchemaError` naming the field.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import InvalidArgument, SchemaError
from ...schema.spec import STREAM_KEYS, SYSTEM_COLUMNS
from ...store.facade import ExperienceStore
from .columns import FieldKind
from .samplers import BaseSampler

RESERVED = frozenset(SYSTEM_COLUMNS) | frozenset(STREAM_KEYS)


def _grow(arr: np.ndarray, n: int, fill: Any) -> np.ndarray:
    if len(arr) >= n:
        return arr
    out = np.full(max(n, 2 * len(arr), 16), fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


class FieldGroup:
    """One arrowbuf store holding the fields written together; rows addressed by their seq."""

    def __init__(self, name: str, kinds: dict[str, FieldKind], capacity: int) -> None:
        self.fields = tuple(sorted(kinds))
        # a field named like a store column (seq, step, episode_id, actor) is stored as `<name>__tq`
        self.column = {f: f"{f}__tq" if f in RESERVED else f for f in self.fields}
        schema = {"name": name, "fields": {self.column[f]: kinds[f].schema_entry() for f in self.fields},
                  "episode_end": [], "truncation": []}  # a sample is a row; no field ends an episode
        self.store = ExperienceStore(schema, capacity=capacity, sampler="fifo", name=name)

    def write(self, cols: dict[str, pa.Array]) -> np.ndarray:
        batch = pa.record_batch([cols[f] for f in self.fields], names=[self.column[f] for f in self.fields])
        return np.asarray(self.store.extend(batch), dtype=np.int64)

    def read(self, fields: list[str], seqs: np.ndarray) -> dict[str, pa.Array]:
        try:
            batch = self.store.take(seqs, columns=[self.column[f] for f in fields])
        except InvalidArgument:
            raise SchemaError(f"fields {fields} of some sample(s) were evicted from the ring (raise `capacity` in "
                              "init's conf, or clear what you no longer need)") from None
        return {f: batch.data.column(self.column[f]) for f in fields}

    def close(self) -> None:
        self.store.close()


class PartitionState:
    """One partition: samples, keys, tags, field locations, consumption per task."""

    def __init__(self, partition_id: str, capacity: int) -> None:
        self.partition_id = partition_id
        self.capacity = capacity
        self.n = 0                                   # global indexes handed out
        self.live = np.zeros(0, dtype=bool)          # allocated and not cleared
        self.keys: dict[str, int] = {}
        self.key_of: dict[int, str] = {}
        self.tags: dict[int, dict[str, Any]] = {}
        self.kinds: dict[str, FieldKind] = {}
        self.group_of: dict[str, np.ndarray] = {}    # field -> group number per sample (-1: not produced)
        self.seq_of: dict[str, np.ndarray] = {}      # field -> row seq in that group
        self.groups: dict[tuple[str, ...], int] = {}
        self.stores: list[FieldGroup] = []
        self.consumed: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ samples and keys
    def plan_keys(self, keys: list[str], create: bool) -> tuple[np.ndarray, list[str]]:
        """Global indexes of `keys` (new keys get the next free indexes, committed by `commit_keys`)."""
        if len(set(keys)) != len(keys):
            raise InvalidArgument("Got duplicated keys.")
        out = np.empty(len(keys), dtype=np.int64)
        new: list[str] = []
        for i, k in enumerate(keys):
            if not isinstance(k, str):
                raise InvalidArgument(f"keys are str, got {type(k).__name__} {k!r}")
            g = self.keys.get(k)
            if g is None:
                if not create:
                    raise KeyError(f"key {k!r} not found in partition {self.partition_id!r}")
                g = self.n + len(new)
                new.append(k)
            out[i] = g
        return out, new

    def allocate(self, count: int) -> np.ndarray:
        start = self.n
        self.n += count
        self.live = _grow(self.live, self.n, False)
        self.live[start:self.n] = True
        for f in self.group_of:
            self.group_of[f] = _grow(self.group_of[f], self.n, -1)
            self.seq_of[f] = _grow(self.seq_of[f], self.n, -1)
        for t in self.consumed:
            self.consumed[t] = _grow(self.consumed[t], self.n, False)
        return np.arange(start, self.n, dtype=np.int64)

    def commit_keys(self, new: list[str]) -> None:
        for g, k in zip(self.allocate(len(new)), new, strict=True):
            self.keys[k] = int(g)
            self.key_of[int(g)] = k

    def check_live(self, gidx: np.ndarray) -> None:
        bad = (gidx < 0) | (gidx >= self.n)
        bad[~bad] = ~self.live[gidx[~bad]]
        if bad.any():
            raise KeyError(f"samples {gidx[bad][:8].tolist()} are not in partition {self.partition_id!r} "
                           "(never written, or cleared)")

    # ------------------------------------------------------------------ field values
    def check_kinds(self, kinds: dict[str, FieldKind], cols: dict[str, pa.Array]) -> None:
        """Refuse fields whose kind differs from the partition's; a dense `[B, L]` batch of a jagged field is
        taken as B samples of length L (rewritten in `cols`)."""
        for f, k in list(kinds.items()):
            old = self.kinds.get(f)
            if (old is not None and old.kind == "jagged" and k.kind == "dense" and len(k.shape) == 1
                    and k.dtype == old.dtype):
                col = cols[f]
                flat = col.storage.flatten() if isinstance(col.type, pa.FixedShapeTensorType) else col
                offsets = np.arange(len(col) + 1, dtype=np.int32) * k.shape[0]
                cols[f], kinds[f] = pa.ListArray.from_arrays(pa.array(offsets), flat), old
                continue
            if old is not None and old != k:
                raise SchemaError(f"field {f!r}: this put holds {k.kind} {k.dtype}{list(k.shape)}, but the "
                                  f"partition's first put of it held {old.kind} {old.dtype}{list(old.shape)}; "
                                  "a field keeps its dtype, shape and kind; nothing was written")

    def write(self, gidx: np.ndarray, kinds: dict[str, FieldKind], cols: dict[str, pa.Array]) -> None:
        """Store `cols` for samples `gidx` (validated already: `check_kinds`); atomic."""
        if not cols:
            return
        fields = tuple(sorted(cols))
        g = self.groups.get(fields)
        created = g is None
        if g is None:
            name = f"{self.partition_id}.g{len(self.stores)}"
            all_kinds = {**self.kinds, **kinds}
            self.stores.append(FieldGroup(name, {f: all_kinds[f] for f in fields}, self.capacity))
            g = len(self.stores) - 1
        try:
            seqs = self.stores[g].write(cols)
        except BaseException:
            if created:
                self.stores.pop().close()
            raise
        if created:
            self.groups[fields] = g
        need = max(self.n, int(gidx.max()) + 1 if len(gidx) else 0)
        for f in fields:
            if f not in self.group_of:
                self.kinds[f] = kinds[f]
                self.group_of[f] = np.full(max(need, 16), -1, dtype=np.int64)
                self.seq_of[f] = np.full(max(need, 16), -1, dtype=np.int64)
            self.group_of[f] = _grow(self.group_of[f], need, -1)
            self.seq_of[f] = _grow(self.seq_of[f], need, -1)
            self.group_of[f][gidx] = g
            self.seq_of[f][gidx] = seqs

    def produced(self, fields: list[str], gidx: np.ndarray) -> np.ndarray:
        ok = self.live[gidx].copy()
        for f in fields:
            if f not in self.group_of:
                return np.zeros(len(gidx), dtype=bool)
            ok &= self.group_of[f][gidx] >= 0
        return ok

    def read(self, gidx: np.ndarray, fields: list[str]) -> dict[str, pa.Array]:
        self.check_live(gidx)
        for f in fields:
            if f not in self.group_of or (self.group_of[f][gidx] < 0).any():
                missing = gidx if f not in self.group_of else gidx[self.group_of[f][gidx] < 0]
                who = [self.key_of.get(int(i), int(i)) for i in missing[:8]]
                raise SchemaError(f"field {f!r} has no value for sample(s) {who} in partition "
                                  f"{self.partition_id!r} (not produced yet)")
        out: dict[str, Any] = {}
        groups: dict[int, list[str]] = {}
        for f in fields:
            for g in np.unique(self.group_of[f][gidx]):
                groups.setdefault(int(g), []).append(f)
        for g, fs in groups.items():
            for f in fs:
                mine = self.group_of[f][gidx] == g
                got = self.stores[g].read([f], self.seq_of[f][gidx][mine])[f]
                out.setdefault(f, []).append((mine, got))
        result: dict[str, pa.Array] = {}
        for f, pieces in out.items():
            if len(pieces) == 1:
                col = pieces[0][1]
                result[f] = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
                continue
            order = np.concatenate([np.flatnonzero(m) for m, _ in pieces])
            joined = pa.concat_arrays([p.combine_chunks() if isinstance(p, pa.ChunkedArray) else p
                                       for _, p in pieces])
            result[f] = joined.take(pa.array(np.argsort(order, kind="stable")))
        return result

    # ------------------------------------------------------------------ status
    def consumed_of(self, task: str) -> np.ndarray:
        if task not in self.consumed:
            self.consumed[task] = np.zeros(max(self.n, 16), dtype=bool)
        return self.consumed[task]

    def clear(self, gidx: np.ndarray) -> None:
        self.live[gidx] = False
        for f in self.group_of:
            self.group_of[f][gidx] = -1
            self.seq_of[f][gidx] = -1
        for g in gidx.tolist():
            k = self.key_of.pop(int(g), None)
            if k is not None:
                self.keys.pop(k, None)
            self.tags.pop(int(g), None)

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.stores = []


class TQState:
    """Every partition of one TransferQueue-compatible system, behind one lock."""

    def __init__(self, capacity: int = 65_536, sampler: BaseSampler | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgument(f"capacity must be a positive number of rows, got {capacity!r}")
        from .samplers import SequentialSampler

        self.capacity = capacity
        self.sampler: BaseSampler = sampler if sampler is not None else SequentialSampler()
        self.partitions: dict[str, PartitionState] = {}
        self.lock = threading.RLock()

    def partition(self, partition_id: str, create: bool = False) -> PartitionState:
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidArgument(f"partition_id must be a non-empty str, got {partition_id!r}")
        p = self.partitions.get(partition_id)
        if p is None:
            if not create:
                raise KeyError(f"partition {partition_id!r} not found")
            p = self.partitions[partition_id] = PartitionState(partition_id, self.capacity)
        return p

    # ------------------------------------------------------------------ writes
    def put_keys(self, partition_id: str, keys: list[str], kinds: dict[str, FieldKind],
                 cols: dict[str, pa.Array], tags: list[dict[str, Any]] | None) -> tuple[np.ndarray, list[str]]:
        """kv put: fields and/or tags of `keys` (created when new). Returns (global indexes, all stored fields)."""
        with self.lock:
            p = self.partition(partition_id, create=True)
            gidx, new = p.plan_keys(keys, create=True)
            p.check_kinds(kinds, cols)
            if tags is not None and len(tags) != len(keys):
                raise InvalidArgument(f"keys with length {len(keys)} does not match length of tags {len(tags)}")
            p.write(gidx, kinds, cols)
            p.commit_keys(new)
            if tags is not None:
                for g, t in zip(gidx.tolist(), tags, strict=True):
                    p.tags.setdefault(int(g), {}).update(t or {})
            return gidx, self.fields_of(p, gidx)

    def put_indexes(self, partition_id: str, gidx: np.ndarray | None, count: int, kinds: dict[str, FieldKind],
                    cols: dict[str, pa.Array], tags: list[dict[str, Any]] | None = None) -> np.ndarray:
        """Metadata-path put: fields of existing samples `gidx`, or `count` new samples when gidx is None."""
        with self.lock:
            p = self.partition(partition_id, create=gidx is None)
            p.check_kinds(kinds, cols)
            if gidx is not None:
                p.check_live(gidx)
                p.write(gidx, kinds, cols)
            else:
                planned = np.arange(p.n, p.n + count, dtype=np.int64)
                p.write(planned, kinds, cols) if cols else None
                gidx = p.allocate(count)
            if tags is not None:
                for g, t in zip(gidx.tolist(), tags, strict=True):
                    if t:
                        p.tags.setdefault(int(g), {}).update(t)
            return gidx

    @staticmethod
    def fields_of(p: PartitionState, gidx: np.ndarray) -> list[str]:
        return sorted(f for f in p.group_of if (p.group_of[f][gidx] >= 0).all())

    # ------------------------------------------------------------------ reads and status
    def read(self, partition_id: str, gidx: np.ndarray, fields: list[str] | None) -> tuple[dict[str, Any],
                                                                                           dict[str, FieldKind]]:
        with self.lock:
            p = self.partition(partition_id)
            p.check_live(gidx)
            # every field any of the samples has: a sample without one of them is an error, as in TransferQueue
            names = (sorted(f for f in p.group_of if (p.group_of[f][gidx] >= 0).any()) if fields is None
                     else list(fields))
            return p.read(gidx, names), {f: p.kinds[f] for f in names}

    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int, mode: str,
                 task_name: str | None, sampler: BaseSampler | None, sampling_config: dict[str, Any]
                 ) -> np.ndarray:
        if mode not in ("fetch", "force_fetch"):
            raise InvalidArgument(f"mode must be 'fetch' or 'force_fetch', got {mode!r}")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
            raise InvalidArgument(f"batch_size must be a non-negative int, got {batch_size!r}")
        with self.lock:
            if partition_id not in self.partitions:
                return np.zeros(0, dtype=np.int64)
            p = self.partitions[partition_id]
            everyone = np.flatnonzero(p.live[: p.n])
            if mode == "force_fetch":
                return everyone[:batch_size] if batch_size else everyone
            if task_name is None:
                raise InvalidArgument("get_meta(mode='fetch') needs a task_name: consumption is tracked per task")
            done = p.consumed_of(task_name)
            ready = everyone[p.produced(list(data_fields), everyone) & ~done[everyone]]
            s = sampler if sampler is not None else self.sampler
            config = {k: v for k, v in sampling_config.items() if k not in ("task_name", "partition_id")}
            sampled, consumed = s.sample([int(i) for i in ready], int(batch_size), task_name=task_name,
                                         partition_id=partition_id, tags=lambda i: p.tags.get(int(i), {}),
                                         **config)
            taken = np.asarray(consumed, dtype=np.int64)
            if len(taken):
                done[taken] = True
            return np.asarray(sampled, dtype=np.int64)

    def production_status(self, partition_id: str, data_fields: list[str]) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            p = self.partition(partition_id)
            idx = np.flatnonzero(p.live[: p.n])
            return idx, p.produced(list(data_fields), idx).astype(np.int8)

    def consumption_status(self, partition_id: str, task_name: str) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            p = self.partition(partition_id)
            idx = np.flatnonzero(p.live[: p.n])
            return idx, p.consumed_of(task_name)[idx].astype(np.int8)

    def reset_consumption(self, partition_id: str, task_name: str | None) -> bool:
        with self.lock:
            p = self.partitions.get(partition_id)
            if p is None:
                return False
            for t, arr in p.consumed.items():
                if task_name is None or t == task_name:
                    arr[:] = False
            self.sampler.clear_cache(partition_id)
            return True

    def clear_keys(self, partition_id: str, keys: list[str]) -> None:
        with self.lock:
            p = self.partition(partition_id)
            gidx, _ = p.plan_keys(keys, create=False)
            p.clear(gidx)

    def clear_samples(self, partition_id: str, gidx: np.ndarray) -> None:
        with self.lock:
            p = self.partition(partition_id)
            p.clear(gidx[(gidx >= 0) & (gidx < p.n)])

    def clear_partition(self, partition_id: str) -> None:
        with self.lock:
            p = self.partitions.pop(partition_id, None)
            self.sampler.clear_cache(partition_id)
        if p is not None:
            p.close()

    def kv_list(self, partition_id: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        with self.lock:
            pids = list(self.partitions) if partition_id is None else [partition_id]
            out: dict[str, dict[str, dict[str, Any]]] = {}
            for pid in pids:
                p = self.partitions.get(pid)
                if p is None:
                    continue
                out[pid] = {k: dict(p.tags.get(g, {})) for k, g in p.keys.items()}
            return out

    def tags_of(self, partition_id: str, gidx: np.ndarray) -> list[dict[str, Any]]:
        with self.lock:
            p = self.partition(partition_id)
            return [dict(p.tags.get(int(g), {})) for g in gidx]

    def keys_of(self, partition_id: str, gidx: np.ndarray) -> list[str | None]:
        with self.lock:
            p = self.partition(partition_id)
            return [p.key_of.get(int(g)) for g in gidx]

    def field_kinds(self, partition_id: str) -> dict[str, FieldKind]:
        """Each stored field's kind in the partition (fixed by its first put)."""
        with self.lock:
            return dict(self.partition(partition_id).kinds)

    def stores(self, partition_id: str) -> dict[str, ExperienceStore]:
        """The arrowbuf stores of a partition's field groups, by name (for SQL, checkpoints, inspection)."""
        with self.lock:
            p = self.partition(partition_id)
            return {s.store.name: s.store for s in p.stores}

    def close(self) -> None:
        with self.lock:
            parts, self.partitions = list(self.partitions.values()), {}
        for p in parts:
            p.close()
