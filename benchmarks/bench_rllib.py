"""RLlib benchmark (issue 19): what arrowbuf's scheduled buffer does to an unmodified RLlib DQN iteration.

RLlib's DQN (new API stack, one local EnvRunner, one local Learner, `train_batch_size` 32, one env sample of 32 steps
and one learner update per `algo.train()`) runs with each replay buffer, same seed and config:

  rllib       RLlib's EpisodeReplayBuffer / PrioritizedEpisodeReplayBuffer
  ab-sync     arrowbuf's buffer, synchronous (sample, gather, episode conversion and add on the learner's thread)
  ab-sched    arrowbuf's buffer with `schedule=True` (the next batch drawn and converted, and adds committed, in the
              background while the learner updates / the EnvRunner samples)

on two environments: CartPole-v1, and `AtariLike` (a synthetic gymnasium env with uint8[4, 84, 84] observations, cheap
to step: frames cycled from a pre-generated pool; DQN with a small CNN so the learner step stays short).

Per iteration (one `algo.train()`), after a warm-up:
  exposed     the time the algorithm's thread spent inside the buffer's `add`, `sample` (with the `get_metrics`
              call RLlib makes right after it) and `update_priorities` calls, timed around the calls by a subclass
              of each buffer (the same spans RLlib's
              `replay_buffer_add_data_timer`, `replay_buffer_sampling_timer` and
              `replay_buffer_update_prios_timer` time; their EMA values are reported as the cross-check).
  iteration   wall time of `algo.train()`.
Medians and p99 over iterations of all repeats. For arrowbuf, the buffer's own metrics (result
`replay_buffer/arrowbuf`: wait for batch, blocking add, conversion, background conversion) are reported too.

    python -m benchmarks.bench_rllib [--env cartpole|atari|both] [--iters 120] [--repeats 2] [--device cpu|cuda]
    python -m benchmarks.bench_rllib --convergence [--seeds 3] [--steps 5000]   # prioritized, training_intensity 8

Prints a table and writes benchmarks/out/rllib_<env>.json (and rllib_convergence.json, docs/img/rllib_convergence.png).
torch runs with one thread: this machine has 2 cores shared with other work, and the background thread needs one.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
WARMUP = 15
BATCH = 32
FRAGMENT = 32
MODES = ("rllib", "ab-sync", "ab-sched")
EMA = 0.01  # RLlib's default EMA coefficient of `metrics.log_time`
RLLIB_TIMERS = ("replay_buffer_add_data_timer", "replay_buffer_sampling_timer", "replay_buffer_update_prios_timer",
                "learner_update_timer", "env_runner_sampling_timer", "training_iteration", "learner_connector_timer")


# ---------------------------------------------------------------------------------------------------- environments
def atari_like_env_class() -> type:
    import gymnasium as gym

    class AtariLike(gym.Env):
        """uint8[4, 84, 84] observations cycled from a fixed pool, 4 actions, episodes of 200-400 steps."""

        metadata: dict[str, Any] = {}

        def __init__(self, config: Any = None) -> None:
            self.observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
            self.action_space = gym.spaces.Discrete(4)
            rng = np.random.default_rng(0)
            self._pool = rng.integers(0, 256, (64, 4, 84, 84), dtype=np.uint8)
            self._rng = rng
            self._t = 0
            self._len = 200

        def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
            if seed is not None:
                self._rng = np.random.default_rng(seed)
            self._t = 0
            self._len = int(self._rng.integers(200, 400))
            return self._pool[0].copy(), {}

        def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
            self._t += 1
            obs = self._pool[self._t % len(self._pool)].copy()
            reward = float(int(action) == self._t % 4)
            return obs, reward, self._t >= self._len, False, {}

    return AtariLike


def _float_obs_module() -> type:
    """RLlib's default DQN torch module, casting uint8 observations to float in [0, 1] (RLlib's CNN does not)."""
    from ray.rllib.algorithms.dqn.torch.default_dqn_torch_rl_module import DefaultDQNTorchRLModule
    from ray.rllib.core.columns import Columns

    class FloatObsDQNTorchRLModule(DefaultDQNTorchRLModule):
        def _qf_forward_helper(self, batch: Any, encoder: Any, head: Any) -> Any:
            obs = batch[Columns.OBS]
            if not obs.is_floating_point():
                batch = {**batch, Columns.OBS: obs.float() / 255.0}
            return super()._qf_forward_helper(batch, encoder, head)

    return FloatObsDQNTorchRLModule


# ---------------------------------------------------------------------------------------------------- timed buffers
def timed(cls: type) -> type:
    """A subclass of a buffer class whose add/sample/update_priorities calls are timed as the algorithm sees them."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.bench_spans: dict[str, float] = {"add": 0.0, "sample": 0.0, "update_priorities": 0.0}

        def add(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().add(*args, **kwargs)
            finally:
                self.bench_spans["add"] += time.perf_counter() - t0

        def sample(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().sample(*args, **kwargs)
            finally:
                self.bench_spans["sample"] += time.perf_counter() - t0

        def get_metrics(self, *args: Any, **kwargs: Any) -> Any:  # inside RLlib's sampling timer: count it there
            t0 = time.perf_counter()
            try:
                return super().get_metrics(*args, **kwargs)
            finally:
                self.bench_spans["sample"] += time.perf_counter() - t0

        def update_priorities(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().update_priorities(*args, **kwargs)
            finally:
                self.bench_spans["update_priorities"] += time.perf_counter() - t0

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


def _timed_classes() -> dict[str, type]:
    """The timed buffer classes, at module level: RLlib's DQN takes a buffer `type` only as an import path."""
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    from arrowbuf.rllib import ArrowbufEpisodeReplayBuffer, ArrowbufPrioritizedEpisodeReplayBuffer

    out = {}
    for cls in (EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, ArrowbufEpisodeReplayBuffer,
                ArrowbufPrioritizedEpisodeReplayBuffer):
        t = timed(cls)
        t.__module__ = __name__
        out[t.__name__] = t
    return out


globals().update(_timed_classes())


def buffer_config(mode: str, prioritized: bool, capacity: int) -> dict[str, Any]:
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    from arrowbuf.rllib import ArrowbufEpisodeReplayBuffer, ArrowbufPrioritizedEpisodeReplayBuffer

    if mode == "rllib":
        cls = PrioritizedEpisodeReplayBuffer if prioritized else EpisodeReplayBuffer
        cfg: dict[str, Any] = {"capacity": capacity}
        if prioritized:
            cfg.update(alpha=0.6, beta=0.4)
    else:
        cls = ArrowbufPrioritizedEpisodeReplayBuffer if prioritized else ArrowbufEpisodeReplayBuffer
        cfg = {"capacity": capacity, "seed": 0}
        if prioritized:
            cfg.update(alpha=0.6, beta=0.4)
        if mode == "ab-sched":
            cfg.update(schedule=True, prefetch=1, max_pending_adds=2)
    cfg["type"] = f"{__name__}.Timed{cls.__name__}"
    return cfg


def dqn_config(env: str, buffer: dict[str, Any], seed: int, device: str, batch: int = BATCH,
               intensity: float | None = None) -> Any:
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (DQNConfig()
              .env_runners(num_env_runners=0, rollout_fragment_length=FRAGMENT)
              .learners(num_learners=0, num_gpus_per_learner=1 if device == "cuda" else 0)
              .reporting(min_sample_timesteps_per_iteration=FRAGMENT, min_time_s_per_iteration=0)
              .debugging(seed=seed)
              .training(replay_buffer_config=buffer, num_steps_sampled_before_learning_starts=256,
                        train_batch_size=batch, target_network_update_freq=500, training_intensity=intensity))
    if env == "atari":
        from ray.rllib.core.rl_module.rl_module import RLModuleSpec

        config = config.environment(atari_like_env_class()).rl_module(rl_module_spec=RLModuleSpec(
            module_class=_float_obs_module(), model_config=DefaultModelConfig(
                conv_filters=[[16, [4, 4], 4]], head_fcnet_hiddens=[64])))
    else:
        config = config.environment("CartPole-v1")
    return config


# ---------------------------------------------------------------------------------------------------- one run
def run_one(env: str, mode: str, prioritized: bool, iters: int, seed: int, device: str,
            batch: int = BATCH, intensity: float | None = None) -> dict[str, Any]:
    capacity = 20_000 if env == "atari" else 50_000
    algo = dqn_config(env, buffer_config(mode, prioritized, capacity), seed, device, batch, intensity).build_algo()
    from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights

    store_w, train_w = calculate_rr_weights(algo.config)
    # how many values each timer gets per iteration (one per call); the EMA is inverted for k equal values
    per_it = {t: (store_w if t in ("replay_buffer_add_data_timer", "env_runner_sampling_timer") else
                  1 if t == "training_iteration" else train_w) for t in RLLIB_TIMERS}
    buf = algo.local_replay_buffer
    rows: list[dict[str, float]] = []
    prev: dict[str, float] = {}
    try:
        for i in range(WARMUP + iters):
            for k in buf.bench_spans:
                buf.bench_spans[k] = 0.0
            t0 = time.perf_counter()
            result = algo.train()
            it = time.perf_counter() - t0
            timers = {k: float(v) for k, v in result.get("timers", {}).items()}
            conn = result.get("learners", {}).get("__all_modules__", {}).get("learner_connector", {})
            if "connector_pipeline_timer" in conn:  # RLlib's episodes-to-batch conversion inside the learner update
                timers["learner_connector_timer"] = float(conn["connector_pipeline_timer"])
            # RLlib's timers are EMAs (coefficient 0.01, one value per iteration here): this iteration's own value
            own = {t: per_it[t] * (timers[t] - (1 - EMA) ** per_it[t] * prev[t]) / (1 - (1 - EMA) ** per_it[t])
                   for t in RLLIB_TIMERS if t in timers and t in prev}  # per iteration: k calls x their mean
            prev = timers
            if i < WARMUP:
                continue
            spans = dict(buf.bench_spans)
            row = {"iteration_s": it, "exposed_s": sum(spans.values()), **{f"{k}_s": v for k, v in spans.items()},
                   **{f"rllib_{t}": v for t, v in own.items()}}
            ab = result.get("replay_buffer", {}).get("arrowbuf")
            if ab:
                row.update({f"ab_{k}": float(v) for k, v in ab.items()})
            rows.append(row)
        ret = result.get("env_runners", {}).get("episode_return_mean")
    finally:
        algo.stop()
        close = getattr(buf, "close", None)
        if close is not None:
            close()
    return {"env": env, "mode": mode, "prioritized": prioritized, "seed": seed, "batch": batch, "rows": rows,
            "timers": prev, "return_mean": ret}


def _stats(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    return float(np.median(a)), float(np.percentile(a, 99))


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["env"], r["prioritized"], r["mode"]) for r in runs}, key=lambda k: (k[0], k[1],
                                                                                           MODES.index(k[2])))
    for env, pri, mode in keys:
        rs = [r for r in runs if (r["env"], r["prioritized"], r["mode"]) == (env, pri, mode)]
        rows = [row for r in rs for row in r["rows"]]
        ex50, ex99 = _stats([row["exposed_s"] for row in rows])
        it50, it99 = _stats([row["iteration_s"] for row in rows])
        s = {"env": env, "prioritized": pri, "mode": mode, "iterations": len(rows),
             "exposed_p50_ms": ex50 * 1e3, "exposed_p99_ms": ex99 * 1e3,
             "iteration_p50_ms": it50 * 1e3, "iteration_p99_ms": it99 * 1e3}
        for k in ("add_s", "sample_s", "update_priorities_s"):
            s[f"{k[:-2]}_p50_ms"] = _stats([row[k] for row in rows])[0] * 1e3
        # RLlib's own timers, per iteration (un-EMA'd), median: the cross-check
        for t in RLLIB_TIMERS:
            vals = [row[f"rllib_{t}"] for row in rows if f"rllib_{t}" in row]
            if vals:
                s[f"rllib_{t}_ms"] = _stats(vals)[0] * 1e3
        if rows and "ab_wait_for_batch_s" in rows[0]:
            for k in ("wait_for_batch_s", "blocking_add_s", "conversion_s", "background_conversion_s",
                      "background_commit_s", "path_s", "hidden_fraction"):
                v = _stats([row[f"ab_{k}"] for row in rows])[0]
                s[f"ab_{k}_p50" if k == "hidden_fraction" else f"ab_{k[:-2]}_p50_ms"] = v if k == "hidden_fraction" \
                    else v * 1e3
        out.append(s)
    # ratios against RLlib's own buffer of the same kind
    for s in out:
        base = next((b for b in out if b["env"] == s["env"] and b["prioritized"] == s["prioritized"]
                     and b["mode"] == "rllib"), None)
        if base is not None:
            s["exposed_vs_rllib"] = s["exposed_p50_ms"] / base["exposed_p50_ms"] if base["exposed_p50_ms"] else None
            s["iteration_vs_rllib"] = s["iteration_p50_ms"] / base["iteration_p50_ms"]
    return out


def table(summary: list[dict[str, Any]]) -> str:
    head = ("| env | buffer | mode | exposed p50 ms | exposed p99 ms | vs RLlib | iteration p50 ms | iteration p99 ms "
            "| vs RLlib | add / sample / prios p50 ms | RLlib timers add / sample / prios ms |")
    lines = [head, "|" + "---|" * head.count("|")[:-1] if False else "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        def f(x: Any, spec: str = ".2f") -> str:
            return "-" if x is None else format(x, spec)
        lines.append(
            f"| {s['env']} | {'prioritized' if s['prioritized'] else 'uniform'} | {s['mode']} | "
            f"{f(s['exposed_p50_ms'])} | {f(s['exposed_p99_ms'])} | {f(s.get('exposed_vs_rllib'), '.0%')} | "
            f"{f(s['iteration_p50_ms'], '.1f')} | {f(s['iteration_p99_ms'], '.1f')} | "
            f"{f(s.get('iteration_vs_rllib'), '.0%')} | {f(s['add_p50_ms'])} / {f(s['sample_p50_ms'])} / "
            f"{f(s['update_priorities_p50_ms'])} | {f(s.get('rllib_replay_buffer_add_data_timer_ms'))} / "
            f"{f(s.get('rllib_replay_buffer_sampling_timer_ms'))} / "
            f"{f(s.get('rllib_replay_buffer_update_prios_timer_ms'))} |")
    return "\n".join(lines)


def breakdown(summary: list[dict[str, Any]]) -> str:
    """Where an iteration's time goes (RLlib's timers, per iteration, medians) and the path's share of it."""
    lines = ["| env | buffer | mode | iteration ms | env sampling ms | learner update ms (of it: learner connector) | "
             "exposed path ms | path share | arrowbuf: wait / blocking add / conversion / background conversion ms | "
             "hidden |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        def f(x: Any, spec: str = ".2f") -> str:
            return "-" if x is None else format(x, spec)
        ab = (f"{f(s.get('ab_wait_for_batch_p50_ms'))} / {f(s.get('ab_blocking_add_p50_ms'))} / "
              f"{f(s.get('ab_conversion_p50_ms'))} / {f(s.get('ab_background_conversion_p50_ms'))}"
              if "ab_wait_for_batch_p50_ms" in s else "-")
        lines.append(f"| {s['env']} | {'prioritized' if s['prioritized'] else 'uniform'} | {s['mode']} | "
                     f"{f(s['iteration_p50_ms'], '.1f')} | {f(s.get('rllib_env_runner_sampling_timer_ms'), '.1f')} | "
                     f"{f(s.get('rllib_learner_update_timer_ms'), '.1f')} "
                     f"({f(s.get('rllib_learner_connector_timer_ms'), '.1f')}) | {f(s['exposed_p50_ms'])} | "
                     f"{f(s['exposed_p50_ms'] / s['iteration_p50_ms'], '.1%')} | {ab} | "
                     f"{f(s.get('ab_hidden_fraction_p50'), '.0%')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- convergence
def convergence(seeds: int, steps: int) -> dict[str, Any]:
    curves: dict[str, list[list[tuple[int, float]]]] = {"rllib": [], "ab-sched": []}
    for seed in range(seeds):
        for mode in curves:
            cfg = dqn_config("cartpole", buffer_config(mode, True, 50_000), seed, "cpu")
            cfg = cfg.reporting(min_sample_timesteps_per_iteration=500).training(
                epsilon=[(0, 1.0), (2000, 0.02)], training_intensity=8)  # ~1 update per 4 env steps
            algo = cfg.build_algo()
            buf = algo.local_replay_buffer
            curve = []
            try:
                done = 0
                while done < steps:
                    r = algo.train()
                    done = int(r["env_runners"]["num_env_steps_sampled_lifetime"])
                    ret = r["env_runners"].get("episode_return_mean")
                    if ret is not None and np.isfinite(ret):
                        curve.append((done, float(ret)))
            finally:
                algo.stop()
                if hasattr(buf, "close"):
                    buf.close()
            curves[mode].append(curve)
            print(f"seed {seed} {mode}: final return {curve[-1][1] if curve else float('nan'):.1f}", flush=True)
    return {"seeds": seeds, "steps": steps, "curves": curves}


def plot_convergence(data: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = {"rllib": "RLlib PrioritizedEpisodeReplayBuffer", "ab-sched": "arrowbuf scheduled (prioritized)"}
    for mode, color in (("rllib", "tab:blue"), ("ab-sched", "tab:orange")):
        for i, curve in enumerate(data["curves"][mode]):
            if curve:
                x, y = zip(*curve)
                ax.plot(x, y, color=color, alpha=0.8, label=names[mode] if i == 0 else None)
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return (mean of recent)")
    ax.set_title(f"DQN CartPole-v1, {data['seeds']} seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", choices=("cartpole", "atari", "both"), default="both")
    ap.add_argument("--iters", type=int, default=120, help="measured iterations per run (after a warm-up)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--buffers", nargs="+", default=["prioritized", "uniform"], choices=("prioritized", "uniform"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", type=int, default=BATCH, help="DQN train_batch_size")
    ap.add_argument("--intensity", type=float, default=None,
                    help="DQN training_intensity (replayed steps per env step / native ratio): updates per iteration")
    ap.add_argument("--convergence", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--quick", action="store_true", help="a smoke run: CartPole, 20 iterations, one repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.env, args.iters, args.repeats, args.buffers = "cartpole", 20, 1, ["prioritized"]

    import ray
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        if args.convergence:
            data = convergence(args.seeds, args.steps)
            (OUT / "rllib_convergence.json").write_text(json.dumps(data))
            plot_convergence(data, ROOT / "docs" / "img" / "rllib_convergence.png")
            print(f"wrote {OUT / 'rllib_convergence.json'} and docs/img/rllib_convergence.png")
            return 0
        envs = ["cartpole", "atari"] if args.env == "both" else [args.env]
        for env in envs:
            runs = []
            for rep in range(args.repeats):
                for kind in args.buffers:
                    for mode in args.modes:  # modes alternate within a repeat: drift on a shared machine spreads
                        runs.append(run_one(env, mode, kind == "prioritized", args.iters, seed=rep,
                                            device=args.device, batch=args.batch, intensity=args.intensity))
                        print(f"  {env} {kind} {mode} repeat {rep}: done", file=sys.stderr, flush=True)
            summary = summarise(runs)
            print(f"\n## DQN {env} ({args.device}; {args.iters} iterations x {args.repeats} repeats, "
                  f"batch {args.batch}, fragment {FRAGMENT}, training_intensity {args.intensity})\n")
            print(table(summary))
            print()
            print(breakdown(summary))
            meta = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
                    "ray": ray.__version__, "torch": torch.__version__, "device": args.device,
                    "iters": args.iters, "repeats": args.repeats}
            suffix = (("" if args.device == "cpu" else f"_{args.device}") + ("" if args.batch == BATCH
                                                                           else f"_b{args.batch}")
                      + ("" if args.intensity is None else f"_i{args.intensity:g}"))
            (OUT / f"rllib_{env}{suffix}.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                                       "runs": runs}, indent=1))
            print(f"wrote {OUT / f'rllib_{env}{suffix}.json'}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
