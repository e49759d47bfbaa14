"""Whether to believe a shared store's files: who owns them and who else can write them.

The threat: /dev/shm is writable by every local user, so another user can create a store under the name a learner
will attach to (or plant files in a store others can write) and feed it rows. `attach` therefore opens a store only
when its directory and every file it opens belong to this process's user and nobody else can write them; a store of
another user is opened only when asked explicitly (`attach(name, allow_other_owner=True)`), and even then files
writable by users other than the owner (and its group, in that case) are refused. Files are opened without following
symbolic links. docs/security.md states the model.
"""

from __future__ import annotations

import os
import stat

from ...errors import StoreNotTrusted


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_store_dir(path: str, name: str, allow_other_owner: bool = False) -> os.stat_result:
    """Check the store directory `path` before anything in it is read; returns its stat.

    Raises:
        StoreNotTrusted: `path` is not a real directory (a link or file under the store's name), belongs to another
            user (unless `allow_other_owner`), or users other than its owner can add or replace files in it.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StoreNotTrusted(f"shared store {name!r}: {path} is not a directory (a link or a file was put under the "
                              "store's name); refusing to attach. Remove it if it is not yours, or pick another name")
    me = os.geteuid()
    if st.st_uid != me and not allow_other_owner:
        raise StoreNotTrusted(
            f"shared store {name!r} at {path} belongs to {_user(st.st_uid)}, not to this process's {_user(me)}: "
            "another user may have created it to feed you rows; refusing to attach. If you trust that user, "
            f"attach({name!r}, allow_other_owner=True)")
    others = _writers(st, st.st_mode, allow_other_owner)
    if others:
        raise StoreNotTrusted(f"shared store {name!r}: {others} can add or replace files in {path} (mode "
                              f"0o{stat.S_IMODE(st.st_mode):o}); refusing to attach. Recreate the store (its "
                              "directory is made 0o700)")
    return st


def check_store_file(fd: int, file: str, name: str, dir_stat: os.stat_result, allow_other_owner: bool = False) -> None:
    """Check an open file of the store (from `open_store_file`): a regular file of the directory's owner that no one
    else can write.

    Raises:
        StoreNotTrusted: it is not a regular file, belongs to another user than the directory, or others can write it.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StoreNotTrusted(f"shared store {name!r}: {file} is not a regular file; refusing to use it")
    if st.st_uid != dir_stat.st_uid:
        raise StoreNotTrusted(f"shared store {name!r}: {file} belongs to {_user(st.st_uid)}, but the store to "
                              f"{_user(dir_stat.st_uid)}: a planted file; refusing to use it. Recreate the store")
    # a file others may write matters only where they can reach it (search permission on the directory)
    reach = dir_stat.st_mode & (stat.S_IXGRP | stat.S_IXOTH)
    mode = st.st_mode & ((stat.S_IWGRP if reach & stat.S_IXGRP else 0) | (stat.S_IWOTH if reach & stat.S_IXOTH else 0))
    others = _writers(st, mode | stat.S_IFREG, allow_other_owner)
    if others:
        raise StoreNotTrusted(f"shared store {name!r}: {others} can write {file} (mode "
                              f"0o{stat.S_IMODE(st.st_mode):o}); refusing to use it. Recreate the store")


def open_store_file(file: str, flags: int) -> int:
    """`os.open` of a store's file that never follows a symbolic link."""
    return os.open(file, flags | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))


def _writers(st: os.stat_result, mode: int, allow_group: bool) -> str:
    """Who other than the owner can write, by `mode`: '' when nobody (the group counts only without
    `allow_group`, which sharing a store between the users of one group needs)."""
    if mode & stat.S_IWOTH:
        return "every local user"
    if mode & stat.S_IWGRP and not allow_group:
        return f"the members of group {st.st_gid}"
    return ""


__all__ = ["check_store_dir", "check_store_file", "open_store_file"]
