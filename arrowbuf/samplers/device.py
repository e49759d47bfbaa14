"""Sampling on a torch device: the host sum tree's layout and search in torch ops, and the sampler a store's device
ring draws with.

`DeviceSumTree` is `arrowbuf.samplers.sumtree.SumTree` on a device: the same heap (a summary level at depth
`min(depth, 11)` read through a cumulative sum, binary levels below it), the same search and the same float64
arithmetic, so the same uniforms pick the same slots (tests/test_device_sampler.py feeds both the same numbers).
Every method is a fixed sequence of torch ops whose shapes depend only on the batch size: nothing reads a device
value on the host (no `.item()`, no boolean-mask indexing, no `nonzero`), so a draw never waits for the device and a
CUDA graph can replay it.

`DeviceSampler` draws for a store whose ring is mirrored on a device (`arrowbuf.ring.device_ring`), on behalf of the
store's host sampler (`UniformSampler` or `PrioritizedSampler`): the device tree's leaves are the host sampler's
`mass` (1 per sampleable row, or the prioritized leaf `(p + eps)^alpha`), copied for the positions that changed at
each sync; uniform draws are iid over the leaves, prioritized ones stratified as the host draws them, with the host's
importance weights `(P(i) / P_min)^-beta`. Usage (what `arrowbuf.engine.device_sample` does)::

    tree = DeviceSumTree(arena_rows, storage)          # storage: float64[DeviceSumTree.nodes(arena_rows)]
    sampler = DeviceSampler(store_sampler, tree, generator)
    sampler.tree.set(positions, sampler_mass)          # leaves of the positions that changed (device tensors)
    pos, weights = sampler.draw(4096)                  # device tensors, sorted positions; weights None (uniform)
    applied = sampler.update(ids, priorities, seq, valid)   # device priorities; the host tree follows (`drain`)

Priority updates given as device tensors are checked and applied on the device (all or nothing, as on the host:
`validate_priorities` plus the leaf bound) and copied to pinned host memory without waiting; `drain` hands the
copies that have landed to the host sampler (the source of truth for checkpoints, Flight and other processes), in
order. An update the device refused is reported by the `drain` that meets it (the next `sample` or
`update_priorities`): the device cannot say so at the call without making the caller wait.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..tiers.gpu import host_view
from .base import MAX_LEAF, MAX_PRIORITY, Sampler
from .prioritized import PrioritizedSampler
from .sumtree import _CLAMP_EPS, _SUMMARY_DEPTH
from .uniform import UniformSampler

__all__ = ["DeviceSumTree", "DeviceSampler", "device_kind"]


def device_kind(sampler: Sampler) -> str | None:
    """"uniform" or "prioritized" when a store with this sampler can draw on the device; None otherwise (queues,
    sequences, groups and custom samplers draw on the host)."""
    if type(sampler) is UniformSampler:
        return "uniform"
    if type(sampler) is PrioritizedSampler:
        return "prioritized"
    return None


class DeviceSumTree:
    """A sum tree over `capacity` leaves in a float64 torch tensor, laid out and searched as `SumTree`.

    Args:
        capacity: leaves (a store's arena rows).
        storage: float64 tensor of `nodes(capacity)` elements on the device (zeroed by the caller); the tree works in
            place, so tensors captured in a CUDA graph stay valid.
    """

    @staticmethod
    def nodes(capacity: int) -> int:
        """Elements of the storage a tree of `capacity` leaves uses (the host tree's layout)."""
        return 2 << (int(capacity) - 1).bit_length()

    def __init__(self, capacity: int, storage: Any) -> None:
        import torch

        self.torch = torch
        self.capacity = int(capacity)
        depth = (self.capacity - 1).bit_length()
        self.leaf_base = 1 << depth
        sd = min(depth, _SUMMARY_DEPTH)
        self.steps = depth - sd
        if tuple(storage.shape) != (2 * self.leaf_base,) or storage.dtype != torch.float64:
            raise InvalidArgument(f"device tree storage must be float64[{2 * self.leaf_base}], got "
                                  f"{storage.dtype}{list(storage.shape)}")
        self.tree = storage
        self.device = storage.device
        self.summary = storage[1 << sd:2 << sd]
        self.size = self.summary.shape[0]
        self.leaves = storage[self.leaf_base:self.leaf_base + self.capacity]
        self.prefix = torch.zeros(self.size + 1, dtype=torch.float64, device=self.device)
        self.prefix_ends = self.prefix[1:]
        self._slots = torch.arange(self.size, dtype=torch.int64, device=self.device)
        self._arange: dict[int, Any] = {}
        self._inf = torch.tensor(math.inf, dtype=torch.float64, device=self.device)

    # ------------------------------------------------------------------ updates
    def set(self, positions: Any, values: Any, unique: bool = False) -> None:
        """Set leaves `positions` (int64 tensor) to `values` (float64 tensor) and recompute their ancestors and the
        summary's prefix sums. Repeated positions: the last write wins (as `SumTree.update`); `unique=True` when the
        caller knows there are none (skips the ordering)."""
        torch = self.torch
        if positions.shape[0] == 0:
            return
        slot = positions + self.leaf_base
        if not unique:
            # last write wins without reading anything back: order by slot (stable, so repeats keep call order),
            # and send every write but the last of each slot to the unused node 0
            order = torch.sort(slot, stable=True).indices
            slot = slot.index_select(0, order)
            values = values.index_select(0, order)
            keep = torch.ones_like(slot, dtype=torch.bool)
            keep[:-1] = slot[1:] != slot[:-1]
            slot = torch.where(keep, slot, 0)
        self.tree.index_put_((slot,), values)
        tree = self.tree
        parents = slot
        for _ in range(self.steps):  # the binary levels below the summary, bottom up (a parent written once per
            parents = parents >> 1   # child is written with the same value each time: no ordering needed)
            left = tree.take(parents * 2)
            tree.index_put_((parents,), left + tree.take(parents * 2 + 1))
        self.refresh()

    def rebuild(self) -> None:
        """Recompute every level below the summary from the leaves, then the prefix sums (after bulk leaf writes)."""
        tree = self.tree
        depth = (self.leaf_base.bit_length() - 1)
        for d in range(depth - 1, depth - self.steps - 1, -1):
            lo, hi = 1 << d, 2 << d
            self.torch.add(tree[2 * lo:2 * hi:2], tree[2 * lo + 1:2 * hi:2], out=tree[lo:hi])
        self.refresh()

    def refresh(self) -> None:
        """The summary's prefix sums (what `total` and the search read)."""
        self.torch.cumsum(self.summary, 0, out=self.prefix_ends)

    # ------------------------------------------------------------------ reads
    def total(self) -> Any:
        """The sum of the leaves: a 0-d device tensor."""
        return self.prefix[-1]

    def min_positive(self) -> Any:
        """The smallest positive leaf (+inf when none): a 0-d device tensor (the host's min tree over positive
        leaves)."""
        return self.torch.where(self.leaves > 0, self.leaves, self._inf).amin()

    def get(self, positions: Any) -> Any:
        """Leaves at `positions`."""
        return self.leaves.take(positions)

    def targets(self, u: Any, stratified: bool) -> Any:
        """Masses to search for uniforms `u` in [0, 1): one per equal slice of the total (`stratified`, as
        `SumTree.sample`) or iid over it, clamped below the total as the host clamps them."""
        torch = self.torch
        total = self.total()
        if stratified:
            n = u.shape[0]
            ar = self._arange.get(n)
            if ar is None:
                ar = self._arange[n] = torch.arange(n, dtype=torch.float64, device=self.device)
            t = (u + ar) * (total / n)
        else:
            t = u * total
        upper = total * (1.0 - _CLAMP_EPS)
        upper = torch.where(upper < total, upper, torch.nextafter(total, torch.zeros_like(total)))
        return torch.minimum(t, upper)

    def find(self, targets: Any) -> Any:
        """For each target mass, the leaf whose prefix-sum interval holds it: `SumTree._find` step for step, with its
        guarded search (which only steps into nodes of positive mass) computed for every target and taken where the
        plain search ended on an empty leaf (rounding), so no branch depends on device values."""
        torch = self.torch
        tree = self.tree
        first = torch.searchsorted(self.prefix_ends, targets, right=True)
        t = targets - self.prefix.take(first)
        if self.steps:
            node = (first + self.size) * 2
            for _ in range(self.steps - 1):
                left = tree.take(node)
                right = t >= left
                t = t - left * right
                node = (node + right) * 2
            node = node + (t >= tree.take(node))
            found = tree.take(node)
            node = node - self.leaf_base
        else:
            node = first
            found = self.summary.take(first)
        # the guarded walk (SumTree._find_guarded)
        last = torch.where(self.summary > 0, self._slots, -1).amax()
        g = torch.minimum(first, last)
        tg = torch.clamp_min(targets - self.prefix.take(g), 0.0)
        g = g + self.size
        for _ in range(self.steps):
            left = tree.take(g * 2)
            right = tree.take(g * 2 + 1)
            go = ((tg >= left) & (right > 0)) | (left <= 0)
            tg = tg - left * go
            g = g * 2 + go
        return torch.where(found > 0, node, g - self.leaf_base)


class DeviceSampler:
    """Draws on the device for a store's `UniformSampler` or `PrioritizedSampler` (see the module docstring).

    Args:
        host: the store's sampler (its kind, parameters and `mass` are read; its state stays on the host).
        tree: the device tree whose leaves mirror `host.mass`.
        generator: a `torch.Generator` on the tree's device (the device PRNG).
    """

    def __init__(self, host: Sampler, tree: DeviceSumTree, generator: Any) -> None:
        kind = device_kind(host)
        if kind is None:
            raise InvalidArgument(f"{type(host).__name__} does not draw on the device (uniform and prioritized do)")
        self.kind = kind
        self.host = host
        self.tree = tree
        self.torch = tree.torch
        self.device = tree.device
        self.generator = generator
        self.stratified = bool(getattr(host, "stratified", False)) if kind == "prioritized" else False
        self.beta = float(getattr(host, "beta", 0.0))
        self.alpha = float(getattr(host, "alpha", 1.0))
        self.eps = float(getattr(host, "eps", 0.0))
        self.pending: collections.deque[tuple[Any, np.ndarray, np.ndarray, np.ndarray, Any]] = collections.deque()
        self._pinned: list[tuple[Any, Any, Any, np.ndarray, np.ndarray, np.ndarray]] = []
        self.cuda = self.device.type == "cuda"

    @property
    def weighted(self) -> bool:
        """Whether draws carry importance weights (prioritized)."""
        return self.kind == "prioritized"

    def mass(self, positions: np.ndarray) -> np.ndarray:
        """The host sampler's mass at `positions` (what the device leaves mirror), read under the store's lock."""
        return np.asarray(self.host.mass(positions), dtype=np.float64)

    # ------------------------------------------------------------------ drawing
    def draw(self, n: int, out_pos: Any = None, out_weights: Any = None) -> tuple[Any, Any]:
        """`n` positions drawn by mass (sorted, as the host samplers return them) and their importance weights
        (float32, prioritized) or None, as device tensors (written into `out_pos`/`out_weights` when given)."""
        torch = self.torch
        u = torch.rand(n, generator=self.generator, dtype=torch.float64, device=self.device)
        return self.draw_from(u, out_pos, out_weights)

    def draw_from(self, u: Any, out_pos: Any = None, out_weights: Any = None) -> tuple[Any, Any]:
        """`draw` with the uniforms given (float64 in [0, 1)): the same uniforms pick the same rows as the host
        sampler's tree (`SumTree.sample` with those numbers)."""
        torch = self.torch
        tree = self.tree
        pos = tree.find(tree.targets(u, self.stratified))
        if out_pos is None:
            pos = torch.sort(pos).values
        else:
            torch.sort(pos, out=(out_pos, torch.empty_like(pos)))
            pos = out_pos
        if not self.weighted:
            return pos, None
        return pos, self.weights(pos, out_weights)

    def weights(self, positions: Any, out: Any = None) -> Any:
        """Importance weights `(P(i) / P_min)^-beta` (float32), as `PrioritizedSampler.weights` computes them."""
        torch = self.torch
        total = self.tree.total()
        p = self.tree.get(positions) / total
        p_min = self.tree.min_positive() / total
        w = torch.pow(p / p_min, -self.beta)
        if out is None:
            return w.to(torch.float32)
        out.copy_(w)
        return out

    # ------------------------------------------------------------------ priorities
    def update(self, ids: Any, priorities: Any, seq: Any, valid: Any, arena_rows: int) -> Any:
        """Apply priority updates given as device tensors; returns the number applied as a 0-d device tensor.

        The ids are checked against the device's mirror of the ring (`seq`, `valid`: an id whose row was evicted or
        recycled, or is not sampleable, is ignored, as on the host); the priorities as `validate_priorities` and
        `PrioritizedSampler.update_priorities` check them, on the device: if any is refused, nothing is applied (the
        error is raised by the `drain` that meets it). The update is queued for the host sampler (`drain`).

        Raises:
            InvalidArgument: a uniform sampler (no priorities), or the counts differ (known without the device).
        """
        if not self.weighted:
            raise InvalidArgument(f"{type(self.host).__name__} has no priorities; use samplers.Prioritized(...)")
        torch = self.torch
        ids = ids.reshape(-1).to(torch.int64)
        pri = priorities.reshape(-1).to(torch.float64)
        if ids.shape[0] != pri.shape[0]:
            raise InvalidArgument(f"{ids.shape[0]} indices but {pri.shape[0]} priorities; pass one priority per index")
        pos = torch.remainder(ids, arena_rows)
        live = (seq.take(pos) == ids) & valid.take(pos)
        p = pri + self.eps
        leaves = torch.where(p > 0, torch.pow(torch.clamp_min(p, 0.0), self.alpha), 0.0)
        ok = ((pri >= 0) & (pri <= MAX_PRIORITY) & (leaves <= MAX_LEAF)).all()  # NaN fails every comparison
        apply = live & ok
        self.tree.set(pos, torch.where(apply, leaves, self.tree.get(pos)))
        self._queue(ids, pri, ok)
        return apply.sum()

    def _queue(self, ids: Any, pri: Any, ok: Any) -> None:
        """Copy an update to host memory without waiting (pinned buffers and an event on CUDA)."""
        torch = self.torch
        n = ids.shape[0]
        buf = self._buffers(n)
        h_ids, h_pri, h_ok, n_ids, n_pri, n_ok = buf
        h_ids[:n].copy_(ids, non_blocking=True)
        h_pri[:n].copy_(pri, non_blocking=True)
        h_ok.copy_(ok.reshape(1), non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.pending.append((event, n_ids[:n], n_pri[:n], n_ok, buf))

    def _buffers(self, n: int) -> tuple[Any, Any, Any, np.ndarray, np.ndarray, np.ndarray]:
        """Host buffers for one queued update of `n` ids (pinned on CUDA), with numpy views made once, so that a
        drain reads them without a torch call."""
        torch = self.torch
        in_use = {id(entry[4]) for entry in self.pending}
        for buf in self._pinned:
            if id(buf) not in in_use and buf[0].shape[0] >= n:
                return buf
        size = 1 << max(6, (n - 1).bit_length())
        pin = self.cuda
        h_ids = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        h_pri = torch.empty(size, dtype=torch.float64, pin_memory=pin)
        h_ok = torch.empty(1, dtype=torch.bool, pin_memory=pin)
        buf = (h_ids, h_pri, h_ok, host_view(h_ids).view(np.int64), host_view(h_pri).view(np.float64),
               host_view(h_ok).view(np.bool_))
        self._pinned.append(buf)
        return buf

    def drain(self, apply: Any, block: bool = False) -> None:
        """Hand queued device updates whose copies have landed to the host: `apply(ids, priorities)` in order
        (`block`: wait for all of them). An update the device refused is dropped from the queue and raised here.

        Raises:
            InvalidArgument: a drained update had a priority that is NaN, infinite, negative or too large (nothing of
                it was applied, on the device or on the host).
        """
        while self.pending:
            event, ids, pri, ok, _ = self.pending[0]
            if event is not None and not event.query():
                if not block:
                    return
                event.synchronize()
            self.pending.popleft()
            if not bool(ok[0]):
                bad = pri[~((pri >= 0) & (pri <= MAX_PRIORITY))]
                raise InvalidArgument(
                    "an earlier update_priorities(<device tensors>) was refused and not applied: priorities must be "
                    f"finite, >= 0 and <= {MAX_PRIORITY:g}, and (p + eps)^alpha at most {MAX_LEAF:g}; got "
                    f"{bad[:3].tolist()} among {len(pri)} (device updates are checked on the device, so the error "
                    "comes with the next call that reads their copies back: a sample raising it served nothing, an "
                    "update_priorities raising it applied its own priorities first)")
            apply(ids.copy(), pri.copy())
