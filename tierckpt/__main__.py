"""``python -m tierckpt``: the ``tierckpt`` command."""

import sys

from tierckpt.cli import main

sys.exit(main())
