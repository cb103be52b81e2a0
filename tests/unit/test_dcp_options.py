"""The DCP options and ids a storage backend sees, in one process: ``checkpoint_id`` as a path (a file tier's
directory, or its ``step-N`` directory) and what is refused, ``overwrite=False``, ``storage_meta``,
``validate_checkpoint_id``, and DCP's format utilities (``dcp_to_torch_save`` / ``torch_save_to_dcp``) over a
hierarchy, compared with DCP's own on its own file-system checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint import format_utils  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from tierckpt import Hierarchy  # noqa: E402
from tierckpt.dcp import (  # noqa: E402
    HierarchyReader,
    HierarchyWriter,
    StepExistsError,
    dcp_to_torch_save,
    torch_save_to_dcp,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Hierarchy]:
    """Host memory, and two file tiers (every step goes to both) whose directories ids may name."""
    kinds = (("host", "host"), ("ssd", "local"), ("pfs", "pfs"))
    tiers = [{"name": n, "kind": k} | ({} if k == "host" else {"path": str(tmp_path / n)}) for n, k in kinds]
    with Hierarchy.from_config({"tiers": tiers, "policy": {"demote": {"pfs": {"every": 1}}}}) as hier:
        yield hier


def _model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return {"model": model.state_dict(), "epoch": seed, "tag": f"run-{seed}", "mix": [torch.arange(3) * seed, 7]}


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "epoch": -1,
        "tag": "",
        "mix": [torch.zeros(3, dtype=torch.int64), 0],
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert (got["epoch"], got["tag"], got["mix"][1]) == (want["epoch"], want["tag"], want["mix"][1])
    assert torch.equal(got["mix"][0], want["mix"][0])


# -- checkpoint_id ----------------------------------------------------------------------------------------------
def test_a_step_directory_of_a_file_tier_names_the_step(h: Hierarchy, tmp_path: Path) -> None:
    sd = _model_state(1)
    dcp.save(sd, checkpoint_id=tmp_path / "pfs" / "step-7", storage_writer=HierarchyWriter(h, step=1))
    assert [c.step for c in h.checkpoints()] == [7]  # not the constructor's step 1
    got = _zeros_like(sd)
    padded = str(tmp_path / "ssd" / "step-000000000007")  # the directory the tier wrote, and a str
    dcp.load(got, checkpoint_id=padded, storage_reader=HierarchyReader(h))
    _assert_same(got, sd)
    assert (tmp_path / "pfs" / "step-000000000007").is_dir()


def test_a_file_tier_directory_keeps_the_given_step(h: Hierarchy, tmp_path: Path) -> None:
    sd, sd2 = _model_state(1), _model_state(2)
    dcp.save(sd, checkpoint_id=tmp_path / "ssd", storage_writer=HierarchyWriter(h, step=3))
    dcp.save(sd2, checkpoint_id=str(tmp_path / "pfs") + "/", storage_writer=HierarchyWriter(h, step=4))
    assert [c.step for c in h.checkpoints()] == [3, 4]
    got = _zeros_like(sd)
    dcp.load(got, checkpoint_id=tmp_path / "pfs", storage_reader=HierarchyReader(h, step=3))
    _assert_same(got, sd)
    got = _zeros_like(sd)
    dcp.load(got, checkpoint_id=tmp_path / "pfs", storage_reader=HierarchyReader(h))  # no step given: newest
    _assert_same(got, sd2)


@pytest.mark.parametrize(
    "where",
    [
        lambda tmp: tmp / "elsewhere" / "step-3",  # a step directory of no tier of the hierarchy
        lambda tmp: tmp / "pfs" / "checkpoint-3",  # under a tier, but not where the tier keeps step 3
        lambda tmp: tmp / "pfs" / "step-3" / "rank-00000",  # inside a step
        lambda tmp: tmp / "elsewhere",
        lambda tmp: "s3://bucket/ckpt/3",
        lambda tmp: "",
    ],
)
def test_a_path_that_is_not_the_hierarchys_is_refused(h: Hierarchy, tmp_path: Path, where: Any) -> None:
    cid = where(tmp_path)
    with pytest.raises(ValueError, match="names no step of this hierarchy") as e:
        dcp.save(_model_state(1), checkpoint_id=cid, storage_writer=HierarchyWriter(h, step=1))
    assert str(tmp_path / "pfs") in str(e.value)  # it says which paths would do
    with pytest.raises(ValueError, match="names no step of this hierarchy"):
        HierarchyReader(h).reset(cid)
    assert h.checkpoints() == []  # nothing was written under another step or place


def test_a_hierarchy_without_file_tiers_takes_steps_only(tmp_path: Path) -> None:
    with Hierarchy.from_config({"tiers": [{"name": "host", "kind": "host"}]}) as h:
        w = HierarchyWriter(h, step=1)
        with pytest.raises(ValueError, match="no file tier"):
            w.reset(tmp_path / "step-2")
        w.reset(2)
        assert w.step == 2 and w.checkpoint_id == "2"
        with pytest.raises(TypeError, match="checkpoint_id"):
            w.reset(2.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step"):
            w.reset(-1)  # type: ignore[arg-type]


def test_validate_checkpoint_id_accepts_the_forms_reset_takes() -> None:
    for ok in (0, 12, "12", "/any/dir", Path("rel/step-3")):
        assert HierarchyWriter.validate_checkpoint_id(ok) and HierarchyReader.validate_checkpoint_id(ok)  # type: ignore[arg-type]
    for bad in (-1, "-1", True, "", "s3://b/k", "abc://abc.abc", 1.5, None):
        assert not HierarchyWriter.validate_checkpoint_id(bad)  # type: ignore[arg-type]
        assert not HierarchyReader.validate_checkpoint_id(bad)  # type: ignore[arg-type]


# -- overwrite and storage_meta ---------------------------------------------------------------------------------
def test_overwrite_false_refuses_a_committed_step(h: Hierarchy) -> None:
    old, new = _model_state(1), _model_state(2)
    dcp.save(old, storage_writer=HierarchyWriter(h, step=5, overwrite=False))  # a new step: fine
    with pytest.raises(CheckpointException) as e:
        dcp.save(new, storage_writer=HierarchyWriter(h, step=5, overwrite=False))
    (err,) = (f[0] for f in e.value.failures.values())
    assert isinstance(err, StepExistsError) and isinstance(err, FileExistsError)
    assert "step 5 is already committed and overwrite=False" in str(err)
    got = _zeros_like(old)
    dcp.load(got, storage_reader=HierarchyReader(h, step=5))
    _assert_same(got, old)  # untouched
    dcp.save(new, storage_writer=HierarchyWriter(h, step=5))  # overwrite=True (DCP's default) replaces it
    dcp.load(got, storage_reader=HierarchyReader(h, step=5))
    _assert_same(got, new)


def test_storage_meta_names_the_step_and_the_save(h: Hierarchy) -> None:
    w = HierarchyWriter(h, step=1)
    dcp.save(_model_state(1), checkpoint_id="9", storage_writer=w)
    sm = HierarchyReader(h, step=9).read_metadata().storage_meta
    assert sm is not None and (sm.checkpoint_id, sm.save_id) == ("9", w.save_id)
    assert w.storage_meta().checkpoint_id == "9"


def test_the_per_rank_record_of_the_coordinator_is_the_jobs(h: Hierarchy) -> None:
    dcp.save(_model_state(1), storage_writer=HierarchyWriter(h, step=1))
    md = HierarchyReader(h, step=1).read_metadata(rank=0)  # its part holds the job's record: that one
    assert "model.0.weight" in md.state_dict_metadata


# -- format utilities -------------------------------------------------------------------------------------------
def test_dcp_to_torch_save_matches_dcps_own(h: Hierarchy, tmp_path: Path) -> None:
    sd = _model_state(3)
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=2))
    dcp.save(sd, checkpoint_id=tmp_path / "fs")  # DCP's own file-system checkpoint of the same state
    dcp_to_torch_save(h, tmp_path / "ours.pt", step=2)
    format_utils.dcp_to_torch_save(tmp_path / "fs", tmp_path / "theirs.pt")
    ours, theirs = torch.load(tmp_path / "ours.pt"), torch.load(tmp_path / "theirs.pt")
    assert ours.keys() == theirs.keys() == {"model", "epoch", "tag", "mix"}
    _assert_same(ours, sd)
    _assert_same(theirs, sd)
    dcp_to_torch_save(h, tmp_path / "newest.pt")  # step=None: the newest
    _assert_same(torch.load(tmp_path / "newest.pt"), sd)


def test_torch_save_to_dcp_then_load(h: Hierarchy, tmp_path: Path) -> None:
    sd = _model_state(4)
    torch.save(sd, tmp_path / "in.pt")
    torch_save_to_dcp(tmp_path / "in.pt", h, step=6)
    got = _zeros_like(sd)
    dcp.load(got, storage_reader=HierarchyReader(h, step=6))
    _assert_same(got, sd)
    with pytest.raises(CheckpointException):  # overwrite stays DCP's default (True) only through the writer
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=6, overwrite=False))


def test_the_reader_of_a_step_not_saved_through_dcp_says_so(h: Hierarchy, tmp_path: Path) -> None:
    h.save({"t": torch.ones(2)}, step=1).wait()
    with pytest.raises(CheckpointException, match="not written through DCP"):
        dcp_to_torch_save(h, tmp_path / "x.pt", step=1)
