"""`Layout`: how TorchRL data (a tensor, a TensorDict, a tensorclass, a pytree) maps onto arrowbuf rows and columns,
and how gathered rows become that data again.

    layout = Layout.infer(batch, ndim=1)          # from the first write (a batch: leading dim = elements)
    cols = layout.columns(batch)                  # {column: values}, one row per stored element
    again = layout.rebuild(gathered, shape)       # the same kind of object, batch shape [*shape, *layout.extra]
    schema = layout.schema("name")                # the store's schema; the layout rides in its metadata
    Layout.from_schema(store.schema)              # what another process (attached, restored, served) rebuilds

A stored element (one row) is what TorchRL's storage indexes: with `ndim=1` one entry along the batch's first dim,
with `ndim=2` one (dim0, dim1) cell, and so on. The batch dims after the storage's `ndim` (`extra`) stay with the
element: a `[4, 5]` TensorDict written to an `ndim=1` storage is 4 rows whose fields have a leading dim of 5, and a
sample of 3 comes back as a `[3, 5]` TensorDict. Nested TensorDicts whose batch is longer than their parent's keep
it (`nodes`), tensorclasses come back as their class (`classes`: imported by name in another process), pytrees
(dicts, lists, tuples of tensors) as the same structure (`treespec`).

Leaves: tensors (`codecs.DenseCodec`/`BitsCodec`) and `NonTensorData` (`codecs.JsonCodec`); anything else raises
`SchemaError` naming the key. Column names: nested keys joined with "." ("next.reward"; a "." or "%" inside a key is
percent-encoded), a key named like a store column (seq, step, episode_id, actor) gets the suffix "__rl", a plain
tensor is the column "_tensor", pytree leaves are named by their path ("b.c.0").
"""

from __future__ import annotations

import importlib
import json
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_leaf_nontensor,
    is_non_tensor,
    is_tensor_collection,
    is_tensorclass,
)
from torch.utils import _pytree as pytree

from ...errors import SchemaError
from ...schema.spec import STREAM_KEYS, SYSTEM_COLUMNS
from .codecs import BitsCodec, Codec, DenseCodec, JsonCodec, check_json, codec_from, dtype_name, tensor_codec
from .slots import SLOT_COLUMN

#: schema metadata key of the layout (JSON)
METADATA_KEY = "torchrl.layout"
LAYOUT_VERSION = 1
TENSOR_COLUMN = "_tensor"
_RESERVED = frozenset(SYSTEM_COLUMNS) | frozenset(STREAM_KEYS)
KINDS = ("tensor", "tensordict", "tensorclass", "pytree")


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace(".", "%2E")


def _unescape(part: str) -> str:
    return part.replace("%2E", ".").replace("%25", "%")


def column_name(path: tuple[str, ...]) -> str:
    name = ".".join(_escape(p) for p in path)
    return f"{name}__rl" if name in _RESERVED else name


#: tensorclasses this process has stored, by name: a class defined inside a function is found here (in the process
#: that defined it) although it cannot be imported
_SEEN_CLASSES: weakref.WeakValueDictionary[str, type] = weakref.WeakValueDictionary()


def class_name(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    _SEEN_CLASSES[name] = cls
    return name


def import_class(name: str) -> type:
    """The class `module:qualname` names (a tensorclass stored in a layout)."""
    seen = _SEEN_CLASSES.get(name)
    if seen is not None:
        return seen
    module, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise SchemaError(f"the stored data are tensorclass {qual!r} of module {module!r}, which this process cannot "
                          "import (a class defined inside a function?); define the tensorclass at module level so "
                          "that every process that reads the storage can rebuild it") from None
    return obj


@dataclass(frozen=True)
class Leaf:
    """One stored leaf: its key path, its column, its codec and its feature shape (the dims after the element's)."""

    path: tuple[Any, ...]
    column: str
    codec: Codec
    feature: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        dtype = None if isinstance(self.codec, JsonCodec) else dtype_name(self.codec.dtype)
        return {"path": list(self.path), "column": self.column, "codec": self.codec.name, "dtype": dtype,
                "feature": list(self.feature)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Leaf:
        return Leaf(tuple(d["path"]), d["column"], codec_from(d["codec"], d.get("dtype")), tuple(d["feature"]))


@dataclass
class Layout:
    """How one kind of TorchRL data is stored (see the module doc)."""

    kind: str
    leaves: tuple[Leaf, ...]
    ndim: int = 1
    inner: tuple[int, ...] = ()
    extra: tuple[int, ...] = ()
    #: nested TensorDicts/tensorclasses: path -> their batch dims after the element's storage dims
    nodes: dict[tuple[str, ...], tuple[int, ...]] = field(default_factory=dict)
    #: tensorclasses: path (() for the root) -> "module:qualname"
    classes: dict[tuple[str, ...], str] = field(default_factory=dict)
    treespec: str | None = None
    _class_objects: dict[tuple[str, ...], type] = field(default_factory=dict, repr=False, compare=False)
    _spec: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # class objects (maybe local to a function) and the parsed treespec stay behind: they are rebuilt by name
        return {**self.__dict__, "_class_objects": {}, "_spec": None}

    # ------------------------------------------------------------------ properties
    @property
    def per_element(self) -> int:
        """Rows per entry along dim 0 (the product of the inner storage dims)."""
        return math.prod(self.inner)

    @property
    def columns_names(self) -> list[str]:
        return [leaf.column for leaf in self.leaves]

    def batch_of(self, leaf: Leaf) -> tuple[int, ...]:
        """The batch dims (after the storage dims) of the TensorDict that holds `leaf`."""
        for i in range(len(leaf.path) - 1, 0, -1):
            if tuple(leaf.path[:i]) in self.nodes:
                return self.nodes[tuple(leaf.path[:i])]
        return self.extra

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> str:
        return json.dumps({
            "version": LAYOUT_VERSION, "kind": self.kind, "ndim": self.ndim, "inner": list(self.inner),
            "extra": list(self.extra), "leaves": [leaf.to_dict() for leaf in self.leaves],
            "nodes": [[list(p), list(b)] for p, b in self.nodes.items()],
            "classes": [[list(p), c] for p, c in self.classes.items()], "treespec": self.treespec})

    @staticmethod
    def from_json(text: str) -> Layout:
        d = json.loads(text)
        if d.get("version") != LAYOUT_VERSION or d.get("kind") not in KINDS:
            raise SchemaError(f"a stored TorchRL layout of version {d.get('version')!r} (kind {d.get('kind')!r}) "
                              f"is not one this arrowbuf reads (version {LAYOUT_VERSION})")
        return Layout(d["kind"], tuple(Leaf.from_dict(x) for x in d["leaves"]), int(d["ndim"]), tuple(d["inner"]),
                      tuple(d["extra"]), {tuple(p): tuple(b) for p, b in d["nodes"]},
                      {tuple(p): c for p, c in d["classes"]}, d.get("treespec"))

    def schema(self, name: str) -> dict[str, Any]:
        """The store schema of this layout (every field `later`, so elements can be written in place)."""
        fields = {leaf.column: leaf.codec.field_spec((*self.extra, *leaf.feature)) for leaf in self.leaves}
        return {"name": name, "fields": fields, "episode_end": [], "truncation": [],
                "metadata": {METADATA_KEY: self.to_json()}}

    @staticmethod
    def from_schema(schema: Any) -> Layout:
        """The layout a store's schema records, or, for a store made elsewhere, the one its fields imply: a tensor
        for a lone `_tensor` field, else a TensorDict whose keys are the field names split at "."."""
        meta = getattr(schema, "metadata", {}) or {}
        if METADATA_KEY in meta:
            return Layout.from_json(meta[METADATA_KEY])
        leaves = []
        for f in schema.fields.values():
            if f.name == SLOT_COLUMN:
                continue
            if f.ragged:
                raise SchemaError(f"field {f.name!r} of the store is ragged; ArrowbufStorage reads fixed-shape fields "
                                  "(and JSON text it wrote itself)")
            codec = DenseCodec(getattr(torch, f.dtype.name))
            path = (TENSOR_COLUMN,) if f.name == TENSOR_COLUMN else tuple(_unescape(p) for p in _key(f.name).split("."))
            leaves.append(Leaf(path, f.name, codec, tuple(f.shape)))
        kind = "tensor" if [x.column for x in leaves] == [TENSOR_COLUMN] else "tensordict"
        return Layout(kind, tuple(leaves))

    # ------------------------------------------------------------------ inference
    @staticmethod
    def infer(data: Any, ndim: int = 1) -> Layout:
        """The layout of `data`, a batch whose first `ndim` dims are storage dims."""
        if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
            _check_dims(data.shape, ndim, "the tensor")
            codec = tensor_codec(data.dtype)
            return Layout("tensor", (Leaf((TENSOR_COLUMN,), TENSOR_COLUMN, codec, tuple(data.shape[ndim:])),), ndim,
                          tuple(data.shape[1:ndim]))
        if is_tensor_collection(data):
            return _infer_collection(data, ndim)
        return _infer_pytree(data, ndim)

    # ------------------------------------------------------------------ writing
    def broadcast(self, data: Any, shape: tuple[int, ...]) -> Any:
        """`data` with leading dims `shape` (the dims a write's index selects): as given, or expanded to them when
        it has fewer (`rb[:, 10:20] = td_of_10` writes the same 10 elements into every entry along dim 0).

        Raises:
            SchemaError: the data's leading dims do not match the index (naming both).
        """
        lead = _batch_shape(data)
        if self.kind in ("tensordict", "tensorclass"):
            lead = lead[:len(lead) - len(self.extra)] if self.extra else lead
            if tuple(lead) == shape:
                return data
            try:
                return data.expand(*shape, *self.extra)
            except (RuntimeError, ValueError):
                pass
        elif self.kind == "tensor":
            feature = self.leaves[0].feature
            lead = lead[:len(lead) - len(feature)] if feature else lead
            if tuple(lead) == shape:
                return data
            try:
                return data.expand(*shape, *feature)
            except RuntimeError:
                pass
        else:
            feature = self.leaves[0].feature
            lead = lead[:len(lead) - len(feature)] if feature else lead
            if tuple(lead) == shape:
                return data
        raise SchemaError(f"the write selects elements of shape {list(shape)} (the index's dims), the data has "
                          f"leading dims {list(lead)}")

    def columns(self, data: Any, lead: int, partial: bool = False, encode: bool = True) -> dict[str, Any]:
        """{column: values} of `data`, whose first `lead` dims are the written elements' (flattened into rows).
        `partial`: a TensorDict may bring a subset of the keys (an in-place write); otherwise every key, and no
        other, must be there. `encode=False` only checks (what `ArrowbufStorage` does before a writer moves its
        cursor) and returns nothing.

        Raises:
            SchemaError: the data does not fit the layout (kind, keys, dtypes, shapes), naming what differs.
        """
        kind = _kind(data)
        if kind != self.kind and not {kind, self.kind} <= {"tensordict", "tensorclass"}:
            raise SchemaError(f"the storage holds {self.kind} data (from its first write), got {kind}")
        rows = -1
        out: dict[str, Any] = {}
        if self.kind == "tensor":
            values = {self.leaves[0].column: data}
        elif self.kind == "pytree":
            flat, spec = pytree.tree_flatten(data)
            if self.treespec is not None and str(spec) != str(self._treespec()):
                raise SchemaError(f"the storage holds pytrees of structure {self._treespec()}, got {spec}")
            values = {leaf.column: v for leaf, v in zip(self.leaves, flat)}
        else:
            td = _as_tensordict(data)
            values = {}
            known = {leaf.path for leaf in self.leaves}
            for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
                path = (key,) if isinstance(key, str) else tuple(key)
                if path not in known:
                    raise SchemaError(f"key {'.'.join(path)!r} is not in the storage (its keys come from its first "
                                      f"write: {sorted('.'.join(p) for p in known)}); adding a key later is not "
                                      "supported by ArrowbufStorage (arrowbuf stores have a fixed schema): write "
                                      "every key from the first write on")
                values[column_name(path)] = value
            missing = [leaf for leaf in self.leaves if leaf.column not in values]
            if missing and not partial:
                raise SchemaError(f"keys {['.'.join(m.path) for m in missing]} are missing: every write must bring "
                                  "the keys of the storage's first write")
        for leaf in self.leaves:
            if leaf.column not in values:
                continue
            v = values[leaf.column]
            where = f"key {'.'.join(map(str, leaf.path))!r}"
            if isinstance(leaf.codec, JsonCodec):
                if not is_non_tensor(v):
                    raise SchemaError(f"{where} holds non-tensor data (NonTensorData) in the storage, got "
                                      f"{type(v).__name__}")
                flat_values = _flatten_nested(v.tolist(), lead)
                if encode:
                    out[leaf.column] = leaf.codec.encode_values(flat_values, where)
                else:
                    for value in flat_values:
                        check_json(value, where)
                n = len(flat_values)
            else:
                if not isinstance(v, torch.Tensor) or is_tensor_collection(v):
                    raise SchemaError(f"{where} holds tensors in the storage, got {type(v).__name__}")
                if v.is_nested:
                    raise SchemaError(f"{where}: nested (jagged) tensors cannot be stored by ArrowbufStorage "
                                      "(columns are fixed-shape per key); pad them")
                if v.dtype != leaf.codec.dtype:
                    raise SchemaError(f"{where} holds {leaf.codec.dtype} in the storage (from its first write), "
                                      f"got {v.dtype}; cast it")
                want = (*self.extra, *leaf.feature)
                got = tuple(v.shape[lead:])
                if got != want:
                    raise SchemaError(f"{where}: each element holds shape {list(want)} in the storage, got "
                                      f"{list(got)}")
                n = math.prod(v.shape[:lead])
                if encode:
                    out[leaf.column] = leaf.codec.encode(v.reshape(n, *got))
            if rows >= 0 and n != rows:
                raise SchemaError(f"{where}: {n} elements, the other keys have {rows}")
            rows = n
        return out

    # ------------------------------------------------------------------ reading
    def rebuild(self, got: dict[str, Any], shape: tuple[int, ...], device: torch.device) -> Any:
        """The data of gathered rows (`SampleBatch.to_numpy()` of `len == prod(shape)` rows) with the storage
        dims `shape` in front (the shape of the index that selected them)."""
        values: dict[str, Any] = {}
        for leaf in self.leaves:
            col = got[leaf.column]
            if isinstance(leaf.codec, JsonCodec):
                values[leaf.column] = _non_tensor(_nest(leaf.codec.decode_values(col), shape),
                                                  (*shape, *self.batch_of(leaf)))
            else:
                t = leaf.codec.decode(col, (*shape, *self.extra, *leaf.feature))
                values[leaf.column] = t if device.type == "cpu" else t.to(device)
        if self.kind == "tensor":
            return values[self.leaves[0].column]
        if self.kind == "pytree":
            return pytree.tree_unflatten([values[leaf.column] for leaf in self.leaves], self._treespec())
        return self._rebuild_collection(values, shape, device)

    def _rebuild_collection(self, values: dict[str, Any], shape: tuple[int, ...], device: torch.device) -> Any:
        batch = (*shape, *self.extra)
        dev = None if device.type == "meta" else device
        if not self.nodes and not self.classes:  # the common case: one constructor call
            nested: dict[str, Any] = {}
            for leaf in self.leaves:
                d = nested
                for part in leaf.path[:-1]:
                    d = d.setdefault(part, {})
                d[leaf.path[-1]] = values[leaf.column]
            return TensorDict(nested, batch_size=batch, device=dev)
        children: dict[tuple[str, ...], list[tuple[str, Any]]] = {}
        for leaf in self.leaves:
            for i in range(1, len(leaf.path)):
                parent, name = tuple(leaf.path[:i - 1]), leaf.path[i - 1]
                entry = children.setdefault(parent, [])
                if (name, None) not in entry:
                    entry.append((name, None))
            children.setdefault(tuple(leaf.path[:-1]), []).append((leaf.path[-1], leaf.column))

        def make(path: tuple[str, ...]) -> Any:
            own = (*shape, *self.nodes.get(path, self.extra)) if path else batch
            td = TensorDict({}, batch_size=own, device=dev)
            for name, column in children.get(path, []):
                td.set(name, values[column] if column is not None else make((*path, name)))
            cls_name = self.classes.get(path)
            if cls_name is None:
                return td
            cls: Any = self._class_objects.get(path) or import_class(cls_name)
            return cls.from_tensordict(td)

        return make(())

    def _treespec(self) -> Any:
        if self._spec is None:
            if self.treespec is None:
                raise SchemaError("a pytree layout without its structure")
            self._spec = pytree.treespec_loads(self.treespec)
        return self._spec


# ---------------------------------------------------------------------- helpers
def _key(column: str) -> str:
    return column[:-4] if column.endswith("__rl") and column[:-4] in _RESERVED else column


def _kind(data: Any) -> str:
    if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
        return "tensor"
    if is_tensorclass(data):
        return "tensorclass"
    if is_tensor_collection(data):
        return "tensordict"
    return "pytree"


def _check_dims(shape: Any, ndim: int, what: str) -> None:
    if len(shape) < ndim:
        raise SchemaError(f"{what} has {len(shape)} batch dim(s); a storage with ndim={ndim} needs at least {ndim}")
    if 0 in tuple(shape[1:]):
        raise SchemaError(f"{what} has an empty dim ({list(shape)}); arrowbuf fields have positive sizes")


def _batch_shape(data: Any) -> tuple[int, ...]:
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        return tuple(data.shape)
    return tuple(pytree.tree_flatten(data)[0][0].shape)


def _as_tensordict(data: Any) -> TensorDictBase:
    if isinstance(data, LazyStackedTensorDict):
        try:
            return data.contiguous()
        except RuntimeError as exc:
            raise SchemaError("a lazy stack of TensorDicts whose entries differ in shape (a ragged lazy stack) "
                              "cannot be stored by ArrowbufStorage: its columns are fixed-shape per key; pad the "
                              f"entries to one shape ({str(exc)[:120]})") from None
    if is_tensorclass(data):
        return data.to_tensordict()
    return data


def _infer_collection(data: Any, ndim: int) -> Layout:
    kind = _kind(data)
    classes: dict[tuple[str, ...], str] = {}
    objects: dict[tuple[str, ...], type] = {}
    if kind == "tensorclass":
        classes[()] = class_name(type(data))
        objects[()] = type(data)
    _check_dims(data.batch_size, ndim, "the TensorDict")
    root_batch = tuple(data.batch_size)
    extra = root_batch[ndim:]
    nodes: dict[tuple[str, ...], tuple[int, ...]] = {}
    leaves: list[Leaf] = []
    source = data if not isinstance(data, LazyStackedTensorDict) else _as_tensordict(data)
    for key, value in source.items(include_nested=True, leaves_only=False, is_leaf=is_leaf_nontensor):
        path = (key,) if isinstance(key, str) else tuple(key)
        where = f"key {'.'.join(path)!r}"
        if is_non_tensor(value):
            leaves.append(Leaf(path, column_name(path), JsonCodec()))
        elif is_tensor_collection(value):
            sub = tuple(value.batch_size)[ndim:]
            if sub != extra:
                nodes[path] = sub
            if is_tensorclass(value):
                classes[path] = class_name(type(value))
                objects[path] = type(value)
        elif isinstance(value, torch.Tensor):
            if value.is_nested:
                raise SchemaError(f"{where}: nested (jagged) tensors cannot be stored by ArrowbufStorage (columns "
                                  "are fixed-shape per key); pad them")
            feature = tuple(value.shape[len(root_batch):])
            if 0 in feature:
                raise SchemaError(f"{where} has an empty dim ({list(value.shape)}); arrowbuf fields have positive "
                                  "sizes")
            leaves.append(Leaf(path, column_name(path), tensor_codec(value.dtype), feature))
        else:
            raise SchemaError(f"{where}: values of type {type(value).__name__} cannot be stored by ArrowbufStorage")
    if not leaves:
        raise SchemaError("the TensorDict has no tensor or NonTensorData to store")
    columns = [leaf.column for leaf in leaves]
    if len(set(columns)) != len(columns):
        dup = sorted({c for c in columns if columns.count(c) > 1})
        raise SchemaError(f"keys map to the same column {dup}; rename them")
    layout = Layout(kind, tuple(leaves), ndim, root_batch[1:ndim], extra, nodes, classes)
    layout._class_objects.update(objects)
    return layout


def _infer_pytree(data: Any, ndim: int) -> Layout:
    try:
        flat, spec = pytree.tree_flatten_with_path(data)
    except Exception as exc:  # noqa: BLE001 (pytree raises what the container's flatten raises)
        raise SchemaError(f"ArrowbufStorage stores tensors, TensorDicts, tensorclasses and pytrees of tensors; "
                          f"{type(data).__name__} could not be flattened ({exc})") from None
    if not flat:
        raise SchemaError(f"ArrowbufStorage stores tensors, TensorDicts, tensorclasses and pytrees of tensors "
                          f"(dicts, lists, tuples); got {type(data).__name__} without tensors")
    leaves = []
    used: set[str] = set()
    inner = None
    for keypath, value in flat:
        parts = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keypath)
        if not isinstance(value, torch.Tensor) or is_tensor_collection(value):
            raise SchemaError(f"pytree leaf {pytree.keystr(keypath)} is a {type(value).__name__}; ArrowbufStorage "
                              "stores pytrees whose leaves are tensors")
        _check_dims(value.shape, ndim, f"pytree leaf {pytree.keystr(keypath)}")
        if inner is None:
            inner = tuple(value.shape[1:ndim])
        elif tuple(value.shape[1:ndim]) != inner:
            raise SchemaError(f"pytree leaves disagree on their storage dims (ndim={ndim}): {list(inner)} and "
                              f"{list(value.shape[1:ndim])}")
        col = column_name(parts) or "_leaf"
        while col in used:
            col += "_"
        used.add(col)
        leaves.append(Leaf(parts, col, tensor_codec(value.dtype), tuple(value.shape[ndim:])))
    try:
        spec_text = pytree.treespec_dumps(spec)
    except Exception as exc:  # noqa: BLE001 (a container type pytree cannot serialise)
        raise SchemaError(f"the pytree's structure ({type(data).__name__}) cannot be recorded: {exc}") from None
    layout = Layout("pytree", tuple(leaves), ndim, inner or (), (), treespec=spec_text)
    layout._spec = spec
    return layout


def _flatten_nested(values: Any, depth: int) -> list[Any]:
    """The first `depth` levels of nested lists flattened into one list (depth 0: the one value)."""
    if depth == 0:
        return [values]
    out = values
    for _ in range(depth - 1):
        out = [x for sub in out for x in sub]
    return list(out)


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    """`flat` (len == prod(shape)) as nested lists of `shape` (a single value for shape ())."""
    if not shape:
        return flat[0]
    out: Any = flat
    for dim in reversed(shape[1:]):
        out = [out[i:i + dim] for i in range(0, len(out), dim)]
    return out


def _non_tensor(nested: Any, shape: tuple[int, ...]) -> Any:
    """NonTensorData / NonTensorStack of `shape` holding `nested` (nested lists, one level per dim)."""
    if not shape:
        return NonTensorData(nested)
    if shape[0] == 0:
        return NonTensorData(None, batch_size=shape)
    return NonTensorStack(*[_non_tensor(x, shape[1:]) for x in nested], stack_dim=0)


__all__ = ["BitsCodec", "DenseCodec", "JsonCodec", "Layout", "Leaf", "METADATA_KEY", "TENSOR_COLUMN",
           "column_name"]
