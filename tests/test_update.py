"""store.update: fields filled later (issue 16). Real stores, real processes, a real Flight server."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest
from conftest import process_context, store_snapshot

import arrowbuf as ab

GRPO = {"name": "g", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
    "reward": {"dtype": "float32", "later": True, "allow_nan": False},
    "emb": {"dtype": "float32", "shape": [2], "later": True},
    "done": {"dtype": "bool"},
}}
SCALAR = {"name": "s", "fields": {"prompt_id": "int64", "reward": {"dtype": "float32", "later": True},
                                  "emb": {"dtype": "float32", "shape": [2], "later": True}, "done": "bool"}}


def rollouts(n, start=0):
    rng = np.random.default_rng(start)
    return {"prompt_id": np.arange(start, start + n), "done": np.ones(n, bool),
            "response": [rng.integers(0, 100, rng.integers(1, 6)).astype(np.int32) for _ in range(n)]}


@pytest.fixture
def store():
    with ab.ExperienceStore(GRPO, capacity=16, chunk_rows=4, seed=0) as s:
        yield s


def test_left_out_fields_read_as_null_everywhere(store):
    ids = store.extend(rollouts(5))
    t = store.to_table()
    assert t.column("reward").null_count == 5 and t.column("ref_logprobs").null_count == 5
    assert t.column("emb").null_count == 5 and t.schema.field("reward").nullable
    b = store.sample(20)
    assert b.data.column("reward").null_count == 20 and b.data.column("emb").null_count == 20
    assert store.present(["reward"], ids).tolist() == [False] * 5
    assert store.present(["prompt_id"], ids).all()  # fields written with their row are always present
    assert store.sql("SELECT count(*) AS n FROM experience WHERE reward IS NULL").column("n")[0].as_py() == 5


def test_update_fills_field_by_field(store):
    ids = store.extend(rollouts(6))
    assert store.update(ids[:3], {"reward": [1.0, 2.0, 3.0]}) == 3
    assert store.update(ids[1:3], {"ref_logprobs": [[0.5, 0.25], []], "emb": np.ones((2, 2))}) == 2
    t = store.to_table().to_pydict()
    assert t["reward"] == [1.0, 2.0, 3.0, None, None, None]
    assert t["ref_logprobs"] == [None, [0.5, 0.25], [], None, None, None]
    assert t["emb"] == [None, [1.0, 1.0], [1.0, 1.0], None, None, None]
    both = store.present(["reward", "ref_logprobs"], ids)
    assert both.tolist() == [False, True, True, False, False, False]
    pos = ids % store.arena_rows
    assert store._core.present(["reward", "ref_logprobs"], pos).tolist() == both.tolist()
    # overwriting is allowed (a retried reward): last write wins
    store.update(ids[:1], {"reward": np.array([9.0], np.float32)})
    assert store.to_table(["reward"]).column(0).to_pylist()[0] == 9.0
    # one id as a plain int takes one value per field
    assert store.update(int(ids[5]), {"reward": 4.5, "ref_logprobs": [1.0]}) == 1
    b = store.sample(64)
    got = dict(zip(b.indices.tolist(), b.data.column("reward").to_pylist()))
    assert got.get(int(ids[5]), 4.5) == 4.5 and got.get(int(ids[3])) is None


@pytest.mark.parametrize("order", ["in order", "shuffled", "some"])
def test_ragged_update_rows_land_on_their_ids_and_are_copied(store, order):
    ids = store.extend(rollouts(16))  # the whole ring: every chunk slot
    pick = {"in order": ids, "shuffled": np.random.default_rng(1).permutation(ids), "some": ids[[1, 6, 7, 12]]}[order]
    flat = np.arange(2 * len(pick), dtype=np.float32)
    arr = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * len(pick) + 1, 2, dtype=np.int32)), pa.array(flat))
    assert store.update(pick, {"ref_logprobs": arr}) == len(pick)
    flat[:] = -1  # the caller's memory (pa.array over numpy is zero-copy): the store kept its own copy
    want = {int(i): [2.0 * k, 2.0 * k + 1] for k, i in enumerate(pick)}
    t = store.to_table(["seq", "ref_logprobs"]).to_pydict()
    assert dict(zip(t["seq"], t["ref_logprobs"])) == {int(i): want.get(int(i)) for i in ids}
    b = store.sample(64, columns=["ref_logprobs"])
    assert [want.get(int(i)) for i in b.indices] == b["ref_logprobs"].to_pylist()


@pytest.mark.filterwarnings("ignore::arrowbuf.errors.AppendSlowPathWarning")  # appends of ragged rows, on purpose
def test_given_at_extend_and_nulls_in_arrow_input(store):
    ids = store.extend({**rollouts(2), "reward": [0.5, None], "ref_logprobs": [None, [1.0]]})
    rb = pa.RecordBatch.from_pydict({"prompt_id": [7], "done": [True], "response": pa.array([[1, 2]], pa.list_(
        pa.int32())), "reward": pa.array([None], pa.float32())})
    ids2 = store.extend(rb)
    t = store.to_table().to_pydict()
    assert t["reward"] == [0.5, None, None] and t["ref_logprobs"] == [None, [1.0], None]
    assert store.present(["reward"], np.concatenate([ids, ids2])).tolist() == [True, False, False]
    store.append({"prompt_id": 8, "done": True, "response": [1], "reward": 2.0})
    store.append({"prompt_id": 9, "done": True, "response": [1], "reward": None})
    assert store.to_table(["reward"]).column(0).to_pylist()[-2:] == [2.0, None]


def test_absent_values_never_show_the_previous_row(store):
    """A ring position reused by a row without the field reads null, not the evicted row's value."""
    ids = store.extend({**rollouts(16), "reward": np.arange(16, dtype=np.float32), "emb": np.ones((16, 2)),
                        "ref_logprobs": [[1.0]] * 16})
    assert store.present(["reward", "emb", "ref_logprobs"], ids).all()
    store.extend(rollouts(40, start=100))  # wraps the ring more than twice
    t = store.to_table()
    assert t.num_rows == 16
    for name in ("reward", "emb", "ref_logprobs"):
        assert t.column(name).null_count == 16, name
    b = store.sample(50)
    assert b.data.column("reward").null_count == 50 and b.data.column("ref_logprobs").null_count == 50


def test_evicted_ids_are_skipped_and_counted(store):
    old = store.extend(rollouts(10))
    new = store.extend(rollouts(12, start=50))  # evicts the oldest 6 rows
    written = store.update(np.concatenate([old, new[:2]]), {"reward": np.arange(12, dtype=np.float32)})
    assert written == 6
    assert store.stats()["update_skipped"] == 6
    r = dict(zip(store.to_table(["seq", "reward"]).column(0).to_pylist(),
                 store.to_table(["seq", "reward"]).column(1).to_pylist()))
    assert r[int(old[-1])] == 9.0 and r[int(new[0])] == 10.0 and r[int(new[2])] is None


@pytest.mark.parametrize("ids, values, error, match", [
    ([0, 1], {"nope": [1, 2]}, ab.SchemaError, "unknown field 'nope'"),
    ([0, 1], {"prompt_id": [1, 2]}, ab.SchemaError, "later: true"),
    ([0, 1], {"reward": [1.0]}, ab.SchemaError, "1 value"),
    ([0, 1], {"reward": [1.0, float("nan")]}, ab.SchemaError, "NaN"),
    ([0, 1], {"reward": np.ma.MaskedArray([1.0, 2.0], mask=[False, True])}, ab.SchemaError, "masked"),
    ([0, 1], {"reward": [1.0, None]}, ab.SchemaError, "reward"),
    ([0, 1], {"reward": ["a", "b"]}, ab.SchemaError, "reward"),
    ([0, 1], {"emb": np.ones((2, 3))}, ab.SchemaError, "shape"),
    ([0, 1], {"ref_logprobs": [["x"], [1.0]]}, ab.SchemaError, "ref_logprobs"),
    ([0, 1], {"ref_logprobs": pa.array([["a"], ["b"]])}, ab.SchemaError, "ref_logprobs"),
    ([0, 1], {"ref_logprobs": pa.array([[1.0], None], pa.list_(pa.float32()))}, ab.SchemaError, "null"),
    ([0, 1], {"ref_logprobs": [[1.0, 2.0], [[1.0]]]}, ab.SchemaError, "1-D"),
    ([0, 1], {"reward": [1.0, 2.0], "emb": np.ones((1, 2))}, ab.SchemaError, "emb"),
    ([0, 99], {"reward": [1.0, 2.0]}, ab.InvalidArgument, "never issued"),
    ([0, -1], {"reward": [1.0, 2.0]}, ab.InvalidArgument, "negative"),
    ([0, 0], {"reward": [1.0, 2.0]}, ab.InvalidArgument, "more than once"),
    ([0, (7 << 56) | 1], {"reward": [1.0, 2.0]}, ab.InvalidArgument, "never issued"),  # a sharded store's id
    ([0.5, 1.0], {"reward": [1.0, 2.0]}, ab.InvalidArgument, "integer ids"),
    ([0, 1], {}, ab.InvalidArgument, "non-empty"),
    ([0, 1], [1.0, 2.0], ab.InvalidArgument, "dict"),
])
def test_bad_input_is_a_clear_error_and_changes_nothing(store, ids, values, error, match):
    store.extend({**rollouts(4), "reward": [0.0, None, 1.0, None]})
    before = store_snapshot(store)
    with pytest.raises(error, match=match):
        store.update(ids, values)
    assert store_snapshot(store) == before
    assert store.stats()["update_skipped"] == 0


def test_wrong_ragged_dtype_is_refused_without_loss(store):
    ids = store.extend(rollouts(2))
    store.update(ids, {"ref_logprobs": [[1.5], [2.5]]})
    before = store_snapshot(store)
    with pytest.raises(ab.SchemaError, match="ref_logprobs"):  # float64 that does not fit float32 ...
        store.update(ids, {"ref_logprobs": [[1e300], [1.0]]})
    with pytest.raises(ab.SchemaError, match="response"):  # ... and a field written with its row
        store.update(ids, {"response": [[1], [2]]})
    assert store_snapshot(store) == before


def test_update_wakes_waiters_through_the_hook(store):
    ids = store.extend(rollouts(3))
    seen = []
    store._core.on_update = lambda pos, fields: seen.append((pos.tolist(), fields))
    store.update(ids[1:], {"reward": [1.0, 2.0]})
    assert seen == [((ids[1:] % store.arena_rows).tolist(), ["reward"])]


def test_closed_store_refuses_updates():
    s = ab.ExperienceStore(GRPO, capacity=8)
    ids = s.extend(rollouts(2))
    s.close()
    with pytest.raises(ab.StoreClosed):
        s.update(ids, {"reward": [1.0, 2.0]})


# ---------------------------------------------------------------- across processes (shared memory)
def _shm_updater(name, ids, q):
    try:
        with ab.ExperienceStore.attach(name) as s:
            q.put(s.update(ids, {"reward": np.full(len(ids), 7.0, np.float32), "emb": np.ones((len(ids), 2))}))
    except BaseException as exc:  # report, never hang the parent
        q.put(repr(exc))


def test_shared_memory_update_from_another_process():
    name = f"upd-{uuid.uuid4().hex[:8]}"
    with ab.ExperienceStore(SCALAR, capacity=32, tier="shm", name=name) as s:
        ids = s.extend({"prompt_id": np.arange(6), "done": np.ones(6, bool)})
        ctx = process_context()
        q = ctx.Queue()
        p = ctx.Process(target=_shm_updater, args=(name, ids[::2], q))
        p.start()
        try:
            assert q.get(timeout=120) == 3
        finally:
            p.join(60)
            if p.is_alive():
                p.kill()
        t = s.to_table(["reward", "emb"]).to_pydict()
        assert t["reward"] == [7.0, None, 7.0, None, 7.0, None]
        assert t["emb"][1] is None and t["emb"][0] == [1.0, 1.0]
        assert s.present(["reward", "emb"], ids).tolist() == [True, False] * 3


# ---------------------------------------------------------------- over Flight (ab.connect), across processes
@pytest.fixture
def served():
    """A store with two tasks behind a real Flight server on 127.0.0.1:0, and a client; closed at teardown."""
    with ab.ExperienceStore(GRPO, capacity=64, chunk_rows=8, seed=0, tasks=["train"]) as s:
        with ab.serve(s, "grpc://127.0.0.1:0", shutdown_timeout=1.0) as server:
            with ab.connect(server.location, timeout=60) as client:
                yield s, server, client


def test_remote_update_and_nulls_over_the_wire(served):
    store, _, client = served
    ids = client.extend(rollouts(4))
    b = client.sample(8)
    assert b["reward"].null_count == 8 and b["ref_logprobs"].null_count == 8
    assert client.update(ids[:2], {"reward": [1.0, 2.0], "ref_logprobs": pa.array([[0.5], [0.25, 0.75]],
                                                                                   pa.list_(pa.float32()))}) == 2
    assert client.to_table(["reward"]).column(0).to_pylist() == [1.0, 2.0, None, None]
    assert store.to_table(["ref_logprobs"]).column(0).to_pylist() == [[0.5], [0.25, 0.75], None, None]
    client.extend({**rollouts(1), "reward": [None], "emb": np.ma.MaskedArray(np.ones((1, 2)), mask=True)})
    client.append({"prompt_id": 9, "done": True, "response": [1], "reward": 3.0})
    assert store.to_table(["reward"]).column(0).to_pylist()[-2:] == [None, 3.0]
    assert store.to_table(["emb"]).column(0).null_count == 6


def test_remote_bad_update_is_refused_and_changes_nothing(served):
    store, server, client = served
    ids = client.extend(rollouts(3))
    before = store_snapshot(store)
    for values in [{"nope": [1, 2, 3]}, {"prompt_id": [1, 2, 3]}, {"reward": [1.0, 2.0]},
                   {"ref_logprobs": [["a"], [], []]}]:
        with pytest.raises(ab.SchemaError):
            client.update(ids, values)
    with pytest.raises(ab.InvalidArgument, match="never issued"):  # checked by the server: ids are its own
        client.update([0, 1000], {"reward": [1.0, 2.0]})
    # a raw Flight client is checked by the server too, before any batch is read
    raw = pa.flight.FlightClient(server.location)
    try:
        for table in [pa.table({"id": pa.array(ids), "prompt_id": pa.array([1, 2, 3])}),
                      pa.table({"reward": pa.array([1.0, 2.0, 3.0])}),
                      pa.table({"id": pa.array([0.5, 1.0, 2.0]), "reward": pa.array([1.0, 2.0, 3.0])}),
                      pa.table({"id": pa.array(ids), "reward": pa.array(["a", "b", "c"])})]:
            writer, _ = raw.do_put(ab.flight.protocol.update_descriptor(store.name), table.schema)
            with pytest.raises(pa.flight.FlightError, match="update"):
                writer.write_table(table)
                writer.close()
        old_server = ab.flight.protocol.decode_put_descriptor  # a version-1 command cannot ask for an update
        with pytest.raises(ab.SchemaError, match="version 2"):
            old_server(pa.flight.FlightDescriptor.for_command(b'{"v":1,"kind":"update"}'))
    finally:
        raw.close()
    assert store_snapshot(store) == before


def _remote_writer(location, q):
    try:
        with ab.connect(location, timeout=60) as c:
            q.put(c.extend(rollouts(8, start=10)).tolist())
    except BaseException as exc:
        q.put(repr(exc))


def _remote_filler(location, ids, field, q):
    try:
        with ab.connect(location, timeout=60) as c:
            if field == "reward":
                values = np.asarray(ids, dtype=np.float32) / 10
            else:
                values = [np.full(i % 3 + 1, i, np.float32) for i in ids]
            q.put(c.update(np.asarray(ids), {field: values}))
    except BaseException as exc:
        q.put(repr(exc))


def _run(ctx, target, *args):
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        return q.get(timeout=180)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join(10)


@pytest.mark.slow
def test_field_by_field_completion_across_processes(served):
    """A writer process extends, two other processes fill reward and ref_logprobs over Flight; a consumer requiring
    both gets each row once, only once complete."""
    store, server, _ = served
    ctx = process_context()
    ids = _run(ctx, _remote_writer, server.location)
    assert isinstance(ids, list) and len(ids) == 8, ids
    assert len(store.consume("train", 8, require=["reward", "ref_logprobs"], timeout=0.0)) == 0
    assert _run(ctx, _remote_filler, server.location, ids[:5], "reward") == 5
    assert len(store.consume("train", 8, require=["reward", "ref_logprobs"], timeout=0.0)) == 0  # half done
    assert _run(ctx, _remote_filler, server.location, ids[2:], "ref_logprobs") == 6
    got = store.consume("train", 8, require=["reward", "ref_logprobs"], timeout=0.0)
    assert sorted(got.indices.tolist()) == ids[2:5]  # complete rows only
    assert got["reward"].tolist() == pytest.approx([i / 10 for i in ids[2:5]])
    assert [len(r) for r in got["ref_logprobs"].to_pylist()] == [i % 3 + 1 for i in ids[2:5]]
    assert len(store.consume("train", 8, require=["reward", "ref_logprobs"], timeout=0.0)) == 0  # once per task
    t = store.to_table(["reward", "ref_logprobs"]).to_pydict()
    assert t["reward"][:5] == pytest.approx([i / 10 for i in ids[:5]]) and t["reward"][5:] == [None] * 3
    assert t["ref_logprobs"][:2] == [None] * 2 and all(r is not None for r in t["ref_logprobs"][2:])


# ---------------------------------------------------------------- the shard adapter (global ids)
def test_shard_adapter_routes_global_ids():
    from arrowbuf.ray import ShardBackend
    from arrowbuf.ray.ids import encode_ids

    with ShardBackend(ab.ExperienceStore(GRPO, capacity=16, seed=0), 3, 5) as shard:
        ids = shard.extend(rollouts(4))
        assert shard.update(ids[:2], {"reward": [1.0, 2.0]}) == 2
        assert shard.store.to_table(["reward"]).column(0).to_pylist() == [1.0, 2.0, None, None]
        stale = encode_ids(3, 4, np.array([2]))  # this shard's previous incarnation: its rows are gone
        assert shard.update(stale, {"reward": [5.0]}) == 0
        assert shard.stats()["update_skipped"] == 1
        before = shard.store.to_table().to_pydict()
        with pytest.raises(ab.InvalidArgument, match="shard"):
            shard.update(encode_ids(2, 5, np.array([2])), {"reward": [5.0]})
        with pytest.raises(ab.InvalidArgument):
            shard.update(np.array([2]), {"reward": [5.0]})  # a local seq is not a global id
        assert shard.store.to_table().to_pydict() == before


# ---------------------------------------------------------------- a ShardedStore on a local Ray cluster
@pytest.mark.slow
def test_sharded_store_update_routes_by_shard(ray_cluster):
    pytest.importorskip("ray")
    from arrowbuf.ray import ShardedStore

    sharded = ShardedStore.create(GRPO, 2, 32, seed=0, failure_timeout=30.0)
    try:
        ids = np.concatenate([sharded.writer(shard=k).extend(rollouts(3, start=10 * k)) for k in (0, 1)])
        assert sharded.update(ids, {"reward": np.arange(6, dtype=np.float32),
                                    "ref_logprobs": [[float(i)] for i in range(6)]}) == 6
        t = sharded.to_table(["prompt_id", "reward", "ref_logprobs"])
        got = {p: (r, lp) for p, r, lp in zip(*(t.column(c).to_pylist() for c in
                                                  ("prompt_id", "reward", "ref_logprobs")))}
        assert got == {p: (float(i), [float(i)]) for i, p in enumerate([0, 1, 2, 10, 11, 12])}
        before = sharded.to_table().to_pydict()
        with pytest.raises(ab.InvalidArgument, match="not issued"):
            sharded.update(np.array([ids[0], 9 << 53]), {"reward": [1.0, 2.0]})
        with pytest.raises(ab.SchemaError, match="later"):
            sharded.update(ids, {"prompt_id": np.arange(6)})
        assert sharded.to_table().to_pydict() == before
    finally:
        sharded.shutdown()


# ---------------------------------------------------------------- a tiered store (device, host and disk chunks)
@pytest.mark.slow
def test_tiered_store_updates_are_never_lost_to_migrations(tmp_path):
    """Chunks move between a (CPU-backed) device tier, the host and a disk while an updater fills every row and a
    sampler checks each row it gets: a value is null or the row's own, and no update is lost at a migration's flip."""
    import threading

    pytest.importorskip("torch")
    from arrowbuf.tiers import GpuTier

    cap, cr = 512, 32
    schema = {"name": "t", "fields": {"a": "int64", "reward": {"dtype": "float64", "later": True},
                                      "emb": {"dtype": "float32", "shape": [2], "later": True}, "done": "bool"}}
    store = ab.ExperienceStore(schema, cap, seed=0, chunk_rows=cr,
                               tiers={"gpu": GpuTier(budget=3 * cr * 64, device="cpu"), "host": "64KiB",
                                      "disk": tmp_path}, placement="static")
    with store:
        ids = store.extend({"a": np.arange(cap), "done": np.ones(cap, bool)})
        cols = store._cols
        for name in ("a", "reward", "emb"):
            cols.ensure_arena(0, name, 4)
        stop = threading.Event()
        errors: list[BaseException] = []

        def mover():
            rng = np.random.default_rng(1)
            try:
                while not stop.is_set():
                    name = ("a", "reward", "emb")[int(rng.integers(3))]
                    s = int(rng.integers(cols.num_slots))
                    cols.migrate(name, s, int(rng.integers(3)), int(store.index.seq[s * cr]), store.index,
                                 store._lock)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        t = threading.Thread(target=mover)
        t.start()
        try:
            for part in np.array_split(np.random.default_rng(0).permutation(ids), 16):
                assert store.update(part, {"reward": part.astype(np.float64),
                                           "emb": np.stack([part, -part], axis=1).astype(np.float32)}) == len(part)
                b = store.sample(64, columns=["a", "reward", "emb"])
                r = b["reward"]
                got = r.to_pylist() if isinstance(r, pa.Array) else r.tolist()
                for seq, a, v in zip(b.indices.tolist(), b["a"].tolist(), got):
                    assert a == seq and v in (None, float(seq))
        finally:
            stop.set()
            t.join()
        assert not errors, errors
        assert store.stats()["placement"]["migrations"] > 0
        tab = store.to_table(["seq", "reward", "emb"]).to_pydict()
        assert tab["reward"] == [float(s) for s in tab["seq"]]
        assert tab["emb"] == [[float(s), float(-s)] for s in tab["seq"]]


def racing_store(fields: dict, tmp_path, cap: int = 64, cr: int = 32):
    """A tiered store of `cap` rows `a` = 0..cap-1 (chunks of `cr`) whose column `a` lives wholly on a (CPU-backed)
    device tier, so every gather reads it there; the tier runs its `race` (when set) before each read: a migration
    landing mid-gather. Returns (store, tier, ids)."""
    pytest.importorskip("torch")
    from arrowbuf.tiers import GpuTier

    class RacingTier(GpuTier):
        race = None

        def take(self, *args, **kwargs):
            if self.race is not None:
                self.race()
            return super().take(*args, **kwargs)

    gpu = RacingTier(budget=2 * cr * 8, device="cpu")
    store = ab.ExperienceStore({"name": "t", "fields": {"a": "int64", **fields, "done": "bool"}}, cap, seed=0,
                               chunk_rows=cr, tiers={"gpu": gpu, "host": "64KiB", "disk": tmp_path},
                               placement="static")
    ids = store.extend({"a": np.arange(cap), "done": np.ones(cap, bool)})
    cols, idx = store._cols, store.index
    assert cols.ensure_arena(0, "a", 2)
    for s in range(cap // cr):
        assert cols.migrate("a", s, 0, int(idx.seq[s * cr]), idx, store._lock)
    return store, gpu, ids


def test_tiered_sample_and_update_progress_while_every_read_races_a_migration(tmp_path):
    """A placement so busy that a chunk of every gather moves while it is read: the sample's optimistic seqlock can
    never win, so it must hold migrations off (bounded) rather than give up; updates still land and read back.
    Deterministic: the moves happen inside the gather itself (a device tier that migrates on each read)."""
    cr = 32
    store, gpu, ids = racing_store({"reward": {"dtype": "float64", "later": True}}, tmp_path, cr=cr)
    with store:
        cols, idx = store._cols, store.index
        ri = cols.ci["reward"]

        def race():  # move both chunks of reward between host and disk: every item of the batch read a moved chunk
            for s in range(2):
                cols.migrate("reward", s, 1 if cols.res[ri, s] == 2 else 2, int(idx.seq[s * cr]), idx, store._lock)

        gpu.race = race
        try:
            for part in np.array_split(ids, 4):
                assert store.update(part, {"reward": part.astype(np.float64)}) == len(part)
                b = store.sample(64, columns=["a", "reward"])
                r = b["reward"]
                got = r.to_pylist() if isinstance(r, pa.Array) else r.tolist()
                for seq, a, v in zip(b.indices.tolist(), b["a"].tolist(), got):
                    assert a == seq and v in (None, float(seq))
        finally:
            gpu.race = None
        assert cols.counters["held_gathers"] >= 4 and cols.counters["migrations"] > 8
        tab = store.to_table(["seq", "reward"]).to_pydict()
        assert tab["reward"] == [float(s) for s in tab["seq"]]


def test_tiered_sample_regathers_rows_whose_nulls_differ_from_the_batch(tmp_path):
    """A chunk moves while a sample reads it, so its items are read again: the batch has null rows (an Arrow array)
    while the re-read rows have none (numpy), or both have nulls in a tensor field. The re-read rows merge into the
    batch whatever kinds the two reads came back as."""
    cr = 32
    store, gpu, ids = racing_store({"reward": {"dtype": "float64", "later": True},
                                    "emb": {"dtype": "float32", "shape": [2], "later": True}}, tmp_path, cr=cr)
    with store:  # column a is read on the device, after the later fields
        cols, idx = store._cols, store.index
        first, evens = ids[:cr], ids[::2]
        assert store.update(first, {"reward": first.astype(np.float64)}) == cr  # chunk 0 whole, chunk 1 null
        assert store.update(evens, {"emb": np.stack([evens, -evens], axis=1).astype(np.float32)}) == len(evens)

        def race():  # once: chunk 0 of both later fields moves between host and disk
            gpu.race = None
            for name in ("reward", "emb"):
                ci = cols.ci[name]
                assert cols.migrate(name, 0, 1 if cols.res[ci, 0] == 2 else 2, int(idx.seq[0]), idx, store._lock)

        before = cols.counters["regathers"]
        gpu.race = race
        b = store.sample(64, columns=["a", "reward", "emb"])
        assert gpu.race is None and cols.counters["regathers"] > before  # the race ran; some items were read again
        rew, emb = b["reward"].to_pylist(), b["emb"].to_pylist()
        for seq, a, r, e in zip(b.indices.tolist(), b["a"].tolist(), rew, emb):
            assert a == seq
            assert r == (float(seq) if seq < cr else None)
            assert e == ([float(seq), float(-seq)] if seq % 2 == 0 else None)


# ---------------------------------------------------------------- ragged fields in shared memory
RAGGED_SHM = {"name": "rs", "fields": {
    "p": "int64", "tok": {"dtype": "int32", "ragged": True, "mean_length": 8},
    "ref": {"dtype": "float32", "ragged": True, "later": True, "mean_length": 8},
    "flags": {"dtype": "bool", "ragged": True}, "done": "bool"}}


def ragged_rows(start, n):
    return {"p": np.arange(start, start + n), "done": np.ones(n, bool),
            "tok": [np.arange(i, i + i % 7, dtype=np.int32) for i in range(start, start + n)],
            "flags": [np.array([i % 2 == 0] * (i % 3)) for i in range(start, start + n)]}


def check_ragged_rows(store):
    t = store.to_table(["seq", "p", "tok", "ref", "flags"]).to_pydict()
    for sq, p, tok, ref, flags in zip(*t.values()):
        assert p == sq and tok == list(range(sq, sq + sq % 7)) and flags == [sq % 2 == 0] * (sq % 3), sq
        assert ref is None or ref == [float(sq)] * (sq % 5), (sq, ref)
    b = store.sample(16)
    for i, tok, ref in zip(b.indices.tolist(), b["tok"].to_pylist(), b["ref"].to_pylist()):
        assert tok == list(range(i, i + i % 7)) and (ref is None or ref == [float(i)] * (i % 5))


def test_ragged_fields_in_shared_memory_survive_the_ring_turning():
    """Batches of random sizes wrap a small ring many times while rows of the old generation of a chunk are still
    live: every row reads back as written (tokens, bools, and a later field updated in place)."""
    rng = np.random.default_rng(0)
    with ab.ExperienceStore(RAGGED_SHM, capacity=20, chunk_rows=4, tier="shm",
                            name=f"rg-{uuid.uuid4().hex[:8]}") as s:
        seq = 0
        for _ in range(15):
            n = int(rng.integers(1, 9))
            ids = s.extend(ragged_rows(seq, n))
            seq += n
            s.update(ids[::2], {"ref": [np.full(i % 5, i, np.float32) for i in ids[::2]]})
            check_ragged_rows(s)
        assert s.to_table(["ref"]).column(0).null_count > 0


def test_ragged_rows_over_the_arenas_room_are_refused_clearly():
    # the arena holds mean_length (8) elements per ring row, 24 rows: 192 elements for the whole column
    with ab.ExperienceStore(RAGGED_SHM, capacity=20, chunk_rows=4, tier="shm",
                            name=f"rg-{uuid.uuid4().hex[:8]}") as s:
        ids = s.extend(ragged_rows(0, 4))
        before = s.to_table().to_pydict()
        with pytest.raises(ab.OutOfSpace, match="mean_length"):
            s.update(ids[:1], {"ref": [np.zeros(300, np.float32)]})
        assert s.to_table().to_pydict() == before
        with pytest.raises(ab.OutOfSpace, match="mean_length"):
            s.extend({**ragged_rows(4, 1), "tok": [np.zeros(300, np.int32)]})
        s.extend(ragged_rows(5, 3))  # the store goes on (the refused batch is left out)
        check_ragged_rows(s)
        s.update(ids[:1], {"ref": [np.ones(100, np.float32)]})  # a row over a chunk's share of the arena fits
        assert s.to_table(["ref"]).column(0)[0].as_py() == [1.0] * 100


def _shm_ragged_worker(name, q):
    try:
        with ab.ExperienceStore.attach(name) as s:
            ids = s.extend(ragged_rows(100, 6))
            s.update(ids, {"ref": [np.full(i % 5, i, np.float32) for i in ids]})
            q.put(ids.tolist())
    except BaseException as exc:
        q.put(repr(exc))


def test_ragged_rows_written_and_updated_by_another_process():
    name = f"rg-{uuid.uuid4().hex[:8]}"
    with ab.ExperienceStore(RAGGED_SHM, capacity=32, chunk_rows=4, tier="shm", name=name) as s:
        s.extend(ragged_rows(0, 5))
        ids = _run(process_context(), _shm_ragged_worker, name)
        assert ids == list(range(5, 11)), ids
        t = s.to_table(["seq", "p", "tok", "ref"]).to_pydict()
        assert t["p"] == [0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 105]
        assert t["tok"][5] == list(range(100, 100 + 100 % 7)) and t["ref"][6] == [6.0] * (6 % 5)
        assert t["ref"][:5] == [None] * 5


def test_ragged_fields_spill_to_the_disk_tier_of_a_tiered_store(tmp_path):
    """A tiered store takes ragged fields (later ones included): their elements live in the disk tier's files."""
    rng = np.random.default_rng(2)
    with ab.ExperienceStore(RAGGED_SHM, capacity=20, chunk_rows=4, tiers={"host": "64KiB", "disk": tmp_path}) as s:
        seq = 0
        for _ in range(12):
            n = int(rng.integers(1, 9))
            ids = s.extend(ragged_rows(seq, n))
            seq += n
            s.update(ids[::2], {"ref": [np.full(i % 5, i, np.float32) for i in ids[::2]]})
            check_ragged_rows(s)
        spilled = [p.name for p in tmp_path.rglob("*") if "tok" in p.name]
        assert spilled, sorted(p.name for p in tmp_path.rglob("*"))
        where = s.placement().to_pylist()
        # placement lists every column where its bytes are (one definition of sizes); ragged ones never move
        assert {r["tier"] for r in where if r["column"] in ("tok", "ref", "flags")} == {"disk"}, where


# ---------------------------------------------------------------- readers never see half an update
WIDE = {"name": "w", "fields": {"p": "int64", "emb": {"dtype": "float64", "shape": [4096], "later": True},
                                "done": "bool"}}


def _wide_updater(name, ids, rounds, q):
    try:
        with ab.ExperienceStore.attach(name) as s:
            for k in range(1, rounds + 1):
                s.update(ids, {"emb": np.full((len(ids), 4096), float(k))})
            q.put(rounds)
    except BaseException as exc:
        q.put(repr(exc))


def test_samples_never_mix_two_updates_of_a_row():
    """Another process overwrites 4096-element rows again and again; every sampled and snapshotted row is one
    update's value throughout (the presence seqlock), never part old, part new."""
    name = f"wide-{uuid.uuid4().hex[:8]}"
    with ab.ExperienceStore(WIDE, capacity=64, chunk_rows=16, tier="shm", name=name) as s:
        ids = s.extend({"p": np.arange(64), "done": np.ones(64, bool)})
        ctx = process_context()
        q = ctx.Queue()
        p = ctx.Process(target=_wide_updater, args=(name, ids, 300, q))
        p.start()
        try:
            seen = 0
            while p.is_alive() or seen == 0:
                b = s.sample(32, columns=["emb"])
                emb = b["emb"]
                rows = emb.to_numpy_ndarray() if isinstance(emb, pa.Array) and not emb.null_count else emb
                if isinstance(rows, np.ndarray):
                    assert (rows == rows[:, :1]).all()
                    seen += 1
                t = s.to_table(["emb"]).column(0).combine_chunks()
                if not t.null_count:
                    arr = t.to_numpy_ndarray()
                    assert (arr == arr[:, :1]).all()
                if seen > 2000:
                    break
            assert q.get(timeout=120) == 300
        finally:
            p.join(60)
            if p.is_alive():
                p.kill()


# --------------------------------------------------------------------- n-step returns over a reward filled later
NSTEP_LATER = {"name": "nl", "fields": {"obs": {"dtype": "float32", "shape": [2]}, "action": "int64",
                                         "reward": {"dtype": "float32", "later": True},
                                         "terminated": "bool", "truncated": "bool"},
               "derived": {"next_obs": {"next_of": "obs"}}}


def test_n_step_returns_never_read_an_unfilled_reward_as_zero():
    """n-step windows stop before a step whose later reward is not filled yet, and a row whose own reward is absent
    gets a NaN return (the old code summed the arena's 0 for every absent reward, silently)."""
    n = 12  # one episode of 12 steps; rewards filled for all but steps 4 and 9
    obs = np.stack([np.arange(n), np.zeros(n)], 1).astype(np.float32)
    with ab.ExperienceStore(NSTEP_LATER, 64, seed=0) as store:
        ids = store.extend({"obs": obs, "action": np.zeros(n, np.int64), "terminated": np.arange(n) == n - 1,
                            "truncated": np.zeros(n, bool), "next_obs": obs + np.array([1, 0], np.float32)})
        filled = np.setdiff1d(np.arange(n), [4, 9])
        reward = (np.arange(n) + 1).astype(np.float32)
        assert store.update(ids[filled], {"reward": reward[filled]}) == len(filled)
        k, gamma = 3, 0.5
        b = store.sample(400, n_step=k, gamma=gamma)
        seen = set()
        for i, r, d, nxt in zip(b.indices, b["n_step_return"], b["n_step_discount"], b["n_step_next_obs"][:, 0]):
            t = int(i)
            seen.add(t)
            if t in (4, 9):
                assert np.isnan(r)
                continue
            m, ret = 0, 0.0
            while m < k and t + m < n and (m == 0 or t + m not in (4, 9)):
                ret += gamma ** m * reward[t + m]
                m += 1
            terminal = t + m - 1 == n - 1
            assert r == pytest.approx(ret) and d == pytest.approx(0.0 if terminal else gamma ** m), (t, r, d)
            assert nxt == obs[t + m - 1, 0] + 1  # the bootstrap observation: the next one of the window's last step
        assert {3, 4, 8, 9, 10} <= seen  # windows that reach an unfilled step, and the unfilled rows themselves
