"""A tiny Lightning training job for tests/integrations/test_lightning.py, run in a process of its own.

It trains a few linear layers with batch norm (buffers as well as parameters) on fixed random data, saves
through ``HierarchyCheckpointIO`` with a ``ModelCheckpoint`` (``save_last=True``, ``save_top_k=2`` on
the validation loss, every epoch), and writes a JSON report: every training step's loss, the checkpoint
dicts it saved (torch.save'd next to the report, the last one of each global step: what ``last.ckpt``
holds), and, when resumed, whether the checkpoint Lightning loaded equals the one saved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from compare import differences
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tierckpt.integrations.lightning import AsyncHierarchyCheckpointIO, HierarchyCheckpointIO


class Net(LightningModule):
    def __init__(self, width: int = 32, lr: float = 0.01, ref_dir: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        )
        self.losses: dict[int, float] = {}
        self.loaded: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ref = Path(self.hparams.ref_dir)
        if self.trainer.is_global_zero and self.hparams.ref_dir:
            torch.save(checkpoint, ref / f"saved-{checkpoint['global_step']}.pt")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ref = Path(self.hparams.ref_dir) / f"saved-{checkpoint['global_step']}.pt"
        saved = torch.load(ref, weights_only=False)
        self.loaded = {"global_step": checkpoint["global_step"], "differences": differences(saved, checkpoint)}
        (Path(self.hparams.ref_dir).parent / f"loaded-{self.global_rank}.json").write_text(json.dumps(self.loaded))


class Kill(Callback):
    """SIGKILL this process when training reaches global step ``at`` (a preemption without warning), once
    some checkpoint has its pointer (its saves may still be climbing down the tiers)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.at:
            last = Path(trainer.checkpoint_callback.dirpath or "", "last.ckpt")  # type: ignore[union-attr]
            for _ in range(600):  # until some checkpoint is durable (its pointer written): up to 30 s
                if last.exists():
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)


def data(n: int, seed: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--io", choices=["plain", "async"], default="plain")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    io_cls = AsyncHierarchyCheckpointIO if args.io == "async" else HierarchyCheckpointIO
    io = io_cls(args.config)
    ref = Path(args.out).parent / "saved"
    ref.mkdir(exist_ok=True)
    model = Net(ref_dir=str(ref))
    ckpt = ModelCheckpoint(
        dirpath=os.path.join(args.root, "checkpoints"), monitor="val_loss", save_top_k=2, save_last=True
    )
    callbacks: list[Callback] = [ckpt, *([Kill(args.kill_at)] if args.kill_at is not None else [])]
    if isinstance(io, AsyncHierarchyCheckpointIO):
        callbacks.append(io.callback)
    trainer = Trainer(
        default_root_dir=args.root, max_epochs=args.epochs, plugins=[io], callbacks=callbacks,
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        deterministic=True,
    )  # fmt: skip
    trainer.fit(model, data(128, 1), data(64, 2), ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        report = {
            "losses": model.losses, "loaded": model.loaded, "global_step": trainer.global_step,
            "best_k": {os.path.basename(k): float(v) for k, v in ckpt.best_k_models.items()},
            "last": os.path.basename(ckpt.last_model_path),
            "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        }  # fmt: skip
        Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
