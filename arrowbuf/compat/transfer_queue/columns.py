"""TransferQueue fields <-> arrowbuf columns, exactly or not at all.

TransferQueue is schema-free: a field is whatever the writer passed, sample by sample. arrowbuf stores typed columns,
so a field has a `FieldKind` (what one sample is: a tensor of a dtype, a str, bytes, a JSON value) fixed by its first
put into a partition, and a put's values of one field travel and are stored as `FieldValues`:

| TransferQueue value (a batch of B)                  | kind                | stored as                              |
|-----------------------------------------------------|---------------------|----------------------------------------|
| dense tensor `[B, *S]` of any dtype arrowbuf keeps  | `tensor`            | `[B, *S]` (scalar or fixed-shape)      |
| (bool, ints, floats, float16, bfloat16, float8,     |                     |                                        |
| complex)                                            |                     |                                        |
| nested tensor (jagged, strided), B tensors of       | `tensor`            | `list<dtype>` of the flattened samples |
| varying shapes                                      |                     | plus each sample's shape (ragged)      |
| `NonTensorStack`/list of str, np.str_, bytes,       | `str`, `npstr`,     | `list<uint8>` of UTF-8 / raw bytes     |
| np.bytes_                                           | `bytes`, `npbytes`  |                                        |
| `NonTensorStack`/`NonTensorData` of dicts, lists,   | `json`              | a JSON column (`dtype: json`)          |
| numbers, None (chat messages, tool calls)           |                     |                                        |

bfloat16, the float8 formats and complex are arrowbuf's logical dtypes (`arrowbuf.schema.dtypes`: their bits, or
(real, imaginary) pairs, under an Arrow extension type); JSON values are `arrowbuf.schema.jsonvalues`'s, exactly or
not at all (no pickle). A field whose per-sample shape changes between puts becomes ragged for that field from then
on (the partition's state decides; the values of the earlier puts stay where they are).

Read back, a field comes as TransferQueue 0.1.11 returns it: samples that are 0-dim tensors as one `[B]` tensor,
every other tensor field as a jagged nested tensor (a strided one where two dimensions vary, a `NonTensorStack` of
tensors where ranks differ), non-tensor fields as a `NonTensorStack`. `output="dense"` (`tq.init({"arrowbuf":
{"output": "dense"}})`) returns a tensor field whose samples share one shape as a dense `[B, *S]` tensor instead.

Refused with `SchemaError` (nothing is written): dtypes arrowbuf cannot keep exactly (`storage_dtype`: float4,
complex32, quantized types), values that are no JSON value (a tuple, a set, a non-string dict key, NaN in JSON, an
object: `json_values`), mixed value types in one field, a batch dimension that disagrees with the keys, and a later
put whose kind or dtype differs from the field's first put.

torch is needed (TransferQueue's values are tensors); tensordict is optional: without it, plain dicts of tensors go
in and come out (non-tensor fields as lists).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import pyarrow as pa

from ...errors import SchemaError
from ...flight.wire import wire_array
from ...schema import dtypes as _logical
from ...schema.spec import DTYPES

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    import torch
    from tensordict import NonTensorStack, TensorDict

#: The fields of a put: a TensorDict, or a dict of field name -> tensor, nested tensor or list of values.
PutFields: TypeAlias = "TensorDict | Mapping[str, Any]"
#: One field as TransferQueue returns it: a tensor (dense, or a jagged/strided nested one), a NonTensorStack, or
#: the list of values where tensordict is not installed.
FieldOut: TypeAlias = "torch.Tensor | NonTensorStack | list[Any]"
#: What a get returns: a TensorDict, or a dict of fields (tensordict not installed, or asked for).
Batch: TypeAlias = "TensorDict | dict[str, Any]"

#: What one sample of a field is.
KINDS = ("tensor", "str", "bytes", "npstr", "npbytes", "json")
TEXT_KINDS = ("str", "bytes", "npstr", "npbytes")
#: Output forms of tensor fields.
OUTPUTS = ("jagged", "dense")


def torch_module() -> ModuleType:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the compat extra installs it
        raise ImportError("arrowbuf.compat needs torch: pip install 'arrowbuf[compat]'") from e
    return torch


def tensordict_module() -> ModuleType | None:
    """tensordict, or None when it is not installed (plain dicts then)."""
    try:
        import tensordict
    except ImportError:
        return None
    return tensordict


@dataclass(frozen=True)
class FieldKind:
    """What one sample of a field is: `kind` (see KINDS) and, for tensors, the numpy dtype name."""

    kind: str
    dtype: str = ""

    def to_json(self) -> list[str]:
        return [self.kind, self.dtype]

    @classmethod
    def from_json(cls, value: object) -> FieldKind:
        """Parse `to_json`'s output; raises SchemaError on anything else (remote input)."""
        if (not isinstance(value, list) or len(value) != 2 or value[0] not in KINDS
                or not isinstance(value[1], str) or (value[0] == "tensor" and value[1] not in TENSOR_DTYPES)):
            raise SchemaError(f"bad field kind {value!r}")
        return cls(value[0], value[1])

    def describe(self) -> str:
        return f"{self.dtype} tensors" if self.kind == "tensor" else f"{self.kind} values"


# ---------------------------------------------------------------------- arrowbuf's logical dtypes and JSON values
#: What a tensor field may hold: numpy's dtypes (complex included) and the ones numpy lacks, kept as their bits
#: (bfloat16, the float8 formats: `arrowbuf.schema.dtypes`).
TENSOR_DTYPES = frozenset(DTYPES) | frozenset(_logical.BITS)


def storage_dtype(where: str, dtype: torch.dtype | np.dtype | str) -> str:
    """The dtype name a tensor field of `dtype` (torch or numpy) is stored under, or SchemaError (a dtype arrowbuf
    cannot keep exactly: float4, complex32, quantized types; nothing is ever stored as another dtype)."""
    name = str(dtype).replace("torch.", "")
    if name in TENSOR_DTYPES:
        return name
    raise SchemaError(f"field {where!r}: dtype {name} cannot be stored exactly (arrowbuf keeps "
                      f"{', '.join(sorted(TENSOR_DTYPES))}); nothing was written. Cast explicitly if a different "
                      "dtype is acceptable")


def json_values(where: str, values: list[Any]) -> FieldValues:
    """Non-tensor values other than str and bytes (dicts, lists, numbers, None: chat messages, tool calls) as a
    JSON field (`arrowbuf.schema.jsonvalues`: each value's JSON text, exactly or not at all: a tuple, a set, a
    non-string key, NaN or an object is refused with a SchemaError naming the field and row; nothing is pickled)."""
    from ...delivery import ragged as _ragged
    from ...schema import jsonvalues

    flat, offsets = _ragged.flat(jsonvalues.encode(f"field {where!r}", values))
    return FieldValues(FieldKind("json", "json"), len(values), flat=flat, offsets=offsets)


def to_numpy(where: str, tensor: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor's values as numpy (zero-copy when contiguous on the CPU): a dtype numpy lacks as its
    bits (`arrowbuf.schema.dtypes`), its dtype checked."""
    name = storage_dtype(where, tensor.dtype)
    if name in _logical.BITS:
        return _logical.tensor_numpy(tensor, name)
    return tensor.detach().cpu().contiguous().numpy()


def tensor_of(arr: np.ndarray, dtype: str = "") -> torch.Tensor:
    """A torch tensor of `dtype` over `arr` (its physical values, which the caller may hand out writable)."""
    if dtype in _logical.BITS:
        return _logical.torch_view(arr, dtype)
    return torch_module().from_numpy(arr)


def _check_shapes(shapes: list[tuple[int, ...]] | None, offsets: np.ndarray) -> None:
    """Each sample's shape holds exactly its values (a shape that says more or fewer would be read back as another
    tensor, or fail every later read of the sample)."""
    if shapes is None:
        return
    n = len(offsets) - 1
    sizes = np.fromiter((math.prod(s) for s in shapes), dtype=np.int64, count=len(shapes))
    if len(shapes) != n or not np.array_equal(sizes, np.diff(offsets)):
        m = min(n, len(shapes))
        bad = next((i for i in range(m) if sizes[i] != offsets[i + 1] - offsets[i]), m)
        raise SchemaError(f"{len(shapes)} per-sample shapes for {n} samples, or a shape that does not hold its "
                          f"sample's values (sample {bad}); nothing was written")


# ---------------------------------------------------------------------- values of one field
@dataclass
class FieldValues:
    """One field's values for n samples, as one of: `dense` (`[n, *S]`, tensors of one shape); `flat` + `offsets`
    (int64, n + 1, from 0) with `shapes` (tensors of varying shapes, flattened) or without (text kinds: bytes)."""

    kind: FieldKind
    n: int
    dense: np.ndarray | None = None
    flat: np.ndarray | None = None
    offsets: np.ndarray | None = None
    shapes: list[tuple[int, ...]] | None = None

    @property
    def ragged(self) -> bool:
        """Tensors stored flattened with per-sample shapes."""
        return self.kind.kind == "tensor" and self.dense is None

    def sample_shapes(self) -> list[tuple[int, ...]]:
        """Each sample's shape (tensor kinds)."""
        if self.dense is not None:
            return [tuple(self.dense.shape[1:])] * self.n
        return list(self.shapes or [])

    def uniform_shape(self) -> tuple[int, ...] | None:
        """The one shape every sample has, or None."""
        if self.dense is not None:
            return tuple(self.dense.shape[1:])
        shapes = set(self.shapes or [])
        return shapes.pop() if len(shapes) == 1 else None

    def spec(self) -> ValuesSpec:
        """What a put's plan needs of these values (kind, count, shapes; a text field's longest sample), without
        the values."""
        longest = None
        if self.kind.kind in TEXT_KINDS and self.offsets is not None:
            longest = int(np.diff(self.offsets).max()) if self.n else 0
        return ValuesSpec(self.kind, self.n, None if self.dense is None else tuple(self.dense.shape[1:]),
                          None if self.dense is not None else self.shapes, longest)

    def as_ragged(self) -> FieldValues:
        """Tensors of one shape flattened (the form of a field that became ragged)."""
        if self.dense is None:
            return self
        per = int(np.prod(self.dense.shape[1:], dtype=np.int64))
        return FieldValues(self.kind, self.n, flat=self.dense.reshape(-1),
                           offsets=np.arange(self.n + 1, dtype=np.int64) * per, shapes=self.sample_shapes())

    def to_arrow(self) -> pa.Array:
        """The Arrow column these values travel and are stored as (zero-copy where numpy allows): a dtype numpy
        lacks, and complex, as arrowbuf's extension type over the physical values."""
        name = self.kind.dtype
        logical = self.kind.kind == "tensor" and name in _logical.NAMES
        if self.dense is not None:
            if logical:
                return _logical.to_arrow(_logical.arrow_type(name, tuple(self.dense.shape[1:])), self.dense)
            if self.n == 0 or 0 in self.dense.shape[1:]:
                typ = pa.fixed_shape_tensor(pa.from_numpy_dtype(self.dense.dtype), list(self.dense.shape[1:]))
                storage = pa.FixedSizeListArray.from_arrays(wire_array(self.dense.reshape(-1)),
                                                            int(np.prod(self.dense.shape[1:])))
                return pa.ExtensionArray.from_storage(typ, storage)
            # wrapped from the buffer: `pa.array` and `from_numpy_ndarray` look for pandas objects first, and the
            # first such look in a process imports pandas (1-2 s: a cold system's first put and get paid it)
            return wire_array(self.dense)
        assert self.flat is not None and self.offsets is not None
        child = (_logical.to_arrow(_logical.arrow_type(name, ()), self.flat) if logical
                 else wire_array(self.flat))
        if self.offsets[-1] < 2**31:
            return pa.ListArray.from_arrays(wire_array(self.offsets.astype(np.int32)), child)
        return pa.LargeListArray.from_arrays(wire_array(self.offsets), child)

    @classmethod
    def from_arrow(cls, kind: FieldKind, col: pa.Array | pa.ChunkedArray, shapes: list[tuple[int, ...]] | None,
                   writable: bool = False) -> FieldValues:
        """Values from an Arrow column (`to_arrow`'s forms, or a store's: JSON as `arrow.json`); `writable`: the
        column's memory is this caller's alone (a gather's output, a received message), so the arrays may be
        handed out writable without a copy."""
        from ...delivery import ragged as _ragged
        from ...flight.messages import received
        from ...schema import jsonvalues
        from ...schema.convert import arrow_to_numpy, tensor_to_numpy

        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        n = len(col)
        if jsonvalues.is_text_type(col.type) or isinstance(col.type, pa.JsonType):
            col = jsonvalues.to_physical(col)
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            if _logical.is_logical(col.type.value_type):
                col = _logical.unwrap_list(col)
            if pa.types.is_fixed_size_list(col.type.value_type):  # complex: (real, imaginary) pairs
                offsets = np.asarray(col.offsets, dtype=np.int64)
                pairs, _ = _logical.storage_values(col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
                flat = np.ascontiguousarray(pairs).view(np.dtype(kind.dtype))
                offsets = offsets - offsets[0]
                _check_shapes(shapes, offsets)
                return cls(kind, n, flat=flat, offsets=offsets, shapes=shapes)
            flat, offsets = _ragged.flat(col, writable=writable)
            _check_shapes(shapes, offsets)
            if writable:
                flat = received(flat)
            return cls(kind, n, flat=flat, offsets=offsets, shapes=shapes)
        if _logical.is_logical(col.type):
            dense = _logical.to_physical(col)
        elif isinstance(col.type, pa.FixedShapeTensorType):
            dense = tensor_to_numpy(col).reshape((n, *col.type.shape))
        else:
            dense = arrow_to_numpy(col)
        return cls(kind, n, dense=received(dense) if writable else dense)

    def take(self, rows: np.ndarray) -> FieldValues:
        """The values of samples at positions `rows`, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.dense is not None:
            return FieldValues(self.kind, len(rows), dense=self.dense[rows])
        assert self.flat is not None and self.offsets is not None
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lens = ends - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        pieces = [self.flat[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
        flat = np.concatenate(pieces) if pieces else self.flat[:0]
        shapes = None if self.shapes is None else [self.shapes[i] for i in rows.tolist()]
        return FieldValues(self.kind, len(rows), flat=flat, offsets=offsets, shapes=shapes)

    @classmethod
    def join(cls, parts: list[tuple[np.ndarray, FieldValues]], n: int) -> FieldValues:
        """One field's values for n samples from (positions, values) pieces that cover 0..n-1 once."""
        if len(parts) == 1 and len(parts[0][0]) == n and np.array_equal(parts[0][0], np.arange(n)):
            return parts[0][1]
        kind = parts[0][1].kind
        order = np.argsort(np.concatenate([p for p, _ in parts]), kind="stable")
        denses = [v.dense for _, v in parts]
        if all(d is not None for d in denses) and len({d.shape[1:] for d in denses}) == 1:  # type: ignore[union-attr]
            return cls(kind, n, dense=np.concatenate(denses)[order])  # type: ignore[arg-type]
        flat_parts = [v.as_ragged() for _, v in parts]
        lens = np.concatenate([np.diff(np.asarray(v.offsets)) for v in flat_parts])
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        joined = cls(kind, len(lens), flat=np.concatenate([np.asarray(v.flat) for v in flat_parts]),
                     offsets=offsets,
                     shapes=None if kind.kind != "tensor" else [s for v in flat_parts for s in v.sample_shapes()])
        return joined.take(order)

    @classmethod
    def concat(cls, chunks: list[FieldValues], out: np.ndarray | None = None,
               flat_out: Callable[[int, np.dtype], np.ndarray] | None = None) -> FieldValues:
        """The values of consecutive chunks of samples as one (dense chunks of one shape into `out` when given: an
        array of the whole shape, e.g. a reused one; ragged ones' values into `flat_out(count, dtype)` when given,
        also from one chunk: a 1-D array of `count` items, e.g. `OutputPool.at_least`, whose pages are already
        mapped)."""
        if len(chunks) == 1 and out is None and (flat_out is None or chunks[0].dense is not None):
            return chunks[0]
        kind = chunks[0].kind
        n = sum(c.n for c in chunks)
        denses = [c.dense for c in chunks]
        if all(d is not None for d in denses) and len({d.shape[1:] for d in denses}) == 1:  # type: ignore[union-attr]
            if out is None:
                return cls(kind, n, dense=np.concatenate(denses))  # type: ignore[arg-type]
            at = 0
            for d in denses:
                assert d is not None
                out[at:at + len(d)] = d
                at += len(d)
            return cls(kind, n, dense=out)
        parts = [c.as_ragged() for c in chunks]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.concatenate([np.diff(np.asarray(c.offsets)) for c in parts]), out=offsets[1:])
        pieces = [np.asarray(c.flat)[int(c.offsets[0]):int(c.offsets[-1])] for c in parts]  # type: ignore[index]
        into = None
        if flat_out is not None and all(x.ndim == 1 for x in pieces) and len({x.dtype for x in pieces}) == 1:
            into = flat_out(sum(len(x) for x in pieces), pieces[0].dtype)
        flat = np.concatenate(pieces, out=into)
        shapes = None if kind.kind != "tensor" else [s for c in parts for s in c.sample_shapes()]
        return cls(kind, n, flat=flat, offsets=offsets, shapes=shapes)

    # ------------------------------------------------------------------ per-sample Python values
    def components(self) -> list[Any]:
        """Each sample as numpy (tensor kinds) or its Python value (text kinds)."""
        if self.kind.kind == "tensor":
            if self.dense is not None:
                return list(self.dense)
            assert self.flat is not None and self.offsets is not None and self.shapes is not None
            return [self.flat[s:e].reshape(shape) for s, e, shape in
                    zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), self.shapes, strict=True)]
        assert self.flat is not None and self.offsets is not None
        bounds = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), strict=True))
        # each sample taken straight from the values' memory: no bytes copy of the whole field first (a 1024 x 32 KiB
        # field: 32 MiB copied into fresh pages, then sliced again)
        view = np.ascontiguousarray(self.flat, dtype=np.uint8).data
        if self.kind.kind in ("str", "npstr"):
            texts = [str(view[s:e], "utf-8") for s, e in bounds]
            return texts if self.kind.kind == "str" else [np.str_(t) for t in texts]
        items = [bytes(view[s:e]) for s, e in bounds]
        if self.kind.kind == "json":
            from ...schema import jsonvalues

            return [jsonvalues.loads_checked("a JSON field", b) for b in items]
        if self.kind.kind == "npbytes":
            return [np.bytes_(b) for b in items]
        return items


@dataclass
class ValuesSpec:
    """What a put's plan and the schema it records need of one field's values, without them: the kind, the
    number of samples, and the one shape of a dense batch (`dense_shape`) or each sample's shape (`shapes`, ragged
    tensors; None for text kinds); for text kinds the bytes of the longest sample where known (`max_len`: a field
    group in shared memory is sized by it)."""

    kind: FieldKind
    n: int
    dense_shape: tuple[int, ...] | None = None
    shapes: list[tuple[int, ...]] | None = None
    max_len: int | None = None

    def longest(self) -> tuple[int, int] | None:
        """(elements, dimensions) of the largest sample: a tensor's values and ndim, a text sample's bytes and 0;
        None for text whose lengths are not known."""
        if self.kind.kind != "tensor":
            return None if self.max_len is None else (self.max_len, 0)
        if self.dense_shape is not None:
            return math.prod(self.dense_shape), len(self.dense_shape)
        shapes = self.shapes or []
        return (max((math.prod(x) for x in shapes), default=0), max((len(x) for x in shapes), default=0))

    def sample_shapes(self) -> list[tuple[int, ...]]:
        if self.dense_shape is not None:
            return [self.dense_shape] * self.n
        return list(self.shapes or [])

    def uniform_shape(self) -> tuple[int, ...] | None:
        """The one shape every sample has, or None (as `FieldValues.uniform_shape`)."""
        if self.dense_shape is not None:
            return self.dense_shape
        shapes = set(self.shapes or [])
        return shapes.pop() if len(shapes) == 1 else None


# ---------------------------------------------------------------------- input: one field of a put
def _text(where: str, values: list[Any]) -> FieldValues | None:
    """str/bytes values (one Python type for the whole batch) as a text field, else None."""
    types = {type(v) for v in values}
    if len(types) != 1:
        if types and all(issubclass(t, (str, bytes)) for t in types):
            raise SchemaError(f"field {where!r}: mixed value types {sorted(t.__name__ for t in types)} in one "
                              "batch; a field holds one type; nothing was written")
        return None
    t = types.pop()
    names: dict[type, str] = {str: "str", np.str_: "npstr", bytes: "bytes", np.bytes_: "npbytes"}
    kind = names.get(t)
    if kind is None:
        return None
    if t is str:
        # Arrow's builder copies each value's UTF-8 (which CPython keeps for an ASCII str) once into one buffer:
        # about 2x faster than encoding each and joining them. `pa.array` would do the same but imports pandas
        # (tests/test_cold_imports.py). Anything it refuses (a lone surrogate, over 2 GiB) takes the path below,
        # which raises what it always raised
        try:
            builder = pa.lib.StringBuilder()
            builder.append_values(values)
            arr = builder.finish()
        except (pa.ArrowException, UnicodeError, OverflowError):
            pass
        else:
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[:len(values) + 1].astype(np.int64)
            return FieldValues(FieldKind(kind, "uint8"), len(values), offsets=offsets,
                               flat=np.frombuffer(arr.buffers()[2] or b"", dtype=np.uint8)[:int(offsets[-1])])
    raw = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
    offsets = np.zeros(len(raw) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in raw], out=offsets[1:])
    return FieldValues(FieldKind(kind, "uint8"), len(raw), flat=np.frombuffer(b"".join(raw), dtype=np.uint8),
                       offsets=offsets)


def tensors_values(where: str, parts: list[Any]) -> FieldValues:
    """B tensors (or numeric arrays), one per sample, as one field (dense when they share a shape)."""
    torch = torch_module()
    dtypes = {storage_dtype(where, p.dtype) for p in parts}
    if len(dtypes) > 1:
        raise SchemaError(f"field {where!r}: mixed dtypes {sorted(dtypes)} in one batch; a field has one dtype; "
                          "nothing was written")
    arrays = [to_numpy(where, p) if isinstance(p, torch.Tensor) else np.asarray(p) for p in parts]
    dtype = dtypes.pop() if dtypes else "float32"
    kind = FieldKind("tensor", dtype)
    shapes = [tuple(int(d) for d in a.shape) for a in arrays]
    if len(set(shapes)) <= 1:
        shape = shapes[0] if shapes else ()
        physical = _logical.physical_dtype(dtype) if dtype in _logical.BITS else np.dtype(dtype)
        return FieldValues(kind, len(arrays), dense=np.stack(arrays) if arrays else np.zeros((0, *shape), physical))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    return FieldValues(kind, len(arrays), flat=np.concatenate([a.reshape(-1) for a in arrays]), offsets=offsets,
                       shapes=shapes)


def _nested(where: str, value: Any) -> FieldValues:  # a nested tensor (torch types it as Tensor, without offsets)
    torch = torch_module()
    if value.layout == torch.jagged and getattr(value, "_ragged_idx", 1) == 1:
        storage_dtype(where, value.dtype)
        values = value.values().detach().cpu()
        offsets = value.offsets().detach().cpu().numpy().astype(np.int64)
        rest = tuple(int(d) for d in values.shape[1:])
        lens = np.diff(offsets)
        flat = to_numpy(where, values)[offsets[0]:offsets[-1]]
        kind = FieldKind("tensor", storage_dtype(where, value.dtype))
        n = len(lens)
        if n and (lens == lens[0]).all():
            return FieldValues(kind, n, dense=flat.reshape((n, int(lens[0]), *rest)))
        per = int(np.prod(rest, dtype=np.int64))
        return FieldValues(kind, n, flat=flat.reshape(-1), offsets=(offsets - offsets[0]) * per,
                           shapes=[(int(L), *rest) for L in lens.tolist()])
    return tensors_values(where, list(value.unbind(0)))


def field_values(where: str, value: object, non_tensor: list[Any] | None = None) -> FieldValues:
    """One field of a put as `FieldValues`. `value` is what a TensorDict holds (`td.get(name)`) or a dict value;
    `non_tensor` the per-sample values of a non-tensor field (`td[name]`), when the caller has them."""
    torch = torch_module()
    td = tensordict_module()
    if isinstance(value, torch.Tensor) and not (td is not None and isinstance(value, td.NonTensorData)):
        if value.is_nested:
            return _nested(where, value)
        if value.dim() == 0:
            raise SchemaError(f"field {where!r}: a scalar has no batch dimension; pass one value per sample")
        arr = to_numpy(where, value)
        return FieldValues(FieldKind("tensor", storage_dtype(where, value.dtype)), int(arr.shape[0]), dense=arr)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        if value.ndim == 0:
            raise SchemaError(f"field {where!r}: a scalar has no batch dimension; pass one value per sample")
        return FieldValues(FieldKind("tensor", storage_dtype(where, value.dtype)), len(value), dense=value)
    if non_tensor is not None:
        values = list(non_tensor)
    elif td is not None and isinstance(value, (td.NonTensorStack, td.NonTensorData)):
        values = value.tolist()
        values = values if isinstance(values, list) else [values]
    elif isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
    else:
        raise SchemaError(f"field {where!r}: expected a tensor, an array or one value per sample, got "
                          f"{type(value).__name__}")
    if values and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        return tensors_values(where, values)
    text = _text(where, values)
    if text is not None:
        return text
    if (non_tensor is None and isinstance(value, (list, tuple)) and values
            and all(isinstance(v, (bool, int, float)) for v in values)):
        arr = torch.as_tensor(values).numpy()  # a plain list of numbers, as a TensorDict takes it: one tensor
        return FieldValues(FieldKind("tensor", storage_dtype(where, arr.dtype)), len(values), dense=arr)
    return json_values(where, values)


def batch_items(fields: PutFields, samples: bool = True) -> tuple[list[tuple[str, Any, Any]], int | None]:
    """(name, value, per-sample values of a non-tensor field or None) of a TensorDict or dict, and the
    TensorDict's batch size (None for a dict), checked. `samples=False`: without the per-sample values (always
    None; a NonTensorStack's list of 1024 strings costs about 15 ms to build), for callers that need the names or
    the batch size only."""
    td = tensordict_module()
    if td is not None and isinstance(fields, td.TensorDictBase):
        size = int(fields.batch_size[0]) if len(fields.batch_size) else None
        out = []
        for name in fields.keys():
            if not isinstance(name, str):
                raise SchemaError(f"nested keys are not supported: {name!r}; flatten the TensorDict first")
            value = fields.get(name)
            if isinstance(value, td.TensorDictBase) and not isinstance(value, (td.NonTensorData,
                                                                                td.NonTensorStack)):
                raise SchemaError(f"field {name!r}: a nested TensorDict; flatten it first")
            plain = None if not samples or (isinstance(value, torch_module().Tensor) and not isinstance(
                value, td.NonTensorData)) else fields[name]
            out.append((name, value, plain))
        return out, size
    if isinstance(fields, dict):
        for name in fields:
            if not isinstance(name, str) or not name:
                raise SchemaError(f"field names are non-empty str, got {name!r}")
        return [(k, v, None) for k, v in fields.items()], None
    raise SchemaError(f"fields must be a TensorDict or a dict of tensors, got {type(fields).__name__}")


def schema_entry(value: FieldValues | ValuesSpec, nested: bool) -> dict[str, Any]:
    """The `field_schema` entry TransferQueue records for a put of these values (dtype and shape names, JSON-able:
    the system keeps them; the client turns them into torch dtypes and sizes): a tensor field's first sample's
    shape (a batch of 0-dim samples counts as shape (1,)), nested inputs with every sample's shape."""
    if value.kind.kind != "tensor":
        return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    shapes = value.sample_shapes()
    first = list(shapes[0]) if shapes else []
    entry: dict[str, Any] = {"dtype": value.kind.dtype, "shape": first if (first or nested) else [1],
                             "is_nested": nested, "is_non_tensor": False}
    if nested:
        entry["per_sample_shapes"] = [list(s) for s in shapes]
    return entry


def put_fields(fields: PutFields, batch: int) -> tuple[dict[str, FieldValues], list[str]]:
    """Every field of a put (all or nothing): its values, and the fields given as nested tensors (TransferQueue
    reports those nested whatever their shapes; `schema_entry`)."""
    torch = torch_module()
    items, size = batch_items(fields)
    if size is not None and size != batch:
        raise SchemaError(f"the TensorDict's batch_size {size} does not match the {batch} keys/samples given; "
                          "nothing was written")
    values: dict[str, FieldValues] = {}
    nested: list[str] = []
    for name, value, plain in items:
        fv = field_values(name, value, plain)
        if fv.n != batch:
            raise SchemaError(f"field {name!r}: batch dimension {fv.n} does not match the {batch} keys/samples "
                              "given; nothing was written")
        if (isinstance(value, torch.Tensor) and value.is_nested) or (
                fv.kind.kind == "tensor" and isinstance(value, (list, tuple)) and fv.dense is None):
            nested.append(name)
        values[name] = fv
    return values, nested


def batch_size_of(fields: PutFields) -> int:
    """The batch size of a put's fields: a TensorDict's, else the length of the first field."""
    items, size = batch_items(fields, samples=False)
    if size is not None:
        return size
    torch = torch_module()
    sizes = set()
    for name, v, _ in items:
        if isinstance(v, torch.Tensor):
            sizes.add(int(v.size(0)) if v.dim() else 0)
        elif isinstance(v, (list, tuple, np.ndarray)):
            sizes.add(len(v))
        else:
            raise SchemaError(f"field {name!r}: expected a tensor, array or list per field, got {type(v).__name__}")
    if len(sizes) > 1:
        raise SchemaError(f"fields disagree on the batch size: {sorted(sizes)}; nothing was written")
    return sizes.pop() if sizes else 0


def dense_numpy(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A scalar or `fixed_shape_tensor` column as an ndarray `[B, *shape]` (bool tensors included, which
    pyarrow's `to_numpy_ndarray` refuses)."""
    from ...schema.convert import arrow_to_numpy, tensor_to_numpy

    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if isinstance(col.type, pa.FixedShapeTensorType):
        return tensor_to_numpy(col)
    return arrow_to_numpy(col)


# ---------------------------------------------------------------------- output
def _pack_tensors(parts: list[torch.Tensor]) -> FieldOut:
    """B tensors as TransferQueue packs them: all 0-dim -> stacked; else a jagged nested tensor, else a strided
    one, else a NonTensorStack."""
    torch = torch_module()
    if all(p.dim() == 0 for p in parts):
        return torch.stack(parts)
    try:
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    except (RuntimeError, TypeError):
        try:
            return torch.nested.as_nested_tensor(parts, layout=torch.strided)
        except (RuntimeError, TypeError):
            return _non_tensor_stack(parts)


def _non_tensor_stack(values: list[Any]) -> NonTensorStack | list[Any]:
    td = tensordict_module()
    return values if td is None else td.NonTensorStack(*values)


def to_torch_field(values: FieldValues, output: str = "jagged") -> FieldOut:
    """A field read back, as TransferQueue 0.1.11 returns it (see the module docstring); `output="dense"` gives a
    field of one shape as `[B, *S]`. Tensors are over the values' memory (no copy)."""
    torch = torch_module()
    if values.kind.kind != "tensor":
        return _non_tensor_stack(values.components())
    n, name = values.n, values.kind.dtype
    if values.dense is not None:
        dense = values.dense
        if dense.ndim == 1 or output == "dense":
            return tensor_of(dense, name)
        if n == 0:
            return tensor_of(dense, name)
        length = dense.shape[1]
        flat = dense.reshape((n * length, *dense.shape[2:]))
        offsets = torch.arange(n + 1, dtype=torch.int64) * length
        return torch.nested.nested_tensor_from_jagged(tensor_of(flat, name), offsets)
    assert values.flat is not None and values.offsets is not None and values.shapes is not None
    shapes = values.shapes
    if output == "dense" and len(set(shapes)) == 1:
        return tensor_of(values.flat.reshape((n, *shapes[0])), name)
    ranks = {len(s) for s in shapes}
    if len(ranks) == 1 and ranks != {0} and len({s[1:] for s in shapes}) == 1:  # only the first dimension varies
        rest = shapes[0][1:]
        per = math.prod(rest)
        flat = values.flat.reshape((-1, *rest))
        return torch.nested.nested_tensor_from_jagged(tensor_of(flat, name),
                                                      torch.from_numpy(values.offsets // max(per, 1)))
    return _pack_tensors([tensor_of(c, name) for c in values.components()])


def to_output(data: dict[str, Any], batch: int, as_tensordict: bool = True) -> Batch:
    """A TensorDict of `data` when tensordict is installed, else the dict."""
    td = tensordict_module()
    if td is None or not as_tensordict:
        return data
    return td.TensorDict(data, batch_size=[batch])
