"""Token budgets of `consume(max_tokens=...)`: which ragged field is counted, and each row's count, from offsets.

`ConsumeTracker` (`arrowbuf.engine.consume`) fills a batch in order while the rows' (groups') token counts fit the
budget. A count is a list length read from the Arrow offsets (or the ragged arena's lengths): no value is copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc

from ..errors import InvalidArgument, SchemaError
from ..schema.convert import arrow_to_numpy

if TYPE_CHECKING:  # pragma: no cover
    from ..schema import ExperienceSchema
    from .core import StoreCore


def ragged_fields(schema: ExperienceSchema) -> list[str]:
    """The ragged (list) fields of `schema`, in order (json fields are stored as bytes, but hold no tokens)."""
    return [n for n, f in schema.fields.items() if f.ragged and not f.is_json]


def check_token_field(schema: ExperienceSchema, token_field: str | None) -> str | None:
    """A store's `token_field=` option, checked.

    Raises:
        SchemaError: it does not name a ragged field of the schema.
    """
    if token_field is not None:
        spec = schema.fields.get(token_field)
        if spec is None or not spec.ragged or spec.is_json:
            raise SchemaError(f"token_field={token_field!r} must name a ragged field of schema {schema.name!r}; "
                              f"its ragged fields are {ragged_fields(schema)}")
    return token_field


def token_field_of(schema: ExperienceSchema, token_field: str | None) -> str:
    """The field a token budget counts: the store's `token_field`, else `response_tokens`, else the only ragged one.

    Raises:
        InvalidArgument: none of those exists (the message says how to name one).
    """
    if token_field is not None:
        return token_field
    ragged = ragged_fields(schema)
    if "response_tokens" in ragged:
        return "response_tokens"
    if len(ragged) == 1:
        return ragged[0]
    raise InvalidArgument(f"consume(max_tokens=...) counts the tokens of a ragged field; schema "
                          f"{schema.name!r} has {ragged or 'none'}: pass ExperienceStore(..., token_field=<name>)")


def token_counts(core: StoreCore, field: str, seqs: np.ndarray) -> np.ndarray:
    """Token count (list length) of ragged `field` for each row `seqs` of the store `core` (a `StoreCore`), read
    from the list offsets only (an unwritten value counts 0)."""
    chunk_rows = core.directory.chunk_rows
    pos = seqs % core.arena_rows
    arena = getattr(core.cols, "tier_ragged", {}).get(field)
    if arena is not None:  # values in one arena (ring.ragged_arena): lengths without copying any value
        return np.maximum(np.asarray(arena.length[pos], dtype=np.int64), 0)
    slots, offs = pos // chunk_rows, pos % chunk_rows
    out = np.zeros(len(seqs), dtype=np.int64)
    per_slot = core.cols.ragged[field]
    for s in np.unique(slots):
        lens = arrow_to_numpy(pc.fill_null(pc.list_value_length(per_slot[int(s)]), 0))
        m = slots == s
        out[m] = lens[offs[m]]
    return out


__all__ = ["check_token_field", "ragged_fields", "token_counts", "token_field_of"]
