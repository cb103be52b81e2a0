"""``restore(key_map=...)`` of a sharded checkpoint: a ``torch.compile``d model's DTensor state saved by 2
spawned gloo ranks (``_orig_mod.`` key paths, rows sharded) is restored, its key paths mapped, into a plain
model's state resharded by columns on 2 ranks, into whole tensors by one process, and as fresh tensors
(each rank's saved box)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from harness import spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy, KeyMap, SoloCoordinator

FULL = torch.arange(48.0).reshape(6, 8)
BIAS = torch.arange(3.0)


def config(tmp: str) -> dict[str, Any]:
    return {"tiers": [{"name": "pfs", "kind": "pfs", "path": tmp + "/pfs"}], "distributed": {"timeout": 20}}


def _sharded(placement: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    return distribute_tensor(
        FULL if placement == "rows" else torch.zeros_like(FULL), mesh, [Shard(0 if placement == "rows" else 1)]
    )


def save(rank: int, world: int, tmp: str) -> bool:
    os.environ["TIERCKPT_JOB"] = "keymap"
    with Hierarchy.from_config(config(tmp)) as h:
        h.save({"model": {"_orig_mod.fc.weight": _sharded("rows"), "_orig_mod.fc.bias": BIAS}}, step=1, blocking=True)
    return True


def restore(rank: int, world: int, tmp: str) -> list[bool]:
    os.environ["TIERCKPT_JOB"] = "keymap"
    with Hierarchy.from_config(config(tmp)) as h:
        target = {"model": {"fc.weight": _sharded("cols"), "fc.bias": torch.zeros(3)}}
        h.restore(into=target, key_map=KeyMap.torch_compile())
        w = target["model"]["fc.weight"]
        return [
            torch.equal(w.to_local(), FULL[:, 4 * rank : 4 * rank + 4]),
            torch.equal(w.full_tensor(), FULL),
            torch.equal(target["model"]["fc.bias"], BIAS),
        ]


def test_a_sharded_checkpoint_restores_under_mapped_key_paths(tmp_path: Path) -> None:
    assert spawn(save, 2, tmp_path, str(tmp_path)) == [{"ok": True}, {"ok": True}]
    assert spawn(restore, 2, tmp_path, str(tmp_path)) == [{"ok": [True, True, True]}] * 2
    with Hierarchy.from_config(config(str(tmp_path)), readonly=True, coordinator=SoloCoordinator(0, 1)) as h:
        whole = {"model": {"fc.weight": torch.zeros(6, 8), "fc.bias": torch.zeros(3)}}
        h.restore(into=whole, key_map=KeyMap.torch_compile())
        assert torch.equal(whole["model"]["fc.weight"], FULL) and torch.equal(whole["model"]["fc.bias"], BIAS)
        fresh = h.restore(key_map=KeyMap.torch_compile())  # rank 0's box, under the mapped key paths
        assert sorted(fresh["model"]) == ["fc.bias", "fc.weight"]
        assert torch.equal(fresh["model"]["fc.weight"], FULL[:3])
