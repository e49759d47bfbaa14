"""docs/integrations.md runs: every python block, in order and in one namespace, from a temporary directory. The
RLlib block is marked `ray` (the wheel check runs it with the [ray] extra); it runs here when ray is installed. The verl
block needs verl (not installed in CI) and is the only one left out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import docs_blocks  # noqa: E402

PAGE = ROOT / "docs" / "integrations.md"

RUNNER = """
import sys
sys.path.insert(0, {scripts!r})
import docs_blocks
ns = {{"__name__": "__main__"}}
for b in docs_blocks.extract({page!r}):
    if b.lang != "python" or (b.skip and "verl" in b.skip):
        continue
    if b.ray is not None and {with_ray} is False:
        continue
    exec(compile(b.code, f"{{b.path}}:{{b.line}}", "exec"), ns)
print("ran", flush=True)
"""


@pytest.mark.slow
def test_the_integrations_page_runs(tmp_path):
    pytest.importorskip("torchrl")
    pytest.importorskip("tensordict")
    try:
        import ray.rllib  # noqa: F401

        with_ray = True
    except ImportError:
        with_ray = False
    code = RUNNER.format(scripts=str(ROOT / "scripts"), page=str(PAGE), with_ray=with_ray)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ran" in r.stdout, r.stderr[-4000:]


def test_every_block_of_the_page_is_marked():
    blocks = docs_blocks.extract(str(PAGE))
    skipped = [b for b in blocks if b.skip]
    assert {("verl" in b.skip) or ("ray" in b.skip) for b in skipped} == {True}
    assert sum(b.lang == "python" and not b.skip for b in blocks) >= 4
