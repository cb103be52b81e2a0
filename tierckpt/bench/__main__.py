"""``python -m tierckpt.bench [options]``: the same as ``tierckpt bench``."""

import sys

from tierckpt.bench.runner import main

sys.exit(main())
