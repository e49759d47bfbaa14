"""TransferQueue 0.1.11's metadata objects: `BatchMeta` (the metadata path) and `KVBatchMeta` (the KV path).

Both mirror TransferQueue's semantics method by method (its public tests check them): a `BatchMeta` is columnar,
one list entry per sample (global index, partition, custom metadata, production status) and one `field_schema`
entry per field (`dtype`, `shape`, `is_nested`, `is_non_tensor`, and `per_sample_shapes` for nested fields);
`chunk`, `select_samples`, `select_fields`, `union`, `concat`, `reorder` and `copy` build new objects (deep copies
of the per-sample dicts), `add_fields`, `reorder` and the `*_custom_meta`/`*_extra_info` setters change the object
in place. `_custom_backend_meta` is carried as TransferQueue carries it (one dict per sample, opaque here: arrowbuf's
storage keeps no per-sample backend metadata).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # pragma: no cover
    from tensordict import TensorDict

logger = logging.getLogger(__name__)


def _equal(a: Any, b: Any) -> bool:
    """Equality of two extra_info values (tensors and arrays by content, never an ambiguous truth value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if type(a).__module__.startswith("torch") and hasattr(a, "is_nested"):
        import torch

        return bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


def merge_extra_info(infos: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """The union of batch-level infos; a key with different values in two of them is a ValueError."""
    if any(set(i) != set(infos[0]) for i in infos[1:]):
        logger.warning("%s.concat: extra_info key sets differ across chunks, performing union of keys.", what)
    out: dict[str, Any] = {}
    for i, info in enumerate(infos):
        for k, v in info.items():
            if k in out and not _equal(out[k], v):
                raise ValueError(f"{what}.concat: extra_info key '{k}' has conflicting values across chunks and "
                                 f"cannot be merged. chunk[0]={out[k]!r}, chunk[{i}]={v!r}")
            out.setdefault(k, v)
    return out


def extract_field_schema(data: TensorDict) -> dict[str, dict[str, Any]]:
    """The `field_schema` of a TensorDict's fields, as TransferQueue records it on put: a tensor's per-sample dtype
    and shape (a `[B]` tensor counts as `[B, 1]`), nested tensors with their per-sample shapes, anything else
    (`NonTensorStack`, lists) as non-tensor with dtype and shape None."""
    import torch

    n = int(data.batch_size[0])
    schema: dict[str, dict[str, Any]] = {}
    if n == 0:
        return schema
    for name, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            parts = value.unbind()
            if len(parts) != n:
                raise ValueError(f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={n}, "
                                 f"got nested tensor composed of {len(parts)} tensors")
            schema[name] = {"dtype": parts[0].dtype, "shape": parts[0].shape, "is_nested": True,
                            "is_non_tensor": False, "per_sample_shapes": [tuple(p.shape) for p in parts]}
        elif isinstance(value, torch.Tensor):
            if value.shape[0] != n:
                raise ValueError(f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={n}, "
                                 f"got value.shape[0]={value.shape[0]}")
            first = (value.unsqueeze(-1) if value.dim() == 1 else value)[0]
            schema[name] = {"dtype": first.dtype, "shape": first.shape, "is_nested": False, "is_non_tensor": False}
        else:
            if len(value) != n:
                raise ValueError(f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={n}, "
                                 f"got len(value)={len(value)}")
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


def torch_schema(schema: dict[str, dict[str, Any]], local: bool = False) -> dict[str, dict[str, Any]]:
    """Field-schema entries as the system keeps them (dtype and shapes by name, JSON) -> as BatchMeta holds them:
    torch dtypes; shapes as TransferQueue's BatchMeta has them: lists in one from the system (`get_meta`, as they
    arrive over its wire), `torch.Size` and tuples in one a put filled in this process (`local`)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, entry in schema.items():
        e = dict(entry)
        if e.get("dtype") is not None:
            e["dtype"] = getattr(torch, e["dtype"])
        if e.get("shape") is not None:
            e["shape"] = torch.Size(e["shape"]) if local else list(e["shape"])
        if e.get("per_sample_shapes") is not None:
            e["per_sample_shapes"] = [None if s is None else (tuple(s) if local else list(s))
                                      for s in e["per_sample_shapes"]]
        out[name] = e
    return out


def apply_put(meta: BatchMeta, schema: dict[str, dict[str, Any]]) -> BatchMeta:
    """What a put does to its BatchMeta (TransferQueue's `add_fields` with set_all_ready): the written fields'
    schema (`torch_schema` form) added, every sample produced. In place; returns `meta`."""
    if meta.size == 0:
        return meta
    meta.field_schema.update(schema)
    meta.production_status[:] = 1
    meta._refresh()
    return meta


class SampleView:
    """A read-only view of one sample of a `BatchMeta` (what `BatchMeta.samples[i]` returns)."""

    __slots__ = ("_batch", "_idx")

    def __init__(self, batch: BatchMeta, idx: int) -> None:
        self._batch = batch
        self._idx = idx

    @property
    def global_index(self) -> int:
        return self._batch.global_indexes[self._idx]

    @property
    def partition_id(self) -> str:
        return self._batch.partition_ids[self._idx]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._idx])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._batch.custom_meta[self._idx])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        """Per-field schema of this sample (a nested field's `shape` is this sample's)."""
        out: dict[str, MappingProxyType[str, Any]] = {}
        for name, meta in self._batch.field_schema.items():
            entry = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            if meta.get("per_sample_shapes") is not None:
                entry["shape"] = meta["per_sample_shapes"][self._idx]
            out[name] = MappingProxyType(entry)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (f"SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
                f"production_status={self.production_status}, fields={list(self._batch.field_schema)})")


class SampleViews:
    """`BatchMeta.samples`: indexable, sized and iterable views of the samples."""

    __slots__ = ("_batch",)

    def __init__(self, batch: BatchMeta) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, idx: int) -> SampleView:
        return SampleView(self._batch, idx)

    def __iter__(self) -> Iterator[SampleView]:
        return (SampleView(self._batch, i) for i in range(len(self)))


class BatchMeta:
    """The samples of one `get_meta`/`put`: global indexes, partitions, field schema, production status, per-sample
    custom metadata and batch-level extra info (see the module docstring)."""

    __slots__ = ("global_indexes", "partition_ids", "field_schema", "production_status", "extra_info",
                 "custom_meta", "_custom_backend_meta", "_size", "_field_names", "_is_ready")

    def __init__(self, global_indexes: list[int], partition_ids: list[str],
                 field_schema: dict[str, dict[str, Any]] | None = None, production_status: npt.ArrayLike | None = None,
                 extra_info: dict[str, Any] | None = None, custom_meta: list[dict[str, Any]] | None = None,
                 _custom_backend_meta: list[dict[str, Any]] | None = None) -> None:
        self.global_indexes = list(global_indexes)
        self.partition_ids = list(partition_ids)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        self.extra_info = dict(extra_info or {})
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(f"Length mismatch: global_indexes has {len(self.global_indexes)}, "
                             f"partition_ids has {len(self.partition_ids)}")
        n = len(self.global_indexes)
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True)
            if len(self.production_status) != n:
                raise ValueError(f"production_status length {len(self.production_status)} != batch_size {n}")
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise ValueError(f"Field '{name}' per_sample_shapes length {len(shapes)} != batch_size {n}")
        self.custom_meta = [dict(d) for d in custom_meta] if custom_meta else [{} for _ in range(n)]
        if len(self.custom_meta) != n:
            raise ValueError(f"custom_meta length {len(self.custom_meta)} != batch_size {n}")
        self._custom_backend_meta = ([dict(d) for d in _custom_backend_meta] if _custom_backend_meta
                                     else [{} for _ in range(n)])
        if len(self._custom_backend_meta) != n:
            raise ValueError(f"_custom_backend_meta length {len(self._custom_backend_meta)} != batch_size {n}")
        self._size = n
        self._refresh()

    def _refresh(self) -> None:
        self._field_names = sorted(self.field_schema)
        self._is_ready = self._size > 0 and bool(np.all(self.production_status == 1))

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for slot, value in zip(self.__slots__, state, strict=False):
            # an array that arrived zero-copy (Ray, Arrow) is read-only: add_fields writes to it
            if slot == "production_status" and isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()
            setattr(self, slot, value)

    # ------------------------------------------------------------------ properties
    @property
    def size(self) -> int:
        """Samples in this batch."""
        return getattr(self, "_size", 0)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        """The fields of the batch, sorted."""
        return getattr(self, "_field_names", [])

    @property
    def is_ready(self) -> bool:
        """Every sample has every field produced (False for an empty batch)."""
        return getattr(self, "_is_ready", False)

    @property
    def samples(self) -> SampleViews:
        """Per-sample read-only views: `samples[i].fields['x']`, `len(samples)`, iteration."""
        return SampleViews(self)

    @property
    def partition_id(self) -> str:
        """The partition of the batch's first sample (a batch from one `get_meta` lies in one partition)."""
        if not self.partition_ids:
            raise ValueError("an empty BatchMeta has no partition")
        return self.partition_ids[0]

    def get_dtypes(self, field_name: str) -> list[Any]:
        """The field's dtype, once per sample (KeyError for an unknown field)."""
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        return [self.field_schema[field_name].get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        """The field's per-sample shapes (KeyError for an unknown field)."""
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        meta = self.field_schema[field_name]
        if meta.get("per_sample_shapes") is not None:
            return list(meta["per_sample_shapes"])
        return [meta.get("shape")] * self.size

    # ------------------------------------------------------------------ extra info (batch level)
    def get_extra_info(self, key: str, default: object = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: object) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        """A deep copy of the batch-level info."""
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        """Remove a key; returns its value (None when absent)."""
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # ------------------------------------------------------------------ custom meta (per sample)
    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of the per-sample custom metadata, in sample order."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        """Merge one dict per sample into the samples' custom metadata (None: nothing)."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(f"The length of custom_meta list {len(custom_meta)} must match the batch size: "
                             f"{self.size}")
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # ------------------------------------------------------------------ batch operations
    def add_fields(self, tensor_dict: TensorDict, set_all_ready: bool = True) -> BatchMeta:
        """Add the fields of a TensorDict (batch == size) to this batch's schema, in place; with `set_all_ready`
        every sample becomes produced. Returns self."""
        n = int(tensor_dict.batch_size[0])
        if n == 0:
            logger.warning("Input TensorDict is empty with batch_size=0. No action is taken.")
            return self
        if n != self.size:
            raise ValueError(f"add_fields batch size mismatch: self.size={self.size} vs tensor_dict={n}")
        self.field_schema.update(extract_field_schema(tensor_dict))
        if set_all_ready:
            self.production_status[:] = 1
        self._refresh()
        return self

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        """A new batch of the samples at these positions (in this order)."""
        pick = list(sample_indices)
        if any(i < 0 or i >= self.size for i in pick):
            raise ValueError(f"Sample indices must be in range [0, {self.size})")
        schema = {}
        for name, meta in self.field_schema.items():
            entry = copy.deepcopy(meta)
            if meta.get("per_sample_shapes") is not None:
                entry["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in pick]
            schema[name] = entry
        return BatchMeta([self.global_indexes[i] for i in pick], [self.partition_ids[i] for i in pick], schema,
                         self.production_status[pick], self.extra_info,
                         [copy.deepcopy(self.custom_meta[i]) for i in pick],
                         [copy.deepcopy(self._custom_backend_meta[i]) for i in pick])

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        """A new batch with only these fields (unknown names are left out)."""
        schema = {f: copy.deepcopy(self.field_schema[f]) for f in field_names if f in self.field_schema}
        backend = [{f: v for f, v in m.items() if f.startswith("_") or f in field_names}
                   for m in self._custom_backend_meta]
        return BatchMeta(self.global_indexes, self.partition_ids, schema, self.production_status.copy(),
                         copy.deepcopy(self.extra_info), copy.deepcopy(self.custom_meta), backend)

    def copy(self) -> BatchMeta:
        """A deep copy."""
        return BatchMeta(list(self.global_indexes), list(self.partition_ids), copy.deepcopy(self.field_schema),
                         self.production_status.copy(), copy.deepcopy(self.extra_info),
                         copy.deepcopy(self.custom_meta), copy.deepcopy(self._custom_backend_meta))

    def __getitem__(self, item: int | np.integer | slice) -> BatchMeta:
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.size if item < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError("BatchMeta index out of range")
            return self.select_samples([i])
        if isinstance(item, slice):
            return self.select_samples(list(range(*item.indices(self.size))))
        raise TypeError(f"Indexing with {type(item)} is not supported.")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """`chunks` consecutive parts; the first `size % chunks` get one sample more (some may be empty)."""
        if self.size < chunks:
            logger.warning("Chunk size %d > number of samples in BatchMeta %d, this will return some empty "
                           "BatchMeta chunks.", chunks, self.size)
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self.select_samples(list(range(start, end))))
            start = end
        return out

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One batch per partition, in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, pid in enumerate(self.partition_ids):
            groups.setdefault(pid, []).append(i)
        return [self.select_samples(idx) for idx in groups.values()]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """The fields of both batches over the same samples (other's win on a name clash); a sample is produced
        when it is in both. An empty side gives a copy of the other."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes:
            raise ValueError(f"BatchMeta.union: global_indexes do not match. self.global_indexes="
                             f"{self.global_indexes}, other.global_indexes={other.global_indexes}")
        if self.partition_ids != other.partition_ids:
            raise ValueError(f"BatchMeta.union: partition_ids do not match. self.partition_ids="
                             f"{self.partition_ids}, other.partition_ids={other.partition_ids}")
        schema = copy.deepcopy(self.field_schema)
        schema.update(copy.deepcopy(other.field_schema))
        custom = [{**copy.deepcopy(a), **copy.deepcopy(b)} for a, b in zip(self.custom_meta, other.custom_meta,
                                                                            strict=True)]
        backend = [{**copy.deepcopy(a), **copy.deepcopy(b)}
                   for a, b in zip(self._custom_backend_meta, other._custom_backend_meta, strict=True)]
        return BatchMeta(list(self.global_indexes), list(self.partition_ids), schema,
                         np.bitwise_and(self.production_status, other.production_status),
                         {**self.extra_info, **other.extra_info}, custom, backend)

    @classmethod
    def concat(cls, data: list[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of the non-empty `data` in order. With `validate`, every part must have the same fields of
        the same dtypes; a field nested in any part is nested in the result (per-sample shapes joined)."""
        parts = [m for m in data if m and m.size > 0]
        if not parts:
            logger.warning("No valid BatchMeta chunks to concatenate. Returning empty BatchMeta.")
            return cls.empty()
        first = parts[0]
        if validate:
            for i, m in enumerate(parts):
                if m.field_names != first.field_names:
                    raise ValueError(f"BatchMeta.concat: field_names mismatch at chunk[{i}]. Expected "
                                     f"{first.field_names}, got {m.field_names}. Extra in chunk: "
                                     f"{set(m.field_names) - set(first.field_names)}, Missing from chunk: "
                                     f"{set(first.field_names) - set(m.field_names)}")
            for name in first.field_names:
                want = first.field_schema.get(name, {}).get("dtype")
                for i, m in enumerate(parts[1:], start=1):
                    got = m.field_schema.get(name, {}).get("dtype")
                    if got != want:
                        raise ValueError(f"Field '{name}' dtype mismatch in concat: chunk[0]={want}, "
                                         f"chunk[{i}]={got}")
        schema: dict[str, dict[str, Any]] = {}
        for name, meta in first.field_schema.items():
            metas = [m.field_schema.get(name, {}) for m in parts]
            nested = any(x.get("is_nested", False) for x in metas)
            entry = {"dtype": meta.get("dtype"), "shape": None if nested else meta.get("shape"), "is_nested": nested,
                     "is_non_tensor": meta.get("is_non_tensor", False)}
            if nested or any(x.get("per_sample_shapes") for x in metas):
                shapes: list[Any] = []
                for m, x in zip(parts, metas, strict=True):
                    shapes.extend(x.get("per_sample_shapes") or [x.get("shape")] * m.size)
                entry["per_sample_shapes"] = shapes
            schema[name] = entry
        return cls([g for m in parts for g in m.global_indexes], [p for m in parts for p in m.partition_ids],
                   schema, np.concatenate([m.production_status for m in parts]),
                   merge_extra_info([m.extra_info for m in parts], "BatchMeta"),
                   [c for m in parts for c in m.custom_meta], [c for m in parts for c in m._custom_backend_meta])

    def reorder(self, indices: list[int]) -> None:
        """Put the samples in the order `indices` (a permutation of the positions), in place."""
        if len(indices) != self.size:
            raise ValueError(f"Indices length {len(indices)} mismatch batch size {self.size}")
        if len(set(indices)) != self.size:
            raise ValueError("Indices contain duplicates")
        if any(i < 0 or i >= self.size for i in indices):
            raise ValueError(f"Reorder indices must be in range [0, {self.size})")
        self.global_indexes = [self.global_indexes[i] for i in indices]
        self.partition_ids = [self.partition_ids[i] for i in indices]
        self.production_status = self.production_status[list(indices)]
        for meta in self.field_schema.values():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in indices]
        self.custom_meta = [self.custom_meta[i] for i in indices]
        self._custom_backend_meta = [self._custom_backend_meta[i] for i in indices]

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        """A batch of no samples."""
        return cls([], [], extra_info=extra_info)

    def __str__(self) -> str:
        return (f"BatchMeta(size={self.size}, field_names={self.field_names}, is_ready={self.is_ready}, "
                f"global_indexes={self.global_indexes}, extra_info={self.extra_info})")

    __repr__ = __str__


@dataclasses.dataclass
class KVBatchMeta:
    """What a KV put returns: the keys, their tags, the partition and every field stored for them."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have same length, but got {len(self.keys)} and {len(self.tags)}")
        if len(self.keys) != len(set(self.keys)):
            raise ValueError("Got duplicated keys.")
        if self.fields is not None and len(self.fields) != len(set(self.fields)):
            raise ValueError("Got duplicated fields.")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, extra_info={self.extra_info})"

    def select_keys(self, keys_to_select: list[str]) -> KVBatchMeta:
        """A new batch of these keys, in this order (RuntimeError for a key not in this batch)."""
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError("Contain duplicate keys.")
        missing = set(keys_to_select) - set(self.keys)
        if missing:
            raise RuntimeError(f"Keys {missing} not found in current batch.")
        pos = {k: i for i, k in enumerate(self.keys)}
        return KVBatchMeta(list(keys_to_select), [self.tags[pos[k]] for k in keys_to_select], self.partition_id,
                           self.fields, self.extra_info)

    def reorder(self, indexes: list[int]) -> None:
        """Put the keys in the order `indexes`, in place."""
        if len(indexes) != self.size:
            raise ValueError(f"Attempted to reorder with indexes length {len(indexes)} that does not match the "
                             f"batch size {self.size}.")
        if len(set(indexes)) != len(indexes):
            raise ValueError("Contain duplicate indexes.")
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """`chunks` consecutive parts; the first `size % chunks` get one key more (some may be empty)."""
        if self.size < chunks:
            logger.warning("Chunk size %d > number of samples in this batch %d, this will return some empty "
                           "KVBatchMeta chunks.", chunks, self.size)
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(KVBatchMeta(self.keys[start:end], self.tags[start:end], self.partition_id, self.fields,
                                   self.extra_info))
            start = end
        return out

    @classmethod
    def concat(cls, data: list[KVBatchMeta]) -> KVBatchMeta:
        """One batch of the non-empty `data` (same partition and fields required)."""
        parts = [m for m in data if m and m.size > 0]
        if not parts:
            logger.warning("No valid KVBatchMeta chunks to concatenate. Returning empty KVBatchMeta.")
            return cls()
        first = parts[0]
        fields = set(first.fields or ())
        for m in parts:
            if m.fields is not None and set(m.fields) != fields:
                raise ValueError("Field names do not match for concatenation.")
            if m.partition_id != first.partition_id:
                raise ValueError("Partition do not match for concatenation.")
        infos = [m.extra_info or {} for m in parts]
        extra = merge_extra_info(infos, "KVBatchMeta") if any(infos) else {}
        return cls([k for m in parts for k in m.keys], [t for m in parts for t in m.tags], first.partition_id,
                   first.fields, extra or None)


class PartitionSnapshot:
    """A copy of one partition's bookkeeping, as TransferQueue's controller hands it out (`get_partition_snapshot`
    of the system's Ray actor, `TransferQueueClient.get_partition_snapshot`): `keys_mapping` (key -> global index),
    `global_indexes` (a set), `custom_meta` (global index -> dict), `field_name_mapping` (field -> column, in
    registration order), `production_status` (int8 tensor [global index, column]: 1 where the field has a value),
    `consumption_status` (task -> int8 tensor over global indexes) and `field_schema` (field -> schema)."""

    def __init__(self, record: dict[str, Any]) -> None:
        import torch

        self.partition_id: str = record["partition_id"]
        self.created_at: float = record["created_at"]
        self.global_indexes: set[int] = set(record["global_indexes"])
        self.keys_mapping: dict[str, int] = dict(record["keys_mapping"])
        self.revert_keys_mapping: dict[int, str] = {g: k for k, g in self.keys_mapping.items()}
        self.custom_meta: dict[int, dict[str, Any]] = {int(g): m for g, m in record["custom_meta"].items()}
        self.field_name_mapping: dict[str, int] = dict(record["field_name_mapping"])
        rows = record["production_status"]
        self.production_status = (torch.tensor(rows, dtype=torch.int8) if rows and rows[0]
                                  else torch.zeros((len(rows), len(self.field_name_mapping)), dtype=torch.int8))
        size = len(rows)
        self.consumption_status = {}
        for task, done in record["consumption_status"].items():
            status = torch.zeros(max([size, *(g + 1 for g in done)]), dtype=torch.int8)
            status[list(done)] = 1
            self.consumption_status[task] = status
        self.field_schema: dict[str, dict[str, Any]] = dict(record["field_schema"])

    @property
    def total_samples_num(self) -> int:
        return len(self.global_indexes)

    @property
    def total_fields_num(self) -> int:
        return len(self.field_name_mapping)

    def __repr__(self) -> str:
        return (f"PartitionSnapshot({self.partition_id!r}, samples={self.total_samples_num}, "
                f"fields={list(self.field_name_mapping)})")
