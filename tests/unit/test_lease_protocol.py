"""The lease protocol of tierckpt.tiers._lease on one directory: holders planted by hand (dead, alive,
reused pids, other hosts that renew or not), races between takers, and a holder that loses its lease."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt import TierBusyError, TierIOError
from tierckpt.tiers import _lease
from tierckpt.tiers._lease import LEASE_DIR, Lease
from tierckpt.tiers.jobs import JobId, _proc_stat, current_process


@pytest.fixture
def leases() -> Iterator[list[Lease]]:
    made: list[Lease] = []
    yield made
    for lease in made:
        lease.release()


def acquire(path: Path, job: str, made: list[Lease], stale_secs: float = 60.0) -> Lease:
    lease = Lease.acquire(path, tier="t", job=job, stale_secs=stale_secs)
    made.append(lease)
    return lease


def plant(path: Path, gen: int, job: str, pid: int, mtime: float | None = None, **proc: Any) -> Path:
    """A generation file of ``job`` and one member process of it (this host, unless ``proc`` says)."""
    d = path / LEASE_DIR
    d.mkdir(parents=True, exist_ok=True)
    gen_file = d / f"gen-{gen}"
    if not gen_file.exists():
        gen_file.write_text(json.dumps({"job": job, "job_source": "job=", "gen": gen, "token": "planted"}))
    me = current_process()
    rec = {"job": job, "job_source": "job=", "host": me.host, "boot_id": me.boot_id, "pid_ns": me.pid_ns}
    rec.update({"pid": pid, "start_ticks": None, "started_at": None, **proc})
    member = d / f"gen-{gen}.{secrets.token_hex(8)}.member"
    member.write_text(json.dumps(rec))
    if mtime is not None:
        os.utime(member, (mtime, mtime))
    return member


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def names(path: Path) -> list[str]:
    return sorted(p.name for p in (path / LEASE_DIR).iterdir())


def renewing(member: Path, every: float) -> tuple[threading.Event, threading.Thread]:
    """A holder on another host, alive: touches its member file every ``every`` seconds."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            os.utime(member)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return stop, t


def test_dead_holder_on_this_host_is_taken_over(tmp_path: Path, leases: list[Lease]) -> None:
    plant(tmp_path, 3, "old", dead_pid())
    lease = acquire(tmp_path, "new", leases)
    assert (lease.gen, lease.job) == (4, JobId("new", "job="))
    assert names(tmp_path) == ["gen-4", lease.member.name]  # the dead one's files are removed


def test_live_holder_is_refused_and_a_reused_pid_is_not_the_holder(tmp_path: Path, leases: list[Lease]) -> None:
    parent = os.getppid()  # alive for as long as this test runs
    stat = _proc_stat(parent)
    assert stat is not None
    plant(tmp_path / "a", 1, "old", parent, start_ticks=stat[1])
    with pytest.raises(TierBusyError, match=f"pid {parent} on host") as info:
        acquire(tmp_path / "a", "new", leases)
    assert info.value.pid == parent and info.value.job == "old"
    # the same pid with another start time is another process: the holder is gone
    plant(tmp_path / "b", 1, "old", parent, start_ticks=stat[1] + 1)
    assert acquire(tmp_path / "b", "new", leases).gen == 2


def test_other_host_renewing_is_refused_after_it_is_seen_renewing(tmp_path: Path, leases: list[Lease]) -> None:
    member = plant(tmp_path, 1, "old", dead_pid(), host="elsewhere")
    stop, t = renewing(member, 0.1)
    try:
        t0 = time.monotonic()
        with pytest.raises(TierBusyError, match="on host elsewhere") as info:
            acquire(tmp_path, "new", leases, stale_secs=10.0)
        assert time.monotonic() - t0 < 5  # refused once seen renewing, not after stale_secs
        assert info.value.host == "elsewhere"
    finally:
        stop.set()
        t.join()


def test_same_host_other_pid_namespace_is_judged_by_renewal_not_by_pid(tmp_path: Path, leases: list[Lease]) -> None:
    """A container on this host with its own pid namespace: its pid means nothing here (this one is dead
    here), so only its renewals count, and it renews."""
    member = plant(tmp_path, 1, "old", dead_pid(), pid_ns="pid:[1]")
    stop, t = renewing(member, 0.1)
    try:
        with pytest.raises(TierBusyError):
            acquire(tmp_path, "new", leases, stale_secs=10.0)
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize(("age", "low", "high"), [(10.0, 0.0, 2.5), (0.0, 2.4, 15.0), (-30.0, 2.9, 15.0)])
def test_other_host_not_renewing_is_taken_over_once_stale(
    tmp_path: Path, leases: list[Lease], age: float, low: float, high: float
) -> None:
    """Last renewed ``age`` s ago by this host's clock: older than stale_secs (3 s) goes at once; a
    recent one after it has been watched for stale_secs; one dated in the future (a clock ahead of ours)
    too, by watching: the clocks need not agree for that."""
    plant(tmp_path, 1, "old", 1, mtime=time.time() - age, host="elsewhere")
    t0 = time.monotonic()
    lease = acquire(tmp_path, "new", leases, stale_secs=3.0)
    assert low <= time.monotonic() - t0 < high
    assert lease.gen == 2


def test_exactly_one_of_many_simultaneous_takers_wins(tmp_path: Path, leases: list[Lease]) -> None:
    """Rounds of 4 threads, each another job, take over a dead holder's lease at once: one wins, the
    others are refused naming the winner (alive: it is this process)."""
    for rnd in range(15):
        path = tmp_path / f"r{rnd}"
        plant(path, 1, "dead", dead_pid() if rnd == 0 else 999_999_999)
        barrier = threading.Barrier(4)
        won: list[Lease] = []
        refused: list[str] = []

        def take(
            i: int, path: Path = path, barrier: threading.Barrier = barrier, won: list[Lease] = won,
            refused: list[str] = refused,
        ) -> None:  # fmt: skip
            barrier.wait()
            try:
                won.append(Lease.acquire(path, tier="t", job=f"job{i}", stale_secs=60))
            except TierBusyError as e:
                refused.append(e.job or "")

        threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        leases.extend(won)
        assert len(won) == 1 and len(refused) == 3, (rnd, won, refused)
        assert set(refused) == {won[0].job.value}
        gens = [n for n in names(path) if not n.endswith(".member")]
        assert gens == [f"gen-{won[0].gen}"] and won[0].gen == 2


class StalledTaker:
    """A thread taking the lease for ``job`` that stalls after judging it free, before it creates the
    next generation, until :meth:`resume`; then :attr:`errors` holds what its acquire raised."""

    def __init__(self, path: Path, job: str, leases: list[Lease], monkeypatch: pytest.MonkeyPatch) -> None:
        self.judged, self.go = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        real = _lease._publish

        def slow_publish(d: Path, name: str, rec: dict[str, Any], tier: str) -> bool:
            if rec["job"] == job:
                self.judged.set()
                assert self.go.wait(30)
            return real(d, name, rec, tier)

        def run() -> None:
            try:
                leases.append(Lease.acquire(path, tier="t", job=job, stale_secs=60))
            except BaseException as e:
                self.errors.append(e)

        monkeypatch.setattr(_lease, "_publish", slow_publish)
        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.judged.wait(30)

    def resume(self) -> None:
        self.go.set()
        self.thread.join()


def test_a_taker_delayed_between_judging_and_creating_loses(
    tmp_path: Path, leases: list[Lease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A judges the dead holder's generation free, then stalls before creating generation 2; B takes it
    over meanwhile. A's create then fails (the name exists), and A is refused naming B."""
    plant(tmp_path, 1, "dead", dead_pid())
    a = StalledTaker(tmp_path, "A", leases, monkeypatch)
    b = acquire(tmp_path, "B", leases)
    a.resume()
    assert b.gen == 2 and len(a.errors) == 1 and isinstance(a.errors[0], TierBusyError), a.errors
    assert a.errors[0].job == "B"
    assert [n for n in names(tmp_path) if not n.endswith(".member")] == ["gen-2"]


def test_a_taker_and_a_joiner_never_both_hold_it(
    tmp_path: Path, leases: list[Lease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation 1 of job J has no member left (released): B judges it free and stalls before creating
    generation 2, while a process of J joins generation 1. B then sees the new member and backs off."""
    plant(tmp_path, 1, "J", dead_pid())
    for m in (tmp_path / LEASE_DIR).glob("*.member"):
        m.unlink()
    b = StalledTaker(tmp_path, "B", leases, monkeypatch)
    joiner = acquire(tmp_path, "J", leases)
    b.resume()
    assert joiner.gen == 1 and len(b.errors) == 1 and isinstance(b.errors[0], TierBusyError), b.errors
    assert [n for n in names(tmp_path) if not n.endswith(".member")] == ["gen-1"]
    joiner.renew()
    assert not joiner.lost


def test_renewal_touches_the_member_file(tmp_path: Path, leases: list[Lease]) -> None:
    lease = acquire(tmp_path, "A", leases, stale_secs=0.6)  # renewed every 0.1 s
    before = lease.member.stat().st_mtime_ns
    deadline = time.monotonic() + 5
    while lease.member.stat().st_mtime_ns == before:
        assert time.monotonic() < deadline, "not renewed"
        time.sleep(0.02)
    lease.release()
    assert not lease.member.exists()
    deadline = time.monotonic() + 5
    while _lease._renewer._thread is not None:  # nothing left to renew: the thread ends
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["taken over", "broken by hand"])
def test_a_holder_that_lost_its_lease_writes_no_more(tmp_path: Path, how: str) -> None:
    from tierckpt.facade.engines import Engines
    from tierckpt.format.manifest import BlobEntry
    from tierckpt.tiers.base import CheckpointKey
    from tierckpt.tiers.local import LocalTier

    engines = Engines()
    tier = LocalTier("ssd", tmp_path, engines.get("threads", 2), job="A")
    try:
        assert tier.lease is not None
        if how == "taken over":  # what another job does once this one failed to renew for stale_secs
            plant(tmp_path, tier.lease.gen + 1, "B", dead_pid())
        else:
            for p in (tmp_path / LEASE_DIR).iterdir():
                p.unlink()
        tier.lease.renew()
        assert tier.lease.lost
        with pytest.raises(TierBusyError, match="no longer holds the lease") as info:
            tier.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", 4096)])
        assert "'B' took it over" in str(info.value) if how == "taken over" else "removed" in str(info.value)
        with pytest.raises(TierBusyError):
            tier.evict(CheckpointKey(1))
    finally:
        tier.close()
        engines.close()


def test_lease_directory_that_is_not_one_is_refused(tmp_path: Path, leases: list[Lease]) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / LEASE_DIR).write_text("x")
    (tmp_path / "b").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "b" / LEASE_DIR).symlink_to(tmp_path / "elsewhere")
    for d in ("a", "b"):
        with pytest.raises(TierIOError, match="is not a directory"):
            acquire(tmp_path / d, "A", leases)
    assert not list((tmp_path / "elsewhere").iterdir())


def test_junk_in_the_lease_directory_neither_hangs_nor_counts(tmp_path: Path, leases: list[Lease]) -> None:
    """A FIFO and a symlink named like members, a directory named like a generation, and a generation
    file that is not JSON (old enough not to be one being written)."""
    d = tmp_path / LEASE_DIR
    d.mkdir()
    os.mkfifo(d / f"gen-3.{'0' * 16}.member")
    (d / f"gen-3.{'1' * 16}.member").symlink_to("/dev/zero")
    (d / "gen-2").mkdir()
    (d / "gen-3").write_bytes(b"\x00garbage")
    os.utime(d / "gen-3", (time.time() - 100, time.time() - 100))
    lease = acquire(tmp_path, "A", leases)  # generation 3 has no member: free
    assert lease.gen == 4


def test_acquire_refuses_a_bad_stale_secs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stale_secs must be positive"):
        Lease.acquire(tmp_path, tier="t", job="A", stale_secs=0)


def test_without_hard_links_the_generation_is_created_exclusively(
    tmp_path: Path, leases: list[Lease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses link() (EPERM): the generation file is created with O_EXCL instead,
    so a second taker of the same generation still loses."""
    import errno

    def no_link(*a: Any, **k: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    plant(tmp_path, 1, "dead", dead_pid())
    lease = acquire(tmp_path, "A", leases)
    assert lease.gen == 2 and json.loads((tmp_path / LEASE_DIR / "gen-2").read_text())["job"] == "A"
    assert not _lease._publish(tmp_path / LEASE_DIR, "gen-2", {"job": "B", "token": "t"}, "t")
    with pytest.raises(TierBusyError, match="job 'A'"):
        acquire(tmp_path, "B", leases)
    assert not [n for n in names(tmp_path) if n.startswith("tmp-")]


def test_a_record_read_whole_survives_a_close_that_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GlusterFS's FUSE client answers the close of a file another process removed meanwhile with ENOENT
    (four ranks taking one directory's lease together): the record was read whole, so it stands."""
    import errno

    from tierckpt.tiers import _lease_state

    rec = tmp_path / "gen-1"
    rec.write_text('{"job": "a"}')
    real_close = os.close

    def close(fd: int) -> None:
        real_close(fd)
        raise OSError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(_lease_state.os, "close", close)
    got = _lease_state.read_record(rec)
    assert got is not None and got[0] == {"job": "a"}
