"""`ExperienceStore.sample_pieces`: a sample delivered in pieces gathered one at a time (what the Flight server's
DoGet in parts sends, so it holds one piece of the output instead of the whole sample): the same items and weights
as `sample` with the same seed, whole rows when a writer recycles rows between pieces, errors before any piece, and
over Flight a server whose output memory stays at about a piece."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab
from arrowbuf.flight import parts as FP
from arrowbuf.flight import protocol as P

SCHEMA = {"name": "pieces", "fields": {
    "obs": {"dtype": "float32", "shape": [16]},
    "tokens": {"dtype": "int32", "ragged": True},
    "key": {"dtype": "int64"},
    "done": {"dtype": "bool"}}}


def _rows(start: int, n: int, mod: int = 50) -> dict:
    """Row `k` (its key) carries its key everywhere (and `k % mod` tokens), so a torn or mixed row shows."""
    key = np.arange(start, start + n)
    lens = key % mod
    return {"key": key, "obs": np.repeat(key.astype(np.float32)[:, None], 16, axis=1), "done": key % 5 == 4,
            "tokens": pa.ListArray.from_arrays(pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32)),
                                               pa.array(np.repeat(key, lens).astype(np.int32)))}


def _check_whole(batch: ab.SampleBatch) -> None:
    d = batch.to_numpy()
    for i, k in enumerate(d["key"]):
        assert (d["obs"][i] == k).all()
        assert len(d["tokens"][i]) == k % 50 and (d["tokens"][i] == k).all()


def _concat(pieces: list[ab.SampleBatch]) -> dict:
    return {"indices": np.concatenate([p.indices for p in pieces]),
            "weights": None if pieces[0].weights is None else np.concatenate([p.weights for p in pieces]),
            "data": pa.Table.from_batches([p.data for p in pieces]).combine_chunks()}


@pytest.mark.parametrize("sampler", ["uniform", "fifo", "prioritized", "sequence"])
def test_pieces_are_the_sample_cut_into_pieces(sampler):
    def make() -> ab.ExperienceStore:
        s = {"prioritized": ab.samplers.Prioritized(alpha=0.6, beta=0.4),
             "sequence": ab.samplers.Sequence(length=3)}.get(sampler, sampler)
        store = ab.ExperienceStore(SCHEMA, capacity=2000, sampler=s, seed=7)
        store.extend(_rows(0, 1500))
        if sampler == "prioritized":
            store.update_priorities(np.arange(1500), np.arange(1500) % 13 + 1.0)
        return store

    a, b = make(), make()
    cols = ["obs", "key", "done"] if sampler == "sequence" else None  # a ragged field has no windows
    whole = a.sample(700, cols)
    pieces = list(b.sample_pieces(700, 64, cols, piece_bytes=20_000))
    assert len(pieces) > 3 and len(pieces[0]) == 64 and sum(len(p) for p in pieces) == 700
    got = _concat(pieces)
    np.testing.assert_array_equal(got["indices"], whole.indices)
    if whole.weights is None:
        assert got["weights"] is None
    else:
        np.testing.assert_allclose(got["weights"], whole.weights)
    assert got["data"].equals(pa.Table.from_batches([whole.data]).combine_chunks())
    # the sampler's state moved as one sample moves it: the next samples agree too
    np.testing.assert_array_equal(a.sample(50, cols).indices, b.sample(50, cols).indices)
    a.close()
    b.close()


def test_rows_recycled_between_pieces_are_drawn_again_whole():
    store = ab.ExperienceStore(SCHEMA, capacity=600, seed=1)
    store.extend(_rows(0, 600))
    pieces = store.sample_pieces(500, 100)
    first = next(pieces)
    store.extend(_rows(600, 500))  # the ring recycles most rows the later pieces were to read
    rest = list(pieces)
    for batch in [first, *rest]:
        _check_whole(batch)
        np.testing.assert_array_equal(batch.to_numpy()["key"], batch.indices)  # each id names its own row
    assert store.stats()["torn_retries"] > 0  # recycled rows were drawn again


def test_errors_come_from_the_call_not_from_a_piece():
    store = ab.ExperienceStore(SCHEMA, capacity=100)
    with pytest.raises(ab.SampleTimeout):
        store.sample_pieces(10, 4)
    store.extend(_rows(0, 20))
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ab.InvalidArgument):
            store.sample_pieces(10, bad)
    with pytest.raises(ab.InvalidArgument):
        store.sample_pieces(10, 4, piece_bytes=0)


def test_distinct_items_come_as_one_piece():
    store = ab.ExperienceStore(SCHEMA, capacity=500, max_times_sampled=1, seed=0)
    store.extend(_rows(0, 500))
    pieces = list(store.sample_pieces(300, 10))
    assert len(pieces) == 1 and len(np.unique(pieces[0].indices)) == 300


def test_a_parted_flight_sample_holds_about_a_piece_of_output_on_the_server(servers, monkeypatch):
    """Gathered piece by piece as the stream goes: the server's output pool holds a few pieces, not the sample (a
    whole gather pools an array as large as every column of it); the client gets the same rows as one message."""
    monkeypatch.setattr(FP, "SAMPLE_PIECE_BYTES", 256 << 10)
    wide = {"name": "wide", "fields": {"obs": {"dtype": "float32", "shape": [1024]}, "key": {"dtype": "int64"}}}
    stores = [ab.ExperienceStore(wide, capacity=4000, seed=3) for _ in range(2)]
    for store in stores:
        store.extend({"obs": np.repeat(np.arange(4000, dtype=np.float32)[:, None], 1024, axis=1),
                      "key": np.arange(4000)})
    parted, whole = (ab.connect(servers(store).location) for store in stores)
    try:
        parted.part_bytes = whole.part_bytes = P.MIN_PART_BYTES
        assert parted.sample_meta == "columns"  # ids ride in every message: the server may gather in pieces
        whole.sample_meta = "json"  # ids in the first message's metadata: the server gathers the sample whole
        for _ in range(3):
            a, b = parted.sample(3000), whole.sample(3000)
            assert a.data.nbytes > 10 << 20
            np.testing.assert_array_equal(a.indices, b.indices)
            assert a.data.equals(b.data)
        pooled = stores[0].stats()["output_pool"]["bytes"]
        assert pooled <= 8 * (256 << 10), pooled  # a few pieces
        assert stores[1].stats()["output_pool"]["bytes"] >= 3000 * 1024 * 4  # the whole gather's output
    finally:
        parted.close()
        whole.close()


@pytest.mark.parametrize("n,messages", [(40, 1), (300, 1), (1500, "several")])
def test_a_ragged_sample_that_fits_one_message_goes_as_one(servers, n, messages):
    """Gathered in pieces (ragged: its size is known only once gathered), a sample that fits the asked message
    size still goes as one message (the client receives it without assembling); a larger one in several."""
    import json

    import pyarrow.flight as flight

    store = ab.ExperienceStore(SCHEMA, capacity=4000, seed=0)
    store.extend(_rows(0, 3000, mod=600))  # 1.2 kB a row on average
    server = servers(store)
    raw = {"v": 3, "kind": "sample", "n": n, "meta": "columns", "part_bytes": P.MIN_PART_BYTES}
    with flight.FlightClient(server.location) as client:
        got = list(client.do_get(flight.Ticket(json.dumps(raw).encode())))
    assert sum(c.data.num_rows for c in got) == n
    assert all(c.data.nbytes <= P.MIN_PART_BYTES for c in got)
    assert len(got) == 1 if messages == 1 else len(got) > 1
    table = pa.Table.from_batches([c.data for c in got])
    assert (table.column("key").to_numpy() == table.column(P.ID_COLUMN).to_numpy()).all()


def test_a_bad_piece_size_is_refused_before_any_item_is_drawn():
    """Argument errors come before the selection: a refused call counts no delivery (with `max_times_sampled=1`
    every item can still be drawn once afterwards)."""
    store = ab.ExperienceStore(SCHEMA, capacity=100, max_times_sampled=1, seed=0)
    store.extend(_rows(0, 20))
    with pytest.raises(ab.InvalidArgument):
        store.sample_pieces(10, 4, piece_bytes=0)
    assert sorted(store.sample(20).indices.tolist()) == list(range(20))
