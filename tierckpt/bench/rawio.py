"""The limits tierckpt is measured against: one aligned buffer written and read sequentially with
O_DIRECT (one ``pwrite``/``preadv`` at a time, or every chunk queued on tierckpt's I/O engine), and fio.
The memory bound (memcpy) is :class:`tierckpt.bench.peers.Memcpy`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from tierckpt.io.buffers import ptr_mv
from tierckpt.io.engine import IOEngine

__all__ = [
    "GB",
    "RAW_CHUNK",
    "fio_available",
    "raw_read_engine",
    "raw_read_pread",
    "raw_write_engine",
    "raw_write_pwrite",
    "run_fio",
]

log = logging.getLogger(__name__)

GB = 1e9
RAW_CHUNK = 64 << 20  # the raw reference's own I/O (a measurement of the disk, not of tierckpt's geometry)


def raw_write_pwrite(path: Path, buf: torch.Tensor, nbytes: int) -> None:
    """Write ``nbytes`` of ``buf`` (4 KiB-aligned) to a new file: O_DIRECT, posix_fallocate, 64 MiB
    ``pwrite`` calls one at a time, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        base = buf.data_ptr()
        for off in range(0, nbytes, RAW_CHUNK):
            n = min(RAW_CHUNK, nbytes - off)
            done = 0
            while done < n:
                done += os.pwrite(fd, ptr_mv(base + off + done, n - done, writable=False), off + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read_pread(path: Path, buf: torch.Tensor, nbytes: int) -> None:
    """Read ``nbytes`` of ``path`` into ``buf`` with O_DIRECT, 64 MiB ``preadv`` calls one at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        base = buf.data_ptr()
        for off in range(0, nbytes, RAW_CHUNK):
            n = min(RAW_CHUNK, nbytes - off)
            done = 0
            while done < n:
                r = os.preadv(fd, [ptr_mv(base + off + done, n - done)], off + done)
                if r == 0:
                    raise EOFError(f"{path}: short file")
                done += r
    finally:
        os.close(fd)


def raw_write_engine(engine: IOEngine, path: Path, buf: torch.Tensor, nbytes: int) -> None:
    """Like :func:`raw_write_pwrite`, with every 64 MiB chunk queued on ``engine`` at once."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        base = buf.data_ptr()
        futs = [engine.pwrite(fd, base + off, min(RAW_CHUNK, nbytes - off), off) for off in range(0, nbytes, RAW_CHUNK)]
        for f in futs:
            f.result()
        engine.fsync(fd).result()
    finally:
        os.close(fd)


def raw_read_engine(engine: IOEngine, path: Path, buf: torch.Tensor, nbytes: int) -> None:
    """Like :func:`raw_read_pread`, with every 64 MiB chunk queued on ``engine`` at once."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        base = buf.data_ptr()
        futs = [
            (min(RAW_CHUNK, nbytes - off), engine.pread(fd, base + off, min(RAW_CHUNK, nbytes - off), off))
            for off in range(0, nbytes, RAW_CHUNK)
        ]
        for n, f in futs:
            if f.result() != n:
                raise EOFError(f"{path}: short file")
    finally:
        os.close(fd)


def fio_available() -> bool:
    """True when the ``fio`` command is on PATH."""
    return shutil.which("fio") is not None


def run_fio(path: Path, nbytes: int, rw: str) -> float | None:
    """fio 16 MiB sequential O_DIRECT at QD16 (io_uring, preallocated, end_fsync); GB/s or None."""
    cmd = [
        "fio", "--name=ref", f"--filename={path}", f"--size={nbytes}", "--bs=16m", f"--rw={rw}",
        "--direct=1", "--ioengine=io_uring", "--iodepth=16", "--fallocate=posix", "--end_fsync=1",
        "--output-format=json",
    ]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
        return float(job["write" if rw == "write" else "read"]["bw_bytes"]) / GB
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as e:
        log.warning("fio %s failed: %s", rw, e)
        return None
