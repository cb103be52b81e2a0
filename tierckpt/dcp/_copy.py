"""One tensor's bytes into another of its dtype and shape, without torch's thread pool where it can."""

from __future__ import annotations

import torch

from tierckpt.format.memory import in_storage
from tierckpt.io.copier import copy_spans

__all__ = ["copy_tensor", "copy_tensors"]


def _flat(t: torch.Tensor) -> bool:
    """Whether ``t`` is a host tensor whose elements are the contiguous bytes at its ``data_ptr()``."""
    return t.device.type == "cpu" and t.is_contiguous() and in_storage(t, t.data_ptr(), t.numel() * t.element_size())


def _span(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int] | None:
    """``(dst, src, nbytes)`` where ``dst[...] = src`` is one copy of bytes (host tensors of one dtype and
    shape, each its contiguous bytes); else None."""
    if dst.dtype == src.dtype and dst.shape == src.shape and _flat(dst) and _flat(src):
        return dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()
    return None


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` (the same dtype and shape): :func:`copy_tensors` of the one pair."""
    copy_tensors([(dst, src)])


def copy_tensors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst[...] = src`` for each ``(dst, src)`` (the same dtype and shape). Host tensors' bytes are copied
    all at once, shared out over a few threads (:func:`~tierckpt.io.copier.copy_spans`: no barrier per
    tensor; torch's ``copy_`` splits each tensor over its thread pool, and on a machine whose cores are
    busy every split waits for a descheduled thread: 3 s instead of 0.05 s for 100 MiB of small tensors
    here, docs/io.md); others by ``copy_`` (a device's asynchronously into pinned memory: the caller
    synchronizes)."""
    spans = []
    for dst, src in pairs:
        span = _span(dst, src)
        if span is not None:
            spans.append(span)
        else:
            dst.copy_(src.detach(), non_blocking=src.device.type == "cuda" and dst.is_pinned())
    copy_spans(spans)
