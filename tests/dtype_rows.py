"""Rows of every dtype a field may have (bfloat16, float8, complex, float16, bool, json; plain fields beside them),
each row derived from its key k (written as `obs[0]`, so a row names itself in any store kind, sharded too), and the
checks that every row read anywhere holds exactly its own bits.

Used by the contract suites (tests/test_surface.py over every store kind, tests/test_tiers.py over every tier) and by
the dtype tests (tests/test_dtypes.py, persistence, Flight, shared memory across processes). Exactness is bit-exact:
NaN payloads, -0.0 and infinities of bfloat16, float8, float16 and complex values are compared as bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.schema import jsonvalues
from arrowbuf.schema.convert import tensor_to_numpy
from arrowbuf.schema.dtypes import LogicalType, to_physical

#: One field of every dtype; `note` (json) and `late` (bfloat16) are filled later by `update`.
DTYPES = {
    "name": "dtypes",
    "fields": {
        "obs": {"dtype": "float32", "shape": [3]},
        "bf": {"dtype": "bfloat16", "shape": [4]},
        "bf1": {"dtype": "bfloat16"},
        "f8": {"dtype": "float8_e4m3fn", "shape": [2]},
        "f8b": {"dtype": "float8_e5m2"},
        "cx": {"dtype": "complex64", "shape": [2]},
        "cz": {"dtype": "complex128"},
        "half": {"dtype": "float16", "shape": [2]},
        "flags": {"dtype": "bool", "shape": [3]},
        "meta": {"dtype": "json"},
        "lp": {"dtype": "bfloat16", "ragged": True},
        "note": {"dtype": "json", "later": True},
        "late": {"dtype": "bfloat16", "shape": [2], "later": True},
        "done": {"dtype": "bool"},
    },
}
#: The fields `update` fills.
LATER = ("note", "late")
EPISODE = 7

# bit patterns every bits column must carry through unchanged: NaNs with payloads (both signs), -0.0, infinities
_BF16_SPECIAL = np.array([0x7FC1, 0x8000, 0xFF81, 0x7F80], dtype=np.uint16)
_F16_SPECIAL = np.array([0x7E01, 0x8000], dtype=np.uint16)
_F32_NAN = np.array([0x7FC00123], dtype=np.uint32).view(np.float32)[0]  # a NaN with a payload


def _bits(k: np.ndarray, width: int, mult: int, dtype: Any) -> np.ndarray:
    j = np.arange(width, dtype=np.int64)
    return ((k[:, None] * mult + j[None, :] * 104729 + 11) % (np.iinfo(dtype).max + 1)).astype(dtype)


def meta_of(k: int) -> Any:
    """The json value of row `k` (strings with non-ASCII text, nested lists and dicts, -0.0, a big int, None)."""
    if k % 5 == 3:
        return None if k % 10 == 3 else [k, "x"]
    return {"seq": int(k), "text": f"é你好 {k}", "tool": [{"name": "f", "args": {"x": k * 0.1, "neg": -0.0}}],
            "big": 2**70 + k, "none": None, "ok": bool(k % 2)}


def lp_of(k: int) -> np.ndarray:
    """The ragged bfloat16 bits of row `k` (k % 4 values; a NaN with a payload and -0.0 in some rows)."""
    out = ((k * 911 + np.arange(k % 4) * 7) % 65536).astype(np.uint16)
    if k % 5 == 1 and len(out):
        out[0] = 0xFFC1 if k % 2 else 0x8000
    return out


def note_of(k: int) -> Any:
    return {"late": int(k), "msg": [{"role": "tool", "content": f"r{k}"}]}


def rows(k0: int, n: int) -> dict[str, Any]:
    """Steps with seq k0..k0+n-1 (when written from seq k0 on): numpy bits for the bits dtypes; an episode ends every
    EPISODE steps."""
    return rows_of(np.arange(k0, k0 + n, dtype=np.int64))


def rows_of(k: np.ndarray) -> dict[str, Any]:
    """The rows of keys `k` (any keys, in their order): what `rows` gives for each of them."""
    k = np.asarray(k, dtype=np.int64)
    n = len(k)
    bf = _bits(k, 4, 7919, np.uint16)
    bf[k % 5 == 0] = _BF16_SPECIAL
    half = _bits(k, 2, 257, np.uint16)
    half[k % 4 == 1] = _F16_SPECIAL
    cx = (k[:, None] + 1j * (-k[:, None] - np.arange(2))).astype(np.complex64)
    cx[k % 6 == 2, 0] = complex(_F32_NAN, -0.0)
    cz = (k / 3 + 1j * k * 1e300).astype(np.complex128)
    return {
        "obs": np.stack([k, k + 1, np.full(n, 7)], 1).astype(np.float32),
        "bf": bf,
        "bf1": ((k * 31337) % 65536).astype(np.uint16),
        "f8": _bits(k, 2, 37, np.uint8),
        "f8b": ((k * 53) % 256).astype(np.uint8),
        "cx": cx,
        "cz": cz,
        "half": half.view(np.float16),
        "flags": ((k[:, None] >> np.arange(3)) & 1).astype(bool),
        "meta": [meta_of(int(i)) for i in k],
        "lp": [lp_of(int(i)) for i in k],
        "done": (k % EPISODE) == EPISODE - 1,
    }


def torch_rows(k0: int, n: int) -> dict[str, Any]:
    """`rows` with the bits dtypes as torch tensors of their dtype (bfloat16, float8) and complex tensors."""
    import torch

    out = rows(k0, n)
    out["bf"] = torch.from_numpy(out["bf"].view(np.int16)).view(torch.bfloat16)
    out["bf1"] = torch.from_numpy(out["bf1"].view(np.int16)).view(torch.bfloat16)
    out["f8"] = torch.from_numpy(out["f8"]).view(torch.float8_e4m3fn)
    out["f8b"] = torch.from_numpy(out["f8b"]).view(torch.float8_e5m2)
    out["lp"] = [torch.from_numpy(r.view(np.int16)).view(torch.bfloat16) for r in out["lp"]]
    out["cx"] = torch.from_numpy(out["cx"])
    return out


def later_values(k: np.ndarray) -> dict[str, Any]:
    """What `update` writes into the fields filled later of rows `k`."""
    k = np.asarray(k, dtype=np.int64)
    late = _bits(k, 2, 8191, np.uint16)
    late[k % 3 == 0] = [0xFFC3, 0x0001]  # a negative NaN with a payload, a subnormal
    return {"note": [note_of(int(i)) for i in k], "late": late}


def _physical(col: Any) -> Any:
    """A column as `to_numpy` gives it, or an Arrow column as physical numpy / Python values."""
    if isinstance(col, (pa.Array, pa.ChunkedArray)):
        t = col.type
        if isinstance(t, pa.JsonType):
            return jsonvalues.decode(col)
        if pa.types.is_list(t) or pa.types.is_large_list(t):  # rows of values (a list of bits: their integers)
            return [None if v is None else np.asarray(v) for v in col.to_pylist()]
        if col.null_count:  # rows without a value: None, the others as arrays (bits as their integers)
            return [None if v is None else np.asarray(v) for v in col.to_pylist()]
        if isinstance(t, LogicalType):
            return to_physical(col)
        if isinstance(t, pa.FixedShapeTensorType):
            return tensor_to_numpy(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
        return col.to_numpy(zero_copy_only=False)
    return col


def _same_bits(got: Any, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.dtype.kind in "fc":
        want = want.view(np.dtype(f"u{want.dtype.itemsize // (2 if want.dtype.kind == 'c' else 1)}"))
        got = got.view(want.dtype) if got.dtype.itemsize == want.dtype.itemsize else \
            got.view(np.dtype(f"u{got.dtype.itemsize // 2}"))
    np.testing.assert_array_equal(got, want, err_msg=what)


def keys_of(cols: dict[str, Any]) -> np.ndarray:
    """The rows' keys: `obs[:, 0]`."""
    obs = _physical(cols["obs"])
    return np.asarray(obs)[:, 0].astype(np.int64)


def check_columns(cols: dict[str, Any], later: dict[int, bool] | None = None) -> np.ndarray:
    """Every row of `cols` (`to_numpy()` of a batch, or Arrow columns of a table; with `obs`) holds exactly the row
    its key names. `later`: key -> whether `update` wrote its later fields (a key not in it: unchecked; False: must
    be null). Returns the keys."""
    seqs = keys_of(cols)
    want = rows_of(seqs)  # only the rows asked for (keys reach 10^6 where a test offsets them by its pid)
    for name, col in cols.items():
        if name not in want and name not in LATER:
            continue
        got = _physical(col)
        if name == "meta":
            assert list(got) == want["meta"], name
            _check_negative_zero(got)
        elif name == "lp":
            assert len(got) == len(seqs)
            for row, s in zip(got, seqs.tolist()):
                np.testing.assert_array_equal(np.asarray(row).astype(np.int64), lp_of(s).astype(np.int64), "lp")
        elif name in LATER:
            _check_later(name, got, seqs, later)
        else:
            _same_bits(got, np.asarray(want[name]), name)
    return seqs


def _check_negative_zero(values: list[Any]) -> None:
    for v in values:
        if isinstance(v, dict):
            neg = v["tool"][0]["args"]["neg"]
            assert neg == 0.0 and np.signbit(neg), "json -0.0 came back without its sign"


def _check_later(name: str, got: Any, seqs: np.ndarray, later: dict[int, bool] | None) -> None:
    if later is None:
        return
    want = later_values(seqs)[name]
    for i, s in enumerate(seqs.tolist()):
        if s not in later:
            continue
        row = got[i]
        if not later[s]:
            assert row is None, f"{name} row {s}: expected no value, got {row!r}"
        elif name == "note":
            assert row == want[i], f"{name} row {s}"
        else:
            _same_bits(row, want[i], f"{name} row {s}")


def check_batch(batch: Any, later: dict[int, bool] | None = None) -> np.ndarray:
    """A sampled batch holds exactly its rows, in numpy and in torch; returns their keys."""
    keys = check_columns(batch.to_numpy(), later)
    check_torch(batch.to_torch())
    return keys


def check_torch(tensors: dict[str, Any]) -> None:
    """`to_torch()` gives tensors of the logical dtypes over exactly the rows' bits."""
    import torch

    seqs = tensors["obs"][:, 0].numpy().astype(np.int64)
    want = rows_of(seqs)
    kinds = {"bf": torch.bfloat16, "bf1": torch.bfloat16, "f8": torch.float8_e4m3fn, "f8b": torch.float8_e5m2,
             "cx": torch.complex64, "cz": torch.complex128, "half": torch.float16, "flags": torch.bool}
    for name, dtype in kinds.items():
        if name not in tensors:
            continue
        t = tensors[name]
        assert t.dtype == dtype, f"{name}: {t.dtype} != {dtype}"
        if dtype in (torch.bfloat16, torch.float16):
            got = t.view(torch.int16).numpy().view(np.uint16)
        elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            got = t.view(torch.uint8).numpy()
        else:
            got = t.numpy()
        _same_bits(got, np.asarray(want[name]), f"torch {name}")
    if "meta" in tensors:
        assert list(tensors["meta"]) == want["meta"]
    if "lp" in tensors:
        for row, s in zip(tensors["lp"], seqs.tolist()):
            assert row.dtype == torch.bfloat16
            np.testing.assert_array_equal(row.view(torch.int16).numpy().view(np.uint16), lp_of(s), "torch lp")


def _comparable(arr: Any) -> Any:
    """An Arrow column as Python values in which floats are their bits (so NaN payloads compare, and equal)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    t = arr.type
    if pa.types.is_floating(t):
        return arr.view({16: pa.uint16(), 32: pa.uint32(), 64: pa.uint64()}[t.bit_width]).to_pylist()
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = arr.value_lengths().to_pylist() if not pa.types.is_fixed_size_list(t) else None
        return arr.is_valid().to_pylist(), lengths, _comparable(arr.flatten())
    return arr.to_pylist()


def assert_same_table(a: pa.Table, b: pa.Table) -> None:
    """`a` and `b` hold the same columns, types and bits (`Table.equals` says NaN != NaN)."""
    assert a.schema.names == b.schema.names and a.num_rows == b.num_rows
    for name in a.schema.names:
        assert a.schema.field(name).type == b.schema.field(name).type, name
        assert _comparable(a.column(name)) == _comparable(b.column(name)), name


def check_table(table: pa.Table, later: dict[int, bool] | None = None) -> None:
    """A table of the store's rows (`to_table`, a checkpoint or dataset read back) holds exactly its rows, typed
    with the dtypes' Arrow types."""
    import arrowbuf as ab

    schema = ab.load_schema(DTYPES).to_arrow()
    for name in DTYPES["fields"]:
        assert table.schema.field(name).type == schema.field(name).type, name
    check_columns({n: table.column(n) for n in table.column_names}, later)


__all__ = ["DTYPES", "EPISODE", "LATER", "assert_same_table", "check_batch", "check_columns", "check_table",
           "check_torch", "keys_of", "later_values", "lp_of", "meta_of", "rows", "torch_rows"]
