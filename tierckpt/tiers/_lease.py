"""Job leases: a tier directory belongs to one job at a time (docs/jobs.md has the rules for users).

On disk, in the tier directory::

    .tierckpt-lease/gen-7                       the owner of generation 7: {"job": ..., ...} (JSON)
    .tierckpt-lease/gen-7.<hex16>.member        one per process holding it: job, host, pid, start
                                                time; its mtime is renewed every stale_secs / 6
    .tierckpt-lease/tmp-<hex16>                 a generation file being written

The lease is the newest generation. It is **held** while one of its members is alive: a member on this
host (same boot, same pid namespace) while its pid runs with the recorded start time (a reused pid has
another one; a zombie is dead); any other member while it renews its mtime (stale when not renewed
for ``stale_secs``, by its age on this host's clock or, whatever the clocks say, by watching it that
long). A generation with no live member is free.

* **Join** (the owner is this job): create a member file of generation g, then check that g is still
  the newest generation.
* **Take** (free, or no generation yet): create a member file of g+1, then ``link()`` a complete
  generation file to ``gen-(g+1)``: a hard link fails with EEXIST when the name exists, on every POSIX
  file system and across NFS clients, so of two takers exactly one creates it. The winner then checks
  that no member of g appeared or renewed since it judged g free (a joiner of g checks the opposite,
  after creating its member: one of the two sees the other, like Dekker's flags), and removes the older
  generations, oldest first.
* **Renew** (a thread, every ``stale_secs / 6``): touch the member file, then check that generation g
  still exists and g+1 does not; otherwise the lease was taken over (a holder paused for longer than
  ``stale_secs``) or broken by hand, and every later write to the tier raises TierBusyError.
* **Release** (``close()``): remove the member file.

flock() is not used: Lustre mounted ``localflock`` grants it per node without telling anyone, NFSv3
needs lockd, and a lock cannot be shared by the processes of one job on many hosts while it excludes
every other job.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any

from tierckpt.config import LEASE_STALE_SECS
from tierckpt.errors import TierBusyError, TierIOError
from tierckpt.tiers._lease_state import (
    GEN_RE,
    MEMBER_RE,
    TMP_RE,
    Member,
    State,
    Watch,
    exists,
    gen_name,
    io_error,
    read_record,
    read_state,
    unlink,
    write_new,
)
from tierckpt.tiers.jobs import HOST, JobId, ProcessId, current_process, resolve_job

__all__ = ["LEASE_DIR", "Lease"]

log = logging.getLogger(__name__)

LEASE_DIR = ".tierckpt-lease"


# -- the protocol ----------------------------------------------------------------------------------------
def _lease_dir(directory: Path, tier: str) -> Path:
    d = directory / LEASE_DIR
    try:
        with contextlib.suppress(FileExistsError):  # checked below: a directory, not a link to one
            d.mkdir()
        st = os.lstat(d)
    except OSError as e:
        raise io_error(tier, f"cannot create the lease directory {d}", e) from e
    if not stat.S_ISDIR(st.st_mode):
        raise TierIOError(
            errno.ENOTDIR, f"tier {tier!r}: {d}, where the tier's lease is kept, is not a directory: remove it", str(d)
        )
    return d


def _new_member(d: Path, gen: int, job: JobId, tier: str) -> Path:
    rec = {"job": job.value, "job_source": job.source, **vars(current_process()), "since": time.time()}
    path = d / f"{gen_name(gen)}.{secrets.token_hex(8)}.member"
    try:
        write_new(path, json.dumps(rec).encode(), sync=False)
    except OSError as e:
        unlink(path)
        raise io_error(tier, f"cannot write the lease file {path}", e) from e
    return path


def _publish(d: Path, name: str, rec: dict[str, Any], tier: str) -> bool:
    """Create ``d/name`` holding ``rec``, complete, unless it exists; whether this call created it."""
    data = json.dumps(rec).encode()
    tmp = d / f"tmp-{secrets.token_hex(8)}"
    try:
        write_new(tmp, data, sync=True)
        try:
            os.link(tmp, d / name)
            return True
        except FileExistsError:  # NFS may answer a retried link() that did succeed so: compare tokens
            got = read_record(d / name)
            return got is not None and got[0] is not None and got[0].get("token") == rec["token"]
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
        try:  # no hard links here: an exclusive create (readers wait for a young empty one to fill)
            write_new(d / name, data, sync=True)
            return True
        except FileExistsError:
            return False
    except OSError as e:
        raise io_error(tier, f"cannot write the lease file {d / name}", e) from e
    finally:
        unlink(tmp)


def _join(d: Path, st: State, job: JobId, tier: str) -> Path | None:
    """Become a member of generation ``st.gen`` (owned by ``job``); None when it changed meanwhile."""
    member = _new_member(d, st.gen, job, tier)
    after = read_state(d, tier, members=False)
    if after.gen == st.gen and after.owner_job == job.value:
        return member
    unlink(member)
    return None


def _take(d: Path, st: State, job: JobId, tier: str) -> Path | None:
    """Create generation ``st.gen + 1`` for ``job``; None when another taker (or a joiner) won."""
    gen = st.gen + 1
    judged = {m.path: m.mtime_ns for m in st.members.get(st.gen, [])}
    member = _new_member(d, gen, job, tier)
    rec = {"job": job.value, "job_source": job.source, "gen": gen, "token": secrets.token_hex(8)}
    rec.update(host=HOST, pid=os.getpid(), created_at=time.time())
    if not _publish(d, gen_name(gen), rec, tier):
        unlink(member)
        return None
    after = read_state(d, tier)
    now = {m.path: m.mtime_ns for m in after.members.get(st.gen, [])}
    if after.gen == gen and all(judged.get(p) == t for p, t in now.items()):
        return member
    if after.gen == gen:  # a member of generation st.gen joined or renewed meanwhile: it keeps it
        unlink(d / gen_name(gen))
    unlink(member)
    return None


def _tidy(d: Path, gen: int, watch: Watch) -> None:
    """Remove older generations (oldest first: a holder checks that its own exists and the next does not),
    their members, members of ``gen`` that are gone, and temporary files of crashed takers."""
    with contextlib.suppress(OSError):
        names = os.listdir(d)
        for _, n in sorted((int(m.group(1)), n) for n in names if (m := GEN_RE.fullmatch(n))):
            if int(n[4:]) < gen:
                unlink(d / n)
        for n in names:
            m = MEMBER_RE.fullmatch(n)
            if m and int(m.group(1)) < gen:
                unlink(d / n)
            elif m and int(m.group(1)) == gen:
                got = read_record(d / n)
                rec, mt = got if got else (None, 0)
                member = Member(d / n, None, ProcessId.from_record(rec) if rec else None, mt)
                if got and watch.gone(member):
                    unlink(d / n)
            elif TMP_RE.fullmatch(n) and time.time() - os.lstat(d / n).st_mtime > max(600.0, watch.stale_secs):
                unlink(d / n)


def _busy(tier: str, d: Path, st: State, alive: list[Member], job: JobId, stale_secs: float) -> TierBusyError:
    src = (st.owner or {}).get("job_source")
    holder = f"job {st.owner_job!r}" + (f" (from {src})" if isinstance(src, str) else "") if st.owner_job else "a job"
    who = "; ".join(m.describe() for m in alive[:3]) + (f"; and {len(alive) - 3} more" if len(alive) > 3 else "")
    lease_file = d / gen_name(st.gen)
    first = alive[0].proc
    return TierBusyError(
        f"tier {tier!r}: {d.parent} is leased by {holder}: {who}; lease file {lease_file}. Two jobs saving "
        "into one directory would overwrite each other's checkpoints, so this one may not write there. To go "
        "on: give this job its own directory; or stop that job (its lease is taken over once its processes "
        f"are gone: at once on the same host, {stale_secs:g} s after their last renewal from another host); "
        "or open the hierarchy with readonly=True to only read. Processes of one job share the lease when "
        f"they have the same identity (job=, $TIERCKPT_JOB; this one is {job.value!r}, from {job.source}); "
        "see docs/jobs.md",
        tier=tier, lease_file=str(lease_file), job=st.owner_job, host=first.host if first else None,
        pid=first.pid if first else None, started_at=first.started_at if first else None,
    )  # fmt: skip


class Lease:
    """This process's share of the lease on one tier directory (the module docstring has the protocol).

    Built by :meth:`acquire`; renewed by a background thread until :meth:`release`.

    Attributes:
        directory: the lease directory (``<tier directory>/.tierckpt-lease``).
        tier: the tier's name, for messages.
        job: the job identity it is held for.
        stale_secs: how long a holder on another host may go without renewing before it counts as gone.
        gen: the generation held.
        member: this process's member file.
    """

    def __init__(self, directory: Path, tier: str, job: JobId, stale_secs: float, gen: int, member: Path) -> None:
        self.directory, self.tier, self.job, self.stale_secs = directory, tier, job, stale_secs
        self.gen, self.member = gen, member
        self.lease_file = directory / gen_name(gen)
        self._lost: str | None = None
        self._released = False
        self._failing = False
        self._due = 0.0
        _renewer.add(self)

    @classmethod
    def acquire(
        cls,
        directory: str | os.PathLike[str],
        *,
        tier: str,
        job: str | JobId | None = None,
        stale_secs: float = LEASE_STALE_SECS,
    ) -> Lease:
        """Take (or join, for the same job) the lease on ``directory``; wait at most about ``stale_secs``
        to see whether a holder on another host still renews it.

        Args:
            directory: the tier directory.
            tier: the tier's name, for messages.
            job: the job identity (default: :func:`~tierckpt.tiers.jobs.resolve_job`).
            stale_secs: renewal timeout of holders on other hosts.

        Raises:
            TierBusyError: another job holds it, naming its processes and the lease file.
            TierIOError: the lease directory cannot be created or written.
        """
        if not stale_secs > 0:
            raise ValueError(f"stale_secs must be positive, got {stale_secs!r}")
        jid = job if isinstance(job, JobId) else resolve_job(job)
        d = _lease_dir(Path(directory), tier)
        watch = Watch(stale_secs)
        deadline = time.monotonic() + 2 * stale_secs + 10  # a holder is judged within stale_secs; then races
        poll = min(1.0, max(0.01, stale_secs / 24))
        waiting = False
        while True:
            st = read_state(d, tier, members=False)
            if not (st.gen and st.owner_job == jid.value):  # not a join: the holders are judged
                st = read_state(d, tier)
            young = time.time() - st.owner_mtime_ns / 1e9 < 2.0
            if st.gen and st.owner is None and young:
                pass  # a generation file being filled in (a file system without hard links)
            elif st.gen and st.owner_job == jid.value:
                member = _join(d, st, jid, tier)  # no tidying: a join reads no other member (many ranks)
                if member is not None:
                    return cls(d, tier, jid, stale_secs, st.gen, member)
            else:
                alive, undecided = watch.judge(st.holders())
                if alive:
                    raise _busy(tier, d, st, alive, jid, stale_secs)
                if not undecided:
                    member = _take(d, st, jid, tier)
                    if member is not None:
                        gone = st.holders()
                        _tidy(d, st.gen + 1, watch)
                        if gone:
                            log.warning(
                                "tier %r: took over the lease of %s from job %r, whose processes are gone (%s)",
                                tier, d.parent, st.owner_job, "; ".join(m.describe() for m in gone[:3]),
                            )  # fmt: skip
                        return cls(d, tier, jid, stale_secs, st.gen + 1, member)
                elif not waiting:
                    waiting = True
                    log.warning(
                        "tier %r: %s is leased by job %r on another host (%s); waiting up to %g s to see "
                        "whether it still renews its lease", tier, d.parent, st.owner_job,
                        undecided[0].describe(), stale_secs,
                    )  # fmt: skip
            if time.monotonic() > deadline:
                raise TierBusyError(
                    f"tier {tier!r}: the lease of {d.parent} kept changing hands for {2 * stale_secs + 10:g} s; "
                    "several jobs are starting on this directory at once (docs/jobs.md)",
                    tier=tier, lease_file=str(d),
                )  # fmt: skip
            time.sleep(poll if waiting else random.uniform(0.005, 0.05))

    @property
    def renew_secs(self) -> float:
        """Seconds between two renewals."""
        return self.stale_secs / 6

    @property
    def released(self) -> bool:
        """Whether :meth:`release` gave this process's share up."""
        return self._released

    @property
    def lost(self) -> bool:
        """Whether another job took the lease over (or it was broken by hand) while this one held it."""
        return self._lost is not None

    def check(self) -> None:
        """Raise unless this process still holds the lease (before every write to the tier).

        Raises:
            TierBusyError: the lease was lost or released.
        """
        if self._lost is None and not self._released:
            return
        why = self._lost or "it was released (the tier is closed)"
        raise TierBusyError(
            f"tier {self.tier!r}: this process no longer holds the lease of {self.directory.parent}: {why}; "
            "nothing more is written there (docs/jobs.md)",
            tier=self.tier, lease_file=str(self.lease_file), job=self.job.value,
        )  # fmt: skip

    def renew(self) -> None:
        """Touch this process's member file, then check that nobody took the lease over."""
        if self._released or self._lost is not None:
            return
        now = time.time()
        try:
            os.utime(self.member, (now, now))
        except FileNotFoundError:
            self._lose(f"its member file {self.member} was removed (the lease was broken by hand, or taken over)")
            return
        except OSError as e:
            if not self._failing:
                log.warning("tier %r: cannot renew the lease %s (will retry): %s", self.tier, self.member, e)
            self._failing = True
            return
        self._failing = False
        after = self.directory / gen_name(self.gen + 1)
        if exists(after):
            got = read_record(after)
            job = (got[0] or {}).get("job") if got else None
            self._lose(f"job {job!r} took it over ({after}): was this process stalled for over {self.stale_secs:g} s?")
        elif exists(self.lease_file) is False:
            self._lose(f"its lease file {self.lease_file} was removed (the lease was broken by hand)")

    def _lose(self, why: str) -> None:
        self._lost = why
        _renewer.remove(self)
        log.error(
            "tier %r: lost the lease of %s: %s; saves to it fail from now on", self.tier, self.directory.parent, why
        )

    def release(self) -> None:
        """Give this process's share up (idempotent): another job may take the lease once no process of
        this job holds it."""
        if self._released:
            return
        self._released = True
        _renewer.remove(self)
        try:
            os.unlink(self.member)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("tier %r: cannot release the lease %s: %s", self.tier, self.member, e)


class _Renewer:
    """One daemon thread per process renews every lease it holds, each every ``renew_secs``."""

    def __init__(self) -> None:
        self._leases: set[Lease] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._cond:
            lease._due = time.monotonic() + lease.renew_secs
            self._leases.add(lease)
            if self._thread is None or not self._thread.is_alive():  # none yet, or forked into a child
                self._thread = threading.Thread(target=self._run, name="tierckpt-lease", daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, lease: Lease) -> None:
        with self._cond:
            self._leases.discard(lease)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._leases:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [lease for lease in self._leases if lease._due <= now]
                if not due:
                    self._cond.wait(min(lease._due for lease in self._leases) - now)
                    continue
                for lease in due:
                    lease._due = now + lease.renew_secs
            for lease in due:
                try:
                    lease.renew()
                except Exception:  # never let one tier's problem stop the others' renewals
                    log.exception("tier %r: renewing the lease failed", lease.tier)


_renewer = _Renewer()
