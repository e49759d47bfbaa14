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

The package, one concept per module: `api` (the module functions: init, close, kv_*, get_meta, put, ...), `client`
(`TransferQueueClient`), `meta` (`BatchMeta`, `KVBatchMeta`), `samplers`, `streaming` (`StreamingDataset`,
`StreamingDataLoader`), `columns` (how fields map onto Arrow columns and what is refused), `state` (how partitions,
keys, tags and consumption are kept), `wire`/`server`/`remote` (the `tq.v1` Flight protocol, its server and client),
`ray` (the system in a named Ray actor), `sharded` (N systems as one). Values come back as a TensorDict when
tensordict is installed (`pip install 'arrowbuf[compat]'`), else as a dict of tensors.
"""

from __future__ import annotations

from .api import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    check_consumption_status,
    check_production_status,
    clear_partition,
    clear_samples,
    close,
    get_client,
    get_consumption_status,
    get_data,
    get_meta,
    get_metrics_endpoint,
    get_partition_list,
    get_production_status,
    init,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    load_checkpoint,
    put,
    reset_consumption,
    save_checkpoint,
    serve,
    set_custom_meta,
    stores,
)
from .client import ControllerError, TransferQueueClient
from .meta import BatchMeta, KVBatchMeta, PartitionSnapshot
from .samplers import BaseSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler, SequentialSampler
from .state import GetMetaTimeout, StorageKeyNotFoundError
from .streaming import StreamingDataLoader, StreamingDataset

__all__ = [
    "BaseSampler", "BatchMeta", "ControllerError", "GRPOGroupNSampler", "GetMetaTimeout", "KVBatchMeta",
    "PartitionSnapshot", "RankAwareSampler", "SeqlenBalancedSampler", "SequentialSampler", "StorageKeyNotFoundError",
    "StreamingDataLoader", "StreamingDataset", "TransferQueueClient",
    "async_kv_batch_get", "async_kv_batch_get_by_meta", "async_kv_batch_put", "async_kv_clear", "async_kv_list",
    "async_kv_put", "check_consumption_status", "check_production_status", "clear_partition", "clear_samples",
    "close", "get_client", "get_consumption_status", "get_data", "get_meta", "get_metrics_endpoint",
    "get_partition_list", "get_production_status", "init", "kv_batch_get", "kv_batch_get_by_meta", "kv_batch_put",
    "kv_clear", "kv_list", "kv_put", "load_checkpoint", "put", "reset_consumption", "save_checkpoint", "serve",
    "set_custom_meta", "stores",
]
