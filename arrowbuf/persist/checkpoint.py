"""`store.checkpoint(path)`: a consistent, incremental, atomic checkpoint that does not stop the world.

Steps (docs/format.md has the layout):

1. `capture` (short; under the store's locks): the live range, index, sampler, episode and RNG state, the tail.
2. Row files, without any lock (order: below): a sealed chunk already written to this directory (by this
   store, or read back by `restore`) is reused as is; others are read, serialised to Arrow IPC, checked intact (a
   seqlock over the rows' seqs) and written once under a name made of their first seq, row count and CRC-32.
3. State files (`_state/<generation>-<mechanism>.*`), then the manifest: `_manifests/<generation>.json`, then
   `_manifest.json` replaced with write-temp + fsync + rename + fsync of the directory. That rename is the commit:
   a process killed at any instant before it leaves the previous checkpoint as it was, restorable.
4. Retention: manifests beyond `keep` go, and files no kept manifest references are deleted; row files only older
   kept checkpoints reference move to `_retained/`, so the top-level `*.arrow` files are the latest rows.

If the ring overwrites rows while step 2 copies them: a chunk whose rows were overwritten while it was read is left
out with everything older, so the checkpoint holds a contiguous range ending at the snapshot point (`hi`), every
row exactly as committed; `dropped_rows` in the manifest counts what went. Chunks are copied oldest first while the
copy stays ahead of the writer (then at most the oldest chunk, where the writer starts, goes); once the writer
overtakes the copy, the rest is copied newest first down to the first overwritten chunk, so a copy slower than the
writer still keeps the newest rows it reached. Sampler, limiter and
episode state are those of the snapshot point, restricted to the kept rows.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ..engine.core import StoreCore
from ..errors import ArrowbufError, InvalidArgument
from ..samplers.spec import to_spec
from . import faults
from . import manifest as mf
from .snapshot import Snapshot, capture, intact_from, later_columns, later_digest, read_chunk, tensor_array

#: Per store (keyed by its ring index) and checkpoint directory: the row files of sealed chunks known to hold its
#: rows exactly, {(first_seq, rows): manifest entry}. Written by checkpoints and by restore.
_WRITTEN: weakref.WeakKeyDictionary[Any, dict[str, dict[tuple[int, int], dict[str, Any]]]] = \
    weakref.WeakKeyDictionary()
#: Nice increment of a background checkpoint's threads (Linux: per thread). Threads of one process share its CPU
#: share (one scheduler group per session under autogroup, or per cgroup); at equal priority a busy checkpoint
#: thread takes half of it from the sampling and inserting threads on a machine without a free core. At +10 it
#: yields to them (about 1 : 10) and still runs at full speed on an idle core. The price, on a machine without one:
#: the checkpoint takes longer, so a ring that overwrites rows fast leaves more of the oldest rows out of it
#: (`dropped_rows`). 0 runs it at the caller's priority.
BACKGROUND_NICE = 10


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: The names a checkpoint works in below its directory: none of them may be a link (`refuse_links`).
INTERNAL = (mf.MANIFESTS, mf.STATE, mf.RETAINED, mf.LOCK, mf.MANIFEST)


def refuse_links(root: str) -> None:
    """Refuse a checkpoint directory with a symbolic link where the checkpoint works (`_state`, `_retained`,
    `_manifests`, `_lock`, `_manifest.json`, and the entries of its subdirectories): a link planted there would make
    the checkpoint write, and retention delete, wherever it points. Row and temp files are replaced by rename
    (which never follows a link) and opened with O_NOFOLLOW.

    Raises:
        InvalidArgument: naming the link.
    """
    for name in INTERNAL:
        p = os.path.join(root, name)
        if os.path.islink(p):
            raise InvalidArgument(f"checkpoint directory {root}: {name} is a symbolic link (to "
                                  f"{os.readlink(p)[:200]!r}); a checkpoint never follows links inside its "
                                  "directory: remove it")
        if name in (mf.MANIFESTS, mf.STATE, mf.RETAINED) and os.path.isdir(p):
            for entry in os.scandir(p):
                if entry.is_symlink():
                    raise InvalidArgument(f"checkpoint directory {root}: {name}/{entry.name} is a symbolic link; "
                                          "a checkpoint never follows links inside its directory: remove it")


def known_files(core: StoreCore, root: str) -> dict[tuple[int, int], dict[str, Any]]:
    return _WRITTEN.setdefault(core.index, {}).setdefault(os.path.realpath(root), {})


class CheckpointHandle:
    """A checkpoint running in the background (`store.checkpoint(path, background=True)`), in a thread whose CPU
    priority is `BACKGROUND_NICE` below the caller's (Linux), so sampling and inserting keep their share of a busy
    machine; on a machine with an idle core it runs at full speed.

    Usage::

        h = store.checkpoint("ckpt/", background=True)   # the snapshot point is the call
        ... keep sampling and inserting ...
        info = h.wait()                                  # the manifest summary; raises what the checkpoint raised
        h.progress                                       # fraction of the row bytes done, 0.0 .. 1.0
    """

    def __init__(self, job: _Job) -> None:
        self._job = job
        self._thread = threading.Thread(target=self._run, name="arrowbuf-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if BACKGROUND_NICE and hasattr(os, "setpriority"):  # its fsync thread, started from it, inherits this
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(
                    os.PRIO_PROCESS, threading.get_native_id()) + BACKGROUND_NICE))
            except OSError:  # not allowed or not per-thread here: run at the process's priority
                pass
        self._job.run()

    @property
    def progress(self) -> float:
        return self._job.progress

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the checkpoint; returns its summary (generation, rows, files and bytes written/reused).

        Raises:
            TimeoutError: still running after `timeout` seconds.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"checkpoint still running after {timeout}s ({self.progress:.0%} done)")
        if self._job.error is not None:
            raise self._job.error
        assert self._job.result is not None
        return self._job.result


class JournalCut(Protocol):
    """How a durable store's journal and a checkpoint of it meet (docs/durability.md, "the handshake"): the
    journal may be cut only below the oldest record whose effect the snapshot is sure to hold.

    Usage (what `checkpoint(..., cut=)` does)::

        snap, entry = cut.capture(core)   # under the store's locks: the snapshot and the journal's cut point
        ...                               # row and state files written and synced
        cut.before_commit()               # the records after the cut point that the files rely on are durable
        ...                               # the manifest, with `entry` as its "journal", is committed
        cut.after_commit()                # the journal before the cut point can go
    """

    def capture(self, core: StoreCore) -> tuple[Snapshot, dict[str, Any]]: ...

    def before_commit(self) -> None: ...

    def after_commit(self) -> None: ...


def checkpoint(core: StoreCore, path: str | os.PathLike, keep: int | None = None, background: bool = False,
               compression: str | None = None, _after_read: Any = None, cut: JournalCut | None = None) -> Any:
    """Write a checkpoint of the store whose internals are `core` into directory `path` (see the module docstring
    and `ExperienceStore.checkpoint`, which calls this).

    A durable store passes its journal's `cut` (`JournalCut`): the snapshot is taken through it, once this
    checkpoint holds the directory's lock, so checkpoints of one directory capture and commit in one order.

    `_after_read(i)` (tests) runs after live chunk `i` was read and serialised, before its intact check: a test
    writes to the store there to overwrite rows mid-copy, deterministically.
    """
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise InvalidArgument(f"keep must be a positive number of checkpoints or None (keep all), got {keep!r}")
    if compression not in (None, "zstd", "lz4"):
        raise InvalidArgument(f"compression must be None (memory-mappable), 'zstd' or 'lz4', got {compression!r}")
    root = os.fspath(path)
    mf.make_dirs(root, private=False)  # a checkpoint may go where its user says; its own directories are private
    refuse_links(root)
    for sub in (mf.MANIFESTS, mf.STATE, mf.RETAINED):
        mf.make_dirs(os.path.join(root, sub))
    core.check_open()
    lock_fd = os.open(os.path.join(root, mf.LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, mf.FILE_MODE)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # one checkpoint writer per directory, across processes
        journal: dict[str, Any] | None = None
        if cut is not None:
            snap, journal = cut.capture(core)
        else:
            snap = capture(core)
        job = _Job(core, snap, root, keep, compression, lock_fd)
        job.after_read = _after_read
        job.journal, job.cut = journal, cut
    except BaseException:
        os.close(lock_fd)
        raise
    if background:
        return CheckpointHandle(job)
    job.run()
    if job.error is not None:
        raise job.error
    return job.result


class _Job:
    def __init__(self, core: StoreCore, snap: Snapshot, root: str, keep: int | None, compression: str | None,
                 lock_fd: int) -> None:
        self.core, self.snap, self.root, self.keep, self.compression = core, snap, root, keep, compression
        self.lock_fd = lock_fd
        self.schema = core.schema.to_arrow()
        assert core.options is not None, "a store's core carries the options it was built from"
        self.options = core.options.to_dict()  # what the store is rebuilt from (its sampler's spec as of now)
        self.progress = 0.0
        self.error: BaseException | None = None
        self.result: dict[str, Any] | None = None
        self.after_read: Any = None
        self.unsynced: list[Any] = []
        self.syncer: Any = None
        self.journal: dict[str, Any] | None = None
        self.cut: JournalCut | None = None
        self.written: list[str] = []  # paths this checkpoint created (removed again if it fails before its commit)
        self.committed = False

    def run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self.result = self._run()
            self.result["cpu_seconds"] = time.thread_time() - cpu0  # this thread's CPU time (the fsyncs' not)
        except BaseException as exc:  # handed to wait()
            self.error = exc
        finally:
            if self.syncer is not None:
                self.syncer.shutdown(wait=True)
            if self.error is not None and not self.committed:
                self._discard()
            os.close(self.lock_fd)

    def _discard(self) -> None:
        """A checkpoint that failed before its commit (out of space, say) removes the files it wrote (we hold the
        directory's lock), so the next checkpoint into the directory has its space and finds no debris."""
        for path in self.written:
            try:
                os.unlink(path)
            except OSError:
                pass
        known = known_files(self.core, self.root)
        gone = {os.path.basename(p) for p in self.written}
        for key in [k for k, e in known.items() if e.get("name") in gone]:
            del known[key]

    def _ipc(self, batch: pa.RecordBatch | pa.Table, schema: pa.Schema | None = None) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        opts = pa.ipc.IpcWriteOptions(compression=self.compression)
        with pa.ipc.new_file(sink, schema or batch.schema, options=opts) as w:
            if isinstance(batch, pa.Table):
                w.write_table(batch)
            else:
                w.write_batch(batch)
        return sink.getvalue()

    def _write(self, name: str, data: Any, sub: str = "", crc: int | None = None) -> dict[str, Any]:
        """Write a file through temp + rename; a background thread fsyncs it while the next file is prepared, and
        `_sync` waits for all of them before the manifest names them."""
        path = os.path.join(self.root, sub, name)
        if not os.path.exists(path):
            self.written.append(path)
        mf.write_file(path, data, sync=False)
        if self.syncer is None:
            from concurrent.futures import ThreadPoolExecutor

            self.syncer = ThreadPoolExecutor(1, thread_name_prefix="arrowbuf-fsync")
        self.unsynced.append(self.syncer.submit(_fsync_path, path))
        crc = mf.crc32(data) if crc is None else crc
        return {"name": name, "bytes": len(memoryview(data).cast("B")), "crc32": f"{crc:08x}"}

    def _sync(self) -> None:
        """Every file this checkpoint wrote is on disk, then their directories (before the manifest names them)."""
        for fut in self.unsynced:
            fut.result()
        for sub in ("", mf.STATE, mf.RETAINED):
            mf.fsync_dir(os.path.join(self.root, sub))
        self.unsynced = []

    def _run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        snap, core, root = self.snap, self.core, self.root
        prev_gen = self._previous_generation()
        gen = prev_gen + 1
        known = known_files(core, root)
        counts = {"written": 0, "reused": 0, "written_bytes": 0}
        kept_lo = snap.lo
        total = max(1, sum(c[2] - c[1] for c in snap.chunks))
        done_rows = 0
        # Oldest chunk first, as long as the copy stays ahead of the ring's writer (it starts at the oldest chunk, so
        # that one may go). If the writer overtakes the copy (it overwrites faster than the copy writes files), go on
        # from the newest chunk down instead, until the first chunk overwritten meanwhile: the checkpoint then keeps
        # the newest rows it got to rather than chasing the writer and keeping none.
        chunks = snap.chunks
        older: list[dict[str, Any]] = []  # kept, copied oldest first
        newer: list[dict[str, Any]] = []  # kept, copied newest first (after the writer overtook the copy)
        i, j, downward = 0, len(chunks) - 1, False
        while i <= j:
            k = j if downward else i
            _, p0, p1, first = chunks[k]
            n = p1 - p0
            e, cut = self._copy(k, known, counts)
            done_rows += n
            self.progress = 0.95 * done_rows / total
            if cut:  # its oldest `cut` rows were overwritten: they and everything older leave the snapshot
                kept_lo = first + cut
                if downward:
                    if e is not None:
                        newer.append(e)
                    older = []
                    break
                older = [] if e is None else [e]
                i += 1
                downward = i <= j and intact_from(core, snap, i) > 0  # the writer is ahead of the copy
                continue
            assert e is not None  # (no cut: the chunk was copied whole)
            if downward:
                newer.append(e)
                j -= 1
            else:
                older.append(e)
                i += 1
        entries = older + newer[::-1]
        written, reused, written_bytes = counts["written"], counts["reused"], counts["written_bytes"]
        state_entries, dropped_valid = self._write_state(gen, kept_lo)
        self._sync()
        if self.cut is not None:
            self.cut.before_commit()
        faults.reached("before_manifest")
        m = {
            "format": mf.FORMAT, "version": mf.FORMAT_VERSION, "generation": gen, "created": time.time(),
            "store": {**self.options, "schema": core.schema.to_dict(), "tier": core.tier_name,
                      "arena_rows": core.arena_rows},
            "rows": {"first_seq": kept_lo, "next_seq": snap.hi, "count": snap.hi - kept_lo,
                     "snapshot_first_seq": snap.lo, "dropped_rows": kept_lo - snap.lo},
            "compression": self.compression,
            "arrow_schema": self.schema.to_string(show_schema_metadata=False),
            "files": entries + state_entries,
        }
        if self.journal is not None:
            m["journal"] = self.journal
        mpath = os.path.join(root, mf.MANIFESTS, f"{gen:08d}.json")
        self.written.append(mpath)
        mf.write_json_atomic(mpath, m)
        faults.reached("before_commit")
        # the commit: write-temp + fsync + rename + fsync dir
        tmp = os.path.join(root, f".{mf.MANIFEST}.tmp-{os.getpid()}")
        self.written.append(tmp)
        mf.write_file(tmp, json.dumps(m, indent=1).encode())
        faults.reached("manifest_tmp")
        os.replace(tmp, os.path.join(root, mf.MANIFEST))
        self.committed = True
        mf.fsync_dir(root)
        if self.cut is not None:
            self.cut.after_commit()
        faults.reached("after_commit")
        self._collect(m)
        self.progress = 1.0
        row_bytes = sum(e["bytes"] for e in entries)
        return {"path": root, "generation": gen, "rows": snap.hi - kept_lo, "first_seq": kept_lo,
                "next_seq": snap.hi, "dropped_rows": kept_lo - snap.lo, "files_written": written,
                "files_reused": reused, "bytes_written": written_bytes, "row_bytes": row_bytes,
                "seconds": time.perf_counter() - t0}

    def _copy(self, i: int, known: dict[tuple[int, int], dict[str, Any]],
              counts: dict[str, int]) -> tuple[dict[str, Any] | None, int]:
        """Live chunk `i` as a row file of this checkpoint (reused, or read, checked intact and written): its
        manifest entry and how many of its first rows were overwritten before or while it was read (they are left
        out: the entry holds the rest; all of them: None)."""
        snap, core, root = self.snap, self.core, self.root
        _, p0, p1, first = snap.chunks[i]
        n = p1 - p0
        cut = intact_from(core, snap, i) if snap.sealed[i] else 0
        if cut == n:
            return None, n
        full = snap.sealed[i] and n == core.chunk_rows and cut == 0
        digest = later_digest(later_columns(core, snap, i)) if full else None
        entry = known.get((first, n)) if full and self.compression is None else None
        if entry is not None and entry.get("later") == digest and self._restore_file(entry):
            e = {k: v for k, v in entry.items() if k != "later"}
            counts["reused"] += 1
        else:
            batch = read_chunk(core, snap, i, self.schema)
            data = self._ipc(batch.slice(cut) if cut else batch)
            del batch
            if self.after_read is not None:
                self.after_read(i)
            if snap.sealed[i]:
                now = intact_from(core, snap, i)  # the seqlock: rows from `now` on were not touched while read
                if now == n:
                    return None, n
                if now > cut:  # more of its oldest rows went while it was read: keep the rest, from the copy
                    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
                    data = self._ipc(table.slice(now - cut))
                    cut = now
                    full = False
            crc = mf.crc32(data)
            name = mf.row_file_name(first + cut, n - cut, crc)
            if os.path.exists(os.path.join(root, name)) and os.path.getsize(os.path.join(root, name)) == len(data):
                e = {"name": name, "bytes": len(data), "crc32": f"{crc:08x}"}  # same content, already there
                counts["reused"] += 1
            else:
                e = self._write(name, data, crc=crc)
                counts["written"] += 1
                counts["written_bytes"] += e["bytes"]
            if full and self.compression is None:
                known[(first, n)] = {**e, "kind": "chunk", "first_seq": first, "rows": n, "later": digest}
            faults.reached("after_chunk")
        e.update(kind="chunk" if full else "tail" if i == len(snap.chunks) - 1 else "partial", first_seq=first + cut,
                 rows=n - cut)
        return e, cut

    def _restore_file(self, entry: dict[str, Any]) -> bool:
        """A known row file is usable when it is still there (moved back to the top level from `_retained/`)."""
        top = os.path.join(self.root, entry["name"])
        if os.path.exists(top):
            return os.path.getsize(top) == entry["bytes"]
        old = os.path.join(self.root, mf.RETAINED, entry["name"])
        if os.path.exists(old) and os.path.getsize(old) == entry["bytes"]:
            os.replace(old, top)
            return True
        return False

    def _previous_generation(self) -> int:
        gens = [int(n[:8]) for n in mf.kept_manifests(self.root)]
        try:
            gens.append(int(mf.read_manifest(self.root)["generation"]))
        except (FileNotFoundError, ArrowbufError, ValueError, TypeError):
            pass
        return max(gens, default=0)

    def _write_state(self, gen: int, kept_lo: int) -> tuple[list[dict[str, Any]], int]:
        """The per-mechanism state files of generation `gen`, restricted to the kept rows [kept_lo, hi)."""
        snap, core = self.snap, self.core
        k = kept_lo - snap.lo
        dropped_valid = int(snap.index["valid"][:k].sum())
        out = []
        index = {name: a[k:] for name, a in snap.index.items()}
        out.append(self._state_arrow(gen, "index", index, {}))
        sampler_arrays = {name: a[k:] for name, a in snap.sampler_arrays.items()}
        out.append(self._state_arrow(gen, "sampler", sampler_arrays,
                                     {"meta": snap.sampler_meta, "dropped_valid": dropped_valid}))
        fin = snap.final
        keep = fin["owner"] >= kept_lo
        final_cols = {"slot": fin["slot"][keep], "owner": fin["owner"][keep]}
        for src, rows in fin["data"].items():
            final_cols[src] = rows[keep]
        out.append(self._state_arrow(gen, "final", final_cols, {}, shapes=True))
        if snap.consume_meta is not None:
            consumed = {task: a[k:] for task, a in snap.consume_arrays.items()}
            out.append(self._state_arrow(gen, "consume", consumed, snap.consume_meta))
        if snap.lineage_meta is not None:
            lineage = {name: a[k:] for name, a in snap.lineage_arrays.items()}
            out.append(self._state_arrow(gen, "lineage", lineage, snap.lineage_meta))
        h = snap.header
        from ..ring.index import HEADER

        header = {name: int(h[i]) for name, i in HEADER.items()}
        header.update(lo=kept_lo)
        limiter = {"spec": to_spec(core.rate_limiter), "inserts": header["inserts"], "samples": header["samples"]}
        for mech, obj in (("episodes", snap.episodes), ("rng", snap.rng), ("limiter", limiter),
                          ("header", header)):
            data = json.dumps(obj, sort_keys=True).encode()
            e = self._write(f"{gen:08d}-{mech}.json", data, mf.STATE)
            e["kind"] = f"state:{mech}"
            out.append(e)
        return out, dropped_valid

    def _state_arrow(self, gen: int, mech: str, cols: dict[str, np.ndarray], meta: dict[str, Any],
                     shapes: bool = False) -> dict[str, Any]:
        arrays, names = [], []
        for name, a in cols.items():
            a = np.asarray(a)
            arrays.append(tensor_array(a) if a.ndim > 1 else pa.array(a))
            names.append(name)
        table = pa.table(arrays, names=names) if arrays else pa.table({})
        table = table.replace_schema_metadata({"arrowbuf": json.dumps(meta)})
        e = self._write(f"{gen:08d}-{mech}.arrow", self._ipc(table), mf.STATE)
        e["kind"] = f"state:{mech}"
        return e

    def _collect(self, latest: dict[str, Any]) -> None:
        """Retention: drop manifests beyond `keep` and every file no kept manifest references."""
        root = self.root
        names = mf.kept_manifests(root)
        if self.keep is not None:
            for n in names[:-self.keep]:
                os.unlink(os.path.join(root, mf.MANIFESTS, n))
            names = names[-self.keep:]
        referenced = {e["name"] for e in latest["files"]}
        for n in names:
            try:
                referenced |= {e["name"] for e in mf.read_manifest(root, n)["files"]}
            except (ArrowbufError, FileNotFoundError):
                continue
        latest_names = {e["name"] for e in latest["files"]}
        for n in os.listdir(root):
            p = os.path.join(root, n)
            if mf.ROW_FILE.match(n) and n not in latest_names:
                if n in referenced:
                    os.replace(p, os.path.join(root, mf.RETAINED, n))
                else:
                    os.unlink(p)
            elif n.startswith(".") and ".tmp-" in n:
                os.unlink(p)  # a temp file of a killed checkpoint (we hold the directory's lock)
        for sub in (mf.RETAINED, mf.STATE, mf.MANIFESTS):
            d = os.path.join(root, sub)
            for n in os.listdir(d):
                if sub == mf.MANIFESTS:
                    if n.startswith(".") and ".tmp-" in n:
                        os.unlink(os.path.join(d, n))
                    continue
                if n not in referenced:
                    p = os.path.join(d, n)
                    if os.path.isdir(p):
                        shutil.rmtree(p)
                    else:
                        os.unlink(p)
        mf.fsync_dir(root)
