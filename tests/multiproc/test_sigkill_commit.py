"""SIGKILL of one rank at each point of a save's global commit (tests/multiproc/killpoints.py), and a
rank hung past the timeout, in a job of 4 spawned gloo ranks on two simulated nodes (node-local ``ssd``
per node, one shared ``pfs`` the save is demoted to).

After each kill: the surviving ranks' save of that step fails within the coordination timeout naming
the dead rank, or commits where every copy was in; the step is listed (by every rank and by a
read-only hierarchy in the parent) exactly on the tiers where its commit completed; a restarted job
(new processes, same directories) restores, bit-exactly on every rank, that step if it is committed
somewhere, else the previous one; its next save succeeds, and after that save's retention nothing of
the step is left on a tier where it did not commit (no rank directory, scratch ``.tmp-*``, or record).

The points are chained to keep the suite fast: each restarted job checks the previous kill, then
dies at the next point. The default chain takes each point the issue names once (a rank's blobs half
written, its copy durable but not reported, rank 0 killed while writing the shared record, a rank
killed mid-demotion, a rank killed after the commit), alternating lazy and blocking saves; the slow
one takes every point, in the other mode and in both where the default leaves it out (a rank killed
inside the gather, rank 0 killed before it writes the record or after, without publishing).
"""

from __future__ import annotations

import os
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import spawn  # tests/multiproc/harness.py
from killpoints import arm, hang

N = 4
TIMEOUT = 3.0
HUNG, HUNG_RANK = 2, 2  # the first job's step 2: rank 2 reports its copy after the others' timeout
#: per kill point, the tiers on which the step commits all the same (every rank's copy was in)
COMMITTED: dict[str, tuple[str, ...]] = {
    "write_top": (),
    "before_gather": (),
    "in_gather": ("ssd",),
    "before_record": ("ssd",),
    "mid_record": ("ssd",),
    "after_record": ("ssd", "pfs"),
    "write_demotion": ("ssd",),
    "after_commit": ("ssd", "pfs"),
}
#: per kill point, the tiers whose commit fails on the surviving ranks: where they waited on the dead
#: rank (rank 0 dead after the record: the others cannot know that the step is committed there)
FAILS: dict[str, tuple[str, ...]] = {
    "write_top": ("ssd", "pfs"),
    "before_gather": ("ssd", "pfs"),
    "after_commit": (),
}
#: (kill point, lazy or blocking save, the rank killed): rank 0 writes the records of shared tiers; the
#: other points kill a rank of the second node
DEFAULT_CHAIN = [
    ("write_top", "lazy", 3),
    ("before_gather", "blocking", 3),
    ("mid_record", "lazy", 0),
    ("write_demotion", "blocking", 3),
    ("after_commit", "lazy", 3),
]
SLOW_CHAIN = [
    ("write_top", "blocking", 3),
    ("before_gather", "lazy", 3),
    ("in_gather", "blocking", 3),
    ("before_record", "lazy", 0),
    ("mid_record", "blocking", 0),
    ("after_record", "lazy", 0),
    ("write_demotion", "lazy", 3),
    ("after_commit", "blocking", 3),
    ("in_gather", "lazy", 3),
    ("before_record", "blocking", 0),
    ("after_record", "blocking", 0),
    ("write_top", "lazy", 0),  # rank 0 before it claims a decision: the others claim it and fail it
    ("before_gather", "blocking", 0),
]


def _config(tmp: str) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": tmp + "/node{node}/ssd"},
            {"name": "pfs", "kind": "pfs", "path": tmp + "/pfs"},
        ],
        "io": {"chunk": "1MiB"},  # a copy is several writes: a kill mid-write leaves a partial one
        "distributed": {"timeout": TIMEOUT},
    }


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(1 << 19, generator=g), "step": step}  # 2 MiB a rank


def _listed(h: Any) -> dict[str, list[str]]:
    return {str(c.step): list(c.tiers) for c in h.checkpoints() if c.tiers}


def _save(h: Any, rank: int, step: int, mode: str) -> dict[str, Any]:
    """Save ``step``; what this rank saw: the failure wait() raised, how long, each tier's outcome."""
    t0 = time.monotonic()
    handle = h.save(_state(rank, step), step=step, blocking=mode == "blocking")
    returned = time.monotonic() - t0  # a lazy save returns at once, whatever the other ranks do
    failed: dict[str, Any] | None = None
    try:
        handle.wait()
    except Exception as e:
        failed = {"error": f"{type(e).__name__}: {e}", "ranks": list(getattr(e, "ranks", []))}
    took = time.monotonic() - t0
    futures.wait(list(handle.durable.values()))
    tiers = {}
    for name, f in handle.durable.items():
        e = f.exception()
        tiers[name] = None if e is None else {"type": type(e).__name__, "ranks": list(getattr(e, "ranks", []))}
    return {"failed": failed, "returned": returned, "took": took, "tiers": tiers, "listed": _listed(h)}


def job(rank: int, world_size: int, tmp: str, stage: dict[str, Any]) -> dict[str, Any]:
    """One run of the job: the first saves steps 1 to 3 (2 with a hung rank), a restarted one restores
    and saves the next step; then, if ``stage`` names a kill point, every rank saves ``stage["kill"]``
    and rank ``stage["who"]`` dies at that point of it."""
    from tierckpt import Hierarchy

    os.environ["TIERCKPT_NODE"] = str(rank // 2)
    os.environ["TIERCKPT_JOB"] = "sigkill-job"
    if stage["point"] and rank == stage["who"]:
        arm(stage["point"], stage["kill"])
    if stage["first"] and rank == HUNG_RANK:
        hang(HUNG, TIMEOUT + 1)
    out: dict[str, Any] = {}
    with Hierarchy.from_config(_config(tmp)) as h:
        if stage["first"]:
            out["saves"] = [_save(h, rank, step, "lazy") for step in (1, HUNG, 3)]
        else:
            got = h.restore()
            want = _state(rank, got["step"])["w"]
            out["restored"] = [got["step"], bool(torch.equal(got["w"], want)), list(h.last_restore)]
            out["saves"] = [_save(h, rank, stage["next"], "lazy")]
        if stage["point"]:
            out["killed"] = _save(h, rank, stage["kill"], stage["mode"])
    return out


def _readonly_listing(tmp: Path) -> list[dict[str, list[str]]]:
    """What a read-only hierarchy of each rank (an evaluation process in the parent) lists."""
    from tierckpt import Hierarchy
    from tierckpt.ranks.coordinator import SoloCoordinator

    out = []
    for r in range(N):
        coord = SoloCoordinator(r, N, node=r // 2)
        with Hierarchy.from_config(_config(str(tmp)), readonly=True, coordinator=coord) as h:
            out.append(_listed(h))
    return out


def _step_dirs(tmp: Path, tier: str, step: int) -> list[Path]:
    roots = sorted(tmp.glob("node*/ssd")) if tier == "ssd" else [tmp / "pfs"]
    return [root / f"step-{step:012d}" for root in roots]


def _check_disk(tmp: Path, step: int, committed: tuple[str, ...]) -> None:
    """Where ``step`` committed: the record and every rank's copy, nothing else; elsewhere: nothing."""
    for tier in ("ssd", "pfs"):
        for d in _step_dirs(tmp, tier, step):
            left = sorted(os.listdir(d)) if d.exists() else []
            if tier in committed:
                ranks = [r for r in range(N) if tier == "pfs" or f"node{r // 2}" in d.parts]
                assert left == ["commit", *(f"rank-{r:05d}" for r in ranks)], (d, left)
            else:
                assert not left and not d.exists(), (d, left)  # no copy, scratch, record, or directory


def _check_hung(saves: dict[int, list[dict[str, Any]]]) -> None:
    """The first job: every rank's save of the hung step fails naming the hung rank; the next works."""
    for r, (first, hung, after) in saves.items():
        assert first["failed"] is None and after["failed"] is None, (r, first, after)
        assert hung["failed"] and HUNG_RANK in hung["failed"]["ranks"], (r, hung)
        assert f"rank(s) {HUNG_RANK} did not arrive" in hung["failed"]["error"], (r, hung)
        assert hung["tiers"]["ssd"] == {"type": "CoordinationError", "ranks": [HUNG_RANK]}, (r, hung)
        if r != HUNG_RANK:
            assert hung["took"] < TIMEOUT + 4, (r, hung)  # the timeout, not the hung rank's sleep
        assert after["listed"] == {"1": ["ssd", "pfs"], "3": ["ssd", "pfs"]}, (r, after)


def _check_killed(got: list[dict[str, Any] | None], point: str, mode: str, who: int, step: int) -> None:
    """The survivors of a kill at ``point``: the tiers where it did not commit failed naming the dead
    rank (where they waited on it) within the timeout; the step is listed where it committed."""
    committed = COMMITTED[point]
    assert got[who] is None, f"rank {who} should have been killed at {point}: {got[who]}"
    for r, out in enumerate(got):
        if r == who:
            continue
        assert out is not None and "ok" in out, (r, out)
        k = out["ok"]["killed"]
        failing = list(FAILS.get(point, ("pfs",)))
        assert [t for t, e in k["tiers"].items() if e is not None] == failing, (r, point, k)
        if failing:  # the first tier that failed waited on the dead rank: its error names it
            assert k["failed"] and k["failed"]["ranks"] == [who], (r, point, k)
            assert k["tiers"][failing[0]] == {"type": "CoordinationError", "ranks": [who]}, (r, point, k)
        # rank 3 dead: the ssd commit and the pfs one each wait one timeout for it; rank 0 dead: the
        # others wait for it twice (it had claimed the decision), with a grace each
        bound = 2 * (TIMEOUT + min(5, 0.5 + TIMEOUT / 4)) if who == 0 else 2 * TIMEOUT
        assert k["took"] < bound + 4, (r, point, k)
        assert mode == "blocking" or k["returned"] < 1, (r, point, k)
        listed = {s: t for s, t in k["listed"].items() if int(s) == step}
        assert listed == ({str(step): list(committed)} if committed else {}), (r, point, k)


def _check_left(tmp: Path, point: str, who: int, step: int) -> None:
    """What the kill left of ``step`` before the restart: the leftovers the restarted job must remove
    are there (so the kill happened where it was meant to)."""
    name, node = f"step-{step:012d}", f"node{who // 2}/ssd"
    ssd, pfs = (sorted(os.listdir(d)) if d.exists() else [] for d in (tmp / node / name, tmp / "pfs" / name))
    if point in ("write_top", "write_demotion"):  # the dead rank's scratch copy: blobs, no manifest
        left = ssd if point == "write_top" else pfs
        scratch = [f for f in left if f.startswith(f".tmp-rank-{who:05d}-")]
        assert len(scratch) == 1, left
        files = os.listdir(tmp / (node if point == "write_top" else "pfs") / name / scratch[0])
        assert files and "manifest" not in files, files
        if point == "write_demotion":
            assert ssd == ["commit", *(f"rank-{r:05d}" for r in range(N) if r // 2 == who // 2)], ssd
    elif point == "before_gather":  # the dead rank's durable copy without a record; the others evicted theirs
        assert ssd == [f"rank-{who:05d}"], ssd
    elif point in ("before_record", "mid_record"):  # every rank's copy, no record
        scratch = [f for f in pfs if f.startswith(".tmp-commit-")]
        assert len(scratch) == (point == "mid_record"), pfs
        assert [f for f in pfs if not f.startswith(".tmp-commit-")] == [f"rank-{r:05d}" for r in range(N)], pfs


def _run_chain(tmp_path: Path, chain: list[tuple[str, str, int]]) -> None:
    tmp = str(tmp_path)
    previous, step = 3, 4  # the newest committed step; the step killed next
    done: list[tuple[int, tuple[str, ...]]] = []  # (killed step, tiers where it committed)
    for i, (point, mode, who) in enumerate([*chain, (None, None, -1)]):
        stage = {"first": i == 0, "point": point, "mode": mode, "who": who, "next": step - 1, "kill": step}
        got = spawn(job, N, tmp_path, tmp, stage, limit=120)
        alive = [r for r in range(N) if r != who]
        for r in alive:
            assert got[r] is not None and "ok" in got[r], (r, point, got[r])  # type: ignore[operator]
        if i == 0:  # the hung rank is not the one killed
            _check_hung({r: got[r]["ok"]["saves"] for r in alive})  # type: ignore[index]
            _check_disk(tmp_path, HUNG, ())
        else:  # the restart of the previous kill
            prev_point, prev_step = chain[i - 1][0], step - 2
            want = prev_step if COMMITTED[prev_point] else previous
            for r in alive:
                out = got[r]
                assert out["ok"]["restored"] == [want, True, [want, "ssd"]], (r, prev_point, out)
                assert out["ok"]["saves"][0]["failed"] is None, (r, prev_point, out)
            previous = step - 1
            _check_disk(tmp_path, prev_step, COMMITTED[prev_point])
        if point is None:
            break
        _check_killed(got, point, mode, who, step)
        _check_left(tmp_path, point, who, step)
        for r, listed in enumerate(_readonly_listing(tmp_path)):
            assert listed.get(str(step), []) == list(COMMITTED[point]), (r, point, listed)
        done.append((step, COMMITTED[point]))
        step += 2
    for s, committed in done:  # nothing came back later
        _check_disk(tmp_path, s, committed)


def test_a_rank_killed_at_each_point_of_a_commit(tmp_path: Path) -> None:
    _run_chain(tmp_path, DEFAULT_CHAIN)


@pytest.mark.slow
def test_a_rank_killed_at_each_point_of_a_commit_other_modes(tmp_path: Path) -> None:
    _run_chain(tmp_path, SLOW_CHAIN)
