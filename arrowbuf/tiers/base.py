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
from typing import Any

import numpy as np


class Tier(abc.ABC):
    """A place arenas live: host heap, shared memory, memory-mapped disk, GPU."""

    #: short name used in the chunk directory and in `store.placement()`.
    name: str = "tier"
    #: True when the memory is new (this process made it): the store initialises its arrays only then, so that a
    #: process attaching to a shared tier never resets what the others wrote.
    fresh: bool = True
    #: True when other processes use the same memory (their commits do not wake this process's condition variables).
    shared: bool = False

    @abc.abstractmethod
    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """Return a writable array of shape [rows, *shape] for `key` (contents undefined)."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held by this tier's arenas."""

    def lock(self, key: str) -> Any:
        """A lock guarding `key` among the users of this tier: a `threading.Lock` for in-process tiers, a
        cross-process lock (with acquire/release, usable by `threading.Condition`) for shared ones."""
        return threading.Lock()

    def reserve(self, nbytes: int) -> None:
        """Called once before a new store's allocations with the bytes they will take; tiers with a hard limit raise
        `OutOfSpace` here, before anything is written."""

    def seal(self, meta: dict[str, Any]) -> None:
        """The store over this tier is complete; a shared tier publishes `meta` so that other processes can attach."""

    def unlink(self) -> None:
        """Remove the tier's memory from the namespace other processes find it in (shared tiers); idempotent."""

    def close(self) -> None:
        """Release the tier's memory; idempotent."""

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
