"""TransferQueue's streaming loader: `StreamingDataset` (a per-rank stream of `(batch, BatchMeta)` micro-batches
over `get_meta`/`get_data`) and `StreamingDataLoader`, with TransferQueue 0.1.11's signatures and semantics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

from . import api
from .client import ConfNode, TransferQueueClient, conf_get
from .columns import tensordict_module, torch_module
from .meta import BatchMeta
from .samplers import SamplerArg

if TYPE_CHECKING:  # pragma: no cover
    from tensordict import TensorDict


def _dataset_base() -> type:
    return torch_module().utils.data.IterableDataset


class StreamingDataset(_dataset_base()):  # type: ignore[misc]
    """Per-rank stream of `(batch, BatchMeta)` micro-batches, as TransferQueue's: each `dp_rank` asks for
    `batch_size` samples of `partition_id` for `task_name` (sampling_config carries dp_rank, task_name, batch_index
    and partition_id: with a `RankAwareSampler` ranks of the same `dp_rank` get the same samples, different ones get
    disjoint ones), then yields them in `micro_batch_size` pieces (`process_batch_fn`).

    With `should_check_consumption_status=True` the stream ends once the task consumed every sample of the
    partition; otherwise it polls for new samples (every `poll_interval` seconds, TransferQueue's 1 s) until
    `max_wait` seconds pass without any (None: forever, as TransferQueue's). `sampler` (an arrowbuf extension)
    overrides the system's sampler for this stream."""

    def __init__(self, config: ConfNode | None, batch_size: int, micro_batch_size: int, data_fields: list[str],
                 partition_id: str, task_name: str, dp_rank: int, should_check_consumption_status: bool = False,
                 fetch_batch_fn: Callable[..., Any] | None = None, process_batch_fn: Callable[..., Any] | None = None,
                 sampler: SamplerArg = None, poll_interval: float = 1.0, max_wait: float | None = None) -> None:
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
        self.sampling_config = {"dp_rank": dp_rank, "task_name": task_name}
        self.sampler = sampler
        self.poll_interval, self.max_wait = poll_interval, max_wait
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0
        super().__init__()

    def _client(self) -> TransferQueueClient:
        if conf_get(self.config, "arrowbuf", "location") and api._CLIENT is None:
            api.init(self.config)
        return api.get_client()

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
            kwargs: dict[str, Any] = dict(tq_client=client, data_fields=self.data_fields, batch_size=self.batch_size,
                          partition_id=self.partition_id, task_name=self.task_name,
                          sampling_config=self.sampling_config, batch_index=self.batch_index)
            if self.sampler is not None:
                kwargs["sampler"] = self.sampler
            data, meta = self.fetch_batch_fn(**kwargs)
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


def default_fetch_batch_fn(tq_client: TransferQueueClient, data_fields: list[str], batch_size: int,
                           partition_id: str, task_name: str, sampling_config: dict[str, Any], batch_index: int,
                           sampler: SamplerArg = None) -> tuple[Any, BatchMeta]:
    """`get_meta` (sampling_config plus batch_index and partition_id) then `get_data`; (None, the empty meta) when
    nothing is ready."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    meta = tq_client.get_meta(data_fields, batch_size, partition_id, task_name=task_name, sampling_config=config,
                              sampler=sampler)
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: TensorDict, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[tuple[Any, BatchMeta]]:
    """A TensorDict and its BatchMeta in micro-batches of `micro_batch_size` samples (the last may be smaller);
    nested tensor fields keep their layout."""
    tdm = tensordict_module()
    torch = torch_module()
    if tdm is None or not isinstance(td, tdm.TensorDict):
        raise TypeError(f"Expected TensorDict, got {type(td).__name__}")
    if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    if len(td.batch_size) == 0:
        raise ValueError("Input TensorDict must have non-empty batch_size")
    total = int(td.batch_size[0])
    if micro_batch_size > total:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) exceeds total batch size ({total})")
    splits = (total + micro_batch_size - 1) // micro_batch_size
    metas = batch_meta.chunk(splits)
    nested: dict[str, tuple[tuple[Any, ...], Any]] = {}
    dense: dict[str, Any] = {}
    for key, value in td.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            nested[key] = (value.unbind(0), value.layout)
        else:
            dense[key] = value
    dense_td = tdm.TensorDict(dense, batch_size=td.batch_size) if dense else None
    out = []
    for i in range(splits):
        start, end = i * micro_batch_size, min((i + 1) * micro_batch_size, total)
        chunk = dense_td[start:end] if dense_td is not None else tdm.TensorDict({}, batch_size=(end - start,))
        for key, (parts, layout) in nested.items():
            chunk[key] = torch.nested.as_nested_tensor(list(parts[start:end]), layout=layout)
        out.append((chunk, metas[i]))
    return out


class StreamingDataLoader(torch_module().utils.data.DataLoader):  # type: ignore[misc]
    """A `torch.utils.data.DataLoader` over a `StreamingDataset` that passes `(batch, BatchMeta)` through."""

    def __init__(self, dataset: StreamingDataset, num_workers: int = 0, collate_fn: Callable[[Any], Any] | None = None,
                 pin_memory: bool = False, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: str | BaseContext | None = None,
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
