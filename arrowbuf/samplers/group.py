"""Groups: all completions of one prompt, delivered whole (GRPO, DAPO).

`GroupSampler` (exported as `ab.samplers.Group`) makes a store deliver whole groups: `G` rows that share a group
key (`prompt_id`). `store.sample(n)` draws whole groups uniformly at random (with replacement; distinct with
`max_times_sampled`), and `store.consume(task, n)` delivers the oldest complete groups (see `arrowbuf.engine.consume`).

Usage::

    store = ab.ExperienceStore(schema, capacity=4096, sampler=ab.samplers.Group(key="prompt_id", size=8,
                                                                                drop_zero_variance="reward"),
                               tasks=["ref", "train"])
    batch = store.consume("train", 64, require=["reward"])   # 8 whole groups (64 rows), never split

How rows form groups: the live rows with one key value, in insert order, are cut into groups of `size` (so a
prompt written twice, 2G rows, is two groups). A group is complete when it has its `size` rows. Groups are never
split: `sample(n)` returns `ceil(n / size)` groups cut to `n` rows only when `n` is not a multiple of `size` (pass
a multiple), and `consume(task, n)` returns at most `n // size` groups.

DAPO dynamic sampling (`drop_zero_variance="reward"`): once every row of a complete group has its reward, a group
whose rewards are all equal carries no GRPO advantage; it is dropped (never sampled nor consumed by any task) and
counted once in `stats()["groups_dropped_zero_variance"]`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..errors import InvalidArgument, SchemaError
from .base import Sampler


class RowView(Protocol):
    """What a group sampler reads of its store's rows (the store's `ConsumeTracker` provides it)."""

    def values(self, name: str, positions: np.ndarray) -> np.ndarray:
        """Values of scalar field `name` at ring `positions`."""

    def present(self, fields: list[str], positions: np.ndarray) -> np.ndarray:
        """Mask: every field in `fields` is present (written) at each of `positions`."""


def assign_groups(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut rows into groups: rows sharing a key, in their given order, form groups of `size`.

    Args:
        keys: the group key of each row, rows in insert order.
        size: rows per group.

    Returns:
        (group number of each row, row count of each group); groups are numbered by key, then by order.
    """
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    new_run = np.empty(n, dtype=bool)
    new_run[0] = True
    new_run[1:] = sk[1:] != sk[:-1]
    run_id = np.cumsum(new_run) - 1
    rank = np.arange(n) - np.flatnonzero(new_run)[run_id]
    gid_sorted = np.cumsum(new_run | (rank % size == 0)) - 1
    gid = np.empty(n, dtype=np.int64)
    gid[order] = gid_sorted
    return gid, np.bincount(gid_sorted)


def complete_groups(seqs: np.ndarray, keys: np.ndarray, size: int) -> np.ndarray:
    """The complete groups among rows `seqs` (insert order) with group keys `keys`: a [groups, size] array of seqs,
    one group per row, oldest group (by its first row) first, each group's rows in insert order."""
    gid, counts = assign_groups(keys, size)
    full = counts[gid] == size
    if not full.any():
        return np.zeros((0, size), dtype=np.int64)
    s, g = seqs[full], gid[full]
    members = s[np.argsort(g, kind="stable")].reshape(-1, size)  # seqs ascend inside each group
    return members[np.argsort(members[:, 0], kind="stable")]


class GroupSampler(Sampler):
    """Whole groups of `size` rows sharing a `key` (all completions of a prompt). See the module docstring.

    Args:
        key: the scalar field naming a row's group (e.g. `prompt_id`).
        size: rows per group (G).
        drop_zero_variance: None, or a scalar field (`"reward"`): groups whose values of it are all equal are dropped.
    """

    spec_name = "group"
    whole_groups = True
    process_local = False  # its state (dropped groups) lives in the store's tier: shared memory for tier="shm"

    def __init__(self, key: str = "prompt_id", size: int = 8, drop_zero_variance: str | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"Group(key=...) takes a field name, got {key!r}")
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise InvalidArgument(f"Group(size=...) must be a positive number of rows per group, got {size!r}")
        if drop_zero_variance is not None and (not isinstance(drop_zero_variance, str) or not drop_zero_variance):
            raise InvalidArgument(f"Group(drop_zero_variance=...) takes None or a field name such as 'reward', got "
                                  f"{drop_zero_variance!r}")
        self.key = key
        self.size = int(size)
        self.drop_zero_variance = drop_zero_variance
        self._count = np.zeros(1, dtype=np.int64)  # groups dropped for zero variance (in the store's tier once bound)
        self._view: RowView | None = None

    @property
    def dropped_groups(self) -> int:
        """Groups dropped for zero variance so far (by every process of a shared store)."""
        return int(self._count[0])

    @dropped_groups.setter
    def dropped_groups(self, value: int) -> None:
        self._count[0] = int(value)

    def _on_bind(self) -> None:
        # per ring position, the seq of a row whose group was dropped for zero variance (seq-stamped: a new row in
        # the slot is not dropped); in the store's tier, so every process of a shared store sees the same drops
        tier = self.index.tier
        self._dropped = tier.allocate("sampler.group.dropped", np.dtype(np.int64), self.index.arena_rows)
        count = tier.allocate("sampler.group.count", np.dtype(np.int64), 1)
        if tier.fresh:  # a process attaching to shared memory must not reset it
            self._dropped.fill(-1)
            count[0] = self.dropped_groups
        self._count = count

    def attach(self, view: RowView, schema: Any) -> None:
        """Give the sampler its store's rows (called once by the store); checks the fields it reads.

        Raises:
            SchemaError: the key or the zero-variance field is not a scalar field of the schema.
        """
        for what, name in (("key", self.key), ("drop_zero_variance", self.drop_zero_variance)):
            if name is None:
                continue
            spec = schema.fields.get(name)
            if spec is None or spec.shape or spec.ragged or not spec.plain:
                scalars = [n for n, f in schema.fields.items() if not f.shape and not f.ragged and f.plain]
                raise SchemaError(f"Group({what}={name!r}) needs a scalar field of schema {schema.name!r}; "
                                  f"its scalar fields are {scalars}")
        self._view = view

    def _rows(self) -> RowView:
        if self._view is None:
            raise InvalidArgument("a Group sampler works inside an ExperienceStore (pass it as sampler=...)")
        return self._view

    def groups(self, seqs: np.ndarray) -> np.ndarray:
        """The complete groups among live rows `seqs` (insert order): [groups, size] seqs, oldest first."""
        pos = seqs % self.index.arena_rows
        return complete_groups(seqs, self._rows().values(self.key, pos), self.size)

    def screen(self, members: np.ndarray) -> np.ndarray:
        """Mask over complete groups `members` ([groups, size] seqs): False for groups dropped for zero variance
        (now or before). Newly dropped groups are remembered and counted (`dropped_groups`)."""
        if self.drop_zero_variance is None or len(members) == 0:
            return np.ones(len(members), dtype=bool)
        view = self._rows()
        pos = members % self.index.arena_rows
        flat = pos.reshape(-1)
        known = view.present([self.drop_zero_variance], flat).reshape(members.shape).all(axis=1)
        vals = view.values(self.drop_zero_variance, flat).reshape(members.shape)
        zero = known & (vals == vals[:, :1]).all(axis=1)
        new = zero & (self._dropped[pos[:, 0]] != members[:, 0])
        if new.any():
            self._dropped[pos[new].reshape(-1)] = members[new].reshape(-1)
            self.dropped_groups += int(new.sum())
        return ~zero

    def select(self, n: int, *, distinct: bool = False) -> tuple[np.ndarray, None] | None:
        members = self.groups(self.index.valid_seqs())
        members = members[self.screen(members)]
        want = -(-n // self.size)
        if len(members) == 0 or (distinct and len(members) < want):
            return None
        pick = (self.rng.choice(len(members), size=want, replace=False) if distinct
                else self.rng.integers(0, len(members), size=want))
        return members[pick].reshape(-1)[:n].copy(), None

    def state(self, positions: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        dropped = self._dropped[positions] == self.index.seq[positions]  # rows of groups dropped for zero variance
        return {"dropped_groups": self.dropped_groups}, {"group_dropped": dropped}

    def load_state(self, positions: np.ndarray, meta: dict[str, Any], arrays: dict[str, np.ndarray],
                   dropped_valid: int = 0) -> None:
        self.dropped_groups = int(meta.get("dropped_groups", 0))
        dropped = positions[np.asarray(arrays.get("group_dropped", np.zeros(len(positions), bool)), dtype=bool)]
        self._dropped[dropped] = self.index.seq[dropped]

    def describe(self) -> dict[str, Any]:
        return {"sampler": "GroupSampler", "group_key": self.key, "group_size": self.size,
                "groups_dropped_zero_variance": self.dropped_groups}



__all__ = ["GroupSampler", "RowView", "assign_groups", "complete_groups"]
