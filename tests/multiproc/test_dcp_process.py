"""``dcp.async_save`` with DCP's process executor (``AsyncCheckpointerType.PROCESS``) through
``HierarchyWriter``, on 1 and 2 ranks (gloo on CPU, spawned processes): DCP pickles the writer into its
checkpoint process, which opens the hierarchy from its configuration with its own process group; the
training ranks then load each step back bit-exact through ``HierarchyReader`` (one of them staged by
``HierarchyStager`` into shared memory). A writer over a
hierarchy built from tier objects fails that save with an error naming the way out."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - a torch without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from harness import spawn  # noqa: E402  (tests/multiproc/harness.py)

_LIMIT = 150.0  # each rank starts DCP's checkpoint process (a spawned interpreter importing torch)


def _config(tmp: str) -> dict[str, Any]:
    return {
        "tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": f"{tmp}/pfs"}],
        "distributed": {"timeout": 30},
    }


def _state(seed: int, mesh: Any) -> dict[str, Any]:
    """A state of this rank: a DTensor sharded over the ranks, a replicated one, a plain tensor, values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": distribute_tensor(torch.randn(9, 5, generator=g), mesh, [Shard(0)]),
            "v": distribute_tensor(torch.randn(4, 3, generator=g).to(torch.bfloat16), mesh, [Replicate()]),
        },
        "ids": torch.randint(0, 1000, (6,), generator=g),
        "step": seed,
        "note": f"run-{seed}",
    }


def _zeros(mesh: Any) -> dict[str, Any]:
    got = _state(0, mesh)
    for t in (got["model"]["w"], got["model"]["v"], got["ids"]):
        t.zero_()
    return {**got, "step": -1, "note": ""}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("w", "v"):
        a, b = got["model"][k].full_tensor(), want["model"][k].full_tensor()
        assert a.dtype == b.dtype and torch.equal(a, b), k
    assert torch.equal(got["ids"], want["ids"])
    assert (got["step"], got["note"]) == (want["step"], want["note"])


def _process_saves(rank: int, world: int, tmp: str) -> None:  # on a rank of harness.spawn (gloo initialized)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt import Hierarchy
    from tierckpt.dcp import HierarchyReader, HierarchyStager, HierarchyWriter
    from tierckpt.errors import TierckptError
    from tierckpt.tiers.pfs import PfsTier

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    process = AsyncCheckpointerType.PROCESS
    with Hierarchy.from_config(_config(tmp)) as h:
        one = _state(1, mesh)
        fut = dcp.async_save(one, storage_writer=HierarchyWriter(h, step=1), async_checkpointer_type=process)
        saved_one = {**one, "model": {k: v.clone() for k, v in one["model"].items()}, "ids": one["ids"].clone()}
        fut.result(timeout=90)
        # the configuration instead of a live hierarchy (a YAML path here), under the job's identity
        yaml = Path(tmp) / "tiers.yaml"
        if rank == 0:
            import yaml as pyyaml

            yaml.write_text(pyyaml.safe_dump(_config(tmp)))
        dist.barrier()
        two = _state(2, mesh)
        writer = HierarchyWriter(str(yaml), step=2, job=h.job)
        stager = HierarchyStager(share_memory=True)  # the staged copy reaches the checkpoint process as it is
        fut = dcp.async_save(two, storage_writer=writer, async_checkpointer_type=process, async_stager=stager)
        fut.result(timeout=90)
        stager.close()

        for step, want in ((1, saved_one), (2, two)):
            got = _zeros(mesh)
            dcp.load(got, storage_reader=HierarchyReader(h, step=step))
            _same(got, want)
        assert [c.step for c in h.checkpoints()] == [1, 2]

        # a hierarchy of tier objects has no configuration the checkpoint process could open
        loose = Hierarchy([PfsTier("pfs", f"{tmp}/loose", job=h.job)], job=h.job)
        with loose:
            fut = dcp.async_save(two, storage_writer=HierarchyWriter(loose, step=3), async_checkpointer_type=process)
            try:
                fut.result(timeout=90)
            except TierckptError as e:
                assert "built from tier objects" in str(e) and "from_config" in str(e), e
            else:
                raise AssertionError("a writer over tier objects was sent to DCP's checkpoint process")


@pytest.mark.parametrize("ranks", [1, 2])
def test_process_executor_saves_through_the_hierarchy_and_loads_back_bit_exact(tmp_path: Path, ranks: int) -> None:
    assert spawn(_process_saves, ranks, tmp_path, str(tmp_path), limit=_LIMIT) == [{"ok": None}] * ranks
