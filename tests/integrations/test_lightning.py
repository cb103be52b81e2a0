"""tierckpt.integrations.lightning with a real Lightning Trainer on the CPU: fit, resume in a fresh process
(the loaded checkpoint equal to the saved one, the metrics of an uninterrupted run), SIGKILL then
resume, two DDP ranks; and the CheckpointIO's own calls (paths, pointers, removal, pickling)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install 'tierckpt[lightning]')")

from jobs import report, run_job

from tierckpt import CheckpointNotFoundError, Hierarchy, StateError, TierckptError
from tierckpt.integrations._pointers import read_pointer
from tierckpt.integrations.lightning import AsyncHierarchyCheckpointIO, HierarchyCheckpointIO

CONFIG = """tiers:
  - {name: host, kind: host, capacity: 1GiB}
  - {name: ssd, kind: local, path: ssd}
  - {name: pfs, kind: pfs, path: pfs}
policy:
  keep: {host: 1, ssd: 2}
"""


def _job(d: Path, out: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_job("lightning_job.py", d, CONFIG, out, *args, check=check)


def _report(d: Path, out: str) -> dict[str, Any]:
    return report(d, out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run of 4 epochs (8 steps each), the reference for every resumed one."""
    d = tmp_path_factory.mktemp("reference")
    _job(d, "ref.json", "--epochs", "4")
    return _report(d, "ref.json")


def _continues_as(resumed: dict[str, Any], reference: dict[str, Any], from_step: int) -> None:
    assert resumed["loaded"] == {"global_step": from_step, "differences": []}
    assert sorted(map(int, resumed["losses"])) == list(range(from_step, 32))
    assert {k: v for k, v in reference["losses"].items() if int(k) >= from_step} == resumed["losses"]
    assert resumed["weights"] == reference["weights"]


@pytest.mark.parametrize("io", ["plain", "async"])
def test_fit_then_resume_last_in_a_fresh_process(tmp_path: Path, uninterrupted: dict[str, Any], io: str) -> None:
    """2 epochs, then a new process fits to 4 with ckpt_path="last": the checkpoint Lightning loads equals
    the one it saved (every tensor bit for bit, loops, callbacks, hyperparameters), and the losses and
    final weights are those of the uninterrupted run."""
    _job(tmp_path, "a.json", "--epochs", "2", "--io", io)
    first = _report(tmp_path, "a.json")
    ckpts = tmp_path / "run" / "checkpoints"
    assert first["last"] == "last.ckpt" and len(first["best_k"]) == 2
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([*first["best_k"], "last.ckpt"])
    last = read_pointer(ckpts / "last.ckpt")
    assert last is not None and last.global_step == 16
    _job(tmp_path, "b.json", "--epochs", "4", "--resume", "--io", io)
    _continues_as(_report(tmp_path, "b.json"), uninterrupted, 16)


def test_sigkill_mid_training_then_resume(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """Killed in the middle of epoch 3 (after the saves of epochs 1 and 2): last.ckpt names a checkpoint
    that survived (epoch 2's, or epoch 1's where epoch 2's had not reached the ssd tier yet: its pointer
    is written then), and the resumed run goes on as the uninterrupted one from there."""
    r = _job(tmp_path, "a.json", "--epochs", "4", "--kill-at", "20", check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-4000:]
    last = read_pointer(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert last is not None and last.global_step in (8, 16)
    _job(tmp_path, "b.json", "--epochs", "4", "--resume")
    _continues_as(_report(tmp_path, "b.json"), uninterrupted, last.global_step)


def test_two_ddp_ranks_save_from_rank_0_and_both_resume(tmp_path: Path) -> None:
    """strategy="ddp" with 2 CPU processes (gloo): rank 0 saves; on resume each rank loads the checkpoint
    (rank 1 through a read-only hierarchy) and finds it equal to the saved one."""
    _job(tmp_path, "a.json", "--epochs", "2", "--devices", "2")
    _job(tmp_path, "b.json", "--epochs", "3", "--devices", "2", "--resume")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"loaded-{rank}.json").read_text()) == {"global_step": 8, "differences": []}
    assert _report(tmp_path, "b.json")["global_step"] == 12


# -- the CheckpointIO's calls, in this process ---------------------------------------------------------


def _io(tmp_path: Path, **kwargs: Any) -> HierarchyCheckpointIO:
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return HierarchyCheckpointIO(tmp_path / "cfg.yaml", **kwargs)


def _ckpt(gs: int, **extra: Any) -> dict[str, Any]:
    return {"global_step": gs, "epoch": 0, "state_dict": {"w": torch.full((4,), float(gs))}, **extra}


def test_paths_of_one_global_step_are_saves_of_their_own(tmp_path: Path) -> None:
    io = _io(tmp_path, blocking=True)
    a, b = tmp_path / "c" / "epoch=0-step=5.ckpt", tmp_path / "c" / "last.ckpt"
    io.save_checkpoint(_ckpt(5, tag="topk"), a)
    io.save_checkpoint(_ckpt(5, tag="last"), b)
    pa, pb = read_pointer(a), read_pointer(b)
    assert pa is not None and pb is not None and (pa.step, pb.step) == (5, 6)
    assert io.load_checkpoint(a)["tag"] == "topk" and io.load_checkpoint(b)["tag"] == "last"
    assert torch.equal(io.load_checkpoint(b, map_location="cpu")["state_dict"]["w"], torch.full((4,), 5.0))
    io.remove_checkpoint(a)
    assert not a.exists() and b.exists()
    with pytest.raises(FileNotFoundError, match="epoch=0-step=5"):
        io.load_checkpoint(a)
    io.teardown()
    assert HierarchyCheckpointIO(tmp_path / "cfg.yaml", readonly=True).load_checkpoint(b)["tag"] == "last"


def test_the_steps_it_deletes_are_those_no_pointer_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which steps the plugin hands to ``Hierarchy.delete`` (recorded here, whether or not this tree has it)."""
    deleted: list[int] = []
    monkeypatch.setattr(Hierarchy, "delete", lambda self, step: deleted.append(step), raising=False)
    io = _io(tmp_path, blocking=True)
    d = tmp_path / "c"
    io.save_checkpoint(_ckpt(1), d / "a.ckpt")
    io.save_checkpoint(_ckpt(2), d / "last.ckpt")
    io.save_checkpoint(_ckpt(3), d / "last.ckpt")  # its pointer named step 2
    os.symlink("a.ckpt", d / "link.ckpt")
    io.remove_checkpoint(d / "link.ckpt")  # a.ckpt still names step 1
    assert deleted == [2] and not (d / "link.ckpt").exists()
    io.remove_checkpoint(d / "a.ckpt")
    assert deleted == [2, 1]
    io.teardown()


def test_removed_and_overwritten_paths_release_their_steps(tmp_path: Path) -> None:
    io = _io(tmp_path, blocking=True)
    d = tmp_path / "c"
    io.save_checkpoint(_ckpt(1), d / "a.ckpt")
    io.save_checkpoint(_ckpt(2), d / "last.ckpt")
    io.save_checkpoint(_ckpt(3), d / "last.ckpt")  # releases step 2
    os.symlink("a.ckpt", d / "link.ckpt")
    io.remove_checkpoint(d / "link.ckpt")  # a.ckpt still names step 1
    io.save_checkpoint(_ckpt(4), d / "b.ckpt")
    steps = [c.step for c in io.hierarchy.checkpoints() if c.tiers]
    assert steps == [1, 3, 4]
    io.remove_checkpoint(d / "a.ckpt")
    io.teardown()
    with Hierarchy.from_yaml(tmp_path / "cfg.yaml", readonly=True) as h:
        assert [c.step for c in h.checkpoints() if c.tiers] == [3, 4]


def test_pickle_only_when_allowed(tmp_path: Path) -> None:
    io = _io(tmp_path, blocking=True, prefetch=False)
    with pytest.raises(StateError, match="hyper_parameters"):
        io.save_checkpoint(_ckpt(1, hyper_parameters={"act": torch.nn.ReLU()}), tmp_path / "c" / "x.ckpt")
    io.teardown()
    io = _io(tmp_path, blocking=True, allow_pickle=True)
    io.save_checkpoint(_ckpt(1, hyper_parameters={"act": torch.nn.ReLU()}), tmp_path / "c" / "x.ckpt")
    assert isinstance(io.load_checkpoint(tmp_path / "c" / "x.ckpt")["hyper_parameters"]["act"], torch.nn.ReLU)
    with pytest.raises(StateError):
        io.load_checkpoint(tmp_path / "c" / "x.ckpt", weights_only=True)
    io.teardown()


def test_a_torch_file_loads_and_a_stale_pointer_is_refused(tmp_path: Path) -> None:
    io = _io(tmp_path, blocking=True)
    torch.save(_ckpt(3), tmp_path / "old.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "old.ckpt")["state_dict"]["w"], torch.full((4,), 3.0))
    io.save_checkpoint(_ckpt(7), tmp_path / "c" / "x.ckpt")
    io.hierarchy.save({"other": 1}, step=7, blocking=True).wait()  # step 7 saved again, not through the plugin
    with pytest.raises(CheckpointNotFoundError, match="another checkpoint"):
        io.load_checkpoint(tmp_path / "c" / "x.ckpt")
    io.teardown()


def test_readonly_refuses_to_save_and_settings_pickle(tmp_path: Path) -> None:
    io = _io(tmp_path, readonly=True)
    with pytest.raises(TierckptError, match="readonly"):
        io.save_checkpoint(_ckpt(1), tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_ckpt(1), tmp_path / "x.ckpt", storage_options={"a": 1})
    copy = pickle.loads(pickle.dumps(AsyncHierarchyCheckpointIO(tmp_path / "cfg.yaml", prefetch=False)))
    assert copy.config == str(tmp_path / "cfg.yaml") and copy.callback.module is None


def test_save_last_link_in_process(tmp_path: Path) -> None:
    """``save_last="link"``: Lightning links last.ckpt to the newest top-k file right after saving it, before
    its pointer is written (the directory must exist by then); the link loads that checkpoint."""
    from lightning import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_job import Net, data  # beside this file, on the path as jobs.py is

    io = _io(tmp_path)
    ckpt = ModelCheckpoint(tmp_path / "ckpts", monitor="val_loss", save_top_k=2, save_last="link")
    trainer = Trainer(
        max_epochs=2, plugins=[io], callbacks=[ckpt], accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Net(), data(64, 1), data(32, 2))
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=1-step=8.ckpt"
    assert io.load_checkpoint(last)["global_step"] == 8
    io.teardown()
