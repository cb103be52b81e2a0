"""One step's copies on one tier, read as full tensors a bounded number of bytes at a time (for export).

Rank 0's copy gives the state tree and the plain (non-DTensor) tensors. A DTensor is read from every
saved rank's copy whose shard overlaps the part wanted, through the resharding restore's range reads
(:mod:`tierckpt.datapath.shardread`: the checksum chunks that hold the part, each verified; a compressed
copy's frames decoded as they are read): a checkpoint saved by many ranks is consolidated in one process,
with no process group. A DTensor larger than the bound is read in slabs of whole rows of its first
dimension (its copies carry a checksum per chunk); a plain tensor is read whole (its one checksum covers
all of its bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tierckpt.datapath.manifests import located
from tierckpt.datapath.shardread import Copies, Dest, Filler
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import dtype_from_name
from tierckpt.format.tree import decode_tree
from tierckpt.interop.names import Leaf, leaves
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["Part", "StepSource"]


@dataclass(frozen=True)
class Part:
    """A box of tensor row ``row`` to read: ``sizes`` at global ``offsets``; its bytes are the full
    tensor's from ``start`` on (a slab of whole rows of the first dimension, or the whole tensor), for
    output item ``item``."""

    item: int
    row: int
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    start: int
    nbytes: int


def _fresh(sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor to read a part into (one function, so that a test can count what is held)."""
    return torch.empty(sizes, dtype=dtype)


class StepSource:
    """Step ``step``'s copies on ``tier`` (another rank's copy that ``tier`` lacks: from the first of
    ``others`` holding it), opened: rank 0's manifest validated and its state tree decoded (a pickled
    value stays its bytes, never unpickled). Close it (or use it as a context manager).

    Raises:
        CheckpointNotFoundError: the copy went away (evicted).
        TierIOError: ``tier`` holds the step's record but not rank 0's copy.
        CorruptCheckpointError: the manifest or tree fails validation.
    """

    def __init__(self, tier: Tier, step: int, others: Sequence[Tier] = ()) -> None:
        self.tier, self.step = tier, step
        self.copies = Copies(tier, step, True, others)  # pickled values are checked, never loaded
        try:
            self.base = self.copies.base(0)
            m = self.manifest = self.base.m
            try:
                tree, ref = decode_tree(m.tree, len(m.tensors), m.version, allow_pickle=True, unpickle=False)
                self.leaves: list[Leaf] = leaves(tree, ref, len(m.tensors))
            except CorruptCheckpointError as e:
                raise located(e, tier, CheckpointKey(step, self.base.rank)) from None
        except BaseException:
            self.copies.close()
            raise

    def close(self) -> None:
        self.copies.close()

    def __enter__(self) -> StepSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shape(self, row: int) -> tuple[int, ...]:
        """The full shape of row ``row`` (a DTensor's global shape)."""
        spec = self.manifest.sharding.get(row)
        return spec.global_shape if spec is not None else self.manifest.tensors.shapes[row]

    def dtype(self, row: int) -> torch.dtype:
        return dtype_from_name(self.manifest.tensors.dtypes[row])

    def parts(self, rows: Sequence[int], bound: int) -> list[Part]:
        """The parts to read rows ``rows`` (item ``i`` is ``rows[i]``) in: each whole, or, for a DTensor
        over ``bound`` bytes, slabs of whole rows of its first dimension of at most ``bound`` bytes (at
        least one row)."""
        out = []
        for item, row in enumerate(rows):
            shape, size = self.shape(row), self.dtype(row).itemsize
            total = math.prod(shape) * size
            if row not in self.manifest.sharding or total <= bound or len(shape) == 0 or shape[0] < 2:
                out.append(Part(item, row, shape, (0,) * len(shape), 0, total))
                continue
            per_row = total // shape[0]
            step = max(1, bound // per_row)
            for r0 in range(0, shape[0], step):
                n = min(step, shape[0] - r0)
                sizes = (n, *shape[1:])
                out.append(Part(item, row, sizes, (r0, *(0,) * (len(shape) - 1)), r0 * per_row, n * per_row))
        return out

    def windows(self, parts: Sequence[Part], bound: int) -> Iterator[list[tuple[Part, torch.Tensor]]]:
        """The parts read, in order, a window at a time: the parts of one window hold at most ``bound``
        bytes together (a part larger than that is a window alone); each window is read before it is
        handed out and dropped once the next is asked for. The reads themselves stage at most the
        tier's read staging (:attr:`~tierckpt.io.geometry.IOGeometry.read_staging_bytes`) at once.

        Raises:
            CorruptCheckpointError: a byte read fails verification (naming the tier, rank, blob and key).
            CheckpointNotFoundError, TierIOError: a rank's copy is missing or unreadable.
        """
        window: list[Part] = []
        held = 0
        for p in parts:
            if window and held + p.nbytes > bound:
                yield self._read(window)
                window, held = [], 0
            window.append(p)
            held += p.nbytes
        if window:
            yield self._read(window)

    def _read(self, window: list[Part]) -> list[tuple[Part, torch.Tensor]]:
        outs = [_fresh(p.sizes, self.dtype(p.row)) for p in window]
        Filler(self.copies, self.base).fill([Dest(p.row, o, (p.sizes, p.offsets)) for p, o in zip(window, outs)])
        return list(zip(window, outs))
