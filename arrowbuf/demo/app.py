"""The demo's run: the store, the actor processes, the learner loop, the summary and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import pathlib
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ArrowbufError, InvalidArgument, SampleTimeout, require
from .actors import ActorSpec, PolicyFile, actor_main
from .dqn import DQNConfig, DQNLearner
from .entry import demos_epilog, run_cli, start_quietly

#: What the learner reads per batch (the n-step columns come with `n_step=`).
LEARNER_COLUMNS = ["obs", "action", "next_obs"]
TRANSPORTS = ("flight", "shm", "local")
#: Below this many environment steps a run cannot show DQN learning CartPole (the summary says so).
SHORT_RUN_STEPS = 10_000
_DESCRIPTION = "The end-to-end demo: distributed DQN on CartPole-v1 with arrowbuf in the middle."


def cartpole_schema() -> Any:
    from ..schema import load_schema

    return load_schema("cartpole")  # schemas/cartpole.yaml, shipped inside the package


# ---------------------------------------------------------------------------------------------------------- transports
def _check_transport(transport: str) -> None:
    """Fail early, naming the cause, when the asked transport cannot work here (never fall back silently: a demo
    that quietly runs in-process hides a broken Flight or shared-memory build)."""
    if transport == "flight":
        try:
            import pyarrow.flight  # noqa: F401 - arrowbuf.flight imports it lazily
        except ImportError as exc:
            raise ArrowbufError(f"--transport flight needs Arrow Flight (pyarrow.flight): {exc}; install a pyarrow "
                                "with Flight, or run with --transport local") from exc
    elif transport == "shm":
        from ..tiers.shm import shm_root

        if not os.path.isdir(shm_root()):
            raise ArrowbufError(f"--transport shm needs a shared-memory folder ({shm_root()} does not exist); "
                                "run with --transport local")


# ---------------------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class DemoResult:
    transport: str
    episodes: list[dict[str, Any]]          # actor, return, length, t (seconds since start), policy_version
    updates: int
    steps: int
    wall_s: float
    summary: Any                            # pa.Table from store.sql
    loader_summary: str
    learner_s: dict[str, float]             # learner loop time: wait_s (next(loader)), train_s, other_s
    plot: str | None
    first20: float
    last20: float


def run(actors: int = 3, steps: int = 15_000, transport: str = "flight", seed: int = 0,
        out: str | os.PathLike[str] = "demo_out", cfg: DQNConfig | None = None, capacity: int | None = None,
        progress: bool = True, log: Callable[[str], None] = print) -> DemoResult:
    """Run the demo and return what it measured (see the module docstring). `progress`: a bar on a terminal, a
    line every 2 s otherwise (`arrowbuf.observe.meter`), from the start (imports, actors starting) to the plot."""
    from ..observe.meter import ProgressMeter

    with ProgressMeter(steps, "dqn", "step", enabled=progress) as bar:
        bar.note("starting: importing torch and gymnasium")
        return _run(actors, steps, transport, seed, out, cfg, capacity, bar, log)


def _run(actors: int, steps: int, transport: str, seed: int, out: str | os.PathLike[str], cfg: DQNConfig | None,
         capacity: int | None, bar: Any, log: Callable[[str], None]) -> DemoResult:
    torch = require("torch", "demo")
    require("gymnasium", "demo")
    from .. import rate_limiters, samplers
    from ..delivery.loader import Loader
    from ..store.facade import ExperienceStore

    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if actors < 1 or steps < 1:
        raise InvalidArgument("--actors and --steps must be >= 1")
    cfg = cfg or DQNConfig()
    torch.set_num_threads(1)
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    t_start = time.time()

    _check_transport(transport)
    sampler = samplers.Prioritized(alpha=cfg.alpha, beta=cfg.beta)

    per_actor = [steps // actors + (1 if i < steps % actors else 0) for i in range(actors)]
    capacity = capacity or max(steps + 1_000, 2 * cfg.warmup)
    spi = cfg.batch_size / cfg.train_every
    flush = 32
    limiter = rate_limiters.SampleToInsertRatio(
        samples_per_insert=spi, min_size=cfg.warmup,
        error_buffer=max(spi * flush * actors * 2, cfg.batch_size * 8.0))
    kwargs: dict[str, Any] = {"tier": "shm", "name": f"demo-{os.getpid()}"} if transport == "shm" else {}
    store = ExperienceStore(cartpole_schema(), capacity=capacity, sampler=sampler, rate_limiter=limiter, seed=seed,
                            **kwargs)
    try:  # whatever happens, the store is closed and a shared one removed
        policy_file = PolicyFile(out_dir / "policy.pt")
        learner = DQNLearner(cfg, seed=seed)
        version = 0
        policy_file.publish(learner.q.state_dict(), version)

        server = None
        workers: list[Any] = []
        events: Any = ctx.Queue() if transport != "local" else queue_mod.Queue()
        stop: Any = ctx.Event() if transport != "local" else threading.Event()
        loader = None
        client = None
        episodes: list[dict[str, Any]] = []
        done: set[int] = set()
        timing = {"wait_s": 0.0, "train_s": 0.0, "other_s": 0.0}  # the learner loop's time: batches, gradients, rest
        try:
            if transport == "flight":
                from ..flight import connect, serve

                server = serve(store, "grpc://127.0.0.1:0")
                address = server.location
                client = connect(address)
                source: Any = client
                log(f"store served over Arrow Flight at {address}; {actors} actor processes; learner reads through "
                    f"ab.Loader over Flight")
            elif transport == "shm":
                address = store.name
                source = store
                log(f"store in shared memory ({address!r}); {actors} actor processes attach to it")
            else:
                address = ""
                source = store
                log(f"store in-process; {actors} actor threads")
            for i in range(actors):
                spec = ActorSpec(i, transport, address, per_actor[i], seed * 1000 + i, str(policy_file.path), cfg,
                                 flush=flush)
                if transport == "local":
                    w: Any = threading.Thread(target=actor_main, args=(spec, events, stop, store), daemon=True,
                                              name=f"actor-{i}")
                else:
                    w = ctx.Process(target=actor_main, args=(spec, events, stop), daemon=True, name=f"actor-{i}")
                start_quietly(w)
                workers.append(w)
            bar.note(f"{actors} actors starting (each imports torch and gymnasium)")

            loader = Loader(source, batch_size=cfg.batch_size, prefetch=2, columns=LEARNER_COLUMNS, timeout=0.25,
                            n_step=cfg.n_step, gamma=cfg.gamma)
            t_train = None
            learn_step = None  # environment steps stored when the first gradient step ran
            publish_every = 50

            def drain() -> None:
                while True:
                    try:
                        ev = events.get_nowait()
                    except queue_mod.Empty:
                        return
                    if ev[0] == "episode":
                        _, a, ret, length, t, v = ev
                        episodes.append({"actor": a, "return": ret, "length": length, "t": t - t_start,
                                         "policy_version": v})
                    elif ev[0] == "done":
                        done.add(ev[1])
                    elif ev[0] == "error":
                        raise ArrowbufError(f"actor {ev[1]} failed: {ev[2]}")

            last_ui = 0.0
            while True:
                drain()
                if len(done) == actors:
                    break
                if not any(w.is_alive() for w in workers):
                    drain()
                    if len(done) < actors:
                        raise ArrowbufError(f"actors {sorted(set(range(actors)) - done)} exited without finishing")
                    break
                t0 = time.perf_counter()
                try:
                    batch = next(loader)
                except SampleTimeout:
                    batch = None
                t1 = time.perf_counter()
                timing["wait_s"] += t1 - t0
                if batch is not None:
                    if t_train is None:
                        t_train = t0
                        learn_step = len(store)
                    td = learner.train(batch.to_numpy(), batch.weights)
                    t2 = time.perf_counter()
                    timing["train_s"] += t2 - t1
                    loader.update_priorities(batch, td + 1e-3)
                    if learner.updates % publish_every == 0:
                        version += 1
                        policy_file.publish(learner.q.state_dict(), version)
                    timing["other_s"] += time.perf_counter() - t2
                now = time.monotonic()
                if now - last_ui >= 0.5:
                    last_ui = now
                    recent = [e["return"] for e in episodes[-20:]]
                    m = loader.metrics
                    its = m.iterations
                    rate = (its * cfg.batch_size / (time.perf_counter() - t_train)) if t_train and its else 0.0
                    bar.update_to(len(store), **{
                        "episodes": len(episodes),
                        "return(last20)": f"{np.mean(recent):.1f}" if recent else "-",
                        "samples/s": f"{rate:,.0f}",
                        "exposed": f"{m.totals['exposed_s'] / its * 1e3:.2f}ms/it" if its else "-",
                        "policy": f"v{version}"})
            bar.update_to(len(store), episodes=len(episodes))
            bar.note("summary (store.sql)")
            wall = time.time() - t_start
            summary = _summary_sql(store)            # every actor is done: the buffer holds the whole run
            total_steps = len(store)
        finally:
            bar.note("stopping the actors")
            stop.set()
            if loader is not None:
                loader.close()
            for w in workers:
                w.join(5)
            for w in workers:
                if isinstance(w, mp.process.BaseProcess) and w.is_alive():
                    w.terminate()
                    w.join(5)
            if client is not None:
                client.close()
            if server is not None:
                server.close()
    finally:
        store.close()
        if transport == "shm":
            try:
                store.unlink()
            except Exception:
                pass
    episodes.sort(key=lambda e: e["t"])  # in the order they ended (the queue interleaves actors)
    rets = [e["return"] for e in episodes]
    first20 = float(np.mean(rets[:20])) if rets else float("nan")
    last20 = float(np.mean(rets[-20:])) if rets else float("nan")
    (out_dir / "episodes.json").write_text(json.dumps(episodes))
    plot = _plot(episodes, out_dir / "returns.png", f"DQN on CartPole-v1, {actors} actors, transport={transport}",
                 learn_step)
    return DemoResult(transport, episodes, learner.updates, total_steps, wall, summary,
                      loader.metrics.summary() if loader is not None else "", timing, plot, first20, last20)


def _summary_sql(store: Any) -> Any:
    """Episode returns by quarter of the run (in insert order), straight from the live buffer with DuckDB."""
    return store.sql(
        "WITH ep AS (SELECT episode_id, count(*) AS length, sum(reward) AS ret, min(seq) AS first_seq, "
        "bool_or(terminated OR truncated) AS complete FROM experience GROUP BY episode_id), "
        "q AS (SELECT *, ntile(4) OVER (ORDER BY first_seq) AS quarter FROM ep WHERE complete) "
        "SELECT quarter, count(*) AS episodes, round(avg(ret), 1) AS mean_return, max(ret) AS best_return, "
        "round(avg(length), 1) AS mean_length FROM q GROUP BY quarter ORDER BY quarter")


def _plot(episodes: list[dict[str, Any]], path: pathlib.Path, title: str,
          learn_step: int | None = None) -> str | None:
    """Write the returns plot (`returns_figure`) to `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = returns_figure(episodes, title, learn_step)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def returns_figure(episodes: list[dict[str, Any]], title: str, learn_step: int | None = None) -> Any:
    """Episode returns over environment steps (all actors; each episode at the steps done when it ended), with a
    20-episode mean and the first gradient step (`learn_step`: environment steps then). Steps, not wall time: a
    loaded machine stretches the start-up (processes, imports) without moving the episodes against each other."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    if episodes:
        ordered = sorted(episodes, key=lambda e: e["t"])
        x = np.cumsum([e["length"] for e in ordered])
        r = np.array([e["return"] for e in ordered])
        ax.scatter(x, r, s=6, alpha=0.35, label="episode return")
        k = min(20, len(r))
        ma = np.convolve(r, np.ones(k) / k, mode="valid")
        ax.plot(x[k - 1:], ma, color="C1", lw=2, label=f"mean of last {k}")
        ax.set_xlim(0, max(int(x[-1]), learn_step or 0) * 1.02)
    if learn_step is not None:
        ax.axvline(learn_step, color="grey", ls="--", lw=1, label="first gradient step")
    ax.set_xlabel("environment steps (all actors)")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the axes: never on a point
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's flags on `p` (also what `arrowbuf demo` registers: `configure_parser(sub.add_parser("demo"))`
    with `func=run_from_args`)."""
    p.add_argument("--actors", type=int, default=3, help="actor processes (threads with --transport local)")
    p.add_argument("--steps", type=int, default=15_000,
                   help="environment steps in all (split across actors; default 15000)")
    p.add_argument("--transport", choices=TRANSPORTS, default="flight",
                   help="how actors write: Arrow Flight (default), shared memory, or in-process threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments, sampling and the model (default 0)")
    p.add_argument("--out", default=os.environ.get("ARROWBUF_DEMO_OUT", "demo_out"),
                   help="folder for returns.png, episodes.json, policy.pt (default: $ARROWBUF_DEMO_OUT or demo_out)")
    p.add_argument("--warmup", type=int, default=None, help="rows stored before learning starts (default 1000)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    cfg = DQNConfig()
    if args.warmup is not None:
        cfg.warmup = args.warmup
    res = run(args.actors, args.steps, args.transport, args.seed, args.out, cfg, progress=not args.no_progress)
    print(f"\n{res.steps} steps, {len(res.episodes)} episodes, {res.updates} gradient steps in {res.wall_s:.1f}s "
          f"(transport={res.transport})")
    print(res.loader_summary)
    print("learner loop: " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in res.learner_s.items()))
    print("episode returns by quarter of the run (DuckDB over the live buffer, store.sql):")
    print(res.summary.to_pandas().to_string(index=False))
    print(f"mean return: first 20 episodes {res.first20:.1f} -> last 20 episodes {res.last20:.1f}")
    if res.steps < SHORT_RUN_STEPS:
        print(f"(a short run: DQN on CartPole needs about {SHORT_RUN_STEPS:,} steps before returns rise, so this run "
              "shows the machinery (actors, store, learner, summary, plot), not learning; the default is 15,000)")
    if res.plot:
        print(f"plot: {res.plot}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m arrowbuf.demo dqn") -> int:
    p = configure_parser(argparse.ArgumentParser(prog=prog, description=_DESCRIPTION,
                                                 epilog=demos_epilog(prog.rsplit(" ", 1)[0]),
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    args = p.parse_args(argv)
    return run_cli(lambda: run_from_args(args), "actors stopped, server and store closed")
