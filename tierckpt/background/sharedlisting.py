"""One rank lists a tier for the ranks that share it (docs/distributed.md, "Tiers listed by one rank").

A tier whose listing is not cheap (``capabilities.cheap_listing`` False: an object store, where a LIST
is a request, billed, and throttled when hundreds of ranks send it at once) is listed once per
hierarchy, when it opens, by the rank :func:`~tierckpt.policies.protocol.lister` names (rank 0 for a
shared tier, the node's first rank for a node-local one). That rank reads every rank's copies, the
records, the world size each record names and the format version of one copy of each step without a
record (:func:`~tierckpt.tiers.holdings.read_holdings` with ``every_rank``), and publishes them through
the coordinator, one keyed call (``decide``; ``node_gather`` for a node-local tier) every rank of the
job makes while its hierarchy is built; each rank takes its own holdings from that message
(:func:`~tierckpt.policies.protocol.seen_by`). The message is msgpack plain data (:func:`pack`): the
steps, and per step the ranks holding a copy as ranges, a few bytes per step for a job whose ranks all
saved. A rank that cannot list, or one that never answers, fails every rank's hierarchy with an error
naming it (bounded by the coordinator's timeout), never a listing of nothing.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tierckpt.errors import CoordinationError
from tierckpt.policies.protocol import ThisRank, TierHoldings
from tierckpt.ranks.coordinator import MAX_RANK, Coordinator
from tierckpt.tiers.base import Tier
from tierckpt.tiers.holdings import read_holdings

__all__ = ["list_for_ranks", "pack", "unpack"]

_opens: weakref.WeakKeyDictionary[Coordinator, itertools.count[int]] = weakref.WeakKeyDictionary()
_MAX_STEPS = 1 << 20  # a listing naming more steps is not one tierckpt wrote


def list_for_ranks(coordinator: Coordinator, tier: Tier, me: ThisRank, who: int) -> TierHoldings:
    """``tier``'s listing of every rank's copies, made by rank ``who`` and published to the ranks that
    share the tier (every rank of the job for a shared tier, the ranks of the node for a node-local one);
    on ``who`` itself, its own holdings as :func:`read_holdings` gave them (every rank's copies, and its
    own copies' format versions). Every rank that shares the tier calls it, once per tier, in the same
    order (when its hierarchy is built).

    Raises:
        OSError: on ``who``: the tier cannot list (the others get a :class:`CoordinationError` naming it).
        CoordinationError: ``who`` could not list the tier, did not answer in time (it died or hung:
            the coordinator's timeout and grace, twice at most), or sent what tierckpt did not write.
    """
    key = f"listing/{tier.name}/{_next(coordinator)}"
    mine: list[TierHoldings] = []
    failed: list[OSError] = []

    def read(_: object = None) -> dict[str, Any]:
        try:
            mine.append(read_holdings(tier, me.rank, every_rank=True))
        except OSError as e:
            failed.append(e)
            return {"error": f"{type(e).__name__}: {e}"}
        return pack(mine[0])

    where = "every rank" if tier.capabilities.shared else f"the ranks of node {sorted(me.node_ranks)}"
    what = f"tier {tier.name!r}: rank {who} lists it once for {where} (its listing is not cheap)"
    try:
        got = _exchange(coordinator, key, tier.capabilities.shared, read)
    except CoordinationError as e:
        raise CoordinationError(f"{what}, and no listing came: {e}", e.ranks, undecided=e.undecided) from e
    if failed:  # this rank listed, and could not
        raise failed[0]
    if mine:
        return mine[0]
    if isinstance(got, Mapping) and "error" in got:
        raise CoordinationError(f"{what}, and could not: {got['error']}", (who,))
    return unpack(tier.name, got, f"{what}: {key!r}")


def _exchange(coordinator: Coordinator, key: str, shared: bool, read: Callable[..., dict[str, Any]]) -> Any:
    """``read()`` run by the listing rank and its result on every rank that shares the tier."""
    if shared:
        return coordinator.decide(key, read)
    node_gather = getattr(coordinator, "node_gather", None)
    if node_gather is None:  # pragma: no cover - lister() names a node's rank only where it has them
        raise CoordinationError(f"{key!r}: the coordinator has no node exchanges")
    return node_gather(key, None, read)


def _next(coordinator: Coordinator) -> int:
    """The number of this listing among those made through ``coordinator`` (its keys are unique in the
    job: every rank builds its hierarchies, and so lists, in the same order)."""
    return next(_opens.setdefault(coordinator, itertools.count(1)))


# -- the message ----------------------------------------------------------------------------------------
def pack(every: TierHoldings) -> dict[str, Any]:
    """``every`` (a listing of every rank's copies) as msgpack plain data: the records, the world size
    each names, per step the ranks holding a copy (as ``[first, end, first, end, ...]`` ranges) and the
    format version of one copy of each step without a record."""
    return {
        "records": sorted(every.records),
        "sizes": {s: every.record_sizes.get(s) for s in sorted(every.records)},
        "ranks": {s: _spans(rs) for s, rs in sorted((every.ranks or {}).items())},
        "versions": dict(sorted(every.step_versions.items())),
    }


def unpack(tier: str, data: Any, where: str) -> TierHoldings:
    """What :func:`pack` made, as the holdings of every rank on ``tier`` (no rank's own part).

    Raises:
        CoordinationError: ``data`` is not what :func:`pack` makes (naming ``where`` and what is wrong).
    """
    try:
        if not isinstance(data, Mapping) or set(data) != {"records", "sizes", "ranks", "versions"}:
            raise ValueError("not a listing")
        records = frozenset(_steps(data["records"]))
        sizes, ranks, versions = _map(data["sizes"]), _map(data["ranks"]), _map(data["versions"])
        return TierHoldings(
            tier,
            records=records,
            record_sizes={s: _count(n) for s, n in sizes.items()},
            ranks={s: frozenset(_ranges(v)) for s, v in ranks.items()},
            step_versions={s: _count(v) for s, v in versions.items()},
        )
    except (ValueError, TypeError) as e:
        raise CoordinationError(f"{where}: the listing is not one tierckpt wrote ({e})") from None


def _spans(ranks: Iterable[int]) -> list[int]:
    """Sorted ranks as ``[first, end, ...]`` ranges (``[0, 512]``: ranks 0 to 511)."""
    out: list[int] = []
    for r in sorted(ranks):
        if out and out[-1] == r:
            out[-1] = r + 1
        else:
            out += [r, r + 1]
    return out


def _ranges(flat: Any) -> list[int]:
    if not isinstance(flat, list) or len(flat) % 2 or not all(type(x) is int for x in flat):
        raise ValueError(f"rank ranges {str(flat)[:80]}")
    pairs = list(zip(flat[::2], flat[1::2], strict=True))
    if any(not 0 <= a < b <= MAX_RANK for a, b in pairs) or sum(b - a for a, b in pairs) > MAX_RANK:
        raise ValueError(f"rank ranges {str(flat)[:80]}")
    return [r for a, b in pairs for r in range(a, b)]


def _steps(values: Any) -> list[int]:
    if not isinstance(values, list) or len(values) > _MAX_STEPS or not all(type(s) is int and s >= 0 for s in values):
        raise ValueError(f"steps {str(values)[:80]}")
    return values


def _map(values: Any) -> dict[int, Any]:
    if not isinstance(values, Mapping):
        raise ValueError(f"expected a map, got {type(values).__name__}")
    _steps(list(values))
    return dict(values)


def _count(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"a count {value!r}")
    return value
