"""The memory-tier interface: where the arenas of a store's columns live.

A tier hands out arenas: one writable array per (column, tier) holding that column's resident chunks, so a gather
over a tier is one `take`. Usage::

    with HostTier() as tier:
        arena = tier.allocate("obs", np.uint8, rows=4096, shape=(4, 84, 84))
        arena[0:10] = batch["obs"]
        tier.nbytes()   # bytes held

For a store with several tiers (`ExperienceStore(tiers=...)`, see `arrowbuf.ring.columns`): a tier has a byte `budget`;
a non-slotted tier (host, disk) hands out `allocate_sparse` arenas spanning the whole ring, whose memory is
accounted per row range (`hold`, `release`); a `slotted` tier (GPU) holds a fixed number of chunk slots per column.
Implementations: `HostTier`, `SharedMemoryTier` (tiers/shm/), `DiskTier` (memory-mapped Arrow IPC files),
`GpuTier` (torch CUDA tensors; imports torch only when made).
"""

from __future__ import annotations

import abc
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

from ..errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from .prefault import PagePreparer

#: A byte size as the tiers take it: an int, a string such as "8GiB" or "512MiB", or None (no limit); `parse_bytes`.
ByteSize: TypeAlias = "int | np.integer | str | None"


class TierLock(Protocol):
    """What `Tier.lock` returns: a `threading.Lock` in one process, a cross-process robust mutex or file lock
    (`arrowbuf.tiers.shm.locks`) for a shared tier. A store holds it as `with lock:` and builds its
    `threading.Condition` over it."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
                 /) -> None: ...


class Tier(abc.ABC):
    """A place arenas live: host heap, shared memory, memory-mapped disk, GPU."""

    #: short name used in the chunk directory and in `store.placement()`.
    name: str = "tier"
    #: True when the memory is new (this process made it): the store initialises its arrays only then, so that a
    #: process attaching to a shared tier never resets what the others wrote.
    fresh: bool = True
    #: True when other processes use the same memory (their commits do not wake this process's condition variables).
    shared: bool = False
    #: True when an arena may be allocated again under the same key, larger, with the old one kept alive by its
    #: readers (process heap): a host store's ragged arena grows instead of raising `OutOfSpace`.
    growable: bool = False
    #: Bytes this tier may hold for a tiered store (`ExperienceStore(tiers=...)`); None: no limit.
    budget: int | None = None
    #: True when arenas hold a limited number of chunk slots addressed through a slot table (device memory cannot be
    #: over-committed); False when an arena spans the whole ring and rows keep their ring positions (host, disk).
    slotted: bool = False

    @abc.abstractmethod
    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """Return a writable array of shape [rows, *shape] for `key` (contents undefined)."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held by this tier's arenas."""

    def prepare_pages(self, keys: list[str], ring_rows: int, name: str = "") -> PagePreparer | None:
        """Start preparing the pages of arenas `keys` ahead of the write head (a `PagePreparer`, see
        tiers/prefault.py), or None: this tier does not (the default)."""
        return None

    def allocate_sparse(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        """An arena of `rows` rows whose memory is held per row range: `hold` accounts a range before it is written,
        `release` gives its memory back. Default: a plain `allocate` (all of it counted as held)."""
        return self.allocate(key, dtype, rows, shape)

    def hold_cost(self, key: str, start: int, stop: int) -> int:
        """Bytes that `hold(key, start, stop)` would add to `nbytes()` (0 for tiers without sparse arenas)."""
        return 0

    def hold(self, key: str, start: int, stop: int, chunk: int | None = None) -> int:
        """Rows [start, stop) of sparse arena `key` are about to be written; returns the bytes added to `nbytes()`.
        With `chunk`, the range is held as consecutive ranges of `chunk` rows, each released on its own later."""
        return 0

    def release(self, key: str, start: int, stop: int) -> int:
        """Rows [start, stop) of sparse arena `key` are no longer needed: their memory goes back (contents become
        undefined). Returns the bytes removed from `nbytes()`."""
        return 0

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more stay within the budget."""
        return self.budget is None or self.nbytes() + nbytes <= self.budget

    def lock(self, key: str) -> TierLock:
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

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4, "tib": 1 << 40}


def parse_bytes(value: object) -> int | None:
    """A byte size: an int, or a string such as "8GiB", "512MiB", "1.5 GB", "4096"; None stays None (no limit).

    Raises:
        ValueError: not a size.
    """
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgument(f"a byte size must be >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise InvalidArgument(f"expected a byte size such as 8GiB, 512MiB or an int, got {value!r}")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
