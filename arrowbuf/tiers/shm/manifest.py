"""A shared store's manifest: reading and checking it (`read_manifest`).

The manifest is a file another process wrote: `read_manifest` checks every value attach relies on (types, ranges,
the arena and lock tables) before anything is mapped, and raises `StoreCorrupt` naming the file otherwise. What the
store above records in it (its schema, sampler and rate-limiter specs) is checked here for its shape only; the store
decodes it on attach (`arrowbuf.samplers.spec`, `arrowbuf.schema`) and names this file when that fails.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any
from urllib.parse import quote

import numpy as np

from ...errors import StoreCorrupt
from .paths import FORMAT_VERSION, LOCK_SLOTS, MANIFEST, PAGE
from .trust import check_store_file, open_store_file

#: The largest manifest attach reads (a real one is a few KiB).
MAX_MANIFEST_BYTES = 4 << 20

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
    _need(m, "schema", (dict,), "a schema object")  # the store's options: `StoreOptions.from_dict` checks them
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
