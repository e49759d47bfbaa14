"""Sampled batches with meta "columns" (protocol version 1): how a batch names its items in trailing Arrow columns
instead of JSON app_metadata, and the padding that keeps the received body aligned.

Part of `arrowbuf.flight.protocol`, which re-exports every name here and reads the "meta" and "pad" request keys
(`SAMPLE_META`, `MAX_PAD`); this module holds what both ends need to build and take apart such a batch, and
imports nothing of the protocol. docs/flight-protocol.md documents it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ...errors import SchemaError
from ...schema.convert import arrow_to_numpy

#: How a sampled batch names its items: the request key "meta" (DoGet sample tickets, DoExchange session commands).
#: "json" (the default): the batch's app_metadata `{"v":1,"indices":[...],"weights":[...]}`. "columns": two more
#: Arrow columns after the sampled ones, `ID_COLUMN` (int64) and, when the sampler has importance weights,
#: `WEIGHT_COLUMN` (float32), and no app_metadata: nothing to build or parse per batch (JSON of 256 ids costs
#: about 25 us each way, of 256 weights about 165 us to write). Servers that speak it list it in `describe`
#: (`"sample_meta"`); a client asks for it only then.
SAMPLE_META = ("json", "columns")
ID_COLUMN = "arrowbuf.id"
WEIGHT_COLUMN = "arrowbuf.weight"
#: The most padding bytes a request may ask for (`pad`): 0-7 bytes realign any body; a little slack.
MAX_PAD = 63


def pad_metadata(pad: int) -> pa.Buffer | None:
    """The app_metadata of a batch sent with meta "columns": `pad` spaces (None for 0), nothing else."""
    return pa.py_buffer(b" " * pad) if pad else None


def realigning_pad(pad: int, misaligned: int) -> int:
    """The `pad` that moves a received body, now `misaligned` bytes past an 8-byte boundary with `pad`, onto one.

    In a Flight message the body follows the IPC header and the app_metadata field (tag, 1-byte length and `pad`
    bytes, absent when `pad` is 0): the receiver's buffer starts at the same alignment for the same layout, so
    the body moves with the field's size. A received array off its dtype's alignment is copied by the client;
    sent aligned, it is used in place (mujoco batch 4096: 12.6 MB not copied per call).
    """
    def shift(p: int) -> int:
        return p + 2 if p else 0

    want = (shift(pad) - misaligned) % 8
    return next(p for p in range(0, 9) if shift(p) % 8 == want)


def split_sample_columns(data: pa.RecordBatch) -> tuple[int, np.ndarray, np.ndarray | None]:
    """A batch sent with meta "columns": (how many leading columns are sampled data, ids, weights or None).

    Raises:
        SchemaError: the trailing columns are not `ID_COLUMN` (int64, no nulls) and optionally `WEIGHT_COLUMN`
            (float32, no nulls).
    """
    names = data.schema.names
    k = len(names)
    weights = None
    if k >= 2 and names[-1] == WEIGHT_COLUMN and names[-2] == ID_COLUMN:
        col = data.column(k - 1)
        if col.type != pa.float32() or col.null_count:
            raise SchemaError(f"sample: column {WEIGHT_COLUMN!r} must be float32 without nulls, got {col.type}")
        weights = arrow_to_numpy(col)
        k -= 1
    if k < 1 or names[k - 1] != ID_COLUMN:
        raise SchemaError(f"sample: expected the trailing column {ID_COLUMN!r} (meta \"columns\"), got {names[-2:]}")
    ids = data.column(k - 1)
    if ids.type != pa.int64() or ids.null_count:
        raise SchemaError(f"sample: column {ID_COLUMN!r} must be int64 without nulls, got {ids.type}")
    return k - 1, arrow_to_numpy(ids), weights
