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
    with pytest.raises(ValueError, match="version 6"):
        flatten({}, version=6)


def test_version_3_refuses_ext_2_references() -> None:
    tree = msgpack.packb({"a": msgpack.ExtType(2, b"\x00\x00\x00\x00")})
    assert unflatten(tree, lambda i: torch.zeros(1), 1, version=2)["a"].shape == (1,)
    with pytest.raises(CorruptCheckpointError, match="ext-2 tensor reference in a version-5 tree"):
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


@pytest.mark.parametrize("version", [2, 3])
def test_int_keys_outside_64_bits_are_refused_or_pickled(version: int) -> None:
    """msgpack stores a dict key in 64 bits: a bigger int key is refused naming the dict (not a raw
    OverflowError), or pickled with the dict, like any other key it cannot store."""
    with pytest.raises(StateError, match=r"^state\['a'\]: cannot save a dict with an int key 1180591620717411303424 "):
        flatten({"a": {2**70: 1}}, version=version)
    with pytest.raises(StateError, match=r"^state: cannot save a dict with an int key -18446744073709551616"):
        flatten({-(2**64): 1}, version=version)
    with pytest.raises(StateError, match=r"^state\['o'\]: "):
        flatten({"o": OrderedDict([(2**64, 1)])}, version=version)
    state = {"a": {2**70: 1, "x": torch.ones(2)}, "edge": {2**64 - 1: "u64", -(2**63): "i64"}}
    flat = flatten(state, allow_pickle=True, version=version)
    value, _ = decode_tree(flat.tree, 1, version, allow_pickle=True, unpickle=False)
    assert type(value["a"]) is Opaque and type(value["edge"]) is dict  # in-range keys stay plain
    back = round_trip(state, allow_pickle=True, version=version)
    assert back["a"][2**70] == 1 and torch.equal(back["a"]["x"], state["a"]["x"]) and back["edge"] == state["edge"]


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_str_that_is_not_utf8_is_refused_naming_its_path(allow_pickle: bool) -> None:
    """A lone surrogate cannot be encoded: refused (pickle or not) naming where, not a raw UnicodeEncodeError."""
    cases = [
        ({"a": ["ok", "\ud800"]}, r"state\['a'\]\[1\]: cannot save a str that is not valid UTF-8"),
        ({"a": {"b": {"\udfff": 1}}}, r"state\['a'\]\['b'\]: cannot save the dict key '\\udfff'"),
        ({"t": (1, ("x\ud800",))}, r"state\['t'\]\[1\]\[0\]: cannot save a str"),
        ({"o": OrderedDict([("\ud800", 1)])}, r"state\['o'\]: cannot save the dict key"),
        ({"o": OrderedDict([("k", [b"", "\ud800"])])}, r"state\['o'\]\['k'\]\[1\]: cannot save a str"),
        ("\ud800", r"state: cannot save a str"),
    ]
    for state, match in cases:
        with pytest.raises(StateError, match="^" + match):
            flatten(state, allow_pickle=allow_pickle)
    assert round_trip({"s": "\U0001f600 ok"}) == {"s": "\U0001f600 ok"}  # a surrogate pair's character is fine


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_cycles_and_deep_nesting_are_refused_naming_a_path(allow_pickle: bool) -> None:
    """A state that holds itself, or is nested past the stack, is refused naming where (not a raw
    RecursionError); a cycle is named where a container refers to one of its ancestors."""
    loop: list = []
    loop.append(loop)
    with pytest.raises(StateError, match=r"^state\['l'\]\[0\]: refers to a container that holds it \(a cycle\)"):
        flatten({"a": 1, "l": loop}, allow_pickle=allow_pickle)
    d: dict = {"n": 1}
    d["sub"] = [0, (d,)]
    with pytest.raises(StateError, match=r"^state\['x'\]\['sub'\]\[1\]\[0\]: refers to a container"):
        flatten({"x": d}, allow_pickle=allow_pickle)
    deep = node = {}  # type: ignore[var-annotated]
    for _ in range(5000):
        node["k"] = node = {}
    with pytest.raises(StateError, match=r"^state\['d'\]\['k'\]\['k'\].*: the state is nested too deep to save"):
        flatten({"d": deep}, allow_pickle=allow_pickle)
    shared = [1]
    assert round_trip({"a": shared, "b": [shared, shared]}) == {"a": [1], "b": [[1], [1]]}  # shared is no cycle


def test_nesting_is_bounded_so_that_what_saves_restores() -> None:
    """Up to MAX_NESTING containers deep a state round-trips; deeper is refused when saved (it used to
    save from about 490 to 511 levels, then fail to restore with a RecursionError)."""
    from tierckpt.format.tree import MAX_NESTING

    def nested(levels: int) -> dict:
        top = node = {}  # type: ignore[var-annotated]
        for _ in range(levels - 1):
            node["k"] = node = {}
        node["w"] = torch.arange(3.0)
        return top

    back = round_trip({"d": nested(MAX_NESTING - 1)})
    node = back["d"]
    while "k" in node:
        node = node["k"]
    assert torch.equal(node["w"], torch.arange(3.0))
    for levels in (MAX_NESTING, 500):
        with pytest.raises(StateError, match=rf"nested too deep to save \(more than {MAX_NESTING} levels"):
            flatten({"d": nested(levels)})


def test_distinct_zero_size_tensors_stay_distinct() -> None:
    """Empty tensors share address 0, so they are deduplicated by object only: two distinct ones stay
    two, the same one twice stays one, and an empty view is never merged with another."""
    e = torch.empty(0)
    w = torch.arange(6.0)
    state = {"a": torch.empty(0), "b": torch.empty(0), "e": e, "e2": e, "w": w, "v1": w[:0], "v2": w[:0], "w2": w}
    flat = flatten(state)
    assert [r.path for r in flat.tensors] == [
        "state['a']", "state['b']", "state['e']", "state['w']", "state['v1']", "state['v2']",
    ]  # fmt: skip
    back = round_trip(state)
    assert back["a"] is not back["b"] and back["a"] is not back["e"]
    assert back["e"] is back["e2"] and back["w"] is back["w2"] and back["v1"] is not back["v2"]
    assert back["a"].shape == (0,) and torch.equal(back["w"], w)


@pytest.mark.filterwarnings("ignore:.*(quantized|Sparse CSR).*:UserWarning")
def test_tensor_refusals_say_what_is_wrong() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    cases = [
        (torch.eye(3).to_sparse(), r"a sparse tensor \(layout torch.sparse_coo"),
        (torch.eye(3).to_sparse_csr(), r"a sparse tensor \(layout torch.sparse_csr"),
        (quantized, r"a quantized tensor \(torch.qint8"),
        (torch.empty(2, device="meta"), r"a meta tensor"),
        (nested, r"a nested tensor"),
    ]
    for t, match in cases:
        for allow_pickle in (False, True):
            with pytest.raises(StateError, match=r"^state\['m'\]\[0\]: cannot save " + match):
                flatten({"m": [t]}, allow_pickle=allow_pickle)


def test_a_version_3_tree_read_as_version_2_is_refused() -> None:
    """Versions 1-2 reference every row with ext 2 and write ext 5 only outside 64 bits: a version-3 tree
    (plain-int references, every int ext 5) read with a flipped version never decodes as a state."""
    state = {"w": torch.zeros(2), "n": 3}
    with pytest.raises(CorruptCheckpointError, match="tensor 0 of the table is not referenced"):
        decode_tree(flatten({"w": torch.zeros(2)}).tree, 1, 2)
    with pytest.raises(CorruptCheckpointError, match="ext-5 int 3 in a version-2 tree"):
        decode_tree(flatten(state).tree, 1, 2)
    assert decode_tree(flatten({"big": 1 << 70}, version=2).tree, 0, 2)[0] == {"big": 1 << 70}
    # a dict pickled whole may orphan the tensors met in it first (writers of every version did so)
    orphan = flatten({"d": {"t": torch.zeros(1), (1,): 2}}, allow_pickle=True, version=2)
    assert len(orphan.tensors) == 1
    assert decode_tree(orphan.tree, 1, 2, allow_pickle=True)[0]["d"].value[(1,)] == 2


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"a": msgpack.Timestamp(3, 0)}, "timestamp"),
        ([msgpack.ExtType(1, msgpack.packb([msgpack.Timestamp(3, 0)]))], "timestamp"),
        ({msgpack.ExtType(1, msgpack.packb([1])): 0}, "in a map key"),
        ([msgpack.ExtType(8, msgpack.packb([1, "x"]))], "torch.Size holds"),
        ([msgpack.ExtType(8, msgpack.packb(5))], "does not hold an array"),
        ([msgpack.ExtType(4, msgpack.packb([["a", 1], ["a", 2]]))], "repeats a key"),
        ([msgpack.ExtType(4, msgpack.packb([[1.5, 1]]))], "neither a str nor an int"),
        ([msgpack.ExtType(4, msgpack.packb([["a"]]))], "pairs"),
        ([msgpack.ExtType(6, b"_inductor")], "unknown dtype"),
        ([msgpack.ExtType(9, b"")], "unknown ext type 9"),
    ],
)
def test_malformed_ext_values_are_refused(tree: object, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_tree(msgpack.packb(tree), 0, 4)


def test_nesting_up_to_the_limit_decodes_in_a_thread_and_deeper_is_refused() -> None:
    import threading

    from tierckpt.format.tree import MAX_NESTING

    def nested(depth: int) -> object:
        v: object = torch.Size([2, 3])
        for i in range(depth):
            v = (v, i) if i % 3 == 0 else OrderedDict(k=v) if i % 3 == 1 else [v]
        return v

    got: list[object] = []
    ok = flatten(nested(MAX_NESTING))
    t = threading.Thread(target=lambda: got.append(unflatten(ok.tree, lambda i: torch.zeros(1), 0)))
    t.start()
    t.join()
    assert got == [nested(MAX_NESTING)]
    with pytest.raises(CorruptCheckpointError, match=f"nested deeper than {MAX_NESTING} containers"):
        decode_tree(b"\x91" * MAX_NESTING + b"\x90", 0, 4)
    assert decode_tree(b"\x91" * (MAX_NESTING - 1) + b"\x90", 0, 4)[0] is not None
