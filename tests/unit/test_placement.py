"""Placement (tierckpt.policies.place): every decision of what moves where, from lists of records, no I/O."""

from __future__ import annotations

import pytest

from tierckpt.policies import (
    CatalogView,
    Close,
    Copy,
    Demotion,
    Every,
    EverySecs,
    Held,
    KeepAll,
    KeepLatest,
    MakeRoom,
    Never,
    Policy,
    Prefetch,
    Restored,
    Retain,
    Save,
    Sent,
    place,
)

TIERS = ("host", "ssd", "pfs")


def policy(**kw: object) -> Policy:
    return Policy(TIERS, **kw)  # type: ignore[arg-type]  # the test passes the keyword fields as given


# -- save ------------------------------------------------------------------------------------------------
def test_a_save_goes_everywhere_by_default_each_copy_from_the_nearest_tier_above() -> None:
    plan = place(Save(7, now=0.0), policy(), CatalogView())
    assert plan.tiers == TIERS
    assert plan.copies == (
        Copy("host"),
        Copy("ssd", ("host",), fallback=True),
        Copy("pfs", ("ssd", "host"), fallback=True),
    )
    assert plan.replaced == ()


def test_every_n_counts_saves_per_tier_and_the_plan_carries_the_cadence() -> None:
    pol = policy(demotion={"ssd": Demotion(Every(2)), "pfs": Demotion(Every(3))})
    sent = {"ssd": Sent(0, 0.0), "pfs": Sent(0, 0.0)}
    went = []
    for step in range(1, 7):
        plan = place(Save(step, now=0.0), pol, CatalogView(sent=sent))
        went.append(plan.tiers)
        sent = dict(plan.sent)
    assert went == [
        ("host",),
        ("host", "ssd"),
        ("host", "pfs"),
        ("host", "ssd"),
        ("host",),
        ("host", "ssd", "pfs"),
    ]
    # a copy that skips the tier in between reads from the top tier
    assert place(Save(3, 0.0), pol, CatalogView(sent={"ssd": Sent(0, 0), "pfs": Sent(2, 0)})).copies[1] == Copy(
        "pfs", ("host",), fallback=True
    )


def test_every_secs_is_due_on_the_first_save_after_the_interval_and_restarts_the_clock() -> None:
    pol = policy(demotion={"ssd": Demotion(Never()), "pfs": Demotion(EverySecs(60))})
    view = CatalogView(sent={"ssd": Sent(0, 0.0), "pfs": Sent(0, 100.0)})
    early = place(Save(1, now=150.0), pol, view)
    assert early.tiers == ("host",) and early.sent["pfs"] == Sent(1, 100.0)
    due = place(Save(2, now=160.0), pol, CatalogView(sent=early.sent))
    assert due.tiers == ("host", "pfs") and due.sent["pfs"] == Sent(0, 160.0)


def test_a_step_saved_again_replaces_its_older_copies_wherever_they_are() -> None:
    pol = policy(demotion={"ssd": Demotion(Never()), "pfs": Demotion(Never())})
    plan = place(Save(5, 0.0, holders={"pfs"}), pol, CatalogView())
    assert plan.tiers == ("host", "pfs") and plan.replaced == ("pfs",)
    assert plan.copies[1] == Copy("pfs", ("host",), fallback=True)


# -- prefetch ----------------------------------------------------------------------------------------------
def test_prefetch_fills_the_target_first_from_the_fastest_holder_then_the_tiers_between() -> None:
    plan = place(Prefetch(9, "host", holders={"pfs"}), policy(), CatalogView())
    assert plan.copies == (Copy("host", ("pfs",), promoted=True), Copy("ssd", ("host", "pfs"), promoted=True))
    assert plan.there is None


def test_prefetch_reads_the_fastest_holder_and_stops_where_the_step_already_is() -> None:
    assert place(Prefetch(9, "host", holders={"ssd", "pfs"}), policy(), CatalogView()).copies == (
        Copy("host", ("ssd",), promoted=True),
    )
    already = place(Prefetch(9, "ssd", holders={"host", "pfs"}), policy(), CatalogView())
    assert already.copies == () and already.there == "host"


def test_a_restore_from_a_lower_tier_promotes_it_only_when_the_policy_says_so() -> None:
    assert place(Restored(3, "pfs"), policy(), CatalogView()).copies == ()
    promoted = place(Restored(3, "pfs"), policy(promote_on_restore=True), CatalogView())
    assert promoted.copies == (Copy("host", ("pfs",), promoted=True), Copy("ssd", ("host", "pfs"), promoted=True))
    assert place(Restored(3, "host"), policy(promote_on_restore=True), CatalogView()).copies == ()


def test_only_a_cadence_in_seconds_makes_the_save_plan_read_the_clock() -> None:
    assert not policy(demotion={"ssd": Demotion(Every(2)), "pfs": Demotion(Never(), on_close=True)}).reads_clock
    assert policy(demotion={"pfs": Demotion(Every(2) | EverySecs(60))}).reads_clock


# -- close -------------------------------------------------------------------------------------------------
def test_close_sends_the_newest_step_to_each_on_close_tier_that_lacks_it() -> None:
    pol = policy(demotion={"ssd": Demotion(Never(), on_close=True), "pfs": Demotion(Never(), on_close=True)})
    plan = place(Close(4, holders={"host"}), pol, CatalogView())
    assert plan.step == 4
    assert plan.copies == (Copy("ssd", ("host",)), Copy("pfs", ("host",)))
    assert place(Close(4, holders={"host", "pfs"}), pol, CatalogView()).copies == (Copy("ssd", ("host",)),)


def test_close_cannot_send_a_step_up_and_has_nothing_to_do_without_one() -> None:
    pol = policy(demotion={"ssd": Demotion(Never(), on_close=True)})
    plan = place(Close(4, holders={"pfs"}), pol, CatalogView())
    assert plan.copies == () and plan.unreachable == ("ssd",)
    assert place(Close(None), pol, CatalogView()).copies == ()
    assert place(Close(4, holders={"host"}), policy(), CatalogView()).copies == ()  # no on_close tier


# -- retention ---------------------------------------------------------------------------------------------
def test_retention_evicts_beyond_the_window_but_holds_the_slowest_copy_of_a_step_not_yet_below() -> None:
    pol = policy(retention={"host": KeepLatest(1), "ssd": KeepLatest(1), "pfs": KeepAll()})
    view = CatalogView(
        committed={"host": [1, 2, 3], "ssd": [1, 2, 3], "pfs": [1]},
        wanted={1: {"host", "ssd", "pfs"}, 2: {"host", "ssd", "pfs"}, 3: {"host", "ssd", "pfs"}},
    )
    plan = place(Retain(), pol, view)
    assert sorted(plan.evict) == [("host", 1), ("host", 2), ("ssd", 1)]
    assert plan.held == [Held(2, "ssd", ("pfs",))]


def test_retention_never_evicts_a_protected_copy() -> None:
    pol = policy(retention={"host": KeepLatest(1)})
    view = CatalogView(committed={"host": [1, 2], "ssd": [1, 2], "pfs": []}, protected={(1, "host")})
    assert place(Retain(), pol, view).evict == []


# -- a full tier -------------------------------------------------------------------------------------------
def test_a_full_tier_gives_up_its_oldest_copy_that_another_tier_holds() -> None:
    view = CatalogView(committed={"host": [1, 2, 3], "ssd": [2, 3], "pfs": []}, protected={(2, "host")})
    assert place(MakeRoom("host", 4), policy(), view).victims == (3,)
    held = CatalogView(committed={"host": [1, 2], "ssd": [1, 2], "pfs": []}, held={(1, "host")})
    assert place(MakeRoom("host", 4), policy(), held).victims == (2,)


def test_a_full_tier_waits_for_pinned_copies_unless_its_policy_says_fail() -> None:
    view = CatalogView(committed={"host": [1, 2], "ssd": [], "pfs": []}, pinned={(1, "host"), (2, "host")})
    room = place(MakeRoom("host", 3), policy(), view)
    assert room.victims == () and room.wait and room.waiting_on == (1, 2)
    assert not place(MakeRoom("host", 3), policy(on_full={"host": "fail"}), view).wait
    nothing_pinned = CatalogView(committed={"host": [1], "ssd": [], "pfs": []})
    assert not place(MakeRoom("host", 3), policy(), nothing_pinned).wait  # nothing will free room: fail


# -- the policy itself -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"demotion": {"host": Demotion()}}, "demotion"),
        ({"retention": {"tape": KeepAll()}}, "retention"),
        ({"on_full": {"ssd": "drop"}}, "on_full"),
    ],
)
def test_a_policy_naming_what_is_not_there_is_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        policy(**kw)


def test_an_unknown_event_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown event"):
        place(object(), policy(), CatalogView())  # type: ignore[call-overload]  # deliberately not an event


def test_a_full_device_gives_up_only_copies_a_lower_tier_holds() -> None:
    """Finding 10: a device that ran out (not a capacity) evicts the oldest copy a slower tier keeps; the
    bottom tier has none to give up, and a copy only a faster tier holds stays."""
    view = CatalogView(committed={"host": [1, 2, 3], "ssd": [1, 2, 3], "pfs": [2]})
    assert place(MakeRoom("ssd", 4, device=True), policy(), view).victims == (2,)
    assert place(MakeRoom("ssd", 4), policy(), view).victims == (1, 2, 3)  # a capacity: any other tier
    assert place(MakeRoom("pfs", 4, device=True), policy(), view).victims == ()
