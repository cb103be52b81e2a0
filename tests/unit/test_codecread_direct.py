"""A codec reader over a tier that reads into any memory (tierckpt.datapath.codecread): runs of raw frames
read straight into the caller's memory (O_DIRECT's alignment kept: landed aligned, moved down), the rest
staged; reads in flight together; a truncated raw run named; what an open reader keeps between reads
bounded in bytes, and a decoded frame freed once both reads that share it have their parts."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from tests.unit.test_codecread import ALIGN, WHERE, F, _head, _raw_blobs
from tierckpt.datapath import codecread
from tierckpt.datapath.codecread import codec_reader
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.frames import FrameIndex
from tierckpt.format.layout import round_up
from tierckpt.io.buffers import memmove
from tierckpt.testing.compressed import encode_blobs
from tierckpt.tiers.base import TierReader

KiB, MiB = 1 << 10, 1 << 20
#: blob 0: compressed, two raw, compressed (planes), raw, compressed, a short raw last frame
PLAN = {0: (1, 1), 1: (0, 0), 2: (0, 0), 3: (2, 0b11), 4: (0, 0), 5: (4, 0xF)}


class AlignedReader(TierReader):
    """Stored bytes in memory, read into any memory under ``align`` = (memory, offset), as O_DIRECT (or,
    with ``(1, 1)``, a buffered file) reads; optionally each read later, on a thread of its own."""

    def __init__(self, stored: list[bytes], align: tuple[int, int], slow: bool = False) -> None:
        self.stored, self.align = [bytearray(s) for s in stored], align
        self.reads: list[tuple[int, int, int, int]] = []  # (blob, offset, nbytes, addr)
        self.lock, self.inflight, self.most = threading.Lock(), 0, 0
        self.pool = ThreadPoolExecutor(4) if slow else None

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return self.align

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        mem, off = self.align
        assert offset % off == 0 and nbytes % off == 0 and addr % mem == 0, (offset, nbytes, addr % mem)
        with self.lock:
            self.reads.append((blob, offset, nbytes, addr))
            self.inflight += nbytes
            self.most = max(self.most, self.inflight)

        def land() -> int:
            if self.pool is not None:
                time.sleep(random.random() / 500)
            data = bytes(self.stored[blob][offset : offset + nbytes])
            memmove(addr, data, len(data))
            with self.lock:
                self.inflight -= nbytes
            return len(data)

        if self.pool is not None:
            return self.pool.submit(land)
        f: Future[int] = Future()
        f.set_result(land())
        return f


def copy_of(
    align: tuple[int, int], slow: bool = False, plan: dict[int, tuple[int, int]] = PLAN
) -> tuple[list[bytes], FrameIndex, AlignedReader]:
    raw = _raw_blobs()
    bufs = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    index, streams = encode_blobs(bufs, F, lambda b, k: plan.get(k, (0, 0)) if b == 0 else (2, 0b11), 1)
    padded = [s + bytes(round_up(len(s), ALIGN) - len(s)) for s in streams]
    return raw, index, AlignedReader(padded, align, slow)


def read(r: TierReader, blob: int, lo: int, n: int, shift: int = 3) -> tuple[bytes, torch.Tensor]:
    buf = torch.full((n + shift + 8,), 0xA5, dtype=torch.uint8)
    got = r.read(blob, lo, buf.data_ptr() + shift, n).result(timeout=30)
    assert bytes(buf[:shift].tolist()) == b"\xa5" * shift and bytes(buf[shift + n :].tolist()) == b"\xa5" * 8
    return buf[shift : shift + got].numpy().tobytes(), buf


@pytest.mark.parametrize("align", [(1, 1), (512, 512), (4096, 4096)])
def test_ranges_of_every_alignment_into_any_memory(align: tuple[int, int]) -> None:
    raw, index, inner = copy_of(align)
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN, direct_min=1)
    assert index.frame(0, 1).stored_offset % 512  # the raw run after frame 0 starts unaligned
    size = len(raw[0])
    rng = random.Random(align[0])
    ranges = [(0, size), (F, 2 * F), (F + 1, 2 * F - 7), (size - 1, 1), (4 * F - 10, 100)]
    ranges += [(lo, rng.randrange(1, size - lo + 1)) for lo in (rng.randrange(size) for _ in range(60))]
    for lo, n in ranges:
        for shift in (0, 3, 4096):
            assert read(r, 0, lo, n, shift)[0] == raw[0][lo : lo + n], (lo, n, shift)
    assert read(r, 1, 0, len(raw[1]))[0] == raw[1]
    r.close()


@pytest.mark.parametrize("align", [(1, 1), (512, 512)])
def test_raw_runs_land_in_the_destination(align: tuple[int, int]) -> None:
    raw, index, inner = copy_of(align)
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN, direct_min=F)
    _, buf = read(r, 0, 0, len(raw[0]), shift=0)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    straight = [(o, n) for _, o, n, a in inner.reads if lo <= a < hi]
    f1, f4 = index.frame(0, 1), index.frame(0, 4)
    if align == (1, 1):  # the two runs of F or more, exactly their stored bytes
        assert straight == [(f1.stored_offset, 2 * F), (f4.stored_offset, F)]
    else:  # from the aligned offset before each, all but its last bytes
        assert [o for o, _ in straight] == [f1.stored_offset // 512 * 512, f4.stored_offset // 512 * 512]
        assert all(n >= F - 512 for _, n in straight)
    read_bytes = sum(n for _, _, n, _ in inner.reads)
    if align == (1, 1):  # the stored bytes and the padding after them (checked), nothing else
        assert read_bytes == round_up(index.held[0], ALIGN) and len(inner.reads) == 5
    else:  # nothing read twice but a few aligned blocks
        assert read_bytes < index.held[0] + 4 * ALIGN


@pytest.mark.parametrize("align", [(1, 1), (512, 512)])
def test_the_padding_after_a_raw_last_frame_is_checked(align: tuple[int, int]) -> None:
    """The last run of raw frames read straight into place: the padding after it is read, and checked."""
    raw, index, inner = copy_of(align, plan={0: (1, 1)})
    assert index.frame(0, 5).width == 0 and round_up(index.held[0], ALIGN) > index.held[0]
    inner.stored[0][-1] = 1
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN, direct_min=1)
    assert read(r, 0, 0, 4 * F)[0] == raw[0][: 4 * F]  # a read that does not reach it
    with pytest.raises(CorruptCheckpointError, match="padding bytes"):
        read(r, 0, 0, len(raw[0]))


def test_reads_in_flight_together() -> None:
    raw, index, _ = copy_of((512, 512))
    _, _, inner = copy_of((512, 512), slow=True)
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN, direct_min=1)
    size = len(raw[0])
    for piece in (5000, F - 1, F + 4097, 3 * F // 2, 2 * F):
        out = torch.zeros(size + 1, dtype=torch.uint8)
        futs = [(lo, r.read(0, lo, out.data_ptr() + 1 + lo, piece)) for lo in range(0, size, piece)]
        assert [f.result(timeout=30) for _, f in futs] == [min(piece, size - lo) for lo, _ in futs]
        assert out[1:].numpy().tobytes() == raw[0], piece
    assert r.held_bytes().frames == 0  # every frame decoded for two reads was handed out whole: freed
    inner.pool.shutdown()  # type: ignore[union-attr]


def test_a_truncated_raw_run_is_named() -> None:
    raw, index, inner = copy_of((512, 512))
    f2 = index.frame(0, 2)
    del inner.stored[0][round_up(f2.stored_offset + 1000, ALIGN) :]  # frame 1 whole, frame 2 cut short
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN, direct_min=1)
    assert read(r, 0, 0, 2 * F)[0] == raw[0][: 2 * F]
    with pytest.raises(CorruptCheckpointError) as e:
        read(r, 0, 0, len(raw[0]))
    assert "truncated" in str(e.value) and "frame 2 of 6" in str(e.value) and "blob=blob-00000.bin" in str(e.value)


def test_a_failing_read_fails_the_read_after_its_other_parts() -> None:
    """One inner read of several raises: the caller hears of it once the others are done."""
    raw, index, inner = copy_of((1, 1), slow=True)
    real = inner.read
    calls: list[int] = []

    def flaky(blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(5, "injected")
        return real(blob, offset, addr, nbytes)

    inner.read = flaky  # type: ignore[method-assign]
    r = codec_reader(inner, _head(raw), index, where=WHERE, mem_align=ALIGN, direct_min=1)
    with pytest.raises(OSError, match="injected"):
        read(r, 0, 0, len(raw[0]))
    assert len(calls) >= 3 and inner.inflight == 0  # every other part had landed
    inner.read = real  # type: ignore[method-assign]
    assert read(r, 0, 0, len(raw[0]))[0] == raw[0]  # nothing kept from the failed one
    inner.pool.shutdown()  # type: ignore[union-attr]


def _big_copy(frames: int, frame_bytes: int) -> tuple[bytes, FrameIndex, AlignedReader]:
    g = torch.Generator().manual_seed(3)
    raw = (torch.randn(frames * frame_bytes // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    index, [stream] = encode_blobs([raw], frame_bytes, lambda b, k: (2, 0b10), 1)
    assert index.compressed_frames() == frames
    stored = stream + bytes(round_up(len(stream), ALIGN) - len(stream))
    return raw.numpy().tobytes(), index, AlignedReader([stored], (512, 512), slow=True)


def test_staging_in_flight_and_kept_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of compressed frames all submitted at once: the staged reads beyond the bound wait for
    buffers given back (then reuse them); an idle reader keeps at most KEEP_BYTES of them."""
    monkeypatch.setattr(codecread, "KEEP_BYTES", 1 * MiB)
    raw, index, inner = _big_copy(32, 256 * KiB)
    head = _head([raw])
    r = codec_reader(inner, head, index, where=WHERE, mem_align=ALIGN, staging_bytes=2 * MiB)
    out = torch.zeros(len(raw), dtype=torch.uint8)
    piece = 512 * KiB  # two frames a read, about 400 KiB stored
    futs = [r.read(0, lo, out.data_ptr() + lo, piece) for lo in range(0, len(raw), piece)]
    assert all(f.result(timeout=60) == piece for f in futs)
    assert out.numpy().tobytes() == raw
    assert inner.most <= 2 * MiB  # never more staged reads in flight than the bound holds
    held = r.held_bytes()
    assert 0 < held.staging <= 1 * MiB and held.frames == 0
    r.close()
    assert r.held_bytes() == (0, 0)
    inner.pool.shutdown()  # type: ignore[union-attr]


def test_kept_frames_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that each want part of a frame and never the rest: the decoded frames kept for the rest are
    the newest, within KEEP_BYTES (two at least)."""
    monkeypatch.setattr(codecread, "KEEP_BYTES", 600 * KiB)
    raw, index, inner = _big_copy(8, 256 * KiB)
    r = codec_reader(inner, _head([raw]), index, where=WHERE, mem_align=ALIGN)
    for k in range(8):
        lo = k * 256 * KiB
        assert read(r, 0, lo, 1000)[0] == raw[lo : lo + 1000]
        assert r.held_bytes().frames == min(k + 1, 2) * 256 * KiB
    lo = 7 * 256 * KiB + 1000
    assert read(r, 0, lo, 256 * KiB - 1000)[0] == raw[lo:]  # the rest of the last one (not read again): freed
    assert r.held_bytes().frames == 256 * KiB
    assert len(inner.reads) == 8
    inner.pool.shutdown()  # type: ignore[union-attr]
