"""Global ids of a sharded store: `shard << 53 | generation << 45 | seq` (see the package docstring)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: Bit layout of a global id: [0][shard: 10][generation: 8][seq: 45].
SEQ_BITS = 45
GEN_BITS = 8
SHARD_BITS = 10
MAX_SHARDS = 1 << SHARD_BITS
_SEQ_MASK = (1 << SEQ_BITS) - 1
_GEN_MASK = (1 << GEN_BITS) - 1


def encode_ids(shard: int, generation: int, seqs: np.ndarray) -> np.ndarray:
    """Global ids of shard-local seqs: `shard << 53 | generation << 45 | seq` (int64, non-negative)."""
    seqs = np.asarray(seqs, dtype=np.int64)
    return (np.int64(shard) << (GEN_BITS + SEQ_BITS)) | (np.int64(generation & _GEN_MASK) << SEQ_BITS) | (
        seqs & _SEQ_MASK)


def decode_ids(ids: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, generation, seq) arrays of global ids."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids >> (GEN_BITS + SEQ_BITS), (ids >> SEQ_BITS) & _GEN_MASK, ids & _SEQ_MASK


def shard_of(ids: npt.ArrayLike) -> np.ndarray:
    """The shard of each global id."""
    return np.asarray(ids, dtype=np.int64) >> (GEN_BITS + SEQ_BITS)

