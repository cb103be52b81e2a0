"""The package's layers: imports only go downward (between packages, and between the four groups of the
orchestration: ranks, data path, background machinery, facade helpers), no module imports another
package's private modules nor calls a private method of another package's class, no import cycle
anywhere, the orchestration names no tier kind, and importing tierckpt (or its Hierarchy) imports no
tier implementation, no io_uring binding, no torch.distributed.checkpoint and does not start CUDA."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import tierckpt

ROOT = Path(tierckpt.__file__).parent
# lowest first: a module may import its own layer and the layers below it, never one above
LAYERS: list[set[str]] = [
    {"errors", "yamlfile", "config", "configvalues", "ioconfig", "format", "io", "policies"},
    {"tiers", "registry"},
    # the orchestration, by concern: how ranks meet; the bytes; what runs on the tiers' workers; what
    # the facade runs in the caller's thread
    {"ranks"},
    {"datapath"},
    {"background"},
    {"facade"},
    {"hierarchy", "resume"},
    {"cli", "__main__", "bench", "testing", "dcp", "interop", "integrations"},
]
ORCHESTRATION = ("tierckpt.ranks", "tierckpt.datapath", "tierckpt.background", "tierckpt.facade")
TIER_KINDS = {"tierckpt.tiers.host", "tierckpt.tiers.gpu", "tierckpt.tiers.local", "tierckpt.tiers.pfs"}


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: in no layer of {LAYERS} (add it where it belongs)")


def _imports(path: Path) -> set[str]:
    """Every tierckpt module ``path`` imports, at the top, inside a function or under TYPE_CHECKING alike:
    relative imports resolved against the module's package, ``from tierckpt.x import y`` as module
    ``tierckpt.x.y`` where ``y`` is one, and a name of the package's lazy exports (``from tierckpt import
    Hierarchy``) as the module that defines it."""
    mods = _modules()
    name = next(n for n, p in mods.items() if p == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("tierckpt"):
                continue
            for a in node.names:
                if base == "tierckpt" and a.name in tierckpt._LAZY:
                    out.add(tierckpt._LAZY[a.name])
                elif f"{base}.{a.name}" in mods:
                    out.add(f"{base}.{a.name}")
                else:
                    out.add(base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tierckpt"))
    return out


def _modules() -> dict[str, Path]:
    return {
        "tierckpt." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in ROOT.rglob("*.py")
    }


_MODULES = _modules()
_read = Path.read_text


def test_imports_only_go_downward() -> None:
    upward = []
    for name, path in _modules().items():
        if name == "tierckpt.__init__" or name == "tierckpt":
            continue  # the package's lazy exports name every layer (imported on first use)
        for imp in _imports(path):
            if imp != "tierckpt" and _layer(imp) > _layer(name):
                upward.append(f"{name} imports {imp}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def _edges() -> dict[str, set[str]]:
    """Per module, the tierckpt modules it imports (:func:`_imports`): a cycle that only type checking
    sees still ties the two modules into one."""
    mods = _modules()
    return {name: {m for m in _imports(path) if m in mods and m != name} for name, path in mods.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle() -> None:
    edges = _edges()
    edges.pop("tierckpt", None)  # the package's lazy exports name every layer (imported on first use)
    cycles = _cycles(edges)
    assert not cycles, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_import_reader_resolves_relative_and_lazy_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader sees an upward import however it is spelled: relative, or through the package's lazy
    exports (the two ways it once missed)."""
    planted = ROOT / "policies" / "_planted_for_test.py"
    monkeypatch.setattr(
        sys.modules[__name__], "_modules", lambda: {**_MODULES, "tierckpt.policies._planted_for_test": planted}
    )
    src = "from ..hierarchy import Hierarchy\nfrom tierckpt import TrainState\nfrom . import placement\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: src if self == planted else _read(self, *a, **k))
    assert _imports(planted) == {"tierckpt.hierarchy", "tierckpt.resume", "tierckpt.policies.placement"}


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private(module: str) -> bool:
    return any(part.startswith("_") and part not in ("__init__", "__main__") for part in module.split(".")[1:])


def test_no_module_imports_another_packages_private_module() -> None:
    """``_x.py`` is its package's business: other packages go through the package's public modules."""
    reached = [
        f"{name} imports {imp}"
        for name, targets in _edges().items()
        for imp in targets
        if _private(imp)
        and imp.rsplit(".", 1)[0] != (name if _modules()[name].name == "__init__.py" else name.rsplit(".", 1)[0])
    ]
    assert not reached, "\n".join(sorted(reached))


def _package(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0].removesuffix(".py")


def test_no_module_calls_a_private_method_of_another_packages_class() -> None:
    """A class's ``_x`` methods are its package's business too: ``handle._settle()`` from the facade
    reached into the background machinery's SaveHandle (it has a public ``settle`` now)."""
    trees = {path: ast.parse(path.read_text()) for path in _modules().values()}
    private: dict[str, set[str]] = {}  # a private method's name: the packages whose classes define it
    for path, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name[:1] == "_" != item.name[1:2]:
                    private.setdefault(item.name, set()).add(_package(path))
    reached = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} (defined in {', '.join(sorted(private[node.attr]))})"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in private
        and _package(path) not in private[node.attr]
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert not reached, "\n".join(sorted(reached))


def test_the_orchestration_names_no_tier_kind() -> None:
    named = [
        f"{name} imports {imp}"
        for name, path in _modules().items()
        if name.startswith((*ORCHESTRATION, "tierckpt.hierarchy"))
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
        if m.startswith("tierckpt.tiers.")
        and m not in {"tierckpt.tiers.base", "tierckpt.tiers.jobs", "tierckpt.tiers.holdings"}  # the contract's
    }
    assert not {m for m in loaded if "uring" in m}, loaded
    assert out["cuda"] is False
    assert out["dcp"] == [], "only tierckpt.dcp imports torch.distributed.checkpoint"
