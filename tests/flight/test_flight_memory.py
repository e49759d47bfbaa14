"""What a batch received over Flight costs in memory: its arrays are the received message itself, writable because
the batch owns that memory alone, so `to_torch` takes them without a copy; writing them never reaches the store.

Real server on 127.0.0.1:0 (in this process: the batch still travels through a loopback socket), closed at teardown
even when a test fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def obs_of(ids: np.ndarray) -> np.ndarray:
    """The observation row `rows` writes for row id k: [k, 2k, 3k, 4k]."""
    k = np.asarray(ids, dtype=np.float32)
    return np.stack([k, k * 2, k * 3, k * 4], axis=1)


def rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.float32)
    obs = obs_of(ids)
    ends = np.zeros(n, bool)
    ends[-1] = True  # every row can be sampled
    return {"obs": obs, "action": np.arange(start, start + n, dtype=np.int64), "reward": ids + 0.5,
            "terminated": ends, "truncated": np.zeros(n, bool), "policy_version": np.zeros(n, np.int64),
            "next_obs": obs + 0.25}


@pytest.fixture()
def remote():
    store = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=8192, sampler="uniform", seed=0)
    server = ab.serve(store, shutdown_timeout=1.0)
    client = None
    try:
        client = ab.connect(server.location, timeout=30.0)
        client.extend(rows(32))
        yield client
    finally:
        if client is not None:
            client.close()
        server.close()
        store.close()


def test_received_arrays_are_correct_and_writable(remote):
    batch = remote.sample(32)
    np.testing.assert_array_equal(batch["obs"], obs_of(batch.indices))
    np.testing.assert_array_equal(batch["action"], batch.indices)
    np.testing.assert_array_equal(batch["reward"], batch.indices.astype(np.float32) + 0.5)
    for name in ("obs", "action", "reward"):
        assert batch[name].flags.writeable and batch[name].flags.aligned, name


@pytest.mark.parametrize("n", [32, 4096])  # one small message, and one that gRPC receives in many pieces
def test_to_torch_of_a_received_batch_does_not_copy(remote, n):
    torch = pytest.importorskip("torch")
    if n > 32:
        remote.extend(rows(n, start=32))
    batch = remote.sample(n, columns=["obs", "reward", "action"])
    arrow = batch.data  # zero-copy over the received arrays
    obs_buffer = arrow.column("obs").storage.values.buffers()[1]
    reward_buffer = arrow.column("reward").buffers()[1]
    t = batch.to_torch()
    assert t["obs"].data_ptr() == batch["obs"].ctypes.data == obs_buffer.address
    assert t["reward"].data_ptr() == batch["reward"].ctypes.data == reward_buffer.address
    assert t["action"].data_ptr() == batch["action"].ctypes.data
    assert t["obs"].shape == (n, 4) and t["obs"].dtype == torch.float32
    torch.testing.assert_close(t["obs"], torch.from_numpy(obs_of(batch.indices)))


def test_writing_a_received_batch_never_changes_the_store(remote):
    pytest.importorskip("torch")
    batch = remote.sample(32, columns=["obs", "reward"])
    t = batch.to_torch()
    t["obs"].mul_(-1.0)  # a trainer normalising in place
    batch["reward"][:] = 7.0
    np.testing.assert_array_equal(batch["obs"], -obs_of(batch.indices))  # one memory: the batch sees the write
    stored = remote.to_table()  # the store, and a fresh batch, do not
    np.testing.assert_array_equal(stored.column("obs").combine_chunks().to_numpy_ndarray(), obs_of(np.arange(32)))
    np.testing.assert_array_equal(stored.column("reward").to_numpy(), rows(32)["reward"])
    again = remote.sample(32, columns=["obs", "reward"])
    np.testing.assert_array_equal(again["obs"], obs_of(again.indices))
    assert not np.shares_memory(again["obs"], batch["obs"])


def test_received_arrays_outlive_the_batch_and_its_record_batch(remote):
    batch = remote.sample(32, columns=["obs"])
    obs, indices = batch["obs"], batch.indices
    del batch  # the array keeps the received message alive
    _ = [np.ones(1 << 16) for _ in range(8)]  # reuse of freed memory would show as changed values
    np.testing.assert_array_equal(obs, obs_of(indices))
    assert isinstance(pa.array(obs.ravel()), pa.Array)


@pytest.mark.parametrize("n, part_bytes", [(64, None), (3000, 1 << 20)])  # one message; a sample in parts
def test_packed_ragged_columns_of_a_received_batch_reach_torch_without_a_copy(n, part_bytes):
    pytest.importorskip("torch")
    from arrowbuf.flight import protocol as P

    store = ab.ExperienceStore(SCHEMAS / "grpo.yaml", capacity=4096, seed=0)
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 300, n)
    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
    toks = rng.integers(0, 1000, int(lens.sum()), dtype=np.int32)
    store.extend({"prompt_id": np.arange(n), "policy_version": np.zeros(n, np.int64), "done": np.ones(n, bool),
                  "prompt_tokens": pa.ListArray.from_arrays(offs, pa.array(toks)),
                  "response_tokens": pa.ListArray.from_arrays(offs, pa.array(toks + 1)),
                  "logprobs": pa.ListArray.from_arrays(offs, pa.array(-toks.astype(np.float32)))})
    try:
        with ab.serve(store) as server, ab.connect(server.location) as remote:
            if part_bytes is not None:
                remote.part_bytes = max(part_bytes, P.MIN_PART_BYTES)
            batch = remote.sample(n, columns=["response_tokens", "logprobs"])
            values = {k: batch[k].values.buffers()[1] for k in ("response_tokens", "logprobs")}
            t = batch.to_torch(pack=True)
            for k, buf in values.items():  # the received values themselves: no copy
                assert buf.address <= t[k].data_ptr() < buf.address + buf.size, k
            o = offs.to_numpy()

            def want(ids: np.ndarray) -> list[int]:
                return np.concatenate([toks[o[i]:o[i + 1]] + 1 for i in ids]).tolist()

            assert t["response_tokens"].tolist() == want(batch.indices)
            t["response_tokens"].zero_()  # the batch's own memory: writing it never reaches the store
            again = remote.sample(n, columns=["response_tokens"])
            assert again.to_torch(pack=True)["response_tokens"].tolist() == want(again.indices)
    finally:
        store.close()
