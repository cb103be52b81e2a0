"""A directory tier's scratch: the names of writes, replaces and evictions in progress, and the sweep that
removes what dead processes of this host left.

A rank's copy is written under ``.tmp-rank-NNNNN-<host>-<pid>-<hex>`` and renamed into place; a copy it
replaces goes to ``.old-…`` for the moment of the swap, an evicted one to ``.evict-…`` until it is freed;
a commit record is written as ``.tmp-commit-…`` (docs/format.md). None of these is ever listed as a
checkpoint (tierckpt.tiers._filelisting).
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

__all__ = ["HOST", "SCRATCH_RE", "scratch_name", "sweep"]

#: this host, as scratch names carry it (so that a sweep removes only what this host's processes left);
#: ``-`` made ``_``, at most 32 characters (not :data:`tierckpt.tiers.jobs.HOST`, the lease's, which is whole)
HOST = socket.gethostname().replace("-", "_")[:32] or "host"
#: a scratch name: (kind: tmp, old or evict), (host), (pid)
SCRATCH_RE = re.compile(r"\.(tmp|old|evict)-(?:rank-\d{5}|commit)-(.+)-(\d+)-[0-9a-f]+")


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


def sweep(step_dirs: Iterable[Path]) -> None:
    """Remove the scratch that dead processes of this host left in ``step_dirs``: directories of crashed
    saves and evictions, files of commit records whose write was interrupted; then each step directory
    a killed save left empty."""
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
            step.rmdir()  # empty after a killed save; fails harmlessly when anything is inside
