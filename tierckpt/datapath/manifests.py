"""A copy's manifest read and validated before any blob byte is: its head (what says which blobs to
read), its commit record (the copy must be the one the step's record names), the rest of it, and the
state tree; every error names the tier and the step."""

from __future__ import annotations

import errno
from typing import Any

from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateError, TierIOError
from tierckpt.format.manifest import Manifest, ManifestHead, decode_head
from tierckpt.format.record import RECORDS_SINCE, decode_record
from tierckpt.format.tree import decode_tree
from tierckpt.tiers.base import CheckpointKey, Tier, TierCopy

__all__ = [
    "UnnamedCopyError",
    "absent",
    "check_committed",
    "load_head",
    "load_manifest",
    "load_rest",
    "load_tree",
    "located",
]


class UnnamedCopyError(CheckpointNotFoundError):
    """A rank's copy is not the one the step's commit record names: a save of the step again replaced it
    and has not committed yet, or never will (it was killed before its record). Not damage: the copy may
    be whole; the step as committed is not on that tier for that rank (a reader takes another tier's copy
    or an older step).

    Attributes:
        tier: the tier's name.
        step: the step.
        rank: the rank whose copy it is.
    """

    def __init__(self, tier: str, step: int, rank: int, world_size: int) -> None:
        super().__init__(
            f"step {step} on tier {tier!r}: rank {rank}'s copy is not the one the step's commit record names "
            f"(of {world_size} ranks): a save of step {step} again replaced it and has not committed, or was "
            "killed before its commit"
        )
        self.tier, self.step, self.rank, self.world_size = tier, step, rank, world_size

    def __reduce__(self) -> tuple[type[UnnamedCopyError], tuple[str, int, int, int]]:
        return type(self), (self.tier, self.step, self.rank, self.world_size)  # pickled whole (DCP sends errors)


def absent(tier: Tier, key: CheckpointKey, e: CheckpointNotFoundError, tiers: str = "") -> BaseException:
    """The error for a copy ``key`` that ``tier`` does not hold (``e``, the tier's): ``e`` itself (gone:
    a reader lists the steps again) where the step's record is gone too (an eviction removes the record
    first) or ``e`` says the tier saw it go; else a :class:`TierIOError` (``ENOENT``) naming the copy: the
    record is there and the copy never was (a node-local tier holds only its node's ranks' copies), so
    the step is unusable on ``tier`` for this reader, at once (``tiers``: the tiers looked at, if several)."""
    if isinstance(e, UnnamedCopyError):
        return e
    try:
        recorded = tier.read_record(key.step) is not None
    except OSError:
        recorded = False
    if not recorded or type(e) is not CheckpointNotFoundError:
        return e
    looked = tiers or repr(tier.name)
    return TierIOError(errno.ENOENT, f"no tier ({looked}) holds a copy of step {key.step} of rank {key.rank} ({e})")


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
        UnnamedCopyError: the record names another copy of the rank (a save of the same step replaced
            it and has not committed yet, or never will): it must not be mixed with the other ranks' copies.
    """
    data = tier.read_record(key.step)
    if data is None:
        raise CheckpointNotFoundError(f"step {key.step} is not committed on tier {tier.name!r} (no commit record)")
    try:
        record = decode_record(data, key.step)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(str(e), tier=tier.name, step=key.step) from None
    if not record.matches(key.rank, manifest):  # not damaged: another save of the step replaced it
        raise UnnamedCopyError(tier.name, key.step, key.rank, record.world_size)


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
