"""What a placement policy sees of a store (`PlacementTarget`): a Protocol that the store's one internals object,
`arrowbuf.engine.core.StoreCore`, satisfies structurally. placement sits below the store, so it names only what a
policy reads and calls, and imports nothing of the store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from ..ring.chunks import ChunkDirectory
    from ..schema import ExperienceSchema


@runtime_checkable
class PlacementTarget(Protocol):
    """What a placement policy sees of its store, and the one thing it does to it (`migrate`).

    The store binds its policy to its internals (`policy.bind(core)`, at construction); a policy reads nothing else.
    Columns are in `columns` order everywhere (arrays of shape [C] or [C, S], S chunk slots). `columns`, `slotted`,
    `bottom` and the per-column arrays describe a tiered store (`tiered`); with one tier there is nothing to place.

    Usage loop (a policy's step)::

        snap = target.snapshot()                   # lo, hi, each slot's first/last seq, inserts, access per column
        mass = target.chunk_mass()                 # [S] sampling mass per chunk slot (Sampler.mass)
        res = target.residency()                   # [C, S] tier code of each (column, chunk)
        target.migrate("obs", slot, tier, gen)     # copy one chunk of one column, off the sample path
    """

    @property
    def schema(self) -> ExperienceSchema: ...

    @property
    def name(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def closed(self) -> bool:
        """True once the store closed: a policy stops."""

    @property
    def directory(self) -> ChunkDirectory: ...

    @property
    def chunk_rows(self) -> int: ...

    @property
    def num_slots(self) -> int:
        """Chunk slots of the ring (its chunks and the spare one)."""

    @property
    def arena_rows(self) -> int:
        """Ring positions: the capacity plus the spare chunk."""

    @property
    def tiered(self) -> bool:
        """Whether columns span several tiers (residency per column and chunk)."""

    @property
    def tiers(self) -> list[Any]:
        """The data tiers, top (fastest) to bottom; a tier code indexes this list."""

    @property
    def columns(self) -> list[str]:
        """The placed columns."""

    @property
    def slotted(self) -> list[bool]:
        """Per tier: whether it holds fixed chunk slots (device memory) instead of the whole ring."""

    @property
    def bottom(self) -> int:
        """The code of the bottom tier (it holds every chunk)."""

    @property
    def queue(self) -> bool:
        """Whether the sampler is a queue (each item delivered once: new chunks hold the mass)."""

    def chunk_bytes(self) -> np.ndarray:
        """[C] bytes of one chunk of each column."""

    def residency(self) -> np.ndarray:
        """[C, S] the tier code of each (column, chunk slot); a copy."""

    def moving(self) -> np.ndarray:
        """[C, S] whether a (column, chunk slot) is being moved or written now."""

    def write_tiers(self) -> np.ndarray:
        """[C] where writers put each column's new chunks (a tier code)."""

    def set_write_tiers(self, codes: np.ndarray) -> None:
        """Where writers put each column's new chunks from now on (never a slotted tier)."""

    def snapshot(self) -> dict[str, Any]:
        """A consistent view under the store's state lock: `lo`, `hi` (live seqs), `gens`/`lasts` (each slot's first
        and last seq), `inserts` and `access` ([C] rows read per column so far)."""

    def chunk_mass(self) -> np.ndarray:
        """[S] each chunk slot's sampling mass (unnormalised): the sum of `Sampler.mass` over its rows."""

    def fixed_bytes(self, code: int) -> int:
        """Bytes tier `code` holds besides column chunks (the index, samplers, final observations on the host)."""

    def slots_total(self, code: int, column: str) -> int:
        """Chunk slots column `column` has in slotted tier `code` (0: no arena there yet)."""

    def ensure_arena(self, code: int, column: str, slots: int) -> bool:
        """Give `column` an arena of `slots` chunk slots in slotted tier `code`; False if it does not fit."""

    def migrate(self, column: str, slot: int, tier: int, gen: int | None) -> bool:
        """Copy chunk slot `slot` of `column` to tier `tier` and flip the slot table; False (nothing changed) if there
        is no room, it is already moving, or the chunk changed meanwhile. `gen`: the sealed chunk's first seq, or
        None for a slot that is not sealed (moved only while no writer is busy)."""
