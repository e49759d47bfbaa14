"""Shared benchmark workloads and a tiny timing helper.

Everything in benchmarks/ measures the same two workloads so that arrowbuf,
its ceilings and its peers can be compared as ratios (see DESIGN.md,
"Performance method").
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import numpy as np

WORKLOADS = {
    "atari": dict(
        obs_shape=(4, 84, 84),
        obs_dtype=np.uint8,
        action_shape=(),
        action_dtype=np.int64,
        capacity=100_000,
    ),
    "mujoco": dict(
        obs_shape=(376,),
        obs_dtype=np.float32,
        action_shape=(17,),
        action_dtype=np.float32,
        capacity=1_000_000,
    ),
}

REWARD_DTYPE = np.float32
FLAG_DTYPE = np.bool_

# Column order used everywhere (next_obs stored separately from obs).
COLUMNS = ("obs", "action", "reward", "terminated", "truncated", "next_obs")


def _wl(workload) -> dict:
    return WORKLOADS[workload] if isinstance(workload, str) else workload


def column_specs(workload) -> dict:
    """{column: (shape_per_row, dtype)} for one transition."""
    w = _wl(workload)
    return {
        "obs": (tuple(w["obs_shape"]), np.dtype(w["obs_dtype"])),
        "action": (tuple(w["action_shape"]), np.dtype(w["action_dtype"])),
        "reward": ((), np.dtype(REWARD_DTYPE)),
        "terminated": ((), np.dtype(FLAG_DTYPE)),
        "truncated": ((), np.dtype(FLAG_DTYPE)),
        "next_obs": (tuple(w["obs_shape"]), np.dtype(w["obs_dtype"])),
    }


def transition_bytes(workload) -> int:
    """Bytes of one transition with obs and next_obs stored separately:
    obs + next_obs + action + reward + terminated + truncated."""
    total = 0
    for shape, dtype in column_specs(workload).values():
        total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return total


def _random_rows(rng: np.random.Generator, n: int, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    size = (n, *shape)
    if dtype == np.uint8:
        # 64 random bits at a time: ~2x faster than integers(..., dtype=uint8).
        total = int(np.prod(size, dtype=np.int64))
        words = rng.integers(0, 2**64 - 1, size=(total + 7) // 8, dtype=np.uint64,
                             endpoint=True)
        return words.view(np.uint8)[:total].reshape(size)
    if dtype.kind == "f":
        return rng.standard_normal(size=size, dtype=np.float32).astype(dtype, copy=False)
    if dtype.kind in "iu":
        return rng.integers(0, 18, size=size).astype(dtype, copy=False)
    if dtype.kind == "b":
        return rng.random(size=size) < 0.5
    raise TypeError(f"unsupported dtype {dtype}")


def make_steps(workload, n: int, seed: int = 0, episode_len: int = 1000) -> dict:
    """n consecutive environment steps as a dict of numpy arrays (leading dim n).

    Keys: obs, action, reward, terminated, truncated, next_obs.
    Inside an episode next_obs[i] == obs[i+1]; an episode ends about every
    `episode_len` steps (lengths jittered +-20%) with terminated=True, and the
    next step's obs is a fresh reset observation. truncated is always False.
    The last episode may be cut off by n (no flag set on its last step).
    Observation content is random (incompressible: the honest worst case).
    """
    w = _wl(workload)
    rng = np.random.default_rng(seed)
    n = int(n)
    # Episode lengths.
    lens = []
    left = n
    lo = max(1, int(episode_len * 0.8))
    hi = max(lo + 1, int(episode_len * 1.2) + 1)
    while left > 0:
        L = min(left, int(rng.integers(lo, hi)))
        lens.append(L)
        left -= L
    lens = np.asarray(lens, dtype=np.int64)
    # Each episode of length L uses L+1 distinct frames (obs_0..obs_L).
    frames = _random_rows(rng, n + len(lens), w["obs_shape"], w["obs_dtype"])
    ep_start_step = np.concatenate([[0], np.cumsum(lens)[:-1]])
    ep_of_step = np.repeat(np.arange(len(lens)), lens)
    frame_idx = np.arange(n) + ep_of_step  # skip one extra frame per finished episode
    obs = frames[frame_idx]
    next_obs = frames[frame_idx + 1]
    del frames
    terminated = np.zeros(n, dtype=FLAG_DTYPE)
    ends = ep_start_step + lens - 1
    terminated[ends[:-1]] = True  # every episode but the last (cut off by n) ends
    action = _random_rows(rng, n, w["action_shape"], w["action_dtype"])
    reward = rng.standard_normal(n, dtype=np.float32).astype(REWARD_DTYPE, copy=False)
    truncated = np.zeros(n, dtype=FLAG_DTYPE)
    return {
        "obs": obs,
        "action": action,
        "reward": reward,
        "terminated": terminated,
        "truncated": truncated,
        "next_obs": next_obs,
    }


# --------------------------------------------------------------------------
# Timing


#: ARROWBUF_BENCH_CLOCK=thread times this thread's CPU time instead of wall time: on a machine shared with other
#: jobs (load above its cores), wall time mostly measures the scheduler; CPU time measures the code. Say which.
_CLOCK = time.thread_time if os.environ.get("ARROWBUF_BENCH_CLOCK") == "thread" else time.perf_counter


def rates(fn: Callable[[], object], repeat: int = 5, number: int = 1,
          items: float = 1.0, warmup: int = 1) -> list[float]:
    """Call fn `warmup` times, then `repeat` times `number` calls each.
    Returns one rate per repeat: items * number / seconds."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = _CLOCK()
        for _ in range(number):
            fn()
        dt = _CLOCK() - t0
        out.append(items * number / dt if dt > 0 else float("inf"))
        _measured()  # outside the timed region
    return out


_meter = None


def _measured() -> None:
    """Progress of a benchmark script a person runs (`python -m benchmarks.bench_x`): its table comes at the end,
    after minutes; meanwhile a line every 2 s (a bar on a terminal, `arrowbuf.observe.meter`) counts the repeats
    measured, from a thread that wakes twice a second (nothing inside a timed region)."""
    global _meter
    if _meter is None:
        import atexit
        import sys

        from arrowbuf.observe.meter import ProgressMeter

        name = os.path.basename(sys.argv[0]).removesuffix(".py") if sys.argv and sys.argv[0] else "benchmark"
        _meter = ProgressMeter(None, name, "repeat")
        atexit.register(_meter.close)
    _meter.update(1)


def median_rate(fn: Callable[[], object], repeat: int = 5, number: int = 1,
                items: float = 1.0, warmup: int = 1) -> float:
    """Median over `repeat` repeats of items*number/seconds."""
    return statistics.median(rates(fn, repeat, number, items, warmup))


def best_of(fn: Callable[[], object], repeat: int = 5, number: int = 1,
            items: float = 1.0, warmup: int = 1) -> float:
    """Best (highest) over `repeat` repeats of items*number/seconds."""
    return max(rates(fn, repeat, number, items, warmup))


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
