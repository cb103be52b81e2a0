"""The conformance suite every tier passes (like zarr's ``StoreTests``).

Bind it in a few lines::

    class TestMyTier(TierConformanceTests):
        @pytest.fixture
        def tier(self, tmp_path):
            t = MyTier("mine", tmp_path)
            yield t
            t.close()

The suite only uses the :class:`~tierckpt.tiers.base.Tier` contract, with aligned buffers and offsets.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tierckpt.errors import CheckpointNotFoundError
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import aligned_empty
from tierckpt.tiers.base import CheckpointKey, Tier

__all__ = ["TierConformanceTests"]

_MANIFEST = b"manifest bytes: opaque to the tier"


def _blob(size: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(size)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    return buf


def _write(tier: Tier, key: CheckpointKey, blobs: list[torch.Tensor], manifest: bytes = _MANIFEST,
           chunk: int = 64 << 10) -> None:  # fmt: skip
    entries = [BlobEntry(f"blob-{i:05d}.bin", b.numel()) for i, b in enumerate(blobs)]
    w = tier.reserve(key, entries)
    futs = []
    for i, b in enumerate(blobs):
        dst = w.buffer(i)
        src = b if dst is None else dst
        if dst is not None:
            dst.copy_(b)
        futs += [w.write(i, o, src.data_ptr() + o, min(chunk, b.numel() - o)) for o in range(0, b.numel(), chunk)]
    for f in futs:
        f.result()
    w.commit(manifest)


def _read(tier: Tier, key: CheckpointKey, sizes: list[int]) -> list[torch.Tensor]:
    entries = [BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes)]
    r = tier.reader(key, entries)
    try:
        out = []
        for i, s in enumerate(sizes):
            buf = aligned_empty(s)
            assert r.read(i, 0, buf.data_ptr(), s).result() == s
            out.append(buf)
        return out
    finally:
        r.close()


class TierConformanceTests:
    """Subclass this and provide a ``tier`` fixture that yields a fresh, empty tier."""

    @pytest.fixture
    def tier(self) -> Tier:  # pragma: no cover - overridden
        raise NotImplementedError("bind the suite with a `tier` fixture")

    def test_capabilities_declared(self, tier: Tier) -> None:
        caps = tier.capabilities
        assert caps.device in ("cpu", "cuda", "file")
        assert caps.alignment_bytes > 0 and caps.alignment_bytes & (caps.alignment_bytes - 1) == 0
        assert isinstance(tier.name, str) and tier.name

    def test_empty(self, tier: Tier) -> None:
        assert tier.list_committed() == []
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(CheckpointKey(1))

    def test_round_trip(self, tier: Tier) -> None:
        blobs = [_blob(3 * 65536, 1), _blob(4096, 2)]
        _write(tier, CheckpointKey(7), blobs)
        assert tier.list_committed() == [CheckpointKey(7)]
        assert tier.read_manifest(CheckpointKey(7)) == _MANIFEST
        back = _read(tier, CheckpointKey(7), [b.numel() for b in blobs])
        assert all(torch.equal(a, b) for a, b in zip(blobs, back))
        assert tier.used_bytes() >= sum(b.numel() for b in blobs)

    def test_partial_read_at_offset(self, tier: Tier) -> None:
        blob = _blob(8 * 4096, 3)
        _write(tier, CheckpointKey(1), [blob])
        r = tier.reader(CheckpointKey(1), [BlobEntry("blob-00000.bin", blob.numel())])
        out = aligned_empty(2 * 4096)
        assert r.read(0, 4096, out.data_ptr(), 2 * 4096).result() == 2 * 4096
        r.close()
        assert torch.equal(out, blob[4096 : 3 * 4096])

    def test_read_alignment_is_honoured(self, tier: Tier) -> None:
        """Where ``read_alignment`` gives ``(memory, offset)``, reads at exactly that alignment work."""
        blob = _blob(16 * 4096, 8)
        _write(tier, CheckpointKey(1), [blob])
        r = tier.reader(CheckpointKey(1), [BlobEntry("blob-00000.bin", blob.numel())])
        try:
            al = r.read_alignment(0)
            if al is None:
                pytest.skip("this tier reads into staging-aligned buffers only")
            mem, off = al
            assert mem >= 1 and off >= 1 and mem & (mem - 1) == 0 and off & (off - 1) == 0
            base = aligned_empty(8 * 4096 + 8192)
            shift = mem if mem < 4096 else 0  # an address aligned to ``mem`` and to nothing larger
            addr = base.data_ptr() + shift
            start, n = 3 * off, 4096 // off * off * 3 or off
            assert r.read(0, start, addr, n).result() == n
        finally:
            r.close()
        assert torch.equal(base[shift : shift + n], blob[start : start + n])

    def test_uncommitted_is_invisible_and_abort_leaves_nothing(self, tier: Tier) -> None:
        w = tier.reserve(CheckpointKey(3), [BlobEntry("blob-00000.bin", 4096)])
        assert tier.list_committed() == []
        w.abort()
        w.abort()  # idempotent
        assert tier.list_committed() == []
        _write(tier, CheckpointKey(4), [_blob(4096, 4)])
        assert tier.list_committed() == [CheckpointKey(4)]

    def test_commit_replaces_same_key(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(2), [_blob(4096, 5)], b"first")
        second = _blob(8192, 6)
        _write(tier, CheckpointKey(2), [second], b"second")
        assert tier.list_committed() == [CheckpointKey(2)]
        assert tier.read_manifest(CheckpointKey(2)) == b"second"
        assert torch.equal(_read(tier, CheckpointKey(2), [8192])[0], second)

    def test_no_blobs(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(9), [], b"only a manifest")
        assert tier.read_manifest(CheckpointKey(9)) == b"only a manifest"

    def test_ranks_and_steps_are_independent(self, tier: Tier) -> None:
        keys = [CheckpointKey(s, r) for s in (5, 10) for r in (0, 1)]
        for i, k in enumerate(keys):
            _write(tier, k, [_blob(4096, 10 + i)], f"m{i}".encode())
        assert tier.list_committed() == sorted(keys)
        tier.evict(CheckpointKey(5, 1))
        assert tier.list_committed() == [CheckpointKey(5, 0), CheckpointKey(10, 0), CheckpointKey(10, 1)]
        assert tier.list_committed(rank=1) == [CheckpointKey(10, 1)]
        assert tier.list_committed(rank=0) == [CheckpointKey(5, 0), CheckpointKey(10, 0)]
        assert tier.holds(CheckpointKey(10, 1)) and not tier.holds(CheckpointKey(5, 1))
        assert tier.read_manifest(CheckpointKey(5, 0)) == b"m0"

    def test_evict(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(1), [_blob(4096, 7)])
        _write(tier, CheckpointKey(2), [_blob(4096, 8)])
        tier.evict(CheckpointKey(1))
        tier.evict(CheckpointKey(1))  # missing: ignored
        assert tier.list_committed() == [CheckpointKey(2)]
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(CheckpointKey(1))

    def test_evict_unlisted_now_freed_by_reclaim(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(1), [_blob(65536, 7)])
        _write(tier, CheckpointKey(2), [_blob(4096, 8)])
        used = tier.used_bytes()
        tier.evict(CheckpointKey(1), free=False)
        assert tier.list_committed() == [CheckpointKey(2)]
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(CheckpointKey(1))
        assert tier.used_bytes() <= used
        tier.reclaim()
        tier.reclaim()  # nothing left: a no-op
        assert tier.list_committed() == [CheckpointKey(2)]
        assert torch.equal(_read(tier, CheckpointKey(2), [4096])[0], _blob(4096, 8))
        root = getattr(tier, "path", None)
        if root is not None:  # a file tier: nothing of step 1 is left on disk
            assert not any("000000000001" in str(p) for p in Path(root).rglob("*")), list(Path(root).rglob("*"))

    def test_concurrent_writers_of_different_steps(self, tier: Tier) -> None:
        errors: list[BaseException] = []

        def run(step: int) -> None:
            try:
                _write(tier, CheckpointKey(step), [_blob(65536, step)])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert tier.list_committed() == [CheckpointKey(s) for s in range(4)]
