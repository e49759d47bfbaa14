"""The crash harness with the store in a server process (`ab.serve`) and the writers, updater and consumers as
Flight clients in another: the server process is SIGKILLed, at random and during checkpoints (`crash.harness`)."""

from __future__ import annotations

import pytest

from crash import harness as h

pytestmark = pytest.mark.slow

#: the ragged variant under each policy; the long variant adds fixed-size rows over Flight (each DoPut a batch of up
#: to 2 MB, the directory in /dev/shm), which the CI runs in process only
RUNS = [(p, "ragged") for p in ("group", "batch", "os")] + ([(p, "fixed") for p in ("group", "os")] if h.LONG else [])


@pytest.mark.parametrize("policy,variant", RUNS)
def test_served_kills(tmp_path, policy, variant):
    r = h.KillRun(str(tmp_path), "served", policy, variant, kills=h.pick(3, h.LONG_SERVED_KILLS),
                  fs="tmpfs" if variant == "fixed" else "disk").run()
    h.assert_clean(r)
