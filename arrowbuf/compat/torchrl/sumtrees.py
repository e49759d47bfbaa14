"""TorchRL's segment trees (the C++ `SumSegmentTreeFp32`, `MinSegmentTreeFp32`, ... of `torchrl._torchrl`) on
arrowbuf's vectorised sum and min trees (`arrowbuf.samplers.sumtree`).

torchrl 0.14.1's C++ extension does not load against torch 2.13, and without it TorchRL's `PrioritizedSampler`
(so `PrioritizedReplayBuffer`, `TensorDictPrioritizedReplayBuffer`, `PrioritizedSliceSampler`) cannot be built.
These classes have the interface that sampler calls (`tree[i]`, `tree[i] = p`, `query(lo, hi)`,
`scan_lower_bound(mass)`), so:

    from arrowbuf.compat.torchrl import use_arrowbuf_sum_trees
    use_arrowbuf_sum_trees()        # True: TorchRL's missing trees are now these; False: its own C++ trees loaded
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=ArrowbufStorage(100_000), ...)

`use_arrowbuf_sum_trees` only fills names the extension left empty (it never replaces a loaded C++ tree), and is
opt-in: importing arrowbuf changes nothing in TorchRL. `ArrowbufPrioritizedSampler` uses these trees without it.
The trees live on the CPU; values are kept in float64 and read back in the tree's dtype (Fp32: float32).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...samplers.sumtree import MinTree, SumTree


def _index_array(index: Any) -> np.ndarray:
    if isinstance(index, torch.Tensor):
        return index.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(index, dtype=np.int64)


class _SegmentTree:
    """The C++ segment tree interface over an arrowbuf tree."""

    _tree_cls: type[SumTree] | type[MinTree] = SumTree
    _dtype = torch.float32

    def __init__(self, capacity: int, dtype: torch.dtype | None = None) -> None:
        self.tree = self._tree_cls(int(capacity))
        self.dtype = dtype or self._dtype
        self.hi = 0  # one past the highest slot ever set: a query over [0, >= hi) reads the whole tree

    def __len__(self) -> int:
        return self.tree.capacity

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            return float(self.tree.get(np.array([int(index)]))[0])
        return torch.as_tensor(self.tree.get(_index_array(index)), dtype=self.dtype)

    def __setitem__(self, index: Any, value: Any) -> None:
        idx = _index_array(index).reshape(-1)
        if idx.size == 0:
            return
        vals = value.detach().cpu().double().numpy() if isinstance(value, torch.Tensor) else np.asarray(value, float)
        vals = np.broadcast_to(vals.reshape(-1) if vals.size != 1 else vals.reshape(()), idx.shape)
        self.tree.update(idx, np.ascontiguousarray(vals, dtype=np.float64))
        self.hi = max(self.hi, int(idx.max()) + 1)

    def __getstate__(self) -> dict[str, Any]:  # TorchRL's state_dict deep-copies its trees
        return {"capacity": self.tree.capacity, "dtype": self.dtype, "values": self.values()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tree = self._tree_cls(int(state["capacity"]))
        self.dtype = state["dtype"]
        self.load(state["values"])

    def _whole(self, lo: int, hi: int) -> bool:
        return lo <= 0 and hi >= self.hi

    def values(self) -> np.ndarray:
        """Every slot's value (float64)."""
        return self.tree.get(np.arange(self.tree.capacity))

    def load(self, values: np.ndarray) -> None:
        """Set every slot's value (as `values()` gave them)."""
        self.tree.clear()
        values = np.asarray(values, dtype=np.float64)
        written = np.flatnonzero(values != self._neutral())
        if written.size:
            self.tree.update(written, values[written])
        self.hi = int(written.max()) + 1 if written.size else 0

    def _neutral(self) -> float:
        return 0.0


class SumSegmentTree(_SegmentTree):
    """`SumSegmentTreeFp32`'s interface: `query(lo, hi)` is the sum over [lo, hi)."""

    _tree_cls = SumTree

    def query(self, lo: Any, hi: Any) -> float:
        lo, hi = int(lo), int(hi)
        if self._whole(lo, hi):
            return self.tree.total()  # type: ignore[union-attr]
        return float(self.tree.get(np.arange(lo, hi)).sum())

    def scan_lower_bound(self, mass: Any) -> np.ndarray:
        """For each mass, the smallest slot whose prefix sum (inclusive) exceeds it."""
        m = mass.detach().cpu().double().numpy() if isinstance(mass, torch.Tensor) else np.asarray(mass, float)
        return self.tree.find_prefixsum(m)  # type: ignore[union-attr]


class MinSegmentTree(_SegmentTree):
    """`MinSegmentTreeFp32`'s interface: `query(lo, hi)` is the minimum over [lo, hi) (inf when empty)."""

    _tree_cls = MinTree

    def _neutral(self) -> float:
        return math.inf

    def query(self, lo: Any, hi: Any) -> float:
        lo, hi = int(lo), int(hi)
        if self._whole(lo, hi):
            return self.tree.min()  # type: ignore[union-attr]
        return float(self.tree.get(np.arange(lo, hi)).min()) if hi > lo else math.inf


class SumSegmentTreeFp32(SumSegmentTree):
    _dtype = torch.float32


class SumSegmentTreeFp64(SumSegmentTree):
    _dtype = torch.float64


class MinSegmentTreeFp32(MinSegmentTree):
    _dtype = torch.float32


class MinSegmentTreeFp64(MinSegmentTree):
    _dtype = torch.float64


_NAMES = {"SumSegmentTreeFp32": SumSegmentTreeFp32, "SumSegmentTreeFp64": SumSegmentTreeFp64,
          "MinSegmentTreeFp32": MinSegmentTreeFp32, "MinSegmentTreeFp64": MinSegmentTreeFp64}


def use_arrowbuf_sum_trees() -> bool:
    """Give TorchRL's `PrioritizedSampler` these trees where its C++ extension did not load (see the module doc).

    Returns:
        True if TorchRL now uses arrowbuf's trees; False if its own C++ trees are loaded (nothing changed).
    """
    from torchrl.data.replay_buffers import samplers
    from torchrl.data.replay_buffers.samplers import prioritized

    if all(getattr(prioritized, name) is ours for name, ours in _NAMES.items()):
        return True
    if any(getattr(prioritized, name) is not None for name in _NAMES):
        return False
    for name, ours in _NAMES.items():
        setattr(prioritized, name, ours)
        setattr(samplers, name, ours)
    return True


__all__ = ["MinSegmentTree", "MinSegmentTreeFp32", "MinSegmentTreeFp64", "SumSegmentTree", "SumSegmentTreeFp32",
           "SumSegmentTreeFp64", "use_arrowbuf_sum_trees"]
