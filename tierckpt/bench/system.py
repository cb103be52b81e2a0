"""What the benchmarks need from the operating system: a cold page cache, how much of a file is resident,
peak RSS and CPU time of one operation, and a description of the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import resource
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import tierckpt
from tierckpt.bench.options import COLD_METHODS

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy

__all__ = [
    "COLD_METHODS",
    "Usage",
    "files_under",
    "machine_info",
    "make_cold",
    "measure",
    "read_text",
    "resident_fraction",
]

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def read_text(path: str) -> str:
    """The stripped contents of a small text file, or "" when it cannot be read."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def files_under(paths: Iterable[Path]) -> list[Path]:
    """Every regular file at or below ``paths``."""
    out: list[Path] = []
    for root in paths:
        if root.is_file():
            out.append(root)
        elif root.is_dir():
            out += [p for p in sorted(root.rglob("*")) if p.is_file()]
    return out


# -- cold page cache ------------------------------------------------------------------------------------
def make_cold(paths: list[Path], method: str = "auto") -> str:
    """Write back dirty pages and empty the page cache; returns the method that worked.

    ``drop_caches`` (root) drops every clean page of the machine; ``fadvise`` fsyncs every file under
    ``paths`` and calls ``posix_fadvise(DONTNEED)`` on it (only clean pages can be dropped, hence the
    fsync). ``auto`` tries ``drop_caches`` first.

    Args:
        paths: files or directories about to be read.
        method: ``auto``, ``drop_caches`` or ``fadvise``.
    """
    os.sync()
    if method in ("auto", "drop_caches"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            return "drop_caches"
        except OSError:
            if method == "drop_caches":
                raise
    for p in files_under(paths):
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _resident_pages(path: Path) -> tuple[int, int]:
    """(resident pages, pages) of one file, through mmap + mincore (no page is touched)."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    pages = -(-size // _PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return 0, pages
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return 0, pages
            return sum(b & 1 for b in bytes(vec)), pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident_fraction(paths: Iterable[Path]) -> float | None:
    """Fraction of the pages of every file under ``paths`` that are in the page cache (``mincore``);
    None when there are no files (e.g. a checkpoint held in memory)."""
    res = tot = 0
    for p in files_under(paths):
        with contextlib.suppress(OSError):
            r, t = _resident_pages(p)
            res, tot = res + r, tot + t
    return res / tot if tot else None


# -- one operation's cost --------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in read_text("/proc/self/status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class Usage:
    """Cost of one measured operation.

    Attributes:
        wall_secs: wall time.
        cpu_secs: user + system CPU time of the whole process (every thread) during the operation.
        peak_extra_rss_bytes: the process's peak RSS during the operation minus its RSS at the start,
            or None where the peak cannot be reset (no ``/proc/self/clear_refs``).
    """

    wall_secs: float = 0.0
    cpu_secs: float = 0.0
    peak_extra_rss_bytes: int | None = None


@contextlib.contextmanager
def measure() -> Iterator[Usage]:
    """Measure the block: wall time (``perf_counter``), process CPU time (``getrusage``: every thread,
    plus children that ended inside the block), and peak extra RSS (the kernel's VmHWM, reset at the start
    through ``/proc/self/clear_refs``, minus VmRSS at the start)."""
    u = Usage()
    peak_ok = _reset_peak_rss()
    rss0 = _status_kib("VmRSS")
    r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        yield u
    finally:
        u.wall_secs = time.perf_counter() - t0
        r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        u.cpu_secs = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) + (
            c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime
        )
        if peak_ok:
            u.peak_extra_rss_bytes = max(0, _status_kib("VmHWM") - rss0) * 1024


# -- machine ---------------------------------------------------------------------------------------------
def _mount_of(path: Path) -> tuple[str, str, str, str]:
    best = ("?", "?", "?", "?")
    best_len = -1
    real = str(path.resolve())
    for line in read_text("/proc/self/mounts").splitlines():
        dev, mnt, fs, opts = line.split()[:4]
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
            best, best_len = (dev, mnt, fs, opts), len(mnt)
    return best


def _source_rev() -> str:
    """Where tierckpt was imported from, with the git commit (``+dirty`` if its sources are modified)."""
    pkg = Path(tierckpt.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(pkg), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(pkg), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return str(pkg)
    if rev.returncode != 0:
        return str(pkg)
    return f"{pkg} @ {rev.stdout.strip()}{'+dirty' if dirty.stdout.strip() else ''}"


def machine_info(scratch: Path, h: Hierarchy | None = None) -> dict[str, Any]:
    """CPU, memory, kernel, the file system and block device under ``scratch``, versions, and (given a
    hierarchy) the I/O settings of its top tier."""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in read_text("/proc/cpuinfo").splitlines() if ln.startswith("model name")),
        platform.processor() or "?",
    )
    dev, mnt, fs, opts = _mount_of(scratch)
    blk = Path(dev).name
    mem_kib = next(
        (int(ln.split()[1]) for ln in read_text("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), 0
    )
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "fs": fs,
        "mount": mnt,
        "device": dev,
        "mount_opts": opts,
        "scheduler": read_text(f"/sys/block/{blk}/queue/scheduler"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tierckpt": tierckpt.__version__,
        "tierckpt_src": _source_rev(),
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "loadavg_start": read_text("/proc/loadavg"),
        "cpu_pressure_start": (read_text("/proc/pressure/cpu").splitlines() or [""])[0],
    }
    if h is not None:
        tier = h.tiers[0]
        engine = getattr(tier, "engine", None)
        info |= {
            "engine": getattr(engine, "name", "?"),
            "backend": getattr(engine, "backend", "-"),
            "direct": bool(getattr(tier, "direct", False)),
            "queue_depth": h.io.queue_depth,
            "chunk_bytes": h.io.chunk_bytes,
        }
    return info
