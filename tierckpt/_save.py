"""Save data path: pack tensors once into aligned chunks, checksum them, write every chunk to every tier.

The packing thread copies tensor bytes with ``ctypes.memmove`` (GIL released, single-threaded; torch's
multi-threaded ``copy_`` stalls on small tensors, URING.md §9) into either the top memory tier's own
blob buffers or a small pool of reusable staging buffers, while the I/O engines write earlier chunks.
Gaps and padding are zeroed, so the same state always gives the same bytes.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch
import xxhash

from tierckpt.format.layout import Layout
from tierckpt.format.tree import FlatState
from tierckpt.io.buffers import StagingPool, memmove, ptr_mv
from tierckpt.tiers.base import TierWriter

__all__ = ["contiguous_cpu", "pack_and_write"]

log = logging.getLogger(__name__)
_EMPTY_DIGEST = xxhash.xxh3_64_intdigest(b"")


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a contiguous CPU tensor (a copy only where needed)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t if t.is_contiguous() else t.contiguous()


def pack_and_write(
    flat: FlatState,
    layout: Layout,
    writers: dict[str, TierWriter],
    failed: dict[str, BaseException],
    pool: Callable[[], StagingPool],
    chunk_bytes: int,
    on_staged: Callable[[], None] | None = None,
) -> list[int]:
    """Pack every tensor, hand each chunk to every writer, wait for the writes; return the checksums.

    A writer whose write fails is recorded in ``failed`` (first error) and gets no further chunks; the
    others go on. ``on_staged`` runs once every tensor byte has been copied out of the caller's state.
    """
    tensors, extents = flat.tensors, layout.extents
    checksums = [_EMPTY_DIGEST] * len(tensors)
    order = sorted(range(len(tensors)), key=lambda i: (extents[i].blob, extents[i].offset))
    order = [i for i in order if extents[i].length]
    mem = next(
        (n for n, w in writers.items() if n not in failed and layout.blob_sizes and w.buffer(0) is not None),
        None,
    )
    inflight: deque[tuple[StagingPool | None, object, list[tuple[str, Future[int]]]]] = deque()

    def drain_one() -> None:
        owner, slot, futs = inflight.popleft()
        for name, f in futs:
            try:
                f.result()
            except BaseException as e:
                if name not in failed:
                    log.error("writing to tier %r failed: %s", name, e)
                    failed[name] = e
        if owner is not None:
            owner.release(slot)  # type: ignore[arg-type]

    k = 0  # position in order
    src: torch.Tensor | None = None
    hasher = xxhash.xxh3_64()
    try:
        for b, size in enumerate(layout.blob_sizes):
            primary = writers[mem].buffer(b) if mem is not None else None
            for c0 in range(0, size, chunk_bytes):
                c1 = min(size, c0 + chunk_bytes)
                owner: StagingPool | None = None
                slot = None
                if primary is not None:
                    base = primary.data_ptr() + c0
                else:
                    owner = pool()
                    while sum(1 for o, _, _ in inflight if o is not None) >= owner.slots:
                        drain_one()
                    slot = owner.acquire()
                    base = slot.data_ptr()
                cursor = c0
                while k < len(order) and extents[order[k]].blob == b and extents[order[k]].offset < c1:
                    i = order[k]
                    e = extents[i]
                    a, z = max(e.offset, c0), min(e.offset + e.length, c1)
                    if a > cursor:
                        ctypes.memset(base + cursor - c0, 0, a - cursor)
                    if src is None:
                        src = contiguous_cpu(tensors[i].tensor)
                        hasher.reset()
                    memmove(base + a - c0, src.data_ptr() + a - e.offset, z - a)
                    hasher.update(ptr_mv(base + a - c0, z - a, writable=False))
                    cursor = z
                    if z < e.offset + e.length:
                        break  # the extent goes on in the next chunk
                    checksums[i] = hasher.intdigest()
                    src = None
                    k += 1
                if cursor < c1:
                    ctypes.memset(base + cursor - c0, 0, c1 - cursor)
                futs = []
                for name, w in writers.items():
                    if name in failed or name == mem:
                        continue
                    try:
                        futs.append((name, w.write(b, c0, base, c1 - c0)))
                    except BaseException as e:
                        log.error("writing to tier %r failed: %s", name, e)
                        failed[name] = e
                inflight.append((owner, slot, futs))
        if on_staged is not None:
            on_staged()
    finally:
        while inflight:
            drain_one()
    return checksums
