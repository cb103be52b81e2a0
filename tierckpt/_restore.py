"""Restore data path: read one tier's copy of a checkpoint, verify it, rebuild the state.

Blobs are read in aligned chunks into aligned buffers (O_DIRECT where the tier uses it), every tensor's
checksum is verified as soon as its blob has arrived (while later reads are in flight), and tensors are
zero-copy views into those buffers. ``copy_into`` then moves a verified state into existing tensors.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import xxhash

from tierckpt.errors import CorruptCheckpointError, StateError
from tierckpt.format.manifest import Manifest, decode_manifest, dtype_from_name
from tierckpt.format.tree import format_path, unflatten
from tierckpt.io.buffers import MappedBuffer, memmove, ptr_mv
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["copy_into", "load_manifest", "read_checkpoint", "verify_checkpoint"]

log = logging.getLogger(__name__)


def load_manifest(tier: Tier, key: CheckpointKey) -> Manifest:
    """Read and validate the manifest of ``key`` on ``tier``."""
    try:
        m = decode_manifest(tier.read_manifest(key))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(str(e), tier=tier.name, step=key.step) from None
    if (m.step, m.rank) != (key.step, key.rank):
        raise CorruptCheckpointError(
            f"manifest says step {m.step} rank {m.rank}, stored as step {key.step} rank {key.rank}",
            tier=tier.name,
            step=key.step,
        )
    return m


def _read_blobs(
    tier: Tier, key: CheckpointKey, m: Manifest, on_blob: Callable[[int, MappedBuffer], None]
) -> list[MappedBuffer]:
    chunk = max(m.align, getattr(tier, "chunk_bytes", 64 << 20) // m.align * m.align)
    bufs = [MappedBuffer(b.size) for b in m.blobs]  # page-aligned: fine for O_DIRECT
    reader = tier.reader(key, m.blobs)
    futs: list[list[tuple[int, int, Future[int]]]] = []
    try:
        for bi, (b, buf) in enumerate(zip(m.blobs, bufs)):
            futs.append([(o, min(chunk, b.size - o), reader.read(bi, o, buf.addr + o, min(chunk, b.size - o)))
                         for o in range(0, b.size, chunk)])  # fmt: skip
        for bi, blob_futs in enumerate(futs):
            for off, n, f in blob_futs:
                got = f.result()
                if got != n:
                    raise CorruptCheckpointError(
                        f"blob is truncated: read {got} of {n} bytes at offset {off}",
                        tier=tier.name, step=key.step, blob=m.blobs[bi].name,
                    )  # fmt: skip
            on_blob(bi, bufs[bi])
    finally:
        for blob_futs in futs:  # never free a buffer the engine may still be reading into
            for _, _, f in blob_futs:
                if not f.done():
                    f.exception()
        reader.close()
    return bufs


def _verifier(tier: Tier, key: CheckpointKey, m: Manifest) -> Callable[[int, MappedBuffer], None]:
    """Checks every tensor's checksum, and that every byte no tensor covers is zero (format.md: gaps
    and padding are zero), so that damage anywhere in a blob is found."""
    by_blob: dict[int, list[int]] = {}
    for i, t in enumerate(m.tensors):
        if t.length:
            by_blob.setdefault(t.blob, []).append(i)
    for ids in by_blob.values():
        ids.sort(key=lambda i: m.tensors[i].offset)

    def verify(bi: int, buf: MappedBuffer) -> None:
        base, end = buf.addr, 0
        for i in by_blob.get(bi, ()):
            t = m.tensors[i]
            if t.offset > end:
                _check_zero(base, end, t.offset, bi)
            if xxhash.xxh3_64_intdigest(ptr_mv(base + t.offset, t.length, writable=False)) != t.checksum:
                raise CorruptCheckpointError(
                    "checksum mismatch", tier=tier.name, step=key.step, blob=m.blobs[bi].name, key=t.path
                )
            end = t.offset + t.length
        if m.blobs[bi].size > end:
            _check_zero(base, end, m.blobs[bi].size, bi)

    def _check_zero(base: int, start: int, stop: int, bi: int) -> None:
        if ctypes.string_at(base + start, stop - start).count(0) != stop - start:
            raise CorruptCheckpointError(
                f"padding bytes [{start}, {stop}) are not zero", tier=tier.name, step=key.step, blob=m.blobs[bi].name
            )

    return verify


def verify_checkpoint(tier: Tier, key: CheckpointKey) -> Manifest:
    """Re-read every blob of ``key`` on ``tier`` and check every checksum; raise on the first problem."""
    m = load_manifest(tier, key)
    _read_blobs(tier, key, m, _verifier(tier, key, m))
    return m


def read_checkpoint(tier: Tier, key: CheckpointKey, *, allow_pickle: bool = False) -> tuple[Any, Manifest]:
    """Read, verify and rebuild the state of ``key`` from ``tier`` as fresh CPU tensors.

    Raises:
        CorruptCheckpointError: naming the tier, blob and key of what failed validation.
        StateError: the checkpoint holds pickled values and ``allow_pickle`` is False.
    """
    m = load_manifest(tier, key)
    if m.has_pickle and not allow_pickle:
        raise StateError(
            f"step {key.step} on tier {tier.name!r} holds pickled values; pass allow_pickle=True "
            "to restore() only if you trust where it came from"
        )
    bufs = _read_blobs(tier, key, m, _verifier(tier, key, m))
    cache: dict[int, torch.Tensor] = {}

    def tensor_at(i: int) -> torch.Tensor:
        t = cache.get(i)
        if t is None:
            e = m.tensors[i]
            dt = dtype_from_name(e.dtype)
            if e.length == 0:
                t = torch.empty(e.shape, dtype=dt)
            else:
                t = bufs[e.blob].tensor(e.offset, e.length, dt, e.shape)
            cache[i] = t
        return t

    try:
        state = unflatten(m.tree, tensor_at, len(m.tensors), allow_pickle=allow_pickle)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(str(e), tier=tier.name, step=key.step) from None
    return state, m


def copy_into(target: Any, source: Any) -> Any:
    """Copy a restored state into ``target`` in place: tensors by copy, other values by assignment.

    Dicts and lists of ``target`` are walked; a tensor in them receives the checkpoint's bytes (same
    shape and dtype required); any other value (numbers, strings, tuples …) is replaced; keys only the
    checkpoint has are added. Everything is checked before anything is changed.

    Raises:
        StateError: naming the key path of a missing key or a shape/dtype/type mismatch.
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    assigns: list[tuple[Any, Any, Any]] = []

    def walk(dst: Any, src: Any, path: tuple[Any, ...]) -> None:
        where = format_path(path, "target")
        if isinstance(dst, dict):
            if not isinstance(src, dict):
                raise StateError(f"{where}: target is a dict, checkpoint has {type(src).__name__}")
            for k in dst:
                if k not in src:
                    raise StateError(f"{format_path((*path, k), 'target')}: key is not in the checkpoint")
            for k, v in src.items():
                if k in dst and (isinstance(dst[k], (dict, list, torch.Tensor))):
                    walk(dst[k], v, (*path, k))
                else:
                    assigns.append((dst, k, v))
        elif isinstance(dst, list):
            if not isinstance(src, list) or len(src) != len(dst):
                raise StateError(f"{where}: target is a list of {len(dst)}, checkpoint has {_describe(src)}")
            for i, (d, s) in enumerate(zip(dst, src)):
                if isinstance(d, (dict, list, torch.Tensor)):
                    walk(d, s, (*path, i))
                else:
                    assigns.append((dst, i, s))
        elif isinstance(dst, torch.Tensor):
            if not isinstance(src, torch.Tensor):
                raise StateError(f"{where}: target is a tensor, checkpoint has {type(src).__name__}")
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise StateError(
                    f"{where}: target is {dst.dtype} {tuple(dst.shape)}, checkpoint has {src.dtype} {tuple(src.shape)}"
                )
            copies.append((dst, src))
        else:
            raise StateError(f"{where}: cannot restore into a {type(dst).__name__}; pass a dict or a list")

    walk(target, source, ())
    with torch.no_grad():
        for dst, src in copies:
            if dst.device.type == "cpu" and dst.is_contiguous() and dst.numel():
                memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
            elif dst.numel():
                dst.copy_(src)
    for container, k, v in assigns:
        container[k] = v
    return target


def _describe(v: Any) -> str:
    return f"a list of {len(v)}" if isinstance(v, list) else type(v).__name__
