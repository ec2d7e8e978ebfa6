"""The `flashgen` command, run from a checkout: `python cli.py --help`.

The click app lives in flashgen/cli.py, so the installed package carries it without a top-level
module of this generic name; the `flashgen` console script calls the same `main`.
"""

from flashgen.cli import main

if __name__ == "__main__":
    main()
