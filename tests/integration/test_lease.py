"""Job leases on file tiers (docs/jobs.md): one job per tier directory, named when refused, taken over
when its holder is gone, shared by the processes of one job; readers need none.

The two-process tests run a small child script (written to tmp_path) that opens a hierarchy and obeys
commands on stdin; the parent is the second process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import ConfigError, Hierarchy, TierBusyError
from tierckpt.tiers._lease import LEASE_DIR
from tierckpt.tiers.jobs import JOB_ENV_VARS, resolve_job

REPO = Path(__file__).resolve().parents[2]
TIERS = ("ssd", "pfs")


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in JOB_ENV_VARS:  # a CI runner under SLURM must not make every process one job
        monkeypatch.delenv(var, raising=False)


def config(root: Path, **lease: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "tiers": [
            {"name": "host", "kind": "host", "capacity": "64MiB"},
            {"name": "ssd", "kind": "local", "path": str(root / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(root / "pfs")},
        ],
        "io": {"chunk": "1MiB"},
    }
    if lease:
        cfg["lease"] = lease
    return cfg


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


CHILD = """
import json, os, sys
from tierckpt import Hierarchy, TierBusyError
import torch

root, job = sys.argv[1], sys.argv[2]
cfg = json.loads(sys.argv[3])
try:
    h = Hierarchy.from_config(cfg, job=None if job == "-" else job)
except TierBusyError as e:
    print("BUSY " + json.dumps({"pid": e.pid, "job": e.job, "host": e.host, "msg": str(e)}), flush=True)
    sys.exit(3)
print("READY %d %s" % (os.getpid(), h.job), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "save":
        s = int(args[0])
        h.save({"w": torch.full((1000,), float(s)), "step": s}, step=s).wait()
        print("SAVED %d" % s, flush=True)
    elif cmd == "close":
        h.close()
        print("CLOSED", flush=True)
    else:
        break
"""


class Child:
    """A second process holding (or trying to take) the lease of ``root``'s tiers."""

    def __init__(self, tmp_path: Path, root: Path, job: str | None, env: dict[str, str] | None = None, **lease: Any):
        script = tmp_path / "lease_child.py"
        script.write_text(textwrap.dedent(CHILD))
        full_env = {k: v for k, v in os.environ.items() if k not in JOB_ENV_VARS}
        full_env.update(PYTHONPATH=str(REPO), **(env or {}))
        args = [str(root), job or "-", json.dumps(config(root, **lease))]
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        )  # fmt: skip

    def line(self) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline().strip()
        if not out:
            raise AssertionError(f"child ended: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return out

    def send(self, cmd: str, expect: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        out = self.line()
        assert out.startswith(expect), out
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=60)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Any]:
    made: list[Child] = []

    def make(root: Path, job: str | None, **kw: Any) -> Child:
        c = Child(tmp_path, root, job, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


# -- two processes -------------------------------------------------------------------------------------
def test_second_writer_is_refused_naming_the_first_until_it_closes(tmp_path: Path, children: Any) -> None:
    root = tmp_path / "ckpt"
    first = children(root, "train-A")
    ready = first.line()
    assert ready.startswith("READY"), ready
    pid = int(ready.split()[1])
    first.send("save 1", "SAVED 1")

    with pytest.raises(TierBusyError) as info:
        Hierarchy.from_config(config(root), job="train-B")
    e = info.value
    assert isinstance(e, BlockingIOError)
    assert (e.tier, e.pid, e.job, e.host) == ("ssd", pid, "train-A", socket.gethostname())
    assert e.started_at is not None and abs(e.started_at - first.started) < 30
    assert e.lease_file is not None and Path(e.lease_file).is_file()
    msg = str(e)
    for part in (f"pid {pid}", "job 'train-A'", e.lease_file, "readonly=True", "'train-B'", "started 20"):
        assert part in msg, (part, msg)
    assert not list((root / "pfs").glob("step-*/.tmp-*"))  # the refused job wrote nothing

    # an evaluation job reads while the writer holds the lease, and takes none
    with Hierarchy.from_config(config(root), readonly=True) as reader:
        assert reader.job is None
        assert reader.restore()["step"] == 1
    assert len(list((root / "ssd" / LEASE_DIR).glob("*.member"))) == 1

    first.send("close", "CLOSED")
    with Hierarchy.from_config(config(root), job="train-B") as h:
        assert h.restore()["step"] == 1
        h.save(state(2), step=2).wait()
    with Hierarchy.from_config(config(root), readonly=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1, 2]


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_a_sigkilled_holder_is_taken_over(tmp_path: Path, children: Any, reap: bool) -> None:
    """Killed with SIGKILL (its lease files stay behind), the holder is gone: the next job takes over at
    once, even while the dead process is an unreaped zombie whose pid still exists."""
    root = tmp_path / "ckpt"
    first = children(root, "train-A")
    assert first.line().startswith("READY")
    first.send("save 1", "SAVED 1")
    first.proc.send_signal(signal.SIGKILL)
    if reap:
        first.proc.wait(timeout=30)
    else:  # a zombie until its parent (us) waits for it
        deadline = time.monotonic() + 30
        while Path(f"/proc/{first.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert list((root / "ssd" / LEASE_DIR).glob("*.member"))  # left behind by the dead holder
    t0 = time.monotonic()
    with Hierarchy.from_config(config(root), job="train-B") as h:
        assert time.monotonic() - t0 < 30  # no waiting for the 60 s renewal timeout on the same host
        assert h.restore()["step"] == 1
        h.save(state(2), step=2).wait()
        for t in TIERS:  # the dead holder's generation and member files are gone
            names = sorted(p.name for p in (root / t / LEASE_DIR).iterdir())
            assert [n for n in names if not n.endswith(".member")] == ["gen-2"], names


def test_two_processes_of_one_job_share_the_lease(tmp_path: Path, children: Any, monkeypatch: Any) -> None:
    """The identity comes from $TIERCKPT_JOB in both processes (as a launcher would set it); a third
    process of another job is refused while either holds it."""
    root = tmp_path / "ckpt"
    monkeypatch.setenv("TIERCKPT_JOB", "run-7")
    other = children(root, None, env={"TIERCKPT_JOB": "run-7"})
    ready = other.line()
    assert ready.split()[2] == "run-7", ready
    with Hierarchy.from_config(config(root)) as h:
        assert h.job == "run-7"
        assert len(list((root / "pfs" / LEASE_DIR).glob("*.member"))) == 2
        other.send("save 11", "SAVED 11")
        h.save(state(12), step=12).wait()
        with pytest.raises(TierBusyError, match=f"pid {other.proc.pid} on host") as info:
            Hierarchy.from_config(config(root), job="run-8")  # another job, while both processes hold it
        assert info.value.job == "run-7"
        other.send("close", "CLOSED")
        with pytest.raises(TierBusyError, match=f"pid {os.getpid()} on host"):  # this process still holds it
            Hierarchy.from_config(config(root), job="run-8")
        assert h.restore(11)["step"] == 11 and h.restore()["step"] == 12


# -- in one process: the rules, with planted holders ------------------------------------------------------
def test_same_process_other_job_is_refused_and_same_job_joins(tmp_path: Path) -> None:
    with Hierarchy.from_config(config(tmp_path), job="A") as h:
        with pytest.raises(TierBusyError, match=f"pid {os.getpid()} on host"):
            Hierarchy.from_config(config(tmp_path), job="B")
        with Hierarchy.from_config(config(tmp_path), job="A") as h2:
            h2.save(state(1), step=1).wait()
        h.save(state(2), step=2).wait()  # the first still holds it
        assert [p.name for p in (tmp_path / "ssd" / LEASE_DIR).iterdir() if p.suffix == ".member"] != []
    assert not list((tmp_path / "ssd" / LEASE_DIR).glob("*.member"))  # released by close()


def test_default_identity_is_one_per_process(tmp_path: Path) -> None:
    """Without job= or a launcher's variable, every hierarchy of this process is one job; another
    process (a child here) is another job."""
    a, b = resolve_job(), resolve_job()
    assert a == b and a.source == "process" and str(os.getpid()) in a.value
    with Hierarchy.from_config(config(tmp_path)) as h, Hierarchy.from_config(config(tmp_path)) as h2:
        assert h.job == h2.job == a.value
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child is a process, and a job, of its own
        os.write(w, resolve_job().value.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    child = os.read(r, 4096).decode()
    os.close(r)
    assert child.startswith("process-") and child != a.value and str(pid) in child


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"TIERCKPT_JOB": "mine", "SLURM_JOB_ID": "42"}, ("mine", "TIERCKPT_JOB")),
        ({"TORCHELASTIC_RUN_ID": "r1", "SLURM_JOB_ID": "42"}, ("r1", "TORCHELASTIC_RUN_ID")),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}, ("42", "SLURM_JOB_ID")),  # torchrun's default
        ({"PBS_JOBID": "7.pbs"}, ("7.pbs", "PBS_JOBID")),
        ({"LSB_JOBID": "99"}, ("99", "LSB_JOBID")),
    ],
)
def test_job_identity_from_the_environment(monkeypatch: Any, env: dict[str, str], want: tuple[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = resolve_job()
    assert (got.value, got.source) == want
    assert resolve_job("explicit").value == "explicit"


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "tab\there", "nl\n"])
def test_bad_job_identity_is_refused(tmp_path: Path, monkeypatch: Any, bad: str) -> None:
    with pytest.raises(ConfigError, match="job: a job identity"):
        Hierarchy.from_config(config(tmp_path), job=bad)
    assert not (tmp_path / "ssd").exists()  # refused before any directory is made
    if bad:
        monkeypatch.setenv("TIERCKPT_JOB", bad)
        with pytest.raises(ConfigError, match=r"\$TIERCKPT_JOB: a job identity"):
            Hierarchy.from_config(config(tmp_path))


def test_lease_config(tmp_path: Path) -> None:
    from tierckpt.config import parse_config

    assert parse_config(config(tmp_path, stale_secs=5)).tiers[1].lease_stale_secs == 5.0
    assert parse_config(config(tmp_path)).tiers[2].lease_stale_secs == 60.0
    for bad in (0, 0.5, -1, "10s", True, 1e9):
        with pytest.raises(ConfigError, match="lease.stale_secs: expected a number of seconds"):
            parse_config(config(tmp_path, stale_secs=bad))
    with pytest.raises(ConfigError, match="lease.job: unknown key"):
        parse_config(config(tmp_path, job="x"))


def test_hierarchy_job_must_match_its_tiers_leases(tmp_path: Path) -> None:
    from tierckpt.facade.engines import Engines
    from tierckpt.tiers.local import LocalTier

    engines = Engines()
    tier = LocalTier("ssd", tmp_path / "ssd", engines.get("threads", 4), job="A")
    try:
        with pytest.raises(ConfigError, match="tier 'ssd' holds its lease for job 'A', not 'B'"):
            Hierarchy([tier], job="B", _engines=engines)
        h = Hierarchy([tier], _engines=engines)
        assert h.job == "A"
        h.close()  # closes the tier: the lease is released
        assert tier.lease is not None and not list((tmp_path / "ssd" / LEASE_DIR).glob("*.member"))
    finally:
        engines.close()


def test_a_tiers_lease_is_read_through_the_tier_contract(tmp_path: Path) -> None:
    """``Tier.lease_job()`` is what a hierarchy checks: a tier kind of one's own that leases its place
    declares it, and a wrapper (FaultyTier) hands on its inner tier's (it hid it: a hierarchy of job B
    took a directory leased for job A)."""
    from tierckpt.facade.engines import Engines
    from tierckpt.testing import FaultyTier
    from tierckpt.tiers.host import HostTier
    from tierckpt.tiers.local import LocalTier

    class Leased(HostTier):  # a kind of one's own whose place is leased to job A
        def lease_job(self) -> str | None:
            return "A"

    with pytest.raises(ConfigError, match="tier 'mem' holds its lease for job 'A', not 'B'"):
        Hierarchy([Leased("mem")], job="B")
    h = Hierarchy([Leased("mem")])
    assert h.job == "A" and HostTier("x").lease_job() is None
    h.close()
    engines = Engines()
    tier = LocalTier("ssd", tmp_path / "ssd", engines.get("threads", 4), job="A")
    try:
        assert tier.lease_job() == "A" and FaultyTier(tier).lease_job() == "A"
        with pytest.raises(ConfigError, match="tier 'ssd' holds its lease for job 'A', not 'B'"):
            Hierarchy([FaultyTier(tier)], job="B", _engines=engines)
    finally:
        tier.close()
        engines.close()
    ro = LocalTier("ssd", tmp_path / "ssd", readonly=True)
    assert ro.lease_job() is None  # a reader holds no lease
    ro.close()


def test_a_hierarchy_that_lost_a_lease_saves_to_its_other_tiers_only(tmp_path: Path) -> None:
    """Stalled past stale_secs, this process's ssd lease went to job B: the next save fails on the ssd
    with TierBusyError naming B, and still reaches host and pfs; nothing on the ssd is evicted."""
    with Hierarchy.from_config(config(tmp_path), job="A") as h:
        h.save(state(1), step=1).wait()
        ssd = h.tier("ssd")
        lease = ssd.lease  # type: ignore[attr-defined]
        (tmp_path / "ssd" / LEASE_DIR / f"gen-{lease.gen + 1}").write_text(json.dumps({"job": "B"}))
        lease.renew()
        handle = h.save(state(2), step=2)
        with pytest.raises(TierBusyError, match="job 'B' took it over") as info:
            handle.wait()
        assert info.value.tier == "ssd"
        handle.wait(tier="pfs")  # copied from the host instead
        assert {c.step: c.tiers for c in h.checkpoints()} == {1: ("host", "ssd", "pfs"), 2: ("host", "pfs")}
        assert h.restore()["step"] == 2
