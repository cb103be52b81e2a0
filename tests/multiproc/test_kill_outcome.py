"""Whether a rank that gave up on rank 0 can know the outcome: when rank 0 took the call up (claimed it)
and then published nothing in time, it may have decided (a commit's record written) before it died or
while it was stuck, so the others' ``CoordinationError`` says ``undecided``; when rank 0 never took it
up, it never runs the decision, and the error says so (``undecided`` False)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from test_coordinator_threads import coordinators, run_ranks  # tests/multiproc/

from tierckpt.errors import CoordinationError


def test_rank_0_stuck_in_its_decision_leaves_the_outcome_unknown_to_the_others() -> None:
    cs = coordinators(3, timeout=0.3)
    back, gave_up = threading.Event(), threading.Barrier(2)

    def decide(values: list[Any]) -> int:  # rank 0, stuck past the others' two waits, then done
        back.wait(10)
        return sum(values)

    def body(r: int) -> Any:
        if r == 0:
            return cs[0].gather("commit/pfs/5/1", 0, decide)
        t0 = time.monotonic()
        with pytest.raises(CoordinationError) as e:
            cs[r].gather("commit/pfs/5/1", r, decide)
        gave_up.wait(10)  # both others gave up before rank 0 publishes
        if r == 1:
            back.set()
        assert e.value.ranks == (0,) and e.value.undecided, e.value
        assert "rank 0 arrived but published no outcome" in str(e.value)
        assert time.monotonic() - t0 < 5
        return "gave up"

    assert run_ranks(3, body) == [3, "gave up", "gave up"]  # rank 0 did decide


def test_rank_0_that_never_came_is_a_decided_failure() -> None:
    cs = coordinators(3, timeout=0.3)

    def body(r: int) -> Any:
        if r == 0:
            return None
        with pytest.raises(CoordinationError) as e:
            cs[r].gather("commit/pfs/6/1", r, sum)
        assert e.value.ranks == (0,) and not e.value.undecided, e.value
        return "failed"

    assert run_ranks(3, body) == [None, "failed", "failed"]
