"""How a codec reader plans a read (tierckpt.datapath.codecplan): runs of raw frames straight into the
caller's memory (in place where the tier reads anywhere, moved down after an aligned read for O_DIRECT),
compressed frames and what is left staged, in reads of the copy's alignment."""

from __future__ import annotations

import random

import pytest

from tierckpt.datapath.codecplan import Direct, Plan, Rules, plan_read
from tierckpt.format.frames import Frame
from tierckpt.format.layout import round_up

KiB = 1 << 10
F = 16 * KiB  # frames are made here, not checked: small ones keep the byte-by-byte simulation quick
ALIGN = 4096


def frames_of(stored: list[int | None], size: int | None = None) -> tuple[list[tuple[int, Frame]], int]:
    """Frames of F raw bytes, frame k stored raw (None) or compressed to ``stored[k]`` bytes (width 1);
    and the blob's stored length."""
    out, at = [], 0
    size = len(stored) * F if size is None else size
    for k, s in enumerate(stored):
        raw = min(F, size - k * F)
        f = Frame(k * F, raw, at, 0, 0, (raw,)) if s is None else Frame(k * F, raw, at, 1, 1, (s,))
        out.append((k, f))
        at += f.stored_len
    return out, at


def rules(held: int, direct: tuple[int, int] | None, direct_min: int = 1) -> Rules:
    return Rules(ALIGN, round_up(held, ALIGN), held, direct, direct_min)


def simulate(plan: Plan, frames: list[tuple[int, Frame]], lo: int, n: int, addr: int, r: Rules) -> list[int]:
    """Where each wanted raw byte comes from, carrying the plan out on labels: raw byte x of the blob is
    stored (raw frames) at a stored offset; compressed ones decode to their raw offsets."""
    stored_of = {}
    for _, f in frames:
        for x in range(f.raw_len):
            stored_of[f.stored_offset + x] = f.raw_offset + x if f.width == 0 else None
    dest: list[int | None] = [None] * n
    for d in plan.directs:  # lands, then moves down
        assert d.at % r.direct[1] == 0 and d.nbytes % r.direct[1] == 0 and (addr + d.land) % r.direct[0] == 0  # type: ignore[index]
        assert d.dst <= d.land and d.land + d.nbytes <= n and d.at + d.nbytes <= r.held
        for i in range(d.nbytes):
            dest[d.land + i] = stored_of.get(d.at + i)
        dest[d.dst : d.dst + d.keep] = dest[d.dst + d.shift : d.dst + d.shift + d.keep]
    for s in plan.staged:
        assert s.at % ALIGN == 0 and (s.nbytes % ALIGN == 0 or s.at + s.nbytes == r.end) and s.at + s.nbytes <= r.end
        for p in s.pieces:
            assert s.at <= p.src and p.src + p.nbytes <= s.at + s.nbytes
            if p.frame.width and p.dst is not None:
                dest[p.dst : p.dst + p.frame.raw_len] = range(p.frame.raw_offset, p.frame.raw_offset + p.frame.raw_len)
            elif p.frame.width == 0:
                assert p.dst is not None
                dest[p.dst : p.dst + p.nbytes] = [stored_of[p.src + i] for i in range(p.nbytes)]
    for _, f in frames:  # partly wanted compressed frames: through a frame buffer
        if f.width and not (lo <= f.raw_offset and f.raw_offset + f.raw_len <= lo + n):
            for x in range(max(lo, f.raw_offset), min(lo + n, f.raw_offset + f.raw_len)):
                dest[x - lo] = x
    return dest  # type: ignore[return-value]


LAYOUT = [3000, None, None, 5001, None, 777, None]  # compressed, two raw, compressed, raw, compressed, raw


@pytest.mark.parametrize("direct", [None, (1, 1), (512, 512), (4096, 4096)])
def test_every_wanted_byte_comes_from_its_place(direct: tuple[int, int] | None) -> None:
    frames_all, held = frames_of(LAYOUT)
    r = rules(held, direct)
    rng = random.Random(1)
    size = len(LAYOUT) * F
    cases = [(0, size, 0), (F, 2 * F, 0), (F + 1, 2 * F - 5, 3), (3, size - 3, 4097)]
    cases += [
        (lo, rng.randrange(1, size - lo + 1), rng.randrange(8192)) for lo in (rng.randrange(size) for _ in range(40))
    ]
    for lo, n, addr in cases:
        frames = [(k, f) for k, f in frames_all if f.raw_offset < lo + n and f.raw_offset + f.raw_len > lo]
        plan = plan_read(frames, lo, n, addr, r)
        assert simulate(plan, frames, lo, n, addr, r) == list(range(lo, lo + n)), (lo, n, addr)


def test_a_tier_that_reads_anywhere_reads_raw_runs_in_place() -> None:
    frames, held = frames_of(LAYOUT)
    plan = plan_read(frames, 0, len(LAYOUT) * F, 12345, rules(held, (1, 1)))
    f1, f4, f6 = frames[1][1], frames[4][1], frames[6][1]
    assert plan.directs == (
        Direct(f1.stored_offset, 2 * F, F, F, 0, 2 * F),
        Direct(f4.stored_offset, F, 4 * F, 4 * F, 0, F),
        Direct(f6.stored_offset, F, 6 * F, 6 * F, 0, F),
    )
    # each compressed frame alone, then the padding after the stream (the last run held its end)
    assert [[p.k for p in s.pieces] for s in plan.staged] == [[0], [3], [5], []] and plan.staged[-1].pad


def test_o_direct_lands_aligned_and_moves_down_the_rest_staged_with_the_next_frame() -> None:
    frames, held = frames_of(LAYOUT)
    plan = plan_read(frames, 0, len(LAYOUT) * F, 0, rules(held, (512, 512)))
    d = plan.directs[0]
    f1 = frames[1][1]
    assert (d.at, d.land, d.dst, d.shift) == (f1.stored_offset // 512 * 512, F, F, f1.stored_offset % 512)
    assert d.nbytes == 2 * F and d.keep == d.nbytes - d.shift  # lands on the run's own bytes, no further
    tail = plan.staged[1].pieces  # the run's last bytes and frame 3, in one read
    assert [(p.k, p.after) for p in tail] == [(1, 0), (3, None)]
    assert tail[0].dst == F + d.keep and tail[0].nbytes == 2 * F - d.keep


def test_short_runs_and_tiers_that_read_only_aligned_buffers_are_staged_in_one_read() -> None:
    frames, held = frames_of(LAYOUT)
    for r in (rules(held, None), rules(held, (1, 1), direct_min=2 * F + 1)):
        plan = plan_read(frames, 0, len(LAYOUT) * F, 0, r)
        assert plan.directs == () and len(plan.staged) == 1 and (plan.staged[0].at, plan.staged[0].nbytes) == (0, r.end)


def test_a_frame_decoded_elsewhere_is_not_read() -> None:
    frames, held = frames_of(LAYOUT)
    plan = plan_read(frames[:2], 100, 2 * F - 100, 0, rules(held, (1, 1)), elsewhere={0})
    assert [p.k for s in plan.staged for p in s.pieces] == [] and len(plan.directs) == 1


@pytest.mark.parametrize("direct", [None, (1, 1), (512, 512)])
@pytest.mark.parametrize("last", [1000, None], ids=["compressed", "raw"])
def test_the_padding_is_read_where_a_read_reaches_the_stream_s_end(
    direct: tuple[int, int] | None, last: int | None
) -> None:
    """Staged with the last pieces, or alone after a read straight into place: checked zero."""
    frames, held = frames_of([None, last], size=F + F // 2 + 100)
    r = rules(held, direct)
    plan = plan_read(frames, 0, F + F // 2 + 100, 0, r)
    assert r.end > held and plan.staged[-1].at + plan.staged[-1].nbytes == r.end
    assert plan.staged[-1].pad == r.end - held
    assert all(s.pad == 0 for s in plan.staged[:-1])
    short = plan_read(frames[:1], 0, F, 0, r)  # not reaching the end: no padding read
    assert all(s.pad == 0 and s.at + s.nbytes <= round_up(F, ALIGN) for s in short.staged)
