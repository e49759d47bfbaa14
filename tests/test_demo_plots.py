"""The demos' plots (issue 44): the GRPO reward plot ticks whole policy versions only; the DQN returns plot spreads
episodes over environment steps from 0, so a slow start-up (a loaded machine) cannot bunch them at one side."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("torch")

from arrowbuf.demo.app import returns_figure  # noqa: E402
from arrowbuf.demo.grpo_app import reward_figure  # noqa: E402


def test_grpo_plot_ticks_whole_policy_versions():
    import matplotlib.pyplot as plt

    for n in (3, 9, 10, 200):  # ten versions gave ticks at 2.5 and 7.5
        fig = reward_figure({"policy_version": list(range(n)), "mean_reward": list(np.linspace(0.2, 0.6, n)),
                             "completions": [8] * n})
        try:
            fig.canvas.draw()
            ticks = fig.axes[0].get_xticks()
            assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
        finally:
            plt.close(fig)


def test_dqn_plot_spreads_episodes_over_environment_steps():
    import matplotlib.pyplot as plt

    # a loaded start: the actors' first episode ends 60 s after the start, the rest within 10 s of it
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, 100)
    episodes = [{"actor": i % 3, "return": float(n), "length": int(n), "t": 60.0 + i * 0.1,
                 "policy_version": 0} for i, n in enumerate(lengths)]
    fig = returns_figure(episodes, "DQN", learn_step=500)
    try:
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        assert lo == 0 and int(lengths.sum()) <= hi <= 1.05 * lengths.sum()
        assert "environment steps" in ax.get_xlabel()
        xs = ax.collections[0].get_offsets()[:, 0]
        np.testing.assert_array_equal(xs, np.cumsum(lengths))  # each episode where the steps were done
        assert ax.lines[-1].get_xdata()[0] == 500  # the first gradient step, in steps too
    finally:
        plt.close(fig)
