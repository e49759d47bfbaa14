"""`StoreOptions`: everything an `ExperienceStore` is built from besides its schema, in one object.

The constructor's keyword arguments build one (they stay the shorthand), and every place that rebuilds a store takes
it whole: a shared-memory store's manifest (`ExperienceStore.attach`), a checkpoint's manifest
(`ExperienceStore.restore`), the spec of a Ray shard. A new option is added here, and read where it takes effect.

Usage::

    opts = ab.StoreOptions(capacity=100_000, sampler="uniform", durable="run/")
    store = ab.ExperienceStore(schema, options=opts)
    opts.to_dict()                      # JSON: what manifests record (samplers and limiters as specs)
    ab.StoreOptions.from_dict(d, where="ckpt/_manifest.json")   # checked: a manifest is a file someone may have changed

Sections: geometry (`capacity`, `chunk_rows`, `final_obs_capacity`), sampling (`sampler`, `rate_limiter`, `seed`,
`max_times_sampled`), consumption (`tasks`, `max_staleness`, `token_field`), placement (`tier`, `tiers`,
`placement`, `name`), observability (`observe`), durability (`durable`, `durability`, `journal_direct`). The
arguments are documented on `ExperienceStore`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgument, StoreCorrupt
from .samplers.spec import from_spec, to_spec

#: Bounds of what a manifest may claim (checked before anything is allocated).
MAX_ROWS = 1 << 45
MAX_TASKS = 4096

#: What `to_dict` records: the options a store is rebuilt from (the placement, the seed and the durability of a
#: restored or attached store are the caller's).
RECORDED = ("name", "capacity", "chunk_rows", "final_obs_capacity", "max_times_sampled", "sampler", "rate_limiter",
            "tasks", "max_staleness", "token_field", "observe")


def final_obs_advice(have: int, want: int) -> tuple[str, str]:
    """The final-observation slots a store has and the option that keeps `want` of them, as a warning says them
    (`engine.writer`: the option's name lives here)."""
    return f"final_obs_capacity={have}", f"Pass final_obs_capacity={want} (or more)"


@dataclass(frozen=True)
class StoreOptions:
    """Everything an `ExperienceStore` is built from besides its schema (module docstring; the arguments are
    documented on `ExperienceStore`)."""

    capacity: int
    sampler: Any = "uniform"
    rate_limiter: Any = None
    seed: int | None = None
    chunk_rows: int | None = None
    final_obs_capacity: int | None = None
    max_times_sampled: int | None = None
    tier: Any = "host"
    name: str | None = None
    tiers: dict[str, Any] | None = None
    placement: Any = None
    tasks: list[str] | None = None
    max_staleness: int | None = None
    token_field: str | None = None
    observe: bool = True
    durable: Any = None
    durability: str = "group"
    #: large journal records written with direct I/O where the filesystem allows it; None: the registered
    #: `ARROWBUF_JOURNAL_DIRECT` (`arrowbuf.config`), read when the store opens its journal
    journal_direct: bool | None = None

    def __post_init__(self) -> None:
        cap = int(self.capacity) if isinstance(self.capacity, np.integer) else self.capacity
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise InvalidArgument(f"capacity must be a positive number of rows, got {cap!r}")
        object.__setattr__(self, "capacity", cap)
        if isinstance(self.tasks, tuple):
            object.__setattr__(self, "tasks", list(self.tasks))

    def replace(self, **changes: Any) -> StoreOptions:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options a store is rebuilt from (`RECORDED`), as JSON: samplers and rate limiters as their specs
        (`arrowbuf.samplers.spec`)."""
        out: dict[str, Any] = {}
        for key in RECORDED:
            v = getattr(self, key)
            if key in ("sampler", "rate_limiter"):
                from .samplers import make_sampler

                v = to_spec(make_sampler(v) if key == "sampler" else v)
            out[key] = v
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str, **more: Any) -> StoreOptions:
        """Options from what `to_dict` wrote (a manifest: also a checkpoint's `store` entry of format 1, whose keys
        are the same), checked: keys it does not know are ignored, a value of the wrong kind or size raises. `more`
        sets the options a manifest does not record (tier, seed, ...).

        Raises:
            StoreCorrupt: naming `where` and the value.
        """
        if not isinstance(d, dict):
            raise StoreCorrupt(f"{where}: the store's options are {type(d).__name__}, expected an object")

        def bad(key: str, what: str) -> StoreCorrupt:
            return StoreCorrupt(f"{where}: {key}={str(d.get(key))[:80]!r}, expected {what}")

        def count(key: str, lo: int, hi: int, optional: bool = True) -> int | None:
            v = d.get(key)
            if v is None and optional:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise bad(key, f"an integer in [{lo}, {hi}]" + (" or null" if optional else ""))
            return v

        def name(key: str) -> str | None:
            v = d.get(key)
            if v is not None and (not isinstance(v, str) or not 0 < len(v) <= 256):
                raise bad(key, "a name of 1 to 256 characters or null")
            return v

        tasks = d.get("tasks")
        if tasks is not None and not (isinstance(tasks, list) and len(tasks) <= MAX_TASKS and
                                      all(isinstance(t, str) and 0 < len(t) <= 256 for t in tasks) and
                                      len(set(tasks)) == len(tasks)):
            raise bad("tasks", f"a list of at most {MAX_TASKS} unique names or null")
        observe = d.get("observe", True)
        if not isinstance(observe, bool):
            raise bad("observe", "true or false")
        for key in ("sampler", "rate_limiter"):
            if not isinstance(d.get(key), (dict, type(None))):
                raise bad(key, "a spec object or null")
        values: dict[str, Any] = dict(
            capacity=count("capacity", 1, MAX_ROWS, optional=False), chunk_rows=count("chunk_rows", 1, MAX_ROWS),
            final_obs_capacity=count("final_obs_capacity", 0, MAX_ROWS) or None,
            max_times_sampled=count("max_times_sampled", 1, 1 << 31), name=name("name"),
            sampler=from_spec(d.get("sampler"), where), rate_limiter=from_spec(d.get("rate_limiter"), where),
            tasks=tasks or None, max_staleness=count("max_staleness", 0, (1 << 62) - 1),
            token_field=name("token_field"), observe=observe)
        values["sampler"] = "uniform" if values["sampler"] is None else values["sampler"]
        values.update(more)
        try:
            return cls(**values)
        except InvalidArgument as exc:
            raise StoreCorrupt(f"{where}: {exc}") from None


__all__ = ["MAX_ROWS", "RECORDED", "StoreOptions"]
