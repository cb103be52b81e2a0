"""One flipped bit anywhere in a checkpoint never changes what a reader returns: for every tier kind, every
bit of a small checkpoint's manifest (header, payload, checksum) and a sample of its blob bits are flipped
one at a time, in place, and ``restore()``, ``restore(into=)`` and ``verify()`` must each return exactly
the saved state or raise CorruptCheckpointError; with a second tier holding a good copy, ``restore()``
falls back and returns exactly the state. The same holds for a compressed copy (its version-6 manifest
file: envelope, inner manifest and frame index, and its stored bytes: zstd streams, raw byte planes and the
zero padding after each blob's stored stream).

``TIERCKPT_BITFLIP_BLOB_BITS`` sets how many blob bits each tier kind flips, plain and compressed: 2,500
by default, the 10,000-bit sample over the four kinds (each flip costs three reads of the blobs: the plain
copies took 51 s on a quiet two-core machine; plain and compressed, 228 s on a loaded one; set it lower
there). The manifest is always flipped exhaustively.
"""

from __future__ import annotations

import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CorruptCheckpointError, Hierarchy, Tier
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import decode_head
from tierckpt.io.engine import make_engine
from tierckpt.testing.compressed import recompress
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.gpu import GpuTier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

KEY = CheckpointKey(1, 0)
BLOB_BITS = int(os.environ.get("TIERCKPT_BITFLIP_BLOB_BITS", "2500"))
FALLBACK_EVERY = 32  # the two-tier fallback is checked on every 32nd flipped bit (it reads the good copy)
MiB = 1 << 20


def tiny_state() -> dict[Any, Any]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, generator=g)
    return {
        "w": w,
        "tied": w,  # one tensor, referenced twice
        "h": torch.randn(5, generator=g).to(torch.float16),
        "bf": torch.randn(3, generator=g).to(torch.bfloat16),
        "i": torch.tensor([1, -2, 1 << 40], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 2),
        "meta": {"step": 7, "lr": 0.5, "name": "run", "raw": b"\x00\xff", "none": None, "on": True},
        "betas": (0.9, 0.95),
        3: [1, -1, "three"],
        "od": OrderedDict(b=1, a=2),
    }


def target() -> dict[Any, Any]:
    """A restore(into=) target: the tensors zeroed, the plain values None (the checkpoint's are assigned)."""
    s = tiny_state()
    out: dict[Any, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in s.items()}
    out["tied"] = out["w"]
    return out


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of states: types, keys in order, dtypes, shapes and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def exact(got: Any) -> bool:
    return same(tiny_state(), got) and got["w"] is got["tied"]


# -- flipping bits in place, per tier kind ----------------------------------------------------------------
class Flipper:
    """Flips one bit of the manifest or of a blob of ``KEY`` on a tier, in place (XOR twice restores it)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        held = getattr(tier, "_held", None)
        if held is not None:  # memory tiers: the manifest bytes object and the blob tensors
            self.rec = held[KEY]
            self.manifest_len = len(self.rec.manifest)
            self.blob_lens = [b.numel() for b in self.rec.blobs]
        else:
            rank_dir = next(Path(tier.path).glob("step-*/rank-00000"))  # type: ignore[attr-defined]
            self.files = [rank_dir / "manifest", *sorted(rank_dir.glob("blob-*")), *rank_dir.glob("data.bin")]
            self.manifest_len = self.files[0].stat().st_size
            self.blob_lens = [f.stat().st_size for f in self.files[1:]]

    def manifest(self, bit: int) -> None:
        pos, mask = divmod(bit, 8)
        if hasattr(self, "rec"):
            data = bytearray(self.rec.manifest)
            data[pos] ^= 1 << mask
            self.rec.manifest = bytes(data)
        else:
            self._file(self.files[0], pos, 1 << mask)

    def blob(self, bit: int) -> None:
        for i, n in enumerate(self.blob_lens):
            if bit < n * 8:
                pos, mask = divmod(bit, 8)
                if hasattr(self, "rec"):
                    self.rec.blobs[i][pos] ^= 1 << mask
                else:
                    self._file(self.files[1 + i], pos, 1 << mask)
                return
            bit -= n * 8
        raise IndexError(bit)

    @staticmethod
    def _file(path: Path, pos: int, mask: int) -> None:
        with open(path, "r+b") as f:
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ mask]))


KINDS: dict[str, Callable[[Path, str], Tier]] = {
    "host": lambda p, n: HostTier(n, 64 * MiB),
    "gpu": lambda p, n: GpuTier(n, 64 * MiB, device="cpu"),
    "local": lambda p, n: LocalTier(n, p / n, make_engine("threads", 2)),
    "pfs": lambda p, n: PfsTier(n, p / n, make_engine("threads", 2)),
}


@pytest.fixture(
    params=[(k, c) for k in sorted(KINDS) for c in (False, True)], ids=lambda p: f"{p[0]}-{'zstd' if p[1] else 'plain'}"
)
def hierarchies(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Hierarchy, Hierarchy, Flipper]]:
    """``(alone, paired, flipper)``: the tier under test alone, and the same tier object above a tier
    that holds a good copy (a host tier), both holding step 1; ``flipper`` flips the tested tier's copy.
    Compressed (``-zstd``): the tested tier's copy stored again in 4 byte planes, two in zstd streams
    and two raw; the flipper's blob bits are then those of the stored stream and its padding."""
    kind, compressed = request.param
    tier = KINDS[kind](tmp_path, "x")
    paired = Hierarchy([tier, HostTier("good", 64 * MiB)])
    paired.save(tiny_state(), step=1).wait()
    assert [c.tiers for c in paired.checkpoints()] == [("x", "good")]
    index = recompress(tier, KEY, plan=lambda b, k: (4, 0b0101)) if compressed else None
    alone = Hierarchy([tier], readonly=True)
    flipper = Flipper(tier)
    if index is not None:
        head = decode_head(tier.read_manifest(KEY))
        assert head.frames == index and index.compressed_frames() and index.frame(0, 0).planes == 0b0101
        assert len(flipper.blob_lens) == len(index.held) == 1  # one blob, at the start of its file or buffer
        flipper.blob_lens = [round_up(h, head.align) for h in index.held]  # bytes past them are never read
    logging.disable(logging.WARNING)  # thousands of "unusable copy" warnings
    try:
        yield alone, paired, flipper
    finally:
        logging.disable(logging.NOTSET)
        alone.close()
        paired.close()


def check_one(alone: Hierarchy, paired: Hierarchy, fallback: bool) -> str:
    """restore(), restore(into=) and verify() of the damaged copy: exactly the state, or a corrupt error."""
    outcomes = []
    for op in ("restore", "into"):
        try:
            if op == "restore":
                got = alone.restore()
            else:
                tgt = target()
                got = alone.restore(into=tgt)
                assert got is tgt
        except CorruptCheckpointError:
            outcomes.append("corrupt")
            continue
        assert exact(got), f"{op} returned a state that was not saved"
        outcomes.append("exact")
    [(_, _, err)] = alone.verify(1)
    assert err is None or isinstance(err, CorruptCheckpointError), repr(err)
    outcomes.append("corrupt" if err else "exact")
    if fallback:
        assert exact(paired.restore()), "the fallback to the good copy returned a state that was not saved"
    return ",".join(outcomes)


def flip_each(
    hierarchies: tuple[Hierarchy, Hierarchy, Flipper], flip: Callable[[int], None], bits: list[int]
) -> dict[str, int]:
    """Flip each of ``bits`` in turn (and back), counting the readers' outcomes; the copy is whole after."""
    alone, paired, _ = hierarchies
    seen: dict[str, int] = {}
    for n, bit in enumerate(bits):
        flip(bit)
        try:
            outcome = check_one(alone, paired, fallback=n % FALLBACK_EVERY == 0)
        finally:
            flip(bit)
        seen[outcome] = seen.get(outcome, 0) + 1
    assert exact(alone.restore()) and alone.verify(1) == [(1, "x", None)]
    return seen


def test_every_manifest_bit(hierarchies: tuple[Hierarchy, Hierarchy, Flipper]) -> None:
    flipper = hierarchies[2]
    n = flipper.manifest_len * 8
    # The manifest is checksummed whole (format version 4), as is a compressed copy's envelope (version 6)
    # around it: no flipped bit goes unnoticed by any reader.
    assert flip_each(hierarchies, flipper.manifest, list(range(n))) == {"corrupt,corrupt,corrupt": n}


def test_sampled_blob_bits(hierarchies: tuple[Hierarchy, Hierarchy, Flipper]) -> None:
    flipper = hierarchies[2]
    total = sum(flipper.blob_lens) * 8
    bits = random.Random(19).sample(range(total), min(BLOB_BITS, total))
    # Tensor bytes are checksummed and gaps and padding must be zero: every flip is found. In a compressed
    # copy a zstd stream's content checksum, the tensor checksums (a raw plane) or the zero padding after
    # the stored stream find it.
    assert flip_each(hierarchies, flipper.blob, bits) == {"corrupt,corrupt,corrupt": len(bits)}
