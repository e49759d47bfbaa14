"""Flight service benchmark (issue 5): remote sampling and ingest over loopback, as ratios to raw Flight.

Rows, for the atari and mujoco workloads:
  sample/doget      `remote.sample(B)` (one DoGet per batch)        vs raw DoGet of a prebuilt batch of the same bytes
  sample/exchange   a learner session (DoExchange, server prefetch 2) vs one raw DoGet streaming prebuilt batches
    prefetch=0      the same session without server-side prefetch
  ingest/writer     `remote.writer().send(batch)` (DoPut + acks)   vs raw DoPut of the same batches (server discards)
  ingest/extend     `remote.extend(batch)` (one DoPut per batch)     vs the same raw DoPut ceiling
The servers (arrowbuf's and the raw one) run together in a subprocess, as a remote store would; the client is this
process. Ceiling and arrowbuf alternate within each repeat; every number is the median over repeats. DeepMind
Reverb is not measured here (it needs its own TF 2.15 / numpy<2 environment). "local sample MB/s" is
`store.sample(B)` in the server process without any network: remote sampling cannot beat it, whatever the ceiling.

    python -m benchmarks.bench_flight [--repeats 3] [--quick]

Prints a table and writes benchmarks/out/flight.json.
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
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SAMPLE_CAPACITY = {"atari": 8192, "mujoco": 65536}
INGEST_CAPACITY = {"atari": 2048, "mujoco": 16384}
INGEST_BATCH = {"atari": 256, "mujoco": 1024}
BATCHES = (256, 4096)
EPISODE = 100


def _steps(workload: str, n: int, rng: np.random.Generator, *, ends: bool) -> dict[str, np.ndarray]:
    if workload == "atari":
        obs = rng.integers(0, 255, size=(n, 4, 84, 84), dtype=np.uint8)
        action = rng.integers(0, 18, size=n, dtype=np.int64)
    else:
        obs = rng.standard_normal((n, 376), dtype=np.float32)
        action = rng.standard_normal((n, 17), dtype=np.float32)
    term = np.zeros(n, bool)
    if ends:
        term[EPISODE - 1::EPISODE] = True
    out = {"obs": obs, "action": action, "reward": rng.standard_normal(n, dtype=np.float32), "terminated": term,
           "truncated": np.zeros(n, bool)}
    if ends:
        out["next_obs"] = obs  # read only on the steps that end an episode
    return out


# ---------------------------------------------------------------------------------------------------- server side
class RawServer(flight.FlightServerBase):
    """The ceiling: DoGet streams prebuilt batches, DoPut reads batches and discards them."""

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.batches: dict[str, pa.RecordBatch] = {}
        self.stores: dict[str, Any] = {}

    def do_action(self, context: Any, action: flight.Action) -> list[bytes]:
        """`time_sample`: seconds per local `store.sample(n)` in this process (no network): the store's bound."""
        req = json.loads(action.body.to_pybytes())
        store = self.stores[req["store"]]
        store.sample(req["n"])
        t0 = time.perf_counter()
        for _ in range(req["reps"]):
            store.sample(req["n"])
        return [json.dumps((time.perf_counter() - t0) / req["reps"]).encode()]

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        req = json.loads(ticket.ticket)
        batch = self.batches[req["key"]]
        return flight.RecordBatchStream(pa.Table.from_batches([batch] * req["count"]))

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        for _ in reader:
            pass


def serve_main(workloads: list[str]) -> None:
    import arrowbuf as ab

    rng = np.random.default_rng(0)
    stores = {}
    raw = RawServer()
    for wl in workloads:
        schema = ab.load_schema(ROOT / "schemas" / f"{wl}.yaml")
        store = ab.ExperienceStore(schema, capacity=SAMPLE_CAPACITY[wl], seed=0, name=wl)
        pool = _steps(wl, 1024, rng, ends=True)
        for _ in range(SAMPLE_CAPACITY[wl] // 1024):
            store.extend(pool)
        stores[wl] = raw.stores[wl] = store
        stores[f"{wl}_ingest"] = ab.ExperienceStore(schema, capacity=INGEST_CAPACITY[wl], seed=0,
                                                    name=f"{wl}_ingest")
        for n in BATCHES:  # the ceiling's batches: the same columns, types and bytes as a sample
            raw.batches[f"{wl}:{n}"] = store.sample(n).data
    server = ab.serve(stores, max_batch_rows=8192, max_prefetch_bytes=1 << 30)
    print(json.dumps({"ab": server.location, "raw": f"grpc://127.0.0.1:{raw.port}"}), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    server.close()
    raw.shutdown()


# ---------------------------------------------------------------------------------------------------- client side
def _timed(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm up (connections, first touch of buffers)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _read_one(reader: Any) -> Any:
    chunk = reader.read_chunk()
    try:
        reader.read_chunk()
    except StopIteration:
        pass
    return chunk


def measure(workloads: list[str], repeats: int, quick: bool) -> list[dict[str, Any]]:
    import arrowbuf as ab

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_flight", "--serve", *workloads], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        locations = json.loads(proc.stdout.readline())
        raw = flight.FlightClient(locations["raw"])
        rows: dict[tuple[str, str, int], dict[str, list[float]]] = {}

        def add(wl: str, mode: str, n: int, ours: float, ceiling: float, nbytes: int, local: float = 0.0) -> None:
            r = rows.setdefault((wl, mode, n), {"ours_s": [], "ceiling_s": [], "local_s": [], "bytes": [nbytes]})
            r["ours_s"].append(ours)
            r["ceiling_s"].append(ceiling)
            r["local_s"].append(local)

        rng = np.random.default_rng(1)
        for wl in workloads:
            remote = ab.connect(locations["ab"], store=wl)
            ingest = ab.connect(locations["ab"], store=f"{wl}_ingest")
            put_batches = [ingest.to_batch(_steps(wl, INGEST_BATCH[wl], rng, ends=False)) for _ in range(4)]
            put_bytes = put_batches[0].nbytes
            k_put = max(4, int((50 if quick else 200) * 2**20 // put_bytes))
            for _ in range(repeats):
                for n in BATCHES:
                    nbytes = remote.sample(n).data.nbytes
                    reps = max(3, min(40, int((150 if quick else 500) * 2**20 // nbytes)))
                    per_call = flight.Ticket(json.dumps({"key": f"{wl}:{n}", "count": 1}).encode())
                    ceiling = _timed(lambda t=per_call: _read_one(raw.do_get(t)), reps)
                    ours = _timed(lambda r=remote, k=n: r.sample(k), reps)
                    body = json.dumps({"store": wl, "n": n, "reps": reps}).encode()
                    local = json.loads(next(iter(raw.do_action(flight.Action("time_sample", body)))).body.to_pybytes())
                    add(wl, "sample/doget", n, ours, ceiling, nbytes, local)
                    stream = flight.Ticket(json.dumps({"key": f"{wl}:{n}", "count": reps}).encode())

                    def raw_stream(t: flight.Ticket = stream) -> None:
                        for _ in raw.do_get(t):
                            pass

                    ceiling = _timed(raw_stream, 1) / reps
                    for prefetch, mode in ((2, "sample/exchange"), (0, "  prefetch=0")):
                        with remote.session(n, prefetch=prefetch, ahead=2) as session:
                            next(session)
                            t0 = time.perf_counter()
                            for _ in range(reps):
                                next(session)
                            ours = (time.perf_counter() - t0) / reps
                        add(wl, mode, n, ours, ceiling, nbytes, local)

                def raw_put(pb: list = put_batches, k: int = k_put) -> None:
                    writer, _ = raw.do_put(flight.FlightDescriptor.for_path("x"), pb[0].schema)
                    for i in range(k):
                        writer.write_batch(pb[i % 4])
                    writer.done_writing()
                    writer.close()

                def ab_writer(dst: Any = ingest, pb: list = put_batches, k: int = k_put) -> None:
                    with dst.writer(max_in_flight=8) as w:
                        for i in range(k):
                            w.send(pb[i % 4])

                def ab_extend(dst: Any = ingest, pb: list = put_batches, k: int = k_put) -> None:
                    for i in range(k):
                        dst.extend(pb[i % 4])

                ab_writer()  # first fill: wrap the ring so that the timed ingest is steady state
                ceiling = _timed(raw_put, 1) / k_put
                add(wl, "ingest/writer", INGEST_BATCH[wl], _timed(ab_writer, 1) / k_put, ceiling, put_bytes)
                add(wl, "ingest/extend", INGEST_BATCH[wl], _timed(ab_extend, 1) / k_put, ceiling, put_bytes)
            remote.close()
            ingest.close()
        raw.close()
    finally:
        proc.stdin.close()
        proc.wait(60)
    out = []
    for (wl, mode, n), r in rows.items():
        ours, ceiling, nbytes = statistics.median(r["ours_s"]), statistics.median(r["ceiling_s"]), r["bytes"][0]
        # the ratio of each repeat (ceiling and arrowbuf measured back to back), then the median: robust to the
        # machine's load drifting between repeats
        ratio = statistics.median(c / o for c, o in zip(r["ceiling_s"], r["ours_s"]))
        local = statistics.median(r["local_s"])
        out.append({"workload": wl, "mode": mode, "batch_rows": n, "batch_mb": nbytes / 1e6,
                    "items_per_s": n / ours, "mb_per_s": nbytes / ours / 1e6,
                    "ceiling_items_per_s": n / ceiling, "ceiling_mb_per_s": nbytes / ceiling / 1e6,
                    "local_sample_mb_per_s": nbytes / local / 1e6 if local else None,
                    "ratio": ratio, "repeats": len(r["ours_s"])})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer bytes per measurement")
    ap.add_argument("--workloads", nargs="+", default=["atari", "mujoco"])
    ap.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve_main(args.serve)
        return
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = measure(args.workloads, args.repeats, args.quick)
    elapsed = time.perf_counter() - t0
    load = (load_before, os.getloadavg()[0])
    print(f"{'workload':8} {'mode':16} {'batch':>6} {'MB/batch':>9} {'items/s':>10} {'MB/s':>8} "
          f"{'ceiling MB/s':>13} {'ratio':>6} {'local sample MB/s':>18}")
    for r in results:
        local = f"{r['local_sample_mb_per_s']:18.0f}" if r["local_sample_mb_per_s"] else f"{'':18}"
        print(f"{r['workload']:8} {r['mode']:16} {r['batch_rows']:6d} {r['batch_mb']:9.2f} {r['items_per_s']:10.0f} "
              f"{r['mb_per_s']:8.0f} {r['ceiling_mb_per_s']:13.0f} {r['ratio']:6.2f} {local}")
    print(f"({elapsed:.0f}s; medians over {args.repeats} repeats; ratio: of ceiling time / arrowbuf time per repeat; "
          f"load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs)")
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "pyarrow": pa.__version__, "cpus": os.cpu_count(),
            "machine": platform.machine(), "seconds": elapsed, "loadavg_1min_before_after": load,
            "repeats": args.repeats, "quick": args.quick,
            "ceiling": "raw Flight over loopback, same process layout: DoGet of prebuilt batches of the same "
                       "bytes (per call, or streamed), DoPut of the same batches into a server that discards them",
            "reverb": "not measured (optional; needs dm-reverb 0.14 + tensorflow 2.15 + numpy<2 in its own venv)"}
    (OUT / "flight.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
