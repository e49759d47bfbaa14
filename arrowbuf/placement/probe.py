"""Tier read bandwidths: short probes (memcpy, disk, GPU), cached per process."""

from __future__ import annotations

import math
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    pass


_MIB = 1 << 20


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
