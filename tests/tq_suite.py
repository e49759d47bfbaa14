"""TransferQueue 0.1.11's own tests, run from its installed wheel against `arrowbuf.compat.transfer_queue` with only
the import swapped (tests/test_compat_tq_suite.py runs this; it is also a script that prints the counts).

How: the seven public-API test files of the wheel (`FILES`) are copied from the installed `transferqueue`
distribution (nothing is fetched) into a temporary directory and run unmodified by pytest in a child process. With
`target="arrowbuf"` the child's PYTHONPATH starts with a generated package `transfer_queue` whose only content is the
swap: it binds `sys.modules["transfer_queue"]` and the submodules the tests import (`ALIASES`) to arrowbuf's modules.
Ray workers started by the tests inherit that environment, so a `@ray.remote` function that imports
`transfer_queue` gets arrowbuf's too. With `target="transferqueue"` nothing is swapped (the suite on TransferQueue
itself, to confirm it passes there).

The child runs with `RAY_ADDRESS=local` (the tests' `ray.init()` starts a private cluster, never another job's) and
`RAY_OVERRIDE_RESOURCES={"CPU": 8}` (TransferQueue's own actors ask for more CPUs than a 2-core machine has;
arrowbuf's ask for none). Its process group is killed when it ends, so no Ray process outlives it.

    python tests/tq_suite.py [--target arrowbuf|transferqueue] [-k EXPR]   # prints passed/failed/skipped and the
                                                                            # failing tests
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSION = "0.1.11"
#: The wheel's public-API test files (202 tests that pass on TransferQueue on a CPU machine; 2 more skip without CUDA).
FILES = ("tests/test_samplers.py", "tests/test_metadata.py", "tests/test_streaming_dataset.py",
         "tests/e2e/test_kv_interface_e2e.py", "tests/e2e/test_e2e_lifecycle_consistency.py",
         "tests/e2e/test_checkpoint_e2e.py", "tests/e2e/test_ssd_offload_e2e.py")
#: TransferQueue module -> arrowbuf module, for every `transfer_queue...` module the test files import.
ALIASES = {
    "transfer_queue": "arrowbuf.compat.transfer_queue",
    "transfer_queue.metadata": "arrowbuf.compat.transfer_queue.meta",
    "transfer_queue.sampler": "arrowbuf.compat.transfer_queue.samplers",
    "transfer_queue.sampler.base": "arrowbuf.compat.transfer_queue.samplers",
    "transfer_queue.sampler.grpo_group_n_sampler": "arrowbuf.compat.transfer_queue.samplers",
    "transfer_queue.sampler.rank_aware_sampler": "arrowbuf.compat.transfer_queue.samplers",
    "transfer_queue.sampler.seqlen_balanced_sampler": "arrowbuf.compat.transfer_queue.samplers",
    "transfer_queue.sampler.sequential_sampler": "arrowbuf.compat.transfer_queue.samplers",
    "transfer_queue.dataloader": "arrowbuf.compat.transfer_queue.streaming",
    "transfer_queue.dataloader.streaming_dataset": "arrowbuf.compat.transfer_queue.streaming",
}
SWAP = '''"""The import swap of tests/tq_suite.py: `transfer_queue` and the submodules TransferQueue's tests import are
arrowbuf's modules (nothing else)."""
import importlib
import sys

for _name, _target in {aliases!r}.items():
    sys.modules[_name] = importlib.import_module(_target)
'''


@dataclass
class SuiteResult:
    """Outcome per test id (`path::Class::test[param]`): "passed", "failed" (errors included) or "skipped"."""

    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    returncode: int = 0
    output: str = ""

    def ids(self, outcome: str) -> list[str]:
        return sorted(t for t, o in self.outcomes.items() if o == outcome)

    def counts(self) -> dict[str, int]:
        return {o: len(self.ids(o)) for o in ("passed", "failed", "skipped")}


def wheel_files() -> dict[str, pathlib.Path]:
    """The installed wheel's copies of `FILES` (ImportError naming the fix when transferqueue is not installed)."""
    try:
        dist = importlib.metadata.distribution("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"transferqueue=={VERSION} is not installed (its wheel ships the tests this harness runs); "
                          f"run scripts/setup.sh or pip install 'transferqueue=={VERSION}'") from None
    if dist.version != VERSION:
        raise ImportError(f"transferqueue {dist.version} is installed; this harness runs {VERSION}'s tests")
    found = {str(f): pathlib.Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f) in FILES}
    missing = sorted(set(FILES) - set(found))
    if missing:
        raise ImportError(f"the installed transferqueue wheel lacks {missing}")
    return found


def _junit(path: pathlib.Path) -> tuple[dict[str, str], dict[str, str]]:
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file", "")
        module = file[: -len(".py")].replace("/", ".")
        cls = case.get("classname", "")[len(module) + 1:]
        tid = "::".join(p for p in (file, cls, case.get("name", "")) if p)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                messages[tid] = (child.get("message") or "")[:300]
            elif child.tag == "skipped" and outcome != "failed":
                outcome = "skipped"
        outcomes[tid] = outcome
    return outcomes, messages


def run(target: str = "arrowbuf", extra: list[str] | None = None, timeout: float = 1800) -> SuiteResult:
    """Run the suite in a child pytest against `target` ("arrowbuf" or "transferqueue")."""
    if target not in ("arrowbuf", "transferqueue"):
        raise ValueError(f"target is 'arrowbuf' or 'transferqueue', got {target!r}")
    files = wheel_files()
    with tempfile.TemporaryDirectory(prefix="tq-suite-") as tmp:
        work = pathlib.Path(tmp)
        for rel, src in files.items():
            dst = work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        (work / "pytest.ini").write_text("[pytest]\n")  # this directory is the rootdir: no project settings
        path = [str(ROOT)]
        if target == "arrowbuf":
            swap = work / "swap" / "transfer_queue"
            swap.mkdir(parents=True)
            (swap / "__init__.py").write_text(SWAP.format(aliases=ALIASES))
            path.insert(0, str(swap.parent))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p and p != str(ROOT)])
        env.update({"RAY_ADDRESS": "local", "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 8}),
                    "RAY_DEDUP_LOGS": "0"})
        xml = work / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN",
               "--continue-on-collection-errors",  # a module that fails to import fails its tests, not the run
               f"--junitxml={xml}", "-o", "junit_family=xunit1", *(extra or []), *sorted(files)]
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[tq_suite] killed after {timeout:.0f} s"
        finally:
            try:  # whatever the child left in its process group (a Ray worker of a failed teardown)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        result = SuiteResult(returncode=proc.returncode, output=out)
        if xml.exists():
            result.outcomes, result.messages = _junit(xml)
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="arrowbuf", choices=("arrowbuf", "transferqueue"))
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--json", default=None, help="write outcomes and messages to this file")
    p.add_argument("--output", action="store_true", help="print the child's output")
    a = p.parse_args(argv)
    res = run(a.target, ["-k", a.k] if a.k else None)
    if a.output:
        print(res.output)
    for t in res.ids("failed"):
        print(f"FAILED {t}: {res.messages.get(t, '')[:160]}")
    print(json.dumps(res.counts()))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"outcomes": res.outcomes, "messages": res.messages}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
