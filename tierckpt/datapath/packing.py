"""Save data path: pack tensors once into aligned chunks, checksum them, write every chunk to every tier.

The packing thread copies tensor bytes with ``ctypes.memmove`` (GIL released, single-threaded; torch's
multi-threaded ``copy_`` stalls on small tensors: docs/io.md) into either the top memory tier's own
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
from tierckpt.format.sharding import DEFAULT_CHUNK_BYTES, Mesh, ShardRow, chunk_checksums
from tierckpt.format.table import blob_spans
from tierckpt.format.tree import FlatState, TensorRef
from tierckpt.io.buffers import StagingPool, memmove, ptr_mv
from tierckpt.tiers.base import TierWriter

__all__ = ["CHUNK_BYTES", "build_manifest", "contiguous_cpu", "pack_and_write", "planned_manifest", "shard_chunk_sums"]

log = logging.getLogger(__name__)
_EMPTY_DIGEST = xxhash.xxh3_64_intdigest(b"")
# copy-then-hash unit: the hash reads the bytes while they are still in the CPU's cache (not an I/O size:
# the writes are the tier's geometry's chunk and pieces)
_BLOCK_BYTES = 1 << 20
xxh3_64_intdigest = xxhash.xxh3_64_intdigest
_ZEROS = bytes(4096)  # padding shorter than this is written from it: not an I/O size
#: the chunk one checksum of a DTensor shard covers (docs/format.md, "Sharding"): a verified range read
#: reads whole chunks, so this bounds its amplification; tests set it small
CHUNK_BYTES = DEFAULT_CHUNK_BYTES


def _zero(view: memoryview, start: int, stop: int) -> None:
    """Zero ``view[start:stop]``: a slice assignment for the usual small gaps, memset for long ones."""
    if stop - start <= len(_ZEROS):
        view[start:stop] = _ZEROS[: stop - start]
    else:
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(view, start)), 0, stop - start)


def _source(t: torch.Tensor) -> int:
    """The address the C loop may copy ``t``'s bytes from, or 0 (not a contiguous CPU tensor). A
    flattened state holds no negative or conjugate view: the walk replaced each by its value."""
    return t.data_ptr() if t.is_cpu and t.is_contiguous() else 0


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
    piece_bytes: int | None = None,
) -> list[int]:
    """Pack every tensor, hand each chunk to every writer, wait for the writes; return the checksums.

    A chunk is handed to the writers in pieces of ``piece_bytes`` (the tier's geometry's: a quarter
    chunk, or the whole chunk where that is below the tier's smallest part; None: the whole chunk), each
    as soon as it is packed, so the disk gets the first bytes of a chunk while the rest is still being
    packed and always has several operations queued (whole-chunk writes from 3 staging slots kept only
    2 in flight while the third was packed). Bytes are copied and hashed in ``_BLOCK_BYTES`` blocks, so
    the hash reads them from the cache, and small gaps are zeroed by slice assignment (a ctypes call
    costs ~1 us; there is a gap next to almost every one of 20,000 small tensors).

    A writer whose write fails is recorded in ``failed`` (first error) and gets no further chunks; the
    others go on. On any other failure (a packing error, an interrupt) every writer is cancelled before
    the writes in flight are waited for. ``on_staged`` runs once every tensor byte has been copied out of the caller's state;
    ``on_packed(checksums)`` once every checksum is known too, before the writes still in flight are
    waited for (the manifest is built then, while the disk writes the last chunks).
    """
    packer = _Packer(flat, layout, writers, failed, pool, chunk_bytes, piece_bytes or chunk_bytes)
    try:
        packer.pack()
        if on_staged is not None:
            on_staged()
        if packer.defer:
            packer.hash_in_place()
        if on_packed is not None:
            on_packed(packer.checksums)
    except BaseException:
        for w in writers.values():  # the save failed: its writes in flight need not go on (s3 retries)
            w.cancel()
        raise
    finally:
        packer.drain()
    return packer.checksums


def _packing_order(layout: Layout) -> list[int]:
    """The non-empty tensors by (blob, offset): the order their bytes are packed in."""
    e_blob, e_off, e_len = layout.blobs, layout.offsets, layout.lengths
    order = [i for i, n in enumerate(e_len) if n]
    order.sort(key=e_off.__getitem__)
    order.sort(key=e_blob.__getitem__)  # stable: (blob, offset); linear when plan() made the layout
    return order


def _memory_tier(writers: dict[str, TierWriter], failed: dict[str, BaseException], layout: Layout) -> str | None:
    """The writer whose own blob buffers the tensors are packed into (a memory tier's), if any."""
    return next(
        (n for n, w in writers.items() if n not in failed and layout.blob_sizes and w.buffer(0) is not None),
        None,
    )


#: ``_native.gather(recs, k, stop, base, p0, n, cursor, max_len, hash) -> (k, cursor)``: the C packing loop
_Gather = Callable[..., tuple[int, int]]
_Inflight = tuple[
    StagingPool | None, torch.Tensor | None, list[tuple[str, Future[int]]]
]  # (pool, slot, writes) of a chunk


class _Packer:
    """One :func:`pack_and_write`: walks the blobs chunk by chunk and piece by piece, packing the tensors
    (position :attr:`k` of :attr:`order` is the next, or the one partly packed) and handing each piece
    to the writers.

    The C loop packs (and hashes) runs of whole tensors straight from the caller's memory, without the
    GIL; a tensor that is not a contiguous CPU one (source 0), or larger than a block, is packed in
    Python (:meth:`copy_extent`). Packing into a memory tier's own buffers with no other writer
    (:attr:`defer`): copy now, hash after ``on_staged`` (the bytes no longer change then), so the
    caller's wait is the copies alone, and each copy is one GIL-free call per piece instead of a copy
    and a hash per block.
    """

    def __init__(
        self,
        flat: FlatState,
        layout: Layout,
        writers: dict[str, TierWriter],
        failed: dict[str, BaseException],
        pool: Callable[[], StagingPool],
        chunk_bytes: int,
        piece_bytes: int,
    ) -> None:
        self.tensors, self.layout, self.writers, self.failed, self.pool = flat.tensors, layout, writers, failed, pool
        self.e_blob, self.e_off, self.e_len = layout.blobs, layout.offsets, layout.lengths
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        self.checksums = [_EMPTY_DIGEST] * len(self.tensors)
        self.order = _packing_order(layout)
        self.mem = _memory_tier(writers, failed, layout)
        self.defer = self.mem is not None and all(n == self.mem or n in failed for n in writers)
        self.inflight: deque[_Inflight] = deque()
        self.staged = 0  # chunks in flight that hold a staging slot
        self.k, self.nk = 0, len(self.order)  # position in order
        self.src = 0  # address of the tensor being packed (0: none)
        self.held: torch.Tensor | None = None  # its CPU copy, if one was made, kept alive meanwhile
        self.hasher = xxhash.xxh3_64()
        self.recs: Records | None = None
        self.gather: _Gather | None = native.gather if native is not None else None
        self.spans: dict[int, tuple[int, int]] = {}
        self.done: list[tuple[int, int]] = []  # [k0, k1) ranges of order packed by the C loop
        # positions of order whose source address recs holds: set piece by piece, just ahead of the C
        # loop, so the first write does not wait for a pass over every tensor (~1-2 us each, 20-40 ms
        # for 20,000 tensors) and the rest of that pass runs while the disk writes
        self.filled = 0
        if self.gather is not None:
            self.recs = records(self.order, self.e_off, self.e_len, self.checksums)
            self.spans = blob_spans(self.order, self.e_blob)
        self.max_len = (1 << 64) - 1 if self.defer else _BLOCK_BYTES

    def pack(self) -> None:
        """Pack every chunk of every blob and hand it to the writers; then (unless :attr:`defer`) every
        checksum is known."""
        for b, size in enumerate(self.layout.blob_sizes):
            primary = self.writers[self.mem].buffer(b) if self.mem is not None else None
            for c0 in range(0, size, self.chunk_bytes):
                self.pack_chunk(b, c0, min(size, c0 + self.chunk_bytes), primary)
        if self.recs is not None and not self.defer:
            table, order, checksums = self.recs.table, self.order, self.checksums
            for k0, k1 in self.done:
                for pos in range(k0, k1):
                    checksums[order[pos]] = table[4 * pos + 2]

    def pack_chunk(self, b: int, c0: int, c1: int, primary: torch.Tensor | None) -> None:
        """Pack bytes ``[c0, c1)`` of blob ``b`` into ``primary`` (the memory tier's buffer) or a staging
        slot, handing each piece to the writers as soon as it is packed."""
        base, owner, slot = self.chunk_memory(c0, primary)
        futs: list[tuple[str, Future[int]]] = []
        self.inflight.append((owner, slot, futs))
        view = ptr_mv(base + c0, c1 - c0)  # the chunk; sliced below, cheaper than a view each time
        for p0 in range(c0, c1, self.piece_bytes):
            p1 = min(c1, p0 + self.piece_bytes)
            self.pack_piece(b, base, view, c0, p0, p1)
            self.submit(b, p0, base + p0, p1 - p0, futs)

    def chunk_memory(
        self, c0: int, primary: torch.Tensor | None
    ) -> tuple[int, StagingPool | None, torch.Tensor | None]:
        """``(base, pool, slot)``: where the chunk starting at blob offset ``c0`` is packed (``base`` +
        blob offset), and the staging slot it holds (None, None when packing in place)."""
        if primary is not None:
            return primary.data_ptr(), None, None  # pack in place: blob offsets are buffer offsets
        owner = self.pool()
        while self.staged >= owner.slots:
            self.drain_one()
        slot = owner.acquire()
        self.staged += 1
        return slot.data_ptr() - c0, owner, slot  # so that base + blob offset lands in the slot

    def pack_piece(self, b: int, base: int, view: memoryview, c0: int, p0: int, p1: int) -> None:
        """Pack bytes ``[p0, p1)`` of blob ``b`` (``view`` is the chunk from ``c0``): every tensor extent
        in them, zeros in between."""
        e_blob, e_off, e_len, order, nk = self.e_blob, self.e_off, self.e_len, self.order, self.nk
        cursor = p0  # bytes before it are packed
        while self.k < nk:
            if self.recs is not None and self.gather is not None and not self.src:
                cursor = self.gather_run(self.recs, self.gather, b, base, p0, p1, cursor)
                if self.k == nk:
                    break
            i = order[self.k]
            off = e_off[i]
            if e_blob[i] != b or off >= p1:
                break
            end = off + e_len[i]
            a, z = max(off, p0), min(end, p1)
            if a > cursor:
                _zero(view, cursor - c0, a - c0)
            cursor = z
            if not self.copy_extent(i, base, view, c0, off, end, a, z):
                break  # the extent goes on in the next piece
        if cursor < p1:
            _zero(view, cursor - c0, p1 - c0)

    def gather_run(self, recs: Records, gather: _Gather, b: int, base: int, p0: int, p1: int, cursor: int) -> int:
        """Pack with the C loop (``gather``, over the records ``recs``) the run of whole tensors of piece
        ``[p0, p1)`` from position :attr:`k` on (zeroing the gaps from ``cursor``); returns the new cursor."""
        if self.filled < self.nk:
            self.filled = _fill_sources(
                recs, self.tensors, self.order, self.e_blob, self.e_off, self.e_len, self.filled, b, p1
            )
        k0 = self.k
        stop = self.spans.get(b, (k0, k0))[1]
        self.k, cursor = gather(recs.table, k0, stop, base + p0, p0, p1 - p0, cursor, self.max_len, not self.defer)
        if self.k > k0:
            self.done.append((k0, self.k))
        return cursor

    def copy_extent(self, i: int, base: int, view: memoryview, c0: int, off: int, end: int, a: int, z: int) -> bool:
        """Copy (and hash, unless :attr:`defer`) bytes ``[a, z)`` of tensor ``i``, whose extent is
        ``[off, end)``; True once the whole tensor is packed (its checksum known), and :attr:`k` moved on."""
        if not self.src:
            self.src = self.source_of(i)
            if a == off and z == end and (self.defer or z - a <= _BLOCK_BYTES):  # the whole tensor at once
                memmove(base + a, self.src, z - a)
                if not self.defer:
                    self.checksums[i] = xxh3_64_intdigest(view[a - c0 : z - c0])
                self.src, self.held, self.k = 0, None, self.k + 1
                return True
            self.hasher.reset()
        src = self.src
        if self.defer:
            memmove(base + a, src + a - off, z - a)
        else:
            for q in range(a, z, _BLOCK_BYTES):
                n = min(_BLOCK_BYTES, z - q)
                memmove(base + q, src + q - off, n)
                self.hasher.update(view[q - c0 : q - c0 + n])
        if z < end:
            return False
        if not self.defer:
            self.checksums[i] = self.hasher.intdigest()
        self.src, self.held, self.k = 0, None, self.k + 1
        return True

    def source_of(self, i: int) -> int:
        """The address of tensor ``i``'s bytes, made a contiguous CPU copy if needed (kept alive in
        :attr:`held` until it is packed)."""
        held = self.held = contiguous_cpu(self.tensors[i].tensor)
        if held.nbytes != self.e_len[i]:
            raise _resized(self.tensors[i], held.nbytes, self.e_len[i])
        return held.data_ptr()

    def submit(self, b: int, off: int, addr: int, n: int, futs: list[tuple[str, Future[int]]]) -> None:
        """Hand bytes ``[off, off + n)`` of blob ``b`` (at ``addr``) to every writer still writing."""
        for name, w in self.writers.items():
            if name in self.failed or name == self.mem:
                continue
            try:
                futs.append((name, w.write(b, off, addr, n)))
            except BaseException as e:
                log.error("writing to tier %r failed: %s", name, e)
                self.failed[name] = e

    def hash_in_place(self) -> None:
        """With :attr:`defer`: every checksum, from the memory tier's buffers (one GIL-free call per
        blob with the C loop)."""
        bases = self.memory_bases()
        checksums, order, loops = self.checksums, self.order, native
        if self.recs is not None and loops is not None:
            table = self.recs.table
            for b, base in enumerate(bases):
                loops.hash_into(table, *self.spans.get(b, (0, 0)), base)
            for pos, i in enumerate(order):
                checksums[i] = table[4 * pos + 2]
        else:
            e_blob, e_off, e_len = self.e_blob, self.e_off, self.e_len
            for i in order:
                checksums[i] = xxh3_64_intdigest(ptr_mv(bases[e_blob[i]] + e_off[i], e_len[i], writable=False))

    def memory_bases(self) -> list[int]:
        """The addresses of the memory tier's blob buffers, which :attr:`defer` packs into (it is set only
        where a memory tier's writer has them)."""
        out = []
        for b in range(len(self.layout.blob_sizes)):
            buf = self.writers[self.mem].buffer(b) if self.mem is not None else None
            if buf is None:
                raise RuntimeError(f"hashing in place needs the memory tier's blob buffers (blob {b} has none)")
            out.append(buf.data_ptr())
        return out

    def drain(self) -> None:
        """Wait for every write still in flight."""
        while self.inflight:
            self.drain_one()

    def drain_one(self) -> None:
        """Wait for the oldest chunk's writes (recording a failed writer) and free its staging slot."""
        owner, slot, futs = self.inflight.popleft()
        for name, f in futs:
            try:
                f.result()
            except BaseException as e:
                if name not in self.failed:
                    log.error("writing to tier %r failed: %s", name, e)
                    self.failed[name] = e
        if owner is not None and slot is not None:
            self.staged -= 1
            owner.release(slot)


def shard_chunk_sums(flat: FlatState) -> tuple[int, dict[int, tuple[int, ...]]]:
    """``(chunk size, checksums by row)``: the chunk checksums of every stored DTensor shard longer than
    :data:`CHUNK_BYTES` (docs/format.md, "Sharding"), read from the caller's tensors: call it before
    the state is staged (they may change after). Plain rows have none: they are only ever read whole."""
    size = CHUNK_BYTES
    out: dict[int, tuple[int, ...]] = {}
    for i, spec in flat.shards.items():
        if spec.stored and flat.nbytes[i] > size:
            t = contiguous_cpu(flat.tensors[i].tensor)
            out[i] = chunk_checksums(ptr_mv(t.data_ptr(), t.nbytes, writable=False), size)
    return size, out


def _table(flat: FlatState, srcs: list[torch.Tensor], layout: Layout, checksums: list[int]) -> TensorTable:
    return TensorTable(
        [r.path for r in flat.tensors], [dtype_name(t.dtype) for t in srcs], [tuple(t.shape) for t in srcs],
        layout.blobs, layout.offsets, layout.lengths, checksums,
    )  # fmt: skip


def planned_manifest(
    flat: FlatState, layout: Layout, blobs: tuple[BlobEntry, ...], *, step: int, rank: int, world_size: int, align: int
) -> Manifest:
    """The manifest a save of ``flat`` will have, but for its checksums (zeros) and tree (empty): what a
    tier that compresses plans its frames from (blob sizes, alignment, each tensor's dtype and extent)."""
    srcs = [r.tensor for r in flat.tensors]
    return Manifest(
        step=step, rank=rank, world_size=world_size, align=align, blobs=blobs,
        tensors=_table(flat, srcs, layout, [0] * len(srcs)), tree=b"", has_pickle=flat.has_pickle,
        chunk_bytes=CHUNK_BYTES,
    )  # fmt: skip


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
    chunks: dict[int, tuple[int, ...]] | None = None,
    chunk_bytes: int | None = None,
) -> bytes:
    """The encoded manifest of a packed checkpoint (``srcs[i]`` is the tensor of ``flat.tensors[i]``;
    ``chunks``: :func:`shard_chunk_sums` of the state, taken with ``chunk_bytes``)."""
    table = _table(flat, srcs, layout, checksums)
    meshes: dict[Mesh, int] = {}
    sharding = {}
    for i, spec in flat.shards.items():
        k = meshes.setdefault(spec.mesh, len(meshes))
        sharding[i] = ShardRow(k, spec.global_shape, spec.placements, spec.stored, (chunks or {}).get(i, ()))
    return encode_manifest(
        Manifest(
            step=step, rank=rank, world_size=world_size, align=align, blobs=blobs, tensors=table,
            tree=flat.tree, has_pickle=flat.has_pickle, chunk_bytes=chunk_bytes or CHUNK_BYTES,
            meshes=tuple(meshes), sharding=sharding,
        )
    )  # fmt: skip
