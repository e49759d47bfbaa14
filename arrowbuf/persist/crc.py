"""CRC-32 for journal records and checkpoint files: the zlib/gzip polynomial (CRC-32/ISO-HDLC), so the values are
the same whichever implementation computes them and the formats do not change.

`crc32(data, value=0)` is python-isal's (`isal.isal_zlib.crc32`: Intel ISA-L, folding with carry-less multiplies,
~20 GB/s on one core) when that package is installed (`pip install arrowbuf[fast]`), else the standard library's
`zlib.crc32` (slicing tables, ~1-4 GB/s). A journal record's checksum is the largest part of the journal's CPU per
byte (a 186 KB batch: ~45 us with zlib, ~10 us with ISA-L), and of a restore's check of the segments it reads.
`IMPLEMENTATION` names the one in use (`store.stats()["journal"]["crc32"]`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Buffer

_crc: Callable[[Any, int], int]
try:
    from isal import isal_zlib as _isal

    _crc = _isal.crc32
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - the standard library's
    _crc = zlib.crc32
    IMPLEMENTATION = "zlib"


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC-32 of `data` (any bytes-like object), continued from `value` (a previous call's result)."""
    return _crc(data, value) & 0xFFFFFFFF
