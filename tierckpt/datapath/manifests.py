"""A copy's manifest read and validated before any blob byte is: its head (what says which blobs to
read), its commit record (the copy must be the one the step's record names), the rest of it, and the
state tree; every error names the tier and the step."""

from __future__ import annotations

from typing import Any

from tierckpt.errors import CheckpointEvictedError, CheckpointNotFoundError, CorruptCheckpointError, StateError
from tierckpt.format.manifest import Manifest, ManifestHead, decode_head
from tierckpt.format.record import RECORDS_SINCE, decode_record
from tierckpt.format.tree import decode_tree
from tierckpt.tiers.base import CheckpointKey, Tier, TierCopy

__all__ = ["check_committed", "load_head", "load_manifest", "load_rest", "load_tree", "located"]


def located(e: CorruptCheckpointError, tier: Tier, key: CheckpointKey) -> CorruptCheckpointError:
    """``e`` naming ``tier`` and the step (as it is, if it names a tier already)."""
    return e if e.tier is not None else CorruptCheckpointError(str(e), tier=tier.name, step=key.step)


def load_manifest(
    tier: Tier, key: CheckpointKey, *, allow_pickle: bool = True, copy: TierCopy | None = None
) -> Manifest:
    """Read and validate the manifest of ``key`` on ``tier`` (from ``copy``, an opened copy of it, if given).

    Raises:
        StateError: the checkpoint holds pickled values and ``allow_pickle`` is False.
    """
    return load_rest(tier, key, load_head(tier, key, allow_pickle=allow_pickle, copy=copy))


def load_head(
    tier: Tier, key: CheckpointKey, *, allow_pickle: bool = True, copy: TierCopy | None = None
) -> ManifestHead:
    """Read the manifest of ``key`` on ``tier`` (from ``copy``, an opened copy of it, if given) and
    validate its head (what says which blobs to read); :func:`load_rest` validates the rest.

    Raises:
        StateError: the checkpoint holds pickled values and ``allow_pickle`` is False.
    """
    data = copy.read_manifest() if copy is not None else tier.read_manifest(key)
    try:
        head = decode_head(data)
    except CorruptCheckpointError as e:
        raise located(e, tier, key) from None
    if head.version >= RECORDS_SINCE:
        check_committed(tier, key, data)
    if (head.step, head.rank) != (key.step, key.rank):
        raise CorruptCheckpointError(
            f"manifest says step {head.step} rank {head.rank}, stored as step {key.step} rank {key.rank}",
            tier=tier.name,
            step=key.step,
        )
    if head.has_pickle and not allow_pickle:
        raise StateError(
            f"step {key.step} on tier {tier.name!r} holds pickled values; pass allow_pickle=True "
            "to restore() only if you trust where it came from"
        )
    return head


def check_committed(tier: Tier, key: CheckpointKey, manifest: bytes) -> None:
    """Check that ``manifest`` is the copy the step's commit record on ``tier`` names for ``key.rank``.

    Raises:
        CheckpointNotFoundError: the tier holds no record of the step (never committed, or evicted).
        CorruptCheckpointError: the record is damaged.
        CheckpointEvictedError: the record names another copy of the rank (a save of the same step replaced
            it and has not committed yet, or its commit failed): it must not be mixed with the other ranks'
            copies (a reader lists the steps again).
    """
    data = tier.read_record(key.step)
    if data is None:
        raise CheckpointNotFoundError(f"step {key.step} is not committed on tier {tier.name!r} (no commit record)")
    try:
        record = decode_record(data, key.step)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(str(e), tier=tier.name, step=key.step) from None
    if not record.matches(key.rank, manifest):  # not damaged: another save of the step is replacing it
        raise CheckpointEvictedError(
            f"step {key.step} on tier {tier.name!r}: rank {key.rank}'s copy is not the one the step's commit "
            f"record names (of {record.world_size} ranks): the step is being saved again, or that save's "
            "commit did not complete"
        )


def load_rest(tier: Tier, key: CheckpointKey, head: ManifestHead) -> Manifest:
    """The whole manifest of ``head`` (tensor table and tree validated; errors name the tier)."""
    try:
        return head.manifest()
    except CorruptCheckpointError as e:
        raise located(e, tier, key) from None


def load_tree(tier: Tier, key: CheckpointKey, m: Manifest, *, allow_pickle: bool) -> tuple[Any, type[int]]:
    """:func:`~tierckpt.format.tree.decode_tree` of manifest ``m`` (errors name the tier)."""
    try:
        return decode_tree(m.tree, len(m.tensors), m.version, allow_pickle=allow_pickle)
    except CorruptCheckpointError as e:
        raise located(e, tier, key) from None
