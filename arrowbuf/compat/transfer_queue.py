"""TransferQueue 0.1.x's API on arrowbuf: code written against `transfer_queue` runs by changing one import::

    import arrowbuf.compat.transfer_queue as tq      # was: import transfer_queue as tq
    tq.init()                                         # an in-process system; tq.init({"arrowbuf": {"location": ...}})
                                                      # joins one served by tq.serve(...) in another process
    tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=TensorDict({...}, batch_size=2),
                    tags=[{"score": 1}, {"score": 2}])
    td = tq.kv_batch_get(keys=["a", "b"], partition_id="train")
    meta = tq.get_meta(data_fields=["prompts"], batch_size=8, partition_id="train", task_name="rollout")
    tq.put(TensorDict({"responses": ...}, batch_size=8), metadata=meta)   # fields filled later
    tq.close()

Mirrored (signatures from TransferQueue 0.1.11, `transfer_queue/interface.py` and `client.py`): `init(conf)`,
`close()`, `kv_put(key, partition_id, fields, tag)`, `kv_batch_put(keys, partition_id, fields, tags)`,
`kv_batch_get(keys, partition_id, select_fields)`, `kv_batch_get_by_meta(meta, select_fields)`,
`kv_list(partition_id)`, `kv_clear(keys, partition_id)` and their `async_` twins; the client's metadata path as
module functions and on `get_client()`: `get_meta(data_fields, batch_size, partition_id, mode, task_name,
sampling_config, sampler)`, `put(data, metadata, partition_id)`, `get_data(metadata)`, `set_custom_meta`,
`get_production_status`, `get_consumption_status`, `check_production_status`, `check_consumption_status`,
`reset_consumption`, `clear_partition`, `clear_samples`, `get_partition_list`; the samplers; `StreamingDataset`
and `StreamingDataLoader`. Not mirrored: `data_parser` (refused when given), `save_checkpoint`/`load_checkpoint`
(use `stores(partition_id)` and arrowbuf's checkpoints), metrics endpoints, storage-backend configs.

How fields map onto Arrow columns and what is refused: `arrowbuf.compat.tq_columns`. How partitions, keys, tags and
consumption are kept: `arrowbuf.compat.tq_state`. Values come back as a TensorDict when tensordict is installed
(`pip install 'arrowbuf[compat]'`), else as a dict of tensors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..errors import InvalidArgument, SchemaError
from .tq_columns import FieldKind, batch_items, columns_of, from_column, tensordict_module, to_output, torch_module
from .tq_meta import BatchMeta, KVBatchMeta
from .tq_samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    make_sampler,
)
from .tq_state import TQState

__all__ = [
    "BaseSampler", "BatchMeta", "GRPOGroupNSampler", "KVBatchMeta", "RankAwareSampler", "SeqlenBalancedSampler",
    "SequentialSampler", "StreamingDataLoader", "StreamingDataset", "TransferQueueClient",
    "async_kv_batch_get", "async_kv_batch_get_by_meta", "async_kv_batch_put", "async_kv_clear", "async_kv_list",
    "async_kv_put", "check_consumption_status", "check_production_status", "clear_partition", "clear_samples",
    "close", "get_client", "get_consumption_status", "get_data", "get_meta", "get_partition_list",
    "get_production_status", "init", "kv_batch_get", "kv_batch_get_by_meta", "kv_batch_put", "kv_clear",
    "kv_list", "kv_put", "load_checkpoint", "put", "reset_consumption", "save_checkpoint", "serve",
    "set_custom_meta", "stores",
]

DEFAULT_CAPACITY = 65_536


def _conf_get(conf: Any, *path: str, default: Any = None) -> Any:
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


class _LocalBackend:
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


_CLIENT: TransferQueueClient | None = None
_RAY_ACTOR: Any = None  # the Ray actor holding the system, when this process's init started it


def init(conf: Any = None) -> Any:
    """Start the system (first call) or join one.

    `conf` is TransferQueue's (a dict or OmegaConf); arrowbuf's own settings go under `arrowbuf`: `location` (join
    the system `serve` runs there, over Flight), `token`, `capacity` (rows per field-group store; default
    TransferQueue's `backend.SimpleStorage.total_storage_size`, else 65536; a store's memory is reserved for its
    capacity and touched as rows arrive), `ray` (default True: inside a Ray job the system lives in a named actor
    that every process's `init` finds, as TransferQueue's controller; see `tq_ray`), `host` (the address that actor
    binds), `shards` (inside a Ray job: N > 1 starts or joins a system of N shards, one named actor each, keys and
    puts routed over them by `tq_sharded`), `locations` (join N systems served over Flight as one sharded system).
    `controller.sampler` names the default sampler (a name, class or instance). A second `init` in the same
    process keeps the first system. Returns `conf`."""
    global _CLIENT, _RAY_ACTOR
    if _CLIENT is not None:
        return conf
    location = _conf_get(conf, "arrowbuf", "location")
    token = _conf_get(conf, "arrowbuf", "token")
    # TransferQueue's SimpleStorage.total_storage_size (samples held) sizes the rings when arrowbuf's capacity is unset
    capacity = int(_conf_get(conf, "arrowbuf", "capacity",
                             default=_conf_get(conf, "backend", "SimpleStorage", "total_storage_size",
                                               default=DEFAULT_CAPACITY)))
    sampler = _conf_get(conf, "controller", "sampler")
    locations = _conf_get(conf, "arrowbuf", "locations")
    shards = int(_conf_get(conf, "arrowbuf", "shards", default=1))
    if not location and not locations and _conf_get(conf, "arrowbuf", "ray", default=True):
        from .tq_ray import join_or_start, join_or_start_shards, ray_running

        if ray_running():
            host = str(_conf_get(conf, "arrowbuf", "host", default="127.0.0.1"))
            if shards > 1:
                locations, _RAY_ACTOR = join_or_start_shards(shards, capacity, sampler, host, token)
            else:
                location, _RAY_ACTOR = join_or_start(capacity, sampler, host, token)
    if locations:
        from .tq_flight import RemoteBackend
        from .tq_sharded import ShardedBackend

        _CLIENT = TransferQueueClient(ShardedBackend([RemoteBackend(str(loc), token) for loc in locations]), conf)
        return conf
    if location:
        from .tq_flight import RemoteBackend

        _CLIENT = TransferQueueClient(RemoteBackend(str(location), token), conf)
        return conf
    state = TQState(capacity=capacity, sampler=make_sampler(sampler))
    _CLIENT = TransferQueueClient(_LocalBackend(state), conf, owned=state)
    return conf


def close() -> None:
    """Close this process's client (and the system, when this process started it); idempotent."""
    global _CLIENT, _RAY_ACTOR
    client, _CLIENT = _CLIENT, None
    actor, _RAY_ACTOR = _RAY_ACTOR, None
    if client is not None:
        client.close()
    if actor is not None:
        from .tq_ray import stop

        for a in actor if isinstance(actor, list) else [actor]:
            stop(a)


def get_client() -> TransferQueueClient:
    """This process's client (starting an in-process system on first use, like TransferQueue)."""
    if _CLIENT is None:
        init()
    assert _CLIENT is not None
    return _CLIENT


def serve(location: str = "grpc://127.0.0.1:0", token: str | None = None) -> Any:
    """Serve this process's system (started with `init`) over Flight; other processes join with
    `init({"arrowbuf": {"location": server.location}})`. Returns the running server (a context manager)."""
    from .tq_flight import TQServer

    client = get_client()
    state = getattr(client.backend, "state", None)
    if state is None:
        raise InvalidArgument("serve() needs an in-process system (this process joined a remote one)")
    return TQServer(state, location, token=token)


def stores(partition_id: str) -> dict[str, Any]:
    """The arrowbuf `ExperienceStore`s holding a partition's field groups (in-process systems): `sql`,
    `to_table`, `checkpoint` work on them."""
    state = getattr(get_client().backend, "state", None)
    if state is None:
        raise InvalidArgument("stores() needs an in-process system")
    return state.stores(partition_id)


# ---------------------------------------------------------------------- the module-level API
def kv_put(key: str, partition_id: str, fields: Any = None, tag: dict[str, Any] | None = None,
           data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    """Put one sample's fields and/or tag under `key` (tensors get a batch dimension added); fields of an existing
    key are added or replaced, its tag merged. Returns every field stored for the key."""
    _no_parser(data_parser)
    return get_client().kv_put(key, partition_id, fields, tag)


def kv_batch_put(keys: list[str], partition_id: str, fields: Any = None, tags: list[dict[str, Any]] | None = None,
                 data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    """Put the fields (a TensorDict or dict with batch == len(keys)) and/or tags of many keys, atomically."""
    _no_parser(data_parser)
    return get_client().kv_batch_put(keys, partition_id, fields, tags)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> Any:
    """The fields (all stored, or `select_fields`) of `keys`, in their order.

    Raises:
        KeyError: an unknown key or partition. SchemaError: a field without a value for some key.
    """
    return get_client().kv_batch_get(keys, partition_id, select_fields)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    if meta.partition_id is None:
        raise ValueError("KVBatchMeta has no partition_id")
    return get_client().kv_batch_get(meta.keys, meta.partition_id,
                                     select_fields if select_fields is not None else meta.fields)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """{partition_id: {key: tags}} for one partition or all."""
    return get_client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove keys (their fields, tags and statuses) from a partition."""
    get_client().kv_clear(keys, partition_id)


async def async_kv_put(key: str, partition_id: str, fields: Any = None, tag: dict[str, Any] | None = None,
                       data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(keys: list[str], partition_id: str, fields: Any = None,
                             tags: list[dict[str, Any]] | None = None,
                             data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(keys: list[str] | str, partition_id: str,
                             select_fields: list[str] | str | None = None) -> Any:
    return await asyncio.to_thread(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    return await asyncio.to_thread(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await asyncio.to_thread(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    await asyncio.to_thread(kv_clear, keys, partition_id)


def get_meta(data_fields: list[str], batch_size: int, partition_id: str, task_name: str | None = None,
             sampler: Any = None, mode: str = "fetch", sampling_config: dict[str, Any] | None = None) -> BatchMeta:
    """See `TransferQueueClient.get_meta`."""
    return get_client().get_meta(data_fields, batch_size, partition_id, mode, task_name, sampling_config, sampler)


def put(data: Any, metadata: BatchMeta | None = None, partition_id: str | None = None) -> BatchMeta:
    """See `TransferQueueClient.put`."""
    return get_client().put(data, metadata, partition_id)


def get_data(metadata: BatchMeta) -> Any:
    """See `TransferQueueClient.get_data`."""
    return get_client().get_data(metadata)


def set_custom_meta(metadata: BatchMeta) -> None:
    get_client().set_custom_meta(metadata)


def get_production_status(data_fields: list[str], partition_id: str) -> tuple[Any, Any]:
    return get_client().get_production_status(data_fields, partition_id)


def get_consumption_status(task_name: str, partition_id: str) -> tuple[Any, Any]:
    return get_client().get_consumption_status(task_name, partition_id)


def check_production_status(data_fields: list[str], partition_id: str) -> bool:
    return get_client().check_production_status(data_fields, partition_id)


def check_consumption_status(task_name: str, partition_id: str) -> bool:
    return get_client().check_consumption_status(task_name, partition_id)


def reset_consumption(partition_id: str, task_name: str | None = None) -> bool:
    return get_client().reset_consumption(partition_id, task_name)


def clear_partition(partition_id: str) -> None:
    get_client().clear_partition(partition_id)


def clear_samples(metadata: BatchMeta) -> None:
    get_client().clear_samples(metadata)


def get_partition_list() -> list[str]:
    return get_client().get_partition_list()


def save_checkpoint(*args: Any, **kwargs: Any) -> None:
    """Not mirrored: checkpoint the partition's arrowbuf stores instead (`stores(partition_id)`, `.checkpoint`)."""
    raise NotImplementedError("arrowbuf.compat.transfer_queue has no save_checkpoint; checkpoint the stores of a "
                              "partition with tq.stores(partition_id)[name].checkpoint(path)")


def load_checkpoint(*args: Any, **kwargs: Any) -> None:
    """Not mirrored (see `save_checkpoint`)."""
    raise NotImplementedError("arrowbuf.compat.transfer_queue has no load_checkpoint (see save_checkpoint)")


def _no_parser(data_parser: Any) -> None:
    if data_parser is not None:
        raise InvalidArgument("data_parser is not supported by arrowbuf.compat; parse before put")


# ---------------------------------------------------------------------- streaming loader
def _dataset_base() -> Any:
    return torch_module().utils.data.IterableDataset


class StreamingDataset(_dataset_base()):  # type: ignore[misc]
    """Per-rank stream of `(batch, BatchMeta)` micro-batches, as TransferQueue's: each `dp_rank` asks for
    `batch_size` samples of `partition_id` for `task_name` (ranks with the same `dp_rank` get the same samples with a
    `RankAwareSampler`; different `dp_rank`s get disjoint ones), then yields them in `micro_batch_size` pieces.

    With `should_check_consumption_status=True` the stream ends once the task consumed every sample of the
    partition; otherwise it polls for new samples (every `poll_interval` seconds) until `max_wait` seconds pass
    without any (None: forever, as TransferQueue's)."""

    def __init__(self, config: Any, batch_size: int, micro_batch_size: int, data_fields: list[str],
                 partition_id: str, task_name: str, dp_rank: int, should_check_consumption_status: bool = False,
                 fetch_batch_fn: Callable[..., Any] | None = None, process_batch_fn: Callable[..., Any] | None = None,
                 sampler: Any = None, poll_interval: float = 0.05, max_wait: float | None = None) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(data_fields) < 1:
            raise ValueError(f"data_fields must be a list with at least one field name, got {data_fields}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        self.config, self.batch_size, self.micro_batch_size = config, batch_size, micro_batch_size
        self.data_fields, self.partition_id, self.task_name = list(data_fields), partition_id, task_name
        self.dp_rank, self.should_check_consumption_status = dp_rank, should_check_consumption_status
        self.fetch_batch_fn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.sampler = make_sampler(sampler) if sampler is not None else None  # None: the system's sampler
        self.poll_interval, self.max_wait = poll_interval, max_wait
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0

    def _client(self) -> TransferQueueClient:
        location = _conf_get(self.config, "arrowbuf", "location")
        if location and _CLIENT is None:
            init(self.config)
        return get_client()

    def __iter__(self) -> Iterator[tuple[Any, BatchMeta]]:
        client = self._client()
        idle_since = time.monotonic()
        while (not self.should_check_consumption_status
               or not client.check_consumption_status(self.task_name, self.partition_id)
               or self.batch_index < len(self.buffer)):
            if self.batch_index < len(self.buffer):
                data, meta = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(data, meta, micro_batch_size=self.micro_batch_size)
                idle_since = time.monotonic()
                continue
            data, meta = self.fetch_batch_fn(client, self.data_fields, self.batch_size, self.partition_id,
                                             self.task_name, {"dp_rank": self.dp_rank}, self.batch_index,
                                             self.sampler)
            if data is not None:
                self.buffer.append((data, meta))
            elif self.max_wait is not None and time.monotonic() - idle_since > self.max_wait:
                return
            else:
                time.sleep(self.poll_interval)

    def reset(self) -> None:
        """Replay the buffered batches from the start."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Switch to another partition with an empty buffer."""
        self.buffer, self.batch_index, self.partition_id = [], 0, partition_id


def default_fetch_batch_fn(client: TransferQueueClient, data_fields: list[str], batch_size: int,
                           partition_id: str, task_name: str, sampling_config: dict[str, Any], batch_index: int,
                           sampler: Any = None) -> tuple[Any, BatchMeta]:
    """`get_meta` then `get_data`; (None, empty meta) when nothing is ready."""
    config = {**sampling_config, "batch_index": batch_index}
    meta = client.get_meta(data_fields, batch_size, partition_id, task_name=task_name, sampling_config=config,
                           sampler=sampler)
    if meta.size == 0:
        return None, meta
    return client.get_data(meta), meta


def chunk_batch_fn(data: Any, meta: BatchMeta, micro_batch_size: int = 1) -> list[tuple[Any, BatchMeta]]:
    """Split a batch and its metadata into micro-batches of `micro_batch_size` (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    n = meta.size
    out = []
    for start in range(0, n, micro_batch_size):
        rows = list(range(start, min(n, start + micro_batch_size)))
        out.append((_select_rows(data, rows), meta.select_samples(rows)))
    return out


def _select_rows(data: Any, rows: list[int]) -> Any:
    torch = torch_module()
    items, _ = batch_items(data)
    picked: dict[str, Any] = {}
    for name, v in items:
        if isinstance(v, torch.Tensor) and v.is_nested:
            parts = v.unbind(0)
            picked[name] = torch.nested.as_nested_tensor([parts[i] for i in rows], layout=torch.jagged)
        elif isinstance(v, torch.Tensor):
            picked[name] = v[rows]
        else:
            vals = v.tolist() if hasattr(v, "tolist") else list(v)
            picked[name] = [vals[i] for i in rows]
    return to_output(picked, len(rows))


class StreamingDataLoader(torch_module().utils.data.DataLoader):  # type: ignore[misc]
    """A `torch.utils.data.DataLoader` over a `StreamingDataset` that passes `(batch, BatchMeta)` through."""

    def __init__(self, dataset: StreamingDataset, num_workers: int = 0, collate_fn: Any = None,
                 pin_memory: bool = False, worker_init_fn: Any = None, multiprocessing_context: Any = None,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "") -> None:
        self.dataset_ = dataset
        super().__init__(dataset=dataset, batch_size=None, num_workers=num_workers,
                         collate_fn=collate_fn or (lambda x: x), pin_memory=pin_memory,
                         worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device)

    def reset(self) -> None:
        self.dataset_.reset()

    def step(self, partition_id: str) -> None:
        self.dataset_.step(partition_id)

    def get_buffer(self) -> list[tuple[Any, BatchMeta]]:
        return self.dataset_.buffer
