"""The demo on Ray: DQN on CartPole-v1 with actors as Ray actors, a `ShardedStore`, and weights by `Broadcast`.

    python -m arrowbuf.demo ray [--actors 3] [--shards 2] [--steps 15000] [--address auto] [--seed 0]

What runs:

* Ray: `ray.init()` on this machine (or `--address` of a running cluster; a caller already connected keeps its
  connection, and nothing of it is shut down);
* the store: a `ShardedStore` (prioritized replay, one shard actor per `--shards`, spread over the nodes);
* actors: `--actors` Ray actors, round-robin over the nodes, each playing CartPole-v1 with an epsilon-greedy
  torch policy and writing its steps through `sharded.writer()` (its node's shard: shared memory when co-located,
  else Flight);
* the learner (this process): double DQN with 3-step returns on `sharded.sample(..., n_step=3)`, priorities sent
  back with `sharded.update_priorities`, one gradient step per `train_every` stored rows at most;
* policy weights: the learner publishes its Q-network with `arrowbuf.ray.Broadcast` every `--publish-every`
  gradient steps, as a new version; each node's relay pulls it block by block from the holder with the most
  blocks (pipelined, receiver-driven); every `poll_every` steps an actor takes the newest version its node holds
  (`Broadcast.poll`, which never waits for a transfer) and keeps acting on the weights it has meanwhile. An actor
  records the digest of every version it loaded, so a run shows that each actor got the learner's exact bytes.
* `--kill-relay`: after the second publish, the relay of one node other than the learner's is killed (failure
  injection); that node's actors get a new relay at their next poll, which joins the running broadcast.

Everything it started (actors, shards, relays, the broadcast's /dev/shm files, and Ray if it started it) is gone
when `run` returns or raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import ArrowbufError, InvalidArgument, SampleTimeout, require
from .dqn import DQNConfig, DQNLearner, EpsilonGreedy, epsilon_at, make_env
from .entry import demos_epilog, run_cli

LEARNER_COLUMNS = ["obs", "action", "next_obs"]


def weights_digest(state: Mapping[str, Any]) -> str:
    """BLAKE2b-128 of a state dict's arrays (torch tensors or numpy), in key order: equal weights, equal digests."""
    from ..ray.hoplite.relay import digest_of

    parts = []
    for k in sorted(state):
        v = state[k]
        a = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
        parts.append(np.ascontiguousarray(a).tobytes())
    return digest_of(b"".join(parts))


class DemoActor:
    """One actor (a Ray actor): plays CartPole, writes to its node's shard, loads broadcast weights."""

    def __init__(self, actor_id: int, sharded: Any, bc: Any, cfg: DQNConfig, seed: int, flush: int = 32,
                 poll_every: int = 50) -> None:
        torch = require("torch", "demo")
        torch.set_num_threads(1)
        self.torch = torch
        self.actor_id, self.sharded, self.bc, self.cfg = actor_id, sharded, bc, cfg
        self.seed, self.flush_rows, self.poll_every = seed, flush, poll_every
        self.policy = EpsilonGreedy(cfg, seed=seed)
        self.version = 0
        self.received: dict[int, str] = {}

    def _load(self, got: tuple[int, Any] | None) -> None:
        if got is None:
            return
        v, state = got
        # the arrays view the node's read-only copy: copy into the module's own parameters
        self.policy.load_state_dict({k: self.torch.from_numpy(np.array(a)) for k, a in state.items()})
        self.version = v
        self.received[v] = weights_digest(state)

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, steps: int, min_version: int = 1) -> dict[str, Any]:
        """Play `steps` steps; before returning, wait until this node holds version >= `min_version` and load it.

        Returns the episodes (return, length, end time, policy version) and the digest of every version loaded.
        """
        import ray

        cfg = self.cfg
        env = make_env(self.seed)
        obs, _ = env.reset(seed=self.seed)
        cols: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated",
                                                      "next_obs", "policy_version")}
        episodes: list[dict[str, Any]] = []
        ep_return, ep_len = 0.0, 0
        with self.sharded.writer() as w:
            def flush() -> None:
                if cols["obs"]:
                    w.send({k: np.asarray(v, dtype=_DTYPES[k]) for k, v in cols.items()})
                    for v in cols.values():
                        v.clear()

            for t in range(steps):
                if t % self.poll_every == 0:
                    self._load(self.bc.poll(self.version))
                action = self.policy.act(obs, epsilon_at(cfg, t / steps))
                nxt, reward, term, trunc, _ = env.step(action)
                for k, v in (("obs", obs), ("action", action), ("reward", reward), ("terminated", term),
                             ("truncated", trunc), ("next_obs", nxt), ("policy_version", self.version)):
                    cols[k].append(v)
                ep_return += float(reward)
                ep_len += 1
                if term or trunc:
                    flush()
                    episodes.append({"actor": self.actor_id, "return": ep_return, "length": ep_len,
                                     "t": time.time(), "policy_version": self.version})
                    ep_return, ep_len = 0.0, 0
                    obs, _ = env.reset()
                else:
                    obs = nxt
                    if len(cols["obs"]) >= self.flush_rows:
                        flush()
            flush()
            w.flush()
        env.close()
        if self.version < min_version:  # the learner keeps training on what is stored until it publishes it
            self._load(self.bc.fetch(min_version))
        return {"actor": self.actor_id, "node": ray.get_runtime_context().get_node_id(), "steps": steps,
                "episodes": episodes, "received": self.received}


_DTYPES = {"obs": np.float32, "action": np.int64, "reward": np.float32, "terminated": bool, "truncated": bool,
           "next_obs": np.float32, "policy_version": np.int64}


@dataclasses.dataclass
class RayDemoResult:
    episodes: list[dict[str, Any]]     # actor, return, length, t (seconds since start), policy_version
    updates: int
    steps: int                         # rows in the sharded store at the end
    wall_s: float
    published: dict[int, str]          # version -> digest of the weights the learner published
    actors: list[dict[str, Any]]       # per actor: actor, node, steps, received {version: digest}
    nodes: int
    killed_relay: str | None
    broadcast_uid: str
    first20: float
    last20: float


def run(actors: int = 3, steps: int = 15_000, shards: int = 2, seed: int = 0, cfg: DQNConfig | None = None,
        publish_every: int = 50, min_version: int = 1, block_size: int = 16 << 10, kill_relay: bool = False,
        address: str | None = None, progress: bool = True, log: Any = print) -> RayDemoResult:
    """Run the Ray demo (see the module docstring) and return what it measured.

    Args:
        actors: Ray actors playing CartPole (round-robin over the nodes).
        steps: environment steps in all (split across actors).
        shards: shards of the `ShardedStore`.
        publish_every: gradient steps between weight versions.
        min_version: each actor, once done playing, waits for this version and loads it (so a short run still
            shows new versions reaching every actor); needs `(min_version - 1) * publish_every` gradient steps.
        block_size: the broadcast's block size (bytes).
        kill_relay: kill one non-learner node's relay after the second publish (failure injection).
        address: a Ray cluster to connect to (default: a running connection, else a new local `ray.init()`).
        progress: a bar on a terminal, a line every 2 s otherwise (`arrowbuf.observe.meter`).
    """
    from ..observe.meter import ProgressMeter

    with ProgressMeter(steps, "ray demo", "row", enabled=progress) as bar:
        bar.note("starting Ray and the shards")
        return _run(actors, steps, shards, seed, cfg, publish_every, min_version, block_size, kill_relay, address,
                    bar, log)


def _run(actors: int, steps: int, shards: int, seed: int, cfg: DQNConfig | None, publish_every: int,
         min_version: int, block_size: int, kill_relay: bool, address: str | None, bar: Any,
         log: Any) -> RayDemoResult:
    require("torch", "demo")
    require("gymnasium", "demo")
    from .. import samplers
    from ..ray import Broadcast, ShardedStore
    from ..ray._common import _ray
    from .app import cartpole_schema

    ray = _ray()
    cfg = cfg or DQNConfig()
    if actors < 1 or steps < 1 or shards < 1 or publish_every < 1:
        raise InvalidArgument("--actors, --steps, --shards and --publish-every must be >= 1")
    if cfg.warmup > steps:
        raise InvalidArgument(f"--warmup ({cfg.warmup}) must be at most --steps ({steps}): learning would not start")
    if (min_version - 1) * publish_every > steps // cfg.train_every:
        raise InvalidArgument(f"min_version {min_version} needs {(min_version - 1) * publish_every} gradient steps, "
                              f"but {steps} steps allow {steps // cfg.train_every}; lower it or --publish-every")
    import torch

    torch.set_num_threads(1)
    started_ray = False
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
        started_ray = True
    t_start = time.time()
    sharded = bc = None
    handles: list[Any] = []
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        sharded = ShardedStore.create(cartpole_schema(), num_shards=shards,
                                      capacity_per_shard=max(steps, 2 * cfg.warmup) // shards + 1_000,
                                      sampler=samplers.Prioritized(alpha=cfg.alpha, beta=cfg.beta), seed=seed)
        bc = Broadcast.create(block_size=block_size)
        learner = DQNLearner(cfg, seed=seed)
        published: dict[int, str] = {}

        def publish() -> int:
            state = learner.q.state_dict()
            v = bc.publish(state)
            published[v] = weights_digest(state)
            return v

        version = publish()
        log(f"Ray: {len(nodes)} node(s); {shards} shards; {actors} actors; weights by Broadcast "
            f"(blocks of {block_size >> 10} KB, one relay per node)")
        per_actor = [steps // actors + (1 if i < steps % actors else 0) for i in range(actors)]
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote = ray.remote(DemoActor)
        handles = [remote.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            nodes[i % len(nodes)], soft=False)).remote(i, sharded, bc, cfg, seed * 1000 + i) for i in range(actors)]
        actor_nodes = ray.get([h.node.remote() for h in handles])
        runs = {h.run.remote(per_actor[i], min_version): i for i, h in enumerate(handles)}
        pending = list(runs)
        results: list[Any] = []
        killed: str | None = None
        rows = 0
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            results += ray.get(done)
            if learner.updates % 20 == 0:
                rows = len(sharded)
            if rows < cfg.warmup or learner.updates >= rows // cfg.train_every:
                # no data yet, or trained enough per stored row: wait for the actors (up to 0.1 s), not spinning
                done, pending = ray.wait(pending, num_returns=1, timeout=0.1)
                results += ray.get(done)
                rows = len(sharded)
                continue
            try:
                batch = sharded.sample(cfg.batch_size, LEARNER_COLUMNS, timeout=1.0, n_step=cfg.n_step,
                                       gamma=cfg.gamma)
            except SampleTimeout:
                continue
            td = learner.train(batch.to_numpy(), batch.weights)
            sharded.update_priorities(batch.indices, td + 1e-3)
            if learner.updates % publish_every == 0:
                version = publish()
                if kill_relay and version == 2 and killed is None:
                    killed = _kill_one_relay(bc, ray.get_runtime_context().get_node_id(), actor_nodes)
                    log(f"killed the broadcast relay of node {killed[:8]} (failure injection)")
            bar.update_to(rows, **{"gradient steps": learner.updates, "policy": f"v{version}"})
        total_rows = len(sharded)
        wall = time.time() - t_start
        uid = bc.uid
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)
        if bc is not None:
            bc.close()
        if sharded is not None:
            sharded.shutdown()
        if started_ray:
            ray.shutdown()
    episodes = sorted(({**e, "t": e["t"] - t_start} for r in results for e in r["episodes"]), key=lambda e: e["t"])
    rets = [e["return"] for e in episodes]
    return RayDemoResult(episodes, learner.updates, total_rows, wall, published,
                         [{k: r[k] for k in ("actor", "node", "steps", "received")} for r in results],
                         len(nodes), killed, uid, float(np.mean(rets[:20])) if rets else float("nan"),
                         float(np.mean(rets[-20:])) if rets else float("nan"))


def _kill_one_relay(bc: Any, learner_node: str, actor_nodes: list[str]) -> str:
    """Kill the relay of the first node other than the learner's that runs an actor; return that node's id."""
    others = [n for n in actor_nodes if n != learner_node]
    if not others:
        raise ArrowbufError("--kill-relay needs an actor on a Ray node besides the learner's (a multi-node cluster)")
    bc.kill_relay(others[0])
    return others[0]


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Ray demo's flags on `p`."""
    p.add_argument("--actors", type=int, default=3, help="Ray actors playing CartPole")
    p.add_argument("--shards", type=int, default=2, help="shards of the ShardedStore")
    p.add_argument("--steps", type=int, default=15_000,
                   help="environment steps in all (split across actors; default 15000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments, sampling and the model (default 0)")
    p.add_argument("--warmup", type=int, default=None, help="rows stored before learning starts (default 1000)")
    p.add_argument("--publish-every", type=int, default=50, help="gradient steps between weight versions")
    p.add_argument("--min-version", type=int, default=1,
                   help="actors, once done, wait for this weight version (shows new versions on short runs)")
    p.add_argument("--block-kb", type=int, default=16, help="broadcast block size, KB")
    p.add_argument("--kill-relay", action="store_true",
                   help="kill one non-learner node's broadcast relay after the second publish (needs 2+ nodes)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start Ray on this machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.add_argument("--out", default=None,
                   help="folder for ray_returns.png (default: $ARROWBUF_DEMO_OUT or demo_out)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m arrowbuf.demo ray") -> int:
    p = configure_parser(argparse.ArgumentParser(prog=prog, description="The demo on Ray: actors as Ray actors, a "
                                                                        "ShardedStore, weights by Broadcast.",
                                                 epilog=demos_epilog(prog.rsplit(" ", 1)[0]),
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    a = p.parse_args(argv)
    return run_cli(lambda: _run_and_report(a), "Ray actors and shards stopped")


def _run_and_report(a: argparse.Namespace) -> int:
    import os
    import pathlib

    from .app import SHORT_RUN_STEPS, _plot

    cfg = DQNConfig()
    if a.warmup is not None:
        cfg.warmup = a.warmup
    res = run(a.actors, a.steps, a.shards, a.seed, cfg, a.publish_every, a.min_version, a.block_kb << 10,
              a.kill_relay, a.address, progress=not a.no_progress)
    out = pathlib.Path(a.out or os.environ.get("ARROWBUF_DEMO_OUT", "demo_out"))
    out.mkdir(parents=True, exist_ok=True)
    plot = _plot(res.episodes, out / "ray_returns.png",
                 f"DQN on CartPole-v1 over Ray: {a.actors} actors, {a.shards} shards")
    print(f"\n{res.steps} steps, {len(res.episodes)} episodes, {res.updates} gradient steps in {res.wall_s:.1f}s "
          f"on {res.nodes} Ray node(s)")
    print(f"weights: {len(res.published)} versions published by Broadcast")
    for r in sorted(res.actors, key=lambda r: r["actor"]):
        same = all(res.published.get(v) == d for v, d in r["received"].items())
        print(f"  actor {r['actor']} (node {r['node'][:8]}): versions {sorted(r['received'])}, "
              f"digests {'identical to the learner' if same else 'DIFFER'}")
    print(f"mean return: first 20 episodes {res.first20:.1f} -> last 20 episodes {res.last20:.1f}")
    if res.steps < SHORT_RUN_STEPS:
        print(f"(a short run: DQN on CartPole needs about {SHORT_RUN_STEPS:,} steps before returns rise, so this run "
              "shows the machinery, not learning; the default is 15,000)")
    if plot:
        print(f"plot: {plot}")
    return 0
