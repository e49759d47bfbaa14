"""The crash harness's workload: schemas, row contents that are a function of a row id, the side log, and the
threads that write, update, consume and checkpoint a store while recording every call they make.

Every thread records each call twice in the side log: a start line before the call (`"ph": "s"`, with the call's
arguments) and an end line after it returned (`"d"`: done, acknowledged, with its result), failed with nothing
applied (`"f"`: `InsertTimeout` of an `extend`, `LeaseError` of an `ack`/`nack`), or raised anything else (`"e"`:
its outcome is unknown, e.g. a Flight call cut by the server's death). A line is one `os.write` on an `O_APPEND`
descriptor, so it reaches the operating system whole before the next call starts; a SIGKILL at any moment leaves
every line but possibly a last, partial one, which the reader drops. A call with a start line and no end line was
in flight when the process died: its outcome is unknown, and the oracle (`crash.oracle`) allows both outcomes.

The same functions drive an `ExperienceStore` (in process), a `RemoteStore` (over Flight) and a `ShardedStore` (Ray):
they use only the calls the three share.
"""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import arrowbuf as ab

#: a prime below 2**24: row contents are computed modulo it, so every value is exact in float32
_P = 16_777_213


@dataclass(frozen=True)
class Variant:
    """One store shape the harness drives.

    `ragged`: a ragged int32 field, a small tensor field, tasks (consumers with and without leases) and the eviction
    hold they bring; rows are copied under the writer's lock. `fixed`: fixed-size fields only and no tasks, so the
    writer copies rows outside its lock (where a checkpoint can race a batch's copy), with larger batches and a ring
    that wraps several times between checkpoints.
    """

    name: str
    width: int  # floats in the tensor field `vec`
    ragged: bool
    capacity: int
    chunk_rows: int
    tasks: tuple[str, ...]
    batch: tuple[int, int]  # rows per extend, inclusive range
    writers: int
    pause: tuple[float, float] = (0.0, 0.0)  # seconds a writer waits between batches

    @property
    def schema(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"rid": {"dtype": "int64"}}
        if self.ragged:
            fields["payload"] = {"dtype": "int32", "ragged": True}
        fields["vec"] = {"dtype": "float32", "shape": [self.width]}
        fields["reward"] = {"dtype": "float32", "later": True}
        return {"name": f"crash_{self.name}", "version": 1, "fields": fields}


VARIANTS = {
    "ragged": Variant("ragged", width=8, ragged=True, capacity=512, chunk_rows=64, tasks=("train", "ref"),
                      batch=(1, 48), writers=2),
    # about 50 MB/s of 1 KB rows into a 64 MB ring: a checkpoint that lost a batch shows it lost for a second or
    # more (until the ring evicts it), and a batch is being copied during about one checkpoint in five
    "fixed": Variant("fixed", width=256, ragged=False, capacity=65536, chunk_rows=4096, tasks=(),
                     batch=(256, 2048), writers=4, pause=(0.025, 0.1)),
}

#: the prioritized sampler's parameters: with alpha 1 and eps 0 a row's sampling mass is its priority exactly
ALPHA, EPS = 1.0, 0.0


def sampler() -> Any:
    return ab.samplers.PrioritizedSampler(alpha=ALPHA, eps=EPS)


def open_store(path: str, variant: Variant, policy: str) -> ab.ExperienceStore:
    """The durable store in `path`: restored if the directory holds one, else created."""
    if os.path.exists(os.path.join(path, "_durable.json")):
        return ab.ExperienceStore.restore(path)
    return ab.ExperienceStore(variant.schema, capacity=variant.capacity, sampler=sampler(),
                              chunk_rows=variant.chunk_rows, durable=path, durability=policy,
                              tasks=list(variant.tasks) or None, seed=0)


# ------------------------------------------------------------------------------------------------ row contents
def _hash(rids: np.ndarray) -> np.ndarray:
    return ((np.asarray(rids, np.int64) % _P) * 1_000_003 + 12_345) % _P


def payload_lengths(rids: np.ndarray) -> np.ndarray:
    return (_hash(rids) % 23 + 1).astype(np.int64)


def vecs(rids: np.ndarray, width: int) -> np.ndarray:
    """The tensor field of rows `rids`: (n, width) float32, every value an integer below 2**24 (exact)."""
    h = ((_hash(rids) * 40_503) % _P).astype(np.int32)[:, None]  # int32 below: both terms < 2**24, no overflow
    return ((h + (np.arange(width, dtype=np.int32) * 97 + 11)[None, :]) % _P).astype(np.float32)


def payloads_flat(rids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ragged field of rows `rids` as (offsets, values): row i is values[offsets[i]:offsets[i + 1]]."""
    lens = payload_lengths(rids)
    offsets = np.zeros(len(rids) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    h = np.repeat(_hash(rids), lens)
    j = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lens)
    values = ((h * 65_599 + j * 31) % 2_147_483_647 - 1_073_741_824).astype(np.int32)
    return offsets, values


def rows(rid0: int, n: int, variant: Variant) -> dict[str, Any]:
    """The batch of rows rid0 .. rid0 + n - 1 (their content is a function of their rid alone)."""
    rids = np.arange(rid0, rid0 + n, dtype=np.int64)
    out: dict[str, Any] = {"rid": rids}
    if variant.ragged:
        offsets, values = payloads_flat(rids)
        out["payload"] = [values[offsets[i]:offsets[i + 1]] for i in range(n)]
    out["vec"] = vecs(rids, variant.width)
    return out


def rid_base(gen: int, thread: int) -> int:
    """The first rid writer `thread` of generation `gen` uses: rids are unique over the whole run."""
    return ((gen + 1) << 40) | (thread << 32)


# ------------------------------------------------------------------------------------------------ the side log
class SideLog:
    """Append-only JSON lines, one `os.write` each (module docstring). Thread-safe."""

    def __init__(self, path: str, gen: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.gen = gen

    def __call__(self, **event: Any) -> None:
        event["g"] = self.gen
        os.write(self.fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class MemoryLog:
    """A side log kept in memory (the Ray variant: its threads live in the test process, which is never killed)."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, **event: Any) -> None:
        event["g"] = self.gen
        with self._lock:
            self.events.append(event)


def read_log(path: str) -> list[dict[str, Any]]:
    """The complete lines of a side log (a last line cut by a kill is dropped: its call was not logged)."""
    out = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return out
    for line in data.split(b"\n")[:-1]:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


class Call:
    """Logs one call: `start(...)`, then `done(...)`, `fail(...)` or `error(exc)`."""

    def __init__(self, log: Callable[..., None], thread: str) -> None:
        self.log, self.thread, self.k = log, thread, 0

    def start(self, op: str, **args: Any) -> None:
        self.k += 1
        self.op = op
        self.log(th=self.thread, k=self.k, op=op, ph="s", t=time.time(), **args)

    def done(self, **result: Any) -> None:
        self.log(th=self.thread, k=self.k, op=self.op, ph="d", t=time.time(), **result)

    def fail(self, exc: BaseException) -> None:
        self.log(th=self.thread, k=self.k, op=self.op, ph="f", t=time.time(), err=type(exc).__name__)

    def error(self, exc: BaseException) -> None:
        self.log(th=self.thread, k=self.k, op=self.op, ph="e", t=time.time(), err=type(exc).__name__,
                 msg=str(exc)[:200])


# ------------------------------------------------------------------------------------------------ the threads
@dataclass
class Shared:
    """What a process's threads share: the ids of acknowledged rows (for the updater) and the stop flag."""

    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)


def _pause(shared: Shared, seconds: float) -> None:
    shared.stop.wait(seconds)


def writer(store: Any, log: Callable[..., None], variant: Variant, gen: int, index: int, shared: Shared,
           seed: int) -> None:
    rng = random.Random(seed * 7919 + index)
    call = Call(log, f"w{index}")
    rid = rid_base(gen, index)
    while not shared.stop.is_set():
        n = rng.randint(*variant.batch)
        batch = rows(rid, n, variant)
        call.start("extend", rid0=rid, n=n)
        rid += n
        try:
            ids = store.extend(batch, timeout=0.5)
        except ab.InsertTimeout as exc:  # nothing written (the ring is full of rows the tasks hold)
            call.fail(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - the outcome is unknown (a served store that died)
            call.error(exc)
            _pause(shared, 0.05)
            continue
        ids = np.asarray(ids, np.int64)
        if np.array_equal(ids, ids[0] + np.arange(len(ids))):
            call.done(first=int(ids[0]), n=len(ids))
        else:
            call.done(ids=ids.tolist())
        with shared.lock:
            shared.recent.extend(ids.tolist())
        if variant.pause[1]:
            _pause(shared, rng.uniform(*variant.pause))


def updater(store: Any, log: Callable[..., None], gen: int, shared: Shared, seed: int) -> None:
    """`update` of the later field, `update_priorities` and `policy_version`, one call at a time (their order is the
    log's): each value is unique over the run (`gen * 100000 + counter`, exact in float32)."""
    rng = random.Random(seed * 31 + 5)
    call = Call(log, "u")
    count = 0
    while not shared.stop.is_set():
        with shared.lock:
            recent = list(shared.recent)
        if not recent:
            _pause(shared, 0.01)
            continue
        count += 1
        value = float(gen * 100_000 + count)
        seqs = sorted(set(rng.sample(recent, min(len(recent), rng.randint(1, 8)))))
        try:
            if count % 10 == 0:
                call.start("pv", v=int(value))
                store.policy_version = int(value)
                call.done()
            elif count % 2:
                call.start("update", ids=seqs, v=value)
                n = store.update(np.asarray(seqs, np.int64), {"reward": np.full(len(seqs), value, np.float32)})
                call.done(n=int(n))
            else:
                call.start("prio", ids=seqs, v=value)
                n = store.update_priorities(np.asarray(seqs, np.int64), np.full(len(seqs), value))
                call.done(n=int(n))
        except Exception as exc:  # noqa: BLE001 - unknown outcome
            call.error(exc)
            _pause(shared, 0.05)
        _pause(shared, rng.uniform(0.002, 0.01))


def values(column: Any) -> list[Any]:
    """A delivered column as Python values, None for a null (an Arrow array, or numpy where a sharded handle joined
    the shards' parts: NaN there; the harness never writes NaN)."""
    if hasattr(column, "to_pylist"):
        return list(column.to_pylist())
    return [None if v is None or (isinstance(v, float) and v != v) else float(v) for v in np.asarray(column).tolist()]


def consumer(store: Any, log: Callable[..., None], task: str, lease: float | None, name: str, shared: Shared,
             seed: int, ack_share: float = 0.7, nack_share: float = 0.15) -> None:
    """`consume(task, n)` (final at once), or with `lease`: then `ack` (final), `nack` or abandon (the lease
    expires and its rows go back), at the given shares. Logs the rows and the later field's values delivered."""
    rng = random.Random(seed * 131 + sum(map(ord, name)))
    call = Call(log, name)
    while not shared.stop.is_set():
        n = rng.randint(8, 64)
        call.start("consume", task=task, n=n, lease=lease)
        try:
            b = store.consume(task, n, lease=lease, timeout=0.05)
        except Exception as exc:  # noqa: BLE001 - unknown outcome
            call.error(exc)
            _pause(shared, 0.05)
            continue
        ids = np.asarray(b.indices, np.int64).tolist()
        rewards = values(b["reward"]) if ids else []
        call.done(ids=ids, lease_id=b.lease, rw=[[i, v] for i, v in zip(ids, rewards) if v is not None])
        if not ids:
            continue
        if lease is None:
            continue
        x = rng.random()
        _pause(shared, rng.uniform(0.0, 0.02))  # "processing"
        if x < ack_share:
            op, fn = "ack", store.ack
        elif x < ack_share + nack_share:
            op, fn = "nack", store.nack
        else:
            call.start("abandon", task=task, lease_id=b.lease, ids=ids)  # the lease expires: its rows go back
            call.done()
            continue
        call.start(op, task=task, lease_id=b.lease, ids=ids)
        try:
            fn(b.lease)
        except ab.LeaseError as exc:  # expired meanwhile (its rows went back) or unknown: nothing applied
            call.fail(exc)
            continue
        except Exception as exc:  # noqa: BLE001
            call.error(exc)
            _pause(shared, 0.05)
            continue
        call.done()


def checkpointer(store: Any, log: Callable[..., None], shared: Shared, seed: int,
                 every: tuple[float, float] = (0.2, 0.8)) -> None:
    """`checkpoint()` every 0.2-0.8 s; the start line is what the harness waits for to kill during a checkpoint."""
    rng = random.Random(seed * 17 + 3)
    call = Call(log, "c")
    while not shared.stop.is_set():
        _pause(shared, rng.uniform(*every))
        if shared.stop.is_set():
            break
        call.start("ckpt")
        try:
            info = store.checkpoint()
        except Exception as exc:  # noqa: BLE001
            call.error(exc)
            continue
        if isinstance(info, list):  # a ShardedStore: one summary per shard
            info = info[0]
        call.done(**{k: info.get(k) for k in ("generation", "first_seq", "next_seq", "dropped_rows")})


def guarded(fn: Callable[..., None], log: Callable[..., None], *args: Any) -> None:
    """Run a workload thread; if it dies of an exception (a bug of the harness: the store's own errors are logged
    as outcomes), log it, so the harness fails instead of checking a run that did less than it says."""
    try:
        fn(*args)
    except BaseException:
        import traceback

        log(op="died", ph="d", th=fn.__name__, trace=traceback.format_exc()[-3000:])
        raise


def client_threads(store_for: Callable[[], Any], log: Callable[..., None], variant: Variant, gen: int,
                   shared: Shared, seed: int, lease_s: float = 0.5) -> list[threading.Thread]:
    """The writer, updater and consumer threads of one process (started); `store_for()` gives each its store
    handle (the same store in process; a connection of its own over Flight)."""
    specs: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    for i in range(variant.writers):
        specs.append((writer, (log, variant, gen, i, shared, seed)))
    specs.append((updater, (log, gen, shared, seed)))
    if variant.tasks:
        specs.append((consumer, (log, "train", None, "ct", shared, seed)))
        specs.append((consumer, (log, "train", lease_s, "cl", shared, seed, 0.8, 0.1)))
        specs.append((consumer, (log, "ref", lease_s, "cr", shared, seed, 0.6, 0.2)))
    threads = []
    for fn, args in specs:
        t = threading.Thread(target=guarded, args=(fn, log, store_for(), *args), daemon=True,
                             name=f"crash-{fn.__name__}")
        t.start()
        threads.append(t)
    return threads
