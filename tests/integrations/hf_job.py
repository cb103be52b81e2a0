"""A tiny Hugging Face Trainer job for tests/integrations/test_hf.py, run in a process of its own.

A Llama-style causal LM built from a config (2 layers of width 64, attention dropout on, so the RNG
matters), trained on fixed random token ids with AdamW and the linear schedule, saving every 4 steps
through ``HierarchyTrainer`` (``save_total_limit=2``). It writes a JSON report: every step's loss, the
final weights' digests, and, when resumed, whether what was loaded (weights, optimizer, scheduler, RNG
states, global step) equals what the saving run had at that step (it ``torch.save``s a reference copy
next to the report at each save).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compare import differences
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

from tierckpt.integrations.hf import POINTER_NAME, HierarchyTrainer


def snapshot(trainer: Any) -> dict[str, Any]:
    """What a checkpoint must give back: weights, optimizer, scheduler, RNG states, global step."""
    return {
        "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(), "global_step": trainer.state.global_step,
        "rng": {
            "python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": [s.tolist() if isinstance(s, np.ndarray) else s for s in np.random.get_state()],
        },
    }  # fmt: skip


class Job(HierarchyTrainer):
    """Records what a resume loaded, right after the last of its loads (the RNG states')."""

    ref_dir: Path | None = None  # where the reference copies are (None: nothing recorded)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is not None and self.ref_dir is not None:
            got = snapshot(self)
            saved = torch.load(self.ref_dir / f"saved-{got['global_step']}.pt", weights_only=False)
            loaded = {"global_step": got["global_step"], "differences": differences(saved, got)}
            (self.ref_dir.parent / "loaded.json").write_text(json.dumps(loaded))


class Reference(TrainerCallback):
    """Keeps a torch.save copy of what each save held (the trainer is between steps: nothing changes)."""

    def __init__(self, trainer: Job) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.save(snapshot(self.trainer), self.trainer.ref_dir / f"saved-{state.global_step}.pt")


class Stop(TrainerCallback):
    """Stop (``--stop-at``, after that step's save) or SIGKILL this process (``--kill-at``, once some
    checkpoint folder is in place: a preemption without warning)."""

    def __init__(self, stop_at: int | None, kill_at: int | None, run_dir: str) -> None:
        self.stop_at, self.kill_at, self.run_dir = stop_at, kill_at, run_dir

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.kill_at is not None and state.global_step >= self.kill_at:
            for _ in range(600):  # until some folder is in place (its step durable): up to 30 s
                if any(Path(self.run_dir).glob(f"checkpoint-*/{POINTER_NAME}")):
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)


def build(config: str | None, run_dir: str, max_steps: int, **kwargs: Any) -> Any:
    """The job's trainer: a :class:`Job` saving through the hierarchy ``config``, or where it is None the
    plain ``Trainer`` (``kwargs``: more ``TrainingArguments``, and the trainer's own with ``trainer_``)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, attention_dropout=0.1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(1))
    settings = dict(
        output_dir=run_dir, max_steps=max_steps, save_steps=4, save_total_limit=2, per_device_train_batch_size=4,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-3,
    )  # fmt: skip
    args = TrainingArguments(**{**settings, **{k: v for k, v in kwargs.items() if not k.startswith("trainer_")}})
    data = [{"input_ids": r, "labels": r} for r in ids]
    own = {k.removeprefix("trainer_"): v for k, v in kwargs.items() if k.startswith("trainer_")}
    if config is None:
        return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8], **own)
    return Job(model=model, args=args, train_dataset=data, eval_dataset=data[:8], hierarchy=config, **own)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    trainer = build(a.config, a.root, a.max_steps)
    trainer.ref_dir = Path(a.out).parent / "saved"
    trainer.ref_dir.mkdir(exist_ok=True)
    trainer.add_callback(Reference(trainer))
    trainer.add_callback(Stop(a.stop_at, a.kill_at, a.root))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    report = {
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "global_step": trainer.state.global_step,
        "weights": {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in trainer.model.state_dict().items()},
    }
    Path(a.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
