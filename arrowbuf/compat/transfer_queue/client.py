"""`TransferQueueClient`: TransferQueue 0.1.11's client (the metadata path, the KV lookups, statuses, clears,
checkpoints; every method also as an `async_` twin), over a system in this process (a `state.TQState`) or a remote
one (`remote.RemoteBackend` over Flight, `sharded.ShardedBackend` over several).

Errors as TransferQueue's client raises them: a call the system refuses (a bad mode, a sampler's ValueError, a
`fetch` without polling_mode that times out) is a `ControllerError` (a RuntimeError, as TransferQueue's client wraps
every controller-side failure), the cause chained; a read of a value that is not there is a
`StorageKeyNotFoundError` (a KeyError); bad input the client checks itself is a ValueError or TypeError.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import numpy as np

from ...errors import ArrowbufError, InvalidArgument, SchemaError
from .columns import (
    Batch,
    FieldValues,
    PutFields,
    batch_items,
    batch_size_of,
    put_fields,
    schema_entry,
    to_output,
    to_torch_field,
    torch_module,
)
from .meta import BatchMeta, KVBatchMeta, PartitionSnapshot, apply_put, torch_schema
from .partition import Status
from .samplers import SamplerArg, sampler_spec
from .state import GetMetaTimeout, StorageKeyNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from tensordict import TensorDict

_P = ParamSpec("_P")
_T = TypeVar("_T")

DEFAULT_CAPACITY = 65_536


class ControllerError(ArrowbufError, RuntimeError):
    """The system refused a metadata call (TransferQueue's client raises RuntimeError for every failure on its
    controller); the original error is the cause."""


class Backend(Protocol):
    """The calls a `TransferQueueClient` makes on its system (`state.TQState` has them all; `remote.RemoteBackend`
    and `sharded.ShardedBackend` carry them elsewhere). Metadata travels as JSON-able records, values as
    `FieldValues`; `in_process` says whether arguments reach the system as they are (any sampler object) or as
    JSON (samplers as `samplers.sampler_spec`)."""

    in_process: bool

    def get_meta(self, partition_id: str, data_fields: list[str], batch_size: int | None, mode: str = "fetch",
                 task_name: str | None = None, sampler: SamplerArg = None,
                 sampling_config: dict[str, Any] | None = None) -> dict[str, Any]: ...
    def kv_retrieve_meta(self, partition_id: str, keys: list[str], create: bool = False) -> dict[str, Any]: ...
    def kv_put(self, partition_id: str, keys: list[str], values: dict[str, FieldValues],
               nested: list[str], tags: list[dict[str, Any] | None] | None) -> dict[str, Any]: ...
    def kv_retrieve_keys(self, partition_id: str, gidx: list[int]) -> list[str | None]: ...
    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]: ...
    def set_custom_meta(self, custom_meta: dict[str, dict[int, dict[str, Any]]]) -> None: ...
    def put(self, partition_id: str, gidx: list[int], values: dict[str, FieldValues],
            nested: list[str]) -> None: ...
    def read(self, partition_id: str, gidx: list[int], fields: list[str]) -> dict[str, FieldValues]: ...
    def production_status(self, partition_id: str, data_fields: list[str]) -> Status: ...
    def consumption_status(self, partition_id: str, task_name: str) -> Status: ...
    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool: ...
    def clear_samples(self, partition_ids: list[str], gidx: list[int]) -> None: ...
    def clear_partition(self, partition_id: str) -> None: ...
    def list_partitions(self) -> list[str]: ...
    def snapshot(self, partition_id: str) -> dict[str, Any] | None: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


class ConfNode(Protocol):
    """A node of TransferQueue's configuration: a dict or an OmegaConf DictConfig (an object's attributes are read
    too)."""

    def __contains__(self, key: object, /) -> bool: ...
    def __getitem__(self, key: str, /) -> Any: ...


def conf_get(conf: ConfNode | None, *path: str, default: object = None) -> Any:
    """`conf[path[0]][path[1]]...` of a dict, OmegaConf or object (`default` where a step is missing)."""
    node: ConfNode | None = conf
    for p in path:
        if node is None:
            return default
        try:
            node = node[p] if p in node else None
        except TypeError:
            node = getattr(node, p, None)
    return default if node is None else node


def to_batch_meta(record: dict[str, Any]) -> BatchMeta:
    """A meta record of the system as a BatchMeta."""
    gidx = record["global_indexes"]
    if not gidx:
        return BatchMeta.empty()
    return BatchMeta(gidx, [record["partition_id"]] * len(gidx), torch_schema(record["field_schema"]),
                     np.asarray(record["production_status"], dtype=np.int8), custom_meta=record["custom_meta"])


def _controller(call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    try:
        return call(*args, **kwargs)
    except (ControllerError, GetMetaTimeout, StorageKeyNotFoundError):
        raise
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise ControllerError(f"the TransferQueue system refused the call: {e}") from e


class TransferQueueClient:
    """TransferQueue's client over a `Backend` (see the module docstring). `output` is how tensor fields come back
    ("jagged", TransferQueue's; "dense": fields of one shape as `[B, *S]`)."""

    def __init__(self, backend: Backend, conf: ConfNode | None = None, owned: Any = None,
                 output: str = "jagged") -> None:
        if output not in ("jagged", "dense"):
            raise InvalidArgument(f"output must be 'jagged' or 'dense', got {output!r}")
        self.backend = backend
        self.conf = conf
        self.output = output
        self._owned = owned

    # ------------------------------------------------------------------ metadata path
    def get_meta(self, data_fields: list[str], batch_size: int, partition_id: str, mode: str = "fetch",
                 task_name: str | None = None, sampling_config: dict[str, Any] | None = None,
                 sampler: SamplerArg = None) -> BatchMeta:
        """Samples of `partition_id` (TransferQueue's modes): `fetch` picks `batch_size` ready samples that
        `task_name` has not consumed, through the system's sampler (or `sampler`, an arrowbuf extension), and marks
        them consumed (an empty BatchMeta in polling_mode when not enough are ready); `force_fetch` returns every
        sample of the partition; `insert` allocates `batch_size` new ones."""
        fields = [data_fields] if isinstance(data_fields, str) else list(data_fields or [])
        if sampler is not None and not self.backend.in_process:
            sampler = sampler_spec(sampler)  # ValueError here, before the call, for a sampler that cannot travel
        return to_batch_meta(_controller(self.backend.get_meta, partition_id, fields, batch_size, mode, task_name,
                                         sampler, dict(sampling_config or {})))

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store the custom metadata of `metadata`'s samples (replacing theirs)."""
        if metadata.size == 0:
            return
        per: dict[str, dict[int, dict[str, Any]]] = {}
        for g, pid, m in zip(metadata.global_indexes, metadata.partition_ids, metadata.get_all_custom_meta(),
                             strict=True):
            per.setdefault(pid, {})[int(g)] = m
        _controller(self.backend.set_custom_meta, per)

    def put(self, data: PutFields, metadata: BatchMeta | None = None, partition_id: str | None = None,
            data_parser: Callable[[Any], Any] | None = None) -> BatchMeta:
        """Write `data` into the samples of `metadata` (batch == metadata.size), or into new samples of
        `partition_id` (allocated as get_meta(mode="insert") does). The written fields are added to `metadata`
        (in place, every sample produced) and it is returned; its custom metadata is stored with the samples."""
        if data_parser is not None:
            data = _parsed(data, data_parser)
        n = batch_size_of(data)
        if metadata is None:
            if partition_id is None:
                raise ValueError("partition_id must be provided if metadata is not given")
            names = [name for name, _, _ in batch_items(data, samples=False)[0]]
            metadata = self.get_meta(names, n, partition_id, mode="insert")
        if not metadata or metadata.size == 0:
            raise ValueError("metadata cannot be none or empty")
        values, nested = put_fields(data, metadata.size)
        parts = metadata.chunk_by_partition() if len(set(metadata.partition_ids)) > 1 else [metadata]
        if len(parts) > 1:
            raise SchemaError(f"put: the BatchMeta spans partitions {sorted(set(metadata.partition_ids))}; put "
                              "each partition's samples separately; nothing was written")
        self.backend.put(metadata.partition_ids[0], list(metadata.global_indexes), values, nested)
        self.set_custom_meta(metadata)
        schema = {f: schema_entry(v, f in nested) for f, v in values.items()}
        return apply_put(metadata, torch_schema(schema, local=True))

    def get_data(self, metadata: BatchMeta) -> Batch:
        """The fields of `metadata`'s samples, in its order (an empty TensorDict for an empty metadata).

        Raises:
            StorageKeyNotFoundError: a sample without a value for one of the fields.
        """
        if not metadata or metadata.size == 0 or not metadata.field_names:
            return to_output({}, 0)
        fields = metadata.field_names
        if len(set(metadata.partition_ids)) == 1:
            values = self.backend.read(metadata.partition_ids[0], list(metadata.global_indexes), fields)
        else:
            pieces: dict[str, list[tuple[np.ndarray, FieldValues]]] = {f: [] for f in fields}
            for pid in dict.fromkeys(metadata.partition_ids):
                pos = np.asarray([i for i, p in enumerate(metadata.partition_ids) if p == pid], dtype=np.int64)
                got = self.backend.read(pid, [metadata.global_indexes[i] for i in pos], fields)
                for f in fields:
                    pieces[f].append((pos, got[f]))
            values = {f: FieldValues.join(p, metadata.size) for f, p in pieces.items()}
        return to_output({f: to_torch_field(values[f], self.output) for f in fields}, metadata.size)

    def clear_partition(self, partition_id: str) -> None:
        """Drop a partition: its samples, keys, statuses and values (an unknown one: nothing)."""
        _controller(self.backend.clear_partition, partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        """Drop `metadata`'s samples (their global indexes are reused later)."""
        if metadata.size == 0:
            return
        _controller(self.backend.clear_samples, list(metadata.partition_ids), list(metadata.global_indexes))

    def get_consumption_status(self, task_name: str, partition_id: str) -> tuple[Any, Any]:
        """(global indexes, int8 1 where `task_name` consumed the sample) of the partition; (None, None) for an
        unknown partition."""
        got = _controller(self.backend.consumption_status, partition_id, task_name)
        if got is None:
            return None, None
        torch = torch_module()
        return torch.tensor(got[0], dtype=torch.long), torch.tensor(got[1], dtype=torch.int8)

    def get_production_status(self, data_fields: list[str], partition_id: str) -> tuple[Any, Any]:
        """(global indexes, int8 [samples, fields] 1 where produced; the fields in the order they were first put,
        as TransferQueue's) of the partition; (None, None) for an unknown partition or field."""
        got = _controller(self.backend.production_status, partition_id, list(data_fields))
        if got is None:
            return None, None
        torch = torch_module()
        status = torch.tensor(got[1], dtype=torch.int8).reshape(len(got[0]), len(set(data_fields)))
        return torch.tensor(got[0], dtype=torch.long), status

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """Whether `task_name` consumed every sample of the partition (False for an empty or unknown one)."""
        _, status = self.get_consumption_status(task_name, partition_id)
        return status is not None and status.numel() > 0 and bool(status.eq(1).all())

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        """Whether every sample of the partition has every field (False for an unknown partition or field)."""
        _, status = self.get_production_status(data_fields, partition_id)
        return status is not None and bool(status.eq(1).all())

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Let `task_name` (every task when None) consume the partition's samples again."""
        return bool(_controller(self.backend.reset_consumption, partition_id, task_name))

    def get_partition_list(self) -> list[str]:
        return list(_controller(self.backend.list_partitions))

    def get_partition_snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        """A copy of a partition's bookkeeping (None for an unknown partition)."""
        record = _controller(self.backend.snapshot, partition_id)
        return None if record is None else PartitionSnapshot(record)

    # ------------------------------------------------------------------ KV path
    def kv_batch_put(self, keys: list[str], partition_id: str, fields: PutFields | None = None,
                     tags: list[dict[str, Any] | None] | None = None,
                     data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
        """TransferQueue's `kv_batch_put` in one atomic call to the system (it makes three: create the keys, put,
        store the tags): refused input changes nothing, not even the keys."""
        if fields is None and tags is None:
            raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
        keys = [keys] if isinstance(keys, str) else list(keys)
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"keys with length {len(keys)} does not match length of tags {len(tags)}")
        values: dict[str, FieldValues] = {}
        nested: list[str] = []
        if fields is not None:
            if data_parser is not None:
                fields = _parsed(fields, data_parser)
            n = batch_size_of(fields)
            if n != len(keys):
                raise ValueError(f"`keys` with length {len(keys)} does not match the `fields` TensorDict with "
                                 f"batch_size {n}")
            values, nested = put_fields(fields, n)
        got = self.backend.kv_put(partition_id, keys, values, nested, None if tags is None else list(tags))
        return KVBatchMeta(keys=keys, tags=got["tags"], partition_id=partition_id, fields=got["fields"])

    # ------------------------------------------------------------------ KV lookups
    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        """The BatchMeta of `keys` (unknown keys left out, or created as new samples when `create`), with the
        fields all of them have."""
        if isinstance(keys, str):
            keys = [keys]
        elif isinstance(keys, list):
            if not keys:
                raise ValueError("Received an empty list as keys.")
            if not all(isinstance(k, str) for k in keys):
                raise TypeError("Not all elements in `keys` are strings.")
        else:
            raise TypeError("Only string or list of strings are allowed as `keys`.")
        return to_batch_meta(_controller(self.backend.kv_retrieve_meta, partition_id, keys, create))

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        """The keys of samples (RuntimeError when one has none)."""
        if isinstance(global_indexes, int):
            global_indexes = [global_indexes]
        elif isinstance(global_indexes, list):
            if not global_indexes:
                raise ValueError("Received an empty list as `global_indexes`.")
            if not all(isinstance(i, int) for i in global_indexes):
                raise TypeError("Not all elements in `global_indexes` are int.")
        else:
            raise TypeError("Only int or list of int are allowed as `global_indexes`.")
        keys = _controller(self.backend.kv_retrieve_keys, partition_id, global_indexes)
        if len(keys) != len(global_indexes) or any(k is None for k in keys):
            raise ControllerError("Some global_indexes have no corresponding keys!")
        return [k for k in keys if k is not None]  # every one (checked above)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """{partition_id: {key: custom metadata}} of one partition (an unknown one: {}) or all."""
        return dict(_controller(self.backend.kv_list, partition_id))

    # ------------------------------------------------------------------ checkpoints
    def save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Write the whole system (arrowbuf checkpoints the controller's bookkeeping and the values together, one
        format) under `checkpoint_dir`/arrowbuf."""
        import os

        self.backend.save_checkpoint(os.path.join(str(checkpoint_dir), "arrowbuf"))

    def load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Restore the system from `save_storage_checkpoint`'s directory."""
        import os

        self.backend.load_checkpoint(os.path.join(str(checkpoint_dir), "arrowbuf"))

    def save_controller_checkpoint(self, path: str) -> None:
        """Not separate in arrowbuf: the bookkeeping and the values form one checkpoint."""
        raise NotImplementedError("arrowbuf checkpoints the controller's bookkeeping together with the values: use "
                                  "save_storage_checkpoint(dir) or tq.save_checkpoint(dir)")

    def load_controller_checkpoint(self, path: str) -> None:
        """Not separate in arrowbuf (see `save_controller_checkpoint`)."""
        raise NotImplementedError("arrowbuf restores the controller's bookkeeping together with the values: use "
                                  "load_storage_checkpoint(dir) or tq.load_checkpoint(dir)")

    # ------------------------------------------------------------------ async twins (run in a worker thread)
    async def async_get_meta(self, data_fields: list[str], batch_size: int, partition_id: str, mode: str = "fetch",
                             task_name: str | None = None, sampling_config: dict[str, Any] | None = None,
                             sampler: SamplerArg = None) -> BatchMeta:
        return await asyncio.to_thread(self.get_meta, data_fields, batch_size, partition_id, mode, task_name,
                                       sampling_config, sampler)

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        await asyncio.to_thread(self.set_custom_meta, metadata)

    async def async_put(self, data: PutFields, metadata: BatchMeta | None = None, partition_id: str | None = None,
                        data_parser: Callable[[Any], Any] | None = None) -> BatchMeta:
        return await asyncio.to_thread(self.put, data, metadata, partition_id, data_parser)

    async def async_get_data(self, metadata: BatchMeta) -> Batch:
        return await asyncio.to_thread(self.get_data, metadata)

    async def async_clear_partition(self, partition_id: str) -> None:
        await asyncio.to_thread(self.clear_partition, partition_id)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        await asyncio.to_thread(self.clear_samples, metadata)

    async def async_get_consumption_status(self, task_name: str, partition_id: str) -> tuple[Any, Any]:
        return await asyncio.to_thread(self.get_consumption_status, task_name, partition_id)

    async def async_get_production_status(self, data_fields: list[str], partition_id: str) -> tuple[Any, Any]:
        return await asyncio.to_thread(self.get_production_status, data_fields, partition_id)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        return await asyncio.to_thread(self.check_consumption_status, task_name, partition_id)

    async def async_check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        return await asyncio.to_thread(self.check_production_status, data_fields, partition_id)

    async def async_reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        return await asyncio.to_thread(self.reset_consumption, partition_id, task_name)

    async def async_get_partition_list(self) -> list[str]:
        return await asyncio.to_thread(self.get_partition_list)

    async def async_kv_retrieve_meta(self, keys: list[str] | str, partition_id: str,
                                     create: bool = False) -> BatchMeta:
        return await asyncio.to_thread(self.kv_retrieve_meta, keys, partition_id, create)

    async def async_kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        return await asyncio.to_thread(self.kv_retrieve_keys, global_indexes, partition_id)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self.kv_list, partition_id)

    async def async_save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        await asyncio.to_thread(self.save_storage_checkpoint, checkpoint_dir)

    async def async_load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        await asyncio.to_thread(self.load_storage_checkpoint, checkpoint_dir)

    def close(self) -> None:
        """Close the connection (and the system, when this client owns it); idempotent."""
        close = getattr(self.backend, "close_client", None)
        if close is not None:
            close()
        if self._owned is not None:
            self._owned.close()
            self._owned = None


def _parsed(data: PutFields, parser: Callable[[Any], Any]) -> PutFields:
    """`data` after TransferQueue's `data_parser` contract: the parser gets {field: batched tensor, or a list of
    per-sample values for nested and non-tensor fields}, changes values in place (same keys, same counts, same
    order) and returns the dict."""
    torch = torch_module()
    items, size = batch_items(data)
    plain: dict[str, Any] = {}
    for name, value, values in items:
        if isinstance(value, torch.Tensor) and value.is_nested:
            plain[name] = list(value.unbind(0))
        elif isinstance(value, torch.Tensor):
            plain[name] = value
        else:
            plain[name] = list(values if values is not None else value)
    counts = {k: len(v) for k, v in plain.items()}
    out = parser(plain)
    if not isinstance(out, dict):
        raise TypeError(f"data_parser must return a dict, got {type(out).__name__}")
    if set(out) != set(plain):
        raise ValueError(f"data_parser must not change dict keys: {sorted(plain)} -> {sorted(out)}")
    for k, v in out.items():
        if len(v) != counts[k]:
            raise ValueError(f"data_parser changed the number of elements for key '{k}': {counts[k]} -> {len(v)}")
    return out if size is None else _as_tensordict(out, size)


def _as_tensordict(data: dict[str, Any], size: int) -> TensorDict:
    from .columns import tensordict_module

    td = tensordict_module()
    assert td is not None
    torch = torch_module()
    fields: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, list) and v and all(isinstance(x, torch.Tensor) for x in v):
            fields[k] = torch.nested.as_nested_tensor(v, layout=torch.jagged)
        elif isinstance(v, list):
            fields[k] = td.NonTensorStack(*v)
        else:
            fields[k] = v
    return td.TensorDict(fields, batch_size=[size])


__all__ = ["Backend", "ControllerError", "TransferQueueClient", "conf_get", "to_batch_meta"]
