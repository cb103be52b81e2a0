"""What a lease directory holds, read back, and how its holders are judged (the protocol that writes
it is in :mod:`tierckpt.tiers._lease`; docs/jobs.md has the rules)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.errors import TierIOError
from tierckpt.tiers.jobs import ProcessId

__all__ = [
    "GEN_RE", "MEMBER_RE", "TMP_RE", "Member", "State", "Watch", "exists", "gen_name", "io_error", "read_record",
    "read_state", "unlink", "write_new",
]  # fmt: skip

GEN_RE = re.compile(r"gen-([1-9][0-9]{0,17})")
MEMBER_RE = re.compile(r"gen-([1-9][0-9]{0,17})\.[0-9a-f]{16}\.member")
TMP_RE = re.compile(r"tmp-[0-9a-f]{16}")
_MAX_RECORD = 64 << 10


# -- records on disk -------------------------------------------------------------------------------------
def gen_name(gen: int) -> str:
    return f"gen-{gen}"


def io_error(tier: str, what: str, e: OSError) -> TierIOError:
    err = TierIOError(e.errno, f"tier {tier!r}: {what}: {e.strerror or e}", e.filename)
    err.__cause__ = e
    return err


def write_new(path: Path, data: bytes, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_record(path: Path) -> tuple[dict[str, Any] | None, int] | None:
    """(the JSON object, or None when it does not parse; mtime in ns) of a regular file; None when there
    is none (gone, a symlink, a FIFO, a directory). Opened, not stat-ed: NFS revalidates on open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        data = os.read(fd, _MAX_RECORD)
    except OSError:
        return None
    finally:
        # read-only, so nothing to lose; a FUSE client may answer the close of a file that another
        # process removed meanwhile with ENOENT (GlusterFS does, with ranks taking a lease together)
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        rec = json.loads(data)
    except ValueError:
        rec = None
    return (rec if isinstance(rec, dict) else None), st.st_mtime_ns


def unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def exists(path: Path) -> bool | None:
    """Whether ``path`` exists; None when that cannot be told (an I/O error)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return True


@dataclass(frozen=True)
class Member:
    path: Path
    job: str | None
    proc: ProcessId | None
    mtime_ns: int

    def describe(self) -> str:
        age = max(0.0, time.time() - self.mtime_ns / 1e9)
        who = self.proc.describe() if self.proc else f"an unidentified process ({self.path.name})"
        return f"{who}, renewed {age:.0f} s ago"


@dataclass(frozen=True)
class State:
    gen: int  #: the newest generation (0: none)
    owner: dict[str, Any] | None  #: its record (None: none, or it does not parse)
    owner_mtime_ns: int
    members: dict[int, list[Member]]  #: members of the newest generation and of the one before

    @property
    def owner_job(self) -> str | None:
        job = (self.owner or {}).get("job")
        return job if isinstance(job, str) else None

    def holders(self) -> list[Member]:
        """The members of the newest generation that belong to its owner (all, when it is unknown)."""
        job = self.owner_job
        return [m for m in self.members.get(self.gen, []) if job is None or m.job == job]


def read_state(d: Path, tier: str, members: bool = True) -> State:
    """The newest generation, its owner and (``members``) the members of it and of the one before: one
    listing and one open per file read (a process joining its own job's lease reads no member)."""
    try:
        names = os.listdir(d)
    except OSError as e:
        raise io_error(tier, f"cannot list the lease directory {d}", e) from e
    gens = [int(m.group(1)) for n in names if (m := GEN_RE.fullmatch(n))]
    gen = max(gens, default=0)
    owner, mtime = None, 0
    if gen:
        got = read_record(d / gen_name(gen))
        owner, mtime = got if got else (None, 0)
    found: dict[int, list[Member]] = {}
    for n in sorted(names) if members else ():
        m = MEMBER_RE.fullmatch(n)
        if m is None or int(m.group(1)) < gen - 1:
            continue
        got = read_record(d / n)
        if got is None:
            continue  # released meanwhile, or not a file
        rec, mt = got
        job = rec.get("job") if rec else None
        proc = ProcessId.from_record(rec) if rec else None
        found.setdefault(int(m.group(1)), []).append(Member(d / n, job if isinstance(job, str) else None, proc, mt))
    return State(gen, owner, mtime, found)


class Watch:
    """What an acquirer has seen of the holders' renewals, by its own monotonic clock."""

    def __init__(self, stale_secs: float) -> None:
        self.stale_secs = stale_secs
        self.first: dict[Path, tuple[int, float]] = {}

    def gone(self, m: Member) -> bool:
        """Whether ``m`` is gone for good (a dead local process; a renewal older than ``stale_secs``)."""
        if m.proc is not None and m.proc.is_local():
            return not m.proc.alive()
        return time.time() - m.mtime_ns / 1e9 >= self.stale_secs

    def judge(self, members: list[Member]) -> tuple[list[Member], list[Member]]:
        """(alive, undecided) among ``members``; the rest are gone. A local member is probed; any other
        is alive once seen renewing, gone once not renewed for ``stale_secs`` by its age or by watching."""
        alive, undecided = [], []
        mono = time.monotonic()
        for m in members:
            if m.proc is not None and m.proc.is_local():
                if m.proc.alive():
                    alive.append(m)
                continue
            first = self.first.setdefault(m.path, (m.mtime_ns, mono))
            if m.mtime_ns != first[0]:
                alive.append(m)
            elif not self.gone(m) and mono - first[1] < self.stale_secs:
                undecided.append(m)
        return alive, undecided
