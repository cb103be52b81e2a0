"""The key map of a restore (tierckpt.datapath.keymap), on plain trees (no I/O): where a mapped key path
goes with and without a target, what ``KeyMap.torch_compile()`` matches, and the errors for a map that
sends two saved values to one place, puts one inside another, or names a key path the checkpoint lacks."""

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
    out, _ = remap({"bufs": {0: 7}, "a": {"b": {"c": 8}}}, KeyMap.of({"bufs.0": "buffers.0", "a.b.c": "a.x.y.c"}))
    assert out == {"buffers": {0: 7}, "a": {"x.y": {"c": 8}}}


def test_with_a_target_a_mapped_path_goes_where_the_target_has_it() -> None:
    target = {"model": {"fc": {"weight": None, "bias": None}}, "optim": None, "step": 0, "empty": {}}
    out, _ = remap(saved(), COMPILE, target)
    assert out["model"] == {"fc": {"weight": 0, "bias": 1}}
    # a compiled target and a plain checkpoint match too (the map applies to both sides)
    plain = {"model": {"fc.weight": 0, "fc.bias": 1}}
    out, _ = remap(plain, COMPILE, {"model": {"_orig_mod.fc.weight": None, "_orig_mod.fc.bias": None}})
    assert out == {"model": {"_orig_mod.fc.weight": 0, "_orig_mod.fc.bias": 1}}
    # a plain map applies to the saved side only
    out, _ = remap(plain, KeyMap.of(lambda p: p.replace("model.fc", "head")), {"head": {"weight": None}})
    assert out == {"head": {"weight": 0}, "head.bias": 1}


def test_a_map_that_sends_two_values_to_one_place_or_one_inside_another_is_refused() -> None:
    with pytest.raises(StateError, match=r"'model._orig_mod.fc.weight' and 'model.fc.weight' both map to "):
        remap({"model": {"_orig_mod.fc.weight": 0, "fc.weight": 1}}, COMPILE)
    with pytest.raises(StateError, match="inside state\\['step'\\], which holds a value"):
        remap({"step": 1, "a": {"w": 2}}, KeyMap.of({"a.w": "step.w"}))
    with pytest.raises(StateError, match="to state\\['a'\\], which holds other values"):
        remap({"a": {"b": 1}, "c": 2}, KeyMap.of({"c": "a"}))
    with pytest.raises(StateError, match=r"\['model.fc.w'\] is not a key path of the checkpoint"):
        remap(saved(), KeyMap.of({"model.fc.w": "x"}))
    with pytest.raises(
        StateError, match=r"the key path of 2 of the target's values: state\['x.y'\] and state\['x'\]\['y'\]"
    ):  # two target paths with one dotted name
        remap({"w": 1}, KeyMap.of({"w": "x.y"}), {"x.y": None, "x": {"y": None}})
    with pytest.raises(StateError, match="not a key path"):
        remap({"w": 1}, KeyMap.of(lambda p: None))  # type: ignore[arg-type,return-value]
    with pytest.raises(StateError, match="an empty key"):
        remap({"a": {"b": 1}}, KeyMap.of({"a.b": "a."}))


def test_what_restore_takes_as_keys() -> None:
    assert KeyMap.of(COMPILE) is COMPILE
    assert KeyMap.of({"a": "b"}).rename("a") == "b" and KeyMap.of({"a": "b"}).rename("c") == "c"
    for bad in (3, {"a": 1}, {1: "a"}):
        with pytest.raises(TypeError, match="keys: "):
            KeyMap.of(bad)  # type: ignore[arg-type]
    assert (
        COMPILE.rename("_orig_mod.enc._orig_mod.x") == "enc.x"
        and COMPILE.rename("m.my_orig_mod.x") == "m.my_orig_mod.x"
    )
    with pytest.raises(ValueError, match="ending with '.'"):
        KeyMap.strip_prefix("_orig_mod")
    assert remap([1, 2], COMPILE) == ([1, 2], {})  # a state that is not a dict: nothing to rename
