"""A directory tier's scratch: the names of writes, replaces and evictions in progress, and the sweep that
removes what dead processes of this host left.

A rank's copy is written under ``.tmp-rank-NNNNN-<host>-<pid>-<hex>`` and renamed into place; a copy it
replaces goes to ``.old-…`` for the moment of the swap, an evicted one to ``.evict-…`` until it is freed;
a commit record is written as ``.tmp-commit-…`` (docs/format.md). None of these is ever listed as a
checkpoint (tierckpt.tiers._filelisting).

A per-node copy's blobs are in the step's ``node-<first rank>-<host>-<pid>-<hex>.data`` file
(tierckpt.tiers._nodefile), never listed either. It goes once no copy of the step and no writer is left
(:func:`drop_unused_node_files`, after an eviction or a failed save), once no manifest names it after a
re-save replaced the copies naming it (:func:`release_node_file`), and a sweep removes one whose
creator is a dead process of this host and which no manifest of the step names while no writer is
working in the step. Each removal renames the file to ``.drop-<host>-<pid>-<name>`` first and looks at
the step again (:func:`_retire`), and a writer checks its file by name after publishing, so that a
removal and a writer never miss each other (docs/distributed.md, "A per-node data file").
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from tierckpt.format.location import MAX_LOCATION_BYTES, block_start, decode_location
from tierckpt.format.manifest import HEADER
from tierckpt.io.fsutil import fsync_dir
from tierckpt.tiers._fileread import MANIFEST_NAME

__all__ = ["HOST", "NODE_RE", "SCRATCH_RE", "drop_unused_node_files", "release_node_file", "scratch_name", "sweep"]

#: this host, as scratch names carry it (so that a sweep removes only what this host's processes left);
#: ``-`` made ``_``, at most 32 characters (not :data:`tierckpt.tiers.jobs.HOST`, the lease's, which is whole)
HOST = socket.gethostname().replace("-", "_")[:32] or "host"
#: a scratch name: (kind: tmp, old or evict), (host), (pid)
SCRATCH_RE = re.compile(r"\.(tmp|old|evict)-(?:rank-\d{5}|commit)-(.+)-(\d+)-[0-9a-f]+")
#: a node file's name: (the node's first rank), (its creator's host), (pid)
NODE_RE = re.compile(r"node-(\d{5})-(.+)-(\d+)-[0-9a-f]{8}\.data")
_RANK_DIR_RE = re.compile(r"rank-\d{5}")
#: a node file being dropped (:func:`_retire`): (the dropper's host), (pid), (the node file's name)
_DROP_RE = re.compile(r"\.drop-([^-]+)-(\d+)-(node-\d{5}-.+\.data)")


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


def _copies(names: Iterable[str]) -> list[str]:
    """Of a step directory's ``names``, the directories that may hold a copy whose node file must stay:
    the ranks' copies and the ``.old-…`` copies of a replace (the sweep keeps an interrupted one's)."""
    return [n for n in names if _RANK_DIR_RE.fullmatch(n) or ((m := SCRATCH_RE.fullmatch(n)) and m.group(1) == "old")]


def _retire(step: Path, names: Iterable[str], keep: Callable[[list[str]], Collection[str] | None]) -> None:
    """Unlink the node files ``names`` of ``step`` unless ``keep`` (given the directory's listing, None:
    keep them all) names them once they are renamed out of the way, then remove the directory if that
    left it empty. A writer checks its node file by name after it published its copy
    (tierckpt.tiers._nodefile), so either this listing sees its scratch or copy (and the file is renamed
    back), or the writer sees its file gone (and takes its copy back): the two never both miss."""
    moved = []
    for name in names:
        away = f".drop-{HOST}-{os.getpid()}-{name}"
        with contextlib.suppress(OSError):
            os.rename(step / name, step / away)
            moved.append((name, away))
    if not moved:
        _unlink_all(step, [])  # the directory, if it is empty
        return
    try:
        kept = keep(os.listdir(step))
    except OSError:
        kept = None
    for name, away in moved:
        if kept is None or name in kept:
            with contextlib.suppress(OSError):
                os.rename(step / away, step / name)
    _unlink_all(step, [away for name, away in moved if kept is not None and name not in kept])


def drop_unused_node_files(step: Path) -> None:
    """Unlink the node files of ``step`` where no copy of the step (``rank-NNNNN``, ``.old-…``) and no
    rank's write in progress is left in it, and remove the directory if that left it empty: a node file
    lives until every copy of the step on the tier is gone. A write that runs meanwhile and finds its
    node file gone, before or after it published, fails (tierckpt.tiers._nodefile): no copy stays that
    names a missing file."""

    def used(names: list[str]) -> Collection[str] | None:
        return None if _copies(names) or _writing(names) else ()

    try:
        names = os.listdir(step)
    except OSError:
        return
    if used(names) is None:
        return
    _retire(step, [n for n in names if NODE_RE.fullmatch(n)], used)


def release_node_file(step: Path, name: str) -> None:
    """Unlink the node file ``name`` of ``step`` (a re-save replaced a copy that named it) once no
    manifest of the step names it. The manifests are read from the node's first rank on, so that a rank
    whose node still has old copies stops early; the last rank of a node to replace its copy reads up
    to every manifest of the step. No new write goes to a replaced file (a save names a fresh one); a
    late writer of the old save finds it gone by its name and fails (tierckpt.tiers._nodefile)."""
    m = NODE_RE.fullmatch(name)
    if m is None or name in (_named_node_files(step, first=int(m.group(1)), stop_at=name) or {name}):
        return

    def used(names: list[str]) -> Collection[str] | None:
        return _named_node_files(step, names, stop_at=name)

    _retire(step, [name], used)


def _named_node_files(
    step: Path, names: list[str] | None = None, *, first: int = 0, stop_at: str | None = None
) -> set[str] | None:
    """The node files the manifests of ``step``'s copies (``rank-NNNNN`` and ``.old-…``; ``names``: its
    listing, else listed now) name, read from rank ``first`` on (then the others, then ``.old-…``),
    stopping once one names ``stop_at``; None where a manifest cannot be read or its location block is
    damaged (nothing is then known to be unnamed)."""
    dirs = sorted(_copies(os.listdir(step) if names is None else names))
    ranks = [d for d in dirs if _RANK_DIR_RE.fullmatch(d)]
    at = f"rank-{first:05d}"
    dirs = [d for d in ranks if d >= at] + [d for d in ranks if d < at] + [d for d in dirs if d not in ranks]
    named: set[str] = set()
    for copy in dirs:
        try:
            fd = os.open(step / copy / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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
        if stop_at in named:
            break
    return named


def _sweep_node_files(step: Path, names: list[str]) -> None:
    """Remove the node files of ``step`` whose creator is a dead process of this host and which no
    manifest of the step names, unless a rank's write is in progress there."""
    _restore_dropped(step, names)
    dead = [n for n in names if (m := NODE_RE.fullmatch(n)) and m.group(2) == HOST and not _pid_alive(int(m.group(3)))]
    if not dead or _writing(names):
        return
    named = _named_node_files(step, names)
    if named is None:
        return

    def used(names: list[str]) -> Collection[str] | None:
        return None if _writing(names) else _named_node_files(step, names)

    _retire(step, [n for n in dead if n not in named], used)


def _restore_dropped(step: Path, names: list[str]) -> None:
    """Node files renamed away to be dropped (:func:`_retire`) whose remover died before it finished,
    back under their names: a dead process of this host's (the next sweep decides about them again),
    and any that a manifest of the step names (safe whoever renamed it: a live remover that looks again
    keeps it, and its own rename back or unlink then finds nothing)."""
    dropped = [(n, m) for n in names if (m := _DROP_RE.fullmatch(n)) and not (step / m.group(3)).exists()]
    named = _named_node_files(step, names) if dropped else set()  # None: cannot tell, so back they go
    for n, m in dropped:
        if named is None or m.group(3) in named or (m.group(1) == HOST and not _pid_alive(int(m.group(2)))):
            with contextlib.suppress(OSError):
                os.rename(step / n, step / m.group(3))


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
