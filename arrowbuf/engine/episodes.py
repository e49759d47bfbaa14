"""Episode bookkeeping on ingest: episode ids, step indexes and the successor of each step.

Several actors' episodes may interleave in one store. A writer names its stream with an `actor` key (the store
assigns episode ids) or gives `episode_id` itself; without either, all rows form one stream. For each incoming batch
the tracker plans, without changing any state, each row's episode id, step index and successor row, and only
`apply` makes the plan the new state (so a batch rejected later changes nothing).

Usage::

    tracker = EpisodeTracker()
    plan = tracker.plan(n, ends, actor=None, episode_id=None)   # may raise SchemaError
    ...write rows...
    tracker.apply(plan, first_seq)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgument, SchemaError


@dataclass
class _Stream:
    episode_id: int = -1        # open episode, -1 when the stream has none
    step: int = 0               # steps of the open episode so far
    pending_seq: int = -1       # seq of the open episode's last row, waiting for its successor


@dataclass
class IngestPlan:
    """What one batch does to the episode state: per-row columns and the new stream states."""

    episode_id: np.ndarray
    step: np.ndarray
    succ: np.ndarray           # local index of each row's successor in the batch, -1 none here, -2 episode ended
    pred: np.ndarray           # local index of each row's predecessor in the batch, -1 none
    patches: list[tuple[int, int]]  # (seq of an earlier pending row, local index of its successor)
    streams: dict[Hashable, _Stream | None] = field(default_factory=dict)  # None: the stream's episode ended
    ended: list[int] = field(default_factory=list)
    next_episode_id: int = 0


class EpisodeTracker:
    """Per-stream episode state: which episode is open, its length, and its last row."""

    def __init__(self, next_id: np.ndarray | None = None) -> None:
        """`next_id`: a one-element int64 array holding the next episode id to hand out; pass a shared one (the
        store's index header) so that every writer process draws ids from one sequence. Streams stay per tracker."""
        self.streams: dict[Hashable, _Stream] = {}
        self.ended: set[int] = set()
        self._next_id = next_id if next_id is not None else np.zeros(1, dtype=np.int64)

    @property
    def next_episode_id(self) -> int:
        return int(self._next_id[0])

    @next_episode_id.setter
    def next_episode_id(self, value: int) -> None:
        self._next_id[0] = value

    def state(self) -> dict[str, Any]:
        """This tracker's state as JSON values: the open streams of this process's writers, the explicit episode
        ids that ended, and the next episode id (`load_state` puts it back).

        Raises:
            InvalidArgument: a stream key that cannot be recorded (actor keys are ints or strings).
        """
        streams = [{"key": _encode_key(key), "episode_id": st.episode_id, "step": st.step,
                    "pending_seq": st.pending_seq} for key, st in self.streams.items()]
        return {"streams": streams, "ended": sorted(int(e) for e in self.ended),
                "next_episode_id": self.next_episode_id}

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace this tracker's state with one `state` returned (a restored store's tracker)."""
        streams = {_decode_key(s["key"]): _Stream(int(s["episode_id"]), int(s["step"]), int(s["pending_seq"]))
                   for s in state["streams"]}
        ended = {int(e) for e in state["ended"]}
        self.streams.clear()
        self.streams.update(streams)
        self.ended = ended
        self.next_episode_id = int(state["next_episode_id"])

    def plan(self, n: int, ends: np.ndarray, actor: Any = None, episode_id: np.ndarray | None = None) -> IngestPlan:
        ep = np.empty(n, dtype=np.int64)
        step = np.empty(n, dtype=np.int64)
        succ = np.full(n, -1, dtype=np.int64)
        pred = np.full(n, -1, dtype=np.int64)
        patches: list[tuple[int, int]] = []
        new_streams: dict[Hashable, _Stream | None] = {}
        ended: list[int] = []
        next_id = self.next_episode_id
        explicit = episode_id is not None
        keys = episode_id if explicit else actor
        if keys is None:
            groups: list[tuple[Hashable, np.ndarray]] = [(None, np.arange(n))]
        else:
            uniq, inverse = np.unique(keys, return_inverse=True)
            order = np.argsort(inverse, kind="stable")
            bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
            groups = [(_key(uniq[g]), order[bounds[g]:bounds[g + 1]]) for g in range(len(uniq))]
        if explicit:
            next_id = max(next_id, int(np.max(np.asarray(keys))) + 1) if n else next_id
        for key, idx in groups:
            old = self.streams.get(("ep", key) if explicit else key)
            m = len(idx)
            e = ends[idx]
            # episode ordinal of each row inside this group: 0 = the stream's open episode
            ordinal = np.zeros(m, dtype=np.int64)
            np.cumsum(e[:-1], out=ordinal[1:])
            if explicit:
                if key in self.ended:
                    raise SchemaError(f"episode_id {key} already ended; a new episode needs a new id")
                if m > 1 and ordinal[-1] > 0:
                    raise SchemaError(
                        f"episode_id {key}: rows continue after the step that ended the episode; "
                        "a new episode needs a new id"
                    )
                ids = np.full(m, key, dtype=np.int64)
            else:
                cont, next_id = _continue(old, next_id)
                first_id = cont.episode_id
                new_count = int(ordinal[-1])
                ids = np.where(ordinal == 0, first_id, next_id + ordinal - 1)
                next_id += new_count
            # step index inside the episode
            local = np.arange(m, dtype=np.int64)
            starts = np.zeros(m, dtype=np.int64)
            boundary = np.flatnonzero(np.diff(ordinal)) + 1
            starts[boundary] = boundary
            np.maximum.accumulate(starts, out=starts)
            steps = local - starts
            if old is not None:
                steps[ordinal == 0] += old.step
            ep[idx] = ids
            step[idx] = steps
            # successors: the next row of the group unless this row ends the episode
            succ[idx[:-1]] = np.where(e[:-1], -2, idx[1:])
            succ[idx[-1]] = -2 if e[-1] else -1
            pred[idx[1:]] = np.where(e[:-1], -1, idx[:-1])
            if old is not None and old.pending_seq >= 0:
                patches.append((old.pending_seq, int(idx[0])))
            ended.extend(int(i) for i in np.unique(ids[e])) if explicit else None
            # the pending row is named by its local index until apply() knows the batch's first seq
            new_streams[("ep", key) if explicit else key] = _after(int(ids[-1]), int(steps[-1]), bool(e[-1]),
                                                                   -2 - int(idx[-1]))
        return IngestPlan(ep, step, succ, pred, patches, new_streams, ended, next_id)

    def advance_one(self, key: Hashable, end: bool, seq: int) -> tuple[int, int, int]:
        """`plan` + `apply` for one row `seq` of stream `key` (store-assigned episode ids), by the same rules
        (`_continue`, `_after`) without the batch bookkeeping: the append path.

        Returns (episode_id, step, seq of the row now followed by this one, or -1).
        """
        cur = self.streams.get(key)
        if cur is None or cur.episode_id < 0:  # (`_continue` of an open stream is the stream itself: skip the call)
            cur, self.next_episode_id = _continue(cur, self.next_episode_id)
            out = (cur.episode_id, cur.step, cur.pending_seq)
            self._set(key, _after(cur.episode_id, cur.step, end, seq, into=cur))
            return out
        out = (cur.episode_id, cur.step, cur.pending_seq)
        if _after(cur.episode_id, cur.step, end, seq, into=cur) is None:  # else: `cur`, updated, is still the state
            self._set(key, None)
        return out

    def close(self, key: Hashable) -> None:
        """End stream `key`'s open episode (`ExperienceStore.end_episode`): its next row starts a new episode."""
        self.streams.pop(key, None)

    def _set(self, key: Hashable, st: _Stream | None) -> None:
        """The one place a stream's state changes."""
        if st is None:
            self.streams.pop(key, None)
        else:
            self.streams[key] = st

    def apply(self, plan: IngestPlan, first_seq: int) -> None:
        """Make a planned batch the new state; `first_seq` is the seq of its first row."""
        for key, st in plan.streams.items():
            if st is not None and st.pending_seq <= -2:
                st.pending_seq = first_seq + (-2 - st.pending_seq)
            self._set(key, st)
        self.ended.update(plan.ended)
        self.next_episode_id = plan.next_episode_id

    def open_episodes(self) -> int:
        return len(self.streams)


def _continue(old: _Stream | None, next_id: int) -> tuple[_Stream, int]:
    """How a stream's next row continues it (the one rule `plan` and `advance_one` share): the stream's open episode,
    or a new one with id `next_id` (its step count 0, keeping a pending predecessor). Returns (that state, the next
    free episode id)."""
    if old is None or old.episode_id < 0:
        return _Stream(next_id, 0, -1 if old is None else old.pending_seq), next_id + 1
    return old, next_id


def _after(episode_id: int, step: int, ended: bool, pending: int, into: _Stream | None = None) -> _Stream | None:
    """A stream's state after its row (`episode_id`, `step`), which may end the episode; `pending` names the row.
    `into`: a state object to reuse (the append path, which owns it)."""
    if ended:
        return None
    if into is None:
        return _Stream(episode_id, step + 1, pending)
    into.episode_id, into.step, into.pending_seq = episode_id, step + 1, pending
    return into


def _key(value: Any) -> Hashable:
    return value.item() if hasattr(value, "item") else value


def _encode_key(key: Any) -> Any:
    if key is None or isinstance(key, (int, str)):
        return {"v": key}
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "ep":
        return {"ep": _encode_key(key[1])["v"]}
    if isinstance(key, (float, bool)):
        return {"v": key}
    raise InvalidArgument(f"an episode stream key {key!r} cannot be checkpointed (actor keys are ints or strings)")


def _decode_key(obj: dict[str, Any]) -> Any:
    if "ep" in obj:
        return ("ep", obj["ep"])
    return obj["v"]
