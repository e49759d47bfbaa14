"""Datasets (issue 15): export, open_dataset, from_dataset over arrowbuf exports, checkpoints, Parquet and Minari."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

import arrowbuf as ab

from conftest import SMALL, make_episodes


def _store(**kw):
    store = ab.ExperienceStore(SMALL, capacity=2000, seed=0, chunk_rows=64, **kw)
    store.extend(make_episodes([40, 70, 30, 90], seed=0)[0])
    open_ep = make_episodes([25], seed=1, start=5e5)[0]
    open_ep["terminated"][:] = False
    open_ep["truncated"][:] = False
    open_ep.pop("next_obs")
    store.extend(open_ep)
    return store


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize("partition_by", [None, "episode_id"])
def test_export_round_trips_into_a_store_that_samples(tmp_path, fmt, partition_by):
    with _store() as store:
        info = store.export(tmp_path / "d", format=fmt, partition_by=partition_by)
        assert info["rows"] == len(store)
        want = store.to_table()
        ds = ab.open_dataset(tmp_path / "d")
        assert ds.kind == ("parquet" if fmt == "parquet" else "arrow") and ds.num_rows == len(store)
        assert set(ds.schema.fields) == set(store.schema.fields) and "next_obs" in ds.schema.derived
        table = ds.to_table()
        assert "next_obs" in table.column_names and table["next_obs"].null_count == 1  # the open episode's last row
        with ab.ExperienceStore.from_dataset(tmp_path / "d", capacity=5000, seed=0) as offline:
            assert len(offline) == len(store)
            got = offline.to_table()
            for c in SMALL["fields"]:
                assert got[c].to_pylist() == want[c].to_pylist()
            b = offline.sample(64)
            nb = b.to_numpy()
            np.testing.assert_array_equal(nb["next_obs"][:, 0], nb["obs"][:, 0] + 1)  # next_obs is the next step
    if fmt == "parquet":  # readable without arrowbuf
        assert pads.dataset(str(tmp_path / "d"), format="parquet",
                            partitioning="hive" if partition_by else None).count_rows() == info["rows"]


def test_checkpoint_opens_as_a_dataset(tmp_path):
    with _store() as store:
        store.checkpoint(tmp_path / "c")
        store.export(tmp_path / "e", format="arrow")
        ds = ab.open_dataset(tmp_path / "c")
        assert ds.kind == "checkpoint" and ds.num_rows == len(store)
        # derived columns are rebuilt from the checkpoint's index and final observations, as an export has them
        exported = ab.open_dataset(tmp_path / "e").to_table()
        assert ds.to_table()["next_obs"].to_pylist() == exported["next_obs"].to_pylist()
        with ab.ExperienceStore.from_dataset(tmp_path / "c", capacity=100, seed=1) as small:
            assert len(small) == 100  # the newest rows
            assert small.to_table()["obs"].to_pylist() == store.to_table()["obs"].to_pylist()[-100:]


def test_parquet_written_by_pyarrow_with_a_matching_schema(tmp_path):
    schema = ab.load_schema(SMALL)
    batch, _ = make_episodes([20, 30], seed=3)
    arrow = schema.to_arrow()
    cols = {}
    for f in schema.fields.values():
        v = batch[f.name]
        cols[f.name] = pa.FixedShapeTensorArray.from_numpy_ndarray(v) if f.shape else pa.array(v)
    table = pa.table(cols).cast(pa.schema([arrow.field(n) for n in cols], metadata=arrow.metadata))
    tensor = pa.FixedShapeTensorArray.from_numpy_ndarray(batch["next_obs"])
    table = table.append_column("next_obs", tensor)
    (tmp_path / "p").mkdir()
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "p" / "rows.parquet")
    with ab.ExperienceStore.from_dataset(tmp_path / "p", schema=SMALL, seed=0) as store:
        assert len(store) == 50 and store.sample(8).to_numpy()["obs"].shape == (8, 3)
    other = json.loads(json.dumps(SMALL))
    other["fields"]["reward"]["dtype"] = "float64"
    with pytest.raises(ab.SchemaError, match="reward"):
        ab.ExperienceStore.from_dataset(tmp_path / "p", schema=other)


def test_minari_arrow_dataset_loads_and_samples(tmp_path, monkeypatch):
    minari = pytest.importorskip("minari")
    gym = pytest.importorskip("gymnasium")
    from minari.data_collector import EpisodeBuffer

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    env = gym.make("CartPole-v1")
    buffers, steps = [], 0
    for ep in range(4):  # a tiny dataset made offline from the env (random policy)
        obs, _ = env.reset(seed=ep)
        obs_l, A, R, T, TR = [obs], [], [], [], []
        rng = np.random.default_rng(ep)
        done = False
        while not done:
            a = int(rng.integers(2))
            obs, r, term, trunc, _ = env.step(a)
            obs_l.append(obs), A.append(a), R.append(r), T.append(term), TR.append(trunc)
            done = term or trunc
        steps += len(A)
        buffers.append(EpisodeBuffer(id=ep, seed=ep, observations=np.array(obs_l), actions=np.array(A),
                                     rewards=np.array(R), terminations=np.array(T), truncations=np.array(TR),
                                     infos={}))
    with pytest.warns(UserWarning):
        minari.create_dataset_from_buffers("cartpole/arrowbuf-test-v0", buffers, env=env, data_format="arrow",
                                           algorithm_name="random", author="arrowbuf", author_email="-",
                                           code_permalink="-", description="test")
    path = tmp_path / "minari" / "cartpole" / "arrowbuf-test-v0"
    ds = ab.open_dataset(path)
    assert ds.kind == "minari" and ds.num_rows == steps
    assert ds.schema.fields["obs"].shape == (4,) and "next_obs" in ds.schema.derived
    with ab.ExperienceStore.from_dataset(path, seed=0) as store:
        assert len(store) == steps
        eps = store.episodes()
        assert eps.num_rows == 4 and all(eps["complete"].to_pylist())
        b = store.sample(32).to_numpy()
        assert b["obs"].shape == (32, 4) and b["next_obs"].shape == (32, 4)
        first = buffers[0]
        t = store.to_table()
        np.testing.assert_allclose(t["obs"].combine_chunks().to_numpy_ndarray()[: len(first.actions)],
                                   first.observations[:-1])


def test_open_dataset_errors(tmp_path):
    with pytest.raises(ab.InvalidArgument, match="no arrowbuf checkpoint"):
        ab.open_dataset(tmp_path)
    with pytest.raises(ab.InvalidArgument):
        ab.open_dataset(tmp_path / "missing")
    with _store() as store, pytest.raises(ab.InvalidArgument, match="partition_by"):
        store.export(tmp_path / "x", partition_by="nope")


# ------------------------------------------------------------------ issue 44: what a new user's tools read
def test_parquet_export_reads_with_duckdb_and_polars_globs(tmp_path):
    """`read_parquet('DIR/*.parquet')` in DuckDB and Polars reads the rows: the export's metadata (its schema file,
    the lineage) lies where a glob of the data files does not reach it, and arrowbuf still reads it."""
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    with _store() as store:
        info = store.export(tmp_path / "d", format="parquet")
        assert "lineage" in info  # a store records its lineage by default: the export writes it too
        n = len(store)
    pattern = str(tmp_path / "d" / "*.parquet")
    con = duckdb.connect()
    try:
        assert con.execute(f"SELECT count(*) FROM read_parquet('{pattern}')").fetchone()[0] == n
    finally:
        con.close()
    assert pl.read_parquet(pattern).height == n
    assert ab.open_dataset(tmp_path / "d").num_rows == n
    assert "next_obs" in ab.open_dataset(tmp_path / "d").schema.derived  # the schema file was found
    assert pa.parquet.read_table(info["lineage"]).num_rows == n
    with ab.ExperienceStore.from_dataset(tmp_path / "d") as offline:
        assert len(offline) == n


def test_an_export_made_the_old_way_still_opens(tmp_path):
    """Exports written before the metadata moved into `_arrowbuf/` (schema in `_arrowbuf.json`, lineage in
    `_lineage.parquet` beside the rows) open as before."""
    import os
    import shutil

    with _store() as store:
        store.export(tmp_path / "d", format="parquet")
        n = len(store)
    meta = tmp_path / "d" / "_arrowbuf"
    shutil.move(str(meta / "dataset.json"), str(tmp_path / "d" / "_arrowbuf.json"))
    shutil.move(str(meta / "lineage.parquet"), str(tmp_path / "d" / "_lineage.parquet"))
    os.rmdir(meta)
    ds = ab.open_dataset(tmp_path / "d")
    assert ds.num_rows == n and "next_obs" in ds.schema.derived


def test_restore_of_an_exported_dataset_says_to_use_from_dataset(tmp_path):
    with _store() as store:
        store.export(tmp_path / "d", format="parquet")
    with pytest.raises(FileNotFoundError) as exc:
        ab.ExperienceStore.restore(tmp_path / "d")
    msg = str(exc.value)
    assert "dataset" in msg and "ExperienceStore.from_dataset" in msg and str(tmp_path / "d") in msg
