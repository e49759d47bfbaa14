"""The broadcast payload: a small JSON header and raw tensor bytes; no pickle unless a caller opts in.

Layout of a payload (one file per node, cut into buckets of `bucket_size` bytes that travel and are verified one by
one)::

    "ABBCAST2"  u64 header_len  header (UTF-8 JSON)  pad to 64  data: every tensor / Arrow stream 64-byte aligned

The header is a tree that mirrors the published object::

    {"format": "arrowbuf.broadcast/2", "data": <node>}
    node: {"k": "tensor", "torch": bool, "dtype": "float32", "shape": [..], "offset": o, "nbytes": n}
          {"k": "arrow", "type": "table" | "batch", "offset": o, "nbytes": n}     an Arrow IPC stream
          {"k": "dict", "items": {key: node, ..}}  {"k": "list" | "tuple", "items": [node, ..]}
          {"k": "json", "v": null | bool | int | float | str}
          {"k": "pickle", "offset": o, "nbytes": n}      only with allow_pickle=True on both ends (a loud warning)

Offsets count from the data start. Decoding validates the header before it touches the data (size bounds, nesting
depth, dtypes from a fixed list, shape x itemsize == nbytes, every span inside the payload), and returns views of the
buffer: read-only numpy arrays, or torch tensors over a private (copy-on-write) mapping.

Digests: BLAKE2b-128 of every bucket (`bucket_digests`), and the payload digest is the BLAKE2b-128 of the
concatenated bucket digests (so a node's copy is checked bucket by bucket as it arrives).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import BroadcastRefused, InvalidArgument, PickleWarning

MAGIC = b"ABBCAST2"
FORMAT = "arrowbuf.broadcast/2"
ALIGN = 64
PREFIX = len(MAGIC) + 8
MAX_HEADER = 64 << 20
MAX_DEPTH = 64
#: JSON containers ([ and {) a header may hold: far more than any published tree needs (a tensor node is one).
MAX_BRACKETS = 1 << 20

#: dtype name -> (numpy dtype of the stored bytes, itemsize). bfloat16 has no numpy dtype: numpy sees uint16.
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("<f8", 8), "float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<u2", 2),
    "int64": ("<i8", 8), "int32": ("<i4", 4), "int16": ("<i2", 2), "int8": ("i1", 1), "uint8": ("u1", 1),
    "uint16": ("<u2", 2), "uint32": ("<u4", 4), "uint64": ("<u8", 8), "bool": ("?", 1),
    "complex64": ("<c8", 8), "complex128": ("<c16", 16),
}


def digest_of(buf: Any) -> str:
    """BLAKE2b-128 (hex) of a bytes-like object."""
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def bucket_digests(buf: Any, bucket_size: int) -> list[str]:
    """The digest of every bucket of `buf`."""
    mv = memoryview(buf).cast("B")
    return [digest_of(mv[i:i + bucket_size]) for i in range(0, max(len(mv), 1), bucket_size)]


def combine(digests: list[str]) -> str:
    """The payload digest: BLAKE2b-128 of the concatenated bucket digests."""
    return digest_of(b"".join(bytes.fromhex(d) for d in digests))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Layout:
    """What `encode` made of an object: the header bytes, the payload size and the chunks to copy in."""

    def __init__(self, header: bytes, size: int, chunks: list[tuple[int, Any]]) -> None:
        self.header, self.size, self.chunks = header, size, chunks

    def write(self, buf: Any) -> None:
        """Write the payload into `buf` (a writable buffer of `size` bytes, e.g. a mapping): one copy per tensor."""
        out = np.frombuffer(buf, dtype=np.uint8, count=self.size)
        out[:PREFIX] = np.frombuffer(MAGIC + struct.pack("<Q", len(self.header)), np.uint8)
        out[PREFIX:PREFIX + len(self.header)] = np.frombuffer(self.header, np.uint8)
        for off, src in self.chunks:
            n = src.nbytes
            if n:
                out[off:off + n] = src


def _torch_bytes(t: Any) -> tuple[str, list[int], np.ndarray]:
    torch = sys.modules["torch"]
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgument(f"a tensor of dtype {t.dtype} cannot be broadcast (supported: {sorted(DTYPES)})")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    flat = t.reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return name, list(t.shape), raw.numpy()


def _numpy_bytes(a: np.ndarray) -> tuple[str, list[int], np.ndarray]:
    name = a.dtype.name
    if name not in DTYPES or a.dtype.byteorder == ">":
        raise InvalidArgument(f"an array of dtype {a.dtype} cannot be broadcast (supported: {sorted(DTYPES)})")
    c = np.ascontiguousarray(a)
    return name, list(a.shape), c.reshape(-1).view(np.uint8)


def encode(obj: Any, allow_pickle: bool = False) -> Layout:
    """Lay out `obj` (tensors, numpy arrays, Arrow tables and record batches, JSON scalars, in dicts with string keys,
    lists and tuples) as a payload. Anything else raises `InvalidArgument`, unless `allow_pickle` (then it is pickled,
    with a `PickleWarning`)."""
    chunks: list[tuple[int, Any]] = []
    pos = 0

    def put(src: np.ndarray) -> int:
        nonlocal pos
        off = pos
        chunks.append((off, src))
        pos = _align(pos + src.nbytes)
        return off

    def node(x: Any, depth: int) -> dict:
        if depth > MAX_DEPTH:
            raise InvalidArgument(f"the object nests deeper than {MAX_DEPTH} levels")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            name, shape, raw = _torch_bytes(x)
            return {"k": "tensor", "torch": True, "dtype": name, "shape": shape, "offset": put(raw),
                    "nbytes": int(raw.nbytes)}
        if isinstance(x, np.ndarray):
            name, shape, raw = _numpy_bytes(x)
            return {"k": "tensor", "torch": False, "dtype": name, "shape": shape, "offset": put(raw),
                    "nbytes": int(raw.nbytes)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"k": "json", "v": x}
        if isinstance(x, np.generic) and x.dtype.kind in "biuf":
            return {"k": "json", "v": x.item()}
        if isinstance(x, Mapping):
            if not all(isinstance(k, str) for k in x):
                return fallback(x, "a mapping with keys other than strings")
            return {"k": "dict", "items": {k: node(v, depth + 1) for k, v in x.items()}}
        if isinstance(x, (list, tuple)):
            return {"k": "tuple" if isinstance(x, tuple) else "list", "items": [node(v, depth + 1) for v in x]}
        pa = sys.modules.get("pyarrow")
        if pa is not None and isinstance(x, (pa.Table, pa.RecordBatch)):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, x.schema) as w:
                w.write(x)
            buf = sink.getvalue()
            raw = np.frombuffer(buf, dtype=np.uint8)
            return {"k": "arrow", "type": "table" if isinstance(x, pa.Table) else "batch", "offset": put(raw),
                    "nbytes": int(raw.nbytes)}
        return fallback(x, f"a {type(x).__name__}")

    def fallback(x: Any, what: str) -> dict:
        if not allow_pickle:
            raise InvalidArgument(f"{what} cannot be broadcast without pickle: send tensors, numpy arrays, Arrow "
                                  "tables, JSON scalars in dicts (string keys) and lists, or opt in with "
                                  "allow_pickle=True (unsafe: see PickleWarning)")
        import pickle

        warnings.warn(f"broadcasting {what} by pickle (allow_pickle=True): anyone who can write the payload can "
                      "run code in every process that loads it", PickleWarning, stacklevel=4)
        raw = np.frombuffer(pickle.dumps(x, protocol=5), dtype=np.uint8)
        return {"k": "pickle", "offset": put(raw), "nbytes": int(raw.nbytes)}

    tree = node(obj, 0)
    header = json.dumps({"format": FORMAT, "data": tree}, separators=(",", ":")).encode()
    data_start = _align(PREFIX + len(header))
    return Layout(header, max(data_start + pos, 1), [(data_start + o, c) for o, c in chunks])


def read_header(buf: Any) -> tuple[dict, int]:
    """(header tree, data start) of a payload; refuses a malformed one before reading its data."""
    mv = memoryview(buf).cast("B")
    if len(mv) < PREFIX or bytes(mv[:len(MAGIC)]) != MAGIC:
        raise BroadcastRefused("not an arrowbuf broadcast payload (bad magic)")
    (hlen,) = struct.unpack_from("<Q", mv, len(MAGIC))
    if hlen > MAX_HEADER or PREFIX + hlen > len(mv):
        raise BroadcastRefused(f"broadcast header of {hlen} bytes does not fit the payload ({len(mv)} bytes)")
    raw = bytes(mv[PREFIX:PREFIX + hlen])
    if raw.count(b"[") + raw.count(b"{") > MAX_BRACKETS:  # nesting is bounded below; this bounds the parse
        raise BroadcastRefused(f"broadcast header has more than {MAX_BRACKETS} JSON containers")
    try:
        head = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; deep nesting recurses
        raise BroadcastRefused(f"broadcast header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or "data" not in head:
        raise BroadcastRefused(f"broadcast header has no {FORMAT} tree")
    return head["data"], _align(PREFIX + hlen)


def _span(n: dict, start: int, size: int) -> tuple[int, int]:
    off, nbytes = n.get("offset"), n.get("nbytes")
    if not (isinstance(off, int) and isinstance(nbytes, int) and off >= 0 and nbytes >= 0
            and start + off + nbytes <= size):
        raise BroadcastRefused(f"broadcast header: span {off}+{nbytes} outside the payload")
    return start + off, nbytes


def _tensor_spec(n: dict) -> tuple[str, list[int]]:
    dtype, shape = n.get("dtype"), n.get("shape")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BroadcastRefused(f"broadcast header: unknown dtype {str(dtype)[:40]!r}")
    if not (isinstance(shape, list) and len(shape) <= 64
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in shape)):
        raise BroadcastRefused(f"broadcast header: bad shape {str(shape)[:80]}")
    if math.prod(shape) * DTYPES[dtype][1] != n.get("nbytes"):
        raise BroadcastRefused(f"broadcast header: shape {shape} of {dtype} is not {n.get('nbytes')} bytes")
    return dtype, shape


def decode(buf: Any, *, torch_views: bool = False, allow_pickle: bool = False) -> Any:
    """The object a payload holds, its tensors as views of `buf` (no copy).

    `torch_views`: tensors become torch tensors (`buf` must be writable: map the file copy-on-write, so a write
    stays private to this process); else read-only numpy arrays. A pickled leaf needs `allow_pickle` (a warning).

    Raises:
        BroadcastRefused: anything malformed in the header or the body; never another error.
    """
    try:
        return _decode(buf, torch_views, allow_pickle)
    except BroadcastRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - anything a malformed payload provokes is a refusal, never a crash
        raise BroadcastRefused(f"broadcast payload refused: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _decode(buf: Any, torch_views: bool, allow_pickle: bool) -> Any:
    mv = memoryview(buf).cast("B")
    tree, start = read_header(mv)
    size = len(mv)
    torch: Any = None
    if torch_views:
        import torch as torch_module

        torch = torch_module

    def tensor(n: dict) -> Any:
        dtype, shape = _tensor_spec(n)
        off, nbytes = _span(n, start, size)
        if torch is not None:
            tdt = getattr(torch, dtype)
            if nbytes == 0:
                return torch.empty(shape, dtype=tdt)
            return torch.frombuffer(mv, dtype=tdt, count=nbytes // DTYPES[dtype][1], offset=off).view(shape)
        return np.frombuffer(mv, dtype=DTYPES[dtype][0], count=nbytes // DTYPES[dtype][1], offset=off).reshape(shape)

    def walk(n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(n, dict):
            raise BroadcastRefused("broadcast header: malformed tree")
        k = n.get("k")
        if not isinstance(k, str):
            raise BroadcastRefused("broadcast header: a node kind is not a string")
        if k == "tensor":
            return tensor(n)
        if k == "json":
            v = n.get("v")
            if not (v is None or isinstance(v, (bool, int, float, str))):
                raise BroadcastRefused("broadcast header: a json leaf is not a scalar")
            return v
        if k == "dict" and isinstance(n.get("items"), dict):
            return {key: walk(v, depth + 1) for key, v in n["items"].items()}
        if k in ("list", "tuple") and isinstance(n.get("items"), list):
            items = [walk(v, depth + 1) for v in n["items"]]
            return tuple(items) if k == "tuple" else items
        if k == "arrow" and n.get("type") in ("table", "batch") and isinstance(n.get("type"), str):
            import pyarrow as pa

            off, nbytes = _span(n, start, size)
            src = pa.py_buffer(mv[off:off + nbytes])
            try:
                reader = pa.ipc.open_stream(src)
                out = reader.read_all() if n["type"] == "table" else reader.read_next_batch()
                out.validate(full=False)
            except (pa.ArrowException, OSError, StopIteration) as exc:  # wrong bytes: invalid, unimplemented, IO
                raise BroadcastRefused(f"broadcast payload: bad Arrow stream: {str(exc)[:200]}") from exc
            return out
        if k == "pickle":
            off, nbytes = _span(n, start, size)
            if not allow_pickle:
                raise BroadcastRefused("the payload holds a pickled object; loading it runs code: pass "
                                       "allow_pickle=True only if you trust every writer of this broadcast")
            import pickle

            warnings.warn("loading a pickled broadcast object (allow_pickle=True)", PickleWarning, stacklevel=3)
            return pickle.loads(mv[off:off + nbytes])
        raise BroadcastRefused(f"broadcast header: unknown node kind {k!r}")

    return walk(tree, 0)


def flat_tensors(obj: Any) -> dict[str, Any]:
    """The tensors of a decoded state_dict-like tree, by dotted name (nested dicts joined with '.')."""
    out: dict[str, Any] = {}

    def go(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                go(f"{prefix}{k}.", v)
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            out[prefix[:-1]] = x

    go("", obj)
    return out

