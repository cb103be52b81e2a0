"""Two processes a launcher started as the ranks of one job (``$WORLD_SIZE=2``, ``$RANK``, one run id, as
torchrun sets them) that build their hierarchy before ``init_process_group``: each would take itself for
rank 0 of 1 and save into rank 0's place, one rank's data lost. Both are refused, naming the variable;
a read-only hierarchy (each process the launcher's rank: it reads its own part of a 2-rank checkpoint,
not rank 0's) and ``tierckpt ls`` in the same environment still read the checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import torch
import yaml

from tierckpt import ConfigError, Hierarchy

_LAUNCH = (
    "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "JSM_NAMESPACE_SIZE",
    "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "JSM_NAMESPACE_RANK",
    "SLURM_PROCID",
)  # fmt: skip


def _config(tmp: Path) -> dict[str, Any]:
    return {"tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": str(tmp / "pfs")}]}


def _rank(rank: int, tmp: str, out: str) -> None:
    """One rank: as torchrun starts it, without a process group."""
    from tierckpt.cli import main

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    os.environ["TORCHELASTIC_RUN_ID"] = "launched-test"  # one job: the ranks would share the lease
    got: dict[str, Any] = {}
    try:
        with Hierarchy.from_config(_config(Path(tmp))) as h:
            h.save({"rank": torch.tensor([rank])}, step=2).wait()
            got["saved_as"] = [h.rank, h.world_size]
    except ConfigError as e:
        got["refused"] = str(e)
    with Hierarchy.from_config(_config(Path(tmp)), readonly=True) as h:  # an evaluation: reading is fine
        got["read_as"] = [h.rank, h.world_size]
        got["listed"] = [c.step for c in h.checkpoints()]
        got["restored"] = int(h.restore()["rank"].item())
    with contextlib.redirect_stdout(io.StringIO()) as ls:
        got["ls_rc"] = main(["ls", f"{tmp}/tiers.yaml"])
    got["ls"] = ls.getvalue()
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def _earlier_run(tmp: Path) -> None:
    """Step 1 of an earlier 2-rank run, saved by two threads of this process: rank r saved ``10 + r``."""
    import threading

    import torch.distributed as dist

    from tierckpt import StoreCoordinator

    store, errors = dist.HashStore(), []

    def rank(r: int) -> None:
        try:
            with Hierarchy.from_config(_config(tmp), coordinator=StoreCoordinator(store, r, 2), job="earlier") as h:
                h.save({"rank": torch.tensor([10 + r])}, step=1).wait()
        except BaseException as e:  # handed to the test
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors


def test_ranks_started_by_a_launcher_without_a_process_group_are_refused(tmp_path: Path) -> None:
    for var in _LAUNCH:
        assert var not in os.environ, f"${var} is set in the test's own environment"
    _earlier_run(tmp_path)
    (tmp_path / "tiers.yaml").write_text(yaml.safe_dump(_config(tmp_path)))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tierckpt.hierarchy", __name__])
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} hung"
    for r in range(2):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert "saved_as" not in got, f"rank {r} saved as rank {got['saved_as'][0]} of {got['saved_as'][1]}"
        assert got["refused"].startswith("$WORLD_SIZE is 2: this process is one of the 2 ranks of a job")
        assert "init_process_group" in got["refused"]
        assert got["read_as"] == [r, 2]
        assert (got["listed"], got["restored"]) == ([1], 10 + r)  # its own part of step 1; nothing refused saved
        assert got["ls_rc"] == 0 and got["ls"].split("\n")[1].split() == ["1", ".", "x", "2"], got["ls"]
    assert [p.name for p in (tmp_path / "pfs").glob("step-*")] == ["step-000000000001"]
