"""How a codec reader reads raw bytes ``[lo, lo + n)`` of a blob of a compressed copy: the reads of stored
bytes it makes of the tier beneath, where each lands, and what is decoded or moved after it lands. Pure:
no I/O (:mod:`tierckpt.datapath.codecread` carries a plan out).

* A run of consecutive frames stored raw (width 0) is read **straight into the caller's memory**
  (:class:`Direct`) where the tier beneath reads into any memory (its ``read_alignment``) and the run
  is at least ``direct_min`` bytes. A buffered file, an object store, a memory tier: the stored bytes
  land where they belong. O_DIRECT needs the file offset, the length and the address aligned, but a raw
  frame after a compressed one starts at any stored offset: the read starts at the aligned offset
  before it, lands at the first aligned address of the run's destination, and its wanted bytes are then
  moved down by ``shift`` (fewer than two alignment units), inside the caller's memory; the run's last
  bytes (less than two units) come with the staged reads. No staging buffer, no page faults of fresh
  memory, one move instead of a copy out of a buffer.
* Everything else (compressed frames, short raw runs, those tails) is read into staging buffers
  (:class:`Staged`, one read for pieces whose stored bytes touch the same aligned blocks), in the tier's
  (or the copy's) alignment: a compressed frame is decoded from there into the caller's memory (wholly
  wanted) or into a frame buffer kept for the reads sharing it (partly wanted), raw bytes are copied
  out. A read that reaches the end of the blob's stored stream reads the zero padding after it, which
  is checked.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from tierckpt.format.frames import Frame
from tierckpt.format.layout import round_up

__all__ = ["Direct", "Piece", "Plan", "Rules", "Staged", "plan_read"]


@dataclass(frozen=True)
class Rules:
    """What the reads of one blob's stored bytes must respect.

    Attributes:
        align: a staged read's offset and length alignment (the tier beneath's ``read_alignment`` where it
            has one that divides the copy's, else the copy's).
        end: the blob's stored region's end (its stored stream rounded up to ``align``): no read passes it.
        held: the blob's stored stream's length.
        direct: ``(memory, offset)`` alignment of a read into any memory (the tier beneath's
            ``read_alignment``); None: it reads only into aligned buffers.
        direct_min: the least raw run read straight into place.
    """

    align: int
    end: int
    held: int
    direct: tuple[int, int] | None
    direct_min: int


@dataclass(frozen=True)
class Direct:
    """A run of raw frames read straight into the caller's memory (offsets into the caller's range).

    Attributes:
        at: stored offset of the read.
        nbytes: its length.
        land: where its first byte lands.
        dst: where its first wanted byte belongs (``land - dst`` < the memory alignment).
        shift: how far above ``dst`` that byte lands (0: in place, nothing moved).
        keep: the wanted bytes it holds, moved down by ``shift`` once it lands.
    """

    at: int
    nbytes: int
    land: int
    dst: int
    shift: int
    keep: int


@dataclass(frozen=True)
class Piece:
    """Stored bytes a staged read holds: a compressed frame, or raw bytes of a run.

    Attributes:
        k: the frame (of a raw run: its first frame in the read).
        frame: that frame.
        src: stored offset of the piece's first byte.
        nbytes: its stored bytes.
        dst: where its raw bytes go (offset into the caller's range); None: a partly wanted compressed
            frame, decoded whole into a frame buffer.
        after: the :class:`Direct` (its index) that lands over this piece's destination: copied after it.
    """

    k: int
    frame: Frame
    src: int
    nbytes: int
    dst: int | None
    after: int | None = None


@dataclass(frozen=True)
class Staged:
    """One read of stored bytes into a staging buffer.

    Attributes:
        at: its stored offset (aligned).
        nbytes: its length (aligned, or to the stored region's end).
        pieces: what it holds, in stored order.
        pad: the zero padding after the blob's stored stream it holds, from ``held`` to its end (0: it does
            not reach the stream's end). A read that reaches the stream's end reads the padding too
            (padding only, no pieces, where a read straight into place held the end).
    """

    at: int
    nbytes: int
    pieces: tuple[Piece, ...]
    pad: int = 0


@dataclass(frozen=True)
class Plan:
    """A read's reads: straight into place first, then staged."""

    directs: tuple[Direct, ...]
    staged: tuple[Staged, ...]


def plan_read(
    frames: Sequence[tuple[int, Frame]], lo: int, n: int, addr: int, rules: Rules, elsewhere: Container[int] = ()
) -> Plan:
    """The reads that bring raw bytes ``[lo, lo + n)`` to ``addr``.

    Args:
        frames: the frames holding them, in order, as ``(k, frame)``.
        lo: the first raw byte.
        n: how many.
        addr: where they go.
        rules: the blob's :class:`Rules`.
        elsewhere: partly wanted compressed frames that another read decodes (not read here).
    """
    hi = lo + n
    directs: list[Direct] = []
    pieces: list[Piece] = []
    i = 0
    while i < len(frames):
        k, f = frames[i]
        if f.width:  # compressed: decoded into place (wholly wanted) or into a frame buffer
            if k not in elsewhere:
                whole = lo <= f.raw_offset and f.raw_offset + f.raw_len <= hi
                pieces.append(Piece(k, f, f.stored_offset, f.stored_len, f.raw_offset - lo if whole else None))
            i += 1
            continue
        j = i + 1
        while j < len(frames) and not frames[j][1].width:
            j += 1
        end = frames[j - 1][1]
        r0, r1 = max(lo, f.raw_offset), min(hi, end.raw_offset + end.raw_len)
        src, dst, size = f.stored_offset + r0 - f.raw_offset, r0 - lo, r1 - r0
        d = _direct(src, dst, size, addr, rules)
        after = None
        if d is not None:
            directs.append(d)
            after = len(directs) - 1 if d.shift else None  # its landing overlaps what is left of the run
            src, dst, size = src + d.keep, dst + d.keep, size - d.keep
        if size:
            pieces.append(Piece(k, f, src, size, dst, after))
        i = j
    staged = _staged(pieces, rules)
    if rules.end > rules.held and any(d.at + d.nbytes == rules.held for d in directs):
        at = rules.held // rules.align * rules.align  # its padding
        staged.append(Staged(at, rules.end - at, (), rules.end - rules.held))
    return Plan(tuple(directs), tuple(staged))


def _direct(src: int, dst: int, size: int, addr: int, rules: Rules) -> Direct | None:
    """Stored bytes ``[src, src + size)`` of a raw run read straight to ``addr + dst``: the longest
    aligned read that lands inside the run's destination; None where none is worth it."""
    if rules.direct is None or size < rules.direct_min:
        return None
    mem, off = rules.direct
    gap = -(addr + dst) % mem  # the first address it may land at
    at = src - src % off
    nbytes = (size - gap) // off * off
    keep = nbytes - (src - at)
    if keep <= 0:
        return None
    return Direct(at, nbytes, dst + gap, dst, gap + src - at, keep)


def _staged(pieces: list[Piece], rules: Rules) -> list[Staged]:
    """The pieces in reads of the copy's alignment: one for pieces whose aligned blocks touch."""
    out: list[Staged] = []
    group: list[Piece] = []

    def flush() -> None:
        s0, s1 = group[0].src, group[-1].src + group[-1].nbytes
        at = s0 // rules.align * rules.align
        end = rules.end if s1 == rules.held else min(round_up(s1, rules.align), rules.end)  # the padding too
        out.append(Staged(at, end - at, tuple(group), end - rules.held if s1 == rules.held < end else 0))
        group.clear()

    for p in pieces:
        if group and p.src > round_up(group[-1].src + group[-1].nbytes, rules.align):
            flush()
        group.append(p)
    if group:
        flush()
    return out
