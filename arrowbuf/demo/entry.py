"""The command-line entry shared by the demos: SIGTERM unwinds like Ctrl-C, so workers stop and servers close."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


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


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
