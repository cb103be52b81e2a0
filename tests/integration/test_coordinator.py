"""The coordination seam: the decisions every rank must share come from the hierarchy's Coordinator
(which step to restore, where a save goes, what a shared tier evicts); the hierarchy follows them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.errors import CheckpointNotFoundError, ConfigError
from tierckpt.io.engine import make_engine
from tierckpt.ranks.coordinator import Coordinator, SoloCoordinator
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.pfs import PfsTier

T = TypeVar("T")


class Rank0Says(SoloCoordinator):
    """A coordinator whose deciding rank (not this one) answers differently: ``step`` for the agreed
    step, ``override`` to rewrite decided results."""

    connects_ranks = True  # it stands for a coordinator the ranks agree through

    def __init__(self, step: int | None = -1, override: Callable[[Any], Any] | None = None) -> None:
        super().__init__(rank=1, world_size=2)
        self.step, self.override = step, override
        self.decisions: list[tuple[str, Any]] = []
        self.asked: list[int | None] = []

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        self.asked.append(newest)
        return newest if self.step == -1 else self.step

    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        out = fn()
        if self.override is not None:
            out = self.override(out)
        self.decisions.append((key, out))
        return out

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], timeout: float | None = None) -> T:
        """Rank 0 sent what this rank sent (the same copy), and its result is this rank's."""
        return self.decide(key, lambda: fn([value] * self.world_size), timeout)


def test_the_solo_coordinator_is_a_coordinator_and_checks_its_rank() -> None:
    c = SoloCoordinator(rank=0, world_size=1)
    assert isinstance(c, Coordinator)
    assert c.decide("k", lambda: 3) == 3 and c.agree_step(5) == 5 and c.all_gather("x") == ["x"]
    with pytest.raises(ConfigError, match=r"rank: 2 is not in \[0, 2\)"):
        SoloCoordinator(rank=2, world_size=2)


def test_every_rank_restores_the_step_the_ranks_agreed_on(tmp_path: Path) -> None:
    coord = Rank0Says(step=1)
    with Hierarchy([HostTier("host")], coordinator=coord) as h:
        for s in (1, 2):
            h.save({"s": torch.tensor([s])}, step=s).wait()
        assert h.restore()["s"].item() == 1 and h.last_restore == (1, "host")
        coord.step = None  # another rank has nothing
        with pytest.raises(CheckpointNotFoundError, match="some rank of the job has no committed checkpoint"):
            h.restore()
        assert h.restore(step=2)["s"].item() == 2  # an explicit step is not negotiated


def test_where_a_save_goes_by_the_clock_is_the_deciding_ranks_plan(tmp_path: Path) -> None:
    def top_only(now: Any) -> Any:  # the deciding rank's clock said the pfs is not due
        return -1e9 if isinstance(now, float) else now

    coord = Rank0Says(override=top_only)
    pfs = PfsTier("pfs", tmp_path / "pfs", make_engine("threads", 2))
    policy = {"demote": {"pfs": {"every_secs": 0.001}}}
    with Hierarchy([HostTier("host"), pfs], policy=policy, coordinator=coord) as h:
        handle = h.save({"w": torch.ones(4)}, step=1)
        handle.wait()
        assert list(handle.durable) == ["host"]
        assert [c.tiers for c in h.checkpoints()] == [("host",)]
    assert [k for k, d in coord.decisions if isinstance(d, float)] == ["save/1/1"]  # the clock, decided once


def test_a_plan_from_counts_alone_is_made_by_each_rank(tmp_path: Path) -> None:
    coord = Rank0Says()
    pfs = PfsTier("pfs", tmp_path / "pfs", make_engine("threads", 2))
    with Hierarchy([HostTier("host"), pfs], policy={"demote": {"pfs": {"every": 2}}}, coordinator=coord) as h:
        for s in (1, 2):
            h.save({"w": torch.ones(4)}, step=s).wait()
    assert not [k for k, _ in coord.decisions if k.startswith("save/")]  # no collective per save


def test_ranks_agree_again_when_one_fell_back_to_an_older_step(tmp_path: Path) -> None:
    """This rank reads its newest step 3; another rank could only read step 2: all restore step 2."""

    class OtherRankFellBack(Rank0Says):
        def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
            self.asked.append(newest)
            return newest if len(self.asked) == 1 else 2

    coord = OtherRankFellBack()
    with Hierarchy([HostTier("host")], coordinator=coord) as h:
        for s in (1, 2, 3):
            h.save({"s": torch.tensor([s])}, step=s).wait()
        assert h.restore()["s"].item() == 2 and h.last_restore == (2, "host")
    assert coord.asked == [3, 3, 2]  # and once more: every rank read step 2 (else they go further back)


def test_what_a_shared_tier_evicts_is_the_deciding_ranks_plan(tmp_path: Path) -> None:
    """Rank 0 decides the shared tier's evictions and sends them with a commit's outcome: this rank,
    whose own window keeps every step, evicts what rank 0 said, with no collective of its own."""

    class Rank0EvictsStep1(Rank0Says):
        def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], timeout: float | None = None) -> T:
            out: Any = super().gather(key, value, fn, timeout)
            if key.startswith("commit/pfs/3/"):
                out = {**out, "evict": [["pfs", 1]]}
            return out  # type: ignore[no-any-return]  # what rank 0 sent

    coord = Rank0EvictsStep1()
    pfs = PfsTier("pfs", tmp_path / "pfs", make_engine("threads", 2))
    with Hierarchy([HostTier("host"), pfs], policy={"keep": {"host": 1, "pfs": 3}}, coordinator=coord) as h:
        for s in (1, 2, 3):
            h.save({"s": torch.tensor([s])}, step=s).wait()
        on = {n: [c.step for c in h.checkpoints() if n in c.tiers] for n in ("host", "pfs")}
    assert on == {"host": [3], "pfs": [2, 3]}  # the host (not shared) follows its own window
    keys = [k for k, _ in coord.decisions]
    assert keys and all(k.startswith("commit/") for k in keys)  # one gather per tier commit, nothing else


# -- what a coordinator declares ------------------------------------------------------------------------------
class _Bare:
    """A third-party coordinator written before ``connects_ranks``: the calls and the identity only."""

    rank, world_size, node, local_rank = 0, 1, 0, 0

    def ranks_on_node(self) -> list[int]:
        return [0]

    def barrier(self, timeout: float | None = None) -> None:
        pass

    def broadcast(self, obj: T, src: int = 0, timeout: float | None = None) -> T:
        return obj

    def all_gather(self, obj: T, timeout: float | None = None) -> list[T]:
        return [obj]

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        return newest

    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        return fn()

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], timeout: float | None = None) -> T:
        return fn([value])


def test_a_coordinator_declares_whether_it_connects_the_ranks(tmp_path: Path) -> None:
    assert SoloCoordinator(0, 2).connects_ranks is False
    assert Rank0Says().connects_ranks is True

    class Declared(_Bare):
        connects_ranks = False

    class Unsure(_Bare):
        connects_ranks = "yes"

    Hierarchy([HostTier("host")], coordinator=Declared()).close()
    with pytest.raises(ConfigError, match=r"Unsure.connects_ranks is 'yes', not True or False"):
        Hierarchy([HostTier("host")], coordinator=cast(Coordinator, Unsure()))


def test_a_coordinator_written_before_connects_ranks_keeps_working_with_a_deprecation_warning(
    tmp_path: Path,
) -> None:
    cfg = {"tiers": [{"name": "host", "kind": "host"}]}
    for build in (
        lambda c: Hierarchy([HostTier("host")], coordinator=c),
        lambda c: Hierarchy.from_config(cfg, coordinator=c),  # checked twice (the parts, the hierarchy): warns once
        lambda c: Hierarchy([HostTier("host")], coordinator=c, readonly=True),
    ):
        bare = _Bare()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            h = build(cast(Coordinator, bare))
        h.close()
        assert [(w.category, w.filename) for w in got] == [(DeprecationWarning, __file__)]  # the user's line
        assert "_Bare does not declare connects_ranks; it is taken as False (it has 1 ranks)" in str(got[0].message)
        assert h.coordinator is bare and h.coordinator.connects_ranks is False

    class Slotted(_Bare):  # takes no new attribute: a wrapper declares it, and forwards every call
        __slots__ = ()

    with pytest.warns(DeprecationWarning, match="Slotted does not declare connects_ranks"):
        h = Hierarchy([HostTier("host")], coordinator=cast(Coordinator, Slotted()))
    with h:
        h.save({"w": torch.ones(2)}, step=1).wait()
        assert h.coordinator.connects_ranks is False and h.coordinator.agree_step(3) == 3
        assert [c.step for c in h.checkpoints()] == [1] and repr(h.coordinator).startswith("<")


class _Legacy:
    """A third-party coordinator of the previous release (no ``connects_ranks``): its own class, which
    agrees through a store-based coordinator it holds."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank, self.world_size, self.node, self.local_rank = inner.rank, inner.world_size, 0, inner.rank

    def ranks_on_node(self) -> list[int]:
        return list(range(self.world_size))

    def barrier(self, timeout: float | None = None) -> None:
        self.inner.barrier(timeout)

    def broadcast(self, obj: T, src: int = 0, timeout: float | None = None) -> T:
        return cast(T, self.inner.broadcast(obj, src, timeout))

    def all_gather(self, obj: T, timeout: float | None = None) -> list[T]:
        return cast("list[T]", self.inner.all_gather(obj, timeout))

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        return cast("int | None", self.inner.agree_step(newest, timeout))

    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        return cast(T, self.inner.decide(key, fn, timeout))

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], timeout: float | None = None) -> T:
        return cast(T, self.inner.gather(key, value, fn, timeout))


def test_two_ranks_on_a_coordinator_written_before_connects_ranks_commit_as_before(
    tmp_path: Path, coordinators: Callable[..., list[Any]], run_ranks: Callable[..., list[Any]]
) -> None:
    legacy = [_Legacy(c) for c in coordinators(2)]
    cfg = {"tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")}]}

    def rank(r: int) -> tuple[Any, ...]:
        with Hierarchy.from_config(cfg, coordinator=cast(Coordinator, legacy[r]), job="j") as h:
            for s in (1, 2):
                h.save({"r": torch.tensor([r, s])}, step=s).wait()
            listed = [(c.step, c.tiers) for c in h.checkpoints()]
            return h.coordinator.connects_ranks, listed, h.restore()["r"].tolist()

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = run_ranks(2, rank)
    assert out == [(True, [(1, ("host", "pfs")), (2, ("host", "pfs"))], [r, 2]) for r in range(2)], out
    assert [w.category for w in got] == [DeprecationWarning] * 2  # once a rank
    assert "it is taken as True (it has 2 ranks, so they are taken to agree through it)" in str(got[0].message)
    steps = sorted((tmp_path / "pfs").glob("step-*"))
    assert len(steps) == 2
    for step in steps:  # each step's commit record, with both ranks' copies
        assert sorted(p.name for p in step.iterdir()) == ["commit", "rank-00000", "rank-00001"], step


def test_a_subclass_of_the_solo_coordinator_connects_no_ranks_unless_it_says_so(tmp_path: Path) -> None:
    class Alone(SoloCoordinator):  # inherits connects_ranks=False: its ranks share nothing
        pass

    with pytest.raises(ConfigError, match="nothing connects these ones"):
        Hierarchy([HostTier("host")], coordinator=Alone(1, 2))
    Hierarchy([HostTier("host")], coordinator=Alone(1, 2), readonly=True).close()  # a reader needs none
    Hierarchy([HostTier("host")], coordinator=Rank0Says()).close()  # a subclass that says it connects them
