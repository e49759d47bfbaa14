"""The power-loss model (`crash.powerloss`): every file call of the journal and checkpoints mirrored into a shadow
file system; the images a power cut would leave (model A: unsynced data and directory entries lost; model B:
directory operations durable at once) restored and checked. Each run is a process of its own (it wraps `os`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from crash import harness as h

pytestmark = pytest.mark.slow


def run_model(tmp_path, policy: str, variant: str, ckpt: bool, ops: int, max_images: int) -> dict:
    out = tmp_path / "result.json"
    config = {"policy": policy, "variant": variant, "ckpt": ckpt, "ops": ops, "seed": 1, "dir": str(tmp_path),
              "out": str(out), "max_images": max_images}
    proc = subprocess.run([sys.executable, "-m", "crash.powerloss", json.dumps(config)], cwd=h.ROOT,
                          env=h.child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("ckpt", [True, False], ids=["checkpoints", "no-checkpoints"])
@pytest.mark.parametrize("policy", ["group", "batch", "os"])
def test_powerloss_ragged(tmp_path, policy, ckpt):
    r = h.record_powerloss(run_model(tmp_path, policy, "ragged", ckpt, ops=h.pick(40, 120),
                                     max_images=h.pick(60, 400)))
    h.assert_clean(r)


@pytest.mark.parametrize("policy", ["group", "os"])
def test_powerloss_fixed_direct_io(tmp_path, policy):
    """Batches of 0.25-2 MB: the journal writes the larger ones with direct I/O (`os.pwrite` from its staging
    buffer, `arrowbuf.persist.appender`) where the filesystem allows it."""
    r = h.record_powerloss(run_model(tmp_path, policy, "fixed", True, ops=h.pick(20, 60),
                                     max_images=h.pick(40, 300)))
    h.assert_clean(r)
