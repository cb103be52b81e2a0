"""Lightning's step time with a checkpoint every N steps: tierckpt's plugins against Lightning's own.

Usage::

    python benchmarks/bench_lightning.py [--width 2048] [--layers 6] [--steps 60] [--every 10] [--dir SCRATCH]

One process per plugin (a fresh page cache is not arranged: run it on a quiet machine), each fitting an
MLP of ``layers`` square ``width`` layers with Adam (state: weights + 2 moments, 12 bytes a parameter)
on random data for ``steps`` steps, with ``ModelCheckpoint(every_n_train_steps=every, save_last=True,
save_top_k=-1)``, all saving into ``dir``: Lightning's ``TorchCheckpointIO`` (synchronous),
``AsyncCheckpointIO(TorchCheckpointIO())``, tierckpt's ``HierarchyCheckpointIO`` and
``AsyncHierarchyCheckpointIO`` (host → local tier in ``dir``, the host tier keeping 1). The
installed Lightning has no DCP-based async plugin to compare with. Prints per plugin the median step
time without a save, the mean time of the steps that save (the save's own time on the training thread
included), the whole fit and the end of the fit (the plugins' teardown: pending writes), as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLUGINS = ("torch", "torch-async", "tierckpt", "tierckpt-async")


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from lightning import LightningModule, Trainer
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from tierckpt.integrations.lightning import AsyncHierarchyCheckpointIO, HierarchyCheckpointIO

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t = 0.0

        def on_train_batch_start(self, *a: Any) -> None:
            now = time.perf_counter()
            if self.t:
                self.times.append(now - self.t)
            self.t = now

    root = Path(args.dir)
    cfg = {"tiers": [{"name": "host", "kind": "host"}, {"name": "ssd", "kind": "local", "path": str(root / "tiers")}],
           "policy": {"keep": {"host": 1}}}  # fmt: skip
    io: Any = {
        "torch": lambda: TorchCheckpointIO(),
        "torch-async": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "tierckpt": lambda: HierarchyCheckpointIO(cfg, prefetch=False),
        "tierckpt-async": lambda: AsyncHierarchyCheckpointIO(cfg, prefetch=False),
    }[args.child]()
    clock = Clock()
    callbacks: list[Callback] = [
        clock,
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=args.every, save_top_k=-1, save_last=True),
    ]
    if isinstance(io, AsyncHierarchyCheckpointIO):
        callbacks.append(io.callback)
    model = MLP()
    x = torch.randn(args.steps * 32, args.width)
    trainer = Trainer(
        max_steps=args.steps, plugins=[io], callbacks=callbacks, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(TensorDataset(x), batch_size=32))
    fit = time.perf_counter() - t0
    t_end = time.perf_counter() - clock.t  # the last step, then the end of the fit (teardown: pending writes)
    saving = [t for i, t in enumerate(clock.times, 1) if i % args.every == 0]
    plain = [t for i, t in enumerate(clock.times, 1) if i % args.every != 0]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return {
        "plugin": args.child, "state_MB": round(nbytes / 1e6), "step_ms": round(statistics.median(plain) * 1e3, 1),
        "saving_step_ms": round(statistics.mean(saving) * 1e3, 1), "fit_s": round(fit, 2),
        "end_of_fit_s": round(t_end, 2), "saves": len(saving),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temporary one)")
    p.add_argument("--plugins", default=",".join(PLUGINS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_lightning."))
    for name in args.plugins.split(","):
        d = base / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        cmd = [sys.executable, __file__, "--child", name, "--dir", str(d)]
        cmd += ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
        r = subprocess.run([*cmd, "--every", str(args.every)], capture_output=True, text=True, env=os.environ)
        print(r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"{name}: failed\n{r.stderr[-3000:]}")
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
