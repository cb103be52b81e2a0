"""``restore(into=...)`` reading the bodies of large tensors straight into the target's memory (no staging
copy) where the tier's read alignment allows it (``_Stream.read_direct``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.datapath.codecread as codecread
import tierckpt.datapath.restore_into as ri
import tierckpt.tiers._fileread as fileread
from tierckpt import CorruptCheckpointError, Hierarchy
from tierckpt.config import LayoutConfig
from tierckpt.io import geometry
from tierckpt.io.buffers import aligned_empty
from tierckpt.io.engine import make_engine
from tierckpt.testing import FaultyTier
from tierckpt.testing.compressed import recompress
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

SLOT = 64 << 10  # 3 small slots: the first reads cover only the start of the first tensor


@pytest.fixture(autouse=True)
def _small_direct_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiers' geometries read tensor bodies of 128 KiB straight into their destinations."""
    monkeypatch.setattr(geometry, "DIRECT_READ_MIN", 128 << 10)


def spy_reads(monkeypatch: pytest.MonkeyPatch, cls: Any) -> list[tuple[int, int]]:
    """(address, length) of every read a reader of class ``cls`` makes from now on."""
    seen: list[tuple[int, int]] = []
    inner = cls.read

    def read(self: Any, blob: int, offset: int, addr: int, nbytes: int) -> Any:
        seen.append((addr, nbytes))
        return inner(self, blob, offset, addr, nbytes)

    monkeypatch.setattr(cls, "read", read)
    return seen


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(address, length) of every read a file tier makes."""
    return spy_reads(monkeypatch, fileread.FileReader)


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(300_001, generator=g),  # 1.2 MB, not a multiple of 4 KiB: a staged tail
        "h": torch.randn(1000, 300, generator=g).to(torch.bfloat16),
        "small": torch.arange(100, dtype=torch.int64),
        "bytes": torch.randint(0, 256, (700_003,), dtype=torch.uint8, generator=g),
        "step": 3,
    }


def page_aligned(t: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """A zeroed tensor like ``t`` at a page-aligned address plus ``shift`` bytes."""
    raw = aligned_empty(t.numel() * t.element_size() + shift, pin=False)[shift:]
    out = raw.view(t.dtype).view(t.shape)
    out.zero_()
    return out


def target_for(state: dict[str, Any], shift: int = 0) -> dict[str, Any]:
    return {k: page_aligned(v, shift if v.dtype == torch.uint8 else 0) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}  # fmt: skip


def into(addrs: list[tuple[int, int]], t: torch.Tensor) -> int:
    """Bytes of the reads that landed inside ``t``'s memory."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return sum(n for a, n in addrs if lo <= a < hi)


def config(tmp_path: Path, *tiers: str, direct: bool = True, engine: str = "auto") -> dict[str, Any]:
    return {
        "tiers": [{"name": t, "kind": "local" if t == "ssd" else "pfs", "path": str(tmp_path / t)} for t in tiers],
        "io": {"engine": engine, "direct": direct},
        "layout": {"blob_size": "1MiB"},
    }


def open_h(cfg: dict[str, Any]) -> Hierarchy:
    h = Hierarchy.from_config(cfg)
    h._in_place = small_staging(h)
    return h


def small_staging(h: Hierarchy) -> ri.RestoreStaging:
    return ri.RestoreStaging(dataclasses.replace(h._geometry, read_slots=3, read_slot_bytes=SLOT))


def tensors(s: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((k, v) for k, v in s.items() if isinstance(v, torch.Tensor))


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, x in tensors(a):
        y = b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), k


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_large_aligned_targets_are_read_into_directly(tmp_path: Path, engine: str, reads: list, loops: str) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd", engine=engine)) as h:
        h.save(state, step=1).wait()
        direct = h.tier("ssd").direct  # type: ignore[attr-defined]
        for _ in range(2):  # the second restore reuses the staging slots
            target = target_for(state)
            ptrs = {k: t.data_ptr() for k, t in tensors(target)}
            reads.clear()
            assert h.restore(into=target) is target
            assert_same(state, target)
            assert target["step"] == 3
            assert {k: t.data_ptr() for k, t in tensors(target)} == ptrs
            for k in ("w", "h", "bytes"):  # all but the staged head (first reads) and the unaligned tail
                t = target[k]
                assert into(reads, t) >= t.numel() * t.element_size() - 3 * SLOT - (4096 if direct else 0), k
            assert into(reads, target["small"]) == 0  # below the threshold: staged


def test_unaligned_targets_are_staged(tmp_path: Path, reads: list) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        if not h.tier("ssd").direct:  # type: ignore[attr-defined]
            pytest.skip("O_DIRECT is not available here: buffered reads may target any address")
        target = target_for(state, shift=1)  # the uint8 tensor sits 1 byte past a page: no DIO alignment allows it
        h.restore(into=target)
        assert_same(state, target)
        assert into(reads, target["bytes"]) == 0
        assert into(reads, target["w"]) > 0


def test_a_compressed_copy_is_decoded_into_any_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressed copy's reader takes reads of any alignment: the bodies of large tensors are decoded
    straight into the target's memory, even one byte past a page."""
    state = make_state()
    seen = spy_reads(monkeypatch, codecread._CodecReader)
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        for key in h.tier("ssd").list_committed():
            recompress(h.tier("ssd"), key, plan=lambda b, k: (2, 0b11) if k % 2 else (1, 1))
        target = target_for(state, shift=1)
        h.restore(into=target)
        assert_same(state, target)
        for k in ("w", "h", "bytes"):
            t = target[k]
            assert into(seen, t) >= t.numel() * t.element_size() - 3 * SLOT, k
        assert into(seen, target["small"]) == 0


def test_buffered_tiers_read_into_any_target(tmp_path: Path, reads: list) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd", direct=False)) as h:
        h.save(state, step=1).wait()
        target = target_for(state, shift=1)
        h.restore(into=target)
        assert_same(state, target)
        assert into(reads, target["bytes"]) > 0


def blob_position(h: Hierarchy, step: int, key: str, where: float) -> tuple[Path, int]:
    """The blob file holding tensor ``key`` and the file offset ``where`` (0..1) into its bytes."""
    _, m = h.inspect(step)
    t = m.tensors
    i = t.paths.index(f"state[{key!r}]")
    p = Path(h.tier("ssd").path) / f"step-{step:012d}" / "rank-00000" / m.blobs[t.blobs[i]].name  # type: ignore[attr-defined]
    return p, t.offsets[i] + int(t.lengths[i] * where)


def test_damage_inside_a_direct_body_is_named_and_the_other_copy_used(tmp_path: Path, reads: list, loops: str) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd", "pfs")) as h:
        h.save(state, step=2).wait()
        p, pos = blob_position(h, 2, "w", 0.6)
        with open(p, "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x01]))
        target = target_for(state)
        with pytest.raises(CorruptCheckpointError) as ei:
            h.restore(into=target, tier="ssd")
        assert (ei.value.tier, ei.value.key) == ("ssd", "state['w']")
        assert into(reads, target["w"]) > 0  # the damaged bytes were read straight into the target
        h.restore(into=target)  # falls back to pfs
        assert_same(state, target)
        assert h.last_restore == (2, "pfs")


def test_blob_truncated_inside_a_direct_body(tmp_path: Path) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=3).wait()
        p, pos = blob_position(h, 3, "w", 0.5)
        with open(p, "r+b") as f:
            f.truncate(pos // 4096 * 4096)
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            h.restore(into=target_for(state))


def test_read_error_inside_a_direct_body_falls_back_to_the_other_copy(tmp_path: Path, reads: list) -> None:
    """A read that fails while a large tensor's body is read straight into the target: the restore
    starts over from the next tier's copy and the target ends up complete."""
    engine = make_engine("auto", queue_depth=8)
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", engine), fail={"read": OSError(5, "injected EIO")}, after=6)
    state = make_state()
    try:
        with Hierarchy([ssd, PfsTier("pfs", tmp_path / "pfs", engine)], layout=LayoutConfig(blob_bytes=1 << 20)) as h:
            h._in_place = small_staging(h)
            h.save(state, step=5).wait()
            ssd.calls["read"] = 0
            target = target_for(state)
            reads.clear()
            h.restore(into=target)
            assert_same(state, target)
            assert h.last_restore == (5, "pfs")
            direct_on_ssd = sum(into(reads[:6], t) for _, t in tensors(target))
            assert direct_on_ssd > 0  # the ssd read straight into the target before its read failed
    finally:
        engine.close()
