"""The host tier: arenas on the process heap (the default for a single process)."""

from __future__ import annotations

import numpy as np

from .base import Tier


class HostTier(Tier):
    """Arenas as plain numpy arrays; pages are touched lazily, on first write."""

    name = "host"

    def __init__(self) -> None:
        self._arenas: dict[str, np.ndarray] = {}

    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        arr = np.empty((rows, *shape), dtype=dtype)
        self._arenas[key] = arr
        return arr

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values())

    def close(self) -> None:
        self._arenas.clear()
