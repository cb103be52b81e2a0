"""A restore's key map (tierckpt.datapath.keymap.remap) on plain trees (no I/O): where a mapped key path
goes with and without a target, what ``KeyMap.torch_compile()`` matches, a value left out, and the errors
for a map that sends two saved values to one place or puts one inside another."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest

from tierckpt import KeyMap, StateError
from tierckpt.datapath.keymap import dotted, leaves, remap

COMPILE = KeyMap.torch_compile()


def saved() -> dict[str, Any]:
    """A decoded tree: tensor references are ints (the values do not matter to the map)."""
    return {
        "model": OrderedDict([("_orig_mod.fc.weight", 0), ("_orig_mod.fc.bias", 1)]),
        "optim": {"state": {0: {"exp_avg": 2}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "step": 5,
        "empty": {},
    }


def test_leaves_are_values_reached_through_dicts() -> None:
    assert [dotted(p) for p, _ in leaves(saved())] == [
        "model._orig_mod.fc.weight", "model._orig_mod.fc.bias", "optim.state.0.exp_avg", "optim.param_groups",
        "step", "empty",
    ]  # fmt: skip


def test_without_a_target_a_renamed_path_keeps_the_nesting_the_map_left_unchanged() -> None:
    out, origins = remap(saved(), COMPILE)
    assert out["model"] == OrderedDict([("fc.weight", 0), ("fc.bias", 1)]) and type(out["model"]) is OrderedDict
    assert out["optim"] == saved()["optim"] and out["step"] == 5 and out["empty"] == {}
    assert origins[("model", "fc.weight")] == "model._orig_mod.fc.weight"
    assert list(out["optim"]["state"]) == [0]  # an int key the map does not change stays an int
    # a container renamed: the keys after it stay (the int one too), the renamed part is one key
    out, _ = remap({"bufs": {0: 7}, "a": {"b": {"c": 8}}}, KeyMap({"bufs.": "buffers.", "a.b.": "a.x.y."}))
    assert out == {"buffers": {0: 7}, "a": {"x.y": {"c": 8}}}


def test_with_a_target_a_mapped_path_goes_where_the_target_has_it() -> None:
    target = {"model": {"fc": {"weight": None, "bias": None}}, "optim": None, "step": 0, "empty": {}}
    out, _ = remap(saved(), COMPILE, target)
    assert out["model"] == {"fc": {"weight": 0, "bias": 1}}
    # a compiled target and a plain checkpoint match too (the map applies to both sides)
    plain = {"model": {"fc.weight": 0, "fc.bias": 1}}
    out, _ = remap(plain, COMPILE, {"model": {"_orig_mod.fc.weight": None, "_orig_mod.fc.bias": None}})
    assert out == {"model": {"_orig_mod.fc.weight": 0, "_orig_mod.fc.bias": 1}}
    # a map of one side renames the saved paths only
    out, _ = remap(plain, KeyMap(lambda p: p.replace("model.fc", "head")), {"head": {"weight": None}})
    assert out == {"head": {"weight": 0}, "head.bias": 1}


def test_a_value_mapped_to_none_is_left_out() -> None:
    out, origins = remap(saved(), KeyMap(lambda p: None if p.startswith("optim.") else p))
    assert list(out) == ["model", "step", "empty"] and ("optim", "state", 0, "exp_avg") not in origins


def test_a_map_that_sends_two_values_to_one_place_or_one_inside_another_is_refused() -> None:
    with pytest.raises(StateError, match=r"'model._orig_mod.fc.weight' and 'model.fc.weight' both map to "):
        remap({"model": {"_orig_mod.fc.weight": 0, "fc.weight": 1}}, COMPILE)
    with pytest.raises(StateError, match="inside state\\['step'\\], which holds a value"):
        remap({"step": 1, "a": {"w": 2}}, KeyMap({"a.w": "step.w"}))
    with pytest.raises(StateError, match="to state\\['a'\\], which holds other values"):
        remap({"a": {"b": 1}, "c": 2}, KeyMap({"c": "a"}))
    with pytest.raises(StateError, match=r"the key path of 2 of the target's values: state\['x.y'\] and state\['x'\]"):
        remap({"w": 1}, KeyMap({"w": "x.y"}), {"x.y": None, "x": {"y": None}})
    with pytest.raises(TypeError, match="not a str or None"):
        remap({"w": 1}, KeyMap(lambda p: 3))  # type: ignore[arg-type,return-value]
    with pytest.raises(StateError, match="an empty key"):
        remap({"a": {"b": 1}}, KeyMap({"a.b": "a."}))


def test_torch_compile_removes_the_prefix_wherever_a_key_starts_with_it() -> None:
    assert COMPILE.both_sides and not KeyMap({"a": "b"}).both_sides and KeyMap(COMPILE).both_sides
    assert COMPILE("_orig_mod.enc._orig_mod.x") == "enc.x" and COMPILE("m.my_orig_mod.x") == "m.my_orig_mod.x"
    assert remap([1, 2], COMPILE) == ([1, 2], {})  # a state that is not a dict: nothing to rename
