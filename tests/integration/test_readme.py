"""The README's headline example, run as written: killed mid-run and restarted, it ends bit-for-bit where
an uninterrupted run ends (model, optimizer, scheduler, RNG and data position).

The first ```python block of README.md is executed unchanged; only the names it leaves to the user
(``model``, ``opt``, ``sched``, ``batches``, ``loss_fn``, ``steps``) are defined around it, by a
small job that draws on every generator a real one does (dropout: torch; its data: python's
``random`` and numpy's global generator) and whose data stream reports its position as a numpy
scalar.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

HARNESS = '''
import os, random, signal
import numpy as np
import torch
from torch import nn

random.seed(0); np.random.seed(0); torch.manual_seed(0)
steps = int(os.environ["STEPS"])
crash_at = int(os.environ.get("CRASH_AT", "0"))  # kill -9 in this many calls of loss_fn (0: never)


class Batches:
    """A data stream that knows its position (like torchdata's StatefulDataLoader)."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(1000 + self.pos)
        self.pos += 1
        return torch.randn(8, 16, generator=g) + random.random() + float(np.random.rand())

    def state_dict(self):
        return {"pos": np.int64(self.pos)}  # a numpy scalar, as real loaders produce

    def load_state_dict(self, s):
        self.pos = int(s["pos"])


model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
batches = Batches()
calls = 0


def loss_fn(out):
    global calls
    calls += 1
    if calls == crash_at:
        handle.wait()  # the README's last save is durable on every tier: then kill -9
        os.kill(os.getpid(), signal.SIGKILL)
    return out.pow(2).mean()
'''


def readme_block() -> str:
    """The first ```python block of README.md, verbatim."""
    m = re.search(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def job_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    (d / "tiers").mkdir(parents=True)
    shutil.copy(ROOT / "tiers" / "local.yaml", d / "tiers" / "local.yaml")
    return d


def script(twice: bool = False) -> str:
    """Harness + README block (``twice``: the block twice, a finished job restarted) + a dump of the final
    state of everything the job resumes, and ``done`` of each pass, to ``final.pt``."""
    block = readme_block()
    return (
        HARNESS
        + block
        + "first = done\n"
        + (block if twice else "")
        + (
            "from tierckpt import rng_state\n"
            "torch.save({'model': model.state_dict(), 'opt': opt.state_dict(), 'sched': sched.state_dict(),"
            " 'pos': batches.pos, 'rng': rng_state(), 'done': (first, done)}, 'final.pt')\n"
        )
    )


def crash(d: Path, steps: int, crash_at: int) -> None:
    """Run the job in a new process in ``d`` and kill -9 it in the ``crash_at``-th forward."""
    env = {**os.environ, "STEPS": str(steps), "CRASH_AT": str(crash_at), "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script()], cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr


def run(d: Path, steps: int, monkeypatch: pytest.MonkeyPatch, twice: bool = False) -> dict[str, Any]:
    """Run the job in ``d`` in this process (it seeds every generator first, as a new process would start:
    only the crash needs a process of its own); the state it ends with."""
    monkeypatch.chdir(d)
    monkeypatch.setenv("STEPS", str(steps))
    exec(compile(script(twice), "README.md", "exec"), {"__name__": "readme"})
    return torch.load(d / "final.pt", weights_only=False)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_readme_example_killed_and_restarted_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, crash_at = 8, 6
    reference = run(job_dir(tmp_path, "straight"), steps, monkeypatch)
    assert reference.pop("done") == (0, 0) and reference["pos"] == steps
    d = job_dir(tmp_path, "crashed")
    crash(d, steps, crash_at)  # kill -9 in the forward of update 6, once update 5's save is durable
    resumed = run(d, steps, monkeypatch, twice=True)  # restart; then, finished, restart again (nothing left to do)
    assert resumed.pop("done") == (crash_at - 1, steps)
    assert_same(reference, resumed)
    assert resumed["sched"]["last_epoch"] == steps and resumed["opt"]["state"][0]["step"] == steps
