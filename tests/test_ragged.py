"""Ragged delivery: to_torch(pack=True) equals a padded reference; cu_seqlens from Arrow offsets; to_numpy rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.delivery import ragged
from arrowbuf.delivery.batch import SampleBatch

torch = pytest.importorskip("torch")


def _batch(rows: list[list[int] | None]) -> SampleBatch:
    ids = pa.array(rows, type=pa.list_(pa.int32()))
    lps = pa.array([None if r is None else [float(x) / 7 for x in r] for r in rows], type=pa.list_(pa.float32()))
    return SampleBatch({"input_ids": ids, "logprobs": lps, "reward": np.arange(len(rows), dtype=np.float32)},
                       np.arange(len(rows), dtype=np.int64))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50_000), max_size=12), min_size=1, max_size=10), st.integers(0, 3))
def test_pack_equals_padded_reference(rows: list[list[int]], cut: int) -> None:
    batch = _batch(rows)
    if cut and len(rows) > cut:  # a sliced Arrow array (non-zero first offset) must pack the same way
        batch = batch.take(np.arange(cut, len(rows)))
        rows = rows[cut:]
    packed = batch.to_torch(pack=True)
    padded = batch.to_torch(pack=False)
    cu = packed["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.tolist() == np.concatenate(([0], np.cumsum([len(r) for r in rows]))).tolist()
    assert "logprobs_cu_seqlens" not in packed  # same lengths: one cu_seqlens
    mask = padded["attention_mask"]
    assert mask.dtype == torch.bool
    # the reference: every padded row's valid prefix, concatenated, is the packed tensor
    for col in ("input_ids", "logprobs"):
        ref = torch.cat([padded[col][i][mask[i]] for i in range(len(rows))])
        assert torch.equal(packed[col], ref)
        assert torch.equal(padded[col][~mask], torch.zeros_like(padded[col][~mask]))
    pos = torch.cat([torch.arange(len(r)) for r in rows])
    assert torch.equal(packed["position_ids"], pos)
    assert packed["max_seqlen"] == max(len(r) for r in rows)
    assert packed["reward"].tolist() == padded["reward"].tolist()


def test_nulls_count_as_empty_and_to_numpy_rows() -> None:
    batch = _batch([[1, 2, 3], None, [4]])
    packed = batch.to_torch(pack=True)
    assert packed["cu_seqlens"].tolist() == [0, 3, 3, 4]
    assert packed["input_ids"].tolist() == [1, 2, 3, 4]
    rows = batch.to_numpy()["input_ids"]
    assert rows[0].tolist() == [1, 2, 3] and rows[1] is None and rows[2].tolist() == [4]
    listed = batch.to_torch()["input_ids"]
    assert listed[0].tolist() == [1, 2, 3] and listed[1] is None


def test_columns_of_other_lengths_get_their_own_offsets() -> None:
    a = pa.array([[1, 2], [3]], type=pa.list_(pa.int32()))
    b = pa.array([[1], [2, 3, 4]], type=pa.list_(pa.int32()))
    batch = SampleBatch({"response": a, "prompt": b}, np.arange(2, dtype=np.int64))
    packed = batch.to_torch(pack=True, tokens="response")
    assert packed["cu_seqlens"].tolist() == [0, 2, 3]
    assert packed["prompt_cu_seqlens"].tolist() == [0, 1, 4]
    padded = batch.to_torch(pack=False, tokens="response", pad_value=-1)
    assert padded["prompt"].tolist() == [[1, -1, -1], [2, 3, 4]]
    assert padded["prompt_attention_mask"].sum().item() == 4
    with pytest.raises(ab.InvalidArgument):
        batch.to_torch(pack=True, tokens="nope")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=0, max_size=30))
def test_position_ids_count_from_zero_in_every_row(lens: list[int]) -> None:
    from arrowbuf.delivery.ragged import position_ids

    offs = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    got = position_ids(offs)
    want = np.concatenate([np.arange(n) for n in lens]) if lens else np.zeros(0)
    assert got.dtype == np.int64 and got.tolist() == want.astype(np.int64).tolist()
    if got.size:
        assert got.flags.writeable  # a fresh array: torch takes it without a copy or a warning


def test_columns_of_the_same_other_lengths_share_their_offsets_tensors() -> None:
    a = pa.array([[1, 2], [3]], type=pa.list_(pa.int32()))
    b = pa.array([[1], [2, 3, 4]], type=pa.list_(pa.int32()))
    c = pa.array([[1.0], [2.0, 3.0, 4.0]], type=pa.list_(pa.float32()))
    batch = SampleBatch({"prompt": a, "response": b, "logprobs": c}, np.arange(2, dtype=np.int64))
    packed = batch.to_torch(pack=True)
    assert packed["cu_seqlens"].tolist() == [0, 2, 3]
    assert packed["response_cu_seqlens"].tolist() == [0, 1, 4]
    assert packed["response_position_ids"].tolist() == [0, 0, 1, 2]
    assert packed["response_max_seqlen"] == packed["logprobs_max_seqlen"] == 3
    assert packed["logprobs_position_ids"] is packed["response_position_ids"]  # computed once
    assert packed["logprobs_cu_seqlens"] is packed["response_cu_seqlens"]


def test_tokens_schema_store_round_trip() -> None:
    store = ab.ExperienceStore(ab.load_schema("tokens"), capacity=64, sampler="fifo")
    rows = [list(range(i + 1)) for i in range(5)]
    store.extend({"prompt_tokens": [[7]] * 5, "response_tokens": rows, "logprobs": [[0.5] * len(r) for r in rows],
                  "reward": np.ones(5, np.float32), "done": np.ones(5, bool), "policy_version": np.zeros(5, np.int64)})
    batch = store.sample(5, columns=["response_tokens", "logprobs"])
    packed = batch.to_torch(pack=True)
    lens = np.diff(packed["cu_seqlens"].numpy())
    assert lens.tolist() == [len(rows[i]) for i in batch.indices.tolist()]
    store.close()


_rows = st.lists(st.one_of(st.none(), st.lists(st.integers(-5, 5), max_size=6)), min_size=1, max_size=12)


@settings(max_examples=120, deadline=None)
@given(_rows, st.data())
def test_take_equals_arrow_take(rows: list[list[int] | None], data: st.DataObject) -> None:
    arr = pa.array(rows, type=pa.list_(pa.int64()))
    cut = data.draw(st.integers(0, len(rows) - 1))
    arr = arr.slice(cut)  # a sliced source (non-zero first offset) gathers the same way
    picks = data.draw(st.lists(st.integers(0, len(arr) - 1), max_size=20))
    got = ragged.take(arr, np.asarray(picks, dtype=np.int64))
    assert got.type == arr.type
    assert got.to_pylist() == arr.take(pa.array(picks, type=pa.int64())).to_pylist()
    got.validate(full=True)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_take_chunked_equals_arrow_take(chunk_rows: int, slots: int, data: st.DataObject) -> None:
    total = chunk_rows * slots
    rows = data.draw(st.lists(st.one_of(st.none(), st.lists(st.floats(-2, 2, width=32), max_size=5)),
                              min_size=total, max_size=total))
    chunks = [pa.array(rows[i * chunk_rows:(i + 1) * chunk_rows], type=pa.list_(pa.float32())) for i in range(slots)]
    if data.draw(st.booleans()):
        start = data.draw(st.integers(0, total - 1))  # a FIFO read, possibly wrapping the ring
        n = data.draw(st.integers(1, total))
        pos = (start + np.arange(n)) % total
    else:
        pos = np.asarray(data.draw(st.lists(st.integers(0, total - 1), max_size=3 * total)), dtype=np.int64)
    got = ragged.take_chunked(chunks, chunk_rows, pos)
    want = pa.chunked_array(chunks).take(pa.array(pos, type=pa.int64())).combine_chunks()
    assert got.type == want.type and got.to_pylist() == want.to_pylist()
    got.validate(full=True)


def test_consecutive_rows_are_zero_copy() -> None:
    chunk = pa.array([[1, 2], [3], [4, 5, 6], [7]], type=pa.list_(pa.int32()))
    got = ragged.take_chunked([chunk, chunk], 4, np.arange(1, 4))
    assert got.to_pylist() == [[3], [4, 5, 6], [7]]
    assert got.values.buffers()[1].address == chunk.values.buffers()[1].address
    assert ragged.take(chunk, np.arange(0, 2)).buffers()[1].address == chunk.buffers()[1].address
    with pytest.raises(ab.InvalidArgument):
        ragged.take(chunk, np.array([4]))


def test_gathered_values_reach_torch_without_a_copy_store_views_with_one() -> None:
    chunk = pa.array([[1, 2], [3], [4, 5, 6], [7]], type=pa.list_(pa.int32()))
    gathered = ragged.take_chunked([chunk, chunk], 4, np.array([2, 5, 0]))  # interleaved: a private gather
    vals, offs = ragged.flat(gathered, writable=True)
    assert vals.flags.writeable and vals.tolist() == [4, 5, 6, 3, 1, 2] and offs.tolist() == [0, 3, 4, 6]
    packed = SampleBatch({"t": gathered}, np.arange(3, dtype=np.int64)).to_torch(pack=True)
    assert packed["t"].data_ptr() == vals.ctypes.data  # no defensive copy of the batch's own memory
    view = ragged.take_chunked([chunk, chunk], 4, np.arange(1, 3))  # a zero-copy slice of the store's memory
    assert not ragged.flat(view, writable=True)[0].flags.writeable
    packed = SampleBatch({"t": view}, np.arange(2, dtype=np.int64)).to_torch(pack=True)
    packed["t"][0] = 99  # the trainer's tensor is a copy: the stored rows stay as they were
    assert chunk.to_pylist()[1] == [3]
