"""The rules that pick which copy a restore reads (tierckpt.facade.choose), on synthetic listings: no I/O."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest

from tierckpt.background.catalog import CheckpointInfo
from tierckpt.errors import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, TierIOError
from tierckpt.facade.choose import MAX_RELISTS, choose_and_read

WHERE = "rank 0 on any tier"


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
    with pytest.raises(CheckpointEvictedError, match=f"{MAX_RELISTS} times in a row"):
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
