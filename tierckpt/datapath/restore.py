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
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tierckpt.datapath.keymap import KeyMap, remap
from tierckpt.datapath.manifests import absent, load_manifest, load_tree, located
from tierckpt.datapath.openblobs import open_blobs
from tierckpt.datapath.reshard import read_sharded
from tierckpt.datapath.verifier import BlobVerifier, Where
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tierckpt.format.manifest import Manifest, dtype_from_name
from tierckpt.format.tree import decode_tree, resolve_tree
from tierckpt.io.buffers import MappedBuffer
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader

__all__ = ["read_checkpoint", "verify_checkpoint"]

log = logging.getLogger(__name__)
_PREFAULT_THREADS = max(1, min(4, os.cpu_count() or 1))


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
    on_data: Callable[[int, MappedBuffer, int, int], object],
) -> list[MappedBuffer]:
    """Read every blob into fresh page-aligned buffers through ``reader`` (closed when done).

    ``on_data(i, buf, offset, n)`` runs (in this thread) each time the ``n`` bytes of blob i at ``offset``
    are in, chunk by chunk and in order, so checking and rebuilding overlap the reads still in flight.

    The buffers' pages are faulted in by ``_PREFAULT_THREADS`` helper threads ahead of the reads (each
    helper populates a chunk, then submits its read), so the page faults of fresh memory overlap the I/O
    instead of running inside it (see :func:`tierckpt.io.buffers.populate`). The reads are the tier's
    geometry's (:meth:`~tierckpt.io.geometry.IOGeometry.read_chunk`), the first chunk's in quarters
    (:meth:`~tierckpt.io.geometry.IOGeometry.first_read`), so the disk starts once a quarter chunk is populated.
    """
    chunk, first = tier.geometry.read_chunk(m.align), tier.geometry.first_read(m.align)  # in the copy's alignment
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
        where = Where(tier.name, key.step)
        for (bi, off, n), t in zip(pieces, tasks):
            where.check_read(m.blobs[bi].name, off, n, t.result().result())
            on_data(bi, bufs[bi], off, n)
    finally:
        for t in tasks:  # never free a buffer the engine may still be reading into
            if t.cancel():
                continue
            with contextlib.suppress(Exception):  # the error, if any, was raised above
                t.result().exception()
        pool.shutdown(wait=True)
        reader.close()
    return bufs


def _no_tensor(i: int) -> Any:
    return None


def verify_checkpoint(tier: Tier, key: CheckpointKey, *, name_rank: bool = False) -> Manifest:
    """Re-read every blob of ``key`` on ``tier`` and check every checksum, after the whole manifest and the
    state tree (what ``restore()`` would check before it reads); raise on the first problem (naming the
    rank with ``name_rank``)."""
    with tier.open_copy(key) as copy:  # one copy, whatever other processes do to the step meanwhile
        m = load_manifest(tier, key, copy=copy)
        try:  # the tree as restore() reads it: decoded and every reference in range, no pickle ever loaded
            value, ref = decode_tree(m.tree, len(m.tensors), m.version, allow_pickle=True, unpickle=False)
            resolve_tree(value, ref, _no_tensor, len(m.tensors))
        except CorruptCheckpointError as e:
            raise located(e, tier, key) from None
        where = Where(tier.name, key.step, key.rank if name_rank else None)
        verifier = BlobVerifier(where, m.tensors, m.blobs)

        def on_data(bi: int, buf: MappedBuffer, off: int, n: int) -> None:
            verifier.feed(bi, off, n, buf.addr + off)

        # every blob open, its size checked first; a compressed copy's every frame decoded
        _read_blobs(tier, key, m, open_blobs(tier, copy, m, background=False, where=where), on_data)
        verifier.finish()
    return m


def read_checkpoint(
    tier: Tier,
    key: CheckpointKey,
    *,
    allow_pickle: bool = False,
    others: Sequence[Tier] = (),
    key_map: KeyMap | None = None,
) -> tuple[Any, Manifest]:
    """Read, verify and rebuild the state of ``key`` from ``tier`` as fresh CPU tensors (its key paths
    mapped by ``key_map``: :mod:`tierckpt.datapath.keymap`).

    A sharded checkpoint (DTensor shards, some stored by other ranks) is read by
    :func:`~tierckpt.datapath.reshard.read_sharded`: another rank's copy that ``tier`` lacks comes from
    the first of ``others`` that holds it, and a rank beyond the ranks that saved reads rank 0's part.

    Raises:
        CorruptCheckpointError: naming the tier, blob and key of what failed validation.
        StateError: the checkpoint holds pickled values and ``allow_pickle`` is False.
        CheckpointNotFoundError: the copy went away (evicted: the step's record too).
        TierIOError: ``tier`` holds the step's record, not the copy this rank reads (``ENOENT``).
    """
    try:
        opened = tier.open_copy(key)
    except CheckpointNotFoundError as e:
        if absent(tier, key, e) is e:  # gone: the restore looks again
            raise
        # a step saved by other ranks
        return read_sharded(tier, key, allow_pickle=allow_pickle, others=others, key_map=key_map)
    with opened as copy:  # one copy, whatever other processes do to the step meanwhile
        m = load_manifest(tier, key, allow_pickle=allow_pickle, copy=copy)
        if m.sharding:  # DTensor shards, some stored by other ranks: datapath/reshard.py
            return read_sharded(tier, key, allow_pickle=allow_pickle, others=others, key_map=key_map)
        tree, ref = load_tree(tier, key, m, allow_pickle=allow_pickle)  # valid before a blob is opened
        if key_map is not None:
            tree = remap(tree, key_map)[0]
        cache: dict[int, torch.Tensor] = {}
        t = m.tensors
        verifier = BlobVerifier(Where(tier.name, key.step), t, m.blobs)
        dtypes = [dtype_from_name(d) for d in t.dtypes]
        offsets, lengths, shapes, order = t.offsets, t.lengths, t.shapes, verifier.order

        def on_data(bi: int, buf: MappedBuffer, off: int, n: int) -> None:
            carve = buf.tensor
            k0, k = verifier.feed(bi, off, n, buf.addr + off)
            for i in order[k0:k]:  # build the views now, while later chunks are still being read
                cache[i] = carve(offsets[i], lengths[i], dtypes[i], shapes[i])

        # every blob is opened, and its size checked against its file, before anything is allocated;
        # every non-empty tensor is in the cache once this returns
        _read_blobs(tier, key, m, open_blobs(tier, copy, m, background=False), on_data)
        verifier.finish()

    def tensor_at(i: int) -> torch.Tensor:
        got = cache.get(i)
        if got is None:  # only zero-size tensors have no bytes to carve
            got = cache[i] = torch.empty(shapes[i], dtype=dtypes[i])
        return got

    try:
        return resolve_tree(tree, ref, tensor_at, len(t)), m
    except CorruptCheckpointError as e:
        raise located(e, tier, key) from None
