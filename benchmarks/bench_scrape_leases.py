"""How long a /metrics scrape (or an inspector refresh) holds writers back while many leases are open (issue 42).

A store of `ROWS` live rows with `LEASES` one-row leases open for one task; a writer thread extends `BATCH` rows every
millisecond (the ring holds all it writes: leased rows hold eviction) while the main thread scrapes per-task progress
in a loop (`store.observability()`, what the collector and the inspector call). Rows, each the median of
`--repeats` runs, interleaved:

  no scrape     the writer alone: the ceiling of its extend latency
  scrape        the writer while progress is scraped (this tree: counted outside the store lock, no per-lease pass)
  per-lease     the same, with progress computed as before issue 42 (one `np.isin` over every live row per open
                lease, under the store lock), reimplemented here as the peer

For each: the scrape's duration (median) and the writer's extend latency (median, p99 and max over the run), with
ratios of the writer's p99 and max to the ceiling's.

    python -m benchmarks.bench_scrape_leases [--quick] [--repeats R]

Prints a table and writes benchmarks/out/scrape_leases.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import threading
import time
from typing import Any

import numpy as np

import arrowbuf as ab

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SCHEMA = {"name": "scrape", "fields": {"x": {"dtype": "int64"}, "reward": {"dtype": "float32", "later": True},
                                       "done": {"dtype": "bool"}}}


def per_lease_progress(store: ab.ExperienceStore) -> dict[str, Any]:
    """Progress as observe/progress.py computed it before issue 42: per open lease, one pass over the live rows, all
    under the store's lock (the peer of this benchmark)."""
    core = store._core  # noqa: SLF001 - the old algorithm read the internals the same way
    tracker = core.consume
    with core.lock:
        idx = core.index
        seqs = np.arange(idx.lo, idx.hi, dtype=np.int64)
        pos = seqs % core.arena_rows
        live = idx.seq[pos] == seqs
        out: dict[str, Any] = {"live": int(live.sum()), "tasks": {}}
        for task in tracker.tasks:
            leased = np.zeros(len(seqs), dtype=bool)
            for held in tracker.leases.of_task(task):
                leased |= np.isin(seqs, held.seqs)
            out["tasks"][task] = int(leased.sum())
    return out


def run(kind: str, rows: int, leases: int, batch: int, seconds: float) -> dict[str, Any]:
    store = ab.ExperienceStore(SCHEMA, capacity=rows + int(seconds * 2000) * batch, tasks=["t"])
    store.extend({"x": np.arange(rows), "done": np.ones(rows, bool)})
    held = [store.consume("t", 1, lease=3600) for _ in range(leases)]
    data = {"x": np.arange(batch), "done": np.ones(batch, bool)}
    stop = threading.Event()
    waits: list[float] = []

    def writer() -> None:
        while not stop.wait(0.001):
            t0 = time.perf_counter()
            store.extend(data)
            waits.append(time.perf_counter() - t0)

    scrapes: list[float] = []
    t = threading.Thread(target=writer)
    t.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if kind == "no scrape":
            time.sleep(0.01)
            continue
        t0 = time.perf_counter()
        if kind == "scrape":
            store.observability()
        else:
            per_lease_progress(store)
        scrapes.append(time.perf_counter() - t0)
    stop.set()
    t.join()
    del held
    store.close()
    w = np.asarray(waits)
    return {"scrape_s": statistics.median(scrapes) if scrapes else None, "extend_p50_s": float(np.median(w)),
            "extend_p99_s": float(np.quantile(w, 0.99)), "extend_max_s": float(w.max()), "extends": len(w),
            "scrapes": len(scrapes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows, leases, batch, seconds = (50_000, 500, 100, 2.0) if args.quick else (250_000, 2000, 100, 5.0)
    kinds = ["no scrape", "scrape", "per-lease"]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            runs[k].append(run(k, rows, leases, batch, seconds))
    med = {k: {m: statistics.median(x[m] for x in v if x[m] is not None) if any(x[m] is not None for x in v)
               else None for m in v[0]} for k, v in runs.items()}
    ceiling = med["no scrape"]
    print(f"{rows:,} live rows, {leases:,} one-row leases open, extends of {batch} rows; medians of {args.repeats}")
    print(f"{'row':<10} {'scrape ms':>10} {'extend p50 ms':>14} {'p99 ms':>9} {'max ms':>9} {'p99/ceil':>9} "
          f"{'max/ceil':>9}")
    for k in kinds:
        m = med[k]
        scrape = "-" if m["scrape_s"] is None else f"{m['scrape_s'] * 1e3:.1f}"
        print(f"{k:<10} {scrape:>10} {m['extend_p50_s'] * 1e3:>14.2f} {m['extend_p99_s'] * 1e3:>9.1f} "
              f"{m['extend_max_s'] * 1e3:>9.1f} {m['extend_p99_s'] / ceiling['extend_p99_s']:>9.2f} "
              f"{m['extend_max_s'] / ceiling['extend_max_s']:>9.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scrape_leases.json").write_text(json.dumps({"rows": rows, "leases": leases, "batch": batch,
                                                        "medians": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
