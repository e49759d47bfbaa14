"""The store-surface contract (`ab.StoreSurface`), one suite run over every implementation, all real parts:

host, shared-memory (the creator and a handle attached by name), tiered (host + disk spill), the shard adapter a
shard's Flight server wraps (`arrowbuf.ray.ShardBackend`), `RemoteStore` over a real Flight server on 127.0.0.1:0, and
`ShardedStore` on a local Ray cluster (started once for the module, shut down at its end).

Each test writes its own rows and checks only what it wrote, so the module-scoped sharded store can carry rows of
earlier tests.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import dtype_rows as D
import numpy as np
import pyarrow as pa
import pytest
from conftest import SMALL, make_episodes

import arrowbuf as ab
from arrowbuf.surface import STATS_KEYS

LOCAL = ["host", "shm", "shm-attached", "tiered", "shard-adapter"]
IMPLEMENTATIONS = [*LOCAL, "remote", "sharded"]
CAPACITY = 4096
#: SMALL plus a field filled later by `update` (the contract's update test writes it)
SURF = {**SMALL, "fields": {**SMALL["fields"], "score": {"dtype": "float32", "later": True}}}

#: Known gaps, (test, implementation) -> reason; strict xfails, so a fix shows up as XPASS and must drop its line.
GAPS: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------------------------------------------- factories
@contextlib.contextmanager
def _shm_names() -> Iterator[Any]:
    from arrowbuf.tiers import shm

    made: list[str] = []

    def new() -> str:
        made.append(f"surf{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return made[-1]

    try:
        yield new
    finally:
        for name in made:
            shm.remove(name)
        left = [n for n in os.listdir(shm.shm_root()) if any(m in n for m in made)]
        assert not left, f"segments left in /dev/shm: {left}"


@pytest.fixture(scope="module")
def ray_local(ray_cluster: Any) -> Any:
    """The session's local Ray cluster (conftest's ray_cluster), with this module's classes shipped by value."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray


def _sharded(schema: dict) -> Iterator[Any]:
    """A 2-shard ShardedStore of `schema` on the module's cluster, shut down afterwards."""
    from arrowbuf.ray import ShardedStore

    sharded = ShardedStore.create(schema, 2, CAPACITY, sampler=ab.samplers.Prioritized(alpha=0.6, beta=0.4),
                                  seed=0, failure_timeout=20.0)
    try:
        yield sharded
    finally:
        sharded.shutdown()


@pytest.fixture(scope="module")
def ray_sharded(ray_local: Any) -> Iterator[Any]:
    yield from _sharded(SMALL)


@pytest.fixture(scope="module")
def ray_sharded_later(ray_local: Any) -> Iterator[Any]:
    """The same with SURF's field filled later (only tests marked `later_fields` ask for it)."""
    yield from _sharded(SURF)


@pytest.fixture(scope="module")
def ray_sharded_dtypes(ray_local: Any) -> Iterator[Any]:
    """The same with a field of every dtype (only tests marked `dtypes` ask for it)."""
    yield from _sharded(D.DTYPES)


@pytest.fixture(params=[*LOCAL, "remote", pytest.param("sharded", marks=[pytest.mark.slow, pytest.mark.ray])])
def surface(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """A store-like object of each implementation, with a prioritized sampler (so priorities matter)."""
    kind = request.param
    gap = GAPS.get((request.node.originalname, kind))
    if gap is not None:
        request.applymarker(pytest.mark.xfail(reason=gap, strict=True))
    prio = ab.samplers.Prioritized(alpha=0.6, beta=0.4)
    later = request.node.get_closest_marker("later_fields") is not None
    dtypes = request.node.get_closest_marker("dtypes") is not None
    # a later field sends append to the general path: only where a test needs it
    schema = D.DTYPES if dtypes else SURF if later else SMALL
    with contextlib.ExitStack() as stack:
        if kind == "host":
            store = stack.enter_context(ab.ExperienceStore(schema, CAPACITY, prio, seed=0))
        elif kind in ("shm", "shm-attached"):
            names = stack.enter_context(_shm_names())
            store = stack.enter_context(ab.ExperienceStore(schema, CAPACITY, prio, seed=0, tier="shm", name=names()))
            if kind == "shm-attached":
                store = stack.enter_context(ab.ExperienceStore.attach(store.name, seed=1))
        elif kind == "tiered":
            store = stack.enter_context(ab.ExperienceStore(schema, CAPACITY, prio, seed=0, chunk_rows=256,
                                                           tiers={"host": "64MiB", "disk": tmp_path / "spill"}))
        elif kind == "shard-adapter":
            from arrowbuf.ray import ShardBackend

            store = ShardBackend(stack.enter_context(ab.ExperienceStore(schema, CAPACITY, prio, seed=0)), 3, 5)
        elif kind == "remote":
            local = stack.enter_context(ab.ExperienceStore(schema, CAPACITY, prio, seed=0))
            server = stack.enter_context(ab.serve(local, "grpc://127.0.0.1:0"))
            store = stack.enter_context(ab.connect(server.location))
        else:  # a fresh handle of the module's sharded store per test (close() closes the handle only)
            sharded = request.getfixturevalue("ray_sharded_dtypes" if dtypes else
                                              "ray_sharded_later" if later else "ray_sharded")
            store = stack.enter_context(pickle.loads(pickle.dumps(sharded)))
        yield store


def _batch(n_steps: int, seed: int) -> dict[str, np.ndarray]:
    """Whole episodes of `n_steps` steps in total."""
    lengths = [n_steps // 4] * 3 + [n_steps - 3 * (n_steps // 4)]
    batch, _ = make_episodes(lengths, seed=seed)
    return batch


def _seqs_of(kind: str, ids: np.ndarray, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(the seqs `ids` name, the `seq` column of the rows of their shard): a local id is its row's seq; a sharded id
    encodes (shard, generation, seq), and a sharded table's `seq` is per shard (with a `shard` column)."""
    seq = table.column("seq").to_numpy()
    if kind not in ("sharded", "shard-adapter"):
        return ids, seq
    from arrowbuf.ray import decode_ids

    shard, _, local = decode_ids(ids)
    assert len(set(shard.tolist())) == 1  # one batch lands on one shard
    if "shard" in table.column_names:
        seq = seq[table.column("shard").to_numpy() == shard[0]]
    return local, seq


# ---------------------------------------------------------------------------------------------------- the contract
def test_implements_the_protocol(surface):
    assert isinstance(surface, ab.StoreSurface)
    assert isinstance(surface.schema, ab.ExperienceSchema)


def test_extend_returns_the_new_rows_ids(surface, request):
    before = len(surface)
    ids = surface.extend(_batch(40, seed=1))
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.shape == (40,)
    assert len(np.unique(ids)) == 40
    assert len(surface) == before + 40
    assert surface.update_priorities(ids, np.full(40, 2.0)) == 40  # every id names a stored row
    named, seqs = _seqs_of(request.node.callspec.params["surface"], ids, surface.to_table(["seq"]))
    np.testing.assert_array_equal(named, seqs[-40:])  # the batch's rows, in row order, newest in its shard


def test_extend_of_nothing_returns_no_ids(surface):
    ids = surface.extend(_batch(8, seed=2))
    empty = surface.extend({k: v[:0] for k, v in _batch(8, seed=3).items()})
    assert isinstance(empty, np.ndarray) and empty.dtype == np.int64 and empty.shape == (0,)
    assert len(ids) == 8


def test_append_returns_an_int_id(surface):
    step = {k: v[0] for k, v in _batch(8, seed=4).items()}
    step["terminated"] = step["truncated"] = False
    a = surface.append(step)
    b = surface.append(step)
    assert type(a) is int and type(b) is int and a != b
    assert surface.update_priorities(np.array([a, b]), np.array([1.0, 3.0])) == 2


def test_sample_and_update_priorities(surface):
    surface.extend(_batch(64, seed=5))
    batch = surface.sample(32, timeout=10.0)
    assert isinstance(batch, ab.SampleBatch) and len(batch) == 32
    assert batch.indices.dtype == np.int64 and batch.indices.shape == (32,)
    assert batch.weights is not None and batch.weights.shape == (32,)
    assert {"obs", "action", "reward", "next_obs"} <= set(batch.columns)
    assert batch["obs"].shape == (32, 3)
    assert surface.update_priorities(batch.indices, np.full(32, 0.5)) == 32
    sub = surface.sample(4, ["reward"], timeout=10.0)
    assert sub.columns == ["reward"]
    with pytest.raises(ab.InvalidArgument):  # one priority per id, and nothing changes
        surface.update_priorities(batch.indices, np.ones(3))


@pytest.mark.later_fields
def test_update_writes_fields_of_stored_rows(surface, request):
    ids = surface.extend(_batch(16, seed=8))
    kind = request.node.callspec.params["surface"]
    assert surface.update(ids[:4], {"score": np.array([7.0, 8.0, 9.0, 10.0], np.float32)}) == 4
    with pytest.raises(ab.SchemaError):  # validated like extend: nothing written
        surface.update(ids[4:6], {"score": np.array(["x", "y"])})
    with pytest.raises(ab.SchemaError):  # only fields filled later
        surface.update(ids[4:6], {"reward": np.ones(2, np.float32)})
    assert surface.update(ids[:0], {"score": np.zeros(0, np.float32)}) == 0
    table = surface.to_table()
    if "shard" in table.column_names:  # a sharded table: the rows of the batch's shard
        from arrowbuf.ray import shard_of

        table = table.filter(table.column("shard").to_numpy() == shard_of(ids[:1])[0])
    local, seq = _seqs_of(kind, ids[:6], table)
    score = table.column("score").to_pylist()
    assert [score[i] for i in np.searchsorted(seq, local)] == [7.0, 8.0, 9.0, 10.0, None, None]


@pytest.mark.dtypes
@pytest.mark.filterwarnings("ignore::arrowbuf.AppendSlowPathWarning")  # append of bfloat16 converts first
def test_every_dtype_round_trips_bit_exactly(surface, request):
    """bfloat16, float8, complex, float16, bool and json fields (NaN payloads, -0.0, non-ASCII text included) come
    back bit-exactly through extend/append, sample, update of later fields, take by id and to_table; torch tensors
    and ml_dtypes arrays go in as they are."""
    kind = request.node.callspec.params["surface"]
    key0 = 1000 * (os.getpid() % 1000) if kind == "sharded" else 0  # the module's sharded store keeps older rows
    ids = surface.extend(D.rows(key0, 40))
    ids2 = surface.extend(D.torch_rows(key0 + 40, 8))
    one = D.rows(key0 + 48, 1)
    assert isinstance(surface.append({k: (v[0] if isinstance(v, np.ndarray) else v[0]) for k, v in one.items()}),
                      int)
    import ml_dtypes as ml  # arrowbuf[dev]

    mlrows = D.rows(key0 + 49, 3)
    mlrows["bf"] = mlrows["bf"].view(ml.bfloat16)
    mlrows["f8b"] = mlrows["f8b"].view(ml.float8_e5m2)
    surface.extend(mlrows)
    keys = np.arange(key0, key0 + 52)
    written = keys[:20:3]
    assert surface.update(np.asarray(ids)[:20:3], D.later_values(written)) == len(written)
    later = {int(k): bool(k in set(written.tolist())) for k in keys[:40]}
    seen: set[int] = set()
    for _ in range(4):
        batch = surface.sample(64)
        seen.update(D.check_batch(batch, later).tolist())
    assert seen & set(keys.tolist())
    table = surface.to_table()
    mine = np.isin(D.keys_of({"obs": table.column("obs")}), keys)
    D.check_table(table.filter(pa.array(mine)), later)
    assert sorted(D.keys_of({"obs": table.column("obs")})[mine].tolist()) == keys.tolist()
    with pytest.raises(ab.SchemaError, match="meta"):  # not JSON: refused, nothing written
        surface.extend({**D.rows(key0 + 60, 2), "meta": [{1, 2}, None]})
    with pytest.raises(ab.SchemaError, match="f8"):  # floats are not rounded to float8 implicitly
        surface.extend({**D.rows(key0 + 60, 2), "f8": np.ones((2, 2), np.float32)})
    assert len(surface.to_table()) == len(table)
    del ids2


def test_stats_to_table_sql_episodes(surface):
    surface.extend(_batch(40, seed=6))
    n = len(surface)
    stats = surface.stats()
    assert set(STATS_KEYS) <= set(stats) and stats["size"] == n and stats["inserts"] >= 40
    table = surface.to_table()
    assert isinstance(table, pa.Table) and table.num_rows == n
    assert {"obs", "action", "reward", "episode_id", "step", "seq"} <= set(table.column_names)
    assert surface.to_table(["reward"]).num_rows == n
    count = surface.sql("SELECT count(*) AS n, sum(reward) AS r FROM experience")
    assert count.column("n").to_pylist() == [n]
    assert count.column("r")[0].as_py() == pytest.approx(float(np.sum(table.column("reward").to_numpy())), rel=1e-4)
    eps = surface.episodes()
    assert {"episode_id", "length", "return", "first_seq", "last_seq", "complete"} <= set(eps.column_names)
    assert sum(eps.column("length").to_pylist()) == n


def test_close_is_idempotent_and_final(surface):
    surface.extend(_batch(8, seed=7))
    surface.close()
    surface.close()
    with pytest.raises(ab.StoreClosed):
        surface.sample(1)
    with pytest.raises(ab.StoreClosed):
        surface.extend(_batch(8, seed=8))


def test_the_context_manager_closes(surface):
    with surface as s:
        assert s is surface
    with pytest.raises(ab.StoreClosed):
        surface.to_table()


# Serving a client (remote, sharded) is possible but not the point here: the local kinds cover `serve`.
@pytest.mark.parametrize("surface", [k for k in IMPLEMENTATIONS if k not in ("remote", "sharded")], indirect=True)
def test_serve_takes_any_surface_and_refuses_other_objects(surface):
    surface.extend(_batch(16, seed=9))
    with ab.serve(surface, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as remote:
        assert len(remote) == len(surface)
        again = remote.extend(_batch(16, seed=10))
        assert again.dtype == np.int64 and len(again) == 16
        assert surface.update_priorities(again, np.ones(16)) == 16  # the served store's own ids
    with pytest.raises(TypeError, match="StoreSurface"):
        ab.serve({"x": object()}, "grpc://127.0.0.1:0")


def test_capabilities_beyond_the_surface_are_declared(tmp_path):
    """Optional capabilities are runtime-checkable Protocols (issue 39): the Flight server, /metrics and the SQL
    sandbox ask `isinstance(store, ab.TableStream)` instead of probing attributes."""
    import arrowbuf as ab

    schema = {"name": "cap", "fields": {"x": "int64"}}
    with ab.ExperienceStore(schema, 64) as plain, \
            ab.ExperienceStore(schema, 64, durable=str(tmp_path / "run")) as durable:
        for cap in (ab.TableStream, ab.PieceSink, ab.Observable, ab.LineageSource, ab.Bounded):
            assert isinstance(plain, cap) and isinstance(durable, cap), cap
        assert plain.takes_pieces and not durable.takes_pieces  # a durable store journals a batch whole
        with ab.serve(plain, "grpc://127.0.0.1:0", parts_into_ring=True) as server, \
                ab.connect(server.location) as remote:
            assert not isinstance(remote, (ab.PieceSink, ab.Observable))
            assert remote.parts_into_ring and remote.capacity == 64
        with ab.serve(durable, "grpc://127.0.0.1:0", parts_into_ring=True) as server, \
                ab.connect(server.location) as remote:
            assert not remote.parts_into_ring  # decided once, when the server started: this store takes none
