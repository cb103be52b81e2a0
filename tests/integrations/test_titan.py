"""torchtitan's checkpointer through a hierarchy (tierckpt.integrations.titan), with torchtitan's own
optimizer, scheduler, data loader and model wrapper on the CPU (tests/integrations/titan_job.py): SIGKILL
mid-run and resume in new processes, on one rank and on two FSDP2 ranks, continues as the uninterrupted
run; ``keep_latest_k`` deletes through ``Hierarchy.delete``; the final model-only save, a seed
checkpoint at step 0 and an ``initial_load_path`` read as torchtitan reads them."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'tierckpt[titan]')")
pytest.importorskip("torchdata", reason="torchdata is not installed (pip install 'tierckpt[titan]')")

import torch
from launch import run_ranks  # tests/integrations/launch.py
from titan_job import Job

from tierckpt import Hierarchy
from tierckpt.integrations.titan import HierarchyCheckpointManager

JOB = Path(__file__).with_name("titan_job.py")
CONFIG = """\
tiers:
  - {name: host, kind: host, capacity: 64MiB}
  - {name: ssd, kind: local, path: ssd}
"""
STEPS = 10


def _run(d: Path, world: int, out: str, *args: str) -> list[int]:
    d.mkdir(exist_ok=True)
    (d / "cfg.yaml").write_text(CONFIG)
    return run_ranks(JOB, d, world, "--config", "cfg.yaml", "--steps", str(STEPS), *args, out=out)


@pytest.mark.parametrize("world", [1, 2])
def test_killed_then_resumed_continues_as_the_uninterrupted_run(tmp_path: Path, world: int) -> None:
    """Saves every 2 steps (keep_latest_k=2), SIGKILLed after step 5 (its step 4 save durable), resumed in
    new processes: it loads step 4 (model, AdamW moments, LR schedule, each rank's data loader position,
    the trainer's step) and the losses of steps 5 to 10 and the final weights equal the uninterrupted
    run's, bit for bit; the hierarchy then holds the newest two steps."""
    assert _run(tmp_path / "ref", world, "ref.json") == [0] * world
    ref = json.loads((tmp_path / "ref" / "ref.json").read_text())
    assert _run(tmp_path / "job", world, "a.json", "--kill-at", "5") == [-signal.SIGKILL] * world
    assert _run(tmp_path / "job", world, "b.json") == [0] * world
    resumed = json.loads((tmp_path / "job" / "b.json").read_text())
    assert resumed["loaded"] and not ref["loaded"]
    assert sorted(map(int, resumed["losses"])) == list(range(5, STEPS + 1))
    assert resumed["losses"] == {k: v for k, v in ref["losses"].items() if int(k) >= 5}
    assert resumed["weights"] == ref["weights"]
    with Hierarchy.from_yaml(tmp_path / "job" / "cfg.yaml", readonly=True) as h:
        assert [c.step for c in h.checkpoints() if c.tiers] == [8, 10]


# -- in this process -----------------------------------------------------------------------------------


def _cfg(tmp_path: Path) -> str:
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return str(tmp_path / "cfg.yaml")


def test_keep_latest_k_deletes_older_steps_and_the_last_save_holds_the_model_only(tmp_path: Path) -> None:
    """interval=1, keep_latest_k=3: after each save the hierarchy holds the newest three steps (the others
    deleted with Hierarchy.delete); the last save (last_save_model_only, export_dtype=bfloat16) holds the
    model alone, in bfloat16."""
    job = Job(6, hierarchy=_cfg(tmp_path), interval=1, keep_latest_k=3, export_dtype="bfloat16")
    assert job.train() is False
    with Hierarchy.from_yaml(tmp_path / "cfg.yaml", readonly=True) as h:
        assert [c.step for c in h.checkpoints() if c.tiers] == [4, 5, 6]
        last = h.restore(6)
        assert set(last) == {"model"} and all(t.dtype == torch.bfloat16 for t in last["model"].values())
        full = h.restore(5)
        assert set(full) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
        assert full["train_state"]["step"] == 5


def test_seed_checkpoint_and_initial_load_path(tmp_path: Path) -> None:
    """A step 0 (torchtitan's seed checkpoint: the model only) loads into the model alone; with no step in
    the hierarchy, initial_load_path (a DCP folder in torchtitan's layout) is read with DCP."""
    import torch.distributed.checkpoint as dcp

    seed = Job(4, hierarchy=_cfg(tmp_path), last_save_model_only=True)
    seed.checkpointer.save(0, last_step=True)  # as --checkpoint.create_seed_checkpoint does
    seed.checkpointer.close()
    job = Job(4, hierarchy=_cfg(tmp_path))
    torch.nn.init.zeros_(job.model[0].weight)
    assert job.checkpointer.load() is True
    assert torch.equal(job.model[0].weight, seed.model[0].weight) and job.train_state.step == 0
    job.checkpointer.close()

    folder = tmp_path / "titan-step-3"
    dcp.save(seed.model.state_dict(), checkpoint_id=str(folder))
    other = tmp_path / "other"
    other.mkdir()
    fresh = Job(4, hierarchy=_cfg(other), initial_load_path=str(folder))
    torch.nn.init.zeros_(fresh.model[0].weight)
    assert fresh.checkpointer.load() is True
    assert torch.equal(fresh.model[0].weight, seed.model[0].weight)
    fresh.checkpointer.close()


def test_exclude_from_loading_and_load_only(tmp_path: Path) -> None:
    """A part in exclude_from_loading is left as the new job built it; load_only opens the hierarchy
    read-only and saves nothing."""
    Job(4, hierarchy=_cfg(tmp_path), interval=2, last_save_model_only=False).train()
    job = Job(4, hierarchy=_cfg(tmp_path), exclude_from_loading=["lr_scheduler"], load_only=True)
    assert job.checkpointer.load() is True
    assert job.train_state.step == 4 and job.lr_schedulers.schedulers[0].last_epoch == 0
    assert job.checkpointer.save(6, last_step=True) is False and job.checkpointer.h.readonly
    job.checkpointer.close()


def test_selected_by_config_with_torchtitans_command_line_overrides() -> None:
    """torchtitan's ConfigManager (``--module``/``--config`` and field overrides, as ``torchtitan.train``
    parses them) keeps the manager's config class, its own fields included: the class it builds."""
    from torchtitan.config import ConfigManager

    args = ["--module", "titan_job", "--config", "tierckpt_debug", "--checkpoint.interval", "7"]
    cfg: Any = ConfigManager().parse_args([*args, "--checkpoint.hierarchy", "tiers/b.yaml"])
    assert type(cfg.checkpoint) is HierarchyCheckpointManager.Config
    assert (cfg.checkpoint.interval, cfg.checkpoint.hierarchy, cfg.checkpoint.enable) == (7, "tiers/b.yaml", True)
    assert cfg.checkpoint._owner is HierarchyCheckpointManager


def test_config_errors_and_disabled() -> None:
    with pytest.raises(ValueError, match="hierarchy's YAML file is required"):
        HierarchyCheckpointManager.Config(enable=True)
    with pytest.raises(ValueError, match="tierckpt export"):
        HierarchyCheckpointManager.Config(enable=True, hierarchy="x.yaml", last_save_in_hf=True)
    off: Any = HierarchyCheckpointManager.Config().build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )
    assert off.load() is False and off.save(10, last_step=True) is False
