"""``tierckpt.load_safetensors``: a safetensors model on disk (one file; a directory of shards with an index,
as Hugging Face writes them) loaded into fresh tensors or into a model's own, with key maps, tied
weights, strictness, casts, and an export read back into the state it came from."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy, StateError, export, load_safetensors

st = pytest.importorskip("safetensors.torch")


class Tiny(torch.nn.Module):
    """A language model's shape: embeddings, a layer, a head tied to the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.lm_head = torch.nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.embed.weight


def hf_dir(tmp: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """``tensors`` as Hugging Face writes a sharded checkpoint: shard files and an index."""
    d = tmp / "hf"
    d.mkdir()
    names = sorted(tensors)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map = {}
    for k, f in enumerate(files):
        part = {n: tensors[n].contiguous() for n in names[k::shards]}
        st.save_file(part, str(d / f), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, f)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text("{}")
    return d


def source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed.weight": torch.randn(11, 4, generator=g),
        "model.layers.0.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.bias": torch.randn(4, generator=g),
    }


def test_a_sharded_directory_into_a_model_with_a_prefix_map_and_tied_weights(tmp_path: Path) -> None:
    d = hf_dir(tmp_path, source())
    model = Tiny()
    sd = model.state_dict()
    assert load_safetensors(d, into=sd, key_map={"model.": ""}) is sd
    want = source()
    assert torch.equal(model.embed.weight, want["model.embed.weight"])
    assert torch.equal(model.lm_head.weight, want["model.embed.weight"])  # tied: one name in the files is enough
    assert torch.equal(model.layers[0].bias, want["model.layers.0.bias"])
    state = {"model": Tiny().state_dict()}  # the TrainState shape: names start with "model." as in the files
    load_safetensors(d, into=state)
    assert torch.equal(state["model"]["layers.0.weight"], want["model.layers.0.weight"])


def test_without_a_target_and_without_an_index(tmp_path: Path) -> None:
    d = tmp_path / "plain"
    d.mkdir()
    src = source()
    st.save_file({k: v for k, v in src.items() if "embed" in k}, str(d / "a.safetensors"))
    st.save_file({k: v for k, v in src.items() if "embed" not in k}, str(d / "b.safetensors"))
    got = load_safetensors(d, key_map=lambda n: None if n.endswith("bias") else n.removeprefix("model."))
    assert sorted(got) == ["embed.weight", "layers.0.weight"]
    assert torch.equal(got["embed.weight"], src["model.embed.weight"])
    assert sorted(load_safetensors(d / "b.safetensors")) == ["model.layers.0.bias", "model.layers.0.weight"]


def test_mismatches_are_named_before_anything_changes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = hf_dir(tmp_path, source() | {"model.extra": torch.zeros(2)})
    target = {k.removeprefix("model."): torch.zeros_like(v) for k, v in source().items()} | {"other": torch.ones(3)}
    with pytest.raises(StateError, match=r"1 missing: other; 1 unexpected: extra \(a key_map renames"):
        load_safetensors(d, into=target, key_map={"model.": ""})
    assert all(not v.any() for k, v in target.items() if k != "other")  # nothing changed
    with caplog.at_level(logging.WARNING):
        load_safetensors(d, into=target, key_map={"model.": ""}, strict=False)
    assert "1 left as they are: other; 1 ignored: extra" in caplog.text
    assert torch.equal(target["embed.weight"], source()["model.embed.weight"]) and torch.equal(
        target["other"], torch.ones(3)
    )
    bad = {"embed.weight": torch.zeros(11, 5), "layers.0.weight": torch.zeros(4, 4, dtype=torch.float64)}
    bad |= {"layers.0.bias": torch.zeros(4)}
    with pytest.raises(
        StateError, match=r"embed.weight: shape \(11, 4\) in model-0000\d-of-00002.safetensors, \(11, 5\)"
    ):
        load_safetensors(d, into=bad, key_map={"model.": ""}, strict=False)
    with pytest.raises(
        StateError, match=r"layers.0.weight: dtype torch.float32 in .*torch.float64 in the state \(cast=True"
    ):
        load_safetensors(d, into=bad | {"embed.weight": torch.zeros(11, 4)}, key_map={"model.": ""}, strict=False)
    cast = bad | {"embed.weight": torch.zeros(11, 4)}
    load_safetensors(d, into=cast, key_map={"model.": ""}, strict=False, cast=True)
    assert torch.equal(cast["layers.0.weight"], source()["model.layers.0.weight"].double())


def test_what_a_directory_holds(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_safetensors(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file"):
        load_safetensors(tmp_path / "empty")
    d = hf_dir(tmp_path, source())
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"names files that are not in .*model-00002-of-00002"):
        load_safetensors(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../../etc/passwd"}}')
    with pytest.raises(FileNotFoundError, match=r"names files that are not in .*etc/passwd"):
        load_safetensors(d)
    (d / "model.safetensors.index.json").write_text("[1]")
    with pytest.raises(StateError, match="not a safetensors index"):
        load_safetensors(d)


def test_an_export_loads_back_into_the_state_it_came_from(tmp_path: Path) -> None:
    w = torch.randn(5, 3)
    state = {"model": {"w": w, "tied": w, "b": torch.arange(4, dtype=torch.bfloat16)}, "step": 3}
    with Hierarchy.from_config({"tiers": [{"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")}]}) as h:
        h.save(state, step=1, blocking=True)
        export(h, tmp_path / "out", max_shard_size=40)  # several files with an index
    target: dict[str, Any] = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": 0}
    target["model"]["tied"] = target["model"]["w"]
    load_safetensors(tmp_path / "out", into=target)
    assert torch.equal(target["model"]["w"], w) and torch.equal(target["model"]["b"], state["model"]["b"])


def test_the_missing_package_is_named_with_its_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'tierckpt\[safetensors\]'"):
        load_safetensors(tmp_path)
