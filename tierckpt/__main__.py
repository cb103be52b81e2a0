"""``python -m tierckpt``: the ``tierckpt`` command."""

import sys

from tierckpt.cli import main

if __name__ == "__main__":  # not when multiprocessing imports the main module of a parent run with -m
    sys.exit(main())
