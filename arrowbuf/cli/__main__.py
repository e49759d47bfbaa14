"""`python -m arrowbuf.cli ...` (the `arrowbuf` command)."""

import sys

from . import main

sys.exit(main())
