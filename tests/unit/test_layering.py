"""The package's layers: imports only go downward, the orchestration names no tier kind, and importing
tierckpt (or its Hierarchy) imports no tier implementation, no io_uring binding, no torch.distributed.checkpoint
and does not start CUDA."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import tierckpt

ROOT = Path(tierckpt.__file__).parent
# lowest first: a module may import its own layer and the layers below it, never one above
LAYERS: list[set[str]] = [
    {"errors", "yamlfile", "config", "configvalues", "format", "io", "policies"},
    {"tiers", "registry"},
    {"orchestration"},
    {"hierarchy", "resume"},
    {"cli", "__main__", "bench", "testing", "dcp"},
]
TIER_KINDS = {"tierckpt.tiers.host", "tierckpt.tiers.gpu", "tierckpt.tiers.local", "tierckpt.tiers.pfs"}


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: in no layer of {LAYERS} (add it where it belongs)")


def _imports(path: Path) -> set[str]:
    """Every tierckpt module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tierckpt"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tierckpt"))
    return out


def _modules() -> dict[str, Path]:
    return {
        "tierckpt." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in ROOT.rglob("*.py")
    }


def test_imports_only_go_downward() -> None:
    upward = []
    for name, path in _modules().items():
        if name == "tierckpt.__init__" or name == "tierckpt":
            continue  # the package's lazy exports name every layer (imported on first use)
        for imp in _imports(path):
            if imp != "tierckpt" and _layer(imp) > _layer(name):
                upward.append(f"{name} imports {imp}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_the_orchestration_names_no_tier_kind() -> None:
    named = [
        f"{name} imports {imp}"
        for name, path in _modules().items()
        if name.startswith(("tierckpt.orchestration", "tierckpt.hierarchy"))
        for imp in _imports(path)
        if imp in TIER_KINDS or imp in {"tierckpt.tiers._files", "tierckpt.tiers._fileread"}
    ]
    assert not named, "\n".join(named)


def test_importing_tierckpt_imports_no_tier_no_io_uring_and_no_cuda() -> None:
    code = """
import json, sys
import tierckpt
from tierckpt import Hierarchy, TrainState, CheckpointInfo, SaveHandle
from tierckpt.policies import place
import torch
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.startswith("tierckpt") or "uring" in m),
    "cuda": torch.cuda.is_initialized(),
    "dcp": sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint")),
}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    loaded = set(out["modules"])
    assert not loaded & TIER_KINDS, loaded & TIER_KINDS
    assert not {
        m
        for m in loaded
        if m.startswith("tierckpt.tiers.") and m not in {"tierckpt.tiers.base", "tierckpt.tiers._jobs"}
    }
    assert not {m for m in loaded if "uring" in m}, loaded
    assert out["cuda"] is False
    assert out["dcp"] == [], "only tierckpt.dcp imports torch.distributed.checkpoint"
