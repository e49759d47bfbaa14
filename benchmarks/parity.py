"""Convergence parity: DQN on CartPole-v1 learns as well with arrowbuf as with a plain numpy ring buffer.

One synchronous DQN loop (the demo's `DQNConfig` and `DQNLearner`: double DQN, 3-step returns, uniform replay),
run with the same seeds and hyperparameters over four replay backends:

* numpy   a plain numpy ring buffer written for this comparison (n-step transitions built at insertion);
* local   `ab.ExperienceStore` in process (n-step returns computed at sample time);
* shm     the same store in shared memory (`tier="shm"`);
* flight  the store served over Arrow Flight: steps go in with `ab.connect(...).extend`, batches come out of an
          `ab.Loader` over the client (prefetching, so a batch can be up to `prefetch` batches older).

Learning curves (mean return of the last 10 training episodes against environment steps, mean and spread over
seeds), a greedy evaluation at the end, and a table go to `--out` (default benchmarks/out/):
parity.png, parity.json, parity.md.

    python -m benchmarks.parity [--seeds 5] [--steps 10000] [--backends numpy local shm flight] [--jobs 2]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import pathlib
import platform
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
BACKENDS = ("numpy", "local", "shm", "flight")
EVAL_EPISODES = 10
STYLES = {"numpy": "-", "local": "--", "shm": ":", "flight": "-"}  # local and shm coincide run for run (same seed)


# ---------------------------------------------------------------------------------------------------------- numpy
class NStepAdder:
    """Turns a stream of steps into n-step transitions (obs, action, return, discount, bootstrap obs)."""

    def __init__(self, n: int, gamma: float) -> None:
        self.n, self.gamma = n, gamma
        self.window: collections.deque[tuple[np.ndarray, int, float]] = collections.deque()

    def step(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, terminated: bool,
             truncated: bool) -> list[tuple[np.ndarray, int, float, float, np.ndarray]]:
        self.window.append((obs, action, reward))
        out = []
        if len(self.window) == self.n:
            out.append(self._emit(next_obs, terminated))
            self.window.popleft()
        if terminated or truncated:  # the episode's last windows are shorter
            while self.window:
                out.append(self._emit(next_obs, terminated))
                self.window.popleft()
        return out

    def _emit(self, next_obs: np.ndarray, terminated: bool) -> tuple[np.ndarray, int, float, float, np.ndarray]:
        ret = sum(self.gamma ** j * r for j, (_, _, r) in enumerate(self.window))
        discount = 0.0 if terminated else self.gamma ** len(self.window)
        obs, action, _ = self.window[0]
        return obs, action, ret, discount, next_obs


class NumpyRingBuffer:
    """A plain ring buffer of n-step transitions in preallocated numpy arrays; uniform sampling with replacement."""

    def __init__(self, capacity: int, obs_dim: int, seed: int) -> None:
        self.obs = np.zeros((capacity, obs_dim), np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), np.float32)
        self.action = np.zeros(capacity, np.int64)
        self.ret = np.zeros(capacity, np.float32)
        self.discount = np.zeros(capacity, np.float32)
        self.capacity, self.size, self.pos = capacity, 0, 0
        self.rng = np.random.default_rng(seed)

    def add(self, obs: np.ndarray, action: int, ret: float, discount: float, next_obs: np.ndarray) -> None:
        i = self.pos
        self.obs[i], self.action[i], self.ret[i], self.discount[i], self.next_obs[i] = (
            obs, action, ret, discount, next_obs)
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, n: int) -> dict[str, np.ndarray]:
        idx = self.rng.integers(0, self.size, n)
        return {"obs": self.obs[idx], "action": self.action[idx], "n_step_return": self.ret[idx],
                "n_step_discount": self.discount[idx], "n_step_next_obs": self.next_obs[idx]}


# ---------------------------------------------------------------------------------------------------------- backends
class NumpyBackend:
    def __init__(self, cfg: Any, capacity: int, seed: int) -> None:
        self.buf = NumpyRingBuffer(capacity, 4, seed)
        self.adder = NStepAdder(cfg.n_step, cfg.gamma)
        self.batch_size = cfg.batch_size

    def add(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, term: bool, trunc: bool) -> None:
        for tr in self.adder.step(obs, action, reward, next_obs, term, trunc):
            self.buf.add(*tr)

    def __len__(self) -> int:
        return self.buf.size

    def batch(self) -> dict[str, np.ndarray]:
        return self.buf.sample(self.batch_size)

    def close(self) -> None:
        pass


class ArrowbufBackend:
    """Steps are buffered and written with one `extend` before each gradient step and at each episode end."""

    def __init__(self, cfg: Any, capacity: int, seed: int, kind: str) -> None:
        import arrowbuf as ab
        from arrowbuf.demo import LEARNER_COLUMNS, cartpole_schema

        self.cfg, self.kind = cfg, kind
        extra: dict[str, Any] = {"tier": "shm", "name": f"parity-{os.getpid()}-{seed}"} if kind == "shm" else {}
        self.store = ab.ExperienceStore(cartpole_schema(), capacity=capacity, seed=seed, **extra)
        self.server = self.client = self.loader = None
        self.writer: Any = self.store
        if kind == "flight":
            self.server = ab.serve(self.store, "grpc://127.0.0.1:0")
            self.client = ab.connect(self.server.location)
            self.writer = self.client
        self.columns = LEARNER_COLUMNS
        self.pending: dict[str, list[Any]] = collections.defaultdict(list)

    def add(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, term: bool, trunc: bool) -> None:
        p = self.pending
        for k, v in (("obs", obs), ("action", action), ("reward", reward), ("terminated", term),
                     ("truncated", trunc), ("next_obs", next_obs), ("policy_version", 0)):
            p[k].append(v)
        if term or trunc:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        p = self.pending
        self.writer.extend({"obs": np.asarray(p["obs"], np.float32), "action": np.asarray(p["action"], np.int64),
                            "reward": np.asarray(p["reward"], np.float32),
                            "terminated": np.asarray(p["terminated"], bool),
                            "truncated": np.asarray(p["truncated"], bool),
                            "next_obs": np.asarray(p["next_obs"], np.float32),
                            "policy_version": np.asarray(p["policy_version"], np.int64)})
        self.pending = collections.defaultdict(list)

    def __len__(self) -> int:
        return len(self.store) + len(self.pending.get("obs", ()))

    def batch(self) -> dict[str, np.ndarray]:
        import arrowbuf as ab

        self.flush()
        if self.kind == "flight":
            if self.loader is None:
                self.loader = ab.Loader(self.client, batch_size=self.cfg.batch_size, prefetch=2,
                                        columns=self.columns, n_step=self.cfg.n_step, gamma=self.cfg.gamma)
            return next(self.loader).to_numpy()
        return self.store.sample(self.cfg.batch_size, columns=self.columns, n_step=self.cfg.n_step,
                                 gamma=self.cfg.gamma).to_numpy()

    def close(self) -> None:
        for part in (self.loader, self.client, self.server):
            if part is not None:
                part.close()
        self.store.close()
        if self.kind == "shm":
            try:
                self.store.unlink()
            except Exception:
                pass


def make_backend(kind: str, cfg: Any, capacity: int, seed: int) -> Any:
    if kind == "numpy":
        return NumpyBackend(cfg, capacity, seed)
    if kind in ("local", "shm", "flight"):
        return ArrowbufBackend(cfg, capacity, seed, kind)
    raise ValueError(f"unknown backend {kind!r}; expected one of {BACKENDS}")


# ---------------------------------------------------------------------------------------------------------- one run
def run_one(kind: str, seed: int, steps: int, cfg_overrides: dict[str, Any],
            eval_episodes: int = EVAL_EPISODES) -> dict[str, Any]:
    """One DQN run: `steps` environment steps with backend `kind`; returns episodes, evaluation and timings."""
    import torch

    from arrowbuf.demo import DQNConfig, DQNLearner, epsilon_at, make_env

    torch.set_num_threads(1)
    cfg = DQNConfig(**cfg_overrides)
    learner = DQNLearner(cfg, seed=seed)
    act = learner.greedy()
    rng = np.random.default_rng(seed)
    env = make_env(seed)
    backend = make_backend(kind, cfg, capacity=steps + 1000, seed=seed)
    episodes: list[tuple[int, float]] = []  # (env step at the end, return)
    t0 = time.perf_counter()
    train_s = 0.0
    try:
        obs, _ = env.reset(seed=seed)
        ep_ret = 0.0
        for t in range(steps):
            eps = epsilon_at(cfg, t / steps)
            action = int(rng.integers(2)) if rng.random() < eps else act(obs)
            nxt, reward, term, trunc, _ = env.step(action)
            backend.add(obs, action, float(reward), nxt, bool(term), bool(trunc))
            ep_ret += float(reward)
            if term or trunc:
                episodes.append((t + 1, ep_ret))
                ep_ret = 0.0
                obs, _ = env.reset()
            else:
                obs = nxt
            if t % cfg.train_every == 0 and t >= cfg.warmup and len(backend) >= cfg.batch_size:
                t1 = time.perf_counter()
                learner.train(backend.batch())
                train_s += time.perf_counter() - t1
        wall = time.perf_counter() - t0
    finally:
        backend.close()
        env.close()
    evals = []
    for i in range(eval_episodes):
        e = make_env(10_000 + i)
        o, _ = e.reset(seed=10_000 + i)
        ret, done = 0.0, False
        while not done:
            o, r, te, tr, _ = e.step(act(o))
            ret += float(r)
            done = te or tr
        evals.append(ret)
        e.close()
    return {"backend": kind, "seed": seed, "steps": steps, "episodes": episodes, "eval": evals,
            "updates": learner.updates, "wall_s": wall, "train_loop_s": train_s}


def curve(episodes: list[tuple[int, float]], grid: np.ndarray, window: int = 10) -> np.ndarray:
    """Mean return of the last `window` episodes finished by each grid step (nan before the first)."""
    ends = np.array([e[0] for e in episodes]) if episodes else np.zeros(0)
    rets = np.array([e[1] for e in episodes]) if episodes else np.zeros(0)
    out = np.full(len(grid), np.nan)
    for i, g in enumerate(grid):
        k = int(np.searchsorted(ends, g, side="right"))
        if k:
            out[i] = rets[max(0, k - window):k].mean()
    return out


# ---------------------------------------------------------------------------------------------------------- report
def summarise(runs: list[dict[str, Any]], backends: list[str]) -> list[dict[str, Any]]:
    rows = []
    for b in backends:
        rs = [r for r in runs if r["backend"] == b]
        if not rs:
            continue
        last20 = [np.mean([e[1] for e in r["episodes"][-20:]]) if r["episodes"] else np.nan for r in rs]
        auc = [np.mean([e[1] for e in r["episodes"]]) if r["episodes"] else np.nan for r in rs]
        ev = [np.mean(r["eval"]) for r in rs]
        rows.append({
            "backend": b, "seeds": len(rs),
            "last20_mean": float(np.mean(last20)), "last20_std": float(np.std(last20)),
            "eval_mean": float(np.mean(ev)), "eval_std": float(np.std(ev)),
            "train_return_mean": float(np.mean(auc)), "train_return_std": float(np.std(auc)),
            "wall_s": float(np.mean([r["wall_s"] for r in rs])),
            "updates_per_s": float(np.mean([r["updates"] / r["wall_s"] for r in rs])),
        })
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    lines = [
        "# DQN convergence parity (CartPole-v1)",
        "",
        f"{args.seeds} seeds x {args.steps} environment steps per backend; double DQN, 3-step returns, uniform "
        "replay, the same seeds and hyperparameters for every backend (`arrowbuf.demo.DQNConfig`). "
        f"Mean +- std over seeds. Greedy evaluation: {args.eval_episodes} episodes after training. "
        f"Machine: {meta['machine']}; Python {meta['python']}, torch {meta['torch']}, gymnasium {meta['gymnasium']}.",
        "",
        "| backend | seeds | return, last 20 training episodes | greedy eval return | mean training return "
        "| wall s/run | updates/s | last-20 ratio to numpy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = next((r for r in rows if r["backend"] == "numpy"), None)
    for r in rows:
        ratio = f"{r['last20_mean'] / base['last20_mean']:.2f}" if base and base["last20_mean"] else "-"
        lines.append(
            f"| {r['backend']} | {r['seeds']} | {r['last20_mean']:.1f} +- {r['last20_std']:.1f} "
            f"| {r['eval_mean']:.1f} +- {r['eval_std']:.1f} | {r['train_return_mean']:.1f} +- "
            f"{r['train_return_std']:.1f} | {r['wall_s']:.1f} | {r['updates_per_s']:.0f} | {ratio} |")
    lines += ["", f"Runs went {args.jobs} at a time (0: one after another in one process); wall s/run and updates/s "
              "include that sharing and any other load on the machine: they are not a speed benchmark. `local` and "
              "`shm` run the same store code with the same seed, so their runs coincide batch for batch.",
              "", "Curves: parity.png (mean of the last 10 training episodes against environment steps; band = "
              "min..max over seeds, line = mean).", ""]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], backends: list[str], steps: int, path: pathlib.Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    grid = np.linspace(0, steps, 101)[1:]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, b in enumerate(backends):
        rs = [r for r in runs if r["backend"] == b]
        if not rs:
            continue
        cs = np.array([curve(r["episodes"], grid) for r in rs])
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, lo, hi = np.nanmean(cs, 0), np.nanmin(cs, 0), np.nanmax(cs, 0)
        ax.plot(grid, mean, color=f"C{i}", lw=2, ls=STYLES.get(b, "-"), label=f"{b} ({len(rs)} seeds)")
        ax.fill_between(grid, lo, hi, color=f"C{i}", alpha=0.15)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("return (mean of last 10 episodes)")
    ax.set_title("DQN on CartPole-v1: replay backend parity")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parity", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10_000, help="environment steps per run")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="runs in parallel (worker processes); 0: all in this process")
    p.add_argument("--warmup", type=int, default=None, help="steps before the first gradient step")
    p.add_argument("--eval-episodes", type=int, default=EVAL_EPISODES, help="greedy episodes after training")
    p.add_argument("--out", default=os.environ.get("ARROWBUF_BENCH_OUT", str(OUT)))
    p.add_argument("--replot", action="store_true", help="redraw parity.png and parity.md from parity.json")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((out / "parity.json").read_text())
        for k, v in saved["args"].items():
            if k not in ("out", "replot"):
                setattr(args, k, v)
        md = markdown(saved["rows"], args, saved["meta"])
        (out / "parity.md").write_text(md)
        print(md)
        print(plot(saved["runs"], args.backends, args.steps, out / "parity.png"))
        return 0
    overrides: dict[str, Any] = {}
    if args.warmup is not None:
        overrides["warmup"] = args.warmup
    jobs = [(b, s) for s in range(args.seeds) for b in args.backends]
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    print(f"parity: {len(jobs)} runs ({args.seeds} seeds x {args.backends}), {args.steps} steps each, "
          f"{args.jobs} at a time", flush=True)

    def report(r: dict[str, Any]) -> None:
        runs.append(r)
        last = np.mean([e[1] for e in r["episodes"][-20:]]) if r["episodes"] else float("nan")
        print(f"  {r['backend']:>6} seed {r['seed']}: last-20 return {last:6.1f}, greedy eval "
              f"{np.mean(r['eval']):6.1f}, {r['updates']} updates in {r['wall_s']:.1f}s", flush=True)

    from arrowbuf.observe.meter import ProgressMeter

    # runs take minutes each: a bar (a terminal) or a line every 2 s says how far the whole is
    with ProgressMeter(len(jobs), "parity", "run") as bar:
        if args.jobs <= 0:  # in this process, one after another (no worker start-up: quick checks)
            for b, s in jobs:
                bar.note(f"running {b} seed {s}")
                report(run_one(b, s, args.steps, overrides, args.eval_episodes))
                bar.update(1)
        else:
            with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
                futs = [pool.submit(run_one, b, s, args.steps, overrides, args.eval_episodes) for b, s in jobs]
                for f in cf.as_completed(futs):
                    report(f.result())
                    bar.update(1)
    runs.sort(key=lambda r: (BACKENDS.index(r["backend"]), r["seed"]))
    import gymnasium
    import torch

    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
            "torch": torch.__version__, "gymnasium": gymnasium.__version__,
            "total_s": round(time.perf_counter() - t0, 1)}
    rows = summarise(runs, args.backends)
    md = markdown(rows, args, meta)
    (out / "parity.md").write_text(md)
    (out / "parity.json").write_text(json.dumps({"meta": meta, "args": vars(args), "rows": rows, "runs": runs}))
    png = plot(runs, args.backends, args.steps, out / "parity.png")
    print()
    print(md)
    print(f"wrote {out / 'parity.md'}, {out / 'parity.json'}" + (f", {png}" if png else "")
          + f" in {meta['total_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
