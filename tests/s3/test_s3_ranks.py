"""Four spawned gloo ranks demote DTensor shards to the s3 tier on the session's radosgw: each step is
committed once on the bucket (one record), and the job restores it resharded on 2 ranks and whole on 1."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc.harness import spawn

pytestmark = pytest.mark.remote

ROWS, COLS = 64, 48


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step


def config(entry: dict[str, Any], host: bool) -> dict[str, Any]:
    tiers = [{"name": "host", "kind": "host"}] if host else []
    return {"tiers": [*tiers, entry], "policy": {"keep": {"obj": 2} | ({"host": 1} if host else {})}}


def save_job(rank: int, world: int, entry: dict[str, Any], env: dict[str, str], steps: int = 3) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tierckpt import Hierarchy

    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    with Hierarchy.from_config(config(entry, host=True)) as h:
        for step in range(1, steps + 1):
            h.save({"w": distribute_tensor(full(step), mesh, [Shard(0)]), "step": step}, step=step).wait()
        assert h.flush(timeout=120)
        return {"listed": {c.step: c.states.get("obj") for c in h.checkpoints()}}


def restore_job(rank: int, world: int, entry: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tierckpt import Hierarchy

    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    target = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]), "step": -1}
    with Hierarchy.from_config(config(entry, host=False)) as h:
        got = h.restore(into=target)
        whole = got["w"].full_tensor()
        return {"step": got["step"], "ok": bool(torch.equal(whole, full(3))), "from": list(h.last_restore)}


def _env(bucket: Any) -> dict[str, str]:
    """The credentials, for ranks whose processes may come from a server started before this test."""
    server = bucket.server
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": server.region}  # fmt: skip


def test_four_ranks_commit_once_and_restore_resharded(s3_bucket: Any, tmp_path: Path) -> None:
    entry = s3_bucket.tier_entry("obj", "ranks", part_size="5MiB")
    env = _env(s3_bucket)
    saved = spawn(save_job, 4, tmp_path, entry, env, limit=180)
    assert saved == [{"ok": {"listed": {"2": "committed", "3": "committed"}}}] * 4, saved
    keys = s3_bucket.keys()
    assert sorted(k for k in keys if "/records/" in k) == [f"ranks/records/step-{s:012d}" for s in (2, 3)]
    heads = [k for k in keys if "/manifests/" in k]
    assert len(heads) == 8 and not any("step-000000000001" in k for k in keys)
    restored = spawn(restore_job, 2, tmp_path, entry, env, limit=120)
    assert restored == [{"ok": {"step": 3, "ok": True, "from": [3, "obj"]}}] * 2, restored
    one = spawn(restore_job, 1, tmp_path, entry, env, limit=120)
    assert one == [{"ok": {"step": 3, "ok": True, "from": [3, "obj"]}}], one


LISTS = ("ListObjectsV2", "ListObjects", "ListMultipartUploads")


def test_four_ranks_list_only_when_they_open(s3_proxy: Any, tmp_path: Path) -> None:
    """Counted at the proxy: the LIST requests of a job are those of its open (one rank's listing and
    rank 0's sweep), the same for 2 saves as for 6; every save and eviction is GETs, PUTs and deletes."""
    proxy, env = s3_proxy.proxy, _env(s3_proxy)
    counts = []
    for steps, prefix in ((2, "a"), (6, "b")):
        proxy.clear_counts()
        entry = s3_proxy.tier_entry("obj", prefix, part_size="5MiB")
        saved = spawn(save_job, 4, tmp_path, entry, env, steps, limit=180)
        assert all(r is not None and "ok" in r for r in saved), saved
        counts.append({op: n for op, n in proxy.counts().items() if op in LISTS})
    assert counts[0] == counts[1], counts
    assert sum(counts[1].values()) <= 6, counts  # one rank's listing at open (heads, records), rank 0's sweep
