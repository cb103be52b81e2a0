"""What one rank lists: per tier, the steps committed there for this rank, read from the tier
(:func:`tierckpt.tiers.holdings.read_holdings`) and judged by the protocol's rules
(:func:`tierckpt.policies.protocol.listed_steps`), merged with the states of the copies in flight into
what ``checkpoints()`` returns (:class:`Listing`). A tier whose listing is not cheap, in a job of several
ranks, is listed by one rank for the others when the hierarchy opens
(:mod:`tierckpt.background.sharedlisting`), then followed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tierckpt.background.catalog import Catalog, CheckpointInfo
from tierckpt.background.sharedlisting import list_for_ranks
from tierckpt.errors import CheckpointNotFoundError
from tierckpt.policies.protocol import (
    ThisRank,
    TierHoldings,
    listed_steps,
    lister,
    own_unrecorded,
    seen_by,
    sweeps_strays,
    unrecorded_copies,
)
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.holdings import copy_version, read_holdings

__all__ = ["Listing"]

log = logging.getLogger("tierckpt.hierarchy")


def _state(tracked: str, listed: bool) -> str:
    """A copy's state from what this hierarchy tracked and whether its tier lists it as committed."""
    if listed and tracked != "evicting":
        return "committed"
    return "absent" if tracked == "committed" else tracked  # committed but unlisted: evicted from outside


class Listing:
    """The steps one rank lists on its tiers (see the module docstring). Thread-safe.

    What a tier's listing showed (its :class:`~tierckpt.policies.protocol.TierHoldings`) is kept until
    the next one: the rank executor's orphan sweep judges the copies it showed without a record. The
    first listing of a persistent tier by a retention pass, where this rank sweeps the tier's strays
    (:func:`~tierckpt.policies.protocol.sweeps_strays`), looks at every rank's copies, and is kept until
    the sweep takes it. The number of ranks a record names is read once a step and tier (until the step
    is evicted), and the format version of a record-less copy this hierarchy never wrote once (it stays
    legacy).

    A tier whose listing is not cheap is listed once, then followed by the catalog; in a job of several
    ranks, that one listing is made by one rank for all of them when the hierarchy opens (:meth:`open`),
    and ``checkpoints()`` follows it too, so that no rank lists it again.

    Args:
        tiers: the tiers, fastest first.
        catalog: the hierarchy's bookkeeping (states, errors, the followed tiers).
        me: this rank in its job.
    """

    def __init__(self, tiers: Sequence[Tier], catalog: Catalog, me: ThisRank) -> None:
        self.tiers = tuple(tiers)
        self.catalog = catalog
        self.me = me
        self._lock = threading.Lock()
        self._sizes: dict[tuple[int, str], int] = {}  # (step, tier): the ranks its record names
        self._versions: dict[tuple[int, str], int] = {}  # (step, tier): a legacy copy's format version
        self._shown: dict[str, TierHoldings] = {}  # per tier, what its last listing showed
        self._everyone: dict[str, TierHoldings | None] = {  # per tier: its listing of every rank's copies
            t.name: None
            for t in self.tiers
            if t.capabilities.persistent and sweeps_strays(me, shared=t.capabilities.shared)
        }
        self._newest: int | None = None  # newest step committed or saved (listed at the first save)
        self._warned_order = False
        self._once: set[str] = set()  # tiers listed by one rank for the ranks sharing them (open())

    def open(self, coordinator: Coordinator) -> None:
        """List, once, each tier that one rank lists for the ranks that share it
        (:func:`~tierckpt.policies.protocol.lister`: a tier whose listing is not cheap, in a job of
        several ranks): that rank reads every rank's copies and publishes them, each rank takes its own
        holdings from them (:func:`~tierckpt.policies.protocol.seen_by`, reading only the format version
        of its own copies without a record), and the catalog follows the tier from then on. Every rank
        calls it when its hierarchy is built; a tier no rank lists for the others is listed by each rank
        when it is first needed, as before.

        Raises:
            OSError: this rank lists a tier for the others and cannot.
            CoordinationError: the rank that lists a tier could not, or did not answer in time.
        """
        nodes_meet = callable(getattr(coordinator, "node_gather", None))
        for t in self.tiers:
            caps = t.capabilities
            who = lister(
                self.me, shared=caps.shared, cheap=caps.cheap_listing,
                ranks_meet=coordinator.connects_ranks, nodes_meet=nodes_meet,
            )  # fmt: skip
            if who is None:
                continue
            got = every = list_for_ranks(coordinator, t, self.me, who)
            if who != self.me.rank:
                mine = own_unrecorded(every, self.me.rank)
                got = seen_by(every, self.me.rank, {s: copy_version(t, CheckpointKey(s, self.me.rank)) for s in mine})
            self._keep(t.name, got, everyone=who == self.me.rank)
            self.catalog.follow(t.name, listed_steps(got, self.me.world_size))
            self._once.add(t.name)

    def listed_once(self, tier: str) -> bool:
        """Whether ``tier`` was listed by one rank for the ranks sharing it (:meth:`open`): this rank never
        lists it; what it holds is what the catalog follows."""
        return tier in self._once

    # -- one tier ---------------------------------------------------------------------------------------
    def holdings(self, tier: Tier, everyone: bool = False) -> TierHoldings | None:
        """What ``tier`` holds for this rank now (None, with a warning, when it cannot list); with
        ``everyone``, every rank's copies too if this rank sweeps the tier's strays and has not listed
        them yet."""
        name = tier.name
        states = self.catalog.states()
        with self._lock:
            sizes = {s: n for (s, t), n in self._sizes.items() if t == name}
            # a copy this hierarchy writes or wrote is read again: it may have replaced a legacy one
            versions = {s: v for (s, t), v in self._versions.items() if t == name and name not in states.get(s, {})}
            everyone = everyone and name in self._everyone and self._everyone[name] is None
        try:
            got = read_holdings(tier, self.me.rank, sizes, versions, every_rank=everyone)
        except OSError as e:
            log.warning("tier %r cannot list its checkpoints: %s", name, e)
            return None
        self._keep(name, got, everyone)
        return got

    def _keep(self, name: str, got: TierHoldings, everyone: bool) -> None:
        """What a listing of tier ``name`` showed (``everyone``: every rank's copies, for the stray sweep)."""
        with self._lock:
            self._shown[name] = got
            if everyone and name in self._everyone:
                self._everyone[name] = got
            self._sizes.update({(s, name): n for s, n in got.record_sizes.items() if n is not None})
            self._versions.update(
                {(s, name): v for s, v in got.versions.items() if v is not None and s not in got.records}
            )

    def _listed(self, tier: Tier, everyone: bool = False) -> list[int] | None:
        got = self.holdings(tier, everyone)
        return None if got is None else listed_steps(got, self.me.world_size)

    def committed(self, tier: Tier, everyone: bool = False) -> list[int]:
        """The steps of this rank committed on ``tier``, oldest first ([] with a warning when it cannot
        list); a tier whose listing is not cheap is listed once, then followed by the catalog.
        ``everyone``: see :meth:`holdings` (a retention pass asks: a read-only hierarchy never pays for
        a listing of every rank's copies)."""
        followed = self.catalog.followed(tier.name)
        if followed is not None:
            return sorted(followed)
        steps = self._listed(tier, everyone)
        if steps is None:
            return []
        followed = self.catalog.follow(tier.name, steps)
        return steps if followed is None else sorted(followed)

    def committed_all(self, everyone: bool = False) -> dict[str, list[int]]:
        """:meth:`committed` of every tier, fastest first."""
        return {t.name: self.committed(t, everyone) for t in self.tiers}

    def unrecorded(self) -> list[tuple[int, str]]:
        """This rank's copies the last listing of each tier showed without a record (see
        :func:`~tierckpt.policies.protocol.unrecorded_copies`), as (step, tier); each is handed out once
        (the next listing shows it again if it is still there)."""
        with self._lock:
            shown, self._shown = list(self._shown.values()), {}
        return [(s, h.tier) for h in shown for s in unrecorded_copies(h)]

    def every_rank(self) -> list[TierHoldings]:
        """The listings of every rank's copies not taken yet (at most one a tier and hierarchy)."""
        with self._lock:
            got = [h for h in self._everyone.values() if h is not None]
            self._everyone = {n: h for n, h in self._everyone.items() if h is None}
        return got

    def forget(self, step: int, tier: str) -> None:
        """The step was evicted from ``tier``: what was read of it there is stale."""
        with self._lock:
            self._sizes.pop((step, tier), None)
            self._versions.pop((step, tier), None)

    # -- every tier ---------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """This rank's steps, oldest first: what the tiers list as committed (always listed afresh: other
        processes may evict or remove copies; a tier one rank listed for the others when the hierarchy
        opened, as the catalog follows it) merged with the states of the copies in flight. A tier that
        cannot list (e.g. its directory is gone) is logged and skipped."""
        committed: dict[int, list[str]] = {}
        for t in self.tiers:
            for step in (self.committed(t) if t.name in self._once else self._listed(t)) or ():
                committed.setdefault(step, []).append(t.name)
        tracked, errors = self.catalog.states(), self.catalog.errors()
        out = []
        for s in sorted(set(committed) | set(tracked)):
            here = committed.get(s, [])
            states = {t.name: _state(tracked.get(s, {}).get(t.name, "absent"), t.name in here) for t in self.tiers}
            if any(v != "absent" for v in states.values()):
                out.append(CheckpointInfo(s, tuple(here), states, dict(errors.get(s, {}))))
        return out

    def committed_steps(self, tier: str | None = None) -> list[CheckpointInfo]:
        """Committed steps, oldest first (only those on ``tier``, as held there, if given)."""
        infos = [i for i in self.checkpoints() if i.tiers]
        if tier is not None:
            infos = [CheckpointInfo(i.step, (tier,)) for i in infos if tier in i.tiers]
        return infos

    def locate(self, step: int | None, tier: str | None = None) -> CheckpointInfo:
        """``step`` (None: the newest) as committed (on ``tier`` if given); CheckpointNotFoundError if it is not."""
        infos = self.committed_steps(tier)
        if not infos:
            where = f"tier {tier!r}" if tier else "any tier"
            raise CheckpointNotFoundError(f"no committed checkpoint for rank {self.me.rank} on {where}")
        if step is None:
            return infos[-1]
        for i in infos:
            if i.step == step:
                return i
        raise CheckpointNotFoundError(f"step {step} is not committed (committed steps: {[i.step for i in infos]})")

    def newest_step(self) -> int:
        """The newest step committed anywhere or saved by this hierarchy (-1: none): the tiers are listed
        once, at the first call, and :meth:`saw_step` keeps it up to date after that."""
        if self._newest is None:
            newest = max((i.step for i in self.committed_steps()), default=-1)
            with self._lock:
                self._newest = newest if self._newest is None else max(self._newest, newest)
        return self._newest

    def saw_step(self, step: int) -> None:
        """A save of ``step`` was made. Warns once when it is older than one already committed:
        ``restore()`` without a step still picks the newer one (a job that went back to an older step
        should remove the steps it abandoned, or restore by step)."""
        newest = self.newest_step()
        if step < newest and not self._warned_order:
            self._warned_order = True
            log.warning(
                "saving step %d, older than step %d already saved: restore() without a step picks step %d; "
                "keep: windows count steps by number (this save is kept until a later save replaces it)",
                step, newest, newest,
            )  # fmt: skip
        with self._lock:
            self._newest = max(newest, step)
