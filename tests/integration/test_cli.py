from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import Hierarchy, TierckptError
from tierckpt.cli import main
from tierckpt.testing.compressed import recompress
from tierckpt.testing.tamper import blob_file
from tierckpt.tiers._lease import LEASE_DIR
from tierckpt.tiers.base import CheckpointKey

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    yml = tmp_path / "h.yaml"
    yml.write_text(
        "tiers:\n  - {name: ssd, kind: local, path: ssd}\n  - {name: pfs, kind: pfs, path: pfs, compress: none}\n"
    )
    with Hierarchy.from_yaml(yml) as h:
        for step in (1, 2):
            h.save({"w": torch.arange(10.0) * step, "opt": {"lr": 0.1, "m": torch.zeros(2, 3, dtype=torch.bfloat16)}},
                   step=step).wait()  # fmt: skip
    return yml


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_ls_inspect_verify(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_json(capsys, "ls", str(config))
    assert rc == 0 and out == {
        "checkpoints": [
            {"step": 1, "tiers": ["ssd", "pfs"], "ranks": 1},
            {"step": 2, "tiers": ["ssd", "pfs"], "ranks": 1},
        ]
    }
    rc, out = run_json(capsys, "inspect", str(config), "--step", "1")
    assert rc == 0 and out["step"] == 1 and out["read_from"] == "ssd"
    keys = {t["key"]: t for t in out["tensors"]}
    assert keys["state['opt']['m']"]["dtype"] == "bfloat16" and keys["state['opt']['m']"]["shape"] == [2, 3]
    assert keys["state['w']"]["bytes"] == 40
    rc, out = run_json(capsys, "verify", str(config))
    assert rc == 0 and out["ok"] and len(out["copies"]) == 4
    assert main(["ls", str(config)]) == 0
    assert "step" in capsys.readouterr().out


def test_inspect_shows_each_tiers_stored_bytes(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 1's copy on pfs stored compressed: inspect says, per tier, the bytes its blobs store and the ratio."""
    with Hierarchy.from_yaml(config) as h:
        index = recompress(h.tier("pfs"), CheckpointKey(1))
    rc, out = run_json(capsys, "inspect", str(config), "--step", "1")
    raw = sum(b["bytes"] for b in out["blobs"])
    assert rc == 0 and out["stored"] == [
        {"tier": "ssd", "codec": None, "raw_bytes": raw, "stored_bytes": raw, "ratio": 1.0},
        {"tier": "pfs", "codec": "zstd", "raw_bytes": raw, "stored_bytes": index.stored_bytes(),
         "ratio": round(raw / index.stored_bytes(), 3)},
    ]  # fmt: skip
    assert main(["inspect", str(config), "--step", "1"]) == 0
    text = capsys.readouterr().out
    assert "  ssd: 4KiB (not compressed)" in text and f"zstd, ratio {raw / index.stored_bytes():.2f})" in text


def test_verify_json_is_complete_and_in_a_stable_order(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What scripts parse: every key always there, the copies in the order (step, tier as configured,
    rank), and an unknown step answered in JSON too (on 987543a: tiers by name, no status nor summary, and
    nothing on stdout for an unknown step)."""
    rc, out = run_json(capsys, "verify", str(config))
    assert rc == 0 and list(out) == ["ok", "error", "summary", "copies"]
    assert out["summary"] == {"copies": 4, "ok": 4, "corrupt": 0, "unusable": 0} and out["error"] is None
    assert [(c["step"], c["tier"]) for c in out["copies"]] == [(1, "ssd"), (1, "pfs"), (2, "ssd"), (2, "pfs")]
    assert list(out["copies"][0]) == ["step", "tier", "node", "rank", "ok", "status", "error"]
    assert out["copies"][0] == {
        "step": 1, "tier": "ssd", "node": None, "rank": 0, "ok": True, "status": "ok", "error": None,
    }  # fmt: skip
    assert main(["verify", str(config)]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ["step 1 on ssd, rank 0: ok", "step 1 on pfs, rank 0: ok"]
    rc, out = run_json(capsys, "verify", str(config), "--step", "7")
    assert rc == 1 and not out["ok"] and out["copies"] == [] and "step 7 is not committed" in out["error"]


@pytest.mark.parametrize(("pos", "what"), [(3, "state['w']"), (41, "padding bytes [40, 64)"), (64, "state['opt']['m']"),
                                           (4000, "padding bytes [76, 4096)")])  # fmt: skip
def test_verify_detects_a_flipped_byte_anywhere(
    config: Path, capsys: pytest.CaptureFixture[str], pos: int, what: str
) -> None:
    blob, base = blob_file(config.parent / "pfs" / "step-000000000002" / "rank-00000")
    data = bytearray(blob.read_bytes())
    data[base + pos] ^= 0x01
    blob.write_bytes(bytes(data))
    rc, out = run_json(capsys, "verify", str(config))
    assert rc == 1 and not out["ok"]
    bad = [c for c in out["copies"] if not c["ok"]]
    assert [(c["step"], c["tier"]) for c in bad] == [(2, "pfs")]
    assert "blob-00000.bin" in bad[0]["error"] and what in bad[0]["error"]
    assert main(["verify", str(config), "--step", "1"]) == 0


def test_errors_exit_2_with_a_message(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: x, kind: local, path: x, capacity: lots}\n")
    assert main(["ls", str(bad)]) == 2
    assert "tiers[0].capacity: expected a size like '64GiB', got 'lots'" in capsys.readouterr().err
    assert main(["inspect", str(config), "--step", "99"]) == 2
    assert "step 99 is not committed" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    """``tierckpt inspect CONFIG | head``: the pipe closes before the output ends. The command stops
    quietly with status 141 (as if SIGPIPE had ended it), not 0 and not with a traceback."""
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: ssd}\n")
    with Hierarchy.from_yaml(yml) as h:  # ~300 KB of inspect output: more than a pipe holds
        h.save({f"layer{i:05d}": torch.zeros(2) for i in range(5000)}, step=1).wait()
    p = subprocess.Popen([sys.executable, "-m", "tierckpt.cli", "inspect", str(yml)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.read(100).startswith(b"step 1")
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_verify_with_nothing_to_check_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path to an empty directory (a mistyped one that exists): verify must not pass having checked
    nothing. (One that does not exist is an error: see test_commands_only_look.)"""
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: typo}\n")
    (tmp_path / "typo").mkdir()
    assert main(["verify", str(yml)]) == 1
    assert "0 of 0 copies verified: no checkpoint found" in capsys.readouterr().out
    rc, out = run_json(capsys, "verify", str(yml))
    summary = {"copies": 0, "ok": 0, "corrupt": 0, "unusable": 0}
    assert rc == 1 and out == {"ok": False, "error": "no checkpoint found", "summary": summary, "copies": []}


def test_commands_only_look(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ls, inspect and verify open the hierarchy read-only: a newest step that an on_close tier lacks is
    not copied there when they close, and a missing directory is an error, not a new directory."""
    yml = tmp_path / "h.yaml"
    yml.write_text(
        "tiers:\n  - {name: ssd, kind: local, path: ssd}\n  - {name: pfs, kind: pfs, path: pfs, compress: none}\n"
        "policy: {demote: {pfs: {every: 1000, on_close: true}}}\n"
    )
    h = Hierarchy.from_yaml(yml)
    h.save({"w": torch.ones(3)}, step=1).wait()
    h._mover.close()  # as if the process died before close(): pfs never got step 1
    for cmd in ("ls", "inspect", "verify"):
        assert main([cmd, str(yml)]) == 0, capsys.readouterr()
        assert [p.name for p in (tmp_path / "pfs").iterdir()] == [LEASE_DIR], cmd
    typo = tmp_path / "typo.yaml"
    typo.write_text("tiers:\n  - {name: ssd, kind: local, path: no-such-dir}\n")
    assert main(["ls", str(typo)]) == 2
    assert "tier 'ssd': directory" in capsys.readouterr().err and not (tmp_path / "no-such-dir").exists()
    with Hierarchy.from_yaml(yml, readonly=True) as ro:
        with pytest.raises(TierckptError, match="cannot save: the hierarchy was opened read-only"):
            ro.save({"w": torch.ones(3)}, step=2)
        with pytest.raises(TierckptError, match="cannot prefetch"):
            ro.prefetch()
        assert torch.equal(ro.restore()["w"], torch.ones(3))
    assert [p.name for p in (tmp_path / "pfs").iterdir()] == [LEASE_DIR]


def test_console_script_entry_point(config: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tierckpt.cli", "ls", str(config), "--json"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(out.stdout)["checkpoints"][0]["step"] == 1


def test_quickstart_runs(tmp_path: Path) -> None:
    yml = tmp_path / "q.yaml"
    yml.write_text("tiers:\n  - {name: host, kind: host, capacity: 256MiB}\n  - {name: ssd, kind: local, path: ssd}\n")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--config", str(yml), "--steps", "2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "resumed exactly" in out.stdout and "tied weights still tied: True" in out.stdout


def test_inspect_shows_plain_values_and_tied_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not only tensors: every plain value with a bounded repr, and which keys share one tensor."""
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: ssd}\n")
    emb = torch.randn(8, 4)
    state = {
        "model": {"emb.weight": emb, "head.weight": emb, "bias": torch.zeros(4)},
        "optim": {"param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": list(range(50))}], "state": {}},
        "step": 7, "name": "x" * 5000, "raw": b"\x00" * 100_000, "big": 2**300, "none": None, "dtype": torch.bfloat16,
    }  # fmt: skip
    with Hierarchy.from_yaml(yml) as h:
        h.save(state, step=7).wait()
    rc, out = run_json(capsys, "inspect", str(yml))
    assert rc == 0
    assert out["tied"] == [{"keys": ["state['model']['emb.weight']", "state['model']['head.weight']"]}]
    assert [t["key"] for t in out["tensors"]] == ["state['model']['emb.weight']", "state['model']['bias']"]
    assert out["tensors"][0]["also_at"] == ["state['model']['head.weight']"] and out["tensors"][1]["also_at"] == []
    values = {v["key"]: v for v in out["values"]}
    assert list(values) == [
        "state['optim']['param_groups'][0]['lr']", "state['optim']['param_groups'][0]['betas']",
        "state['optim']['param_groups'][0]['params']", "state['optim']['state']", "state['step']", "state['name']",
        "state['raw']", "state['big']", "state['none']", "state['dtype']",
    ]  # fmt: skip
    assert values["state['step']"] == {"key": "state['step']", "type": "int", "repr": "7"}
    assert values["state['optim']['param_groups'][0]['betas']"]["repr"] == "(0.9, 0.999)"
    assert values["state['optim']['param_groups'][0]['params']"]["repr"].endswith("...] (50 items)")
    assert values["state['optim']['state']"]["repr"] == "{}" and values["state['none']"]["repr"] == "None"
    assert values["state['dtype']"]["repr"] == "torch.bfloat16"
    for key, tail in (("name", "(5000 characters)"), ("raw", "(100000 bytes)"), ("big", "<an integer of 301 bits>")):
        r = values[f"state[{key!r}]"]["repr"]
        assert r.endswith(tail) and len(r) < 120, r
    assert main(["inspect", str(yml)]) == 0
    text = capsys.readouterr().out
    assert "2 tensors" in text and "10 plain values" in text
    assert "state['model']['emb.weight'] = state['model']['head.weight']" in text
    assert "  state['step'] = 7\n" in text and "  state['optim']['param_groups'][0]['lr'] = 0.001\n" in text


def test_inspect_names_a_pickled_value_without_unpickling_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: ssd}\n")
    with Hierarchy.from_yaml(yml) as h:
        h.save({"w": torch.ones(2), "obj": {1, 2, 3}}, step=1, allow_pickle=True).wait()
    rc, out = run_json(capsys, "inspect", str(yml))
    assert rc == 0 and out["has_pickle"]
    (v,) = out["values"]
    assert v["key"] == "state['obj']" and v["type"] == "pickled" and v["repr"].startswith("<pickled value, ")


_NO_TORCH = """
import runpy, sys
sys.argv = ["tierckpt", *sys.argv[1:]]
try:
    runpy.run_module("tierckpt", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("torch imported" if "torch" in sys.modules else "no torch", code)
"""


@pytest.mark.parametrize(
    ("argv", "code", "shows"),
    [(["--help"], 0, "inspect"), (["--version"], 0, "tierckpt 0.1.0"), (["bench", "--help"], 0, "--quick"),
     (["inspect", "--help"], 0, "--json"), (["ls"], 2, "required: config"), (["frobnicate"], 2, "invalid choice")],
)  # fmt: skip
def test_help_version_and_usage_errors_import_no_torch(argv: list[str], code: int, shows: str) -> None:
    """Parsing the command line imports no torch (3-5 s on a slow machine): --help, --version and usage
    errors answer at once. Checked on sys.modules, not with a clock."""
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines()[-1] == f"no torch {code}", out.stdout + out.stderr
    assert shows in out.stdout + out.stderr


def test_python_dash_m_tierckpt(config: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tierckpt", "ls", str(config), "--json"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert [c["step"] for c in json.loads(out.stdout)["checkpoints"]] == [1, 2]
    out = subprocess.run([sys.executable, "-m", "tierckpt", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"tierckpt {tierckpt.__version__}"


def test_version_matches_the_package_metadata() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{tierckpt.__version__}"\n' in text


def test_import_tierckpt_imports_no_torch_until_a_name_needs_it() -> None:
    code = (
        "import sys, tierckpt; from tierckpt import ConfigError, TierIOError, load_config; a = 'torch' in sys.modules;"
        " from tierckpt import Hierarchy; print(a, 'torch' in sys.modules, sorted(set(tierckpt.__all__) - set(dir(tierckpt))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "True", "[]"]
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = tierckpt.nope
