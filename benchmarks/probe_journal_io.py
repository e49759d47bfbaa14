"""Ways a journal record could reach the disk, measured raw (issue 25, sixth session): what each costs per 186 KB
record (a GRPO batch of 64 rows) with an `fdatasync` (or a durable completion) after each, and whether an
asynchronous durable write overlapped with the store's own copy brings one writer near its no-journal rate.

Rows:

- `append`: `pwrite` at the end of the file through the page cache, then `fdatasync` (the journal's way for small
  records);
- `direct`: the same with `O_DIRECT` from an aligned buffer (whole 4 KiB blocks);
- `direct over zeros`: `O_DIRECT` over blocks written (zeros) and synced before: no block allocation, no size
  change, so the `fdatasync` commits no filesystem metadata;
- `store`: one writer's `ExperienceStore.extend` of the batch without a journal (the rate to compare with);
- `store + aio`: the same, with the batch's record encoded and written by Linux AIO (`io_submit`, `O_DIRECT`,
  `RWF_DSYNC`: durable on completion; no thread) while the store copies, reaped after (appending, and over zeros).
  The prototype validates the batch twice (once for the record): ~130 us of its CPU per batch is that.

    python -m benchmarks.probe_journal_io [--dir /tmp] [--seconds 2]

Linux on x86-64 only (the AIO rows use raw syscall numbers). Writes benchmarks/out/journal_io.json; say the load.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import resource
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import arrowbuf as ab
from arrowbuf.persist import journal as jr
from arrowbuf.persist.replay import columns_table
from benchmarks.bench_journal import GRPO_RECORD_BYTES, OUT, grpo_batch

BLOCK = 4096
_SYS = {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209}  # x86-64


def _aligned(nbytes: int, fill: bool = True) -> mmap.mmap:
    m = mmap.mmap(-1, -(-nbytes // BLOCK) * BLOCK)
    m.write(np.random.default_rng(0).integers(0, 255, len(m), dtype=np.uint8).tobytes() if fill else bytes(len(m)))
    return m


def _zero_fill(fd: int, nbytes: int) -> None:
    z = _aligned(8 << 20, fill=False)
    for off in range(0, nbytes, len(z)):
        os.pwrite(fd, z, off)
    os.fsync(fd)
    z.close()


def raw(where: str, mode: str, seconds: float) -> dict[str, float]:
    """Per-record latency and kernel CPU of `mode` (module docstring), back to back for `seconds`."""
    path = os.path.join(where, f"jio-{os.getpid()}.bin")
    direct = mode != "append"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    buf = _aligned(GRPO_RECORD_BYTES)
    step = len(buf) if direct else GRPO_RECORD_BYTES
    view = memoryview(buf)[:step]
    span = 2 << 30
    if mode == "direct over zeros":
        span = 512 << 20
        _zero_fill(fd, span)
    lat, off = [], 0
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            a = time.perf_counter()
            os.pwrite(fd, view, off)
            os.fdatasync(fd)
            lat.append(time.perf_counter() - a)
            off = (off + step) % (span - step)
    finally:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        os.close(fd)
        os.unlink(path)
        view.release()
        buf.close()
    n = len(lat)
    return {"us_per_record": float(np.mean(lat) * 1e6), "p50_us": float(np.median(lat) * 1e6),
            "sys_us_per_record": (r1.ru_stime - r0.ru_stime) / n * 1e6}


class _Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_uint32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def store(where: str, mode: str, seconds: float) -> dict[str, float]:
    """One writer extending GRPO batches for `seconds`: `store` (no journal) or `store + aio[ over zeros]`."""
    schema = ab.load_schema("grpo")
    batch = grpo_batch(64)
    s = ab.ExperienceStore(schema, capacity=64 * 20, seed=0)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctx = ctypes.c_ulong(0)
    fd, stage = -1, _aligned(1 << 20, fill=False)
    path = os.path.join(where, f"jaio-{os.getpid()}.bin")
    span = 1 << 30
    if mode != "store":
        if libc.syscall(_SYS["io_setup"], 8, ctypes.byref(ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        if mode.endswith("over zeros"):
            span = 512 << 20
            _zero_fill(fd, span)
    arr = np.frombuffer(stage, np.uint8)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(stage))
    iocb, ev = _Iocb(), (_Event * 1)()
    ptrs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
    off = held = n = 0
    try:
        for _ in range(20):
            s.extend(batch)
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < seconds:
            if mode == "store":
                s.extend(batch)
            else:
                cols, k = schema.validate_batch(batch)
                rec = jr.prepare("batch", {"first": 0, "n": k}, jr.table_pieces(columns_table(cols)), meta_width=80)
                fill = held
                for p in jr.seal(rec, n, 0)[0]:
                    src = np.frombuffer(memoryview(p).cast("B"), np.uint8)
                    arr[fill:fill + len(src)] = src
                    fill += len(src)
                whole = -(-fill // BLOCK) * BLOCK
                arr[fill:whole] = 0
                iocb.opcode, iocb.fildes, iocb.buf, iocb.nbytes, iocb.offset, iocb.rw_flags = 1, fd, addr, whole, off, 2
                if libc.syscall(_SYS["io_submit"], ctx, 1, ptrs) != 1:
                    raise OSError(ctypes.get_errno(), "io_submit")
                s.extend(batch)  # the store's own work while the record goes to the disk
                if libc.syscall(_SYS["io_getevents"], ctx, 1, 1, ev, None) != 1 or ev[0].res != whole:
                    raise OSError(ctypes.get_errno(), f"io_getevents: {ev[0].res}")
                keep = fill % BLOCK
                arr[:keep] = arr[fill - keep:fill]
                held = keep
                off += fill - keep
                if off > span - (2 << 20):
                    off = held = 0
            n += 1
        dt = time.perf_counter() - t0
        return {"us_per_batch": dt / n * 1e6, "cpu_us_per_batch": (time.thread_time() - c0) / n * 1e6}
    finally:
        s.close()
        if fd >= 0:
            os.close(fd)
            os.unlink(path)
            libc.syscall(_SYS["io_destroy"], ctx)
        del arr
        stage.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    where = tempfile.mkdtemp(dir=a.dir, prefix="jio-")
    res: dict[str, Any] = {"load_start": os.getloadavg()[0], "raw": {}, "store": {}}
    try:
        for _ in range(a.reps):  # interleaved; medians below
            for mode in ("append", "direct", "direct over zeros"):
                res["raw"].setdefault(mode, []).append(raw(where, mode, a.seconds))
            for mode in ("store", "store + aio", "store + aio over zeros"):
                res["store"].setdefault(mode, []).append(store(where, mode, a.seconds))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    res["load_end"] = os.getloadavg()[0]

    def med(rows: list[dict[str, float]], k: str) -> float:
        return float(np.median([r[k] for r in rows]))

    print(f"journal I/O probe ({a.dir}, 186 KB records, medians of {a.reps}): load {res['load_start']:.1f} -> "
          f"{res['load_end']:.1f}")
    print(f"{'raw (record + fdatasync)':<26} {'us/record':>10} {'p50 us':>8} {'kernel us':>10}")
    for mode, rows in res["raw"].items():
        print(f"{mode:<26} {med(rows, 'us_per_record'):>10.0f} {med(rows, 'p50_us'):>8.0f} "
              f"{med(rows, 'sys_us_per_record'):>10.0f}")
    base = med(res["store"]["store"], "us_per_batch")
    print(f"{'one writer, 64 GRPO rows':<26} {'us/batch':>10} {'cpu us':>8} {'x store':>10}")
    for mode, rows in res["store"].items():
        print(f"{mode:<26} {med(rows, 'us_per_batch'):>10.0f} {med(rows, 'cpu_us_per_batch'):>8.0f} "
              f"{base / med(rows, 'us_per_batch'):>10.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "journal_io.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
