"""A sample received in parts, assembled once (issue 28's memory figure): list columns of numbers are copied as they
arrive into one values array per column (`parts._RaggedColumn`, allocated by the client's output pool) instead of a
copy per part plus a concatenated copy at the end, and the batch equals the one an unparted reply gives, byte for
byte. Real servers on port 0."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.flight import protocol as P
from arrowbuf.flight.parts import RAGGED_HEADROOM, PartsAssembler

from test_flight_parts_ragged import RAGGED  # the GRPO-like schema of the ragged parts tests


class Counting:
    """An `at_least` allocator that records what it hands out (np.empty, like the default)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def __call__(self, count: int, dtype, tag: str) -> np.ndarray:
        out = np.empty(count, dtype)
        self.arrays.append(out)
        return out

    def owns(self, address: int) -> bool:
        return any(a.ctypes.data <= address < a.ctypes.data + max(1, a.nbytes) for a in self.arrays)


def _list(lens, type_, null_rows=(), null_values=False, seed=0) -> pa.Array:
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, dtype=np.int64)
    offs = np.concatenate(([0], np.cumsum(lens)))
    vt = type_.value_type
    values = pa.array(rng.integers(-100, 100, int(offs[-1])).astype(vt.to_pandas_dtype()),
                      mask=(rng.random(int(offs[-1])) < 0.1) if null_values and offs[-1] else None, type=vt)
    cls = pa.LargeListArray if pa.types.is_large_list(type_) else pa.ListArray
    mask = pa.array([i in null_rows for i in range(len(lens))]) if null_rows else None
    return cls.from_arrays(pa.array(offs, type=pa.int64() if cls is pa.LargeListArray else pa.int32()), values,
                           type=type_, mask=mask)


def _assemble(rb: pa.RecordBatch, cuts, at_least) -> pa.RecordBatch:
    asm = PartsAssembler(rb.schema, rb.num_rows, at_least=at_least)
    offset = 0
    for c in cuts:
        asm.add(rb.slice(offset, c))
        offset += c
    return asm.batch()


TYPES = [pa.list_(pa.int32()), pa.list_(pa.float32()), pa.large_list(pa.int64()), pa.list_(pa.float16()),
         pa.list_(pa.field("item", pa.float32(), nullable=False))]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.sampled_from(TYPES),
       st.lists(st.integers(0, 40), min_size=1, max_size=240), st.sets(st.integers(0, 240), max_size=6),
       st.booleans(), st.booleans())
def test_assembled_list_columns_equal_the_batch(cuts, type_, lens, null_rows, null_values, growing):
    """Any cut, any row lengths (growing: short rows first, so the values array is regrown), null rows or null
    values anywhere (the column falls back to pieces from that part on): the assembled batch equals the batch."""
    n = sum(cuts)
    lens = (lens * (n // len(lens) + 1))[:n]
    if growing:
        lens = sorted(lens)
    rb = pa.RecordBatch.from_pydict({
        "l": _list(lens, type_, {r for r in null_rows if r < n}, null_values),
        "x": pa.array(np.arange(n)), "b": pa.array(np.arange(n) % 2 == 0)})
    alloc = Counting()
    got = _assemble(rb, cuts, alloc)
    got.validate(full=True)
    assert got.equals(rb)
    assert _assemble(rb, cuts, None).equals(rb)  # without an allocator: pieces, as before


def test_a_list_column_is_one_values_array_regrown_when_later_rows_are_longer():
    lens = [1] * 50 + [100] * 50  # the first part's average says 1 value a row; then 100
    rb = pa.RecordBatch.from_pydict({"l": _list(lens, pa.list_(pa.int32()))})
    alloc = Counting()
    got = _assemble(rb, [50, 25, 25], alloc)
    assert got.equals(rb)
    col = got.column(0)
    assert col.values.buffers()[1].address == alloc.arrays[-1].ctypes.data  # one array, the last allocated
    # sized from the first part, regrown as longer rows come, each time by at least RAGGED_HEADROOM
    assert 2 <= len(alloc.arrays) <= 3
    assert all(len(b) >= RAGGED_HEADROOM * len(a) for a, b in zip(alloc.arrays, alloc.arrays[1:]))


def test_a_uniform_list_column_is_allocated_once_within_the_headroom():
    lens = np.full(400, 64)
    rb = pa.RecordBatch.from_pydict({"l": _list(lens, pa.list_(pa.float32()))})
    alloc = Counting()
    assert _assemble(rb, [100] * 4, alloc).equals(rb)
    assert len(alloc.arrays) == 1 and lens.sum() <= len(alloc.arrays[0]) <= RAGGED_HEADROOM * lens.sum() + 1


def _grpo(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 400, n)
    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
    total = int(lens.sum())
    return {"prompt_id": np.arange(n), "done": np.ones(n, bool), "reward": rng.random(n, np.float32),
            "tokens": pa.ListArray.from_arrays(offs, pa.array(rng.integers(0, 1000, total).astype(np.int32))),
            "logprobs": pa.ListArray.from_arrays(offs, pa.array(rng.random(total, np.float32))),
            "ref": pa.ListArray.from_arrays(offs, pa.array(rng.random(total, np.float32)))}


@pytest.mark.parametrize("form", ["columns", "json"])
def test_a_ragged_sample_in_parts_equals_the_unparted_one_byte_for_byte(servers, form):
    stores = [ab.ExperienceStore(RAGGED, capacity=4096, seed=0) for _ in range(2)]  # the same rows, the same draws
    for store in stores:
        store.extend(_grpo(3000))
    parted, whole = (ab.connect(servers(store).location) for store in stores)
    try:
        parted.part_bytes = P.MIN_PART_BYTES
        whole.part_bytes = 1 << 30  # one message
        parted.sample_meta = whole.sample_meta = form
        a, b = parted.sample(3000), whole.sample(3000)
        np.testing.assert_array_equal(a.indices, b.indices)
        assert a.data.nbytes > 4 * P.MIN_PART_BYTES  # several messages
        assert a.data.equals(b.data)
        ta, tb = a.to_torch(pack=True), b.to_torch(pack=True)
        assert ta.keys() == tb.keys()
        for k in ta:
            if hasattr(ta[k], "numpy"):
                assert ta[k].dtype == tb[k].dtype and ta[k].numpy().tobytes() == tb[k].numpy().tobytes()
            else:
                assert ta[k] == tb[k]
    finally:
        parted.close()
        whole.close()


def test_a_ragged_sample_in_parts_is_held_once_and_its_memory_reused(servers):
    """The list columns' values land in arrays of the client's output pool (no per-part copies, no concatenated
    copy); `to_torch(pack=True)` hands those arrays to torch without a copy; a dropped batch's arrays take the next
    sample (warm memory), a kept batch is never overwritten."""
    pytest.importorskip("torch")
    store = ab.ExperienceStore(RAGGED, capacity=4096, sampler="fifo")
    data = _grpo(3000)
    store.extend(data)
    server = servers(store)
    remote = ab.connect(server.location)
    try:
        remote.part_bytes = P.MIN_PART_BYTES
        kept = remote.sample(3000)
        kept_tokens = kept.to_torch(pack=True)["tokens"]
        want = kept_tokens.clone()
        address = None
        for _ in range(3):
            store.extend(data)  # fifo: the next sample is these rows again
            arrow0 = pa.total_allocated_bytes()
            b = remote.sample(3000)
            # the ragged values are not pieces and a concatenation in Arrow's pool: held once, in the output pool
            assert pa.total_allocated_bytes() - arrow0 < 0.05 * b.data.nbytes
            col = b.data.column("tokens")
            t = b.to_torch(pack=True)
            assert t["tokens"].data_ptr() == col.values.buffers()[1].address + 4 * col.values.offset  # no copy
            assert t["tokens"].data_ptr() != kept_tokens.data_ptr()
            np.testing.assert_array_equal(t["tokens"].numpy(), kept_tokens.numpy())  # fifo: the same rows
            if address is not None:
                assert t["tokens"].data_ptr() == address  # the dropped batch's array, reused
            address = t["tokens"].data_ptr()
            del b, t, col
        assert kept_tokens.equal(want)
    finally:
        remote.close()


def test_a_part_whose_list_offsets_run_backwards_is_refused():
    """What a server sends is checked before it is copied: offsets that run backwards (or past the values)."""
    values = pa.array(np.arange(10, dtype=np.int32))
    for offs in ([0, 5, 3, 10], [0, 8, 2, 9]):  # (past the values: pyarrow refuses to make such an array)
        bad = pa.ListArray.from_buffers(pa.list_(pa.int32()), len(offs) - 1,
                                        [None, pa.py_buffer(np.array(offs, np.int32))], children=[values])
        rb = pa.RecordBatch.from_arrays([bad], names=["l"])
        asm = PartsAssembler(rb.schema, rb.num_rows, at_least=Counting())
        with pytest.raises(ab.SchemaError, match="offsets"):
            asm.add(rb)


@pytest.mark.parametrize("shard_info", [False, True])
def test_a_ray_shard_backend_serves_a_large_sample_in_parts_with_its_own_ids_and_options(servers, shard_info):
    """A Ray shard's Flight server serves a `ShardBackend`, whose `sample` returns global ids and takes
    `shard_info`: a sample in parts from it must go through that `sample`, not the wrapped store's `sample_pieces`
    (which its attribute forwarding would reach: local ids, and `shard_info` refused; CI's wheel test with the ray
    extra failed on the latter)."""
    from arrowbuf.ray.ids import decode_ids
    from arrowbuf.ray.shard import ShardBackend

    store = ab.ExperienceStore({"name": "big", "fields": {"obs": {"dtype": "float32", "shape": [1024]}}},
                               capacity=4096, seed=0)
    store.extend({"obs": np.ones((4096, 1024), np.float32)})
    server = servers(ShardBackend(store, shard=2, generation=1))
    remote = ab.connect(server.location)
    try:
        assert remote.sample_meta == "columns"
        b = remote.sample(3000, **({"shard_info": True} if shard_info else {}))  # 12 MB: in parts
        shard, _, seqs = decode_ids(b.indices)
        assert len(b) == 3000 and (shard == 2).all() and (seqs < 4096).all()
        assert ("_mass" in b.data.column_names) == shard_info
    finally:
        remote.close()
        store.close()
