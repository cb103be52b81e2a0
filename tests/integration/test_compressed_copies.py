"""Copies stored compressed, end to end: a save demoted to tiers that compress (``compress:``), restored
from them; frames passed through between two tiers that compress, decoded for one that does not; the
commit records naming one tag on every tier; a tier that takes its writes in order; a budgeted tier's
``auto``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.format.frames import held_sizes, unwrap_manifest
from tierckpt.format.manifest import decode_head
from tierckpt.format.record import decode_record, manifest_tag
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.compression import Adaptive
from tierckpt.testing.faulty import FaultyTier
from tierckpt.tiers.base import CheckpointKey, Tier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

MiB = 1 << 20
ZSTD = CompressConfig("zstd")


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3 * MiB // 2, generator=g)
    return {
        "model": {"w": w.to(torch.bfloat16), "b": torch.zeros(4096), "big": torch.randn(700_000, generator=g)},
        "optim": {"exp_avg": w * 1e-3, "exp_avg_sq": (w * 1e-3) ** 2, "step": torch.tensor(7)},
        "rng": torch.randint(0, 256, (300_001,), dtype=torch.uint8, generator=g),
        "meta": {"epoch": 3},
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def _with(tier: Tier, cfg: CompressConfig) -> Tier:
    tier.compress = cfg
    return tier


def _manifest(tier: Tier, step: int) -> bytes:
    return tier.read_manifest(CheckpointKey(step))


def _tag(tier: Tier, step: int) -> int:
    data = tier.read_record(step)
    assert data is not None, f"no record of step {step} on {tier.name}"
    return decode_record(data, step).manifests[0]


def test_save_demote_to_a_compressing_tier_and_restore_from_it(tmp_path: Path) -> None:
    ssd = _with(LocalTier("ssd", tmp_path / "ssd"), ZSTD)
    s = state()
    with Hierarchy([HostTier("host", 256 * MiB), ssd], policy={"keep": {"host": 1}}) as h:
        h.save(s, step=1).durable["ssd"].result()
        manifest = _manifest(ssd, 1)
        inner, index = unwrap_manifest(manifest)
        assert index is not None and index.compressed_frames() > 0
        files = [tmp_path / "ssd" / "step-000000000001" / "rank-00000" / b.name for b in decode_head(inner).blobs]
        assert [f.stat().st_size for f in files] == held_sizes(manifest)  # blob files cut to what they hold
        assert sum(held_sizes(manifest) or []) < sum(b.size for b in decode_head(inner).blobs)
        assert same(h.restore(1, tier="ssd"), s)
        assert sorted((t, e) for _, t, e in h.verify(1)) == [("host", None), ("ssd", None)]  # raw checksums
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd")]) as h:  # a new process reads it (compress: none)
        assert same(h.restore(1), s)


def test_frames_pass_through_between_compressing_tiers_and_are_decoded_for_a_plain_one(tmp_path: Path) -> None:
    pfs = _with(PfsTier("pfs", tmp_path / "pfs"), ZSTD)
    far = _with(LocalTier("far", tmp_path / "far"), CompressConfig("auto"))
    plain = LocalTier("plain", tmp_path / "plain")
    s = state(1)
    tiers = [HostTier("host", 256 * MiB), pfs, far, plain]
    with Hierarchy(tiers) as h:
        done = h.save(s, step=2).durable
        for name in ("pfs", "far", "plain"):
            done[name].result()
        at_pfs, at_far, at_plain = (_manifest(t, 2) for t in (pfs, far, plain))
        assert at_far == at_pfs  # the frames went through as pfs stored them: the same file, byte for byte
        inner, index = unwrap_manifest(at_pfs)
        assert index is not None and at_plain == inner  # decoded: the plain copy has the inner manifest
        far_files = [tmp_path / "far" / "step-000000000002" / "rank-00000" / b.name for b in decode_head(inner).blobs]
        assert [f.stat().st_size for f in far_files] == held_sizes(at_pfs)
        # one tag on every tier: the inner manifest's
        assert {_tag(t, 2) for t in tiers} == {manifest_tag(inner)} == {manifest_tag(at_pfs)}
        for name in ("pfs", "far", "plain"):
            assert same(h.restore(2, tier=name), s)


def test_a_compressed_copy_promoted_to_a_memory_tier(tmp_path: Path) -> None:
    """A restore from a compressed copy that promotes it: the host tier (compress: none) gets it decoded."""
    s = state(2)
    with Hierarchy([_with(LocalTier("ssd", tmp_path / "ssd"), ZSTD)]) as h:
        h.save(s, step=3, blocking=True)
    host = HostTier("host", 256 * MiB)
    with Hierarchy([host, LocalTier("ssd", tmp_path / "ssd")], policy={"promote": {"on_restore": True}}) as h:
        assert same(h.restore(3), s)
        h.wait()
        h.prefetch(3, to="host").result()
        assert unwrap_manifest(_manifest(host, 3))[1] is None
        assert same(h.restore(3, tier="host"), s)


def test_a_tier_that_takes_writes_in_order(tmp_path: Path) -> None:
    local = LocalTier("seq", tmp_path / "seq")
    seq = _with(FaultyTier(local, capabilities={"sequential_writes": True}), ZSTD)
    s = state(3)
    with Hierarchy([HostTier("host", 256 * MiB), seq]) as h:
        h.save(s, step=4).durable["seq"].result()
        assert unwrap_manifest(_manifest(seq, 4))[1] is not None
        assert same(h.restore(4, tier="seq"), s)


def test_the_top_tier_compresses_what_it_packs(tmp_path: Path) -> None:
    ssd = _with(LocalTier("ssd", tmp_path / "ssd"), ZSTD)
    s = state(4)
    with Hierarchy([ssd]) as h:
        h.save(s, step=5, blocking=True)
        assert unwrap_manifest(_manifest(ssd, 5))[1] is not None
        assert same(h.restore(5), s)


def test_compress_from_the_config(tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"name": "host", "kind": "host", "capacity": "256MiB"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd"), "compress": "zstd:3"},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs"), "compress": "none"},
        ],
        "io": {"chunk": "1MiB"},
    }
    s = state(5)
    with Hierarchy.from_config(cfg) as h:
        d = h.save(s, step=6).durable
        d["ssd"].result()
        d["pfs"].result()
        ssd, pfs = h.tier("ssd"), h.tier("pfs")
        assert ssd.compress == CompressConfig("zstd", 3) and pfs.compress == CompressConfig("none")
        assert unwrap_manifest(_manifest(ssd, 6))[1] is not None
        assert unwrap_manifest(_manifest(pfs, 6))[1] is None
        assert same(h.restore(6, tier="ssd"), s)


def test_auto_compresses_on_a_budgeted_tier(tmp_path: Path) -> None:
    """``auto`` on a tier whose budget (20 MB/s) is far below what the compressor does: once the kind is
    measured (the first save's samples) and what the tier's writes cost the CPUs (measured over the saves'
    writes, where the CPUs' time can be read), every frame of floating-point data is stored compressed."""
    slow = _with(PfsTier("pfs", tmp_path / "pfs", bandwidth_bytes_per_sec=40_000_000), CompressConfig("auto"))
    s = {"w": torch.randn(8 * MiB).to(torch.bfloat16)}
    with Hierarchy([HostTier("host", 256 * MiB), slow], policy={"keep": {"pfs": 1}}) as h:
        for step in range(6, 12):  # a few saves: the budget's burst lets the first ones through at once
            h.save(s, step=step).durable["pfs"].result()
            _, index = unwrap_manifest(_manifest(slow, step))
            if index is not None and index.compressed_frames() == index.total:
                break
        assert index is not None and index.compressed_frames() == index.total
        assert slow.adaptive is not None  # the demotions' decisions: under the budget that paced them
        assert slow.adaptive.snapshot(40e6)["kinds"]["bfloat16/weight"]["planes"] != 0
        assert same(h.restore(step, tier="pfs"), s)


def _one_frame(seed: int) -> dict[str, Any]:
    """A state whose copy is one frame that compresses: its writes resolve once it is encoded, before
    the codec writer hands the tier anything, so a tier's refusal of that write comes at the commit."""
    return {"w": torch.randn(128 * 1024, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)}


@pytest.mark.parametrize("kind", ["capacity", "device"])
@pytest.mark.parametrize("make", [_one_frame, state], ids=["at-commit", "from-writes"])
def test_a_compressed_tier_refusing_a_write_for_room_evicts_nothing(
    tmp_path: Path, kind: str, make: Callable[[int], dict[str, Any]]
) -> None:
    """The ssd (zstd) refuses a write of step 2's copy for room (a quota, a full device: a TierFullError
    from the write's future), found at the commit or by the copy's writes. Committing again cannot make
    that write again, so the copy fails at once (docs/policies.md, "Failures": the step's ssd state
    "failed", ``handle.wait(tier="ssd")`` raises a TierIOError with ENOSPC caused by the tier's error):
    step 1's ssd copy, which pfs also holds and a full tier would evict to make room, stays; step 2
    reaches pfs from host; the next save goes on."""
    from tierckpt.errors import DeviceFullError, TierFullError, TierIOError

    full = TierFullError("injected: over the quota") if kind == "capacity" else DeviceFullError(28, "injected: full")
    ssd = _with(FaultyTier(LocalTier("ssd", tmp_path / "ssd")), ZSTD)
    pfs = _with(PfsTier("pfs", tmp_path / "pfs"), CompressConfig("none"))
    with Hierarchy([HostTier("host", 256 * MiB), ssd, pfs]) as h:
        h.save(make(1), step=1).wait(timeout=60)
        assert unwrap_manifest(_manifest(ssd, 1))[1] is not None  # stored compressed: the codec writer's
        ssd.fail["write"] = full
        handle = h.save(make(2), step=2)
        with pytest.raises(TierIOError) as e:
            handle.wait(tier="ssd", timeout=60)
        assert not isinstance(e.value, TierFullError) and e.value.errno == 28 and e.value.__cause__ is full
        handle.wait(tier="pfs", timeout=60)
        info = {c.step: c for c in h.checkpoints()}
        assert info[2].states["ssd"] == "failed" and info[2].errors["ssd"] is e.value
        assert info[1].tiers == ("host", "ssd", "pfs") and info[2].tiers == ("host", "pfs")
        assert ssd.calls["evict"] == 0 and ssd.inner.holds(CheckpointKey(1))
        del ssd.fail["write"]
        h.save(make(3), step=3).wait(timeout=60)
        assert "ssd" in {c.step: c for c in h.checkpoints()}[3].tiers
        assert same(h.restore(1, tier="ssd"), make(1))


@pytest.mark.parametrize("files", ["per_rank", "per_node"])
def test_a_pfs_data_file_keeps_blobs_in_place(tmp_path: Path, files: str) -> None:
    pfs = _with(PfsTier("pfs", tmp_path / "pfs", files=files), ZSTD)
    s = state(6)
    with Hierarchy([HostTier("host", 256 * MiB), pfs]) as h:
        h.save(s, step=8).durable["pfs"].result()
        assert unwrap_manifest(_manifest(pfs, 8))[1] is not None
        assert same(h.restore(8, tier="pfs"), s)


def test_an_object_store_tier_compresses_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The s3 tier (``auto`` unless told otherwise) stores a demoted copy compressed, passes its frames
    on to another tier that compresses, and restores from it (moto's in-process S3)."""
    moto = pytest.importorskip("moto")
    from tierckpt.tiers._s3client import S3Settings
    from tierckpt.tiers.s3 import S3Tier

    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="codec-copies")
        s3 = S3Tier("s3", "codec-copies", "run/", S3Settings(attempts=2, deadline_s=5), part_size=5 * MiB)
        below = _with(LocalTier("below", tmp_path / "below"), ZSTD)
        s = state(7)
        with Hierarchy([HostTier("host", 256 * MiB), s3, below], policy={"keep": {"s3": 3, "below": 3}}) as h:
            assert s3.compress == CompressConfig("auto")
            s3.adaptive = _SlowTier(CompressConfig("auto"), 2)  # moto is in-process: it looks fast
            h.save(s, step=8).durable["below"].result()  # the kinds measured on samples
            d = h.save(s, step=9).durable
            d["below"].result()
            at_s3 = _manifest(s3, 9)
            assert unwrap_manifest(at_s3)[1] is not None
            assert _manifest(below, 9) == at_s3  # passed through
            assert same(h.restore(9, tier="s3"), s)
            assert same(h.restore(9, tier="below"), s)


class _SlowTier(Adaptive):
    """An Adaptive that sees its tier's writes as taking at least 1 s per 5 MB."""

    def observe_tier(self, stored_bytes: int, busy_seconds: float) -> None:
        super().observe_tier(stored_bytes, max(busy_seconds, stored_bytes / 5e6))


@pytest.mark.parametrize("where", ["start", "middle", "last-byte"])
def test_a_flipped_stored_byte_is_damage_and_the_other_tier_is_read(tmp_path: Path, where: str) -> None:
    from tierckpt.errors import CorruptCheckpointError

    pfs = _with(PfsTier("pfs", tmp_path / "pfs"), ZSTD)
    s = state(8)
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd"), pfs]) as h:
        h.save(s, step=10).durable["pfs"].result()
        manifest = _manifest(pfs, 10)
        _, index = unwrap_manifest(manifest)
        assert index is not None
        pos = {"start": 0, "middle": index.held[0] // 2, "last-byte": index.held[0] - 1}[where]
        path = tmp_path / "pfs" / "step-000000000010" / "rank-00000" / "data.bin"
        with path.open("r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ 0x10]))
        with pytest.raises(CorruptCheckpointError):
            h.restore(10, tier="pfs")
        report = {t: e for _, t, e in h.verify(10)}
        assert report["ssd"] is None and isinstance(report["pfs"], CorruptCheckpointError)
        assert same(h.restore(10), s)  # from the other tier
