"""Loader benchmark (issue 6): exposed experience-path latency per learner iteration, synchronous vs `ab.Loader`.

A learner loop over the atari workload (obs uint8 [4, 84, 84], next_obs derived, capacity 20k, batch 256) takes a
batch and runs a real torch model step (a Q-network on pooled frames: forward, TD loss, backward, Adam step) whose
hidden width is calibrated so that the step costs about 1x and 2x the measured path time (sample + gather + collate
to torch tensors). Per iteration it measures the exposed latency (time the learner waits for its batch) and the
iteration time, for

  sync     batch = source.sample(256).to_torch()   then the model step      (every bit of the path is exposed)
  loader   batch = next(loader)                    then the model step      (Loader(prefetch=4, format="torch"))

over a local store and over Flight (`ab.connect` to a server in a subprocess, as a remote store would be). torch runs
with `torch.set_num_threads(1)`: this machine has 2 cores, and the Loader's thread needs the other one (with more
cores, give torch all but one). Modes alternate within each repeat; the reported numbers are medians over repeats of
per-repeat medians.

    python -m benchmarks.bench_loader [--repeats 3] [--iters 60] [--quick] [--no-flight]

Prints a table and writes benchmarks/out/loader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
CAPACITY = 20_000
BATCH = 256
PREFETCH = 4
FILL_PIECE = 5_000


# ---------------------------------------------------------------------------------------------------- the store
def build_store() -> Any:
    import arrowbuf as ab
    from benchmarks.workloads import make_steps

    store = ab.ExperienceStore(ROOT / "schemas" / "atari.yaml", capacity=CAPACITY, seed=0, name="atari")
    for i in range(CAPACITY // FILL_PIECE):
        store.extend(make_steps("atari", FILL_PIECE, seed=i))
    return store


def serve_main() -> None:
    import arrowbuf as ab

    store = build_store()
    server = ab.serve(store, max_batch_rows=4096)
    print(json.dumps({"location": server.location}), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    server.close()
    store.close()


# ---------------------------------------------------------------------------------------------------- the learner
class Learner:
    """A DQN-style step: Q(obs) and max Q(next_obs) from an MLP over the newest frame (every 4th pixel), Huber TD loss,
    Adam. The features are cheap on purpose (uint8 -> float of whole stacks runs at ~0.3 G elements/s on this host);
    the hidden width sets the cost of the step's matmuls."""

    def __init__(self, hidden: int, actions: int = 18) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        feat = 21 * 21
        self.net = torch.nn.Sequential(torch.nn.Linear(feat, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, actions))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-4)
        self.hidden = hidden

    def _features(self, obs: Any) -> Any:
        return obs[:, -1, ::4, ::4].float().div_(255.0).flatten(1)

    def step(self, batch: dict[str, Any]) -> float:
        torch = self.torch
        q = self.net(self._features(batch["obs"]))
        q_a = q.gather(1, batch["action"].view(-1, 1)).squeeze(1)
        with torch.no_grad():
            q_next = self.net(self._features(batch["next_obs"])).max(1).values
            done = batch["terminated"].float()
            target = batch["reward"] + 0.99 * (1.0 - done) * q_next
        loss = torch.nn.functional.smooth_l1_loss(q_a, target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def time_step(learner: Learner, batch: dict[str, Any], reps: int = 10) -> float:
    learner.step(batch)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        learner.step(batch)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def calibrate(target_s: float, batch: dict[str, Any]) -> tuple[Learner, float]:
    """A Learner whose step costs about `target_s`: bisection on the hidden width (the cost grows with it)."""
    lo, hi = 16, 4096
    best: tuple[float, int, float] | None = None
    for _ in range(9):
        mid = int(round((lo * hi) ** 0.5))  # geometric: the cost is between linear and quadratic in the width
        t = time_step(Learner(mid), batch)
        if best is None or abs(t - target_s) < best[0]:
            best = (abs(t - target_s), mid, t)
        if t < target_s:
            lo = mid
        else:
            hi = mid
        if hi - lo <= max(2, lo // 32):
            break
    assert best is not None
    learner = Learner(best[1])
    return learner, time_step(learner, batch)


# ---------------------------------------------------------------------------------------------------- the loops
def path_time(source: Any, iters: int = 60, warmup: int = 40) -> float:
    """Median time of one synchronous sample + collate to torch inside a learner loop (the path of one iteration).

    Measured in the loop with the cheapest model step, not back to back: back to back, the allocator keeps returning
    the batch buffers to the OS and every batch first-touches fresh pages (about 2x slower than in a training loop,
    where other allocations keep the heap in use)."""
    learner = Learner(16)
    run_sync(source, learner, warmup)  # the first batches first-touch fresh memory
    return run_sync(source, learner, iters)["exposed_s"]


def run_sync(source: Any, learner: Learner, iters: int) -> dict[str, Any]:
    exposed, iteration = [], []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        batch = source.sample(BATCH).to_torch()
        t1 = time.perf_counter()
        learner.step(batch)
        t2 = time.perf_counter()
        if i >= 3:
            exposed.append(t1 - t0)
            iteration.append(t2 - t0)
    return {"exposed_s": statistics.median(exposed), "exposed_mean_s": statistics.fmean(exposed),
            "iteration_s": statistics.median(iteration), "iteration_mean_s": statistics.fmean(iteration)}


def run_loader(source: Any, learner: Learner, iters: int) -> dict[str, Any]:
    import arrowbuf as ab

    exposed, iteration = [], []
    with ab.Loader(source, BATCH, prefetch=PREFETCH, format="torch", timeout=60.0) as loader:
        loader.fill(60.0)
        for i in range(iters + 3):
            t0 = time.perf_counter()
            batch = next(loader)
            t1 = time.perf_counter()
            learner.step(batch)
            t2 = time.perf_counter()
            if i >= 3:
                exposed.append(t1 - t0)
                iteration.append(t2 - t0)
        m = loader.metrics
        tail = m.to_arrow().slice(3)
        path = tail.column("path_s").to_numpy()
        hidden = 1.0 - tail.column("exposed_path_s").to_numpy().sum() / path.sum()
    return {"exposed_s": statistics.median(exposed), "exposed_mean_s": statistics.fmean(exposed),
            "iteration_s": statistics.median(iteration), "iteration_mean_s": statistics.fmean(iteration),
            "background_path_s": float(np.median(path)), "hidden_fraction": float(hidden),
            "summary": m.summary()}


# ---------------------------------------------------------------------------------------------------- driver
def measure(repeats: int, iters: int, flight: bool) -> list[dict[str, Any]]:
    import torch

    import arrowbuf as ab

    torch.set_num_threads(1)
    sources: dict[str, Any] = {"local": build_store()}
    proc = None
    if flight:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_loader", "--serve"], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        sources["flight"] = ab.connect(json.loads(proc.stdout.readline())["location"])  # type: ignore[union-attr]
    rows = []
    try:
        for name, source in sources.items():
            p = path_time(source)
            batch = source.sample(BATCH).to_torch()
            for factor in (1.0, 2.0):
                learner, step_s = calibrate(factor * p, batch)
                load_before = os.getloadavg()[0]
                runs: dict[str, list[dict[str, Any]]] = {"sync": [], "loader": []}
                for r in range(repeats):
                    order = ("sync", "loader") if r % 2 == 0 else ("loader", "sync")
                    for mode in order:
                        fn = run_sync if mode == "sync" else run_loader
                        runs[mode].append(fn(source, learner, iters))
                row = summarise(name, factor, p, step_s, learner.hidden, runs)
                row["loadavg_1min"] = [load_before, os.getloadavg()[0]]  # other work on the host skews rows
                rows.append(row)
                print(format_row(row), flush=True)
    finally:
        for s in sources.values():
            s.close()
        if proc is not None:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(30)
    return rows


def summarise(source: str, factor: float, path_s: float, step_s: float, hidden: int,
              runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "summary"}
           for mode, rs in runs.items()}
    sync, load = med["sync"], med["loader"]
    return {
        "source": source, "compute_x_path": factor, "path_s": path_s, "step_s": step_s, "hidden_width": hidden,
        "sync": sync, "loader": load,
        "exposed_reduction": 1.0 - load["exposed_s"] / sync["exposed_s"],
        "exposed_mean_reduction": 1.0 - load["exposed_mean_s"] / sync["exposed_mean_s"],
        "iteration_reduction": 1.0 - load["iteration_s"] / sync["iteration_s"],
        "ideal_iteration_reduction": 1.0 - max(step_s, path_s) / (step_s + path_s),
        "loader_summaries": [r["summary"] for r in runs["loader"]],
        "repeats": runs,
    }


HEADER = (f"{'source':<7} {'compute':>8} {'path ms':>8} {'step ms':>8} | {'exposed ms sync':>15} {'loader':>8} "
          f"{'cut':>6} {'(mean cut)':>10} | {'iter ms sync':>12} {'loader':>8} {'cut':>6} {'ideal':>6} | "
          f"{'bg path ms':>10} {'hidden':>7} | load")


def format_row(r: dict[str, Any]) -> str:
    ms = 1e3
    s, lo = r["sync"], r["loader"]
    return (f"{r['source']:<7} {r['compute_x_path']:>7.0f}x {r['path_s'] * ms:>8.2f} {r['step_s'] * ms:>8.2f} | "
            f"{s['exposed_s'] * ms:>15.3f} {lo['exposed_s'] * ms:>8.3f} {r['exposed_reduction']:>6.1%} "
            f"{r['exposed_mean_reduction']:>10.1%} | {s['iteration_s'] * ms:>12.2f} {lo['iteration_s'] * ms:>8.2f} "
            f"{r['iteration_reduction']:>6.1%} {r['ideal_iteration_reduction']:>6.1%} | "
            f"{lo['background_path_s'] * ms:>10.2f} {lo['hidden_fraction']:>7.1%} | "
            f"{max(r.get('loadavg_1min', [0.0])):>4.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 20 iterations (a smoke run)")
    ap.add_argument("--no-flight", action="store_true", help="local store only")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve_main()
        return 0
    repeats, iters = (1, 20) if args.quick else (args.repeats, args.iters)
    flight = not args.no_flight
    if flight:
        try:
            import arrowbuf.flight  # noqa: F401
        except ImportError as e:
            print(f"Flight rows skipped: {e}")
            flight = False
    print(f"atari, capacity {CAPACITY}, batch {BATCH}, prefetch {PREFETCH}, torch threads 1, "
          f"{os.cpu_count()} cores; medians of {repeats} repeats x {iters} iterations")
    print(HEADER)
    rows = measure(repeats, iters, flight)
    OUT.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "loader", "workload": "atari", "capacity": CAPACITY, "batch": BATCH, "prefetch": PREFETCH,
           "repeats": repeats, "iters": iters, "torch_threads": 1, "cpus": os.cpu_count(),
           "python": platform.python_version(), "machine": platform.machine(), "rows": rows}
    (OUT / "loader.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {OUT / 'loader.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
