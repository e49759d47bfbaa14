"""Where a GRPO batch's journal path spends the writer's CPU (issue 25): thread CPU time per phase, which holds
under load better than rates, for one writer extending batches of 64 GRPO rows (186 KB records).

Configurations (interleaved, `--reps` times each; medians printed):

- `none`: the same store without a journal;
- `os`, `group`: the journal (the writer encodes and writes the record, and under "group" starts its disk write
  and fdatasyncs itself);
- `group+win4`: `extend(wait=False)`, 4 writes in flight (the journal's sync thread fdatasyncs them).

Phases: `validate` (`ExperienceSchema.validate_batch`), `encode` (columns as a table, its IPC pieces, the record's
header and CRC: `columns_table` + `table_pieces` + `prepare`), `append+write` (`Journal.append_prepared`, with the
`writev`), `store copy` (the store's reservation, copy and commit without the append), `wait`
(`Journal.wait`/`flush`/`sync_soon`: the ack), `other` (the rest of `extend`).

And `--contention`: the no-journal writer's rate and thread CPU alone and beside another *process* that (a)
appends 186 KB records + fdatasync (the journal's disk work, no GIL shared), (b) spins on the CPU: whether this
machine has a free core for the journal's work.

    python -m benchmarks.profile_journal [--reps 3] [--batches 1500] [--contention] [--dir /tmp]

Writes benchmarks/out/journal_profile.json. Say the load (printed) with any figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

import arrowbuf as ab
from arrowbuf.engine import writer as wr
from arrowbuf.persist import journal as jr
from arrowbuf.store import durable as du
from benchmarks.bench_journal import OUT, grpo_batch

CONFIGS = ("none", "os", "group", "group+win4")
_acc: collections.Counter[str] = collections.Counter()
_main = threading.main_thread()
_inside: set[str] = set()


def _wrap(obj: Any, name: str, label: str, unless: tuple[str, ...] = ()) -> tuple[Any, str, Any]:
    """Count the main thread's CPU time in `obj.name` under `label` (nested calls count in both), except while
    inside `unless`."""
    f = getattr(obj, name)

    def g(*a: Any, **k: Any) -> Any:
        if threading.current_thread() is not _main or _inside.intersection(unless):
            return f(*a, **k)
        c = time.thread_time()
        _inside.add(label)
        try:
            return f(*a, **k)
        finally:
            _inside.discard(label)
            _acc[label] += time.thread_time() - c

    setattr(obj, name, g)
    return obj, name, f


def profile(config: str, where: str, batches: int) -> dict[str, float]:
    policy = None if config == "none" else config.split("/")[0].split("+")[0]
    window = 4 if "+win4" in config else 0
    schema_cls = type(ab.load_schema("grpo"))
    wraps = [_wrap(schema_cls, "validate_batch", "validate"), _wrap(du, "columns_table", "encode"),
             _wrap(du.jr, "table_pieces", "encode"), _wrap(du.jr, "prepare", "encode"),
             _wrap(jr.Journal, "append_prepared", "append"), _wrap(jr.Journal, "wait", "wait"),
             _wrap(jr.Journal, "sync_soon", "kick"), _wrap(wr.StoreWriter, "_ingest", "ingest")]
    flush = _wrap(jr.Journal, "flush", "flush", unless=("append", "wait"))
    d = tempfile.mkdtemp(dir=where, prefix="jp-")
    kw: dict[str, Any] = {} if policy is None else {"durable": os.path.join(d, "run"), "durability": policy}
    s = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1280, seed=0, **kw)
    try:
        b = grpo_batch(64)
        for _ in range(10):
            s.extend(b)
        _acc.clear()
        handles: collections.deque[Any] = collections.deque()
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(batches):
            if window:
                handles.append(s.extend(b, wait=False))
                if len(handles) > window:
                    handles.popleft().wait()
            else:
                s.extend(b)
        while handles:
            handles.popleft().wait()
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    finally:
        s.close()
        for obj, name, f in (*wraps, flush):
            setattr(obj, name, f)
        shutil.rmtree(d, ignore_errors=True)
    us = collections.defaultdict(float, {k: v / batches * 1e6 for k, v in _acc.items()})
    # `kick` (sync_soon) and `append` run inside the store's reservation (`_ingest`); `flush` outside `append` and
    # `wait`: the wait=False path's wait for its record to be written
    out = {"validate": us["validate"], "encode": us["encode"], "append+write": us["append"],
           "store copy": us["ingest"] - us["append"] - us["kick"],
           "wait": us["wait"] + us["kick"] + us["flush"]}
    out["other"] = cpu / batches * 1e6 - sum(out.values())
    out["writer cpu"] = cpu / batches * 1e6
    out["wall"] = wall / batches * 1e6
    return out


_BG = r"""
import os, sys, time
mode, secs, path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
buf = os.urandom(186 << 10)
end, n = time.time() + secs, 0
while time.time() < end:
    if mode == "spin":
        x = 0
        for i in range(10000):
            x += i
        continue
    os.write(fd, buf)
    os.fdatasync(fd)
    n += 1
    if n % 1000 == 0:
        os.ftruncate(fd, 0)
os.close(fd)
os.unlink(path)
"""


def contention(where: str, batches: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    """A no-journal writer alone and beside another process doing the journal's disk work or spinning."""
    s = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1280, seed=0)
    b = grpo_batch(64)
    res: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    try:
        for _ in range(10):
            s.extend(b)
        for _ in range(reps):
            for mode in ("alone", "disk", "spin"):
                p = None if mode == "alone" else subprocess.Popen(
                    [sys.executable, "-c", _BG, mode, "30", os.path.join(where, f"jp-bg-{os.getpid()}")])
                time.sleep(0.2)
                c0, w0 = time.thread_time(), time.perf_counter()
                for _ in range(batches):
                    s.extend(b)
                res[mode].append(((time.thread_time() - c0) / batches * 1e6,
                                  (time.perf_counter() - w0) / batches * 1e6))
                if p is not None:
                    p.kill()
                    p.wait()
                    try:
                        os.unlink(os.path.join(where, f"jp-bg-{os.getpid()}"))
                    except FileNotFoundError:
                        pass
    finally:
        s.close()
    return dict(res)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", type=int, default=1500)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--contention", action="store_true", help="also the competing-process probe")
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    for _ in range(args.reps):
        for c in CONFIGS:
            runs[c].append(profile(c, args.dir, args.batches))
    load1 = os.getloadavg()[0]
    cols = ("validate", "encode", "append+write", "store copy", "wait", "other", "writer cpu", "wall")
    med = {c: {k: float(np.median([r[k] for r in rs])) for k in cols} for c, rs in runs.items()}
    print(f"GRPO batch (64 rows, 186 KB record), writer thread CPU us per batch, medians of {args.reps}; "
          f"load {load0:.1f} -> {load1:.1f} on {os.cpu_count()} CPUs")
    print(f"{'config':<18}" + "".join(f"{k:>13}" for k in cols))
    for c, m in med.items():
        print(f"{c:<18}" + "".join(f"{m[k]:>13.0f}" for k in cols))
    out: dict[str, Any] = {"load": [load0, load1], "reps": args.reps, "batches": args.batches, "medians": med,
                           "runs": runs}
    if args.contention:
        res = contention(args.dir, args.batches, args.reps)
        out["contention"] = res
        print(f"contention (no journal; writer thread CPU / wall us per batch, medians; load "
              f"{os.getloadavg()[0]:.1f}):")
        for mode, v in res.items():
            print(f"  {mode:<6} cpu {np.median([x[0] for x in v]):5.0f}  wall {np.median([x[1] for x in v]):5.0f}"
                  f"  (alone / this: {np.median([x[1] for x in res['alone']]) / np.median([x[1] for x in v]):.2f}x)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "journal_profile.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
