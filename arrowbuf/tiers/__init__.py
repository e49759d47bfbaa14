"""Memory tiers: host, shared memory, disk and GPU arenas behind one `Tier` interface.

`make_tiers` turns the `tiers=` argument of `ExperienceStore` into tier objects::

    make_tiers({"gpu": "8GiB", "host": "16GiB", "disk": "spill/"})
    make_tiers({"host": 1 << 30, "disk": ("spill/", "100GiB")})
    make_tiers({"gpu": GpuTier("1GiB", device="cuda:1"), "host": HostTier("8GiB"), "disk": DiskTier("spill/")})
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidArgument
from .base import Tier, format_bytes, parse_bytes
from .disk import DiskTier
from .gpu import GpuTier
from .host import HostTier

#: Tiers from fastest to slowest; a store's data tiers are kept in this order (codes in the chunk directory).
ORDER = ("gpu", "host", "disk")


def make_tiers(spec: dict[str, Any]) -> tuple[HostTier, list[Tier]]:
    """(the host tier the store's index lives in, the data tiers fastest first) for `ExperienceStore(tiers=spec)`.

    Keys are tier names: "gpu" (a budget, or a dict with budget and device), "host" (a budget), "disk" (a spill
    directory, `(directory, budget)` or a dict with path and budget); a value may also be a `Tier`. Without a "host"
    key the index still lives on the host, unbudgeted, and holds no column data; without a host or disk tier the host
    holds the rest (unbudgeted).
    """
    if not isinstance(spec, dict) or not spec:
        raise InvalidArgument("tiers= takes a dict of tier name -> budget, e.g. {'host': '16GiB', 'disk': 'spill/'}, "
                         f"got {spec!r}")
    made: dict[str, Tier] = {}
    try:
        for name, value in spec.items():
            if name not in ORDER:
                raise InvalidArgument(f"unknown tier {name!r} in tiers=; expected some of {list(ORDER)}")
            made[name] = _one(name, value)
    except BaseException:
        for t in made.values():
            t.close()
        raise
    host = made.get("host")
    meta = host if isinstance(host, HostTier) else HostTier()
    data = [made[n] for n in ORDER if n in made]
    if all(t.slotted for t in data):
        data.append(meta)  # somewhere to hold what the device does not
    return meta, data


def _one(name: str, value: Any) -> Tier:
    if isinstance(value, Tier):
        if value.name != name:
            raise InvalidArgument(f"tiers={{{name!r}: ...}} got a {value.name!r} tier")
        return value
    if name == "host":
        return HostTier(budget=value)
    if name == "gpu":
        if isinstance(value, dict):
            return GpuTier(budget=value.get("budget"), device=value.get("device", "cuda"))
        return GpuTier(budget=value)
    # disk
    if isinstance(value, dict):
        return DiskTier(value["path"], budget=value.get("budget"))
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return DiskTier(value[0], budget=value[1])
    if isinstance(value, (str, os.PathLike)):
        return DiskTier(value)
    raise InvalidArgument(f"tiers={{'disk': ...}} takes a spill directory, (directory, budget) or a dict; "
                          f"got {value!r}")


__all__ = ["Tier", "HostTier", "DiskTier", "GpuTier", "make_tiers", "parse_bytes", "format_bytes", "ORDER"]
