"""A tier's reads and writes paced by its bandwidth budget (:attr:`Tier.budget
<tierckpt.tiers.base.Tier.budget>`; docs/tiers.md, "Bandwidth budgets").

Every reader and writer the data path opens on a tier goes through :func:`throttled_reader` /
:func:`throttled_writer`, told whether the work is background work (a demotion, a promotion after a
restore, an ``on_close`` flush, a non-blocking save) or foreground work that a caller waits for (a
prefetch, a blocking save, a restore). The bucket is charged before each operation is handed to the tier
(a chunk, or a save's piece of one), never per byte, so the operations it lets through are in flight
together at the engine's queue depth. An operation the budget does not pace is counted (its
``unthrottled_bytes``) and takes nothing from the bucket. Memory copies that bypass ``read``/``write``
(a memory tier's own buffers) are not seen: a memory tier takes no budget.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from tierckpt.io.budget import Budget
from tierckpt.tiers.base import Tier, TierReader, TierWriter

__all__ = ["throttled_reader", "throttled_writer"]


def _charge(budget: Budget, background: bool, nbytes: int) -> None:
    if budget.paces(background):
        budget.take(nbytes)
    else:
        budget.record(nbytes)


class _Writer(TierWriter):
    def __init__(self, inner: TierWriter, budget: Budget, background: bool) -> None:
        self._inner, self._budget, self._background = inner, budget, background
        self._cancelled = False

    def buffer(self, blob: int) -> torch.Tensor | None:
        return self._inner.buffer(blob)

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        if not self._cancelled:  # a cancelled writer's writes fail at once: not after waiting for the budget
            _charge(self._budget, self._background, nbytes)
        return self._inner.write(blob, offset, addr, nbytes)

    def commit(self, manifest: bytes) -> None:
        self._inner.commit(manifest)

    def abort(self) -> None:
        self._inner.abort()

    def cancel(self) -> None:
        self._cancelled = True
        self._inner.cancel()


class _Reader(TierReader):
    def __init__(self, inner: TierReader, budget: Budget, background: bool) -> None:
        self._inner, self._budget, self._background = inner, budget, background

    def buffer(self, blob: int) -> torch.Tensor | None:
        return self._inner.buffer(blob)

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        _charge(self._budget, self._background, nbytes)
        return self._inner.read(blob, offset, addr, nbytes)

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return self._inner.read_alignment(blob)

    def close(self) -> None:
        self._inner.close()


def throttled_writer(tier: Tier, writer: TierWriter, *, background: bool) -> TierWriter:
    """``writer`` (of ``tier``), its writes charged to the tier's budget; as it is where there is none."""
    return writer if tier.budget is None else _Writer(writer, tier.budget, background)


def throttled_reader(tier: Tier, reader: TierReader, *, background: bool) -> TierReader:
    """``reader`` (of ``tier``), its reads charged to the tier's budget; as it is where there is none."""
    return reader if tier.budget is None else _Reader(reader, tier.budget, background)
