"""Inspect a buffer like a dataframe: SQL (DuckDB), Polars, pandas, the episode summary and a plot.

    python examples/inspect_buffer.py [--steps 4000] [--out DIR]        fill a local store, then inspect it
    python examples/inspect_buffer.py --location grpc://HOST:PORT       inspect a served store (e.g. the demo's)
                                      (DIR default: $ARROWBUF_EXAMPLES_OUT or a temp dir)

Without `--location` it fills a store with CartPole steps from a few interleaved actors of different skill (a random
policy and two simple heuristics), so the tables have something to show. Checks that SQL, Polars, pandas and
`episodes()` agree, and writes `inspect_buffer.png` (returns per actor and episode lengths) and
`inspect_buffer.json` to DIR.
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

POLICIES = ("random", "lean", "pid")   # actor i plays POLICIES[i % 3]


def policy(kind: str, obs: np.ndarray, rng: np.random.Generator) -> int:
    if kind == "random":
        return int(rng.integers(2))
    if kind == "lean":                        # push toward the side the pole leans to
        return int(obs[2] > 0)
    return int(obs[2] + 0.5 * obs[3] + 0.05 * obs[1] > 0)   # angle + angular velocity: balances for long


def fill(store: ab.ExperienceStore, steps: int, actors: int, seed: int) -> None:
    import gymnasium as gym

    envs = [gym.make("CartPole-v1") for _ in range(actors)]
    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(envs)]
    rng = np.random.default_rng(seed)
    for t in range(steps):
        i = t % actors
        a = policy(POLICIES[i % len(POLICIES)], obs[i], rng)
        nxt, r, term, trunc, _ = envs[i].step(a)
        store.append({"obs": obs[i], "action": a, "reward": r, "terminated": term, "truncated": trunc,
                      "next_obs": nxt, "policy_version": i % len(POLICIES), "actor": i})
        obs[i] = envs[i].reset()[0] if (term or trunc) else nxt


def inspect(store, out: pathlib.Path) -> dict:
    """What a person looks at first; works on a local store and on `ab.connect(...)`'s client alike."""
    stats = store.stats()
    print(f"{len(store)} rows of capacity {stats.get('capacity')}, {stats.get('inserts')} inserted, "
          f"{stats.get('chunks')} chunks ({stats.get('sealed_chunks')} sealed), {stats.get('open_episodes')} "
          f"episodes still open")
    # 1. SQL: returns per behaviour policy (policy_version doubles as a policy id here)
    per_policy = store.sql(
        "SELECT policy_version, count(*) AS episodes, round(avg(ret), 1) AS mean_return, max(ret) AS best "
        "FROM (SELECT episode_id, any_value(policy_version) AS policy_version, sum(reward) AS ret "
        "      FROM experience GROUP BY episode_id HAVING bool_or(terminated OR truncated)) "
        "GROUP BY 1 ORDER BY 1")
    print("SQL, complete episodes per behaviour policy:")
    print(per_policy.to_pandas().to_string(index=False))
    # 2. the built-in episode summary agrees with SQL
    eps = store.episodes()
    complete = eps.filter(eps.column("complete"))
    sql_eps = store.sql("SELECT count(*) AS n FROM (SELECT episode_id FROM experience GROUP BY episode_id "
                        "HAVING bool_or(terminated OR truncated))").to_pylist()[0]["n"]
    assert complete.num_rows == sql_eps, (complete.num_rows, sql_eps)
    # 3. Polars and pandas see the same rows
    import polars as pl

    df = store.to_polars()
    actions = df.group_by("action").agg(pl.len().alias("n")).sort("action")
    print("Polars, action counts:", dict(zip(actions["action"].to_list(), actions["n"].to_list())))
    pdf = store.to_pandas(["obs", "reward"])
    assert len(df) == len(pdf) == len(store)
    obs = np.stack(pdf["obs"].to_numpy())
    print(f"pandas: obs column as [N, 4] array, mean |pole angle| {np.abs(obs[:, 2]).mean():.4f} rad")
    # 4. plot
    png = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ep = store.sql("SELECT episode_id, any_value(policy_version) AS policy, sum(reward) AS ret, "
                       "min(seq) AS first_seq FROM experience GROUP BY episode_id "
                       "HAVING bool_or(terminated OR truncated) ORDER BY first_seq").to_pandas()
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
        for pol, g in ep.groupby("policy"):
            a1.plot(g["first_seq"], g["ret"], "o", ms=3, label=f"policy {pol}")
        a1.set_xlabel("first seq of episode")
        a1.set_ylabel("return")
        a1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        a1.set_title("episode returns")
        a2.hist(complete.column("length").to_numpy(), bins=30)
        a2.set_xlabel("episode length")
        a2.set_ylabel("episodes")
        a2.set_title("episode lengths (store.episodes())")
        fig.tight_layout()
        png = out / "inspect_buffer.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        print(f"plot: {png}")
    except ImportError:
        print("(matplotlib not installed: no plot)")
    return {"rows": len(store), "complete_episodes": complete.num_rows,
            "per_policy": per_policy.to_pylist(), "plot": str(png) if png else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--location", default=None, help="a served store's Flight location (default: fill a local one)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--actors", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # what this example imports beyond arrowbuf (the [demo] extra), checked before anything runs
    for module in ("gymnasium", "duckdb", "pandas", "polars", "matplotlib"):
        ab.errors.require(module, "demo")
    # a temporary folder only when no --out and no $ARROWBUF_EXAMPLES_OUT (a default made one on every run)
    args.out = args.out or os.environ.get("ARROWBUF_EXAMPLES_OUT") or tempfile.mkdtemp(prefix="arrowbuf-")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.location:
        with ab.connect(args.location) as client:
            result = inspect(client, out)
    else:
        schema = ab.load_schema("cartpole")  # a schema shipped with arrowbuf (schemas/cartpole.yaml)
        with ab.ExperienceStore(schema, capacity=args.steps, seed=args.seed) as store:
            fill(store, args.steps, args.actors, args.seed)
            result = inspect(store, out)
            # the heuristics really are better than random: the buffer shows it
            means = {r["policy_version"]: r["mean_return"] for r in result["per_policy"]}
            if len(means) == 3:
                assert float(means[2]) > float(means[0]), means
    (out / "inspect_buffer.json").write_text(json.dumps(result, indent=2, default=float))
    print(f"ok: wrote {out / 'inspect_buffer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
