"""The pure parts of export and import: names of a state's leaves, selection, key maps, and the streamed
safetensors writer's header (checked against the safetensors package's own reader)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from tierckpt.errors import StateError
from tierckpt.format.manifest import FORMAT_VERSION
from tierckpt.format.tree import decode_tree, flatten
from tierckpt.interop import writers
from tierckpt.interop.names import KeyMap, Leaf, leaves, select
from tierckpt.interop.writers import Item, SafetensorsWriter, from_st_dtype, st_dtype, st_shape


def decoded(state: object) -> list[Leaf]:
    flat = flatten(state)
    tree, ref = decode_tree(flat.tree, len(flat.tensors), FORMAT_VERSION)
    return leaves(tree, ref, len(flat.tensors))


def test_leaves_are_named_by_key_paths() -> None:
    w = torch.zeros(2)
    got = decoded({"model": {"layers.0.weight": w, "tied": w}, "opt": [{"lr": 0.1, "betas": (0.9, 0.99)}], "e": {}})
    assert [(x.name, x.row, x.value) for x in got] == [
        ("model.layers.0.weight", 0, None), ("model.tied", 0, None), ("opt.0.lr", None, 0.1),
        ("opt.0.betas.0", None, 0.9), ("opt.0.betas.1", None, 0.99), ("e", None, {}),
    ]  # fmt: skip
    assert type(decoded({"n": 7})[0].value) is int  # a tree's Int as the int it is


def test_key_maps() -> None:
    m = KeyMap({"model.": "", "model.head.": "lm_head.", "": "x."})
    assert [m(n) for n in ("model.a", "model.head.w", "b")] == ["a", "lm_head.w", "x.b"]  # longest prefix first
    assert KeyMap(None)("a") == "a" and KeyMap(KeyMap({"a": "b"}))("ac") == "bc"
    assert KeyMap(str.upper)("a") == "A"
    with pytest.raises(TypeError, match="prefixes and replacements must be str"):
        KeyMap({"a": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="expected a mapping of prefixes or a function"):
        KeyMap(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapped to 3, not a str or None"):
        KeyMap(lambda n: 3)("a")  # type: ignore[arg-type,return-value]


def test_select() -> None:
    found = decoded({"model": {"w": torch.zeros(1)}, "model2": {"w": torch.zeros(1)}, "step": 1})
    assert [x.name for x in select(found, ["model"])] == ["model.w"]  # a dotted prefix, not a string prefix
    assert [x.name for x in select(found, ["model.w", "step"])] == ["model.w", "step"]
    assert [x.name for x in select(found, (), lambda n: None if n == "step" else n)] == ["model.w", "model2.w"]
    with pytest.raises(
        StateError, match=r"state\['model'\]\['w'\] and state\['model2'\]\['w'\] would both be named 'w'"
    ):
        select(found, (), lambda n: n.rpartition(".")[2])
    with pytest.raises(StateError, match=r"state\['step'\]: renamed to an empty name"):
        select(found, ["step"], {"step": ""})
    with pytest.raises(StateError, match="the state is a single value"):
        select(decoded(torch.zeros(1)))


def test_safetensors_dtypes() -> None:
    assert st_dtype(torch.bfloat16, "w") == "BF16" and st_dtype(torch.float8_e4m3fn, "w") == "F8_E4M3"
    with pytest.raises(StateError, match=r"^w: dtype complex128 has no safetensors type \(safetensors holds bool, "):
        st_dtype(torch.complex128, "w")
    assert st_shape("F4", (3, 4), "w") == [3, 8] and st_shape("F32", (), "w") == []
    with pytest.raises(StateError, match="a 0-d F4 tensor has no safetensors shape"):
        st_shape("F4", (), "w")
    assert from_st_dtype("F4", [3, 8], "w")[1] == (3, 4)
    with pytest.raises(StateError, match="safetensors dtype F99 has no torch dtype"):
        from_st_dtype("F99", [1], "w")


def test_the_header_is_written_first_and_the_bytes_in_any_order(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    a, b, c = torch.arange(3, dtype=torch.int8), torch.randn(2, 2, dtype=torch.float64), torch.arange(5.0)
    items = [Item(("a",), a.dtype, (3,)), Item(("b", "b2"), b.dtype, (2, 2)), Item(("c",), c.dtype, (5,))]
    w = SafetensorsWriter(tmp_path / "x.safetensors", items, {"format": "pt"})
    w.put(2, 8, c[2:])  # pieces in any order
    w.put(1, 0, b)
    w.put(0, 0, a)
    with pytest.raises(AssertionError, match=r"tensors not written whole: \['c'\]"):
        w.close()
    w = SafetensorsWriter(tmp_path / "y.safetensors", items, {"format": "pt"})
    for i, t in enumerate((a, b, c)):
        w.put(i, 0, t)
    w.close()
    raw = (tmp_path / "y.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and [k for k in header if k != "__metadata__"] == ["b", "b2", "c", "a"]  # largest items first
    got = st.load_file(str(tmp_path / "y.safetensors"))
    assert torch.equal(got["a"], a) and torch.equal(got["b2"], b) and torch.equal(got["c"], c)
    with pytest.raises(FileExistsError):
        SafetensorsWriter(tmp_path / "y.safetensors", items, {})


def test_a_header_over_the_readers_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "MAX_HEADER_BYTES", 100)
    items = [Item((f"tensor.{i}",), torch.float32, (1,)) for i in range(10)]
    with pytest.raises(StateError, match=r"x.safetensors: a header of \d+ bytes .* give a smaller max shard size"):
        SafetensorsWriter(tmp_path / "x.safetensors", items, {})
    assert not (tmp_path / "x.safetensors").exists()
