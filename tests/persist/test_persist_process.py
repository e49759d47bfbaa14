"""Checkpoints under crashes, concurrent writer processes, and per tier (host, shared memory, disk-spilled).

Real processes (subprocess / spawn), real /dev/shm segments, real files; cleaned up even on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from conftest import ROWS_SCHEMA, process_context, rows

import arrowbuf as ab
from arrowbuf.persist import checkpoint as persist_checkpoint
from arrowbuf.persist import manifest as mf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CTX = process_context()
SCHEMA = {**ROWS_SCHEMA, "name": "persistproc"}


def check_whole(table: pa.Table | pa.RecordBatch) -> None:
    """No torn row: each row's columns agree with each other."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    obs = table["obs"].combine_chunks().to_numpy_ndarray()
    act = table["action"].to_numpy()
    assert (obs[:, 3] == 7).all() and (obs[:, 2] == obs[:, 1] + 1).all()
    np.testing.assert_array_equal(obs[:, 1], act)
    np.testing.assert_array_equal(table["reward"].to_numpy(), (obs[:, 0] * 1e6 + obs[:, 1]).astype(np.float32))


# ------------------------------------------------------------------------------------------------ SIGKILL
_CRASH = textwrap.dedent("""
    import os, sys
    import numpy as np
    import arrowbuf as ab
    sys.path.insert(0, {tests!r})
    from conftest import rows
    root, point = sys.argv[1], sys.argv[2]
    store = ab.ExperienceStore({schema!r}, capacity=2000, chunk_rows=64, seed=0,
                               sampler=ab.samplers.Prioritized())
    store.extend(rows(1, 0, 1500))
    b = store.sample(100)
    store.update_priorities(b.indices, np.arange(100) + 1.0)
    store.checkpoint(root, keep=2)
    store.extend(rows(1, 1500, 1300))  # wraps the ring: new chunks, evicted chunks, a new tail
    from arrowbuf.persist import faults
    faults.install(faults.kill_at(point))
    store.checkpoint(root, keep=2)
    print("survived")
""")


def _expected_first() -> ab.ExperienceStore:
    store = ab.ExperienceStore(SCHEMA, capacity=2000, chunk_rows=64, seed=0, sampler=ab.samplers.Prioritized())
    store.extend(rows(1, 0, 1500))
    b = store.sample(100)
    store.update_priorities(b.indices, np.arange(100) + 1.0)
    return store


@pytest.mark.parametrize("point", ["after_chunk", "before_manifest", "before_commit", "manifest_tmp",
                                   "after_commit"])
def test_sigkill_during_checkpoint_leaves_a_restorable_checkpoint(tmp_path, point):
    root = str(tmp_path / "c")
    script = _CRASH.format(tests=os.path.join(ROOT, "tests"), schema=SCHEMA)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script, root, point], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert mf.verify(root) == []
    with ab.ExperienceStore.restore(root) as again, _expected_first() as first:
        if point == "after_commit":  # killed after the commit: the new checkpoint is the one restored
            assert again.stats()["next_seq"] == 2800 and len(again) == 2000
            check_whole(again.to_table())
        else:  # the previous checkpoint, exactly
            assert again.to_table().equals(first.to_table())
            x, y = again.sample(64), first.sample(64)
            np.testing.assert_array_equal(x.indices, y.indices)
            np.testing.assert_array_equal(x.weights, y.weights)
        again.checkpoint(root, keep=2)  # the next checkpoint cleans up what the killed one left
    leftovers = [n for n in os.listdir(root) if ".tmp-" in n]
    assert not leftovers and mf.verify(root) == []


# ------------------------------------------------------------------------------------------------ overrun
@pytest.mark.parametrize("ends", ["everywhere", "only_in_dropped_rows"])
def test_rows_overwritten_while_copied_are_left_out_never_torn(tmp_path, ends):
    cr = 64
    with ab.ExperienceStore(SCHEMA, capacity=16 * cr, chunk_rows=cr, seed=0,
                            sampler=ab.samplers.Prioritized()) as store:
        batch = rows(1, 0, 16 * cr + 10)            # full ring: a partial oldest chunk ... a 10-row tail
        if ends != "everywhere":                    # the kept rows then point to no final observation
            batch["terminated"][250:] = False   # the last episode end, seq 249, is in chunk 3
        store.extend(batch)
        before = store.to_table().combine_chunks()
        hi = store.stats()["next_seq"]
        k = [16 * cr + 10]

        def overwrite(i: int) -> None:               # a real writer overtakes the copy at chunk 3
            if i == 3:
                store.extend(rows(1, k[0], 4 * cr))
                k[0] += 4 * cr

        info = persist_checkpoint(store._core, tmp_path / "c", _after_read=overwrite)
        assert info["next_seq"] == hi and info["dropped_rows"] > 0
        got = pads.dataset(str(tmp_path / "c"), format="ipc").to_table().sort_by("seq")
        seqs = got["seq"].to_numpy()
        assert (np.diff(seqs) == 1).all() and seqs[-1] == hi - 1 and seqs[0] == info["first_seq"]
        check_whole(got)
        want = before.filter(pa.compute.greater_equal(before["seq"], info["first_seq"]))
        assert got.select(want.column_names).to_pydict() == want.to_pydict()
    with ab.ExperienceStore.restore(tmp_path / "c") as again:
        assert len(again) == info["rows"] and again.stats()["first_seq"] == info["first_seq"]
        check_whole(again.sample(200).data)


@pytest.mark.parametrize("writer", ["slower", "faster"])
def test_a_copy_racing_the_writer_keeps_what_it_can(tmp_path, writer):
    """The ring's writer overwrites the oldest rows while the checkpoint copies: a copy faster than the writer loses
    at most the chunks where the writer started; one the writer overtakes still keeps the newest rows it reached
    (copying from the newest chunk down) instead of chasing the writer and keeping almost none."""
    cr = 64
    with ab.ExperienceStore(SCHEMA, capacity=16 * cr, chunk_rows=cr, seed=0) as store:
        store.extend(rows(1, 0, 16 * cr + 10))
        hi = store.stats()["next_seq"]
        k = [16 * cr + 10]
        step = cr // 4 if writer == "slower" else 2 * cr   # rows the writer commits per chunk the copy reads

        def overwrite(i: int) -> None:
            store.extend(rows(1, k[0], step))
            k[0] += step

        info = persist_checkpoint(store._core, tmp_path / "c", _after_read=overwrite)
        got = pads.dataset(str(tmp_path / "c"), format="ipc").to_table().sort_by("seq")
        seqs = got["seq"].to_numpy()
        assert info["next_seq"] == hi and seqs[-1] == hi - 1 and (np.diff(seqs) == 1).all()
        check_whole(got)
        if writer == "slower":
            assert info["dropped_rows"] <= 2 * cr, info
        else:
            assert info["rows"] >= 3 * cr, info


# ------------------------------------------------------------------------------------------------ tiers
def _tier_store(kind: str, tmp_path, names) -> ab.ExperienceStore:
    kw = dict(capacity=3000, chunk_rows=64, seed=5, sampler=ab.samplers.Prioritized())
    if kind == "shm":
        return ab.ExperienceStore(SCHEMA, tier="shm", name=names(), **kw)
    if kind == "disk":  # spilled: most chunks live in the disk tier
        return ab.ExperienceStore(SCHEMA, tiers={"host": "600KiB", "disk": str(tmp_path / "spill")},
                                  placement=None, **kw)
    return ab.ExperienceStore(SCHEMA, **kw)


@pytest.mark.parametrize("kind", ["host", "shm", "disk"])
@pytest.mark.parametrize("into", ["same", "host"])
def test_round_trip_per_tier(tmp_path, names, kind, into):
    with _tier_store(kind, tmp_path, names) as store:
        store.extend(rows(2, 0, 3500))
        b = store.sample(50)
        store.update_priorities(b.indices, np.linspace(0.5, 4, 50))
        if kind == "disk":
            assert "disk" in set(store.placement()["tier"].to_pylist())
        store.checkpoint(tmp_path / "c")
        kw: dict = {}
        if into == "same" and kind == "shm":
            kw = dict(tier="shm", name=names())
        elif into == "same" and kind == "disk":
            kw = dict(tiers={"host": "600KiB", "disk": str(tmp_path / "spill2")})
        with ab.ExperienceStore.restore(tmp_path / "c", **kw) as again:
            assert again.to_table().equals(store.to_table())
            for _ in range(3):
                x, y = store.sample(32), again.sample(32)
                np.testing.assert_array_equal(x.indices, y.indices)
                np.testing.assert_array_equal(x.weights, y.weights)
                assert x.data.equals(y.data)


# ------------------------------------------------------------------------------------------------ concurrent
def _writer(name: str, writer: int, n: int, done) -> None:
    store = ab.ExperienceStore.attach(name)
    for k in range(0, n, 37):
        store.extend(rows(writer, k, min(37, n - k)))
    store.close()
    done.set()


def _checkpoint_from_attached(name: str, root: str) -> None:
    store = ab.ExperienceStore.attach(name)
    store.checkpoint(root)
    store.close()


@pytest.mark.slow
def test_checkpoint_while_a_writer_process_and_a_sampler_run_is_consistent(tmp_path, names):
    name = names()
    alpha_one = ab.samplers.Prioritized(alpha=1.0, beta=0.4, eps=0.0)
    with ab.ExperienceStore(SCHEMA, capacity=4000, chunk_rows=64, seed=0, tier="shm", name=name,
                            sampler=alpha_one) as store:
        store.extend(rows(0, 0, 500))
        done = CTX.Event()
        p = CTX.Process(target=_writer, args=(name, 1, 30_000, done), daemon=True)
        p.start()
        names.procs.append(p)
        updated: dict[int, float] = {}
        gens = 0
        while not done.is_set() or gens < 2:
            b = store.sample(64)
            pri = (b.data["action"].to_numpy() % 97 + 2).astype(np.float64)  # a priority that encodes its row
            store.update_priorities(b.indices, pri)
            updated.update(zip(b.indices.tolist(), pri.tolist()))
            info = store.checkpoint(tmp_path / "c", keep=1)
            gens += 1
            got = pads.dataset(str(tmp_path / "c"), format="ipc").to_table().sort_by("seq")
            seqs = got["seq"].to_numpy()
            assert len(seqs) == info["rows"] and (np.diff(seqs) == 1).all() and seqs[-1] == info["next_seq"] - 1
            check_whole(got)
            if gens > 25:
                break
        p.join(60)
        assert p.exitcode == 0
        with ab.ExperienceStore.restore(tmp_path / "c") as again:
            t = again.to_table(["seq", "action"])
            pos = t["seq"].to_numpy() % again._core.arena_rows
            leaves = again.sampler.sum_tree.get(pos)
            for seq, leaf, act in zip(t["seq"].to_numpy(), leaves, t["action"].to_numpy()):
                if seq in updated:
                    assert leaf == updated[seq] and leaf == act % 97 + 2  # priorities match their rows
        # a checkpoint from another attached process
        p2 = CTX.Process(target=_checkpoint_from_attached, args=(name, str(tmp_path / "d")), daemon=True)
        p2.start()
        names.procs.append(p2)
        p2.join(60)
        assert p2.exitcode == 0
        with ab.ExperienceStore.restore(tmp_path / "d") as again:
            want = store.to_table()  # (attach rebuilds the schema with its fields in another order: compare by name)
            assert again.to_table().select(want.column_names).equals(want)
