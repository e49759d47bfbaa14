"""Shared-memory trust (issue 17), against real /dev/shm and real processes: `attach` refuses a store another user
owns (unless asked explicitly) or others can write, corrupt manifests raise `StoreCorrupt` naming the file, and
tampered lock memory raises instead of hanging.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import struct
import threading
import uuid

import numpy as np
import pytest
from conftest import process_context

import arrowbuf as ab
from arrowbuf.tiers import shm
from arrowbuf.tiers.shm.locks import pthread_lib

SCHEMA = {"name": "trust", "fields": {"obs": {"dtype": "float32", "shape": [3]}, "reward": {"dtype": "float32"},
                                      "terminated": {"dtype": "bool"}}}
OTHER_UID = 4242  # a uid without an account: "another local user"
CTX = process_context()
JOIN_S = 60
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")


def _rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    k = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.stack([k, k, k], 1), "reward": k, "terminated": (np.arange(n) % 10) == 9}


@pytest.fixture
def shared():
    """A live shared store with rows (this process owns it); removed afterwards whatever happened."""
    name = f"trust{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = ab.ExperienceStore(SCHEMA, 64, sampler=ab.samplers.Prioritized(), tier="shm", name=name)
    store.extend(_rows(20))
    path = shm.store_path(name)
    procs: list[mp.Process] = []
    try:
        yield store, name, path, procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        if os.path.isdir(path):
            _chown_tree(path, 0)
            os.chmod(path, 0o700)
        store.close()
        shm.remove(name)
        assert not [n for n in os.listdir(shm.shm_root()) if name in n], "segments left in /dev/shm"


def _chown_tree(path: str, uid: int) -> None:
    os.chown(path, uid, -1)
    for n in os.listdir(path):
        os.chown(os.path.join(path, n), uid, -1, follow_symlinks=False)


# ---------------------------------------------------------------------------------------------- owner and mode
@needs_root
def test_attach_refuses_a_store_of_another_user(shared):
    store, name, path, _ = shared
    _chown_tree(path, OTHER_UID)  # as if uid 4242 had created the store under the name this learner attaches to
    with pytest.raises(ab.StoreNotTrusted) as err:
        ab.ExperienceStore.attach(name)
    assert f"uid {OTHER_UID}" in str(err.value) and "allow_other_owner=True" in str(err.value)
    assert isinstance(err.value, PermissionError)
    other = ab.ExperienceStore.attach(name, allow_other_owner=True)  # asked for explicitly: trusted
    try:
        assert len(other) == len(store) == 20
        assert len(other.sample(8)) == 8
    finally:
        other.close()


@needs_root
def test_attach_refuses_a_planted_file(shared):
    _, name, path, _ = shared
    arena = os.path.join(path, "arena.reward")
    os.chown(arena, OTHER_UID, -1)  # the directory is ours, one arena is someone else's
    with pytest.raises(ab.StoreNotTrusted, match="arena.reward"):
        ab.ExperienceStore.attach(name)
    os.chown(arena, 0, -1)
    manifest = os.path.join(path, "manifest.json")
    os.chown(manifest, OTHER_UID, -1)
    with pytest.raises(ab.StoreNotTrusted, match="manifest.json"):
        ab.ExperienceStore.attach(name)


def test_attach_refuses_a_store_others_can_write(shared):
    _, name, path, _ = shared
    os.chmod(path, 0o777)  # every local user can replace its files
    for allow in (False, True):  # trusting another owner is not trusting everyone
        with pytest.raises(ab.StoreNotTrusted, match="every local user"):
            ab.ExperienceStore.attach(name, allow_other_owner=allow)
    os.chmod(path, 0o755)  # others can reach the files now: a world-writable arena is refused
    arena = os.path.join(path, "arena.obs")
    os.chmod(arena, 0o666)
    with pytest.raises(ab.StoreNotTrusted, match="arena.obs"):
        ab.ExperienceStore.attach(name)
    os.chmod(arena, 0o600)
    ab.ExperienceStore.attach(name).close()  # the same store, its modes repaired, attaches


def test_attach_refuses_a_link_under_the_store_name(shared, tmp_path):
    _, name, path, _ = shared
    other = f"{name}-link"
    link = shm.store_path(other)
    os.symlink(path, link)  # a name that points at another directory
    try:
        with pytest.raises(ab.StoreNotTrusted, match="not a directory"):
            ab.ExperienceStore.attach(other)
    finally:
        os.unlink(link)


# ---------------------------------------------------------------------------------------------- corrupt manifests
def _set(*keys, value):
    def f(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
        return m
    return f


def _drop(*keys):
    def f(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
        return m
    return f


def _first_arena(field: str, value):
    def f(m):
        m["arenas"]["reward"][field] = value
        return m
    return f


def _same_slot(m):
    m["locks"]["slots"] = {k: 0 for k in m["locks"]["slots"]}
    return m


def _rows_and_bytes(m):  # self-consistent, but not this store's geometry
    a = m["arenas"]["reward"]
    a["rows"] += 1024
    a["bytes"] = max(4096, -(-a["rows"] * 4 // 4096) * 4096)
    return m


def _flock_with_pthread_arena(m):
    m["locks"]["kind"] = "flock"
    return m


def _deep_spec(depth):
    spec = {"kind": "prioritized", "args": {}}
    for _ in range(depth):
        spec = {"kind": "sequence", "args": {"length": 2, "priority": spec}}
    return spec


JSON_CASES = {
    "format missing": _drop("format"),
    "format 1 (string specs)": _set("format", value=1),
    "format 2 (no consume arenas)": _set("format", value=2),
    "format 4": _set("format", value=4),
    "other name": _set("name", value="someone-else"),
    "schema missing": _drop("schema"),
    "schema a string": _set("schema", value="atari"),
    "schema without fields": _set("schema", "fields", value={}),
    "schema bad dtype": _set("schema", "fields", "reward", "dtype", value="float99"),
    "capacity missing": _drop("capacity"),
    "capacity a string": _set("capacity", value="64"),
    "capacity negative": _set("capacity", value=-5),
    "capacity huge": _set("capacity", value=10 ** 30),
    "capacity a float": _set("capacity", value=64.5),
    "capacity changed": _set("capacity", value=65),
    "chunk_rows zero": _set("chunk_rows", value=0),
    "max_times_sampled added": _set("max_times_sampled", value=1),
    "sampler syntax": _set("sampler", value="arrowbuf.samplers:(("),
    "sampler other module": _set("sampler", value="os:system('true')"),
    "sampler unknown class": _set("sampler", value="arrowbuf.samplers:Nope()"),
    "sampler not a sampler": _set("sampler", value="arrowbuf.samplers:Any()"),
    "sampler bad argument": _set("sampler", value="arrowbuf.samplers:PrioritizedSampler(bogus=1)"),
    "sampler non-literal": _set("sampler", value="arrowbuf.samplers:PrioritizedSampler(alpha=__import__('os'))"),
    "sampler a number": _set("sampler", value=5),
    "sampler unknown kind": _set("sampler", value={"kind": "os.system", "args": {}}),
    "sampler kind not a string": _set("sampler", value={"kind": ["prioritized"], "args": {}}),
    "sampler args a list": _set("sampler", value={"kind": "prioritized", "args": [1]}),
    "sampler unknown argument": _set("sampler", value={"kind": "prioritized", "args": {"bogus": 1}}),
    "sampler bad value": _set("sampler", value={"kind": "prioritized", "args": {"alpha": -1}}),
    "sampler non-literal argument": _set("sampler", value={"kind": "prioritized", "args": {"alpha": [1, 2]}}),
    "sampler nested too deep": _set("sampler", value=_deep_spec(50)),
    "sampler legacy module form": _set("sampler", value={"module": "os", "class": "system", "args": {}}),
    "rate limiter bad argument": _set("rate_limiter", value={"kind": "min_size", "args": {"min_size": "x"}}),
    "rate limiter garbage": _set("rate_limiter", value="arrowbuf.rate_limiters:MinSize(min_size='x')"),
    "owner missing": _drop("owner"),
    "arenas a list": _set("arenas", value=[]),
    "arena file elsewhere": _first_arena("file", "../../../etc/passwd"),
    "arena object dtype": _first_arena("dtype", "|O"),
    "arena bogus dtype": _first_arena("dtype", "<x9"),
    "arena bytes wrong": _first_arena("bytes", 1),
    "arena shape negative": _first_arena("shape", [-1]),
    "arena rows changed": _rows_and_bytes,
    "arena removed": _drop("arenas", "reward"),
    "lock kind unknown": _set("locks", "kind", value="spin"),
    "lock kind flipped": _flock_with_pthread_arena,
    "lock slot out of range": _set("locks", "slots", "write", value=99),
    "lock slot negative": _set("locks", "slots", "write", value=-1),
    "lock slot a string": _set("locks", "slots", "write", value="1"),
    "lock slots shared": _same_slot,
}
RAW_CASES = {
    "empty": b"",
    "truncated": None,  # the first half of the real manifest
    "not utf-8": b"\xff\xfe\x00{",
    "a list": b"[1, 2]",
    "null": b"null",
    "deeply nested": b"[" * 200_000,
    "too large": b'{"pad": "' + b"x" * (5 << 20) + b'"}',
}


@pytest.mark.parametrize("case", [*JSON_CASES, *RAW_CASES])
def test_corrupt_manifest_raises_an_error_naming_it(shared, case):
    store, name, path, _ = shared
    file = os.path.join(path, "manifest.json")
    with open(file, "rb") as f:
        original = f.read()
    if case in JSON_CASES:
        data = json.dumps(JSON_CASES[case](json.loads(original))).encode()
    else:
        data = RAW_CASES[case] if RAW_CASES[case] is not None else original[: len(original) // 2]
    with open(file, "wb") as f:
        f.write(data)
    try:
        with pytest.raises(ab.StoreCorrupt) as err:
            ab.ExperienceStore.attach(name)
        assert file in str(err.value), str(err.value)
        assert len(str(err.value)) < 2000  # names the problem, does not echo the file
    finally:
        with open(file, "wb") as f:
            f.write(original)
    assert len(store) == 20  # the owner is untouched


def test_missing_or_truncated_arena_file_raises_an_error_naming_it(shared):
    _, name, path, _ = shared
    arena = os.path.join(path, "arena.reward")
    with open(arena, "rb") as f:
        original = f.read()
    os.truncate(arena, 100)
    with pytest.raises(ab.StoreCorrupt, match="arena.reward"):
        ab.ExperienceStore.attach(name)
    os.unlink(arena)
    with pytest.raises(ab.StoreCorrupt, match="arena.reward"):
        ab.ExperienceStore.attach(name)
    with open(arena, "wb") as f:
        f.write(original)
    os.chmod(arena, 0o600)


# ---------------------------------------------------------------------------------------------- tampered locks
def _noop() -> None:
    pass


def _wait_for(event) -> None:
    event.wait(JOIN_S)


def _extend_in_child(name: str, q) -> None:
    try:
        other = ab.ExperienceStore.attach(name)
        try:
            other.extend(_rows(5, 100))
            q.put(("ok", ""))
        finally:
            other.close()
    except BaseException as exc:  # reported to the parent
        q.put((type(exc).__name__, str(exc)))


@pytest.mark.slow
@pytest.mark.skipif(pthread_lib() is None, reason="robust pthread mutexes not available (flock locks)")
@pytest.mark.parametrize("holder", ["dead thread", "process without the store", "garbage"])
def test_tampered_lock_memory_raises_instead_of_hanging(shared, holder):
    store, name, path, procs = shared
    with open(os.path.join(path, "manifest.json")) as f:
        slot = json.load(f)["locks"]["slots"]["write"]
    if holder == "dead thread":
        p = CTX.Process(target=_noop)
        p.start()
        p.join(JOIN_S)
        tid = p.pid
        assert not os.path.exists(f"/proc/{tid}")
    elif holder == "garbage":
        tid = None  # the whole mutex overwritten: its kind field is no kind libc knows
    else:
        bystander_done = CTX.Event()
        bystander = CTX.Process(target=_wait_for, args=(bystander_done,), daemon=True)  # alive, no store open
        procs.append(bystander)
        bystander.start()
        tid = bystander.pid
    locks = os.path.join(path, "arena.tier.locks")
    with open(locks, "r+b") as f:
        f.seek(slot * 64)
        original = f.read(64)
        f.seek(slot * 64)
        f.write(bytes(range(7, 71)) if tid is None else struct.pack("<i", tid))  # "held by `tid`"
    try:
        q = CTX.Queue()
        p = CTX.Process(target=_extend_in_child, args=(name, q), daemon=True)
        procs.append(p)
        p.start()
        p.join(JOIN_S)
        assert not p.is_alive(), "extend hung on a tampered lock"
        kind, message = q.get(timeout=10)
        assert kind == "StoreCorrupt", (kind, message)
        assert "arena.tier.locks" in message and (tid is None or str(tid) in message)
    finally:
        with open(locks, "r+b") as f:
            f.seek(slot * 64)
            f.write(original)
        if holder == "process without the store":
            bystander_done.set()
    store.extend(_rows(5, 200))  # repaired: the owner goes on
    assert len(store) == 25


def _hold_write_lock(name: str, held, release) -> None:
    tier = shm.SharedMemoryTier.attach(name)
    try:
        lock = tier.lock("write")
        with lock:
            held.set()
            release.wait(JOIN_S)
    finally:
        tier.close()


@pytest.mark.slow
@pytest.mark.skipif(pthread_lib() is None, reason="robust pthread mutexes not available (flock locks)")
@pytest.mark.parametrize("holder", ["attached process", "forked child"])
def test_a_lock_held_long_by_a_live_holder_is_waited_for(shared, holder):
    # the stuck-holder check must never fire for a holder that can release: a process with the store open, or a
    # forked child of one (it has the memory mapped but no lease of its own); the holder keeps the lock for longer
    # than the check's patience, then releases it, and the waiting extend goes through
    store, name, path, procs = shared
    ctx = mp.get_context("fork" if holder == "forked child" else "spawn")
    held, release = ctx.Event(), ctx.Event()
    if holder == "forked child":
        tier = shm.SharedMemoryTier.attach(name)  # this process maps the lock; the child inherits the mapping
        lock = tier.lock("write")

        def hold() -> None:
            with lock:
                held.set()
                release.wait(JOIN_S)
            os._exit(0)

        p = ctx.Process(target=hold, daemon=True)
    else:
        tier = None
        p = ctx.Process(target=_hold_write_lock, args=(name, held, release), daemon=True)
    procs.append(p)
    p.start()
    try:
        assert held.wait(JOIN_S), "the holder never took the lock"
        timer = threading.Timer(1.5, release.set)  # about 3x the check's patience (10 waits of 50 ms)
        timer.start()
        ids = store.extend(_rows(5, 300))  # waits for the holder, then writes
        timer.join()
        assert len(np.atleast_1d(ids)) >= 1 and len(store) == 25
        p.join(JOIN_S)
        assert p.exitcode == 0
    finally:
        release.set()
        if tier is not None:
            tier.close()
