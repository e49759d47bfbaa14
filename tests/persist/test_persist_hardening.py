"""Findings of the adversarial review of persist/ (issue 25): links planted inside a checkpoint root, a checkpoint
that runs out of space, manifests that lie about sizes, name directories or FIFOs, or claim a huge capacity.
Real files, a real Flight server on port 0, a real tmpfs (in a private mount namespace) where the host allows it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pyarrow.flight as flight
import pytest
from conftest import SMALL, make_episodes

import arrowbuf as ab
from arrowbuf.persist import manifest as mf


def _call(location: str, body: dict) -> dict:
    client = flight.FlightClient(location)
    try:
        (result,) = list(client.do_action(flight.Action("checkpoint", json.dumps({"v": 1, **body}).encode())))
        return json.loads(result.body.to_pybytes())
    finally:
        client.close()


@pytest.mark.parametrize("planted", [mf.STATE, mf.RETAINED, mf.MANIFESTS, mf.LOCK, mf.MANIFEST])
def test_checkpoint_action_never_follows_a_link_planted_inside_the_root(tmp_path, planted):
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (victim / "sub").mkdir()
    target = victim if planted in (mf.STATE, mf.RETAINED, mf.MANIFESTS) else victim / "precious.txt"
    os.symlink(target, root / "run" / planted)
    with ab.ExperienceStore(SMALL, capacity=200, seed=0) as store:
        store.extend(make_episodes([50, 30])[0])
        with ab.serve(store, "grpc://127.0.0.1:0", checkpoint_root=root) as server:
            for _ in range(2):  # the second one would run retention over the link's target
                with pytest.raises(flight.FlightError, match="link"):
                    _call(server.location, {"path": "run", "keep": 1})
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt", "sub"]
    assert (victim / "precious.txt").read_text() == "keep me"


def test_a_local_checkpoint_refuses_links_inside_its_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(other, ckpt / mf.STATE)
    with ab.ExperienceStore(SMALL, capacity=200, seed=0) as store:
        store.extend(make_episodes([40])[0])
        with pytest.raises(ab.InvalidArgument, match="symbolic link"):
            store.checkpoint(ckpt)
    assert list(other.iterdir()) == []


def _checkpoint(tmp_path, rows=200):
    ckpt = tmp_path / "ckpt"
    with ab.ExperienceStore(SMALL, capacity=1000, seed=0, chunk_rows=64) as store:
        store.extend(make_episodes([rows])[0])
        store.checkpoint(ckpt)
    return ckpt, mf.read_manifest(str(ckpt))


def _rewrite(ckpt, m):
    m = {k: v for k, v in m.items() if k != "_path"}
    mf.write_json_atomic(str(ckpt / mf.MANIFEST), m)


def test_a_manifest_claiming_a_huge_file_is_store_corrupt_without_reading_it(tmp_path):
    ckpt, m = _checkpoint(tmp_path)
    row = next(e for e in m["files"] if e["kind"] in ("chunk", "tail"))
    row["bytes"] = 2 ** 40
    _rewrite(ckpt, m)
    with pytest.raises(ab.StoreCorrupt, match=row["name"]):
        ab.ExperienceStore.restore(ckpt)
    problems = mf.verify(str(ckpt))
    assert len(problems) == 1 and row["name"] in problems[0]


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_manifest_entry_naming_a_directory_or_fifo_is_refused(tmp_path, kind):
    ckpt, m = _checkpoint(tmp_path)
    row = next(e for e in m["files"] if e["kind"] in ("chunk", "tail"))
    os.unlink(ckpt / row["name"])
    if kind == "directory":
        os.mkdir(ckpt / row["name"])
    else:
        os.mkfifo(ckpt / row["name"])
    problems = mf.verify(str(ckpt))  # no crash, no hang
    assert len(problems) == 1 and "not a regular file" in problems[0]
    with pytest.raises(ab.StoreCorrupt, match="not a regular file"):
        ab.ExperienceStore.restore(ckpt)
    code = "import sys; from arrowbuf.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "checkpoint", "verify", str(ckpt)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 1 and "DAMAGED" in out.stdout, out.stdout + out.stderr


def test_restore_checks_capacity_against_arena_rows_before_allocating(tmp_path):
    ckpt, m = _checkpoint(tmp_path)
    m["store"]["capacity"] = 2 ** 50  # would allocate petabytes before the old check ran
    _rewrite(ckpt, m)
    with pytest.raises(ab.StoreCorrupt, match="capacity"):
        ab.ExperienceStore.restore(ckpt)


_ENOSPC_CHILD = textwrap.dedent("""
    import os, sys, errno
    import numpy as np
    import arrowbuf as ab
    from conftest import SMALL, make_episodes
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    with ab.ExperienceStore(SMALL, capacity=20000, seed=0, chunk_rows=1024) as big:
        big.extend(make_episodes([20000], obs_dim=3)[0])
        try:
            big.checkpoint(d)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        else:
            raise SystemExit("the checkpoint fit: make the store bigger")
    left = sorted(n for n in os.listdir(d) if not n.startswith("_"))
    print("LEFT", left)
    with ab.ExperienceStore(SMALL, capacity=200, seed=0) as small:
        small.extend(make_episodes([100])[0])
        info = small.checkpoint(d)
    with ab.ExperienceStore.restore(d) as again:
        assert len(again) == 100
    print("OK", info["rows"])
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a private tmpfs")
def test_a_checkpoint_that_runs_out_of_space_cleans_up_so_the_next_one_works(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k none {mnt}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.decode()[:200]}")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), tests])}
    script = tmp_path / "child.py"
    script.write_text(_ENOSPC_CHILD)
    cmd = f"mount -t tmpfs -o size=256k none {mnt} && exec {sys.executable} {script} {mnt}/ckpt"
    out = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LEFT []" in out.stdout and "OK 100" in out.stdout
