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

Mirrored, with TransferQueue 0.1.11's semantics (its own test suite runs against this package with only the import
swapped; docs/integrations.md lists what fails and why): the module API (`init`, `close`, the `kv_*` calls and
their `async_` twins, `save_checkpoint`, `load_checkpoint`, `get_metrics_endpoint`, `get_client`), the client's
metadata path (also as module functions here: `get_meta`, `put`, `get_data`, statuses, clears), `BatchMeta`,
`KVBatchMeta`, the samplers, `StreamingDataset`/`StreamingDataLoader`, `StorageKeyNotFoundError`.

The package, one concept per module: `api` (the module functions: init, close, kv_*, checkpoints, ...), `client`
(`TransferQueueClient` and the `Backend` calls it makes), `meta` (`BatchMeta`, `KVBatchMeta`, `PartitionSnapshot`),
`samplers`, `streaming` (`StreamingDataset`, `StreamingDataLoader`), `columns` (how fields map onto arrowbuf columns
and back, and what is refused), `state` (the system: TransferQueue's controller over arrowbuf stores), `partition`
(its parts), `checkpoint` (its checkpoints), `wire`/`server`/`remote` (the `tq.v2` Flight protocol, its server and
client), `ray` (the system in the TransferQueueController Ray actor), `sharded` (N systems as one). Values come back
as a TensorDict when tensordict is installed (`pip install 'arrowbuf[compat]'`), else as a dict of tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .streaming import StreamingDataLoader, StreamingDataset


def __getattr__(name: str) -> Any:
    # the streaming classes subclass torch's at definition: imported when first asked for, so that a process that
    # only serves a system (the Ray actors: `ray`, `sharded`) does not import torch (1.5 s quiet, more per actor
    # started in a loaded cluster)
    if name in ("StreamingDataLoader", "StreamingDataset"):
        from . import streaming

        return getattr(streaming, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
