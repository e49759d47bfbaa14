"""`TransferQueueClient`: the client behind TransferQueue's module functions (`api`), over a system in this process
(`LocalBackend`, a `TQState`) or a remote one (`remote.RemoteBackend`, `sharded.ShardedBackend`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidArgument, SchemaError
from .columns import FieldKind, batch_items, columns_of, from_column, tensordict_module, to_output, torch_module
from .meta import BatchMeta, KVBatchMeta
from .samplers import BaseSampler, make_sampler
from .state import TQState

DEFAULT_CAPACITY = 65_536


def conf_get(conf: Any, *path: str, default: Any = None) -> Any:
    """`conf[path[0]][path[1]]...` of a dict, OmegaConf or object (`default` where a step is missing)."""
    node = conf
    for p in path:
        if node is None:
            return default
        try:
            node = node[p] if p in node else None
        except TypeError:
            node = getattr(node, p, None)
    return default if node is None else node


class TransferQueueClient:
    """The client behind the module functions: local (`TQState` in this process) or remote (Flight)."""

    def __init__(self, backend: Any, conf: Any = None, owned: TQState | None = None) -> None:
        self.backend = backend
        self.conf = conf
        self._owned = owned
        self._samplers: dict[Any, BaseSampler] = {}

    # ------------------------------------------------------------------ helpers
    def _out(self, cols: dict[str, Any], kinds: dict[str, FieldKind], n: int) -> Any:
        return to_output({f: from_column(kinds[f], cols[f]) for f in cols}, n)

    @staticmethod
    def _batch(fields: Any) -> int:
        items, size = batch_items(fields)
        if size is not None:
            return size
        torch = torch_module()
        sizes = set()
        for name, v in items:
            if isinstance(v, torch.Tensor):
                sizes.add(int(v.size(0)) if v.dim() else 0)
            elif isinstance(v, (list, tuple, np.ndarray)):
                sizes.add(len(v))
            else:
                raise SchemaError(f"field {name!r}: expected a tensor, array or list per field, got "
                                  f"{type(v).__name__}")
        if len(sizes) > 1:
            raise SchemaError(f"fields disagree on the batch size: {sorted(sizes)}; nothing was written")
        return sizes.pop() if sizes else 0

    # ------------------------------------------------------------------ metadata path
    def get_meta(self, data_fields: list[str], batch_size: int, partition_id: str, mode: str = "fetch",
                 task_name: str | None = None, sampling_config: dict[str, Any] | None = None,
                 sampler: Any = None) -> BatchMeta:
        """Samples of `partition_id` whose `data_fields` are all produced and that `task_name` has not consumed,
        picked by the sampler (the system's, or `sampler`) and marked consumed for that task. May be empty
        (`size == 0`) when not enough are ready. `mode="force_fetch"` returns samples regardless of readiness and
        consumption and marks nothing."""
        fields = [data_fields] if isinstance(data_fields, str) else list(data_fields)
        s = None
        if sampler is not None:  # one instance per name, so that samplers that cache picks (per rank) keep them
            key = sampler if isinstance(sampler, str) else id(sampler)
            s = self._samplers.get(key) if isinstance(sampler, str) else None
            if s is None:
                s = make_sampler(sampler)
                if isinstance(sampler, str):
                    self._samplers[key] = s
        gidx = self.backend.get_meta(partition_id, fields, batch_size, mode, task_name, s, dict(sampling_config or {}))
        return self._meta(partition_id, gidx, fields)

    def _meta(self, partition_id: str, gidx: np.ndarray, fields: list[str]) -> BatchMeta:
        if len(gidx) == 0:
            return BatchMeta.empty()
        _, status = self.backend.production_status(partition_id, fields)
        idx, _ = self.backend.production_status(partition_id, [])
        pos = np.searchsorted(idx, gidx)
        ready = status[np.clip(pos, 0, max(len(status) - 1, 0))] if len(status) else np.zeros(len(gidx))
        tags = self.backend.tags_of(partition_id, gidx)
        return BatchMeta(gidx.tolist(), [partition_id] * len(gidx), {f: {} for f in fields}, ready,
                         custom_meta=tags)

    def put(self, data: Any, metadata: BatchMeta | None = None, partition_id: str | None = None,
            data_parser: Callable[[Any], Any] | None = None) -> BatchMeta:
        """Write `data` (batch == metadata.size) into the samples of `metadata`, or insert new samples into
        `partition_id` when no metadata is given. Returns the metadata with the written fields added."""
        if data_parser is not None:
            raise InvalidArgument("data_parser is not supported by arrowbuf.compat; parse before put")
        n = self._batch(data)
        kinds, cols = columns_of(data, n)
        if metadata is None:
            if partition_id is None:
                raise ValueError("partition_id must be provided if metadata is not given")
            gidx = self.backend.put_indexes(partition_id, None, n, kinds, cols, None)
            return self._meta(partition_id, np.asarray(gidx, dtype=np.int64), sorted(kinds))
        if metadata.size == 0:
            raise ValueError("metadata cannot be none or empty")
        if n != metadata.size:
            raise SchemaError(f"data has batch size {n} but metadata holds {metadata.size} samples; nothing was "
                              "written")
        pid = metadata.partition_id
        gidx = np.asarray(metadata.global_indexes, dtype=np.int64)
        self.backend.put_indexes(pid, gidx, n, kinds, cols, metadata.custom_meta)
        out = metadata.select_fields(metadata.field_names)
        for f in kinds:
            out.field_schema.setdefault(f, {})
        _, status = self.backend.production_status(pid, out.field_names)
        idx, _ = self.backend.production_status(pid, [])
        out.production_status = status[np.searchsorted(idx, gidx)]
        return out

    def get_data(self, metadata: BatchMeta) -> Any:
        """The fields of `metadata`'s samples, in its order (an empty TensorDict for an empty metadata)."""
        if metadata.size == 0 or not metadata.field_names:
            return to_output({}, 0)
        gidx = np.asarray(metadata.global_indexes, dtype=np.int64)
        cols, kinds = self.backend.read(metadata.partition_id, gidx, metadata.field_names)
        return self._out(cols, kinds, metadata.size)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store `metadata.custom_meta` as the samples' tags."""
        if metadata.size:
            self.backend.put_indexes(metadata.partition_id, np.asarray(metadata.global_indexes, dtype=np.int64),
                                     metadata.size, {}, {}, metadata.custom_meta)

    def get_production_status(self, data_fields: list[str], partition_id: str) -> tuple[Any, Any]:
        """(global indexes, 1 where every field is produced else 0) over the partition's samples, as tensors."""
        torch = torch_module()
        idx, st = self.backend.production_status(partition_id, list(data_fields))
        return torch.from_numpy(idx), torch.from_numpy(st)

    def get_consumption_status(self, task_name: str, partition_id: str) -> tuple[Any, Any]:
        """(global indexes, 1 where `task_name` consumed the sample else 0), as tensors."""
        torch = torch_module()
        idx, st = self.backend.consumption_status(partition_id, task_name)
        return torch.from_numpy(idx), torch.from_numpy(st)

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        _, st = self.backend.production_status(partition_id, list(data_fields))
        return bool(len(st)) and bool(np.all(st == 1))

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        try:
            _, st = self.backend.consumption_status(partition_id, task_name)
        except KeyError:
            return False
        return bool(len(st)) and bool(np.all(st == 1))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Let `task_name` (every task when None) consume the partition's samples again."""
        return bool(self.backend.reset_consumption(partition_id, task_name))

    def clear_partition(self, partition_id: str) -> None:
        """Drop a partition: its samples, keys, tags, statuses and stores."""
        self.backend.clear_partition(partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        if metadata.size:
            self.backend.clear_samples(metadata.partition_id, np.asarray(metadata.global_indexes, dtype=np.int64))

    def get_partition_list(self) -> list[str]:
        return sorted(self.backend.kv_list(None))

    # ------------------------------------------------------------------ KV path
    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                     tags: list[dict[str, Any]] | None = None) -> KVBatchMeta:
        if fields is None and tags is None:
            raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
        keys = [keys] if isinstance(keys, str) else list(keys)
        kinds: dict[str, FieldKind] = {}
        cols: dict[str, Any] = {}
        if fields is not None:
            n = self._batch(fields)
            if n != len(keys):
                raise ValueError(f"`keys` with length {len(keys)} does not match the `fields` TensorDict with "
                                 f"batch_size {n}")
            kinds, cols = columns_of(fields, n)
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"keys with length {len(keys)} does not match length of tags {len(tags)}")
        gidx, stored = self.backend.put_keys(partition_id, keys, kinds, cols, tags)
        return KVBatchMeta(keys=keys, tags=self.backend.tags_of(partition_id, np.asarray(gidx)),
                           partition_id=partition_id, fields=list(stored))

    def kv_put(self, key: str, partition_id: str, fields: Any = None,
               tag: dict[str, Any] | None = None) -> KVBatchMeta:
        if fields is None and tag is None:
            raise ValueError("Please provide at least one parameter of `fields` or `tag`.")
        batched = None
        if fields is not None:
            batched = self._unsqueeze(fields)
        return self.kv_batch_put([key], partition_id, batched, None if tag is None else [tag])

    @staticmethod
    def _unsqueeze(fields: Any) -> Any:
        td = tensordict_module()
        torch = torch_module()
        if td is not None and isinstance(fields, td.TensorDictBase):
            if len(fields.batch_size) and fields.batch_size[0] == 1:
                return fields
            if len(fields.batch_size):
                raise SchemaError(f"kv_put takes one sample; got a TensorDict of batch_size {fields.batch_size}")
            return fields.unsqueeze(0)
        items, _ = batch_items(fields)
        out: dict[str, Any] = {}
        for name, v in items:
            if isinstance(v, torch.Tensor):
                if v.is_nested:
                    raise ValueError(f"field {name!r}: nested tensors go through kv_batch_put")
                out[name] = v.unsqueeze(0)
            elif isinstance(v, str):
                out[name] = [v]
            elif isinstance(v, (int, float, bool, np.number, np.bool_)):
                out[name] = np.asarray([v])
            else:
                out[name] = np.asarray(v)[None]
        return out

    def kv_batch_get(self, keys: list[str] | str, partition_id: str,
                     select_fields: list[str] | str | None = None) -> Any:
        keys = [keys] if isinstance(keys, str) else list(keys)
        fields = [select_fields] if isinstance(select_fields, str) else select_fields
        gidx = self.backend.key_indexes(partition_id, keys)
        cols, kinds = self.backend.read(partition_id, gidx, fields)
        return self._out(cols, kinds, len(keys))

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return dict(self.backend.kv_list(partition_id))

    def kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        self.backend.clear_keys(partition_id, [keys] if isinstance(keys, str) else list(keys))

    def kv_retrieve_meta(self, keys: list[str], partition_id: str, create: bool = False) -> BatchMeta:
        """The BatchMeta of `keys` (new keys are created as empty samples when `create`), with every field each
        of them has."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        if create:
            gidx, _ = self.backend.put_keys(partition_id, keys, {}, {}, None)
        else:
            gidx = self.backend.key_indexes(partition_id, keys)
        gidx = np.asarray(gidx, dtype=np.int64)
        fields = [f for f in self._fields(partition_id) if self._has(partition_id, f, gidx)]
        return self._meta(partition_id, gidx, fields)

    def _fields(self, partition_id: str) -> list[str]:
        return list(self.backend.field_names(partition_id))

    def _has(self, partition_id: str, field: str, gidx: np.ndarray) -> bool:
        idx, st = self.backend.production_status(partition_id, [field])
        pos = np.searchsorted(idx, gidx)
        return bool(len(gidx)) and bool(np.all(st[pos] == 1))

    def kv_retrieve_keys(self, global_indexes: list[int], partition_id: str) -> list[str | None]:
        """The user keys of samples (None for samples inserted without one)."""
        return list(self.backend.keys_of(partition_id, np.asarray(global_indexes, dtype=np.int64)))

    # the async twins of the client's methods, as TransferQueue's client has them (run in a worker thread)
    async def async_get_meta(self, data_fields: list[str], batch_size: int, partition_id: str, mode: str = "fetch",
                             task_name: str | None = None, sampling_config: dict[str, Any] | None = None,
                             sampler: Any = None) -> BatchMeta:
        return await asyncio.to_thread(self.get_meta, data_fields, batch_size, partition_id, mode, task_name,
                                       sampling_config, sampler)

    async def async_put(self, data: Any, metadata: BatchMeta | None = None, partition_id: str | None = None,
                        data_parser: Callable[[Any], Any] | None = None) -> BatchMeta:
        return await asyncio.to_thread(self.put, data, metadata, partition_id, data_parser)

    async def async_get_data(self, metadata: BatchMeta) -> Any:
        return await asyncio.to_thread(self.get_data, metadata)

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        await asyncio.to_thread(self.set_custom_meta, metadata)

    async def async_kv_retrieve_meta(self, keys: list[str], partition_id: str, create: bool = False) -> BatchMeta:
        return await asyncio.to_thread(self.kv_retrieve_meta, keys, partition_id, create)

    async def async_kv_retrieve_keys(self, global_indexes: list[int], partition_id: str) -> list[str | None]:
        return await asyncio.to_thread(self.kv_retrieve_keys, global_indexes, partition_id)

    async def async_clear_partition(self, partition_id: str) -> None:
        await asyncio.to_thread(self.clear_partition, partition_id)

    async def async_reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return await asyncio.to_thread(self.reset_consumption, partition_id, task_name)

    def close(self) -> None:
        close = getattr(self.backend, "close_client", None)
        if close is not None:
            close()
        if self._owned is not None:
            self._owned.close()
            self._owned = None


class LocalBackend:
    """A `TQState` in this process, with the calls the client makes."""

    def __init__(self, state: TQState) -> None:
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.state, name)

    def put_indexes(self, *args: Any) -> np.ndarray:
        return self.state.put_indexes(*args)

    def field_names(self, partition_id: str) -> list[str]:
        with self.state.lock:
            return sorted(self.state.partition(partition_id).group_of)

    def key_indexes(self, partition_id: str, keys: list[str]) -> np.ndarray:
        with self.state.lock:
            p = self.state.partition(partition_id)
            gidx, _ = p.plan_keys(keys, create=False)
            return gidx

