"""One TransferQueue-compatible system spread over N served systems (shards): the smallest honest sharding.

Each shard is a whole `TQState` served over Flight (`server.TQServer`; inside a Ray job one named Ray actor per
shard, `ray.join_or_start_shards`). `ShardedBackend` is a client-side router with the calls
`TransferQueueClient` makes, so every process that joins with the same shard locations sees one system:

- KV path: a key lives on shard `crc32(key) % N` (the same in every process). `kv_batch_put`/`kv_batch_get`/
  `kv_clear` split their keys by shard and reassemble the caller's order; `kv_list` merges the shards.
- Metadata path: the new samples of one `put(data, partition_id=...)` go *whole* to one shard (a GRPO group put
  together stays together); successive puts of this client rotate over the shards, starting at shard 0. Every
  global index handed out carries its shard: `shard << 40 | index on the shard` (shard 0's indexes are the plain
  ones), and every index passed back is routed by it.
- `get_meta(mode="fetch")` asks the shards in order 0..N-1 and returns the first non-empty batch: a batch (and so a
  GRPO group, a rank's share) comes from one shard and is marked consumed there, so each task still sees each sample
  once, and ranks of one DP group (rank-aware sampler, cached per shard) get the same batch. A batch is *not*
  assembled from several shards: with B ready samples split over shards, a `batch_size` larger than any one shard's
  ready count gets nothing. `force_fetch` concatenates the shards.
- Statuses, tags, key lookups, clears are split by shard and merged.

Not sharded: the field-group stores inside one shard (each shard holds whole `ExperienceStore`s, not an
`arrowbuf.ray.ShardedStore`). Validation: input refused by the client (batch sizes, mixed dtypes, unknown keys, tags
length) writes nothing anywhere; before a put with fields, every shard's kinds of those fields are fetched (one
small call per shard) and a field whose kind differs from any shard's first put of it is refused before any shard
writes. Not atomic across shards otherwise: a put that a shard refuses for another reason (its ring full, a
concurrent put from another process fixing a field's kind first) may already be written on the shards before it;
and a dense 1-D batch of a field that some shard holds as jagged is stored dense on a shard that never saw it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import InvalidArgument, SchemaError
from .columns import FieldKind

SHARD_SHIFT = 40
MAX_SHARDS = 1 << 12
_LOCAL_MASK = (1 << SHARD_SHIFT) - 1


def encode(shard: int, local: np.ndarray) -> np.ndarray:
    """Global indexes of shard-local ones: `shard << 40 | local`."""
    return (np.int64(shard) << SHARD_SHIFT) | np.asarray(local, dtype=np.int64)


def decode(gidx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local index) of global indexes."""
    g = np.asarray(gidx, dtype=np.int64)
    return g >> SHARD_SHIFT, g & _LOCAL_MASK


def key_shard(key: str, n: int) -> int:
    """The shard of a user key (stable across processes and runs)."""
    if not isinstance(key, str):
        raise InvalidArgument(f"keys are str, got {type(key).__name__} {key!r}")
    return zlib.crc32(key.encode()) % n


def _take(col: Any, idx: np.ndarray) -> Any:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.take(pa.array(idx, type=pa.int64()))


def _join(parts: list[tuple[np.ndarray, Any]], n: int) -> Any:
    """One column of `n` rows from (positions, column piece) pairs."""
    if len(parts) == 1 and np.array_equal(parts[0][0], np.arange(n)):
        col = parts[0][1]
        return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    order = np.concatenate([p for p, _ in parts])
    joined = pa.concat_arrays([c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for _, c in parts])
    return joined.take(pa.array(np.argsort(order, kind="stable")))


class ShardedBackend:
    """The calls `TransferQueueClient` makes, routed over `backends` (one per shard; see the module docstring)."""

    def __init__(self, backends: list[Any]) -> None:
        if not 1 <= len(backends) <= MAX_SHARDS:
            raise InvalidArgument(f"need 1..{MAX_SHARDS} shards, got {len(backends)}")
        self.backends = list(backends)
        self.n = len(backends)
        self._next = 0  # the shard of this client's next metadata-path put

    # ------------------------------------------------------------------ routing helpers
    def _by_shard(self, gidx: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{shard: (positions in gidx, local indexes)}; refuses indexes of shards that do not exist."""
        shard, local = decode(gidx)
        bad = (shard < 0) | (shard >= self.n)
        if bad.any():
            raise KeyError(f"samples {np.asarray(gidx)[bad][:8].tolist()} are not in this {self.n}-shard system")
        return {int(k): (np.flatnonzero(shard == k), local[shard == k]) for k in np.unique(shard)}

    def _keys_by_shard(self, keys: list[str]) -> dict[int, np.ndarray]:
        shards = np.asarray([key_shard(k, self.n) for k in keys], dtype=np.int64)
        return {int(k): np.flatnonzero(shards == k) for k in np.unique(shards)}

    def _each(self, call: str, partition_id: str, *args: Any) -> list[tuple[int, Any]]:
        """`call` on every shard that has the partition (KeyError when none has it)."""
        out: list[tuple[int, Any]] = []
        missing: KeyError | None = None
        for k, b in enumerate(self.backends):
            try:
                out.append((k, getattr(b, call)(partition_id, *args)))
            except KeyError as e:
                missing = e
        if not out and missing is not None:
            raise missing
        return out

    # ------------------------------------------------------------------ writes
    def _check_kinds(self, partition_id: str, kinds: dict[str, FieldKind]) -> None:
        """Refuse, before any shard writes, a field whose kind differs from any shard's first put of it (as one
        system would: a field keeps its dtype, shape and kind in a partition, whichever shard holds the samples)."""
        if not kinds or self.n == 1:
            return
        try:
            held = self._each("field_kinds", partition_id)
        except KeyError:
            return  # a new partition
        for _, theirs in held:
            for f, k in kinds.items():
                old = theirs.get(f)
                if old is None or old == k:
                    continue
                if old.kind == "jagged" and k.kind == "dense" and len(k.shape) == 1 and k.dtype == old.dtype:
                    continue  # taken as jagged by the shard that has it jagged (see TQState.check_kinds)
                raise SchemaError(f"field {f!r}: this put holds {k.kind} {k.dtype}{list(k.shape)}, but the "
                                  f"partition's first put of it held {old.kind} {old.dtype}{list(old.shape)}; "
                                  "a field keeps its dtype, shape and kind; nothing was written")

    def put_keys(self, partition_id: str, keys: list[str], kinds: dict[str, FieldKind], cols: dict[str, Any],
                 tags: list[dict[str, Any]] | None) -> tuple[np.ndarray, list[str]]:
        if len(set(keys)) != len(keys):
            raise InvalidArgument("Got duplicated keys.")
        self._check_kinds(partition_id, kinds)
        out = np.empty(len(keys), dtype=np.int64)
        stored: set[str] | None = None
        for k, pos in self._keys_by_shard(keys).items():
            sub_cols = {f: _take(c, pos) for f, c in cols.items()}
            sub_tags = None if tags is None else [tags[i] for i in pos]
            gidx, fields = self.backends[k].put_keys(partition_id, [keys[i] for i in pos], kinds, sub_cols, sub_tags)
            out[pos] = encode(k, gidx)
            stored = set(fields) if stored is None else stored & set(fields)
        return out, sorted(stored or ())

    def put_indexes(self, partition_id: str, gidx: np.ndarray | None, count: int, kinds: dict[str, FieldKind],
                    cols: dict[str, Any], tags: list[dict[str, Any]] | None = None) -> np.ndarray:
        self._check_kinds(partition_id, kinds)
        if gidx is None:  # new samples: the whole put on one shard
            k = self._next
            self._next = (self._next + 1) % self.n
            return encode(k, self.backends[k].put_indexes(partition_id, None, count, kinds, cols, tags))
        gidx = np.asarray(gidx, dtype=np.int64)
        parts = self._by_shard(gidx)
        for k, (pos, local) in parts.items():
            sub_cols = {f: _take(c, pos) for f, c in cols.items()}
            sub_tags = None if tags is None else [tags[i] for i in pos]
            self.backends[k].put_indexes(partition_id, local, len(pos), kinds, sub_cols, sub_tags)
        return gidx

    # ------------------------------------------------------------------ reads
    def read(self, partition_id: str, gidx: np.ndarray, fields: list[str] | None
             ) -> tuple[dict[str, Any], dict[str, FieldKind]]:
        gidx = np.asarray(gidx, dtype=np.int64)
        parts = self._by_shard(gidx)
        pieces: dict[str, list[tuple[np.ndarray, Any]]] = {}
        kinds: dict[str, FieldKind] = {}
        names: set[str] | None = None
        for k, (pos, local) in parts.items():
            cols, ks = self.backends[k].read(partition_id, local, fields)
            if names is not None and set(cols) != names:  # as one system: a sample lacking a field is an error
                lacking = sorted(names ^ set(cols))
                raise SchemaError(f"field(s) {lacking} have no value for some of the samples in partition "
                                  f"{partition_id!r} (not produced yet)")
            names = set(cols)
            kinds.update(ks)
            for f, c in cols.items():
                pieces.setdefault(f, []).append((pos, c))
        return {f: _join(p, len(gidx)) for f, p in pieces.items()}, kinds

    def key_indexes(self, partition_id: str, keys: list[str]) -> np.ndarray:
        out = np.empty(len(keys), dtype=np.int64)
        for k, pos in self._keys_by_shard(keys).items():
            out[pos] = encode(k, self.backends[k].key_indexes(partition_id, [keys[i] for i in pos]))
        return out

    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int, mode: str,
                 task_name: str | None, sampler: Any, sampling_config: dict[str, Any]) -> np.ndarray:
        got: list[np.ndarray] = []
        for k, b in enumerate(self.backends):
            want = batch_size - sum(len(g) for g in got) if mode == "force_fetch" and batch_size else batch_size
            local = np.asarray(b.get_meta(partition_id, data_fields, want, mode, task_name, sampler,
                                          sampling_config), dtype=np.int64)
            if len(local):
                got.append(encode(k, local))
                if mode != "force_fetch" or (batch_size and sum(len(g) for g in got) >= batch_size):
                    break
        return np.concatenate(got) if got else np.zeros(0, dtype=np.int64)

    def _status(self, call: str, partition_id: str, arg: Any) -> tuple[np.ndarray, np.ndarray]:
        idx: list[np.ndarray] = []
        st: list[np.ndarray] = []
        for k, (i, s) in self._each(call, partition_id, arg):
            idx.append(encode(k, i))
            st.append(np.asarray(s, dtype=np.int8))
        all_idx = np.concatenate(idx)
        order = np.argsort(all_idx, kind="stable")
        return all_idx[order], np.concatenate(st)[order]

    def production_status(self, partition_id: str, data_fields: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return self._status("production_status", partition_id, data_fields)

    def consumption_status(self, partition_id: str, task_name: str) -> tuple[np.ndarray, np.ndarray]:
        return self._status("consumption_status", partition_id, task_name)

    def reset_consumption(self, partition_id: str, task_name: str | None) -> bool:
        return any([bool(b.reset_consumption(partition_id, task_name)) for b in self.backends])

    def tags_of(self, partition_id: str, gidx: np.ndarray) -> list[dict[str, Any]]:
        out: list[Any] = [None] * len(gidx)
        for k, (pos, local) in self._by_shard(np.asarray(gidx, dtype=np.int64)).items():
            for i, t in zip(pos.tolist(), self.backends[k].tags_of(partition_id, local), strict=True):
                out[i] = t
        return out

    def keys_of(self, partition_id: str, gidx: np.ndarray) -> list[str | None]:
        out: list[str | None] = [None] * len(gidx)
        for k, (pos, local) in self._by_shard(np.asarray(gidx, dtype=np.int64)).items():
            for i, key in zip(pos.tolist(), self.backends[k].keys_of(partition_id, local), strict=True):
                out[i] = key
        return out

    def field_names(self, partition_id: str) -> list[str]:
        return sorted(set().union(*[set(f) for _, f in self._each("field_names", partition_id)]))

    def kv_list(self, partition_id: str | None) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for b in self.backends:
            for pid, keys in b.kv_list(partition_id).items():
                out.setdefault(pid, {}).update(keys)
        return out

    # ------------------------------------------------------------------ clears
    def clear_keys(self, partition_id: str, keys: list[str]) -> None:
        self.key_indexes(partition_id, keys)  # every key known (KeyError otherwise) before any shard clears
        for k, pos in self._keys_by_shard(keys).items():
            self.backends[k].clear_keys(partition_id, [keys[i] for i in pos])

    def clear_samples(self, partition_id: str, gidx: np.ndarray) -> None:
        shard, _ = decode(gidx)
        ok = np.asarray(gidx)[(shard >= 0) & (shard < self.n)]
        for k, (_, local) in self._by_shard(ok).items():
            self.backends[k].clear_samples(partition_id, local)

    def clear_partition(self, partition_id: str) -> None:
        for b in self.backends:
            b.clear_partition(partition_id)

    def close_client(self) -> None:
        for b in self.backends:
            close = getattr(b, "close_client", None)
            if close is not None:
                close()
