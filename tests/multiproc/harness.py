"""Spawned gloo ranks as torchrun runs them: the parent holds the job's TCPStore (torchrun's agent
does), each rank joins it and initializes a gloo process group, then runs a module-level function."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt.errors import CoordinationError

CLEAN_ENV = (
    "TIERCKPT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "TIERCKPT_NODE",
    "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NODEID", "SLURM_LOCALID", "RANK",
)  # fmt: skip


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    for var in CLEAN_ENV:
        os.environ.pop(var, None)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
        result: dict[str, Any] = {"ok": fn(rank, world_size, *args)}
    except CoordinationError as e:
        result = {"error": str(e), "ranks": list(e.ranks)}
    except BaseException as e:  # reported to the parent
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no process-group teardown: some tests leave a peer dead


def spawn(
    fn: Callable[..., Any], world_size: int, tmp: Path, *args: Any, limit: float = 60.0
) -> list[dict[str, Any] | None]:
    """Run ``fn(rank, world_size, *args)`` (a module-level function, JSON-able result) on ``world_size``
    spawned ranks; each rank's ``{"ok": result}`` or ``{"error": ..., "ranks": ...}``, None for a rank
    that died."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    out = tmp / f"results-{time.monotonic_ns()}"
    out.mkdir()
    ctx = mp.get_context("forkserver")  # one server imports torch once; each rank is a fork of it
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tierckpt.hierarchy", fn.__module__])
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, store.port, str(out), args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"
    got = [out / f"{r}.json" for r in range(world_size)]
    return [json.loads(f.read_text()) if f.exists() else None for f in got]


def fsdp_mlp(world: int, dims: tuple[int, int, int], lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A seeded two-layer MLP of sizes ``dims``, each layer and the whole sharded with FSDP2 over ``world``
    ranks (0: a plain model, in a process without a process group), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    d_in, d_hidden, d_out = dims
    model = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(), torch.nn.Linear(d_hidden, d_out))
    if world:
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)
