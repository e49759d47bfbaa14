"""The end-to-end demo: distributed DQN on CartPole-v1 with arrowbuf in the middle.

    python -m arrowbuf.demo [--actors 3] [--steps 15000] [--transport flight|shm|local] [--seed 0] [--out DIR]

What runs (all on this machine, nothing started by hand):

* the store: an `ExperienceStore` with prioritized replay (`ab.samplers.Prioritized`) and a sample-to-insert rate
  limiter, served over Arrow Flight by the main process (`--transport flight`, default), or created in shared memory
  (`shm`), or kept in-process (`local`: actors are threads);
* actors: `--actors` processes (multiprocessing, spawn) each play CartPole-v1 with an epsilon-greedy torch policy and
  write their steps to the store (`ab.connect(location).extend`, or `ExperienceStore.attach(name).extend`);
* the learner (main process): double DQN with 3-step returns, reading batches through `ab.Loader` (prefetching in
  the background) and sending new priorities back with `loader.update_priorities`;
* policy weights go back to the actors through a file: the learner writes `policy.pt` (weights and version) to a
  temporary name and `os.replace`s it into place, so an actor never reads half a file; actors reload when the file
  changes;
* a progress line (tqdm when installed), an episode-return summary from `store.sql` at the end, and a PNG of the
  returns over time in `--out`.

The DQN pieces (`DQNConfig`, `QNetwork`, `DQNLearner`, `epsilon_at`) are reused by `benchmarks/parity.py`.

The package: `dqn` (the DQN pieces), `actors` (actor processes and the policy file), `app` (the run, its command line).
"""

from __future__ import annotations

from .actors import ActorSpec, PolicyFile, actor_main
from .app import LEARNER_COLUMNS, TRANSPORTS, DemoResult, cartpole_schema, configure_parser, main, run, run_from_args
from .dqn import DQNConfig, DQNLearner, EpsilonGreedy, epsilon_at, make_env, make_qnetwork

__all__ = ["LEARNER_COLUMNS", "TRANSPORTS", "ActorSpec", "DQNConfig", "DQNLearner", "DemoResult", "EpsilonGreedy",
           "PolicyFile", "actor_main", "cartpole_schema", "configure_parser", "epsilon_at", "main", "make_env",
           "make_qnetwork", "run", "run_from_args"]
