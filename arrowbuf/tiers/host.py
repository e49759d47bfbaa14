"""The host tier: arenas on the process heap (the default for a single process).

Dense arenas (`allocate`) are plain numpy arrays. Sparse arenas (`allocate_sparse`, what a tiered store uses for its
host-resident chunks) are anonymous mappings of the whole ring whose pages are accounted per row range: `hold`
counts the pages a range covers before it is written, `release` gives them back to the kernel (MADV_DONTNEED), so
`nbytes()` is exact to the page and stays within `budget` however chunks come and go. Transparent huge pages are
disabled on them (a huge page would commit 2 MiB behind one written row).

Dense arenas of a ring that fits in RAM get their pages prepared ahead of the write head by a background thread
(`prepare_pages`, `arrowbuf.tiers.prefault.PagePreparer`), so a first fill does not stop at every fresh page;
`HostTier(prefault=False)` turns it off. Sparse arenas (rings bigger than RAM) are never prepared.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

from .base import ByteSize, Tier, parse_bytes
from .prefault import DEFAULT_WINDOW, MIN_RING_BYTES, PagePreparer, fits_in_ram

PAGE = mmap.PAGESIZE
# Reserve no swap for the whole mapping: a sparse arena spans the whole ring (more than RAM for a store that spills)
# but only the held pages are ever written. Python < 3.13 lacks the constant; 0x4000 is its value on Linux.
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class _SparseArena:
    """An anonymous mapping with a reference count per page of the ranges held in it."""

    def __init__(self, dtype: np.dtype, rows: int, shape: tuple[int, ...]) -> None:
        self.row_bytes = int(np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)))
        nbytes = rows * self.row_bytes
        self.map = mmap.mmap(-1, max(nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        self.array = np.frombuffer(self.map, dtype=np.uint8, count=nbytes).view(dtype).reshape(rows, *shape)
        self.refs = np.zeros(-(-max(nbytes, 1) // PAGE), dtype=np.int32)
        self.held_pages = 0

    def pages(self, start: int, stop: int) -> tuple[int, int]:
        return (start * self.row_bytes) // PAGE, -(-(stop * self.row_bytes) // PAGE)

    def cost(self, start: int, stop: int) -> int:
        p0, p1 = self.pages(start, stop)
        return int(np.count_nonzero(self.refs[p0:p1] == 0)) * PAGE

    def hold(self, start: int, stop: int, chunk: int | None = None) -> int:
        if chunk is None or stop - start <= chunk:
            p0, p1 = self.pages(start, stop)
            refs = self.refs[p0:p1]
            new = int(np.count_nonzero(refs == 0))
            refs += 1
        else:  # one reference per chunk on every page the chunk touches (a difference array: no loop over chunks)
            bounds = np.arange(start, stop + chunk, chunk, dtype=np.int64)
            bounds[-1] = min(bounds[-1], stop)
            b = bounds * self.row_bytes
            first, last = b[:-1] // PAGE, -(-b[1:] // PAGE)
            diff = np.zeros(len(self.refs) + 1, dtype=np.int64)
            np.add.at(diff, first, 1)
            np.add.at(diff, last, -1)
            inc = np.cumsum(diff[:-1]).astype(np.int32)
            new = int(np.count_nonzero((self.refs == 0) & (inc > 0)))
            self.refs += inc
        self.held_pages += new
        return new * PAGE

    def release(self, start: int, stop: int) -> int:
        p0, p1 = self.pages(start, stop)
        refs = self.refs[p0:p1]
        if (refs <= 0).any():
            raise RuntimeError(f"release of rows [{start}, {stop}) that are not held")
        refs -= 1
        free = np.flatnonzero(refs == 0)
        if len(free):  # runs of pages nobody holds any more go back to the kernel
            breaks = np.flatnonzero(np.diff(free) != 1)
            starts = np.concatenate([[free[0]], free[breaks + 1]])
            stops = np.concatenate([free[breaks], [free[-1]]]) + 1
            for a, b in zip(starts.tolist(), stops.tolist()):
                self.map.madvise(mmap.MADV_DONTNEED, (p0 + a) * PAGE, (b - a) * PAGE)
        self.held_pages -= len(free)
        return len(free) * PAGE


class HostTier(Tier):
    """Arenas as plain numpy arrays; pages are touched lazily, on first write.

    Args:
        budget: bytes this tier may hold in a tiered store ("16GiB", an int, or None for no limit).
        prefault: prepare the pages of a store's ring ahead of its write head (`prepare_pages`) when the ring fits
            in RAM; False: never (pages then fault in the writer, on first write).
        prefault_window: bytes prepared ahead of the head ("256MiB", an int).
    """

    growable = True

    name = "host"

    def __init__(self, budget: ByteSize = None, *, prefault: bool = True,
                 prefault_window: ByteSize = DEFAULT_WINDOW) -> None:
        self.budget = parse_bytes(budget)
        self.prefault = bool(prefault)
        self.prefault_window = parse_bytes(prefault_window) or DEFAULT_WINDOW
        self.preparers: list[PagePreparer] = []
        self.prefault_off: str | None = None  # why the last `prepare_pages` made no preparer
        self._arenas: dict[str, np.ndarray] = {}
        self._sparse: dict[str, _SparseArena] = {}

    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        arr = np.empty((rows, *shape), dtype=dtype)
        self._arenas[key] = arr
        return arr

    def prepare_pages(self, keys: list[str], ring_rows: int, name: str = "") -> PagePreparer | None:
        """Start preparing the pages of dense arenas `keys` (their first `ring_rows` rows, ring positions) ahead of
        the write head, if on and the ring fits in RAM; the caller passes the head on (`PagePreparer.advance`)."""
        arenas = [self._arenas[k] for k in keys if k in self._arenas]
        ring = sum(int(a.strides[0]) * min(ring_rows, len(a)) for a in arenas)
        self.prefault_off = ("off (HostTier(prefault=False))" if not self.prefault
                             else f"ring of {ring} bytes < {MIN_RING_BYTES}" if ring < MIN_RING_BYTES
                             else "ring does not fit in MemAvailable" if not fits_in_ram(ring, self.prefault_window)
                             else None)
        if self.prefault_off is not None:
            return None
        prep = PagePreparer(arenas, ring_rows, self.prefault_window, name=name)
        self.preparers.append(prep)
        return prep

    def allocate_sparse(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        arena = _SparseArena(np.dtype(dtype), rows, tuple(shape))
        self._sparse[key] = arena
        return arena.array

    def hold_cost(self, key: str, start: int, stop: int) -> int:
        return self._sparse[key].cost(start, stop)

    def hold(self, key: str, start: int, stop: int, chunk: int | None = None) -> int:
        return self._sparse[key].hold(start, stop, chunk)

    def release(self, key: str, start: int, stop: int) -> int:
        return self._sparse[key].release(start, stop)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values()) + sum(s.held_pages * PAGE for s in self._sparse.values())

    def address_range(self, key: str) -> tuple[int, int]:
        """(start address, bytes) of arena `key` (a sparse arena: its mapping; tests compare it with /proc/self/smaps
        or ask `mincore` which pages are resident)."""
        if key in self._arenas:
            return self._arenas[key].ctypes.data, self._arenas[key].nbytes
        arr = self._sparse[key].array
        return arr.ctypes.data, len(self._sparse[key].map)

    def close(self) -> None:
        for prep in self.preparers:
            prep.close()
        self.preparers.clear()
        self._arenas.clear()
        self._sparse.clear()  # the mappings are unmapped when the last view of them goes
