"""A process SIGKILLed in the middle of a save to the mount (its host → pfs demotion of step 3, after one
piece of the copy is written: tests/multiproc/killpoints.py's ``write_demotion``): a new process lists
steps 1 and 2 on pfs and not step 3, restores them bit-exactly, sweeps the dead process's scratch when it
opens the tier for writing, and saves again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.pfs.steps import config, same, state
from tierckpt import Hierarchy

pytestmark = [pytest.mark.pfs, pytest.mark.remote]

ROOT = Path(__file__).parents[2]
CHILD = """
import sys
sys.path.insert(0, {multiproc!r})
from killpoints import arm
from tests.pfs.steps import config, state
from tierckpt import Hierarchy

arm("write_demotion", 3)
with Hierarchy.from_config(config({pfs!r})) as h:
    for step in (1, 2, 3):
        h.save(state(step), step=step).wait()
        assert h.flush(timeout=60)
        print("demoted", step, flush=True)
"""


def test_a_save_killed_mid_write_loses_no_committed_step(pfs_dir: Path) -> None:
    pfs = pfs_dir / "pfs"
    script = textwrap.dedent(CHILD).format(multiproc=str(ROOT / "tests" / "multiproc"), pfs=str(pfs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-3000:])
    assert r.stdout.split() == ["demoted", "1", "demoted", "2"], r.stdout
    step3 = pfs / "step-000000000003"
    scratch = [p.name for p in step3.iterdir() if p.name.startswith(".tmp-")]
    assert scratch, list(step3.iterdir())  # the half-written copy the kill left

    with Hierarchy.from_config(config(pfs, host=False), readonly=True) as h:  # another process, looking
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("pfs",)), (2, ("pfs",))]
    with Hierarchy.from_config(config(pfs)) as h:  # the restarted job: opening pfs sweeps the scratch
        assert not step3.exists() or not any(p.name.startswith(".") for p in step3.iterdir())
        assert same(h.restore(), state(2)) and h.last_restore == (2, "pfs")
        assert same(h.restore(1), state(1))
        h.save(state(3), step=3).wait()
        assert h.flush(timeout=60)
        assert [(c.step, c.tiers) for c in h.checkpoints()][-1] == (3, ("host", "pfs"))
    with Hierarchy.from_config(config(pfs, host=False)) as h:
        assert same(h.restore(3), state(3))
