"""Memory tiers: one contract suite over host, shared memory, disk and GPU (the GPU cases skip without a CUDA device),
the disk tier's Arrow IPC files, the GPU tier's error without a GPU, and `tiers=` on the store.

Rows encode their own seq (obs = [seq, seq + 1, 7], reward = seq) so any row read anywhere is checked on its own.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab
from arrowbuf.tiers import DiskTier, GpuTier, HostTier, make_tiers, parse_bytes
from arrowbuf.tiers.gpu import gpu_environment
from conftest import SMALL

SCHEMA = {**SMALL, "name": "tiertest"}  # the shared small schema of conftest, under its own name
EPISODE = 37


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_gpu = pytest.mark.skipif(not cuda_available(), reason=f"no CUDA device: {gpu_environment()}")
# "gpu-on-cpu": the gpu tier's code path (torch tensors, device gathers) on torch's CPU device, so it runs everywhere
TIERS = ["host", "shm", "disk", "gpu-on-cpu", pytest.param("gpu", marks=needs_gpu)]


def rows(k0: int, n: int) -> dict[str, np.ndarray]:
    """Steps with seq k0..k0+n-1 (when written from seq k0 on); an episode ends every EPISODE steps."""
    k = np.arange(k0, k0 + n)
    enc = lambda kk: np.stack([kk, kk + 1, np.full(len(kk), 7)], 1).astype(np.float32)  # noqa: E731
    return {"obs": enc(k), "action": k.astype(np.int64), "reward": k.astype(np.float32),
            "terminated": (k % EPISODE) == EPISODE - 1, "truncated": np.zeros(n, bool), "next_obs": enc(k + 1)}


def check_batch(batch: ab.SampleBatch) -> None:
    """Every row is whole and is the row its id names."""
    x = batch.to_numpy()
    seq = batch.indices
    np.testing.assert_array_equal(x["obs"][:, 0], seq.astype(np.float32))
    np.testing.assert_array_equal(x["obs"][:, 1:], np.stack([seq + 1, np.full(len(seq), 7)], 1).astype(np.float32))
    np.testing.assert_array_equal(x["reward"], seq.astype(np.float32))
    np.testing.assert_array_equal(x["action"], seq)
    if "next_obs" in x:
        np.testing.assert_array_equal(x["next_obs"][:, 0], (seq + 1).astype(np.float32))


@pytest.fixture
def make_tier(tmp_path):
    """A factory of fresh tiers by kind; closes them all afterwards."""
    made: list = []

    def make(kind: str):
        if kind == "host":
            t = HostTier()
        elif kind == "disk":
            t = DiskTier(tmp_path / "spill")
        elif kind == "shm":
            from arrowbuf.tiers.shm import SharedMemoryTier

            t = SharedMemoryTier.create(f"tiertest-{uuid.uuid4().hex[:10]}")
        else:
            t = GpuTier() if kind == "gpu" else GpuTier(device="cpu")
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def to_numpy(a) -> np.ndarray:
    return a.cpu().numpy() if hasattr(a, "cpu") else np.asarray(a)


# ---------------------------------------------------------------------- the Tier contract
@pytest.mark.parametrize("kind", TIERS)
def test_tier_contract_allocate_write_read_account_close(kind, make_tier):
    tier = make_tier(kind)
    assert tier.name == kind.removesuffix("-on-cpu") and tier.nbytes() == 0
    obs = tier.allocate("obs", np.dtype(np.float32), 100, (3,))
    flags = tier.allocate("flags", np.dtype(np.bool_), 100)
    assert tuple(obs.shape) == (100, 3) and tuple(flags.shape) == (100,)
    assert tier.nbytes() >= 100 * 12 + 100
    values = np.arange(300, dtype=np.float32).reshape(100, 3)
    if kind.startswith("gpu"):
        tier.put(obs, 0, values)
        tier.put(flags, 0, values[:, 0] > 150)
    else:
        obs[:] = values
        flags[:] = values[:, 0] > 150
    np.testing.assert_array_equal(to_numpy(obs), values)
    np.testing.assert_array_equal(to_numpy(flags), values[:, 0] > 150)
    lock = tier.lock("state")
    with lock:
        pass
    with tier:
        pass
    tier.close()  # idempotent
    tier.close()


@pytest.mark.parametrize("kind", TIERS)
def test_a_store_returns_the_same_rows_on_every_tier(kind, tmp_path):
    """The same data and seed give the same batches, to_table and episodes on every tier."""
    ref = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32)
    if kind == "host":
        store = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32, tier=HostTier())
    elif kind == "shm":
        store = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32, tier="shm",
                                   name=f"tiertest-{uuid.uuid4().hex[:10]}")
    elif kind == "disk":
        store = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32, tier=DiskTier(tmp_path / "spill"))
    else:  # gpu: every chunk moved to the device, then sampled there
        # on torch's CPU device the probed bandwidths are alike: give the GPU's, so the policy promotes chunks
        # ring=False: chunk slots placed on the device (the device ring has tests of its own: test_device_ring.py)
        gpu, bw = (GpuTier("64MiB", ring=False), None) if kind == "gpu" else (GpuTier(budget="64MiB", device="cpu"),
                                                         {"gpu": 100e9, "host": 10e9})
        store = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32, tiers={"gpu": gpu, "host": None},
                                   placement=ab.placement.BandwidthAware(interval=None, bandwidth=bw))
    with ref, store:
        for s in (ref, store):
            s.extend(rows(0, 700))
        if kind.startswith("gpu"):
            ref.sample(64)  # the same draws on both sides, so the two random streams stay in step
            store.sample(64)
            store.placement_policy.step()
            assert store.placement().filter(pa.compute.equal(pa.compute.field("tier"), "gpu"))["chunks"] \
                .to_numpy().sum() > 0
        for _ in range(3):
            a, b = ref.sample(64), store.sample(64)
            np.testing.assert_array_equal(a.indices, b.indices)
            check_batch(b)
            for k, v in a.to_numpy().items():
                np.testing.assert_array_equal(v, b.to_numpy()[k])
        assert ref.to_table().equals(store.to_table())
        assert ref.episodes().equals(store.episodes())


@pytest.mark.parametrize("kind", ["gpu-ring-on-cpu", pytest.param("gpu-ring", marks=needs_gpu)])
def test_a_store_with_a_device_ring_holds_the_same_rows_and_samples_them_whole(kind):
    """The device ring (issue 43; tests/test_device_ring.py has the rest): the same table and episodes as a host
    store of the same data, and whole rows from the device (its own PRNG: other rows than the host's draws)."""
    import torch

    device = "cpu" if kind.endswith("on-cpu") else "cuda"
    ref = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32)
    store = ab.ExperienceStore(SCHEMA, 500, seed=3, chunk_rows=32,
                               tiers={"gpu": GpuTier(budget="64MiB", device=device, ring=True), "host": None})
    with ref, store:
        for s in (ref, store):
            s.extend(rows(0, 700))
        for _ in range(3):
            b = store.sample(64)
            assert isinstance(b.indices, torch.Tensor) and b["obs"].device.type == device
            check_batch(ab.SampleBatch({k: b[k] for k in b.columns}, b.indices.cpu().numpy()))
        assert ref.to_table().equals(store.to_table())
        assert ref.episodes().equals(store.episodes())


@pytest.mark.parametrize("kind", TIERS)
@pytest.mark.filterwarnings("ignore::arrowbuf.AppendSlowPathWarning")
def test_every_dtype_round_trips_bit_exactly_on_every_tier(kind, tmp_path):
    """bfloat16, float8, complex, float16, bool and json fields (tests/dtype_rows.py), filled later ones too, on each
    tier: as the arena's only tier, and on the GPU tier after placement moved chunks there (the GPU tier stores
    uint16 as int16 and delivers it widened: bfloat16 comes back as bfloat16 tensors of the same bits)."""
    import dtype_rows as D

    kw: dict = {"seed": 3, "chunk_rows": 32}
    if kind == "host":
        kw["tier"] = HostTier()
    elif kind == "shm":
        kw.update(tier="shm", name=f"tiertest-{uuid.uuid4().hex[:10]}")
    elif kind == "disk":
        kw["tier"] = DiskTier(tmp_path / "spill")
    else:
        # ring=False: chunk slots placed on the device (the device ring has tests of its own: test_device_ring.py)
        gpu, bw = (GpuTier("64MiB", ring=False), None) if kind == "gpu" else (GpuTier(budget="64MiB", device="cpu"),
                                                         {"gpu": 100e9, "host": 10e9})
        kw.update(tiers={"gpu": gpu, "host": None}, placement=ab.placement.BandwidthAware(interval=None, bandwidth=bw))
    with ab.ExperienceStore(D.DTYPES, 300, **kw) as store:
        ids = store.extend(D.rows(0, 200))
        store.extend(D.torch_rows(200, 50))
        written = np.arange(0, 250, 3)
        store.update(ids[written[written < 200]], D.later_values(written[written < 200]))
        later = {k: bool(k % 3 == 0 and k < 200) for k in range(250)}
        if kind.startswith("gpu"):
            store.sample(64)
            store.placement_policy.step()
            on_gpu = store.placement().filter(pa.compute.equal(pa.compute.field("tier"), "gpu"))
            assert {"bf", "f8", "cx"} & set(on_gpu["column"].to_pylist())
        for _ in range(3):
            D.check_batch(store.sample(64), later)
        D.check_table(store.to_table(), later)


# ---------------------------------------------------------------------- disk
def test_disk_arenas_are_arrow_ipc_files_any_arrow_tool_reads(tmp_path):
    tier = DiskTier(tmp_path / "spill", budget="1MiB")
    obs = tier.allocate("obs", np.dtype(np.uint8), 64, (4, 5))
    done = tier.allocate("index.valid", np.dtype(np.bool_), 64)
    reward = tier.allocate("reward", np.dtype(np.float16), 64)
    obs[:] = np.arange(64 * 20, dtype=np.uint8).reshape(64, 4, 5)
    done[::3] = True
    reward[:] = np.linspace(0, 1, 64, dtype=np.float16)
    tier.flush()
    t = pa.ipc.open_file(tier.path_of("obs")).read_all()
    assert isinstance(t.schema.field("obs").type, pa.FixedShapeTensorType)
    np.testing.assert_array_equal(t.column("obs").chunk(0).to_numpy_ndarray(), obs)
    v = pa.ipc.open_file(tier.path_of("index.valid")).read_all()
    assert v.schema.field(0).metadata[b"arrowbuf.dtype"] == b"|b1"
    np.testing.assert_array_equal(v.column(0).to_numpy().astype(bool), done)
    r = pa.ipc.open_file(tier.path_of("reward")).read_all()
    np.testing.assert_array_equal(r.column(0).to_numpy(), reward)
    tier.prefetch("obs", np.array([1, 2, 3, 40, 63]))  # reads ahead (MADV_WILLNEED); the data is untouched
    tier.load_cache()
    np.testing.assert_array_equal(obs, np.arange(64 * 20, dtype=np.uint8).reshape(64, 4, 5))
    files = [tier.path_of(k) for k in ("obs", "index.valid", "reward")]
    assert tier.nbytes() == sum(os.path.getsize(f) for f in files)
    with pytest.raises(ab.OutOfSpace, match="budget"):
        tier.allocate("big", np.dtype(np.uint8), 2 << 20)
    tier.close()
    assert not any(os.path.exists(f) for f in files) and not os.path.exists(tier.path)


def test_a_large_disk_arena_is_reserved_without_being_written(tmp_path):
    """The file is a valid IPC file of zeros whose blocks are reserved (posix_fallocate), not written."""
    with DiskTier(tmp_path) as tier:
        arena = tier.allocate("big", np.dtype(np.uint8), 64 << 20)
        st = os.stat(tier.path_of("big"))
        assert st.st_blocks * 512 >= 64 << 20  # reserved: a write through the mapping cannot hit ENOSPC
        arena[-1] = 9
        tier.flush()
        with pa.memory_map(tier.path_of("big")) as source:
            col = pa.ipc.open_file(source).get_batch(0).column(0)
            assert len(col) == 64 << 20 and col[12345].as_py() == 0 and col[-1].as_py() == 9
            del col


# ---------------------------------------------------------------------- host sparse arenas
def test_host_sparse_arena_holds_exactly_the_pages_of_held_ranges():
    tier = HostTier()
    arena = tier.allocate_sparse("obs", np.dtype(np.float32), 10_000, (100,))  # 400 bytes a row
    assert tier.nbytes() == 0
    assert tier.hold_cost("obs", 0, 100) == tier.hold("obs", 0, 100) == 40_960  # 40,000 bytes: 10 pages
    assert tier.hold("obs", 100, 200) == 40_960  # shares one page with [0, 100): that one is not counted twice
    arena[0:200] = 1.0
    assert tier.nbytes() == 81_920
    assert tier.release("obs", 0, 100) == 36_864  # the shared page stays
    np.testing.assert_array_equal(arena[100:200], 1.0)
    assert tier.release("obs", 100, 200) == 45_056 and tier.nbytes() == 0
    with pytest.raises(RuntimeError):
        tier.release("obs", 0, 100)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    big = tier.allocate_sparse("big", np.dtype(np.uint8), 2 * ram)  # bigger than RAM: address space, no memory
    assert tier.hold("big", 2 * ram - 1, 2 * ram) == 4096 and tier.nbytes() == 4096
    big[-1] = 1


# ---------------------------------------------------------------------- gpu
def test_gpu_tier_without_a_gpu_names_the_extra_and_what_was_found():
    if cuda_available():
        assert GpuTier("1MiB").nbytes() == 0
        return
    with pytest.raises(ab.MissingDependency) as err:
        GpuTier("1MiB")
    msg = str(err.value)
    assert "arrowbuf[gpu]" in msg and "found:" in msg and "torch" in msg and "cudf" in msg
    with pytest.raises(ab.MissingDependency, match=r"arrowbuf\[gpu\]"):
        ab.ExperienceStore(SCHEMA, 100, tiers={"gpu": "1GiB", "host": "1GiB"})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("dtype,shape", [(np.uint8, (84, 84, 4)), (np.uint8, (3,)), (np.uint8, (7,)),
                                         (np.float32, ()), (np.float32, (5,)), (np.float16, (3,)), (np.int64, (2,)),
                                         (np.uint16, (4,)), (np.uint32, (3,)), (np.bool_, (16,))])
def test_gpu_tier_gathers_and_scatters_rows_exactly_whatever_their_width(device, dtype, shape):
    # take and scatter move rows as wide words where a row's bytes allow (a uint8 frame as int64 words): the values,
    # dtypes and shapes delivered must be those of an element-wise gather, for every width and odd row sizes
    tier = GpuTier(device=device)
    rng = np.random.default_rng(0)
    arena = tier.allocate("col", np.dtype(dtype), 50, shape)
    values = rng.integers(0, 200, size=(50, *shape)).astype(dtype)
    tier.put(arena, 0, values)
    pos = rng.integers(0, 50, size=17)
    got = tier.take(arena, pos, np.dtype(dtype))
    assert tuple(got.shape) == (17, *shape)
    np.testing.assert_array_equal(got.cpu().numpy().astype(dtype), values[pos])
    out = tier.empty((30, *shape), np.dtype(dtype))
    at = rng.permutation(30)[:17]
    tier.scatter(out, at, got)
    assert out.dtype == got.dtype
    np.testing.assert_array_equal(out.cpu().numpy()[at].astype(dtype), values[pos])
    tier.close()


@needs_gpu
def test_gpu_sampling_delivers_device_tensors_gathered_on_the_device():
    import torch

    with ab.ExperienceStore(SCHEMA, 2000, seed=0, chunk_rows=64, tiers={"gpu": GpuTier("256MiB", ring=False),
                                                                      "host": None},
                            placement=ab.placement.BandwidthAware(interval=None)) as store:
        store.extend(rows(0, 2000))
        store.sample(256)
        store.placement_policy.step()
        batch = store.sample(512)
        assert isinstance(batch["obs"], torch.Tensor) and batch["obs"].is_cuda
        t = batch.to_torch("cuda")
        assert t["obs"].data_ptr() == batch["obs"].data_ptr()  # no host round trip
        check_batch(batch)


@needs_gpu
def test_to_cudf_has_the_scalar_and_metadata_columns():
    pytest.importorskip("cudf", reason="cuDF (arrowbuf[gpu]) is not installed on this GPU machine")
    with ab.ExperienceStore(SCHEMA, 500, seed=0) as store:
        store.extend(rows(0, 300))
        df = store.to_cudf()
        assert list(df.columns) == ["action", "reward", "terminated", "truncated", "episode_id", "step", "seq"]
        assert len(df) == 300
        with pytest.raises(ab.SchemaError, match="tensor"):
            store.to_cudf(["obs"])


# ---------------------------------------------------------------------- tiers= on the store
def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes(4096) == 4096
    assert parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("16k") == 16 << 10 and parse_bytes(None) is None
    for bad in ("lots", -1, "8 parsecs", 1.5, True):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_tiers_argument_is_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown tier"):
        ab.ExperienceStore(SCHEMA, 100, tiers={"tape": "1TiB"})
    with pytest.raises(ValueError, match="not both"):
        ab.ExperienceStore(SCHEMA, 100, tier="shm", tiers={"host": "1GiB"})
    tokens = {"name": "tok", "fields": {"tokens": {"dtype": "int32", "ragged": True}, "reward": {"dtype": "float32"},
                                        "terminated": {"dtype": "bool"}, "truncated": {"dtype": "bool"}}}
    with ab.ExperienceStore(tokens, 100, tiers={"host": "1GiB", "disk": tmp_path / "r"}) as ragged:  # issue 16
        ragged.extend({"tokens": [[1, 2], []], "reward": [0.0, 1.0], "terminated": [True, True],
                       "truncated": [False, False]})
        assert ragged.to_table(["tokens"]).column(0).to_pylist() == [[1, 2], []]
    with pytest.raises(ab.OutOfSpace, match="add a disk tier") as err:  # host alone must hold everything
        ab.ExperienceStore(SCHEMA, 100_000, tiers={"host": "1MiB"})
    assert "budget is 1.0 MiB" in str(err.value)
    with pytest.raises(ab.OutOfSpace, match="host tier"):  # the index alone does not fit
        ab.ExperienceStore(SCHEMA, 100_000, tiers={"host": "64KiB", "disk": tmp_path / "a"})
    with pytest.raises(ab.OutOfSpace, match="disk"):  # the bottom tier holds a whole ring of every column
        ab.ExperienceStore(SCHEMA, 100_000, tiers={"host": "8MiB", "disk": (tmp_path / "b", "1MiB")})
    assert not any(p.is_dir() and any(p.iterdir()) for p in tmp_path.iterdir())  # failed stores left no files
    meta, data = make_tiers({"disk": tmp_path / "c", "host": "1GiB"})
    assert [t.name for t in data] == ["host", "disk"] and meta is data[0] and meta.budget == 1 << 30
    for t in data:
        t.close()


@pytest.mark.parametrize("spec", ["host", "disk"])
def test_a_single_tier_store_keeps_the_direct_path(spec, tmp_path):
    tiers = {"host": "64MiB"} if spec == "host" else {"disk": tmp_path}
    with ab.ExperienceStore(SCHEMA, 1000, seed=0, tiers=tiers) as store:
        assert store._cols.direct and store.placement_policy is None
        store.extend(rows(0, 1500))
        check_batch(store.sample(100))
        p = store.placement()
        assert set(p["tier"].to_pylist()) == {spec}
        assert store.stats()["bytes"]["host"] <= 64 << 20


def test_disk_files_go_when_the_store_closes(tmp_path):
    store = ab.ExperienceStore(SCHEMA, 1000, tiers={"host": "4MiB", "disk": tmp_path})
    store.extend(rows(0, 100))
    (sub,) = list(tmp_path.iterdir())
    assert sorted(p.name for p in sub.iterdir()) == sorted(f"{n}.arrow" for n in SCHEMA["fields"])
    store.close()
    assert list(tmp_path.iterdir()) == []
    store.close()


TOKENS = {"name": "tok", "fields": {"obs": {"dtype": "float32", "shape": [16]},
                                    "tokens": {"dtype": "int32", "ragged": True, "mean_length": 64},
                                    "logprobs": {"dtype": "float32", "ragged": True, "mean_length": 64},
                                    "reward": {"dtype": "float32"}, "terminated": {"dtype": "bool"}}}


def _token_rows(k0: int, n: int) -> dict:
    """Rows k0..k0+n-1: row k has k % 97 + 1 tokens [k, k+1, ...]; obs and reward say k too."""
    k = np.arange(k0, k0 + n)
    toks = [np.arange(i, i + i % 97 + 1, dtype=np.int32) for i in k]
    return {"obs": np.repeat(k[:, None], 16, 1).astype(np.float32), "reward": k.astype(np.float32),
            "tokens": pa.array(toks, type=pa.list_(pa.int32())),
            "logprobs": pa.array([-t.astype(np.float32) for t in toks], type=pa.list_(pa.float32())),
            "terminated": np.ones(n, bool)}


def _check_token_rows(tokens: list, logprobs: list, obs: np.ndarray, reward: np.ndarray) -> None:
    for t, lp, o, r in zip(tokens, logprobs, obs, reward):
        k = int(r)
        np.testing.assert_array_equal(o, np.full(16, k, np.float32))
        np.testing.assert_array_equal(np.asarray(t), np.arange(k, k + k % 97 + 1))
        np.testing.assert_array_equal(np.asarray(lp), -np.arange(k, k + k % 97 + 1, dtype=np.float32))


def test_ragged_fields_spill_to_disk_and_round_trip(tmp_path):
    """Token data in a tiered store lives in the disk tier (a spill); what was extended reads back equal through
    to_table and sample while the ring turns, with fixed-size columns split between host and disk."""
    with ab.ExperienceStore(TOKENS, 1000, tiers={"host": "1MiB", "disk": tmp_path / "spill"}) as store:
        on_disk = [f for f in os.listdir(store._data_tiers[-1].path) if "tokens" in f]
        assert on_disk, "the ragged field's arenas are not in the disk tier"
        for k in range(0, 3500, 250):  # the ring turns three times
            ids = store.extend(_token_rows(k, 250))
            np.testing.assert_array_equal(ids, np.arange(k, k + 250))
            if k % 1000 != 250:
                continue
            t = store.to_table(["tokens", "logprobs", "obs", "reward", "seq"])
            _check_token_rows(t.column("tokens").to_pylist(), t.column("logprobs").to_pylist(),
                              t.column("obs").combine_chunks().to_numpy_ndarray(), t.column("reward").to_numpy())
            np.testing.assert_array_equal(t.column("reward").to_numpy(), t.column("seq").to_numpy())
        t = store.to_table(["seq"])
        assert len(store) == 1000 and t.column("seq").to_numpy()[0] == 2500
        b = store.sample(512)
        _check_token_rows(b["tokens"].to_pylist(), b["logprobs"].to_pylist(), b["obs"], b["reward"])
        np.testing.assert_array_equal(b["reward"], b.indices)
