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
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from ...errors import InvalidArgument, SchemaError
from .codecs import JsonCodec
from .layout import Layout
from .rows import gather, live_range
from .slots import SLOT_COLUMN

if TYPE_CHECKING:
    from .storage import ArrowbufStorage

FORMAT_KEY = "_arrowbuf_storage"
FORMAT_VERSION = 1
_RETRIES = 8


def empty_state(storage: ArrowbufStorage) -> dict[str, Any]:
    return {FORMAT_KEY: FORMAT_VERSION, "initialized": False, "max_size": storage.max_size, "ndim": storage.ndim,
            "_len": 0}


def dump(storage: ArrowbufStorage) -> dict[str, Any]:
    """The state_dict of an initialized storage (see the module doc)."""
    layout = storage.layout
    assert layout is not None
    for attempt in range(_RETRIES):
        lo, hi = live_range(storage.store)
        seqs = np.arange(lo, hi, dtype=np.int64)
        try:
            got = gather(storage.store, seqs, [*layout.columns_names, *_slot(storage)])
        except InvalidArgument:  # a writer of a shared store evicted rows meanwhile: read again
            if attempt == _RETRIES - 1:
                raise
            continue
        break
    positions = got[SLOT_COLUMN] if _slot(storage) else seqs % storage.max_size
    columns: dict[str, Any] = {}
    for leaf in layout.leaves:
        col = got[leaf.column]
        if isinstance(leaf.codec, JsonCodec):
            lengths = np.array([len(r) for r in col], dtype=np.int64)
            offsets = np.zeros(len(col) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values = np.concatenate([np.asarray(r, dtype=np.uint8) for r in col]) if len(col) else \
                np.zeros(0, np.uint8)
            columns[leaf.column] = {"values": torch.from_numpy(values), "offsets": torch.from_numpy(offsets)}
        else:
            columns[leaf.column] = torch.from_numpy(np.ascontiguousarray(col))
    return {FORMAT_KEY: FORMAT_VERSION, "initialized": True, "max_size": storage.max_size, "ndim": storage.ndim,
            "_len": int(hi - lo), "layout": layout.to_json(),
            "positions": torch.from_numpy(np.asarray(positions, dtype=np.int64).copy()), "columns": columns}


def _slot(storage: ArrowbufStorage) -> list[str]:
    return [SLOT_COLUMN] if SLOT_COLUMN in storage.store.schema.fields else []


def load(storage: ArrowbufStorage, state: dict[str, Any]) -> None:
    """Load an ArrowbufStorage or a LazyTensorStorage state_dict into `storage` (see the module doc).

    Raises:
        InvalidArgument: a state of another size or ndim, or not a storage state_dict.
    """
    if FORMAT_KEY in state:
        _load_own(storage, state)
    elif "_storage" in state and "_len" in state:
        _load_lazy_tensor(storage, state)
    else:
        raise InvalidArgument(f"not a storage state_dict (keys {sorted(state)[:8]}): ArrowbufStorage loads its own "
                              "state_dicts and LazyTensorStorage's")


def _check_size(storage: ArrowbufStorage, max_size: int, per: int, ndim: int) -> None:
    if ndim != storage.ndim:
        raise InvalidArgument(f"state of a storage with ndim={ndim}, this one has ndim={storage.ndim}")
    mine = math.ceil(storage.max_size / per) * per
    if int(max_size) != mine:
        raise InvalidArgument(f"state of a storage of {max_size} slots, this one has {storage.max_size}")


def _load_own(storage: ArrowbufStorage, state: dict[str, Any]) -> None:
    if state[FORMAT_KEY] != FORMAT_VERSION:
        raise InvalidArgument(f"an ArrowbufStorage state_dict of format {state[FORMAT_KEY]!r}; this arrowbuf reads "
                              f"format {FORMAT_VERSION}")
    if not state["initialized"]:
        _check_size(storage, state["max_size"], 1, int(state["ndim"]))
        storage._replace_store(None)
        return
    layout = Layout.from_json(state["layout"])
    _check_size(storage, state["max_size"], layout.per_element, int(state["ndim"]))
    storage.max_size = int(state["max_size"])
    storage._replace_store(layout)
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
    if len(positions):
        storage._append_rows(positions, cols)


def _load_lazy_tensor(storage: ArrowbufStorage, state: dict[str, Any]) -> None:
    if not state["initialized"]:
        storage._replace_store(None)
        return
    raw = state["_storage"]
    if isinstance(raw, torch.Tensor):
        data: Any = raw
    elif isinstance(raw, dict):
        data = TensorDict().load_state_dict(raw, strict=False)
    else:
        raise InvalidArgument(f"a LazyTensorStorage state whose _storage is a {type(raw).__name__}; ArrowbufStorage "
                              "loads tensor and TensorDict storages")
    per = math.prod(data.shape[1:storage.ndim])
    _check_size(storage, data.shape[0] * per, per, storage.ndim)
    rows0 = -(int(state["_len"]) // -per)
    storage._replace_store(None)
    if rows0:
        storage.set(torch.arange(rows0), data[:rows0], set_cursor=False)
