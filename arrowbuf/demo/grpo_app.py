"""`python -m arrowbuf.demo grpo`: a GRPO pipeline over arrowbuf, learning to reverse digit strings on the CPU.

What runs (all on this machine, every byte of experience through arrowbuf over Arrow Flight):

* the store (main process): one row per completion (`prompt_id`, `policy_version`, `prompt`, `response_tokens`,
  `logprobs`, and the later fields `reward` and `ref_logprobs`), `ab.samplers.Group(key="prompt_id", size=G)` so
  every stage gets whole groups, tasks "reward", "ref" and "train", served with `ab.serve`;
* 2 rollout workers (processes): sample G completions per prompt with the current policy and `extend` whole groups,
  recording the policy version and the log-probs they sampled with;
* a reward worker (process): `consume("reward")`, checks the answers, `update(ids, {"reward": r})`;
* a reference worker (process): the initial policy, frozen; `consume("ref")`, `update(ids, {"ref_logprobs": lp})`;
* the trainer (main process, through its own Flight client): `consume("train", require=["reward", "ref_logprobs"],
  max_staleness=k)`, GRPO step (`arrowbuf.demo.grpo`), then publishes the weights as the next policy version
  (`PolicyFile`, atomic replace) and sets `store.policy_version`; workers reload the weights when the version
  changes. Flow control: the trainer hands out generation credits (a semaphore of groups, two batches deep; the
  credits of groups dropped as stale come back), so rollouts stay within a version or two of the trainer.

Output: a progress bar, `grpo_reward.png` (mean reward per policy version) and `grpo.json` in `--out`, and a SQL
summary per policy version (`store.sql` over the live buffer, which holds the whole run).
"""

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
from typing import Any

import numpy as np

from ..errors import ArrowbufError, InsertTimeout, InvalidArgument, require
from .actors import PolicyFile
from .entry import demos_epilog, run_cli, start_quietly
from .grpo import GRPOConfig, GRPOTrainer, generate, make_policy, make_prompts, rewards, token_logprobs

_DESCRIPTION = "GRPO over arrowbuf: rollout, reward and reference workers and a trainer, all through Arrow Flight."
TASKS = ["reward", "ref", "train"]


def grpo_schema() -> Any:
    """One row per completion; `reward` and `ref_logprobs` are filled later by their workers."""
    from ..schema import load_schema

    return load_schema({"name": "grpo_demo", "fields": {
        "prompt_id": {"dtype": "int64"},
        "policy_version": {"dtype": "int64"},
        "prompt": {"dtype": "int32", "ragged": True},
        "response_tokens": {"dtype": "int32", "ragged": True},
        "logprobs": {"dtype": "float32", "ragged": True},
        "reward": {"dtype": "float32", "later": True},
        "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
        "done": {"dtype": "bool"},
    }})


@dataclasses.dataclass
class WorkerSpec:
    role: str                 # "rollout", "reward" or "ref"
    worker_id: int
    location: str
    policy_path: str
    cfg: GRPOConfig
    seed: int
    workers: int = 2          # rollout workers (prompt ids are worker_id + workers * k)


def _rows(pa: Any, prompt_ids: np.ndarray, version: int, prompts: np.ndarray, responses: np.ndarray,
          logps: np.ndarray) -> dict[str, Any]:
    n, length = responses.shape

    def ragged(values: np.ndarray, dtype: Any) -> Any:
        offs = pa.array(np.arange(0, n * length + 1, length, dtype=np.int32))
        return pa.ListArray.from_arrays(offs, pa.array(values.reshape(-1).astype(dtype)))

    return {"prompt_id": prompt_ids, "policy_version": np.full(n, version, np.int64),
            "prompt": ragged(prompts, np.int32), "response_tokens": ragged(responses, np.int32),
            "logprobs": ragged(logps, np.float32), "done": np.ones(n, bool)}


def worker_main(spec: WorkerSpec, stop: Any, credits: Any, errors: Any, local_store: Any = None) -> None:
    """A worker: `rollout`, `reward` or `ref` (see the module docstring). Exits when `stop` is set.

    A process connects to `spec.location` over Flight; with `--transport local` it is a thread given the store.
    """
    try:
        torch = require("torch", "demo")
        torch.set_num_threads(1)
        import pyarrow as pa

        from ..flight import connect

        store = local_store if local_store is not None else connect(spec.location)
        try:
            if spec.role == "rollout":
                _rollout(spec, store, stop, credits, torch, pa)
            else:
                _fill(spec, store, stop, torch, pa)
        finally:
            if local_store is None:
                store.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which stops the run
        if not stop.is_set():
            errors.put(f"{spec.role} worker {spec.worker_id}: {type(exc).__name__}: {exc}")


def _rollout(spec: WorkerSpec, store: Any, stop: Any, credits: Any, torch: Any, pa: Any) -> None:
    cfg = spec.cfg
    rng = np.random.default_rng(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    policy = make_policy(cfg, seed=0)
    policy_file = PolicyFile(spec.policy_path)
    version, k = 0, 0
    per_round = max(1, cfg.prompts_per_step // spec.workers)
    while not stop.is_set():
        got = 0
        while got < per_round and not stop.is_set():
            if credits.acquire(timeout=0.5):  # the trainer grants groups as it consumes them
                got += 1
        if stop.is_set():
            return
        new = policy_file.poll()
        if new is not None:
            version, state = new
            policy.load_state_dict(state)
        length = int(rng.integers(cfg.min_len, cfg.max_len + 1))
        prompts = make_prompts(rng, got, length)
        responses, logps = generate(policy, prompts, cfg.group, gen)
        ids = spec.worker_id + spec.workers * (k + np.arange(got, dtype=np.int64))
        k += got
        rows = _rows(pa, np.repeat(ids, cfg.group), version, np.repeat(prompts, cfg.group, axis=0), responses, logps)
        while not stop.is_set():
            try:
                store.extend(rows)
                break
            except InsertTimeout:  # the buffer is full of rows a stage has not consumed yet: wait and retry
                continue


def _fill(spec: WorkerSpec, store: Any, stop: Any, torch: Any, pa: Any) -> None:
    cfg = spec.cfg
    ref = make_policy(cfg, seed=0)  # the initial policy (the trainer starts from the same seed), frozen
    ref.eval()
    n = cfg.group * max(1, cfg.prompts_per_step // spec.workers)  # one rollout write: served as soon as it lands
    while not stop.is_set():
        batch = store.consume(spec.role, n, timeout=0.5)
        if not len(batch):
            continue
        rows = batch.to_numpy()
        prompts, responses = rows["prompt"], rows["response_tokens"]
        if spec.role == "reward":
            store.update(batch.indices, {"reward": rewards(prompts, responses)})
        else:
            with torch.no_grad():
                lps = [x.numpy().astype(np.float32) for x in token_logprobs(ref, prompts, responses)]
            store.update(batch.indices, {"ref_logprobs": pa.array(lps, type=pa.list_(pa.float32()))})


# ---------------------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class GRPOResult:
    steps: int
    wall_s: float
    history: list[dict[str, Any]]     # per trainer step: version, reward, rows, lag, t
    summary: Any                      # pa.Table from store.sql: per policy version
    stats: dict[str, Any]
    plot: str | None
    first: float                      # mean reward of completions from the first fifth of the policy versions
    last: float                       # ... and from the last fifth
    worker_pids: list[int]


def run(steps: int = 200, workers: int = 2, seed: int = 0, out: str | os.PathLike[str] = "demo_out",
        cfg: GRPOConfig | None = None, progress: bool = True, log: Any = print,
        transport: str = "flight") -> GRPOResult:
    """Run the GRPO demo (see the module docstring) for `steps` trainer steps.

    `transport="local"` runs the workers as threads on the store itself (no Flight): for debugging only.
    `progress`: a bar on a terminal, a line every 2 s otherwise (`arrowbuf.observe.meter`), from the start (imports,
    workers starting: tens of seconds on a busy machine) to the plot.
    """
    from ..observe.meter import ProgressMeter

    with ProgressMeter(steps, "grpo", "trainer step", enabled=progress) as bar:
        bar.note("starting: importing torch")
        return _run(steps, workers, seed, out, cfg, bar, log, transport)


def _run(steps: int, workers: int, seed: int, out: str | os.PathLike[str], cfg: GRPOConfig | None, bar: Any,
         log: Any, transport: str) -> GRPOResult:
    torch = require("torch", "demo")
    from ..flight import connect, serve
    from ..samplers import Group
    from ..store.facade import ExperienceStore

    if transport not in ("flight", "local"):
        raise InvalidArgument(f"transport must be 'flight' or 'local', got {transport!r}")
    if steps < 1 or workers < 1:
        raise InvalidArgument(f"--steps and --workers must be >= 1, got {steps} and {workers}")
    cfg = cfg or GRPOConfig()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    batch_rows = cfg.group * cfg.prompts_per_step
    capacity = max(4096, 3 * steps * batch_rows)  # the whole run stays in the buffer, for the SQL summary
    store = ExperienceStore(grpo_schema(), capacity=capacity, sampler=Group(key="prompt_id", size=cfg.group),
                            tasks=TASKS, seed=seed)
    t_start = time.time()
    procs: list[Any] = []
    history: list[dict[str, Any]] = []
    local = transport == "local"
    stop: Any = threading.Event() if local else ctx.Event()
    credits: Any = threading.Semaphore(0) if local else ctx.Semaphore(0)
    errors: Any = queue_mod.Queue() if local else ctx.Queue()
    try:
        with serve(store, "grpc://127.0.0.1:0") as server:
            policy_file = PolicyFile(out_dir / "policy.pt")
            trainer = GRPOTrainer(cfg, seed=0)
            policy_file.publish(trainer.policy.state_dict(), 0)
            log(f"store served over Arrow Flight at {server.location}; {workers} rollout workers, a reward worker "
                f"and a reference worker (processes); trainer consumes whole groups of {cfg.group}")
            specs = [WorkerSpec("rollout", i, server.location, str(policy_file.path), cfg, seed * 1000 + i, workers)
                     for i in range(workers)]
            specs += [WorkerSpec(r, 0, server.location, str(policy_file.path), cfg, seed, workers)
                      for r in ("reward", "ref")]
            for s in specs:
                name = f"grpo-{s.role}-{s.worker_id}"
                p: Any = (threading.Thread(target=worker_main, args=(s, stop, credits, errors, store), daemon=True,
                                           name=name) if local else
                          ctx.Process(target=worker_main, args=(s, stop, credits, errors), daemon=True, name=name))
                start_quietly(p)
                procs.append(p)
            bar.note(f"{len(procs)} workers starting (each imports torch); waiting for the first rewarded groups")
            remote: Any = store if local else connect(server.location)
            try:
                compensated = 0
                for _ in range(2 * cfg.prompts_per_step):  # two batches in flight
                    credits.release()
                while trainer.version < steps:
                    _raise_worker_errors(errors, procs)
                    batch = remote.consume("train", batch_rows, require=["reward", "ref_logprobs"],
                                           max_staleness=cfg.max_staleness, timeout=2.0)
                    if not len(batch):  # nothing ready: give back the credits of groups dropped on the way
                        st = remote.stats()
                        lost = (int(st.get("stale_dropped", 0)) // cfg.group
                                + int(st.get("groups_dropped_zero_variance", 0)))
                        for _ in range(lost - compensated):
                            credits.release()
                        compensated = max(compensated, lost)
                        continue
                    rows = batch.to_numpy()
                    r = np.asarray(rows["reward"], dtype=np.float32)
                    versions = np.asarray(rows["policy_version"])
                    info = trainer.step(rows["prompt"], rows["response_tokens"], rows["logprobs"],
                                        rows["ref_logprobs"], r, np.asarray(rows["prompt_id"]))
                    policy_file.publish(trainer.policy.state_dict(), trainer.version)
                    remote.policy_version = trainer.version
                    for _ in range(len(batch) // cfg.group):
                        credits.release()
                    history.append({"version": trainer.version, "reward": float(r.mean()), "rows": len(batch),
                                    "lag": float((trainer.version - 1 - versions).mean()),
                                    "t": time.time() - t_start, **info})
                    recent = [h["reward"] for h in history[-10:]]
                    bar.update_to(trainer.version, **{"reward(last10)": f"{np.mean(recent):.3f}",
                                                      "kl": f"{info['kl']:.3f}", "lag": f"{history[-1]['lag']:.1f}",
                                                      "policy": f"v{trainer.version}"})
                stats = remote.stats()
            finally:
                bar.note("stopping the workers")
                stop.set()
                if not local:
                    remote.close()
                _stop_workers(procs)
            wall = time.time() - t_start
            bar.note("summary (store.sql) and plot")
            summary = _summary_sql(store)
    finally:
        stop.set()
        _stop_workers(procs)
        store.close()
    per_version = summary.to_pydict()
    first, last = _ends(per_version)
    (out_dir / "grpo.json").write_text(json.dumps({
        "history": history, "per_version": per_version, "first": first, "last": last, "wall_s": wall,
        "worker_pids": [getattr(p, "pid", None) for p in procs],
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}}, default=float))
    plot = _plot(per_version, history, out_dir / "grpo_reward.png")
    return GRPOResult(trainer.version, wall, history, summary, stats, plot, first, last,
                      [getattr(p, "pid", 0) for p in procs])


def _raise_worker_errors(errors: Any, procs: list[Any]) -> None:
    if not errors.empty():
        raise ArrowbufError(f"a worker failed: {errors.get()}")
    dead = [p.name for p in procs if not p.is_alive()]
    if dead:
        raise ArrowbufError(f"workers exited early: {dead}")


def _stop_workers(procs: list[Any]) -> None:
    for p in procs:
        p.join(10)
    for p in procs:
        if isinstance(p, mp.process.BaseProcess) and p.is_alive():
            p.terminate()
            p.join(5)


def _summary_sql(store: Any) -> Any:
    """Per policy version: completions, mean reward, share solved, mean response length (DuckDB over the buffer)."""
    return store.sql(
        "SELECT policy_version, count(*) AS completions, count(DISTINCT prompt_id) AS prompts, "
        "round(avg(reward), 3) AS mean_reward, round(avg(CASE WHEN reward = 1 THEN 1.0 ELSE 0.0 END), 3) AS solved, "
        "round(avg(len(response_tokens)), 2) AS mean_tokens FROM experience WHERE reward IS NOT NULL "
        "GROUP BY policy_version ORDER BY policy_version")


def _ends(per_version: dict[str, list]) -> tuple[float, float]:
    """Mean reward (weighted by completions) of the first and the last fifth of the policy versions."""
    n = len(per_version.get("policy_version", []))
    if not n:
        return float("nan"), float("nan")
    k = max(1, n // 5)
    w = np.asarray(per_version["completions"], dtype=np.float64)
    r = np.asarray(per_version["mean_reward"], dtype=np.float64)
    return float(np.average(r[:k], weights=w[:k])), float(np.average(r[-k:], weights=w[-k:]))


def _plot(per_version: dict[str, list], history: list[dict[str, Any]], path: pathlib.Path) -> str | None:
    """Write the reward plot (`reward_figure`) to `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = reward_figure(per_version)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def reward_figure(per_version: dict[str, list]) -> Any:
    """Mean reward per policy version (ticks at whole versions only) and its 10-version mean."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 4.5))
    v = np.asarray(per_version.get("policy_version", []))
    r = np.asarray(per_version.get("mean_reward", []), dtype=np.float64)
    if v.size:
        ax.plot(v, r, ".", alpha=0.4, label="mean reward of the\ncompletions of a version")
        k = min(10, v.size)
        ax.plot(v[k - 1:], np.convolve(r, np.ones(k) / k, mode="valid"), color="C1", lw=2, label=f"mean of {k}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a policy version is a whole number
    ax.axhline(0.2, color="grey", ls="--", lw=1, label="uniformly random policy")
    ax.set_xlabel("policy version (trainer steps)")
    ax.set_ylabel("reward (share of digits right)")
    ax.set_title("GRPO over arrowbuf: reversing digit strings")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the axes: never on a point
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The GRPO demo's flags."""
    d = GRPOConfig()
    p.add_argument("--steps", type=int, default=200, help="trainer steps (policy versions), default 200")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (default 2)")
    p.add_argument("--group", type=int, default=d.group, help=f"completions per prompt (default {d.group})")
    p.add_argument("--prompts", type=int, default=d.prompts_per_step,
                   help=f"prompts (groups) per trainer step (default {d.prompts_per_step})")
    p.add_argument("--max-staleness", type=int, default=d.max_staleness,
                   help=f"policy versions a trained-on row may lag (default {d.max_staleness})")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments, sampling and the model (default 0)")
    p.add_argument("--out", default=os.environ.get("ARROWBUF_DEMO_OUT", "demo_out"),
                   help="folder for grpo_reward.png, grpo.json, policy.pt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--transport", choices=("flight", "local"), default="flight",
                   help="flight (default): worker processes over Arrow Flight; local: threads on the store (debug)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    cfg = GRPOConfig(group=args.group, prompts_per_step=args.prompts, max_staleness=args.max_staleness)
    res = run(args.steps, args.workers, args.seed, args.out, cfg, progress=not args.no_progress,
              transport=args.transport)
    print(f"\n{res.steps} trainer steps in {res.wall_s:.1f}s; stale rows dropped: {res.stats.get('stale_dropped', 0)}"
          f", zero-variance groups dropped: {res.stats.get('groups_dropped_zero_variance', 0)}")
    print("per policy version (DuckDB over the live buffer, store.sql):")
    table = res.summary.to_pandas()
    print(table.to_string(index=False, max_rows=24))
    print(f"mean reward: first fifth of versions {res.first:.3f} -> last fifth {res.last:.3f} "
          "(0.2 is a uniformly random policy, 1.0 solves the task)")
    if res.steps < 100:
        print("(a short run: the reward rises over about 100 trainer steps, so this run shows the machinery (workers, "
              "the store's tasks and groups, the trainer, summary, plot), not learning; the default is 200)")
    if res.plot:
        print(f"plot: {res.plot}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m arrowbuf.demo grpo") -> int:
    p = configure_parser(argparse.ArgumentParser(prog=prog, description=_DESCRIPTION,
                                                 epilog=demos_epilog(prog.rsplit(" ", 1)[0]),
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    args = p.parse_args(argv)
    return run_cli(lambda: run_from_args(args), "workers stopped, server and store closed")


__all__ = ["GRPOResult", "WorkerSpec", "configure_parser", "grpo_schema", "main", "run", "run_from_args",
           "worker_main"]
