"""An RLlib algorithm checkpoint that keeps its arrowbuf replay buffer.

RLlib 2.60's new API stack leaves the replay buffer out of `algo.save()` (`Algorithm.get_checkpointable_components`
has no buffer; only the old stack's `store_buffer_in_checkpoints` path calls the buffer's `get_state`). These two
functions put the buffer in by checkpoint reference::

    from arrowbuf.rllib import save_with_buffer, from_checkpoint_with_buffer

    save_with_buffer(algo, "ckpt/")              # algo.save_to_path + the buffer's store checkpointed into ckpt/
    algo = from_checkpoint_with_buffer("ckpt/")  # Algorithm.from_checkpoint, then the buffer restored: full again

The store goes to the buffer's `checkpoint_dir` (the `replay_buffer_config(..., checkpoint_dir=...)` option), or,
without one, to `<path>/arrowbuf_replay_buffer` (incremental across saves into the same directory).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ray.rllib.algorithms.algorithm import Algorithm

STATE_FILE = "arrowbuf_replay_buffer.json"
STORE_DIR = "arrowbuf_replay_buffer"


def save_with_buffer(algo: Algorithm, path: str | os.PathLike) -> str:
    """`algo.save_to_path(path)` and the algorithm's arrowbuf replay buffer by checkpoint reference; returns path."""
    from ..persist.manifest import write_json_atomic

    root = os.path.abspath(os.fspath(path))
    out = algo.save_to_path(root)
    buf = algo.local_replay_buffer
    if buf is not None and hasattr(buf, "checkpoint_dir"):
        if buf.checkpoint_dir is None:
            buf.checkpoint_dir = os.path.join(root, STORE_DIR)
        write_json_atomic(os.path.join(root, STATE_FILE), buf.get_state())
    return str(out)


def from_checkpoint_with_buffer(path: str | os.PathLike, **kwargs: Any) -> Algorithm:
    """`Algorithm.from_checkpoint(path)`, then its arrowbuf replay buffer restored from the saved reference."""
    from ray.rllib.algorithms.algorithm import Algorithm

    root = os.path.abspath(os.fspath(path))
    algo = Algorithm.from_checkpoint(root, **kwargs)
    state_file = os.path.join(root, STATE_FILE)
    buf = algo.local_replay_buffer
    if buf is not None and os.path.exists(state_file):
        with open(state_file) as f:
            buf.set_state(json.load(f))
    return algo
