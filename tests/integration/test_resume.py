"""The resume path: ``restore(into=, strict=)``, :class:`tierckpt.TrainState` (model, fresh optimizer,
scheduler, RNG, data position) and the RNG helpers."""

from __future__ import annotations

import importlib.util
import logging
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tierckpt import Hierarchy, StateError, TrainState, rng_state, set_rng_state

ROOT = Path(__file__).resolve().parents[2]


def open_h(tmp_path: Path) -> Hierarchy:
    return Hierarchy.from_config({"tiers": [{"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")}]})


def job(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def update(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, i: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


class Position:
    """A data position that reports itself with numpy scalars."""

    def __init__(self) -> None:
        self.pos, self.epoch = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": np.int64(self.pos), "epoch": np.float32(self.epoch), "seen": [np.uint8(1), (np.bool_(True),)]}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.pos, self.epoch, self.seen = s["pos"], s["epoch"], s["seen"]


# -- restore(into=, strict=) ---------------------------------------------------------------------------


def test_strict_lists_every_key_missing_from_either_side_and_changes_nothing(tmp_path: Path) -> None:
    state = {"model": {f"w{i}": torch.full((2,), float(i)) for i in range(30)}, "step": 3, "meta": {"a": 1}}
    with open_h(tmp_path) as h:
        h.save(state, step=3).wait()
        target = {"model": {f"w{i}": torch.zeros(2) for i in range(5, 60)}, "step": 0, "other": 1}
        with pytest.raises(StateError) as ei:
            h.restore(into=target)
        msg = str(ei.value)
        # w30..w59 and 'other' only in the target, w0..w4 and 'meta' only in the checkpoint
        assert "in 37 place(s)" in msg
        assert "target['model']['w35']: key is not in the checkpoint" in msg
        assert "target['other']: key is not in the checkpoint" in msg
        assert "31 key(s) not in the checkpoint, 6 only in it" in msg
        assert "target['model']['w4']: key is only in the checkpoint" in msg  # both sides are shown
        assert "target['meta']: key is only in the checkpoint" in msg
        assert "... and " in msg and "strict=False" in msg and msg.count("\n") < 30  # bounded
        assert all(not t.any() for t in target["model"].values()) and target["step"] == 0 and "meta" not in target
        # one key short: named alone
        small = {"model": {f"w{i}": torch.zeros(2) for i in range(30)}, "step": 0}
        with pytest.raises(StateError, match=r"^target\['meta'\]: key is only in the checkpoint"):
            h.restore(into=small)


def test_strict_false_adds_checkpoint_keys_leaves_target_keys_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"model": {"a": torch.ones(3), "b": torch.full((2,), 2.0)}, "step": 3}
    with open_h(tmp_path) as h:
        h.save(state, step=3).wait()
        keep = torch.full((4,), 7.0)
        target: dict[str, Any] = {"model": {"a": torch.zeros(3), "new": keep}}
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            assert h.restore(into=target, strict=False) is target
        assert torch.equal(target["model"]["a"], torch.ones(3)) and torch.equal(
            target["model"]["b"], state["model"]["b"]
        )
        assert target["step"] == 3 and target["model"]["new"] is keep and torch.equal(keep, torch.full((4,), 7.0))
        assert "1 key(s) only in the target were left as they are, 2 only in the checkpoint were added" in caplog.text
        assert "target['model']['new']" in caplog.text
        # shapes must match either way, and every mismatch is listed
        bad = {"model": {"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)}, "step": 0}
        with pytest.raises(
            StateError, match=r"(?s)in 2 place.*'a'\]: target is torch.float32 \(4,\).*'b'\]: target is torch.int64"
        ):
            h.restore(into=bad, strict=False)


def test_restore_into_a_fresh_optimizer_is_refused_with_the_route(tmp_path: Path) -> None:
    model, opt, sched = job(0)
    update(model, opt, sched, 0)
    with open_h(tmp_path) as h:
        h.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=1).wait()
        model2, opt2, _ = job(1)
        target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        with pytest.raises(
            StateError, match=r"target\['optim'\]\['state'\]: target is an empty dict.*fresh optimizer.*TrainState"
        ):
            h.restore(into=target)
        assert not opt2.state and not torch.equal(model2[0].weight, model[0].weight)  # nothing changed
        # the documented route without TrainState: strict=False, then load_state_dict
        out = h.restore(into={"model": model2.state_dict(), "optim": opt2.state_dict()}, strict=False)
        opt2.load_state_dict(out["optim"])
        assert torch.equal(opt2.state[model2[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


# -- TrainState ----------------------------------------------------------------------------------------


def test_train_state_resumes_a_fresh_job_exactly(tmp_path: Path) -> None:
    model, opt, sched = job(0)
    data = Position()
    for i in range(3):
        update(model, opt, sched, i)
    data.pos, data.epoch = 3, 1
    gen = torch.Generator().manual_seed(5)
    with open_h(tmp_path) as h:
        TrainState(model=model, optim=opt, sched=sched, data=data, gen=gen).save(h, step=3).wait()
        expected = (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=gen))
        model2, opt2, sched2 = job(1)  # different weights, a fresh optimizer (no state tensors), step 0
        data2, gen2 = Position(), torch.Generator()
        params = [p.data_ptr() for p in model2.parameters()]
        assert TrainState(model=model2, optim=opt2, sched=sched2, data=data2, gen=gen2).restore(h) == 3
    assert (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=gen2))[1:3] == expected[1:3]
    assert [p.data_ptr() for p in model2.parameters()] == params  # restored in place
    assert type(data2.pos) is int and data2.pos == 3 and type(data2.epoch) is float and data2.seen == [1, (True,)]
    assert sched2.state_dict() == sched.state_dict() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert opt2.state[q].keys() == opt.state[p].keys()
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in opt.state[p])
    for i in range(3, 5):  # and training goes on bit for bit
        update(model, opt, sched, i)
        update(model2, opt2, sched2, i)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_rng_states_come_back_exactly(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # a cached gaussian on both
    with open_h(tmp_path) as h:
        TrainState(model=nn.Linear(2, 2)).save(h, step=1).wait()
        draws = (random.gauss(0, 1), random.random(), np.random.standard_normal(), np.random.rand(3), torch.rand(3))
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        TrainState(model=nn.Linear(2, 2)).restore(h)
    again = (random.gauss(0, 1), random.random(), np.random.standard_normal(), np.random.rand(3), torch.rand(3))
    assert draws[:3] == again[:3] and np.array_equal(draws[3], again[3]) and torch.equal(draws[4], again[4])


def test_malformed_rng_state_is_refused_before_anything_changes() -> None:
    good = rng_state()
    before = torch.get_rng_state()
    for bad, where in [
        ({"torch": good["torch"]}, r"rng state: expected a dict with 'python' and 'torch'"),
        ({**good, "torch": good["torch"].float()}, r"rng state\['torch'\]: expected a uint8 tensor"),
        ({**good, "numpy": (1, 2)}, r"rng state\['numpy'\]"),
        ({**good, "python": {**good["python"], "state": torch.zeros(3, dtype=torch.int64)}}, r"\['python'\]: .*625"),
        ({**good, "numpy": {**good["numpy"], "keys": torch.zeros(3)}}, r"\['numpy'\]: .*624"),
        ({**good, "cuda": {"0": good["torch"]}}, r"rng state\['cuda'\]"),
    ]:
        state = random.getstate()
        with pytest.raises(StateError, match=where):
            set_rng_state(bad)
        assert random.getstate() == state and torch.equal(torch.get_rng_state(), before)


def test_train_state_errors_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(StateError, match=r"part 'step': a builtins.int has no state_dict\(\)"):
        TrainState(model=nn.Linear(2, 2), step=3)
    with pytest.raises(StateError, match="rng= takes True or False"):
        TrainState(model=nn.Linear(2, 2), rng=nn.Linear(2, 2))  # type: ignore[arg-type]
    with open_h(tmp_path) as h:
        assert TrainState(model=nn.Linear(2, 2)).restore(h) == 0  # nothing saved yet: a fresh start
        TrainState(model=nn.Linear(2, 2), optim=Position()).save(h, step=1).wait()
        with pytest.raises(StateError, match=r"target\['opt'\]: key is not in the checkpoint"):
            TrainState(model=nn.Linear(2, 2), opt=Position()).restore(h)
        with pytest.raises(StateError, match=r"target\['model'\]\['weight'\]: target is torch.float32 \(3, 2\)"):
            TrainState(model=nn.Linear(2, 3), optim=Position()).restore(h)
        with pytest.raises(StateError, match=r"missing \['data'\], not a part here \['rng'\]"):
            TrainState(model=nn.Linear(2, 2), optim=Position(), data=Position(), rng=False).load_state_dict(h.restore())


def test_numpy_values_have_a_route_and_the_refusal_points_at_it(tmp_path: Path) -> None:
    with open_h(tmp_path) as h:
        with pytest.raises(
            StateError, match=r"state\['lr'\]: cannot save a value of type numpy.float64 \(save x.item\(\)"
        ):
            h.save({"lr": np.float64(0.1)}, step=1)
        with pytest.raises(StateError, match=r"numpy.ndarray .*torch.from_numpy\(x\).*docs/resume.md"):
            h.save({"rng": np.random.get_state()}, step=1)


def test_quickstart_model_starts_at_the_loss_of_a_uniform_guess() -> None:
    spec = importlib.util.spec_from_file_location("tierckpt_quickstart_init", ROOT / "examples" / "quickstart.py")
    qs = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(qs)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model, opt, _ = qs.build(2)
    loss = qs.forward_backward(model, opt, 0)
    assert abs(loss - math.log(512)) < 0.3, loss
