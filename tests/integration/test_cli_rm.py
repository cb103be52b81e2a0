"""``tierckpt rm CONFIG --step N``: the step leaves every directory of every tier (each node's and each
rank's, where the path holds ``{node}`` or ``{rank}``), every rank's copy with it; an unknown step exits
1 naming the steps there are; a job holding the tiers' leases refuses it (exit 2, naming the holder);
a tier directory that does not exist is an error, and nothing is created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.cli import main

N = 4


def ls(yml: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[int, list[str]]]:
    assert main(["ls", str(yml), "--json"]) == 0
    return [(c["step"], c["tiers"]) for c in json.loads(capsys.readouterr().out)["checkpoints"]]


def rank_dirs(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.glob("step-*/rank-*"))


@pytest.mark.parametrize("ssd", ["node{node}/ssd", "rank{rank}/ssd"])
def test_rm_deletes_every_ranks_copy_in_every_directory(
    tmp_path: Path, saved_by_ranks: Any, capsys: pytest.CaptureFixture[str], ssd: str
) -> None:
    yml = saved_by_ranks(ssd, steps=(1, 2))
    ssds = sorted(p.parent for p in tmp_path.glob("*/ssd"))
    assert len(ssds) == (2 if "node" in ssd else 4)
    assert main(["rm", str(yml), "--step", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 1 and out["error"] is None
    assert sorted((d["tier"], d["location"]) for d in out["deleted"]) == sorted(
        [("ssd", str(d / "ssd")) for d in ssds] + [("pfs", str(tmp_path / "pfs"))]
    )
    for d in [*(d / "ssd" for d in ssds), tmp_path / "pfs"]:
        assert all(p.startswith("step-000000000002/") for p in rank_dirs(d)), d
    assert len(rank_dirs(tmp_path / "pfs")) == N
    assert ls(yml, capsys) == [(2, ["ssd", "pfs"])]
    with Hierarchy.from_yaml(yml, readonly=True) as r:  # what remains is whole
        assert all(err is None for _, _, err in r.verify())
        assert torch.equal(r.restore()["w"], torch.full((1000,), 200.0))


def test_rm_of_an_unknown_step_exits_1_naming_the_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: host, kind: host}\n  - {name: ssd, kind: local, path: ssd}\n")
    with Hierarchy.from_yaml(yml) as h:
        for step in (1, 2):
            h.save({"w": torch.ones(4) * step}, step=step, blocking=True)
    assert main(["rm", str(yml), "--step", "2"]) == 0
    assert capsys.readouterr().out == f"step 2 deleted from ssd ({tmp_path / 'ssd'})\n"
    assert main(["rm", str(yml), "--step", "2"]) == 1
    assert "step 2 is not committed on any tier (committed steps: [1])" in capsys.readouterr().err
    assert main(["rm", str(yml), "--step", "5", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {
        "step": 5, "deleted": [], "error": "step 5 is not committed on any tier (committed steps: [1])"
    }  # fmt: skip
    assert ls(yml, capsys) == [(1, ["ssd"])]


def test_rm_is_refused_while_a_job_holds_the_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: ssd}\n")
    with Hierarchy.from_yaml(yml, job="training") as h:
        h.save({"w": torch.ones(4)}, step=1, blocking=True)
        assert main(["rm", str(yml), "--step", "1"]) == 2
        err = capsys.readouterr().err
        assert "is leased by job 'training'" in err, err
        assert [c.step for c in h.checkpoints()] == [1]
    assert main(["rm", str(yml), "--step", "1"]) == 0  # once the job is gone


def test_rm_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: nowhere}\n")
    assert main(["rm", str(yml), "--step", "1"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
