"""A pipelined acknowledgement: `store.extend(batch, wait=False)` returns a `PendingWrite` at once.

A writer that acknowledges every batch synchronously pays max(its copy, the fsync) per call; one that keeps a
window of unacknowledged writes (as a Kafka producer does) overlaps the fsync of batch k with the encoding and copy
of batches k + 1, k + 2, ... and reaches the rate of a store without a journal when the disk keeps up:

    handles = collections.deque()
    for batch in batches:
        handles.append(store.extend(batch, wait=False))
        if len(handles) > 4:
            handles.popleft().wait()      # the oldest write is durable: acknowledge it upstream

Guarantees (docs/durability.md):

- When `extend(..., wait=False)` returns, the batch is stored exactly as when `extend` returns: its rows are
  visible to `sample`, `len`, `to_table` and `consume`, its ids are `handle.ids`, and its journal record is written
  (in the operating system's page cache, in commit order): it survives a kill of the process under every policy.
- `handle.durable` is True, and `handle.wait()` returns, once the record is durable under the store's policy (for
  "batch" and "group": on disk, fdatasync'd; for "os": at once). Records are durable in commit order: once a handle
  is durable, every batch extended before it is too. Under "group" the fdatasync of a batch extended with
  `wait=False` starts at most the group window (2 ms) later, shared by the batches extended meanwhile, or at once
  when a `wait()` needs it.
- What a crash of the machine may lose: batches whose handle was not yet durable (never one that reported durable).
  A consumer never receives rows that can be lost: `consume` waits for its own record, which follows the batch's.
- A store without `durable=` returns a handle that is durable at once (nothing to wait for), so the same code runs
  on both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InsertTimeout

if TYPE_CHECKING:  # pragma: no cover
    from ..persist.journal import Journal


class PendingWrite:
    """A stored batch whose durability may still be pending (module docstring). Thread-safe; `wait` may be called
    any number of times, from any thread."""

    __slots__ = ("ids", "_journal", "_ticket")

    def __init__(self, ids: np.ndarray, journal: Journal | None = None, ticket: int = -1) -> None:
        self.ids = ids          #: the new rows' ids, as `extend` returns them
        self._journal = journal  # a `persist.journal.Journal` (None: nothing to wait for)
        self._ticket = int(ticket)

    @property
    def durable(self) -> bool:
        """Whether the batch is durable under the store's policy now (it stays so)."""
        return self._journal is None or bool(self._journal.is_durable(self._ticket))

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Return the ids once the batch is durable under the store's policy.

        Raises:
            InsertTimeout: not durable within `timeout` seconds (the batch stays stored; wait again).
            OSError: the journal could not make it durable (the disk failed): treat the batch as not acknowledged.
        """
        if self._journal is not None and not self._journal.wait(self._ticket, timeout):
            raise InsertTimeout(f"the batch of ids {int(self.ids[0]) if len(self.ids) else '-'}.. is stored but not "
                                f"yet durable after {timeout}s: wait again (the disk is slow or stalled)")
        return self.ids

    def __repr__(self) -> str:
        return f"PendingWrite(rows={len(self.ids)}, durable={self.durable})"
