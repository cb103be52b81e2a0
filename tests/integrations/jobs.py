"""Run an integration's test job (lightning_job.py, hf_job.py) in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
# Variables a launcher may have left that would make a job believe it is one rank of many.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")


def run_job(
    job: str, d: Path, config: str, out: str, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``job`` (a script beside this file) with this tree on its path, its config in ``d/cfg.yaml``.

    The job writes its training root under ``d/run`` and its report to ``d/out``; with ``check`` a
    non-zero exit fails the test with the job's stderr.
    """
    d.mkdir(exist_ok=True)
    if not (d / "cfg.yaml").exists():
        (d / "cfg.yaml").write_text(config)
    full = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    full["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])
    full.update(env or {})
    r = subprocess.run(
        [sys.executable, str(HERE / job), "--config", str(d / "cfg.yaml"), "--root", str(d / "run"), "--out", str(d / out), *args],
        capture_output=True, text=True, env=full, timeout=300,
    )  # fmt: skip
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def report(d: Path, out: str) -> dict[str, Any]:
    """The report a job wrote to ``d/out``."""
    return json.loads((d / out).read_text())
