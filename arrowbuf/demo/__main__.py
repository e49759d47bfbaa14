"""`python -m arrowbuf.demo`: see `arrowbuf.demo`; `python -m arrowbuf.demo ray ...`: see `arrowbuf.demo.ray_app`."""

import sys

from .app import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["ray"]:
        from .ray_app import main as ray_main

        sys.exit(ray_main(sys.argv[2:]))
    sys.exit(main())
