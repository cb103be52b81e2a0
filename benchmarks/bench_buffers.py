"""Does the page size of an I/O buffer change O_DIRECT speed? 4 KiB pages against transparent huge pages.

Usage::

    python benchmarks/bench_buffers.py [--size 1GiB] [--repeats 3] [--dir SCRATCH]

Writes one file, then reads it back cold (page cache dropped) the way tierckpt's in-place restore reads a
checkpoint: 16 MiB O_DIRECT reads into 12 reused staging slots, at most 12 in flight on the ``uring``
engine (QD 16). The slots are either plain anonymous memory (4 KiB pages) or the library's buffers
(:func:`tierckpt.io.buffers.aligned_empty`: ``MADV_HUGEPAGE`` from 2 MiB on), allocated for each
measurement after the page cache is dropped (as a long-running process allocates its buffers from a
fragmented free list) and faulted in before the timer. The same file is also written from each kind of
buffer (O_DIRECT, 16 MiB writes, fsync). The order of the kinds alternates from repeat to repeat.
docs/io.md, "Huge-page buffers", says why it matters; docs/benchmarks.md has the latest figures.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

from tierckpt.bench.system import make_cold
from tierckpt.config import parse_size
from tierckpt.io.buffers import aligned_empty
from tierckpt.io.engine import IOEngine, make_engine

PIECE = 16 << 20
SLOTS = 12


class _Slots:
    """``SLOTS`` buffers of ``PIECE`` bytes, faulted in; ``addrs`` are their addresses."""

    def __init__(self, huge: bool) -> None:
        if huge:
            self._keep: list[object] = [aligned_empty(PIECE, pin=False) for _ in range(SLOTS)]
            self.addrs = [t.data_ptr() for t in self._keep]  # type: ignore[attr-defined]
        else:
            maps = [mmap.mmap(-1, PIECE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(SLOTS)]
            self._keep = maps
            self.addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
        for a in self.addrs:
            ctypes.memset(a, 0x5A, PIECE)


def _stream(engine: IOEngine, path: Path, size: int, slots: _Slots, write: bool) -> float:
    """Seconds to move ``size`` bytes through the slots, at most ``SLOTS`` operations in flight."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        if write:
            os.posix_fallocate(fd, 0, size)
        todo, inflight, free = deque(range(0, size, PIECE)), deque(), list(range(SLOTS))
        t0 = time.perf_counter()
        while todo or inflight:
            while todo and free:
                off, k = todo.popleft(), free.pop()
                op = engine.pwrite if write else engine.pread
                inflight.append((k, op(fd, slots.addrs[k], min(PIECE, size - off), off)))
            k, fut = inflight.popleft()
            fut.result()
            free.append(k)
        if write:
            engine.fsync(fd).result()
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB", help="file size (rounded to 16 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp dir under /tmp)")
    args = ap.parse_args()
    size = max(PIECE, parse_size(args.size, "--size") // PIECE * PIECE)
    engine = make_engine("uring", queue_depth=16)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(
        f"size {size / 1e9:.2f} GB, {SLOTS} x 16 MiB slots, THP: {thp.read_text().strip() if thp.exists() else 'n/a'}"
    )
    kinds = ("4k", "huge")
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "data.bin"
        for rep in range(args.repeats):
            order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
            for op in ("write", "read"):
                for kind in order:
                    make_cold([path])  # before allocating: the buffers get pages from a used machine's free lists
                    slots = _Slots(huge=kind == "huge")
                    secs = _stream(engine, path, size, slots, write=op == "write")
                    del slots
                    times.setdefault((op, kind), []).append(secs)
                    print(f"  r{rep} {op:<5} {kind:<4} {size / secs / 1e9:6.2f} GB/s", flush=True)
    engine.close()
    print("\nmedians:")
    for op in ("write", "read"):
        gb = {k: size / statistics.median(times[(op, k)]) / 1e9 for k in kinds}
        print(
            f"  {op:<5} 4 KiB pages {gb['4k']:.2f} GB/s, huge pages {gb['huge']:.2f} GB/s ({gb['huge'] / gb['4k']:.2f}x)"
        )


if __name__ == "__main__":
    main()
