"""The LLM post-training data path (issue 16): TransferQueue's own workload, ragged rows and a GRPO-shaped batch.

Rows:
  fixed      TransferQueue's perftest case (its scripts/performance_test/perftest.py, default "simple" case): a global
             batch of SAMPLES x FIELDS fields x 8192 float32, PUT then GET of the same samples, per system:
               memcpy           np.copyto of the payload into fresh memory (the host ceiling)
               arrowbuf local   `store.extend(batch)` then `store.sample(n)` (FIFO: the rows just put) + to_torch
               arrowbuf flight  the same through `ab.connect` from another process (server in a subprocess)
               raw flight       DoPut of the same record batch into a server that keeps it, DoGet of it back
               ray              `ray.put` in a writer actor, `ray.get` in a reader actor (+ torch.from_numpy)
               transferqueue    0.1.11, SimpleStorage backend, writer and reader actors as in its perftest; the
                                GET counts the conversion of its jagged nested tensors to a dense [B, 8192] tensor
  ragged     the same fields as ragged lists of lengths 1..8192 (an arithmetic progression, as TransferQueue's
             complex case), arrowbuf in-process: FIFO GET (the rows just put) and uniform GET (random rows), each
             against a memcpy of the gathered bytes into fresh memory; once back to back and once with 0.5 s pauses
             between operations (TransferQueue's own method)
  grpo       PROMPTS x 8 responses, response lengths uniform in [1k, 16k] tokens (scaled: see --prompts), ragged
             input_ids (int32) and logprobs (float32), reward filled later: bytes per token id stored, and the token
             imbalance of `split(ranks=4, balance="tokens")`

Each system runs in its own child process (a fresh interpreter; `--child NAME`), which reports GB/s (payload bytes /
seconds, medians over repeats) and the peak memory of its process tree (PSS summed over the child, its servers, Ray's
processes) above the tree's memory before the payload existed, sampled every 20 ms.

    python -m benchmarks.bench_llm [--quick [--peers]] [--samples N] [--repeats R] [--only fixed ragged grpo]
                                   [--skip ray transferqueue ...]

The default run takes 4-8 minutes here (two Ray startups); run it in parts (`--only fixed`, `--only ragged`,
`--only grpo`) to keep each under two. `--quick` (about a minute) leaves out Ray and TransferQueue unless `--peers`.

TransferQueue runs from its own venv (default /work/venv-tq, `--tq-python`): it pulls packages (pyzmq, hydra,
omegaconf, msgspec, psutil) that the project venv does not carry. Prints a table, writes benchmarks/out/llm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
SEQ = 8192
FIELDS = 9
TQ_PYTHON = "/work/venv-tq/bin/python"


# ---------------------------------------------------------------------------------------------------- memory
def _tree(root: int) -> list[int]:
    """`root` and all its descendants (from /proc)."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _pss(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


class PeakMemory:
    """Peak PSS of this process's tree above its value at `start()`, sampled by a thread every 20 ms.

    `peak_self` is the same for this process alone (the client); the rest of the tree is servers and Ray's processes.
    """

    def __init__(self, pids: list[int] | None = None) -> None:
        self.pids = pids  # measure these processes as "self" instead of this one
        self.base = self.peak = self.base_self = self.peak_self = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        pids = _tree(os.getpid())
        self.peak = max(self.peak, _pss(pids))
        self.peak_self = max(self.peak_self, _pss(self.pids or [os.getpid()]))

    def start(self) -> "PeakMemory":
        self.base = self.peak = _pss(_tree(os.getpid()))
        self.base_self = self.peak_self = _pss(self.pids or [os.getpid()])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return self.peak - self.base

    def split(self) -> dict[str, int]:
        """Peak growth of this process and of the whole tree (bytes)."""
        return {"peak_self_bytes": self.peak_self - self.base_self, "peak_bytes": self.peak - self.base}


# ---------------------------------------------------------------------------------------------------- payloads
def fixed_payload(samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"field_{i}": rng.standard_normal((samples, SEQ), dtype=np.float32) for i in range(FIELDS)}


def ragged_lengths(samples: int) -> np.ndarray:
    """1..8192 as an arithmetic progression over the samples (TransferQueue's nested fields)."""
    return np.linspace(1, SEQ, samples).astype(np.int64)


def ragged_payload(samples: int, seed: int = 0) -> dict[str, Any]:
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lens = ragged_lengths(samples)
    offs = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    return {f"field_{i}": pa.ListArray.from_arrays(pa.array(offs), pa.array(
        rng.standard_normal(int(offs[-1]), dtype=np.float32))) for i in range(FIELDS)}


def _schema(ragged: bool) -> Any:
    import arrowbuf as ab

    spec = {"dtype": "float32", "ragged": True} if ragged else {"dtype": "float32", "shape": [SEQ]}
    fields: dict[str, Any] = {f"field_{i}": dict(spec) for i in range(FIELDS)}
    fields["done"] = {"dtype": "bool"}
    return ab.load_schema({"name": "perftest", "fields": fields})


def _with_done(payload: dict[str, Any], samples: int) -> dict[str, Any]:
    return {**payload, "done": np.ones(samples, dtype=bool)}


def _import_torch() -> None:
    """Load torch before memory is measured, as a trainer's process has it: its import (about 170 MB of PSS here,
    2.3x a 75 MB payload) is not a cost of moving the payload."""
    import torch  # noqa: F401


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _med(xs: list[float]) -> float:
    """The median after dropping the first (warm-up: imports, first touch, connections) of repeats + 1 runs."""
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


# ---------------------------------------------------------------------------------------------------- children
def child_memcpy(samples: int, repeats: int) -> dict[str, Any]:
    src = np.ones(samples * SEQ * FIELDS, dtype=np.float32)
    mem = PeakMemory().start()
    fresh, steady = [], []
    dst = np.ones_like(src)
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = np.empty_like(src)
        np.copyto(out, src)
        fresh.append(time.perf_counter() - t0)
        del out
        steady.append(_timed(lambda: np.copyto(dst, src)))
    return {"put_s": _med(fresh), "get_s": _med(fresh), "steady_s": _med(steady), "peak_bytes": mem.stop(),
            "bytes": src.nbytes}


def child_ab_local(samples: int, repeats: int) -> dict[str, Any]:
    import arrowbuf as ab

    payload = fixed_payload(samples)
    rows = _with_done(payload, samples)
    store = ab.ExperienceStore(_schema(False), capacity=samples, sampler="fifo")
    _import_torch()
    mem = PeakMemory().start()
    put, get = [], []
    for _ in range(repeats + 1):
        put.append(_timed(lambda: store.extend(rows)))

        def read() -> None:
            store.sample(samples, columns=list(payload)).to_torch()

        get.append(_timed(read))
    store.close()
    return {"put_s": _med(put), "get_s": _med(get), "peak_bytes": mem.stop(),
            "bytes": sum(v.nbytes for v in payload.values())}


def child_ab_flight(samples: int, repeats: int) -> dict[str, Any]:
    """arrowbuf over Flight, then (memory no longer measured) raw Flight and arrowbuf alternating, for the ratios."""
    import pyarrow as pa
    import pyarrow.flight as flight

    import arrowbuf as ab

    mem = PeakMemory()
    payload = fixed_payload(samples)
    rows = _with_done(payload, samples)
    cols = list(payload)
    proc = _spawn_server("ab", samples, False)
    raw_proc = None
    try:
        remote = ab.connect(json.loads(proc.stdout.readline())["location"], store="perftest")
        _import_torch()
        mem.start()
        put, get, get_sample = [], [], []
        for _ in range(repeats + 1):
            put.append(_timed(lambda: remote.extend(rows)))
            t0 = time.perf_counter()
            batch = remote.sample(samples, columns=cols)
            get_sample.append(time.perf_counter() - t0)
            batch.to_torch()  # a trainer's tensors (the read-only receive buffers are copied)
            get.append(time.perf_counter() - t0)
            del batch
        mem.stop()
        # the ratio to raw Flight: the same bytes, the two measured back to back in each repeat
        raw_proc = _spawn_server("raw", samples, False)
        raw = flight.FlightClient(json.loads(raw_proc.stdout.readline())["location"])
        table = pa.RecordBatch.from_pydict({k: pa.FixedShapeTensorArray.from_numpy_ndarray(v)
                                            for k, v in payload.items()})
        r_put, r_get = [], []
        for _ in range(repeats + 1):
            def do_put() -> None:
                writer, _ = raw.do_put(flight.FlightDescriptor.for_path("x"), table.schema)
                writer.write_batch(table)
                writer.close()

            raw_put = _timed(do_put)
            ours_put = _timed(lambda: remote.extend(rows))
            raw_get = _timed(lambda: raw.do_get(flight.Ticket(b"x")).read_all())
            ours_get = _timed(lambda: remote.sample(samples, columns=cols))
            r_put.append(raw_put / ours_put)
            r_get.append(raw_get / ours_get)
        raw.close()
        remote.close()
    finally:
        for p in (proc, raw_proc):
            if p is not None:
                p.stdin.close()
                p.wait(60)
    return {"put_s": _med(put), "get_s": _med(get), "get_sample_s": _med(get_sample), **mem.split(),
            "bytes": sum(v.nbytes for v in payload.values()), "ratio_raw_put": _med(r_put),
            "ratio_raw_get": _med(r_get)}


def child_ab_flight_parts(samples: int, repeats: int) -> dict[str, Any]:
    """TransferQueue's perftest batch in ONE `remote.extend(batch)` call to a server whose max_batch_bytes is below
    the payload (the default 256 MiB, or a quarter of the payload when it is smaller, so quick runs cut parts too):
    the client sends it in parts (protocol 3) and the server commits it as one extend. Peak memory (PSS growth) of
    the client and of the server process, each as a multiple of the payload, measured after a warm-up extend and
    sample (the server's ring already touched)."""
    import arrowbuf as ab

    payload = fixed_payload(samples)
    rows = _with_done(payload, samples)
    nbytes = sum(v.nbytes for v in payload.values())
    limit = 256 << 20 if nbytes > 256 << 20 else max(1 << 20, nbytes // 4)  # the server's default, or cut in 4
    proc = _spawn_server("ab-parts", samples, False, ["--max-batch-bytes", str(limit)])
    try:
        remote = ab.connect(json.loads(proc.stdout.readline())["location"], store="perftest")
        _import_torch()
        remote.extend(rows)  # warm-up: the ring's pages, the connection
        remote.sample(samples, columns=list(payload)).to_torch()
        peaks: dict[str, int] = {}
        put, get = [], []
        for phase in ("put", "get"):  # each phase in its own window: PUT is the parts path, GET one DoGet message
            client, server = PeakMemory(), PeakMemory(pids=[proc.pid])
            client.start()
            server.start()
            for _ in range(repeats):
                if phase == "put":
                    put.append(_timed(lambda: remote.extend(rows)))
                else:
                    t0 = time.perf_counter()
                    batch = remote.sample(samples, columns=list(payload))
                    batch.to_torch()
                    get.append(time.perf_counter() - t0)
                    del batch
            client.stop()
            server.stop()
            peaks[f"{phase}_client_peak_bytes"] = client.split()["peak_self_bytes"]
            peaks[f"{phase}_server_peak_bytes"] = server.split()["peak_self_bytes"]
        from arrowbuf.flight.parts import part_bytes

        parts = -(-nbytes // part_bytes(limit))
        remote.close()
    finally:
        proc.stdin.close()
        proc.wait(60)
    return {"put_s": _med(put), "get_s": _med(get), "bytes": nbytes, "max_batch_bytes": limit, "parts_about": parts,
            **peaks}


def child_raw_flight(samples: int, repeats: int) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.flight as flight

    mem = PeakMemory()
    proc = _spawn_server("raw", samples, False)
    try:
        client = flight.FlightClient(json.loads(proc.stdout.readline())["location"])
        payload = fixed_payload(samples)
        batch = pa.RecordBatch.from_pydict({k: pa.FixedShapeTensorArray.from_numpy_ndarray(v)
                                            for k, v in payload.items()})
        mem.start()
        put, get = [], []
        for _ in range(repeats + 1):
            def do_put() -> None:
                writer, _ = client.do_put(flight.FlightDescriptor.for_path("x"), batch.schema)
                writer.write_batch(batch)
                writer.close()

            put.append(_timed(do_put))
            get.append(_timed(lambda: client.do_get(flight.Ticket(b"x")).read_all()))
        client.close()
        mem.stop()
    finally:
        proc.stdin.close()
        proc.wait(60)
    return {"put_s": _med(put), "get_s": _med(get), **mem.split(), "bytes": sum(v.nbytes for v in payload.values())}


def _ray_init() -> Any:
    import ray

    # TransferQueue's controller and storage units each reserve a CPU: 8 logical CPUs on this 2-core machine
    for attempt in range(2):  # Ray gives its node 30 s to start; a loaded machine sometimes needs a second try
        try:
            ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
                     log_to_driver=False)
            return ray
        except Exception:  # noqa: BLE001 - retried once, then raised
            ray.shutdown()
            if attempt:
                raise
    return ray


def child_ray(samples: int, repeats: int) -> dict[str, Any]:
    ray = _ray_init()
    try:
        @ray.remote(num_cpus=0.001)
        class Writer:
            def make(self, samples: int) -> int:
                self.payload = fixed_payload(samples)
                return sum(v.nbytes for v in self.payload.values())

            def put(self) -> list:
                return [ray.put(self.payload)]  # a list: the reader gets the reference, not the value

        @ray.remote(num_cpus=0.001)
        class Reader:
            def get(self, refs: list) -> int:
                import torch

                data = ray.get(refs[0])
                out = {k: torch.from_numpy(v) for k, v in data.items()}  # what a trainer takes
                return len(out)

        writer, reader = Writer.remote(), Reader.remote()
        ray.get(reader.get.remote([ray.put({})]))
        mem = PeakMemory().start()
        nbytes = ray.get(writer.make.remote(samples))
        put, get = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            refs = ray.get(writer.put.remote())
            put.append(time.perf_counter() - t0)
            get.append(_timed(lambda refs=refs: ray.get(reader.get.remote(refs))))
            del refs
        peak = mem.stop()
    finally:
        ray.shutdown()
    return {"put_s": _med(put), "get_s": _med(get), "peak_bytes": peak, "bytes": nbytes}


def child_tq(samples: int, repeats: int) -> dict[str, Any]:
    """TransferQueue 0.1.11 as its perftest runs it (SimpleStorage, writer and reader actors)."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray = _ray_init()
    try:
        config = OmegaConf.load(pathlib.Path(tq.__file__).parent / "config.yaml")
        config.backend.storage_backend = "SimpleStorage"
        config.backend.SimpleStorage.total_storage_size = samples * (repeats + 2)
        conf = OmegaConf.to_container(config, resolve=True)

        @ray.remote(num_cpus=0.001)
        class Client:
            def __init__(self, conf: dict) -> None:
                tq.init(OmegaConf.create(conf))

            def make(self, samples: int) -> int:
                import torch
                from tensordict import TensorDict

                torch.manual_seed(0)
                self.data = TensorDict({f"field_{i}": torch.randn(samples, SEQ) for i in range(FIELDS)},
                                       batch_size=(samples,))
                return samples * SEQ * FIELDS * 4

            def put(self, keys: list[str], partition: str) -> None:
                tq.kv_batch_put(keys=keys, partition_id=partition, fields=self.data)

            def get(self, keys: list[str], partition: str) -> int:
                import torch

                res = tq.kv_batch_get(keys=keys, partition_id=partition)
                dense = {}
                for k in res.keys():  # jagged nested tensors -> the dense [B, 8192] a trainer takes
                    v = res[k]
                    dense[k] = torch.stack(v.unbind()) if getattr(v, "is_nested", False) else v
                return len(dense)

            def clear(self, keys: list[str], partition: str) -> None:
                tq.kv_clear(keys=keys, partition_id=partition)

            def close(self) -> None:
                tq.close()

        tq.init(OmegaConf.create(conf))  # the driver starts the controller and storage units
        writer, reader = Client.remote(conf), Client.remote(conf)
        mem = PeakMemory().start()
        nbytes = ray.get(writer.make.remote(samples))
        put, get = [], []
        for r in range(repeats + 1):
            keys = [f"k{r}_{i}" for i in range(samples)]
            put.append(_timed(lambda keys=keys: ray.get(writer.put.remote(keys, "train_0"))))
            get.append(_timed(lambda keys=keys: ray.get(reader.get.remote(keys, "train_0"))))
            ray.get(writer.clear.remote(keys, "train_0"))
        peak = mem.stop()
        ray.get([writer.close.remote(), reader.close.remote()])
        tq.close()
    finally:
        ray.shutdown()
    return {"put_s": _med(put), "get_s": _med(get), "peak_bytes": peak, "bytes": nbytes,
            "version": _dist_version("transferqueue")}


def child_ragged(samples: int, repeats: int, pause: float) -> dict[str, Any]:
    """arrowbuf in-process on ragged rows: FIFO and uniform GET vs memcpy of the gathered bytes (fresh memory)."""
    import arrowbuf as ab

    payload = ragged_payload(samples)
    rows = _with_done(payload, samples)
    nbytes = sum(v.values.nbytes for v in payload.values())
    fifo = ab.ExperienceStore(_schema(True), capacity=samples, sampler="fifo")
    uni = ab.ExperienceStore(_schema(True), capacity=samples, sampler="uniform", seed=0)
    uni.extend(rows)
    src = np.ones(nbytes // 2, dtype=np.float32)  # warm source, 2x: a uniform batch may hold more bytes

    def memcpy(nb: int) -> float:
        """Median of 3 copies of `nb` bytes into freshly allocated memory (what a gather's output is), each after
        the same pause as the GET it is compared with (one operation after an idle spell, as the GET is timed)."""
        def one() -> float:
            time.sleep(pause)
            return _timed(lambda: np.copyto(np.empty(nb // 4, np.float32), src[:nb // 4]))
        return statistics.median(one() for _ in range(3))

    def get(store: Any) -> tuple[float, int, int, float]:
        """One GET (sample + packed tensors: values + cu_seqlens, what a varlen trainer takes): seconds, bytes,
        minor page faults and thread CPU seconds it took (the last two hold under load)."""
        f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
        t0 = time.perf_counter()
        t = store.sample(samples, columns=list(payload)).to_torch(pack=True)
        s = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        cpu = time.thread_time() - c0
        nb = sum(t[k].numel() * 4 for k in payload)
        del t
        return s, nb, faults, cpu

    put, get_fifo, get_uni, memcpy_fifo, memcpy_uni, r_fifo, r_uni = [], [], [], [], [], [], []
    faults_fifo, faults_uni, cpu_fifo, cpu_uni = [], [], [], []
    got = got_uni = 0
    for i in range(repeats + 1):
        time.sleep(pause)
        put.append(_timed(lambda: fifo.extend(rows)))
        time.sleep(pause)
        s, got, f, c = get(fifo)
        get_fifo.append(s)
        memcpy_fifo.append(memcpy(got))
        r_fifo.append(memcpy_fifo[-1] / get_fifo[-1])
        time.sleep(pause)
        s, got_uni, fu, cu = get(uni)
        get_uni.append(s)
        memcpy_uni.append(memcpy(got_uni))
        r_uni.append(memcpy_uni[-1] / get_uni[-1])
        if i:  # after the warm-up round
            faults_fifo.append(f)
            faults_uni.append(fu)
            cpu_fifo.append(c)
            cpu_uni.append(cu)
    fifo.close()
    uni.close()
    return {"put_s": _med(put), "get_fifo_s": _med(get_fifo), "get_uniform_s": _med(get_uni),
            "memcpy_fifo_s": _med(memcpy_fifo), "memcpy_uniform_s": _med(memcpy_uni), "bytes": nbytes,
            "fifo_bytes": got, "uniform_bytes": got_uni, "pause_s": pause, "ratio_fifo": _med(r_fifo),
            "ratio_uniform": _med(r_uni), "faults_fifo": statistics.median(faults_fifo),
            "faults_uniform": statistics.median(faults_uni), "cpu_fifo_s": statistics.median(cpu_fifo),
            "cpu_uniform_s": statistics.median(cpu_uni)}


def child_grpo(prompts: int, repeats: int) -> dict[str, Any]:
    """A GRPO-shaped batch: bytes per token id stored and the token imbalance of a 4-rank split."""
    import pyarrow as pa

    import arrowbuf as ab
    from arrowbuf.delivery.balance import imbalance, partition

    group = 8
    n = prompts * group
    rng = np.random.default_rng(0)
    lens = rng.integers(1024, 16 * 1024 + 1, n)
    offs = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    tokens = int(offs[-1])
    ids = pa.ListArray.from_arrays(pa.array(offs), pa.array(rng.integers(0, 151_000, tokens, dtype=np.int32)))
    lps = pa.ListArray.from_arrays(pa.array(offs), pa.array(-rng.random(tokens, dtype=np.float32)))
    schema = ab.load_schema({"name": "grpo", "fields": {
        "prompt_id": {"dtype": "int64"}, "policy_version": {"dtype": "int64"},
        "input_ids": {"dtype": "int32", "ragged": True}, "logprobs": {"dtype": "float32", "ragged": True},
        "reward": {"dtype": "float32"}, "done": {"dtype": "bool"}}})
    store = ab.ExperienceStore(schema, capacity=n, sampler="fifo")
    rows = {"prompt_id": np.repeat(np.arange(prompts), group), "policy_version": np.zeros(n, np.int64),
            "input_ids": ids, "logprobs": lps, "reward": np.zeros(n, np.float32), "done": np.ones(n, bool)}
    put = _timed(lambda: store.extend(rows))
    table = store.to_table()
    ids_bytes = table.column("input_ids").nbytes
    row_bytes = table.nbytes
    t0 = time.perf_counter()
    batch = store.sample(n)
    get = time.perf_counter() - t0
    splits = {}
    counts = batch.token_counts()
    for method in ("kk", "lpt"):
        parts = partition(counts, 4, groups=batch.to_numpy()["prompt_id"], method=method)
        splits[f"{method}, groups whole"] = imbalance(counts, parts)
        splits[method] = imbalance(counts, partition(counts, 4, method=method))
    splits["contiguous"] = imbalance(counts, np.array_split(np.arange(n), 4))
    sq = counts.astype(np.float64) ** 2
    parts = partition(sq, 4, groups=batch.to_numpy()["prompt_id"])
    splits["tokens^2 cost, kk, groups whole"] = imbalance(sq, parts)
    splits["tokens^2 cost when balanced by tokens"] = imbalance(
        sq, partition(counts, 4, groups=batch.to_numpy()["prompt_id"]))
    t0 = time.perf_counter()
    batch.split(4, balance="tokens", group="prompt_id")
    split_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch.split(4, balance="tokens^2", group="prompt_id", micro_batches=4)
    split_micro_s = time.perf_counter() - t0
    store.close()
    return {"prompts": prompts, "group": group, "tokens": tokens, "bytes_per_token_id": ids_bytes / tokens,
            "bytes_per_token_row": row_bytes / tokens, "put_s": put, "get_s": get,
            "bytes": int(ids.nbytes + lps.nbytes), "imbalance": splits, "split_s": split_s,
            "split_micro_s": split_micro_s}


def _grpo_rows(rng: np.random.Generator, prompts: int, first_id: int, lo: int, hi: int,
               version: int = 0) -> dict[str, Any]:
    """`prompts` groups of 8 completions, response lengths uniform in [lo, hi] tokens (grpo.yaml's fields)."""
    import pyarrow as pa

    n = prompts * 8
    lens = rng.integers(lo, hi + 1, n)
    offs = pa.array(np.concatenate(([0], np.cumsum(lens))).astype(np.int32))
    tokens = int(lens.sum())
    plens = pa.array(np.arange(0, 16 * n + 1, 16, dtype=np.int32))
    return {"prompt_id": np.repeat(np.arange(first_id, first_id + prompts), 8),
            "prompt_tokens": pa.ListArray.from_arrays(plens, pa.array(rng.integers(0, 151_000, 16 * n, np.int32))),
            "response_tokens": pa.ListArray.from_arrays(offs, pa.array(rng.integers(0, 151_000, tokens, np.int32))),
            "logprobs": pa.ListArray.from_arrays(offs, pa.array(-rng.random(tokens, dtype=np.float32))),
            "reward": rng.random(n, dtype=np.float32), "policy_version": np.full(n, version, np.int64),
            "done": np.ones(n, bool)}


def writer_main(location: str, seed: int, groups: int, lo: int, hi: int) -> None:
    """A writer process of the consume benchmark: `groups` whole groups over Flight, two at a time."""
    import arrowbuf as ab

    rng = np.random.default_rng(seed)
    remote = ab.connect(location)
    sent = 0
    while sent < groups:
        rows = _grpo_rows(rng, 2, seed * 1_000_000 + sent, lo, hi)
        try:
            remote.extend(rows)
            sent += 2
        except ab.InsertTimeout:  # the buffer is full of rows the trainer has not consumed: wait again
            continue
    remote.close()


#: The predicate of the consume benchmark's filtered calls: true for every row, so both kinds of call deliver alike.
CONSUME_WHERE = "reward >= 0.0 AND policy_version >= 0 AND prompt_id >= 0"
#: The trainer's step between consumes in the consume benchmark (seconds).
CONSUME_STEP_S = 0.05


def child_consume(prompts: int, repeats: int) -> dict[str, Any]:
    """consume("train", 64 rows = 8 whole groups) latency while 2 writer processes push groups over Flight, calls
    with and without `where=` alternating (`CONSUME_WHERE` passes every row, so both wait for the same rows).

    The trainer takes `CONSUME_STEP_S` between consumes (its step), so the writers keep ahead and a consume measures
    its own cost under concurrent writes rather than the writers' rate; `waited` counts the calls that found fewer
    than 64 rows ready and waited for the writers anyway."""
    import arrowbuf as ab

    lo, hi = 1024, 16 * 1024
    batches = max(8, prompts // 8) * 2
    store = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1024, tasks=["train"],
                               sampler=ab.samplers.Group(key="prompt_id", size=8))
    lat: dict[str, list[float]] = {"plain": [], "where": []}
    tokens = 0
    with ab.serve(store, max_batch_bytes=1 << 30) as server:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        groups = (batches + 2) * 8 // 2 + 64  # each writer; the rest wait on the full store until it closes
        writers = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_llm", "--serve", "writer", "--location",
                                     server.location, "--seed", str(i + 1), "--groups", str(groups)], cwd=ROOT, env=env)
                   for i in range(2)]
        waited = 0
        try:
            store.consume("train", 64, timeout=120.0)  # the writers are up
            store.consume("train", 64, where=CONSUME_WHERE, timeout=120.0)  # validated once, like any predicate
            for i in range(batches):
                time.sleep(CONSUME_STEP_S)
                kind = "where" if i % 2 else "plain"
                st = store.stats()
                waited += st["next_seq"] - st["consumed"]["train"] < 64
                t0 = time.perf_counter()
                b = store.consume("train", 64, timeout=60.0, where=CONSUME_WHERE if i % 2 else None)
                lat[kind].append(time.perf_counter() - t0)
                tokens += int(b.token_counts("response_tokens").sum())
        finally:
            store.close()  # a writer still blocked on a full buffer gets an error and exits
            for w in writers:
                try:
                    w.wait(30)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
    out: dict[str, Any] = {"batches": batches, "rows_per_batch": 64, "tokens": tokens, "lengths": [lo, hi],
                           "where": CONSUME_WHERE, "step_s": CONSUME_STEP_S, "waited": int(waited)}
    for kind, xs in lat.items():
        ms = np.asarray(xs) * 1e3
        prefix = "" if kind == "plain" else "where_"
        out.update({f"{prefix}p50_ms": float(np.percentile(ms, 50)), f"{prefix}p99_ms": float(np.percentile(ms, 99)),
                    f"{prefix}max_ms": float(ms.max())})
    return out


def child_consume_local(prompts: int, repeats: int) -> dict[str, Any]:
    """consume("train", 64) in process from a full store (no writers): the floor of a consume, with and without
    `where=`; the store is refilled outside the timed calls."""
    import arrowbuf as ab

    rng = np.random.default_rng(0)
    store = ab.ExperienceStore(ab.load_schema("grpo"), capacity=1024, tasks=["train"],
                               sampler=ab.samplers.Group(key="prompt_id", size=8))
    lat: dict[str, list[float]] = {"plain": [], "where": []}
    first = 0
    for i in range(max(64, prompts * 4)):
        if i % 16 == 0:
            store.extend(_grpo_rows(rng, 128, first, 64, 256))
            first += 128
        kind = "where" if i % 2 else "plain"
        t0 = time.perf_counter()
        b = store.consume("train", 64, timeout=0, where=CONSUME_WHERE if i % 2 else None)
        lat[kind].append(time.perf_counter() - t0)
        assert len(b) == 64
    store.close()
    out: dict[str, Any] = {}
    for kind, xs in lat.items():
        ms = np.asarray(xs[2:]) * 1e3  # the first of each validates and warms up
        out[kind] = {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                     "calls": len(ms)}
    return out


def child_where(prompts: int, repeats: int) -> dict[str, Any]:
    """consume(where=...) latency over the same rows with token columns of 1x and 10x the length."""
    import arrowbuf as ab

    out = {}
    rng = np.random.default_rng(0)
    n_groups = 128
    for scale in (1, 10):
        store = ab.ExperienceStore(ab.load_schema("grpo"), capacity=n_groups * 8, tasks=["train"])
        rows = _grpo_rows(rng, n_groups, 0, 100 * scale, 400 * scale)
        rows["policy_version"] = np.arange(n_groups * 8) % 10
        store.extend(rows)
        none, some = [], []
        for i in range(5 * repeats + 1):
            t0 = time.perf_counter()
            store.consume("train", 8, where="reward > 2.0 AND policy_version >= 3", timeout=0)  # matches no row
            none.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.consume("train", 8, where=f"policy_version = {i % 10} AND reward > 0.5", timeout=0)
            some.append(time.perf_counter() - t0)
        tokens = int(np.diff(rows["response_tokens"].offsets.to_numpy()).sum())
        store.close()
        out[f"x{scale}"] = {"none_ms": _med(none) * 1e3, "match8_ms": _med(some) * 1e3, "tokens": tokens}
    return out


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:  # noqa: BLE001 - only a label
        return "?"


# ---------------------------------------------------------------------------------------------------- servers
def _spawn_server(kind: str, samples: int, ragged: bool, extra: list[str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "benchmarks.bench_llm", "--serve", kind, "--samples",
                             str(samples), *(extra or [])], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)


def serve_main(kind: str, samples: int, args: Any = None) -> None:
    import pyarrow.flight as flight

    if kind == "writer":
        writer_main(args.location, args.seed, args.groups, 1024, 16 * 1024)
        return
    if kind in ("ab", "ab-parts"):
        import arrowbuf as ab

        # "ab-parts": uniform sampling, so its GET window needs no PUT in it (a FIFO serves each row once)
        store = ab.ExperienceStore(_schema(False), capacity=samples, sampler="fifo" if kind == "ab" else "uniform",
                                   name="perftest")
        limit = 4 << 30 if kind == "ab" else int(args.max_batch_bytes)
        server = ab.serve(store, max_batch_bytes=limit, max_batch_rows=max(65_536, samples))
        print(json.dumps({"location": server.location}), flush=True)
        sys.stdin.read()
        server.close()
        store.close()
        return

    class Raw(flight.FlightServerBase):
        """The ceiling: DoPut keeps the table, DoGet sends it back."""

        def __init__(self) -> None:
            super().__init__("grpc://127.0.0.1:0")
            self.table: Any = None

        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            self.table = reader.read_all()

        def do_get(self, context: Any, ticket: Any) -> Any:
            return flight.RecordBatchStream(self.table)

    raw = Raw()
    print(json.dumps({"location": f"grpc://127.0.0.1:{raw.port}"}), flush=True)
    sys.stdin.read()
    raw.shutdown()


# ---------------------------------------------------------------------------------------------------- parent
CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "memcpy": child_memcpy, "arrowbuf local": child_ab_local, "arrowbuf flight": child_ab_flight,
    "arrowbuf flight parts": child_ab_flight_parts, "raw flight": child_raw_flight, "ray": child_ray,
    "transferqueue": child_tq}


def run_child(name: str, args: list[str], python: str = sys.executable, timeout: float = 600) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_DEDUP_LOGS="0")
    try:
        out = subprocess.run([python, "-m", "benchmarks.bench_llm", "--child", name, *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="128 samples, 32 GRPO prompts, 2 repeats, no pauses row, no Ray/TransferQueue (--peers)")
    ap.add_argument("--samples", type=int, default=None,
                    help="global batch (default 256, --quick 128; TransferQueue's default: 1024)")
    ap.add_argument("--prompts", type=int, default=None, help="GRPO prompts (issue: 256)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--only", nargs="+", default=["fixed", "ragged", "grpo"],
                    help="fixed, ragged, grpo (grpo includes the consume and where rows), consume (those rows only)")
    ap.add_argument("--skip", nargs="*", default=[], help="fixed-row systems to skip, e.g. transferqueue ray")
    ap.add_argument("--peers", action="store_true", help="with --quick: also Ray and TransferQueue (each starts Ray)")
    ap.add_argument("--tq-python", default=TQ_PYTHON)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--pause", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--location", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--groups", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-batch-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    samples = args.samples or (128 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 3)
    prompts = args.prompts or (32 if args.quick else 256)
    if args.serve:
        serve_main(args.serve, samples, args)
        return
    if args.child:
        if args.child == "ragged":
            res = child_ragged(samples, repeats, args.pause)
        elif args.child == "grpo":
            res = child_grpo(prompts, repeats)
        elif args.child == "consume":
            res = child_consume(prompts, repeats)
        elif args.child == "consume_local":
            res = child_consume_local(prompts, repeats)
        elif args.child == "where":
            res = child_where(prompts, repeats)
        else:
            res = CHILDREN[args.child](samples, repeats)
        print(json.dumps(res), flush=True)
        return
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    common = ["--samples", str(samples), "--repeats", str(repeats), "--prompts", str(prompts)]
    results: dict[str, Any] = {}
    if "fixed" in args.only:
        results["fixed"] = {}
        for name in CHILDREN:
            if name in args.skip or (args.quick and name in ("ray", "transferqueue") and not args.peers):
                continue
            if name == "transferqueue" and not os.path.exists(args.tq_python):
                results["fixed"][name] = {"error": f"{args.tq_python} missing (pip install transferqueue==0.1.11 "
                                                   "into its own venv)"}
                continue
            python = args.tq_python if name == "transferqueue" else sys.executable
            results["fixed"][name] = run_child(name, common, python)
            _print_fixed(name, results["fixed"][name])
    if "ragged" in args.only:
        results["ragged"] = {}
        for pause in (0.0,) if args.quick else (0.0, 0.5):
            r = run_child("ragged", [*common, "--pause", str(pause)])
            results["ragged"][f"pause {pause}"] = r
            _print_ragged(pause, r)
    if "grpo" in args.only:
        results["grpo"] = run_child("grpo", common)
        _print_grpo(results["grpo"])
    if "grpo" in args.only or "consume" in args.only:
        results["consume_local"] = run_child("consume_local", common)
        _print_consume_local(results["consume_local"])
        results["consume"] = run_child("consume", common)
        _print_consume(results["consume"])
        results["where"] = run_child("where", common)
        _print_where(results["where"])
    elapsed = time.perf_counter() - t0
    load = (load_before, os.getloadavg()[0])
    print(f"({elapsed:.0f}s; {samples} samples x {FIELDS} fields x {SEQ} float32 = "
          f"{samples * FIELDS * SEQ * 4 / 1e6:.0f} MB; medians of {repeats} after a warm-up run; "
          f"load average {load[0]:.1f} -> "
          f"{load[1]:.1f} on {os.cpu_count()} CPUs)")
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "seconds": elapsed, "loadavg_1min_before_after": load, "samples": samples, "fields": FIELDS,
            "seq": SEQ, "repeats": repeats, "prompts": prompts, "quick": args.quick,
            "memory": "peak PSS of the child's process tree above its value before the payload existed"}
    (OUT / "llm.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))


def _gbs(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e9:6.2f}"


def _print_fixed(name: str, r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"fixed  {name:16} unavailable: {r['error']}", flush=True)
        return
    if "put_client_peak_bytes" in r:
        b = r["bytes"]
        print(f"fixed  {name:16} one extend of {b / 1e6:.0f} MB in about {r['parts_about']} parts "
              f"(max_batch_bytes {r['max_batch_bytes'] / 2**20:.0f} MiB): PUT {_gbs(b, r['put_s'])} GB/s, peak "
              f"client {r['put_client_peak_bytes'] / b:.2f}x, server {r['put_server_peak_bytes'] / b:.2f}x the "
              f"payload; GET (DoGet in parts of <= 64 MiB + to_torch) {_gbs(b, r['get_s'])} GB/s, peak client "
              f"{r['get_client_peak_bytes'] / b:.2f}x, server {r['get_server_peak_bytes'] / b:.2f}x (target < 2x)",
              flush=True)
        return
    if "ratio_raw_put" in r:
        print(f"fixed  {name:16} vs raw Flight back to back: PUT {r['ratio_raw_put']:.2f}x, GET (sample, no torch) "
              f"{r['ratio_raw_get']:.2f}x; GET without to_torch {_gbs(r['bytes'], r['get_sample_s'])} GB/s",
              flush=True)
    print(f"fixed  {name:16} PUT {_gbs(r['bytes'], r['put_s'])} GB/s  GET {_gbs(r['bytes'], r['get_s'])} GB/s  "
          f"peak +{r['peak_bytes'] / 2**30:5.2f} GiB ({r['peak_bytes'] / r['bytes']:4.1f}x payload"
          + (f"; this process {r['peak_self_bytes'] / r['bytes']:.1f}x" if "peak_self_bytes" in r else "") + ")",
          flush=True)


def _print_ragged(pause: float, r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"ragged pause {pause}: unavailable: {r['error']}", flush=True)
        return
    fifo, uni = r["ratio_fifo"], r["ratio_uniform"]
    print(f"ragged pause {pause:3.1f}  PUT {_gbs(r['bytes'], r['put_s'])} GB/s  GET fifo "
          f"{_gbs(r['fifo_bytes'], r['get_fifo_s'])} GB/s ({fifo:4.2f}x memcpy)  GET uniform "
          f"{_gbs(r['uniform_bytes'], r['get_uniform_s'])} GB/s ({uni:4.2f}x memcpy); per GET fifo/uniform: "
          f"{r['faults_fifo']:.0f}/{r['faults_uniform']:.0f} page faults, "
          f"{r['cpu_fifo_s'] * 1e3:.1f}/{r['cpu_uniform_s'] * 1e3:.1f} ms thread CPU", flush=True)


def _print_grpo(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"grpo   unavailable: {r['error']}", flush=True)
        return
    imb = ", ".join(f"{k} {v:.4f}" for k, v in r["imbalance"].items())
    print(f"grpo   {r['prompts']}x{r['group']} rows, {r['tokens'] / 1e6:.1f}M tokens: "
          f"{r['bytes_per_token_id']:.2f} B/token id ({r['bytes_per_token_row']:.2f} B/token for the whole row), "
          f"PUT {_gbs(r['bytes'], r['put_s'])} GB/s, GET {_gbs(r['bytes'], r['get_s'])} GB/s; "
          f"split(4) imbalance (max part / mean part): {imb}; split(4, tokens^2, 4 micro-batches) "
          f"{r['split_micro_s'] * 1e3:.1f} ms", flush=True)


def _print_consume(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"consume unavailable: {r['error']}", flush=True)
        return
    print(f"consume(train, 64 rows = 8 groups of 1k-16k tokens) with 2 writer processes over Flight: "
          f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; with where= p50 {r['where_p50_ms']:.1f} ms, "
          f"p99 {r['where_p99_ms']:.1f} ms (targets: 5 / 20 ms) over {r['batches']} batches alternating, "
          f"{r['step_s'] * 1e3:.0f} ms steps between them ({r['tokens'] / 1e6:.1f}M tokens; {r['waited']} calls "
          "waited for rows)", flush=True)


def _print_consume_local(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"consume in process unavailable: {r['error']}", flush=True)
        return
    p, w = r["plain"], r["where"]
    print(f"consume(train, 64 rows) in process, store full, no writers: p50 {p['p50_ms']:.2f} ms, p99 "
          f"{p['p99_ms']:.2f} ms (target p50 < 2 ms); with where= p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms",
          flush=True)


def _print_where(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"where   unavailable: {r['error']}", flush=True)
        return
    a, b = r["x1"], r["x10"]
    print(f"where   consume(where=...) over 1024 rows, token columns x1 ({a['tokens'] / 1e6:.1f}M tokens) -> x10: "
          f"no match {a['none_ms']:.2f} -> {b['none_ms']:.2f} ms; 8 rows matched and delivered "
          f"{a['match8_ms']:.2f} -> {b['match8_ms']:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
