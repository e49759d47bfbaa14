"""The write path of a store, picked when the store is built: every call that changes a store goes through one
`Writes` object, as Reverb's table takes a checkpointer and TorchRL's buffer a writer.

- `DirectWrites` (here) applies each change through the store's parts: the `StoreWriter` (append, extend,
  end_episode), the `StoreUpdater`, the reader's priority updates and the `ConsumeTracker` (tasks, policy version).
- `DurableWrites` (`arrowbuf.store.durable`, `ExperienceStore(..., durable=DIR)`) journals each change too, and
  returns once it is durable under the store's policy.

The facade never asks which one it holds. Usage (what `ExperienceStore` does)::

    writes: Writes = DirectWrites(parts)                    # or DurableWrites.create(DIR, "group", parts)
    ids = writes.extend(batch, timeout=None, wait=True)     # np.ndarray of ids (a PendingWrite with wait=False)
    writes.update(ids, {"reward": r}); writes.set_policy_version(3)
    writes.checkpoint("ckpt/", keep=2, background=False, compression=None)
    writes.close()
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..engine.consume import ConsumeTracker
from ..engine.core import StoreCore
from ..engine.reader import StoreReader
from ..engine.update import StoreUpdater
from ..engine.writer import StoreWriter
from ..errors import InvalidArgument
from .pending import PendingWrite

if TYPE_CHECKING:
    from ..persist.checkpoint import CheckpointHandle
    from ..persist.journal import Journal


@dataclass(frozen=True)
class StoreParts:
    """The parts of one store that change it (built by the facade over one `StoreCore`)."""

    core: StoreCore
    writer: StoreWriter
    reader: StoreReader
    updater: StoreUpdater
    consume: ConsumeTracker


class Writes(Protocol):
    """Every change to a store (module docstring)."""

    #: Whether an extend may arrive in pieces copied straight into the ring (`ExperienceStore.begin_extend`).
    accepts_pieces: bool
    @property
    def journal(self) -> Journal | None:
        """The store's write-ahead log, or None (not durable)."""
        ...

    def append(self, step: dict[str, Any], timeout: float | None) -> int: ...

    def extend(self, batch: Any, timeout: float | None, wait: bool) -> np.ndarray | PendingWrite: ...

    def end_episode(self, actor: Hashable, final: dict[str, Any]) -> bool: ...

    def update(self, ids: Any, values: Any) -> int: ...

    def update_priorities(self, indices: Any, priorities: Any) -> int: ...

    def add_task(self, name: str) -> None: ...

    def set_policy_version(self, value: int) -> None: ...

    def checkpoint(self, path: str | None, keep: int | None, background: bool,
                   compression: str | None) -> dict[str, Any] | CheckpointHandle: ...

    def stats(self) -> dict[str, Any] | None:
        """What `store.stats()["journal"]` shows (None: nothing)."""
        ...

    def close(self) -> None: ...


class DirectWrites:
    """`Writes` that apply each change through the store's parts, and journal nothing."""

    accepts_pieces = True
    journal = None

    def __init__(self, parts: StoreParts) -> None:
        self.parts = parts

    def append(self, step: dict[str, Any], timeout: float | None) -> int:
        return self.parts.writer.append(step, timeout=timeout)

    def extend(self, batch: Any, timeout: float | None, wait: bool) -> np.ndarray | PendingWrite:
        ids = self.parts.writer.extend(batch, timeout=timeout)
        return ids if wait else PendingWrite(ids)

    def end_episode(self, actor: Hashable, final: dict[str, Any]) -> bool:
        return self.parts.writer.end_episode(actor, final)

    def update(self, ids: Any, values: Any) -> int:
        return self.parts.updater.update(ids, values)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        return self.parts.reader.update_priorities(indices, priorities)

    def add_task(self, name: str) -> None:
        self.parts.consume.add_task(name)

    def set_policy_version(self, value: int) -> None:
        self.parts.consume.policy_version = value

    def checkpoint(self, path: str | None, keep: int | None, background: bool,
                   compression: str | None) -> dict[str, Any] | CheckpointHandle:
        if path is None:
            raise InvalidArgument("checkpoint(path): a store without durable= needs a directory")
        from ..persist.checkpoint import checkpoint

        self.parts.reader.settle()  # the device path's queued priority updates: in the sampler state copied
        out: dict[str, Any] | CheckpointHandle = checkpoint(self.parts.core, path, keep=keep, background=background,
                                                            compression=compression)
        return out

    def stats(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass
