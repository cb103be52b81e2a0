"""The message in which one rank publishes a tier's listing of every rank's copies to the ranks that
share it (tierckpt.background.sharedlisting): small, plain msgpack data, and refused whole where it is
not what tierckpt wrote."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from tierckpt.background.sharedlisting import pack, unpack
from tierckpt.errors import CoordinationError
from tierckpt.policies.protocol import TierHoldings

EVERY = TierHoldings(
    "obj",
    own=frozenset({1, 2}),
    records=frozenset({1, 2}),
    record_sizes={1: 512, 2: None},
    versions={7: 5},
    ranks={1: frozenset(range(512)), 2: frozenset({0, 1, 2, 9, 10, 511}), 3: frozenset({5})},
    step_versions={3: None},
)


def test_a_listing_goes_through_msgpack_and_comes_back_as_every_ranks_holdings() -> None:
    got = unpack("obj", msgpack.unpackb(msgpack.packb(pack(EVERY)), strict_map_key=False), "here")
    assert got.records == EVERY.records and dict(got.record_sizes) == dict(EVERY.record_sizes)
    assert got.ranks == EVERY.ranks and dict(got.step_versions) == {3: None}
    assert got.own == frozenset() and not got.versions  # no rank's own part: each rank takes its own


def test_a_step_all_of_whose_ranks_saved_costs_a_few_bytes_whatever_the_number_of_ranks() -> None:
    steps = TierHoldings("obj", records=frozenset(range(100)), record_sizes=dict.fromkeys(range(100), 100_000),
                         ranks={s: frozenset(range(100_000)) for s in range(100)})  # fmt: skip
    assert pack(steps)["ranks"][0] == [0, 100_000]
    assert len(msgpack.packb(pack(steps))) < 2_000


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"records": []},
        {"records": [-1], "sizes": {}, "ranks": {}, "versions": {}},
        {"records": [1], "sizes": {1: "4"}, "ranks": {}, "versions": {}},
        {"records": [], "sizes": {}, "ranks": {1: [3, 2]}, "versions": {}},
        {"records": [], "sizes": {}, "ranks": {1: [0, 1, 2]}, "versions": {}},
        {"records": [], "sizes": {}, "ranks": {1: [0, 10**6]}, "versions": {}},
        {"records": [], "sizes": {}, "ranks": {"1": [0, 1]}, "versions": {}},
        {"records": [], "sizes": {}, "ranks": {}, "versions": {1: -4}},
    ],
)
def test_a_message_tierckpt_did_not_write_is_refused_naming_where_it_came_from(bad: Any) -> None:
    with pytest.raises(CoordinationError, match="tier 'obj' from rank 0: the listing is not one tierckpt wrote"):
        unpack("obj", bad, "tier 'obj' from rank 0")
