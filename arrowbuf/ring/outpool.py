"""A bounded pool of reusable output arrays for gathers, safe against callers who keep a batch.

A gather of large rows into a fresh array pays for fresh memory: the kernel maps and zeroes every page on first touch.
For atari batches (two 256 x 28 KB frame-stack columns per sample, 14.5 MB) that costs more than the gather itself:
when two such outputs are freed, glibc hands the memory back to the kernel, so every sample faults the same pages in
again (measured: about 940 page faults and 3.4 ms of system time per atari PER sample + update, against 0.6 ms for
the copies; one 7.2 MB output alone was reused by malloc, and `MALLOC_MMAP_THRESHOLD_=100000000` also avoids it).
`OutputPool` keeps the output arrays and hands one out again once nobody else holds it.

Safety rule: an array is reused only when the pool's own reference is the only one left. Everything that can read or
write an array's memory holds a reference to the array object itself: a numpy view (its `base`, numpy collapses
chains of views to the owner), `torch.from_numpy` and DLPack tensors, Arrow buffers made from it
(`pa.array`, `FixedShapeTensorArray.from_numpy_ndarray`), memoryviews, `np.frombuffer`. So a batch, or any view or
tensor of it that a caller keeps, keeps its array out of the pool, and a kept batch is never overwritten. (A raw
pointer, e.g. `arr.ctypes.data` kept after the array is dropped, or a weak reference, does not count: do not keep
those instead of the array.) The reference count is compared with what an idle array in the pool shows, measured
once at import through the same code path (`_IDLE`), so the rule does not depend on CPython's counting details.

Bounds: at most `max_bytes` of arrays are tracked (busy or idle), at most `per_shape` arrays of one shape, dtype and
tag (the reader tags each array with its column); arrays under `min_bytes` are never pooled (malloc reuses small blocks
without faults). When a new array does not fit, idle arrays of other shapes are dropped (least recently used shape
first); if it still does not fit, the caller gets a fresh array the pool does not track. So the pool never holds more
than `max_bytes`, and a caller that keeps every batch just gets fresh arrays.

Usage (what `arrowbuf.engine.reader.StoreReader` does)::

    pool = OutputPool()
    out = pool.empty((256, 4, 84, 84), np.uint8)     # a reused array when one is idle, else a new one
    take_into(arena, positions, out)                 # np.take into it, bounds checked
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["OutputPool", "take_into", "DEFAULT_MAX_BYTES", "MIN_BYTES", "PER_SHAPE"]

#: Bytes of arrays one pool tracks at most (busy or idle): an atari batch of 4096 is 2 x 115 MB, and a learner loop
#: holds the previous batch while the next is gathered, so 4 arrays of that size fit.
DEFAULT_MAX_BYTES = 512 << 20

#: Arrays smaller than this are not pooled: malloc reuses small blocks without page faults.
MIN_BYTES = 64 << 10

#: Arrays of one shape and dtype at most: the batch being gathered, the caller's previous batch, and a few prefetched
#: or kept ones. More outstanding batches get fresh arrays.
PER_SHAPE = 4


def _refs(arrays: list[np.ndarray], i: int) -> int:
    """The reference count of `arrays[i]` as seen from here (the list's reference included)."""
    return sys.getrefcount(arrays[i])


#: What `_refs` shows for an array that only the pool's list holds.
_IDLE = _refs([np.empty(1)], 0)


class OutputPool:
    """Reusable output arrays, bounded in bytes, reused only when nothing outside the pool references them.

    See the module docstring for the safety rule and the bounds. Thread-safe.

    Args:
        max_bytes: bytes of arrays tracked at most (0 turns pooling off).
        min_bytes: smaller arrays are always fresh.
        per_shape: arrays of one shape and dtype at most.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, min_bytes: int = MIN_BYTES,
                 per_shape: int = PER_SHAPE) -> None:
        self.max_bytes = int(max_bytes)
        self.min_bytes = int(min_bytes)
        self.per_shape = int(per_shape)
        self._lock = threading.Lock()
        # ordered: least recently used first
        self._arrays: dict[tuple[tuple[int, ...], str, str], list[np.ndarray]] = {}
        self._bytes = 0
        self.hits = 0  # an idle array handed out again
        self.misses = 0  # a new array allocated and tracked
        self.fresh = 0  # a new array not tracked (too small, too big, over a bound)

    def empty(self, shape: tuple[int, ...], dtype: Any, tag: str = "") -> np.ndarray:
        """An uninitialised C-contiguous array of `shape` and `dtype` that no one else holds: reused when possible.

        `tag` (a column name) keeps arrays apart in the pool: `per_shape` bounds the arrays of one (shape, dtype,
        tag), so a batch of many columns of one shape (nine [B, 8192] float32 fields) reuses one array per column
        rather than `per_shape` arrays among all of them. The caller owns it until it drops every reference to it
        (and to its views); write all of it before use.
        """
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            self.fresh += 1
            return np.empty(shape, dtype)
        key = (shape, dtype.str, tag)
        with self._lock:
            arrays = self._arrays.pop(key, [])
            self._arrays[key] = arrays  # most recently used last
            for i in range(len(arrays)):
                if _refs(arrays, i) == _IDLE:
                    self.hits += 1
                    return arrays[i]
            if len(arrays) < self.per_shape and self._make_room(nbytes, key):
                out = np.empty(shape, dtype)
                arrays.append(out)
                self._bytes += nbytes
                self.misses += 1
                return out
            if not arrays:
                del self._arrays[key]
        self.fresh += 1
        return np.empty(shape, dtype)

    def at_least(self, count: int, dtype: Any, tag: str = "") -> np.ndarray:
        """The first `count` elements of a 1-D array no one else holds (a view): for outputs whose size changes
        from call to call (a ragged gather's values). Reuses the smallest idle array of `dtype` and `tag` with at
        least `count` elements; a new one is rounded up to a size class (at most 1/8 more), so batches of about the
        same size share arrays. The same bounds and safety rule as `empty` (the view holds the array)."""
        dtype = np.dtype(dtype)
        count = int(count)
        step = 1 << max(0, count.bit_length() - 4)
        size = -(-max(1, count) // step) * step  # the size class: <= 1/8 over count
        nbytes = size * dtype.itemsize
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            self.fresh += 1
            return np.empty(count, dtype)
        key = ((-1,), dtype.str, tag)
        with self._lock:
            arrays = self._arrays.pop(key, [])
            self._arrays[key] = arrays  # most recently used last
            idle = [i for i in range(len(arrays)) if _refs(arrays, i) == _IDLE]
            fits = [i for i in idle if len(arrays[i]) >= count]
            if fits:
                self.hits += 1
                return arrays[min(fits, key=lambda i: len(arrays[i]))][:count]
            if len(arrays) >= self.per_shape and idle:  # full: an idle array too small for this makes way
                i = min(idle, key=lambda i: len(arrays[i]))
                self._bytes -= arrays[i].nbytes
                del arrays[i]
            if len(arrays) < self.per_shape and self._make_room(nbytes, key):
                out = np.empty(size, dtype)
                arrays.append(out)
                self._bytes += nbytes
                self.misses += 1
                return out[:count]
            if not arrays:
                del self._arrays[key]
        self.fresh += 1
        return np.empty(count, dtype)

    def _make_room(self, nbytes: int, keep: tuple[tuple[int, ...], str, str]) -> bool:
        """Drop idle arrays of other shapes, least recently used first, until `nbytes` more fit (under the lock)."""
        for key in list(self._arrays):
            if self._bytes + nbytes <= self.max_bytes:
                break
            if key == keep:
                continue
            arrays = self._arrays[key]
            for i in range(len(arrays) - 1, -1, -1):
                if _refs(arrays, i) == _IDLE:
                    self._bytes -= arrays[i].nbytes
                    del arrays[i]
            if not arrays:
                del self._arrays[key]
        return self._bytes + nbytes <= self.max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the pool tracks (busy or idle); never above `max_bytes`."""
        return self._bytes

    def clear(self) -> None:
        """Forget every array (busy ones stay valid for their holders; they are just not reused)."""
        with self._lock:
            self._arrays.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        """Arrays and bytes tracked, the bound, and how many requests were hits, new tracked arrays, fresh ones."""
        with self._lock:
            idle = sum(_refs(a, i) == _IDLE for a in self._arrays.values() for i in range(len(a)))
            count = sum(len(a) for a in self._arrays.values())
        return {"arrays": count, "idle": int(idle), "bytes": self._bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "fresh": self.fresh}


#: At most this many runs of consecutive positions are copied run by run (one memcpy each); more go through `take`.
MAX_RUNS = 16


def take_into(arena: np.ndarray, positions: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`np.take(arena, positions, axis=0)` written into `out` (shaped `[len(positions), *arena.shape[1:]]`).

    Positions in a few runs of consecutive rows (a FIFO or a consume: the rows just written, one run or two where
    the ring wraps) are copied run by run, one memcpy each: numpy's `take` moves rows about 4x slower than a slice
    copy here. Otherwise numpy buffers `take(..., out=)` through a temporary in its default mode, which would bring
    back the fresh memory the pool avoids; `mode="clip"` writes straight into `out`. Clipping would silently read a
    wrong row for a position out of range, so positions are checked first (one reduction), and anything out of
    range, negative included, goes through plain `np.take` with its usual semantics (an IndexError, or numpy's wrap
    of negatives).
    """
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    if pos.size and pos.view(np.uint64).max() >= arena.shape[0]:  # negatives are huge as uint64
        out[...] = np.take(arena, pos, axis=0)
        return out
    runs = _runs(pos)
    if runs is not None:
        for start, stop in runs:
            np.copyto(out[start:stop], arena[pos[start]:pos[start] + stop - start])
        return out
    return np.take(arena, pos, axis=0, out=out, mode="clip")


def _runs(pos: np.ndarray) -> list[tuple[int, int]] | None:
    """[(start, stop), ...] of the runs of consecutive values in `pos` (indices into `pos`), or None when there are
    more than `MAX_RUNS` (or fewer than 2 positions: nothing to gain)."""
    if pos.size < 2:
        return None
    breaks = np.flatnonzero(np.diff(pos) != 1)
    if breaks.size >= MAX_RUNS:
        return None
    edges = [0, *(breaks + 1).tolist(), int(pos.size)]
    return list(zip(edges[:-1], edges[1:]))
