"""Flight actor/learner: a store served over Arrow Flight, actor processes writing, a learner reading via ab.Loader.

    python examples/flight_actor_learner.py [--actors 2] [--steps 1000] [--out DIR]
                                           (DIR default: $ARROWBUF_EXAMPLES_OUT or a temp dir)

The main process creates a prioritized store and serves it (`ab.serve(store, "grpc://127.0.0.1:0")`); each actor
process connects by address (`ab.connect(location)`) and streams CartPole steps with `extend`; the learner pulls
batches with 3-step returns through `ab.Loader` over its own client and sends priorities back. Checks that every
step arrived, that batches and priority updates went through, lists the store with a plain Flight client, and
writes `flight_actor_learner.json` to DIR.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

import arrowbuf as ab


def actor(location: str, actor_id: int, steps: int, seed: int) -> None:
    """Play random-policy CartPole and write steps over Flight, 50 at a time (an episode end also flushes)."""
    import gymnasium as gym

    client = ab.connect(location)                      # a separate process: it knows only the address
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    try:
        for _ in range(steps):
            action = int(rng.integers(2))
            nxt, reward, term, trunc, _ = env.step(action)
            rows.append({"obs": obs, "action": action, "reward": reward, "terminated": term, "truncated": trunc,
                         "next_obs": nxt, "policy_version": 0})
            obs = env.reset()[0] if (term or trunc) else nxt
            if term or trunc or len(rows) == 50:
                client.extend(columns(rows, actor_id))
                rows = []
        if rows:
            client.extend(columns(rows, actor_id))
    finally:
        client.close()


def columns(rows: list[dict], actor_id: int) -> dict[str, np.ndarray]:
    cols = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
    cols["obs"] = cols["obs"].astype(np.float32)
    cols["next_obs"] = cols["next_obs"].astype(np.float32)
    cols["reward"] = cols["reward"].astype(np.float32)
    cols["actor"] = np.full(len(rows), actor_id)      # keeps this actor's episodes apart from the others'
    return cols


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000, help="steps per actor")
    p.add_argument("--batches", type=int, default=50, help="batches the learner takes")
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
    store = ab.ExperienceStore(schema, capacity=total, sampler=ab.samplers.Prioritized(), seed=args.seed)
    ctx = mp.get_context("spawn")
    procs = []
    try:
        with ab.serve(store, "grpc://127.0.0.1:0") as server:
            print(f"serving at {server.location}")
            for i in range(args.actors):
                pr = ctx.Process(target=actor, args=(server.location, i, args.steps, args.seed + i), daemon=True)
                pr.start()
                procs.append(pr)
            with ab.connect(server.location) as client, \
                    ab.Loader(client, batch_size=64, prefetch=2, n_step=3, gamma=0.99, timeout=60) as loader:
                t0 = time.perf_counter()
                for _ in range(args.batches):              # learn while the actors are still writing
                    batch = next(loader)
                    assert len(batch) == 64 and batch.weights is not None
                    td = np.abs(batch["n_step_return"] - 1.0) + 0.01     # stand-in for |TD error|
                    loader.update_priorities(batch, td)
                learn_s = time.perf_counter() - t0
                for pr in procs:
                    pr.join(60)
                    assert pr.exitcode == 0, f"actor exited with {pr.exitcode}"
                assert len(client) == total, (len(client), total)
                stats = client.stats()
                print(f"learner: {loader.metrics.iterations} batches in {learn_s:.2f}s; {loader.metrics.summary()}")
            # any Flight client can discover the store
            import pyarrow.flight as flight

            infos = list(flight.FlightClient(server.location).list_flights())
            names = [i.descriptor.path[0].decode() if i.descriptor.path else str(i.descriptor) for i in infos]
            assert any("cartpole" in n for n in names), names
            print(f"list_flights: {names}")
        eps = store.episodes()
        complete = int(np.sum(eps.column("complete").to_numpy(zero_copy_only=False)))
        print(f"store: {len(store)} steps from {args.actors} actors over Flight, {complete} complete episodes")
        result = {"rows": len(store), "expected": total, "episodes": complete, "batches": args.batches,
                  "location": server.location, "flights": names,
                  "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}}
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
                pr.join(5)
        store.close()
    (out / "flight_actor_learner.json").write_text(json.dumps(result, indent=2))
    print(f"ok: wrote {out / 'flight_actor_learner.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
