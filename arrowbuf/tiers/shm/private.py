"""Private files in shared memory: one per-user directory, files created exclusively and checked by descriptor.

Used by the broadcast (`arrowbuf.ray.Broadcast`), whose files hold policy weights that other local users must neither
read nor replace. The guarantees:

- The directory is ``<root>/arrowbuf-<euid>/`` (root: /dev/shm or ``$ARROWBUF_SHM_DIR``), created 0700. Every use
  opens it with O_DIRECTORY|O_NOFOLLOW and checks the open descriptor: a directory (not a link), owned by this user,
  no access for group or others. Anything else raises `BroadcastRefused`; nothing is created through it.
- Files are created relative to that descriptor with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600: a name that exists (a
  planted link, another user's file, a stale file) is refused, never written through.
- A file is opened for reading relative to the same descriptor with O_NOFOLLOW and accepted only if the open
  descriptor is a regular file of this user, mode 0600, one link, of the expected size and, when given, the expected
  (device, inode): the very file its creator made. The caller maps that descriptor and never opens the name again.
- Every holder of a file keeps a shared `flock` on it while it uses it; the kernel drops the lock when the holder
  dies. `sweep` (run by ``arrowbuf shm gc`` and by `Broadcast.create`) removes the files nobody holds, so a killed
  driver's weights do not stay in RAM until reboot.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from ...errors import BroadcastRefused
from .paths import shm_root

#: file names the broadcast uses start with this (sweep touches nothing else)
FILE_PREFIX = "bc-"
#: a file nobody holds is left alone this long after its last change (its creator may be between open and flock)
SWEEP_GRACE_S = 2.0
_RETRIES = 5


def user_dir(root: str | os.PathLike[str] | None = None) -> str:
    """The path of this user's private directory under `root` (not created)."""
    return os.path.join(shm_root(root), f"arrowbuf-{os.geteuid()}")


def _check_dir(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise BroadcastRefused(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise BroadcastRefused(f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): refused")
    if st.st_mode & 0o077:
        raise BroadcastRefused(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others could reach its files; "
                               "refused (it must be 0700)")


def open_dir(root: str | os.PathLike[str] | None = None, create: bool = True) -> int:
    """An O_DIRECTORY descriptor of this user's private directory (created 0700 with `create`), checked (see the
    module docstring). The caller closes it. Raises `BroadcastRefused` for a link, a foreign or a too-open directory,
    FileNotFoundError when it is missing and `create` is False."""
    path = user_dir(root)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise BroadcastRefused(f"{path} is a symlink or not a directory: refused") from exc
        raise
    try:
        _check_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(name: str, size: int, root: str | os.PathLike[str] | None = None) -> int:
    """Create `name` in the private directory (O_EXCL|O_NOFOLLOW, 0600), `size` bytes reserved, held with a shared
    flock; return its descriptor (the caller maps it and keeps it open while it uses the file).

    Raises `BroadcastRefused` when the name exists (whatever it is: a link, a foreign file, a stale file).
    """
    _check_name(name)
    for attempt in range(_RETRIES):
        d = open_dir(root)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
        except FileExistsError as exc:
            raise BroadcastRefused(f"{os.path.join(user_dir(root), name)} exists already (planted or stale): "
                                   "refused") from exc
        except FileNotFoundError:  # a sweep removed the empty directory between our open and create: again
            if attempt == _RETRIES - 1:
                raise
            continue
        finally:
            os.close(d)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.fchmod(fd, 0o600)
            if size > 0:
                os.posix_fallocate(fd, 0, size)  # reserved now: a later write into the mapping never SIGBUSes
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise AssertionError("unreachable")


def open_verified(name: str, size: int, ident: tuple[int, int] | None = None,
                  root: str | os.PathLike[str] | None = None) -> int:
    """Open `name` read-only (O_NOFOLLOW) in the private directory and check the descriptor: a regular file of this
    user, mode 0600, one link, `size` bytes, and (with `ident`) that (device, inode). Return the descriptor; raise
    `BroadcastRefused` (FileNotFoundError when the name is gone)."""
    _check_name(name)
    d = open_dir(root, create=False)
    path = os.path.join(user_dir(root), name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BroadcastRefused(f"{path} is a symlink: refused") from exc
        raise
    finally:
        os.close(d)
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"owned by uid {st.st_uid}, not this user"
        elif stat.S_IMODE(st.st_mode) != 0o600:
            why = f"mode {stat.S_IMODE(st.st_mode):o}, not 600"
        elif st.st_nlink != 1:
            why = f"{st.st_nlink} links"
        elif st.st_size != size:
            why = f"{st.st_size} bytes, expected {size}"
        elif ident is not None and (st.st_dev, st.st_ino) != tuple(ident):
            why = "not the file its creator made (another inode)"
        if why is not None:
            raise BroadcastRefused(f"{path}: {why}: refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(fd: int) -> tuple[int, int]:
    """(device, inode) of an open file: what `open_verified` checks against."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def unlink(name: str, root: str | os.PathLike[str] | None = None) -> bool:
    """Remove `name` from the private directory (never follows a link: unlink removes the link itself)."""
    _check_name(name)
    try:
        d = open_dir(root, create=False)
    except (FileNotFoundError, BroadcastRefused):
        return False
    try:
        os.unlink(name, dir_fd=d)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(d)


def names(prefix: str = FILE_PREFIX, root: str | os.PathLike[str] | None = None) -> list[str]:
    """The names in the private directory that start with `prefix` (none when it is missing or refused)."""
    try:
        d = open_dir(root, create=False)
    except (FileNotFoundError, BroadcastRefused):
        return []
    try:
        return sorted(n for n in os.listdir(d) if n.startswith(prefix))
    finally:
        os.close(d)


def sweep(root: str | os.PathLike[str] | None = None, grace_s: float = SWEEP_GRACE_S) -> list[str]:
    """Remove the broadcast files nobody holds (their holders died or closed them) and anything that is not a
    regular file under a broadcast name; then the directory itself when it is empty. Return the removed names.

    Safe at any time from any process: a live holder keeps a shared flock, which the exclusive probe never gets. A
    refused directory (a link, another user's) is left untouched.
    """
    try:
        d = open_dir(root, create=False)
    except (FileNotFoundError, BroadcastRefused):
        return []
    out = []
    try:
        now = time.time()
        for n in os.listdir(d):
            if not n.startswith(FILE_PREFIX):
                continue
            try:
                st = os.stat(n, dir_fd=d, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):  # nothing of ours: a planted link, fifo or directory
                    if not stat.S_ISDIR(st.st_mode):
                        os.unlink(n, dir_fd=d)
                        out.append(n)
                    continue
                if now - st.st_mtime < grace_s:
                    continue
                fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # a live holder
                    if (os.fstat(fd).st_ino == os.stat(n, dir_fd=d, follow_symlinks=False).st_ino):
                        os.unlink(n, dir_fd=d)
                        out.append(n)
                finally:
                    os.close(fd)
            except OSError:  # raced with its holder or another sweep
                continue
        remove_if_empty(root)
    finally:
        os.close(d)
    return out


def remove_if_empty(root: str | os.PathLike[str] | None = None) -> None:
    """Remove the private directory when it holds nothing (a creator racing this retries, see `create_file`)."""
    try:
        os.rmdir(user_dir(root))
    except OSError:
        pass


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        from ...errors import InvalidArgument

        raise InvalidArgument(f"bad private file name {name!r}")
