"""``Hierarchy.delete(step)``: the step leaves every tier (records first, then copies, as eviction does);
the work of this hierarchy on the step is waited for; a reader that opened the step reads it whole; an
unknown step, a read-only hierarchy and a record that cannot be removed are named errors; a deletion
killed at any point leaves whole steps or copies nothing lists (which retention then removes); the
step's number may be saved again."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointNotFoundError, Hierarchy, TierckptError
from tierckpt.testing import FaultyTier
from tierckpt.tiers.base import Tier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier


def state(step: int, n: int = 4096) -> dict[str, Any]:
    return {"w": torch.arange(float(n)) + 1000 * step, "meta": {"step": step}}


def same(got: dict[str, Any], step: int) -> bool:
    return torch.equal(got["w"], state(step)["w"]) and got["meta"] == {"step": step}


def on_disk(path: Path) -> list[str]:
    """What a file tier's directory holds besides its lease: step directories, scratch."""
    return sorted(p.name for p in path.iterdir() if p.name != ".tierckpt-lease") if path.exists() else []


def steps(h: Hierarchy) -> dict[int, tuple[str, ...]]:
    return {c.step: c.tiers for c in h.checkpoints()}


class Gate(threading.Event):
    """A gate of a FaultyTier that says when a call has reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.reached.set()
        return super().wait(timeout)


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_deleted_step_leaves_every_tier_and_may_be_saved_again(chain_config: Any, tmp_path: Path) -> None:
    with Hierarchy.from_config(chain_config(keep={"host": 3})) as h:
        for s in (1, 2, 3):
            h.save(state(s), step=s, blocking=True)
        assert steps(h)[2] == ("host", "ssd", "pfs")
        h.delete(2)
        assert steps(h) == {1: ("host", "ssd", "pfs"), 3: ("host", "ssd", "pfs")}
        for tier in (None, "host", "ssd", "pfs"):
            with pytest.raises(CheckpointNotFoundError, match="committed steps: \\[1, 3\\]"):
                h.restore(step=2, tier=tier)
        h.delete(3)  # the newest: restore() goes back to the one before
        assert same(h.restore(), 1) and h.last_restore == (1, "host")
        h.save(state(22), step=2, blocking=True)  # a deleted step's number, saved again
        got = h.restore(step=2)
        assert torch.equal(got["w"], state(22)["w"]) and h.restore()["meta"] == {"step": 22}
        assert [c.step for c in h.checkpoints()] == [1, 2]
    for tier in ("ssd", "pfs"):  # the deleted copies' files are gone once close() returns; no scratch left
        assert on_disk(tmp_path / tier) == ["step-000000000001", "step-000000000002"], tier
    with Hierarchy.from_config(chain_config(), readonly=True) as r:  # what a later process sees
        assert steps(r) == {1: ("ssd", "pfs"), 2: ("ssd", "pfs")}
        assert r.verify() == [(s, t, None) for s in (1, 2) for t in ("ssd", "pfs")]


def test_an_unknown_step_a_bad_step_and_a_read_only_hierarchy_are_named_errors(chain_config: Any) -> None:
    with Hierarchy.from_config(chain_config()) as h:
        for s in (1, 2):
            h.save(state(s), step=s, blocking=True)
        with pytest.raises(CheckpointNotFoundError, match=r"cannot delete step 7: .*committed steps: \[1, 2\]") as e:
            h.delete(7)
        assert isinstance(e.value, FileNotFoundError)
        for bad in (-1, True, 1.0, "1"):
            with pytest.raises(ValueError, match="step must be an int"):
                h.delete(bad)  # type: ignore[arg-type]
    with Hierarchy.from_config(chain_config(), readonly=True) as r:
        with pytest.raises(TierckptError, match="cannot delete: the hierarchy was opened read-only"):
            r.delete(1)
        assert sorted(steps(r)) == [1, 2]


def _chain(tmp_path: Path, pfs: Tier | None = None) -> list[Tier]:
    return [
        HostTier("host"),
        LocalTier("ssd", tmp_path / "ssd", chunk_bytes=1 << 20),
        pfs or PfsTier("pfs", tmp_path / "pfs", chunk_bytes=1 << 20),
    ]


def test_delete_waits_for_the_steps_demotion_in_flight(tmp_path: Path) -> None:
    """The demotion to pfs is held mid-commit: delete() waits for it, then removes the copy it made too
    (never a copy that a demotion finishing after the deletion puts back)."""
    gate = Gate()
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", chunk_bytes=1 << 20), gates={"commit": gate})
    with Hierarchy(_chain(tmp_path, pfs)) as h:
        handle = h.save(state(1), step=1)
        try:
            assert gate.reached.wait(30)
            deleting, out = in_thread(lambda: h.delete(1))
            deleting.join(0.3)
            assert deleting.is_alive() and steps(h)[1] == ("host", "ssd")  # waiting; nothing removed yet
            assert h.checkpoints()[0].states["pfs"] == "writing"
        finally:
            gate.set()
        deleting.join(30)
        assert out == [None]
        handle.wait()  # the save itself succeeded everywhere
        assert steps(h) == {}
        with pytest.raises(CheckpointNotFoundError):
            h.restore()
    assert on_disk(tmp_path / "ssd") == [] and on_disk(tmp_path / "pfs") == []


def test_delete_waits_for_a_prefetch_of_the_step(tmp_path: Path) -> None:
    gate = Gate()
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", chunk_bytes=1 << 20), gates={"read": gate})
    with Hierarchy(_chain(tmp_path, pfs), policy={"keep": {"host": 1, "ssd": 1}}) as h:
        gate.set()
        for s in (1, 2):
            h.save(state(s), step=s, blocking=True)
        assert steps(h) == {1: ("pfs",), 2: ("host", "ssd", "pfs")}
        gate.clear()
        gate.reached.clear()
        climbing = h.prefetch(1)
        try:
            assert gate.reached.wait(30)
            deleting, out = in_thread(lambda: h.delete(1))
            deleting.join(0.3)
            assert deleting.is_alive()
        finally:
            gate.set()
        deleting.join(30)
        assert out == [None] and climbing.result(30) == "host"  # the prefetch ended, then the step went
        assert steps(h) == {2: ("host", "ssd", "pfs")}
        with pytest.raises(CheckpointNotFoundError):
            h.restore(step=1, tier="host")


def test_a_step_deleted_while_a_prefetch_plans_it_is_not_copied_back(tmp_path: Path) -> None:
    """Another thread deletes the step between the prefetch's finding it and its copy being queued: the
    prefetch fails naming the deletion, and no trace of the step comes back (no copy, no failed state)."""
    with Hierarchy(_chain(tmp_path), policy={"keep": {"host": 1, "ssd": 1}}) as h:
        for s in (1, 2):
            h.save(state(s), step=s, blocking=True)
        planned = h._planner.prefetch
        h._planner.prefetch = lambda info, to: (h.delete(info.step), planned(info, to))[1]  # type: ignore[method-assign]
        with pytest.raises(CheckpointNotFoundError, match="step 1 was deleted"):
            h.prefetch(1).result(30)
        assert [c.step for c in h.checkpoints()] == [2]
        h._planner.prefetch = planned  # type: ignore[method-assign]
        h.save(state(11), step=1, blocking=True)  # saved again: it may climb again
        assert h.prefetch(1).result(30) == "host"


def test_a_reader_that_opened_the_step_reads_it_whole_while_it_is_deleted(tmp_path: Path) -> None:
    """Another process's read-only hierarchy (here: another Hierarchy of this process) has opened step 1's
    pfs copy when the training job deletes the step: it reads every byte of it, verified."""
    with Hierarchy(_chain(tmp_path)[1:]) as h:
        for s in (1, 2):
            h.save(state(s, n=1 << 18), step=s, blocking=True)
        gate = Gate()
        seen = FaultyTier(PfsTier("pfs", tmp_path / "pfs", readonly=True), gates={"read": gate})
        with Hierarchy([seen], readonly=True) as reader:
            reading, out = in_thread(lambda: reader.restore(step=1))
            try:
                assert gate.reached.wait(30)  # the copy is open, its first read held
                h.delete(1)
                assert 1 not in steps(h)
            finally:
                gate.set()
            reading.join(30)
            assert torch.equal(out[0]["w"], state(1, n=1 << 18)["w"])
            with pytest.raises(CheckpointNotFoundError):  # a restore that starts now does not see it
                reader.restore(step=1)


def test_a_record_that_cannot_be_removed_leaves_the_step_whole_there(tmp_path: Path) -> None:
    eio = OSError(errno.EIO, "Input/output error")
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", chunk_bytes=1 << 20), fail={"remove_record": eio})
    with Hierarchy(_chain(tmp_path, pfs)[1:]) as h:
        for s in (1, 2):
            h.save(state(s), step=s, blocking=True)
        with pytest.raises(TierckptError, match=r"step 1 is still committed on tiers \['pfs'\]"):
            h.delete(1)
        # ssd's record went first (so its copy is unlisted), pfs's could not: the plan stopped there, and
        # the step is still committed, whole, on pfs
        assert steps(h) == {1: ("pfs",), 2: ("ssd", "pfs")}
        assert same(h.restore(step=1), 1) and h.last_restore == (1, "pfs")
        pfs.fail.clear()
        h.delete(1)
        assert steps(h) == {2: ("ssd", "pfs")}
        h.save(state(3), step=3, blocking=True)  # its retention pass removes ssd's unlisted copy of step 1
    assert on_disk(tmp_path / "ssd") == ["step-000000000002", "step-000000000003"]
    assert on_disk(tmp_path / "pfs") == ["step-000000000002", "step-000000000003"]


_CHILD = """
import os, signal, sys, torch
from tierckpt import Hierarchy
from tierckpt.tiers._files import FileTier

root, point = sys.argv[1], sys.argv[2]
cfg = {"tiers": [{"name": "ssd", "kind": "local", "path": root + "/ssd"},
                 {"name": "pfs", "kind": "pfs", "path": root + "/pfs"}]}
h = Hierarchy.from_config(cfg)
for s in (1, 2):
    h.save({"w": torch.arange(4096.0) + 1000 * s, "meta": {"step": s}}, step=s, blocking=True)
calls = {"remove_record": 0, "evict": 0}

def dying(name, real):
    def call(self, *args, **kwargs):
        calls[name] += 1
        if (name, calls[name]) == (point, 2 if point == "remove_record" else 1):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)
    return call

FileTier.remove_record = dying("remove_record", FileTier.remove_record)
FileTier.evict = dying("evict", FileTier.evict)
h.delete(1)
"""


@pytest.mark.parametrize("point", ["remove_record", "evict"])
def test_a_deletion_killed_midway_leaves_whole_steps_or_unlisted_copies(tmp_path: Path, point: str) -> None:
    """SIGKILL after ssd's record went and before pfs's (``remove_record``), or after every record went
    and before any copy (``evict``): what is listed is whole, nothing is reported damaged, and the next
    job's retention removes the copies nothing lists."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), point], env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL
    cfg = {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ]
    }
    with Hierarchy.from_config(cfg, readonly=True) as r:
        listed = {1: ("pfs",), 2: ("ssd", "pfs")} if point == "remove_record" else {2: ("ssd", "pfs")}
        assert steps(r) == listed
        assert all(err is None for _, _, err in r.verify())
        for s in listed:
            assert same(r.restore(step=s), s)
    with Hierarchy.from_config(cfg) as h:  # the job goes on: its first retention pass sweeps the orphans
        h.save(state(3), step=3, blocking=True)
        if point == "remove_record":
            h.delete(1)
        assert steps(h) == {2: ("ssd", "pfs"), 3: ("ssd", "pfs")}
    for tier in ("ssd", "pfs"):
        assert on_disk(tmp_path / tier) == ["step-000000000002", "step-000000000003"], tier
