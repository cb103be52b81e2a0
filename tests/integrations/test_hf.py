"""tierckpt.integrations.hf and .accelerate with a real transformers Trainer and Accelerator on the CPU: a
tiny causal LM from a config trained, stopped and resumed in a fresh process from the hierarchy (what is
loaded equal to what was saved, bit for bit, and the losses of an uninterrupted run), save_total_limit's
rotation deleting steps from the hierarchy, SIGKILL then resume; and Accelerate's state through a
hierarchy."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tierckpt[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'tierckpt[hf]')")

from jobs import report, run_job

from tierckpt import CheckpointNotFoundError, Hierarchy, StateError
from tierckpt.integrations._pointers import read_pointer
from tierckpt.integrations.hf import POINTER_NAME

CONFIG = """tiers:
  - {name: host, kind: host, capacity: 1GiB}
  - {name: ssd, kind: local, path: ssd}
policy:
  keep: {host: 1}
"""


def _job(d: Path, out: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_job("hf_job.py", d, CONFIG, out, *args, check=check, env={"HF_HUB_OFFLINE": "1"})


def _report(d: Path, out: str) -> dict[str, Any]:
    return report(d, out)


def _steps(d: Path) -> list[int]:
    with Hierarchy.from_yaml(d / "cfg.yaml", readonly=True) as h:
        return [c.step for c in h.checkpoints() if c.tiers]


def _folders(d: Path) -> list[str]:
    return sorted(p.name for p in (d / "run").iterdir())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """16 steps without a stop: the reference of every resumed run."""
    d = tmp_path_factory.mktemp("reference")
    _job(d, "ref.json")
    return _report(d, "ref.json")


def _continues_as(d: Path, resumed: dict[str, Any], reference: dict[str, Any], from_step: int) -> None:
    assert json.loads((d / "loaded.json").read_text()) == {"global_step": from_step, "differences": []}
    # the log history up to from_step came back with trainer_state.json; the steps after it were run again
    assert sorted(map(int, resumed["losses"])) == list(range(1, 17))
    assert resumed["losses"] == reference["losses"]
    assert resumed["weights"] == reference["weights"]


def test_stop_then_resume_true_in_a_fresh_process(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """Stopped after step 8 (saves at 4 and 8), then resume_from_checkpoint=True in a new process: the
    Trainer finds checkpoint-8, what it loads equals what was saved (weights, optimizer, scheduler, RNG,
    global step: bit for bit), and it goes on as the uninterrupted run; save_total_limit=2 removed
    checkpoint-4 and checkpoint-8 and their steps from the hierarchy."""
    _job(tmp_path, "a.json", "--stop-at", "8")
    assert _folders(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint-8").iterdir()) == [POINTER_NAME, "trainer_state.json"]
    pointer = read_pointer(tmp_path / "run" / "checkpoint-8" / POINTER_NAME)
    assert pointer is not None and (pointer.step, pointer.global_step) == (8, 8)
    assert json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8
    assert _steps(tmp_path) == [4, 8]
    _job(tmp_path, "b.json", "--resume")
    _continues_as(tmp_path, _report(tmp_path, "b.json"), uninterrupted, 8)
    assert _folders(tmp_path) == ["checkpoint-12", "checkpoint-16"]
    assert _steps(tmp_path) == [12, 16]


def test_sigkill_mid_training_then_resume(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """Killed at step 10: the newest folder in place names a step that survived (8's, or 4's where 8's
    had not reached the ssd tier yet: its folder is put in place then), and the resumed run goes on as
    the uninterrupted one from there."""
    r = _job(tmp_path, "a.json", "--kill-at", "10", check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr[-4000:]
    newest = max(int(n.split("-")[1]) for n in _folders(tmp_path) if n.startswith("checkpoint-"))
    assert newest in (4, 8) and newest in _steps(tmp_path)
    _job(tmp_path, "b.json", "--resume")
    _continues_as(tmp_path, _report(tmp_path, "b.json"), uninterrupted, newest)


# -- in this process ---------------------------------------------------------------------------------------


def _build(tmp_path: Path, hierarchy: bool, max_steps: int, **kwargs: Any) -> Any:
    """hf_job.build in this process (the plain Trainer where ``hierarchy`` is False)."""
    from hf_job import build  # beside this file, on the path as jobs.py is

    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return build(str(tmp_path / "cfg.yaml") if hierarchy else None, str(tmp_path / "run"), max_steps, **kwargs)


def test_a_folder_the_trainer_wrote_itself_resumes_too(tmp_path: Path) -> None:
    """The plain Trainer saved checkpoint-4 (its files); the hierarchy's trainer resumes from it as the
    Trainer would, and saves through the hierarchy from then on."""
    from safetensors.torch import load_file

    plain = _build(tmp_path, False, 4)
    plain.train()
    assert (tmp_path / "run" / "checkpoint-4" / "model.safetensors").exists()
    trainer = _build(tmp_path, True, 8)
    loaded: dict[str, torch.Tensor] = {}
    original = trainer._load_optimizer_and_scheduler

    def record(checkpoint: str | None) -> None:  # the weights as loaded, before any step changes them
        loaded.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        original(checkpoint)

    trainer._load_optimizer_and_scheduler = record
    trainer.train(resume_from_checkpoint=True)
    saved = load_file(tmp_path / "run" / "checkpoint-4" / "model.safetensors")
    assert saved.keys() <= loaded.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert trainer.state.global_step == 8 and _steps(tmp_path) == [8]
    assert (tmp_path / "run" / "checkpoint-8" / POINTER_NAME).exists()


def test_a_folder_whose_step_holds_another_checkpoint_is_refused(tmp_path: Path) -> None:
    trainer = _build(tmp_path, True, 4, trainer_prefetch=False)
    trainer.train()
    with Hierarchy.from_yaml(tmp_path / "cfg.yaml") as h:
        h.delete(4)
        h.save({"other": torch.ones(2)}, step=4, blocking=True).wait()
    again = _build(tmp_path, True, 8, trainer_prefetch=False)
    with pytest.raises(CheckpointNotFoundError, match="another checkpoint"):
        again.train(resume_from_checkpoint=True)


def test_blocking_saves_and_the_best_model_at_the_end(tmp_path: Path) -> None:
    """blocking=True: each folder is in place when _save_checkpoint returns; load_best_model_at_end loads
    the weights of the best step from the hierarchy (the highest eval loss is "best" here, so that it is
    not the last step: the eval loss falls)."""
    trainer = _build(
        tmp_path, True, 12, trainer_blocking=True, eval_strategy="steps", eval_steps=4, save_total_limit=None,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
    )  # fmt: skip
    weights: dict[int, dict[str, torch.Tensor]] = {}
    original = trainer._save_checkpoint

    def save(model: Any, trial: Any) -> None:
        original(model, trial)
        gs = trainer.state.global_step
        assert read_pointer(tmp_path / "run" / f"checkpoint-{gs}" / POINTER_NAME) is not None
        weights[gs] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    trainer._save_checkpoint = save
    trainer.train()
    best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
    assert best == 4 and sorted(weights) == [4, 8, 12] and _steps(tmp_path) == [4, 8, 12]
    assert all(torch.equal(v, weights[4][k]) for k, v in trainer.model.state_dict().items())


# -- Accelerate --------------------------------------------------------------------------------------------


def _accelerated(seed: int) -> tuple[Any, Any, Any, Any]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _steps_of(acc: Any, model: Any, opt: Any, sched: Any, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x = torch.randn(4, 8)  # from the global generator: the RNG state decides the data too
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerate_save_state_then_load_state_into_fresh_objects(tmp_path: Path) -> None:
    """save_state after 3 steps, 3 more steps; then fresh objects (other initial weights) load_state:
    they hold what was saved, bit for bit, and the 3 steps after it give the same losses."""
    from tierckpt.integrations.accelerate import load_state, save_state

    (tmp_path / "cfg.yaml").write_text(CONFIG)
    acc, model, opt, sched = _accelerated(0)
    _steps_of(acc, model, opt, sched, 3)
    with Hierarchy.from_yaml(tmp_path / "cfg.yaml") as h:
        save_state(acc, h, 3)
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "lr": sched.get_last_lr()}
        after = _steps_of(acc, model, opt, sched, 3)
    acc, model, opt, sched = _accelerated(1)
    with Hierarchy.from_yaml(tmp_path / "cfg.yaml") as h:
        assert load_state(acc, h) == 3 and h.last_restore == (3, "ssd")
        assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
        assert sched.get_last_lr() == saved["lr"] and len(opt.state_dict()["state"]) == 4
        assert _steps_of(acc, model, opt, sched, 3) == after


def test_accelerate_load_state_names_what_does_not_match(tmp_path: Path) -> None:
    from tierckpt.integrations.accelerate import load_state, save_state

    (tmp_path / "cfg.yaml").write_text(CONFIG)
    acc, *_ = _accelerated(0)
    with Hierarchy.from_yaml(tmp_path / "cfg.yaml") as h:
        assert load_state(acc, h) == 0  # nothing saved yet: nothing changes
        save_state(acc, h, 1, blocking=True)
        acc._schedulers.clear()  # a run without the scheduler
        with pytest.raises(StateError, match="scheduler"):
            load_state(acc, h)
