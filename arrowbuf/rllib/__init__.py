"""RLlib replay buffers backed by arrowbuf (see `arrowbuf.rllib.buffers` and docs/rllib.md)."""

from .buffers import ArrowbufEpisodeReplayBuffer, ArrowbufPrioritizedEpisodeReplayBuffer, replay_buffer_config

__all__ = ["ArrowbufEpisodeReplayBuffer", "ArrowbufPrioritizedEpisodeReplayBuffer", "replay_buffer_config"]
