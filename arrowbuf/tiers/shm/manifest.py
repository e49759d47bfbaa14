"""A shared store's manifest: reading and checking it (`read_manifest`), and the spec strings it records for the
sampler and rate-limiter objects (`to_spec`, `from_spec`).

The manifest is a file another process wrote: `read_manifest` checks every value attach relies on (types, ranges,
the arena and lock tables) before anything is mapped, and raises `StoreCorrupt` naming the file otherwise.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import os
from typing import Any
from urllib.parse import quote

import numpy as np

from ...errors import ArrowbufError, SchemaError, StoreCorrupt
from ...schema import load_schema
from .paths import FORMAT_VERSION, LOCK_SLOTS, MANIFEST, PAGE
from .trust import check_store_file, open_store_file

#: The largest manifest attach reads (a real one is a few KiB).
MAX_MANIFEST_BYTES = 4 << 20

#: Modules whose classes a manifest may name as the sampler or rate limiter (attach imports nothing else).
SPEC_MODULES = ("arrowbuf.samplers", "arrowbuf.rate_limiters")


def to_spec(obj: Any) -> str:
    """A spec string naming `obj`'s class and constructor arguments: ``arrowbuf.samplers:FifoSampler()``.

    Each parameter of the class's `__init__` is read back from the attribute of the same name; objects whose
    arguments are not recoverable that way (or not literals) cannot be shared and raise TypeError.
    """
    cls = type(obj)
    if cls.__module__ not in SPEC_MODULES:
        raise TypeError(f"{cls.__name__} cannot be recorded in a shared store's manifest: only classes of "
                        f"{', '.join(SPEC_MODULES)} can (other processes rebuild it from the manifest)")
    args = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(obj, p.name):
            if p.default is p.empty:
                raise TypeError(f"{cls.__name__}: argument {p.name!r} is not kept as an attribute of the same name; "
                                "it cannot be recorded in a shared store's manifest")
            continue
        value = getattr(obj, p.name)
        if isinstance(value, np.generic):
            value = value.item()
        if ast.literal_eval(repr(value)) != value:  # raises on non-literals too
            raise TypeError(f"{cls.__name__}.{p.name}={value!r} is not a literal")
        args.append(f"{p.name}={value!r}")
    return f"{cls.__module__}:{cls.__name__}({', '.join(args)})"


def from_spec(spec: str | None) -> Any:
    """Build the object a `to_spec` string names (classes of `SPEC_MODULES` only; arguments are literals)."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise ArrowbufError(f"a spec is a string like 'arrowbuf.samplers:FifoSampler()', got {type(spec).__name__}")
    module, _, call = spec.partition(":")
    if module not in SPEC_MODULES:
        raise ArrowbufError(f"manifest names {module!r}; expected one of {SPEC_MODULES}")
    try:
        node = ast.parse(call, mode="eval").body
    except SyntaxError:
        raise ArrowbufError(f"malformed spec {spec[:200]!r}: not a call expression") from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            and all(k.arg for k in node.keywords)):
        raise ArrowbufError(f"malformed spec {spec[:200]!r}")
    from ...rate_limiters import RateLimiter
    from ...samplers import Sampler

    cls = getattr(importlib.import_module(module), node.func.id, None)
    if not (isinstance(cls, type) and issubclass(cls, (Sampler, RateLimiter)) and cls.__module__ == module):
        raise ArrowbufError(f"spec {spec[:200]!r}: {module} has no sampler or rate-limiter class {node.func.id!r}")
    try:
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        return cls(**kwargs)
    except (ValueError, TypeError, ArrowbufError) as exc:
        raise ArrowbufError(f"spec {spec[:200]!r} does not build a {cls.__name__}: {exc}") from None


def read_manifest(path: str, name: str, dir_stat: os.stat_result, allow_other_owner: bool = False) -> dict[str, Any]:
    """Read and check the manifest of the store directory `path` (see the module docstring).

    Raises:
        FileNotFoundError: there is no manifest (yet: the store is being created).
        StoreNotTrusted: the manifest belongs to another user than the store, or others can write it.
        StoreCorrupt: it is not a manifest this arrowbuf wrote; the message names the file and what is wrong.
    """
    file = os.path.join(path, MANIFEST)
    fd = open_store_file(file, os.O_RDONLY)
    try:
        check_store_file(fd, file, name, dir_stat, allow_other_owner)
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)

    def bad(why: str) -> StoreCorrupt:
        return StoreCorrupt(f"shared store {name!r}: its manifest {file} {why}; the store cannot be attached. "
                            "Recreate it (or remove it with `arrowbuf shm rm`)")

    if len(raw) > MAX_MANIFEST_BYTES:
        raise bad(f"is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(m, dict):
        raise bad(f"holds a JSON {type(m).__name__}, expected an object")
    if m.get("format") != FORMAT_VERSION:
        raise bad(f"has format {str(m.get('format'))[:50]!r}; this arrowbuf reads format {FORMAT_VERSION}: open it "
                  "with the arrowbuf version that created it")
    try:
        _check_values(m, name)
    except _Bad as exc:
        raise bad(str(exc)) from None
    return m


class _Bad(Exception):
    """One thing wrong with a manifest (turned into StoreCorrupt naming the file)."""


def _need(m: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    if key not in m:
        raise _Bad(f"lacks {key!r}")
    v = m[key]
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise _Bad(f"has {key}={_short(v)}, expected {what}")
    return v


def _int(m: dict[str, Any], key: str, lo: int, hi: int, optional: bool = False) -> int | None:
    kinds: tuple[type, ...] = (int, type(None)) if optional else (int,)
    v = _need(m, key, kinds, f"an integer in [{lo}, {hi}]" + (" or null" if optional else ""))
    if v is not None and not lo <= v <= hi:
        raise _Bad(f"has {key}={v}, expected an integer in [{lo}, {hi}]")
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_values(m: dict[str, Any], name: str) -> None:
    if m.get("name") != name:
        raise _Bad(f"names the store {_short(m.get('name'))}, not {name!r}")
    try:
        load_schema(_need(m, "schema", (dict,), "a schema object"))
    except SchemaError as exc:
        raise _Bad(f"has an invalid schema ({str(exc)[:300]})") from None
    _int(m, "capacity", 1, 1 << 45)
    _int(m, "chunk_rows", 1, 1 << 45)
    _int(m, "final_obs_capacity", 0, 1 << 45, optional=True)
    _int(m, "max_times_sampled", 1, 1 << 31, optional=True)
    for key in ("sampler", "rate_limiter"):
        spec = _need(m, key, (str, type(None)), "a spec string or null")
        try:
            from_spec(spec)
        except ArrowbufError as exc:
            raise _Bad(f"has an unusable {key} ({exc})") from None
    owner = _need(m, "owner", (dict,), "an object with pid and start_time")
    _int(owner, "pid", 0, 1 << 31)
    _int(owner, "start_time", 0, 1 << 62)
    arenas = _need(m, "arenas", (dict,), "an object of arenas")
    for key, a in arenas.items():
        if not isinstance(a, dict):
            raise _Bad(f"has arena {_short(key)} = {_short(a)}, expected an object")
        if a.get("file") != "arena." + quote(key, safe=""):
            want = "arena." + quote(key, safe="")
            raise _Bad(f"has arena {_short(key)} in file {_short(a.get('file'))}, expected {want!r}")
        try:
            dtype = np.dtype(_need(a, "dtype", (str,), "a numpy dtype string"))
        except (TypeError, ValueError):
            raise _Bad(f"has arena {_short(key)} of dtype {_short(a.get('dtype'))}, not a numpy dtype") from None
        if dtype.hasobject or dtype.itemsize == 0 or dtype.kind not in "biufcSUV":
            raise _Bad(f"has arena {_short(key)} of dtype {dtype.str!r}, which an arena cannot hold")
        rows = _int(a, "rows", 0, 1 << 45) or 0
        shape = _need(a, "shape", (list,), "a list of dimensions")
        if len(shape) > 8 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 40
                                     for d in shape):
            raise _Bad(f"has arena {_short(key)} of shape {_short(shape)}, expected up to 8 non-negative sizes")
        nbytes = rows * math.prod(shape) * dtype.itemsize
        size = _int(a, "bytes", 0, 1 << 50)
        if size != max(PAGE, -(-nbytes // PAGE) * PAGE):
            raise _Bad(f"has arena {_short(key)} of {size} bytes, but {rows} rows of {dtype.str}{shape} take {nbytes}")
    locks = _need(m, "locks", (dict,), "an object with kind and slots")
    kind = _need(locks, "kind", (str,), "'pthread' or 'flock'")
    slots = _need(locks, "slots", (dict,), "an object of lock slots")
    if kind not in ("pthread", "flock"):
        raise _Bad(f"has locks of kind {_short(kind)}, expected 'pthread' or 'flock'")
    if (kind == "pthread") != ("tier.locks" in arenas):
        raise _Bad(f"has locks of kind {kind!r} but {'no' if kind == 'pthread' else 'an'} arena 'tier.locks'")
    taken = list(slots.values())
    if kind == "pthread" and (not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < LOCK_SLOTS
                                      for v in taken) or len(set(taken)) != len(taken)):
        raise _Bad(f"has lock slots {_short(slots)}; expected distinct slots in [0, {LOCK_SLOTS})")
