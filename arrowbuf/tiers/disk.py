"""The disk tier: arenas as uncompressed Arrow IPC files in a spill directory, memory-mapped read-write.

Usage::

    with DiskTier("spill/") as tier:               # files go to a private subdirectory, removed on close
        arena = tier.allocate("obs", np.uint8, rows=1 << 20, shape=(4, 84, 84))
        arena[0:10] = batch["obs"]                   # writes go to the page cache, the kernel writes them back
        pa.ipc.open_file(tier.path_of("obs")).read_all()   # any Arrow tool reads the file

    store = ExperienceStore(schema, capacity, tiers={"host": "16GiB", "disk": "spill/"})   # a tiered store

Each arena is one IPC file holding one record batch of one column of the arena's full size (tensor rows as a
`fixed_shape_tensor`, bool as uint8 with `arrowbuf.dtype=bool` in the field metadata). The file is written once at
allocation with the body left as a hole and the whole file reserved with posix_fallocate, so creating even a huge
arena costs no write and no memory, and a later write through the mapping can never fail for want of space (it would
be a SIGBUS); the file is then mapped
read-write and the column's data buffer is viewed in place as a numpy array. It stays a valid Arrow IPC file that
`pyarrow.ipc.open_file`, DuckDB or Polars read zero-copy. Compression is never used: it defeats zero-copy reads
(compressed IPC or Parquet are for checkpoints and archives).
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import InvalidArgument, OutOfSpace, StoreClosed
from .base import Tier, format_bytes, parse_bytes


class _Mapped:
    __slots__ = ("path", "fd", "map", "array", "nbytes", "offset")

    def __init__(self, path: str, fd: int, mapping: mmap.mmap, array: np.ndarray, nbytes: int, offset: int) -> None:
        self.path, self.fd, self.map, self.array, self.nbytes = path, fd, mapping, array, nbytes
        self.offset = offset  # of the column's data in the file (and the mapping)


class DiskTier(Tier):
    """Arenas in memory-mapped Arrow IPC files under `directory`.

    Args:
        directory: the spill directory (created if missing); this tier's files go to a private subdirectory of it.
        budget: bytes of files this tier may hold ("100GiB", an int, or None: as much as the disk has).
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], budget: Any = None) -> None:
        self.directory = os.fspath(directory)
        self.budget = parse_bytes(budget)
        # the directories this tier creates, deepest first: close() removes those still empty, so a store refused
        # (its budget, a missing dependency) or closed leaves no empty spill folder behind
        self._made: list[str] = []
        d = os.path.abspath(self.directory)
        while d and not os.path.isdir(d):
            self._made.append(d)
            d = os.path.dirname(d)
        os.makedirs(self.directory, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix=f"arrowbuf-{os.getpid()}-", dir=self.directory)
        self._files: dict[str, _Mapped] = {}
        self._closed = False

    # ------------------------------------------------------------------ Tier
    def reserve(self, nbytes: int) -> None:
        free = shutil.disk_usage(self.path).free
        if nbytes > free:
            raise OutOfSpace(f"disk tier at {self.directory!r}: the store needs {format_bytes(nbytes)} but the disk "
                             f"has {format_bytes(free)} free; free space or pick another spill directory")

    def allocate(self, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...] = ()) -> np.ndarray:
        if self._closed:
            raise StoreClosed(f"disk tier {self.path!r} is closed")
        dtype = np.dtype(dtype)
        shape = tuple(int(x) for x in shape)
        nbytes = int(rows) * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if self.budget is not None and self.nbytes() + nbytes > self.budget:
            raise OutOfSpace(f"disk tier at {self.directory!r}: arena {key!r} needs {format_bytes(nbytes)}, "
                             f"{format_bytes(self.nbytes())} of the {format_bytes(self.budget)} budget are in use; "
                             "raise the disk budget")
        if key in self._files:
            raise InvalidArgument(f"disk tier: arena {key!r} already exists")
        path = os.path.join(self.path, _file_name(key))
        _write_zero_ipc(path, key, dtype, int(rows), shape)
        offset = _data_offset(path) if nbytes else 0
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset).view(dtype).reshape(rows, *shape)
        self._files[key] = _Mapped(path, fd, mapping, array, os.path.getsize(path), offset)
        return array

    def nbytes(self) -> int:
        """Bytes of this tier's files (all of them reserved on disk)."""
        return sum(f.nbytes for f in self._files.values())

    def close(self) -> None:
        """Unmap and delete the files (views still alive keep their mapping until they go); idempotent."""
        if self._closed:
            return
        self._closed = True
        files, self._files = self._files, {}
        for f in files.values():
            f.array = None  # type: ignore[assignment]
            try:
                f.map.close()
            except BufferError:  # a view (a to_table() column, a batch) still uses it: unmapped when it goes
                pass
            os.close(f.fd)
        shutil.rmtree(self.path, ignore_errors=True)
        for d in self._made:
            try:
                os.rmdir(d)  # only if empty: another store's files, or the user's, stay
            except OSError:
                break

    # ------------------------------------------------------------------ disk specifics
    def path_of(self, key: str) -> str:
        """The IPC file of arena `key`."""
        return self._files[key].path

    def flush(self) -> None:
        """Write dirty pages back to the files (msync)."""
        for f in self._files.values():
            f.map.flush()

    def drop_cache(self) -> None:
        """Flush, then evict this tier's pages from memory (benchmarks: measure reads from the disk, not the page
        cache). The data stays in the files; the next read faults it back in."""
        for f in self._files.values():
            f.map.flush()
            if hasattr(mmap, "MADV_DONTNEED"):
                f.map.madvise(mmap.MADV_DONTNEED)
            os.fsync(f.fd)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def load_cache(self) -> None:
        """Read every page of this tier's files into the page cache and map it (benchmarks: a warm disk tier)."""
        for f in self._files.values():
            if f.array is not None and f.array.size:
                flat = f.array.reshape(-1).view(np.uint8)
                int(flat[::mmap.PAGESIZE].sum())

    def prefetch(self, key: str, rows: np.ndarray) -> None:
        """Start reading arena `key`'s `rows` (sorted positions) from the disk, all at once (MADV_WILLNEED), so that
        a gather of rows not in the page cache waits for the disk once, not once per row. Adjacent rows are merged
        into one range."""
        f = self._files.get(key)
        if f is None or not len(rows) or not hasattr(mmap, "MADV_WILLNEED"):
            return
        base = f.offset
        row_bytes = f.array.strides[0]
        breaks = np.flatnonzero(np.diff(rows) != 1)
        starts = rows[np.concatenate([[0], breaks + 1])] * row_bytes + base
        stops = (rows[np.concatenate([breaks, [len(rows) - 1]])] + 1) * row_bytes + base
        page = mmap.PAGESIZE
        for a, b in zip((starts // page * page).tolist(), stops.tolist()):
            f.map.madvise(mmap.MADV_WILLNEED, a, b - a)

    def __repr__(self) -> str:
        return f"DiskTier({self.directory!r}, files={len(self._files)}, bytes={self.nbytes()})"


def _file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".arrow"


def _arrow_type(dtype: np.dtype) -> pa.DataType:
    """The Arrow type of one stored element's parts: bool as uint8 (numpy's bytes), complex numbers as their two
    floats (Arrow has no complex type)."""
    if dtype.kind == "c":
        return pa.from_numpy_dtype(np.dtype(f"f{dtype.itemsize // 2}"))
    return pa.uint8() if dtype == np.bool_ else pa.from_numpy_dtype(dtype)


def _write_zero_ipc(path: str, key: str, dtype: np.dtype, rows: int, shape: tuple[int, ...]) -> None:
    """An IPC file with one record batch of one all-zero column of `rows` rows.

    The column's data buffer views a read-only anonymous mapping (untouched pages: no memory committed); the IPC writer
    hands that body buffer to the sink zero-copy, and the sink skips over it (a hole) instead of writing it. The whole
    file is then reserved with posix_fallocate: the body reads as zeros, costs no write, and a later write through the
    mapping cannot fail for want of disk space.
    """
    width = int(np.prod(shape, dtype=np.int64)) * (2 if dtype.kind == "c" else 1)  # complex: (real, imaginary)
    nbytes = rows * width * (dtype.itemsize // (2 if dtype.kind == "c" else 1))
    zeros = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    try:
        buf = pa.py_buffer(zeros).slice(0, nbytes)
        value_type = _arrow_type(dtype)
        values = pa.Array.from_buffers(value_type, rows * width, [None, buf])
        if dtype.kind == "c":
            column: pa.Array = pa.FixedSizeListArray.from_arrays(values, width)
        elif shape:
            column = pa.ExtensionArray.from_storage(
                pa.fixed_shape_tensor(value_type, list(shape)), pa.FixedSizeListArray.from_arrays(values, width))
        else:
            column = values
        meta = {b"arrowbuf.dtype": dtype.str.encode(), b"arrowbuf.shape": repr(list(shape)).encode()}
        schema = pa.schema([pa.field(key, column.type, nullable=False, metadata=meta)])
        with open(path, "wb") as raw:
            sink = _SkipZeros(raw, buf.address, buf.address + nbytes)
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
                writer.write_batch(pa.record_batch([column], schema=schema))
            raw.truncate(raw.tell())
            size = raw.tell()
            raw.flush()
            if size:
                os.posix_fallocate(raw.fileno(), 0, size)
        del buf, values, column
    finally:
        try:
            zeros.close()
        except BufferError:  # pragma: no cover - an Arrow buffer outlived the write; freed with it
            pass


class _SkipZeros:
    """A write-only file object for `pa.PythonFile` that seeks over the body buffers lying in [lo, hi) (zeros)."""

    closed = False
    mode = "wb"

    def __init__(self, raw: Any, lo: int, hi: int) -> None:
        self.raw, self.lo, self.hi = raw, lo, hi

    def write(self, data: Any) -> int:
        if isinstance(data, pa.Buffer) and self.lo <= data.address and data.address + data.size <= self.hi:
            self.raw.seek(data.size, os.SEEK_CUR)
            return data.size
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _data_offset(path: str) -> int:
    """Byte offset in the file of the column's data buffer."""
    with pa.memory_map(path) as source:
        whole = source.read_buffer()
        column = pa.ipc.open_file(source).get_batch(0).column(0)
        if isinstance(column, pa.ExtensionArray):
            column = column.storage
        if isinstance(column, pa.FixedSizeListArray):
            column = column.values
        data = column.buffers()[1]
        return data.address - whole.address
