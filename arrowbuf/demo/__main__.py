"""`python -m arrowbuf.demo [dqn|grpo|ray] [flags]`: the demos (`arrowbuf.demo.entry.DEMOS`); without a name, dqn."""

import sys

from .entry import dispatch

if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
