"""A directory tier's scratch: the names of writes, replaces and evictions in progress, and the sweep that
removes what dead processes of this host left.

A rank's copy is written under ``.tmp-rank-NNNNN-<host>-<pid>-<hex>`` and renamed into place; a copy it
replaces goes to ``.old-…`` for the moment of the swap, an evicted one to ``.evict-…`` until it is freed;
a commit record is written as ``.tmp-commit-…`` (docs/format.md). None of these is ever listed as a
checkpoint (tierckpt.tiers._filelisting).

A per-node copy's blobs are in the step's ``node-<first rank>-<host>-<pid>-<hex>.data`` file
(tierckpt.tiers._nodefile), never listed either. It goes once no copy of the step and no writer is left
(:func:`drop_unused_node_files`, after an eviction or a failed save), and a sweep removes one whose
creator is a dead process of this host and which no manifest of the step names while no writer is
working in the step (docs/distributed.md, "A per-node data file").
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable
from pathlib import Path

from tierckpt.format.location import MAX_LOCATION_BYTES, block_start, decode_location
from tierckpt.format.manifest import HEADER
from tierckpt.io.fsutil import fsync_dir
from tierckpt.tiers._fileread import MANIFEST_NAME

__all__ = ["HOST", "NODE_RE", "SCRATCH_RE", "drop_unused_node_files", "scratch_name", "sweep"]

#: this host, as scratch names carry it (so that a sweep removes only what this host's processes left);
#: ``-`` made ``_``, at most 32 characters (not :data:`tierckpt.tiers.jobs.HOST`, the lease's, which is whole)
HOST = socket.gethostname().replace("-", "_")[:32] or "host"
#: a scratch name: (kind: tmp, old or evict), (host), (pid)
SCRATCH_RE = re.compile(r"\.(tmp|old|evict)-(?:rank-\d{5}|commit)-(.+)-(\d+)-[0-9a-f]+")
#: a node file's name: (the node's first rank), (its creator's host), (pid)
NODE_RE = re.compile(r"node-(\d{5})-(.+)-(\d+)-[0-9a-f]{8}\.data")
_RANK_DIR_RE = re.compile(r"rank-\d{5}")


def scratch_name(kind: str, rank: int | None) -> str:
    """A fresh scratch name of ``kind`` (``tmp``, ``old``, ``evict``) for ``rank``'s copy, or (None) a
    step's commit record, naming this host and process."""
    what = "commit" if rank is None else f"rank-{rank:05d}"
    return f".{kind}-{what}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _alive(host: str, pid: str) -> bool:
    """Whether the process ``pid`` of ``host`` may be alive: always, for another host's (it cannot tell)."""
    return host != HOST or _pid_alive(int(pid))


def _writing(names: Iterable[str]) -> bool:
    """Whether one of ``names`` (a step directory's) is a rank's write in progress: the ``.tmp-rank-``
    scratch of a live process of this host, or of any process of another host."""
    for name in names:
        m = SCRATCH_RE.fullmatch(name)
        if m and m.group(1) == "tmp" and name.startswith(".tmp-rank-") and _alive(m.group(2), m.group(3)):
            return True
    return False


def _unlink_all(step: Path, names: Iterable[str]) -> None:
    """Unlink the files ``names`` of ``step``, then fsync it and remove it if that left it empty."""
    names = list(names)
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(step / name)
    if names:
        with contextlib.suppress(OSError):
            fsync_dir(step)
    with contextlib.suppress(OSError):
        step.rmdir()


def drop_unused_node_files(step: Path) -> None:
    """Unlink the node files of ``step`` where no copy of the step (``rank-NNNNN``) and no rank's write
    in progress is left in it, and remove the directory if that left it empty: a node file lives until
    every copy of the step on the tier is gone. A write that starts meanwhile and finds its node file
    gone fails (tierckpt.tiers._nodefile), never publishes."""
    try:
        names = os.listdir(step)
    except OSError:
        return
    if any(_RANK_DIR_RE.fullmatch(n) for n in names) or _writing(names):
        return
    _unlink_all(step, [n for n in names if NODE_RE.fullmatch(n)])


def _named_node_files(step: Path) -> set[str] | None:
    """The node files the manifests of ``step``'s copies name; None where a manifest cannot be read or
    its location block is damaged (nothing is then known to be unnamed)."""
    named: set[str] = set()
    for rank in os.listdir(step):
        if not _RANK_DIR_RE.fullmatch(rank):
            continue
        try:
            fd = os.open(step / rank / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        try:
            start = block_start(os.pread(fd, HEADER.size, 0))
            size = os.fstat(fd).st_size
            if start is not None and size > start:
                named.add(decode_location(os.pread(fd, MAX_LOCATION_BYTES + 1, start)).name)
        except OSError:  # CorruptCheckpointError included
            return None
        finally:
            os.close(fd)
    return named


def _sweep_node_files(step: Path, names: list[str]) -> None:
    """Remove the node files of ``step`` whose creator is a dead process of this host and which no
    manifest of the step names, unless a rank's write is in progress there."""
    dead = [n for n in names if (m := NODE_RE.fullmatch(n)) and m.group(2) == HOST and not _pid_alive(int(m.group(3)))]
    if not dead or _writing(names):
        return
    named = _named_node_files(step)
    if named is not None:
        _unlink_all(step, [n for n in dead if n not in named])


def sweep(step_dirs: Iterable[Path]) -> None:
    """Remove the scratch that dead processes of this host left in ``step_dirs``: directories of crashed
    saves and evictions, files of commit records whose write was interrupted, node files of dead
    creators that no copy names; then each step directory a killed save left empty."""
    for step in step_dirs:
        try:
            entries = list(os.scandir(step))
        except OSError:
            continue
        for e in entries:
            m = SCRATCH_RE.fullmatch(e.name)
            if m and m.group(2) == HOST and not _pid_alive(int(m.group(3))):
                if m.group(1) == "old" and not (step / e.name.replace(".old-", "", 1)[:10]).exists():
                    continue  # an interrupted non-atomic replace: keep the only copy for inspection
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:  # a commit record's scratch file (write_record killed before its rename)
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
        with contextlib.suppress(OSError):
            _sweep_node_files(step, os.listdir(step))
        with contextlib.suppress(OSError):
            step.rmdir()  # empty after a killed save; fails harmlessly when anything is inside
