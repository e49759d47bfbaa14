"""A process's first put, get and sample import nothing heavy on the way (pyarrow's `pa.array` and `to_numpy` look
for pandas objects first, and the first such look in a process imports pandas: 1-2 s of a cold TransferQueue
system's first put, and of every new actor's first sample). Checked in a fresh interpreter, with real Flight
servers: pandas is not imported by the calls arrowbuf makes."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import sys
import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

import arrowbuf as ab
import arrowbuf.compat.transfer_queue as tq
from arrowbuf.compat.transfer_queue.server import TQServer
from arrowbuf.compat.transfer_queue.state import TQState

def check(what):
    if "pandas" in sys.modules:
        print("pandas imported by:", what)
        sys.exit(3)

check("the imports")
state = TQState(capacity=64)
server = TQServer(state)
tq.init({"arrowbuf": {"location": server.location, "shared_memory": False, "ray": False}})
nested = torch.nested.as_nested_tensor([torch.randn(3), torch.randn(5), torch.randn(2), torch.randn(1)],
                                       layout=torch.jagged)
td = TensorDict({"x": torch.randn(4, 8), "i": torch.arange(4), "n": nested,
                 "s": NonTensorStack.from_list(["a", "bb", "c", "d"]), "b": torch.ones(4, 3, dtype=torch.bool),
                 "h": torch.ones(4, 2, dtype=torch.bfloat16)}, batch_size=[4])
keys = [f"k{i}" for i in range(4)]
tq.kv_batch_put(keys=keys, partition_id="p", fields=td)
check("a TransferQueue put over Flight")
out = tq.kv_batch_get(keys=keys, partition_id="p")
dense = {f: torch.stack(list(out[f].unbind())) for f in ("x", "b")}  # (TransferQueue returns them jagged)
assert torch.equal(dense["x"], td["x"]) and torch.equal(dense["b"], td["b"])
assert list(out["s"]) == ["a", "bb", "c", "d"], out["s"]
check("a TransferQueue get over Flight")
tq.close(); server.close(); state.close()

schema = {"fields": {"obs": {"dtype": "float32", "shape": [4]}, "a": {"dtype": "int64"}, "d": {"dtype": "bool"},
                     "t": {"dtype": "int32", "ragged": True}}}
store = ab.ExperienceStore(schema, capacity=100)
store.extend({"obs": np.zeros((10, 4), np.float32), "a": np.arange(10), "d": np.arange(10) % 2 == 0,
              "t": [np.arange(i, dtype=np.int32) for i in range(10)]})
check("extend")
batch = store.sample(4)
batch.to_numpy(); batch.to_torch()
check("sample, to_numpy, to_torch")
with ab.serve(store) as srv:
    remote = ab.connect(srv.location)
    remote.extend({"obs": np.ones((3, 4), np.float32), "a": np.arange(3), "d": np.ones(3, bool),
                   "t": [np.arange(2, dtype=np.int32)] * 3})
    remote.sample(4).to_torch()
    remote.close()
check("a Flight store's extend and sample")
store.close()
print("ok")
"""


def test_first_puts_gets_and_samples_do_not_import_pandas(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "ARROWBUF_SHM_DIR": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])
