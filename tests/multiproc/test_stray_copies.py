"""Audit finding 4 (from tests/multiproc/test_audit_ranks.py on w/repro): the copies of ranks 2-3 of an
uncommitted step of a 4-rank job are orphans no rank of a 2-rank restarted job owns; that job's first
retention pass (after its first save) removes them (docs/distributed.md, "Failures"). On 8c32cc0 they
stayed on pfs through every restart. Spawned gloo ranks (tests/multiproc/harness.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from harness import spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy

TIMEOUT = 20.0


def config(root: str) -> dict[str, Any]:
    return {
        "tiers": [{"name": "pfs", "kind": "pfs", "path": root + "/pfs"}],
        "io": {"engine": "threads", "chunk": "1MiB"},
        "distributed": {"timeout": TIMEOUT},
    }


def plain(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(100 * step + rank)), "step": step}


def start(rank: int, spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    os.environ["TIERCKPT_NODE"] = str(spec["nodes"][rank])
    os.environ["TIERCKPT_JOB"] = spec["job"]


def save_job(rank: int, world: int, spec: dict[str, Any]) -> list[int]:
    """Save ``spec["steps"]``; this rank's listing at the end."""
    start(rank, spec)
    with Hierarchy.from_config(config(spec["root"])) as h:
        for step in spec["steps"]:
            h.save(plain(rank, step), step=step, blocking=True).wait()
        return [c.step for c in h.checkpoints()]


def restore_job(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Restore the newest step, then save ``spec["then"]``; what this rank restored and listed after."""
    start(rank, spec)
    with Hierarchy.from_config(config(spec["root"])) as h:
        got = h.restore()
        out = {"restored": got["step"], "good": torch.equal(got["w"], plain(rank, got["step"])["w"])}
        h.save(plain(rank, spec["then"]), step=spec["then"], blocking=True).wait()
        return out | {"after": [c.step for c in h.checkpoints()]}


def run(fn: Any, world: int, tmp: Path, spec: dict[str, Any]) -> list[Any]:
    got = spawn(fn, world, tmp, spec, limit=180)
    for r, res in enumerate(got):
        assert res is not None and "ok" in res, f"rank {r}: {res}"
    return [res["ok"] for res in got if res is not None]


def test_orphans_of_ranks_beyond_a_smaller_restarted_job_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "job"
    spec = {"root": str(root), "nodes": [0, 0, 1, 1], "job": "audit-4"}
    assert run(save_job, 4, tmp_path, spec | {"steps": [1, 2]}) == [[1, 2]] * 4
    step2 = root / "pfs" / f"step-{2:012d}"
    (step2 / "commit").unlink()  # rank 0 killed in step 2's commit before it wrote the record
    ranks = run(restore_job, 2, tmp_path, spec | {"nodes": [0, 1], "then": 3})
    assert [(r["restored"], r["good"], r["after"]) for r in ranks] == [(1, True, [1, 3])] * 2, ranks
    left = sorted(p.name for p in step2.iterdir()) if step2.exists() else []
    assert left == [], left  # removed by the restarted job's first retention pass
