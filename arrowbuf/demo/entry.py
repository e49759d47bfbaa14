"""The command-line entry shared by the demos: which demo runs (`dispatch`), and SIGTERM unwinding like Ctrl-C, so
workers stop and servers close (`run_cli`)."""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from ..flight.client import RemoteStore
    from ..store.facade import ExperienceStore

T = TypeVar("T")

#: A demo's worker: a process (flight, shm) or a thread (`--transport local`).
Worker: TypeAlias = "threading.Thread | BaseProcess"
#: The store a demo's worker writes and reads: the store itself (local), attached (shm) or over Flight.
DemoStore: TypeAlias = "ExperienceStore | RemoteStore"


class StopFlag(Protocol):
    """When the workers stop: a `threading.Event` or a multiprocessing one."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...


class Mailbox(Protocol[T]):
    """Messages from the workers: a `queue.Queue` or a multiprocessing one."""

    def put(self, item: T, /) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> T: ...

    def get_nowait(self) -> T: ...

    def empty(self) -> bool: ...

#: The demos: name -> (module with `main(argv, prog)`, one line on what it runs). The first is the default.
DEMOS: dict[str, tuple[str, str]] = {
    "dqn": ("arrowbuf.demo.app", "distributed DQN on CartPole-v1: actor processes, a Flight-served store, a learner "
                                 "(the default)"),
    "grpo": ("arrowbuf.demo.grpo_app", "GRPO, LLM post-training style: rollout, reward and reference workers, a "
                                       "trainer consuming whole groups"),
    "ray": ("arrowbuf.demo.ray_app", "the DQN demo on Ray: Ray actors, a ShardedStore, weights by broadcast "
                                     "(needs arrowbuf[ray])"),
}


def demos_epilog(prog: str = "python -m arrowbuf.demo") -> str:
    """The list of demos, for every demo's --help (an argparse epilog; use RawDescriptionHelpFormatter)."""
    lines = [f"demos ({prog} <demo> --help for each one's flags):"]
    lines += [f"  {name:<5} {what}" for name, (_, what) in DEMOS.items()]
    return "\n".join(lines)


def dispatch(argv: Sequence[str] | None = None, prog: str = "python -m arrowbuf.demo") -> int:
    """Run the demo named by the first argument (dqn, grpo, ray; none: dqn) with the remaining arguments.

    Args:
        argv: the arguments after `prog`, e.g. ["grpo", "--steps", "20"]; None reads sys.argv.
        prog: how the user called it, for usage lines (`arrowbuf demo` or `python -m arrowbuf.demo`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    name, shown = "dqn", "[dqn]"  # no demo named: the default, shown as optional in the usage line
    if args and args[0] in DEMOS:
        name = shown = args.pop(0)
    elif args and not args[0].startswith("-"):
        print(f"{prog}: there is no demo {args[0]!r}; the demos are {', '.join(DEMOS)} "
              f"(run {prog} --help for the list)", file=sys.stderr)
        return 2
    module = importlib.import_module(DEMOS[name][0])
    return int(module.main(args, prog=f"{prog} {shown}"))


def start_quietly(worker: Worker) -> None:
    """Start a worker process (or thread) that ignores Ctrl-C: a child spawned while SIGINT is ignored keeps
    ignoring it, so Ctrl-C reaches the main process only, which stops the workers itself (a Ctrl-C in every
    child printed a traceback per child). Threads start as they are."""
    if not hasattr(worker, "pid") or threading.current_thread() is not threading.main_thread():
        worker.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def run_cli(run: Callable[[], int], stopped: str) -> int:
    """Run `run()` with SIGTERM turned into an exception (main thread only); Ctrl-C prints `stopped` and gives 130.

    Args:
        run: the demo's body; its return value is the exit code.
        stopped: what was shut down on the way out, e.g. "actors stopped, server and store closed".
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run()
    except KeyboardInterrupt:
        print(f"\ninterrupted: {stopped}", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
