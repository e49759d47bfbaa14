"""One TransferQueue-compatible system spread over N served systems (shards): the smallest honest sharding.

Each shard is a whole `TQState` served over Flight (`server.TQServer`; inside a Ray job one named Ray actor per
shard, `ray.join_or_start_shards`). `ShardedBackend` is a client-side router with the calls `TransferQueueClient`
makes (`client.Backend`), so every process that joins with the same shard locations sees one system:

- KV path: a key lives on shard `crc32(key) % N` (the same in every process). Key lookups, puts, gets and clears
  split their keys by shard and reassemble the caller's order; `kv_list` merges the shards.
- Metadata path: the new samples of one `put(data, partition_id=...)` (get_meta `insert`) go *whole* to one shard
  (a GRPO group put together stays together); successive inserts of this client rotate over the shards, starting
  at shard 0. Every global index handed out carries its shard: `shard << 40 | index on the shard` (shard 0's indexes
  are the plain ones), and every index passed back is routed by it.
- `get_meta(mode="fetch")` asks the shards in order 0..N-1 and returns the first non-empty batch: a batch (and so a
  GRPO group, a rank's share) comes from one shard and is marked consumed there, so each task still sees each sample
  once, and ranks of one DP group (rank-aware sampler, cached per shard) get the same batch. A batch is *not*
  assembled from several shards: with B ready samples split over shards, a `batch_size` larger than any one shard's
  ready count gets nothing. Without polling_mode this router waits for a batch (the shards answer at once) and
  raises `GetMetaTimeout` as one system would. `force_fetch` concatenates the shards.
- Statuses, custom metadata, key lookups and clears are split by shard and merged.

Not sharded: the field-group stores inside one shard. Not offered: partition snapshots and checkpoints of a
sharded system (checkpoint each shard). Validation: input refused by the client (batch sizes, mixed dtypes, bad
keys) writes nothing anywhere; a put that a shard refuses (a kind that differs from that shard's) may already be
written on the shards before it: puts are atomic per shard, not across shards.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import InvalidArgument, SchemaError
from .columns import FieldValues
from .partition import Status
from .samplers import SamplerArg
from .state import GetMetaTimeout, StorageKeyNotFoundError

SHARD_SHIFT = 40
MAX_SHARDS = 1 << 12
_LOCAL_MASK = (1 << SHARD_SHIFT) - 1


def encode(shard: int, local: npt.ArrayLike) -> np.ndarray:
    """Global indexes of shard-local ones: `shard << 40 | local`."""
    return (np.int64(shard) << SHARD_SHIFT) | np.asarray(local, dtype=np.int64)


def decode(gidx: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local index) of global indexes."""
    g = np.asarray(gidx, dtype=np.int64)
    return g >> SHARD_SHIFT, g & _LOCAL_MASK


def key_shard(key: str, n: int) -> int:
    """The shard of a user key (stable across processes and runs)."""
    if not isinstance(key, str):
        raise InvalidArgument(f"keys are str, got {type(key).__name__} {key!r}")
    return zlib.crc32(key.encode()) % n


def _merge_records(parts: list[tuple[int, dict[str, Any]]], order: np.ndarray | None = None) -> dict[str, Any]:
    """One meta record of shard records (global indexes encoded), samples in shard order or at positions `order`
    (the position of each concatenated sample in the result); fields: those every part has."""
    parts = [(k, r) for k, r in parts if r["global_indexes"]]
    if not parts:
        return {"global_indexes": [], "partition_id": None, "field_schema": {}, "production_status": [],
                "custom_meta": []}
    gidx = np.concatenate([encode(k, r["global_indexes"]) for k, r in parts])
    fields = set(parts[0][1]["field_schema"])
    for _, r in parts[1:]:
        fields &= set(r["field_schema"])
    schema: dict[str, Any] = {}
    for f in sorted(fields):
        entry = dict(parts[0][1]["field_schema"][f])
        shapes = [r["field_schema"][f].get("per_sample_shapes") for _, r in parts]
        if any(s is not None for s in shapes):
            entry["per_sample_shapes"] = [
                x for (_, r), s in zip(parts, shapes, strict=True)
                for x in (s or [r["field_schema"][f].get("shape")] * len(r["global_indexes"]))]
            entry["is_nested"] = True
        schema[f] = entry
    status = [s for _, r in parts for s in r["production_status"]]
    custom = [c for _, r in parts for c in r["custom_meta"]]
    rec = {"global_indexes": gidx.tolist(), "partition_id": parts[0][1]["partition_id"], "field_schema": schema,
           "production_status": status, "custom_meta": custom}
    if order is not None:
        inv = np.argsort(order, kind="stable")
        rec["global_indexes"] = [rec["global_indexes"][i] for i in inv]
        rec["production_status"] = [status[i] for i in inv]
        rec["custom_meta"] = [custom[i] for i in inv]
        for e in schema.values():
            if "per_sample_shapes" in e:
                e["per_sample_shapes"] = [e["per_sample_shapes"][i] for i in inv]
    return rec


class ShardedBackend:
    """`client.Backend` routed over `backends` (one per shard; see the module docstring)."""

    in_process = False

    def __init__(self, backends: list[Any], polling_mode: bool = True, wait: float = 5.0) -> None:
        if not 1 <= len(backends) <= MAX_SHARDS:
            raise InvalidArgument(f"need 1..{MAX_SHARDS} shards, got {len(backends)}")
        self.backends = list(backends)
        self.n = len(backends)
        self.polling_mode = polling_mode
        self.wait = wait
        self._next = 0  # the shard of this client's next insert

    def _by_shard(self, gidx: npt.ArrayLike) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{shard: (positions in gidx, local indexes)}; refuses indexes of shards that do not exist."""
        shard, local = decode(gidx)
        bad = (shard < 0) | (shard >= self.n)
        if bad.any():
            raise KeyError(f"samples {np.asarray(gidx)[bad][:8].tolist()} are not in this {self.n}-shard system")
        return {int(k): (np.flatnonzero(shard == k), local[shard == k]) for k in np.unique(shard)}

    def _keys_by_shard(self, keys: list[str]) -> dict[int, np.ndarray]:
        shards = np.asarray([key_shard(k, self.n) for k in keys], dtype=np.int64)
        return {int(k): np.flatnonzero(shards == k) for k in np.unique(shards)}

    # ------------------------------------------------------------------ metadata
    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int | None, mode: str = "fetch",
                 task_name: str | None = None, sampler: SamplerArg = None,
                 sampling_config: dict[str, Any] | None = None) -> dict[str, Any]:
        if mode == "insert":
            k = self._next
            self._next = (self._next + 1) % self.n
            rec = self.backends[k].get_meta(partition_id, data_fields, batch_size, mode, task_name, sampler,
                                             sampling_config)
            return _merge_records([(k, rec)])
        if mode == "force_fetch":
            parts, missing = [], None
            for k, b in enumerate(self.backends):
                try:
                    parts.append((k, b.get_meta(partition_id, data_fields, batch_size, mode, task_name, sampler,
                                                sampling_config)))
                except ValueError as e:
                    missing = e
            if not parts and missing is not None:
                raise missing
            return _merge_records(parts)
        deadline = time.monotonic() + self.wait
        while True:
            for k, b in enumerate(self.backends):
                rec = b.get_meta(partition_id, data_fields, batch_size, mode, task_name, sampler, sampling_config)
                if rec["global_indexes"]:
                    return _merge_records([(k, rec)])
            if self.polling_mode:
                return _merge_records([])
            if time.monotonic() > deadline:
                raise GetMetaTimeout(f"Timeout while waiting for sufficient data for task {task_name}: no shard of "
                                     f"{self.n} had {batch_size} ready samples of {data_fields} in partition "
                                     f"{partition_id!r}")
            time.sleep(0.02)  # the shards answer at once (polling); this router waits like one system would

    def kv_retrieve_meta(self, partition_id: str, keys: list[str], create: bool = False) -> dict[str, Any]:
        parts: list[tuple[int, dict[str, Any]]] = []
        positions: list[np.ndarray] = []
        for k, pos in self._keys_by_shard(keys).items():
            rec = self.backends[k].kv_retrieve_meta(partition_id, [keys[i] for i in pos], create)
            found = self.backends[k].kv_retrieve_keys(partition_id, rec["global_indexes"]) if rec[
                "global_indexes"] else []
            where = {keys[i]: i for i in pos}
            parts.append((k, rec))
            positions.append(np.asarray([where[key] for key in found], dtype=np.int64))
        order = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        ranks = np.argsort(np.argsort(order, kind="stable"), kind="stable")  # positions among the found keys
        return _merge_records(parts, ranks)

    def kv_retrieve_keys(self, partition_id: str, gidx: list[int]) -> list[str | None]:
        out: list[str | None] = [None] * len(gidx)
        for k, (pos, local) in self._by_shard(gidx).items():
            for i, key in zip(pos.tolist(), self.backends[k].kv_retrieve_keys(partition_id, local.tolist()),
                              strict=False):
                out[i] = key
        return out

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for b in self.backends:
            for pid, keys in b.kv_list(partition_id).items():
                out.setdefault(pid, {}).update(keys)
        return out

    def set_custom_meta(self, custom_meta: dict[str, dict[int, dict[str, Any]]]) -> None:
        for pid, per in custom_meta.items():
            gidx = list(per)
            for k, (pos, local) in self._by_shard(gidx).items():
                self.backends[k].set_custom_meta({pid: {int(g): per[gidx[i]] for i, g in zip(pos.tolist(),
                                                                                               local.tolist(),
                                                                                               strict=True)}})

    # ------------------------------------------------------------------ values
    def _check_kinds(self, partition_id: str, values: dict[str, FieldValues]) -> None:
        """Refuse, before any shard writes, a field whose kind or dtype differs from any shard's (as one system
        would: a field keeps its kind in a partition, whichever shard holds its samples)."""
        for b in self.backends:
            for f, kind in b.field_kinds(partition_id).items():
                if f in values and values[f].kind.to_json() != kind:
                    raise SchemaError(f"field {f!r}: this put holds {values[f].kind.describe()}, but the partition's "
                                      f"field holds {kind[1]} {kind[0]} values on another shard; a field keeps its "
                                      "kind and dtype; nothing was written")

    def put(self, partition_id: str, gidx: list[int], values: dict[str, FieldValues],
            nested: list[str]) -> None:
        if self.n > 1:
            self._check_kinds(partition_id, values)
        for k, (pos, local) in self._by_shard(gidx).items():
            self.backends[k].put(partition_id, local.tolist(), {f: v.take(pos) for f, v in values.items()}, nested)

    def kv_put(self, partition_id: str, keys: list[str], values: dict[str, FieldValues],
               nested: list[str], tags: list[dict[str, Any] | None] | None) -> dict[str, Any]:
        if len(set(keys)) != len(keys):
            raise ValueError("Got duplicated keys.")
        if self.n > 1 and values:
            self._check_kinds(partition_id, values)
        merged: list[Any] = [None] * len(keys)
        fields: set[str] | None = None
        for k, pos in self._keys_by_shard(keys).items():
            got = self.backends[k].kv_put(partition_id, [keys[i] for i in pos],
                                          {f: v.take(pos) for f, v in values.items()}, nested,
                                          None if tags is None else [tags[i] for i in pos])
            for i, t in zip(pos.tolist(), got["tags"], strict=True):
                merged[i] = t
            fields = set(got["fields"]) if fields is None else fields & set(got["fields"])
        return {"fields": sorted(fields or ()), "tags": merged}

    def read(self, partition_id: str, gidx: list[int], fields: list[str]) -> dict[str, FieldValues]:
        pieces: dict[str, list[tuple[np.ndarray, FieldValues]]] = {f: [] for f in fields}
        for k, (pos, local) in self._by_shard(gidx).items():
            got = self.backends[k].read(partition_id, local.tolist(), fields)
            for f in fields:
                pieces[f].append((pos, got[f]))
        if not gidx:
            raise StorageKeyNotFoundError("read of no samples")
        return {f: FieldValues.join(p, len(gidx)) for f, p in pieces.items()}

    # ------------------------------------------------------------------ status
    def _status(self, call: str, partition_id: str, arg: list[str] | str) -> Status:
        idx: list[np.ndarray] = []
        st: list[np.ndarray] = []
        for k, b in enumerate(self.backends):
            got = getattr(b, call)(partition_id, arg)
            if got is not None:
                idx.append(encode(k, got[0]))
                st.append(np.asarray(got[1], dtype=np.int8))
        if not idx:
            return None
        all_idx = np.concatenate(idx)
        order = np.argsort(all_idx, kind="stable")
        return all_idx[order].tolist(), np.concatenate(st)[order].tolist()

    def production_status(self, partition_id: str, data_fields: list[str]) -> Status:
        return self._status("production_status", partition_id, data_fields)

    def consumption_status(self, partition_id: str, task_name: str) -> Status:
        return self._status("consumption_status", partition_id, task_name)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return all([bool(b.reset_consumption(partition_id, task_name)) for b in self.backends])

    # ------------------------------------------------------------------ clears and partitions
    def clear_samples(self, partition_ids: list[str], gidx: list[int]) -> None:
        shard, _ = decode(gidx)
        keep = (shard >= 0) & (shard < self.n)
        pids = [p for p, ok in zip(partition_ids, keep.tolist(), strict=True) if ok]
        ok_gidx = np.asarray(gidx, dtype=np.int64)[keep]
        for k, (pos, local) in self._by_shard(ok_gidx).items():
            self.backends[k].clear_samples([pids[i] for i in pos.tolist()], local.tolist())

    def clear_partition(self, partition_id: str) -> None:
        for b in self.backends:
            b.clear_partition(partition_id)

    def list_partitions(self) -> list[str]:
        return list(dict.fromkeys(p for b in self.backends for p in b.list_partitions()))

    def snapshot(self, partition_id: str) -> dict[str, Any] | None:
        raise InvalidArgument("partition snapshots of a sharded system are not offered; ask each shard")

    def save_checkpoint(self, path: str) -> None:
        raise InvalidArgument("checkpoints of a sharded system are not offered; checkpoint each shard's system")

    def load_checkpoint(self, path: str) -> None:
        raise InvalidArgument("checkpoints of a sharded system are not offered; checkpoint each shard's system")

    def close_client(self) -> None:
        for b in self.backends:
            close = getattr(b, "close_client", None)
            if close is not None:
                close()
