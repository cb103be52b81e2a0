"""What the many-rank protocol's rules (:mod:`tierckpt.policies.protocol`) read and return, as plain
records: where this rank stands in its job (:class:`ThisRank`), what a tier holds for it
(:class:`TierHoldings`), what this hierarchy tracks of one copy (:class:`CopyState`), and the actions
of a plan, each with what its failure does (:data:`OnFailure`), which the rank executor
(:class:`~tierckpt.background.executor.RankExecutor`) carries out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Action",
    "CopyState",
    "EvictCopy",
    "Fail",
    "Keep",
    "OnFailure",
    "RemoveRecord",
    "ThisRank",
    "TierHoldings",
    "Warn",
    "WriteRecord",
]


# -- inputs --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThisRank:
    """Where this rank stands in its job.

    Attributes:
        rank: this rank.
        world_size: the job's number of ranks.
        node_ranks: the ranks of this rank's node (they share its node-local tiers' directories).
    """

    rank: int
    world_size: int
    node_ranks: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TierHoldings:
    """What one tier holds for one rank, as its listing showed it
    (:func:`tierckpt.tiers.holdings.read_holdings`).

    Attributes:
        tier: the tier's name.
        own: the steps of which this rank's copy is in place (its manifest durable).
        records: the steps whose commit record the tier holds.
        record_sizes: for each step with a record but no copy of this rank (a listing of every rank's
            copies: each step with a record), the number of ranks its record names (None: unreadable).
        versions: for each copy of this rank without a record, its manifest's format version (None:
            unreadable).
        ranks: per step, the ranks whose copies the tier holds, when the listing looked at every rank's
            (None: at this rank's only).
        step_versions: when the listing looked at every rank's copies, for each step without a record,
            the format version of one copy of it (its highest rank's, the one a stray would be; None:
            unreadable): a step of format 4 or older has no record and is committed by itself.
    """

    tier: str
    own: frozenset[int] = frozenset()
    records: frozenset[int] = frozenset()
    record_sizes: Mapping[int, int | None] = field(default_factory=dict)
    versions: Mapping[int, int | None] = field(default_factory=dict)
    ranks: Mapping[int, frozenset[int]] | None = None
    step_versions: Mapping[int, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class CopyState:
    """What this hierarchy tracks of its copy of one step on one tier (its catalog).

    Attributes:
        state: one of the catalog's states (``pending``, ``writing``, ``committed``, ``failed``,
            ``evicting``), or None for a copy this hierarchy never wrote (an earlier process's).
        pinned: a transfer of this rank reads the copy.
        unknown: the copy's commit failed without an outcome (rank 0 may have written the record).
    """

    state: str | None = None
    pinned: bool = False
    unknown: bool = False


# -- actions -------------------------------------------------------------------------------------------
#: What the executor does when an action fails: ``raise`` the error (the operation fails), ``stop`` the
#: plan with a warning (the actions after it are not carried out), or ``continue`` with a warning.
OnFailure = Literal["raise", "stop", "continue"]


@dataclass(frozen=True)
class WriteRecord:
    """Write the step's commit record on the tier (the outcome's record). One that cannot be written
    fails what wrote it (``raise``): the step is not committed there."""

    tier: str
    step: int
    on_failure: OnFailure = "raise"


@dataclass(frozen=True)
class RemoveRecord:
    """Remove the step's commit record from the tier (idempotent): the step is unlisted for every rank.
    One that cannot be removed stops the plan (``stop``): the copies after it stay, since a record never
    names a copy that is gone."""

    tier: str
    step: int
    on_failure: OnFailure = "stop"


@dataclass(frozen=True)
class EvictCopy:
    """Evict rank ``rank``'s copy of the step from the tier (a missing one is no error). One that cannot
    go is left to a later pass (``continue``): nothing lists it once its record is gone."""

    tier: str
    step: int
    rank: int
    on_failure: OnFailure = "continue"


@dataclass(frozen=True)
class Keep:
    """Leave rank ``rank``'s copy of the step where it is, for ``why``."""

    tier: str
    step: int
    rank: int
    why: str


@dataclass(frozen=True)
class Warn:
    """Say ``message`` as a warning."""

    message: str


@dataclass(frozen=True)
class Fail:
    """Fail the operation: the step is not committed where it was read (``why``; a
    :class:`~tierckpt.errors.CheckpointNotFoundError`)."""

    why: str


Action = WriteRecord | RemoveRecord | EvictCopy | Keep | Warn | Fail
