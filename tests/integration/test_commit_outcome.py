"""A commit whose outcome a rank cannot know: rank 0 took the decision up (it may have written the
step's record on the shared tier) and then published nothing in time. The rank keeps its copy: if the
record is there the step is committed and listed (evicting the copy would leave a record naming a
copy that is gone); if no record ever comes, the copy is an orphan that the next retention pass
removes. When rank 0 never took the decision up, the copy goes at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.errors import CoordinationError
from tierckpt.io.engine import make_engine
from tierckpt.ranks.coordinator import SoloCoordinator
from tierckpt.tiers.pfs import PfsTier

T = TypeVar("T")
LOST = 2  # the step whose commit loses rank 0


class Rank0Lost(SoloCoordinator):
    """This process is rank 1 of 2; rank 0 sent the same copy's tag and decides as this rank would,
    except for step ``LOST``'s commit: it decides (``wrote``: the record is written) or not, then is
    never heard of again."""

    connects_ranks = True  # it stands for a coordinator the ranks agree through

    def __init__(self, wrote: bool, undecided: bool) -> None:
        super().__init__(rank=1, world_size=2)
        self.wrote, self.undecided = wrote, undecided

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], timeout: float | None = None) -> T:
        if key.startswith(f"commit/pfs/{LOST}/"):
            if self.wrote:
                fn([value, value])  # rank 0's decision: writes the record on the shared tier
            raise CoordinationError(f"{key!r}: rank 0 published no outcome", (0,), undecided=self.undecided)
        return fn([value, value])


def _hierarchy(tmp_path: Path, coord: SoloCoordinator) -> Hierarchy:
    return Hierarchy([PfsTier("pfs", tmp_path / "pfs", make_engine("threads", 2))], coordinator=coord)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(step))}


def _save_lost(h: Hierarchy) -> None:
    h.save(_state(1), step=1).wait()
    with pytest.raises(CoordinationError, match="rank 0 published no outcome") as e:
        h.save(_state(LOST), step=LOST).wait()
    assert e.value.ranks == (0,)


def test_an_unknown_outcome_whose_record_was_written_is_a_committed_step(tmp_path: Path) -> None:
    with _hierarchy(tmp_path, Rank0Lost(wrote=True, undecided=True)) as h:
        _save_lost(h)
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, LOST]
        assert torch.equal(h.restore()["w"], _state(LOST)["w"])
    with _hierarchy(tmp_path, Rank0Lost(wrote=False, undecided=False)) as h:  # the job restarted
        h.save(_state(3), step=3).wait()
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, LOST, 3]
        assert torch.equal(h.restore(step=LOST)["w"], _state(LOST)["w"])


def test_an_unknown_outcome_without_a_record_leaves_an_orphan_that_retention_removes(tmp_path: Path) -> None:
    copy = tmp_path / "pfs" / f"step-{LOST:012d}" / "rank-00001"
    with _hierarchy(tmp_path, Rank0Lost(wrote=False, undecided=True)) as h:
        _save_lost(h)
        assert copy.is_dir()  # kept: rank 0 may have written the record
        assert [c.step for c in h.checkpoints() if c.tiers] == [1]
        h.save(_state(3), step=3).wait()  # its retention pass finds no record: an orphan
        assert not copy.parent.exists()
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, 3]


def test_a_failure_rank_0_never_took_up_removes_the_copy_at_once(tmp_path: Path) -> None:
    with _hierarchy(tmp_path, Rank0Lost(wrote=False, undecided=False)) as h:
        _save_lost(h)
        assert not (tmp_path / "pfs" / f"step-{LOST:012d}").exists()
        assert [c.step for c in h.checkpoints() if c.tiers] == [1]


class Rank0Stuck(SoloCoordinator):
    """Rank 1 of 2, whose rank 0 took up step ``LOST``'s decision and is stuck in it (writing the record
    on a slow file system): this rank gets an unknown outcome, then step ``LOST + 1``'s commit fails
    because rank 0 does not answer (it is still busy), until :meth:`recover` finishes the decision."""

    connects_ranks = True  # it stands for a coordinator the ranks agree through

    def __init__(self) -> None:
        super().__init__(rank=1, world_size=2)
        self.stuck: Callable[[], Any] | None = None

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], timeout: float | None = None) -> T:
        if key.startswith(f"commit/pfs/{LOST}/"):
            self.stuck = lambda: fn([value, value])
            raise CoordinationError(f"{key!r}: rank 0 published no outcome", (0,), undecided=True)
        if self.stuck is not None and key.startswith("commit/pfs/"):
            raise CoordinationError(f"{key!r}: rank 0 did not answer", (0,))
        return fn([value, value])

    def recover(self) -> None:
        assert self.stuck is not None
        self.stuck()
        self.stuck = None


def test_an_unknown_outcome_stays_unknown_until_rank_0_publishes_a_later_commit(tmp_path: Path) -> None:
    """A later commit that fails because rank 0 is still busy says nothing about the earlier one: the
    copy stays; once rank 0 has written the record and decided a later commit, the step is committed."""
    copy = tmp_path / "pfs" / f"step-{LOST:012d}" / "rank-00001"
    coord = Rank0Stuck()
    with _hierarchy(tmp_path, coord) as h:
        _save_lost(h)
        with pytest.raises(CoordinationError, match="rank 0 did not answer"):
            h.save(_state(LOST + 1), step=LOST + 1).wait()
        assert copy.is_dir()  # its retention pass must not take it for an orphan: rank 0 is still at it
        coord.recover()  # rank 0 writes step LOST's record
        h.save(_state(LOST + 2), step=LOST + 2).wait()
        assert [c.step for c in h.checkpoints() if c.tiers] == [1, LOST, LOST + 2]
        assert torch.equal(h.restore(step=LOST)["w"], _state(LOST)["w"])
