"""RLlib replay buffers backed by arrowbuf, with optional latency-aware scheduling (docs/rllib.md).

`arrowbuf.rllib.buffers` holds the buffer classes, `convert` the episode/column conversion, `scheduling` the
background add. The names below are the public ones.
"""

from .buffers import (
           METRIC_NAMES,
           METRICS_KEY,
           ArrowbufEpisodeReplayBuffer,
           ArrowbufPrioritizedEpisodeReplayBuffer,
           replay_buffer_config,
)
from .checkpoint import from_checkpoint_with_buffer, save_with_buffer
from .scheduling import BackgroundCommitter

__all__ = ["METRICS_KEY", "METRIC_NAMES", "ArrowbufEpisodeReplayBuffer", "ArrowbufPrioritizedEpisodeReplayBuffer",
           "BackgroundCommitter", "from_checkpoint_with_buffer", "replay_buffer_config", "save_with_buffer"]
