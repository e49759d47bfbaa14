"""TransferQueue 0.1.11's module functions (`init`, `close`, `kv_*` and their `async_` twins, `save_checkpoint`,
`load_checkpoint`, `get_metrics_endpoint`, `get_client`), plus arrowbuf's own (`serve`, `stores`, and the client's
metadata path as module functions): one client per process (`client.TransferQueueClient`), started or joined by
`init`.

KV semantics are TransferQueue's: a put creates unknown keys (new samples) and merges tags; a get of keys of which
none exists raises ValueError ("keys or partition were not found!"), of keys whose common fields are not all
produced raises ValueError, and returns the fields every requested key has; `kv_clear` of unknown keys or partitions
does nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidArgument
from .client import DEFAULT_CAPACITY, TransferQueueClient, conf_get
from .columns import Batch, PutFields
from .meta import BatchMeta, KVBatchMeta
from .samplers import SamplerArg
from .state import TQState

if TYPE_CHECKING:  # pragma: no cover
    from .server import TQServer

logger = logging.getLogger(__name__)

_CLIENT: TransferQueueClient | None = None
_RAY_ACTOR: Any = None  # the Ray actor(s) holding the system, when this process's init started it
_CONF: Any = None
_PID = 0  # the process that made _CLIENT: a forked child (a DataLoader worker) starts over instead of sharing it

METADATA_FILE = "metadata.json"


def _settings(conf: Any) -> dict[str, Any]:
    total = conf_get(conf, "backend", "SimpleStorage", "total_storage_size")
    return {
        # TransferQueue's SimpleStorage.total_storage_size (samples held) sizes the rings when arrowbuf's is unset
        "capacity": int(conf_get(conf, "arrowbuf", "capacity", default=total if total else DEFAULT_CAPACITY)),
        "sampler": conf_get(conf, "controller", "sampler"),
        "polling_mode": bool(conf_get(conf, "controller", "polling_mode", default=False)),
        "wait": float(conf_get(conf, "arrowbuf", "get_meta_wait", default=5.0)),
        "output": str(conf_get(conf, "arrowbuf", "output", default="jagged")),
        "token": conf_get(conf, "arrowbuf", "token"),
        "location": conf_get(conf, "arrowbuf", "location"),
        "locations": conf_get(conf, "arrowbuf", "locations"),
        "shards": int(conf_get(conf, "arrowbuf", "shards", default=1)),
        "ray": bool(conf_get(conf, "arrowbuf", "ray", default=True)),
        "host": str(conf_get(conf, "arrowbuf", "host", default="127.0.0.1")),
        "limits": conf_get(conf, "arrowbuf", "limits"),
        # field groups in /dev/shm, written and read by the processes of the node themselves: on by default for a
        # system in a Ray actor (and its clients), off for one in this process (unless True: then `serve`d, its
        # clients on this node use it); False turns it off everywhere (as between nodes)
        "shared_memory": conf_get(conf, "arrowbuf", "shared_memory"),
    }


def init(conf: Any = None) -> Any:
    """Start the system (first call) or join one.

    `conf` is TransferQueue's (a dict or OmegaConf): `controller.sampler` (a name, class or instance),
    `controller.polling_mode` (False: `get_meta(mode="fetch")` waits up to `arrowbuf.get_meta_wait` seconds (5) for
    enough ready samples, then raises; True: returns an empty BatchMeta), `backend.SimpleStorage.total_storage_size`
    (rows per field-group ring unless `arrowbuf.capacity` is set; default 65536). arrowbuf's own settings go under
    `arrowbuf`: `output` ("jagged", TransferQueue's, or "dense"), `location` (join the system `serve` runs there,
    over Flight), `token`, `ray` (default True: inside a Ray job the system lives in a Ray actor named
    "TransferQueueController" (namespace "transfer_queue"), as TransferQueue's controller, that every process's
    `init` finds; see `ray`), `host` (the address that actor binds), `shards` (inside a Ray job: N > 1 starts or
    joins N shards routed by `sharded`), `locations` (join N systems served over Flight as one sharded system),
    `shared_memory` (the field groups in /dev/shm, so that the processes of the system's node put and read values
    themselves, not over Flight: on by default for a system in a Ray actor, off by default for one in this process;
    False turns it off in the system and its clients). A
    second `init` in the same process keeps the first system. Returns `conf`."""
    global _CLIENT, _RAY_ACTOR, _CONF, _PID
    _forget_if_forked()
    if _CLIENT is not None:
        return conf
    _PID = os.getpid()
    s = _settings(conf)
    location, locations = s["location"], s["locations"]
    actors: Any = None
    if not location and not locations and s["ray"]:
        from .ray import join_or_start, join_or_start_shards, ray_running

        if ray_running():
            if s["shards"] > 1:  # the shards answer at once; the router waits as one system would
                locations, _RAY_ACTOR = join_or_start_shards(s["shards"], {**s, "polling_mode": True}, s["host"],
                                                             s["token"])
            else:
                location, actors, _RAY_ACTOR = join_or_start(s, s["host"], s["token"])
    if locations:
        from .remote import RemoteBackend
        from .sharded import ShardedBackend

        shm = s["shared_memory"] is not False
        shards = ShardedBackend([RemoteBackend(str(loc), s["token"], shared_memory=shm) for loc in locations],
                                polling_mode=s["polling_mode"] or not s["shards"] > 1, wait=s["wait"])
        _CLIENT = TransferQueueClient(shards, conf, output=s["output"])
    elif location:
        from .remote import RemoteBackend

        _CLIENT = TransferQueueClient(RemoteBackend(str(location), s["token"], actor=actors,
                                                    shared_memory=s["shared_memory"] is not False), conf,
                                      output=s["output"])
    else:
        state = TQState(capacity=s["capacity"], sampler=s["sampler"], polling_mode=s["polling_mode"],
                        wait=s["wait"], shared_memory=s["shared_memory"] is True)
        _CLIENT = TransferQueueClient(state, conf, owned=state, output=s["output"])
    _CONF = conf
    return conf


def _forget_if_forked() -> None:
    """In a forked child, drop the parent's client without closing it: its connections, threads and locks belong to
    the parent (closing them here could hang or break the parent's system)."""
    global _CLIENT, _RAY_ACTOR, _CONF
    if _CLIENT is not None and _PID != os.getpid():
        _CLIENT, _RAY_ACTOR, _CONF = None, None, None


def close() -> None:
    """Close this process's client (and the system, when this process started it); idempotent."""
    global _CLIENT, _RAY_ACTOR, _CONF
    _forget_if_forked()
    client, _CLIENT = _CLIENT, None
    actor, _RAY_ACTOR = _RAY_ACTOR, None
    _CONF = None
    if client is not None:
        client.close()
    if actor is not None:
        from .ray import stop

        for a in actor if isinstance(actor, list) else [actor]:
            stop(a)


def get_client() -> TransferQueueClient:
    """This process's client: joins the job's system (inside Ray) or starts one in this process on first use."""
    _forget_if_forked()
    if _CLIENT is None:
        init()
    assert _CLIENT is not None
    return _CLIENT


def get_metrics_endpoint() -> str | None:
    """The Prometheus endpoint of the system (`host:port`), or None when metrics are not enabled (TransferQueue's
    default, and arrowbuf's: a TransferQueue-compatible system exports none)."""
    if _CLIENT is None:
        return None
    return conf_get(_CONF, "metrics", "endpoint")


def serve(location: str = "grpc://127.0.0.1:0", token: str | None = None) -> TQServer:
    """Serve this process's system (started with `init`) over Flight; other processes join with
    `init({"arrowbuf": {"location": server.location}})`. Returns the running server (a context manager)."""
    from .server import TQServer

    state = get_client()._owned
    if not isinstance(state, TQState):
        raise InvalidArgument("serve() needs an in-process system (this process joined a remote one)")
    return TQServer(state, location, token=token)


def stores(partition_id: str) -> dict[str, Any]:
    """The arrowbuf `ExperienceStore`s holding a partition's field groups (in-process systems): `sql`,
    `to_table`, `checkpoint` work on them."""
    state = get_client()._owned
    if not isinstance(state, TQState):
        raise InvalidArgument("stores() needs an in-process system")
    return state.stores(partition_id)


# ---------------------------------------------------------------------- the KV API
def _kv_fields(fields: PutFields) -> PutFields:
    """kv_put's fields: a dict gets a batch dimension (tensors unsqueezed, anything else one value per sample)."""
    from .columns import tensordict_module, torch_module

    td = tensordict_module()
    if td is not None and isinstance(fields, td.TensorDictBase):
        return fields
    if not isinstance(fields, dict):
        raise ValueError("`fields` can only be dict or TensorDict")
    torch = torch_module()
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise ValueError("Please use (async)kv_batch_put for batch operation")
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = td.NonTensorStack(value) if td is not None else [value]
    return td.TensorDict(batch, batch_size=[1]) if td is not None else batch


def kv_put(key: str, partition_id: str, fields: PutFields | None = None, tag: dict[str, Any] | None = None,
           data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    """Put one sample's fields and/or tag under `key` (a dict's tensors get a batch dimension, its other values are
    one value of the sample); an existing key's fields are added or replaced, its tag merged. Returns every field
    stored for the key."""
    if fields is None and tag is None:
        raise ValueError("Please provide at least one parameter of fields or tag.")
    return get_client().kv_batch_put([key], partition_id, None if fields is None else _kv_fields(fields),
                                     None if tag is None else [tag], data_parser)


def kv_batch_put(keys: list[str], partition_id: str, fields: PutFields | None = None,
                 tags: list[dict[str, Any] | None] | None = None,
                 data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    """Put the fields (batch == len(keys)) and/or tags of many keys, atomically; returns every field stored for
    all of them."""
    return get_client().kv_batch_put(keys, partition_id, fields, tags, data_parser)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> Batch:
    """The fields (those every key has, or `select_fields`) of `keys`, in their order; unknown keys are left out.

    Raises:
        ValueError: none of the keys exists, or a selected field is not produced for every key.
    """
    client = get_client()
    meta = client.kv_retrieve_meta(keys, partition_id, create=False)
    if meta.size == 0:
        raise ValueError("keys or partition were not found!")
    if select_fields is not None:
        meta = meta.select_fields([select_fields] if isinstance(select_fields, str) else list(select_fields))
    if not meta.is_ready:
        raise ValueError("Some fields are not ready in all the requested keys!")
    return client.get_data(meta)


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Batch:
    """`kv_batch_get` of a KV put's result (`select_fields` must be among its fields)."""
    if meta.partition_id is None:
        raise ValueError("Must provide partition_id in the input KVBatchMeta.")
    if select_fields is not None:
        wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        if meta.fields is None or any(f not in meta.fields for f in wanted):
            raise ValueError(f"Some fields assigned in select_fields not found in the metadata. Assigned: {wanted}; "
                             f"Fields in KVBatchMeta: {meta.fields}.")
    else:
        wanted = meta.fields  # type: ignore[assignment]
    return kv_batch_get(meta.keys, meta.partition_id, wanted)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """{partition_id: {key: tags}} of one partition (an unknown one: {}) or all."""
    return get_client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove keys (their fields, tags and statuses) from a partition; unknown keys and partitions are ignored."""
    keys = [keys] if isinstance(keys, str) else keys
    client = get_client()
    meta = client.kv_retrieve_meta(keys, partition_id, create=False)
    if meta.size > 0:
        client.clear_samples(meta)


async def async_kv_put(key: str, partition_id: str, fields: PutFields | None = None, tag: dict[str, Any] | None = None,
                       data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    return await asyncio.to_thread(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(keys: list[str], partition_id: str, fields: PutFields | None = None,
                             tags: list[dict[str, Any] | None] | None = None,
                             data_parser: Callable[[Any], Any] | None = None) -> KVBatchMeta:
    return await asyncio.to_thread(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(keys: list[str] | str, partition_id: str,
                             select_fields: list[str] | str | None = None) -> Batch:
    return await asyncio.to_thread(kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Batch:
    return await asyncio.to_thread(kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await asyncio.to_thread(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    await asyncio.to_thread(kv_clear, keys, partition_id)


# ---------------------------------------------------------------------- checkpoints
def save_checkpoint(checkpoint_dir: str | Path, *, include_storage: bool = True,
                    metadata: dict[str, Any] | None = None) -> None:
    """Write the whole system to `checkpoint_dir` (replaced atomically: written beside it, then renamed in):
    TransferQueue's `metadata.json` (`storage_saved`, `user_metadata`) and arrowbuf's checkpoint of the system under
    `arrowbuf/` (its bookkeeping as JSON, each field-group store as an arrowbuf checkpoint: Arrow IPC files that
    pyarrow, DuckDB and Polars read). The values are always saved (`include_storage=False` is ignored, as
    TransferQueue ignores it for its in-memory storage); `metadata` must be JSON.

    Raises:
        RuntimeError: the system is not initialized.
    """
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    target = Path(checkpoint_dir)
    tmp = target.parent / f"{target.name}.tmp"
    old = target.parent / f"{target.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        if not include_storage:
            logger.warning("include_storage=False has no effect: arrowbuf keeps the values in memory, and a "
                           "checkpoint without them would lose them on restart. Saving them.")
        _CLIENT.save_storage_checkpoint(str(tmp))
        with open(tmp / METADATA_FILE, "w") as f:
            json.dump({"storage_saved": True, "user_metadata": metadata or {}}, f, indent=2)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists() and not target.exists():
            old.rename(target)
        raise


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Replace the system's state with `save_checkpoint`'s (an interrupted save's previous checkpoint is rolled
    back first).

    Raises:
        RuntimeError: the system is not initialized. FileNotFoundError: no checkpoint, or no metadata.json in it.
    """
    if _CLIENT is None:
        raise RuntimeError("TransferQueue is not initialized. Call tq.init() first.")
    target = Path(checkpoint_dir)
    old = target.parent / f"{target.name}.old"
    if not target.exists() and old.exists():
        logger.warning("Found interrupted checkpoint replacement; restoring %s to %s", old, target)
        old.rename(target)
    if not target.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {target}")
    meta = target / METADATA_FILE
    if not meta.exists():
        raise FileNotFoundError(f"{METADATA_FILE} not found in {target}")
    json.loads(meta.read_text())
    _CLIENT.load_storage_checkpoint(str(target))


# ---------------------------------------------------------------------- the client's metadata path, as functions
def get_meta(data_fields: list[str], batch_size: int, partition_id: str, task_name: str | None = None,
             sampler: SamplerArg = None, mode: str = "fetch",
             sampling_config: dict[str, Any] | None = None) -> BatchMeta:
    """See `TransferQueueClient.get_meta`."""
    return get_client().get_meta(data_fields, batch_size, partition_id, mode, task_name, sampling_config, sampler)


def put(data: PutFields, metadata: BatchMeta | None = None, partition_id: str | None = None) -> BatchMeta:
    """See `TransferQueueClient.put`."""
    return get_client().put(data, metadata, partition_id)


def get_data(metadata: BatchMeta) -> Batch:
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
