"""The shared-out host copy (tierckpt.io.copier): every byte lands where it should, whatever the split."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from tierckpt.io import copier
from tierckpt.io.copier import PIECE, copy_spans


def _spans(
    sizes: list[int], seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, int, int]]]:
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return srcs, dsts, [(d.data_ptr(), s.data_ptr(), n) for d, s, n in zip(dsts, srcs, sizes, strict=True)]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "sizes",
    [
        [0, 1, 17],  # below the parallel threshold: plain memmove
        [3 * PIECE + 5, 0, PIECE - 1, 2 * PIECE, 7],  # pieces of many spans, uneven ends
        [11 * PIECE // 3],
    ],
)
def test_every_byte_copied(sizes: list[int], threads: int) -> None:
    srcs, dsts, spans = _spans(sizes)
    copy_spans(spans, threads=threads)
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(s, d)


def test_bytes_outside_the_spans_untouched() -> None:
    src = torch.randint(0, 256, (4 * PIECE,), dtype=torch.uint8)
    dst = torch.full((4 * PIECE + 2,), 0xAB, dtype=torch.uint8)
    copy_spans([(dst.data_ptr() + 1, src.data_ptr(), src.numel())], threads=2)
    assert dst[0] == 0xAB and dst[-1] == 0xAB
    assert torch.equal(dst[1:-1], src)


def test_many_calls_reuse_the_helpers() -> None:
    srcs, dsts, spans = _spans([3 * PIECE])  # kept: the spans' memory must outlive the copy
    copy_spans(spans, threads=3)
    started = copier._helpers._threads
    for seed in range(20):
        srcs, dsts, spans = _spans([PIECE + seed, 2 * PIECE], seed)
        copy_spans(spans, threads=3)
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts, strict=True))
    assert copier._helpers._threads == started


def test_threads_refused_below_one() -> None:
    with pytest.raises(ValueError, match="threads"):
        copy_spans([], threads=0)


_FORKED = f"""
import ctypes, os
from tierckpt.io.copier import copy_spans

def copied():
    n = 3 * {PIECE}
    src = (ctypes.c_ubyte * n).from_buffer_copy(bytes(range(256)) * (n // 256))
    dst = (ctypes.c_ubyte * n)()
    copy_spans([(ctypes.addressof(dst), ctypes.addressof(src), n)], threads=2)
    return bytes(dst) == bytes(src)

assert copied()  # the parent's helper thread exists now
pid = os.fork()
if pid == 0:
    os._exit(0 if copied() else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_copies_with_its_own_helpers() -> None:
    # in a fresh interpreter: a pytest process has used torch's thread pool, which a forked child cannot
    res = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_a_stopped_copy_writes_nothing_after_stop_returns() -> None:
    # what copy_spans does when its caller is interrupted: once stop() returns, no helper touches the memory
    n, piece = 64 << 20, 256 << 10
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    job = copier._Job([(dst.data_ptr() + o, src.data_ptr() + o, piece) for o in range(0, n, piece)])
    helper = threading.Thread(target=job.run)
    helper.start()
    job.stop()
    seen = dst.clone()
    helper.join(30)
    assert not helper.is_alive()
    assert torch.equal(dst, seen)  # nothing written after stop() returned
    job.run()  # a stopped job hands out no more pieces
    assert torch.equal(dst, seen)
