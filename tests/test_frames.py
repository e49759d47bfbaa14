import numpy as np
import pytest

import arrowbuf as ab
from conftest import SMALL, make_episodes


@pytest.fixture
def filled():
    """Two actors' interleaved episodes, part of the oldest evicted, one episode still open."""
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=40, seed=0, chunk_rows=8)
    a, _ = make_episodes([6, 9, 4], seed=1)
    b, _ = make_episodes([5, 12], seed=2, start=50_000.0)
    b["terminated"][-1] = b["truncated"][-1] = False  # actor 1's last episode stays open
    rows = []
    ia = ib = 0
    rng = np.random.default_rng(0)
    while ia < len(a["obs"]) or ib < len(b["obs"]):
        take_a = ib >= len(b["obs"]) or (ia < len(a["obs"]) and rng.random() < 0.5)
        src, i, actor = (a, ia, 0) if take_a else (b, ib, 1)
        k = min(int(rng.integers(1, 4)), len(src["obs"]) - i)
        part = {key: v[i:i + k] for key, v in src.items()}
        part["actor"] = np.full(k, actor)
        store.extend(part)
        rows += [(actor, i + j) for j in range(k)]
        if take_a:
            ia += k
        else:
            ib += k
    return store, a, b, rows


def reference(store, a, b, rows):
    """Per live row: (episode key, reward, end) from the input arrays, in seq order."""
    live = rows[-len(store):]
    first_seq = len(rows) - len(store)
    out = []
    for k, (actor, i) in enumerate(live):
        src = a if actor == 0 else b
        ends = np.flatnonzero(src["terminated"] | src["truncated"])
        ep_no = int(np.searchsorted(ends, i))
        starts = np.concatenate([[0], ends + 1])
        out.append(dict(key=(actor, ep_no), seq=first_seq + k, reward=float(src["reward"][i]),
                        end=bool(src["terminated"][i] or src["truncated"][i]), step=i - int(starts[ep_no])))
    return out


def test_episodes_match_reference(filled):
    store, a, b, rows = filled
    ref = reference(store, a, b, rows)
    eps = store.episodes().to_pylist()
    groups = {}
    for r in ref:
        groups.setdefault(r["key"], []).append(r)
    assert len(eps) == len(groups)
    expected = sorted(
        (min(r["seq"] for r in g), len(g), pytest.approx(sum(r["reward"] for r in g), rel=1e-5),
         max(r["seq"] for r in g), g[0]["step"] == 0 and g[-1]["end"])
        for g in groups.values())
    got = [(e["first_seq"], e["length"], e["return"], e["last_seq"], e["complete"]) for e in eps]
    assert got == expected
    assert any(not e["complete"] for e in eps)  # the evicted head and the open episode


def test_sql_matches_reference(filled):
    pytest.importorskip("duckdb")
    store, a, b, rows = filled
    ref = reference(store, a, b, rows)
    res = store.sql("SELECT count(*) AS n, sum(reward) AS r, max(seq) AS m FROM experience")
    n, r, m = res.column("n")[0].as_py(), res.column("r")[0].as_py(), res.column("m")[0].as_py()
    assert n == len(ref) and m == ref[-1]["seq"]
    assert r == pytest.approx(sum(x["reward"] for x in ref), rel=1e-5)
    per_ep = store.sql("SELECT episode_id, count(*) AS n FROM experience GROUP BY 1 ORDER BY min(seq)")
    assert per_ep.column("n").to_pylist() == store.episodes().column("length").to_pylist()
    tensor = store.sql("SELECT obs FROM experience ORDER BY seq LIMIT 1")
    assert len(tensor.column("obs")[0].as_py()) == 3
    with pytest.raises(ab.SchemaError):
        store.sql("")


def test_pandas_and_polars_match(filled):
    pd = pytest.importorskip("pandas")
    pl = pytest.importorskip("polars")
    store, a, b, rows = filled
    ref = reference(store, a, b, rows)
    df = store.to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == len(ref)
    np.testing.assert_allclose(df["reward"].to_numpy(), [r["reward"] for r in ref], rtol=1e-6)
    assert df["step"].tolist() == [r["step"] for r in ref]
    assert df["obs"].iloc[0].shape == (3,)
    pf = store.to_polars()
    assert isinstance(pf, pl.DataFrame) and pf.height == len(ref)
    np.testing.assert_allclose(pf["reward"].to_numpy(), [r["reward"] for r in ref], rtol=1e-6)
    assert pf["seq"].to_list() == [r["seq"] for r in ref]


def test_empty_store_frames():
    store = ab.ExperienceStore(ab.load_schema(SMALL), capacity=10)
    assert store.episodes().num_rows == 0
    assert store.to_table().num_rows == 0
    pytest.importorskip("duckdb")
    assert store.sql("SELECT count(*) AS n FROM experience").column("n")[0].as_py() == 0
