"""Prioritized replay for TorchRL buffers without TorchRL's C++ extension (which torchrl 0.14.1 does not load
against torch 2.13): two samplers, for two places to keep the priorities.

- `ArrowbufPrioritizedSampler`: TorchRL's own `PrioritizedSampler` (its algorithm, its state: priorities per
  storage position, max-priority tracking, `alpha`/`beta`/`eps`, `reduction`, importance weights
  `(p_i / p_min) ** -beta`) running on arrowbuf's vectorised sum and min trees (`sumtrees`) instead of the C++
  segment trees. It is a `PrioritizedSampler`, so `TensorDictReplayBuffer.update_tensordict_priority` and
  `PrioritizedReplayBuffer(sampler=...)` treat it as theirs; it works over any storage::

      sampler = ArrowbufPrioritizedSampler(max_capacity=100_000, alpha=0.6, beta=0.4)
      rb = TensorDictReplayBuffer(storage=ArrowbufStorage(100_000), sampler=sampler, priority_key="td_error",
                                  batch_size=256)
      batch = rb.sample(); loss = ...; batch["td_error"] = td_error
      rb.update_tensordict_priority(batch)

  `TensorDictPrioritizedReplayBuffer` takes no sampler: it builds TorchRL's `PrioritizedSampler`, which works
  once `use_arrowbuf_sum_trees()` gave TorchRL these trees.

- `ArrowbufSampler`: delegates to the `ArrowbufStorage`'s own store sampler (e.g. `ab.samplers.Prioritized`), so
  the priorities live in the store: shared by every process of a shared-memory store, kept by its checkpoints.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import torch
from tensordict import MemoryMappedTensor
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, Sampler

from ...errors import InvalidArgument
from .sumtrees import MinSegmentTree, SumSegmentTree


class ArrowbufPrioritizedSampler(PrioritizedSampler):
    """TorchRL's `PrioritizedSampler` on arrowbuf's sum/min trees (see the module doc); same arguments, same
    behaviour, no C++ extension. The trees live on the CPU (`device` is accepted for signature compatibility;
    a CUDA storage's indices are drawn on the CPU). Its `state_dict` holds tensors only (`torch.load` with
    `weights_only=True` reads it); `dumps`/`loads` write TorchRL's own file layout.

    Args:
        max_capacity: positions (the storage's `max_size`).
        alpha: priority exponent; beta: importance-sampling exponent; eps: added to priorities.
        dtype: dtype of the returned weights (torch.float or torch.double).
        reduction: how a multi-dimensional priority is reduced ("max", "min", "median", "mean").
        max_priority_within_buffer: track the max priority among stored items only.
    """

    _max_priority: Any  # TorchRL's property: (value, index), or (None, None) before the first update

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max", max_priority_within_buffer: bool = False,
                 device: torch.device | str | None = None) -> None:
        if alpha < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={alpha}")
        if beta < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={beta}")
        Sampler.__init__(self)
        self._max_capacity = int(max_capacity)
        self._alpha = alpha
        self._beta = beta
        self._eps = eps
        self.reduction = reduction
        self.dtype = dtype
        self._max_priority_within_buffer = max_priority_within_buffer
        self._device = None  # the trees are numpy arrays on the CPU
        self._init()

    def _init(self) -> None:
        self._sum_tree = SumSegmentTree(self._max_capacity, self.dtype)
        self._min_tree = MinSegmentTree(self._max_capacity, self.dtype)
        self._max_priority = None

    def _tree_device_from_storage(self, storage: Any) -> torch.device | None:
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        return {"_schema_version": self._STATE_SCHEMA_VERSION, "_alpha": self._alpha, "_beta": self._beta,
                "_eps": self._eps, "_max_priority": self._max_priority,
                "_sum_tree": torch.from_numpy(self._sum_tree.values()),
                "_min_tree": torch.from_numpy(self._min_tree.values())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("_sum_tree", "_min_tree"):
            v = state_dict[key]
            if not isinstance(v, torch.Tensor) or v.shape != (self._max_capacity,):
                raise InvalidArgument(f"ArrowbufPrioritizedSampler.load_state_dict: {key} must be a tensor of "
                                      f"{self._max_capacity} priorities (this sampler's max_capacity), got "
                                      f"{type(v).__name__} {getattr(v, 'shape', '')}")
        self._alpha = state_dict["_alpha"]
        self._beta = state_dict["_beta"]
        self._eps = state_dict["_eps"]
        self._max_priority = state_dict["_max_priority"]
        self._sum_tree.load(state_dict["_sum_tree"].double().numpy())
        self._min_tree.load(state_dict["_min_tree"].double().numpy())

    def dumps(self, path: Any) -> None:
        path = pathlib.Path(path).absolute()
        path.mkdir(exist_ok=True)
        for name, tree in (("sumtree", self._sum_tree), ("mintree", self._min_tree)):
            MemoryMappedTensor.from_tensor(torch.from_numpy(tree.values()), filename=path / f"{name}.memmap",
                                           existsok=True)
        maxp = self._max_priority
        metadata = {"_alpha": float(self._alpha), "_beta": float(self._beta), "_eps": float(self._eps),
                    "_max_priority": [None if x is None else float(x) for x in maxp],
                    "_max_capacity": float(self._max_capacity), "_schema_version": self._STATE_SCHEMA_VERSION}
        (path / "sampler_metadata.json").write_text(json.dumps(metadata))

    def loads(self, path: Any) -> None:
        path = pathlib.Path(path).absolute()
        metadata = json.loads((path / "sampler_metadata.json").read_text())
        if int(metadata["_max_capacity"]) != self._max_capacity:
            raise RuntimeError(f"max capacity of loaded metadata ({metadata['_max_capacity']}) differs from "
                               f"self._max_capacity ({self._max_capacity}).")
        self._alpha, self._beta, self._eps = metadata["_alpha"], metadata["_beta"], metadata["_eps"]
        maxp = metadata["_max_priority"]
        self._max_priority = None if maxp[0] is None else (torch.tensor(maxp[0]), None if maxp[1] is None
                                                           else torch.tensor(int(maxp[1])))
        for name, tree in (("sumtree", self._sum_tree), ("mintree", self._min_tree)):
            mm = MemoryMappedTensor.from_filename(shape=(self._max_capacity,), dtype=torch.float64,
                                                  filename=path / f"{name}.memmap")
            tree.load(mm.numpy())


class ArrowbufSampler(Sampler):
    """A TorchRL sampler that delegates to the `ArrowbufStorage`'s own store sampler (arrowbuf's sum-tree
    `Prioritized`, uniform, ...): `sample` returns its items as storage positions with `priority_weight`
    (importance weights, max 1) when it has them; `update_priority` goes to `store.update_priorities`, so the
    priorities live in the store (a shared-memory store's processes share them; its checkpoints keep them)::

        storage = ArrowbufStorage(100_000, sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4))
        rb = TensorDictReplayBuffer(storage=storage, sampler=ArrowbufSampler(), batch_size=256)
        batch = rb.sample(); rb.update_priority(batch["index"], td_error)

    New rows enter with the store sampler's max priority. TorchRL's `update_tensordict_priority` acts only for a
    `PrioritizedSampler`: use `ArrowbufPrioritizedSampler` for that API, or call `update_priority` as above.
    """

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict[str, Any]]:
        batch, positions = storage.sample_store(batch_size)
        info: dict[str, Any] = {}
        if batch.weights is not None:
            info["priority_weight"] = torch.as_tensor(np.asarray(batch.weights, dtype=np.float32))
        return storage.index_of(positions), info

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        if storage is None or not hasattr(storage, "update_store_priorities"):
            raise InvalidArgument("ArrowbufSampler.update_priority needs its ArrowbufStorage (a replay buffer passes "
                                  "it as storage=)")
        prio = np.asarray(torch.as_tensor(priority).detach().reshape(-1).cpu(), dtype=np.float64)
        storage.update_store_priorities(index, prio)

    def _empty(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}  # the priorities live in the store: the storage's state_dict/dumps keep them

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def dumps(self, path: Any) -> None:
        pass

    def loads(self, path: Any) -> None:
        pass


__all__ = ["ArrowbufPrioritizedSampler", "ArrowbufSampler"]
