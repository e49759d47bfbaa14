"""TransferQueue 0.1.x's module functions (`init`, `close`, `kv_*`, `get_meta`, `put`, ...): one client per process
(`client.TransferQueueClient`), started or joined by `init`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ...errors import InvalidArgument
from .client import DEFAULT_CAPACITY, LocalBackend, TransferQueueClient, conf_get
from .meta import BatchMeta, KVBatchMeta
from .samplers import make_sampler
from .state import TQState

_CLIENT: TransferQueueClient | None = None
_RAY_ACTOR: Any = None  # the Ray actor holding the system, when this process's init started it


def init(conf: Any = None) -> Any:
    """Start the system (first call) or join one.

    `conf` is TransferQueue's (a dict or OmegaConf); arrowbuf's own settings go under `arrowbuf`: `location` (join
    the system `serve` runs there, over Flight), `token`, `capacity` (rows per field-group store; default
    TransferQueue's `backend.SimpleStorage.total_storage_size`, else 65536; a store's memory is reserved for its
    capacity and touched as rows arrive), `ray` (default True: inside a Ray job the system lives in a named actor
    that every process's `init` finds, as TransferQueue's controller; see `ray`), `host` (the address that actor
    binds), `shards` (inside a Ray job: N > 1 starts or joins a system of N shards, one named actor each, keys and
    puts routed over them by `sharded`), `locations` (join N systems served over Flight as one sharded system).
    `controller.sampler` names the default sampler (a name, class or instance). A second `init` in the same
    process keeps the first system. Returns `conf`."""
    global _CLIENT, _RAY_ACTOR
    if _CLIENT is not None:
        return conf
    location = conf_get(conf, "arrowbuf", "location")
    token = conf_get(conf, "arrowbuf", "token")
    # TransferQueue's SimpleStorage.total_storage_size (samples held) sizes the rings when arrowbuf's capacity is unset
    capacity = int(conf_get(conf, "arrowbuf", "capacity",
                             default=conf_get(conf, "backend", "SimpleStorage", "total_storage_size",
                                               default=DEFAULT_CAPACITY)))
    sampler = conf_get(conf, "controller", "sampler")
    locations = conf_get(conf, "arrowbuf", "locations")
    shards = int(conf_get(conf, "arrowbuf", "shards", default=1))
    if not location and not locations and conf_get(conf, "arrowbuf", "ray", default=True):
        from .ray import join_or_start, join_or_start_shards, ray_running

        if ray_running():
            host = str(conf_get(conf, "arrowbuf", "host", default="127.0.0.1"))
            if shards > 1:
                locations, _RAY_ACTOR = join_or_start_shards(shards, capacity, sampler, host, token)
            else:
                location, _RAY_ACTOR = join_or_start(capacity, sampler, host, token)
    if locations:
        from .remote import RemoteBackend
        from .sharded import ShardedBackend

        _CLIENT = TransferQueueClient(ShardedBackend([RemoteBackend(str(loc), token) for loc in locations]), conf)
        return conf
    if location:
        from .remote import RemoteBackend

        _CLIENT = TransferQueueClient(RemoteBackend(str(location), token), conf)
        return conf
    state = TQState(capacity=capacity, sampler=make_sampler(sampler))
    _CLIENT = TransferQueueClient(LocalBackend(state), conf, owned=state)
    return conf


def close() -> None:
    """Close this process's client (and the system, when this process started it); idempotent."""
    global _CLIENT, _RAY_ACTOR
    client, _CLIENT = _CLIENT, None
    actor, _RAY_ACTOR = _RAY_ACTOR, None
    if client is not None:
        client.close()
    if actor is not None:
        from .ray import stop

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
    from .server import TQServer

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

