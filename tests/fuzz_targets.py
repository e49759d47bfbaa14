"""The servers tests/test_fuzz_servers.py fuzzes, each in its own process so that its memory is measured alone.

    python tests/fuzz_targets.py flight|tq|inspector|metrics|relay

prints one JSON line (where it serves, and what a test needs to know) and serves until its stdin closes. Every
server binds 127.0.0.1 port 0 and holds small stores, so that what it keeps is bounded by design and any growth of
its memory under fuzzing is what a request made it allocate.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"
GRPO_FIELDS = {"prompt_id": {"dtype": "int64"}, "response_tokens": {"dtype": "int32", "ragged": True},
               "reward": {"dtype": "float32", "later": True}, "done": {"dtype": "bool"},
               "policy_version": {"dtype": "int64"}}


def cartpole(n: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.stack([ids] * 4, axis=1), "action": np.zeros(n, np.int64), "reward": np.ones(n, np.float32),
            "terminated": (np.arange(n) % 10) == 9, "truncated": np.zeros(n, bool),
            "policy_version": np.zeros(n, np.int64), "next_obs": np.stack([ids + 0.5] * 4, axis=1)}


def grpo(n: int, start: int = 0) -> dict:
    k = np.arange(start, start + n)
    return {"prompt_id": k // 4, "response_tokens": [np.arange(1 + i % 5, dtype=np.int32) for i in range(n)],
            "done": np.ones(n, bool), "policy_version": np.zeros(n, np.int64)}


def announce(**info: object) -> None:
    print(json.dumps({"pid": os.getpid(), **info}), flush=True)


def wait_for_stdin() -> None:
    sys.stdin.read()  # until the test closes our stdin


def flight_target() -> None:
    import arrowbuf as ab

    cp = ab.ExperienceStore(SCHEMAS / "cartpole.yaml", capacity=2000, seed=0)
    cp.extend(cartpole(100))
    llm = ab.ExperienceStore({"name": "grpo", "fields": GRPO_FIELDS}, capacity=2000, seed=0, tasks=["ref", "train"])
    llm.extend(grpo(200))
    with tempfile.TemporaryDirectory() as root, ab.serve(
            {"cartpole": cp, "grpo": llm}, checkpoint_root=root, max_batch_rows=256, max_batch_bytes=1 << 20,
            max_n_step=16, max_timeout=0.5, shutdown_timeout=1.0, max_leases_per_client=64,
            sql_limits=ab.SqlLimits(timeout=1.0, memory_limit=64 << 20, max_result_bytes=1 << 20)) as server:
        announce(location=server.location)
        wait_for_stdin()
    cp.close()
    llm.close()


def tq_target() -> None:
    from arrowbuf.compat.transfer_queue.server import TQServer
    from arrowbuf.compat.transfer_queue.state import TQState

    # the shm_* actions too; its shared stores within 32 MiB (under the fuzz tests' bound on growth)
    state = TQState(capacity=512, polling_mode=True, shared_memory=True, shm_budget=32 << 20)
    with TQServer(state, max_partitions=16, max_tasks=8, max_groups=8, max_upload_bytes=1 << 20,
                  max_reply_bytes=1 << 20) as server:
        announce(location=server.location)
        wait_for_stdin()
    state.close()


def inspector_target() -> None:
    import arrowbuf as ab
    from arrowbuf.observe.ui import Inspector
    from arrowbuf.serving.limits import NetLimits

    store = ab.ExperienceStore({"name": "grpo", "fields": GRPO_FIELDS}, capacity=2000, seed=0, tasks=["t"])
    store.extend(grpo(300))
    limits = NetLimits(max_request_bytes=64 << 10, idle_timeout=2.0, request_timeout=10.0)
    with Inspector(store, "127.0.0.1:0", token="tok", interval=0.5, limits=limits) as ins:
        announce(port=ins.port, token="tok")
        wait_for_stdin()
    store.close()


def metrics_target() -> None:
    import arrowbuf as ab
    from arrowbuf.observe.metrics import MetricsEndpoint
    from arrowbuf.serving.limits import NetLimits

    store = ab.ExperienceStore({"name": "grpo", "fields": GRPO_FIELDS}, capacity=2000, seed=0, tasks=["t"])
    store.extend(grpo(300))
    with MetricsEndpoint.start("127.0.0.1:0", stores={"grpo": store},
                               limits=NetLimits(idle_timeout=2.0, request_timeout=10.0)) as endpoint:
        announce(port=endpoint.port)
        wait_for_stdin()
    store.close()


def relay_target() -> None:
    from arrowbuf.ray.hoplite.payload import bucket_digests, combine
    from arrowbuf.ray.hoplite.relay import Relay, _Copy, file_name

    secret = bytes(range(16))
    size, bs = 10_000, 1024
    data = bytes((i * 7) % 251 for i in range(size))
    digests = bucket_digests(memoryview(data), bs)
    meta = {"version": 1, "size": size, "block_size": bs, "nblocks": len(digests), "digests": digests,
            "digest": combine(digests)}
    root = tempfile.mkdtemp(prefix="pt-fuzz-relay-", dir="/dev/shm")

    async def main() -> None:
        relay = Relay("fz", "k", root=root, secret=secret.hex())
        copy = _Copy(meta, file_name("fz", "k", 1), create=True, root=root)  # the node's copy, complete
        copy.mm[:] = data
        copy.have = copy.meta["nblocks"]
        relay.cur = copy
        host, port = await relay.address("127.0.0.1")
        announce(port=port, secret=secret.hex(), size=size, block_size=bs, version=1)
        await asyncio.to_thread(wait_for_stdin)
        await relay.close()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(root, ignore_errors=True)


TARGETS = {"flight": flight_target, "tq": tq_target, "inspector": inspector_target, "metrics": metrics_target,
           "relay": relay_target}

if __name__ == "__main__":
    threading.current_thread().name = f"fuzz-target-{sys.argv[1]}"
    TARGETS[sys.argv[1]]()
