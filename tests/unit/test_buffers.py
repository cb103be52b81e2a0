"""Host buffers: alignment, lifetime, and the huge-page advice on large I/O buffers."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from tierckpt.io.buffers import MappedBuffer, aligned_empty

_HUGE = 2 << 20


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process that contains ``addr``."""
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= addr < hi
        elif found and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_available() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return hasattr(mmap, "MADV_HUGEPAGE") and p.exists() and "[never]" not in p.read_text()


needs_thp = pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are not available")


@pytest.mark.parametrize("align", [512, 4096, 1 << 20])
@pytest.mark.parametrize("nbytes", [1, 4096, _HUGE - 1, _HUGE, 5 * _HUGE + 123])
def test_aligned_empty_alignment_and_size(nbytes: int, align: int) -> None:
    t = aligned_empty(nbytes, align, pin=False)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.is_contiguous()
    assert t.data_ptr() % align == 0
    t.fill_(7)  # every byte writable
    assert int(t[-1]) == 7 and int(t[0]) == 7


@needs_thp
def test_large_buffers_are_advised_huge_pages() -> None:
    """Big I/O buffers are physically contiguous in 2 MiB units (fewer device segments, fewer faults)."""
    big = aligned_empty(8 * _HUGE, pin=False)
    assert "hg" in _vm_flags(big.data_ptr())
    mapped = MappedBuffer(4 * _HUGE)
    assert "hg" in _vm_flags(mapped.addr)
    small = aligned_empty(64 << 10, pin=False)  # small ones stay on torch's allocator
    assert "hg" not in _vm_flags(small.data_ptr())


def test_large_buffer_memory_is_released_with_its_last_view() -> None:
    """The mapping lives as long as a tensor sliced from it, and no longer."""
    t = aligned_empty(4 * _HUGE, pin=False)
    part = t[_HUGE : 2 * _HUGE]
    addr = part.data_ptr()
    del t
    gc.collect()
    part.fill_(1)  # still mapped: the slice keeps it alive
    assert int(part.sum()) == _HUGE
    _vm_flags(addr)
    del part
    gc.collect()
    with pytest.raises(AssertionError, match="no mapping"):
        _vm_flags(addr)
