"""Restore data path: read one tier's copy of a checkpoint, verify it, rebuild the state.

Blobs are read in aligned chunks into fresh page-aligned buffers (O_DIRECT where the tier uses it),
whose pages helper threads fault in just ahead of the reads; every tensor's checksum is verified, and
its zero-copy view built, as soon as the chunk that completes it has arrived (while later reads are in
flight).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from tierckpt.datapath.manifests import load_manifest, load_tree, located
from tierckpt.datapath.reshard import read_sharded
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import Manifest, dtype_from_name
from tierckpt.format.native import THREADS, all_zero, native, records
from tierckpt.format.table import blob_spans
from tierckpt.format.tree import decode_tree, resolve_tree
from tierckpt.io.buffers import MappedBuffer, ptr_mv
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader

__all__ = ["read_checkpoint", "verify_checkpoint"]

log = logging.getLogger(__name__)
_PREFAULT_THREADS = max(1, min(4, os.cpu_count() or 1))
_ZEROS = bytes(4096)


def _fresh_buffers(tier: Tier, key: CheckpointKey, m: Manifest) -> list[MappedBuffer]:
    """One page-aligned buffer per blob; memory that cannot be had is a MemoryError naming the request."""
    bufs: list[MappedBuffer] = []
    for b in m.blobs:
        try:
            bufs.append(MappedBuffer(b.size))
        except (OSError, MemoryError, OverflowError) as e:
            raise MemoryError(
                f"restoring step {key.step} from tier {tier.name!r}: cannot allocate {b.size} bytes for "
                f"{b.name} ({m.blob_bytes} bytes for the checkpoint's {len(m.blobs)} blob(s)): {e}"
            ) from e
    return bufs


def _read_blobs(
    tier: Tier,
    key: CheckpointKey,
    m: Manifest,
    reader: TierReader,
    on_data: Callable[[int, MappedBuffer, int], object],
) -> list[MappedBuffer]:
    """Read every blob into fresh page-aligned buffers through ``reader`` (closed when done).

    ``on_data(i, buf, upto)`` runs (in this thread) each time the first ``upto`` bytes of blob i are in,
    chunk by chunk, so checking and rebuilding overlap the reads still in flight.

    The buffers' pages are faulted in by ``_PREFAULT_THREADS`` helper threads ahead of the reads (each
    helper populates a chunk, then submits its read), so the page faults of fresh memory overlap the I/O
    instead of running inside it (see :func:`tierckpt.io.buffers.populate`). The first chunk is read in
    quarters, so the disk starts after a quarter chunk is populated.
    """
    chunk = max(m.align, tier.geometry.chunk_bytes // m.align * m.align)  # the tier's, in the copy's alignment
    first = max(m.align, chunk // 4 // m.align * m.align)
    try:
        bufs = _fresh_buffers(tier, key, m)  # page-aligned: fine for O_DIRECT
    except BaseException:
        reader.close()
        raise

    def prep(bi: int, off: int, n: int) -> Future[int]:
        bufs[bi].populate(off, n)
        return reader.read(bi, off, bufs[bi].addr + off, n)

    pieces: list[tuple[int, int, int]] = []  # (blob, offset, length) in reading order
    for bi, b in enumerate(m.blobs):
        off = 0
        while off < b.size:
            n = min(first if bi == 0 and off < chunk else chunk, b.size - off)
            pieces.append((bi, off, n))
            off += n
    pool = ThreadPoolExecutor(_PREFAULT_THREADS, thread_name_prefix="tierckpt-prefault")
    tasks: list[Future[Future[int]]] = []
    try:
        tasks = [pool.submit(prep, bi, off, n) for bi, off, n in pieces]
        for (bi, off, n), t in zip(pieces, tasks):
            got = t.result().result()
            if got != n:
                raise CorruptCheckpointError(
                    f"blob is truncated: read {got} of {n} bytes at offset {off}",
                    tier=tier.name, step=key.step, blob=m.blobs[bi].name,
                )  # fmt: skip
            on_data(bi, bufs[bi], off + n)
    finally:
        for t in tasks:  # never free a buffer the engine may still be reading into
            if t.cancel():
                continue
            with contextlib.suppress(Exception):  # the error, if any, was raised above
                t.result().exception()
        pool.shutdown(wait=True)
        reader.close()
    return bufs


class _Verifier:
    """Checks every tensor's checksum, and that every byte no tensor covers is zero (format.md: gaps
    and padding are zero), so that damage anywhere in a blob is found.

    :meth:`verify` is called with a blob's received prefix (``upto`` bytes, growing); it checks what
    lies wholly inside it and was not checked yet. With :mod:`tierckpt.format.native`, each call is
    one GIL-free C loop.
    """

    def __init__(self, tier: Tier, key: CheckpointKey, m: Manifest) -> None:
        self.tier, self.key, self.m = tier, key, m
        t = m.tensors
        self.order = t.order()  # non-empty tensors by (blob, offset)
        self.span = blob_spans(self.order, t.blobs)
        # per blob: next position in order, bytes checked
        self.done = [(self.span.get(bi, (0, 0))[0], 0) for bi in range(len(m.blobs))]
        self.recs = records(self.order, t.offsets, t.lengths, t.checksums).table if native is not None else None

    def verify(self, bi: int, buf: MappedBuffer, upto: int) -> list[int]:
        """Check what the first ``upto`` bytes of blob ``bi`` (in ``buf``) complete; return the indices
        of the tensors checked."""
        k, end = self.done[bi]
        k0, stop = k, self.span.get(bi, (0, 0))[1]
        if self.recs is not None:
            k, end, err, g0, g1 = native.scatter(self.recs, k, stop, buf.addr, 0, upto, end, upto, THREADS)  # type: ignore[union-attr]  # the C path runs only when native is not None
            if err == 1:
                self._mismatch(bi, self.order[k])
            elif err == 2:
                self._padding_error(bi, g0, g1)
        else:
            k, end = self._verify_python(bi, buf, upto, k, stop, end)
        size = self.m.blobs[bi].size
        if k == stop and upto >= size and size > end:
            if not all_zero(buf.addr + end, size - end):
                self._padding_error(bi, end, size)
            end = size
        self.done[bi] = (k, end)
        return self.order[k0:k]

    def _verify_python(self, bi: int, buf: MappedBuffer, upto: int, k: int, stop: int, end: int) -> tuple[int, int]:
        """:meth:`verify` without the C loop, from position ``k`` (bytes checked up to ``end``): returns
        the new ``(k, end)``."""
        t = self.m.tensors
        order, offsets, lengths, checksums = self.order, t.offsets, t.lengths, t.checksums
        digest, zeros, nz = xxhash.xxh3_64_intdigest, _ZEROS, len(_ZEROS)
        view = ptr_mv(buf.addr, buf.nbytes, writable=False)  # sliced per tensor: cheaper than a view each
        while k < stop:
            i = order[k]
            o = offsets[i]
            end_i = o + lengths[i]
            if end_i > upto:
                break
            if o != end and (
                view[end:o].tobytes() != zeros[: o - end] if o - end <= nz else not all_zero(buf.addr + end, o - end)
            ):
                self._padding_error(bi, end, o)
            if digest(view[o:end_i]) != checksums[i]:
                self._mismatch(bi, i)
            end = end_i
            k += 1
        return k, end

    def _mismatch(self, bi: int, i: int) -> None:
        raise CorruptCheckpointError(
            "checksum mismatch", tier=self.tier.name, step=self.key.step, blob=self.m.blobs[bi].name,
            key=self.m.tensors.paths[i],
        )  # fmt: skip

    def _padding_error(self, bi: int, start: int, stop: int) -> None:
        raise CorruptCheckpointError(
            f"padding bytes [{start}, {stop}) are not zero",
            tier=self.tier.name, step=self.key.step, blob=self.m.blobs[bi].name,
        )  # fmt: skip


def _no_tensor(i: int) -> Any:
    return None


def verify_checkpoint(tier: Tier, key: CheckpointKey) -> Manifest:
    """Re-read every blob of ``key`` on ``tier`` and check every checksum, after the whole manifest and the
    state tree (what ``restore()`` would check before it reads); raise on the first problem."""
    with tier.open_copy(key) as copy:  # one copy, whatever other processes do to the step meanwhile
        m = load_manifest(tier, key, copy=copy)
        try:  # the tree as restore() reads it: decoded and every reference in range, no pickle ever loaded
            value, ref = decode_tree(m.tree, len(m.tensors), m.version, allow_pickle=True, unpickle=False)
            resolve_tree(value, ref, _no_tensor, len(m.tensors))
        except CorruptCheckpointError as e:
            raise located(e, tier, key) from None
        _read_blobs(
            tier, key, m, copy.reader(m.blobs), _Verifier(tier, key, m).verify
        )  # every blob open, its size checked first
    return m


def read_checkpoint(tier: Tier, key: CheckpointKey, *, allow_pickle: bool = False) -> tuple[Any, Manifest]:
    """Read, verify and rebuild the state of ``key`` from ``tier`` as fresh CPU tensors.

    Raises:
        CorruptCheckpointError: naming the tier, blob and key of what failed validation.
        StateError: the checkpoint holds pickled values and ``allow_pickle`` is False.
    """
    with tier.open_copy(key) as copy:  # one copy, whatever other processes do to the step meanwhile
        m = load_manifest(tier, key, allow_pickle=allow_pickle, copy=copy)
        if m.sharding:  # DTensor shards, some stored by other ranks: datapath/reshard.py
            return read_sharded(tier, key, allow_pickle=allow_pickle), m
        tree, ref = load_tree(tier, key, m, allow_pickle=allow_pickle)  # valid before a blob is opened
        cache: dict[int, torch.Tensor] = {}
        verify = _Verifier(tier, key, m).verify

        t = m.tensors
        dtypes = [dtype_from_name(d) for d in t.dtypes]
        offsets, lengths, shapes = t.offsets, t.lengths, t.shapes

        def on_data(bi: int, buf: MappedBuffer, upto: int) -> None:
            carve = buf.tensor
            for i in verify(bi, buf, upto):  # build the views now, while later chunks are still being read
                cache[i] = carve(offsets[i], lengths[i], dtypes[i], shapes[i])

        # every blob is opened, and its size checked against its file, before anything is allocated;
        # every non-empty tensor is in the cache once this returns
        _read_blobs(tier, key, m, copy.reader(m.blobs), on_data)

    def tensor_at(i: int) -> torch.Tensor:
        got = cache.get(i)
        if got is None:  # only zero-size tensors have no bytes to carve
            got = cache[i] = torch.empty(shapes[i], dtype=dtypes[i])
        return got

    try:
        return resolve_tree(tree, ref, tensor_at, len(t)), m
    except CorruptCheckpointError as e:
        raise located(e, tier, key) from None
