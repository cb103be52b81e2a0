"""Export and import across ranks: an FSDP2 model and AdamW saved by 2 spawned gloo ranks, exported by one
process with no process group (full tensors, bit for bit, a DTensor larger than the bound read in slabs);
and a safetensors file loaded on 2 ranks into FSDP2-sharded parameters and DTensors of other placements,
each rank reading its own box (docs/integrations.md, "Export and import")."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # fully_shard imports it: once in the forkserver, not in each rank
from harness import spawn  # tests/multiproc/harness.py

from tierckpt import Hierarchy, export, load_safetensors

st = pytest.importorskip("safetensors.torch")

BIG = (96, 64)  # float32, 24 KiB: sharded Shard(0) over 2 ranks, exported 8 KiB at a time


def config(d: Path) -> dict[str, Any]:
    """A node-local tier of one directory a rank (the exporting process sees rank 0's only), and a shared one."""
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(d / "ssd-{rank}")},
            {"name": "pfs", "kind": "pfs", "path": str(d / "pfs"), "compress": "none"},
        ],
        "policy": {"demote": {"pfs": {"every": 1}}},
    }


def _model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 18), torch.nn.ReLU(), torch.nn.Linear(18, 5))  # uneven shards
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out |= {f"{k}.{kk}": vv for kk, vv in _full(v).items()}
        elif isinstance(v, torch.Tensor):
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).clone()
    return out


def _save(rank: int, world: int, d: str) -> int:
    """Train two steps, save model, optimizer and a big DTensor; rank 0 writes the full values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model, opt = _model(world, 0)
    for s in range(2):
        g = torch.Generator().manual_seed(100 + s)
        loss = ((model(torch.randn(4, 8, generator=g)) - torch.randn(4, 5, generator=g)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    big = torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG)
    extra = {
        "big": distribute_tensor(big, init_device_mesh("cpu", (world,)), [Shard(0)]),
        "mine": torch.full((2,), rank),
    }
    state = {"model": msd, "optim": osd, "extra": extra, "step": 2}
    with Hierarchy.from_config(config(Path(d))) as h:
        h.save(state, step=2, blocking=True)
    full = {f"model.{k}": v for k, v in _full(msd).items()} | {f"optim.{k}": v for k, v in _full(osd).items()}
    full |= {"extra.big": big, "extra.mine": torch.full((2,), rank)}
    if rank == 0:
        torch.save(full, Path(d) / "expected.pt")
    return len(full)


def test_a_two_rank_fsdp2_save_is_exported_by_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.interop import reading

    (n, _) = [r["ok"] for r in spawn(_save, 2, tmp_path, str(tmp_path))]  # type: ignore[index]
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    assert n == len(expected)
    held, peak = [0], [0]
    fresh = reading._fresh

    def counted(sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = fresh(sizes, dtype)
        held[0] += t.nbytes
        peak[0] = max(peak[0], held[0])
        weakref.finalize(t, lambda k=t.nbytes: held.__setitem__(0, held[0] - k))
        return t

    monkeypatch.setattr(reading, "_fresh", counted)
    got = export(config(tmp_path), tmp_path / "out", max_inflight="8KiB")  # no process group here
    assert (got.step, got.tier) == (2, "ssd")  # rank 0's copy from ssd-0, rank 1's from pfs
    assert peak[0] <= 8 * 1024, peak[0]  # the 24 KiB DTensor in slabs of whole rows
    loaded = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(loaded) == sorted(expected)
    for k, v in expected.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k  # bit-exact
    assert torch.equal(loaded["extra.mine"], torch.zeros(2, dtype=torch.int64))  # rank 0's plain tensor
    export(config(tmp_path), tmp_path / "pt", format="torch", only=["model"])
    pt = torch.load(tmp_path / "pt" / "pytorch_model.bin", weights_only=True)
    assert sorted(pt) == sorted(k for k in expected if k.startswith("model."))
    assert all(torch.equal(pt[k], expected[k]) for k in pt)


def _load(rank: int, world: int, path: str) -> int:
    """Load the file into an FSDP2 model (other initial values) and DTensors placed otherwise; rank 0 writes
    what each holds as full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model, _ = _model(world, 7)
    mesh = init_device_mesh("cpu", (world,))
    other = {
        "cols": distribute_tensor(torch.zeros(5, 9), mesh, [Shard(1)]),
        "rep": distribute_tensor(torch.zeros(3), mesh, [Replicate()]),
    }
    state = {"net": model.state_dict(), "other": other}
    load_safetensors(path, into=state, key_map={"model.": "net."})
    full = {f"net.{k}": v for k, v in _full(model.state_dict()).items()} | {
        f"other.{k}": v for k, v in _full(other).items()
    }
    torch.save(full, Path(path).parent / f"loaded-{rank}.pt")
    return rank


def test_a_safetensors_file_loads_into_dtensor_sharded_tensors_on_two_ranks(tmp_path: Path) -> None:
    torch.manual_seed(3)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 18), torch.nn.ReLU(), torch.nn.Linear(18, 5))
    tensors = {f"model.{k}": v.detach().clone() for k, v in plain.state_dict().items()}
    tensors |= {"other.cols": torch.randn(5, 9), "other.rep": torch.randn(3)}
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    assert [r["ok"] for r in spawn(_load, 2, tmp_path, str(tmp_path / "model.safetensors"))] == [0, 1]  # type: ignore[index]
    for rank in range(2):
        got = torch.load(tmp_path / f"loaded-{rank}.pt", weights_only=True)
        assert sorted(got) == sorted(k.replace("model.", "net.", 1) for k in tensors)
        for k, v in tensors.items():
            assert torch.equal(got[k.replace("model.", "net.", 1)], v), (rank, k)
