"""RLlib buffer state by checkpoint reference (issue 15): get_state writes a checkpoint, set_state restores it."""

from __future__ import annotations

import numpy as np
import pytest

# Ray clusters, demo runs and processes: the developer loop (-m 'not slow') leaves these to CI
pytestmark = pytest.mark.slow

pytest.importorskip("ray.rllib")

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402

from arrowbuf.rllib import ArrowbufPrioritizedEpisodeReplayBuffer  # noqa: E402


def _episodes(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out, g = [], 0
    for n in lengths:
        obs = [np.full(4, g + i, np.float32) for i in range(n + 1)]
        out.append(SingleAgentEpisode(observations=obs, actions=list(rng.integers(0, 2, n)),
                                      rewards=list(rng.normal(size=n)), terminated=True, len_lookback_buffer=0))
        g += n + 1
    return out


def test_buffer_state_round_trips_the_experience_by_checkpoint(tmp_path):
    buf = ArrowbufPrioritizedEpisodeReplayBuffer(1000, checkpoint_dir=tmp_path / "buf", seed=0)
    try:
        buf.add(_episodes([30, 50, 20]))
        buf.sample(num_items=16)
        buf.update_priorities(np.linspace(0.1, 3.0, 16))
        state = buf.get_state()
        assert state["checkpoint"]["generation"] == 1 and state["added"] == 100
        again = ArrowbufPrioritizedEpisodeReplayBuffer(1000, seed=0)
        again.set_state(state)
        try:
            assert len(again) == len(buf) == 100
            assert again.store.to_table().equals(buf.store.to_table())
            assert again.store.stats()["priority_sum"] == buf.store.stats()["priority_sum"]
            a, b = buf.store.sample(32), again.store.sample(32)
            np.testing.assert_array_equal(a.indices, b.indices)
            assert len(again.sample(num_items=8)) == 8
        finally:
            again.store.close()
    finally:
        buf.store.close()


def test_dqn_save_and_from_checkpoint_resume_with_a_full_buffer(tmp_path, ray_cluster):
    pytest.importorskip("gymnasium")
    from ray.rllib.algorithms.dqn import DQNConfig

    from arrowbuf.rllib import from_checkpoint_with_buffer, replay_buffer_config, save_with_buffer

    algo = again = None
    try:
        config = (DQNConfig().environment("CartPole-v1")
                  .env_runners(num_env_runners=0, rollout_fragment_length=32)
                  .learners(num_learners=0)
                  .reporting(min_sample_timesteps_per_iteration=32, min_time_s_per_iteration=0)
                  .debugging(seed=0)
                  .training(replay_buffer_config=replay_buffer_config(capacity=5000, prioritized=True, seed=0),
                            num_steps_sampled_before_learning_starts=64, train_batch_size=32))
        algo = config.build_algo()
        for _ in range(3):
            algo.train()
        rows = len(algo.local_replay_buffer)
        assert rows > 64
        want = algo.local_replay_buffer.store.to_table()
        save_with_buffer(algo, tmp_path / "algo")
        again = from_checkpoint_with_buffer(tmp_path / "algo")
        assert len(again.local_replay_buffer) == rows  # resumes with a full buffer
        assert again.local_replay_buffer.store.to_table().equals(want)
        again.train()  # and trains on
        assert len(again.local_replay_buffer) > rows
    finally:
        for a in (algo, again):
            if a is not None:
                buf = a.local_replay_buffer
                a.stop()
                buf.close()
                if getattr(buf, "store", None) is not None:
                    buf.store.close()
