"""The GPU tier: a store's columns in device memory, as a device ring (the whole ring mirrored) or as chunk slots.

Usage::

    store = ExperienceStore(schema, capacity, tiers={"gpu": "8GiB", "host": "16GiB", "disk": "spill/"})
    batch = store.sample(4096, columns=["obs", "action", "reward"])
    batch["obs"]            # a torch CUDA tensor: gathered on the device
    store.to_cudf()         # scalar and metadata columns as a cuDF DataFrame (a copy); device=True: views

Needs the optional extra ``pip install 'arrowbuf[gpu]'`` (a CUDA build of torch, cupy, cudf) and a CUDA device;
torch, cupy and cudf are imported only when a GPU tier is made. Two uses of the tier (`GpuTier(ring=...)`):

- the device ring (`arrowbuf.ring.device_ring`, docs/tiers.md): every mirrorable column's whole ring on the device,
  pulled from the host arenas at each sample; sampling, gathers and priority updates then run on the device with no
  host sync. The default on a CUDA device when the columns fit the budget.
- chunk slots: device memory cannot be over-committed like host memory, so each column's arena holds a fixed number
  of chunk slots, and the store's slot table maps a ring chunk to its local slot; data reaches the device by copies
  of whole sealed chunks (migrations, decided by the placement policy), never on the append path. A gather over the
  tier is one `index_select` on the device.

Tensors cross to other libraries through DLPack (`torch.utils.dlpack`, `cupy.from_dlpack`, `cudf.from_dlpack`) or
`__cuda_array_interface__` (`cudf_views`); cuDF has no fixed-shape tensor type, so tensor columns stay torch tensors
and cuDF gets the scalar and metadata columns. `Staging` feeds host-to-device copies through pinned memory without
waiting; `use_rmm_pool` puts torch and cuDF on one RMM pool.

`device="cpu"` runs the same code on torch CPU tensors: the tests use it to exercise both paths without a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ..errors import InvalidArgument, MissingDependency, OutOfSpace
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

    def __init__(self, budget: Any = None, device: str = "cuda", ring: bool | list[str] | None = None) -> None:
        self.torch = require_torch_device(device)
        self.device = self.torch.device(device)
        self.budget = parse_bytes(budget)
        if not (ring is None or isinstance(ring, bool) or (isinstance(ring, (list, tuple))
                                                            and all(isinstance(c, str) for c in ring))):
            raise InvalidArgument(f"GpuTier(ring=...) takes None (auto), True, False or a list of column names; "
                                  f"got {ring!r}")
        #: the device ring (`arrowbuf.ring.device_ring`): None: on a CUDA device when the columns fit the budget;
        #: True: always (`OutOfSpace` when the columns do not fit); False: never (chunk slots placed by the policy);
        #: a list: those columns.
        self.ring = list(ring) if isinstance(ring, (list, tuple)) else ring
        self._arenas: dict[str, Any] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._staging: Staging | None = None

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

    def free(self, key: str) -> None:
        """Give arena `key` back (its bytes leave `nbytes()`; tensors still referenced elsewhere stay valid)."""
        self._arenas.pop(key, None)
        self._dtypes.pop(key, None)

    def close(self) -> None:
        self._arenas.clear()
        self._staging = None

    @property
    def cuda(self) -> bool:
        """Whether the device is a CUDA device (streams, events, pinned memory and graphs apply)."""
        return bool(self.device.type == "cuda")

    @property
    def staging(self) -> Staging:
        """Host buffers that feed this tier's uploads without waiting (`Staging`), made on first use."""
        if self._staging is None:
            self._staging = Staging(self.torch, self.device)
        return self._staging

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


def torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    """The torch dtype this tier stores numpy `dtype` as (unsigned 16/32/64-bit as the signed type of the width)."""
    return _torch_dtype(torch, _SIGNED.get(np.dtype(dtype), np.dtype(dtype)))


def as_signed(values: np.ndarray) -> np.ndarray:
    """`values` as this tier stores them (unsigned 16/32/64-bit viewed as signed), no copy."""
    return _as_signed(values)


def widen(torch: Any, t: Any, dtype: np.dtype) -> Any:
    """A gathered tensor as this tier delivers numpy `dtype` (uint16/uint32 widened to int64 values)."""
    return _widen(torch, t, np.dtype(dtype))


def host_view(t: Any) -> np.ndarray:
    """A uint8 numpy view of a host (CPU, pinned or not) tensor's bytes, made from its address: the caller keeps `t`
    alive as long as the view. (Not `t.numpy()`: a view of host memory reads nothing from a device, and this keeps
    the sync-freedom tests' ban on `.numpy()` simple.)"""
    import ctypes

    nbytes = int(t.numel()) * int(t.element_size())
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(t.data_ptr())))


class Staging:
    """Host memory that feeds host-to-device copies without making the host wait.

    A copy from pageable host memory makes the host wait for the device (the driver stages it); from pinned memory it
    is queued and returns at once. So an upload goes through a pinned buffer: the host rows are copied into it (a
    memcpy), the device copy is queued on the current stream, and an event marks when the buffer may be reused.
    Buffers are kept and reused (a free one is one whose event has passed); past `limit` bytes of buffers, or for an
    upload larger than `big`, the copy is made the plain way (it waits), which only a bulk rebuild of the device ring
    does. On the CPU (`device="cpu"`, the tests) an upload is a plain copy.

    Attributes:
        waits: uploads that had to wait (a bulk copy, or every buffer still in flight).
        uploads: copies queued; bytes: bytes uploaded.
    """

    def __init__(self, torch: Any, device: Any, limit: int = 512 << 20, big: int = 64 << 20) -> None:
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.limit = int(limit)
        self.big = int(big)
        self._bufs: list[list[Any]] = []  # [pinned uint8 tensor, its numpy view, event or None]
        self.waits = 0
        self.uploads = 0
        self.bytes = 0

    def copy_into(self, dst: Any, values: np.ndarray) -> None:
        """`dst.copy_(values)` (shapes alike; `values` in the tier's storage dtype, see `as_signed`)."""
        values = np.ascontiguousarray(values)
        self.uploads += 1
        self.bytes += values.nbytes
        if not self.cuda:
            dst.copy_(self.torch.from_numpy(values))
            return
        if values.nbytes > self.big:  # a bulk rebuild: a blocking copy in pieces (no pinned buffer that large)
            self.waits += 1
            rows = max(1, self.big // max(1, values.nbytes // max(1, len(values))))
            flat_dst = dst.reshape(len(values), -1) if values.ndim > 1 else dst
            flat_src = values.reshape(len(values), -1) if values.ndim > 1 else values
            for i in range(0, len(values), rows):
                flat_dst[i:i + rows].copy_(self.torch.from_numpy(flat_src[i:i + rows]))
            return
        buf = self._take(values.nbytes)
        host = buf[1][:values.nbytes].view(values.dtype).reshape(values.shape)
        np.copyto(host, values)
        src = buf[0][:values.nbytes].view(torch_dtype(self.torch, values.dtype)).view(values.shape)
        dst.copy_(src, non_blocking=True)
        event = self.torch.cuda.Event()
        event.record(self.torch.cuda.current_stream(self.device))
        buf[2] = event

    def to_device(self, values: np.ndarray) -> Any:
        """A new device tensor holding `values` (queued, as `copy_into`)."""
        values = np.ascontiguousarray(values)
        out = self.torch.empty(values.shape, dtype=torch_dtype(self.torch, values.dtype), device=self.device)
        self.copy_into(out, _as_signed(values))
        return out

    def _take(self, nbytes: int) -> list[Any]:
        fits = sorted((b for b in self._bufs if b[0].shape[0] >= nbytes), key=lambda b: int(b[0].shape[0]))
        for buf in fits:
            if buf[2] is None or buf[2].query():
                buf[2] = None
                return buf
        if self._bufs and self.nbytes() + nbytes > self.limit:  # every buffer in flight, no room for more: wait
            self.waits += 1
            if fits:
                fits[0][2].synchronize()
                fits[0][2] = None
                return fits[0]
            for buf in self._bufs:
                if buf[2] is not None:
                    buf[2].synchronize()
            self._bufs.clear()
        size = 1 << max(16, (int(nbytes) - 1).bit_length())
        t = self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True)
        buf = [t, host_view(t), None]
        self._bufs.append(buf)
        return buf

    def nbytes(self) -> int:
        """Bytes of pinned host memory held."""
        return sum(int(b[0].shape[0]) for b in self._bufs)


def use_rmm_pool(budget: Any = None, device: int = 0) -> Any:
    """Make torch allocate device memory from an RMM pool, the pool cuDF uses too (one pool for both, at most `budget`
    bytes: a GPU tier's budget then bounds what torch and cuDF hold together). Call it once, before anything allocates
    CUDA memory in the process (torch cannot switch allocators afterwards). Returns the RMM memory resource.

    Raises:
        MissingDependency: RMM (or a CUDA build of torch, or a GPU) is missing: `pip install 'arrowbuf[gpu]'`.
        InvalidArgument: torch already allocated CUDA memory in this process.
    """
    torch = require_torch_device("cuda")
    try:
        rmm = importlib.import_module("rmm")
        rmm_torch = importlib.import_module("rmm.allocators.torch")
    except Exception as exc:
        raise MissingDependency("use_rmm_pool() needs RMM (it comes with cuDF): pip install 'arrowbuf[gpu]' on a "
                                f"machine with a GPU; found: {gpu_environment()}") from exc
    limit = parse_bytes(budget)
    pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), maximum_pool_size=limit)
    rmm.mr.set_per_device_resource(device, pool)
    try:
        torch.cuda.memory.change_current_allocator(rmm_torch.rmm_torch_allocator)
    except RuntimeError as exc:
        raise InvalidArgument("use_rmm_pool() must run before torch allocates CUDA memory in this process (torch "
                              f"cannot switch allocators afterwards): call it first thing; torch said: {exc}") from exc
    return pool


def _cudf() -> Any:
    try:
        return importlib.import_module("cudf")
    except Exception as exc:  # cuDF raises more than ImportError when CUDA is absent
        raise MissingDependency("store.to_cudf() needs cuDF: pip install 'arrowbuf[gpu]' (cudf-cu13) on a machine "
                                f"with a GPU; found: {gpu_environment()}") from exc


def to_cudf(table: Any) -> Any:
    """A cuDF DataFrame of a table's scalar columns (cuDF has no fixed-shape tensor type): a copy to the device."""
    return _cudf().DataFrame.from_arrow(table)


def cudf_views(columns: dict[str, Any]) -> Any:
    """A cuDF DataFrame whose columns are views of 1-D device tensors (read through `__cuda_array_interface__`, no
    copy): what `store.to_cudf(device=True)` returns.

    Raises:
        MissingDependency: cuDF is not installed (or no GPU).
        InvalidArgument: a column is not a CUDA tensor.
    """
    cudf = _cudf()
    data = {}
    for name, t in columns.items():
        if not getattr(t, "is_cuda", False):
            raise InvalidArgument(f"to_cudf(device=True): column {name!r} is not in CUDA memory (a store whose device "
                                  "ring is on the CPU, as in tests, has nothing cuDF can view)")
        data[name] = _cudf_column(cudf, t)
    return cudf.DataFrame._from_data(data) if hasattr(cudf.DataFrame, "_from_data") else cudf.DataFrame(data)


def _cudf_column(cudf: Any, t: Any) -> Any:
    """A cuDF column over tensor `t`'s memory (zero-copy through `__cuda_array_interface__`)."""
    try:
        from cudf.core.column import as_column

        return as_column(t)
    except Exception:  # an older or newer cuDF without that entry point: a Series over the interface
        return cudf.Series(t)._column
