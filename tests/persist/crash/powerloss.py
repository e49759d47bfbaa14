"""Power-loss model: every file call a durable store makes is mirrored into a shadow file system, and the store's
directory as a power cut at each moment would leave it is restored and checked (`crash.oracle`).

`python -m crash.powerloss CONFIG_JSON` runs one model in its own process (the `os` functions are wrapped there, for
the whole process, and unwrapped before the images are restored) and writes its result as JSON to `config["out"]`.

The shadow file system (`ShadowFS`) wraps `os.open`, `close`, `write`, `pwrite`, `pwritev`, `ftruncate`, `fsync`,
`fdatasync`, `replace`, `rename`, `unlink`/`remove`, `mkdir` (so `makedirs`) and `rmdir`: every call
`arrowbuf.persist` and `arrowbuf.store.durable` make on files under the store's directory (a grep of both for `os.`;
the journal's direct I/O writes go through `os.pwrite` from its staging buffer, `arrowbuf.persist.appender`, and its
buffered ones through `os.pwritev`). Per file it keeps the current bytes and the durable bytes; per directory the
current entries and the durable ones. Two models of what survives a power cut:

- model A (pessimistic POSIX): a file's data is durable only once an `fsync`/`fdatasync` of that file returned; a
  directory entry (a create, rename, unlink, mkdir) only once an `fsync` of its directory returned.
- model B (metadata journaling, ext4/XFS-like): directory operations are durable at once; file data as in A.
- model C (a size that reached the disk before the data): as B, and every file keeps its current size, the bytes
  past its durable data reading as zeros (an appending direct write's unwritten extent, a lost page cache after a
  size update). docs/format.md calls a last record that ends in such zeros a torn tail: dropped, never applied.

A crash image is taken after every acknowledged call of the workload and after every sync, rename, unlink and
mkdir. Images that are the same files with the same bytes are restored once, with the most acknowledged calls any of
them had (the strictest check). An image restored must hold every call acknowledged before it (under "os", which
promises nothing against a power cut for the calls since, every call acknowledged before the last checkpoint
returned), may hold the call in progress, and must restore without an error.

The workload is one thread (a total order of acknowledgements): extends (the "fixed" variant's batches reach the
journal's direct-I/O size), updates, priorities, consumes with and without leases (ack, nack, leases left open),
policy versions and, unless `ckpt` is false, checkpoints. After the run the model checks itself: every file's current
bytes in the shadow must equal the real file's (a write the wrappers missed would make the images wrong).

Not modelled: a restore's own writes (`journal.seal_last` writes through `open()`; the kill harness covers restarts),
torn writes inside a page other than C's zeros, and reordering of data writes between syncs (a sync makes a file's
whole current content durable at once).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

PAGE = 1 << 16


class _Inode:
    __slots__ = ("cur", "dirty", "dur", "ver")

    def __init__(self) -> None:
        self.cur = bytearray()
        self.dirty: set[int] = set()
        self.dur: tuple[tuple[bytes, ...], int] = ((), 0)  # pages, length
        self.ver = 0

    def put(self, off: int, data: bytes) -> None:
        if len(self.cur) < off:
            self.cur.extend(bytes(off - len(self.cur)))
        self.cur[off:off + len(data)] = data
        if data:
            self.dirty.update(range(off // PAGE, (off + len(data) - 1) // PAGE + 1))

    def truncate(self, n: int) -> None:
        old = len(self.cur)
        if n < old:
            del self.cur[n:]
        else:
            self.cur.extend(bytes(n - old))
        self.dirty.update(range(min(n, old) // PAGE, max(n, old) // PAGE + 1))

    def sync(self) -> None:
        """The current bytes become durable (pages unchanged since the last sync are shared with it)."""
        pages = list(self.dur[0])
        n = len(self.cur)
        count = -(-n // PAGE)
        del pages[count:]
        pages.extend([b""] * (count - len(pages)))
        for i in self.dirty:
            if i < count:
                pages[i] = bytes(self.cur[i * PAGE:(i + 1) * PAGE])
        self.dirty = set()
        self.dur = (tuple(pages), n)
        self.ver += 1

    def durable_bytes(self) -> bytes:
        return b"".join(self.dur[0])[:self.dur[1]]


class ShadowFS:
    """Mirrors the file calls under `root` (module docstring). `images`: (key, acked, image A, image B)."""

    NAMES = ("open", "close", "write", "pwrite", "pwritev", "ftruncate", "fsync", "fdatasync", "replace", "rename",
             "unlink", "remove", "mkdir", "rmdir")

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.lock = threading.RLock()
        self.inodes: dict[int, _Inode] = {}
        self.cur_ns: dict[str, int] = {}
        self.dur_ns: dict[str, int] = {}
        self.cur_dirs = {self.root}
        self.dur_dirs = {self.root}
        self.fds: dict[int, tuple[int | None, str, int]] = {}  # fd -> (inode or None for a directory, path, flags)
        self.acked = 0
        self.images: dict[tuple[Any, ...], dict[str, Any]] = {}  # key -> image, in order of first appearance
        self.events = 0
        self.real: dict[str, Any] = {}

    # ------------------------------------------------------------------ paths
    def _path(self, path: Any, dir_fd: int | None = None) -> str | None:
        if isinstance(path, int):
            return None
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            base = self.fds.get(dir_fd)
            p = os.path.join(base[1] if base else os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        p = os.path.abspath(p)
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    # ------------------------------------------------------------------ the wrappers
    def install(self) -> None:
        self.real = {n: getattr(os, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(os, n, getattr(self, "_" + n))

    def uninstall(self) -> None:
        for n, f in self.real.items():
            setattr(os, n, f)

    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        with self.lock:
            fd = self.real["open"](path, flags, mode, dir_fd=dir_fd)
            p = self._path(path, dir_fd)
            if p is not None:
                if os.path.isdir(p):
                    self.fds[fd] = (None, p, flags)
                else:
                    if p not in self.cur_ns:
                        ino = len(self.inodes) + 1
                        self.inodes[ino] = _Inode()
                        self.cur_ns[p] = ino
                        self._snap(f"create:{os.path.basename(p)}")
                    elif flags & os.O_TRUNC:
                        self.inodes[self.cur_ns[p]].truncate(0)
                    self.fds[fd] = (self.cur_ns[p], p, flags)
            else:
                self.fds.pop(fd, None)
            return fd

    def _close(self, fd: int) -> None:
        with self.lock:
            self.fds.pop(fd, None)
            return self.real["close"](fd)

    def _file(self, fd: int) -> _Inode | None:
        entry = self.fds.get(fd)
        return None if entry is None or entry[0] is None else self.inodes[entry[0]]

    def _write(self, fd: int, data: Any) -> int:
        with self.lock:
            ino = self._file(fd)
            pos = os.lseek(fd, 0, os.SEEK_CUR) if ino is not None else 0
            n = self.real["write"](fd, data)
            if ino is not None:
                if self.fds[fd][2] & os.O_APPEND:
                    pos = len(ino.cur)
                ino.put(pos, bytes(memoryview(data).cast("B")[:n]))
            return n

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self.lock:
            n = self.real["pwrite"](fd, data, offset)
            ino = self._file(fd)
            if ino is not None:
                ino.put(offset, bytes(memoryview(data).cast("B")[:n]))
            return n

    def _pwritev(self, fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        with self.lock:
            buffers = list(buffers)
            n = self.real["pwritev"](fd, buffers, offset, flags) if flags else self.real["pwritev"](fd, buffers,
                                                                                                  offset)
            ino = self._file(fd)
            if ino is not None:
                ino.put(offset, b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:n])
            return n

    def _ftruncate(self, fd: int, length: int) -> None:
        with self.lock:
            self.real["ftruncate"](fd, length)
            ino = self._file(fd)
            if ino is not None:
                ino.truncate(length)

    def _sync(self, fd: Any, real: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        with self.lock:
            real(fd)
            entry = self.fds.get(fd)
            if entry is None:
                return
            ino, path, _ = entry
            if ino is None:  # a directory: its entries become durable
                for p in [p for p in self.dur_ns if os.path.dirname(p) == path and p not in self.cur_ns]:
                    del self.dur_ns[p]
                for p, i in self.cur_ns.items():
                    if os.path.dirname(p) == path:
                        self.dur_ns[p] = i
                self.dur_dirs = {d for d in self.dur_dirs if os.path.dirname(d) != path or d in self.cur_dirs}
                self.dur_dirs |= {d for d in self.cur_dirs if os.path.dirname(d) == path}
            else:
                self.inodes[ino].sync()
            self._snap(f"sync:{os.path.basename(path)}")

    def _fsync(self, fd: Any) -> None:
        self._sync(fd, self.real["fsync"])

    def _fdatasync(self, fd: Any) -> None:
        self._sync(fd, self.real["fdatasync"])

    def _replace(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None,
                 _real: str = "replace") -> None:
        with self.lock:
            self.real[_real](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            s, d = self._path(src, src_dir_fd), self._path(dst, dst_dir_fd)
            if s is not None and d is not None and s in self.cur_ns:
                self.cur_ns[d] = self.cur_ns.pop(s)
                self._snap(f"rename:{os.path.basename(d)}")

    def _rename(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        self._replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, _real="rename")

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        with self.lock:
            self.real["unlink"](path, dir_fd=dir_fd)
            p = self._path(path, dir_fd)
            if p is not None and self.cur_ns.pop(p, None) is not None:
                self._snap(f"unlink:{os.path.basename(p)}")

    _remove = _unlink

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        with self.lock:
            self.real["mkdir"](path, mode, dir_fd=dir_fd)
            p = self._path(path, dir_fd)
            if p is not None:
                self.cur_dirs.add(p)
                self._snap(f"mkdir:{os.path.basename(p)}")

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        with self.lock:
            self.real["rmdir"](path, dir_fd=dir_fd)
            p = self._path(path, dir_fd)
            if p is not None:
                self.cur_dirs.discard(p)
                self._snap(f"rmdir:{os.path.basename(p)}")

    # ------------------------------------------------------------------ images
    def _image(self, ns: dict[str, int], dirs: set[str], sizes: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The image of namespace `ns` and `dirs` with each file's durable bytes; `sizes`: at its current size
        (zeros past its durable bytes). A file is (pages, durable length, size)."""
        ok = set()
        for d in sorted(dirs, key=len):  # a directory exists if its parent does
            if d == self.root or os.path.dirname(d) in ok:
                ok.add(d)
        files = {}
        for p, i in ns.items():
            if os.path.dirname(p) in ok:
                ino = self.inodes[i]
                pages, n = ino.dur
                files[p] = (i, ino.ver, (pages, n, len(ino.cur) if sizes else n))
        key = (tuple(sorted((p, i, v, f[2]) for p, (i, v, f) in files.items())), tuple(sorted(ok)))
        return key, {"dirs": sorted(ok), "files": {p: f for p, (_, _, f) in files.items()}}

    def _snap(self, label: str) -> None:
        """The images of this moment (every model), with the calls acknowledged so far."""
        with self.lock:
            self.events += 1
            for model, ns, dirs, sizes in (("A", self.dur_ns, self.dur_dirs, False),
                                           ("B", self.cur_ns, self.cur_dirs, False),
                                           ("C", self.cur_ns, self.cur_dirs, True)):
                key, img = self._image(ns, dirs, sizes)
                key = (model, key)
                old = self.images.get(key)
                if old is None:
                    self.images[key] = {"model": model, "acked": self.acked, "label": label, "event": self.events,
                                        **img}
                else:
                    old["acked"] = self.acked  # the same bytes later: checked with the most acknowledged calls

    def ack(self, count: int, label: str) -> None:
        with self.lock:
            self.acked = count
            self._snap(f"ack:{label}")

    def verify(self) -> list[str]:
        """Paths whose real bytes differ from the shadow's current bytes (a write the wrappers missed)."""
        bad = []
        for p, i in self.cur_ns.items():
            try:
                with open(p, "rb") as f:
                    real = f.read()
            except FileNotFoundError:
                bad.append(f"{p}: missing")
                continue
            if real != bytes(self.inodes[i].cur):
                bad.append(f"{p}: {len(real)} bytes real, {len(self.inodes[i].cur)} in the shadow")
        return bad


def materialize(image: dict[str, Any], root: str, dest: str) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    for d in image["dirs"]:
        os.makedirs(dest + d[len(root):], exist_ok=True)
    for p, (pages, n, size) in image["files"].items():
        data = b"".join(pages)[:min(n, size)]
        with open(dest + p[len(root):], "wb") as f:
            f.write(data + bytes(size - len(data)))


# ---------------------------------------------------------------------------------------------- the workload
def workload(store: Any, fs: ShadowFS, variant: Any, n_ops: int, seed: int, ckpt: bool) -> list[dict[str, Any]]:
    """One thread of calls; returns the side log's events (start and done lines) in order."""
    import arrowbuf as ab
    from crash import workload as wl

    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    acked_ids: list[int] = []
    open_leases: list[tuple[str, Any, list[int]]] = []
    rid = wl.rid_base(0, 0)
    k = 0

    def log(op: str, args: dict[str, Any], result: dict[str, Any]) -> None:
        """Call `k` returned: logged, and acknowledged for the images from now on (the next one is in flight)."""
        nonlocal k
        k += 1
        events.append({"g": 0, "th": "p", "k": k, "op": op, "ph": "s", **args})
        events.append({"g": 0, "th": "p", "k": k, "op": op, "ph": "d", **result})
        fs.ack(k, op)

    def release() -> None:
        while open_leases:
            task, lease, ids = open_leases.pop(0)
            store.nack(lease)
            log("nack", {"task": task, "lease_id": lease, "ids": ids}, {})

    i = 0
    while i < n_ops:
        x = rng.random()
        if x < 0.4 or not acked_ids:
            n = rng.randint(*variant.batch)
            try:
                ids = store.extend(wl.rows(rid, n, variant), timeout=0.2)
            except ab.InsertTimeout:  # the tasks hold the ring: consume instead (nothing acknowledged)
                release()
                for task in variant.tasks:
                    b = store.consume(task, variant.capacity)
                    log("consume", {"task": task, "n": variant.capacity, "lease": None},
                        {"ids": np.asarray(b.indices).tolist(), "rw": _rw(b)})
            else:
                log("extend", {"rid0": rid, "n": n}, {"first": int(ids[0]), "n": len(ids)})
                acked_ids.extend(int(s) for s in ids)
                rid += n
        elif x < 0.52:
            seqs = sorted(set(rng.sample(acked_ids[-200:], min(8, len(acked_ids)))))
            v = float(100_000 + i)
            store.update(np.asarray(seqs), {"reward": np.full(len(seqs), v, np.float32)})
            log("update", {"ids": seqs, "v": v}, {})
        elif x < 0.6:
            seqs = sorted(set(rng.sample(acked_ids[-200:], min(8, len(acked_ids)))))
            v = float(200_000 + i)
            store.update_priorities(np.asarray(seqs), np.full(len(seqs), v))
            log("prio", {"ids": seqs, "v": v}, {})
        elif x < 0.7 and variant.tasks:
            n = rng.randint(8, 64)
            b = store.consume("train", n)
            log("consume", {"task": "train", "n": n, "lease": None},
                {"ids": np.asarray(b.indices).tolist(), "rw": _rw(b)})
        elif x < 0.82 and variant.tasks:
            if len(open_leases) > 1:
                release()
            n = rng.randint(8, 64)
            b = store.consume("ref", n, lease=600)
            ids = np.asarray(b.indices).tolist()
            log("consume", {"task": "ref", "n": n, "lease": 600}, {"ids": ids, "lease_id": b.lease, "rw": _rw(b)})
            if b.lease is not None:
                if rng.random() < 0.7:
                    store.ack(b.lease)
                    log("ack", {"task": "ref", "lease_id": b.lease, "ids": ids}, {})
                else:
                    open_leases.append(("ref", b.lease, ids))
        elif x < 0.88:
            store.policy_version = 1000 + i
            log("pv", {"v": 1000 + i}, {})
        elif x < 0.97 and ckpt:
            info = store.checkpoint()
            log("ckpt", {}, {k_: info.get(k_) for k_ in ("generation", "first_seq", "next_seq", "dropped_rows")})
        else:
            release()
        i += 1
    return events


def choose(images: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most `limit` images (0: all), the same share for each model: first the first image of each count of
    acknowledged calls, then others, evenly spread over the run."""
    if not limit or len(images) <= limit:
        return images
    models = sorted({img["model"] for img in images})
    per = max(1, limit // len(models))
    out = []
    for model in models:
        mine = [img for img in images if img["model"] == model]
        seen: set[int] = set()
        firsts = [i for i, img in enumerate(mine) if not (img["acked"] in seen or seen.add(img["acked"]))]
        rest = [i for i in range(len(mine)) if i not in set(firsts)]
        pick = _spread(firsts, per)
        pick += _spread(rest, per - len(pick))
        out += [mine[i] for i in sorted(pick)]
    return out


def _spread(items: list[int], n: int) -> list[int]:
    """`n` of `items`, evenly spaced (all of them if there are no more)."""
    if n <= 0:
        return []
    if len(items) <= n:
        return list(items)
    return [items[int(j * len(items) / n)] for j in range(n)]


def _rw(b: Any) -> list[list[Any]]:
    ids = np.asarray(b.indices).tolist()
    if not ids:
        return []
    return [[i, v] for i, v in zip(ids, b["reward"].to_pylist()) if v is not None]


def _image_context(path: str) -> dict[str, Any] | None:
    """What a violation's message says about an image: its checkpoint's rows and its journal segments (sizes)."""
    try:
        with open(os.path.join(path, "_manifest.json")) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    d = os.path.join(path, "_journal")
    segs = ({n: os.path.getsize(os.path.join(d, n)) for n in sorted(os.listdir(d)) if n.endswith(".arrows")}
            if os.path.isdir(d) else "no _journal directory")
    return {**{k: m["rows"].get(k) for k in ("first_seq", "next_seq", "dropped_rows")}, "journal": segs}


def _events_at(events: list[dict[str, Any]], acked: int, policy: str) -> list[dict[str, Any]]:
    """The side log as a crash at this moment leaves it: calls 1..acked done, the next one in progress (its
    result known: an unknown outcome whose ids are known); under "os" every call after the last acknowledged
    checkpoint is of unknown outcome too (no fsync before its acknowledgement)."""
    required = acked
    if policy == "os":
        ckpts = [e["k"] for e in events if e["op"] == "ckpt" and e["ph"] == "d" and e["k"] <= acked]
        required = max(ckpts, default=0)
    out = []
    for e in events:
        if e["k"] <= required or e["ph"] == "s" and e["k"] <= acked + 1:
            out.append(e)
        elif e["k"] <= acked + 1:
            out.append({**e, "ph": "u"})
    return out


# ---------------------------------------------------------------------------------------------- a run
def run(config: dict[str, Any]) -> dict[str, Any]:
    import arrowbuf as ab
    from crash import oracle as orc
    from crash import workload as wl

    policy, variant = config["policy"], wl.VARIANTS[config["variant"]]
    work = config["dir"]
    root = os.path.join(work, "run")
    os.makedirs(root)
    fs = ShadowFS(root)
    t0 = time.monotonic()
    fs.install()
    try:
        store = ab.ExperienceStore(variant.schema, capacity=variant.capacity, sampler=wl.sampler(),
                                   chunk_rows=variant.chunk_rows, durable=root, durability=policy,
                                   tasks=list(variant.tasks) or None, seed=0)
        fs.ack(0, "created")
        events = workload(store, fs, variant, int(config["ops"]), int(config["seed"]), bool(config["ckpt"]))
        store.close()
    finally:
        fs.uninstall()
    t_run = time.monotonic() - t0
    model_errors = fs.verify()
    images = list(fs.images.values())
    chosen = choose(images, int(config.get("max_images") or 0))
    where = {"mode": "powerloss", "policy": policy, "variant": variant.name, "ckpt": bool(config["ckpt"])}
    violations: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    dest = os.path.join(work, "img")
    for img in chosen:
        acked = img["acked"]
        o = orc.Oracle(variant, {**where, "model": img["model"], "event": img["event"], "at": img["label"],
                                 "acked_calls": acked})
        found = o.ingest(_events_at(events, acked, policy))
        materialize(img, root, dest)
        context = _image_context(dest)  # before the restore writes into the image (its journal, a new segment)
        if not os.path.exists(os.path.join(dest, "_manifest.json")):
            if acked > 0:
                found += o._limit([o._v("store gone", detail="no _manifest.json in the image")])
        else:
            try:
                r = ab.ExperienceStore.restore(dest)
            except Exception as exc:  # noqa: BLE001 - a violation: the image must restore
                found += o._limit([o._v("restore failed", detail=f"{type(exc).__name__}: {str(exc)[:300]}")])
            else:
                try:
                    got = orc.snapshot(r, variant.tasks)
                    got.checkpoint = context
                    found += o.check(got)
                finally:
                    r.close()
        for k, v in o.counts.items():
            counts[k] = counts.get(k, 0) + v
        violations += [{"kind": v.kind, "model": img["model"], "text": str(v)} for v in found]
    shutil.rmtree(dest, ignore_errors=True)
    kinds = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("violation:")}
    whole = orc.Oracle(variant, {})  # the run's own counts: every call acknowledged
    whole.ingest(events)
    counts = {**{k: v for k, v in whole.counts.items() if not k.startswith("violation:")},
              "rows_checked": counts.get("rows_checked", 0),
              **{k: v for k, v in counts.items() if k.startswith("violation:")}}
    failed_images = {(v["model"], v["text"].split(" acked_calls=")[0]) for v in violations}
    return {"policy": policy, "variant": variant.name, "ckpt": bool(config["ckpt"]),
            "calls": len(events) // 2, "events": fs.events, "images": len(images), "images_checked": len(chosen),
            "checkpoints": sum(1 for e in events if e["op"] == "ckpt" and e["ph"] == "d"),
            "model_errors": model_errors, "violations_by_kind": kinds,
            "images_with_violations": len(failed_images), "violations": violations[:300],
            "counts": counts, "seconds_run": round(t_run, 1), "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        result = run(config)
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(config["out"], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
