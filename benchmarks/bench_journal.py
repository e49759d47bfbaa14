"""Journal benchmark (issue 25): what durability costs, beside the disk's own ceilings measured in the same run.

Rows (all on the disk of `--dir`):

- ceilings: a raw fsync loop (4 KiB write + fdatasync, per second and its p50/p99), and sequential write bandwidth
  (8 MiB writes, then fsync);
- ingest rows/s with `durability="group"`, "batch" and "os" vs the same store without a journal, for fixed tensors
  (uint8 4x84x84 frames, batches of 256) and GRPO rows (ragged tokens, batches of 64), with 1 and 4 writer threads,
  in process; and over Flight (one client, group vs none, fixed tensors and GRPO rows); `x none` is the ratio to
  the no-journal rate, `x ceil` the MB/s over min(the no-journal MB/s, the disk's write bandwidth measured the
  journal's way); `cpu us/b` the writer threads' CPU time per batch;
- the journal's cost against its own ceilings (issue 38): a lone synchronous writer (`durability="group"`, one
  thread, every extend acknowledged) against 1 / (t_none + t_sync), where t_none is a lone writer's time per batch
  without a journal and t_sync the p50 of writing a record of the same size the journal's way and fdatasyncing it,
  both measured in the same run (frames and GRPO rows); and the journal's own user-space CPU per GRPO batch
  (thread CPU with the journal, minus without it, minus the CPU its write, sync_file_range and fdatasync calls
  took: `Journal.stats["syscall_cpu_s"]`) over the no-journal CPU per batch;
- acknowledgement latency p50/p99 per policy (one writer, batches of 16 GRPO rows), beside the raw fsync latency;
- recovery: restore (checkpoint + replay) of a journal of N MB (frames, and GRPO rows), seconds per GB, per-record
  and bulk replay, vs reading the same segment files (page cache dropped before each; medians of 3).

    python -m benchmarks.bench_journal [--quick] [--dir /tmp] [--only ingest,flight,ack,recovery]
                                       [--kinds frames,grpo] [--seconds S]
    python -m benchmarks.bench_persist --journal [--quick]

Writes benchmarks/out/journal.json. The machine is shared and noisy: the load is printed with the table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import arrowbuf as ab

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
POLICIES = ("group", "batch", "os")
#: A GRPO batch's journal record (64 rows, `grpo_batch`): the size of the appends of the journal-shaped disk probe.
GRPO_RECORD_BYTES = 186 << 10
#: A frames batch's journal record (256 rows of 4x84x84 bytes): the size of the direct-write disk probe's appends.
FRAMES_RECORD_BYTES = 256 * 4 * 84 * 84 + (8 << 10)


def fsync_loop(where: str, seconds: float) -> dict[str, float]:
    """Append 4 KiB and fdatasync, as fast as possible: the disk's fsync ceiling."""
    path = os.path.join(where, "fsync.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    buf = b"\1" * 4096
    lat = []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            os.write(fd, buf)
            os.fdatasync(fd)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    a = np.array(lat)
    return {"fsyncs_per_s": len(a) / a.sum(), "p50_us": float(np.percentile(a, 50) * 1e6),
            "p99_us": float(np.percentile(a, 99) * 1e6)}


def journal_write_ceiling(where: str, record_bytes: int, seconds: float, window_s: float = 0.002) -> float:
    """Write bandwidth of the disk under `where` (bytes/s) the way the journal writes: appends of `record_bytes`
    (one record each, `os.writev` of one buffer) for `window_s`, then one fdatasync covering them (a group commit
    window), repeated for `seconds`. The ceiling for a journaled row: every byte of it goes this way."""
    path = os.path.join(where, f"jceil-{os.getpid()}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    buf = np.random.default_rng(0).integers(0, 255, record_bytes, dtype=np.uint8)
    total, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            w_end = time.perf_counter() + window_s
            while True:
                total += os.writev(fd, [buf])
                if time.perf_counter() >= w_end:
                    break
            os.fdatasync(fd)
        return total / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)


def direct_write_ceiling(where: str, record_bytes: int, seconds: float) -> float:
    """Write bandwidth of the disk under `where` (bytes/s) for large records the way the journal writes them with
    direct I/O (`arrowbuf.persist.appender`): O_DIRECT appends of `record_bytes` (rounded up to 4 KiB) from an
    aligned buffer, one fdatasync after each, back to back. The ceiling for frames (7.2 MB batches); the
    journal-shaped probe (186 KB appends through the page cache) is GRPO rows'. Falls back to the page cache where
    O_DIRECT is refused."""
    import mmap

    size = -(-record_bytes // 4096) * 4096
    buf = mmap.mmap(-1, size)
    buf.write(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes())
    path = os.path.join(where, f"dceil-{os.getpid()}.bin")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)
    total, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            total += os.pwrite(fd, buf, total)
            os.fdatasync(fd)
        return total / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def write_ceiling(where: str, nbytes: int) -> float:
    """Sequential write bandwidth of the disk under `where` (bytes/s): bench_persist's ceiling, the same probe."""
    from benchmarks.bench_persist import disk_write_ceiling

    return disk_write_ceiling(nbytes, where)


def frames_schema() -> Any:
    return {"name": "frames", "fields": {"obs": {"dtype": "uint8", "shape": [4, 84, 84]}, "action": "int64",
                                         "reward": "float32", "done": "bool"}}


def frames_batch(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 255, (n, 4, 84, 84), dtype=np.uint8), "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32), "done": (np.arange(n) % 100) == 99}


def grpo_batch(n: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(64, 512, n)
    return {"prompt_id": np.arange(n, dtype=np.int64) // 8,
            "prompt_tokens": [rng.integers(0, 32000, 128, dtype=np.int32) for _ in range(n)],
            "response_tokens": [rng.integers(0, 32000, k, dtype=np.int32) for k in lens],
            "logprobs": [np.zeros(k, np.float32) for k in lens], "policy_version": np.zeros(n, np.int64),
            "done": np.ones(n, bool)}


def _store(kind: str, durable: str | None, policy: str | None, capacity: int) -> ab.ExperienceStore:
    schema = frames_schema() if kind == "frames" else ab.load_schema("grpo")
    kw: dict[str, Any] = {} if durable is None else {"durable": durable, "durability": policy}
    return ab.ExperienceStore(schema, capacity=capacity, seed=0, **kw)


def ingest(kind: str, where: str, policy: str | None, writers: int, seconds: float,
           window: int = 0) -> dict[str, float]:
    """Rows/s of `writers` threads extending back to back for `seconds` (the ring wraps: steady state). `window`:
    each writer keeps that many writes unacknowledged (`extend(..., wait=False)`, then the oldest handle's `wait()`),
    as a producer with a window does; 0: every extend acknowledges synchronously."""
    n = 256 if kind == "frames" else 64
    batch = frames_batch(n) if kind == "frames" else grpo_batch(n)
    row_bytes = _row_bytes(kind, batch)
    d = tempfile.mkdtemp(dir=where, prefix="jb-")
    s = _store(kind, None if policy is None else os.path.join(d, "run"), policy, 20 * n * writers)
    try:
        for _ in range(2):
            s.extend(batch)  # warm up (first touch of the ring)
        os.sync()  # no writeback left from an earlier row (frames dirty GBs of page cache) under this row's fsyncs
        done = [0] * writers
        stop = time.perf_counter() + seconds

        cpu = [0.0] * writers

        def loop(i: int) -> None:
            c0 = time.thread_time()
            handles: collections.deque[Any] = collections.deque()
            while time.perf_counter() < stop:
                if window:
                    handles.append(s.extend(batch, wait=False))
                    if len(handles) > window:
                        handles.popleft().wait()
                else:
                    s.extend(batch)
                done[i] += n
            while handles:
                handles.popleft().wait()
            cpu[i] = time.thread_time() - c0

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(writers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        st = s.stats().get("journal", {})
        return {"rows_per_s": sum(done) / dt, "mb_per_s": sum(done) * row_bytes / dt / 1e6,
                "direct_io": st.get("direct_io", False),
                "fsyncs": st.get("fsyncs", 0), "records": st.get("records", 0),
                "cpu_us_per_batch": sum(cpu) / max(1, sum(done) // n) * 1e6}
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def flight_ingest(kind: str, where: str, policy: str | None, seconds: float) -> dict[str, float]:
    """Rows/s and MB/s of one Flight client extending back to back (each DoPut acknowledged once durable under
    `policy`) into a served store on 127.0.0.1."""
    n = 256 if kind == "frames" else 64
    batch = frames_batch(n) if kind == "frames" else grpo_batch(n)
    d = tempfile.mkdtemp(dir=where, prefix="jb-")
    s = _store(kind, None if policy is None else os.path.join(d, "run"), policy, 20 * n)
    try:
        with ab.serve(s, "grpc://127.0.0.1:0") as server, ab.connect(server.location) as c:
            c.extend(batch)
            os.sync()  # as `ingest`
            rows, stop, t0 = 0, time.perf_counter() + seconds, time.perf_counter()
            while time.perf_counter() < stop:
                c.extend(batch)
                rows += n
            dt = time.perf_counter() - t0
            return {"rows_per_s": rows / dt, "mb_per_s": rows * _row_bytes(kind, batch) / dt / 1e6}
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def _row_bytes(kind: str, batch: dict[str, Any]) -> int:
    if kind == "frames":
        return 4 * 84 * 84 + 13
    return int(np.mean([len(r) for r in batch["response_tokens"]]) * 8 + 128 * 4 + 24)


def ack_latency(where: str, policy: str | None, count: int) -> dict[str, float]:
    batch = grpo_batch(16)
    d = tempfile.mkdtemp(dir=where, prefix="jb-")
    s = _store("grpo", None if policy is None else os.path.join(d, "run"), policy, 4096)
    try:
        lat = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.extend(batch)
            lat.append(time.perf_counter() - t0)
        a = np.array(lat[5:])
        return {"p50_us": float(np.percentile(a, 50) * 1e6), "p99_us": float(np.percentile(a, 99) * 1e6)}
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def _drop(path: str) -> None:
    for dd, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dd, f), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _read_files(jdir: str) -> float:
    t0 = time.perf_counter()
    for f in sorted(os.listdir(jdir)):
        with open(os.path.join(jdir, f), "rb") as fh:
            while fh.read(8 << 20):
                pass
    return time.perf_counter() - t0


def recovery(where: str, mb: int, kind: str = "frames") -> dict[str, Any]:
    """Restore of a durable store whose rows are all in the journal (no checkpoint after the first): per-record
    replay and bulk replay (`persist.replay`) of copies of the same directory, interleaved with reads of the same
    files, page cache dropped before each; medians of 3 (the first touch of a fresh process's arenas is part of a
    restore's cost, and noisy)."""
    from arrowbuf.persist import replay as rp

    d = tempfile.mkdtemp(dir=where, prefix="jb-")
    run = os.path.join(d, "run")
    n = 256 if kind == "frames" else 64
    batch = frames_batch(n) if kind == "frames" else grpo_batch(n)
    row_bytes = 4 * 84 * 84 if kind == "frames" else 2600
    rows = max(n, (mb << 20) // row_bytes // n * n)
    s = _store(kind, run, "os", rows + n)
    bulk_rows = rp.BULK_ROWS
    times: dict[str, list[float]] = {"read": [], "per_record": [], "bulk": []}
    try:
        for _ in range(rows // n):
            s.extend(batch)
        s.close()
        jdir = os.path.join(run, "_journal")
        jbytes = sum(os.path.getsize(os.path.join(jdir, f)) for f in os.listdir(jdir))
        for trial in range(3):
            _drop(run)
            times["read"].append(_read_files(jdir))
            for mode in ("per_record", "bulk"):
                copy = os.path.join(d, f"{mode}{trial}")
                shutil.copytree(run, copy)
                _drop(copy)
                rp.BULK_ROWS = bulk_rows if mode == "bulk" else 0
                t0 = time.perf_counter()
                with ab.ExperienceStore.restore(copy) as again:
                    times[mode].append(time.perf_counter() - t0)
                    assert len(again) == rows
                shutil.rmtree(copy)
        gb = jbytes / 1e9
        med = {k: float(np.median(v)) for k, v in times.items()}
        return {"kind": kind, "journal_gb": gb, "rows": rows, "read_s_per_gb": med["read"] / gb,
                "per_record_s_per_gb": med["per_record"] / gb, "bulk_s_per_gb": med["bulk"] / gb,
                "restore_s_per_gb": med["bulk"] / gb, "vs_read": med["read"] / med["bulk"], "times": times}
    finally:
        rp.BULK_ROWS = bulk_rows
        shutil.rmtree(d, ignore_errors=True)


def record_sync_p50(where: str, record_bytes: int, count: int) -> float:
    """p50 seconds of making one record of `record_bytes` durable the journal's way: appended (with direct I/O for
    1 MiB and more, as `arrowbuf.persist.appender` does; through the page cache below) and fdatasynced."""
    import mmap

    from arrowbuf.persist.appender import DIRECT_MIN

    direct = record_bytes >= DIRECT_MIN and hasattr(os, "O_DIRECT")
    size = -(-record_bytes // 4096) * 4096 if direct else record_bytes
    buf = mmap.mmap(-1, max(size, 4096))
    buf.write(np.random.default_rng(0).integers(0, 255, len(buf), dtype=np.uint8).tobytes())
    view = memoryview(buf)[:size]
    path = os.path.join(where, f"rsync-{os.getpid()}.bin")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    lat, off = [], 0
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            off += os.pwrite(fd, view, off)
            os.fdatasync(fd)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
        view.release()
        buf.close()
    return float(np.median(lat[2:]))


def lone_writer(kind: str, where: str, seconds: float) -> dict[str, Any]:
    """A lone synchronous writer with `durability="group"` against the ceiling 1 / (t_none + t_sync) (module
    docstring): t_none and t_sync measured in this call, interleaved (none, sync, journal, sync, none); the
    writer's CPU per batch with and without the journal, and the journal's own (the CPU of its syscalls left out)."""
    import resource

    n = 256 if kind == "frames" else 64
    batch = frames_batch(n) if kind == "frames" else grpo_batch(n)
    record = columns_bytes(kind, batch)

    def one(policy: str | None) -> dict[str, float]:
        d = tempfile.mkdtemp(dir=where, prefix="jb-")
        s = _store(kind, None if policy is None else os.path.join(d, "run"), policy, 20 * n)
        try:
            for _ in range(3):
                s.extend(batch)
            os.sync()
            sys0 = (s.stats().get("journal") or {}).get("syscall_cpu_s", 0.0)
            r0 = resource.getrusage(resource.RUSAGE_THREAD)
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                s.extend(batch)
                count += 1
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            sys1 = (s.stats().get("journal") or {}).get("syscall_cpu_s", 0.0)
            return {"s_per_batch": dt / count, "batches": count,
                    "cpu_us": (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / count * 1e6,
                    "user_us": (r1.ru_utime - r0.ru_utime) / count * 1e6,
                    "syscall_us": (sys1 - sys0) / count * 1e6}
        finally:
            s.close()
            shutil.rmtree(d, ignore_errors=True)

    nones, syncs = [one(None)], [record_sync_p50(where, record, 40)]
    durable = one("group")
    syncs.append(record_sync_p50(where, record, 40))
    nones.append(one(None))
    with journal_code_timer() as code:  # a third run, the journal's own code timed call by call
        timed = one("group")
    t_none = float(np.median([x["s_per_batch"] for x in nones]))
    t_sync = float(np.median(syncs))
    none_cpu = float(np.median([x["cpu_us"] for x in nones]))
    own = code["cpu_s"] / max(1, timed["batches"]) * 1e6 - timed["syscall_us"]
    return {"kind": kind, "record_bytes": record, "t_none_us": t_none * 1e6, "t_sync_us": t_sync * 1e6,
            "ceiling_rows_per_s": n / (t_none + t_sync), "rows_per_s": n / durable["s_per_batch"],
            "x_ceiling": (t_none + t_sync) / durable["s_per_batch"], "none_cpu_us": none_cpu,
            "journal_cpu_us": durable["cpu_us"], "journal_syscall_cpu_us": timed["syscall_us"],
            "journal_own_cpu_us": own, "own_cpu_share": own / none_cpu,
            "writer_cpu_over_none_us": durable["cpu_us"] - durable["syscall_us"] - none_cpu,
            "trials": {"none": nones, "sync": syncs, "group": durable, "timed": timed}}


@contextlib.contextmanager
def journal_code_timer() -> Iterator[dict[str, float]]:
    """The thread CPU time spent in the journal's own code of an extend, accumulated while the block runs: encoding
    (`columns_table`, `table_pieces`, `prepare`), appending (`Journal.append_prepared`), announcing (`expect`,
    `unexpect`) and waiting (`Journal.wait`, `sync_soon`); the CPU of the write/sync calls inside them is in
    `Journal.stats["syscall_cpu_s"]`, which the caller subtracts. Each wrapped call adds two `thread_time` reads."""
    from arrowbuf.persist import journal as jr_mod
    from arrowbuf.store import durable as du

    acc = {"cpu_s": 0.0}
    inside = threading.local()

    def timed(f: Any) -> Any:
        def g(*a: Any, **k: Any) -> Any:
            if getattr(inside, "on", False):  # nested: counted by the outer call
                return f(*a, **k)
            inside.on = True
            c0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                acc["cpu_s"] += time.thread_time() - c0
                inside.on = False
        return g

    targets = [(du, "columns_table"), (du.jr, "table_pieces"), (du.jr, "prepare"),
               (jr_mod.Journal, "append_prepared"), (jr_mod.Journal, "expect"), (jr_mod.Journal, "unexpect"),
               (jr_mod.Journal, "wait"), (jr_mod.Journal, "sync_soon")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    for obj, name, f in saved:
        setattr(obj, name, timed(f))
    try:
        yield acc
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)


def columns_bytes(kind: str, batch: dict[str, Any]) -> int:
    """The bytes of a batch's journal record payload (its validated columns as an Arrow IPC stream)."""
    from arrowbuf.persist.replay import columns_table

    schema = ab.load_schema(frames_schema() if kind == "frames" else "grpo")
    cols, _ = schema.validate_batch(batch)
    return int(columns_table(cols).get_total_buffer_size())


SECTIONS = ("ingest", "lone", "flight", "ack", "recovery")


def run(where: str, quick: bool, sections: tuple[str, ...] = SECTIONS, kinds: tuple[str, ...] = ("frames", "grpo"),
        seconds: float | None = None) -> dict[str, Any]:
    secs = seconds if seconds is not None else (1.0 if quick else 4.0)
    res: dict[str, Any] = {"load_start": os.getloadavg()[0], "cpus": os.cpu_count(), "dir": where, "quick": quick}
    res["fsync"] = fsync_loop(where, secs)
    res["write_gb_per_s"] = write_ceiling(where, (128 if quick else 1024) << 20) / 1e9
    # the journal's own way of writing (record-sized appends, one fdatasync per 2 ms window), measured several times
    # in the run (before, between and after the rows: the disk's rate drifts); each row is compared with the median
    jw: list[float] = []

    dw: list[float] = []

    def jprobe() -> None:
        jw.append(journal_write_ceiling(where, GRPO_RECORD_BYTES, 0.5 if quick else 1.0) / 1e9)
        dw.append(direct_write_ceiling(where, FRAMES_RECORD_BYTES, 0.5 if quick else 1.0) / 1e9)

    jprobe()
    res["ingest"] = {}
    for kind in kinds if "ingest" in sections else ():
        jprobe()
        for writers in (1, 4):
            for policy in (None, *POLICIES):
                if quick and writers == 4 and policy in ("batch", "os"):
                    continue
                r = ingest(kind, where, policy, writers, secs)
                res["ingest"][f"{kind} w{writers} {policy or 'none'}"] = r
            res["ingest"][f"{kind} w{writers} group+win4"] = ingest(kind, where, "group", writers, secs, window=4)
    res["lone"] = {kind: lone_writer(kind, where, secs) for kind in (kinds if "lone" in sections else ())}
    res["flight"] = {}
    for kind in kinds if "flight" in sections else ():
        for p in (None, "group"):
            res["flight"][f"{kind} {p or 'none'}"] = flight_ingest(kind, where, p, secs)
    jprobe()
    res["journal_write_gb_per_s_trials"] = jw
    res["journal_write_gb_per_s"] = float(np.median(jw))
    res["direct_write_gb_per_s_trials"] = dw
    res["direct_write_gb_per_s"] = float(np.median(dw))
    if "ack" in sections:
        res["ack"] = {str(p or "none"): ack_latency(where, p, 100 if quick else 1000) for p in (None, *POLICIES)}
    if "recovery" in sections:
        res["recovery"] = recovery(where, 64 if quick else 256, "frames")
        res["recovery_grpo"] = recovery(where, 32 if quick else 128, "grpo")
    from arrowbuf.persist.crc import IMPLEMENTATION

    res["crc32"] = IMPLEMENTATION
    res["direct_io"] = any(r.get("direct_io") for r in res["ingest"].values())
    res["load_end"] = os.getloadavg()[0]
    return res


def ceiling_ratio(res: dict[str, Any], r: dict[str, float], none: dict[str, float], kind: str = "grpo") -> float:
    """A row's MB/s over min(the same store's no-journal MB/s, the disk's write MB/s the journal's way: for frames
    the median of the large direct-write probes of the run, for GRPO rows that of the journal-shaped probes; the
    sequential probe in an older result)."""
    disk = res.get("direct_write_gb_per_s" if kind == "frames" else "journal_write_gb_per_s",
                   res.get("journal_write_gb_per_s", res["write_gb_per_s"]))
    return float(r["mb_per_s"] / min(none["mb_per_s"], disk * 1e3))


def table(res: dict[str, Any]) -> str:
    f = res["fsync"]
    out = [f"journal ({'quick' if res['quick'] else 'full'}, {res['dir']}): load {res['load_start']:.1f} -> "
           f"{res['load_end']:.1f} on {res['cpus']} CPUs",
           f"ceilings: raw fsync loop {f['fsyncs_per_s']:.0f}/s (p50 {f['p50_us']:.0f} us, p99 {f['p99_us']:.0f} "
           f"us); sequential write {res['write_gb_per_s']:.2f} GB/s; journal-shaped write (186 KB appends, one "
           f"fdatasync per 2 ms) median {res.get('journal_write_gb_per_s', float('nan')):.2f} GB/s of "
           f"{', '.join(f'{x:.2f}' for x in res.get('journal_write_gb_per_s_trials', []))}; large direct writes "
           f"(7.2 MB O_DIRECT appends, an fdatasync after each) median "
           f"{res.get('direct_write_gb_per_s', float('nan')):.2f} GB/s of "
           f"{', '.join(f'{x:.2f}' for x in res.get('direct_write_gb_per_s_trials', []))}",
           f"{'ingest (in process)':<28} {'rows/s':>10} {'MB/s':>8} {'x none':>7} {'x ceil':>7} {'fsyncs':>7} "
           f"{'records':>8} {'cpu us/b':>9}"]
    ing = res["ingest"]
    for key, r in ing.items():
        kind, w, _ = key.split()
        none = ing[f"{kind} {w} none"]
        x_none = r["rows_per_s"] / none["rows_per_s"]
        out.append(f"{key:<28} {r['rows_per_s']:>10.0f} {r['mb_per_s']:>8.1f} {x_none:>7.2f} "
                   f"{ceiling_ratio(res, r, none, kind):>7.2f} {r['fsyncs']:>7} {r['records']:>8} "
                   f"{r['cpu_us_per_batch']:>9.0f}")
    out.append("x ceil: MB/s over min(the no-journal rate, the disk's write bandwidth measured the journal's way: "
               "large direct writes for frames, the journal-shaped probe for GRPO rows): a journal writes every "
               "byte to the disk, so that is the most it can reach (the disk bounds frames, the CPU bounds GRPO rows); "
               f"direct I/O for records of 1 MiB and more: {res.get('direct_io', '?')}; "
               "group+win4: each writer keeps 4 writes unacknowledged (extend(wait=False)); cpu us/b: the writer "
               f"threads' CPU time per batch; CRC-32: {res.get('crc32', '?')}")
    for kind, r in res.get("lone", {}).items():
        out.append(f"lone synchronous writer ({kind}, group): {r['rows_per_s']:.0f} rows/s against the ceiling "
                   f"1/(t_none {r['t_none_us']:.0f} us + t_sync {r['t_sync_us']:.0f} us, a "
                   f"{r['record_bytes'] / 1e6:.2f} MB record written and fdatasynced) = "
                   f"{r['ceiling_rows_per_s']:.0f} rows/s: "
                   f"{r['x_ceiling']:.2f}x ceil (target >= 0.9)")
        out.append(f"journal's own CPU per {kind} batch: {r['journal_own_cpu_us']:.0f} us (its encoding, appends "
                   f"and waits timed call by call, the {r['journal_syscall_cpu_us']:.0f} us of its write/sync calls "
                   f"left out), against {r['none_cpu_us']:.0f} us per batch without a journal: "
                   f"{r['own_cpu_share']:.0%} (target <= 25% for GRPO rows); the writer's whole CPU per batch "
                   f"grew by {r['writer_cpu_over_none_us']:.0f} us besides the syscalls (the store's own work slows "
                   "while the disk's waits let other work take the core)")
    fl = res["flight"]
    for key, r in fl.items():
        kind, policy = key.split()
        if policy == "none":
            continue
        none = fl[f"{kind} none"]
        out.append(f"over Flight ({kind}, 1 client): none {none['rows_per_s']:.0f} rows/s ({none['mb_per_s']:.0f} "
                   f"MB/s), {policy} {r['rows_per_s']:.0f} rows/s ({r['mb_per_s']:.0f} MB/s): "
                   f"{r['rows_per_s'] / none['rows_per_s']:.2f}x none, {ceiling_ratio(res, r, none, kind):.2f}x ceil")
    if "ack" in res:
        out.append("ack latency (extend of 16 grpo rows): " + ", ".join(
            f"{p} p50 {r['p50_us']:.0f} us / p99 {r['p99_us']:.0f} us" for p, r in res["ack"].items()))
    for key in ("recovery", "recovery_grpo") if "recovery" in res else ():
        rc = res[key]
        out.append(f"recovery ({rc['kind']}): {rc['journal_gb']:.3f} GB of journal ({rc['rows']} rows): restore "
                   f"{rc['per_record_s_per_gb']:.2f} s/GB per record, {rc['bulk_s_per_gb']:.2f} s/GB bulk; reading "
                   f"the files {rc['read_s_per_gb']:.2f} s/GB (bulk at {rc['vs_read']:.2f}x of the read ceiling; "
                   "medians of 3, page cache dropped)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 s per row, small recovery (a check that it runs)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {','.join(SECTIONS)} (the ceilings always run)")
    p.add_argument("--kinds", default="frames,grpo", help="comma-separated row shapes: frames, grpo")
    p.add_argument("--seconds", type=float, default=None, help="seconds per ingest row (default 4; 1 with --quick)")
    args = p.parse_args(argv)
    res = run(args.dir, args.quick, tuple(args.only.split(",")), tuple(args.kinds.split(",")), args.seconds)
    print(table(res))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "journal.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
