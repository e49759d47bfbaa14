"""The end-to-end demo: actors play an environment and write experience, a learner samples, SQL summarises.

Run with `python -m arrowbuf.demo` (or `bash scripts/demo.sh`). Uses gymnasium's CartPole-v1 when gymnasium is
installed and a built-in synthetic environment otherwise.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import numpy as np

from .schema import load_schema
from .store import ExperienceStore

SCHEMAS = pathlib.Path(__file__).resolve().parent.parent / "schemas"
CARTPOLE = {
    "name": "cartpole",
    "fields": {"obs": {"dtype": "float32", "shape": [4]}, "action": {"dtype": "int64"},
               "reward": {"dtype": "float32"}, "terminated": {"dtype": "bool"}, "truncated": {"dtype": "bool"},
               "policy_version": {"dtype": "int64"}},
    "derived": {"next_obs": {"next_of": "obs"}},
}


class SyntheticEnv:
    """A tiny CartPole-shaped environment (no dependency): reward 1 per step, random episode lengths."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        self.t = 0
        self.limit = int(self.rng.integers(10, 200))
        return self.rng.normal(size=4).astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        obs = self.rng.normal(size=4).astype(np.float32)
        return obs, 1.0, self.t >= self.limit, False, {}


def make_env(seed: int) -> Any:
    try:
        import gymnasium as gym

        env = gym.make("CartPole-v1")
        env.reset(seed=seed)
        return env
    except ImportError:
        return SyntheticEnv(seed)


def run_actors(store: ExperienceStore, actors: int, steps: int, seed: int) -> float:
    """Play `actors` environments round-robin with a random policy, one step each in turn."""
    envs = [make_env(seed + i) for i in range(actors)]
    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(envs)]
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for t in range(steps):
        i = t % actors
        action = int(rng.integers(0, 2))
        nxt, reward, term, trunc, _ = envs[i].step(action)
        store.append({"obs": np.asarray(obs[i], np.float32), "action": action, "reward": float(reward),
                      "terminated": bool(term), "truncated": bool(trunc), "policy_version": 0,
                      "next_obs": np.asarray(nxt, np.float32), "actor": i})
        obs[i] = envs[i].reset()[0] if (term or trunc) else nxt
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="arrowbuf demo", description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--capacity", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    schema = load_schema(SCHEMAS / "cartpole.yaml") if (SCHEMAS / "cartpole.yaml").exists() else load_schema(
        CARTPOLE)
    with ExperienceStore(schema, capacity=args.capacity, seed=args.seed) as store:
        secs = run_actors(store, args.actors, args.steps, args.seed)
        print(f"ingested {len(store)} steps from {args.actors} interleaved actors in {secs:.2f}s "
              f"({len(store) / secs:,.0f} steps/s)")
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 1.0:
            batch = store.sample(args.batch_size)
            n += len(batch)
        print(f"sampled {n / (time.perf_counter() - t0):,.0f} transitions/s (batch {args.batch_size})")
        eps = store.episodes()
        print(f"{eps.num_rows} episodes stored, {sum(eps.column('complete').to_pylist())} complete")
        try:
            summary = store.sql(
                "SELECT count(DISTINCT episode_id) AS episodes, avg(ret) AS mean_return, max(ret) AS best "
                "FROM (SELECT episode_id, sum(reward) AS ret FROM experience GROUP BY episode_id)")
            print("episode returns (DuckDB over the live buffer):")
            print(summary.to_pandas().to_string(index=False))
        except ImportError as exc:
            print(f"(SQL summary skipped: {exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
