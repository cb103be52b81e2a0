"""Launch a job script on N ranks as torchrun would: one process a rank, ``$RANK``/``$WORLD_SIZE`` and a
free ``$MASTER_PORT`` set (the script initializes its gloo process group from them), this tree first on
its path, run in a directory of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def run_ranks(script: Path, d: Path, world: int, *args: str, out: str = "") -> list[int]:
    """``script *args --out OUT`` on ``world`` ranks in ``d``; their exit codes (0, or -SIGKILL where the
    job killed itself), asserting each ended one way or the other (the stderr tail when not). ``OUT`` is
    ``out``, or ``out-<rank>.json`` when ``out`` is empty."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(world),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    for v in ("TIERCKPT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LOCAL_RANK"):
        env.pop(v, None)
    argv = [sys.executable, str(script), *args, "--out"]
    procs = [
        subprocess.Popen(
            [*argv, out or f"out-{r}.json"], cwd=d, env={**env, "RANK": str(r)}, stderr=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    codes = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        codes.append(p.returncode)
        assert p.returncode in (0, -signal.SIGKILL), err[-4000:]
    return codes
