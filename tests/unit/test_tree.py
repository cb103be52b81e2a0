from __future__ import annotations

import math
from collections import OrderedDict

import msgpack
import pytest
import torch

from tierckpt.errors import CorruptCheckpointError, StateError
from tierckpt.format.tree import Int, Opaque, Ref, decode_tree, flatten, unflatten


def round_trip(state: object, allow_pickle: bool = False, version: int = 3) -> object:
    flat = flatten(state, allow_pickle=allow_pickle, version=version)
    return unflatten(
        flat.tree, lambda i: flat.tensors[i].tensor, len(flat.tensors), allow_pickle=allow_pickle, version=version
    )


@pytest.mark.parametrize("version", [1, 2, 3])
def test_plain_values_keep_their_types(version: int) -> None:
    state = {
        "none": None, "t": True, "f": False, "i": -3, "big": 2**80, "neg": -(2**70), "u64": 2**64 - 1,
        "x": 1.5, "nan": math.nan, "s": "héllo", "b": b"\x00\xff", "l": [1, [2, (3, 4)]], "tup": (1, "a", (None,)),
        "empty": {}, "int_keys": {0: "a", 7: {"b": 1}}, "od": OrderedDict([("z", 1), ("a", 2)]),
        "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
        "ints": [0, 1023, 1024, -1, 2**63 - 1, -(2**63)],
    }  # fmt: skip
    back = round_trip(state, version=version)
    assert isinstance(back, dict)
    for k, v in state.items():
        if k == "nan":
            assert math.isnan(back[k])
            continue
        assert back[k] == v and type(back[k]) is type(v), k
    assert type(back["l"][1][1]) is tuple
    assert list(back["od"]) == ["z", "a"]


def test_tensors_are_referenced_and_shared_ones_deduplicated() -> None:
    w = torch.randn(3, 4)
    state = {"a": w, "b": [w, w.t()], "c": (w[1],)}
    flat = flatten(state)
    assert [r.path for r in flat.tensors] == ["state['a']", "state['b'][1]", "state['c'][0]"]
    back = round_trip(state)
    assert back["a"] is back["b"][0]  # tied weights stay tied


def test_flatten_gives_each_stored_tensor_its_byte_size() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state = {"a": base, "b": base.t()[1:3], "e": torch.empty(0, 5), "z": torch.tensor(7, dtype=torch.int8),
             "c": torch.ones(3, dtype=torch.complex64).conj(), "again": base, "g": torch.ones(2, requires_grad=True)}  # fmt: skip
    flat = flatten(state)
    assert len(flat.nbytes) == len(flat.tensors) == 6  # "again" is stored once
    assert list(flat.nbytes) == [r.tensor.nbytes for r in flat.tensors] == [192, 64, 0, 1, 24, 8]


def test_refusals_name_the_key_path() -> None:
    state = {"optim": {"param_groups": [{"lr": 1.0, "betas_fn": lambda: 0}]}}
    with pytest.raises(StateError, match=r"state\['optim'\]\['param_groups'\]\[0\]\['betas_fn'\]"):
        flatten(state)
    with pytest.raises(StateError, match=r"state\['s'\]: cannot save a value of type builtins.set"):
        flatten({"s": {1, 2}})
    with pytest.raises(StateError, match=r"state\['d'\]: .*tuple key"):
        flatten({"d": {(1, 2): 3}})
    with pytest.raises(StateError, match="sparse"):
        flatten({"sp": torch.eye(3).to_sparse()})


class Custom:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.x == self.x


def test_pickle_is_opt_in_on_both_sides() -> None:
    state = {"obj": Custom(3), "keys": {(1, 2): "x"}}
    flat = flatten(state, allow_pickle=True)
    assert flat.has_pickle
    with pytest.raises(StateError, match="allow_pickle"):
        unflatten(flat.tree, lambda i: flat.tensors[i].tensor, 0)
    assert round_trip(state, allow_pickle=True) == state


def test_same_state_same_tree() -> None:
    def make() -> dict:
        return {"a": torch.ones(2), "b": {"c": [1, 2.5, "x"], "d": (None, b"z")}}

    assert flatten(make()).tree == flatten(make()).tree


def test_malformed_tree_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError):
        unflatten(b"\xc1garbage", lambda i: torch.zeros(1), 0)
    flat = flatten({"a": torch.zeros(1)})
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        unflatten(flat.tree, lambda i: torch.zeros(1), 0)


def test_tensors_at_the_same_address_are_told_apart_by_what_they_are() -> None:
    """Deduplication keys on the first element's address, then on the full identity: views of the
    same bytes with another shape, dtype or conjugate bit stay separate tensors; the same tensor (a
    conjugate one included) is stored once."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    z = torch.complex(torch.ones(3), torch.arange(3.0))
    zc = z.conj()
    state = {
        "w": w, "rows2": w[:2], "flat": w.view(-1), "bits": w.view(torch.int32), "again": w,
        "z": z, "zc": zc, "zc2": zc, "grad": torch.ones(2, requires_grad=True),
    }  # fmt: skip
    flat = flatten(state)
    assert [r.path for r in flat.tensors] == [
        "state['w']", "state['rows2']", "state['flat']", "state['bits']", "state['z']", "state['zc']", "state['grad']",
    ]  # fmt: skip
    back = round_trip(state)
    assert back["again"] is back["w"] and back["zc2"] is back["zc"]
    for k in ("w", "rows2", "flat", "bits", "z", "zc"):
        assert torch.equal(back[k], state[k].resolve_conj()), k
        assert back[k].dtype == state[k].dtype and back[k].shape == state[k].shape, k
    assert not back["zc"].is_conj() and not back["grad"].requires_grad


def test_version_3_references_tensors_with_plain_ints() -> None:
    """Format 3: a tensor reference is a plain msgpack int and an int value is ext 5, so decoding calls
    no Python per tensor; dict keys stay plain ints; version 2 keeps ext 2 and plain ints."""
    w = torch.ones(2)
    state = {"w": w, "again": w, "n": 7, 3: "int key", "size": torch.Size([4])}
    assert msgpack.unpackb(flatten(state).tree, strict_map_key=False) == {
        "w": 0, "again": 0, "n": msgpack.ExtType(5, b"7"), 3: "int key", "size": msgpack.ExtType(8, msgpack.packb([4]))
    }  # fmt: skip
    v2 = msgpack.unpackb(flatten(state, version=2).tree, strict_map_key=False)
    assert v2["w"] == msgpack.ExtType(2, b"\x00\x00\x00\x00") and v2["n"] == 7
    value, ref = decode_tree(flatten(state).tree, 1, 3)
    assert ref is int and type(value["w"]) is int and type(value["n"]) is Int and value["n"] == 7
    assert type(value["size"]) is torch.Size and type(value["size"][0]) is int  # a leaf, not references
    value, ref = decode_tree(flatten(state, version=2).tree, 1, 2)
    assert ref is Ref and type(value["w"]) is Ref and type(value["n"]) is int


@pytest.mark.parametrize("tree", [{"a": 1}, {"a": -1}, {"a": (0, 5)}, [0, {"x": 2**64 - 1}]])
def test_version_3_references_out_of_range_are_corrupt(tree: object) -> None:
    with pytest.raises(CorruptCheckpointError, match="tensor reference -?[0-9]+ out of range"):
        unflatten(msgpack.packb(tree), lambda i: torch.zeros(1), 1)


def test_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version 4"):
        flatten({}, version=4)


def test_version_3_refuses_ext_2_references() -> None:
    tree = msgpack.packb({"a": msgpack.ExtType(2, b"\x00\x00\x00\x00")})
    assert unflatten(tree, lambda i: torch.zeros(1), 1, version=2)["a"].shape == (1,)
    with pytest.raises(CorruptCheckpointError, match="ext-2 tensor reference in a version-3 tree"):
        unflatten(tree, lambda i: torch.zeros(1), 1)


@pytest.mark.parametrize("version", [2, 3])
def test_pickled_values_are_leaves(version: int) -> None:
    """An unpickled dict's ints are its values, never tensor references (in version 3 a plain int
    in the tree is one)."""
    state = {"w": torch.ones(3), "odd": {(1, 2): 0, "n": [0, 0]}}
    flat = flatten(state, allow_pickle=True, version=version)
    value, _ = decode_tree(flat.tree, 1, version, allow_pickle=True)
    assert type(value["odd"]) is Opaque
    assert round_trip(state, allow_pickle=True, version=version)["odd"] == {(1, 2): 0, "n": [0, 0]}
