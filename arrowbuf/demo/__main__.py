"""`python -m arrowbuf.demo`: see `arrowbuf.demo`; `python -m arrowbuf.demo grpo`: see `arrowbuf.demo.grpo_app`;
`python -m arrowbuf.demo ray`: see `arrowbuf.demo.ray_app`."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["grpo"]:
        from .grpo_app import main as grpo_main

        sys.exit(grpo_main(sys.argv[2:]))
    if sys.argv[1:2] == ["ray"]:
        from .ray_app import main as ray_main

        sys.exit(ray_main(sys.argv[2:]))
    from .app import main

    sys.exit(main())
