"""Local replay: one process plays CartPole, writes steps into an in-process store and samples it three ways.

    python examples/local_replay.py [--steps 3000] [--out DIR]     (DIR default: $ARROWBUF_EXAMPLES_OUT or a temp dir)

Shows: `ExperienceStore` from the CartPole schema, `append` of single steps with interleaved actors, uniform
sampling, prioritized sampling with 3-step returns and priority updates, and the episode table. Checks the
invariants it relies on and writes `local_replay.json` to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

import arrowbuf as ab


def play(store: ab.ExperienceStore, steps: int, actors: int, seed: int) -> list[float]:
    """Random-policy CartPole in `actors` interleaved environments; returns the finished episodes' returns."""
    import gymnasium as gym

    envs = [gym.make("CartPole-v1") for _ in range(actors)]
    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(envs)]
    ret = [0.0] * actors
    returns = []
    rng = np.random.default_rng(seed)
    for t in range(steps):
        i = t % actors                          # actors take turns: their episodes interleave in the store
        action = int(rng.integers(2))
        nxt, reward, term, trunc, _ = envs[i].step(action)
        store.append({"obs": obs[i], "action": action, "reward": reward, "terminated": term, "truncated": trunc,
                      "next_obs": nxt, "policy_version": 0, "actor": i})   # "actor" keeps episodes apart
        ret[i] += reward
        if term or trunc:
            returns.append(ret[i])
            ret[i] = 0.0
            obs[i] = envs[i].reset()[0]
        else:
            obs[i] = nxt
    return returns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # what this example imports beyond arrowbuf (the [demo] extra), checked before anything runs
    for module in ("gymnasium",):
        ab.errors.require(module, "demo")
    # a temporary folder only when no --out and no $ARROWBUF_EXAMPLES_OUT (a default made one on every run)
    args.out = args.out or os.environ.get("ARROWBUF_EXAMPLES_OUT") or tempfile.mkdtemp(prefix="arrowbuf-")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    schema = ab.load_schema("cartpole")  # a schema shipped with arrowbuf (schemas/cartpole.yaml)
    checks: dict[str, object] = {}

    # 1. uniform replay
    with ab.ExperienceStore(schema, capacity=args.steps, seed=args.seed) as store:
        returns = play(store, args.steps, args.actors, args.seed)
        assert len(store) == args.steps, (len(store), args.steps)
        batch = store.sample(128)
        arrays = batch.to_numpy()
        assert arrays["obs"].shape == (128, 4) and arrays["next_obs"].shape == (128, 4)
        assert batch.weights is None
        eps = store.episodes()
        complete = eps.filter(eps.column("complete"))
        # the store's per-episode returns are the ones the environment reported (same multiset)
        assert sorted(complete.column("return").to_pylist()) == sorted(returns)
        print(f"uniform: {len(store)} steps, {complete.num_rows} complete episodes, "
              f"mean return {np.mean(returns):.1f}; sample(128) -> obs {arrays['obs'].shape}")
        checks["uniform"] = {"rows": len(store), "episodes": complete.num_rows,
                             "mean_return": float(np.mean(returns))}

    # 2. prioritized replay with 3-step returns
    sampler = ab.samplers.Prioritized(alpha=0.6, beta=0.4)
    with ab.ExperienceStore(schema, capacity=args.steps, sampler=sampler, seed=args.seed) as store:
        play(store, args.steps, args.actors, args.seed)
        batch = store.sample(64, n_step=3, gamma=0.99)
        a = batch.to_numpy()
        # rewards are 1 per step: a 3-step return is 1 + g + g^2 unless the episode ended sooner
        assert np.all(a["n_step_return"] <= 1 + 0.99 + 0.99 ** 2 + 1e-5) and np.all(a["n_step_return"] >= 1 - 1e-6)
        assert batch.weights is not None and np.isclose(batch.weights.max(), 1.0)
        # raise the priority of 8 rows far above the rest: they dominate the next batches
        hot = batch.indices[:8]
        store.update_priorities(hot, np.full(8, 1e6))
        again = store.sample(256)
        share = float(np.isin(again.indices, hot).mean())
        assert share > 0.5, share
        print(f"prioritized: n_step_return in [{a['n_step_return'].min():.3f}, {a['n_step_return'].max():.3f}], "
              f"IS weights max {batch.weights.max():.2f}; after update_priorities the 8 boosted rows are "
              f"{share:.0%} of the next batch")
        checks["prioritized"] = {"boosted_share": share}

    # 3. capacity: the ring keeps the newest rows
    with ab.ExperienceStore(schema, capacity=500, seed=args.seed) as store:
        play(store, 2000, 1, args.seed)
        t = store.to_table(["obs"])
        assert len(store) == 500 and t.num_rows == 500
        seqs = store.sql("SELECT min(seq) AS lo, max(seq) AS hi FROM experience").to_pylist()[0]
        assert (seqs["lo"], seqs["hi"]) == (1500, 1999), seqs
        print(f"ring: capacity 500 after 2000 steps holds seq {seqs['lo']}..{seqs['hi']}")
        checks["ring"] = seqs

    (out / "local_replay.json").write_text(json.dumps(checks, indent=2))
    print(f"ok: wrote {out / 'local_replay.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
