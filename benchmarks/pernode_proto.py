"""A prototype of one rank's save in the per-node layout (docs/distributed.md, "A per-node data file: the design"), for
counting its file and store operations in ``bench_commit_sim.py``: the syscalls the design makes, in its
order, on a real directory. Not the tier's writer (tierckpt writes one data file per rank):
it writes no data that any reader of this version could read, and it cleans nothing up after a failure.

Per save and node: every rank sets its part's size on the store; the node's first rank waits for the
others, creates the node file (``O_CREAT | O_EXCL``), ``posix_fallocate``s it, fsyncs the step
directory, and sets the name and the offsets; every rank then writes its region, fsyncs its descriptor,
checks the file is still linked, writes its manifest with a location block into its scratch directory,
fsyncs that directory, renames it to ``rank-NNNNN`` and fsyncs the step's and the tier's directories.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import xxhash

from tierckpt.io.fsutil import fsync_dir
from tierckpt.tiers._filescratch import HOST, scratch_name
from tierckpt.tiers._filewrite import write_file

_LOC_HEAD = struct.Struct("<8sHHI")  # magic, version, flags, name length


def location_block(name: str, offset: int) -> bytes:
    """The location block of docs/distributed.md ("A per-node data file: the design") naming ``name`` at ``offset``."""
    raw = name.encode()
    body = _LOC_HEAD.pack(b"TCKPLOC1", 1, 0, len(raw)) + raw + struct.pack("<Q", offset)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def save_per_node(
    store: Any, root: Path, step: int, rank: int, node_ranks: list[int], manifest: bytes, data: bytes
) -> None:
    """Save ``rank``'s copy of ``step`` (``data``: its blobs back to back, a multiple of 4096 bytes) into
    the node file of ``node_ranks`` (the node's global ranks, ascending) under the tier directory ``root``."""
    first = node_ranks[0]
    key = f"pernode/pfs/{step}/{first}"
    step_dir = root / f"step-{step:012d}"
    store.set(f"{key}/size/{rank}", str(len(data)))
    step_dir.mkdir(exist_ok=True)  # as the per-rank writer does (another process may have removed it)
    if rank == first:
        others = [f"{key}/size/{r}" for r in node_ranks[1:]]
        if others:
            store.wait(others)
        sizes = [len(data)] + [int(store.get(k)) for k in others]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        name = f"node-{first:05d}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}.data"
        fd = os.open(step_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, sum(sizes))  # its size is made durable by every writer's fsync
        finally:
            os.close(fd)
        fsync_dir(step_dir)  # its name is durable before any manifest can name it
        store.set(f"{key}/place", json.dumps([name, offsets]))
    name, offsets = json.loads(store.get(f"{key}/place"))
    offset = offsets[node_ranks.index(rank)]
    tmp = step_dir / scratch_name("tmp", rank)
    tmp.mkdir()
    fd = os.open(step_dir / name, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
        if os.fstat(fd).st_nlink == 0:
            raise RuntimeError(f"{name} was removed while rank {rank} wrote it")
    finally:
        os.close(fd)
    write_file(tmp / "manifest", manifest + location_block(name, offset))
    fsync_dir(tmp)
    os.rename(tmp, step_dir / f"rank-{rank:05d}")
    fsync_dir(step_dir)
    fsync_dir(root)
