"""``tierckpt.export`` and ``tierckpt export`` in one process: every dtype safetensors holds, bit for bit
through ``safetensors.torch.load_file``; torch files through ``torch.load(weights_only=True)``; names,
values, tied tensors, ``only`` and renames; several files with an index; compressed copies; the copy
chosen as a restore chooses it; and the errors (unknown step, a dtype safetensors lacks, an existing
output, a failed write), none of which leaves output behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt import CheckpointNotFoundError, CorruptCheckpointError, Hierarchy, StateError
from tierckpt.cli import main
from tierckpt.interop.exporting import export
from tierckpt.interop.output import OutputExistsError
from tierckpt.interop.writers import ST_DTYPES
from tierckpt.testing.tamper import blob_file

st = pytest.importorskip("safetensors.torch")


def config(tmp: Path, **ssd: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp / "ssd"), **ssd},
            {"name": "pfs", "kind": "pfs", "path": str(tmp / "pfs")},
        ],
        "policy": {"demote": {"pfs": {"every": 1}}},
    }


def save(cfg: dict[str, Any], *states: Any) -> None:
    with Hierarchy.from_config(cfg) as h:
        for step, s in enumerate(states, 1):
            h.save(s, step=step, blocking=True)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern possible (NaNs included): compare as bytes."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and as_bytes(a) == as_bytes(b)


def dtype_state() -> dict[str, Any]:
    shapes = [(3, 5), (7,), (), (0, 4), (2, 3, 4)]
    packed = getattr(torch, "float4_e2m1fn_x2", None)  # two values a byte: no 0-d safetensors shape
    return {
        "model": {
            str(dt).removeprefix("torch."): random_bytes((2, 3) if dt is packed else shapes[i % len(shapes)], dt, i)
            for i, dt in enumerate(ST_DTYPES)
        }
    }


def test_every_dtype_safetensors_holds_is_exported_bit_for_bit(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    state = dtype_state()
    state["model"]["bool"] = torch.tensor([True, False, True])  # bool: only 0 and 1 are values
    save(cfg, state)
    got = export(cfg, tmp_path / "out")
    assert (got.step, got.tier, got.files) == (1, "ssd", ("model.safetensors",))
    loaded = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(loaded) == sorted(f"model.{k}" for k in state["model"])
    for k, v in state["model"].items():
        assert same(loaded[f"model.{k}"], v), k
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt", "step": "1"}
    for name, entry in header.items():  # each tensor starts at a multiple of its item size
        if name != "__metadata__":
            assert entry["data_offsets"][0] % loaded[name].element_size() == 0, name


def test_a_dtype_safetensors_lacks_is_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    save(cfg, {"model": {"w": torch.zeros(2)}, "z": torch.zeros(3, dtype=torch.complex128)})
    with pytest.raises(StateError, match=r"^z: dtype complex128 has no safetensors type .*format='torch'"):
        export(cfg, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["pfs", "ssd"]  # no output, no scratch
    export(cfg, tmp_path / "out", only=["model"])  # left out: fine
    got = export(cfg, tmp_path / "out.pt", format="torch")  # torch.save holds it
    assert torch.load(tmp_path / "out.pt" / "pytorch_model.bin", weights_only=True)["z"].dtype == torch.complex128
    assert got.files == ("pytorch_model.bin",)


def train_state() -> dict[str, Any]:
    w = torch.randn(6, 4)
    return {
        "model": {"layers.0.weight": w, "layers.0.bias": torch.randn(6), "head.weight": w},  # tied
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "step": 7,
        "note": "hello",
        "blob": b"\x00\xff",
        "dt": torch.bfloat16,
        "empty": {},
    }


def test_names_values_and_tied_tensors(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    s = train_state()
    save(cfg, s)
    got = export(cfg, tmp_path / "out")
    assert got.files == ("model.safetensors", "values.json") and got.tensors == 4 and got.values == 8
    loaded = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(loaded) == ["model.head.weight", "model.layers.0.bias", "model.layers.0.weight", "optim.state.0.step"]
    assert torch.equal(loaded["model.head.weight"], s["model"]["layers.0.weight"])
    values = json.loads((tmp_path / "out" / "values.json").read_text())
    assert values == {
        "step": 1,
        "values": {
            "optim.param_groups.0.lr": 0.1, "optim.param_groups.0.betas.0": 0.9, "optim.param_groups.0.betas.1": 0.99,
            "step": 7, "note": "hello", "blob": {"base64": "AP8="}, "dt": "torch.bfloat16", "empty": {},
        },
    }  # fmt: skip
    pt = export(cfg, tmp_path / "pt", format="torch")
    assert pt.files == ("pytorch_model.bin",)
    back = torch.load(tmp_path / "pt" / "pytorch_model.bin", weights_only=True)
    assert back["model.head.weight"] is back["model.layers.0.weight"]  # still tied
    assert back["optim.param_groups.0.betas.1"] == 0.99 and back["blob"] == b"\x00\xff" and back["dt"] == torch.bfloat16
    assert torch.equal(back["model.layers.0.bias"], s["model"]["layers.0.bias"])


def test_only_and_renames(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    save(cfg, train_state())
    got = export(cfg, tmp_path / "out", only=["model"], key_map={"model.": "", "model.head.": "lm_head."})
    assert got.files == ("model.safetensors",) and got.values == 0
    assert sorted(st.load_file(str(tmp_path / "out" / "model.safetensors"))) == [
        "layers.0.bias", "layers.0.weight", "lm_head.weight",
    ]  # fmt: skip
    got = export(cfg, tmp_path / "out2", key_map=lambda n: None if n.startswith("optim") else n.upper())
    assert "STEP" in json.loads((tmp_path / "out2" / "values.json").read_text())["values"]
    both = r"state\['model'\]\['layers.0.weight'\] and state\['model'\]\['layers.0.bias'\] would both be named 'same'"
    with pytest.raises(StateError, match=both):
        export(cfg, tmp_path / "out3", only=["model"], key_map=lambda n: "same")
    with pytest.raises(StateError, match=r"nothing under 'opt' \(the state's top-level keys"):
        export(cfg, tmp_path / "out3", only=["opt"])


def test_several_files_with_an_index(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    s = {"model": {f"l{i}": torch.randn(64, 16) for i in range(5)}}  # 4 KiB each
    save(cfg, s)
    got = export(cfg, tmp_path / "out", max_shard_size="9KiB")
    names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert got.files == (*names, "model.safetensors.index.json")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 5 * 4096}
    assert index["weight_map"] == {f"model.l{i}": names[i // 2] for i in range(5)}
    for name in names:
        for k, v in st.load_file(str(tmp_path / "out" / name)).items():
            assert index["weight_map"][k] == name and torch.equal(v, s["model"][k.removeprefix("model.")])
    pt = export(cfg, tmp_path / "pt", format="torch", max_shard_size=4096)
    assert len(pt.files) == 6 and pt.files[-1] == "pytorch_model.bin.index.json"
    back = {}
    for name in pt.files[:-1]:
        back |= torch.load(tmp_path / "pt" / name, weights_only=True)
    assert all(torch.equal(back[f"model.{k}"], v) for k, v in s["model"].items())


def test_compressed_copies_export(tmp_path: Path) -> None:
    cfg = config(tmp_path, compress="zstd:3")
    s = {"model": {"zeros": torch.zeros(300_000), "ramp": torch.arange(100_000, dtype=torch.bfloat16)}}
    save(cfg, s)
    rank_dir = tmp_path / "ssd" / "step-000000000001" / "rank-00000"
    stored = sum(f.stat().st_size for f in rank_dir.iterdir() if f.name != "manifest")
    assert stored < 100_000  # it is compressed: the export reads its frames
    export(cfg, tmp_path / "out")
    loaded = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(loaded["model.zeros"], s["model"]["zeros"]) and torch.equal(
        loaded["model.ramp"], s["model"]["ramp"]
    )


def damage(tier_dir: Path, step: int) -> None:
    f, off = blob_file(tier_dir / f"step-{step:012d}" / "rank-00000")
    data = bytearray(f.read_bytes())
    data[off + 10] ^= 0xFF
    f.write_bytes(bytes(data))


def test_a_damaged_copy_falls_back_and_a_step_damaged_everywhere_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path)
    s1, s2 = {"w": torch.randn(1000)}, {"w": torch.randn(1000)}
    save(cfg, s1, s2)
    damage(tmp_path / "ssd", 2)
    got = export(cfg, tmp_path / "a")
    assert (got.step, got.tier) == (2, "pfs")
    assert torch.equal(st.load_file(str(tmp_path / "a" / "model.safetensors"))["w"], s2["w"])
    damage(tmp_path / "pfs", 2)
    got = export(cfg, tmp_path / "b")  # the newest good step
    assert (got.step, got.tier) == (1, "ssd")
    assert torch.equal(st.load_file(str(tmp_path / "b" / "model.safetensors"))["w"], s1["w"])
    assert "step 2 is unusable on every tier" in caplog.text
    with pytest.raises(CorruptCheckpointError, match="step 2 is unusable on every tier that holds it"):
        export(cfg, tmp_path / "c", step=2)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "pfs", "ssd"]  # the failed attempts left nothing


def test_unknown_step_and_an_existing_output(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    save(cfg)  # the tiers' directories, no step
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        export(cfg, tmp_path / "out")
    save(cfg, {"w": torch.ones(3)})
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 is not committed \(committed steps: \[1\]\)"):
        export(cfg, tmp_path / "out", step=5)
    (tmp_path / "out").mkdir()
    export(cfg, tmp_path / "out")  # an empty directory is fine
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(OutputExistsError, match="exists and is a non-empty directory"):
        export(cfg, tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is a file"):
        export(cfg, tmp_path / "file")
    export(cfg, tmp_path / "out", force=True, format="torch")  # replaced whole
    assert sorted(os.listdir(tmp_path / "out")) == ["pytorch_model.bin"]
    assert sorted(os.listdir(tmp_path)) == ["file", "out", "pfs", "ssd"]


def test_a_failed_write_is_raised_as_it_is_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error writing the output is not a damaged copy: no other tier is tried, the OSError is raised."""
    from tierckpt.interop import writers

    cfg = config(tmp_path)
    save(cfg, {"w": torch.ones(3)})
    calls = []

    def full(self: Any, i: int, offset: int, piece: torch.Tensor) -> None:
        calls.append(i)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writers.SafetensorsWriter, "put", full)
    with pytest.raises(OSError, match="No space left on device") as e:
        export(cfg, tmp_path / "out")
    assert type(e.value) is OSError and calls == [0]  # one attempt
    assert sorted(os.listdir(tmp_path)) == ["pfs", "ssd"]


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "h.yaml"
    path.write_text(json.dumps(config(tmp_path)))  # JSON is YAML
    save(config(tmp_path), {"model": {"w": torch.ones(3)}, "step": 1}, {"model": {"w": torch.full((3,), 2.0)}})
    assert main(["export", str(path), "--out", str(tmp_path / "out"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "step": 2, "tier": "ssd", "path": str(tmp_path / "out"), "files": ["model.safetensors"],
        "tensors": 1, "tensor_bytes": 12, "values": 0,
    }  # fmt: skip
    argv = ["export", str(path), "--step", "1", "--out", str(tmp_path / "o1"), "--only", "model", "--rename", "model.="]
    assert main(argv) == 0
    assert "exported step 1 from tier 'ssd'" in capsys.readouterr().out
    assert torch.equal(st.load_file(str(tmp_path / "o1" / "model.safetensors"))["w"], torch.ones(3))
    assert main(["export", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "exists and is a non-empty directory" in capsys.readouterr().err
    assert main(["export", str(path), "--step", "9", "--out", str(tmp_path / "o9")]) == 2
    assert "step 9 is not committed" in capsys.readouterr().err
    assert main(["export", str(path), "--out", str(tmp_path / "o2"), "--rename", "nope"]) == 2
    assert main(["export", str(path), "--out", str(tmp_path / "o3"), "--format", "torch", "--force"]) == 0


def test_importing_tierckpt_and_exporting_imports_no_safetensors(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = config(tmp_path)
    save(cfg, {"w": torch.ones(3)})
    code = (
        "import json, sys, tierckpt\n"
        f"tierckpt.export(json.loads({json.dumps(json.dumps(cfg))}), {str(tmp_path / 'out')!r})\n"
        "print('safetensors' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert tierckpt.export is export


class Held:
    """Counts the bytes of the tensors a function returns while they are alive, and the most at once."""

    def __init__(self) -> None:
        self.now = self.peak = self.total = 0

    def wrap(self, fn: Any) -> Any:
        import weakref

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            t = fn(*args, **kwargs)
            n = t.numel() * t.element_size()
            self.now += n
            self.total += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(t, self.free, n)
            return t

        return counted

    def free(self, n: int) -> None:
        self.now -= n


def test_memory_stays_bounded_for_a_state_larger_than_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """48 tensors of 64 KiB (3 MiB) exported with 256 KiB in flight: what is read is held a window at a
    time (at most the bound, and the last tensor handed out while the next window is read), and the
    reads' own buffers stay within the tier's read staging."""
    from tierckpt.datapath import shardread
    from tierckpt.interop import reading

    cfg = config(tmp_path)
    s = {"model": {f"w{i}": torch.randn(16 * 1024) for i in range(48)}}
    save(cfg, s)
    tensors, buffers = Held(), Held()
    monkeypatch.setattr(reading, "_fresh", tensors.wrap(reading._fresh))
    monkeypatch.setattr(shardread, "aligned_empty", buffers.wrap(shardread.aligned_empty))
    export(cfg, tmp_path / "safetensors", max_inflight="256KiB")
    assert tensors.total == 48 * 64 * 1024  # everything was read through the counted path
    assert tensors.peak <= 256 * 1024 + 64 * 1024, tensors.peak
    with Hierarchy.from_config(cfg, readonly=True) as h:
        staging = h.tier("ssd").geometry.read_staging_bytes
    assert 0 < buffers.peak <= staging + 2 * 64 * 1024  # + one read's alignment slack
    loaded = st.load_file(str(tmp_path / "safetensors" / "model.safetensors"))
    assert all(torch.equal(loaded[f"model.{k}"], v) for k, v in s["model"].items())


def test_the_documented_example_runs_as_written(tmp_path: Path) -> None:
    """docs/integrations.md, "Export and import": its first Python block, unchanged, in a new process."""
    import re
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text[text.index("## Export and import") :]
    m = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert m is not None
    env = os.environ | {"PYTHONPATH": str(Path(tierckpt.__file__).parents[1]), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "10 ssd ('model.safetensors',)"
