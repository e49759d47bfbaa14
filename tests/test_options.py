"""One options object (`ab.StoreOptions`) and one configuration registry (`ab.config`), issue 39: the constructor's
keywords build the options, and every place that rebuilds a store (a shared-memory attach, a restore) takes them
whole; every ARROWBUF_* variable is registered and read when a store opens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.persist import manifest as mf

SCHEMA = {"name": "opt", "version": 1, "fields": {"obs": {"dtype": "float32", "shape": [2]}, "done": {"dtype": "bool"},
                                                   "policy_version": {"dtype": "int64"}},
          "derived": {"next_obs": {"next_of": "obs"}}, "episode_end": ["done"]}


def steps(n, start=0):
    obs = np.arange(start * 2, (start + n) * 2, dtype=np.float32).reshape(n, 2)
    return {"obs": obs, "next_obs": obs + 1, "done": np.arange(start, start + n) % 5 == 4,
            "policy_version": np.zeros(n, np.int64)}


def test_keywords_and_options_build_the_same_store():
    opts = ab.StoreOptions(capacity=64, sampler=ab.samplers.Prioritized(alpha=0.7), seed=3, final_obs_capacity=40,
                           max_times_sampled=5, tasks=["train"], max_staleness=2)
    with ab.ExperienceStore(SCHEMA, options=opts) as a, \
            ab.ExperienceStore(SCHEMA, 64, ab.samplers.Prioritized(alpha=0.7), seed=3, final_obs_capacity=40,
                               max_times_sampled=5, tasks=["train"], max_staleness=2) as b:
        assert a.options.to_dict() == b.options.to_dict()
        assert a.options.final_obs_capacity == 40 and a.options.chunk_rows == a.chunk_rows  # resolved, as built
        assert a.tasks == ["train"] and a.stats()["final_obs_capacity"] == 40
        a.extend(steps(10))
        b.extend(steps(10))
        assert a.sample(8).indices.tolist() == b.sample(8).indices.tolist()


def test_options_and_keywords_together_are_refused():
    with pytest.raises(ab.InvalidArgument, match="not both"):
        ab.ExperienceStore(SCHEMA, options=ab.StoreOptions(capacity=8), seed=1)
    with pytest.raises(ab.InvalidArgument, match="capacity"):
        ab.ExperienceStore(SCHEMA)
    with pytest.raises(ab.InvalidArgument, match="capacity"):
        ab.StoreOptions(capacity=0)


def test_options_round_trip_through_a_dict():
    opts = ab.StoreOptions(capacity=100, sampler=ab.samplers.Prioritized(alpha=0.5, beta=0.2), chunk_rows=16,
                           final_obs_capacity=30, max_times_sampled=3, name="x", tasks=["a", "b"],
                           max_staleness=4, token_field=None, observe=False)
    d = json.loads(json.dumps(opts.to_dict()))
    again = ab.StoreOptions.from_dict(d, "here")
    assert again.to_dict() == opts.to_dict()
    assert again.sampler.alpha == 0.5 and again.observe is False


@pytest.mark.parametrize("bad", [{"capacity": -1}, {"capacity": 2 ** 50}, {"capacity": 8, "chunk_rows": "x"},
                                 {"capacity": 8, "tasks": ["a", "a"]}, {"capacity": 8, "sampler": "uniform"},
                                 {"capacity": 8, "observe": 1}, [1, 2]])
def test_a_recorded_option_out_of_bounds_is_store_corrupt(bad):
    with pytest.raises(ab.StoreCorrupt, match="manifest"):
        ab.StoreOptions.from_dict(bad, "manifest")


def test_a_checkpoint_records_the_options_and_restore_rebuilds_from_them(tmp_path):
    opts = ab.StoreOptions(capacity=64, sampler=ab.samplers.Prioritized(alpha=0.7), final_obs_capacity=40,
                           max_times_sampled=5, tasks=["train"], name="mine")
    with ab.ExperienceStore(SCHEMA, options=opts) as s:
        s.extend(steps(20))
        s.checkpoint(str(tmp_path / "ck"))
    m = mf.read_manifest(str(tmp_path / "ck"))
    assert m["store"]["final_obs_capacity"] == 40 and m["store"]["max_times_sampled"] == 5
    with ab.ExperienceStore.restore(str(tmp_path / "ck")) as again:
        o = again.options
        assert (o.final_obs_capacity, o.max_times_sampled, o.name, o.tasks) == (40, 5, "mine", ["train"])
        assert isinstance(o.sampler, ab.samplers.Prioritized) and o.sampler.alpha == 0.7


def test_a_shared_store_publishes_its_options_and_attach_takes_them(tmp_path):
    name = f"opt-{os.getpid()}"
    opts = ab.StoreOptions(capacity=64, final_obs_capacity=33, max_times_sampled=2, tier="shm", name=name)
    with ab.ExperienceStore(SCHEMA, options=opts) as s:
        other = ab.ExperienceStore.attach(name)
        try:
            assert other.options.final_obs_capacity == 33 and other.options.max_times_sampled == 2
            assert other.options.to_dict() == s.options.to_dict()
        finally:
            other.close()


def test_config_registers_every_variable_and_reads_it_when_asked(monkeypatch):
    assert set(ab.config.REGISTRY) >= {"ARROWBUF_SHM_DIR", "ARROWBUF_SHM_LOCKS", "ARROWBUF_JOURNAL_DIRECT"}
    monkeypatch.setenv("ARROWBUF_JOURNAL_DIRECT", "0")
    assert ab.config.get("ARROWBUF_JOURNAL_DIRECT") is False
    with ab.config.override(ARROWBUF_JOURNAL_DIRECT=True):
        assert ab.config.get("ARROWBUF_JOURNAL_DIRECT") is True
    assert ab.config.get("ARROWBUF_JOURNAL_DIRECT") is False
    with pytest.raises(KeyError):
        ab.config.get("ARROWBUF_NOPE")
    assert all(doc for _, doc in ab.config.describe().values())


def test_the_journal_setting_is_read_when_the_store_opens_not_at_import(tmp_path):
    """ARROWBUF_JOURNAL_DIRECT set after `import arrowbuf` still applies to the next store; the store's own option
    wins over it."""
    code = """
import os, sys
import arrowbuf as ab
os.environ["ARROWBUF_JOURNAL_DIRECT"] = "0"
s = ab.ExperienceStore({"name": "t", "fields": {"x": "int64"}}, 10, durable=sys.argv[1] + "/a")
t = ab.ExperienceStore({"name": "t", "fields": {"x": "int64"}}, options=ab.StoreOptions(
    capacity=10, durable=sys.argv[1] + "/b", journal_direct=True))
print(s._durable.journal.direct, t._durable.journal.direct)
s.close(); t.close()
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_the_library_reads_the_environment_only_in_its_configuration_module():
    import pathlib

    root = pathlib.Path(ab.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if ("os.environ" in p.read_text() or "os.getenv" in p.read_text())
                 and p.name != "config.py" and "demo" not in p.parts]
    assert offenders == []


@pytest.mark.slow
def test_ray_shards_are_built_from_the_options(ray_cluster):
    """A sharded store's shards take the whole options (final-observation slots, max_times_sampled: options the
    shards could not be given before)."""
    from arrowbuf.ray import ShardedStore

    opts = ab.StoreOptions(capacity=64, final_obs_capacity=33, max_times_sampled=4)
    s = ShardedStore.create(SCHEMA, 2, 64, options=opts, strategy=None, tier="host")
    try:
        shards = s.stats()["shards"]
        assert len(shards) == 2 and all(st["final_obs_capacity"] == 33 for st in shards)
    finally:
        s.close()
