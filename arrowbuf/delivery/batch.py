"""SampleBatch: what `store.sample` returns.

Usage::

    batch = store.sample(256)
    batch.indices            # int64 ids naming the sampled rows (for update_priorities)
    batch.weights            # importance-sampling weights (max 1) or None
    batch.to_numpy()         # {"obs": uint8[256, 4, 84, 84], ...}; [B, T, ...] for sequences
    batch.to_torch("cpu")    # the same as torch tensors (zero-copy on the CPU)
    batch.data               # pa.RecordBatch (tensor columns are fixed_shape_tensor)
    parts = batch.split(ranks=4, balance="tokens")   # token-balanced parts for data-parallel ranks
    mine = batch.split(ranks=4, balance="tokens", rank=r)  # this rank's part (the same on every rank)
    batch.to_torch(pack=True)  # ragged columns flattened + cu_seqlens (int32) + position_ids; pack=False pads + mask
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, overload

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from ..errors import InvalidArgument, require
from ..schema import dtypes as _dtypes
from ..schema import jsonvalues as _jsonvalues
from ..schema.convert import arrow_to_numpy, numpy_to_arrow
from ..schema.inputs import DeviceLike, Gathered, JsonValue
from . import balance as _balance
from . import ragged as _ragged

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from typing_extensions import TypeIs


class LeaseOwner(Protocol):
    """What acks a leased batch (`SampleBatch.ack`, `nack`): the store or client that delivered it."""

    def ack(self, lease: str) -> int: ...

    def nack(self, lease: str) -> int: ...


def _is_tensor(values: object) -> TypeIs[torch.Tensor]:
    """A torch tensor (what a GPU tier delivers), recognised without importing torch."""
    return type(values).__module__.startswith("torch")


def _host(values: Gathered) -> np.ndarray | pa.Array:
    """numpy for a torch tensor (copied from the device; bfloat16 and float8 as their bits, as `to_numpy` gives
    them), anything else unchanged."""
    return _dtypes.tensor_numpy(values, _dtypes.tensor_dtype_name(values)) if _is_tensor(values) else values


def _to_arrow(values: Gathered) -> pa.Array:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
    if _is_tensor(values):
        name = _dtypes.tensor_dtype_name(values)
        if name in _dtypes.NAMES:  # a GPU tier's gather of a bfloat16, float8 or complex field
            return _dtypes.to_arrow(_dtypes.arrow_type(name, tuple(values.shape[1:])),
                                    _dtypes.tensor_numpy(values, name))
    values = _host(values)
    if values.ndim == 1:
        return numpy_to_arrow(values)
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(values))


#: What `SampleBatch.split` balances: "tokens", "tokens^2", "rows", a callable on the rows' token counts, or None.
Balance = str | Callable[[np.ndarray], npt.ArrayLike] | None


class SampleBatch:
    """A sampled batch: columns, the ids of their rows and importance weights.

    Attributes:
        indices: int64 ids of the sampled items (for sequences: the id of each window's first row).
        weights: float32 importance-sampling weights normalised to max 1, or None for samplers without them.
        columns: the names of the columns, in order.
    """

    __slots__ = ("_arrays", "indices", "weights", "columns", "_data", "info", "lease", "owner")

    def __init__(self, arrays: dict[str, Any], indices: np.ndarray, weights: np.ndarray | None = None,
                 info: dict[str, Any] | None = None) -> None:
        self._arrays = arrays
        self.indices = indices
        self.weights = weights
        self.columns = list(arrays)
        self._data: pa.RecordBatch | None = None
        self.info = info or {}
        self.lease: str | None = None  # the lease id of a batch consumed with lease= (None: final already)
        self.owner: LeaseOwner | None = None  # what acks the lease: the store (or client) that delivered the batch

    def ack(self) -> int:
        """Acknowledge this batch's lease (`store.ack(batch.lease)`): its rows are consumed for good by the task;
        returns the rows. A batch without a lease (consumed without `lease=`, or empty) has nothing to ack: 0.

        Raises:
            LeaseError: the lease is not open any more (acked or nacked already, or expired).
        """
        if self.lease is None:
            return 0
        return int(self._owner("ack").ack(self.lease))

    def nack(self) -> int:
        """Give this batch's rows back to the task's queue now (`store.nack(batch.lease)`); returns the rows (0 for a
        batch without a lease).

        Raises:
            LeaseError: the lease is not open any more.
        """
        if self.lease is None:
            return 0
        return int(self._owner("nack").nack(self.lease))

    def _owner(self, verb: str) -> LeaseOwner:
        if self.owner is None:
            from ..errors import LeaseError

            raise LeaseError(f"{verb}: this batch is a copy (pickled) of a leased batch and does not know its store; "
                             f"call store.{verb}(batch.lease) on the store that delivered it")
        return self.owner

    def __getstate__(self) -> dict[str, Any]:
        # the owner (a store or client) stays in its process: a copy acks through `store.ack(batch.lease)`
        return {k: getattr(self, k) for k in self.__slots__ if k != "owner"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k in self.__slots__:
            object.__setattr__(self, k, state.get(k))

    def __len__(self) -> int:
        return len(self.indices)

    @classmethod
    def concat(cls, parts: list[SampleBatch], info: dict[str, Any] | None = None) -> SampleBatch:
        """The rows of `parts` (batches of the same columns) in order, as one batch.

        Weights are kept as each part had them (None unless every part has weights); `info` defaults to the first
        part's.
        """
        if not parts:
            raise InvalidArgument("SampleBatch.concat needs at least one batch; got an empty list")
        arrays: dict[str, Any] = {}
        for c in parts[0].columns:
            vals = [p[c] for p in parts]
            if any(isinstance(v, (pa.Array, pa.ChunkedArray)) for v in vals):  # e.g. a later field NULL in a part:
                # Arrow there (its nulls kept), numpy in a part where it is written; joined as Arrow
                arrows = [_to_arrow(v) for v in vals]
                arrows = [v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v for v in arrows]
                kind = next(v.type for v, raw in zip(arrows, vals) if isinstance(raw, (pa.Array, pa.ChunkedArray)))
                arrays[c] = pa.concat_arrays([v if v.type == kind else v.cast(kind) for v in arrows])
            elif _is_tensor(vals[0]):
                arrays[c] = require("torch", "torch").cat(vals)
            else:
                arrays[c] = np.concatenate(vals)
        weights = None
        if all(p.weights is not None for p in parts):
            weights = np.concatenate([p.weights for p in parts])
        return cls(arrays, np.concatenate([p.indices for p in parts]), weights,
                   parts[0].info if info is None else info)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {getattr(v, 'shape', len(v))}" for k, v in self._arrays.items())
        return f"SampleBatch(n={len(self)}, {shapes}, weights={'yes' if self.weights is not None else 'no'})"

    def __getitem__(self, name: str) -> Any:
        return self._arrays[name]

    @property
    def data(self) -> pa.RecordBatch:
        """The batch as a `pa.RecordBatch` (built on first use, zero-copy over the gathered arrays)."""
        if self._data is None:
            self._data = pa.RecordBatch.from_arrays([_to_arrow(v) for v in self._arrays.values()],
                                                    names=self.columns)
        return self._data

    def to_numpy(self) -> dict[str, Any]:
        """Columns as numpy arrays shaped [B, *shape] ([B, T, *shape] for sequences); ragged columns as lists."""
        out: dict[str, Any] = {}
        for k, v in self._arrays.items():
            if _logical_column(v):
                out[k] = _logical_numpy(v)
            elif _ragged.is_ragged(v):
                out[k] = _ragged.split_rows(v)  # views over one buffer, no per-row Python conversion
            elif isinstance(v, (pa.Array, pa.ChunkedArray)):  # other Arrow types (rare): one array per row, as before
                out[k] = [np.asarray(x) if x is not None else None for x in v.to_pylist()]
            else:
                out[k] = _host(v)
        return out

    def to_torch(self, device: DeviceLike = "cpu", non_blocking: bool = False, pack: bool | None = None,
                 tokens: str | None = None, pad_value: float = 0) -> dict[str, Any]:
        """Columns as torch tensors on `device` (zero-copy on the CPU where the dtype allows).

        Columns gathered on a GPU tier are already device tensors and move only if `device` differs. Needs
        `pip install 'arrowbuf[torch]'`.

        Args:
            device: target device.
            non_blocking: passed to `Tensor.to`.
            pack: how ragged (list) columns come back. None: a list of 1-D tensors per column. True: each ragged
                column flattened to one 1-D tensor, plus `cu_seqlens` (int32 [B+1], the Arrow offsets rebased to 0),
                `position_ids` (int64, 0..len-1 per row) and `max_seqlen` (int) of the `tokens` column; a ragged
                column whose row lengths differ from it gets its own `<name>_cu_seqlens`. False: each ragged column
                padded with `pad_value` to [B, max_len], plus `attention_mask` (bool [B, max_len]) of the `tokens`
                column (`<name>_attention_mask` for a column of other lengths).
            tokens: the ragged column whose lengths define `cu_seqlens`/`attention_mask` (default: the first ragged
                column).
            pad_value: fill for pack=False.
        """
        torch = require("torch", "torch")
        out: dict[str, Any] = {}
        ref = self._token_column(tokens) if pack is not None and self._ragged_columns() else None
        ref_offs = _ragged.flat(self._arrays[ref])[1] if ref is not None else None
        seen: list[tuple[np.ndarray, tuple[Any, Any, int]]] = []  # offsets -> (cu_seqlens, position_ids, max_seqlen)
        for k, v in self._arrays.items():
            if _is_tensor(v):
                out[k] = v.to(device, non_blocking=non_blocking)
                continue
            if _logical_column(v):
                out[k] = _logical_torch(torch, v, device, non_blocking)
                continue
            if _ragged.is_ragged(v) and pack is not None:
                assert ref_offs is not None
                self._ragged_to_torch(torch, out, k, v, ref_offs, pack, pad_value, device, k == ref, seen)
                continue
            if _ragged.is_ragged(v):
                kind = _list_dtype(v)
                out[k] = [None if x is None else _values_torch(torch, x, kind, device, non_blocking)
                          for x in _ragged.split_rows(v)]
                continue
            if isinstance(v, (pa.Array, pa.ChunkedArray)):  # other Arrow types (rare): one tensor per row, as before
                out[k] = [None if x is None else torch.as_tensor(np.asarray(x)).to(device) for x in v.to_pylist()]
                continue
            out[k] = _torch_from_numpy(torch, v, device, non_blocking)
        return out

    @staticmethod
    def _ragged_to_torch(torch: ModuleType, out: dict[str, Any], name: str, values: pa.Array, ref_offs: np.ndarray,
                         pack: bool, pad_value: float, device: DeviceLike, is_ref: bool,
                         seen: list[tuple[np.ndarray, tuple[Any, Any, int]]]) -> None:
        vals, offs = _ragged.flat(values, writable=pack)  # a gather's own memory goes to torch without a copy
        same = offs.shape == ref_offs.shape and bool(np.array_equal(offs, ref_offs))
        kind = _list_dtype(values)  # bfloat16 / float8 lists: their bits, viewed as the dtype
        if pack:
            out[name] = _values_torch(torch, vals, kind, device, False)
            if is_ref or not same:
                prefix = "" if is_ref else f"{name}_"
                made = next((m for o, m in seen if o.shape == offs.shape and np.array_equal(o, offs)), None)
                if made is None:  # the first column of these row lengths: computed once, shared by the rest
                    made = (torch.from_numpy(offs.astype(np.int32)).to(device),
                            torch.from_numpy(_ragged.position_ids(offs)).to(device),
                            int(np.diff(offs).max()) if offs.size > 1 else 0)
                    seen.append((offs, made))
                out[f"{prefix}cu_seqlens"], out[f"{prefix}position_ids"], out[f"{prefix}max_seqlen"] = made
            return
        if kind is not None:  # the pad value as the dtype's bits
            pad_value = torch.tensor(pad_value, dtype=torch.float32).to(_dtypes.torch_dtype(kind)).view(
                torch.int16 if kind == "bfloat16" else torch.uint8).item() & (0xFFFF if kind == "bfloat16" else 0xFF)
        padded, mask = _ragged.pad(values, pad_value)
        out[name] = _values_torch(torch, padded, kind, device, False)
        if is_ref or not same:
            out["attention_mask" if is_ref else f"{name}_attention_mask"] = torch.from_numpy(mask).to(device)

    # ---- rows, token counts and balanced splits --------------------------------------------------------------

    def _ragged_columns(self) -> list[str]:
        return [k for k, v in self._arrays.items() if _ragged.is_ragged(v)]

    def _token_column(self, tokens: str | None) -> str:
        ragged = self._ragged_columns()
        if tokens is None:
            if not ragged:
                raise InvalidArgument(
                    f"this batch has no ragged (list) column to count tokens in; columns are {self.columns}")
            return ragged[0]
        if tokens not in ragged:
            raise InvalidArgument(f"tokens={tokens!r}: expected one of the ragged columns {ragged}")
        return tokens

    def token_counts(self, tokens: str | None = None) -> np.ndarray:
        """int64 tokens per row of the ragged column `tokens` (default: the first ragged column)."""
        return _ragged.lengths(self._arrays[self._token_column(tokens)])

    def take(self, rows: npt.ArrayLike) -> SampleBatch:
        """The batch's rows at positions `rows` (int array), in that order, as a new batch."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise InvalidArgument(f"take: row positions must be in [0, {len(self)}); got {rows.min()}..{rows.max()}")
        arrays: dict[str, Any] = {}
        for k, v in self._arrays.items():
            if _ragged.is_ragged(v):
                arrays[k] = _ragged.take(v, rows)  # ranged copies (or a zero-copy slice), not Arrow's list take
            elif isinstance(v, (pa.Array, pa.ChunkedArray)):
                arrays[k] = v.take(numpy_to_arrow(rows))
            elif _is_tensor(v):
                arrays[k] = v[require("torch", "torch").from_numpy(rows).to(v.device)]
            else:
                arrays[k] = v[rows]
        weights = None if self.weights is None else self.weights[rows]
        return SampleBatch(arrays, self.indices[rows], weights, dict(self.info))

    @overload
    def split(self, ranks: int, balance: Balance = "tokens", rank: None = None, group: str | None = None,
              tokens: str | None = None, method: str = "kk", micro_batches: None = None) -> list[SampleBatch]: ...

    @overload
    def split(self, ranks: int, balance: Balance = "tokens", *, rank: int, group: str | None = None,
              tokens: str | None = None, method: str = "kk", micro_batches: None = None) -> SampleBatch: ...

    @overload
    def split(self, ranks: int, balance: Balance = "tokens", rank: int | None = None, group: str | None = None,
              tokens: str | None = None, method: str = "kk", micro_batches: int | None = None
              ) -> SampleBatch | list[SampleBatch] | list[list[SampleBatch]]: ...

    def split(self, ranks: int, balance: Balance = "tokens", rank: int | None = None, group: str | None = None,
              tokens: str | None = None, method: str = "kk", micro_batches: int | None = None
              ) -> SampleBatch | list[SampleBatch] | list[list[SampleBatch]]:
        """Cut the batch into `ranks` parts for data-parallel ranks, balanced by a cost.

        The partition depends only on the batch's contents (ties broken by row position), so R processes that each
        hold the same global batch and call `split(R, rank=r)` get disjoint parts that together cover it. The largest
        per-rank cost is within 4/3 - 1/(3 ranks) of the optimum (`arrowbuf.delivery.balance`).

        Args:
            ranks: number of parts (>= 1).
            balance: the cost balanced across ranks: "tokens" (token count of the `tokens` column), "tokens^2"
                (its square: the attention cost), "rows" (row counts), a callable on the rows' token counts (an
                int64 array) returning one cost >= 0 per row, or None (contiguous chunks of near-equal size).
            rank: return only this rank's part (0 <= rank < ranks) instead of the list.
            group: a column whose equal values must stay on one rank (and one micro-batch), e.g. "prompt_id".
            tokens: the ragged column to count tokens in (default: the first ragged column).
            method: "kk" (Karmarkar-Karp) or "lpt" (greedy longest-first).
            micro_batches: cut each rank's part into exactly this many micro-batches of near-equal cost, so every
                rank runs the same number of steps (a micro-batch is empty only when its rank holds fewer rows or
                groups than this).

        Returns:
            A list of `ranks` batches (rows in their original order within each), or one batch when `rank` is given;
            with `micro_batches`, a list of `micro_batches` batches in place of each batch.
        """
        if not isinstance(ranks, (int, np.integer)) or isinstance(ranks, bool) or ranks < 1:
            raise InvalidArgument(f"split: expected ranks >= 1 (an int), got {ranks!r}")
        if rank is not None and not (isinstance(rank, (int, np.integer)) and 0 <= rank < ranks):
            raise InvalidArgument(f"split: expected 0 <= rank < {ranks}, got {rank!r}")
        if balance is not None and not callable(balance) and balance not in _balance.COSTS:
            raise InvalidArgument(f"split: expected balance in {_balance.COSTS}, a callable on the row token "
                                  f"counts, or None; got {balance!r}")
        keys = None
        if group is not None:
            if group not in self._arrays:
                raise InvalidArgument(f"split: group={group!r} is not a column of this batch ({self.columns})")
            keys = _host(self._arrays[group])
            if isinstance(keys, (pa.Array, pa.ChunkedArray)):
                keys = arrow_to_numpy(keys)
        n = len(self)
        if balance is None:
            if keys is not None:
                raise InvalidArgument("split: group= needs a balance cost")
            if micro_batches is not None:
                raise InvalidArgument("split: micro_batches= needs a balance cost")
            parts = [np.asarray(p, dtype=np.int64) for p in np.array_split(np.arange(n, dtype=np.int64), ranks)]
            if rank is not None:
                return self.take(parts[int(rank)])
            return [self.take(p) for p in parts]
        lengths = np.ones(n, dtype=np.int64) if balance == "rows" else self.token_counts(tokens)
        weights = _balance.costs(lengths, balance)
        plan = _balance.split_plan(weights, int(ranks), micro_batches, groups=keys, method=method)
        batches = plan if rank is None else [plan[int(rank)]]
        if micro_batches is not None:
            nested = [[self.take(p) for p in micro] for micro in batches]
            return nested if rank is None else nested[0]
        out = [self.take(micro[0]) for micro in batches]
        return out if rank is None else out[0]


def _logical_column(values: Gathered) -> bool:
    """A column of a dtype numpy lacks (bfloat16, float8, complex: `arrowbuf.schema.dtypes`) or of JSON values."""
    if not isinstance(values, (pa.Array, pa.ChunkedArray)):
        return False
    return isinstance(values.type, (_dtypes.LogicalType, pa.JsonType))


def _logical_numpy(values: pa.Array) -> np.ndarray | list[JsonValue] | list[np.ndarray | None]:
    """`to_numpy` of a logical column: JSON values as a list of Python values (None: JSON null, or a later value
    not written yet); bfloat16/float8 as their bits ([B, *shape] uint16/uint8), complex as numpy complex; a column
    with null rows (later values not written yet) as a list of per-row arrays, None where null."""
    if isinstance(values.type, pa.JsonType):
        return _jsonvalues.decode(values)
    return _logical_rows(values)


def _logical_rows(values: pa.Array) -> np.ndarray | list[np.ndarray | None]:
    """`_logical_numpy` of a column of an arrowbuf dtype (not JSON)."""
    phys = _dtypes.to_physical(values)
    if not values.null_count:
        return phys
    valid = np.asarray(values.is_valid(), dtype=bool)
    return [phys[i, ...] if ok else None for i, ok in enumerate(valid.tolist())]  # rows as (0-d) array views


def _logical_torch(torch: ModuleType, values: pa.Array, device: DeviceLike, non_blocking: bool
                   ) -> torch.Tensor | list[JsonValue] | list[torch.Tensor | None]:
    """`to_torch` of a logical column: a tensor of its dtype (torch.bfloat16, torch.float8_*, complex) over the
    batch's memory where it is writable; JSON values and columns with null rows as `_logical_numpy` gives them
    (tensors per row)."""
    if isinstance(values.type, pa.JsonType):
        return _jsonvalues.decode(values)
    out = _logical_rows(values)
    name = values.type.dtype_name
    if isinstance(out, list):
        return [None if r is None else _dtypes.torch_view(r, name).to(device, non_blocking=non_blocking)
                for r in out]
    t = _dtypes.torch_view(out, name)
    return t.to(device, non_blocking=non_blocking) if str(device) != "cpu" else t


def _list_dtype(values: pa.Array) -> str | None:
    """The arrowbuf dtype of a ragged column's values (a ragged bfloat16 or float8 field), or None."""
    vt = values.type.value_type
    return vt.dtype_name if isinstance(vt, _dtypes.LogicalType) else None


def _values_torch(torch: ModuleType, v: np.ndarray, kind: str | None, device: DeviceLike, non_blocking: bool
                  ) -> torch.Tensor:
    """`_torch_from_numpy`, or for the bits of an arrowbuf dtype `kind`, a tensor of that dtype over them."""
    if kind is None:
        return _torch_from_numpy(torch, v, device, non_blocking)
    t = _dtypes.torch_view(v, kind)
    return t.to(device, non_blocking=non_blocking) if str(device) != "cpu" else t


def _torch_from_numpy(torch: ModuleType, v: np.ndarray, device: DeviceLike, non_blocking: bool) -> torch.Tensor:
    if v.dtype in (np.uint16, np.uint32, np.uint64):
        v = v.astype(np.int64)
    if not v.flags.writeable:
        v = v.copy()  # a read-only mapping must not reach torch as a writable tensor
    t = torch.from_numpy(v)
    return t.to(device, non_blocking=non_blocking) if str(device) != "cpu" else t


__all__ = ["SampleBatch"]
