"""Reading replicated bytes once: in a job, the ranks of a ``Replicate`` group of a DTensor target split
the reads of the box they all hold, then exchange the pieces over the mesh's own process groups
(docs/distributed.md, "Reading replicated bytes once").

For a DTensor target whose placements hold ``Replicate`` on mesh dims ``D`` (each of size > 1), every
rank with the same coordinates on the other dims holds the same box. Of the ``k`` members of that
group (ordered by their coordinates on ``D``, row-major), one that saved a shard holding the whole box
reads it from its own copy (the usual restart: the replica that wrote it); else they split the box
along its first dim of size > 1 (so that each piece is one contiguous range of the local shard and of
every saved shard it overlaps) into ``n = min(k, that dim's size, box bytes // MIN_PIECE_BYTES)``
near-equal pieces, read by ``n`` consecutive members (which ones: from a hash of the key path, so that
small tensors spread over the group). Each rank reads and verifies only its pieces (shardread.py, as
for any box), on whatever tier its restore falls back to.

Then the ranks agree, through the hierarchy's coordinator (one keyed ``gather``: its store, its
timeout), that every rank's reads succeeded, on the same step, with the same plan for every group (a
digest of the group's entries); only then do they run the collectives, so a rank that failed never
leaves the others blocked in a collective, and no rank copies in bytes nobody verified. A rank that
failed raises its own error; every other rank raises :class:`~tierckpt.errors.CoordinationError` naming
it and its error. The exchange runs over the replicated dims last to first (one ``broadcast`` per
non-empty block and dim, on ``device_mesh.get_group(dim)``, of the local shard's own memory as bytes), in
the order of the key paths, which is the same on every rank, so collectives never cross.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import xxhash

from tierckpt.datapath.matching import holds_dtensor
from tierckpt.errors import CoordinationError
from tierckpt.format.sharding import DEFAULT_CHUNK_BYTES
from tierckpt.ranks.coordinator import Coordinator, dist_rank

__all__ = ["MIN_PIECE_BYTES", "ReplicaExchange", "replica_exchange", "settled"]

log = logging.getLogger("tierckpt.hierarchy")
T = TypeVar("T")
#: the smallest piece a rank reads of a replicated box: a piece reads whole checksum chunks (the format's,
#: 4 MiB as written), so smaller pieces would read more in all than one rank reading the whole box. A split
#: of the work among ranks, from the format's checksum chunk: the reads themselves are the tier's geometry's
MIN_PIECE_BYTES = DEFAULT_CHUNK_BYTES
_ERR_CHARS = 2000  # of a failed rank's error, in the agreement
_NAMED = 8  # failed ranks whose errors a message quotes
_counts: weakref.WeakKeyDictionary[Coordinator, itertools.count[int]] = weakref.WeakKeyDictionary()
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class _Entry:
    """One replicated target: this rank's local shard, how its group splits it, and the groups."""

    path: str
    local: torch.Tensor
    dim: int  # the dim of the local shard the pieces split
    bounds: tuple[int, ...]  # member c reads [bounds[c], bounds[c + 1]) of ``dim``
    me: int  # this rank's index in the group (row-major over the replicated dims)
    sizes: tuple[int, ...]  # members along each replicated dim
    srcs: tuple[tuple[int, ...], ...]  # per replicated dim: the global rank at each coordinate (others: mine)
    groups: tuple[Any, ...]  # per replicated dim: the mesh's process group
    members: tuple[int, ...]  # global ranks, row-major over the replicated dims
    describe: str  # what every member of the group must plan identically


class ReplicaExchange:
    """The replicated targets of one ``restore(into=)`` in a job: their split (:meth:`plan`, while the
    target is matched), the agreement and the exchange (:meth:`settle`, after the reads).

    Args:
        coordinator: the hierarchy's coordinator (every rank of the job calls :meth:`settle` or
            :meth:`fail` once, in the same order as its other restores).
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.rank = coordinator.rank
        self.key = f"replicas/{next(_counts.setdefault(coordinator, itertools.count(1)))}"
        self.entries: list[_Entry] = []

    def reset(self) -> None:
        """Forget the plan (a read of another tier or step plans again)."""
        self.entries.clear()

    def plan(
        self, path: str, dtensor: Any, local: torch.Tensor, box: Box, stored_by: Callable[[int], Box | None]
    ) -> tuple[torch.Tensor, Box] | None:
        """This rank's piece of a DTensor target's local shard ``local`` (global box ``box``): the part
        of ``local`` to read and its global box, or None where the target is not replicated (read it
        all, as a single rank does). ``stored_by(rank)``: the box saved rank ``rank`` stored of this
        tensor (None: none); a member that stored a box holding all of ``box`` reads it all, from
        its own copy (the usual restart: the replica that saved it), and the others read nothing."""
        mesh = dtensor.device_mesh
        dims = [d for d, p in enumerate(dtensor.placements) if p.is_replicate() and mesh.size(d) > 1]
        sizes, offsets = box
        coord = mesh.get_coordinate()
        if not dims or not sizes or not math.prod(sizes) or coord is None:  # 0-d: each replica reads its few bytes
            return None
        try:
            groups = tuple(mesh.get_group(d) for d in dims)
        except Exception as e:  # a mesh without process groups: read it all (the digest tells the others)
            log.debug("restore: %s: no process group on its mesh (%s); every replica reads it", path, e)
            return None
        ranks = mesh.mesh
        ks = tuple(mesh.size(d) for d in dims)
        srcs = tuple(tuple(int(ranks[_at(coord, d, x)]) for x in range(k)) for d, k in zip(dims, ks))
        members = tuple(int(ranks[_at_all(coord, dims, xs)]) for xs in itertools.product(*map(range, ks)))
        me, k = members.index(self.rank), len(members)
        split = next((d for d, n in enumerate(sizes) if n > 1), 0)
        owner = next((c for c, g in enumerate(members) if _holds(stored_by(g), box)), None)
        if owner is not None:
            n, first = 1, owner
        else:
            n = max(1, min(k, sizes[split], local.element_size() * math.prod(sizes) // MIN_PIECE_BYTES))
            first = xxhash.xxh3_64_intdigest(path.encode()) % (k - n + 1)
        bounds = _bounds(sizes[split], n, first, k)
        describe = repr((path, tuple(dtensor.shape), str(local.dtype), tuple(mesh.shape), dims, box, split, bounds))
        self.entries.append(_Entry(path, local, split, bounds, me, ks, srcs, groups, members, describe))
        lo, hi = bounds[me], bounds[me + 1]
        psizes = (*sizes[:split], hi - lo, *sizes[split + 1 :])
        poffs = (*offsets[:split], offsets[split] + lo, *offsets[split + 1 :])
        return local.narrow(split, lo, hi - lo), (psizes, poffs)

    def settle(self, step: int) -> None:
        """After this rank read ``step``: agree with every rank, then exchange the pieces.

        Raises:
            CoordinationError: another rank's reads failed (naming it and its error), the ranks planned
                different exchanges, or a rank did not arrive within the coordinator's timeout.
        """
        groups: dict[tuple[int, ...], list[str]] = {}
        for e in self.entries:
            groups.setdefault(e.members, []).append(e.describe)
        mine = [[_digest(repr(g)), len(g), _digest("\n".join(sorted(d)))] for g, d in groups.items()]
        verdict = self.coordinator.gather(self.key, {"ok": True, "step": step, "groups": mine}, _judge)
        if verdict.get("err"):
            raise CoordinationError(f"restore of step {step}: {verdict['err']}", tuple(verdict["ranks"]))
        if not verdict["go"]:  # ranks read different steps: nothing is exchanged, the restore agrees on one
            return
        moved = 0
        for e in sorted(self.entries, key=lambda e: (e.path, e.members)):
            moved += _exchange(e)
        if self.entries:
            log.debug("restore: step %d: %d replicated tensors exchanged (%d bytes)", step, len(self.entries), moved)

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks that this rank's reads failed (they raise naming it); never raises."""
        try:
            self.coordinator.gather(
                self.key, {"ok": False, "err": f"{type(error).__name__}: {error}"[:_ERR_CHARS]}, _judge
            )
        except Exception as e:  # the caller raises its own error
            log.debug("restore: telling the other ranks of this rank's failure failed: %s", e)


def replica_exchange(coordinator: Coordinator, into: Any) -> ReplicaExchange | None:
    """The exchange of a ``restore(into=...)``, or None where replicated targets are read by every
    replica, as in a single process: no target, no DTensor in it, a coordinator of one rank (or one
    that does not connect the ranks, ``connects_ranks`` False: ranks that do not restore together), or
    no process group whose ranks are the coordinator's."""
    if into is None or coordinator.world_size < 2 or not coordinator.connects_ranks:
        return None
    if dist_rank() != (coordinator.rank, coordinator.world_size) or not holds_dtensor(into):
        return None
    return ReplicaExchange(coordinator)


def settled(exchange: ReplicaExchange | None, read: Callable[[], tuple[T, int, str]]) -> tuple[T, int, str]:
    """``read()`` (a restore's choice and read of a copy: ``(state, step, tier)``), then the exchange's
    agreement and collectives; where ``read`` raises, the other ranks are told before it propagates."""
    if exchange is None:
        return read()
    try:
        got = read()
    except Exception as e:  # not a KeyboardInterrupt: that process is going away, the others time out
        exchange.fail(e)
        raise
    exchange.settle(got[1])
    return got


def _judge(values: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's verdict on every rank's report: an error naming the ranks that failed or disagree,
    else whether they read one step (``go``: exchange)."""
    failed = [(r, v["err"]) for r, v in enumerate(values) if not v["ok"]]
    if failed:
        said = "; ".join(f"rank {r}: {err}" for r, err in failed[:_NAMED])
        more = f" (and {len(failed) - _NAMED} more ranks)" if len(failed) > _NAMED else ""
        ranks = [r for r, _ in failed]
        return {"go": False, "err": f"rank(s) {_short(ranks)} could not read their part: {said}{more}", "ranks": ranks}
    if len({v["step"] for v in values}) > 1:
        return {"go": False, "err": None, "ranks": []}
    problems = _disagreements(values)
    if problems:
        said, ranks = "; ".join(p for p, _ in problems[:_NAMED]), sorted({r for _, rs in problems for r in rs})
        return {"go": False, "err": f"the ranks' targets differ in their replicated DTensors: {said}", "ranks": ranks}
    return {"go": True, "err": None, "ranks": []}


def _disagreements(values: Sequence[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    """Each replica group whose members did not all plan it, or planned it differently: (what, ranks)."""
    seen: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    for r, v in enumerate(values):
        for group, size, digest in v["groups"]:
            seen.setdefault(group, (size, []))[1].append((r, digest))
    out = []
    for size, got in seen.values():
        ranks = [r for r, _ in got]
        if len(got) != size:
            out.append((f"ranks {_short(ranks)} plan an exchange among {size} ranks that only they plan", ranks))
        elif len({d for _, d in got}) > 1:  # name the ranks that differ from the most common plan
            common = Counter(d for _, d in got).most_common(1)[0][0]
            odd = [r for r, d in got if d != common]
            same = [r for r, d in got if d == common]
            out.append((f"rank(s) {_short(odd)} plan other exchanges than ranks {_short(same)} of their group", odd))
    return out


def _short(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" … ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def _exchange(e: _Entry) -> int:
    """Run one entry's broadcasts over its replicated dims, last to first: after dim ``j`` each member
    holds the pieces of every member that shares its coordinates on the dims before ``j``. Returns the
    bytes this rank received."""
    import torch.distributed as dist

    got, span = 0, 1
    for j in reversed(range(len(e.sizes))):
        k = e.sizes[j]
        base = e.me // (span * k) * (span * k)
        mine = e.me // span % k
        for x in range(k):
            lo, hi = e.bounds[base + x * span], e.bounds[base + (x + 1) * span]
            if hi == lo:
                continue
            view = e.local.narrow(e.dim, lo, hi - lo)
            buf = view if view.is_contiguous() else view.contiguous()
            with torch.no_grad():
                dist.broadcast(buf.reshape(-1).view(torch.uint8), src=e.srcs[j][x], group=e.groups[j])
                if x != mine:
                    got += buf.nbytes
                    if buf is not view:
                        view.copy_(buf)
        span *= k
    return got


def _bounds(size: int, n: int, first: int, k: int) -> tuple[int, ...]:
    """Where each of ``k`` members' pieces starts along a dim of ``size``: ``n`` near-equal pieces, to
    members ``first`` .. ``first + n - 1`` (the others read nothing); ``k + 1`` entries."""
    parts = [size // n + (i < size % n) for i in range(n)]
    edges = list(itertools.accumulate(parts, initial=0))
    return tuple(edges[min(max(c - first, 0), n)] for c in range(k + 1))


def _holds(outer: Box | None, inner: Box) -> bool:
    """Whether box ``outer`` holds all of box ``inner``."""
    if outer is None:
        return False
    return all(o <= i and i + m <= o + n for (n, o), (m, i) in zip(zip(*outer), zip(*inner)))


def _at(coord: Sequence[int], dim: int, x: int) -> tuple[int, ...]:
    return tuple(x if d == dim else c for d, c in enumerate(coord))


def _at_all(coord: Sequence[int], dims: Sequence[int], xs: Sequence[int]) -> tuple[int, ...]:
    out = list(coord)
    for d, x in zip(dims, xs):
        out[d] = x
    return tuple(out)


def _digest(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode())
