"""Every torch and numpy dtype stored exactly, and JSON values without pickle (issue 40): schemas, the conversions
at the edges (torch tensors, ml_dtypes arrays, bits, Arrow), refusals that write nothing, bit-exact round trips
through checkpoints, the journal after kill -9, datasets read by pyarrow, DuckDB and Polars, Flight in parts and
shared memory across processes. The contract over every store kind is tests/test_surface.py
(`test_every_dtype_round_trips_bit_exactly`), over every tier tests/test_tiers.py; the rows and checks are
tests/dtype_rows.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import dtype_rows as D
import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.schema import dtypes, jsonvalues
from arrowbuf.schema.dtypes import BITS

TESTS = os.path.dirname(os.path.abspath(__file__))


def _store(**kw):
    return ab.ExperienceStore(D.DTYPES, capacity=kw.pop("capacity", 256), seed=0, chunk_rows=16, **kw)


def _filled(store, n=40):
    ids = store.extend(D.rows(0, n))
    written = np.arange(0, n, 4)
    store.update(ids[written], D.later_values(written))
    return {int(k): bool(k % 4 == 0) for k in range(n)}


# ---------------------------------------------------------------------------------------------------- schemas
def test_every_dtype_is_declared_by_name_and_the_refusal_lists_them(tmp_path):
    names = ["bool", "int8", "uint64", "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
             *BITS, "json"]
    schema = ab.load_schema({"fields": {f"f{i}": n for i, n in enumerate(names)}})
    assert [f.dtype_name for f in schema.fields.values()] == names
    assert ab.load_schema(schema.to_dict()) == schema
    assert ab.load_schema(schema.to_arrow()).to_dict() == schema.to_dict()
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nfields:\n  h: {dtype: bfloat16, shape: [2, 3]}\n  m: json\n  z: {dtype: float8_e5m2}\n")
    s = ab.load_schema(path)
    assert s.fields["h"].arrow_type() == dtypes.arrow_type("bfloat16", (2, 3)) and s.fields["m"].is_json
    with pytest.raises(ab.SchemaError) as err:
        ab.load_schema({"fields": {"x": "bfloat17"}})
    for n in ("bfloat16", "float8_e4m3fn", "float8_e8m0fnu", "complex64", "json", "float16", "bool"):
        assert n in str(err.value)
    for bad, words in [({"dtype": "json", "shape": [2]}, "shape"), ({"dtype": "json", "ragged": True}, "ragged"),
                       ({"dtype": "complex64", "ragged": True}, "ragged complex64"),
                       ({"dtype": "complex32"}, "unknown dtype")]:
        with pytest.raises(ab.SchemaError, match=words):
            ab.load_schema({"fields": {"x": bad}})
    with pytest.raises(ab.SchemaError, match="derive"):
        ab.load_schema({"fields": {"o": {"dtype": "bfloat16", "shape": [2]}}, "derived": {"n": {"next_of": "o"}}})
    assert ab.FieldSpec("x", "bfloat16").dtype == np.uint16  # type: ignore[arg-type]


def test_the_extension_types_survive_ipc_parquet_and_pickle(tmp_path):
    import pickle

    import pyarrow.parquet as pq

    with _store() as store:
        _filled(store)
        table = store.to_table()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    back = pa.ipc.open_file(sink.getvalue()).read_all()
    assert back.schema == table.schema
    D.assert_same_table(back, table)
    pq.write_table(table, tmp_path / "t.parquet")
    D.assert_same_table(pq.read_table(tmp_path / "t.parquet"), table)
    D.assert_same_table(pickle.loads(pickle.dumps(table)), table)
    D.check_table(back, {k: k % 4 == 0 for k in range(40)})


# ---------------------------------------------------------------------------------------------------- conversions
def test_floats_round_to_bfloat16_as_torch_rounds():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[~np.isnan(values)]
    values = np.concatenate([values, np.float32([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.3e38, 1.00390625,
                                                 1.01171875])])  # ties to even both ways
    ours = dtypes.round_to_bfloat16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    wide = rng.standard_normal(50_000) * 10.0 ** rng.integers(-40, 38, 50_000)  # float64: through float32, as torch
    np.testing.assert_array_equal(dtypes.round_to_bfloat16(wide),
                                  torch.from_numpy(wide).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    nan = np.array([0x7FC00001, 0xFF800001], dtype=np.uint32).view(np.float32)  # quiet and signalling NaNs
    out = dtypes.round_to_bfloat16(nan)
    assert np.isnan(dtypes.bfloat16_to_float32(out)).all() and (out >> 15).tolist() == [0, 1]  # sign kept


def test_every_input_form_of_a_bits_field_stores_the_same_bits():
    want = np.array([[0x3FC0, 0x7FC1], [0x8000, 0xFF80]], dtype=np.uint16)  # 1.5, a NaN payload, -0.0, -inf
    forms = {
        "uint16 bits": want, "int16 bits": want.view(np.int16),
        "torch bfloat16": torch.from_numpy(want.view(np.int16)).view(torch.bfloat16),
        "torch int16 bits": torch.from_numpy(want.view(np.int16)),
        "ml_dtypes": want.view(ml_dtypes.bfloat16),
        "arrow extension": dtypes.to_arrow(dtypes.arrow_type("bfloat16", (2,)), want),
        "arrow storage": pa.FixedSizeListArray.from_arrays(pa.array(want.reshape(-1)), 2),
        "arrow tensor of bits": pa.FixedShapeTensorArray.from_numpy_ndarray(want),
    }
    with ab.ExperienceStore({"fields": {"x": {"dtype": "bfloat16", "shape": [2]}}}, 100) as store:
        for what, v in forms.items():
            ids = store.extend({"x": v})
            got = store.take(ids).to_numpy()["x"]
            np.testing.assert_array_equal(got, want, err_msg=what)
        t = torch.tensor([[1.5, 1.00390625], [-0.0, float("-inf")]])
        ids = store.extend({"x": t.numpy()})  # floats: rounded to nearest even, as torch rounds
        np.testing.assert_array_equal(store.take(ids).to_numpy()["x"],
                                      t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        n = len(store)
        for bad, words in [(np.ones((2, 2), np.int32), "int32"), (np.full((2, 2), 1e39), "out of the range"),
                           (np.ones((2, 2), np.complex64), "complex64")]:
            with pytest.raises(ab.SchemaError, match=words):
                store.extend({"x": bad})
        assert len(store) == n


def test_a_tensor_of_another_dtype_converts_exactly_or_is_refused():
    schema = {"fields": {"f8": "float8_e4m3fn", "bf": "bfloat16", "f32": "float32", "c": "complex64"}}
    with ab.ExperienceStore(schema, 100) as store:
        f8 = torch.tensor([0.5, -448.0]).to(torch.float8_e4m3fn)
        ids = store.extend({"f8": f8, "bf": f8, "f32": f8.to(torch.bfloat16), "c": torch.tensor([1 + 2j, 3j])})
        t = store.take(ids).to_torch()
        assert t["bf"].tolist() == [0.5, -448.0] and t["f32"].tolist() == [0.5, -448.0]  # exact widenings
        assert t["c"].tolist() == [1 + 2j, 3j]
        with pytest.raises(ab.SchemaError, match="f8.*rounding"):
            store.extend({"f8": torch.tensor([0.5, 1.0]).to(torch.bfloat16), "bf": f8, "f32": [1.0, 2.0],
                          "c": [1j, 2j]})
        with pytest.raises(ab.SchemaError, match="f32.*complex"):
            store.extend({"f8": f8, "bf": f8, "f32": np.array([1j, 2j]), "c": [1j, 2j]})
        assert len(store) == 2


@pytest.mark.parametrize("name,nan,inf", [("bfloat16", 0x7FC1, 0xFF80), ("float8_e4m3fn", 0xFF, None),
                                          ("float8_e4m3fnuz", 0x80, None), ("float8_e5m2", 0x7E, 0xFC),
                                          ("float8_e5m2fnuz", 0x80, None), ("float8_e8m0fnu", 0xFF, None)])
def test_allow_nan_false_refuses_each_formats_nan_and_infinities(name, nan, inf):
    bits = BITS[name].bits
    # every NaN and infinity of the format, as torch decodes it
    every = np.arange(2 ** (8 * bits.itemsize), dtype=np.int64).astype(bits)
    decoded = torch.from_numpy(every.view(np.int16) if bits.itemsize == 2 else every).view(
        getattr(torch, name)).float().numpy()
    np.testing.assert_array_equal(BITS[name].nonfinite(every), ~np.isfinite(decoded))
    with ab.ExperienceStore({"fields": {"x": {"dtype": name, "allow_nan": False}}}, 10) as store:
        for bad in [nan, inf]:
            if bad is not None:
                with pytest.raises(ab.SchemaError, match="allow_nan"):
                    store.extend({"x": np.array([0, bad], bits)})
        assert len(store) == 0
        store.extend({"x": np.array([0, 1], bits)})


def test_complex_values_keep_their_bits_and_real_numbers_convert():
    nan = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
    values = np.array([complex(nan, -0.0), complex(np.inf, 1e-45), 3 - 4j], np.complex64)
    with ab.ExperienceStore({"fields": {"c": "complex64", "r": {"dtype": "complex128", "allow_nan": False}}},
                            10) as store:
        ids = store.extend({"c": values, "r": [1, 2.5, -3]})
        got = store.take(ids).to_numpy()
        np.testing.assert_array_equal(got["c"].view(np.uint32), values.view(np.uint32))
        assert got["r"].dtype == np.complex128 and got["r"].tolist() == [1, 2.5, -3]
        with pytest.raises(ab.SchemaError, match="allow_nan"):
            store.extend({"c": values, "r": values})
        with pytest.raises(ab.SchemaError, match="out of the range"):
            store.extend({"c": np.array([1e300, 1, 1], np.complex128), "r": [1, 2, 3]})
        assert len(store) == 3


# ---------------------------------------------------------------------------------------------------- JSON
JSON_VALUES = [None, True, False, 0, -1, 2**100, -(2**70), 0.1, -0.0, 1e308, 5e-324, "", "é你好\n\"\\", [], {},
               [1, [2, [3, {"a": None}]]], {"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
               "\ud800 lone surrogate", {"k" * 1000: "v" * 10000}, np.int64(5), np.float32(0.5), np.bool_(True)]


def test_json_values_round_trip_equal_everywhere_they_are_read():
    with ab.ExperienceStore({"fields": {"m": "json", "k": "int64"}}, 100) as store:
        ids = store.extend({"m": JSON_VALUES, "k": np.arange(len(JSON_VALUES))})
        store.append({"m": {"appended": [1, 2]}, "k": 99})
        want = [v.item() if isinstance(v, np.generic) else v for v in JSON_VALUES] + [{"appended": [1, 2]}]
        b = store.take(np.append(ids, ids[-1] + 1))
        got = b.to_numpy()["m"]
        assert got == want and b.to_torch()["m"] == want
        assert [type(v) for v in got] == [type(v) for v in want]
        assert math.copysign(1.0, got[8]) == -1.0  # -0.0 kept its sign
        text = b.data.column("m")
        assert isinstance(text.type, pa.JsonType)
        assert [json.loads(s) for s in text.storage.to_pylist()] == want  # any JSON reader gets the values
        assert jsonvalues.decode(store.to_table().column("m")) == want
        sql = store.sql("SELECT json_extract_string(m, '$.role') AS role FROM experience WHERE k = 16")
        assert sql.column("role").to_pylist() == ["user"]


class _Obj:
    pass


def _nested(depth):
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


_LOOP: list = []
_LOOP.append(_LOOP)


_NOT_JSON = [
    ({1, 2}, "set is not JSON"), ((1, 2), "tuple is not JSON"), (b"x", "bytes is not JSON"),
    (_Obj(), "_Obj is not JSON"), (float("nan"), "nan is not a JSON number"), ([float("inf")], "inf is not"),
    (np.float32("nan"), "not a JSON number"), ({1: "a"}, "key 1 .int. is not a string"),
    ({"a": {(1,): 2}}, "is not a string"), (_nested(10_000), "nested more than 64"), (_LOOP, "nested more than 64"),
    ({"a": np.zeros(2)}, "ndarray is not JSON"), (torch.zeros(1), "Tensor is not JSON"), (10 ** 5000, "not encodable"),
]


@pytest.mark.parametrize("value,words", _NOT_JSON, ids=[w.split(" ")[0] + str(i) for i, (_, w) in enumerate(_NOT_JSON)])
def test_what_is_not_json_is_refused_naming_the_field_and_nothing_is_written(value, words):
    with ab.ExperienceStore({"fields": {"meta": "json", "k": "int64"}}, 100) as store:
        store.extend({"meta": [1], "k": [0]})
        with pytest.raises(ab.SchemaError, match=f"field 'meta' row 1: .*{words}"):
            store.extend({"meta": [{"fine": 1}, value], "k": [1, 2]})
        with pytest.raises(ab.SchemaError, match="field 'meta'"):
            store.append({"meta": value, "k": 3})
        assert len(store) == 1


@pytest.mark.parametrize("text,words", [('{"a": 1', "not valid JSON"), ("NaN", "not a JSON number"),
                                        ("[" * 100 + "]" * 100, "nested more than 64"),
                                        ("[" * 100_000 + "]" * 100_000, "nested more than 64")])
def test_json_text_from_arrow_is_parsed_and_checked(text, words):
    with ab.ExperienceStore({"fields": {"meta": "json"}}, 100) as store:
        with pytest.raises(ab.SchemaError, match=words):
            store.extend(pa.table({"meta": pa.array(['{"ok": 1}', text])}))
        with pytest.raises(ab.SchemaError, match="UTF-8"):
            store.extend(pa.table({"meta": pa.array([b'"\xff"'], pa.binary())}))
        store.extend(pa.table({"meta": pa.array(['{"ok":  [1, 2]}', "null"])}))  # the text as given
        assert store.to_table().column("meta").combine_chunks().storage.to_pylist() == ['{"ok":  [1, 2]}', "null"]


def test_a_value_over_the_size_bound_is_refused(monkeypatch):
    monkeypatch.setattr(jsonvalues, "MAX_VALUE_BYTES", 1000)
    with ab.ExperienceStore({"fields": {"meta": "json"}}, 100) as store:
        with pytest.raises(ab.SchemaError, match="more than the 1000"):
            store.extend({"meta": ["x" * 2000]})
        assert len(store) == 0


# ---------------------------------------------------------------------------------------------------- delivery
def test_to_torch_is_a_zero_copy_view_of_the_sampled_bits():
    with ab.ExperienceStore({"fields": {"x": {"dtype": "bfloat16", "shape": [4096]}}}, 64) as store:
        store.extend({"x": torch.randn(64, 4096).to(torch.bfloat16)})
        batch = store.sample(32)
        col = batch["x"]
        address = col.storage.values.buffers()[1].address
        t = batch.to_torch()["x"]
        assert t.dtype == torch.bfloat16 and t.shape == (32, 4096) and t.data_ptr() == address
        x = batch.to_numpy()["x"]
        assert x.dtype == np.uint16 and x.ctypes.data == address and x.flags.writeable
        stored = store.take(batch.indices[:1]).to_numpy()["x"][0, 0]
        t[0, 0] = 3.0 if stored != 0x4040 else 5.0
        assert x[0, 0] == t[0, 0].view(torch.int16).item() & 0xFFFF  # one memory: the batch's own
        assert store.take(batch.indices[:1]).to_numpy()["x"][0, 0] == stored  # not the store's


def test_dataframes_and_sql_see_the_documented_types():
    with _store() as store:
        _filled(store, 20)
        pdf = store.to_pandas()
        assert pdf["bf1"].dtype == np.uint16 and isinstance(pdf["meta"][0], str)
        pl = store.to_polars()
        assert str(pl.schema["bf"]).startswith("Array(UInt16") and str(pl.schema["f8b"]) == "UInt8"
        assert str(pl.schema["cx"]).startswith("Array(Float32") and str(pl.schema["meta"]) == "String"
        out = store.sql("SELECT bf1, cz, half, meta, note FROM experience ORDER BY seq LIMIT 2")
        assert out.schema.field("bf1").type == pa.uint16()
        assert out.schema.field("half").type == pa.list_(pa.float32(), 2)  # float16 as float32: DuckDB has no half
        assert out.column("cz").to_pylist()[1] == [1 / 3, 1e300]
        assert json.loads(out.column("meta").to_pylist()[0]) == D.meta_of(0)
        assert store.sql("SELECT count(*) AS n FROM experience WHERE half[1] = half[1]").column("n")[0].as_py() > 0


def test_where_filters_take_float16_and_refuse_bits_columns():
    with ab.ExperienceStore({"fields": {"h": "float16", "x": "bfloat16", "m": "json"}}, 100,
                            tasks=["a", "b"]) as store:
        store.extend({"h": np.float16([1, 2, 3]), "x": [1.0, 2.0, 3.0], "m": [1, 2, 3]})
        assert store.consume("a", n=3, where="h > 1.5").to_numpy()["h"].tolist() == [2.0, 3.0]
        for where in ("x > 1.5", "m = 2"):
            with pytest.raises(ab.InvalidArgument, match="bfloat16"):
                store.consume("b", n=3, where=where)


# ---------------------------------------------------------------------------------------------------- hypothesis
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids,
                                                                                              max_size=4),
                     max_leaves=20)
_DTYPES = st.sampled_from(["bfloat16", *BITS, "complex64", "complex128", "float16", "bool", "int8", "json"])


@st.composite
def _schemas(draw):
    n = draw(st.integers(1, 4))
    fields = {}
    for i in range(n):
        name = draw(_DTYPES)
        spec: dict = {"dtype": name}
        shaped = draw(st.integers(0, 2))
        if name in BITS and shaped == 2:
            spec["ragged"] = True
        elif name != "json" and shaped:
            spec["shape"] = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
        if draw(st.integers(0, 3)) == 0:
            spec["later"] = True
        fields[f"f{i}"] = spec
    return ab.load_schema({"name": "h", "fields": fields})


def _values(draw, spec, n):
    if spec.is_json:
        return [draw(_JSON) for _ in range(n)]
    if spec.ragged:
        lengths = [draw(st.integers(0, 4)) for _ in range(n)]
        return [np.frombuffer(draw(st.binary(min_size=k * spec.dtype.itemsize, max_size=k * spec.dtype.itemsize)),
                              dtype=spec.dtype).copy() for k in lengths]
    shape = (n, *spec.shape)
    size = int(np.prod(shape))
    raw = draw(st.binary(min_size=size * spec.dtype.itemsize, max_size=size * spec.dtype.itemsize))
    arr = np.frombuffer(raw, dtype=np.uint8).copy().view(spec.dtype if spec.dtype.kind != "b" else np.uint8)
    if spec.dtype.kind == "b":
        arr = (arr & 1).astype(bool)
    return arr.reshape(shape)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "fc":
        a = a.view(np.uint8)
        b = b.view(np.uint8)
    np.testing.assert_array_equal(a, b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=_schemas(), data=st.data(), n=st.integers(1, 6))
def test_random_schemas_and_values_round_trip_bit_exactly(schema, data, n):
    """Any mix of the dtypes, shapes and fields filled later: extend, take, to_table and an IPC file give back the
    bits (every bit pattern, NaNs and -0.0 included) and the JSON values."""
    batch = {name: _values(data.draw, spec, n) for name, spec in schema.fields.items()}
    with ab.ExperienceStore(schema, 64) as store:
        ids = store.extend(batch)
        got = store.take(ids).to_numpy()
        table = store.to_table()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        back = pa.ipc.open_stream(sink.getvalue()).read_all()
        D.assert_same_table(back, table)
        for name, spec in schema.fields.items():
            if spec.is_json:
                assert got[name] == batch[name]
                assert jsonvalues.decode(back.column(name)) == batch[name]
                continue
            if spec.ragged:
                assert [r.tolist() for r in got[name]] == [r.tolist() for r in batch[name]]
                assert back.column(name).to_pylist() == [r.tolist() for r in batch[name]]
                continue
            _same(got[name], batch[name])
            if spec.logical or spec.dtype.kind == "c":
                _same(dtypes.to_physical(back.column(name).combine_chunks()), batch[name])


# ---------------------------------------------------------------------------------------------------- persistence
def test_checkpoints_restore_every_dtype_exactly_and_rewrite_updated_chunks(tmp_path):
    with _store() as store:
        later = _filled(store, 40)
        store.checkpoint(tmp_path / "ck")
        store.update(np.array([1, 2]), D.later_values(np.array([1, 2])))  # rows of a sealed chunk, updated
        later.update({1: True, 2: True})
        store.extend(D.rows(40, 10))
        store.checkpoint(tmp_path / "ck")
        table = store.to_table()
    with ab.ExperienceStore.restore(tmp_path / "ck") as again:
        D.assert_same_table(again.to_table(), table)
        D.check_table(again.to_table(), later)
        D.check_batch(again.sample(64), later)
    import pyarrow.dataset as pds

    files = pds.dataset(tmp_path / "ck", format="ipc").to_table()
    D.check_table(files, later)


_JOURNAL_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import arrowbuf as ab
    import dtype_rows as D
    s = ab.ExperienceStore(D.DTYPES, capacity=1000, chunk_rows=32, seed=0, durable=sys.argv[1], durability="batch")
    i = 0
    while True:
        ids = s.extend(D.torch_rows(5 * i, 5) if i % 2 else D.rows(5 * i, 5))
        print("ACK batch", i, flush=True)
        s.update(ids[:2], D.later_values(np.arange(5 * i, 5 * i + 2)))
        print("ACK update", i, flush=True)
        i += 1
""")


@pytest.mark.slow
def test_kill_9_loses_no_acknowledged_row_of_any_dtype(tmp_path):
    d = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), TESTS])}
    p = subprocess.Popen([sys.executable, "-c", _JOURNAL_CHILD, str(d)], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        while len(lines) < 40:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line.split())
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert len(lines) >= 40, "the child stopped early"
    batches = {int(x[2]) for x in lines if x[1] == "batch"}
    updates = {int(x[2]) for x in lines if x[1] == "update"}
    with ab.ExperienceStore.restore(d) as again:
        table = again.to_table()
        keys = set(D.keys_of({"obs": table.column("obs")}).tolist())
        assert {5 * i + k for i in batches for k in range(5)} <= keys
        later = {5 * i + k: k < 2 for i in updates for k in range(5)}
        D.check_table(table, later)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_datasets_keep_every_dtype_and_other_readers_see_the_storage(tmp_path, fmt):
    import duckdb
    import polars as pl

    with _store() as store:
        later = _filled(store, 30)
        store.export(tmp_path / "data", format=fmt)
        table = store.to_table()
    ds = ab.open_dataset(tmp_path / "data")
    with ab.ExperienceStore.from_dataset(tmp_path / "data", capacity=256) as offline:
        D.check_table(offline.to_table(), later)
        D.assert_same_table(offline.to_table().drop(["episode_id"]), table.drop(["episode_id"]))
    del ds
    part = next(p for p in sorted((tmp_path / "data").iterdir()) if not p.name.startswith("_"))
    if fmt == "parquet":
        rel = duckdb.sql(f"SELECT * FROM read_parquet('{part}')")
        types = dict(zip(rel.columns, map(str, rel.types)))
        assert types["bf"] == "USMALLINT[]" and types["f8b"] == "UTINYINT" and types["meta"] == "JSON"
        assert types["cx"] == "FLOAT[]" and types["half"] == "FLOAT[]"
        frame = pl.read_parquet(part)
    else:
        frame = pl.read_ipc(part)
    assert frame.height == 30 and "bf" in frame.columns


# ---------------------------------------------------------------------------------------------------- Flight
def test_flight_moves_every_dtype_in_parts(servers):
    from arrowbuf.flight import protocol as P

    with _store(capacity=8192) as store:
        server = servers(store, max_batch_bytes=P.MIN_PART_BYTES)
        with ab.connect(server.location) as remote:
            rows = D.rows(0, 8000)
            assert remote.to_batch(rows).nbytes > P.MIN_PART_BYTES
            ids = remote.extend(rows)  # over max_batch_bytes: an extend in parts
            assert len(ids) == 8000
            written = np.arange(0, 8000, 4)
            remote.update(ids[written], D.later_values(written))
            later = {int(k): bool(k % 4 == 0) for k in range(8000)}
            remote.part_bytes = P.MIN_PART_BYTES
            batch = remote.sample(6000)  # a sample in parts, assembled
            D.check_batch(batch, later)
            assert batch.to_numpy()["bf"].flags.writeable
            D.check_table(remote.to_table(), later)
            D.check_table(store.to_table(), later)


# ---------------------------------------------------------------------------------------------------- shm
_SHM_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import arrowbuf as ab
    import dtype_rows as D
    with ab.ExperienceStore.attach(sys.argv[1]) as s:
        D.check_batch(s.sample(64))
        ids = s.extend(D.torch_rows(100, 20))
        s.update(ids[:5], D.later_values(np.arange(100, 105)))
    print("OK", flush=True)
""")


@pytest.mark.slow
def test_shared_memory_moves_every_dtype_between_processes():
    from arrowbuf.tiers import shm

    name = f"dtypes-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with _store(tier="shm", name=name, capacity=512) as store:
            later = _filled(store, 40)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), TESTS])}
            out = subprocess.run([sys.executable, "-c", _SHM_CHILD, name], capture_output=True, text=True, env=env,
                                 timeout=120)
            assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
            later.update({100 + k: k < 5 for k in range(20)})
            D.check_table(store.to_table(), later)
            D.check_batch(store.sample(128), later)
            assert len(store) == 60
    finally:
        shm.remove(name)
    assert not [n for n in os.listdir(shm.shm_root()) if name in n]


# ---------------------------------------------------------------------------------------------------- other paths
@pytest.mark.filterwarnings("ignore::arrowbuf.AppendSlowPathWarning")
def test_consume_sequences_and_the_loader_deliver_every_dtype():
    with _store(tasks=["train"], capacity=512) as store:
        later = _filled(store, 60)
        got = store.consume("train", 25, lease=30.0)
        D.check_batch(got, later)
        got.ack()
        rest = store.consume("train", 100)
        assert len(rest) == 35 and sorted(D.check_batch(rest, later).tolist() + D.keys_of(got.to_numpy()).tolist()) \
            == list(range(60))
        loader = ab.Loader(store, batch_size=16, prefetch=2, format="torch", columns=["obs", "bf", "f8", "cx", "meta"])
        try:
            for _, tb in zip(range(3), loader):
                D.check_torch(dict(tb.items()))
        finally:
            loader.close()
    with ab.ExperienceStore(D.DTYPES, 256, sampler=ab.samplers.Sequence(length=4), seed=0) as seq:
        seq.extend(D.rows(0, 60))
        b = seq.sample(8, columns=["obs", "bf", "cx", "half"])
        x = b.to_numpy()
        assert x["bf"].shape == (8, 4, 4) and x["cx"].shape == (8, 4, 2)
        want = D.rows(0, 60)
        keys = x["obs"][:, :, 0].astype(np.int64)
        np.testing.assert_array_equal(x["bf"], want["bf"][keys])
        np.testing.assert_array_equal(x["cx"].view(np.uint32), want["cx"][keys].view(np.uint32))
        assert b.to_torch()["bf"].dtype == torch.bfloat16 and b.to_torch()["bf"].shape == (8, 4, 4)
