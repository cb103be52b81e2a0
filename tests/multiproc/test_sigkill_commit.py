"""SIGKILL of one rank in the middle of a save, in a job of 4 spawned gloo ranks on two simulated nodes
(node-local ``ssd`` per node, one shared ``pfs``): the step is listed on no rank, the restarted job
restores the previous step on every rank, and nothing of the dead step survives its next save."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import spawn  # tests/multiproc/harness.py

N = 4


def _config(tmp: str) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": tmp + "/node{node}/ssd"},
            {"name": "pfs", "kind": "pfs", "path": tmp + "/pfs"},
        ],
        "distributed": {"timeout": 4},
    }


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((2 << 20,), float(100 * step + rank)), "step": step}  # 8 MiB a rank


def save_then_die(rank: int, world_size: int, tmp: str, how: str) -> Any:
    from tierckpt import Hierarchy

    os.environ["TIERCKPT_NODE"] = str(rank // 2)
    os.environ["TIERCKPT_JOB"] = "sigkill-job"
    with Hierarchy.from_config(_config(tmp)) as h:
        for step in (1, 2):
            h.save(_state(rank, step), step=step).wait()
        if rank == 3:
            if how == "lazy":  # killed while its lazy save's copies are being written
                h.save(_state(rank, 3), step=3)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGKILL)).start()  # mid blocking save
            h.save(_state(rank, 3), step=3, blocking=True)
            time.sleep(60)
        t0 = time.monotonic()
        handle = h.save(_state(rank, 3), step=3)
        try:
            handle.wait()
            failed = None
        except Exception as e:
            failed = str(e)
        took = time.monotonic() - t0
        futures.wait(list(handle.durable.values()))  # the pfs copy too (written directly once the ssd failed)
        errors = {t: str(f.exception()) for t, f in handle.durable.items()}
        return {
            "failed": failed,
            "took": took,
            "errors": errors,
            "listed": [c.step for c in h.checkpoints() if c.tiers],
        }


def restart(rank: int, world_size: int, tmp: str) -> Any:
    from tierckpt import Hierarchy

    os.environ["TIERCKPT_NODE"] = str(rank // 2)
    os.environ["TIERCKPT_JOB"] = "sigkill-job"
    with Hierarchy.from_config(_config(tmp)) as h:
        got = h.restore()
        restored = [got["step"], got["w"][0].item(), h.last_restore]
        h.save(_state(rank, 4), step=4).wait()
        return {"restored": restored, "listed": [c.step for c in h.checkpoints() if c.tiers]}


@pytest.mark.parametrize("how", ["lazy", "blocking"])
def test_a_rank_killed_mid_save_leaves_no_trace_of_the_step(tmp_path: Path, how: str) -> None:
    got = spawn(save_then_die, N, tmp_path, str(tmp_path), how, limit=90)
    assert got[3] is None  # killed
    for r in range(3):
        out = got[r]
        assert out is not None and "ok" in out, out
        res = out["ok"]
        assert res["failed"] and "3" in res["failed"], res  # names the dead rank
        assert res["took"] < 30 and res["listed"] == [1, 2], res
        assert "rank(s) 3 did not arrive" in res["errors"]["ssd"] and res["errors"]["pfs"] != "None", res
    again = spawn(restart, N, tmp_path, str(tmp_path), limit=90)
    for r, out in enumerate(again):
        assert out is not None and "ok" in out, out
        assert out["ok"]["restored"] == [2, 200.0 + r, [2, "ssd"]]
        assert out["ok"]["listed"] == [1, 2, 4]
    left = [p for p in tmp_path.rglob("step-000000000003*")]
    assert not left, left  # the dead step's copies and scratch are gone
