"""Shared-memory benchmark (issue 4): 1, 2 and 4 writer processes + 1 sampler process on one store.

For each buffer and workload: aggregate insert rows/s of the writers (per-step appends, and extends of 1000 rows) while
a sampler process draws batches of 256, and the sampler's samples/s alone and while the writers run. Buffers, in one
run and on the same machine:

- arrowbuf      `ExperienceStore(..., tier="shm")`, attached by name in every process (next_obs derived).
- numpy ceiling an unsynchronised ring of numpy arrays over files in /dev/shm: writer w of W owns 1/W of the ring, the
                sampler gathers sorted random rows (obs, the next row's obs, action, reward, flags) with no checks.
- cpprb         `MPReplayBuffer` (next_obs stored as its own column: its next_of does not return next_obs here).
- torchrl       `ReplayBuffer(LazyMemmapStorage(..., scratch_dir=/dev/shm/...), shared=True)` (workers forked).

Processes are spawned once per (buffer, workload) and kept; every timed window starts at the same instant in all of
them. Each number is the median over `--repeat` windows (interleaved: alone, 1, 2, 4 writers, ...). The ring is full
(steady state) before any window. Prints a table and writes benchmarks/out/shm.json.

    python -m benchmarks.bench_shm [--quick] [--window 0.5] [--repeat 3] [--buffers arrowbuf numpy cpprb torchrl]
    python -m benchmarks.bench_shm --merge out/shm.run1.json out/shm.run2.json out/shm.run3.json   # medians
    python -m benchmarks.bench_shm --issue18 [--lib TREE]   # issue 18's rows (see ISSUE18); TREE: another checkout
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import shutil
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
CAPACITY = {"atari": 30_000, "mujoco": 200_000}  # the same for every buffer; bounded so that a run stays short
POOL = {"atari": 1000, "mujoco": 20_000}  # source steps each writer cycles through
CHUNK = 1000
BATCH = 256
WRITERS = (1, 2, 4)
MODES = ("step", "chunk")
FIELDS = ("obs", "action", "reward", "terminated", "truncated")
CTX = mp.get_context("spawn")
# TorchRL's shared buffer makes its locks in the default (fork) context and must reach workers that way; forking
# also spares five imports of torch per run
CTX_FOR = {"torchrl": mp.get_context("fork")}


# ---------------------------------------------------------------------------------------------- adapters
class _Adapter:
    """What a worker process does with one buffer: write a step, write a chunk, sample a batch."""

    def __init__(self, handle: Any, workload: str, role: str, wid: int) -> None:
        from .workloads import make_steps

        self.handle = handle
        self.role = role
        self.wid = wid
        if role == "writer":
            self.pool = make_steps(workload, POOL[workload], seed=wid)
            n = len(self.pool["obs"])
            self.steps = [{k: v[j] for k, v in self.pool.items()} for j in range(n)]
            self.chunks = [{k: v[a:a + CHUNK] for k, v in self.pool.items()} for a in range(0, n - CHUNK + 1, CHUNK)]
        self.j = 0
        self.s = 0

    def step(self, writers: int) -> int:
        self.j = (self.j + 1) % len(self.steps)
        self.write_step(self.steps[self.j], writers)
        return 1

    def chunk(self, writers: int) -> int:
        self.s = (self.s + 1) % len(self.chunks)
        return self.write_chunk(self.chunks[self.s], writers) or CHUNK

    def close(self) -> None:
        pass


class _Arrowbuf(_Adapter):
    def __init__(self, handle: Any, workload: str, role: str, wid: int) -> None:
        import arrowbuf as ab

        super().__init__(handle, workload, role, wid)
        self.store = ab.ExperienceStore.attach(handle, seed=wid)

    def write_step(self, step: dict, writers: int) -> None:
        self.store.append(step)

    def write_chunk(self, chunk: dict, writers: int) -> None:
        self.store.extend(chunk)

    def sample(self) -> int:
        self.store.sample(BATCH)
        return BATCH

    def close(self) -> None:
        self.store.close()


class _Numpy(_Adapter):
    def __init__(self, handle: Any, workload: str, role: str, wid: int) -> None:
        super().__init__(handle, workload, role, wid)
        path, capacity, specs = handle
        self.capacity = capacity
        self.cols = {c: _map(os.path.join(path, c), d, (capacity, *s)) for c, (s, d) in specs.items()}
        self.rng = np.random.default_rng(wid)
        self.cursor = 0

    def _region(self, writers: int) -> tuple[int, int]:
        size = self.capacity // writers
        return self.wid * size, size

    def write_step(self, step: dict, writers: int) -> None:
        base, size = self._region(writers)
        i = base + self.cursor % size
        self.cursor += 1
        for c, arr in self.cols.items():
            arr[i] = step[c]

    def write_chunk(self, chunk: dict, writers: int) -> int:
        base, size = self._region(writers)
        m = min(CHUNK, size)
        off = self.cursor % (size - m + 1)
        self.cursor += m
        for c, arr in self.cols.items():
            arr[base + off:base + off + m] = chunk[c][:m]
        return m

    def sample(self) -> int:
        idx = np.sort(self.rng.integers(0, self.capacity - 1, BATCH))
        batch = {c: np.take(arr, idx, axis=0) for c, arr in self.cols.items()}  # a batch: all columns kept
        batch["next_obs"] = np.take(self.cols["obs"], idx + 1, axis=0)  # the next row (arrowbuf derives it alike)
        return BATCH


def _map(file: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The file as a writable array, pre-faulted (MAP_POPULATE) as arrowbuf's mappings are: no page faults later."""
    import mmap

    fd = os.open(file, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mm, dtype=dtype, count=count).reshape(shape)


class _Cpprb(_Adapter):
    def write_step(self, step: dict, writers: int) -> None:
        self.handle.add(**step)

    def write_chunk(self, chunk: dict, writers: int) -> None:
        self.handle.add(**chunk)

    def sample(self) -> int:
        self.handle.sample(BATCH)
        return BATCH


class _TorchRL(_Adapter):
    def __init__(self, handle: Any, workload: str, role: str, wid: int) -> None:
        import torch
        from tensordict import TensorDict

        super().__init__(handle, workload, role, wid)
        torch.set_num_threads(1)
        if role == "writer":
            t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.pool.items()}
            n = min(len(self.pool["obs"]), 2000)  # TensorDicts are slow to build: a smaller cycle of them
            self.tsteps = [TensorDict({k: v[j] for k, v in t.items()}, batch_size=[]) for j in range(n)]
            self.tchunks = [TensorDict({k: v[a:a + CHUNK] for k, v in t.items()}, batch_size=[CHUNK])
                            for a in range(0, n - CHUNK + 1, CHUNK)]

    def step(self, writers: int) -> int:
        self.j = (self.j + 1) % len(self.tsteps)
        self.handle.add(self.tsteps[self.j])
        return 1

    def chunk(self, writers: int) -> int:
        self.s = (self.s + 1) % len(self.tchunks)
        self.handle.extend(self.tchunks[self.s])
        return CHUNK

    def sample(self) -> int:
        self.handle.sample(BATCH)
        return BATCH


class _Flight(_Adapter):
    """A Flight writer: `ab.connect(location).extend(chunk)` into a store served by another process."""

    def __init__(self, handle: Any, workload: str, role: str, wid: int) -> None:
        import arrowbuf as ab

        super().__init__(handle, workload, role, wid)
        self.client = ab.connect(handle)

    def write_step(self, step: dict, writers: int) -> None:
        self.client.append(step)

    def write_chunk(self, chunk: dict, writers: int) -> None:
        self.client.extend(chunk)

    def sample(self) -> int:
        self.client.sample(BATCH)
        return BATCH

    def close(self) -> None:
        self.client.close()


ADAPTERS = {"arrowbuf": _Arrowbuf, "numpy": _Numpy, "cpprb": _Cpprb, "torchrl": _TorchRL, "flight": _Flight}


def _worker(kind: str, handle: Any, workload: str, role: str, wid: int, conn: Any) -> None:
    import warnings

    warnings.simplefilter("ignore")
    try:
        a = ADAPTERS[kind](handle, workload, role, wid)
        conn.send("ready")
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        op, start, duration, writers = cmd
        fn = {"step": a.step, "chunk": a.chunk, "sample": a.sample}[op]
        args = () if op == "sample" else (writers,)
        time.sleep(max(0.0, start - time.monotonic()))
        end = start + duration
        n = 0
        t0 = time.monotonic()
        try:
            while time.monotonic() < end:
                n += fn(*args)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
        conn.send((n, time.monotonic() - t0))
    a.close()


# ---------------------------------------------------------------------------------------------- buffers
def _specs(workload: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    from .workloads import column_specs

    return {c: v for c, v in column_specs(workload).items() if c in FIELDS}


def _fill_rows(workload: str, rows: int, write: Any) -> float:
    """Write `rows` rows in chunks from a repeating pool (steady state for the windows); returns seconds."""
    from .workloads import make_steps

    pool = make_steps(workload, POOL[workload], seed=99)
    t0 = time.perf_counter()
    done = 0
    while done < rows:
        for a in range(0, POOL[workload] - CHUNK + 1, CHUNK):
            write({k: v[a:a + CHUNK] for k, v in pool.items()})
            done += CHUNK
            if done >= rows:
                break
    return time.perf_counter() - t0


class _Buffer:
    """Creates a buffer in this process, fills it, and hands out what a worker attaches with."""

    def __init__(self, kind: str, workload: str, capacity: int) -> None:
        self.kind, self.workload, self.capacity = kind, workload, capacity
        self.cleanup: list[Any] = []
        t0 = time.perf_counter()
        getattr(self, "_make_" + kind)()
        self.create_s = time.perf_counter() - t0 - self.fill_s

    def _make_arrowbuf(self) -> None:
        import arrowbuf as ab

        name = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.store = ab.ExperienceStore(ab.load_schema(ROOT / "schemas" / f"{self.workload}.yaml"), self.capacity,
                                        tier="shm", name=name)
        self.cleanup.append(self.store.close)
        self.fill_s = _fill_rows(self.workload, self.capacity, self.store.extend)
        self.handle = name

    def _make_numpy(self) -> None:
        path = f"/dev/shm/bench-numpy-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        os.mkdir(path)
        self.cleanup.append(lambda: shutil.rmtree(path, ignore_errors=True))
        specs = _specs(self.workload)
        cols = {}
        for c, (s, d) in specs.items():
            nbytes = self.capacity * int(np.prod(s, dtype=np.int64)) * d.itemsize
            with open(os.path.join(path, c), "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(1, nbytes))
            cols[c] = _map(os.path.join(path, c), d, (self.capacity, *s))
        cursor = [0]

        def write(chunk: dict) -> None:
            a = cursor[0] % (self.capacity - CHUNK + 1)
            cursor[0] += CHUNK
            for c, arr in cols.items():
                arr[a:a + CHUNK] = chunk[c]

        self.fill_s = _fill_rows(self.workload, self.capacity, write)
        self.handle = (path, self.capacity, specs)

    def _make_cpprb(self) -> None:
        import cpprb

        env = {c: {"shape": s if s else 1, "dtype": d} for c, (s, d) in _specs(self.workload).items()}
        env["next_obs"] = dict(env["obs"])
        self.rb = cpprb.MPReplayBuffer(self.capacity, env, ctx=CTX)
        self.fill_s = _fill_rows(self.workload, self.capacity, lambda ch: self.rb.add(**ch))
        self.handle = self.rb

    def _make_torchrl(self) -> None:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyMemmapStorage, ReplayBuffer

        path = f"/dev/shm/bench-torchrl-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.cleanup.append(lambda: shutil.rmtree(path, ignore_errors=True))
        self.rb = ReplayBuffer(storage=LazyMemmapStorage(self.capacity, scratch_dir=path), shared=True)

        def write(chunk: dict) -> None:
            self.rb.extend(TensorDict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in chunk.items()},
                                      batch_size=[CHUNK]))

        self.fill_s = _fill_rows(self.workload, self.capacity, write)
        self.handle = self.rb

    def close(self) -> None:
        self.handle = None
        self.rb = None
        for f in reversed(self.cleanup):
            f()


# ---------------------------------------------------------------------------------------------- the run
def _available(kind: str) -> str | None:
    mods = {"cpprb": ["cpprb"], "torchrl": ["torchrl", "tensordict", "torch"]}.get(kind, [])
    for m in mods:
        try:
            __import__(m)
        except Exception as e:  # noqa: BLE001 - a peer that does not import is reported, not fatal
            return f"{m} unavailable: {type(e).__name__}: {e}"[:200]
    return None


def measure(kind: str, workload: str, capacity: int, window: float, repeat: int, budget: float) -> dict[str, Any]:
    """One buffer on one workload; repeats stop early (at least one is done) once the windows took `budget` s."""
    out: dict[str, Any] = {"buffer": kind, "workload": workload, "capacity": capacity}
    why = _available(kind)
    if why:
        out["unavailable"] = why
        return out
    buf = _Buffer(kind, workload, capacity)
    out["create_s"], out["fill_rows_per_s"] = buf.create_s, capacity / buf.fill_s
    procs, conns = [], []
    t0 = time.monotonic()
    try:
        roles = [("writer", w) for w in range(max(WRITERS))] + [("sampler", 100)]
        ctx = CTX_FOR.get(kind, CTX)
        for role, wid in roles:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(kind, buf.handle, workload, role, wid, child), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            msg = c.recv()
            if msg != "ready":
                raise RuntimeError(msg[1])
        sampler = conns[-1]
        out["spawn_s"] = time.monotonic() - t0
        runs: dict[str, list[float]] = {}

        def window_run(writers: int, mode: str | None) -> None:
            start = time.monotonic() + 0.05
            active = [(conns[w], mode) for w in range(writers)] + [(sampler, "sample")]
            for c, op in active:
                c.send((op, start, window, writers))
            res = []
            for c, _ in active:
                r = c.recv()
                if r[0] == "error":
                    raise RuntimeError(r[1])
                res.append(r)
            key = f"{writers}w_{mode}" if writers else "alone"
            if writers:
                runs.setdefault(key + "_insert", []).append(sum(n / dt for n, dt in res[:-1]))
            runs.setdefault(key + "_sample", []).append(res[-1][0] / res[-1][1])

        t1 = time.monotonic()
        done = 0
        while done < repeat and (done == 0 or time.monotonic() - t1 < budget):
            window_run(0, None)
            for mode in MODES:
                for w in WRITERS:
                    window_run(w, mode)
            done += 1
        out.update({k: statistics.median(v) for k, v in runs.items()})
        out["repeats_done"] = done
    finally:
        for c in conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        buf.close()
    return out


def run(workloads: list[str], buffers: list[str], quick: bool, window: float, repeat: int,
        budget: float = 20.0) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "python": platform.python_version()},
                           "window_s": window, "repeat": repeat, "batch": BATCH, "chunk": CHUNK, "rows": []}
    for wl in workloads:
        cap = CAPACITY[wl] // (10 if quick else 1)
        for kind in buffers:
            t0 = time.perf_counter()
            try:
                row = measure(kind, wl, cap, window, repeat, budget)
            except Exception as e:  # noqa: BLE001 - a broken peer is reported, not fatal
                row = {"buffer": kind, "workload": wl, "unavailable": f"{type(e).__name__}: {str(e)[-300:]}"}
            row["seconds"] = time.perf_counter() - t0
            res["rows"].append(row)
            print(f"  {wl:<7} {kind:<9} {row['seconds']:5.1f}s", file=sys.stderr, flush=True)
    return res


def _k(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k"


def print_table(res: dict[str, Any]) -> str:
    lines = [f"batch {res['batch']}, chunk {res['chunk']}, window {res['window_s']}s, medians of {res['repeat']}; "
             f"{res['machine']['cpus']} CPUs",
             f"{'workload':<7} {'buffer':<9} {'mode':<5} {'W':>2} {'insert/s':>9} {'x ceil':>6} "
             f"{'sample/s':>9} {'alone':>9} {'x alone':>7} {'x ceil':>6}"]
    ceil = {(r["workload"]): r for r in res["rows"] if r["buffer"] == "numpy" and "unavailable" not in r}
    for r in res["rows"]:
        if "unavailable" in r:
            lines.append(f"{r['workload']:<7} {r['buffer']:<9} unavailable: {r['unavailable']}")
            continue
        if isinstance(res["repeat"], int) and r.get("repeats_done", res["repeat"]) < res["repeat"]:
            lines.append(f"{r['workload']:<7} {r['buffer']:<9} (slow: {r['repeats_done']} of {res['repeat']} repeats "
                         f"within the time budget)")
        c = ceil.get(r["workload"], {})
        alone = r.get("alone_sample")
        for mode in MODES:
            for w in WRITERS:
                k = f"{w}w_{mode}"
                ins, smp = r.get(k + "_insert"), r.get(k + "_sample")
                ci, cs = c.get(k + "_insert"), c.get(k + "_sample")
                lines.append(
                    f"{r['workload']:<7} {r['buffer']:<9} {mode:<5} {w:>2} {_k(ins):>9} "
                    f"{(ins / ci if ins and ci else 0):>6.2f} {_k(smp):>9} {_k(alone):>9} "
                    f"{(smp / alone if smp and alone else 0):>7.2f} {(smp / cs if smp and cs else 0):>6.2f}")
    return "\n".join(lines)


def merge(files: list[str]) -> dict[str, Any]:
    """Medians, metric by metric, over the results of several runs (each a JSON this script wrote)."""
    runs = [json.loads(pathlib.Path(f).read_text()) for f in files]
    res = dict(runs[0], runs=len(runs), repeat=f"{runs[0]['repeat']} x {len(runs)} runs")
    rows = []
    for i, row in enumerate(runs[0]["rows"]):
        same = [r["rows"][i] for r in runs if "unavailable" not in r["rows"][i]]
        if not same:
            rows.append(row)
            continue
        merged = dict(same[0])
        for k, v in same[0].items():
            if isinstance(v, float):
                merged[k] = statistics.median(r[k] for r in same if k in r)
        merged["repeats_done"] = min(r.get("repeats_done", 0) for r in same)
        rows.append(merged)
    res["rows"] = rows
    return res


# ---------------------------------------------------------------------------------------------- issue 18
ISSUE18 = """Issue 18 rows, mujoco, chunks of 1000 rows, one store of CAPACITY rows (full before timing):
- writers: aggregate insert rows/s of 1 and of 2 arrowbuf writer processes (target: 2 >= 1.5x 1), beside the
  unsynchronised numpy ring's 1 and 2 writers (ceiling);
- flight: a Flight writer process (`ab.connect(...).extend`, the server in the bench's process, serving the same shm
  store) alone and beside one tight arrowbuf shm writer process (target: beside >= 0.3x alone);
- sampler: a sampler process (batches of 256) beside one chunked writer process, arrowbuf against the numpy ring
  (target: >= 0.8x numpy's).
Windows are interleaved (every case once per round, `repeat` rounds); medians."""


def issue18(capacity: int, window: float, repeat: int) -> dict[str, Any]:
    """The issue-18 rows (see ISSUE18); returns medians and every window's value."""
    import arrowbuf as ab

    wl = "mujoco"
    bufs = {k: _Buffer(k, wl, capacity) for k in ("arrowbuf", "numpy")}
    server = ab.serve(bufs["arrowbuf"].store, "grpc://127.0.0.1:0")
    handles = {"arrowbuf": bufs["arrowbuf"].handle, "numpy": bufs["numpy"].handle, "flight": server.location}
    roles = [("arrowbuf", "writer", 0), ("arrowbuf", "writer", 1), ("arrowbuf", "sampler", 100),
             ("numpy", "writer", 0), ("numpy", "writer", 1), ("numpy", "sampler", 100), ("flight", "writer", 2)]
    procs, conns = [], {}
    runs: dict[str, list[float]] = {}
    try:
        for kind, role, wid in roles:
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_worker, args=(kind, handles[kind], wl, role, wid, child), daemon=True)
            p.start()
            procs.append(p)
            conns[(kind, role, wid)] = parent
        def recv(c: Any) -> Any:
            if not c.poll(120):
                raise RuntimeError("a worker process did not answer within 120 s")
            return c.recv()

        for c in conns.values():
            msg = recv(c)
            if msg != "ready":
                raise RuntimeError(msg[1])

        def window_run(active: list[tuple[tuple[str, str, int], str, int]]) -> list[float]:
            start = time.monotonic() + 0.05
            for key, op, w in active:
                conns[key].send((op, start, window, w))
            out = []
            for key, _, _ in active:
                r = recv(conns[key])
                if r[0] == "error":
                    raise RuntimeError(r[1])
                out.append(r[0] / r[1])
            return out

        aw0, aw1, asp = ("arrowbuf", "writer", 0), ("arrowbuf", "writer", 1), ("arrowbuf", "sampler", 100)
        nw0, nw1, nsp = ("numpy", "writer", 0), ("numpy", "writer", 1), ("numpy", "sampler", 100)
        fw = ("flight", "writer", 2)
        cases = {
            "arrowbuf_1w": lambda: sum(window_run([(aw0, "chunk", 1)])),
            "arrowbuf_2w": lambda: sum(window_run([(aw0, "chunk", 2), (aw1, "chunk", 2)])),
            "numpy_1w": lambda: sum(window_run([(nw0, "chunk", 1)])),
            "numpy_2w": lambda: sum(window_run([(nw0, "chunk", 2), (nw1, "chunk", 2)])),
            "flight_alone": lambda: window_run([(fw, "chunk", 1)])[0],
            "flight_beside_shm": lambda: window_run([(fw, "chunk", 1), (aw0, "chunk", 1)])[0],
            "arrowbuf_sampler_beside_writer": lambda: window_run([(asp, "sample", 1), (aw0, "chunk", 1)])[0],
            "numpy_sampler_beside_writer": lambda: window_run([(nsp, "sample", 1), (nw0, "chunk", 1)])[0],
        }
        for _ in range(repeat):
            for k, f in cases.items():
                runs.setdefault(k, []).append(f())
    finally:
        for c in conns.values():
            try:
                c.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        server.close()
        for b in bufs.values():
            b.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    med["writers_2_over_1"] = med["arrowbuf_2w"] / med["arrowbuf_1w"]
    med["ceiling_2_over_1"] = med["numpy_2w"] / med["numpy_1w"]
    med["flight_beside_over_alone"] = med["flight_beside_shm"] / med["flight_alone"]
    med["sampler_over_numpy"] = med["arrowbuf_sampler_beside_writer"] / med["numpy_sampler_beside_writer"]
    return {"capacity": capacity, "window_s": window, "repeat": repeat, "medians": med, "runs": runs,
            "load_avg": os.getloadavg(), "arrowbuf": os.path.dirname(ab.__file__)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["atari", "mujoco"])
    p.add_argument("--buffers", nargs="+", default=["arrowbuf", "numpy", "cpprb", "torchrl"])
    p.add_argument("--quick", action="store_true", help="a tenth of the capacities, shorter windows")
    p.add_argument("--window", type=float, default=None, help="seconds per timed window (default 0.5, quick 0.3)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--budget", type=float, default=20.0,
                   help="seconds of timed windows per buffer and workload before repeats stop (slow peers)")
    p.add_argument("--out", default=str(OUT / "shm.json"))
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print and write the medians of earlier runs instead")
    p.add_argument("--issue18", action="store_true", help="only the issue-18 rows (parallel writers, Flight beside "
                   "a shm writer, sampler beside a writer): " + ISSUE18.splitlines()[0])
    p.add_argument("--lib", help="import arrowbuf from this source tree (a before/after comparison)")
    args = p.parse_args(argv)
    if args.lib:  # spawned workers inherit sys.path
        sys.path.insert(0, os.path.abspath(args.lib))
    if args.issue18:
        cap = CAPACITY["mujoco"] // (4 if args.quick else 1)
        res = issue18(cap, args.window or (0.3 if args.quick else 0.5), args.repeat)
        print(json.dumps(res["medians"], indent=1))
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str))
        return 0
    if args.merge:
        res = merge(args.merge)
        res["table"] = print_table(res)
        print(res["table"])
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        return 0
    window = args.window or (0.3 if args.quick else 0.5)
    res = run(args.workloads, args.buffers, args.quick, window, args.repeat, args.budget)
    table = print_table(res)
    res["table"] = table
    print(table)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
