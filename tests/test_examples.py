"""The demo, every example and the parity benchmark run end to end with short flags, and their outputs are checked.

The scripts run as subprocesses (as a user runs them), a few at a time, started together when the first of these
tests asks for its result; each test then checks what its script printed and wrote.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pathlib
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import arrowbuf as ab

# Ray clusters, demo runs and processes: the developer loop (-m 'not slow') leaves these to CI
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ is a top-level folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIMEOUT_S = 300

pytest.importorskip("gymnasium")
pytest.importorskip("torch")


def _commands(out: pathlib.Path) -> dict[str, list[str]]:
    py = sys.executable
    demo = [py, "-m", "arrowbuf.demo", "--no-progress", "--actors", "2"]
    return {
        "demo_flight": demo + ["--steps", "1000", "--warmup", "200", "--out", str(out / "demo_flight")],
        "demo_shm": demo + ["--transport", "shm", "--steps", "1000", "--warmup", "200",
                            "--out", str(out / "demo_shm")],
        "local_replay": [py, "examples/local_replay.py", "--steps", "1500", "--out", str(out / "ex")],
        "flight_actor_learner": [py, "examples/flight_actor_learner.py", "--steps", "300", "--batches", "10",
                                 "--out", str(out / "ex")],
        "shared_memory_actors": [py, "examples/shared_memory_actors.py", "--steps", "400", "--batches", "10",
                                 "--out", str(out / "ex")],
        "inspect_buffer": [py, "examples/inspect_buffer.py", "--steps", "1500", "--out", str(out / "ex")],
        "llm_tokens": [py, "examples/llm_tokens.py", "--out", str(out / "ex")],
    }


class Runs:
    """Starts the selected scripts together (at most 3 at once) and hands out their results."""

    def __init__(self, out: pathlib.Path, names: list[str]) -> None:
        self.out = out
        cmds = _commands(out)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ARROWBUF_EXAMPLES_OUT": str(out / "ex")}
        env.pop("ARROWBUF_DEMO_OUT", None)
        self._pool = cf.ThreadPoolExecutor(max_workers=3)
        self._futs = {n: self._pool.submit(subprocess.run, cmds[n], cwd=ROOT, env=env, capture_output=True,
                                           text=True, timeout=TIMEOUT_S) for n in names}

    def __getitem__(self, name: str) -> subprocess.CompletedProcess:
        r = self._futs[name].result()
        assert r.returncode == 0, f"{name} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    selected = [item.name[len("test_"):] for item in request.session.items
                if item.module is request.module and item.name.startswith("test_")]
    names = [n for n in _commands(pathlib.Path()) if n in selected]
    r = Runs(tmp_path_factory.mktemp("examples"), names)
    yield r
    r.close()


def _png(path: pathlib.Path) -> None:
    assert path.exists(), f"{path} not written"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000, f"{path}: not a plot ({len(data)} bytes)"


def _check_demo(r: subprocess.CompletedProcess, out: pathlib.Path, steps: int, transport: str) -> dict:
    text = r.stdout
    m = re.search(r"(\d+) steps, (\d+) episodes, (\d+) gradient steps in ([\d.]+)s \(transport=(\w+)\)", text)
    assert m, text
    assert int(m.group(1)) == steps
    assert int(m.group(3)) > 0, "the learner never trained"
    assert m.group(5) == transport, text
    # the SQL summary: a header and one row per quarter of the run
    assert "episode returns by quarter of the run (DuckDB over the live buffer, store.sql):" in text
    assert re.search(r"quarter\s+episodes\s+mean_return\s+best_return\s+mean_length", text)
    quarters = re.findall(r"^\s+([1-4])\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", text, re.M)
    assert [q[0] for q in quarters] == ["1", "2", "3", "4"], text
    assert sum(int(q[1]) for q in quarters) <= int(m.group(2))
    fl = re.search(r"mean return: first 20 episodes ([\d.]+) -> last 20 episodes ([\d.]+)", text)
    assert fl, text
    assert "Loader:" in text and "exposed" in text
    _png(out / "returns.png")
    episodes = json.loads((out / "episodes.json").read_text())
    assert len(episodes) == int(m.group(2)) and all(e["return"] == e["length"] for e in episodes)
    assert sum(e["length"] for e in episodes) <= steps
    assert max(e["policy_version"] for e in episodes) >= 1, "actors never picked up new weights"
    assert (out / "policy.pt").exists() and not list(out.glob(".policy-*")), "policy file not replaced atomically"
    return {"episodes": episodes, "first20": float(fl.group(1)), "last20": float(fl.group(2))}


# In this process (torch is imported once here anyway), while the scripts above run in the background: the demo with
# actor threads, and the parity benchmark with its runs in this process.
def test_demo_local(runs: Runs, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from arrowbuf import demo

    assert demo.main(["--transport", "local", "--actors", "2", "--steps", "800", "--warmup", "200",
                      "--no-progress", "--out", str(tmp_path)]) == 0
    r = subprocess.CompletedProcess([], 0, capsys.readouterr().out, "")
    assert "actor threads" in r.stdout
    _check_demo(r, tmp_path, 800, "local")
    assert not [t for t in threading.enumerate() if t.name.startswith(("actor-", "arrowbuf-loader"))]


def test_parity(runs: Runs, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import parity

    assert parity.main(["--seeds", "1", "--steps", "300", "--warmup", "100", "--eval-episodes", "2", "--jobs", "0",
                        "--out", str(tmp_path)]) == 0
    md = (tmp_path / "parity.md").read_text()
    for backend in ("numpy", "local", "shm", "flight"):
        assert re.search(rf"^\| {backend} \| 1 \| [\d.]+ \+- ", md, re.M), md
    data = json.loads((tmp_path / "parity.json").read_text())
    assert {row["backend"] for row in data["rows"]} == {"numpy", "local", "shm", "flight"}
    assert all(run["updates"] == (300 - 100) // 2 and len(run["eval"]) == 2 for run in data["runs"])
    _png(tmp_path / "parity.png")
    assert "| backend |" in capsys.readouterr().out


def test_demo_flight(runs: Runs) -> None:
    # a broken Flight must fail this test: the demo exits non-zero (never falls back to an in-process run)
    r = runs["demo_flight"]
    assert "store served over Arrow Flight at grpc://127.0.0.1:" in r.stdout, r.stdout
    _check_demo(r, runs.out / "demo_flight", 1000, "flight")


def test_demo_shm(runs: Runs) -> None:
    # a broken shared-memory tier must fail this test, as above; the run is prioritized (rows written by other
    # processes reach the owner's sum tree, or the learner never trains)
    r = runs["demo_shm"]
    assert "store in shared memory" in r.stdout, r.stdout
    _check_demo(r, runs.out / "demo_shm", 1000, "shm")
    shm_root = pathlib.Path(os.environ.get("ARROWBUF_SHM_DIR", "/dev/shm"))
    assert not list(shm_root.glob("arrowbuf.demo-*")), "the demo left a shared-memory store behind"


def test_demo_refuses_a_broken_transport(tmp_path: pathlib.Path) -> None:
    # shared memory unusable (its folder missing): a clear error naming the cause, not a quiet in-process run
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARROWBUF_SHM_DIR": str(tmp_path / "no-such-dir")}
    r = subprocess.run([sys.executable, "-m", "arrowbuf.demo", "--transport", "shm", "--steps", "50", "--actors", "1",
                        "--no-progress", "--out", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert r.returncode != 0, r.stdout[-3000:]
    assert "--transport shm needs a shared-memory folder" in r.stderr, r.stderr[-3000:]
    assert "falling back" not in r.stdout + r.stderr


def test_local_replay(runs: Runs) -> None:
    r = runs["local_replay"]
    assert "uniform: 1500 steps" in r.stdout and "ring: capacity 500" in r.stdout
    data = json.loads((runs.out / "ex" / "local_replay.json").read_text())
    assert data["uniform"]["rows"] == 1500 and data["prioritized"]["boosted_share"] > 0.5
    assert data["ring"] == {"lo": 1500, "hi": 1999}


def test_flight_actor_learner(runs: Runs) -> None:
    r = runs["flight_actor_learner"]
    assert "serving at grpc://" in r.stdout and "list_flights: ['cartpole']" in r.stdout
    data = json.loads((runs.out / "ex" / "flight_actor_learner.json").read_text())
    assert data["rows"] == data["expected"] == 600 and data["batches"] == 10 and data["episodes"] > 0


def test_shared_memory_actors(runs: Runs) -> None:
    r = runs["shared_memory_actors"]
    assert "learner process sampled 320 rows in 10 batches" in r.stdout
    data = json.loads((runs.out / "ex" / "shared_memory_actors.json").read_text())
    assert data["rows"] == data["expected"] == 800 and data["learner_rows"] == 320


def test_inspect_buffer(runs: Runs) -> None:
    r = runs["inspect_buffer"]
    assert "SQL, complete episodes per behaviour policy:" in r.stdout and "Polars, action counts:" in r.stdout
    data = json.loads((runs.out / "ex" / "inspect_buffer.json").read_text())
    assert data["rows"] == 1500 and data["complete_episodes"] > 0
    assert sorted(row["policy_version"] for row in data["per_policy"]) == [0, 1, 2]
    _png(runs.out / "ex" / "inspect_buffer.png")


def test_llm_tokens(runs: Runs) -> None:
    r = runs["llm_tokens"]
    assert "each once" in r.stdout
    data = json.loads((runs.out / "ex" / "llm_tokens.json").read_text())
    assert data["rows"] == 96 and data["delivered"] == 32 and data["stale_dropped"] >= 64
    assert [row["policy_version"] for row in data["summary"]] == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------------- in-process
def test_nstep_adder_matches_store_nstep(small_schema: ab.ExperienceSchema) -> None:
    """The parity baseline builds n-step transitions like arrowbuf computes them at sample time."""
    from benchmarks.parity import NStepAdder

    gamma, k = 0.9, 3
    rng = np.random.default_rng(0)
    lengths, ends = [5, 2, 7], ["terminated", "truncated", "terminated"]
    store = ab.ExperienceStore(small_schema, capacity=100, sampler="fifo")
    adder = NStepAdder(k, gamma)
    expected = []
    for n, end in zip(lengths, ends):
        obs = rng.normal(size=(n + 1, 3)).astype(np.float32)
        rew = rng.normal(size=n).astype(np.float32)
        term = np.zeros(n, bool)
        trunc = np.zeros(n, bool)
        (term if end == "terminated" else trunc)[-1] = True
        store.extend({"obs": obs[:-1], "action": np.zeros(n, np.int64), "reward": rew, "terminated": term,
                      "truncated": trunc, "next_obs": obs[1:]})
        for t in range(n):
            expected += adder.step(obs[t], 0, float(rew[t]), obs[t + 1], bool(term[t]), bool(trunc[t]))
    got = store.sample(sum(lengths), n_step=k, gamma=gamma).to_numpy()
    assert len(expected) == sum(lengths)
    np.testing.assert_allclose(got["obs"], np.stack([e[0] for e in expected]))
    np.testing.assert_allclose(got["n_step_return"], [e[2] for e in expected], rtol=1e-5)
    np.testing.assert_allclose(got["n_step_discount"], [e[3] for e in expected], rtol=1e-6)
    np.testing.assert_allclose(got["n_step_next_obs"], np.stack([e[4] for e in expected]))


def test_policy_file_round_trip(tmp_path: pathlib.Path) -> None:
    from arrowbuf.demo import DQNConfig, DQNLearner, PolicyFile

    learner = DQNLearner(DQNConfig(hidden=8))
    writer, reader = PolicyFile(tmp_path / "policy.pt"), PolicyFile(tmp_path / "policy.pt")
    assert reader.poll() is None
    writer.publish(learner.q.state_dict(), 1)
    version, state = reader.poll()
    assert version == 1 and set(state) == set(learner.q.state_dict())
    assert reader.poll() is None                      # unchanged: nothing to reload
    writer.publish(learner.q.state_dict(), 2)
    assert reader.poll()[0] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["policy.pt"]


def test_epsilon_schedule() -> None:
    from arrowbuf.demo import DQNConfig, epsilon_at

    cfg = DQNConfig(eps_start=1.0, eps_end=0.1, eps_fraction=0.5)
    assert epsilon_at(cfg, 0.0) == 1.0
    assert epsilon_at(cfg, 0.25) == pytest.approx(0.55)
    assert epsilon_at(cfg, 0.5) == epsilon_at(cfg, 1.0) == pytest.approx(0.1)
