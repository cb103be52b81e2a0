"""``python -m tierckpt.bench [options]``: the same as ``tierckpt bench``."""

import sys

from tierckpt.bench.runner import main

if __name__ == "__main__":  # not when the restart benchmark's forkserver children import the main module
    sys.exit(main())
