"""Shared-memory actors: one store in /dev/shm, actor processes and a learner process attached to it.

    python examples/shared_memory_actors.py [--actors 2] [--steps 1000] [--out DIR]
                                           (DIR default: $ARROWBUF_EXAMPLES_OUT or a temp dir)

The main process creates the store with `tier="shm"`; actor processes open it by name with
`ExperienceStore.attach(name)` and write CartPole steps with `extend` (no sockets, no copies through a server); a
learner process attaches too and samples batches with 3-step returns while they write. Checks that every step is
visible to every process, that episode ids never collide across writers, and writes `shared_memory_actors.json`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import sys
import tempfile

import numpy as np

import arrowbuf as ab


def actor(name: str, actor_id: int, steps: int, seed: int) -> None:
    import gymnasium as gym

    store = ab.ExperienceStore.attach(name, timeout=30)     # the same memory as the creator's store
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    buf: dict[str, list] = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated", "next_obs")}
    try:
        for t in range(steps):
            action = int(rng.integers(2))
            nxt, reward, term, trunc, _ = env.step(action)
            for k, v in zip(buf, (obs, action, reward, term, trunc, nxt)):
                buf[k].append(v)
            obs = env.reset()[0] if (term or trunc) else nxt
            if term or trunc or len(buf["obs"]) == 50 or t == steps - 1:
                n = len(buf["obs"])
                store.extend({"obs": np.asarray(buf["obs"], np.float32), "action": np.asarray(buf["action"]),
                              "reward": np.asarray(buf["reward"], np.float32),
                              "terminated": np.asarray(buf["terminated"]), "truncated": np.asarray(buf["truncated"]),
                              "next_obs": np.asarray(buf["next_obs"], np.float32),
                              "policy_version": np.zeros(n, np.int64), "actor": np.full(n, actor_id)})
                for v in buf.values():
                    v.clear()
    finally:
        store.close()


def learner(name: str, batches: int, results: "mp.Queue[dict]") -> None:
    store = ab.ExperienceStore.attach(name, timeout=30)
    try:
        shapes, rows = set(), 0
        for _ in range(batches):
            b = store.sample(32, n_step=3, gamma=0.99, timeout=30)  # waits for the rate limiter's min size
            a = b.to_numpy()
            shapes.add(a["n_step_next_obs"].shape)
            rows += len(b)
        results.put({"rows": rows, "shapes": sorted(map(list, shapes)), "seen": len(store)})
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000, help="steps per actor")
    p.add_argument("--batches", type=int, default=50)
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
    total = args.actors * args.steps
    name = f"example-{os.getpid()}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    store = ab.ExperienceStore(schema, capacity=total, seed=args.seed, tier="shm", name=name,
                               rate_limiter=ab.rate_limiters.MinSize(200))
    try:
        nbytes = store.stats().get("bytes", {})
        nbytes = sum(nbytes.values()) if isinstance(nbytes, dict) else nbytes
        print(f"shared store {name!r}: {nbytes:,} bytes reserved in shared memory")
        procs = [ctx.Process(target=actor, args=(name, i, args.steps, args.seed + i), daemon=True)
                 for i in range(args.actors)]
        procs.append(ctx.Process(target=learner, args=(name, args.batches, results), daemon=True))
        for pr in procs:
            pr.start()
        got = results.get(timeout=120)
        for pr in procs:
            pr.join(60)
            assert pr.exitcode == 0, f"{pr.name} exited with {pr.exitcode}"
        assert len(store) == total, (len(store), total)
        eps = store.episodes()
        ids = eps.column("episode_id").to_pylist()
        assert len(ids) == len(set(ids))
        counted = store.sql("SELECT count(*) AS n FROM experience").to_pylist()[0]["n"]
        assert counted == total
        assert got["rows"] == 32 * args.batches and got["shapes"] == [[32, 4]], got
        complete = int(np.sum(eps.column("complete").to_numpy(zero_copy_only=False)))
        print(f"{args.actors} actor processes wrote {total} steps; the creator sees {len(store)} rows, "
              f"{complete} complete episodes with distinct ids")
        print(f"learner process sampled {got['rows']} rows in {args.batches} batches while they wrote "
              f"(it saw {got['seen']} rows at the end)")
        result = {"name": name, "rows": len(store), "expected": total, "episodes": complete,
                  "learner_rows": got["rows"]}
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
                pr.join(5)
        store.close()                                  # the creator's close removes the name from /dev/shm
    shm_root = os.environ.get("ARROWBUF_SHM_DIR", "/dev/shm")
    assert not os.path.exists(os.path.join(shm_root, f"arrowbuf.{name}")), "the segment outlived its store"
    (out / "shared_memory_actors.json").write_text(json.dumps(result, indent=2))
    print(f"ok: wrote {out / 'shared_memory_actors.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
