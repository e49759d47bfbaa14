"""ExtendInPieces: one extend whose rows arrive in pieces (a Flight DoPut in parts), copied straight into the ring.

`ExperienceStore.begin_extend(rows, names)` returns one when the store can take it (`PiecesWriter.ok`: arena
columns, ragged fields only outside shared memory, no consume hold, rate limiter, journal, derived fields, no
episode-end fields in a shared store), else None (the caller assembles the batch and calls `extend`). A store with
ragged fields appends their values to each chunk's region in ring order, so its batch in pieces holds the store's
write lock from the first piece to `commit` or `abort` (other writers, `update` and checkpoints wait): the caller
must end every sink it begins. The guarantees are those of one `extend`:

- the rows are reserved on the first piece (seqs [base, base + rows), their ring positions freed), each piece is
  validated against the schema and copied into its rows (one copy: no assembled batch), and `commit` makes every
  row visible at once, with consecutive ids;
- `abort` (a piece failed validation, the stream broke, the client died, fewer rows came than declared) stores
  nothing and leaves no reservation behind: its seqs become a hole, as a dead writer's.

Usage::

    sink = store.begin_extend(rows, batch.schema.names)   # None: assemble and extend instead
    try:
        for part in parts:
            sink.write(part)
        ids = sink.commit()
    except BaseException:
        sink.abort()
        raise
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SchemaError
from ..schema import ExperienceSchema
from .pieces_writer import PiecesWriter
from .reservation import Reservation


class ExtendInPieces:
    """The pieces of one extend of `rows` rows (see the module docstring). One thread uses it."""

    def __init__(self, schema: ExperienceSchema, writer: PiecesWriter, rows: int) -> None:
        self.schema = schema
        self.rows = int(rows)
        self.filled = 0
        self._writer = writer
        self._res: Reservation | None = None
        self._done = False

    def write(self, piece: Any) -> None:
        """Validate `piece` (a batch of the store's schema) and copy its rows into the next reserved rows.

        Raises:
            SchemaError: the piece does not match the schema, or brings more rows than declared (the caller aborts).
        """
        if self._done:
            raise SchemaError("an extend in pieces that was committed or aborted takes no more pieces")
        cols, m = self.schema.validate_batch(piece)
        if m == 0 or self.filled + m > self.rows:
            raise SchemaError(f"an extend in pieces: a piece of {m} rows after {self.filled} of the {self.rows} "
                              "declared; nothing stored")
        if self._res is None:
            self._res = self._writer.begin(self.rows)
        self._writer.write(self._res, self.filled, cols, m)
        self.filled += m

    def commit(self) -> np.ndarray:
        """Make every row visible at once; returns their ids (consecutive).

        Raises:
            SchemaError: fewer rows came than declared (nothing is stored; the reservation is given up).
        """
        if self._done:
            raise SchemaError("an extend in pieces was already committed or aborted")
        if self.filled != self.rows:
            self.abort()
            raise SchemaError(f"an extend in pieces ended after {self.filled} of {self.rows} rows; nothing stored")
        try:
            assert self._res is not None
            ids = self._writer.finish(self._res)
        except BaseException:  # not committed (the store closed while waiting for earlier writers): a hole
            self.abort()
            raise
        self._done = True
        return np.asarray(ids, dtype=np.int64)

    def abort(self) -> None:
        """Store nothing; the reserved rows (if any) become a hole. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        if self._res is not None:
            self._writer.abort(self._res)
            self._res = None


__all__ = ["ExtendInPieces"]
