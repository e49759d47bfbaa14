"""The crash harness on a durable Ray shard (`crash.harness.run_ray`): its actor process SIGKILLed while threads
write, update and consume through their handles and checkpoints run; on the session's local Ray cluster."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from crash import harness as h  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["group"] + (["batch", "os"] if h.LONG else []))
def test_durable_shard_kills(ray_cluster, tmp_path, policy):
    r = h.run_ray(str(tmp_path), policy, kills=h.pick(3, h.LONG_RAY_KILLS))
    assert r.kills == h.pick(3, h.LONG_RAY_KILLS)
    h.assert_clean(r)
