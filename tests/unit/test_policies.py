"""The pure policy objects: demotion cadence, retention, eviction safety, capacity victims."""

from __future__ import annotations

import pytest

from tierckpt.policies import (
    AnyOf,
    Cadence,
    Demotion,
    Every,
    EverySecs,
    Held,
    KeepAll,
    KeepLatest,
    Never,
    RetentionPlan,
    capacity_victims,
    missing_tiers,
    plan_evictions,
    plan_retention,
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


def test_a_failed_lower_copy_holds_the_last_copy_until_a_newer_step_is_there() -> None:
    # The case: pfs copies of steps 1..10 failed, ssd keeps 2. Every step stays on the ssd.
    keep = {"host": KeepLatest(1), "ssd": KeepLatest(2)}
    wanted = {s: {"host", "ssd", "pfs"} for s in range(1, 12)}
    committed: dict[str, list[int]] = {"host": [10], "ssd": list(range(1, 11)), "pfs": []}
    plan = plan_retention(committed, keep, wanted)
    assert plan.evict == []
    assert plan.held == [Held(s, "ssd", ("pfs",)) for s in range(1, 9)]
    # The pfs recovers: step 11 reaches it, and the backlog is released down to the window.
    committed = {"host": [10, 11], "ssd": list(range(1, 12)), "pfs": [11]}
    plan = plan_retention(committed, keep, wanted)
    assert plan.evict == [("host", 10), *(("ssd", s) for s in range(1, 10))]
    assert plan.held == []


def test_an_unfinished_or_failed_copy_holds_the_only_copy() -> None:
    committed = {"host": [1, 2], "ssd": []}
    wanted = {1: {"host", "ssd"}, 2: {"host", "ssd"}}
    plan = plan_retention(committed, {"host": KeepLatest(1)}, wanted)
    assert plan == RetentionPlan(evict=[], held=[Held(1, "host", ("ssd",))])
    # A newer step committed on the ssd makes step 1 safe (whatever the ssd's own window).
    committed = {"host": [1, 2], "ssd": [2]}
    assert plan_evictions(committed, {"host": KeepLatest(1)}, wanted) == [("host", 1)]
    assert plan_evictions(committed, {"host": KeepLatest(1), "ssd": KeepLatest(1)}, wanted) == [("host", 1)]
    # A step that was never sent anywhere else is evicted by the tier's own window.
    assert plan_evictions({"host": [1, 2], "ssd": []}, {"host": KeepLatest(1)}, {1: {"host"}}) == [("host", 1)]


def test_the_held_copy_is_the_slowest_one() -> None:
    wanted = {s: {"host", "ssd", "pfs"} for s in (1, 2, 3)}
    committed = {"host": [1, 2, 3], "ssd": [1, 2, 3], "pfs": []}
    plan = plan_retention(committed, {"host": KeepLatest(1), "ssd": KeepLatest(1)}, wanted)
    assert plan.evict == [("host", 1), ("host", 2)]  # the ssd copies stay: they survive the process
    assert plan.held == [Held(1, "ssd", ("pfs",)), Held(2, "ssd", ("pfs",))]
    # The ssd's window is wider than the host's: the host copies go, nothing is held.
    plan = plan_retention(committed, {"host": KeepLatest(1), "ssd": KeepLatest(3)}, wanted)
    assert plan == RetentionPlan([("host", 1), ("host", 2)], [])
    # The host's window is wider: the ssd copies are held all the same (a host copy dies with the process).
    plan = plan_retention(committed, {"host": KeepLatest(3), "ssd": KeepLatest(1)}, wanted)
    assert plan == RetentionPlan([], [Held(1, "ssd", ("pfs",)), Held(2, "ssd", ("pfs",))])


def test_a_failed_copy_above_the_slowest_one_holds_nothing() -> None:
    # The ssd fails for every step, the pfs has them all: the pfs window applies as usual (its copy is the
    # safer one), and the host copies go (the pfs holds them).
    wanted = {s: {"host", "ssd", "pfs"} for s in (1, 2, 3)}
    committed = {"host": [1, 2, 3], "ssd": [], "pfs": [1, 2, 3]}
    keep = {"host": KeepLatest(1), "ssd": KeepLatest(2), "pfs": KeepLatest(2)}
    assert plan_retention(committed, keep, wanted) == RetentionPlan([("host", 1), ("host", 2), ("pfs", 1)], [])


def test_a_step_of_an_earlier_process_is_wanted_below_its_slowest_copy() -> None:
    # Nobody knows where steps 1 and 2 were sent: they are wanted on the pfs, below the ssd.
    keep = {"ssd": KeepLatest(1)}
    plan = plan_retention({"ssd": [1, 2, 3], "pfs": []}, keep, {3: {"ssd"}})
    assert plan.held == [Held(1, "ssd", ("pfs",)), Held(2, "ssd", ("pfs",))]
    assert plan_evictions({"ssd": [1, 2, 3], "pfs": [2]}, keep, {3: {"ssd"}}) == [("ssd", 1), ("ssd", 2)]
    assert plan_evictions({"pfs": [1, 2, 3]}, {"pfs": KeepLatest(1)}, {}) == [("pfs", 1), ("pfs", 2)]


def test_missing_tiers() -> None:
    newest = {"host": 5, "ssd": 3, "pfs": -1}
    assert missing_tiers(4, {"host", "ssd", "pfs", "gone"}, newest) == ("ssd", "pfs", "gone")
    assert missing_tiers(3, {"ssd"}, newest) == ()


def test_plan_evictions_with_two_copies_drops_each_by_its_own_rule() -> None:
    committed = {"host": [1, 2], "ssd": [1, 2]}
    retention = {"host": KeepLatest(1), "ssd": KeepLatest(1)}
    wanted = {1: {"host", "ssd"}, 2: {"host", "ssd"}}
    assert plan_evictions(committed, retention, wanted) == [("host", 1), ("ssd", 1)]


def test_capacity_victims_only_gives_up_copies_held_elsewhere() -> None:
    assert capacity_victims([4, 1, 2, 3], elsewhere={1, 3, 4}, protected={3}, exclude=4) == [1]
    assert capacity_victims([1, 2], elsewhere=set()) == []
