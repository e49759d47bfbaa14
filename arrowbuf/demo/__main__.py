"""`python -m arrowbuf.demo`: see `arrowbuf.demo`; `python -m arrowbuf.demo grpo`: see `arrowbuf.demo.grpo_app`."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["grpo"]:
        from .grpo_app import main as grpo_main

        sys.exit(grpo_main(sys.argv[2:]))
    from .app import main

    sys.exit(main())
