"""What a large sample costs its reader beyond the batch itself: the sample comes in bounded parts copied into a
reused output as they arrive, so a repeated sample of 96 MB raises the reader's resident memory by a fraction of
the payload, not by another copy of it (64 MiB parts did: a sample under one part came as one message, held twice
while it arrived; and gRPC read far ahead of the reader).

A real server on 127.0.0.1:0 in this process; the reader in a child process, so its peak resident memory
(VmHWM, reset through /proc/self/clear_refs) is its own. Linux only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import arrowbuf as ab

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")

ROWS, WIDTH = 768, 32768  # 768 rows of 128 KB: 96 MiB per sample of every row
SCHEMA = {"name": "wide", "fields": {"x": {"dtype": "float32", "shape": [WIDTH]}, "done": {"dtype": "bool"}}}

READER = textwrap.dedent("""
    import json, sys
    import arrowbuf as ab

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    remote = ab.connect(sys.argv[1], timeout=60.0)
    n = int(sys.argv[2])
    growth = []
    for i in range(4):
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        batch = remote.sample(n)
        x = batch["x"]
        ok = bool((x[:, 0] == batch.indices.astype("float32")).all())
        growth.append(status("VmHWM") - before)
        del batch, x
        if not ok:
            growth.append(-1)
            break
    remote.close()
    print(json.dumps(growth))
""")


def test_a_repeated_large_sample_costs_the_reader_a_fraction_of_the_payload(tmp_path):
    store = ab.ExperienceStore(ab.load_schema(SCHEMA), capacity=ROWS, sampler="uniform", seed=0)
    x = np.zeros((ROWS, WIDTH), np.float32)
    x[:, 0] = np.arange(ROWS, dtype=np.float32)
    server = ab.serve(store, max_batch_rows=ROWS, shutdown_timeout=2.0)
    script = tmp_path / "reader.py"
    script.write_text(READER)
    store.extend({"x": x, "done": np.ones(ROWS, bool)})
    try:
        proc = subprocess.run([sys.executable, str(script), server.location, str(ROWS)], capture_output=True,
                              text=True, timeout=120)
    finally:
        server.close()
        store.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    assert -1 not in growth, "a sample brought the wrong rows"
    payload = ROWS * WIDTH * 4
    # the first sample allocates the output the later ones reuse; each later one adds transient parts only
    # (measured: 0.35-0.72x with 8 MiB parts; 1.4-1.8x with 64 MiB parts and gRPC's growing window)
    assert max(growth[1:]) < payload, [f"{g / payload:.2f}x" for g in growth]
