"""Each extra alone does what the README's extras table says it covers (issue 44): the session's wheel of this tree
(conftest.arrowbuf_wheel) is installed with one extra (none, query, demo, torch, metrics, compat, ray, datasets,
fast) into a fresh venv outside the repository (by uv where the dev extra brought it: `install_into_fresh_venv`;
tests/test_docs_blocks.py installs with pip, as the README says), then what the table promises runs from a folder
outside it too.
What the extra does not cover fails at once with `ab.MissingDependency` naming the extra that does.

The installer may reach PyPI; torch is always `torch==2.13.0` on the same command line (pip, or uv given pip's
find-links, takes the CPU wheel this machine keeps). Bounded: every install and every check has a timeout, and the
wheel is built once per session.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import ROOT, install_into_fresh_venv

sys.path.insert(0, str(ROOT / "scripts"))
import docs_blocks  # noqa: E402

pytestmark = pytest.mark.slow

INSTALL_TIMEOUT_S = 900
CHECK_TIMEOUT_S = 600
TORCH = "torch==2.13.0"


def _readme_block(heading: str) -> str:
    """The first python block of README.md after `heading` (the code the README shows, run as it is)."""
    path = ROOT / "README.md"
    lines = path.read_text().splitlines()
    at = lines.index(heading) + 1
    return next(b.code for b in docs_blocks.extract(str(path)) if b.line > at and b.lang == "python")


def _first_block(path: Any) -> str:
    return next(b.code for b in docs_blocks.extract(str(path)) if b.lang == "python")


BASE = '''
import arrowbuf as ab, numpy as np
# Flight, a checkpoint and its restore, an export and the command line: no extra
store = ab.ExperienceStore("cartpole", capacity=100, seed=0)
store.extend({"obs": np.zeros((8, 4), np.float32), "action": np.zeros(8, np.int64), "reward": np.ones(8, np.float32),
              "terminated": np.arange(8) == 7, "truncated": np.zeros(8, bool), "policy_version": np.zeros(8, np.int64),
              "next_obs": np.ones((8, 4), np.float32)})
with ab.serve(store, "grpc://127.0.0.1:0") as server:
    client = ab.connect(server.location)
    assert len(client) == 8 and client.sample(4).to_numpy()["obs"].shape == (4, 4)
    client.close()
store.checkpoint("ckpt")
with ab.ExperienceStore.restore("ckpt") as again:
    assert len(again) == 8
store.export("data")
from arrowbuf.cli import main
assert main(["inspect", "ckpt"]) == 0
# what needs an extra says which one
for call, extra in ((lambda: store.sql("SELECT 1"), "query"), (lambda: store.sample(2).to_torch(), "torch")):
    try:
        call()
    except ab.MissingDependency as exc:
        assert f"arrowbuf[{extra}]" in str(exc), exc
    else:
        raise AssertionError(f"no MissingDependency naming [{extra}]")
print("base ok")
'''

QUERY = '''
import arrowbuf as ab, numpy as np
store = ab.ExperienceStore("cartpole", capacity=100, seed=0)
store.extend({"obs": np.zeros((8, 4), np.float32), "action": np.zeros(8, np.int64), "reward": np.ones(8, np.float32),
              "terminated": np.arange(8) % 4 == 3, "truncated": np.zeros(8, bool),
              "policy_version": np.zeros(8, np.int64), "next_obs": np.ones((8, 4), np.float32)})
assert store.sql("SELECT episode_id, sum(reward) AS r FROM experience GROUP BY 1").num_rows == 2
assert len(store.to_pandas()) == 8 and store.to_polars().height == 8
assert store.episodes().num_rows == 2
print("query ok")
'''

TORCH_CHECK = '''
import arrowbuf as ab, numpy as np, torch
store = ab.ExperienceStore("cartpole", capacity=100, seed=0)
store.extend({"obs": np.zeros((8, 4), np.float32), "action": np.zeros(8, np.int64), "reward": np.ones(8, np.float32),
              "terminated": np.arange(8) == 7, "truncated": np.zeros(8, bool), "policy_version": np.zeros(8, np.int64),
              "next_obs": np.ones((8, 4), np.float32)})
t = store.sample(4).to_torch()
assert isinstance(t["obs"], torch.Tensor) and tuple(t["obs"].shape) == (4, 4)
print("torch ok", torch.__version__)
'''

METRICS = '''
import urllib.request
import arrowbuf as ab
store = ab.ExperienceStore("grpo", capacity=100, tasks=["train"])
store.extend({"prompt_id": [1, 1], "prompt_tokens": [[1, 2], [1, 2]], "response_tokens": [[3], [4, 5]],
              "logprobs": [[-0.1], [-0.2, -0.3]], "policy_version": [0, 0], "done": [True, True]})
with ab.serve(store, "grpc://127.0.0.1:0", metrics="127.0.0.1:0") as server:
    text = urllib.request.urlopen(server.metrics_url).read().decode()
assert "arrowbuf_rows_inserted_total" in text and "arrowbuf_rows_bytes" in text, text[:2000]
print("metrics ok")
'''

COMPAT = '''
import torch
from torchrl.data import ReplayBuffer
from arrowbuf.compat.torchrl import ArrowbufStorage
import arrowbuf.compat.transfer_queue as tq
rb = ReplayBuffer(storage=ArrowbufStorage(100), batch_size=4)
from tensordict import TensorDict
rb.extend(TensorDict({"obs": torch.arange(32.0).reshape(8, 4), "reward": torch.ones(8)}, batch_size=[8]))
assert tuple(rb.sample()["obs"].shape) == (4, 4)
print("compat ok")
'''

RAY = '''
import numpy as np, ray, arrowbuf as ab
from arrowbuf.ray import ShardedStore
# a cluster of its own: a plain ray.init() joins any cluster `ray start` left on this machine (other test sessions')
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
sharded = ShardedStore.create(ab.load_schema("cartpole"), num_shards=2, capacity_per_shard=1000)
try:
    sharded.writer().extend({"obs": np.zeros((64, 4), np.float32), "action": np.zeros(64, np.int64),
                             "reward": np.ones(64, np.float32), "terminated": np.arange(64) % 16 == 15,
                             "truncated": np.zeros(64, bool), "policy_version": np.zeros(64, np.int64),
                             "next_obs": np.ones((64, 4), np.float32)})
    assert len(sharded) == 64 and len(sharded.sample(16).indices) == 16
finally:
    sharded.shutdown()
ray.shutdown()
print("ray ok")
'''

DATASETS = '''
import os, numpy as np, gymnasium as gym, minari, arrowbuf as ab
from minari.data_collector import EpisodeBuffer
os.environ["MINARI_DATASETS_PATH"] = os.path.abspath("minari")
env = gym.make("CartPole-v1")
buffers, steps = [], 0
for ep in range(2):
    obs, _ = env.reset(seed=ep)
    o, A, R, T, TR = [obs], [], [], [], []
    done = False
    while not done:
        obs, r, term, trunc, _ = env.step(ep % 2)
        o.append(obs), A.append(ep % 2), R.append(r), T.append(term), TR.append(trunc)
        done = term or trunc
    steps += len(A)
    buffers.append(EpisodeBuffer(id=ep, seed=ep, observations=np.array(o), actions=np.array(A), rewards=np.array(R),
                                 terminations=np.array(T), truncations=np.array(TR), infos={}))
minari.create_dataset_from_buffers("cartpole/extras-v0", buffers, env=env, data_format="arrow",
                                   algorithm_name="fixed", author="arrowbuf", author_email="-", code_permalink="-",
                                   description="extras test")
with ab.ExperienceStore.from_dataset("minari/cartpole/extras-v0") as store:
    assert len(store) == steps and store.episodes().num_rows == 2
print("datasets ok")
'''

FAST = '''
import numpy as np, arrowbuf as ab
from arrowbuf.persist.crc import IMPLEMENTATION
assert IMPLEMENTATION == "isal", IMPLEMENTATION
store = ab.ExperienceStore("cartpole", capacity=100)
store.extend({"obs": np.zeros((8, 4), np.float32), "action": np.zeros(8, np.int64), "reward": np.ones(8, np.float32),
              "terminated": np.arange(8) == 7, "truncated": np.zeros(8, bool), "policy_version": np.zeros(8, np.int64),
              "next_obs": np.ones((8, 4), np.float32)})
store.checkpoint("ckpt")
with ab.ExperienceStore.restore("ckpt") as again:
    assert len(again) == 8
print("fast ok")
'''

#: The small flags of each example (tests/test_docs_blocks.py's), which run the examples' own checks in seconds.
EXAMPLES = {"local_replay.py": ["--steps", "500"], "flight_actor_learner.py": ["--steps", "200", "--batches", "5"],
            "shared_memory_actors.py": ["--steps", "200", "--batches", "5"], "inspect_buffer.py": ["--steps", "800"],
            "llm_tokens.py": []}


def _demo_checks() -> list[tuple[str, list[str]]]:
    checks = [("the RL quickstart", ["python", "-c", _readme_block("## Quickstart (replay for RL)")])]
    checks += [(f"examples/{name}", ["python", str(ROOT / "examples" / name), *flags, "--out", "out"])
               for name, flags in EXAMPLES.items()]
    checks += [("arrowbuf demo (DQN)", ["arrowbuf", "demo", "--steps", "600", "--actors", "2", "--warmup", "200",
                                        "--no-progress", "--out", "dqn"]),
               ("arrowbuf demo grpo", ["arrowbuf", "demo", "grpo", "--steps", "2", "--workers", "1", "--no-progress",
                                       "--out", "grpo"])]
    return checks


#: extra -> (what else goes on pip's command line, the checks: (what, argv[, the extra it must say is missing]);
#: "python" and "arrowbuf" are the venv's).
#: The README's extras table lists exactly these extras (test below).
EXTRAS: dict[str, tuple[list[str], Any]] = {
    "": ([], lambda: [("the LLM quickstart", ["python", "-c", _readme_block("## Quickstart (LLM post-training)")]),
                      ("Flight, checkpoints, export, the CLI", ["python", "-c", BASE]),
                      ("an example without [demo] stops at once, naming it",
                       ["python", str(ROOT / "examples" / "llm_tokens.py"), "--out", "out"], "demo")]),
    "query": ([], lambda: [("sql, pandas, polars, episodes", ["python", "-c", QUERY])]),
    "demo": ([TORCH], _demo_checks),
    "torch": ([TORCH], lambda: [("batch.to_torch()", ["python", "-c", TORCH_CHECK])]),
    "metrics": ([], lambda: [("/metrics", ["python", "-c", METRICS])]),
    "compat": ([TORCH], lambda: [("TorchRL storage, TransferQueue API", ["python", "-c", COMPAT]),
                                 ("docs/integrations.md's TransferQueue block",
                                  ["python", "-c", _first_block(ROOT / "docs" / "integrations.md")])]),
    "ray": ([], lambda: [("ShardedStore", ["python", "-c", RAY])]),
    "datasets": ([], lambda: [("a Minari dataset", ["python", "-c", DATASETS])]),
    "fast": ([], lambda: [("ISA-L CRC-32", ["python", "-c", FAST])]),
}


def test_the_readme_table_lists_exactly_these_extras():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| extra | what it covers |"):]
    table = table[:table.index("\n\n")]
    listed = {"" if m == "(none)" else m.strip("`") for m in re.findall(r"^\| ([^|]+?) \|", table, re.M)[1:]}
    assert listed == set(EXTRAS), listed


@pytest.mark.parametrize("extra", [pytest.param(e, marks=[pytest.mark.own_ray_cluster] if e == "ray" else [])
                                   for e in EXTRAS], ids=lambda e: e or "none")
def test_each_extra_alone_runs_what_the_readme_says_it_covers(extra, arrowbuf_wheel, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "RAY_ADDRESS", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    t0 = time.monotonic()
    more, checks = EXTRAS[extra]
    target = f"{arrowbuf_wheel}[{extra}]" if extra else str(arrowbuf_wheel)
    r = install_into_fresh_venv(venv, [target, *more], env, INSTALL_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    installed = time.monotonic() - t0
    run = tmp_path / "run"  # outside the repository: nothing there can help
    run.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["ARROWBUF_SHM_DIR"] = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    where = subprocess.run(["python", "-c", "import arrowbuf; print(arrowbuf.__file__)"], cwd=run, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    for what, argv, *missing in checks():
        r = subprocess.run(argv, cwd=run, env=env, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        if missing:  # what the extra does not cover stops at once, with one clear error naming the extra that does
            assert r.returncode != 0 and f"arrowbuf[{missing[0]}]" in r.stderr, (what, r.stderr[-3000:])
            assert "MissingDependency" in r.stderr and r.stdout == "", (what, r.stdout[-2000:])
            continue
        # the script's own stderr first: Ray forwards its workers' logs ("(ShardActor pid=...)") into the same
        # stream, and a worker's crash dump can push the script's traceback out of the tail
        own = "\n".join(line for line in r.stderr.splitlines() if not re.search(r"\(\w+ pid=\d+", line))
        assert r.returncode == 0, (f"[{extra}] {what}: exit {r.returncode}\n{r.stdout[-2000:]}\n"
                                   f"the script's stderr:\n{own[-3000:]}\nall of stderr:\n{r.stderr[-3000:]}")
    print(f"[{extra or 'none'}] install {installed:.0f} s, checks {time.monotonic() - t0 - installed:.0f} s")

