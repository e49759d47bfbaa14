"""`ArrowbufStorage`: a TorchRL replay-buffer storage whose rows live in an arrowbuf store.

    from torchrl.data import ReplayBuffer, TensorDictReplayBuffer, RandomSampler
    from arrowbuf.compat.torchrl import ArrowbufStorage

    rb = TensorDictReplayBuffer(storage=ArrowbufStorage(10_000), batch_size=256)       # one process
    rb = ReplayBuffer(storage=ArrowbufStorage(10_000, tier="shm", name="replay"), ...)  # shared memory: the storage
                                                                                        # pickles to other processes
    rb = ReplayBuffer(storage=ArrowbufStorage(10_000, store=ab.connect(location)), ...) # a store served over Flight

How slots map onto the ring: TorchRL's `RoundRobinWriter` writes slot `(cursor + k) % max_size`; arrowbuf's ring
keeps the newest `capacity` rows in insert order. With `max_size == capacity`, slot `i` is the stored row whose seq
is `i` modulo `max_size` (plus a fixed offset after `load_state_dict`), so the writer's indices, the sampler's
indices and priority updates all name the same rows. Writes must therefore be appends in round-robin order: a
write at another cursor (a `TensorDictMaxValueWriter`, `rb[i] = x`) raises `NotImplementedError`.

The schema is inferred from the first write: a TensorDict's leaves (nested keys joined with "."), or a plain tensor
(stored as the field `_tensor`); bool, int and float dtypes of any fixed shape. `state_dict()` carries the rows
(an Arrow table) and `dumps(path)`/`loads(path)` write and read an arrowbuf checkpoint (same rows, same slots).

Reads turn slots into row ids and gather them with `ExperienceStore.take` (one gather per column); a store served
over Flight has no random access yet, so there a read takes a snapshot of its rows (`to_table`) and picks from it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage, StoreStorage

from ..errors import InvalidArgument, SchemaError
from ..schema.spec import DTYPES, STREAM_KEYS, SYSTEM_COLUMNS
from ..store.facade import ExperienceStore
from .transfer_queue.columns import dense_numpy

_TENSOR = "_tensor"
_RESERVED = frozenset(SYSTEM_COLUMNS) | frozenset(STREAM_KEYS)


def _column(key: str) -> str:
    return f"{key}__rl" if key in _RESERVED else key


def _key(column: str) -> str:
    return column[:-4] if column.endswith("__rl") and column[:-4] in _RESERVED else column


def _leaves(data: Any) -> dict[str, torch.Tensor]:
    """Flat {"a.b": tensor} of a TensorDict (batched), or {"_tensor": t} of a tensor."""
    if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
        return {_TENSOR: data}
    if not isinstance(data, TensorDictBase):
        if is_tensor_collection(data):
            data = data.to_tensordict()
        elif isinstance(data, dict):
            data = TensorDict(data, batch_size=[len(next(iter(data.values())))])
        else:
            raise TypeError(f"ArrowbufStorage stores TensorDicts and tensors, got {type(data).__name__}")
    out = {}
    for k, v in data.items(include_nested=True, leaves_only=True):
        name = k if isinstance(k, str) else ".".join(k)
        if not isinstance(v, torch.Tensor):
            raise SchemaError(f"field {name!r}: non-tensor values ({type(v).__name__}) cannot be stored")
        out[name] = v
    return out


def _schema(name: str, leaves: dict[str, torch.Tensor]) -> dict[str, Any]:
    fields = {}
    for k, v in leaves.items():
        dtype = str(v.dtype).replace("torch.", "")
        if dtype not in DTYPES:
            raise SchemaError(f"field {k!r}: dtype {dtype} cannot be stored exactly; cast it first")
        fields[_column(k)] = {"dtype": dtype, "shape": list(v.shape[1:])}
    return {"name": name, "fields": fields, "episode_end": [], "truncation": []}


class ArrowbufStorage(StoreStorage):
    """A TorchRL `Storage` of at most `max_size` elements in an arrowbuf `ExperienceStore` (see the module doc).

    Args:
        max_size: elements held (the store's capacity); taken from `store` when omitted there.
        store: an existing store to use (`ExperienceStore`, an attached shared store, `ab.connect(...)`); its
            schema must match the data written. Default: one is created on the first write.
        tier: "host" (default) or "shm" for a store that other processes open (the storage pickles by name).
        name: the store's name (a shared store's name in /dev/shm).
        device: where `get` puts the tensors.
        sampler: the store's own sampler (e.g. `ab.samplers.Prioritized(alpha=0.6, beta=0.4)`), which an
            `ArrowbufSampler` delegates to; TorchRL's samplers ignore it.
        seed: the store sampler's seed.
    """

    def __init__(self, max_size: int | None = None, *, store: Any = None, tier: str = "host",
                 name: str | None = None, device: Any = "cpu", sampler: Any = "fifo", seed: int | None = None) -> None:
        if max_size is None:
            if store is None:
                raise InvalidArgument("ArrowbufStorage needs max_size (or a store to take it from)")
            max_size = int(store.stats()["capacity"])
        Storage.__init__(self, max_size=max_size)  # not StoreStorage's: it needs redis
        if tier not in ("host", "shm"):
            raise InvalidArgument(f"tier must be 'host' or 'shm', got {tier!r}")
        self._store = store
        self._sampler_spec = sampler
        self._seed = seed
        self._tier = tier
        self._name = name or f"torchrl-{id(self):x}"
        self._offset = 0          # slot(seq) = (seq + offset) % max_size
        self._is_tensor = False
        self.device = torch.device(device)
        if store is not None:
            self._check_capacity(store)
            self._is_tensor = _TENSOR in store.schema.fields

    # ------------------------------------------------------------------ the store
    def _check_capacity(self, store: Any) -> None:
        cap = int(store.stats()["capacity"])
        if cap != self.max_size:
            raise InvalidArgument(f"the store holds {cap} rows but max_size is {self.max_size}; they must be equal "
                                  "(slots are ring positions)")

    @property
    def store(self) -> Any:
        """The arrowbuf store underneath (None until the first write): `sql`, `to_table`, `checkpoint` work on it."""
        return self._store

    def _create(self, leaves: dict[str, torch.Tensor]) -> None:
        self._store = ExperienceStore(_schema(self._name, leaves), capacity=self.max_size,
                                      sampler=self._sampler_spec, seed=self._seed, tier=self._tier, name=self._name)
        self._is_tensor = _TENSOR in leaves

    def seqs_of(self, slots: Any) -> np.ndarray:
        """The row ids (seqs) behind slots."""
        lo, hi = self._range()
        arr = np.asarray(torch.as_tensor(slots).reshape(-1).cpu(), dtype=np.int64)
        return lo + (arr - self._offset - lo) % self.max_size

    def slots_of(self, seqs: Any) -> np.ndarray:
        """The slots of row ids (seqs)."""
        return (np.asarray(seqs, dtype=np.int64) + self._offset) % self.max_size

    def _range(self) -> tuple[int, int]:
        """The live seqs [lo, hi) of the store."""
        if isinstance(self._store, ExperienceStore):
            return int(self._store.index.lo), int(self._store.index.hi)
        st = self._store.stats()
        return int(st["first_seq"]), int(st["next_seq"])

    # ------------------------------------------------------------------ Storage
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        if not set_cursor:
            raise NotImplementedError("ArrowbufStorage appends in round-robin order; writing a slot in place "
                                      "(rb[i] = x, write_at) is not supported")
        if isinstance(data, list):
            raise TypeError("ArrowbufStorage stores TensorDicts and tensors, not lists")
        single = isinstance(cursor, (int, np.integer)) or (isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        if single:
            data = data.unsqueeze(0)
            slots = np.array([int(cursor)], dtype=np.int64)
        else:
            slots = np.asarray(torch.as_tensor(cursor).reshape(-1).cpu(), dtype=np.int64)
        leaves = _leaves(data)
        if self._store is None:
            self._create(leaves)
        n = len(slots)
        next_seq = self._range()[1]
        run = (slots[0] + np.arange(n)) % self.max_size
        if len(self._store) == 0 and np.array_equal(slots, run):
            # an empty storage follows the writer's cursor (TorchRL moves it before writing, so a refused first
            # write leaves it ahead)
            self._offset = int(slots[0] - next_seq) % self.max_size
        expected = (next_seq + self._offset + np.arange(n)) % self.max_size
        if not np.array_equal(slots, expected):
            raise NotImplementedError(f"ArrowbufStorage appends in round-robin order: the next slots are "
                                      f"{expected[:4].tolist()}..., the writer asked for {slots[:4].tolist()}... "
                                      "(use a RoundRobinWriter, one writer per storage; TorchRL's writer moves its "
                                      "cursor before a write, so after a refused write it is out of step)")
        cols = {}
        fields = self._store.schema.fields
        for k, v in leaves.items():
            col = _column(k)
            if col not in fields:
                raise SchemaError(f"field {k!r} is not in the storage's schema ({sorted(map(_key, fields))})")
            cols[col] = v.detach().cpu().contiguous().numpy()
        self._store.extend(cols)
        self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def get(self, index: Any) -> Any:
        if self._store is None:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        single = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        if isinstance(index, slice):
            slots = np.arange(self.max_size)[index]
        else:
            slots = np.asarray(torch.as_tensor(index).reshape(-1).cpu(), dtype=np.int64)
        lo, hi = self._range()
        n = hi - lo
        slots = np.where(slots < 0, slots + n, slots)
        seqs = lo + (slots - self._offset - lo) % self.max_size
        if n == 0 or (seqs >= hi).any() or (slots < 0).any() or (slots >= self.max_size).any():
            bad = (seqs >= hi) | (slots < 0) | (slots >= self.max_size)
            raise IndexError(f"slots {slots[bad][:4].tolist()} hold no element (the storage holds {n} of "
                             f"{self.max_size})")
        out: dict[str, torch.Tensor] = {}
        if isinstance(self._store, ExperienceStore):  # random access by id: one gather per column
            got = self._store.take(seqs).to_numpy()
            for col in self._store.schema.fields:
                t = torch.from_numpy(np.ascontiguousarray(got[col]))
                out[_key(col)] = t.to(self.device) if self.device.type != "cpu" else t
        else:  # a remote store: a snapshot of its rows, then a take
            table = self._store.to_table()
            first = int(table.column("seq")[0].as_py()) if table.num_rows else hi
            rows = table.take(pa.array(seqs - first))
            for col in self._store.schema.fields:
                t = torch.from_numpy(np.array(dense_numpy(rows.column(col)), copy=True))
                out[_key(col)] = t.to(self.device) if self.device.type != "cpu" else t
        if self._is_tensor:
            t = out[_TENSOR]
            return t[0] if single else t
        td = TensorDict(out, batch_size=[len(slots)], device=self.device).unflatten_keys(".")
        return td[0] if single else td

    def __len__(self) -> int:
        return 0 if self._store is None else len(self._store)

    def _empty(self) -> None:
        if self._store is not None and self._tier == "host" and isinstance(self._store, ExperienceStore):
            self._store.close()
            self._store = None
        elif self._store is not None:
            raise NotImplementedError("emptying a shared or remote ArrowbufStorage is not supported")
        self._offset = 0
        self._bump_mutation_revision()

    def contains(self, item: Any) -> Any:
        if isinstance(item, int):
            return 0 <= (item + len(self) if item < 0 else item) < len(self)
        if isinstance(item, torch.Tensor):
            return (item >= 0) & (item < len(self))
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    def state_dict(self) -> dict[str, Any]:
        """The rows (a `pa.Table` with their seqs), the schema and the slot offset."""
        if self._store is None:
            return {"initialized": False, "max_size": self.max_size}
        return {"initialized": True, "max_size": self.max_size, "schema": self._store.schema.to_dict(),
                "table": self._store.to_table(), "offset": self._offset, "is_tensor": self._is_tensor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the rows with `state_dict`'s; every element keeps its slot."""
        if int(state_dict["max_size"]) != self.max_size:
            raise InvalidArgument(f"state of a storage of {state_dict['max_size']} slots, this one has "
                                  f"{self.max_size}")
        if self._store is not None:
            self._empty()
        if not state_dict.get("initialized"):
            return
        table: pa.Table = state_dict["table"]
        schema = dict(state_dict["schema"])
        schema["name"] = self._name
        self._store = ExperienceStore(schema, capacity=self.max_size, sampler="fifo", tier=self._tier,
                                      name=self._name)
        self._is_tensor = bool(state_dict.get("is_tensor"))
        if table.num_rows:
            first = int(table.column("seq")[0].as_py())
            self._offset = (first + int(state_dict.get("offset", 0)) - self._range()[1]) % self.max_size
            self._store.extend(table.select(list(self._store.schema.fields)))
        self._bump_mutation_revision()

    def dumps(self, path: Any) -> None:
        """An arrowbuf checkpoint of the rows at `path` (restored by `loads` with the same slots)."""
        if self._store is None:
            raise RuntimeError("nothing to dump: the storage was never written")
        self._store.checkpoint(path)

    def loads(self, path: Any) -> None:
        if self._store is not None:
            self._empty()
        self._store = ExperienceStore.restore(path)
        self._check_capacity(self._store)
        self._is_tensor = _TENSOR in self._store.schema.fields
        self._bump_mutation_revision()

    # TorchRL 0.14 picks a replay buffer's default collate by the storage's class and knows only its own: as a
    # StoreStorage (a key-value store storage, whose get returns whole batches) ArrowbufStorage gets the identity.
    # Nothing else of StoreStorage is used: pickling is Storage's (a shared store pickles by name, a served store by
    # address; a host store refuses), and every method a buffer calls is defined here.
    __getstate__ = Storage.__getstate__
    __setstate__ = Storage.__setstate__

    def close(self) -> None:
        """Close the store (and unlink a shared one this process created); idempotent."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def __repr__(self) -> str:
        return f"ArrowbufStorage(max_size={self.max_size}, len={len(self)}, tier={self._tier!r})"


class ArrowbufSampler(Sampler):
    """A TorchRL sampler that delegates to the `ArrowbufStorage`'s own store sampler (arrowbuf's sum-tree
    `Prioritized`, uniform, ...): `sample` returns its items as slots with `priority_weight` (importance weights, max
    1) when it has them; `update_priority` goes to `store.update_priorities`. TorchRL's own `PrioritizedSampler`
    needs its C++ extension, which torchrl 0.14.1 does not load against torch 2.13.0; this one needs none. Update
    priorities with `rb.update_priority(batch["index"], td_error)` (TorchRL's `update_tensordict_priority` acts only
    for its own PrioritizedSampler)::

        storage = ArrowbufStorage(100_000, sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4))
        rb = TensorDictReplayBuffer(storage=storage, sampler=ArrowbufSampler(), batch_size=256,
                                    priority_key="td_error")
    """

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict[str, Any]]:
        store = self._store(storage)
        batch = store.sample(batch_size, columns=[])
        info: dict[str, Any] = {}
        if batch.weights is not None:
            info["priority_weight"] = torch.as_tensor(np.asarray(batch.weights, dtype=np.float32))
        return torch.as_tensor(storage.slots_of(batch.indices)), info

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        if storage is None:
            raise InvalidArgument("ArrowbufSampler.update_priority needs the storage (a replay buffer passes it)")
        prio = np.asarray(torch.as_tensor(priority).detach().reshape(-1).cpu(), dtype=np.float64)
        self._store(storage).update_priorities(storage.seqs_of(index), prio)

    @staticmethod
    def _store(storage: Any) -> Any:
        if not isinstance(storage, ArrowbufStorage) or storage.store is None:
            raise InvalidArgument("ArrowbufSampler samples an ArrowbufStorage that holds data")
        return storage.store

    def _empty(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}  # the sampler's state (priorities) lives in the store: state_dict/dumps of the storage keep it

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def dumps(self, path: Any) -> None:
        pass

    def loads(self, path: Any) -> None:
        pass


__all__ = ["ArrowbufSampler", "ArrowbufStorage"]
