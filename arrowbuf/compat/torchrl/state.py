"""`ArrowbufStorage.state_dict` and `load_state_dict`: a format `torch.load(weights_only=True)` reads, and loading
LazyTensorStorage's.

An ArrowbufStorage state_dict holds plain containers, strings, ints and tensors only::

    {"_arrowbuf_storage": 1, "initialized": True, "max_size": 1000, "ndim": 1, "_len": 700,
     "layout": "<Layout JSON>",                   # how the data map onto columns (arrowbuf.compat.torchrl.layout)
     "positions": LongTensor[700],                # each stored element's position, oldest first
     "columns": {"obs": Tensor[700, 4], ...,      # each column's rows, oldest first (bits for bf16, complex, ...)
                 "note": {"values": ByteTensor, "offsets": LongTensor}}}   # NonTensorData: JSON text

`load_state_dict` appends the rows in that order under their positions, so every element keeps its index and the
ring evicts them in their original order; the store keeps the loading storage's own sampler (a prioritized
storage stays prioritized; priorities themselves are kept by `dumps`/`loads`, the arrowbuf checkpoint, and by
`ArrowbufPrioritizedSampler.state_dict`).

Interchange with LazyTensorStorage: a LazyTensorStorage state_dict (`{"_storage": TensorDict state or tensor,
"initialized", "_len"}`) loads into an ArrowbufStorage of the same `max_size` (its first `_len` elements, at the
same positions). The other direction does not work: a LazyTensorStorage cannot load an ArrowbufStorage state_dict
(it has no "_storage" entry, so LazyTensorStorage raises KeyError): the rows are kept in insertion order with their
positions, not as the preallocated array LazyTensorStorage copies, and may hold what LazyTensorStorage's format
has no place for (NonTensorData as JSON, tensorclass and pytree layouts). Go through the data instead:
`LazyTensorStorage(n).set(range(len(s)), s[:])`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from ...errors import InvalidArgument, SchemaError
from .codecs import JsonCodec
from .layout import Layout
from .rows import gather, live_range
from .slots import SLOT_COLUMN

FORMAT_KEY = "_arrowbuf_storage"
FORMAT_VERSION = 1
_RETRIES = 8


def empty_state(max_size: int, ndim: int) -> dict[str, Any]:
    """The state_dict of a storage that holds nothing yet."""
    return {FORMAT_KEY: FORMAT_VERSION, "initialized": False, "max_size": max_size, "ndim": ndim, "_len": 0}


def dump(store: Any, layout: Layout, max_size: int, ndim: int) -> dict[str, Any]:
    """The state_dict of a storage over `store` (see the module doc)."""
    slot = [SLOT_COLUMN] if SLOT_COLUMN in store.schema.fields else []
    for attempt in range(_RETRIES):
        lo, hi = live_range(store)
        seqs = np.arange(lo, hi, dtype=np.int64)
        try:
            got = gather(store, seqs, [*layout.columns_names, *slot])
        except InvalidArgument:  # a writer of a shared store evicted rows meanwhile: read again
            if attempt == _RETRIES - 1:
                raise
            continue
        break
    positions = got[SLOT_COLUMN] if slot else seqs % max_size
    columns: dict[str, Any] = {}
    for leaf in layout.leaves:
        col = got[leaf.column]
        if isinstance(leaf.codec, JsonCodec):
            offsets = np.zeros(len(col) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in col], out=offsets[1:])
            values = np.concatenate([np.asarray(r, dtype=np.uint8) for r in col]) if len(col) else \
                np.zeros(0, np.uint8)
            columns[leaf.column] = {"values": torch.from_numpy(values), "offsets": torch.from_numpy(offsets)}
        else:
            columns[leaf.column] = torch.from_numpy(np.ascontiguousarray(col))
    return {FORMAT_KEY: FORMAT_VERSION, "initialized": True, "max_size": max_size, "ndim": ndim,
            "_len": int(hi - lo), "layout": layout.to_json(),
            "positions": torch.from_numpy(np.asarray(positions, dtype=np.int64).copy()), "columns": columns}


@dataclass
class Loaded:
    """What a state_dict holds, ready to write into a storage.

    Attributes:
        layout: the data's layout (None: the storage was empty).
        max_size: the storage's size in elements (rounded to whole entries along dim 0).
        positions, columns: an ArrowbufStorage state: rows (oldest first) and their positions.
        data, entries: a LazyTensorStorage state: its data and how many entries along dim 0 are stored.
    """

    layout: Layout | None
    max_size: int
    positions: np.ndarray | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    data: Any = None
    entries: int = 0


def read(state: dict[str, Any], max_size: int, ndim: int) -> Loaded:
    """Read an ArrowbufStorage or a LazyTensorStorage state_dict for a storage of `max_size` and `ndim`.

    Raises:
        InvalidArgument: a state of another size or ndim, or not a storage state_dict.
    """
    if FORMAT_KEY in state:
        return _read_own(state, max_size, ndim)
    if "_storage" in state and "_len" in state:
        return _read_lazy_tensor(state, max_size, ndim)
    raise InvalidArgument(f"not a storage state_dict (keys {sorted(state)[:8]}): ArrowbufStorage loads its own "
                          "state_dicts and LazyTensorStorage's")


def _check_size(max_size: int, ndim: int, theirs: int, their_ndim: int, per: int) -> int:
    if their_ndim != ndim:
        raise InvalidArgument(f"state of a storage with ndim={their_ndim}, this one has ndim={ndim}")
    if int(theirs) != math.ceil(max_size / per) * per:
        raise InvalidArgument(f"state of a storage of {theirs} slots, this one has {max_size}")
    return int(theirs)


def _read_own(state: dict[str, Any], max_size: int, ndim: int) -> Loaded:
    if state[FORMAT_KEY] != FORMAT_VERSION:
        raise InvalidArgument(f"an ArrowbufStorage state_dict of format {state[FORMAT_KEY]!r}; this arrowbuf reads "
                              f"format {FORMAT_VERSION}")
    if not state["initialized"]:
        return Loaded(None, _check_size(max_size, ndim, state["max_size"], int(state["ndim"]), 1))
    layout = Layout.from_json(state["layout"])
    size = _check_size(max_size, ndim, state["max_size"], int(state["ndim"]), layout.per_element)
    positions = np.asarray(state["positions"], dtype=np.int64)
    cols: dict[str, Any] = {}
    for leaf in layout.leaves:
        value = state["columns"][leaf.column]
        if isinstance(leaf.codec, JsonCodec):
            offsets = pa.array(np.asarray(value["offsets"], dtype=np.int32))
            cols[leaf.column] = pa.ListArray.from_arrays(offsets, pa.array(value["values"].numpy(), pa.uint8()))
        else:
            cols[leaf.column] = value.numpy()
        if len(cols[leaf.column]) != len(positions):
            raise SchemaError(f"state column {leaf.column!r} holds {len(cols[leaf.column])} rows for "
                              f"{len(positions)} positions")
    return Loaded(layout, size, positions, cols)


def _read_lazy_tensor(state: dict[str, Any], max_size: int, ndim: int) -> Loaded:
    if not state["initialized"]:
        return Loaded(None, max_size)
    raw = state["_storage"]
    if isinstance(raw, torch.Tensor):
        data: Any = raw
    elif isinstance(raw, dict):
        data = TensorDict().load_state_dict(raw, strict=False)
    else:
        raise InvalidArgument(f"a LazyTensorStorage state whose _storage is a {type(raw).__name__}; ArrowbufStorage "
                              "loads tensor and TensorDict storages")
    per = math.prod(data.shape[1:ndim])
    size = _check_size(max_size, ndim, data.shape[0] * per, ndim, per)
    entries = -(int(state["_len"]) // -per)
    return Loaded(Layout.infer(data[:max(entries, 1)], ndim), size, data=data[:entries], entries=entries)
