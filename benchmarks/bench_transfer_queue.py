"""TransferQueue's own performance script against TransferQueue 0.1.11 and against arrowbuf.compat (issue 27).

TransferQueue ships `scripts/performance_test/perftest.py` (installed with the `transferqueue` wheel as the
top-level package `scripts`): a writer Ray actor `kv_batch_put`s a TensorDict of `global_batch_size` samples x
`field_num` float32 fields of `seq_len` (with `--use_complex_case`: a third jagged nested tensors, a third strings),
a reader actor `kv_list`s and `kv_batch_get`s them, the writer `kv_clear`s; it times put and get and writes a CSV.
This benchmark runs that script unmodified, once per backend, each in its own process and Ray job
(`ray.init(num_cpus=8)`: TransferQueue's actors ask for more CPUs than this machine has; one node, all traffic
inside the host):

  transferqueue   `import transfer_queue as tq` is TransferQueue 0.1.11 (SimpleStorage, 2 storage units)
  arrowbuf        the same script with the name `transfer_queue` bound to `arrowbuf.compat.transfer_queue` (in the
                  driver and, by a Ray worker setup hook, in every worker): the import is the only change. The
                  system lives in one Ray actor (arrowbuf.compat.transfer_queue.ray), its field groups in /dev/shm:
                  the writer and reader actors put and read the values themselves, plans and locations go over
                  Arrow Flight
  arrowbuf-flight the same with `arrowbuf: {shared_memory: false}` in the config: values over Flight too, as
                  between nodes

and, as the ceilings measured in the same run, one numpy copy of the same bytes in one process (`memcpy`: warm,
best of 5) and the same copy after the buffers sat idle as long as perftest sleeps before each phase (`memcpy after
idle`: 10 s before a put, which follows the previous iteration's `time.sleep(10)`, 2 s before a get; median of 3).
On a VM whose host takes back memory its guest leaves idle (this project's machines: a 320 MiB copy takes 27 ms warm,
40-56 ms after 2 s idle, 119-138 ms after 10 s), a put that copies its bytes once cannot be faster than the second,
so the table also gives the most any such put or get could be against TransferQueue's (`bound`). With the
arrowbuf-flight backend, a third ceiling: a raw Arrow Flight put and get of the simple case's bytes between two
processes after the same idle (`raw Flight`: the server keeps the record batches as received and streams them back
from memory, no checks, no store), and the most any put or get over Flight could be against TransferQueue's.

    python -m benchmarks.bench_transfer_queue [--quick] [--complex] [--batch 1024 --seq-len 8192 --fields 10]
                                              [--iterations 4] [--rounds 2]

`--rounds R` runs each backend R times, interleaved (round i in order, round i+1 reversed). Each run is its own
process tree with its own local Ray cluster in a private temp dir (never another job's: RAY_ADDRESS is unset); its
peak RSS (sum over the tree, and the largest process) is sampled every 0.2 s, `uptime` is recorded before and after,
and whatever of the tree outlives the run is killed by pid (listed in the JSON as `leftover_pids_killed`).

Prints a table and writes benchmarks/out/transfer_queue.json. Needs `transferqueue==0.1.11` (pip install
'arrowbuf[bench-tq]') for the TransferQueue row and the script; without it, nothing runs. The script sleeps 16 s per
iteration by design (between its phases); its figures are its own put and get spans.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
BACKENDS = ("transferqueue", "arrowbuf", "arrowbuf-flight")
#: arrowbuf.compat's own settings per backend (TransferQueue's config is the same for all)
ARROWBUF_CONFIG = {"arrowbuf": "", "arrowbuf-flight": "arrowbuf:\n  shared_memory: false\n"}
CONFIG = """\
controller:
  sampler: SequentialSampler
  polling_mode: false
backend:
  storage_backend: SimpleStorage
  SimpleStorage:
    total_storage_size: 100000
    num_data_storage_units: 2
"""


def swap_import() -> None:
    """Bind the name `transfer_queue` to arrowbuf's module (the Ray worker setup hook of the arrowbuf run)."""
    import arrowbuf.compat.transfer_queue as tq

    sys.modules["transfer_queue"] = tq


def perftest_path() -> pathlib.Path | None:
    spec = importlib.util.find_spec("transfer_queue")
    if spec is None or not spec.origin:
        return None
    site = pathlib.Path(spec.origin).parent.parent
    path = site / "scripts" / "performance_test" / "perftest.py"
    return path if path.exists() else None


def child(backend: str, script: str, argv: list[str], ray_tmp: str | None = None) -> None:
    """Run TransferQueue's perftest.py in this process, on `backend`."""
    import runpy

    import ray

    runtime_env: dict[str, Any] = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    if backend.startswith("arrowbuf"):
        swap_import()
        runtime_env["worker_process_setup_hook"] = "benchmarks.bench_transfer_queue.swap_import"
    # a private temp dir: this run's own local cluster, never another job's (RAY_ADDRESS is unset by the parent)
    ray.init(num_cpus=8, include_dashboard=False, runtime_env=runtime_env, log_to_driver=False,
             _temp_dir=ray_tmp)
    try:
        # perftest pins its actors with the resource node:<head_node_ip>: this machine's own address (one node; its
        # traffic stays inside the host)
        argv = [ray.util.get_node_ip_address() if a == "HEAD" else a for a in argv]
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
    finally:
        ray.shutdown()


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _rss(procs: list[Any]) -> list[tuple[int, str, int]]:
    import psutil

    out = []
    for p in procs:
        try:
            out.append((p.pid, " ".join(p.cmdline()[:3])[:80], p.memory_info().rss))
        except psutil.Error:
            pass
    return out


def run_backend(backend: str, script: pathlib.Path, args: argparse.Namespace, tmp: pathlib.Path,
                tag: str = "") -> tuple[list[dict], dict[str, Any]]:
    """One perftest run on `backend` in its own process tree; its rows, and the run's peak RSS and load.

    Peak RSS: sampled every 0.2 s over the child's whole process tree (driver, Ray's GCS/raylet/workers, the
    writer/reader actors and the storage actors); `tree` is the peak of their sum, `largest` the peak of the largest
    single process. RSS counts shared pages (Ray's object store, shared memory) in every process that touched them.
    Every process of the tree still alive when the run ends is killed by pid and counted in `leftover`.
    """
    import threading

    import psutil

    cfg = tmp / f"config-{backend}.yaml"
    cfg.write_text(CONFIG + ARROWBUF_CONFIG.get(backend, ""))
    out_csv = tmp / f"{backend}{tag}.csv"
    ray_tmp = tempfile.mkdtemp(prefix="rtq-", dir="/tmp")
    argv = ["--backend_config", str(cfg), "--head_node_ip", "HEAD", "--global_batch_size", str(args.batch),
            "--field_num", str(args.fields), "--seq_len", str(args.seq_len), "--num_test_iterations",
            str(args.iterations), "--output_csv", str(out_csv)]
    if args.complex:
        argv.append("--use_complex_case")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "benchmarks.bench_transfer_queue", "--child", backend, "--script", str(script),
           "--ray-tmp", ray_tmp, "--", *argv]
    up0 = uptime()
    t0 = time.perf_counter()
    log = open(tmp / f"{backend}{tag}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    peak = {"tree": 0, "largest": 0, "largest_cmd": ""}
    seen: dict[int, Any] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            procs = _tree(proc.pid)
            for p in procs:
                seen.setdefault(p.pid, p)
            rss = _rss(procs)
            if rss:
                peak["tree"] = max(peak["tree"], sum(r[2] for r in rss))
                big = max(rss, key=lambda r: r[2])
                if big[2] > peak["largest"]:
                    peak["largest"], peak["largest_cmd"] = big[2], big[1]
            done.wait(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    done.set()
    th.join()
    wall = time.perf_counter() - t0
    leftover = []
    for pid, p in seen.items():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                leftover.append(pid)
                p.kill()
        except psutil.Error:
            pass
    import shutil

    shutil.rmtree(ray_tmp, ignore_errors=True)
    up1 = uptime()
    log.seek(0)
    text = log.read()
    log.close()
    if rc != 0 or not out_csv.exists():
        raise RuntimeError(f"perftest on {backend} failed (exit {rc}):\n{text[-3000:]}")
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["wall_s"] = wall
    run = {"backend": backend, "tag": tag, "wall_s": wall, "uptime_before": up0, "uptime_after": up1,
           "peak_rss_tree_MiB": peak["tree"] / 2**20, "peak_rss_largest_MiB": peak["largest"] / 2**20,
           "peak_rss_largest_cmd": peak["largest_cmd"], "leftover_pids_killed": leftover,
           "put_s": [float(r["put_time"]) for r in rows], "get_s": [float(r["get_time"]) for r in rows]}
    print(f"{backend:<15}{tag:<6} put {' '.join(f'{x:.3f}' for x in run['put_s'])}  get "
          f"{' '.join(f'{x:.3f}' for x in run['get_s'])}  peak RSS tree {run['peak_rss_tree_MiB']:.0f} MiB "
          f"(largest {run['peak_rss_largest_MiB']:.0f})  [{up0.split('load')[-1]} ->{up1.split('load')[-1]}]"
          f"{'  LEFTOVER ' + str(leftover) if leftover else ''}", flush=True)
    return rows, run


def memcpy_ceiling(nbytes: int, repeats: int = 5) -> float:
    """GB/s of one numpy copy of `nbytes` (best of `repeats`; the destination is touched first)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


#: seconds perftest's loop sleeps before each phase it times: `time.sleep(10)` ends each iteration (before the next
#: put), `time.sleep(2)` comes before the get
IDLE_BEFORE = {"put": 10.0, "get": 2.0}


def memcpy_after_idle(nbytes: int, idle_s: float, repeats: int = 3) -> float:
    """Seconds of one numpy copy of `nbytes` between buffers both left untouched for `idle_s` seconds (median of
    `repeats`): the first pass over memory idle that long, as perftest's put and get make it."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def serve_raw_flight() -> None:
    """What any put or get over Arrow Flight must at least do (`raw Flight`): the server keeps the record batches
    it received as they came (no check, no copy into a store) and streams them back from memory as they are."""
    import pyarrow as pa
    import pyarrow.flight as flight

    class Server(flight.FlightServerBase):  # type: ignore[misc]
        table: pa.Table | None = None

        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            self.table = None
            self.table = pa.Table.from_batches([c.data for c in reader if c.data is not None])

        def do_get(self, context: Any, ticket: Any) -> Any:
            assert self.table is not None
            return flight.RecordBatchStream(self.table)

    server = Server("grpc://127.0.0.1:0")
    print(server.port, flush=True)
    sys.stdin.read()  # serves until the parent closes its end
    server.shutdown()


def flight_after_idle(batch: int, fields: int, seq_len: int, repeats: int = 3) -> dict[str, float]:
    """Seconds of a raw Arrow Flight put and get (`serve_raw_flight`) of perftest's bytes between two processes on this
    host, in messages of the size arrowbuf's compat layer sends (`wire.CHUNK_BYTES`), each after perftest's idle
    before that phase (`IDLE_BEFORE`); median of `repeats`."""
    import pyarrow as pa
    import pyarrow.flight as flight

    from arrowbuf.compat.transfer_queue.wire import chunk_rows

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_transfer_queue", "--raw-flight-server"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        client = flight.FlightClient(f"grpc://127.0.0.1:{port}")
        cols = [pa.FixedSizeListArray.from_arrays(pa.array(np.full(batch * seq_len, i, dtype=np.float32)), seq_len)
                for i in range(fields)]
        table = pa.table(cols, names=[f"f{i}" for i in range(fields)])
        times: dict[str, list[float]] = {"put": [], "get": []}
        for _ in range(repeats):
            time.sleep(IDLE_BEFORE["put"])
            t0 = time.perf_counter()
            writer, reader = client.do_put(flight.FlightDescriptor.for_command(b"put"), table.schema)
            with writer:
                writer.write_table(table, max_chunksize=chunk_rows(table))
                writer.done_writing()
            times["put"].append(time.perf_counter() - t0)
            time.sleep(IDLE_BEFORE["get"])
            t0 = time.perf_counter()
            got = client.do_get(flight.Ticket(b"get")).read_all()
            times["get"].append(time.perf_counter() - t0)
            assert got.num_rows == batch
            del got
        client.close()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 256, seq_len 1024, 4 fields, 3 iterations")
    ap.add_argument("--complex", action="store_true", help="perftest's complex case (nested tensors, strings)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--fields", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=4, help="perftest's own default: 4")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per backend, interleaved (round i runs the backends in order, i+1 reversed)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--ceilings", action="store_true",
                    help="only measure the memcpy ceilings (warm and after perftest's idle) at the run's size")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--raw-flight-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--script", help=argparse.SUPPRESS)
    ap.add_argument("--ray-tmp", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_flight_server:
        serve_raw_flight()
        return 0
    if args.child:
        child(args.child, args.script, [a for a in args.rest if a != "--"], args.ray_tmp)
        return 0
    if args.quick:
        args.batch, args.seq_len, args.fields, args.iterations = 256, 1024, 4, 3
        args.timeout = min(args.timeout, 600)
    if args.ceilings:
        nbytes = args.batch * args.seq_len * args.fields * 4
        warm = nbytes / memcpy_ceiling(nbytes) / 1e9
        idle = {phase: memcpy_after_idle(nbytes, s) for phase, s in IDLE_BEFORE.items()}
        print(f"{nbytes / 2**20:.0f} MiB copy: warm {warm * 1e3:.1f} ms; after {IDLE_BEFORE['put']:.0f} s idle "
              f"(before a put) {idle['put'] * 1e3:.1f} ms; after {IDLE_BEFORE['get']:.0f} s idle (before a get) "
              f"{idle['get'] * 1e3:.1f} ms; load {os.getloadavg()[0]:.2f}")
        raw = flight_after_idle(args.batch, args.fields, args.seq_len)
        print(f"raw Flight between two processes, same idle: put {raw['put'] * 1e3:.1f} ms, get "
              f"{raw['get'] * 1e3:.1f} ms; load {os.getloadavg()[0]:.2f}")
        return 0
    script = perftest_path()
    if script is None:
        print("transferqueue==0.1.11 is not installed (pip install 'arrowbuf[bench-tq]'): nothing to run")
        return 0
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-tq-") as tmp:
        for rnd in range(args.rounds):
            for backend in (backends if rnd % 2 == 0 else backends[::-1]):
                got, run = run_backend(backend, script, args, pathlib.Path(tmp), tag=f"r{rnd}")
                runs.append(run)
                for r in got:
                    rows.append({**r, "storage": r.get("backend"), "backend": backend, "round": rnd})
    size_gb = float(rows[0]["total_data_size_gb"])
    ceiling = memcpy_ceiling(int(size_gb * 1024**3))
    idle = {phase: memcpy_after_idle(int(size_gb * 1024**3), s) for phase, s in IDLE_BEFORE.items()}
    # (the simple case's layout: in the complex case a third of the fields are ragged and a third strings)
    raw = flight_after_idle(args.batch, args.fields, args.seq_len) if "arrowbuf-flight" in backends else None
    summary: dict[str, dict[str, float]] = {}
    for backend in {r["backend"] for r in rows}:
        mine = [r for r in rows if r["backend"] == backend]
        put = float(np.median([float(r["put_time"]) for r in mine]))
        get = float(np.median([float(r["get_time"]) for r in mine]))
        summary[backend] = {"put_s": put, "get_s": get, "put_GBps": size_gb * 1.073741824 / put,
                            "get_GBps": size_gb * 1.073741824 / get, "iterations": len(mine),
                            "peak_rss_tree_MiB": max(r["peak_rss_tree_MiB"] for r in runs if r["backend"] == backend),
                            "peak_rss_largest_MiB": max(r["peak_rss_largest_MiB"] for r in runs
                                                        if r["backend"] == backend)}
    print(f"\nTransferQueue perftest ({'complex' if args.complex else 'simple'} case): batch {args.batch} x "
          f"{args.fields} fields x seq_len {args.seq_len} = {size_gb * 1024:.1f} MiB, {args.iterations} iteration(s),"
          f" load {os.getloadavg()[0]:.2f}")
    print(f"{'backend':<15}{'put s':>10}{'get s':>10}{'put GB/s':>10}{'get GB/s':>10}{'put/ceil':>10}{'get/ceil':>10}"
          f"{'RSS MiB':>10}")
    for backend in [b for b in BACKENDS if b in summary]:
        s = summary[backend]
        print(f"{backend:<15}{s['put_s']:>10.4f}{s['get_s']:>10.4f}{s['put_GBps']:>10.3f}{s['get_GBps']:>10.3f}"
              f"{s['put_GBps'] / ceiling:>10.3f}{s['get_GBps'] / ceiling:>10.3f}{s['peak_rss_tree_MiB']:>10.0f}")
    print(f"{'memcpy':<15}{'':>10}{'':>10}{ceiling:>10.3f}{ceiling:>10.3f}")
    print(f"{'memcpy idle':<15}{idle['put']:>10.4f}{idle['get']:>10.4f}"
          f"{size_gb * 1.073741824 / idle['put']:>10.3f}{size_gb * 1.073741824 / idle['get']:>10.3f}"
          f"   (after {IDLE_BEFORE['put']:.0f} s / {IDLE_BEFORE['get']:.0f} s idle, as perftest's put / get)")
    if raw is not None:
        print(f"{'raw Flight':<15}{raw['put']:>10.4f}{raw['get']:>10.4f}"
              f"{size_gb * 1.073741824 / raw['put']:>10.3f}{size_gb * 1.073741824 / raw['get']:>10.3f}"
              f"   (two processes, the same idle; the simple case's layout)")
    if "transferqueue" in summary:
        t = summary["transferqueue"]
        print(f"bound: a put or get that copies its bytes once at most {t['put_s'] / idle['put']:.2f}x / "
              f"{t['get_s'] / idle['get']:.2f}x TransferQueue's here")
        if raw is not None:
            print(f"bound: a put or get over Flight at most {t['put_s'] / raw['put']:.2f}x / "
                  f"{t['get_s'] / raw['get']:.2f}x TransferQueue's here")
    for mine in ("arrowbuf", "arrowbuf-flight"):
        if "transferqueue" in summary and mine in summary:
            a, t = summary[mine], summary["transferqueue"]
            print(f"{mine} / TransferQueue throughput: put {a['put_GBps'] / t['put_GBps']:.2f}x, "
                  f"get {a['get_GBps'] / t['get_GBps']:.2f}x, peak RSS of the tree "
                  f"{a['peak_rss_tree_MiB'] / t['peak_rss_tree_MiB']:.2f}x")
    OUT.mkdir(parents=True, exist_ok=True)
    name = "transfer_queue_complex.json" if args.complex else "transfer_queue.json"
    (OUT / name).write_text(json.dumps({
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "load": os.getloadavg(),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "script", "rest")},
        "memcpy_GBps": ceiling, "memcpy_after_idle_s": idle, "raw_flight_after_idle_s": raw,
        "idle_before_s": IDLE_BEFORE, "summary": summary,
        "runs": runs, "rows": rows}, indent=1))
    print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
