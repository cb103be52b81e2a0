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
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import xxhash

from tierckpt.errors import StateError
from tierckpt.format.layout import Layout
from tierckpt.format.manifest import BlobEntry, Manifest, TensorTable, dtype_name, encode_manifest
from tierckpt.format.native import Records, native, records
from tierckpt.format.table import blob_spans
from tierckpt.format.tree import FlatState, TensorRef
from tierckpt.io.buffers import StagingPool, memmove, ptr_mv
from tierckpt.tiers.base import TierWriter

__all__ = ["build_manifest", "contiguous_cpu", "pack_and_write"]

log = logging.getLogger(__name__)
_EMPTY_DIGEST = xxhash.xxh3_64_intdigest(b"")
_PIECES = 4  # writes per staging chunk, each handed to the writers as soon as it is packed
_BLOCK_BYTES = 1 << 20  # copy-then-hash unit: the hash reads the bytes while they are still cached
xxh3_64_intdigest = xxhash.xxh3_64_intdigest
_ZEROS = bytes(4096)


def _zero(view: memoryview, start: int, stop: int) -> None:
    """Zero ``view[start:stop]``: a slice assignment for the usual small gaps, memset for long ones."""
    if stop - start <= len(_ZEROS):
        view[start:stop] = _ZEROS[: stop - start]
    else:
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(view, start)), 0, stop - start)


def _source(t: torch.Tensor) -> int:
    """The address the C loop may copy ``t``'s bytes from, or 0 (not a contiguous CPU tensor)."""
    return t.data_ptr() if t.is_cpu and t.is_contiguous() and not (t.is_neg() or t.is_conj()) else 0


def _resized(ref: TensorRef, nbytes: int, planned: int) -> StateError:
    return StateError(
        f"{ref.path} holds {nbytes} bytes now but {planned} when it was saved: a tensor of the state was "
        "replaced or resized before the save copied it (wait for handle.staged before changing the state)"
    )


def _fill_sources(
    recs: Records, tensors: Sequence[TensorRef], order: list[int], e_blob: list[int], e_off: list[int],
    e_len: list[int], k: int, blob: int, stop: int,
) -> int:  # fmt: skip
    """Set the source address of the records from position ``k`` up to the first tensor at or past
    offset ``stop`` of ``blob``; returns that position. A tensor whose size is no longer the one the
    layout was planned with raises (its bytes would be read past their end)."""
    table, n = recs.table, len(order)
    while k < n:
        i = order[k]
        b = e_blob[i]
        if b > blob or (b == blob and e_off[i] >= stop):
            break
        t = tensors[i].tensor
        if t.nbytes != e_len[i]:
            raise _resized(tensors[i], t.nbytes, e_len[i])
        table[4 * k + 3] = _source(t)
        k += 1
    return k


#: integer dtypes by item size: a non-contiguous tensor is gathered as one of them, bit for bit, since
#: torch has no copy kernel for some dtypes (``torch.int1`` ... ``torch.uint7``, ``torch.bits16`` ...)
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a contiguous CPU tensor (a copy only where needed; the copy's dtype may be
    an integer one of the same item size: only the bytes count)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_contiguous():
        return t
    same = _SAME_SIZE_INT.get(t.element_size())
    return t.view(same).contiguous() if same is not None else t.contiguous()


def pack_and_write(
    flat: FlatState,
    layout: Layout,
    writers: dict[str, TierWriter],
    failed: dict[str, BaseException],
    pool: Callable[[], StagingPool],
    chunk_bytes: int,
    on_staged: Callable[[], None] | None = None,
    on_packed: Callable[[list[int]], None] | None = None,
) -> list[int]:
    """Pack every tensor, hand each chunk to every writer, wait for the writes; return the checksums.

    A chunk is handed to the writers in ``_PIECES`` pieces, each as soon as it is packed, so the disk
    gets the first bytes of a chunk while the rest is still being packed and always has several
    operations queued (whole-chunk writes from 3 staging slots kept only 2 in flight while the third
    was packed). Bytes are copied and hashed in ``_BLOCK_BYTES`` blocks, so the hash reads them from
    the cache, and small gaps are zeroed by slice assignment (a ctypes call costs ~1 us; there is a
    gap next to almost every one of 20,000 small tensors).

    A writer whose write fails is recorded in ``failed`` (first error) and gets no further chunks; the
    others go on. ``on_staged`` runs once every tensor byte has been copied out of the caller's state;
    ``on_packed(checksums)`` once every checksum is known too, before the writes still in flight are
    waited for (the manifest is built then, while the disk writes the last chunks).
    """
    tensors, e_blob, e_off, e_len = flat.tensors, layout.blobs, layout.offsets, layout.lengths
    checksums = [_EMPTY_DIGEST] * len(tensors)
    order = [i for i, n in enumerate(e_len) if n]
    order.sort(key=e_off.__getitem__)
    order.sort(key=e_blob.__getitem__)  # stable: (blob, offset); linear when plan() made the layout
    mem = next(
        (n for n, w in writers.items() if n not in failed and layout.blob_sizes and w.buffer(0) is not None),
        None,
    )
    # Packing into a memory tier's own buffers with no other writer: copy now, hash after ``on_staged``
    # (the bytes no longer change then), so the caller's wait is the copies alone, and each copy is one
    # GIL-free call per piece instead of a copy and a hash per block.
    defer = mem is not None and all(n == mem or n in failed for n in writers)
    piece_bytes = max(layout.align, chunk_bytes // _PIECES // layout.align * layout.align)
    inflight: deque[tuple[StagingPool | None, object, list[tuple[str, Future[int]]]]] = deque()
    staged = 0  # chunks in flight that hold a staging slot

    def drain_one() -> None:
        nonlocal staged
        owner, slot, futs = inflight.popleft()
        for name, f in futs:
            try:
                f.result()
            except BaseException as e:
                if name not in failed:
                    log.error("writing to tier %r failed: %s", name, e)
                    failed[name] = e
        if owner is not None:
            staged -= 1
            owner.release(slot)  # type: ignore[arg-type]

    def submit(b: int, off: int, addr: int, n: int, futs: list[tuple[str, Future[int]]]) -> None:
        for name, w in writers.items():
            if name in failed or name == mem:
                continue
            try:
                futs.append((name, w.write(b, off, addr, n)))
            except BaseException as e:
                log.error("writing to tier %r failed: %s", name, e)
                failed[name] = e

    k, nk = 0, len(order)  # position in order
    src, held = 0, None  # address of the tensor being packed (0: none) and its CPU copy, kept alive
    hasher = xxhash.xxh3_64()
    # The C loop packs (and hashes) runs of whole tensors straight from the caller's memory, without the
    # GIL; a tensor that is not a contiguous CPU one (source 0), or larger than a block, is packed below.
    recs, gather = None, native.gather if native is not None else None
    spans: dict[int, tuple[int, int]] = {}
    done: list[tuple[int, int]] = []  # [k0, k1) ranges of order packed by the C loop
    filled = 0  # positions of order whose source address recs holds: set piece by piece, just ahead of
    # the C loop, so the first write does not wait for a pass over every tensor (~1-2 us each, 20-40 ms
    # for 20,000 tensors) and the rest of that pass runs while the disk writes
    if gather is not None:
        recs = records(order, e_off, e_len, checksums)
        spans = blob_spans(order, e_blob)
    max_len = (1 << 64) - 1 if defer else _BLOCK_BYTES
    try:
        for b, size in enumerate(layout.blob_sizes):
            primary = writers[mem].buffer(b) if mem is not None else None
            for c0 in range(0, size, chunk_bytes):
                c1 = min(size, c0 + chunk_bytes)
                owner: StagingPool | None = None
                slot = None
                if primary is not None:
                    base = primary.data_ptr()  # pack in place: blob offsets are buffer offsets
                else:
                    owner = pool()
                    while staged >= owner.slots:
                        drain_one()
                    slot = owner.acquire()
                    staged += 1
                    base = slot.data_ptr() - c0  # so that base + blob offset lands in the slot
                futs: list[tuple[str, Future[int]]] = []
                inflight.append((owner, slot, futs))
                view = ptr_mv(base + c0, c1 - c0)  # the chunk; sliced below, cheaper than a view each time
                for p0 in range(c0, c1, piece_bytes):
                    p1 = min(c1, p0 + piece_bytes)
                    cursor = p0
                    while k < nk:
                        if recs is not None and not src:
                            if filled < nk:
                                filled = _fill_sources(recs, tensors, order, e_blob, e_off, e_len, filled, b, p1)
                            k0 = k
                            k, cursor = gather(
                                recs.table,
                                k,
                                spans.get(b, (k, k))[1],
                                base + p0,
                                p0,
                                p1 - p0,
                                cursor,
                                max_len,
                                not defer,
                            )  # type: ignore[misc]
                            if k > k0:
                                done.append((k0, k))
                            if k == nk:
                                break
                        i = order[k]
                        off = e_off[i]
                        if e_blob[i] != b or off >= p1:
                            break
                        end = off + e_len[i]
                        a, z = max(off, p0), min(end, p1)
                        if a > cursor:
                            _zero(view, cursor - c0, a - c0)
                        if not src:
                            held = contiguous_cpu(tensors[i].tensor)
                            if held.nbytes != e_len[i]:
                                raise _resized(tensors[i], held.nbytes, e_len[i])
                            src = held.data_ptr()
                            if a == off and z == end and (defer or z - a <= _BLOCK_BYTES):  # whole tensor
                                memmove(base + a, src, z - a)
                                if not defer:
                                    checksums[i] = xxh3_64_intdigest(view[a - c0 : z - c0])
                                src, held, cursor, k = 0, None, z, k + 1
                                continue
                            hasher.reset()
                        if defer:
                            memmove(base + a, src + a - off, z - a)
                        else:
                            for q in range(a, z, _BLOCK_BYTES):
                                n = min(_BLOCK_BYTES, z - q)
                                memmove(base + q, src + q - off, n)
                                hasher.update(view[q - c0 : q - c0 + n])
                        cursor = z
                        if z < end:
                            break  # the extent goes on in the next piece
                        if not defer:
                            checksums[i] = hasher.intdigest()
                        src, held, k = 0, None, k + 1
                    if cursor < p1:
                        _zero(view, cursor - c0, p1 - c0)
                    submit(b, p0, base + p0, p1 - p0, futs)
                del view
        if recs is not None and not defer:
            table = recs.table
            for k0, k1 in done:
                for pos in range(k0, k1):
                    checksums[order[pos]] = table[4 * pos + 2]
        if on_staged is not None:
            on_staged()
        if defer:
            bases = [writers[mem].buffer(b).data_ptr() for b in range(len(layout.blob_sizes))]  # type: ignore[index, union-attr]
            if recs is not None:  # one GIL-free call per blob
                for b, base in enumerate(bases):
                    native.hash_into(recs.table, *spans.get(b, (0, 0)), base)  # type: ignore[union-attr]
                table = recs.table
                for pos, i in enumerate(order):
                    checksums[i] = table[4 * pos + 2]
            else:
                for i in order:
                    checksums[i] = xxh3_64_intdigest(ptr_mv(bases[e_blob[i]] + e_off[i], e_len[i], writable=False))
        if on_packed is not None:
            on_packed(checksums)
    finally:
        while inflight:
            drain_one()
    return checksums


def build_manifest(
    flat: FlatState,
    srcs: list[torch.Tensor],
    layout: Layout,
    blobs: tuple[BlobEntry, ...],
    checksums: list[int],
    *,
    step: int,
    rank: int,
    world_size: int,
    align: int,
) -> bytes:
    """The encoded manifest of a packed checkpoint (``srcs[i]`` is the tensor of ``flat.tensors[i]``)."""
    table = TensorTable(
        [r.path for r in flat.tensors], [dtype_name(t.dtype) for t in srcs], [tuple(t.shape) for t in srcs],
        layout.blobs, layout.offsets, layout.lengths, checksums,
    )  # fmt: skip
    return encode_manifest(
        Manifest(
            step=step, rank=rank, world_size=world_size, align=align, blobs=blobs, tensors=table,
            tree=flat.tree, has_pickle=flat.has_pickle,
        )
    )  # fmt: skip
