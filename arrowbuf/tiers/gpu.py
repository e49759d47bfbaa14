"""The GPU tier: a column's GPU-resident chunks as slots of one torch CUDA tensor per column.

Usage::

    store = ExperienceStore(schema, capacity, tiers={"gpu": "8GiB", "host": "16GiB", "disk": "spill/"})
    batch = store.sample(4096, columns=["obs", "action", "reward"])
    batch["obs"]            # a torch CUDA tensor when obs has GPU-resident chunks: gathered on the device
    store.to_cudf()         # scalar and metadata columns as a cuDF DataFrame

Needs the optional extra ``pip install 'arrowbuf[gpu]'`` (a CUDA build of torch, cupy, cudf) and a CUDA device;
torch, cupy and cudf are imported only when a GPU tier is made. Device memory cannot be over-committed like host
memory, so this tier is *slotted*: each column's arena holds a fixed number of chunk slots, and the store's slot table
maps a ring chunk to its local slot. A gather over the tier is one `index_select` on the device; data reaches the
device by copies of whole sealed chunks (migrations), never on the append path. Tensors cross to other libraries
through DLPack (`torch.utils.dlpack`, `cupy.from_dlpack`, `cudf.from_dlpack`); cuDF has no fixed-shape tensor type,
so tensor columns stay torch tensors and cuDF gets the scalar and metadata columns.

`device="cpu"` runs the same code on torch CPU tensors: the tests use it to exercise the slotted path without a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ..errors import MissingDependency, OutOfSpace
from .base import Tier, format_bytes, parse_bytes

# numpy dtypes torch has no (full) support for: stored as the signed type of the same width, delivered widened.
_SIGNED: dict[np.dtype, np.dtype] = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
           np.dtype(np.uint64): np.dtype(np.int64)}


def gpu_environment() -> str:
    """What this machine has for the GPU tier, in words (for error messages and benchmark logs)."""
    found = []
    try:
        torch = importlib.import_module("torch")
        cuda = getattr(torch.version, "cuda", None)
        if not cuda:
            found.append(f"torch {torch.__version__} (a CPU-only build)")
        elif not torch.cuda.is_available():
            found.append(f"torch {torch.__version__} (CUDA {cuda} build, but no CUDA device is visible)")
        else:
            found.append(f"torch {torch.__version__} with {torch.cuda.device_count()} CUDA device(s): "
                         f"{torch.cuda.get_device_name(0)}")
    except ImportError:
        found.append("torch not installed")
    for mod in ("cupy", "cudf"):
        try:
            m = importlib.import_module(mod)
            found.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception:  # cupy/cudf raise more than ImportError when CUDA is absent
            found.append(f"{mod} not installed")
    return ", ".join(found)


def require_torch_device(device: str) -> Any:
    """torch, checked to reach `device`; raises `MissingDependency` naming the extra and what was found."""
    hint = "pip install 'arrowbuf[gpu]' (a CUDA build of torch, cupy-cuda13x, cudf-cu13) on a machine with a GPU"
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        raise MissingDependency(f"the gpu tier needs torch with CUDA: {hint}; found: {gpu_environment()}") from exc
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise MissingDependency(f"the gpu tier needs a CUDA device: {hint}; found: {gpu_environment()}")
    return torch


class GpuTier(Tier):
    """Column arenas as torch tensors on a CUDA device (or `device="cpu"` for tests).

    Args:
        budget: bytes of device memory this tier may hold ("8GiB", an int, or None: no limit).
        device: the torch device ("cuda", "cuda:1", ...).

    Raises:
        MissingDependency: torch is missing or no CUDA device is visible; the message names `arrowbuf[gpu]` and what
            was found.
    """

    name = "gpu"
    slotted = True

    def __init__(self, budget: Any = None, device: str = "cuda") -> None:
        self.torch = require_torch_device(device)
        self.device = self.torch.device(device)
        self.budget = parse_bytes(budget)
        self._arenas: dict[str, Any] = {}
        self._dtypes: dict[str, np.dtype] = {}

    # ------------------------------------------------------------------ Tier
    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> Any:
        """A torch tensor [rows, *shape] on the device (unsigned 16/32/64-bit dtypes are stored as signed)."""
        dtype = np.dtype(dtype)
        store = _SIGNED.get(dtype, dtype)
        nbytes = int(rows) * store.itemsize * int(np.prod(shape, dtype=np.int64))
        if self.budget is not None and self.nbytes() + nbytes > self.budget:
            raise OutOfSpace(f"gpu tier: arena {key!r} needs {format_bytes(nbytes)}, {format_bytes(self.nbytes())} "
                             f"of the {format_bytes(self.budget)} budget are in use")
        t = self.torch.empty((int(rows), *shape), dtype=_torch_dtype(self.torch, store), device=self.device)
        self._arenas[key] = t
        self._dtypes[key] = dtype
        return t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._arenas.values())

    def close(self) -> None:
        self._arenas.clear()

    # ------------------------------------------------------------------ data movement (used by the column store)
    def put(self, arena: Any, start: int, values: np.ndarray) -> None:
        """Copy host rows into arena rows [start, start + len(values))."""
        src = self.torch.from_numpy(np.ascontiguousarray(_as_signed(values)))
        arena[start:start + len(values)].copy_(src)

    def get(self, arena: Any, start: int, stop: int, dtype: np.dtype) -> np.ndarray:
        """Arena rows [start, stop) as a host numpy array of `dtype`."""
        out = arena[start:stop].cpu().numpy()
        return out.view(dtype) if out.dtype != dtype else out

    def take(self, arena: Any, positions: np.ndarray, dtype: np.dtype) -> Any:
        """Rows at arena `positions`, gathered on the device: a device tensor (unsigned types widened to int64).

        One `index_select` over the arena's rows. (Measured on an H200: an atari frame column gathers at 0.89x a
        device copy of the same bytes this way; reading the rows as 8-byte words instead was slower, 0.63x.)"""
        idx = self.torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(self.device, non_blocking=True)
        return _widen(self.torch, arena.index_select(0, idx), dtype)

    def scatter(self, out: Any, rows: np.ndarray, part: Any) -> None:
        """`out[rows] = part` on the device, for `out` from `empty` and `part` in the representation `take` and
        `to_device` deliver (the rows of a batch that came from different tiers, put in their places)."""
        idx = self.torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(out.device, non_blocking=True)
        out.index_copy_(0, idx, part)

    def to_device(self, values: np.ndarray) -> Any:
        """A host array as a device tensor in the representation `take` delivers."""
        dtype = values.dtype
        t = self.torch.from_numpy(np.ascontiguousarray(_as_signed(values))).to(self.device)
        return _widen(self.torch, t, dtype)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An uninitialised device tensor of the representation `take` delivers for `dtype`."""
        if dtype in _SIGNED:
            return self.torch.empty(shape, dtype=self.torch.int64, device=self.device)
        return self.torch.empty(shape, dtype=_torch_dtype(self.torch, dtype), device=self.device)

    def __repr__(self) -> str:
        return f"GpuTier(device={str(self.device)!r}, arenas={len(self._arenas)}, bytes={self.nbytes()})"


def _as_signed(values: np.ndarray) -> np.ndarray:
    signed = _SIGNED.get(values.dtype)
    return values.view(signed) if signed is not None else values


def _widen(torch: Any, t: Any, dtype: np.dtype) -> Any:
    """Undo the signed storage of unsigned types: uint16/uint32 as exact int64 values, uint64 as its int64 bits."""
    if dtype == np.uint16:
        return t.to(torch.int64) & 0xFFFF
    if dtype == np.uint32:
        return t.to(torch.int64) & 0xFFFFFFFF
    return t


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def to_cudf(table: Any) -> Any:
    """A cuDF DataFrame of a table's scalar columns (cuDF has no fixed-shape tensor type)."""
    try:
        cudf = importlib.import_module("cudf")
    except Exception as exc:
        raise MissingDependency("store.to_cudf() needs cuDF: pip install 'arrowbuf[gpu]' on a machine with a GPU; "
                                f"found: {gpu_environment()}") from exc
    return cudf.DataFrame.from_arrow(table)
