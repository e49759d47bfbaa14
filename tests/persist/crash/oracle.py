"""What a restored durable store must hold, given the side log of the calls made on it (`crash.workload`).

The oracle keeps the *expected state* of one durable directory: a baseline (what the previous check found and
accepted, or the empty store) plus the calls of the generation since, each acknowledged (done), failed (nothing
applied) or unknown (in flight at the kill, or raised: either outcome is allowed). `check(restored)` compares a
restored store against it and returns the violations, then makes the restored state the new baseline (so one loss is
reported once, and the calls of the next generation apply on top of what the next worker restored).

What is checked, and why it is exact (every rule follows from the store's contract, docs/durability.md; "acked" means
the call returned before the kill, as the side log shows):

- Rows. The ring evicts oldest first, by seq: after a restore with next seq `hi`, the live rows are exactly the
  rows written with seq in `[hi - capacity, hi)` (holes, i.e. ids issued to batches that never committed, take their
  place too). So every acked row (or row of the baseline) with seq >= hi - capacity must be present ("acked row
  lost"); one below may be gone only if the ring could evict it: with tasks, only once every task consumed it for
  good (a consume without lease or an acked lease), which the log shows, up to the rows an in-flight consume may
  have taken ("evicted before every task consumed it"). Note that this needs no trust in the restored store's
  own oldest seq: a checkpoint that drops a live chunk moves that seq up, and the rows are reported lost.
- Every present row: its rid was sent by a writer ("phantom row"), not by an `extend` that raised InsertTimeout
  ("row of a failed write"), once ("duplicate row"; the Ray variant allows a batch whose shard died mid-call to be
  stored twice, docs/durability.md), under the id its `extend` returned ("row under another id"), under an id no
  other row had ("id reused"), and byte-exact: every field is a function of its rid ("content differs").
- `next_seq` is above every id ever given ("next id below an issued id": ids are never reused).
- The later field: the value of the last acked `update` of the row (one updater thread: the log's order is the
  calls' order), or of an update after it whose outcome is unknown; null if none ("update lost", "update value
  wrong"). A value delivered by a consume that was final and acked must be there too ("delivered value lost").
- Priorities (sampling mass, alpha 1, eps 0): the last acked `update_priorities`, or an unknown one after it.
- Consumption per task: a row a task consumed for good (a consume without lease that returned it, an ack that
  returned) stays consumed ("consumed row delivered again"); a live row no final call of the task could have
  taken is not consumed: the rows of leases that were nacked, abandoned or open at the kill come back ("leased
  row did not come back"; "row consumed without an acknowledged consume" for a row never leased). A consume in
  flight at the kill may have taken up to its `n` rows: that many unexplained rows are allowed, per task.
- `policy_version`: the last acked value or an unknown one after it ("policy_version lost").

What it does not check: sampling, the RNG and staleness drops (not journaled by design), and which rows an in-flight
call took beyond the counts above.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crash import workload as wl


@dataclass
class Violation:
    kind: str
    where: dict[str, Any]
    seq: int | None = None
    rid: int | None = None
    task: str | None = None
    detail: str = ""

    def __str__(self) -> str:
        if not self.where and self.seq is None:  # already formatted (a power-loss model's, from its process)
            return self.detail
        at = ", ".join(f"{k}={v}" for k, v in self.where.items())
        what = " ".join(f"{k}={v}" for k, v in (("seq", self.seq), ("rid", self.rid), ("task", self.task))
                        if v is not None)
        return f"[{self.kind}] {at}: {what} {self.detail}".rstrip()


@dataclass
class Restored:
    """What a check reads from a restored store (`snapshot`): its rows (every column, with `seq`), its next seq, and,
    for a full check, the rows each task has not consumed, the priorities and the policy version."""

    table: Any
    next_seq: int
    unconsumed: dict[str, set[int]] | None = None
    priority: Callable[[np.ndarray], np.ndarray] | None = None
    policy_version: int | None = None
    #: the `rows` entry of the checkpoint the restore started from (`_manifest.json`), for the messages
    checkpoint: dict[str, Any] | None = None


def snapshot(store: Any, tasks: tuple[str, ...]) -> Restored:
    """Read a restored `ExperienceStore` for a full check. Drains every task (`consume` marks rows consumed): use it
    on a copy of the directory, never on the one the next generation restores."""
    table = store.to_table()
    next_seq = int(store.stats()["next_seq"])
    unconsumed: dict[str, set[int]] = {}
    for task in tasks:
        got: set[int] = set()
        while True:
            b = store.consume(task, store.capacity, timeout=0)
            if not len(b.indices):
                break
            got.update(int(i) for i in b.indices)
        unconsumed[task] = got
    arena = store.arena_rows
    return Restored(table, next_seq, unconsumed,
                    lambda seqs: store.sampler.mass(np.asarray(seqs, np.int64) % arena),
                    int(store.policy_version))


@dataclass
class _Op:
    op: str
    status: str  # "acked" | "failed" | "unknown"
    args: dict[str, Any]
    result: dict[str, Any] | None  # an acked call's result; an unknown one's when known (power-loss model)


def calls(events: list[dict[str, Any]]) -> list[_Op]:
    """The calls of a side log's events, each once, in the order their start lines were logged."""
    order: dict[tuple[Any, ...], _Op] = {}
    for e in events:
        key = (e.get("g"), e.get("th"), e.get("k"), e["op"])
        ph = e.get("ph")
        if e["op"] == "died":
            raise AssertionError(f"a workload thread died (a harness bug; the run did less than it logs):\n"
                                 f"{e.get('trace')}")
        if e["op"] in ("open", "ready"):
            order[(*key, len(order))] = _Op(e["op"], "acked", {}, e)
            continue
        op = order.get(key)
        if op is None:
            op = order[key] = _Op(e["op"], "unknown", {}, None)
        if ph == "s":
            op.args = e
        elif ph == "d":
            op.status, op.result = "acked", e
        elif ph == "f":
            op.status, op.result = "failed", e  # the result: when and how it failed
        elif ph == "u":
            op.status, op.result = "unknown", e
        # "e": raised, outcome unknown (the default)
    return list(order.values())


class Ranges:
    """A map from disjoint key intervals to values: `[key, key + n) -> [value, value + n)` (rids to seqs, seqs to
    rids), looked up for many keys at once."""

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, keys: np.ndarray, values: np.ndarray | None = None) -> None:
        """Map `keys[i] -> values[i]` (default: to themselves); runs where both go up by one are stored once."""
        keys = np.asarray(keys, np.int64)
        values = keys if values is None else np.asarray(values, np.int64)
        if not len(keys):
            return
        brk = np.flatnonzero((np.diff(keys) != 1) | (np.diff(values) != 1)) + 1
        starts = np.concatenate([[0], brk])
        lens = np.diff(np.concatenate([starts, [len(keys)]]))
        self._parts.append((keys[starts], values[starts], lens))
        self._arrays = None

    def add_range(self, key: int, value: int, n: int) -> None:
        self._parts.append((np.array([key], np.int64), np.array([value], np.int64), np.array([n], np.int64)))
        self._arrays = None

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, value) for each key."""
        keys = np.asarray(keys, np.int64)
        if self._arrays is None:
            if self._parts:
                k, v, n = (np.concatenate(x) for x in zip(*self._parts))
                order = np.argsort(k, kind="stable")
                self._arrays = (k[order], v[order], n[order])
                self._parts = [self._arrays]
            else:
                self._arrays = (np.zeros(0, np.int64),) * 3
        k, v, n = self._arrays
        if not len(k):
            return np.zeros(len(keys), bool), np.zeros(len(keys), np.int64)
        i = np.searchsorted(k, keys, side="right") - 1
        j = np.maximum(i, 0)
        found = (i >= 0) & (keys < k[j] + n[j])
        return found, v[j] + keys - k[j]


def _expand(ranges: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(seqs, rids) of ranges (first seq, first rid, n)."""
    if not ranges:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    f, r, n = (np.asarray(x, np.int64) for x in zip(*ranges))
    off = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(f, n) + off, np.repeat(r, n) + off


@dataclass
class Oracle:
    """The expected state of one durable directory (module docstring)."""

    variant: wl.Variant
    where: dict[str, Any]
    capacity: int | None = None
    #: maps ids as the store returns them to seqs (a ShardedStore's global ids to its shard's seqs)
    to_seqs: Callable[[Any], np.ndarray] = field(default=lambda ids: np.asarray(ids, np.int64))
    #: a batch whose call raised may be stored twice (a Ray handle re-sends it to the restarted shard)
    resend: bool = False
    limit: int = 25  # examples kept per kind and check

    def __post_init__(self) -> None:
        if self.capacity is None:
            self.capacity = self.variant.capacity
        self.tasks = tuple(self.variant.tasks)
        # rows that must be there unless the ring evicted them: the baseline's, and this generation's acked extends
        self.base_seqs = np.zeros(0, np.int64)
        self.base_rids = np.zeros(0, np.int64)
        self.new_rows: list[tuple[int, int, int]] = []  # (first seq, first rid, n)
        self.sent = Ranges()  # every rid a writer sent
        self.failed = Ranges()  # rids of extends that raised InsertTimeout
        self.failed_why: dict[int, str] = {}  # first rid of such an extend -> when it ran (for the message)
        #: when the harness killed the store (time.time()), to say whether a failed call spanned a kill
        self.kills: list[float] = []
        self.rid_seq = Ranges()  # rid -> the seq its acked extend returned (or a restore showed)
        self.maybe_seq = Ranges()  # rid -> seq of extends with an unknown outcome whose ids are known
        self.owner = Ranges()  # seq -> the rid it was given to (acked, or seen restored)
        self.max_seq = -1
        self.reward: dict[int, set[float | None]] = {}  # rows without an entry: null
        self.delivered: dict[int, float] = {}  # seq -> a later-field value a final, acked consume delivered
        self.prio: dict[int, set[float] | None] = {}  # None: unknown (an unknown call on a row never set before)
        self.pv: set[int] = {0}
        self.final: dict[str, set[int]] = {t: set() for t in self.tasks}
        self.maybe: dict[str, set[int]] = {t: set() for t in self.tasks}
        self.budget: dict[str, int] = {t: 0 for t in self.tasks}
        self.leased: dict[str, set[int]] = {t: set() for t in self.tasks}
        self.expect_open: tuple[int, int, int] | None = None
        self.counts: collections.Counter = collections.Counter()
        self.checkpoints: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the calls of a generation
    def _seqs(self, ids: Any) -> list[int]:
        return [int(s) for s in self.to_seqs(np.asarray(ids, np.int64))]

    def _extend_seqs(self, result: dict[str, Any]) -> np.ndarray:
        if "first" in result:  # consecutive ids, logged as (first, n)
            ids = np.arange(int(result["first"]), int(result["first"]) + int(result["n"]), dtype=np.int64)
        else:
            ids = np.asarray(result["ids"], np.int64)
        return np.asarray(self.to_seqs(ids), np.int64)

    def ingest(self, events: list[dict[str, Any]]) -> list[Violation]:
        """Apply one generation's calls (its side logs' events); returns violations the log itself shows (an id
        given to two rows, a worker's restore that differs from the check's)."""
        out: list[Violation] = []
        leases: dict[Any, dict[str, Any]] = {}  # lease id -> the result of the consume that took it
        acked_seqs, acked_rids = [], []
        for op in calls(events):
            a, r, st = op.args, op.result, op.status
            if op.op == "open":
                assert r is not None
                if self.expect_open is not None and (r["hi"], r["n"], r["pv"]) != self.expect_open:
                    out.append(self._v("restore differs", detail=f"the worker restored (next_seq, rows, "
                                       f"policy_version) = {(r['hi'], r['n'], r['pv'])}, the check's restore of "
                                       f"the same directory {self.expect_open}"))
                self.expect_open = None
            elif op.op == "extend":
                if not a:
                    continue  # its start line was cut by the kill: nothing was sent
                rid0, n = int(a["rid0"]), int(a["n"])
                rids = np.arange(rid0, rid0 + n, dtype=np.int64)
                self.sent.add_range(rid0, rid0, n)
                if st == "failed":
                    self.failed.add_range(rid0, rid0, n)
                    t0, t1 = a.get("t"), (r or {}).get("t")
                    spans = t0 is not None and t1 is not None and any(t0 <= k <= t1 for k in self.kills)
                    self.failed_why[rid0] = (f"its extend (rids {rid0}..{rid0 + n - 1}) raised "
                                             f"{(r or {}).get('err', 'InsertTimeout')}"
                                             + (", and the store was killed while it ran" if spans else ""))
                elif st == "acked":
                    assert r is not None
                    seqs = self._extend_seqs(r)
                    self.counts["acked_rows"] += n
                    acked_seqs.append(seqs)
                    acked_rids.append(rids)
                elif r is not None and ("ids" in r or "first" in r):
                    self.maybe_seq.add(rids, self._extend_seqs(r))
            elif op.op in ("update", "prio"):
                if not a or st == "failed":
                    continue
                seqs = self._seqs(a["ids"])
                if st == "acked" and self.resend and r is not None and int(r.get("n", len(seqs))) < len(seqs):
                    st = "unknown"  # a sharded store: part of the call may have gone to a dead incarnation
                v = float(a["v"])
                for s in seqs:
                    if op.op == "update":
                        self.reward[s] = {v} if st == "acked" else self.reward.get(s, {None}) | {v}
                    else:
                        cur = self.prio.get(s)
                        self.prio[s] = {v} if st == "acked" else None if cur is None else cur | {v}
                if st == "acked":
                    self.counts["updates" if op.op == "update" else "priorities"] += 1
            elif op.op == "pv":
                if not a or st == "failed":
                    continue
                self.pv = {int(a["v"])} if st == "acked" else self.pv | {int(a["v"])}
                self.counts["policy_versions"] += st == "acked"
            elif op.op == "consume":
                if not a or st == "failed":
                    continue
                task, lease = a["task"], a.get("lease")
                if st == "acked":
                    assert r is not None
                    seqs = self._seqs(r["ids"])
                    self.counts["consumes"] += 1
                    if lease is None:
                        self.final[task].update(seqs)
                        self._delivered(r)
                    elif seqs:
                        leases[r.get("lease_id")] = r
                        self.leased[task].update(seqs)
                        self.counts["leases"] += 1
                        self.counts["leased_rows"] += len(seqs)
                elif lease is None:
                    if r is not None and "ids" in r:
                        self.maybe[task].update(self._seqs(r["ids"]))
                    else:
                        self.budget[task] += int(a["n"])
            elif op.op in ("ack", "nack", "abandon"):
                if not a:
                    continue
                task = a["task"]
                seqs = self._seqs(a["ids"])
                if op.op == "ack":
                    if st == "acked":
                        self.final[task].update(seqs)
                        self.counts["acks"] += 1
                        if a.get("lease_id") in leases:  # the values its consume delivered count from now on
                            self._delivered(leases[a["lease_id"]])
                    elif st == "unknown":
                        self.maybe[task].update(seqs)
                else:
                    self.counts[op.op + "s"] += st == "acked"
            elif op.op == "ckpt":
                if st == "acked" and r is not None:
                    self.checkpoints.append({k: r.get(k) for k in ("generation", "first_seq", "next_seq",
                                                                    "dropped_rows")})
                    self.counts["checkpoints"] += 1
        if acked_seqs:
            seqs, rids = np.concatenate(acked_seqs), np.concatenate(acked_rids)
            found, prev = self.owner.lookup(seqs)
            uniq, first, counts = np.unique(seqs, return_index=True, return_counts=True)
            for i in np.flatnonzero(found & (prev != rids))[:self.limit]:
                out.append(self._v("id reused", int(seqs[i]), int(rids[i]),
                                   detail=f"extend returned id {int(seqs[i])}, given to rid {int(prev[i])} before"))
            for i in first[counts > 1][:self.limit]:
                out.append(self._v("id reused", int(seqs[i]), int(rids[i]), detail="two acked extends returned it"))
            self.owner.add(seqs, rids)
            self.rid_seq.add(rids, seqs)
            brk = np.flatnonzero((np.diff(seqs) != 1) | (np.diff(rids) != 1)) + 1
            for lo, hi in zip(np.concatenate([[0], brk]), np.concatenate([brk, [len(seqs)]])):
                self.new_rows.append((int(seqs[lo]), int(rids[lo]), int(hi - lo)))
            self.max_seq = max(self.max_seq, int(seqs.max()))
        return self._limit(out)

    def _delivered(self, r: dict[str, Any]) -> None:
        for i, v in r.get("rw") or []:
            if v is not None:
                self.delivered[self._seqs([i])[0]] = float(v)

    # ------------------------------------------------------------------ the check
    def _v(self, kind: str, seq: int | None = None, rid: int | None = None, task: str | None = None,
           detail: str = "") -> Violation:
        return Violation(kind, dict(self.where), seq, rid, task, detail)

    def check(self, got: Restored, partial: bool = False) -> list[Violation]:
        """Compare a restored store with the expected state, then take it as the new baseline. `partial`: only
        rows and the later field were read (`got.unconsumed` and the rest are None)."""
        out: list[Violation] = []
        cap = int(self.capacity)  # type: ignore[arg-type]
        hi = int(got.next_seq)
        t = got.table
        seqs = np.asarray(t.column("seq").to_numpy(), np.int64)
        rids = np.asarray(t.column("rid").to_numpy(), np.int64)
        live = {int(s): i for i, s in enumerate(seqs.tolist())}
        self.counts["checks"] += 1
        if hi <= self.max_seq:
            out.append(self._v("next id below an issued id", detail=f"next_seq {hi} <= id {self.max_seq} given "
                                                                     "before"))
        out += self._check_rows(seqs, rids, t, live)
        # rows that must be there
        new_seqs, new_rids = _expand(self.new_rows)
        ms, mr = np.concatenate([self.base_seqs, new_seqs]), np.concatenate([self.base_rids, new_rids])
        present = np.isin(ms, seqs)
        self.counts["rows_checked"] += int(present.sum())
        for i in np.flatnonzero(~present & (ms >= hi - cap)):
            out.append(self._v("acked row lost", int(ms[i]), int(mr[i]),
                               detail=f"live window [{hi - cap}, {hi}); {self._ckpt_context(int(ms[i]), got)}"))
        evicted_unconsumed: dict[str, list[tuple[int, int]]] = {t_: [] for t_ in self.tasks}
        if self.tasks:  # evicted: only once every task consumed it for good
            for i in np.flatnonzero(~present & (ms < hi - cap)):
                s = int(ms[i])
                for task in self.tasks:
                    if s not in self.final[task] and s not in self.maybe[task]:
                        evicted_unconsumed[task].append((s, int(mr[i])))
        if not partial:
            out += self._check_consumption(got, live, rids, evicted_unconsumed)
            out += self._check_priorities(got, seqs, rids)
            if got.policy_version is not None and got.policy_version not in self.pv:
                out.append(self._v("policy_version lost", detail=f"restored {got.policy_version}, expected one of "
                                                                 f"{sorted(self.pv)}"))
        self._rebase(got, seqs, rids, t.column("reward").to_pylist(), partial)
        return self._limit(out)

    def _check_rows(self, seqs: np.ndarray, rids: np.ndarray, t: Any, live: dict[int, int]) -> list[Violation]:
        """Every present row: sent, not failed, once, under its id, an id nobody else had, byte-exact, its later
        field."""
        out: list[Violation] = []
        bad: dict[str, np.ndarray] = {}
        sent, _ = self.sent.lookup(rids)
        bad["phantom row"] = ~sent
        failed, _ = self.failed.lookup(rids)
        bad["row of a failed write"] = failed & ~np.isin(seqs, self.base_seqs)  # reported once, when it appears
        acked, want = self.rid_seq.lookup(rids)
        maybe, want_maybe = self.maybe_seq.lookup(rids)
        want = np.where(acked, want, want_maybe)
        known = acked | maybe
        uniq, first, counts = np.unique(rids, return_index=True, return_counts=True)
        dup = np.isin(rids, uniq[counts > 1])
        if self.resend:  # a re-sent batch may be stored twice: each copy is fine where its id is no other row's
            dup[:] = False
            known &= ~np.isin(rids, uniq[counts > 1])
        bad["duplicate row"] = dup & ~np.isin(np.arange(len(rids)), first)
        bad["row under another id"] = known & (want != seqs)
        owned, owner = self.owner.lookup(seqs)
        bad["id reused"] = owned & (owner != rids)
        bad["content differs"] = ~self._content(t, rids)
        details = {"phantom row": "no writer sent this rid",
                   "row of a failed write": "its extend raised InsertTimeout (nothing written)",
                   "duplicate row": "the rid is stored twice", "content differs": "a field is not the rid's content"}
        failed_firsts = sorted(self.failed_why)
        for kind, mask in bad.items():
            for i in np.flatnonzero(mask):
                detail = details.get(kind) or (f"its extend returned id {int(want[i])}" if kind ==
                                               "row under another id" else f"given to rid {int(owner[i])} before")
                if kind == "row of a failed write":
                    j = int(np.searchsorted(failed_firsts, int(rids[i]), side="right")) - 1
                    detail = self.failed_why.get(failed_firsts[j], detail) if j >= 0 else detail
                out.append(self._v(kind, int(seqs[i]), int(rids[i]), detail=detail))
        rewards = t.column("reward").to_pylist()
        for s, rid, value in zip(seqs.tolist(), rids.tolist(), rewards):
            allowed = self.reward.get(s, {None})
            if value not in allowed:
                kind = "update lost" if value is None else "update value wrong"
                out.append(self._v(kind, s, rid, detail=f"reward {value}, expected one of "
                                                        f"{sorted(allowed, key=str)}"))
            if s in self.delivered and value is None:
                out.append(self._v("delivered value lost", s, rid, detail=f"a final consume delivered reward "
                                                                          f"{self.delivered[s]}; restored null"))
        return out

    def _content(self, t: Any, rids: np.ndarray) -> np.ndarray:
        ok = np.ones(len(rids), bool)
        if not len(rids):
            return ok
        vec = t.column("vec").combine_chunks()
        got = np.asarray(vec.to_numpy_ndarray() if hasattr(vec, "to_numpy_ndarray") else
                         np.stack(vec.to_numpy(zero_copy_only=False)), np.float32).reshape(len(rids), -1)
        ok &= (got == wl.vecs(rids, self.variant.width)).all(axis=1)
        if self.variant.ragged:
            col = t.column("payload").combine_chunks()
            offsets = np.asarray(col.offsets.to_numpy(), np.int64)
            values = np.asarray(col.flatten().to_numpy(), np.int32)
            exp_off, exp_val = wl.payloads_flat(rids)
            lens, exp_lens = np.diff(offsets), np.diff(exp_off)
            same_len = lens == exp_lens
            ok &= same_len
            if same_len.all() and len(values) == len(exp_val):
                bad = np.flatnonzero(values != exp_val)
                if len(bad):
                    ok[np.unique(np.searchsorted(exp_off, bad, side="right") - 1)] = False
            else:
                for i in np.flatnonzero(same_len):
                    a = values[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]
                    ok[i] &= np.array_equal(a, exp_val[exp_off[i]:exp_off[i + 1]])
        return ok

    def _check_consumption(self, got: Restored, live: dict[int, int], rids: np.ndarray,
                           evicted_unconsumed: dict[str, list[tuple[int, int]]]) -> list[Violation]:
        out: list[Violation] = []
        assert got.unconsumed is not None
        for task in self.tasks:
            left = got.unconsumed.get(task, set())
            unexplained: list[tuple[int, int]] = []
            for s, i in live.items():
                consumed = s not in left
                if s in self.final[task]:
                    if not consumed:
                        out.append(self._v("consumed row delivered again", s, int(rids[i]), task,
                                           "a consume or ack of it returned before the kill"))
                elif consumed and s not in self.maybe[task]:
                    unexplained.append((s, int(rids[i])))
            unexplained += evicted_unconsumed.get(task, [])
            if len(unexplained) > self.budget[task]:
                for s, rid in unexplained:
                    if s not in live:
                        kind, why = "evicted before every task consumed it", "evicted"
                    elif s in self.leased[task]:
                        kind, why = "leased row did not come back", "consumed"
                    else:
                        kind, why = "row consumed without an acknowledged consume", "consumed"
                    out.append(self._v(kind, s, rid, task, f"{why}; {len(unexplained)} such rows for the task, "
                                                           f"at most {self.budget[task]} explained by consumes in "
                                                           f"flight"))
        return out

    def _check_priorities(self, got: Restored, seqs: np.ndarray, rids: np.ndarray) -> list[Violation]:
        out: list[Violation] = []
        if got.priority is None or not len(seqs):
            return out
        mass = got.priority(seqs)
        for s, rid, m in zip(seqs.tolist(), rids.tolist(), mass.tolist()):
            allowed = self.prio.get(s)
            if allowed is not None and m not in allowed:
                out.append(self._v("priority lost", s, rid, detail=f"priority {m}, expected one of "
                                                                  f"{sorted(allowed)}"))
        return out

    def _ckpt_context(self, seq: int, got: Restored) -> str:
        """Where a lost row stands against the checkpoint the restore started from (the journal after it replayed
        the rest): below its first seq (the checkpoint left out a chunk that still had live rows), or at or after its
        snapshot point (neither in the checkpoint nor in the journal after it)."""
        c = got.checkpoint
        if c is None:
            return f"checkpoints of this generation: {self.checkpoints[-3:] or 'none completed'}"
        where = (f"below the checkpoint's first seq {c.get('first_seq')} (it dropped {c.get('dropped_rows')} rows)"
                 if seq < int(c.get("first_seq", 0)) else
                 f"at or after the checkpoint's snapshot point {c.get('next_seq')}, not in the journal after it"
                 if seq >= int(c.get("next_seq", 0)) else "inside the checkpoint's range")
        return f"restored from checkpoint {c}: {where}"

    def _rebase(self, got: Restored, seqs: np.ndarray, rids: np.ndarray, rewards: list[Any], partial: bool) -> None:
        """The restored state is the baseline from here on (the next generation restores the same directory).
        What was not restored was reported (lost) or evicted: either way it is gone from here on."""
        found, _ = self.owner.lookup(seqs)
        self.owner.add(seqs[~found], rids[~found])
        bound, _ = self.rid_seq.lookup(rids)
        self.rid_seq.add(rids[~bound], seqs[~bound])
        self.max_seq = max(self.max_seq, int(got.next_seq) - 1)
        self.base_seqs, self.base_rids = seqs.copy(), rids.copy()
        self.new_rows = []
        self.maybe_seq = Ranges()
        self.reward = {s: {v} for s, v in zip(seqs.tolist(), rewards) if v is not None}
        if partial:
            return
        self.delivered = {}
        if got.priority is not None and len(seqs):
            self.prio = {s: {m} for s, m in zip(seqs.tolist(), got.priority(seqs).tolist())}
        if got.policy_version is not None:
            self.pv = {got.policy_version}
        assert got.unconsumed is not None
        for task in self.tasks:
            left = got.unconsumed.get(task, set())
            self.final[task] = {s for s in seqs.tolist() if s not in left}
            self.maybe[task] = set()
            self.budget[task] = 0
            self.leased[task] = set()
        self.checkpoints = []

    def _limit(self, out: list[Violation]) -> list[Violation]:
        """Every violation counts; at most `limit` examples per kind are kept in full."""
        kept: list[Violation] = []
        per: collections.Counter = collections.Counter()
        for v in out:
            self.counts["violation:" + v.kind] += 1
            per[v.kind] += 1
            if per[v.kind] <= self.limit:
                kept.append(v)
        for kind, n in per.items():
            if n > self.limit:
                kept.append(self._v(kind, detail=f"... and {n - self.limit} more of this kind in this check"))
        return kept
