"""A per-node copy's place: the one exchange per save and node that gives each rank its region of the
node's data file (docs/distributed.md, "A per-node data file").

Every rank of a node that writes its copy of a step to a ``files: per_node`` tier sends the size of its
part and the multiple its region must start on (:meth:`~tierckpt.tiers.base.Tier.node_part`) under a
key made of the tier, the step and the n-th commit of that step on that tier (unique in the job's run,
as the commit's own keys are); the node's first rank lays the regions out (:func:`lay_out`), creates
the file (:meth:`~tierckpt.tiers.base.Tier.create_node_file`; a full device fails it, and nothing is
evicted for it: :meth:`Mover.with_room <tierckpt.background.mover.Mover.with_room>`) and sends its name and the offsets back. 2 store requests a rank, L + 1 more for the
first (L ranks on the node). The waits are bounded by the coordinator's timeout: a rank that does not
come fails the copy of every rank of its node on that tier, with an error naming the tier, the step and
the node, and the save goes on elsewhere. A rank whose copy fails before its exchange tells its node at
once (the rank executor's ``skip_place``).

Where the coordinator offers no node gather (a third party's, or ranks deciding alone), or the copy is
made by this rank alone (a promotion: no other rank makes it), the rank's node is itself alone: it
creates a node file of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tierckpt.errors import CoordinationError
from tierckpt.format.location import NODE_FILE_RE, Location
from tierckpt.format.manifest import BlobEntry
from tierckpt.ranks.coordinator import Coordinator
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["lay_out", "node_place", "place_key"]

#: runs a write of ``step`` on ``tier`` (the node file's creation) as the mover runs writes (which, on a
#: ``node_files`` tier, makes no room: a full device fails it)
Room = Callable[[Tier, int, Callable[[], str]], str]


#: what a rank that never comes to its node's exchange may mean
_HINT = (
    " (a rank whose tier is not configured alike, e.g. without files: per_node, never comes: every rank of "
    "the job must configure its tiers the same way)"
)


def place_key(tier: str, step: int, n: int) -> str:
    """The exchange's key: the ``n``-th commit of ``step`` on ``tier`` (as ``commit/<tier>/<step>/<n>``)."""
    return f"place/{tier}/{step}/{n}"


def lay_out(parts: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Where each region of a node file starts, and the file's size: the regions in rank order, each
    starting on the next multiple of its unit. ``parts``: ``[size, unit]`` per rank of the node.

    Raises:
        ValueError: a part that is not two ints, a size below 0 or a unit below 1.
    """
    offsets, end = [], 0
    for i, part in enumerate(parts):
        if not (len(part) == 2 and all(type(v) is int for v in part) and part[0] >= 0 and part[1] >= 1):
            raise ValueError(f"node file: rank {i} of the node sent {part!r}, not [size >= 0, unit >= 1]")
        size, unit = part
        start = -(-end // unit) * unit
        offsets.append(start)
        end = start + size
    return offsets, end


def node_place(
    coordinator: Coordinator,
    tier: Tier,
    key: CheckpointKey,
    blobs: Sequence[BlobEntry],
    name: str | None,
    room: Room,
) -> Location:
    """This rank's place for its copy of ``key`` on ``tier`` (a ``node_files`` tier): the node file and
    the offset of its region. ``name``: the exchange's key (:func:`place_key`); None for a copy this rank
    makes alone (it gets a node file of its own).

    Raises:
        CoordinationError: naming the tier, the step and the node: a rank of the node did not take part
            in time, or the node's first rank could not create the file.
        TierFullError, TierIOError: (the node's first rank, or a rank alone) the file cannot be created.
    """
    part = list(tier.node_part(blobs))
    gather = getattr(coordinator, "node_gather", None) if name is not None else None
    on_node = coordinator.ranks_on_node() if gather is not None else [key.rank]
    first = on_node[0]

    def create(parts: list[list[int]]) -> dict[str, Any]:
        offsets, total = lay_out(parts)
        made = room(tier, key.step, lambda: tier.create_node_file(key.step, first, total))
        return {"name": made, "offsets": offsets}

    if gather is None or len(on_node) == 1:
        got = create([part])
    else:
        try:
            got = gather(name, part, create)
        except CoordinationError as e:
            hint = _HINT if "did not arrive" in str(e) else ""
            raise CoordinationError(
                f"tier {tier.name!r}: step {key.step}: node {coordinator.node} (ranks {on_node}) could not share "
                f"a node file: {e}{hint}",
                e.ranks,
            ) from e
    return _mine(got, on_node.index(key.rank), len(on_node))


def _mine(got: Any, index: int, ranks: int) -> Location:
    """This rank's place from the first rank's answer, checked (it came through the job's store)."""
    ok = isinstance(got, dict) and isinstance(got.get("name"), str) and isinstance(got.get("offsets"), list)
    if not ok or not NODE_FILE_RE.fullmatch(got["name"]) or len(got["offsets"]) != ranks:
        raise CoordinationError(f"node file: the node's first rank answered {got!r}, not a name and {ranks} offsets")
    offset = got["offsets"][index]
    if type(offset) is not int or offset < 0:
        raise CoordinationError(f"node file: offset {offset!r} for this rank is not a non-negative int")
    return Location(got["name"], offset)
