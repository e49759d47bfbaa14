"""The demo's actors: each plays CartPole and writes its steps to the store; weights arrive through a policy file."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InsertTimeout, require
from .dqn import DQNConfig, EpsilonGreedy, epsilon_at, make_env
from .entry import DemoStore, Mailbox, StopFlag


# ---------------------------------------------------------------------------------------------------------- weights
class PolicyFile:
    """Policy weights from the learner to the actors through one file: written to a temporary name in the same
    directory and `os.replace`d into place (atomic on POSIX), so a reader sees the old or the new file, never half."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self._seen: tuple[int, int] | None = None

    def publish(self, state_dict: dict[str, Any], version: int) -> None:
        torch = require("torch", "demo")
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".policy-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save({"version": int(version), "state_dict": state_dict}, fh)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def poll(self) -> tuple[int, dict[str, Any]] | None:
        """(version, state_dict) when the file changed since the last poll, else None."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._seen:
            return None
        torch = require("torch", "demo")
        with open(self.path, "rb") as fh:  # the inode we opened stays whole even if the learner replaces the name
            blob = torch.load(fh, weights_only=True)
        self._seen = key
        return int(blob["version"]), blob["state_dict"]


# ---------------------------------------------------------------------------------------------------------- actors
@dataclasses.dataclass
class ActorSpec:
    actor_id: int
    transport: str
    address: str              # Flight location or shared-memory store name ("" for local)
    steps: int                # environment steps this actor plays
    seed: int
    policy_path: str
    cfg: DQNConfig
    flush: int = 32           # steps per write (an episode end also flushes)
    poll_every: int = 50      # steps between policy-file checks


def _open_store(spec: ActorSpec, local_store: DemoStore | None) -> tuple[DemoStore, Callable[[], None]]:
    if spec.transport == "local":
        assert local_store is not None, "an actor thread is given the store"
        return local_store, lambda: None
    if spec.transport == "flight":
        from ..flight import connect

        client = connect(spec.address)
        return client, client.close
    from ..store.facade import ExperienceStore

    shared = ExperienceStore.attach(spec.address, timeout=30.0)
    return shared, shared.close


def actor_main(spec: ActorSpec, events: Mailbox[tuple[Any, ...]], stop: StopFlag,
               local_store: DemoStore | None = None) -> None:
    """One actor: play `spec.steps` CartPole steps, write them in pieces of `spec.flush`, report episodes on `events`.

    Runs as a spawned process (flight, shm) or a thread (local). Puts ("episode", actor, return, length, time,
    policy_version), then ("done", actor, steps) or ("error", actor, message) on `events`.
    """
    try:
        torch = require("torch", "demo")
        if spec.transport != "local":
            torch.set_num_threads(1)
        store, close = _open_store(spec, local_store)
        try:
            _play(spec, store, events, stop)
        finally:
            close()
    except BaseException as exc:  # report, never hang the learner waiting for a dead actor
        events.put(("error", spec.actor_id, f"{type(exc).__name__}: {exc}"))
        raise
    events.put(("done", spec.actor_id, spec.steps))


def _play(spec: ActorSpec, store: DemoStore, events: Mailbox[tuple[Any, ...]], stop: StopFlag) -> None:
    cfg = spec.cfg
    env = make_env(spec.seed)
    policy = EpsilonGreedy(cfg, seed=spec.seed)
    weights = PolicyFile(spec.policy_path)
    version = 0
    obs, _ = env.reset(seed=spec.seed)
    cols: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated", "next_obs")}
    versions: list[int] = []
    ep_return, ep_len = 0.0, 0

    def flush() -> None:
        if not versions:
            return
        n = len(versions)
        batch = {"obs": np.asarray(cols["obs"], np.float32), "action": np.asarray(cols["action"], np.int64),
                 "reward": np.asarray(cols["reward"], np.float32),
                 "terminated": np.asarray(cols["terminated"], bool), "truncated": np.asarray(cols["truncated"], bool),
                 "next_obs": np.asarray(cols["next_obs"], np.float32),
                 "policy_version": np.asarray(versions, np.int64), "actor": np.full(n, spec.actor_id, np.int64)}
        while True:  # a rate limiter may hold the insert back while the learner catches up
            try:
                store.extend(batch, timeout=1.0)
                break
            except InsertTimeout:
                if stop.is_set():
                    return
        for v in cols.values():
            v.clear()
        versions.clear()

    for t in range(spec.steps):
        if stop.is_set():
            break
        if t % spec.poll_every == 0:
            got = weights.poll()
            if got is not None:
                version, state = got
                policy.load_state_dict(state)
        action = policy.act(obs, epsilon_at(cfg, t / spec.steps))
        nxt, reward, term, trunc, _ = env.step(action)
        for k, v in (("obs", obs), ("action", action), ("reward", reward), ("terminated", term),
                     ("truncated", trunc), ("next_obs", nxt)):
            cols[k].append(v)
        versions.append(version)
        ep_return += float(reward)
        ep_len += 1
        if term or trunc:
            flush()
            events.put(("episode", spec.actor_id, ep_return, ep_len, time.time(), version))
            ep_return, ep_len = 0.0, 0
            obs, _ = env.reset()
        else:
            obs = nxt
            if len(versions) >= spec.flush:
                flush()
    flush()
    env.close()
