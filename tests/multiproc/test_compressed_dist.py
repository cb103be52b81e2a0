"""Compressed copies on many ranks (docs/tiers.md, "Compression"): 2 spawned gloo ranks save an FSDP2
model, its AdamW state and a bf16 DTensor into a ``host`` tier, demoted by the mover into a ``pfs`` tier
that compresses (``zstd``; ``auto`` under a 20 MB/s budget: compressed once it has measured the tier), with one data file a rank or a
node; the copies are restored on 2 ranks and resharded in one process, bit-exact, and ``verify``
re-reads every rank's copy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import fsdp_mlp, spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy
from tierckpt.format.frames import unwrap_manifest
from tierckpt.ranks.coordinator import SoloCoordinator
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.pfs import PfsTier

FRAME = 64 << 10  # the checksum chunk, so each copy's frames: several of every tensor kind a rank
EMB = (1024, 256)  # a bf16 DTensor, rows sharded


def config(tmp: str, compress: str, files: str) -> dict[str, Any]:
    pfs: dict[str, Any] = {"name": "pfs", "kind": "pfs", "path": tmp + "/pfs", "compress": compress}
    if compress == "auto":
        pfs["io"] = {"bandwidth": "20MB/s"}  # background copies paced below what the compressor does
    if files == "per_node":
        pfs["options"] = {"files": "per_node"}
    return {"tiers": [{"name": "host", "kind": "host"}, pfs], "distributed": {"timeout": 10.0}}


def _env() -> None:
    os.environ["TIERCKPT_NODE"] = "0"  # both ranks on one node
    os.environ["TIERCKPT_JOB"] = "compressed-job"


def _fsdp(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 on ``world`` ranks; 0: a plain one) and its AdamW."""
    return fsdp_mlp(world, (256, 1024, 256), 1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
    x, y = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _emb(step: int) -> torch.Tensor:
    return torch.randn(EMB, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, world: int, emb: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    msd, osd = get_state_dict(model, opt)
    rows = distribute_tensor(emb, init_device_mesh("cpu", (world,)), [Shard(0)])
    return {"model": msd, "optim": osd, "emb": rows, "step": 0}


def _hashes(tree: Any, path: str = "") -> dict[str, str]:
    """dtype, shape and SHA-256 of every tensor's whole value (a DTensor's gathered: a collective), by path."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _hashes(sub, f"{path}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _hashes(sub, f"{path}/{i}").items()}
    if not isinstance(tree, torch.Tensor):
        return {}
    whole = (tree.full_tensor() if isinstance(tree, DTensor) else tree).contiguous()
    digest = hashlib.sha256(whole.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return {path: f"{whole.dtype} {list(whole.shape)} {digest}"}


# -- the ranks' bodies (module level: spawned processes import them) -------------------------------------
def save_job(rank: int, world: int, tmp: str, compress: str, files: str) -> dict[str, Any]:
    """Steps 1 and 2, each after a training step; each waited for on both tiers. The hashes of step 2."""
    from tierckpt.datapath import packing

    _env()
    packing.CHUNK_BYTES = FRAME
    model, opt = _fsdp(world)
    out: dict[str, Any] = {}
    with Hierarchy.from_config(config(tmp, compress, files)) as h:
        for step in (1, 2):
            _train(model, opt, step)
            state = _state(model, opt, world, _emb(step)) | {"step": step}
            handle = h.save(state, step=step)
            out[str(step)] = {
                n: None if f.exception(60) is None else str(f.exception()) for n, f in handle.durable.items()
            }
        out["hashes"] = _hashes(state)
    return out


def restore_job(rank: int, world: int, tmp: str, compress: str, files: str) -> dict[str, Any]:
    """Step 2 into a fresh FSDP2 model and AdamW (a step of other data: its state to restore into)."""
    _env()
    model, opt = _fsdp(world)
    _train(model, opt, 7)
    target = _state(model, opt, world, torch.zeros(EMB, dtype=torch.bfloat16))
    with Hierarchy.from_config(config(tmp, compress, files)) as h:
        h.restore(2, into=target)
        came = list(h.last_restore)
    return {"hashes": _hashes(target), "from": came}


def _whole_target() -> dict[str, Any]:
    """A target of whole plain tensors (one process, no process group): a plain model and its AdamW,
    the optimizer's state keyed by name as ``get_state_dict`` keys it."""
    model, opt = _fsdp(0)
    _train(model, opt, 7)
    osd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    optim = {"state": {names[i]: v for i, v in osd["state"].items()},
             "param_groups": [dict(g, params=names) for g in osd["param_groups"]]}  # fmt: skip
    return {"model": model.state_dict(), "optim": optim, "emb": torch.zeros(EMB, dtype=torch.bfloat16), "step": 0}


@pytest.mark.parametrize("files", ["per_rank", "per_node"])
@pytest.mark.parametrize("compress", ["zstd", "auto"])
def test_compressed_copies_of_two_ranks_restore_reshard_and_verify(tmp_path: Path, compress: str, files: str) -> None:
    saved = spawn(save_job, 2, tmp_path, str(tmp_path), compress, files, limit=120)
    for r, out in enumerate(saved):
        assert out is not None and "ok" in out, (r, out)
        assert out["ok"]["1"] == out["ok"]["2"] == {"host": None, "pfs": None}, (r, out)
    want = saved[0]["ok"]["hashes"]  # type: ignore[index]
    assert saved[1]["ok"]["hashes"] == want  # type: ignore[index]
    assert len(want) == 4 + 3 * 4 + 1  # 4 parameters, AdamW's step and 2 moments of each, the rows

    step_dir = tmp_path / "pfs" / "step-000000000002"
    node_files = [p.name for p in step_dir.iterdir() if p.name.startswith("node-")]
    assert len(node_files) == (files == "per_node"), sorted(os.listdir(step_dir))  # one data file a node
    pfs = PfsTier("pfs", tmp_path / "pfs", readonly=True)
    try:
        for r in (0, 1):
            _, index = unwrap_manifest(pfs.read_manifest(CheckpointKey(2, r)))
            if compress == "zstd":
                assert index is not None and index.compressed_frames() > index.total // 2, (r, index)
            # auto: compressed where it has measured what the tier's writes cost the CPUs (0.1 s of
            # writes or 32 MiB: more than these small copies write), else the plain copy; either way
            # it restores, reshards and verifies below
    finally:
        pfs.close()

    back = spawn(restore_job, 2, tmp_path, str(tmp_path), compress, files, limit=120)
    for r, out in enumerate(back):
        assert out is not None and "ok" in out, (r, out)
        assert out["ok"]["from"] == [2, "pfs"] and out["ok"]["hashes"] == want, (r, out)

    target = _whole_target()
    cfg = config(str(tmp_path), compress, files)
    with Hierarchy.from_config(cfg, readonly=True, coordinator=SoloCoordinator(0, 1, node=0)) as h:
        h.restore(2, into=target)
        assert h.last_restore == (2, "pfs")
        assert [(s, t, e) for s, t, e in h.verify()] == [(s, "pfs", None) for s in (1, 2) for _ in range(2)]
    assert _hashes(target) == want  # resharded: whole tensors, bit-exact
