"""The sample path of a store with a device ring: draws, gathers and priority updates on the device, no host sync.

`StoreReader.sample` hands a sample here when the store's GPU tier mirrors the ring (`arrowbuf.ring.device_ring`),
the sampler draws on the device (`arrowbuf.samplers.device`: uniform or prioritized, without `max_times_sampled`)
and every column asked for is mirrored. One `sample(n)`:

1. under the state lock: wait for the rate limiter and for a sampleable row (host counters), then `sync` the mirror
   (copies of what changed, queued on the ring's stream) and hand the device priority updates whose copies landed
   to the host sampler;
2. on the ring's stream, holding the ring's lock (no other sync lands in between): draw positions with the device
   PRNG over the device tree, read their seqs from the mirror, gather every column with one `index_select` each
   (a derived column through the mirrored `next_pos`: ring rows and final observations alike), the importance
   weights, and n-step returns, straight into output tensors kept in a pool (`DeviceOutputs`: a set is reused only
   once nothing outside the pool references it). On CUDA, once a request's shapes have been seen, this step is a
   CUDA graph replay (`_Graphs`): one launch instead of a few dozen.

Nothing in it reads a device value on the host: the batch's columns, `indices` and `weights` are device tensors,
and the caller's stream is ordered after the ring's. `update_priorities` with device tensors is applied on the
device and reaches the host sampler without waiting (`DeviceSampler.update`, `drain`).

Differences from the host path, by design: the device PRNG draws other rows than the host one for the same seed
(seeded batches repeat on the same kind of device); `batch.indices` and `batch.weights` are device tensors;
`update_priorities(<device tensors>)` returns its count as a 0-d device tensor, and a refused update is reported by
the next call that drains it (see `arrowbuf.samplers.device`); the host sampler's running maximum priority takes in
device updates once their copies land (new rows enter at the maximum known then).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..delivery.batch import SampleBatch
from ..errors import InvalidArgument, SampleTimeout
from ..ring.device_ring import DeviceRing
from ..ring.tiered import TieredColumnArenas
from ..samplers.device import DeviceSampler, DeviceSumTree
from ..tiers.gpu import torch_dtype
from .core import StoreCore
from .nstep import n_step_dtype, n_step_returns_device

_SYSTEM = ("seq", "episode_id", "step")
_MAX_SETS = 8     # output sets kept per request shape (a learner holds one or two batches; a Loader `prefetch` more)
_GRAPHS = 4       # CUDA graphs kept per request shape, each with its own outputs
_WARM = 2         # eager samples of a request shape before its first graph is captured


class DeviceSampling:
    """The device sample path over a store's `StoreCore` and its `DeviceRing` (see the module docstring).

    Args:
        core: the store's internals (its columns are a `TieredColumnArenas` holding `ring`).
        ring: the device ring.
        timeout_error: builds the `SampleTimeout` for a sample that could not be served (the reader's message).
        graphs: use CUDA graphs on a CUDA device (None: yes).
    """

    def __init__(self, core: StoreCore, ring: DeviceRing,
                 timeout_error: Callable[[int, float | None], SampleTimeout], graphs: bool | None = None) -> None:
        torch = ring.torch
        self.torch = torch
        self.core = core
        self.ring = ring
        self.cols: TieredColumnArenas = core.cols  # type: ignore[assignment]
        self.timeout_error = timeout_error
        self.generator = torch.Generator(device=ring.device)
        self.generator.manual_seed(_seed(core.rng))
        self.tree = DeviceSumTree(core.arena_rows, ring.tree)
        self.sampler = DeviceSampler(core.sampler, self.tree, self.generator)
        self.outputs = DeviceOutputs(torch, ring.device)
        use_graphs = ring.tier.cuda if graphs is None else bool(graphs) and ring.tier.cuda
        self.graphs = _Graphs(self) if use_graphs else None
        self.derived = {d.name: d.next_of for d in core.schema.derived.values()}
        self._served: dict[tuple[tuple[str, ...], bool], bool] = {}
        self._plans: dict[tuple, dict[str, tuple[tuple[int, ...], Any]]] = {}
        self.stats: dict[str, Any] = {"samples": 0, "eager": 0, "graph_replays": 0, "graph_captures": 0,
                                      "graphs_off": "", "priority_updates": 0}

    # ------------------------------------------------------------------ what it serves
    def serves(self, names: list[str], n_step: int | None) -> bool:
        """Whether every column of `names` (and, with `n_step`, the reward, the episode-end flags and the bootstrap
        sources) is mirrored on the device."""
        key = (tuple(names), n_step is not None)
        ok = self._served.get(key)
        if ok is None:
            arenas = self.ring.arenas
            need = [self.derived.get(n, n) for n in names if n not in _SYSTEM]
            if n_step is not None:
                need += ["reward", *self.core.end_fields, *self.derived.values()]
            ok = self._served[key] = all(n in arenas for n in need)
        return ok

    # ------------------------------------------------------------------ sample
    def sample(self, n: int, names: list[str], timeout: float | None, n_step: int | None,
               gamma: float) -> SampleBatch:
        """`n` items drawn and gathered on the device (the caller checked the arguments and `serves`).

        Waiting (for the rate limiter, for rows) happens under the state lock only, never holding the ring's lock, so
        a thread waiting for data does not hold up another's priority update or sample."""
        ring = self.ring
        core = self.core
        deadline = None if timeout is None or timeout <= 0 else time.monotonic() + timeout
        held = [False]
        seen: tuple[int, int] | None = None
        while True:
            with core.cond:
                self._wait(n, timeout, deadline, held, seen)
            with ring.lock, ring.on_stream():
                with core.cond:
                    ready = self._ready(n)
                    if ready is False:  # no sampleable row on the device yet: wait for a commit
                        seen = (core.index.hi, core.index.counter("final_count"))
                    elif ready is None:  # the rate limiter changed its mind meanwhile: wait on it again
                        held[0], seen = True, None
                if ready:
                    plan_key = (n, tuple(names), n_step, float(gamma))
                    plan = self._plan(plan_key)
                    outs = self.graphs.run(plan_key, plan) if self.graphs is not None else None
                    if outs is None:
                        outs, pooled = self.outputs.take(plan_key, plan)
                        self.run(plan_key, outs)
                        self.stats["eager"] += 1
                        if not pooled:  # the caller's alone: its memory goes back when the caller drops it
                            ring.hand_over(outs.values())
                    self.stats["samples"] += 1
                    break
        if held[0]:
            core.limiter_waits["sample"] += 1
        arrays = {k: outs[k] for k in plan if not k.startswith("_")}
        return SampleBatch(arrays, outs["_indices"], outs.get("_weights"))

    def _wait(self, n: int, timeout: float | None, deadline: float | None, held: list[bool],
              seen: tuple[int, int] | None) -> None:
        """Under the state lock: wait for the rate limiter and for rows (`seen`: the commit point when the mirror had
        no sampleable row: wait for a later one); raise `SampleTimeout` past the deadline."""
        core = self.core
        index = core.index

        def ready() -> bool:
            core.check_open()
            if core.rate_limiter is not None and not core.rate_limiter.can_sample(n, core.counters()):
                held[0] = True
                return False
            if seen is not None:
                return (index.hi, index.counter("final_count")) != seen
            return len(index) > 0

        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not core.wait_for(ready, left if left is None or left > 0 else None):
            raise self.timeout_error(n, timeout)

    def _ready(self, n: int) -> bool | None:
        """Under the state lock and the ring's: sync the mirror; when the limiter allows and a row is sampleable,
        count the sample (it is served now): True; False: no sampleable row; None: the limiter says no."""
        core = self.core
        if core.rate_limiter is not None and not core.rate_limiter.can_sample(n, core.counters()):
            return None
        self._sync()
        if not (self.ring.valid_count > 0 and (not self.sampler.weighted or core.sampler.total_mass() > 0)):
            return False
        core.index.count("samples", n)
        core.cond.notify_all()
        return True

    def _sync(self) -> None:
        """Under the state lock: device updates that landed go to the host sampler (raising for one the device
        refused); then the mirror catches up."""
        if self.sampler.pending:
            self.sampler.drain(self._apply_host)
        self._pull()

    def _pull(self) -> None:
        """Under the state lock: the mirror catches up with the host (`DeviceRing.sync`), the tree's leaves too."""
        core = self.core
        got = self.ring.sync(core.index, core.final_owner, self.cols.rows, self.cols.final_rows, self.sampler.mass)
        if got is not None:
            pos, leaves = got
            if pos.shape[0] * 8 > self.core.arena_rows:  # many leaves: write them, then rebuild the levels once
                self.tree.leaves.index_copy_(0, pos, leaves)
                self.tree.rebuild()
            else:
                self.tree.set(pos, leaves, unique=True)

    def _plan(self, key: tuple) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The output tensors of a request: name -> (shape, torch dtype); names starting with "_" stay internal."""
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        torch = self.torch
        n, names, n_step, _ = key
        schema = self.core.schema
        plan = {"_pos": ((n,), torch.int64), "_indices": ((n,), torch.int64)}
        if self.sampler.weighted:
            plan["_weights"] = ((n,), torch.float32)
        for name in names:
            if name in _SYSTEM:
                plan[name] = ((n,), torch.int64)
                continue
            spec = schema.fields[self.derived.get(name, name)]
            plan[name] = ((n, *spec.shape), _delivered(torch, spec.dtype))
            if spec.dtype in _UNSIGNED:
                plan[f"_raw.{name}"] = ((n, *spec.shape), torch_dtype(torch, spec.dtype))
        if n_step is not None:
            nd = torch_dtype(torch, n_step_dtype(schema.fields["reward"].dtype))
            plan["n_step_return"] = ((n,), nd)
            plan["n_step_discount"] = ((n,), nd)
            for d, src in self.derived.items():
                spec = schema.fields[src]
                plan[f"n_step_{d}"] = ((n, *spec.shape), _delivered(torch, spec.dtype))
                if spec.dtype in _UNSIGNED:
                    plan[f"_raw.n_step_{d}"] = ((n, *spec.shape), torch_dtype(torch, spec.dtype))
        self._plans[key] = plan
        return plan

    def run(self, key: tuple, outs: dict[str, Any]) -> None:
        """The device work of one sample into `outs` (what a CUDA graph captures): fixed shapes, no host reads."""
        torch = self.torch
        ring = self.ring
        n, names, n_step, gamma = key
        pos, _ = self.sampler.draw(n, outs["_pos"], outs.get("_weights"))
        torch.index_select(ring.seq, 0, pos, out=outs["_indices"])
        nxt = None
        for name in names:
            if name == "seq":
                outs[name].copy_(outs["_indices"])
            elif name == "episode_id":
                torch.index_select(ring.episode_id, 0, pos, out=outs[name])
            elif name == "step":
                torch.index_select(ring.step, 0, pos, out=outs[name])
            elif name in self.derived:
                if nxt is None:
                    nxt = ring.next_pos.take(pos)
                self._gather(self.derived[name], nxt, name, outs)
            else:
                self._gather(name, pos, name, outs)
        if n_step is not None:
            core = self.core
            trunc = core.schema.truncation
            arenas = ring.arenas
            ret, disc, last = n_step_returns_device(
                torch, ring.next_pos, ring.valid, arenas["reward"],
                [arenas[f] for f in core.end_fields if f not in trunc], [arenas[f] for f in core.end_fields
                                                                          if f in trunc],
                pos, int(n_step), float(gamma), core.arena_rows, outs["n_step_return"].dtype)
            outs["n_step_return"].copy_(ret)
            outs["n_step_discount"].copy_(disc)
            last_next = ring.next_pos.take(last)
            for d, src in self.derived.items():
                self._gather(src, last_next, f"n_step_{d}", outs)

    def _gather(self, source: str, rows: Any, name: str, outs: dict[str, Any]) -> None:
        torch = self.torch
        raw = outs.get(f"_raw.{name}")
        if raw is None:
            torch.index_select(self.ring.arenas[source], 0, rows, out=outs[name])
            return
        torch.index_select(self.ring.arenas[source], 0, rows, out=raw)
        mask = 0xFFFF if raw.dtype == torch.int16 else 0xFFFFFFFF
        torch.bitwise_and(raw.to(torch.int64), mask, out=outs[name])

    # ------------------------------------------------------------------ priorities
    def update_priorities(self, indices: Any, priorities: Any) -> Any:
        """Priorities given as device tensors, applied on the device (see `DeviceSampler.update`); returns the number
        applied as a 0-d device tensor."""
        torch = self.torch
        ring = self.ring
        self.core.check_open()
        ids = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(np.asarray(indices),
                                                                                device=ring.device)
        pri = priorities if isinstance(priorities, torch.Tensor) else torch.as_tensor(np.asarray(priorities),
                                                                                      device=ring.device)
        refused: InvalidArgument | None = None
        with ring.lock, ring.on_stream():
            with self.core.cond:  # the mirror as of now: ids of rows evicted meanwhile are ignored, as on the host
                try:
                    if self.sampler.pending:
                        self.sampler.drain(self._apply_host)
                except InvalidArgument as exc:  # an earlier call's: reported once this one is applied
                    refused = exc
                self._pull()
            applied = self.sampler.update(ids, pri, ring.seq, ring.valid, self.core.arena_rows)
            ring.hand_over([applied])
            self.stats["priority_updates"] += 1
        if refused is not None:
            raise refused
        return applied

    def _apply_host(self, ids: np.ndarray, pri: np.ndarray) -> None:
        """Under the state lock: a device update (already on the device) applied to the host sampler."""
        c = self.core
        live = c.index.live(ids)
        if live.any():
            c.sampler.update_priorities(ids[live] % c.arena_rows, pri[live])
        c.index.count("priority_updates_ignored", int((~live).sum()))

    def flush(self) -> None:
        """Wait for every queued device priority update and apply it to the host sampler (what a checkpoint or
        another process then sees); raises what `drain` raises."""
        with self.ring.lock, self.core.lock:
            self.sampler.drain(self._apply_host, block=True)

    def host_update(self, apply: Callable[[], np.ndarray]) -> None:
        """A priority update given on the host: queued device updates go first (in order), then `apply()` (under the
        state lock; returns the positions it changed), whose leaves the next sync copies."""
        with self.ring.lock, self.core.lock:
            self.sampler.drain(self._apply_host, block=True)
            self.ring.mark(apply())

    def views(self, names: list[str]) -> dict[str, Any]:
        """The device ring's columns `names` (scalar fields, episode_id, step, seq) as 1-D device tensors over every
        ring position, no copy, after a sync; plus `live` (a new tensor: the position holds a live row)."""
        ring = self.ring
        fields = self.core.schema.fields
        bad = [n for n in names if n not in _SYSTEM and (n not in ring.arenas or fields[n].shape)]
        if bad:
            raise InvalidArgument(f"to_cudf(device=True): {bad} are not scalar columns of the device ring; it holds "
                                  f"{sorted(n for n in ring.arenas if not fields[n].shape)} and {list(_SYSTEM)}")
        with ring.lock, ring.on_stream():
            with self.core.cond:
                self._sync()
                lo, hi = self.core.index.lo, self.core.index.hi
            out = {n: ring.arenas[n][:self.core.arena_rows] if n in ring.arenas else getattr(ring, n) for n in names}
            if "seq" not in out:
                out["seq"] = ring.seq
            out["live"] = (ring.seq >= lo) & (ring.seq < hi)
        return out

    def describe(self) -> dict[str, Any]:
        """What `stats()` shows of the device path: samples, graph replays, the mirror's copies, staging."""
        st = self.ring.tier.staging
        return {**self.stats, **{f"ring_{k}": v for k, v in self.ring.stats.items()},
                "ring_bytes": self.ring.nbytes(), "staging_uploads": st.uploads, "staging_bytes": st.bytes,
                "staging_waits": st.waits, "pending_priority_updates": len(self.sampler.pending),
                "columns": sorted(self.ring.arenas), "device": str(self.ring.device)}


_UNSIGNED = {np.dtype(np.uint16), np.dtype(np.uint32)}


def _delivered(torch: Any, dtype: np.dtype) -> Any:
    """The torch dtype a device gather delivers for numpy `dtype` (uint16/uint32 widened to int64, as `GpuTier.take`
    delivers them)."""
    return torch.int64 if np.dtype(dtype) in _UNSIGNED else torch_dtype(torch, dtype)


def _seed(rng: np.random.Generator) -> int:
    """A seed for the device PRNG from the store's generator, without advancing its stream (a child of its seed
    sequence), so the host draws of a seeded store stay what they were."""
    seq = getattr(rng.bit_generator, "seed_seq", None)
    if isinstance(seq, np.random.SeedSequence):
        return int(seq.spawn(1)[0].generate_state(1, np.uint64)[0] >> np.uint64(1))
    return int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))


class DeviceOutputs:
    """Device output tensors reused across samples: a set of outputs (one per column) is handed out again only once
    nothing outside the pool references any of its tensors (no batch, tensor or view of it is alive), so a batch the
    caller keeps is never overwritten. Up to `_MAX_SETS` sets per request shape are kept; past that, a set is made
    for the one sample."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self.sets: dict[tuple, list[OutputSet]] = {}
        self.made = 0

    def take(self, key: tuple, plan: dict[str, tuple[tuple[int, ...], Any]]) -> tuple[dict[str, Any], bool]:
        """A free output set for request `key`, and whether the pool keeps it (else it is made for this sample)."""
        sets = self.sets.setdefault(key, [])
        for one in sets:
            if one.free():
                return one.outs, True
        outs = self.make(plan)
        if len(sets) < _MAX_SETS:
            sets.append(OutputSet(outs))
            return outs, True
        return outs, False

    def make(self, plan: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, Any]:
        """A new output set for `plan`."""
        self.made += 1
        return {k: self.torch.empty(shape, dtype=dtype, device=self.device) for k, (shape, dtype) in plan.items()}


class OutputSet:
    """Output tensors and how to tell that only the pool references them: their Python references (a batch holds the
    tensor itself) and the users of their memory (a view, a DLPack or numpy export), compared with the counts when
    only the pool held them."""

    def __init__(self, outs: dict[str, Any]) -> None:
        import torch

        self.outs = outs
        self.tensors = list(outs.values())
        self._use = getattr(torch._C, "_storage_Use_Count", None)
        # the storage's address, read once: asking for `untyped_storage()` each time costs a Python object
        self._storages = [t.untyped_storage()._cdata for t in self.tensors] if self._use is not None else []
        self.base = self._counts()

    def _counts(self) -> tuple[list[int], list[int]]:
        refs = [sys.getrefcount(t) for t in self.tensors]
        use = self._use
        return refs, ([use(c) for c in self._storages] if use is not None else [])

    def free(self) -> bool:
        """Whether nothing outside the pool references these outputs."""
        refs = [sys.getrefcount(t) for t in self.tensors]
        if refs != self.base[0]:
            return False
        use = self._use
        return use is None or [use(c) for c in self._storages] == self.base[1]


class _Graphs:  # pragma: no cover - needs a CUDA device
    """CUDA graphs of the device sample step (`DeviceSampling.run`), per request shape: captured on the ring's
    stream once the shape was sampled eagerly `_WARM` times (lazy initialisations done), each with its own outputs
    (`_GRAPHS` per shape: a graph replays only when nothing outside references its outputs). Tensors the step reads
    (mirrors, arenas, the tree and its prefix sums) are updated in place by syncs, so a graph stays valid; the device
    PRNG's state is registered with each graph, so replays draw fresh numbers. A capture that fails turns graphs off
    for the store (`stats()["device"]["graphs_off"]` says why); samples go on eagerly."""

    def __init__(self, owner: DeviceSampling) -> None:
        self.owner = owner
        self.graphs: dict[tuple, list[tuple[Any, OutputSet]]] = {}
        self.seen: dict[tuple, int] = {}
        self.off = False

    def run(self, key: tuple, plan: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, Any] | None:
        """Replay a free graph of `key` (capturing one when due); None: sample eagerly."""
        if self.off:
            return None
        for graph, one in self.graphs.get(key, []):
            if one.free():
                graph.replay()
                self.owner.stats["graph_replays"] += 1
                return one.outs
        seen = self.seen[key] = self.seen.get(key, 0) + 1
        if seen <= _WARM or len(self.graphs.get(key, [])) >= _GRAPHS:
            return None
        try:
            graph, outs = self._capture(key, plan)
        except Exception as exc:  # a capture failed: eager from now on, and say why
            self.off = True
            self.owner.stats["graphs_off"] = f"{type(exc).__name__}: {exc}"[:300]
            return None
        self.graphs.setdefault(key, []).append((graph, OutputSet(outs)))
        self.owner.stats["graph_captures"] += 1
        graph.replay()
        self.owner.stats["graph_replays"] += 1
        return outs

    def _capture(self, key: tuple, plan: dict[str, tuple[tuple[int, ...], Any]]) -> tuple[Any, dict[str, Any]]:
        torch = self.owner.torch
        ring = self.owner.ring
        outs = self.owner.outputs.make(plan)
        graph = torch.cuda.CUDAGraph()
        register = getattr(graph, "register_generator_state", None)
        if register is None:
            raise RuntimeError("this torch cannot register a device generator with a CUDA graph")
        register(self.owner.generator)
        with torch.cuda.graph(graph, stream=ring.stream, capture_error_mode="thread_local"):
            self.owner.run(key, outs)
        return graph, outs
