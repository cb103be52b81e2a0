"""What a tier holds for one rank, as plain records for the many-rank protocol's rules
(:mod:`tierckpt.policies.protocol`): this rank's copies, the steps' commit records, the number of ranks
a record names, a copy's format version. Reading only; nothing here decides what they mean."""

from __future__ import annotations

from collections.abc import Mapping

from tierckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from tierckpt.format.manifest import HEADER, manifest_version
from tierckpt.format.record import decode_record
from tierckpt.policies.protocol import TierHoldings
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["copy_version", "read_holdings", "record_world_size", "recorded"]


def read_holdings(
    tier: Tier,
    rank: int,
    known_sizes: Mapping[int, int | None] | None = None,
    known_versions: Mapping[int, int | None] | None = None,
    *,
    every_rank: bool = False,
) -> TierHoldings:
    """What ``tier`` holds for ``rank`` now: its copies and the steps' records, the world size each record
    of a step without a copy of ``rank`` names, and the format version of each copy without a record
    (those in ``known_sizes`` / ``known_versions`` are taken from there instead of read again). With
    ``every_rank``, every rank's copies are listed too (on a file tier a ``readdir`` a step and a ``stat``
    a copy, instead of one ``stat`` a step), the world size of every record is read, and the format
    version of one copy of each step without a record (its highest rank's: one manifest header a step).

    Raises:
        OSError: the tier cannot list.
    """
    ranks: dict[int, set[int]] = {}
    for k in tier.list_committed(None if every_rank else rank):
        ranks.setdefault(k.step, set()).add(k.rank)
    own = frozenset(s for s, rs in ranks.items() if rank in rs)
    records = frozenset(tier.list_records())
    sizes, known = known_sizes or {}, known_versions or {}
    versions = {
        s: known[s] if s in known else copy_version(tier, CheckpointKey(s, rank)) for s in sorted(own - records)
    }
    return TierHoldings(
        tier.name,
        own,
        records,
        {
            s: sizes[s] if s in sizes else record_world_size(tier, s)
            for s in sorted(records if every_rank else records - own)
        },
        versions,
        {s: frozenset(rs) for s, rs in ranks.items()} if every_rank else None,
        {s: _step_version(tier, s, max(ranks[s]), rank, versions) for s in sorted(set(ranks) - records)}
        if every_rank
        else {},
    )


def _step_version(tier: Tier, step: int, highest: int, rank: int, versions: Mapping[int, int | None]) -> int | None:
    """The format version of ``highest``'s copy of a step without a record (``versions`` has this rank's)."""
    return versions[step] if highest == rank and step in versions else copy_version(tier, CheckpointKey(step, highest))


def record_world_size(tier: Tier, step: int) -> int | None:
    """The number of ranks ``step``'s record on ``tier`` names; None when there is none or it cannot be
    read or decoded (a restore of the step would say why)."""
    try:
        data = tier.read_record(step)
        return decode_record(data, step).world_size if data is not None else None
    except (OSError, CorruptCheckpointError, UnsupportedFormatError):
        return None


def recorded(tier: Tier, step: int) -> bool | None:
    """Whether ``tier`` holds ``step``'s record now (None: it cannot be read)."""
    try:
        return tier.read_record(step) is not None
    except OSError:
        return None


def copy_version(tier: Tier, key: CheckpointKey) -> int | None:
    """The format version of ``key``'s manifest on ``tier`` (from its header); None when the copy is gone
    or its header is not a manifest's (a restore would say why)."""
    try:
        head = tier.read_manifest(key)[: HEADER.size]
    except OSError:
        return None
    return manifest_version(head)
