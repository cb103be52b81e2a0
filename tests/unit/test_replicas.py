"""The plan of the replicated reads (datapath/replicas.py): pieces, and rank 0's verdict."""

from __future__ import annotations

from tierckpt.datapath.replicas import _bounds, _holds, _judge


def test_pieces_are_near_equal_ranges_of_consecutive_members() -> None:
    assert _bounds(10, 4, 0, 4) == (0, 3, 6, 8, 10)
    assert _bounds(10, 2, 1, 4) == (0, 0, 5, 10, 10)  # members 1 and 2 read, 0 and 3 nothing
    assert _bounds(7, 1, 3, 4) == (0, 0, 0, 0, 7)  # one member reads it all
    assert _bounds(2, 2, 0, 2) == (0, 1, 2)


def test_a_stored_box_holds_a_target_box_only_when_it_contains_it() -> None:
    assert _holds(((4, 6), (0, 0)), ((2, 6), (2, 0)))
    assert not _holds(((4, 6), (0, 0)), ((2, 6), (3, 0)))
    assert not _holds(((4, 3), (0, 0)), ((4, 6), (0, 0)))
    assert not _holds(None, ((1,), (0,)))


def _ok(step: int = 3, groups: list[list[int]] | None = None) -> dict[str, object]:
    return {"ok": True, "step": step, "groups": groups if groups is not None else [[11, 2, 5]]}


def test_the_verdict_names_the_ranks_that_failed_with_their_errors() -> None:
    v = _judge([_ok(), {"ok": False, "err": "CorruptCheckpointError: bad chunk"}, _ok()])
    assert v["ranks"] == [1] and not v["go"]
    assert v["err"] == "rank(s) 1 could not read their part: rank 1: CorruptCheckpointError: bad chunk"


def test_ranks_that_read_different_steps_exchange_nothing() -> None:
    assert _judge([_ok(3), _ok(2)]) == {"go": False, "err": None, "ranks": []}


def test_ranks_that_plan_different_exchanges_are_refused_before_any_collective() -> None:
    assert _judge([_ok(), _ok()]) == {"go": True, "err": None, "ranks": []}
    v = _judge([_ok(), _ok(groups=[[11, 2, 6]])])  # one group, two plans
    assert v["ranks"] == [1] and v["err"].endswith("rank(s) 1 plan other exchanges than ranks 0 of their group")
    v = _judge([_ok(), _ok(groups=[]), _ok(groups=[[12, 1, 0]])])  # rank 1 plans nothing for group 11
    assert v["ranks"] == [0] and not v["go"]
    assert v["err"] == (
        "the ranks' targets differ in their replicated DTensors: ranks 0 plan an exchange among 2 ranks that only they plan"
    )
