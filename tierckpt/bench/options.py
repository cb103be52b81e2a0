"""The ``tierckpt bench`` options, apart from the code that runs them: ``tierckpt --help`` builds this
parser, and it imports nothing heavy (no torch).
"""

from __future__ import annotations

import argparse

__all__ = ["COLD_METHODS", "SIZES", "WORKLOADS", "add_arguments"]

COLD_METHODS = ("auto", "drop_caches", "fadvise")
WORKLOADS = ("llm", "small", "mixed", "train")
# (full, quick) defaults of the size options
SIZES: dict[str, tuple[str, str]] = {
    "llm_size": ("2GB", "50MB"),
    "small_count": ("20000", "1000"),
    "mixed_size": ("1GB", "30MB"),
    "mixed_small": ("3000", "250"),
    "prefetch_size": ("1GB", "50MB"),
    "sweep_size": ("1GB", "64MB"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` options."""
    p.add_argument("--quick", action="store_true", help="small sizes: the whole run in under 3 minutes")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of %(default)s")
    p.add_argument("--peers", default=None,
                   help="comma-separated peers or prefixes (tierckpt,torch,dcp,torchsnapshot,safetensors); "
                        "raw, fio and memcpy always run (default: all)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats of every measurement (default 3; with --quick 2, and 3 of the cheap restarts)")  # fmt: skip
    p.add_argument("--out", default="bench-results", help="folder for JSON lines, markdown and PNGs")
    p.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: under /tmp)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="only the io: tuning sweep (prints the best io: block)")
    mode.add_argument("--prefetch", action="store_true", help="only the restore-time prefetch benchmark")
    mode.add_argument("--no-prefetch", action="store_true", help="leave the prefetch benchmark out of a full run")
    p.add_argument("--sweep-grid", action="store_true", help="sweep every combination, not one knob at a time")
    p.add_argument("--prefetch-t", default=None, help="init times in seconds, e.g. 0,0.5,1,2 (default: "
                   "multiples of the measured direct restore time)")  # fmt: skip
    for name, (full, quick) in SIZES.items():
        p.add_argument("--" + name.replace("_", "-"), default=None, help=f"default {full} ({quick} with --quick)")
    p.add_argument("--cold", choices=COLD_METHODS, default="auto",
                   help="how to empty the page cache: drop_caches (root), fadvise (per file), auto")  # fmt: skip
    p.add_argument("--engine", default=None, help="tierckpt io.engine for its rows (auto, uring, threads)")
    p.add_argument("--queue-depth", type=int, default=None, help="tierckpt io.queue_depth for its rows")
    p.add_argument("--chunk", default=None, help="tierckpt io.chunk for its rows, e.g. 64MiB")
    p.add_argument("--no-check", action="store_true", help="skip comparing restores with the saved state")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
