"""A training loop's data side for tests/integrations/test_data_position.py, run in processes of its own.

Each step takes one batch from each data loader (a plain ``DataLoader`` through
:class:`tierckpt.ResumableLoader`, and torchdata's ``StatefulDataLoader``), both with 2 worker processes
and shuffled, over datasets whose items carry a random draw made in the worker, and draws one number
from torch's global generator (the training step's randomness). The loaders and the RNG states are a
:class:`tierckpt.TrainState` saved every step. Run as rank ``$RANK`` of ``$WORLD_SIZE`` (gloo, the
launcher's ``$MASTER_ADDR``/``$MASTER_PORT``) each rank has its own loaders over a ``DistributedSampler``
and saves its own loader state. Writes ``{step: {"plain": [...], "stateful": [...], "rng": x}}`` of the
steps it ran to ``--out`` (one file a rank), and SIGKILLs itself after the save of ``--kill-after``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from tierckpt import Hierarchy, ResumableLoader, TrainState

ITEMS, BATCH = 44, 4  # 11 batches an epoch on one rank, 6 (the last one short) on each of two


class Noisy(Dataset[torch.Tensor]):
    """Item i is [i, a draw from each of the worker's global generators: torch's, numpy's, python's] (a
    random augmentation)."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> torch.Tensor:
        draws = [int(torch.randint(0, 1 << 30, ())), int(np.random.randint(0, 1 << 30)), random.randrange(1 << 30)]
        return torch.tensor([i, *draws])


class NoisyStateful(Noisy):
    """The same with the draws from a generator of the dataset's own, which it saves (``StatefulDataLoader``
    saves each worker's copy of a dataset that has ``state_dict``)."""

    gen: torch.Generator | None = None

    def _g(self) -> torch.Generator:
        if self.gen is None:
            self.gen = torch.Generator().manual_seed(torch.initial_seed())  # the worker's seed
        return self.gen

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 1 << 30, (), generator=self._g()))])

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self._g().get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._g().set_state(state["gen"])


def loaders(rank: int, world: int, kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "plain" in kinds:  # shuffled from torch's global generator
        ds = Noisy()
        sampler = DistributedSampler(ds, world, rank, shuffle=True, seed=5) if world > 1 else None
        loader = DataLoader(ds, batch_size=BATCH, shuffle=sampler is None, sampler=sampler, num_workers=2)
        out["plain"] = ResumableLoader(loader)
    if "stateful" in kinds:  # shuffled from a generator of its own
        from torchdata.stateful_dataloader import StatefulDataLoader

        ds = NoisyStateful()
        sampler = DistributedSampler(ds, world, rank, shuffle=True, seed=7) if world > 1 else None
        gen = torch.Generator().manual_seed(11 + rank)
        out["stateful"] = StatefulDataLoader(
            ds, batch_size=BATCH, shuffle=sampler is None, sampler=sampler, num_workers=2, generator=gen
        )
    return out


def endless(loader: Any) -> Iterator[torch.Tensor]:
    """Epoch after epoch (a DistributedSampler's epoch is set by ResumableLoader; the StatefulDataLoader's
    keeps epoch 0: its epoch would be a part of the job's own to save)."""
    while True:
        yield from loader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--loaders", default="plain,stateful")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(100 + rank)
    parts = loaders(rank, world, a.loaders.split(","))
    job = TrainState(**parts)
    seen: dict[int, dict[str, Any]] = {}
    with Hierarchy.from_yaml(a.config) as h:
        done = job.restore(h)
        streams = {name: endless(loader) for name, loader in parts.items()}
        for step in range(done, a.steps):
            seen[step] = {name: next(s).tolist() for name, s in streams.items()}
            seen[step]["rng"] = torch.rand(()).item()
            job.save(h, step=step + 1)
            if step + 1 == a.kill_after:
                h.wait()
                Path(a.out).write_text(json.dumps(seen))
                os.kill(os.getpid(), signal.SIGKILL)
    Path(a.out).write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
