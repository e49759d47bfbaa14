"""The checkpoint layout on disk, its manifest, and file integrity (see docs/format.md).

A checkpoint directory::

    ckpt/
      00000000000000000000-4096-1a2b3c4d.arrow   rows: one Arrow IPC file per sealed chunk (first seq, rows, crc32)
      00000000000000004096-1200-5e6f7a8b.arrow   ... and the open tail (a partial chunk, its own file)
      _manifest.json                             the latest checkpoint (replaced atomically: the commit point)
      _manifests/00000007.json                   every kept checkpoint's manifest (retention: keep=k)
      _state/00000007-index.arrow, ...           per-mechanism state of each kept checkpoint
      _retained/...                              row files only older kept checkpoints still reference
      _lock                                      one checkpoint writer at a time (flock)

Names starting with `_` or `.` are skipped by `pyarrow.dataset`, so after a checkpoint completes the top-level
`*.arrow` files are exactly the latest checkpoint's rows: `pyarrow.dataset.dataset(ckpt, format="ipc")` reads them.

Checksums are CRC-32 (zlib's polynomial; `persist.crc`: ISA-L's when installed, ~20 GB/s, else zlib's, a few
GB/s; the same values), enough to catch truncation and corruption
(not tampering: a checkpoint is trusted data of its owner, like a model checkpoint). Sizes are checked first.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from ..errors import InvalidArgument, StoreCorrupt
from ..observe.meter import ProgressSink
from .crc import crc32 as _crc32

FORMAT = "arrowbuf-checkpoint"
#: Version of the layout; bumped on any incompatible change (docs/format.md lists them).
FORMAT_VERSION = 1
MANIFEST = "_manifest.json"
MANIFESTS = "_manifests"
STATE = "_state"
RETAINED = "_retained"
LOCK = "_lock"
MAX_MANIFEST_BYTES = 64 << 20
#: An export's (`store.export`, `arrowbuf.persist.datasets`) metadata folder and schema file in it, and where exports
#: of earlier versions kept the schema file: defined here, beside the checkpoint's names, so that `read_manifest`
#: can tell a user who points it at an export what it is.
DATASET_META_DIR = "_arrowbuf"
DATASET_SIDE_FILE = os.path.join(DATASET_META_DIR, "dataset.json")
OLD_DATASET_SIDE_FILE = "_arrowbuf.json"
ROW_FILE = re.compile(r"^(\d{20})-(\d+)-([0-9a-f]{8})\.arrow$")


def crc32(data: Any, value: int = 0) -> int:
    return _crc32(memoryview(data).cast("B"), value)


def row_file_name(first_seq: int, rows: int, crc: int) -> str:
    return f"{first_seq:020d}-{rows}-{crc:08x}.arrow"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Mode of the files and directories a checkpoint or a journal creates: its rows are its owner's alone, as in a
#: shared-memory store.
FILE_MODE = 0o600
DIR_MODE = 0o700


def make_dirs(path: str, private: bool = True) -> None:
    """Create directory `path` and its missing parents (mode `DIR_MODE`), each new entry made durable (its parent
    directory fsynced before anything inside it is acknowledged); with `private`, check that `path` is a directory
    of this user that no other user can write (`check_private`)."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
        fsync_dir(os.path.dirname(d))
    if private:
        check_private(path)


def check_private(path: str) -> None:
    """Refuse a directory that another local user owns or can write (group- or world-writable): its files could
    be forged (a journal's records are checksummed, not signed) or replaced under the store.

    Raises:
        InvalidArgument: naming the directory, its owner and mode, and what to do.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise InvalidArgument(f"{path} is a symbolic link; a checkpoint or journal directory never follows links")
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"{path} is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise InvalidArgument(
            f"{path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: a durable store's directory "
            f"must be this user's (uid {os.geteuid()}) and not writable by group or others (another user could "
            "forge its records); use a directory of your own, or `chmod go-w` it")


def write_file(path: str, data: Any, *, sync: bool = True) -> None:
    """Write `data` to `path` through a temp file and a rename (never a half-written `path`)."""
    d, base = os.path.split(path)
    tmp = os.path.join(d, f".{base}.tmp-{os.getpid()}")
    try:
        os.unlink(tmp)  # a leftover of a killed writer (or a planted link: never opened through)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:  # out of space, say: leave no half-written temp file behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to `path` with write-temp + fsync + rename + fsync of the directory."""
    write_file(path, json.dumps(obj, indent=1).encode())
    fsync_dir(os.path.dirname(path) or ".")


def locate(root: str, name: str) -> str:
    """Where a file a manifest lists lives now: the top level, `_retained/` or `_state/`."""
    for sub in ("", RETAINED, STATE):
        p = os.path.join(root, sub, name)
        if os.path.exists(p):
            return p
    return os.path.join(root, name)


def read_verified(root: str, entry: dict[str, Any]) -> bytes:
    """The bytes of the file a manifest entry names, after checking its size and CRC-32.

    Raises:
        StoreCorrupt: the file is missing, truncated, or its checksum differs; the message names it.
    """
    path = locate(root, entry["name"])
    want = int(entry["bytes"])
    try:  # never blocks (a FIFO), never follows a link; the size is checked before anything is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise StoreCorrupt(f"checkpoint {root}: file {entry['name']} is missing; the checkpoint cannot be restored "
                           "(restore an older one, or `arrowbuf checkpoint verify` to list what is damaged)") from None
    except OSError as exc:
        raise StoreCorrupt(f"checkpoint {root}: file {path} cannot be opened ({exc.strerror}; a link?); the "
                           "checkpoint cannot be restored") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreCorrupt(f"checkpoint {root}: {path} is not a regular file; the checkpoint cannot be restored")
        if st.st_size != want:
            raise StoreCorrupt(f"checkpoint {root}: file {path} has {st.st_size} bytes, the manifest says {want} "
                               "(truncated or replaced); the checkpoint cannot be restored")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(want + 1)
    finally:
        os.close(fd)
    if len(data) != want:
        raise StoreCorrupt(f"checkpoint {root}: file {path} has {len(data)} bytes, the manifest says "
                           f"{entry['bytes']} (truncated or replaced); the checkpoint cannot be restored")
    got = crc32(data)
    if got != int(entry["crc32"], 16):
        raise StoreCorrupt(f"checkpoint {root}: file {path} is corrupt (crc32 {got:08x}, the manifest says "
                           f"{entry['crc32']}); the checkpoint cannot be restored")
    return data


def read_manifest(root: str, name: str | None = None) -> dict[str, Any]:
    """The latest manifest of checkpoint directory `root` (or the kept manifest file `name` of `_manifests/`).

    Raises:
        FileNotFoundError: no checkpoint there.
        StoreCorrupt: the manifest is malformed or of an unknown format version; the message names it.
    """
    path = os.path.join(root, MANIFEST) if name is None else os.path.join(root, MANIFESTS, name)
    if not os.path.exists(path):
        if name is None and any(os.path.exists(os.path.join(root, f))
                                for f in (DATASET_SIDE_FILE, OLD_DATASET_SIDE_FILE)):
            raise FileNotFoundError(f"{root} is an exported dataset (store.export), not a checkpoint: load it with "
                                    f"ExperienceStore.from_dataset({root!r}) (or read it with "
                                    f"ab.open_dataset({root!r})); restore() reads checkpoint directories "
                                    "(store.checkpoint)")
        raise FileNotFoundError(f"no checkpoint at {root}: {path} does not exist")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise StoreCorrupt(f"checkpoint manifest {path} cannot be opened ({exc.strerror}; a link?)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreCorrupt(f"checkpoint manifest {path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        m = json.loads(raw)
    except ValueError:
        raise StoreCorrupt(f"checkpoint manifest {path} is not valid JSON (truncated or corrupt)") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise StoreCorrupt(f"{path} is not an arrowbuf checkpoint manifest")
    if m.get("version") != FORMAT_VERSION:
        raise StoreCorrupt(f"{path}: checkpoint format version {m.get('version')!r}; this arrowbuf reads version "
                           f"{FORMAT_VERSION} (docs/format.md)")
    for key in ("generation", "store", "rows", "files"):
        if key not in m:
            raise StoreCorrupt(f"{path}: the manifest has no {key!r}")
    files = m["files"]
    if not isinstance(files, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and "/" not in e["name"]
            and not e["name"].startswith("..") and isinstance(e.get("bytes"), int)
            and isinstance(e.get("crc32"), str) for e in files):
        raise StoreCorrupt(f"{path}: malformed file list")
    m["_path"] = path
    return m


def kept_manifests(root: str) -> list[str]:
    """Names of the kept manifests in `_manifests/`, oldest first."""
    d = os.path.join(root, MANIFESTS)
    if not os.path.isdir(d):
        return []
    return sorted(n for n in os.listdir(d) if re.fullmatch(r"\d{8}\.json", n))


def verify(root: str, manifest: dict[str, Any] | None = None, progress: ProgressSink | None = None) -> list[str]:
    """Check every file of a checkpoint (sizes, checksums); returns the problems found (empty: intact). `progress`
    hears the bytes checked (phase "verify")."""
    problems = []
    try:
        m = manifest or read_manifest(root)
    except (FileNotFoundError, StoreCorrupt) as exc:
        return [str(exc)]
    total = sum(int(e["bytes"]) for e in m["files"])
    done = 0
    if progress is not None:
        progress("verify", 0, total, "B")
    for e in m["files"]:
        try:
            read_verified(root, e)
        except StoreCorrupt as exc:
            problems.append(str(exc))
        done += int(e["bytes"])
        if progress is not None:
            progress("verify", done, total, "B")
    return problems
