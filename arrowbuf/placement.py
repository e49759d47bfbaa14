"""Placement: which tier each (column, chunk) of a tiered store lives in.

Usage::

    store = ab.ExperienceStore(schema, capacity, tiers={"gpu": "8GiB", "host": "16GiB", "disk": "spill/"},
                               placement=ab.placement.BandwidthAware())   # the default when several tiers are given
    store.placement()               # pa.Table: column, tier, chunks, bytes
    store.placement(explain=True)   # ... and why: access share, sampling mass, value per byte, bandwidth

A policy is bound to one store through a `PlacementTarget` (what the policy sees of the store: tiers, chunk
residency, access counts, per-chunk sampling mass, and `migrate`), which the store builds; it runs `step()` in a
background thread every `interval` seconds (or not at all with `interval=None`: call `step()` yourself, as the tests
do). A step reads the inputs, plans, and carries out moves; each
move copies one chunk of one column off the sample path and flips the slot table (see `arrowbuf.columns`).

`BandwidthAware` (after the Conduit paper): the value of keeping a (column, chunk) in a faster tier is the rate of
bytes samples read from it, `rows/s of the column x the chunk's share of the sampling mass x row bytes`, per byte
held: `access share(column) x mass share(chunk)`, the same for every column's row size. Tiers are filled top-down,
greedily by that value per byte, under each tier's byte budget; a (column, chunk) already in a tier counts
`1 + hysteresis` times its value there (a newcomer must beat it clearly) and access counts decay with a half-life of
a few steps, so an alternating pattern settles instead of thrashing. A promotion is made only if what it saves before
the chunk is evicted, `bytes read/s x (1/bandwidth below - 1/bandwidth above) x remaining life`, exceeds the copy,
`chunk bytes / copy bandwidth`; bandwidths come from a short probe (cached per process), or are given.
"""

from __future__ import annotations

import abc
import math
import os
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .errors import InvalidArgument, StoreClosed

if TYPE_CHECKING:  # pragma: no cover
    from .chunks import ChunkDirectory
    from .columns import ColumnArenas
    from .index import RingIndex
    from .samplers import Sampler
    from .schema import ExperienceSchema

_MIB = 1 << 20


class PlacementTarget:
    """What a placement policy sees of its store, and the one thing it does to it (`migrate`).

    The store builds it from its parts (`ExperienceStore` does, at construction) and binds its policy to it; a policy
    reads nothing else. Columns are in `columns` order everywhere (arrays of shape [C] or [C, S], S chunk slots).

    Usage loop (a policy's step)::

        snap = target.snapshot()                   # lo, hi, each slot's first/last seq, inserts, access per column
        mass = target.chunk_mass()                 # [S] sampling mass per chunk slot (Sampler.mass)
        res = target.residency()                   # [C, S] tier code of each (column, chunk)
        target.migrate("obs", slot, tier, gen)     # copy one chunk of one column, off the sample path
    """

    def __init__(self, schema: "ExperienceSchema", cols: "ColumnArenas", directory: "ChunkDirectory",
                 index: "RingIndex", sampler: "Sampler", state_lock: Any, write_lock: Any, capacity: int,
                 name: str, data_tier: Any) -> None:
        self.schema = schema
        self.name = name
        self.capacity = int(capacity)
        self.directory = directory
        self.chunk_rows = directory.chunk_rows
        self.num_slots = directory.num_slots
        self.tiered = hasattr(cols, "tiers")
        self.tiers: list[Any] = list(getattr(cols, "tiers", None) or [data_tier])
        self.closed = False
        self._cols: Any = cols
        self._index = index
        self._sampler = sampler
        self._state_lock = state_lock
        self._write_lock = write_lock
        if self.tiered:
            self.columns: list[str] = list(cols.names)  # type: ignore[attr-defined]
            self._cis = np.array([cols.ci[n] for n in self.columns], dtype=np.int64)  # type: ignore[attr-defined]
            self.slotted: list[bool] = list(cols.slotted)  # type: ignore[attr-defined]
            self.bottom: int = int(cols.bottom)  # type: ignore[attr-defined]
            self.arena_rows: int = int(cols.arena_rows)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ reading
    @property
    def queue(self) -> bool:
        """Whether the sampler is a queue (each item delivered once: new chunks hold the mass)."""
        return bool(self._sampler.queue)

    def chunk_bytes(self) -> np.ndarray:
        """[C] bytes of one chunk of each column."""
        return np.array([self._cols.chunk_bytes[n] for n in self.columns], dtype=np.int64)

    def residency(self) -> np.ndarray:
        """[C, S] the tier code (index into `tiers`) of each (column, chunk slot); a copy."""
        return self._cols.res[self._cis].astype(np.int64)

    def moving(self) -> np.ndarray:
        """[C, S] whether a (column, chunk slot) is being moved or written now."""
        return self._cols.moving[self._cis].copy()

    def write_tiers(self) -> np.ndarray:
        """[C] where writers put each column's new chunks (a tier code)."""
        return np.asarray(self._cols.write_tier)[self._cis].astype(np.int64)

    def set_write_tiers(self, codes: np.ndarray) -> None:
        """Where writers put each column's new chunks from now on (never a slotted tier)."""
        for i, ci in enumerate(self._cis.tolist()):
            self._cols.write_tier[ci] = int(codes[i])

    def snapshot(self) -> dict[str, Any]:
        """A consistent view under the store's state lock: `lo`, `hi` (live seqs), `gens`/`lasts` (each slot's first
        and last seq), `inserts` and `access` ([C] rows read per column so far)."""
        idx = self._index
        cr = self.chunk_rows
        first = np.arange(self.num_slots, dtype=np.int64) * cr
        with self._state_lock:
            return {"lo": idx.lo, "hi": idx.hi, "gens": idx.seq[first].copy(), "lasts": idx.seq[first + cr - 1].copy(),
                    "inserts": idx.counter("inserts"),
                    "access": np.array(self._cols.access, dtype=np.int64)[self._cis]}

    def chunk_mass(self) -> np.ndarray:
        """[S] each chunk slot's sampling mass (unnormalised): the sum of `Sampler.mass` over its rows."""
        rows = self.num_slots * self.chunk_rows
        per_row = np.asarray(self._sampler.mass(np.arange(rows, dtype=np.int64)), dtype=np.float64)
        return per_row.reshape(self.num_slots, self.chunk_rows).sum(axis=1)

    def fixed_bytes(self, code: int) -> int:
        """Bytes tier `code` holds besides column chunks (the index, samplers, final observations on the host)."""
        cols = self._cols
        data = sum(int((cols.res[cols.ci[n]] == code).sum()) * cols.chunk_bytes[n] for n in self.columns)
        return max(0, self.tiers[code].nbytes() - data)

    def slots_total(self, code: int, column: str) -> int:
        """Chunk slots column `column` has in slotted tier `code` (0: no arena there yet)."""
        return int(self._cols.slots_total(code, column))

    # ------------------------------------------------------------------ acting
    def ensure_arena(self, code: int, column: str, slots: int) -> bool:
        """Give `column` an arena of `slots` chunk slots in slotted tier `code`; False if it does not fit."""
        return bool(self._cols.ensure_arena(code, column, slots))

    def migrate(self, column: str, slot: int, tier: int, gen: int | None) -> bool:
        """Copy chunk slot `slot` of `column` to tier `tier` and flip the slot table; False (nothing changed) if there
        is no room, it is already moving, or the chunk changed meanwhile. `gen`: the sealed chunk's first seq, or
        None for a slot that is not sealed (moved only while no writer is busy)."""
        return bool(self._cols.migrate(column, slot, tier, gen, self._index, self._state_lock, self._write_lock))


class Placement(abc.ABC):
    """Decides residency per (column, chunk) of one tiered store. Usage loop (what the store does)::

        policy.bind(target)     # once, at the end of the store's construction (a PlacementTarget); starts the thread
        policy.step()           # one round: observe, plan, move (the thread calls it every `interval` seconds)
        policy.close()          # stop and join the thread (store.close() calls it)
    """

    interval: float | None = None

    def bind(self, target: PlacementTarget) -> None:
        if getattr(self, "_target", None) is not None:
            raise InvalidArgument("a placement policy serves one store; make a new one for each store")
        self._target: PlacementTarget | None = target
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.interval is not None and target.tiered and len(target.tiers) > 1:
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop, self.interval),
                                            name=f"arrowbuf-placement-{target.name}", daemon=True)
            self._thread.start()

    def _live_target(self) -> PlacementTarget | None:
        target = getattr(self, "_target", None)
        return None if target is None or target.closed else target

    @abc.abstractmethod
    def step(self) -> int:
        """One round of placement; returns the number of chunks moved."""

    def explain(self) -> dict[str, Any]:
        """Per-column inputs of the last decision (for `store.placement(explain=True)`)."""
        return {}

    def close(self) -> None:
        """Stop the background thread and wait for it (a move in progress finishes first); idempotent. The store
        calls it when it closes: the target is closed too."""
        target = getattr(self, "_target", None)
        if target is not None:
            target.closed = True
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _run(ref: "weakref.ref[Placement]", stop: threading.Event, interval: float) -> None:
    """The background loop; holds the policy only weakly between rounds, so a forgotten store is collected. A round
    that took a while waits longer before the next (a quarter of one core at most, on a big store)."""
    delay = interval
    while not stop.wait(delay):
        policy = ref()
        if policy is None:
            return
        target = policy._live_target()
        if target is None:
            return
        try:
            t0 = time.perf_counter()
            policy.step()
            delay = max(interval, 3 * (time.perf_counter() - t0))
        except Exception as exc:  # keep serving from where the data is; the error is visible in explain()
            policy.last_error = repr(exc)  # type: ignore[attr-defined]
            if target.closed:
                return
        del policy, target


class Static(Placement):
    """Never moves anything: chunks stay where the store first put them (upper tiers filled in ring order)."""

    def step(self) -> int:
        return 0


class BandwidthAware(Placement):
    """Greedy placement by value per byte under per-tier budgets, aware of tier bandwidths, with hysteresis.

    Args:
        interval: seconds between background steps; None: no thread (call `step()`).
        hysteresis: a (column, chunk) in a tier counts `1 + hysteresis` times its value there.
        half_life: steps over which access counts lose half their weight.
        bandwidth: read bandwidth per tier in bytes/s, e.g. `{"host": 8e9, "disk": 1e9}`; tiers not given are
            probed (16 MiB, once per process and directory).
        horizon: the longest remaining life (seconds) credited to a chunk when weighing a move against its cost.
        max_bytes_per_step: bytes moved per step at most (default: what a quarter of `interval` moves at the
            slowest copy bandwidth, and at least 64 MiB).
    """

    def __init__(self, interval: float | None = 0.25, hysteresis: float = 0.5, half_life: float = 4.0,
                 bandwidth: dict[str, float] | None = None, horizon: float = 60.0,
                 max_bytes_per_step: int | None = None) -> None:
        if hysteresis < 0 or half_life <= 0 or horizon <= 0:
            raise InvalidArgument("need hysteresis >= 0, half_life > 0 and horizon > 0")
        if interval is not None and interval <= 0:
            raise InvalidArgument(f"interval must be > 0 seconds or None, got {interval}")
        self.interval = interval
        self.hysteresis = float(hysteresis)
        self.decay = 0.5 ** (1.0 / float(half_life))
        self.given_bandwidth = dict(bandwidth or {})
        self.horizon = float(horizon)
        self.max_bytes_per_step = max_bytes_per_step
        self.steps = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one step at a time (the thread, or a caller)
        self._bw: np.ndarray | None = None
        self._share: np.ndarray | None = None
        self._rate: np.ndarray | None = None
        self._seen: np.ndarray | None = None
        self._inserts: tuple[float, int] | None = None
        self._insert_rate = 0.0
        self._inserting = False
        self._last_t: float | None = None
        self._period = 1.0
        self._explain: dict[str, Any] = {}

    # ------------------------------------------------------------------ inputs
    def bandwidths(self) -> dict[str, float]:
        """Read bandwidth per tier (bytes/s): given, or probed once."""
        target = self._live_target()
        if target is None:
            raise StoreClosed("the store of this placement policy is closed")
        if self._bw is None:
            self._bw = np.array([self.given_bandwidth.get(t.name) or probe_bandwidth(t) for t in target.tiers])
        return {t.name: float(b) for t, b in zip(target.tiers, self._bw)}

    def _observe(self, target: PlacementTarget) -> dict[str, Any]:
        cr, ns = target.chunk_rows, target.num_slots
        snap = target.snapshot()
        lo, hi, gens, lasts = snap["lo"], snap["hi"], snap["gens"], snap["lasts"]
        inserts, access = snap["inserts"], snap["access"]
        sealed = (gens >= lo) & (lasts == gens + cr - 1) & (gens + cr <= hi)
        mass = target.chunk_mass()
        now = time.monotonic()
        dt = max(1e-6, now - self._last_t) if self._last_t is not None else None
        self._period = self.interval or dt or 1.0  # seconds until the next step, as far as we know
        self._last_t = now
        # access: per-step counts decay to a share per column; rows/s for the gain of a move
        delta = access - (self._seen if self._seen is not None else 0)
        self._seen = access
        if self._share is None:
            self._share = np.zeros(len(access))
            self._rate = np.zeros(len(access))
        total = delta.sum()
        if total > 0:
            self._share = self.decay * self._share + (1 - self.decay) * delta / total
        if dt is not None:
            self._rate = self.decay * self._rate + (1 - self.decay) * delta / dt  # type: ignore[operator]
        elif total > 0:
            self._rate = delta.astype(float)
        self._inserting = self._inserts is not None and inserts > self._inserts[1]
        if self._inserts is not None and dt is not None:
            self._insert_rate = self.decay * self._insert_rate + (1 - self.decay) * (inserts - self._inserts[1]) / dt
        self._inserts = (now, inserts)
        share = self._share / self._share.sum() if self._share.sum() > 0 else self._share
        dead = (gens < lo) & (lasts < lo)  # no live row: the slot waits for the next chunk written
        msum = mass.sum()
        mshare = mass / msum if msum > 0 else np.zeros(ns)
        rows_left = np.maximum(0, gens + target.capacity - hi)  # rows the ring takes until the chunk is evicted
        life = np.minimum(self.horizon, rows_left / self._insert_rate) if self._insert_rate > 0 else \
            np.full(ns, self.horizon)
        life[dead] = self.horizon
        newest = int(np.argmax(np.where(sealed, gens, -1))) if sealed.any() else -1
        return {"lo": lo, "hi": hi, "gens": gens, "sealed": sealed, "dead": dead, "share": share,
                "rate": self._rate, "mass": mshare, "life": life, "newest": newest}

    # ------------------------------------------------------------------ the round
    def step(self) -> int:
        target = self._live_target()
        if target is None or not target.tiered:
            return 0
        with self._lock:
            t0 = time.perf_counter()
            moved = self._step(target)
            self.steps += 1
            self._explain["step_seconds"] = time.perf_counter() - t0
            return moved

    def _step(self, target: PlacementTarget) -> int:
        self.bandwidths()
        bw = self._bw
        assert bw is not None
        obs = self._observe(target)
        names = target.columns
        ntiers = len(target.tiers)
        cr = target.chunk_rows
        share = obs["share"]                                        # [C] access share per column
        mass = obs["mass"]                                          # [S] sampling-mass share per chunk slot
        new_mass = mass.max() if target.queue else (mass[obs["newest"]] if obs["newest"] >= 0 else 0.0)
        new_score = share * new_mass                                # [C] what a chunk written now is worth
        mass = np.where(obs["dead"], new_mass, mass)                # an empty slot is worth the chunk it will get
        score = share[:, None] * mass[None, :]                      # [C, S] value per byte held (up to a constant)
        cur = target.residency()                                    # [C, S] tier now
        cb = target.chunk_bytes()                                   # [C] bytes of one chunk
        read_rate = np.asarray(obs["rate"])[:, None] * mass[None, :] * (cb / cr)[:, None]  # bytes/s read
        life = obs["life"][None, :]
        unsealed = np.broadcast_to(~obs["sealed"][None, :], score.shape)
        movable = ~target.moving()                                  # unsealed ones only while no writer is busy
        desired = cur.copy()
        assigned = ~movable
        # chunks writers start before the next step (none while nothing is inserted: no room is held back)
        insert_chunks = 1 + math.ceil(self._insert_rate * self._period / cr) if self._inserting else 0
        slotted, bottom = target.slotted, target.bottom
        write_tier = np.full(len(names), bottom)
        top = next(c for c in range(ntiers) if not slotted[c])
        for code in range(ntiers - 1):
            t = target.tiers[code]
            incumbent = cur <= code                                 # here, or above and on the way down
            gain = read_rate * (1.0 / bw[cur] - 1.0 / bw[code]) * life   # seconds of reads saved before eviction
            cost = cb[:, None] / np.minimum(bw[cur], bw[code])            # seconds the copy takes
            cand = ~assigned & (incumbent | ((score > 0) & (gain >= cost)))
            if slotted[code]:
                cand &= ~unsealed                                   # device memory takes sealed chunks only
            eff = np.where(incumbent, score * (1 + self.hysteresis), score)
            ci_, si_ = np.nonzero(cand)
            order = np.argsort(-eff[ci_, si_], kind="stable")
            ci_, si_ = ci_[order], si_[order]
            if slotted[code]:
                keep = self._fit_slotted(target, code, names, cb, ci_)
                threshold = np.inf
            else:
                fixed = (~movable) & (cur == code)
                budget = math.inf if t.budget is None else \
                    t.budget - target.fixed_bytes(code) - int((cb[:, None] * fixed).sum())
                if code == top:  # room for the chunks writers start before the next step in slots now below
                    budget -= min(self._reserve(target, obs["hi"], insert_chunks, cur, cb, share, top), budget / 4)
                keep = np.cumsum(cb[ci_]) <= budget
                threshold = 0.0 if keep.all() else (eff[ci_[keep][-1], si_[keep][-1]] if keep.any() else np.inf)
            desired[ci_[keep], si_[keep]] = code
            assigned[ci_[keep], si_[keep]] = True
            self._explain.setdefault("threshold", {})[t.name] = float(threshold)
            if not slotted[code]:
                better = (write_tier == bottom) & (new_score > 0) & (new_score >= threshold)
                write_tier[better] = code
        desired[~assigned] = bottom
        target.set_write_tiers(write_tier)  # where writers put new chunks (never a slotted tier)
        ci_, si_ = np.nonzero(desired != cur)
        to = desired[ci_, si_]
        down = np.flatnonzero(to > cur[ci_, si_])
        up = np.flatnonzero(to < cur[ci_, si_])
        down = down[np.argsort(score[ci_[down], si_[down]], kind="stable")]   # make room first, least valuable first
        up = up[np.argsort(-score[ci_[up], si_[up]], kind="stable")]         # then the most valuable promotions
        done, spent, limit = 0, 0, self._limit(bw)
        for k in [*down.tolist(), *up.tolist()]:
            if self._stop.is_set() or target.closed or spent >= limit:
                break
            c, s_, tier = int(ci_[k]), int(si_[k]), int(to[k])
            gen = int(obs["gens"][s_]) if obs["sealed"][s_] else None
            ok = target.migrate(names[c], s_, tier, gen)
            if not ok and tier > cur[c, s_]:  # a demotion that found no room there: further down
                for lower in range(tier + 1, ntiers):
                    if not slotted[lower] and target.migrate(names[c], s_, lower, gen):
                        ok = True
                        break
            if ok:
                done += 1
                spent += int(cb[c])
        self._record(names, obs, score, bw)
        return done

    @staticmethod
    def _reserve(target: PlacementTarget, hi: int, chunks: int, cur: np.ndarray, cb: np.ndarray,
                 share: np.ndarray, top: int) -> int:
        """Bytes to keep free in the top tier so that the next `chunks` chunks written land there without a copy:
        a new chunk reuses the slot of the oldest, so only slots now below the top tier need room (none when a
        column fits the top tier whole)."""
        cr = target.chunk_rows
        first = -(-hi // cr) * cr
        slots = ((first + cr * np.arange(chunks)) % target.arena_rows) // cr
        going_up = (target.write_tiers() == top) & (share > 0)
        below = (cur[:, slots] > top).sum(axis=1)
        return int((cb * below * going_up).sum())

    def _fit_slotted(self, target: PlacementTarget, code: int, names: list[str], cb: np.ndarray,
                     ci_: np.ndarray) -> np.ndarray:
        """Slotted tier: a column's arena holds a fixed number of slots once made; a column without one gets an arena
        sized to what its candidates win of the remaining budget (made here, before the moves). `ci_` are the
        candidates' columns, best first; returns which of them are kept."""
        t = target.tiers[code]
        caps = np.array([target.slots_total(code, n) for n in names], dtype=np.int64)
        by_col = np.argsort(ci_, kind="stable")  # grouped by column, best first within each
        grouped = ci_[by_col]
        rank = np.empty(len(ci_), dtype=np.int64)
        rank[by_col] = np.arange(len(ci_)) - np.searchsorted(grouped, grouped, side="left")
        has = caps[ci_] > 0
        keep = has & (rank < caps[ci_])
        newcomer = ~has
        room = math.inf if t.budget is None else t.budget - t.nbytes()
        keep |= newcomer & (np.cumsum(np.where(newcomer, cb[ci_], 0)) <= room)
        for c in np.unique(ci_[keep & newcomer]).tolist():
            count = int(((ci_ == c) & keep).sum())
            spare = 1 if t.budget is None or t.nbytes() + (count + 1) * int(cb[c]) <= t.budget else 0
            if not target.ensure_arena(code, names[c], count + spare):
                keep &= ci_ != c
        return keep

    def _limit(self, bw: np.ndarray) -> float:
        if self.max_bytes_per_step is not None:
            return float(self.max_bytes_per_step)
        return max(64 * _MIB, float(bw.min()) * (self.interval or 1.0) / 4)

    def _record(self, names: list[str], obs: dict[str, Any], score: np.ndarray, bw: np.ndarray) -> None:
        self._explain.update({
            "share": {n: float(obs["share"][c]) for c, n in enumerate(names)},
            "rows_per_s": {n: float(np.asarray(obs["rate"])[c]) for c, n in enumerate(names)},
            "mass": obs["mass"].copy(), "score": score, "bandwidth": bw.copy(),
            "insert_rows_per_s": self._insert_rate,
        })

    def explain(self) -> dict[str, Any]:
        return dict(self._explain, steps=self.steps, last_error=self.last_error)


# ---------------------------------------------------------------------- bandwidth probe
_PROBED: dict[tuple[str, Any], float] = {}


def probe_bandwidth(tier: Any, nbytes: int = 16 * _MIB) -> float:
    """Read bandwidth of a tier in bytes/s: a short measurement, cached per process (and per filesystem for disk)."""
    kind = tier.name
    if kind == "disk":
        key: tuple[str, Any] = (kind, os.stat(tier.directory).st_dev)
    elif kind == "gpu":
        key = (kind, str(tier.device))
    else:
        key = (kind, None)
    if key in _PROBED:
        return _PROBED[key]
    if kind == "disk":
        bw = _probe_disk(tier.directory, nbytes)
    elif kind == "gpu":
        bw = _probe_gpu(tier, nbytes)
    else:
        bw = _probe_memcpy(nbytes)
    _PROBED[key] = bw
    return bw


def _probe_memcpy(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _probe_disk(directory: str, nbytes: int) -> float:
    """Cold reads: write a file, flush it and drop it from the page cache, read it back."""
    fd, path = tempfile.mkstemp(prefix="arrowbuf-probe-", dir=directory)
    try:
        block = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8).tobytes()
        os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        os.lseek(fd, 0, os.SEEK_SET)
        done = 0
        while done < nbytes:
            got = os.read(fd, min(4 * _MIB, nbytes - done))
            if not got:
                break
            done += len(got)
        return done / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
        os.unlink(path)


def _probe_gpu(tier: Any, nbytes: int) -> float:
    torch = tier.torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=tier.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if tier.device.type == "cuda":
        torch.cuda.synchronize(tier.device)
    t0 = time.perf_counter()
    dst.copy_(src)
    if tier.device.type == "cuda":
        torch.cuda.synchronize(tier.device)
    return nbytes / max(time.perf_counter() - t0, 1e-9)


def make_placement(spec: Any, tiers: int) -> Placement | None:
    """The policy for a store with `tiers` data tiers: the one given, BandwidthAware() for several, else None."""
    if spec is None:
        return BandwidthAware() if tiers > 1 else None
    if isinstance(spec, Placement):
        return spec
    if isinstance(spec, type) and issubclass(spec, Placement):
        return spec()
    if spec == "bandwidth_aware":
        return BandwidthAware()
    if spec == "static":
        return Static()
    raise InvalidArgument(f"unknown placement {spec!r}; expected an ab.placement policy, 'bandwidth_aware' or 'static'")


def placement_table(target: PlacementTarget, policy: Placement | None, explain: bool = False) -> pa.Table:
    """`store.placement()`: one row per (column, tier): chunks and bytes there; with `explain`, why."""
    tiers = target.tiers
    rows: dict[str, list[Any]] = {"column": [], "tier": [], "chunks": [], "bytes": []}
    extra: dict[str, list[Any]] = {"access_share": [], "rows_per_s": [], "mass": [], "value_per_byte": [],
                                   "read_gbps": [], "why": []}
    info = policy.explain() if (explain and policy is not None) else {}
    bw = info.get("bandwidth")
    directory = target.directory
    for f in target.schema.fields.values():
        if f.ragged:
            continue
        cb = f.row_bytes * target.chunk_rows
        ci = directory.columns.index(f.name)
        res = directory.residency[ci] if target.tiered else np.zeros(directory.num_slots, int)
        for code, t in enumerate(tiers):
            here = res == code
            n = int(here.sum())
            rows["column"].append(f.name)
            rows["tier"].append(t.name)
            rows["chunks"].append(n)
            rows["bytes"].append(n * cb)
            if explain:
                share = info.get("share", {}).get(f.name)
                mass = info.get("mass")
                m = float(mass[here].sum()) if mass is not None else None
                extra["access_share"].append(share)
                extra["rows_per_s"].append(info.get("rows_per_s", {}).get(f.name))
                extra["mass"].append(m)
                extra["value_per_byte"].append(share * m / max(1, n * cb) if share is not None and m is not None
                                               and n else None)
                extra["read_gbps"].append(float(bw[code]) / 1e9 if bw is not None else None)
                extra["why"].append(_why(f.name, t.name, n, share, m, code, len(tiers), policy))
    cols_out = {**rows, **(extra if explain else {})}
    return pa.table(cols_out)


def _why(column: str, tier: str, chunks: int, share: float | None, mass: float | None, code: int, ntiers: int,
         policy: Placement | None) -> str:
    if policy is None:
        return "single tier" if ntiers == 1 else "no placement policy: where the store first put it"
    if share is None:
        return "no step yet"
    if not chunks:
        return ""
    reads = f"{100 * share:.0f}% of sampled rows read this column"
    if mass is not None:
        reads += f"; these chunks hold {100 * mass:.0f}% of the sampling mass"
    if code == ntiers - 1:
        return reads + ("; the rest, below the upper tiers' value cut" if share > 0 else
                        "; never sampled: lowest value")
    return reads + "; highest value per byte that fits the budget"


__all__ = ["Placement", "PlacementTarget", "BandwidthAware", "Static", "probe_bandwidth"]
