"""TransferQueue's workload across processes, side by side (issue 28): arrowbuf over shared memory and over Flight,
raw Flight DoPut/DoGet of the same bytes, TransferQueue 0.1.11, and memcpy, each with the peak memory of every side.

Shapes:
  fixed  TransferQueue's perftest at its own size: SAMPLES (1024) x 9 fields x 8192 float32 = 302 MB, PUT as ONE
         `extend` call (no manual slicing), then GET of the same rows
  grpo   PROMPTS (256) x 8 completions, response lengths uniform in [1k, 16k] tokens: ragged response_tokens (int32),
         logprobs and ref_logprobs (float32), 16 prompt tokens, prompt_id, reward, policy_version (about 218 MB)

Systems (every side is its own process; the parent drives them over pipes and times nothing itself):
  memcpy          the ceiling: one np.copyto of the payload bytes into memory already touched, in one process
  raw flight      a pyarrow Flight server that keeps the DoPut's table and sends it back on DoGet; a client process
                  does DoPut of the payload as one record batch, then DoGet + read_all (no validation, no store)
  raw flight parts the same, the DoPut's batch sent as zero-copy slices of 8 MiB (`parts.PIPELINE_PART_BYTES`, what
                  arrowbuf's client sends to a server that writes parts into its ring): a peer ceiling, since
                  smaller messages land in reused heap memory on the receiver
  arrowbuf flight `ab.serve(store)` in a server process (defaults: max_batch_bytes 256 MiB, so a 302 MB extend goes
                  in parts); a writer process `remote.extend(rows)` (one call); a reader process
                  `remote.sample(n)` of a FIFO store (the rows just put) + `to_torch()` (pack=True for ragged)
  arrowbuf shm    a writer process creates `ExperienceStore(tier="shm", tasks=["train"])` and extends (one call);
                  a reader process `ExperienceStore.attach`es it and `consume("train", n)` + `to_torch()`: no server
  transferqueue   0.1.11 as its perftest runs it: `tq.init` in a driver (controller, 2 SimpleStorage units), writer
                  and reader Ray actors, `kv_batch_put` / `kv_batch_get` (+ `kv_clear`); fixed GET converts its
                  nested tensors to the dense [B, 8192] a trainer takes, as bench_llm does

Throughput: payload bytes / seconds, medians of `--repeats` after one warm-up round. Memory: peak PSS of each side's
process tree (the TransferQueue side is its driver and all of Ray's processes), sampled every 20 ms by the parent,
as absolute peak and as growth above the side's idle PSS (imports done, before the payload is made); the payload
itself is created in the writer (TransferQueue's writer actor too), so it counts once on every system. CPU: the
Flight server process's CPU seconds (all threads) per PUT, raw and arrowbuf, which holds under load.

    python -m benchmarks.bench_tq_xproc [--quick] [--shapes fixed grpo] [--systems ...] [--repeats R]

Full mode (302 MB and 218 MB, 3 repeats) takes about 3-4 minutes here (two Ray startups for TransferQueue);
`--quick` (1/8 of each size, 2 repeats, no TransferQueue unless `--peers`) about 40 s. Prints a table, writes
benchmarks/out/tq_xproc.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np

from .bench_llm import FIELDS, SEQ, _dist_version, _grpo_rows, _pss, _tree

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SYSTEMS = ("memcpy", "raw flight", "raw flight parts", "arrowbuf flight", "arrowbuf shm", "transferqueue")
GRPO_FIELDS = ("prompt_id", "prompt_tokens", "response_tokens", "logprobs", "ref_logprobs", "reward",
               "policy_version", "done")


# ---------------------------------------------------------------------------------------------------- payloads
def payload(shape: str, size: int) -> dict[str, Any]:
    """The rows of one PUT: `size` samples (fixed) or `size` prompts x 8 (grpo), as arrowbuf's `extend` takes them."""
    rng = np.random.default_rng(0)
    if shape == "fixed":
        rows: dict[str, Any] = {f"field_{i}": rng.standard_normal((size, SEQ), dtype=np.float32)
                                for i in range(FIELDS)}
        rows["done"] = np.ones(size, dtype=bool)
        return rows
    rows = _grpo_rows(rng, size, 0, 1024, 16 * 1024)
    rows["ref_logprobs"] = rows["logprobs"]  # the same shape and bytes, filled at PUT time here
    return {k: rows[k] for k in GRPO_FIELDS}


def schema(shape: str, shm: bool = False) -> Any:
    """The store's schema; `shm`: grpo's ragged fields declare the lengths a shared-memory arena is sized by (a
    shared arena cannot grow; a host arena grows, so the Flight server keeps schemas/grpo.yaml as it is)."""
    import arrowbuf as ab

    if shape == "grpo" and not shm:
        return ab.load_schema("grpo")
    if shape == "grpo":  # schemas/grpo.yaml, with the lengths a shared-memory arena is sized by
        # the mean response (8704 tokens for lengths uniform in [1k, 16k]) and 12% more: the arena holds that many
        # elements per ring row on average (arrowbuf.ring.ragged_arena), whatever one chunk holds
        mean = {"prompt_tokens": 16, "response_tokens": 9728, "logprobs": 9728, "ref_logprobs": 9728}
        fields = {f.name: {"dtype": str(f.dtype), "ragged": True, "mean_length": mean[f.name]} if f.ragged else
                  {"dtype": str(f.dtype)} for f in ab.load_schema("grpo").fields.values()}
        return ab.load_schema({"name": "grpo", "fields": fields})
    fields: dict[str, Any] = {f"field_{i}": {"dtype": "float32", "shape": [SEQ]} for i in range(FIELDS)}
    fields["done"] = {"dtype": "bool"}
    return ab.load_schema({"name": "perftest", "fields": fields})


def rows_of(shape: str, size: int) -> int:
    return size if shape == "fixed" else size * 8


def record_batch(shape: str, rows: dict[str, Any]) -> Any:
    """The payload as one pa.RecordBatch (what raw Flight sends; its nbytes is the payload size of every system)."""
    import pyarrow as pa

    cols = {}
    for k, v in rows.items():
        if isinstance(v, np.ndarray) and v.ndim == 2:
            cols[k] = pa.FixedShapeTensorArray.from_numpy_ndarray(v)
        else:
            cols[k] = v if isinstance(v, pa.Array) else pa.array(v)
    return pa.RecordBatch.from_pydict(cols)


# ---------------------------------------------------------------------------------------------------- roles
def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _loop(handlers: dict[str, Any]) -> None:
    """Answer the parent's commands (one per line) until stdin closes: each handler returns a JSON-able dict."""
    _reply({"ready": True})
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit":
            break
        _reply(handlers[cmd](arg))


def role_raw_server(shape: str, size: int) -> None:
    import pyarrow.flight as flight

    class Raw(flight.FlightServerBase):
        """The ceiling: DoPut keeps the table, DoGet sends it back."""

        def __init__(self) -> None:
            super().__init__("grpc://127.0.0.1:0")
            self.table: Any = None

        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            self.table = None  # the previous table goes first (a store overwrites its ring)
            self.table = reader.read_all()

        def do_get(self, context: Any, ticket: Any) -> Any:
            return flight.RecordBatchStream(self.table)

    raw = Raw()
    _loop({"where": lambda _: {"location": f"grpc://127.0.0.1:{raw.port}"}})
    raw.shutdown()


def role_raw_client(shape: str, size: int, location: str, parts: bool = False) -> None:
    """`parts`: the batch goes as zero-copy slices of `parts.PIPELINE_PART_BYTES` in one DoPut (the message size
    arrowbuf's client sends to a server that writes parts into its ring), else as one record batch."""
    import pyarrow.flight as flight

    client = flight.FlightClient(location)
    state: dict[str, Any] = {}

    def make(_: str) -> dict[str, Any]:
        state["rb"] = record_batch(shape, payload(shape, size))
        return {"bytes": state["rb"].nbytes}

    def put(_: str) -> dict[str, Any]:
        rb = state["rb"]

        def go() -> None:
            writer, _ = client.do_put(flight.FlightDescriptor.for_path("x"), rb.schema)
            if parts:
                from arrowbuf.flight.parts import PIPELINE_PART_BYTES, split_rows

                for offset, rows in split_rows(rb, PIPELINE_PART_BYTES):
                    writer.write_batch(rb.slice(offset, rows))
            else:
                writer.write_batch(rb)
            writer.close()

        return {"s": _timed(go)}

    def get(_: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        table = client.do_get(flight.Ticket(b"x")).read_all()
        s = time.perf_counter() - t0
        del table
        return {"s": s}

    _loop({"make": make, "put": put, "get": get})
    client.close()


def role_ab_server(shape: str, size: int) -> None:
    import arrowbuf as ab

    store = ab.ExperienceStore(schema(shape), capacity=rows_of(shape, size), sampler="fifo", name="xproc")
    # the writer is our own process (trusted): parts go straight into the ring (ServerLimits.parts_into_ring)
    server = ab.serve(store, max_batch_rows=max(65_536, rows_of(shape, size)), parts_into_ring=True)
    _loop({"where": lambda _: {"location": server.location}})
    server.close()
    store.close()


def role_ab_writer(shape: str, size: int, location: str) -> None:
    """A Flight writer (location grpc://...) or the shared-memory store's creator and writer (location shm:NAME)."""
    import torch  # noqa: F401 - a trainer's or rollout worker's process has it; its import is no transfer cost

    import arrowbuf as ab

    if location.startswith("shm:"):
        target: Any = ab.ExperienceStore(schema(shape, shm=True), capacity=rows_of(shape, size), tier="shm",
                                         name=location[4:], tasks=["train"])
    else:
        target = ab.connect(location, store="xproc")
    state: dict[str, Any] = {}

    def make(_: str) -> dict[str, Any]:
        state["rows"] = payload(shape, size)
        return {"bytes": record_batch(shape, state["rows"]).nbytes}

    def put(_: str) -> dict[str, Any]:
        return {"s": _timed(lambda: target.extend(state["rows"]))}

    _loop({"make": make, "put": put})
    target.close()


def role_ab_reader(shape: str, size: int, location: str) -> None:
    import torch  # noqa: F401 - see role_ab_writer

    import arrowbuf as ab

    n = rows_of(shape, size)
    pack = shape == "grpo"
    if location.startswith("shm:"):
        store = ab.ExperienceStore.attach(location[4:], timeout=60.0)

        def fetch() -> Any:
            return store.consume("train", n, timeout=60.0)
        closer: Any = store
    else:
        remote = ab.connect(location, store="xproc")

        def fetch() -> Any:
            return remote.sample(n, timeout=60.0)
        closer = remote

    def get(_: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch = fetch()
        got = batch.to_torch(pack=True) if pack else batch.to_torch()
        s = time.perf_counter() - t0
        rows = len(batch)
        del got, batch
        return {"s": s, "rows": rows}

    _loop({"get": get})
    closer.close()


def role_tq(shape: str, size: int, repeats: int) -> None:
    """TransferQueue's side, whole: a driver with the controller and storage units, writer and reader actors."""
    import shutil
    import tempfile

    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    n = rows_of(shape, size)
    tmp = tempfile.mkdtemp(prefix="rtq-", dir="/tmp")
    # a new local cluster of its own, never another job's (address="local"; a private temp dir); TransferQueue's
    # controller and storage units each reserve a CPU: 8 logical CPUs on this 2-core machine
    try:
        for attempt in range(2):  # Ray gives its node 30 s to start; a loaded machine sometimes needs a second try
            try:
                ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                         logging_level="ERROR", log_to_driver=False, _temp_dir=tmp)
                break
            except Exception:  # noqa: BLE001 - retried once, then raised
                ray.shutdown()
                if attempt:
                    raise
        config = OmegaConf.load(pathlib.Path(tq.__file__).parent / "config.yaml")
        config.backend.storage_backend = "SimpleStorage"
        config.backend.SimpleStorage.total_storage_size = n * (repeats + 2)
        conf = OmegaConf.to_container(config, resolve=True)

        @ray.remote(num_cpus=0.001)
        class Client:
            def __init__(self, conf: dict) -> None:
                tq.init(OmegaConf.create(conf))

            def make(self, shape: str, size: int) -> int:
                import torch
                from tensordict import TensorDict

                rows = payload(shape, size)
                fields: dict[str, Any] = {}
                for k, v in rows.items():
                    if isinstance(v, np.ndarray):
                        fields[k] = torch.from_numpy(v)
                    else:  # a ragged column: a jagged nested tensor (TransferQueue's own ragged form)
                        offs = v.offsets.to_numpy()
                        flat = torch.from_numpy(v.values.to_numpy())
                        fields[k] = torch.nested.nested_tensor_from_jagged(flat, torch.from_numpy(
                            offs.astype(np.int64)))
                self.data = TensorDict(fields, batch_size=(len(rows["done"]),))
                return int(record_batch(shape, rows).nbytes)

            def put(self, keys: list[str], partition: str) -> None:
                tq.kv_batch_put(keys=keys, partition_id=partition, fields=self.data)

            def get(self, keys: list[str], partition: str, dense: bool) -> int:
                import torch

                res = tq.kv_batch_get(keys=keys, partition_id=partition)
                out = {}
                for k in res.keys():  # fixed: jagged nested tensors -> the dense [B, 8192] a trainer takes
                    v = res[k]
                    out[k] = torch.stack(v.unbind()) if dense and getattr(v, "is_nested", False) else v
                return len(out)

            def clear(self, keys: list[str], partition: str) -> None:
                tq.kv_clear(keys=keys, partition_id=partition)

            def close(self) -> None:
                tq.close()

        tq.init(OmegaConf.create(conf))  # the driver starts the controller and storage units
        writer, reader = Client.remote(conf), Client.remote(conf)
        ray.get([writer.__ray_ready__.remote(), reader.__ray_ready__.remote()])
        _reply({"ready": True})
        sys.stdin.readline()  # the parent took the idle PSS
        nbytes = ray.get(writer.make.remote(shape, size))
        put, get = [], []
        for r in range(repeats + 1):
            keys = [f"k{r}_{i}" for i in range(n)]
            put.append(_timed(lambda keys=keys: ray.get(writer.put.remote(keys, "train_0"))))
            get.append(_timed(lambda keys=keys: ray.get(reader.get.remote(keys, "train_0", shape == "fixed"))))
            ray.get(writer.clear.remote(keys, "train_0"))
        ray.get([writer.close.remote(), reader.close.remote()])
        tq.close()
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    _reply({"bytes": nbytes, "put": put, "get": get, "version": _dist_version("transferqueue")})


# ---------------------------------------------------------------------------------------------------- parent
class Side:
    """One role process, driven over its pipes; its tree's PSS is sampled by `Sampler`."""

    def __init__(self, label: str, role: str, shape: str, size: int, extra: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   RAY_DEDUP_LOGS="0")
        env.pop("RAY_ADDRESS", None)
        self.label = label
        self.warm = self.peak_warm = 0  # PSS after the warm-up round, and the peak since
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_tq_xproc", "--role", role, "--shape",
                                      shape, "--size", str(size), *(extra or [])], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.idle = self.peak = 0

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.label}: exited ({self.proc.wait()})")
            if line.startswith("{"):
                return dict(json.loads(line))

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                for pid in reversed(_tree(self.proc.pid)):
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        pass
                self.proc.wait()


class Sampler:
    """Peak PSS of each side's process tree, every 20 ms, on a thread of the parent."""

    def __init__(self, sides: list[Side]) -> None:
        self.sides = sides
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def idle(self) -> None:
        for s in self.sides:
            s.idle = s.peak = _pss(_tree(s.proc.pid))

    def mark_warm(self) -> None:
        """After the warm-up round: the ring, pools and connections exist; later peaks above this are what one
        PUT or GET adds (its transport and copies)."""
        for s in self.sides:
            s.warm = s.peak_warm = _pss(_tree(s.proc.pid))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for s in self.sides:
                now = _pss(_tree(s.proc.pid))
                s.peak = max(s.peak, now)
                if s.warm:
                    s.peak_warm = max(s.peak_warm, now)

    def __enter__(self) -> Sampler:
        self.idle()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used: a measure per PUT that holds under load."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _med(xs: list[float], warmup: int = 1) -> float:
    return float(np.median(xs[warmup:] if len(xs) > warmup else xs))


def _memory(sides: list[Side]) -> dict[str, Any]:
    return {s.label: {"peak_MiB": s.peak / 2**20, "growth_MiB": (s.peak - s.idle) / 2**20,
                      "over_warm_MiB": (s.peak_warm - s.warm) / 2**20 if s.warm else None} for s in sides}


def run_memcpy(shape: str, size: int, repeats: int) -> dict[str, Any]:
    nbytes = record_batch(shape, payload(shape, size)).nbytes
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.ones_like(src)
    s = [_timed(lambda: np.copyto(dst, src)) for _ in range(repeats + 3)]
    return {"bytes": nbytes, "put_s": min(s), "get_s": min(s)}


def run_pair(system: str, shape: str, size: int, repeats: int, warmup: int = 1) -> dict[str, Any]:
    """raw flight, arrowbuf flight, arrowbuf shm: a store side (server or shm creator), a writer, a reader;
    `warmup` rounds first, not counted."""
    sides: list[Side] = []
    try:
        if system == "arrowbuf shm":
            location = f"shm:xproc-{uuid.uuid4().hex[:8]}"
            writer = Side("writer (creates the shm store)", "ab-writer", shape, size, ["--location", location])
            sides.append(writer)
            writer.read()
            reader = Side("reader (attaches)", "ab-reader", shape, size, ["--location", location])
            sides.append(reader)
            reader.read()
        else:
            raw = system.startswith("raw flight")
            server = Side("server", "raw-server" if raw else "ab-server", shape, size)
            sides.append(server)
            server.read()
            location = server.ask("where")["location"]
            writer = Side("client" if raw else "writer", "raw-client" if raw else "ab-writer", shape, size,
                          ["--location", location] + (["--parts"] if system == "raw flight parts" else []))
            sides.append(writer)
            writer.read()
            reader = writer
            if not raw:
                reader = Side("reader", "ab-reader", shape, size, ["--location", location])
                sides.append(reader)
                reader.read()
        put, get, put_cpu = [], [], []
        store_side = sides[0]  # the server (Flight) or the shm store's creator
        with Sampler(sides) as sampler:
            nbytes = writer.ask("make")["bytes"]
            for i in range(repeats + warmup):
                c0 = _cpu_s(store_side.proc.pid)
                put.append(writer.ask("put")["s"])
                put_cpu.append(_cpu_s(store_side.proc.pid) - c0)
                get.append(reader.ask("get")["s"])
                if i == warmup - 1:
                    sampler.mark_warm()
    finally:
        for s in reversed(sides):
            s.close()
    return {"bytes": nbytes, "put_s": _med(put, warmup), "get_s": _med(get, warmup), "put_all_s": put,
            "get_all_s": get, "put_cpu_s": _med(put_cpu, warmup), "put_cpu_all_s": put_cpu, "memory": _memory(sides)}


def run_tq(shape: str, size: int, repeats: int) -> dict[str, Any]:
    side = Side("driver + Ray (controller, storage, writer, reader)", "tq", shape, size, ["--repeats", str(repeats)])
    try:
        side.read()
        with Sampler([side]):
            res = side.ask("go")
    finally:
        side.close()
    return {"bytes": res["bytes"], "put_s": _med(res["put"]), "get_s": _med(res["get"]), "put_all_s": res["put"],
            "get_all_s": res["get"], "version": res["version"], "memory": _memory([side])}


def run_system(system: str, shape: str, size: int, repeats: int, warmup: int = 1) -> dict[str, Any]:
    try:
        if system == "memcpy":
            return run_memcpy(shape, size, repeats)
        if system == "transferqueue":
            return run_tq(shape, size, repeats)
        return run_pair(system, shape, size, repeats, warmup)
    except Exception as exc:  # noqa: BLE001 - one system's failure is a row, not the end of the run
        return {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report(shape: str, res: dict[str, dict[str, Any]]) -> None:
    print(f"\n{shape}: {next((r['bytes'] for r in res.values() if 'bytes' in r), 0) / 1e6:.0f} MB per PUT/GET")
    print(f"{'system':<17}{'PUT GB/s':>9}{'GET GB/s':>9}  peak PSS per side in MiB (+growth above idle; "
          "+growth above warm, after the first round)")
    for system, r in res.items():
        if "error" in r:
            print(f"{system:<17} unavailable: {r['error']}")
            continue
        mem = "; ".join(f"{k} {v['peak_MiB']:.0f} (+{v['growth_MiB']:.0f}"
                        + (f"; +{v['over_warm_MiB']:.0f})" if v.get("over_warm_MiB") is not None else ")")
                        for k, v in r.get("memory", {}).items())
        print(f"{system:<17}{r['bytes'] / r['put_s'] / 1e9:>9.2f}{r['bytes'] / r['get_s'] / 1e9:>9.2f}  {mem}")
    ok = {k: v for k, v in res.items() if "error" not in v}

    def ratio(a: str, b: str, what: str) -> str:
        if a not in ok or b not in ok:
            return "n/a"
        return f"{ok[b][what] / ok[a][what]:.2f}x"

    def total(system: str) -> float:
        return sum(v["peak_MiB"] for v in ok[system]["memory"].values())

    print(f"arrowbuf flight / raw flight parts (the same bytes in the messages arrowbuf sends): PUT "
          f"{ratio('arrowbuf flight', 'raw flight parts', 'put_s')}, GET "
          f"{ratio('arrowbuf flight', 'raw flight parts', 'get_s')}")
    for system in ("raw flight", "raw flight parts", "arrowbuf flight"):
        if system in ok and "put_cpu_s" in ok[system]:
            r = ok[system]
            print(f"{system}: server process CPU per PUT {r['put_cpu_s'] * 1e3:.0f} ms (median after the warm-up "
                  f"rounds; all rounds {[round(x * 1e3) for x in r['put_cpu_all_s']]}; 10 ms ticks); PUT seconds "
                  f"{[round(x, 3) for x in r['put_all_s']]}")
    print(f"arrowbuf shm / transferqueue: PUT {ratio('arrowbuf shm', 'transferqueue', 'put_s')}, GET "
          f"{ratio('arrowbuf shm', 'transferqueue', 'get_s')} (target >= 4x)")
    print(f"arrowbuf flight / raw flight: PUT {ratio('arrowbuf flight', 'raw flight', 'put_s')}, GET "
          f"{ratio('arrowbuf flight', 'raw flight', 'get_s')} (target >= 0.8x); / transferqueue: PUT "
          f"{ratio('arrowbuf flight', 'transferqueue', 'put_s')}, GET "
          f"{ratio('arrowbuf flight', 'transferqueue', 'get_s')}")
    if "transferqueue" in ok:
        for system in ("arrowbuf shm", "arrowbuf flight"):
            if system in ok:
                print(f"{system} peak PSS (sum of sides) / transferqueue's: "
                      f"{total(system) / total('transferqueue'):.2f} (target <= 0.5)")
    for system in ("arrowbuf flight", "raw flight"):
        if system in ok:
            mem = ok[system]["memory"]
            worst = max(mem, key=lambda k: mem[k]["growth_MiB"])
            over = max(mem, key=lambda k: mem[k]["over_warm_MiB"] or 0)
            size = ok[system]["bytes"] / 2**20
            print(f"{system}: largest growth of one side / payload {mem[worst]['growth_MiB'] / size:.2f}x ({worst}; "
                  f"a store side holds its ring: 1x); largest peak above its warm level (after the first round) "
                  f"{(mem[over]['over_warm_MiB'] or 0) / size:.2f}x ({over}) (target < 2x)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/8 of each size, 2 repeats, no TransferQueue (--peers)")
    ap.add_argument("--peers", action="store_true", help="with --quick: TransferQueue too")
    ap.add_argument("--shapes", nargs="+", default=["fixed", "grpo"])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), help=f"from {SYSTEMS}")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1,
                    help="rounds before the counted ones (raw and arrowbuf; TransferQueue: one): a store's ring is "
                         "first-touched memory for its first fills (a grpo ring's ragged regions: about 3 rounds)")
    ap.add_argument("--samples", type=int, default=None, help="fixed shape's samples (default 1024)")
    ap.add_argument("--prompts", type=int, default=None, help="grpo shape's prompts (default 256)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--location", help=argparse.SUPPRESS)
    ap.add_argument("--parts", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        roles = {"raw-server": lambda: role_raw_server(args.shape, args.size),
                 "raw-client": lambda: role_raw_client(args.shape, args.size, args.location, args.parts),
                 "ab-server": lambda: role_ab_server(args.shape, args.size),
                 "ab-writer": lambda: role_ab_writer(args.shape, args.size, args.location),
                 "ab-reader": lambda: role_ab_reader(args.shape, args.size, args.location),
                 "tq": lambda: role_tq(args.shape, args.size, args.repeats)}
        roles[args.role]()
        return
    repeats = args.repeats or (2 if args.quick else 3)
    sizes = {"fixed": args.samples or (128 if args.quick else 1024),
             "grpo": args.prompts or (32 if args.quick else 256)}
    systems = [s for s in args.systems if not (args.quick and s == "transferqueue" and not args.peers)]
    t0 = time.perf_counter()
    up0 = _uptime()
    print(f"load before: {up0}", flush=True)
    results: dict[str, Any] = {}
    for shape in args.shapes:
        results[shape] = {}
        for system in systems:
            results[shape][system] = run_system(system, shape, sizes[shape], repeats, args.warmup)
            r = results[shape][system]
            print(f"  {shape} {system}: " + (r["error"] if "error" in r else
                  f"PUT {r['bytes'] / r['put_s'] / 1e9:.2f} GB/s GET {r['bytes'] / r['get_s'] / 1e9:.2f} GB/s"),
                  flush=True)
        report(shape, results[shape])
    up1 = _uptime()
    elapsed = time.perf_counter() - t0
    print(f"\n({elapsed:.0f}s; medians of {repeats} after {args.warmup} warm-up round(s); load before: "
          f"{up0.split('load')[-1]}, after: {up1.split('load')[-1]})")
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "seconds": elapsed, "uptime_before": up0,
            "uptime_after": up1, "sizes": sizes, "repeats": repeats, "warmup": args.warmup, "quick": args.quick,
            "memory": "peak PSS of each side's process tree (absolute and above its idle value), sampled every 20 ms"}
    (OUT / "tq_xproc.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {OUT / 'tq_xproc.json'}")


if __name__ == "__main__":
    main()
