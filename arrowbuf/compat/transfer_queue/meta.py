"""TransferQueue 0.1.x's metadata objects: `BatchMeta` (the metadata path) and `KVBatchMeta` (the KV path).

The attributes and methods code reads in practice are mirrored (global_indexes, partition_ids, field_names, size,
is_ready, custom_meta, extra_info, chunk, select_samples, select_fields, update_custom_meta, ...); the storage
backend internals TransferQueue keeps in them (`_custom_backend_meta`) are not.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np


class BatchMeta:
    """The samples of one `get_meta`/`put`: their global indexes, partition, fields and readiness."""

    def __init__(self, global_indexes: list[int], partition_ids: list[str],
                 field_schema: dict[str, dict[str, Any]] | None = None, production_status: Any = None,
                 extra_info: dict[str, Any] | None = None, custom_meta: list[dict[str, Any]] | None = None) -> None:
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(f"Length mismatch: global_indexes has {len(self.global_indexes)}, "
                             f"partition_ids has {len(self.partition_ids)}")
        n = len(self.global_indexes)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        self.production_status = (np.zeros(n, dtype=np.int8) if production_status is None
                                  else np.array(production_status, dtype=np.int8))
        if len(self.production_status) != n:
            raise ValueError(f"production_status length {len(self.production_status)} != batch_size {n}")
        self.extra_info = dict(extra_info or {})
        self.custom_meta = [dict(d) for d in custom_meta] if custom_meta else [{} for _ in range(n)]
        if len(self.custom_meta) != n:
            raise ValueError(f"custom_meta length {len(self.custom_meta)} != batch_size {n}")

    @property
    def size(self) -> int:
        """Samples in this batch."""
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        """The fields of the batch, sorted."""
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        """Every sample has every field produced."""
        return self.size > 0 and bool(np.all(self.production_status == 1))

    @property
    def partition_id(self) -> str:
        """The partition of the batch (a batch from one `get_meta` lies in one partition)."""
        if not self.partition_ids:
            raise ValueError("an empty BatchMeta has no partition")
        return self.partition_ids[0]

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]]) -> None:
        """Merge one dict per sample into the samples' custom metadata (their tags)."""
        if len(custom_meta) != self.size:
            raise ValueError(f"custom_meta length {len(custom_meta)} != batch_size {self.size}")
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new or {})

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        """The samples at positions `sample_indices` of this batch."""
        pick = list(sample_indices)
        return BatchMeta([self.global_indexes[i] for i in pick], [self.partition_ids[i] for i in pick],
                         self.field_schema, self.production_status[pick], self.extra_info,
                         [self.custom_meta[i] for i in pick])

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        return BatchMeta(self.global_indexes, self.partition_ids,
                         {f: self.field_schema[f] for f in field_names if f in self.field_schema},
                         self.production_status, self.extra_info, self.custom_meta)

    def __getitem__(self, item: Any) -> BatchMeta:
        if isinstance(item, int):
            return self.select_samples([item])
        return self.select_samples(list(range(self.size))[item])

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into `chunks` consecutive parts (sizes differ by at most one)."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self.select_samples(list(range(start, end))))
            start = end
        return out

    @classmethod
    def concat(cls, data: list[BatchMeta]) -> BatchMeta:
        if not data:
            return cls.empty()
        schema: dict[str, dict[str, Any]] = {}
        for m in data:
            schema.update(m.field_schema)
        return cls([i for m in data for i in m.global_indexes], [p for m in data for p in m.partition_ids], schema,
                   np.concatenate([m.production_status for m in data]), data[0].extra_info,
                   [c for m in data for c in m.custom_meta])

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls([], [], extra_info=extra_info)

    def __repr__(self) -> str:
        return f"BatchMeta(size={self.size}, field_names={self.field_names}, is_ready={self.is_ready})"


@dataclasses.dataclass
class KVBatchMeta:
    """What a kv put returns: the keys, their tags, the partition and every field stored for them."""

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
        self.tags = copy.deepcopy(self.tags)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)
