"""The parts of a TransferQueue-compatible system's state (`state.TQState` holds them): the system-wide
`IndexManager`, a `Partition` (samples, keys, custom metadata, per-task consumption, fields) with, per field, its
schema as TransferQueue reports it (`FieldInfo`) and where its values are (`FieldState`), and the arrowbuf stores
that hold the values (`FieldGroup`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ...errors import ArrowbufError, InvalidArgument, SchemaError
from ...flight.wire import wire_array
from ...schema.dtypes import physical_dtype
from ...schema.spec import STREAM_KEYS, SYSTEM_COLUMNS
from ...store.facade import ExperienceStore
from .columns import FieldKind, FieldValues

log = logging.getLogger("arrowbuf.compat")
#: A status reply (`production_status`, `consumption_status`): (the partition's sorted global indexes, per index its
#: 0/1 per field or 0/1 consumed), a two-element JSON list over the wire; None: unknown partition or field.
Status = Sequence[list[Any]] | None


def grow(arr: np.ndarray, n: int, fill: float) -> np.ndarray:
    if len(arr) >= n:
        return arr
    out = np.full(max(n, 2 * len(arr), 16), fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


class IndexManager:
    """System-wide global indexes: released ones are reused first, in release order; each partition's set of
    indexes (a Python set, iterated as TransferQueue iterates it: `force_fetch` returns them in that order)."""

    def __init__(self) -> None:
        self.counter = 0
        self.reusable: list[int] = []
        self.of: dict[str, set[int]] = {}

    def allocate(self, partition_id: str, count: int) -> list[int]:
        if count <= 0:
            raise ValueError(f"Number of indexes needed must be larger than 0, but got {count}")
        reuse = self.reusable[:count]
        del self.reusable[:count]
        fresh = list(range(self.counter, self.counter + count - len(reuse)))
        self.counter += len(fresh)
        out = reuse + fresh
        self.of.setdefault(partition_id, set()).update(out)
        return out

    def release_partition(self, partition_id: str) -> list[int]:
        indexes = self.of.pop(partition_id, set())
        self.reusable.extend(indexes)
        return list(indexes)

    def release(self, partition_id: str, indexes: list[int]) -> None:
        mine = self.of.get(partition_id)
        if mine is None:
            return
        if not set(indexes) <= mine:
            raise ValueError("Some indexes to release do not belong to the specified partition.")
        mine.difference_update(indexes)
        self.reusable.extend(indexes)
        if not mine:
            self.of.pop(partition_id, None)

    def to_json(self) -> dict[str, Any]:
        return {"counter": self.counter, "reusable": self.reusable, "of": {p: list(s) for p, s in self.of.items()}}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> IndexManager:
        m = cls()
        m.counter, m.reusable = int(obj["counter"]), [int(i) for i in obj["reusable"]]
        m.of = {str(p): {int(i) for i in s} for p, s in obj["of"].items()}
        return m


@dataclass
class FieldInfo:
    """One field's schema in a partition, as TransferQueue's controller keeps it (what `BatchMeta.field_schema`
    reports): dtype (a name), shape (None once nested), is_nested, is_non_tensor, and each sample's shape while
    nested. A put of another shape makes it nested; once the samples left after a clear share one shape it is not."""

    indexes: set[int] = field(default_factory=set)
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    is_nested: bool | None = None
    is_non_tensor: bool | None = None
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def first(cls, entry: dict[str, Any], gidx: list[int]) -> FieldInfo:
        shapes = entry.get("per_sample_shapes")
        return cls(set(gidx), entry.get("dtype"), _shape(entry.get("shape")), bool(entry.get("is_nested", False)),
                   bool(entry.get("is_non_tensor", False)),
                   {g: tuple(s) for g, s in zip(gidx, shapes, strict=True)} if shapes else {})

    def update(self, entry: dict[str, Any], gidx: list[int]) -> None:
        dtype = entry.get("dtype")
        if dtype is not None:
            if self.dtype is None:
                self.dtype = dtype
            elif self.dtype != dtype:
                raise SchemaError(f"dtype mismatch: existing={self.dtype}, incoming={dtype}. All batches for the "
                                  "same field must have the same dtype.")
        if entry.get("is_nested"):
            shapes = entry.get("per_sample_shapes")
            if shapes is None:
                raise SchemaError("Receiving a nested field without 'per_sample_shapes'!")
            if self.is_nested is not None and not self.is_nested:
                for g in self.indexes:
                    self.shapes[g] = self.shape  # type: ignore[assignment]
                self.is_nested, self.shape = True, None
            self.shapes.update({g: tuple(s) for g, s in zip(gidx, shapes, strict=True)})
        elif not entry.get("is_non_tensor"):
            shape = _shape(entry.get("shape"))
            if shape is None:
                raise SchemaError("Receiving a regular tensor without 'shape'!")
            if self.is_nested:
                self.shapes.update({g: shape for g in gidx})
            elif self.is_non_tensor is not None and not self.is_non_tensor and self.shape != shape:
                for g in self.indexes:
                    self.shapes[g] = self.shape  # type: ignore[assignment]
                self.shapes.update({g: shape for g in gidx})
                self.shape, self.is_nested = None, True
        self.indexes.update(gidx)

    def remove(self, gidx: list[int]) -> None:
        for g in gidx:
            self.shapes.pop(g, None)
            self.indexes.discard(g)
        if not self.indexes:
            self.is_nested = self.is_non_tensor = self.shape = self.dtype = None
            self.shapes.clear()
        elif self.is_nested:
            left = {tuple(s) for s in self.shapes.values()}
            if len(left) == 1:
                self.is_nested, self.shape = False, left.pop()
                self.shapes.clear()

    def batch_schema(self, gidx: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": None if self.shape is None else list(self.shape),
                               "is_nested": self.is_nested, "is_non_tensor": self.is_non_tensor}
        if self.is_nested and self.shapes:
            out["per_sample_shapes"] = [None if self.shapes.get(g) is None else list(self.shapes[g]) for g in gidx]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"indexes": sorted(self.indexes), "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape), "is_nested": self.is_nested,
                "is_non_tensor": self.is_non_tensor, "shapes": [[g, list(s)] for g, s in self.shapes.items()]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FieldInfo:
        return cls({int(i) for i in obj["indexes"]}, obj["dtype"], _shape(obj["shape"]), obj["is_nested"],
                   obj["is_non_tensor"], {int(g): tuple(s) for g, s in obj["shapes"]})


def _shape(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(d) for d in value)


SHAPE_PREFIX = "__shape__."
RESERVED = frozenset(SYSTEM_COLUMNS) | frozenset(STREAM_KEYS)


class SharedMemoryBudget:
    """The /dev/shm of one system's field groups: fresh store names (`name`: the system's prefix and a count, so two
    systems never collide) and the bytes their stores reserve. A store is reserved whole when it is made
    (`posix_fallocate`: real memory, whether or not rows are ever written, and a plan carries no values), so every
    store of every group together stays within `limit` bytes: `take` refuses what would pass it (the group's store
    is then made in the system's memory and its rows go over Flight), `give` returns a closed store's bytes.
    Thread-safe."""

    def __init__(self, prefix: str, limit: int) -> None:
        self.prefix = prefix
        self.limit = int(limit)
        self.used = 0
        self._count = 0
        self._lock = threading.Lock()

    @staticmethod
    def default_limit(root: str = "/dev/shm") -> int:
        """Half of the size of the file system under `root` (0 where there is none)."""
        try:
            st = os.statvfs(root)
        except OSError:
            return 0
        return st.f_frsize * st.f_blocks // 2

    def name(self) -> str:
        with self._lock:
            self._count += 1
            return f"{self.prefix}-{self._count}"

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)


#: A field group's store in shared memory starts with `INITIAL_ROWS` rows only while they take at most this many
#: bytes (else with the first put's rows): /dev/shm is reserved when the store is made, and a plan carries no values.
SMALL_STORE_BYTES = 1 << 20

#: Rows a field group's store starts with (or the first put's rows, if more): it doubles (its rows copied into a
#: store twice its size) until it holds the partition's `capacity`, so that a partition written a few samples
#: holds a few rows, not a whole ring.
INITIAL_ROWS = 16


class FieldGroup:
    """One arrowbuf store holding fields written together, each in one storage form. A ragged tensor field has a
    companion column `__shape__.<field>` with each row's shape. Rows are addressed by a row id: the store's seq less
    `base` (a store that grows is replaced by a larger one, whose seqs start elsewhere). `pending` counts the rows
    planned into it whose writes are in flight (`make_room`).

    `shm` given, no JSON field, and the largest sample of each ragged field (nested tensors, text) known (`need`:
    field -> (elements, dimensions)): the store is in shared memory under a fresh name from it (a grown store is
    another), so that the processes of the node write and read its rows themselves (`shm`: that name; None where
    /dev/shm had no room, the budget had none left, or the store is this process's). A ragged arena in /dev/shm cannot
    grow, so each is sized for (rows + 1) samples of the largest (`ragged_arena`: any rows in the ring, plus the
    padding where a sample wraps), and a put with a larger sample goes to a new group (`make_room`). `attached` opens
    such a group in another process."""

    def __init__(self, name: str, forms: dict[str, tuple[FieldKind, Any]], capacity: int,
                 store: ExperienceStore | None = None, base: int = 0, rows: int = INITIAL_ROWS,
                 shm: SharedMemoryBudget | None = None, need: dict[str, tuple[int, int]] | None = None) -> None:
        self.name = name
        self.capacity = capacity
        self.forms = dict(forms)
        self.fields = tuple(sorted(forms))
        self.pending = 0
        ragged = [f for f, (_, m) in self.forms.items() if m == "ragged"]
        sized = all(k.kind != "json" for k, _ in self.forms.values()) and (
            not ragged or (need is not None and all(f in need for f in ragged)))
        self._budget = shm if sized else None
        # the largest sample each ragged field's arena is sized for (shared memory only)
        self.need: dict[str, tuple[int, int]] = {f: need[f] for f in ragged} if shm and sized and need else {}
        self._shm_bytes = 0  # what the current store took of the budget
        self.shm: str | None = None
        self._arrow_types: dict[str, pa.DataType] | None = None  # each field's Arrow type in `batch` (`takes_as_is`)
        # a ragged tensor field has a companion column of shapes, which a put's record batch does not carry
        self._no_companions = not any(k.kind == "tensor" and m == "ragged" for k, m in self.forms.values())
        # a field is the store column of its name (SQL sees it), or `<name>__tq` where a store column has the name
        self.column = {f: f"{f}__tq" if f in RESERVED or f.startswith(SHAPE_PREFIX) else f for f in self.fields}
        first = max(rows, INITIAL_ROWS)
        if self._budget is not None:  # reserved at once: no more rows of large samples than the first put's
            first = max(rows, min(INITIAL_ROWS, SMALL_STORE_BYTES // self._row_bytes()))
        first = min(capacity, max(first, 1))

        def sized_for(elements: int) -> dict[str, int]:
            # per ring row: (rows + 1) of the largest over `first` rows (a grown store has more rows: more room)
            return {"mean_length": max(1, elements + -(-elements // first) + 1)}

        cols: dict[str, Any] = {}
        for f in self.fields:
            kind, mode = forms[f]
            if kind.kind == "json":
                cols[self.column[f]] = {"dtype": "json"}
            elif mode == "ragged" or kind.kind != "tensor":
                cols[self.column[f]] = {"dtype": kind.dtype, "ragged": True}
                if f in self.need:
                    cols[self.column[f]].update(sized_for(self.need[f][0]))
            else:
                cols[self.column[f]] = {"dtype": kind.dtype, "shape": list(mode)}
            if kind.kind == "tensor" and mode == "ragged":
                cols[SHAPE_PREFIX + self.column[f]] = {"dtype": "int64", "ragged": True}
                if f in self.need:
                    cols[SHAPE_PREFIX + self.column[f]].update(sized_for(self.need[f][1]))
        self._schema = {"name": name, "fields": cols, "episode_end": [], "truncation": []}  # a sample is a row
        self.store = store if store is not None else self._new_store(first)
        self.base = base

    def _new_store(self, rows: int) -> ExperienceStore:
        """A store of `rows` rows: in shared memory when the group has a budget (in this process's memory where the
        budget or /dev/shm has no room for it: then its rows go over Flight); `shm` says which."""
        budget = self._budget
        if budget is not None:
            need = rows * self._row_bytes()
            if not budget.take(need):
                log.warning("%s: a shared-memory store of %d rows (%d bytes) would pass the system's shm_budget "
                            "(%d of %d bytes taken); its rows go over Flight", self.name, rows, need, budget.used,
                            budget.limit)
            else:
                try:
                    store = ExperienceStore(self._schema, capacity=rows, sampler="fifo", name=budget.name(),
                                            tier="shm")
                except (ArrowbufError, OSError) as e:
                    budget.give(need)
                    log.warning("%s: no shared-memory store of %d rows (%s); its rows go over Flight", self.name,
                                rows, e)
                else:
                    # what it really reserved (its index, flags and chunks too): taken as well, or not kept
                    extra = int(store.stats().get("reserved_bytes", need)) - need
                    if extra <= 0 or budget.take(extra):
                        self.shm, self._shm_bytes = store.name, need + max(extra, 0)
                        return store
                    store.close()
                    budget.give(need)
                    log.warning("%s: a shared-memory store of %d rows would pass the system's shm_budget; its rows "
                                "go over Flight", self.name, rows)
        self.shm, self._shm_bytes = None, 0
        return ExperienceStore(self._schema, capacity=rows, sampler="fifo", name=self.name)

    def _row_bytes(self) -> int:
        """Bytes a row of this group's store reserves in shared memory, about (its dense fields, and the store's
        own columns: seq, flags); the store's real reservation is taken once it exists."""
        total = 64
        for f, (kind, mode) in self.forms.items():
            size = physical_dtype(kind.dtype).itemsize
            if mode == "ragged":
                elements, dims = self.need.get(f, (0, 0))
                total += elements * size + dims * 8 + 48  # and each arena's per-row bookkeeping
            else:
                total += int(np.prod(mode, dtype=np.int64)) * size
        return total

    def _release(self, store: ExperienceStore, shm_bytes: int) -> None:
        store.close()
        if shm_bytes and self._budget is not None:
            self._budget.give(shm_bytes)

    @classmethod
    def attached(cls, shm: str, forms: dict[str, tuple[FieldKind, Any]], base: int) -> FieldGroup:
        """The group whose store is the shared store `shm`, opened in this process (a client of the node writes and
        reads its rows; the system's process owns it). Raises what `ExperienceStore.attach` raises."""
        store = ExperienceStore.attach(shm)
        group = cls(shm, forms, store.capacity, store=store, base=base)
        group.shm = shm
        return group

    def describe(self) -> dict[str, Any]:
        """What a client of the node needs to open the group (`attached`): its shared store, base and forms."""
        return {"shm": self.shm, "base": self.base,
                "forms": {f: [k.to_json(), m if m == "ragged" else list(m)] for f, (k, m) in self.forms.items()}}

    @staticmethod
    def forms_of(obj: dict[str, Any]) -> dict[str, tuple[FieldKind, Any]]:
        """The forms `describe` (or `to_json`) wrote."""
        return {str(f): (FieldKind.from_json(k), m if m == "ragged" else tuple(int(d) for d in m))
                for f, (k, m) in obj["forms"].items()}

    def fits(self, need: dict[str, tuple[int, int]] | None) -> bool:
        """Whether samples whose largest are `need` (None: not known) fit the arenas of this group's store: always
        where they can grow (the process's memory), in shared memory only within the sizes they were made for."""
        if not self.need or self.shm is None:
            return True
        return need is not None and all(
            f in need and need[f][0] <= e and need[f][1] <= d for f, (e, d) in self.need.items())

    def make_room(self, n: int, oldest_live: int | None) -> bool:
        """Make room for `n` more rows after the `pending` ones before they are written: grow the store (double it,
        or to what they need; at most `capacity`) where writing them would evict a live row (`oldest_live`: the
        oldest row id a field still points to, None: none) while it is smaller than `capacity`. Rows no field points
        to any more (cleared, overwritten) are overwritten in place: a partition whose samples are cleared after use
        reuses its store's memory. Below `capacity` the ring never evicts a live row, and a row's new seq after a
        growth is its old one shifted. Returns False when the store would have to grow while writes into it are in
        flight (`pending`; it is not copied under a writer): the caller writes the rows into a new group."""
        size = self.store.capacity
        lo, hi = self.store.index.lo, self.store.index.hi
        end = hi + self.pending + n   # the ring's next seq once every planned write is in
        if end - lo <= size or size >= self.capacity:
            return True
        if self.pending + n <= size and (oldest_live is None or oldest_live + self.base >= end - size):
            return True  # the rows the ring overwrites are dead
        if self.pending:
            return False
        old_bytes = self._shm_bytes
        bigger = self._new_store(min(self.capacity, max(2 * size, hi - lo + n)))
        try:
            new_first = int(bigger.extend(self.store.to_table(list(self._schema["fields"])))[0]) if hi > lo else 0
        except BaseException:
            self._release(bigger, self._shm_bytes)
            self._shm_bytes = old_bytes
            raise
        old, self.store = self.store, bigger
        self.base += (new_first - lo) if hi > lo else (int(bigger.index.hi) - hi)
        self._release(old, old_bytes)
        return True

    def batch(self, values: dict[str, FieldValues]) -> pa.RecordBatch:
        """The store's record batch of `values` (each field in this group's form)."""
        arrays: list[pa.Array] = []
        names: list[str] = []
        for f in self.fields:
            kind, mode = self.forms[f]
            v = values[f].as_ragged() if mode == "ragged" else values[f]
            arrays.append(v.to_arrow())
            names.append(self.column[f])
            if kind.kind == "tensor" and mode == "ragged":
                shapes = v.sample_shapes()
                offsets = np.zeros(len(shapes) + 1, dtype=np.int32)
                np.cumsum([len(s) for s in shapes], out=offsets[1:])
                dims = np.asarray([d for s in shapes for d in s], dtype=np.int64)
                arrays.append(pa.ListArray.from_arrays(wire_array(offsets), wire_array(dims)))
                names.append(SHAPE_PREFIX + self.column[f])
        return pa.record_batch(arrays, names=names)

    def write(self, values: dict[str, FieldValues]) -> np.ndarray:
        """Append one row per sample (room made beforehand: `make_room`); returns their row ids."""
        batch = self.batch(values)
        if self._arrow_types is None:
            self._arrow_types = {f: batch.schema.field(self.column[f]).type for f in self.fields}
        return np.asarray(self.store.extend(batch), dtype=np.int64) - self.base

    def takes_as_is(self, schema: pa.Schema) -> bool:
        """Whether a put's record batch of `schema` (a column per field, by name) holds every field of this group in
        the Arrow type `batch` gives it (known once one write went through `write`): `write_batch` takes it without
        converting the values to and from `FieldValues`."""
        types = self._arrow_types
        return types is not None and self._no_companions and set(schema.names) == set(self.fields) and all(
            schema.field(f).type.equals(t) for f, t in types.items())

    def write_batch(self, batch: pa.RecordBatch) -> np.ndarray:
        """`write` of a record batch that `takes_as_is` accepted; returns the row ids."""
        arrays = [batch.column(f) for f in self.fields]
        return np.asarray(self.store.extend(pa.record_batch(arrays, names=[self.column[f] for f in self.fields])),
                          dtype=np.int64) - self.base

    def read(self, fields: list[str], rows: np.ndarray) -> dict[str, FieldValues] | None:
        """The fields of rows `rows` (row ids; None when a row was evicted)."""
        seqs = np.asarray(rows, dtype=np.int64) + self.base
        cols = [self.column[f] for f in fields]
        cols += [SHAPE_PREFIX + self.column[f] for f in fields if self.forms[f][1] == "ragged"
                 and self.forms[f][0].kind == "tensor"]
        try:
            batch = self.store.take(seqs, columns=cols)
        except InvalidArgument:
            return None
        out: dict[str, FieldValues] = {}
        for f in fields:
            kind, mode = self.forms[f]
            shapes = None
            if mode == "ragged" and kind.kind == "tensor":
                dims = FieldValues.from_arrow(FieldKind("tensor", "int64"), batch[SHAPE_PREFIX + self.column[f]],
                                              None)
                assert dims.flat is not None and dims.offsets is not None
                shapes = [tuple(dims.flat[s:e].tolist()) for s, e in
                          zip(dims.offsets[:-1].tolist(), dims.offsets[1:].tolist(), strict=True)]
            col = batch[self.column[f]]
            if isinstance(col, np.ndarray):  # a dense gather: this call's own memory
                out[f] = FieldValues(kind, len(seqs), dense=col)
            else:
                out[f] = FieldValues.from_arrow(kind, col, shapes, writable=True)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "base": self.base,
                "forms": {f: [k.to_json(), m if m == "ragged" else list(m)] for f, (k, m) in self.forms.items()}}

    def close(self) -> None:
        bytes_, self._shm_bytes = self._shm_bytes, 0
        self._release(self.store, bytes_)


@dataclass
class FieldState:
    """What the partition stores for one field: its kind (fixed by its first put), its storage form (a shape, or
    "ragged" once its shape changed), and per global index which group and row hold its value (-1: none)."""

    kind: FieldKind
    mode: tuple[int, ...] | str  # a shape, or "ragged"
    group: np.ndarray = field(default_factory=lambda: np.full(16, -1, dtype=np.int64))
    seq: np.ndarray = field(default_factory=lambda: np.full(16, -1, dtype=np.int64))

    def has(self, gidx: np.ndarray) -> np.ndarray:
        inside = gidx < len(self.group)
        out = np.zeros(len(gidx), dtype=bool)
        out[inside] = self.group[gidx[inside]] >= 0
        return out


class Partition:
    """One partition: its samples (global indexes), keys, custom metadata, field schemas and values, consumption
    per task."""

    def __init__(self, partition_id: str) -> None:
        self.partition_id = partition_id
        self.created_at = time.time()
        self.indexes: set[int] = set()
        self.field_order: dict[str, int] = {}        # TransferQueue's field_name_mapping: registration order
        self.info: dict[str, FieldInfo] = {}
        self.fields: dict[str, FieldState] = {}
        self.consumed: dict[str, np.ndarray] = {}
        self.custom_meta: dict[int, dict[str, Any]] = {}
        self.keys: dict[str, int] = {}
        self.key_of: dict[int, str] = {}
        self.groups: dict[Any, int] = {}
        self.stores: list[FieldGroup] = []

    def produced(self, fields: list[str], gidx: np.ndarray) -> np.ndarray:
        """[len(gidx), len(fields)] int8: 1 where the field has a value for the sample."""
        out = np.zeros((len(gidx), len(fields)), dtype=np.int8)
        for j, f in enumerate(fields):
            st = self.fields.get(f)
            if st is not None:
                out[:, j] = st.has(gidx)
        return out

    def oldest_live_row(self, g: int) -> int | None:
        """The oldest row of field group `g` that a field still points to (None: none)."""
        oldest: int | None = None
        for st in self.fields.values():
            rows = st.seq[st.group == g]
            if len(rows):
                low = int(rows.min())
                oldest = low if oldest is None else min(oldest, low)
        return oldest

    def consumed_of(self, task: str) -> np.ndarray:
        if task not in self.consumed:
            self.consumed[task] = np.zeros(16, dtype=bool)
        return self.consumed[task]

    def is_consumed(self, task: str, gidx: np.ndarray) -> np.ndarray:
        arr = self.consumed_of(task)
        out = np.zeros(len(gidx), dtype=bool)
        inside = gidx < len(arr)
        out[inside] = arr[gidx[inside]]
        return out

    def mark_consumed(self, task: str, gidx: list[int]) -> None:
        if not gidx:
            return
        arr = grow(self.consumed_of(task), max(gidx) + 1, False)
        arr[np.asarray(gidx, dtype=np.int64)] = True
        self.consumed[task] = arr

    def ready(self, fields: list[str], task: str) -> list[int]:
        """Samples with every field produced and not consumed by `task`, ascending."""
        if any(f not in self.fields for f in fields):
            return []
        idx = np.asarray(sorted(self.indexes), dtype=np.int64)
        ok = self.produced(fields, idx).all(axis=1) & ~self.is_consumed(task, idx)
        return idx[ok].tolist()

    def clear(self, gidx: list[int], clear_consumption: bool = True) -> None:
        arr = np.asarray(gidx, dtype=np.int64)
        for st in self.fields.values():
            inside = arr[arr < len(st.group)]
            st.group[inside] = -1
            st.seq[inside] = -1
        if clear_consumption:
            for c in self.consumed.values():
                c[arr[arr < len(c)]] = False
        self.indexes.difference_update(gidx)
        empty = []
        for name, info in self.info.items():
            info.remove(gidx)
            if not info.indexes:
                empty.append(name)
        if not self.indexes:
            self.info.clear()
        else:
            for name in empty:
                self.info.pop(name)
        for g in gidx:
            self.custom_meta.pop(g, None)
            k = self.key_of.pop(g, None)
            if k is not None:
                self.keys.pop(k, None)

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.stores = []


class PartitionView:
    """What a sampler may ask of a partition (TransferQueue passes its partition status as `partition=`)."""

    def __init__(self, partition: Partition) -> None:
        self._p = partition

    def get_custom_meta(self, global_indices: list[int]) -> dict[int, dict[str, Any]]:
        return {i: self._p.custom_meta[i] for i in global_indices if i in self._p.custom_meta}


