"""Who holds a lease: job identities and processes (docs/jobs.md).

A **job** is what a lease belongs to: every process of one training job (all its ranks, on every host)
must resolve the same identity, and a second job a different one. A **process** is identified well
enough that a process on the same host can tell whether it still runs (pid, start time, boot id, pid
namespace) and a process elsewhere can name it (host, pid, start time).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierckpt.errors import ConfigError

if TYPE_CHECKING:
    from tierckpt.tiers.base import Tier

__all__ = ["HOST", "JOB_ENV_VARS", "JobId", "ProcessId", "current_process", "hierarchy_job", "resolve_job"]

#: where a job identity comes from when ``job=`` is not given, in this order (then: one per process)
JOB_ENV_VARS = ("TIERCKPT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
_JOB_RE = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII without spaces
HOST = socket.gethostname() or "localhost"


@dataclass(frozen=True)
class JobId:
    """A job identity, and where it came from (``job=``, an environment variable, or ``process``)."""

    value: str
    source: str

    def __str__(self) -> str:
        return self.value


_job_lock = threading.Lock()
_process_jobs: dict[int, JobId] = {}


def _check_job(value: object, where: str) -> str:
    if not isinstance(value, str) or not _JOB_RE.fullmatch(value):
        raise ConfigError(
            f"{where}: a job identity is 1 to 128 printable ASCII characters without spaces, got {value!r}"
        )
    return value


def resolve_job(job: str | None = None) -> JobId:
    """The job identity of this process: ``job``, else the first of :data:`JOB_ENV_VARS` that is set
    (``TORCHELASTIC_RUN_ID`` only when it is not torchrun's default ``none``), else an identity of this
    process alone (the same for every hierarchy it opens).

    Raises:
        ConfigError: the identity has spaces, control characters or is longer than 128 characters.
    """
    if job is not None:
        return JobId(_check_job(job, "job"), "job=")
    for var in JOB_ENV_VARS:
        value = os.environ.get(var)
        if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            return JobId(_check_job(value, f"${var}"), var)
    pid = os.getpid()
    with _job_lock:
        if pid not in _process_jobs:  # keyed by pid: a forked child is a process of its own
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", HOST)[:40]
            _process_jobs[pid] = JobId(f"process-{name}-{pid}-{secrets.token_hex(4)}", "process")
        return _process_jobs[pid]


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(4096).strip()  # an identity is a line: a bound, not an I/O size
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of ``pid`` from /proc, or None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)  # one line: a bound
        rest = data[data.rindex(b")") + 2 :].split()
        return rest[0].decode(), int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_time() -> float | None:
    """The boot time (seconds since the epoch) from /proc/stat, None where unreadable."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class ProcessId:
    """A process, identified well enough to tell from another host whether it still runs.

    Attributes:
        host: host name.
        boot_id: the kernel's boot id (a reboot ends every process).
        pid_ns: the pid namespace (a pid means nothing in another container).
        pid: process id.
        start_ticks: start time in clock ticks after boot (a reused pid has another), None if unknown.
        started_at: start time in seconds since the epoch, None if unknown.
    """

    host: str
    boot_id: str
    pid_ns: str
    pid: int
    start_ticks: int | None
    started_at: float | None

    @classmethod
    def current(cls) -> ProcessId:
        pid = os.getpid()
        stat = _proc_stat(pid)
        ticks = stat[1] if stat else None
        btime = _boot_time()
        started = btime + ticks / os.sysconf("SC_CLK_TCK") if ticks is not None and btime is not None else None
        return cls(HOST, _read_text("/proc/sys/kernel/random/boot_id"), _pid_ns(), pid, ticks, started)

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> ProcessId | None:
        try:
            p = cls(rec["host"], rec["boot_id"], rec["pid_ns"], rec["pid"], rec["start_ticks"], rec["started_at"])
        except (KeyError, TypeError):
            return None
        ok = all(isinstance(v, str) for v in (p.host, p.boot_id, p.pid_ns)) and type(p.pid) is int
        ok = ok and (p.start_ticks is None or type(p.start_ticks) is int)
        ok = ok and (p.started_at is None or isinstance(p.started_at, (int, float)))
        return p if ok else None

    def is_local(self) -> bool:
        """Whether this process's pid can be probed from here: same host, boot and pid namespace."""
        me = current_process()
        return bool(self.boot_id and self.pid_ns) and (self.host, self.boot_id, self.pid_ns) == (
            me.host, me.boot_id, me.pid_ns,
        )  # fmt: skip

    def alive(self) -> bool:
        """For a local process: whether it still runs (not exited, not a zombie, not a reused pid)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process
        stat = _proc_stat(self.pid)
        if stat is None:
            return True  # /proc hidden: the pid exists, assume it is the holder
        state, ticks = stat
        return state not in ("Z", "X") and (self.start_ticks is None or ticks == self.start_ticks)

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at)) if self.started_at else "?"
        return f"pid {self.pid} on host {self.host} (started {started})"


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_me_cache: dict[int, ProcessId] = {}


def current_process() -> ProcessId:
    pid = os.getpid()
    if pid not in _me_cache:
        _me_cache[pid] = ProcessId.current()
    return _me_cache[pid]


def hierarchy_job(tiers: Sequence[Tier], job: str | None) -> str:
    """The job identity of a writable hierarchy of ``tiers``: ``job`` (or the environment's) when no
    tier holds a lease, else the one their leases are held for (:meth:`Tier.lease_job`), which must
    agree with ``job``.

    Raises:
        ConfigError: the tiers' leases are held for different jobs, or not for ``job``.
    """
    held = {t.name: value for t in tiers if (value := t.lease_job()) is not None}
    want = resolve_job(job).value if job is not None or not held else None
    for name, value in held.items():
        want = want or value
        if value != want:
            raise ConfigError(
                f"tiers: tier {name!r} holds its lease for job {value!r}, not {want!r}: build every file tier "
                "with the same job= (Hierarchy.from_config(..., job=) does)"
            )
    assert want is not None
    return want
