"""``files: per_node`` with 2 spawned gloo ranks of one node, where a save fails: a full device while the
node file is created (the save fails on that tier, and no earlier step is evicted for it), and a rank
whose copy fails before the node's exchange (the others fail at once, naming it), docs/distributed.md,
"A per-node data file"."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import spawn  # tests/multiproc/harness.py
from test_pernode_dist import _close, _env, _wait  # tests/multiproc/

from tierckpt import Hierarchy
from tierckpt.tiers.base import CheckpointKey

MiB = 1 << 20


def config(tmp: str, pfs: str, timeout: float) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "host", "kind": "host"},
            {
                "name": "pfs",
                "kind": "pfs",
                "path": pfs,
                "options": {"files": "per_node"},
                "io": {"direct": False},
                "compress": "none",
            },  # raw blobs: the device is sized for them
            {"name": "ssd", "kind": "local", "path": tmp + "/ssd"},
        ],
        "policy": {"keep": {"pfs": 5, "ssd": 5}},
        "io": {"chunk": "1MiB"},
        "distributed": {"timeout": timeout},
    }


def full_job(rank: int, world: int, tmp: str, pfs: str) -> dict[str, Any]:
    """Save steps 1 and 2 (1 MiB a rank), then step 3 (1.5 MiB a rank), whose node file does not fit."""
    _env()
    out: dict[str, Any] = {}
    h = Hierarchy.from_config(config(tmp, pfs, 30.0))
    try:
        for step, n in ((1, MiB), (2, MiB), (3, 3 * MiB // 2)):
            out[str(step)] = _wait(h.save({"w": torch.full((n // 4,), float(step + rank))}, step=step))
        out["pfs"] = sorted(c.step for c in h.checkpoints() if "pfs" in c.tiers)
        # a per-node copy's manifest reaches other tiers without its location block: the same bytes
        key = CheckpointKey(1, rank)
        out["same"] = h.tier("pfs").read_manifest(key) == h.tier("ssd").read_manifest(key)
    finally:
        _close(h)
    return out


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_device_at_the_node_file_fails_the_save_there_and_evicts_nothing(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "small", "6M") as small:
        got = spawn(full_job, 2, tmp_path, str(tmp_path), str(small / "pfs"), limit=120)
        for r, out in enumerate(got):
            assert out is not None and "ok" in out, (r, out)
            saved = out["ok"]
            assert saved["1"] == saved["2"] == {"host": None, "pfs": None, "ssd": None}, (r, saved)
            assert saved["3"]["host"] is None and saved["3"]["ssd"] is None, (r, saved)
            assert saved["3"]["pfs"] is not None, (r, saved)
            assert saved["pfs"] == [1, 2], (r, saved)  # nothing evicted for a save that could not fit
            assert saved["same"], (r, saved)
        err = got[0]["ok"]["3"]["pfs"]  # type: ignore[index]
        assert "DeviceFullError" in err and "tier 'pfs'" in err and "of step 3" in err and "rank 0" in err, err
        assert "tier 'pfs': step 3: node 0" in got[1]["ok"]["3"]["pfs"], got  # type: ignore[index]
        with Hierarchy.from_config(config(str(tmp_path), str(small / "pfs"), 30.0)) as h:
            for step in (1, 2):
                assert torch.equal(h.restore(step, tier="pfs")["w"], torch.full((MiB // 4,), float(step)))
        step3 = small / "pfs" / "step-000000000003"
        left = os.listdir(step3) if step3.exists() else []
        assert not [n for n in left if n.startswith(("node-", "rank-"))], left


def failing_job(rank: int, world: int, tmp: str, victim: int) -> dict[str, Any]:
    """Save steps 1 and 2; rank ``victim``'s demotion of step 2 fails before the node's exchange."""
    from tierckpt.background.mover import Mover

    _env()
    if rank == victim:
        pick = Mover._pick_source

        def broken(self: Any, key: Any, dst: str, sources: Any) -> Any:
            if key.step == 2:
                raise RuntimeError("the source went away")
            return pick(self, key, dst, sources)

        Mover._pick_source = broken  # type: ignore[method-assign]
    h = Hierarchy.from_config(config(tmp, tmp + "/pfs", 60.0))
    times, outcomes = [], []
    try:
        for step in (1, 2):
            times.append(time.monotonic())
            outcomes.append(_wait(h.save({"w": torch.full((1024,), float(step))}, step=step)))
            times[-1] = time.monotonic() - times[-1]
    finally:
        _close(h)
    return {"1": outcomes[0], "2": outcomes[1], "2-secs": times[1]}


@pytest.mark.parametrize("victim", [1, 0])  # a rank of the node, and its first (the node file's creator)
def test_a_rank_failing_before_the_exchange_fails_its_node_at_once_naming_it(victim: int, tmp_path: Path) -> None:
    got = spawn(failing_job, 2, tmp_path, str(tmp_path), victim, limit=120)
    other = got[1 - victim]
    assert got[victim] is not None and other is not None, got
    assert "the source went away" in got[victim]["ok"]["2"]["pfs"], got
    err = other["ok"]["2"]["pfs"]
    assert err is not None and f"rank {victim} failed before the node's exchange" in err, err
    assert "tier 'pfs': step 2" in err, err
    assert other["ok"]["2-secs"] < 30, other  # not the 60 s timeout
    assert other["ok"]["1"]["pfs"] is None and other["ok"]["2"]["host"] is None, other
