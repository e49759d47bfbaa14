"""The memory-tier interface: where the arenas of a store's columns live.

A tier hands out arenas: one writable numpy array per (column, tier) holding that column's resident chunks as slots,
so a gather over a tier is one `take`. Usage::

    with HostTier() as tier:
        arena = tier.allocate("obs", np.uint8, rows=4096, shape=(4, 84, 84))
        arena[0:10] = batch["obs"]
        tier.nbytes()   # bytes held
"""

from __future__ import annotations

import abc
import threading

import numpy as np


class Tier(abc.ABC):
    """A place arenas live: host heap, shared memory, memory-mapped disk, GPU."""

    #: short name used in the chunk directory and in `store.placement()`.
    name: str = "tier"

    @abc.abstractmethod
    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """Return a writable array of shape [rows, *shape] for `key` (contents undefined)."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held by this tier's arenas."""

    def lock(self, key: str) -> threading.Lock:
        """A lock guarding `key` among the users of this tier (a thread lock for in-process tiers)."""
        return threading.Lock()

    def close(self) -> None:
        """Release the tier's memory; idempotent."""

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
