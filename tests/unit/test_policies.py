"""The pure policy objects: demotion cadence, retention, eviction safety, capacity victims."""

from __future__ import annotations

import pytest

from tierckpt.policies import (
    AnyOf,
    Cadence,
    Demotion,
    Every,
    EverySecs,
    KeepAll,
    KeepLatest,
    Never,
    capacity_victims,
    plan_evictions,
)


def run_cadence(rule: Demotion, times: list[float]) -> list[bool]:
    """Drive a rule the way the hierarchy does: count saves and seconds since the last one sent."""
    saves, last, out = 0, 0.0, []
    for now in times:
        saves += 1
        due = rule.rule.due(Cadence(saves, now - last))
        out.append(due)
        if due:
            saves, last = 0, now
    return out


def test_every_n_saves() -> None:
    assert run_cadence(Demotion(Every(5)), [float(i) for i in range(1, 11)]) == [False] * 4 + [True] + [False] * 4 + [
        True
    ]
    assert all(run_cadence(Demotion(), [1.0, 2.0, 3.0]))  # default: every save


def test_every_secs_and_any_of() -> None:
    times = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    assert run_cadence(Demotion(EverySecs(25)), times) == [False, False, True, False, False, True, False]
    either = Every(2) | EverySecs(25)
    assert isinstance(either, AnyOf)
    assert run_cadence(Demotion(either), times) == [False, True, False, True, False, True, False]
    assert not any(run_cadence(Demotion(Never()), times))


def test_from_settings_matches_the_yaml_keys() -> None:
    assert Demotion.from_settings() == Demotion(Every(1), False)
    assert Demotion.from_settings(every=5) == Demotion(Every(5), False)
    assert Demotion.from_settings(every_secs=60) == Demotion(EverySecs(60), False)
    assert Demotion.from_settings(every=5, every_secs=60).rule == AnyOf((Every(5), EverySecs(60)))
    assert Demotion.from_settings(on_close=True) == Demotion(Never(), True)  # only on close
    assert Demotion.from_settings(every=3, on_close=True) == Demotion(Every(3), True)


@pytest.mark.parametrize("bad", [lambda: Every(0), lambda: EverySecs(0), lambda: KeepLatest(0)])
def test_rules_refuse_nonsense(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        bad()


def test_keep_latest() -> None:
    assert KeepLatest(2).to_evict([5, 1, 3, 4]) == [1, 3]
    assert KeepLatest(2).to_evict([1]) == []
    assert KeepAll().to_evict([1, 2, 3]) == []


def test_plan_evictions_applies_each_tiers_window() -> None:
    committed = {"host": [8, 9, 10], "ssd": [8, 9, 10], "pfs": [5, 10]}
    retention = {"host": KeepLatest(1), "ssd": KeepLatest(2)}
    wanted = {8: {"host", "ssd"}, 9: {"host", "ssd"}, 10: {"host", "ssd", "pfs"}}
    assert plan_evictions(committed, retention, wanted) == [("host", 8), ("host", 9), ("ssd", 8)]


def test_plan_evictions_never_drops_a_pinned_or_promoted_copy() -> None:
    committed = {"host": [1, 2, 3], "ssd": [1]}
    plan = plan_evictions(committed, {"host": KeepLatest(1)}, {}, protected={(2, "host")})
    assert plan == [("host", 1)]  # step 2 is still being copied down (or was just promoted)


def test_plan_evictions_keeps_the_last_copy_another_rule_wants() -> None:
    # Step 1 failed to reach the ssd (keep all): the host copy is the only one; the ssd rule keeps step
    # 1, so the host must not evict it even though its own window is full.
    committed = {"host": [1, 2], "ssd": [2]}
    wanted = {1: {"host", "ssd"}, 2: {"host", "ssd"}}
    assert plan_evictions(committed, {"host": KeepLatest(1)}, wanted) == []
    # If the ssd would not keep step 1 either (keep 1, it holds 2), the host may let it go.
    assert plan_evictions(committed, {"host": KeepLatest(1), "ssd": KeepLatest(1)}, wanted) == [("host", 1)]
    # A step that was never sent anywhere else is evicted by the tier's own window.
    assert plan_evictions(committed, {"host": KeepLatest(1)}, {1: {"host"}}) == [("host", 1)]


def test_plan_evictions_with_two_copies_drops_each_by_its_own_rule() -> None:
    committed = {"host": [1, 2], "ssd": [1, 2]}
    retention = {"host": KeepLatest(1), "ssd": KeepLatest(1)}
    wanted = {1: {"host", "ssd"}, 2: {"host", "ssd"}}
    assert plan_evictions(committed, retention, wanted) == [("host", 1), ("ssd", 1)]


def test_capacity_victims_only_gives_up_copies_held_elsewhere() -> None:
    assert capacity_victims([4, 1, 2, 3], elsewhere={1, 3, 4}, protected={3}, exclude=4) == [1]
    assert capacity_victims([1, 2], elsewhere=set()) == []
