"""torchtitan's checkpointer components driven as torchtitan's ``Trainer.train`` drives them, for
tests/integrations/test_titan.py, on the CPU (torchtitan's Trainer itself needs a GPU).

The job's pieces are torchtitan's own: ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup
then linear decay), ``ParallelAwareDataloader`` (a ``StatefulDataLoader`` with 2 workers, its state per
data-parallel rank) and ``ModelWrapper``, with a small MLP (FSDP2-sharded over the ranks when
``$WORLD_SIZE`` > 1, gloo) and a trainer state (step, tokens seen). The checkpointer is built from its
config (``HierarchyCheckpointManager.Config(...).build(...)``, as the Trainer builds
``config.checkpoint``); each step: a batch, forward and backward, ``maybe_wait_for_staging``, the
optimizer and scheduler steps, ``save(step, last_step=...)``. Run as a script it writes
``{"losses": {step: loss}, "weights": {name: list}, "loaded": bool}`` to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import default_adamw

from tierckpt.integrations.titan import HierarchyCheckpointManager

ITEMS, BATCH = 96, 4


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True).sin()


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """A stand-in for torchtitan's ``Trainer.Config`` (whose module needs its Trainer's requirements): its
    ``checkpoint`` field, typed as there, and what torchtitan's ConfigManager checks."""

    hf_assets_path: str = "."
    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def tierckpt_debug() -> JobConfig:
    """A config_registry function, as ``--module titan_job --config tierckpt_debug`` names one."""
    return JobConfig(checkpoint=HierarchyCheckpointManager.Config(enable=True, hierarchy="tiers/a.yaml", interval=10))


class TrainState:
    """The trainer's own state, as torchtitan's Trainer saves itself."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class Job:
    def __init__(self, steps: int, rank: int = 0, world: int = 1, **checkpoint: Any) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        opt_cfg = default_adamw(lr=1e-2)
        opt_cfg.implementation = "for-loop"
        self.optimizers = OptimizersContainer(opt_cfg, model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=self.optimizers, training_steps=steps
        )
        ds = Pairs()
        sampler = DistributedSampler(ds, world, rank, shuffle=False) if world > 1 else None
        self.dataloader = ParallelAwareDataloader(
            ds, dp_rank=rank, dp_world_size=world, batch_size=BATCH, sampler=sampler, num_workers=2
        )
        self.train_state = TrainState()
        self.steps = steps
        self.checkpointer = HierarchyCheckpointManager.Config(enable=True, **checkpoint).build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder="",
        )
        self.losses: dict[int, float] = {}

    def train(self, kill_at: int = -1) -> bool:
        """torchtitan's Trainer.train, reduced to what touches the checkpointer; True if it loaded one."""
        loaded = self.checkpointer.load(step=-1)
        batches = iter(self.dataloader)
        while self.train_state.step < self.steps:
            self.train_state.step += 1
            step = self.train_state.step
            x, y = next(batches)
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            self.train_state.ntokens_seen += x.numel()
            self.losses[step] = loss.item()
            self.checkpointer.save(step, last_step=step == self.steps)
            if step == kill_at:
                self.checkpointer.maybe_wait_for_saving()
                os.kill(os.getpid(), signal.SIGKILL)
        self.checkpointer.close()
        return loaded

    def weights(self) -> dict[str, list[float]]:
        out = {}
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = full.flatten().tolist()
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    job = Job(a.steps, rank, world, hierarchy=a.config, interval=2, keep_latest_k=2, last_save_model_only=False)
    loaded = job.train(a.kill_at)
    weights = job.weights()
    if rank == 0:
        Path(a.out).write_text(json.dumps({"losses": job.losses, "weights": weights, "loaded": loaded}))


if __name__ == "__main__":
    main()
