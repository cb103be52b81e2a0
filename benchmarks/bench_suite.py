"""The benchmark suite from a source checkout: the same as ``tierckpt bench`` (see docs/benchmarks.md).

Usage::

    python benchmarks/bench_suite.py --quick          # every peer on small states, under 3 minutes
    python benchmarks/bench_suite.py                  # the full run (~2 GB llm state, 3 repeats)
    python benchmarks/bench_suite.py --prefetch       # only the restart-with-prefetch benchmark
    python benchmarks/bench_suite.py --sweep          # only the io: tuning sweep
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierckpt first
    from tierckpt.bench.runner import main

    sys.exit(main())
