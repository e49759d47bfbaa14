"""SampleBatch: what `store.sample` returns.

Usage::

    batch = store.sample(256)
    batch.indices            # int64 ids naming the sampled rows (for update_priorities)
    batch.weights            # importance-sampling weights (max 1) or None
    batch.to_numpy()         # {"obs": uint8[256, 4, 84, 84], ...}; [B, T, ...] for sequences
    batch.to_torch("cpu")    # the same as torch tensors (zero-copy on the CPU)
    batch.data               # pa.RecordBatch (tensor columns are fixed_shape_tensor)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from .errors import InvalidArgument, require


def _is_tensor(values: Any) -> bool:
    """A torch tensor (what a GPU tier delivers), recognised without importing torch."""
    return type(values).__module__.startswith("torch")


def _host(values: Any) -> Any:
    """numpy for a torch tensor (copied from the device), anything else unchanged."""
    return values.detach().cpu().numpy() if _is_tensor(values) else values


def _to_arrow(values: Any) -> pa.Array:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    values = _host(values)
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(values))


class SampleBatch:
    """A sampled batch: columns, the ids of their rows and importance weights.

    Attributes:
        indices: int64 ids of the sampled items (for sequences: the id of each window's first row).
        weights: float32 importance-sampling weights normalised to max 1, or None for samplers without them.
        columns: the names of the columns, in order.
    """

    __slots__ = ("_arrays", "indices", "weights", "columns", "_data", "info")

    def __init__(self, arrays: dict[str, Any], indices: np.ndarray, weights: np.ndarray | None = None,
                 info: dict[str, Any] | None = None) -> None:
        self._arrays = arrays
        self.indices = indices
        self.weights = weights
        self.columns = list(arrays)
        self._data: pa.RecordBatch | None = None
        self.info = info or {}

    def __len__(self) -> int:
        return len(self.indices)

    @classmethod
    def concat(cls, parts: list["SampleBatch"], info: dict[str, Any] | None = None) -> "SampleBatch":
        """The rows of `parts` (batches of the same columns) in order, as one batch.

        Weights are kept as each part had them (None unless every part has weights); `info` defaults to the first
        part's.
        """
        if not parts:
            raise InvalidArgument("SampleBatch.concat needs at least one batch; got an empty list")
        arrays: dict[str, Any] = {}
        for c in parts[0].columns:
            vals = [p[c] for p in parts]
            if isinstance(vals[0], (pa.Array, pa.ChunkedArray)):
                arrays[c] = pa.concat_arrays([v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v
                                              for v in vals])
            elif _is_tensor(vals[0]):
                arrays[c] = require("torch", "torch").cat(vals)
            else:
                arrays[c] = np.concatenate(vals)
        weights = None
        if all(p.weights is not None for p in parts):
            weights = np.concatenate([p.weights for p in parts])
        return cls(arrays, np.concatenate([p.indices for p in parts]), weights,
                   parts[0].info if info is None else info)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {getattr(v, 'shape', len(v))}" for k, v in self._arrays.items())
        return f"SampleBatch(n={len(self)}, {shapes}, weights={'yes' if self.weights is not None else 'no'})"

    def __getitem__(self, name: str) -> Any:
        return self._arrays[name]

    @property
    def data(self) -> pa.RecordBatch:
        """The batch as a `pa.RecordBatch` (built on first use, zero-copy over the gathered arrays)."""
        if self._data is None:
            self._data = pa.RecordBatch.from_arrays([_to_arrow(v) for v in self._arrays.values()],
                                                    names=self.columns)
        return self._data

    def to_numpy(self) -> dict[str, Any]:
        """Columns as numpy arrays shaped [B, *shape] ([B, T, *shape] for sequences); ragged columns as lists."""
        out: dict[str, Any] = {}
        for k, v in self._arrays.items():
            if isinstance(v, (pa.Array, pa.ChunkedArray)):
                out[k] = [np.asarray(x) if x is not None else None for x in v.to_pylist()]
            else:
                out[k] = _host(v)
        return out

    def to_torch(self, device: str | Any = "cpu", non_blocking: bool = False) -> dict[str, Any]:
        """Columns as torch tensors on `device` (zero-copy on the CPU where the dtype allows).

        Ragged columns come back as lists of 1-D tensors; columns gathered on a GPU tier are already device tensors
        and move only if `device` differs. Needs `pip install 'arrowbuf[torch]'`.
        """
        torch = require("torch", "torch")
        out: dict[str, Any] = {}
        for k, v in self._arrays.items():
            if _is_tensor(v):
                out[k] = v.to(device, non_blocking=non_blocking)
                continue
            if isinstance(v, (pa.Array, pa.ChunkedArray)):
                v = [np.asarray(x) if x is not None else None for x in v.to_pylist()]
            if isinstance(v, list):
                out[k] = [torch.as_tensor(x).to(device) for x in v]
                continue
            if v.dtype in (np.uint16, np.uint32, np.uint64):
                v = v.astype(np.int64)
            if not v.flags.writeable:
                v = v.copy()  # a read-only mapping must not reach torch as a writable tensor
            t = torch.from_numpy(v)
            out[k] = t.to(device, non_blocking=non_blocking) if str(device) != "cpu" else t
        return out


__all__ = ["SampleBatch"]
