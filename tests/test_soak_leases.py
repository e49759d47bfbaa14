"""Soak (issue 25, leases half): writer processes over Flight, a reference stage that fills later fields under
leases, trainer processes that consume under leases, and `kill -9` of any of them at random times. Afterwards every
row is acknowledged exactly once per task (recorded where consumption becomes final: the store's final hooks), every
row the trainers saw was complete and correct, and the rows of killed consumers were delivered again.

Bounded for CI (`ARROWBUF_SOAK_S`, default 6 s of kills, and on until the kills and the expired lease asserted below
happened; about half a minute in all); the long variant: `ARROWBUF_SOAK_S=600 pytest tests/test_soak_leases.py -m slow`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

import arrowbuf as ab

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("ARROWBUF_SOAK_S", "6"))
SCHEMA = {"name": "soak", "fields": {
    "prompt_id": {"dtype": "int64"},
    "response": {"dtype": "int32", "ragged": True},
    "reward": {"dtype": "float32", "later": True},
    "ref_logprobs": {"dtype": "float32", "ragged": True, "later": True},
}}

WRITER = r"""
import json, sys, time, numpy as np, arrowbuf as ab
location, wid = sys.argv[1], int(sys.argv[2])
k = 0
with ab.connect(location) as remote:
    while True:
        p = wid * 10**9 + np.arange(k, k + 16)
        ids = remote.extend({"prompt_id": p, "response": [np.arange(int(x) % 7 + 1, dtype=np.int32) for x in p]},
                            timeout=30)
        print(json.dumps({"written": ids.tolist(), "prompts": p.tolist()}), flush=True)  # acknowledged
        k += 16
        time.sleep(0.02)
"""

REF = r"""
import random, sys, time, numpy as np, arrowbuf as ab
location, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
with ab.connect(location) as remote:
    while True:
        b = remote.consume("ref", rng.randint(8, 48), lease=1.5, timeout=0.2)
        if not len(b):
            continue
        p = b.to_numpy()["prompt_id"]
        resp = b.to_numpy()["response"]
        time.sleep(rng.random() * 0.1)  # computing the reference log-probs: killed here, or not
        remote.update(b.indices, {"reward": (p % 1000).astype(np.float32) * 0.5,   # idempotent: same values again
                                  "ref_logprobs": [np.full(len(r), -float(x % 1000), np.float32)
                                                   for r, x in zip(resp, p)]})
        try:
            b.ack()
        except ab.LeaseError:
            pass  # too slow: the rows went back; the update is idempotent
"""

TRAINER = r"""
import json, random, sys, time, numpy as np, arrowbuf as ab
location, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
with ab.connect(location) as remote:
    while True:
        b = remote.consume("train", rng.randint(8, 64), require=["reward", "ref_logprobs"], lease=1.5, timeout=0.2)
        if not len(b):
            continue
        d = b.to_numpy()
        bad = [int(i) for i, p, r, resp, lp in zip(b.indices, d["prompt_id"], d["reward"], d["response"],
                                                    d["ref_logprobs"])
               if r != (p % 1000) * 0.5 or len(lp) != len(resp) or len(resp) != p % 7 + 1
               or not (lp == -float(p % 1000)).all()]
        if bad:
            print(json.dumps({"bad": bad}), flush=True)
        time.sleep(rng.random() * 0.1)  # training on it: killed here, or not
        try:
            b.ack()
        except ab.LeaseError:
            continue  # too slow: the rows went back and are delivered again
        print(json.dumps({"acked": b.indices.tolist()}), flush=True)
"""


def test_leases_soak_with_random_kills(procs):
    rng = random.Random(0)
    finals: dict[str, list[np.ndarray]] = {"ref": [], "train": []}
    lock = threading.Lock()

    hows: set[str] = set()

    def record(task, seqs, how):  # under the store's lock, where consumption becomes final
        with lock:
            hows.add(how)
            finals[task].append(seqs.copy())

    with ab.ExperienceStore(SCHEMA, capacity=1 << 17, tasks=["ref", "train"]) as store, ab.serve(store) as server:
        store._consume.final_hooks.append(record)
        loc = server.location
        kinds = {"writer": WRITER, "ref": REF, "trainer": TRAINER}
        running: dict[str, list] = {"writer": [], "ref": [], "trainer": []}
        outputs: list[bytes] = []
        seeds = iter(range(1, 10**6))

        def start(kind, arg=None):
            p = procs([sys.executable, "-c", kinds[kind], loc, str(next(seeds) if arg is None else arg)])
            running[kind].append(p)
            return p

        for w in range(2):
            start("writer", w)
        start("ref")
        start("trainer")
        start("trainer")
        kills = {"writer": 0, "ref": 0, "trainer": 0}
        end = time.monotonic() + SOAK_S
        writer_ids = iter(range(2, 10**6))

        def short_of_events() -> bool:  # what is asserted below: 3 kills, and a killed consumer's lease expired
            expired = sum(store.stats()["leases_expired"].values())
            return sum(kills.values()) < 3 or (kills["ref"] + kills["trainer"] > 0 and expired < 1)

        # past SOAK_S only while short of those (a consumer killed while it still started held no lease), up to 60 s
        while time.monotonic() < end or (short_of_events() and time.monotonic() < end + 60):
            time.sleep(rng.uniform(1.0, 3.0))
            kind = rng.choice(["writer", "ref", "trainer", "trainer"])
            victim = running[kind].pop(rng.randrange(len(running[kind])))
            os.kill(victim.pid, signal.SIGKILL)
            kills[kind] += 1
            out, _ = victim.communicate(timeout=30)
            outputs.append(out)
            start(kind, next(writer_ids) if kind == "writer" else None)
        for p in running["writer"]:  # the writers stop; the consumers drain what is left
            p.send_signal(signal.SIGKILL)
            out, _ = p.communicate(timeout=30)
            outputs.append(out)
        total = len(store)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = store.stats()
            if st["consumed"]["ref"] == total and st["consumed"]["train"] == total:
                break
            time.sleep(0.5)
        for kind in ("ref", "trainer"):
            for p in running[kind]:
                p.send_signal(signal.SIGKILL)
                out, _ = p.communicate(timeout=30)
                outputs.append(out)
        st = store.stats()
        table = store.to_table(["seq", "prompt_id", "response", "reward", "ref_logprobs"])
        ids = table.column("seq").to_numpy()

    lines = [json.loads(line) for out in outputs for line in out.decode().splitlines() if line.strip()]
    bad = [x["bad"] for x in lines if "bad" in x]
    seen = np.concatenate([np.asarray(x["acked"], dtype=np.int64) for x in lines if "acked" in x] or [[]])
    written = {i: p for x in lines if "written" in x for i, p in zip(x["written"], x["prompts"])}
    print(f"\nsoak {SOAK_S:.0f}s: {total} rows ({len(written)} acknowledged to writers), kills {kills}, "
          f"redelivered {st['redelivered']}, leases expired {st['leases_expired']}, rows the trainers acked "
          f"{len(seen)} (distinct {len(np.unique(seen))})")
    # every row a writer had acknowledged is there, exactly as written, with the fields the reference stage filled
    rows = table.to_pydict()
    by_id = {i: k for k, i in enumerate(rows["seq"])}
    assert written and set(written) <= set(by_id)
    for i, k in by_id.items():
        p = rows["prompt_id"][k]
        assert written.get(i, p) == p and rows["response"][k] == list(range(p % 7 + 1))
        assert rows["reward"][k] == (p % 1000) * 0.5 and rows["ref_logprobs"][k] == [-float(p % 1000)] * (p % 7 + 1)
    assert hows == {"acked"}  # every consume here is leased: nothing is final but an ack
    assert not bad, bad[:3]  # every row a trainer saw was complete and exactly as written and updated
    assert total > 0 and len(ids) == total and sum(kills.values()) >= 3
    assert len(seen) == len(np.unique(seen))  # what the surviving trainers' acks say agrees: none acked twice
    for task in ("ref", "train"):
        acked = np.sort(np.concatenate(finals[task]))
        np.testing.assert_array_equal(acked, np.sort(ids), err_msg=f"task {task}: each row acked exactly once")
        assert st["in_flight"][task] == 0
    killed_consumers = kills["ref"] + kills["trainer"]
    if killed_consumers:  # a consumer spends most of its time holding a lease: a kill leaves one to expire
        assert sum(st["leases_expired"].values()) >= 1
        assert sum(st["redelivered"].values()) >= 1
