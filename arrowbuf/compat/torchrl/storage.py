"""`ArrowbufStorage`: a TorchRL replay-buffer storage whose elements are rows of an arrowbuf `ExperienceStore`.

    rb = TensorDictReplayBuffer(storage=ArrowbufStorage(10_000), batch_size=256)           # one process
    rb = ReplayBuffer(storage=ArrowbufStorage(10_000, shared_init=True), ...)              # shared memory: hand it
                                                                                            # to workers, even unwritten
    rb = ReplayBuffer(storage=ArrowbufStorage(store=ab.connect(location)), ...)            # a store served over Flight

The parts: `layout` maps TorchRL data onto columns (schema from the first write), `index` resolves TorchRL's index
forms to element positions, `slots` maps positions to the store's rows (each row records its position, so any
write order works), `state` reads and writes state_dicts (also LazyTensorStorage's), `shared` lets the process
that made a shared storage create its store when a worker writes first. What the storage does not support raises
(NotImplementedError, SchemaError) naming the feature; docs/integrations.md lists it.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import weakref
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from torch.utils import _pytree as pytree
from torchrl.data.replay_buffers.storages import Storage, StoreStorage, TensorStorage

from ...errors import InvalidArgument, SchemaError, StoreExists
from ...samplers.spec import from_spec, to_spec
from ...store.facade import ExperienceStore
from . import state as state_io
from .index import resolve
from .layout import Layout
from .rows import gather, live_range
from .shared import StoreHome, request_store
from .slots import SLOT_COLUMN, SeqModulo, SlotColumn, SlotMap, plan_write

try:
    from torch.compiler import disable as _compile_disable
except ImportError:  # pragma: no cover (torch < 2.1)
    from torch._dynamo import disable as _compile_disable

_READ_RETRIES = 8  # a gather that lost a row to a concurrent writer is redone (shared stores)


def _stack_list(data: list[Any]) -> Any:
    """A list of elements as one batch (what TorchRL's storages do with `extend(list)`)."""
    try:
        first = data[0]
        if isinstance(first, torch.Tensor) and not is_tensor_collection(first):
            return torch.stack(data)
        if is_tensor_collection(first):
            return torch.stack(data).contiguous()
        flat = [pytree.tree_flatten(d) for d in data]
        spec = flat[0][1]
        if any(str(s) != str(spec) for _, s in flat):
            raise ValueError("the elements have different structures")
        return pytree.tree_unflatten([torch.stack(leaves) for leaves in zip(*(f for f, _ in flat))], spec)
    except Exception as exc:  # noqa: BLE001 (the message TorchRL's storages give, for the same inputs)
        raise RuntimeError("Stacking the elements of the list resulted in an error. Storages of type "
                           "ArrowbufStorage expect all elements of the list to have the same tree structure. If the "
                           "list is compact (each leaf is itself a batch with the appropriate number of elements) "
                           "consider using a tuple instead, as lists are used within `extend` for per-item addition."
                           ) from exc


def _unsqueeze(data: Any) -> Any:
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        return data.unsqueeze(0)
    return pytree.tree_map(lambda t: t.unsqueeze(0), data)


def _sampler_of(spec: Any) -> Any:
    """A fresh store sampler for `spec` (a sampler instance is bound to one store; a new store needs its own)."""
    if isinstance(spec, (str, type)) or spec is None:
        return spec
    return from_spec(to_spec(spec), "ArrowbufStorage(sampler=...)")


class ArrowbufStorage(StoreStorage):
    """A TorchRL `Storage` of at most `max_size` elements in an arrowbuf `ExperienceStore` (see the module doc).

    Args:
        max_size: elements held (the store's capacity); taken from `store` when omitted there.
        device: where reads put the tensors ("auto": the device of the first write).
        ndim: storage dims, as on LazyTensorStorage: with `ndim=2` a `[T, B]` batch is `T * B` elements indexed
            by (t, b); `max_size` counts elements and is rounded up to whole entries along dim 0.
        compilable: as TorchRL's: the storage's counters are tensors (a `torch.compile`d loop); its own reads and
            writes run eagerly (dynamo does not trace into them). Not with shared memory.
        shared_init: the storage is shared with other processes, which may write first: its store lives in shared
            memory (`tier="shm"`) and the process that made the storage creates it (`arrowbuf.compat.torchrl.shared`).
        scratch_dir: a directory: the store keeps its columns there (arrowbuf's disk tier, memory-mapped), as
            LazyMemmapStorage keeps its memmaps.
        store: an existing store (`ExperienceStore`, attached shared store, `ab.connect(...)`); its capacity must
            equal `max_size`. Default: one is created at the first write.
        tier: "host" (default) or "shm" (shared memory: the storage pickles by name to other processes).
        name: the store's name (a shared store's name in /dev/shm).
        sampler: the store's own sampler (e.g. `ab.samplers.Prioritized(alpha=0.6, beta=0.4)`), used by
            `ArrowbufSampler`; TorchRL's samplers do not use it.
        seed: the store sampler's seed.
        init_timeout: seconds a process that writes first waits for the home process to create a shared store.
    """

    max_size: int

    def __init__(self, max_size: int | None = None, *, device: Any = "cpu", ndim: int = 1, compilable: bool = False,
                 shared_init: bool = False, scratch_dir: Any = None, store: Any = None, tier: str | None = None,
                 name: str | None = None, sampler: Any = "fifo", seed: int | None = None,
                 init_timeout: float = 60.0, checkpointer: Any = None) -> None:
        if max_size is None:
            if store is None:
                raise InvalidArgument("ArrowbufStorage needs max_size (or a store to take it from)")
            max_size = int(store.stats()["capacity"])
        if not isinstance(ndim, int) or ndim < 1:
            raise InvalidArgument(f"ndim must be a positive int, got {ndim!r}")
        if tier is None:
            tier = "shm" if shared_init else "host"
        if tier not in ("host", "shm"):
            raise InvalidArgument(f"tier must be 'host' or 'shm', got {tier!r}")
        if shared_init and tier != "shm":
            raise InvalidArgument("shared_init=True shares the storage with other processes: it needs tier='shm' "
                                  "(the default with shared_init)")
        if compilable and tier == "shm":
            raise RuntimeError("Cannot share a compilable storage between processes.")
        if scratch_dir is not None and tier != "host":
            raise InvalidArgument("scratch_dir keeps the columns on disk (memory-mapped); it cannot be combined with "
                                  "tier='shm' (shared memory)")
        Storage.__init__(self, max_size=max_size, checkpointer=checkpointer, compilable=compilable)
        self.ndim = ndim
        self.shared_init = shared_init
        self.scratch_dir = None if scratch_dir is None else os.fspath(scratch_dir)
        self._store: Any = store
        self._sampler_spec = sampler
        self._seed = seed
        self._tier = tier
        self._name = name or f"torchrl-{os.getpid():x}-{id(self):x}"
        self._init_timeout = float(init_timeout)
        self._layout: Layout | None = None
        self._slots: SlotMap | None = None
        self._home: StoreHome | _RemoteHome | None = None
        self._home_address: str | None = None
        self._lock_pid = -1  # see _init_lock
        self.device = device if device == "auto" else torch.device(device)
        if store is not None:
            self._adopt(store)
        elif tier == "shm":
            self._home = StoreHome(self._create_from_layout)
            self._home_address = self._home.address
            atexit.register(_close_home, weakref.ref(self))

    # ------------------------------------------------------------------ the store
    @property
    def _init_lock(self) -> Any:
        """Guards the store's creation (the home's thread may create it while this thread writes). One per process:
        a lock inherited through fork may be held by a thread that does not exist in the child."""
        if self._lock_pid != os.getpid():
            self._lock = threading.RLock()
            self._lock_pid = os.getpid()
        return self._lock

    @property
    def store(self) -> Any:
        """The arrowbuf store underneath (None until the first write): `sql`, `to_table`, `checkpoint` work on it."""
        return self._store

    @property
    def layout(self) -> Layout | None:
        """How the stored data map onto the store's columns (None until the first write)."""
        return self._layout

    def _adopt(self, store: Any) -> None:
        cap = int(store.stats()["capacity"])
        layout = Layout.from_schema(store.schema)
        if layout.ndim != self.ndim:
            raise InvalidArgument(f"the store holds a storage of ndim={layout.ndim}, this one has ndim={self.ndim}")
        if cap != self.max_size:
            rounded = math.ceil(self.max_size / layout.per_element) * layout.per_element
            if cap != rounded:
                raise InvalidArgument(f"the store holds {cap} rows but max_size is {self.max_size}; they must be "
                                      "equal (positions are ring positions)")
            self.max_size = cap
        self._store = store
        self._layout = layout
        self._slots = SlotColumn(cap) if SLOT_COLUMN in store.schema.fields else SeqModulo(cap)

    def _schema(self, layout: Layout) -> dict[str, Any]:
        schema = layout.schema(self._name)
        schema["fields"][SLOT_COLUMN] = {"dtype": "int64"}
        return schema

    def _open(self, layout: Layout) -> None:
        """Create (or, for a shared store another process created, attach) the store of `layout`."""
        if self._tier == "shm" and self._home is not None and self._home.pid != os.getpid():
            request_store(self._home_address or "", layout.to_json(), self._init_timeout)
            self._adopt(ExperienceStore.attach(self._name, seed=self._seed, timeout=self._init_timeout))
            self._check_layout(layout)
            return
        self._create(layout)

    def _create(self, layout: Layout) -> None:
        if self._store is not None:
            self._check_layout(layout)
            return
        kwargs: dict[str, Any] = {"sampler": _sampler_of(self._sampler_spec), "seed": self._seed,
                                  "name": self._name}
        if self.scratch_dir is not None:
            kwargs["tiers"] = {"disk": self.scratch_dir}
        else:
            kwargs["tier"] = self._tier
        try:
            store = ExperienceStore(self._schema(layout), capacity=self.max_size, **kwargs)
        except StoreExists:  # another storage of this name made it: use it if it holds the same layout
            self._adopt(ExperienceStore.attach(self._name, seed=self._seed, timeout=self._init_timeout))
            self._check_layout(layout)
            return
        self._store = store
        self._slots = SlotColumn(self.max_size)
        self._layout = layout

    def _create_from_layout(self, text: str) -> None:
        """The home process's side of `shared`: create the store a worker asked for (once)."""
        with self._init_lock:
            self._create(Layout.from_json(text))

    def _check_layout(self, layout: Layout) -> None:
        assert self._layout is not None
        mine = [(x.column, x.codec.name, str(x.codec.dtype), x.feature) for x in self._layout.leaves]
        theirs = [(x.column, x.codec.name, str(x.codec.dtype), x.feature) for x in layout.leaves]
        if (mine, self._layout.kind, self._layout.extra, self._layout.inner) != \
                (theirs, layout.kind, layout.extra, layout.inner):
            raise SchemaError(f"the storage holds {self._layout.kind} data with columns {mine} (batch dims "
                              f"{list(self._layout.inner)}+{list(self._layout.extra)}), the write brings "
                              f"{layout.kind} data with {theirs} ({list(layout.inner)}+{list(layout.extra)})")

    def _attach_if_shared(self) -> bool:
        """A shared storage whose store another process created: attach to it (False if none exists yet)."""
        if self._store is not None:
            return True
        if self._tier != "shm":
            return False
        try:
            self._adopt(ExperienceStore.attach(self._name, seed=self._seed))
        except (LookupError, FileNotFoundError):
            return False
        return True

    def _range(self) -> tuple[int, int]:
        """The live seqs [lo, hi) of the store."""
        return live_range(self._store)

    def _per_element(self, data: Any = None, batched: bool = True) -> int:
        if self._layout is not None:
            return self._layout.per_element
        if self.ndim == 1 or data is None:
            return 1
        shape = _shape_of(data)
        return math.prod(shape[1:self.ndim] if batched else shape[:self.ndim - 1])

    # ------------------------------------------------------------------ TorchRL's shape API
    @property
    def initialized(self) -> bool:
        return self._store is not None or self._attach_if_shared()

    @property
    def _len(self) -> int:
        return len(self)

    @_len.setter
    def _len(self, value: int) -> None:
        # RoundRobinWriter.write_at sets it on storages that keep a counter; here the length is the number of
        # stored elements, which the write itself already changed
        pass

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        # TorchRL's writers call this before they move their cursor and then write: data this storage cannot
        # hold is refused here, so the writer stays in step with what is stored
        data = batched_data if batched_data is not None else single_data
        if data is not None:
            self._check(data, batched=batched_data is not None)
        if self.ndim == 1:
            return self.max_size
        if self._layout is None and single_data is None and batched_data is None:
            raise ValueError("single_data or batched_data must be passed.")
        per = self._per_element(batched_data if batched_data is not None else single_data,
                                batched=batched_data is not None)
        return -(self.max_size // -per)

    @property
    def _len_along_dim0(self) -> int:
        per = self._per_element()
        return -(len(self) // -per)

    @property
    def _total_shape(self) -> torch.Size | None:
        if self._layout is None:
            return None
        return torch.Size([self.max_size // self._layout.per_element, *self._layout.inner])

    @property
    def shape(self) -> torch.Size | None:
        if self.ndim == 1:
            return torch.Size([self.max_size])
        total = self._total_shape
        if total is None:
            return None
        return total if self._is_full else torch.Size([self._len_along_dim0, *total[1:]])

    @_compile_disable()
    def _rand_given_ndim(self, batch_size: int) -> Any:
        if self.ndim == 1:
            return torch.randint(0, len(self), (batch_size,), generator=self._rng)
        shape = self.shape
        assert shape is not None
        return tuple(torch.randint(d, (batch_size,), generator=self._rng) for d in shape)

    def flatten(self) -> Any:
        """A `TensorStorage` of the elements with the storage dims flattened (a copy, as TorchRL's is a view)."""
        if self.ndim == 1:
            return self
        data = self.get(slice(None))
        if is_tensor_collection(data) or isinstance(data, torch.Tensor):
            return TensorStorage(data.flatten(0, self.ndim - 1))
        return TensorStorage(pytree.tree_map(lambda t: t.flatten(0, self.ndim - 1), data))

    def _check(self, data: Any, batched: bool) -> None:
        """Raise `SchemaError` (or RuntimeError for a list that does not stack) unless `data` can be written."""
        if isinstance(data, list):
            data = _stack_list(data)
        batch = data if batched else _unsqueeze(data)
        layout = self._layout if self._layout is not None else Layout.infer(batch, self.ndim)
        layout.columns(batch, self.ndim, partial=True, encode=False)

    # ------------------------------------------------------------------ Storage: writes
    @_compile_disable()
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        if isinstance(data, list):
            data = _stack_list(data)
        single = isinstance(cursor, (int, np.integer)) or (isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        if self._layout is None:
            with self._init_lock:
                if self._layout is None:
                    layout = Layout.infer(_unsqueeze(data) if single else data, self.ndim)
                    if self.ndim > 1:  # as LazyTensorStorage: whole entries along dim 0
                        self.max_size = -(self.max_size // -layout.per_element) * layout.per_element
                    if self.device == "auto":
                        self.device = torch.device(getattr(data, "device", None) or "cpu")
                    self._open(layout)
        assert self._layout is not None
        if isinstance(cursor, range):
            cursor = torch.arange(cursor.start, cursor.stop, cursor.step)
        elif isinstance(cursor, list):
            cursor = torch.as_tensor(cursor)
        # a write addresses the whole capacity (LazyTensorStorage writes into its preallocated array)
        dims = (self.max_size // self._layout.per_element, *self._layout.inner)
        positions, shape = resolve(cursor, dims)
        if set_cursor:
            self._set_last_cursor(cursor)
        self._write(positions, self._layout.broadcast(data, shape), len(shape))
        self._bump_mutation_revision()

    def _write(self, positions: np.ndarray, data: Any, lead: int) -> None:
        assert self._layout is not None and self._slots is not None
        lo, hi = self._range()
        self._slots.refresh(self._store, lo, hi)
        keep, update_seqs, append = plan_write(self._slots, positions, lo, hi, self.max_size)
        cols = self._layout.columns(data, lead, partial=not append.any())
        n = len(positions)
        for name, col in cols.items():
            if len(col) != n:
                raise SchemaError(f"key {name!r}: {len(col)} elements for {n} positions")
        if self._slots.recorded:
            cols[SLOT_COLUMN] = positions
        if len(keep) != n:
            cols = {k: _take(v, keep) for k, v in cols.items()}
        if (~append).any():
            upd = {k: _take(v, np.flatnonzero(~append)) for k, v in cols.items() if k != SLOT_COLUMN}
            self._store.update(update_seqs, upd)
        if append.any():
            rows = cols if append.all() else {k: _take(v, np.flatnonzero(append)) for k, v in cols.items()}
            ids = self._store.extend(rows)
            self._slots.record(positions[keep][append], ids)

    # ------------------------------------------------------------------ Storage: reads
    @_compile_disable()
    def get(self, index: Any) -> Any:
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        if _whole(index) and _writing_through_a_read():
            raise NotImplementedError(
                "ArrowbufStorage: TorchRL's ReplayBuffer writes `rb[i, j] = x` (a tuple index) and `rb[key] = x` into "
                "the view `rb[:]` returns; this storage's reads are copies, so such a write would be lost. Write "
                "through the storage instead: `rb.storage[index] = x` (or `rb[i] = x` with one index)")
        assert self._layout is not None and self._slots is not None
        for attempt in range(_READ_RETRIES):
            lo, hi = self._range()
            self._slots.refresh(self._store, lo, hi)
            dims = (-(max(hi - lo, 0) // -self._layout.per_element), *self._layout.inner)
            if hi - lo == self.max_size:
                dims = (self.max_size // self._layout.per_element, *self._layout.inner)
            positions, shape = resolve(index, dims)
            seqs, live = self._slots.seqs(positions, lo, hi)
            if not live.all():
                bad = positions[~live][:4].tolist()
                raise IndexError(f"positions {bad} hold no element (the storage holds {hi - lo} of {self.max_size}; "
                                 "a position is filled by a write)")
            try:
                got = self._gather(seqs)
            except InvalidArgument:  # a concurrent writer recycled a row while it was read: read again
                if attempt == _READ_RETRIES - 1:
                    raise
                continue
            device = self.device if isinstance(self.device, torch.device) else torch.device("cpu")
            return self._layout.rebuild(got, shape, device)
        raise AssertionError("unreachable")

    def _gather(self, seqs: np.ndarray) -> dict[str, Any]:
        assert self._layout is not None
        return gather(self._store, seqs, self._layout.columns_names)

    def __len__(self) -> int:
        if not self.initialized:
            return 0
        return len(self._store)

    @property
    def _is_full(self) -> bool:
        return len(self) == self.max_size

    def contains(self, item: Any) -> Any:
        n = self._len_along_dim0
        if isinstance(item, int):
            return 0 <= (item + n if item < 0 else item) < n
        if isinstance(item, torch.Tensor):
            return (item >= 0) & (item < n)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    # ------------------------------------------------------------------ the store's own sampler (ArrowbufSampler)
    def sample_store(self, batch_size: int) -> tuple[Any, np.ndarray]:
        """A batch drawn by the store's own sampler: (the `SampleBatch` of its ids, their positions)."""
        if not self.initialized:
            raise RuntimeError("Cannot sample from an empty storage.")
        assert self._slots is not None
        cols = [SLOT_COLUMN] if self._slots.recorded else []
        batch = self._store.sample(batch_size, columns=cols)
        if self._slots.recorded:
            positions = np.asarray(batch.to_numpy()[SLOT_COLUMN], dtype=np.int64)
        else:
            positions = self._slots.positions(batch.indices, self._store)
        return batch, positions

    def index_of(self, positions: np.ndarray) -> Any:
        """TorchRL's index of element positions: a tensor, or a tuple of tensors (one per dim) when ndim > 1."""
        t = torch.as_tensor(positions, dtype=torch.long)
        if self.ndim == 1:
            return t
        shape = self._total_shape
        assert shape is not None
        return tuple(torch.as_tensor(x) for x in np.unravel_index(positions, tuple(shape)))

    def positions_of(self, index: Any) -> np.ndarray:
        """Element positions of a TorchRL index (flat positions, a tuple per dim, or [N, ndim] coordinates)."""
        shape = self._total_shape
        if isinstance(index, tuple) and shape is not None:
            return np.ravel_multi_index(tuple(np.asarray(torch.as_tensor(i).cpu()) for i in index), tuple(shape))
        arr = np.asarray(torch.as_tensor(index).detach().cpu(), dtype=np.int64)
        if self.ndim > 1 and arr.ndim == 2 and shape is not None and arr.shape[-1] == self.ndim:
            return np.ravel_multi_index(tuple(arr.T), tuple(shape))
        return arr.reshape(-1)

    def update_store_priorities(self, index: Any, priorities: np.ndarray) -> None:
        """Priorities of elements (a TorchRL index) to the store's sampler."""
        if not self.initialized:
            raise RuntimeError("the storage holds nothing yet")
        assert self._slots is not None
        lo, hi = self._range()
        self._slots.refresh(self._store, lo, hi)
        positions = self.positions_of(index)
        seqs, live = self._slots.seqs(positions, lo, hi)
        if len(priorities) == 1 and len(seqs) > 1:
            priorities = np.repeat(priorities, len(seqs))
        self._store.update_priorities(seqs[live], priorities[live])

    def seqs_of(self, index: Any) -> np.ndarray:
        """The row ids (seqs) behind a TorchRL index."""
        assert self._slots is not None
        lo, hi = self._range()
        self._slots.refresh(self._store, lo, hi)
        return self._slots.seqs(self.positions_of(index), lo, hi)[0]

    # ------------------------------------------------------------------ lifetime, state
    def _empty(self) -> None:
        if self._store is not None:
            if self._tier != "host" or not isinstance(self._store, ExperienceStore):
                raise NotImplementedError("emptying a shared or served ArrowbufStorage (rb.empty()) is not supported: "
                                          "other processes use its store; make a new storage instead")
            self._store.close()
            self._store, self._slots, self._layout = None, None, None
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, Any]:
        """A state_dict of plain containers and tensors (`torch.load(weights_only=True)` reads it; see `state`)."""
        if not self.initialized:
            return state_io.empty_state(self.max_size, self.ndim)
        assert self._layout is not None
        return state_io.dump(self._store, self._layout, self.max_size, self.ndim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the elements with those of `state_dict` (this storage's or a LazyTensorStorage's); every element
        keeps its position, and the store keeps this storage's sampler."""
        loaded = state_io.read(state_dict, self.max_size, self.ndim)
        self._replace_store(None)
        if loaded.layout is not None:
            self.max_size = loaded.max_size
            self._create(loaded.layout)
            assert self._slots is not None
            if loaded.positions is not None and len(loaded.positions):
                cols = dict(loaded.columns)
                if self._slots.recorded:
                    cols[SLOT_COLUMN] = loaded.positions
                self._slots.record(loaded.positions, self._store.extend(cols))
            elif loaded.entries:
                self.set(torch.arange(loaded.entries), loaded.data, set_cursor=False)
        self._bump_mutation_revision()

    def _replace_store(self, layout: Layout | None) -> None:
        """Drop the store (host) and, for `layout`, make an empty one (load_state_dict, loads)."""
        if self._store is not None:
            if self._tier != "host":
                raise NotImplementedError("loading a state into a shared ArrowbufStorage that holds a store is not "
                                          "supported (other processes use it); load it into a new storage")
            self._store.close()
        self._store, self._slots, self._layout = None, None, None
        if layout is not None:
            self._create(layout)

    def dumps(self, path: Any) -> None:
        """An arrowbuf checkpoint of the store at `path` (rows, positions, the store sampler's state)."""
        if not self.initialized:
            raise RuntimeError("nothing to dump: the storage was never written")
        self._store.checkpoint(path)

    def loads(self, path: Any) -> None:
        """Replace the store with the checkpoint at `path` (`dumps`)."""
        if self._store is not None:
            self._replace_store(None)
        store = ExperienceStore.restore(path, name=self._name)
        try:
            self._adopt(store)
        except BaseException:
            store.close()
            raise
        self._bump_mutation_revision()

    def close(self) -> None:
        """Close the store (and unlink a shared one this process created); idempotent."""
        if self._home is not None:
            self._home.close()
        if self._store is not None:
            self._store.close()
            self._store = None

    def __getstate__(self) -> dict[str, Any]:
        state = Storage.__getstate__(self)
        state["_home_pid"] = self._home.pid if self._home is not None else None
        state["_home"] = None
        state.pop("_lock", None)
        state["_lock_pid"] = -1
        if self._tier == "host" and self._store is not None and isinstance(self._store, ExperienceStore):
            raise TypeError("an ArrowbufStorage whose store lives in this process's heap cannot be pickled; create it "
                            "with tier='shm' (or shared_init=True) to share it with other processes")
        if self._tier == "host" and self._store is None and get_spawning_popen() is not None:
            raise RuntimeError("Cowardly refusing to share an ArrowbufStorage that keeps its rows in this process's "
                               "heap with another process: what the other process writes would stay there. Make it "
                               "with shared_init=True (shared memory), or write to it in this process only")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        home_pid = state.pop("_home_pid", None)
        Storage.__setstate__(self, state)
        if home_pid is not None and self._home_address is not None:
            self._home = _RemoteHome(home_pid, self._home_address)

    def __repr__(self) -> str:
        return f"ArrowbufStorage(max_size={self.max_size}, len={len(self)}, ndim={self.ndim}, tier={self._tier!r})"


class _RemoteHome:
    """The home of a shared storage seen from another process (it only knows where to ask)."""

    def __init__(self, pid: int, address: str) -> None:
        self.pid = pid
        self.address = address

    def close(self) -> None:
        pass


def _close_home(ref: Any) -> None:
    """At exit of the process that made a shared storage: stop listening and close (unlink) its store."""
    storage = ref()
    if storage is not None and isinstance(storage._home, StoreHome) and storage._home.pid == os.getpid():
        storage.close()


def _whole(index: Any) -> bool:
    if isinstance(index, tuple):
        return all(_whole(i) for i in index)
    return isinstance(index, slice) and index == slice(None)


def _writing_through_a_read() -> bool:
    """Whether this read serves TorchRL's `ReplayBuffer.__setitem__`, which writes into what it reads."""
    frame = sys._getframe(2)
    for _ in range(10):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "__setitem__" and "replay_buffers" in code.co_filename and "torchrl" in code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _take(values: Any, idx: np.ndarray) -> Any:
    if isinstance(values, np.ndarray):
        return values[idx]
    return values.take(idx)  # a pa.Array (JSON text)


def _shape_of(data: Any) -> tuple[int, ...]:
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        return tuple(data.shape)
    return tuple(pytree.tree_flatten(data)[0][0].shape)


__all__ = ["ArrowbufStorage"]
