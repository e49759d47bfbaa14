"""CPU cost of an extend in parts over Flight against raw Flight DoPut of the same bytes (issue 28).

TransferQueue's fixed shape (SAMPLES x 9 x 8192 float32 + a `done` column; 302 MB at 1024 samples) PUT over Flight
on 127.0.0.1, client and server in ONE process, timed in process CPU time (`time.process_time`: every thread, the
client's and the server's), which holds on a loaded machine where wall time does not. Rows, medians of `--repeats`
after one warm-up each, interleaved (raw, direct, assembled, raw, ...):

  memcpy      the ceiling: one np.copyto of the payload bytes into memory already touched
  raw         a pyarrow Flight server whose DoPut keeps the received table (`read_all`); the client sends the
              payload as ONE record batch (no validation, no store)
  direct      `RemoteStore.extend(rows)` (one call) into `ab.serve(store)` with max_batch_bytes 256 MiB: the batch
              goes in parts of 8 MiB (`parts.PIPELINE_PART_BYTES`, the size a client sends to a server that writes
              parts into its ring), each copied by the server straight into the ring (store/pieces.py)
  assembled   the same into a server with the default `parts_into_ring=False` (parts of up to 64 MiB, copied
              into one assembled batch, then `store.extend` copies that into the ring)

    python -m benchmarks.bench_parts_cpu [--quick] [--samples N] [--repeats R]

Full mode (302 MB, 5 repeats) takes about a minute; `--quick` (1/8 of the size, 3 repeats) a few seconds. Prints
a table, writes benchmarks/out/parts_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

import arrowbuf as ab

from .bench_tq_xproc import payload, record_batch, schema

OUT = pathlib.Path(__file__).parent / "out" / "parts_cpu.json"


class _Raw(flight.FlightServerBase):
    """The ceiling: DoPut keeps the table."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.table: Any = None

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        self.table = None
        self.table = reader.read_all()


def _cpu(fn: Any) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    size = args.samples or (128 if args.quick else 1024)
    repeats = args.repeats or (3 if args.quick else 5)
    rows = payload("fixed", size)
    rb = record_batch("fixed", rows)
    nbytes = rb.nbytes
    load_before = _uptime()

    raw = _Raw()
    raw_client = flight.FlightClient(f"grpc://127.0.0.1:{raw.port}")
    stores = {k: ab.ExperienceStore(schema("fixed"), capacity=size, sampler="fifo", name="xproc")
              for k in ("direct", "assembled")}
    part_cap = min(256 << 20, max(1 << 20, nbytes // 4))  # the default 256 MiB at full size: parts in any mode
    # direct: parts written into the ring (ServerLimits.parts_into_ring); assembled: the default path
    servers = {k: ab.serve(s, max_batch_bytes=part_cap, parts_into_ring=k == "direct") for k, s in stores.items()}
    remotes = {k: ab.connect(srv.location, store="xproc") for k, srv in servers.items()}
    src = np.concatenate([np.asarray(v).reshape(-1).view(np.uint8) for v in rows.values()])
    dst = np.empty_like(src)
    np.copyto(dst, src)

    def raw_put() -> None:
        writer, _ = raw_client.do_put(flight.FlightDescriptor.for_path("x"), rb.schema)
        writer.write_batch(rb)
        writer.close()

    runs: dict[str, Any] = {
        "memcpy": lambda: np.copyto(dst, src),
        "raw": raw_put,
        "direct": lambda: remotes["direct"].extend(rows),
        "assembled": lambda: remotes["assembled"].extend(rows),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    try:
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(repeats):
            for k, fn in runs.items():
                times[k].append(_cpu(fn))
        assert len(stores["direct"]) == size and len(stores["assembled"]) == size
    finally:
        for r in remotes.values():
            r.close()
        for srv in servers.values():
            srv.close()
        for s in stores.values():
            s.close()
        raw_client.close()
        raw.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    load_after = _uptime()
    print(f"fixed {size} x 9 x 8192 float32 + done: {nbytes / 1e6:.0f} MB per PUT; process CPU ms, median of "
          f"{repeats} [range]; load before: {load_before}; after: {load_after}")
    print(f"{'path':<11}{'CPU ms':>9}  {'range':<17}{'raw / path':>11}{'memcpy / path':>15}")
    for k, v in times.items():
        print(f"{k:<11}{med[k] * 1e3:>9.0f}  [{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}]".ljust(38)
              + f"{med['raw'] / med[k]:>10.2f}x{med['memcpy'] / med[k]:>14.2f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"bytes": nbytes, "samples": size, "repeats": repeats, "cpu_s": times,
                               "median_cpu_s": med, "vs_raw": {k: med["raw"] / v for k, v in med.items()},
                               "load_before": load_before, "load_after": load_after, "pyarrow": pa.__version__},
                              indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
