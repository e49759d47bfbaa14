"""Memory of ragged (list) columns (issue 28): bytes a store's ragged arenas hold per byte of ragged payload in the
ring, for the GRPO shape (PROMPTS x 8 completions, responses uniform in [1k, 16k] tokens, bench_tq_xproc's rows) and
a uniform shape (the same rows, every response 8704 tokens), in host memory and in shared memory.

Each case makes a store of `capacity` = one payload's rows, extends the payload ROUNDS times (the ring turns; the
last payload is what the ring holds), then measures, per ragged column, what its arena keeps:
  host  pages of the arena's values array resident now (mincore(2): what the kernel holds, not a counter of ours)
  shm   the arena's values file (reserved whole at creation, posix_fallocate)
  disk  a tiered store (`tiers={"host": "64MiB", "disk": a temp dir}`): its ragged arenas live in the disk tier;
        the values file as reserved (its size), as shm (`--tiers host shm disk`; not in the default run)
and divides the sum by the ragged payload bytes (the values buffers of the ragged columns of one payload). This is a
count of bytes, so it holds under load. Also the growth of the process's RSS over the store's life (host).

    python -m benchmarks.bench_ragged_memory [--quick] [--tiers host shm disk] [--shapes grpo uniform]

Full mode (256 prompts: 2048 rows, about 218 MB a payload) takes under a minute; --quick (32 prompts) a few
seconds. Prints a table, writes benchmarks/out/ragged_memory.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from .bench_tq_xproc import GRPO_FIELDS, payload, schema

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
PAGE = os.sysconf("SC_PAGE_SIZE")
ROUNDS = 4
UNIFORM_LENGTH = 8704  # the mean of uniform [1024, 16384]


def resident_bytes(arr: np.ndarray) -> int:
    """Bytes of the pages of `arr` resident now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = arr.ctypes.data // PAGE * PAGE
    pages = -(-(arr.ctypes.data + arr.nbytes - start) // PAGE)
    vec = np.zeros(pages, dtype=np.uint8)
    if libc.mincore(start, pages * PAGE, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((vec & 1).sum()) * PAGE


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def uniform(rows: dict[str, Any]) -> dict[str, Any]:
    """`rows` with every response `UNIFORM_LENGTH` tokens (same row count)."""
    import pyarrow as pa

    n = len(rows["prompt_id"])
    offs = pa.array(np.arange(0, UNIFORM_LENGTH * (n + 1), UNIFORM_LENGTH, dtype=np.int32))
    out = dict(rows)
    rng = np.random.default_rng(1)
    for k in ("response_tokens", "logprobs", "ref_logprobs"):
        t = rows[k].type.value_type
        vals = rng.integers(0, 151_000, UNIFORM_LENGTH * n, np.int32) if t == pa.int32() else \
            -rng.random(UNIFORM_LENGTH * n, dtype=np.float32)
        out[k] = pa.ListArray.from_arrays(offs, pa.array(vals, type=t))
    return out


def measure(tier: str, shape: str, prompts: int) -> dict[str, Any]:
    import arrowbuf as ab

    rows = payload("grpo", prompts)
    if shape == "uniform":
        rows = uniform(rows)
    n = len(rows["prompt_id"])
    ragged = [k for k in GRPO_FIELDS if k in rows and hasattr(rows[k], "offsets")]
    payload_bytes = sum(rows[k].values.nbytes for k in ragged)
    base = rss()
    spill = None
    if tier == "shm":
        store = ab.ExperienceStore(schema("grpo", shm=True), capacity=n, tier="shm",
                                   name=f"rgmem{uuid.uuid4().hex[:8]}")
    elif tier == "disk":
        spill = tempfile.mkdtemp(prefix="rgmem-")
        store = ab.ExperienceStore(schema("grpo", shm=True), capacity=n, tiers={"host": "64MiB", "disk": spill})
    else:
        store = ab.ExperienceStore(schema("grpo"), capacity=n)
    try:
        for _ in range(ROUNDS):
            store.extend(rows)
        arenas = store._core.cols.tier_ragged  # the benchmark reads the arenas' arrays, as a test would
        held = {k: (resident_bytes(arenas[k].values) if tier == "host" else arenas[k].values.nbytes) for k in ragged}
        grown = rss() - base
    finally:
        store.close()
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    return {"tier": tier, "shape": shape, "rows": n, "payload_bytes": payload_bytes, "held_bytes": sum(held.values()),
            "held_per_payload": sum(held.values()) / payload_bytes, "per_column": held,
            "rss_growth_per_payload": grown / payload_bytes if tier == "host" else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 prompts instead of 256")
    ap.add_argument("--tiers", nargs="+", default=["host", "shm"])
    ap.add_argument("--shapes", nargs="+", default=["grpo", "uniform"])
    ap.add_argument("--prompts", type=int, default=None)
    args = ap.parse_args(argv)
    prompts = args.prompts or (32 if args.quick else 256)
    results = [measure(t, s, prompts) for s in args.shapes for t in args.tiers]
    print(f"ragged arena memory, {prompts} prompts x 8 rows, {ROUNDS} extends of one payload into a ring of its rows")
    print(f"{'shape':8} {'tier':5} {'payload MB':>10} {'held MB':>9} {'held/payload':>12} {'rss growth/payload':>18}")
    for r in results:
        g = r["rss_growth_per_payload"]
        print(f"{r['shape']:8} {r['tier']:5} {r['payload_bytes'] / 1e6:10.1f} {r['held_bytes'] / 1e6:9.1f} "
              f"{r['held_per_payload']:12.2f} {'-' if g is None else f'{g:.2f}':>18}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ragged_memory.json").write_text(json.dumps({"prompts": prompts, "rounds": ROUNDS, "results": results},
                                                       indent=1))


if __name__ == "__main__":
    main()
