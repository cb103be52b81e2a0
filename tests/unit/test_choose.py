"""The rules that pick which copy and step a restore reads (tierckpt.facade.choose), and the job that
follows them (tierckpt.facade.restorejob) on synthetic listings and reads: no I/O."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest

from tierckpt.background.catalog import CheckpointInfo
from tierckpt.datapath.manifests import UnnamedCopyError
from tierckpt.errors import (
    CheckpointEvictedError,
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    StateError,
    TierIOError,
)
from tierckpt.facade.choose import (
    LOOK_AGAIN,
    MAX_LOOKS,
    MAX_STALE_LOOKS,
    Again,
    Done,
    GiveUp,
    Kind,
    LookAgain,
    Next,
    Stop,
    TooMany,
    after_copies,
    after_round,
    backoff,
    kind_of,
    name_failures,
    proposal,
    unusable,
)
from tierckpt.facade.restorejob import RestoreJob
from tierckpt.ranks.coordinator import SoloCoordinator

WHERE = "rank 0 on any tier"


def choose_and_read(
    listing: Callable[[], list[CheckpointInfo]], read: Callable[[int, str], Any], step: int | None, where: str
) -> tuple[Any, int, str]:
    """One rank's restore of ``step`` (None: the newest that restores) with these listings and reads."""
    job = RestoreJob(lambda s, t, _: read(s, t), listing, SoloCoordinator(0, 1), where=where)
    return job.run(step)


def listing_of(*snapshots: dict[int, tuple[str, ...]]) -> Callable[[], list[CheckpointInfo]]:
    """A listing that returns each snapshot in turn (the last one for ever after)."""
    calls = [0]

    def listing() -> list[CheckpointInfo]:
        snap = snapshots[min(calls[0], len(snapshots) - 1)]
        calls[0] += 1
        return [CheckpointInfo(s, t) for s, t in sorted(snap.items())]

    return listing


def reads(outcomes: dict[tuple[int, str], list[Any]]) -> Callable[[int, str], Any]:
    """``read(step, tier)`` popping the next outcome (an exception is raised, a value returned)."""

    def read(step: int, tier: str) -> Any:
        out = outcomes[(step, tier)].pop(0) if len(outcomes[(step, tier)]) > 1 else outcomes[(step, tier)][0]
        if isinstance(out, BaseException):
            raise out
        return out

    return read


def gone() -> CheckpointEvictedError:
    return CheckpointEvictedError("evicted while being opened")


def test_a_copy_that_goes_away_makes_the_choice_start_over() -> None:
    listing = listing_of({5: ("ssd", "pfs")}, {6: ("ssd", "pfs")})
    read = reads({(5, "ssd"): [gone()], (5, "pfs"): [gone()], (6, "ssd"): ["six"]})
    assert choose_and_read(listing, read, None, WHERE) == ("six", 6, "ssd")


def test_an_explicit_step_evicted_while_opened_is_not_found_and_says_so() -> None:
    listing = listing_of({5: ("ssd",)}, {6: ("ssd",)})
    with pytest.raises(CheckpointEvictedError, match=r"step 5 was evicted or replaced .* now: \[6\]"):
        choose_and_read(listing, reads({(5, "ssd"): [gone()]}), 5, WHERE)


def test_an_explicit_step_saved_again_while_opened_is_read_again() -> None:
    listing = listing_of({5: ("ssd",)})
    assert choose_and_read(listing, reads({(5, "ssd"): [gone(), "new five"]}), 5, WHERE) == ("new five", 5, "ssd")


def test_looking_again_is_bounded() -> None:
    listing = listing_of({5: ("ssd",)})
    with pytest.raises(CheckpointEvictedError, match=f"{MAX_LOOKS} times in a row"):
        choose_and_read(listing, reads({(5, "ssd"): [gone()]}), None, WHERE)


def test_a_damaged_copy_beside_one_that_went_away_is_looked_at_again() -> None:
    bad = CorruptCheckpointError("checksum mismatch", tier="ssd", step=5)
    listing = listing_of({5: ("ssd", "pfs")})
    read = reads({(5, "ssd"): [bad, "five"], (5, "pfs"): [gone()]})
    assert choose_and_read(listing, read, None, WHERE) == ("five", 5, "ssd")


def test_io_errors_are_not_called_damage() -> None:
    listing = listing_of({5: ("ssd", "pfs")})
    eio = TierIOError(errno.EIO, "tier 'ssd': cannot read")
    bad = CorruptCheckpointError("checksum mismatch", tier="pfs", step=5)
    with pytest.raises(TierIOError) as ei:
        choose_and_read(listing, reads({(5, "ssd"): [eio], (5, "pfs"): [bad]}), 5, WHERE)
    assert not isinstance(ei.value, CorruptCheckpointError) and ei.value.errno == errno.EIO
    assert "tier 'ssd': [Errno 5] tier 'ssd': cannot read" in str(ei.value) and "tier 'pfs': checksum mismatch" in str(
        ei.value
    )


def test_nothing_committed() -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint for rank 0 on any tier"):
        choose_and_read(listing_of({}), reads({}), None, WHERE)
    with pytest.raises(CheckpointNotFoundError, match=r"step 4 is not committed \(committed steps: \[5\]\)"):
        choose_and_read(listing_of({5: ("ssd",)}), reads({}), 4, WHERE)


# -- the pure rules -----------------------------------------------------------------------------------------
def unnamed() -> UnnamedCopyError:
    return UnnamedCopyError("ssd", 5, 0, 2)


def test_what_a_failure_says_about_a_copy() -> None:
    assert kind_of(CorruptCheckpointError("x")) is Kind.DAMAGED
    assert kind_of(TierIOError(errno.EIO, "x")) is Kind.UNREADABLE
    assert kind_of(gone()) is Kind.GONE and kind_of(CheckpointNotFoundError("x")) is Kind.GONE
    assert kind_of(unnamed()) is Kind.UNNAMED
    assert kind_of(StateError("target mismatch")) is None and kind_of(MemoryError()) is None


def test_after_every_copy_failed() -> None:
    bad = ("pfs", CorruptCheckpointError("x"))
    assert after_copies([bad], 0, 0, may_commit=True) == GiveUp()
    assert after_copies([("ssd", gone()), bad], 3, 0, may_commit=False) == LookAgain(backoff(4), stale=False)
    assert after_copies([("ssd", gone())], MAX_LOOKS, 0, may_commit=False) == TooMany()
    # a copy the record does not name: looked at again only where another process may be saving the step
    assert after_copies([("ssd", unnamed()), bad], 0, 0, may_commit=False) == GiveUp()
    assert after_copies([("ssd", unnamed()), bad], 0, 2, may_commit=True) == LookAgain(backoff(3), stale=True)
    assert after_copies([("ssd", unnamed())], 0, MAX_STALE_LOOKS, may_commit=True) == GiveUp()
    assert [backoff(n) for n in (1, 2, 3, 7, 8, 50)] == [0.005, 0.01, 0.02, 0.2, 0.2, 0.2]


def test_what_a_rank_proposes_after_a_step() -> None:
    assert proposal(5, True, [3, 5], {}, gone=False) == 5
    assert proposal(5, False, [2, 3, 5, 7], {3: []}, gone=False) == 2  # older, not skipped (7 is newer)
    assert proposal(5, False, [5, 7], {}, gone=False) is None
    assert proposal(5, False, [7], {}, gone=True) == LOOK_AGAIN


def test_what_the_agreement_means() -> None:
    assert after_round(5, 5) == Done()  # the smallest proposal is the step only where every rank read it
    assert after_round(5, 3) == Next(3)
    assert after_round(5, LOOK_AGAIN) == Again()
    assert after_round(5, None) == Stop()
    assert name_failures([None, "E: one", None, "E: three"]) == {
        "ranks": [1, 3],
        "said": "rank 1: E: one; rank 3: E: three",
    }


def test_the_error_of_an_unusable_step_says_what_it_is() -> None:
    damage = CorruptCheckpointError("checksum mismatch", tier="ssd", step=5, blob="b", key="k", rank=1)
    eio = TierIOError(errno.EIO, "cannot read")
    assert unusable(5, [("ssd", damage)], [5]) is damage  # one failure, nothing else to say
    both = unusable(5, [("ssd", damage), ("pfs", damage)], [4, 5])
    assert isinstance(both, CorruptCheckpointError) and (both.tier, both.key, both.rank) == ("ssd", "k", 1)
    assert "older committed steps: [4]" in str(both)
    io = unusable(5, [("ssd", damage), ("pfs", eio)], [5])
    assert isinstance(io, TierIOError) and not isinstance(io, CorruptCheckpointError) and io.errno == errno.EIO
    stale = unusable(5, [("ssd", damage), ("pfs", unnamed())], [5])  # a copy that is whole: not damage
    assert type(stale) is CheckpointNotFoundError and "is not the one the step's commit record names" in str(stale)


# -- every rank the same step (ranks as threads, a StoreCoordinator on an in-process store) ------------------
def run_job(
    copies: list[dict[int, dict[str, Any]]], listed: list[list[int]] | None = None
) -> list[tuple[Any, int, str] | BaseException]:
    """Each rank's restore (no step given) of the steps ``listed`` (default: those in ``copies``), each
    ``copies[rank][step][tier]`` a value or an exception."""
    import threading

    import torch.distributed as dist

    from tierckpt.ranks.distributed import StoreCoordinator

    n, store = len(copies), dist.HashStore()
    out: list[Any] = [None] * n

    def one(r: int) -> None:
        steps = listed[r] if listed else sorted(copies[r])
        infos = [CheckpointInfo(s, tuple(copies[r].get(s, {"ssd": None}))) for s in steps]

        def read(s: int, t: str, _: Any) -> Any:
            got = copies[r][s][t]
            if isinstance(got, BaseException):
                raise got
            return got

        try:
            c = StoreCoordinator(store, r, n, timeout=20.0)
            out[r] = RestoreJob(read, lambda: infos, c, where=f"rank {r} on any tier").run()
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def bad(step: int) -> CorruptCheckpointError:
    return CorruptCheckpointError("checksum mismatch", tier="pfs", step=step)


def test_a_rank_that_cannot_read_the_step_another_fell_back_to_takes_the_job_further_back() -> None:
    """Finding 6 (b): rank 1 cannot read step 3, rank 0 not step 2: both restore step 1."""
    got = run_job([
        {1: {"pfs": "r0s1"}, 2: {"pfs": bad(2)}, 3: {"pfs": "r0s3"}},
        {1: {"pfs": "r1s1"}, 2: {"pfs": "r1s2"}, 3: {"pfs": bad(3)}},
    ])  # fmt: skip
    assert got == [("r0s1", 1, "pfs"), ("r1s1", 1, "pfs")]


def test_ranks_whose_listings_differ_go_back_together() -> None:
    """Finding 6 (a): rank 0 lists step 4, rank 1 only 3, which rank 0 cannot read: both restore 2."""
    got = run_job([
        {2: {"pfs": "r0s2"}, 3: {"ssd": TierIOError(errno.ENOENT, "no tier holds rank 1's copy")}, 4: {"ssd": "x"}},
        {2: {"pfs": "r1s2"}, 3: {"ssd": "r1s3"}},
    ])  # fmt: skip
    assert got == [("r0s2", 2, "pfs"), ("r1s2", 2, "pfs")]


def test_a_rank_with_nothing_left_stops_every_rank_naming_it() -> None:
    got = run_job([{1: {"pfs": "r0s1"}, 2: {"pfs": "r0s2"}}, {1: {"pfs": bad(1)}, 2: {"pfs": bad(2)}}])
    assert isinstance(got[1], CorruptCheckpointError) and str(got[1]).startswith("step 2 is unusable on every tier")
    assert isinstance(got[0], CoordinationError) and got[0].ranks == (1,)
    assert "rank 1: CorruptCheckpointError: step 2 is unusable on every tier" in str(got[0])


def test_a_rank_whose_restore_fails_otherwise_stops_every_rank_naming_it() -> None:
    got = run_job([{1: {"pfs": "r0s1"}}, {1: {"pfs": StateError("target['w']: shape differs")}}])
    assert isinstance(got[1], StateError)
    assert isinstance(got[0], CoordinationError) and "rank 1: StateError: target['w']: shape differs" in str(got[0])
