"""`BandwidthAware` placement (after the Conduit paper); see `arrowbuf.placement`."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgument, StoreClosed

if TYPE_CHECKING:  # pragma: no cover
    pass

from .base import Placement
from .probe import probe_bandwidth
from .target import PlacementTarget

_MIB = 1 << 20

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
            self._rate = self.decay * self._rate + (1 - self.decay) * delta / dt
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
