"""The index forms TorchRL reads a storage with, resolved to flat element positions.

    pos, shape = resolve(index, dims)    # dims: the storage's current dims [len_along_dim0, *inner]

`pos` are flat positions (`np.ravel_multi_index` over the full storage dims, dim 0 counted in whole entries) and
`shape` the dims the result carries in front of each element's own batch dims (`()` for one element). The view
is TorchRL's: a storage that is not full reads as its first `len_along_dim0` entries, so `[:]`, `[-2:]`, `[::2]`
and a boolean mask over `len(rb)` entries mean what they mean on `LazyTensorStorage`.

Forms: an int (negative counts from the end), a slice (negative and stepped), an int tensor/array/list of any
shape, a boolean mask (over dim 0, or over several leading dims), a tuple of those (one per storage dim: what
multi-dimensional storages and `SliceSampler` pass), `Ellipsis` and `None`. An index past the storage's own dims
(into an element's batch dims) raises `NotImplementedError`: index the returned TensorDict instead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...errors import InvalidArgument


def _as_numpy(index: Any) -> Any:
    if isinstance(index, torch.Tensor):
        return index.detach().cpu().numpy()
    if isinstance(index, range):
        return np.arange(index.start, index.stop, index.step)
    if isinstance(index, list):
        return np.asarray([int(i) if isinstance(i, torch.Tensor) else i for i in index])
    return index


def _int_like(index: Any) -> bool:
    if isinstance(index, (bool, np.bool_)):
        return False
    if isinstance(index, (int, np.integer)):
        return True
    return isinstance(index, torch.Tensor) and index.ndim == 0 and not index.dtype.is_floating_point \
        and index.dtype != torch.bool


def resolve(index: Any, dims: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Flat positions and result dims of `index` over a storage view of `dims` (see the module doc).

    Raises:
        IndexError: an index out of range of the view (as torch raises).
        NotImplementedError: an index into an element's own batch dims.
    """
    inner = math.prod(dims[1:])
    length = dims[0]
    # fast paths: what samplers and writers pass
    if _int_like(index):
        i = int(index)
        j = i + length if i < 0 else i
        if not 0 <= j < length:
            raise IndexError(f"index {i} is out of range for a storage of {length} entries along dim 0")
        if inner == 1 and len(dims) == 1:
            return np.array([j], dtype=np.int64), ()
        return j * inner + np.arange(inner, dtype=np.int64), tuple(dims[1:])
    if len(dims) == 1 and isinstance(index, (torch.Tensor, np.ndarray, list, range)):
        arr = np.asarray(_as_numpy(index))
        if arr.dtype.kind in "iu" and arr.ndim >= 1:
            pos = arr.astype(np.int64, copy=True).reshape(-1)
            neg = pos < 0
            if neg.any():
                pos[neg] += length
            if pos.size and (pos.min() < 0 or pos.max() >= length):
                bad = arr.reshape(-1)[(pos < 0) | (pos >= length)][:4].tolist()
                raise IndexError(f"index {bad} is out of range for a storage of {length} entries")
            return pos, tuple(arr.shape)
        if arr.dtype.kind == "f" and arr.size == 0:  # an empty list
            return np.zeros(0, dtype=np.int64), tuple(arr.shape)
    # the general case: numpy's indexing of a grid of positions (same rules as torch's)
    idx: Any = tuple(_as_numpy(i) for i in index) if isinstance(index, tuple) else _as_numpy(index)
    parts = idx if isinstance(idx, tuple) else (idx,)
    used = sum(p.ndim if isinstance(p, np.ndarray) and p.dtype == np.bool_ else
               (0 if p is None or p is Ellipsis else 1) for p in parts)
    if used > len(dims):
        raise NotImplementedError(
            f"ArrowbufStorage: the index {index!r} reaches past the storage's {len(dims)} dim(s) into an element's "
            "own batch dims; index the storage's dims only and index the returned data for the rest")
    for p in parts:
        if isinstance(p, np.ndarray) and p.dtype.kind == "f":
            raise IndexError(f"tensors used as indices must be long, int, byte or bool tensors, got {p.dtype}")
        if not (p is None or p is Ellipsis or isinstance(p, (slice, np.ndarray, int, np.integer))):
            raise InvalidArgument(f"ArrowbufStorage cannot index with {type(p).__name__} ({p!r})")
    grid = np.arange(math.prod(dims), dtype=np.int64).reshape(dims)
    sel = grid[idx]
    return np.asarray(sel, dtype=np.int64).reshape(-1), tuple(np.shape(sel))
