"""Checkpoint and restore (issue 15): real files, real processes; no mocks, no timing asserts."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

import arrowbuf as ab
from arrowbuf.persist import manifest as mf

from conftest import SMALL, make_episodes

SAMPLERS = {
    "uniform": lambda: dict(sampler="uniform"),
    "prioritized": lambda: dict(sampler=ab.samplers.Prioritized(alpha=0.7, beta=0.5)),
    "fifo_max_times": lambda: dict(sampler="fifo", max_times_sampled=2),
    "sequence": lambda: dict(sampler=ab.samplers.Sequence(length=4, priority=ab.samplers.Prioritized())),
}


def _filled(kind: str = "uniform", capacity: int = 1000, chunk_rows: int = 64, seed: int = 3, **kw):
    store = ab.ExperienceStore(SMALL, capacity=capacity, seed=seed, chunk_rows=chunk_rows, **SAMPLERS[kind](), **kw)
    batch, _ = make_episodes([50, 80, 120, 300, 400, 170], seed=0)
    store.extend(batch)
    # an open episode of actor 7, to be continued after restore
    open_ep, _ = make_episodes([30], seed=1, start=5e5)
    open_ep["terminated"][:] = False
    open_ep["truncated"][:] = False
    open_ep.pop("next_obs")
    open_ep["actor"] = np.full(30, 7)
    store.extend(open_ep)
    return store


def _same_batches(a: ab.ExperienceStore, b: ab.ExperienceStore, n: int = 3, size: int = 16) -> None:
    for _ in range(n):
        x, y = a.sample(size), b.sample(size)
        np.testing.assert_array_equal(x.indices, y.indices)
        if x.weights is not None or y.weights is not None:
            np.testing.assert_array_equal(x.weights, y.weights)
        assert x.data.equals(y.data)


def _state(store: ab.ExperienceStore):
    st = store.stats()
    return (store.to_table(), {k: st[k] for k in ("size", "first_seq", "next_seq", "inserts", "samples",
                                                  "open_episodes", "removed", "final_obs_dropped")},
            {k: v for k, v in st.items() if k in ("cursor", "max_priority", "priority_sum")})


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_round_trip_per_sampler_same_rows_state_and_batches(tmp_path, kind):
    with _filled(kind) as store:
        if kind != "fifo_max_times":
            b = store.sample(32)
            if kind in ("prioritized", "sequence"):
                store.update_priorities(b.indices, np.random.default_rng(0).random(len(b.indices)) * 3)
        else:
            store.sample(100)
        store.checkpoint(tmp_path / "ckpt")
        with ab.ExperienceStore.restore(tmp_path / "ckpt") as again:
            t0, s0, x0 = _state(store)
            t1, s1, x1 = _state(again)
            assert t1.equals(t0) and t1.schema.equals(t0.schema)
            assert s1 == s0 and x1 == x0
            _same_batches(store, again, size=16 if kind != "fifo_max_times" else 50)
            # the episode actor 7 left open continues in the restored store
            more, _ = make_episodes([5], seed=2, start=9e5)
            more["actor"] = np.full(5, 7)
            ids = again.extend(more)
            ids0 = store.extend(more)
            assert np.array_equal(np.asarray(ids), np.asarray(ids0))
            t0, t1 = store.to_table(), again.to_table()
            assert t1.equals(t0)
            ep = t1.filter(pa.compute.equal(t1["seq"], t1["seq"][-1].as_py()))["episode_id"][0].as_py()
            rows = t1.filter(pa.compute.equal(t1["episode_id"], ep))
            assert rows.num_rows == 35 and rows["step"].to_pylist() == list(range(35))
            assert again.episodes().equals(store.episodes())


def test_seed_reseeds_and_restored_ids_still_update_priorities(tmp_path):
    with _filled("prioritized") as store:
        b = store.sample(8)
        store.checkpoint(tmp_path / "c")
        with ab.ExperienceStore.restore(tmp_path / "c", seed=11) as r1, \
                ab.ExperienceStore.restore(tmp_path / "c", seed=11) as r2:
            _same_batches(r1, r2)
            assert r1.update_priorities(b.indices, np.ones(8)) == 8  # ids from before the checkpoint name their rows


def test_incremental_checkpoint_writes_only_new_chunks(tmp_path):
    root = tmp_path / "c"
    with ab.ExperienceStore(SMALL, capacity=4096, chunk_rows=128, seed=0) as store:
        batch, _ = make_episodes([1000, 1000, 1000, 1000], seed=0)
        store.extend(batch)                      # 4000 rows: 31 sealed chunks and a tail of 32
        first = store.checkpoint(root)
        assert first["files_written"] == 32 and first["files_reused"] == 0
        more, _ = make_episodes([400], seed=1, start=1e6)
        store.extend(more)                       # 10% more rows, wraps the ring
        second = store.checkpoint(root)
        new_sealed = (4400 // 128) - (4000 // 128)
        # new sealed chunks, the partly evicted oldest chunk and the tail; every other chunk is reused
        assert second["files_written"] <= new_sealed + 2
        assert second["files_reused"] >= 31 - new_sealed - 1
        assert second["bytes_written"] < 0.2 * second["row_bytes"]
        # a restored store reuses the files it was read from
        with ab.ExperienceStore.restore(root) as again:
            third = again.checkpoint(root)
            assert third["files_written"] <= 1 and third["bytes_written"] < 0.05 * third["row_bytes"]


def test_external_readers_see_exactly_the_latest_rows(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    root = tmp_path / "c"
    with _filled("uniform") as store:
        store.checkpoint(root, keep=2)
        store.extend(make_episodes([300], seed=5, start=2e6)[0])
        store.checkpoint(root, keep=2)          # older checkpoint's exclusive files move to _retained/
        want = store.to_table()
    table = pads.dataset(str(root), format="ipc").to_table().sort_by("seq")
    assert table.equals(want.combine_chunks()) or table.to_pydict() == want.to_pydict()
    con = duckdb.connect()  # DuckDB 2.0.1 has no built-in Arrow IPC reader (offline): it scans the pyarrow dataset
    con.register("ckpt", pads.dataset(str(root), format="ipc"))
    got = con.sql("SELECT count(*), min(seq), max(seq), sum(reward) FROM ckpt").fetchall()[0]
    assert got[:3] == (want.num_rows, want["seq"][0].as_py(), want["seq"][-1].as_py())
    assert got[3] == pytest.approx(pa.compute.sum(want["reward"]).as_py(), rel=1e-5)
    lf = pl.scan_ipc(str(root / "*.arrow")).select(
        pl.len(), pl.col("seq").min().alias("lo"), pl.col("seq").max().alias("hi")).collect()
    assert lf.row(0) == (want.num_rows, want["seq"][0].as_py(), want["seq"][-1].as_py())


def test_retention_keeps_k_checkpoints_and_collects_the_rest(tmp_path):
    root = tmp_path / "c"
    with ab.ExperienceStore(SMALL, capacity=500, chunk_rows=64, seed=0) as store:
        for i in range(5):
            store.extend(make_episodes([300], seed=i, start=i * 1e6)[0])
            store.checkpoint(root, keep=2)
        assert mf.kept_manifests(str(root)) == ["00000004.json", "00000005.json"]
        referenced = set()
        for n in mf.kept_manifests(str(root)):
            referenced |= {e["name"] for e in mf.read_manifest(str(root), n)["files"]}
        on_disk = {p.name for p in root.rglob("*") if p.is_file() and p.parent.name != "_manifests"
                   and p.name not in ("_manifest.json", "_lock")}
        assert on_disk == referenced
        assert mf.verify(str(root)) == []
        # the older kept checkpoint is intact too
        assert mf.verify(str(root), mf.read_manifest(str(root), "00000004.json")) == []


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_chunk_file_is_an_error_naming_it(tmp_path, damage):
    root = tmp_path / "c"
    with _filled("uniform") as store:
        store.checkpoint(root)
    victim = sorted(root.glob("*.arrow"))[3]
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ab.StoreCorrupt, match=victim.name):
        ab.ExperienceStore.restore(root)
    assert any(victim.name in p for p in mf.verify(str(root)))


def test_different_schema_is_a_schema_error_naming_fields(tmp_path):
    with _filled("uniform") as store:
        store.checkpoint(tmp_path / "c")
    other = json.loads(json.dumps(SMALL))
    other["fields"]["obs"]["shape"] = [4]
    other["fields"]["value"] = {"dtype": "float32"}
    with pytest.raises(ab.SchemaError, match=r"value.*obs|obs.*value"):
        ab.ExperienceStore.restore(tmp_path / "c", schema=other)


def test_background_checkpoint_while_sampling_and_inserting(tmp_path):
    with ab.ExperienceStore(SMALL, capacity=20_000, chunk_rows=256, seed=0) as store:
        store.extend(make_episodes([5000, 5000], seed=0)[0])
        h = store.checkpoint(tmp_path / "c", background=True)
        hi = store.stats()["next_seq"]
        store.extend(make_episodes([500], seed=1, start=1e6)[0])  # inserts and samples go on meanwhile
        store.sample(64)
        info = h.wait(timeout=60)
        assert h.done and h.progress == 1.0
        assert info["next_seq"] == hi and info["rows"] == 10_000  # the snapshot point is the call
    with ab.ExperienceStore.restore(tmp_path / "c") as again:
        assert len(again) == 10_000 and again.stats()["next_seq"] == hi


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priority is a Linux/POSIX feature")
def test_background_checkpoint_thread_yields_the_cpu(tmp_path):
    """The background checkpoint's thread runs BACKGROUND_NICE below the caller (samplers keep their CPU share);
    a synchronous checkpoint runs at the caller's priority."""
    import threading

    from arrowbuf.persist import checkpoint as persist_checkpoint
    from arrowbuf.persist.checkpoint import BACKGROUND_NICE

    seen = []

    def record(i: int) -> None:  # runs in the thread that copies the chunks
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ab.ExperienceStore(SMALL, capacity=2000, chunk_rows=256, seed=0) as store:
        store.extend(make_episodes([600], seed=0)[0])
        persist_checkpoint(store._core, tmp_path / "a", background=True, _after_read=record).wait(timeout=60)
        persist_checkpoint(store._core, tmp_path / "b", _after_read=record)
    assert seen[0] == min(19, mine + BACKGROUND_NICE) and seen[-1] == mine
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's own is untouched


def test_empty_store_round_trip(tmp_path):
    with ab.ExperienceStore(SMALL, capacity=100, seed=0) as store:
        store.checkpoint(tmp_path / "c")
    with ab.ExperienceStore.restore(tmp_path / "c") as again:
        assert len(again) == 0
        again.extend(make_episodes([10])[0])
        assert len(again) == 10


def test_bad_arguments(tmp_path):
    with ab.ExperienceStore(SMALL, capacity=100, seed=0) as store:
        with pytest.raises(ab.InvalidArgument):
            store.checkpoint(tmp_path / "c", keep=0)
        with pytest.raises(ab.InvalidArgument):
            store.checkpoint(tmp_path / "c", compression="gzip")
    with pytest.raises(FileNotFoundError):
        ab.ExperienceStore.restore(tmp_path / "nothing")
    with pytest.raises(ab.StoreClosed):
        store.checkpoint(tmp_path / "closed")


def test_zstd_archive_round_trip(tmp_path):
    with _filled("uniform") as store:
        store.checkpoint(tmp_path / "z", compression="zstd")
        with ab.ExperienceStore.restore(tmp_path / "z") as again:
            assert again.to_table().equals(store.to_table())
    assert pads.dataset(str(tmp_path / "z"), format="ipc").count_rows() == len(store)


def test_format_doc_exists():
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "format.md"
    assert doc.exists() and f"version {mf.FORMAT_VERSION}" in doc.read_text().lower()


def test_ragged_fields_round_trip(tmp_path):
    tokens = ab.load_schema(pathlib.Path(__file__).resolve().parents[2] / "schemas" / "tokens.yaml")
    rng = np.random.default_rng(0)
    with ab.ExperienceStore(tokens, capacity=300, chunk_rows=32, seed=0) as store:
        for k in range(4):
            n = 100
            lens = rng.integers(1, 20, n)
            store.extend(pa.table({
                "prompt_tokens": pa.array([rng.integers(0, 1000, m).astype(np.int32) for m in lens]),
                "response_tokens": pa.array([rng.integers(0, 1000, m + 1).astype(np.int32) for m in lens]),
                "logprobs": pa.array([rng.normal(size=m + 1).astype(np.float32) for m in lens]),
                "reward": rng.normal(size=n).astype(np.float32), "done": np.ones(n, bool),
                "policy_version": np.full(n, k, np.int64)}))
        store.checkpoint(tmp_path / "c")
        with ab.ExperienceStore.restore(tmp_path / "c") as again:
            assert again.to_table().to_pydict() == store.to_table().to_pydict()
            x, y = store.sample(16), again.sample(16)
            np.testing.assert_array_equal(x.indices, y.indices)
            assert x.data.equals(y.data)


LATER = {"name": "later", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
    "reward": {"dtype": "float32", "later": True},
    "emb": {"dtype": "float32", "shape": [2], "later": True},
    "done": {"dtype": "bool"},
}}


@pytest.mark.parametrize("tier", ["host", "shm"])
def test_fields_filled_later_round_trip_and_updates_reach_the_next_checkpoint(tmp_path, tier):
    """Rows of later fields stay absent (null) through restore, not zeros; an `update` of rows in a sealed chunk
    after a checkpoint reaches the next (incremental) checkpoint, which rewrites only the chunks it changed."""
    import uuid

    root = tmp_path / "c"
    rng = np.random.default_rng(0)
    names = iter(f"later-{uuid.uuid4().hex[:8]}-{k}" for k in range(4))

    def restored():
        return ab.ExperienceStore.restore(root, tier=tier, name=next(names) if tier == "shm" else None)

    with ab.ExperienceStore(LATER, capacity=64, chunk_rows=8, seed=0, tier=tier,
                            name=next(names) if tier == "shm" else None) as store:
        ids = store.extend({"prompt_id": np.arange(40), "done": np.ones(40, bool),
                            "response": [rng.integers(0, 9, rng.integers(1, 5)).astype(np.int32) for _ in range(40)]})
        store.update(ids[:3], {"reward": [1.0, 2.0, 3.0], "emb": np.ones((3, 2), np.float32)})
        store.update(ids[1:2], {"ref_logprobs": [[0.5, -0.5]]})
        first = store.checkpoint(root)
        assert first["files_written"] == 5
        with restored() as again:
            assert again.to_table().equals(store.to_table())
            assert again.present(["reward"], ids).tolist() == [True] * 3 + [False] * 37
            assert again.present(["ref_logprobs"], ids).tolist() == [False, True] + [False] * 38
        store.update(ids[20:22], {"reward": [4.0, 5.0]})       # rows of sealed chunk 2 (rows 16..23)
        store.update(ids[33:34], {"ref_logprobs": [[1.0]]})    # chunk 4 (rows 32..39)
        second = store.checkpoint(root)
        assert second["files_written"] == 2 and second["files_reused"] == 3
        with restored() as again:
            t = again.to_table()
            assert t.equals(store.to_table())
            assert t["reward"].to_pylist()[20:23] == [4.0, 5.0, None]
            assert t["ref_logprobs"].to_pylist()[33] == [1.0]
            third = again.checkpoint(root)  # a restored store knows the files it was read from, later fields too
            assert third["files_written"] == 0 and third["files_reused"] == 5


def test_a_bool_tensor_field_survives_checkpoint_and_restore(tmp_path):
    """pyarrow's to_numpy_ndarray refuses bool tensors; restore must not."""
    schema = {"name": "bools", "episode_end": [], "truncation": [],
              "fields": {"mask": {"dtype": "bool", "shape": [3]}, "x": {"dtype": "int64"}}}
    mask = np.array([[True, False, True], [False, True, True], [False, False, False]])
    with ab.ExperienceStore(schema, capacity=8) as store:
        store.extend({"mask": mask, "x": np.arange(3)})
        store.checkpoint(tmp_path / "ck")
    again = ab.ExperienceStore.restore(tmp_path / "ck")
    got = again.to_table()
    assert np.array_equal(np.array(got["mask"].to_pylist()), mask) and got["x"].to_pylist() == [0, 1, 2]
    again.close()
