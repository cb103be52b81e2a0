"""``restore(key_map=...)``: a checkpoint restored under other key paths than it was saved with. A
``torch.compile``d model's state restored into a plain model and the other way round (in place, as fresh
tensors, through ``TrainState``), renamed parameters (a mapping, a callable), tied weights kept tied,
``strict=False`` adding keys under their mapped names, a value left out, ``load_safetensors`` with the
same map, and the errors a wrong map gives, before any tensor of the target changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tierckpt import Hierarchy, KeyMap, StateError, TrainState, load_safetensors


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.fixture
def h(tmp_path: Path) -> Any:
    tiers = [{"name": "host", "kind": "host"}, {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")}]
    with Hierarchy.from_config({"tiers": tiers}) as h:
        yield h


def test_a_compiled_models_checkpoint_restores_into_a_plain_model_and_back(h: Hierarchy) -> None:
    saved = model(0)
    h.save({"model": torch.compile(saved).state_dict(), "step": 1}, step=1, blocking=True)
    plain = model(1)
    with pytest.raises(StateError, match=r"key_map=tierckpt.KeyMap.torch_compile\(\)"):  # the error says what to do
        h.restore(into={"model": plain.state_dict(), "step": 0})
    assert not same(plain, saved)  # nothing changed
    for tier in ("host", "ssd"):
        target = model(2)
        got = h.restore(into={"model": target.state_dict(), "step": 0}, key_map=KeyMap.torch_compile(), tier=tier)
        assert same(target, saved) and got["step"] == 1
    fresh = h.restore(key_map=KeyMap.torch_compile())  # new tensors: the prefix dropped
    assert list(fresh["model"]) == list(saved.state_dict()) and model(3).load_state_dict(fresh["model"])
    h.save({"model": saved.state_dict(), "step": 2}, step=2, blocking=True)  # plain, into a compiled one
    compiled = torch.compile(model(4))
    h.restore(into={"model": compiled.state_dict(), "step": 0}, key_map=KeyMap.torch_compile())
    assert same(compiled, saved)


def test_train_state_takes_a_key_map(h: Hierarchy) -> None:
    saved = model(0)
    opt = torch.optim.AdamW(saved.parameters(), lr=0.01)
    saved(torch.ones(2, 8)).sum().backward()
    opt.step()
    TrainState(model=torch.compile(saved), optim=opt).save(h, step=7, blocking=True)
    target = model(1)
    fresh_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    assert TrainState(model=target, optim=fresh_opt).restore(h, key_map=KeyMap.torch_compile()) == 7
    assert same(target, saved)
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 0.01
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_renamed_parameters_by_a_mapping_or_a_callable(h: Hierarchy) -> None:
    old = model(0)
    h.save({"model": old.state_dict()}, step=1, blocking=True)
    renamed = {"0.weight": "encoder.weight", "0.bias": "encoder.bias", "2.weight": "head.weight", "2.bias": "head.bias"}
    target = {"model": {new: torch.zeros_like(old.state_dict()[k]) for k, new in renamed.items()}}
    mapping = {f"model.{k}": f"model.{v}" for k, v in renamed.items()}
    for key_map in (mapping, lambda p: mapping.get(p, p)):
        for t in target["model"].values():
            t.zero_()
        h.restore(into=target, key_map=key_map)
        assert all(torch.equal(target["model"][v], old.state_dict()[k]) for k, v in renamed.items())
    got = h.restore(key_map=mapping)  # fresh tensors under the new names
    assert list(got["model"]) == list(renamed.values())
    # a rename may change the nesting: the target's structure decides
    nested = {"encoder": {"weight": torch.zeros(16, 8)}, "rest": {}}
    h.restore(into=nested, key_map={"model.0.weight": "encoder.weight"}, strict=False)
    assert torch.equal(nested["encoder"]["weight"], old.state_dict()["0.weight"])
    assert sorted(nested["model"]) == ["0.bias", "2.bias", "2.weight"]  # strict=False: added as mapped
    # a prefix renames a whole module; a value mapped to None is left out
    got = h.restore(key_map={"model.0.": "model.encoder.", "model.2.": "model.head."})
    assert list(got["model"]) == list(renamed.values())
    got = h.restore(key_map=lambda p: None if p.endswith("bias") else p)
    assert list(got["model"]) == ["0.weight", "2.weight"]


def test_tied_weights_stay_tied_under_a_key_map(h: Hierarchy) -> None:
    w = torch.randn(5, 3)
    h.save({"model": {"_orig_mod.emb": w, "_orig_mod.out": w}}, step=1, blocking=True)
    got = h.restore(key_map=KeyMap.torch_compile())
    assert got["model"]["emb"] is got["model"]["out"] and torch.equal(got["model"]["emb"], w)


def test_a_wrong_map_is_a_state_error_before_anything_changes(h: Hierarchy) -> None:
    old = model(0)
    h.save({"model": old.state_dict()}, step=1, blocking=True)
    target = model(1)
    before = [t.clone() for t in target.state_dict().values()]
    into = {"model": target.state_dict()}
    cases = [
        ({"model.0.weight": "model.2.weight"}, r"'model.0.weight' and 'model.2.weight' both map to "),
        (
            {"model.0.weight": "model.first.weight"},
            r"\['0.weight'\]: key is not in the checkpoint \(no saved key path maps to it\)"
            r"(.|\n)*\['first.weight'\]: key is only in the checkpoint \(saved as 'model.0.weight'\)",
        ),
        ({"model.0.weight": "model.0.weight.x"}, r"\['0.weight.x'\]: key is only in the checkpoint"),
    ]
    for key_map, match in cases:
        with pytest.raises(StateError, match=match):
            h.restore(into=into, key_map=key_map)
        assert all(torch.equal(a, b) for a, b in zip(before, target.state_dict().values(), strict=True))
    with pytest.raises(TypeError, match="not a str or None"):
        h.restore(into=into, key_map=lambda p: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="expected a mapping of prefixes or a function"):
        h.restore(key_map=["model"])  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, target.state_dict().values(), strict=True))


def test_load_safetensors_takes_the_same_map(tmp_path: Path) -> None:
    """A plain model's safetensors file (a Hugging Face one, say) loaded into a compiled model's state."""
    safetensors = pytest.importorskip("safetensors.torch")
    plain = model(0)
    safetensors.save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(tmp_path / "m.safetensors"))
    compiled = torch.compile(model(1))
    load_safetensors(tmp_path / "m.safetensors", into=compiled.state_dict(), key_map=KeyMap.torch_compile())
    assert same(compiled, plain)
