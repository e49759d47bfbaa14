"""The crash harness with the store in a server process (`ab.serve`) and the writers, updater and consumers as
Flight clients in another: the server process is SIGKILLed, at random and during checkpoints (`crash.harness`)."""

from __future__ import annotations

import pytest

from crash import harness as h

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["group", "batch", "os"])
def test_served_kills(tmp_path, policy):
    r = h.KillRun(str(tmp_path), "served", policy, "ragged", kills=h.pick(3, h.LONG_SERVED_KILLS)).run()
    h.assert_clean(r)
